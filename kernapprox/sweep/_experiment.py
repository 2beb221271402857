"""What an experiment is: named presets of a grid, metrics with their metadata, a cell function and a plot.

A *grid* is an ordered mapping ``axis -> list of values`` (``str``, ``int``, ``float`` or ``bool``; one type per
axis). A *cell* is one point of the grid: ``params`` maps every axis to one value. Each cell's randomness comes
from :func:`cell_seed_sequence`, built from the experiment name and the cell's coordinate *values* (never their
positions), so adding values to an axis, reordering axes or running one cell alone never changes an existing
cell's numbers.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import numbers
import re
import sys
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


def _default_module(fn) -> str:
    module = getattr(fn, "__module__", None) or "__main__"
    if module == "__main__":  # python -m experiments.x: the importable name is the spec's
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
    return module


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
        data (e.g. the same queries and keys for every estimator and rank: paired comparisons, and exact
        references that a cell may memoise by ``data_rng.bit_generator.seed_seq``). ``rng`` stays per cell.
    module : str, optional
        Importable module holding the experiment (found from ``run_cell``); worker processes import it.
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
    module: str | None = field(default=None)

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
        if self.data_axes and "data_rng" not in inspect.signature(self.run_cell).parameters:
            raise TypeError("an experiment with data_axes needs run_cell(params, rng, device, data_rng)")
        object.__setattr__(self, "grids", grids)
        object.__setattr__(self, "metrics", dict(self.metrics))
        if self.module is None:
            object.__setattr__(self, "module", _default_module(self.run_cell))

    @property
    def axes(self) -> list[str]:
        return list(next(iter(self.grids.values())))

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


def select(experiment: Experiment, grid: dict[str, list], only: Mapping | None) -> dict[str, list]:
    """Restrict ``grid`` to the values in ``only`` (``axis -> value or list of values``).

    A value must have the axis's type and appear in the grid or in another preset of the experiment (the
    ``seed`` axis accepts any non-negative integer), so that a typo fails instead of running an unknown cell.
    """
    if not only:
        return grid
    if not isinstance(only, Mapping):
        raise TypeError(f"only must be a mapping axis -> value(s), got {type(only).__name__}")
    out = dict(grid)
    for axis, wanted in only.items():
        if axis not in grid:
            raise ValueError(f"only: unknown axis {axis!r}; axes: {', '.join(grid)}")
        wanted = list(wanted) if isinstance(wanted, list | tuple) else [wanted]
        kind = axis_type(grid[axis])
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


def parse_value(experiment: Experiment, axis: str, text: str):
    """Parse ``text`` as a value of ``axis`` (its type is that of the axis in the experiment's presets)."""
    kind = axis_type(experiment.known_values(axis))
    if kind is str:
        return text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError(f"--only {axis}={text}: expected true or false")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--only {axis}={text}: expected a {kind.__name__}") from None
