"""Switch 5 on one GPU: chunked GEMMs, activation memory saved, communication exposed.

What chunking costs the GEMMs, what sequence parallelism saves in activation memory,
and how much communication each scheme leaves exposed on NVLink."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colossal_lab.benchmarks.harness import counted
from colossal_lab.config import Switches, preset
from colossal_lab.errors import UsageError
from colossal_lab.measure import timing
from colossal_lab.model import build_model
from colossal_lab.parallel import overlap_model as om
from colossal_lab.switches.apply import apply_switches

NAME = "sequence_parallel_gemm"
PRESET, SEQ_LEN, BATCH = "llama-7b", 4096, 1
TPS = (2, 4, 8)
CHUNKS = (1, 2, 4, 8)
REPS = 50
PASSES = ("fwd", "dgrad", "wgrad")
PROJS = ("qkv", "o", "gate_up", "down")
QUICK = {"preset": "tiny", "seq_len": 64, "batch": 1, "tps": (2, 4), "chunks": (1, 2, 4),
         "reps": 10}
"""The CPU smoke test: the tiny model's shapes, a few repetitions, perf_counter."""
LINK = "NVLink 4"


@dataclass(frozen=True)
class Gemm:
    """One projection's GEMM on one rank: Y (M, N) = X (M, K) · Wᵀ (K, N)."""

    proj: str
    parallel: str
    """"column" (all-gather before it under SP) or "row" (reduce-scatter after it)."""
    m: int
    n: int
    k: int


def gemms(cfg, tokens: int, tp: int) -> list[Gemm]:
    """The four projections of a LLaMA layer as one of `tp` ranks holds them."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    return [Gemm("qkv", "column", tokens, qkv // tp, d),
            Gemm("o", "row", tokens, d, cfg.num_attention_heads * cfg.head_dim // tp),
            Gemm("gate_up", "column", tokens, 2 * i // tp, d),
            Gemm("down", "row", tokens, d, i // tp)]


def _chunked(g: Gemm, what: str, k: int, device, dtype):
    """A function running pass `what` of `g` as k chunks along the tokens."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)

    x, w, dy = rnd(g.m, g.k), rnd(g.n, g.k, scale=0.02), rnd(g.m, g.n)
    c = g.m // k
    if what == "fwd":
        out = torch.empty(g.m, g.n, device=device, dtype=dtype)
        return lambda: [torch.mm(x[j * c:(j + 1) * c], w.t(), out=out[j * c:(j + 1) * c])
                        for j in range(k)]
    if what == "dgrad":
        out = torch.empty(g.m, g.k, device=device, dtype=dtype)
        return lambda: [torch.mm(dy[j * c:(j + 1) * c], w, out=out[j * c:(j + 1) * c])
                        for j in range(k)]
    acc = torch.zeros(g.n, g.k, device=device, dtype=dtype)

    def wgrad():
        torch.mm(dy[:c].t(), x[:c], out=acc)
        for j in range(1, k):
            acc.addmm_(dy[j * c:(j + 1) * c].t(), x[j * c:(j + 1) * c])

    return wgrad


def gemm_rows(cfg, tokens: int, tps, chunks, reps: int, device, dtype=torch.bfloat16,
              progress: bool = True) -> list[dict]:
    """Every (tp, projection, pass, k) case; ratios against k = 1 of the same case."""
    first = _chunked(gemms(cfg, tokens, tps[0])[0], "fwd", 1, device, dtype)
    for _ in range(5):  # the process's first GEMMs (thread pools, cuBLAS handles): untimed
        first()
    rows = []
    for tp in tps:
        for g in gemms(cfg, tokens, tp):
            for what in PASSES:
                base = None
                for k in chunks:
                    if g.m % k:
                        continue
                    t, how = timing.time_kernels(_chunked(g, what, k, device, dtype),
                                                 device=device, reps=reps)
                    flops = 2 * g.m * g.n * g.k
                    row = {"kind": "gemm", "tp": tp, "proj": g.proj, "parallel": g.parallel,
                           "pass": what, "chunks": k, "m": g.m, "n": g.n, "k": g.k,
                           "chunk_tokens": g.m // k, "dtype": str(dtype).split(".")[-1],
                           "ms": t.median_ms, "ms_p10": t.p10_ms, "ms_p90": t.p90_ms,
                           "reps": t.n, "timing": how,
                           "tflops": timing.tflops(flops, t.median_ms)}
                    base = base or row
                    row["ratio"] = row["ms"] / base["ms"]
                    rows.append(row)
                if progress:
                    print(f"  tp {tp} {g.proj:<8}{what:<6}" + " ".join(
                        f"k{r['chunks']} {r['ms']:.3f} ms (x{r['ratio']:.2f})"
                        for r in rows if r["tp"] == tp and r["proj"] == g.proj
                        and r["pass"] == what), flush=True)
    return rows


# ----------------------------------------------------------------- activation memory


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int, *, sp: bool,
                      scores: bool = True) -> float:
    """Activation bytes per layer and rank, Korthikanti et al. 2022 (their equations
    for a GPT layer with 16-bit activations and dropout): plain TP
    ``sbh·(10 + 24/t + 5as/(ht))``, with sequence parallelism ``sbh·(34/t + 5as/(ht))``;
    `scores=False` drops the 5as/(ht) term (the attention scores, which flash attention
    does not keep)."""
    attn = 5 * a * s / (h * t) if scores else 0.0
    per = 34 / t if sp else 10 + 24 / t
    return s * b * h * (per + attn)


def colossalai_split_gather_bytes(s: int, b: int, h: int, a: int, t: int, *,
                                  scores: bool = True, gathered_linears: int = 5) -> float:
    """ColossalAI's split_gather by its code (a prediction, not a measurement): the
    formula's SP bytes, but each of the `gathered_linears` column-parallel linears (q,
    k, v, gate, up in its LLaMA policy) keeps the *gathered* (s, b, h) input,
    2·sbh bytes each, where the formula keeps the two block inputs sharded (2·2·sbh/t)."""
    return korthikanti_bytes(s, b, h, a, t, sp=True, scores=scores) \
        + s * b * h * (2 * gathered_linears - 4 / t)


def saved_bytes_per_layer(cfg, seq_len: int, batch: int, switches, device,
                          dtype=torch.bfloat16) -> int:
    """Bytes of the distinct tensors (storages) one decoder layer's forward keeps for
    the backward, parameters excluded: what a layer really holds, measured with
    `torch.autograd.graph.saved_tensors_hooks` (one layer of `cfg` with `switches`)."""

    model = apply_switches(build_model(cfg.replace(num_hidden_layers=1), device), switches)
    if switches.precision != "bf16-pure":
        model = model.to(dtype)
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(batch, seq_len, cfg.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)
    cos, sin = model.model.rotary_emb(seq_len, device)
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin)
    return sum(kept.values())


def memory_rows(cfg, seq_len: int, batch: int, tps, measured: int | None) -> list[dict]:
    """Per layer and rank, and per model in GiB, for t = 1 and `tps`."""
    s, b, h, a, L = seq_len, batch, cfg.hidden_size, cfg.num_attention_heads, \
        cfg.num_hidden_layers
    rows = []
    for t in (1, *tps):
        for scores in (True, False):
            values = {
                "tp": korthikanti_bytes(s, b, h, a, t, sp=False, scores=scores),
                "sp": korthikanti_bytes(s, b, h, a, t, sp=True, scores=scores),
                "colossalai-split_gather": colossalai_split_gather_bytes(s, b, h, a, t,
                                                                         scores=scores)}
            for scheme, per_layer in values.items():
                if t == 1 and scheme != "tp":
                    continue  # one rank: the three are one
                rows.append({"kind": "memory", "scheme": scheme, "tp": t,
                             "attention_scores": scores, "source": "formula",
                             "seq_len": s, "batch": b, "hidden": h, "heads": a,
                             "layers": L, "bytes_per_layer": per_layer,
                             "sbh_per_layer": per_layer / (s * b * h),
                             "model_gib": per_layer * L / 2**30})
    if measured is not None:
        rows.append({"kind": "memory", "scheme": "ours-measured", "tp": 1,
                     "attention_scores": False, "source": "saved_tensors_hooks",
                     "seq_len": s, "batch": b, "hidden": h, "heads": a, "layers": L,
                     "bytes_per_layer": measured, "sbh_per_layer": measured / (s * b * h),
                     "model_gib": measured * L / 2**30})
    return rows


# ---------------------------------------------------------- exposed communication


def _ms(rows, tp, proj, what, k=1) -> float:
    return next(r["ms"] for r in rows if r["kind"] == "gemm" and r["tp"] == tp
                and r["proj"] == proj and r["pass"] == what and r["chunks"] == k)


def collective_ms(nbytes: float, t: int, link: om.Link, kind: str) -> float:
    """One ring collective over t ranks, ms: an all-reduce moves 2(t−1)/t of the bytes
    through each link, an all-gather or a reduce-scatter (t−1)/t (`nbytes` the full
    tensor), a point-to-point step 1/t (one shard); each pays the link's latency α."""
    frac = {"all_reduce": 2 * (t - 1) / t, "half": (t - 1) / t, "p2p": 1 / t}[kind]
    return link.latency_us / 1e3 + frac * nbytes / (link.gbps * 1e9) * 1e3


def ring_ms(chunk_ms: float, step_ms: float, t: int) -> float:
    """A ring of t steps: the first chunk's GEMM, then t − 1 steps each as long as the
    slower of the next GEMM chunk and one shard's transfer."""
    return chunk_ms + (t - 1) * max(chunk_ms, step_ms)


def comm_rows(gemm: list[dict], cfg, tokens: int, tps, link: om.Link,
              elem: int = 2) -> list[dict]:
    """Exposed communication per layer (forward + backward), per scheme and tp, from
    the measured GEMM times (`gemm` rows). Assumptions: no contention between the
    GEMMs and the transfers (optimistic), a bandwidth independent of the message size,
    the attention core and the element-wise work ignored (they only add compute to
    hide behind), the ring's GEMM chunks timed by `gemm_rows` with k = t."""
    n = tokens * cfg.hidden_size * elem  # one (S, d) activation, bytes
    rows = []
    for t in tps:
        if not any(r["tp"] == t and r["chunks"] == t for r in gemm):
            continue
        ar = collective_ms(n, t, link, "all_reduce")
        half = collective_ms(n, t, link, "half")
        p2p = collective_ms(n, t, link, "p2p")
        compute = sum(_ms(gemm, t, p, w) for p in PROJS for w in PASSES)
        col, row = ("qkv", "gate_up"), ("o", "down")
        plain = {"fwd": 2 * ar,
                 "bwd": sum(max(0.0, ar - _ms(gemm, t, p, "wgrad")) for p in col)}
        split = {"fwd": 4 * half,
                 "bwd": sum(max(0.0, half - _ms(gemm, t, p, "dgrad"))
                            + max(0.0, half - _ms(gemm, t, p, "wgrad")) for p in col)
                 + 2 * half}
        ring, extra = {"fwd": 0.0, "bwd": 0.0}, 0.0
        # forward: each projection's GEMM in t chunks, a shard moving at each step;
        # backward: column dX (GEMM + reduce-scatter ring) and dW (all-gather ring),
        # row dY all-gathered by a ring feeding both of its GEMMs
        for p in PROJS:
            for what, phase in (("fwd", "fwd"), ("dgrad", "bwd"), ("wgrad", "bwd")):
                whole, split_k = _ms(gemm, t, p, what), _ms(gemm, t, p, what, t)
                if p in row and what == "wgrad":
                    continue  # rides the dgrad ring of the same dY shards, below
                chunk = split_k / t
                if p in row and what == "dgrad":
                    chunk = (split_k + _ms(gemm, t, p, "wgrad", t)) / t
                    whole += _ms(gemm, t, p, "wgrad")
                ring[phase] += ring_ms(chunk, p2p, t) - chunk * t
                extra += chunk * t - whole
        for scheme, e in (("tp-all_reduce", plain), ("sp-split_gather", split),
                          ("sp-ring", ring)):
            exposed = e["fwd"] + e["bwd"]
            cost = exposed + (extra if scheme == "sp-ring" else 0.0)
            rows.append({"kind": "comm", "scheme": scheme, "tp": t, "link": link.name,
                         "link_gbps": link.gbps, "latency_us": link.latency_us,
                         "tokens": tokens, "activation_bytes": n,
                         "all_reduce_ms": ar, "gather_or_scatter_ms": half,
                         "ring_step_ms": p2p, "gemm_ms": compute,
                         "exposed_fwd_ms": e["fwd"], "exposed_bwd_ms": e["bwd"],
                         "exposed_ms": exposed,
                         "split_cost_ms": extra if scheme == "sp-ring" else 0.0,
                         "layer_ms": compute + cost,
                         "exposed_share": cost / (compute + cost)})
    return rows


# ------------------------------------------------------------------------- run


def config_of(reps: int = REPS) -> dict:
    return {"preset": PRESET, "seq_len": SEQ_LEN, "batch": BATCH, "tps": list(TPS),
            "chunks": list(CHUNKS), "reps": reps, "passes": list(PASSES),
            "dtype": "bfloat16",
            "timing": "timing.time_kernels: CUDA-graph replays, CUDA events around each, "
                      "L2 flushed before each",
            "memory": "Korthikanti et al. 2022 equations (GPT layer, 16-bit, dropout); "
                      "measured: one decoder layer's saved tensors, sdpa attention, "
                      "bf16 parameters",
            "link": vars(om.link(LINK)),
            "comm_model": "ring collectives, alpha + bytes/bandwidth, no contention, "
                          "GEMMs as measured (colossal_lab.benchmarks.sequence_parallel_"
                          "gemm.comm_rows)"}


def run(quick: bool = False, *, progress: bool = True, reps: int | None = None) -> list[dict]:
    """GEMM rows (measured), memory rows (formula + the t = 1 check), comm rows (model).
    `quick`: the tiny model on this machine's CPU in fp32, not a measurement of any GPU.

    One GPU cannot run tensor parallelism, but it can run every GEMM a TP rank runs, whole
    and cut into the chunks a ring would cut it into. For LLaMA-7B (d 4096, 32 heads, i
    11008), sequence 4096, batch 1, bf16, and each TP size t of `TPS`, the four
    projections as one rank holds them: "qkv" (column-parallel, 3d/t outputs), "o" (row,
    d/t inputs), "gate_up" (column, 2i/t) and "down" (row, i/t). Each in three passes:
    "fwd" Y = X Wᵀ and "dgrad" dX = dY·W, both split along the tokens into k chunks, and
    "wgrad" dW = dYᵀX split along the tokens, its reduction dimension: k GEMMs accumulating
    into one output (``addmm_``). k = 1 (unsplit), 2, 4, 8. Timed as CUDA-graph replays
    (`timing.time_kernels`: CUDA events around each replay, L2 flushed, `REPS` replays;
    median, p10, p90), the k-chunk time divided by the unsplit one measured in the same
    process ("ratio").

    Then, computed from those rows (no second measurement):

    - ``kind="memory"``: activation memory per layer and rank, Korthikanti et al. 2022's
      formulas (GPT layer, 16-bit activations, dropout masks; with and without the 5as²b/t
      attention-score term, which flash attention removes) for plain TP
      (sbh·(10 + 24/t)) and sequence parallelism (sbh·34/t), the same per 32-layer model in
      GiB, and ColossalAI's "split_gather" as its LLaMA policy builds it (each of q, k, v,
      gate and up gathers its input and keeps the gathered copy: ``ctx.gathered_input``);
      plus, for t = 1, what our decoder layer *measurably* keeps for the backward (bytes
      of the distinct tensors autograd saves, `saved_bytes_per_layer`), as a check of the
      formula's scale.
    - ``kind="comm"``: a model of the communication each scheme leaves exposed per layer
      (forward + backward) on NVLink 4 (`overlap_model.link`), fed with the measured GEMM
      times: plain TP (4 all-reduces; the backward two overlapped with the dW GEMMs),
      split_gather (8 all-gathers/reduce-scatters; the column linears' backward re-gather
      hidden behind dX and the reduce-scatter behind dW, Megatron's overlaps), and the ring
      (each collective in t steps, step time max(GEMM chunk, transfer of one shard)).

        python -m colossal_lab bench sequence_parallel_gemm          # -> results/<gpu>/...
        python -m colossal_lab bench sequence_parallel_gemm --quick  # CPU smoke, not saved
    """

    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    if quick:
        q = QUICK
        cfg, seq, batch, tps, chunks = preset(q["preset"]), q["seq_len"], q["batch"], \
            q["tps"], q["chunks"]
        reps, dtype = reps or q["reps"], torch.float32
    else:
        if device.type != "cuda":
            raise RuntimeError("the GEMM timings need a CUDA GPU; use --quick on a CPU")
        cfg, seq, batch, tps, chunks, dtype = preset(PRESET), SEQ_LEN, BATCH, TPS, CHUNKS, \
            torch.bfloat16
        reps = reps or REPS
        if reps < 20:
            raise UsageError(f"reps={reps}: time at least 20, or p10-p90 means nothing")
    tokens = seq * batch
    rows = gemm_rows(cfg, tokens, tps, chunks, reps, device, dtype, progress=progress)
    sw = Switches(enable_flash_attention="sdpa", precision="bf16-pure")
    measured = saved_bytes_per_layer(cfg, seq, batch, sw, device,
                                     dtype=torch.bfloat16)
    rows += memory_rows(cfg, seq, batch, tps, measured)
    rows += comm_rows(rows, cfg, tokens, tps, om.link(LINK), elem=2)
    if progress:
        print(summary(rows), flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    lines = ["k-chunk / unsplit GEMM time (median), per tp and projection:"]
    for r in rows:
        if r["kind"] == "gemm" and r["chunks"] == r["tp"] and r["pass"] == "fwd":
            lines.append(f"  tp {r['tp']} {r['proj']:<8} fwd in {r['chunks']} chunks of "
                         f"{r['chunk_tokens']} tokens: x{r['ratio']:.2f}")
    for r in rows:
        if r["kind"] == "comm":
            lines.append(f"  tp {r['tp']} {r['scheme']:<16} exposed {r['exposed_ms']:.3f} ms "
                         f"+ split {r['split_cost_ms']:.3f} ms of a {r['layer_ms']:.3f} ms "
                         f"layer ({r['exposed_share']:.1%})")
    return "\n".join(lines)


BENCH = counted(NAME, __doc__, run, config_of, count="reps", default=REPS,
                what="replays per case", quick_help="tiny shapes on the CPU, not saved")
main = BENCH.main


if __name__ == "__main__":
    main()
