"""Switch 6's precision policies: which number formats a step computes and stores in.

    precision   parameters   matmuls        gradients    optimizer state     loss scaling
    fp32        fp32         fp32           fp32         fp32 m, v           no
    tf32        fp32         TF32 (fp32     fp32         fp32 m, v           no
                             range, 10-bit mantissa, on the tensor cores)
    bf16        fp32         bf16 autocast  fp32         fp32 m, v           no
    bf16-pure   bf16         bf16           bf16         fp32 master, m, v   no
    fp16        fp32         fp16 autocast  fp32         fp32 m, v           dynamic
    fp8         fp32         fp8 linears,   fp32         fp32 m, v           no (per-tensor
                             bf16 the rest                                    fp8 scales)
    fp8-pure    bf16         fp8 linears,   bf16         fp32 master, m, v   no (per-tensor
                             bf16 the rest                                    fp8 scales)

**Why bf16 needs no loss scaling and fp16 does** (Micikevicius et al., "Mixed Precision
Training", 2018). bf16 keeps fp32's 8 exponent bits; fp16 has 5 (largest 65504, smallest
subnormal 6e-8), so small gradients flush to zero. Multiplying the loss by S shifts every
gradient up by log2(S) binades; `DynamicLossScaler` halves S (and skips the step) on an
inf/NaN gradient and doubles it after `growth_interval` clean steps, all on the device.

**Master weights.** An update lr·g is often below half an ulp of a bf16 weight (2^-8
relative) and rounds away. "bf16" autocast keeps fp32 parameters and casts them per
matmul; "bf16-pure" stores the model in bf16 and keeps fp32 masters in the optimizer
only (`training.optimizer.MasterAdamW`, or our `FusedAdamW`). "fp8-pure" is "bf16-pure"
with fp8 linears: the fp8 casts read 2-byte weights instead of 4, no fp32 weight is cast
to bf16 every step, and the optimizer moves a bf16 parameter with its split master.

`POLICIES` is the table as data; `step_context` gives a step's autocast and TF32 mode,
`loss_scaler` the fp16 scaler, `optimizer_backend` and `adamw_moments` the optimizer's
options, `of(model)` what a model was given. `switches.precision` applies a precision to
a model; fp8 linears are `ops.fp8`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from colossal_lab.config import PRECISIONS
from colossal_lab.kernels.adamw import FusedAdamW
from colossal_lab.ops import kernel_switch


@dataclass(frozen=True)
class Policy:
    """Everything a precision decides; the rest of the library asks `policy(name)`."""

    name: str
    param_dtype: torch.dtype
    """What the parameters (and so their gradients) are stored in."""
    autocast_dtype: torch.dtype | None
    """The autocast dtype of forward and loss (None: no autocast)."""
    tf32: bool
    """fp32 matmuls run on the tensor cores in TF32 (`matmul_mode`)."""
    loss_scaling: bool
    """Dynamic loss scaling (`DynamicLossScaler`)."""
    fp8: bool
    """Eligible linears become `fp8.Fp8Linear` (options from `Switches.extra`)."""
    master_weights: bool
    """The optimizer keeps fp32 master weights (`MasterAdamW`): low-precision params."""


POLICIES = {p.name: p for p in (
    Policy("fp32", torch.float32, None, False, False, False, False),
    Policy("tf32", torch.float32, None, True, False, False, False),
    Policy("bf16", torch.float32, torch.bfloat16, False, False, False, False),
    Policy("bf16-pure", torch.bfloat16, None, False, False, False, True),
    Policy("fp16", torch.float32, torch.float16, False, True, False, False),
    Policy("fp8", torch.float32, torch.bfloat16, False, False, True, False),
    Policy("fp8-pure", torch.bfloat16, None, False, False, True, True),
)}
"""The table of the module docstring, as data (fp8 linears run in a bf16 autocast). MFU
is reported against the bf16 peak for every precision, so that a faster format shows
as a higher MFU."""

AUTOCAST_DTYPE = {name: p.autocast_dtype for name, p in POLICIES.items()}
"""The autocast dtype of each precision."""


def policy(precision: str) -> Policy:
    """The `Policy` of a precision name; a clear error for an unknown one."""
    try:
        return POLICIES[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}") from None


@contextlib.contextmanager
def step_context(precision: str, device: torch.device | str):
    """Around a forward and its loss: the policy's TF32 matmul mode and autocast."""
    with matmul_mode(precision), autocast(precision, device):
        yield


def loss_scaler(precision: str) -> DynamicLossScaler | None:
    """A fresh `DynamicLossScaler` when the policy scales the loss (fp16), else None."""
    return DynamicLossScaler() if policy(precision).loss_scaling else None


OPTIMIZER_BACKENDS = ("torch", "triton")
"""`Switches.enable_fused_optimizer` values: "torch" = clipping, then torch's AdamW or
`MasterAdamW`; "triton" = `FusedAdamW` (ours)."""


def optimizer_backend(value, device) -> str:
    """The optimizer `Switches.enable_fused_optimizer = value` picks on `device` (the
    rule of `kernel_switch.resolve`: True = "triton" on a GPU, "torch" elsewhere)."""
    return kernel_switch.resolve(value, device, names=OPTIMIZER_BACKENDS,
                                 field="enable_fused_optimizer", what="AdamW",
                                 off="torch", cpu="torch")


def adamw_moments(switches) -> str:
    """`extra["adamw_moments"]` of `switches` (None: "fp32"), checked: "fp32" or "bf16".
    "bf16" is an option of our AdamW (`FusedAdamW(moments=...)`, a change of numerics):
    it applies where `enable_fused_optimizer` picks ours ("triton"); where it picks
    torch's (True on a CPU, or sharded parameters), the moments stay fp32, as
    `moments_of` on the optimizer built records."""
    extra = getattr(switches, "extra", None) or {}
    value = extra.get("adamw_moments", "fp32")
    if value not in FusedAdamW.MOMENTS:
        raise ValueError(f"extra['adamw_moments']={value!r}; choose one of "
                         f"{tuple(FusedAdamW.MOMENTS)}")
    return value


@contextlib.contextmanager
def matmul_mode(precision: str):
    """Around a whole step (forward, backward, optimizer): "tf32" lets fp32 matmuls and
    convolutions run on the tensor cores in TF32; PyTorch's default, which "fp32"
    keeps, is full fp32 (on an H100/H200 about 8x slower). The flags are restored."""
    if not policy(precision).tf32:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def autocast(precision: str, device: torch.device | str):
    """The autocast context for `precision` (fp32 and bf16-pure need none)."""
    dtype = policy(precision).autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


# --------------------------------------------------------------------- loss scaling


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training, without host synchronisation.

    Per step::

        scaler.scale(loss).backward()     # gradients · S
        scaler.unscale_(optimizer)        # gradients / S, found_inf = any inf/NaN
        clip_grad_norm_(...)              # on the true gradients
        scaler.step(optimizer)            # skipped when found_inf
        scaler.update()                   # S ·= backoff on overflow, ·= growth after
                                          # growth_interval clean steps
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.init_scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._scale: torch.Tensor | None = None  # 0-dim fp32 on the loss's device
        self._growth: torch.Tensor | None = None  # 0-dim int32: clean steps in a row
        self._found_inf: torch.Tensor | None = None
        self._init_growth = 0  # clean steps in a row to start from (a resumed run's)
        self.skipped_steps = 0  # counted only where a sync happens anyway (non-fused)

    def _lazy_init(self, device: torch.device) -> None:
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32,
                                     device=device)
            self._growth = torch.full((), self._init_growth, dtype=torch.int32,
                                      device=device)

    @property
    def scale_value(self) -> float:
        """S as a Python float (synchronises; for display)."""
        return self.init_scale if self._scale is None else self._scale.item()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self._lazy_init(loss.device)
        return loss * self._scale.to(loss.dtype)

    def unscale_(self, optimizer_or_params) -> torch.Tensor:
        """Divide every gradient by S in place; returns found_inf (0-dim fp32, 1.0 when
        some gradient was inf or NaN)."""
        if self._scale is None:
            raise RuntimeError("unscale_ before scale(loss): nothing was scaled")
        grads: dict[tuple, list[torch.Tensor]] = {}
        for p in _params(optimizer_or_params):
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        inv = self._scale.double().reciprocal().float()
        for (device, _), gs in grads.items():
            f = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(device))
            found += f.to(found.device)
        self._found_inf = found.clamp_(max=1.0)
        return self._found_inf

    def step(self, optimizer) -> None:
        """`optimizer.step()` unless a gradient overflowed. Fused optimizers
        (`_step_supports_amp_scaling`) skip on device from `found_inf`; others need
        one host sync to decide."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, self._found_inf
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif self._found_inf.item() == 0.0:
            optimizer.step()
        else:
            self.skipped_steps += 1

    def update(self) -> None:
        """Back off on overflow, grow after `growth_interval` clean steps (on device)."""
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_/step: no overflow check ran")
        torch._amp_update_scale_(self._scale, self._growth, self._found_inf,
                                 self.growth_factor, self.backoff_factor,
                                 self.growth_interval)
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "growth_tracker":
                0 if self._growth is None else int(self._growth.item()),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        """Restore S and the growth count; the tensors are made on the next loss's
        device (a checkpoint written on one device resumes on another)."""
        self.init_scale = state["scale"]
        self.growth_factor, self.backoff_factor = state["growth_factor"], \
            state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self._init_growth = state["growth_tracker"]
        self._scale = self._growth = self._found_inf = None


# -------------------------------------------------------------- master-weight AdamW


def is_low_precision(model_or_params) -> bool:
    """True when the trainable parameters are stored in bf16 or fp16 (bf16-pure)."""
    params = model_or_params.parameters() if hasattr(model_or_params, "parameters") \
        else model_or_params
    return any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
               for p in params)


def of(model: torch.nn.Module) -> str:
    """The precision applied to `model` (`apply_switches`), "fp32" for a plain one."""
    model = getattr(model, "_orig_mod", model)  # through torch.compile's wrapper
    switches = getattr(model, "switches", None)
    return "fp32" if switches is None else switches.precision


def _params(optimizer_or_params) -> Iterable[torch.Tensor]:
    if isinstance(optimizer_or_params, torch.optim.Optimizer):
        return [p for g in optimizer_or_params.param_groups for p in g["params"]]
    return list(optimizer_or_params)
