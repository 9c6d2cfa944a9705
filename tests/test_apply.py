"""`apply_switches`: a plain model, every switch applied by its own function in one
documented order, swapped in place with no rebuild, and precision decided in one module."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

import colossal_lab
from colossal_lab import model as model_mod
from colossal_lab import precision
from colossal_lab.config import Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import apply as apply_mod
from colossal_lab.switches import checkpointing, fp8
from colossal_lab.switches import precision as precision_switch
from colossal_lab.switches.apply import ORDER, apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig as Ckpt
from colossal_lab.testing.correctness import check_close
from colossal_lab.training import optimizer, train

PACKAGE = pathlib.Path(colossal_lab.__file__).parent
CFG = tiny().replace(intermediate_size=176)  # every width a multiple of 16: fp8 takes all


def test_no_model_constructor_takes_switches():
    """The model is plain: no constructor in model.py has a switches parameter."""
    classes = [c for _, c in inspect.getmembers(model_mod, inspect.isclass)
               if c.__module__ == model_mod.__name__]
    assert len(classes) >= 6
    for cls in classes:
        params = inspect.signature(cls.__init__).parameters.values()
        for p in params:
            assert "switch" not in p.name.lower(), (cls.__name__, p.name)
            assert "Switches" not in str(p.annotation), (cls.__name__, p.name)
    imported = {a.asname or a.name for node in ast.walk(ast.parse(inspect.getsource(model_mod)))
                if isinstance(node, ast.ImportFrom) for a in node.names}
    assert "Switches" not in imported and "apply_switches" not in imported


def test_build_model_refuses_switches_as_device():
    with pytest.raises(TypeError, match="apply_switches"):
        build_model(CFG, Switches())


def test_order_is_the_documented_one(monkeypatch):
    """Each switch goes through its own module's `apply`, in `ORDER`, precision last."""
    assert ORDER == ("enable_flash_attention", "enable_fused_rope",
                     "enable_fused_normalization", "enable_fused_projections",
                     "enable_fused_cross_entropy", "enable_fused_embedding",
                     "gradient_checkpoint_config", "precision", "enable_compile",
                     "overlap_communication")
    doc = apply_mod.__doc__  # lists each switch's function in the same order
    where = [doc.index(f"{m}.apply") for m in
             ("switches.attention", "switches.rope", "switches.norm",
              "switches.projections", "switches.loss", "switches.embedding",
              "switches.checkpointing", "switches.precision", "switches.compile",
              "parallel.data_parallel")]
    assert where == sorted(where)
    calls = []

    def spy(name, fn):
        def wrapped(model, value, *args, **kw):
            calls.append(name)
            return fn(model, value, *args, **kw)
        return wrapped

    for field, fn in list(apply_mod._APPLY.items()):
        monkeypatch.setitem(apply_mod._APPLY, field, spy(field, fn))
    monkeypatch.setattr(precision_switch, "apply", spy("precision", precision_switch.apply))
    monkeypatch.setattr(apply_mod.compile_switch, "apply",
                        spy("enable_compile", apply_mod.compile_switch.apply))
    monkeypatch.setattr(apply_mod.data_parallel, "apply",
                        spy("overlap_communication", apply_mod.data_parallel.apply))
    apply_switches(build_model(CFG, "cpu"), Switches(True, True, True, "fp32", Ckpt(),
                                                     enable_fused_rope=True,
                                                     enable_fused_cross_entropy=True,
                                                     enable_fused_embedding=True))
    assert tuple(calls) == ORDER


SWAPS = [
    Switches.naive("fp32"),
    Switches("sdpa", "torch", "eager", "fp32"),
    Switches("sdpa", "torch", "eager", "fp32", Ckpt(gradient_checkpointing_ratio=0.5)),
    Switches(False, False, False, "fp32", Ckpt(mode="selective")),
    Switches("sdpa", "triton", "triton", "fp32"),
    Switches("sdpa", "torch", "eager", "fp32", enable_fused_rope="triton",
             enable_fused_cross_entropy="triton", enable_fused_embedding="triton"),
]


@pytest.mark.parametrize("first,second", list(zip(SWAPS, SWAPS[1:] + SWAPS[:1])),
                         ids=lambda s: "-".join(str(v) for v in (
                             s.enable_flash_attention, s.enable_fused_normalization,
                             s.enable_fused_projections,
                             getattr(s.gradient_checkpoint_config, "mode", None))))
def test_swap_in_place_equals_a_fresh_model(first, second):
    """Applying `second` to a model that had `first` gives what applying `second` to a
    fresh plain model gives: the same loss, gradients and state dict."""
    torch.manual_seed(0)
    swapped = apply_switches(build_model(CFG, "cpu"), first)
    weights = {k: v.clone() for k, v in swapped.state_dict().items()}
    apply_switches(swapped, second)
    fresh = apply_switches(build_model(CFG, "cpu"), second)
    fresh.load_state_dict(weights)
    assert list(swapped.state_dict()) == list(fresh.state_dict()) == list(weights)
    assert checkpointing.checkpointed(swapped) == checkpointing.checkpointed(fresh)
    assert [type(m) for m in swapped.modules()] == [type(m) for m in fresh.modules()]
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (swapped, fresh):
        loss = m(ids, ids)
        loss.backward()
        losses.append(loss.detach())
    check_close(losses[0], losses[1], name="loss", atol=1e-6, rtol=1e-6)
    grads = [dict(m.named_parameters()) for m in (swapped, fresh)]
    for k, p in grads[1].items():
        check_close(grads[0][k].grad, p.grad, name=k, atol=1e-6, rtol=1e-5)
    assert swapped.switches == second


def test_precision_swaps_in_place():
    """fp32 -> fp8 -> bf16-pure -> bf16 on one model: linears become fp8 and back,
    parameters change dtype, buffers stay fp32, the values survive (rounded once)."""
    m = apply_switches(build_model(CFG, "cpu"), Switches.naive("fp32"))
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    apply_switches(m, Switches.naive("fp8"))
    n_linear = 7 * CFG.num_hidden_layers + 1
    assert len(fp8.fp8_modules(m)) == n_linear
    assert all(a is b for a, b in zip(m.parameters(), params))  # same Parameters
    apply_switches(m, Switches.naive("bf16-pure"))
    assert not fp8.fp8_modules(m)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are not weights
    assert isinstance(optimizer.make_optimizer(m), optimizer.MasterAdamW)
    apply_switches(m, Switches.naive("bf16"))
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    for k, v in m.state_dict().items():
        check_close(v, ref[k], name=k, atol=0, rtol=2**-8)  # one bf16 rounding
    assert precision.of(m) == "bf16"
    assert type(optimizer.make_optimizer(m)) is torch.optim.AdamW


@pytest.mark.parametrize("name", precision.PRECISIONS)
def test_step_asks_the_model_its_precision(name, monkeypatch):
    """`make_step` takes no precision: it uses the model's, through the precision
    module (autocast dtype inside the forward, a loss scaler only for fp16)."""
    m = apply_switches(build_model(CFG, "cpu"), Switches.naive(name))
    seen = []
    monkeypatch.setattr(train, "our_loss", lambda model, i, la: (
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                    else None), model(i, la))[1])
    step = train.make_step(m, optimizer.make_optimizer(m), train.our_loss)
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    step(ids, ids)
    pol = precision.policy(name)
    assert step.precision == name and seen == [pol.autocast_dtype]
    assert (step.scaler is not None) == pol.loss_scaling
    assert {p.dtype for p in m.parameters()} == {pol.param_dtype}


def test_plain_model_is_fp32():
    assert precision.of(build_model(CFG, "cpu")) == "fp32"


ASKS = {"precision", "precision_mod", "P"}
"""Names the precision module is imported as: calling through them is asking it."""


def _calls_outside(names: set[str], allowed: set[str]) -> list[str]:
    hits = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                asks = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") in ASKS
                if name in names and not asks:
                    hits.append(f"{rel}:{node.lineno} {name}")
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == "allow_tf32":
                        hits.append(f"{rel}:{node.lineno} allow_tf32")
    return hits


def test_precision_is_decided_in_one_module():
    """Autocast, TF32, loss scaling, master weights and the fp8 conversion are set up
    by `precision` (the policies), `switches.precision` (applied to a model) and
    `training.optimizer` (master weights) only. `ops.autocast_state` may only read the
    dtype precision chose and turn autocast off around a Function's own GEMMs (fp8
    linears, the fused loss); nothing else calls any of it. `measure.hardware` sets TF32
    around one measurement of the card's TF32 ceiling (restored after), which decides
    nothing about a step."""
    hits = _calls_outside({"autocast", "DynamicLossScaler", "MasterAdamW",
                           "convert_to_fp8", "GradScaler"},
                          allowed={"precision.py", "switches/precision.py",
                                   "training/optimizer.py", "ops/autocast_state.py",
                                   "measure/hardware.py"})
    assert hits == []
    state = (PACKAGE / "ops/autocast_state.py").read_text()
    calls = [n for n in ast.walk(ast.parse(state)) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", "") == "autocast"]
    assert len(calls) == 1 and [(k.arg, k.value.value) for k in calls[0].keywords] \
        == [("enabled", False)]


def test_errors_before_anything_changes():
    m = build_model(CFG, "cpu")
    before = [type(x) for x in m.modules()]
    with pytest.raises(ValueError, match="enable_flash_attention='flash3'"):
        apply_switches(m, Switches(enable_flash_attention="flash3"))
    with pytest.raises(ValueError, match="fp8_scaling='delayed'"):
        apply_switches(m, Switches(precision="fp8", extra={"fp8_scaling": "delayed"},
                                   gradient_checkpoint_config=Ckpt(mode="selective")))
    class Mesh:  # a DeviceMesh's shape, without a process group
        mesh_dim_names = ("pp", "dp", "tp")

        def __getitem__(self, dim):
            return type("Dim", (), {"size": lambda _: 2 if dim == "tp" else 1})()

    with pytest.raises(ValueError, match="tensor parallelism over tp=2 ranks: launch"):
        apply_switches(m, Switches(), mesh=Mesh())  # switch 5 needs a process group
    with pytest.raises(ValueError, match="make the mesh with tp > 1"):
        apply_switches(m, Switches(enable_sequence_parallelism=True))
    with pytest.raises(ValueError, match="launch with torchrun"):
        apply_switches(m, Switches(overlap_communication=True))
    assert [type(x) for x in m.modules()] == before and m.switches is None


def test_a_switch_nothing_takes_is_an_error():
    """A model without our attention or norm modules (here a bare MLP stack) cannot
    take a kernel switch: an error, not a silent no-op; the precision it can take."""
    other = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no module of this Sequential takes it"):
        apply_switches(other, Switches(enable_flash_attention=True))
    with pytest.raises(ValueError, match="no `layers` list"):
        apply_switches(other, Switches(gradient_checkpoint_config=Ckpt()))
    apply_switches(other, Switches.naive("bf16-pure"))
    assert other[0].weight.dtype == torch.bfloat16 and precision.of(other) == "bf16-pure"


def test_apply_under_torch_compile_wrapper():
    """A compiled model's switches are applied to the module inside the wrapper."""
    m = build_model(CFG, "cpu")
    compiled = torch.compile(m)
    apply_switches(compiled, Switches.naive("bf16"))
    assert m.switches.precision == "bf16" and precision.of(compiled) == "bf16"


def test_top_level_exports():
    assert colossal_lab.build_model is build_model
    assert colossal_lab.apply_switches is apply_switches
