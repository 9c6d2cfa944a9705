"""The embedding's backward (`kernels.embedding`, `switches.embedding`): ours against
torch's on random ids with repeats, unused rows, odd widths and a padding row; the
switch dispatches, keeps torch's path where ours does not apply, and is refused under
tensor parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.config import Switches
from colossal_lab.kernels import embedding as kernel
from colossal_lab.ops import embedding
from colossal_lab.switches import embedding as embedding_switch
from colossal_lab.testing.correctness import check_close
from tests.conftest import count_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {  # (V, d, id shape): d over one column block (1500, 2 programs a row), odd d
    "small": (11, 8, (3, 5)),
    "odd": (301, 37, (2, 19)),
    "wide": (50, 1500, (4, 33)),
    "1d-few-rows": (5, 24, (64,)),  # every row used many times
}


def _ref_grad(ids, w, dy, padding_idx=None):
    """torch's gradient of W[ids] in fp64."""
    w64 = w.detach().double().requires_grad_()
    F.embedding(ids, w64, padding_idx=padding_idx).backward(dy.double())
    return w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_backward_matches_torch(case, dtype, monkeypatch):
    """dW against fp64 sums; bf16 by the 2x rule against torch's own bf16 gradient.
    Some rows are unused (their gradient must be zero, written by the kernel)."""
    V, d, shape = case
    torch.manual_seed(0)
    ids = torch.randint(0, max(1, V - 2), shape, device=DEVICE)  # the last rows unused
    w = (torch.randn(V, d, device=DEVICE) * 0.5).to(dtype).requires_grad_()
    dy = torch.randn(*shape, d, device=DEVICE).to(dtype)
    launches = count_launches(monkeypatch, kernel._embedding_backward_kernel)
    y = kernel.embedding_triton(ids, w)
    assert torch.equal(y, F.embedding(ids, w))  # the forward is torch's gather
    y.backward(dy)
    assert launches == {"_embedding_backward_kernel": 1}
    ref = _ref_grad(ids, w, dy)
    lowp = None
    if dtype != torch.float32:
        w2 = w.detach().clone().requires_grad_()
        F.embedding(ids, w2).backward(dy)
        lowp = w2.grad
    assert w.grad.dtype == dtype
    check_close(w.grad, ref.to(dtype) if lowp is None else ref, lowp, name="dW",
                atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.count_nonzero(w.grad[V - 2:]) == 0


def test_padding_row_int32_ids_and_determinism():
    """The padding row gets a zero gradient though it is looked up; int32 ids work; two
    runs give bit-equal gradients (sums in token order)."""
    V, d = 17, 40
    ids = torch.randint(0, V, (3, 29), device=DEVICE, dtype=torch.int32)
    ids[0, :5] = 4
    dy = torch.randn(3, 29, d, device=DEVICE)
    w = torch.randn(V, d, device=DEVICE)
    grads = []
    for _ in range(2):
        wp = w.clone().requires_grad_()
        kernel.embedding_triton(ids, wp, padding_idx=4).backward(dy)
        grads.append(wp.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.count_nonzero(grads[0][4]) == 0
    check_close(grads[0], _ref_grad(ids.long(), w, dy, padding_idx=4).float(), name="dW")


def test_bad_inputs_are_refused():
    w = torch.randn(5, 4, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="integer tensor"):
        kernel.embedding_triton(torch.zeros(3, device=DEVICE), w)
    with pytest.raises(ValueError, match="expected \\(V, d\\)"):
        kernel.embedding_triton(torch.zeros(3, dtype=torch.long, device=DEVICE),
                                torch.randn(5, device=DEVICE))
    with pytest.raises(ValueError, match="rows for"):
        kernel.embedding_backward(torch.randn(4, 3, device=DEVICE),
                                  torch.zeros(5, dtype=torch.long, device=DEVICE), 5,
                                  torch.float32)
    with pytest.raises(ValueError, match="enable_fused_embedding"):
        embedding_switch.apply(nn.Linear(2, 2), "fast")


def test_switch_dispatches_and_keeps_torch_where_ours_does_not_apply(monkeypatch):
    """"triton" runs our backward; a module with max_norm or scale_grad_by_freq, and
    "eager", run the module's own call (no launch), with torch's gradient."""
    launches = count_launches(monkeypatch, kernel._embedding_backward_kernel)
    ids = torch.randint(0, 9, (2, 7), device=DEVICE)
    for module, backend, expect in (
            (nn.Embedding(9, 6), "triton", 1),
            (nn.Embedding(9, 6, scale_grad_by_freq=True), "triton", 0),
            (nn.Embedding(9, 6, max_norm=1.0), "triton", 0),
            (nn.Embedding(9, 6), "eager", 0)):
        module = module.to(DEVICE)
        launches.clear()
        out = embedding.lookup(ids, module, backend)
        out.sum().backward()
        assert launches.get("_embedding_backward_kernel", 0) == expect, module
        ref = torch.zeros_like(module.weight)
        if not module.scale_grad_by_freq:
            ref.index_add_(0, ids.flatten(), torch.ones(ids.numel(), 6, device=DEVICE))
            check_close(module.weight.grad, ref, name="dW")


def test_tensor_parallel_refuses_the_switch(monkeypatch):
    """TP shards the embedding through the module's call: the switch is refused with a
    one-line reason before anything changes."""
    from colossal_lab.config import tiny
    from colossal_lab.model import build_model
    from colossal_lab.switches.apply import _check_tensor_parallel

    class Mesh:  # what `_check_tensor_parallel` reads of a 2-way "tp" mesh
        mesh_dim_names = ("tp",)

        def __getitem__(self, name):
            return self

        def size(self):
            return 2

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    sw = Switches.naive("fp32").replace(enable_fused_embedding=True)
    with pytest.raises(ValueError, match="turn enable_fused_embedding off"):
        _check_tensor_parallel(build_model(tiny(), "cpu"), sw, Mesh())
