"""Switch 6, ColossalAI's `precision`: sets a model's parameter dtype and its fp8 linears.

Values: the names of `precision.POLICIES`: ColossalAI's "fp32", "bf16", "fp16", and
"tf32", "bf16-pure", "fp8" (ColossalAI's separate `use_fp8`). On the model it casts the
parameters to the policy's dtype and, for "fp8", swaps every eligible `nn.Linear` for an
`ops.fp8.Fp8Linear` (`switches.fp8`). Autocast, TF32 and loss scaling are per step
(`precision.step_context`), not on the model.
"""

from __future__ import annotations

import torch

from colossal_lab.ops import fp8
from colossal_lab.precision import policy
from colossal_lab.switches import fp8 as fp8_switch


def apply(model: torch.nn.Module, precision: str, extra: dict | None = None) -> int:
    """Switch 6 on `model`, in place: parameters stored in the policy's dtype and, for
    "fp8", every eligible `nn.Linear` swapped for an `Fp8Linear` sharing its weight
    (options in `extra`: fp8_scaling, fp8_history, fp8_skip, fp8_backend, ...). fp8
    linears from an earlier application are first turned back into plain ones (their
    amax histories restart). Autocast, TF32, loss scaling and the optimizer are
    applied per step: `step_context`, `loss_scaler`, `make_optimizer`. Returns how many
    linears are fp8."""
    pol, extra = policy(precision), extra or {}
    fp8_switch.revert(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != pol.param_dtype:
                p.data = p.data.to(pol.param_dtype)
    if not pol.fp8:
        return 0
    fp8.check_fp8_supported(next(model.parameters()).device)
    return len(fp8_switch.convert_to_fp8(model, fp8.Fp8Config.from_extra(extra),
                                  skip=tuple(extra.get("fp8_skip", ()))))
