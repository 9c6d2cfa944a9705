"""Does TunableOp (torch timing every cuBLASLt algorithm per GEMM shape) speed up the
finale's bf16 step? A working tool, not a results file (notes/finale.md).

    python notes/probe_gemm_tunableop.py OUT.json

ours-bf16 and hf-liger, each in a child process (`steps.measure_isolated`, 20 timed
steps), first with cuBLAS's default algorithms, then with TunableOp tuning on; the
tuned choices go to tunableop<device>.csv beside OUT.
"""

import json
import os
import sys
import time

from colossal_lab.benchmarks import composed, steps


def main() -> None:
    out = sys.argv[1]
    by = {s.name: s for s in composed.SETUPS}
    tuned_env = {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_TUNING": "1",
                 "PYTORCH_TUNABLEOP_FILENAME": os.path.join(
                     os.path.dirname(os.path.abspath(out)), "tunableop%d.csv")}
    rows = []
    for tuned in (False, True):
        for name in ("ours-bf16", "hf-liger"):
            saved = dict(os.environ)
            os.environ.update(tuned_env if tuned else {})  # the child inherits it
            t0 = time.time()
            try:
                r = steps.measure_isolated(by[name], "llama-7b-8l", 4096, 4)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            r.update(tunableop=tuned, wall_s=time.time() - t0)
            rows.append(r)
            print(name, "tuned" if tuned else "default", r.get("step_ms"),
                  r.get("step_ms_p10"), r.get("step_ms_p90"), r.get("mfu"),
                  r.get("error"), flush=True)
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
