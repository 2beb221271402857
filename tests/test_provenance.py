"""The code-version key of cached objects: the code, not the paths; the git revision."""

import textwrap

import pytest

from kernapprox import provenance


def _package(root, name, files):
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / name


BASE = {
    "__init__.py": "",
    "train.py": '''
        """Trains."""
        from .maths import step          # the update
        def fit(x):
            """Fit."""
            from .late import scale
            return step(x) * scale()
        ''',
    "maths.py": '''
        """Maths."""
        import numpy as np
        def step(x):
            return np.tanh(x) + 1
        ''',
    "late.py": "def scale():\n    return 2\n",
    "plot.py": "def draw():\n    return 0\n",
}


def _digest(tmp_path, tag, files, entry="train"):
    root = _package(tmp_path / tag, "toy", files)
    return provenance.code_digest(f"toy.{entry}", package="toy", root=root)


def test_the_key_follows_the_code_and_not_the_files(tmp_path):
    base = _digest(tmp_path, "base", BASE)
    assert provenance.code_modules("toy.train", package="toy", root=tmp_path / "base" / "toy") == {
        "toy.train", "toy.maths", "toy.late"}                       # function-level imports count; plot does not
    # moved into a subpackage (the import that names it fixed), comments, docstrings, formatting: the same key
    moved = {**{k: v for k, v in BASE.items() if k != "maths.py"}, "core/__init__.py": "",
             "core/numerics.py": BASE["maths.py"].replace('"""Maths."""', '"""Moved maths, new prose."""'),
             "train.py": BASE["train.py"].replace("from .maths import step          # the update",
                                                  "from toy.core.numerics import step")}
    assert _digest(tmp_path, "moved", moved) == base
    assert _digest(tmp_path, "prose", {**BASE, "train.py": BASE["train.py"].replace('"""Fit."""', "# fit\n")
                                       .replace("return step(x) * scale()", "return step(x)*scale( )")}) == base
    assert _digest(tmp_path, "plot", {**BASE, "plot.py": "def draw():\n    return 1\n"}) == base
    # any change of code that the entry runs: another key
    for tag, files in {
            "constant": {**BASE, "maths.py": BASE["maths.py"].replace("+ 1", "+ 2")},
            "library": {**BASE, "maths.py": BASE["maths.py"].replace("np.tanh", "np.sinh")},
            "late": {**BASE, "late.py": "def scale():\n    return 3\n"},
            "name": {**BASE, "late.py": "def scale():\n    return 2\nscale2 = 1\n"}}.items():
        assert _digest(tmp_path, tag, files) != base, tag


def test_a_file_a_module_names_enters_by_content(tmp_path):
    files = {**BASE, "late.py": 'SOURCE = "kernel.cpp"\ndef scale():\n    return 2\n', "kernel.cpp": "int a;"}
    base = _digest(tmp_path, "a", files)
    assert _digest(tmp_path, "b", {**files, "kernel.cpp": "int b;"}) != base
    assert _digest(tmp_path, "c", {**files, "other.cpp": "int b;"}) == base


def test_unknown_modules_are_refused(tmp_path):
    root = _package(tmp_path, "toy", BASE)
    with pytest.raises(ValueError, match="not a module"):
        provenance.code_digest("toy.missing", package="toy", root=root)
    with pytest.raises(ValueError, match="not a module"):
        provenance.code_digest("numpy", package="toy", root=root)


def test_git_revision_outside_a_repository(tmp_path):
    assert provenance.git_revision(tmp_path) == "unknown"
    rev = provenance.git_revision()
    assert rev == "unknown" or len(rev.split("+")[0]) == 40


def test_the_digest_is_computed_once_and_recomputed_when_a_file_changes(tmp_path):
    """Parsing takes about a second: the second call is served from the cache; editing a module's code (new
    content and modification time) gives a new digest at once."""
    import time

    from kernapprox.provenance import code_digest

    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nX = b.Y + 1\n")
    (pkg / "b.py").write_text("Y = 1\n")
    first = code_digest("toypkg.a", package="toypkg", root=pkg)
    start = time.perf_counter()
    assert code_digest("toypkg.a", package="toypkg", root=pkg) == first
    assert time.perf_counter() - start < 0.5
    (pkg / "b.py").write_text("Y = 22\n")
    assert code_digest("toypkg.a", package="toypkg", root=pkg) != first
