"""`extra["adamw_defer"]` (`switches.deferred_adamw`): our AdamW's update of step k
applied during step k+1's forward, part by part. The same kernels on the same tensors in
the same order, so the trajectory must be the plain step's bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import deferred_adamw
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training.train import make_optimizer, make_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SW = Switches(precision="bf16-pure", enable_fused_optimizer="triton",
              extra={"adamw_moments": "bf16"})


def _run(switches, n_steps=4, flush=True, micro_batches=1):
    torch.manual_seed(0)
    model = apply_switches(build_model(tiny(), DEVICE), switches)
    opt = make_optimizer(model, 1e-3)
    # clipping that bites: the coefficient moves
    step = make_step(model, opt, clip=0.5, micro_batches=micro_batches)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(n_steps):
        ids = torch.randint(0, tiny().vocab_size, (2 * micro_batches, 17),
                            generator=g).to(DEVICE)
        losses.append(step(ids[:, :-1], ids[:, 1:]).item())
    if flush:
        step.flush()
    return model, opt, step, losses


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_deferred_update_is_the_plain_step_bit_for_bit(micro_batches):
    """Four steps, then `flush`: the same losses, weights, masters and moments as the
    plain step; before `flush` the last update is pending and the weights are those of
    the step before; after, the gradients are released as `zero_grad` leaves them. With
    gradient accumulation the pending update is applied in the first micro-batch's
    forward, before its backward adds to any gradient."""
    model, opt, _, losses = _run(SW, micro_batches=micro_batches)
    d_model, d_opt, d_step, d_losses = _run(
        SW.replace(extra={**SW.extra, "adamw_defer": True}), flush=False,
        micro_batches=micro_batches)
    assert d_step.deferred is not None and d_step.deferred.pending
    assert d_losses == losses  # each loss comes from a forward that saw every update
    before = [p.detach().clone() for p in d_model.parameters()]
    d_step.flush()
    assert not d_step.deferred.pending
    assert any(not torch.equal(a, b) for a, b in zip(before, d_model.parameters()))
    for a, b in zip(model.parameters(), d_model.parameters()):
        assert torch.equal(a, b) and b.grad is None
    for sa, sb in zip(opt.state_dict()["state"].values(),
                      d_opt.state_dict()["state"].values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def test_parts_cover_every_parameter_once_in_forward_order():
    model = build_model(tiny(), "cpu")
    gates, groups = deferred_adamw.parts(model)
    assert gates[0] is model.model and gates[-1] is model.model.norm
    assert gates[1:-1] == list(model.model.layers)
    ids = [id(p) for g in groups for p in g]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert [id(p) for p in groups[0]] == [id(model.model.embed_tokens.weight)]
    with pytest.raises(ValueError, match="needs our LlamaForCausalLM"):
        deferred_adamw.parts(torch.nn.Linear(2, 2))


def test_an_option_of_our_adamw_and_its_refusals():
    # torch's AdamW (the plain path on this device): the usual step, nothing deferred
    _, opt, step, _ = _run(Switches(precision="fp32", enable_fused_optimizer=False,
                                    extra={"adamw_defer": True}), n_steps=1)
    assert step.deferred is None and not hasattr(opt, "take_coefficient")
    for change, match in ((dict(precision="fp16"), "fp16"),
                          (dict(overlap_communication=True), "data parallelism"),
                          (dict(enable_sequence_parallelism=True), "tensor parallelism"),
                          (dict(enable_compile="graph"), "enable_compile"),
                          (dict(enable_compile="layers"), "enable_compile")):
        with pytest.raises(ValueError, match=match):
            deferred_adamw.check(SW.replace(extra={"adamw_defer": True}, **change))
    with pytest.raises(ValueError, match="adamw_defer'\\]='yes'"):
        deferred_adamw.requested(SW.replace(extra={"adamw_defer": "yes"}))


def test_states_exist_when_the_update_is_deferred_and_close_removes_the_hooks():
    """The first deferred step allocates the optimizer's states at once, on the stream
    that ran the backward (`FusedAdamW.init_state`), not later inside the next forward on
    the side stream; `close` applies the pending update and takes the hooks off."""
    d_model, d_opt, d_step, _ = _run(SW.replace(extra={**SW.extra, "adamw_defer": True}),
                                     n_steps=1, flush=False)
    assert d_step.deferred.pending
    with_grad = [p for p in d_model.parameters() if p.grad is not None]
    assert with_grad and all(set(d_opt.state[p]) >= {"exp_avg", "exp_avg_sq", "step"}
                             for p in with_grad)
    assert all(float(d_opt.state[p]["step"]) == 0 for p in with_grad)  # not yet applied
    gates, _ = deferred_adamw.parts(d_model)
    hooked = [len(g._forward_pre_hooks) for g in gates]
    before = [p.detach().clone() for p in d_model.parameters()]
    d_step.close()
    assert d_step.deferred is None
    assert [len(g._forward_pre_hooks) for g in gates] == [n - 1 for n in hooked]
    assert all(float(d_opt.state[p]["step"]) == 1 for p in with_grad)
    assert any(not torch.equal(a, b) for a, b in zip(before, d_model.parameters()))
    d_step.close()  # a second close is a no-op


def test_a_deferred_setup_runs_with_expandable_segments(monkeypatch):
    """The deferred update frees gradients during the forward: its benchmark process gets
    expandable segments (module docstring, **Memory**), any other setup the default
    allocator; on a GPU without them the update warns."""
    from colossal_lab.benchmarks import composed, steps

    seen = {}

    def fake_child(module, args, cwd=None, env=None):
        seen[args[args.index("--setup-json") + 1]] = env
        return {"setup": "x"}, None

    monkeypatch.setattr(steps, "in_child", fake_child)
    by = {s.name: s for s in composed.SETUPS}
    for name in ("ours-bf16-defer", "ours-7b-bf16-defer", "ours-bf16", "ours-7b-bf16"):
        steps.measure_isolated(by[name], "tiny", 16, 2)
    deferred = [e for j, e in seen.items() if '"adamw_defer": true' in j]
    plain = [e for j, e in seen.items() if '"adamw_defer": true' not in j]
    assert len(deferred) == 2 and len(plain) == 2
    assert all(e == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
               for e in deferred)
    assert all(e is None for e in plain)

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert not deferred_adamw.allocator_ok()
    with pytest.warns(UserWarning, match="expandable_segments:True"):
        deferred_adamw.check_allocator("cuda")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, "
                                                  "expandable_segments:True")
    assert deferred_adamw.allocator_ok()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deferred_adamw.check_allocator("cuda")
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        deferred_adamw.check_allocator("cpu")  # a CPU has no caching allocator
