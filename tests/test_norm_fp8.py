"""RMSNorm (with the residual add) writing its output in fp8, both layouts
(`kernels.rms_norm_fp8`): against the unfused path (the Triton norm writing y, then
`fp8_cast_transpose`) bit for bit — q, qᵀ and its padding, inv_scale, h, rstd, amax — on
ragged token counts, row pieces, mixed dtypes, delayed and dynamic scaling; the cast at
every two-pass tile and the amax pass at every tile of both families (one pass, two
passes), a one-pass tile refused for a cast; one layout alone, the torch reference, the
checks. CPU: the kernels run under the Triton interpreter."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from colossal_lab.kernels import fp8_cast
from colossal_lab.kernels import rms_norm_fp8 as kernel
from colossal_lab.kernels.rms_norm import add_rms_norm_forward, rms_norm_forward
from colossal_lab.kernels.rms_norm_fp8 import rms_norm_fp8, rms_norm_fp8_amax
from tests.conftest import requires_cuda

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-6
BF, F32 = torch.bfloat16, torch.float32
# (T, d, x dtype, residual dtype or None): ragged T (yᵀ padded), one piece (64), two
# pieces (48 = 32 + 16, 80 = 64 + 16), fp32 rows, a bf16 x on an fp32 residual stream
CASES = [(21, 64, BF, None), (37, 48, BF, BF), (5, 80, F32, None), (33, 64, BF, F32),
         (16, 80, F32, F32)]


def _same(a, b, what):
    """Equal values (fp8 compared as floats: the interpreter writes -0 as +0)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype)
    diff = (a.float() != b.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def _inputs(T, d, dtype, res_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, d, generator=g) * 3).to(dtype)
    res = None if res_dtype is None else torch.randn(T, d, generator=g).to(res_dtype)
    w = torch.rand(d, generator=g) * 2 - 0.5  # some negative weights
    return x, res, w


def _unfused(x, res, w, dtype, src, amax_out):
    """The Triton norm writes y (and h), then the cast reads it: (q, qt, inv, h, rstd)."""
    if res is None:
        y, rstd = rms_norm_forward(x, w, EPS)
        h = None
    else:
        y, h, rstd = add_rms_norm_forward(x, res, w, EPS)
    return (*fp8_cast.fp8_cast_transpose(y, dtype, src, amax_out=amax_out), h, rstd)


@pytest.mark.parametrize("T,d,dtype,res_dtype", CASES, ids=str)
@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_fused_writes_the_unfused_bits(T, d, dtype, res_dtype, scaling):
    x, res, w = _inputs(T, d, dtype, res_dtype, seed=T + d)
    if scaling == "dynamic":  # the amax-only pass gives the scale
        src = rms_norm_fp8_amax(x, res, w, EPS, use_triton=True)
    else:  # a history below the amax: some elements saturate
        src = torch.tensor([0.5, 2.0, 1.0])
    af, ar = torch.zeros(1), torch.zeros(1)
    q, qt, inv, h, rstd = rms_norm_fp8(x, res, w, EPS, E4, src, amax_out=af,
                                       use_triton=True)
    rq, rqt, rinv, rh, rrstd = _unfused(x, res, w, E4, src, ar)
    _same(q, rq, "row-major")
    _same(qt, rqt, "transposed")
    assert qt.shape == (d, fp8_cast.padded(T)) and qt[:, T:].float().abs().sum() == 0
    _same(rstd, rrstd, "rstd")
    assert (h is None) == (res is None)
    if h is not None:
        _same(h, rh, "h")
    assert torch.equal(inv, rinv) and torch.equal(af, ar) and af.item() > 0
    if scaling == "dynamic":
        assert torch.equal(src, ar)  # the pass found the unfused cast's amax
    else:
        assert q.float().abs().max() == 448.0  # saturated, finite


# (T, d, x dtype, residual dtype or None) for every tile: ragged T; d = 208 in three
# pieces (128 + 64 + 16), several column tiles of two passes and a partial one, the norm
# kernel's row tile (16 rows) shorter than a two-pass program; fp32 rows of 144 = 128 +
# 16 on an fp32 stream; d = 48, whose row tile (64 rows) is longer than any program
TILE_CASES = [(37, 208, BF, BF), (19, 144, F32, F32), (21, 48, BF, None)]


@functools.cache
def _unfused_case(T, d, dtype, res_dtype):
    """Inputs and the unfused outputs (q, qt, inv, h, rstd, amax) of a `TILE_CASES`
    case, once per worker, under a history below the amax (saturating)."""
    x, res, w = _inputs(T, d, dtype, res_dtype, seed=T + d)
    ar = torch.zeros(1)
    return (x, res, w), (*_unfused(x, res, w, E4, torch.tensor([0.5, 2.0]), ar), ar)


@pytest.mark.parametrize("case", TILE_CASES, ids=str)
@pytest.mark.parametrize("tile", kernel.CAST_TILES, ids=str)
def test_every_cast_tile_writes_the_unfused_bits(tile, case):
    """Through the tile bypass, each tile of `CAST_TILES` (two passes) writes the
    unfused path's q, qᵀ with its zero padding, inv_scale, h, rstd and amax."""
    (x, res, w), ref = _unfused_case(*case)
    af = torch.zeros(1)
    out = (*rms_norm_fp8(x, res, w, EPS, E4, torch.tensor([0.5, 2.0]), amax_out=af,
                         use_triton=True, tile=tile), af)
    for a, b, what in zip(out, ref, ("q", "qt", "inv", "h", "rstd", "amax")):
        assert (a is None) == (b is None), what
        if a is not None:
            _same(a, b, f"{tile}: {what}")
    assert out[1][:, case[0]:].float().abs().sum() == 0


@pytest.mark.parametrize("case", TILE_CASES, ids=str)
@pytest.mark.parametrize("tile", kernel.TILES, ids=str)
def test_every_tile_finds_the_unfused_amax(tile, case):
    """Through the tile bypass, the amax pass at each tile of `TILES` (one pass and
    two) finds the amax the unfused cast reduces from y, bit for bit."""
    (x, res, w), ref = _unfused_case(*case)
    amax = rms_norm_fp8_amax(x, res, w, EPS, use_triton=True, tile=tile)
    assert amax.item() > 0 and torch.equal(amax, ref[-1]), (tile, amax, ref[-1])


@pytest.mark.parametrize("tile", [(8, 0), (2, 0, 4)], ids=str)
def test_a_one_pass_tile_is_refused_for_a_cast(tile):
    """One pass computes the amax only: asked of a cast (either layout, or both) a
    one-pass tile raises ValueError, on the torch path too; the amax pass runs it."""
    x, res, w = _inputs(8, 64, BF, BF, seed=3)
    src = torch.ones(1)
    for q, qt, use_triton in ((True, True, True), (True, False, True),
                              (False, True, True), (True, True, False)):
        with pytest.raises(ValueError, match=r"one pass, which computes the amax only"):
            rms_norm_fp8(x, res, w, EPS, E4, src, write_q=q, write_qt=qt,
                         use_triton=use_triton, tile=tile)
    ar = torch.zeros(1)
    _unfused(x, res, w, E4, src, ar)
    assert torch.equal(rms_norm_fp8_amax(x, res, w, EPS, use_triton=True, tile=tile), ar)


def test_the_prune_gives_the_cast_two_passes_and_the_amax_the_norm_kernels_rows(
        monkeypatch):
    """On a GPU the autotuner times, for a cast, the two-pass tiles only; for the amax
    pass the one-pass tiles of at least the norm kernel's ROWS rows (fewer spread a row
    differently: the offline layout test), or the two-pass ones when none is left.
    Under the interpreter the rows do not matter, and each autotuner holds the first
    tile of its own: a cast runs two passes, the amax pass one."""
    import triton

    one = [t for t in kernel.TILES if t[1] == 0]
    two = [t for t in kernel.TILES if t[1]]
    assert one and two  # both families
    assert list(kernel.AMAX_TILES) == one and list(kernel.CAST_TILES) == two
    configs = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}) for t, c in kernel.TILES]

    def kept(rows, q, qt):
        return [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_C"])
                for c in kernel._prune(configs, {}, ROWS=rows, WRITE_Q=q, WRITE_QT=qt)]

    def tiles(autotuned):
        return [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_C"]) for c in autotuned.configs]

    assert kernel.INTERPRET
    assert tiles(kernel._autotuned(8, True)) == two[:1]
    assert tiles(kernel._autotuned(8, False)) == one[:1]
    assert kept(64, False, False) == one and kept(64, True, True) == two
    monkeypatch.setattr(kernel, "INTERPRET", False)
    for q, qt in ((True, True), (True, False), (False, True)):
        for rows in (1, 8, 64):  # d = 4096: one row a tile; d = 64: 64 rows
            assert kept(rows, q, qt) == two
    assert kept(1, False, False) == one
    assert kept(8, False, False) == [t for t in one if t[0] >= 8]
    assert kept(64, False, False) == two


@pytest.mark.parametrize("tile", [None, (32, 64)], ids=["autotuned", "two-pass"])
def test_one_layout_alone_and_e5m2(tile):
    """write_q / write_qt alone write what both write, at the autotuned tile and at
    another; e5m2 writes the unfused path's bits."""
    x, res, w = _inputs(37, 48, BF, BF, seed=1)
    src = torch.tensor([4.0])
    both = rms_norm_fp8(x, res, w, EPS, E4, src, use_triton=True, tile=tile)
    q_only = rms_norm_fp8(x, res, w, EPS, E4, src, write_qt=False, use_triton=True,
                          tile=tile)
    qt_only = rms_norm_fp8(x, res, w, EPS, E4, src, write_q=False, use_triton=True,
                           tile=tile)
    assert q_only[1] is None and qt_only[0] is None
    _same(q_only[0], both[0], "row-major alone")
    _same(qt_only[1], both[1], "transposed alone")
    e5 = rms_norm_fp8(x, res, w, EPS, E5, src, use_triton=True, tile=tile)
    _same(e5[0], _unfused(x, res, w, E5, src, None)[0], "e5m2")


@pytest.mark.parametrize("res_dtype", [None, BF], ids=["plain", "residual"])
def test_torch_reference_against_the_kernel(res_dtype):
    """The launchers' torch path (CPU without the interpreter) computes the same
    formulas; torch sums the squares in another order, so rstd may differ in its last
    bits, which moves a rare element of y across an fp8 rounding boundary: at most one
    step, on at most 1% of the elements."""
    x, res, w = _inputs(40, 80, BF, res_dtype, seed=7)
    src = torch.tensor([3.0])
    k = rms_norm_fp8(x, res, w, EPS, E4, src, use_triton=True)
    t = rms_norm_fp8(x, res, w, EPS, E4, src, use_triton=False)
    for a, b in zip(k[:2], t[:2]):
        off = a.float() != b.float()
        assert off.float().mean() < 0.01
        assert ((a.float() - b.float()).abs() <= b.float().abs() / 4)[off].all()
    assert torch.equal(k[2], t[2])
    if res_dtype is not None:
        _same(k[3], t[3], "h")
    assert ((k[4] - t[4]).abs() <= 4e-7 * k[4]).all()  # a few ulp
    assert torch.allclose(rms_norm_fp8_amax(x, res, w, EPS, use_triton=True),
                          rms_norm_fp8_amax(x, res, w, EPS, use_triton=False), rtol=1e-2)


def test_bad_inputs_are_refused():
    x, res, w = _inputs(8, 32, BF, BF, seed=2)
    src = torch.ones(1)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_fp8(x, res[:, :16], w, EPS, E4, src)
    with pytest.raises(ValueError, match="2-D"):
        rms_norm_fp8(x[None], None, w, EPS, E4, src)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fp8(x, res, w[:16], EPS, E4, src)
    with pytest.raises(ValueError, match="fp8 dtype"):
        rms_norm_fp8(x, res, w, EPS, torch.bfloat16, src, use_triton=True)


def test_rows_are_laid_out_as_the_norm_kernel_lays_them_out():
    """Compiled for sm_90 without a GPU (in a process without the interpreter), each
    row sum of squares of the fused kernel, in one pass (the amax pass) and in two (the
    cast), spreads a row over a thread's registers, lanes and warps as the norm
    kernel's does: on a GPU both add a row's squares in the same order, so r (and y)
    keep the norm kernel's bits. `aot_arguments` compiles the mode each tile runs. Cases:
    llama-7b's d = 4096 in bf16, d = 5120 (two row pieces) with an fp32 residual stream,
    fp32 rows without a residual; and d = 128 and 80, where a two-pass tile has the
    shape of the norm kernel's row tile (or piece), whose fp8 stores would widen the
    row's layout but for `_shared_width`."""
    for tile in ((8, 0), (32, 128)):
        consts = kernel.aot_arguments(4096, BF, BF, tile)[1][2]
        assert consts["WRITE_Q"] == consts["WRITE_QT"] == (tile[1] > 0), tile
        assert consts["WRITE_AMAX"] and consts["BLOCK_C"] == tile[1]
    code = r"""
import json, torch
from colossal_lab.kernels import rms_norm_fp8
from colossal_lab.kernels.sm90_compile import compile_sm90, row_reduction_layouts
bf, f32 = torch.bfloat16, torch.float32
out = []
for hidden, dtype, res, tiles in (
        (4096, bf, bf, ((8, 0), (2, 0), (16, 64), (32, 128))),
        (5120, bf, f32, ((8, 0), (32, 64))), (4096, f32, None, ((4, 0), (16, 128))),
        (128, bf, bf, ((32, 128),)), (80, bf, None, ((32, 64),))):
    for tile in tiles:
        norm, fused = rms_norm_fp8.aot_arguments(hidden, dtype, res, tile)
        out.append([hidden, tile, *(row_reduction_layouts(compile_sm90(*k)["ttgir"])
                                    for k in (norm, fused))])
print(json.dumps(out))
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for hidden, tile, norm, fused in json.loads(out.stdout.strip().splitlines()[-1]):
        assert norm and len(fused) > len(norm), (hidden, tile)  # the sums, then amax
        assert fused[:len(norm)] == norm, (hidden, tile, norm, fused)


# ------------------------------------------------------------------------------- GPU


@requires_cuda  # compiled kernels: `make test-gpu`
@pytest.mark.parametrize("T,d,res_dtype", [(1000, 4096, BF), (4096, 4096, None),
                                           (2048, 5120, F32), (333, 1024, BF)], ids=str)
def test_fused_writes_the_unfused_bits_on_the_gpu(T, d, res_dtype):
    """Compiled, the cast at every tile of `CAST_TILES` and at the autotuned one writes
    the unfused path's bytes: q, qᵀ, inv_scale, amax, h and rstd (the kernel reduces each
    row as the norm kernel lays it out, so r has the norm kernel's bits), with a history
    smaller than the values (saturation); and the amax pass at every tile of `TILES`
    (one pass and two) and at the autotuned one finds the amax."""
    x, res, w = (None if t is None else t.cuda() for t in _inputs(T, d, BF, res_dtype, 5))
    src = torch.tensor([0.5, 2.0], device="cuda")
    ar = torch.zeros(1, device="cuda")
    ref = (*_unfused(x, res, w, E4, src, ar), ar)
    for tile in (*kernel.TILES, None):
        assert torch.equal(rms_norm_fp8_amax(x, res, w, EPS, tile=tile), ar), tile
    for tile in (*kernel.CAST_TILES, None):
        af = torch.zeros(1, device="cuda")
        out = (*rms_norm_fp8(x, res, w, EPS, E4, src, amax_out=af, tile=tile), af)
        for a, b, what in zip(out, ref, ("q", "qt", "inv", "h", "rstd", "amax")):
            if a is None:
                assert b is None, (tile, what)
                continue
            assert torch.equal(a.view(torch.uint8) if a.dtype == E4 else a,
                               b.view(torch.uint8) if b.dtype == E4 else b), (tile, what)
