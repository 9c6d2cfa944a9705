"""`kernels.native`: RMSNorm's per-call work in C++, replaying the launches the Python
path registered. On a CPU the extension is built and its launches are recorded instead
of made (dry run): the tests check that it hands each kernel exactly the arguments the
Python path passed, forward and backward; on a GPU, that results are bit-equal."""

import os
import struct
import subprocess
import sys

import pytest
import torch

from colossal_lab.kernels import native
from colossal_lab.kernels import rms_norm as rk

PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .f32 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3,
	.param .u64 .ptr .global .align 1 k_param_4
)
.reqntid 128, 1, 1
{
	.param .u32 other;
"""


def test_ptx_params_reads_the_entry_only():
    assert native.ptx_params(PTX) == ("u64", "u32", "f32", "u64", "u64")
    assert native.ptx_params("no entry here") == ()


def test_kernel_params_map_arguments_to_parameters():
    t = torch.empty(4)
    # a tensor, an int, an int equal to 1 (compiled in by Triton), a float; two scratch
    assert native.kernel_params((t, 7, 1, 0.5), (3, None, None, None), PTX) == [
        ("t", 3), ("i", 7), ("f", 0), ("n", 0), ("n", 0)]
    assert native.kernel_params((t, 7, 2, 0.5), (3,), PTX) is None  # one too many
    assert native.kernel_params((t, 0.5, 7), (3,), PTX) is None  # types out of order
    assert native.kernel_params((t, 7, 0.5), (None,), PTX) is None  # unknown tensor


@pytest.fixture(scope="module")
def mod():
    m = native.module()
    assert m is not None, native.why_not()  # a C++ compiler is part of the set-up
    m.clear()
    m.set_dry_run(True)
    yield m
    m.set_dry_run(False)
    m.clear()


def _fake_ptx(args) -> str:
    """PTX parameters as Triton declares them for `args` (ints equal to 1 compiled in),
    plus its two scratch pointers."""
    types = []
    for a in args:
        if isinstance(a, torch.Tensor):
            types.append("u64")
        elif isinstance(a, float):
            types.append("f32")
        elif a != 1:
            types.append("u32")
    types += ["u64", "u64"]
    return ".entry k(" + ",".join(f".param .{t} p{i}" for i, t in enumerate(types)) + ")"


def _register_from_python_path(mod, x, w, eps):
    """Run the Python path once, capturing its launches, and register them the way
    `rms_norm._native_hook` does (with stand-in PTX and function handles)."""
    launches = []

    def capture(kernel, grid, args, key):
        launches.append((kernel, grid, args))

    x2d = x.detach().reshape(-1, x.shape[-1])
    y, _, rstd = rk._forward(x2d, None, w.detach(), eps, None, capture)
    dy = torch.randn_like(x2d)
    rk._backward(dy, x2d, w.detach(), rstd, None, None, None, None, on_launch=capture)
    where = {rk._rms_norm_forward_kernel: ("forward", (0, 0, 1, 2, 2, 3)),
             rk._rms_norm_backward_kernel: ("backward", (0, 1, 2, 3, 0, 4, 5)),
             rk._rms_norm_partials_sum_kernel: ("sum", (5, 6, 6))}
    for i, (kernel, grid, args) in enumerate(launches):
        which, slots = where[kernel]
        params = native.kernel_params(args, slots, _fake_ptx(args))
        assert params is not None, which
        mod.set_launch(mod.key_of(x2d, w), which, 1000 + i, list((*grid, 1, 1)[:3]), 128, 0,
                       params, grid[0] if which == "backward" else 0)
    return launches


def test_native_path_hands_kernels_the_python_paths_arguments(mod):
    eps = 1e-5
    x = torch.randn(5, 3, 72, requires_grad=True)
    w = torch.randn(72, requires_grad=True)
    assert mod.rms_norm(x, w, eps) is None  # no plan yet: the caller takes Python
    launches = _register_from_python_path(mod, x, w, eps)
    mod.set_dry_run(True)  # clears the record
    y = mod.rms_norm(x, w, eps)
    assert y is not None and y.shape == x.shape and y.dtype == x.dtype
    assert "RMSNormNative" in y.grad_fn.name()
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    (f_fn, f_grid, f_threads, _, fwd), (b_fn, _, _, _, bwd), (s_fn, _, _, _, sm) = \
        mod.recorded()
    assert (f_fn, b_fn, s_fn) == (1000, 1001, 1002)  # forward, backward, sum: in order
    assert f_grid == list((*launches[0][1], 1, 1)[:3]) and f_threads == 128

    ptr = {"x": x.data_ptr(), "w": w.data_ptr(), "y": y.data_ptr(), "dy": dy.data_ptr(),
           "dx": dx.data_ptr(), "dw": dw.data_ptr()}

    def expect(args, names):
        """(kind, value) the kernel must get for the Python path's `args`, with the
        tensors the native path allocated in place of the Python path's."""
        out, names = [], iter(names)  # one name per tensor argument
        for a in args:
            if isinstance(a, torch.Tensor):
                name = next(names)
                out.append(("t", ptr[name]) if name in ptr else ("t", None))
            elif isinstance(a, float):
                out.append(("f", struct.unpack("<I", struct.pack("<f", eps))[0]))
            elif a != 1:
                out.append(("i", a))
        return out + [("n", 0), ("n", 0)]

    def same(got, want):
        assert len(got) == len(want)
        for (k, v), (k2, v2) in zip(got, want):
            assert k == k2 and (v2 is None or v == v2), (got, want)

    same(fwd, expect(launches[0][2], ("x", "x", "w", "y", "y", "rstd")))
    same(bwd, expect(launches[1][2], ("dy", "x", "w", "rstd", "dy", "dx", "partials")))
    same(sm, expect(launches[2][2], ("partials", "dw", "dw")))
    assert fwd[5][1] == bwd[3][1]  # the rstd the forward wrote is what backward reads
    assert bwd[6][1] == sm[0][1]  # the partials the backward wrote are what sum reads


def test_native_path_declines_what_it_has_no_plan_for(mod):
    x, w = torch.randn(4, 72), torch.randn(72)
    _register_from_python_path(mod, x, w, 1e-6)
    assert mod.rms_norm(x, w, 1e-6) is not None
    assert mod.rms_norm(torch.randn(6, 72), w, 1e-6) is None  # another shape
    assert mod.rms_norm(torch.randn(72, 4).t(), w, 1e-6) is None  # not contiguous
    assert mod.rms_norm(x.double(), w, 1e-6) is None  # another dtype
    assert mod.rms_norm(x, torch.randn(144)[::2], 1e-6) is None  # w not contiguous


def test_on_by_default_off_by_environment_and_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(native, "INTERPRET", False)
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.requested()
    with native.disabled():
        assert not native.requested()
        with native.forced():
            assert native.requested()
        assert not native.requested()
    assert native.requested()
    for off in ("0", "off", "False"):
        monkeypatch.setenv(native.ENV, off)
        assert not native.requested()
    with native.forced():
        assert native.requested()
    monkeypatch.setenv(native.ENV, "1")
    assert native.requested()
    x, w = torch.randn(3, 40), torch.randn(40)
    assert native.rms_norm(x, w, 1e-6) is None  # CPU tensors: always the Python path
    monkeypatch.setattr(native, "INTERPRET", True)
    assert not native.requested()
    with native.forced():
        assert not native.requested()


def test_arguments_match_a_kernel_compiled_for_sm90():
    """The argument list the Python path passes, mapped by `kernel_params`, against the
    parameters of the forward and backward kernels compiled for sm_90 (Triton's real
    calling convention, scratch pointers included), in a process without the
    interpreter."""
    code = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from colossal_lab.kernels import native, rms_norm as rk

def compile_for(kernel, args, constexprs):
    sig, consts = {}, dict(constexprs)
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32"}[a.dtype]
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif a == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
    for name in constexprs:
        sig[name] = "constexpr"
    src = ASTSource(kernel, sig, consts, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

x = torch.empty(1, 3000, dtype=torch.bfloat16)  # one row: n_rows == 1 is compiled in
w = torch.empty(3000, dtype=torch.bfloat16)
y, rstd = torch.empty_like(x), torch.empty(1)
grid, ints, cx, warps, key = rk._forward_plan(1, 3000, 3000, 3000, False,
    (x.dtype, x.dtype, w.dtype, x.dtype), (True, True, True), None)
args = (x, x, w, y, y, rstd, *ints, 1e-6)
ptx = compile_for(rk._rms_norm_forward_kernel, args, cx).asm["ptx"]
params = native.kernel_params(args, (0, 0, 1, 2, 2, 3), ptx)
assert params is not None, native.ptx_params(ptx)
assert params[-2:] == [("n", 0), ("n", 0)] and ("i", 1) not in params, params
print("ok", len(params))
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def _saved_shapes(fn):
    """(shape, dtype) of every tensor autograd saves while `fn` runs."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_native_path_saves_what_the_python_path_saves(mod):
    """A checkpointed layer's first forward may run in Python (registering the plan) and
    its recomputation in C++: torch.utils.checkpoint compares the tensors each saved."""
    eps = 1e-6
    x = torch.randn(2, 3, 72, requires_grad=True)
    w = torch.randn(72, requires_grad=True)
    python = _saved_shapes(lambda: rk.TritonRMSNormFunction.apply(x, w, eps))
    _register_from_python_path(mod, x, w, eps)
    cpp = _saved_shapes(lambda: mod.rms_norm(x, w, eps))
    assert cpp == python and len(python) == 3

    calls = []

    def layer(x):  # Python the first time, C++ when checkpoint recomputes it
        calls.append("C++" if calls else "Python")  # (the recomputation stops early)
        if len(calls) == 1:
            return rk.TritonRMSNormFunction.apply(x, w, eps)
        return mod.rms_norm(x, w, eps)

    mod.set_dry_run(True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    dx, = torch.autograd.grad(y, x, torch.randn_like(y))  # raised CheckpointError before
    assert calls == ["Python", "C++"] and dx.shape == x.shape
    # the recomputed forward launched from C++; the backward is the Python node's
    assert [r[0] for r in mod.recorded()] == [1000]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_native_path_on_gpu_equals_the_python_path(monkeypatch):
    """First call: Python (registers); second: C++. Bit-equal outputs and gradients."""
    monkeypatch.setenv(native.ENV, "1")
    assert native.module() is not None, native.why_not()
    for shape, dtype in (((4, 1000, 3000), torch.bfloat16), ((64, 4096), torch.float32)):
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        outs = []
        for _ in range(3):
            y = rk.rms_norm_triton(x, w)
            outs.append((y.grad_fn.name(), y, *torch.autograd.grad(y, (x, w), dy)))
        assert "RMSNormNative" not in outs[0][0] and "RMSNormNative" in outs[2][0]
        for got, want in zip(outs[2][1:], outs[0][1:]):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_native_path_is_the_default_and_its_plan_completes_outside_the_choice(monkeypatch):
    """By default (no environment) the second call of a shape runs in C++; a plan also
    completes when the backward runs after the block that chose the path has ended
    (the benchmark's calls: forward inside `forced()`, `autograd.grad` outside)."""
    monkeypatch.delenv(native.ENV, raising=False)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    names = []
    for _ in range(3):
        y = rk.rms_norm_triton(x, w)
        names.append(y.grad_fn.name())
        torch.autograd.grad(y, (x, w), dy)
    assert "RMSNormNative" not in names[0] and "RMSNormNative" in names[2], names
    x2 = torch.randn(24, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with native.disabled():
        y = rk.rms_norm_triton(x2, w2)  # the Python path: no plan registered
    torch.autograd.grad(y, (x2, w2), torch.randn_like(y))
    for _ in range(2):
        with native.forced():
            y = rk.rms_norm_triton(x2, w2)
        torch.autograd.grad(y, (x2, w2), torch.randn_like(y))
    with native.forced():
        assert "RMSNormNative" in rk.rms_norm_triton(x2, w2).grad_fn.name()


def test_a_build_lock_left_by_an_interrupted_build_is_removed(tmp_path):
    """torch's lock file outlives a build that was killed; without this every later
    process would wait for it forever."""
    (tmp_path / "lock").write_text("")
    with native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").write_text("")  # the live build's own lock stays
    assert (tmp_path / "lock").exists()
