"""Switch 8 on one GPU: when each gradient is ready, and what all-reduce it would expose.

How much all-reduce would a data-parallel step leave exposed, given when each gradient
becomes ready in the backward?"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colossal_lab import precision
from colossal_lab.benchmarks import steps
from colossal_lab.benchmarks.harness import counted
from colossal_lab.config import SWITCH_SETS, preset
from colossal_lab.errors import UsageError
from colossal_lab.measure import timing
from colossal_lab.parallel import overlap_model as om
from colossal_lab.parallel.data_parallel import unwrap
from colossal_lab.switches.resolved import backends_in_use
from colossal_lab.testing.gradient_checks import data_parallel_gradient_check
from colossal_lab.training import data, train

NAME = "grad_overlap_model"
PRESET, SEQ_LEN, BATCH = "llama-7b-8l", 4096, 4
WARMUP, ITERS = 3, 30
QUICK = {"preset": "tiny", "seq_len": 64, "batch": 2, "warmup": 1, "iters": 5}
"""The CPU smoke test: tiny model, a few steps, perf_counter."""
WORLDS = (2, 8)
DTYPES = {"bf16": 2, "fp32": 4}
"""Gradient (and reduction) dtype -> bytes per element."""
ORDERS = ("ready", "registration")
"""Bucket orders: the measured ready order (the overlapped reducer's buckets after its
first step) and reverse registration (before it)."""
MEASURED = "grad_overlap_measured"
"""The results file of the measured multi-GPU run (`grad_overlap_measured`): chapter 08 shows
it when it exists."""
M = 1024 * 1024


@dataclass(frozen=True)
class BucketSize:
    """A bucket cap in elements, or in bytes (DDP's `bucket_cap_mb`: elements depend
    on the dtype); `elems=None` and `nbytes=None`: one flat bucket after the backward
    (the naive reducer)."""

    label: str
    elems: int | None = None
    nbytes: int | None = None
    first_nbytes: int | None = None
    """A smaller cap for the first bucket (DDP: 1 MiB)."""

    @property
    def flat(self) -> bool:
        return self.elems is None and self.nbytes is None

    def caps(self, bytes_per_elem: int) -> tuple[int | None, int | None]:
        """(bucket cap, first-bucket cap) in elements of `bytes_per_elem` bytes."""
        cap = self.elems if self.elems is not None else (
            None if self.nbytes is None else self.nbytes // bytes_per_elem)
        first = None if self.first_nbytes is None else self.first_nbytes // bytes_per_elem
        return cap, first


BUCKETS = (BucketSize("1M", 1 * M), BucketSize("4M", 4 * M),
           BucketSize("12M (ColossalAI)", 12 * M),
           BucketSize("25 MB (DDP)", nbytes=25 * M, first_nbytes=1 * M),
           BucketSize("64M", 64 * M), BucketSize("flat"))
"""Elements are 2^20 ("M"), as ColossalAI's ``reduce_bucket_size_in_m``; DDP's 25 MB
is 25 MiB (``bucket_cap_mb=25``) with a first bucket of 1 MiB
(``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""

K = 1024
QUICK_BUCKETS = (BucketSize("1K", 1 * K), BucketSize("4K", 4 * K),
                 BucketSize("12K", 12 * K),
                 BucketSize("25 KB", nbytes=25 * K, first_nbytes=1 * K),
                 BucketSize("64K", 64 * K), BucketSize("flat"))
"""`BUCKETS` divided by 1024, for the tiny model's ~150k parameters (with the real caps
every bucket would hold the whole tiny model)."""


# ---------------------------------------------------------------- the timeline


class TimelineRecorder:
    """Marks, on the device's clock, when the backward starts and ends and when each
    trainable parameter's gradient is final.

    CUDA: events recorded on the current stream by the hooks (the autograd thread's
    stream: the one the gradient was computed on), read after the step, so the GPU's
    own times and no host synchronisation inside the backward. CPU: `perf_counter` in
    the hooks (the CPU runs the backward in the hooks' thread)."""

    def __init__(self, model: torch.nn.Module):

        inner = unwrap(model)
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.cuda = self.params[0].device.type == "cuda"
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
            for i, p in enumerate(self.params)]
        self._marks: list = []
        self._start = self._end = None
        self.order: list[int] = []
        """Parameter indices in the order their hooks fired in the last backward."""

    def _now(self, slot=None):
        if self.cuda:
            slot.record()  # current stream: the GPU passes it when earlier work is done
            return slot
        return time.perf_counter()

    def arm(self) -> None:
        """Get ready for the next backward (events made here, not inside it)."""
        if self.cuda:
            new = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            self._pool = [new() for _ in self.params]
            self._pool_start, self._pool_end = new(), new()
        self._marks = [None] * len(self.params)
        self._start = self._end = None
        self.order = []

    def _ready(self, i: int, param) -> None:
        self._marks[i] = self._now(self._pool[i] if self.cuda else None)
        self.order.append(i)

    def _begin(self, grad) -> None:
        self._start = self._now(self._pool_start if self.cuda else None)
        # DDP's trick: a callback the engine runs when this backward has finished
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._end = self._now(self._pool_end if self.cuda else None)

    def wrap(self, loss_fn):
        """`loss_fn` whose loss marks the start of the backward (a hook on the loss runs
        before any of the backward's work)."""

        def timed(model, *args):
            loss = loss_fn(model, *args)
            if loss.requires_grad:
                loss.register_hook(self._begin)
            return loss

        return timed

    def collect(self) -> tuple[list[float | None], float]:
        """(ms from the backward's start to each parameter's ready mark (None: no
        gradient), ms from start to end) of the last backward. Synchronises on CUDA:
        call it after the step."""
        if self._start is None or self._end is None:
            raise RuntimeError("no backward was recorded: call arm(), run one step with "
                               "the wrapped loss, then collect()")
        if self.cuda:
            torch.cuda.synchronize()
            ms = lambda m: self._start.elapsed_time(m)  # noqa: E731
        else:
            ms = lambda m: (m - self._start) * 1e3  # noqa: E731
        return [None if m is None else ms(m) for m in self._marks], ms(self._end)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, p10, p90), as `timing` computes a step's spread (`statistics.quantiles`,
    its default method: `integrity` recomputes the step's from `step_ms_all`)."""
    t = timing._summary(list(values))
    return t.median_ms, t.p10_ms, t.p90_ms


def measure_timeline(preset_name: str = PRESET, seq_len: int = SEQ_LEN,
                     batch: int = BATCH, *, switches=None, warmup: int = WARMUP,
                     iters: int = ITERS, device=None, progress: bool = True
                     ) -> list[dict]:
    """Time `iters` training steps (after `warmup`) of `preset_name` with `switches`
    (default: `SWITCH_SETS["best"]`; on a CPU its "triton" norm becomes the CPU's best,
    as Triton would need the interpreter), recording the backward's timeline in each.
    Returns one "param" row per trainable parameter and one "backward" row."""

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if switches is None:
        switches = SWITCH_SETS["best"]
        if device.type == "cpu":
            switches = switches.replace(enable_fused_normalization=True)
    torch.manual_seed(0)
    cfg = preset(preset_name)
    setup = steps.Setup("grad-overlap", "backward timeline", switches=switches)
    model, loss_fn = steps.build(setup, preset_name, device)
    rec = TimelineRecorder(model)
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt, rec.wrap(loss_fn))
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=0, device=device)
    ready: list[list[float | None]] = []
    backward: list[float] = []
    steps_ms: list[float] = []
    first_order: list[int] = []

    def before(i):
        rec.arm()

    def after(i, ms):
        marks, bwd = rec.collect()
        ready.append(marks)
        backward.append(bwd)
        steps_ms.append(ms)
        if not first_order:
            first_order.extend(rec.order)
        if progress:
            print(f"  step {len(steps_ms)}/{iters}: {ms:.1f} ms, backward {bwd:.1f} ms",
                  flush=True)
        train.collect_now()

    def one(i):
        if i < warmup:
            rec.arm()
        step(*next(batches))

    with train.gc_between_steps():
        timing.time_iterations(one, warmup=warmup, iters=iters, device=device,
                               before_step=before, on_step=after)
    rec.detach()
    place = {i: k for k, i in enumerate(first_order)}
    rows = []
    for i, (name, p) in enumerate(zip(rec.names, rec.params)):
        got = [r[i] for r in ready if r[i] is not None]
        med, p10, p90 = _spread(got) if got else (None, None, None)
        rows.append({"kind": "param", "name": name, "index": i, "numel": p.numel(),
                     "param_dtype": str(p.dtype).replace("torch.", ""),
                     "ready_ms": med, "ready_ms_p10": p10, "ready_ms_p90": p90,
                     "ready_place": place.get(i), "steps": len(got)})
    b_med, b_p10, b_p90 = _spread(backward)
    s_med, s_p10, s_p90 = _spread(steps_ms)
    rows.append({"kind": "backward", "preset": preset_name, "seq_len": seq_len,
                 "batch": batch, "precision": precision.of(model),
                 **backends_in_use(model),
                 "timing": "cuda_events" if device.type == "cuda" else "perf_counter",
                 "params": len(rec.params),
                 "numel": sum(p.numel() for p in rec.params), "backward_ms": b_med,
                 "backward_ms_p10": b_p10, "backward_ms_p90": b_p90, "step_ms": s_med,
                 "step_ms_p10": s_p10, "step_ms_p90": s_p90, "steps_timed": len(steps_ms),
                 "backward_ms_all": backward, "step_ms_all": steps_ms})
    return rows


def grads_of(rows: Sequence[dict]) -> tuple[list[om.Grad], float, float]:
    """The model's inputs from a timeline's rows: the gradients in registration order
    (a parameter that got no gradient counts as ready at the backward's end), the
    backward's and the whole step's median ms."""
    bwd = next(r for r in rows if r.get("kind") == "backward")
    params = sorted((r for r in rows if r.get("kind") == "param"),
                    key=lambda r: r["index"])
    grads = [om.Grad(r["name"], r["numel"], r["ready_ms"] if r["ready_ms"] is not None
                     else bwd["backward_ms"]) for r in params]
    return grads, bwd["backward_ms"], bwd["step_ms"]


# ------------------------------------------------------------------- the model


def overlap_of(grads: Sequence[om.Grad], backward_ms: float, bucket: BucketSize,
               link: om.Link, world: int, dtype: str = "bf16", order: str = "ready"
               ) -> om.Overlap:
    """The model's prediction for one configuration (`dtype` a key of `DTYPES`): the
    naive reducer for the flat bucket, else the buckets `bucket` makes in `order`."""
    nbytes = DTYPES[dtype]
    kw = {"link": link, "world": world, "bytes_per_elem": nbytes,
          "backward_ms": backward_ms}
    if bucket.flat:
        return om.naive(grads, **kw)
    cap, first = bucket.caps(nbytes)
    return om.simulate(grads, om.make_buckets(grads, cap, order=order,
                                              first_bucket_elems=first), **kw)


def model_rows(grads: Sequence[om.Grad], backward_ms: float, step_ms: float, *,
               buckets: Sequence[BucketSize] = BUCKETS,
               links: Sequence[om.Link] = om.LINKS, worlds: Sequence[int] = WORLDS,
               dtypes: Sequence[str] = tuple(DTYPES), orders: Sequence[str] = ORDERS
               ) -> list[dict]:
    """One "model" row per (bucket size, order, link, world, dtype); the flat bucket
    (naive) once per (link, world, dtype), with ``order=None``."""
    total = sum(g.numel for g in grads)
    rows = []
    for dtype in dtypes:
        for b in buckets:
            cap, first = b.caps(DTYPES[dtype])
            for order in [None] if b.flat else orders:
                for ln in links:
                    for w in worlds:
                        res = overlap_of(grads, backward_ms, b, ln, w, dtype, order)
                        rows.append({
                            "kind": "model", "bucket": b.label,
                            "bucket_elems": total if b.flat else cap,
                            "first_bucket_elems": first, "order": order, "link": ln.name,
                            "link_gbps": ln.gbps, "latency_us": ln.latency_us, "world": w,
                            "dtype": dtype, "buckets": len(res.spans),
                            "comm_ms": res.comm_ms, "exposed_ms": res.exposed_ms,
                            "hidden_ms": res.hidden_ms,
                            "first_start_ms": res.first_start_ms,
                            "last_bucket_elems": res.spans[-1].elems,
                            "last_comm_ms": res.spans[-1].comm_ms,
                            "backward_ms": backward_ms, "step_ms": step_ms,
                            "exposed_share": res.exposed_ms / (step_ms + res.exposed_ms)})
    return rows


def run(quick: bool = False, *, iters: int | None = None, progress: bool = True
        ) -> list[dict]:
    """The timeline (param and backward rows) and the model over every configuration.
    `quick`: the tiny model on this machine's CPU, `QUICK_BUCKETS`; not a measurement
    of any GPU.

    One GPU cannot measure data parallelism, but it can measure what overlap works with:
    the backward's timeline. For a training step of `llama-7b-8l` (sequence 4096, batch 4,
    the best bf16 switches, `config.SWITCH_SETS["best"]`), a post-accumulate-grad hook on
    every parameter records a CUDA event on the current stream when the parameter's
    gradient is final, and a hook on the loss records one when the backward starts (and
    queues one for its end, `queue_callback`, as DDP does); nothing synchronises inside the
    backward: the elapsed times are read after the step. Over 30 steps (after 3 warm-up
    steps) each parameter's ready time is the median, with p10 and p90, and so is the
    backward's total time. On a CPU (`quick`): the tiny model, 5 steps after 1, with
    `time.perf_counter` in the hooks, the best switches a CPU runs, and the bucket sizes of
    `QUICK_BUCKETS` (divided by 1024): a smoke test and an illustration, not a measurement.

    `colossal_lab.parallel.overlap_model` then turns the timeline into predicted exposed
    communication for every bucket size of `BUCKETS` (1M, 4M, 12M = ColossalAI's, 25 MB =
    DDP's with its 1 MiB first bucket, 64M elements, and one flat bucket after the
    backward = naive), every link of `overlap_model.LINKS` (NVLink 4, PCIe 5 x16, 400 and
    100 Gb/s networks), 2 and 8 ranks, and bf16 and fp32 gradients; buckets assigned in the
    measured ready order (what the overlapped reducer uses from its second step) and in
    reverse registration order (its first step).

    Rows: ``kind="param"`` (one per trainable parameter: name, numel, ready_ms median /
    p10 / p90, its place in the order the hooks fired), ``kind="backward"`` (the backward
    and whole-step times), ``kind="model"`` (one per configuration: buckets, comm_ms,
    exposed_ms, backward_ms, exposed_share = exposed / (one GPU's step + exposed), the
    share of a data-parallel step spent waiting for the reduction).

        python -m colossal_lab bench grad_overlap   # results/<gpu>/grad_overlap_model.json
        python -m colossal_lab bench grad_overlap --quick   # tiny, this CPU, not saved
    """
    if quick:
        q = QUICK
        rows = measure_timeline(q["preset"], q["seq_len"], q["batch"], warmup=q["warmup"],
                                iters=iters or q["iters"], device="cpu", progress=False)
    else:
        iters = iters or ITERS
        if iters < 20:
            raise UsageError(f"iters={iters}: time at least 20 steps, or the p10-p90 "
                             "spread means nothing")
        rows = measure_timeline(iters=iters, progress=progress)
    grads, bwd, step = grads_of(rows)
    rows += model_rows(grads, bwd, step, buckets=QUICK_BUCKETS if quick else BUCKETS)
    if progress:
        print(summary(rows), flush=True)
    return rows


def summary(rows: Sequence[dict]) -> str:
    """The backward, then bf16 exposed ms per bucket size and link at 8 ranks."""
    b = next(r for r in rows if r.get("kind") == "backward")
    lines = [f"{b['preset']}, seq {b['seq_len']}, batch {b['batch']} ({b['timing']}): "
             f"backward {b['backward_ms']:.1f} ms (p10 {b['backward_ms_p10']:.1f}, p90 "
             f"{b['backward_ms_p90']:.1f}), step {b['step_ms']:.1f} ms, "
             f"{b['params']} parameters, n={b['steps_timed']}"]
    model = [r for r in rows if r.get("kind") == "model" and r["dtype"] == "bf16"
             and r["world"] == max(WORLDS) and r["order"] in ("ready", None)]
    links = list(dict.fromkeys(r["link"] for r in model))
    lines.append(f"  exposed ms, bf16, {max(WORLDS)} ranks: " + " | ".join(links))
    for label in dict.fromkeys(r["bucket"] for r in model):
        cells = [f"{r['exposed_ms']:8.2f}" for ln in links for r in model
                 if r["bucket"] == label and r["link"] == ln]
        lines.append(f"  {label:<18}" + " ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------- the chapter's live check


def gradient_checks(cases: dict) -> dict:
    """Run on every rank of a group (`distributed.spawn(gradient_checks, 2, cases)`):
    `data_parallel_gradient_check` for each case, ``{name: (backend, keywords)}``, in one
    group of processes (each costs a few seconds to start). Returns {name: verdict}."""

    return {name: data_parallel_gradient_check(backend, **kw)
            for name, (backend, kw) in cases.items()}


# ------------------------------------------------------------------------ main


def config_of(iters: int = ITERS) -> dict:
    return {"preset": PRESET, "seq_len": SEQ_LEN, "batch": BATCH,
            "switches": 'config.SWITCH_SETS["best"]', "warmup": WARMUP, "iters": iters,
            "data": "random tokens", "optimizer": "train.make_optimizer (bf16-pure: fp32 "
            "master AdamW)",
            "timing": "CUDA events recorded in post-accumulate-grad hooks, on the "
                      "current stream; backward start from a hook on the loss, end "
                      "from an autograd queue_callback; read after each step",
            "buckets": [vars(b) for b in BUCKETS], "worlds": list(WORLDS),
            "dtypes": DTYPES, "orders": list(ORDERS),
            "links": [vars(ln) for ln in om.LINKS],
            "allreduce": "ring: latency + 2(W-1)/W * bytes / bandwidth, one stream, no "
                         "contention with compute (colossal_lab.parallel.overlap_model)"}


BENCH = counted("grad_overlap", __doc__, run, config_of, count="iters", default=ITERS,
                what="timed steps", quick_help="tiny model on the CPU, not saved",
                file_name=lambda a: NAME)
main = BENCH.main


if __name__ == "__main__":
    main()
