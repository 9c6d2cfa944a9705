"""The Hopper attention kernels (Gluon): which inputs they take, how they are chosen,
that they compile for sm_90 on any machine, and on an H100/H200 that the forward and
the one-pass backward match the reference."""

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


def test_forward_refuses_an_unknown_epilogue():
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="epilogue='smem'"):
        hopper.forward(q, q, q, True, 1.0, q, torch.zeros(1, 1, 128), epilogue="smem")


def test_forward_refuses_stages_and_steps_that_do_not_fit():
    """K/V slots and keys per step as far as shared memory holds them (the persistent
    schedulers' second Q buffer goes first); other values are refused, saying why."""
    lse = torch.zeros(1, 1, 128)
    for d, stages, keys, match in ((64, 5, None, "stages=5; choose from"),
                                   (256, 3, None, "needs 256 KiB of shared memory"),
                                   (128, 4, 128, "needs 288 KiB"),
                                   (128, 2, 96, "keys_per_step=96; choose from"),
                                   (256, 2, 128, r"choose from \(64,\) at head_dim 256")):
        q = torch.zeros(1, 1, 128, d, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=match):
            hopper.forward(q, q, q, True, 1.0, q, lse, stages=stages, keys_per_step=keys)
    # warpgroup 0's skipped key tile: 64 keys a step, and no ping-pong turns to count
    for d, keys, schedule, match in ((128, None, "serial", "needs 64 keys a step"),
                                     (256, None, "pingpong", "other than 'pingpong'")):
        q = torch.zeros(1, 1, 128, d, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=match):
            hopper.forward(q, q, q, True, 1.0, q, lse, keys_per_step=keys,
                           schedule=schedule, diag_skip=True)
    # (grid, dynamic) x stages 2, 3, 4 at D 128 with 64 keys a step, then 128
    assert [hopper.q_buffers(sc, 128, st, 64) for sc in ("grid", "dynamic")
            for st in hopper.STAGE_CHOICES] == [1, 1, 1, 2, 2, 2]
    assert [hopper.q_buffers("dynamic", 128, st) for st in (2, 3)] == [2, 1]
    assert hopper.q_buffers("static", 256) == 1 and hopper.q_buffers("static", 64) == 2
    # the buffers of the 3-slot build at D 128; ptxas adds the barriers (229,856 B in
    # all), which the compile test holds to MAX_SHARED
    assert hopper.shared_bytes(128, 128, 3, 1) == 229_376 <= hopper.SHARED_LIMIT


def test_forward_kernel_choice_and_errors():
    """Where the Hopper kernel cannot run (here: fp32, and on a CPU the interpreter),
    "auto" runs the portable kernel and "hopper" says why; unknown names are refused."""
    q = torch.randn(1, 2, 128, 64, device=DEVICE)
    o_auto, lse_auto = fa.flash_attention_forward(q, q, q, True, kernel="auto")
    o_port, lse_port = fa.flash_attention_forward(q, q, q, True, kernel="portable")
    assert torch.equal(o_auto, o_port) and torch.equal(lse_auto, lse_port)
    with pytest.raises(ValueError, match="Hopper kernels cannot"):
        fa.flash_attention_forward(q, q, q, True, kernel="hopper")
    with pytest.raises(ValueError, match="Hopper kernels cannot"):
        fa.flash_attention_backward(q, q, q, q, o_port, lse_port, True, kernel="hopper")
    with pytest.raises(ValueError, match="kernel="):
        fa.flash_attention_backward(q, q, q, q, o_port, lse_port, True, kernel="fa3")
    with pytest.raises(ValueError, match="kernel="):
        fa.flash_attention_forward(q, q, q, True, kernel="fa3")
    with pytest.raises(ValueError, match="kernel="):
        fa.flash_attention(q, q, q, True, kernel="fa3")
    assert fa.kernel_plan(q, q, q) == "fwd portable, bwd portable"
    assert fa.kernel_plan(q, q, q, "hopper") == "fwd error, bwd error"
    with pytest.raises(ValueError, match="schedule="):
        hopper.forward(q, q, q, True, 0.125, q, q, schedule="fast")
    with pytest.raises(ValueError, match="scheduler="):
        hopper.forward(q, q, q, True, 0.125, q, q, scheduler="lpt")
    assert hopper.default_scheduler(True) == "grid"
    assert hopper.default_scheduler(False) == "static"
    with pytest.raises(ValueError, match="contiguous last dimension"):
        hopper.forward(q, q, q, True, 0.125, q.transpose(2, 3), torch.empty(1, 2, 128))


def test_auto_forward_plans_every_length():
    """`AUTO_FORWARD` gives every (mask, length) a plan, in order of length; "auto"
    leaves the rows that say portable to the portable forward, "hopper" runs the
    default schedule there, a named schedule keeps its name under the default
    scheduler with the default options."""
    for causal in (True, False):
        rows = [longest for c, longest, _ in fa.AUTO_FORWARD if c == causal]
        assert rows[-1] is None and rows[:-1] == sorted(rows[:-1])
        for s in (128, 1024, 1152, 2048, 4096, 1 << 20):
            for d in (64, 128, 256):
                plan = fa._forward_plan("auto", s, causal, d)
                assert plan is None or (plan[0] in hopper.SCHEDULES
                                        and plan[1] in hopper.SCHEDULERS)
                assert fa._forward_plan("hopper", s, causal, d) == (
                    plan or (hopper.DEFAULT_SCHEDULE, hopper.default_scheduler(causal),
                             {}))
                assert fa._forward_plan("hopper-pingpong", s, causal, d) == (
                    "pingpong", hopper.default_scheduler(causal), {})
    short = {"keys_per_step": 64, "stages": 4, "diag_skip": True, "epilogue": "tma"}
    assert fa._forward_plan("auto", 1024, True, 128) == ("overlap", "dynamic", short)
    assert fa._forward_plan("auto", 1024, True, 256) == ("overlap", "dynamic",
                                                         dict(short, stages=2))
    assert fa._forward_plan("auto", 1024, False) == ("pingpong", "static", {})
    assert fa._forward_plan("auto", 2048, True) == ("overlap", "dynamic", {})
    assert fa._forward_plan("auto", 4096, True) == ("serial", "grid", {})


def test_plan_options_fit_the_head_dim():
    """A plan's options are cut to what `flash_attention_hopper.forward` accepts at the
    head dim: the slots to what shared memory holds, the keys to `block_n`, the skip to
    causal 64-key steps outside ping-pong; the plan's name says what differs from the
    defaults, as the probe names its variants."""
    opts = {"keys_per_step": 128, "stages": 4, "diag_skip": True}
    for d in (64, 128, 256):
        got = fa._fit_options(opts, d, True, "overlap")
        keys = got["keys_per_step"]
        assert keys == hopper.block_n(d)
        assert hopper.shared_bytes(d, keys, got["stages"], 1) <= hopper.SHARED_LIMIT
        assert all(n <= got["stages"] or hopper.shared_bytes(d, keys, n, 1)
                   > hopper.SHARED_LIMIT for n in hopper.STAGE_CHOICES)  # the most that fit
        assert got["diag_skip"] == (keys == hopper.HALF_M)
    assert fa._fit_options(fa.SHORT_CAUSAL, 128, False, "overlap")["diag_skip"] is False
    assert fa._fit_options(fa.SHORT_CAUSAL, 128, True, "pingpong")["diag_skip"] is False
    assert fa._fit_options(fa.SHORT_CAUSAL, 256, True, "overlap")["stages"] == 2
    assert fa._fit_options({}, 128, True, "serial") == {}
    assert fa._plan_name(("overlap", "dynamic", fa.SHORT_CAUSAL), 128) == \
        "hopper-overlap-dynamic-tma-k64-s4-skip"
    assert fa._plan_name(("overlap", "dynamic", dict(fa.SHORT_CAUSAL, stages=2)), 256) \
        == "hopper-overlap-dynamic-tma-skip"
    assert fa._plan_name(("serial", "grid", {}), 128) == "hopper-serial-grid"


SM90_BUILDS = {  # name -> (module, aot_arguments(...), most spill bytes ptxas may report)
    "fwd-d128-causal-overlap": ("hopper", (128, True, "overlap"), 0),
    "fwd-d64-full-overlap": ("hopper", (64, False, "overlap"), 0),
    "fwd-d128-causal-serial": ("hopper", (128, True, "serial"), 160),
    "fwd-d128-full-pingpong": ("hopper", (128, False, "pingpong"), 0),
    "fwd-d128-causal-serial-dynamic": ("hopper", (128, True, "serial", True), 160),
    "fwd-d64-causal-pingpong-dynamic": ("hopper", (64, True, "pingpong", True), 0),
    "fwd-d256-causal-serial": ("hopper", (256, True, "serial"), 80),
    "fwd-d256-full-pingpong-dynamic": ("hopper", (256, False, "pingpong", True), 12),
    "fwd-d128-causal-serial-tma": ("hopper", (128, True, "serial", False, "tma"), 32),
    "fwd-d128-causal-overlap-dynamic-tma": ("hopper", (128, True, "overlap", True, "tma"),
                                            12),
    "fwd-d128-causal-serial-3stages": ("hopper", (128, True, "serial", False, "registers",
                                                  3), 160),
    "fwd-d128-causal-pingpong-dynamic-tma-3stages": (
        "hopper", (128, True, "pingpong", True, "tma", 3), 12),
    "fwd-d128-causal-overlap-dynamic-64keys-4stages": (
        "hopper", (128, True, "overlap", True, "registers", 4, 64), 0),
    "fwd-d128-causal-overlap-dynamic-64keys-4stages-skip": (
        "hopper", (128, True, "overlap", True, "registers", 4, 64, True), 0),
    "fwd-d128-causal-overlap-dynamic-64keys-4stages-tma-skip": (
        "hopper", (128, True, "overlap", True, "tma", 4, 64, True), 0),
    "fwd-d256-causal-serial-skip": ("hopper", (256, True, "serial", False, "registers", 2,
                                               None, True), 96),
    "fwd-d256-causal-overlap-dynamic-tma-skip": ("hopper", (256, True, "overlap", True,
                                                            "tma", 2, None, True), 56),
    "bwd-d128-causal": ("hopper_bwd", (128, True), 64),
    "bwd-d128-full": ("hopper_bwd", (128, False), 32),
    "bwd-d64-causal": ("hopper_bwd", (64, True), 0),
    "bwd-d128-gqa4": ("hopper_bwd", (128, True, 4), 128),
    "bwd-d256-causal": ("hopper_bwd", (256, True), 32),
    "bwd-d256-gqa4": ("hopper_bwd", (256, True, 4), 128),
}
"""What the compile test builds, with the spills it may have (measured with Triton 3.7.1;
the bounds catch a change that makes them worse). The serial schedule (the default: it
measured fastest or level) spills 128 B at head dim 128 with the causal mask, 100 B with
the dynamic scheduler. The backward holds dK, dV (64 registers each), Sᵀ and
dPᵀ (32 each) and dQ (32) per consumer thread of a 240-register budget: 36 B at head dim
128 with the mask, 16 B without, 100 B with the grouped-query loop. At head dim 256 the
forward (64 keys per step, the O accumulator 128 registers per thread) spills 80 B with
the mask; the backward (its warpgroups split dK's and dV's columns) 20 B, 92 B with the
grouped-query loop. Every build fits the 227 KiB of shared memory an sm_90 block may
use: the forward takes about 193 KiB at D 128 with two Q buffers and at D 256 with one,
the backward about 226 KiB at D 256 (one dO slot)."""
MAX_SHARED = 227 * 1024


@pytest.mark.skipif(not hopper.HAVE_GLUON, reason="this Triton has no Gluon")
def test_compiles_for_sm90_without_a_gpu():
    """Gluon has no interpreter: compile the Hopper kernels for sm_90 ahead of time (in a
    process without the interpreter) and check what ptxas reports: 12 warps (two 4-warp
    consumers and a loader), spills within `SM90_BUILDS`' bounds."""
    code = r"""
import json, sys
from colossal_lab.kernels import flash_attention_hopper as hopper
from colossal_lab.kernels import flash_attention_hopper_backward as hopper_bwd
from colossal_lab.kernels.sm90_compile import compile_sm90
out = {}
for name, (module, args) in json.loads(sys.argv[1]).items():
    info = compile_sm90(*globals()[module].aot_arguments(*args))
    out[name] = {k: info[k] for k in ("num_warps", "spill_bytes", "registers",
                                      "shared_bytes")}
print(json.dumps(out))
"""
    import json

    builds = {name: (mod, args) for name, (mod, args, _) in SM90_BUILDS.items()}
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(builds)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (_, _, max_spill) in SM90_BUILDS.items():
        info = report[name]
        assert info["num_warps"] == 12, (name, info)
        assert info["spill_bytes"] <= max_spill, (name, info)
        assert info["shared_bytes"] <= MAX_SHARED, (name, info)


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
                                          (1, 4, 1, 640, 128), (3, 2, 2, 1152, 64),
                                          (1, 4, 2, 384, 256)])
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
def test_hopper_kernels_train(causal):
    """Out and gradients through `flash_attention(kernel="hopper")` (both Gluon
    kernels) against the reference, within the bound the bf16 reference sets."""
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
    ref, ref_lse = fa.flash_attention_forward(q, k, v, True, kernel="portable")
    # O as q's layout (a TMA view), and O that TMA cannot address (rows 264 B apart)
    # where the "tma" epilogue stores from registers instead
    for o in (torch.empty_like(q), torch.empty(b, hq, s, d + 4, device="cuda",
                                                dtype=q.dtype)[..., :d]):
        for epilogue in hopper.EPILOGUES:
            lse = torch.empty(b, hq, s, device="cuda")
            o.zero_()
            hopper.forward(q, k, v, True, d ** -0.5, o, lse, schedule=schedule,
                           epilogue=epilogue)
            torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=0)
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.gpu
@on_hopper
def test_auto_takes_the_portable_kernel_where_hopper_cannot():
    """At a length long enough for `AUTO_HOPPER` to want the Hopper kernels in both
    passes, but not a multiple of 128: "auto" runs the portable ones, "hopper" refuses."""
    q = torch.randn(1, 2, 2112, 128, device="cuda", dtype=torch.bfloat16)  # S % 128 = 64
    assert q.shape[2] >= max(r["min_seq_len"] for r in fa.AUTO_HOPPER.values())
    assert "multiple of 128" in hopper.unsupported(q, q, q)
    o, lse = fa.flash_attention_forward(q, q, q, True, kernel="auto")
    ref, _ = fa.flash_attention_forward(q, q, q, True, kernel="portable")
    assert torch.equal(o, ref)
    with pytest.raises(ValueError, match="multiple of 128"):
        fa.flash_attention_forward(q, q, q, True, kernel="hopper")
    do = torch.randn_like(q)
    grads = fa.flash_attention_backward(do, q, q, q, o, lse, True, kernel="auto")
    ref_grads = fa.flash_attention_backward(do, q, q, q, o, lse, True, kernel="portable")
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(do)
    return q.grad, k.grad, v.grad


def _check_hopper_grads(q, k, v, do, causal):
    """dQ, dK, dV through both Hopper kernels against fp32 attention: each error within
    2 x the portable kernels' (plus a floor)."""
    ref = _grads(lambda q, k, v: _reference(q, k, v, causal)[0], q.float(), k.float(),
                 v.float(), do.float())
    ours = _grads(lambda q, k, v: fa.flash_attention(q, k, v, causal, kernel="hopper"),
                  q, k, v, do)
    portable = _grads(lambda q, k, v: fa.flash_attention(q, k, v, causal,
                                                         kernel="portable"), q, k, v, do)
    for name, o, r, p in zip(("dq", "dk", "dv"), ours, ref, portable):
        assert o.dtype == q.dtype and o.shape == r.shape, name
        err = (o.float() - r).abs().max().item()
        bound = 2 * (p.float() - r).abs().max().item() + 2e-3
        assert err <= bound, (name, err, bound)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(2, 4, 4, 128, 128), (1, 8, 2, 384, 128),
                                          (2, 4, 1, 640, 64), (1, 2, 2, 1152, 128),
                                          (2, 4, 4, 128, 256), (1, 4, 2, 384, 256)])
def test_hopper_backward_matches_reference(b, hq, hkv, s, d, causal, dtype):
    """dQ, dK, dV of the one-pass Gluon backward against fp32 attention: each error within
    2 x the portable backward's (plus a floor), at one and several query heads per
    key/value head, every head dim (256: the warpgroups split the columns), one and
    several key blocks per program's row."""
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    _check_hopper_grads(q, k, v, torch.randn_like(q), causal)


@pytest.mark.gpu
@on_hopper
def test_hopper_backward_layouts():
    """dO and the inputs as (B, S, H, D) transposes and packed-QKV slices: the gradients
    equal those of contiguous copies (dK and dV bit for bit: no atomics there)."""
    b, s, hq, hkv, d = 2, 512, 8, 2, 128
    q, k, v = _packed_qkv(b, s, hq, hkv, d, device="cuda")
    do = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    o, lse = fa.flash_attention_forward(q, k, v, True, kernel="hopper")
    got = fa.flash_attention_backward(do, q, k, v, o, lse, True, kernel="hopper")
    want = fa.flash_attention_backward(do.contiguous(), q.contiguous(), k.contiguous(),
                                       v.contiguous(), o, lse, True, kernel="hopper")
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-2, rtol=0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hopper_persistent_forward_takes_many_tiles(causal):
    """More tiles than SMs, so each persistent program takes several (ring positions,
    barrier phases and ping-pong turns carried from tile to tile; with the "dynamic"
    scheduler, tile ids passed from the load warp): every schedule's output and LSE under
    every scheduler equal those of one program per tile bit for bit, and the backward at
    this many tiles matches the reference as the other tests bound it."""
    b, s, hq, hkv, d = 8, 1024, 16, 4, 128
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    _every_scheduler_agrees(q, k, v, causal)
    _check_hopper_grads(q, k, v, torch.randn_like(q), causal)


def _every_scheduler_agrees(q, k, v, causal) -> dict:
    """Each schedule under each scheduler, at more tiles than SMs, the TMA epilogue with
    the default schedule under every scheduler and with every schedule under the dynamic
    one, and (head dim <= 128) three K/V slots, and 64 keys a step in four, with the
    default schedule under every scheduler, with the TMA epilogue too under the dynamic
    one (each build compiles for a few seconds on the GPU's host): output and LSE
    bit-equal to one program per tile's with O stored from registers and two slots (64
    keys a step: close, the sums run in another order).
    Where the steps are 64 keys, warpgroup 0's skip of the tile's last key tile
    (`diag_skip`, not with ping-pong) is bit-equal to the same build without it: the
    tile it leaves out adds exact zeros. Returns {schedule: (o, lse)} of those runs."""
    b, hq, s, d = q.shape
    assert b * hq * s // hopper.BLOCK_M > 2 * hopper.sm_count(q.device)
    grid = {}
    for schedule in hopper.SCHEDULES:
        outs = {}
        for scheduler in hopper.SCHEDULERS:
            tma = schedule == hopper.DEFAULT_SCHEDULE or scheduler == "dynamic"
            more = schedule == hopper.DEFAULT_SCHEDULE and d <= 128
            ways = [(e, hopper.STAGES, None) for e in (hopper.EPILOGUES if tma else
                                                       ("registers",))]
            ways += [("registers", 3, None), ("registers", 4, 64)] if more else []
            ways += [("tma", 4, 64)] if more and scheduler == "dynamic" else []
            for epilogue, stages, keys in ways:
                skips = (False, True) if hopper.diag_skip_applies(
                    causal, keys or hopper.block_n(d), schedule) else (False,)
                for skip in skips:
                    o, lse = torch.empty_like(q), torch.empty(b, hq, s, device="cuda")
                    hopper.forward(q, k, v, causal, d ** -0.5, o, lse, schedule=schedule,
                                   scheduler=scheduler, epilogue=epilogue, stages=stages,
                                   keys_per_step=keys, diag_skip=skip)
                    outs[scheduler, epilogue, stages, keys, skip] = (o, lse)
        for (scheduler, epilogue, stages, keys, skip), (o, lse) in outs.items():
            if skip:
                plain = outs[scheduler, epilogue, stages, keys, False]
                assert torch.equal(o, plain[0]), (schedule, scheduler, keys, "skip")
                assert torch.equal(lse, plain[1]), (schedule, scheduler, keys, "skip")
        first = outs["grid", "registers", hopper.STAGES, None, False]
        for how, (o, lse) in outs.items():
            if how[3] is None:  # the same steps: the same sums
                assert torch.equal(o, first[0]), (schedule, how)
                assert torch.equal(lse, first[1]), (schedule, how)
            else:
                torch.testing.assert_close(o.float(), first[0].float(), atol=1e-2, rtol=0)
                torch.testing.assert_close(lse, first[1], atol=1e-4, rtol=0)
        grid[schedule] = first
    return grid


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hopper_forward_at_head_dim_256_under_every_scheduler(causal):
    """Head dim 256 (64 keys per step, one Q buffer): every schedule under every
    scheduler bit-equal to one program per tile, at more tiles than SMs, and close to
    the portable forward; the Hopper backward at this many programs matches the
    reference as the other tests bound it."""
    b, s, hq, hkv, d = 4, 1024, 16, 4, 256
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert hopper.unsupported(q, k, v) is None
    assert hopper.unsupported(q, k, v, "backward") is None
    ref, ref_lse = fa.flash_attention_forward(q, k, v, causal, kernel="portable")
    for o, lse in _every_scheduler_agrees(q, k, v, causal).values():
        torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    _check_hopper_grads(q, k, v, torch.randn_like(q), causal)
    fwd = "overlap-dynamic-tma-skip" if causal else "pingpong-static"
    assert fa.kernel_plan(q, k, v, "hopper", causal) == f"fwd hopper-{fwd}, bwd hopper"
    assert fa.kernel_plan(q, k, v, causal=causal) == (  # "auto" (the rules)
        f"fwd hopper-{fwd}, bwd hopper")


@pytest.mark.gpu
@on_hopper
def test_auto_picks_each_pass_by_its_rule(monkeypatch):
    """kernel="auto" (the default) runs each pass's Hopper kernel exactly where
    `AUTO_HOPPER` and `AUTO_FORWARD` say: at S = 512, D = 128 with the mask both
    portable kernels; from S = 1024 both Hopper kernels, the forward overlapped under
    the dynamic scheduler up to 2048 (at 1024 with `SHORT_CAUSAL`'s options)."""
    q, k, v, do = (torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    o, lse = fa.flash_attention_forward(q, k, v, True)
    o_p, lse_p = fa.flash_attention_forward(q, k, v, True, kernel="portable")
    assert torch.equal(o, o_p) and torch.equal(lse, lse_p)
    assert fa.kernel_plan(q, k, v, causal=True) == "fwd portable, bwd portable"
    g = fa.flash_attention_backward(do, q, k, v, o_p, lse_p, True)
    g_p = fa.flash_attention_backward(do, q, k, v, o_p, lse_p, True, kernel="portable")
    assert all(torch.equal(a, b) for a, b in zip(g, g_p))
    calls = []  # (the Hopper forward's keywords; with 64-key steps its output may
    real = hopper.forward  # equal the portable one's bit for bit, the same sums)
    monkeypatch.setattr(hopper, "forward", lambda *a, **kw: calls.append(kw) or real(
        *a, **kw))
    for s in (1024, 2048):
        q, k, v, do = (torch.randn(1, 4, s, 128, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        calls.clear()
        o, lse = fa.flash_attention_forward(q, k, v, True)
        o_h, lse_h = fa.flash_attention_forward(q, k, v, True, kernel="hopper")
        assert len(calls) == 2 and calls[0] == calls[1]
        assert calls[0] == dict(schedule="overlap", scheduler="dynamic",
                                **(fa.SHORT_CAUSAL if s == 1024 else {}))
        o_p, lse_p = fa.flash_attention_forward(q, k, v, True, kernel="portable")
        assert len(calls) == 2 and torch.equal(o, o_h) and torch.equal(lse, lse_h)
        torch.testing.assert_close(o.float(), o_p.float(), atol=1e-2, rtol=0)
        assert fa.kernel_plan(q, k, v, causal=True) == (
            "fwd hopper-overlap-dynamic" + ("-tma-k64-s4-skip" if s == 1024 else "")
            + ", bwd hopper")
        g = fa.flash_attention_backward(do, q, k, v, o_p, lse_p, True)
        g_p = fa.flash_attention_backward(do, q, k, v, o_p, lse_p, True, kernel="portable")
        assert torch.equal(g[1], fa.flash_attention_backward(
            do, q, k, v, o_p, lse_p, True, kernel="hopper")[1])
        assert not torch.equal(g[1], g_p[1])
