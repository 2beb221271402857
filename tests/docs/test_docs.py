"""The documentation's generated parts come from the code and the figures, and every page is reachable."""

import re
from pathlib import Path

import pytest
from helpers import docs_module

import kernapprox as ka

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.fixture
def generate():
    with docs_module("generate") as module:
        yield module


def test_estimator_page_includes_the_generated_registry_table(generate, tmp_path):
    """The estimator table is generated from the registry at build time (never pasted into a page)."""
    generate.write_generated(tmp_path)
    table = (tmp_path / "estimator_table.md").read_text(encoding="utf-8")
    assert table.strip() == ka.estimator_table().strip()
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]}
    assert rows == set(ka.available_estimators())
    page = (DOCS / "guide" / "estimators.md").read_text(encoding="utf-8")
    assert "```{include} ../_generated/estimator_table.md" in page
    assert "| `positive_orthogonal` |" not in page  # not pasted


def test_gallery_has_every_figure(generate, tmp_path):
    generate.write_generated(tmp_path)
    gallery = (tmp_path / "gallery.md").read_text(encoding="utf-8")
    for png in sorted((ROOT / "figures").glob("*.png")):
        assert f"/_generated/figures/{png.name}" in gallery
        assert (tmp_path / "figures" / png.name).read_bytes() == png.read_bytes()
    assert "```{include} ../_generated/gallery.md" in (DOCS / "guide" / "findings.md").read_text(encoding="utf-8")


def test_gallery_titles_captions_and_findings_come_from_the_figures(generate, tmp_path):
    """A figure's title and caption are the PNG's own; its text is figures/<name>.md when it exists."""
    from PIL import Image

    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "kernel_error.png").write_bytes((ROOT / "figures" / "kernel_error.png").read_bytes())
    Image.new("RGB", (2, 2)).save(tmp_path / "figures" / "zzz_new.png")          # no title, no caption
    (tmp_path / "figures" / "zzz_new.md").write_text("## Findings\n\n- The error is 0.5 [0.4, 0.6]. More.\n- Second.\n")
    items = generate.figures(tmp_path)
    assert [item.name for item in items] == ["kernel_error", "zzz_new"]
    assert not items[0].generated and items[0].text == ""
    assert items[0].title == "Kernel-matrix error against the number of features"         # the PNG's Title
    assert items[0].caption  # save_figure stores the caption in the PNG
    assert items[1].generated and generate.first_sentence(items[1].text) == "The error is 0.5 [0.4, 0.6]."
    assert items[1].title == "Zzz new" and items[1].caption == ""
    # the figures are the page's sections: a heading inside a figure's text must not open another one
    page = generate.gallery_page(items, "/_generated/figures")
    assert [line for line in page.splitlines() if line.startswith("#")] == [
        "## Kernel-matrix error against the number of features", "## Zzz new"]
    assert "**Findings**\n\n- The error is 0.5" in page


def _toctree_entries(page: Path) -> list[Path]:
    text = page.read_text(encoding="utf-8")
    entries = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith(":"):
                entries.append((page.parent / f"{line}.md").resolve())
    return entries


def test_every_page_is_reachable_from_the_index():
    seen, todo = set(), [DOCS / "index.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        todo.extend(_toctree_entries(page))
    pages = {path.resolve() for path in DOCS.rglob("*.md")
             if not any(part.startswith("_") for part in path.relative_to(DOCS).parts)}
    assert pages <= seen, f"pages outside every toctree: {sorted(map(str, pages - seen))}"
    assert all(page.exists() for page in seen)
