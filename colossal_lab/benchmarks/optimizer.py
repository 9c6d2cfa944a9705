"""The optimizer step alone: clipping + AdamW over `llama-7b-8l`'s parameters, four ways.

Every switch is on (fused projections); the four run side by side in one run."""

from __future__ import annotations

import gc

import torch

from colossal_lab.benchmarks.harness import Benchmark, flag
from colossal_lab.config import SWITCH_SETS, preset
from colossal_lab.kernels.adamw import FusedAdamW
from colossal_lab.measure import timing
from colossal_lab.measure.hardware import measure_copy_gbps
from colossal_lab.model import build_model
from colossal_lab.switches.apply import apply_switches
from colossal_lab.training import optimizer as precision

NAME = "optimizer"
PROVIDERS = ("torch-fp32", "ours-fp32", "master", "ours-master", "ours-master-m16")
BYTES_PER_PARAM = {"torch-fp32": 40, "ours-fp32": 32, "master": 46, "ours-master": 28,
                   "ours-master-m16": 20}
"""Bytes a parameter each provider moves (see `kernels.adamw`); ours-master keeps its
fp32 masters split (`split_master`): 26 for the update and 2 for the norm pass;
ours-master-m16 also holds the moments in bf16 (a change of numerics)."""
HP = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
CLIP = 1.0


def param_shapes(preset_name: str) -> list[torch.Size]:
    """The trainable parameters' shapes with every switch on (meta device: no memory)."""
    model = build_model(preset(preset_name), "meta")
    model = apply_switches(model, SWITCH_SETS["best"].replace(
        precision="fp32", enable_fused_optimizer=False), None)
    return [p.shape for p in model.parameters() if p.requires_grad]


def _make(provider: str, shapes, device):
    dtype = torch.bfloat16 if "master" in provider else torch.float32
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn(s, device=device, dtype=dtype) * 1e-3
        params.append(p)
    if provider.startswith("ours"):
        opt = FusedAdamW(params, **HP, moments="bf16" if provider.endswith("m16") else "fp32")

        def step():
            opt.clip_grad_norm_(CLIP)
            opt.step()
    else:
        opt = precision.MasterAdamW(params, **HP) if provider == "master" else \
            torch.optim.AdamW(params, **HP, fused=torch.device(device).type == "cuda")

        def step():
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
    return params, step


def run(quick: bool = False, providers=PROVIDERS, progress: bool = True) -> list[dict]:
    """Every provider's optimizer step on the model's parameter shapes, side by side.

        provider      parameters  optimizer                                       bytes/param
        torch-fp32    fp32        clip_grad_norm_, torch AdamW(fused=True)        4+8 + 28 = 40
        ours-fp32     fp32        FusedAdamW (clipping folded in)                 4 + 28   = 32
        master        bf16        clip_grad_norm_, MasterAdamW (fp32 masters)     2+4 + 40 = 46
        ours-master   bf16        FusedAdamW, fp32 masters split (bf16 + int16)   2 + 26   = 28
        ours-master-m16 bf16      the same with bf16 moments (stochastic rounding) 2 + 18  = 20

    fp32 parameters are what bf16 autocast and fp8 train (switch 6), bf16 ones with fp32
    masters what "bf16-pure" trains (chapter 10's ours-bf16). The byte counts are the
    ideal traffic of each (the table in `kernels.adamw`); the time is one whole step
    (norm, clipping and update, Python launches included), timed as a training step is
    (`timing.time_iterations`, CUDA events, 20 steps after 3 warm-ups), each provider on
    fresh random gradients of the same shapes, one at a time (each needs ~30 GB). The
    ceiling is the device's measured copy bandwidth.

        python -m colossal_lab bench optimizer            # -> results/<gpu>/optimizer.json
        python -m colossal_lab bench optimizer --quick    # the tiny model (CPU: interpreter)
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "tiny" if quick else "llama-7b-8l"
    shapes = param_shapes(name)
    n = sum(s.numel() for s in shapes)
    copy_gbps = None
    if device.type == "cuda":

        copy_gbps = measure_copy_gbps(device=device)
    rows = []
    for prov in providers:
        params, one_step = _make(prov, shapes, device)
        t = timing.time_iterations(lambda i, f=one_step: f(), warmup=3 if not quick else 1,
                                   iters=20 if not quick else 2, device=device)
        nbytes = BYTES_PER_PARAM[prov] * n
        rows.append({"provider": prov, "model": name, "params": n, "tensors": len(shapes),
                     "ms": t.median_ms, "ms_p10": t.p10_ms, "ms_p90": t.p90_ms,
                     "steps": t.n, "bytes_per_param": BYTES_PER_PARAM[prov],
                     "gbytes": nbytes / 1e9, "gbps": timing.gbps(nbytes, t.median_ms),
                     "copy_gbps": copy_gbps})
        if progress:
            print(f"{prov:12s} {t}")
        del params, one_step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by = {r["provider"]: r for r in rows}
    for r in rows:  # each fused one against its unfused sibling, in the same run
        base = by.get({"ours-fp32": "torch-fp32", "ours-master": "master",
                       "ours-master-m16": "master"}.get(r["provider"], r["provider"]))
        r["speedup_vs_unfused"] = base["ms"] / r["ms"] if base else None
        r["of_copy_ceiling"] = r["gbps"] / copy_gbps if copy_gbps else None
    return rows


def config_of() -> dict:
    return {"model": "llama-7b-8l, every switch (fused projections)", "clip": CLIP,
            "hyper": {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()},
            "bytes_per_param": BYTES_PER_PARAM,
            "timing": "timing.time_iterations: CUDA events around each whole optimizer "
                      "step (norm, clip, update; launches included), 3 warm-up, 20 timed",
            "ceiling": "hardware.measure_copy_gbps (read + write bytes)"}


def _table(rows: list[dict]) -> str:
    return "\n".join(f"{r['provider']:12s} {r['ms']:7.2f} ms  {r['gbps']:6.0f} GB/s "
                     f"({r['of_copy_ceiling']:.0%} of copy)  x{r['speedup_vs_unfused']:.2f}"
                     for r in rows)


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny model on the CPU, not saved",
    options=[flag("providers", choices=PROVIDERS)],
    run=lambda a: run(a.quick, providers=tuple(a.providers) if a.providers else PROVIDERS),
    config=lambda a: config_of(), summary=_table)
main = BENCH.main


if __name__ == "__main__":
    main()
