"""GPU telemetry: `nvidia-smi` lines parse into samples, the summary keeps only the
timed steps' samples, and a machine without a GPU or without `nvidia-smi` gets a row
field that says so instead of an error."""

from __future__ import annotations

import datetime as dt
import os
import stat
import time

import pytest
import torch

from colossal_lab.measure import telemetry

LINES = """2026/12/02 06:55:12.100, 1980, 1980, 300.5, 700.00, 41
2026/12/02 06:55:12.200, 1755, 1980, 699.1, 700.00, 55
2026/12/02 06:55:12.300, 1740, 1980, 700.2, 700.00, 57
2026/12/02 06:55:12.400, 1770, 1980, [N/A], 700.00, 58
a warning line the driver printed
2026/12/02 06:55:12.5"""


def test_parse_skips_what_is_not_a_sample():
    samples = telemetry.parse(LINES)
    assert len(samples) == 4
    assert samples[0].at == dt.datetime(2026, 12, 2, 6, 55, 12, 100000)
    assert samples[1].sm_mhz == 1755 and samples[1].power_limit_w == 700
    assert samples[3].power_w is None  # "[N/A]"


def test_summary_keeps_the_timed_steps_only():
    samples = telemetry.parse(LINES)
    row = telemetry.summarize(samples, since=dt.datetime(2026, 12, 2, 6, 55, 12, 150000))
    assert row["sm_clock_mhz"] == 1755 and row["sm_clock_mhz_p10"] == 1740
    assert row["sm_clock_mhz_p90"] == 1770 and row["sm_clock_max_mhz"] == 1980
    assert row["power_w"] == pytest.approx(699.65) and row["power_w_max"] == 700.2
    assert row["power_limit_w"] == 700 and row["temp_c_max"] == 58
    assert "3 samples" in row["telemetry"]
    whole = telemetry.summarize(samples)
    assert whole["sm_clock_mhz_p90"] == 1980 and "4 samples" in whole["telemetry"]
    late = telemetry.summarize(samples, since=dt.datetime(2026, 12, 2, 7))
    assert list(late) == ["telemetry"] and "4 before" in late["telemetry"]


def test_cpu_device_says_unavailable():
    with telemetry.GpuSampler("cpu") as s:
        pass
    assert s.fields() == {"telemetry": "unavailable: cpu device"}


def _fake_nvidia_smi(tmp_path, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_sampler_reads_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi that prints the lines and then waits to be stopped, as
    the real one loops: the sampler stops it and parses what it wrote."""
    lines = "\n".join(LINES.splitlines()[:4])
    path = _fake_nvidia_smi(tmp_path, f"cat <<'X'\n{lines}\nX\nexec sleep 30")
    monkeypatch.setenv("PATH", path + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(telemetry, "_gpu_id", lambda device: "GPU-test")
    with telemetry.GpuSampler(torch.device("cuda", 0)) as s:
        time.sleep(1.0)  # the steps run; the stand-in prints meanwhile
    fields = s.fields(dt.datetime(2026, 12, 2, 6, 55, 12, 150000))
    assert fields["sm_clock_mhz"] == 1755 and "3 samples" in fields["telemetry"]


def test_sampler_reports_a_failing_nvidia_smi(tmp_path, monkeypatch):
    path = _fake_nvidia_smi(tmp_path, "echo 'Failed to initialize NVML: Driver mismatch'")
    monkeypatch.setenv("PATH", path + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(telemetry, "_gpu_id", lambda device: None)
    with telemetry.GpuSampler(torch.device("cuda", 0)) as s:
        time.sleep(0.5)
    assert s.fields()["telemetry"].startswith("unavailable: nvidia-smi gave no samples "
                                              "(Failed to initialize NVML")


def test_a_timed_row_carries_its_telemetry_field():
    """The step benchmark's rows say what telemetry they have: on this CPU, why none."""
    from colossal_lab.benchmarks import steps

    row = steps.measure_one(steps.Setup("t", "tiny", switches=steps.Switches.naive("fp32")),
                            "tiny", 32, 2, progress=False)
    assert row["telemetry"] == "unavailable: cpu device"
