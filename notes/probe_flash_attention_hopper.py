"""Probe the Hopper attention kernels against the portable ones and cuDNN, same process.

    python notes/probe_flash_attention_hopper.py [--shapes N] [--head-dims D ...]
                                                 [--seq-lens S ...] [--out probe.json]
        [--shape B,HQ,HKV,S,D,causal|full ...] [--schedules ...] [--schedulers ...]
        [--epilogues ...]
        [--stages 2 3 4] [--keys 64 128] [--diag-skip] [--rounds 3]

A working tool for choosing `flash_attention.AUTO_HOPPER` and the forward's schedule and
persistence, not a results file. Each variant is timed by CUDA-graph replay with the L2
flushed (`timing.time_kernels`, as the sweep times), and the whole set of variants
`--rounds` times over, interleaved: the median of the rounds and their p10-p90 are
kept. (Until 2026-12-03 it timed eager calls with events, one pass: at the 0.1 ms
kernels of S1024 two runs disagreed by more than the effects probed.) Read ratios
within one run only. The sweep
(`python -m colossal_lab bench flash_attention`) is what the book records. Per shape it
prints forward TFLOP/s for cuDNN, the portable forward and each Hopper schedule under
each scheduler (`flash_attention_hopper.SCHEDULERS`), and fwd+bwd TFLOP/s for cuDNN,
the portable kernels, the Hopper kernels and "auto"; the largest gradient differences
against cuDNN's, and each forward variant's largest output difference (`fwd_err`): a
variant that is fast and wrong shows there.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from colossal_lab.kernels import flash_attention as fa
from colossal_lab.kernels import flash_attention_hopper as hopper
from colossal_lab.measure import timing

SHAPES = [  # batch, query heads, kv heads, S, D, causal: B·S = 16k tokens, H·D = 4096
    (16, 32, 32, 1024, 128, True), (16, 32, 32, 1024, 128, False),
    (8, 32, 4, 2048, 128, True), (4, 32, 32, 4096, 128, True),
    (4, 32, 32, 4096, 128, False), (32, 32, 32, 512, 128, False),
    (4, 64, 64, 4096, 64, True), (1, 32, 32, 16384, 128, True),
    (4, 16, 16, 4096, 256, True), (4, 16, 16, 4096, 256, False),
    (16, 16, 16, 1024, 256, True), (8, 16, 16, 2048, 256, True),
]


SCHEDULES = tuple(hopper.SCHEDULES)  # --schedules narrows it
SCHEDULERS = tuple(hopper.SCHEDULERS)  # --schedulers narrows it
EPILOGUES = (hopper.DEFAULT_EPILOGUE,)  # --epilogues widens it
STAGES = (hopper.STAGES,)  # --stages widens it
KEYS = (None,)  # keys per step; --keys widens it (None: `hopper.block_n`)
SKIPS = (False,)  # warpgroup 0's diagonal skip; --diag-skip adds it where it applies
ROUNDS = 3  # interleaved repetitions of the whole set of variants (--rounds)


def variant_name(schedule: str, scheduler: str, epilogue: str, stages: int,
                 keys: int | None = None, skip: bool = False) -> str:
    """e.g. "pingpong-dynamic-tma-s3" or "serial-grid-k64-s4-skip"; defaults add
    nothing."""
    return (f"{schedule}-{scheduler}"
            + ("" if epilogue == hopper.DEFAULT_EPILOGUE else f"-{epilogue}")
            + ("" if keys is None else f"-k{keys}")
            + ("" if stages == hopper.STAGES else f"-s{stages}")
            + ("-skip" if skip else ""))


def fits(d: int, stages: int, keys: int | None) -> bool:
    """The Hopper forward takes this many slots and keys a step at head dim d."""
    bn = keys or hopper.block_n(d)
    return bn <= hopper.block_n(d) and hopper.shared_bytes(d, bn, stages, 1) <= \
        hopper.SHARED_LIMIT


def parse_shape(text: str) -> tuple:
    """"4,16,4,4096,256,causal" -> (4, 16, 4, 4096, 256, True)."""
    *ints, mask = text.split(",")
    if len(ints) != 5 or mask not in ("causal", "full"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected B,HQ,HKV,S,D,causal|full")
    return (*map(int, ints), mask == "causal")


def timed(fns: dict, rounds: int) -> dict:
    """{name: (median, p10, p90) ms}: every function timed by CUDA-graph replay
    (`timing.time_kernels`, as the sweep times, L2 flushed), the whole set `rounds`
    times over, interleaved, so that a drift of the clocks reaches every variant alike;
    the median and the p10/p90 are over all rounds' replays' medians."""
    per: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t, how = timing.time_kernels(f, device="cuda", reps=30)
            per[name].append(t.median_ms)
    out = {}
    for name, ms in per.items():
        ms = sorted(ms)
        lo, hi = timing.quantile_10_90(ms)
        out[name] = (ms[len(ms) // 2], lo, hi, ms)
    return out


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def probe(b: int, hq: int, hkv: int, s: int, d: int, causal: bool) -> dict:
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    flop = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    o, lse = torch.empty_like(q), torch.empty(b, hq, s, device="cuda")
    fwd = {"cudnn": lambda: cudnn(q, k, v, causal),
           "portable": lambda: fa.flash_attention_forward(q, k, v, causal,
                                                          kernel="portable")}
    if hopper.unsupported(q, k, v) is None:
        for schedule in SCHEDULES:
            for scheduler in SCHEDULERS:
                for epilogue in EPILOGUES:
                    for st, kn, sk in ((st, kn, sk) for st in STAGES for kn in KEYS
                                       for sk in SKIPS if fits(d, st, kn)):
                        if sk and not hopper.diag_skip_applies(
                                causal, kn or hopper.block_n(d), schedule):
                            continue
                        name = variant_name(schedule, scheduler, epilogue, st, kn, sk)
                        fwd[name] = (lambda sch=schedule, sc=scheduler, ep=epilogue,
                                     st=st, kn=kn, sk=sk: hopper.forward(
                                         q, k, v, causal, d ** -0.5, o, lse, schedule=sch,
                                         scheduler=sc, epilogue=ep, stages=st,
                                         keys_per_step=kn, diag_skip=sk))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), do)

    both = {"cudnn": fwd_bwd(lambda q, k, v: cudnn(q, k, v, causal))}
    for kernel in ("portable", "hopper", "auto"):
        if kernel != "hopper" or hopper.unsupported(q, k, v, "backward") is None:
            both[kernel] = fwd_bwd(lambda q, k, v, kern=kernel: fa.flash_attention(
                q, k, v, causal, kernel=kern))
    ref = both["cudnn"]()
    row = {"shape": f"B{b} H{hq}/{hkv} S{s} D{d} {'causal' if causal else 'full'}",
           "auto": fa.kernel_plan(q, k, v, causal=causal), "fwd": {}, "fwd_bwd": {},
           "grad_err": {}}
    for name, f in both.items():
        row["grad_err"][name] = [round((g.float() - r.float()).abs().max().item(), 4)
                                 for g, r in zip(f(), ref)]
    ref_o, row["fwd_err"] = cudnn(q, k, v, causal), {}
    for name, f in fwd.items():  # each variant's output, not only its time
        out = f()  # (cuDNN: o; portable: (o, lse); Hopper variants fill `o`)
        got = out if isinstance(out, torch.Tensor) else out[0] if out else o
        row["fwd_err"][name] = round((got.float() - ref_o.float()).abs().max().item(), 4)
    for key, fns, scale in (("fwd", fwd, 1.0), ("fwd_bwd", both, 3.5)):
        for name, (ms, p10, p90, each) in timed(fns, ROUNDS).items():
            row[key][name] = {"tflops": round(scale * flop / ms / 1e9, 1),
                              "ms": round(ms, 4), "p10_p90_ms": [round(p10, 4),
                                                                 round(p90, 4)],
                              "rounds_ms": [round(x, 4) for x in each]}
    return row


def main() -> None:
    global SCHEDULES, SCHEDULERS, EPILOGUES, STAGES, KEYS, SKIPS, ROUNDS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes")
    p.add_argument("--head-dims", type=int, nargs="+", help="only shapes of these")
    p.add_argument("--seq-lens", type=int, nargs="+", help="only shapes of these")
    p.add_argument("--out", default="probe_flash_attention_hopper.json")
    p.add_argument("--schedules", nargs="+", choices=tuple(hopper.SCHEDULES),
                   help="the Hopper forward's schedules to time (default: all)")
    p.add_argument("--schedulers", nargs="+", choices=tuple(hopper.SCHEDULERS),
                   help="the Hopper forward's schedulers to time (default: all)")
    p.add_argument("--epilogues", nargs="+", choices=tuple(hopper.EPILOGUES),
                   help="the Hopper forward's epilogues to time (default: the default)")
    p.add_argument("--stages", nargs="+", type=int, choices=hopper.STAGE_CHOICES,
                   help="K/V slots of the Hopper forward to time (default: the default)")
    p.add_argument("--keys", nargs="+", type=int, choices=hopper.KEYS_CHOICES,
                   help="keys per step of the Hopper forward to time (default: its own)")
    p.add_argument("--diag-skip", action="store_true",
                   help="also time warpgroup 0's skip of each causal tile's last key tile "
                        "(64 keys a step, not ping-pong)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="time the whole set of variants this many times, interleaved")
    p.add_argument("--shape", nargs="+", type=parse_shape, default=[],
                   help="probe these shapes instead of the built-in list, e.g. "
                        "4,16,4,4096,256,causal")
    a = p.parse_args()
    SCHEDULES = tuple(a.schedules or SCHEDULES)
    SCHEDULERS = tuple(a.schedulers or SCHEDULERS)
    EPILOGUES = tuple(a.epilogues or EPILOGUES)
    STAGES = tuple(a.stages or STAGES)
    KEYS = tuple(a.keys or KEYS)
    SKIPS = (False, True) if a.diag_skip else SKIPS
    ROUNDS = a.rounds
    rows = []
    shapes = [s for s in (a.shape or SHAPES) if (not a.head_dims or s[4] in a.head_dims)
              and (not a.seq_lens or s[3] in a.seq_lens)]
    for shape in shapes[:a.shapes]:
        rows.append(probe(*shape))
        with open(a.out, "w") as f:  # after every shape: a cut run keeps what it has
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        r = rows[-1]
        print(r["shape"], f"(auto: {r['auto']})", flush=True)
        for key in ("fwd", "fwd_bwd"):
            print(f"  {key:8s}", "  ".join(f"{n} {v['tflops']:.0f}"
                                          for n, v in r[key].items()), flush=True)
        print("  max |grad - cuDNN's|", r["grad_err"], flush=True)
        worst = max(r["fwd_err"].items(), key=lambda kv: kv[1])
        print(f"  max |o - cuDNN's|: {worst[1]} ({worst[0]}, the worst variant)",
              flush=True)


if __name__ == "__main__":
    main()
