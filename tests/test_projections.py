"""Switch 3: fused projections equal the separate ones (outputs, every gradient), load
and save the separate (Hugging Face) state dict exactly, convert in place, and the
Triton SwiGLU matches silu(gate)·up. On a CPU the kernel runs under the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from colossal_lab.benchmarks import fused_qkv
from colossal_lab.benchmarks.steps import Setup
from colossal_lab.config import ModelConfig, Switches, tiny
from colossal_lab.model import MLP, Attention, RotaryEmbedding, build_model
from colossal_lab.ops import swiglu as projections
from colossal_lab.ops.swiglu import swiglu_fused_ref, swiglu_ref
from colossal_lab.switches import attention
from colossal_lab.switches import projections as projections_switch
from colossal_lab.switches.apply import apply_switches
from colossal_lab.testing.correctness import check_close
from tests.conftest import MODEL_CONFIGS, count_launches, requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CONFIGS = {k: MODEL_CONFIGS[k] for k in ("tiny-gqa", "gqa-6:2-odd", "mha-3", "mqa-tied")}
FUSED = ["eager", "triton"]  # the switch values; "compile" has its own test


def _attention(cfg, value):
    """One attention module (naive kernel) with the projections switch applied."""
    m = Attention(cfg)
    attention.apply(m, "naive")
    projections_switch.apply(m, value)
    return m


def _mlp(cfg, value):
    m = MLP(cfg)
    projections_switch.apply(m, value)
    return m


def _model(cfg, value, precision="fp32"):
    sw = Switches.naive(precision).replace(enable_fused_projections=value)
    return apply_switches(build_model(cfg, "cpu"), sw)


def _grads_in_hf_layout(model) -> dict[str, torch.Tensor]:
    """Parameter gradients under the separate names (fused ones split by rows)."""
    out = {}
    for name, p in model.named_parameters():
        mod = model.get_submodule(name.rsplit(".", 2)[0])
        if name.endswith("qkv_proj.weight"):
            parts, sizes = ("q_proj", "k_proj", "v_proj"), mod.qkv_sizes()
        elif name.endswith("gate_up_proj.weight"):
            parts, sizes = ("gate_proj", "up_proj"), [mod.down_proj.in_features] * 2
        else:
            out[name] = p.grad
            continue
        stem = name.rsplit(".", 2)[0]
        for part, g in zip(parts, p.grad.split(sizes)):
            out[f"{stem}.{part}.weight"] = g
    return out


# --------------------------------------------------------------------- Triton SwiGLU

SHAPES = [(1, 2), (5, 2 * 123), (3, 7, 2 * 100), (2, 2 * 1000), (3, 2 * 2100)]
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-3, 0.0),
          (torch.float16, 1e-4, 0.0)]


def _check_swiglu(fn, gu, dh, atol, rtol):
    """fn(gu) and d/d(gu) against the eager reference in fp32 and, for low precision,
    in gu's dtype (the 2x rule of `check_close`)."""
    x = gu.detach().clone().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x, dh)
    assert out.dtype == grad.dtype == gu.dtype

    def ref(dtype):
        r = gu.detach().to(dtype).requires_grad_()
        o = swiglu_fused_ref(r)
        return o, torch.autograd.grad(o, r, dh.to(dtype))[0]

    ref_out, ref_grad = ref(torch.float32)
    lp_out, lp_grad = ref(gu.dtype) if gu.dtype != torch.float32 else (None, None)
    check_close(out, ref_out, lp_out, name="h", atol=atol, rtol=rtol)
    check_close(grad, ref_grad, lp_grad, name="dgate_up", atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_swiglu_triton(shape, dtype, atol, rtol):
    gu = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    dh = torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).to(dtype)
    _check_swiglu(lambda t: projections.swiglu(t, "triton"), gu, dh, atol, rtol)


def test_swiglu_triton_strided_input_and_expanded_grad():
    """gate_up as a column slice of a wider matrix (row stride > 2i), and the stride-0
    gradient of `h.sum()`."""
    big = torch.randn(9, 300, device=DEVICE)
    gu = big[:, :2 * 70]
    dh = torch.ones(9, 1, device=DEVICE).expand(9, 70)
    _check_swiglu(lambda t: projections.swiglu(t[:, :], "triton"), gu, dh, 1e-5, 1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
def test_swiglu_triton_extreme_values():
    """σ(g) for |g| = 100: exp overflows to inf, no NaN; silu(−100) = 0, silu(100) = 100."""
    g = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]], device=DEVICE)
    gu = torch.cat([g, torch.full_like(g, 2.0)], dim=-1)
    _check_swiglu(lambda t: projections.swiglu(t, "triton"), gu, torch.ones_like(g),
                  1e-5, 1e-5)


def test_swiglu_saves_less_than_eager():
    """The Triton SwiGLU keeps only its input for the backward; eager also keeps
    silu(gate): T·i elements more."""
    t, i = 16, 40
    gu = torch.randn(t, 2 * i, device=DEVICE, requires_grad=True)
    eager = fused_qkv.saved_bytes(lambda: projections.swiglu(gu, "eager"))
    ours = fused_qkv.saved_bytes(lambda: projections.swiglu(gu, "triton"))
    assert ours == gu.numel() * 4 and eager == ours + t * i * 4


def test_eager_traffic_matches_docstring():
    """Eager on views moves 5·T·i·e bytes forward and 13·T·i·e backward (counted op by
    op), the fused kernels 3·T·i·e and 5·T·i·e: the table in `kernels.swiglu`."""
    t, i = 4096, 1024
    traffic = fused_qkv.eager_traffic(t, i, torch.bfloat16)
    n = t * i * 2
    assert traffic["fwd_bytes"] == 5 * n and traffic["bwd_bytes"] == 13 * n
    assert fused_qkv.swiglu_bytes(t, i) == (3 * n, 5 * n)


def test_swiglu_errors():
    with pytest.raises(ValueError, match="odd last dimension"):
        projections.swiglu(torch.randn(2, 5), "eager")
    with pytest.raises(ValueError, match="enable_fused_projections"):
        projections.swiglu(torch.randn(2, 4), "cudnn")
    from colossal_lab.kernels.swiglu import swiglu_triton

    with pytest.raises(ValueError, match="float32"):
        swiglu_triton(torch.ones(2, 4, dtype=torch.int32))


def test_swiglu_compile_matches_reference():
    pytest.importorskip("torch._inductor")
    gu = torch.randn(6, 2 * 24, device=DEVICE)
    dh = torch.randn(6, 24, device=DEVICE)
    _check_swiglu(lambda t: projections.swiglu(t, "compile"), gu, dh, 1e-5, 1e-5)


def test_triton_swiglu_runs_the_kernels(monkeypatch):
    """The "triton" switch value launches our SwiGLU kernels, forward and backward (on
    a CPU under the interpreter), inside a fused MLP."""
    from colossal_lab.kernels import swiglu as sk

    launches = count_launches(monkeypatch, sk._swiglu_forward_kernel,
                              sk._swiglu_backward_kernel)
    mlp = _mlp(CONFIGS["tiny-gqa"], "triton").to(DEVICE)
    mlp(torch.randn(2, 5, 64, device=DEVICE)).sum().backward()
    assert launches == {"_swiglu_forward_kernel": 1, "_swiglu_backward_kernel": 1}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "fallback"])
def test_triton_swiglu_without_gpu_or_interpreter(strict, monkeypatch):
    import colossal_lab.kernels
    from colossal_lab import switches

    monkeypatch.setattr(colossal_lab.kernels, "INTERPRET", False)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    if strict:
        with pytest.raises(switches.BackendUnavailable, match="TRITON_INTERPRET"):
            projections.resolve_activation("triton", "cpu")
        return
    monkeypatch.delenv(switches.STRICT_ENV)
    with pytest.warns(UserWarning, match="TRITON_INTERPRET=1; using 'eager'"):
        assert projections.resolve_activation("triton", "cpu") == "eager"


def test_resolve_activation():
    assert projections.resolve_activation(True, "cpu") == "eager"
    assert projections.resolve_activation(False) == "eager"
    assert projections.resolve_activation("compile", "cpu") == "compile"
    assert projections.resolve_activation("triton", DEVICE) == "triton"  # interpreter
    if torch.cuda.is_available():
        assert projections.resolve_activation(True, "cuda") == "triton"
    assert not projections.is_fused(False) and projections.is_fused("eager")
    with pytest.raises(ValueError, match="choose False"):
        projections.is_fused("fast")


# ------------------------------------------------------- fused modules equal separate


def _pair(module_fn, value):
    """A separate module and a fused one loaded from its state dict."""
    sep = module_fn(False)
    with torch.no_grad():
        for p in sep.parameters():
            p.normal_(0, 0.3)
    fused = module_fn(value)
    fused.load_state_dict(sep.state_dict())
    return sep, fused


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("value", FUSED)
def test_attention_fused_equals_separate(name, value):
    cfg = CONFIGS[name]
    sep, fused = _pair(lambda v: _attention(cfg, v), value)
    assert fused.fused and not sep.fused and type(fused.qkv_proj) is nn.Linear
    x = torch.randn(2, 11, cfg.hidden_size)
    cos, sin = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta)(11, x.device)
    for a, b in zip(fused.project_qkv(x), sep.project_qkv(x)):
        check_close(a, b, name="q/k/v", atol=1e-5, rtol=1e-5)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yf = sep(xs, cos, sin), fused(xf, cos, sin)
    check_close(yf, ys, name="out", atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(ys)
    ys.backward(dy)
    yf.backward(dy)
    check_close(xf.grad, xs.grad, name="dx", atol=1e-5, rtol=1e-5)
    w_grads = fused.qkv_proj.weight.grad.split(fused.qkv_sizes())
    for g, lin in zip(w_grads, (sep.q_proj, sep.k_proj, sep.v_proj)):
        check_close(g, lin.weight.grad, name="dW", atol=1e-5, rtol=1e-5)
    check_close(fused.o_proj.weight.grad, sep.o_proj.weight.grad, name="dWo", atol=1e-5,
                rtol=1e-5)


def test_fused_qkv_split_makes_no_copy():
    cfg = CONFIGS["gqa-6:2-odd"]
    attn = _attention(cfg, True)
    q, k, v = attn.project_qkv(torch.randn(2, 5, cfg.hidden_size))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() \
        == v.untyped_storage().data_ptr()
    assert [t.shape[-1] for t in (q, k, v)] == [96, 32, 32]


@pytest.mark.parametrize("name", ["tiny-gqa", "gqa-6:2-odd"])
@pytest.mark.parametrize("value", FUSED + ["compile"])
def test_mlp_fused_equals_separate(name, value):
    if value == "compile":
        pytest.importorskip("torch._inductor")
    cfg = CONFIGS[name]
    sep, fused = _pair(lambda v: _mlp(cfg, v), value)
    x = torch.randn(3, 7, cfg.hidden_size)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yf = sep(xs), fused(xf)
    check_close(yf, ys, name="out", atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(ys)
    ys.backward(dy)
    yf.backward(dy)
    check_close(xf.grad, xs.grad, name="dx", atol=1e-5, rtol=1e-5)
    dg, du = fused.gate_up_proj.weight.grad.split(cfg.intermediate_size)
    check_close(dg, sep.gate_proj.weight.grad, name="dWgate", atol=1e-5, rtol=1e-5)
    check_close(du, sep.up_proj.weight.grad, name="dWup", atol=1e-5, rtol=1e-5)
    check_close(fused.down_proj.weight.grad, sep.down_proj.weight.grad, name="dWdown",
                atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_has_separate_names_and_round_trips(name):
    """Fused modules save exactly the separate model's keys (same order, shapes) and
    load them back bit for bit, both ways."""
    cfg = CONFIGS[name]
    sep, fused = _model(cfg, False), _model(cfg, "eager")
    fused.load_state_dict(sep.state_dict())  # strict: names map both ways
    sd_sep, sd_fused = sep.state_dict(), fused.state_dict()
    assert list(sd_fused) == list(sd_sep)
    for k in sd_sep:
        assert sd_fused[k].shape == sd_sep[k].shape, k
        assert torch.equal(sd_fused[k], sd_sep[k]), k
    back = _model(cfg, False)
    back.load_state_dict(fused.state_dict())
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd_sep[k]), k
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in sd_fused)


def test_state_dict_views_share_the_fused_weight():
    """`state_dict()` hands out row views (no copy of a 7B model's projections);
    `hf_state_dict()` copies them so each tensor owns its storage (safetensors)."""
    m = _model(tiny(), "eager")
    w = m.model.layers[0].self_attn.qkv_proj.weight
    sd = m.state_dict()
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert q.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    hf = m.hf_state_dict()
    for k, v in hf.items():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size() \
            or k == "lm_head.weight", k
        assert torch.equal(v, sd[k])


def test_separate_model_loads_a_fused_checkpoint():
    """The load hook also splits `qkv_proj` / `gate_up_proj` keys (a checkpoint in the
    fused layout, e.g. from a model that stores it so)."""
    cfg = CONFIGS["gqa-6:2-odd"]
    fused = _model(cfg, "eager")
    raw = {k: v for k, v in fused.named_parameters()}  # fused names
    sep = _model(cfg, False)
    sep.load_state_dict(raw)
    for k, v in sep.state_dict().items():
        assert torch.equal(v, fused.state_dict()[k]), k


@pytest.mark.parametrize("name", ["tiny-gqa", "gqa-6:2-odd", "mqa-tied"])
@pytest.mark.parametrize("value", FUSED)
def test_logits_equal_transformers_with_fused_projections(name, value):
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    hf = transformers.LlamaForCausalLM(cfg.to_hf()).eval()
    ours = _model(cfg, value).eval()
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    with torch.no_grad():
        ref, out = hf(ids).logits, ours(ids)
    check_close(out, ref, name="logits", atol=2e-5, rtol=2e-5)
    # and back: to_hf() builds an equal Hugging Face model from the fused one
    with torch.no_grad():
        check_close(ours.to_hf().eval()(ids).logits, ref, name="to_hf", atol=2e-5,
                    rtol=2e-5)


def test_loss_and_grads_equal_transformers_with_fused_projections():
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS["gqa-6:2-odd"]
    hf = transformers.LlamaForCausalLM(cfg.to_hf())
    ours = _model(cfg, "triton")
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    hf_loss = hf(input_ids=ids, labels=ids).loss
    our_loss = ours(ids[:, :-1], ids[:, 1:])
    check_close(our_loss, hf_loss, name="loss", atol=1e-5, rtol=1e-5)
    hf_loss.backward()
    our_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for k, g in _grads_in_hf_layout(ours).items():
        check_close(g, hf_grads[k].grad, name=k[-20:], atol=1e-6, rtol=1e-4)


# --------------------------------------------------------- conversion in place, fp8 swap


def test_apply_converts_in_place_keeping_values():
    cfg = CONFIGS["gqa-6:2-odd"]
    m = _model(cfg, False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        ref = m(ids)
    apply_switches(m, Switches.naive("fp32").replace(enable_fused_projections="triton"))
    layer = m.model.layers[0]
    assert layer.self_attn.fused and layer.mlp.fused and layer.mlp.activation == "triton"
    assert [n for n, _ in layer.self_attn.named_children()] == ["qkv_proj", "o_proj"]
    assert [n for n, _ in layer.mlp.named_children()] == ["gate_up_proj", "down_proj"]
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        check_close(m(ids), ref, name="fused", atol=1e-5, rtol=1e-5)
    w = layer.self_attn.qkv_proj.weight
    apply_switches(m, Switches.naive("fp32").replace(enable_fused_projections="eager"))
    assert layer.self_attn.qkv_proj.weight is w  # a backend change does not restack
    apply_switches(m, Switches.naive("fp32"))
    assert [n for n, _ in layer.self_attn.named_children()] == ["q_proj", "k_proj",
                                                                 "v_proj", "o_proj"]
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert m.num_params() == _model(cfg, False).num_params()


class _Fp8LikeLinear(nn.Linear):
    """Stands in for the fp8 pass's Linear subclass: same weight Parameter."""


def _swap_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = _Fp8LikeLinear(child.in_features, child.out_features, bias=False,
                                     device="meta")
                new.weight = child.weight
                setattr(parent, name, new)


def test_linear_swap_keeps_hf_state_dict_and_blocks_conversion():
    """A pass that swaps every exact nn.Linear (fp8 training) swaps the fused ones too;
    the state dict keeps the Hugging Face names, and converting afterwards says why
    it cannot."""
    cfg = tiny()
    m = _model(cfg, "eager")
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    _swap_linears(m)
    assert type(m.model.layers[0].self_attn.qkv_proj) is _Fp8LikeLinear
    sd = m.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    m.load_state_dict(ref)
    with pytest.raises(TypeError, match="before swapping"):
        projections_switch.apply(m, False)


# ------------------------------------------------------------------------ benchmark


@pytest.fixture(scope="module")
def bench_rows(few_cpu_reps):
    return fused_qkv.run(quick=True)


def test_benchmark_quick_rows(bench_rows):
    gemm = [r for r in bench_rows if r["kind"] == "gemm"]
    assert {r["provider"] for r in gemm} == set(fused_qkv.GEMM_PROVIDERS)
    assert {r["proj"] for r in gemm} == {"qkv", "gate_up"}
    for r in gemm:
        assert "error" not in r, r
        for f in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                  "fwd_bwd_speedup", "fwd_bwd_eager_ms"):
            assert r[f] > 0, (f, r)
    sw = [r for r in bench_rows if r["kind"] == "swiglu"]
    assert {r["provider"] for r in sw} == {"eager", "triton"}
    for r in sw:
        assert "error" not in r and r["fwd_bwd_gbps"] > 0 and r["saved_bytes"] > 0, r
    assert [r for r in bench_rows if r["kind"] == "ceiling"][0]["copy_gbps"] > 0
    assert not [r for r in bench_rows if r["kind"] == "step"]  # its own benchmark now
    assert "speed-up over separate" in fused_qkv.summary(bench_rows)
    import json

    json.dumps(bench_rows)


def test_step_benchmark_quick_rows():
    from colossal_lab.benchmarks import fused_qkv_step

    rows = fused_qkv_step.run(quick=True)
    assert [r["setup"] for r in rows] == [s.name for s in fused_qkv.SETUPS]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    assert [r["swiglu_backend"] for r in rows] == ["eager", "eager", "triton"]


def test_benchmark_setups_and_shapes():
    """The step setups differ in switch 3 only; the GEMM shapes are the presets'."""
    sw = [s.switches for s in fused_qkv.SETUPS]
    assert all(s.replace(enable_fused_projections=False) == sw[0] for s in sw)
    assert [s.enable_fused_projections for s in sw] == [False, "eager", "triton"]
    assert fused_qkv.MODELS["llama-7b"].sizes("qkv") == [4096] * 3
    assert fused_qkv.MODELS["1b"].sizes("qkv") == [2048, 256, 256]
    assert fused_qkv.MODELS["1b"].sizes("gate_up") == [5632, 5632]
    for s in fused_qkv.SETUPS:  # what the child process of each step setup receives
        assert Setup.from_json(s.to_json()) == s


# ----------------------------------------------------------------------------- GPU only


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 2 * 11008), (4096, 2 * 5632)], ids=str)
def test_swiglu_triton_bf16_on_gpu(shape):
    gu = (torch.randn(shape, device="cuda") * 3).to(torch.bfloat16)
    dh = torch.randn(shape[0], shape[1] // 2, device="cuda").to(torch.bfloat16)
    _check_swiglu(lambda t: projections.swiglu(t, "triton"), gu, dh, 1e-3, 0.0)


@requires_cuda
@pytest.mark.gpu
def test_fused_step_matches_separate_on_gpu():
    """bf16 autocast, llama-7b layer shape scaled down to 2 layers: the loss of one
    step agrees, fused + Triton SwiGLU against separate."""
    cfg = ModelConfig(vocab_size=1024, num_hidden_layers=2, num_key_value_heads=8)
    base = Switches(enable_flash_attention=True)
    sep = apply_switches(build_model(cfg, "cuda"), base)
    fused = apply_switches(build_model(cfg, "cuda"),
                           base.replace(enable_fused_projections="triton"))
    fused.load_state_dict(sep.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ls, lf = sep(ids, ids), fused(ids, ids)
    check_close(lf.float(), ls.float(), name="loss", atol=2e-2)


def test_swiglu_ref_is_silu_times_up():
    g, u = torch.randn(4, 5), torch.randn(4, 5)
    check_close(swiglu_ref(g, u), g * torch.sigmoid(g) * u, atol=1e-6)
