"""The attention benchmark runs end to end on tiny shapes (CPU smoke test; no speed claims)."""

from __future__ import annotations

import pytest
import torch

from colossal_lab.benchmarks import flash_attention as bench_fa


def test_flops_convention():
    # 4·B·H·S²·D, halved when causal; fwd+bwd counts 3.5× that
    assert bench_fa.attention_flops(4, 32, 4096, 128, causal=False) == 4 * 4 * 32 * 4096**2 * 128
    assert bench_fa.attention_flops(4, 32, 4096, 128, causal=True) == pytest.approx(
        0.5 * bench_fa.attention_flops(4, 32, 4096, 128, causal=False))
    assert bench_fa.FWD_BWD_FACTOR == 3.5
    # the sweep keeps B·S and H·D fixed; naive is skipped where it would not fit
    assert bench_fa.naive_gib(4, 32, 4096) < bench_fa.NAIVE_LIMIT_GIB
    assert bench_fa.naive_gib(2, 32, 8192) > bench_fa.NAIVE_LIMIT_GIB


def test_quick_run_rows(capsys):
    rows = bench_fa.run(quick=True)
    speed = [r for r in rows if r["kind"] == "speed"]
    assert {r["provider"] for r in speed} == set(bench_fa.QUICK_PROVIDERS)
    assert {r["causal"] for r in speed} == {True, False}
    fields = ("provider", "batch", "heads", "kv_heads", "layout", "seq_len", "head_dim",
              "causal", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "timing",
              "wall_s")
    for r in speed:
        assert "error" not in r, r
        for f in fields:
            assert f in r, (f, r)
        for f in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops"):
            assert r[f] > 0, (f, r)
        assert r["batch"] * r["seq_len"] == 64
        # every provider computes the same attention (fp32 on CPU)
        assert r["max_abs_err_vs_fp32"] < (1e-4 if not torch.cuda.is_available() else 1e-2)
    table = bench_fa.summary(rows)
    assert "triton" in table and "naive" in table
    capsys.readouterr()


def test_main_saves_with_provenance(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    bench_fa.main(["--quick", "--out-name", "fa_smoke", "--seq-lens", "32",
                   "--providers", "naive", "triton"])
    from colossal_lab.measure.results import load_results, results_dir

    (path,) = list(results_dir().glob("*/fa_smoke.json"))
    res = load_results("fa_smoke", gpu=path.parent.name)
    assert "bench flash_attention" in res.provenance["command"]
    assert {r["provider"] for r in res.rows} == {"naive", "triton"}
    assert res.config["flops_fwd_bwd"] == "3.5 x fwd"


# ------------------------------------------------------------- the sweep's cases


def test_sweep_holds_every_point_and_provider():
    """Issue #14's points: S x D x causal/full x MHA/GQA-4/GQA-8, at B·S = 16384 and
    H·D = 4096, with ours, cuDNN, SDPA-flash and Flex at every one."""
    cases = bench_fa.sweep_cases()
    speed = [c for c in cases if c.kind == "speed"]
    points = {(c.seq_len, c.head_dim, c.causal, c.layout) for c in speed}
    assert points == {(s, d, causal, lay) for s in (512, 1024, 2048, 4096, 8192, 16384)
                      for d in (64, 128, 256) for causal in (True, False)
                      for lay in ("mha", "gqa4", "gqa8")}
    assert len(speed) == len(points)  # each once
    for c in speed:
        assert set(bench_fa.SWEEP_PROVIDERS) <= set(c.providers), c
        assert c.batch * c.seq_len == 16384 and c.heads * c.head_dim == 4096
        assert c.heads // c.kv_heads == {"mha": 1, "gqa4": 4, "gqa8": 8}[c.layout]
    canon = [c for c in speed if (c.seq_len, c.head_dim, c.causal) == (4096, 128, True)]
    assert {c.layout for c in canon} == {"mha", "gqa4", "gqa8"}
    for c in canon:  # the chapter's extra providers, at the canonical point only
        assert set(bench_fa.CANONICAL_EXTRAS) <= set(c.providers)
    assert sum(len(c.providers) for c in speed) == \
        4 * len(speed) + len(bench_fa.CANONICAL_EXTRAS) * 3
    c0 = bench_fa.CANONICAL
    assert any((c.batch, c.heads, c.kv_heads, c.seq_len, c.head_dim, c.causal)
               == (c0["batch"], c0["heads"], c0["heads"], c0["seq_len"], c0["head_dim"],
                   c0["causal"]) for c in canon)
    mem = [c for c in cases if c.kind == "memory"]
    assert [c.seq_len for c in mem] == list(bench_fa.MEM_SEQ_LENS)


def test_flex_compiles_once_per_series(monkeypatch):
    """"flex" compiles once per (D, causal, group, dtype) with dynamic shapes and reuses
    it across sequence lengths; a new series, or "flex-static" (one static compile per
    shape), resets the compiler first."""
    compiles, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: compiles.append(dynamic)
                        or (lambda *a, **k: dynamic))
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    monkeypatch.setattr(bench_fa, "_FLEX_COMPILED", {})

    def run(batch, seq, dim=64, group=1, static=False):
        q = torch.empty(batch, 4, seq, dim)
        k = torch.empty(batch, 4 // group, seq, dim)
        return bench_fa._flex_fn(q, k, k, False, static=static)()

    assert [run(4, 512), run(2, 1024), run(1, 2048)] == [True] * 3
    assert (compiles, len(resets)) == ([True], 1)  # one dynamic compile for the series
    run(4, 512, group=2)  # another layout: its own compile
    assert (compiles, len(resets)) == ([True, True], 2)
    assert run(2, 1024, group=2, static=True) is False  # one shape, compiled statically
    assert (compiles[-1], len(resets)) == (False, 3)
    run(1, 2048, group=2)  # the series compiles again after a static compile's reset
    assert (compiles[-1], len(resets)) == (True, 4)
    assert "flex-static" in bench_fa.config_of()["flex_compile"]


def test_filters_narrow_the_sweep():
    (case,) = bench_fa.sweep_cases(seq_lens=(1024,), head_dims=(64,), layouts=("gqa8",),
                                   causal="full")
    assert (case.heads, case.kv_heads, case.batch, case.causal) == (64, 8, 16, False)
    assert case.providers == bench_fa.SWEEP_PROVIDERS
    named = bench_fa.sweep_cases(providers=("triton", "cudnn"), head_dims=(128,),
                                 causal="causal", memory=False)
    assert {c.providers for c in named} == {("triton", "cudnn")}  # no extras
    assert len(named) == 6 * 3
    mem = bench_fa.sweep_cases(providers=("triton", "cudnn"), head_dims=(128,))
    assert {c.providers for c in mem if c.kind == "memory"} == {("triton",)}
    assert not [c for c in bench_fa.sweep_cases(layouts=("gqa4",)) if c.kind == "memory"]
    no_flex = bench_fa.sweep_cases(exclude=("flex",))  # a first pass without compiles
    assert not [c for c in no_flex if "flex" in c.providers]
    assert len(no_flex) == len(bench_fa.sweep_cases())
    assert any(set(bench_fa.CANONICAL_EXTRAS) <= set(c.providers) for c in no_flex)
    with pytest.raises(ValueError, match="multiple of 4"):
        bench_fa.sweep_cases(quick=True, layouts=("gqa4",))  # H=2 in the smoke test
    with pytest.raises(ValueError, match="does not divide"):
        bench_fa.sweep_cases(head_dims=(96,))


def test_pending_keeps_what_is_measured():
    """Resuming: a row without an error is done (a skipped one too); an errored one runs
    again; a case with nothing left is dropped."""
    cases = bench_fa.sweep_cases(seq_lens=(1024, 2048), head_dims=(128,), layouts=("mha",),
                                 causal="causal", memory=False)
    c1, c2 = cases

    def row(case, provider, **extra):
        return {"kind": "speed", "provider": provider, "batch": case.batch,
                "heads": case.heads, "kv_heads": case.kv_heads, "seq_len": case.seq_len,
                "head_dim": case.head_dim, "causal": case.causal, "dtype": "bfloat16",
                **extra}

    done = [row(c1, p) for p in c1.providers] + [
        row(c2, "triton"), row(c2, "cudnn", error="RuntimeError: x"),
        row(c2, "flex", skipped="needs CUDA"),
        {**row(c2, "sdpa-flash"), "head_dim": 64}]  # another point: not this one's
    (left,) = bench_fa.pending(cases, done)
    assert left.seq_len == 2048 and left.providers == ("cudnn", "sdpa-flash")


def test_redo_replaces_the_selected_points_and_keeps_the_rule_it_replaced(capsys):
    """--redo: the selected points' rows go (measured again, all their providers side by
    side); the rest stay; a changed kernel rule is accepted only with may_change, and
    the earlier rule is kept in resumed_from."""
    from colossal_lab.measure.results import resumed_rows

    c1024, c2048 = bench_fa.sweep_cases(seq_lens=(1024, 2048), head_dims=(128,),
                                        layouts=("mha",), causal="full", memory=False)

    def row(case, provider):
        return {"kind": "speed", "provider": provider, "batch": case.batch,
                "heads": case.heads, "kv_heads": case.kv_heads, "seq_len": case.seq_len,
                "head_dim": case.head_dim, "causal": case.causal, "dtype": "bfloat16"}

    rows = [row(c, p) for c in (c1024, c2048) for p in ("triton", "cudnn")]
    rows.append({"kind": "ceiling"})
    left = bench_fa.redone([c1024], rows)
    assert [r.get("seq_len") for r in left] == [2048, 2048, None]
    (todo,) = bench_fa.pending([c1024], left)
    assert set(todo.providers) == set(c1024.providers)

    def error(msg):
        raise SystemExit(msg)

    recorded = {"config": {"triton": {"min_seq_len": 2048}, "tokens": 1},
                "provenance": {"git_sha": "abc"}, "rows": rows}
    now = {"triton": {"min_seq_len": 1024}, "tokens": 1}
    with pytest.raises(SystemExit, match="triton"):
        resumed_rows("fa", recorded, now, error)
    kept, config = resumed_rows("fa", recorded, now, error, may_change=("triton",))
    assert len(kept) == len(rows) and config["triton"] == {"min_seq_len": 1024}
    assert config["resumed_from"] == [{"git_sha": "abc",
                                       "config_then": {"triton": {"min_seq_len": 2048}}}]
    with pytest.raises(SystemExit, match="tokens"):  # only the named entry may change
        resumed_rows("fa", recorded, {**now, "tokens": 2}, error, may_change=("triton",))
    _, same = resumed_rows("fa", recorded, recorded["config"], error,
                           may_change=("triton",))
    assert same["resumed_from"] == [{"git_sha": "abc"}]  # unchanged: nothing to keep
    # failed rows: measured again where the run covers them (`retry`), kept elsewhere
    failed = [dict(row(c1024, "triton"), error="boom"),
              dict(row(c2048, "triton"), timing="cuda_graph/events (capture failed: X)")]
    recorded_failed = {**recorded, "rows": [*rows[1:3], *failed]}
    everything, _ = resumed_rows("fa", recorded_failed, recorded["config"], error)
    assert all("error" not in r and "timing" not in r for r in everything)
    selected = {c1024.key(p) for p in c1024.providers}
    kept, _ = resumed_rows("fa", recorded_failed, recorded["config"], error,
                           retry=lambda r: bench_fa.row_key(r) in selected)
    assert [r for r in kept if "timing" in r or "error" in r] == [
        dict(failed[1], measured_at="abc")]
    with pytest.raises(SystemExit):
        bench_fa.main(["--redo", "--dry-run"])
    assert "use it with --resume" in capsys.readouterr().err


def test_a_provider_that_cannot_take_the_case_is_recorded_as_skipped():
    """PyTorch's memory-efficient kernel has no grouped-query heads. An error row it left
    at a GQA point (before the rule) is dropped on resume, as every error row is; the
    provider stays pending, so the resumed run records it as skipped, with why, at no
    cost and without running it; a skipped row is done."""
    (gqa,) = bench_fa.sweep_cases(seq_lens=(4096,), head_dims=(128,), layouts=("gqa4",),
                                  causal="causal", memory=False)
    gqa = bench_fa.Case(**{**gqa.__dict__, "providers": ("sdpa-efficient", "cudnn")})
    assert "grouped-query" in bench_fa._static_skip("sdpa-efficient", gqa)
    mha = bench_fa.Case(**{**gqa.__dict__, "kv_heads": gqa.heads})
    assert bench_fa._static_skip("sdpa-efficient", mha) is None
    err = {"kind": "speed", "provider": "sdpa-efficient", "batch": gqa.batch,
           "heads": gqa.heads, "kv_heads": gqa.kv_heads, "seq_len": gqa.seq_len,
           "head_dim": gqa.head_dim, "causal": gqa.causal, "dtype": "bfloat16",
           "error": "RuntimeError: No available kernel."}
    (left,) = bench_fa.pending([gqa], [err])
    assert left.providers == ("sdpa-efficient", "cudnn")
    assert bench_fa.provider_s("sdpa-efficient", gqa) == 0.0
    small = bench_fa.Case(**{**gqa.__dict__, "batch": 1, "heads": 4, "kv_heads": 1,
                             "seq_len": 64, "head_dim": 64,
                             "providers": ("sdpa-efficient",)})
    (row,) = bench_fa.run_cases([small])
    assert row["skipped"] == bench_fa._static_skip("sdpa-efficient", gqa)
    assert "fwd_ms" not in row and "error" not in row
    assert bench_fa.pending([small], [row]) == []  # a skipped row is done


def test_chunks_cover_the_sweep_once_within_budget():
    chunks = bench_fa.plan_chunks(500.0)
    assert all(c["s"] <= 500 for c in chunks)
    keys = []
    for c in chunks:
        filters = {k: v for k, v in c.items() if k != "s"}
        for case in bench_fa.sweep_cases(**filters):
            keys += [case.key(p) for p in case.providers]
    everything = [case.key(p) for case in bench_fa.sweep_cases() for p in case.providers]
    assert sorted(keys) == sorted(everything)  # every provider run once, none twice
    argv = bench_fa.chunk_argv(chunks[0])
    assert argv[:4] == ["--head-dims", "128", "--causal", "causal"]


def test_dry_run_lists_cases_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no(*a, **k):
        raise AssertionError("--dry-run measured something")

    monkeypatch.setattr(bench_fa, "measure_case", no)
    monkeypatch.setattr(bench_fa, "measure_memory", no)
    bench_fa.main(["--dry-run", "--chunk-s", "500"])
    out = capsys.readouterr().out
    n = len(bench_fa.sweep_cases())
    assert f"{n} cases" in out and "estimate" in out
    assert "speed B=4 H=32 Hkv=8 S=4096 D=128 causal" in out
    commands = [ln for ln in out.splitlines() if "bench flash_attention --" in ln]
    assert len(commands) == len(bench_fa.plan_chunks(500.0))
    assert "--resume" not in commands[0] and all("--resume" in c for c in commands[1:])
    assert not list(tmp_path.rglob("*.json"))


# ------------------------------------------------------------ measuring, resuming


def test_grouped_query_and_skips_on_cpu(capsys):
    """Hkv < Hq goes to every provider as it is (ours natively, SDPA with enable_gqa);
    a provider that cannot run here is a skipped row, never SDPA under its name."""
    rows = bench_fa.measure_case(1, 4, 32, 32, True, ("naive", "sdpa", "triton", "cudnn",
                                                      "sdpa-flash", "flex"),
                                 kv_heads=2, dtype=torch.float32, quick=True)
    by = {r["provider"]: r for r in rows}
    for p in ("naive", "sdpa", "triton"):
        assert "error" not in by[p], by[p]
        assert by[p]["layout"] == "gqa2" and by[p]["kv_heads"] == 2
        assert by[p]["timing"] == "perf_counter"
        assert by[p]["max_abs_err_vs_fp32"] < 1e-4
    for p in ("cudnn", "sdpa-flash", "flex"):
        assert "fwd_ms" not in by[p] and by[p]["skipped"], by[p]
    capsys.readouterr()


def test_rounds_time_the_providers_in_turns(monkeypatch, capsys):
    """With rounds, every round measures the case's providers once, the order rotated
    from round to round; each row is its first round's with the median of the rounds'
    timings; a pass not timed in every round keeps the first round's, a failed provider
    its error."""
    ms = {"triton": [3.0, 1.0, 2.0], "sdpa": [5.0, 9.0, 4.0], "naive": [None] * 3}
    orders = []

    def measure_case(b, h, s, d, causal, providers, **kw):
        orders.append(list(providers))
        n = len(orders) - 1
        rows = []
        for p in providers:
            row = {"kind": "speed", "provider": p, "seq_len": s, "timing": "cuda_graph",
                   "round": n, "max_abs_err_vs_fp32": 0.0}
            if p == "naive":
                row["error"] = "no kernel"
            else:
                row.update(fwd_ms=ms[p][n], fwd_tflops=1.0)
                if p == "triton" or n == 0:  # sdpa's fwd+bwd: first round only
                    row.update(fwd_bwd_ms=3 * ms[p][n], fwd_bwd_tflops=1.0)
            rows.append(row)
        return rows

    monkeypatch.setattr(bench_fa, "measure_case", measure_case)
    case = bench_fa.Case(1, 2, 2, 16, 32, False, ("naive", "triton", "sdpa"))
    rows = bench_fa.measure_in_turns(case, 3)
    assert orders == [["naive", "triton", "sdpa"], ["triton", "sdpa", "naive"],
                      ["sdpa", "naive", "triton"]]
    by = {r["provider"]: r for r in rows}
    assert [r["provider"] for r in rows] == ["naive", "triton", "sdpa"]
    assert by["naive"]["error"] == "no kernel" and "rounds" not in by["naive"]
    assert by["triton"]["round"] == 0 and by["triton"]["fwd_ms_rounds"] == [3.0, 1.0, 2.0]
    assert by["triton"]["fwd_ms"] == 2.0 and by["triton"]["fwd_bwd_ms"] == 6.0
    assert by["triton"]["fwd_tflops"] == pytest.approx(
        bench_fa.tflops(bench_fa.attention_flops(1, 2, 16, 32, False), 2.0))
    assert by["sdpa"]["fwd_ms"] == 5.0 and by["sdpa"]["fwd_bwd_ms"] == 15.0
    assert "fwd_bwd_ms_rounds" not in by["sdpa"]
    assert by["triton"]["rounds"] == 3 and "median of 3 rounds" in by["triton"]["timing"]
    orders.clear()  # one round: measure_case once, its rows as they are
    one = bench_fa.measure_in_turns(case, 1)
    assert orders == [["naive", "triton", "sdpa"]]
    assert [r.get("fwd_ms") for r in one] == [None, 3.0, 5.0]
    assert all("rounds" not in r for r in one)
    capsys.readouterr()


def test_a_failing_provider_says_why(monkeypatch, capsys):
    """SDPA restricted to one kernel raises "No available kernel" and warns why: the
    row's error carries both. A provider whose backward fails keeps its forward."""
    import warnings

    from colossal_lab.ops.attention import attention_ref

    def make_fn(provider, q, k, v, causal):
        def fails():
            warnings.warn("Flash attention kernel not used because head_dim > 256",
                          stacklevel=2)
            raise RuntimeError("No available kernel. Aborting execution.")

        def forward_only():  # no graph to differentiate: its fwd+bwd raises
            return attention_ref(q.detach(), k.detach(), v.detach(), causal)

        return fails if provider == "naive" else forward_only

    monkeypatch.setattr(bench_fa, "make_fn", make_fn)
    failed, fwd_only = bench_fa.measure_case(1, 2, 16, 32, False, ("naive", "sdpa"),
                                             dtype=torch.float32, quick=True)
    assert failed["error"].startswith("RuntimeError: No available kernel")
    assert "head_dim > 256" in failed["error"]
    assert "fwd_tflops" not in failed
    assert "error" not in fwd_only and fwd_only["fwd_tflops"] > 0
    assert "fwd_bwd_tflops" not in fwd_only and "grad" in fwd_only["fwd_bwd_error"]
    assert "fwd+bwd failed" in bench_fa._format(fwd_only)
    checks = bench_fa.targets([{**fwd_only, "provider": p, "seq_len": 1024}
                               for p in ("triton", "cudnn")])
    assert [c["status"] for c in checks if c["check"] != "canonical"] == [
        "met", "not measured"]
    capsys.readouterr()


def test_resume_measures_only_what_is_missing(tmp_path, monkeypatch, capsys):
    import json

    from colossal_lab.measure.results import load_results, results_dir

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    base = ["--quick", "--out-name", "fa_resume", "--providers", "naive", "sdpa"]
    bench_fa.main([*base, "--seq-lens", "32", "--causal", "causal"])
    (path,) = list(results_dir().glob("*/fa_resume.json"))
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == 2 and all("timing" in r for r in doc["rows"])
    doc["rows"][1] = {**doc["rows"][1], "error": "RuntimeError: flaky"}  # sdpa failed
    for k in ("fwd_ms", "fwd_tflops"):
        doc["rows"][1].pop(k)
    path.write_text(json.dumps(doc))
    first = doc["provenance"]

    measured = []
    real = bench_fa.measure_case
    monkeypatch.setattr(bench_fa, "measure_case", lambda *a, **k: measured.append(
        (a[2], tuple(a[5]))) or real(*a, **k))
    bench_fa.main([*base, "--seq-lens", "32", "64", "--causal", "causal", "--resume"])
    assert measured == [(32, ("sdpa",)), (64, ("naive", "sdpa"))]
    res = load_results("fa_resume", gpu=path.parent.name)
    assert [(r["seq_len"], r["provider"]) for r in res.rows] == [
        (32, "naive"), (32, "sdpa"), (64, "naive"), (64, "sdpa")]
    assert not [r for r in res.rows if "error" in r]
    assert res.rows[0]["measured_at"] == first["git_sha"]  # kept, with its commit
    assert "measured_at" not in res.rows[1]  # measured by this invocation
    assert res.config["resumed_from"] == [first]
    assert "--resume" in res.provenance["command"]
    with pytest.raises(SystemExit):  # another configuration: refused, file untouched
        bench_fa.main([*base, "--seq-lens", "32", "--timing", "events", "--resume"])
    assert len(load_results("fa_resume", gpu=path.parent.name).rows) == 4
    with pytest.raises(SystemExit):  # nothing to resume
        bench_fa.main(["--quick", "--out-name", "fa_none", "--resume"])
    capsys.readouterr()


# -------------------------------------------------------------------------- targets


def _speed(provider, s=4096, d=128, kv=32, causal=True, fwd=400.0, all_=300.0, **extra):
    return {"kind": "speed", "provider": provider, "batch": 16384 // s, "heads": 4096 // d,
            "kv_heads": kv, "seq_len": s, "head_dim": d, "causal": causal,
            "fwd_tflops": fwd, "fwd_bwd_tflops": all_, **extra}


def test_targets_met_missed_and_not_measured():
    rows = [_speed("triton", fwd=460, all_=400), _speed("cudnn", fwd=500, all_=480),
            _speed("triton", s=512, fwd=100), _speed("cudnn", s=512, fwd=500),  # S < 1k
            _speed("triton", s=2048, kv=8, fwd=430, all_=300),
            _speed("cudnn", s=2048, kv=8, fwd=500, all_=400),
            _speed("triton", s=8192),  # no cuDNN row at all
            _speed("triton", s=16384, d=256, kv=16),
            {**_speed("cudnn", s=16384, d=256, kv=16, fwd=None, all_=None),
             "error": "RuntimeError: No available kernel"}]
    checks = bench_fa.targets(rows)
    canon = {c["metric"]: c for c in checks if c["check"] == "canonical"}
    assert canon["fwd"]["ratio"] == pytest.approx(0.92) and canon["fwd"]["status"] == "met"
    assert canon["fwd_bwd"]["ratio"] == pytest.approx(400 / 480)
    assert canon["fwd_bwd"]["status"] == "not met" and canon["fwd"]["target"] == 0.90
    long = {(c["seq_len"], c["head_dim"], c["layout"], c["metric"]): c for c in checks
            if c["check"] != "canonical"}
    assert 512 not in {k[0] for k in long}  # S >= 1024 only
    assert long[(2048, 128, "gqa4", "fwd")]["status"] == "met"  # 0.86 >= 0.85
    assert long[(2048, 128, "gqa4", "fwd_bwd")]["status"] == "not met"  # 0.75
    assert long[(4096, 128, "mha", "fwd")]["target"] == 0.85
    missing = long[(8192, 128, "mha", "fwd")]
    assert missing["status"] == "not measured" and missing["ratio"] is None
    assert "cudnn: no row" in missing["why"]
    failed = long[(16384, 256, "mha", "fwd_bwd")]
    assert failed["status"] == "not measured" and "No available kernel" in failed["why"]
    text = bench_fa.targets_summary(checks)
    assert "canonical fwd 0.92 (met" in text and "not measured" in text
    # nothing measured at the canonical point: said, not invented
    empty = bench_fa.targets([])
    assert [c["status"] for c in empty] == ["not measured", "not measured"]
    # a figure timed by a fallback (the graph capture failed) counts as no figure
    fell = "cuda_graph/events (capture failed: RuntimeError)"
    checks = bench_fa.targets([_speed("triton", fwd=460, all_=400),
                               _speed("cudnn", fwd=500, all_=480, timing=fell)])
    canon = {c["metric"]: c for c in checks if c["check"] == "canonical"}
    assert canon["fwd"]["status"] == "not measured" and canon["fwd"]["ratio"] is None
    assert canon["fwd"]["why"] == f"cudnn: {fell}"


def test_dry_run_resume_plans_what_a_gpu_file_lacks(tmp_path, monkeypatch, capsys):
    """`--dry-run --resume --gpu h200` on a CPU: the cases the recorded file lacks,
    the estimate corrected by the `wall_s` its rows recorded (`calibration`)."""
    from colossal_lab.measure.results import save_results

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    first = bench_fa.sweep_cases(head_dims=(128,), causal="causal", layouts=("mha",),
                                 memory=False)
    rows = []
    for case in first:
        for p in case.providers:
            rows.append({"kind": "speed", "provider": p, "batch": case.batch,
                         "heads": case.heads, "kv_heads": case.kv_heads,
                         "seq_len": case.seq_len, "head_dim": case.head_dim,
                         "causal": case.causal, "dtype": "bfloat16", "fwd_tflops": 1.0,
                         "wall_s": 2 * bench_fa.provider_s(p, case)})
    save_results("flash_attention", rows, config=bench_fa.config_of(), gpu="h200")
    scale = bench_fa.calibration(rows)
    assert scale["flex"] == pytest.approx(2.0) and set(scale) >= {"triton", "cudnn"}
    bench_fa.main(["--dry-run", "--resume", "--gpu", "h200", "--chunk-s", "500"])
    out = capsys.readouterr().out
    left = bench_fa.pending(bench_fa.sweep_cases(), rows)
    assert f"{len(left)} cases" in out and "calibrated" in out
    assert "speed B=4 H=32 Hkv=32 S=4096 D=128 causal" not in out  # recorded: not listed
    assert "speed B=4 H=32 Hkv=8 S=4096 D=128 causal" in out
    commands = [ln for ln in out.splitlines() if "bench flash_attention --" in ln]
    assert commands and all("--resume" in c for c in commands)
    mha = [c for c in commands if "--head-dims 128 --causal causal --layouts mha " in c]
    assert len(mha) == 1  # what is left there: the memory rows
    chunks = bench_fa.plan_chunks(500.0, done=rows, scale=scale)
    assert all(c["s"] <= 500 for c in chunks)


def test_resume_accepts_a_grown_provider_list_only():
    """A sweep whose canonical extras gained a provider resumes (the new provider is
    what the resuming run measures); one that lost a provider, or changed anything
    else, is refused."""
    from colossal_lab.measure.results import resumed_rows

    def error(msg):
        raise SystemExit(msg)

    recorded = {"config": {"canonical_extras": ["naive", "triton-atomic"], "tokens": 1},
                "provenance": {"git_sha": "abc"}, "rows": [{"provider": "naive"}]}
    grown = {"canonical_extras": ("naive", "triton-portable", "triton-atomic"), "tokens": 1}
    kept, config = resumed_rows("fa", recorded, grown, error, grown=("canonical_extras",))
    assert kept == [{"provider": "naive", "measured_at": "abc"}]
    assert config["canonical_extras"] == grown["canonical_extras"]
    assert config["resumed_from"] == [{"git_sha": "abc"}]
    with pytest.raises(SystemExit, match="canonical_extras"):  # not grown without leave
        resumed_rows("fa", recorded, grown, error)
    with pytest.raises(SystemExit, match="canonical_extras"):  # shrunk
        resumed_rows("fa", recorded, {"canonical_extras": ("naive",), "tokens": 1}, error,
                     grown=("canonical_extras",))
    with pytest.raises(SystemExit, match="tokens"):
        resumed_rows("fa", recorded, {**grown, "tokens": 2}, error,
                     grown=("canonical_extras",))
