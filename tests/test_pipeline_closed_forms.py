"""The schedules against the zero-bubble paper's closed forms, for equal and for measured
F, B, W.

Qi et al., "Zero Bubble Pipeline Parallelism", Table 1: with p uniform stages, no
latency and costs F, B (input gradient), W (weight gradient) per stage, a stage idles

* 1F1B: (p − 1)(F + B + W),
* ZB-H1: (p − 1)(F + B − W), at 1F1B's peak memory (p micro-batches),
* ZB-H2: (p − 1)(F + B − 2W), with up to 2p − 1 micro-batches.

The paper's "bubble" is a stage's idle time within the step: the makespan minus the
stage's own work. With uniform stages every rank does the same work in the same
makespan, so the idle time is the same on every rank; the tests take the largest (the
stricter reading, and the one that sets the step time) and check it equals the mean.

The measured costs are a LLaMA-7B decoder layer's on an H200 (`MEASURED`), one layer
per stage, no head: W is shorter than F and B (W is the linears' weight gradients, B
also holds attention's backward), the case where a W started in a gap too short for it
holds up the critical path. ZB-V has no closed form for unequal costs; it is held to
ZB-H1's (same memory, twice the chunks) and above its own floor, the ramp (p − 1)F/2.
"""

from __future__ import annotations

import pytest

from colossal_lab.parallel.pipeline import schedules as sch
from colossal_lab.parallel.pipeline.simulate import simulate
from colossal_lab.parallel.pipeline.validate import peak_activations, validate

UNIFORM = (1.0, 1.0, 1.0)
MEASURED = (3.56, 3.44, 2.47)
"""F, B, W of one LLaMA-7B layer on an H200 in ms, as results/h200/pipeline_sim.json
records them (rounded)."""
COSTS = {"uniform": UNIFORM, "measured": MEASURED}
CASES = [(p, m) for p in (2, 4, 8) for m in (2 * p, 4 * p)]
RTOL = 0.05


def idle(schedule: sch.Schedule, f: float, b: float, w: float) -> float:
    """The paper's bubble of `schedule` under uniform costs: the largest idle time of
    a rank (makespan minus its own work), checked equal to the mean."""
    per_rank = simulate(schedule, f, b, w).idle
    assert max(per_rank) == pytest.approx(sum(per_rank) / len(per_rank), abs=1e-9)
    return max(per_rank)


def one_f_one_b_form(p, f, b, w):
    return (p - 1) * (f + b + w)


def zb_h1_form(p, f, b, w):
    return (p - 1) * (f + b - w)


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p,m", CASES)
def test_1f1b_bubble_is_the_closed_form(p, m, costs):
    f, b, w = COSTS[costs]
    got = idle(sch.one_f_one_b(p, m), f, b, w)
    assert got == pytest.approx(one_f_one_b_form(p, f, b, w), rel=RTOL)


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p,m", CASES)
def test_zb_h1_bubble_is_the_closed_form(p, m, costs):
    """ZB-H1 built for the costs it is timed with idles (p − 1)(F + B − W), and so does
    the order built for F = B = W (it does not depend on the costs), at 1F1B's peak."""
    f, b, w = COSTS[costs]
    form = zb_h1_form(p, f, b, w)
    built = sch.zb_h1(p, m, f=f, b=b, w=w)
    assert idle(built, f, b, w) == pytest.approx(form, rel=RTOL)
    assert idle(sch.zb_h1(p, m), f, b, w) == pytest.approx(form, rel=RTOL)
    assert idle(built, f, b, w) < idle(sch.one_f_one_b(p, m), f, b, w)
    assert max(peak_activations(built)) <= p
    validate(built)


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("p,m", CASES)
def test_zbv_no_worse_than_zb_h1_form(p, m, costs):
    """ZB-V (1F1B's memory) idles no more than ZB-H1's closed form, and not less than
    its ramp: the last rank waits for p − 1 chunk forwards of F/2."""
    f, b, w = COSTS[costs]
    s = sch.zb_v(p, m, f=f, b=b, w=w)
    got = idle(s, f, b, w)
    assert got <= zb_h1_form(p, f, b, w) + 1e-6 * (f + b + w)
    assert got >= (p - 1) * f / 2 - 1e-9
    assert max(peak_activations(s)) <= p
    validate(s)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_zb_h1_when_w_exceeds_f(p, m):
    """W > F: rank 0 cannot start its first B before pF + (p − 1)B, so it idles
    (p − 1)B at least, more than (p − 1)(F + B − W); the order reaches that bound."""
    f, b, w = 1.0, 1.0, 2.0
    assert idle(sch.zb_h1(p, m, f=f, b=b, w=w), f, b, w) == pytest.approx((p - 1) * b)


def test_measured_zb_h1_gap_is_the_one_reported():
    """The figures the closed forms are checked against, spelled out at p = 4 and 8."""
    f, b, w = MEASURED
    assert zb_h1_form(4, f, b, w) == pytest.approx(13.59)
    assert zb_h1_form(8, f, b, w) == pytest.approx(31.71)
    assert idle(sch.zb_h1(4, 8, f=f, b=b, w=w), f, b, w) == pytest.approx(13.59)
    assert idle(sch.zb_h1(8, 16, f=f, b=b, w=w), f, b, w) == pytest.approx(31.71)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_reaches_the_ramp_with_more_memory(p, m):
    """Measured costs: at 1F1B's memory the V idles more than its ramp (p − 1)F/2; with
    1.5 times that memory the same scheduler reaches the ramp, within its cap."""
    f, b, w = MEASURED
    ramp = (p - 1) * f / 2
    assert idle(sch.zb_v(p, m, f=f, b=b, w=w), f, b, w) > ramp * 1.05
    wide = sch.zb_v(p, m, f=f, b=b, w=w, memory=1.5)
    assert idle(wide, f, b, w) == pytest.approx(ramp, rel=1e-6)
    assert p < max(peak_activations(wide)) <= 1.5 * p
    validate(wide)


def test_memory_and_costs_through_make():
    f, b, w = MEASURED
    costs = {"f": f, "b": b, "w": w}
    assert sch.make("zbv", 4, 8, costs=costs, memory=1.5).programs == \
        sch.zb_v(4, 8, f=f, b=b, w=w, memory=1.5).programs
    assert sch.make("zbv", 4, 8, costs=costs).programs == sch.zb_v(4, 8, f=f, b=b,
                                                                   w=w).programs
    assert sch.zb_v(4, 8, memory=1.0).programs == sch.zb_v(4, 8).programs
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):  # orders free of costs
        assert sch.make(name, 4, 8, costs=costs) == sch.make(name, 4, 8)


@pytest.mark.parametrize("call,match", [
    (lambda: sch.zb_v(4, 8, memory=0.5), r"memory=0.5 must be a finite number >= 1.0"),
    (lambda: sch.zb_v(4, 8, memory=float("nan")), "memory=nan must be"),
    (lambda: sch.zb_v(4, 8, memory=True), "memory=True must be"),
    (lambda: sch.make("1f1b", 4, 8, memory=1.5), r"memory=1.5 is ZB-V's .* use 'zbv'"),
    (lambda: sch.zb_v(4, 8, f=[1.0] * 3), r"f has 3 entries; .* per virtual stage \(8\)"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
