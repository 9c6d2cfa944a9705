"""The finale's comparison: every single-GPU switch composed, against HF + Liger."""

from __future__ import annotations

from colossal_lab.benchmarks.steps import Setup, chapter_bench, run_chapter
from colossal_lab.config import SWITCH_SETS

ALL_BF16 = SWITCH_SETS["best"].replace(precision="bf16", enable_fused_optimizer=False,
                                       extra={})
"""Every kernel switch, including the finale's RoPE, fused head + loss and embedding
backward, in bf16 autocast."""
S123 = ALL_BF16.replace(enable_fused_rope=False, enable_fused_cross_entropy=False,
                        enable_fused_embedding=False)
"""Switches 1-3 in bf16: what the chapters before the finale composed."""

SETUPS = (
    Setup("hf-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf", liger=True),
    Setup("ours-bf16-s123", "ours: switches 1-3, bf16 autocast", switches=S123),
    Setup("ours-bf16-autocast", "ours: + RoPE, fused loss, embedding backward; bf16 "
          "autocast",
          switches=ALL_BF16),
    Setup("ours-bf16", "ours: every switch, bf16 params + fp32 masters, our AdamW "
          "(fp32 moments: the exact optimizer)", switches=SWITCH_SETS["best"]),
    Setup("ours-bf16-compile", "ours: every switch, bf16 params, each layer "
          "torch.compiled", switches=SWITCH_SETS["best"].replace(enable_compile="layers")),
    Setup("ours-bf16-graph", "ours: every switch, bf16 params, the step replayed as a "
          "CUDA graph", switches=SWITCH_SETS["best"].replace(enable_compile="graph")),
    Setup("ours-bf16-defer", "ours: every switch, bf16 params, AdamW's update overlapped "
          "with the next forward", switches=SWITCH_SETS["best"].replace(
              extra={**SWITCH_SETS["best"].extra, "adamw_defer": True})),
    Setup("best-bf16-moments", "ours: every switch, bf16 params + fp32 masters, our "
          "AdamW with bf16 moments", switches=SWITCH_SETS["best-bf16-moments"]),
    Setup("ours-fp8-eager", "ours: every switch, fp8 linears (delayed scaling), bf16 "
          "params + fp32 masters, exact AdamW, launched eagerly",
          switches=SWITCH_SETS["best-fp8"]),
    Setup("ours-fp8", "ours: every switch, fp8 linears (delayed scaling), bf16 params + "
          "fp32 masters, exact AdamW, the step replayed as a CUDA graph",
          switches=SWITCH_SETS["best-fp8-graph"]),
    Setup("ours-fp8-fp32-params", "ours: every switch, fp8 linears (delayed scaling) "
          "over fp32 parameters", switches=SWITCH_SETS["best-fp8-fp32-params"]),
    Setup("hf-torchao-fp8", "HF transformers: SDPA, torchao float8 (tensorwise), "
          "torch.compile", "hf", compile=True, torchao_fp8=True),
    Setup("hf-torchao-fp8-rowwise", "HF transformers: SDPA, torchao float8 (rowwise), "
          "torch.compile", "hf", compile=True, torchao_fp8=True, torchao_recipe="rowwise"),
    # Full LLaMA-7B, batch 6 in three micro-batches of 2: with the exact optimizer the
    # step starts from 75 GiB (bf16 weights and their low halves, fp32 moments); from
    # the second micro-batch on the 12.5 GiB of bf16 gradients are alive too, and each
    # sequence keeps 18.7 GiB of activations, so a micro-batch of 2 peaks near 125 GiB,
    # inside the 135 GiB an H200's allocator can hand out, with no layer recomputed
    # (`auto_ratio` checks it before the timed steps; a micro-batch of 3 would need
    # six layers recomputed). The optimizer's 28 bytes a parameter (~48 ms at the copy
    # rate) do not grow with the batch: ~8% of a step of one micro-batch of 2, under 3%
    # over three. Real 7B runs accumulate far more (LLaMA's global batch is 4M tokens),
    # so its share only shrinks from here.
    Setup("ours-7b-bf16", "ours: full LLaMA-7B, every switch, bf16 params, batch 6 in "
          "three micro-batches of 2", switches=SWITCH_SETS["best"], preset="llama-7b",
          batch=6, micro_batch=2, auto_ratio=True),
    Setup("ours-7b-bf16-defer", "ours: full LLaMA-7B, every switch, bf16 params, AdamW's "
          "update overlapped with the next forward, batch 6 in three micro-batches of 2",
          switches=SWITCH_SETS["best"].replace(
              extra={**SWITCH_SETS["best"].extra, "adamw_defer": True}),
          preset="llama-7b", batch=6, micro_batch=2, auto_ratio=True),
)
SETUP_NAMES = tuple(s.name for s in SETUPS)


def run(quick: bool = False) -> list[dict]:
    """Every setup side by side (`steps.run_chapter`). `quick`: the tiny model on this
    machine, without the setups `steps.runs_quick` leaves to the GPU run (Liger's
    kernels need a GPU; compiled setups take minutes to compile).

    One training step of `llama-7b-8l` (seq 4096, batch 4, random tokens, AdamW), each
    setup in its own process, all in one run:

        hf-liger            Hugging Face LlamaForCausalLM, SDPA, Liger's kernels, bf16 autocast
        ours-bf16-s123      switches 1-3 (cuDNN attention, Triton norm, fused projections +
                            our SwiGLU), bf16 autocast: the best composition before the finale
        ours-bf16-autocast  + our RoPE and fused head + loss, bf16 autocast (fp32 weights,
                            cast every step)
        ours-bf16           the same with bf16 parameters and fp32 master weights in our
                            one-pass AdamW: no per-step weight casts, the clipping folded
                            into the update, fp32 moments: the update torch's AdamW
                            computes (the best bf16 composition, `SWITCH_SETS["best"]`)
        ours-bf16-compile   ours-bf16 with each decoder layer torch.compiled around our
                            kernels (`enable_compile="layers"`; not in "best" until measured);
                            its row's `first_step_s` is the compile time
        ours-bf16-graph     ours-bf16 with the whole step replayed as one CUDA graph
                            (`enable_compile="graph"`; "best" launches eagerly: with
                            bf16 GEMMs the host stays ahead of the GPU)
        ours-bf16-defer     ours-bf16 with each step's AdamW update run during the next
                            step's forward, on a side stream (`extra["adamw_defer"]`; not
                            in "best" until measured)
        best-bf16-moments   ours-bf16 with AdamW's moments in bf16, stochastically
                            rounded: 8 bytes a parameter less, a change of numerics
                            (`composed_curves` checks what it costs)
        ours-fp8-eager      ours-bf16 with fp8 linears, delayed scaling: the same bf16
                            parameters, fp32 masters and exact AdamW, each kernel launched
                            from Python (`SWITCH_SETS["best-fp8"]`)
        ours-fp8            the same step replayed as one CUDA graph, the fp8 headline (the
                            amax rings advance on the device; `SWITCH_SETS["best-fp8-graph"]`):
                            the shorter fp8 step leaves launch gaps a graph can close
        ours-fp8-fp32-params  ours-fp8-eager over fp32 parameters: each fp8 cast reads a 4-byte
                            weight, AdamW moves 32 bytes a parameter instead of 28
        hf-torchao-fp8      Hugging Face's model, SDPA, torchao's float8 linears (tensorwise
                            dynamic scaling), torch.compile: the peer of ours-fp8
        hf-torchao-fp8-rowwise  the same with torchao's rowwise recipe (a scale a row)
        ours-7b-bf16        full LLaMA-7B (32 layers), batch 6 in three micro-batches of 2
                            (gradient accumulation), as ours-bf16, with the fewest
                            checkpointed layers that the memory model says fit a
                            micro-batch (`Setup.auto_ratio`: three probes, then verified
                            by the run)
        ours-7b-bf16-defer  the same with AdamW's update run during the next forward (at
                            7B its 28 bytes a parameter are under 3% of the step)

        python -m colossal_lab bench composed                      # results/<gpu>/composed.json
        python -m colossal_lab bench composed --setups hf-liger ours-bf16
        python -m colossal_lab bench composed --pairs 3            # the headline pair
                                                                   # timed 3 times in turns
        python -m colossal_lab bench composed --quick              # tiny model, no Liger,
                                                                   # nothing compiled
    """
    return run_chapter("composed", SETUPS, quick)


PAIRED = ("hf-liger", "ours-bf16")
"""The headline's two setups: `--pairs N` times them N times in turns."""


def pair_ratios(rows: list[dict]) -> list[float]:
    """Per pair of `--pairs` (rows with a `pair`), hf-liger's step time over ours-bf16's:
    how many times faster ours ran in that pair, in pair order."""
    by: dict[int, dict] = {}
    for r in rows:
        if r.get("pair") is not None and "error" not in r:
            by.setdefault(r["pair"], {})[r["setup"]] = r["step_ms"]
    return [p[PAIRED[0]] / p[PAIRED[1]] for _, p in sorted(by.items()) if len(p) == 2]


BENCH = chapter_bench("composed", SETUPS, paired=PAIRED)
main = BENCH.main


if __name__ == "__main__":
    main()
