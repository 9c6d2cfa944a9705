"""What autocast is doing now, for autograd Functions that run their own GEMMs.

A step's autocast is set by `colossal_lab.precision.step_context`; a few Functions (fp8
linears, the fused head + loss) read the dtype it chose and turn autocast off around
their own matmuls, so that it does not cast their operands a second time. A leaf module.
"""

from __future__ import annotations

import torch


def current_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force on `device_type`, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def off(device_type: str):
    """A region where autocast does not touch this Function's own matmuls."""
    return torch.autocast(device_type, enabled=False)
