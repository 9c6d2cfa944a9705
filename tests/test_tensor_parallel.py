"""Switch 5 on gloo: for every mode (plain TP, split_gather, ring, torch's DTensor plan)
the loss, the logits and every gradient, gathered to full shapes, are one process's;
GQA key/value heads sharded (tp=2) and replicated (tp=4); separate and fused
projections; through `apply_switches` on a mesh, with activation checkpointing, and
with data parallelism on the same mesh (dp=2 × tp=2); the vocabulary-parallel loss
with ignored labels; and the errors for what cannot be split.

Processes are the expensive part (each imports torch), so one group of 2 and one of 4
run everything they can check, once per module, and the tests read their answers.

**Tolerance, fp32.** Tensor parallelism computes the same sums in another order: a
row-parallel linear adds t partial sums of k/t terms where one process adds k terms,
the vocabulary-parallel loss takes its max and sum over t pieces, the norms' weight
gradients add t partial sums over S/t tokens. fp32 addition is not associative, so the
results differ by a few units in the last place (2^-24 ≈ 6e-8 relative) of the largest
terms. The bound per tensor is ``max|g − g_ref| <= 1e-6 + 1e-5 · max|g_ref|``
(`colossal_lab.testing.correctness`), some 100 ulps; what is measured is ~1e-7 against bounds
of ~3e-6 (printed on failure). A missing reduction (a norm gradient not summed over
the ranks, a replicated key/value head not summed) is off by O(|g|): 1e-2 to 1e-1
here, 10^4 times the bound. The loss and the logits use the same rule.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.fallback import BackendUnavailable
from colossal_lab.model import build_model
from colossal_lab.parallel import data_parallel as dp
from colossal_lab.parallel import distributed, grad_norm
from colossal_lab.parallel import tensor_parallel as tpm
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.testing import gradient_checks
from colossal_lab.testing.correctness import max_abs_err

FP32 = {"atol": 1e-6, "rtol": 1e-5}
MODES_2 = ("all_reduce", "split_gather", "ring", "dtensor")
MODES_4 = ("all_reduce", "split_gather", "ring")  # dtensor needs tp | Hkv = 2


# ----------------------------------------------------------- what the ranks run


def _compare(model, ref, loss, loss_ref) -> dict:
    """Loss and every gradient against the reference, by the FP32 rule."""
    got = gradient_checks.full_named(model, grads=True)
    want = gradient_checks.full_named(ref, grads=True)
    worst = max(want, key=lambda n: max_abs_err(got[n], want[n]) /
                (FP32["atol"] + FP32["rtol"] * want[n].abs().max().item()))
    err = max_abs_err(got[worst], want[worst])
    bound = FP32["atol"] + FP32["rtol"] * want[worst].abs().max().item()
    loss_err = abs(loss - loss_ref)
    return {"ok": err <= bound and loss_err <= FP32["atol"] + FP32["rtol"] * abs(loss_ref)
            and set(got) == set(want), "worst": worst, "err": err, "bound": bound,
            "loss_err": loss_err}


def through_apply_switches(mode: str, ckpt: bool) -> dict:
    """`apply_switches` on a `make_mesh(tp=world)` mesh, optionally with every layer
    checkpointed (the recompute replays the communication), against one process."""
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    sw = Switches.naive("fp32").replace(
        enable_sequence_parallelism=mode != "all_reduce",
        sequence_parallelism_mode=None if mode == "all_reduce" else mode,
        gradient_checkpoint_config=GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
        if ckpt else None)
    mesh = distributed.make_mesh(tp=distributed.world_size())
    apply_switches(model, sw, mesh=mesh)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    loss_ref = ref(ids[:, :-1], ids[:, 1:])
    loss_ref.backward()
    norm_ref = torch.stack([p.grad.norm() for p in ref.parameters()]).norm().item()
    return {**_compare(model, ref, loss.item(), loss_ref.item()), "mode": model.tp.mode,
            "switches": model.switches == sw, "norm": grad_norm.total_norm(model).item(),
            "norm_ref": norm_ref,
            "own_norm": torch.stack([p.grad.norm() for p in model.parameters()]).norm()
            .item()}


def with_data_parallel() -> dict:
    """dp=2 × tp=2 on four ranks: sequence-parallel TP inside each pair, our
    overlapped gradient all-reduce across the pairs; each pair sees half the global
    batch. The gradients are those of the whole batch on one process."""
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    mesh = distributed.make_mesh(dp=2, tp=2)
    sw = Switches.naive("fp32").replace(enable_sequence_parallelism=True,
                                        overlap_communication=True,
                                        extra={"dp_bucket_elems": 4096})
    model = apply_switches(model, sw, mesh=mesh)
    ids = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    d = mesh.get_local_rank("dp")
    loss = model(x.chunk(2)[d], y.chunk(2)[d])
    loss.backward()
    dp.of(model).finish()
    loss_ref = ref(x, y)
    loss_ref.backward()
    out = _compare(model, ref, 0.0, 0.0)  # the loss is a half-batch's: not compared
    return {**out, "dp": d, "tp": mesh.get_local_rank("tp")}


def ce_with_ignored_labels() -> dict:
    """The vocabulary-parallel loss alone, some labels ignored: loss and logit gradient
    against `F.cross_entropy` on the full logits."""
    from colossal_lab.parallel.tp_ops import vocab_parallel_cross_entropy

    t, r = distributed.world_size(), distributed.rank()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 96, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 96, (37,), generator=g)
    labels[::5] = -100
    full = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full, labels, ignore_index=-100)
    ref.backward()
    local = logits.chunk(t, dim=1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, r * 96 // t, None)
    loss.backward()
    return {"loss_err": abs(loss.item() - ref.item()),
            "grad_err": max_abs_err(local.grad, full.grad.chunk(t, dim=1)[r])}


def errors() -> dict:
    """What must be refused or fall back, and how."""
    out = {}
    cfg = tiny()
    model = build_model(cfg, "cpu")
    tpm.apply(model, "split_gather")
    try:
        model(torch.zeros(1, 15, dtype=torch.long), torch.zeros(1, 15, dtype=torch.long))
    except ValueError as e:
        out["sequence"] = str(e)
    try:
        tpm.apply(model, "ring")
    except RuntimeError as e:
        out["twice"] = str(e)
    try:
        tpm.apply(build_model(cfg, "cpu"), "symm_mem")  # strict mode: no quiet fallback
    except BackendUnavailable as e:
        out["symm_mem_strict"] = str(e)
    os.environ["COLOSSAL_LAB_STRICT"] = "0"
    try:
        out["symm_mem_fallback"] = tpm.apply(build_model(cfg, "cpu"), "symm_mem").tp.mode
    finally:
        os.environ["COLOSSAL_LAB_STRICT"] = "1"
    mesh = distributed.make_mesh(tp=distributed.world_size())
    try:
        apply_switches(build_model(cfg, "cpu"), Switches(
            enable_sequence_parallelism=True, enable_fused_cross_entropy=True), mesh=mesh)
    except ValueError as e:
        out["fused_loss"] = str(e)
    if distributed.world_size() == 4:
        try:
            apply_switches(build_model(cfg, "cpu"), Switches(
                enable_sequence_parallelism=True, sequence_parallelism_mode="dtensor"),
                mesh=mesh)
        except ValueError as e:
            out["dtensor_kv"] = str(e)
    return out


def bf16_smoke(mode: str) -> dict:
    """Under bf16 autocast the modes run and land within bf16's error of fp32."""
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg, "cpu")
    ref = copy.deepcopy(model)
    tpm.apply(model, mode)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return {"loss": loss.item(), "loss_ref": ref(ids[:, :-1], ids[:, 1:]).item(),
            "finite": all(torch.isfinite(p.grad).all().item() for p in model.parameters())}


def suite(modes: tuple[str, ...]) -> dict:
    """Everything one group checks."""
    world = distributed.world_size()
    cases = {m: (m, {}) for m in modes}
    cases.update({(m, "fused"): (m, {"fused": True}) for m in modes if m != "all_reduce"})
    cases = {str(k): v for k, v in cases.items()}
    out = {"checks": gradient_checks.tensor_parallel_gradient_checks(cases),
           "apply": {("split_gather", True): through_apply_switches("split_gather", True),
                     ("ring", False): through_apply_switches("ring", False)},
           "ce": ce_with_ignored_labels(), "errors": errors(),
           "bf16": bf16_smoke("ring")}
    if world == 4:
        out["dp"] = with_data_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return distributed.spawn(suite, 2, MODES_2, timeout_s=240)


@pytest.fixture(scope="module")
def four_ranks():
    return distributed.spawn(suite, 4, MODES_4, timeout_s=240)


def _verdict(res: dict) -> str:
    return (f"{res.get('mode')}: loss err {res['loss_err']:.2e}, worst {res['worst']} "
            f"max err {res['err']:.2e}, bound {res['bound']:.2e}")


# ------------------------------------------------------------------ gradients


CASES = [(w, m, f) for w, modes in ((2, MODES_2), (4, MODES_4)) for m in modes
         for f in ((False,) if m == "all_reduce" else (False, True))]
"""(world, mode, fused projections): plain TP once per world (the layouts are tested
with SP); dtensor on 2 ranks only (tp=4 > Hkv=2 is refused, `test_errors_...`)."""


@pytest.mark.parametrize("world,mode,fused", CASES,
                         ids=[f"{w}-{m}-{'fused' if f else 'separate'}" for w, m, f in CASES])
def test_loss_logits_and_gradients_equal_one_process(world, mode, fused, two_ranks,
                                                     four_ranks):
    ranks = two_ranks if world == 2 else four_ranks
    key = str((mode, "fused")) if fused else mode
    for r, out in enumerate(ranks):
        res = out["checks"][key]
        assert res["mode"] == mode
        assert res["ok"], f"rank {r}/{world}: {_verdict(res)}"
        assert res["logits_err"] <= FP32["atol"] * 10, res["logits_err"]
        assert res["params"] == 21  # every parameter of the tiny model, HF names
    local = ranks[0]["checks"][key]["local_numel"]
    full = ranks[0]["checks"][key]["full_numel"]
    assert local < full  # the model really is split


def test_replicated_kv_heads_hold_whole_heads(four_ranks):
    """tp=4 > Hkv=2: each rank holds one whole key/value head, two ranks per head."""
    cfg = tiny()
    assert tpm.kv_heads_of(cfg, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert tpm.kv_heads_of(cfg, 2) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("world", [2, 4])
def test_through_apply_switches_with_checkpointing(world, two_ranks, four_ranks):
    ranks = two_ranks if world == 2 else four_ranks
    for r, out in enumerate(ranks):
        for (mode, ckpt), res in out["apply"].items():
            assert res["mode"] == mode and res["switches"]
            assert res["ok"], f"rank {r}/{world}, ckpt={ckpt}: {_verdict(res)}"


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_norm_is_the_whole_models(world, two_ranks, four_ranks):
    """`grad_norm.total_norm` of the split model is one process's norm on every rank
    (at tp = 4 the tiny model's two key/value heads are replicated, counted once); a
    rank's own parameters alone give another norm, which clipping must not use."""
    ranks = two_ranks if world == 2 else four_ranks
    for r, out in enumerate(ranks):
        for case, res in out["apply"].items():
            assert abs(res["norm"] - res["norm_ref"]) <= 1e-5 * res["norm_ref"], (r, case)
            assert abs(res["own_norm"] - res["norm_ref"]) > 1e-3 * res["norm_ref"], case


def test_tensor_and_data_parallel_on_one_mesh(four_ranks):
    places = sorted((out["dp"]["dp"], out["dp"]["tp"]) for out in four_ranks)
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r, out in enumerate(four_ranks):
        assert out["dp"]["ok"], f"rank {r}: {_verdict(out['dp'])}"


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_loss_with_ignored_labels(world, two_ranks, four_ranks):
    for out in (two_ranks if world == 2 else four_ranks):
        assert out["ce"]["loss_err"] < 1e-12 and out["ce"]["grad_err"] < 1e-12, out["ce"]


def test_bf16_autocast_runs_within_bf16_error(two_ranks):
    for out in two_ranks:
        b = out["bf16"]
        assert b["finite"]
        assert abs(b["loss"] - b["loss_ref"]) < 2 ** -7 * abs(b["loss_ref"]) * 4, b


# ---------------------------------------------------------------- errors


def test_errors_say_what_to_change(two_ranks, four_ranks):
    e = two_ranks[0]["errors"]
    assert "sequence length 15 is not divisible by tp_size=2" in e["sequence"]
    assert "e.g. 14 or 16" in e["sequence"]
    assert "already applied" in e["twice"]
    assert "symm_mem" in e["symm_mem_strict"] and "COLOSSAL_LAB_STRICT" in e["symm_mem_strict"]
    assert e["symm_mem_fallback"] == "ring"
    assert "turn enable_fused_cross_entropy off" in e["fused_loss"]
    e4 = four_ranks[0]["errors"]
    assert "tp_size=4 does not divide num_key_value_heads=2" in e4["dtensor_kv"]


@pytest.mark.parametrize("cfg_kw,tp,match", [
    ({}, 3, "tp_size=3 does not divide num_attention_heads=4; choose tp from [1, 2, 4]"),
    ({"vocab_size": 510}, 4, "tp_size=4 does not divide vocab_size=510"),
    ({"intermediate_size": 170}, 4, "does not divide intermediate_size=170"),
    ({"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64,
      "intermediate_size": 192}, 8, None),
    ({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96,
      "intermediate_size": 192, "vocab_size": 384}, 6, "not a multiple of it"),
])
def test_check_sizes(cfg_kw, tp, match):
    cfg = tiny().replace(**cfg_kw)
    if match is None:
        tpm.check_sizes(cfg, tp)  # kv heads replicated twice each: fine
        return
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
        tpm.check_sizes(cfg, tp)


def test_resolve_mode():
    assert tpm.resolve_mode(False) == "all_reduce"
    assert tpm.resolve_mode(False, "all_reduce") == "all_reduce"
    assert tpm.resolve_mode(True) == "split_gather"  # ColossalAI's default
    assert tpm.resolve_mode(True, "ring") == "ring"
    with pytest.raises(ValueError, match="needs enable_sequence_parallelism=True"):
        tpm.resolve_mode(False, "ring")
    with pytest.raises(ValueError, match="set enable_sequence_parallelism=False"):
        tpm.resolve_mode(True, "all_reduce")
    with pytest.raises(NotImplementedError, match="context parallelism"):
        tpm.resolve_mode(True, "all_to_all")
    with pytest.raises(ValueError, match="choose one of"):
        apply_switches(build_model(tiny(), "cpu"),
                       Switches(enable_sequence_parallelism=True,
                                sequence_parallelism_mode="chunked"))


def test_fused_qkv_shard_is_per_head_group():
    """Rank r's rows of [q; k; v]: its query heads, then its key and value heads."""
    cfg = tiny()  # Hq 4, Hkv 2, D 16: q rows 0-63, k 64-95, v 96-127
    s = tpm.qkv_shard(cfg, 2)
    assert s.full == 128
    assert s.pieces == (((0, 32), (64, 80), (96, 112)), ((32, 64), (80, 96), (112, 128)))
    s4 = tpm.qkv_shard(cfg, 4)
    assert s4.pieces[1] == ((16, 32), (64, 80), (96, 112))  # head 1 with kv head 0
    assert s4.pieces[2] == ((32, 48), (80, 96), (112, 128))
    w = torch.arange(128.0)[:, None]
    assert s.take(w, 1).flatten().tolist() == list(range(32, 64)) + list(range(80, 96)) \
        + list(range(112, 128))
    gu = tpm.gate_up_shard(cfg, 2)
    assert gu.pieces == (((0, 86), (172, 258)), ((86, 172), (258, 344)))
