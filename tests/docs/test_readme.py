"""The README is the front door: short, its example runs and prints what it says, its links and gallery are current."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short():
    assert len(README.encode("utf-8")) <= 15 * 1024


def test_readme_example_runs_and_prints_what_it_says():
    # The first python block, and the ```text block after it: what running the block prints.
    match = re.search(r"```python\n(.*?)```\s*\n(?:[^`]*?)```text\n(.*?)```", README, re.S)
    assert match, "the README needs a ```python example followed by a ```text block of its output"
    code, expected = match.groups()
    assert len(code.strip().splitlines()) <= 12
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip() == expected.strip()


def test_readme_links_point_to_files():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) + re.findall(r'(?:src|href)="([^"]+)"', README)
    assert targets
    missing = [target for target in targets if "://" not in target and not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.fixture
def generate():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate

        yield generate
    finally:
        sys.path.remove(str(ROOT / "docs"))


def test_readme_gallery_is_current(generate):
    """Every study's figure has a thumbnail and one sentence, every named preset's figure a link after the table,
    and the full presets one sentence with their count; regenerate with `python docs/generate.py readme`."""
    assert generate.update_readme(ROOT / "README.md", check=True), "run `python docs/generate.py readme`"
    block = README[README.index(generate.GALLERY_START):README.index(generate.GALLERY_END)]
    full = sorted((ROOT / "figures").glob("*_full.png"))
    if full:
        assert f"Full presets of {len(full)} studies (`make figures PRESET=full`" in block
        assert "`figures/<study>_full.png`" in block
    for png in sorted((ROOT / "figures").glob("*.png")):
        if png not in full:
            assert f'src="figures/{png.name}"' in block or f"](figures/{png.name})" in block, png.name
    studies = {p.stem for p in (ROOT / "experiments").glob("*.py") if not p.stem.startswith("_")}
    for png in sorted((ROOT / "figures").glob("*.png")):
        if png.stem in studies:                   # each study keeps its own row
            assert f'src="figures/{png.name}"' in block, png.name
