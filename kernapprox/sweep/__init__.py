"""The experiment engine: grids × seeds → executor → resumable store → one xarray dataset per experiment.

An experiment module defines ``GRIDS`` (presets), ``METRICS``, ``run_cell(params, rng, device)`` and
``plot(ds, path)``, gathers them into an :class:`Experiment` (:meth:`Experiment.from_module` reads these
conventional names) and calls :func:`run_cli`. A comparative study (an
``estimator`` axis) also declares ``data_axes`` (refused otherwise), usually a ``draw`` (the data of one draw and
its exact references, made once by the engine and handed to every cell of the draw as ``data``), a
:class:`Reference` computed once per data draw, fixed :class:`Parameter` values, a ``summarise`` that adds paired
comparisons and summaries with intervals (:mod:`kernapprox.stats`), and ``findings(ds)``, its sentences, which the
engine writes beside the figure as bullets with the closing line on the intervals and the data's digest
(:func:`findings_text`). A combination that does not apply returns :func:`not_applicable`. From Python:

>>> from kernapprox.sweep import run, load
>>> ds = run(EXPERIMENT, preset="smoke", out="results/x.nc", device="cpu")   # doctest: +SKIP
>>> ds.kernel_rel_fro.sel(estimator="positive").median("seed")               # doctest: +SKIP

Guarantees: each cell's randomness comes from ``SeedSequence(root_seed, spawn_key=...)`` of the experiment name
and the cell's coordinate values (:func:`cell_seed_sequence`), so grids can grow and single cells can be rerun
without changing stored numbers (``Experiment(data_axes=...)`` adds a data stream shared by the cells that agree
on those axes, for paired comparisons); finished cells are persisted one file each, so a killed run resumes and
ends with the same dataset; every finished cell is kept in the result store (:mod:`kernapprox.store`) under the key of
its inputs with the record of the code it ran, so a preset that shares cells with another, or a rerun after an edit
that its code does not depend on, computes nothing again; the dataset is written atomically with provenance
attributes (the merged dependency record of its cells among them); an output path holding
anything but an earlier result of the same experiment is never overwritten.
"""

from ._cli import build_parser, run_cli
from ._experiment import (
    AXIS_ATTRS,
    Experiment,
    Metric,
    Parameter,
    Reference,
    cell_key,
    cell_seed_sequence,
    data_seed_sequence,
    iter_cells,
)
from ._figures import (
    FigureStatus,
    dataset_digest,
    draw,
    figure_status,
    findings_body,
    findings_text,
    provenance_path,
    read_code_digest,
    read_digest,
    read_provenance,
    write_provenance,
)
from ._run import SweepError, default_output, resolve_device, resolve_grid, run, summarise_dataset
from ._store import MARKER, OutputPathError, load
from ._worker import CellError, not_applicable

__all__ = ["Experiment", "Metric", "Parameter", "Reference", "AXIS_ATTRS", "run", "run_cli", "load",
           "cell_seed_sequence", "data_seed_sequence", "cell_key", "iter_cells", "resolve_grid",
           "summarise_dataset", "draw", "findings_body", "findings_text", "dataset_digest", "read_digest",
           "read_code_digest", "figure_status", "FigureStatus", "provenance_path", "read_provenance",
           "write_provenance",
           "build_parser", "default_output", "resolve_device", "SweepError", "CellError", "OutputPathError",
           "MARKER", "not_applicable"]
