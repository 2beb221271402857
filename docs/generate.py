"""The generated parts of the documentation: the estimator table, the figure gallery, the README's gallery block and
the tables of the "Choosing an estimator" page.

``conf.py`` calls :func:`write_generated` at every build, so the docs never hold a pasted copy of something the
code or the figures can say. The README's thumbnail gallery (between ``<!-- gallery:start -->`` and
``<!-- gallery:end -->``) is regenerated with ``python docs/generate.py readme``; ``tests/docs/test_docs.py`` checks
that it is current.

The choosing page's tables (``docs/guide/choosing.md``, between ``<!-- choosing:start -->`` and
``<!-- choosing:end -->``) are computed from the studies' datasets ``results/*.nc`` by :mod:`choosing`
(``docs/choosing.py``) and regenerated with ``python docs/generate.py choosing``; the docs build regenerates them
when every dataset the page reads is present (a checkout without ``results/`` keeps the committed page), and
``tests/docs/test_choosing.py`` checks that they are current.

Gallery text per figure: the generated findings ``figures/<name>.md`` (when that file exists). The figure's title
and caption are the ones :func:`kernapprox.plotting.save_figure` stored in the PNG's ``Title`` and ``Description``
(a figure without a title of its own is named after its file).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHOOSING = DOCS / "guide" / "choosing.md"
GALLERY_START, GALLERY_END = "<!-- gallery:start -->", "<!-- gallery:end -->"
# The order of the gallery (the order of the study: kernel, variance, attention, in-context tasks, data, cost);
# figures not listed follow in alphabetical order.
ORDER = ("kernel_error", "variance_theory", "attention_error", "icl_recall", "icl_regression", "icl_classification",
         "in_context_vs_in_weight", "rank_summary", "query_distribution", "spectrum", "modality_spectrum", "modes",
         "model_substitution",
         "causal_lm", "distillation")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


@dataclass(frozen=True)
class Figure:
    """One figure of the gallery: ``figures/<name>.png`` and what is said about it."""

    name: str
    title: str
    text: str  # markdown: the generated findings ("" when there are none)
    generated: bool  # True when ``text`` is ``figures/<name>.md``
    caption: str  # the PNG's stored caption ("" if none)

    @property
    def image(self) -> Path:
        return ROOT / "figures" / f"{self.name}.png"


def estimator_table() -> str:
    """The registry's estimator table (the one ``python -m kernapprox.estimators`` prints)."""
    from kernapprox.estimators.registry import estimator_table as table

    return table()


def _png_metadata(path: Path) -> tuple[str, str]:
    """``(title, caption)`` stored in a PNG (``""`` for what it lacks)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow comes with matplotlib
        return "", ""
    with Image.open(path) as image:
        return (str(image.info.get("Title", "")).strip(), str(image.info.get("Description", "")).strip())


def figures(root: Path = ROOT) -> list[Figure]:
    """Every ``figures/*.png`` in gallery order, with its title, text and caption."""
    names = sorted(path.stem for path in (root / "figures").glob("*.png"))
    names.sort(key=lambda name: (ORDER.index(name) if name in ORDER else len(ORDER), name))
    out = []
    for name in names:
        title, caption = _png_metadata(root / "figures" / f"{name}.png")
        if not title or title == name:                   # save_figure's default is the file's stem
            title = name.replace("_", " ").capitalize()
        findings = root / "figures" / f"{name}.md"
        generated = findings.exists()
        text = findings.read_text(encoding="utf-8").strip() if generated else ""
        out.append(Figure(name, title, text, generated, caption))
    return out


def first_sentence(markdown: str) -> str:
    """The first sentence of a paragraph (or the first bullet of a list), on one line; headings are skipped."""
    text = "\n".join(line for line in markdown.splitlines() if not line.lstrip().startswith("#")).strip()
    if text.startswith(("- ", "* ")):  # generated findings are bullets: the first bullet
        text = text[2:].split("\n- ")[0].split("\n* ")[0]
    text = " ".join(text.split())
    return _SENTENCE_END.split(text, maxsplit=1)[0]


def _escape(text: str) -> str:
    """Plain text (a PNG caption) made safe for MyST markdown."""
    return re.sub(r"([\\`*_\[\]<>$|#])", r"\\\1", " ".join(text.split()))


def _demote_headings(markdown: str) -> str:
    """Headings inside a figure's text become bold lines: the page's own sections are the figures."""
    return re.sub(r"^#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", r"**\1**", markdown, flags=re.M)


_SOURCE = re.compile(r"<!-- findings of (?:.*/)?(results/[\w.-]+\.nc) \((experiments|benchmarks)\.(\w+)\)")


def _sources(item: Figure) -> tuple[str, str]:
    """``(program file, dataset)`` of a figure: as its findings name them (a preset other than the default writes
    ``results/<name>_<preset>.nc`` of ``experiments/<name>.py``; a benchmark's figure names its
    ``benchmarks/<name>.py``), else ``experiments/<name>.py`` and ``results/<name>.nc``."""
    found = _SOURCE.search(item.text)
    if found:
        return f"{found.group(2)}/{found.group(3)}.py", found.group(1)
    return f"experiments/{item.name}.py", f"results/{item.name}.nc"


def gallery_page(items: list[Figure], image_dir: str) -> str:
    """The body of the findings page: one section per figure, its caption, then its text."""
    parts = []
    for item in items:
        module, dataset = _sources(item)
        section = (f"(fig-{item.name})=\n## {item.title}\n\n"
                   f"`{module}` → `{dataset}` → `figures/{item.name}.png`\n\n"
                   f"```{{figure}} {image_dir}/{item.name}.png\n:alt: {item.name}\n:width: 100%\n\n"
                   f"{_escape(item.caption) or item.name}\n```\n")
        if item.text:
            section += f"\n**Findings (generated from the dataset).**\n\n{_demote_headings(item.text)}\n"
        parts.append(section)
    return "\n".join(parts)


def readme_gallery(items: list[Figure]) -> str:
    """The README's thumbnail gallery: a table of small images (GitHub links each to its file), each with one
    finding sentence. A figure of another preset of a study that has its own row (its findings name
    ``results/<name>_<preset>.nc`` of that study) is not a row: the full presets are named in one sentence after the
    table and the named presets linked in one line, so the README keeps one row per study; a benchmark's figure (its
    findings name ``benchmarks/<name>.py``: it times one machine) is
    linked in a line of its own."""
    lines = [GALLERY_START,
             "<!-- generated by `python docs/generate.py readme` from figures/*.png and their texts: do not edit -->",
             "", "| figure | what it shows |", "|---|---|"]
    shown = {item.name for item in items}
    variants, benchmarks = [], []
    for item in items:
        module = _sources(item)[0]
        if module.startswith("benchmarks/"):
            benchmarks.append(item)
            continue
        if module != f"experiments/{item.name}.py" and Path(module).stem in shown:
            variants.append(item)                  # another preset of a study that has its own row
            continue
        sentence = first_sentence(item.text) if item.text else ""
        thumbnail = f'<img src="figures/{item.name}.png" width="260" alt="{item.name}">'
        cell = f"**{item.title}** (`{item.name}`). {sentence}".strip().replace("|", "\\|")
        lines.append(f"| {thumbnail} | {cell} |")
    full = [v for v in variants if v.name.endswith("_full")]
    named = [v for v in variants if v not in full]
    if full:
        lines += ["", f"Full presets of {len(full)} studies (`make figures PRESET=full`: ten seeds or draws where the "
                      "default has fewer): `figures/<study>_full.png` and `.md`."]
    if named:
        links = ", ".join(f"[`{v.name}`](figures/{v.name}.png)" for v in named)
        lines += ["", f"Named presets (`make <study>-<preset>`): {links}."]
    if benchmarks:
        links = ", ".join(f"[`{b.name}`](figures/{b.name}.png) ({_sources(b)[0]})" for b in benchmarks)
        lines += ["", f"Benchmarks of the machine that ran them (not part of `make figures`): {links}."]
    lines.append(GALLERY_END)
    return "\n".join(lines)


def update_readme(path: Path = ROOT / "README.md", *, check: bool = False) -> bool:
    """Rewrite the README's gallery block; with ``check`` only report whether it is current."""
    text = path.read_text(encoding="utf-8")
    start, end = text.index(GALLERY_START), text.index(GALLERY_END) + len(GALLERY_END)
    new = text[:start] + readme_gallery(figures()) + text[end:]
    if check or new == text:
        return new == text
    path.write_text(new, encoding="utf-8")
    return True


def write_generated(out: Path = DOCS / "_generated") -> None:
    """Write what the pages include: the estimator table, the gallery page and a copy of the figures."""
    out.mkdir(parents=True, exist_ok=True)
    _write_if_changed(out / "estimator_table.md", estimator_table() + "\n")
    image_dir = out / "figures"
    image_dir.mkdir(exist_ok=True)
    items = figures()
    for item in items:
        target = image_dir / item.image.name
        if not target.exists() or target.read_bytes() != item.image.read_bytes():
            shutil.copyfile(item.image, target)
    _write_if_changed(out / "gallery.md", gallery_page(items, "/_generated/figures"))
    if out == DOCS / "_generated" and choosing_datasets_present():
        update_choosing()                            # rewritten only where the tables changed


def update_choosing(path: Path = CHOOSING, *, check: bool = False, root: Path = ROOT) -> bool:
    """Rewrite the choosing page's tables from the datasets; with ``check`` only report whether they are current."""
    import choosing

    return choosing.update_page(path, check=check, root=root)


def choosing_datasets_present(root: Path = ROOT) -> bool:
    """Whether every dataset the choosing page reads is in ``results/`` (else the page cannot be regenerated here)."""
    import choosing

    return all((root / "results" / f"{name}.nc").exists() for name in choosing.sources(root))


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged files keep their time stamp, so an incremental build re-reads only what changed.
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["readme", "table", "choosing"],
                        help="readme: rewrite the README gallery block; table: print the estimator table; "
                             "choosing: rewrite the tables of docs/guide/choosing.md from results/*.nc")
    parser.add_argument("--check", action="store_true", help="only check that the README block (or the choosing "
                        "page) is current")
    args = parser.parse_args(argv)
    if args.what == "table":
        print(estimator_table())
        return 0
    if args.what == "choosing":
        if not update_choosing(check=args.check) and args.check:
            print("docs/guide/choosing.md is out of date: run `python docs/generate.py choosing`", file=sys.stderr)
            return 1
        return 0
    current = update_readme(check=args.check)
    if args.check and not current:
        print("README gallery is out of date: run `python docs/generate.py readme`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(DOCS)]
    raise SystemExit(main())
