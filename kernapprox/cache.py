"""The one cache root of kernapprox, and the private folders inside it.

Everything the library keeps between runs (compiled kernels, trained models, extracted heads of real models,
fitted maps) lives under one root:

``$KERNAPPROX_CACHE_DIR``
    when set (an absolute or relative path, created on first use);
``$XDG_CACHE_HOME/kernapprox``
    else, the user's cache directory (``~/.cache/kernapprox`` when ``XDG_CACHE_HOME`` is unset).

:func:`cache_dir` names a folder below the root; :func:`private_dir` makes (or accepts) a folder that only its owner
can read, write or enter, which is where anything that will be *executed* (a compiled library) is kept: a folder
that another user could write is refused, never used, so a library planted there is never loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_ENV = "KERNAPPROX_CACHE_DIR"

__all__ = ["CACHE_ENV", "cache_root", "cache_dir", "private_dir", "UnsafeCacheError"]


class UnsafeCacheError(PermissionError):
    """A cache folder that is not the current user's own, or that others may write: never used."""


def cache_root() -> Path:
    """``$KERNAPPROX_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernapprox``, else ``~/.cache/kernapprox`` (not created)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernapprox"


def cache_dir(*parts: str, root: str | os.PathLike | None = None) -> Path:
    """The folder ``<root>/<parts...>`` (``root`` defaults to :func:`cache_root`), created if missing."""
    for part in parts:
        if not isinstance(part, str) or not part or os.sep in part or part in (".", ".."):
            raise ValueError(f"cache folder names must be plain names, got {part!r}")
    folder = Path(root if root is not None else cache_root()).joinpath(*parts)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a folder owned by the current user with mode ``0700``: created so if missing; an existing one
    must already be the user's own and closed to others (group and others have no permission bits) and must not be
    a symbolic link, else :class:`UnsafeCacheError` names what is wrong. Nothing is ever loosened or repaired: a
    folder that fails the check is refused, not fixed."""
    folder = Path(path)
    if not folder.is_symlink() and not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:           # made by a concurrent process: checked below like any other
            pass
    check_private(folder)
    return folder


def check_private(folder: str | os.PathLike) -> None:
    """Raise :class:`UnsafeCacheError` unless ``folder`` is a real folder (no symbolic link) owned by the current
    user that group and others can neither read, write nor enter."""
    folder = Path(folder)
    try:
        info = os.lstat(folder)
    except FileNotFoundError as exc:
        raise UnsafeCacheError(f"{folder} does not exist") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"{folder} is not a folder of its own (a symbolic link or a file)")
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and info.st_uid != uid:
        raise UnsafeCacheError(f"{folder} is owned by uid {info.st_uid}, not by this user ({uid})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeCacheError(f"{folder} has mode {stat.S_IMODE(info.st_mode):04o}; a private folder has no "
                               "group or other permissions (0700)")
