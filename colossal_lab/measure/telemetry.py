"""What the GPU's clocks and power did while a benchmark ran: `nvidia-smi`, sampled.

A GEMM's rate is not a constant of the card. A GPU runs at the highest clock its power
limit (and temperature) allows; a dense stream of tensor-core GEMMs draws the most
power, so the clock drops while it runs, and the same GEMM between cheap memory-bound
kernels can run faster than in a stream of GEMMs. Chapter 09's profile shows exactly
that: GEMMs of the naive bf16 step above the rate one sustained GEMM reaches. Whether
the clock is the reason is a measurement, not an inference, once each timed row says
what the clock and the power were while its steps ran: `GpuSampler` runs
``nvidia-smi --query-gpu=... --loop-ms=100`` beside the steps, and `fields` summarises the
samples taken after a given moment (the first timed step, so warm-up and compilation
are left out).

No Python dependency: `nvidia-smi` ships with the driver. Where it is missing (a CPU
machine, a container without it) or fails, the row says so in `telemetry` and nothing
else changes: telemetry never fails a benchmark.
"""

from __future__ import annotations

import datetime as _dt
import shutil
import statistics
import subprocess
from dataclasses import dataclass

import torch

QUERY = ("timestamp", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit",
         "temperature.gpu")
"""The `nvidia-smi --query-gpu` fields sampled, in this order."""
INTERVAL_MS = 100
"""Sampling period: ten samples a second; a ~0.3 s training step gets about three."""
TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
"""How `nvidia-smi` writes `timestamp` (the node's local time)."""


@dataclass(frozen=True)
class Sample:
    """One `nvidia-smi` line: when, the SM clock and its maximum (MHz), the board power
    and its limit (W), the temperature (°C). A field the driver reports as "[N/A]" is
    None."""

    at: _dt.datetime
    sm_mhz: float | None
    sm_max_mhz: float | None
    power_w: float | None
    power_limit_w: float | None
    temp_c: float | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse(text: str) -> list[Sample]:
    """The samples in `nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits`
    output; lines that do not parse (a warning, a cut-off last line) are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(QUERY):
            continue
        try:
            at = _dt.datetime.strptime(parts[0], TIME_FORMAT)
        except ValueError:
            continue
        out.append(Sample(at, *(_number(p) for p in parts[1:])))
    return out


def _p(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank, inside the samples)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(samples: list[Sample], since: _dt.datetime | None = None) -> dict:
    """Row fields from the samples taken at or after `since` (all of them when None):
    the SM clock's median, p10 and p90 and its maximum, the median and highest power
    against the limit, the highest temperature, and how many samples. With no sample
    left: `telemetry` says so and nothing else."""
    kept = [s for s in samples if since is None or s.at >= since]
    if not kept:
        return {"telemetry": f"no nvidia-smi sample in the timed steps "
                             f"({len(samples)} before them)"}
    row: dict = {"telemetry": f"nvidia-smi every {INTERVAL_MS} ms, {len(kept)} samples "
                              "in the timed steps"}
    clocks = [s.sm_mhz for s in kept if s.sm_mhz is not None]
    if clocks:
        row.update(sm_clock_mhz=statistics.median(clocks), sm_clock_mhz_p10=_p(clocks, 0.1),
                   sm_clock_mhz_p90=_p(clocks, 0.9))
    top = [s.sm_max_mhz for s in kept if s.sm_max_mhz is not None]
    if top:
        row["sm_clock_max_mhz"] = max(top)
    power = [s.power_w for s in kept if s.power_w is not None]
    if power:
        row.update(power_w=statistics.median(power), power_w_max=max(power))
    limit = [s.power_limit_w for s in kept if s.power_limit_w is not None]
    if limit:
        row["power_limit_w"] = max(limit)
    temps = [s.temp_c for s in kept if s.temp_c is not None]
    if temps:
        row["temp_c_max"] = max(temps)
    return row


def _gpu_id(device: torch.device) -> str | None:
    """How `nvidia-smi --id` names this CUDA device: its UUID (CUDA_VISIBLE_DEVICES
    renumbers devices, the UUID does not), or None when torch does not report one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class GpuSampler:
    """``with GpuSampler(device) as s: ...`` samples the GPU's clocks and power with
    `nvidia-smi` while the block runs; `s.fields(since)` are the row fields
    (`summarize`). On a CPU, without `nvidia-smi`, or when it fails, `fields` holds
    only `telemetry` with the reason."""

    def __init__(self, device: torch.device | str, interval_ms: int = INTERVAL_MS):
        self.device = torch.device(device)
        self.interval_ms = interval_ms
        self.samples: list[Sample] = []
        self.why: str | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        if self.device.type != "cuda":
            self.why = f"unavailable: {self.device.type} device"
            return self
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.why = "unavailable: no nvidia-smi on PATH"
            return self
        cmd = [exe, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits",
               f"--loop-ms={self.interval_ms}"]
        gpu = _gpu_id(self.device)
        if gpu is not None:
            cmd.append(f"--id={gpu}")
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self.why = f"unavailable: nvidia-smi did not start ({e})"
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = parse(out or "")
        if not self.samples:
            first = (out or "").strip().splitlines()[:1]
            said = first[0][:120] if first else "no output"
            self.why = f"unavailable: nvidia-smi gave no samples ({said})"

    def fields(self, since: _dt.datetime | None = None) -> dict:
        """Row fields of the samples at or after `since` (local time, as `nvidia-smi`
        writes it: `now()` at the first timed step)."""
        if self.why is not None:
            return {"telemetry": self.why}
        return summarize(self.samples, since)


def now() -> _dt.datetime:
    """The local wall-clock time, comparable with `nvidia-smi`'s timestamps."""
    return _dt.datetime.now()
