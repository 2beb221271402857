"""Files that are either complete or absent: the one way results, figures and caches are written.

:func:`atomic_write` writes to a temporary file in the destination's folder and renames it over the destination,
so a reader (or a run killed half-way) never sees a partial file at the final path.
"""

from __future__ import annotations

import contextlib
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
