"""Can the optimizer step hide behind the next step's forward? A first look before
building a deferred, overlapped AdamW for the finale (notes/finale.md, seventh
session). A working tool, not a results file.

    python notes/probe_optimizer_overlap.py OUT.json

On the finale's step (`llama-7b-8l`, every switch of `best`, seq 4096, batch 4), three
timings, each over 20 repetitions after 3 warm-ups, median and p10-p90:

1. the forward and its loss alone (autograd recording, as in training; the graph is
   dropped, nothing is backpropagated);
2. one `FusedAdamW` step alone (bf16 parameters, split masters, bf16 moments, gradients
   present, the clipping coefficient computed first, as in `train.make_step`);
3. both at once: the optimizer on a side stream, the forward on the main one, timed
   from a common start to when both are done.

`hidden` = (1 + 2 − 3) / 2: the share of the optimizer's time the forward absorbs (1.0:
all of it, 0.0: none). The H200 runs the GEMMs at its 700 W power limit, so a
concurrent memory-bound kernel may slow them: this measures what is left of the
overlap after that, not what an idle GPU would allow.
"""

import argparse
import json

import torch

from colossal_lab.measure import timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the rows")
    args = ap.parse_args()
    from colossal_lab.benchmarks import composed
    from colossal_lab.benchmarks.steps import prepare
    from colossal_lab.training import data

    setup = {s.name: s for s in composed.SETUPS}["ours-bf16"]
    device, cfg, model, loss_fn, _, opt = prepare(setup, "llama-7b-8l", 4)
    ids, labels = next(data.random_batches(cfg.vocab_size, 4, 4096, seed=0, device=device))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    side = torch.cuda.Stream(device)

    def forward():
        loss_fn(model, ids, labels)  # the autograd graph is dropped here

    def optimizer_step():
        opt.clip_grad_norm_(1.0)
        opt.step()

    def both():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            optimizer_step()
        forward()
        torch.cuda.current_stream(device).wait_stream(side)

    rows = {}
    for name, fn in (("forward", forward), ("optimizer", optimizer_step), ("both", both)):
        r = timing.time_iterations(lambda i, fn=fn: fn(), warmup=3, iters=20, device=device)
        rows[name] = {"ms": round(r.median_ms, 3), "p10": round(r.p10_ms, 3),
                      "p90": round(r.p90_ms, 3)}
        print(f"{name:<10} {r.median_ms:8.2f} ms (p10-p90 {r.p10_ms:.2f}-{r.p90_ms:.2f})",
              flush=True)
    f, o, b = (rows[k]["ms"] for k in ("forward", "optimizer", "both"))
    rows["hidden"] = round((f + o - b) / o, 3)
    print(f"hidden: {rows['hidden']:.0%} of the optimizer's {o:.2f} ms", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"setup": setup.name, "preset": "llama-7b-8l", "batch": 4,
                   "seq_len": 4096, **rows}, fh, indent=1)


if __name__ == "__main__":
    main()
