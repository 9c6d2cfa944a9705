"""The finale's waterfall: from every switch off to every switch on, one switch at a time."""

from __future__ import annotations

from colossal_lab.benchmarks.steps import Setup, chapter_benchmark
from colossal_lab.config import SWITCH_SETS, Switches

NAME = "waterfall"


def _steps() -> list[tuple[str, str, Switches]]:
    """(name, label, switches) of each bar, each one switch more than the one before."""
    sw = Switches.naive("fp32")
    bars = [("naive-fp32", "every switch off, fp32", sw)]
    for name, label, change in (
            ("+bf16", "+ bf16 autocast", dict(precision="bf16")),
            ("+attention", "+ flash attention", dict(enable_flash_attention=True)),
            ("+norm", "+ Triton RMSNorm", dict(enable_fused_normalization="triton")),
            ("+projections", "+ fused projections, Triton SwiGLU",
             dict(enable_fused_projections=True)),
            ("+rope", "+ Triton RoPE", dict(enable_fused_rope=True)),
            ("+loss", "+ fused head + cross-entropy", dict(enable_fused_cross_entropy=True)),
            ("+embedding", "+ our embedding backward", dict(enable_fused_embedding=True)),
            ("+bf16-params", "+ bf16 parameters, fp32 masters", dict(precision="bf16-pure")),
            ("+adamw", "+ one-pass AdamW (= best bf16)", dict(enable_fused_optimizer=True)),
            ("+bf16-moments", "+ AdamW moments in bf16 (a change of numerics)",
             dict(extra={"adamw_moments": "bf16"}))):
        sw = sw.replace(**change)
        bars.append((name, label, sw))
    if bars[-2][2] != SWITCH_SETS["best"] or sw != SWITCH_SETS["best-bf16-moments"]:
        raise AssertionError("the waterfall's +adamw bar must be SWITCH_SETS['best'], "
                             "its +bf16-moments bar SWITCH_SETS['best-bf16-moments']")
    bars.append(("fp8", "every switch, fp8 linears (delayed)", SWITCH_SETS["best-fp8"]))
    return bars


SETUPS = tuple(
    Setup(name, label, switches=sw, **({"micro_batch": 1} if not sw.enable_flash_attention
                                       else {}),
          **({"warmup": 1} if sw.precision == "fp32" else {}))
    for name, label, sw in _steps()) + (
    Setup("best+compile", "best bf16 + torch.compile of each layer (outside the chain: "
          "compare with +adamw)", switches=SWITCH_SETS["best"].replace(
              enable_compile="layers")),
    Setup("hf-sdpa", "HF transformers: bf16, SDPA", "hf"),
    Setup("hf-compile", "HF transformers: bf16, SDPA, torch.compile", "hf", compile=True),
    Setup("hf-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf", liger=True),
    Setup("hf-torchao-fp8", "HF transformers: SDPA, torchao float8 (tensorwise), "
          "torch.compile", "hf", compile=True, torchao_fp8=True),
)
"""One training step of `llama-7b-8l` (seq 4096, batch 4, random tokens, AdamW with
clipping), each bar in its own process, all in one run, next to Hugging Face's model
(SDPA; SDPA + torch.compile; SDPA + Liger's kernels; SDPA + torchao's float8 linears +
torch.compile, the peer of the fp8 bar). Each bar adds one switch to the bar before it,
so its delta is that switch's, in this order:

    naive-fp32      every switch off, fp32 (PyTorch's default, no TF32)
    +bf16           bf16 autocast (switch 6)
    +attention      flash attention, the best backend here (switch 1)
    +norm           our Triton RMSNorm (switch 2)
    +projections    fused QKV and gate/up with our SwiGLU (switch 3)
    +rope           our RoPE kernel
    +loss           our fused head + cross-entropy
    +bf16-params    bf16 parameters, fp32 masters in the optimizer (no weight casts)
    +embedding      our embedding backward
    +adamw          our one-pass AdamW with the clipping folded in: `SWITCH_SETS["best"]`
    +bf16-moments   its moments in bf16, stochastically rounded (a change of numerics):
                    `SWITCH_SETS["best-bf16-moments"]`
    fp8             the same with fp8 linears, delayed scaling: `SWITCH_SETS["best-fp8"]`

and one bar outside the chain, in no switch set:

    best+compile    `SWITCH_SETS["best"]` with each decoder layer torch.compiled
                    (`enable_compile="layers"`); compared with +adamw, and its
                    `first_step_s` with theirs: what compiling buys and costs

The first two bars materialise the attention scores and run in micro-batches of one
sequence (the whole batch's scores would not fit), as chapter 00's naive rows do. Every
row also carries its memory: the peak and the activations of one step
(`colossal_lab.training.memory`), what each switch costs or saves.

    python -m colossal_lab bench waterfall            # -> results/<gpu>/waterfall.json
    python -m colossal_lab bench waterfall --quick    # tiny model on the CPU, not saved
"""
SETUP_NAMES = tuple(s.name for s in SETUPS)
OUTSIDE_CHAIN = {"best+compile": "+bf16-moments"}
"""Bars outside the one-switch-per-bar chain, and the bar each is compared with
(`plot.chain_bases`, `plot.waterfall(outside=...)`)."""

run, main = chapter_benchmark(NAME, SETUPS)

if __name__ == "__main__":
    main()
