"""Is the CUDA graph's lead on the fp8 step real? Reads the rounds of
`bench composed --setups ours-fp8-eager ours-fp8` (from f54e2f6; before it the pair was
named ours-fp8 and ours-fp8-graph), each saved under its own
$COLOSSAL_LAB_RESULTS (`<dir>/<gpu>/composed.json`), and prints each round's ratio
(eager step over graph step) with both p10–p90 ranges. Exit 0 when the graph was ahead
in every round, 1 otherwise, 2 on bad input. A working tool for notes/finale.md.

    python notes/graph_pairs.py OUT/r1 OUT/r2 OUT/r3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows_of(folder: Path) -> dict[str, dict]:
    files = sorted(folder.glob("*/composed.json"))
    if len(files) != 1:
        raise ValueError(f"{folder}: expected one <gpu>/composed.json, found {len(files)}")
    doc = json.loads(files[0].read_text())
    return {r["setup"]: r for r in doc["rows"] if "error" not in r}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: graph_pairs.py ROUND_DIR [ROUND_DIR ...]", file=sys.stderr)
        return 2
    ahead = []
    for folder in map(Path, argv):
        try:
            rows = rows_of(folder)
            eager, graph = ((rows["ours-fp8-eager"], rows["ours-fp8"])
                            if "ours-fp8-eager" in rows else
                            (rows["ours-fp8"], rows["ours-fp8-graph"]))
        except (ValueError, KeyError, OSError) as e:
            print(f"graph_pairs: {folder}: {e}", file=sys.stderr)
            return 2
        ratio = eager["step_ms"] / graph["step_ms"]
        ahead.append(ratio > 1.0)
        print(f"{folder.name}: eager {eager['step_ms']:.1f} ms "
              f"({eager['step_ms_p10']:.1f}-{eager['step_ms_p90']:.1f}), graph "
              f"{graph['step_ms']:.1f} ({graph['step_ms_p10']:.1f}-"
              f"{graph['step_ms_p90']:.1f}): x{ratio:.3f}")
    verdict = all(ahead)
    print(f"graph ahead in {sum(ahead)} of {len(ahead)} rounds: "
          f"{'every round' if verdict else 'not every round'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
