"""Several processes on `torch.distributed`: start them, give them a mesh, stop them on failure.

**Launch.** One process per GPU, started by `torchrun` (it sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``); each calls `init()` first::

    torchrun --nproc-per-node 8 -m colossal_lab train --preset llama-7b-8l ...

Several nodes run the same line with a rendezvous (``--nnodes 4 --rdzv-id job42
--rdzv-backend c10d --rdzv-endpoint node0:29500``; under SLURM one task per node, the
allocation's first node the endpoint). Without ``WORLD_SIZE`` `init()` does nothing: one
process, world size 1, the same code. It picks NCCL when CUDA is there and gloo
otherwise: the CPU tests and the book's live checks run gloo processes (`spawn`).

**The mesh.** `make_mesh(dp, tp, pp)` names the dims ``("pp", "dp", "tp")``, outermost
first (torchtitan's order): consecutive ranks share a tp group, so tensor parallelism,
which communicates inside every layer, stays on one node's NVLink; data parallelism,
one reduction per step, comes next; pipeline stages, which only pass activations between
neighbours, span the slowest links. Every dim exists, also of size 1.

**When a rank fails** the others must not wait forever. Every collective has a timeout
(`init(timeout_s=...)`); `guard()` around a rank's work prints ``[rank r/w] failed:
...``, aborts the process group and exits non-zero, which makes its peers fail at once;
a collective that fails on a surviving rank (`collective()`) becomes a `RankFailure`
naming it. `spawn` runs a function on N local processes and raises `SpawnError` naming
the rank that failed first, within a deadline: stragglers are killed, never waited for.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from colossal_lab.measure.progress import Progress

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout of `init()` (NCCL's own default, 10 minutes): long enough for a
first step that compiles, short enough that a hang ends the job the same hour."""

MESH_DIMS = ("pp", "dp", "tp")
"""The named dims of `make_mesh`, outermost (slowest links) first."""

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each process and `init()` reads."""


@dataclass(frozen=True)
class Env:
    """Where this process stands: `init()`'s answer."""

    rank: int
    """This process's global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job (1: no torch.distributed)."""
    local_rank: int
    """Rank on this node: the index of its GPU."""
    backend: str | None
    """"nccl", "gloo", or None for a single process without a process group."""
    device: torch.device
    """The device this rank computes on (cuda:local_rank under NCCL)."""
    timeout_s: float | None
    """The timeout of every collective of the default group (None: no group)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, draws progress bars and writes files."""
        return self.rank == 0


class RankFailure(RuntimeError):
    """A collective failed on this rank because another rank failed, exited or stopped
    responding; the first rank that failed has printed the original error."""

    def __init__(self, message: str, *, rank: int, world_size: int, what: str,
                 timeout_s: float | None):
        super().__init__(message)
        self.rank, self.world_size = rank, world_size
        self.what, self.timeout_s = what, timeout_s


class SpawnError(RuntimeError):
    """`spawn`'s error: a rank raised (`rank`, its exception type `exc_type` and its
    traceback text in the message), or ranks did not finish before the deadline."""

    def __init__(self, message: str, *, rank: int | None, exc_type: str | None,
                 errors: dict[int, str], unfinished: list[int]):
        super().__init__(message)
        self.rank, self.exc_type = rank, exc_type
        self.errors, self.unfinished = errors, unfinished


# ----------------------------------------------------------------------- the group


_STATE: dict = {"timeout_s": None}  # what `init` set and the process group cannot tell


def default_backend() -> str:
    """"nccl" where CUDA and NCCL are available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Env:
    """Start this process's part of the job from torchrun's environment variables.

    The default process group gets `backend` ("nccl" on CUDA, "gloo" on the CPU when
    None) and a `timeout_s` on every collective. Under NCCL each process takes the GPU
    of its ``LOCAL_RANK`` (and binds the group to it, so NCCL connects eagerly).
    Without ``WORLD_SIZE`` this is a single process: nothing is initialised, world 1.
    Called again in an initialised process, it describes the group it has."""
    if dist.is_available() and dist.is_initialized():
        return env()
    if "WORLD_SIZE" not in os.environ:
        return env()
    missing = [k for k in LAUNCH_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with "
                           "torchrun (it sets them all), or unset WORLD_SIZE for one process")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
    backend = backend or default_backend()
    local_rank = int(os.environ["LOCAL_RANK"])
    kw = {}
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has "
                               f"{torch.cuda.device_count()} GPUs: --nproc-per-node must "
                               "not exceed the GPUs per node")
        torch.cuda.set_device(local_rank)
        kw["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **kw)
    _STATE["timeout_s"] = float(timeout_s)
    return env()


def env() -> Env:
    """This process's `Env` (world 1 on CPU or GPU 0 when not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        return Env(0, 1, 0, None, dev, None)
    backend = dist.get_backend()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")
    return Env(dist.get_rank(), dist.get_world_size(), local, backend, dev,
               _STATE["timeout_s"])


def destroy() -> None:
    """Leave the process group (a no-op without one). Call it at the end of a clean
    run; after a failure `guard()` aborts instead, which waits for nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE["timeout_s"] = None


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size(group=None) -> int:
    """Processes in `group` (default: the world); 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def is_main() -> bool:
    """Rank 0: the one that prints, draws progress bars and writes files."""
    return rank() == 0


def barrier(timeout_s: float | None = None) -> None:
    """Wait for every rank. On gloo `monitored_barrier`, whose error names the ranks
    that did not arrive; on NCCL a plain barrier (bounded by the group's timeout)."""
    if world_size() == 1:
        return
    with collective("barrier"):
        if dist.get_backend() == "gloo":
            t = timeout_s or _STATE["timeout_s"] or DEFAULT_TIMEOUT_S
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=t))
        else:
            dist.barrier()


# ------------------------------------------------------------------------ the mesh


def make_mesh(dp: int | None = None, tp: int = 1, pp: int = 1,
              device_type: str | None = None):
    """A `DeviceMesh` over every rank with dims ``("pp", "dp", "tp")`` (`MESH_DIMS`;
    tp fastest-varying, so a tp group is consecutive ranks on one node). `dp=None`
    takes what tp and pp leave. dp·tp·pp must be the world size."""
    world = world_size()
    for name, value in (("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp is not None else ()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if dp is None:
        if world % (tp * pp):
            raise ValueError(f"tp·pp = {tp}·{pp} = {tp * pp} does not divide the world "
                             f"size {world}: choose tp and pp whose product divides {world}")
        dp = world // (tp * pp)
    if dp * tp * pp != world:
        fix = (f"e.g. dp={world // (tp * pp)} with tp={tp}, pp={pp}"
               if world % (tp * pp) == 0 else f"with tp·pp dividing {world}")
        raise ValueError(
            f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp}, but the world has {world} "
            f"process{'es' if world != 1 else ''} (torchrun --nnodes × --nproc-per-node): "
            f"choose sizes whose product is {world}, {fix}")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs torch.distributed, also for one process: launch "
                           "with torchrun (--nproc-per-node 1 works) and call "
                           "distributed.init() first")
    device_type = device_type or ("cuda" if env().backend == "nccl" else "cpu")
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


# ------------------------------------------------------------------------- logging


def log(*args, file=None, **kw) -> None:
    """`print` on every rank, each line prefixed ``[rank r/w]`` when the world has more
    than one process (a single process prints plainly), flushed at once so that the
    ranks' lines interleave in the order they happened."""
    text = " ".join(str(a) for a in args)
    if world_size() > 1:
        prefix = f"[rank {rank()}/{world_size()}] "
        text = "\n".join(prefix + line for line in text.split("\n"))
    print(text, file=file or sys.stdout, flush=True, **kw)


def rank0_print(*args, **kw) -> None:
    """`print` on rank 0 only, without a prefix: what a run reports once."""
    if is_main():
        print(*args, flush=True, **kw)


def progress(*args, enabled: bool = True, **kw):
    """A `colossal_lab.measure.progress.Progress` bar drawn by rank 0 only (the others count
    silently): N bars redrawing on one terminal would be unreadable."""
    return Progress(*args, enabled=enabled and is_main(), **kw)


# ---------------------------------------------------------------- failure handling


_PEER_SIGNS = ("timed out", "timeout", "connection reset", "connection closed",
               "connection refused", "broken pipe", "socket closed", "aborted",
               "watchdog", "peer")
"""Words in a backend's error that mean another rank is gone or stuck (gloo and NCCL
have no error type for it: their messages are all there is)."""


def as_rank_failure(exc: BaseException, what: str, *,
                    by_message: bool = True) -> RankFailure | None:
    """The `RankFailure` that `exc`, raised by collective `what`, means; None when it
    is not a communication failure (a shape mismatch, a programming error). gloo raises
    plain `RuntimeError`s, told apart by their message (`by_message`, for errors known
    to come from a collective); torch's `DistError`s always count."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or isinstance(exc, RankFailure):
        return None
    if not (isinstance(exc, dist.DistError)
            or by_message and any(s in text.lower() for s in _PEER_SIGNS)):
        return None
    e = env()
    t = e.timeout_s
    when = f"collective timeout {t:g} s" if t is not None else "no collective timeout set"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return RankFailure(
        f"[rank {e.rank}/{e.world_size}] {what} failed ({when}, backend {e.backend}): "
        f"another rank failed, exited or stopped responding. The rank that failed first "
        f"printed its own error ('[rank r/w] failed: ...'); look for it above. "
        f"Backend said: {first[:300]}",
        rank=e.rank, world_size=e.world_size, what=what, timeout_s=t)


@contextlib.contextmanager
def collective(what: str):
    """Around a collective (or a wait on one): a failure caused by another rank comes
    out as a `RankFailure` naming `what` and the timeout; other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        failure = as_rank_failure(exc, what)
        if failure is None:
            raise
        raise failure from exc


def _reduced(values: list[float], op, what: str, group=None) -> torch.Tensor:
    t = torch.tensor(list(values), dtype=torch.float64,
                     device=env().device if dist.get_backend(group) == "nccl" else "cpu")
    with collective(what):
        dist.all_reduce(t, op=op, group=group)
    return t


def all_mean(values: list[float], group=None) -> list[float]:
    """The mean over the ranks of each of `values` (e.g. every step's loss on this
    rank's share of the batch -> the loss of the global batch); unchanged on one
    process."""
    if world_size(group) == 1:
        return list(values)
    return (_reduced(values, dist.ReduceOp.SUM, "all_mean", group)
            / world_size(group)).tolist()


def all_sum(values: list[float], group=None) -> list[float]:
    """The sum over the ranks of each of `values`; unchanged on one process."""
    if world_size(group) == 1:
        return list(values)
    return _reduced(values, dist.ReduceOp.SUM, "all_sum", group).tolist()


def all_max(values: list[float], group=None) -> list[float]:
    """The largest over the ranks of each of `values`: every step's time on the slowest
    rank, which is the step's time for all of them; unchanged on one process."""
    if world_size(group) == 1:
        return list(values)
    return _reduced(values, dist.ReduceOp.MAX, "all_max", group).tolist()


def abort() -> None:
    """Drop this process's process group without talking to the others: what a failing
    rank does on its way out (a clean `destroy()` could wait for peers that never come)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group()
    except Exception:  # older torch, or a backend without abort: exiting is enough
        pass


@contextlib.contextmanager
def guard(what: str = "this rank's work"):
    """Around a rank's whole job (`python -m colossal_lab train` under torchrun, each
    `spawn` worker). An exception is printed as ``[rank r/w] failed: ...``, the process
    group is aborted, and the exception propagates, so the process exits non-zero:
    its peers' collectives fail instead of waiting, and torchrun stops the job."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        # only torch's own distributed errors: a message is no proof outside a collective
        failure = as_rank_failure(exc, what, by_message=False)
        shown = failure if failure is not None else exc
        log(f"failed: {type(shown).__name__}: {shown}", file=sys.stderr)
        abort()
        if failure is not None:
            raise failure from exc
        raise


# --------------------------------------------------------------------------- spawn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; the rendezvous takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spawn_worker(fn, rank_: int, nprocs: int, port: int, backend: str,
                  collective_timeout_s: float, threads: int | None, args, results) -> None:
    """One process of `spawn`: torchrun's environment, `init`, `fn`, the answer."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank_),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(nprocs))
    if backend == "gloo" and sys.platform.startswith("linux"):
        # every process is on this machine: gloo's pairs over loopback, whatever the
        # host name resolves to (in some containers an address nobody can reach)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)
    ok = False
    try:
        with guard(f"{getattr(fn, '__name__', 'fn')} on rank {rank_}"):
            init(backend, timeout_s=collective_timeout_s)
            out = fn(*args)
        # pickled here, by value: a tensor sent through the queue as shared memory would
        # vanish with this process before the parent reads it
        results.put(pickle.dumps(("ok", rank_, out)))
        ok = True
    except BaseException as exc:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        consequence = isinstance(exc, RankFailure) or as_rank_failure(exc, "") is not None
        results.put(pickle.dumps(("error", rank_, (type(exc).__name__, str(exc), tb,
                                                   consequence))))
    finally:
        results.close()
        results.join_thread()  # the answer is in the pipe before the process ends
    if ok:
        destroy()
    else:
        os._exit(1)  # no clean-up that could wait on a peer


def spawn(fn, nprocs: int, *args, timeout_s: float = 120.0,
          collective_timeout_s: float = 30.0, backend: str = "gloo",
          threads: int | None = 1, grace_s: float | None = None) -> list:
    """Run ``fn(*args)`` on `nprocs` new processes that form one process group
    (`backend` on 127.0.0.1, each collective bounded by `collective_timeout_s`) and
    return each rank's result, by rank.

    `fn`, `args` and the result must pickle (`fn` a module-level function, not one
    defined in a notebook). The processes are daemons, so `fn` cannot start processes of
    its own; `threads` caps each one's intra-op threads. If a rank raises, the others get
    `grace_s` (default: the collective timeout + 2 s) to report, then the survivors are
    killed and `SpawnError` names the rank that failed first (whose error is not a mere
    `RankFailure`) with its traceback. Nothing outlives `timeout_s`."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a whole number >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_worker, daemon=True,
                         args=(fn, r, nprocs, port, backend, collective_timeout_s, threads,
                               args, results)) for r in range(nprocs)]
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    grace = collective_timeout_s + 2.0 if grace_s is None else grace_s
    done: dict[int, object] = {}
    errors: dict[int, tuple] = {}  # rank -> (type name, message, traceback, RankFailure?)
    order: list[int] = []  # ranks in the order their errors arrived
    first_error_at = None
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            p.start()
        while len(done) + len(errors) < nprocs:
            now = time.monotonic()
            if now >= (deadline if first_error_at is None
                       else min(deadline, first_error_at + grace)):
                break
            try:
                kind, r, payload = pickle.loads(results.get(timeout=0.05))
            except queue.Empty:
                for r, p in enumerate(procs):  # dead without a word (a signal, a crash)?
                    if r in done or r in errors or p.exitcode is None:
                        continue
                    if now - dead_since.setdefault(r, now) > 1.0:  # its answer is late
                        errors[r] = ("ProcessDied", f"exit code {p.exitcode}",
                                     f"the process of rank {r} ended with exit code "
                                     f"{p.exitcode} without reporting\n", False)
                        order.append(r)
                        first_error_at = first_error_at or now
                continue
            if kind == "ok":
                done[r] = payload
            else:
                errors[r] = payload
                order.append(r)
                first_error_at = first_error_at or time.monotonic()
    finally:
        for r, p in enumerate(procs):
            if r in done or r in errors:  # reported: it is on its way out
                p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():  # still running after the deadline or the grace: killed
                p.kill()
                p.join(timeout=5)
        results.close()
    unfinished = [r for r in range(nprocs) if r not in done and r not in errors]
    elapsed = time.monotonic() - t0
    if errors:
        causes = [r for r in order if not errors[r][3]]
        if not causes and unfinished:  # the others' collectives failed on these ranks
            first = unfinished[0]
            failed = ", ".join(f"rank {r}: {errors[r][1].splitlines()[0][:300]}"
                               for r in order)
            raise SpawnError(f"rank {first}/{nprocs} stopped responding: ranks "
                             f"{unfinished} were still running when the others' collectives "
                             f"failed, and were killed\n  {failed}", rank=first,
                             exc_type=None, errors={r: f"{e[0]}: {e[1]}"
                                                    for r, e in errors.items()},
                             unfinished=unfinished)
        first = (causes or order)[0]
        name, msg, tb, _ = errors[first]
        others = "".join(f"\n  rank {r}: {errors[r][0]}: {errors[r][1].splitlines()[0][:200]}"
                         for r in order if r != first)
        if unfinished:
            others += f"\n  ranks {unfinished}: still running; killed"
        raise SpawnError(f"rank {first}/{nprocs} failed with {name}: {msg}"
                         + (f"\nthe other ranks:{others}" if others else "")
                         + f"\n\n--- traceback of rank {first} ---\n{tb}",
                         rank=first, exc_type=name,
                         errors={r: f"{e[0]}: {e[1]}" for r, e in errors.items()},
                         unfinished=unfinished)
    if unfinished:
        raise SpawnError(f"ranks {unfinished} of {nprocs} did not finish within "
                         f"timeout_s={timeout_s:g} s ({elapsed:.1f} s elapsed) and were "
                         "killed", rank=None, exc_type=None, errors={},
                         unfinished=unfinished)
    return [done[r] for r in range(nprocs)]
