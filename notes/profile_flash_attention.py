"""Profile our FlashAttention kernels at the canonical point under Nsight Compute.

    ncu --clock-control none --profile-from-start off --kernel-name regex:_attn \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python notes/profile_flash_attention.py

Autotuning runs first, outside the profiled range; then one fwd+bwd is profiled.
"""

import torch

from colossal_lab.kernels.flash_attention import flash_attention

q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
for _ in range(2):  # autotune and warm up, not profiled
    torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
torch.cuda.synchronize()
torch.cuda.profiler.start()
torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
