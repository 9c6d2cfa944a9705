"""The finale on two GPUs: the best switches composed with each parallel layout.

The layouts run side by side in one torchrun group, as MFU per GPU against the
single-GPU best."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from colossal_lab.benchmarks import grad_overlap_measured as gom
from colossal_lab.benchmarks import pipeline_measured as pm
from colossal_lab.benchmarks import sequence_parallel_step as sps
from colossal_lab.benchmarks import two_gpu as two
from colossal_lab.benchmarks.harness import Benchmark, at_least, flag, opt
from colossal_lab.config import preset
from colossal_lab.measure import hardware, mfu, results
from colossal_lab.parallel import distributed
from colossal_lab.training import data

NAME = "composed_parallel"
KIND = "composed_parallel"
PRESET, SEQ_LEN = "llama-7b-8l", 4096
SETUPS = ("dp2-overlap", "dp2-ddp", "tp2-ring", "tp2-split_gather", "pp2-zbv", "pp2-1f1b")
DP_BATCH = 4
"""Sequences per rank under DP: the single-GPU ``composed`` run's batch."""
PP_M = 8
"""Micro-batches (of `pm.MICRO_BATCH` sequences) per pipelined step."""
WARMUP, ITERS = 3, 20
SINGLE_GPU_NAME, SINGLE_GPU_SETUP = "composed", "ours-bf16"
"""The single-GPU results file and its best bf16 row, the reference of every ratio."""
QUICK = {"preset": "tiny", "seq_len": 32, "dp_batch": gom.QUICK["batches"][0],
         "tp_batch": sps.QUICK["batch"], "pp_m": pm.QUICK["ms"][0],
         "pp_layers": pm.QUICK["layers"], "warmup": 1, "iters": 3}
"""The CPU smoke test: the siblings' own quick sizes."""


# ------------------------------------------------------- the single-GPU reference


def single_gpu_path() -> Path:
    """``results/<this GPU's slug>/composed.json``: one GPU of the same kind."""

    return results.results_dir() / hardware.detect().slug / f"{SINGLE_GPU_NAME}.json"


def single_gpu_best(path: Path, preset: str, seq_len: int,
                    setup: str = SINGLE_GPU_SETUP) -> dict:
    """The single-GPU best bf16 row (`setup`, by default `SINGLE_GPU_SETUP`) of `path`
    for `preset` at `seq_len`: its file, commit, MFU and tokens/s; ``mfu`` None and
    ``why`` when the file or such a row is absent."""
    out = {"file": str(path), "setup": setup, "git_sha": None, "mfu": None,
           "tokens_per_s": None}
    if not path.exists():
        return {**out, "why": f"no {path}: run `python -m colossal_lab bench "
                              f"{SINGLE_GPU_NAME}` on one GPU of this kind first"}
    doc = json.loads(path.read_text())
    out["git_sha"] = (doc.get("provenance") or {}).get("git_sha")
    rows = [r for r in doc.get("rows", []) if r.get("setup") == setup
            and r.get("preset") == preset and r.get("seq_len") == seq_len
            and r.get("mfu") is not None]
    if not rows:
        return {**out, "why": f"{path} has no {setup!r} row with an MFU for "
                              f"{preset} at sequence {seq_len}"}
    return {**out, "mfu": rows[0]["mfu"], "tokens_per_s": rows[0].get("tokens_per_s")}


def vs_single_gpu_best(mfu_per_gpu: float | None, best: dict) -> float | None:
    """MFU per GPU over the single-GPU best's MFU (None without either)."""
    if mfu_per_gpu is None or not best.get("mfu"):
        return None
    return mfu_per_gpu / best["mfu"]


# ------------------------------------------------------------------- the setups


def _dp(backend: str, ctx: dict) -> dict:
    """Data parallel under `backend` ("overlap", "ddp"): this rank's timing."""
    bucket = gom.QUICK_BUCKET_ELEMS if ctx["quick"] else gom.BUCKET_ELEMS
    model, opt = gom.build(ctx["preset"], backend, quick=ctx["quick"],
                           bucket_elems=bucket, device=ctx["device"])
    t = gom.time_steps(model, opt, ctx["cfg"], ctx["preset"], ctx["dp_batch"],
                       ctx["seq_len"], warmup=ctx["warmup"], iters=ctx["iters"],
                       peak_tflops=ctx["peak"], seed=distributed.rank())
    del model, opt
    two.release()
    return {"bucket_elems": bucket,
            "precision": gom._switches(backend, ctx["quick"], bucket).precision,
            **{k: t[k] for k in ("step_ms", "step_ms_p10", "step_ms_p90", "steps_timed",
                                 "step_ms_all", "peak_mem_gib")}}


def _tp(mode: str, ctx: dict) -> dict:
    """TP = 2 with sequence parallelism in `mode`: this rank's timing (and its checking
    steps' losses, which `sequence_parallel_step` records)."""
    mesh = ctx["tp_mesh"]
    why = sps.unavailable(mode, mesh.get_group("tp"))
    if why is not None:
        return {"skipped": why}
    t = sps.measure_mode(mode, ctx["cfg"], ctx["sw"], mesh, ctx["seq_len"],
                         ctx["tp_batch"], warmup=ctx["warmup"], iters=ctx["iters"],
                         device=ctx["device"])
    return {"precision": ctx["sw"].precision,
            **{k: t[k] for k in ("step_ms", "step_ms_p10", "step_ms_p90", "steps_timed",
                                 "step_ms_all", "peak_mem_gib", "mode_ran", "loss_step1",
                                 "loss_step2")}}


def _pp(schedule: str, ctx: dict) -> dict:
    """A p = 2 pipeline under `schedule` with AdamW after each step: this rank's timing."""

    cfg, m = ctx["pp_cfg"], ctx["pp_m"]
    got = pm._build(schedule, cfg, ctx["sw"], ctx["pp_mesh"], m, ctx["device"])
    if isinstance(got, str):
        return {"skipped": got}
    step, _, _, opt = got  # got keeps the stages alive

    def train_step(x, y):
        out = step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    gen = data.random_batches(cfg.vocab_size, m * pm.MICRO_BATCH, ctx["seq_len"], seed=0,
                              device=ctx["device"])
    batches = [next(gen) for _ in range(3)]
    t = two.timed_steps(train_step, batches, warmup=ctx["warmup"], iters=ctx["iters"],
                        device=ctx["device"])
    got = step = opt = train_step = None  # the stages and their optimizer freed
    two.release()
    return {"precision": ctx["sw"].precision, "m": m, "micro_batch": pm.MICRO_BATCH, **t}


def layout(setup: str) -> tuple[str, str]:
    """("dp2", "overlap") of "dp2-overlap": the layout and its variant."""
    kind, _, variant = setup.partition("-")
    return kind, variant


def group_batch(setup: str, ctx: dict) -> int:
    """Sequences one step of the whole group trains on, each counted once."""
    kind = layout(setup)[0]
    if kind == "dp2":
        return ctx["dp_batch"] * distributed.world_size()
    if kind == "tp2":
        return ctx["tp_batch"]
    return ctx["pp_m"] * pm.MICRO_BATCH


MEASURE = {"dp2": _dp, "tp2": _tp, "pp2": _pp}


def per_gpu(row: dict, cfg, world: int, peak: float, best: dict) -> dict:
    """The throughput fields of a timed row: the group's tokens/s, per GPU, MFU per GPU
    (6N and attention-aware, one GPU's peak) and the ratio to the single-GPU best."""

    st = mfu.step_stats(cfg, batch=row["batch"] / world, seq_len=row["seq_len"],
                        step_time_s=row["step_ms"] / 1e3, peak_tflops=peak)
    out = {"tokens_per_s": row["batch"] * row["seq_len"] / (row["step_ms"] / 1e3),
           "tokens_per_s_per_gpu": st.tokens_per_s, "mfu_per_gpu": st.mfu,
           "mfu_attn_per_gpu": st.mfu_attn, "n_params": st.n_params,
           "peak_tflops": peak, "single_gpu_best_mfu": best.get("mfu"),
           "vs_single_gpu_best": vs_single_gpu_best(st.mfu, best)}
    if out["vs_single_gpu_best"] is None:
        out["vs_single_gpu_best_why"] = best.get("why")
    return out


def _context(quick: bool, iters: int | None) -> dict:
    """Every setup's fixed inputs on this rank."""

    q = QUICK if quick else {}
    name = q.get("preset", PRESET)
    cfg = preset(name)
    return {"quick": quick, "preset": name, "cfg": cfg, "seq_len": q.get("seq_len", SEQ_LEN),
            "dp_batch": q.get("dp_batch", DP_BATCH),
            "tp_batch": q.get("tp_batch", sps.BATCH[SEQ_LEN]),
            "pp_m": q.get("pp_m", PP_M),
            "pp_cfg": cfg.replace(num_hidden_layers=q["pp_layers"]) if quick else cfg,
            "warmup": q.get("warmup", WARMUP), "iters": iters or q.get("iters", ITERS),
            "sw": two.switches_for(quick),
            "tp_mesh": distributed.make_mesh(tp=sps.TP),
            "pp_mesh": distributed.make_mesh(pp=pm.P),
            "peak": hardware.detect().peak_tflops("bf16") or 1.0,  # CPU: never saved
            "device": distributed.env().device}


def run_ranks(quick: bool = False, setups=SETUPS, iters: int | None = None) -> list[dict]:
    """Every setup on every rank of a two-rank group (already initialised); returns the
    rows (the same on every rank)."""
    ctx = _context(quick, iters)
    best = single_gpu_best(single_gpu_path(), ctx["preset"], ctx["seq_len"])
    world = distributed.world_size()
    rows = []
    for setup in setups:
        kind, variant = layout(setup)
        cfg = ctx["pp_cfg"] if kind == "pp2" else ctx["cfg"]
        row = {"kind": KIND, "setup": setup, "layout": kind, "variant": variant,
               "preset": ctx["preset"], "layers": cfg.num_hidden_layers,
               "seq_len": ctx["seq_len"], "batch": group_batch(setup, ctx),
               "world": world}
        if kind == "dp2":
            row["batch_per_rank"] = ctx["dp_batch"]
        rows.append(measure_row(NAME, row, MEASURE[kind], variant, ctx, cfg, best))
    return rows


def measure_row(name: str, row: dict, measure, variant: str, ctx: dict, cfg,
                best: dict) -> dict:
    """`row` completed by ``measure(variant, ctx)`` on every rank (`two_gpu.attempt`):
    its ``error`` or ``skipped``, else its timing, the larger rank's peak memory and the
    per-GPU throughput against the single-GPU `best` (`per_gpu`); one line printed."""
    setup, world = row["setup"], row["world"]
    distributed.rank0_print(f"[{name}] {setup} ...")
    got, error = two.attempt(measure, variant, ctx)
    if error is not None or "skipped" in got:
        key = "error" if error is not None else "skipped"
        row[key] = error if error is not None else got["skipped"]
        distributed.rank0_print(f"[{name}] {setup}: {key}, {row[key]}")
        return row
    peaks = two.per_rank(got.pop("peak_mem_gib"))
    row.update(got, peak_mem_gib_per_rank=peaks,
               peak_mem_gib=None if None in peaks else max(peaks))
    row.update(per_gpu(row, cfg, world, ctx["peak"], best))
    loss = f", loss {row['loss_step1']:.4f}" if row.get("loss_step1") is not None else ""
    distributed.rank0_print(
        f"[{name}] {setup}: {row['step_ms']:.1f} ms (p10 {row['step_ms_p10']:.1f}, "
        f"p90 {row['step_ms_p90']:.1f}), {row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
        f"MFU/GPU {row['mfu_per_gpu']:.1%}{loss}")
    return row


def run(quick: bool = False, setups=SETUPS, iters: int | None = None) -> list[dict]:
    """Rank 0's rows (`two_gpu.run`): two gloo CPU processes with `quick`.

    On two ranks (``torchrun --nproc-per-node 2``, NCCL, NVLink multicast off), `llama-7b-8l`
    at sequence 4096, bf16, every setup of `SETUPS` built fresh from seed 0 by the sibling
    benchmark that measures its switch alone (nothing is re-implemented here):

    * ``dp2-overlap``: data parallel, our overlapped bucketed all-reduce
      (`grad_overlap_measured.build`, backend "overlap", 12M-element buckets), per-rank batch
      `DP_BATCH` = 4: each GPU does the single-GPU ``composed`` run's whole step, plus the
      gradient all-reduce; the switches are ``SWITCH_SETS["best"]`` exactly as the
      single-GPU ``ours-bf16`` row's;
    * ``dp2-ddp``: the same with torch ``DistributedDataParallel`` on the same bucket bytes,
      the reference next to it;
    * ``tp2-ring``, ``tp2-split_gather``: TP = 2 with sequence parallelism, its collectives
      cut into ring steps under the GEMMs, or ColossalAI's plain all-gather/reduce-scatter
      (`sequence_parallel_step.measure_mode`: two checking steps, then the timed ones),
      batch `sequence_parallel_step.BATCH[4096]`;
    * ``pp2-zbv``, ``pp2-1f1b``: a pipeline of p = 2 at m = `PP_M` micro-batches of one
      sequence, our ZB-V (two chunks per rank in a V) or 1F1B, built by
      `pipeline_measured._build` (the smallest piece of that benchmark that yields one
      schedule's step: its `run_ranks` also measures per-layer costs and checks gradients
      against 1F1B, which this comparison does not need), AdamW after every step.

    TP and PP run `two_gpu.switches_for`: "best" without the fused cross-entropy and
    embedding, which TP's vocabulary-parallel loss and the pipeline's stage heads replace.

    **Timing.** `WARMUP` untimed steps, then `ITERS` (>= 20) timed with CUDA events; a
    step's time is the slower rank's (the per-step MAX over the ranks), so ``step_ms`` is the
    median of those, with p10 and p90 (DP through `train.measure_step`, TP and PP through
    `two_gpu.timed_steps`; the same events, the same reduction).

    **Per GPU.** ``batch`` counts the sequences one step of the whole group trains on, each
    once: DP 2 · 4 (every rank its own), TP 2 (both ranks work on the same tokens, each
    holding half of every weight), PP m · 1 (each micro-batch passes both stages). Then
    ``tokens_per_s = batch · seq / step``, ``tokens_per_s_per_gpu`` half of it, and
    ``mfu_per_gpu = 6 · N · tokens_per_s_per_gpu / peak``: the tutorial's formula (`mfu.step_stats`)
    with the whole model's N and one GPU's dense bf16 peak; with ``mfu_attn_per_gpu`` its
    attention-aware sibling. A layout's communication, its duplicated work (none here) and
    its bubbles all show up as lost MFU per GPU. ``vs_single_gpu_best = mfu_per_gpu /
    mfu(ours-bf16)``, the best bf16 row of ``results/<gpu>/composed.json`` (its file and
    commit in the config, ``single_gpu_best``; None with the reason when that file, or a
    row of the same preset and sequence, is absent). ``peak_mem_gib`` is the larger rank's
    `torch.cuda.max_memory_allocated` over the timed steps, each rank's in
    ``peak_mem_gib_per_rank``. A setup that fails (out of memory, a missing op) becomes a
    row with its ``error``; the others still run.

        torchrun --nproc-per-node 2 -m colossal_lab bench composed_parallel
        torchrun --nproc-per-node 2 -m colossal_lab bench composed_parallel --setups dp2-overlap
        python -m colossal_lab bench composed_parallel --quick   # 2 gloo CPU processes

    The quick run: the tiny model (4 layers for the pipeline), fp32, sequence 32, gloo, a
    few steps; prints, saves nothing.

    **No target.** The layouts are compared, not held to a number: `targets(rows)` reports
    each layout's ratio in the shape of the other benchmarks' verdicts, with no verdict.
    """
    return two.run(functools.partial(run_ranks, setups=tuple(setups), iters=iters), quick)


# ---------------------------------------------------------------------- the targets


def targets(rows: list[dict], world: int | None = None) -> list[dict]:
    """One report per layout (dp2, tp2, pp2, in the rows' order), in the shape of the
    verdicts of `two_gpu.threshold` but with no target: ``target`` None and ``ok``
    None, which `two_gpu.format_targets` prints as "reported". Nothing holds these
    layouts to a number; a report is neither met nor missed, so ``ok`` is never True
    or False here, and ``why`` is set only when the layout has no figure.

    ``measured`` is the layout's best ``vs_single_gpu_best`` (MFU per GPU over the
    single-GPU best's) and ``at`` its setup; ``worst`` the lowest over the layout's
    setups that ran; ``mfu_per_gpu`` the best setup's; ``by_setup`` every ratio;
    ``unmeasured`` the setups that failed or were skipped. Not measured (``why``) when
    no setup of the layout has the ratio: every one failed, or the single-GPU file was
    absent (its ``vs_single_gpu_best_why``; ``mfu_per_gpu`` is then the layout's best
    MFU per GPU still). Without a row, one such entry says so. `world` is not used: the
    layouts are two-GPU ones."""
    rows = [r for r in rows if r.get("kind") == KIND]
    out = []
    for kind in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == kind]
        ran = {r["setup"]: r for r in mine if r.get("vs_single_gpu_best") is not None}
        missing = [{"at": r["setup"], "why": two.gap(r) or r.get("vs_single_gpu_best_why")
                    or "no vs_single_gpu_best"} for r in mine if r["setup"] not in ran]
        check = {"check": f"{kind}: MFU per GPU against the single-GPU best "
                          "(vs_single_gpu_best)", "target": None, "ok": None,
                 "points": len(ran), "measured": None, "worst": None, "at": None,
                 "failing": [], "unmeasured": missing, "mfu_per_gpu": None,
                 "by_setup": {s: r["vs_single_gpu_best"] for s, r in ran.items()}}
        if not ran:
            mfus = [r["mfu_per_gpu"] for r in mine if r.get("mfu_per_gpu") is not None]
            out.append({**check, "mfu_per_gpu": max(mfus, default=None),
                        "why": "; ".join(f"{m['at']}: {m['why']}" for m in missing)})
            continue
        best = max(ran.values(), key=lambda r: r["vs_single_gpu_best"])
        out.append({**check, "measured": best["vs_single_gpu_best"], "at": best["setup"],
                    "worst": min(check["by_setup"].values()),
                    "mfu_per_gpu": best["mfu_per_gpu"]})
    return out or [{"check": "MFU per GPU against the single-GPU best", "target": None,
                    "ok": None, "points": 0, "measured": None, "worst": None, "at": None,
                    "failing": [], "unmeasured": [], "why": "no rows"}]


COLUMNS = [("setup", "setup", ""), ("batch", "batch", "d"), ("step ms", "step_ms", ".1f"),
           ("p10", "step_ms_p10", ".1f"), ("p90", "step_ms_p90", ".1f"),
           ("tok/s", "tokens_per_s", ",.0f"), ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f"),
           ("MFU/GPU", "mfu_per_gpu", ".3f"), ("vs 1 GPU", "vs_single_gpu_best", ".3f"),
           ("peak GiB", "peak_mem_gib", ".1f")]


def config_of(setups, iters: int) -> dict:
    return {"preset": PRESET, "seq_len": SEQ_LEN, "setups": list(setups),
            "dp_batch_per_rank": DP_BATCH, "dp_bucket_elems": gom.BUCKET_ELEMS,
            "tp_batch": sps.BATCH[SEQ_LEN], "pp_m": PP_M, "pp_micro_batch": pm.MICRO_BATCH,
            "warmup": WARMUP, "iters": iters, "world": two.WORLD,
            "switches_dp": 'config.SWITCH_SETS["best"]',
            "switches_tp_pp": repr(two.switches_for(False)),
            "single_gpu_best": single_gpu_best(single_gpu_path(), PRESET, SEQ_LEN),
            "batch": "sequences per step of the whole group, each counted once",
            "mfu_per_gpu": "6N · tokens_per_s_per_gpu / one GPU's dense bf16 peak",
            "step_time": "per step the slower rank's (CUDA events), median/p10/p90",
            "data": "random tokens (DP: each rank its own; TP, PP: seed 0, shared)",
            "nccl_nvls_enable": "0"}


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    quick_help="tiny model, 2 gloo processes on this CPU, not saved",
    options=[opt("--setups", nargs="+", choices=SETUPS, default=list(SETUPS)),
             flag("iters", help=f"timed steps (default {ITERS})")],
    check=at_least(20),
    execute=lambda call: two.on_ranks(
        call, show=lambda rows: two.print_table(rows, COLUMNS),
        quick_rows=lambda: run(True, call.args.setups, call.args.iters),
        rank_rows=lambda: run_ranks(False, setups=call.args.setups, iters=call.args.iters),
        config=lambda: config_of(call.args.setups, call.args.iters or ITERS)))
main = BENCH.main


if __name__ == "__main__":
    main()
