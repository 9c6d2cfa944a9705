"""The fused-norm benchmark runs end to end on a CPU (tiny shapes, Triton interpreter)
and its rows carry every field the book reads. No speed is asserted here."""

import gc
import json
import types

import pytest
import torch

from colossal_lab.benchmarks import fused_norm, norm_measure, norm_sweep, norm_tuner
from colossal_lab.kernels import _norm_common

FIELDS = ("op", "provider", "tokens", "hidden", "dtype", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
          "fwd_gbps", "bwd_gbps", "fwd_bwd_gbps")


@pytest.fixture(scope="module")
def rows():
    return fused_norm.run(quick=True)


def test_rows_have_every_field(rows):
    ops = [r for r in rows if r["kind"] == "op"]
    assert {r["op"] for r in ops} == set(fused_norm.NORM_OPS)
    assert {"eager", "torch", "triton"} <= {r["provider"] for r in ops}
    assert {r["provider"] for r in ops if r["op"] == "add_rms_norm"} >= {"separate"}
    for r in ops:
        assert "error" not in r, r
        for f in FIELDS:
            assert f in r, (f, r)
        for f in FIELDS[5:]:
            assert r[f] > 0, (f, r)
    json.dumps(rows)  # storable as a results file


def test_ceiling_row(rows):
    ceiling = [r for r in rows if r["kind"] == "ceiling"]
    assert len(ceiling) == 1 and ceiling[0]["copy_gbps"] > 0


def test_summary_table(rows):
    text = fused_norm.summary(rows)
    assert "copy ceiling" in text and "triton" in text and "separate" in text


def test_moved_bytes_formulas():
    n = 16384 * 4096
    fwd, bwd = fused_norm.moved_bytes("rms_norm", 16384, 4096, 2)
    assert round(fwd / n) == 4 and round(bwd / n) == 6
    fwd, bwd = fused_norm.moved_bytes("add_rms_norm", 16384, 4096, 2)
    assert round(fwd / n) == 8 and round(bwd / n) == 8
    with pytest.raises(ValueError):
        fused_norm.moved_bytes("group_norm", 1, 1)


@pytest.mark.parametrize("op,fwd,bwd", [("rms_norm", 36, 92), ("layer_norm", 52, 122),
                                        ("add_rms_norm", 42, 98)])
def test_eager_traffic_matches_docstrings(op, fwd, bwd):
    """The bytes per element the module docstrings quote for eager bf16 (meta tensors:
    nothing is allocated)."""
    n = 16384 * 4096
    t = fused_norm.traffic_bytes(op, 16384, 4096, torch.bfloat16)
    assert round(t["fwd_bytes"] / n) == fwd and round(t["bwd_bytes"] / n) == bwd


def test_measure_records_errors():
    row = fused_norm.measure("rms_norm", "triton", 2, 70000, torch.float32, "cpu")
    assert "65536" in row["error"]


# ------------------------------------------------- issue #14: the sweep, targets, table

SWEEP_FIELDS = ("fwd_bwd_ms", "eager_fwd_ms", "eager_fwd_bwd_ms", "eager_fwd_bwd_gbps",
                "timing", "timed_as", "copy_gbps")


@pytest.fixture()
def small_host(monkeypatch):
    """Host-time rows at one tiny shape, 2 calls: the interpreter is slow."""
    monkeypatch.setattr(norm_sweep, "HOST_SHAPES", ((4, 64),))
    monkeypatch.setattr(norm_sweep, "HOST_CALLS", 2)


def test_sweep_rows_carry_both_timings_and_host_time(small_host):
    cases = [("rms_norm", 8, 100, "bfloat16"), ("swiglu", 8, 70, "float32")]
    rows = fused_norm.sweep(cases, ["torch", "triton"])
    ops = [r for r in rows if r["kind"] == "op"]
    assert {(r["op"], r["provider"]) for r in ops} == {
        ("rms_norm", "torch"), ("rms_norm", "triton"), ("swiglu", "torch"),
        ("swiglu", "triton")}
    for r in ops:
        assert "error" not in r, r
        for f in SWEEP_FIELDS:
            assert r.get(f), (f, r)
    hosts = [r for r in rows if r["kind"] == "host"]
    assert len(hosts) == 4 and all(r["host_us"] > 0 and r["device"] == "cpu"
                                   for r in hosts)
    assert [r for r in rows if r["kind"] == "ceiling"]
    json.dumps(rows)


def test_eager_timings_take_the_providers_in_turns(monkeypatch):
    """Every round times each provider once, the order rotated from round to round; a
    row keeps its rounds' median; a provider that cannot run says so, the others are
    timed."""
    class Call:
        def __init__(self, provider, name):
            self.provider, self.name = provider, name

    def provider_fn(op, provider):
        if provider == "broken":
            raise RuntimeError("no such kernel")
        return provider

    order = []
    rounds_ms = {"torch": [3.0, 1.0, 2.0], "triton": [5.0, 9.0, 4.0]}

    def fake_time_fn(f, device=None, warmup_ms=None, rep_ms=None):
        order.append((f.provider, f.name))
        n = sum(1 for p, name in order if (p, name) == (f.provider, f.name)) - 1
        ms = rounds_ms[f.provider][n]
        return types.SimpleNamespace(median_ms=ms if f.name == "fwd" else 2 * ms)

    monkeypatch.setattr(norm_measure, "_provider_fn", provider_fn)
    monkeypatch.setattr(norm_measure, "_eager_calls",
                        lambda fn, inputs, grads: (Call(fn, "fwd"), Call(fn, "fwd_bwd")))
    monkeypatch.setattr(norm_measure, "time_fn", fake_time_fn)
    rows = [{"kind": "op", "provider": p, "fwd_bwd_ms": 1.0, "timing": "cuda_graph"}
            for p in ("torch", "triton", "broken")]
    rows.append({"kind": "op", "provider": "liger", "skipped": "too big"})
    fused_norm.eager_in_turns("rms_norm", rows, 8, 64, torch.float32, "cpu")
    assert [p for p, name in order if name == "fwd"] == [
        "torch", "triton", "triton", "torch", "torch", "triton"]
    by = {r["provider"]: r for r in rows}
    assert by["torch"]["eager_fwd_ms"] == 2.0 and by["torch"]["eager_fwd_bwd_ms"] == 4.0
    assert by["triton"]["eager_fwd_ms"] == 5.0 and by["triton"]["eager_fwd_bwd_ms"] == 10.0
    assert "in turns (3 rounds" in by["torch"]["timed_as"]["eager_fwd_ms/eager_fwd_bwd_ms"]
    assert by["torch"]["timed_as"]["fwd_ms/bwd_ms/fwd_bwd_ms"] == "cuda_graph"
    assert "no such kernel" in by["broken"]["error"]
    assert by["broken"]["eager_fwd_ms"] is None
    assert "eager_fwd_ms" not in by["liger"]  # a skipped case is not timed


def test_default_sweep_times_eager_only_at_its_one_token_count(small_host, monkeypatch):
    monkeypatch.setattr(norm_sweep, "SWEEP_EAGER_AT", (8, "float32"))
    monkeypatch.setattr(norm_sweep, "SWEEP_PROVIDERS", ("torch",))
    cases = [("rms_norm", 8, 40, "float32"), ("rms_norm", 4, 40, "float32"),
             ("rms_norm", 8, 40, "bfloat16")]
    rows = fused_norm.sweep(cases, host=False)
    got = {(r["tokens"], r["dtype"], r["provider"]) for r in rows if r["kind"] == "op"}
    assert got == {(8, "float32", "eager"), (8, "float32", "torch"),
                   (4, "float32", "torch"), (8, "bfloat16", "torch")}


def test_sweep_cases_cover_the_issue_and_skip_by_memory():
    cases = fused_norm.sweep_cases("rms_norm")
    assert cases[0] == ("rms_norm", *fused_norm.HEADLINE, "bfloat16")
    hidden = set(fused_norm.HIDDEN) | set(fused_norm.ODD_HIDDEN)
    assert {(t, h, d) for _, t, h, d in cases} == {
        (t, h, d) for t in fused_norm.TOKENS for h in hidden for d in fused_norm.DTYPES}
    assert not [c for c in cases if fused_norm.skip_reason(*c)]  # every point runs
    assert "GiB" in fused_norm.skip_reason("swiglu", 65536, 28672, "float32")
    assert fused_norm.skip_reason("rms_norm", 16384, 4096, "float32") is None
    models = fused_norm.sweep_cases("models")
    assert {h for op, _, h, _ in models if op == "swiglu"} == {
        i for _, i in fused_norm.MODEL_SIZES.values()}
    assert {h for op, _, h, _ in models if op == "layer_norm"} == {
        h for h, _ in fused_norm.MODEL_SIZES.values()}


@pytest.mark.parametrize("group", list(fused_norm.GROUPS))
def test_dry_run_chunks_cover_every_case(group):
    cases = fused_norm.sweep_cases(group)
    providers = list(fused_norm.SWEEP_PROVIDERS)
    chunks = fused_norm.plan_chunks(cases, len(providers))
    assert sorted(c for ch in chunks for c in ch) == sorted(cases)
    for ch in chunks:  # a chunk is over budget only when one (op, dtype, H) is
        est = fused_norm.chunk_estimate_s(ch, len(providers))
        one_size = len({(c[0], c[2], c[3]) for c in ch}) == 1
        assert est < fused_norm.CHUNK_BUDGET_S or one_size
    text = fused_norm.dry_run(cases, providers, group, "x")
    commands = [line for line in text.splitlines() if "bench fused_norm" in line]
    assert "--resume" not in commands[0].split("&&")[0]
    assert all("--resume" in part for line in commands for part in line.split("&&")[1:])
    tokens = {c[1] for c in cases}
    assert all(f"--tokens {' '.join(map(str, sorted(tokens)))} " in part
               for line in commands for part in line.split("&&"))


def test_dry_run_of_a_redo_keeps_the_selection(capsys):
    """A dry run of `--resume --redo --tokens 16384 --providers torch triton` prints
    commands that continue the saved sweep (every one, the first included), re-measure,
    and keep the selected tokens and providers: run as printed, they redo what the dry
    run listed and nothing else."""
    fused_norm.main(["--group", "rms_norm", "--ops", "rms_norm", "--tokens", "16384",
                     "--hidden", "1024", "4096", "--providers", "torch", "triton",
                     "--resume", "--redo", "--dry-run"])
    text = capsys.readouterr().out
    parts = [part for line in text.splitlines() if "bench fused_norm" in line
             for part in line.split("] ", 1)[1].split("&&")]
    assert len(parts) == len(fused_norm.DTYPES)
    for part in parts:
        flags = part.split()
        assert flags.count("--resume") == 1 and "--redo" in flags
        assert flags[flags.index("--tokens") + 1:flags.index("--tokens") + 3] == [
            "16384", "--name"]
        assert flags[flags.index("--providers") + 1:][:2] == ["torch", "triton"]
        assert set(flags[flags.index("--hidden") + 1:][:2]) == {"1024", "4096"}


def test_resume_appends_the_missing_cases(small_host, tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    args = ["--group", "rms_norm", "--providers", "torch", "triton", "--dtypes",
            "float32", "--tokens", "8", "--name", "sweep_test"]
    fused_norm.main([*args, "--hidden", "100"])
    fused_norm.main([*args, "--hidden", "100", "64", "--resume"])
    doc = json.loads(next(tmp_path.glob("*/sweep_test.json")).read_text())
    ops = [r for r in doc["rows"] if r["kind"] == "op"]
    assert sorted((r["hidden"], r["provider"]) for r in ops) == [
        (64, "torch"), (64, "triton"), (100, "torch"), (100, "triton")]
    assert len(doc["config"]["resumed_from"]) == 1
    assert all("measured_at" in r for r in ops if r["hidden"] == 100)
    with pytest.raises(SystemExit):  # another configuration: refused
        fused_norm.main([*args, "--group", "models", "--ops", "swiglu", "--resume"])


def _pair(tokens, hidden, ours_ms, torch_ms, eager=(1.0, 1.0), dtype="bfloat16"):
    base = {"kind": "op", "op": "rms_norm", "tokens": tokens, "hidden": hidden,
            "dtype": dtype, "timing": "cuda_graph", "copy_gbps": 4000.0}
    return [{**base, "provider": "triton", "fwd_bwd_ms": ours_ms,
             "eager_fwd_bwd_ms": eager[0], "fwd_bwd_gbps": 3500.0},
            {**base, "provider": "torch", "fwd_bwd_ms": torch_ms,
             "eager_fwd_bwd_ms": eager[1], "fwd_bwd_gbps": 3000.0}]


def test_measure_labels_each_pass_where_one_fell_back(monkeypatch):
    """A row whose passes were timed alike has one `timing`; where one pass's capture
    fell back, `timing_by_pass` (and `timed_as`) say which, and `pass_timing` reads it."""
    real = norm_measure.time_kernels

    def bwd_falls_back(fn, device=None):
        t, _ = real(fn, device=device)
        return t, ("events (capture failed: X)" if getattr(fn, "capture_stream", 0) is None
                   else "cuda_graph")

    row = fused_norm.measure("rms_norm", "torch", 8, 64, torch.float32, device="cpu")
    assert row["timing"] == "perf_counter" and "timing_by_pass" not in row
    monkeypatch.setattr(norm_measure, "time_kernels", bwd_falls_back)
    row = fused_norm.measure("rms_norm", "torch", 8, 64, torch.float32, device="cpu")
    assert row["timing"] == "cuda_graph/events (capture failed: X)"
    assert row["timing_by_pass"] == {"fwd_ms": "cuda_graph", "fwd_bwd_ms": "cuda_graph",
                                     "bwd_ms": "events (capture failed: X)"}
    assert fused_norm.pass_timing(row) == "cuda_graph"
    assert fused_norm.pass_timing(row, "bwd_ms").startswith("events")
    row["fwd_bwd_ms"] = 1.0
    fused_norm.eager_in_turns("rms_norm", [row], 8, 64, torch.float32, device="cpu")
    assert row["timed_as"]["bwd_ms"] == "events (capture failed: X)"


def test_targets_on_synthetic_rows():
    host = [{"kind": "host", "op": "rms_norm", "provider": p, "tokens": 16,
             "hidden": 4096, "dtype": "bfloat16", "host_us": us}
            for p, us in (("triton", 60.0), ("torch", 50.0))]
    rows = (_pair(16384, 4096, 1.0, 1.5) + _pair(4096, 5000, 1.0, 1.1, eager=(2.0, 1.0))
            + _pair(65536, 1000, 1.0, 1.2) + host)
    graph, eager, copy, host_gap = fused_norm.targets(rows)
    assert [c["ok"] for c in (graph, eager, copy, host_gap)] == [True] * 4
    assert graph["points"] == 3 and eager["points"] == 2  # eager loses at 4096 tokens
    assert copy["worst"] == 3500.0 / 4000.0 and host_gap["worst"] == 10.0

    slow = _pair(16384, 4096, 1.0, 0.9, eager=(1.2, 1.0))
    slow[0]["fwd_bwd_gbps"] = 3000.0  # 75% of copy
    host[0]["host_us"] = 90.0
    bad = fused_norm.targets(slow + host)
    assert [c["ok"] for c in bad] == [False, False, False, False]
    assert bad[0]["failing"][0]["at"] == (16384, 4096, "bfloat16")
    assert round(bad[0]["worst"], 2) == 0.9 and bad[3]["worst"] == 40.0
    # a row that graph replay did not time (a capture fell back to events), ours or
    # torch's, fails the graph check however its ratio reads
    for who in (0, 1):
        eager_capture = _pair(4096, 4096, 1.0, 2.0) + _pair(1024, 4096, 1.0, 2.0)
        eager_capture[who]["timing"] = "cuda_graph/events (capture failed: X)"
        check = fused_norm.targets(eager_capture)[0]
        assert check["ok"] is False and check["points"] == 2
        provider = eager_capture[who]["provider"]
        assert check["failing"] == [{"at": (4096, 4096, "bfloat16"), "not_graph_replay": {
            provider: "cuda_graph/events (capture failed: X)"}}]
        # the check reads the fwd+bwd's own label where the passes differ: a backward
        # alone that fell back does not fail it, a fwd+bwd that fell back does
        for field, ok in (("bwd_ms", True), ("fwd_bwd_ms", False)):
            eager_capture[who]["timing_by_pass"] = {
                "fwd_ms": "cuda_graph", "bwd_ms": "cuda_graph", "fwd_bwd_ms": "cuda_graph",
                field: "events (capture failed: X)"}
            assert fused_norm.targets(eager_capture)[0]["ok"] is ok
    # the checks of another provider of ours (the C++ path) read that provider's rows
    native = [{**r, "provider": "triton-native", "fwd_bwd_ms": 0.5}
              for r in slow if r["provider"] == "triton"]
    by_native = fused_norm.targets(slow + native, ours="triton-native")
    assert by_native[0]["ok"] and by_native[0]["worst"] == pytest.approx(1.8)


@pytest.fixture()
def table(monkeypatch):
    """A launch table for a pretend GPU, its cache cleared before and after."""
    from colossal_lab.kernels import _norm_common

    entries = {"128/float32/fwd": {"rows": 2, "num_warps": 8},
               "128/float32/bwd": {"rows": 4, "num_warps": 4, "programs_per_sm": 3,
                                   "num_stages": 1, "min_rows_per_program": 5}}
    monkeypatch.setattr(_norm_common, "TABLES", {"NVIDIA H200": entries})
    monkeypatch.setattr(_norm_common, "_gpu_name", lambda: "NVIDIA H200")
    _norm_common.launch_config.cache_clear()
    yield _norm_common
    _norm_common.launch_config.cache_clear()


def test_table_entry_overrides_the_heuristic(table):
    heuristic = table.launch_config(100)  # no dtype: never the table
    assert heuristic.source == "heuristic" and heuristic.rows == 32
    cfg = table.launch_config(100, torch.float32)
    assert (cfg.rows, cfg.num_warps, cfg.source) == (2, 8, "table:NVIDIA H200")
    bwd = table.launch_config(100, torch.float32, backward=True)
    assert (bwd.rows, bwd.programs_per_sm, bwd.num_stages,
            bwd.min_rows_per_program) == (4, 3, 1, 5)
    assert table.launch_config(100, torch.bfloat16).source == "heuristic"  # missing
    assert table.launch_config(1000, torch.float32).source == "heuristic"  # bucket 1024
    assert table.launch_config(100, torch.float32, rows=1).source == "override"


def test_small_entry_overrides_at_few_rows(table, monkeypatch):
    """A ".../small" entry changes only the fields it sets, only where asked (launches
    of at most SMALL_ROWS rows), and says so in the source."""
    entries = dict(table.TABLES["NVIDIA H200"])
    entries["128/float32/bwd/small"] = {"num_warps": 2, "programs_per_sm": 1}
    monkeypatch.setattr(table, "TABLES", {"NVIDIA H200": entries})
    table.launch_config.cache_clear()
    big = table.launch_config(100, torch.float32, backward=True)
    few = table.launch_config(100, torch.float32, backward=True, small=True)
    assert (big.num_warps, big.programs_per_sm, big.source) == (4, 3, "table:NVIDIA H200")
    assert (few.rows, few.num_warps, few.programs_per_sm, few.num_stages,
            few.min_rows_per_program) == (4, 2, 1, 1, 5)
    assert few.source == "table:NVIDIA H200/small"
    fwd = table.launch_config(100, torch.float32, small=True)  # no forward small entry
    assert (fwd.rows, fwd.source) == (2, "table:NVIDIA H200")


def test_rms_norm_plans_take_the_small_entry_by_row_count(table, monkeypatch):
    """The launchers ask for the small entry at <= SMALL_ROWS rows and not above, and
    the kernels stay correct with it."""
    from colossal_lab.kernels import _norm_common, rms_norm
    from colossal_lab.ops import norm

    entries = dict(_norm_common.TABLES["NVIDIA H200"])
    entries["128/float32/fwd/small"] = {"rows": 1, "num_warps": 2}
    monkeypatch.setattr(_norm_common, "TABLES", {"NVIDIA H200": entries})
    monkeypatch.setattr(_norm_common, "SMALL_ROWS", 8)
    monkeypatch.setattr(rms_norm, "SMALL_ROWS", 8)
    table.launch_config.cache_clear()
    rms_norm._forward_plan.cache_clear()
    rms_norm._backward_plan.cache_clear()
    for n_rows, tile in ((7, 1), (9, 2)):
        x = torch.randn(n_rows, 100, requires_grad=True)
        w = (torch.randn(100) * 0.1 + 1).requires_grad_(True)
        dy = torch.randn(n_rows, 100)
        got = torch.autograd.grad(rms_norm.rms_norm_triton(x, w, 1e-6), (x, w), dy)
        ref = torch.autograd.grad(norm.rms_norm_ref(x, w, 1e-6), (x, w), dy)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        grid, _, constexprs, warps, _ = rms_norm._forward_plan(
            n_rows, 100, 100, 100, False, (torch.float32,) * 4, (True,) * 3, None)
        assert constexprs["ROWS"] == tile and grid == (-(-n_rows // tile),)
        assert warps == (2 if n_rows <= 8 else 8)
    rms_norm._forward_plan.cache_clear()  # plans made with this test's table
    rms_norm._backward_plan.cache_clear()


def test_small_tune_candidates_one_per_grid():
    """`_tune_small` times each (tile, warps, grid) once: on a CPU every grid is the
    interpreter's 4 programs, so one backward candidate per tile and warps."""
    fwd, bwd = norm_tuner._small_candidates(1024, 1024, torch.device("cpu"))
    tiles = [r for r in norm_tuner.TUNE_SMALL_ROWS if r * 1024 <= 16384]
    assert fwd == [(r, nw) for r in tiles for nw in norm_tuner.TUNE_SMALL_WARPS]
    assert sorted((r, nw) for r, nw, *_ in bwd) == sorted(fwd)
    assert {p for *_, p in bwd} == {4}


def test_kernels_correct_with_a_table_launch(table):
    from colossal_lab.kernels.rms_norm import rms_norm_triton
    from colossal_lab.ops import norm

    x = torch.randn(7, 100, requires_grad=True)
    w = (torch.randn(100) * 0.1 + 1).requires_grad_(True)
    dy = torch.randn(7, 100)
    got = torch.autograd.grad(rms_norm_triton(x, w, 1e-6), (x, w), dy)
    ref = torch.autograd.grad(norm.rms_norm_ref(x, w, 1e-6), (x, w), dy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    used = [table.launch_config(100, torch.float32, small=True),  # 7 rows: "small"
            table.launch_config(100, torch.float32, backward=True, small=True)]
    assert [c.rows for c in used] == [2, 4]  # the table's tiles, not the heuristic's 32
    assert table.launch_config.cache_info().hits >= 2  # the launches asked the same


NORM_TABLE_PY = {'NVIDIA H200': {'1024/bfloat16/bwd': {'min_rows_per_program': 2},
                                 '1024/bfloat16/bwd/small': {'min_rows_per_program': 1,
                                                             'num_stages': 1,
                                                             'num_warps': 4,
                                                             'prefetch': False,
                                                             'programs_per_sm': 2,
                                                             'rows': 4},
                                 '1024/float32/bwd': {'min_rows_per_program': 1},
                                 '1024/float32/bwd/small': {'min_rows_per_program': 1,
                                                            'num_stages': 1,
                                                            'num_warps': 4,
                                                            'prefetch': False,
                                                            'programs_per_sm': 2,
                                                            'rows': 4},
                                 '2048/bfloat16/bwd': {'min_rows_per_program': 4},
                                 '2048/float32/bwd': {'min_rows_per_program': 4},
                                 '4096/bfloat16/bwd': {'min_rows_per_program': 2,
                                                       'num_stages': 1,
                                                       'num_warps': 8,
                                                       'prefetch': True,
                                                       'programs_per_sm': 2,
                                                       'rows': 1},
                                 '4096/bfloat16/fwd': {'num_warps': 8, 'rows': 1},
                                 '4096/float32/bwd': {'min_rows_per_program': 4}}}
"""`TABLES` as `kernels/norm_table.py` held it before the table became data."""


def test_norm_table_json_holds_the_python_table():
    """`norm_table.json` loads to the table the Python module held, bools included,
    and is the table the launches consult."""
    loaded = _norm_common.load_tables()
    assert loaded == NORM_TABLE_PY
    assert [type(v) for e in loaded["NVIDIA H200"].values() for v in e.values()] == [
        type(v) for e in NORM_TABLE_PY["NVIDIA H200"].values() for v in e.values()]
    assert _norm_common.TABLES == loaded


def test_write_table_from_tune_rows(tmp_path, monkeypatch):
    from colossal_lab.measure.results import save_results

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    tune = [{"kind": "tune", "hidden": 4096, "dtype": "bfloat16", "pass": "fwd",
             "rows": r, "num_warps": nw, "gbps": g}
            for r, nw, g in ((1, 8, 3000.0), (2, 8, 3500.0), (1, 16, None))]
    tune += [{"kind": "tune", "hidden": 4096, "dtype": "bfloat16", "pass": "bwd",
              "rows": 1, "num_warps": 8, "programs_per_sm": 2, "num_stages": s,
              "prefetch": pf, "gbps": g, "tokens": 16384}
             for s, pf, g in ((1, False, 2000.0), (2, False, 2500.0), (1, True, 2400.0))]
    # a smaller token count's (faster-looking) tile does not replace the 16k winner
    tune += [{"kind": "tune", "hidden": 4096, "dtype": "bfloat16", "pass": "bwd",
              "rows": 4, "num_warps": 4, "programs_per_sm": 1, "num_stages": 1,
              "gbps": 9000.0, "tokens": 4096}]
    # the grid cap comes from the smallest token count that tuned it
    tune += [{"kind": "tune", "hidden": 4096, "dtype": "bfloat16", "pass": "bwd",
              "rows": 1, "num_warps": 8, "programs_per_sm": 2, "num_stages": 2,
              "min_rows_per_program": m, "gbps": g, "tokens": t}
             for m, g, t in ((4, 1000.0, 1024), (16, 1200.0, 1024), (32, 5000.0, 4096))]
    # whole launches tuned at few tokens: the fastest at the smallest count tuned;
    # the row timing what ran before ("current") is never a candidate
    small = {"kind": "tune-small", "hidden": 1000, "dtype": "float32",
             "pass": "bwd", "num_stages": 1, "prefetch": False}
    tune += [{**small, "rows": r, "num_warps": nw, "programs_per_sm": p,
              "min_rows_per_program": m, "gbps": g, "tokens": t}
             for r, nw, p, m, g, t in ((4, 2, 1, 8, 500.0, 1024), (2, 4, 2, 4, 600.0, 1024),
                                       (1, 8, 1, 1, 900.0, 2048))]
    tune += [{**small, "rows": 8, "num_warps": 8, "gbps": 9999.0, "tokens": 1024,
              "current": "heuristic", "ms": 1.0}]
    for r in tune:
        if r["kind"] == "tune-small" and "current" not in r:
            r["ms"] = 500.0 / r["gbps"]  # 1.0 ms: the 600 GB/s winner beats 1.0 by 17%
    # a forward whose best is within SMALL_MARGIN of what runs gets no small entry
    tune += [{**small, "pass": "fwd", "rows": r, "num_warps": 4, "gbps": g, "ms": ms,
              "tokens": 1024, **({"current": "heuristic"} if cur else {})}
             for r, g, ms, cur in ((1, 100.0, 1.0, True), (2, 102.0, 0.98, False))]
    # ... but a small entry that ran and is not clearly beaten stays as it ran
    tune += [{**small, "hidden": 2048, "pass": "fwd", "rows": r, "num_warps": 4,
              "gbps": g, "ms": ms, "tokens": 1024,
              **({"current": "table:NVIDIA H200/small"} if cur else {})}
             for r, g, ms, cur in ((8, 100.0, 1.0, True), (2, 102.0, 0.98, False))]
    saved = save_results("fused_norm_tune", tune, gpu="h200")
    path = fused_norm.write_table(path=tmp_path / "norm_table.json")
    tables = _norm_common.load_tables(path)
    gpu = json.loads(saved.read_text())["provenance"]["gpu"]  # keyed by torch's name
    assert tables[gpu] == {
        "4096/bfloat16/bwd": {"rows": 1, "num_warps": 8, "programs_per_sm": 2,
                              "num_stages": 2, "prefetch": False,
                              "min_rows_per_program": 16},
        "4096/bfloat16/fwd": {"rows": 2, "num_warps": 8},
        "1024/float32/bwd/small": {"rows": 2, "num_warps": 4, "programs_per_sm": 2,
                                   "num_stages": 1, "prefetch": False,
                                   "min_rows_per_program": 4},
        "2048/float32/fwd/small": {"rows": 8, "num_warps": 4}}


def test_tune_rows_save_and_merge(tmp_path, monkeypatch):
    """Every row `tune` returns (the ceiling too) has the fields save_tune merges by, and
    a later invocation at another token count keeps the earlier one's rows."""
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    monkeypatch.setattr(norm_tuner, "measure_copy_gbps", lambda device: 4000.0)
    monkeypatch.setattr(norm_tuner, "_tune_hidden", lambda t, h, d, dev: [
        {"kind": "tune", "tokens": t, "hidden": h, "dtype": str(d)[6:], "pass": "bwd",
         "rows": 1, "num_warps": 4, "programs_per_sm": 1, "num_stages": 1, "gbps": 1.0}])
    for tokens in ((1024,), (16384,)):
        with monkeypatch.context() as m:  # tune refuses to run without a GPU
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "empty_cache", lambda: None)
            rows = fused_norm.tune(tokens, (1024, 2048))
        fused_norm.save_tune("fused_norm_tune", rows, "test")
    saved = json.loads((tmp_path / hardware_slug() / "fused_norm_tune.json").read_text())
    assert sorted((r["kind"], r["tokens"], r["hidden"]) for r in saved["rows"]
                  if r["kind"] == "tune") == [("tune", 1024, 1024), ("tune", 1024, 2048),
                                               ("tune", 16384, 1024), ("tune", 16384, 2048)]


def hardware_slug() -> str:
    from colossal_lab.measure import hardware

    return hardware.detect().slug


def test_host_parts_stubs_the_launches_and_puts_them_back():
    from colossal_lab.kernels import _norm_common, rms_norm

    kernels = (rms_norm._rms_norm_forward_kernel, rms_norm._rms_norm_backward_kernel,
               _norm_common._rms_norm_partials_sum_kernel)
    rows = fused_norm.host_parts(calls=3)
    assert {r["triton_launches_per_fwd_bwd"] for r in rows} == {3}  # fwd, bwd, dw sum
    parts = {r["part"]: r["us"] for r in rows}
    assert parts["launch_config"] > 0 and "F.rms_norm fwd+bwd" in parts
    assert (rms_norm._rms_norm_forward_kernel, rms_norm._rms_norm_backward_kernel,
            _norm_common._rms_norm_partials_sum_kernel) == kernels


def test_host_rows_time_the_providers_in_turns_with_the_collector_paused(monkeypatch):
    """Host time drifts within a process; the providers' loops alternate (order rotated
    each round) so a drift shifts them alike, and no collection lands inside a loop."""
    seen = []

    def fake(op, provider):
        def fn(x, w):
            seen.append((provider, gc.isenabled()))
            return x * w
        return fn

    monkeypatch.setattr(norm_measure, "_provider_fn", fake)
    rows = fused_norm.host_rows("rms_norm", ("torch", "triton"), 4, 64, torch.float32,
                                "cpu", calls=2, repeats=3)
    assert [r["provider"] for r in rows] == ["torch", "triton"]
    assert all(r["host_us"] > 0 and "interleaved" in r["host_timing"] for r in rows)
    timed = seen[20:]  # after 10 warm-up calls each
    assert all(not on for _, on in timed) and gc.isenabled()
    loops = [p for i, (p, _) in enumerate(timed) if i % 2 == 0]
    assert loops == ["torch", "triton", "triton", "torch", "torch", "triton"]


def test_host_rows_keep_one_providers_error_to_its_row(monkeypatch):
    real = norm_measure._provider_fn

    def fake(op, provider):
        if provider == "triton":
            raise RuntimeError("no such kernel")
        return real(op, provider)

    monkeypatch.setattr(norm_measure, "_provider_fn", fake)
    torch_row, bad = fused_norm.host_rows("rms_norm", ("torch", "triton"), 4, 64,
                                          torch.float32, "cpu", calls=2, repeats=2)
    assert torch_row["host_us"] > 0 and "error" not in torch_row
    assert "no such kernel" in bad["error"] and "host_us" not in bad


def test_redo_drops_the_selected_points_and_their_host_rows():
    kept = [{"kind": "op", "op": "rms_norm", "provider": p, "tokens": t, "hidden": h,
             "dtype": d} for p in ("torch", "triton") for t, h, d in
            ((16384, 1024, "bfloat16"), (16384, 1024, "float32"), (1024, 1024, "bfloat16"))]
    kept += [{"kind": "host", "op": "rms_norm", "provider": "torch", "tokens": 16,
              "hidden": 2048, "dtype": d} for d in ("bfloat16", "float32")]
    kept += [{"kind": "ceiling", "copy_gbps": 4000.0}]
    left = fused_norm.redo_rows(kept, [("rms_norm", 16384, 1024, "bfloat16")])
    assert {(r.get("kind"), r.get("tokens"), r.get("dtype")) for r in left} == {
        ("op", 16384, "float32"), ("op", 1024, "bfloat16"), ("host", 16, "float32"),
        ("ceiling", None, None)}


def test_resume_keeps_failed_rows_it_does_not_measure(small_host, tmp_path, monkeypatch):
    """A failed row (an error, or a capture that fell back) is measured again by a run
    that covers its point, and stays as recorded, failure and all, through a narrower
    run that does not: it does not silently drop out of the file."""
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    args = ["--group", "rms_norm", "--providers", "torch", "triton", "--dtypes",
            "float32", "--tokens", "8", "--name", "sweep_test"]
    fused_norm.main([*args, "--hidden", "100", "64"])
    path = next(tmp_path.glob("*/sweep_test.json"))
    doc = json.loads(path.read_text())
    failed = "cuda_graph/events (capture failed: X)"
    for r in doc["rows"]:  # (the test's own file: a row as a failed capture leaves it)
        if r.get("kind") == "op" and (r["hidden"], r["provider"]) == (64, "torch"):
            r["timing"] = failed
    path.write_text(json.dumps(doc))

    def timing_of(hidden, provider):
        rows = json.loads(path.read_text())["rows"]
        return [r["timing"] for r in rows if r.get("kind") == "op"
                and (r["hidden"], r["provider"]) == (hidden, provider)]

    fused_norm.main([*args, "--hidden", "100", "--resume", "--redo"])
    assert timing_of(64, "torch") == [failed] and len(timing_of(100, "torch")) == 1
    fused_norm.main([*args, "--hidden", "64", "--resume"])
    assert timing_of(64, "torch") == ["perf_counter"]
    assert timing_of(64, "triton") == ["perf_counter"]


def test_redo_needs_a_resumed_sweep(capsys):
    with pytest.raises(SystemExit) as e:
        fused_norm.main(["--redo", "--group", "rms_norm"])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
