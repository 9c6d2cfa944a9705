"""The attention sweep's reading: the targets off the rows, and the summary table.

`targets` holds ours against cuDNN at the canonical point and over long sequences,
`targets_summary` says it in lines, `summary` prints the ratios at a few points.
"""

from __future__ import annotations

from colossal_lab.benchmarks.flash_attention_cases import CANONICAL, OUR_VARIANTS, layout_of
from colossal_lab.measure.results import fell_back

TARGET_CANONICAL = 0.90
"""Target: ours / cuDNN at the canonical point, forward and fwd+bwd."""
TARGET_LONG = 0.85
"""Target: ours / cuDNN at every point with S >= `TARGET_MIN_SEQ`."""
TARGET_MIN_SEQ = 1024
POINT = ("batch", "heads", "kv_heads", "seq_len", "head_dim", "causal")
"""The fields that make a sweep point (with the provider, a row)."""


def _point(r: dict) -> tuple:
    return tuple(r.get("kv_heads", r["heads"]) if f == "kv_heads" else r[f] for f in POINT)


def targets(rows: list[dict], *, numerator: str = "triton",
            denominator: str = "cudnn") -> list[dict]:
    """The targets, read off `rows`: one dict per check, the canonical point
    first (fwd, fwd+bwd; ≥ `TARGET_CANONICAL`), then every point with S ≥
    `TARGET_MIN_SEQ` that any speed row measured (fwd, fwd+bwd; ≥ `TARGET_LONG`).

    Each dict: "check", "metric" ("fwd" or "fwd_bwd"), the point's fields and "layout",
    "ratio" (`numerator` / `denominator` TFLOP/s, None when not measured), "target",
    "status" ("met", "not met" or "not measured") and "why" (for "not measured": which
    provider has no figure and its `error` / `skipped`, or a timing that fell back,
    `results.fell_back`; else None). Where a point has
    several rows of a provider (a re-measured one), the last counts."""
    speed = [r for r in rows if r.get("kind", "speed") == "speed" and "provider" in r]
    last = {(r["provider"], _point(r)): r for r in speed}
    c = CANONICAL
    canon = (c["batch"], c["heads"], c["heads"], c["seq_len"], c["head_dim"], c["causal"])
    long = sorted({_point(r) for r in speed if r["seq_len"] >= TARGET_MIN_SEQ},
                  key=lambda p: (-p[4], not p[5], p[1] // p[2], p[3]))

    def check(name: str, point: tuple, metric: str, target: float) -> dict:
        out = {"check": name, "metric": metric, **dict(zip(POINT, point)),
               "layout": layout_of(point[1], point[2]), "ratio": None, "target": target}
        missing = []
        for p in (numerator, denominator):
            r = last.get((p, point))
            if r is None or not r.get(f"{metric}_tflops"):
                why = "no row" if r is None else (r.get("error") or r.get(f"{metric}_error")
                                                  or r.get("skipped") or "no figure")
                missing.append(f"{p}: {why}"[:120])
            elif fell_back(r):  # timed by a fallback: a failed measurement, not a figure
                missing.append(f"{p}: {r['timing']}"[:120])
        if missing:
            return {**out, "status": "not measured", "why": "; ".join(missing)}
        ratio = (last[(numerator, point)][f"{metric}_tflops"]
                 / last[(denominator, point)][f"{metric}_tflops"])
        return {**out, "ratio": ratio, "status": "met" if ratio >= target else "not met",
                "why": None}

    out = [check("canonical", canon, m, TARGET_CANONICAL) for m in ("fwd", "fwd_bwd")]
    out += [check(f"S>={TARGET_MIN_SEQ}", p, m, TARGET_LONG)
            for p in long for m in ("fwd", "fwd_bwd")]
    return out


def targets_summary(checks: list[dict]) -> str:
    """Two lines: the canonical ratios, then how many long-sequence checks are met,
    missed (the worst) and not measured."""
    canon = [c for c in checks if c["check"] == "canonical"]
    lines = ["goals, ours / cuDNN: canonical " + ", ".join(
        f"{c['metric']} " + (f"{c['ratio']:.2f}" if c["ratio"] is not None else "-")
        + f" ({c['status']}, >= {c['target']:.2f})" for c in canon)]
    rest = [c for c in checks if c["check"] != "canonical"]
    if rest:
        n = {s: [c for c in rest if c["status"] == s]
             for s in ("met", "not met", "not measured")}
        worst = min(n["not met"], key=lambda c: c["ratio"], default=None)
        lines.append(
            f"  {rest[0]['check']} (>= {rest[0]['target']:.2f}): {len(n['met'])} met, "
            f"{len(n['not met'])} not met, {len(n['not measured'])} not measured of "
            f"{len(rest)}" + (f"; worst {worst['ratio']:.2f} at S={worst['seq_len']} "
                              f"D={worst['head_dim']} {worst['layout']} "
                              f"{'causal' if worst['causal'] else 'full'} "
                              f"{worst['metric']}" if worst else ""))
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Provider × key cases, fwd / fwd+bwd TFLOP/s; ratios at the canonical point."""
    speed = [r for r in rows if r.get("kind") == "speed"]
    if not speed:
        return "no speed rows"
    big = max(r["seq_len"] for r in speed)
    dims = sorted({r["head_dim"] for r in speed}, reverse=True)
    c = CANONICAL
    cases = [(f"S={c['seq_len']} D={c['head_dim']} causal", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=True)),
             (f"S={c['seq_len']} D={c['head_dim']} full", dict(
                 seq_len=c["seq_len"], head_dim=c["head_dim"], causal=False)),
             (f"S={big} D={c['head_dim']} causal", dict(seq_len=big,
                                                       head_dim=c["head_dim"], causal=True))]
    cases += [(f"S={c['seq_len']} D={d} causal", dict(seq_len=c["seq_len"], head_dim=d,
                                                      causal=True))
              for d in dims if d != c["head_dim"]]
    if not any(r["seq_len"] == c["seq_len"] for r in speed):  # quick runs
        cases = [(f"S={big} D={dims[0]} causal", dict(seq_len=big, head_dim=dims[0],
                                                      causal=True))]

    def find(provider, kv_heads=None, **match):
        for r in speed:
            if r["provider"] == provider and all(r.get(k) == v for k, v in match.items()) \
                    and (kv_heads is None or r["kv_heads"] == kv_heads) \
                    and (kv_heads is not None or r["kv_heads"] == r["heads"]):
                return r
        return None

    def cell(r):
        if r is None:
            return "-"
        if "fwd_tflops" not in r:
            return r.get("skipped", "error")[:13]
        return f"{r['fwd_tflops']:.0f} / " + (f"{r['fwd_bwd_tflops']:.0f}"
                                              if "fwd_bwd_tflops" in r else "error")

    cases = [(name, m) for name, m in cases if any(find(p, **m) for p in
                                                   {r["provider"] for r in speed})]
    if not cases:  # a chunk without the canonical point: its first MHA point
        r = next((r for r in speed if r["kv_heads"] == r["heads"]), speed[0])
        cases = [(f"S={r['seq_len']} D={r['head_dim']} "
                  f"{'causal' if r['causal'] else 'full'}",
                  dict(seq_len=r["seq_len"], head_dim=r["head_dim"], causal=r["causal"]))]
    providers = list(dict.fromkeys(r["provider"] for r in speed))
    width = 24
    lines = ["TFLOP/s, fwd / fwd+bwd (fwd+bwd counted as 3.5 x fwd), MHA",
             f"{'provider':<16}" + "".join(f"{name:>{width}}" for name, _ in cases)]
    for p in providers:
        lines.append(f"{p:<16}" + "".join(f"{cell(find(p, **m)):>{width}}" for _, m in cases))
    name, m = cases[0]
    ours = find("triton", **m)
    if ours and "fwd_tflops" in ours:
        for other in ("sdpa-flash", "cudnn", "flex", "flash_attn", *OUR_VARIANTS):
            r = find(other, **m)
            if r and "fwd_tflops" in r:
                lines.append(f"triton / {other} at {name}: fwd "
                             f"{ours['fwd_tflops'] / r['fwd_tflops']:.2f}x, fwd+bwd "
                             f"{ours['fwd_bwd_tflops'] / r['fwd_bwd_tflops']:.2f}x")
    at = {k: v for k, v in m.items()}
    for kv in sorted({r["kv_heads"] for r in speed if r["kv_heads"] != r["heads"]
                      and all(r.get(k) == v for k, v in at.items())}, reverse=True):
        gqa = [r for r in speed if r["kv_heads"] == kv
               and all(r.get(k) == v for k, v in at.items())]
        lines.append(f"grouped-query (Hkv={kv}) at {name}: " + ", ".join(
            f"{r['provider']} {cell(r)}" for r in gqa))
    mem = [r for r in rows if r.get("kind") == "memory"]
    if mem:
        seqs = sorted({r["seq_len"] for r in mem})
        lines.append("peak memory of one fwd+bwd, GiB (B=1, H=32, D=128, causal)")
        lines.append(f"{'provider':<16}" + "".join(f"{'S=' + str(s):>10}" for s in seqs))
        for p in dict.fromkeys(r["provider"] for r in mem):
            cells = []
            for s in seqs:
                r = next((r for r in mem if r["provider"] == p and r["seq_len"] == s), None)
                cells.append(f"{r['peak_mem_gib']:.2f}" if r and "peak_mem_gib" in r
                             else (r or {}).get("skipped", "error")[:8])
            lines.append(f"{p:<16}" + "".join(f"{x:>10}" for x in cells))
    if any(r["provider"] == "cudnn" for r in speed):
        lines.append(targets_summary(targets(rows)))
    return "\n".join(lines)


