"""fp8 linears: quantisation, scaling, the cast kernel, the GEMM wrapper, the layer's
output and gradients against the fp8 reference math and against bf16, and the rules for
which layers convert. On CPU the GEMMs run in emulation and the cast kernel under the
Triton interpreter (which it is checked against bit for bit)."""

import warnings

import pytest
import torch
import torch.nn as nn

from colossal_lab import switches
from colossal_lab.config import Switches, tiny
from colossal_lab.kernels import fp8_cast
from colossal_lab.model import build_model
from colossal_lab.ops import fp8
from colossal_lab.switches import fp8 as fp8_switch
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_calls, requires_cuda

FORMATS = (fp8.E4M3, fp8.E5M2)
MANTISSA = {"e4m3": 3, "e5m2": 2}


def test_format_constants():
    assert fp8.E4M3.max == 448.0 and fp8.E5M2.max == 57344.0


# ------------------------------------------------------------------------ quantisation


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 3e3])
@pytest.mark.parametrize("shape", [(7, 13), (64, 48), (1, 1000)])
def test_round_trip_error_is_half_an_ulp(fmt, magnitude, shape):
    """Dequantise(quantise(x)) is within half an fp8 spacing of x wherever x·scale is
    a normal fp8 number, and amax maps to the format's largest value."""
    x = torch.randn(*shape) * magnitude
    s = fp8.amax_to_scale(x.abs().amax(), fmt)
    q = fp8.quantize(x, s, fmt)
    assert q.dtype == fmt.dtype and torch.isfinite(q.float()).all()
    assert q.float().abs().max() == fmt.max
    back = fp8.dequantize(q, s)
    normal = (x * s).abs() >= torch.finfo(fmt.dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(MANTISSA[fmt.name] + 1) * (1 + 1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_representable_values_survive(fmt):
    everything = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    everything = everything[everything.isfinite()]
    q = fp8.quantize(everything, torch.tensor(1.0), fmt)
    assert torch.equal(q.float(), everything)


def test_saturation_and_zero_tensor():
    x = torch.tensor([1.0, -1000.0, 2000.0])
    q = fp8.quantize(x, torch.tensor(1.0), fp8.E4M3)  # a too-small amax: saturate
    assert q.float().tolist() == [1.0, -448.0, 448.0]
    z = torch.zeros(5)
    s = fp8.amax_to_scale(z.abs().amax(), fp8.E4M3)
    assert torch.isfinite(s) and fp8.quantize(z, s, fp8.E4M3).float().abs().sum() == 0


# ------------------------------------------------------------------------- cast kernel

SHAPES = [(37, 50), (64, 64), (5, 16), (1, 64), (70, 33), (130, 20)]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", ["dynamic", "history"])
def test_cast_kernel_matches_torch_bit_for_bit(dtype, shape, src):
    x = (torch.randn(*shape) * 5).to(torch.bfloat16)
    if src == "dynamic":
        amax = fp8_cast.fp8_amax(x, use_triton=True)
        assert torch.equal(amax, fp8_cast.fp8_amax(x))
        out_k = out_t = None
    else:  # delayed: a history smaller than the tensor's amax (saturates), amax out
        amax = torch.tensor([0.5, 3.0, 1.0])
        out_k, out_t = torch.zeros(1), torch.zeros(1)
    yk, ytk, ik = fp8_cast.fp8_cast_transpose(x, dtype, amax, amax_out=out_k,
                                              use_triton=True)
    yt_, ytt, it = fp8_cast.fp8_cast_transpose(x, dtype, amax, amax_out=out_t)
    assert torch.equal(yk.float(), yt_.float())  # (the interpreter writes -0 as +0)
    assert torch.equal(ytk.float(), ytt.float())
    assert ytk.shape == (shape[1], fp8_cast.padded(shape[0]))
    assert torch.equal(ytk[:, :shape[0]].float(), yk.float().t())
    assert ytk[:, shape[0]:].float().abs().sum() == 0  # zero padding
    assert torch.equal(ik, it)
    if out_k is not None:
        assert torch.equal(out_k, out_t) and out_k.item() == x.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_interpreter_rounding_is_round_half_even(dtype):
    """The kernel's fp32 pre-rounding equals torch's conversion on random values,
    exact ties and subnormals (scale 1: amax source = the format's max)."""
    top = torch.finfo(dtype).max
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # ties between neighbours
    x = torch.cat([mids, torch.randn(2000) * 10, torch.randn(500) * 1e-3,
                   torch.rand(500) * top]).reshape(1, -1)
    src = torch.tensor([top])
    yk, _, _ = fp8_cast.fp8_cast_transpose(x, dtype, src, write_yt=False, use_triton=True)
    yt, _, _ = fp8_cast.fp8_cast_transpose(x, dtype, src, write_yt=False)
    assert torch.equal(yk.float(), yt.float())  # equal values; the interpreter's -0 is +0
    assert torch.equal(yt.float(), x.to(dtype).float())


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_cast_kernel_without_gpu_or_interpreter(strict, monkeypatch):
    """use_triton=True on CPU tensors without the interpreter: torch ops, with a
    warning, or an error in strict mode."""
    import colossal_lab.kernels

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    x = torch.randn(8, 16)
    if strict:
        with pytest.raises(switches.BackendUnavailable, match="use_triton=True"):
            fp8_cast.fp8_amax(x, use_triton=True)
        return
    monkeypatch.delenv(switches.STRICT_ENV)
    with pytest.warns(UserWarning, match="using 'torch ops'"):
        assert torch.equal(fp8_cast.fp8_amax(x, use_triton=True), fp8_cast.fp8_amax(x))


def test_amax_kernel_spans_programs():
    n = fp8_cast.AMAX_BLOCK * fp8_cast.AMAX_ITERS + 123
    x = torch.randn(n)
    x[-5] = -40.0
    assert fp8_cast.fp8_amax(x, use_triton=True).item() == 40.0


# ------------------------------------------------------------------------ scaled_mm


def _operands(m=32, k=64, n=48):
    a = torch.randn(m, k).to(torch.float8_e5m2)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()  # column-major (k, n)
    return a, b, torch.tensor([0.5]), torch.tensor([2.0])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulation_matches_scaled_mm(out_dtype):
    """The emulation computes what torch._scaled_mm computes (its CPU kernel here)."""
    a, b, sa, sb = _operands()
    emu = fp8.scaled_mm(a, b, sa, sb, out_dtype, backend="emulate")
    real = fp8.scaled_mm(a, b, sa, sb, out_dtype, backend="scaled_mm")
    ref = (a.float() * 0.5) @ (b.float() * 2.0)
    check_close(emu, ref, atol=1e-4 if out_dtype == torch.float32 else 0.2)
    check_close(real.float(), emu.float(), atol=1e-4 if out_dtype == torch.float32 else 0.2)


def test_scaled_mm_layout_and_shape_rules():
    a, b, sa, sb = _operands()
    with pytest.raises(ValueError, match="column-major"):
        fp8.scaled_mm(a, b.contiguous(), sa, sb, torch.float32)
    with pytest.raises(ValueError, match="row-major"):
        fp8.scaled_mm(a.t().contiguous().t(), b, sa, sb, torch.float32)
    a2 = torch.randn(8, 40).to(torch.float8_e4m3fn)
    b2 = torch.randn(48, 40).to(torch.float8_e4m3fn).t()
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.scaled_mm(a2, b2, sa, sb, torch.float32)


def test_scaled_mm_old_tuple_convention(monkeypatch):
    """torch < 2.4 returned (out, amax); the wrapper returns the tensor either way."""
    a, b, sa, sb = _operands()
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm",
                        lambda *args, **kw: (real(*args, **kw), torch.zeros(())))
    out = fp8.scaled_mm(a, b, sa, sb, torch.float32, backend="scaled_mm")
    assert isinstance(out, torch.Tensor) and out.shape == (32, 48)


def test_clear_error_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(fp8, "_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match=r"8\.9.*sm_80"):
        fp8.check_fp8_supported("cuda")
    fp8.check_fp8_supported("cpu")  # the emulation runs anywhere


# ------------------------------------------------------------------- the fp8 linear

LINEAR_CASES = [((3, 11), 64, 48), ((16,), 32, 16), ((2, 7), 96, 160), ((5, 16), 48, 32)]


def _layer(k, n, bias=False, **cfg):
    lin = nn.Linear(k, n, bias=bias)
    return lin, fp8.Fp8Linear.from_linear(lin, fp8.Fp8Config(**cfg))


@pytest.mark.parametrize("lead,k,n", LINEAR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_reference_math(lead, k, n, bias):
    """Output and both gradients equal the plain-torch fp8 math (`fp8_linear_ref`) up
    to fp32 summation order; odd token counts exercise the padded transposes."""
    lin, f = _layer(k, n, bias)
    x = torch.randn(*lead, k, requires_grad=True)
    y = f(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = fp8.fp8_linear_ref(x.detach(), lin.weight.detach(), dy)
    if bias:
        y_ref = y_ref + lin.bias.detach()
        check_close(lin.bias.grad, dy.reshape(-1, n).sum(0), name="db", atol=1e-5)
    check_close(y, y_ref, name="y", atol=1e-5, rtol=1e-5)
    check_close(x.grad, dx_ref, name="dx", atol=1e-5, rtol=1e-5)
    check_close(lin.weight.grad, dw_ref, name="dw", atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("lead,k,n", LINEAR_CASES)
def test_fp8_error_bounded_by_bf16_error(lead, k, n):
    """Against an fp32 linear, fp8's error stays within a fixed multiple of bf16's:
    e4m3 has 4 fewer mantissa bits than bf16 (16x coarser), e5m2 5 (32x)."""
    lin, f = _layer(k, n)
    x = torch.randn(*lead, k, requires_grad=True)
    y = f(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w32 = lin.weight.detach().clone().requires_grad_()
    x32 = x.detach().clone().requires_grad_()
    y32 = x32 @ w32.t()
    y32.backward(dy)
    wb = lin.weight.detach().bfloat16().requires_grad_()
    xb = x.detach().bfloat16().requires_grad_()
    yb = xb @ wb.t()
    yb.backward(dy.bfloat16())
    check_close(y, y32, yb.float(), name="y", factor=32, atol=1e-3)
    check_close(x.grad, x32.grad, xb.grad.float(), name="dx", factor=64, atol=1e-3)
    check_close(lin.weight.grad, w32.grad, wb.grad.float(), name="dw", factor=64, atol=1e-3)


def test_autocast_dtypes():
    """Under bf16 autocast: y and dx bf16, dW in the (fp32) weight's dtype."""
    lin, f = _layer(64, 32)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32


def test_delayed_scaling_history():
    """First cast dynamic; later casts scale by the history's max; an outlier beyond it
    saturates once, enters the history, and the next cast scales for it."""
    lin, f = _layer(32, 16, scaling="delayed", history_len=3)
    x = torch.randn(8, 32)
    f(x)
    assert f.amax_history_x[0] == x.abs().max() and f.amax_history_x[1:].sum() == 0
    big = x * 10
    y_sat = f(big)  # scale from amax(x): most of big saturates
    assert torch.isfinite(y_sat).all()
    assert f.amax_history_x.max() == big.abs().max()
    y = f(big)  # now scaled for big: as good as dynamic
    check_close(y, fp8.fp8_linear_ref(big, lin.weight.detach()), atol=1e-5, rtol=1e-5)
    assert (y_sat - y).abs().max() > 1.0
    f(x), f(x)
    assert f._scalers["x"].pos == 2  # a ring of 3: 5 casts wrapped around
    with torch.no_grad():  # evaluation leaves the history alone
        before = f.amax_history_x.clone()
        f(big * 100)
    assert torch.equal(f.amax_history_x, before)


def test_delayed_gradient_history_updates():
    lin, f = _layer(32, 16, scaling="delayed")
    x = torch.randn(8, 32, requires_grad=True)
    for scale in (1.0, 2.0):
        (f(x) * scale).sum().backward()
    assert f.amax_history_grad[:2].tolist() == [1.0, 2.0]


# ------------------------------------------------------------------------- conversion


def test_convert_shares_parameters_and_state_dict(monkeypatch):
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())  # warned once per process: reset
    cfg = tiny()  # intermediate 172: the MLP linears cannot run in fp8
    m = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp32"))
    before = m.state_dict()
    params = {n: p for n, p in m.named_parameters()}
    with pytest.warns(UserWarning, match=r"mlp\.gate_proj \(64->172\)"):
        names = fp8_switch.convert_to_fp8(m)
    assert "lm_head" in names and "model.layers.0.self_attn.o_proj" in names
    assert not any("mlp" in n for n in names)
    assert type(m.model.layers[0].mlp.up_proj) is nn.Linear
    assert isinstance(m.lm_head, fp8.Fp8Linear)
    for n, p in m.named_parameters():
        assert p is params[n]
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_convert_skip_and_exact_type_only():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(32, 32), MyLinear(32, 32), nn.Linear(32, 16))
    names = fp8_switch.convert_to_fp8(model, skip=("2",))
    assert names == ["0"]
    assert type(model[1]) is MyLinear and type(model[2]) is nn.Linear


def test_fp8_model_trains_close_to_fp32():
    """A whole model in fp8 (every width a multiple of 16): loss at initialisation
    close to fp32's, every parameter gets a gradient."""
    cfg = tiny().replace(intermediate_size=176)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    torch.manual_seed(0)
    m32 = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may stay in bf16 here
        m8 = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp8"))
    m8.load_state_dict(m32.state_dict())
    assert len(fp8_switch.fp8_modules(m8)) == cfg.num_hidden_layers * 7 + 1
    l32 = m32(ids[:, :-1], ids[:, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l8 = m8(ids[:, :-1], ids[:, 1:])
    assert abs(l8.item() - l32.item()) < 0.02 * l32.item()
    l8.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m8.parameters())


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_full_checkpointing_recomputes_the_same_fp8(scaling, monkeypatch):
    """Full checkpointing runs each layer's forward twice. The recompute quantises with
    the scale of the original forward and leaves the amax histories alone, so over
    three SGD steps the loss, every gradient and every history equal those of the same
    model without checkpointing bit for bit (torch.equal: the CPU recompute repeats the
    same ops on the same inputs and scales), and each history advances once a step."""
    cfg = tiny().replace(intermediate_size=176)  # every linear fp8
    extra = {"fp8_scaling": scaling, "fp8_backend": "emulate", "fp8_history": 4}
    casts = count_calls(monkeypatch, fp8, "fp8_cast_transpose")
    models = [apply_switches(build_model(cfg, "cpu"),
                             Switches(precision="fp8", extra=extra,
                                      gradient_checkpoint_config=ckpt))
              for ckpt in (None, GradientCheckpointConfig(mode="full"))]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 33))
        losses, n_casts = [], []
        for m in models:
            casts["n"] = 0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(ids[:, :-1], ids[:, 1:])
            loss.backward()
            losses.append(loss.detach())
            n_casts.append(casts["n"])
        assert n_casts[1] > n_casts[0]  # the checkpointed layers did recompute
        assert torch.equal(losses[0], losses[1]), step
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        for a, b in zip(fp8_switch.fp8_modules(models[0]), fp8_switch.fp8_modules(models[1])):
            for role in ("x", "w", "grad"):
                assert torch.equal(a._scalers[role].history, b._scalers[role].history)
                if scaling == "delayed":
                    assert b._scalers[role].pos == step + 1, (step, role)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_config_from_switches_extra():
    c = fp8.Fp8Config.from_extra({"fp8_scaling": "delayed", "fp8_history": 4,
                                  "fp8_backend": "emulate"})
    assert (c.scaling, c.history_len, c.backend) == ("delayed", 4, "emulate")
    with pytest.raises(ValueError, match="dynamic"):
        fp8.Fp8Config(scaling="per-row")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.Fp8Linear(30, 32)


# ------------------------------------------------------------------------------- GPU


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape,in_dtype", [((1000, 4096), torch.bfloat16),
                                            ((512, 768), torch.float32),
                                            ((1000, 512), torch.float32)])
def test_cast_kernel_on_gpu(dtype, shape, in_dtype):
    x = (torch.randn(*shape, device="cuda") * 3).to(in_dtype)
    amax = fp8_cast.fp8_amax(x)
    assert amax.item() == x.float().abs().max().item()
    yk, ytk, ik = fp8_cast.fp8_cast_transpose(x, dtype, amax)
    yt_, ytt, it = fp8_cast.fp8_cast_transpose(x, dtype, amax, use_triton=False)
    assert torch.equal(ik, it)
    assert torch.equal(yk.view(torch.uint8), yt_.view(torch.uint8))
    assert torch.equal(ytk.view(torch.uint8), ytt.view(torch.uint8))


@requires_cuda
def test_fp8_linear_on_gpu_matches_emulation():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    lin = nn.Linear(4096, 1024, bias=False, device="cuda")
    x = torch.randn(4, 1000, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for backend in ("scaled_mm", "emulate"):
        f = fp8.Fp8Linear.from_linear(lin, fp8.Fp8Config(backend=backend))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = f(x)
        dy = torch.randn_like(y, generator=None) if not outs else outs[0][3]
        gx, gw = torch.autograd.grad(y, (x, lin.weight), dy)
        outs.append((y.float(), gx.float(), gw, dy))
    (y, gx, gw, _), (ye, gxe, gwe, _) = outs
    check_close(y, ye, atol=2e-2, rtol=1e-2)
    check_close(gx, gxe, atol=2e-2, rtol=1e-2)
    check_close(gw, gwe, atol=2e-2, rtol=1e-2)


def test_fp8_pure_keeps_bf16_parameters_with_fp32_masters():
    """"fp8-pure": the fp8 linears of "fp8" over "bf16-pure"'s storage: parameters and
    gradients in bf16, no autocast, the optimizer keeping fp32 masters; the loss at
    initialisation is fp32's within bf16 and fp8 rounding, and a step moves every
    parameter."""
    from colossal_lab import precision as P
    from colossal_lab.training import optimizer
    from colossal_lab.training.step import make_step

    cfg = tiny().replace(intermediate_size=176)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    torch.manual_seed(0)
    m32 = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp32"))
    m8 = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp8-pure"))
    m8.load_state_dict(m32.state_dict())
    assert P.policy("fp8-pure").master_weights and P.policy("fp8-pure").fp8
    assert {p.dtype for p in m8.parameters()} == {torch.bfloat16}
    assert len(fp8_switch.fp8_modules(m8)) == cfg.num_hidden_layers * 7 + 1
    l32 = m32(ids[:, :-1], ids[:, 1:])
    l8 = m8(ids[:, :-1], ids[:, 1:])
    assert abs(l8.item() - l32.item()) < 0.02 * l32.item()
    opt = optimizer.make_optimizer(m8)
    assert type(opt).__name__ == "MasterAdamW"  # torch's path on a CPU, with masters
    before = [p.detach().clone() for p in m8.parameters()]
    loss = make_step(m8, opt)(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(loss).all()
    # every fp32 master moved (a bf16 parameter may round back to where it was: a norm
    # weight of 1 moves by lr, under half its bf16 ulp)
    masters = [opt.state[p]["master"] for p in m8.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(not torch.equal(a.float(), m) for a, m in zip(before, masters))
