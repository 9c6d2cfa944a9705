"""The benchmarks' harness: flags as data, the default flow, chunk planning."""

import json
import pathlib
import re

import pytest

from colossal_lab import benchmarks
from colossal_lab.benchmarks import harness
from colossal_lab.benchmarks.harness import Benchmark, flag, opt, pack


def _bench(**kw) -> Benchmark:
    return Benchmark("toy", "A toy benchmark.\n\nMore.", quick_help="tiny",
                     options=[opt("--size", type=int, default=3), flag("name")],
                     run=lambda a: [{"size": a.size, "quick": a.quick}],
                     config=lambda a: {"size": a.size}, **kw)


def test_default_flow_saves_with_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    _bench(summary=lambda rows: f"{len(rows)} row").main(["--size", "5", "--name", "t"])
    out = capsys.readouterr().out
    assert "saved" in out and "1 row" in out
    (path,) = tmp_path.glob("*/t.json")
    doc = json.loads(path.read_text())
    assert doc["rows"] == [{"size": 5, "quick": False}] and doc["config"] == {"size": 5}
    assert doc["provenance"]["command"] == "python -m colossal_lab bench toy --size 5 --name t"


def test_quick_runs_and_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path))
    ran = []
    bench = Benchmark("toy", "Toy.", run=lambda a: ran.append(a.quick) or [])
    bench.main(["--quick"])
    assert ran == [True] and not list(tmp_path.rglob("*.json"))


def test_check_is_a_usage_error(capsys):
    bench = _bench(check=lambda a: "--size must be odd" if a.size % 2 == 0 else None)
    with pytest.raises(SystemExit) as e:
        bench.main(["--size", "4", "--quick"])
    assert e.value.code == 2 and "--size must be odd" in capsys.readouterr().err


def test_flag_overrides_the_shared_spec():
    flags, kw = flag("name", default="x", help="here")
    assert flags == ("--name",) and kw == {"default": "x", "help": "here"}
    assert harness.COMMON["name"][1]["help"] != "here"  # the shared spec is untouched


def test_at_least_and_types(capsys):
    bench = Benchmark("toy", "Toy.", options=[flag("iters"),
                                              opt("--m", type=harness.whole_at_least(2)),
                                              opt("--share", type=harness.share)],
                      check=harness.at_least(20), run=lambda a: [])
    for argv, says in ((["--iters", "5"], "at least 20 steps"), (["--m", "1"], "--m"),
                       (["--share", "1.5"], "--share"), (["--share", "nan"], "--share")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
    bench.main(["--quick", "--iters", "5", "--m", "2", "--share", "0.25"])


def test_pack_fills_chunks_in_order():
    cost = lambda chunk: 1.0 + sum(chunk)  # noqa: E731  (a start-up, then each item)
    assert pack([2, 2, 2, 5, 1], cost, 5.0) == [[2, 2], [2], [5], [1]]
    assert pack([], cost, 5.0) == []
    chunks = pack(list(range(10)), cost, 12.0)
    assert [x for c in chunks for x in c] == list(range(10))
    assert all(cost(c) <= 12.0 or len(c) == 1 for c in chunks)


def test_every_benchmark_declares_its_command_line_through_the_harness():
    """One argparse parser made in benchmarks/ (the harness's), and every registered
    benchmark's `main`."""
    folder = pathlib.Path(benchmarks.__file__).parent
    made = re.compile(r"(?<!class )\b\w*Parser\(")
    parsers = [p.name for p in folder.glob("*.py") for _ in made.finditer(p.read_text())]
    assert parsers == ["harness.py"]
    for name in benchmarks.BENCHMARKS:
        assert callable(benchmarks.get(name).main)


def test_spot_check_pairs_old_and_new_code():
    """A round of `spot_check --old-tree`: the ratio is old/new and the verdict is
    "level" only when each median lies inside the other's p10-p90."""
    from colossal_lab.benchmarks import spot_check

    def row(ms, lo, hi):
        return {"setup": "s", "preset": "tiny", "batch": 2, "seq_len": 64, "step_ms": ms,
                "step_ms_p10": lo, "step_ms_p90": hi, "steps_timed": 20}

    level = spot_check.pair_row("composed:s", 0, "abc", row(100, 98, 103), row(101, 99, 104))
    assert level["verdict"] == "level" and abs(level["speedup_new_vs_old"] - 100 / 101) < 1e-9
    faster = spot_check.pair_row("composed:s", 1, "abc", row(100, 98, 103), row(90, 89, 91))
    assert faster["verdict"] == "faster" and faster["speedup_new_vs_old"] > 1
    failed = spot_check.pair_row("composed:s", 0, "abc", {"error": "out of memory"},
                                 row(90, 89, 91))
    assert failed["error"] == "old: out of memory" and "verdict" not in failed


def test_spot_check_old_tree_must_hold_the_package(tmp_path, capsys):
    from colossal_lab.benchmarks import spot_check

    with pytest.raises(SystemExit) as e:
        spot_check.main(["--old-tree", str(tmp_path), "--checks", "composed:ours-bf16"])
    assert e.value.code == 2
    assert "no colossal_lab package" in capsys.readouterr().err
