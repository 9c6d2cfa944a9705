"""Roofline points from recorded profiles (`book.profiled`) and cuDNN attention's count
(`measure.roofline.op_cost`), on the CPU."""

import pytest

from colossal_lab.book import profiled
from colossal_lab.measure.roofline import op_cost

B, H, S, D = 4, 32, 4096, 128


def test_op_cost_counts_cudnn_attention_as_attention():
    q = [B, H, S, D]
    fwd = op_cost("aten::_cudnn_attention_forward",
                  {"Input Dims": [q, q, q], "Input type": ["c10::BFloat16"] * 3})
    assert fwd[0] == pytest.approx(2.0 * B * H * S * S * D)  # causal 4·B·H·S²·D·½
    bwd = op_cost("aten::_cudnn_attention_backward",
                  {"Input Dims": [q, q, q, q, q], "Input type": ["c10::BFloat16"] * 5})
    assert bwd[0] == pytest.approx(2.5 * fwd[0])


@pytest.mark.parametrize("name, factor", [("aten::_cudnn_attention_forward", 1.0),
                                          ("aten::_cudnn_attention_backward", 2.5)])
def test_an_estimated_attention_row_is_recounted(name, factor):
    calls, numel = 8.0, B * H * S * D
    row = {"kind": "op", "setup": "x", "name": name, "kernel_class": "attention",
           "calls": calls, "ms": 10.0, "flops": calls * numel,
           "bytes": calls * 4 * numel * 2, "seq_len": S, "precision": "bf16-pure"}
    (p,) = profiled.points([row], "x")
    assert p.flops == pytest.approx(factor * calls * 2.0 * B * H * S * S * D)
    assert p.intensity > 100


def test_other_rows_stay_as_recorded():
    row = {"kind": "op", "setup": "x", "name": "aten::mm", "kernel_class": "GEMM",
           "calls": 1.0, "ms": 1.0, "flops": 2e12, "bytes": 1e9, "seq_len": S}
    (p,) = profiled.points([row], "x")
    assert (p.flops, p.bytes) == (2e12, 1e9)
