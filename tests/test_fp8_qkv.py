"""The fp8 qkv projection with RoPE in one node, its gradient's cast fused into RoPE's
backward (`ops.fp8_qkv`): against the composed path (`Fp8Linear`, then
`RotaryQKVFunction`) bit for bit — outputs, gradients, amax histories — on ragged token
counts, in both scalings, under autocast and without, in a model for three SGD steps,
under full checkpointing, with a frozen input or weight and an unused output; and the
dispatch. CPU: the kernels run under the Triton interpreter, the GEMMs in emulation (or
torch's CPU `_scaled_mm`)."""

import copy

import pytest
import torch
import torch.nn as nn

from colossal_lab.kernels.rope import rope_qkv_triton
from colossal_lab.ops import fp8, fp8_qkv
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from tests.conftest import count_calls, requires_cuda
from tests.fp8_models import same_histories, same_models, sgd_steps, tiny_fp8_models

D_MODEL, N_Q, N_KV, HEAD = 64, 4, 2, 16
WIDTH = (N_Q + 2 * N_KV) * HEAD


def _tables(S):
    pos = torch.arange(S + 5, dtype=torch.float32)[:, None]
    inv = 10000.0 ** (-torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    return ang.cos(), ang.sin()


def _pair(scaling="delayed", backend="emulate", **kw):
    torch.manual_seed(0)
    lin = nn.Linear(D_MODEL, WIDTH, bias=False, **kw)
    cfg = fp8.Fp8Config(scaling=scaling, backend=backend, history_len=4)
    fused = fp8.Fp8Linear.from_linear(lin, cfg)
    return fused, copy.deepcopy(fused)


def _composed(x, module, cos, sin):
    return rope_qkv_triton(module(x), N_Q, N_KV, cos, sin)


def _run(path, module, x, cos, sin, grads, autocast):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else \
        torch.autocast("cpu", enabled=False)
    with ctx:
        outs = fp8_qkv.fp8_qkv_rope(x, module, N_Q, N_KV, cos, sin) if path == "fused" \
            else _composed(x, module, cos, sin)
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g.to(o.dtype) for o, g in used])
    return outs


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
    diff = (a.float() != b.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


CASES = [((2, 19), s, a, "emulate") for s in ("dynamic", "delayed") for a in (True, False)]
CASES += [((1, 32), "delayed", True, "emulate"), ((1, 32), "delayed", True, "scaled_mm")]


@pytest.mark.parametrize("tokens,scaling,autocast,backend", CASES)
def test_fused_equals_composed(tokens, scaling, autocast, backend):
    """Two steps (the second uses the history the first filed): outputs, dx, dW and every
    history equal the composed path's, bit for bit."""
    B, S = tokens
    cos, sin = _tables(S)
    fused, comp = _pair(scaling, backend)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(B, S, D_MODEL, generator=g) * (1 + 3 * step)
        grads = [torch.randn(B, S, h, HEAD, generator=g) for h in (N_Q, N_KV, N_KV)]
        xf, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        outs_f = _run("fused", fused, xf, cos, sin, grads, autocast)
        outs_c = _run("composed", comp, xc, cos, sin, grads, autocast)
        for name, a, b in zip("qkv", outs_f, outs_c):
            _same(a, b, f"step {step} {name}")
        _same(xf.grad, xc.grad, f"step {step} dx")
        _same(fused.weight.grad, comp.weight.grad, f"step {step} dW")
        same_histories(fused, comp)
        fused.weight.grad = comp.weight.grad = None


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["x", "weight"])
def test_a_frozen_input_or_weight_and_an_unused_output(needs):
    """Only the gradients asked for are computed, and an output left out of the loss (v)
    counts as a zero gradient, as in the composed path."""
    cos, sin = _tables(11)
    fused, comp = _pair()
    for m in (fused, comp):
        m.weight.requires_grad_(needs[1])
    x = torch.randn(3, 11, D_MODEL)
    grads = [torch.randn(3, 11, N_Q, HEAD), torch.randn(3, 11, N_KV, HEAD), None]
    xf, xc = x.clone().requires_grad_(needs[0]), x.clone().requires_grad_(needs[0])
    _run("fused", fused, xf, cos, sin, grads, True)
    _run("composed", comp, xc, cos, sin, grads, True)
    if needs[0]:
        _same(xf.grad, xc.grad, "dx")
        assert fused.weight.grad is None
    else:
        _same(fused.weight.grad, comp.weight.grad, "dW")
        assert xf.grad is None
    same_histories(fused, comp)


def test_model_fused_equals_composed(monkeypatch):
    """A model whose attention takes the fused path trains bit for bit as one with
    `fp8_fuse_rope=False` (loss, every gradient, every history, three SGD steps; the
    dynamic scaling's amax pass is held to the composed path above)."""
    calls = count_calls(monkeypatch, fp8_qkv, "rope_fp8_backward")
    cfg, models = tiny_fp8_models({"fp8_scaling": "delayed"},
                                  [({}, None), ({"fp8_fuse_rope": False}, None)],
                                  enable_fused_rope="triton")
    for step, losses in sgd_steps(cfg, models, generator=torch.Generator().manual_seed(3)):
        assert torch.equal(losses[0], losses[1]), step
        same_models(models, step)
    assert calls["n"] == 3 * cfg.num_hidden_layers  # only the first model fused


def test_model_fused_under_full_checkpointing(monkeypatch):
    """Full checkpointing recomputes the fused node with the original forward's scales:
    loss, gradients and histories equal those without checkpointing."""
    calls = count_calls(monkeypatch, fp8_qkv, "rope_fp8_backward")
    cfg, models = tiny_fp8_models({"fp8_scaling": "delayed"},
                                  [({}, None), ({}, GradientCheckpointConfig(mode="full"))],
                                  enable_fused_rope="triton")
    for step, losses in sgd_steps(cfg, models, generator=torch.Generator().manual_seed(3)):
        assert torch.equal(losses[0], losses[1]), step
        same_models(models, step)
        attn = models[1].model.layers[0].self_attn
        assert attn.qkv_proj._scalers["grad"].pos == step + 1  # once a step
    assert calls["n"] == 2 * 3 * cfg.num_hidden_layers


def test_dispatch_conditions():
    fused, _ = _pair()
    assert fp8_qkv.fusable(fused, "triton", "cpu")
    assert not fp8_qkv.fusable(fused, "eager", "cpu")
    assert not fp8_qkv.fusable(nn.Linear(D_MODEL, WIDTH, bias=False), "triton", "cpu")
    with_bias = fp8.Fp8Linear.from_linear(nn.Linear(D_MODEL, WIDTH))
    assert not fp8_qkv.fusable(with_bias, "triton", "cpu")
    off = fp8.Fp8Linear.from_linear(nn.Linear(D_MODEL, WIDTH, bias=False),
                                    fp8.Fp8Config(fuse_rope=False))
    assert not fp8_qkv.fusable(off, "triton", "cpu")
    handle = fused.register_forward_pre_hook(lambda *a: None)
    assert not fp8_qkv.fusable(fused, "triton", "cpu")
    handle.remove()
    assert fp8.Fp8Config.from_extra({"fp8_fuse_rope": False}).fuse_rope is False


# ------------------------------------------------------------------------------- GPU


@requires_cuda  # the compiled kernels and `_scaled_mm`: `make test-gpu`
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("shape", [(1, 1000), (2, 2048)], ids=["1000-tokens", "4096-tokens"])
def test_fused_equals_composed_on_the_gpu(scaling, shape):
    """On the GPU, hidden 512, 8 query and 4 key/value heads of 64, three steps under
    bf16 autocast: q, k, v, dx, dW and every amax history equal the composed path's bit
    for bit (the fused kernel rounds as RoPE's kernel and the cast do)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    B, S = shape
    d, n_q, n_kv, hd = 512, 8, 4, 64
    cfg = fp8.Fp8Config(scaling=scaling, backend="scaled_mm", history_len=4)
    fused = fp8.Fp8Linear.from_linear(
        nn.Linear(d, (n_q + 2 * n_kv) * hd, bias=False, device="cuda"), cfg)
    comp = copy.deepcopy(fused)
    pos = torch.arange(S, dtype=torch.float32, device="cuda")[:, None]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32, device="cuda") / hd)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    cos, sin = ang.cos(), ang.sin()
    for step, mag in enumerate((1.0, 1.0, 6.0)):
        x = torch.randn(B, S, d, device="cuda") * mag
        grads = [torch.randn(B, S, h, hd, device="cuda", dtype=torch.bfloat16) * mag
                 for h in (n_q, n_kv, n_kv)]
        outs = []
        for path, m in (("fused", fused), ("composed", comp)):
            xi = x.clone().requires_grad_()
            m.weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qkv = fp8_qkv.fp8_qkv_rope(xi, m, n_q, n_kv, cos, sin) \
                    if path == "fused" else rope_qkv_triton(m(xi), n_q, n_kv, cos, sin)
            torch.autograd.backward(list(qkv), grads)
            outs.append((*(t.detach() for t in qkv), xi.grad, m.weight.grad))
        for a, b, what in zip(*outs, ("q", "k", "v", "dx", "dW")):
            _same(a, b, f"{what} step {step}")
        same_histories(fused, comp)
