"""`composed_view.pick_bf16` finds chapter 10's rows by what they ran, in a composed file
recorded when "ours-bf16" held AdamW's moments in bf16 and in one where it holds fp32."""

import pytest

from colossal_lab.book import composed_view as cv


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


def test_failed_rows_are_never_picked():
    rows = [row("ours-bf16-m32", error="OutOfMemoryError: ..."), row("ours-bf16", moments="bf16")]
    assert cv.pick_bf16(rows)["exact"] is None


def test_level_words_follow_the_p10_p90_rule():
    a, b = row("a", step_ms=300.0), row("b", step_ms=302.0)
    assert cv.level_words(a, b) == "level with"
    fast = row("c", step_ms=250.0, step_ms_p10=248.0, step_ms_p90=252.0)
    assert cv.level_words(fast, b).endswith("faster than")
