"""The package's architecture, checked on its source: the import graph and who may ask what an estimator is.

* The import graph of ``kernapprox`` (module-level imports, relative ones resolved) has no cycle.
* Dependencies point one way (DESIGN.md): the estimator layer imports only itself and the layer below it
  (``kernel``, ``theory``, ``validation``); the attention layer imports only estimators and below; nothing below the
  estimators imports anything above it.
* Nothing outside ``kernapprox/estimators/`` learns what an estimator is by inspection (``hasattr``, ``inspect``,
  ``isinstance``/``issubclass`` against a concrete estimator class, ``hasattr``/``getattr`` of a capability or of an
  estimator method): it reads the declared capabilities.
* The capability table printed by ``python -m kernapprox.registry`` comes from the declarations alone (building an
  estimator is never needed) and the command has a ``--help`` and no runpy warning.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kernapprox as ka
from kernapprox.estimators.base import Capabilities

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kernapprox"

BELOW_ESTIMATORS = {"kernapprox.kernel", "kernapprox.theory", "kernapprox.validation", "kernapprox.backends",
                    "kernapprox.cache"}
CAPABILITY_NAMES = {field for field in Capabilities.__dataclass_fields__} | {"supports_causal", "modes"}
ESTIMATOR_METHODS = {"attention", "features", "kernel_matrix", "state_bytes", "num_features_param", "_log_features"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports at module level (relative imports resolved; ``from X import
    y`` counts ``X.y`` when that is a module, else ``X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kernapprox"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("kernapprox"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def test_import_graph_has_no_cycle(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_dependencies_point_one_way(graph):
    for name, deps in graph.items():
        if name.startswith("kernapprox.estimators"):
            allowed = lambda m: m.startswith("kernapprox.estimators") or m in BELOW_ESTIMATORS  # noqa: E731
        elif name.startswith("kernapprox.attention"):
            allowed = lambda m: m.startswith(("kernapprox.estimators", "kernapprox.attention")) or m in BELOW_ESTIMATORS  # noqa: E501,E731
        elif name in BELOW_ESTIMATORS:
            allowed = lambda m: m in BELOW_ESTIMATORS  # noqa: E731
        else:
            continue
        bad = sorted(m for m in deps if not allowed(m))
        assert not bad, f"{name} imports {bad}, above its layer"


def test_the_registry_imports_no_family(graph):
    assert graph["kernapprox.estimators.registry"] <= {"kernapprox.estimators.base"}


def _estimator_class_names() -> set[str]:
    names = {cls.__name__ for cls in _subclasses(ka.Estimator)}
    return names - {"Estimator"}


def _subclasses(cls):
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def test_no_module_outside_the_estimators_inspects_what_an_estimator_is():
    concrete = _estimator_class_names()
    offences = []
    for name, path in modules().items():
        if name.startswith("kernapprox.estimators"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name | ast.Attribute):
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            literal = node.args[1].value if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) else None
            if func in ("hasattr", "getattr") and literal in CAPABILITY_NAMES | ESTIMATOR_METHODS:
                offences.append(f"{where}: {func}(..., {literal!r})")
            elif func in ("isinstance", "issubclass") and len(node.args) == 2:
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                for c in classes:
                    cname = c.id if isinstance(c, ast.Name) else getattr(c, "attr", "")
                    if cname in concrete:
                        offences.append(f"{where}: {func}(..., {cname})")
            elif (func == "signature" and isinstance(node.func, ast.Attribute)
                  and getattr(node.func.value, "id", "") == "inspect"
                  and name not in ("kernapprox.sweep._experiment", "kernapprox.distributions")):
                offences.append(f"{where}: inspect.signature")
    assert not offences, "capabilities must be read, not inferred:\n" + "\n".join(offences)


def test_capability_table_is_built_from_declarations(monkeypatch):
    """Building any estimator while the table is made fails the test: the table reads declarations only."""
    def refuse(*args, **kwargs):
        raise AssertionError("the capability table built an estimator")

    monkeypatch.setattr(ka.Estimator, "__init__", refuse)
    table = ka.estimator_table()
    assert len(table.splitlines()) == len(ka.available_estimators()) + 2


def test_registry_command_line():
    env_args = [sys.executable, "-W", "error::RuntimeWarning", "-m", "kernapprox.registry"]
    out = subprocess.run([*env_args, "--help"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "usage: python -m kernapprox.registry" in out.stdout and "columns:" in out.stdout
    out = subprocess.run([*env_args, "--names"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ka.available_estimators() and not out.stderr
    out = subprocess.run(env_args, capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ka.estimator_table() and not out.stderr


def test_experiments_and_benchmarks_are_not_installed_packages():
    """They run from a checkout (``python -m experiments.<name>``); site-packages holds only ``kernapprox``."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["kernapprox*"]
    for path in (ROOT / "experiments").glob("*.py"):
        assert "benchmarks" not in {n.module.split(".")[0] for n in ast.walk(ast.parse(path.read_text("utf-8")))
                                    if isinstance(n, ast.ImportFrom) and n.module}, path.name
