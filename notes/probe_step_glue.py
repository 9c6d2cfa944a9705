"""What is left outside the GEMMs of the finale's bf16 step, and how much of it a kernel
change could win. A working tool, not a results file (notes/finale.md).

    python notes/probe_step_glue.py OUT.json

On llama-7b-8l's parameter shapes (bf16 params, fp32 masters, as ours-bf16 trains):
1. `kernels.adamw` at other BLOCK / num_warps than the defaults (the update alone);
2. the clipping norm pass: `clip_coefficient` (torch._foreach_norm, fp32 result) against
   the two-stage Triton sum of squares (`adamw.sum_of_squares`, which replaced it;
   the first run, notes/probes/step_glue_2185b9b.json, timed the same kernel written
   here, also at 32768 elements a program: 1.79 ms);
3. the residual add after the down projection: `h + x @ W.T` against `torch.addmm`;
4. the embedding's backward: torch's against index_add_ into an fp32 buffer.
Each timed with `timing.time_iterations` (20 steps after 3 warm-ups), p10-p90 kept.
"""

import json
import sys

import torch

from colossal_lab.benchmarks.optimizer import HP, param_shapes
from colossal_lab.kernels import adamw
from colossal_lab.measure import timing


def t_of(fn, iters=20):
    t = timing.time_iterations(lambda i: fn(), warmup=3, iters=iters, device="cuda")
    return {"ms": t.median_ms, "p10": t.p10_ms, "p90": t.p90_ms}


def main() -> None:
    out = sys.argv[1]
    dev = torch.device("cuda")
    shapes = param_shapes("llama-7b-8l")
    n = sum(s.numel() for s in shapes)
    rows = []
    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02)
              for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grads = [p.grad for p in params]

    # 1. the update alone at other block shapes
    default = (adamw.BLOCK, adamw.NUM_WARPS)
    opt = adamw.FusedAdamW(params, **HP)
    for block, warps in [(2048, 8), (1024, 4), (4096, 8), (4096, 16), (8192, 16),
                         (2048, 4)]:
        adamw.BLOCK, adamw.NUM_WARPS = block, warps
        r = t_of(opt.step)
        r.update(probe="adamw_update", block=block, num_warps=warps,
                 gbps=28 * n / r["ms"] / 1e6)
        rows.append(r)
        print(r, flush=True)
    adamw.BLOCK, adamw.NUM_WARPS = default

    # 2. the norm pass
    ref = adamw.clip_coefficient(grads, 1.0)[0]
    for name, fn in [("foreach_norm_fp32", lambda: adamw.clip_coefficient(grads, 1.0)),
                     ("foreach_norm_native", lambda: torch.linalg.vector_norm(
                         torch.stack(torch._foreach_norm(grads, 2.0)).float())),
                     ("triton_sumsq_8192", lambda: adamw.sum_of_squares(grads).sqrt())]:
        r = t_of(fn)
        val = fn()
        val = val[0] if isinstance(val, tuple) else val
        r.update(probe="clip_norm", variant=name, gbps=2 * n / r["ms"] / 1e6,
                 rel_err=float((val - ref).abs() / ref))
        rows.append(r)
        print(r, flush=True)
    opt = params = grads = None  # free ~30 GB before the next probe
    torch.cuda.empty_cache()

    # 3. residual add after the down projection (B*S=16384, i=11008, d=4096)
    x = torch.randn(16384, 11008, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, device=dev, dtype=torch.bfloat16) * 0.01
    h = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    for name, fn in [("linear_then_add", lambda: h + torch.nn.functional.linear(x, w)),
                     ("addmm", lambda: torch.addmm(h, x, w.t())),
                     ("linear_only", lambda: torch.nn.functional.linear(x, w))]:
        r = t_of(fn)
        r.update(probe="residual_add", variant=name)
        rows.append(r)
        print(r, flush=True)
    x = w = h = None

    # 4. embedding backward (V=32000, d=4096, 16384 tokens)
    ids = torch.randint(0, 32000, (16384,), device=dev)
    dy = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)

    def torch_bwd():
        return torch.ops.aten.embedding_dense_backward(dy, ids, 32000, -1, False)

    def index_add_bwd():
        acc = torch.zeros(32000, 4096, device=dev, dtype=torch.float32)
        acc.index_add_(0, ids, dy.float())
        return acc.to(torch.bfloat16)

    for name, fn in [("torch", torch_bwd), ("index_add_fp32", index_add_bwd)]:
        r = t_of(fn)
        r.update(probe="embedding_backward", variant=name)
        rows.append(r)
        print(r, flush=True)

    json.dump({"device": torch.cuda.get_device_name(), "params": n, "rows": rows},
              open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
