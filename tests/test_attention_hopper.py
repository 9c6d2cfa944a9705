"""The Hopper attention forward (Gluon): which inputs it takes, how the forward is
chosen, that it compiles for sm_90 on any machine, and on an H100/H200 that it matches
the reference (forward, and backward through the portable kernel's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from colossal_lab.kernels import flash_attention as fa
from colossal_lab.kernels import flash_attention_hopper as hopper
from tests.test_attention import DEVICE, _check

on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU")


def _packed_qkv(b, s, hq, hkv, d, dtype=torch.bfloat16, device="cpu"):
    qkv = torch.randn(b, s, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    q = qkv[..., :hq * d].view(b, s, hq, d).transpose(1, 2)
    k = qkv[..., hq * d:(hq + hkv) * d].view(b, s, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d:].view(b, s, hkv, d).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "packed"])
def test_rows_view_addresses_every_element(layout):
    b, s, hq, hkv, d = 3, 40, 4, 2, 64
    if layout == "packed":
        tensors = _packed_qkv(b, s, hq, hkv, d)
    elif layout == "bshd":
        tensors = [torch.randn(b, s, h, d).to(torch.bfloat16).transpose(1, 2)
                   for h in (hq, hkv, hkv)]
    else:
        tensors = [torch.randn(b, h, s, d).to(torch.bfloat16) for h in (hq, hkv, hkv)]
    for t in tensors:
        view, ss = hopper.rows_view(t)
        for bi in range(b):
            for h in range(t.shape[1]):
                off = bi * t.stride(0) + h * t.stride(1)
                row, col = off // ss, off % ss
                assert torch.equal(view[row:row + s, col:col + d], t[bi, h])


def test_rows_view_refuses_what_tma_cannot_address():
    x = torch.randn(2, 4, 64, 64).to(torch.bfloat16)
    assert hopper.rows_view(x.transpose(2, 3)) is None  # D not contiguous
    assert hopper.rows_view(x[..., 1:63]) is None  # misaligned base and rows
    wide = torch.randn(2, 64, 4, 128).to(torch.bfloat16)
    assert hopper.rows_view(wide[..., :64].transpose(1, 2)) is not None  # heads side by side
    # heads neither whole rows apart nor side by side within one row: no view
    odd = torch.randn(4 * 8256 + 64 * 128).to(torch.bfloat16).as_strided(
        (1, 4, 64, 64), (4 * 8256, 8256, 128, 1))
    assert hopper.rows_view(odd) is None


def test_unsupported_says_why():
    q = torch.randn(1, 2, 256, 128).to(torch.bfloat16)
    why = hopper.unsupported(q, q, q)
    assert why is not None and ("CUDA" in why or "Gluon" in why)


def test_forward_kernel_choice_and_errors():
    """Where the Hopper kernel cannot run (here: fp32, and on a CPU the interpreter),
    "auto" runs the portable kernel and "hopper" says why; unknown names are refused."""
    q = torch.randn(1, 2, 128, 64, device=DEVICE)
    o_auto, lse_auto = fa.flash_attention_forward(q, q, q, True, kernel="auto")
    o_port, lse_port = fa.flash_attention_forward(q, q, q, True, kernel="portable")
    assert torch.equal(o_auto, o_port) and torch.equal(lse_auto, lse_port)
    with pytest.raises(ValueError, match="Hopper forward cannot"):
        fa.flash_attention_forward(q, q, q, True, kernel="hopper")
    with pytest.raises(ValueError, match="kernel="):
        fa.flash_attention_forward(q, q, q, True, kernel="fa3")
    with pytest.raises(ValueError, match="kernel="):
        fa.flash_attention(q, q, q, True, kernel="fa3")
    with pytest.raises(ValueError, match="schedule="):
        hopper.forward(q, q, q, True, 0.125, q, q, schedule="fast")
    with pytest.raises(ValueError, match="contiguous last dimension"):
        hopper.forward(q, q, q, True, 0.125, q.transpose(2, 3), torch.empty(1, 2, 128))


@pytest.mark.skipif(not hopper.HAVE_GLUON, reason="this Triton has no Gluon")
def test_compiles_for_sm90_without_a_gpu():
    """Gluon has no interpreter: compile the kernel for sm_90 ahead of time (a process
    without the interpreter) and check ptxas keeps it free of spills."""
    code = r"""
import os, subprocess, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime.jit import mangle_type
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from colossal_lab.kernels import flash_attention_hopper as fh

for d, causal, schedule in ((128, True, 1), (64, False, 1), (128, True, 0), (128, False, 2)):
    q = torch.empty(1, 2, 256, d, dtype=torch.bfloat16)
    sig = {}
    for name, block in zip(fh._attn_fwd_hopper_kernel.arg_names[:3],
                           (fh.HALF_M, fh.BLOCK_N, fh.BLOCK_N)):
        view, ss = fh.rows_view(q)
        layout = gl.NVMMASharedLayout.get_default_for([block, d], gl.bfloat16)
        sig[name] = mangle_type(TensorDescriptor(view, list(view.shape), [ss, 1],
                                                 [block, d], layout))
    sig.update(o_ptr="*bf16", lse_ptr="*fp32")
    for name in fh._attn_fwd_hopper_kernel.arg_names[5:20]:
        sig[name] = "i64" if name.endswith(("sb", "sh", "ss")) else "i32"
    sig["qk_scale"] = "fp32"
    consts = dict(GROUP=1, HEAD_DIM=d, CAUSAL=causal, BLOCK_N=fh.BLOCK_N,
                  STAGES=fh.STAGES, SCHEDULE=schedule, CONSUMER_REGS=fh.CONSUMER_REGS,
                  PRODUCER_REGS=fh.PRODUCER_REGS)
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fh._attn_fwd_hopper_kernel, sig, consts, {})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name,
                          "-o", f.name + ".cubin"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0 bytes spill stores" in out.stderr, out.stderr
    assert k.metadata.num_warps == 12, k.metadata.num_warps  # 4 + 4 consumers, 1 loader
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def _reference(q, k, v, causal):
    """fp32 attention and its natural-log LSE (grouped heads repeated)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return s.softmax(-1) @ v, torch.logsumexp(s, -1)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(2, 4, 4, 128, 128), (2, 8, 2, 384, 64),
                                          (1, 4, 1, 640, 128), (3, 2, 2, 1152, 64)])
def test_hopper_forward_matches_reference(b, hq, hkv, s, d, causal, dtype):
    """The Gluon forward against fp32 attention: its error within 2 x the portable
    kernel's (plus a floor) and the LSE to 1e-4."""
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    assert hopper.unsupported(q, k, v) is None
    ref, ref_lse = _reference(q, k, v, causal)
    o, lse = fa.flash_attention_forward(q, k, v, causal, kernel="hopper")
    portable, _ = fa.flash_attention_forward(q, k, v, causal, kernel="portable")
    err = (o.float() - ref).abs().max().item()
    bound = 2 * (portable.float() - ref).abs().max().item() + 1e-3
    assert err <= bound, (err, bound)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hopper_forward_trains(causal):
    """Out and gradients through `flash_attention(kernel="hopper")` (the backward is the
    portable kernel's, fed the Gluon forward's O and LSE) against the reference."""
    q, k, v, do = (torch.randn(2, h, 384, 128, device="cuda", dtype=torch.bfloat16)
                   for h in (8, 2, 2, 8))
    _check(q, k, v, do, causal, atol=1e-3,
           fn=lambda q, k, v: fa.flash_attention(q, k, v, causal, kernel="hopper"))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("layout", ["bshd", "packed"])
@pytest.mark.parametrize("schedule", hopper.SCHEDULES)
def test_hopper_forward_layouts_and_schedules(layout, schedule):
    """(B, S, H, D) transposes and slices of a packed QKV go in without copies; every
    schedule gives the same output."""
    b, s, hq, hkv, d = 2, 512, 8, 2, 128
    if layout == "packed":
        q, k, v = _packed_qkv(b, s, hq, hkv, d, device="cuda")
    else:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   .transpose(1, 2) for h in (hq, hkv, hkv))
    assert hopper.unsupported(q, k, v) is None
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device="cuda")
    hopper.forward(q, k, v, True, d ** -0.5, o, lse, schedule=schedule)
    ref, ref_lse = fa.flash_attention_forward(q, k, v, True, kernel="portable")
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.gpu
@on_hopper
def test_auto_takes_the_portable_kernel_where_hopper_cannot():
    q = torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.bfloat16)  # S % 128 != 0
    assert "multiple of 128" in hopper.unsupported(q, q, q)
    o, _ = fa.flash_attention_forward(q, q, q, True, kernel="auto")
    ref, _ = fa.flash_attention_forward(q, q, q, True, kernel="portable")
    assert torch.equal(o, ref)
    with pytest.raises(ValueError, match="multiple of 128"):
        fa.flash_attention_forward(q, q, q, True, kernel="hopper")
