"""`composed_view.pick_bf16` finds chapter 10's rows by what they ran, in a composed file
recorded when "ours-bf16" held AdamW's moments in bf16 and in one where it holds fp32."""

import pytest

from colossal_lab.book import composed_view as cv
from colossal_lab.book import floor_view as fv
from colossal_lab.book import loss_check_view as lv
from colossal_lab.book import paired_rows


def row(setup, precision="bf16-pure", moments="fp32", preset="llama-7b-8l", **kw):
    return {"setup": setup, "precision": precision, "optimizer_moments": moments,
            "preset": preset, "batch": 4, "seq_len": 4096, "step_ms": 300.0,
            "step_ms_p10": 295.0, "step_ms_p90": 305.0, **kw}


OLD = [row("hf-liger", "bf16"), row("ours-bf16-autocast", "bf16"),
       row("ours-bf16", moments="bf16"), row("ours-bf16-compile", moments="bf16"),
       row("ours-bf16-graph", moments="bf16"),
       row("ours-bf16-defer", moments="bf16", optimizer_deferred=True),
       row("ours-bf16-m32"), row("ours-fp8", "fp8", "bf16"),
       row("ours-7b-bf16", moments="bf16", preset="llama-7b")]
NEW = [row("hf-liger", "bf16"), row("ours-bf16-autocast", "bf16"), row("ours-bf16"),
       row("ours-bf16-compile"), row("ours-bf16-graph"),
       row("ours-bf16-defer", optimizer_deferred=True),
       row("best-bf16-moments", moments="bf16"), row("ours-fp8", "fp8"),
       row("ours-7b-bf16", preset="llama-7b")]


@pytest.mark.parametrize("rows, exact, rounded", [(OLD, "ours-bf16-m32", "ours-bf16"),
                                                  (NEW, "ours-bf16", "best-bf16-moments")])
def test_pick_by_what_ran(rows, exact, rounded):
    pick = cv.pick_bf16(rows, "llama-7b-8l")
    assert pick["exact"]["setup"] == exact and pick["exact"]["optimizer_moments"] == "fp32"
    assert pick["bf16_moments"]["setup"] == rounded


def test_variants_compare_with_the_row_of_their_moments():
    defer = next(r for r in OLD if r["setup"] == "ours-bf16-defer")
    assert cv.same_moments_peer(defer, OLD)["setup"] == "ours-bf16"
    defer = next(r for r in NEW if r["setup"] == "ours-bf16-defer")
    assert cv.same_moments_peer(defer, NEW)["setup"] == "ours-bf16"


def test_variant_sentences_follow_each_verdict():
    """Each variant against the same step without it, with the reading its verdict
    gives: level, faster and slower; the fp8 headline (replayed as a graph) against the
    same step launched eagerly; a variant without its row is left out, and so is the fp8
    headline of a file without the eager fp8 row."""
    rows = [r if r["setup"] != "ours-bf16-compile" else
            {**r, "step_ms": 320.0, "step_ms_p10": 318.0, "step_ms_p90": 322.0}
            for r in NEW if r["setup"] != "ours-bf16-defer"]
    rows = [r if r["setup"] != "ours-fp8" else {**r, "precision": "fp8-pure",
                                                "step_ms": 240.0, "step_ms_p10": 238.0,
                                                "step_ms_p90": 242.0} for r in rows]
    assert len(cv.variant_sentences(rows)) == 2  # no eager fp8 row: no fp8 sentence
    rows += [row("ours-fp8-eager", "fp8-pure", step_ms=250.0, step_ms_p10=248.0,
                 step_ms_p90=252.0),
             row("ours-fp8-x", "fp8-pure")]
    got = cv.variant_sentences(rows)
    assert len(got) == 3  # compile, graph, fp8 graph; no defer row
    compile_, graph, fp8 = got
    assert compile_.startswith("Each layer torch.compiled (ours-bf16-compile")
    assert "the speed of ours-bf16" in compile_ and cv.READINGS["compile", "slower"] in compile_
    assert "level with ours-bf16" in graph and cv.READINGS["graph", "level"] in graph
    assert fp8.startswith("The fp8 step replayed as one CUDA graph (ours-fp8")
    assert "faster than ours-fp8-eager" in fp8 and cv.READINGS["graph", "faster"] in fp8


def test_failed_rows_are_never_picked():
    rows = [row("ours-bf16-m32", error="OutOfMemoryError: ..."), row("ours-bf16", moments="bf16")]
    assert cv.pick_bf16(rows)["exact"] is None


def test_level_words_follow_the_p10_p90_rule():
    a, b = row("a", step_ms=300.0), row("b", step_ms=302.0)
    assert cv.level_words(a, b) == "level with"
    fast = row("c", step_ms=250.0, step_ms_p10=248.0, step_ms_p90=252.0)
    assert cv.level_words(fast, b).endswith("faster than")


# ---------------------------------------------------------------- pairs and the headline

import json  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from colossal_lab.book import predicted  # noqa: E402
from colossal_lab.measure import results  # noqa: E402


def paired(ratios, moments="fp32", **extra):
    """NEW's rows with hf-liger and ours-bf16 timed in pairs (as `--pairs N` records:
    no untagged row of either), ours-bf16's step 300 ms and hf-liger's 300 × ratio."""
    rows = [r for r in NEW if r["setup"] not in ("hf-liger", "ours-bf16")]
    for i, q in enumerate(ratios):
        rows.append(row("hf-liger", "bf16", pair=i, step_ms=300.0 * q,
                        tokens_per_s=1e4 / q, power_w=690.0, **extra))
        rows.append(row("ours-bf16", moments=moments, pair=i, step_ms=300.0,
                        tokens_per_s=1e4, power_w=690.0, **extra))
    return rows


def test_headline_is_the_median_of_the_pairs_and_names_the_smallest():
    h = cv.headline(paired([1.20, 1.10, 1.15]))
    assert h.ratio == pytest.approx(1.15) and h.smallest == pytest.approx(1.10)
    assert h.pair_ratios == pytest.approx((1.20, 1.10, 1.15))
    # the rows shown are the median pair's, both from the same turn
    assert h.ours["pair"] == h.peer["pair"] == 2
    assert "median of 3 pairs" in cv.headline_words(h)


def test_headline_without_pairs_is_the_single_rows_ratio():
    rows = [dict(r) for r in NEW]
    rows[0]["step_ms"] = 345.0
    h = cv.headline(rows)
    assert h.pair_ratios == () and h.ratio == pytest.approx(345.0 / 300.0)
    assert h.ours["setup"] == "ours-bf16" and cv.headline_words(h) == ""


def test_pairs_of_a_bf16_moments_ours_do_not_make_the_headline():
    # an older ours-bf16 (bf16 moments) timed in pairs: the ratio is the exact row's
    rows = paired([1.3, 1.3, 1.3], moments="bf16") + [row("ours-bf16-m32", step_ms=250.0)]
    h = cv.headline(rows)
    assert h.ours["setup"] == "ours-bf16-m32" and h.pair_ratios == ()
    assert h.ratio == pytest.approx(300.0 * 1.3 / 250.0)


def test_one_row_a_setup_untagged_first_else_the_median_pair():
    rows = paired([1.20, 1.10, 1.15])
    one = paired_rows.one_per_setup(rows)
    assert [r["setup"] for r in one].count("ours-bf16") == 1
    assert cv.by_setup(rows)["hf-liger"]["pair"] == 2
    # an untagged row of the same setup wins over the pairs
    rows.append(row("hf-liger", "bf16", step_ms=999.0))
    assert "pair" not in cv.by_setup(rows)["hf-liger"]
    assert cv.pick_bf16(rows, "llama-7b-8l")["exact"]["pair"] == 2


def test_even_count_of_pairs_takes_the_lower_middle():
    rows = paired([1.30, 1.10, 1.20, 1.40])
    assert paired_rows.median_pair(rows)["hf-liger"]["pair"] == 2  # 1.20
    assert cv.headline(rows).ratio == pytest.approx(1.25)


def test_failed_pair_is_left_out():
    rows = paired([1.20, 1.10, 1.15])
    rows[-1] = {**rows[-1], "error": "RuntimeError: boom"}  # pair 2's ours-bf16
    h = cv.headline(rows)
    assert h.pair_ratios == pytest.approx((1.20, 1.10))


def test_the_intro_and_the_chapter_pick_the_same_rows():
    rows = [{**r, "norm_backend": "liger"} if r["setup"] == "hf-liger" else r
            for r in paired([1.20, 1.10, 1.15])]
    ours, peer = predicted.exact_optimizer(rows)
    h = cv.headline(rows)
    assert ours is h.ours and peer is h.peer


def test_targets_judge_the_pairs_by_their_median_and_smallest():
    rows = [{"mfu": 0.6, **r} for r in paired([1.20, 1.04, 1.15])]
    md = cv.targets_table(rows, cv.headline(rows).ours).data
    median = next(line for line in md.splitlines() if "median of the pairs" in line)
    each = next(line for line in md.splitlines() if "in each pair" in line)
    assert "×1.15" in median and median.endswith("| yes |")
    assert "×1.04" in each and each.endswith("| no |")
    assert "pairs: ×1.20, ×1.04, ×1.15" in median
    assert "1.13 × hf-liger's |" not in md  # the single-run goal is replaced


def test_tokens_per_joule_and_energy():
    assert cv.tokens_per_joule({"tokens_per_s": 7000.0, "power_w": 700.0}) == 10.0
    assert cv.tokens_per_joule({"tokens_per_s": 7000.0}) is None
    assert cv.tokens_per_joule({"tokens_per_s": 1.0, "power_w": 1.0, "error": "x"}) is None
    rows = paired([1.2, 1.2, 1.2], power_limit_w=700.0)
    words = cv.energy_words(rows)
    # 690 W / 1e4 tokens/s = 69.0 mJ a token for ours; 690 / (1e4 / 1.2) = 82.8 for HF
    assert "69.0 mJ" in words and "82.8" in words and "×1.20" in words
    md = cv.composed_table(rows, cv.headline(rows).ours, None).data
    assert "tokens/s per W" in md


# ---------------------------------------------------------------- found by content


def _write(root, gpu, name, rows, gpu_name="G"):
    (root / gpu).mkdir(parents=True, exist_ok=True)
    (root / gpu / f"{name}.json").write_text(json.dumps(
        {"name": name, "provenance": {"gpu": gpu_name}, "config": {}, "rows": rows}))


def test_the_loss_check_is_found_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    assert lv.loss_check_on_record() is None
    _write(tmp_path, "a100", "composed_curves", [{"kind": "loss_check", "holds": True}])
    _write(tmp_path, "h100-sxm", "composed_curves", [{"kind": "loss_check"}])
    _write(tmp_path, results.REFERENCE_GPU, "composed_curves",
           [{"kind": "loss_curve", "setup": "naive"}])  # the old format: no verdict
    assert lv.loss_check_on_record().path.parent.name == "a100"  # alphabetical after
    _write(tmp_path, results.REFERENCE_GPU, "composed_curves", [{"kind": "loss_check"}])
    assert lv.loss_check_on_record().path.parent.name == results.REFERENCE_GPU


# ---------------------------------------------------------------- the loss check

NAIVE = {0: 3.70, 1: 3.71, 2: 3.72}  # spread 0.02


def curve(setup, role, seed, val, precision="bf16-pure", moments="fp32",
          optimizer="FusedAdamW", **kw):
    return {"kind": "loss_curve", "setup": setup, "role": role, "seed": seed,
            "val_loss": val, "precision": precision, "optimizer_moments": moments,
            "optimizer": optimizer, "n_params": 325e6, "batch": 5, "seq_len": 256,
            "steps": 2000, "lr": 3e-4, "epochs": 0.97, **kw}


def check_of(rows, **over):
    from colossal_lab.benchmarks.composed_curves import verdict

    v = {**verdict(rows), **over}
    return results.Results("composed_curves", {"gpu": "G"}, rows + [v],
                           {"model": {"num_hidden_layers": 24, "hidden_size": 1024}})


def loss_rows(ours_diff=(0.001, -0.01, 0.004), masters=0.03, nearest=0.003):
    rows = []
    for s, v in NAIVE.items():
        rows += [curve(f"naive-s{s}", "naive", s, v, "bf16", optimizer="AdamW"),
                 curve(f"ours-bf16-s{s}", "ours-bf16", s, v + ours_diff[s])]
    rows += [curve("control-no-masters-s0", "control", 0, NAIVE[0] + masters,
                   moments="bf16", optimizer="AdamW"),
             curve("control-nearest-s0", "control", 0, NAIVE[0] + nearest,
                   moments="bf16-nearest"),
             curve("ours-fp8-s0", "variant", 0, NAIVE[0] - 0.001, "fp8-pure"),
             curve("ours-fp8-fp32-params-s0", "variant", 0, NAIVE[0] + 0.05, "fp8"),
             curve("best-bf16-moments-s1", "variant", 1, 0.0, moments="bf16",
                   error="RuntimeError: boom")]
    rows[-1].pop("val_loss")
    return rows


@pytest.mark.parametrize("setup, role, precision, moments, optimizer, name", [
    ("naive-s1", "naive", "bf16", "fp32", "AdamW", "naive"),
    ("ours-bf16-s0", "ours-bf16", "bf16-pure", "fp32", "FusedAdamW", "AdamW exact"),
    ("control-no-masters-s0", "control", "bf16-pure", "bf16", "AdamW", "no fp32 masters"),
    ("control-nearest-s0", "control", "bf16-pure", "bf16-nearest", "FusedAdamW",
     "rounded to nearest"),
    ("best-bf16-moments-s2", "variant", "bf16-pure", "bf16", "FusedAdamW",
     "stochastic rounding"),
    ("ours-fp8-s0", "variant", "fp8-pure", "fp32", "FusedAdamW",
     "fp8 linears, bf16 parameters + fp32 masters"),
    ("ours-fp8-fp32-params-s0", "variant", "fp8", "fp32", "FusedAdamW",
     "fp8 linears, fp32 parameters"),
])
def test_curve_names_say_what_ran(setup, role, precision, moments, optimizer, name):
    got = lv.curve_name({"setup": setup, "role": role, "precision": precision,
                         "optimizer_moments": moments, "optimizer": optimizer})
    assert name in got


def test_curve_names_of_the_older_format_are_kept():
    assert lv.curve_name({"setup": "s123-fp32", "precision": "fp32"}) == "s123-fp32"
    assert lv.curve_name({"setup": "best", "precision": "bf16-pure",
                          "optimizer_moments": "bf16"}) == "every switch, bf16 moments"


def test_loss_table_pairs_each_run_with_its_seed():
    res = check_of(loss_rows())
    got = {r["run"]: r for r in lv.loss_table_rows(res)}
    assert got["ours-bf16-s1"]["diff"] == pytest.approx(-0.01)
    assert got["ours-bf16-s1"]["inside"] == "yes"
    assert got["control-no-masters-s0"]["inside"] == "no"
    assert got["ours-fp8-fp32-params-s0"]["inside"] == "no"
    assert got["naive-s2"]["inside"] == "the reference"
    md = lv.loss_table(res).data
    assert "best-bf16-moments-s1" in md and "¹" in md  # the failed run: a footnote


def test_verdict_words_when_the_check_holds():
    words = " ".join(lv.loss_verdict_words(check_of(loss_rows()), (0.9, 0.95)))
    assert words.startswith("The check holds")
    assert "“every switch, no fp32 masters”" in words
    assert "did not flag the control “every switch, bf16 moments rounded to nearest”" \
        in words and "5%" in words and "2,000 steps" in words
    assert ("every switch, fp8 linears, fp32 parameters: seed 0 +0.0500, seed 0 outside "
            "the spread, above the naive run's loss") in words
    assert "bf16 parameters + fp32 masters: seed 0 -0.0010, inside the spread" in words


def test_variant_words_group_the_seeds_and_say_the_side():
    runs = [{"seed": 0, "diff": 0.004, "inside_spread": True},
            {"seed": 1, "diff": -0.0215, "inside_spread": False},
            {"seed": 2, "diff": 0.006, "inside_spread": True}]
    got = lv.variant_words("fp8", runs)
    assert got == ("fp8: seed 0 +0.0040, seed 1 -0.0215, seed 2 +0.0060 (mean -0.0038), "
                   "seed 1 outside the spread, below the naive run's loss")
    both = [{**runs[1], "seed": 1}, {"seed": 2, "diff": 0.03, "inside_spread": False}]
    assert lv.variant_words("v", both).endswith("seed 1 and seed 2 outside the spread")
    assert lv.variant_words("v", runs[:1]).endswith(", inside the spread")
    assert lv.variant_words("v", [runs[0], runs[2]]).endswith("all inside the spread")


def test_verdict_words_when_it_does_not_hold_or_is_incomplete():
    words = " ".join(lv.loss_verdict_words(check_of(loss_rows(ours_diff=(0.0, 0.05, 0.0)))))
    assert words.startswith("The check does not hold") and "seed 1 +0.0500" in words
    words = " ".join(lv.loss_verdict_words(check_of(loss_rows(masters=0.0))))
    assert "no positive control lands outside" in words
    rows = [r for r in loss_rows() if r["setup"] != "ours-bf16-s2"]
    words = lv.loss_verdict_words(check_of(rows))
    assert words[0].startswith("The check is not complete")


def test_loss_setup_words_are_read_from_the_file():
    words = lv.loss_setup_words(check_of(loss_rows()))
    assert "325M parameters (24 layers of width 1024)" in words
    assert "1,280 tokens a step, 97% of one epoch" in words


def test_loss_check_figure_draws_every_paired_run_and_the_band():
    res = check_of(loss_rows())
    fig = lv.loss_check_figure(res, "t")
    ax = fig.axes[0]
    points = [line for line in ax.get_lines() if line.get_marker() not in (None, "None")]
    assert len(points) == len(lv.loss_check(res)["paired"])  # 3 ours, 2 controls, 2 variants
    band = ax.patches[0]  # axvspan: ± the spread of the naive seeds
    assert band.get_x() == pytest.approx(-0.02)
    assert band.get_x() + band.get_width() == pytest.approx(0.02)


# ---------------------------------------------------------------- the floor


def floor_rows(with_steps=True, failed=False):
    rows = []
    for prec, g in (("bf16", 250.0), ("fp8", 140.0)):
        rows += [{"kind": "floor", "precision": prec, "part": "gemm", "ms": g,
                  "ms_p10": g - 5, "ms_p90": g + 5, "tflops": 700.0, "sm_clock_mhz": 1400.0,
                  "sm_clock_max_mhz": 1980.0, "power_w": 699.0, "power_limit_w": 700.0},
                 {"kind": "floor", "precision": prec, "part": "attention", "ms": 35.0,
                  "ms_p10": 34.0, "ms_p90": 36.0, "sm_clock_mhz": 1900.0, "power_w": 500.0},
                 {"kind": "floor", "precision": prec, "part": "optimizer", "ms": 25.0}]
    if with_steps:
        def step(setup, ms, **kw):
            return {"kind": "step", "setup": setup, "step_ms": ms, "step_ms_p10": ms - 3,
                    "step_ms_p90": ms + 3, "steps_timed": 20, "sm_clock_mhz": 1500.0,
                    "power_w": 695.0, "tokens_per_s": 5e4, **kw}
        rows += [step("hf-liger", 360.0, precision="bf16"),
                 step("ours-bf16", 315.0, precision="bf16-pure"),
                 step("hf-torchao-fp8", 313.0, precision="bf16",
                      fp8_backend="torchao-tensorwise"),
                 step("ours-fp8", 240.0, precision="fp8-pure", fp8_backend="scaled_mm")]
        if failed:
            rows[-1] = {"kind": "step", "setup": "ours-fp8",
                        "error": "torch.OutOfMemoryError: CUDA out of memory"}
    return rows


def test_steps_are_measured_against_the_floor_of_what_they_ran():
    rows = floor_rows(failed=True)
    assert [r["setup"] for r in fv.floor_steps(rows, "bf16")] == ["ours-bf16", "hf-liger"]
    # a failed row has no fp8_backend: its setup's definition says fp8
    assert [r["setup"] for r in fv.floor_steps(rows, "fp8")] == ["ours-fp8",
                                                                 "hf-torchao-fp8"]


def test_floor_sentences_with_and_without_steps():
    words = " ".join(fv.floor_sentences(floor_rows(with_steps=False), "CMD"))
    assert "The bf16 floor is 310 ms" in words and "(81%)" in words
    assert "699 W of its 700 W limit" in words and "`CMD`" in words
    words = " ".join(fv.floor_sentences(floor_rows(), "CMD"))
    assert "`CMD`" not in words
    assert "runs 315 ms a step, +5 ms (×1.02) against its floor" in words  # bf16 310
    assert "runs 240 ms a step, +40 ms (×1.20)" in words  # fp8 floor 200
    assert "17% of the fp8 step" in words  # 40 / 240


def test_floor_table_and_figure_show_a_failed_step_as_missing():
    rows = floor_rows(failed=True)
    md = fv.floor_table(rows).data
    assert "SM clock (MHz)" in md and "power (W)" in md
    line = next(x for x in md.splitlines() if "fp8 step: ours, fp8 linears" in x)
    assert "—¹" in line and "out of memory" in md
    assert "+5 ms, ×1.02" in md
    fig = fv.floor_figure(rows, "t")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "—¹" in texts and any("×1.02 the floor" in t for t in texts)
    fig = fv.floor_figure(floor_rows(with_steps=False), "t")
    assert not any("the floor" in t.get_text() for t in fig.axes[0].texts)


def test_targets_judge_fp8_against_each_peer_and_7b_by_mfu():
    times = {"hf-liger": 360.0, "ours-bf16": 300.0, "ours-fp8": 220.0,
             "hf-torchao-fp8": 330.0, "ours-7b-bf16": 600.0}
    rows = [dict(r, step_ms=times.get(r["setup"], 300.0), mfu=0.56) for r in NEW]
    rows += [row("hf-torchao-fp8", "fp8", step_ms=330.0, mfu=0.5)]
    for r in rows:
        r.update(step_ms_p10=r["step_ms"] * 0.99, step_ms_p90=r["step_ms"] * 1.01)
    md = cv.targets_table(rows, cv.pick_bf16(rows, "llama-7b-8l")["exact"]).data
    line = {k: next(x for x in md.splitlines() if k in x)
            for k in ("1.70 × hf-liger", "1.45 × hf-torchao", "55%", "1.13 ×")}
    assert "×1.64" in line["1.70 × hf-liger"] and line["1.70 × hf-liger"].endswith("| no |")
    assert "×1.50" in line["1.45 × hf-torchao"] and line["1.45 × hf-torchao"].endswith(
        "| yes |")
    assert "56.0%" in line["55%"] and "×1.20" in line["1.13 ×"]


def test_fp8_profile_words_read_both_profiles():
    def prof(setup, **ms):
        return ([{"kind": "class", "setup": setup, "kernel_class": k.replace("_", "/"),
                  "ms": v} for k, v in ms.items()]
                + [{"kind": "step", "setup": setup, "profiled_step_ms": sum(ms.values())}])
    rows = (prof("best", GEMM=250.0, attention=38.0, optimizer=13.0, copies_casts=2.0,
                 norm=4.0)
            + prof("best-fp8", GEMM=142.0, attention=39.0, optimizer=13.0,
                   copies_casts=12.0, norm=4.0))
    got = cv.fp8_profile_words(rows)
    assert "GEMMs take 142 ms against 250 in bf16 (×1.76 faster)" in got
    assert "copies and casts 12 ms against 2" in got
    assert "the fp8 step spends 16 ms and the bf16 step 6" in got
    assert "take 210 and 307 ms" in got
    assert cv.fp8_profile_words(prof("best", GEMM=1.0)) is None


def test_optimizer_share_words_scale_by_parameters_and_tokens():
    opt = [{"provider": "ours-master", "bytes_per_param": 28, "gbps": 4000.0},
           {"provider": "ours-master-m16", "bytes_per_param": 20, "gbps": 4000.0}]
    big = row("ours-7b-bf16", preset="llama-7b", n_params=6.0e9, batch=2, step_ms=600.0,
              mfu=0.54)
    small = row("ours-bf16", n_params=2.0e9, step_ms=300.0, mfu=0.60)
    assert cv.optimizer_ms(big, opt) == pytest.approx(42.0)
    assert cv.optimizer_ms({**big, "optimizer_moments": "bf16"}, opt) == pytest.approx(30.0)
    words = cv.optimizer_share_words(big, small, opt)
    assert "about 42 ms of the full model's 600 ms step (7%)" in words
    assert "against 14 ms of the 8-layer model's 300 (5%)" in words
    assert "3.0× the parameters after 0.5× the tokens" in words
    assert "(54.0% against 60.0%)" in words
    assert cv.optimizer_share_words(big, small, opt[1:]) is None


def test_full_model_memory_words_with_and_without_both_peaks():
    b7 = row("ours-7b-bf16", preset="llama-7b", batch=3, auto_ratio_ckpt_layers=0,
             predicted_peak_gib=131.5, peak_mem_gib=130.8, mem_fixed_gib=87.4,
             mem_base_gib=75.4, mem_per_sample_none_gib=18.7, mem_per_sample_full_gib=0.76,
             mem_capacity_gib=134.9, ckpt_layers=0)
    words = cv.full_model_memory_words(b7, 32)
    assert "starts from (weights, fp32 masters, moments) at 75.4 GiB" in words
    assert "18.7 GiB a sequence with no layer checkpointed" in words
    assert "the gradients make 87.4 GiB" in words
    assert "fit the batch in 135 GiB: 0 of 32, predicted peak 131.5 GiB" in words
    assert "peaked at 130.8 GiB (-0.5% against the prediction)" in words
    old = cv.full_model_memory_words({**b7, "mem_base_gib": None, "predicted_peak_gib": 100.7,
                                      "peak_mem_gib": 112.5}, 32)
    assert "fixed memory (weights, gradients, fp32 masters, moments) at 87.4 GiB" in old
    assert "(+11.7% against the prediction)" in old
    acc = cv.full_model_memory_words({**b7, "batch": 6, "micro_batch": 2,
                                      "mem_grads_held_gib": 12.5, "mem_base_gib": 87.9,
                                      "predicted_peak_gib": 125.3, "peak_mem_gib": 125.0},
                                     32)
    assert "The batch of 6 runs as micro-batches of 2" in acc
    assert "12.5 GiB of gradients: 87.9 GiB in all" in acc
    assert "fit a micro-batch of 2 in 135 GiB: 0 of 32, predicted peak 125.3" in acc


def test_comparison_verdict_follows_the_p10_p90_rule():
    from colossal_lab.measure import compare

    base = row("b", step_ms=300.0, step_ms_p10=295.0, step_ms_p90=305.0)
    assert compare.versus(row("a", step_ms=302.0), base).verdict == "level"
    fast = row("f", step_ms=250.0, step_ms_p10=248.0, step_ms_p90=252.0)
    slow = row("s", step_ms=350.0, step_ms_p10=348.0, step_ms_p90=352.0)
    assert compare.versus(fast, base).verdict == "faster"
    assert compare.versus(slow, base).verdict == "slower"
    assert "x0.857 (slower" in str(compare.versus(slow, base))


def test_full_model_floor_scales_the_8_layer_rates():
    rows = floor_rows()
    for r in rows:
        if r.get("part") == "attention":
            r["flops"] = 7e12  # 35 ms: 2e14 FLOP/s
        if r.get("part") == "optimizer":
            r.update(bytes_per_param=28, copy_gbps=4000.0)
    big = {"batch": 2, "seq_len": 1000, "n_params": 1.1e9, "step_ms": 60.0, "mfu": 0.5,
           "mfu_attn": 0.6, "peak_tflops": 1000.0, "power_w": 690.0, "power_limit_w": 700.0,
           "sm_clock_mhz": 1470.0, "recompute_tflop": 0.0}
    f = fv.full_model_floor(big, rows, embed_params=int(1e8))
    assert f["gemm_ms"] == pytest.approx(6 * 1e9 * 2000 / 700e12 * 1e3)  # 17.14
    assert f["attention_ms"] == pytest.approx(30.0)  # 0.1 · 1e15 · 0.06 s / 2e14
    assert f["optimizer_ms"] == pytest.approx(1.1e9 * 28 / 4e12 * 1e3)  # 7.7
    assert f["floor_ms"] == pytest.approx(17.142857 + 30 + 7.7)
    assert f["mfu_at_floor"] == pytest.approx(0.5 * 60 / 54.842857)
    words = fv.full_model_floor_words(big, rows, int(1e8),
                                      small={"step_ms": 315.0})
    assert "about 55 ms" in words and "at most 54.7%" in words and "×1.09 its floor" in words
    assert "×1.02 its own" in words and "690 W of its 700 W limit" in words
    assert fv.full_model_floor({**big, "recompute_tflop": 3.0}, rows, 0) is None
    no_opt = [r for r in rows if r.get("part") != "optimizer"]
    assert fv.full_model_floor_words(big, no_opt, 0) is None
