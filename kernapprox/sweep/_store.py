"""Where results live: the assembled dataset and its atomic write (the cells themselves live in the result store,
:mod:`kernapprox.store`, one file each, kept across runs, presets and studies).

Dataset
    dims = grid axes (then each array metric's extra dims); variables = metrics (float64, NaN where a cell has
    not run) and ``cell_seconds``; the reference's metrics (if the experiment has one) over the reference axes
    only, with ``reference_seconds``; coordinates carry ``long_name`` and ``units``, fixed parameters are scalar
    coordinates; attributes carry the provenance. Written with the ``h5netcdf`` engine to a
    temporary file in the same folder, fsync'ed, then ``os.replace``'d, so no partial file is ever visible at
    the final path. Our files carry the attribute ``kernapprox_experiment``; an existing file at the output path
    that is unreadable, foreign or of another experiment is never overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xarray as xr

from ..io import atomic_write
from ._experiment import Experiment, Metric, cell_key, iter_cells

MARKER = "kernapprox_experiment"
FORMAT_VERSION = 1
NETCDF_ENGINE = "h5netcdf"


class OutputPathError(ValueError):
    """The output path holds something that is not a result of this experiment: refuse to overwrite it."""


# --------------------------------------------------------------------------------------------- the dataset
def check_output_path(out: Path, experiment_name: str) -> None:
    """Refuse to overwrite anything at ``out`` except an earlier result of the same experiment."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_file():
        raise OutputPathError(f"output path {out} exists and is not a file; choose another --out")
    name = _marker_of(out)
    if name != experiment_name:
        raise OutputPathError(f"output path {out} holds results of experiment {name!r}, not {experiment_name!r}; "
                              "refusing to overwrite it (choose another --out or delete it)")


def _open_result(path: Path) -> xr.Dataset:
    """Open ``path`` lazily; ``OutputPathError`` unless it is a readable netCDF file carrying our marker."""
    try:
        ds = xr.open_dataset(path, engine=NETCDF_ENGINE)
    except Exception as exc:  # noqa: BLE001 - whatever the reader says, the file is not ours
        raise OutputPathError(f"{path} exists but is not a readable netCDF file ({type(exc).__name__}: {exc}); "
                              "refusing to overwrite it (delete it or choose another --out)") from None
    if MARKER not in ds.attrs:
        ds.close()
        raise OutputPathError(f"{path} is a netCDF file but not a kernapprox result (no {MARKER!r} attribute); "
                              "refusing to overwrite it (delete it or choose another --out)")
    return ds


def _marker_of(path: Path) -> str:
    with _open_result(path) as ds:
        return str(ds.attrs[MARKER])


def load(path) -> xr.Dataset:
    """Read a result dataset into memory (the file is closed again).

    Raises ``FileNotFoundError`` if ``path`` does not exist and ``ValueError`` if it is not a kernapprox result.
    JSON attributes (``grid``, ``package_versions``, ...) stay strings; ``json.loads`` them when needed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no result dataset at {path}; run the experiment first")
    with _open_result(path) as ds:
        return ds.load()


def _pad_to(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if arr.shape == shape:
        return arr
    out = np.full(shape, np.nan)
    if arr.ndim == 0:  # a NaN placeholder for a non-applicable array metric
        out[...] = arr
    else:
        out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out


def _extra_dim_sizes(tables, sizes: dict[str, int] | None = None) -> dict[str, int]:
    """Sizes of the metrics' own dims over ``tables = [(metrics, cells), ...]`` (shared dims must agree)."""
    sizes = {} if sizes is None else sizes
    for metrics, cells in tables:
        _dim_sizes(metrics, cells, sizes)
    return sizes


def _dim_sizes(metrics: Mapping[str, Metric], cells: Mapping[str, dict], sizes: dict[str, int]) -> None:
    for name, metric in metrics.items():
        for i, dim in enumerate(metric.dims):
            if metric.coords and dim in metric.coords:
                size = len(metric.coords[dim])
                if sizes.get(dim, size) != size:
                    raise ValueError(f"dimension {dim!r} has {size} coordinates in metric {name!r} but "
                                     f"{sizes[dim]} elsewhere")
                sizes[dim] = size
                continue
            observed = [c["metrics"][name].shape[i] for c in cells.values() if c["metrics"][name].ndim]
            sizes[dim] = max([sizes.get(dim, 0), *observed]) or 1


REFERENCE_MARK = "__reference__"


def reference_key(params: Mapping) -> str:
    """The progress-store key of the reference cell with these reference-axis values."""
    return cell_key({**params, REFERENCE_MARK: True})


def _fill(metrics, grid, cells, key_of, sizes):
    axes = list(grid)
    shape = tuple(len(grid[a]) for a in axes)
    data = {name: np.full(shape + tuple(sizes[d] for d in m.dims), np.nan) for name, m in metrics.items()}
    seconds = np.full(shape, np.nan)
    for index, params in iter_cells(grid):
        cell = cells.get(key_of(params))
        if cell is None:
            continue
        seconds[index] = cell["seconds"]
        for name, metric in metrics.items():
            data[name][index] = _pad_to(cell["metrics"][name], tuple(sizes[d] for d in metric.dims))
    variables = {name: xr.Variable(axes + list(m.dims), data[name],
                                   {"long_name": m.long_name, "units": m.units, "description": m.description})
                 for name, m in metrics.items()}
    return variables, seconds


def assemble(experiment: Experiment, grid: dict[str, list], cells: Mapping[str, dict],
             attrs: Mapping[str, object], parameters: Mapping[str, object] | None = None) -> xr.Dataset:
    """Build the dataset of ``grid`` from finished cells (by :func:`cell_key`, reference cells by
    :func:`reference_key`); NaN where a cell is missing. ``parameters``: the fixed parameters' values."""
    axes = list(grid)
    reference = experiment.reference
    ref_grid = {a: grid[a] for a in experiment.reference_axes}
    ref_cells = {k: c for k, c in cells.items() if c["params"].get(REFERENCE_MARK)}
    cells = {k: c for k, c in cells.items() if k not in ref_cells}
    tables = [(experiment.metrics, cells)] + ([(reference.metrics, ref_cells)] if reference is not None else [])
    sizes = _extra_dim_sizes(tables)
    variables, seconds = _fill(experiment.metrics, grid, cells, cell_key, sizes)
    variables["cell_seconds"] = xr.Variable(axes, seconds, {
        "long_name": "wall time of the cell", "units": "s",
        "description": "seconds spent in run_cell where the cell ran (NaN: the cell has not run)"})
    if reference is not None:
        ref_vars, ref_seconds = _fill(reference.metrics, ref_grid, ref_cells, reference_key, sizes)
        for var in ref_vars.values():
            var.attrs["reference"] = "computed once per data draw, without the estimator axes"
        variables.update(ref_vars)
        variables["reference_seconds"] = xr.Variable(list(ref_grid), ref_seconds, {
            "long_name": "wall time of the reference cell", "units": "s",
            "description": "seconds spent in the reference's run_cell (NaN: not run)"})
    coords = {axis: xr.Variable(axis, _coordinate(values), experiment.coordinate_attrs(axis))
              for axis, values in grid.items()}
    for metrics in [experiment.metrics] + ([reference.metrics] if reference is not None else []):
        for metric in metrics.values():
            for dim in metric.dims:
                given = (metric.coords or {}).get(dim)
                values = np.asarray(given) if given is not None else np.arange(sizes[dim])
                coords.setdefault(dim, xr.Variable(dim, values, experiment.coordinate_attrs(dim)))
    for name, value in (parameters or {}).items():
        p = experiment.parameters[name]
        coords[name] = xr.Variable((), value, {"long_name": p.long_name, "units": p.units,
                                               "description": p.description or "fixed parameter of the study"})
    ds = xr.Dataset(variables, coords=coords)
    ds.attrs.update({MARKER: experiment.name, "kernapprox_format": FORMAT_VERSION, **attrs})
    return ds


def _coordinate(values: list) -> np.ndarray:
    if isinstance(values[0], str):
        return np.array(values, dtype=object)
    return np.array(values)


def write(ds: xr.Dataset, out: Path) -> None:
    """Write ``ds`` to ``out`` atomically with the h5netcdf engine."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: ds.to_netcdf(tmp, engine=NETCDF_ENGINE))
