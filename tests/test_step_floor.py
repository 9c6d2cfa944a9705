"""The step's floor (`benchmarks.step_floor`) on the CPU: the GEMM list is the step's,
AdamW's bytes follow the kernel's table, and the rows sum to the floor."""

from __future__ import annotations

import pytest

from colossal_lab.benchmarks import step_floor
from colossal_lab.config import SWITCH_SETS, preset
from colossal_lab.measure import mfu


def test_step_gemms_hold_the_step_matmul_flops():
    """Forward, input and weight gradients of every linear and the head: three times
    the forward's 2·tokens·(matmul parameters) FLOPs."""
    cfg, tokens = preset("tiny"), 2 * 64
    gemms = step_floor.step_gemms(cfg, tokens)
    flops = sum(2 * m * n * k for _, m, n, k in gemms)
    assert flops == 3 * 2 * tokens * mfu.matmul_params(cfg)
    assert len(gemms) == 3 * 4 * cfg.num_hidden_layers + 3 * len(
        [g for g in gemms if g[0] == "head.fwd"])


@pytest.mark.parametrize("switches, want", [
    (SWITCH_SETS["best"], 26 + 2), (SWITCH_SETS["best-bf16-moments"], 18 + 2),
    (SWITCH_SETS["best-fp8"], 26 + 2), (SWITCH_SETS["best-fp8-fp32-params"], 32)])
def test_adamw_bytes_follow_the_kernel_table(switches, want):
    """bf16 parameters with a split master and fp32 moments move 26 bytes in the update
    and 2 in the norm pass; bf16 moments 8 fewer; fp32 parameters (fp8 linears over fp32
    weights) 32; fp8 linears over bf16 parameters as bf16."""
    assert step_floor.adamw_bytes(switches) == want


def test_quick_floor_parts_and_summary():
    rows = step_floor.run(quick=True, with_steps=False)
    parts = [r["part"] for r in rows]
    assert parts == ["gemm", "attention", "optimizer"]  # no fp8 on a CPU
    assert all(r["ms"] > 0 and r["kind"] == "floor" for r in rows)
    assert step_floor.floor_ms(rows, "bf16") == pytest.approx(sum(r["ms"] for r in rows))
    step = {"kind": "step", "setup": "ours-bf16", "step_ms": 2 * step_floor.floor_ms(
        rows, "bf16")}
    assert "2.00x" in step_floor.summary(rows + [step])
