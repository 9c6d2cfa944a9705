"""The fp8 step (`SWITCH_SETS["best-fp8"]`: fp8 linears, delayed scaling) eagerly and
replayed as one CUDA graph (`enable_compile="graph"`), on the GPU. A working tool for
the `ours-fp8-graph` setup of `bench composed`, not a results file.

    python notes/probe_fp8_graph.py OUT.json [--steps 6] [--reps 20] [--no-timing]

(a) Correctness at LLaMA-7B's layer shape with 2 layers (seq 1024, batch 2, amax rings
of `--history` 4 entries, so six steps wrap around): three runs from the same seed and
batches, eager, eager again and graphed, `--steps` steps each. Reported: the losses
(bit-for-bit equal or the largest difference), every parameter and every amax history
after the steps (elements that differ, largest difference relative to the largest
value), the ring positions (which must all equal steps mod history), the graph's eager
steps and captures, and the roles never cast (an fp8 head the fused loss does not
call). The second eager run says what the kernels' own run-to-run
differences are, if any: graphed against eager is judged against that.

(b) Time at `llama-7b-8l`, seq 4096, batch 4 (`SWITCH_SETS["best-fp8"]` as is): per
variant a fresh model, `--warmup` steps (the graph's eager steps and capture among
them), then `--reps` steps each between two CUDA events, no host synchronisation in
between: median, p10, p90 in ms, and the peak memory. The variants run in turns,
`--rounds` times. Out-of-memory is recorded, not raised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _diff(a, b) -> dict:
    a, b = a.float(), b.float()
    scale = b.abs().max().item() or 1.0
    return dict(differ=int((a != b).sum().item()), of=a.numel(),
                max_rel=(a - b).abs().max().item() / scale)


def _switches(graph: bool, history: int | None):
    from colossal_lab.config import SWITCH_SETS

    sw = SWITCH_SETS["best-fp8"]
    if history is not None:
        sw = sw.replace(extra={**sw.extra, "fp8_history": history})
    return sw.replace(enable_compile="graph") if graph else sw


def _build(cfg, switches):
    import torch

    from colossal_lab.model import build_model
    from colossal_lab.switches.apply import apply_switches
    from colossal_lab.training.train import make_optimizer, make_step

    torch.manual_seed(0)
    model = apply_switches(build_model(cfg, "cuda"), switches)
    opt = make_optimizer(model)
    return model, opt, make_step(model, opt)


def _batches(cfg, batch: int, seq: int, n: int):
    import itertools

    from colossal_lab.training.data import random_batches

    return list(itertools.islice(random_batches(cfg.vocab_size, batch, seq, seed=0,
                                                device="cuda"), n))


def _run_check(cfg, graph: bool, history: int, batches) -> dict:
    import torch

    from colossal_lab.ops.fp8 import Fp8Linear

    model, opt, step = _build(cfg, _switches(graph, history))
    losses = torch.stack([step(ids, lab) for ids, lab in batches]).float()
    torch.cuda.synchronize()
    out = dict(losses=losses.cpu(),
               params={n: p.detach().clone() for n, p in model.named_parameters()},
               hist={f"{n}.{r}": (s.history.clone(), s.pos, s.seen)
                     for n, m in model.named_modules() if isinstance(m, Fp8Linear)
                     for r, s in m._scalers.items()},
               captures=getattr(step, "captures", None),
               eager_steps=getattr(step, "eager_steps", None),
               capture_s=getattr(step, "capture_s", None))
    del model, opt, step
    torch.cuda.empty_cache()
    return out


def _compare(a: dict, b: dict) -> dict:
    import torch

    la, lb = a["losses"], b["losses"]
    params = {n: _diff(a["params"][n], b["params"][n]) for n in a["params"]}
    hists = {n: _diff(a["hist"][n][0], b["hist"][n][0]) for n in a["hist"]}
    worst = lambda d: max(d.values(), key=lambda r: (r["differ"] > 0, r["max_rel"]))  # noqa: E731
    return dict(
        losses_equal=torch.equal(la, lb), loss_max_abs=(la - lb).abs().max().item(),
        params_equal=all(r["differ"] == 0 for r in params.values()),
        params_differ=sum(r["differ"] for r in params.values()),
        params_worst=worst(params),
        histories_equal=all(r["differ"] == 0 for r in hists.values()),
        histories_differ=sum(r["differ"] for r in hists.values()),
        histories_worst=worst(hists),
        positions_equal=all(a["hist"][n][1:] == b["hist"][n][1:] for n in a["hist"]))


def check(args) -> dict:
    from colossal_lab.config import llama_7b

    cfg = llama_7b().replace(num_hidden_layers=2)
    batches = _batches(cfg, args.check_batch, args.check_seq, args.steps)
    runs = {name: _run_check(cfg, name == "graph", args.history, batches)
            for name in ("eager", "eager2", "graph")}
    positions = {p for r in runs.values() for _, p, seen in r["hist"].values() if seen}
    unstarted = sorted({n for r in runs.values() for n, (_, _, seen) in r["hist"].items()
                        if not seen})
    return dict(
        model="llama-7b x2 layers", seq=args.check_seq, batch=args.check_batch,
        steps=args.steps, history=args.history, fp8_modules_roles=len(runs["eager"]["hist"]),
        losses={k: r["losses"].tolist() for k, r in runs.items()},
        positions=sorted(positions), positions_expected=args.steps % args.history,
        unstarted_roles=unstarted,
        graph_captures=runs["graph"]["captures"], graph_eager_steps=runs["graph"]["eager_steps"],
        graph_capture_s=runs["graph"]["capture_s"],
        graph_vs_eager=_compare(runs["graph"], runs["eager"]),
        eager2_vs_eager=_compare(runs["eager2"], runs["eager"]))


def _time_one(cfg, graph: bool, args) -> dict:
    import torch

    row = dict(variant="graph" if graph else "eager")
    model = opt = step = None
    try:
        torch.cuda.reset_peak_memory_stats()
        model, opt, step = _build(cfg, _switches(graph, None))
        batches = _batches(cfg, args.batch, args.seq, 4)
        t0 = time.perf_counter()
        for i in range(args.warmup):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
        row["warmup_s"] = round(time.perf_counter() - t0, 2)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        for i in range(args.reps):
            starts[i].record()
            step(*batches[i % len(batches)])
            ends[i].record()
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        row.update(median_ms=statistics.median(ms), p10_ms=_pct(ms, 0.1),
                   p90_ms=_pct(ms, 0.9), reps=len(ms), ms=ms,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   captures=getattr(step, "captures", None),
                   eager_steps=getattr(step, "eager_steps", None),
                   capture_s=getattr(step, "capture_s", None))
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"OutOfMemoryError: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # noqa: BLE001 -- a failed capture is a result here
        row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    del model, opt, step
    torch.cuda.empty_cache()
    return row


def timing(args) -> list[dict]:
    from colossal_lab.config import preset

    cfg = preset("llama-7b-8l")
    rows = []
    for r in range(args.rounds):
        for graph in (False, True):
            row = dict(_time_one(cfg, graph, args), round=r, preset="llama-7b-8l",
                       seq=args.seq, batch=args.batch)
            rows.append(row)
            if "error" in row:
                print(f"[time] {row['variant']}: {row['error'][:300]}", flush=True)
            else:
                print(f"[time] {row['variant']:<5} {row['median_ms']:.1f} ms (p10-p90 "
                      f"{row['p10_ms']:.1f}-{row['p90_ms']:.1f}), peak "
                      f"{row['peak_gib']:.1f} GiB, captures {row['captures']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the results")
    ap.add_argument("--steps", type=int, default=6, help="steps of the correctness runs")
    ap.add_argument("--history", type=int, default=4, help="amax history length there")
    ap.add_argument("--check-seq", type=int, default=1024)
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--no-timing", action="store_true", help="the correctness part only")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per variant")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=1, help="eager, graph: this many turns")
    args = ap.parse_args()

    import torch

    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    try:
        out["check"] = check(args)
    except Exception as e:  # noqa: BLE001 -- recorded, then the timing still runs
        import traceback

        out["check"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    c = out["check"]
    if "error" in c:
        print(f"[check] {c['error'][:500]}", flush=True)
    else:
        g, e2 = c["graph_vs_eager"], c["eager2_vs_eager"]
        print(f"[check] captures {c['graph_captures']} after {c['graph_eager_steps']} eager "
              f"steps; positions {c['positions']} (expected {c['positions_expected']}); "
              f"roles never cast: {c['unstarted_roles']}", flush=True)
        for name, d in (("graph vs eager", g), ("eager2 vs eager", e2)):
            print(f"[check] {name}: losses equal {d['losses_equal']} (max abs "
                  f"{d['loss_max_abs']:.3g}); params equal {d['params_equal']} "
                  f"({d['params_differ']} differ, worst {d['params_worst']}); histories "
                  f"equal {d['histories_equal']} ({d['histories_differ']} differ, worst "
                  f"{d['histories_worst']}); positions equal {d['positions_equal']}",
                  flush=True)
    with open(args.out, "w") as f:  # the check, even if the timing fails
        json.dump(out, f, indent=1)
    if not args.no_timing:
        out["timing"] = timing(args)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
