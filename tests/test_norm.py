"""Switch 2: fused RMSNorm, LayerNorm and add + RMSNorm against the eager references.

On a CPU the Triton kernels run under the interpreter. Every output and every gradient
is checked by the 2x-low-precision rule of `colossal_lab.testing.correctness`: the kernel's
error against the reference in fp32 must be at most twice the error of the same
reference run in the kernel's dtype, plus a small atol (fp32: atol + rtol·max|ref|).
"""

from __future__ import annotations

import pytest
import torch

from colossal_lab import switches
from colossal_lab.ops import norm
from colossal_lab.ops.norm import add_rms_norm_ref, layer_norm_ref, rms_norm_ref
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_launches

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [(123,), (5, 123), (7, 1024), (2, 3, 4097), (2, 1, 3, 64), (3, 700), (2, 1282),
          (2, 1000)]
# row pieces (`_norm_common.row_pieces`): 123 -> one padded 128; 4097 -> 4096 + 1;
# 700 -> 512 + 128 + 64 (three, the last padded); 1282 -> 1024 + 256 + 2.
# ALIGN (`_norm_common.alignment`): 1 at 123 and 4097, 2 at 1282, 4 at 700, 8 at 1000,
# 16 at 64 and 1024
# (activation dtype, weight dtype, atol, rtol). bf16 activations with fp32 weights is
# what autocast trains with. atol only absorbs ties: the bound is 2·err(lowp) + atol.
DTYPES = [
    (torch.float32, torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, torch.bfloat16, 1e-3, 0.0),
    (torch.float16, torch.float16, 1e-4, 0.0),
    (torch.bfloat16, torch.float32, 1e-3, 0.0),
]
DTYPE_IDS = ["fp32", "bf16", "fp16", "bf16-w32"]


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)


def _check_op(fn, ref_fn, inputs, grad_outs, atol, rtol):
    """Run `fn` (the kernel) and `ref_fn` in fp32 and, for low precision, in the
    kernel's dtypes; check every output and the gradient of every input."""
    ins = [_leaf(t) for t in inputs]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], ins, [g for _, g in pairs])

    def run_ref(cast):
        r_ins = [_leaf(t, torch.float32 if cast else None) for t in inputs]
        r_outs = ref_fn(*r_ins)
        r_outs = r_outs if isinstance(r_outs, tuple) else (r_outs,)
        r_pairs = [(o, g.to(o.dtype)) for o, g in zip(r_outs, grad_outs) if g is not None]
        r_grads = torch.autograd.grad([o for o, _ in r_pairs], r_ins,
                                      [g for _, g in r_pairs])
        return r_outs, r_grads

    ref_outs, ref_grads = run_ref(cast=True)
    lowp = inputs[0].dtype != torch.float32
    lp_outs, lp_grads = run_ref(cast=False) if lowp else ((None,) * 9, (None,) * 9)
    for i, (o, r, lp) in enumerate(zip(outs, ref_outs, lp_outs)):
        assert o.dtype == (lp.dtype if lp is not None else torch.float32), f"out{i} dtype"
        check_close(o, r, lp, name=f"out{i}", atol=atol, rtol=rtol)
    for i, (g, r, lp) in enumerate(zip(grads, ref_grads, lp_grads)):
        assert g.dtype == inputs[i].dtype, f"grad {i} dtype {g.dtype}"
        check_close(g, r, lp, name=f"grad{i}", atol=atol, rtol=rtol)


def _inputs(shape, dtype, wdtype, shift=0.0):
    x = (torch.randn(shape) * 2 + shift).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(wdtype)
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,wdtype,atol,rtol", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(shape, dtype, wdtype, atol, rtol):
    x, w = _inputs(shape, dtype, wdtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    _check_op(lambda x, w: norm.rms_norm(x, w, 1e-6, backend="triton"),
              lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], [dy], atol, rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,wdtype,atol,rtol", DTYPES, ids=DTYPE_IDS)
def test_layer_norm(shape, dtype, wdtype, atol, rtol):
    x, w = _inputs(shape, dtype, wdtype, shift=3.0)  # non-zero mean: centring matters
    b = (0.5 * torch.randn(shape[-1])).to(wdtype).to(DEVICE)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    _check_op(lambda x, w, b: norm.layer_norm(x, w, b, 1e-5, backend="triton"),
              lambda x, w, b: layer_norm_ref(x, w, b, 1e-5), [x, w, b], [dy], atol, rtol)


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 4097)], ids=str)
@pytest.mark.parametrize("dtype,wdtype,atol,rtol", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_layer_norm_without_bias(shape, dtype, wdtype, atol, rtol):
    x, w = _inputs(shape, dtype, wdtype, shift=3.0)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    _check_op(lambda x, w: norm.layer_norm(x, w, None, 1e-5, backend="triton"),
              lambda x, w: layer_norm_ref(x, w, None, 1e-5), [x, w], [dy], atol, rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,wdtype,atol,rtol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("h_used", [True, False], ids=["h-used", "h-unused"])
def test_add_rms_norm(shape, dtype, wdtype, atol, rtol, h_used):
    """Gradients reach x and residual through h: from the norm, and (h_used) from a
    later use of h, as the next residual add of a pre-norm block does."""
    x, w = _inputs(shape, dtype, wdtype)
    res = (torch.randn(shape, device=DEVICE) * 2).to(dtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    dh = torch.randn(shape, device=DEVICE).to(dtype) if h_used else None
    _check_op(lambda x, r, w: norm.add_rms_norm(x, r, w, 1e-6, backend="triton"),
              lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6), [x, res, w], [dy, dh],
              atol, rtol)


def test_add_rms_norm_mixed_residual_stream():
    """Autocast: bf16 block output added to an fp32 residual stream -> fp32 h and y,
    gradients in each input's dtype."""
    x, w = _inputs((6, 96), torch.bfloat16, torch.float32)
    res = torch.randn(6, 96, device=DEVICE)
    dy, dh = torch.randn(6, 96, device=DEVICE), torch.randn(6, 96, device=DEVICE)
    _check_op(lambda x, r, w: norm.add_rms_norm(x, r, w, 1e-6, backend="triton"),
              lambda x, r, w: add_rms_norm_ref(x, r, w, 1e-6), [x, res, w], [dy, dh],
              1e-5, 1e-5)


def test_uncontiguous_input_and_expanded_grad():
    """A transposed input and the stride-0 gradient of `y.sum()`."""
    xt = torch.randn(64, 10, device=DEVICE).t()  # (10, 64), column stride 10
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    x1, x2 = _leaf(xt), _leaf(xt)
    norm.rms_norm(x1, w, backend="triton").sum().backward()
    dw = w.grad.clone()
    w.grad = None
    rms_norm_ref(x2, w).sum().backward()
    check_close(x1.grad, x2.grad, name="dx", atol=1e-5)
    check_close(dw, w.grad, name="dw", atol=1e-5)


def test_empty_rows():
    x = torch.randn(0, 64, device=DEVICE, requires_grad=True)
    w = torch.ones(64, device=DEVICE, requires_grad=True)
    y = norm.rms_norm(x, w, backend="triton")
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad, torch.zeros(64, device=DEVICE))


def test_tolerance_catches_a_wrong_eps():
    """The tolerances can fail: eps 1e-2 instead of 1e-6 is caught on unit-scale rows."""
    x = torch.randn(4, 256, device=DEVICE) * 0.1
    w = torch.ones(256, device=DEVICE)
    with pytest.raises(AssertionError):
        check_close(norm.rms_norm(x, w, 1e-2, backend="triton"), rms_norm_ref(x, w, 1e-6),
                    atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_hidden_size_limit(op):
    from colossal_lab.kernels.layer_norm import layer_norm_triton
    from colossal_lab.kernels.rms_norm import rms_norm_triton

    x, w = torch.randn(1, 65537, device=DEVICE), torch.ones(65537, device=DEVICE)
    fn = rms_norm_triton if op == "rms_norm" else layer_norm_triton
    with pytest.raises(ValueError, match="65536"):
        fn(x, w)


def test_bad_weight_shape():
    with pytest.raises(ValueError, match=r"expected \(64,\)"):
        norm.rms_norm(torch.randn(2, 64, device=DEVICE), torch.ones(32, device=DEVICE),
                      backend="triton")


# ------------------------------------------------------------------------------ dispatch


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown normalization backend"):
        norm.rms_norm(torch.randn(2, 8), torch.ones(8), backend="cudnn")
    with pytest.raises(ValueError, match="unknown normalization backend"):
        norm.resolve_backend("fast")


@pytest.mark.parametrize("backend,module", [("liger", "liger_kernel"), ("apex", "apex")])
def test_missing_backend_falls_back(backend, module, monkeypatch):
    """Without the library (or without a GPU) the switch warns and uses torch; it never
    crashes the way ColossalAI does without apex (hpcaitech/ColossalAI#6260). Strict
    mode raises instead."""
    if backend in norm.available_backends(DEVICE):
        pytest.skip(f"{module} is installed here")
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    x, w = torch.randn(3, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    with pytest.raises(switches.BackendUnavailable, match=f"'{backend}'.*refuses"):
        norm.rms_norm(x, w, backend=backend)
    monkeypatch.delenv(switches.STRICT_ENV)
    with pytest.warns(UserWarning, match=f"'{backend}'.*using 'torch'"):
        y = norm.rms_norm(x, w, backend=backend)
    check_close(y, rms_norm_ref(x, w), atol=1e-5)
    y2 = norm.layer_norm(x, w, None, backend=backend)  # warned once: no second warning
    check_close(y2, layer_norm_ref(x, w), atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_triton_backend_runs_the_kernels(op, monkeypatch):
    """backend="triton" launches our forward and backward kernels, on a CPU under the
    interpreter: not an eager stand-in with equal output."""
    from colossal_lab.kernels import layer_norm as ln
    from colossal_lab.kernels import rms_norm as rn

    kernels = (ln._layer_norm_forward_kernel, ln._layer_norm_backward_kernel) \
        if op == "layer_norm" else \
        (rn._rms_norm_forward_kernel, rn._rms_norm_backward_kernel)
    launches = count_launches(monkeypatch, *kernels)
    x = torch.randn(3, 40, device=DEVICE, requires_grad=True)
    w = torch.randn(40, device=DEVICE, requires_grad=True)
    if op == "add_rms_norm":
        y, h = norm.add_rms_norm(x, torch.randn_like(x), w, backend="triton")
    else:
        y = getattr(norm, op)(x, w, backend="triton")
    y.sum().backward()
    assert sorted(launches.values()) == [1, 1], launches


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_triton_without_gpu_or_interpreter(strict, monkeypatch):
    """CPU tensors without the interpreter: "triton" cannot run; torch, with a warning,
    or an error in strict mode."""
    import colossal_lab.kernels

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if strict:
        with pytest.raises(switches.BackendUnavailable, match="TRITON_INTERPRET"):
            norm.resolve_backend("triton", "cpu")
        return
    monkeypatch.delenv(switches.STRICT_ENV)
    with pytest.warns(UserWarning, match="TRITON_INTERPRET=1; using 'torch'"):
        assert norm.resolve_backend("triton", "cpu") == "torch"


def test_true_resolves_per_device():
    assert norm.resolve_backend(True, "cpu") == "torch"
    assert norm.resolve_backend(False) == "eager"
    if torch.cuda.is_available():
        assert norm.resolve_backend(True, "cuda") == "triton"


@pytest.mark.parametrize("backend", ["torch", "compile"])
def test_library_backends_match_reference(backend):
    if backend == "compile" and DEVICE == "cpu":
        pytest.importorskip("torch._inductor")
    x, w = torch.randn(4, 48, device=DEVICE), torch.randn(48, device=DEVICE)
    b, r = torch.randn(48, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    check_close(norm.rms_norm(x, w, backend=backend), rms_norm_ref(x, w), atol=1e-5)
    check_close(norm.layer_norm(x, w, b, backend=backend), layer_norm_ref(x, w, b),
                atol=1e-5)
    y, h = norm.add_rms_norm(x, r, w, backend=backend)
    y_ref, h_ref = add_rms_norm_ref(x, r, w)
    check_close(y, y_ref, atol=1e-5)
    check_close(h, h_ref, atol=0)


# -------------------------------------------------------------------------------- modules


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_module_triton_equals_eager(residual):
    eager = norm.RMSNorm(80, eps=1e-5, backend="eager").to(DEVICE)
    with torch.no_grad():
        eager.weight.normal_()
    fused = norm.RMSNorm(80, eps=1e-5, backend="triton").to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(3, 5, 80, device=DEVICE)
    r = torch.randn(3, 5, 80, device=DEVICE) if residual else None
    ye, yf = eager(x, residual=r), fused(x, residual=r)
    if residual:
        (ye, he), (yf, hf) = ye, yf
        check_close(hf, he, atol=0)
    check_close(yf, ye, atol=1e-5)
    ye.square().sum().backward()
    yf.square().sum().backward()
    check_close(fused.weight.grad, eager.weight.grad, name="dw", atol=1e-4)


@pytest.mark.parametrize("cls,kwargs", [(norm.RMSNorm, {}), (norm.LayerNorm, {}),
                                        (norm.LayerNorm, {"bias": False})])
def test_state_dict_same_for_every_backend(cls, kwargs):
    """A fused module loads and saves the naive one's state dict: same keys, shapes and
    values whatever the backend (Hugging Face layout: `weight`, and `bias`)."""
    dicts = [cls(32, backend=b, **kwargs).state_dict() for b in norm.BACKENDS + (True,)]
    for sd in dicts[1:]:
        assert list(sd) == list(dicts[0])
        assert all(torch.equal(sd[k], dicts[0][k]) for k in sd)
    expected = ["weight"] if cls is norm.RMSNorm or kwargs else ["weight", "bias"]
    assert list(dicts[0]) == expected


def test_layer_norm_module_matches_torch():
    ours = norm.LayerNorm(40, backend="triton").to(DEVICE)
    ref = torch.nn.LayerNorm(40).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 40, device=DEVICE)
    check_close(ours(x), ref(x), atol=1e-5)


# ------------------------------------------------------------------------------ GPU only


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_large_bf16_on_gpu(op):
    """The benchmark's shape: many programs, a long persistent loop, 16-byte loads."""
    shape = (16384, 4096)
    x, w = _inputs(shape, torch.bfloat16, torch.bfloat16)
    dy = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    if op == "rms_norm":
        _check_op(lambda x, w: norm.rms_norm(x, w, backend="triton"), rms_norm_ref,
                  [x, w], [dy], 1e-3, 0.0)
    elif op == "layer_norm":
        b = torch.randn(4096, device=DEVICE).to(torch.bfloat16)
        _check_op(lambda x, w, b: norm.layer_norm(x, w, b, backend="triton"),
                  layer_norm_ref, [x, w, b], [dy], 1e-3, 0.0)
    else:
        res = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
        _check_op(lambda x, r, w: norm.add_rms_norm(x, r, w, backend="triton"),
                  add_rms_norm_ref, [x, res, w], [dy, dy], 1e-3, 0.0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["liger", "apex", "compile", "torch"])
def test_other_backends_on_gpu(backend):
    if backend not in norm.available_backends("cuda"):
        pytest.skip(f"{backend} not installed")
    x, w = _inputs((256, 1000), torch.bfloat16, torch.bfloat16)
    dy = torch.randn(256, 1000, device=DEVICE).to(torch.bfloat16)
    _check_op(lambda x, w: norm.rms_norm(x, w, backend=backend), rms_norm_ref, [x, w],
              [dy], 1e-3, 0.0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 3072), (1000, 3000), (37, 5120), (2048, 1024)],
                         ids=str)
def test_small_token_counts_on_gpu(shape):
    """Few rows: the persistent grid is capped by rows per program, not by SMs."""
    x, w = _inputs(shape, torch.bfloat16, torch.bfloat16)
    dy = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    _check_op(lambda x, w: norm.rms_norm(x, w, backend="triton"), rms_norm_ref,
              [x, w], [dy], 1e-3, 0.0)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("shape", [(13, 5120), (9, 1000), (21, 13824 // 8 + 3)], ids=str)
def test_rms_norm_backward_prefetch(shape, prefetch):
    """The backward with and without the register double buffer: several tiles per
    program (4 programs under the interpreter), one to three row pieces, a last tile
    that is partly past the end."""
    from colossal_lab.kernels.rms_norm import rms_norm_backward, rms_norm_forward

    x, w = _inputs(shape, torch.bfloat16, torch.float32)
    dy = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    _, rstd = rms_norm_forward(x.detach(), w.detach(), 1e-6)
    dx, dw = rms_norm_backward(dy, x.detach(), w.detach(), rstd, prefetch=prefetch)
    xr, wr = x.detach().float().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.autograd.grad(rms_norm_ref(xr.double(), wr, 1e-6), (xr, wr), dy.double())
    torch.testing.assert_close(dx.float(), ref[0].float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dw.double(), ref[1], atol=1e-3, rtol=1e-3)


def test_persistent_grid_size(monkeypatch):
    """SMs x programs per SM, capped so each program loops over >= min_rows rows and
    never more programs than tiles."""
    from colossal_lab.kernels import _norm_common as nc

    monkeypatch.setattr(nc, "INTERPRET", False)
    monkeypatch.setattr(nc, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert nc.persistent_programs(16384, 1, 8, cuda, min_rows=8) == 264  # 16 // 8 per SM
    assert nc.persistent_programs(16384, 1, 4, cuda, programs_per_sm=1) == 132
    assert nc.persistent_programs(1024, 1, 4, cuda, min_rows=8) == 128
    assert nc.persistent_programs(1024, 1, 4, cuda, min_rows=1) == 528
    assert nc.persistent_programs(1000, 16, 4, cuda, min_rows=8) == 63  # tiles of 16 rows
    assert nc.persistent_programs(3, 1, 4, cuda, min_rows=8) == 1
    assert nc.persistent_programs(5, 2, 4, torch.device("cpu")) == 3  # tiles


@pytest.mark.parametrize("programs,n_cols", [(1, 1), (5, 70), (67, 130), (300, 33)],
                         ids=str)
def test_partials_sum_is_one_deterministic_launch(programs, n_cols, monkeypatch):
    """The backward's dweight (and dbias) partials are summed in fp32 and rounded once to
    each parameter's dtype, by one launch, the same bits on every call."""
    from colossal_lab.kernels import _norm_common as nc

    partials = torch.randn(2, programs, n_cols, device=DEVICE) * 3
    w = torch.empty(n_cols, dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty(n_cols, device=DEVICE)
    counts = count_launches(monkeypatch, nc._rms_norm_partials_sum_kernel)
    dw, db = nc.sum_partials(partials, w, b)
    assert counts == {"_rms_norm_partials_sum_kernel": 1}
    assert (dw.dtype, db.dtype) == (torch.bfloat16, torch.float32)
    expect = partials.double().sum(1)  # (2, n_cols)
    torch.testing.assert_close(db.double(), expect[1], atol=1e-4, rtol=1e-5)
    # rounded once: within half a bf16 ulp of the exact sum (plus fp32 summation error)
    torch.testing.assert_close(dw.double(), expect[0], atol=1e-4, rtol=2 ** -8)
    again = nc.sum_partials(partials, w, b)
    assert torch.equal(again[0], dw) and torch.equal(again[1], db)


@pytest.mark.parametrize("n_cols", [1, 2, 3, 17, 123, 700, 1000, 1282, 3000, 4096, 4097,
                                    5120, 11008, 13824, 65535])
def test_row_pieces_cover_the_row_with_little_padding(n_cols):
    from colossal_lab.kernels._norm_common import MAX_PADDING, row_pieces

    pieces = row_pieces(n_cols)
    used = [p for p in pieces if p]
    assert len(pieces) == 3 and pieces[len(used):] == (0,) * (3 - len(used))
    assert all(p & (p - 1) == 0 for p in used)  # powers of two
    assert used == sorted(used, reverse=True)
    assert sum(used) >= n_cols and sum(used[:-1]) < n_cols  # every piece holds columns
    # little padding, unless three pieces were needed (then at most the last piece's)
    assert sum(used) - n_cols <= max(n_cols * MAX_PADDING, used[-1] // 2 if len(used) == 3
                                     else 0)
    if n_cols & (n_cols - 1) == 0:
        assert used == [n_cols]
