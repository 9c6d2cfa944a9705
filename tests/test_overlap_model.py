"""The overlap model (`colossal_lab.parallel.overlap_model`) on timelines small enough to work out
by hand, its sanity (more bandwidth never exposes more; the naive reducer exposes all of
it), and the benchmark that feeds it (`benchmarks.grad_overlap`) run quick on the CPU.

Units in the hand-made cases: a link of 1 GB/s moves 1e6 bytes per ms; at 2 ranks the
ring factor 2·(W−1)/W is 1, so a gradient of 100 elements of 1e4 bytes (1e6 bytes)
takes exactly 1 ms without latency.
"""

from __future__ import annotations

import random

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from colossal_lab.benchmarks import grad_overlap  # noqa: E402
from colossal_lab.parallel import overlap_model as om

SLOW = om.Link("test link", gbps=1.0, latency_us=0.0, source="test")
KW = {"link": SLOW, "world": 2, "bytes_per_elem": 1e4}  # 100 elements = 1 ms


def spans(res: om.Overlap) -> list[tuple[float, float]]:
    return [(pytest.approx(s.start_ms), pytest.approx(s.end_ms)) for s in res.spans]


# ---------------------------------------------------------------- the cost


def test_ring_allreduce_cost():
    assert om.allreduce_ms(1e9, 1, SLOW) == 0.0  # one rank: nothing to reduce
    assert om.allreduce_ms(1e6, 2, SLOW) == pytest.approx(1.0)
    # 8 ranks: 2·7/8 = 1.75 of the bytes through each link, plus the latency
    nv = om.link("NVLink 4")
    assert om.allreduce_ms(450e6, 8, nv) == pytest.approx(nv.latency_us / 1e3 + 1.75)
    with pytest.raises(ValueError, match="no link"):
        om.link("carrier pigeon")


def test_every_link_states_its_source():
    for ln in om.LINKS:
        assert ln.gbps > 0 and 10 <= ln.latency_us <= 20
        assert ln.source.startswith(("datasheet", "assumption")), ln


# ----------------------------------------------------------- hand-computed


def test_one_bucket_starts_when_its_last_gradient_is_ready():
    grads = [om.Grad("a", 40, 1.0), om.Grad("b", 60, 5.0)]
    res = om.simulate(grads, [[1, 0]], **KW)
    assert spans(res) == [(5.0, 6.0)]
    assert res.backward_ms == 5.0 and res.comm_ms == pytest.approx(1.0)
    assert res.exposed_ms == pytest.approx(1.0) and res.hidden_ms == pytest.approx(0.0)


def test_two_buckets_hidden_behind_the_backward():
    # the backward runs on for 2 ms after its last parameter gradient (the input
    # gradients of the first layer): both all-reduces finish inside it
    grads = [om.Grad("late", 100, 10.0), om.Grad("early", 100, 1.0)]
    res = om.simulate(grads, [[1], [0]], backward_ms=12.0, **KW)
    assert spans(res) == [(1.0, 2.0), (10.0, 11.0)]
    assert res.exposed_ms == 0.0 and res.hidden_ms == pytest.approx(2.0)
    assert res.first_start_ms == 1.0


def test_communication_slower_than_compute_queues_up():
    # 5 ms per bucket, a gradient every 1 ms: each bucket waits for the previous one
    grads = [om.Grad(f"g{i}", 500, float(i)) for i in range(3)]
    res = om.simulate(grads, [[0], [1], [2]], backward_ms=3.0, **KW)
    assert spans(res) == [(0.0, 5.0), (5.0, 10.0), (10.0, 15.0)]
    assert res.comm_ms == pytest.approx(15.0)
    assert res.exposed_ms == pytest.approx(12.0) and res.hidden_ms == pytest.approx(3.0)


def test_tiny_buckets_are_latency_bound():
    # 1000 one-element gradients 1 µs apart; 20 µs per all-reduce whatever its size
    fast = om.Link("latency only", gbps=1e9, latency_us=20.0, source="test")
    grads = [om.Grad(f"g{i}", 1, i * 1e-3) for i in range(1000)]
    kw = {"link": fast, "world": 2, "bytes_per_elem": 2}
    each = om.simulate(grads, [[i] for i in range(1000)], **kw)
    assert each.comm_ms == pytest.approx(1000 * 0.020)
    assert each.end_ms == pytest.approx(0.0 + 1000 * 0.020)  # back to back from t = 0
    assert each.exposed_ms == pytest.approx(20.0 - 0.999)
    one = om.naive(grads, **kw)
    assert one.exposed_ms == pytest.approx(0.020)  # one latency: 1000 times less


def test_the_naive_reducer_exposes_all_of_it():
    rng = random.Random(0)
    grads = [om.Grad(f"g{i}", rng.randint(1, 10**6), rng.uniform(0, 50))
             for i in range(40)]
    total = sum(g.numel for g in grads)
    for ln in om.LINKS:
        for w in (2, 8):
            res = om.naive(grads, link=ln, world=w, bytes_per_elem=2, backward_ms=60.0)
            assert res.exposed_ms == pytest.approx(res.comm_ms)
            assert res.comm_ms == pytest.approx(om.allreduce_ms(2 * total, w, ln))
            assert res.spans[0].start_ms == 60.0 and res.hidden_ms == pytest.approx(0.0)


def test_every_gradient_in_exactly_one_bucket():
    grads = [om.Grad("a", 1, 0.0), om.Grad("b", 1, 1.0)]
    for bad in ([[0]], [[0], [0, 1]]):
        with pytest.raises(ValueError, match="exactly one bucket"):
            om.simulate(grads, bad, **KW)


def test_bucket_orders():
    # registered a, b, c; ready c, a, b (as when the backward visits a module twice)
    grads = [om.Grad("a", 10, 2.0), om.Grad("b", 10, 3.0), om.Grad("c", 10, 1.0)]
    assert om.ready_order(grads) == [2, 0, 1]
    assert om.make_buckets(grads, 20) == [[2, 0], [1]]
    assert om.make_buckets(grads, 20, order="registration") == [[2, 1], [0]]
    assert om.make_buckets(grads, 100, first_bucket_elems=10) == [[2], [0, 1]]
    # the registration order's first bucket waits for b, the last to be ready
    reg = om.simulate(grads, om.make_buckets(grads, 20, order="registration"), **KW)
    rdy = om.simulate(grads, om.make_buckets(grads, 20), **KW)
    assert reg.first_start_ms == 3.0 and rdy.first_start_ms == 2.0
    with pytest.raises(ValueError, match="order"):
        om.make_buckets(grads, 20, order="backwards")


# ------------------------------------------------------------------ sanity


@pytest.mark.parametrize("seed", range(5))
def test_more_bandwidth_never_exposes_more(seed):
    rng = random.Random(seed)
    n = rng.randint(5, 60)
    grads = [om.Grad(f"g{i}", rng.randint(1, 3 * 10**6), rng.uniform(0, 100))
             for i in range(n)]
    for cap in (2**18, 2**20, 2**22, 2**40):
        plan = om.make_buckets(grads, cap)
        for w in (2, 8):
            last = float("inf")
            for gbps in (1, 5, 11, 45, 55, 450, 4000):
                ln = om.Link("x", gbps, 15.0, "test")
                res = om.simulate(grads, plan, link=ln, world=w, bytes_per_elem=2)
                assert res.exposed_ms <= last + 1e-9
                assert res.exposed_ms <= om.naive(grads, link=ln, world=w,
                                                  bytes_per_elem=2).exposed_ms + 1e-9
                last = res.exposed_ms


# --------------------------------------------------------- the benchmark, quick


@pytest.fixture(scope="module")
def quick_rows():
    return grad_overlap.run(quick=True, progress=False)


def test_quick_run_times_every_trainable_parameter_once(quick_rows):
    from colossal_lab.benchmarks import steps
    from colossal_lab.config import SWITCH_SETS

    sw = SWITCH_SETS["best"].replace(enable_fused_normalization=True)
    model, _ = steps.build(steps.Setup("x", "x", switches=sw), "tiny", "cpu")
    want = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    params = [r for r in quick_rows if r["kind"] == "param"]
    assert sorted(r["name"] for r in params) == sorted(want)  # each exactly once
    bwd = next(r for r in quick_rows if r["kind"] == "backward")
    assert bwd["timing"] == "perf_counter" and bwd["params"] == len(want)
    for r in params:
        assert r["numel"] == want[r["name"]]
        assert r["steps"] == bwd["steps_timed"]
        assert r["ready_ms_p10"] <= r["ready_ms"] <= r["ready_ms_p90"]
        assert 0 <= r["ready_ms"]
        assert r["ready_ms"] <= bwd["backward_ms_p90"]
    places = sorted(r["ready_place"] for r in params)
    assert places == list(range(len(params)))
    # the backward produces the output head's gradient first, the embedding's last
    first = min(params, key=lambda r: r["ready_place"])
    last = max(params, key=lambda r: r["ready_place"])
    assert first["name"] == "lm_head.weight"
    assert last["name"] == "model.embed_tokens.weight"


def test_quick_run_models_every_configuration(quick_rows):
    model = [r for r in quick_rows if r["kind"] == "model"]
    got = {(r["bucket"], r["order"], r["link"], r["world"], r["dtype"]) for r in model}
    assert len(got) == len(model)
    want = {(b.label, None if b.flat else o, ln.name, w, d)
            for b in grad_overlap.QUICK_BUCKETS for o in grad_overlap.ORDERS
            for ln in om.LINKS for w in grad_overlap.WORLDS for d in grad_overlap.DTYPES}
    assert got == want
    for r in model:
        assert 0 <= r["exposed_ms"] <= r["comm_ms"] + 1e-9
        assert 0 <= r["exposed_share"] < 1
        if r["bucket"] == "flat":
            assert r["buckets"] == 1 and r["exposed_ms"] == pytest.approx(r["comm_ms"])


def test_plots(quick_rows):
    grads, bwd, _ = grad_overlap.grads_of(quick_rows)
    res = om.simulate(grads, om.make_buckets(grads, 12 * 1024), link=om.LINKS[-1],
                      world=8, bytes_per_elem=2, backward_ms=bwd)
    fig = om.plot_timeline(res, grads, title="t", names={0: "embedding"})
    assert fig.get_size_inches()[0] <= 9
    fig = om.plot_exposed(quick_rows)
    assert fig.get_size_inches()[0] <= 9 and len(fig.axes) == len(grad_overlap.WORLDS)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()
              if not ln.get_label().startswith("_")]
    assert labels == [ln.name for ln in om.LINKS]
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_timeline_from_events():
    """The GPU path: events recorded in the hooks, read after each step; the output
    head's gradient first, the embedding's last, every one inside the backward."""
    rows = grad_overlap.measure_timeline("tiny", 64, 2, warmup=1, iters=3,
                                         device="cuda", progress=False)
    bwd = next(r for r in rows if r["kind"] == "backward")
    params = sorted((r for r in rows if r["kind"] == "param"),
                    key=lambda r: r["ready_ms"])
    assert bwd["timing"] == "cuda_events" and bwd["steps_timed"] == 3
    assert all(r["steps"] == 3 and 0 <= r["ready_ms"] <= bwd["backward_ms_p90"]
               for r in params)
    assert params[0]["name"] == "lm_head.weight"
    assert params[-1]["name"] == "model.embed_tokens.weight"
    assert 0 < bwd["backward_ms"] < bwd["step_ms"]
