"""The device-side amax-history ring of fp8 delayed scaling (`ops.fp8._Scaler`,
`kernels.fp8_cast.advance_history`).

The ring's position is a (1,) int64 tensor and each cast's amax a persistent (1,) fp32
buffer, so a step captured as a CUDA graph writes a new slot each replay. The
bookkeeping must be the host-side ring's exactly: which slot gets which amax, the scale
from the history's max, evaluation moving nothing, a checkpointed recompute moving
nothing. `_host_ring_scaled` below is that host-side ring (a Python position, a fresh
zeroed amax per cast, a slice copy); models running it and models running the device
ring train side by side, compared bit for bit: outputs, gradients, histories,
positions. CPU: the GEMMs in emulation, the kernels under the Triton interpreter."""

import types

import pytest
import torch
import torch.nn as nn

from colossal_lab.config import Switches, tiny
from colossal_lab.kernels import fp8_cast
from colossal_lab.model import build_model
from colossal_lab.ops import fp8, fp8_mlp
from colossal_lab.ops.replay import current_replay
from colossal_lab.switches import fp8 as fp8_switch
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from tests.conftest import count_calls, requires_cuda

ROLES = ("x", "w", "grad")


# --------------------------------------------------------------------------- reference


def _host_ring_scaled(self, cast, amax, *, update, device):
    """`_Scaler.scaled` with the ring on the host: `self.ref_pos` a Python int, a
    freshly zeroed amax per delayed cast, `history[pos:pos+1].copy_(amax)`."""
    delayed = self.module.fp8_config.scaling == "delayed"
    amax_out = None
    replay = current_replay()
    recompute = replay is not None and replay.recomputing
    if recompute:
        src = replay.take(self)
    elif delayed and self.seen:
        src = self.history
        if update:
            amax_out = torch.zeros(1, dtype=torch.float32, device=device)
    else:
        src = amax_out = amax()
    if replay is not None and not recompute:
        replay.put(self, src.clone())
    out = cast(src, None if amax_out is src else amax_out)
    if delayed and not recompute and (update or not self.seen):
        self.history[self.ref_pos:self.ref_pos + 1].copy_(amax_out)
        self.ref_pos = (self.ref_pos + 1) % self.history.numel()
        self.seen = True
    return out


def _to_host_ring(modules):
    """Make every scaler of `modules` (Fp8Linears) run the host-ring reference."""
    for m in modules:
        for s in m._scalers.values():
            s.ref_pos = 0
            s.scaled = types.MethodType(_host_ring_scaled, s)


def _same_rings(device_mods, host_mods, what):
    assert len(device_mods) == len(host_mods) > 0
    for i, (d, h) in enumerate(zip(device_mods, host_mods)):
        for role in ROLES:
            sd, sh = d._scalers[role], h._scalers[role]
            where = f"{what}: module {i} role {role}"
            assert torch.equal(sd.history, sh.history), where
            assert sd.pos == sh.ref_pos and sd.seen == sh.seen, where
            assert sd.amax_out.item() == 0.0, where  # re-zeroed after every filing


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert torch.equal(a, b), what


# ------------------------------------------------------------------------------ kernel


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_advance_kernel_matches_torch(n, device):
    """The one-program kernel (the interpreter on CPU, compiled on the GPU) and the
    torch ops: the same history, position and amax after each of 2n+1 filings, with and
    without the reset."""
    out = {}
    for use in (True, False):
        hist = torch.zeros(n, device=device)
        pos = torch.zeros(1, dtype=torch.int64, device=device)
        amax, states = torch.zeros(1, device=device), []
        for k in range(2 * n + 1):
            amax.fill_(float(k + 1))
            fp8_cast.advance_history(hist, amax, pos, reset=k % 2 == 0, use_triton=use)
            states.append(tuple(t.to("cpu", copy=True) for t in (hist, pos, amax)))
        out[use] = states
    for k, ((h1, p1, a1), (h0, p0, a0)) in enumerate(zip(out[True], out[False])):
        assert torch.equal(h1, h0) and torch.equal(p1, p0) and torch.equal(a1, a0), k
        assert p0.item() == (k + 1) % n
        assert a0.item() == (0.0 if k % 2 == 0 else float(k + 1))
    # slot j holds the last amax filed there: k + 1 for the last k with k % n == j
    assert out[False][-1][0].tolist() == [float(max(k for k in range(2 * n + 1)
                                                    if k % n == j) + 1) for j in range(n)]


# ------------------------------------------------------------------------ Fp8Linear


@pytest.mark.parametrize("use_triton", [None, True], ids=["torch", "interpreter"])
def test_linear_matches_host_ring(use_triton):
    """An Fp8Linear with a ring of 3 over ten calls: the first in evaluation (dynamic,
    it starts the history), training steps, an outlier that saturates, evaluation in
    between (nothing moves): outputs, gradients and rings equal the host ring's."""
    cfg = fp8.Fp8Config(scaling="delayed", history_len=3, use_triton=use_triton)
    lin = nn.Linear(48, 32, bias=True)
    pair = []
    for _ in range(2):
        ref = nn.Linear(48, 32, bias=True)
        ref.load_state_dict(lin.state_dict())
        pair.append(fp8.Fp8Linear.from_linear(ref, cfg))
    dev, host = pair
    _to_host_ring([host])
    g = torch.Generator().manual_seed(0)
    plan = ["eval", "train", "train", "eval", "train", "big", "train", "eval", "train",
            "train"]
    for step, kind in enumerate(plan):
        x = torch.randn(5, 7, 48, generator=g) * (40.0 if kind == "big" else 1.0)
        dy = torch.randn(5, 7, 32, generator=g)
        outs = []
        for m in pair:
            m.weight.grad = m.bias.grad = None
            xi = x.clone().requires_grad_(kind != "eval")
            if kind == "eval":
                with torch.no_grad():
                    y = m(xi)
            else:
                y = m(xi)
                y.backward(dy)
            outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
        for a, b, name in zip(*outs, ("y", "dx", "dW", "db")):
            _same(a, b, f"step {step} ({kind}) {name}")
        _same_rings([dev], [host], f"step {step} ({kind})")
    assert dev._scalers["x"].pos == 8 % 3  # the evaluation start + seven training filings


def test_buffers_travel_and_stay_out_of_the_state_dict():
    """The ring's buffers are non-persistent (a plain nn.Linear loads the state dict),
    int64 positions survive a dtype change, and `.to()` carries them along."""
    f = fp8.Fp8Linear(32, 16, config=fp8.Fp8Config(scaling="delayed", history_len=4))
    assert set(f.state_dict()) == {"weight", "bias"}
    nn.Linear(32, 16).load_state_dict(f.state_dict())
    bufs = dict(f.named_buffers())
    for role in ROLES:
        assert bufs[f"amax_history_{role}"].shape == (4,)
        assert bufs[f"amax_pos_{role}"].dtype == torch.int64
        assert bufs[f"amax_out_{role}"].shape == (1,)
    f.to(torch.float64)
    assert f._scalers["x"].position.dtype == torch.int64
    assert f._scalers["x"].position is f.amax_pos_x


def test_scaling_state_round_trip_writes_the_device_position_in_place():
    cfg = fp8.Fp8Config(scaling="delayed", history_len=4)
    a = fp8.Fp8Linear(32, 16, config=cfg)
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(6):
        a(x).sum().backward()
    state = a.scaling_state()
    assert state == {r: {"pos": 6 % 4, "seen": True} for r in ROLES}
    assert all(type(st["pos"]) is int for st in state.values())
    b = fp8.Fp8Linear(32, 16, config=cfg)
    held = b.amax_pos_grad
    b.load_scaling_state(state)
    assert b.scaling_state() == state and b.amax_pos_grad is held


def test_first_delayed_cast_inside_a_capture_is_refused(monkeypatch):
    """The first delayed cast is dynamic and host-decided; captured, every replay would
    repeat it. A capture must come after one eager step."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    f = fp8.Fp8Linear(32, 16, config=fp8.Fp8Config(scaling="delayed"))
    with pytest.raises(RuntimeError, match="run one step eagerly before capturing"):
        f._scalers["x"].scaled(None, None, update=True, device=torch.device("cuda"))
    f._scalers["x"].seen = True  # after the eager step: the history is the source
    f.amax_history_x.fill_(1.0)
    out = f._scalers["x"].scaled(lambda src, amax_out: (src, amax_out), None,
                                 update=True, device=torch.device("cpu"))
    assert out[0] is f.amax_history_x and out[1] is f.amax_out_x


# ---------------------------------------------------------------------------- models


CASES = {  # name: (Switches changes, extra changes, the fused MLP runs)
    "composed": (dict(enable_fused_projections=True), {"fp8_fuse_mlp": False}, False),
    "fused-mlp": (dict(enable_fused_projections="triton"), {}, True),
    "fused-mlp-full-ckpt": (dict(enable_fused_projections="triton",
                                 gradient_checkpoint_config=GradientCheckpointConfig(
                                     mode="full")), {}, True),
    "composed-full-ckpt": (dict(gradient_checkpoint_config=GradientCheckpointConfig(
        mode="full")), {"fp8_fuse_mlp": False}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_host_ring(case, monkeypatch):
    """A small LLaMA (every linear fp8, rings of 3) over five SGD steps with an
    evaluation forward in between: loss, every gradient, every parameter and every ring
    equal those of the same model on the host ring, bit for bit; the fused MLP path
    (`ops.fp8_mlp`) and the checkpointed recompute (`ops.replay`) included."""
    changes, extra, fused = CASES[case]
    calls = count_calls(monkeypatch, fp8_mlp, "swiglu_fp8_forward")
    cfg = tiny().replace(intermediate_size=176)
    sw = Switches(precision="fp8", **changes,
                  extra={"fp8_scaling": "delayed", "fp8_backend": "emulate",
                         "fp8_history": 3, **extra})
    torch.manual_seed(0)
    models = [apply_switches(build_model(cfg, "cpu"), sw) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    mods = [fp8_switch.fp8_modules(m) for m in models]
    _to_host_ring(mods[1])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        ids = torch.randint(0, cfg.vocab_size, (2, 25), generator=g)
        if step == 2:  # evaluation: an output, no filing
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                evals = [m(ids[:, :-1], ids[:, 1:]) for m in models]
            assert torch.equal(*evals), step
            _same_rings(*mods, f"evaluation at step {step}")
        losses = []
        for m in models:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(ids[:, :-1], ids[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        _same_rings(*mods, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert mods[0][0]._scalers["grad"].pos == 5 % 3
    assert (calls["n"] > 0) == fused
