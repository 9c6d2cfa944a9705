"""Backends that cannot run here: one warning and the next best, or an error.

A backend asked for by name that cannot run here (a library missing, no GPU, a shape the
kernel does not take) goes through `fallback`: one warning, then the next best backend.
With ``COLOSSAL_LAB_STRICT=1`` (set for the whole test session and in the chapters) it
raises `BackendUnavailable` instead, so that no measurement silently times another kernel
than the one its label names. This module imports nothing from the package: the kernels,
the ops and the switches all use it.
"""

from __future__ import annotations

import os
import warnings

STRICT_ENV = "COLOSSAL_LAB_STRICT"
"""Environment variable: "1" turns every fallback into a `BackendUnavailable` error."""

WARNED: set[str] = set()
"""Messages `warn_once` has shown in this process (clear it to see them again)."""


class BackendUnavailable(RuntimeError):
    """A backend requested by name cannot run here and strict mode forbids a fallback."""


def warn_once(msg: str, stacklevel: int = 4) -> None:
    """A fallback or a kept-as-is layer is worth one warning per process, not one per
    forward pass."""
    if msg not in WARNED:
        WARNED.add(msg)
        warnings.warn(msg, stacklevel=stacklevel)


def strict() -> bool:
    """Is strict mode on (``COLOSSAL_LAB_STRICT`` set to anything but "" or "0")?"""
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def fallback(why: str, instead: str, stacklevel: int = 5) -> None:
    """A requested backend cannot run (`why` names it and says why) and `instead` will:
    warn once, or raise `BackendUnavailable` in strict mode. Every dispatcher calls
    this, never `warnings.warn` itself."""
    if strict():
        raise BackendUnavailable(f"{why}; {STRICT_ENV}=1 refuses the fallback to "
                                 f"{instead!r} (choose a backend that runs here, or "
                                 f"unset {STRICT_ENV})")
    warn_once(f"{why}; using {instead!r}", stacklevel)
