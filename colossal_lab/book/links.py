"""Where the book's sources live: one table of links, ColossalAI's pinned to one commit.

Papers, ColossalAI's files and issues, PyTorch and Hugging Face pages, other projects,
and the chapters themselves. Why one table. A chapter that cites FlashAttention-2 or ColossalAI's
`grad_ckpt_config.py` links it with `markdown_link(key)`, so

- every link into ColossalAI's source names the same commit, `COLOSSALAI_COMMIT` (the
  newest snapshot of hpcaitech/ColossalAI when these links were written):
  files move and line numbers drift on `main`, a pinned blob does not. A line anchor
  (`#L164`) is given only where the line was read at that commit;
- every paper is its arXiv abstract page, every PyTorch page the `stable` docs;
- `tests/test_links.py` checks the whole table once, for all chapters, and
  `book/references.md` lists the same entries by chapter.

Targets that are not URLs are the book's own pages, as paths relative to `book/`: every
chapter and the references page live there, so `01_flash_attention.ipynb` works from any
of them (Jupyter Book turns it into a link to the chapter's page).

Nothing here touches the network, and the module imports nothing from the package.

    >>> markdown_link("colossalai#6390", "hpcaitech/ColossalAI#6390")
    '[hpcaitech/ColossalAI#6390](https://github.com/hpcaitech/ColossalAI/issues/6390)'
    >>> markdown_link("chapter:04", "chapter 04")
    '[chapter 04](04_gradient_checkpointing.ipynb)'
"""

from __future__ import annotations

COLOSSALAI_REPO = "https://github.com/hpcaitech/ColossalAI"
COLOSSALAI_COMMIT = "4f9953be335ef371b3848719ddafe596c01ecd37"
"""hpcaitech/ColossalAI's commit "Update README.md (#6412)": every ColossalAI source
link below is a blob or tree at this commit."""


def _cai(path: str, lines: str = "") -> str:
    """A file (or, ending in "/", a folder) of ColossalAI at `COLOSSALAI_COMMIT`;
    `lines` is "164" or "183-199"."""
    kind = "tree" if path.endswith("/") else "blob"
    anchor = ""
    if lines:
        first, _, last = lines.partition("-")
        anchor = f"#L{first}" + (f"-L{last}" if last else "")
    return f"{COLOSSALAI_REPO}/{kind}/{COLOSSALAI_COMMIT}/{path.rstrip('/')}{anchor}"


def _issue(n: int) -> str:
    return f"{COLOSSALAI_REPO}/issues/{n}"


def _pull(n: int) -> str:
    return f"{COLOSSALAI_REPO}/pull/{n}"


def _arxiv(arxiv_id: str) -> str:
    return f"https://arxiv.org/abs/{arxiv_id}"


def _torch(page: str) -> str:
    return f"https://docs.pytorch.org/docs/stable/{page}"


def _torch_note(page: str) -> str:
    """A page of PyTorch's notes (its design and semantics pages)."""
    return _torch(f"notes/{page}")


def _hf(page: str) -> str:
    return f"https://huggingface.co/docs/{page}"


PAPERS: dict[str, tuple[str, str]] = {
    "kaplan2020": ("Kaplan et al. 2020, Scaling Laws for Neural Language Models",
                   _arxiv("2001.08361")),
    "palm": ("Chowdhery et al. 2022, PaLM: Scaling Language Modeling with Pathways",
             _arxiv("2204.02311")),
    "llama": ("Touvron et al. 2023, LLaMA: Open and Efficient Foundation Language Models",
              _arxiv("2302.13971")),
    "korthikanti2022": ("Korthikanti et al. 2022, Reducing Activation Recomputation in "
                        "Large Transformer Models", _arxiv("2205.05198")),
    "flashattention": ("Dao et al. 2022, FlashAttention: Fast and Memory-Efficient Exact "
                       "Attention with IO-Awareness", _arxiv("2205.14135")),
    "flashattention2": ("Dao 2023, FlashAttention-2: Faster Attention with Better "
                        "Parallelism and Work Partitioning", _arxiv("2307.08691")),
    "flashattention3": ("Shah et al. 2024, FlashAttention-3: Fast and Accurate Attention "
                        "with Asynchrony and Low-precision", _arxiv("2407.08608")),
    "online-softmax": ("Milakov & Gimelshein 2018, Online normalizer calculation for "
                       "softmax", _arxiv("1805.02867")),
    "rmsnorm": ("Zhang & Sennrich 2019, Root Mean Square Layer Normalization",
                _arxiv("1910.07467")),
    "layernorm": ("Ba, Kiros & Hinton 2016, Layer Normalization", _arxiv("1607.06450")),
    "glu-variants": ("Shazeer 2020, GLU Variants Improve Transformer",
                     _arxiv("2002.05202")),
    "gqa": ("Ainslie et al. 2023, GQA: Training Generalized Multi-Query Transformer "
            "Models from Multi-Head Checkpoints", _arxiv("2305.13245")),
    "rope": ("Su et al. 2021, RoFormer: Enhanced Transformer with Rotary Position "
             "Embedding", _arxiv("2104.09864")),
    "chen2016": ("Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost",
                 _arxiv("1604.06174")),
    "narayanan2021": ("Narayanan et al. 2021, Efficient Large-Scale Language Model "
                      "Training on GPU Clusters Using Megatron-LM (1F1B schedule)",
                      _arxiv("2104.04473")),
    "mixed-precision": ("Micikevicius et al. 2018, Mixed Precision Training",
                        _arxiv("1710.03740")),
    "fp8-formats": ("Micikevicius et al. 2022, FP8 Formats for Deep Learning",
                    _arxiv("2209.05433")),
    "deepseek-v3": ("DeepSeek-AI 2024, DeepSeek-V3 Technical Report",
                    _arxiv("2412.19437")),
    "zero-bubble": ("Qi et al. 2024, Zero Bubble Pipeline Parallelism",
                    _arxiv("2401.10241")),
    "megatron2019": ("Shoeybi et al. 2019, Megatron-LM: Training Multi-Billion Parameter "
                     "Language Models Using Model Parallelism", _arxiv("1909.08053")),
    "gpipe": ("Huang et al. 2019, GPipe: Efficient Training of Giant Neural Networks "
              "using Pipeline Parallelism", _arxiv("1811.06965")),
    "pipedream": ("Narayanan et al. 2019, PipeDream: Generalized Pipeline Parallelism for "
                  "DNN Training (the 1F1B schedule)", _arxiv("1806.03377")),
    "pipedream-flush": ("Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN "
                        "Training (PipeDream-Flush, 1F1B with a flush)",
                        _arxiv("2006.09503")),
    "zero": ("Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training "
             "Trillion Parameter Models", _arxiv("1910.02054")),
    "pytorch-ddp": ("Li et al. 2020, PyTorch Distributed: Experiences on Accelerating "
                    "Data Parallel Training", _arxiv("2006.15704")),
    "fsdp": ("Zhao et al. 2023, PyTorch FSDP: Experiences on Scaling Fully Sharded Data "
             "Parallel", _arxiv("2304.11277")),
    "roofline": ("Williams, Waterman & Patterson 2009, Roofline: An Insightful Visual "
                 "Performance Model for Multicore Architectures",
                 "https://doi.org/10.1145/1498765.1498785"),
}

COLOSSALAI: dict[str, tuple[str, str]] = {
    "colossalai": ("hpcaitech/ColossalAI, the snapshot every source link is pinned to",
                   f"{COLOSSALAI_REPO}/tree/{COLOSSALAI_COMMIT}"),
    "colossalai:HybridParallelPlugin": (
        "ColossalAI HybridParallelPlugin (colossalai/booster/plugin/"
        "hybrid_parallel_plugin.py)",
        _cai("colossalai/booster/plugin/hybrid_parallel_plugin.py", "928")),
    "colossalai:enable_jit_fused": (
        "ColossalAI HybridParallelPlugin's enable_jit_fused (\"Whether to switch on JIT "
        "in Shardformer\")",
        _cai("colossalai/booster/plugin/hybrid_parallel_plugin.py", "960")),
    # switch 1: the flag ends in ColoAttention, which dispatches to flash-attn or SDPA
    "colossalai:llama_flash_attention_forward": (
        "ColossalAI get_llama_flash_attention_forward (colossalai/shardformer/modeling/"
        "llama.py)", _cai("colossalai/shardformer/modeling/llama.py", "489")),
    "colossalai:ColoAttention": (
        "ColossalAI ColoAttention (colossalai/shardformer/layer/attn.py)",
        _cai("colossalai/shardformer/layer/attn.py", "82")),
    "colossalai:flash_attention_dao": (
        "ColossalAI's flash-attn kernel loader calling flash_attn_func "
        "(extensions/pybind/flash_attention/flash_attention_dao_cuda.py)",
        _cai("extensions/pybind/flash_attention/flash_attention_dao_cuda.py", "85")),
    "colossalai:flash_attention_sdpa": (
        "ColossalAI's SDPA kernel loader "
        "(extensions/pybind/flash_attention/flash_attention_sdpa_cuda.py)",
        _cai("extensions/pybind/flash_attention/flash_attention_sdpa_cuda.py", "47")),
    # switch 2
    "colossalai:FusedRMSNorm": (
        "ColossalAI FusedRMSNorm, a wrapper of apex's kernel "
        "(colossalai/shardformer/layer/normalization.py)",
        _cai("colossalai/shardformer/layer/normalization.py", "300")),
    # switch 3: what enable_jit_fused does, and where QKV fusion lives
    "colossalai:kernel_jit": ("ColossalAI colossalai/kernel/jit/ (TorchScript-fused "
                              "bias + GeLU, bias + dropout + add)",
                              _cai("colossalai/kernel/jit/")),
    "colossalai:bias_gelu": ("ColossalAI colossalai/kernel/jit/bias_gelu.py",
                             _cai("colossalai/kernel/jit/bias_gelu.py")),
    "colossalai:bias_dropout_add": (
        "ColossalAI colossalai/kernel/jit/bias_dropout_add.py",
        _cai("colossalai/kernel/jit/bias_dropout_add.py")),
    "colossalai:llama_policy": ("ColossalAI LlamaPolicy (colossalai/shardformer/policies/"
                                "llama.py), which has no enable_jit_fused branch",
                                _cai("colossalai/shardformer/policies/llama.py", "26")),
    "colossalai:qkv_fused_linear": (
        "ColossalAI colossalai/shardformer/layer/qkv_fused_linear.py",
        _cai("colossalai/shardformer/layer/qkv_fused_linear.py")),
    "colossalai:GPT2FusedLinearConv1D_Col": (
        "ColossalAI GPT2FusedLinearConv1D_Col (qkv_fused_linear.py)",
        _cai("colossalai/shardformer/layer/qkv_fused_linear.py", "193")),
    # switch 4
    "colossalai:grad_ckpt_config": (
        "ColossalAI colossalai/shardformer/shard/grad_ckpt_config.py "
        "(GradientCheckpointConfig, PipelineGradientCheckpointConfig)",
        _cai("colossalai/shardformer/shard/grad_ckpt_config.py")),
    "colossalai:llama_ckpt_layers": (
        "ColossalAI LlamaPipelineForwards: which layers of a stage are checkpointed "
        "(colossalai/shardformer/modeling/llama.py)",
        _cai("colossalai/shardformer/modeling/llama.py", "183-199")),
    "colossalai:performance_evaluator": (
        "ColossalAI examples/language/performance_evaluator.py (2·N·(3 + 1) FLOPs per "
        "token with checkpointing)",
        _cai("examples/language/performance_evaluator.py", "164")),
    # switch 6
    "colossalai:linear_fp8": (
        "ColossalAI linear_fp8 (colossalai/quantization/fp8.py): checks the input's "
        "dimensions, not the weight's",
        _cai("colossalai/quantization/fp8.py", "842-843")),
    # switch 7
    "colossalai:zero_bubble_pp": (
        "ColossalAI ZeroBubbleVPipeScheduler (colossalai/pipeline/schedule/"
        "zero_bubble_pp.py)",
        _cai("colossalai/pipeline/schedule/zero_bubble_pp.py", "40")),
    # switch 5
    "colossalai:linear_gather_rs": (
        "ColossalAI _LinearWithGatherForwardReduceScatterBackward, split_gather's column "
        "linear (colossalai/shardformer/layer/_operation.py)",
        _cai("colossalai/shardformer/layer/_operation.py", "527")),
    "colossalai:ring_as_gather": (
        "ColossalAI _ring_as_gather, the ring mode's chunked all-gather "
        "(colossalai/shardformer/layer/_operation.py)",
        _cai("colossalai/shardformer/layer/_operation.py", "418")),
    # issues and pull requests (not pinned: they are threads, not code)
    "colossalai#5509": ("hpcaitech/ColossalAI#5509: gradient_checkpointing_ratio and "
                        "heterogeneous shard policy (issue, the design)", _issue(5509)),
    "colossalai#5508": ("hpcaitech/ColossalAI#5508: add gradient_checkpointing_ratio and "
                        "heterogeneous shard policy for llama (pull request)",
                        _pull(5508)),
    "colossalai#6260": ("hpcaitech/ColossalAI#6260: FusedRMSNorm fails with "
                        "'NoneType' object is not callable without apex (issue)",
                        _issue(6260)),
    "colossalai#6446": ("hpcaitech/ColossalAI#6446: fall back to native RMSNorm when "
                        "apex is not installed (pull request for ColossalAI#6260)", _pull(6446)),
    "colossalai#6390": ("hpcaitech/ColossalAI#6390: use_fp8=True fails when a dimension "
                        "is not divisible by 16 (issue)", _issue(6390)),
    "colossalai#6393": ("hpcaitech/ColossalAI#6393: FP8 linear dimension check "
                        "(pull request for ColossalAI#6390)", _pull(6393)),
    "colossalai#6086": ("hpcaitech/ColossalAI#6086: optimize sequence parallelism "
                        "(pull request)", _pull(6086)),
}

DOCS: dict[str, tuple[str, str]] = {
    "torch:checkpoint": ("PyTorch torch.utils.checkpoint", _torch("checkpoint.html")),
    "torch:sdpa": ("PyTorch torch.nn.functional.scaled_dot_product_attention",
                   _torch("generated/torch.nn.functional.scaled_dot_product_attention"
                          ".html")),
    "torch:sdpa_kernel": ("PyTorch torch.nn.attention.sdpa_kernel",
                          _torch("generated/torch.nn.attention.sdpa_kernel.html")),
    "torch:flex_attention": ("PyTorch torch.nn.attention.flex_attention",
                             _torch("nn.attention.flex_attention.html")),
    "torch:flop_counter": ("PyTorch torch.utils.flop_counter.FlopCounterMode",
                           _torch("generated/torch.utils.flop_counter.FlopCounterMode"
                                  ".html")),
    "torch:compile": ("PyTorch torch.compile", _torch("generated/torch.compile.html")),
    "torch:rms_norm": ("PyTorch torch.nn.functional.rms_norm",
                       _torch("generated/torch.nn.functional.rms_norm.html")),
    "torch:amp": ("PyTorch torch.amp (autocast, GradScaler)", _torch("amp.html")),
    "torch:backends": ("PyTorch torch.backends (torch.backends.cuda.matmul.allow_tf32)",
                       _torch("backends.html")),
    "torch:finfo": ("PyTorch torch.finfo", _torch("type_info.html")),
    "torch:cuda_event": ("PyTorch torch.cuda.Event",
                         _torch("generated/torch.cuda.Event.html")),
    "torch:cuda_graphs": ("PyTorch CUDA semantics: CUDA Graphs",
                          _torch_note("cuda.html#cuda-graphs")),
    "torch:extending": ("PyTorch: Extending PyTorch (torch.autograd.Function)",
                        _torch_note("extending.html")),
    "torch:tensor_parallel": ("PyTorch torch.distributed.tensor.parallel (ColwiseParallel, "
                              "RowwiseParallel, SequenceParallel)",
                              _torch("distributed.tensor.parallel.html")),
    "torch:module": ("PyTorch torch.nn.Module (state-dict hooks)",
                     _torch("generated/torch.nn.Module.html")),
    "python:gc": ("Python gc module (gc.callbacks)",
                  "https://docs.python.org/3/library/gc.html"),
    "python:quantiles": ("Python statistics.quantiles",
                         "https://docs.python.org/3/library/statistics.html"
                         "#statistics.quantiles"),
    "hf:llama": ("Hugging Face Transformers: LLaMA", _hf("transformers/model_doc/llama")),
    "hf:phi3": ("Hugging Face Transformers: Phi-3", _hf("transformers/model_doc/phi3")),
    "hf:gpt2": ("Hugging Face Transformers: GPT-2", _hf("transformers/model_doc/gpt2")),
    "hf:tokenizers": ("Hugging Face Tokenizers", _hf("tokenizers")),
    "colossalai:docs": ("ColossalAI documentation (HybridParallelPlugin, Gemini, the "
                        "booster plugins)", "https://colossalai.org/docs/"),
    "nsight-compute": ("NVIDIA Nsight Compute documentation",
                       "https://docs.nvidia.com/nsight-compute/"),
}

PROJECTS: dict[str, tuple[str, str]] = {
    "colossalai:repo": ("hpcaitech/ColossalAI (repository)", COLOSSALAI_REPO),
    "flash-attention": ("Dao-AILab/flash-attention",
                        "https://github.com/Dao-AILab/flash-attention"),
    "liger-kernel": ("Liger-Kernel (LinkedIn)",
                     "https://github.com/linkedin/Liger-Kernel"),
    "torchtitan": ("pytorch/torchtitan", "https://github.com/pytorch/torchtitan"),
    "torchtitan:performance": ("torchtitan docs/performance.md",
                               "https://github.com/pytorch/torchtitan/blob/main/docs/"
                               "performance.md"),
    "megatron-lm": ("NVIDIA/Megatron-LM", "https://github.com/NVIDIA/Megatron-LM"),
    "transformer-engine": ("NVIDIA Transformer Engine",
                           "https://github.com/NVIDIA/TransformerEngine"),
    "torchao:float8": ("torchao float8 training (torchao.float8)",
                       "https://github.com/pytorch/ao/tree/main/torchao/float8"),
    "apex": ("NVIDIA/apex", "https://github.com/NVIDIA/apex"),
    "quack": ("QuACK: CuTe-DSL kernels (Dao-AILab/quack)",
              "https://github.com/Dao-AILab/quack"),
    "vllm": ("vLLM", "https://github.com/vllm-project/vllm"),
    "llm-foundry": ("MosaicML llm-foundry training benchmarks",
                    "https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/"
                    "benchmarking"),
    "triton:tutorial-05": ("Triton tutorial 05, Layer Normalization",
                           "https://triton-lang.org/main/getting-started/tutorials/"
                           "05-layer-norm.html"),
    "hta": ("Holistic Trace Analysis (facebookresearch/HolisticTraceAnalysis)",
            "https://github.com/facebookresearch/HolisticTraceAnalysis"),
    "nccl": ("NVIDIA/nccl", "https://github.com/NVIDIA/nccl"),
    "nccl-tests": ("NVIDIA/nccl-tests", "https://github.com/NVIDIA/nccl-tests"),
    "nanogpt": ("karpathy/nanoGPT", "https://github.com/karpathy/nanoGPT"),
    "triton:tutorial-06": ("Triton tutorial 06, Fused Attention",
                           "https://triton-lang.org/main/getting-started/tutorials/"
                           "06-fused-attention.html"),
}

CHAPTERS: dict[str, tuple[str, str]] = {
    "book:intro": ("colossal_lab", "intro.ipynb"),
    "chapter:00": ("00 · What MFU is, and how to measure it honestly", "00_mfu.ipynb"),
    "chapter:01": ("01 · Flash attention", "01_flash_attention.ipynb"),
    "chapter:02": ("02 · Fused normalization", "02_fused_norm.ipynb"),
    "chapter:03": ("03 · Fused projections: QKV with GQA, gate/up for SwiGLU",
                   "03_fused_projections.ipynb"),
    "chapter:04": ("04 · Gradient checkpointing", "04_gradient_checkpointing.ipynb"),
    "chapter:05": ("05 · Tensor and sequence parallelism", "05_sequence_parallel.ipynb"),
    "chapter:06": ("06 · Precision: fp32, bf16, fp16 and fp8", "06_precision.ipynb"),
    "chapter:07": ("07 · Pipeline parallelism: 1F1B, interleaved and zero bubble",
                   "07_pipeline.ipynb"),
    "chapter:08": ("08 · Overlapped gradient all-reduce", "08_overlap_allreduce.ipynb"),
    "chapter:09": ("09 · Profiling a step, and the doctor", "09_profiling.ipynb"),
    "chapter:10": ("10 · Every switch in one LLaMA run", "10_composed.ipynb"),
    "chapter:10b": ("10b · The finale's kernels", "10b_finale_kernels.ipynb"),
    "book:references": ("References", "references.md"),
    "book:measurements": ("Measurements", "measurements.md"),
}
"""The book's own pages, relative to `book/`; titles are the pages' first headings."""

TUTORIAL = "chapter 10, performance switches"
"""How the book cites the ColossalAI tutorial chapter it starts from (it has no public
URL: `book/references.md` describes it under the label `tutorial`, with ColossalAI's
repository and documentation). Sections are cited as "§10.2"."""


def tutorial(section: str | None = None) -> str:
    """A MyST citation of the tutorial, linking its entry on the references page:
    ``tutorial("10.8")`` -> "ColossalAI's tutorial, chapter 10, performance switches,
    §10.8" as a `{ref}` to the label `tutorial`."""
    where = f", §{section}" if section else ""
    return f"{{ref}}`ColossalAI's tutorial, {TUTORIAL}{where} <tutorial>`"

LINKS: dict[str, tuple[str, str]] = {
    **PAPERS, **COLOSSALAI, **DOCS, **PROJECTS, **CHAPTERS}
"""key -> (title, url or a path relative to book/)."""


def markdown_link(key: str, text: str | None = None) -> str:
    """`[text](url)` for `key`; the entry's title when `text` is None."""
    try:
        title, url = LINKS[key]
    except KeyError:
        raise KeyError(f"no link {key!r}; add it to colossal_lab.book.links or use one of "
                       f"{sorted(LINKS)}") from None
    return f"[{title if text is None else text}]({url})"
