"""AdamW in one Triton pass per parameter, with the gradient clipping folded in.

**Why.** The optimizer step of a bf16 run with fp32 master weights is pure memory
traffic, and the unfused step moves more of it than the math needs. Per parameter, for
bf16 parameters and gradients (e = 2 bytes) with fp32 masters and moments::

                                         read                  write        bytes
    clip_grad_norm_: norm of g           g                                  2
                     g ·= coef           g                     g            4
    MasterAdamW: g -> fp32 copy          g                     g32          6
                 torch._fused_adamw_     g32, master, m, v     master, m, v 28
                 master -> bf16 param    master                param        6
                                                                     total 46
    this kernel (after one norm pass)    g, master, m, v       master, m, v,
                                                               param        28 + 2
      with the master split               g, param, lo, m, v    param, lo,
      (`split_master`, bf16)                                    m, v         26 + 2
      and bf16 moments (`moments="bf16"`)  m, v in bf16          m, v in bf16 18 + 2

For llama-7b-8l (1.88 G parameters) that is 86 GB against 53 GB a step. The split
master keeps the fp32 master as the bf16 parameter (its high half, rounded to nearest)
plus an int16 low half: bit for bit the same master, 2 bytes a parameter less. With fp32
parameters the kernel moves torch's fused AdamW's 28 bytes, minus the clipping's extra
passes. bf16 moments (stochastically rounded, `_round_stochastic`; a change of numerics)
take 8 bytes more off either.

**Math** (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019; the
update of `torch.optim.AdamW`), per element, t the step, c the clipping coefficient::

    g  = c · grad,                   c = min(1, max_norm / (‖grad‖₂ + 1e-6))
    w ← w · (1 − lr · λ)
    m ← m + (1 − β1) · (g − m)
    v ← β2 · v + (1 − β2) · g²
    w ← w − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

c is computed on the device from one pass of block sums of squares (`sum_of_squares`;
no host synchronisation) and read by every program; so is `found_inf` (fp16 loss scaling: a
step with an inf/NaN gradient changes nothing) and the step count t, so a skipped step
needs no host round trip either.

Three layers, as every kernel here: `_adamw_kernel` → `adamw_step` (launcher over a
list of parameters) → `FusedAdamW` (the `torch.optim.Optimizer`); `adamw_ref` is the
reference the tests compare against.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from colossal_lab.kernels._norm_common import _to_dtype
from colossal_lab.kernels.launch import launch

BLOCK = 2048
"""Elements per program: 8 per thread at 8 warps (16-byte bf16 loads, two fp32 ones)."""
NUM_WARPS = 8


@triton.jit
def _hash32(x):
    """A 32-bit integer hash (uint32 in, uint32 out; the "lowbias32" constants of
    C. Wellons' hash-prospector): each output bit flips with probability ~1/2 for any
    change of the input. About 8 integer operations an element, against ~100 for the
    Philox rounds of `tl.randint`: on the H200 the bf16-moment update (with its norm
    pass) is about 6% faster with it than with Philox."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _round_stochastic(x, r16):
    """fp32 x to bf16 bits (int16), rounded up in magnitude with probability equal to
    the dropped fraction: r16 uniform in [0, 2^16) added below the kept 16 bits, then
    cut (Gupta et al. 2015): unbiased, E[round(x)] = x, where nearest rounding would
    drop every increment smaller than half a bf16 ulp."""
    return ((x.to(tl.int32, bitcast=True) + r16) >> 16).to(tl.int16)


@triton.jit(do_not_specialize=["seed"])  # 1 would become a constexpr int
def _adamw_kernel(
    P,  # the parameter, written: fp32 (updated in place) or bf16/fp16 (masters in W);
    #     with MASTER_LO, a bf16 parameter's bits as int16: the master's high half
    G,  # its gradient, P's dtype (bf16 when MASTER_LO)
    W,  # fp32 master weights (HAS_MASTER), or with MASTER_LO their low halves (int16)
    M,  # fp32 first moment, or with MOMENTS_BF16 its bf16 bits as int16
    V,  # fp32 second moment, likewise
    STEP,  # fp32 scalar: this step's t (already incremented)
    COEF,  # fp32 scalar: the gradient's clipping (and unscaling) factor c
    FOUND_INF,  # fp32 scalar: nonzero = skip this step
    n,  # elements
    lr, beta1, beta2, eps, weight_decay,
    log2_beta1, log2_beta2,  # log2 of the betas: β^t = 2^(t·log2 β) on the device
    seed,  # this parameter's stream of random bits for the moments' rounding
    HAS_MASTER: tl.constexpr,
    MASTER_LO: tl.constexpr,  # the master split: bf16 parameter (high) + int16 (low)
    MOMENTS_BF16: tl.constexpr,  # moments held in bf16
    STOCHASTIC: tl.constexpr,  # bf16 moments rounded stochastically (else to nearest)
    HAS_COEF: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: tensors of > 2^31 elements
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FOUND_INF:  # a skipped step loads and stores nothing (one cached address)
        mask = mask & (tl.load(FOUND_INF + offs * 0) == 0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(COEF)
    if MASTER_LO:  # fp32 bits = (bf16 bits << 16) + low half, the low half signed
        hi = tl.load(P + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(W + offs, mask=mask, other=0).to(tl.int32)
        w = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    elif HAS_MASTER:
        w = tl.load(W + offs, mask=mask, other=0.0)
    else:
        w = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    if MOMENTS_BF16:  # bf16 bits, widened: fp32 with 16 zero low bits
        m = (tl.load(M + offs, mask=mask, other=0).to(tl.int32) << 16).to(
            tl.float32, bitcast=True)
        v = (tl.load(V + offs, mask=mask, other=0).to(tl.int32) << 16).to(
            tl.float32, bitcast=True)
    else:
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
    t = tl.load(STEP)
    bias1 = 1.0 - tl.exp2(t * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(t * log2_beta2))

    w = w * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    w = w - (lr / bias1) * (m / denom)

    if MOMENTS_BF16:  # 16 random bits each, keyed by (parameter, step, element)
        key = _hash32(seed.to(tl.uint32) * 0x9E3779B9 + t.to(tl.uint32))
        bits = _hash32((offs & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
                       + (offs >> 32).to(tl.uint32) + key)
        r_m = (bits & 0xFFFF).to(tl.int32)
        r_v = (bits >> 16).to(tl.int32)
        if not STOCHASTIC:  # half an ulp added, then cut: nearest, ties away from zero
            r_m = r_m * 0 + 0x8000
            r_v = r_v * 0 + 0x8000
        tl.store(M + offs, _round_stochastic(m, r_m), mask=mask)
        tl.store(V + offs, _round_stochastic(v, r_v), mask=mask)
    else:
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
    if MASTER_LO:  # the nearest bf16 (ties away from zero) and what it leaves over
        bits = w.to(tl.int32, bitcast=True)
        hi = (bits + 0x8000) >> 16
        tl.store(W + offs, (bits - (hi << 16)).to(tl.int16), mask=mask)
        tl.store(P + offs, hi.to(tl.int16), mask=mask)
    else:
        if HAS_MASTER:
            tl.store(W + offs, w, mask=mask)
        tl.store(P + offs, _to_dtype(w, P.dtype.element_ty), mask=mask)  # nearest even


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor],
               masters: list[torch.Tensor] | None, exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float,
               coef: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None,
               seeds: list[int] | None = None, stochastic: bool = True) -> None:
    """One AdamW update of every parameter in place, one launch each.

    params: the model's parameters (any shape, contiguous), fp32 or bf16/fp16.
    grads: their gradients, same dtypes and shapes.
    masters: fp32 copies of low-precision params (updated, then rounded into params),
        or for bf16 params their int16 low halves (`split_master`: the param is the
        master's high half), or None when params are fp32 themselves.
    exp_avgs, exp_avg_sqs: the moments, shaped like params: fp32, or both bf16 (kept
        by stochastic rounding, `_round_stochastic`).
    steps: 0-dim fp32 tensors on the device, each parameter's step count t for this
        update (already incremented): the kernel computes the bias corrections from it.
    coef: 0-dim fp32 tensor multiplying every gradient (clipping, unscaling), or None.
    found_inf: 0-dim fp32 tensor, nonzero = leave everything as it is, or None.
    seeds: one integer per parameter keying its random bits (bf16 moments; with the
        step count, so a rerun or a resumed run rounds the same way); default its index.
    stochastic: bf16 moments rounded stochastically (the default); False rounds them to
        the nearest bf16, the biased rounding the stochastic one exists to avoid.
    """
    if not 0.0 < beta1 < 1.0 or not 0.0 < beta2 < 1.0:
        raise ValueError(f"betas=({beta1}, {beta2}) must lie strictly between 0 and 1")
    if not steps or len(steps) != len(params):
        raise ValueError(f"{len(params)} parameters but {len(steps)} step counts")
    dummy = steps[0]  # an fp32 pointer for the arguments a specialisation never reads
    for i, (p, g) in enumerate(zip(params, grads)):
        if not (p.is_contiguous() and g.is_contiguous()):
            raise ValueError(f"parameter {i} or its gradient is not contiguous")
        if g.dtype != p.dtype or g.shape != p.shape:
            raise ValueError(f"parameter {i}: gradient {g.dtype} {tuple(g.shape)} against "
                             f"parameter {p.dtype} {tuple(p.shape)}")
        master = masters[i] if masters is not None else None
        if master is None and p.dtype != torch.float32:
            raise ValueError(f"parameter {i} is {p.dtype}: low-precision parameters need "
                             "fp32 masters")
        lo = master is not None and master.dtype == torch.int16
        if lo and (p.dtype != torch.bfloat16 or master.shape != p.shape):
            raise ValueError(f"parameter {i}: an int16 master low half needs a bf16 "
                             f"parameter of its shape, not {p.dtype} {tuple(p.shape)}")
        m, v = exp_avgs[i], exp_avg_sqs[i]
        half = m.dtype == torch.bfloat16
        if {m.dtype, v.dtype} not in ({torch.float32}, {torch.bfloat16}) or \
                m.shape != p.shape or v.shape != p.shape:
            raise ValueError(f"parameter {i}: moments {m.dtype} {tuple(m.shape)} and "
                             f"{v.dtype} {tuple(v.shape)}; both fp32 or both bf16, shaped "
                             f"like the parameter {tuple(p.shape)}")
        n = p.numel()
        if n == 0:
            continue
        launch(_adamw_kernel, (triton.cdiv(n, BLOCK),),
               (p.view(torch.int16) if lo else p, g, dummy if master is None else master,
                m.view(torch.int16) if half else m, v.view(torch.int16) if half else v,
                steps[i],
                dummy if coef is None else coef, dummy if found_inf is None else found_inf,
                n, lr, beta1, beta2, eps, weight_decay, math.log2(beta1),
                math.log2(beta2), i if seeds is None else seeds[i]),
               {"HAS_MASTER": master is not None, "MASTER_LO": lo, "MOMENTS_BF16": half,
                "STOCHASTIC": stochastic, "HAS_COEF": coef is not None,
                "HAS_FOUND_INF": found_inf is not None, "BLOCK": BLOCK},
               num_warps=NUM_WARPS)


SUMSQ_BLOCK = 8192
"""Elements per program of the norm pass: its partial sums are 1/8192 of the gradient."""


@triton.jit
def _sum_squares_kernel(X, PARTIAL, n, BLOCK: tl.constexpr):
    """PARTIAL[program] = the sum of x² over the program's BLOCK elements, in fp32."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(PARTIAL + pid, tl.sum(x * x, axis=0))


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ x² over every element of every tensor (contiguous, one device), a 0-dim fp32
    tensor: one launch per tensor writes its block sums into one shared buffer, then one
    sum over the buffer. Deterministic (no atomics); on the H200, over llama-7b-8l's bf16
    gradients, about 30% faster than `torch._foreach_norm` with fp32 results. The
    launches go through `launch.launch`: per tensor, Triton's own launch path takes
    more host time than the kernel takes GPU time, and would leave the GPU waiting."""
    counts = [triton.cdiv(t.numel(), SUMSQ_BLOCK) for t in tensors]
    if not sum(counts):
        return torch.zeros((), device=tensors[0].device, dtype=torch.float32)
    partial = torch.empty(sum(counts), device=tensors[0].device, dtype=torch.float32)
    at = 0
    for t, c in zip(tensors, counts):
        if c:
            if not t.is_contiguous():
                raise ValueError(f"a {tuple(t.shape)} gradient is not contiguous")
            launch(_sum_squares_kernel, (c,), (t, partial[at:], t.numel()),
                   {"BLOCK": SUMSQ_BLOCK}, num_warps=NUM_WARPS)
        at += c
    return partial.sum()


def clip_coefficient(grads: list[torch.Tensor], max_norm: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖grads‖₂ as a 0-dim fp32 tensor, c = min(1, max_norm / (‖grads‖₂ + 1e-6))), on
    the device, without a host synchronisation: what `torch.nn.utils.clip_grad_norm_`
    computes before it scales every gradient (here the scaling is left to the kernel).
    The squares are summed in fp32 (`sum_of_squares`), also for bf16 gradients."""
    if not grads:
        raise ValueError("no gradients to clip")
    device = grads[0].device
    sums = [sum_of_squares(on_device).to(device)
            for on_device in _by_device(grads).values()]
    total = torch.stack(sums).sum().sqrt()
    return total, (max_norm / (total + 1e-6)).clamp(max=1.0)


def _by_device(tensors: list[torch.Tensor]) -> dict:
    out: dict = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


# ----------------------------------------------------------------------------- reference


def adamw_ref(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, step: int, *, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of fp32 (or fp64) tensors in place, the math of `torch.optim.AdamW`:
    decoupled decay, bias-corrected moments (the module docstring, with c = 1)."""
    g = grad.to(param.dtype)  # fp32 (or fp64 in the tests) math on any gradient
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)


# ------------------------------------------------------------------------- split masters


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master as (bf16 high half, int16 low half), `join_master` exact.

    The high half is the master rounded to the nearest bf16 (ties away from zero: the
    bit pattern plus 2^15, cut), so a bf16 parameter can hold it as it is; the low half
    is what that rounding left over, bits(master) − bits(high) << 16, which lies in
    [−2^15, 2^15) and so fits an int16. Together they are the fp32 master bit for bit:
    2 bytes of state a parameter instead of 4, and the update reads and writes 26 bytes
    a parameter instead of 28 (`FusedAdamW`)."""
    bits = master.detach().float().contiguous().view(torch.int32)
    hi = (bits + 0x8000) >> 16
    return hi.to(torch.int16).view(torch.bfloat16), (bits - (hi << 16)).to(torch.int16)


def join_master(param: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master from a bf16 parameter (its high half) and its int16 low half."""
    hi = param.detach().contiguous().view(torch.int16).to(torch.int32)
    return ((hi << 16) + lo.to(torch.int32)).view(torch.float32)


# ----------------------------------------------------------------------------- optimizer


class FusedAdamW(torch.optim.Optimizer):
    """AdamW in one Triton pass per parameter (`adamw_step`), for fp32 parameters or for
    bf16/fp16 ones with fp32 master weights (made at the first step), with gradient
    clipping folded into the pass.

    Per step, instead of `clip_grad_norm_(params, max_norm); opt.step()`::

        opt.clip_grad_norm_(max_norm)   # one norm pass; returns ‖g‖ (a device tensor)
        opt.step()                      # the update, reading g · c

    State per parameter: `exp_avg`, `exp_avg_sq` (fp32), `step` (a 0-dim fp32 tensor,
    as torch's fused AdamW keeps it) and for low-precision parameters the fp32 master:
    for bf16 ones split (`split_master`), the parameter itself holding its high half
    and `master_lo` (int16) the rest, so no fp32 copy is kept and the update moves 26
    bytes a parameter; `master` (fp32) for fp16 ones. `master(p)` gives the fp32 master
    either way, and `state_dict` / `load_state_dict` carry it as `master` in fp32 (the
    checkpoint format of `MasterAdamW`). Supports `found_inf` (`DynamicLossScaler` sets
    it: an overflowing step is skipped on the device).

    `moments="bf16"` holds both moments in bf16, stochastically rounded on every store
    (random bits keyed by parameter, step and element: a resumed run rounds as the
    uninterrupted one): 4 bytes of state and of traffic a parameter less each, and a
    change of numerics, unlike everything above. The DeepSeek-V3 report (arXiv:2412.19437,
    §3.3.3) trains with AdamW's moments in BF16. Nearest rounding would not do: with
    β2 = 0.999 the second moment's step-to-step change is 0.1%, under half a bf16 ulp
    (0.2%), so v could neither grow nor decay.
    """

    MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16,
               "bf16-nearest": torch.bfloat16}
    """Moment dtypes by name. "bf16-nearest" rounds them to the nearest bf16 instead:
    not an option to train with, the harmful change a loss check must be able to see."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, moments: str = "fp32"):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if moments not in self.MOMENTS:
            raise ValueError(f"moments={moments!r}; choose one of {tuple(self.MOMENTS)}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.moments, self._moments = moments, self.MOMENTS[moments]
        self._seeds = {p: i for i, p in enumerate(
            p for g in self.param_groups for p in g["params"])}
        self._step_supports_amp_scaling = True
        self._coef: torch.Tensor | None = None

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            if p.dtype == torch.bfloat16:  # the master is the parameter, exactly
                st["master_lo"] = torch.zeros_like(p, dtype=torch.int16)
            elif p.dtype != torch.float32:
                st["master"] = p.detach().float().clone()
            st["exp_avg"] = torch.zeros_like(p, dtype=self._moments)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self._moments)
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return st

    @torch.no_grad()
    def init_state(self, params=None) -> None:
        """Allocate the states of `params` (default: every parameter with a gradient) now,
        on the current stream, where the first `step` would: the fp32 master's low half
        (a bf16 parameter: 2 bytes) or an fp32 copy (fp16: 4 bytes), and the two moments
        (4 + 4 bytes, or 2 + 2 in bf16). An update run on another stream
        (`switches.deferred_adamw`) would otherwise allocate them there, from a pool that
        only that stream reuses."""
        for p in self._with_grads() if params is None else params:
            self._state(p)

    def master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master weights of parameter `p` (a new tensor for a split master),
        or None (an fp32 parameter, or no step taken yet)."""
        st = self.state.get(p, {})
        if "master_lo" in st:
            return join_master(p, st["master_lo"])
        return st.get("master")

    def _with_grads(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The total 2-norm of every gradient (a 0-dim fp32 device tensor, what
        `torch.nn.utils.clip_grad_norm_` returns); the gradients are scaled by
        min(1, max_norm / (norm + 1e-6)) inside the next `step`, not here."""
        total, self._coef = clip_coefficient([p.grad for p in self._with_grads()],
                                             max_norm)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef, self._coef = self._coef, None
        for group in self.param_groups:
            self._update_group(group, [p for p in group["params"] if p.grad is not None],
                               coef)
        return loss

    def set_clip_coefficient(self, coef: torch.Tensor) -> None:
        """Scale the gradients by `coef` (a 0-dim device tensor) inside the next update:
        `clip_grad_norm_` with a norm computed elsewhere (over the ranks of a split
        model, `grad_norm.clip_`)."""
        self._coef = coef

    def take_coefficient(self) -> torch.Tensor | None:
        """The clipping coefficient `clip_grad_norm_` left for the next update, handed
        over (None when the gradients were not clipped): for updates made one part at a
        time (`update`)."""
        coef, self._coef = self._coef, None
        return coef

    @torch.no_grad()
    def update(self, params, coef: torch.Tensor | None = None) -> None:
        """`step` for `params` only (some of this optimizer's parameters, those with a
        gradient), their gradients scaled by `coef`: the same arithmetic, one part of the
        model at a time (`switches.deferred_adamw`)."""
        chosen = {id(p) for p in params}
        for group in self.param_groups:
            self._update_group(group, [p for p in group["params"]
                                       if id(p) in chosen and p.grad is not None], coef)

    def _update_group(self, group: dict, params: list, coef) -> None:
        if not params:
            return
        found_inf = getattr(self, "found_inf", None)
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        if found_inf is not None:  # a skipped step does not count
            torch._foreach_sub_(steps, [found_inf.reshape(()).to(steps[0].device)]
                                * len(steps))
        beta1, beta2 = group["betas"]
        masters = [s.get("master_lo", s.get("master")) for s in states]
        adamw_step(
            [p.detach() for p in params], [p.grad for p in params],
            None if all(m is None for m in masters) else masters,
            [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"],
            coef=None if coef is None else coef.to(params[0].device),
            found_inf=None if found_inf is None else found_inf.to(params[0].device),
            seeds=[self._seeds.get(p, 0) for p in params],
            stochastic=self.moments != "bf16-nearest")

    def state_dict(self) -> dict:
        """`Optimizer.state_dict` with every master in fp32 under `master` (split ones
        joined), so a checkpoint does not depend on how the masters are held."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in list(sd["state"].items()):
            if "master_lo" in st:
                st = dict(st)
                st["master"] = join_master(params[i], st.pop("master_lo"))
                sd["state"][i] = st
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Like `Optimizer.load_state_dict`, which casts floating state to the parameter
        dtype; that would round the fp32 masters and moments to bf16, so they are
        restored in fp32 (the moments in this optimizer's `moments` dtype). A bf16
        parameter's master is split again: the parameter takes its high half (equal to
        the saved parameter, which was that half)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            st = self.state[p]
            for k, v in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(v):
                    dtype = self._moments if k in ("exp_avg", "exp_avg_sq") else torch.float32
                    st[k] = v.to(device=p.device, dtype=dtype, copy=True)
            if "master" in st and p.dtype == torch.bfloat16:
                hi, st["master_lo"] = split_master(st.pop("master"))
                p.copy_(hi)

