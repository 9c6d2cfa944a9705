"""The FLOP count is checked against PyTorch's own counter, not against itself."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from colossal_lab.config import ModelConfig, Switches, preset, tiny
from colossal_lab.measure import mfu
from colossal_lab.model import build_model
from colossal_lab.switches.apply import apply_switches

CFGS = [tiny(), ModelConfig(vocab_size=300, hidden_size=96, intermediate_size=200,
                            num_hidden_layers=3, num_attention_heads=3,
                            num_key_value_heads=1, max_position_embeddings=128)]


@pytest.mark.parametrize("cfg", CFGS, ids=["tiny", "mqa"])
@pytest.mark.parametrize("batch,seq_len", [(2, 37), (1, 64)])
def test_flops_match_flop_counter(cfg, batch, seq_len):
    model = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    assert counter.get_total_flops() == mfu.exact_matmul_flops(cfg, batch, seq_len)


def test_forward_only_is_a_third():
    cfg = tiny()
    model = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    assert 3 * counter.get_total_flops() == mfu.exact_matmul_flops(cfg, 2, 40)


@pytest.mark.parametrize("name", ["tiny", "1b", "llama-7b-8l", "llama-7b"])
def test_param_count_matches_the_model(name):
    cfg = preset(name)
    from colossal_lab.model import LlamaForCausalLM

    with torch.device("meta"):  # shapes only: no memory for 7B parameters
        model = LlamaForCausalLM(cfg)
    assert mfu.count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_known_sizes():
    assert round(mfu.count_params(preset("llama-7b")) / 1e9, 2) == 6.74
    assert round(mfu.count_params(preset("llama-7b-8l")) / 1e9, 2) == 1.88
    assert round(mfu.count_params(preset("1b")) / 1e9, 2) == 1.10


def test_causal_halves_attention_and_conventions():
    cfg = preset("llama-7b-8l")
    full = mfu.attention_flops_per_token(cfg, 4096, causal=False)
    assert full == 12 * 8 * 4096 * 4096
    assert mfu.attention_flops_per_token(cfg, 4096, causal=True) == full / 2
    assert mfu.attention_flops_per_token(cfg, 4096, backward=False, causal=False) == full / 3


def test_step_stats_and_hfu():
    cfg = preset("llama-7b-8l")
    n = mfu.count_params(cfg)
    tokens = 4 * 4096
    t = 6 * n * tokens / (0.5 * 989e12)  # a step that would be exactly 50% MFU (6N)
    s = mfu.step_stats(cfg, batch=4, seq_len=4096, step_time_s=t, peak_tflops=989)
    assert s.mfu == pytest.approx(0.5)
    assert s.mfu_attn > s.mfu
    assert s.hfu == pytest.approx(s.mfu_attn)
    full = mfu.step_stats(cfg, batch=4, seq_len=4096, step_time_s=t, peak_tflops=989,
                          recompute_fraction=1.0)
    # full recomputation repeats one forward: about a third more hardware FLOPs
    assert full.hfu / full.mfu_attn == pytest.approx(4 / 3, rel=0.05)
    assert full.mfu == s.mfu
    assert "N=1.88B" in str(s)
    with pytest.raises(ValueError):
        mfu.step_stats(cfg, batch=1, seq_len=8, step_time_s=0, peak_tflops=989)
    with pytest.raises(ValueError):
        mfu.hardware_flops(cfg, 10, 10, recompute_fraction=1.5)
