"""NCCL's all-reduce, all-gather and reduce-scatter bus bandwidth on the GPUs of one node.

Against message size, over each link NCCL may take between them."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from colossal_lab.benchmarks import two_gpu
from colossal_lab.benchmarks.harness import Benchmark, Invocation, Option, flag, opt
from colossal_lab.errors import UsageError
from colossal_lab.measure import results, timing
from colossal_lab.parallel import distributed

NAME = "collectives"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
MiB = 2**20
SIZES = tuple(MiB * 4**k for k in range(6))
"""Message sizes in bytes: 1, 4, 16, 64, 256 MiB and 1 GiB."""
QUICK_SIZES = (4 * 1024, 64 * 1024, MiB)
WARMUP, REPS = 5, 20
QUICK_WARMUP, QUICK_REPS = 1, 4
DTYPE = torch.bfloat16

LINKS = ("nvlink", "host", "sockets")
LINK_ENV = {"nvlink": {},
            "host": {"NCCL_P2P_DISABLE": "1"},
            "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}
"""NCCL environment of each link setting, on top of `ALWAYS_ENV`."""
QUICK_LINK = "loopback"
"""The ``link`` of `--quick` rows: gloo over 127.0.0.1, whatever `--link` says."""
ALWAYS_ENV = {"NCCL_NVLS_ENABLE": "0"}
"""Set for every link: NVLink multicast (NVLS) stays off on this machine."""


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw of `op` on `world` ranks (nccl-tests' convention)."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    raise ValueError(f"op={op!r}; choose one of {OPS}")


def set_link(link: str) -> dict:
    """Put `link`'s NCCL environment into `os.environ` (before the process group
    starts: NCCL reads it once) and return what it set. The variables of the other
    settings are removed, so "nvlink" means NCCL's own choice even when the shell had
    ``NCCL_P2P_DISABLE`` set."""
    if link not in LINK_ENV:
        raise ValueError(f"link={link!r}; choose one of {LINKS}")
    for other in LINK_ENV.values():
        for k in other:
            os.environ.pop(k, None)
    env = {**ALWAYS_ENV, **LINK_ENV[link]}
    os.environ.update(env)
    return env


def _op_call(op: str, size_bytes: int, world: int, device, dtype=DTYPE, group=None):
    """The buffers for one `op` on a message of `size_bytes` and a call that runs it."""
    esize = torch.finfo(dtype).bits // 8
    elems = size_bytes // esize
    if op != "all_reduce" and elems % world:
        raise ValueError(f"{size_bytes} bytes of {dtype} do not split over {world} ranks")
    shard = elems // world
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    if op == "all_reduce":
        buf = torch.zeros(elems, dtype=dtype, device=device)  # zeros: no overflow
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out = torch.empty(elems, dtype=dtype, device=device)
        inp = torch.zeros(shard, dtype=dtype, device=device)
        return lambda: gather(out, inp, group=group)
    if op == "reduce_scatter":
        out = torch.empty(shard, dtype=dtype, device=device)
        inp = torch.zeros(elems, dtype=dtype, device=device)
        return lambda: scatter(out, inp, group=group)
    raise ValueError(f"op={op!r}; choose one of {OPS}")


def time_collective(op: str, size_bytes: int, *, warmup: int = WARMUP, reps: int = REPS,
                    dtype=DTYPE, group=None) -> dict:
    """Time `op` on a message of `size_bytes`: the row's timing and bandwidth fields
    (`ms`, `ms_p10`, `ms_p90`, `ms_all`, `algbw_gbps`, `busbw_gbps` and the busbw of
    the p90 and p10 times, `busbw_gbps_p90time` ≤ median ≤ `busbw_gbps_p10time`)."""
    env = distributed.env()
    world = distributed.world_size(group)
    call = _op_call(op, size_bytes, world, env.device, dtype, group)
    cuda = env.device.type == "cuda"

    def line_up(i):
        if cuda:
            torch.cuda.synchronize()
        distributed.barrier()

    times: list[float] = []
    timing.time_iterations(lambda i: call(), warmup=warmup, iters=reps, device=env.device,
                           before_step=line_up, on_step=lambda i, ms: times.append(ms))
    times = [round(t, 5) for t in distributed.all_max(times, group)]
    s = timing._summary(times)
    return {"size_bytes": size_bytes, "elems": size_bytes // (torch.finfo(dtype).bits // 8),
            "ms": s.median_ms, "ms_p10": s.p10_ms, "ms_p90": s.p90_ms, "reps": s.n,
            "ms_all": times, **bandwidths(op, size_bytes, world, s.median_ms,
                                          s.p10_ms, s.p90_ms)}


def bandwidths(op: str, size_bytes: float, world: int, ms: float, ms_p10: float,
               ms_p90: float) -> dict:
    """algbw and busbw (GB/s, 1e9 bytes) of `op` moving a `size_bytes` message in `ms`;
    the busbw of the p90 time (slow reps) and of the p10 time (fast reps)."""
    f = bus_factor(op, world)
    return {"algbw_gbps": timing.gbps(size_bytes, ms),
            "busbw_gbps": timing.gbps(size_bytes, ms) * f,
            "busbw_gbps_p90time": timing.gbps(size_bytes, ms_p90) * f,
            "busbw_gbps_p10time": timing.gbps(size_bytes, ms_p10) * f,
            "bus_factor": f}


def measure(link: str, *, ops: Sequence[str] = OPS, sizes: Sequence[int] = SIZES,
            warmup: int = WARMUP, reps: int = REPS, progress: bool = True) -> list[dict]:
    """Every (op, size) on this process group, on every rank (a collective needs them
    all); rows tagged with `link`, the world and the backend."""
    env = distributed.env()
    bar = distributed.progress(total=len(ops) * len(sizes), desc=f"collectives ({link})",
                               enabled=progress)
    rows = []
    for op in ops:
        for size in sizes:
            row = {"kind": "collective", "op": op, "link": link, "world": env.world_size,
                   "backend": env.backend, "dtype": str(DTYPE).replace("torch.", ""),
                   **time_collective(op, size, warmup=warmup, reps=reps)}
            rows.append(row)
            bar.update(1)
    bar.close()
    return rows


def _quick_worker(link: str, sizes, warmup: int, reps: int) -> list[dict]:
    return measure(link, sizes=sizes, warmup=warmup, reps=reps, progress=False)


def run(quick: bool = False, *, link: str = "nvlink", reps: int | None = None,
        sizes: Sequence[int] | None = None, progress: bool = True,
        world: int = two_gpu.WORLD) -> list[dict]:
    """The rows of one link setting. `quick`: `world` gloo processes on this CPU
    (`spawn`), `QUICK_SIZES`, a few reps; rank 0's rows. Otherwise call it on every rank
    of a torchrun job (`main` does): NCCL on the GPUs, every rank returns the rows.

    **What is measured.** Each op on bf16 messages of `SIZES` bytes (1 MiB to 1 GiB, powers
    of 4), `WARMUP` untimed calls then `REPS` timed ones, each bracketed by CUDA events on
    the current stream (`timing.time_iterations`) after a barrier that lines the ranks up,
    so a rep times the collective, not one rank waiting for the other to arrive. A rep's
    time is the slowest rank's (a collective is done when it is done everywhere); the row
    holds the median, p10 and p90 of those, and every rep in `ms_all`.

    **Sizes and bus bandwidth,** as nccl-tests define them (NVIDIA nccl-tests,
    doc/PERFORMANCE.md). The size S of a row is the whole message: the all-reduced buffer,
    the all-gather's output (each rank gives S/n), the reduce-scatter's input (each rank
    keeps S/n). Algorithm bandwidth is algbw = S / t. Bus bandwidth rescales it to the
    bytes every link carries in the bandwidth-optimal ring, so that it is comparable
    across ops and rank counts, and with the link's peak:

        all-reduce:                  busbw = algbw · 2(n−1)/n
        all-gather, reduce-scatter:  busbw = algbw · (n−1)/n

    (`BUS_FACTOR`). On 2 ranks an all-reduce's busbw is its algbw; an all-gather's is half.

    **The links** (`--link`, `LINK_ENV`), set in NCCL's environment before the process
    group starts: "nvlink" (NCCL's choice: peer-to-peer over NVLink), "host"
    (``NCCL_P2P_DISABLE=1``: through shared host memory over PCIe), "sockets"
    (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``: through the network stack, as between
    nodes without InfiniBand). ``NCCL_NVLS_ENABLE=0`` always: NVLink SHARP (multicast) must
    stay off on the machines this book is measured on. One invocation measures one link
    setting (NCCL reads its environment once); its rows carry ``link`` and replace that
    link's rows in ``results/<gpu>x<n>/collectives.json`` (`results.merge_rows`), so three
    invocations build one file::

        torchrun --nproc-per-node 2 -m colossal_lab bench collectives --link nvlink
        torchrun --nproc-per-node 2 -m colossal_lab bench collectives --link host
        torchrun --nproc-per-node 2 -m colossal_lab bench collectives --link sockets
        python -m colossal_lab bench collectives --quick   # 2 gloo processes on this CPU

    The world n is whatever torchrun launched (``--nproc-per-node 4`` on four GPUs: the
    rows carry ``world`` and their bus factor, and go to ``results/<gpu>x4``).
    `--quick` is a smoke test: 2 CPU processes (or ``--world 4``) on gloo over loopback,
    `QUICK_SIZES`, a few reps, nothing saved: it exercises the code, it measures no GPU.
    """
    if quick:  # NCCL's link settings mean nothing to gloo: say where it ran
        return distributed.spawn(_quick_worker, world, QUICK_LINK,
                                 tuple(sizes or QUICK_SIZES), QUICK_WARMUP,
                                 reps or QUICK_REPS, timeout_s=120)[0]
    reps = reps or REPS
    if reps < 20:
        raise UsageError(f"reps={reps}: time at least 20 reps, or the p10-p90 spread "
                         "means nothing")
    return measure(link, sizes=sizes or SIZES, reps=reps, progress=progress)


def summary(rows: Sequence[dict]) -> str:
    """Bus bandwidth (GB/s, median and p90-time..p10-time) per op and size, per link."""
    lines = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        lines.append(f"bus bandwidth, GB/s ({link}, {mine[0]['world']} ranks, "
                     f"{mine[0]['backend']}, {mine[0]['dtype']}): median [p90-time, "
                     "p10-time]")
        for op in dict.fromkeys(r["op"] for r in mine):
            cells = [f"{_size(r['size_bytes'])} {r['busbw_gbps']:.3g} "
                     f"[{r['busbw_gbps_p90time']:.3g}, {r['busbw_gbps_p10time']:.3g}]"
                     for r in mine if r["op"] == op]
            lines.append(f"  {op:<15}" + " | ".join(cells))
    return "\n".join(lines)


def plot_bandwidth(rows: Sequence[dict]):
    """Bus bandwidth against message size, one line per (op, link), the p10-p90 time
    spread shaded: where each link saturates, the ceiling the chapters hold the
    switches' communication against. Returns the figure."""
    import matplotlib.pyplot as plt  # lazy: plotting only, optional for a run

    rows = [r for r in rows if r.get("kind") == "collective"]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for op, link in dict.fromkeys((r["op"], r["link"]) for r in rows):
        pts = sorted((r["size_bytes"], r["busbw_gbps"], r["busbw_gbps_p90time"],
                      r["busbw_gbps_p10time"]) for r in rows
                     if r["op"] == op and r["link"] == link)
        xs = [p[0] for p in pts]
        line, = ax.plot(xs, [p[1] for p in pts], marker="o", ms=3, lw=1.4,
                        label=f"{op}, {link}")
        ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], alpha=0.15,
                        color=line.get_color(), lw=0)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["size_bytes"] for r in rows})
    ax.set_xticks(sizes[::2])
    ax.set_xticklabels([_size(n).replace(" ", "") for n in sizes[::2]], fontsize=8)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    world = rows[0]["world"] if rows else "?"
    ax.set_title(f"Collectives on {world} ranks", fontsize=11)
    ax.legend(fontsize=8, frameon=False, ncol=2)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    plt.close(fig)  # shown once, by the caller's display
    return fig


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def config_of(link_env: dict, reps: int, sizes) -> dict:
    return {"ops": list(OPS), "sizes_bytes": list(sizes), "dtype": "bf16",
            "warmup": WARMUP, "reps": reps,
            "nccl_env": {k: {**ALWAYS_ENV, **v} for k, v in LINK_ENV.items()},
            "this_invocation_nccl_env": link_env,
            "timing": "CUDA events around each rep after a barrier; a rep's time is the "
                      "slowest rank's",
            "bus_bandwidth": "nccl-tests: all-reduce 2(n-1)/n, all-gather and "
                             "reduce-scatter (n-1)/n times S/t; S the whole message",
            "merged_by": "link"}


def link_flag() -> Option:
    """``--link``: the NCCL transport a measured run uses (`LINK_ENV`)."""
    return opt("--link", choices=LINKS, default="nvlink",
               help="NCCL transport between the GPUs (default: nvlink)")


def on_link(call: Invocation, *, quick_rows, rank_rows, merged_by, config, report
            ) -> None:
    """The command line's flow of a benchmark per NCCL transport: `--quick`: print
    `report(quick_rows(world))`; else at least two ranks on the `--link` transport
    (`set_link`, before NCCL starts), `rank_rows()` on every rank, and on rank 0 the
    rows merged into the saved ones (`results.merge_rows` by `merged_by`: each link's
    run adds its rows) with `config(link_env)`."""
    a, name = call.args, call.bench.name
    if a.quick:
        print(report(quick_rows(two_gpu.quick_world(call))))
        return
    two_gpu.refuse(name, quick=False, at_least=True)
    link_env = set_link(a.link)  # before init: NCCL reads its environment once
    with distributed.guard(f"bench {name}"):
        distributed.init()
        rows = rank_rows()
        if distributed.is_main():
            slug = results.run_slug()
            merged = results.merge_rows(name, rows, merged_by, gpu=slug)
            path = results.save_results(name, merged, gpu=slug, config=config(link_env))
            print(report(rows))
            print(f"saved {path} ({len(rows)} rows of link {a.link!r}, "
                  f"{len(merged)} in all)")
        distributed.barrier()
    distributed.destroy()


BENCH = Benchmark(
    NAME, __doc__, prog=f"bench {NAME}",
    quick_help="gloo processes on this CPU (link 'loopback', --link ignored), tiny "
    "messages, not saved; a measured run takes torchrun's world (2 or more)",
    options=[link_flag(), two_gpu.world_flag(),
             flag("reps", help=f"timed reps (default {REPS})")],
    check=two_gpu.world_problem,
    execute=lambda call: on_link(
        call, merged_by="link", report=summary,
        quick_rows=lambda world: run(True, link=call.args.link, reps=call.args.reps,
                                     world=world),
        rank_rows=lambda: run(link=call.args.link, reps=call.args.reps),
        config=lambda env: config_of(env, call.args.reps or REPS, SIZES)))
main = BENCH.main


if __name__ == "__main__":
    main()
