"""Drawing a result: the figure and its findings, from the dataset alone, tied together by the data's digest.

:func:`draw` writes ``<figure>.png`` with the experiment's ``plot`` and, when the experiment has ``findings``,
``<figure>.md``: its markdown bullets (every number computed from the dataset) and a last line naming the dataset
and the digest of its values (:func:`dataset_digest`). The PNG's ``Source`` metadata carries the same digest, so a
figure and its findings can be checked to come from the same data; both are deterministic functions of the
dataset (the same dataset gives byte-identical text).
"""

from __future__ import annotations

import hashlib
import json
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
    """The code digest (the id of the dataset's merged dependency record, :func:`kernapprox.provenance.record_id`)
    named by a findings file's last line (``None`` if it names none)."""
    match = _DIGEST_LINE.search(markdown)
    return match["code"] if match else None


class FigureStatus(NamedTuple):
    """One committed figure against the code now. ``status`` is ``"current"`` (nothing its numbers depend on has
    changed, nor the code that draws it), ``"stale"`` (``reasons`` says what changed: a library module, the study's
    compute or report code, a package version) or ``"unknown"`` (no provenance record beside it)."""

    path: Path
    module: str
    recorded: str | None
    status: str
    reasons: tuple[str, ...] = ()


def provenance_path(figure) -> Path:
    """The provenance record of a figure: ``<figure>.deps.json`` beside ``<figure>.png`` and ``.md``."""
    figure = Path(figure)
    return figure.with_name(figure.stem + ".deps.json")


def read_provenance(figure) -> dict | None:
    """The provenance record beside ``figure`` (``None`` when there is none or it is unreadable)."""
    try:
        return json.loads(provenance_path(figure).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def figure_status(folder="figures", *, root=None) -> list[FigureStatus]:
    """Whether each figure in ``folder`` (a findings file ``*.md`` with the engine's last line, or a ``*.png``
    with a provenance record) is current: its record (:func:`provenance_path`) against the code under ``root``
    (default: this checkout): every library module its cells loaded, the study's compute slice and the package
    versions (:func:`kernapprox.provenance.changes`), and the study's report code
    (:func:`kernapprox.provenance.report_digest`). Nothing is imported or run."""
    from ..provenance import changes, report_digest

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} is not a directory")
    rows, reports = [], {}
    stems = sorted({p.stem for p in folder.glob("*.md")} | {p.name[:-len(".deps.json")]
                                                            for p in folder.glob("*.deps.json")})
    for stem in stems:
        md = folder / f"{stem}.md"
        record = read_provenance(folder / f"{stem}.png")
        match = _DIGEST_LINE.search(md.read_text(encoding="utf-8")) if md.is_file() else None
        if record is None and match is None:
            continue
        module = (record or {}).get("study") or (match["module"] if match else "?")
        if record is None or not record.get("code"):
            rows.append(FigureStatus(md, module, None, "unknown", ("no provenance record",)))
            continue
        reasons = list(changes(record["code"], root=root))
        if module not in reports:
            try:
                reports[module] = report_digest(module, root=root)
            except ValueError:
                reports[module] = None
        if reports[module] != record.get("report"):
            reasons.append(f"{module} (report) changed")
        rows.append(FigureStatus(md, module, record.get("code_digest"), "stale" if reasons else "current",
                                 tuple(reasons)))
    return rows


def _body(markdown: str) -> str:
    """A findings text without its last line (the data's digest and source), which a rerun may change while every
    printed number stays the same."""
    return _DIGEST_LINE.sub("", markdown).rstrip()


def draw(experiment, ds: xr.Dataset, figure, *, source: str = "the dataset") -> list[Path]:
    """Write the figure, the findings beside it (``.md``) and its provenance record (``.deps.json``: what the
    numbers depend on, :mod:`kernapprox.store`; the report code's digest; the data digest); returns the paths
    written.

    A figure whose findings would read the same (every printed number equal: the data are unchanged at the
    precision the findings print) and whose report code is unchanged is *re-stamped*, not redrawn: its PNG and
    findings stay as they are and only the record is rewritten, naming the new data digest beside the one the
    figure was drawn from. So a rerun on another machine, whose last bits differ, certifies a figure instead of
    rewriting it."""
    from .. import plotting
    from ..provenance import report_digest

    figure = Path(figure)
    figure.parent.mkdir(parents=True, exist_ok=True)
    digest = dataset_digest(ds)
    try:
        report = report_digest(experiment.module)
    except ValueError:                                  # a study outside the project's package: no record
        report = None
    text = findings_text(experiment, ds, source) if experiment.findings is not None else None
    md = figure.with_suffix(".md")
    old = read_provenance(figure)
    keep = (report is not None and old is not None and old.get("report") == report and figure.is_file()
            and (text is None or (md.is_file() and _body(md.read_text(encoding="utf-8")) == _body(text))))
    written = []
    if not keep:
        with plotting.figure_source(f"{source}; data digest {digest}"):
            experiment.plot(ds, figure)
        written.append(figure)
        if text is not None:
            atomic_write(md, lambda tmp: tmp.write_text(text, encoding="utf-8"))
            written.append(md)
    if report is not None:
        written.insert(0, write_provenance(figure, ds, experiment.module, report, keep=keep))
    return written


def write_provenance(figure, ds: xr.Dataset, module: str, report: str, *, keep: bool = False) -> Path:
    """Write ``<figure>.deps.json``: the dataset's merged dependency record (its ``dependencies`` attribute), the
    study and its preset, the report digest, the data digest, and the digest the figure was drawn from (the same
    unless the figure was kept: ``keep``)."""
    from ..provenance import record_id

    digest = dataset_digest(ds)
    old = read_provenance(figure) or {}
    code = json.loads(ds.attrs["dependencies"]) if ds.attrs.get("dependencies") else None
    record = {"study": module, "preset": ds.attrs.get("preset"), "code_digest": record_id(code) if code else None,
              "code": code, "report": report, "data_digest": digest,
              "drawn_from": old.get("drawn_from", digest) if keep else digest,
              "git_revision": ds.attrs.get("git_revision")}
    path = provenance_path(figure)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n",
                                                  encoding="utf-8"))
    return path
