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

__all__ = ["git_revision", "code_digest", "code_modules", "file_digest", "module_digest", "study_digest",
           "report_digest", "dependency_record", "record_id", "merge_records", "changes", "loaded_modules",
           "SourceChangedError", "REPORT_MODULES", "COMPUTE_ROOTS", "REPORT_ROOTS"]

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


# ----------------------------------------------------------------------------------- what a result depends on
# One notion of "what a result depends on", used by the cell store, the cached trained models and fitted maps, the
# figures' provenance and `python -m kernapprox.sweep status` (kernapprox.store):
#
# - the library modules the computing process had loaded when the result was finished (every one of its modules
#   in ``sys.modules``), each by the digest of its normalised syntax tree (:func:`file_digest`: comments,
#   docstrings and formatting do not enter; the native sources a module names do). Code that ran is in a loaded
#   module, so the record is sound at module granularity; it is precise as far as the package is lazy (``import
#   kernapprox`` loads the attention core and the estimators only, and a module that builds a trainable map
#   imports kernapprox.trainable where it builds one). Modules that only move or describe results (the sweep
#   engine's driver, store and report code, plotting: :data:`REPORT_MODULES`) are left out;
# - the study's compute code: the slice of its module reached from ``run_cell``, ``draw``, ``run_reference`` and
#   ``DATA_AXES`` (:func:`study_digest`), following names into the other modules of its package, so that the
#   findings, the plot and the summaries (the report) never enter;
# - the versions of the packages that compute (:data:`COMPUTE_PACKAGES`, where loaded) and of the packages whose
#   files are the data (a module's ``DATA_PACKAGES``: the model and text wheels);
# - the cell's own inputs (parameters, seed, device type) are its key in the store, not part of this record.

import importlib.metadata as _metadata  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

STUDIES = "experiments"
REPORT_MODULES = frozenset({
    "kernapprox.plotting", "kernapprox.provenance", "kernapprox.store", "kernapprox.sweep",
    "kernapprox.sweep.__main__", "kernapprox.sweep._cli", "kernapprox.sweep._figures", "kernapprox.sweep._run",
    "kernapprox.sweep._store", "kernapprox.sweep._provenance", "kernapprox.sweep._schedule",
})
COMPUTE_PACKAGES = {"numpy": "numpy", "scipy": "scipy", "torch": "torch", "sklearn": "scikit-learn",
                    "transformers": "transformers", "tokenizers": "tokenizers", "gguf": "gguf",
                    "safetensors": "safetensors", "threadpoolctl": "threadpoolctl"}
COMPUTE_ROOTS = ("run_cell", "draw", "run_reference", "DATA_AXES")
REPORT_ROOTS = ("plot", "findings", "summarise", "check_params", "GRIDS", "PARAMETERS", "METRICS", "AXIS_ATTRS",
                "REFERENCE_METRICS", "REFERENCE_AXES", "EXPERIMENT")
_STARTED_NS = time.time_ns()            # a source file changed after this moment is not the code this process runs


class SourceChangedError(RuntimeError):
    """A module's source changed while the process that ran it was running: its result cannot be keyed by the
    code that made it."""


def project_root() -> Path:
    """The folder that holds the ``kernapprox`` package (and, in the repository, ``experiments``)."""
    return _ROOT.parent


def _module_path(name: str, root: Path) -> Path | None:
    package = name.split(".")[0]
    return _file_of(name, package, root / package)


_FILE_DIGESTS: dict = {}


def file_digest(path: str | Path, package: str) -> str:
    """SHA-256 of one module's code (its syntax tree without docstrings, imports of ``package`` reduced to the
    names they bind, and the companion files it names: see the module docstring); memoised on the file's path,
    modification time and size."""
    path = Path(path)
    info = path.stat()
    key = (str(path.resolve()), info.st_mtime_ns, info.st_size, package)
    if key not in _FILE_DIGESTS:
        tree = ast.parse(path.read_bytes(), filename=str(path))
        _FILE_DIGESTS[key] = _module_digest(tree, path, package)[:16]
    return _FILE_DIGESTS[key]


def module_digest(name: str, *, root: str | Path | None = None) -> str | None:
    """:func:`file_digest` of module ``name`` (of ``kernapprox`` or of the studies' package) under ``root``
    (default: :func:`project_root`); ``None`` when there is no such module."""
    path = _module_path(name, Path(root) if root is not None else project_root())
    return None if path is None else file_digest(path, name.split(".")[0])


# ------------------------------------------------------------------------------------- a study's code slice
def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name.split(".")[0]) for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _is_main_guard(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__")


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int, size: int, package: str):
    tree = ast.parse(Path(path).read_bytes(), filename=path)
    _normalised_copy = ast.parse(Path(path).read_bytes(), filename=path)
    _normalised(_normalised_copy, package)            # docstrings stripped, package imports reduced
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:] or [ast.Pass()]                 # as _normalised drops the module's docstring
    if len(body) != len(_normalised_copy.body):
        raise AssertionError(f"{path}: the normalised tree does not align with the module's statements")
    statements = []
    for original, clean in zip(body, _normalised_copy.body):
        if isinstance(original, ast.Expr) and isinstance(getattr(original, "value", None), ast.Constant) \
                and isinstance(original.value.value, str):
            continue                                    # a bare string
        text = ast.dump(clean, annotate_fields=False, include_attributes=False)
        used = {n.id for n in ast.walk(original) if isinstance(n, ast.Name)}
        statements.append((original, hashlib.sha256(text.encode()).hexdigest()[:16], used))
    return statements


def _find_module(name: str, root: Path) -> Path | None:
    """A module's file under ``root``, else where Python finds it (a study outside the project: its own file)."""
    path = _module_path(name, root)
    if path is not None:
        return path
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if file is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        file = spec.origin if spec is not None and spec.has_location else None
    return Path(file) if file and file.endswith(".py") and Path(file).is_file() else None


def _statements(name: str, root: Path):
    path = _find_module(name, root)
    if path is None:
        raise ValueError(f"{name!r} is not a module under {root} nor an importable file")
    info = path.stat()
    return path, _parsed(str(path), info.st_mtime_ns, info.st_size, name.split(".")[0])


def _import_target(node: ast.ImportFrom, module: str, path: Path) -> str:
    return _absolute(node, module, path.name == "__init__.py")


def study_digest(module: str, roots=COMPUTE_ROOTS, *, root: str | Path | None = None) -> str:
    """SHA-256 (16 hex digits) of the part of study ``module`` that ``roots`` (top-level names) reach: their
    statements, the statements of every top-level name those use, at any depth, across the modules of the
    studies' package (``from ._common import f`` follows ``f`` there; ``from experiments import _lm`` takes that
    module whole), and every top-level statement that runs for its effect (not a definition, an assignment, an
    import or the ``__main__`` guard). With :data:`COMPUTE_ROOTS` it is the study's compute code: its findings,
    plot and summaries do not enter; with :data:`REPORT_ROOTS` its report and design (grids, metrics)."""
    base = Path(root) if root is not None else project_root()
    package = module.split(".")[0]
    seen: set[tuple] = set()
    digests: set[str] = set()
    todo: list[tuple[str, str | None]] = [(module, name) for name in roots]
    visited_modules: set[str] = set()
    while todo:
        mod, wanted = todo.pop()
        path, statements = _statements(mod, base)
        first_visit = mod not in visited_modules
        visited_modules.add(mod)
        for index, (node, digest, used) in enumerate(statements):
            bound = _bound_names(node)
            effect = not bound and not _is_main_guard(node)
            if not (wanted is None or wanted in bound or (first_visit and effect)):
                continue
            if isinstance(node, ast.ImportFrom):             # followed name by name (each import once per name)
                if (mod, index, wanted) in seen:
                    continue
                seen.add((mod, index, wanted))
                digests.add(f"{mod}:{digest}")
                target = _import_target(node, mod, path)
                if target.split(".")[0] != package:
                    continue
                for alias in node.names:
                    if wanted is not None and (alias.asname or alias.name) != wanted:
                        continue
                    sub = f"{target}.{alias.name}"
                    if _find_module(sub, base) is not None:
                        todo.append((sub, None))              # a module: whole
                    else:
                        todo.append((target, alias.name))
                continue
            if (mod, index) in seen:
                continue
            seen.add((mod, index))
            digests.add(f"{mod}:{digest}")
            if isinstance(node, ast.Import):
                todo.extend((a.name, None) for a in node.names if a.name.split(".")[0] == package
                            and _find_module(a.name, base) is not None)
                continue
            todo.extend((mod, name) for name in used)
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ records
def loaded_modules(packages=(PACKAGE, STUDIES)) -> tuple[str, ...]:
    """The modules of ``packages`` in ``sys.modules`` that are files (sorted names)."""
    return tuple(sorted(name for name, mod in list(sys.modules.items())
                        if name.split(".")[0] in packages and getattr(mod, "__file__", None)))


def package_versions_of(modules) -> dict[str, str]:
    """The versions of the compute packages that are loaded (:data:`COMPUTE_PACKAGES`) and of the data packages
    that the loaded library ``modules`` declare (their ``DATA_PACKAGES``)."""
    found = {dist for top, dist in COMPUTE_PACKAGES.items() if top in sys.modules}
    for name in modules:
        found.update(getattr(sys.modules.get(name), "DATA_PACKAGES", ()) or ())
    return {dist: _version(dist) for dist in sorted(found)}


def _version(dist: str) -> str:
    try:
        return _metadata.version(dist)
    except _metadata.PackageNotFoundError:
        return "not installed"


def dependency_record(modules=None, *, study: str | None = None, root: str | Path | None = None,
                      roots=COMPUTE_ROOTS) -> dict:
    """What a result computed now depends on: ``{"library": {module: digest}, "study": {module: digest},
    "packages": {distribution: version}, "python": "3.x"}`` for the library ``modules`` (default: those loaded
    now, :func:`loaded_modules`, less :data:`REPORT_MODULES`) and the compute slice of ``study``
    (:func:`study_digest`). Raises :class:`SourceChangedError` when a module's file changed after this process
    started (the record would name code that did not run)."""
    base = Path(root) if root is not None else project_root()
    names = loaded_modules((PACKAGE,)) if modules is None else tuple(modules)
    library = {}
    for name in names:
        if name.split(".")[0] != PACKAGE or name in REPORT_MODULES:
            continue
        path = _module_path(name, base)
        if path is None:
            continue
        if root is None and path.stat().st_mtime_ns > _STARTED_NS:
            raise SourceChangedError(f"{path} changed while this process ran its code; rerun (the result would be "
                                     "recorded against code that did not make it)")
        library[name] = file_digest(path, PACKAGE)
    record = {"library": library, "study": {}, "packages": package_versions_of(names),
              "python": ".".join(map(str, sys.version_info[:2]))}
    if study is not None:
        record["study"][study] = (_running_study_digest(study, tuple(roots)) if root is None
                                  else study_digest(study, tuple(roots), root=base))
        if tuple(roots) != COMPUTE_ROOTS:               # a program that is not a sweep study names its own
            record["roots"] = {study: list(roots)}
    return record


_RUNNING: dict = {}


def _running_study_digest(study: str, roots: tuple) -> str:
    """The compute digest of the study this process runs, computed once (at its first record) from a source that
    has not changed since the process started: :class:`SourceChangedError` otherwise."""
    key = (study, roots)
    if key not in _RUNNING:
        path = _find_module(study, project_root())
        if path is not None and path.stat().st_mtime_ns > _STARTED_NS:
            raise SourceChangedError(f"{path} changed while this process ran its code; rerun (the result would be "
                                     "recorded against code that did not make it)")
        _RUNNING[key] = study_digest(study, roots)
    return _RUNNING[key]


def record_id(record: dict) -> str:
    """SHA-256 (16 hex digits) of a record's canonical JSON: the name of a record in the store."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def merge_records(records) -> dict:
    """The union of dependency records (the code of a dataset whose cells were made by several runs)."""
    out = {"library": {}, "study": {}, "packages": {}, "python": ""}
    for record in records:
        if record.get("roots"):
            out.setdefault("roots", {}).update(record["roots"])
        for part in ("library", "study", "packages"):
            out[part].update(record.get(part, {}))
        out["python"] = record.get("python", out["python"])
    return out


def changes(record: dict, *, root: str | Path | None = None) -> list[str]:
    """What changed since ``record`` was made (empty: nothing it depends on): each library module whose code
    differs or that is gone, each study whose compute slice differs, each package whose version differs."""
    base = Path(root) if root is not None else project_root()
    out = []
    for name, digest in sorted(record.get("library", {}).items()):
        now = module_digest(name, root=base)
        if now != digest:
            out.append(f"{name} {'removed' if now is None else 'changed'}")
    roots = record.get("roots", {})
    for name, digest in sorted(record.get("study", {}).items()):
        try:
            now = study_digest(name, tuple(roots.get(name, COMPUTE_ROOTS)), root=base)
        except ValueError:
            now = None
        if now != digest:
            out.append(f"{name} (compute) {'removed' if now is None else 'changed'}")
    for dist, version in sorted(record.get("packages", {}).items()):
        if _version(dist) != version:
            out.append(f"{dist} {version} -> {_version(dist)}")
    if record.get("python") and record["python"] != ".".join(map(str, sys.version_info[:2])):
        out.append(f"python {record['python']}")
    return out


def report_digest(study: str, *, root: str | Path | None = None) -> str:
    """The digest of what draws a study's figure and findings: its report slice (:data:`REPORT_ROOTS`: findings,
    plot, summaries, grids, metrics) and the library's report modules (plotting, statistics, the figure writer)."""
    base = Path(root) if root is not None else project_root()
    parts = [study_digest(study, REPORT_ROOTS, root=base)]
    parts += [f"{m}:{module_digest(m, root=base)}" for m in ("kernapprox.plotting", "kernapprox.stats",
                                                              "kernapprox.sweep._figures")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

