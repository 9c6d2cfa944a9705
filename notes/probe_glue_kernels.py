"""Micro timings of the finale's glue kernels against what they replaced, on the
finale's shapes (LLaMA-7B, B 4, S 4096, bf16). A working tool, not a results file
(notes/finale.md, sixth session).

    python notes/probe_glue_kernels.py OUT.json

1. the embedding's backward: torch's `embedding_dense_backward` against
   `kernels.embedding.embedding_backward`, on uniform ids and on skewed ones (half the
   tokens on 10 ids);
2. the fused loss's backward scaling: eager `(g * s).to(dtype)` against
   `kernels.cross_entropy.scale_cast`, for the head's fp32 dW and the bf16 dh;
3. the qkv gradient of `RotaryQKVFunction`: the RoPE backward launch then a `copy_` of
   the transposed dv, against one launch that also copies dv (`COPY_V`).
Each timed with `timing.time_iterations` (30 steps after 5 warm-ups), p10-p90 kept.
"""

import argparse
import json

import torch

from colossal_lab.measure import timing


def t_of(fn, iters=30):
    r = timing.time_iterations(lambda i: fn(), warmup=5, iters=iters, device="cuda")
    return {"ms": round(r.median_ms, 4), "p10": round(r.p10_ms, 4), "p90": round(r.p90_ms, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the rows")
    args = ap.parse_args()
    from colossal_lab.kernels import cross_entropy as ce
    from colossal_lab.kernels import embedding as emb
    from colossal_lab.kernels import rope as kr

    dev = "cuda"
    rows = []
    N, V, d = 16384, 32000, 4096
    ids = torch.randint(0, V, (4, 4096), device=dev)
    dy = torch.randn(4, 4096, d, device=dev, dtype=torch.bfloat16)
    skew = ids.clone()
    skew.view(-1)[: N // 2] = torch.randint(0, 10, (N // 2,), device=dev)
    for name, x in (("embedding_backward", ids), ("embedding_backward_skewed", skew)):
        def theirs(x=x):
            return torch.ops.aten.embedding_dense_backward(dy, x, V, -1, False)

        def ours(x=x):
            return emb.embedding_backward(dy, x, V, torch.bfloat16)

        err = (theirs().float() - ours().float()).abs().max().item()
        rows.append({"probe": name, "max_err": err, "torch": t_of(theirs), "ours": t_of(ours)})
    gw = torch.randn(V, d, device=dev)
    gh = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
    g = torch.tensor(1.0, device=dev)
    rows.append({"probe": "scale_cast_dW", "eager": t_of(lambda: (gw * g).to(torch.bfloat16)),
                 "ours": t_of(lambda: ce.scale_cast(gw, g, torch.bfloat16))})
    rows.append({"probe": "scale_cast_dh",
                 "eager": t_of(lambda: (gh * g.to(gh.dtype)).to(gh.dtype)),
                 "ours": t_of(lambda: ce.scale_cast(gh, g, gh.dtype))})
    B, S, H, D = 4, 4096, 32, 128
    cos = torch.randn(S, D // 2, device=dev)
    sin = torch.randn(S, D // 2, device=dev)
    dq, dk, dv = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(3))  # as cuDNN hands them back
    out = torch.empty(B, S, 3 * H * D, device=dev, dtype=torch.bfloat16)
    qo, ko, vo = kr.split_heads(out, H, H)

    def rope_then_copy():
        kr._launch(dq, dk, cos, sin, True, q_out=qo, k_out=ko)
        vo.copy_(dv)

    def one_launch():
        kr._launch(dq, dk, cos, sin, True, q_out=qo, k_out=ko, v=dv, v_out=vo)

    rows.append({"probe": "rope_qkv_backward", "rope_then_copy": t_of(rope_then_copy),
                 "one_launch": t_of(one_launch)})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
