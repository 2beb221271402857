"""The getting-started section on models and layers ("A model with pluggable attention"): every python block runs
and prints the ```text block that follows it."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "guide" / "getting_started.md").read_text(encoding="utf-8")
SECTION = PAGE[PAGE.index("## A model with pluggable attention"):PAGE.index("## Where to read on")]
BLOCKS = re.findall(r"```python\n(.*?)```\s*\n(?:[^`]*?)```text\n(.*?)```", SECTION, re.S)


def test_the_section_has_its_examples():
    assert len(BLOCKS) == 2 and "CausalTransformer" in BLOCKS[0][0] and "KernelAttention" in BLOCKS[1][0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs_and_prints_what_the_page_says(index):
    code, expected = BLOCKS[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"getting_started.md[{index}]", "exec"), {"__name__": "guide_example"})
    assert out.getvalue().strip() == expected.strip()
