"""Switch 8 on gloo: every backend's gradients are the single-process gradients of the
global batch, `no_sync` accumulation changes nothing, every parameter is in exactly one
bucket of at most the cap, the buckets follow the order the gradients really came in,
bf16 reduction is as good as bf16 can be, replicas stay identical through optimizer
steps, and a rank that fails ends the others within seconds instead of hanging.

Processes are the expensive part (each imports torch), so one group of 2 and one of 3
run everything they can check, once per module (`two_ranks`, `three_ranks`), and the
tests read their answers.

**Tolerance, fp32.** Data parallelism computes the same mean as one process, only in
another order: each rank sums its shard's B·S/W tokens into a weight gradient and the
all-reduce adds W partial sums, where one process sums all B·S tokens at once. Both are
fp32 sums of the same terms, differing by a few units in the last place (2^-24 ≈ 6e-8
relative) of the largest terms. The bound ``max|g - g_ref| <= 1e-6 + 1e-5 · max|g_ref|``
(`colossal_lab.testing.correctness`) leaves some 100 ulps for that; what is measured is ~2e-8
against bounds of ~1.5e-6 (printed by `gradient_check`). A wrong reduction (a sum
instead of a mean, a missing bucket, a stale buffer) is off by O(|g|), 10^4 times more.

**Tolerance, bf16 reduction.** The 2x rule: the error must stay within twice that of the
same mean computed in bf16 (each shard's gradient / W rounded to bf16, then added in bf16
in every order an all-reduce may add them), plus 1e-6.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from colossal_lab import Switches, apply_switches, build_model
from colossal_lab.config import tiny
from colossal_lab.parallel import data_parallel as dp
from colossal_lab.parallel import distributed
from colossal_lab.testing import gradient_checks
from colossal_lab.training import train
from colossal_lab.training.optimizer import make_optimizer

BACKENDS = dp.BACKENDS
FP32 = {"atol": 1e-6, "rtol": 1e-5}


# ----------------------------------------------------------- what the ranks run


class Toy(torch.nn.Module):
    """Registered a, b, c but run as b(a(c(x))): the gradients come in b, a, c, not in
    the reverse registration order c, b, a, so the bucket rebuild has something to fix."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(self.c(x))).square().mean()


def toy_order() -> dict:
    """The overlapped reducer on `Toy`: bucket order before and after the first step,
    and the order the gradients came in."""
    torch.manual_seed(0)
    model = Toy()
    dp.apply(model, "overlap", bucket_elems=64)  # one parameter per bucket
    sync = dp.of(model)
    before = sync.bucket_order()
    x = torch.randn(4, 8)
    orders = []
    for _ in range(2):
        model(x).backward()
        sync.finish()
        orders.append((list(sync.ready_order), sync.bucket_order()))
        model.zero_grad(set_to_none=True)
    return {"before": before, "orders": orders}


def train_replicas(backend: str, steps: int = 3) -> torch.Tensor:
    """A few optimizer steps through the library's own path: `apply_switches` with
    switch 8 last, then `train.make_step` (two micro-batches, the first under
    `no_sync`, `finish()` before clipping) with AdamW. The ranks start from different
    weights (`apply` broadcasts rank 0's) and see different data."""
    r = distributed.rank()
    torch.manual_seed(r)
    model = build_model(tiny(), "cpu")
    sw = Switches.naive("fp32").replace(overlap_communication=backend,
                                        extra={"dp_bucket_elems": 8192})
    wrapped = apply_switches(model, sw)
    assert dp.unwrap(wrapped) is model and dp.of(wrapped).backend == backend
    assert (wrapped is model) == (backend != "ddp")  # DDP's forward must be the one called
    step = train.make_step(wrapped, make_optimizer(model), micro_batches=2)
    for _ in range(steps):
        ids = torch.randint(0, tiny().vocab_size, (4, 17))
        step(ids[:, :-1], ids[:, 1:])
    return torch.cat([dp.full_param(p).detach().flatten() for p in model.parameters()])


CASES_2 = {
    **{(b, "fp32"): (b, {}) for b in BACKENDS},
    **{(b, "no_sync"): (b, {"micro_batches": 2, "global_batch": 8}) for b in BACKENDS},
    **{(b, "bf16"): (b, {"reduce_dtype": torch.bfloat16}) for b in BACKENDS},
    ("overlap", "cap"): ("overlap", {"bucket_elems": 5000, "first_bucket_elems": 100}),
}
CASES_3 = {(b, "fp32"): (b, {}) for b in BACKENDS}
CASES_3[("overlap", "no_sync")] = ("overlap", {"micro_batches": 2, "global_batch": 6})


def suite(cases: dict, replicas: bool) -> dict:
    """Everything one group checks: `gradient_check` per case, the toy's bucket order,
    and the replicas after optimizer steps."""
    out = {key: gradient_checks.data_parallel_gradient_check(backend, **{**FP32, **kw})
           for key, (backend, kw) in cases.items()}
    out["toy"] = toy_order()
    if replicas:
        out["replicas"] = {b: train_replicas(b) for b in BACKENDS}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return distributed.spawn(suite, 2, CASES_2, True, timeout_s=180)


@pytest.fixture(scope="module")
def three_ranks():
    return distributed.spawn(suite, 3, CASES_3, False, timeout_s=180)


# ------------------------------------------------------------------ gradients


def _verdict(res: dict) -> str:
    lowp = "" if res["err_lowp"] is None else f", bf16 reference {res['err_lowp']:.2e}"
    return (f"{res['backend']}: worst {res['worst']} max err {res['err']:.2e}{lowp}, "
            f"bound {res['bound']:.2e}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
def test_gradients_equal_single_process(backend, world, two_ranks, three_ranks):
    ranks = two_ranks if world == 2 else three_ranks
    for r, out in enumerate(ranks):
        res = out[(backend, "fp32")]
        assert res["backend"] == backend
        assert res["ok"], f"rank {r}/{world}: {_verdict(res)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sync_accumulation_equals_one_batch(backend, two_ranks, three_ranks):
    """Two micro-batches per rank, the first under no_sync: the gradient of the whole
    global batch, as with one."""
    for r, out in enumerate(two_ranks):
        res = out[(backend, "no_sync")]
        assert res["ok"], f"rank {r}: {_verdict(res)}"
    if backend == "overlap":
        for out in three_ranks:
            assert out[("overlap", "no_sync")]["ok"], _verdict(out[("overlap", "no_sync")])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_reduction_within_bf16_error(backend, two_ranks):
    for r, out in enumerate(two_ranks):
        res = out[(backend, "bf16")]
        assert res["err_lowp"] is not None and res["err_lowp"] > 0
        assert res["ok"], f"rank {r}: {_verdict(res)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicas_stay_identical_through_optimizer_steps(backend, two_ranks):
    a, b = (out["replicas"][backend] for out in two_ranks)
    assert torch.equal(a, b), f"{backend}: replicas differ by {(a - b).abs().max():.2e}"


# -------------------------------------------------------------------- buckets


def test_every_parameter_in_exactly_one_bucket_under_the_cap(two_ranks):
    cap, first = 5000, 100
    numel = {n: p.numel() for n, p in build_model(tiny(), "cpu").named_parameters()}
    for out in two_ranks:
        res = out[("overlap", "cap")]
        assert res["ok"], _verdict(res)
        names = [n for b in res["buckets"] for n in b["params"]]
        assert sorted(names) == sorted(numel)  # all of them, each once
        for i, b in enumerate(res["buckets"]):
            assert b["elements"] == sum(numel[n] for n in b["params"])
            limit = first if i == 0 else cap
            assert b["elements"] <= limit or len(b["params"]) == 1, b
        assert any(len(b["params"]) > 1 for b in res["buckets"])  # the cap groups some
        assert any(b["elements"] > cap for b in res["buckets"])  # and isolates big ones
    assert two_ranks[0][("overlap", "cap")]["buckets"] == \
        two_ranks[1][("overlap", "cap")]["buckets"]


def test_buckets_rebuilt_in_the_order_gradients_came(two_ranks):
    for out in two_ranks:
        toy = out["toy"]
        (ready1, buckets1), (ready2, buckets2) = toy["orders"]
        assert toy["before"] == ["c.bias", "c.weight", "b.bias", "b.weight", "a.bias",
                                 "a.weight"]  # reverse registration
        assert ready1[:2] in (["b.bias", "b.weight"], ["b.weight", "b.bias"])
        assert buckets1 == ready1 != toy["before"]  # rebuilt after the first backward
        assert ready2 == buckets2 == buckets1  # and the second comes in that order
    assert two_ranks[0]["toy"] == two_ranks[1]["toy"]
    for out in two_ranks:  # the model's own order is kept too, on every step
        assert out[("overlap", "fp32")]["ready_order"] == out[("overlap", "fp32")][
            "bucket_order"]


@pytest.mark.parametrize("numels,cap,first,expect", [
    ([4, 4, 4], 8, None, [[2, 1], [0]]),
    ([4, 20, 4, 4], 8, None, [[3, 2], [1], [0]]),  # larger than the cap: alone
    ([1, 1, 1, 1, 1], 3, 1, [[4], [3, 2, 1], [0]]),  # a small first bucket
    ([5], 1, None, [[0]]),
])
def test_assign_buckets(numels, cap, first, expect):
    assert dp.assign_buckets(numels, cap, first_cap=first) == expect


def test_assign_buckets_splits_dtypes_and_checks_order():
    keys = ["f32", "f32", "bf16", "f32"]
    assert dp.assign_buckets([1, 1, 1, 1], 10, keys=keys) == [[3], [2], [1, 0]]
    with pytest.raises(ValueError, match="exactly once"):
        dp.assign_buckets([1, 1], 10, order=[0, 0])
    with pytest.raises(ValueError, match=">= 1"):
        dp.assign_buckets([1], 0)


# --------------------------------------------------------------- one process


def test_resolve():
    assert dp.resolve(True, 1) == "overlap"
    assert dp.resolve(False, 1) is None and dp.resolve(None, 1) is None
    assert dp.resolve(False, 4) == "naive"  # several replicas never go unreduced
    assert dp.resolve("fsdp2", 2) == "fsdp2"
    with pytest.raises(ValueError, match="choose True, False or one of"):
        dp.resolve("zero3", 2)


def test_single_process_overlap_is_exact_and_rebuilds():
    """World 1: no communication, the gradients untouched (views of the buckets)."""
    model = apply_switches(build_model(tiny(), "cpu"), Switches.naive("fp32"))
    ref = build_model(tiny(), "cpu")
    ref.load_state_dict(model.state_dict())
    assert dp.apply(model, "overlap", bucket_elems=5000) is model
    sync = dp.of(model)
    ids = torch.randint(0, tiny().vocab_size, (2, 9))
    for _ in range(2):
        model(ids[:, :-1], ids[:, 1:]).backward()
        sync.finish()
        assert sync.rebuilt and sync.ready_order == sync.bucket_order()
        model.zero_grad(set_to_none=True)
    model(ids[:, :-1], ids[:, 1:]).backward()
    sync.finish()
    ref(ids[:, :-1], ids[:, 1:]).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    slots = {k.buffer.untyped_storage().data_ptr() for k in sync.buckets}
    assert all(p.grad.untyped_storage().data_ptr() in slots for p in model.parameters())


def test_plain_model_has_no_sync_and_reapply_detaches():
    model = build_model(tiny(), "cpu")
    assert dp.apply(model, False) is model and dp.of(model) is dp.NO_SYNC
    dp.apply(model, "overlap")
    first = dp.of(model)
    dp.apply(model, "overlap")
    assert dp.of(model) is not first and first._hooks == []
    dp.apply(model, None)
    assert dp.of(model) is dp.NO_SYNC


def test_accumulating_without_no_sync_is_an_error():
    model = build_model(tiny(), "cpu")
    dp.apply(model, "overlap")
    ids = torch.randint(0, tiny().vocab_size, (2, 9))
    model(ids[:, :-1], ids[:, 1:]).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(ids[:, :-1], ids[:, 1:]).backward()
    with dp.of(model).no_sync(), pytest.raises(RuntimeError, match="inside no_sync"):
        dp.of(model).finish()


def test_peers_need_a_process_group():
    with pytest.raises(RuntimeError, match="torchrun"):
        dp.apply(build_model(tiny(), "cpu"), "ddp")
    with pytest.raises(ValueError, match="bucket_elems"):
        dp.apply(build_model(tiny(), "cpu"), "overlap", bucket_elems=0)


# ---------------------------------------------------------------- failing rank


def rank1_fails(mode: str) -> None:
    """Rank 1 raises (or hangs) before its backward; rank 0 runs its step and waits for
    the gradient all-reduces in `finish()`."""
    model = build_model(tiny(), "cpu")
    dp.apply(model, "overlap", bucket_elems=20000)
    if distributed.rank() == 1:
        if mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        time.sleep(120)  # stuck: its process stays alive, its connections open
    ids = torch.randint(0, tiny().vocab_size, (2, 9))
    model(ids[:, :-1], ids[:, 1:]).backward()
    dp.of(model).finish()


def test_failing_rank_ends_the_others():
    t0 = time.monotonic()
    with pytest.raises(distributed.SpawnError) as info:
        distributed.spawn(rank1_fails, 2, "raise", collective_timeout_s=5, timeout_s=60)
    elapsed = time.monotonic() - t0
    e = info.value
    assert e.rank == 1 and e.exc_type == "ValueError"
    assert "rank 1/2 failed with ValueError: rank 1 fails on purpose" in str(e)
    assert e.errors[0].startswith("RankFailure") and "gradient bucket" in e.errors[0]
    assert "collective timeout 5 s" in e.errors[0]
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_hanging_rank_times_out_the_others():
    t0 = time.monotonic()
    with pytest.raises(distributed.SpawnError) as info:
        distributed.spawn(rank1_fails, 2, "hang", collective_timeout_s=3, timeout_s=60,
                          grace_s=1)
    elapsed = time.monotonic() - t0
    e = info.value
    assert e.rank == 1 and e.unfinished == [1]
    assert "rank 1/2 stopped responding" in str(e)
    assert "RankFailure" in e.errors[0] and "collective timeout 3 s" in e.errors[0]
    # gloo words it "Timed out waiting ..." or, when the pair closes first under load,
    # "Application timeout caused pair closure": either way the deadline fired
    assert re.search(r"timed out|timeout caused", e.errors[0], re.IGNORECASE), e.errors[0]
    assert elapsed < 30, f"took {elapsed:.1f} s"
