"""Kernel classes: which part of a training step a kernel or operator name belongs to."""

from __future__ import annotations

import re

KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", (r"nccl", r"c10d::", r"gloo", r"record_param_comms", r"all_?reduce",
                       r"all_?gather", r"reduce_?scatter", r"all_to_all", r"sendrecv")),
    ("optimizer", (r"multi_tensor_apply", r"adam", r"_foreach_", r"\bsgd", r"lamb(?!da)",
                   r"LpNorm", r"clip_grad")),
    ("loss", (r"cross_?entropy", r"nll_loss", r"log_?softmax", r"logsumexp")),
    ("attention", (r"flash", r"fmha", r"attention", r"attn", r"sdpa",
                   r"scaled_dot_product", r"softmax")),
    ("norm", (r"rms_?norm", r"layer_?norm", r"group_?norm", r"batch_?norm", r"rsqrt")),
    ("rope", (r"rope", r"rotary")),
    ("activation", (r"silu", r"swiglu", r"gelu", r"act_and_mul", r"\bglu")),
    ("GEMM", (r"gemm", r"xmma", r"cutlass", r"nvjet", r"cublas", r"^(void )?sm\d+_",
              r"ampere_", r"hopper_", r"volta_", r"turing_", r"splitk", r"gemv",
              r"triton_tem_", r"scaled_mm",
              r"^aten::(mm|addmm|bmm|baddbmm|addmv|matmul|linear|_scaled_mm)$")),
    ("copies/casts", (r"copy", r"(?<!broad)cast", r"memcpy", r"memset", r"fill", r"catarray",
                      r"^aten::(to|_to_copy|clone|contiguous|cat|zero_|zeros|ones|"
                      r"empty_like|index_put_|stack)$")),
    ("elementwise", (r"elementwise", r"reduce_kernel", r"triton_(poi|red|per)_",
                     r"^aten::(add|sub|mul|div|neg|pow|exp|log|sqrt|reciprocal|mean|sum|"
                     r"where|masked_fill|maximum|minimum|abs|clamp|lerp|addcmul|addcdiv|"
                     r"tanh|sigmoid|sin|cos|amax|max|min|ne|eq|lt|gt|sign|"
                     r"linalg_vector_norm|norm)_?$")),
)
"""(class, patterns) in the order they are tried; a kernel's class is the first whose
pattern occurs in its name (case-insensitive `re.search`), else "other". The order
matters where names share words:

* communication first (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``), then the
  optimizer (``multi_tensor_apply_kernel<...FusedAdamW...>``, our ``_adamw_kernel``,
  ``aten::_fused_adamw_``; gradient clipping's ``LpNormFunctor`` before "norm");
* loss before attention: the cross-entropy's ``cunn_SoftMaxForward<...LogSoftMax...>``
  is a softmax too; any other softmax is attention's (naive attention);
* attention before GEMM: cuDNN's ``cudnn_generated_fort_native_sdpa_sm90_flash_...``
  carries an ``sm90`` like cuBLAS's ``sm90_xmma_gemm_...``; ``fmha_cutlassF_...``
  (memory-efficient attention) a ``cutlass``;
* norm, rope and activation before copies and elementwise: Inductor's fused
  ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0`` is an RMSNorm (``rsqrt``),
  ``triton_poi_fused_mul_silu_0`` a SwiGLU; PyTorch's
  ``elementwise_kernel<...silu_kernel...>`` an activation;
* copies before elementwise: ``elementwise_kernel<...direct_copy_kernel_cuda...>`` is
  a copy or a dtype cast, not arithmetic.

What names cannot tell: an eager RMSNorm is ``pow``, ``mean``, ``add``, ``rsqrt`` and
``mul`` kernels; only its ``rsqrt`` says "norm", the rest count as elementwise. The
embedding (``indexSelect...``, ``embedding_backward...``) and anything unknown is
"other". Names come from CUDA kernels (GPU traces) and from operators (CPU traces:
``aten::mm``, ``aten::_scaled_dot_product_flash_attention_for_cpu``, our autograd
Functions such as ``TritonRMSNormFunction``)."""

CLASSES = tuple(c for c, _ in KERNEL_CLASSES) + ("other",)
COLORS = dict(zip(CLASSES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                            "#8c564b", "#e377c2", "#2b2d7c", "#bcbd22", "#17becf",
                            "#c7c7c7")))
"""One colour per class, the same in every chart."""
_COMPILED = tuple((c, re.compile("|".join(p), re.IGNORECASE)) for c, p in KERNEL_CLASSES)


def classify(name: str) -> str:
    """The `KERNEL_CLASSES` class of a kernel or operator name ("other" if none)."""
    for cls, pattern in _COMPILED:
        if pattern.search(name):
            return cls
    return "other"


def short_name(name: str, width: int = 90) -> str:
    """A kernel name for a table: no leading ``void``, no ``at::native::`` or
    ``(anonymous namespace)::``, no argument list, at most `width` characters
    (templated CUDA names run to hundreds)."""
    name = re.sub(r"^void ", "", name)
    name = name.replace("(anonymous namespace)::", "").replace("at::native::", "")
    if name.endswith(")"):  # drop the argument list: the "(" that matches the last ")"
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] if i > 0 else name
                break
    return name if len(name) <= width else name[:width - 1] + "…"
