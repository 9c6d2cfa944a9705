"""The optimizer a precision asks for: torch's AdamW, ours, or AdamW over fp32 masters."""

from __future__ import annotations

import torch

from colossal_lab.kernels.adamw import FusedAdamW, adamw_ref
from colossal_lab.precision import (
    adamw_moments,
    is_low_precision,
    of,
    optimizer_backend,
    policy,
)


def moments_of(optimizer) -> str:
    """The dtype AdamW's moments are held in by `optimizer`: "fp32", "bf16" (or our
    AdamW's "bf16-nearest"). Torch's AdamW keeps them in its parameters' dtype."""
    if hasattr(optimizer, "moments"):
        return optimizer.moments
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(optimizer, torch.optim.AdamW) and is_low_precision(params):
        return "bf16"
    return "fp32"


def make_optimizer(model: torch.nn.Module, lr: float = 3e-4, weight_decay: float = 0.1):
    """AdamW for `model`'s switches: ours, `FusedAdamW` (clipping folded in, fp32 masters
    for low-precision parameters, moments in `extra["adamw_moments"]`'s dtype), when
    `enable_fused_optimizer` picks "triton"; otherwise `MasterAdamW` (fp32 masters and
    moments) when the parameters are stored in low precision, else torch's AdamW, the
    fused CUDA kernel when the parameters are on a GPU. Build it after `apply_switches`:
    fusing projections makes new Parameters. Sharded (FSDP2) parameters always take
    torch's AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    model = getattr(model, "_orig_mod", model)
    switches = getattr(model, "switches", None)
    sharded = any(type(p.data).__name__ == "DTensor" for p in params)
    fused = switches is not None and not sharded and optimizer_backend(
        switches.enable_fused_optimizer, params[0].device) == "triton"
    kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if fused:
        return FusedAdamW(params, **kw, moments=adamw_moments(switches))
    if switches is not None and (switches.extra or {}).get("adamw_masters") is False:
        # low-precision parameters updated in place, moments in their dtype: the
        # rounding fp32 masters exist to avoid (a loss check's harmful control)
        return torch.optim.AdamW(params, **kw, fused=params[0].is_cuda or None)
    if policy(of(model)).master_weights or is_low_precision(params):
        return MasterAdamW(params, **kw)
    return torch.optim.AdamW(params, **kw, fused=params[0].is_cuda or None)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW for low-precision (bf16/fp16) parameters with fp32 master weights.

    State per parameter: `master` (fp32 copy, made at the first step), `exp_avg`,
    `exp_avg_sq` (fp32) and `step`. A step converts the low-precision gradients to fp32
    a chunk at a time (at most `chunk_bytes` of fp32 gradients exist at once: a full
    fp32 copy of LLaMA-7B's gradients would be 27 GB), runs PyTorch's fused AdamW kernel
    (`torch._fused_adamw_`, the kernel behind `AdamW(fused=True)`) on the fp32 masters,
    and writes the masters back into the parameters, rounded: about 40 bytes moved per
    parameter. One Triton kernel reading the bf16 gradient and writing the bf16 parameter
    in the same pass would move 28; that matters most at small batches, where the
    optimizer is a larger share of the step (chapter 04's full LLaMA-7B at batch 1).

    Supports `found_inf` (skip on overflow, set by `DynamicLossScaler`) like the fused
    torch optimizers, `zero_grad`, `state_dict` / `load_state_dict` (masters stay fp32).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, chunk_bytes: int = 256 << 20):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.chunk_bytes = chunk_bytes
        self._step_supports_amp_scaling = True

    def master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master weights of parameter `p` (None before the first step), as
        `FusedAdamW.master` gives them."""
        return self.state.get(p, {}).get("master")

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["master"] = p.detach().float().clone()
            st["exp_avg"] = torch.zeros_like(st["master"])
            st["exp_avg_sq"] = torch.zeros_like(st["master"])
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            chunk, nbytes = [], 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                chunk.append(p)
                nbytes += p.numel() * 4
                if nbytes >= self.chunk_bytes:
                    self._update(chunk, group, found_inf)
                    chunk, nbytes = [], 0
            if chunk:
                self._update(chunk, group, found_inf)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict, found_inf) -> None:
        states = [self._state(p) for p in params]
        masters = [s["master"] for s in states]
        grads = [p.grad.float() for p in params]  # this chunk's fp32 gradients only
        avgs, sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        if hasattr(torch, "_fused_adamw_"):
            if found_inf is not None:
                found_inf = found_inf.to(masters[0].device)
            torch._fused_adamw_(masters, grads, avgs, sqs, [], steps, lr=group["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False,
                                grad_scale=None, found_inf=found_inf)
        else:  # old torch: the reference math (skips need one sync here)
            if found_inf is None or found_inf.item() == 0.0:
                for m, g, a, s, t in zip(masters, grads, avgs, sqs, steps):
                    adamw_ref(m, g, a, s, int(t.item()), lr=group["lr"], beta1=beta1,
                              beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"])
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))
        torch._foreach_copy_([p.detach() for p in params], masters)  # round to bf16
        del grads

    def load_state_dict(self, state_dict: dict) -> None:
        """Like `Optimizer.load_state_dict`, which casts floating state to the parameter
        dtype; that would round the fp32 masters to bf16, so they are restored."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(v):
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
