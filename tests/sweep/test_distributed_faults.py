"""Distributed faults: a dask worker process killed mid-sweep loses no cell and duplicates none.

The engine's own ``--dask --workers 2`` path starts a ``LocalCluster`` on loopback (processes, one thread
each). The first cell to run finds no marker file, creates it and SIGKILLs its own worker process
(``TOY_DIE_ONCE`` in ``tests/toy_experiment.py``); the nanny restarts the worker and the lost task is run again
(by dask, or resubmitted by the engine when dask gives up on it). The dataset must equal that of an undisturbed
in-process run, cell for cell. A second test (marked slow) kills a worker of a user's cluster from the driver.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import kernapprox.sweep as sweep

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import toy_experiment  # noqa: E402

TOY = toy_experiment.EXPERIMENT


def test_a_killed_dask_worker_loses_and_duplicates_no_cell(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    reference = sweep.run(TOY, preset="smoke", out=tmp_path / "reference.nc", device="cpu", progress=False)
    marker = tmp_path / "worker-died"
    monkeypatch.setenv("TOY_DIE_ONCE", str(marker))          # read by the cells, which run in the workers only
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    ds = sweep.run(TOY, preset="smoke", out=tmp_path / "dask.nc", device="cpu", progress=False, dask=True,
                   workers=2, resume=False)
    assert marker.exists()                                    # a worker process really was killed
    assert ds.attrs["executor"] == "dask.distributed LocalCluster, 2 worker processes"
    total = int(np.prod([len(v) for v in TOY.grids["smoke"].values()]))
    assert ds.attrs["cells_run"] == total and ds.attrs["cells_reused"] == 0
    assert int(np.isfinite(ds["cell_seconds"].values).sum()) == total      # every cell, each stored once
    for name in ("mean", "draws", "ragged"):
        np.testing.assert_array_equal(ds[name].values, reference[name].values, err_msg=name)


@pytest.mark.slow   # a second cluster, a kill and a worker restart: ~25 s; `make test-slow` runs it
def test_a_worker_killed_by_the_driver_mid_sweep(tmp_path, monkeypatch):
    """A user's cluster (``executor=client.get_executor()``): SIGKILL one worker process from outside while
    cells are in flight; the sweep still completes with every cell exactly once and the reference numbers."""
    distributed = pytest.importorskip("distributed")
    import signal
    import threading

    from kernapprox.cache import CACHE_ENV, cache_root

    own = cache_root()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "reference-cache"))     # the reference's cells apart
    reference = sweep.run(TOY, preset="smoke", out=tmp_path / "reference.nc", device="cpu", progress=False)
    monkeypatch.setenv(CACHE_ENV, str(own))
    monkeypatch.setenv("TOY_SLEEP", "0.05")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "dask.nc"
    cells = own / "store" / "cells" / "toy"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        pids = client.run(os.getpid)                          # worker address -> pid
        victim = sorted(pids.values())[0]
        killed = threading.Event()

        def kill_when_running():
            while not (cells.is_dir() and any(cells.glob("*.npz"))):
                if killed.wait(0.01):
                    return
            os.kill(victim, signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill_when_running, daemon=True)
        killer.start()
        ds = sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False,
                       executor=client.get_executor(pure=False))
        finished_before_kill = not killed.is_set()
        killed.set()
        killer.join(timeout=10)
    assert not finished_before_kill, "the sweep ended before the worker could be killed"
    total = int(np.prod([len(v) for v in TOY.grids["smoke"].values()]))
    assert ds.attrs["cells_run"] == total and int(np.isfinite(ds["cell_seconds"].values).sum()) == total
    for name in ("mean", "draws", "ragged"):
        np.testing.assert_array_equal(ds[name].values, reference[name].values, err_msg=name)
