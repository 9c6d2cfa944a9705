"""Our LLaMA equals Hugging Face's on the same weights, and its switches change nothing
but speed."""

import pytest
import torch

from colossal_lab import switches as switches_mod
from colossal_lab.config import ModelConfig, Switches, preset, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import BackendUnavailable, backends_in_use
from colossal_lab.switches.apply import apply_switches
from tests.conftest import MODEL_CONFIGS

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {k: MODEL_CONFIGS[k] for k in ("tiny-gqa", "mha-odd", "mqa-tied")}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seq_len", [1, 37, 64])
def test_logits_equal_transformers(name, seq_len):
    cfg = CONFIGS[name]
    hf = transformers.LlamaForCausalLM(cfg.to_hf()).eval()
    ours = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32")).eval()
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert out.shape == ref.shape == (2, seq_len, cfg.vocab_size)
    err = (out - ref).abs().max().item()
    assert err < 2e-5 * max(1.0, ref.abs().max().item()), err


def test_loss_and_grads_equal_transformers():
    cfg = tiny()
    hf = transformers.LlamaForCausalLM(cfg.to_hf())
    ours = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    ours.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    hf_loss = hf(input_ids=ids, labels=ids).loss
    our_loss = ours(ids[:, :-1], ids[:, 1:])
    assert torch.allclose(hf_loss, our_loss, atol=1e-5), (hf_loss, our_loss)
    hf_loss.backward()
    our_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for k, p in ours.named_parameters():
        assert torch.allclose(p.grad, hf_grads[k].grad, atol=1e-5, rtol=1e-4), k


def test_state_dict_round_trip_is_exact():
    cfg = CONFIGS["mqa-tied"]
    a = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    hf = a.to_hf()
    b = apply_switches(build_model(cfg, "cpu"),
                       Switches(enable_flash_attention=True, enable_fused_normalization=True))
    b.load_hf_state_dict(hf.state_dict())
    for k, v in a.hf_state_dict().items():
        assert torch.equal(v, b.hf_state_dict()[k]), k
    assert set(a.hf_state_dict()) == {k for k in hf.state_dict() if "rotary" not in k}


def test_from_hf_config_round_trip():
    cfg = CONFIGS["mha-odd"]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("attn", ["sdpa", "sdpa-math", True])
@pytest.mark.parametrize("norm", ["torch", True])
def test_switches_keep_the_function(attn, norm):
    cfg = tiny()
    naive = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    fast = apply_switches(build_model(cfg, "cpu"),
                          Switches(enable_flash_attention=attn, enable_fused_normalization=norm,
                                   precision="fp32"))
    fast.load_state_dict(naive.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    l1, l2 = naive(ids, ids), fast(ids, ids)
    l1.backward()
    l2.backward()
    assert torch.allclose(l1, l2, atol=1e-5)
    g2 = dict(fast.named_parameters())
    for k, p in naive.named_parameters():
        assert torch.allclose(p.grad, g2[k].grad, atol=1e-5, rtol=1e-4), k


HEAD_DIM_32 = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1)  # head_dim 32: Triton attention runs


@pytest.mark.parametrize("switches,expected", [
    (Switches.naive("fp32"), ("naive", "eager", "eager", None)),
    (Switches(True, True, True, "fp32"), ("sdpa", "torch", "eager", None)),
    (Switches("triton", "triton", "triton", "fp32"), ("triton",) * 3 + (None,)),
    (Switches("sdpa-math", "compile", "eager", "fp8"), ("sdpa-math", "compile", "eager",
                                                        "emulate")),
    (Switches(False, "eager", "compile", "fp8", extra={"fp8_backend": "scaled_mm"}),
     ("naive", "eager", "compile", "scaled_mm")),
])
def test_backends_in_use(switches, expected):
    """What each switch resolves to on the model's device (here the CPU: "triton" runs
    under the interpreter, True means SDPA / torch / eager, fp8 "auto" emulates)."""
    if torch.cuda.is_available():
        pytest.skip("the expected names are the CPU's")
    m = apply_switches(build_model(HEAD_DIM_32, "cpu"), switches)
    keys = ("attention_backend", "norm_backend", "swiglu_backend", "fp8_backend")
    assert backends_in_use(m) == {**dict(zip(keys, expected)), "rope_backend": "eager",
                                  "loss_backend": "eager", "embedding_backend": "eager"}


def test_backends_in_use_after_fallback_and_a_swap(monkeypatch):
    """A backend that cannot run is recorded as what runs instead (strict mode: an
    error), and a switch swapped in place is seen."""
    m = apply_switches(build_model(tiny(), "cpu"), Switches.naive("fp32"))  # head_dim 16
    apply_switches(m, Switches.naive("fp32").replace(enable_flash_attention="triton"))
    with pytest.raises(BackendUnavailable, match="head_dim"):
        backends_in_use(m)
    monkeypatch.delenv(switches_mod.STRICT_ENV)
    monkeypatch.setattr("colossal_lab.fallback.WARNED", set())
    with pytest.warns(UserWarning, match="not 16; using 'sdpa'"):
        assert backends_in_use(m)["attention_backend"] == "sdpa"


def test_presets_and_bad_configs():
    assert preset("llama-7b-8l").num_hidden_layers == 8
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-5")
    with pytest.raises(ValueError, match="does not divide"):
        ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="not divisible"):
        ModelConfig(hidden_size=100, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match="precision"):
        Switches(precision="int4")


def _loss_and_backward(model, ids):
    """The next-token loss of `ids` (its gradients left in the parameters)."""
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach()


def test_fused_rope_loss_and_embedding_match_the_plain_model():
    """Our RoPE kernel, the chunked head + loss and our embedding backward, switched on
    in one model, give the plain model's loss and gradients (fp32; on the CPU the
    Triton kernels run under the interpreter), and the rows say which ran."""
    cfg = MODEL_CONFIGS["gqa-6:2-odd"]
    torch.manual_seed(0)
    plain = apply_switches(build_model(cfg, DEVICE), Switches.naive("fp32"))
    fused = apply_switches(build_model(cfg, DEVICE), Switches.naive("fp32").replace(
        enable_fused_rope="triton", enable_fused_cross_entropy="triton",
        enable_fused_embedding="triton", enable_fused_projections="eager"))
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    losses = [_loss_and_backward(m, ids) for m in (plain, fused)]
    assert torch.allclose(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    ref = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in fused.named_parameters():
        if n.endswith("qkv_proj.weight") or n.endswith("gate_up_proj.weight"):
            continue  # fused layout: compared through the state dict below
        assert torch.allclose(p.grad, ref[n], atol=1e-5, rtol=1e-4), n
    used = backends_in_use(fused)
    assert used["rope_backend"] == used["loss_backend"] == used["embedding_backend"] \
        == "triton"


@pytest.mark.parametrize("ckpt", [None, 0.5], ids=["stored", "half-checkpointed"])
def test_deferred_residual_adds_match_the_summed_stream(ckpt):
    """With a fusing norm the model hands each layer's last residual add to the next
    norm (`defer_residual`): the same loss and gradients as the layer summing it itself
    (fp32; on the CPU the Triton norm under the interpreter), with half the layers
    checkpointed too (their forward returns the pair through `checkpoint`)."""
    from colossal_lab.switches.checkpointing import GradientCheckpointConfig

    cfg = MODEL_CONFIGS["gqa-6:2-odd"]
    torch.manual_seed(0)
    sw = Switches.naive("fp32").replace(
        enable_fused_normalization="triton",
        gradient_checkpoint_config=None if ckpt is None else GradientCheckpointConfig(
            gradient_checkpointing_ratio=ckpt))
    deferred = apply_switches(build_model(cfg, DEVICE), sw)
    summed = apply_switches(build_model(cfg, DEVICE), sw)
    summed.model.defer_residual = False
    summed.load_state_dict(deferred.state_dict())
    assert deferred.model.defer_residual
    ids = torch.randint(0, cfg.vocab_size, (2, 23), device=DEVICE)
    losses = [_loss_and_backward(m, ids) for m in (deferred, summed)]
    assert torch.allclose(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    ref = dict(summed.named_parameters())
    for n, p in deferred.named_parameters():
        assert torch.allclose(p.grad, ref[n].grad, atol=1e-5, rtol=1e-4), n
    apply_switches(deferred, sw.replace(enable_fused_normalization=False))
    assert not deferred.model.defer_residual  # the eager norm sums in the layer again
