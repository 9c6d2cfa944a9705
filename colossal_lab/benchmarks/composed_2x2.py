"""The finale on four GPUs: full LLaMA-7B with every switch, as DP 2 × TP 2 and TP 2 × PP 2.

Both layouts are measured in one torchrun group, as MFU per GPU against the single-GPU
7B run and the target `TARGET_MFU`."""

from __future__ import annotations

import functools

import torch

from colossal_lab.benchmarks import composed_parallel as cp
from colossal_lab.benchmarks import grad_overlap_measured as gom
from colossal_lab.benchmarks import pipeline_measured as pm
from colossal_lab.benchmarks import two_gpu as two
from colossal_lab.benchmarks.harness import Benchmark, at_least, flag, opt, share, whole_at_least
from colossal_lab.config import preset
from colossal_lab.errors import UsageError
from colossal_lab.measure import hardware
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel, distributed, grad_norm, tensor_parallel
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.training import data, train

NAME = "composed_2x2"
KIND = "composed_2x2"
PRESET, SEQ_LEN = "llama-7b", 4096
SETUPS = ("dp2tp2-ring", "dp2tp2-split_gather", "tp2pp2-zbv", "tp2pp2-1f1b")
WORLD = 4
"""The only world size measured: two by two."""
MESHES = {"dp2tp2": {"pp": 1, "dp": 2, "tp": 2}, "tp2pp2": {"pp": 2, "dp": 1, "tp": 2}}
"""Each layout's `distributed.make_mesh` sizes."""
PP_SP_MODE = "ring"
"""The pipeline's sequence-parallel mode (its stages' TP collectives)."""
DP_BATCH = 2
"""Sequences per dp rank. An estimate, not yet measured: ~34 GB of weights, gradients
and optimizer state per rank plus ~1.5 GB of activations per layer and sequence over
tp should fit an H200's 141 GB without recomputation (else ``--ckpt-ratio``)."""
PP_M = 8
"""Micro-batches (of `pipeline_measured.MICRO_BATCH` sequences) per pipelined step."""
WARMUP, ITERS = 3, 20
TARGET_MFU = 0.50
"""The target: MFU (6N) per GPU in bf16 of the composed 7B run."""
SINGLE_GPU_SETUP = "ours-7b-bf16"
"""The single-GPU row of ``composed.json`` on the same model: full 7B at 4096."""
QUICK = {"preset": "tiny", "layers": 4, "seq_len": 32, "dp_batch": 2, "pp_m": 4,
         "warmup": 1, "iters": 3}
"""The CPU smoke test: dp_batch · 2 = pp_m, so both layouts train on the same tokens."""
COLUMNS = cp.COLUMNS[:1] + [("mode", "mode", "")] + cp.COLUMNS[1:] + [
    ("meets 0.50", "meets_target", "")]


# ------------------------------------------------------------------- the setups


def _switches(layout: str, variant: str, ctx: dict):
    """The base switches plus sequence parallelism, the layout's own and the
    checkpointing of ``--ckpt-ratio``."""

    ratio = ctx["ckpt_ratio"]
    sw = ctx["sw"].replace(
        enable_sequence_parallelism=True,
        sequence_parallelism_mode=variant if layout == "dp2tp2" else PP_SP_MODE,
        gradient_checkpoint_config=None if ratio is None
        else GradientCheckpointConfig(gradient_checkpointing_ratio=ratio))
    if layout == "dp2tp2":
        sw = sw.replace(overlap_communication=True,
                        extra={**sw.extra, "dp_bucket_elems": ctx["bucket_elems"]})
    return sw


def _group_loss(loss) -> float:
    """The group's mean loss of one step: each rank's (a dp rank's on its slice, the
    same on both ranks of a tp pair and on every rank of a pipeline) averaged over the
    world, which is the mean over the dp ranks' equal slices."""
    losses = two.per_rank(loss.item())
    return sum(losses) / len(losses)


def _checked_and_timed(step, batches, ctx: dict) -> dict:
    """Two checking steps (their group losses), then `WARMUP` + `ITERS` timed."""
    losses = [_group_loss(step(*batches[0])), _group_loss(step(*batches[1]))]
    t = two.timed_steps(step, batches, warmup=ctx["warmup"], iters=ctx["iters"],
                        device=ctx["device"])
    return {"loss_step1": losses[0], "loss_step2": losses[1], **t}


def _group_batches(cfg, n: int, ctx: dict) -> list:
    """Four of the group's batches of `n` sequences, seed 0, alike on every rank."""

    gen = data.random_batches(cfg.vocab_size, n, ctx["seq_len"], seed=0,
                              device=ctx["device"])
    return [next(gen) for _ in range(4)]


def _dp_tp(mode: str, ctx: dict) -> dict:
    """DP 2 × TP 2 with sequence parallelism in `mode`: this rank's figures."""

    cfg, mesh, b = ctx["cfg"], ctx["meshes"]["dp2tp2"], ctx["dp_batch"]
    torch.manual_seed(0)
    model = apply_switches(build_model(cfg, ctx["device"]),
                           _switches("dp2tp2", mode, ctx), mesh)
    ran = tensor_parallel.of(data_parallel.unwrap(model)).mode
    if ran != mode:  # never measure one mode under another's name
        raise RuntimeError(f"asked for {mode!r} but {ran!r} was built")
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt)
    r = mesh["dp"].get_local_rank()
    batches = [(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])  # this dp rank's slice
               for x, y in _group_batches(cfg, b * MESHES["dp2tp2"]["dp"], ctx)]
    out = _checked_and_timed(step, batches, ctx)
    del model, opt, step
    two.release()
    return {"mode_ran": ran, "bucket_elems": ctx["bucket_elems"], **out}


def _tp_pp(schedule: str, ctx: dict) -> dict:
    """TP 2 × PP 2 under `schedule`, AdamW after each clipped step: this rank's
    figures."""

    cfg, m = ctx["cfg"], ctx["pp_m"]
    got = pm._build(schedule, cfg, _switches("tp2pp2", schedule, ctx),
                    ctx["meshes"]["tp2pp2"], m, ctx["device"])
    if isinstance(got, str):
        return {"skipped": got}
    _, _, piped, opt = got
    ran = {st.tp.mode for st in piped.stages.values()}
    if ran != {PP_SP_MODE}:
        raise RuntimeError(f"asked for {PP_SP_MODE!r} stages but {sorted(ran)} were built")

    def train_step(x, y):
        loss = piped.step(x, y)
        data_parallel.of(piped).finish()  # a no-op without a "dp" dim
        grad_norm.clip_(piped, opt, 1.0)  # by the whole split model's norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out = _checked_and_timed(train_step, _group_batches(cfg, m * pm.MICRO_BATCH, ctx), ctx)
    got = piped = opt = train_step = None  # the stages and their optimizer freed
    two.release()
    return {"mode_ran": PP_SP_MODE, "schedule": schedule, "m": m,
            "micro_batch": pm.MICRO_BATCH, **out}


MEASURE = {"dp2tp2": _dp_tp, "tp2pp2": _tp_pp}


def group_batch(layout: str, ctx: dict) -> int:
    """Sequences one step of the whole group trains on, each counted once."""
    if layout == "dp2tp2":
        return ctx["dp_batch"] * MESHES["dp2tp2"]["dp"]
    return ctx["pp_m"] * pm.MICRO_BATCH


def choice(rows: list[dict]) -> dict:
    """The summary row: the setup (and its layout) with the highest MFU per GPU among
    those that ran, each candidate's MFU next to it."""
    ran = {r["setup"]: r for r in rows if r.get("mfu_per_gpu") is not None}
    out = {"kind": "choice", "by": "mfu_per_gpu", "target_mfu": TARGET_MFU,
           "candidates": {s: r["mfu_per_gpu"] for s, r in ran.items()}}
    if not ran:
        return {**out, "setup": None, "layout": None,
                "why": "no setup ran: every row has an error"}
    best = max(ran.values(), key=lambda r: r["mfu_per_gpu"])
    return {**out, "setup": best["setup"], "layout": best["layout"],
            "mfu_per_gpu": best["mfu_per_gpu"], "step_ms": best["step_ms"],
            "meets_target": best["meets_target"]}


def targets(rows: list[dict], world: int | None = None) -> list[dict]:
    """The target on these rows, each a `two_gpu.threshold` verdict: the
    composed 7B run reaches MFU (6N) >= `TARGET_MFU` per GPU in bf16 (``mfu_per_gpu``,
    one GPU's dense bf16 peak), first for the faster setup, the one the ``kind:
    "choice"`` row names (`choice` of the rows where there is no such row), then for
    each setup of `SETUPS` (and any other in the rows), one check each.

    A setup absent (a run of ``--setups``), failed (out of memory) or skipped is
    unmeasured, and so is a row of another preset than `PRESET` (the quick run's tiny
    model) or another precision than bf16: the target is full LLaMA-7B's in bf16.
    `world` is not used: the benchmark runs at `WORLD` only."""
    setups = [r for r in rows if r.get("kind") == KIND]
    by = {r["setup"]: r for r in setups}
    picked = next((r for r in rows if r.get("kind") == "choice"), None) or choice(setups)

    def point(setup: str):
        r = by.get(setup)
        why = two.gap(r)
        if why is None and r.get("preset") != PRESET:
            why = f"preset {r.get('preset')}: the target is {PRESET}'s"
        elif why is None and not str(r.get("precision")).startswith("bf16"):
            why = f"precision {r.get('precision')}: the target is bf16's"
        elif why is None and r.get("mfu_per_gpu") is None:
            why = "no mfu_per_gpu"
        return ([], [(setup, why)]) if why else ([(setup, r["mfu_per_gpu"])], [])

    def verdict(check: str, points, missing) -> dict:
        return two.threshold(f"{check}: MFU (6N) >= {TARGET_MFU} per GPU, {PRESET} in "
                             "bf16", TARGET_MFU, points, unmeasured=missing)

    if picked.get("setup") is None:
        first = verdict("the faster setup (choice)", [],
                        [("choice", picked.get("why") or "no setup ran")])
    else:
        first = verdict("the faster setup (choice)", *point(picked["setup"]))
    return [first, *(verdict(s, *point(s)) for s in dict.fromkeys([*SETUPS, *by]))]


def _context(quick: bool, iters: int | None, dp_batch: int | None, pp_m: int | None,
             ckpt_ratio: float | None) -> dict:
    """Every setup's fixed inputs on this rank (the meshes: collectives, every rank)."""

    q = QUICK if quick else {}
    name = q.get("preset", PRESET)
    cfg = preset(name)
    if quick:
        cfg = cfg.replace(num_hidden_layers=q["layers"])
    return {"quick": quick, "preset": name, "cfg": cfg,
            "seq_len": q.get("seq_len", SEQ_LEN),
            "dp_batch": dp_batch or q.get("dp_batch", DP_BATCH),
            "pp_m": pp_m or q.get("pp_m", PP_M), "ckpt_ratio": ckpt_ratio,
            "bucket_elems": gom.QUICK_BUCKET_ELEMS if quick else gom.BUCKET_ELEMS,
            "warmup": q.get("warmup", WARMUP), "iters": iters or q.get("iters", ITERS),
            "sw": two.switches_for(quick),
            "meshes": {k: distributed.make_mesh(**v) for k, v in MESHES.items()},
            "peak": hardware.detect().peak_tflops("bf16") or 1.0,  # CPU: never saved
            "device": distributed.env().device}


def run_ranks(quick: bool = False, setups=SETUPS, iters: int | None = None,
              dp_batch: int | None = None, pp_m: int | None = None,
              ckpt_ratio: float | None = None) -> list[dict]:
    """Every setup on every rank of a four-rank group (already initialised), then the
    choice; returns the rows (the same on every rank)."""
    world = distributed.world_size()
    if world != WORLD:
        raise UsageError(f"{NAME} runs on exactly {WORLD} ranks, not {world}")
    ctx = _context(quick, iters, dp_batch, pp_m, ckpt_ratio)
    best = cp.single_gpu_best(cp.single_gpu_path(), ctx["preset"], ctx["seq_len"],
                              setup=SINGLE_GPU_SETUP)
    cfg = ctx["cfg"]
    rows = []
    for setup in setups:
        kind, variant = cp.layout(setup)
        row = {"kind": KIND, "setup": setup, "layout": kind, "variant": variant,
               "preset": ctx["preset"], "layers": cfg.num_hidden_layers,
               "seq_len": ctx["seq_len"], "batch": group_batch(kind, ctx),
               "world": world, "mesh": dict(MESHES[kind]),
               "mode": variant if kind == "dp2tp2" else PP_SP_MODE,
               "precision": ctx["sw"].precision, "ckpt_ratio": ctx["ckpt_ratio"]}
        if kind == "dp2tp2":
            row["batch_per_dp_rank"] = ctx["dp_batch"]
        row = cp.measure_row(NAME, row, MEASURE[kind], variant, ctx, cfg, best)
        if row.get("mfu_per_gpu") is not None:
            row.update(target_mfu=TARGET_MFU,
                       meets_target=row["mfu_per_gpu"] >= TARGET_MFU)
        rows.append(row)
    rows.append(choice(rows))
    return rows


def run(quick: bool = False, setups=SETUPS, iters: int | None = None, **sizes) -> list:
    """Rank 0's rows (`two_gpu.run`): four gloo CPU processes with `quick`. `sizes`:
    `run_ranks`'s ``dp_batch``, ``pp_m``, ``ckpt_ratio``.

    On four ranks (``torchrun --nproc-per-node 4``, NCCL, NVLink multicast off),
    `llama-7b` (32 layers) at sequence 4096, the base switches `two_gpu.switches_for`
    (the best bf16 set without the fused cross-entropy and embedding, which TP's
    vocabulary-parallel loss and its row-sharded embedding replace), each setup of
    `SETUPS` built fresh from seed 0 by `apply_switches` on a `distributed.make_mesh`:

    * ``dp2tp2-ring``, ``dp2tp2-split_gather``: mesh dp = 2 × tp = 2; each tp pair holds
      half of every weight with sequence parallelism in that mode (collectives cut into
      ring steps under the GEMMs, or ColossalAI's all-gather / reduce-scatter), and the
      two pairs reduce their gradients with our overlapped bucketed all-reduce
      (``overlap_communication=True``, `grad_overlap_measured.BUCKET_ELEMS` buckets);
      `DP_BATCH` sequences per dp rank (``--dp-batch``), `train.make_step` (the DP
      reduction, clipping by the whole model's norm, AdamW);
    * ``tp2pp2-zbv``, ``tp2pp2-1f1b``: mesh pp = 2 × tp = 2, a pipeline of two stages
      (ZB-V: two chunks per rank in a V, whose W steps run the TP linears' deferred
      weight-gradient halves; or 1F1B), each stage TP-sharded with ring sequence
      parallelism, m = `PP_M` micro-batches of one sequence (``--pp-m``), built by
      `pipeline_measured._build`; after each ``model.step`` the gradients are clipped by
      the whole split model's norm (`grad_norm.clip_`), then AdamW.

    Which is faster is not obvious: DP × TP all-reduces a 7B/2 gradient each step
    (overlapped with the backward) and runs every layer on every pair; TP × PP sends only
    activations between the stages but pays the pipeline's bubble (ZB-V fills most of it).
    ``--ckpt-ratio R`` recomputes ``floor(R · n)`` layers of each stage
    (`GradientCheckpointConfig`) in every setup, should the activations not fit.

    **Correctness first.** Each setup's first two steps are its check (as
    `sequence_parallel_step`'s): the group's loss of step 1 (the initial weights) and of
    step 2 (after one optimizer step), recorded as ``loss_step1`` / ``loss_step2``. The
    data are seed 0's random tokens, the whole group's batch drawn alike on every rank; a
    dp rank trains on its slice of it, the pipeline on all of it. When the two layouts'
    batches are the same size (``--dp-batch`` · 2 = ``--pp-m``, as in the quick run) they
    train on the same tokens from the same weights, so their losses agree to rounding.

    **Timing and per GPU** as `composed_parallel`'s: `WARMUP` untimed steps, then
    `ITERS` (>= 20) timed with CUDA events, a step's time the slower rank's, ``step_ms``
    the median with p10 and p90 (`two_gpu.timed_steps`). ``batch`` counts the sequences
    one step of the group trains on, each once: dp2tp2 ``dp_batch`` · 2 (each tp pair its
    own, both ranks of a pair the same), tp2pp2 m · 1. `composed_parallel.per_gpu` turns
    it into tokens/s, per GPU, ``mfu_per_gpu`` (6N, one GPU's dense bf16 peak) and
    ``vs_single_gpu_best`` against `SINGLE_GPU_SETUP` of ``results/<gpu>/composed.json``
    (`llama-7b` at 4096 on one GPU); ``meets_target`` is ``mfu_per_gpu >= TARGET_MFU``.
    A setup that fails (out of memory) becomes a row with its ``error``; the others still
    run. After them one row of ``kind: "choice"`` names the faster setup by MFU per GPU
    among those that ran, and its layout: whichever is faster.

        torchrun --nproc-per-node 4 -m colossal_lab bench composed_2x2
        torchrun --nproc-per-node 4 -m colossal_lab bench composed_2x2 --ckpt-ratio 0.25
        python -m colossal_lab bench composed_2x2 --quick   # 4 gloo CPU processes

    Measured rows go to ``results/<gpu>x4/composed_2x2.json`` (`results.run_slug`). The
    quick run: the tiny model with 4 layers (ZB-V's 2p = 4 stages), fp32, sequence 32,
    gloo, a few steps; prints, saves nothing. `targets(rows)` reads the target off
    the rows.
    """
    return two.run(functools.partial(run_ranks, setups=tuple(setups), iters=iters,
                                     **sizes), quick, WORLD)


def print_rows(rows: list[dict]) -> None:
    """The setups' table, then the choice in a sentence."""
    two.print_table([r for r in rows if r["kind"] != "choice"], COLUMNS)
    c = rows[-1]
    if c["setup"] is None:
        print(f"choice: none ({c['why']})")
    else:
        print(f"choice: {c['setup']} ({c['layout']}), MFU/GPU {c['mfu_per_gpu']:.3f}, "
              f"target {TARGET_MFU:.2f} {'met' if c['meets_target'] else 'missed'}")


def config_of(setups, iters: int, dp_batch: int, pp_m: int,
              ckpt_ratio: float | None) -> dict:
    return {"preset": PRESET, "seq_len": SEQ_LEN, "setups": list(setups),
            "meshes": MESHES, "pp_sp_mode": PP_SP_MODE, "dp_batch_per_rank": dp_batch,
            "dp_bucket_elems": gom.BUCKET_ELEMS, "pp_m": pp_m,
            "pp_micro_batch": pm.MICRO_BATCH, "ckpt_ratio": ckpt_ratio,
            "warmup": WARMUP, "iters": iters, "check_steps": 2, "world": WORLD,
            "switches": repr(two.switches_for(False)), "target_mfu": TARGET_MFU,
            "single_gpu_best": cp.single_gpu_best(cp.single_gpu_path(), PRESET, SEQ_LEN,
                                                  setup=SINGLE_GPU_SETUP),
            "batch": "sequences per step of the whole group, each counted once",
            "mfu_per_gpu": "6N · tokens_per_s_per_gpu / one GPU's dense bf16 peak",
            "step_time": "per step the slower rank's (CUDA events), median/p10/p90",
            "clip": "1.0, by the whole split model's norm (grad_norm)",
            "data": "random tokens, seed 0, the group's batch alike on every rank; "
                    "a dp rank trains on its slice",
            "nccl_nvls_enable": "0"}


def _sizes(a) -> dict:
    return {"dp_batch": a.dp_batch, "pp_m": a.pp_m, "ckpt_ratio": a.ckpt_ratio}


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    quick_help="tiny model, 4 gloo processes on this CPU, not saved",
    options=[opt("--setups", nargs="+", choices=SETUPS, default=list(SETUPS)),
             flag("iters", help=f"timed steps (default {ITERS})"),
             opt("--dp-batch", type=whole_at_least(1), default=None,
                 help=f"sequences per dp rank in dp2tp2 (default {DP_BATCH})"),
             opt("--pp-m", type=whole_at_least(2), default=None,
                 help=f"micro-batches per pipelined step, >= p = 2 (default {PP_M})"),
             opt("--ckpt-ratio", type=share, default=None,
                 help="share of each stage's layers to recompute (default: none)")],
    check=at_least(20),
    execute=lambda call: two.on_ranks(
        call, worlds=(WORLD,), show=print_rows,
        quick_rows=lambda: run(True, call.args.setups, call.args.iters, **_sizes(call.args)),
        rank_rows=lambda: run_ranks(False, setups=call.args.setups, iters=call.args.iters,
                                    **_sizes(call.args)),
        config=lambda: config_of(call.args.setups, call.args.iters or ITERS,
                                 call.args.dp_batch or DP_BATCH, call.args.pp_m or PP_M,
                                 call.args.ckpt_ratio)))
main = BENCH.main


if __name__ == "__main__":
    main()
