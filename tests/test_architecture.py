"""The package's architecture, checked on its source: the import graph and who may ask what an estimator is.

* The import graph of ``kernapprox`` has no cycle. *Every* import counts: module-level, inside functions and
  classes, under ``if``/``try``, and ``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal
  name (relative imports resolved). A function-level import is still a dependency: it runs, and a cycle through it
  is a partially initialised module waiting for the call order that finds it.
* Dependencies point one way (docs/guide/architecture.md), layer by layer, lowest first:

  1. ``kernel``, ``theory``, ``validation``, ``rules`` (the state-update rules and their names);
  2. the feature maps: ``kernapprox.estimators`` (the protocol, the families that are feature maps, the registry);
  3. the linear-attention core: ``kernapprox.attention``;
  4. the attention estimators that compose from the core: ``kernapprox.approximate`` (hybrids, Scatterbrain, LARA,
     EVA, Nyströmformer and the rank-r references).

  A module of a layer imports only its own layer and the layers below; everything else in the package sits above
  them and may import them all.
* Nothing outside ``kernapprox/estimators/`` and ``kernapprox/approximate/`` learns what an estimator is by
  inspection (``hasattr``, ``inspect``, ``isinstance``/``issubclass`` against a concrete estimator class,
  ``hasattr``/``getattr`` of a capability or of an estimator method): it reads the declared capabilities.
* The capability table printed by ``python -m kernapprox.estimators`` comes from the declarations alone (building an
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

BOTTOM = {"kernapprox.kernel", "kernapprox.theory", "kernapprox.validation", "kernapprox.rules", "kernapprox.backends",
          "kernapprox.cache"}
# (layer name, the packages it holds), lowest first; a module imports only its own layer and those below.
LAYERS = (("bottom", tuple(BOTTOM)), ("feature maps", ("kernapprox.estimators",)),
          ("attention core", ("kernapprox.attention",)), ("attention estimators", ("kernapprox.approximate",)))
# Edges that are known and being removed elsewhere; no other exception is allowed.
KNOWN_EDGES: set = set()
CAPABILITY_NAMES = {field for field in Capabilities.__dataclass_fields__} | {"supports_causal", "modes"}
ESTIMATOR_METHODS = {"attention", "features", "kernel_matrix", "state_bytes", "num_features_param", "_log_features"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _literal_import_call(node: ast.Call) -> str | None:
    """The module name of ``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source (relative imports resolved; ``from X
    import y`` counts ``X.y`` when that is a module, else ``X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
        elif isinstance(node, ast.Call):
            target = _literal_import_call(node)
            if target is not None and target.startswith("kernapprox"):
                found.add(target)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) - {m for (a, m) in KNOWN_EDGES if a == name}
            for name, path in mods.items()}


def test_every_import_is_seen(tmp_path):
    """The walk sees imports inside functions and under ``if``, and literal ``import_module`` calls."""
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\n"
                     "def f():\n    from .kernel import resolve_scale\n"
                     "    if resolve_scale:\n        import kernapprox.theory\n"
                     "    return importlib.import_module('kernapprox.metrics')\n", encoding="utf-8")
    found = imports_of("kernapprox.probe", probe, set(modules()))
    assert found == {"kernapprox.kernel", "kernapprox.theory", "kernapprox.metrics"}


def test_known_exceptions_are_still_needed():
    """Each known edge exists today; once its change lands the edge is gone and its line must go too."""
    mods = modules()
    for src, dst in sorted(KNOWN_EDGES):
        assert dst in imports_of(src, mods[src], set(mods)), f"{src} -> {dst} is gone: delete it from KNOWN_EDGES"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer_of(module: str) -> int | None:
    """Index of the layer that holds ``module`` (0 = bottom), or None above every layer."""
    for index, (_, packages) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    return None


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a layered module that reaches a higher layer, or a module above every layer."""
    bad = []
    for name, deps in sorted(graph.items()):
        own = layer_of(name)
        if own is None:
            continue
        for m in sorted(deps):
            other = layer_of(m)
            if other is None or other > own:
                above = "above every layer" if other is None else f"the {LAYERS[other][0]} layer"
                bad.append(f"{name} ({LAYERS[own][0]}) imports {m} ({above})")
    return bad


def test_dependencies_point_one_way(graph):
    bad = layer_breaches(graph)
    assert not bad, "imports reaching up the layers:\n" + "\n".join(bad)


def test_the_checks_see_a_cycle_and_a_breach():
    """The two checks have the power to fail: the import native -> linear (inside a function) closes a cycle with
    linear -> native, and a feature map importing the core is a breach."""
    toy = {"kernapprox.attention.linear": {"kernapprox.attention.native"},
           "kernapprox.attention.native": {"kernapprox.attention.linear"}}
    assert find_cycle(toy) == ["kernapprox.attention.linear", "kernapprox.attention.native",
                               "kernapprox.attention.linear"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    breach = {"kernapprox.estimators.random": {"kernapprox.attention.linear", "kernapprox.rules"},
              "kernapprox.rules": {"kernapprox.sweep"}, "kernapprox.approximate.hybrid": {"kernapprox.attention"}}
    assert layer_breaches(breach) == [
        "kernapprox.estimators.random (feature maps) imports kernapprox.attention.linear (the attention core layer)",
        "kernapprox.rules (bottom) imports kernapprox.sweep (above every layer)"]


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
        if name.startswith(("kernapprox.estimators", "kernapprox.approximate")):
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
                  # the engine reads a study's functions, lm_eval a transformers model's forward (its cache keyword)
                  and name not in ("kernapprox.sweep._experiment", "kernapprox.distributions", "kernapprox.lm_eval")):
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
    env_args = [sys.executable, "-W", "error::RuntimeWarning", "-m", "kernapprox.estimators"]
    out = subprocess.run([*env_args, "--help"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "usage: python -m kernapprox.estimators" in out.stdout and "columns:" in out.stdout
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


def test_attention_estimators_declare_how_they_use_the_core():
    """Every estimator that brings its own attention lives in ``kernapprox.approximate`` and declares ``core``: the
    core functions it composes from, each public in ``kernapprox.attention`` and imported by its module from the
    attention layer (so the declaration cannot drift from the code)."""
    import kernapprox.attention as core

    mods = modules()
    for name in ka.available_estimators():
        if ka.capabilities(name).kind != "attention":
            continue
        cls = ka.estimator_class(name)
        module = cls.__module__
        assert module.startswith("kernapprox.approximate."), (name, module)
        from_core = {alias.name for node in ast.walk(ast.parse(mods[module].read_text(encoding="utf-8")))
                     if isinstance(node, ast.ImportFrom) and node.level == 2
                     and (node.module or "").startswith("attention") for alias in node.names}
        assert isinstance(cls.core, tuple), name
        for fn in cls.core:
            assert fn in core.__all__ and fn in from_core, (name, fn)
