"""Chapter 00's baseline: our model with every switch off against what a user would pick.

One training step (AdamW, random tokens) of the same model shape, timed side by side in
one run: our LLaMA naive in fp32 and in bf16 (eager attention, eager norm); our LLaMA
with PyTorch's SDPA and an eager RMSNorm, the same kernels as Hugging Face's model (the
like-for-like check that our model is no slower), and with `F.rms_norm`; Hugging Face
`LlamaForCausalLM` with SDPA, + `torch.compile`, and with Liger's kernels.

    python -m colossal_lab bench baseline            # llama-7b-8l, seq 4096, batch 4
    python -m colossal_lab bench baseline --quick    # tiny model, CPU smoke test
"""

from __future__ import annotations

from colossal_lab.benchmarks.harness import Benchmark, flag, opt
from colossal_lab.benchmarks.steps import Setup, run_setups, step_config
from colossal_lab.config import Switches

SETUPS = (
    Setup("ours-fp32-naive", "ours: fp32, naive attention + norm", "ours",
          Switches.naive("fp32"), micro_batch=1, warmup=1),
    Setup("ours-bf16-naive", "ours: bf16, naive attention + norm", "ours",
          Switches.naive("bf16"), micro_batch=1),
    Setup("ours-bf16-sdpa-eager-norm", "ours: bf16, SDPA + eager RMSNorm (as HF)", "ours",
          Switches(enable_flash_attention="sdpa", enable_fused_normalization=False)),
    Setup("ours-bf16-sdpa", "ours: bf16, SDPA + F.rms_norm", "ours",
          Switches(enable_flash_attention="sdpa", enable_fused_normalization="torch")),
    Setup("hf-bf16-sdpa", "HF transformers: bf16, SDPA", "hf"),
    Setup("hf-bf16-sdpa-compile", "HF transformers: bf16, SDPA, torch.compile", "hf",
          compile=True),
    Setup("hf-bf16-sdpa-liger", "HF transformers: bf16, SDPA, Liger kernels", "hf",
          liger=True),
)
SETUP_NAMES = tuple(s.name for s in SETUPS)
QUICK = ("ours-fp32-naive", "ours-bf16-naive", "ours-bf16-sdpa", "hf-bf16-sdpa")


def run(quick: bool = False, *, preset_name: str = "llama-7b-8l", seq_len: int = 4096,
        batch: int = 4, setups=None) -> list[dict]:
    """Every setup, side by side. `quick`: the tiny model at seq 64, in this process."""
    if quick:
        preset_name, seq_len, batch = "tiny", 64, 2
        setups = setups or QUICK
    chosen = [s for s in SETUPS if s.name in (setups or SETUP_NAMES)]
    return run_setups(chosen, preset_name=preset_name, seq_len=seq_len, batch=batch,
                      isolate=not quick, tag="baseline")


config_of = step_config


STEP_FLAGS = [flag("preset"), flag("seq_len"), flag("batch")]
"""The step's shape on the command line (also `profile_breakdown`'s)."""

BENCH = Benchmark(
    "baseline", __doc__, quick_help="tiny model at seq 64, in this process, not saved",
    options=[*STEP_FLAGS, opt("--setups", nargs="*", choices=SETUP_NAMES)],
    run=lambda a: run(a.quick, preset_name=a.preset, seq_len=a.seq_len, batch=a.batch,
                      setups=a.setups),
    config=lambda a: config_of(a.preset, a.seq_len, a.batch))
main = BENCH.main


if __name__ == "__main__":
    main()
