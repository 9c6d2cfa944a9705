"""The landing page's overview (`colossal_lab.book.overview`): one entry per switch chapter
read from the committed H200 results, its figure, and synthetic rows for the verdicts
(level, faster, slower) and for what is missing or failed."""

import itertools
import json

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from colossal_lab.book import overview
from colossal_lab.measure import results
from colossal_lab.measure.results import REPO_ROOT  # noqa: E402

GPU = "h200"


@pytest.fixture(scope="module")
def entries():
    return overview.gather(gpu=GPU)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def recorded(entry) -> dict:
    """The entry's results file as committed, read without the library."""
    return json.loads((REPO_ROOT / entry.file).read_text())


def row_of(doc: dict, setup: str) -> dict:
    """The setup's row; of a setup timed in pairs (hf-liger and ours-bf16 in turns,
    tagged `pair`), the row of the pair whose ratio of step times is the median."""
    rows = [r for r in doc["rows"] if r.get("setup") == setup]
    if len(rows) == 1:
        return rows[0]
    assert all(r.get("pair") is not None for r in rows), setup
    step = {(r["setup"], r["pair"]): r["step_ms"] for r in doc["rows"] if "pair" in r}
    ratios = sorted((step["hf-liger", r["pair"]] / step["ours-bf16", r["pair"]], r["pair"])
                    for r in rows)
    mid = ratios[(len(ratios) - 1) // 2][1]
    (row,) = [r for r in rows if r["pair"] == mid]
    return row


# ------------------------------------------------------------------ recorded results


def test_every_written_chapter_has_an_entry(entries):
    assert [e.chapter.number for e in entries] == ["00", "01", "02", "03", "04", "06", "10"]
    for e in entries:
        assert e.ok, (e.chapter.number, e.missing)
        assert e.file == f"results/{GPU}/{e.chapter.results}.json"
        assert (REPO_ROOT / "book" / e.chapter.page).exists(), e.chapter.page
        assert e.commit == recorded(e)["provenance"]["git_sha"][:10]


def test_mfu_and_tokens_are_the_rows_values(entries):
    for e in entries:
        doc = recorded(e)
        for p in (e.off, e.on, *e.also):
            row = row_of(doc, p.setup)
            assert p.mfu == row["mfu"] and p.tokens_per_s == row["tokens_per_s"]
            assert p.mfu_low == pytest.approx(row["mfu"] * row["step_ms"] / row["step_ms_p90"])
            assert p.mfu_high == pytest.approx(row["mfu"] * row["step_ms"] / row["step_ms_p10"])
            assert p.mfu_low <= p.mfu <= p.mfu_high


def test_ratio_is_of_median_step_times(entries):
    for e in entries:
        doc = recorded(e)
        off, on = row_of(doc, e.chapter.off), row_of(doc, e.chapter.on)
        assert e.comparison.speedup == pytest.approx(off["step_ms"] / on["step_ms"])
        assert e.verdict.startswith(f"×{off['step_ms'] / on['step_ms']:.2f} ")


def test_checkpointing_says_it_trades_speed_for_memory(entries):
    (ckpt,) = [e for e in entries if e.chapter.trades_memory]
    assert ckpt.chapter.on == "ckpt-selective" and "slower" in ckpt.verdict
    assert ckpt.on.peak_mem_gib < ckpt.off.peak_mem_gib
    assert ckpt.memory == f"{ckpt.off.peak_mem_gib:.1f} → {ckpt.on.peak_mem_gib:.1f} GiB"


def test_precision_shows_fp32_too(entries):
    (prec,) = [e for e in entries if e.chapter.number == "06"]
    assert (prec.off.setup, prec.on.setup) == ("bf16", "fp8-delayed")
    assert [p.setup for p in prec.also] == ["fp32"]


def test_banners_name_each_file_and_its_commit(entries):
    text = overview.banners(entries)
    firsts = [ln for ln in text.splitlines() if ln.startswith(results.BANNER_PREFIX)]
    assert len(firsts) == len({e.file for e in entries})
    for e in entries:
        assert f"{results.BANNER_PREFIX}{e.file} (recorded, commit {e.commit})" in firsts
    assert "/work/" not in text and str(REPO_ROOT) not in text


def test_captions_name_each_file_once_without_a_commit(entries):
    data, meta = overview.captions(entries)._repr_mimebundle_()
    files = {e.file for e in entries if e.results is not None}
    assert [c["results"] for c in meta["colossal_lab"]["captions"]] == sorted(
        files, key=[e.file for e in entries].index)
    assert all(f in data["text/plain"] for f in files)
    assert not any(e.commit in data["text/html"] for e in entries)


def test_table_links_every_chapter(entries):
    lines = overview.table(entries).data.splitlines()
    assert len(lines) == 2 + len(entries)
    assert f"results file in results/{GPU}/ |" in lines[0]
    for e, line in zip(entries, lines[2:]):
        assert f"[{e.chapter.number} · {e.chapter.title}]({e.chapter.page})" in line
        assert f"| {e.chapter.results}.json |" in line and e.commit not in line
        assert f"{e.off.mfu:.1%} → {e.on.mfu:.1%}; {e.verdict}" in line
        assert ("peak memory" in line) is e.chapter.trades_memory


# ------------------------------------------------------------------ the figure


def visible_texts(fig):
    """Every non-empty text drawn on the figure (annotations, ticks, title, legend)."""
    return [t for t in fig.findobj(matplotlib.text.Text)
            if t.get_visible() and t.get_text().strip()]


def test_figure_is_readable(entries):
    ax = overview.plot_mfu_per_switch(entries)
    fig = ax.figure
    assert fig.get_size_inches()[0] <= 9
    bars = {c.patches[0].get_gid(): c for c in ax.containers
            if isinstance(c, matplotlib.container.BarContainer)}
    assert len(bars["off"]) == len(bars["on"]) == len(entries)  # one pair per entry
    assert [b.get_width() for b in bars["on"]] == [e.on.mfu for e in entries]
    assert len(bars["also"]) == sum(len(e.also) for e in entries)
    gpu = entries[0].results.provenance["gpu"]
    row = entries[1].on.row
    title = ax.get_title(loc="right")
    assert gpu in title and f"{row['preset']}, seq {row['seq_len']}, batch {row['batch']}" \
        in title
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = visible_texts(fig)
    assert min(t.get_fontsize() for t in texts) >= 10
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    page = fig.bbox
    for text, box in boxes:
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 \
            and box.y1 <= page.y1, f"{text!r} leaves the figure"
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"{a!r} overlaps {b!r}"
    patches = [p.get_window_extent(renderer) for c in bars.values() for p in c.patches]
    for t in ax.texts:
        assert not any(t.get_window_extent(renderer).overlaps(p) for p in patches), \
            f"{t.get_text()!r} sits on a bar"


# ------------------------------------------------------------------ synthetic rows

CHAPTER = overview.Chapter("09", "Demo", "09_demo.ipynb", "demo", "slow", "fast",
                           "a demo", also=("other",))


def step_row(setup: str, ms: float, spread: float, **extra) -> dict:
    """A step row of 16,384 tokens at `ms` (p10/p90 at ± `spread` ms), MFU 40 % at 100 ms."""
    return {"setup": setup, "label": setup, "preset": "tiny", "batch": 4, "seq_len": 4096,
            "step_ms": ms, "step_ms_p10": ms - spread, "step_ms_p90": ms + spread,
            "steps_timed": 20, "mfu": 0.4 * 100 / ms, "tokens_per_s": 16384 / ms * 1e3,
            "peak_mem_gib": 10.0, "peak_tflops": 989.4, **extra}


def fake(*rows) -> results.Results:
    prov = {"gpu": "Fake GPU", "gpu_count": 1, "git_sha": "f" * 40,
            "date": "2026-12-01T00:00:00+00:00", "command": "test"}
    return results.Results("demo", prov, list(rows), path=REPO_ROOT / "results" / "x.json")


@pytest.mark.parametrize("fast_ms, spread, word, level", [
    (98.0, 5.0, "level", True),     # each median inside the other's p10-p90
    (80.0, 2.0, "faster", False),
    (120.0, 5.0, "slower", False),
    (96.0, 1.0, "faster", False),   # 4 % apart with a tight spread: a real difference
])
def test_verdicts(fast_ms, spread, word, level):
    e = overview.entry(CHAPTER, fake(step_row("slow", 100.0, spread),
                                     step_row("fast", fast_ms, spread),
                                     step_row("other", 200.0, 1.0)))
    assert e.ok and e.comparison.level is level
    assert e.comparison.speedup == pytest.approx(100.0 / fast_ms)
    assert e.verdict == f"×{100.0 / fast_ms:.2f} {word}"
    assert e.on.mfu == pytest.approx(0.4 * 100 / fast_ms)
    assert e.on.mfu_low == pytest.approx(e.on.mfu * fast_ms / (fast_ms + spread))
    texts = [t.get_text() for t in overview.plot_mfu_per_switch([e]).texts]
    assert any(f"×{100.0 / fast_ms:.2f} {word}" in t for t in texts), texts


def test_few_steps_are_flagged():
    e = overview.entry(CHAPTER, fake(step_row("slow", 100.0, 1.0, steps_timed=4),
                                     step_row("fast", 50.0, 1.0)))
    assert e.comparison.few_steps and "under 20 steps" in e.verdict


def test_missing_file_is_noted_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    (e,) = overview.gather(gpu=GPU, chapters=[CHAPTER])
    assert not e.ok and e.results is None and "demo" in e.missing
    assert overview.banners([e]) == ""
    assert overview.table_row(e)["result"].startswith("not measured")
    assert "not measured" in overview.table([e]).data
    ax = overview.plot_mfu_per_switch([e])
    assert not any(isinstance(c, matplotlib.container.BarContainer) for c in ax.containers)
    assert any(t.get_text().startswith("not measured") for t in ax.texts)


def test_failed_or_absent_setups_are_noted():
    failed = overview.entry(CHAPTER, fake(step_row("slow", 100.0, 1.0),
                                          {"setup": "fast", "error": "out of memory"}))
    assert not failed.ok and failed.missing == "fast failed: out of memory"
    absent = overview.entry(CHAPTER, fake(step_row("fast", 100.0, 1.0)))
    assert not absent.ok and "no row 'slow'" in absent.missing
    other_failed = overview.entry(CHAPTER, fake(step_row("slow", 100.0, 1.0),
                                                step_row("fast", 50.0, 1.0),
                                                {"setup": "other", "error": "crashed"}))
    assert other_failed.ok and other_failed.also == ()
    assert other_failed.notes == ("other failed: crashed",)
    ax = overview.plot_mfu_per_switch([failed, other_failed])
    assert any("out of memory" in t.get_text() for t in ax.texts)


def test_different_batches_give_no_step_time_ratio():
    e = overview.entry(CHAPTER, fake(step_row("slow", 100.0, 1.0),
                                     step_row("fast", 50.0, 1.0, batch=8)))
    assert not e.ok and "tokens_per_s" in e.missing


def test_axis_names_the_peak_the_rows_record(entries):
    label = overview.xlabel_of(entries)
    assert label == "MFU (6N) of 989.4 TFLOP/s, the dense bf16 peak, for every precision"
    other = overview.entry(CHAPTER, fake(step_row("slow", 100.0, 1.0, mfu_peak="fp8 peak"),
                                         step_row("fast", 50.0, 1.0)))
    assert overview.xlabel_of([other]).endswith("989.4 TFLOP/s peak")
