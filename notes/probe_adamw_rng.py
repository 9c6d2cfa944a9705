"""Is the bf16-moment AdamW update bound by its random bits? The old kernel drew them
with `tl.randint` (Philox, ten rounds an element); the current one with `_hash32` (about
eight integer operations). A working tool, not a results file.

    git show 4c437d9:colossal_lab/kernels/adamw.py > OLD.py   # the Philox kernel
    python notes/probe_adamw_rng.py OLD.py OUT.json

On llama-7b-8l's parameter shapes (1.88 G bf16 parameters, split masters, bf16
moments, gradients present), one `FusedAdamW` step of each kernel (the clipping pass
included, as in the finale's step), timed in turns: 5 rounds of 10 steps each after 3
warm-ups, CUDA events around each step; median and p10-p90, and the effective GB/s at
20 bytes a parameter (18 for the update, 2 for the norm pass).
"""

import argparse
import importlib.util
import json
import sys

import torch

from colossal_lab.config import PRESETS
from colossal_lab.kernels import adamw
from colossal_lab.measure import timing
from colossal_lab.model import LlamaModel


def _load(path: str):
    spec = importlib.util.spec_from_file_location("adamw_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["adamw_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the old kernels.adamw module's source file")
    ap.add_argument("out", help="JSON file for the rows")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = PRESETS["llama-7b-8l"]()
    with torch.device("meta"):
        shapes = [p.shape for p in LlamaModel(cfg).parameters()]
    n = sum(s.numel() for s in shapes)
    opts = {}
    for name, mod in (("philox", _load(args.old)), ("hash32", adamw)):
        g = torch.Generator(device=device).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g,
                                                 dtype=torch.bfloat16) * 0.02)
                  for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=g,
                                 dtype=torch.bfloat16) * 1e-3
        opts[name] = mod.FusedAdamW(params, lr=1e-4, moments="bf16")

    def step(opt):
        opt.clip_grad_norm_(1.0)
        opt.step()

    times = {k: [] for k in opts}
    for opt in opts.values():  # compile and warm up, states made
        for _ in range(3):
            step(opt)
    torch.cuda.synchronize()
    for order in timing.in_turns(list(opts), 5):
        for k in order:
            timing.time_iterations(lambda i, o=opts[k]: step(o), warmup=1, iters=10,
                                   device=device,
                                   on_step=lambda i, ms, k=k: times[k].append(ms))
    rows = {}
    for k, ts in times.items():
        ts = sorted(ts)
        med = ts[len(ts) // 2]
        p10, p90 = timing.quantile_10_90(ts)
        rows[k] = {"ms": round(med, 3), "p10_ms": round(p10, 3), "p90_ms": round(p90, 3),
                   "gbps_20B": round(20 * n / med / 1e6, 1), "steps": len(ts)}
        print(f"{k:<8} {med:7.3f} ms (p10-p90 {p10:.3f}-{p90:.3f}) "
              f"{rows[k]['gbps_20B']:7.0f} GB/s at 20 B", flush=True)
    rows["ratio_philox_over_hash32"] = round(rows["philox"]["ms"] / rows["hash32"]["ms"], 4)
    print(f"philox / hash32: {rows['ratio_philox_over_hash32']:.3f}", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"preset": "llama-7b-8l", "params": n, **rows}, fh, indent=1)


if __name__ == "__main__":
    main()
