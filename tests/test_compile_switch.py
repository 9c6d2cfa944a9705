"""`enable_compile` (`switches.compile`): each decoder layer or the whole model compiled
in place, the same loss and gradients as eager, counted, idempotent, refused early when
it cannot work; and the benchmarks' compile peers (`first_step_s`, torchao float8).

On the CPU our Triton kernels run under the interpreter, which Dynamo cannot trace, so
the models here use the eager and torch backends and `torch.compile` runs AOTAutograd
without code generation ("aot_eager", through a backend that counts the graphs): what
is tested is the wiring (what gets compiled, that it is traced and run, that forward
and backward agree), not Inductor's kernels.
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from colossal_lab.benchmarks import composed, steps, waterfall
from colossal_lab.config import SWITCH_SETS, Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import compile as compile_switch
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig as Ckpt
from colossal_lab.testing.correctness import check_close

CFG = tiny()  # 2 layers, odd intermediate width (172), GQA 4:2


@pytest.fixture
def graphs():
    """A torch.compile backend that records each graph Dynamo hands it, then runs it
    through AOTAutograd eagerly; Dynamo's caches are cleared first, so every test
    compiles afresh (they are shared across modules: `Module._call_impl` is one code
    object)."""
    torch._dynamo.reset()
    yield Graphs()
    torch._dynamo.reset()


class Graphs(list):
    """The graphs `backend` was handed, in order."""

    def backend(self, gm, example_inputs):
        self.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode,ckpt", [("layers", None), ("layers", Ckpt()),
                                       ("model", None)],
                         ids=["layers", "layers-checkpointed", "model"])
def test_compiled_loss_and_every_gradient_equal_eager(mode, ckpt, graphs):
    """Forward and backward of the compiled model against the same weights run
    eagerly. fp32 and AOTAutograd runs the same aten ops, so the tolerance is fp32
    round-off (atol 1e-6, rtol 1e-5), not a low-precision one."""
    sw = Switches(precision="fp32", gradient_checkpoint_config=ckpt)
    eager = apply_switches(build_model(CFG, "cpu"), sw)
    model = build_model(CFG, "cpu")
    model.load_state_dict(eager.state_dict())
    apply_switches(model, sw.replace(enable_compile=mode,
                                     extra={"compile_backend": graphs.backend}))
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(eager, ids)
    got_loss, got = _loss_and_grads(model, ids)
    # one graph: the whole forward, or one layer's, reused by the other layer
    assert len(graphs) == 1
    check_close(got_loss, want_loss, name="loss", atol=1e-6, rtol=1e-5)
    assert got.keys() == want.keys()
    for k in want:
        check_close(got[k], want[k], name=k, atol=1e-6, rtol=1e-5)
    _loss_and_grads(model, ids)  # a second step at the same shape compiles nothing
    assert len(graphs) == 1


def test_apply_counts_and_keeps_modules_and_keys():
    """`apply` compiles in place: the count, the same module objects and classes, the
    same state-dict keys (no `_orig_mod.` prefix), forward hooks kept."""
    model = build_model(CFG, "cpu")
    keys, layers = list(model.state_dict()), list(model.model.layers)
    hook = model.model.layers[0].register_forward_hook(lambda *_: None)
    extra = {"compile_backend": "aot_eager"}
    assert compile_switch.apply(model, "layers", extra) == CFG.num_hidden_layers
    assert compile_switch.compiled(model) == ["model.layers.0", "model.layers.1"]
    assert list(model.model.layers) == layers and list(model.state_dict()) == keys
    assert hook.id in model.model.layers[0]._forward_hooks
    assert compile_switch.apply(model, True, extra) == CFG.num_hidden_layers  # = "layers"
    assert compile_switch.apply(model, "model", extra) == 1
    assert compile_switch.compiled(model) == [""]
    assert list(model.state_dict()) == keys
    assert compile_switch.apply(model, False) == 0
    assert compile_switch.compiled(model) == []


def test_applying_again_never_nests(graphs):
    """Switches applied again remove the earlier compilation first: layers then model
    leaves only the model compiled (never a compiled layer inside a compiled model),
    the same switches twice compile the same modules once, and off is eager again,
    with the loss of a fresh eager model."""
    extra = {"compile_backend": graphs.backend}
    model = build_model(CFG, "cpu")
    fresh = build_model(CFG, "cpu")
    fresh.load_state_dict(model.state_dict())
    apply_switches(model, Switches(precision="fp32", enable_compile="layers", extra=extra))
    first = model.model.layers[0]._compiled_call_impl
    apply_switches(model, Switches(precision="fp32", enable_compile="layers", extra=extra))
    assert compile_switch.compiled(model) == ["model.layers.0", "model.layers.1"]
    assert model.model.layers[0]._compiled_call_impl is not first  # replaced, not wrapped
    apply_switches(model, Switches(precision="fp32", enable_compile="model", extra=extra))
    assert compile_switch.compiled(model) == [""]
    apply_switches(model, Switches.naive("fp32"))
    assert compile_switch.compiled(model) == []
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    assert len(graphs) == 0  # nothing ran compiled: applying compiles lazily
    check_close(model(ids, ids).detach(), fresh(ids, ids).detach(), name="loss", atol=0,
                rtol=0)


def test_bad_values_are_refused_before_anything_changes():
    model = build_model(CFG, "cpu")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="enable_compile='graphs'; choose"):
        apply_switches(model, Switches(enable_compile="graphs"))
    with pytest.raises(ValueError, match=r"extra\['compile_backend'\]='nope'"):
        apply_switches(model, Switches(enable_compile="layers",
                                       extra={"compile_backend": "nope"}))
    with pytest.raises(ValueError, match=r"extra\['compile_mode'\]='max-autotune' is an "
                                         "Inductor mode"):
        apply_switches(model, Switches(enable_compile="layers", extra={
            "compile_backend": "aot_eager", "compile_mode": "max-autotune"}))
    with pytest.raises(ValueError, match=r"extra\['compile_mode'\]='fast'"):
        apply_switches(model, Switches(enable_compile="model", extra={"compile_mode": "fast"}))
    assert [type(m) for m in model.modules()] == before and model.switches is None
    assert compile_switch.compiled(model) == []
    with pytest.raises(ValueError, match="no `layers` list; use 'model'"):
        apply_switches(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                       Switches(enable_compile="layers"))
    with pytest.raises(NotImplementedError, match="pipeline stages is not composed yet"):
        compile_switch.check_model(model, "layers", pp=2)
    compile_switch.check_model(model, False, pp=2)  # off: nothing to refuse


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's Triton interpreter")
def test_our_kernels_under_the_interpreter_are_refused():
    """Dynamo cannot trace an interpreted Triton kernel: refused with what to change."""
    with pytest.raises(ValueError, match="enable_fused_normalization=triton.*interpreter"):
        apply_switches(build_model(CFG, "cpu"), Switches(
            enable_fused_normalization="triton", enable_compile="layers",
            extra={"compile_backend": "aot_eager"}))


def _train_args(*flags):
    from colossal_lab.training import cli as cli_train

    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)
    return cli_train.switches_from(parser.parse_args(list(flags)))


def test_cli_flags_parse():
    sw = _train_args("--switches", "bf16", "--compile", "layers", "--compile-backend",
                     "aot_eager")
    assert sw.enable_compile == "layers" and sw.extra["compile_backend"] == "aot_eager"
    assert sw.precision == "bf16"  # the rest is the set's
    assert _train_args("--compile", "model").enable_compile == "model"
    assert _train_args("--compile", "true").enable_compile is True
    assert _train_args("--switches", "best", "--compile", "off").enable_compile is False
    assert _train_args("--switches", "best").enable_compile is False  # not in best yet
    assert _train_args("--switches", "best").enable_fused_embedding is True
    assert _train_args("--embedding", "off").enable_fused_embedding is False
    assert _train_args("--switches", "naive", "--embedding", "triton",
                       "--rope", "triton").enable_fused_embedding == "triton"


def test_cli_trains_compiled(capsys, graphs):
    """`train --compile layers` end to end: bf16 autocast, two steps, the layers
    compiled (one graph for both), a finite loss."""
    from torch._dynamo.utils import counters

    from colossal_lab.__main__ import main

    counters.clear()
    main(["train", "--switches", "bf16", "--compile", "layers", "--compile-backend",
          "aot_eager", "--data", "random", "--steps", "2", "--batch", "2", "--seq-len",
          "16", "--log-every", "1"])
    out = capsys.readouterr().out
    loss = float(out.split("final loss ")[1].split()[0].rstrip(","))
    assert loss == loss and 0 < loss < 10
    assert counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------- benchmarks


def test_benchmark_setups():
    """ours-bf16-compile is best + compiled layers (best itself is unmeasured with it);
    torchao's peer compiles; every setup survives its JSON round trip (the child
    process rebuilds it from there)."""
    by = {s.name: s for s in composed.SETUPS}
    names = list(by)
    assert names.index("ours-bf16-compile") == names.index("ours-bf16") + 1
    assert by["ours-bf16-compile"].switches == SWITCH_SETS["best"].replace(
        enable_compile="layers")
    for s in (by["hf-torchao-fp8"], *[w for w in waterfall.SETUPS if w.torchao_fp8]):
        assert s.impl == "hf" and s.compile and s.switches.precision == "bf16"
    for s in (*composed.SETUPS, *waterfall.SETUPS):
        assert steps.Setup.from_json(s.to_json()) == s


def test_setup_rules():
    """Setups that cannot work are refused when declared: two compilations of one model;
    torchao's float8 without compile, on our model, or outside bf16 autocast."""
    with pytest.raises(ValueError, match="compile=True wraps the model.*choose one"):
        steps.Setup("c", "c", switches=Switches(enable_compile="layers"), compile=True)
    with pytest.raises(ValueError, match="torchao_fp8 needs compile=True"):
        steps.Setup("t", "t", "hf", torchao_fp8=True)
    with pytest.raises(ValueError, match="impl='hf'"):
        steps.Setup("t", "t", "ours", compile=True, torchao_fp8=True)
    with pytest.raises(ValueError, match="bf16 autocast"):
        steps.Setup("t", "t", "hf", switches=Switches.naive("fp32"), compile=True,
                    torchao_fp8=True)
    with pytest.raises(ValueError, match="torchao_recipe='blockwise'"):
        steps.Setup("t", "t", "hf", compile=True, torchao_fp8=True,
                    torchao_recipe="blockwise")


def test_torchao_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now fails
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    setup = next(s for s in composed.SETUPS if s.name == "hf-torchao-fp8")
    with pytest.raises(ImportError, match=r"install torchao \(make wheelhouse carries it\)"):
        steps.build(setup, "tiny", torch.device("cpu"))


def test_torchao_converts_the_linears_it_can():
    """Every linear whose dims are multiples of 16 becomes torchao's Float8Linear (the
    tiny model's q/k/v/o, 64 and 32 wide); the MLP (172 wide) and the head stay."""
    pytest.importorskip("torchao.float8")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(CFG.to_hf(), attn_implementation="sdpa")
    assert steps.convert_torchao_float8(hf) == 4 * CFG.num_hidden_layers
    f8 = {n for n, m in hf.named_modules() if type(m).__name__ == "Float8Linear"}
    assert f8 == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(CFG.num_hidden_layers)
                  for p in "qkvo"}
    assert type(hf.lm_head) is torch.nn.Linear


def test_torchao_rowwise_recipe_reaches_its_config():
    """`torchao_recipe="rowwise"`: the linears carry torchao's rowwise config (a scale a
    row of each operand), not the tensorwise one."""
    pytest.importorskip("torchao.float8")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(CFG.to_hf(), attn_implementation="sdpa")
    assert steps.convert_torchao_float8(hf, "rowwise") == 4 * CFG.num_hidden_layers
    f8 = [m for m in hf.modules() if type(m).__name__ == "Float8Linear"]
    kinds = {str(m.config.cast_config_input.scaling_granularity) for m in f8}
    assert kinds == {"ScalingGranularity.AXISWISE"}


def test_first_step_time_is_the_first_call_only():
    calls = []
    timed = steps.FirstCallTimer(lambda *a: calls.append(a) or len(calls), "cpu")
    assert timed.seconds is None
    assert timed(1) == 1 and timed(2) == 2 and calls == [(1,), (2,)]
    first = timed.seconds
    assert isinstance(first, float) and first >= 0
    timed(3)
    assert timed.seconds == first


def test_wheelhouse_keeps_torchao_and_drops_what_the_node_has():
    """The wheelhouse drops the node image's own packages by distribution name: torch,
    triton and the CUDA libraries go, torchao (a name that starts with "torch") stays."""
    from colossal_lab.wheelhouse import skipped

    assert skipped("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl")
    assert skipped("triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl")
    assert skipped("nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl")
    assert not skipped("torchao-0.17.0-cp310-abi3-manylinux_2_24_x86_64.whl")
    assert not skipped("liger_kernel-0.8.5-py3-none-any.whl")
    assert not skipped("pandas-2.3.3-cp312-cp312-manylinux_2_17_x86_64.whl")
