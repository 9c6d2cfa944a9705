"""Test set-up: Triton kernels run under the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before any kernel is defined, so it is set here, before
the test modules import `colossal_lab.kernels`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Every test skipped for want of CUDA is also marked `gpu`, so `pytest -m gpu`
    (`make test-gpu`) runs all of them on a GPU node, whichever decorator they use."""
    for item in items:
        if any(m.name == "skipif" and m.kwargs.get("reason") == "needs a CUDA GPU"
               for m in item.iter_markers()):
            item.add_marker(pytest.mark.gpu)
