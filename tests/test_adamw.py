"""Our fused AdamW (`kernels.adamw`): the Triton pass equals the reference update and
torch's AdamW, for fp32 parameters and for bf16 ones with fp32 masters, with the
clipping folded in, a skipped step skipped, odd sizes, state round trips; the optimizer
switch picks it. On a CPU the kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from colossal_lab import precision as P
from colossal_lab.config import Switches, tiny
from colossal_lab.kernels.adamw import (
    SUMSQ_BLOCK,
    FusedAdamW,
    adamw_ref,
    adamw_step,
    clip_coefficient,
    sum_of_squares,
)
from colossal_lab.model import build_model
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training import optimizer
from colossal_lab.training.train import make_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SIZES = [1, 3, 2047, 2049, 5000]  # one element, a masked block, block edges, > 2 blocks
TOL = dict(atol=1e-6, rtol=1e-5)
"""fp32 against the fp64 reference: the kernel's fp32 arithmetic (β^t through exp2)
differs from the reference's in the last bits; a wrong term moves it by ~lr = 1e-2."""


def _tensors(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    grads = [torch.randn(n, generator=g) for _ in range(3)]
    return w, m, v, grads


def _ref_steps(w, m, v, grads, coef=1.0):
    w, m, v = w.double(), m.double(), v.double()
    for t, g in enumerate(grads, start=1):
        adamw_ref(w, g.double() * coef, m, v, t, **HP)
    return w, m, v


@pytest.mark.parametrize("n", SIZES)
def test_fp32_update_equals_reference(n):
    w, m, v, grads = _tensors(n)
    want = _ref_steps(w, m, v, grads)
    p, ma, va = (x.to(DEVICE).clone() for x in (w, m, v))
    step = torch.zeros((), device=DEVICE)
    for g in grads:
        step += 1
        adamw_step([p], [g.to(DEVICE)], None, [ma], [va], [step], **HP)
    for got, ref in zip((p, ma, va), want):
        torch.testing.assert_close(got.double().cpu(), ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [3, 2049])
def test_low_precision_params_keep_fp32_masters(dtype, n):
    """The master follows the fp32 update of the rounded gradients exactly; the
    parameter is the master rounded to its dtype."""
    w, m, v, grads = _tensors(n, seed=1)
    low = [g.to(dtype) for g in grads]
    want_w, want_m, want_v = _ref_steps(w, m, v, [g.float() for g in low])
    master, ma, va = (x.to(DEVICE).clone() for x in (w, m, v))
    p = w.to(dtype).to(DEVICE)
    step = torch.zeros((), device=DEVICE)
    for g in low:
        step += 1
        adamw_step([p], [g.to(DEVICE)], [master], [ma], [va], [step], **HP)
    torch.testing.assert_close(master.double().cpu(), want_w, **TOL)
    torch.testing.assert_close(ma.double().cpu(), want_m, **TOL)
    torch.testing.assert_close(va.double().cpu(), want_v, **TOL)
    assert torch.equal(p.cpu(), master.cpu().to(dtype))


@pytest.mark.parametrize("n", SIZES)
def test_split_master_is_the_fp32_master_bit_for_bit(n):
    """bf16 parameters with int16 low halves (`split_master`): three updates give, bit
    for bit, the fp32 master that the fp32-master path gives, and parameters equal to
    its rounding (nearest, ties away from zero: one bf16 ulp from nearest-even at exact
    ties only). `join_master(split_master(x))` is x for every float, signed zeros and
    exact ties included."""
    from colossal_lab.kernels.adamw import join_master, split_master

    w, m, v, grads = _tensors(n, seed=7)
    w = w.to(torch.bfloat16).float()  # both paths start from a bf16 parameter
    runs = []
    for split in (False, True):
        p, ma, va = (x.to(DEVICE).clone() for x in (w.to(torch.bfloat16), m, v))
        master = torch.zeros(n, dtype=torch.int16, device=DEVICE) if split else \
            w.clone().to(DEVICE)
        step = torch.zeros((), device=DEVICE)
        for g in grads:
            step += 1
            adamw_step([p], [g.to(torch.bfloat16).to(DEVICE)], [master], [ma], [va],
                       [step], **HP)
        runs.append((join_master(p, master) if split else master, p, ma, va))
    (m32, p32, ma32, va32), (mlo, plo, malo, valo) = runs
    assert torch.equal(mlo.view(torch.int32), m32.view(torch.int32))
    assert torch.equal(malo, ma32) and torch.equal(valo, va32)
    assert torch.equal(plo, split_master(m32)[0])
    assert ((plo.float() - p32.float()).abs() <= (p32.float().abs() * 2 ** -7)).all()
    x = torch.cat([torch.randn(4096) * torch.logspace(-30, 30, 4096),
                   torch.tensor([0.0, -0.0, 1.0, -3.5]),
                   (torch.arange(64, dtype=torch.int32) * 65536 + 0x3F808000)
                   .view(torch.float32)])  # exact ties
    assert torch.equal(join_master(*split_master(x)).view(torch.int32), x.view(torch.int32))
    with pytest.raises(ValueError, match="int16 master low half needs a bf16"):
        adamw_step([torch.zeros(3, device=DEVICE, dtype=torch.float16)],
                   [torch.zeros(3, device=DEVICE, dtype=torch.float16)],
                   [torch.zeros(3, device=DEVICE, dtype=torch.int16)],
                   [torch.zeros(3, device=DEVICE)], [torch.zeros(3, device=DEVICE)],
                   [torch.ones((), device=DEVICE)], **HP)


def test_bf16_moments_are_rounded_without_bias():
    """bf16 moments (`_round_stochastic`): after one step from zero, m = (1 − β1)·g and
    v = (1 − β2)·g² land on the two bf16 neighbours of their fp32 values, with means
    equal to those values (nearest rounding would be off by ~1e-4 here: 0.1 lies 9.8e-5
    from its nearest bf16); the bits are keyed by seed and step (the same ones give the
    same rounding, another seed or step an unrelated one)."""
    n = 1 << 16
    outs = []
    for seed, t in ((0, 1.0), (0, 1.0), (1, 1.0), (0, 2.0)):
        p = torch.zeros(n, device=DEVICE)
        m, v = (torch.zeros(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        adamw_step([p], [torch.ones(n, device=DEVICE)], None, [m], [v],
                   [torch.full((), t, device=DEVICE)], **HP, seeds=[seed])
        outs.append((m.float().cpu(), v.float().cpu()))
    (m, v), same, other, later = outs
    for got, exact in ((m, 0.1), (v, 0.05)):  # (1 − β) · 1, in fp32
        exact = torch.tensor(exact, dtype=torch.float32)
        below = exact.to(torch.bfloat16).float()
        below = below if below <= exact else torch.nextafter(
            below.to(torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16)).float()
        assert set(got.unique().tolist()) <= {below.item(), torch.nextafter(
            below.to(torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16)).item()}
        assert abs(got.double().mean().item() - exact.item()) < 2e-4 * exact.item()
    assert torch.equal(m, same[0]) and torch.equal(v, same[1])
    up = m != m.min()  # rounded up, with probability q (the dropped fraction, ~0.8)
    q = up.float().mean().item()
    for o in (other, later):  # another seed, or the next step: independent bits, so
        # the two roundings differ with probability 2q(1 − q), not 0 (the same bits)
        differ = (up != (o[0] != o[0].min())).float().mean().item()
        assert abs(differ - 2 * q * (1 - q)) < 0.02
        assert not torch.equal(v, o[1])


def test_nearest_rounded_moments_are_the_nearest_bf16():
    """`stochastic=False` (the "bf16-nearest" moments of a loss check's harmful control):
    m and v are the fp32 update rounded to the nearest bf16, every element, whatever the
    seed; the stochastic rounding of the same update differs from it somewhere."""
    n = 4099
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(n, generator=g).to(DEVICE)
    outs = {}
    for stochastic in (False, True):
        p = torch.zeros(n, device=DEVICE)
        m, v = (torch.zeros(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        adamw_step([p], [grad], None, [m], [v], [torch.ones((), device=DEVICE)], **HP,
                   seeds=[7], stochastic=stochastic)
        outs[stochastic] = (m.cpu(), v.cpu())
    exact_m = (1 - HP["beta1"]) * grad.cpu()
    exact_v = (1 - HP["beta2"]) * grad.cpu() ** 2
    assert torch.equal(outs[False][0], exact_m.to(torch.bfloat16))
    assert torch.equal(outs[False][1], exact_v.to(torch.bfloat16))
    assert not torch.equal(outs[True][0], outs[False][0])
    opt = FusedAdamW([torch.zeros(2, requires_grad=True)], moments="bf16-nearest")
    assert optimizer.moments_of(opt) == "bf16-nearest"


def test_no_masters_control_updates_bf16_parameters_in_place():
    """`extra={"adamw_masters": False}` on bf16 parameters: torch's AdamW with no fp32
    master, its moments in bf16 (the harmful control of a loss check)."""
    model = build_model(tiny())
    model = apply_switches(model, Switches(precision="bf16-pure",
                                           extra={"adamw_masters": False}))
    opt = optimizer.make_optimizer(model)
    assert type(opt) is torch.optim.AdamW
    assert optimizer.moments_of(opt) == "bf16"


def test_bf16_moments_train_like_fp32_ones_and_resume_exactly():
    """The tiny model, bf16-pure, three steps: bf16 moments give the fp32 moments' losses
    within bf16 noise; a copy of the optimizer's state taken after two steps and loaded
    into a fresh one continues bit for bit (the rounding's bits come from parameter and
    step, not from a generator's position); a moments dtype other than fp32/bf16 is
    refused; bf16 moments apply where our AdamW runs."""
    def run(moments, which, opt_state=None, model_state=None):
        model = _model("bf16-pure", "triton")
        if model_state is not None:
            model.load_state_dict(model_state)
        opt = FusedAdamW(list(model.parameters()), lr=1e-3, betas=(0.9, 0.95),
                         moments=moments)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        step = make_step(model, opt, clip=0.5)
        g = torch.Generator().manual_seed(4)
        batches = [torch.randint(0, tiny().vocab_size, (2, 17), generator=g)
                   for _ in range(3)]
        losses = [step(ids[:, :-1].to(DEVICE), ids[:, 1:].to(DEVICE)).item()
                  for ids in batches[which]]
        return model, opt, losses

    _, _, fp32 = run("fp32", slice(0, 3))
    model, opt, bf16 = run("bf16", slice(0, 3))
    torch.testing.assert_close(bf16, fp32, atol=0, rtol=4e-3)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    m2, o2, _ = run("bf16", slice(0, 2))
    sd = o2.state_dict()
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in sd["state"].values())
    resumed, _, _ = run("bf16", slice(2, 3), opt_state=sd, model_state=m2.state_dict())
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="moments='fp16'"):
        FusedAdamW([torch.zeros(2, requires_grad=True)], moments="fp16")
    # an option of our AdamW, which `make_optimizer` passes it; torch's (chosen here
    # explicitly; True picks it on a CPU) keeps fp32 moments, and says so
    for fused, kind, moments in ((False, "MasterAdamW", "fp32"),
                                 ("triton", "FusedAdamW", "bf16")):
        opt = optimizer.make_optimizer(apply_switches(build_model(tiny(), DEVICE), Switches(
            precision="bf16-pure", enable_fused_optimizer=fused,
            extra={"adamw_moments": "bf16"})))
        assert (type(opt).__name__, optimizer.moments_of(opt)) == (kind, moments)
    with pytest.raises(ValueError, match="adamw_moments'\\]='int8'"):
        apply_switches(build_model(tiny(), DEVICE), Switches(
            enable_fused_optimizer="triton", extra={"adamw_moments": "int8"}))


def test_coefficient_and_found_inf():
    w, m, v, grads = _tensors(777, seed=2)
    want = _ref_steps(w, m, v, grads[:1], coef=0.25)
    p, ma, va = (x.to(DEVICE).clone() for x in (w, m, v))
    step = torch.ones((), device=DEVICE)
    coef = torch.tensor(0.25, device=DEVICE)
    skip = torch.ones((), device=DEVICE)
    before = [x.clone() for x in (p, ma, va)]
    adamw_step([p], [grads[0].to(DEVICE)], None, [ma], [va], [step], **HP, coef=coef,
               found_inf=skip)
    for x, b in zip((p, ma, va), before):
        assert torch.equal(x, b), "a step with found_inf set changed the state"
    adamw_step([p], [grads[0].to(DEVICE)], None, [ma], [va], [step], **HP, coef=coef,
               found_inf=torch.zeros((), device=DEVICE))
    for got, ref in zip((p, ma, va), want):
        torch.testing.assert_close(got.double().cpu(), ref, **TOL)


def test_clip_coefficient_is_clip_grad_norm():
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=g, device="cpu").to(DEVICE) * 3 for s in (5, 300)]
    ref = [x.clone().requires_grad_() for x in grads]
    for r, x in zip(ref, grads):
        r.grad = x.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    norm, coef = clip_coefficient(grads, 1.0)
    torch.testing.assert_close(norm, want_norm)
    for r, x in zip(ref, grads):
        torch.testing.assert_close(x * coef, r.grad)
    _, loose = clip_coefficient(grads, 1e6)
    assert loose.item() == 1.0  # never scaled up


def test_clip_coefficient_of_bf16_gradients_is_accumulated_in_fp32():
    grads = [torch.full((4096,), 0.01, dtype=torch.bfloat16, device=DEVICE)] * 2
    norm, _ = clip_coefficient(grads, 1.0)
    assert norm.dtype == torch.float32
    want = (2 * 4096 * torch.tensor(0.01, dtype=torch.bfloat16).double() ** 2) ** 0.5
    assert abs(norm.item() - want) < 1e-6 * want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sum_of_squares_over_odd_sizes(dtype):
    """Block sums over tensors of 0, 1, a block minus one and a block plus one elements
    (the masked tails, the empty tensor skipped), against an fp64 sum; bf16 is summed in
    fp32, so its error is fp32's, not bf16's."""
    g = torch.Generator().manual_seed(5)
    sizes = (0, 1, SUMSQ_BLOCK - 1, SUMSQ_BLOCK + 1, 3 * 7)
    xs = [(torch.randn(n, generator=g) * 2).to(dtype).to(DEVICE) for n in sizes]
    got = sum_of_squares(xs)
    want = sum(float((x.double() ** 2).sum()) for x in xs)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - want) < 1e-5 * want
    assert sum_of_squares([torch.zeros(0, device=DEVICE)]).item() == 0.0


def test_sum_of_squares_refuses_a_strided_tensor():
    x = torch.randn(8, 8, device=DEVICE).t()
    with pytest.raises(ValueError, match="not contiguous"):
        sum_of_squares([x])


def _master(opt, p):
    """The fp32 weights behind `p`: the masters (`master(p)` of ours, split or not, and
    of MasterAdamW), or an fp32 parameter itself."""
    m = opt.master(p) if hasattr(opt, "master") else None
    return (p.detach() if m is None else m).clone()


def _model(precision: str, fused):
    torch.manual_seed(0)
    model = build_model(tiny(), DEVICE)
    return apply_switches(model, Switches(precision=precision,
                                          enable_fused_optimizer=fused))


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_training_steps_equal_the_unfused_optimizer(precision):
    """Three steps of the tiny model with clipping at 0.5 (which bites: the first
    gradients' norm is larger): ours against clip_grad_norm_ + torch AdamW (fp32) or
    MasterAdamW (bf16-pure), from the same weights and batches."""
    runs = {}
    for fused in ("triton", False):
        model = _model(precision, fused)
        opt = optimizer.make_optimizer(model, lr=1e-3)
        assert isinstance(opt, FusedAdamW) == (fused == "triton")
        step = make_step(model, opt, clip=0.5)
        g = torch.Generator().manual_seed(4)
        losses, after_first = [], None
        for _ in range(3):
            ids = torch.randint(0, tiny().vocab_size, (2, 17), generator=g).to(DEVICE)
            losses.append(step(ids[:, :-1], ids[:, 1:]).item())
            if after_first is None:  # fp32 weights: the masters, or the fp32 params
                after_first = [_master(opt, p) for p in model.parameters()]
        runs[fused] = losses, after_first, [p.detach().clone() for p in model.parameters()]
    (l_ours, w_ours, p_ours), (l_ref, w_ref, p_ref) = runs["triton"], runs[False]
    assert l_ours[0] == l_ref[0]
    if precision == "fp32":
        tol = dict(atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(l_ours, l_ref, **tol)
        for a, b in zip(p_ours, p_ref):  # after all three steps
            torch.testing.assert_close(a, b, **tol)
        return
    # bf16: the unfused clipping rounds the scaled gradients to bf16 (ours scales them
    # in fp32): after the first step, from the same gradients, the fp32 masters agree
    # closely (1e-5). Later steps start from parameters one bf16 ulp apart here and
    # there, so elements with near-zero gradients can take different signs: the losses
    # are compared from then on, within bf16 noise.
    for a, b in zip(w_ours, w_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # lr = 1e-3: a wrong term
        # shows as ~1e-3; a gradient within eps of zero moves by ~1e-6
    torch.testing.assert_close(l_ours, l_ref, atol=0, rtol=4e-3)


def test_state_dict_round_trip_keeps_fp32_masters():
    model = _model("bf16-pure", "triton")
    opt = optimizer.make_optimizer(model)
    step = make_step(model, opt)
    ids = torch.randint(0, tiny().vocab_size, (2, 9), device=DEVICE)
    step(ids[:, :-1], ids[:, 1:])
    sd = opt.state_dict()
    fresh = FusedAdamW(list(model.parameters()), lr=3e-4, betas=(0.9, 0.95))
    fresh.load_state_dict(sd)
    for p in model.parameters():
        a, b = opt.state[p], fresh.state[p]
        assert sd["state"][0]["master"].dtype == torch.float32  # the checkpoint's format
        assert "master" not in b and b["master_lo"].dtype == torch.int16  # split again
        assert torch.equal(opt.master(p), fresh.master(p))
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and b["step"].item() == 1


def test_switch_picks_the_optimizer():
    assert P.optimizer_backend(False, "cpu") == "torch"
    assert P.optimizer_backend(True, "cpu") == "torch"  # no GPU: the unfused pair
    assert P.optimizer_backend(True, "cuda") == "triton"
    with pytest.raises(ValueError, match="enable_fused_optimizer"):
        apply_switches(build_model(tiny(), "cpu"), Switches(enable_fused_optimizer="apex"))
    assert isinstance(optimizer.make_optimizer(_model("fp32", False)), torch.optim.AdamW)
    assert isinstance(optimizer.make_optimizer(_model("bf16-pure", False)), optimizer.MasterAdamW)


def test_bad_inputs_are_clear_errors():
    p = torch.zeros(4, dtype=torch.bfloat16, device=DEVICE)
    s = [torch.ones((), device=DEVICE)]
    f = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="masters"):
        adamw_step([p], [p.clone()], None, [f], [f.clone()], s, **HP)
    with pytest.raises(ValueError, match="gradient"):
        adamw_step([f], [p], None, [f.clone()], [f.clone()], s, **HP)
    with pytest.raises(ValueError, match="contiguous"):
        w = torch.zeros(4, 4, device=DEVICE)
        adamw_step([w.t()], [w.t()], None, [w], [w], s, **HP)
    with pytest.raises(ValueError, match="betas"):
        adamw_step([f], [f], None, [f], [f], s, **{**HP, "beta1": 1.0})
    with pytest.raises(ValueError, match="step counts"):
        adamw_step([f], [f], None, [f], [f], [], **HP)


def test_optimizer_benchmark_runs_quick(few_cpu_reps):
    from colossal_lab.benchmarks import optimizer

    rows = optimizer.run(quick=True, progress=False)
    assert [r["provider"] for r in rows] == list(optimizer.PROVIDERS)
    assert all(r["ms"] > 0 and r["params"] == rows[0]["params"] for r in rows)
    assert {r["provider"]: r["speedup_vs_unfused"] for r in rows}["master"] == 1.0
