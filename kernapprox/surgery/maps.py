"""The fitted maps: per-``(layer, head)`` fitted estimators (learned maps distilled on calibration text,
calibrated data-dependent maps) stored once, without pickles, in the result store (:mod:`kernapprox.store`).

An entry is the store object ``maps/<estimator>_<hash>`` (:func:`find_maps`, :func:`store_maps`), ``<hash>`` a hash of
the configuration that produced it (estimator, ``r``, options, seed, calibration data and its text hash, model),
valid while the code the fitting process loaded is unchanged (the store's rule). It holds one file, ``maps.npz``:
each map's ``fitted_state()`` arrays under ``L<layer>H<head>/<name>``, and a ``__provenance__`` entry (JSON) with
that configuration, the package versions, the creation date and the fitting seconds. Loading uses
``allow_pickle=False`` and rebuilds each map with ``load_fitted_state`` after a fit on placeholder points that only
builds its structure.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from ..io import atomic_write

__all__ = ["config_hash", "find_maps", "store_maps", "save_maps", "load_maps", "read_provenance"]


def config_hash(config: Mapping) -> str:
    """A short, stable hash of a JSON-serialisable configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:20]


NAMESPACE = "maps"


def _store(folder):
    from ..store import Store, default_store

    return default_store() if folder is None else Store(Path(folder) / "store")


def find_maps(estimator: str, config: Mapping, folder=None) -> Path | None:
    """The ``maps.npz`` of the valid store entry of ``config`` (``None``: fit them); ``folder`` is a cache root
    (default: :func:`kernapprox.cache.cache_root`)."""
    entry = _store(folder).find(NAMESPACE, f"{estimator}_{config_hash(config)}")
    return None if entry is None else entry / "maps.npz"


def store_maps(estimator: str, config: Mapping, maps: Mapping[tuple[int, int], object], seconds: float,
               folder=None) -> Path:
    """Store fitted maps under ``config`` (:func:`save_maps` into a new store entry); returns their file."""
    entry = _store(folder).put(NAMESPACE, f"{estimator}_{config_hash(config)}",
                               lambda tmp: save_maps(tmp / "maps.npz", maps, config, seconds))
    return entry / "maps.npz"


def save_maps(path: Path, maps: Mapping[tuple[int, int], object], config: Mapping, seconds: float) -> None:
    """Write ``{(layer, head): fitted estimator}`` with its provenance, atomically."""
    arrays = {}
    for (layer, head), est in maps.items():
        for key, value in est.fitted_state().items():
            value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            arrays[f"L{layer}H{head}/{key}"] = value
    provenance = {"config": dict(config), "fit_seconds": round(seconds, 3), "torch_version": str(torch.__version__),
                  "kernapprox_version": importlib.metadata.version("kernapprox"),
                  "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "threads": torch.get_num_threads()}
    arrays["__provenance__"] = np.array(json.dumps(provenance, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:                    # a file object: np.savez would append ".npz" to a path
            np.savez(f, **arrays)

    atomic_write(path, write)


def load_maps(path: Path, make: Callable[[int, int], object], keys, placeholder: torch.Tensor) -> dict:
    """``{(layer, head): estimator}`` for every ``(layer, head)`` in ``keys``: ``make(layer, head)`` fitted on
    ``placeholder`` (structure only), then its stored state loaded."""
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    maps = {}
    for layer, head in keys:
        prefix = f"L{layer}H{head}/"
        state = {key[len(prefix):]: (value if value.ndim else value.item())
                 for key, value in arrays.items() if key.startswith(prefix)}
        est = make(layer, head).fit(placeholder, placeholder)
        maps[(layer, head)] = est.load_fitted_state(state)
    return maps


def read_provenance(path: Path) -> dict | None:
    """The ``__provenance__`` record of a cache entry (``None`` when there is none)."""
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as stored:
        return json.loads(str(stored["__provenance__"]))
