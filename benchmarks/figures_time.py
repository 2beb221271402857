"""``python -m benchmarks.figures_time --preset full``: what one ``make figures`` run of a preset cost, study by study.

Every number is read from the datasets the run wrote (``results/<name>.nc`` for the default preset,
``results/<name>_<preset>.nc`` for another): each study's ``wall_seconds``, ``cpu_seconds``, cells run and reused,
threads and start and end times (the provenance attributes of :func:`kernapprox.sweep.run`). The run's span is the
first study's start to the last study's end: the experiments of ``make figures`` with ``JOBS`` of them at a time,
not the install before them nor the README's gallery after them. A study whose dataset is missing, or was written
by another preset, is named, not guessed. The budgets are the project's: ``make figures`` (default) within 25
minutes, install included, and ``make figures PRESET=full`` within 60 minutes on the 2-core reference machine.

``--out`` writes the table as Markdown (``benchmarks/FIGURES_TIME_<preset>.md``; the performance page of the
documentation includes it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import xarray as xr

ROOT = Path(__file__).resolve().parents[1]
BUDGET_MINUTES = {"default": 25.0, "full": 60.0}


def studies() -> list[str]:
    """The experiments ``make figures`` runs: every ``experiments/<name>.py`` but the private modules."""
    return sorted(p.stem for p in (ROOT / "experiments").glob("[a-z]*.py"))


def _time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def collect(preset: str, results: Path = ROOT / "results") -> tuple[list[dict], list[str]]:
    """One row per study whose dataset of ``preset`` exists, and the names of the studies without one."""
    suffix = "" if preset == "default" else f"_{preset}"
    rows, missing = [], []
    for name in studies():
        path = results / f"{name}{suffix}.nc"
        if not path.exists():
            missing.append(name)
            continue
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            attrs = dict(ds.attrs)
        if attrs.get("preset_base", attrs.get("preset")) != preset or "time_start" not in attrs:
            missing.append(f"{name} (its dataset is not a run of the {preset} preset)")
            continue
        rows.append({"study": name, "wall_s": float(attrs["wall_seconds"]), "cpu_s": float(attrs["cpu_seconds"]),
                     "cells_run": int(attrs.get("cells_run", 0)), "cells_reused": int(attrs.get("cells_reused", 0)),
                     "threads": int(attrs.get("torch_num_threads", 0)), "start": _time(attrs["time_start"]),
                     "end": _time(attrs["time_end"]), "revision": attrs.get("git_revision", "")})
    return rows, missing


def table(preset: str, rows: list[dict], missing: list[str]) -> str:
    """The Markdown report: the run's span against its budget, then one row per study, the longest first."""
    if not rows:
        raise ValueError(f"no dataset of the {preset} preset under results/: run make figures PRESET={preset}")
    start, end = min(r["start"] for r in rows), max(r["end"] for r in rows)
    span = (end - start).total_seconds()
    cpu = sum(r["cpu_s"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    budget = BUDGET_MINUTES.get(preset)
    revisions = sorted({r["revision"] for r in rows})
    lines = [f"`make figures PRESET={preset}`: {len(rows)} studies from {start:%Y-%m-%d %H:%M} to {end:%H:%M} UTC, "
             f"a span of {span / 60:.1f} min (the experiments only: install and gallery not included)"
             + (f" against the budget of {budget:g} min" if budget else "")
             + f"; the studies' wall times add up to {wall / 60:.1f} min and their CPU times to {cpu / 60:.1f} "
             f"CPU-min. Code: {', '.join(f'`{r}`' for r in revisions)}.", ""]
    if span > wall:
        lines += ["These datasets come from several runs (the span exceeds the studies' summed wall times): the span "
                  "is not one run's time; the per-study times are.", ""]
    if missing:
        lines += [f"Not in this run: {', '.join(missing)}.", ""]
    lines += ["| study | wall (s) | CPU (s) | cells run | cells reused | torch threads | start (UTC) | end (UTC) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["wall_s"]):
        lines.append(f"| {r['study']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['cells_run']} | "
                     f"{r['cells_reused']} | {r['threads']} | {r['start']:%H:%M:%S} | {r['end']:%H:%M:%S} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, help="write the Markdown table here (else print it)")
    args = parser.parse_args(argv)
    rows, missing = collect(args.preset, args.results)
    text = table(args.preset, rows, missing)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
