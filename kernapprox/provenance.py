"""Where a number came from: the git revision of the code, and a digest of the code that computes it.

:func:`git_revision` names the commit (``+dirty`` when tracked files changed). :func:`code_digest` is a key for
caches of computed objects (the trained models of :mod:`kernapprox.models.training`): a SHA-256 of the *code* of
some modules and of every module of the package that they import, at any depth (imports inside functions
included). What enters and what does not:

- each module's syntax tree (``ast.parse``), without its docstrings (module, class, function) and with every
  import of the package reduced to the names it binds (``from ..validation import check_choice`` and
  ``from kernapprox.checks import check_choice`` are the same statement), so comments, formatting, prose and
  *where* a module lives play no part: moving a file (and fixing the imports that name it) keeps the key, while
  any change of a statement, a constant or an imported external library changes it;
- the digests of the modules are sorted before they are combined, so neither a module's path nor its file name
  nor the order of the walk enters the key;
- a file beside a module that the module names by a string literal (the C++ source of a compiled kernel,
  ``Path(__file__).with_name("_kernel.cpp")``) enters with its bytes;
- the modules that the entry modules never import (plotting, the sweep engine, ...) do not enter: editing them
  cannot invalidate a cache that they cannot affect.

Why the code and not a version constant: a constant bumped by hand is forgotten exactly when a change looks
harmless (a summation order, a default), and a stale cache entry is a silently wrong result; a digest of the code
can only err towards a miss. Its one blind spot is a change of *which* module a name is imported from when both
modules are already in the walk (``from .a import f`` → ``from .b import f``): the set of module digests is
unchanged. The syntax tree's dump is Python's, so a new Python version may change
every key once (a miss, never a wrong hit).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import subprocess
from pathlib import Path

__all__ = ["git_revision", "code_digest", "code_modules"]

PACKAGE = "kernapprox"
_ROOT = Path(__file__).resolve().parent


def git_revision(where: str | Path | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding ``where`` (default: this package; ``+dirty`` if tracked
    files changed); ``"unknown"`` outside a repository or without git."""
    where = Path(where) if where is not None else _ROOT
    try:
        rev = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


# ------------------------------------------------------------------------------------------ the import walk
def _file_of(name: str, package: str, root: Path) -> Path | None:
    """The source file of module ``name`` (dotted, absolute) inside ``package`` at ``root``, found by path only
    (nothing is imported); ``None`` when it is not a module of the package."""
    parts = name.split(".")
    if parts[0] != package:
        return None
    base = root.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    if keep <= 0:
        raise ValueError(f"relative import beyond the top package in {module}")
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _imports(tree: ast.AST, module: str, is_package: bool, package: str, root: Path) -> set[str]:
    """The package's modules that ``tree`` imports (every ``import``/``from`` statement, at any depth)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            found.add(target)
            # ``from pkg import sub`` imports the module pkg.sub when there is one
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return {name for name in found if _file_of(name, package, root) is not None}


def _normalised(tree: ast.Module, package: str) -> str:
    """The dump of ``tree`` without docstrings and with the package's imports reduced to the names they bind."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == package):
            node.module, node.level = None, 0
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    alias.name = alias.name.rsplit(".", 1)[-1]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def _companions(tree: ast.AST, path: Path) -> list[Path]:
    """Files beside ``path`` (other than Python modules) that ``tree`` names by a string literal."""
    names = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and 0 < len(node.value) < 256 and "." in node.value and not node.value.endswith(".py")
             and not set(node.value) & {"/", "\\", "\0", "\n"}}
    return sorted(path.with_name(name) for name in names if name.strip(".") and path.with_name(name).is_file())


def _module_digest(tree: ast.Module, path: Path, package: str) -> str:
    digest = hashlib.sha256(_normalised(tree, package).encode())
    for companion in _companions(tree, path):       # by content: the name is in the tree already
        digest.update(hashlib.sha256(companion.read_bytes()).digest())
    return digest.hexdigest()


def _walk(modules, package: str, root: Path) -> dict[str, tuple[ast.Module, Path]]:
    if isinstance(modules, str):
        modules = (modules,)
    trees, todo = {}, list(modules)
    for name in todo:
        if _file_of(name, package, root) is None:
            raise ValueError(f"{name!r} is not a module of the package {package!r} (at {root})")
    while todo:
        name = todo.pop()
        if name in trees:
            continue
        path = _file_of(name, package, root)
        tree = ast.parse(path.read_bytes(), filename=str(path))
        trees[name] = tree, path
        todo.extend(_imports(tree, name, path.name == "__init__.py", package, root) - trees.keys())
    return trees


def _package_root(package: str, root) -> Path:
    if root is not None:
        return Path(root)
    if package == PACKAGE:
        return _ROOT
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} not found")
    return Path(next(iter(spec.submodule_search_locations)))


def code_modules(modules, *, package: str = PACKAGE, root: str | Path | None = None) -> frozenset[str]:
    """The names of ``modules`` (dotted names, one or a sequence) and of every module of ``package`` they import,
    at any depth: the modules whose code enters :func:`code_digest`. Nothing is imported; files are found by path
    below ``root`` (default: the package's folder)."""
    return frozenset(_walk(modules, package, _package_root(package, root)))


def code_digest(modules, *, package: str = PACKAGE, root: str | Path | None = None) -> str:
    """SHA-256 (16 hex digits) of the code of ``modules`` and of every module of ``package`` they import (see the
    module docstring for what enters): unchanged by moving files, by comments, formatting and docstrings; changed
    by any change of the code the modules run.

    Parsing the modules takes about a second, so the digest is computed once per process and kept while no file
    below the package's folder changes (their paths, modification times and sizes, read on every call)."""
    modules = (modules,) if isinstance(modules, str) else tuple(modules)
    folder = _package_root(package, root)
    return _cached_digest(modules, package, folder, _snapshot(folder))


def _snapshot(folder: Path) -> tuple:
    """``(path, mtime_ns, size)`` of every file below ``folder`` but the byte-code caches."""
    entries = []
    for path in folder.rglob("*"):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        info = path.stat()
        entries.append((str(path), info.st_mtime_ns, info.st_size))
    return tuple(sorted(entries))


@functools.lru_cache(maxsize=16)
def _cached_digest(modules: tuple, package: str, folder: Path, snapshot: tuple) -> str:
    trees = _walk(modules, package, folder)
    digests = sorted(_module_digest(tree, path, package) for tree, path in trees.values())
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]
