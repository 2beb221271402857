"""Files that are either complete or absent: the one way results, figures and caches are written and read back.

:func:`atomic_write` writes to a temporary file in the destination's folder and renames it over the destination,
so a reader (or a run killed half-way) never sees a partial file at the final path. :func:`read_arrays` reads the
arrays of a cached netCDF file once per process (while the file is unchanged).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/file system can fsync a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write, durable: bool = True) -> None:
    """Call ``write(tmp_path)``, then rename over ``path`` (same folder, so the rename is atomic).

    ``durable`` also fsyncs the file and the folder, so the new content survives a power loss, not only a killed
    process (progress files skip it: a damaged one is detected on reading and its cell simply runs again).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give the result ordinary permissions
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)


def read_arrays(path: str | os.PathLike, names) -> dict:
    """The variables ``names`` of the netCDF file ``path`` as numpy arrays, and its attributes under ``"attrs"``.

    Read once per process while the file is unchanged: the read is memoised on the resolved path, the file's
    modification time and size, so a file rewritten in place (atomically, by :func:`atomic_write`) is read again.
    The returned dictionary is shared between calls: do not modify it. A missing variable raises ``KeyError``
    naming it.
    """
    path = Path(path).resolve()
    info = path.stat()
    names = (names,) if isinstance(names, str) else tuple(names)
    return _read_arrays(str(path), info.st_mtime_ns, info.st_size, names)


@functools.lru_cache(maxsize=8)
def _read_arrays(path: str, mtime_ns: int, size: int, names: tuple[str, ...]) -> dict:
    import xarray as xr

    with xr.open_dataset(path, engine="h5netcdf") as ds:
        missing = [name for name in names if name not in ds.variables]
        if missing:
            raise KeyError(f"{path} has no variable {', '.join(map(repr, missing))}")
        out = {name: ds[name].values for name in names}
        out["attrs"] = dict(ds.attrs)
    return out


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in blocks of 4 MiB: how pinned data files and cached models are
    identified."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
