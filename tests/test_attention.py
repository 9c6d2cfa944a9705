"""Switch 1: our Triton FlashAttention-2 against the naive reference.

On a CPU the kernels run under the Triton interpreter with one small tile (32×16), so
the odd lengths below exercise every path of the kernels: several key blocks, the
diagonal split into steps, and the ragged last block (S = 1, 17, 67, 130). The output
and all three gradients are checked against `attention_ref(..., upcast=True)`.

Tolerances. fp32 on the interpreter: errors are ~1e-6 (float rounding in a different
summation order), so atol 2e-5 passes with margin and still fails any real bug (a wrong
mask, block or scale gives errors of 1e-2 and more). Low precision: the 2x rule of
`colossal_lab.testing.correctness` against the same reference computed in bf16/fp16. fp32 on a
GPU: Triton's matmuls run in tf32, so the low-precision reference is the reference
computed with tf32 matmuls.
"""

from __future__ import annotations

import math

import pytest
import torch

from colossal_lab import switches
from colossal_lab.kernels.flash_attention import (
    SUPPORTED_HEAD_DIMS,
    flash_attention,
    flash_attention_forward,
)
from colossal_lab.ops.attention import attention, attention_ref, resolve_backend
from colossal_lab.switches import BackendUnavailable
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_launches

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL_FP32 = 2e-5 if DEVICE == "cpu" else 1e-3  # GPU: on top of 2 x err(tf32 reference)
ATOL_DIRECT = 2e-5 if DEVICE == "cpu" else 1e-2  # plain comparisons, tf32 on a GPU


def _inputs(b, hq, hkv, s, d, dtype=torch.float32, device=DEVICE):
    q = torch.randn(b, hq, s, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
    do = torch.randn(b, hq, s, d, device=device, dtype=dtype)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do, cast=None):
    """(out, dq, dk, dv) of `fn`, on fresh leaves (optionally cast first)."""
    leaves = [t.detach().to(cast or t.dtype).requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do.to(out.dtype))
    return (out, *grads)


def _check(q, k, v, do, causal, atol=ATOL_FP32, fn=None):
    """Our kernel vs the fp32 reference; the low-precision reference sets the bound."""
    fn = fn or (lambda q, k, v: flash_attention(q, k, v, causal))
    ours = _fwd_bwd(fn, q, k, v, do)
    ref = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, causal, upcast=True),
                   q, k, v, do, cast=torch.float32)
    if q.dtype != torch.float32:
        lowp = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, causal), q, k, v, do)
    elif q.is_cuda:  # tl.dot on fp32 is tf32: compare with a tf32 reference
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            lowp = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, causal), q, k, v, do)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    else:
        lowp = (None,) * 4
    for name, o, r, lp in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert o.dtype == q.dtype and o.shape == r.shape, name
        check_close(o, r, lp, name=name, atol=atol, rtol=0.0, verbose=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_len", [1, 17, 67, 130])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference(causal, heads, kv_heads, seq_len, head_dim):
    _check(*_inputs(1, heads, kv_heads, seq_len, head_dim), causal)


@pytest.mark.parametrize("seq_len", [17, 130])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_atomic_dq(causal, heads, kv_heads, seq_len):
    """FA2's backward: dQ accumulated with atomics by the dK/dV kernel."""
    _check(*_inputs(1, heads, kv_heads, seq_len, 64), causal,
           fn=lambda q, k, v: flash_attention(q, k, v, causal, dq_mode="atomic"))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_batch_and_non_contiguous_inputs(causal):
    """q, k, v as transposes of (B, S, H, D) tensors, as a model produces them, and a
    non-contiguous dO: the kernels read the strides, nothing is copied."""
    b, s, hq, hkv, d = 2, 67, 4, 2, 64
    q = torch.randn(b, s, hq, d, device=DEVICE).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device=DEVICE).transpose(1, 2)
    v = torch.randn(b, s, hkv, d, device=DEVICE).transpose(1, 2)
    do = torch.randn(b, hq, d, s, device=DEVICE).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or do.is_contiguous())
    _check(q, k, v, do, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision(dtype):
    """bf16/fp16 (upcast to fp32 inside the kernels under the interpreter)."""
    _check(*_inputs(1, 4, 2, 67, 64, dtype=dtype), causal=True, atol=1e-3)


def test_custom_scale_and_lse():
    b, h, s, d = 1, 2, 40, 64
    q, k, v, _ = _inputs(b, h, h, s, d)
    scale = 0.3
    out, lse = flash_attention_forward(q, k, v, causal=True, sm_scale=scale)
    # softmax(q kᵀ · scale) = the reference's softmax(q' kᵀ / √d) with q' = q · scale · √d
    ref = attention_ref(q * (scale * math.sqrt(d)), k, v, causal=True, upcast=True)
    check_close(out, ref, name="out", atol=ATOL_DIRECT, rtol=0.0)
    scores = (q @ k.transpose(-2, -1)).double() * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    lse_ref = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    check_close(lse, lse_ref, name="lse", atol=ATOL_DIRECT, rtol=0.0)


def test_errors_say_what_to_change():
    q, k, v, _ = _inputs(1, 8, 3, 16, 64)
    with pytest.raises(ValueError, match="not a multiple of Hkv=3"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match="not a multiple of Hkv=3"):
        attention(q, k, v, backend="triton")
    q, k, v, _ = _inputs(1, 4, 4, 16, 48)
    with pytest.raises(ValueError, match=r"head_dim=48 is not supported.*\(32, 64, 128, 256\)"):
        flash_attention(q, k, v)
    assert 48 not in SUPPORTED_HEAD_DIMS
    q, k, v, _ = _inputs(1, 4, 4, 16, 64)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        flash_attention(q, k[:, :, :8], v[:, :, :8])
    with pytest.raises(ValueError, match="dq_mode"):
        flash_attention(q, k, v, dq_mode="magic")
    with pytest.raises(ValueError, match="sm_scale must be positive"):
        flash_attention(q, k, v, sm_scale=-1.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dispatch_backends_agree(causal):
    """`attention()` through each backend that runs on a CPU gives the same numbers."""
    q, k, v, do = _inputs(2, 4, 2, 33, 64)
    results = {name: _fwd_bwd(lambda q, k, v, name=name: attention(q, k, v, causal, name),
                              q, k, v, do)
               for name in ("naive", "sdpa", "sdpa-math", "triton")}
    rtol = 0.0 if DEVICE == "cpu" else 5e-3  # tf32 matmuls on a GPU
    for name, got in results.items():
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, results["naive"]):
            check_close(a, b, name=f"{name}:{what}", atol=ATOL_FP32, rtol=rtol)


def test_resolve_backend():
    assert resolve_backend(False) == "naive"
    assert resolve_backend(True, "cpu") == "sdpa"
    assert resolve_backend("triton", DEVICE) == "triton"  # CPU: the interpreter
    assert resolve_backend(True, DEVICE, dtype=torch.float32) == "sdpa"  # no fp32 cuDNN
    if torch.cuda.is_available():
        assert resolve_backend(True, "cuda") in ("cudnn", "sdpa")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seq_len,head_dim", [(1000, 128), (4096, 128), (777, 64)])
def test_gpu_low_precision(seq_len, head_dim, causal, dtype):
    """Real GPU tiles (autotuned) in bf16/fp16: err ≤ 2 · err(reference in low precision)."""
    _check(*_inputs(2, 8, 2, seq_len, head_dim, dtype=dtype, device="cuda"), causal,
           atol=1e-3)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_unavailable_backend_falls_back_or_raises(strict, monkeypatch):
    """cuDNN attention needs a GPU and has no fp32 kernel: fp32 (or CPU) inputs go to
    PyTorch's SDPA with one warning, or raise in strict mode."""
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if not strict:
        monkeypatch.delenv(switches.STRICT_ENV)
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    if strict:
        with pytest.raises(BackendUnavailable, match="'cudnn'.*refuses.*'sdpa'"):
            attention(q, k, v, causal=True, backend="cudnn")
        return
    with pytest.warns(UserWarning, match="'cudnn'.*using 'sdpa'"):
        out = attention(q, k, v, causal=True, backend="cudnn")
    check_close(out, attention_ref(q, k, v, True), name="fp32 via cudnn",
                atol=ATOL_DIRECT)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_unsupported_head_dim_falls_back_to_sdpa(strict, monkeypatch):
    """The Triton kernel takes head dims in SUPPORTED_HEAD_DIMS; the dispatcher sends
    others to SDPA (one warning) like every other switch, or raises in strict mode."""
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if not strict:
        monkeypatch.delenv(switches.STRICT_ENV)
    q, k, v, do = _inputs(1, 4, 2, 17, 48)
    assert 48 not in SUPPORTED_HEAD_DIMS
    assert resolve_backend("triton", DEVICE, head_dim=64) == "triton"
    if strict:
        with pytest.raises(BackendUnavailable, match="head_dim in .* not 48"):
            attention(q, k, v, backend="triton")
        return
    with pytest.warns(UserWarning, match="not 48; using 'sdpa'"):
        ours = _fwd_bwd(lambda q, k, v: attention(q, k, v, backend="triton"),
                        q, k, v, do)
    ref = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, True), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        check_close(a, b, name=name, atol=ATOL_FP32,
                    rtol=0.0 if DEVICE == "cpu" else 5e-3)


def test_triton_backend_runs_the_kernel(monkeypatch):
    """backend="triton" launches our kernels (under the interpreter on a CPU): the
    forward once, the backward's preprocess, dK/dV and dQ kernels once each."""
    from colossal_lab.kernels import flash_attention as fa

    launches = count_launches(monkeypatch, fa._attn_fwd_kernel,
                              fa._attn_bwd_preprocess_kernel, fa._attn_bwd_dkdv_kernel,
                              fa._attn_bwd_dq_kernel)
    q, k, v, do = _inputs(1, 2, 1, 17, 32)
    _fwd_bwd(lambda q, k, v: attention(q, k, v, backend="triton"), q, k, v, do)
    assert launches == {"_attn_fwd_kernel": 1, "_attn_bwd_preprocess_kernel": 1,
                        "_attn_bwd_dkdv_kernel": 1, "_attn_bwd_dq_kernel": 1}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_triton_without_gpu_or_interpreter(strict, monkeypatch):
    """CPU tensors without the interpreter: Triton cannot run, the dispatcher says so."""
    import colossal_lab.kernels

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if not strict:
        monkeypatch.delenv(switches.STRICT_ENV)
        with pytest.warns(UserWarning, match="TRITON_INTERPRET=1; using 'sdpa'"):
            assert resolve_backend("triton", "cpu") == "sdpa"
    else:
        with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
            resolve_backend("triton", "cpu")
