"""Every committed results file is traceable (`colossal_lab.book.integrity`): derived fields
recompute, provenance is complete, and it is the provenance committed with the rows.
The tamper tests prove each check fails on a doctored copy in a throwaway repository."""

import copy
import json
import shutil
import subprocess

import pytest

from colossal_lab.book import integrity
from colossal_lab.measure.results import REPO_ROOT

FILES = integrity.committed_results(REPO_ROOT)
SOURCE = REPO_ROOT / "results" / "h200" / "baseline.json"  # step rows, runs' provenance
REL = "results/h200/baseline.json"


def _show(problems: list[str]) -> str:
    return "\n".join(problems)


def test_results_files_are_found():
    assert len(FILES) >= 5 and SOURCE in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_committed_results_file(path):
    problems = integrity.check_file(path, REPO_ROOT)
    assert not problems, _show(problems)


# ------------------------------------------------------------------ tamper tests


def git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout


def commit(repo, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def load(path) -> dict:
    return json.loads(path.read_text())


def save(path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


@pytest.fixture
def repo(tmp_path):
    """A throwaway repository holding one real results file, committed."""
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.name", "integrity test")
    git(tmp_path, "config", "user.email", "integrity@example.invalid")
    f = tmp_path / REL
    f.parent.mkdir(parents=True)
    shutil.copy(SOURCE, f)
    commit(tmp_path, "results: baseline")
    return tmp_path, f


def rerun(doc: dict, slower: float = 1.1) -> dict:
    """What an honest re-run writes: new step times, derived fields and provenance."""
    doc = copy.deepcopy(doc)
    for row in doc["rows"]:
        if "step_ms" in row:
            row["step_ms"] *= slower
            if "step_ms_all" in row:  # the raw steps too: the summary is made from them
                row["step_ms_all"] = [t * slower for t in row["step_ms_all"]]
            row.update(integrity.expected(row))
            row.update(integrity.expected(row))  # derived fields from the new summary
    doc["provenance"].update(git_sha="b" * 40, date="2026-12-01T00:00:00+00:00")
    return doc


def test_real_copy_is_clean(repo):
    root, f = repo
    assert integrity.check_file(f, root) == []
    assert integrity.check_all(root / "results", root) == {f: []}


def test_provenance_edited_and_committed_is_reported(repo):
    root, f = repo
    doc = load(f)
    doc["provenance"]["git_sha"] = "c" * 40  # rows untouched
    save(f, doc)
    assert any("git_sha" in p for p in integrity.check_history(f, root))  # uncommitted
    commit(root, "fix the commit by hand")
    problems = integrity.check_history(f, root)
    assert len(problems) == 1 and "git_sha" in problems[0] and "results: baseline" \
        in problems[0], problems
    assert integrity.check_rows(doc) == [] and integrity.check_provenance(doc) == []


def test_edited_mfu_is_reported(repo):
    _, f = repo
    doc = load(f)
    doc["rows"][1]["mfu"] *= 1.05
    problems = integrity.check_rows(doc)
    assert len(problems) == 1 and "row 1" in problems[0] and "mfu=" in problems[0]


def test_edited_step_time_is_reported_in_every_derived_field():
    doc = load(SOURCE)
    doc["rows"][0]["step_ms"] *= 0.9
    fields = {p.split(": ")[1].split("=")[0] for p in integrity.check_rows(doc)}
    assert {"tokens_per_s", "mfu", "mfu_attn", "hfu", "achieved_tflops"} <= fields


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_recomputed_field_catches_an_edit(path):
    """Each rule that recomputes a field of a real file catches a 1% edit of it."""
    doc = load(path)
    seen = set()
    for i, row in enumerate(doc["rows"]):
        for key in integrity.expected(row):
            if key in seen or not integrity._num(row.get(key)) or not row[key]:
                continue
            seen.add(key)
            bad = copy.deepcopy(doc)
            bad["rows"][i][key] = row[key] * 1.01 + (1 if isinstance(row[key], int) else 0)
            problems = integrity.check_rows(bad)
            assert any(f"row {i} " in p and f"{key}=" in p for p in problems), (key, problems)
    if path.name != "env.json":
        assert seen, f"{path} has no field the checks can recompute"


def test_deleted_torch_is_reported(repo):
    _, f = repo
    doc = load(f)
    del doc["provenance"]["torch"]
    assert integrity.check_provenance(doc) == ["provenance lacks torch"]
    doc["provenance"]["torch"] = ""
    assert integrity.check_provenance(doc) == ["provenance lacks torch"]


def test_provenance_rules():
    doc = load(SOURCE)
    p = doc["provenance"]
    assert integrity.check_provenance(doc) == []
    assert integrity.check_provenance({**doc, "provenance": {**p, "driver": None}}) \
        == ["provenance lacks driver"]
    cpu = {**p, "gpu": "CPU (x86_64, 8 threads)", "driver": None, "cuda": None}
    assert integrity.check_provenance({**doc, "provenance": cpu}) == []
    odd = {**p, "git_sha": "unknown", "gpu_count": 0, "note": "by hand"}
    problems = integrity.check_provenance({**doc, "provenance": odd})
    assert len(problems) == 3 and "note" in problems[0], problems
    assert integrity.check_provenance({"rows": []}) == ["no provenance"]


def test_genuine_rerun_is_clean(repo):
    root, f = repo
    save(f, rerun(load(f)))
    assert integrity.check_file(f, root) == []  # uncommitted re-run: nothing to compare
    commit(root, "re-run baseline")
    assert integrity.check_file(f, root) == []
    doc = load(f)  # a later commit that touches only the config is fine too
    doc["config"]["note"] = "reworded"
    save(f, doc)
    commit(root, "config note")
    assert integrity.check_history(f, root) == []


def test_never_committed_file_has_no_history(repo):
    root, f = repo
    new = root / "results" / "h200" / "new.json"
    shutil.copy(f, new)
    assert integrity.check_history(new, root) == []


def test_shallow_clone_says_history_is_unavailable(repo, tmp_path):
    root, f = repo
    doc = load(f)
    doc["config"]["note"] = "touches the file, not the rows"
    save(f, doc)
    commit(root, "config only")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{root}", str(shallow))
    problems = integrity.check_history(shallow / REL, shallow)
    assert len(problems) == 1 and problems[0].startswith("history unavailable"), problems
    save(f, rerun(doc))  # the commit that changed the rows and its parent are there
    commit(root, "re-run")
    shallow2 = tmp_path / "shallow2"
    git(tmp_path, "clone", "-q", "--depth", "2", f"file://{root}", str(shallow2))
    assert integrity.check_history(shallow2 / REL, shallow2) == []


def test_main_reports_and_fails(monkeypatch, capsys, repo):
    root, f = repo
    doc = load(f)
    doc["rows"][0]["mfu"] *= 2
    save(f, doc)
    monkeypatch.setattr(integrity, "REPO_ROOT", root)
    assert integrity.main() == 1
    out = capsys.readouterr().out
    assert REL in out and "mfu=" in out
