"""The notebook checks retry a Jupyter kernel that dies at start (the root conftest.py):
a start that fails once is retried and its kernel used; one that always fails still
fails, after `KERNEL_STARTS` tries, so a broken kernel is never hidden."""

import importlib.util
from pathlib import Path

import pytest

nbval_kernel = pytest.importorskip("nbval.kernel")
ROOT_CONFTEST = Path(__file__).resolve().parent.parent / "conftest.py"


def _load_root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_under_test", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # wraps nbval_kernel.start_new_kernel again
    return module


@pytest.mark.parametrize("failures, ok", [(0, True), (1, True), (2, True), (3, False)])
def test_kernel_start_is_retried(monkeypatch, failures, ok):
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= failures:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "manager", "client"

    monkeypatch.setattr(nbval_kernel, "start_new_kernel", flaky)
    root = _load_root_conftest()
    assert root.KERNEL_STARTS == 3
    if ok:
        assert nbval_kernel.start_new_kernel() == ("manager", "client")
        assert len(calls) == failures + 1
    else:
        with pytest.raises(RuntimeError, match="Kernel died"):
            nbval_kernel.start_new_kernel()
        assert len(calls) == root.KERNEL_STARTS
