"""Nsight Compute target: the causal S1024 D128 forward (B16 H32), one call each of the
Hopper forward (serial on the grid, overlap under the dynamic scheduler), the portable
forward and cuDNN. A working tool (notes/flash_attention.md):

    ncu --clock-control none --profile-from-start off -k regex:"attn_fwd|cudnn" \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        --section ComputeWorkloadAnalysis python notes/ncu_flash_attention_s1024.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from colossal_lab.kernels import flash_attention as fa
from colossal_lab.kernels import flash_attention_hopper as hopper

b, h, s, d = 16, 32, 1024, 128
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
runs = [lambda: hopper.forward(q, k, v, True, d ** -0.5, o, lse, schedule="serial",
                               scheduler="grid"),
        lambda: hopper.forward(q, k, v, True, d ** -0.5, o, lse, schedule="overlap",
                               scheduler="dynamic"),
        lambda: fa.flash_attention_forward(q, k, v, True, kernel="portable"),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)]
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for f in runs:  # compile and warm up outside the profiled range
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in runs:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
