"""RoPE's backward with the e5m2 cast fused in (`kernels.rope_fp8`): against the unfused
path (`RotaryQKVFunction`'s backward writing dqkv, then `fp8_cast_transpose`) bit for
bit, on GQA and ragged shapes, delayed and dynamic scaling; the torch ops against the
kernel; the checks. CPU: the kernels run under the Triton interpreter."""

import pytest
import torch

from colossal_lab.kernels import fp8_cast
from colossal_lab.kernels.rope import half_tables, rope_qkv_triton
from colossal_lab.kernels.rope_fp8 import rope_fp8_backward, rope_fp8_backward_amax
from tests.conftest import requires_cuda

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (B, S, Hq, Hkv, D): GQA and ragged token counts (T = 14, 33: padding), D/2 not a power of 2
SHAPES = [(2, 7, 4, 2, 16), (1, 33, 2, 2, 32), (3, 5, 3, 1, 24), (1, 64, 1, 1, 16)]


def _same(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    diff = (a.float() != b.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def _tables(S, D):
    pos = torch.arange(S + 3, dtype=torch.float32)[:, None]
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    return ang.cos(), ang.sin()


def _grads(B, S, Hq, Hkv, D, dtype, seed):
    """dq, dk, dv in the layouts the attention's backward hands over: (B, H, S, D)
    tensors transposed to (B, S, H, D) views."""
    g = torch.Generator().manual_seed(seed)

    def one(H):
        return (torch.randn(B, H, S, D, generator=g) * 3).to(dtype).transpose(1, 2)

    return one(Hq), one(Hkv), one(Hkv)


def _unfused(dq, dk, dv, cos, sin, dtype, src, amax_out):
    B, S, Hq, D = dq.shape
    Hkv = dk.shape[2]
    qkv = torch.zeros(B, S, (Hq + 2 * Hkv) * D, dtype=dq.dtype, requires_grad=True)
    q, k, v = rope_qkv_triton(qkv, Hq, Hkv, cos, sin)
    torch.autograd.backward((q, k, v), (dq, dk, dv))
    return fp8_cast.fp8_cast_transpose(qkv.grad.reshape(B * S, -1), dtype, src,
                                       amax_out=amax_out, use_triton=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_fused_backward_writes_the_unfused_bits(shape, dtype, scaling):
    B, S, Hq, Hkv, D = shape
    cos, sin = _tables(S, D)
    cos_h, sin_h = half_tables(cos, sin, S, D)
    dq, dk, dv = _grads(B, S, Hq, Hkv, D, dtype, seed=sum(shape))
    if scaling == "dynamic":  # the amax-only pass gives the scale
        src = rope_fp8_backward_amax(dq, dk, dv, cos_h, sin_h, use_triton=True)
    else:  # a history below the amax: some elements saturate
        src = torch.tensor([0.5, 2.0, 1.0])
    af, ar = torch.zeros(1), torch.zeros(1)
    q, qt, inv = rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E5, src, amax_out=af,
                                   use_triton=True)
    rq, rqt, rinv = _unfused(dq, dk, dv, cos, sin, E5, src, ar)
    T = B * S
    _same(q, rq, "row-major")
    _same(qt, rqt, "transposed")
    assert qt.shape == ((Hq + 2 * Hkv) * D, fp8_cast.padded(T))
    assert qt[:, T:].float().abs().sum() == 0
    assert torch.equal(inv, rinv) and torch.equal(af, ar) and af.item() > 0
    if scaling == "dynamic":
        assert torch.equal(src, ar)  # the pass found the unfused cast's amax
    # the torch ops: the same bits
    tq, tqt, tinv = rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E5, src, use_triton=False)
    _same(tq, q, "torch row-major")
    _same(tqt, qt, "torch transposed")
    assert torch.equal(tinv, inv)


def test_one_layout_alone_and_e4m3():
    B, S, Hq, Hkv, D = SHAPES[0]
    cos, sin = _tables(S, D)
    cos_h, sin_h = half_tables(cos, sin, S, D)
    dq, dk, dv = _grads(B, S, Hq, Hkv, D, torch.bfloat16, seed=1)
    src = torch.tensor([4.0])
    both = rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E4, src, use_triton=True)
    q_only = rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E4, src, write_qt=False,
                               use_triton=True)
    qt_only = rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E4, src, write_q=False,
                                use_triton=True)
    assert q_only[1] is None and qt_only[0] is None
    _same(q_only[0], both[0], "row-major alone")
    _same(qt_only[1], both[1], "transposed alone")
    ref = _unfused(dq, dk, dv, cos, sin, E4, src, None)
    _same(both[0], ref[0], "e4m3")


def test_bad_inputs_are_refused():
    B, S, Hq, Hkv, D = SHAPES[0]
    cos, sin = _tables(S, D)
    cos_h, sin_h = half_tables(cos, sin, S, D)
    dq, dk, dv = _grads(B, S, Hq, Hkv, D, torch.bfloat16, seed=2)
    src = torch.ones(1)
    with pytest.raises(ValueError, match="must match dk"):
        rope_fp8_backward(dq, dk, dv[:, :, :0], cos_h, sin_h, E5, src)
    with pytest.raises(ValueError, match="cos_half"):
        rope_fp8_backward(dq, dk, dv, cos_h[:2], sin_h, E5, src)
    with pytest.raises(ValueError, match="fp8 dtype"):
        rope_fp8_backward(dq, dk, dv, cos_h, sin_h, torch.bfloat16, src, use_triton=True)


@pytest.mark.parametrize("tile", [(64, 4), (16, 4)])
def test_a_chosen_tile_writes_what_the_default_writes(tile):
    """The tile bypass (`tile=`) with a tile other than the interpreter's: the same fp8
    bytes, inverse scale and amax, on a shape of several token blocks (T = 70)."""
    B, S, Hq, Hkv, D = 2, 35, 2, 1, 16
    cos, sin = _tables(S, D)
    cos_h, sin_h = half_tables(cos, sin, S, D)
    dq, dk, dv = _grads(B, S, Hq, Hkv, D, torch.bfloat16, seed=3)
    src = torch.tensor([2.0])
    runs = []
    for t in (None, tile):
        amax = torch.zeros(1)
        runs.append((*rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E5, src, amax_out=amax,
                                        use_triton=True, tile=t), amax))
    for a, b, what in zip(*runs, ("q", "qt", "inv", "amax")):
        _same(a, b, what)


@requires_cuda  # compiled tiles: `make test-gpu`
@pytest.mark.parametrize("shape", [(1, 1000, 8, 4, 128), (2, 2048, 32, 32, 128)])
def test_every_tile_writes_the_same_bits_on_the_gpu(shape):
    """Whatever tile the autotuner picks, the kernel writes the same fp8 bytes (both
    layouts), inverse scale and amax: each tile of `TILES`, and the autotuned one,
    against the first, with a history smaller than the values (saturation)."""
    from colossal_lab.kernels import rope_fp8

    B, S, Hq, Hkv, D = shape
    cos, sin = (t.cuda() for t in _tables(S, D))
    cos_h, sin_h = half_tables(cos, sin, S, D)
    dq, dk, dv = (t.cuda() for t in _grads(B, S, Hq, Hkv, D, torch.bfloat16, seed=4))
    src = torch.tensor([0.5, 2.0], device="cuda")
    runs = {}
    for tile in (*rope_fp8.TILES, None):
        amax = torch.zeros(1, device="cuda")
        runs[tile] = (*rope_fp8_backward(dq, dk, dv, cos_h, sin_h, E5, src, amax_out=amax,
                                         tile=tile), amax)
    ref = runs.pop(rope_fp8.TILES[0])
    for tile, out in runs.items():
        for a, b, what in zip(out, ref, ("q", "qt", "inv", "amax")):
            assert torch.equal(a.view(torch.uint8) if a.dtype == E5 else a,
                               b.view(torch.uint8) if b.dtype == E5 else b), (tile, what)
