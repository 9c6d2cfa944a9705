"""The step's floor: its GEMMs, attention and optimizer each at its own ceiling, beside the steps.

A training step cannot take less than the time of its unavoidable work, each part run
at the best rate this card sustains for it:

    gemm        every GEMM of the step (forward, input and weight gradients, the head),
                replayed back to back as one CUDA graph, `--replays` times: the rate the
                tensor cores sustain at the card's power limit, not a short benchmark's
                burst (bf16; for fp8 the linears' GEMMs through `torch._scaled_mm`,
                e4m3 x e4m3 forward and e5m2 x e4m3 backward, the head in bf16)
    attention   the step's attention forward and backward with the backend the best
                switch set picks, every layer
    optimizer   the bytes AdamW must move (`adamw_bytes`) at the copy rate measured on
                this card (`hardware.measure_copy_gbps`, as `bench optimizer` uses)

The steps themselves (ours-bf16, ours-fp8, HF + Liger, HF + torchao fp8) are timed in
the same run (`steps.run_setups`, each in its own process); what a step spends beyond
the sum of the parts is everything else: casts, norms, element-wise kernels, launch gaps.
Every row carries the SM clock and the power drawn while it was measured.

    python -m colossal_lab bench step_floor            # -> results/<gpu>/step_floor.json
    python -m colossal_lab bench step_floor --quick    # tiny model on the CPU, not saved
"""

from __future__ import annotations

import time

import torch

from colossal_lab.benchmarks.harness import Benchmark, flag, opt
from colossal_lab.benchmarks.steps import Setup, run_setups
from colossal_lab.config import SWITCH_SETS, ModelConfig, preset
from colossal_lab.measure import hardware, mfu, telemetry, timing
from colossal_lab.ops import attention as attention_op
from colossal_lab.ops.cross_entropy import default_chunk_tokens
from colossal_lab.precision import policy

NAME = "step_floor"
PRECISIONS = {"bf16": SWITCH_SETS["best"], "fp8": SWITCH_SETS["best-fp8"]}
"""The floor of each precision, and the switch set whose step it bounds."""
STEP_SETUPS = (
    Setup("hf-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf", liger=True),
    Setup("ours-bf16", "ours: every switch, bf16 params, exact AdamW",
          switches=SWITCH_SETS["best"]),
    Setup("hf-torchao-fp8", "HF transformers: SDPA, torchao float8 (tensorwise), "
          "torch.compile", "hf", compile=True, torchao_fp8=True),
    Setup("ours-fp8", "ours: every switch, fp8 linears (delayed scaling), bf16 params + "
          "fp32 masters, exact AdamW", switches=SWITCH_SETS["best-fp8"]),
)


def _fp8(label: str) -> bool:
    """Whether the floor `label` (a key of `PRECISIONS`) runs its linears in fp8."""
    return policy(PRECISIONS[label].precision).fp8


def step_gemms(cfg: ModelConfig, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of every GEMM of one step with fused q/k/v and gate/up
    projections, in the order the step runs them: each layer's forward x·Wᵀ, the head
    in the chunks of the fused loss, then each layer's backward dy·W and dyᵀ·x."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    linears = [("qkv", d, d + 2 * kv), ("o", d, d), ("gate_up", d, 2 * f), ("down", f, d)]
    fwd, bwd = [], []
    for _ in range(cfg.num_hidden_layers):
        for name, k, n in linears:
            fwd.append((f"{name}.fwd", tokens, n, k))
            bwd[:0] = [(f"{name}.dx", tokens, k, n), (f"{name}.dw", n, k, tokens)]
    chunk = default_chunk_tokens(tokens, v, 2)
    head = []
    for start in range(0, tokens, chunk):
        c = min(chunk, tokens - start)
        head += [("head.fwd", c, v, d), ("head.dx", c, d, v), ("head.dw", v, d, c)]
    return fwd + head + bwd


def _gemm_call(name: str, m: int, n: int, k: int, precision: str, dev):
    """A closure running one GEMM as the step runs it, on operands made once."""
    bf16 = torch.bfloat16
    if not _fp8(precision) or name.startswith("head") or dev.type != "cuda":
        a = torch.randn(m, k, device=dev, dtype=bf16)
        b = torch.randn(n, k, device=dev, dtype=bf16).t()  # column-major, as W.T
        out = torch.empty(m, n, device=dev, dtype=bf16)
        return lambda: torch.mm(a, b, out=out)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    first = e4 if name.endswith(".fwd") else e5  # gradients in e5m2
    a = torch.randn(m, k, device=dev).to(first)
    b = torch.randn(n, k, device=dev).to(e4).t()  # _scaled_mm: B column-major
    one = torch.ones((), device=dev)
    fast = name.endswith(".fwd")  # fast accumulation in the forward only
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=bf16,
                                    use_fast_accum=fast)


def gemm_floor(cfg: ModelConfig, tokens: int, precision: str, replays: int,
               dev) -> dict:
    """The step's GEMMs back to back, replayed `replays` times as one CUDA graph (on a
    CPU, a loop): the median replay, its p10-p90, the FLOP rate and the clock and
    power while it ran."""
    gemms = step_gemms(cfg, tokens)
    calls = {g: _gemm_call(*g, precision, dev) for g in set(gemms)}

    def run_all():
        for g in gemms:
            calls[g]()

    flops = sum(2 * m * n * k for _, m, n, k in gemms)
    run_all()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        step = graph.replay
    else:
        step = run_all
    with telemetry.GpuSampler(dev) as gpu:
        time.sleep(0.3 if dev.type == "cuda" else 0)  # samples of their own before
        since = telemetry.now()
        t = timing.time_iterations(lambda i: step(), warmup=3, iters=replays, device=dev)
    return {"part": "gemm", "ms": t.median_ms, "ms_p10": t.p10_ms, "ms_p90": t.p90_ms,
            "gemms": len(gemms), "flops": flops, "tflops": timing.tflops(flops, t.median_ms),
            "how": "cuda_graph" if dev.type == "cuda" else "perf_counter",
            **gpu.fields(since)}


def attention_floor(cfg: ModelConfig, batch: int, seq_len: int, switches, dev) -> dict:
    """One layer's attention forward and backward with the backend `switches` picks,
    timed alone (CUDA-graph replay), times the layers."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hd = cfg.hidden_size // cfg.num_attention_heads
    backend = attention_op.resolve_backend(switches.enable_flash_attention, dev,
                                           dtype=dtype, head_dim=hd)
    shape = (batch, cfg.num_attention_heads, seq_len, hd)
    kv = (batch, cfg.num_key_value_heads, seq_len, hd)
    q = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(kv, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(kv, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=dev, dtype=dtype)

    def fwd_bwd():
        out = attention_op.attention(q, k, v, causal=True, backend=backend)
        out.backward(dy)

    with telemetry.GpuSampler(dev) as gpu:
        since = telemetry.now()
        t, how = timing.time_kernels(fwd_bwd, device=dev)
    layers = cfg.num_hidden_layers
    return {"part": "attention", "ms": t.median_ms * layers, "ms_p10": t.p10_ms * layers,
            "ms_p90": t.p90_ms * layers, "backend": backend, "how": how,
            "flops": mfu.attention_flops_per_token(cfg, seq_len) * batch * seq_len,
            **gpu.fields(since)}


def adamw_bytes(switches) -> int:
    """Bytes our one-pass AdamW moves per parameter for `switches`: read and write the
    parameter and its master (a bf16 parameter's master is its int16 low half beside
    it), read and write both moments, read the gradient in the update and in the norm
    pass (`kernels.adamw`'s table: 26 + 2 for bf16 parameters with fp32 moments)."""
    param = policy(switches.precision).param_dtype.itemsize
    moments = 2 if (switches.extra or {}).get("adamw_moments") == "bf16" else 4
    master = 2 if param == 2 else 0  # the low half; fp32 parameters are their master
    return 2 * (param + master) + 2 * 2 * moments + 2 * param


def optimizer_floor(cfg: ModelConfig, switches, dev) -> dict:
    """AdamW's bytes (`adamw_bytes` x parameters) at the copy rate of this card: the
    ceiling `bench optimizer` judges AdamW against (`hardware.measure_copy_gbps`, a
    2 GiB fp32 copy, read plus write counted). A byte copy through a CUDA graph runs
    a third slower on Hopper and would put the floor above a good AdamW kernel."""
    copy_gbps = hardware.measure_copy_gbps(device=dev)
    nbytes = adamw_bytes(switches) * mfu.count_params(cfg)
    return {"part": "optimizer", "ms": nbytes / copy_gbps / 1e6, "bytes": nbytes,
            "bytes_per_param": adamw_bytes(switches), "copy_gbps": copy_gbps,
            "how": "hardware.measure_copy_gbps"}


def run(quick: bool = False, preset_name: str = "llama-7b-8l", seq_len: int = 4096,
        batch: int = 4, replays: int = 20, with_steps: bool = True) -> list[dict]:
    """The floor parts of each precision (rows of kind "floor"), then the steps (kind
    "step"): what each step spends beyond its floor is `step_ms` - the parts' sum."""
    if quick:
        preset_name, seq_len, batch, replays = "tiny", 64, 2, 3
    cfg = preset(preset_name)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for precision, switches in PRECISIONS.items():
        if _fp8(precision) and dev.type != "cuda":
            continue  # fp8 GEMMs need fp8 tensor cores
        print(f"[{NAME}] {precision} floor ...", flush=True)
        common = {"kind": "floor", "precision": precision, "preset": preset_name,
                  "seq_len": seq_len, "batch": batch}
        for part in (gemm_floor(cfg, batch * seq_len, precision, replays, dev),
                     attention_floor(cfg, batch, seq_len, switches, dev),
                     optimizer_floor(cfg, switches, dev)):
            rows.append({**common, **part})
            print(f"  {part['part']:<10} {part['ms']:8.1f} ms", flush=True)
    if with_steps:
        setups = [s for s in STEP_SETUPS if not quick or s.impl == "ours"]
        if quick:
            setups = [s for s in setups if not s.switches.precision.startswith("fp8")]
        steps = run_setups(setups, preset_name=preset_name, seq_len=seq_len, batch=batch,
                           isolate=not quick, tag=NAME)
        rows += [{**r, "kind": "step"} for r in steps]
    return rows


def floor_ms(rows: list[dict], precision: str) -> float:
    """The floor of `precision`: the sum of its parts."""
    return sum(r["ms"] for r in rows if r.get("kind") == "floor"
               and r["precision"] == precision)


def summary(rows: list[dict]) -> str:
    lines = []
    for precision in PRECISIONS:
        parts = [r for r in rows if r.get("kind") == "floor" and r["precision"] == precision]
        if parts:
            lines.append(f"{precision} floor {floor_ms(rows, precision):.1f} ms = " + " + ".join(
                f"{r['part']} {r['ms']:.1f}" for r in parts))
    for r in rows:
        if r.get("kind") == "step" and "error" not in r:
            floor = floor_ms(rows, "fp8" if "fp8" in r["setup"] else "bf16")
            if floor:
                lines.append(f"{r['setup']:<16} {r['step_ms']:8.1f} ms, "
                             f"{r['step_ms'] - floor:+.1f} ms over its floor "
                             f"({r['step_ms'] / floor:.2f}x)")
    return "\n".join(lines)


BENCH = Benchmark(
    NAME, __doc__, quick_help="tiny model on the CPU, bf16 only, not saved",
    options=[flag("preset"), flag("seq_len"), flag("batch"),
             opt("--replays", type=int, default=20,
                 help="timed replays of the step's GEMMs (default 20)"),
             opt("--no-steps", action="store_true", help="the floor only")],
    run=lambda a: run(a.quick, a.preset, a.seq_len, a.batch, a.replays, not a.no_steps),
    config=lambda a: {"preset": a.preset, "seq_len": a.seq_len, "batch": a.batch,
                      "replays": a.replays,
                      "precisions": {p: repr(s) for p, s in PRECISIONS.items()}},
    summary=summary)
main = BENCH.main


if __name__ == "__main__":
    main()
