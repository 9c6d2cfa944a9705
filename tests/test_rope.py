"""RoPE switch: the Triton kernel rotates q and k in one launch, forward and backward,
equal to the reference and to the model's own `apply_rotary` (transposed), on strided
column slices of a fused qkv output too; the switch dispatches, falls back and applies.
On a CPU the kernel runs under the interpreter (small shapes: the file takes seconds)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from colossal_lab.benchmarks import fused_qkv
from colossal_lab.benchmarks import rope as rope_bench
from colossal_lab.config import tiny
from colossal_lab.model import RotaryEmbedding, apply_rotary, build_model
from colossal_lab.ops import rope
from colossal_lab.ops.rope import rotary_ref
from colossal_lab.switches import rope as rope_switch
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 0.0)]
"""(dtype, atol, rtol): bf16 must be within 2x the error of the model's bf16 rotary
(+ 1e-5); fp32 within 1e-5 + 1e-5·max|ref| of the fp64 reference."""
SHAPES = {  # (B, S, Hq, Hkv, D)
    "S1": (1, 1, 4, 4, 16),
    "gqa-6:2": (3, 37, 6, 2, 64),
    "mqa-D128": (1, 37, 4, 1, 128),
    "D24": (2, 5, 3, 3, 24),  # D/2 = 12: a masked column block
}


def _tables(length: int, D: int, theta: float = 10000.0):
    return RotaryEmbedding(D, length, theta)(length, DEVICE)  # (length, D) fp32


class Case:
    """Random q, k (and v) for one shape, as separate tensors or as column slices of
    one fused (B, S, (Hq + 2·Hkv)·D) output; `views(dtype)` makes fresh leaves."""

    def __init__(self, B, S, Hq, Hkv, D, fused: bool):
        self.shape, self.fused = (B, S, Hq, Hkv, D), fused
        self.base = torch.randn(B, S, (Hq + 2 * Hkv) * D, device=DEVICE)
        self.dq = torch.randn(B, S, Hq, D, device=DEVICE)
        self.dk = torch.randn(B, S, Hkv, D, device=DEVICE)

    def views(self, dtype):
        """(leaves, q (B, S, Hq, D), k (B, S, Hkv, D))."""
        B, S, Hq, Hkv, D = self.shape
        leaf = self.base.detach().to(dtype).clone().requires_grad_()
        if self.fused:  # strided rows: (Hq + 2·Hkv)·D apart
            q, k, _ = leaf.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            return (leaf,), q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D))
        q, k, _ = leaf.detach().split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = q.unflatten(-1, (Hq, D)).contiguous().requires_grad_()
        k = k.unflatten(-1, (Hkv, D)).contiguous().requires_grad_()
        return (q, k), q, k

    def run(self, fn, dtype, cos, sin):
        """Outputs and the leaves' gradients of `fn(q, k, cos, sin)` in `dtype`."""
        leaves, q, k = self.views(dtype)
        q_rot, k_rot = fn(q, k, cos, sin)
        grads = torch.autograd.grad((q_rot, k_rot), leaves,
                                    (self.dq.to(dtype), self.dk.to(dtype)))
        return (q_rot, k_rot, *grads)


def _model_rotary(q, k, cos, sin):
    """The model's own RoPE: (B, H, S, D) views in, back to (B, S, H, D)."""
    S = q.shape[1]
    q_rot, k_rot = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos[:S], sin[:S])
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


def _check_against_references(fn, case, dtype, atol, rtol, cos, sin):
    """fn's outputs and gradients against rotary_ref in fp64, and against the model's
    apply_rotary in `dtype` (fp32: equal within rtol; bf16: the 2x rule)."""
    outs = case.run(fn, dtype, cos, sin)
    names = ("q_rot", "k_rot") + (("dqkv",) if case.fused else ("dq", "dk"))
    assert all(o.dtype == dtype for o in outs)
    assert outs[0].is_contiguous() and outs[1].is_contiguous()  # (B, S, H, D)
    ref = case.run(rotary_ref, torch.float64, cos, sin)
    model = case.run(_model_rotary, dtype, cos, sin)
    for name, out, r, m in zip(names, outs, ref, model):
        if dtype == torch.float32:
            check_close(out, r, name=name, atol=atol, rtol=rtol)
            check_close(out, m, name=name + " vs model", atol=atol, rtol=rtol)
        else:
            check_close(out, r, m, name=name, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=["fp32", "bf16"])
def test_rotary_triton_matches_reference_and_model(shape, fused, dtype, atol, rtol):
    """Forward and backward through the switch's dispatch; the tables are longer than
    S (the model's are built for max_position_embeddings)."""
    case = Case(*shape, fused=fused)
    cos, sin = _tables(shape[1] + 11, shape[-1])
    _check_against_references(lambda *a: rope.rotary(*a, backend="triton"), case, dtype,
                              atol, rtol, cos, sin)


def _split_rotary_run(backend, case, dtype, cos, sin, dv):
    """q_rot, k_rot, v and the gradient of the fused qkv leaf through
    `rope.split_rotary`, with dq, dk, dv flowing back; v's gradient arrives transposed
    (as the attention's does)."""
    B, S, Hq, Hkv, D = case.shape
    leaf = case.base.detach().to(dtype).clone().requires_grad_()
    q_rot, k_rot, v = rope.split_rotary(leaf, Hq, Hkv, cos, sin, backend)
    grad, = torch.autograd.grad((q_rot, k_rot, v), leaf,
                                (case.dq.to(dtype), case.dk.to(dtype), dv.to(dtype)))
    return q_rot, k_rot, v, grad


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_rotary_writes_one_qkv_gradient(shape, dtype):
    """The fused projection's split and RoPE as one node ("triton") against the split's
    views and `rotary` ("eager" and "triton" on the views): the same q, k, v and qkv
    gradient, v a view of qkv, and no concatenation in the backward."""
    case = Case(*shape, fused=True)
    B, S, Hq, Hkv, D = shape
    cos, sin = _tables(S + 3, D)
    dv = torch.randn(B, Hkv, S, D, device=DEVICE).transpose(1, 2)  # (B, S, H, D) strided
    fused = _split_rotary_run("triton", case, dtype, cos, sin, dv)
    assert fused[2]._base is not None  # v is a view of the projection's output
    assert fused[0].is_contiguous() and fused[1].is_contiguous()

    from colossal_lab.kernels.rope import split_heads

    # (bf16 against the eager chain is the 2x rule of the tests above, on the views)
    for backend in ("triton", "eager") if dtype == torch.float32 else ("triton",):
        leaf = case.base.detach().to(dtype).clone().requires_grad_()
        q, k, v = split_heads(leaf, Hq, Hkv)  # views; autograd concatenates dq, dk, dv
        q_rot, k_rot = rope.rotary(q, k, cos, sin, backend)
        grad, = torch.autograd.grad((q_rot, k_rot, v), leaf,
                                    (case.dq.to(dtype), case.dk.to(dtype), dv.to(dtype)))
        for name, got, want in zip(("q_rot", "k_rot", "v", "dqkv"), fused,
                                   (q_rot, k_rot, v, grad)):
            if backend == "triton":  # the same kernel: bit-equal
                assert torch.equal(got, want), name
            else:
                check_close(got, want, name=name, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused[3][..., (Hq + Hkv) * D:],
                       dv.to(dtype).reshape(B, S, Hkv * D))  # dv lands as it came


def test_split_rotary_launches_and_refuses_bad_widths(monkeypatch):
    """One launch each way; the backward neither concatenates nor copies (dq, dk
    rotated and dv copied into the one qkv gradient by the launch); a width that is not
    (n_q + 2·n_kv)·D is refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import colossal_lab.kernels.rope as kr

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    launches = count_launches(monkeypatch, kr._rope_kernel)
    counted = kr._rope_kernel.run

    def unrecorded(*args, **kwargs):  # the interpreter's own tensor ops are not ours
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return counted(*args, **kwargs)

    monkeypatch.setattr(kr._rope_kernel, "run", unrecorded)
    case = Case(2, 5, 4, 2, 16, fused=True)
    cos, sin = _tables(5, 16)
    leaf = case.base.detach().clone().requires_grad_()
    q_rot, k_rot, v = rope.split_rotary(leaf, 4, 2, cos, sin, "triton")
    with Ops() as ops:
        torch.autograd.grad((q_rot, k_rot, v), leaf,
                            (case.dq, case.dk, torch.randn(2, 5, 2, 16, device=DEVICE)))
    assert launches == {"_rope_kernel": 2}
    assert not {"cat", "copy_"} & set(ops.names), ops.names
    with pytest.raises(ValueError, match="expected \\(B, S, \\(n_q"):
        rope.split_rotary(torch.randn(1, 3, 100, device=DEVICE), 4, 2, cos, sin, "triton")


def test_rope_outputs_with_scattered_tokens_are_refused():
    """Given outputs (the qkv gradient's column slices) must have contiguous heads and
    evenly spaced tokens; a transposed (B, H, S, D) view has neither and is refused."""
    import colossal_lab.kernels.rope as kr

    cos, sin = _tables(5, 16)
    cos_h, sin_h = kr.half_tables(cos.to(DEVICE), sin.to(DEVICE), 5, 16)
    q = torch.randn(2, 5, 4, 16, device=DEVICE)
    k = torch.randn(2, 5, 2, 16, device=DEVICE)
    bad = torch.empty(2, 4, 5, 16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="evenly spaced tokens"):
        kr._launch(q, k, cos_h, sin_h, backward=True, q_out=bad,
                   k_out=torch.empty_like(k))


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=["fp32", "bf16"])
def test_rope_triton_half_and_batched_tables(dtype, atol, rtol):
    """rope_triton directly, with the (S', D/2) half tables and with Hugging Face's
    (1, S, D) tables: the same result as the full (S, D) tables."""
    from colossal_lab.kernels.rope import rope_triton

    case = Case(2, 9, 4, 2, 32, fused=True)
    cos, sin = _tables(9, 32)
    full = case.run(rope_triton, dtype, cos, sin)
    half = case.run(rope_triton, dtype, cos[:, :16], sin[:, :16])
    batched = case.run(rope_triton, dtype, cos[None], sin[None])
    for a, b, c in zip(full, half, batched):
        assert torch.equal(a, b) and torch.equal(a, c)
    _check_against_references(rope_triton, case, dtype, atol, rtol, cos, sin)


def test_reference_is_the_models_rotary():
    """rotary_ref in (B, S, H, D) is `model.apply_rotary` in (B, H, S, D), bit for bit,
    in fp32 and bf16: the "eager" backend is what the model ran."""
    cos, sin = _tables(20, 16)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 13, 4, 16, device=DEVICE).to(dtype)
        k = torch.randn(2, 13, 2, 16, device=DEVICE).to(dtype)
        for a, b in zip(rotary_ref(q, k, cos, sin), _model_rotary(q, k, cos, sin)):
            assert torch.equal(a, b)
        halves = rotary_ref(q, k, cos[:, :8], sin[:, :8])
        for a, b in zip(halves, rotary_ref(q, k, cos, sin)):
            assert torch.equal(a, b)


def test_transposed_input_and_odd_gradient_strides():
    """q stored as (B, H, S, D) and handed over transposed (head stride S·D); gradients
    that reach the outputs transposed (a consumer in (B, H, S, D)) and expanded
    (stride 0, from a sum): the kernel takes any strides over B, S and H."""
    from colossal_lab.kernels.rope import rope_triton

    B, S, Hq, Hkv, D = 2, 7, 3, 1, 16
    cos, sin = _tables(S, D)
    q_bhsd = torch.randn(B, Hq, S, D, device=DEVICE, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, device=DEVICE, requires_grad=True)
    w = torch.randn(B, Hq, S, D, device=DEVICE)

    def loss(fn):
        q_rot, k_rot = fn(q_bhsd.transpose(1, 2), k, cos, sin)
        return (q_rot.transpose(1, 2) * w).sum() + k_rot.sum()

    ours = torch.autograd.grad(loss(rope_triton), (q_bhsd, k))
    ref = torch.autograd.grad(loss(rotary_ref), (q_bhsd, k))
    for name, a, b in zip(("dq", "dk"), ours, ref):
        check_close(a, b, name=name)


def test_empty_inputs():
    from colossal_lab.kernels.rope import rope_triton

    cos, sin = _tables(4, 16)
    q = torch.randn(2, 0, 4, 16, device=DEVICE)
    k = torch.randn(2, 0, 2, 16, device=DEVICE)
    q_rot, k_rot = rope_triton(q, k, cos, sin)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


# --------------------------------------------------------------- what runs, what is saved


def test_one_launch_forward_one_backward(monkeypatch):
    """q and k share one launch each way, and "triton" runs our kernel, not a stand-in."""
    import colossal_lab.kernels.rope as kr

    launches = count_launches(monkeypatch, kr._rope_kernel)
    counted = kr._rope_kernel.run

    def unrecorded(*args, **kwargs):  # the interpreter's own tensor ops are not ours
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return counted(*args, **kwargs)

    monkeypatch.setattr(kr._rope_kernel, "run", unrecorded)
    case = Case(2, 5, 4, 2, 16, fused=True)
    cos, sin = _tables(5, 16)
    case.run(lambda *a: rope.rotary(*a, backend="triton"), torch.float32, cos, sin)
    assert launches == {"_rope_kernel": 2}


def test_saves_only_the_tables():
    """Nothing of q or k is kept for the backward: only the cos/sin tables."""
    from colossal_lab.kernels.rope import rope_triton

    cos, sin = _tables(6, 16)
    q = torch.randn(1, 6, 4, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 6, 2, 16, device=DEVICE, requires_grad=True)
    saved = fused_qkv.saved_bytes(lambda: rope_triton(q, k, cos, sin))
    assert saved == cos.nbytes + sin.nbytes


def test_tiled_heads(monkeypatch):
    """More heads than one tile holds: a second grid axis of head blocks (and k heads
    fewer than q heads masked in the later blocks)."""
    import colossal_lab.kernels.rope as kr

    monkeypatch.setattr(kr, "MAX_TILE", 16)  # 2 heads of D/2 = 8 per program
    case = Case(1, 3, 5, 3, 16, fused=True)
    cos, sin = _tables(3, 16)
    assert kr._tiling(5, 8)[0] == 2
    _check_against_references(kr.rope_triton, case, torch.float32, 1e-5, 1e-5, cos, sin)


# ------------------------------------------------------------------------- the switch


def test_resolve_backend():
    assert rope.resolve_backend(False) == rope.resolve_backend(None) == "eager"
    assert rope.resolve_backend(True, "cpu") == "eager"
    assert rope.resolve_backend(True, "cuda") == "triton"
    assert rope.resolve_backend("compile", "cpu") == "compile"
    assert rope.resolve_backend("triton", DEVICE) == "triton"  # GPU, or the interpreter
    with pytest.raises(ValueError, match="rope_backend='flash'.*one of"):
        rope.resolve_backend("flash")


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_triton_without_gpu_or_interpreter(strict, monkeypatch):
    """CPU tensors without the interpreter: strict mode refuses, otherwise one warning
    and the eager reference."""
    import colossal_lab.fallback
    import colossal_lab.kernels

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr(colossal_lab.fallback, "WARNED", set())
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = RotaryEmbedding(8, 3, 10000.0)(3, "cpu")
    if strict:
        with pytest.raises(colossal_lab.fallback.BackendUnavailable,
                           match="TRITON_INTERPRET"):
            rope.rotary(q, k, cos, sin, "triton")
        return
    monkeypatch.delenv(colossal_lab.fallback.STRICT_ENV)
    with pytest.warns(UserWarning, match="TRITON_INTERPRET=1; using 'eager'"):
        out = rope.rotary(q, k, cos, sin, "triton")
    for a, b in zip(out, rotary_ref(q, k, cos, sin)):
        assert torch.equal(a, b)


def test_bad_inputs_raise_clear_errors():
    from colossal_lab.kernels.rope import rope_triton

    cos, sin = _tables(8, 16)
    q = torch.randn(2, 8, 4, 16, device=DEVICE)
    k = torch.randn(2, 8, 2, 16, device=DEVICE)
    bad = [
        ((q.flatten(2), k, cos, sin), "unflatten"),
        ((q, k[:1], cos, sin), "must agree in batch"),
        ((q[..., :15], k[..., :15], cos[:, :15], sin[:, :15]), "odd"),
        ((q, k, cos[:5], sin[:5]), "5 positions, fewer than the sequence length 8"),
        ((q, k, cos[:, :12], sin[:, :12]), "needs 16"),
        ((q, k, cos, sin[:, :8]), "same shape"),
        ((q, k, cos.expand(2, 8, 16), sin.expand(2, 8, 16)), "per-batch"),
        ((q.int(), k.int(), cos, sin), "float32"),
        ((q, k.double(), cos, sin), "float32"),
        ((q, k, cos.int(), sin.int()), "float table"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            rope_triton(*args)


def test_apply_sets_the_attribute_and_rejects_unknown_values():
    class Attn(nn.Module):
        rope_backend = False

    model = nn.Sequential(Attn(), nn.Linear(2, 2), nn.Sequential(Attn()))
    assert rope_switch.apply(model, "triton") == 2
    assert [m.rope_backend for m in model.modules()
            if isinstance(m, Attn)] == ["triton"] * 2
    assert rope_switch.apply(model, False) == 2 and model[0].rope_backend is False
    with pytest.raises(ValueError, match="rope_backend='fused'"):
        rope_switch.apply(model, "fused")
    llama = build_model(tiny(), "cpu")  # however many attention modules read it
    assert rope_switch.apply(llama, True) == sum(hasattr(type(m), "rope_backend")
                                          for m in llama.modules())


def test_compile_matches_reference():
    pytest.importorskip("torch._inductor")
    case = Case(1, 4, 2, 1, 8, fused=False)
    cos, sin = _tables(4, 8)
    out = case.run(lambda *a: rope.rotary(*a, backend="compile"), torch.float32, cos, sin)
    ref = case.run(rotary_ref, torch.float32, cos, sin)
    for a, b in zip(out, ref):
        check_close(a, b)


# ------------------------------------------------------------------------ the benchmark


def test_eager_traffic_matches_docstring():
    """Counted op by op: eager moves 10 N e each way (12 and 10 kernels), and with fused
    qkv its backward adds a transposing copy (2 N e) and the split's concatenation."""
    shape, S = rope_bench.Shape(4, 32, 32, 128), 4096
    n = shape.batch * S * (shape.heads + shape.kv_heads) * shape.head_dim * 2  # N e
    sep = rope_bench.eager_traffic(shape, S, "separate")
    fused = rope_bench.eager_traffic(shape, S, "fused")
    assert sep["fwd_kernels"] == 12 and sep["bwd_kernels"] == 10
    for nbytes in (sep["fwd_bytes"], sep["bwd_bytes"]):
        assert 10 * n <= nbytes < 10.05 * n  # + the tables, broadcast
    assert fused["fwd_bytes"] == sep["fwd_bytes"]
    assert fused["bwd_bytes"] - sep["bwd_bytes"] == 2 * n + 3.5 * n  # copy; zeros + cat
    ideal = rope_bench.moved_bytes(shape, S)
    assert ideal[0] == ideal[1] == 2 * n + 2 * S * 64 * 4


def test_benchmark_quick_runs(few_cpu_reps):
    rows = rope_bench.run(quick=True)
    ops = [r for r in rows if r["kind"] == "op"]
    assert {r["provider"] for r in ops} == {"eager", "triton"}
    assert {r["layout"] for r in ops} == set(rope_bench.LAYOUTS)
    for r in ops:
        assert "error" not in r, r
        for f in ("fwd_ms", "fwd_bwd_ms", "fwd_gbps", "fwd_bwd_gbps", "fwd_speedup"):
            assert r[f] > 0, (f, r)
    assert len([r for r in rows if r["kind"] == "traffic"]) == 2
    assert "triton" in rope_bench.summary(rows)
    json.dumps(rows)  # storable as a results file
