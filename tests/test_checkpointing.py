"""Switch 4: which layers are checkpointed, proof by FLOP count that exactly those are
recomputed (and that selective recomputation repeats no GEMM), gradients identical to no
checkpointing, the HFU/MFU accounting, the memory model, and the benchmark's quick mode."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from colossal_lab import precision as P
from colossal_lab.benchmarks import checkpointing as bench_ckpt
from colossal_lab.benchmarks import steps
from colossal_lab.config import ModelConfig, Switches, preset, tiny
from colossal_lab.measure import mfu
from colossal_lab.model import build_model
from colossal_lab.switches import checkpointing as ck
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig as Ckpt
from colossal_lab.testing.correctness import check_close
from colossal_lab.training import memory, train

MHA4 = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=100, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
GQA5 = ModelConfig(vocab_size=257, hidden_size=96, intermediate_size=172, num_hidden_layers=5,
                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128)


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize("ratio", [-0.1, 1.5, True, "0.5", float("nan")])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="gradient_checkpointing_ratio"):
        Ckpt(gradient_checkpointing_ratio=ratio)


def test_ratio_and_list_together_is_an_error():
    with pytest.raises(ValueError, match="not both"):
        Ckpt(gradient_checkpointing_ratio=0.5, num_ckpt_layers_per_stage=[1, 1])


@pytest.mark.parametrize("counts", [[], [1, -1], [1.5], [True]])
def test_bad_counts(counts):
    with pytest.raises(ValueError, match="num_ckpt_layers_per_stage"):
        Ckpt(num_ckpt_layers_per_stage=counts)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        Ckpt(mode="some")
    with pytest.raises(ValueError, match="mode"):
        ck.checkpoint(lambda x: x, torch.ones(1), mode="some")


def test_list_length_must_match_stages():
    c = Ckpt(num_ckpt_layers_per_stage=[2, 1])
    with pytest.raises(ValueError, match="exactly one entry"):  # no pipeline: one stage
        c.num_ckpt_layers(0, 1, 8)
    with pytest.raises(ValueError, match="3 .*stages"):
        c.num_ckpt_layers(0, 3, 8)
    with pytest.raises(ValueError, match="exactly one entry"):  # early: at model build
        apply_switches(build_model(tiny(), "cpu"),
                       Switches(precision="fp32", gradient_checkpoint_config=c))


def test_count_larger_than_stage():
    with pytest.raises(ValueError, match="holds only 3"):
        ck.checkpoint_plan(Ckpt(num_ckpt_layers_per_stage=[2, 4]), layers_per_stage=[5, 3])
    with pytest.raises(ValueError, match="holds only 2"):
        apply_switches(build_model(tiny(), "cpu"),
                       Switches(precision="fp32",
                                gradient_checkpoint_config=Ckpt(num_ckpt_layers_per_stage=[3])))


def test_stage_indices_checked():
    with pytest.raises(ValueError, match="stage=2"):
        Ckpt().num_ckpt_layers(2, 2, 4)
    with pytest.raises(ValueError, match="model_chunk_id"):
        Ckpt().num_ckpt_layers(0, 2, 4, model_chunk_id=1)


def test_resolve():
    assert ck.resolve(None) is None
    c = Ckpt(gradient_checkpointing_ratio=0.5, mode="selective")
    assert ck.resolve(c) is c
    assert ck.resolve({"gradient_checkpointing_ratio": 0.5, "num_ckpt_layers_per_stage": None,
                       "mode": "selective"}) == c
    with pytest.raises(TypeError, match="GradientCheckpointConfig"):
        ck.resolve(0.5)


# ---------------------------------------------------------------------- which layers


@pytest.mark.parametrize("ratio,n,expected", [(0.5, 8, 4), (0.25, 7, 1), (0.0, 5, 0),
                                              (1.0, 5, 5), (0.29, 100, 29), (0.7, 10, 7)])
def test_ratio_floors(ratio, n, expected):
    assert Ckpt(gradient_checkpointing_ratio=ratio).num_ckpt_layers(0, 1, n) == expected
    plan = ck.checkpoint_plan(Ckpt(gradient_checkpointing_ratio=ratio), n)
    assert plan == (True,) * expected + (False,) * (n - expected)  # the first ones


def test_no_config_and_default_config():
    assert ck.checkpoint_plan(None, 3) == (False,) * 3
    assert ck.checkpoint_plan(Ckpt(), 3) == (True,) * 3
    assert Ckpt().ratio == 1.0 and Ckpt(num_ckpt_layers_per_stage=[1]).ratio is None


def test_ratio_per_stage():
    plan = ck.checkpoint_plan(Ckpt(gradient_checkpointing_ratio=0.5), layers_per_stage=[3, 3, 2])
    assert plan == (True, False, False, True, False, False, True, False)


def test_colossalai_example_per_stage():
    """Example 1 of ColossalAI's PipelineGradientCheckpointConfig docstring."""
    per_stage = [9, 9, 9, 10, 11, 10, 11, 11]
    counts = [4, 4, 2, 2, 0, 0, 0, 0]
    plan = ck.checkpoint_plan(Ckpt(num_ckpt_layers_per_stage=counts), 80, per_stage)
    assert sum(plan) == 12
    start = 0
    for n, k in zip(per_stage, counts):
        assert plan[start:start + n] == (True,) * k + (False,) * (n - k)
        start += n


def test_interleaved_chunks():
    """Two stages, two chunks each: entry stage + chunk * num_stages, in model order."""
    c = Ckpt(num_ckpt_layers_per_stage=[1, 0, 2, 1])
    plan = ck.checkpoint_plan(c, layers_per_stage=[2, 2, 2, 2], num_model_chunks=2)
    assert plan == (True, False, False, False, True, True, True, False)
    assert c.num_ckpt_layers(1, 2, 2, model_chunk_id=1, num_model_chunks=2) == 1
    with pytest.raises(ValueError, match="multiple of num_model_chunks"):
        ck.checkpoint_plan(c, layers_per_stage=[2, 2, 2], num_model_chunks=2)


def test_split_layers():
    assert ck.split_layers(10, 4) == [3, 3, 2, 2]
    assert ck.split_layers(8, 1) == [8]
    with pytest.raises(ValueError):
        ck.split_layers(2, 3)
    with pytest.raises(ValueError, match="sums to"):
        ck.checkpoint_plan(Ckpt(), 9, ck.split_layers(10, 4))


def test_apply_to_a_pipeline_stage():
    """A pipeline stage holding a slice of the layers checkpoints the first of *its*;
    a later config takes the earlier one's wrapping away."""
    m = build_model(MHA4, "cpu")
    assert ck.apply(m, Ckpt(gradient_checkpointing_ratio=0.5)) == 2
    assert ck.checkpointed(m) == (True, True, False, False)
    m.model.layers = m.model.layers[:3]  # stage 1 of 2 after a split 1 + 3
    assert ck.apply(m, Ckpt(num_ckpt_layers_per_stage=[0, 1]), stage=(1, 2, 0, 1)) == 1
    assert ck.checkpointed(m) == (True, False, False)
    with pytest.raises(ValueError, match="2 entries for 1"):
        ck.apply(m, Ckpt(num_ckpt_layers_per_stage=[0, 1]))
    assert ck.apply(m, None) == 0 and ck.checkpointed(m) == (False,) * 3
    assert all("forward" not in layer.__dict__ for layer in m.model.layers)


# ------------------------------------------------------------------ FLOPs and gradients


def _step(cfg, conf, *, batch=2, seq=37, attn=False, norm=False, fused=False,
          precision="fp32"):
    """Forward + backward of a fresh model (same seed), counted; returns (total FLOPs,
    per-op FLOPs, gradients)."""
    torch.manual_seed(0)
    sw = Switches(precision=precision, enable_flash_attention=attn,
                  enable_fused_normalization=norm, enable_fused_projections=fused,
                  gradient_checkpoint_config=conf)
    model = apply_switches(build_model(cfg, "cpu"), sw)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        with P.autocast(precision, torch.device("cpu")):
            loss = model(ids, ids)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    per_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op, grads, loss.detach()


def _same_grads(grads, ref):
    assert grads.keys() == ref.keys()
    for k in ref:  # recomputation repeats the same ops: bit-identical
        check_close(grads[k], ref[k], name=k, atol=0.0, rtol=0.0)


CONFIGS = [Ckpt(gradient_checkpointing_ratio=0.5), Ckpt(gradient_checkpointing_ratio=0.25),
           Ckpt(), Ckpt(mode="selective"), Ckpt(mode="elementwise"),
           Ckpt(gradient_checkpointing_ratio=0.5, mode="selective")]


@pytest.mark.parametrize("conf", CONFIGS, ids=lambda c: f"{c.ratio}-{c.mode}")
@pytest.mark.parametrize("cfg,batch,seq,fused", [(MHA4, 2, 37, False), (GQA5, 1, 19, True)],
                         ids=["mha4", "gqa5-fused"])
def test_recompute_is_exactly_the_checkpointed_layers(cfg, batch, seq, fused, conf):
    """Naive attention, fp32: the counted FLOPs grow by exactly the checkpointed layers'
    forward (less the last GEMM, which the non-reentrant checkpoint never reaches), by
    only their attention core with "selective", and gradients do not change."""
    base, base_ops, ref, ref_loss = _step(cfg, None, batch=batch, seq=seq, fused=fused)
    total, ops, grads, loss = _step(cfg, conf, batch=batch, seq=seq, fused=fused)
    # naive attention multiplies the full S×S: FlopCounterMode counts it non-causal
    extra = ck.recompute_flops(cfg, batch, seq, conf, causal=False, attention_backend="naive")
    assert total - base == extra
    n = sum(ck.checkpoint_plan(conf, cfg.num_hidden_layers))
    assert n == int(conf.ratio * cfg.num_hidden_layers + 1e-9)
    if conf.mode != "full":  # selective recomputes no GEMM at all
        assert ops["aten.mm"] == base_ops["aten.mm"]
    elif n:
        assert ops["aten.mm"] > base_ops["aten.mm"]
    check_close(loss, ref_loss, name="loss", atol=0.0, rtol=0.0)
    _same_grads(grads, ref)


def test_full_recompute_skips_only_the_last_gemm():
    """Counted by op: full recomputation of all L layers adds L × (layer GEMMs −
    down_proj) to aten.mm, and L × the attention bmm's forward to aten.bmm."""
    cfg, b, s = MHA4, 2, 37
    _, base_ops, _, _ = _step(cfg, None, batch=b, seq=s)
    _, ops, _, _ = _step(cfg, Ckpt(), batch=b, seq=s)
    f = ck.layer_forward_flops(cfg, b * s, s, causal=False)
    L = cfg.num_hidden_layers
    assert ops["aten.mm"] - base_ops["aten.mm"] == L * (f["gemm"] - f["last_gemm"])
    assert ops["aten.bmm"] - base_ops["aten.bmm"] == L * f["attention"]


def test_no_recompute_without_grad_or_in_eval():
    cfg = MHA4
    model = apply_switches(build_model(cfg, "cpu"),
                           Switches(precision="fp32", gradient_checkpoint_config=Ckpt()))
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    ref = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp32"))
    ref.load_state_dict(model.state_dict())
    check_close(model(ids), ref(ids), atol=0.0, rtol=0.0)
    model.eval()
    with FlopCounterMode(display=False) as a:
        model(ids, ids).backward()
    ref.eval()
    with FlopCounterMode(display=False) as b:
        ref(ids, ids).backward()
    assert a.get_total_flops() == b.get_total_flops()


@pytest.mark.parametrize("mode", ["full", "selective", "elementwise"])
@pytest.mark.parametrize("attn,norm", [("triton", "triton"), ("sdpa", "triton"),
                                       ("sdpa", False)])
def test_kernels_and_sdpa_under_recompute(mode, attn, norm):
    """Our Triton norm and attention (autograd Functions, interpreted here) and SDPA under
    full and selective recomputation: gradients identical; GEMM FLOPs as accounted
    (the FLOP counter does not see SDPA's CPU kernel or Triton's launches)."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=90,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64)  # head_dim 32: Triton attention runs
    base, _, ref, _ = _step(cfg, None, batch=2, seq=21, attn=attn, norm=norm)
    conf = Ckpt(mode=mode)
    total, _, grads, _ = _step(cfg, conf, batch=2, seq=21, attn=attn, norm=norm)
    assert total - base == ck.recompute_flops(cfg, 2, 21, conf, attention_backend=attn,
                                              attention_counted=False)
    _same_grads(grads, ref)


def test_bf16_autocast_gradients_identical():
    base, _, ref, _ = _step(GQA5, None, batch=2, seq=17, precision="bf16")
    for conf in (Ckpt(), Ckpt(mode="selective")):
        _, _, grads, _ = _step(GQA5, conf, batch=2, seq=17, precision="bf16")
        _same_grads(grads, ref)


def test_policy_recognises_gemms():
    aten = torch.ops.aten
    a, w = torch.ones(4, 8), torch.ones(8, 3)
    assert not ck.saves("full", aten.mm.default, (a, w))
    assert ck.saves("selective", aten.mm.default, (a, w))
    assert ck.saves("selective", aten.addmm.default, (torch.ones(3), a, w))
    assert not ck.saves("selective", aten.mm.default, (a, w), skip_gemm_k=8)
    assert ck.saves("selective", aten.mm.default, (a, w), skip_gemm_k=5)
    assert not ck.saves("selective", aten.bmm.default)  # naive attention: recomputed
    assert not ck.saves("selective", aten.mul.Tensor)
    if hasattr(aten, "_scaled_mm"):  # fp8 linears
        assert ck.saves("selective", aten._scaled_mm.default, (a, w))
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert ck.saves("elementwise", sdpa) and not ck.saves("selective", sdpa)


def test_last_gemm_k():
    model = apply_switches(build_model(MHA4, "cpu"), Switches(precision="fp32"))
    assert ck.last_gemm_k(model.model.layers[0]) == MHA4.intermediate_size
    same = MHA4.replace(intermediate_size=64)  # ambiguous with o_proj: keep every GEMM
    assert ck.last_gemm_k(apply_switches(build_model(same, "cpu"),
                                         Switches(precision="fp32")).model.layers[0]) is None
    assert ck.last_gemm_k(torch.nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------ accounting


def test_hfu_and_mfu_side_by_side():
    cfg = preset("llama-7b-8l")
    b, s = 4, 4096
    tokens = b * s
    t = 0.4
    none = mfu.step_stats(cfg, batch=b, seq_len=s, step_time_s=t, peak_tflops=989)
    stats = {m: mfu.step_stats(cfg, batch=b, seq_len=s, step_time_s=t, peak_tflops=989,
                               recompute_flops=ck.recompute_flops(cfg, b, s, Ckpt(mode=m)))
             for m in ck.MODES}
    for st in stats.values():  # recompute never changes MFU
        assert st.mfu == none.mfu and st.mfu_attn == none.mfu_attn
    assert none.hfu == pytest.approx(none.mfu_attn)
    assert stats["elementwise"].hfu == pytest.approx(none.mfu_attn)  # cuDNN output kept
    assert none.mfu_attn < stats["selective"].hfu < stats["full"].hfu
    f = ck.layer_forward_flops(cfg, tokens, s)
    full_extra = cfg.num_hidden_layers * (f["gemm"] - f["last_gemm"] + f["attention"])
    assert stats["full"].hfu * t * 989e12 == pytest.approx(
        mfu.model_flops(cfg, tokens, s) + full_extra)
    # 25 % of the step's matmul work is repeated: close to, but below, a full forward
    assert 1.2 < stats["full"].hfu / none.mfu_attn < 4 / 3
    half = ck.recompute_flops(cfg, b, s, Ckpt(gradient_checkpointing_ratio=0.5))
    assert half == pytest.approx(full_extra / 2)
    # ColossalAI's evaluator: 8N per token whenever checkpointing is on, whatever it does
    n = mfu.count_params(cfg)
    assert ck.colossalai_flops(cfg, tokens, True) == 8 * n * tokens
    assert ck.colossalai_flops(cfg, tokens, False) == 6 * n * tokens
    assert ck.colossalai_flops(cfg, tokens, True) > mfu.hardware_flops(
        cfg, tokens, s, recompute_flops=half)
    with pytest.raises(ValueError):
        mfu.hardware_flops(cfg, tokens, s, recompute_flops=-1.0)


def test_recompute_spec():
    spec = ck.recompute_spec(Ckpt(gradient_checkpointing_ratio=0.5), 8)
    assert (spec.layers, spec.fraction, spec.gemms, spec.attention) == (4, 0.5, True, True)
    sel = ck.recompute_spec(Ckpt(mode="selective"), 8)
    assert not sel.gemms and sel.attention
    assert not ck.recompute_spec(Ckpt(mode="elementwise"), 8, attention_backend="cudnn").attention
    assert ck.recompute_spec(Ckpt(mode="elementwise"), 8, attention_backend="triton").attention
    none = ck.recompute_spec(None, 8)
    assert none.layers == 0 and not none.gemms and not none.attention


def test_memory_model_per_layer():
    """The docstring's element counts for LLaMA-7B, and the reductions they promise."""
    cfg = preset("llama-7b")
    h, i = cfg.hidden_size, cfg.intermediate_size
    count = {m: sum(ck.activation_elements_per_token(cfg, m).values())
             for m in (None, *ck.MODES)}
    assert count[None] == 9 * h + 4 * i
    assert count["full"] == h
    assert count["selective"] == 5 * h + 2 * i
    assert count["elementwise"] == 6 * h + 2 * i
    assert round(count[None] * 2 / 1024) == 158  # KiB per token in bf16
    assert 1 - count["selective"] / count[None] == pytest.approx(0.475, abs=0.005)
    with pytest.raises(ValueError):
        ck.activation_elements_per_token(cfg, "other")
    gqa = sum(ck.activation_elements_per_token(preset("1b"), None).values())
    c = preset("1b")
    kv = c.num_key_value_heads * c.head_dim
    assert gqa == 6 * c.hidden_size + 2 * kv + 4 * c.intermediate_size + c.hidden_size


def test_memory_model_choices():
    mm = memory.MemoryModel(fixed_gib=100.0, per_sample_none_gib=22.0, per_sample_full_gib=3.0,
                        num_layers=32, capacity_gib=135.0)
    assert mm.largest_batch(0) == 1
    assert mm.largest_batch(32) == 11
    k = mm.min_ckpt_layers(2)
    assert mm.peak(2, k) <= 135.0 < mm.peak(2, k - 1)
    assert mm.min_ckpt_layers(20) is None
    assert memory.largest_batch(10.0, 2.0, 9.0) == 0
    assert memory.largest_batch(10.0, 0.5, 12.0) == 4
    with pytest.raises(ValueError):
        memory.largest_batch(1.0, 0.0, 2.0)


# ------------------------------------------------------------- benchmark machinery


def test_setup_json_round_trip():
    s = steps.Setup("x", "x", switches=Switches(gradient_checkpoint_config=Ckpt(
        num_ckpt_layers_per_stage=[2], mode="selective")), preset="llama-7b", batch=2,
        auto_ratio=True)
    back = steps.Setup.from_json(s.to_json())
    assert back == s
    assert isinstance(back.switches.gradient_checkpoint_config, Ckpt)
    json.loads(s.to_json())


class FakeProber:
    """Stands in for the GPU allocator. A step allocates `fixed` before the forward,
    activations of `none` (`full`) a sequence with no (every) layer checkpointed, and
    `grads` of gradients by the end of the backward: the peak is the larger of the
    backward's start (fixed + batch · activations) and its end (fixed + grads + batch ·
    full). Out of memory above `real_gib`."""

    available = True

    def __init__(self, model, cfg, seq_len, *, fixed=10.0, none=2.0, full=0.5, grads=0.0,
                 real_gib=30.0):
        self.model, self.cfg, self.seq_len = model, cfg, seq_len
        self.device = torch.device("cpu")
        self.setup = steps.Setup("fake", "fake", switches=Switches.naive("fp32"))
        self.loss_fn = train.our_loss
        self.fixed, self.none, self.full, self.real = fixed, none, full, real_gib
        self.grads = grads
        self.results = {}
        self.calls = []

    def __call__(self, batch):
        flags = ck.checkpointed(self.model)
        k, n = sum(flags), len(flags)
        act = batch * (self.none - k / n * (self.none - self.full))
        peak = max(self.fixed + act, self.fixed + self.grads + batch * self.full)
        self.calls.append((batch, k))
        if peak > self.real:
            raise torch.cuda.OutOfMemoryError("fake: out of memory")
        r = {"before": self.fixed, "peak": peak, "activation": peak - self.fixed,
             "saved": act, "per_layer": [0.1 * batch] * (n - 1)}
        self.results[batch] = r
        return r

    def fields(self, batch):
        return {"activation_mem_gib": self(batch)["activation"]}


def _timer(probe, opt):
    """What `steps.measure_one` hands `verify_largest_batch`: time the probe's model."""
    return lambda bs: steps.time_setup(probe.model, opt, probe.loss_fn, probe.setup,
                                       probe.cfg, "tiny", bs, seq_len=probe.seq_len,
                                       device=probe.device)


@pytest.fixture
def tiny_model():
    cfg = tiny()
    model = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    return cfg, model, train.make_optimizer(model)


def test_auto_ratio_picks_fewest_layers(tiny_model, monkeypatch):
    cfg, model, opt = tiny_model
    monkeypatch.setattr(memory, "capacity_gib", lambda: 13.5)
    probe = FakeProber(model, cfg, 16)
    out = memory.auto_ratio(probe, model, opt, batch=2)
    # none: 10 + 2·2 = 14 > 13.5; one of two layers: 10 + 2·1.25 = 12.5 fits
    assert out["auto_ratio_ckpt_layers"] == 1
    assert ck.checkpointed(model) == (True, False)
    assert model.switches.gradient_checkpoint_config.gradient_checkpointing_ratio == 0.5
    assert out["mem_fixed_gib"] == pytest.approx(10.0)
    assert out["mem_per_sample_none_gib"] == pytest.approx(2.0)
    assert out["mem_per_sample_full_gib"] == pytest.approx(0.5)
    assert probe.results == {}  # other configurations' probes are forgotten


def test_auto_ratio_two_peaks(tiny_model, monkeypatch):
    """Full LLaMA-7B with the exact optimizer on an H200, as measured: 75.4 GiB before
    the forward, 12.0 GiB of gradients, 18.7 GiB of activations a sequence with no layer
    checkpointed (0.76 with all). Without checkpointing the peak comes as the backward
    starts (112.8 GiB at batch 2, 131.5 at batch 3): the model predicts it, where one
    line from the all-checkpointed probes' intercept said 101 and 107."""
    cfg, model, opt = tiny_model
    monkeypatch.setattr(memory, "capacity_gib", lambda: 134.9)
    kw = dict(fixed=75.4, none=18.7, full=0.76, grads=12.0, real_gib=300.0)
    for batch, want_k, want_peak in ((2, 0, 75.4 + 2 * 18.7), (3, 0, 75.4 + 3 * 18.7)):
        probe = FakeProber(model, cfg, 16, **kw)
        out = memory.auto_ratio(probe, model, opt, batch=batch)
        assert out["auto_ratio_ckpt_layers"] == want_k
        assert out["predicted_peak_gib"] == pytest.approx(want_peak)
        assert out["mem_base_gib"] == pytest.approx(75.4)
        assert out["mem_fixed_gib"] == pytest.approx(75.4 + 12.0)
    probe = FakeProber(model, cfg, 16, **kw)  # batch 4: 150.2 GiB unless a layer recomputes
    out = memory.auto_ratio(probe, model, opt, batch=4)
    assert out["auto_ratio_ckpt_layers"] == 1  # of tiny's 2: 75.4 + 4 · 9.73 = 114.3
    assert out["predicted_peak_gib"] == pytest.approx(75.4 + 4 * (18.7 - (18.7 - 0.76) / 2))


def test_auto_ratio_counts_the_gradients_a_micro_batch_starts_with(tiny_model, monkeypatch):
    """Under gradient accumulation a micro-batch after the first starts with every
    gradient alive: the first peak's line starts at base + the parameters' bytes. A
    capacity between the two predictions flips the choice from none to one layer."""
    cfg, model, opt = tiny_model
    grads = sum(p.numel() * p.element_size() for p in model.parameters()) / memory.GIB
    kw = dict(fixed=75.4, none=18.7, full=0.76, grads=12.0, real_gib=300.0)
    monkeypatch.setattr(memory, "capacity_gib", lambda: 75.4 + 3 * 18.7 + grads / 2)
    out = memory.auto_ratio(FakeProber(model, cfg, 16, **kw), model, opt, batch=3)
    assert out["auto_ratio_ckpt_layers"] == 0 and "mem_grads_held_gib" not in out
    out = memory.auto_ratio(FakeProber(model, cfg, 16, **kw), model, opt, batch=3,
                            accumulating=True)
    assert out["auto_ratio_ckpt_layers"] == 1
    assert out["mem_grads_held_gib"] == pytest.approx(grads)
    assert out["mem_base_gib"] == pytest.approx(75.4 + grads)


def test_memory_model_two_peaks():
    """With `base`, the larger of the backward's start and its end; without, one line."""
    one = memory.MemoryModel(87.4, 18.7, 0.76, 32, 134.9)
    two = memory.MemoryModel(87.4, 18.7, 0.76, 32, 134.9, base_gib=75.4)
    assert one.peak(2, 0) == pytest.approx(87.4 + 37.4)
    assert two.peak(2, 0) == pytest.approx(75.4 + 37.4)  # the start: no gradients yet
    assert two.peak(2, 32) == pytest.approx(87.4 + 1.52)  # the end: every gradient
    assert two.min_ckpt_layers(3) == 0 and one.min_ckpt_layers(3) > 0
    assert [two.peak(4, k) for k in range(33)] == sorted(
        (two.peak(4, k) for k in range(33)), reverse=True)


def test_largest_batch_predicted_and_verified(tiny_model, monkeypatch):
    cfg, model, opt = tiny_model
    monkeypatch.setattr(memory, "capacity_gib", lambda: 20.0)
    probe = FakeProber(model, cfg, 16)
    row = {"batch": 2, "peak_mem_gib": None}
    out = memory.verify_largest_batch(probe, row, _timer(probe, opt))
    assert out["largest_batch_predicted"] == 5 and out["largest_batch"] == 5
    assert out["mem_per_sample_gib"] == pytest.approx(2.0)
    assert out["mem_fixed_gib"] == pytest.approx(10.0)
    assert out["largest_batch_tokens_per_s"] > 0 and out["largest_batch_mfu"] > 0
    assert out["layer_mem_per_sample_gib"] == pytest.approx(0.1)


def test_largest_batch_when_two_does_not_fit(tiny_model, monkeypatch):
    cfg, model, opt = tiny_model
    monkeypatch.setattr(memory, "capacity_gib", lambda: 100.0)
    probe = FakeProber(model, cfg, 16, real_gib=13.0)
    row = {"batch": 1, "peak_mem_gib": 12.0, "tokens_per_s": 5.0}
    out = memory.verify_largest_batch(probe, row, _timer(probe, opt))
    assert out["largest_batch"] == 1 and "out of memory" in out["largest_batch_note"]
    assert out["largest_batch_tokens_per_s"] == 5.0


def test_largest_batch_survives_a_failing_run(tiny_model, monkeypatch):
    """A verification run that fails (say, a kernel's size limit at a huge batch) becomes
    a note; the prediction is kept and nothing is raised."""
    cfg, model, opt = tiny_model
    monkeypatch.setattr(memory, "capacity_gib", lambda: 20.0)

    def broken(*args, **kwargs):
        raise RuntimeError("too many elements")

    monkeypatch.setattr(train, "measure_step", broken)
    probe = FakeProber(model, cfg, 16)
    out = memory.verify_largest_batch(probe, {"batch": 2, "peak_mem_gib": None},
                                      _timer(probe, opt))
    assert out["largest_batch_predicted"] == 5 and out["largest_batch"] is None
    assert "too many elements" in out["largest_batch_note"]


def test_measure_one_predicts_and_verifies_the_largest_batch(monkeypatch):
    """`steps.measure_one`'s GPU-only wiring (probes, then `verify_largest_batch` timing
    the same model), with the allocator faked so that it runs here."""
    monkeypatch.setattr(memory, "capacity_gib", lambda: 20.0)
    monkeypatch.setattr(memory, "Prober", lambda model, loss_fn, setup, cfg, seq_len,
                        device: FakeProber(model, cfg, seq_len))
    setup = steps.Setup("fake", "fake", switches=Switches.naive("fp32"),
                        find_largest_batch=True)
    row = steps.measure_one(setup, "tiny", 16, 2, progress=False)
    assert row["largest_batch_predicted"] == 5 and row["largest_batch"] == 5
    assert row["largest_batch_tokens_per_s"] > 0 and row["activation_mem_gib"] > 0
    assert row["hfu"] == pytest.approx(row["mfu_attn"])  # nothing recomputed


def test_memory_probe_is_empty_on_cpu():
    cfg = tiny()
    model = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert memory.memory_probe(model, train.our_loss, ids, ids) == {}


ROW_FIELDS = ("setup", "preset", "batch", "seq_len", "tokens_per_s", "mfu", "mfu_attn", "hfu",
              "mfu_colossalai", "peak_mem_gib", "activation_mem_gib", "ckpt_mode",
              "ckpt_layers", "ckpt_ratio", "recompute_tflop")


def test_benchmark_quick_mode():
    rows = bench_ckpt.run(quick=True)
    assert [r["setup"] for r in rows] == list(bench_ckpt.QUICK)
    by = {r["setup"]: r for r in rows}
    for r in rows:
        assert "error" not in r, r
        for f in ROW_FIELDS:
            assert f in r, (f, r)
        assert r["preset"] == "tiny" and r["tokens_per_s"] > 0
        assert r["hfu"] >= r["mfu_attn"] * (1 - 1e-12)
    assert by["ckpt-none"]["ckpt_layers"] == 0 and by["ckpt-none"]["hfu"] == pytest.approx(
        by["ckpt-none"]["mfu_attn"])
    assert by["ckpt-0.5"]["ckpt_layers"] == 1 and by["ckpt-0.5"]["hfu"] > by["ckpt-0.5"]["mfu_attn"]
    assert by["ckpt-selective"]["ckpt_mode"] == "selective"
    assert by["ckpt-none"]["mfu_colossalai"] == pytest.approx(by["ckpt-none"]["mfu"])
    assert by["ckpt-0.5"]["mfu_colossalai"] == pytest.approx(by["ckpt-0.5"]["mfu"] * 8 / 6)
    json.dumps(rows)


def test_benchmark_setups_declared():
    names = bench_ckpt.SETUP_NAMES
    assert len(set(names)) == len(names)
    full_7b = [s for s in bench_ckpt.SETUPS if s.preset == "llama-7b"]
    assert all(s.switches.precision == "bf16-pure" for s in full_7b)
    assert {s.name for s in bench_ckpt.SETUPS if s.find_largest_batch} == {
        s.name for s in bench_ckpt.SWEEP}
    assert all(s.iters >= 20 for s in bench_ckpt.SETUPS)
    # like for like at batch 2: none, selective, full differ in the checkpoint config only
    pair = {s.name: s for s in full_7b if s.batch == 2}
    assert set(pair) == {"7b-none-b2", "7b-selective", "7b-full"}
    plain = [s.switches.replace(gradient_checkpoint_config=None) for s in pair.values()]
    assert all(p == plain[0] for p in plain)
    assert "expandable_segments" in bench_ckpt.config_of()["allocator"]


class _CountOps(TorchDispatchMode):
    """How often each aten op ran (forward, recompute and backward together)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = str(func.overloadpacket)
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,attention_runs", [(None, 1), ("full", 2), ("selective", 2),
                                                 ("elementwise", 1)])
def test_attention_kernel_recomputed_or_kept(mode, attention_runs):
    """SDPA's kernel, which the FLOP counter cannot see on a CPU, counted by call: once per
    layer without recompute or when "elementwise" keeps its output, twice otherwise."""
    cfg = MHA4
    conf = None if mode is None else Ckpt(mode=mode)
    model = apply_switches(build_model(cfg, "cpu"),
                           Switches(precision="fp32", enable_flash_attention="sdpa",
                                    gradient_checkpoint_config=conf))
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with _CountOps() as ops:
        model(ids, ids).backward()
    runs = ops.counts.get("aten._scaled_dot_product_flash_attention_for_cpu", 0)
    assert runs == attention_runs * cfg.num_hidden_layers


def test_delayed_fp8_with_selective_recompute_is_a_clear_error():
    from colossal_lab.config import Switches, tiny
    from colossal_lab.model import build_model
    from colossal_lab.switches.checkpointing import GradientCheckpointConfig

    sw = Switches(precision="fp8", extra={"fp8_scaling": "delayed"},
                  gradient_checkpoint_config=GradientCheckpointConfig(mode="selective"))
    with pytest.raises(ValueError, match="fp8_scaling='dynamic'"):
        apply_switches(build_model(tiny(), "cpu"), sw)
    apply_switches(build_model(tiny(), "cpu"), sw.replace(extra={"fp8_scaling": "dynamic"}))
