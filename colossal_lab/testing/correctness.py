"""One correctness rule, shared by the tests and the notebooks.

A fast kernel in bf16 will not match an fp32 reference bit for bit; the question is
whether it is *as good as* the same reference computed in the same low precision. So
(the rule flash-attention's tests use):

    err(fast)  = max |fast - ref_hi|        ref_hi: the reference in fp32 (upcast)
    err(lowp)  = max |ref_lo - ref_hi|      ref_lo: the reference in the fast dtype
    pass  iff  err(fast) <= factor * err(lowp) + atol

With no low-precision reference (fp32 kernels) it falls back to `max|fast-ref| <= atol +
rtol*max|ref|`. Both errors are printed so a reader sees the margin, not just "ok".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Check:
    """One comparison's verdict: both errors, the bound they were held to, and ok."""

    name: str
    err: float
    err_lowp: float | None
    bound: float
    ok: bool

    def __str__(self) -> str:
        lowp = ("" if self.err_lowp is None
                else f", reference in low precision {self.err_lowp:.2e}")
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name:<12} max err {self.err:.2e}{lowp}, bound {self.bound:.2e}: {verdict}"


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| in fp64 (NaN if any element is NaN); the shapes must match."""
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != reference {tuple(b.shape)}")
    diff = (a.detach().double() - b.detach().double()).abs()
    if diff.numel() == 0:
        return 0.0
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item()


def check_close(out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor | None = None,
                *, name: str = "output", atol: float = 1e-5, rtol: float = 1e-5,
                factor: float = 2.0, verbose: bool = False) -> Check:
    """Compare `out` against the high-precision `ref` by the rule above; raise
    `AssertionError` on failure (NaN always fails). Returns the `Check`."""
    err = max_abs_err(out, ref)
    if ref_lowp is not None:
        err_lowp = max_abs_err(ref_lowp, ref)
        bound = factor * err_lowp + atol
    else:
        err_lowp = None
        bound = atol + rtol * ref.detach().abs().max().item() if ref.numel() else atol
    check = Check(name, err, err_lowp, bound, err == err and err <= bound)
    if verbose:
        print(check)
    if not check.ok:
        raise AssertionError(str(check))
    return check


def check_all(outs: dict, refs: dict, refs_lowp: dict | None = None, **kw) -> list[Check]:
    """`check_close` over named pairs, e.g. {"out": y, "dx": x.grad, "dw": w.grad}."""
    refs_lowp = refs_lowp or {}
    return [check_close(outs[k], refs[k], refs_lowp.get(k), name=k, **kw) for k in outs]
