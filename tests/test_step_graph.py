"""`enable_compile="graph"` (`switches.step_graph`): the training step replayed as a
CUDA graph. On the CPU: the refusals, and the wrapper's logic (eager first step, one
capture, a new capture for a new shape or learning rate) with a stand-in graph whose
replay runs the captured step; on a GPU: real captures against the eager step."""

from __future__ import annotations

import pytest
import torch

from colossal_lab.config import SWITCH_SETS, Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import compile as compile_switch
from colossal_lab.switches import step_graph
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training.train import make_optimizer, make_step
from tests.conftest import requires_cuda

GRAPH = SWITCH_SETS["best"].replace(enable_compile="graph")


def test_graph_is_a_compile_mode_that_compiles_nothing():
    assert compile_switch.resolve("graph") == "graph"
    model = build_model(tiny(), "cpu")
    assert compile_switch.apply(model, "graph") == 0
    assert compile_switch.compiled(model) == []


@pytest.mark.parametrize("change, match", [
    (dict(precision="fp16"), "fp16"),
    (dict(enable_fused_optimizer=False), "torch's AdamW"),
    (dict(gradient_checkpoint_config={"ratio": 0.5}), "gradient checkpointing"),
    (dict(overlap_communication=True), "data parallelism"),
    (dict(enable_sequence_parallelism=True), "tensor parallelism"),
])
def test_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        step_graph.check(GRAPH.replace(**change), "cuda")
    step_graph.check(GRAPH, "cuda")  # the best set itself is taken
    step_graph.check(GRAPH.replace(precision="fp8"), "cuda")  # dynamic scaling
    for scaling in ("dynamic", "delayed"):  # the amax ring's position is on the device
        step_graph.check(GRAPH.replace(precision="fp8-pure",
                                       extra={"fp8_scaling": scaling}), "cuda")


def test_refused_on_a_cpu():
    with pytest.raises(ValueError, match="needs a GPU, not cpu"):
        apply_switches(build_model(tiny(), "cpu"), GRAPH)


class _StandIn:
    """A CUDA graph stand-in: capture keeps the function, replay runs it."""

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


def _plain_step(seed=0):
    torch.manual_seed(seed)
    model = apply_switches(build_model(tiny(), "cpu"), Switches(precision="fp32"))
    opt = make_optimizer(model, 1e-3)
    return model, opt, make_step(model, opt)


def _batches(shapes):
    g = torch.Generator().manual_seed(3)
    out = []
    for b, s in shapes:
        ids = torch.randint(0, tiny().vocab_size, (b, s + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def test_wrapper_runs_eager_then_replays_and_captures_again(monkeypatch):
    """The stand-in replays what was captured, so the wrapped step must give the eager
    step's losses and weights exactly; captures: one after the first (eager) step, one
    for the new shape, one for the new learning rate."""
    monkeypatch.setattr(step_graph.torch.cuda, "CUDAGraph", _StandIn)
    monkeypatch.setattr(step_graph.timing, "_capture",
                        lambda fn, graph: setattr(graph, "fn", fn))
    shapes = [(2, 16)] * 3 + [(1, 24)] * 2 + [(2, 16)]
    batches = _batches(shapes)
    eager_model, eager_opt, eager = _plain_step()
    model, opt, step = _plain_step()
    graphed = step_graph.GraphedStep(step, opt, "cpu")
    losses, want = [], []
    for i, (ids, lab) in enumerate(batches):
        if i == 4:  # the learning rate is a number in the captured launches
            for o in (opt, eager_opt):
                o.param_groups[0]["lr"] = 5e-4
        losses.append(graphed(ids, lab).item())
        want.append(eager(ids, lab).item())
        if i == 0:
            assert graphed.captures == 1  # captured after the eager step, not run
    assert losses == want
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    assert graphed.captures == 4 and graphed.capture_s is not None


@pytest.mark.parametrize("fused_loss", [False, True], ids=["head", "fused-loss"])
def test_fp8_delayed_runs_two_eager_steps_before_capturing(fused_loss, monkeypatch):
    """fp8 delayed scaling: the first step's casts are dynamic (they start the amax
    histories), so the second step runs eagerly too (the steady state's kernels compile
    there) and the capture follows it; an fp8 head the fused loss never calls (it reads
    the weight) does not hold the capture back. With the stand-in graph the wrapped
    step trains as the eager one, histories and ring positions included."""
    from colossal_lab.switches import fp8 as fp8_switch

    monkeypatch.setattr(step_graph.torch.cuda, "CUDAGraph", _StandIn)
    monkeypatch.setattr(step_graph.timing, "_capture",
                        lambda fn, graph: setattr(graph, "fn", fn))
    cfg = tiny().replace(intermediate_size=176)  # every linear fp8
    sw = Switches(precision="fp8", enable_fused_cross_entropy=fused_loss,
                  extra={"fp8_scaling": "delayed", "fp8_history": 3, "fp8_backend": "emulate"})

    def built():
        torch.manual_seed(0)
        model = apply_switches(build_model(cfg, "cpu"), sw)
        opt = make_optimizer(model, 1e-3)
        return model, make_step(model, opt), opt

    eager_model, eager, _ = built()
    model, step, opt = built()
    assert fp8_switch.histories_started(model) == 0
    graphed = step_graph.GraphedStep(step, opt, "cpu")
    for i, (ids, lab) in enumerate(_batches([(2, 16)] * 5)):
        assert graphed(ids, lab).item() == eager(ids, lab).item(), i
        assert graphed.captures == (0 if i == 0 else 1), i
    assert graphed.eager_steps == 2
    unused = 1 if fused_loss else 0  # the head
    assert fp8_switch.histories_started(model) == 3 * (len(fp8_switch.fp8_modules(model))
                                                        - unused)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(fp8_switch.fp8_modules(model), fp8_switch.fp8_modules(eager_model)):
        for role in ("x", "w", "grad"):
            sa, sb = a._scalers[role], b._scalers[role]
            assert torch.equal(sa.history, sb.history)
            assert sa.pos == sb.pos == (5 % 3 if sa.seen else 0) and sa.seen == sb.seen


@requires_cuda  # a CUDA graph: `make test-gpu`
def test_graphed_step_trains_as_the_eager_one():
    """Every switch of `best`, the tiny model: six steps (a shape change among them)
    with the step replayed as a graph against the eager step, from the same weights and
    batches: the same kernels in the same order, so the same losses and weights up to
    the kernels' own run-to-run differences."""
    def run(switches):
        torch.manual_seed(0)
        model = apply_switches(build_model(tiny(), "cuda"), switches)
        opt = make_optimizer(model, 1e-3)
        step = make_step(model, opt)
        losses = [step(ids.cuda(), lab.cuda()).item()
                  for ids, lab in _batches([(2, 64)] * 4 + [(1, 96)] * 2)]
        return model, step, losses

    m_eager, _, eager = run(SWITCH_SETS["best"])
    m_graph, step, graphed = run(GRAPH)
    assert isinstance(step, step_graph.GraphedStep) and step.captures == 2
    torch.testing.assert_close(graphed, eager, rtol=2e-3, atol=0)
    for a, b in zip(m_graph.parameters(), m_eager.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=2e-3)


@requires_cuda  # a CUDA graph: `make test-gpu`
def test_graphed_fp8_delayed_step_trains_as_the_eager_one():
    """`best-fp8` (fp8 linears, delayed scaling, rings of 4 so six steps wrap around)
    replayed as a graph against the eager step: the replays file their amaxes in the
    next slot each step (the ring's position is a device tensor), so the positions
    match exactly and losses, weights and histories up to the kernels' run-to-run
    differences."""
    from colossal_lab.switches import fp8 as fp8_switch

    cfg = tiny().replace(intermediate_size=176)  # every linear a multiple of 16: fp8
    best = SWITCH_SETS["best-fp8"]
    best = best.replace(extra={**best.extra, "fp8_history": 4})

    def run(switches):
        torch.manual_seed(0)
        model = apply_switches(build_model(cfg, "cuda"), switches)
        opt = make_optimizer(model, 1e-3)
        step = make_step(model, opt)
        losses = [step(ids.cuda(), lab.cuda()).item()
                  for ids, lab in _batches([(2, 64)] * 4 + [(1, 96)] * 2)]
        return model, step, losses

    m_eager, _, eager = run(best)
    m_graph, step, graphed = run(best.replace(enable_compile="graph"))
    assert isinstance(step, step_graph.GraphedStep) and step.captures == 2
    assert step.eager_steps == 2  # the histories start in the first
    torch.testing.assert_close(graphed, eager, rtol=2e-3, atol=0)
    for a, b in zip(m_graph.parameters(), m_eager.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=2e-3)
    mods = [fp8_switch.fp8_modules(m) for m in (m_graph, m_eager)]
    assert len(mods[0]) == len(mods[1]) > 0
    for a, b in zip(*mods):
        for role in ("x", "w", "grad"):
            sa, sb = a._scalers[role], b._scalers[role]
            assert sa.pos == sb.pos == (6 % 4 if sa.seen else 0), role
            torch.testing.assert_close(sa.history, sb.history, rtol=0.05, atol=0)
