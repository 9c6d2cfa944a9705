"""The book's outputs are current (`integrity.check_notebook`): every `show_source`
output equals the library's source today, and every results banner names the commit
its results file records. Tamper tests on synthetic notebooks prove both checks fail."""

import json

import pytest

from colossal_lab.book import integrity, notebook
from colossal_lab.book.notebook import SOURCE_KEY, show_source, source_text
from colossal_lab.kernels import rms_norm
from colossal_lab.measure import mfu, results
from colossal_lab.measure.results import REPO_ROOT

nbformat = pytest.importorskip("nbformat")
v4 = nbformat.v4

NOTEBOOKS = sorted((REPO_ROOT / "book").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_outputs_are_current(path):
    problems = integrity.check_notebook(path)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ helpers


def source_output(obj, lines=None, execution_count=1):
    """The output `show_source(obj, lines)` leaves in a notebook."""
    data, meta = show_source(obj, lines)._repr_mimebundle_()
    return v4.new_output("execute_result", data=data, metadata=meta,
                         execution_count=execution_count)


def write_nb(path, cells):
    """`cells`: (source, outputs) pairs of code cells."""
    nb = v4.new_notebook(cells=[v4.new_code_cell(src, outputs=outs) for src, outs in cells])
    nbformat.write(nb, path)
    return path


def demo_results(root, sha="a" * 40, date="2026-11-30T05:52:57+00:00"):
    """A results file under `root`/results, and its `Results`."""
    path = root / "results" / "h200" / "demo.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prov = {"gpu": "NVIDIA H200", "gpu_count": 1, "git_sha": sha, "date": date,
            "command": "python -m colossal_lab bench demo"}
    path.write_text(json.dumps({"name": "demo", "provenance": prov, "rows": [{"a": 1}]}))
    return path, results.Results("demo", prov, [{"a": 1}], path=path)


def set_provenance(path, **changes):
    doc = json.loads(path.read_text())
    doc["provenance"].update(changes)
    path.write_text(json.dumps(doc))


# ------------------------------------------------------------------ show_source


def test_show_source_records_what_it_showed():
    data, meta = show_source(mfu.count_params)._repr_mimebundle_()
    assert data["text/plain"] == source_text(mfu.count_params)
    assert data["text/plain"].startswith("def count_params(")
    assert "<style>" in data["text/html"] and "Verbatim" in data["text/latex"]
    assert meta == {SOURCE_KEY: {"source_of": "colossal_lab.measure.mfu:count_params",
                                 "lines": None}}
    _, meta = show_source(mfu.StepStats.__str__, lines=(0, 2))._repr_mimebundle_()
    assert meta[SOURCE_KEY] == {"source_of": "colossal_lab.measure.mfu:StepStats.__str__",
                                "lines": [0, 2]}


def test_show_source_unwraps_triton_kernels():
    shown = show_source(rms_norm._rms_norm_forward_kernel)
    assert shown.source_of == "colossal_lab.kernels.rms_norm:_rms_norm_forward_kernel"
    assert "@triton.jit" in shown.source and "def _rms_norm_forward_kernel" in shown.source


def test_fresh_source_outputs_pass(tmp_path):
    nb = write_nb(tmp_path / "fresh.ipynb", [
        ("from colossal_lab.book.notebook import show_source", []),
        ("show_source(mfu.count_params)", [source_output(mfu.count_params)]),
        ("show_source(mfu.layer_params, lines=(1, 4))",
         [source_output(mfu.layer_params, (1, 4))]),
        ("show_source(rms_norm._rms_norm_backward_kernel)",
         [source_output(rms_norm._rms_norm_backward_kernel)]),
    ])
    assert integrity.check_notebook(nb) == []


def test_edited_source_output_is_reported(tmp_path):
    out = source_output(mfu.count_params)
    out["data"]["text/plain"] = out["data"]["text/plain"].replace("6", "8", 1) + "  # old"
    nb = write_nb(tmp_path / "stale.ipynb", [("show_source(mfu.count_params)", [out])])
    problems = integrity.check_notebook(nb)
    assert len(problems) == 1 and "colossal_lab.measure.mfu:count_params" in problems[0]
    assert "cell 0" in problems[0]


def test_wrong_lines_are_reported(tmp_path):
    out = source_output(mfu.layer_params, (1, 4))
    out["metadata"][SOURCE_KEY]["lines"] = [2, 5]
    nb = write_nb(tmp_path / "lines.ipynb", [("show_source(mfu.layer_params)", [out])])
    assert len(integrity.check_notebook(nb)) == 1


def test_output_without_metadata_is_stale(tmp_path):
    out = source_output(mfu.count_params)
    out["metadata"] = {}  # as before show_source recorded anything
    nb = write_nb(tmp_path / "old.ipynb", [("show_source(mfu.count_params)", [out]),
                                          ("x = 1  # show_source(x) in a comment", [])])
    problems = integrity.check_notebook(nb)
    assert len(problems) == 1 and "cell 0" in problems[0] and "stale" in problems[0]


def test_vanished_object_is_reported(tmp_path):
    out = source_output(mfu.count_params)
    out["metadata"][SOURCE_KEY]["source_of"] = "colossal_lab.measure.mfu:count_parameters"
    nb = write_nb(tmp_path / "gone.ipynb", [("show_source(mfu.count_params)", [out])])
    problems = integrity.check_notebook(nb)
    assert len(problems) == 1 and "cannot find" in problems[0]


# ------------------------------------------------------------------ banners


def test_banner_format():
    for path in sorted(REPO_ROOT.glob("results/*/*.json")):
        res = results.load_results(path.stem, gpu=path.parent.name)
        text = res.banner()
        lines = text.splitlines()
        rel = path.relative_to(REPO_ROOT).as_posix()
        assert len(lines) == 2 and all(len(x) <= results.BANNER_WIDTH for x in lines), text
        assert lines[0] == (f"{results.BANNER_PREFIX}{rel} (recorded, commit "
                            f"{res.provenance['git_sha'][:10]})")
        assert res.provenance["gpu"] in lines[1] and res.provenance["date"][:10] in lines[1]
        res.live = True
        assert "(measured live, commit" in res.banner()


def test_banner_of_current_file_passes_and_stale_one_fails(tmp_path):
    path, res = demo_results(tmp_path)
    nb = write_nb(tmp_path / "b.ipynb", [
        ("res = results.measure_or_load('demo', run)",
         [v4.new_output("stream", name="stdout", text=res.banner() + "\n")])])
    assert integrity.check_notebook(nb, repo_root=tmp_path) == []
    set_provenance(path, date="2026-12-01T01:00:00+00:00")  # same commit, re-run
    problems = integrity.check_notebook(nb, repo_root=tmp_path)
    assert len(problems) == 1 and "dates" in problems[0], problems
    set_provenance(path, git_sha="b" * 40)
    problems = integrity.check_notebook(nb, repo_root=tmp_path)
    assert any("commit aaaaaaaaaa" in p and "bbbbbbbbbb" in p for p in problems), problems


def test_banner_naming_a_missing_or_no_file_fails(tmp_path):
    _, res = demo_results(tmp_path)
    text = res.banner()
    unsaved = results.Results("demo", res.provenance, []).banner()
    nb = write_nb(tmp_path / "b.ipynb", [
        ("print(1)", [v4.new_output("stream", name="stdout",
                                    text=text.replace("demo.json", "gone.json"))]),
        ("print(2)", [v4.new_output("stream", name="stdout", text=unsaved)]),
        ("print(3)", [v4.new_output("stream", name="stdout", text=(
            "Recorded on 1 x NVIDIA H200 on 2026-11-30 (torch 2.11.0, triton 3.6.0, "
            "CUDA 13.0, driver 580, commit 3e7c066aa3) by `x`\n"))]),
    ])
    problems = integrity.check_notebook(nb, repo_root=tmp_path)
    assert len(problems) == 3, problems
    assert "cell 0" in problems[0] and "cell 1" in problems[1] and "old format" in problems[2]


# ------------------------------------------------------------------ captions


def caption_output(res):
    data, meta = notebook.Caption(res)._repr_mimebundle_()
    return v4.new_output("display_data", data=data, metadata=meta)


def test_caption_shows_gpu_and_file_and_no_commit(tmp_path):
    _, res = demo_results(tmp_path)
    data, meta = notebook.Caption(res)._repr_mimebundle_()
    assert data["text/plain"] == f"Measured on NVIDIA H200 · {res._file_label()}"
    assert 'href="measurements.html#' in data["text/html"] and "aaaaaaa" not in str(data)
    assert meta[SOURCE_KEY]["git_sha"] == "a" * 40


def test_caption_of_current_file_passes_and_stale_one_fails(tmp_path):
    path, res = demo_results(tmp_path)
    res.path = path
    out = caption_output(res)
    out["metadata"][SOURCE_KEY]["results"] = "results/h200/demo.json"
    nb = write_nb(tmp_path / "c.ipynb", [("res = results.measure_or_load('demo', run)",
                                          [out])])
    assert integrity.check_notebook(nb, repo_root=tmp_path) == []
    set_provenance(path, date="2026-12-01T01:00:00+00:00")
    problems = integrity.check_notebook(nb, repo_root=tmp_path)
    assert len(problems) == 1 and "dates" in problems[0], problems
    set_provenance(path, git_sha="b" * 40)
    problems = integrity.check_notebook(nb, repo_root=tmp_path)
    assert len(problems) == 1 and "bbbbbbbbbb" in problems[0], problems


def test_table_shows_failures_as_a_dash_and_a_footnote():
    md = notebook.table([{"setup": "b3", "batch": 3, "error": "OutOfMemoryError: CUDA "
                          "out of memory. Tried to allocate 7.83 GiB"},
                         {"setup": "fa", "ms": 1.5},
                         {"setup": "fa2", "error": "ImportError: No module named "
                          "'flash_attn'"}],
                        {"setup": None, "ms": ".1f"}, headers={"ms": "|g − g_ref| ms"}).data
    lines = md.splitlines()
    assert lines[0] == "| setup | \\|g − g_ref\\| ms |"
    assert lines[2] == "| b3 | —¹ |" and lines[3] == "| fa | 1.5 |" and lines[4] == "| fa2 | —² |"
    assert "¹ b3: out of memory at batch 3 on this GPU." in md
    assert "² flash_attn is not installed on this node." in md
    assert "Error" not in md and "Tried" not in md


# ------------------------------------------------------------------ executed for real


def test_executed_notebook_passes_then_tampered_copies_fail(tmp_path, monkeypatch):
    """Run a small notebook in a real kernel (CPU), then doctor its output and file."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    monkeypatch.setenv("COLOSSAL_LAB_RESULTS", str(tmp_path / "results"))
    results.save_results("demo", [{"a": 1}], command="pytest", gpu=results.REFERENCE_GPU)
    nb = v4.new_notebook(cells=[v4.new_code_cell(s) for s in (
        "from colossal_lab.measure import mfu, results\n"
        "from colossal_lab.book.notebook import show_source",
        "show_source(mfu.count_params)",
        "show_source(mfu.layer_params, lines=(0, 3))",
        "res = results.measure_or_load('demo', lambda: [{'a': 2}], command='pytest')",
    )])
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)
    assert integrity.check_notebook(path, repo_root=tmp_path) == []
    shown = nb.cells[3].outputs[0]  # in a notebook: a caption, its run in its metadata
    assert "data" in shown, nb.cells[3].outputs
    assert shown["data"]["text/plain"].startswith("Measured on "), shown
    assert "/demo.json" in shown["data"]["text/html"] and "commit" not in str(shown["data"])
    assert shown["metadata"][SOURCE_KEY]["results"].endswith("/demo.json")

    out = nb.cells[1].outputs[0]
    assert out["metadata"][SOURCE_KEY]["source_of"] == "colossal_lab.measure.mfu:count_params"
    out["data"]["text/plain"] += "\n    # a line the library no longer has"
    nbformat.write(nb, path)
    assert len(integrity.check_notebook(path, repo_root=tmp_path)) == 1
    out["data"]["text/plain"] = source_text(mfu.count_params)
    nbformat.write(nb, path)
    assert integrity.check_notebook(path, repo_root=tmp_path) == []

    saved = next((tmp_path / "results").glob("*/demo.json"))
    set_provenance(saved, git_sha="0" * 40)  # the file was re-run after the notebook
    problems = integrity.check_notebook(path, repo_root=tmp_path)
    assert len(problems) == 1 and "0000000000" in problems[0], problems
