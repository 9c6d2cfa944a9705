"""A model of the gradient communication a data-parallel step leaves exposed (switch 8).

It turns one GPU's measured backward (`Grad`: each gradient's size and the time it became
final, from `benchmarks.grad_overlap`) into a prediction for any bucket size, link and
number of ranks. The buckets are the reducer's own (`make_buckets` calls
`grad_sync.assign_buckets`). One communication stream runs them in bucket order; bucket
b starts when its last gradient is ready and the stream is free:

    start_b = max(ready_b, end_{b-1}),   end_b = start_b + T(bytes_b)

and the communication *exposed* after the backward is ``max(0, end_last − T_bwd)``
(`simulate`); the naive reducer, one flat bucket after the backward, exposes all of it
(`naive`). A ring all-reduce of n bytes over W ranks moves 2·(W−1)/W · n bytes through
every GPU's link (Patarasuk & Yuan), so (`allreduce_ms`)

    T(n) = α + 2·(W−1)/W · n / B

with B the link's bus bandwidth per direction and α a fixed per-collective latency, an
assumption of each `Link`.

**Assumptions.** One stream, in order, as `OverlappedAllReduce` and DDP issue them. No
contention (optimistic: NCCL's kernels slow the real backward down). A bandwidth that
does not depend on the message size (optimistic for small buckets). Lockstep ranks, no
straggler. Free bookkeeping (the copies into the buckets, the division by W).

What becomes ready last is always exposed (for LLaMA the input embedding, at the very end
of the backward), whatever the bucket size; a small *first* bucket (DDP's 1 MiB) starts
the communication as soon as the first gradients are ready.

References: Li et al. 2020, "PyTorch Distributed", arXiv:2006.15704; Patarasuk & Yuan
2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"; NVIDIA
nccl-tests, doc/PERFORMANCE.md (bus bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from colossal_lab.palette import BLUE, GREY, ORANGE
from colossal_lab.parallel.grad_sync import assign_buckets

# ----------------------------------------------------------------------- the links


@dataclass(frozen=True)
class Link:
    """A link every GPU of the data-parallel group has to the ring."""

    name: str
    gbps: float
    """Bandwidth per GPU and direction, GB/s (1e9 bytes/s): the ring's bus bandwidth."""
    latency_us: float
    """α: fixed cost of one all-reduce, µs (an assumption)."""
    source: str
    """Where the bandwidth comes from, or that it is an assumption."""


LINKS: tuple[Link, ...] = (
    Link("NVLink 4", 450.0, 10.0,
         "datasheet: NVIDIA H100 / H200 SXM, NVLink 900 GB/s per GPU (both directions "
         "together), so 450 GB/s each way; an upper bound, NCCL reaches less"),
    Link("PCIe 5 x16", 55.0, 10.0,
         "assumption: 32 GT/s x 16 lanes with 128b/130b coding is 63 GB/s each way "
         "(PCI-SIG PCIe 5.0); ~55 GB/s effective after packet overhead"),
    Link("400 Gb/s network", 45.0, 20.0,
         "assumption: 400 Gb/s (one NDR InfiniBand / 400GbE NIC per GPU) is 50 GB/s "
         "line rate; ~45 GB/s effective"),
    Link("100 Gb/s network", 11.0, 20.0,
         "assumption: 100 Gb/s (one NIC per GPU) is 12.5 GB/s line rate; ~11 GB/s "
         "effective"),
)
"""The links of chapter 08's table, fastest first."""

ETHERNET_1G = Link("1 Gb/s Ethernet", 0.11, 50.0,
                   "assumption: 1 Gb/s is 0.125 GB/s line rate; ~0.11 GB/s effective, "
                   "50 µs a collective over TCP (gloo)")
"""A link a cluster of CPUs might have, for chapter 08's CPU illustration: a CPU's
backward is so slow next to the links of `LINKS` that on them the picture would show
no communication at all."""


def link(name: str) -> Link:
    """The `LINKS` entry called `name`."""
    for entry in LINKS:
        if entry.name == name:
            return entry
    raise ValueError(f"no link {name!r}; choose one of {[x.name for x in LINKS]}")


def allreduce_ms(nbytes: float, world: int, link: Link) -> float:
    """Time of one ring all-reduce of `nbytes` over `world` ranks on `link`, ms:
    ``α + 2·(W−1)/W · nbytes / B``; 0 on one rank (nothing to reduce)."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    if world == 1:
        return 0.0
    ring = 2 * (world - 1) / world  # bytes through each link, per byte reduced
    return link.latency_us / 1e3 + ring * nbytes / (link.gbps * 1e9) * 1e3


# ------------------------------------------------------------------- the timeline


@dataclass(frozen=True)
class Grad:
    """One parameter's gradient in the backward."""

    name: str
    numel: int
    ready_ms: float
    """When it became final, ms after the start of the backward."""


def ready_order(grads: Sequence[Grad]) -> list[int]:
    """Indices of `grads` in the order they became ready (ties: registration order)."""
    return sorted(range(len(grads)), key=lambda i: (grads[i].ready_ms, i))


def make_buckets(grads: Sequence[Grad], bucket_elems: int, *, order="ready",
                 first_bucket_elems: int | None = None) -> list[list[int]]:
    """Buckets of at most `bucket_elems` elements (`first_bucket_elems` for the first),
    as `grad_sync.assign_buckets` makes them, walking `order`: "ready" (the
    measured order: the overlapped reducer's buckets after its first step),
    "registration" (reverse registration: its buckets before), or a list of indices."""
    if isinstance(order, str):
        if order not in ("ready", "registration"):
            raise ValueError(f"order={order!r}; choose 'ready', 'registration' or a list "
                             "of parameter indices")
        order = ready_order(grads) if order == "ready" else None
    return assign_buckets([g.numel for g in grads], bucket_elems, order,
                          first_cap=first_bucket_elems)


# --------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class BucketSpan:
    """One bucket's all-reduce on the communication stream."""

    index: int
    params: tuple[int, ...]
    elems: int
    ready_ms: float
    """When its last gradient became ready."""
    start_ms: float
    end_ms: float

    @property
    def comm_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Overlap:
    """What `simulate` or `naive` predicts for one configuration."""

    spans: tuple[BucketSpan, ...]
    backward_ms: float

    @property
    def comm_ms(self) -> float:
        """Total time the communication stream is busy."""
        return sum(s.comm_ms for s in self.spans)

    @property
    def end_ms(self) -> float:
        """When the last all-reduce ends (the backward's end if nothing is sent)."""
        return max([self.backward_ms] + [s.end_ms for s in self.spans])

    @property
    def exposed_ms(self) -> float:
        """Communication still running when the backward ends: what the optimizer waits
        for, on top of one GPU's step."""
        return max(0.0, self.end_ms - self.backward_ms)

    @property
    def hidden_ms(self) -> float:
        """Communication done while the backward ran. (Once the backward has ended every
        bucket is ready, so the stream never idles after it: hidden + exposed = comm.)"""
        return self.comm_ms - self.exposed_ms

    @property
    def first_start_ms(self) -> float | None:
        """When communication starts (None: no bucket)."""
        return self.spans[0].start_ms if self.spans else None


def _check(grads: Sequence[Grad], world: int, bytes_per_elem: float) -> None:
    if not grads:
        raise ValueError("no gradients to reduce")
    if bytes_per_elem <= 0:
        raise ValueError(f"bytes_per_elem={bytes_per_elem} must be > 0 (2 for bf16)")
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")


def simulate(grads: Sequence[Grad], buckets: Sequence[Sequence[int]], *, link: Link,
             world: int, bytes_per_elem: float, backward_ms: float | None = None
             ) -> Overlap:
    """One communication stream all-reducing `buckets` (lists of indices into `grads`,
    in launch order) while the backward runs, by the module docstring's recurrence;
    `backward_ms` (default: the last gradient's ready time) is when the backward ends."""
    _check(grads, world, bytes_per_elem)
    seen = sorted(i for b in buckets for i in b)
    if seen != list(range(len(grads))):
        raise ValueError("every gradient must be in exactly one bucket")
    end_bwd = max(g.ready_ms for g in grads) if backward_ms is None else backward_ms
    spans, free = [], 0.0
    for b, idx in enumerate(buckets):
        elems = sum(grads[i].numel for i in idx)
        ready = max(grads[i].ready_ms for i in idx)
        start = max(ready, free)
        free = start + allreduce_ms(elems * bytes_per_elem, world, link)
        spans.append(BucketSpan(b, tuple(idx), elems, ready, start, free))
    return Overlap(tuple(spans), end_bwd)


def naive(grads: Sequence[Grad], *, link: Link, world: int, bytes_per_elem: float,
          backward_ms: float | None = None) -> Overlap:
    """The naive reducer: every gradient in one flat bucket, all-reduced after the
    backward ends. Nothing overlaps: exposed = the whole communication."""
    _check(grads, world, bytes_per_elem)
    end_bwd = max(g.ready_ms for g in grads) if backward_ms is None else backward_ms
    elems = sum(g.numel for g in grads)
    t = allreduce_ms(elems * bytes_per_elem, world, link)
    span = BucketSpan(0, tuple(range(len(grads))), elems, end_bwd, end_bwd, end_bwd + t)
    return Overlap((span,), end_bwd)


# -------------------------------------------------------------------------- plots


def plot_timeline(result: Overlap, grads: Sequence[Grad], *, title: str | None = None,
                  names: dict[int, str] | None = None, fig=None):
    """One configuration on one time axis (9 × 4.2 in): above, the share of gradient
    elements ready as the backward runs (each step up is one parameter; `names` labels
    chosen ones by index); below, each bucket's all-reduce on the communication stream,
    with a tick where its last gradient became ready, and the exposed part after the
    backward's end shaded. Returns the figure."""
    import matplotlib.pyplot as plt

    if fig is None:
        fig = plt.figure(figsize=(9, 4.2))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    order = ready_order(grads)
    total = sum(g.numel for g in grads)
    t, share, acc = [0.0], [0.0], 0
    for i in order:
        acc += grads[i].numel
        t.append(grads[i].ready_ms)
        share.append(acc / total)
    end = result.end_ms
    t.append(max(end, result.backward_ms))
    share.append(1.0)
    top.step(t, share, where="post", color=BLUE, lw=1.6)
    top.set_ylim(0, 1.08)
    top.set_ylabel("gradient elements\nready", fontsize=9)
    top.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
    for i, label in (names or {}).items():
        g = grads[i]
        y = share[order.index(i) + 1]
        top.annotate(label, (g.ready_ms, y), xytext=(4, -12), textcoords="offset points",
                     fontsize=8, color="#333333")
    for ax in (top, bottom):
        ax.axvline(result.backward_ms, color="#333333", lw=1, ls="--")
        ax.spines[["top", "right"]].set_visible(False)
    top.text(result.backward_ms, 1.04, " backward ends", fontsize=8, va="bottom")
    for s in result.spans:
        color = BLUE if s.index % 2 == 0 else ORANGE
        bottom.broken_barh([(s.start_ms, max(s.comm_ms, 1e-9))], (0.2, 0.6),
                           facecolor=color, edgecolor="white", lw=0.5)
        bottom.plot([s.ready_ms], [0.95], marker="v", color=GREY, ms=4)
    if result.exposed_ms > 0:
        bottom.axvspan(result.backward_ms, end, color="#d62728", alpha=0.12, lw=0)
        bottom.text((result.backward_ms + end) / 2, 0.02,
                    f"exposed {result.exposed_ms:.3g} ms", ha="center", va="bottom",
                    fontsize=8, color="#a01010")
    bottom.set_ylim(0, 1.1)
    bottom.set_yticks([0.5])
    bottom.set_yticklabels([f"{len(result.spans)} bucket"
                            f"{'s' if len(result.spans) != 1 else ''}"], fontsize=9)
    bottom.set_xlabel("ms after the start of the backward  "
                      "(▼: a bucket's last gradient ready)", fontsize=9)
    bottom.set_xlim(0, max(end, result.backward_ms) * 1.03)
    if title:
        top.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _elements(x: float) -> str:
    """1024 -> "1K", 12·2^20 -> "12M": element counts in powers of 1024."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def plot_exposed(rows: Sequence[dict], *, dtype: str = "bf16",
                 worlds: Sequence[int] | None = None, order: str = "ready",
                 title: str | None = None, fig=None):
    """Exposed communication against bucket size, one line per link, one panel per
    world size (9 in wide), from `benchmarks.grad_overlap`'s "model" rows; the naive
    flat bucket is the open square at the right of each line. Log y axis (symmetric-log
    when a value is 0, drawn at 0). Returns the figure."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker as ticker

    rows = [r for r in rows if r.get("kind") == "model" and r["dtype"] == dtype
            and r.get("order") in (order, None)]  # None: the flat bucket, any order
    if not rows:
        raise ValueError(f"no model rows for dtype={dtype!r}, order={order!r}")
    worlds = sorted({r["world"] for r in rows}) if worlds is None else list(worlds)
    exposed = [r["exposed_ms"] for r in rows if r["world"] in worlds]
    links = list(dict.fromkeys(r["link"] for r in rows))
    colors = dict(zip(links, [BLUE, ORANGE, "#2a9d4b", "#8e44ad", GREY] * 2))
    if fig is None:
        fig = plt.figure(figsize=(9, 3.8))
    axes = fig.subplots(1, len(worlds), sharey=True, squeeze=False)[0]
    for ax, w in zip(axes, worlds):
        for name in links:
            mine = [r for r in rows if r["world"] == w and r["link"] == name]
            bucketed = sorted((r for r in mine if r["bucket"] != "flat"),
                              key=lambda r: r["bucket_elems"])
            flat = [r for r in mine if r["bucket"] == "flat"]
            ax.plot([r["bucket_elems"] for r in bucketed],
                    [r["exposed_ms"] for r in bucketed], marker="o", ms=4,
                    color=colors[name], label=name)
            for r in flat:
                ax.plot([r["bucket_elems"]], [r["exposed_ms"]], marker="s", ms=6,
                        color=colors[name], mfc="white")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(ticker.LogLocator(base=4))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: _elements(x)))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        if min(exposed) > 0:
            ax.set_yscale("log")
        else:  # a 0 at 0, linear up to the smallest non-zero value
            ax.set_yscale("symlog", linthresh=min([v for v in exposed if v > 0] or [1.0]))
        ax.set_title(f"{w} ranks, {dtype} gradients", fontsize=10)
        ax.set_xlabel("bucket size (elements; □ = one flat bucket after the backward)",
                      fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(True, which="major", axis="y", color="#dddddd", lw=0.6)
    axes[0].set_ylabel("exposed communication (ms)")
    axes[0].legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
