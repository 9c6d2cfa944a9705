"""Switch 8 on N GPUs: how much gradient all-reduce each data-parallel backend hides."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence

import torch

from colossal_lab import precision as precision_mod
from colossal_lab.benchmarks import collectives, two_gpu
from colossal_lab.benchmarks import grad_overlap as go
from colossal_lab.benchmarks.harness import Benchmark, flag, opt
from colossal_lab.config import SWITCH_SETS, Switches, preset
from colossal_lab.errors import UsageError
from colossal_lab.measure import hardware, mfu, timing
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel, distributed
from colossal_lab.parallel import overlap_model as om
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training import data, train

NAME = go.MEASURED
PRESETS = ("llama-7b-8l", "1b")
SEQ_LEN = 4096
BATCHES = (2, 4)
"""Per-rank batches (sequences): the global batch is N times more."""
WARMUP, ITERS = 3, 20
TIMELINE_STEPS = 10
"""Steps of the nocomm model recorded by `TimelineRecorder` (after its timing)."""
BUCKET_ELEMS = 12 * 2**20
BACKENDS = ("nocomm", "naive", "overlap", "ddp", "fsdp2")
OVERLAPPED = ("overlap", "ddp", "fsdp2")
"""The backends whose overlap efficiency is reported."""
PROBE_REPS = 10
"""Timed all-reduces per size of the link probe (the model's bandwidth)."""
TARGET_E = 0.8
"""Target: our overlap's E at least this wherever the communication is at
least `TARGET_COMM_SHARE` of the backward."""
TARGET_COMM_SHARE = 0.2
"""The ``comm_share`` from which on `TARGET_E` holds."""
GRAD_RTOL = {2: 2e-2, 4: 1e-5}
"""Largest |g − g_naive| over the largest |g_naive| of gradients that equal naive's, by
bytes per gradient element (bf16, fp32): `pipeline_measured.GRAD_RTOL`'s, keyed by what
the rows record (``grad_bytes_per_elem``; they do not name the precision)."""
QUICK = {"presets": ("tiny",), "seq_len": 32, "batches": (2,), "warmup": 1, "iters": 3,
         "timeline_steps": 2, "probe_reps": 3}
QUICK_BUCKET_ELEMS = 16 * 1024
"""Buckets for the tiny model's ~130k parameters (the real cap would hold it whole)."""


# ---------------------------------------------------------------- the formulas


def overlap_efficiency(t_sync: float, t_overlap: float, t_nocomm: float) -> float | None:
    """E = (T_sync − T_overlap) / (T_sync − T_nocomm): the share of the naive step's
    communication time that the overlapped step does not pay. None when the naive step
    is no slower than the step without communication (nothing to hide)."""
    exposed_sync = t_sync - t_nocomm
    if not exposed_sync > 0:
        return None
    return (t_sync - t_overlap) / exposed_sync


def comm_share(t_sync: float, t_nocomm: float, backward_ms: float) -> float | None:
    """(T_sync − T_nocomm) / T_backward: the naive step's communication against the
    backward it could hide under; None without a backward time."""
    if not backward_ms or backward_ms <= 0:
        return None
    return (t_sync - t_nocomm) / backward_ms


# ---------------------------------------------------------------- one backend


def _switches(backend: str, quick: bool, bucket_elems: int):

    base = Switches() if quick else SWITCH_SETS["best"]  # fp32 on the CPU: fast, exact
    dp = "naive" if backend == "nocomm" else backend
    return base.replace(overlap_communication=dp,
                        extra={**base.extra, "dp_bucket_elems": bucket_elems})


def build(preset_name: str, backend: str, *, quick: bool, bucket_elems: int, device):
    """A fresh model (seed 0) with the best switches and `backend`'s reduction applied
    by `apply_switches`, and its optimizer. "nocomm": naive's, reduction removed."""

    torch.manual_seed(0)
    model = apply_switches(build_model(preset(preset_name), device),
                           _switches(backend, quick, bucket_elems))
    if backend == "nocomm":
        inner = data_parallel.unwrap(model)
        inner.grad_sync.detach()
        inner.grad_sync = data_parallel.NO_SYNC  # the same step, nothing reduced
    return model, train.make_optimizer(model)


def reduced_grads(model, input_ids, labels) -> dict[str, torch.Tensor]:
    """Forward, backward and the backend's reduction (`finish`) on one batch, no
    optimizer step; the reduced gradients by name (fsdp2's shards gathered)."""

    inner = data_parallel.unwrap(model)
    prec = precision_mod.of(inner)
    device = input_ids.device
    with precision_mod.matmul_mode(prec), precision_mod.autocast(prec, device):
        loss = train.our_loss(model, input_ids, labels)
    loss.backward()
    data_parallel.of(model).finish()
    out = {}
    for name, p in inner.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def grad_diff(got: dict, ref: dict) -> tuple[float, float]:
    """(max |got − ref|, max |ref|) over every parameter, in fp32."""
    if set(got) != set(ref):
        raise RuntimeError(f"gradients of {sorted(set(got) ^ set(ref))[:4]} exist on one "
                           "side only")
    diff = scale = 0.0
    for name, r in ref.items():
        diff = max(diff, (got[name].float() - r.float()).abs().max().item())
        scale = max(scale, r.float().abs().max().item())
    return diff, scale


def time_steps(model, opt, cfg, preset_name: str, batch: int, seq_len: int, *, warmup: int,
               iters: int, peak_tflops: float, seed: int) -> dict:
    """`train.measure_step` of `make_step(model, opt)` on random tokens (this rank's
    own), then each step's time replaced by the slowest rank's: the row's step fields,
    tokens/s per GPU and MFU against one GPU's peak from those."""

    device = next(model.parameters()).device
    step = train.make_step(model, opt)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=seed, device=device)
    m = train.measure_step(step, batches, cfg=cfg, setup="dp", preset=preset_name,
                           batch=batch, seq_len=seq_len, warmup=warmup, iters=iters,
                           peak_tflops=peak_tflops, progress=False)
    times = [round(t, 3) for t in distributed.all_max(m.step_ms_all)]
    s = timing._summary(times)
    st = mfu.step_stats(cfg, batch=batch, seq_len=seq_len, step_time_s=s.median_ms / 1e3,
                        peak_tflops=peak_tflops, recompute_flops=0.0)
    return {"step_ms": s.median_ms, "step_ms_p10": s.p10_ms, "step_ms_p90": s.p90_ms,
            "steps_timed": s.n, "step_ms_all": times, "tokens_per_s": st.tokens_per_s,
            "mfu": st.mfu, "mfu_attn": st.mfu_attn, "hfu": st.hfu,
            "achieved_tflops": st.achieved_tflops, "n_params": st.n_params,
            "peak_tflops": peak_tflops, "peak_mem_gib": m.peak_mem_gib,
            "optimizer": type(opt).__name__}


def backward_timeline(model, opt, cfg, batch: int, seq_len: int, steps: int, seed: int):
    """Gradient-ready times and backward ms (medians over `steps` recorded steps after
    one), as `bench grad_overlap` records them: the model's input."""

    device = next(model.parameters()).device
    rec = go.TimelineRecorder(model)
    step = train.make_step(model, opt, rec.wrap(train.our_loss))
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=seed, device=device)
    ready: list = []
    backward: list[float] = []

    def after(i, ms):
        marks, bwd = rec.collect()
        ready.append(marks)
        backward.append(bwd)

    def one(i):
        if i < 1:
            rec.arm()
        step(*next(batches))

    timing.time_iterations(one, warmup=1, iters=steps, device=device,
                           before_step=lambda i: rec.arm(), on_step=after)
    rec.detach()
    rows = [{"kind": "param", "name": n, "index": i, "numel": p.numel(),
             "ready_ms": (timing._summary([r[i] for r in ready if r[i] is not None])
                          .median_ms if any(r[i] is not None for r in ready) else None)}
            for i, (n, p) in enumerate(zip(rec.names, rec.params))]
    bwd = timing._summary(backward).median_ms
    rows.append({"kind": "backward", "backward_ms": bwd, "step_ms": None})
    grads, bwd, _ = go.grads_of(rows)
    return grads, bwd


def predicted_exposed(backend: str, grads, backward_ms: float, *, bucket_elems: int,
                      esize: int, world: int, busbw: dict[int, float]) -> float | None:
    """The single-GPU model's exposed communication for `backend`'s buckets, on a
    `Link` with the bus bandwidth measured here (`busbw`: bytes -> GB/s): the flat
    buffer's for naive, one bucket's for ours and DDP (ready order: both rebuild their
    buckets after the first step); None for fsdp2 and nocomm."""

    dtype = {2: "bf16", 4: "fp32"}[esize]
    flat = sum(g.numel for g in grads) * esize
    if backend == "naive":
        bucket, nbytes = go.BucketSize("flat"), flat
    elif backend == "overlap":
        bucket, nbytes = go.BucketSize("ours", bucket_elems), bucket_elems * esize
    elif backend == "ddp":
        bucket = go.BucketSize("ddp", nbytes=bucket_elems * esize,
                               first_nbytes=torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
        nbytes = bucket_elems * esize
    else:
        return None
    link = om.Link("measured here", busbw[min(nbytes, flat)], 0.0,
                   "this run's all-reduce of that many bytes (latency included)")
    return go.overlap_of(grads, backward_ms, bucket, link, world, dtype, "ready").exposed_ms


# ---------------------------------------------------------------- one configuration


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_config(preset_name: str, batch: int, link: str, *, seq_len: int, quick: bool,
                   warmup: int, iters: int, timeline_steps: int, probe_reps: int,
                   bucket_elems: int, peak_tflops: float, progress: bool = True
                   ) -> list[dict]:
    """Every backend's row for one (preset, per-rank batch, link), on every rank."""

    env = distributed.env()
    world, rank = env.world_size, env.rank
    cfg = preset(preset_name)
    check_ids, check_labels = next(data.random_batches(
        cfg.vocab_size, batch, seq_len, seed=1000 + rank, device=env.device))
    say = distributed.rank0_print if progress else (lambda *a, **k: None)
    rows: dict[str, dict] = {}
    ref_grads = grads = bwd = None
    esize = None
    for backend in BACKENDS:
        say(f"  {preset_name}, batch {batch}/rank, {link}: {backend}")
        model, opt = build(preset_name, backend, quick=quick, bucket_elems=bucket_elems,
                           device=env.device)
        row = {}
        if backend != "nocomm":
            got = reduced_grads(model, check_ids, check_labels)
            if backend == "naive":
                ref_grads = got
            diff, scale = grad_diff(got, ref_grads)
            row.update(grad_max_abs_diff_vs_naive=diff, grad_max_abs=scale)
            del got
        row.update(time_steps(model, opt, cfg, preset_name, batch, seq_len, warmup=warmup,
                              iters=iters, peak_tflops=peak_tflops, seed=rank))
        if backend == "nocomm":
            grads, bwd = backward_timeline(model, opt, cfg, batch, seq_len,
                                           timeline_steps, seed=rank)
            esize = next(model.parameters()).element_size()
        rows[backend] = row
        del model, opt  # before the next backend's model is built
        _free()
    del ref_grads
    # the link as the model sees it: an all-reduce of one bucket and of the flat
    # buffer, measured on this group (DDP's 1 MiB first bucket taken at the cap's rate)
    flat = sum(g.numel for g in grads) * esize
    busbw = {n: collectives.time_collective("all_reduce", n, warmup=2, reps=probe_reps,
                                            dtype=_dtype(esize))
             for n in sorted({min(bucket_elems * esize, flat), flat})}
    t_nocomm, t_sync = rows["nocomm"]["step_ms"], rows["naive"]["step_ms"]
    out = []
    for backend in BACKENDS:
        r = rows[backend]
        nbytes = flat if backend == "naive" else min(bucket_elems * esize, flat)
        probe = busbw[nbytes] if backend in ("naive", "overlap", "ddp") else None
        out.append({
            "kind": "dp_step", "preset": preset_name, "seq_len": seq_len, "batch": batch,
            "global_batch": batch * world, "world": world, "link": link,
            "backend": backend, "dist_backend": env.backend,
            "bucket_elems": bucket_elems if backend in ("overlap", "ddp") else None,
            "grad_bytes_per_elem": esize, "grad_elems": flat // esize,
            **r,
            "t_nocomm_ms": t_nocomm, "t_sync_ms": t_sync, "backward_ms": bwd,
            "measured_exposed_ms": r["step_ms"] - t_nocomm,
            "predicted_exposed_ms": predicted_exposed(
                backend, grads, bwd, bucket_elems=bucket_elems, esize=esize, world=world,
                busbw={n: p["busbw_gbps"] for n, p in busbw.items()}),
            "link_busbw_gbps": probe["busbw_gbps"] if probe else None,
            "link_probe_bytes": nbytes if probe else None,
            "allreduce_flat_ms": busbw[flat]["ms"],
            "overlap_efficiency": (overlap_efficiency(t_sync, r["step_ms"], t_nocomm)
                                   if backend in OVERLAPPED else None),
            "comm_share": comm_share(t_sync, t_nocomm, bwd),
        })
    return out


def _dtype(esize: int) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[esize]


def measure(link: str, *, presets: Sequence[str] = PRESETS,
            batches: Sequence[int] = BATCHES, seq_len: int = SEQ_LEN, quick: bool = False,
            warmup: int = WARMUP, iters: int = ITERS, timeline_steps: int = TIMELINE_STEPS,
            probe_reps: int = PROBE_REPS, bucket_elems: int = BUCKET_ELEMS,
            progress: bool = True) -> list[dict]:
    """Every (preset, batch) for one link setting, on every rank of the group."""

    peak = hardware.detect().peak_tflops("bf16")
    if peak is None:  # the CPU: MFU against a number, never read (quick is not saved)
        peak = 1.0
    rows = []
    for name in presets:
        for batch in batches:
            rows += measure_config(name, batch, link, seq_len=seq_len, quick=quick,
                                   warmup=warmup, iters=iters,
                                   timeline_steps=timeline_steps, probe_reps=probe_reps,
                                   bucket_elems=bucket_elems, peak_tflops=peak,
                                   progress=progress)
    return rows


def _quick_worker(link: str) -> list[dict]:
    q = QUICK
    return measure(link, presets=q["presets"], batches=q["batches"], seq_len=q["seq_len"],
                   quick=True, warmup=q["warmup"], iters=q["iters"],
                   timeline_steps=q["timeline_steps"], probe_reps=q["probe_reps"],
                   bucket_elems=QUICK_BUCKET_ELEMS, progress=False)


def run(quick: bool = False, *, link: str = "nvlink", presets: Sequence[str] = PRESETS,
        iters: int | None = None, progress: bool = True,
        world: int = two_gpu.WORLD) -> list[dict]:
    """One link setting's rows. `quick`: `world` gloo processes on this CPU (`spawn`),
    rank 0's rows. Otherwise on every rank of a torchrun job (`main`).

    For each preset of `--presets` (default `PRESETS`: llama-7b-8l, and "1b", TinyLlama-1.1B's
    shape), each per-rank batch of `BATCHES` (sequence 4096, the best bf16 switches,
    `config.SWITCH_SETS["best"]`) and the link setting of `--link`
    (`collectives.LINK_ENV`: nvlink, host, sockets), the training step is timed
    (`train.measure_step`: `WARMUP` then `ITERS` steps, CUDA events; a step's time is the
    slowest rank's) for

    * ``nocomm``: the naive model with its reduction taken out (``grad_sync`` set to
      `data_parallel.NO_SYNC`), run on every rank at once at the same per-rank batch:
      T_nocomm, one GPU's step under the same conditions as the others (every GPU busy,
      same clocks, same memory). We do not take "naive minus its all-reduce": that would
      assume the flatten and copy-back cost nothing and that the all-reduce costs on the
      step's stream what it costs alone; the all-reduce alone is recorded
      (`allreduce_flat_ms`) as a cross-check of T_sync − T_nocomm.
    * ``naive``: one flat all-reduce after the backward (`NaiveAllReduce`): T_sync.
    * ``overlap``: ours, `OverlappedAllReduce` (``overlap_communication=True``), buckets of
      `BUCKET_ELEMS` (ColossalAI's 12M elements) launched as they fill.
    * ``ddp``: torch `DistributedDataParallel`, buckets of the same bytes
      (`bucket_cap_mb` = 12M elements of the gradient dtype; its first bucket 1 MiB).
    * ``fsdp2``: `fully_shard` per decoder layer (ZeRO-3: reduce-scatter of the
      gradients, all-gather of the parameters; not a replicated peer: it also moves the
      parameters, and its optimizer updates 1/N of them).

    All four are built by `apply_switches(model, switches, mesh)` on a fresh model (seed 0).

    **Per row** (`kind="dp_step"`, one per preset, batch, link and backend):
    ``tokens_per_s`` per GPU (per-rank batch · sequence / step), ``step_ms`` with p10 and p90
    and every step (``step_ms_all``), MFU against one GPU's peak, and

    * overlap efficiency E = (T_sync − T_overlap) / (T_sync − T_nocomm)
      (`overlap_efficiency`): 1 = every millisecond of the naive step's communication
      hidden, 0 = none, < 0 = slower than naive; for overlap, ddp and fsdp2 (None when
      T_sync − T_nocomm ≤ 0: no communication to hide, E means nothing);
    * ``measured_exposed_ms`` = T − T_nocomm, and next to it ``predicted_exposed_ms``: what
      the single-GPU model of `overlap_model` (the one chapter 08 draws from
      `bench grad_overlap`) predicts for the same buckets, from this run's own backward
      timeline (the nocomm model's gradient-ready times, `grad_overlap.TimelineRecorder`)
      and this link's all-reduce measured here (a `Link` whose bandwidth is the bus
      bandwidth of an all-reduce of one bucket, or of the flat buffer for naive, latency
      folded in: `link_busbw_gbps`); None for fsdp2, which the model does not describe;
    * ``comm_share`` = (T_sync − T_nocomm) / T_backward: the naive step's communication
      against the backward it could hide under (> 1: no bucket size can hide it all);
    * ``grad_max_abs_diff_vs_naive``: after one forward and backward on the same batch
      (rank-dependent, the same for every backend), the largest difference between this
      backend's reduced gradients and naive's (fsdp2: its shards gathered), with
      ``grad_max_abs`` for scale; this is also each backend's first step (ours and DDP
      rebuild their buckets in it).

    Run once per link; each invocation replaces its link's and presets' rows in
    ``results/<gpu>x<n>/grad_overlap_measured.json`` (`results.merge_rows`)::

        torchrun --nproc-per-node 2 -m colossal_lab bench grad_overlap_measured --link nvlink
        torchrun --nproc-per-node 4 -m colossal_lab bench grad_overlap_measured --link nvlink
        python -m colossal_lab bench grad_overlap_measured --quick   # 2 gloo CPU processes

    `--quick`: the tiny model in fp32, sequence 32, 2 gloo processes on this CPU (or
    ``--world 4``; `distributed.spawn`), buckets of `QUICK_BUCKET_ELEMS`, a few steps,
    nothing saved. N is whatever torchrun launched (2 or more): the per-rank batch stays,
    the global batch is N times it, and the model's all-reduce time uses N
    (``2(N−1)/N``, cancelled by the bus bandwidth measured at the same N).

    **Targets** (at any N): `targets(rows)` reads them off the rows.
    """
    if quick:
        return distributed.spawn(_quick_worker, world, collectives.QUICK_LINK,
                                 timeout_s=240, collective_timeout_s=60)[0]
    iters = iters or ITERS
    if iters < 20:
        raise UsageError(f"iters={iters}: time at least 20 steps, or the p10-p90 spread "
                         "means nothing")
    return measure(link, presets=presets, iters=iters, progress=progress)


# ---------------------------------------------------------------- the targets


def _share(row: dict) -> float | None:
    """The row's ``comm_share``, else the same figure from its own fields
    ((``t_sync_ms`` − ``t_nocomm_ms``) / ``backward_ms``); None without them."""
    if row.get("comm_share") is not None:
        return row["comm_share"]
    if None in (row.get("t_sync_ms"), row.get("t_nocomm_ms")):
        return None
    return comm_share(row["t_sync_ms"], row["t_nocomm_ms"], row.get("backward_ms"))


def targets(rows: Sequence[dict], world: int | None = None) -> list[dict]:
    """The targets on these rows (one world, any N: `world` only names it; by
    default the rows' ``world``), each a `two_gpu.threshold` verdict on our backend,
    "overlap", over every (preset, per-rank batch, link) configuration in the rows:

    1. E >= `TARGET_E` wherever ``comm_share`` >= `TARGET_COMM_SHARE`: E =
       (T_sync − T_overlap) / (T_sync − T_nocomm) (``overlap_efficiency``) and the
       share (T_sync − T_nocomm) / T_backward, T_backward the nocomm model's backward
       (``backward_ms``, recomputed from those fields where ``comm_share`` is absent).
       A configuration below the share is ``exempt`` (listed with its share), not a
       point; with none at or above it the check is None: the target applies nowhere.
       ``comm_share`` of each point is kept: a backward of T_backward hides at most
       that much of the all-reduce, so E stays below about min(1, 1 / share), and
       where the share passes 1 / 0.8 = 1.25 no bucket size meets the target;
    2. our reduced gradients equal naive's, the sync version (one forward and backward
       on the same batch): ``grad_max_abs_diff_vs_naive / grad_max_abs <=
       GRAD_RTOL[grad_bytes_per_elem]``.

    A configuration without an overlap row (or whose row failed) is unmeasured."""
    world = two_gpu.world_of(list(rows), world)
    dp = [r for r in rows if r.get("kind") == "dp_step"]
    configs = list(dict.fromkeys((r["preset"], r["batch"], r["link"]) for r in dp))
    ours = {(r["preset"], r["batch"], r["link"]): r for r in dp if r["backend"] == "overlap"}
    n = f", N = {world}" if world else ""
    e_points, e_missing, exempt, shares = [], [], [], {}
    g_points, g_missing = [], []
    for key in configs:
        r, at = ours.get(key), f"{key[0]} batch {key[1]} {key[2]}"
        if two_gpu.gap(r):
            e_missing.append((at, f"overlap {two_gpu.gap(r)}"))
            g_missing.append((at, f"overlap {two_gpu.gap(r)}"))
            continue
        share = _share(r)
        e = r.get("overlap_efficiency")
        if e is None and None not in (r.get("t_sync_ms"), r.get("t_nocomm_ms")):
            e = overlap_efficiency(r["t_sync_ms"], r["step_ms"], r["t_nocomm_ms"])
        if share is None:
            e_missing.append((at, "no comm_share (no backward_ms)"))
        elif share < TARGET_COMM_SHARE:
            exempt.append({"at": at, "comm_share": share})
        elif e is None:
            e_missing.append((at, "no overlap_efficiency"))
        else:
            e_points.append((at, e))
            shares[at] = share
        diff, scale = r.get("grad_max_abs_diff_vs_naive"), r.get("grad_max_abs")
        if diff is None or scale is None:
            g_missing.append((at, "no gradient comparison"))
        else:
            g_points.append((at, diff / scale if scale else (0.0 if diff == 0
                                                             else math.inf)))
    nowhere = (f"communication < {TARGET_COMM_SHARE:.0%} of the backward in every "
               "configuration: the target applies nowhere" if exempt else "no rows")
    esize = next((r["grad_bytes_per_elem"] for r in ours.values()
                  if r.get("grad_bytes_per_elem") in GRAD_RTOL), 2)
    return [
        two_gpu.threshold(
            f"overlap's E >= {TARGET_E} wherever comm_share >= {TARGET_COMM_SHARE} "
            f"(communication over the backward), every preset, batch, link{n}", TARGET_E,
            e_points, unmeasured=e_missing, empty=nowhere, exempt=exempt,
            comm_share=shares),
        two_gpu.threshold(
            "overlap's gradients equal naive's (sync): max |g - g_naive| <= "
            f"{GRAD_RTOL[esize]:g} max |g_naive|, every preset, batch, link{n}",
            GRAD_RTOL[esize], g_points, at_most=True, unmeasured=g_missing)]


def summary(rows: Sequence[dict]) -> str:
    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec)

    lines = [f"{'preset':<12}{'b/rank':>7} {'link':<8}{'backend':<9}{'step ms':>9}"
             f"{'p10':>9}{'p90':>9}{'tok/s/GPU':>11}{'E':>7}{'exp ms':>9}{'pred ms':>9}"
             f"{'comm/bwd':>9}{'grad diff':>11}"]
    for r in rows:
        lines.append(
            f"{r['preset']:<12}{r['batch']:>7} {r['link']:<8}{r['backend']:<9}"
            f"{r['step_ms']:>9.2f}{r['step_ms_p10']:>9.2f}{r['step_ms_p90']:>9.2f}"
            f"{r['tokens_per_s']:>11.4g}{f(r['overlap_efficiency'], '.2f'):>7}"
            f"{f(r['measured_exposed_ms'], '.2f'):>9}"
            f"{f(r['predicted_exposed_ms'], '.2f'):>9}{f(r['comm_share'], '.2f'):>9}"
            f"{f(r.get('grad_max_abs_diff_vs_naive'), '.2g'):>11}")
    return "\n".join(lines)


def config_of(link_env: dict, presets, iters: int) -> dict:
    return {"presets": list(presets), "seq_len": SEQ_LEN, "batches_per_rank": list(BATCHES),
            "switches": 'config.SWITCH_SETS["best"]', "warmup": WARMUP, "iters": iters,
            "timeline_steps": TIMELINE_STEPS, "bucket_elems": BUCKET_ELEMS,
            "backends": list(BACKENDS), "probe_reps": PROBE_REPS,
            "nccl_env": {k: {**collectives.ALWAYS_ENV, **v}
                         for k, v in collectives.LINK_ENV.items()},
            "this_invocation_nccl_env": link_env,
            "data": "random tokens, each rank its own", "merged_by": ["link", "preset"],
            "timing": "train.measure_step (CUDA events per step); each step's time the "
                      "slowest rank's"}


def _known_presets(a) -> str | None:
    for name in a.presets:  # an unknown name fails here, not after minutes of setup
        preset(name)
    return two_gpu.world_problem(a)


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    quick_help="tiny model, gloo processes on this CPU (link 'loopback', --link "
    "ignored), not saved; a measured run takes torchrun's world (2 or more)",
    options=[collectives.link_flag(),
             opt("--presets", nargs="+", default=list(PRESETS),
                 help=f"model presets (default: {' '.join(PRESETS)})"),
             two_gpu.world_flag(), flag("iters", help=f"timed steps (default {ITERS})")],
    check=_known_presets,
    execute=lambda call: collectives.on_link(
        call, merged_by=("link", "preset"), report=summary,
        quick_rows=lambda world: run(True, link=call.args.link, world=world),
        rank_rows=lambda: run(link=call.args.link, presets=call.args.presets,
                              iters=call.args.iters),
        config=lambda env: config_of(env, call.args.presets, call.args.iters or ITERS)))
main = BENCH.main


if __name__ == "__main__":
    main()
