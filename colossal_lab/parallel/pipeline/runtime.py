"""Run a pipeline schedule for real: this rank's F, B, W and transfers, over point-to-point.

`PipelineRuntime(stages, schedule)` takes this rank's stages (`stages.build_stages`) and
a schedule that `validate` accepts, lowered with eager receives (`Schedule.lower`);
`step(input_ids, labels)` walks this rank's program in order:

* ``F(mb, s)``: stage s's forward of micro-batch mb. The last stage backpropagates its
  loss / m, so the gradients add up to those of the mean over the micro-batches: for
  equal micro-batches, the model's without a pipeline.
* ``B(mb, s)``: the backward from the stage's output to its input, whose gradient goes
  to stage s − 1; the whole backward where the schedule does not split it.
* ``W(mb, s)``: the weight gradients that B deferred.
* ``SEND_*`` / ``RECV_*``: consecutive transfers, posted together (``batch_isend_irecv``).

**Splitting B and W** (ZB-H1, ZB-V). Every plain `nn.Linear` of a stage runs through
`DeferredLinear`, whose backward computes dx = dy · W at once and files a job holding dy
and x with the stage's `WeightGradStore`; ``W(mb, s)`` runs the jobs and adds
dW = dyᵀ · x through autograd, so gradient hooks (switch 8's) fire. B costs the input
GEMMs and everything that is not a linear, W the weight GEMMs, about half the backward's
FLOPs; this is how the zero-bubble authors, Megatron and ColossalAI split it. (Calling
``torch.autograd.grad`` on the parameters for W instead would walk the graph again,
recomputing every activation gradient.) One store per stage: with two chunks per rank
each W must find exactly its own jobs. Tensor-parallel linears file their weight
gradient's communication too (`tp_ops.deferral`): a stage's tp ranks meet in W. Linears
that another switch replaced (fp8) compute dW in B: correct, only not deferred.

**overlap_p2p** (ColossalAI's flag, on by default). Off: each group of transfers is
waited for where the schedule puts it. On: nothing waits until a compute needs a
received tensor, and sends are waited at the end of the step. Neither can deadlock:
`validate` plays the programs with every group blocking.

**No metadata on the wire.** A receiver allocates (b, S, d), or (b, S/t, d) under
sequence parallelism, in `act_dtype` from the step's input shape; messages between two
ranks match in posting order, which `validate` checks.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab import precision as precision_mod
from colossal_lab.ops import autocast_state
from colossal_lab.parallel import distributed
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.schedules import Action, Schedule
from colossal_lab.parallel.pipeline.validate import validate

# ----------------------------------------------------------- the weight-gradient store


class WeightGradStore:
    """One stage's deferred weight-gradient jobs, by micro-batch.

    `micro_batch(mb)` around the stage's F names the micro-batch that the `DeferredLinear`
    nodes made there belong to; their backward files a job under it (`put`); `flush(mb)`
    runs the jobs of one micro-batch (the stage's W)."""

    def __init__(self, name: str = ""):
        self.name = name
        self.key: int | None = None
        """The micro-batch whose forward runs now (None: outside the pipeline)."""
        self.pending: dict[int, list[Callable[[], list]]] = {}
        self.jobs_run = 0
        """Jobs `flush` has run, over the store's life (what W did)."""

    @contextlib.contextmanager
    def micro_batch(self, mb: int):
        old, self.key = self.key, mb
        try:
            yield
        finally:
            self.key = old

    def put(self, key: int, job: Callable[[], list]) -> None:
        """File `job` (returns [(parameter, gradient), ...]) under micro-batch `key`."""
        self.pending.setdefault(key, []).append(job)

    def flush(self, key: int) -> int:
        """Run micro-batch `key`'s jobs and add their gradients to the parameters, through
        autograd (one call; gradient hooks fire). Returns how many jobs ran."""
        jobs = self.pending.pop(key, [])
        self.jobs_run += len(jobs)
        grads: dict[int, list] = {}  # id(param) -> [param, summed gradient]
        with torch.no_grad():  # as in a backward (a job may gather: no graph to build)
            for job in jobs:
                for p, g in job():
                    slot = grads.setdefault(id(p), [p, None])
                    slot[1] = g if slot[1] is None else slot[1] + g
        if grads:
            params, gs = zip(*grads.values())
            torch.autograd.backward(list(params), list(gs))
        return len(jobs)

    def __len__(self) -> int:
        """Jobs waiting, over every micro-batch."""
        return sum(len(v) for v in self.pending.values())


class DeferredLinear(torch.autograd.Function):
    """``y = x Wᵀ + b`` of `module` (an `nn.Linear`) whose backward returns dx at once
    and files dW (and db) with `store` under micro-batch `key`; with ``key=None``
    (outside a pipeline step) it returns them as `nn.Linear` does.

    x (..., in); `weight` and `bias` are the module's, or detached from it when the
    gradient is deferred: then autograd holds no edge to the parameters, and their
    gradient hooks fire only when W adds the gradient, not (with nothing) in B. `dtype`
    is the autocast dtype the matmuls run in (None: the inputs' own), so that the
    result equals `nn.Linear`'s under autocast."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, store, key, dtype):
        xc, wc = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        bc = bias if bias is None or dtype is None else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.module, ctx.store, ctx.key, ctx.x_dtype = module, store, key, x.dtype
        return F.linear(xc, wc, bc)  # (..., out)

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ wc).to(ctx.x_dtype)  # (..., out) @ (out, in) -> (..., in)
        weight, bias = ctx.module.weight, ctx.module.bias  # the leaves, not the casts

        def weight_grads() -> list:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), xc.reshape(-1, xc.shape[-1])
            out = []
            if weight.requires_grad:
                out.append((weight, (dy2.t() @ x2).to(weight.dtype)))  # (out, in)
            if bias is not None and bias.requires_grad:
                out.append((bias, dy2.sum(0).to(bias.dtype)))  # (out,)
            return out

        if ctx.key is None:  # outside a pipeline step: at once, as nn.Linear
            grads = dict((id(p), g) for p, g in weight_grads())
            return (dx, grads.get(id(weight)),
                    grads.get(id(bias)) if bias is not None else None,
                    None, None, None, None)
        ctx.store.put(ctx.key, weight_grads)
        return dx, None, None, None, None, None, None


def _deferred_forward(module: nn.Linear, store: WeightGradStore, x: torch.Tensor):
    key = store.key if x.requires_grad else None  # else no backward would reach it
    w, b = module.weight, module.bias
    if key is not None:  # W adds the gradient: no autograd edge to the parameters
        w, b = w.detach(), (b.detach() if b is not None else None)
    dtype = autocast_state.current_dtype(x.device.type)  # cast here, as autocast would
    with autocast_state.off(x.device.type):
        return DeferredLinear.apply(x, w, b, module, store, key, dtype)


def defer_weight_grads(stage: nn.Module, store: WeightGradStore) -> int:
    """Route every plain `nn.Linear` of `stage` through `DeferredLinear` with `store`
    (an instance attribute ``forward``; `restore_weight_grads` removes it), and hand
    `store` to every linear that defers by itself (a ``wgrad_store`` attribute: the
    tensor-parallel linears, whose weight gradient comes with communication, see
    `tp_ops.deferral`). Subclasses of `nn.Linear` (fp8 linears) are left alone.
    Returns how many linears defer."""
    n = 0
    for mod in stage.modules():
        if type(mod) is nn.Linear:
            mod.forward = functools.partial(_deferred_forward, mod, store)
            n += 1
        elif hasattr(mod, "wgrad_store"):
            mod.wgrad_store = store
            n += 1
    return n


def restore_weight_grads(stage: nn.Module) -> None:
    """Undo `defer_weight_grads`: the linears' own forward again."""
    for mod in stage.modules():
        if type(mod) is nn.Linear and "forward" in mod.__dict__:
            del mod.forward
        elif "wgrad_store" in mod.__dict__:
            del mod.wgrad_store


# --------------------------------------------------------------------------- transfers


class _Posted:
    """One group of transfers posted together; `wait()` once, for all of them."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors  # tensors: alive until done

    def wait(self) -> None:
        if self.works is not None:
            with distributed.collective("pipeline point-to-point"):
                for w in self.works:
                    w.wait()
            self.works, self.tensors = None, []


# ----------------------------------------------------------------------------- runtime


class PipelineRuntime:
    """Executes `schedule` on this rank's `stages` ({virtual stage: `stages.Stage`}).

    `group`: the pipeline process group (``mesh.get_group("pp")``; None: the default
    group, or none at all for a one-rank schedule); this rank's place in it is its
    pipeline rank. `precision`: switch 6's name (autocast and TF32 around the step).
    `act_dtype`: the dtype of the activations between stages. The schedule is validated
    (dependencies, no deadlock when every group of transfers blocks) before anything
    runs."""

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, *, group=None,
                 overlap_p2p: bool = True, precision: str = "fp32",
                 act_dtype: torch.dtype = torch.float32, device=None):
        p = schedule.num_ranks
        if p > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"a {p}-rank pipeline needs torch.distributed: launch "
                                   "with torchrun and call "
                                   "colossal_lab.parallel.distributed.init()")
            size = dist.get_world_size(group)
            if size != p:
                raise ValueError(f"the schedule has {p} ranks but the pipeline group has "
                                 f"{size}: make the mesh with pp={p}")
            self.rank = dist.get_rank(group)
        else:
            self.rank = 0
        mine = schedule.stages_of(self.rank)
        if sorted(stages) != mine:
            raise ValueError(f"pipeline rank {self.rank} runs stages {mine} of "
                             f"{schedule.name}, but was given {sorted(stages)}")
        validate(schedule, p2p="batched")
        self.schedule, self.stages, self.group = schedule, dict(stages), group
        self.overlap_p2p, self.precision, self.act_dtype = overlap_p2p, precision, act_dtype
        self.program = schedule.lower("eager").programs[self.rank]
        first = next(iter(stages.values()))
        self.hidden_size = first.cfg.hidden_size
        self.seq_shards = getattr(first, "seq_shards", 1)
        """Sequence parallelism inside the stages: each rank sends its 1/t of the
        sequence (`stages.Stage.seq_shards`)."""
        self.device = torch.device(device) if device is not None else \
            next(first.parameters()).device
        self.peers = {r: (dist.get_global_rank(group, r) if group is not None else r)
                      for r in range(p)} if p > 1 else {0: 0}
        self.stores: dict[int, WeightGradStore] = {}
        for s, stage in stages.items():
            restore_weight_grads(stage)  # from an earlier runtime on these modules
            if schedule.split_backward:
                self.stores[s] = WeightGradStore(f"stage {s}")
                defer_weight_grads(stage, self.stores[s])
        self.counts: Counter = Counter()
        """Compute actions the last `step` ran, by kind ("F", "B", "W")."""
        self.trace: list[tuple[Action, float, float]] = []
        """The last step's compute actions with host start and end (perf_counter, s
        since `step_start`): on a CPU the actions' times; on a GPU launch times."""
        self.step_start = 0.0
        """`time.perf_counter()` when the last step began (one clock for every process
        of a machine on Linux: the ranks' traces line up)."""
        if p > 1:  # every rank of the group talks once before the first batched p2p
            # (NCCL creates its communicator lazily on the first call of the group)
            with distributed.collective("pipeline group warm-up"):
                dist.all_reduce(torch.zeros(1, device=self._comm_device()), group=group)

    def _comm_device(self) -> torch.device:
        backend = dist.get_backend(self.group) if dist.is_initialized() else None
        return self.device if backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------------ a step

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch, (B, S) token ids and (B, S) labels (every
        rank passes them; stage 0 reads the ids, the last stage the labels), cut into
        the schedule's m micro-batches along B. Gradients are added to this rank's
        parameters' ``.grad``; returns the loss, the mean over the micro-batches of
        their mean cross-entropy, on every rank of the pipeline."""
        m = self.schedule.num_microbatches
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels "
                             f"{tuple(labels.shape)} must both be (batch, seq)")
        if input_ids.shape[0] % m:
            raise ValueError(f"batch {input_ids.shape[0]} does not split into "
                             f"num_microbatches={m} equal micro-batches: use a batch that "
                             f"is a multiple of {m}")
        b, seq = input_ids.shape[0] // m, input_ids.shape[1]
        if seq % self.seq_shards:
            raise ValueError(f"sequence length {seq} does not split into the "
                             f"{self.seq_shards} sequence shards of the stages' tensor "
                             f"parallelism: use a multiple of {self.seq_shards}")
        self._ids = input_ids.to(self.device).chunk(m)
        self._labels = labels.to(self.device).chunk(m)
        self._shape = (b, seq // self.seq_shards, self.hidden_size)
        self._saved: dict = {}  # (mb, stage) -> (input, output) from F to B
        self._local: dict = {}  # tensors between two stages of this rank
        self._to_send: dict = {}  # (kind, mb, stage) -> tensor for SEND_F / SEND_B
        self._incoming: dict = {}  # (kind, mb, stage) -> (buffer, _Posted)
        self._in_flight: list[_Posted] = []
        self._losses: list[torch.Tensor] = []
        self.counts, self.trace = Counter(), []
        for store in self.stores.values():  # left only by a step that raised
            store.pending.clear()
        t0 = self.step_start = time.perf_counter()
        prog, i = self.program, 0
        with precision_mod.matmul_mode(self.precision):
            while i < len(prog):
                if prog[i].is_compute:
                    a = prog[i]
                    start = time.perf_counter() - t0
                    {sch.F: self._forward, sch.B: self._backward, sch.W: self._weight}[
                        a.kind](a)
                    self.trace.append((a, start, time.perf_counter() - t0))
                    self.counts[a.kind] += 1
                    i += 1
                    continue
                j = i
                while j < len(prog) and not prog[j].is_compute:
                    j += 1
                self._post(prog[i:j])
                i = j
            for posted in self._in_flight:
                posted.wait()
        left = [name for name, d in (("saved", self._saved), ("local", self._local),
                                     ("to_send", self._to_send),
                                     ("incoming", self._incoming)) if d]
        left += [f"W jobs of {s}" for s, st in self.stores.items() if len(st)]
        if left:  # a schedule that validate() accepted cannot leave anything behind
            raise RuntimeError(f"pipeline rank {self.rank}: the step left {left} "
                               "unconsumed")
        return self._loss(m)

    def _loss(self, m: int) -> torch.Tensor:
        last = self.schedule.num_stages - 1
        owner = self.schedule.rank_of(last)
        if self.rank == owner:
            loss = torch.stack([x.float() for x in self._losses]).sum() / m
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.schedule.num_ranks > 1:
            t = loss.to(self._comm_device())
            with distributed.collective("pipeline loss broadcast"):
                dist.broadcast(t, src=self.peers[owner], group=self.group)
            loss = t.to(self.device)
        return loss

    # ------------------------------------------------------------ compute actions

    def _input(self, mb: int, s: int) -> torch.Tensor:
        if s == 0:
            return self._ids[mb]
        if (sch.F, mb, s) in self._local:
            x = self._local.pop((sch.F, mb, s))
        else:
            x, posted = self._incoming.pop((sch.F, mb, s))
            posted.wait()
        return x.requires_grad_()  # a leaf: B reads its .grad

    def _forward(self, a: Action) -> None:
        mb, s = a.mb, a.stage
        stage, last = self.stages[s], self.schedule.num_stages - 1
        x = self._input(mb, s)
        store = self.stores.get(s)
        ctx = store.micro_batch(mb) if store is not None else contextlib.nullcontext()
        with ctx, precision_mod.autocast(self.precision, self.device):
            out = stage(x, self._labels[mb]) if s == last else stage(x)
        if s == last:
            self._losses.append(out.detach())
            out = out / self.schedule.num_microbatches  # the mean over micro-batches
        else:
            if tuple(out.shape) != self._shape or out.dtype != self.act_dtype:
                raise RuntimeError(
                    f"stage {s} returned {tuple(out.shape)} {out.dtype}, but the "
                    f"runtime sends {self._shape} {self.act_dtype} between stages: pass "
                    "act_dtype= the dtype of the model's residual stream")
            nxt = (sch.F, mb, s + 1)
            if self.schedule.rank_of(s + 1) == self.rank:
                self._local[nxt] = out.detach()
            else:
                self._to_send[(sch.F, mb, s)] = out.detach()
        self._saved[(mb, s)] = (x, out)

    def _backward(self, a: Action) -> None:
        mb, s = a.mb, a.stage
        x, out = self._saved.pop((mb, s))
        if s == self.schedule.num_stages - 1:
            grad = None  # out is the loss / m
        elif (sch.B, mb, s) in self._local:
            grad = self._local.pop((sch.B, mb, s))
        else:
            grad, posted = self._incoming.pop((sch.B, mb, s))
            posted.wait()
        # one ordinary backward: with a split schedule the stage's linears file their
        # weight gradients with its store instead of returning them (`DeferredLinear`)
        torch.autograd.backward(out, grad)
        if s > 0:
            dx = x.grad
            if self.schedule.rank_of(s - 1) == self.rank:
                self._local[(sch.B, mb, s - 1)] = dx
            else:
                self._to_send[(sch.B, mb, s)] = dx

    def _weight(self, a: Action) -> None:
        self.stores[a.stage].flush(a.mb)

    # ------------------------------------------------------------------ transfers

    def _post(self, actions: list[Action]) -> None:
        ops, tensors, recvs = [], [], []
        for a in actions:
            if a.kind in (sch.SEND_F, sch.SEND_B):
                kind = sch.F if a.kind == sch.SEND_F else sch.B
                t = self._to_send.pop((kind, a.mb, a.stage)).contiguous()
                peer = self.schedule.rank_of(a.stage + (1 if kind == sch.F else -1))
                ops.append(dist.P2POp(dist.isend, t, self.peers[peer], self.group))
            else:
                kind = sch.F if a.kind == sch.RECV_F else sch.B
                t = torch.empty(self._shape, dtype=self.act_dtype, device=self.device)
                peer = self.schedule.rank_of(a.stage + (-1 if kind == sch.F else 1))
                ops.append(dist.P2POp(dist.irecv, t, self.peers[peer], self.group))
                recvs.append(((kind, a.mb, a.stage), t))
            tensors.append(t)
        with distributed.collective("pipeline point-to-point"):
            works = dist.batch_isend_irecv(ops)
        posted = _Posted(list(works or []), tensors)
        if not self.overlap_p2p:
            posted.wait()  # where the schedule puts the transfers, before computing on
        else:
            self._in_flight.append(posted)
        for key, t in recvs:
            self._incoming[key] = (t, posted)
