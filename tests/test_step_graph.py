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
    (dict(precision="fp8", extra={"fp8_scaling": "delayed"}), "delayed scaling"),
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
