"""pytest set-up shared by the unit tests (tests/) and the notebook checks (nbval, book/).

nbval starts one Jupyter kernel per notebook. Its ports are picked free and bound a moment
later, so two pytest-xdist workers starting kernels at the same instant can race for one
port, and the losing kernel dies before it answers (`Kernel died before replying to
kernel_info`): every cell of that notebook then errors without having run. Starting the
kernel is retried up to `KERNEL_STARTS` times; what the cells do is checked as before.
"""

from __future__ import annotations

import logging

KERNEL_STARTS = 3

try:
    from nbval import kernel as _nbval_kernel
except ImportError:  # the unit tests run without nbval too
    _nbval_kernel = None

if _nbval_kernel is not None:
    _start_once = _nbval_kernel.start_new_kernel

    def _start_new_kernel(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            try:
                return _start_once(*args, **kwargs)
            except RuntimeError:
                if attempt == KERNEL_STARTS:
                    raise
                logging.getLogger("nbval").warning(
                    "kernel died at start (attempt %d of %d): starting another",
                    attempt, KERNEL_STARTS)
        raise AssertionError("unreachable")

    _nbval_kernel.start_new_kernel = _start_new_kernel
