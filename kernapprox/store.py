"""The result store: every computed result (a study's cell, a trained model, a fitted map, a distilled student)
kept once, under the key of its inputs, with the record of the code it depends on; reused while that code is
unchanged, recomputed when it is not.

Layout, below ``<cache root>/store`` (:func:`kernapprox.cache.cache_root`):

``records/<id>.json``
    A dependency record (:func:`kernapprox.provenance.dependency_record`): the library modules the computing
    process had loaded with the digests of their code, the study's compute slice, the package versions. Many
    results share one record; ``<id>`` is the digest of its content.
``cells/<experiment>/<cell>.<record>.npz``
    One finished cell of a study: its metrics, parameters and seconds. ``<cell>`` is the digest of its inputs
    (the experiment's name, the cell's coordinates, the fixed parameters, the root seed, the device type, TF32):
    every preset of a study that holds the cell finds it, and a study that extends another reuses its cells.
``objects/<namespace>/<key>.<record>/``
    A folder of files (a trained model's weights and training curve, a student's maps), ``<key>`` the digest of
    the configuration the caller gives.

A result is *valid* while :func:`kernapprox.provenance.changes` of its record is empty: no module it loaded has
another digest now (a comment, a docstring or formatting never changes one), its study's compute code is the
same, and so are the package versions. A library edit therefore recomputes exactly the results made by
processes that loaded the edited module, and nothing else; an edit of a study's findings or plot recomputes
nothing (the report is drawn again from the cells). The rule follows the content-addressed stores of build
systems and of pytest-testmon's dependency tracking; the code is this project's own.

Writes are atomic (a temporary file renamed into place, :func:`kernapprox.io.atomic_write`) and hold back
``SIGINT`` until the file is whole (:func:`interrupts_deferred`), so concurrent writers of the same result and a
run interrupted at any moment leave only whole entries (two writers of one entry write the same name; the last
rename wins and both are valid). ``python -m kernapprox.store size`` reports what the store holds and ``prune``
removes the entries whose record is no longer valid (or every entry of a namespace).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from . import provenance
from .cache import cache_root
from .io import _fsync_dir, atomic_write

__all__ = ["Store", "default_store", "interrupts_deferred", "input_key"]


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back ``SIGINT`` (Ctrl-C) inside the block and raise :class:`KeyboardInterrupt` after it, so that a
    file being written is finished (or not begun) when the interrupt arrives. Outside the main thread, or where
    the handler cannot be set, the block runs unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except (ValueError, OSError):                     # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def input_key(payload: Mapping) -> str:
    """SHA-256 (32 hex digits) of a JSON payload: the key of a result's inputs."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def _check_name(value, what: str) -> str:
    if not isinstance(value, str) or not value or not all(c.isalnum() or c in "_-" for c in value):
        raise ValueError(f"{what} must be a non-empty name of letters, digits, '_' and '-', got {value!r}")
    return value


class Store:
    """The result store below ``root`` (default: ``<cache root>/store``). See the module docstring.

    Validity of a record is computed once per store object (the code of a running process does not change; a
    source file edited while it runs is refused when a record is made:
    :class:`kernapprox.provenance.SourceChangedError`)."""

    def __init__(self, root: str | os.PathLike | None = None, *, project: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_root() / "store"
        self.project = Path(project) if project is not None else None
        self._valid: dict[str, bool] = {}
        self._records: dict[str, dict] = {}
        self._ids: dict[tuple, str] = {}

    # ------------------------------------------------------------------------------------------- records
    def _folder(self, *parts: str) -> Path:
        folder = self.root.joinpath(*parts)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def put_record(self, record: dict) -> str:
        """Store a dependency record (once); returns its id."""
        rid = provenance.record_id(record)
        path = self._folder("records") / f"{rid}.json"
        if not path.exists():
            with interrupts_deferred():
                atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record, sort_keys=True, indent=0)),
                             durable=False)
        return rid

    def record(self, rid: str) -> dict | None:
        """The record ``rid`` (``None`` when it is missing or unreadable)."""
        if rid not in self._records:
            try:
                self._records[rid] = json.loads((self.root / "records" / f"{rid}.json").read_text())
            except (OSError, ValueError):
                return None
        return self._records[rid]

    def valid(self, rid: str) -> bool:
        """Whether the code, study and packages of record ``rid`` are today's
        (:func:`kernapprox.provenance.changes`)."""
        if rid not in self._valid:
            record = self.record(rid)
            self._valid[rid] = record is not None and not provenance.changes(record, root=self.project)
        return self._valid[rid]

    def current_record(self, modules=None, *, study: str | None = None) -> str:
        """Record (and store) what a result finished now depends on: the library ``modules`` (default: those
        loaded), ``study``'s compute slice and the packages; returns the record's id. Memoised on the modules."""
        names = provenance.loaded_modules((provenance.PACKAGE,)) if modules is None else tuple(sorted(modules))
        key = (names, study)
        if key not in self._ids:
            self._ids[key] = self.put_record(provenance.dependency_record(names, study=study, root=self.project))
        return self._ids[key]

    # --------------------------------------------------------------------------------------------- cells
    def cells(self, experiment: str) -> dict[str, list[tuple[str, Path]]]:
        """Every stored cell of ``experiment``: ``{cell key: [(record id, path), ...]}``, newest first."""
        folder = self.root / "cells" / _check_name(experiment, "experiment")
        found: dict[str, list[tuple[float, str, Path]]] = {}
        if folder.is_dir():
            with os.scandir(folder) as entries:
                for entry in entries:
                    parts = entry.name.split(".")
                    if len(parts) == 3 and parts[2] == "npz":
                        found.setdefault(parts[0], []).append((entry.stat().st_mtime, parts[1], Path(entry.path)))
        return {key: [(rid, path) for _, rid, path in sorted(items, reverse=True)] for key, items in found.items()}

    def valid_cells(self, experiment: str) -> dict[str, tuple[str, Path]]:
        """``{cell key: (record id, path)}`` of the newest valid entry of each stored cell of ``experiment``."""
        out = {}
        for key, entries in self.cells(experiment).items():
            for rid, path in entries:
                if self.valid(rid):
                    out[key] = (rid, path)
                    break
        return out

    @staticmethod
    def read_cell(path: Path) -> dict | None:
        """``{"params", "metrics", "seconds"}`` of a stored cell; ``None`` if the file is damaged or holds another
        cell than its name says (its key is stored inside too)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            params = json.loads(str(arrays.pop("__params__")))
            seconds = float(arrays.pop("__seconds__"))
            key = str(arrays.pop("__key__"))
        except Exception:  # noqa: BLE001 - any damage means: run the cell again
            return None
        if key != Path(path).name.split(".")[0]:
            return None
        return {"params": params, "metrics": arrays, "seconds": seconds}

    def put_cell(self, experiment: str, key: str, rid: str, params: dict, metrics: Mapping[str, np.ndarray],
                 seconds: float) -> Path:
        """Store one finished cell under its input ``key`` and record ``rid`` (atomically, SIGINT held back)."""
        buffer = io.BytesIO()
        np.savez(buffer, __params__=np.array(json.dumps(params)), __seconds__=np.array(float(seconds)),
                 __key__=np.array(key), **metrics)
        path = self._folder("cells", _check_name(experiment, "experiment")) / f"{key}.{rid}.npz"
        with interrupts_deferred():
            atomic_write(path, lambda tmp: tmp.write_bytes(buffer.getvalue()), durable=False)
        return path

    # ------------------------------------------------------------------------------------------- objects
    def find(self, namespace: str, key: str) -> Path | None:
        """The folder of the newest valid entry of ``key`` in ``namespace`` (``None``: compute it)."""
        folder = self.root / "objects" / _check_name(namespace, "namespace")
        if not folder.is_dir():
            return None
        entries = sorted((p for p in folder.glob(f"{_check_name(key, 'key')}.*") if p.is_dir()),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for path in entries:
            if self.valid(path.name.split(".", 1)[1]):
                return path
        return None

    def put(self, namespace: str, key: str, write: Callable[[Path], None], *, modules=None) -> Path:
        """Store an object: ``write(folder)`` writes its files into a new folder, which is renamed into place as
        ``<key>.<record>`` (the record of the library ``modules``, default those loaded now). Returns the
        folder. An entry that another writer finished first is kept (it is the same result)."""
        rid = self.current_record(modules)
        parent = self._folder("objects", _check_name(namespace, "namespace"))
        final = parent / f"{_check_name(key, 'key')}.{rid}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=parent))
        try:
            write(tmp)
            for path in tmp.rglob("*"):                     # durable before it becomes visible
                if path.is_file():
                    with open(path, "rb+") as f:
                        os.fsync(f.fileno())
            with interrupts_deferred():
                try:
                    os.replace(tmp, final)
                except OSError:
                    if not final.is_dir():                  # not a concurrent writer's finished entry
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(parent)
        return final

    # --------------------------------------------------------------------------------------- maintenance
    def size(self) -> dict[str, tuple[int, int]]:
        """``{part: (entries, bytes)}`` for the records, each study's cells and each namespace of objects."""
        out: dict[str, tuple[int, int]] = {}

        def add(name, path):
            count, size = out.get(name, (0, 0))
            total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
                else path.stat().st_size
            out[name] = (count + 1, size + total)

        for part, prefix in (("cells", "cells/"), ("objects", "objects/")):
            base = self.root / part
            if base.is_dir():
                for group in sorted(p for p in base.iterdir() if p.is_dir()):
                    for entry in group.iterdir():
                        add(prefix + group.name, entry)
        if (self.root / "records").is_dir():
            for entry in (self.root / "records").iterdir():
                add("records", entry)
        return out

    def prune(self, *, everything: str | None = None) -> tuple[int, int]:
        """Remove the entries whose record is not valid today (or, with ``everything="cells/<experiment>"`` or
        ``"objects/<namespace>"``, every entry there); returns ``(entries, bytes)`` removed. Records no entry
        names any more are removed too."""
        removed = [0, 0]

        def drop(path: Path):
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
                else path.stat().st_size
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed[0] += 1
            removed[1] += size

        used = set()
        for part in ("cells", "objects"):
            base = self.root / part
            if not base.is_dir():
                continue
            for group in base.iterdir():
                if not group.is_dir():
                    continue
                for entry in list(group.iterdir()):
                    if entry.name.startswith("."):
                        continue
                    rid = entry.name.split(".")[1] if entry.name.count(".") >= 1 else ""
                    if everything == f"{part}/{group.name}" or not self.valid(rid):
                        drop(entry)
                    else:
                        used.add(rid)
        if (self.root / "records").is_dir():
            for entry in list((self.root / "records").iterdir()):
                if entry.stem not in used:
                    drop(entry)
        return removed[0], removed[1]


_DEFAULT: Store | None = None


def default_store() -> Store:
    """The store below the cache root (one object per process, so that validity is computed once)."""
    global _DEFAULT
    root = cache_root() / "store"
    if _DEFAULT is None or _DEFAULT.root != root:
        _DEFAULT = Store(root)
    return _DEFAULT


def _fmt(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def main(argv=None) -> int:
    """``python -m kernapprox.store size | prune [--all PART]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kernapprox.store", description="The result store: its size, "
                                     "and pruning of the entries that today's code no longer makes.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("size", help="entries and bytes of each part of the store")
    prune = sub.add_parser("prune", help="remove the entries whose code changed (and records nothing names)")
    prune.add_argument("--all", metavar="PART", help="remove every entry of PART (cells/<study> or "
                                                     "objects/<namespace>), valid or not")
    args = parser.parse_args(argv)
    store = default_store()
    if args.command == "size":
        rows = store.size()
        for part, (count, size) in sorted(rows.items()):
            print(f"{part:40s} {count:8d} entries {_fmt(size):>10s}")
        total = sum(size for _, size in rows.values())
        print(f"{'total':40s} {sum(c for c, _ in rows.values()):8d} entries {_fmt(total):>10s}  ({store.root})")
    else:
        count, size = store.prune(everything=args.all)
        print(f"removed {count} entries, {_fmt(size)} ({store.root})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
