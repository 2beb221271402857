"""A tiny numpy-only experiment for the engine's tests, with deliberate failure points set by environment.

``TOY_KILL_AT_CELL=k``   SIGKILL this process when its k-th cell starts (cells 1..k-1 are finished and persisted)
``TOY_DIE_ONCE=path``    the first cell to find ``path`` missing creates it and kills its own process
``TOY_FAIL_FAMILY=b``    cells with ``family == b`` raise ``ValueError``
``TOY_SLEEP=s``          each cell sleeps ``s`` seconds
``TOY_INTERRUPT_AT_CELL=k``  raise KeyboardInterrupt (Ctrl-C) when the k-th cell starts
"""

import os
import signal
import time

import numpy as np

from kernapprox.sweep import Experiment, Metric, run_cli

GRIDS = {
    "smoke": {"family": ["a", "b"], "size": [1, 3], "flag": [False, True], "scale": [0.5, 2.0], "seed": [0, 1]},
    "wide": {"family": ["a", "b", "c"], "size": [1, 2, 3], "flag": [False, True], "scale": [0.5, 1.0, 2.0],
             "seed": [0, 1, 2]},
}
METRICS = {
    "mean": Metric(long_name="mean of the draws", units="1", description="mean of 5 standard normal draws × scale"),
    "draws": Metric(long_name="the draws", units="1", description="5 standard normal draws", dims=("draw",),
                    coords={"draw": [0, 1, 2, 3, 4]}),
    "ragged": Metric(long_name="first `size` uniform draws", units="1", description="length varies with size",
                     dims=("item",)),
}
_started = 0


def run_cell(params, rng, device):
    global _started
    _started += 1
    if os.environ.get("TOY_KILL_AT_CELL") and _started == int(os.environ["TOY_KILL_AT_CELL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("TOY_INTERRUPT_AT_CELL") and _started == int(os.environ["TOY_INTERRUPT_AT_CELL"]):
        raise KeyboardInterrupt
    marker = os.environ.get("TOY_DIE_ONCE")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if params["family"] == os.environ.get("TOY_FAIL_FAMILY"):
        raise ValueError(f"family {params['family']} is broken on purpose")
    time.sleep(float(os.environ.get("TOY_SLEEP", "0")))
    draws = rng.standard_normal(5)
    if params["family"] == "c":
        return {"mean": np.nan, "draws": np.nan, "ragged": np.nan}
    return {"mean": params["scale"] * draws.mean() + params["flag"], "draws": draws,
            "ragged": rng.uniform(size=params["size"])}


def plot(ds, path):
    from kernapprox import plotting

    fig, ax = plotting.new_figure()
    ds["mean"].mean([d for d in ds["mean"].dims if d != "seed"]).plot.line(ax=ax, marker="o")
    plotting.save_figure(fig, path, "Toy experiment: mean of the draws per seed.")


EXPERIMENT = Experiment(name="toy", title="Toy experiment", description="Engine tests: numpy draws per cell.",
                        grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)


def leave_partial_progress(out, monkeypatch):
    """Run the smoke grid with family ``b`` failing, so that the 16 family-``a`` cells stay in the result store;
    returns their cell files, sorted."""
    import pytest

    from kernapprox.sweep import CellError, run

    monkeypatch.setenv("TOY_FAIL_FAMILY", "b")
    with pytest.raises(CellError):
        run(EXPERIMENT, preset="smoke", out=out, device="cpu", progress=False)
    monkeypatch.delenv("TOY_FAIL_FAMILY")
    cells = stored_cells()
    assert len(cells) == 16
    return cells


def stored_cells(experiment: str = "toy"):
    """The cell files of ``experiment`` in the result store of the current cache root, sorted."""
    from kernapprox.cache import cache_root

    return sorted((cache_root() / "store" / "cells" / experiment).glob("*.npz"))
