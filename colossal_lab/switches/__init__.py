"""The layer that applies switches to a model: one module per switch, each with `apply`.

Each module's `apply(model, value)` sets its switch on a model in place; `apply_switches`
(`switches.apply`) applies them all in their fixed order. The ops themselves (reference,
dispatch, autograd) are in `colossal_lab.ops`.

A backend asked for by name that cannot run here goes through `fallback` (one warning,
or `BackendUnavailable` under ``COLOSSAL_LAB_STRICT=1``; see `colossal_lab.fallback`,
re-exported here). `backends_in_use(model)` (`switches.resolved`) says what a model's
switches resolve to.
"""

from __future__ import annotations

from colossal_lab.fallback import (  # noqa: F401  (re-exported)
    STRICT_ENV,
    WARNED,
    BackendUnavailable,
    fallback,
    strict,
    warn_once,
)
from colossal_lab.switches.apply import apply_switches  # noqa: E402,F401  (re-exported)
from colossal_lab.switches.resolved import backends_in_use  # noqa: E402,F401  (re-exported)
