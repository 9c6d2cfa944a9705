"""What the RMSNorm and LayerNorm kernels share: tiling, launch settings and input checks.

The launch settings include the persistent backward grid.

Both norms reduce over the last dimension H of a (rows, H) matrix, and both are
memory-bound: per element they do a handful of FLOPs against 2 to 10 bytes of traffic.
So the launch settings aim at one thing, keeping enough bytes in flight:

- a program covers whole rows, so one pass over memory suffices and the row statistics
  never leave registers. Triton tiles have power-of-two sides, so a row of H elements
  is held as up to three power-of-two *pieces* (`row_pieces`: 5120 = 4096 + 1024,
  13824 as 8192 + 4096 + 2048), each a (ROWS, P) tile masked down to the row. One
  padded tile of next_power_of_2(H) would be simpler, but at H = 5120 it is 8192 wide:
  37% of every thread's registers hold masked-off padding, fewer programs fit on an
  SM, fewer bytes are in flight, and the kernel falls below the bandwidth it reaches
  at H = 4096;
- each thread holds 8 to 32 contiguous elements per tensor, so a bf16 row is read with
  16-byte vector loads; Triton vectorises only what it knows to be aligned, so H and
  the row strides reach the kernels divided by `alignment` and are multiplied back by
  that constexpr;
- small H gets several rows per program (ROWS > 1) so a program still moves ~8 KB;
- the backward runs a *persistent* grid of a few programs per SM that loop over row
  tiles, each accumulating its dweight partial sum in registers and writing it once:
  the (programs, H) fp32 partials are then summed by `sum_partials` (one launch, which
  also rounds to the weight's dtype). Few programs keep that buffer small (132 x 4096
  x 4 B = 2 MB on an H200, against 400 MB of row traffic), and no atomics make the
  result deterministic.

The defaults below are the result of reasoning, not of a sweep on every GPU:
`python -m colossal_lab.benchmarks.fused_norm --tune` times the alternatives on the
card at hand per hidden bucket and dtype, and `--write-table` stores the winners in
`norm_table.json` (`TABLES`), which `launch_config` consults for the GPU it runs on;
`DEFAULTS` remain the fallback.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from colossal_lab.kernels import INTERPRET
from colossal_lab.kernels.launch import launch, plan_key

MAX_HIDDEN = 65536
"""Largest H a program can hold in registers as one row (64K elements)."""


@dataclass(frozen=True)
class Defaults:
    """Launch heuristics, in one place so a sweep on a new GPU changes one line."""

    tile_elems: int = 4096
    """Target elements per tile of ROWS rows: small H gets ROWS = tile_elems //
    next_power_of_2(H)."""
    elems_per_thread: int = 16
    """Elements of one tensor per thread: 16 bf16 = two 16-byte loads."""
    programs_per_sm_warps: int = 16
    """Backward: warps per SM to fill with persistent programs (programs = this // warps,
    at least 1). More programs hide more latency but enlarge the dweight partials."""
    bwd_stages: int = 2
    """Backward: `num_stages` of the row loop (1: no software pipelining; 2: Triton may
    prefetch the next tile's loads while the current one computes)."""
    bwd_prefetch: bool = False
    """Backward (RMSNorm): issue the next row tile's loads before reducing the current
    one (a register double buffer; costs the registers of one more x and dy tile)."""
    bwd_min_rows_per_program: int = 8
    """Backward: fewest rows a persistent program loops over. Caps the grid at small
    token counts, where (programs x H) fp32 partials written and summed would
    otherwise rival the rows' own traffic (1024 x 3072 bf16: 528 programs' partials
    are 13 MB beside 19 MB of x, dy and dx)."""


DEFAULTS = Defaults()

SMALL_ROWS = 2048
"""At this many rows or fewer, plain RMSNorm's launches (not the fused add's, which the
small entries were not tuned on) take the table's
"<block>/<dtype>/<pass>/small" entry where the GPU has one (`bench fused_norm --tune
--tokens 1024`, timed by graph replay). Such a call is a few microseconds of GPU work,
mostly launch latency and the tail of one wave: the tile, warps and grid that keep
16k rows' bytes in flight are not the fastest there (1024 x 1024 bf16 on the H200)."""


@dataclass(frozen=True)
class LaunchConfig:
    """How one norm launch is tiled."""

    block: int
    """next_power_of_2(H): the hidden bucket of `norm_table` and of the heuristic."""
    rows: int
    """Rows per tile (ROWS)."""
    num_warps: int
    """Warps per program."""
    programs_per_sm: int | None = None
    """Backward: persistent programs per SM (None: `DEFAULTS.programs_per_sm_warps //
    num_warps`)."""
    num_stages: int | None = None
    """Backward: pipelining depth of the row loop (None: `DEFAULTS.bwd_stages`)."""
    min_rows_per_program: int | None = None
    """Backward: fewest rows per persistent program (None:
    `DEFAULTS.bwd_min_rows_per_program`)."""
    prefetch: bool | None = None
    """Backward (RMSNorm): register double buffer of the row loop (None:
    `DEFAULTS.bwd_prefetch`)."""
    source: str = "heuristic"
    """"heuristic", "override" or "table:<gpu>" (`TABLES`)."""
    pieces: tuple[int, int, int] = (0, 0, 0)
    """The row's power-of-two pieces (`row_pieces`), 0 for an absent one."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: `triton.cdiv` is a ConstexprFunction in Triton 3.7,
    whose host-side call costs more than the arithmetic it does."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), in plain Python (see `cdiv`)."""
    return 1 << (n - 1).bit_length()


def _floor_power_of_2(n: int) -> int:
    """Largest power of two <= n (1 for n < 1)."""
    return 1 << max(0, n.bit_length() - 1)


MAX_PADDING = 1 / 16
"""`row_pieces` rounds the rest of a row up to a power of two when that pads the row by
at most this fraction, rather than adding a piece."""


def row_pieces(n_cols: int) -> tuple[int, int, int]:
    """Up to three powers of two, largest first, that cover a row of `n_cols` with
    little padding; 0 marks an absent piece. Each piece but the last is the largest
    power of two that fits in what is left; the last rounds the rest up. A piece is
    added only while rounding up would pad the row by more than `MAX_PADDING`::

        4096 -> (4096, 0, 0)     1000 -> (1024, 0, 0)      pads 2.4%
        5120 -> (4096, 1024, 0)  3000 -> (2048, 1024, 0)   pads 2.4%
        13824 -> (8192, 4096, 2048)                        pads 3.7%
    """
    if n_cols < 1:
        raise ValueError("cannot normalise rows of 0 elements")
    pieces, rest = [], n_cols
    while True:
        up = next_power_of_2(rest)
        if len(pieces) == 2 or sum(pieces) + up - n_cols <= n_cols * MAX_PADDING:
            pieces.append(up)
            return (*pieces, *(0,) * (3 - len(pieces)))
        pieces.append(up // 2)  # rest is not a power of two, so up // 2 < rest
        rest -= up // 2


TABLE_PATH = Path(__file__).with_name("norm_table.json")
"""Tuned launch settings per GPU, written by `bench fused_norm --write-table`."""


def load_tables(path: Path = TABLE_PATH) -> dict[str, dict[str, dict[str, int | bool]]]:
    """`TABLES` from `norm_table.json`: {GPU name (as `torch.cuda.get_device_name()` and
    a tune result's provenance say it): {"<block>/<dtype>/<pass>[/small]": {launch
    field: value}}}, block = next_power_of_2(H), pass "fwd" or "bwd". Keys of an entry:
    rows, num_warps and, for "bwd", programs_per_sm, num_stages, prefetch (RMSNorm
    only), min_rows_per_program. A ".../small" entry (whole launches tuned at few
    tokens) overrides its pass's entry at up to `SMALL_ROWS` rows."""
    return json.loads(path.read_text())["tables"]


TABLES = load_tables()
"""The tuned launches `table_entry` consults; a GPU or key absent: the heuristic."""


@functools.cache
def _gpu_name() -> str | None:
    """This process's GPU as torch names it ("NVIDIA H200", the `gpu` of a results
    file's provenance), the key of `TABLES`; None without CUDA or under the
    interpreter. (Kernels import nothing above them, so not `hardware`'s slug.)"""
    if INTERPRET or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def table_entry(block: int, dtype: torch.dtype | None, backward: bool,
                gpu: str | None = None, small: bool = False) -> dict | None:
    """The tuned launch of (hidden bucket `block`, `dtype`, pass) for `gpu` (default
    this one) from `TABLES`, or None. With `small` (a launch of
    at most `SMALL_ROWS` rows) the ".../small" entry, where there is one, overrides the
    fields it sets."""
    gpu = gpu or _gpu_name()
    if gpu is None or dtype is None:
        return None
    key = f"{block}/{str(dtype).replace('torch.', '')}/{'bwd' if backward else 'fwd'}"
    table = TABLES.get(gpu, {})
    entry, few = table.get(key), table.get(f"{key}/small") if small else None
    return {**(entry or {}), **few} if few else entry


@functools.lru_cache(maxsize=1024)
def launch_config(n_cols: int, dtype: torch.dtype | None = None, *,
                  backward: bool = False, rows: int | None = None,
                  num_warps: int | None = None, small: bool = False) -> LaunchConfig:
    """Tile and warps for rows of `n_cols` elements of `dtype`, for the forward or the
    `backward`: the tuned entry for this GPU when `TABLES` has one (its ".../small"
    entry too with `small`: at most `SMALL_ROWS` rows), the heuristic otherwise;
    `rows`/`num_warps` override both (the tuning sweep uses them).

    Cached per argument tuple: every launch asks, and the answer never changes within
    a process (call `launch_config.cache_clear()` after editing `TABLES`)."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(
            f"hidden size {n_cols} > {MAX_HIDDEN}: a fused norm keeps one row in "
            "registers; use the 'torch' backend for rows this long")
    if n_cols < 1:
        raise ValueError("cannot normalise rows of 0 elements")
    block = next_power_of_2(n_cols)
    if rows is not None or num_warps is not None:
        source, entry = "override", {}
    else:
        entry = table_entry(block, dtype, backward, small=small)
        source = f"table:{_gpu_name()}" if entry else "heuristic"
        if entry and small and table_entry(block, dtype, backward) != entry:
            source += "/small"
        entry = entry or {}
    pieces = row_pieces(n_cols)
    rows = rows or entry.get("rows") or max(1, DEFAULTS.tile_elems // block)
    if num_warps is None:
        tile = rows * sum(pieces)  # registers go to the pieces, not to the bucket
        cap = 32 if tile >= 32768 else 16
        num_warps = entry.get("num_warps") or min(
            cap, max(4, _floor_power_of_2(tile // (32 * DEFAULTS.elems_per_thread))))
    return LaunchConfig(block, rows, num_warps, entry.get("programs_per_sm"),
                        entry.get("num_stages"), entry.get("min_rows_per_program"),
                        entry.get("prefetch"), source, pieces)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(n_rows: int, rows_per_tile: int, num_warps: int,
                        device: torch.device, programs_per_sm: int | None = None,
                        min_rows: int | None = None) -> int:
    """Size of the backward's persistent grid: a few programs per SM, each looping over
    at least `min_rows` rows (default `DEFAULTS.bwd_min_rows_per_program`), never more
    programs than row tiles. 4 programs in all under the interpreter, enough to
    exercise the loop."""
    n_tiles = cdiv(n_rows, rows_per_tile)
    if device.type == "cuda" and not INTERPRET:
        if programs_per_sm is None:
            programs_per_sm = max(1, DEFAULTS.programs_per_sm_warps // num_warps)
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = _sm_count(index) * programs_per_sm
        min_rows = min_rows or DEFAULTS.bwd_min_rows_per_program
        programs = min(programs, cdiv(n_rows, max(min_rows, rows_per_tile)))
    else:
        programs = 4
    return max(1, min(n_tiles, programs))


def alignment(*ints: int) -> int:
    """The largest power of two, at most 16, dividing every one of `ints` (H and the
    row strides of a launch).

    The norm kernels take H and their row strides divided by this and multiply them
    back by it as a constexpr (`ALIGN`), so Triton knows each row starts on an
    ALIGN-element boundary and loads it with 16-byte vectors. On its own Triton learns
    divisibility from integer arguments only when it is 16: at H = 3000 (8 x 375) a
    bf16 row would be read element by element."""
    g = 0
    for i in ints:
        g = math.gcd(g, i)
    return 16 if g == 0 else min(16, g & -g)


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(..., H) -> (rows, H) view with unit column stride (copies only when needed;
    e.g. the expanded gradient of `y.sum()` has stride 0)."""
    t2d = t.reshape(-1, n_cols)
    if t2d.stride(-1) != 1 and t2d.numel() > 0:
        t2d = t2d.contiguous()
    return t2d


def check_param(p: torch.Tensor | None, n_cols: int, x: torch.Tensor, name: str):
    """A weight or bias must be (H,) on x's device; any float dtype (kernels upcast it,
    so autocast's fp32 weights with bf16 activations need no cast)."""
    if p is None:
        return None
    if p.shape != (n_cols,):
        raise ValueError(f"{name} has shape {tuple(p.shape)}; expected ({n_cols},) to "
                         f"match the last dimension of the input {tuple(x.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but the input is on {x.device}")
    if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} dtype {p.dtype} must be float32, float16 or bfloat16")
    return p.contiguous()


def check_input(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused norms take float32, float16 or bfloat16; got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("cannot normalise a 0-d tensor")


@triton.jit
def _piece(rows, row_ok, n_cols, OFF: tl.constexpr, P: tl.constexpr):
    """Columns OFF .. OFF + P - 1 of a row tile (one of `row_pieces`): their indices
    (P,), their in-bounds mask and the (ROWS, P) mask of the tile."""
    cols = OFF + tl.arange(0, P)
    col_ok = cols < n_cols
    return cols, col_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def _row_tile(tile, n_rows, ROWS: tl.constexpr):
    """Row indices (ROWS,) of row tile `tile` and their in-bounds mask. The indices are
    int64 so `rows * stride` cannot overflow for tensors past 2^31 elements."""
    rows = tl.arange(0, ROWS).to(tl.int64) + tile * ROWS
    return rows, rows < n_rows


_EMULATE_RTNE: tl.constexpr = tl.constexpr(INTERPRET)
"""Triton's interpreter (3.x) casts fp32 to bf16 by truncation, the GPU rounds to
nearest even; under the interpreter `_to_dtype` rounds first so that CPU tests check the
numerics the GPU has."""


@triton.jit
def _to_dtype(x, dtype: tl.constexpr):
    """fp32 `x` cast to `dtype` with round-to-nearest-even, on the GPU and under the
    interpreter alike."""
    if _EMULATE_RTNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_partials_sum_kernel(
    PARTIALS,  # (N_PARTS, n_programs, n_cols) fp32 partial sums, contiguous
    OUT0,  # (n_cols,) Σ over programs of PARTIALS[0], in OUT0's dtype
    OUT1,  # (n_cols,) Σ of PARTIALS[1], in OUT1's dtype (N_PARTS == 2 only)
    n_programs,  # rows of each partial block
    n_cols,  # H
    BLOCK_P: tl.constexpr,  # partial rows summed per step
    BLOCK: tl.constexpr,  # columns per program
):
    """Column sums of the backward's dweight (and dbias) partials, in fp32, rounded once
    to the parameter's dtype: one launch where `partials.sum(0).to(w.dtype)` takes two
    (three for LayerNorm's dw and db). The order of the sum is fixed: deterministic.
    LayerNorm's too; the name keeps `profile`'s "norm" category (it matches rms_?norm)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    part = tl.program_id(1)
    col_ok = cols < n_cols
    base = PARTIALS + part.to(tl.int64) * n_programs * n_cols
    acc = tl.zeros((BLOCK_P, BLOCK), dtype=tl.float32)
    for start in range(0, n_programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < n_programs)[:, None] & col_ok[None, :]
        acc += tl.load(base + p[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)  # (BLOCK,)
    if part == 0:
        tl.store(OUT0 + cols, _to_dtype(total, OUT0.dtype.element_ty), mask=col_ok)
    else:
        tl.store(OUT1 + cols, _to_dtype(total, OUT1.dtype.element_ty), mask=col_ok)


_SUM_BLOCK = 32
"""Columns per program of the partials sum: H / 32 programs (128 at H = 4096), enough
to spread the (programs, H) partials over the SMs; each reads its columns of every
partial row in a few (BLOCK_P, 32) steps. Few programs with a long loop (64 columns,
64 rows a step: 64 programs of 5 dependent steps at H = 4096) leave the sum waiting on
memory latency."""


def _sum_tile_rows(n_programs: int) -> int:
    """Partial rows summed per step: all of them up to 256 (one step for <= 256)."""
    return min(256, max(16, next_power_of_2(n_programs)))


@functools.lru_cache(maxsize=1024)
def _sum_plan(n_parts: int, n_programs: int, n_cols: int, out_dtypes: tuple,
              partials_aligned: bool) -> tuple:
    """Grid, constexprs, warps and launch key of `sum_partials` for one shape: worked
    out once, not per call (host time, see `kernels.launch`)."""
    block_p = _sum_tile_rows(n_programs)
    constexprs = dict(BLOCK_P=block_p, BLOCK=_SUM_BLOCK)
    warps = max(1, min(8, block_p * _SUM_BLOCK // 1024))
    key = plan_key(out_dtypes, (partials_aligned,), (n_programs, n_cols), constexprs,
                   warps)
    return (cdiv(n_cols, _SUM_BLOCK), n_parts), constexprs, warps, key


def sum_partials(partials: torch.Tensor, *params: torch.Tensor, on_launch=None
                 ) -> list[torch.Tensor]:
    """(len(params), programs, H) fp32 partials -> one (H,) sum per parameter, in that
    parameter's dtype, in one launch. `on_launch(kernel, grid, args, key)`, if given,
    is told what was launched (`kernels.native` replays it)."""
    n_parts, n_programs, n_cols = partials.shape
    outs = [p.new_empty(n_cols) for p in params]  # (same dtype and device as p)
    grid, constexprs, warps, key = _sum_plan(
        n_parts, n_programs, n_cols, tuple(o.dtype for o in outs),
        partials.data_ptr() % 16 == 0)
    args = (partials, outs[0], outs[-1], n_programs, n_cols)
    launch(_rms_norm_partials_sum_kernel, grid, args, constexprs, num_warps=warps, key=key)
    if on_launch is not None:
        on_launch(_rms_norm_partials_sum_kernel, grid, args, key)
    return outs
