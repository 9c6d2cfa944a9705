"""One module per throughput switch: reference, dispatch, autograd wiring, module."""

import warnings

WARNED: set[str] = set()
"""Messages `warn_once` has shown in this process (clear it to see them again)."""


def warn_once(msg: str, stacklevel: int = 4) -> None:
    """A fallback or a kept-as-is layer is worth one warning per process, not one per
    forward pass."""
    if msg not in WARNED:
        WARNED.add(msg)
        warnings.warn(msg, stacklevel=stacklevel)
