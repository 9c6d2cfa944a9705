"""One row a setup from a results file whose setups may have several rows.

`bench composed --pairs N` times hf-liger and ours-bf16 N more times in turns, each row
tagged with its `pair`, so that a drift of the card's clock falls on both sides of each
ratio. Whoever reads such a file by setup (chapter 10's tables, the landing page's
overview, the MFU predictions) must pick the same row, or two pages would quote two
different runs of one setup. The rule, in one place (`one_per_setup`): a setup's untagged
row where it has one; else the row of the median pair, so that both headline rows come
from the same turn.
"""

from __future__ import annotations

from colossal_lab.benchmarks import composed


def is_pair(row: dict) -> bool:
    """Whether `row` is one of the turns `bench composed --pairs N` times (tagged `pair`)."""
    return row.get("pair") is not None


def pairs(rows: list[dict]) -> list[tuple[int, dict[str, dict], float]]:
    """(pair, {setup: row}, ratio) of every complete pair of `--pairs` (both setups of
    `composed.PAIRED` ran without error), in pair order; the ratio is
    `composed.pair_ratios`'s: hf-liger's step time over ours-bf16's."""
    by: dict[int, dict[str, dict]] = {}
    for r in rows:
        if is_pair(r) and "error" not in r:
            by.setdefault(r["pair"], {})[r["setup"]] = r
    done = [(k, p) for k, p in sorted(by.items()) if set(composed.PAIRED) <= set(p)]
    ratios = composed.pair_ratios(rows)
    assert len(ratios) == len(done), "pair_ratios and the complete pairs disagree"
    return [(k, p, q) for (k, p), q in zip(done, ratios)]


def median_pair(rows: list[dict]) -> dict[str, dict] | None:
    """{setup: row} of the pair whose ratio is the median of the pairs' (the lower of
    the two middle ones for an even count), or None without a complete pair."""
    done = sorted(pairs(rows), key=lambda t: t[2])
    return done[(len(done) - 1) // 2][1] if done else None


def one_per_setup(rows: list[dict]) -> list[dict]:
    """One row per setup name, where each setup first appears: the rule every table and
    every lookup by name in this chapter follows. A setup's untagged row when it has one
    (the first); else, for the setups `--pairs` timed in turns, the row of the median
    pair (`median_pair`), so both headline rows come from the same turn; else its first
    row that did not fail, else its first row."""
    mid = median_pair(rows) or {}
    untagged = {r.get("setup") for r in rows if not is_pair(r)}
    out, seen = [], set()
    for r in rows:
        name = r.get("setup")
        if name in seen or (is_pair(r) and name in untagged):
            continue
        if is_pair(r):
            same = [x for x in rows if x.get("setup") == name]
            r = mid.get(name) or next((x for x in same if "error" not in x), same[0])
        out.append(r)
        seen.add(name)
    return out


def by_setup(rows: list[dict]) -> dict[str, dict]:
    """{setup: row} of the rows that did not fail, one a setup (`one_per_setup`)."""
    return {r["setup"]: r for r in one_per_setup(rows) if "error" not in r}
