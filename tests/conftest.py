"""Test set-up: Triton kernels run under the interpreter when there is no GPU, and
strict mode is on.

`TRITON_INTERPRET` must be set before any kernel is defined, so it is set here, before
the test modules import `colossal_lab.kernels`. `COLOSSAL_LAB_STRICT=1` makes every
backend fallback raise (`switches.fallback`): a test asking for "triton" tests Triton,
never what a dispatcher quietly ran instead. Tests of the fallback itself unset it
with monkeypatch.
"""

import os

import pytest
import torch

from colossal_lab.config import ModelConfig, tiny

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["COLOSSAL_LAB_STRICT"] = "1"  # read at each fallback, so set before any runs

# Under pytest-xdist (`make test` runs `-n 2`) the workers share the machine's cores: each
# one's torch (and the processes it starts: CLI runs, spawned gloo ranks, torchrun) gets
# its share of them, not all of them each, which oversubscribes and spins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(_THREADS)

MODEL_CONFIGS = {  # shared shapes: GQA, MHA with odd widths, MQA with tied embeddings
    "tiny-gqa": tiny(),
    "gqa-6:2-odd": ModelConfig(vocab_size=301, hidden_size=96, intermediate_size=250,
                               num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=2, max_position_embeddings=128),
    "mha-odd": ModelConfig(vocab_size=301, hidden_size=96, intermediate_size=250,
                           num_hidden_layers=3, num_attention_heads=6,
                           num_key_value_heads=6, max_position_embeddings=128),
    "mha-3": ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=100,
                         num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=3, max_position_embeddings=64),
    "mqa-tied": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=1, tie_word_embeddings=True,
                            rope_theta=500000.0),
}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "browser: opens the built book in headless Chromium (tests/test_book_browser"
        ".py); runs only with `-m browser`, after `make book`")


def pytest_collection_modifyitems(config, items):
    """Every test skipped for want of CUDA is also marked `gpu`, so `pytest -m gpu`
    (`make test-gpu`) runs all of them on a GPU node, whichever decorator they use.

    Browser tests need a built book and Chromium: a run whose `-m` does not name
    `browser` (a plain `pytest tests`) deselects them; `make test` runs them after
    `make book` with `-m browser`."""
    for item in items:
        if any(m.name == "skipif" and m.kwargs.get("reason") == "needs a CUDA GPU"
               for m in item.iter_markers()):
            item.add_marker(pytest.mark.gpu)
    if "browser" not in (config.option.markexpr or ""):
        browser = [item for item in items if item.get_closest_marker("browser")]
        if browser:
            config.hook.pytest_deselected(items=browser)
            items[:] = [item for item in items if not item.get_closest_marker("browser")]


@pytest.fixture(scope="module")
def few_cpu_reps():
    """CPU timings (`timing.time_fn`'s loop, which `time_kernels` runs on a CPU) of 1
    warm-up and 3 calls instead of 2 and 10, for this module: every timing path still
    runs (and the Triton interpreter is slow); for benchmark smoke tests that assert no
    speed and no count of calls. Patched where the benchmarks look it up: the timing
    module, and each colossal_lab module that imported `time_fn` by name."""
    import sys

    from colossal_lab.measure import timing

    real = timing.time_fn

    def few(fn, **kw):
        kw.setdefault("cpu_warmup", 1)
        kw.setdefault("cpu_reps", 3)
        return real(fn, **kw)

    with pytest.MonkeyPatch.context() as mp:
        for name, mod in list(sys.modules.items()):
            if name.startswith("colossal_lab") and getattr(mod, "time_fn", None) is real:
                mp.setattr(mod, "time_fn", few)
        yield


def count_calls(monkeypatch, module, name: str) -> dict[str, int]:
    """Count the calls of `module.name` (still calling it): `{"n": calls so far}`.
    Proves which path a dispatcher took, where outputs are equal by design."""
    calls = {"n": 0}
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def count_launches(monkeypatch, *kernels) -> dict[str, int]:
    """Count the launches of Triton kernels (`@triton.jit`, interpreted or compiled, or
    autotuned): `kernel[grid](...)` calls the kernel object's `run`, wrapped here. Proves
    that a dispatcher ran our Triton kernel, not merely something with equal output.
    `kernels.launch`'s direct path (on a GPU, a specialisation launched before) and
    RMSNorm's C++ path (`kernels.native`) would bypass `run`: both are switched off
    meanwhile."""
    from colossal_lab.kernels import launch, native

    monkeypatch.setattr(launch, "_fast", False)
    monkeypatch.setenv(native.ENV, "0")
    counts: dict[str, int] = {}
    for kernel in kernels:
        name = getattr(kernel, "fn", kernel).__name__

        def run(*args, _real=kernel.run, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return counts
