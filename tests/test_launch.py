"""`kernels.launch`: the direct launch path keyed at least as finely as Triton's own
specialisation, the interpreter untouched, and (on a GPU) bit-equal results."""

import pytest
import torch

from colossal_lab.kernels import INTERPRET, launch
from colossal_lab.kernels.rms_norm import rms_norm_triton


def test_spec_tells_apart_what_triton_specialises_on():
    t = torch.zeros(64, dtype=torch.bfloat16)
    s = launch._spec((t, t[1:], t.float(), 16, 17, 1, 1 << 40, 0.5, True))
    assert s[0] == (torch.bfloat16, True) and s[1] == (torch.bfloat16, False)  # 2-byte offset
    assert s[2][0] == torch.float32
    assert s[3] == (True, False, True) and s[4] == (False, False, True)  # divisible by 16
    assert s[5] == (False, True, True) and s[6] == (True, False, False)  # 1; past 32 bits
    assert s[7] == "f" and s[8] == ("b", True)
    assert launch._spec((16,)) != launch._spec((32 + 1,))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's path")
def test_interpreter_launches_through_the_jit(monkeypatch):
    monkeypatch.setattr(launch, "CACHE", {})
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    rms_norm_triton(x, w).sum().backward()
    assert launch.CACHE == {} and x.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_direct_launches_match_the_jit_bit_for_bit(monkeypatch):
    x = torch.randn(1000, 3000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def run():
        return (rms_norm_triton(x, w), *torch.autograd.grad(rms_norm_triton(x, w), (x, w), dy))

    monkeypatch.setattr(launch, "_fast", False)
    ref = run()
    monkeypatch.setattr(launch, "_fast", True)
    monkeypatch.setattr(launch, "CACHE", {})
    run()  # compiles (or finds) and fills the cache
    assert len(launch.CACHE) == 3  # forward, backward, dweight sum
    for got, want in zip(run(), ref):  # every launch from the cache now
        assert torch.equal(got, want)
    assert launch._fast  # the direct path took every call


def test_no_hooks_tells_empty_chains_from_listeners():
    from triton.knobs import HookChain

    chain = HookChain()
    assert launch._no_hooks(None) and launch._no_hooks(chain)
    chain.add(print)
    assert not launch._no_hooks(chain)
    assert not launch._no_hooks(print)  # an old-style single hook


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_launches_still_call_a_profilers_hook(monkeypatch):
    """A launch hook added after a kernel was cached (e.g. by a profiler) is called on
    every later launch: the runner then goes through Triton's own path. The norm on
    its Python path (the C++ one, `kernels.native`, launches without Triton's hooks)
    and the optimizer's two kernels."""
    from triton import knobs

    from colossal_lab.kernels import adamw, native

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    p = torch.nn.Parameter(torch.randn(300, device="cuda", dtype=torch.bfloat16))
    opt = adamw.FusedAdamW([p])

    def run():
        with native.disabled():
            rms_norm_triton(x, w).sum().backward()
        p.grad = torch.randn_like(p)
        opt.clip_grad_norm_(1.0)
        opt.step()

    run()  # cached now
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        run()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    for name in ("_rms_norm_forward_kernel", "_rms_norm_backward_kernel",
                 "_sum_squares_kernel", "_adamw_kernel"):
        assert name in seen, (name, seen)
    assert launch._fast


def test_callers_keys_are_as_fine_as_tritons_specialisation(monkeypatch):
    """The norms pass their own launch key (a cached plan's) instead of `_spec(args)`:
    whatever shapes, strides, offsets and dtypes come in, launches with equal keys
    specialise alike (equal `_spec`, constexprs and warps), so a cached compiled kernel
    is never reused where Triton would have compiled another."""
    from colossal_lab.kernels import _norm_common, layer_norm, native, rms_norm

    seen: dict = {}
    real = launch.launch

    def spy(kernel, grid, args, constexprs, *, num_warps, num_stages=None, key=None):
        if key is not None:
            spec = (launch._spec(args), tuple(constexprs.items()), num_warps, num_stages)
            assert seen.setdefault((kernel, key), spec) == spec, kernel
        return real(kernel, grid, args, constexprs, num_warps=num_warps,
                    num_stages=num_stages, key=key)

    for module in (rms_norm, layer_norm, _norm_common):
        monkeypatch.setattr(module, "launch", spy)
    monkeypatch.setenv(native.ENV, "0")  # the Python launches (the C++ path has none)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
    gen = torch.Generator().manual_seed(0)
    for rows, cols, offset, dtype in [(5, 1001, 0, torch.float32), (7, 1009, 1, torch.float32),
                                      (3, 1001, 3, torch.bfloat16), (9, 64, 0, torch.float32),
                                      (1, 64, 1, torch.float32), (16, 48, 2, torch.bfloat16),
                                      (5, 1009, 0, torch.float32), (20, 1001, 0, torch.float32)]:
        base = torch.randn(rows * cols + offset, generator=gen).to(dev, dtype)
        x = base[offset:].view(rows, cols).requires_grad_()  # offset: unaligned pointer
        w = torch.randn(cols, generator=gen).to(dev).requires_grad_()
        b = torch.randn(cols, generator=gen).to(dev).requires_grad_()
        rms_norm.rms_norm_triton(x, w).sum().backward()
        layer_norm.layer_norm_triton(x, w, b).sum().backward()
        y, h = rms_norm.add_rms_norm_triton(x, x.detach() * 2, w)
        (y.sum() + h.sum()).backward()
    assert len({k[0] for k in seen}) == 5  # rms fwd, bwd, ln fwd, bwd, partials sum
