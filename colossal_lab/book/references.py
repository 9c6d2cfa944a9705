"""Numbers the book cites but did not measure, each with its source.

A chapter that compares with someone else's figure takes it from here, never from a
file the reader does not have, and says what differs (GPU, precision, formula). Our
own numbers come from `results/<gpu>/*.json` instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    """One published or separately measured figure."""

    key: str
    what: str
    """What was measured, with the setup that matters for a like-for-like reading."""
    value: float
    unit: str
    """"mfu" (a fraction of the dense bf16 peak), "tflops", "tokens_per_s", "x", ..."""
    source: str
    """Where it comes from: paper, repository and file, or measurement."""
    url: str | None = None


ANCHORS = {a.key: a for a in (
    Anchor("hf_7b_full_ckpt_h200",
           "Hugging Face LlamaForCausalLM, LLaMA-7B (32 layers), seq 4096, batch 2, bf16, "
           "full gradient checkpointing, fused AdamW, one H200; MFU 6N (the weights' "
           "dtype was not recorded; a 101 GiB peak suggests fp32 weights and states)",
           0.380, "mfu",
           "measured by the colossal_lab maintainers on one H200 (torch "
           "2.11.0+cu130), outside this repository's benchmarks: 9.3k tokens/s, 101 GiB"),
    Anchor("llm_foundry_7b_ckpt_h100",
           "llm-foundry (MosaicML), 7B, 8xH100, bf16, seq 4096, activation "
           "checkpointing; MFU counts attention", 0.404, "mfu",
           "mosaicml/llm-foundry, scripts/train/benchmarking/README.md",
           "https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/benchmarking"),
    Anchor("llm_foundry_7b_h100",
           "llm-foundry, 7B, 8xH100, bf16, seq 2048, no checkpointing; MFU counts "
           "attention", 0.464, "mfu",
           "mosaicml/llm-foundry, scripts/train/benchmarking/README.md",
           "https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/benchmarking"),
    Anchor("fa3_causal_fwd_4k",
           "FlashAttention-3 paper, H100 SXM5, head dim 128, causal forward at seq 4096",
           579.0, "tflops", "Shah et al. 2024, FlashAttention-3, Figure 5",
           "https://arxiv.org/abs/2407.08608"),
    Anchor("torchtitan_float8_speedup",
           "torchtitan, Llama3-8B on 8xH100, torch.compile + float8 (tensorwise) over "
           "torch.compile in bf16, tokens/s per GPU (6.7k -> 8.5k)", 1.27, "x",
           "pytorch/torchtitan, docs/performance.md",
           "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"),
    Anchor("a100_tf32_over_bf16",
           "A100 datasheet: dense TF32 156 TFLOP/s against dense bf16 312: the tutorial's "
           "'bf16 is about 2x fp32' holds against TF32, not against true fp32 (19.5)",
           2.0, "x", "NVIDIA A100 Tensor Core GPU datasheet (2020)",
           "https://www.nvidia.com/en-us/data-center/a100/"),
    Anchor("korthikanti_selective",
           "Korthikanti et al. 2022: selective recomputation + sequence parallelism give "
           "5x less activation memory and cut the recompute overhead by over 90%",
           5.0, "x", "Reducing Activation Recomputation in Large Transformer Models",
           "https://arxiv.org/abs/2205.05198"),
)}


def anchor(key: str) -> Anchor:
    try:
        return ANCHORS[key]
    except KeyError:
        raise KeyError(f"no anchor {key!r}; known: {sorted(ANCHORS)}") from None


def table_rows(keys=None) -> list[dict]:
    """Rows for `notebook.table`: what, value, unit, source."""
    return [{"what": a.what, "value": a.value, "unit": a.unit, "source": a.source}
            for k, a in ANCHORS.items() if keys is None or k in keys]
