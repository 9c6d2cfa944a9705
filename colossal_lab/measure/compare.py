"""Comparing measured steps honestly: a ratio, its spread, "level" inside the noise.

Every step row carries the median step time and its p10 and p90 over at least 20
timed steps (`train.measure_step`). Two setups differ only when their medians lie
outside each other's p10-p90 range; otherwise the book calls them *level*, whatever
the ratio of the medians says. The chapters use `versus` for every "x times faster".
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_STEPS = 20
"""Fewer timed steps than this make the p10-p90 spread meaningless."""


@dataclass(frozen=True)
class Comparison:
    """`a` against `b`: `speedup` = b's median step time / a's (> 1: a is faster)."""

    a: str
    b: str
    speedup: float
    level: bool
    """The medians lie inside each other's p10-p90 range: no measurable difference."""
    few_steps: bool
    """One side timed fewer than `MIN_STEPS` steps: its spread is not trustworthy."""

    @property
    def verdict(self) -> str:
        """"level", "faster" or "slower": `a` against `b` by the p10-p90 rule."""
        return "level" if self.level else ("faster" if self.speedup > 1 else "slower")

    def __str__(self) -> str:
        note = f", fewer than {MIN_STEPS} steps timed" if self.few_steps else ""
        return f"{self.a} vs {self.b}: x{self.speedup:.3f} ({self.verdict}{note})"


def _range(row: dict) -> tuple[float, float]:
    return row["step_ms_p10"], row["step_ms_p90"]


def versus(a: dict, b: dict) -> Comparison:
    """Compare two step rows (same batch and sequence length, or tokens/s would be the
    fair measure: then compare `tokens_per_s` yourself)."""
    if (a["batch"], a["seq_len"]) != (b["batch"], b["seq_len"]):
        raise ValueError(f"{a['setup']} and {b['setup']} ran different batches "
                         f"({a['batch']}x{a['seq_len']} vs {b['batch']}x{b['seq_len']}): "
                         "compare tokens_per_s, not step times")
    (a10, a90), (b10, b90) = _range(a), _range(b)
    level = a10 <= b["step_ms"] <= a90 or b10 <= a["step_ms"] <= b90
    few = min(a.get("steps_timed", 0), b.get("steps_timed", 0)) < MIN_STEPS
    return Comparison(a["setup"], b["setup"], b["step_ms"] / a["step_ms"], level, few)


def spread(row: dict) -> str:
    """"p10-p90 ms (n)" of a step row, for tables: e.g. "383-404 (20)"."""
    if row.get("step_ms_p10") is None:
        return "–"
    return f"{row['step_ms_p10']:.0f}–{row['step_ms_p90']:.0f} ({row.get('steps_timed', '?')})"


def with_spread(rows: list[dict]) -> list[dict]:
    """Copies of `rows` with a `spread` column (see `spread`), for `notebook.table`."""
    return [{**r, "spread": spread(r)} for r in rows]


def verdict(a: dict, b: dict) -> str:
    """A short table cell: "x1.05" or "x1.01 (level)"."""
    c = versus(a, b)
    return f"x{c.speedup:.2f}" + (" (level)" if c.level else "")
