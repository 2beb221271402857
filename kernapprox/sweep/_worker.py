"""What runs a cell, wherever it runs: in the driver, in a pool process or on a dask worker.

A task carries names and numbers only (the experiment's module, the cell's parameters, the seed); the worker
imports the experiment, derives the cell's ``Generator``, runs the cell with TF32 off (unless the experiment
allows it) and returns numpy arrays. Any exception raised while doing so comes back as :class:`CellError`, a
deterministic failure that is never retried; every other failure (a dead worker, a broken pool) is the
infrastructure's and the driver may resubmit the task.
"""

from __future__ import annotations

import collections
import importlib
import numbers
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from ._experiment import Experiment, accepts


class CellError(RuntimeError):
    """A cell raised (or returned something invalid): a bug or a bad parameter, not a lost worker."""

    def __init__(self, message: str, params: dict | None = None, remote_traceback: str = ""):
        super().__init__(message, params, remote_traceback)
        self.message = message
        self.params = params
        self.remote_traceback = remote_traceback

    def __str__(self):
        text = f"{self.message}; cell {self.params}"
        if self.remote_traceback:
            text += f"\n--- traceback where the cell ran ---\n{self.remote_traceback}"
        return text


@dataclass(frozen=True)
class CellTask:
    """One cell to run: picklable, small, and independent of where it runs."""

    module: str
    experiment: str
    params: dict
    root_seed: int
    spawn_key: tuple[int, ...]
    device: str
    allow_tf32: bool = False
    num_threads: int | None = None
    data_spawn_key: tuple[int, ...] | None = None
    parameters: dict | None = None       # the experiment's fixed parameters, merged into params for run_cell
    reference: bool = False              # a reference cell (Experiment.reference), params = its axes only


@dataclass(frozen=True)
class CellOutcome:
    params: dict
    metrics: dict[str, np.ndarray]
    seconds: float
    modules: tuple[str, ...] = ()        # the library modules loaded where the cell ran, when it finished


_LOADED: list = [0, ()]


def loaded_library() -> tuple[str, ...]:
    """The names of the ``kernapprox`` modules loaded in this process (what a finished cell may have run: its
    dependency record, :mod:`kernapprox.store`); recomputed only when ``sys.modules`` grew."""
    if _LOADED[0] != len(sys.modules):
        from ..provenance import loaded_modules

        _LOADED[:] = [len(sys.modules), loaded_modules(("kernapprox",))]
    return _LOADED[1]


_EXPERIMENTS: dict[tuple[str, str], Experiment] = {}

# The engine's memo of data draws (Experiment.draw), per process: the cells of one draw run one after the other
# (data-major order in the driver, one batch per draw on a pool), so a few entries suffice.
_DRAWS: collections.OrderedDict = collections.OrderedDict()
MAX_DRAWS = 4


def draw_of(experiment: Experiment, task: CellTask, device):
    """The data draw of ``task``'s cell, ``experiment.draw(params, data_rng, device)`` on the data axes' values
    and the fixed parameters, computed once per process and draw (memoised by the data stream's seed, the
    device and those values) and handed to every cell and to the reference of that draw."""
    axes = {a: task.params[a] for a in experiment.data_axes}
    key = (task.module, task.experiment, task.root_seed, task.data_spawn_key, str(device),
           repr(sorted({**(task.parameters or {}), **axes}.items())))
    if key in _DRAWS:
        _DRAWS.move_to_end(key)
        return _DRAWS[key]
    data_rng = np.random.default_rng(np.random.SeedSequence(task.root_seed, spawn_key=task.data_spawn_key))
    value = experiment.draw({**(task.parameters or {}), **axes}, data_rng, device)
    _DRAWS[key] = value
    while len(_DRAWS) > MAX_DRAWS:
        _DRAWS.popitem(last=False)
    return value


def find_experiment(module: str, name: str) -> Experiment:
    """The :class:`Experiment` called ``name`` defined in ``module`` (imported on first use)."""
    key = (module, name)
    if key not in _EXPERIMENTS:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        # `python -m <module>` runs it as __main__: use that copy instead of importing it a second time
        mod = main if spec is not None and spec.name == module else importlib.import_module(module)
        found = [obj for obj in vars(mod).values() if isinstance(obj, Experiment) and obj.name == name]
        if not found:
            raise LookupError(f"module {module!r} defines no Experiment named {name!r}")
        _EXPERIMENTS[key] = found[0]
    return _EXPERIMENTS[key]


def precision_settings(allow_tf32: bool) -> dict:
    """torch's reduced-precision matmul switches for cells: error studies run with TF32 off."""
    return {"cuda_matmul_allow_tf32": bool(allow_tf32), "cudnn_allow_tf32": bool(allow_tf32),
            "float32_matmul_precision": "high" if allow_tf32 else "highest"}


def restore_precision(flags: dict) -> None:
    """Apply switches as returned by :func:`precision_settings` or saved by :func:`precision_flags`."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])


def precision_flags() -> dict:
    import torch

    return {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


class NotApplicable(dict):
    """What a cell returns when its combination does not apply: :func:`not_applicable`."""


def not_applicable(**kept) -> NotApplicable:
    """The one way a cell says "this combination does not apply" (an estimator that needs more points than it
    has, no configuration within the memory budget, a causal run of a non-causal estimator): every metric is NaN
    except the book-keeping values given in ``kept`` (e.g. the budget it was sized for). The engine fills the NaN
    with each metric's shape; the cell's wall time is still recorded, which tells "not applicable" (a time) from
    "not run" (NaN) in ``cell_seconds``."""
    return NotApplicable(kept)


def normalise_metrics(experiment: Experiment, result, reference: bool = False) -> dict[str, np.ndarray]:
    """Check a cell's return value against the experiment's metrics (or its reference's); return float64 numpy
    arrays.

    Every metric must be present and no other key; values are numpy arrays/scalars or Python numbers (bool and
    integers are stored as float64, where NaN marks what did not run). Torch tensors are refused: convert them
    (``.cpu().numpy()``) in the cell, where the device transfer is visible.
    """
    table = experiment.reference.metrics if reference else experiment.metrics
    what = "the reference's run_cell" if reference else "run_cell"
    if not isinstance(result, dict):
        raise TypeError(f"{what} must return a dict metric -> value, got {type(result).__name__}")
    if isinstance(result, NotApplicable):
        result = {**dict.fromkeys(table, np.float64(np.nan)), **result}
    missing = [m for m in table if m not in result]
    extra = [k for k in result if k not in table]
    if missing or extra:
        raise ValueError(f"{what} returned keys {sorted(result)}; missing metrics {missing}, unknown keys {extra}")
    out = {}
    for name, metric in table.items():
        value = result[name]
        if not isinstance(value, np.ndarray | np.generic | numbers.Real):
            raise TypeError(f"metric {name!r}: expected a numpy array/scalar or a real number, got "
                            f"{type(value).__name__}")
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"metric {name!r}: expected real numbers, got dtype {arr.dtype}")
        arr = arr.astype(np.float64)
        if arr.ndim != len(metric.dims) and not (arr.ndim == 0 and np.isnan(arr)):
            raise ValueError(f"metric {name!r} has dims {metric.dims} but the cell returned shape {arr.shape}")
        for dim, size in zip(metric.dims, arr.shape):
            if metric.coords and dim in metric.coords and arr.ndim and size != len(metric.coords[dim]):
                raise ValueError(f"metric {name!r}: dimension {dim!r} has {len(metric.coords[dim])} coordinates "
                                 f"but the cell returned {size} values")
        out[name] = arr
    return out


def execute_cell(task: CellTask) -> CellOutcome:
    """Run one cell; any failure inside comes back as :class:`CellError` with the remote traceback."""
    try:
        import torch

        experiment = find_experiment(task.module, task.experiment)
        if task.num_threads is not None and torch.get_num_threads() != task.num_threads:
            torch.set_num_threads(task.num_threads)
        previous = precision_flags()
        restore_precision(precision_settings(task.allow_tf32))
        device = torch.device(task.device)
        rng = np.random.default_rng(np.random.SeedSequence(task.root_seed, spawn_key=task.spawn_key))
        fn = experiment.reference.run_cell if task.reference else experiment.run_cell
        extra = {}
        if task.data_spawn_key is not None and (experiment.draw is None or accepts(fn, "data_rng")):
            extra["data_rng"] = np.random.default_rng(np.random.SeedSequence(task.root_seed,
                                                                             spawn_key=task.data_spawn_key))
        params = {**(task.parameters or {}), **task.params}
        if experiment.draw is not None:
            extra["data"] = draw_of(experiment, task, device)
        try:
            start = time.perf_counter()
            result = fn(params, device, **extra) if task.reference else fn(params, rng, device, **extra)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        finally:
            restore_precision(previous)
        return CellOutcome(dict(task.params), normalise_metrics(experiment, result, task.reference), seconds,
                           loaded_library())
    except CellError:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure of the cell itself is reported, not retried
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        what = "reference of experiment" if task.reference else "experiment"
        raise CellError(f"{what} {task.experiment!r} failed: {type(exc).__name__}: {exc}", dict(task.params),
                        traceback.format_exc()) from None


def execute_batch(tasks: tuple[CellTask, ...]) -> list[CellOutcome]:
    """The cells of one data draw, in order (the reference first when it is among them): the draw is computed
    once for all of them (:func:`draw_of`). What a pool or dask worker runs for a study that declares a draw."""
    return [execute_cell(task) for task in tasks]


def init_pool_worker(num_threads: int | None) -> None:
    """Process-pool initializer: one share of the cores per worker (no oversubscription)."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=num_threads)          # numpy/scipy BLAS too, for the worker's lifetime
