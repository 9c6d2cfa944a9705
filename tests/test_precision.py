"""Precision modes: autocast per precision, fp16 dynamic loss scaling (an overflow skips
the step and lowers the scale), the bf16-pure master-weight AdamW (same update as
torch's AdamW, chunked, checkpointable), and every precision training end to end."""

import pytest
import torch
import torch.nn as nn

from colossal_lab import precision as P
from colossal_lab.config import Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.precision import PRECISIONS
from colossal_lab.switches.apply import apply_switches
from colossal_lab.testing.correctness import check_close
from colossal_lab.training import optimizer, train


@pytest.mark.parametrize("precision", PRECISIONS)
def test_autocast_dtype(precision):
    with P.autocast(precision, "cpu"):
        on = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")
    want = P.AUTOCAST_DTYPE[precision]
    assert on == (want is not None)
    if want is not None:
        assert dtype == want
    with pytest.raises(ValueError, match="choose one of"):
        P.autocast("fp4", "cpu")


# --------------------------------------------------------------------- loss scaling


def _tiny_problem(opt_kind: str):
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    if opt_kind == "sgd":
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    elif opt_kind == "adamw-fused":  # skips on device from found_inf
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True)
    else:
        lin = lin.to(torch.bfloat16)
        opt = optimizer.MasterAdamW(lin.parameters(), lr=0.1)
    return lin, opt


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw-fused", "master"])
def test_overflow_skips_step_and_backs_off(opt_kind):
    lin, opt = _tiny_problem(opt_kind)
    scaler = P.DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    x = torch.randn(3, 8, dtype=lin.weight.dtype)
    # a clean step first, so the optimizers have state
    scaler.scale(lin(x).float().sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = [p.detach().clone() for p in lin.parameters()]
    steps_before = [s["step"].clone() for s in opt.state.values() if "step" in s]
    scaler.scale(lin(x).float().sum()).backward()
    lin.weight.grad[0, 0] = float("inf")  # an fp16 overflow
    found = scaler.unscale_(opt)
    assert found.item() == 1.0
    scaler.step(opt)
    scaler.update()
    for a, b in zip(before, lin.parameters()):
        assert torch.equal(a, b.detach())  # the step was skipped
    assert [s["step"] for s in opt.state.values() if "step" in s] == steps_before
    assert scaler.scale_value == 512.0


def test_scale_grows_after_clean_steps_and_unscales_exactly():
    lin, opt = _tiny_problem("sgd")
    scaler = P.DynamicLossScaler(init_scale=8.0, growth_interval=2)
    x = torch.randn(3, 8)
    lin(x).sum().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    opt.zero_grad()
    for i in range(2):
        scaler.scale(lin(x).sum()).backward()
        scaler.unscale_(opt)
        if i == 0:
            for g, p in zip(ref, lin.parameters()):
                assert torch.equal(g, p.grad)  # /8 of a power-of-two scaled gradient
        opt.zero_grad()  # (no step: same weights, same gradients)
        scaler._found_inf = torch.zeros(())
        scaler.update()
    assert scaler.scale_value == 16.0
    sd = scaler.state_dict()
    other = P.DynamicLossScaler()
    other.load_state_dict(sd)
    assert other.scale_value == 16.0


def test_fp16_step_skips_overflow_end_to_end():
    """make_step in fp16: an absurd scale overflows, the weights stay, the scale halves;
    with the default scale training proceeds."""
    cfg = tiny()
    m = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp16"))
    opt = train.make_optimizer(m)
    step = train.make_step(m, opt)
    step.scaler.init_scale = 2.0**127
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    before = [p.detach().clone() for p in m.parameters()]
    loss = step(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert step.scaler.scale_value == 2.0**126
    step.scaler.load_state_dict({**step.scaler.state_dict(), "scale": 2.0**10})
    step(ids[:, :-1], ids[:, 1:])
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


# -------------------------------------------------------------- master-weight AdamW

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(shapes, dtype):
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(*s).to(dtype)) for s in shapes]


SHAPES = [(7, 5), (64,), (3, 4, 5), (1,)]


@pytest.mark.parametrize("chunk_bytes", [16, 1 << 20])
def test_master_adamw_matches_torch_adamw(chunk_bytes):
    """Same gradients (bf16-representable), same hyper-parameters: the fp32 masters
    follow torch's fp32 AdamW and the bf16 parameters are the masters rounded."""
    ref = _params(SHAPES, torch.bfloat16)
    ref = [nn.Parameter(p.detach().float()) for p in ref]
    low = [nn.Parameter(p.detach().bfloat16()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, **HP)
    opt = optimizer.MasterAdamW(low, chunk_bytes=chunk_bytes, **HP)
    for _ in range(5):
        for a, b in zip(ref, low):
            g = torch.randn_like(a).bfloat16()
            a.grad, b.grad = g.float(), g
        opt_ref.step()
        opt.step()
    for a, b in zip(ref, low):
        master = opt.state[b]["master"]
        assert master.dtype == torch.float32 and b.dtype == torch.bfloat16
        check_close(master, a.detach(), atol=1e-6, rtol=1e-5)
        assert torch.equal(b.detach(), master.bfloat16())


def test_adamw_ref_is_torch_adamw():
    p = _params([(5, 3)], torch.float32)[0]
    q = p.detach().clone()
    m, v = torch.zeros_like(q), torch.zeros_like(q)
    opt = torch.optim.AdamW([p], **HP)
    for t in range(1, 4):
        g = torch.randn_like(q)
        p.grad = g.clone()
        opt.step()
        optimizer.adamw_ref(q, g, m, v, t, lr=HP["lr"], beta1=0.9, beta2=0.95, eps=HP["eps"],
                    weight_decay=HP["weight_decay"])
    check_close(q, p.detach(), atol=1e-6)


def test_master_weights_keep_small_updates():
    """Updates below half a bf16 ulp vanish from bf16 weights but not from masters."""
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = optimizer.MasterAdamW([w], lr=1e-4, weight_decay=0.0)
    naive = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(100):
        w.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
        naive -= 1e-4  # the same step applied to bf16 directly: rounds away
    assert torch.equal(naive, torch.ones(4, dtype=torch.bfloat16))
    assert opt.state[w]["master"][0].item() == pytest.approx(1 - 1e-2, rel=1e-3)
    assert w[0].item() < 1.0


def test_master_adamw_chunks_its_fp32_gradients(monkeypatch):
    """No step holds more than `chunk_bytes` of fp32 gradients (or one tensor's)."""
    params = _params([(64, 64)] * 6, torch.bfloat16)
    for p in params:
        p.grad = torch.randn_like(p)
    seen = []
    real = torch._fused_adamw_

    def spy(ps, gs, *a, **kw):
        seen.append(sum(g.numel() * g.element_size() for g in gs))
        return real(ps, gs, *a, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    optimizer.MasterAdamW(params, chunk_bytes=2 * 64 * 64 * 4).step()
    assert seen == [2 * 64 * 64 * 4] * 3


def test_master_adamw_state_dict_round_trip():
    a = _params(SHAPES, torch.bfloat16)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = optimizer.MasterAdamW(a, **HP)
    for p in a:
        p.grad = torch.randn_like(p)
    opt_a.step()
    opt_b = optimizer.MasterAdamW(b, **HP)
    opt_b.load_state_dict(opt_a.state_dict())
    for p in b:
        assert opt_b.state[p]["master"].dtype == torch.float32
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
        g = torch.randn_like(pa)
        pa.grad, pb.grad = g, g.clone()
    opt_a.step()
    opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert torch.equal(opt_a.state[pa]["master"], opt_b.state[pb]["master"])
    opt_b.zero_grad()
    assert all(p.grad is None for p in b)


def test_make_optimizer_picks_masters_for_bf16_params():
    m = apply_switches(build_model(tiny(), "cpu"), Switches(precision="bf16-pure"))
    assert next(m.parameters()).dtype == torch.bfloat16
    assert isinstance(train.make_optimizer(m), optimizer.MasterAdamW)
    m32 = apply_switches(build_model(tiny(), "cpu"), Switches(precision="bf16"))
    assert type(train.make_optimizer(m32)) is torch.optim.AdamW


# ------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_learns(precision):
    """A repeated batch: the loss falls in every precision (clipping on)."""
    cfg = tiny().replace(intermediate_size=176)
    torch.manual_seed(0)
    m = apply_switches(build_model(cfg, "cpu"), Switches(precision=precision))
    opt = train.make_optimizer(m, lr=3e-3)
    step = train.make_step(m, opt, micro_batches=2)
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    losses = [step(ids[:, :-1], ids[:, 1:]).item() for _ in range(6)]
    assert all(x == x for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
