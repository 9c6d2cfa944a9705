import json
import statistics

import pytest
import torch

from colossal_lab.measure import results, timing


def test_time_fn_and_iterations_on_cpu():
    x = torch.randn(256, 256)
    t = timing.time_fn(lambda: x @ x, cpu_reps=5)
    assert t.n == 5 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    seen = []
    t2 = timing.time_iterations(lambda i: x @ x, warmup=1, iters=4,
                               on_step=lambda i, ms: seen.append(i))
    assert t2.n == 4 and seen == [1, 2, 3, 4]
    assert timing.tflops(2e12, 1000) == pytest.approx(2.0)
    assert timing.gbps(4e9, 2) == pytest.approx(2000.0)


def test_p10_p90_stay_inside_the_samples():
    """Few samples, wide spread: deciles would extrapolate below zero."""
    assert timing.quantile_10_90([1.0, 4.0, 5.0, 6.0, 100.0]) == (1.0, 100.0)
    assert timing.quantile_10_90([3.0]) == (3.0, 3.0)
    many = [float(i) for i in range(1, 21)]  # 20 steps: inside already, unchanged
    q = statistics.quantiles(many, n=10)
    assert timing.quantile_10_90(many) == (q[0], q[-1])


def test_time_kernels_says_how_it_timed(monkeypatch):
    x = torch.randn(64, 64)
    t, how = timing.time_kernels(lambda: x @ x, device="cpu")
    assert how == "perf_counter" and t.median_ms > 0

    def no_capture(fn, reps, capture_mode):
        raise RuntimeError("operation not permitted when stream is capturing")

    # a GPU whose capture fails falls back to eager timing, labels it "events" and
    # says why
    monkeypatch.setattr(timing, "_on_cuda", lambda device: True)
    monkeypatch.setattr(timing, "time_cuda_graph", no_capture)
    monkeypatch.setattr(timing, "time_fn", lambda fn, device=None: timing._summary([1.5]))
    t, how = timing.time_kernels(lambda: x @ x, device="cuda")
    assert how == ("events (capture failed: RuntimeError: operation not permitted when "
                   "stream is capturing)") and t.median_ms == 1.5
    assert results.fell_back({"timing": how})  # --resume measures such a row again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_capture_does_not_keep_later_memory():
    """After a capture fails, later captures' memory must still be returned: on the
    H200 a sweep's first failed capture made every later one leak until out of memory."""
    def bad():  # synchronising inside a capture invalidates it
        torch.empty(1 << 20, device="cuda").zero_()
        torch.cuda.synchronize()

    _, how = timing.time_kernels(bad)
    assert how.startswith("events (capture failed"), how
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    for _ in range(4):  # 4 x 256 MiB captured and released
        _, how = timing.time_kernels(
            lambda: torch.empty(256 << 20, dtype=torch.uint8, device="cuda").zero_(), reps=3)
        assert how == "cuda_graph"
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= base + (300 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_backward_alone_of_torch_rms_norm_is_captured():
    """F.rms_norm's backward alone, on a graph its forward built outside the capture,
    failed every "thread_local" capture at 16384 x 1000 fp32 on the H200, so the sweep's
    torch row fell back to events; the next mode of `timing.CAPTURE_MODES` captures it."""
    from colossal_lab.benchmarks import fused_norm

    f = fused_norm._provider_fn("rms_norm", "torch")
    inputs, grads = fused_norm._inputs("rms_norm", 16384, 1000, torch.float32,
                                       torch.device("cuda"))
    t, how = timing.time_kernels(fused_norm._backward_only(f, inputs, grads), reps=20)
    assert how == "cuda_graph", how
    assert 0 < t.median_ms < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sweeps_torch_row_is_timed_by_graph_replay():
    """The sweep's torch row at 1024 x 1000 bf16, as a process's first case, fell back
    to events in every pass with a backward while a graph of the warm-up call was kept
    alive (`fused_norm.measure`); every pass is graph replay now."""
    from colossal_lab.benchmarks import fused_norm

    for tokens, hidden, dtype in ((1024, 1000, torch.bfloat16),
                                  (16384, 1000, torch.float32)):
        row = fused_norm.measure("rms_norm", "torch", tokens, hidden, dtype)
        assert row["timing"] == "cuda_graph", row
        assert 0 < row["bwd_ms"] < row["fwd_bwd_ms"]


def test_resume_runs_a_fallen_back_row_again():
    from colossal_lab.measure.results import fell_back, resumed_rows

    graph = {"provider": "torch", "timing": "cuda_graph"}
    events = {"provider": "eager", "timing": "cuda_graph/events (capture failed: X)"}
    assert fell_back(events) and not fell_back(graph) and not fell_back({"x": 1})
    recorded = {"config": {"a": 1}, "provenance": {"git_sha": "abc"},
                "rows": [graph, events, {"provider": "t", "error": "boom"}]}
    kept, _ = resumed_rows("n", recorded, {"a": 1}, error=None)
    assert kept == [dict(graph, measured_at="abc")]


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    return tmp_path


def test_save_load_round_trip(tmp_results):
    rows = [{"provider": "triton", "seq_len": 4096, "fwd_tflops": 1.5},
            {"provider": "naive", "seq_len": 4096, "fwd_tflops": 0.5}]
    path = results.save_results("demo", rows, config={"dtype": torch.bfloat16},
                                command="pytest", gpu="h200")
    assert path == tmp_results / "h200" / "demo.json"
    doc = json.loads(path.read_text())
    for key in ("gpu", "gpu_count", "torch", "triton", "python", "git_sha", "date", "command"):
        assert key in doc["provenance"], key
    assert doc["config"]["dtype"] == "torch.bfloat16"
    res = results.load_results("demo", gpu="h200")
    assert res.rows == rows
    assert res.one(provider="triton")["fwd_tflops"] == 1.5
    assert len(res.where(seq_len=4096)) == 2
    banner = res.banner()
    assert banner.startswith(results.BANNER_PREFIX) and "(recorded, commit " in banner
    assert "demo.json" in banner and "  1 x " in banner and "by `pytest`" in banner
    with pytest.raises(LookupError):
        res.one(seq_len=4096)


def test_load_falls_back_to_reference_gpu(tmp_results):
    results.save_results("demo", [{"a": 1}], gpu=results.REFERENCE_GPU)
    assert results.load_results("demo").rows == [{"a": 1}]
    with pytest.raises(FileNotFoundError, match="run the benchmark"):
        results.load_results("nothing-here")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_measure_or_load_loads_without_gpu(tmp_results, capsys):
    results.save_results("demo", [{"a": 2}], gpu=results.REFERENCE_GPU, command="bench demo")
    res = results.measure_or_load("demo", lambda: pytest.fail("must not measure on CPU"))
    assert res.rows == [{"a": 2}] and not res.live
    assert "(recorded, commit " in capsys.readouterr().out


def test_measure_or_load_reuse_modes(tmp_results, monkeypatch, capsys):
    """On a GPU, REUSE=1 measures only what is not recorded here; REUSE=only never."""
    dev = results.hardware.detect()  # this CPU, before CUDA pretends to be there
    here = dev.slug
    monkeypatch.setattr(results.hardware, "detect", lambda: dev)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    results.save_results("demo", [{"a": 3}], gpu=here, command="bench demo")
    monkeypatch.setenv("COLOSSAL_LAB_REUSE", "1")
    assert results.measure_or_load("demo", lambda: pytest.fail("recorded here")).rows \
        == [{"a": 3}]
    monkeypatch.setenv("COLOSSAL_LAB_REUSE", "only")
    with pytest.raises(FileNotFoundError, match="run the benchmark"):
        results.measure_or_load("absent", lambda: pytest.fail("must not measure"))
    monkeypatch.setenv("COLOSSAL_LAB_REUSE", "yes")
    with pytest.raises(ValueError, match="COLOSSAL_LAB_REUSE"):
        results.measure_or_load("demo", lambda: [])


def test_multi_gpu_results_have_their_own_folder(tmp_results):
    here = results.hardware.detect().slug
    assert results.run_slug(1) == here and results.run_slug(2) == f"{here}x2"
    assert results.run_slug() == here  # no process group: one process
    results.save_results("dp", [{"a": 4}], gpu=f"{results.REFERENCE_GPU}x4")
    results.save_results("dp", [{"a": 2}], gpu=f"{results.REFERENCE_GPU}x2")
    (tmp_results / f"{results.REFERENCE_GPU}xtra").mkdir()  # not a GPU count
    res = results.load_results("dp")  # found by its name; the fewest GPUs first
    assert res.rows == [{"a": 2}] and res.path.parent.name == f"{results.REFERENCE_GPU}x2"
    results.save_results("dp", [{"a": 1}], gpu=results.REFERENCE_GPU)
    assert results.load_results("dp").rows == [{"a": 1}]  # one GPU's file comes first


def test_every_multi_gpu_run_is_shown(tmp_results, capsys):
    """`load_multi_gpu` returns each multi-GPU folder's file, two GPUs then four;
    `show_multi_gpu` shows each run's caption, its selected rows and its targets, or
    one line saying nothing is on record."""
    from colossal_lab.book import notebook

    ref = results.REFERENCE_GPU
    assert results.load_multi_gpu("dp") == []
    assert notebook.show_multi_gpu("dp", "The step", {"a": None}) == []
    assert "The step: not yet measured on several GPUs" in capsys.readouterr().out
    results.save_results("dp", [{"a": 4, "keep": True}, {"a": 40}], gpu=f"{ref}x4")
    results.save_results("dp", [{"a": 2, "keep": True}], gpu=f"{ref}x2")
    results.save_results("dp", [{"a": 1}], gpu=ref)  # one GPU's: not a multi-GPU run
    runs = results.load_multi_gpu("dp")
    assert [r.path.parent.name for r in runs] == [f"{ref}x2", f"{ref}x4"]
    seen = []

    def targets(rows, world=None):  # the shape of every benchmark's `targets`
        seen.append(len(rows))
        a = min(r["a"] for r in rows)
        return [{"check": f"a >= 3 ({len(rows)} rows)", "ok": a >= 3, "target": 3,
                 "measured": a, "worst": a, "points": len(rows), "at": "lowest a",
                 "failing": [] if a >= 3 else [{"at": "lowest a", "measured": a}]}]

    shown = []
    notebook.show_multi_gpu("dp", "The step", {"a": "d"}, select=lambda r: "keep" in r,
                            targets=targets, plot=lambda rows: shown.append(rows))
    out = capsys.readouterr().out
    assert out.count("Measured on ") == 2 and out.count("/dp.json") == 2
    assert seen == [1, 2]  # every row of each file to its targets
    assert shown == [[{"a": 2, "keep": True}], [{"a": 4, "keep": True}]]
    assert "NOT met: a >= 3 (1 rows)" in out and "met: a >= 3 (2 rows)" in out


def test_committed_results_have_provenance():
    for path in sorted(results.REPO_ROOT.glob("results/*/*.json")):
        doc = json.loads(path.read_text())
        p = doc["provenance"]
        for key in ("gpu", "torch", "git_sha", "date", "command"):
            assert p.get(key), f"{path} lacks {key}"
        assert doc["rows"], f"{path} has no rows"
        for r in doc["rows"]:
            for k in ("mfu", "mfu_attn", "hfu"):
                if k in r:
                    assert 0 < r[k] < 1, f"{path}: {k}={r[k]} is not a fraction"


def test_error_line_puts_the_exception_first():
    """A child's traceback tail ("File ... | code | XError: why") reads as the
    exception first, the context after it; other texts are left as they are."""
    from colossal_lab.measure.results import error_line

    tail = ('File "/x/steps.py", line 158, in convert | raise ImportError(f"...") | '
            "ImportError: torchao float8 setups need torchao")
    assert error_line(tail) == ("ImportError: torchao float8 setups need torchao "
                                '[File "/x/steps.py", line 158, in convert | '
                                'raise ImportError(f"...")]')
    assert error_line("x | torch.OutOfMemoryError: CUDA out of memory") == (
        "torch.OutOfMemoryError: CUDA out of memory [x]")
    for plain in ("out of memory", "ValueError: bad", "no exception | here",
                  "KeyError: first | then context"):
        assert error_line(plain) == plain


def test_exception_tail_keeps_the_first_line_of_a_long_message():
    """A child that died of an exception whose message spans lines (torch's
    CheckpointError) is recorded by that exception and its first lines, not by the last
    three lines of the message."""
    from colossal_lab.measure.results import error_line, exception_tail

    output = "\n".join([
        "[steps] ours-7b-bf16 ...", "Traceback (most recent call last):",
        '  File "/x/checkpoint.py", line 902, in check_recomputed_tensors_match',
        "    raise CheckpointError(",
        "torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed "
        "values for the following tensors have different metadata than during the "
        "forward pass.", "tensor at position 0:",
        "saved metadata: {'shape': torch.Size([8192, 4096])}", "",
        "recomputed metadata: {'shape': torch.Size([2, 4096, 4096])}",
        "enable checkpoint-debug mode globally."])
    tail = exception_tail(output)
    assert tail == ("raise CheckpointError( | torch.utils.checkpoint.CheckpointError: "
                    "torch.utils.checkpoint: Recomputed values for the following tensors "
                    "have different metadata than during the forward pass. | tensor at "
                    "position 0: | saved metadata: {'shape': torch.Size([8192, 4096])}")
    assert error_line(tail).startswith("torch.utils.checkpoint.CheckpointError: ")
    # an indented line that merely mentions an error is not the exception line
    assert exception_tail("a\n  raise ValueError(x)\nb\nc\nd") == "b | c | d"
    assert exception_tail("") == ""
