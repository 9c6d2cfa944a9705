"""Do the fp8 fusions that have not yet run on a GPU hold there? A gate for the closing.

    python notes/fusion_gate.py QKV.json [NORM.json]

reads what `notes/probe_fp8_qkv.py` and `notes/probe_fp8_norm.py` wrote and says, for
each fusion, whether it wrote the composed path's bits (every output, gradient and
amax history) and whether its node ran no slower than the composed one (medians of the
alternating reps). Exit 0 when both hold for both; 1 otherwise, naming the
`Switches.extra` key that turns the failing fusion off (`fp8_fuse_rope`,
`fp8_fuse_norm`). A missing or unreadable file fails its fusion; without NORM.json only
the RoPE fusion is judged (the norm fusion is opt-in).
"""

from __future__ import annotations

import json
import sys


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def qkv_verdict(out: dict | None) -> list[str]:
    """What fails in `probe_fp8_qkv`'s file (empty: the fusion holds)."""
    if out is None or "bits" not in out or "step" not in out:
        return ["no probe result"]
    bits = out["bits"]
    bad = [f"{k}: {v} elements differ" for k, v in bits.items()
           if k != "histories" and v != 0]
    if not bits.get("histories"):
        bad.append("histories differ")
    fused, comp = out["step"]["fused"]["median_ms"], out["step"]["composed"]["median_ms"]
    if fused > comp:
        bad.append(f"fused {fused:.3f} ms > composed {comp:.3f} ms")
    return bad


def norm_verdict(out: dict | None) -> list[str]:
    """What fails in `probe_fp8_norm`'s file (empty: the fusion holds)."""
    if out is None or "nodes" not in out:
        return ["no probe result"]
    bad = []
    for block, r in out["nodes"].items():
        n = sum(1 for v in r["bits"]["outputs_and_grads"] if v != 0)
        if n:
            bad.append(f"{block}: {n} outputs or gradients differ")
        if not r["bits"]["histories"]:
            bad.append(f"{block}: histories differ")
        fused, comp = r["fused"]["median_ms"], r["composed"]["median_ms"]
        if fused > comp:
            bad.append(f"{block}: fused {fused:.3f} ms > composed {comp:.3f} ms")
    return bad


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: fusion_gate.py QKV.json [NORM.json]", file=sys.stderr)
        return 2
    failed = False
    checks = (("fp8_fuse_rope", qkv_verdict), ("fp8_fuse_norm", norm_verdict))
    for (key, verdict), path in zip(checks, argv):
        bad = verdict(_load(path))
        failed |= bool(bad)
        print(f"{key}: " + ("holds" if not bad else "FAILS (" + "; ".join(bad)
                                                     + f"): turn {key} off"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
