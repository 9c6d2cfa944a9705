"""The RMSNorm inside the fp8 projection after it (`ops.fp8_norm`), the norm writing the
projection's fp8 input: the qkv + RoPE node and the MLP node with the norm against the
composed path (the Triton norm, then the same node) bit for bit — outputs, the stream
h, every gradient (x, residual, norm weight, weights), amax histories — with and
without a residual, both scalings, under autocast and without; in a model for two SGD
steps (under delayed scaling also with full checkpointing) on an odd token count, then
in evaluation; and the dispatch. CPU: the kernels run under the Triton interpreter, the GEMMs in
emulation."""

import copy

import pytest
import torch
import torch.nn as nn

from colossal_lab.ops import fp8, fp8_mlp, fp8_norm, fp8_qkv
from colossal_lab.ops.norm import LayerNorm, RMSNorm
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.switches.fp8 import fp8_modules
from tests.conftest import count_calls, requires_cuda
from tests.fp8_models import same_histories, sgd_steps, tiny_fp8_models

D, N_Q, N_KV, HEAD, N_I = 64, 4, 2, 16, 48
WIDTH = (N_Q + 2 * N_KV) * HEAD


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype)
    diff = (a.float() != b.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def _tables(S):
    pos = torch.arange(S, dtype=torch.float32)[:, None]
    inv = 10000.0 ** (-torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    return ang.cos(), ang.sin()


def _blocks(block, scaling, device="cpu", backend="emulate"):
    """Two identical (norm, fp8 projections) sets with separate state: fused, composed."""
    torch.manual_seed(0)
    cfg = fp8.Fp8Config(scaling=scaling, backend=backend, history_len=4, fuse_norm=True)
    norm = RMSNorm(D, backend="triton").to(device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    widths = [(D, WIDTH)] if block == "qkv" else [(D, 2 * N_I), (N_I, D)]
    projs = [fp8.Fp8Linear.from_linear(nn.Linear(i, o, bias=False, device=device), cfg)
             for i, o in widths]
    one = (norm, *projs)
    return one, copy.deepcopy(one)


def _call(block, fused, mods, x, residual, cos, sin):
    """(outputs, h) of the block after the norm, fused or composed."""
    norm, *projs = mods
    if fused:
        if block == "qkv":
            *outs, h = fp8_qkv.fp8_qkv_rope(x, projs[0], N_Q, N_KV, cos, sin, norm,
                                            residual)
            return outs, h
        y, h = fp8_mlp.fp8_swiglu_mlp(x, *projs, norm, residual)
        return [y], h
    normed, h = (norm(x), x) if residual is None else norm(x, residual=residual)
    if block == "qkv":
        return list(fp8_qkv.fp8_qkv_rope(normed, projs[0], N_Q, N_KV, cos, sin)), h
    return [fp8_mlp.fp8_swiglu_mlp(normed, *projs)], h


def _step(block, fused, mods, x, residual, cos, sin, seed, autocast):
    """One forward and backward (output gradients drawn from `seed`); returns the
    outputs, h and every gradient."""
    x = x.detach().clone().requires_grad_()
    residual = None if residual is None else residual.detach().clone().requires_grad_()
    for m in mods:
        m.weight.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        outs, h = _call(block, fused, mods, x, residual, cos, sin)
    ends = [*outs, h] if residual is not None else outs  # h feeds the next add
    g = torch.Generator(x.device).manual_seed(seed)
    torch.autograd.backward(ends, [torch.randn(e.shape, generator=g, device=e.device)
                                   .to(e.dtype) for e in ends])
    got = [*(o.detach() for o in outs), h.detach(), x.grad]
    got += [residual.grad] if residual is not None else []
    return got + [m.weight.grad for m in mods]


def _histories_equal(a, b):
    for m, n in zip(a[1:], b[1:]):
        same_histories(m, n)


@pytest.mark.parametrize("block", ["qkv", "mlp"])
@pytest.mark.parametrize("residual", [False, True], ids=["first-layer", "residual"])
@pytest.mark.parametrize("scaling,autocast", [("delayed", True), ("dynamic", True),
                                              ("delayed", False)])
def test_fused_equals_composed(block, residual, scaling, autocast):
    """Two steps (the second scales from the history the first filed, with a larger
    input): outputs, h, dx, dresidual, dnorm_weight, every dW and every history equal
    the composed path's, bit for bit, on 7 tokens (qᵀ padded)."""
    B, S = 1, 7
    cos, sin = _tables(S)
    fused, comp = _blocks(block, scaling)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(B, S, D, generator=g) * (1 + 3 * step)
        res = torch.randn(B, S, D, generator=g) if residual else None
        if autocast and res is not None:
            x = x.bfloat16()  # a bf16 block output on the fp32 stream, as in the model
        outs_f = _step(block, True, fused, x, res, cos, sin, step, autocast)
        outs_c = _step(block, False, comp, x, res, cos, sin, step, autocast)
        assert len(outs_f) == len(outs_c)
        for i, (a, b) in enumerate(zip(outs_f, outs_c)):
            _same(a, b, f"step {step} output {i}")
        _histories_equal(fused, comp)


@pytest.mark.parametrize("frozen", ["x", "norm-weight", "projection"])
def test_only_the_gradients_asked_for(frozen):
    """A frozen x (only the residual trains), norm weight or projection weight: the
    others' gradients equal the composed path's and the frozen one gets none."""
    S = 13
    fused, comp = _blocks("mlp", "delayed")
    x, res = torch.randn(1, S, D), torch.randn(1, S, D)
    dy, dh = torch.randn(1, S, D), torch.randn(1, S, D)
    got = []
    for is_fused, mods in ((True, fused), (False, comp)):
        xi = x.clone().requires_grad_(frozen != "x")
        ri = res.clone().requires_grad_()
        mods[0].weight.requires_grad_(frozen != "norm-weight")
        mods[1].weight.requires_grad_(frozen != "projection")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (y,), h = _call("mlp", is_fused, mods, xi, ri, None, None)
        torch.autograd.backward([y, h], [dy.to(y.dtype), dh])
        got.append([xi.grad, ri.grad, *(m.weight.grad for m in mods)])
    for i, (a, b) in enumerate(zip(*got)):
        assert (a is None) == (b is None), i
        if a is not None:
            _same(a, b, f"gradient {i}")
    assert got[0][{"x": 0, "norm-weight": 2, "projection": 3}[frozen]] is None


# ------------------------------------------------------------------- in the model


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_model_fused_equals_composed_and_checkpointed(scaling, monkeypatch):
    """Models from the same weights: the norms fused (every layer's two norms; the first
    layer's input norm has no residual), `fp8_fuse_norm=False` and, under delayed
    scaling, fused under full checkpointing. Two SGD steps on 9 tokens: losses, every
    gradient (norm weights too) and every history are equal, each history advances once
    a step (the recompute quantises with the original forward's scales); then
    evaluation (no_grad) gives equal losses and leaves the histories as they were."""
    calls = count_calls(monkeypatch, fp8_norm, "rms_norm_fp8")
    ckpt = [({}, GradientCheckpointConfig(mode="full"))] if scaling == "delayed" else []
    cfg, models = tiny_fp8_models(
        {"fp8_scaling": scaling, "fp8_fuse_norm": True},
        [({}, None), ({"fp8_fuse_norm": False}, None), *ckpt],
        enable_fused_rope="triton", enable_fused_normalization="triton")
    layer = models[-1].model.layers[1]
    gen = torch.Generator().manual_seed(3)
    for step, losses in sgd_steps(cfg, models, n=2, generator=gen, ids_shape=(1, 10)):
        for other in range(1, len(models)):
            assert torch.equal(losses[0], losses[other]), (step, other)
            for (name, p), q in zip(models[0].named_parameters(),
                                    models[other].parameters()):
                assert torch.equal(p.grad, q.grad), (step, other, name)
            for a, b in zip(*(fp8_modules(m) for m in (models[0], models[other]))):
                same_histories(a, b)
        if scaling == "delayed":  # the checkpointed model's, the recompute included
            for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
                assert proj._scalers["x"].pos == step + 1
    n_norms = 2 * cfg.num_hidden_layers
    fused = 2 * n_norms * (1 + 2 * len(ckpt))  # two steps; the third model recomputes
    assert calls["n"] == fused
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=gen)
    before = [[s.history.clone() for m in fp8_modules(model) for s in m._scalers.values()]
              for model in models]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [m(ids[:, :-1], ids[:, 1:]) for m in models]
    assert all(torch.equal(losses[0], loss) for loss in losses[1:])
    for model, hist in zip(models, before):
        after = [s.history for m in fp8_modules(model) for s in m._scalers.values()]
        assert all(torch.equal(a, b) for a, b in zip(hist, after))
    assert calls["n"] == fused + n_norms * (1 + len(ckpt))


def test_dispatch_conditions(monkeypatch):
    (norm, proj), _ = _blocks("qkv", "delayed")
    assert fp8_norm.fusable(norm, proj, "cpu")
    assert fp8_qkv.fusable(proj, "triton", "cpu", norm)
    for backend in ("eager", "torch", "compile", False):
        assert not fp8_norm.fusable(RMSNorm(D, backend=backend), proj, "cpu"), backend
    assert not fp8_norm.fusable(LayerNorm(D, backend="triton"), proj, "cpu")
    off = fp8.Fp8Linear.from_linear(nn.Linear(D, WIDTH, bias=False),
                                    fp8.Fp8Config(fuse_norm=False))
    assert not fp8_norm.fusable(norm, off, "cpu")
    assert not fp8_qkv.fusable(off, "triton", "cpu", norm)
    assert fp8_qkv.fusable(off, "triton", "cpu")  # the RoPE fusion alone stays
    handle = norm.register_forward_hook(lambda *a: None)
    assert not fp8_norm.fusable(norm, proj, "cpu")
    handle.remove()
    assert fp8.Fp8Config.from_extra({"fp8_fuse_norm": True}).fuse_norm is True
    assert fp8.Fp8Config().fuse_norm is False  # opt-in: on a GPU it ran level
    # in the model: a hook on a block or a norm sends that norm the composed way
    cfg, (model,) = tiny_fp8_models({"fp8_fuse_norm": True}, [({}, None)],
                                    enable_fused_normalization="triton")
    calls = count_calls(monkeypatch, fp8_norm, "rms_norm_fp8")
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)  # RoPE not Triton: only the MLPs' norms fuse
        assert calls["n"] == cfg.num_hidden_layers
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: None)
        model.model.layers[1].post_attention_layernorm.register_forward_hook(
            lambda *a: None)
        model(ids)
        assert calls["n"] == cfg.num_hidden_layers


# ------------------------------------------------------------------------------- GPU


@requires_cuda  # the compiled kernels and `_scaled_mm`: `make test-gpu`
@pytest.mark.parametrize("block", ["qkv", "mlp"])
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_fused_equals_composed_on_the_gpu(block, scaling):
    """On the GPU, 1000 tokens (yᵀ padded), three steps under bf16 autocast with a
    residual: outputs, h and every gradient equal the composed path's bit for bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    B, S = 1, 1000
    fused, comp = _blocks(block, scaling, "cuda", "scaled_mm")
    cos, sin = (t.cuda() for t in _tables(S))
    for step, mag in enumerate((1.0, 1.0, 6.0)):
        x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16) * mag
        res = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16) * mag
        outs = [_step(block, f, mods, x, res, cos, sin, step, True)
                for f, mods in ((True, fused), (False, comp))]
        for i, (a, b) in enumerate(zip(*outs)):
            _same(a, b, f"step {step} output {i}")
        _histories_equal(fused, comp)
