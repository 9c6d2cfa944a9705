"""What machine are we on, what is its peak, and what does it really reach.

MFU divides achieved FLOP/s by a *peak*. Two honest choices matter (BASELINES.md lists
the common mistakes): use the **dense** datasheet figure, never the 2:4-sparse one, and
use the figure **for the dtype the matmuls run in** (bf16 for a bf16 run, not tf32).
Datasheets are upper bounds nobody reaches; so we also measure the *ceilings* this card
really delivers (a large matmul, a large copy) and report MFU against both.
"""

from __future__ import annotations

import platform
import re
from dataclasses import asdict, dataclass

import torch

from colossal_lab.measure.timing import time_fn


@dataclass(frozen=True)
class GPUSpec:
    """Dense datasheet peaks in TFLOP/s (None: no such unit) and memory bandwidth."""

    name: str
    slug: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float
    fp8: float | None
    mem_gbps: float
    source: str
    variants: tuple[str, ...] = ()
    """Form-factor words a device name may add to `name` for this row (upper case),
    e.g. "SXM4", "PCIE" for the A100, whose variants share their compute peaks."""


# Dense (not 2:4-sparse) tensor-core peaks. Where a datasheet prints only the sparse
# figure ("with sparsity"), the dense one is half of it.
GPUS: tuple[GPUSpec, ...] = (
    GPUSpec("NVIDIA H200 NVL", "h200-nvl", 835.5, 835.5, 417.5, 60.0, 1671.0, 4800,
            "NVIDIA H200 NVL datasheet (2024), sparse figures halved"),
    GPUSpec("NVIDIA H200", "h200", 989.4, 989.4, 494.7, 66.9, 1978.9, 4800,
            "NVIDIA H200 SXM datasheet (2024), sparse figures halved", ("SXM",)),
    # GH200's GPU is an H100 SXM (same peaks) with HBM3 (the "480GB" module: 96 GB at
    # 4 TB/s) or HBM3e (144 GB at 4.9 TB/s); by substring it would match the H200 row
    GPUSpec("NVIDIA GH200 144G HBM3e", "gh200-hbm3e", 989.4, 989.4, 494.7, 67.0, 1978.9,
            4900, "NVIDIA GH200 Grace Hopper Superchip datasheet (2024), sparse figures "
            "halved"),
    GPUSpec("NVIDIA GH200", "gh200", 989.4, 989.4, 494.7, 67.0, 1978.9, 4000,
            "NVIDIA GH200 Grace Hopper Superchip datasheet (2023), sparse figures "
            "halved"),
    GPUSpec("NVIDIA H100 NVL", "h100-nvl", 835.5, 835.5, 417.5, 60.0, 1671.0, 3900,
            "NVIDIA H100 NVL datasheet (2023), sparse figures halved"),
    GPUSpec("NVIDIA H100 PCIe", "h100-pcie", 756.5, 756.5, 378.0, 51.2, 1513.0, 2000,
            "NVIDIA H100 PCIe datasheet (2023), sparse figures halved"),
    GPUSpec("NVIDIA H100", "h100-sxm", 989.4, 989.4, 494.7, 66.9, 1978.9, 3350,
            "NVIDIA H100 SXM datasheet (2023), sparse figures halved", ("SXM", "SXM5")),
    GPUSpec("NVIDIA B200", "b200", 2250.0, 2250.0, 1100.0, 80.0, 4500.0, 8000,
            "NVIDIA HGX B200 datasheet (2024), dense figures"),
    GPUSpec("NVIDIA A100", "a100", 312.0, 312.0, 156.0, 19.5, None, 2039,
            "NVIDIA A100 datasheet (2020), dense figures; 80GB SXM bandwidth",
            ("SXM4", "PCIE")),
    GPUSpec("NVIDIA L40S", "l40s", 362.05, 362.05, 183.0, 91.6, 733.0, 864,
            "NVIDIA L40S datasheet (2023), sparse figures halved"),
    GPUSpec("NVIDIA L4", "l4", 121.0, 121.0, 60.0, 30.3, 242.5, 300,
            "NVIDIA L4 datasheet (2023), sparse figures halved"),
    GPUSpec("NVIDIA A10", "a10", 125.0, 125.0, 62.5, 31.2, None, 600,
            "NVIDIA A10 datasheet (2021), dense figures"),
    GPUSpec("NVIDIA GeForce RTX 4090", "rtx4090", 165.2, 165.2, 82.6, 82.6, 330.3, 1008,
            "NVIDIA Ada Lovelace architecture whitepaper, fp32-accumulate figures"),
    GPUSpec("AMD Instinct MI300X", "mi300x", 1307.4, 1307.4, 653.7, 163.4, 2614.9, 5300,
            "AMD Instinct MI300X datasheet (2023), dense figures"),
)

_DTYPE_FIELD = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                "bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "tf32": "tf32",
                "fp8": "fp8"}


_MEMORY_WORD = re.compile(r"\d+GB?|HBM\d*E?")
"""Device-name words that give its memory ("80GB", "144G", "HBM3E"), not its model."""


def _words(name: str) -> list[str]:
    return name.replace("-", " ").upper().split()


def find_spec(device_name: str) -> GPUSpec | None:
    """The table row of `device_name` (as `torch.cuda.get_device_name` spells it), or
    None for a GPU the table does not know.

    Matched by whole words, never by substring ("NVIDIA GH200 480GB" is not an H200,
    "NVIDIA L40S" not an L4): the row's name must be the device name's first words, and
    every further word a memory size or type or one of the row's `variants` (so "NVIDIA
    H100 NVL" is not the H100 SXM row). The first such row wins."""
    words = _words(device_name)
    for spec in GPUS:
        head = _words(spec.name)
        rest = words[len(head):]
        if words[:len(head)] == head and all(
                _MEMORY_WORD.fullmatch(w) or w in spec.variants for w in rest):
            return spec
    return None


@dataclass(frozen=True)
class Device:
    """The device we measure on."""

    kind: str  # "cuda" or "cpu"
    name: str
    count: int
    spec: GPUSpec | None
    capability: tuple[int, int] | None = None

    @property
    def slug(self) -> str:
        """Folder name under `results/` ("h200", "a100", …, "cpu")."""
        if self.spec is not None:
            return self.spec.slug
        if self.kind == "cpu":
            return "cpu"
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")

    def peak_tflops(self, dtype="bf16") -> float | None:
        """Dense datasheet peak for `dtype` ("bf16", "fp16", "tf32", "fp32", "fp8" or a
        torch dtype); None when the datasheet has no such unit or the GPU is unknown."""
        field_name = _DTYPE_FIELD.get(dtype, dtype)
        if self.spec is None:
            return None
        return getattr(self.spec, field_name)

    @property
    def supports_fp8(self) -> bool:
        return self.capability is not None and self.capability >= (8, 9)

    def describe(self) -> str:
        peak = self.peak_tflops("bf16")
        p = f"{peak:g} TFLOP/s dense bf16" if peak else "no datasheet peak"
        return f"{self.count} x {self.name} ({p})"


def detect() -> Device:
    """The current CUDA device (index `torch.cuda.current_device()`), or the CPU."""
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        name = torch.cuda.get_device_name(idx)
        return Device("cuda", name, torch.cuda.device_count(), find_spec(name),
                      torch.cuda.get_device_capability(idx))
    name = platform.processor() or platform.machine() or "cpu"
    return Device("cpu", f"CPU ({name}, {torch.get_num_threads()} threads)", 1, None)


def default_device() -> torch.device:
    """`cuda` when present, else `cpu` (the d2l `try_gpu` helper)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------- ceilings


def measure_matmul_tflops(n: int | None = None, dtype: torch.dtype = torch.bfloat16,
                          device: torch.device | None = None) -> float:
    """Median TFLOP/s of an n×n×n matmul on random data (8192 on a GPU, 1024 on CPU)."""
    device = device or default_device()
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    if device.type == "cpu" and dtype in (torch.float16,):
        dtype = torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_fp8_tflops(n: int = 8192) -> float | None:
    """Median TFLOP/s of an fp8 e4m3 `torch._scaled_mm` (None where fp8 is not there)."""
    if not (torch.cuda.is_available() and detect().supports_fp8):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    t = time_fn(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def measure_copy_gbps(nbytes: int | None = None, device: torch.device | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    device = device or default_device()
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src))
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9


@dataclass(frozen=True)
class Ceilings:
    """What this card measurably reaches, next to its datasheet."""

    matmul_bf16_tflops: float
    matmul_tf32_tflops: float | None
    matmul_fp32_tflops: float
    matmul_fp8_tflops: float | None
    copy_gbps: float


def measure_ceilings() -> Ceilings:
    on_gpu = torch.cuda.is_available()
    tf32 = None
    if on_gpu:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on the tensor cores
        try:
            tf32 = measure_matmul_tflops(dtype=torch.float32)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    fp32 = measure_matmul_tflops(dtype=torch.float32)
    return Ceilings(
        matmul_bf16_tflops=measure_matmul_tflops(dtype=torch.bfloat16),
        matmul_tf32_tflops=tf32,
        matmul_fp32_tflops=fp32,
        matmul_fp8_tflops=measure_fp8_tflops(),
        copy_gbps=measure_copy_gbps(),
    )


def ceilings_row() -> dict:
    """One results row: the device, its datasheet peaks and its measured ceilings."""
    dev = detect()
    return {"gpu": dev.name, "peak_bf16_tflops": dev.peak_tflops("bf16"),
            "peak_fp8_tflops": dev.peak_tflops("fp8"),
            "datasheet_mem_gbps": dev.spec.mem_gbps if dev.spec else None,
            **asdict(measure_ceilings())}
