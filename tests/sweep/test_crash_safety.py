"""Crash safety of the experiment engine beyond ``tests/sweep/test_sweep.py`` (which kills a run at a fixed cell).

* SIGKILL at random moments, several times in a row on one output path: at every moment the final path is
  either absent or a complete, valid dataset, and the run that finally completes gives exactly the dataset of
  an uninterrupted run.
* SIGKILL during the final write (the writer is made to stop half-way and wait): nothing appears at the final
  path (fresh output) or the previous result stays byte-for-byte intact (rerun over it); the next run
  completes from the progress store.
* A damaged progress store (truncated cell file, a cell file under another cell's name, a stray file, a
  garbled manifest) never leaks into the dataset: the affected cells simply run again.
* A file at the output path that is not a result of this experiment (empty, truncated copy of a result, a
  pickle, a directory) is refused with a clear error, by the API and by the command line (exit status 2), and
  left untouched.

Subprocesses run ``python -m toy_experiment`` (``tests/toy_experiment.py``) with a short sleep per cell.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kernapprox.sweep as sweep

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import toy_experiment  # noqa: E402

TOY = toy_experiment.EXPERIMENT
METRICS = ["mean", "draws", "ragged"]

# The final write stops half-way: the temporary file is truncated to half its size, a marker is created, and the
# process waits to be killed. Everything else is the ordinary command line.
HELD_WRITER = r"""
import os, sys, time
import xarray as xr
from kernapprox.sweep import run_cli
from toy_experiment import EXPERIMENT

_write = xr.Dataset.to_netcdf

def held(self, path=None, *args, **kwargs):
    result = _write(self, path, *args, **kwargs)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    open(os.environ["HOLD_MARKER"], "w").close()
    time.sleep(600)
    return result

xr.Dataset.to_netcdf = held
run_cli(EXPERIMENT, sys.argv[1:])
"""


def env(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def start(args, cwd, code=None, **extra):
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "toy_experiment"]
    log = open(Path(cwd) / f"stderr-{time.monotonic_ns()}.log", "w+")
    proc = subprocess.Popen([*command, "--quiet", "--no-figure", *args], cwd=cwd, env=env(**extra),
                            stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log
    return proc


def stderr_of(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def wait_for(condition, proc, timeout=120.0):
    """Poll until ``condition()`` or the process ends; return whether the condition held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return condition()
        time.sleep(0.01)
    raise AssertionError(f"timed out; stderr:\n{stderr_of(proc)}")


def kill(proc):
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.log.close()


def assert_absent_or_complete(out: Path, total: int):
    """The final path holds nothing, or a whole dataset of every cell (never a partial file)."""
    if not out.exists():
        return
    ds = sweep.load(out)
    assert int(np.isfinite(ds["cell_seconds"].values).sum()) == total


def assert_same_metrics(a, b):
    for name in METRICS:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)


def completed_with_progress_reused(ds, log: str) -> bool:
    """Cells were reused from the result store."""
    return ds.attrs["cells_reused"] > 0


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    return {preset: sweep.run(TOY, preset=preset, out=folder / f"{preset}.nc", device="cpu", progress=False,
                              resume=False) for preset in ("smoke", "wide")}


# --------------------------------------------------------------------------------- kills at random moments
def test_random_sigkills_always_resume_to_the_identical_dataset(tmp_path, references, own_store):
    out = tmp_path / "runs" / "toy.nc"
    cells = own_store / "store" / "cells" / "toy"
    total = int(np.prod([len(v) for v in TOY.grids["wide"].values()]))
    delays = np.random.default_rng(20240229).uniform(0.05, 1.2, size=3)
    progress = []
    for delay in delays:
        proc = start(["--preset", "wide", "--out", str(out)], tmp_path, TOY_SLEEP="0.01")
        wait_for(lambda: cells.is_dir() or out.exists(), proc)      # past the imports: the sweep has started
        stop = time.monotonic() + delay
        while time.monotonic() < stop and proc.poll() is None:
            assert_absent_or_complete(out, total)
            time.sleep(0.02)
        kill(proc)
        assert_absent_or_complete(out, total)
        progress.append(len(list(cells.glob("*.npz"))) if cells.is_dir() else total)
    assert any(0 < p < total for p in progress), progress            # at least one kill landed mid-sweep
    final = subprocess.run([sys.executable, "-m", "toy_experiment", "--quiet", "--no-figure", "--preset", "wide",
                            "--out", str(out)], cwd=tmp_path, env=env(), capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, final.stderr
    ds = sweep.load(out)
    assert_same_metrics(ds, references["wide"])
    assert completed_with_progress_reused(ds, final.stderr) or progress[-1] in (0, total)


def test_sigkill_during_the_final_write_never_exposes_a_partial_file(tmp_path, references, own_store):
    out = tmp_path / "toy.nc"
    marker = tmp_path / "writing"
    cells = own_store / "store" / "cells" / "toy"
    args = ["--preset", "smoke", "--out", str(out)]

    # a fresh output: killed half-way through the write
    proc = start(args, tmp_path, code=HELD_WRITER, HOLD_MARKER=str(marker))
    assert wait_for(marker.exists, proc), stderr_of(proc)
    kill(proc)
    assert not out.exists()
    assert list(tmp_path.glob("toy.nc.tmp-*"))                     # the half-written file is only a temporary
    assert len(list(cells.glob("*.npz"))) == 32                     # every cell survived in the result store
    resumed = subprocess.run([sys.executable, "-m", "toy_experiment", "--quiet", "--no-figure", *args],
                             cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    ds = sweep.load(out)
    assert_same_metrics(ds, references["smoke"])
    assert ds.attrs["cells_run"] == 0

    # a forced rerun over an existing result: killed half-way through the write; the old result is untouched
    before = out.read_bytes()
    marker.unlink()
    proc = start([*args, "--force"], tmp_path, code=HELD_WRITER, HOLD_MARKER=str(marker))
    assert wait_for(marker.exists, proc), stderr_of(proc)
    kill(proc)
    assert out.read_bytes() == before
    assert_same_metrics(sweep.load(out), references["smoke"])


# ------------------------------------------------------------------------------------- damaged progress
def partial_run(tmp_path, monkeypatch):
    """A run of the smoke grid that fails on family b, leaving the 16 family-a cells in its progress store."""
    out = tmp_path / "toy.nc"
    return out, toy_experiment.leave_partial_progress(out, monkeypatch)


def finish(out):
    return sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False)


@pytest.mark.parametrize("damage", ["truncated", "empty", "swapped", "stray", "manifest"])
def test_damaged_progress_never_leaks_into_the_dataset(tmp_path, monkeypatch, references, damage, capsys):
    out, cells = partial_run(tmp_path, monkeypatch)
    if damage == "truncated":
        cells[0].write_bytes(cells[0].read_bytes()[:50])
    elif damage == "empty":
        cells[0].write_bytes(b"")
    elif damage == "swapped":                                       # another cell's numbers under this name
        cells[0].write_bytes(cells[1].read_bytes())
    elif damage == "stray":
        (cells[0].parent / "notes.txt").write_text("not a cell")
        (cells[0].parent / "cafe.npz.tmp-1234").write_bytes(b"half")
    else:                                                           # the cells' dependency record
        for record in (cells[0].parents[2] / "records").glob("*.json"):
            record.write_text("{garbled")
    ds = finish(out)
    assert_same_metrics(ds, references["smoke"])
    expected_run = {"truncated": 17, "empty": 17, "swapped": 17, "stray": 16, "manifest": 32}[damage]
    assert ds.attrs["cells_run"] == expected_run
    if damage in ("truncated", "empty", "swapped"):
        assert "runs again" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- hostile output path
def _truncated_result(path, folder):
    good = folder / "good.nc"
    sweep.run(TOY, preset="smoke", out=good, device="cpu", progress=False, only={"family": "a", "size": 1})
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])


def _pickle(path, folder):
    path.write_bytes(pickle.dumps({"kernapprox_experiment": "toy", "mean": [1.0, 2.0]}))


@pytest.mark.parametrize("kind", ["empty", "truncated_result", "pickle", "directory"])
def test_output_paths_that_are_not_results_are_refused_and_kept(tmp_path, kind):
    out = tmp_path / "toy.nc"
    if kind == "empty":
        out.write_bytes(b"")
    elif kind == "truncated_result":
        _truncated_result(out, tmp_path)
    elif kind == "pickle":
        _pickle(out, tmp_path)
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    before = out.read_bytes() if out.is_file() else (out / "keep.txt").read_text()
    stored = toy_experiment.stored_cells()
    with pytest.raises(sweep.OutputPathError, match="refusing to overwrite|not a file"):
        sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        sweep.run_cli(TOY, ["--preset", "smoke", "--out", str(out), "--no-figure", "--quiet"])
    assert exit_info.value.code == 2 and str(out) in err.getvalue() and "Traceback" not in err.getvalue()
    after = out.read_bytes() if out.is_file() else (out / "keep.txt").read_text()
    assert after == before
    assert toy_experiment.stored_cells() == stored                  # refused before any work
