"""Switch 5 on 2 or 4 GPUs: a tensor-parallel `llama-7b-8l` step in each mode.

TP = t, the world size; the communication modes run side by side in one run."""

from __future__ import annotations

import torch

from colossal_lab.benchmarks import two_gpu
from colossal_lab.benchmarks.harness import Benchmark, opt
from colossal_lab.benchmarks.two_gpu import (
    LOSS_RTOL,
    WORLDS,
    attempt,
    per_rank,
    print_table,
    release,
    switches_for,
    timed_steps,
)
from colossal_lab.config import preset
from colossal_lab.model import build_model
from colossal_lab.parallel import distributed, tp_ops
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training import data, memory, train

NAME = "sequence_parallel_step"
PRESET = "llama-7b-8l"
SEQ_LENS = (4096, 8192)
BATCH = {4096: 2, 8192: 1}
"""Sequences per step at each length: 8192 tokens a step either way."""
MODES = ("all_reduce", "split_gather", "ring", "symm_mem")
TP = 2
"""The TP degree at two ranks (`composed_parallel`'s TP 2); this benchmark's t is the
world size torchrun launched (`two_gpu.WORLDS`)."""
WARMUP, ITERS = 3, 25
"""Untimed steps after the two checking steps, then timed steps (>= 20)."""
QUICK = {"preset": "tiny", "seq_lens": (32,), "batch": 2, "warmup": 1, "iters": 3}
"""The CPU smoke test: tiny model, fp32, gloo, a few steps."""
RING_VS_TP = {2: 1.08, 4: 1.1}
"""Target (TP 2 and TP 4): ring's ``vs_tp`` at least this, at every sequence
length measured."""
ACT_VS_TP = {2: 0.6}
"""Target (TP 2): split_gather's and ring's ``act_vs_tp`` at most this."""
SP_MODES = ("split_gather", "ring")
"""The sequence-parallel modes held to `ACT_VS_TP` (symm_mem: not part of the target)."""


# ----------------------------------------------------------------------- the cases


def unavailable(mode: str, group) -> str | None:
    """Why `mode` cannot run on `group` here (None: it can)."""

    if mode == "symm_mem" and not tp_ops.symm_mem_available(group):
        backend = torch.distributed.get_backend(group)
        return (f"no symm_mem: torch {torch.__version__} on {backend} "
                f"({'CUDA' if torch.cuda.is_available() else 'no CUDA'}) lacks torch's "
                "fused symmetric-memory ops (needs CUDA + NCCL)")
    return None


def measure_mode(mode: str, cfg, sw, mesh, seq_len: int, batch: int, *, warmup: int,
                 iters: int, device) -> dict:
    """One mode at one sequence length on this rank: its two checking steps' losses,
    its timing and memory (this rank's figures; `run_ranks` combines them)."""

    sp = mode != "all_reduce"
    msw = sw.replace(enable_sequence_parallelism=sp,
                     sequence_parallelism_mode=mode if sp else None)
    torch.manual_seed(0)
    model = apply_switches(build_model(cfg, device), msw, mesh)
    ran = model.tp.mode
    if ran != mode:  # never measure one mode under another's name
        raise RuntimeError(f"asked for {mode!r} but {ran!r} was built")
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt)
    gen = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    batches = [next(gen) for _ in range(4)]
    losses = [step(*batches[0]).item(), step(*batches[1]).item()]
    out = timed_steps(step, batches, warmup=warmup, iters=iters, device=device)
    probe = memory.memory_probe(model, train.our_loss, *batches[0])
    out.update(mode_ran=ran, loss_step1=losses[0], loss_step2=losses[1],
               activation_gib=probe.get("saved"), act_peak_gib=probe.get("activation"))
    del model, opt, step
    release()
    return out


def compare_to_plain(row: dict, base: dict, rtol: float) -> None:
    """Add to `row` its comparison with plain TP's `base` row at the same length: the
    checking steps' loss difference (``loss_ok`` within `rtol`), the speed-up
    ``vs_tp`` and the saved-activation ratio ``act_vs_tp``."""
    row["loss_diff"] = max(abs(row["loss_step1"] - base["loss_step1"]),
                           abs(row["loss_step2"] - base["loss_step2"]))
    row["loss_ok"] = row["loss_diff"] <= rtol * abs(base["loss_step2"])
    row["step_ms_tp"] = base["step_ms"]
    row["vs_tp"] = base["step_ms"] / row["step_ms"]
    row["activation_gib_tp"] = base["activation_gib"]
    if base["activation_gib"] and row["activation_gib"] is not None:
        row["act_vs_tp"] = row["activation_gib"] / base["activation_gib"]


def run_ranks(quick: bool = False, seq_lens=None, modes=MODES) -> list[dict]:
    """The benchmark on every rank of a group (already initialised), TP over all of it
    (t = its world size); returns the rows (the same on every rank)."""

    e = distributed.env()
    q = QUICK if quick else None
    preset_name = q["preset"] if quick else PRESET
    seq_lens = seq_lens or (q["seq_lens"] if quick else SEQ_LENS)
    warmup, iters = (q["warmup"], q["iters"]) if quick else (WARMUP, ITERS)
    cfg = preset(preset_name)
    sw = switches_for(quick)
    tp = e.world_size
    mesh = distributed.make_mesh(tp=tp)
    group = mesh.get_group("tp")
    rtol = LOSS_RTOL.get(sw.precision, 5e-3)
    rows = []
    for seq_len in seq_lens:
        batch = q["batch"] if quick else BATCH[seq_len]
        base = None
        for mode in modes:
            row = {"mode": mode, "seq_len": seq_len, "batch": batch, "tp": tp,
                   "world": e.world_size, "preset": preset_name,
                   "precision": sw.precision, "loss_rtol": rtol}
            why = unavailable(mode, group)
            if why is not None:
                row["skipped"] = why
                rows.append(row)
                distributed.rank0_print(f"[{NAME}] seq {seq_len} {mode}: skipped, {why}")
                continue
            got, error = attempt(measure_mode, mode, cfg, sw, mesh, seq_len, batch,
                                 warmup=warmup, iters=iters, device=e.device)
            if error is not None:
                row["error"] = error
                rows.append(row)
                distributed.rank0_print(f"[{NAME}] seq {seq_len} {mode}: failed, {error}")
                continue
            ranks = per_rank({k: got.pop(k) for k in ("peak_mem_gib", "activation_gib",
                                                      "act_peak_gib")})
            row.update(got)
            for k in ("peak_mem_gib", "activation_gib", "act_peak_gib"):
                vals = [r[k] for r in ranks]
                row[f"{k}_per_rank"] = vals
                row[k] = None if None in vals else max(vals)
            row["tokens_per_s"] = batch * seq_len / (row["step_ms"] / 1e3)
            row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / e.world_size
            if mode == "all_reduce":
                base = row
            if base is not None:
                compare_to_plain(row, base, rtol)
            rows.append(row)
            distributed.rank0_print(
                f"[{NAME}] seq {seq_len} {mode}: {row['step_ms']:.1f} ms "
                f"(p10 {row['step_ms_p10']:.1f}, p90 {row['step_ms_p90']:.1f}), "
                f"{row['tokens_per_s']:,.0f} tok/s, x{row.get('vs_tp', 1):.3f} vs TP, "
                f"loss diff {row.get('loss_diff', 0):.2e}")
    return rows


def run(quick: bool = False, world: int = two_gpu.WORLD) -> list[dict]:
    """Rank 0's rows (`two_gpu.run`): with `quick`, `world` gloo CPU processes (t).

    `sequence_parallel_gemm` predicts from one GPU what each scheme leaves exposed; this
    benchmark runs them. On t ranks (``torchrun --nproc-per-node t``, NCCL, NVLink
    multicast off: ``NCCL_NVLS_ENABLE=0``), for sequence lengths `SEQ_LENS` (batch
    `BATCH[seq]`: 8192 tokens a step either way) and each mode of `MODES`:

    * "all_reduce": plain TP, an all-reduce after every attention and MLP block;
    * "split_gather": sequence parallelism, ColossalAI's default (all-gather before a
      column-parallel linear, reduce-scatter after a row-parallel one);
    * "ring": the same collectives cut into t point-to-point steps under the GEMMs;
    * "symm_mem": torch's async TP (fused all-gather-matmul on symmetric memory), or a row
      that says why it cannot run here (no CUDA/NCCL, a torch without the ops): never
      another mode in its place (`tensor_parallel.apply` would fall back to "ring").

    The model carries the best single-GPU switches in bf16 (`config.SWITCH_SETS["best"]`)
    but the fused cross-entropy, which TP replaces by its vocabulary-parallel loss. Every
    mode starts from the same weights (seed 0, rank 0's broadcast) and the same batches.

    **Correctness first.** The first two steps of each mode are its check: the loss of step
    1 (the initial weights) and of step 2 (after one optimizer step) against plain TP's,
    ``|loss − loss_tp| <= LOSS_RTOL[precision] · |loss_tp|`` (bf16 reduces in another order
    in each mode; fp32 on the CPU agrees to rounding). The difference is recorded
    (``loss_diff``, the larger of the two) with ``loss_ok``.

    **Timing.** `WARMUP` more steps, then `ITERS` timed with CUDA events
    (`timing.time_iterations`); a step's time is the slowest rank's (an all-reduce of MAX
    over the ranks' times of that step), so ``step_ms`` is the median of those, with
    p10 and p90. tokens/s counts the batch once (every rank works on the same tokens):
    ``tokens_per_s = batch · seq / step``, ``tokens_per_s_per_gpu`` 1/t of it.

    **Memory**, per rank: ``peak_mem_gib`` (`torch.cuda.max_memory_allocated` over the
    timed steps, optimizer step included) and the probes of `memory.memory_probe` on one
    extra forward + backward: ``activation_gib`` its "saved" (what the forward keeps for
    the backward: the quantity sequence parallelism divides by t) and ``act_peak_gib`` its
    "activation" (peak minus what was allocated before the forward: saved activations,
    the backward's transients and the gradients). Both per rank as lists and their max.

    **Ratios** against plain TP at the same sequence length, from the same run:
    ``vs_tp = step_ms_tp / step_ms`` (> 1: faster than plain TP) and ``act_vs_tp =
    activation_gib / activation_gib_tp``; the plain-TP figures are in the row
    (``step_ms_tp``, ``activation_gib_tp``), so `integrity` recomputes both.

        torchrun --nproc-per-node 2 -m colossal_lab bench sequence_parallel_step   # TP 2
        torchrun --nproc-per-node 4 -m colossal_lab bench sequence_parallel_step   # TP 4
        python -m colossal_lab bench sequence_parallel_step --quick   # 2 gloo CPU processes
        python -m colossal_lab bench sequence_parallel_step --quick --world 4   # TP 4, gloo

    **Targets** (at TP 2 and TP 4): `targets(rows)` reads them off the rows.

    The quick run: the tiny model, fp32, gloo, two (or ``--world``) processes of
    `distributed.spawn`, a few steps; checks and prints, saves nothing. At TP 4 the tiny
    model's two key/value heads are each replicated on two ranks; `llama-7b-8l`'s 32 are
    sharded at either t.
    """
    return two_gpu.run(run_ranks, quick, world)


# ---------------------------------------------------------------------- the targets


def targets(rows: list[dict], world: int | None = None) -> list[dict]:
    """The targets on these rows at TP = `world` (default: the rows' ``world``),
    each a `two_gpu.threshold` verdict:

    1. ring >= `RING_VS_TP` [t] x plain TP (``vs_tp = step_ms_tp / step_ms``) at every
       sequence length in the rows; the worst length decides (TP 2 and TP 4 only);
    2. split_gather's and ring's saved activations <= `ACT_VS_TP` [t] x plain TP's
       (``act_vs_tp``) at every sequence length (TP 2 only);
    3. every mode that ran agrees with plain TP: its ``loss_ok`` (steps 1 and 2 within
       ``loss_rtol`` of plain TP's); measured ``loss_diff / |plain TP's step-2 loss|``,
       target ``loss_rtol``. A skipped mode (symm_mem where torch lacks the ops) has no
       loss to check: it is named in ``skipped``, not counted; one that failed is
       unmeasured.

    A point whose row, or plain TP's at its length, is absent, failed or skipped, or
    lacks the field (``act_vs_tp`` without allocator statistics), is unmeasured: the
    check is then None with ``why``, unless another point misses."""
    world = two_gpu.world_of(rows, world)
    rows = [r for r in rows if "mode" in r]
    by = {(r["seq_len"], r["mode"]): r for r in rows}
    seqs = sorted({r["seq_len"] for r in rows})

    def over(modes, field):
        """(points, unmeasured) of `field` of `modes` at every length."""
        points, missing = [], []
        for seq in seqs:
            base = by.get((seq, MODES[0]))
            for mode in modes:
                r, at = by.get((seq, mode)), f"{mode} at seq {seq}"
                if two_gpu.gap(r):
                    missing.append((at, two_gpu.gap(r)))
                elif two_gpu.gap(base):
                    missing.append((at, f"plain TP: {two_gpu.gap(base)}"))
                elif r.get(field) is None:
                    missing.append((at, f"no {field}"))
                else:
                    points.append((at, r[field]))
        return points, missing

    out = []
    if world in RING_VS_TP:
        points, missing = over(("ring",), "vs_tp")
        out.append(two_gpu.threshold(
            f"ring >= {RING_VS_TP[world]}x plain TP (step_ms_tp / step_ms) at every "
            f"seq len, TP = {world}", RING_VS_TP[world], points,
            unmeasured=missing))
    if world in ACT_VS_TP:
        points, missing = over(SP_MODES, "act_vs_tp")
        out.append(two_gpu.threshold(
            f"SP's saved activations <= {ACT_VS_TP[world]}x plain TP's (act_vs_tp of "
            f"split_gather and ring) at every seq len, TP = {world}", ACT_VS_TP[world],
            points, at_most=True, unmeasured=missing))
    points, missing, skipped = [], [], []
    for r in rows:
        if r["mode"] == MODES[0]:
            continue  # the baseline, against itself
        at, base = f"{r['mode']} at seq {r['seq_len']}", by.get((r["seq_len"], MODES[0]))
        if r.get("skipped") is not None:
            skipped.append({"at": at, "why": two_gpu.gap(r)})
        elif r.get("loss_ok") is None:
            why = two_gpu.gap(r) or f"plain TP: {two_gpu.gap(base) or 'no loss'}"
            missing.append((at, why))
        else:
            scale = abs(base["loss_step2"]) or 1.0
            points.append((at, r["loss_diff"] / scale, r["loss_ok"]))
    rtol = next((r["loss_rtol"] for r in rows if "loss_rtol" in r),
                LOSS_RTOL[switches_for(False).precision])
    out.append(two_gpu.threshold(
        "every mode that ran: losses of steps 1, 2 within loss_rtol of plain TP's "
        "(loss_diff / |loss_tp|)", rtol, points, at_most=True,
        unmeasured=missing, skipped=skipped))
    return out


COLUMNS = [("mode", "mode", ""), ("seq", "seq_len", "d"), ("step ms", "step_ms", ".1f"),
           ("p10", "step_ms_p10", ".1f"), ("p90", "step_ms_p90", ".1f"),
           ("tok/s", "tokens_per_s", ",.0f"), ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f"),
           ("vs TP", "vs_tp", ".3f"), ("act GiB", "activation_gib", ".2f"),
           ("act vs TP", "act_vs_tp", ".3f"), ("loss diff", "loss_diff", ".1e")]


def config_of(quick: bool = False, world: int = TP) -> dict:
    sw = switches_for(quick)
    return {"preset": PRESET, "seq_lens": list(SEQ_LENS), "batch": BATCH, "tp": world,
            "world": world, "modes": list(MODES), "warmup": WARMUP, "iters": ITERS,
            "check_steps": 2, "switches": repr(sw), "loss_rtol": LOSS_RTOL,
            "data": "random tokens, seed 0, the same on every rank",
            "step_time": "per step the slower rank's (CUDA events), median/p10/p90",
            "activation": "memory.memory_probe 'saved' (forward keeps for backward), "
                          "per rank; act_peak_gib its 'activation' (peak - before)",
            "vs_tp": "step_ms_tp / step_ms", "nccl_nvls_enable": "0"}


def _modes(a) -> list[str]:
    """The chosen modes, all_reduce always among them: the ratios' baseline."""
    modes = a.modes or MODES
    return modes if "all_reduce" in modes else ["all_reduce", *modes]


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    description="switch 5 measured: TP modes at t = the world size "
    f"({two_gpu._either(WORLDS)}: torchrun's --nproc-per-node, or --world with --quick)",
    quick_help="tiny model, fp32, gloo processes on this CPU, not saved",
    options=[two_gpu.world_flag(), opt("--seq-lens", type=int, nargs="*"),
             opt("--modes", nargs="*", choices=MODES)],
    check=two_gpu.world_problem,
    execute=lambda call: two_gpu.on_ranks(
        call, worlds=WORLDS, show=lambda rows: print_table(rows, COLUMNS),
        quick_rows=lambda: run(True, two_gpu.quick_world(call)),
        rank_rows=lambda: run_ranks(False, seq_lens=call.args.seq_lens,
                                    modes=_modes(call.args)),
        config=lambda: config_of(world=distributed.world_size())))
main = BENCH.main
