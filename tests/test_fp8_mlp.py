"""The fp8 MLP with the SwiGLU's casts fused in (`kernels.swiglu_fp8`, `ops.fp8_mlp`).

The kernels against the unfused kernels' math (the Triton SwiGLU, then the torch cast)
bit for bit; the fused MLP against the composed one (Fp8Linear, Triton SwiGLU,
Fp8Linear) bit for bit, since both quantise the same values (the fused kernels round h
and d(gate_up) to the activation dtype first); against plain-torch fp8 math; delayed
scaling, evaluation, checkpointing and the dispatch. CPU: the kernels run under the
Triton interpreter, the GEMMs in emulation (or torch's CPU `_scaled_mm`)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.kernels import fp8_cast, swiglu_fp8
from colossal_lab.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_triton
from colossal_lab.ops import fp8, fp8_mlp
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_calls, requires_cuda
from tests.fp8_models import same_models, sgd_steps, tiny_fp8_models

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(37, 48), (64, 64), (5, 16), (130, 80)]  # (tokens, i): ragged, one tile, tiny, 3x2


def _same(a, b, what):
    """Equal fp8 (or float) values; compares as floats (the interpreter writes -0 as +0)."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    diff = (a.float() != b.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


# ----------------------------------------------------------------------------- kernels


def _src(kind, amax_fn):
    """The amax source: dynamic (the tensor's own amax, from the amax-only pass) or a
    history smaller than the tensor's amax (saturates some elements)."""
    return amax_fn() if kind == "dynamic" else torch.tensor([0.25, 2.0, 1.0])


def _check_cast(out, ref, rows, width, what):
    (q, qt, inv), (rq, rqt, rinv) = out, ref
    _same(q, rq, f"{what} row-major")
    _same(qt, rqt, f"{what} transposed")
    assert qt.shape == (width, fp8_cast.padded(rows))
    _same(qt[:, :rows], q.t(), f"{what} qt is q transposed")
    assert qt[:, rows:].float().abs().sum() == 0  # zero padding
    assert torch.equal(inv, rinv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", ["dynamic", "history"])
def test_forward_kernel_is_swiglu_then_cast(dtype, shape, src):
    """q, qᵀ, inv_scale and amax equal the Triton SwiGLU's h (in gu's dtype) cast by
    `fp8_cast_transpose`'s torch path, bit for bit."""
    t, i = shape
    gu = (torch.randn(t, 2 * i) * 3).to(dtype)
    h = swiglu_forward(gu)
    amax = _src(src, lambda: swiglu_fp8.swiglu_fp8_forward_amax(gu, use_triton=True))
    if src == "dynamic":
        assert amax.item() == h.float().abs().max().item()
    out_k, out_r = torch.zeros(1), torch.zeros(1)
    got = swiglu_fp8.swiglu_fp8_forward(gu, E4, amax, amax_out=out_k, use_triton=True)
    ref = fp8_cast.fp8_cast_transpose(h, E4, amax, amax_out=out_r)
    _check_cast(got, ref, t, i, "h")
    assert torch.equal(out_k, out_r) and out_k.item() == h.float().abs().max().item()
    if src == "history":
        assert got[0].float().abs().max() == 448.0  # saturated, finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", ["dynamic", "history"])
def test_backward_kernel_is_swiglu_backward_then_cast(dtype, shape, src):
    """d(gu) = [dg | du] in e5m2, both layouts, equals the Triton SwiGLU backward's
    output cast by `fp8_cast_transpose`'s torch path; dh may have a row stride."""
    t, i = shape
    gu = (torch.randn(t, 2 * i) * 3).to(dtype)
    dh = torch.randn(t, i + 16).to(dtype)[:, :i]  # a strided view
    dgu = swiglu_backward(dh, gu)
    amax = _src(src, lambda: swiglu_fp8.swiglu_fp8_backward_amax(dh, gu, use_triton=True))
    if src == "dynamic":
        assert amax.item() == dgu.float().abs().max().item()
    out_k, out_r = torch.zeros(1), torch.zeros(1)
    got = swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, amax, amax_out=out_k, use_triton=True)
    ref = fp8_cast.fp8_cast_transpose(dgu, E5, amax, amax_out=out_r)
    _check_cast(got, ref, t, 2 * i, "d(gu)")
    assert torch.equal(out_k, out_r)


def test_kernels_write_only_what_is_asked():
    gu = torch.randn(20, 64).bfloat16()
    dh = torch.randn(20, 32).bfloat16()
    src = torch.tensor([4.0])
    q, qt, _ = swiglu_fp8.swiglu_fp8_forward(gu, E4, src, write_q=False, use_triton=True)
    assert q is None and qt.shape == (32, 32)
    q, qt, _ = swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, write_qt=False,
                                              use_triton=True)
    assert qt is None and q.shape == (20, 64)
    ref = fp8_cast.fp8_cast_transpose(swiglu_backward(dh, gu), E5, src, write_yt=False)
    _same(q, ref[0], "d(gu) alone")


def test_torch_fallback_matches_kernel_up_to_exp():
    """The launchers' torch path (CPU without the interpreter) computes the same
    formulas; only torch's exp may differ from the kernel's in the last bit, which moves
    a rare element by one bf16, at most one fp8 step."""
    gu = (torch.randn(64, 160) * 3).bfloat16()
    dh = torch.randn(64, 80).bfloat16()
    src = torch.tensor([8.0])
    for k, t in ((swiglu_fp8.swiglu_fp8_forward(gu, E4, src, use_triton=True),
                  swiglu_fp8.swiglu_fp8_forward(gu, E4, src, use_triton=False)),
                 (swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, use_triton=True),
                  swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, use_triton=False))):
        for a, b in zip(k[:2], t[:2]):
            off = a.float() != b.float()
            assert off.float().mean() < 0.01
            assert ((a.float() - b.float()).abs() <= b.float().abs() / 4)[off].all()


# ------------------------------------------------------------------------- the MLP

D, N_I = 48, 80  # hidden, intermediate: multiples of 16, not of the 64-wide tile


def _pair(scaling="dynamic", backend="emulate", bias=False, history=4):
    """Two identical (gate_up, down) Fp8Linear pairs with separate state: one for the
    fused path, one for the composed path."""
    cfg = fp8.Fp8Config(scaling=scaling, backend=backend, history_len=history)
    gu, dn = nn.Linear(D, 2 * N_I, bias=bias), nn.Linear(N_I, D, bias=bias)
    a = (fp8.Fp8Linear.from_linear(gu, cfg), fp8.Fp8Linear.from_linear(dn, cfg))
    b = tuple(copy.deepcopy(m) for m in a)
    return a, b


def _composed(x, gate_up, down):
    return down(swiglu_triton(gate_up(x)))


def _run(path, mods, x, dy, autocast):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    for m in mods:
        m.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fp8_mlp.fp8_swiglu_mlp(x, *mods) if path == "fused" else _composed(x, *mods)
    if dy is not None:
        y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, [None if m.weight.grad is None else m.weight.grad.clone()
                                for m in mods]


def _histories(mods):
    return [(r, s.history.clone(), s.pos, s.seen) for m in mods
            for r, s in m._scalers.items()]


def _same_histories(a, b):
    for (r, ha, pa, sa), (_, hb, pb, sb) in zip(_histories(a), _histories(b)):
        assert torch.equal(ha, hb) and (pa, sa) == (pb, sb), r


@pytest.mark.parametrize("tokens", [(2, 19), (32,)], ids=["38-tokens", "32-tokens"])
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("backend", ["emulate", "scaled_mm"])
def test_fused_equals_composed(tokens, scaling, autocast, backend):
    """Output, dx, dW_gate_up, dW_down and every amax history equal the composed path's
    bit for bit, over three steps (delayed: the first is dynamic, the third input is
    larger than the history and saturates)."""
    fused, comp = _pair(scaling, backend)
    for step, mag in enumerate((1.0, 1.0, 6.0)):
        x = torch.randn(*tokens, D) * mag
        dy = torch.randn(*tokens, D) * mag
        x.requires_grad_()
        yf, dxf, dwf = _run("fused", fused, x, dy, autocast)
        yc, dxc, dwc = _run("composed", comp, x, dy, autocast)
        assert yf.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert dxf.dtype == x.dtype and dwf[0].dtype == torch.float32
        _same(yf, yc, f"y step {step}")
        _same(dxf, dxc, f"dx step {step}")
        _same(dwf[0], dwc[0], f"dW_gate_up step {step}")
        _same(dwf[1], dwc[1], f"dW_down step {step}")
        _same_histories(fused, comp)
    if scaling == "delayed":
        assert fused[1]._scalers["x"].pos == 3 and fused[0]._scalers["grad"].pos == 3


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True), (False, True, True)],
                         ids=["x", "w_gu", "w_down", "weights"])
def test_requires_grad_combinations(needs):
    """Only the asked gradients are computed, each equal to the composed path's."""
    fused, comp = _pair("delayed")
    for mods in (fused, comp):
        mods[0].weight.requires_grad_(needs[1])
        mods[1].weight.requires_grad_(needs[2])
    x = torch.randn(21, D, requires_grad=needs[0])
    dy = torch.randn(21, D)
    outs = [_run(p, m, x, dy, True) for p, m in (("fused", fused), ("composed", comp))]
    (yf, dxf, dwf), (yc, dxc, dwc) = outs
    _same(yf, yc, "y")
    assert (dxf is None) == (not needs[0]) and (dxc is None) == (not needs[0])
    if needs[0]:
        _same(dxf, dxc, "dx")
    for k in (0, 1):
        assert (dwf[k] is None) == (not needs[1 + k])
        if needs[1 + k]:
            _same(dwf[k], dwc[k], f"dW {k}")
    _same_histories(fused, comp)


def _fake(t, fmt):
    s = fp8.amax_to_scale(t.abs().amax(), fmt)
    return fp8.dequantize(fp8.quantize(t, s, fmt), s)


def _mlp_ref(x, w_gu, w_dn, dy):
    """The fused MLP's math in plain fp32 torch with dynamic scales: quantise and
    dequantise every GEMM operand, multiply in fp32."""
    xq, wq, vq = _fake(x, fp8.E4M3), _fake(w_gu, fp8.E4M3), _fake(w_dn, fp8.E4M3)
    g, u = (xq @ wq.t()).chunk(2, dim=1)
    h = F.silu(g) * u
    hq = _fake(h, fp8.E4M3)
    gq = _fake(dy, fp8.E5M2)
    dh = gq @ vq
    s = torch.sigmoid(g)
    dgu_q = _fake(torch.cat([dh * u * s * (1 + g * (1 - s)), dh * g * s], 1), fp8.E5M2)
    return hq @ vq.t(), dgu_q @ wq, dgu_q.t() @ xq, gq.t() @ hq


def test_fused_matches_plain_torch_fp8_math():
    """In fp32 (no intermediate bf16), the fused path equals the plain-torch fp8 math up
    to fp32 summation order and the last bit of exp, which can move an element of h or
    d(gu) that sits on an fp8 rounding boundary by one step: almost every element agrees
    to 1e-4 relative, all within a few percent of the largest value. A dropped scale or
    a wrong transposition misses by far more."""
    (gate_up, down), _ = _pair("dynamic")
    x = torch.randn(37, D, requires_grad=True)
    dy = torch.randn(37, D)
    y, dx, (dw_gu, dw_dn) = _run("fused", (gate_up, down), x, dy, False)
    refs = _mlp_ref(x.detach(), gate_up.weight.detach(), down.weight.detach(), dy)
    for name, got, ref in zip(("y", "dx", "dW_gate_up", "dW_down"), (y, dx, dw_gu, dw_dn),
                              refs):
        err = (got - ref).abs()
        scale = ref.abs().max()
        assert (err <= 1e-4 * ref.abs() + 1e-5 * scale).float().mean() > 0.99, name
        assert err.max() <= 0.03 * scale, (name, (err.max() / scale).item())
    # and the fp8 error against fp32 stays small: the scales are applied
    with torch.no_grad():
        g, u = (x @ gate_up.weight.t()).chunk(2, dim=1)
        y32 = (F.silu(g) * u) @ down.weight.t()
    check_close(y, y32, name="y vs fp32", atol=0.1 * y32.abs().max().item())


def test_evaluation_leaves_histories_alone():
    """Under no_grad (evaluation) the fused path scales from the history without
    extending it, and returns what the composed path returns."""
    fused, comp = _pair("delayed")
    x = torch.randn(24, D, requires_grad=True)
    _run("fused", fused, x, torch.randn(24, D), True)
    _run("composed", comp, x, torch.randn(24, D), True)
    before = _histories(fused)
    with torch.no_grad():
        yf, _, _ = _run("fused", fused, x * 50, None, True)
        yc, _, _ = _run("composed", comp, x * 50, None, True)
    _same(yf, yc, "y in evaluation")
    for (r, h0, p0, s0), (_, h1, p1, s1) in zip(before, _histories(fused)):
        assert torch.equal(h0, h1) and (p0, s0) == (p1, s1), r


# ------------------------------------------------------------------- in the model


def _count_fused(monkeypatch):
    return count_calls(monkeypatch, fp8_mlp, "swiglu_fp8_forward")


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_model_fused_equals_composed(scaling, monkeypatch):
    """A model whose MLPs take the fused path trains bit for bit as one with
    `fp8_fuse_mlp=False` (loss, every gradient, every history, three SGD steps)."""
    calls = _count_fused(monkeypatch)
    cfg, models = tiny_fp8_models({"fp8_scaling": scaling},
                                  [({}, None), ({"fp8_fuse_mlp": False}, None)])
    for step, losses in sgd_steps(cfg, models):
        assert torch.equal(losses[0], losses[1]), step
        same_models(models, step)
    assert calls["n"] == 3 * cfg.num_hidden_layers  # only the first model fused


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_model_fused_under_full_checkpointing(scaling, monkeypatch):
    """Full checkpointing recomputes the fused MLP with the original forward's scales:
    loss, gradients and histories equal those without checkpointing, and each history
    advances once a step."""
    calls = _count_fused(monkeypatch)
    cfg, models = tiny_fp8_models({"fp8_scaling": scaling},
                                  [({}, None), ({}, GradientCheckpointConfig(mode="full"))])
    for step, losses in sgd_steps(cfg, models):
        assert torch.equal(losses[0], losses[1]), step
        same_models(models, step)
        if scaling == "delayed":
            mlp = models[1].model.layers[0].mlp
            assert mlp.down_proj._scalers["x"].pos == step + 1
    assert calls["n"] == 3 * 3 * cfg.num_hidden_layers  # the second model recomputed


def test_dispatch_conditions():
    (gate_up, down), _ = _pair()
    assert fp8_mlp.fusable(gate_up, down, "triton", "cpu")
    assert not fp8_mlp.fusable(gate_up, down, "eager", "cpu")
    assert not fp8_mlp.fusable(nn.Linear(D, 2 * N_I, bias=False), down, "triton", "cpu")
    (gb, db), _ = _pair(bias=True)
    assert not fp8_mlp.fusable(gb, db, "triton", "cpu")
    off = fp8.Fp8Linear.from_linear(nn.Linear(N_I, D, bias=False),
                                    fp8.Fp8Config(fuse_mlp=False))
    assert not fp8_mlp.fusable(gate_up, off, "triton", "cpu")
    handle = down.register_forward_hook(lambda *a: None)
    assert not fp8_mlp.fusable(gate_up, down, "triton", "cpu")
    handle.remove()
    assert fp8.Fp8Config.from_extra({"fp8_fuse_mlp": False}).fuse_mlp is False


# ------------------------------------------------------------------------------- GPU


@requires_cuda  # the compiled kernels and `_scaled_mm`: `make test-gpu`
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("tokens", [1000, 4096])
def test_fused_equals_composed_on_the_gpu(scaling, tokens):
    """On the GPU, at widths that span many tiles (hidden 512, intermediate 1376, a
    ragged token count), three steps under bf16 autocast: the fused MLP's output, dx,
    both weight gradients and every amax history equal the composed path's bit for
    bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    d, n = 512, 1376
    cfg = fp8.Fp8Config(scaling=scaling, backend="scaled_mm", history_len=4)
    gu = nn.Linear(d, 2 * n, bias=False, device="cuda")
    dn = nn.Linear(n, d, bias=False, device="cuda")
    fused = (fp8.Fp8Linear.from_linear(gu, cfg), fp8.Fp8Linear.from_linear(dn, cfg))
    comp = tuple(copy.deepcopy(m) for m in fused)
    for step, mag in enumerate((1.0, 1.0, 6.0)):
        x = torch.randn(tokens, d, device="cuda") * mag
        dy = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) * mag
        outs = []
        for path, mods in (("fused", fused), ("composed", comp)):
            xi = x.clone().requires_grad_()
            for m in mods:
                m.weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = (fp8_mlp.fp8_swiglu_mlp(xi, *mods) if path == "fused"
                     else _composed(xi, *mods))
            y.backward(dy)
            outs.append((y.detach(), xi.grad, mods[0].weight.grad, mods[1].weight.grad))
        for a, b, what in zip(*outs, ("y", "dx", "dW_gate_up", "dW_down")):
            _same(a, b, f"{what} step {step}")
        _same_histories(fused, comp)


@requires_cuda  # compiled tiles: `make test-gpu`
@pytest.mark.parametrize("shape", [(1000, 1376), (37, 80), (4096, 2752)])
def test_every_tile_writes_the_same_bits_on_the_gpu(shape):
    """Whatever tile the autotuner picks, the fused kernels write the same fp8 bytes
    (both layouts), inverse scale and amax: each tile of `TILES` against the first, in
    the forward and the backward, with a history smaller than the values (saturation)."""
    t, i = shape
    gu = (torch.randn(t, 2 * i, device="cuda") * 3).bfloat16()
    dh = (torch.randn(t, i, device="cuda") * 3).bfloat16()
    src = torch.tensor([0.25, 2.0, 1.0], device="cuda")
    runs = {}
    for tile in swiglu_fp8.TILES:
        fa, ba = (torch.zeros(1, device="cuda") for _ in range(2))
        fwd = swiglu_fp8.swiglu_fp8_forward(gu, E4, src, amax_out=fa, tile=tile)
        bwd = swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, amax_out=ba, tile=tile)
        runs[tile] = (*fwd, fa, *bwd, ba)
    auto_fa, auto_ba = (torch.zeros(1, device="cuda") for _ in range(2))
    runs["autotuned"] = (*swiglu_fp8.swiglu_fp8_forward(gu, E4, src, amax_out=auto_fa),
                         auto_fa,
                         *swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, amax_out=auto_ba),
                         auto_ba)
    ref = runs.pop(swiglu_fp8.TILES[0])
    names = ("h", "hT", "h inv", "h amax", "d", "dT", "d inv", "d amax")
    for tile, out in runs.items():
        for a, b, what in zip(out, ref, names):
            assert torch.equal(a.view(torch.uint8) if a.dtype in (E4, E5) else a,
                               b.view(torch.uint8) if b.dtype in (E4, E5) else b), \
                (tile, what)


@pytest.mark.parametrize("tile", [(64, 128, 4), (128, 64, 4), (64, 256, 8)])
def test_a_chosen_tile_writes_what_the_default_writes(tile):
    """The tile bypass (`tile=`) with a tile other than the interpreter's: the same fp8
    bytes, inverse scale and amax as the default tile, forward and backward, on a shape
    that leaves partial tiles both ways."""
    torch.manual_seed(3)
    gu, dh = torch.randn(70, 2 * 90) * 3, torch.randn(70, 90) * 3
    src = torch.tensor([0.25, 2.0, 1.0])
    outs = []
    for t in (None, tile):
        fa, ba = torch.zeros(1), torch.zeros(1)
        f = swiglu_fp8.swiglu_fp8_forward(gu, E4, src, amax_out=fa, use_triton=True, tile=t)
        b = swiglu_fp8.swiglu_fp8_backward(dh, gu, E5, src, amax_out=ba, use_triton=True,
                                           tile=t)
        outs.append((*f, fa, *b, ba))
    for a, b, what in zip(*outs, ("h", "hT", "h inv", "h amax", "d", "dT", "d inv",
                                  "d amax")):
        _same(a, b, what)
