"""One module per throughput switch: reference, dispatch, autograd wiring, module.

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


def __getattr__(name: str):
    # `backends_in_use` inspects the model, which imports the switches: loaded on use,
    # so that importing a switch never imports the model back
    if name == "backends_in_use":
        from colossal_lab.switches.resolved import backends_in_use

        return backends_in_use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
