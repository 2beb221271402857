"""Provenance of a result: code revision and dependency record, package versions, device, threads, command line."""

from __future__ import annotations

import importlib
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

from ..provenance import git_revision

PACKAGES = {"numpy": "numpy", "scipy": "scipy", "torch": "torch", "xarray": "xarray", "sklearn": "scikit-learn",
            "h5netcdf": "h5netcdf", "dask": "dask", "distributed": "distributed", "matplotlib": "matplotlib",
            "seaborn": "seaborn", "kernapprox": "kernapprox"}


def _module_dir(module: str) -> Path | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    file = getattr(mod, "__file__", None)
    return Path(file).resolve().parent if file else None


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name, dist in PACKAGES.items():
        try:
            versions[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def device_description(device) -> str:
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (f"cuda:{index} ({torch.cuda.get_device_name(index)}, CUDA {torch.version.cuda}, "
                f"{torch.cuda.device_count()} visible)")
    return f"cpu ({platform.machine()}, {platform.processor() or 'unknown processor'}, {os.cpu_count()} cores)"


def thread_counts() -> dict[str, object]:
    import torch

    return {"torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "cpu_count": os.cpu_count(),
            **{var: os.environ.get(var, "") for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                         "OPENBLAS_NUM_THREADS")}}


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    return shlex.join([os.path.basename(sys.executable), *argv]) if argv else "python (interactive)"


def provenance_attrs(experiment, preset: str, grid: dict, root_seed: int, device, executor: str,
                     precision: dict, history: str, code: str, cell_threads: int | None = None,
                     parameters: dict | None = None, changes: dict | None = None) -> dict:
    """Global attributes of a result dataset (strings and numbers; JSON for structures).

    ``preset`` is the preset's name only when the run covered that preset's grid with the default parameters;
    otherwise it is ``"custom"``, ``preset_base`` names the preset it started from and ``grid_changes`` (JSON)
    says what changed (``--seeds``, ``--only``, ``--set``). ``grid`` is always the grid actually run."""
    threads = thread_counts()
    if cell_threads is not None:
        threads["torch_num_threads"] = cell_threads
    where = _module_dir(experiment.module)
    return {
        "title": experiment.title,
        "experiment": experiment.name,
        "description": experiment.description,
        "preset": "custom" if changes else preset,
        "preset_base": preset,
        "grid_changes": json.dumps(changes or {}),
        "grid": json.dumps(grid),
        "parameters": json.dumps(parameters or {}),
        "root_seed": int(root_seed),
        "git_revision": git_revision(where),
        "code_digest": code,
        "package_versions": json.dumps(package_versions()),
        "device": device_description(device),
        "executor": executor,
        "torch_num_threads": int(threads["torch_num_threads"]),
        "torch_num_interop_threads": int(threads["torch_num_interop_threads"]),
        "threads": json.dumps(threads),
        "precision": json.dumps(precision),
        "history": history,
        "seeding": "cell rng = numpy SeedSequence(root_seed, spawn_key=(blake2b-64 of 'experiment=<name>', "
                   "blake2b-64 of '<axis>=<json value>' for each axis sorted by name))"
                   + (f"; data_rng: spawn_key=(blake2b-64 of 'experiment=<name>', of 'stream=data', of "
                      f"'<axis>=<json value>' for the data axes {list(experiment.data_axes)})"
                      if experiment.data_axes else ""),
    }
