"""Pipeline schedules as data: the generators, the validator and the simulator.

Conventions of the closed forms checked here: costs are per rank's share of the model,
F = B = W = 1, so a full backward (GPipe, 1F1B, interleaved) costs 2; a chunk of a
v-chunk schedule costs 1/v of that; no p2p latency; the bubble is idle over total time.
"""

import matplotlib
import pytest

matplotlib.use("Agg")

from colossal_lab.parallel.pipeline import schedules as sch  # noqa: E402
from colossal_lab.parallel.pipeline.schedules import (
    Action,
    Schedule,
    ScheduleError,
)
from colossal_lab.parallel.pipeline.simulate import (
    bubble_arithmetic,
    plot_bubbles,
    plot_gallery,
    plot_gantt,
    simulate,
)
from colossal_lab.parallel.pipeline.validate import (
    activation_profile,
    peak_activations,
    validate,
)

GRID = [(p, m) for p in (2, 3, 4) for m in range(p, 2 * p + 2)]
NAMES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


def every_schedule():
    for p, m in GRID:
        for name in NAMES:
            if name == "interleaved" and m % p:
                continue
            yield name, p, m


def program(*ranks: str) -> tuple:
    return tuple(sch.parse_program(t) for t in ranks)


def broken(s: Schedule, rank: int, text: str) -> Schedule:
    """`s` with rank `rank`'s program replaced by `text`."""
    progs = list(s.programs)
    progs[rank] = sch.parse_program(text)
    return Schedule(s.name, s.num_microbatches, s.placement, tuple(progs), s.split_backward)


# ------------------------------------------------------------------------ generators


@pytest.mark.parametrize("name,p,m", list(every_schedule()))
@pytest.mark.parametrize("p2p", ["blocking", "batched"])
def test_every_schedule_is_valid(name, p, m, p2p):
    s = sch.make(name, p, m, chunks=2)
    report = validate(s, p2p=p2p)
    assert report.num_ranks == p and report.num_microbatches == m
    assert s.num_stages == p * (2 if name in ("interleaved", "zbv") else 1)
    kinds = sorted({a.kind for prog in s.programs for a in prog})
    assert kinds == (["B", "F", "W"] if name.startswith("zb") else ["B", "F"])
    lowered = s.lower()
    assert lowered.has_comms and validate(lowered, p2p=p2p).messages == report.messages


def test_interleaved_with_three_chunks_and_one_rank():
    validate(sch.interleaved_1f1b(3, 6, chunks=3))
    for name in NAMES:  # one rank: no transfers at all
        s = sch.make(name, 1, 3)
        assert validate(s).messages == 0 and not s.lower().has_comms


def test_v_placement_and_chunks():
    s = sch.zb_v(4, 4)
    assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.stages_of(0) == [0, 7] and s.chunk_of(7) == 1 and s.chunk_of(3) == 0
    assert sch.interleaved_1f1b(4, 4).placement == (0, 1, 2, 3) * 2


def test_1f1b_warm_up_and_action_text():
    s = sch.one_f_one_b(4, 8)
    assert [str(a) for a in s.programs[0][:5]] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    assert [str(a) for a in s.programs[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    assert Action.parse("12RECV_B3") == Action("RECV_B", 3, 12)
    assert all(Action.parse(str(a)) == a for prog in sch.zb_v(2, 3).lower().programs
               for a in prog)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F3")


@pytest.mark.parametrize("call,match", [
    (lambda: sch.one_f_one_b(0, 4), r"p \(pipeline ranks\) = 0"),
    (lambda: sch.gpipe(2, 0), r"m \(micro-batches\) = 0"),
    (lambda: sch.zb_v(2.5, 4), "positive integer"),
    (lambda: sch.zb_h1(True, 4), "positive integer"),
    (lambda: sch.interleaved_1f1b(4, 6), r"m % p == 0.*m=6, p=4: choose m = 4 or 8"),
    (lambda: sch.interleaved_1f1b(4, 3), "choose m = 4$"),
    (lambda: sch.interleaved_1f1b(4, 8, chunks=1), "chunks=1 must be an integer >= 2"),
    (lambda: sch.make("dualpipe", 4, 8), "unknown schedule 'dualpipe'"),
    (lambda: sch.greedy("x", 2, (0, 1), live_cap=[1, 1], f=0.0), "must be > 0"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------- validator


def test_missing_w_is_caught():
    s = sch.zb_h1(2, 2)
    text = " ".join(str(a) for a in s.programs[1] if str(a) != "1W1")
    with pytest.raises(ScheduleError, match=r"missing W of micro-batch 1 at stage 1 "
                                            r"\(1W1\) on rank 1"):
        validate(broken(s, 1, text))


def test_duplicate_wrong_rank_and_w_in_full_backward():
    s = sch.one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(broken(s, 0, "0F0 0F1 0B0 0B1 0B1"))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(broken(s, 0, "0F0 0F1 0B0 0B1 1F0"))
    with pytest.raises(ScheduleError, match=r"folds W into B \(split_backward=False\)"):
        validate(broken(s, 0, "0F0 0F1 0B0 0W0 0B1"))
    with pytest.raises(ScheduleError, match="micro-batch 5; there are 2"):
        validate(broken(s, 0, "0F0 0F1 0B0 0B1 0F5"))


def test_swapped_dependency_on_one_rank():
    s = sch.one_f_one_b(2, 2)  # rank 1 runs B0 before the F0 it needs
    with pytest.raises(ScheduleError, match=r"rank 1 runs B \(full backward\) of "
                                            r"micro-batch 0 at stage 1 \(1B0\) before F of "
                                            r"micro-batch 0 at stage 1 \(1F0\)"):
        validate(broken(s, 1, "1B0 1F0 1F1 1B1"))
    z = sch.zb_h1(2, 2)  # W before its B
    with pytest.raises(ScheduleError, match=r"runs W of micro-batch 0 at stage 0 \(0W0\) "
                                            r"before B of micro-batch 0"):
        validate(broken(z, 0, "0F0 0F1 0W0 0B0 0B1 0W1"))


def test_swapped_dependency_across_ranks():
    # rank 0 wants B0 (needs rank 1's B0, which comes after rank 1's F1, which needs
    # F1 from rank 0) before it runs F1
    s = sch.gpipe(2, 2)
    with pytest.raises(ScheduleError, match=r"wait on each other: rank 0 at 0B0 waits for "
                                            r"1B0 on rank 1; rank 1 at 1F1 waits for 0F1 "
                                            r"on rank 0"):
        validate(broken(s, 0, "0F0 0B0 0F1 0B1"))


def test_deadlocking_send_order_blocking():
    """Receives placed right before use: rank 0 sends F1 while rank 1 sends the gradient
    of micro-batch 0 back; with blocking sends each waits for the other's receive."""
    late = sch.one_f_one_b(2, 2).lower("late")
    with pytest.raises(ScheduleError, match=r"deadlock under blocking point-to-point: "
                                            r"rank 0 blocks in 0SEND_F1 \(to rank 1\); "
                                            r"rank 1 blocks in 1SEND_B0 \(to rank 0\)"):
        validate(late)
    validate(late, p2p="batched")  # batched send+recv (batch_isend_irecv) gets through
    validate(sch.one_f_one_b(2, 2))  # eager receives get through one call at a time


def test_deadlocking_send_order_batched():
    s = sch.gpipe(2, 2)  # rank 0 holds F1's activation back until after B0
    explicit = Schedule(s.name, 2, s.placement, program(
        "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0SEND_F1 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"), False)
    with pytest.raises(ScheduleError, match="deadlock under batched point-to-point: "
                                            r"rank 0 blocks in 0RECV_B0 \(from rank 1\); "
                                            r"rank 1 blocks in 1RECV_F1 \(from rank 0\)"):
        validate(explicit, p2p="batched")
    with pytest.raises(ScheduleError, match="deadlock under batched"):
        validate(sch.interleaved_1f1b(2, 4).lower("late"), p2p="batched")


def test_messages_out_of_order():
    s = sch.gpipe(2, 2)
    swapped = Schedule(s.name, 2, s.placement, program(
        "0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"), False)
    with pytest.raises(ScheduleError, match=r"out of order from rank 0 to rank 1: message 0 "
                                            r"sent is the activation of micro-batch 1"):
        validate(swapped, p2p="batched")
    # ZB-V's links carry both directions: late receives cross them
    with pytest.raises(ScheduleError, match="out of order"):
        validate(sch.zb_v(2, 4).lower("late"), p2p="batched")


def test_missing_or_misplaced_transfers():
    s = sch.gpipe(2, 1)
    no_recv = Schedule(s.name, 1, s.placement, program(
        "0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"), False)
    with pytest.raises(ScheduleError, match="without receiving 0F0 from rank 0 first"):
        validate(no_recv)
    early_send = Schedule(s.name, 1, s.placement, program(
        "0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"), False)
    with pytest.raises(ScheduleError, match="before computing it"):
        validate(early_send)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("p,m", GRID)
def test_peak_activations(p, m):
    assert peak_activations(sch.gpipe(p, m)) == (m,) * p
    one = peak_activations(sch.one_f_one_b(p, m))
    assert one == tuple(p - r for r in range(p))  # <= p, rank 0 holds the most
    assert peak_activations(sch.zb_h1(p, m)) == (p,) * p  # 1F1B's rank-0 peak everywhere
    assert max(peak_activations(sch.zb_v(p, m))) <= p
    # W keeping none of the stash: ZB-H1 is then exactly 1F1B per rank
    assert peak_activations(sch.zb_h1(p, m), w_stash=0.0) == one


def test_activation_profile_returns_to_zero():
    for name, p, m in every_schedule():
        assert all(abs(t[-1]) < 1e-9 for t in activation_profile(sch.make(name, p, m)))
    with pytest.raises(ValueError, match="w_stash"):
        activation_profile(sch.zb_v(2, 2), w_stash=1.5)


# ------------------------------------------------------------------------ simulator


def test_1f1b_bubble_matches_closed_form_and_seed_arithmetic():
    tl = simulate(sch.one_f_one_b(4, 8), f=1.0, b=1.0, w=1.0)
    assert tl.bubble == pytest.approx(3 / 11, abs=1e-9)  # (p-1)/(m+p-1) = 27.3%
    assert tl.bubble_over_useful == pytest.approx(3 / 8, abs=1e-9)  # the seed's (p-1)/m
    assert tl.makespan == 33.0 and tl.idle == (9.0,) * 4
    got = bubble_arithmetic(4, 8)
    assert got["seed_formula"] == 0.375
    assert got["simulated_idle_over_total"] == pytest.approx(got["idle_over_total"], abs=1e-9)
    assert got["simulated_idle_over_useful"] == pytest.approx(0.375, abs=1e-9)
    assert "27.3%" in got["meaning"] and "37.5%" in got["meaning"]


@pytest.mark.parametrize("p,m", GRID + [(4, 8), (8, 16), (8, 32)])
def test_closed_form_bubbles(p, m):
    """F = B = W: 1F1B and GPipe (p−1)/(m+p−1); ZB-H1 (p−1)/(3m+p−1), a third of
    1F1B's idle time; ZB-V the ramp alone, (p−1)/(6m+p−1) (the bound: the last rank
    cannot start before p − 1 chunk forwards of 1/2 each); interleaved-2
    (p−1)/(2m+p−1)."""
    def bubble(s):
        return simulate(s).bubble
    assert bubble(sch.one_f_one_b(p, m)) == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert bubble(sch.gpipe(p, m)) == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    zb1 = bubble(sch.zb_h1(p, m))
    assert zb1 == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)
    assert zb1 < bubble(sch.one_f_one_b(p, m))
    zbv = bubble(sch.zb_v(p, m))
    assert zbv == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9)
    if m % p == 0:
        assert bubble(sch.interleaved_1f1b(p, m)) == pytest.approx(
            (p - 1) / (2 * m + p - 1), abs=1e-9)


def test_zbv_near_zero_and_ordering_at_p4_m8():
    b = {n: simulate(sch.make(n, 4, 8)).bubble for n in NAMES}
    assert b["zbv"] < 0.06  # (4-1)/(48+3) = 5.9%
    assert b["zbv"] < b["zb-h1"] < b["interleaved"] < b["1f1b"] == b["gpipe"]


def test_simulator_costs_latency_and_per_stage_times():
    s = sch.one_f_one_b(2, 2)
    base = simulate(s)
    slow = simulate(s, comm=0.5)
    # exposed latency: F0's activation going out and B1's gradient coming back
    assert slow.makespan == base.makespan + 2 * 0.5
    per_stage = simulate(s, f=[1.0, 2.0], b=[1.0, 2.0], w=[1.0, 2.0])
    assert per_stage.makespan > base.makespan
    with pytest.raises(ValueError, match="one per virtual stage"):
        simulate(s, f=[1.0, 2.0, 3.0])
    # a chunk of a 2-chunk schedule takes half the time of the rank's share
    v = simulate(sch.zb_v(2, 2))
    assert {sp.end - sp.start for row in v.spans for sp in row} == {0.5}
    # the spans respect every dependency and each rank's order
    for row in simulate(sch.zb_v(3, 5), f=1.0, b=1.3, w=0.7, comm=0.1).spans:
        assert all(a.end <= b.start + 1e-12 for a, b in zip(row, row[1:]))


def test_simulate_rejects_bad_order():
    with pytest.raises(ScheduleError, match="before"):
        simulate(broken(sch.one_f_one_b(2, 2), 1, "1B0 1F0 1F1 1B1"))


def test_greedy_built_for_other_costs_is_valid():
    for p, m in [(2, 3), (4, 8)]:
        for gen in (sch.zb_h1, sch.zb_v):
            s = gen(p, m, f=1.0, b=1.5, w=0.5, comm=0.1)
            validate(s)
            assert simulate(s, 1.0, 1.5, 0.5, 0.1).bubble < simulate(
                sch.one_f_one_b(p, m), 1.0, 1.5, 0.5, 0.1).bubble


# ------------------------------------------------------------------------------ plots


def test_gantt_is_readable():
    tl = simulate(sch.zb_v(4, 8))
    ax = plot_gantt(tl)
    assert ax.figure.get_size_inches()[0] <= 9
    numbers = [t.get_text() for t in ax.texts]
    assert set(numbers) <= {str(i) for i in range(8)} and len(numbers) > 50
    assert len(ax.patches) == len([sp for row in tl.spans for sp in row])
    assert "bubble 5.9%" in ax.get_title()


def test_static_figures():
    fig = plot_gallery(4, 8)
    assert fig.get_size_inches()[0] <= 9 and len(fig.axes) == 5
    ax = plot_bubbles(4, range(4, 17, 4))
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert {"1f1b", "zb-h1", "zbv", "interleaved-2", "(p−1)/(m+p−1)"} <= set(labels)


def test_explorer_updates():
    pytest.importorskip("ipywidgets")
    from colossal_lab.parallel.pipeline.simulate import explorer

    box = explorer(p=4, m=8, schedule="1f1b")
    text = box.children[-2]
    assert "bubble 27.3%" in text.value
    box.children[0].children[0].value = "interleaved"
    box.children[1].children[1].value = 6  # m % p != 0: the error, not a crash
    assert "m % p == 0" in text.value
    box.children[1].children[1].value = 8
    assert "interleaved-2" in text.value
