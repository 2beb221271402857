"""Each engine test gets a result store of its own (a fresh cache root, inherited by the subprocesses it starts):
cells one test computed are never reused by another, so the counts of cells run and reused are the test's own."""

import pytest

from kernapprox.cache import CACHE_ENV


@pytest.fixture(autouse=True)
def own_store(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root
