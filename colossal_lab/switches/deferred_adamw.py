"""`extra["adamw_defer"]` (no ColossalAI flag): step k's AdamW update runs in step k+1's forward.

Values: False (default) or True. On the model it registers a forward pre-hook on the
decoder stack, each layer and the final norm (`DeferredUpdate`).

**Why.** The optimizer step is memory traffic (20 bytes a parameter with bf16 moments),
and it runs alone between the backward and the
next forward, while the forward's GEMMs leave the memory system mostly idle. Nothing
forces the order except that a layer's forward must see that layer's updated weights.

**How.** At the end of step k the gradients are clipped as usual (the norm and the
coefficient stay on the device) but not applied: `DeferredUpdate.defer` keeps them. In
step k+1 a forward pre-hook on the model starts the update of the embedding on a side
stream and waits for it; the hook on layer i waits for layer i's update and starts layer
i+1's, so each layer's update runs while the layer before it computes; the final norm's
hook waits for the rest (final norm, output head). Each part's gradients are released
as its update is issued (`record_stream`: their memory is not reused before the side
stream is done with it), so the backward of step k+1 starts from none, as after
`zero_grad`. The optimizer's states are allocated when the first update is deferred, on
the stream that ran the backward, as a plain step would: allocated by the side stream
inside a forward, they would come from a pool that only that stream reuses, next to the
forward's activations (at full LLaMA-7B, 63 GiB of moments and master halves). The
updates are the same kernels on the same tensors in the same order as
`FusedAdamW.step`: the trajectory is the eager one, bit for bit.

**Memory.** Freeing each part's gradients during the forward interleaves frees of
parameter-sized blocks with the forward's allocations of other sizes. The caching
allocator splits those blocks, and near the card's capacity the backward can fail with
gigabytes reserved but free, where the plain step, which frees every gradient at once
before the forward, fits at the same peak. With expandable segments
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) the allocator maps memory in pages
that serve any size, and the deferred step peaks where the plain one does. The
benchmarks run a deferred setup's process with it; `DeferredUpdate` warns without it
(`check_allocator`).

`flush()` applies whatever is still pending and waits for it: before a checkpoint, an
evaluation, an export or reading the weights, and at the end of training
(`train.train` calls it; `step.flush` of `train.make_step`).

An option of our AdamW, as `extra["adamw_moments"]`: where `enable_fused_optimizer`
picks torch's (True on a CPU), the step is the usual one. **Refused** (`check`), what
a second stream would need more care for: data parallelism (its gradient reduction),
tensor parallelism, `enable_compile` (a compiled layer would trace the hooks; the graph
step does not capture a second stream yet), fp16 (a skipped step decided by the loss
scaler). Pipeline stages build their own step, which does not defer.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from colossal_lab.switches import compile as compile_switch  # not the builtin


def requested(switches) -> bool:
    """`extra["adamw_defer"]` of `switches`, checked: True or False (default)."""
    value = (getattr(switches, "extra", None) or {}).get("adamw_defer", False)
    if not isinstance(value, bool):
        raise ValueError(f"extra['adamw_defer']={value!r}; choose True or False")
    return value


def check(switches, device=None) -> None:
    """Refuse what the deferred update does not compose with (module docstring)."""
    if not requested(switches):
        return
    refused = {
        "fp16 (the loss scaler decides which steps are skipped)":
            switches.precision == "fp16",
        "data parallelism (overlap_communication)": bool(switches.overlap_communication),
        "tensor parallelism (enable_sequence_parallelism)":
            bool(switches.enable_sequence_parallelism),
        "enable_compile (a compiled layer would trace the hooks; the graph step does not "
        "capture a second stream yet)": compile_switch.resolve(switches.enable_compile)
        is not None,
    }
    if named := [k for k, v in refused.items() if v]:
        raise ValueError(f"extra['adamw_defer']=True does not compose with {named[0]}")


ALLOC_CONF = "expandable_segments:True"
"""The CUDA allocator setting a deferred update wants (module docstring, **Memory**)."""


def allocator_ok() -> bool:
    """Does this process's allocator configuration (`PYTORCH_CUDA_ALLOC_CONF` or
    `PYTORCH_ALLOC_CONF`, read when CUDA starts) use expandable segments?"""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF",
                                                     "PYTORCH_ALLOC_CONF"))
    return ALLOC_CONF.lower() in conf.replace(" ", "").lower()


def check_allocator(device) -> None:
    """Warn, once a process, when a deferred update on a GPU runs without expandable
    segments (module docstring, **Memory**)."""
    if torch.device(device).type == "cuda" and not allocator_ok():
        warnings.warn(f"extra['adamw_defer']=True frees gradients during the forward; "
                      f"without PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} the allocator can "
                      f"fragment and run out of memory where the plain step fits",
                      stacklevel=3)


def parts(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[list]]:
    """(gates, groups) of our `LlamaForCausalLM`: the modules whose forward each part's
    update must precede (the decoder stack, each layer, the final norm) and the
    parameters of each part (embedding, each layer, the rest)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "embed_tokens") \
            or not hasattr(inner, "norm"):
        raise ValueError(f"extra['adamw_defer']=True needs our LlamaForCausalLM "
                         f"(model.embed_tokens, model.layers, model.norm), not "
                         f"{type(model).__name__}")
    seen: set[int] = set()

    def own(params):
        out = [p for p in params if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    groups = [own(inner.embed_tokens.parameters())]
    groups += [own(layer.parameters()) for layer in layers]
    groups.append(own(model.parameters()))  # final norm, head: everything left
    return [inner, *layers, inner.norm], groups


class DeferredUpdate:
    """The update of the last step, applied part by part ahead of the forward that
    needs it (module docstring). `pending`: an update is waiting."""

    def __init__(self, model: torch.nn.Module, optimizer, device):
        if not hasattr(optimizer, "update") or not hasattr(optimizer, "take_coefficient"):
            raise ValueError(f"extra['adamw_defer']=True needs our FusedAdamW, not "
                             f"{type(optimizer).__name__}")
        self.optimizer, self.device = optimizer, torch.device(device)
        check_allocator(self.device)
        gates, self.groups = parts(model)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending, self.issued, self.coef = False, 0, None
        self.ready = None
        self.done: list = [None] * len(self.groups)
        self.handles = [gate.register_forward_pre_hook(self._hook(i))
                        for i, gate in enumerate(gates)]

    def defer(self) -> None:
        """End of a step: keep the gradients and the clipping coefficient for the next
        forward (a pending update is applied first: one step's update at a time)."""
        self.flush()
        self.optimizer.init_state()  # on this stream, not the side one (`init_state`)
        self.coef = self.optimizer.take_coefficient()
        self.pending, self.issued = True, 0
        if self.cuda:  # the side stream starts after the backward and the norm
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))

    def _stream(self):
        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def _issue(self, upto: int) -> None:
        """Start the updates of parts `issued` .. `upto` on the side stream."""
        while self.issued <= min(upto, len(self.groups) - 1):
            g = self.issued
            params = self.groups[g]
            with self._stream():
                if self.cuda:
                    self.side.wait_event(self.ready)
                self.optimizer.update(params, self.coef)
                for p in params:
                    if p.grad is not None and self.cuda:
                        p.grad.record_stream(self.side)
                    p.grad = None
                if self.cuda:
                    self.done[g] = torch.cuda.Event()
                    self.done[g].record(self.side)
            self.issued += 1

    def _wait(self, g: int) -> None:
        if self.cuda and self.done[g] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done[g])
            self.done[g] = None

    def _hook(self, g: int):
        def hook(module, args):
            if not self.pending:
                return None
            self._issue(g)  # this part (issued already, but for the first)
            self._wait(g)
            self._issue(g + 1)  # the next part runs while this one computes
            if g == len(self.groups) - 1:
                self.pending = False
            return None

        return hook

    def flush(self) -> None:
        """Apply what is pending now, and make the current stream wait for it."""
        if not self.pending:
            return
        self._issue(len(self.groups) - 1)
        for g in range(len(self.groups)):
            self._wait(g)
        self.pending = False

    def remove(self) -> None:
        """Apply what is pending and take the hooks off the model."""
        self.flush()
        for h in self.handles:
            h.remove()
