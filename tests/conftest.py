"""Shared fixtures and markers. CUDA tests skip cleanly without a device.

Every test process gets a cache root of its own (``KERNAPPROX_CACHE_DIR``, a fresh temporary folder removed at the
end), set before any test runs and inherited by the subprocesses tests start: nothing the tests train, record or
fit is ever written into the user's cache, and no test reads a model the user trained. One exception: the tests
marked ``lm`` load SmolLM2-135M through the user's own cache root (:data:`USER_CACHE_ROOT`), where
``kernapprox.lm.load_smollm2`` keeps the model it converts from the installed GGUF file (a pure function of that file,
checked by its hash, and a minute's work that every test process would otherwise repeat).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kernapprox.cache import CACHE_ENV, cache_root

# The shared helpers (helpers.py, toy_*.py) live in this folder and every test imports them by bare name, from the
# subfolders too (`from helpers import gaussian`, `import toy_experiment`): this folder is on sys.path. Pytest's
# default (prepend) import mode puts it there for this conftest already; said here so that it holds in any mode.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# The user's root, read before the tests' own root replaces it, and handed to the xdist workers and subprocesses
# (which inherit the replaced KERNAPPROX_CACHE_DIR) through a variable of its own: the tests marked lm load
# SmolLM2 there, the tests marked signals read (never write) what `make signals` fetched.
_USER_ROOT_ENV = "KERNAPPROX_TEST_USER_CACHE_ROOT"
os.environ.setdefault(_USER_ROOT_ENV, str(cache_root()))
USER_CACHE_ROOT = os.environ[_USER_ROOT_ENV]
_CACHE_ROOT = tempfile.mkdtemp(prefix="kernapprox-test-cache-")
os.environ[CACHE_ENV] = _CACHE_ROOT
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)   # also when a worker ends without unconfigure


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="session")
def user_cache_root():
    """The user's cache root (:data:`USER_CACHE_ROOT`), for the tests marked ``lm`` only."""
    return USER_CACHE_ROOT


@pytest.fixture(autouse=True)
def _deterministic_torch():
    # Tests draw inputs from explicit generators; this only guards against stray global-RNG use.
    # One intra-op thread per test process: the tensors are small and `make test` runs two xdist workers on two
    # cores, so more threads only add OpenMP barrier waits (restored afterwards).
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """``smoke_run(name) -> (module, dataset, folder)``: the smoke preset of ``experiments.<name>``, run once per
    test session (per xdist worker) into a temporary folder (``folder / "x.nc"``)."""
    import importlib

    from kernapprox import sweep

    runs = {}

    def get(name):
        if name not in runs:
            module = importlib.import_module(f"experiments.{name}")
            folder = tmp_path_factory.mktemp(name)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                ds = sweep.run(module.EXPERIMENT, preset="smoke", out=folder / "x.nc", device="cpu", progress=False)
            finally:
                torch.set_num_threads(threads)
            runs[name] = module, ds, folder
        return runs[name]

    return get
