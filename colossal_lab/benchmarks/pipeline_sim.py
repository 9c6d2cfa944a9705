"""Switch 7 on one GPU: F, B and W of a LLaMA-7B layer, and each schedule on p GPUs.

What each pipeline schedule would make of those costs, simulated."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from colossal_lab import precision
from colossal_lab.benchmarks.harness import counted
from colossal_lab.config import SWITCH_SETS, preset
from colossal_lab.errors import UsageError
from colossal_lab.measure import timing
from colossal_lab.model import build_model
from colossal_lab.parallel import overlap_model as om
from colossal_lab.parallel.pipeline.runtime import (
    WeightGradStore,
    defer_weight_grads,
    restore_weight_grads,
)
from colossal_lab.parallel.pipeline.sim_rows import (  # noqa: F401  (re-exported)
    CHUNKS,
    LINKS,
    MS,
    PS,
    SCHEDULES,
    simulate_rows,
    stage_costs,
)
from colossal_lab.parallel.pipeline.stages import Stage
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.resolved import backends_in_use

NAME = "pipeline_sim"
PRESET, SEQ_LEN, MICRO_BATCH = "llama-7b", 4096, 1
WARMUP, REPS = 3, 30
SIM_LINKS = LINKS
MEASURED = "pipeline_measured"
"""The results file of a measured multi-GPU pipeline run (`pipeline_measured`): chapter 07
shows it when it exists."""
QUICK = {"preset": "tiny", "seq_len": 64, "micro_batch": 1, "warmup": 2, "reps": 10,
         "ps": (2, 4), "ms": (4, 8)}
"""The CPU smoke test: the tiny model's layer timed with perf_counter on one thread, a
smaller grid, LLaMA-7B's 32 layers all the same."""


# ------------------------------------------------------------------ the measurement


def _parts(preset_name: str, switches, device):
    """One decoder layer and the last stage's head, from a one-layer model of the
    preset with `switches` applied, plus the layer count of the full preset."""

    cfg = preset(preset_name)
    one = apply_switches(build_model(cfg.replace(num_hidden_layers=1), device), switches)
    layer = Stage(one, 1, 3, range(0, 1))  # a middle stage: the layer alone
    head = Stage(one, 2, 3, range(1, 1))  # the last stage without layers
    return one, layer, head, cfg


def _time_part(stage, x_shape, dtype, labels, *, warmup: int, reps: int, device) -> dict:
    """F, B and W (weight gradients deferred), and F and the full backward (not), of
    `stage`, in ms, each repetition running both; and its activation memory."""

    cuda = device.type == "cuda"
    x = torch.randn(x_shape, dtype=dtype, device=device)
    dy = torch.randn(x_shape, dtype=dtype, device=device) if not stage.is_last else None

    def clock():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(a, b):
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    def forward():
        inp = x.detach().requires_grad_()
        out = stage(inp, labels) if stage.is_last else stage(inp)
        return inp, out

    times: dict[str, list[float]] = {"f": [], "b": [], "w": [], "f_undivided": [],
                                     "full_bwd": []}
    store = WeightGradStore("bench")
    act, before = None, 0

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def clocked(names, context=None, after_forward=None, then=None):
        """Clocks around a forward (inside `context`), its backward and `then`; each
        interval's ms into `times[name]` when `names` is given (a timed repetition)."""
        nonlocal before
        stage.zero_grad(set_to_none=True)
        sync()
        before = torch.cuda.memory_allocated() if cuda else 0
        marks = [clock()]
        with context or contextlib.nullcontext():
            inp, out = forward()
        marks.append(clock())
        if after_forward is not None:
            after_forward()
        torch.autograd.backward(out, dy)
        marks.append(clock())
        if then is not None:
            then()
            marks.append(clock())
        sync()
        for name, t0, t1 in zip(names or (), marks, marks[1:]):
            times[name].append(ms(t0, t1))

    def activation_memory():
        nonlocal act
        if cuda and act is None:
            torch.cuda.synchronize()
            act = (torch.cuda.memory_allocated() - before) / 2**20

    for i in range(warmup + reps):  # the two variants alternate: drift hits both
        timed = i >= warmup
        defer_weight_grads(stage, store)  # split: F, B (dW deferred), W
        clocked(("f", "b", "w") if timed else None, store.micro_batch(0),
                activation_memory, lambda: store.flush(0))
        restore_weight_grads(stage)  # undivided: F, the whole backward
        clocked(("f_undivided", "full_bwd") if timed else None)
    return {"times": times, "act_mib": act}


def measure(preset_name: str = PRESET, seq_len: int = SEQ_LEN,
            micro_batch: int = MICRO_BATCH, *, switches=None, warmup: int = WARMUP,
            reps: int = REPS, device=None) -> list[dict]:
    """The "measure" rows (layer, head) and the "p2p" row for `preset_name`."""

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if switches is None:
        switches = SWITCH_SETS["best"]
        if device.type == "cpu":  # the CPU's best norm, not Triton under the interpreter
            switches = switches.replace(enable_fused_normalization=True)
    torch.manual_seed(0)
    one, layer, head, cfg = _parts(preset_name, switches, device)
    act_dtype = one.model.embed_tokens.weight.dtype
    shape = (micro_batch, seq_len, cfg.hidden_size)
    labels = torch.randint(0, cfg.vocab_size, shape[:2], device=device)
    rows = []
    for part, stage in (("layer", layer), ("head", head)):
        with precision.step_context(precision.of(one), device):
            got = _time_part(stage, shape, act_dtype, labels, warmup=warmup, reps=reps,
                             device=device)
        row = {"kind": "measure", "part": part, "preset": preset_name, "seq_len": seq_len,
               "micro_batch": micro_batch, "precision": precision.of(one),
               "layers": cfg.num_hidden_layers,
               "timing": "cuda_events" if device.type == "cuda" else "perf_counter",
               "reps": reps, "act_mib": got["act_mib"], **backends_in_use(one)}
        for k, v in got["times"].items():
            t = timing._summary(v)
            row.update({f"{k}_ms": t.median_ms, f"{k}_ms_p10": t.p10_ms,
                        f"{k}_ms_p90": t.p90_ms, f"{k}_ms_all": v})
        rows.append(row)
    nbytes = micro_batch * seq_len * cfg.hidden_size * act_dtype.itemsize
    rows.append({"kind": "p2p", "preset": preset_name, "seq_len": seq_len,
                 "micro_batch": micro_batch, "shape": list(shape),
                 "dtype": str(act_dtype).replace("torch.", ""), "act_bytes": nbytes,
                 **{f"comm_ms[{ln.name}]": p2p_ms(nbytes, ln) for ln in om.LINKS}})
    return rows


def p2p_ms(nbytes: float, link) -> float:
    """One point-to-point transfer of `nbytes` on `link` (`overlap_model.Link`), ms:
    latency + bytes / bandwidth."""
    return link.latency_us / 1e3 + nbytes / (link.gbps * 1e9) * 1e3



def run(quick: bool = False, *, reps: int | None = None, progress: bool = True
        ) -> list[dict]:
    """The measurement and the simulation. `quick`: the tiny model on this machine's
    CPU and a smaller grid; not a measurement of any GPU.

    One GPU cannot run a pipeline, but it can measure what a schedule is built from. For
    one decoder layer of `llama-7b` (sequence 4096, micro-batch 1, the best bf16 switches,
    `config.SWITCH_SETS["best"]`) and for the last stage's extra work (final norm, output
    head and loss, `stages.Stage` with no layers), CUDA events time, over `REPS` repetitions
    after `WARMUP`:

    * F: the forward, building the autograd graph, as a pipeline stage runs it;
    * B: the backward to the input with the weight gradients deferred (the runtime's
      `DeferredLinear` filing dW = dyᵀx with a `WeightGradStore`);
    * W: the deferred weight gradients (`WeightGradStore.flush`);
    * the forward and the full backward with plain linears (no deferral): what GPipe,
      1F1B and interleaved run; each repetition times both variants, so drift hits both,

    each as median, p10 and p90, plus the activation memory one micro-batch leaves between
    F and B, and the size of what a stage sends its neighbour: one (1, 4096, 4096) bf16
    hidden state, 32 MiB, whose transfer time comes from the link table of
    `overlap_model.LINKS` (latency + bytes / bandwidth: a model, not a measurement).

    `pipeline.simulate` then times every schedule for p ∈ {2, 4, 8} and m ∈ {4, 8, 16,
    32} on LLaMA-7B's 32 layers: virtual stage s holds 32/S layers, the last one also the
    head (per-stage costs), the embedding is left out (a lookup), transfers run beside the
    compute (``overlap_p2p``) and cost their transfer time on NVLink 4 (a pipeline in one
    node) and on a 400 Gb/s network (one stage per node). ZB-H1's and ZB-V's orders are
    built from the measured costs, as ColossalAI builds its ZB-V order.

    Rows: ``kind="measure"`` (part "layer" or "head": f/b/w/f_undivided/full_bwd ms with
    p10 and p90, act_mib, backends), ``kind="p2p"`` (act_bytes, comm_ms per link) and ``kind="sim"``
    (schedule, p, m, chunks, link: step_ms, bubble, tokens_per_s, speedup_vs_1f1b,
    peak_activations in micro-batches of a rank's layers, peak_act_gib from the measured
    act_mib, an upper bound for the zero-bubble schedules whose W keeps part of it).

        python -m colossal_lab bench pipeline_sim           # results/<gpu>/pipeline_sim.json
        python -m colossal_lab bench pipeline_sim --quick   # tiny model on this CPU, not saved
    """

    if quick:
        q = QUICK
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread: steadier on a busy machine, no spinning
        try:
            rows = measure(q["preset"], q["seq_len"], q["micro_batch"],
                           warmup=q["warmup"], reps=reps or q["reps"], device="cpu")
        finally:
            torch.set_num_threads(threads)
        rows += simulate_rows(rows, ps=q["ps"], ms=q["ms"],
                              num_layers=preset(PRESET).num_hidden_layers)
    else:
        reps = reps or REPS
        if reps < 20:
            raise UsageError(f"reps={reps}: time at least 20 repetitions, or the p10-p90 "
                             "spread means nothing")
        rows = measure(reps=reps)
        rows += simulate_rows(rows)
    if progress:
        print(summary(rows), flush=True)
    return rows


def summary(rows: Sequence[dict]) -> str:
    """F, B, W of a layer and the head; the simulated step at the largest m per p."""
    out = []
    for r in (x for x in rows if x.get("kind") == "measure"):
        out.append(f"{r['part']:<6} ({r['preset']}, seq {r['seq_len']}, {r['timing']}): "
                   + ", ".join(f"{k.upper() if k != 'full_bwd' else 'full B'} "
                               f"{r[k + '_ms']:.2f} ms" for k in ("f", "b", "w", "full_bwd"))
                   + (f"; activations {r['act_mib']:.0f} MiB" if r["act_mib"] else ""))
    sim = [r for r in rows if r.get("kind") == "sim"]
    if sim:
        ln = sim[0]["link"]
        for p in sorted({r["p"] for r in sim}):
            m = max(r["m"] for r in sim if r["p"] == p)
            cells = [f"{r['schedule']} {r['bubble']:.1%}" for r in sim
                     if r["p"] == p and r["m"] == m and r["link"] == ln]
            out.append(f"p={p}, m={m}, {ln}: bubble " + ", ".join(cells))
    return "\n".join(out)


def config_of(reps: int = REPS) -> dict:

    return {"preset": PRESET, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH,
            "switches": 'config.SWITCH_SETS["best"]', "warmup": WARMUP, "reps": reps,
            "ps": list(PS), "ms": list(MS), "schedules": list(SCHEDULES),
            "interleaved_chunks": CHUNKS, "links": [vars(om.link(n)) for n in SIM_LINKS],
            "timing": "CUDA events around F (forward, graph built), B (backward to the "
                      "input, weight gradients deferred), W (the deferred weight "
                      "gradients) and the full backward, one layer and the head",
            "simulation": "colossal_lab.parallel.pipeline.simulate: per-stage costs (32/S layers, "
                          "head on the last stage, embedding left out), p2p latency = "
                          "link latency + activation bytes / bandwidth, transfers "
                          "overlapped; zb-h1 and zbv orders built from the measured "
                          "costs"}


BENCH = counted(NAME, __doc__, run, config_of, count="reps", default=REPS,
                what="timed repetitions", quick_help="tiny model on the CPU, not saved")
main = BENCH.main


if __name__ == "__main__":
    main()
