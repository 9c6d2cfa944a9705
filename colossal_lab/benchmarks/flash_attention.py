"""Switch 1's micro-benchmark: every attention backend side by side, in one process.

Providers: naive (materialised scores), PyTorch SDPA forced to its flash, memory-efficient
and cuDNN kernels, our Triton FlashAttention-2 (`colossal_lab.kernels.flash_attention`;
"triton" with its deterministic dQ kernel, "triton-atomic" with FA2's atomic dQ),
FlexAttention under `torch.compile`, and `flash_attn` when it is installed. Each case
(batch, heads, seq_len, head_dim, causal) is set up once and every provider runs on the
same tensors, so the ratios are what to read; absolute numbers drift between machines.

The sweep keeps the work per query token fixed: B·S = 16384 tokens and H·D = 4096 (H=32
at D=128, H=64 at D=64), S from 512 to 16384, causal and not, bf16. The canonical point
B=4, H=32, S=4096, D=128, causal (BASELINES.md's) is part of it; one extra grouped-query
case (Hkv=8) runs there. Memory rows: peak memory of one fwd+bwd at B=1, H=32, D=128.

    python -m colossal_lab bench flash_attention            # GPU: the sweep, ~6-8 min
    python -m colossal_lab bench flash_attention --quick    # CPU smoke test, tiny shapes

Results: `results/<gpu>/flash_attention.json` (rewritten after every case, so a run that
is cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

import torch

from colossal_lab.results import save_results
from colossal_lab.timing import peak_memory_gib, reset_peak_memory, tflops, time_fn

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
"""B·S of every sweep case: the batch shrinks as the sequence grows."""
HIDDEN = 4096
"""H·D of every sweep case (a LLaMA-7B layer)."""
HEAD_DIMS = (128, 64)
CANONICAL = {"batch": 4, "heads": 32, "seq_len": 4096, "head_dim": 128, "causal": True}
GQA_KV_HEADS = 8
"""Key/value heads of the extra grouped-query case at the canonical point."""
PROVIDERS = ("naive", "sdpa-flash", "sdpa-efficient", "cudnn", "triton", "triton-atomic", "flex",
             "flash_attn")
"""`triton` is our kernel with its default backward (dQ in its own kernel); `triton-atomic`
the same forward with FA2's atomic dQ (`dq_mode="atomic"`)."""
QUICK_PROVIDERS = ("naive", "sdpa", "triton")
FLEX_SEQ_LENS = (4096,)
"""FlexAttention compiles once per shape (tens of seconds each): only these, at D=128."""
MEM_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
MEM_PROVIDERS = ("naive", "triton", "sdpa-flash")
NAIVE_LIMIT_GIB = 40.0
"""Skip the naive provider where its score matrices would need more than this."""


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs: two matmuls (Q Kᵀ and P V) of 2·S²·D each per head; causal halves it."""
    flops = 4.0 * batch * heads * seq_len**2 * head_dim
    return flops * 0.5 if causal else flops


FWD_BWD_FACTOR = 3.5
"""fwd+bwd FLOPs = 3.5 × fwd: the backward's 5 matmuls (dV, dP, dQ, dK and the recomputed
Q Kᵀ are 2.5 × the forward's 2), the FlashAttention papers' and BASELINES.md's convention.
Recomputation beyond that (our dQ kernel recomputes P and dP) is not counted."""


def naive_gib(batch: int, heads: int, seq_len: int) -> float:
    """Rough peak of naive fwd+bwd: per score element bf16 scores, fp32 softmax in and out,
    bf16 probabilities, and their gradients — about 16 bytes."""
    return 16.0 * batch * heads * seq_len**2 / 2**30


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_fn(q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.compiler.reset()  # one static compile per shape; no recompile limit to hit
    compiled = torch.compile(flex_attention, dynamic=False)
    s = q.shape[-2]
    block_mask = None
    if causal:
        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal_mask, None, None, s, s, device=q.device)
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return lambda: compiled(q, k, v, block_mask=block_mask, **extra)


def make_fn(provider: str, q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    """A zero-argument forward for `provider` on these tensors."""
    if provider == "flex":
        return _flex_fn(q, k, v, causal)
    if provider == "triton-atomic":
        from colossal_lab.kernels.flash_attention import flash_attention

        return lambda: flash_attention(q, k, v, causal, dq_mode="atomic")
    from colossal_lab.switches.attention import attention

    return lambda: attention(q, k, v, causal, backend=provider)


def _skip_reason(provider: str, batch: int, heads: int, seq_len: int, head_dim: int,
                 device: torch.device) -> str | None:
    if provider == "naive" and naive_gib(batch, heads, seq_len) > NAIVE_LIMIT_GIB:
        return "memory"
    if provider == "flash_attn" and not _flash_attn_installed():
        return "not installed"
    if provider == "flex" and (seq_len not in FLEX_SEQ_LENS or head_dim != 128):
        return "compile time (flex runs at D=128, S in FLEX_SEQ_LENS)"
    if provider in ("sdpa-flash", "sdpa-efficient", "cudnn", "flex") and device.type != "cuda":
        return "needs CUDA"
    return None


REF_SCORES_GIB = 1.0
"""Memory the fp32 reference's (B, H, rows, S) score matrix may take: at long sequences
it checks the last query rows only (`fp32_reference`)."""


def fp32_reference(q, k, v, causal: bool) -> tuple[torch.Tensor, int]:
    """(reference, rows): naive attention in fp32 on upcast inputs
    (`attention_ref(..., upcast=True)`) for the last `rows` query rows, as many as fit
    `REF_SCORES_GIB` of fp32 scores (all of them at short sequences).

    The last rows with the full keys are exactly those rows of the causal output:
    `attention_ref` aligns a shorter query block with the end of the keys."""
    from colossal_lab.switches.attention import attention_ref

    b, h, s, _ = q.shape
    per_row = b * h * s * 4  # bytes of one query row of fp32 scores, all heads
    rows = max(1, min(s, int(REF_SCORES_GIB * 2**30 // per_row)))
    with torch.no_grad():
        ref = attention_ref(q[..., -rows:, :].detach(), k.detach(), v.detach(), causal,
                            upcast=True)
    return ref, rows


def measure_case(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool,
                 providers, *, kv_heads: int | None = None, dtype=torch.bfloat16,
                 device=None, quick: bool = False) -> list[dict]:
    """Time every provider's fwd and fwd+bwd on one set of random tensors."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    ref, ref_rows = fp32_reference(q, k, v, causal)
    flops = attention_flops(batch, heads, seq_len, head_dim, causal)
    timing = {"cpu_warmup": 1, "cpu_reps": 2} if quick else {}
    rows = []
    for provider in providers:
        row = {"kind": "speed", "provider": provider, "batch": batch, "heads": heads,
               "kv_heads": kv_heads, "seq_len": seq_len, "head_dim": head_dim,
               "causal": causal, "dtype": str(dtype).replace("torch.", "")}
        reason = _skip_reason(provider, batch, heads, seq_len, head_dim, device)
        if reason:
            rows.append({**row, "skipped": reason})
            continue
        t0 = time.perf_counter()
        try:
            fwd = make_fn(provider, q, k, v, causal)

            def fwd_bwd(fwd=fwd):
                torch.autograd.grad(fwd(), (q, k, v), do)

            out = fwd()  # compile / autotune outside the timed region
            fwd_bwd()
            # the error column: against naive attention in fp32 on the same (upcast)
            # inputs, over the last `ref_rows` query rows (the causal rows that see the
            # most keys); not against SDPA, whose default on a GPU may be cuDNN itself
            row["max_abs_err_vs_fp32"] = (out[..., -ref_rows:, :].float() - ref
                                          ).abs().max().item()
            row["err_ref_rows"] = ref_rows
            del out
            # FLOPs next to the timing: fwd = 4·B·H·S²·D (× 0.5 causal), fwd+bwd = 3.5 × fwd
            t_fwd = time_fn(fwd, device=device, **timing)
            t_all = time_fn(fwd_bwd, device=device, **timing)
            row.update(fwd_ms=t_fwd.median_ms, fwd_bwd_ms=t_all.median_ms,
                       fwd_tflops=tflops(flops, t_fwd.median_ms),
                       fwd_bwd_tflops=tflops(FWD_BWD_FACTOR * flops, t_all.median_ms),
                       fwd_spread=round(t_fwd.spread, 3), fwd_bwd_spread=round(t_all.spread, 3))
        except Exception as e:  # one provider failing must not stop the others
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(_format(row, time.perf_counter() - t0), flush=True)
    return rows


def measure_memory(seq_len: int, providers=MEM_PROVIDERS, *, batch: int = 1, heads: int = 32,
                   head_dim: int = 128, causal: bool = True) -> list[dict]:
    """Peak memory of one fwd+bwd (inputs included) and what it adds over the inputs."""
    rows = []
    for provider in providers:
        row = {"kind": "memory", "provider": provider, "batch": batch, "heads": heads,
               "kv_heads": heads, "seq_len": seq_len, "head_dim": head_dim, "causal": causal,
               "dtype": "bfloat16"}
        if provider == "naive" and naive_gib(batch, heads, seq_len) > NAIVE_LIMIT_GIB:
            rows.append({**row, "skipped": "memory"})
            continue
        try:
            shape = (batch, heads, seq_len, head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            fwd = make_fn(provider, q, k, v, causal)
            torch.autograd.grad(fwd(), (q, k, v), do)  # warm-up (autotuning allocates)
            reset_peak_memory()
            base = torch.cuda.memory_allocated() / 2**30
            torch.autograd.grad(fwd(), (q, k, v), do)
            torch.cuda.synchronize()
            peak = peak_memory_gib()
            row.update(peak_mem_gib=peak, extra_mem_gib=peak - base)
            del q, k, v, do
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def run(quick: bool = False, *, head_dims=HEAD_DIMS, seq_lens=None, providers=None,
        memory: bool = True, on_rows: Callable[[list[dict]], None] | None = None
        ) -> list[dict]:
    """The sweep; `on_rows(rows_so_far)` is called after every case (for saving).

    `quick`: tiny fp32 shapes on whatever device there is, providers naive, sdpa and
    triton only, no memory rows (a CPU smoke test; its numbers mean nothing)."""
    rows: list[dict] = []
    t_start = time.perf_counter()
    if quick:
        dtype, tokens, hidden = torch.float32, 64, 64
        seq_lens, head_dims = seq_lens or (32, 64), (32,)
        providers = providers or QUICK_PROVIDERS
    else:
        dtype, tokens, hidden = torch.bfloat16, TOKENS, HIDDEN
        seq_lens = seq_lens or SEQ_LENS
        providers = providers or PROVIDERS
    for i, head_dim in enumerate(head_dims):
        for causal in (True, False):
            for seq_len in seq_lens:
                batch, heads = max(1, tokens // seq_len), hidden // head_dim
                print(f"[flash_attention] B={batch} H={heads} S={seq_len} D={head_dim} "
                      f"causal={causal}  ({time.perf_counter() - t_start:.0f} s)", flush=True)
                rows += measure_case(batch, heads, seq_len, head_dim, causal, providers,
                                     dtype=dtype, quick=quick)
                if on_rows:
                    on_rows(rows)
        if i == 0 and not quick:  # the extras before the second head dim: they matter more
            rows += _extras(providers, dtype, memory, on_rows, rows)
    print(f"[flash_attention] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return rows


def _extras(providers, dtype, memory: bool, on_rows, rows_so_far) -> list[dict]:
    """Grouped-query attention at the canonical point, and the memory rows."""
    c = CANONICAL
    print(f"[flash_attention] grouped-query: canonical case with Hkv={GQA_KV_HEADS}", flush=True)
    rows = measure_case(c["batch"], c["heads"], c["seq_len"], c["head_dim"], c["causal"],
                        [p for p in providers if p != "naive"], kv_heads=GQA_KV_HEADS,
                        dtype=dtype)
    if on_rows:
        on_rows(rows_so_far + rows)
    if memory and torch.cuda.is_available():
        print("[flash_attention] memory of one fwd+bwd, B=1 H=32 D=128 causal", flush=True)
        for seq_len in MEM_SEQ_LENS:
            rows += measure_memory(seq_len, [p for p in MEM_PROVIDERS if p in providers])
            if on_rows:
                on_rows(rows_so_far + rows)
    return rows


def _format(r: dict, seconds: float | None = None) -> str:
    head = f"  {r['provider']:<15} S={r['seq_len']:<6}"
    if "skipped" in r:
        return f"{head} skipped ({r['skipped']})"
    if "error" in r:
        return f"{head} failed: {r['error'][:100]}"
    if r["kind"] == "memory":
        return f"{head} peak {r['peak_mem_gib']:.2f} GiB (+{r['extra_mem_gib']:.2f} over inputs)"
    took = f"  [{seconds:.1f} s]" if seconds is not None else ""
    return (f"{head} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:7.1f} TFLOP/s   "
            f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms {r['fwd_bwd_tflops']:7.1f} TFLOP/s   "
            f"err {r['max_abs_err_vs_fp32']:.1e}{took}")


def summary(rows: list[dict]) -> str:
    """Provider × key cases, fwd / fwd+bwd TFLOP/s; ratios at the canonical point."""
    speed = [r for r in rows if r.get("kind") == "speed"]
    if not speed:
        return "no speed rows"
    big = max(r["seq_len"] for r in speed)
    dims = sorted({r["head_dim"] for r in speed}, reverse=True)
    c = CANONICAL
    cases = [(f"S={c['seq_len']} D={c['head_dim']} causal", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=True)),
             (f"S={c['seq_len']} D={c['head_dim']} full", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=False)),
             (f"S={big} D={dims[0]} causal", dict(seq_len=big, head_dim=dims[0], causal=True))]
    if len(dims) > 1:
        cases.append((f"S={c['seq_len']} D={dims[-1]} causal", dict(
            seq_len=c["seq_len"], head_dim=dims[-1], causal=True)))
    if not any(r["seq_len"] == c["seq_len"] for r in speed):  # quick runs
        cases = [(f"S={big} D={dims[0]} causal", dict(seq_len=big, head_dim=dims[0],
                                                      causal=True))]

    def find(provider, kv_heads=None, **match):
        for r in speed:
            if r["provider"] == provider and all(r.get(k) == v for k, v in match.items()) \
                    and (kv_heads is None or r["kv_heads"] == kv_heads) \
                    and (kv_heads is not None or r["kv_heads"] == r["heads"]):
                return r
        return None

    def cell(r):
        if r is None:
            return "-"
        if "fwd_tflops" not in r:
            return r.get("skipped", "error")[:13]
        return f"{r['fwd_tflops']:.0f} / {r['fwd_bwd_tflops']:.0f}"

    providers = list(dict.fromkeys(r["provider"] for r in speed))
    width = 24
    lines = ["TFLOP/s, fwd / fwd+bwd (fwd+bwd counted as 3.5 x fwd)",
             f"{'provider':<16}" + "".join(f"{name:>{width}}" for name, _ in cases)]
    for p in providers:
        lines.append(f"{p:<16}" + "".join(f"{cell(find(p, **m)):>{width}}" for _, m in cases))
    name, m = cases[0]
    ours = find("triton", **m)
    if ours and "fwd_tflops" in ours:
        for other in ("sdpa-flash", "cudnn", "flex", "flash_attn", "triton-atomic"):
            r = find(other, **m)
            if r and "fwd_tflops" in r:
                lines.append(f"triton / {other} at {name}: fwd "
                             f"{ours['fwd_tflops'] / r['fwd_tflops']:.2f}x, fwd+bwd "
                             f"{ours['fwd_bwd_tflops'] / r['fwd_bwd_tflops']:.2f}x")
    gqa = [r for r in speed if r["kv_heads"] != r["heads"]]
    if gqa:
        lines.append(f"grouped-query (Hkv={gqa[0]['kv_heads']}) at {name}: " + ", ".join(
            f"{r['provider']} {cell(r)}" for r in gqa))
    mem = [r for r in rows if r.get("kind") == "memory"]
    if mem:
        seqs = sorted({r["seq_len"] for r in mem})
        lines.append("peak memory of one fwd+bwd, GiB (B=1, H=32, D=128, causal)")
        lines.append(f"{'provider':<16}" + "".join(f"{'S=' + str(s):>10}" for s in seqs))
        for p in dict.fromkeys(r["provider"] for r in mem):
            cells = []
            for s in seqs:
                r = next((r for r in mem if r["provider"] == p and r["seq_len"] == s), None)
                cells.append(f"{r['peak_mem_gib']:.2f}" if r and "peak_mem_gib" in r
                             else (r or {}).get("skipped", "error")[:8])
            lines.append(f"{p:<16}" + "".join(f"{x:>10}" for x in cells))
    return "\n".join(lines)


def config_of(quick: bool = False) -> dict:
    return {"tokens_per_case": 64 if quick else TOKENS, "hidden": 64 if quick else HIDDEN,
            "dtype": "float32" if quick else "bfloat16", "canonical": CANONICAL,
            "gqa_kv_heads": GQA_KV_HEADS, "flops_fwd": "4*B*H*S^2*D, x0.5 if causal",
            "flops_fwd_bwd": f"{FWD_BWD_FACTOR} x fwd", "timing": "triton do_bench median",
            "fwd": "forward with autograd recording (training forward)",
            "naive_limit_gib": NAIVE_LIMIT_GIB, "flex_seq_lens": FLEX_SEQ_LENS,
            "memory": "peak of one fwd+bwd incl. inputs, B=1 H=32 D=128 causal"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke test, not saved")
    p.add_argument("--out-name", help="results file name (default flash_attention; "
                                      "with --quick: save only if given)")
    p.add_argument("--head-dims", type=int, nargs="*", default=list(HEAD_DIMS))
    p.add_argument("--seq-lens", type=int, nargs="*", help=f"default {SEQ_LENS}")
    p.add_argument("--providers", nargs="*", choices=PROVIDERS + ("sdpa",),
                   help=f"default {PROVIDERS}")
    p.add_argument("--no-memory", action="store_true", help="skip the memory rows")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    name = a.out_name or (None if a.quick else "flash_attention")
    command = "python -m colossal_lab bench flash_attention " + " ".join(
        shlex.quote(x) for x in argv)
    config = {**config_of(a.quick), "head_dims": a.head_dims}

    def save(rows):
        if name:
            from colossal_lab.kernels.flash_attention import tuned_configs

            config["triton_tiles"] = tuned_configs()  # what the autotuner picked, per key
            return save_results(name, rows, config=config, command=command.strip())

    rows = run(a.quick, head_dims=tuple(a.head_dims), seq_lens=a.seq_lens,
               providers=a.providers, memory=not a.no_memory, on_rows=save)
    print(summary(rows))
    path = save(rows)
    if path:
        print(f"saved {path}")


if __name__ == "__main__":
    main()
