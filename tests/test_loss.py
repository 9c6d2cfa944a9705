"""The loss switch: every backend of `fused_linear_cross_entropy` gives the loss and the
gradients (hidden, weight) of `cross_entropy_ref(hidden @ weight.T)`, the Triton kernel
alone matches softmax − onehot on strided rows, the chunked paths never make an (N, V)
tensor, and bad inputs and switch values fail early. On a CPU the kernel runs under
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from colossal_lab import switches
from colossal_lab.kernels import cross_entropy as ce_kernel
from colossal_lab.kernels.cross_entropy import (
    cross_entropy_loss_and_grad_,
    cross_entropy_triton,
)
from colossal_lab.ops import cross_entropy as loss_switch
from colossal_lab.ops.cross_entropy import (
    BACKENDS,
    cross_entropy_ref,
    fused_linear_cross_entropy,
)
from colossal_lab.switches import loss
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100

# (N, d, V, chunk_tokens): one token; chunks that do not divide N; V not a power of two
CASES = [(1, 16, 301, None), (37, 48, 1000, 10), (37, 48, 301, 16), (64, 32, 128, None)]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)]  # (dtype, atol)


def _inputs(n, d, v, *, ignore_every=7, device=DEVICE):
    """fp64 hidden (N, d), weight (V, d) and labels (N,) with every 7th ignored; logits
    of a few units, like a trained head's."""
    h = torch.randn(n, d, dtype=torch.float64, device=device)
    w = torch.randn(v, d, dtype=torch.float64, device=device) * (2.0 / d ** 0.5)
    y = torch.randint(0, v, (n,), device=device)
    if ignore_every:
        y[3::ignore_every] = IGNORE
    return h, w, y


def _run(fn, h, w, y, dtype, grad_out=None, **kw):
    """Loss and gradients of `fn(hidden, weight, labels)` on inputs cast to `dtype`."""
    hh = h.detach().to(dtype, copy=True).requires_grad_()
    ww = w.detach().to(dtype, copy=True).requires_grad_()
    loss = fn(hh, ww, y, **kw)
    go = torch.ones_like(loss) if grad_out is None else torch.full_like(loss, grad_out)
    dh, dw = torch.autograd.grad(loss, (hh, ww), go)
    return loss, dh, dw


def _ref(h, w, y, ignore_index=IGNORE):
    return cross_entropy_ref(h @ w.t(), y, ignore_index)


def _check(out, h, w, y, dtype, atol, grad_out=None):
    """out = (loss, dh, dw) against the fp64 reference; in low precision by the 2x rule
    against the eager reference computed in `dtype`."""
    ref = _run(_ref, h, w, y, torch.float64, grad_out)
    lowp = _run(_ref, h, w, y, dtype, grad_out) if dtype != torch.float32 else (None,) * 3
    assert out[0].dtype == torch.float32 and out[1].dtype == out[2].dtype == dtype
    for name, o, r, lo in zip(("loss", "dhidden", "dweight"), out, ref, lowp):
        check_close(o, r.to(o.dtype) if lo is None else r, lo, name=name, atol=atol,
                    rtol=1e-5)


# ------------------------------------------------------------------------ every backend


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,d,v,chunk", CASES, ids=[f"{c[0]}x{c[1]}-V{c[2]}-c{c[3]}"
                                                    for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(backend, n, d, v, chunk, dtype, atol, monkeypatch):
    h, w, y = _inputs(n, d, v)
    launches = count_launches(monkeypatch, ce_kernel._cross_entropy_kernel)
    out = _run(fused_linear_cross_entropy, h, w, y, dtype, backend=backend,
               chunk_tokens=chunk)
    _check(out, h, w, y, dtype, atol)
    chunks = -(-n // chunk) if chunk else 1
    assert launches == ({"_cross_entropy_kernel": chunks} if backend == "triton" else {})


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_grad_output_not_one(backend, dtype, atol, monkeypatch):
    """The backward scales both precomputed gradients by the incoming one: "triton" in
    one `scale_cast` launch each (bf16: from the fp32 dW buffer of several chunks)."""
    h, w, y = _inputs(37, 48, 301)
    launches = count_launches(monkeypatch, ce_kernel._scale_cast_kernel)
    out = _run(fused_linear_cross_entropy, h, w, y, dtype, grad_out=0.37,
               backend=backend, chunk_tokens=8)
    _check(out, h, w, y, dtype, atol, grad_out=0.37)
    assert launches == ({"_scale_cast_kernel": 2} if backend == "triton" else {})


def test_scale_cast_rounds_once():
    """fp32 -> bf16 with the factor applied in fp32 and one rounding: equal to the
    eager fp32 product rounded; odd length (the last program masked); a strided input
    falls back to eager with the same values."""
    x = torch.randn(4097 + 13, device=DEVICE) * 5
    s = torch.tensor(0.37, device=DEVICE)
    got = ce_kernel.scale_cast(x, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x * s).to(torch.bfloat16))
    strided = torch.randn(64, 40, device=DEVICE).t()
    assert torch.equal(ce_kernel.scale_cast(strided, s, torch.float32), strided * s)


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_autocast_runs_the_matmuls_in_bf16(backend):
    """fp32 parameters under bf16 autocast (precision "bf16"): bf16 GEMMs, fp32
    gradients, as accurate as the eager path under the same autocast."""
    h, w, y = _inputs(37, 48, 301)

    def under_autocast(fn):
        def f(hh, ww, yy, **kw):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return fn(hh, ww, yy, **kw)
        return f

    class MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                self.seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with MatmulDtypes() as mode:
        mode.seen = []
        out = _run(under_autocast(fused_linear_cross_entropy), h, w, y, torch.float32,
                   backend=backend, chunk_tokens=16)
    assert mode.seen and set(mode.seen) == {torch.bfloat16}
    assert out[1].dtype == out[2].dtype == torch.float32
    ref = _run(_ref, h, w, y, torch.float64)
    lowp = _run(under_autocast(_ref), h, w, y, torch.float32)
    for name, o, r, lo in zip(("loss", "dhidden", "dweight"), out, ref, lowp):
        check_close(o, r, lo, name=name, atol=1e-5)


@pytest.mark.parametrize("frozen", ["weight", "hidden", "both"])
@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_requires_grad_false(backend, frozen):
    h, w, y = _inputs(37, 48, 301)
    ref = _run(_ref, h, w, y, torch.float64)
    hh = h.float().requires_grad_(frozen != "hidden" and frozen != "both")
    ww = w.float().requires_grad_(frozen != "weight" and frozen != "both")
    loss = fused_linear_cross_entropy(hh, ww, y, backend=backend, chunk_tokens=16)
    check_close(loss, ref[0].float(), name="loss")
    if frozen == "both":
        assert not loss.requires_grad
        return
    loss.backward()
    for t, r in ((hh, ref[1]), (ww, ref[2])):
        if t.requires_grad:
            check_close(t.grad, r.float(), name="grad")
        else:
            assert t.grad is None


def test_no_grad_computes_the_loss_only(monkeypatch):
    """Evaluation: the kernel's gradient pass is compiled out (WRITE_GRAD=False)."""
    h, w, y = _inputs(37, 48, 301)
    seen = []
    real = ce_kernel.cross_entropy_loss_and_grad_

    def spy(z, labels, **kw):
        seen.append(kw["grad_scale"])
        return real(z, labels, **kw)

    monkeypatch.setattr(ce_kernel, "cross_entropy_loss_and_grad_", spy)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h.float(), w.float(), y, backend="triton",
                                          chunk_tokens=16)
    check_close(loss, _ref(h, w, y).float(), name="loss")
    assert seen == [None] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_label_ignored(backend):
    h, w, _ = _inputs(9, 16, 301)
    y = torch.full((9,), IGNORE, device=DEVICE)
    loss, dh, dw = _run(fused_linear_cross_entropy, h, w, y, torch.float32,
                        backend=backend, chunk_tokens=4)
    assert loss.item() == 0.0
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_other_ignore_index_and_batched_shapes():
    """(B, S, d) hidden with (B, S) labels, as the model has them; ignore_index=0."""
    h, w, y = _inputs(2 * 9, 16, 301, ignore_every=0)
    y[::4] = 0
    out = _run(lambda a, b, c, **kw: fused_linear_cross_entropy(
        a.view(2, 9, 16), b, c.view(2, 9), **kw), h, w, y, torch.float32,
        backend="triton", chunk_tokens=5, ignore_index=0)
    ref = _run(lambda a, b, c: _ref(a, b, c, ignore_index=0), h, w, y, torch.float64)
    for o, r in zip(out, ref):
        check_close(o, r.float())


# ------------------------------------------------------------------------- the kernel


def _kernel_ref(z, y, scale):
    """fp64 per-row loss and (softmax − onehot) · scale, ignored rows 0."""
    zz = z.double().requires_grad_()
    rows = F.cross_entropy(zz, y, ignore_index=IGNORE, reduction="none")
    (dz,) = torch.autograd.grad(rows.sum() * scale, zz)
    return rows, dz


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("v,block", [(301, 64), (1000, 128), (33, None)])
def test_kernel_on_strided_rows(v, block, dtype, monkeypatch):
    """Logits rows inside a wider buffer (row stride ≠ V), several BLOCK-wide chunks
    with a partial last one; the gradient lands in place and the padding is untouched."""
    n = 13
    z = (torch.randn(n, v, device=DEVICE) * 4).to(dtype)
    y = torch.randint(0, v, (n,), device=DEVICE)
    y[[2, 7]] = IGNORE
    buf = torch.full((n, v + 5), 7.0, dtype=dtype, device=DEVICE)
    view = buf[:, :v]
    view.copy_(z)
    launches = count_launches(monkeypatch, ce_kernel._cross_entropy_kernel)
    scale = torch.tensor([0.25], device=DEVICE)
    rows = cross_entropy_loss_and_grad_(view, y, grad_scale=scale, block=block)
    assert launches == {"_cross_entropy_kernel": 1}
    ref_rows, ref_dz = _kernel_ref(z, y, 0.25)
    check_close(rows, ref_rows.float(), name="loss", atol=1e-5)
    lowp = ref_dz.to(dtype) if dtype != torch.float32 else None
    check_close(view, ref_dz if lowp is not None else ref_dz.float(), lowp, name="dz",
                atol=1e-7)
    assert torch.equal(buf[:, v:], torch.full_like(buf[:, v:], 7.0))
    assert torch.equal(view[[2, 7]], torch.zeros_like(view[[2, 7]]))


def test_kernel_loss_only_and_float_scale():
    z = torch.randn(5, 301, device=DEVICE)
    y = torch.randint(0, 301, (5,), device=DEVICE)
    before = z.clone()
    rows = cross_entropy_loss_and_grad_(z, y, grad_scale=None, block=64)
    assert torch.equal(z, before)  # no gradient pass
    ref_rows, ref_dz = _kernel_ref(before, y, 0.5)
    check_close(rows, ref_rows.float())
    cross_entropy_loss_and_grad_(z, y, grad_scale=0.5, block=64)
    check_close(z, ref_dz.float(), atol=1e-7)


def test_kernel_label_out_of_range_is_nan_in_its_row_only():
    z = torch.randn(3, 40, device=DEVICE)
    y = torch.tensor([1, 40, -5], device=DEVICE)
    rows = cross_entropy_loss_and_grad_(z, y, grad_scale=1.0, block=16)
    assert rows[0].isfinite() and rows[1:].isnan().all()
    assert z[0].isfinite().all() and z[1:].isnan().all()


def test_cross_entropy_triton_function():
    """The logits-level autograd Function: mean loss, gradient via the logits' buffer."""
    z = torch.randn(11, 301, device=DEVICE) * 3
    y = torch.randint(0, 301, (11,), device=DEVICE)
    y[4] = IGNORE
    zz = z.clone().requires_grad_()
    loss = cross_entropy_triton(zz * 1.0, y)  # a non-leaf, as lm_head's output is
    (dz,) = torch.autograd.grad(loss * 2.0, zz)
    zr = z.double().requires_grad_()
    ref = cross_entropy_ref(zr, y)
    (dr,) = torch.autograd.grad(ref * 2.0, zr)
    check_close(loss, ref.float(), name="loss")
    check_close(dz, dr.float(), name="dz", atol=1e-7)


def test_kernel_bad_inputs():
    z = torch.randn(4, 10, device=DEVICE)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="unit column stride"):
        cross_entropy_loss_and_grad_(torch.randn(10, 4, device=DEVICE).t(), y)
    with pytest.raises(ValueError, match="must be 2-D"):
        cross_entropy_loss_and_grad_(z[None], y)
    with pytest.raises(ValueError, match=r"labels \(3,\) must be \(4,\)"):
        cross_entropy_loss_and_grad_(z, y[:3])
    with pytest.raises(ValueError, match="integer"):
        cross_entropy_loss_and_grad_(z, y.float())
    with pytest.raises(ValueError, match="power of two"):
        cross_entropy_loss_and_grad_(z, y, block=100)


# ------------------------------------------------------------------------------ memory


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns, in bytes (the interpreter views
    a kernel argument's storage as bytes), and its op."""

    def __enter__(self):
        self.largest, self.op = 0, None
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.nbytes > self.largest:
                self.largest, self.op = t.nbytes, func
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tensor_of_all_the_logits(backend):
    """Forward and backward of the chunked paths make nothing larger than one chunk of
    logits (c, V); the eager path does make the (N, V) logits, so the probe can fail."""
    n, d, v, chunk = 64, 8, 301, 16
    h, w, y = _inputs(n, d, v)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    with LargestOutput() as probe:
        loss = fused_linear_cross_entropy(hh, ww, y, backend=backend, chunk_tokens=chunk)
        loss.backward()
    if backend == "eager":
        assert probe.largest == n * v * 4
    else:
        assert probe.largest == chunk * v * 4, probe.op


def test_default_chunk_rule():
    rule = loss_switch.default_chunk_tokens
    assert rule(16384, 32000, 2) == 8192  # 1.05 GB of bf16 logits: 2 chunks
    assert rule(16384, 128256, 2) == 2048  # 4.2 GB: 8 chunks
    assert rule(16384, 32000, 4) == 4096
    assert rule(37, 301, 4) == 37  # small: one chunk
    assert rule(16383, 32000, 2) == 8192  # equal chunks, the last one row short
    assert 16384 * 32000 * 2 / rule(16384, 32000, 2) <= loss_switch.CHUNK_BYTES * 2


# -------------------------------------------------------------------- checks, dispatch


def test_bad_inputs_fail_early():
    h, w, y = _inputs(6, 16, 40)
    h, w = h.float(), w.float()
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match="not its transpose"):
        f(h, w.t(), y)
    with pytest.raises(ValueError, match="one per token"):
        f(h, w, y[:5])
    with pytest.raises(ValueError, match="integer"):
        f(h, w, y.float())
    with pytest.raises(ValueError, match="torch.autocast"):
        f(h.bfloat16(), w, y)
    with pytest.raises(ValueError, match=r"label 40 is outside \[0, 40\)"):
        f(h.cpu(), w.cpu(), torch.full_like(y, 40).cpu())  # checked where it is cheap
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        f(h, w, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="choose False"):
        f(h, w, y, backend="liger")


def test_resolve_backend():
    r = loss_switch.resolve_backend
    assert r(False) == r(None) == "eager"
    assert r(True, "cpu") == "chunked"
    assert r(True, "cuda") == "triton"
    assert r("chunked", "cpu") == "chunked"
    assert r("triton", DEVICE) == "triton"  # the interpreter on a CPU
    with pytest.raises(ValueError, match=r"one of \('eager', 'chunked', 'triton'\)"):
        r("fast")


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_triton_without_gpu_or_interpreter(strict, monkeypatch):
    import colossal_lab.kernels

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if strict:
        with pytest.raises(switches.BackendUnavailable, match="TRITON_INTERPRET"):
            loss_switch.resolve_backend("triton", "cpu")
        return
    monkeypatch.delenv(switches.STRICT_ENV)
    with pytest.warns(UserWarning, match="TRITON_INTERPRET=1; using 'chunked'"):
        assert loss_switch.resolve_backend("triton", "cpu") == "chunked"
    h, w, y = (t.cpu() for t in _inputs(5, 16, 40))  # CPU tensors: no GPU to run on
    launches = count_launches(monkeypatch, ce_kernel._cross_entropy_kernel)
    loss = fused_linear_cross_entropy(h.float(), w.float(), y, backend="triton")
    check_close(loss, _ref(h, w, y).float())
    assert launches == {}  # the torch path ran


class _Head(nn.Module):
    loss_backend = False

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8, bias=False)


def test_apply_sets_every_loss_module():
    model = nn.Sequential(_Head(), nn.Linear(2, 2), _Head())
    assert loss.apply(model, "triton") == 2
    assert [m.loss_backend for m in model if isinstance(m, _Head)] == ["triton"] * 2
    assert loss.apply(model, True) == 2 and model[0].loss_backend is True
    assert not hasattr(model[1], "loss_backend")
    with pytest.raises(ValueError, match="choose False"):
        loss.apply(model, "cut")
    assert model[0].loss_backend is True  # unchanged by the rejected value


# --------------------------------------------------------------------------- benchmark


def test_benchmark_quick(few_cpu_reps):
    from colossal_lab.benchmarks import cross_entropy as bench

    rows = bench.run(quick=True)
    assert {r["provider"] for r in rows} == {"eager", "triton"}
    for r in rows:
        assert "error" not in r, r
        assert r["fwd_bwd_ms"] > 0 and r["speedup"] > 0
    losses = [r["loss"] for r in rows]
    assert abs(losses[0] - losses[1]) < 1e-4  # same inputs, same loss


# ------------------------------------------------------------- dW accumulated in fp32


def test_fp32_out_probe_matches_the_device():
    """The probe finds cuBLAS's fp32-output GEMM on CUDA and none on the CPU (where
    aten::mm.dtype is not registered), so the CPU keeps the zeroed-buffer path."""
    dev = torch.device(DEVICE)
    assert loss_switch.mm_fp32_out_supported(dev) == (dev.type == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,d,v,chunk", [(37, 48, 1000, 10), (4099, 256, 3001, 1024)])
def test_fp32_out_dw_matches_the_buffer_path(n, d, v, chunk, monkeypatch):
    """bf16 chunks: dW from GEMMs that write and accumulate in fp32 equals dW from bf16
    partials added into a zeroed fp32 buffer within one bf16 rounding per chunk, and
    both meet the fp64 reference by the 2x rule; the loss and dh are the same path."""
    h, w, y = _inputs(n, d, v)
    fast = _run(fused_linear_cross_entropy, h, w, y, torch.bfloat16, chunk_tokens=chunk)
    monkeypatch.setitem(loss_switch._FP32_OUT, "cuda", False)
    slow = _run(fused_linear_cross_entropy, h, w, y, torch.bfloat16, chunk_tokens=chunk)
    torch.testing.assert_close(fast[0], slow[0], rtol=0, atol=0)
    torch.testing.assert_close(fast[1], slow[1], rtol=0, atol=0)
    _check(fast, h, w, y, torch.bfloat16, 1e-5)
    _check(slow, h, w, y, torch.bfloat16, 1e-5)
