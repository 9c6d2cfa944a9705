import pytest
import torch

from colossal_lab.measure import hardware


@pytest.mark.parametrize("name,slug,bf16", [
    ("NVIDIA H200", "h200", 989.4),
    ("NVIDIA H200 NVL", "h200-nvl", 835.5),
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.4),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm", 989.4),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.5),
    ("NVIDIA H100 NVL", "h100-nvl", 835.5),
    ("NVIDIA GH200 480GB", "gh200", 989.4),
    ("NVIDIA GH200 144G HBM3e", "gh200-hbm3e", 989.4),
    ("NVIDIA A100-SXM4-80GB", "a100", 312.0),
    ("NVIDIA A100-SXM4-40GB", "a100", 312.0),
    ("NVIDIA A100-PCIE-40GB", "a100", 312.0),
    ("NVIDIA A100 80GB PCIe", "a100", 312.0),
    ("NVIDIA L40S", "l40s", 362.05),
    ("NVIDIA GeForce RTX 4090", "rtx4090", 165.2),
])
def test_peak_table(name, slug, bf16):
    spec = hardware.find_spec(name)
    assert spec is not None and spec.slug == slug and spec.bf16 == bf16
    dev = hardware.Device("cuda", name, 1, spec, (9, 0))
    assert dev.peak_tflops(torch.bfloat16) == bf16
    assert dev.peak_tflops("tf32") < bf16  # never divide a bf16 run by the tf32 peak


def test_dense_not_sparse():
    # the 1979 TFLOP/s often quoted for H100/H200 bf16 is the 2:4-sparse figure
    assert hardware.find_spec("NVIDIA H200").bf16 < 1000
    assert hardware.find_spec("NVIDIA A100").fp8 is None


@pytest.mark.parametrize("name", [
    "Some Future Accelerator 9000",
    "NVIDIA H20",              # not an H200
    "NVIDIA H800",             # not an H100 (other interconnect, other peaks)
    "NVIDIA A800-SXM4-80GB",   # not an A100
    "NVIDIA L40",              # not an L4, nor an L40S
    "NVIDIA H100 NVL2",        # an unknown variant gets no row, not the SXM one
    "NVIDIA GH200X",
])
def test_unknown_gpus_get_no_peak(name):
    """Whole-word matching: a name the table does not know gives None (MFU against the
    measured ceiling), never the row of a GPU whose name it contains."""
    assert hardware.find_spec(name) is None
    dev = hardware.Device("cuda", name, 1, hardware.find_spec(name))
    assert dev.peak_tflops() is None


def test_unknown_gpu_and_cpu():
    assert hardware.find_spec("Some Future Accelerator 9000") is None
    dev = hardware.Device("cuda", "Some Future Accelerator 9000", 1, None)
    assert dev.peak_tflops("bf16") is None and dev.slug == "some-future-accelerator-9000"
    here = hardware.detect()
    if here.kind == "cpu":
        assert here.slug == "cpu" and here.peak_tflops() is None
        assert not here.supports_fp8


def test_ceilings_measure_something():
    assert hardware.measure_matmul_tflops(n=256, dtype=torch.float32) > 0
    assert hardware.measure_copy_gbps(nbytes=8 << 20) > 0
