"""Running a grid: choose the cells still to do, fan them out to an executor, persist each as it finishes.

Executors: in-process (``workers=0``, the default, and the right choice on one GPU), a local process pool
(``workers=N``, spawn context, one share of the cores per worker), ``dask.distributed`` (``scheduler=ADDRESS``
or ``dask=True`` for a ``LocalCluster`` of ``workers`` processes), or any ``concurrent.futures.Executor``.
Tasks carry names and numbers; results come back as numpy arrays; only this driver writes.

A task lost to the infrastructure (a dead worker, a broken pool, a cancelled future) is resubmitted up to
``max_retries`` times (a broken pool that we own is rebuilt first). A cell that raises fails the run at once,
with the worker's traceback: cells are deterministic, so retrying a bug would only repeat it. Finished cells
are already in the progress store either way, so the next run resumes.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import xarray as xr

from ..provenance import merge_records, record_id
from ..store import default_store, input_key, interrupts_deferred
from ._experiment import (
    Experiment,
    cell_key,
    cell_spawn_key,
    check_root_seed,
    check_values,
    data_spawn_key,
    iter_cells,
    replace_values,
    select,
)
from ._provenance import command_line, provenance_attrs
from ._store import REFERENCE_MARK, assemble, check_output_path, reference_key, write
from ._worker import CellError, CellTask, execute_batch, execute_cell, init_pool_worker, precision_settings


class SweepError(RuntimeError):
    """The infrastructure kept failing (cells lost more than ``max_retries`` times, or an executor we cannot
    rebuild broke)."""


def resolve_device(device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``."""
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    else:
        raise TypeError(f"device must be a string or torch.device, got {type(device).__name__}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r} was asked for but CUDA is not available here; use --device cpu or auto")
    return dev


def default_output(experiment: Experiment, only=None, custom: bool = False, preset: str = "default") -> Path:
    """``results/<name>.nc`` for the default preset and ``results/<name>_<preset>.nc`` for another, so that no preset
    writes over another's result; a slice run (``only``) goes to ``results/<name>.only.nc`` and a run with a changed
    grid or parameters (``custom``) to ``results/<name>.custom.nc``, so neither replaces a preset's result."""
    if only:
        return Path("results") / f"{experiment.name}.only.nc"
    if custom:
        return Path("results") / f"{experiment.name}.custom.nc"
    return Path("results") / f"{experiment.name}{preset_suffix(preset)}.nc"


def preset_suffix(preset: str) -> str:
    """``""`` for the default preset, ``"_<preset>"`` for any other: the suffix of its dataset and figure names
    (as the Makefile names them)."""
    return "" if preset == "default" else f"_{preset}"


def default_figure(experiment: Experiment, preset: str = "default") -> Path:
    """``figures/<name>.png`` for the default preset, ``figures/<name>_<preset>.png`` for another."""
    return Path("figures") / f"{experiment.name}{preset_suffix(preset)}.png"


def resolve_grid(experiment: Experiment, preset: str, *, seeds: int | None = None, only=None, set_values=None,
                 parameters=None) -> tuple[dict[str, list], dict, dict]:
    """The grid a run covers and the fixed parameters it uses: ``(grid, parameter values, changes)``.

    ``changes`` records how the run departs from the preset (``seeds``, ``only``, ``set``, ``parameters``; empty
    when it is the preset itself), so the dataset says which grid it holds instead of a preset label alone.
    """
    grid = experiment.grid(preset)
    changes: dict = {}
    if seeds is not None:
        if "seed" not in grid:
            raise ValueError(f"seeds: experiment {experiment.name!r} has no 'seed' axis")
        if isinstance(seeds, bool) or not isinstance(seeds, int) or not 0 < seeds <= sys.maxsize:
            raise ValueError(f"seeds must be a positive integer (at most {sys.maxsize}), got {seeds!r}")
        grid["seed"] = list(range(seeds))
        changes["seeds"] = seeds
    grid = replace_values(experiment, grid, set_values)
    grid = select(experiment, grid, only)
    values = experiment.parameter_values(parameters)
    check_values(experiment, grid, values)
    if set_values:
        changes["set"] = {axis: grid[axis] for axis in set_values}
    if only:
        changes["only"] = {axis: grid[axis] for axis in only}
    changed = {k: v for k, v in values.items() if v != experiment.parameters[k].value}
    if changed:
        changes["parameters"] = changed
    if grid == experiment.grid(preset) and not changed:
        changes = {}
    return grid, values, changes


# -------------------------------------------------------------------------------------------------- executors
class _InlineExecutor(cf.Executor):
    """Runs each task when it is submitted, in this process."""

    def submit(self, fn, /, *args, **kwargs):
        future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - delivered through the future, like any executor
            future.set_exception(exc)
        return future


@dataclass
class _Plan:
    executor: cf.Executor
    description: str
    window: int                      # tasks in flight at most (bounded memory; results persisted as they come)
    num_threads: int | None = None   # torch threads per task where we own the workers
    rebuild: object = None           # () -> Executor, for pools we own
    closers: list = field(default_factory=list)

    def close(self, cancel: bool = False):
        if self.rebuild is not None:  # a pool we own
            self.executor.shutdown(wait=not cancel, cancel_futures=cancel)
        for close in reversed(self.closers):  # dask: closing the client releases its tasks
            close()


def _threads_per_worker(workers: int, threads: int | None) -> int:
    return threads or max(1, (os.cpu_count() or 1) // workers)


def _make_plan(workers: int, use_dask: bool, scheduler: str | None, executor, threads: int | None) -> _Plan:
    if executor is not None:
        if not isinstance(executor, cf.Executor):
            raise TypeError(f"executor must be a concurrent.futures.Executor, got {type(executor).__name__}")
        return _Plan(executor, f"{type(executor).__name__} (given)", window=1024, num_threads=threads)
    if scheduler or use_dask:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise ImportError("the dask executor needs dask.distributed: pip install 'kernapprox[dask]'") from None
        closers = []
        if scheduler:
            client = Client(scheduler)
            description = f"dask.distributed at {scheduler}"
            num_threads = threads
        else:
            if workers <= 0:
                raise ValueError("--dask needs --workers N (N >= 1 worker processes for the LocalCluster)")
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address=None)
            closers.append(cluster.close)
            client = Client(cluster)
            description = f"dask.distributed LocalCluster, {workers} worker processes"
            num_threads = _threads_per_worker(workers, threads)
        closers.append(client.close)
        slots = max(1, sum(client.nthreads().values()))
        plan = _Plan(client.get_executor(pure=False), description, window=max(4, 4 * slots),
                     num_threads=num_threads, closers=closers)
        return plan
    if workers > 0:
        def pool():
            return cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                          initializer=init_pool_worker,
                                          initargs=(_threads_per_worker(workers, threads),))
        return _Plan(pool(), f"process pool, {workers} workers", window=2 * workers,
                     num_threads=_threads_per_worker(workers, threads), rebuild=pool)
    return _Plan(_InlineExecutor(), "in-process", window=1, num_threads=threads)


def _execute(tasks: list[CellTask], plan: _Plan, max_retries: int, on_done) -> None:
    queue = collections.deque(tasks)
    pending: dict[cf.Future, CellTask] = {}
    lost = collections.Counter()

    def lose(task, exc):
        key = cell_key(_first(task).params)
        lost[key] += 1
        if lost[key] > max_retries:
            raise SweepError(f"cell {_first(task).params} was lost {lost[key]} times (max_retries={max_retries}); last "
                             f"failure: {type(exc).__name__}: {exc}") from exc
        queue.appendleft(task)

    def rebuild(exc):
        if plan.rebuild is None:
            raise SweepError(f"the executor broke ({type(exc).__name__}: {exc}) and is not ours to rebuild") from exc
        plan.executor.shutdown(wait=False, cancel_futures=True)
        plan.executor = plan.rebuild()

    try:
        _drain(queue, pending, plan, lose, rebuild, on_done)
    except BaseException:
        for future in pending:
            future.cancel()
        raise


def _first(task):
    return task[0] if isinstance(task, tuple) else task


def _batched(tasks: list[CellTask]) -> list:
    """The cells of each data draw as one tuple (in their order: the reference first), for executors whose
    workers would otherwise each compute the same draw (:attr:`Experiment.draw`)."""
    groups: dict = {}
    for task in tasks:
        groups.setdefault(task.data_spawn_key, []).append(task)
    return [tuple(group) for group in groups.values()]


def _drain(queue, pending, plan, lose, rebuild, on_done):
    while queue or pending:
        while queue and len(pending) < plan.window:
            task = queue.popleft()
            try:
                fn = execute_batch if isinstance(task, tuple) else execute_cell
                pending[plan.executor.submit(fn, task)] = task
            except cf.BrokenExecutor as exc:
                lose(task, exc)
                rebuild(exc)
        if not pending:
            continue
        done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        broken = None
        for future in done:
            task = pending.pop(future)
            try:
                outcome = future.result()
            except CellError:
                raise
            except Exception as exc:  # noqa: BLE001 - the infrastructure's failure: resubmit (bounded)
                lose(task, exc)
                if isinstance(exc, cf.BrokenExecutor):
                    broken = exc
            else:
                if isinstance(task, tuple):            # the cells of one data draw
                    for one, result in zip(task, outcome):
                        on_done(one, result)
                else:
                    on_done(task, outcome)
        if broken is not None:
            rebuild(broken)


# ------------------------------------------------------------------------------------------------------ run
def run(experiment: Experiment, preset: str = "smoke", out=None, device="cpu", only=None, workers: int = 0,
        resume: bool = True, *, seeds: int | None = None, root_seed: int = 0, executor=None, dask: bool = False,
        scheduler: str | None = None, max_retries: int = 2, threads: int | None = None,
        progress: bool | None = None, history: str | None = None, set_values=None,
        parameters=None) -> xr.Dataset:
    """Run ``experiment``'s grid ``preset`` and write the dataset to ``out``; returns the dataset.

    Parameters
    ----------
    experiment : Experiment
    preset : str
        A key of ``experiment.grids``.
    out : path, optional
        Output file (default ``results/<name>.nc``, or ``results/<name>.only.nc`` with ``only``). Progress is
        kept in ``<out>.partial/`` until the dataset is written.
    device : "auto", "cpu", "cuda", "cuda:N" or torch.device
    only : mapping axis -> value or list of values, optional
        Run a slice of the grid (values must be values of the experiment).
    set_values : mapping axis -> list of values, optional
        Replace the values of axes by any values of their type (``--set axis=v1,v2``).
    parameters : mapping name -> value, optional
        Change fixed parameters of the experiment (``--set name=value``).
    workers : int
        0 runs cells in this process; ``N`` > 0 uses a spawn process pool of N workers (or, with ``dask``, a
        dask ``LocalCluster`` of N worker processes).
    resume : bool
        Reuse every cell the result store (:mod:`kernapprox.store`) holds with the same inputs (experiment,
        coordinates, fixed parameters, root seed, device type) made by today's code: the cells of an interrupted
        run, of another preset, of an earlier run whose code has not changed since (a library edit reruns only
        the cells whose processes loaded the edited module). ``False`` (``--force``) recomputes every cell.
        Interrupted (Ctrl-C), the run says how many cells are saved and how to resume.
    seeds : int, optional
        Replace the ``seed`` axis by ``0 .. seeds-1``.
    root_seed : int
        Root of every cell's ``SeedSequence``.
    executor : concurrent.futures.Executor, optional
        Run cells there (e.g. ``distributed.Client.get_executor()``); it is not shut down.
    dask : bool
        With ``workers``: start a dask ``LocalCluster``.
    scheduler : str, optional
        Address of a running ``dask.distributed`` scheduler.
    max_retries : int
        Resubmissions of a cell lost to the infrastructure.
    threads : int, optional
        torch threads per running cell (default: torch's own choice in-process, the cores divided among pool
        workers). Small CPU problems run faster with 1 thread per process than with threads that wait on each
        other, especially when several runs share the machine (``make -j``).
    progress : bool, optional
        Progress bar (default: when stderr is a terminal).
    history : str, optional
        The command line to record (default: ``sys.argv``).
    """
    if not isinstance(experiment, Experiment):
        raise TypeError(f"experiment must be an Experiment, got {type(experiment).__name__}")
    for name, value in (("workers", workers), ("max_retries", max_retries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be a bool, got {resume!r}")
    grid, values, changes = resolve_grid(experiment, preset, seeds=seeds, only=only, set_values=set_values,
                                         parameters=parameters)
    out = Path(out) if out is not None else default_output(experiment, only, bool(changes), preset)
    dev = resolve_device(device)
    root_seed = check_root_seed(root_seed)
    check_output_path(out, experiment.name)
    out.parent.mkdir(parents=True, exist_ok=True)

    started = datetime.now(UTC)
    clock = time.perf_counter()
    cpu_clock = _cpu_seconds()
    store = default_store()
    inputs = {"experiment": experiment.name, "root_seed": root_seed, "device_type": dev.type,
              "allow_tf32": experiment.allow_tf32, "parameters": values}
    cells = [(params, False) for _, params in iter_cells(grid)]
    ref_grid = {a: grid[a] for a in experiment.reference_axes}
    cells += [(params, True) for _, params in iter_cells(ref_grid)] if ref_grid else []
    keys = [reference_key(p) if ref else cell_key(p) for p, ref in cells]
    store_keys = {key: cell_input_key(inputs, p, ref) for (p, ref), key in zip(cells, keys)}
    finished: dict[str, dict] = {}
    driver_threads = torch.get_num_threads()  # in-process cells may change it; put it back afterwards
    try:
        if resume:
            stored = store.valid_cells(experiment.name)
            for key in keys:
                hit = stored.get(store_keys[key])
                if hit is None:
                    continue
                cell = store.read_cell(hit[1])
                if cell is None:
                    print(f"warning: unreadable cell file {hit[1]} is ignored; its cell runs again", file=sys.stderr)
                    hit[1].unlink(missing_ok=True)
                else:
                    finished[key] = {**cell, "record": hit[0]}
        todo = [(p, ref) for (p, ref), k in zip(cells, keys) if k not in finished]
        reused = len(cells) - len(todo)
        plan = (_make_plan(workers, dask, scheduler, executor, threads) if todo
                else _Plan(_InlineExecutor(), "none", 1))
        if experiment.data_axes:
            # data-major order, the reference of each draw first: cells that share a data draw run one after the
            # other, so a cell may memoise what its draw costs to make (episodes, the exact computation)
            position = {axis: {value: i for i, value in enumerate(grid[axis])} for axis in experiment.data_axes}
            todo.sort(key=lambda item: (tuple(position[a][item[0][a]] for a in experiment.data_axes), not item[1]))
        tasks = [CellTask(experiment.module, experiment.name, p, root_seed, cell_spawn_key(experiment.name, p),
                          str(dev), experiment.allow_tf32, plan.num_threads,
                          data_spawn_key(experiment.name, p, experiment.data_axes) if experiment.data_axes else None,
                          values, ref)
                 for p, ref in todo]
        show = sys.stderr.isatty() if progress is None else bool(progress)
        from tqdm.auto import tqdm

        with tqdm(total=len(tasks), desc=experiment.name, unit="cell", disable=not show, smoothing=0.1) as bar:
            def on_done(task, outcome):
                key = reference_key(task.params) if task.reference else cell_key(task.params)
                if key in finished:  # a resubmitted duplicate: the first result stands
                    return
                stored = {**task.params, REFERENCE_MARK: True} if task.reference else task.params
                rid = store.current_record(outcome.modules or None, study=experiment.module)
                store.put_cell(experiment.name, store_keys[key], rid, stored, outcome.metrics, outcome.seconds)
                finished[key] = {"params": stored, "metrics": outcome.metrics, "seconds": outcome.seconds,
                                 "record": rid}
                bar.update(1)

            ok = False
            try:
                batched = experiment.draw is not None and not isinstance(plan.executor, _InlineExecutor)
                with blas_threads(plan.num_threads):
                    _execute(_batched(tasks) if batched else tasks, plan, max_retries, on_done)
                ok = True
            finally:
                plan.close(cancel=not ok)
        ended = datetime.now(UTC)
        wall = time.perf_counter() - clock
        cpu = _cpu_seconds() - cpu_clock
        records = [store.record(finished[k]["record"]) for k in dict.fromkeys(keys)]
        dependencies = merge_records(r for r in records if r is not None)
        attrs = provenance_attrs(experiment, preset, grid, root_seed, dev, plan.description,
                                 precision_settings(experiment.allow_tf32),
                                 history if history is not None else command_line(), record_id(dependencies),
                                 plan.num_threads, values, changes)
        attrs.update({"time_start": started.isoformat(timespec="seconds"),
                      "time_end": ended.isoformat(timespec="seconds"), "wall_seconds": round(wall, 3),
                      "cpu_seconds": round(cpu, 3),
                      "cells_total": len(cells), "cells_run": len(tasks), "cells_reused": reused,
                      "dependencies": json.dumps(dependencies, sort_keys=True),
                      "timings": json.dumps({"start": started.isoformat(), "end": ended.isoformat(),
                                             "wall_seconds": wall, "cpu_seconds": cpu, "cells_run": len(tasks),
                                             "cells_reused": reused})})
        ds = assemble(experiment, grid, {k: finished[k] for k in keys}, attrs, values)
        ds = summarise_dataset(experiment, ds)
        with interrupts_deferred():
            write(ds, out)
    except KeyboardInterrupt:
        saved = sum(k in finished for k in keys)
        print(f"\n{experiment.name}: interrupted: {saved} of {len(cells)} cells saved in the store "
              f"({store.root}); rerun the same command to resume", file=sys.stderr)
        raise
    finally:
        if torch.get_num_threads() != driver_threads:
            torch.set_num_threads(driver_threads)
    print(f"{experiment.name} [{ds.attrs['preset']}]: {len(tasks)} cells run, {reused} reused, "
          f"{time.perf_counter() - clock:.1f} s on {dev}, {_cpu_seconds() - cpu_clock:.1f} CPU-s "
          f"({plan.description}) -> {out}", file=sys.stderr)
    return ds


def cell_input_key(inputs: dict, params: dict, reference: bool) -> str:
    """The store key of a cell: its experiment, coordinates (a reference cell marked), fixed parameters, root seed,
    device type and TF32 switch (:func:`kernapprox.store.input_key`)."""
    return input_key({**inputs, "params": params, "reference": bool(reference)})


def blas_threads(num_threads: int | None):
    """A context limiting numpy's and scipy's BLAS/OpenMP thread pools (threadpoolctl) to ``num_threads``, the torch
    thread count of the cells this process runs (``None``: no limit). Without it a multithreaded BLAS call
    (``eigh``, ``qr``) on cores already busy spins its threads instead of working: on a loaded 2-core machine a
    256×256 ``eigh`` took 10× its one-thread time."""
    if num_threads is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=num_threads)


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (pool workers), user and system."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def summarise_dataset(experiment: Experiment, ds: xr.Dataset) -> xr.Dataset:
    """Apply the experiment's ``summarise`` (paired comparisons, summaries with intervals) and document the
    summaries in the attributes (:func:`kernapprox.stats.describe_summaries`). Every variable it adds must carry
    ``long_name``, ``units`` and ``description``; every summary its ``statistic``, ``interval`` and ``over``."""
    from .. import stats

    if experiment.summarise is None:
        return _with_coordinate_attrs(experiment, ds)
    out = experiment.summarise(ds.copy())                 # a shallow copy: what it adds is visible here
    if not isinstance(out, xr.Dataset):
        raise TypeError(f"summarise of {experiment.name!r} must return an xarray.Dataset, got {type(out).__name__}")
    for name in set(out.data_vars) - set(ds.data_vars):
        var = out[name]
        missing = [a for a in ("long_name", "units", "description") if not var.attrs.get(a)]
        if stats.is_summary(var):
            missing += [a for a in ("statistic", "interval", "over") if a not in var.attrs]
        if missing:
            raise ValueError(f"summarise of {experiment.name!r}: variable {name!r} lacks attributes {missing}")
    out.attrs.update(stats.describe_summaries(out))
    return _with_coordinate_attrs(experiment, out)


def _with_coordinate_attrs(experiment: Experiment, ds: xr.Dataset) -> xr.Dataset:
    """Every coordinate with its ``long_name`` and ``units``: those it has, else the experiment's
    (:meth:`Experiment.coordinate_attrs`: its ``axis_attrs``, then :data:`AXIS_ATTRS`, then the name itself)."""
    for name in ds.coords:
        attrs = ds[name].attrs
        if not attrs.get("long_name") or not attrs.get("units"):
            ds[name].attrs = {**experiment.coordinate_attrs(name), **{k: v for k, v in attrs.items() if v}}
    return ds
