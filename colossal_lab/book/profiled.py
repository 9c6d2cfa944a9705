"""Roofline points from a recorded profile (`benchmarks.profile_breakdown`'s "op" rows).

A results file stores each operator's FLOPs and bytes as `measure.roofline.op_cost`
counted them. An attention operator counted by its memory-bound estimate (one FLOP per
element of its largest tensor, the (B, H, S, D) query: what `op_cost` gives an operator
whose name it does not know) shows attention running at hundreds of TFLOP/s as a few
hundredths of one. `points` recounts such rows, recognised by an intensity below one
FLOP per byte (no attention kernel is that low), with attention's own count from the
query's size and the row's sequence length (causal: 4·B·H·S²·D·½ forward, 2.5 times that
backward; bytes Q, K, V and O, and their gradients backward), as `op_cost` counts SDPA's
and cuDNN's attention operators from their shapes.
"""

from __future__ import annotations

from colossal_lab.measure.roofline import RooflinePoint

BYTES = {"bf16": 2, "bf16-pure": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of the attention tensors, by the row's precision."""


def recounted(row: dict) -> tuple[float, float]:
    """(FLOPs, bytes) per step of an "op" row: attention counted by the memory-bound
    estimate (below one FLOP per byte, which no attention kernel is) recounted as
    attention, anything else as recorded."""
    flops, nbytes = float(row["flops"]), float(row["bytes"])
    if row.get("kernel_class") != "attention" or not nbytes or flops / nbytes >= 1.0:
        return flops, nbytes
    numel = flops / row["calls"]  # the estimate: one FLOP per element of B·H·S·D
    s = row["seq_len"]
    fwd = 2.0 * numel * s  # 4·B·H·S²·D·½ = 2·S·(B·H·S·D)
    esz = BYTES.get(str(row.get("precision")), 2)
    backward = "backward" in row["name"]
    per_call = (2.5 * fwd, 8.0 * numel * esz) if backward else (fwd, 4.0 * numel * esz)
    return per_call[0] * row["calls"], per_call[1] * row["calls"]


def points(rows: list[dict], setup: str) -> list[RooflinePoint]:
    """The roofline points of `setup`'s "op" rows, attention recounted (`recounted`)."""
    out = []
    for r in rows:
        if r.get("kind") == "op" and r.get("setup") == setup:
            flops, nbytes = recounted(r)
            out.append(RooflinePoint(r["name"], r["kernel_class"], r["calls"], r["ms"],
                                     flops, nbytes))
    return out
