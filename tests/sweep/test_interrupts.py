"""Ctrl-C at any moment ends a run with the documented message and exit status 130, never a traceback (the
store holds back SIGINT while a cell file or the dataset is written, so no write is left half-done): sent at many
points of a sweep (cells, cell writes, the final write) and of a study's imports; the rerun ends with the
uninterrupted run's numbers."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kernapprox.sweep as sweep
from kernapprox.store import Store

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import toy_experiment  # noqa: E402

PROJECT = TESTS.parent


def _env(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(PROJECT), os.environ.get("PYTHONPATH", "")]),
            **extra}


def _interrupt(cmd, cwd, delay, started, **env):
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not started() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_sigint_at_many_points_of_a_sweep_ends_with_the_message_and_130(tmp_path, own_store, monkeypatch):
    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(tmp_path / "reference-cache"))     # the reference's cells apart
    reference = sweep.run(toy_experiment.EXPERIMENT, preset="smoke", out=tmp_path / "ref.nc", device="cpu",
                          progress=False)
    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(own_store))
    cells = own_store / "store" / "cells" / "toy"
    out = tmp_path / "toy.nc"
    cmd = [sys.executable, "-m", "toy_experiment", "--quiet", "--no-figure", "--preset", "smoke", "--force",
           "--out", str(out)]
    outcomes = []
    for delay in np.linspace(0.0, 0.4, 9):         # from the first cell to past the end of the sweep
        shutil.rmtree(cells, ignore_errors=True)    # "started" is this run's first cell file
        code, err = _interrupt(cmd, tmp_path, float(delay), lambda: cells.is_dir(), TOY_SLEEP="0.01")
        assert "Traceback" not in err and "ZIP" not in err, err
        assert code in (0, 130), (delay, code, err)
        if code == 130:
            assert "interrupted" in err and "rerun the same command" in err, err
        outcomes.append(code)
    assert outcomes.count(130) >= 5, outcomes
    assert all(Store.read_cell(p) is not None for p in cells.glob("*.npz"))     # every cell file whole
    done = subprocess.run([*cmd[:-3], "--out", str(out)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ds = sweep.load(out)
    for name in ("mean", "draws", "ragged"):
        np.testing.assert_array_equal(ds[name].values, reference[name].values, err_msg=name)


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0])
def test_sigint_while_a_study_imports_ends_with_the_message_and_130(tmp_path, delay):
    """`python -m experiments.<name>` interrupted before its command line starts (the imports take seconds)."""
    code, err = _interrupt([sys.executable, "-m", "experiments.sampler_bias", "--preset", "smoke", "--quiet",
                            "--out", str(tmp_path / "s.nc"), "--no-figure"], PROJECT, delay, lambda: True)
    assert code in (0, 130) and "Traceback" not in err, err
    if code == 130:
        assert "interrupted" in err
