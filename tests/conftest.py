"""Shared fixtures and markers. CUDA tests skip cleanly without a device."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    # Tests draw inputs from explicit generators; this only guards against stray global-RNG use.
    torch.manual_seed(0)
    yield
