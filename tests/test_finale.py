"""Chapter 10's benchmarks on the CPU: the waterfall adds one switch per bar and ends at
the best sets; every bar and the loss curves run (tiny model) and record what ran."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colossal_lab.benchmarks import composed_curves, steps, waterfall
from colossal_lab.config import SWITCH_SETS


def _changed(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def test_waterfall_adds_one_switch_per_bar():
    ours = [s for s in waterfall.SETUPS if s.impl == "ours" and s.name != "best+compile"]
    assert ours[0].switches == SWITCH_SETS["naive"]
    for before, after in zip(ours[:-2], ours[1:-1]):
        assert len(_changed(before.switches, after.switches)) == 1, after.name
    assert ours[-3].switches == SWITCH_SETS["best"]  # +adamw: the exact optimizer
    assert ours[-2].switches == SWITCH_SETS["best-bf16-moments"]
    assert ours[-1].switches == SWITCH_SETS["best-fp8"]
    # the bars that materialise the scores run one sequence at a time
    assert [s.name for s in ours if s.micro_batch == 1] == ["naive-fp32", "+bf16"]
    assert {s.name for s in waterfall.SETUPS if s.impl == "hf"} == {
        "hf-sdpa", "hf-compile", "hf-liger", "hf-torchao-fp8"}
    # outside the chain, after the fp8 bar: best with each layer compiled
    names = [s.name for s in waterfall.SETUPS]
    assert names.index("best+compile") == names.index("fp8") + 1
    extra = next(s for s in waterfall.SETUPS if s.name == "best+compile")
    assert _changed(SWITCH_SETS["best"], extra.switches) == {"enable_compile"}
    assert extra.switches.enable_compile == "layers"
    assert not SWITCH_SETS["best"].enable_compile  # unmeasured: not in the best set


def test_waterfall_quick_runs_every_bar():
    """Every bar of ours on the tiny model (compiled setups need minutes, Liger's and
    torchao's a GPU: left to the GPU run); each records the backends that ran."""
    chosen = [s for s in waterfall.SETUPS if steps.runs_quick(s)]
    assert {s.name for s in waterfall.SETUPS} - {s.name for s in chosen} == {
        "best+compile", "hf-compile", "hf-liger", "hf-torchao-fp8"}
    rows = steps.run_chapter("waterfall", chosen, quick=True)
    by = {r["setup"]: r for r in rows}
    assert not [r for r in rows if "error" in r]
    assert set(by) == {s.name for s in chosen}
    assert by["naive-fp32"]["precision"] == "fp32" and by["+adamw"]["precision"] == "bf16-pure"
    # what ran is recorded: True picks our Triton RoPE and AdamW on a GPU, the eager
    # RoPE and torch's AdamW path on a CPU (the quick run uses the GPU where there is one)
    gpu = torch.cuda.is_available()
    assert by["+rope"]["rope_backend"] == ("triton" if gpu else "eager")
    assert by["naive-fp32"]["optimizer"] == "AdamW"
    assert by["+bf16-params"]["optimizer"] == "MasterAdamW"
    assert by["+adamw"]["optimizer"] == ("FusedAdamW" if gpu else "MasterAdamW")
    # bf16 moments are our AdamW's: torch's keeps fp32 ones, and the row says which ran
    assert by["+adamw"]["optimizer_moments"] == "fp32"
    assert by["+bf16-moments"]["optimizer_moments"] == ("bf16" if gpu else "fp32")
    assert all(r["first_step_s"] > 0 for r in rows)  # the warm-up step's wall time


def test_composed_curves_quick():
    """The loss check's machinery on the tiny model: paired seeds, the spread, the
    controls' verdicts (6 steps say nothing about learning; the shapes of rows do)."""
    rows = composed_curves.run(quick=True)
    curves = {r["setup"]: r for r in rows if r["kind"] == "loss_curve"}
    assert set(curves) == set(composed_curves.QUICK)
    assert curves["naive-s1"]["seed"] == 1
    assert curves["naive-s1"]["losses"] != curves["naive-s0"]["losses"]
    assert all(len(r["losses"]) == 6 and 0 < r["epochs"] < 1 for r in curves.values())
    check = rows[-1]
    assert check["kind"] == "loss_check" and check["naive_seeds"] == [0, 1]
    spread = abs(curves["naive-s1"]["val_loss"] - curves["naive-s0"]["val_loss"])
    assert check["spread_val_loss"] == pytest.approx(spread)
    pair = check["paired"]["ours-bf16-s0"]
    assert pair["diff"] == pytest.approx(curves["ours-bf16-s0"]["val_loss"]
                                         - curves["naive-s0"]["val_loss"])
    assert check["holds"] is None  # seed 2 and its pair have not run


def test_loss_check_verdict_flags_the_control_and_needs_every_pair():
    def row(setup, role, seed, val):
        return {"kind": "loss_curve", "setup": setup, "role": role, "seed": seed,
                "val_loss": val}

    rows = [row("naive-s0", "naive", 0, 3.00), row("naive-s1", "naive", 1, 3.02),
            row("naive-s2", "naive", 2, 2.99),
            *(row(f"ours-bf16-s{k}", "ours-bf16", k, v)
              for k, v in ((0, 3.01), (1, 3.00), (2, 3.00))),
            row("control-nearest-s0", "control", 0, 3.20),
            {"kind": "loss_curve", "setup": "ours-fp8-s0", "error": "out of memory"}]
    v = composed_curves.verdict(rows)
    assert v["spread_val_loss"] == pytest.approx(0.03)
    assert v["controls_flagged"] == ["control-nearest-s0"] and v["holds"] is True
    rows[4] = row("ours-bf16-s1", "ours-bf16", 1, 3.10)  # a pair outside the spread
    assert composed_curves.verdict(rows)["holds"] is False
    assert composed_curves.verdict(rows[:3] + rows[6:7])["holds"] is None


def test_composed_pairs_time_the_headline_in_turns(tmp_path, monkeypatch):
    """`bench composed --pairs 3`: hf-liger and ours-bf16 timed three times each, the
    order swapped every pair, each row tagged with its pair; `pair_ratios` gives
    hf-liger's time over ours' per pair. The timing itself is faked: the order is the
    point."""
    from colossal_lab.benchmarks import composed
    from colossal_lab.measure import results

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    order = []

    def fake(setup, preset_name, seq_len, batch):
        order.append(setup.name)
        ms = 350.0 if setup.name == "hf-liger" else 300.0 + len(order)
        return {"setup": setup.name, "preset": preset_name, "seq_len": seq_len,
                "batch": batch, "step_ms": ms, "tokens_per_s": batch * seq_len / ms,
                "mfu": 0.5, "mfu_attn": 0.55}

    monkeypatch.setattr(steps, "measure_isolated", fake)
    composed.main(["--setups", "hf-liger", "ours-bf16", "ours-fp8", "--pairs", "3"])
    assert order == ["ours-fp8", "hf-liger", "ours-bf16", "ours-bf16", "hf-liger",
                     "hf-liger", "ours-bf16"]
    (path,) = list(tmp_path.glob("*/composed.json"))
    saved = results.load_results("composed", gpu=path.parent.name)
    assert [r.get("pair") for r in saved.rows] == [None, 0, 0, 1, 1, 2, 2]
    assert saved.config["pairs"] == {"setups": ["hf-liger", "ours-bf16"], "count": 3}
    assert composed.pair_ratios(saved.rows) == pytest.approx([350 / 303, 350 / 304,
                                                              350 / 307])


@pytest.mark.parametrize("argv", [["--pairs", "2", "--quick"],
                                  ["--pairs", "2", "--setups", "ours-bf16"]])
def test_composed_pairs_refuse_what_cannot_pair(argv, capsys):
    from colossal_lab.benchmarks import composed

    with pytest.raises(SystemExit) as e:
        composed.main(argv)
    assert e.value.code == 2 and "--pairs" in capsys.readouterr().err


def test_loss_check_batch_fits_one_epoch(monkeypatch):
    """The loss check's batch is the most sequences a step that keep its steps inside
    98% of one epoch of the corpus found where it runs; too small a corpus is refused."""
    from colossal_lab.errors import UsageError

    run_args = {**composed_curves.LOSS_RUN}
    for n, want in ((10_300, 5), (2_000, 0)):
        monkeypatch.setattr(composed_curves.data, "packed_sequences",
                            lambda *a, n=n, **k: torch.zeros(n, 257, dtype=torch.int32))
        if want:
            batch = composed_curves.fit_batch(composed_curves.LOSS_CFG, run_args)
            assert batch == want and batch * run_args["steps"] <= 0.98 * n
        else:
            with pytest.raises(UsageError, match="too few for 2000 steps"):
                composed_curves.fit_batch(composed_curves.LOSS_CFG, run_args)


def test_composed_curves_concurrent_runs_compute_what_serial_runs_do(capsys):
    """`--jobs 2`: two runs trained at once in child processes give the rows the same
    runs give one after the other in this process, in `CURVES` order."""
    names = ("naive-s1", "naive-s0")
    seen = []
    rows = composed_curves.run_concurrently(names, 2, quick=True,
                                            on_row=lambda r: seen.append(len(r)))
    assert [r["setup"] for r in rows] == ["naive-s0", "naive-s1"] and seen == [1, 2]
    serial = composed_curves.run(quick=True, names=names)
    for got, want in zip(rows, serial[:2], strict=True):
        assert got["losses"] == want["losses"] and got["val_loss"] == want["val_loss"]


def test_composed_curves_failed_child_becomes_an_error_row(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("Traceback (most recent call last):\n  File ...\n"
                   "torch.OutOfMemoryError: CUDA out of memory\n")
    c = composed_curves.CURVES[0]
    row = composed_curves._child_row(c, 1, str(tmp_path / "missing.json"), str(log))
    assert row["setup"] == c.name and "OutOfMemoryError" in row["error"]
    assert "val_loss" not in row and row["role"] == "naive"


def test_composed_curves_resume_runs_again_what_changed_meaning():
    """A saved run is kept only while its curve still runs the same precision and
    AdamW moments: ours-fp8 moved to bf16 parameters, so a saved fp8 run over fp32
    parameters runs again; a curve no longer listed is dropped."""
    def row(setup, precision, moments):
        return {"kind": "loss_curve", "setup": setup, "precision": precision,
                "optimizer_moments": moments}

    keep = [row("naive-s0", "bf16", "fp32"), row("ours-bf16-s0", "bf16-pure", "fp32"),
            row("control-no-masters-s0", "bf16-pure", "bf16"),
            row("control-nearest-s0", "bf16-pure", "bf16-nearest"),
            row("best-bf16-moments-s0", "bf16-pure", "bf16")]
    assert all(composed_curves.still_current(r) for r in keep)
    assert not composed_curves.still_current(row("ours-fp8-s0", "fp8", "fp32"))
    assert composed_curves.still_current(row("ours-fp8-s0", "fp8-pure", "fp32"))
    assert not composed_curves.still_current(row("ours-bf16-s0", "bf16-pure", "bf16"))
    assert not composed_curves.still_current(row("gone-s0", "bf16", "fp32"))


def test_composed_pairs_resume_after_an_interruption(tmp_path, monkeypatch):
    """A `--pairs` run stopped half way (the fake timing raises on its 4th setup)
    continues with `--resume`: the rows it saved are kept, pair tags included, and only
    the (setup, pair) turns it lacks are timed."""
    from colossal_lab.benchmarks import composed
    from colossal_lab.measure import results

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    order, stop = [], [4]

    def fake(setup, preset_name, seq_len, batch):
        if len(order) + 1 == stop[0]:
            raise KeyboardInterrupt  # the machine taken back mid-run
        order.append(setup.name)
        ms = 350.0 if setup.name == "hf-liger" else 300.0
        return {"setup": setup.name, "preset": preset_name, "seq_len": seq_len,
                "batch": batch, "step_ms": ms, "tokens_per_s": batch * seq_len / ms,
                "mfu": 0.5, "mfu_attn": 0.55}

    monkeypatch.setattr(steps, "measure_isolated", fake)
    argv = ["--setups", "hf-liger", "ours-bf16", "ours-fp8", "--pairs", "2"]
    with pytest.raises(KeyboardInterrupt):
        composed.main(argv)
    assert order == ["ours-fp8", "hf-liger", "ours-bf16"]
    stop[0] = 0
    order.clear()
    composed.main(argv + ["--resume"])
    assert order == ["ours-bf16", "hf-liger"]  # pair 1 in swapped order, nothing again
    (path,) = list(tmp_path.glob("*/composed.json"))
    saved = results.load_results("composed", gpu=path.parent.name)
    assert [(r["setup"], r.get("pair")) for r in saved.rows] == [
        ("ours-fp8", None), ("hf-liger", 0), ("ours-bf16", 0), ("ours-bf16", 1),
        ("hf-liger", 1)]
    assert composed.pair_ratios(saved.rows) == pytest.approx([350 / 300, 350 / 300])
