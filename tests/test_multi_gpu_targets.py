"""The issues' targets (#20 on two GPUs, #21 on four) read off each multi-GPU
benchmark's rows by its `targets`, and the lines `two_gpu.format_targets` prints.

The rows are built by hand in the shape each `run_ranks` gives them, their derived
fields (ratios, ``loss_ok``, ``grad_ok``, E, the communication share) computed by the
benchmark's own formulas; each check is driven to a pass, to a miss at one named point,
and to "not measured" (a row absent, failed or skipped), with figures just either side
of its threshold."""

import math

import pytest

from colossal_lab.benchmarks import composed_2x2 as cz
from colossal_lab.benchmarks import composed_parallel as cp
from colossal_lab.benchmarks import grad_overlap_measured as gom
from colossal_lab.benchmarks import pipeline_measured as pm
from colossal_lab.benchmarks import sequence_parallel_step as sps
from colossal_lab.benchmarks import two_gpu

OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
KEYS = {"check", "target", "ok", "points", "measured", "worst", "at", "failing",
        "unmeasured"}


def by_check(checks: list[dict], word: str) -> dict:
    """The one check whose text holds `word`."""
    (hit,) = [c for c in checks if word in c["check"]]
    return hit


def assert_shape(checks: list[dict]) -> None:
    for c in checks:
        assert KEYS <= set(c), c
        assert c["ok"] in (True, False, None)
        assert (c["ok"] is None) == ("why" in c) or c["target"] is None, c
        if c["ok"] is False:
            assert c["failing"], c


# ------------------------------------------------------------------ the verdict itself


def test_threshold_a_miss_outranks_a_gap_and_nothing_seen_passes_nothing():
    t = two_gpu.threshold
    assert t("x", 1.0, [("a", 1.2), ("b", 1.0)])["ok"] is True  # >= is inclusive
    miss = t("x", 1.0, [("a", 1.2), ("b", 0.99)], unmeasured=[("c", "no row")])
    assert miss["ok"] is False and miss["failing"] == [{"at": "b", "measured": 0.99}]
    assert (miss["worst"], miss["measured"], miss["at"]) == (0.99, 0.99, "b")
    gap = t("x", 1.0, [("a", 1.2)], unmeasured=[("c", "no row")])
    assert gap["ok"] is None and gap["why"] == "c: no row" and gap["worst"] == 1.2
    assert t("x", 1.0, [], empty="nothing ran")["why"] == "nothing ran"
    low = t("x", 0.6, [("a", 0.5), ("b", 0.6)], at_most=True)
    assert low["ok"] is True and (low["worst"], low["at"]) == (0.6, "b")
    assert t("x", 1.0, [("a", math.nan)])["ok"] is False
    assert t("x", 1.0, [("a", None)])["ok"] is False
    # a row's own verdict wins over the comparison
    assert t("x", 1.0, [("a", 2.0, False)])["ok"] is False


def test_format_targets_one_line_each():
    checks = [two_gpu.threshold("fast", 1.1, [("seq 4096", 1.2), ("seq 8192", 1.15)]),
              two_gpu.threshold("small", 0.6, [("seq 4096", 0.7)], at_most=True),
              two_gpu.threshold("loss", 5e-3, [], unmeasured=[("ring", "error: OOM")],
                                skipped=[{"at": "symm_mem", "why": "skipped: no ops"}]),
              {"check": "dp2: MFU", "target": None, "ok": None, "points": 2,
               "measured": 0.93, "worst": 0.9, "at": "dp2-overlap", "failing": [],
               "unmeasured": []}]
    lines = two_gpu.format_targets(checks).splitlines()
    assert lines == [
        "met: fast: worst 1.15 (seq 8192, of 2 points)",
        "NOT met: small: 0.7 (seq 4096); failing: seq 4096 (0.7)",
        "not measured: loss: ring: error: OOM; skipped: symm_mem",
        "reported: dp2: MFU: 0.93 (dp2-overlap; lowest 0.9)"]


def test_gap_names_why_a_row_has_no_figure():
    assert two_gpu.gap(None) == "no row"
    assert two_gpu.gap({"error": "a | b | RuntimeError: boom"}).startswith(
        "error: RuntimeError: boom")
    assert two_gpu.gap({"skipped": "no symm_mem"}) == "skipped: no symm_mem"
    assert two_gpu.gap({"step_ms": 1.0}) is None
    assert two_gpu.world_of([{"kind": "costs"}, {"world": 4}]) == 4
    assert two_gpu.world_of([{"world": 4}], 2) == 2


# -------------------------------------------------------------- sequence_parallel_step


def pick(figures: dict, point, case: str, default):
    """A synthetic row's figure: `figures` by (point, case), else by case, else
    `default`."""
    return figures.get((point, case), figures.get(case, default))



def sp_rows(world: int = 2, *, ms=None, act=None, loss2=None, errors=None,
            seqs=(4096, 8192)) -> list[dict]:
    """Rows as `sps.run_ranks` makes them: plain TP at 100 ms and 10 GiB saved, the SP
    modes at `ms` / `act` (by (seq, mode)), symm_mem skipped, step-2 losses `loss2`;
    `errors`: the (seq, mode) that failed."""
    ms = {"split_gather": 98.0, "ring": 90.0, **(ms or {})}
    act = {"split_gather": 5.0, "ring": 5.0, **(act or {})}
    loss2, errors = loss2 or {}, errors or ()
    rtol = two_gpu.LOSS_RTOL["bf16-pure"]
    rows = []
    for seq in seqs:
        base = None
        for mode in sps.MODES:
            row = {"mode": mode, "seq_len": seq, "batch": sps.BATCH[seq], "tp": world,
                   "world": world, "preset": sps.PRESET, "precision": "bf16-pure",
                   "loss_rtol": rtol}
            if mode == "symm_mem":
                rows.append({**row, "skipped": "no symm_mem: torch lacks the ops"})
                continue
            if (seq, mode) in errors:
                rows.append({**row, "error": OOM})
                continue
            row.update(step_ms=pick(ms, seq, mode, 100.0),
                       activation_gib=pick(act, seq, mode, 10.0),
                       loss_step1=10.4, loss_step2=pick(loss2, seq, mode, 10.0))
            if mode == "all_reduce":
                base = row
            if base is not None:
                sps.compare_to_plain(row, base, rtol)
            rows.append(row)
    return rows


def test_sequence_parallel_targets_met_at_two():
    checks = sps.targets(sp_rows())
    assert_shape(checks)
    assert [c["ok"] for c in checks] == [True, True, True]
    ring = by_check(checks, "ring >=")
    assert ring["target"] == 1.08 and ring["points"] == 2
    assert ring["worst"] == pytest.approx(100 / 90)
    act = by_check(checks, "activations")
    assert act["target"] == 0.6 and act["points"] == 4 and act["worst"] == 0.5
    loss = by_check(checks, "loss")
    assert loss["points"] == 4  # split_gather, ring at two lengths; not plain TP itself
    assert loss["skipped"] == [
        {"at": f"symm_mem at seq {s}", "why": "skipped: no symm_mem: torch lacks the ops"}
        for s in (4096, 8192)]


def test_sequence_parallel_ring_missed_at_one_length():
    # 100 / 93 = 1.075: under 1.08 at seq 8192 only
    checks = sps.targets(sp_rows(ms={(8192, "ring"): 93.0}))
    ring = by_check(checks, "ring >=")
    assert ring["ok"] is False and ring["at"] == "ring at seq 8192"
    assert ring["failing"] == [{"at": "ring at seq 8192", "measured": pytest.approx(100 / 93)}]
    assert ring["measured"] == ring["worst"] == pytest.approx(100 / 93)
    assert by_check(checks, "activations")["ok"] is True


@pytest.mark.parametrize("ring_ms, at_two, at_four", [(90.0, True, True),
                                                      (92.0, True, False),  # x1.087
                                                      (93.0, False, False)])  # x1.075
def test_sequence_parallel_target_follows_the_world(ring_ms, at_two, at_four):
    rows = sp_rows(4, ms={"ring": ring_ms})
    four = sps.targets(rows)  # the rows' world: TP 4, no activation target
    assert len(four) == 2 and "TP = 4" in four[0]["check"] and four[0]["target"] == 1.1
    assert four[0]["ok"] is at_four
    assert by_check(sps.targets(rows, 2), "ring >=")["ok"] is at_two


def test_sequence_parallel_activation_missed():
    checks = sps.targets(sp_rows(act={(4096, "split_gather"): 6.1}))
    act = by_check(checks, "activations")
    assert act["ok"] is False
    assert act["failing"] == [{"at": "split_gather at seq 4096",
                               "measured": pytest.approx(0.61)}]


def test_sequence_parallel_failed_rows_are_not_measured():
    checks = sps.targets(sp_rows(errors=[(8192, "ring")]))
    ring = by_check(checks, "ring >=")
    assert ring["ok"] is None and ring["points"] == 1
    assert ring["why"].startswith("ring at seq 8192: error: OutOfMemoryError")
    assert by_check(checks, "activations")["ok"] is None
    assert by_check(checks, "loss")["ok"] is None
    # a miss elsewhere still fails the check
    checks = sps.targets(sp_rows(ms={(4096, "ring"): 99.0}, errors=[(8192, "ring")]))
    assert by_check(checks, "ring >=")["ok"] is False
    # plain TP failed: nothing to compare with at that length
    ring = by_check(sps.targets(sp_rows(errors=[(4096, "all_reduce")])), "ring >=")
    assert ring["ok"] is None and "plain TP: error" in ring["why"]
    assert [u["at"] for u in ring["unmeasured"]] == ["ring at seq 4096"]


def test_sequence_parallel_without_allocator_statistics():
    checks = sps.targets(sp_rows(act={"all_reduce": None, "split_gather": None,
                                      "ring": None}))
    act = by_check(checks, "activations")
    assert act["ok"] is None and "no act_vs_tp" in act["why"]


def test_sequence_parallel_loss_missed():
    rtol = two_gpu.LOSS_RTOL["bf16-pure"]
    # ring's step-2 loss just past rtol · |plain TP's|: fails; just inside: passes
    bad = sps.targets(sp_rows(loss2={(4096, "ring"): 10.0 * (1 + 1.01 * rtol)}))
    loss = by_check(bad, "loss")
    assert loss["ok"] is False and loss["target"] == rtol
    assert [f["at"] for f in loss["failing"]] == ["ring at seq 4096"]
    assert loss["worst"] == pytest.approx(1.01 * rtol)
    good = sps.targets(sp_rows(loss2={(4096, "ring"): 10.0 * (1 + 0.99 * rtol)}))
    assert by_check(good, "loss")["ok"] is True


def test_sequence_parallel_no_rows():
    (loss,) = sps.targets([])
    assert loss["ok"] is None and loss["why"] == "no rows"
    checks = sps.targets([], 2)
    assert [c["ok"] for c in checks] == [None] * 3 and all(c["why"] for c in checks)


# ------------------------------------------------------------------- pipeline_measured


def pp_rows(p: int = 2, ms=(4, 8, 16), *, step=None, bubble=None, sim=None, grad=None,
            errors=(), skipped=("torch-zbv",)) -> list[dict]:
    """Rows as `pm.run_ranks` makes them: per (m, schedule) its step time, measured and
    simulated bubble, gradient difference (over the largest gradient), 1F1B at 400 ms;
    `errors` fail, `skipped` have no class; the costs rows after them."""
    step = {"1f1b": 400.0, "zb-h1": 380.0, "zbv": 350.0, **(step or {})}
    bubble = {"1f1b": 0.16, "zb-h1": 0.12, "zbv": 0.066, **(bubble or {})}
    sim = {"1f1b": 0.159, "zb-h1": 0.1, "zbv": 0.0659, **(sim or {})}
    grad = grad or {}
    grtol = pm.GRAD_RTOL["bf16-pure"]
    rtol = two_gpu.LOSS_RTOL["bf16-pure"]
    rows = []
    for m in ms:
        base = None
        for schedule in pm.SCHEDULES:
            row = {"schedule": schedule, "impl": "torch" if "torch" in schedule else "ours",
                   "p": p, "m": m, "chunks": 2 if "zbv" in schedule else 1,
                   "micro_batch": 1, "batch": m, "seq_len": 4096, "preset": pm.PRESET,
                   "layers": 8, "precision": "bf16-pure", "world": p}

            if schedule in skipped:
                rows.append({**row, "skipped": "torch has no ScheduleZBVZeroBubble"})
                continue
            if (m, schedule) in errors:
                rows.append({**row, "error": OOM})
                continue
            rel = 0.0 if schedule == "1f1b" else grad.get((m, schedule), 1e-3)
            loss = 10.0 + (0.0 if schedule == "1f1b" else 1e-4)
            if schedule == "1f1b":
                base, ref_loss = row, loss
            if base is not None:
                row.update(grad_max_abs_diff=rel * 0.5, grad_max_abs=0.5,
                           grad_rel_diff=rel, grad_ok=rel <= grtol, grad_rtol=grtol,
                           loss=loss, loss_diff=abs(loss - ref_loss),
                           loss_ok=abs(loss - ref_loss) <= rtol * abs(ref_loss))
            ours = schedule.removeprefix("torch-")  # torch's ZB-V timed as ours
            row.update(step_ms=pick(step, m, schedule, step[ours]),
                       bubble=pick(bubble, m, schedule, bubble[ours]),
                       bubble_sim=pick(sim, m, schedule, sim[ours]))
            if row["bubble_sim"]:
                row["bubble_vs_sim"] = row["bubble"] / row["bubble_sim"]
            if base is not None:
                row["step_ms_1f1b"] = base["step_ms"]
                row["speedup_vs_1f1b"] = base["step_ms"] / row["step_ms"]
            rows.append(row)
    return rows + [{"kind": "costs", "part": "layer", "f_ms": 3.5},
                   {"kind": "costs", "part": "head", "f_ms": 9.0}]


def test_pipeline_targets_met_at_two():
    checks = pm.targets(pp_rows())
    assert_shape(checks)
    assert [c["ok"] for c in checks] == [True] * 4
    speed = by_check(checks, "1F1B (step_ms")
    assert speed["target"] == 1.1 and speed["at"] == "m = 8" and speed["points"] == 1
    assert speed["measured"] == pytest.approx(400 / 350)
    sim = by_check(checks, "simulator")
    assert "m = 8" in sim["check"] and "|bubble - bubble_sim| <= 0.2 bubble_sim" in \
        sim["check"]
    assert sim["measured"] == pytest.approx(abs(0.066 - 0.0659) / 0.0659)
    assert (sim["bubble"], sim["bubble_sim"]) == (0.066, 0.0659)
    grads = by_check(checks, "gradients")
    assert grads["points"] == 6 and grads["target"] == pm.GRAD_RTOL["bf16-pure"]
    assert [s["at"] for s in grads["skipped"]] == [f"torch-zbv at m = {m}" for m in (4, 8, 16)]


@pytest.mark.parametrize("zbv_ms, ok", [(363.0, True), (364.0, False)])  # 1.102, 1.099
def test_pipeline_speedup_either_side(zbv_ms, ok):
    speed = by_check(pm.targets(pp_rows(step={(8, "zbv"): zbv_ms})), "1F1B (step_ms")
    assert speed["ok"] is ok
    assert speed["failing"] == ([] if ok else [{"at": "m = 8", "measured": 400 / zbv_ms}])


@pytest.mark.parametrize("measured, ok", [(0.078, True), (0.080, False),  # sim 0.066
                                          (0.053, True), (0.052, False)])
def test_pipeline_bubble_within_20_percent_of_the_simulator(measured, ok):
    rows = pp_rows(bubble={(8, "zbv"): measured}, sim={(8, "zbv"): 0.066},
                   step={(4, "zbv"): 500.0})  # another m misses 1.1x: not this check's
    sim = by_check(pm.targets(rows), "simulator")
    assert sim["ok"] is ok and sim["at"] == "m = 8"
    assert sim["measured"] == pytest.approx(abs(measured - 0.066) / 0.066)


def test_pipeline_simulator_without_a_bubble():
    rows = pp_rows(bubble={(8, "zbv"): 0.01}, sim={(8, "zbv"): 0.0})
    sim = by_check(pm.targets(rows), "simulator")
    assert sim["ok"] is False and sim["measured"] == math.inf


@pytest.mark.parametrize("zbv, f1b, ok", [(0.10, 0.36, True), (0.1199, 0.36, True),
                                          (0.121, 0.36, False),
                                          (0.2736, 0.3624, False)])  # the simulator's
def test_pipeline_bubble_third_of_1f1b_at_four(zbv, f1b, ok):
    rows = pp_rows(4, ms=(8, 16, 32), bubble={"zbv": zbv, "1f1b": f1b})
    checks = pm.targets(rows)
    assert len(checks) == 3  # p = 4: the bubble ratio, gradients, loss
    third = by_check(checks, "1/3")
    assert third["target"] == pytest.approx(1 / 3) and "p = 4" in third["check"]
    assert third["ok"] is ok and third["measured"] == pytest.approx(zbv / f1b)


def test_pipeline_1f1b_without_a_bubble_is_no_ratio():
    third = by_check(pm.targets(pp_rows(4, ms=(8,), bubble={"1f1b": -0.02})), "1/3")
    assert third["ok"] is None and "1F1B's measured bubble is -0.02" in third["why"]


def test_pipeline_without_m_8_or_with_a_failed_zbv():
    checks = pm.targets(pp_rows(ms=(4, 16)))  # a run of --ms 4 16
    for c in checks[:2]:
        assert c["ok"] is None and c["why"] == "m = 8: ZB-V no row"
    failed = pm.targets(pp_rows(errors=[(8, "zbv")]))
    speed = by_check(failed, "1F1B (step_ms")
    assert speed["ok"] is None and speed["why"].startswith("m = 8: ZB-V error: OutOfMemory")
    assert by_check(failed, "gradients")["ok"] is None
    base_failed = by_check(pm.targets(pp_rows(errors=[(8, "1f1b")])), "1F1B (step_ms")
    assert base_failed["why"].startswith("m = 8: 1F1B error")


def test_pipeline_gradients_missed_at_one_point():
    rtol = pm.GRAD_RTOL["bf16-pure"]
    checks = pm.targets(pp_rows(grad={(16, "zb-h1"): 1.5 * rtol}))
    grads = by_check(checks, "gradients")
    assert grads["ok"] is False
    assert grads["failing"] == [{"at": "zb-h1 at m = 16", "measured": 1.5 * rtol}]
    assert by_check(checks, "loss")["ok"] is True
    # 1F1B failed at m = 4: the others there have nothing to compare with
    gap = by_check(pm.targets(pp_rows(errors=[(4, "1f1b")])), "gradients")
    assert gap["ok"] is None and "zbv at m = 4: 1F1B: error" in gap["why"]


# --------------------------------------------------------------- grad_overlap_measured


def dp_rows(configs, *, world: int = 2, esize: int = 2, grad_rel=0.0) -> list[dict]:
    """Rows as `gom.measure_config` makes them: `configs` maps (preset, batch, link) to
    (T_nocomm, T_sync, T_overlap, T_backward) in ms (T_backward None: no timeline)."""
    rows = []
    for (preset, batch, link), (t_nc, t_sync, t_ov, bwd) in configs.items():
        for backend, t in (("nocomm", t_nc), ("naive", t_sync), ("overlap", t_ov),
                           ("ddp", t_ov * 1.01), ("fsdp2", t_ov * 1.05)):
            row = {"kind": "dp_step", "preset": preset, "seq_len": 4096, "batch": batch,
                   "world": world, "link": link, "backend": backend,
                   "grad_bytes_per_elem": esize, "step_ms": t, "t_nocomm_ms": t_nc,
                   "t_sync_ms": t_sync, "backward_ms": bwd,
                   "measured_exposed_ms": t - t_nc,
                   "overlap_efficiency": (gom.overlap_efficiency(t_sync, t, t_nc)
                                          if backend in gom.OVERLAPPED else None),
                   "comm_share": gom.comm_share(t_sync, t_nc, bwd)}
            if backend != "nocomm":
                row.update(grad_max_abs_diff_vs_naive=0.0 if backend == "naive"
                           else grad_rel * 0.25, grad_max_abs=0.25)
            rows.append(row)
    return rows


CONFIGS = {("llama-7b-8l", 2, "nvlink"): (300.0, 310.0, 309.0, 200.0),  # 5%: exempt
           ("llama-7b-8l", 2, "host"): (300.0, 400.0, 315.0, 200.0),  # 50%, E 0.85
           ("1b", 4, "sockets"): (100.0, 140.0, 108.0, 66.0)}  # 61%, E 0.8


def test_grad_overlap_targets_met():
    checks = gom.targets(dp_rows(CONFIGS))
    assert_shape(checks)
    e, grads = checks
    assert (e["ok"], grads["ok"]) == (True, True)
    assert e["target"] == 0.8 and e["points"] == 2 and "N = 2" in e["check"]
    assert e["worst"] == pytest.approx(0.8) and e["at"] == "1b batch 4 sockets"
    assert e["exempt"] == [{"at": "llama-7b-8l batch 2 nvlink", "comm_share": 0.05}]
    assert e["comm_share"]["llama-7b-8l batch 2 host"] == pytest.approx(0.5)
    assert grads["points"] == 3 and grads["target"] == gom.GRAD_RTOL[2]


def test_grad_overlap_efficiency_missed_at_one_configuration():
    configs = {**CONFIGS, ("1b", 4, "sockets"): (100.0, 140.0, 108.4, 66.0)}  # E 0.79
    e = gom.targets(dp_rows(configs))[0]
    assert e["ok"] is False
    assert e["failing"] == [{"at": "1b batch 4 sockets", "measured": pytest.approx(0.79)}]


def test_grad_overlap_target_applies_only_from_20_percent():
    # E 0.1 at a 19% share: exempt, so nothing is held to 0.8 and nothing passes
    rows = dp_rows({("1b", 2, "nvlink"): (100.0, 119.0, 117.1, 100.0)})
    e = gom.targets(rows)[0]
    assert e["ok"] is None and "applies nowhere" in e["why"] and e["points"] == 0
    # the same E at 20%: a miss
    rows = dp_rows({("1b", 2, "nvlink"): (100.0, 120.0, 118.0, 100.0)})
    assert gom.targets(rows)[0]["ok"] is False


def test_grad_overlap_share_recomputed_or_unmeasured():
    rows = dp_rows(CONFIGS)
    for r in rows:
        r.pop("comm_share")  # older rows: the share from T_sync, T_nocomm, T_backward
    assert gom.targets(rows)[0] == gom.targets(dp_rows(CONFIGS))[0]
    no_bwd = dp_rows({**CONFIGS, ("1b", 4, "sockets"): (100.0, 140.0, 108.0, None)})
    e = gom.targets(no_bwd)[0]
    assert e["ok"] is None and e["why"] == "1b batch 4 sockets: no comm_share (no backward_ms)"


def test_grad_overlap_missing_overlap_row():
    rows = [r for r in dp_rows(CONFIGS)
            if not (r["link"] == "host" and r["backend"] == "overlap")]
    e, grads = gom.targets(rows)
    assert e["ok"] is None and e["why"] == "llama-7b-8l batch 2 host: overlap no row"
    assert grads["ok"] is None


@pytest.mark.parametrize("esize, rel, ok", [(2, 0.0, True), (2, 0.019, True),
                                            (2, 0.021, False), (4, 0.9e-5, True),
                                            (4, 1.1e-5, False)])
def test_grad_overlap_gradients_equal_naive(esize, rel, ok):
    grads = gom.targets(dp_rows(CONFIGS, esize=esize, grad_rel=rel))[1]
    assert grads["ok"] is ok and grads["target"] == gom.GRAD_RTOL[esize]
    assert grads["worst"] == pytest.approx(rel)


def test_grad_overlap_no_rows():
    e, grads = gom.targets([])
    assert e["why"] == grads["why"] == "no rows"


# ----------------------------------------------------------------- composed_parallel


def cp_row(setup: str, vs: float | None = None, **kw) -> dict:
    kind, variant = cp.layout(setup)
    row = {"kind": cp.KIND, "setup": setup, "layout": kind, "variant": variant,
           "preset": cp.PRESET, "seq_len": 4096, "world": 2}
    if vs is not None:
        row.update(mfu_per_gpu=0.55 * vs, single_gpu_best_mfu=0.55, vs_single_gpu_best=vs)
    return {**row, **kw}


def test_composed_parallel_reports_each_layout():
    rows = [cp_row("dp2-overlap", 0.95), cp_row("dp2-ddp", 0.9),
            cp_row("tp2-ring", 0.7), cp_row("tp2-split_gather", error=OOM),
            cp_row("pp2-zbv", error=OOM), cp_row("pp2-1f1b", skipped="no class")]
    checks = cp.targets(rows, 2)
    assert_shape(checks)
    dp, tp, pp = checks
    for c in checks:
        assert c["target"] is None and c["ok"] is None and c["failing"] == []
    assert (dp["measured"], dp["worst"], dp["at"]) == (0.95, 0.9, "dp2-overlap")
    assert dp["mfu_per_gpu"] == pytest.approx(0.55 * 0.95) and "why" not in dp
    assert tp["points"] == 1 and tp["unmeasured"][0]["at"] == "tp2-split_gather"
    assert "why" in pp and "pp2-zbv: error: OutOfMemoryError" in pp["why"]
    assert "pp2-1f1b: skipped: no class" in pp["why"]
    lines = two_gpu.format_targets(checks).splitlines()
    assert lines[0].startswith("reported: dp2: MFU per GPU") and "0.95 (dp2-overlap" \
        in lines[0]
    assert lines[2].startswith("not measured: pp2")


def test_composed_parallel_without_the_single_gpu_file():
    why = "no results/h200/composed.json: run `python -m colossal_lab bench composed`"
    rows = [cp_row("dp2-overlap", mfu_per_gpu=0.5, vs_single_gpu_best=None,
                   vs_single_gpu_best_why=why)]
    (dp,) = cp.targets(rows)
    assert dp["why"] == f"dp2-overlap: {why}" and dp["mfu_per_gpu"] == 0.5
    (none,) = cp.targets([])
    assert none["why"] == "no rows" and none["target"] is None


# ----------------------------------------------------------------------- composed_2x2


def cz_rows(mfus: dict, **kw) -> list[dict]:
    """Rows as `cz.run_ranks` makes them, `mfus` by setup (a str: that error), then
    the choice row."""
    rows = []
    for setup, mfu in mfus.items():
        kind, variant = cp.layout(setup)
        row = {"kind": cz.KIND, "setup": setup, "layout": kind, "variant": variant,
               "preset": cz.PRESET, "world": 4, "precision": "bf16-pure", **kw}
        if isinstance(mfu, str):
            row["error"] = mfu
        else:
            row.update(mfu_per_gpu=mfu, step_ms=1000.0, target_mfu=cz.TARGET_MFU,
                       meets_target=mfu >= cz.TARGET_MFU)
        rows.append(row)
    return rows + [cz.choice(rows)]


def test_composed_2x2_faster_setup_meets_the_target():
    rows = cz_rows({"dp2tp2-ring": 0.52, "dp2tp2-split_gather": 0.499,
                    "tp2pp2-zbv": OOM, "tp2pp2-1f1b": 0.45})
    checks = cz.targets(rows, 4)
    assert_shape(checks)
    assert [c["check"].split(":")[0] for c in checks] == [
        "the faster setup (choice)", *cz.SETUPS]
    first = checks[0]
    assert first["ok"] is True and first["at"] == "dp2tp2-ring"
    assert (first["measured"], first["target"]) == (0.52, 0.5)
    assert "MFU (6N) >= 0.5 per GPU, llama-7b in bf16" in first["check"]
    per = {c["check"].split(":")[0]: c for c in checks[1:]}
    assert per["dp2tp2-ring"]["ok"] is True
    assert per["dp2tp2-split_gather"]["ok"] is False
    assert per["dp2tp2-split_gather"]["failing"] == [
        {"at": "dp2tp2-split_gather", "measured": 0.499}]
    assert per["tp2pp2-zbv"]["ok"] is None and "OutOfMemoryError" in per["tp2pp2-zbv"]["why"]
    assert per["tp2pp2-1f1b"]["ok"] is False


def test_composed_2x2_faster_setup_misses():
    rows = cz_rows({"dp2tp2-ring": 0.48, "tp2pp2-zbv": 0.49})
    checks = cz.targets(rows)
    assert checks[0]["ok"] is False and checks[0]["at"] == "tp2pp2-zbv"
    per = {c["check"].split(":")[0]: c for c in checks[1:]}
    assert per["dp2tp2-split_gather"]["why"] == "dp2tp2-split_gather: no row"


def test_composed_2x2_choice_row_absent_or_empty():
    rows = cz_rows({"dp2tp2-ring": 0.48, "tp2pp2-zbv": 0.51})
    assert cz.targets(rows[:-1]) == cz.targets(rows)  # the choice recomputed
    none = cz.targets(cz_rows({"dp2tp2-ring": OOM}))[0]
    assert none["ok"] is None and "no setup ran" in none["why"]


def test_composed_2x2_quick_rows_are_not_the_7b_in_bf16():
    tiny = cz.targets(cz_rows({"dp2tp2-ring": 0.9}, preset="tiny"))
    assert tiny[0]["ok"] is None and "preset tiny" in tiny[0]["why"]
    fp32 = cz.targets(cz_rows({"dp2tp2-ring": 0.9}, precision="fp32"))
    assert fp32[0]["ok"] is None and "precision fp32" in fp32[0]["why"]
