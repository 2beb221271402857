"""`python -m kernapprox.sweep status` is exact, on the committed figures themselves. In a copy of the project:
(a) a comment added to any library module changes no figure's status; (b) a statement added to a module a study's
cells loaded (sampled from each figure's record), or to its run_cell, makes that figure stale and names the module;
(c) a statement added to a library module no cell of the figure loaded, or a top-level statement of the study that
neither its compute nor its report reaches, leaves it current (a report-only edit: tests/sweep/test_sweep.py).
Figures that are not current in the checkout are left out (the test is about what a change does, `make
figure-status` about what is committed)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from kernapprox import provenance
from kernapprox.sweep import figure_status, read_provenance

ROOT = provenance.project_root()


def _path(root: Path, module: str) -> Path:
    path = root / (module.replace(".", "/") + ".py")
    return path if path.is_file() else root / module.replace(".", "/") / "__init__.py"


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    for part in ("kernapprox", "experiments", "figures"):
        shutil.copytree(ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    for md in (root / "figures").glob("*.md"):                  # figure_status wants the PNG beside the record
        (root / "figures" / f"{md.stem}.png").write_bytes(b"")
    current = [row for row in figure_status(root / "figures", root=root) if row.status == "current"]
    if not current:
        pytest.skip("no committed figure is current: nothing to test on")
    return root, current


def _status(root, stem):
    (row,) = [r for r in figure_status(root / "figures", root=root) if r.path.stem == stem]
    return row


def test_a_comment_anywhere_changes_no_status(clone):
    root, current = clone
    library = sorted(p for p in (root / "kernapprox").rglob("*.py"))
    originals = {p: p.read_text() for p in library}
    try:
        for path in library:
            path.write_text(originals[path] + "\n# a comment only\n")
        rows = {r.path.stem: r.status for r in figure_status(root / "figures", root=root)}
        assert all(rows[row.path.stem] == "current" for row in current)
    finally:
        for path, text in originals.items():
            path.write_text(text)


def test_a_statement_in_a_reached_module_stales_the_figure_and_elsewhere_nothing(clone):
    root, current = clone
    rng = np.random.default_rng(20261207)
    every = sorted(p.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
                   for p in (root / "kernapprox").rglob("*.py"))
    checked = 0
    for row in current:
        record = read_provenance(root / "figures" / f"{row.path.stem}.png")
        reached = sorted(record["code"]["library"])
        outside = [m for m in every if m not in reached and m not in provenance.REPORT_MODULES]
        for module in rng.choice(reached, size=min(3, len(reached)), replace=False):
            path = _path(root, module)
            text = path.read_text()
            try:
                path.write_text(text + "\n_EDITED_BY_THE_TEST = 1\n")
                after = _status(root, row.path.stem)
                assert after.status == "stale" and f"{module} changed" in after.reasons, (row.path.name, module)
            finally:
                path.write_text(text)
            checked += 1
        if outside:
            module = outside[int(rng.integers(len(outside)))]
            path = _path(root, module)
            text = path.read_text()
            try:
                path.write_text(text + "\n_EDITED_BY_THE_TEST = 1\n")
                assert _status(root, row.path.stem).status == "current", (row.path.name, module)
            finally:
                path.write_text(text)
        assert _status(root, row.path.stem).status == "current"
    assert checked >= len(current)


def test_run_cell_stales_the_compute_and_an_unreached_statement_nothing(clone):
    root, current = clone
    for module in sorted({row.module for row in current}):
        if not module.startswith("experiments."):
            continue
        path = _path(root, module)
        text = path.read_text()
        stems = [row.path.stem for row in current if row.module == module]
        try:
            path.write_text(text + "\n_EDITED_BY_THE_TEST = 1\n")
            # a top-level statement that run_cell does not use: neither compute nor report
            assert all(_status(root, s).status == "current" for s in stems), module
            body = text.index("def run_cell(")
            colon = text.index(":\n", text.index(")", body))
            indent = "    "
            edited = text[:colon + 2] + f"{indent}_edited_by_the_test = 1\n" + text[colon + 2:]
            path.write_text(edited)
            for stem in stems:
                after = _status(root, stem)
                assert after.status == "stale" and f"{module} (compute) changed" in after.reasons, stem
        finally:
            path.write_text(text)
