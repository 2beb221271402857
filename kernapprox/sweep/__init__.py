"""The experiment engine: grids × seeds → executor → resumable store → one xarray dataset per experiment.

An experiment module defines ``GRIDS`` (presets), ``METRICS``, ``run_cell(params, rng, device)`` and
``plot(ds, path)``, wraps them in :class:`Experiment` and calls :func:`run_cli`. From Python:

>>> from kernapprox.sweep import run, load
>>> ds = run(EXPERIMENT, preset="smoke", out="results/x.nc", device="cpu")   # doctest: +SKIP
>>> ds.kernel_rel_fro.sel(estimator="positive").median("seed")               # doctest: +SKIP

Guarantees: each cell's randomness comes from ``SeedSequence(root_seed, spawn_key=...)`` of the experiment name
and the cell's coordinate values (:func:`cell_seed_sequence`), so grids can grow and single cells can be rerun
without changing stored numbers (``Experiment(data_axes=...)`` adds a data stream shared by the cells that agree
on those axes, for paired comparisons); finished cells are persisted one file each, so a killed run resumes and
ends with the same dataset; the dataset is written atomically with provenance attributes; an output path holding
anything but an earlier result of the same experiment is never overwritten.
"""

from ._cli import build_parser, run_cli
from ._experiment import Experiment, Metric, cell_key, cell_seed_sequence, data_seed_sequence, iter_cells
from ._run import SweepError, default_output, resolve_device, run
from ._store import MARKER, OutputPathError, load
from ._worker import CellError

__all__ = ["Experiment", "Metric", "run", "run_cli", "load", "cell_seed_sequence", "data_seed_sequence", "cell_key",
           "iter_cells",
           "build_parser", "default_output", "resolve_device", "SweepError", "CellError", "OutputPathError",
           "MARKER"]
