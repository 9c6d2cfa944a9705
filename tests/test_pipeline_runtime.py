"""Switch 7's runtime on gloo: every schedule's loss and gradients are those of the model
without a pipeline, on 2 and 4 processes, and so are torch.distributed.pipelining's on
the same model and batch; B and W really split; clear errors for what cannot run.

Processes are the expensive part (each imports torch), so one group of 2 and one of 4
run every case once per module (`two_ranks`, `four_ranks`, `pipeline.check.
check_schedules`) and the tests read their answers. Models: the tiny config with one
decoder layer per virtual stage (4 layers at p = 2, 8 at p = 4), fp32, m = 4
micro-batches of one sequence of 16 tokens.

**Tolerance, fp32** (`pipeline.check`): per parameter and for the loss,
``max|g − g_ref| <= 1e-6 + 1e-5 · max|g_ref|``. The pipeline adds the same terms as
one process in another order (m micro-batch means, then their mean; m backwards
accumulated), a few ulps apart: measured ~2e-8 against bounds of ~1.5e-6. A lost
micro-batch, a gradient routed to the wrong stage, a W run twice or a loss not divided
by m is off by O(|g|); with m = 4, by a quarter or more of the gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.parallel import distributed
from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.runtime import (
    DeferredLinear,
    PipelineRuntime,
    WeightGradStore,
    defer_weight_grads,
    restore_weight_grads,
)
from colossal_lab.parallel.pipeline.stages import Stage, StageError, build_stages, split_layers
from colossal_lab.switches import pipeline_parallel as ppl
from colossal_lab.switches.apply import apply_switches
from colossal_lab.testing.pipeline_check import (
    ATOL,
    RTOL,
    TORCH_PEERS,
    check_schedules,
    config_for,
)

NAMES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]
M = 4
TP_PP = [("1f1b", "all_reduce"), ("zbv", "split_gather"), ("zb-h1", "ring"),
         ("zbv", "all_reduce")]
"""pp = 2 × tp = 2 cases: every tensor-parallel mode ours, split and unsplit backward."""


def _cases(p: int) -> dict:
    cases = {("ours", n): ("ours", n, {"m": M}) for n in NAMES}
    cases[("ours-blocking", "1f1b")] = ("ours", "1f1b", {"m": M, "overlap_p2p": False})
    cases[("ours-blocking", "zbv")] = ("ours", "zbv", {"m": M, "overlap_p2p": False})
    cases.update({("torch", n): ("torch", n, {"m": M}) for n in TORCH_PEERS})
    return cases


CASES_2 = {**_cases(2),
           ("switches", "zbv pp=2"): ("switches", "zbv", {"pp": 2, "m": M})}
CASES_4 = {**_cases(4),
           ("switches", "zbv pp=2 dp=2"): ("switches", "zbv", {"pp": 2, "dp": 2, "m": M}),
           ("switches", "zbv pp=2 dp=2 overlap"): (
               "switches", "zbv", {"pp": 2, "dp": 2, "m": M, "dp_backend": True,
                                   "overlap_p2p": False}),
           ("switches", "interleaved pp=4"): ("switches", "interleaved", {"pp": 4, "m": M}),
           **{("switches", f"{style} pp=2 tp=2 {mode}"): (
               "switches", style, {"pp": 2, "tp": 2, "tp_mode": mode, "m": M})
              for style, mode in TP_PP}}


@pytest.fixture(scope="module")
def two_ranks():
    return distributed.spawn(check_schedules, 2, CASES_2, timeout_s=240)


@pytest.fixture(scope="module")
def four_ranks():
    return distributed.spawn(check_schedules, 4, CASES_4, timeout_s=240)


def _ranks(p, two_ranks, four_ranks):
    return two_ranks if p == 2 else four_ranks


def _verdict(v: dict) -> str:
    return (f"{v['name']} rank {v['rank']}: worst {v['worst']} err {v['err']:.2e} "
            f"bound {v['bound']:.2e}; loss {v['loss']:.7f} vs {v['ref_loss']:.7f}")


def _expected_counts(name: str, m: int) -> dict:
    chunks = 2 if name in ("interleaved", "zbv", "interleaved-zb") else 1
    split = name in ("zb-h1", "zbv", "interleaved-zb")
    return {"F": m * chunks, "B": m * chunks, **({"W": m * chunks} if split else {})}


# ------------------------------------------------------------------- ours, on gloo


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_one_process(p, name, two_ranks, four_ranks):
    ranks = _ranks(p, two_ranks, four_ranks)
    stages = []
    for v in (r[("ours", name)] for r in ranks):
        assert v["params"] > 0 and v["ok"], _verdict(v)
        assert v["loss_ok"], _verdict(v)
        assert v["counts"] == _expected_counts(name, M), v["counts"]
        stages += v["stages"]
    assert sorted(stages) == list(range(sch.make(name, p, M).num_stages))


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
@pytest.mark.parametrize("p", [2, 4])
def test_without_overlap_p2p_the_same(p, name, two_ranks, four_ranks):
    """Transfers waited where the schedule puts them: the same gradients, bit for bit
    (the same arithmetic in the same order; only the waiting moves)."""
    for r in _ranks(p, two_ranks, four_ranks):
        v, w = r[("ours-blocking", name)], r[("ours", name)]
        assert v["ok"] and v["loss_ok"], _verdict(v)
        assert (v["err"], v["loss"]) == (w["err"], w["loss"])


def test_zero_bubble_runs_w_after_b():
    """In the trace, each W of ZB-V comes after its B on the same rank, and some W wait
    past later forwards (what fills the bubbles)."""
    s = sch.zb_v(2, M)
    for prog in s.programs:
        at = {a: i for i, a in enumerate(prog)}
        assert all(at[sch.Action("W", a.mb, a.stage)] > i for i, a in enumerate(prog)
                   if a.kind == "B")
    assert any(at[sch.Action("W", a.mb, a.stage)] > at[sch.Action("F", a.mb + 1, a.stage)]
               for prog in s.programs for at in [{a: i for i, a in enumerate(prog)}]
               for a in prog if a.kind == "B" and a.mb + 1 < M)


# --------------------------------------------------------------- torch's, the same


@pytest.mark.parametrize("name", list(TORCH_PEERS))
@pytest.mark.parametrize("p", [2, 4])
def test_torch_pipelining_peer(p, name, two_ranks, four_ranks):
    """torch.distributed.pipelining's schedule on the same stages and batch: equal to
    one process, equal to ours, with the same number of F, B (or I) and W steps."""
    for r in _ranks(p, two_ranks, four_ranks):
        v = r[("torch", name)]
        if "skipped" in v:
            pytest.skip(v["skipped"])
        assert v["ok"] and v["loss_ok"], _verdict(v)
        want = _expected_counts(name, M)
        if "W" in want:  # torch calls the input-gradient backward "I"
            want["I"] = want.pop("B")
        assert v["counts"] == want
        if ("ours", name) in r:
            ours = r[("ours", name)]
            assert v["vs_ours"] <= ATOL + RTOL * 1.0, v["vs_ours"]
            steps = {k: n for k, n in v["counts"].items()}
            steps["B"] = steps.pop("I", steps.get("B"))
            assert steps == ours["counts"]


# --------------------------------------------------------- through apply_switches


@pytest.mark.parametrize("key,p", [("zbv pp=2", 2), ("zbv pp=2 dp=2", 4),
                                   ("zbv pp=2 dp=2 overlap", 4), ("interleaved pp=4", 4)])
def test_apply_switches_pipeline_and_data_parallel(key, p, two_ranks, four_ranks):
    """`apply_switches` on a pp × dp mesh: stages, then switch 8 over each stage's dp
    group; `model.step` then `finish()` gives the global batch's gradients."""
    for r in _ranks(p, two_ranks, four_ranks):
        v = r[("switches", key)]
        assert v["params"] > 0 and v["ok"] and v["loss_ok"], _verdict(v)
        assert v["norm_ok"], (v["norm"], v["ref_norm"])  # the clipping norm, whole


@pytest.mark.parametrize("style,mode", TP_PP)
def test_pipeline_with_tensor_parallel_stages(style, mode, four_ranks):
    """pp = 2 × tp = 2: each stage holds its tp rank's shards (sequence shards between
    stages under SP, the vocabulary-parallel head and loss on the last); the gradients,
    gathered whole, are one process's. Under a split backward every tensor-parallel
    linear's weight gradient (communication included) runs in W: each rank's W ran
    jobs, 4 linears a layer and the head, per micro-batch; none without the split."""
    last = sch.make(style, 2, M).num_stages - 1  # one decoder layer per stage
    for r in four_ranks:
        v = r[("switches", f"{style} pp=2 tp=2 {mode}")]
        assert v["params"] > 0 and v["ok"] and v["loss_ok"], _verdict(v)
        assert v["counts"] == _expected_counts(style, M), v["counts"]
        assert v["norm_ok"], (v["norm"], v["ref_norm"])
        if style == "1f1b":
            assert v["deferred"] == 0
        else:
            head = 1 if last in v["stages"] else 0
            assert v["deferred"] == M * (4 * len(v["stages"]) + head), (v["deferred"],
                                                                        v["stages"])


# ------------------------------------------------------- one process, no transfers


def _one_rank(name, cfg, precision="fp32", m=M, act_dtype=torch.float32):
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    s = sch.make(name, 1, m)
    rt = PipelineRuntime(build_stages(model, s.placement, 0), s, precision=precision,
                         act_dtype=act_dtype)
    ids = torch.randint(0, cfg.vocab_size, (2 * m, 13), generator=torch.Generator()
                        .manual_seed(1))
    return model, ref, rt, ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_every_schedule(name):
    """p = 1: the stages of a rank pass tensors to each other directly (the V's tip),
    two sequences per micro-batch, bias-free linears deferred."""
    cfg = config_for(2)
    model, ref, rt, x, y = _one_rank(name, cfg)
    loss = rt.step(x, y)
    ref_loss = ref(x, y)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= ATOL + RTOL * ref_loss.item()
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n].grad, p.grad, rtol=RTOL, atol=ATOL)
    assert rt.counts == _expected_counts(name, M)
    assert [a.kind for a, *_ in rt.trace] == [a.kind for a in rt.program]  # no comms


def test_one_rank_tied_embeddings_through_the_v():
    """A head tied to the embedding: on the V both uses sit on rank 0, the lookup's
    gradient comes in B, the head's deferred one in W, into the one weight."""
    cfg = config_for(2).replace(tie_word_embeddings=True)
    model, ref, rt, x, y = _one_rank("zbv", cfg)
    rt.step(x, y)
    ref(x, y).backward()
    tied = model.model.embed_tokens.weight
    assert tied is model.lm_head.weight
    torch.testing.assert_close(tied.grad, ref.lm_head.weight.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_one_rank_with_checkpointed_layers(mode):
    """Switch 4 before the stages: the recomputed forward runs inside B (no micro-batch
    set), the deferred nodes are the first forward's; the gradients are the same."""
    from colossal_lab.switches.checkpointing import GradientCheckpointConfig

    cfg = config_for(2)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    apply_switches(model, Switches.naive("fp32").replace(
        gradient_checkpoint_config=GradientCheckpointConfig(mode=mode)))
    s = sch.zb_v(1, M)
    rt = PipelineRuntime(build_stages(model, s.placement, 0), s)
    ids = torch.randint(0, cfg.vocab_size, (M, 13))
    rt.step(ids[:, :-1], ids[:, 1:])
    ref(ids[:, :-1], ids[:, 1:]).backward()
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n].grad, p.grad, rtol=RTOL, atol=ATOL)


def test_bf16_autocast_within_twice_bf16_error():
    """precision="bf16": autocast in F, fp32 residual stream between the stages. The
    pipeline's error against the fp32 reference stays within twice that of the same
    model run whole under autocast, plus 1e-6 (`colossal_lab.testing.correctness`'s rule)."""
    from colossal_lab import precision

    cfg = config_for(2)
    model, ref, rt, x, y = _one_rank("zbv", cfg, precision="bf16")
    low = copy.deepcopy(ref)
    rt.step(x, y)
    ref(x, y).backward()
    with precision.autocast("bf16", "cpu"):
        low_loss = low(x, y)
    low_loss.backward()
    got, lows = dict(model.named_parameters()), dict(low.named_parameters())
    for n, p in ref.named_parameters():
        err = (got[n].grad - p.grad).abs().max().item()
        err_low = (lows[n].grad - p.grad).abs().max().item()
        assert err <= 2 * err_low + 1e-6, (n, err, err_low)


def test_b_leaves_weight_gradients_to_w():
    """After F and B of one micro-batch only the norms have gradients (and the input
    its gradient); the linears' wait in the stage's store until W, which then gives
    exactly the undivided backward's."""
    cfg = tiny()
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    stage = Stage(model, 1, 3, range(0, 2))  # both layers, a middle stage
    store = WeightGradStore("t")
    n_linear = defer_weight_grads(stage, store)
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    dy = torch.randn(2, 9, cfg.hidden_size)
    with store.micro_batch(0):
        out = stage(x)
    torch.autograd.backward(out, dy)
    linears = {n for n, m in stage.named_modules() if isinstance(m, torch.nn.Linear)}
    for n, p in stage.named_parameters():
        assert (p.grad is None) == (n.rsplit(".", 1)[0] in linears), n
    assert x.grad is not None and len(store) == n_linear == 7 * 2
    assert store.flush(0) == n_linear and len(store) == 0
    x_ref = x.detach().clone().requires_grad_()
    ref_stage = Stage(ref, 1, 3, range(0, 2))
    torch.autograd.backward(ref_stage(x_ref), dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    got = dict(stage.named_parameters())
    for n, p in ref_stage.named_parameters():
        torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-6, atol=1e-7)
    restore_weight_grads(stage)
    assert all("forward" not in m.__dict__ for m in stage.modules())


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float32, True),
                                            (torch.bfloat16, False)])
@pytest.mark.parametrize("bias", [False, True])
def test_deferred_linear_outside_a_step_is_nn_linear(dtype, autocast, bias):
    """Without a micro-batch (key None) `DeferredLinear` is `nn.Linear`: output, dx, dW
    and db, also under bf16 autocast and with bf16 weights; odd shapes."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(37, 23, bias=bias).to(dtype)
    ref = copy.deepcopy(lin)
    x = torch.randn(3, 5, 37, dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    store = WeightGradStore()
    defer_weight_grads(lin, store)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    if not autocast:
        ctx = torch.enable_grad()
    with ctx:
        y, yr = lin(x), ref(xr)
    assert y.dtype == yr.dtype
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 and not autocast else {}
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **tol)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **tol)
    assert len(store) == 0 and DeferredLinear is not None


def test_w_adds_through_autograd_so_hooks_fire():
    """W's gradients reach `.grad` through autograd: post-accumulate-grad hooks (switch
    8's reducer) see every one."""
    lin = torch.nn.Linear(8, 8, bias=False)
    seen = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    store = WeightGradStore()
    defer_weight_grads(lin, store)
    for mb in range(2):
        with store.micro_batch(mb):
            out = lin(torch.randn(4, 8, requires_grad=True))
        out.sum().backward()
    assert seen == [] and lin.weight.grad is None
    store.flush(1)
    store.flush(0)
    assert len(seen) == 2 and torch.equal(seen[-1], lin.weight.grad)


# ------------------------------------------------------------------------ errors


def test_layers_that_do_not_divide():
    with pytest.raises(StageError, match=r"choose a number of stages in \[1, 2, 3, 6\]"):
        split_layers(6, 4)
    assert split_layers(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split_layers(5, 2, [1, 4]) == [range(0, 1), range(1, 5)]
    with pytest.raises(StageError, match="summing to the model's 5 layers"):
        split_layers(5, 2, [1, 3])
    model = build_model(config_for(3), "cpu")
    with pytest.raises(StageError, match="do not divide into 4 equal stages"):
        build_stages(model, sch.v_placement(2), 0)


def test_stages_hold_the_models_own_modules():
    model = build_model(config_for(4), "cpu")
    stages = build_stages(model, sch.v_placement(2), 0)
    assert sorted(stages) == [0, 3]
    first, last = stages[0], stages[3]
    assert first.embed_tokens is model.model.embed_tokens and last.lm_head is model.lm_head
    assert first.layers["0"] is model.model.layers[0]
    assert last.model_names()["lm_head.weight"] == "lm_head.weight"
    assert first.model_names()["layers.0.mlp.up_proj.weight"] == \
        "model.layers.0.mlp.up_proj.weight"
    assert "stage 3/4, layers 3..3, norm, head, loss" in repr(last)


def test_tied_embeddings_need_the_v():
    cfg = config_for(4).replace(tie_word_embeddings=True)
    model = build_model(cfg, "cpu")
    with pytest.raises(StageError, match="pp_style='zbv'"):
        build_stages(model, sch.linear_placement(4), 0)
    assert sorted(build_stages(model, sch.v_placement(2), 0)) == [0, 3]  # both on rank 0


def _switches(**kw):
    return Switches.naive("fp32").replace(**kw)


@pytest.mark.parametrize("kw,match", [
    ({"pp_style": "zero-bubble"}, "pp_style='zero-bubble'; choose one of"),
    ({"pp_style": "zbv", "num_model_chunks": 3}, "exactly 2 model chunks"),
    ({"pp_style": "interleaved", "num_model_chunks": 1}, "num_model_chunks >= 2"),
    ({"pp_style": "1f1b", "num_model_chunks": 2}, "use pp_style='interleaved'"),
    ({"num_microbatches": 0}, "num_microbatches=0 must be a whole number"),
])
def test_bad_pipeline_switches(kw, match):
    with pytest.raises(ValueError, match=match):
        ppl.check(_switches(**kw))


def test_schedule_errors_say_what_to_choose():
    with pytest.raises(ValueError, match="needs num_microbatches: e.g. 8 or more"):
        ppl.make_schedule(_switches(), 4)
    with pytest.raises(ValueError, match=r"m=2 < p=4 never fills the V .*use m >= 4"):
        ppl.make_schedule(_switches(pp_style="zbv", num_microbatches=2), 4)
    with pytest.raises(ValueError, match="m % p == 0.*choose m = 4 or 8"):
        ppl.make_schedule(_switches(pp_style="interleaved", num_microbatches=6), 4)
    s = ppl.make_schedule(_switches(pp_style="zbv", num_microbatches=4), 4)
    assert s.name == "zbv" and s.chunks == 2


class FakeMesh:
    """A DeviceMesh's shape, without a process group."""

    mesh_dim_names = ("pp", "dp", "tp")

    def __init__(self, pp):
        self.pp = pp

    def __getitem__(self, dim):
        return type("Dim", (), {"size": lambda _: self.pp if dim == "pp" else 1})()


@pytest.mark.parametrize("kw,err,match", [
    ({"pp_style": "zbv", "num_microbatches": 4, "overlap_communication": "ddp"},
     ValueError, "use True"),
    ({"pp_style": "1f1b", "num_microbatches": 4, "precision": "fp16"},
     NotImplementedError, "loss scaling"),
    ({"pp_style": "1f1b"}, ValueError, "needs num_microbatches"),
    ({"pp_style": "zbv", "num_microbatches": 4}, StageError, "do not divide into 4"),
])
def test_apply_switches_refuses_before_changing_anything(kw, err, match):
    model = build_model(config_for(3), "cpu")
    before = [type(x) for x in model.modules()]
    sw = Switches(**{"precision": "fp32", **kw})
    with pytest.raises(err, match=match):
        apply_switches(model, sw, mesh=FakeMesh(2))
    assert [type(x) for x in model.modules()] == before and model.switches is None


def test_runtime_errors():
    cfg = config_for(2)
    model, _, rt, x, y = _one_rank("1f1b", cfg)
    with pytest.raises(ValueError, match="does not split into num_microbatches=4"):
        rt.step(x[:6], y[:6])
    s = sch.zb_v(1, 4)
    with pytest.raises(ValueError, match=r"runs stages \[0, 1\] of zbv, but was given \[0\]"):
        PipelineRuntime({0: build_stages(model, s.placement, 0)[0]}, s)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        PipelineRuntime(build_stages(model, sch.linear_placement(2), 0),
                        sch.one_f_one_b(2, 4))
    bad = PipelineRuntime(build_stages(model, s.placement, 0), s,
                          act_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="pass act_dtype="):
        bad.step(x, y)


def test_pipelined_model_has_no_forward():
    cfg = config_for(2)
    model = build_model(cfg, "cpu")
    s = sch.one_f_one_b(1, 2)
    stages = build_stages(model, s.placement, 0)
    pm = ppl.PipelineModel(model, stages, PipelineRuntime(stages, s))
    with pytest.raises(TypeError, match=r"model.step\(input_ids, labels\)"):
        pm(torch.zeros(2, 4, dtype=torch.long))
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    assert pm.step(ids, ids).ndim == 0
    assert set(pm.model_names().values()) == {n for n, _ in model.named_parameters()}
