"""Drawing a result: the figure and its findings, from the dataset alone, tied together by the data's digest.

:func:`draw` writes ``<figure>.png`` with the experiment's ``plot`` and, when the experiment has ``findings``,
``<figure>.md``: its markdown bullets (every number computed from the dataset) and a last line naming the dataset
and the digest of its values (:func:`dataset_digest`). The PNG's ``Source`` metadata carries the same digest, so a
figure and its findings can be checked to come from the same data; both are deterministic functions of the
dataset (the same dataset gives byte-identical text).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xarray as xr

from ..io import atomic_write

TIMING_VARIABLES = ("cell_seconds", "reference_seconds")
_DIGEST_LINE = re.compile(r"<!-- findings of (?P<source>\S+) \((?P<module>[^)]*)\); "
                          r"data digest (?P<digest>[0-9a-f]+)(?:; code (?P<code>[0-9a-f]+))? -->")


def dataset_digest(ds: xr.Dataset) -> str:
    """SHA-256 (16 hex digits) of a dataset's coordinates and data values, without its timings (the wall times of
    its cells and every other variable in seconds, ``units="s"``: training times, timed calls) or any attribute
    (provenance, dates), so that two runs that computed the same numbers have the same digest."""
    digest = hashlib.sha256()
    for group in (ds.coords, ds.data_vars):
        for name in sorted(group):
            if name in TIMING_VARIABLES or (name in ds.data_vars and group[name].attrs.get("units") == "s"):
                continue
            var = group[name]
            digest.update(f"{name}:{','.join(map(str, var.dims))}:{var.shape}".encode())
            values = np.asarray(var.values)
            if values.dtype.kind in "biuf":
                digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
            else:
                digest.update("\x1f".join(map(str, values.ravel().tolist())).encode())
    return digest.hexdigest()[:16]


def findings_body(experiment, ds: xr.Dataset) -> str:
    """The experiment's findings on ``ds`` as markdown: its text, or its sentences as bullets
    (:func:`kernapprox.plotting.bullets`; empty sentences left out). ``ValueError`` if there is nothing."""
    from ..plotting import bullets

    body = experiment.findings(ds)
    if isinstance(body, list | tuple):                      # sentences: one bullet each
        body = bullets(body)
    if not isinstance(body, str) or not body.strip():
        raise ValueError(f"findings of {experiment.name!r} must return non-empty markdown text or a list of "
                         "sentences")
    return body.strip()


def findings_text(experiment, ds: xr.Dataset, source: str) -> str:
    """The markdown written beside the figure: the experiment's findings (:func:`findings_body`), the closing
    line that says what the intervals are (:func:`kernapprox.stats.interval_note` over the study's
    ``replicates``), then the line naming the data."""
    from ..plotting import bullets
    from ..stats import interval_note

    body = findings_body(experiment, ds)
    note = bullets([interval_note(ds, experiment.replicates)])
    if "Numbers in parentheses are" not in body:          # the engine's closing line, unless the study wrote one
        body = f"{body}\n{note}"
    code = ds.attrs.get("code_digest") or ""
    return (body + f"\n\n<!-- findings of {source} ({experiment.module}); data digest "
            f"{dataset_digest(ds)}{f'; code {code}' if code else ''} -->\n")


def read_digest(markdown: str) -> str | None:
    """The data digest named by a findings file's last line (``None`` if it has none)."""
    match = _DIGEST_LINE.search(markdown)
    return match["digest"] if match else None


def read_code_digest(markdown: str) -> str | None:
    """The code digest (:func:`kernapprox.sweep.study_code_digest` of the code that made the data) named by a
    findings file's last line (``None`` if it names none)."""
    match = _DIGEST_LINE.search(markdown)
    return match["code"] if match else None


class FigureStatus(NamedTuple):
    """One committed findings file against the code now: ``status`` is ``"current"`` (its data was made by code
    with today's digest), ``"stale"`` (by other code), or ``"unknown"`` (the file names no code digest, or its
    module's digest cannot be computed)."""

    path: Path
    module: str
    recorded: str | None
    current: str | None
    status: str


def figure_status(folder="figures") -> list[FigureStatus]:
    """Whether each findings file in ``folder`` (``*.md`` with the engine's last line) was made by today's code:
    its recorded code digest against :func:`~kernapprox.sweep.study_code_digest` of its module now. A figure made
    by other code may still show the same numbers (a change elsewhere in the library); rerunning it settles it
    (``make figures`` reruns what is stale and the data digest says whether the numbers moved)."""
    from ._provenance import study_code_digest

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} is not a directory")
    rows, current = [], {}
    for path in sorted(folder.glob("*.md")):
        match = _DIGEST_LINE.search(path.read_text(encoding="utf-8"))
        if match is None:
            continue
        module = match["module"]
        if module not in current:
            current[module] = study_code_digest(module)
        now, recorded = current[module], match["code"]
        status = "unknown" if recorded is None or now is None else ("current" if recorded == now else "stale")
        rows.append(FigureStatus(path, module, recorded, now, status))
    return rows


def draw(experiment, ds: xr.Dataset, figure, *, source: str = "the dataset") -> list[Path]:
    """Write the figure (and the findings beside it, ``.md``); returns the paths written."""
    from .. import plotting

    figure = Path(figure)
    figure.parent.mkdir(parents=True, exist_ok=True)
    digest = dataset_digest(ds)
    with plotting.figure_source(f"{source}; data digest {digest}"):
        experiment.plot(ds, figure)
    written = [figure]
    if experiment.findings is not None:
        text = findings_text(experiment, ds, source)
        path = figure.with_suffix(".md")
        atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        written.append(path)
    return written
