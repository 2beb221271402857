"""What an experiment is: named presets of a grid, metrics with their metadata, a cell function and a plot.

A *grid* is an ordered mapping ``axis -> list of values`` (``str``, ``int``, ``float`` or ``bool``; one type per
axis). A *cell* is one point of the grid: ``params`` maps every axis to one value. Each cell's randomness comes
from :func:`cell_seed_sequence`, built from the experiment name and the cell's coordinate *values* (never their
positions), so adding values to an axis, reordering axes or running one cell alone never changes an existing
cell's numbers.

Comparative studies (a grid with an ``estimator`` axis) must declare ``data_axes``: every estimator then sees
bit-identical inputs for equal data-axis values, and an optional :class:`Reference` (exact attention, a spectrum)
is computed once per data draw and stored without the estimator axes. Fixed parameters (:class:`Parameter`) are
part of the experiment, stored as scalar coordinates with units and changeable from the command line.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import numbers
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

AXIS_TYPES = (bool, int, float, str)  # bool first: bool is a subclass of int
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Metric:
    """A result variable: CF-style metadata, and the extra dimensions of an array-valued metric.

    Parameters
    ----------
    long_name, units, description : str
        Stored as the variable's attributes (``units="1"`` for dimensionless numbers).
    dims : tuple of str
        Extra dimensions of an array-valued metric (after the grid axes). A cell may return arrays of different
        lengths along a dimension without ``coords``; shorter ones are padded with NaN.
    coords : mapping, optional
        Coordinate values of (some of) ``dims``; a cell's array must then have exactly that length.
    """

    long_name: str
    units: str
    description: str
    dims: tuple[str, ...] = ()
    coords: Mapping[str, Sequence] | None = None

    def __post_init__(self):
        for attr in ("long_name", "units", "description"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ValueError(f"Metric {attr} must be a non-empty string, got {getattr(self, attr)!r}")
        if isinstance(self.dims, str) or not all(isinstance(d, str) and _NAME.match(d) for d in self.dims):
            raise ValueError(f"Metric dims must be a tuple of identifiers, got {self.dims!r}")
        object.__setattr__(self, "dims", tuple(self.dims))
        for dim in self.coords or {}:
            if dim not in self.dims:
                raise ValueError(f"Metric coords names {dim!r}, which is not one of its dims {self.dims}")


@dataclass(frozen=True)
class Parameter:
    """A fixed parameter of an experiment (not a grid axis): its default value and what it is.

    ``run_cell`` finds it in ``params`` under its name; ``--set name=value`` changes it for a run. The dataset
    stores it as a scalar coordinate with ``long_name`` and ``units`` (and all of them in the ``parameters``
    attribute, JSON).
    """

    value: bool | int | float | str
    long_name: str
    units: str
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.value, AXIS_TYPES):
            raise TypeError(f"Parameter value must be a bool, int, float or str, got {self.value!r}")
        for attr in ("long_name", "units"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ValueError(f"Parameter {attr} must be a non-empty string, got {getattr(self, attr)!r}")


@dataclass(frozen=True)
class Reference:
    """What a comparative study computes once per data draw, without the estimator axes (e.g. exact attention's
    score on the episodes every estimator reads, the spectrum of the exact kernel matrix).

    Parameters
    ----------
    run_cell : callable ``(params, device, data_rng) -> dict``
        ``params`` holds the values of ``axes`` (and the fixed parameters); ``data_rng`` (a keyword) is the data
        stream of the experiment's ``data_axes``, so the reference draws exactly the inputs the estimator cells
        draw. With ``Experiment.draw``: ``(params, device, data)``, the draw's data.
        Deterministic given its inputs (no other randomness).
    metrics : mapping name -> Metric
        Stored with dims ``axes`` (in grid order) then each metric's own dims.
    axes : tuple of str, optional
        Grid axes the reference depends on: the data axes (default) plus read-out parameters such as ``beta``.
        Never ``estimator`` or ``num_features``.
    """

    run_cell: Callable
    metrics: Mapping[str, Metric]
    axes: tuple[str, ...] | None = None

    def __post_init__(self):
        if not callable(self.run_cell):
            raise TypeError("Reference run_cell must be a callable (params, device, data_rng) -> dict")
        if not isinstance(self.metrics, Mapping) or not self.metrics:
            raise ValueError("Reference metrics must be a non-empty mapping name -> Metric")
        for name, metric in self.metrics.items():
            if not isinstance(metric, Metric):
                raise TypeError(f"reference metric {name!r} must be a Metric, got {type(metric).__name__}")
        object.__setattr__(self, "metrics", dict(self.metrics))
        if self.axes is not None:
            if isinstance(self.axes, str):
                raise ValueError(f"Reference axes must be a tuple of axis names, got {self.axes!r}")
            object.__setattr__(self, "axes", tuple(self.axes))


# The axis whose presence makes a study comparative, and the axes that describe a method, never the data.
COMPARED_AXIS = "estimator"
METHOD_AXES = ("estimator", "num_features")

# Coordinate attributes of the axes that most studies share; an experiment's ``axis_attrs`` adds or overrides.
AXIS_ATTRS = {
    "seed": {"long_name": "replicate (independent data draw)", "units": "1"},
    "estimator": {"long_name": "estimator (kernapprox registry name or study label)", "units": "1"},
    "num_features": {"long_name": "feature dimension r of the state", "units": "1"},
    "seq_len": {"long_name": "sequence length n", "units": "token"},
    "beta": {"long_name": "nominal inverse temperature β", "units": "1"},
    "causal": {"long_name": "causal attention", "units": "1"},
    # dimensions that metrics of several studies share (a study's axis_attrs may say more)
    "episode": {"long_name": "episode (prompt) of the data draw", "units": "1"},
    "sv_index": {"long_name": "index of the singular value, largest first", "units": "1"},
    "layer": {"long_name": "layer (0 = the first)", "units": "1"},
    "head": {"long_name": "attention head", "units": "1"},
    "repeat": {"long_name": "repeated measurement", "units": "1"},
    "replicate": {"long_name": "replicate within the cell", "units": "1"},
    "stat": {"long_name": "summary statistic: estimate, 95 % interval (lo, hi) and the other entries of "
                          "kernapprox.stats.STATS", "units": "1"},
}


def _check_axis_values(preset: str, axis: str, values) -> list:
    where = f"grid {preset!r}, axis {axis!r}"
    if not isinstance(axis, str) or not _NAME.match(axis):
        raise ValueError(f"grid {preset!r}: axis names must be identifiers, got {axis!r}")
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{where}: values must be a non-empty list, got {values!r}")
    kinds = {next((t for t in AXIS_TYPES if isinstance(v, t)), None) for v in values}
    if None in kinds:
        bad = next(v for v in values if not isinstance(v, AXIS_TYPES))
        raise TypeError(f"{where}: values must be str, int, float or bool, got {bad!r} ({type(bad).__name__})")
    if len(kinds) > 1:
        raise TypeError(f"{where}: all values must have one type, got {sorted(t.__name__ for t in kinds)} "
                        "(write floats as 1.0, not 1)")
    kind = kinds.pop()
    if kind is float and not all(np.isfinite(v) for v in values):
        raise ValueError(f"{where}: float values must be finite, got {values!r}")
    clean = [kind(v) for v in values]  # numpy float64 -> float (same value); keeps JSON exact
    if len(set(clean)) != len(clean):
        raise ValueError(f"{where}: values must be distinct, got {values!r}")
    return clean


def check_grid(preset: str, grid) -> dict[str, list]:
    """Validate one grid and return it as a plain ``dict[str, list]``."""
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError(f"grid {preset!r} must be a non-empty mapping axis -> values, got {grid!r}")
    return {axis: _check_axis_values(preset, axis, values) for axis, values in grid.items()}


def axis_type(values: Sequence) -> type:
    """The Python type of an axis (from its checked values)."""
    return type(values[0])


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a parameter called ``name`` (or any keyword): how the engine decides which of the
    optional arguments (``data_rng``, ``data``) a cell function is handed."""
    parameters = inspect.signature(fn).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _default_module(fn) -> str:
    module = getattr(fn, "__module__", None) or "__main__"
    if module == "__main__":  # python -m experiments.x: the importable name is the spec's
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
    return module


# What Experiment.from_module reads from a study module: constants (module name -> field) and functions.
_MODULE_CONSTANTS = {"GRIDS": "grids", "METRICS": "metrics", "PARAMETERS": "parameters", "AXIS_ATTRS": "axis_attrs",
                     "DATA_AXES": "data_axes"}
_MODULE_FUNCTIONS = ("run_cell", "plot", "draw", "summarise", "findings", "check_params")


@dataclass(frozen=True)
class Experiment:
    """One experiment: its grids (presets), metrics, cell function and plot.

    Parameters
    ----------
    name : str
        Identifier; default output ``results/<name>.nc`` and figure ``figures/<name>.png``.
    title, description : str
        What is measured and which question it answers (stored in the dataset, shown by ``--help``).
    grids : mapping preset -> grid
        Usually ``smoke`` (seconds, for tests), ``default`` (``make figures`` on a CPU) and ``full`` (GPU scale).
        Every preset has the same axes in the same order.
    metrics : mapping name -> Metric
    run_cell : callable ``(params, rng, device) -> dict``
        A pure function of its parameters returning ``{metric: numpy scalar or array}``; randomness only from
        ``rng``. Non-applicable combinations return NaN metrics.
    plot : callable ``(dataset, path) -> None``
        Reads the dataset only and writes a PNG.
    allow_tf32 : bool
        Leave TF32 matmuls enabled on CUDA (timing studies). Error studies keep the default ``False``.
    data_axes : tuple of str
        Common random numbers: when given, ``run_cell`` also receives ``data_rng``, a ``Generator`` derived from
        the values of these axes only (:func:`data_seed_sequence`), so every cell that shares them draws the same
        data (e.g. the same queries and keys for every estimator and rank: paired comparisons). With a ``draw``
        the engine makes that data once per draw instead and hands it to the cells. ``rng`` stays per cell.
        Required for a comparative study (a grid with an ``estimator`` axis); must include ``seed`` when the
        grid has one, and never ``estimator`` or ``num_features``.
    reference : Reference, optional
        Computed once per data draw and stored once (no estimator axis).
    parameters : mapping name -> Parameter
        Fixed parameters; ``run_cell`` receives them in ``params``.
    axis_attrs : mapping axis -> {"long_name", "units", ...}
        Coordinate attributes (``long_name``, ``units``, ...) of the grid axes and of the metrics' own dimensions,
        added to :data:`AXIS_ATTRS`. Every coordinate of a dataset carries both (the engine refuses to write one
        without them).
    summarise : callable ``(dataset) -> dataset``, optional
        Adds the derived variables (paired comparisons, summaries with intervals: :mod:`kernapprox.stats`) the
        figure and the findings read; applied by the engine before the dataset is written.
    findings : callable ``(dataset) -> str or list of str``, optional
        The findings, every number computed from the dataset: markdown text, or its sentences (one bullet each,
        empty ones left out: :func:`kernapprox.plotting.bullets`); written beside the figure
        (``figures/<name>.md``) with the closing line on the intervals and the line naming the data.
    module : str, optional
        Importable module holding the experiment (found from ``run_cell``); worker processes import it.
    check_params : callable ``(params) -> None``, optional
        Raises ``ValueError`` naming the axis for a cell the study cannot run (e.g. an estimator it does not
        support). The engine calls it on every cell of a grid, after its own checks of the common axes
        (``check_values``), before any cell runs, so a bad ``--set`` value fails at once.
    replicates : str
        What the bootstrap intervals resample (the unit of replication), named in the closing line the engine
        writes after the findings (:func:`kernapprox.stats.interval_note`).
    draw : callable ``(params, data_rng, device) -> data``, optional
        The data of one draw (inputs, and what is computed from them alone, such as exact attention's output):
        ``params`` holds the data axes' values and the fixed parameters, ``data_rng`` a fresh data stream. The
        engine computes it once per draw and hands it to every cell of that draw and to its reference as the
        keyword ``data`` (``run_cell(params, rng, device, data)``, ``Reference.run_cell(params, device,
        data)``; the data stream, already spent by the draw, is passed as ``data_rng`` only to a function that
        names it); on a process pool or dask the cells of one draw run as one task, so a draw is never recomputed
        by another worker. Exact references that every cell of a draw reads (exact attention's output on the
        draw's inputs) belong in the draw too: computed once, never memoised by the study. Needs ``data_axes``.
    """

    name: str
    title: str
    description: str
    grids: Mapping[str, Mapping[str, Sequence]]
    metrics: Mapping[str, Metric]
    run_cell: Callable
    plot: Callable
    allow_tf32: bool = False
    data_axes: tuple[str, ...] = ()
    reference: Reference | None = None
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    axis_attrs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    summarise: Callable | None = None
    findings: Callable | None = None
    module: str | None = field(default=None)
    check_params: Callable | None = None
    replicates: str = "the replicates"
    draw: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"Experiment name must be an identifier, got {self.name!r}")
        for attr in ("title", "description"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr).strip():
                raise ValueError(f"Experiment {attr} must be a non-empty string")
        if not callable(self.run_cell) or not callable(self.plot):
            raise TypeError("Experiment run_cell and plot must be callables")
        if not isinstance(self.grids, Mapping) or not self.grids:
            raise ValueError("Experiment grids must be a non-empty mapping preset -> grid")
        grids = {preset: check_grid(preset, grid) for preset, grid in self.grids.items()}
        axes = [list(g) for g in grids.values()]
        if any(a != axes[0] for a in axes):
            raise ValueError(f"every preset must have the same axes in the same order, got "
                             f"{ {p: list(g) for p, g in grids.items()} }")
        for preset in grids:
            for axis, values in grids[preset].items():
                first = axis_type(next(iter(grids.values()))[axis])
                if axis_type(values) is not first:
                    raise TypeError(f"axis {axis!r} has type {first.__name__} in one preset and "
                                    f"{axis_type(values).__name__} in {preset!r}")
        if not isinstance(self.metrics, Mapping) or not self.metrics:
            raise ValueError("Experiment metrics must be a non-empty mapping name -> Metric")
        for name, metric in self.metrics.items():
            if not isinstance(metric, Metric):
                raise TypeError(f"metric {name!r} must be a Metric, got {type(metric).__name__}")
            if not _NAME.match(name) or name.startswith("__") or name == "cell_seconds":
                raise ValueError(f"metric name {name!r} must be an identifier (not 'cell_seconds' or '__…')")
            clash = {name, *metric.dims} & set(axes[0])
            if clash:
                raise ValueError(f"metric {name!r} uses names that are grid axes: {sorted(clash)}")
        if isinstance(self.data_axes, str) or not all(a in axes[0] for a in self.data_axes):
            raise ValueError(f"data_axes must be a tuple of grid axes {axes[0]}, got {self.data_axes!r}")
        object.__setattr__(self, "data_axes", tuple(self.data_axes))
        self._check_comparative(axes[0])
        if self.data_axes and self.draw is None and not accepts(self.run_cell, "data_rng"):
            raise TypeError("an experiment with data_axes needs run_cell(params, rng, device, data_rng)")
        self._check_reference(axes[0])
        self._check_parameters(axes[0])
        if self.summarise is not None and not callable(self.summarise):
            raise TypeError("Experiment summarise must be a callable (dataset) -> dataset")
        if self.findings is not None and not callable(self.findings):
            raise TypeError("Experiment findings must be a callable (dataset) -> str")
        if self.draw is not None:
            if not callable(self.draw) or not self.data_axes:
                raise TypeError("Experiment draw must be a callable (params, data_rng, device) -> data, and needs "
                                "data_axes (a draw is per data-axis values)")
            if not accepts(self.run_cell, "data"):
                raise TypeError("an experiment with a draw needs run_cell(params, rng, device, data)")
            if self.reference is not None and not accepts(self.reference.run_cell, "data"):
                raise TypeError("an experiment with a draw needs Reference.run_cell(params, device, data)")
        if not isinstance(self.replicates, str) or not self.replicates.strip():
            raise ValueError("Experiment replicates must name the unit the intervals resample")
        if self.check_params is not None and not callable(self.check_params):
            raise TypeError("Experiment check_params must be a callable (params) -> None")
        object.__setattr__(self, "grids", grids)
        object.__setattr__(self, "metrics", dict(self.metrics))
        if self.module is None:
            object.__setattr__(self, "module", _default_module(self.run_cell))

    @classmethod
    def from_module(cls, module: str | types.ModuleType, *, title: str, **fields) -> Experiment:
        """The experiment a study module declares under the conventional names, so that the study holds
        declarations and functions and the engine gathers them (zoology's experiments as configuration).

        ``module`` is the module or its name (a study ends with ``EXPERIMENT = Experiment.from_module(__name__,
        title=...)``; under ``python -m`` its ``__name__`` is ``"__main__"`` and the importable name is the
        spec's). The fields read, where the module defines them: ``GRIDS``, ``METRICS``, ``PARAMETERS``,
        ``AXIS_ATTRS`` and ``DATA_AXES`` (constants); ``run_cell``, ``plot``, ``draw``, ``summarise``,
        ``findings`` and ``check_params`` (functions, which must be defined in the module itself: a function of
        another module is passed by keyword, so that no imported name is taken by accident); and a
        :class:`Reference` of ``run_reference`` with ``REFERENCE_METRICS`` (and ``REFERENCE_AXES`` when it is
        not the data axes). ``name`` defaults to the module's last dotted part, ``description`` to its docstring
        with the whitespace collapsed. Keyword ``fields`` (any :class:`Experiment` field) override what is read.
        """
        if isinstance(module, str):
            if module not in sys.modules:
                raise ValueError(f"module {module!r} is not imported (pass the module object or its __name__)")
            module = sys.modules[module]
        if not isinstance(module, types.ModuleType):
            raise TypeError(f"module must be a module or its name, got {type(module).__name__}")
        spec = getattr(module, "__spec__", None)
        qualified = spec.name if spec is not None and spec.name else module.__name__
        found = {"name": qualified.rsplit(".", 1)[-1], "description": " ".join((module.__doc__ or "").split()),
                 "module": qualified}
        for attr, name in _MODULE_CONSTANTS.items():
            if hasattr(module, attr):
                found[name] = getattr(module, attr)
        for name in (*_MODULE_FUNCTIONS, "run_reference"):
            fn = getattr(module, name, None)
            if fn is None or name in fields:
                continue
            if getattr(fn, "__module__", None) != module.__name__:
                raise TypeError(f"{qualified}.{name} is defined in {getattr(fn, '__module__', None)!r}, not in the "
                                f"study: pass it by keyword ({name}=...) if it is meant")
            if name != "run_reference":
                found[name] = fn
        if hasattr(module, "run_reference") and "reference" not in fields:
            if not hasattr(module, "REFERENCE_METRICS"):
                raise ValueError(f"{qualified} defines run_reference but no REFERENCE_METRICS")
            found["reference"] = Reference(run_cell=module.run_reference, metrics=module.REFERENCE_METRICS,
                                           axes=getattr(module, "REFERENCE_AXES", None))
        unknown = set(fields) - {f.name for f in cls.__dataclass_fields__.values()} - {"title"}
        if unknown:
            raise TypeError(f"unknown Experiment fields {sorted(unknown)}")
        return cls(title=title, **{**found, **fields})

    def _check_comparative(self, axes: list[str]) -> None:
        """A study with an estimator axis compares estimators: refuse it unless the data are paired."""
        if COMPARED_AXIS in axes and not self.data_axes:
            raise ValueError(
                f"experiment {self.name!r} compares estimators (its grid has an {COMPARED_AXIS!r} axis) but declares "
                "no data_axes: declare the axes that define the data (e.g. data_axes=('seq_len', 'seed')) so that "
                "every estimator and the exact reference see bit-identical inputs (common random numbers)")
        method = [a for a in self.data_axes if a in METHOD_AXES]
        if method:
            raise ValueError(f"data_axes of {self.name!r} name method axes {method}: the data must not depend on the "
                             "estimator or its rank, or the comparison is not paired")
        if self.data_axes and "seed" in axes and "seed" not in self.data_axes:
            raise ValueError(f"data_axes of {self.name!r} must include 'seed': otherwise every seed reads the same "
                             "data and the replicates are not independent")

    def _check_reference(self, axes: list[str]) -> None:
        if self.reference is None:
            return
        if not isinstance(self.reference, Reference):
            raise TypeError(f"Experiment reference must be a Reference, got {type(self.reference).__name__}")
        if not self.data_axes:
            raise ValueError("an experiment with a reference needs data_axes (the reference is per data draw)")
        ref_axes = self.reference.axes if self.reference.axes is not None else self.data_axes
        unknown = [a for a in ref_axes if a not in axes]
        if unknown or any(a in METHOD_AXES for a in ref_axes) or not set(self.data_axes) <= set(ref_axes):
            raise ValueError(f"reference axes must contain the data axes {self.data_axes}, be grid axes and never "
                             f"{METHOD_AXES}; got {ref_axes}")
        object.__setattr__(self.reference, "axes", tuple(a for a in axes if a in ref_axes))   # grid order
        for name, metric in self.reference.metrics.items():
            if not _NAME.match(name) or name in self.metrics or name == "cell_seconds":
                raise ValueError(f"reference metric name {name!r} must be an identifier distinct from the metrics")
            clash = {name, *metric.dims} & set(axes)
            if clash:
                raise ValueError(f"reference metric {name!r} uses names that are grid axes: {sorted(clash)}")

    def _check_parameters(self, axes: list[str]) -> None:
        if not isinstance(self.parameters, Mapping):
            raise TypeError("Experiment parameters must be a mapping name -> Parameter")
        for name, parameter in self.parameters.items():
            if not isinstance(parameter, Parameter):
                raise TypeError(f"parameter {name!r} must be a Parameter, got {type(parameter).__name__}")
            if not _NAME.match(name) or name in axes or name in self.metrics:
                raise ValueError(f"parameter name {name!r} must be an identifier that is not an axis or a metric")
        object.__setattr__(self, "parameters", dict(self.parameters))
        dims = {d for m in self.metrics.values() for d in m.dims}
        if self.reference is not None:
            dims |= {d for m in self.reference.metrics.values() for d in m.dims}
        known = [*axes, *sorted(dims - set(axes)), "stat"]
        if not isinstance(self.axis_attrs, Mapping) or any(a not in known for a in self.axis_attrs):
            raise ValueError(f"axis_attrs must map grid axes or metric dimensions {known} to attribute dicts, got "
                             f"{self.axis_attrs!r}")
        object.__setattr__(self, "axis_attrs", {a: dict(v) for a, v in self.axis_attrs.items()})

    @property
    def axes(self) -> list[str]:
        return list(next(iter(self.grids.values())))

    @property
    def reference_axes(self) -> tuple[str, ...]:
        """The grid axes a reference cell is defined by (empty without a reference)."""
        return self.reference.axes if self.reference is not None else ()

    def coordinate_attrs(self, axis: str) -> dict:
        """``long_name`` and ``units`` (and any other attribute) of the coordinate ``axis`` (a grid axis or a
        metric's own dimension)."""
        return {"long_name": axis.replace("_", " "), "units": "1", **AXIS_ATTRS.get(axis, {}),
                **self.axis_attrs.get(axis, {})}

    def parameter_values(self, overrides: Mapping | None = None) -> dict:
        """The fixed parameters' values, with ``overrides`` (name -> value, checked against each default's type)."""
        values = {name: p.value for name, p in self.parameters.items()}
        for name, value in (overrides or {}).items():
            if name not in self.parameters:
                known = ", ".join(self.parameters) or "none"
                raise ValueError(f"unknown parameter {name!r} of {self.name!r}; parameters: {known}")
            kind = type(self.parameters[name].value)
            if kind is float and type(value) is int:
                value = float(value)
            if type(value) is not kind:
                raise TypeError(f"parameter {name!r} takes {kind.__name__} values, got {value!r}")
            values[name] = value
        return values

    def grid(self, preset: str) -> dict[str, list]:
        """A copy of the grid of ``preset`` (``ValueError`` listing the presets if unknown)."""
        if preset not in self.grids:
            raise ValueError(f"unknown preset {preset!r} for experiment {self.name!r}; "
                             f"valid presets: {', '.join(self.grids)}")
        return {axis: list(values) for axis, values in self.grids[preset].items()}

    def known_values(self, axis: str) -> list:
        """Every value ``axis`` takes in any preset, in first-seen order."""
        seen: list = []
        for grid in self.grids.values():
            seen.extend(v for v in grid[axis] if v not in seen)
        return seen


# ------------------------------------------------------------------------------------------------- cells
def canonical_value(value) -> str:
    """JSON text of a coordinate value (``1`` and ``1.0`` and ``true`` differ, as their axis types do)."""
    return json.dumps(value)


def cell_key(params: Mapping) -> str:
    """A file-name-safe digest identifying one cell by its coordinate values (axis order does not matter)."""
    text = json.dumps(sorted(params.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def cell_spawn_key(experiment_name: str, params: Mapping) -> tuple[int, ...]:
    """``spawn_key`` of a cell: 64-bit digests of the experiment name and of each ``axis=value`` (sorted by axis)."""
    return (_hash64(f"experiment={experiment_name}"),
            *(_hash64(f"{axis}={canonical_value(value)}") for axis, value in sorted(params.items())))


def check_root_seed(root_seed) -> int:
    if isinstance(root_seed, bool) or not isinstance(root_seed, numbers.Integral) or root_seed < 0:
        raise ValueError(f"root_seed must be a non-negative integer, got {root_seed!r}")
    return int(root_seed)


def cell_seed_sequence(experiment_name: str, params: Mapping, root_seed: int) -> np.random.SeedSequence:
    """``SeedSequence(root_seed, spawn_key=cell_spawn_key(...))``: the source of one cell's randomness."""
    return np.random.SeedSequence(check_root_seed(root_seed), spawn_key=cell_spawn_key(experiment_name, params))


def data_spawn_key(experiment_name: str, params: Mapping, data_axes) -> tuple[int, ...]:
    """``spawn_key`` of the data stream shared by all cells with the same values of ``data_axes``."""
    return (_hash64(f"experiment={experiment_name}"), _hash64("stream=data"),
            *(_hash64(f"{axis}={canonical_value(params[axis])}") for axis in sorted(data_axes)))


def data_seed_sequence(experiment_name: str, params: Mapping, data_axes, root_seed: int) -> np.random.SeedSequence:
    """``SeedSequence(root_seed, spawn_key=data_spawn_key(...))``: the data stream of an experiment with
    ``data_axes`` (see :class:`Experiment`)."""
    return np.random.SeedSequence(check_root_seed(root_seed),
                                  spawn_key=data_spawn_key(experiment_name, params, data_axes))


def iter_cells(grid: Mapping[str, Sequence]):
    """All cells of ``grid`` in row-major order: ``(index tuple, params dict)``."""
    axes = list(grid)
    for index in np.ndindex(*(len(grid[a]) for a in axes)):
        yield index, {axis: grid[axis][i] for axis, i in zip(axes, index)}


def grid_size(grid: Mapping[str, Sequence]) -> int:
    return int(np.prod([len(v) for v in grid.values()], dtype=np.int64))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _registered_estimator(value) -> bool:
    from ..estimators.registry import available_estimators

    return value in available_estimators()


# What the common axes may hold, for values that no preset has (a --set value): (test, what it must be).
AXIS_DOMAINS = {
    "estimator": (_registered_estimator, "a registered estimator name (kernapprox.available_estimators())"),
    "num_features": (_positive_int, "a positive integer"),
    "seq_len": (_positive_int, "a positive integer"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    "beta": (lambda v: isinstance(v, float) and v > 0, "a positive number"),
}


def check_values(experiment: Experiment, grid: Mapping[str, Sequence], parameters: Mapping | None = None) -> None:
    """Refuse, before any cell runs, a grid that holds values the study cannot run: every value of a common axis
    (:data:`AXIS_DOMAINS`) that no preset holds must lie in its domain, and the study's own ``check_params``
    must accept every cell (its axis values and the fixed ``parameters``, as ``run_cell`` gets them).
    ``ValueError`` names the axis, the value and what it must be."""
    for axis, values in grid.items():
        if axis not in AXIS_DOMAINS:
            continue
        known = experiment.known_values(axis)
        test, must = AXIS_DOMAINS[axis]
        bad = [v for v in values if v not in known and not test(v)]
        if bad:
            raise ValueError(f"{experiment.name}: axis {axis!r} has values {bad}, which are not {must}; values of "
                             f"the presets: {', '.join(map(str, known))}")
    if experiment.check_params is not None:
        for _, params in iter_cells(grid):
            experiment.check_params({**params, **(parameters or {})})


def _axis_values(option: str, takes: str, grid: dict[str, list], mapping, note: str = ""):
    """Each ``(axis, values as a list, the axis's type)`` of ``mapping`` (``only``, ``--set``), refusing anything
    but a mapping and an axis the grid does not have (``note`` completes that message)."""
    if not isinstance(mapping, Mapping):
        name = "only" if option == "only" else "set_values"
        raise TypeError(f"{name} must be a mapping axis -> {takes}, got {type(mapping).__name__}")
    for axis, values in mapping.items():
        if axis not in grid:
            raise ValueError(f"{option}: unknown axis {axis!r}; axes: {', '.join(grid)}{note}")
        yield axis, list(values) if isinstance(values, list | tuple) else [values], axis_type(grid[axis])


def select(experiment: Experiment, grid: dict[str, list], only: Mapping | None) -> dict[str, list]:
    """Restrict ``grid`` to the values in ``only`` (``axis -> value or list of values``).

    A value must have the axis's type and appear in the grid or in another preset of the experiment (the
    ``seed`` axis accepts any non-negative integer), so that a typo fails instead of running an unknown cell.
    """
    if not only:
        return grid
    out = dict(grid)
    for axis, wanted, kind in _axis_values("only", "value(s)", grid, only):
        allowed = grid[axis] + [v for v in experiment.known_values(axis) if v not in grid[axis]]
        chosen = []
        for value in wanted:
            if type(value) is not kind and not (kind is float and type(value) is np.float64):
                raise TypeError(f"only: axis {axis!r} takes {kind.__name__} values, got {value!r}")
            seed_like = axis == "seed" and kind is int and value >= 0
            if value not in allowed and not seed_like:
                raise ValueError(f"only: {axis}={value!r} is not a value of this experiment; valid: "
                                 f"{', '.join(map(str, allowed))}")
            if value not in chosen:
                chosen.append(kind(value))
        out[axis] = chosen
    return out


def replace_values(experiment: Experiment, grid: dict[str, list], new: Mapping | None) -> dict[str, list]:
    """Replace the values of axes by any values of the axis's type (``--set axis=v1,v2``)."""
    if not new:
        return grid
    out = dict(grid)
    note = f" (fixed parameters: {', '.join(experiment.parameters) or 'none'})"
    for axis, values, kind in _axis_values("set", "list of values", grid, new, note):
        if kind is float:
            values = [float(v) if type(v) is int else v for v in values]
        checked = _check_axis_values("--set", axis, values)
        if axis_type(checked) is not kind:
            raise TypeError(f"set: axis {axis!r} takes {kind.__name__} values, got {values!r}")
        out[axis] = checked
    return out


def parse_text(kind: type, text: str, where: str):
    """Parse ``text`` as a value of type ``kind`` (bool, int, float, str); ``where`` names the option."""
    if kind is str:
        return text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError(f"{where}: expected true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{where}: expected a {kind.__name__}, got {text!r}") from None


def parse_value(experiment: Experiment, axis: str, text: str):
    """Parse ``text`` as a value of ``axis`` (its type is that of the axis in the experiment's presets)."""
    return parse_text(axis_type(experiment.known_values(axis)), text, f"--only {axis}")
