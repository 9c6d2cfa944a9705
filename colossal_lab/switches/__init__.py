"""One module per throughput switch: reference, dispatch, autograd wiring, and the
`apply(model, value)` that sets it on a model in place; `apply_switches`
(`switches.apply`) applies them all in their fixed order.

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

_LAZY = {"backends_in_use": "colossal_lab.switches.resolved",
         "apply_switches": "colossal_lab.switches.apply"}
"""Loaded on use: `backends_in_use` inspects the model, which imports the switches, and
`apply_switches` imports every switch; importing one switch imports neither."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
