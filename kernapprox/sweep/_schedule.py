"""``make figures``: run the studies whose figures are not current, a few at a time.

A figure is current when nothing its numbers depend on and nothing that draws it has changed since it was made
(:func:`kernapprox.sweep.figure_status`, one notion of "changed" for the store, the figures and this scheduler).
Each study that is not current runs as ``python -m experiments.<name> --preset P``: its cells come from the result
store (:mod:`kernapprox.store`) where their code is unchanged and are computed where it is not, and its figure is
re-stamped where the findings read the same (:func:`kernapprox.sweep.draw`). ``--all`` runs every study of the
preset (a cold run, on an empty cache root, is ``make figures ALL=1``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ._figures import figure_status


def preset_suffix(preset: str) -> str:
    return "" if preset == "default" else f"_{preset}"


def studies_in(folder: Path) -> list[str]:
    """The study modules of the folder ``experiments``: ``<name>.py`` that do not start with ``_``."""
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def split_stem(stem: str, studies: list[str]) -> tuple[str, str] | None:
    """``(study, preset)`` of a figure's file stem (``causal_lm_long`` → ``("causal_lm", "long")``)."""
    for study in sorted(studies, key=len, reverse=True):
        if stem == study:
            return study, "default"
        if stem.startswith(study + "_"):
            return study, stem[len(study) + 1:]
    return None


def plan(studies: list[str], presets: list[str], figures: Path, *, everything: bool = False) -> list[tuple]:
    """``[(study, preset, why)]`` to run, in the order given: every pair whose figure is missing or not current
    (or every pair, with ``everything``)."""
    status = {row.path.stem: row for row in figure_status(figures)} if figures.is_dir() else {}
    todo = []
    for preset in presets:
        for study in studies:
            stem = f"{study}{preset_suffix(preset)}"
            row = status.get(stem)
            if everything:
                todo.append((study, preset, "all"))
            elif row is None or not (figures / f"{stem}.png").is_file():
                todo.append((study, preset, "no figure"))
            elif row.status != "current":
                todo.append((study, preset, "; ".join(row.reasons) or row.status))
    return todo


def run_studies(todo, *, jobs: int, device: str, threads: int, python: str = sys.executable,
                figures: Path = Path("figures"), results: Path = Path("results"), extra=()) -> int:
    """Run the planned ``(study, preset, why)`` pairs, ``jobs`` at a time; 0 when every run succeeded."""
    pending = list(todo)
    running: dict[subprocess.Popen, tuple] = {}
    failed = []
    started = time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                study, preset, why = pending.pop(0)
                suffix = preset_suffix(preset)
                cmd = [python, "-m", f"experiments.{study}", "--preset", preset, "--device", device, "--threads",
                       str(threads), "--out", str(results / f"{study}{suffix}.nc"), "--figure",
                       str(figures / f"{study}{suffix}.png"), "--quiet", *extra]
                print(f"[figures] {study} ({preset}): {why}", flush=True)
                running[subprocess.Popen(cmd)] = (study, preset)
            done = [p for p in running if p.poll() is not None]
            if not done:
                time.sleep(0.2)
            for proc in done:
                study, preset = running.pop(proc)
                if proc.returncode != 0:
                    failed.append(f"{study} ({preset}): exit {proc.returncode}")
    except KeyboardInterrupt:
        for proc in running:
            proc.send_signal(signal.SIGINT)
        for proc in running:
            proc.wait()
        print("\n[figures] interrupted; what the studies finished is saved in the result store: rerun to resume",
              file=sys.stderr)
        return 130
    minutes = (time.perf_counter() - started) / 60
    if failed:
        print(f"[figures] {len(failed)} of {len(todo)} runs failed ({minutes:.1f} min): " + "; ".join(failed),
              file=sys.stderr)
        return 1
    print(f"[figures] {len(todo)} runs, {minutes:.1f} min", file=sys.stderr)
    return 0


def committed_presets(figures: Path, studies: list[str]) -> list[tuple[str, str]]:
    """``(study, preset)`` of every figure in ``figures`` made by a study (for ``recertify``)."""
    found = []
    for md in sorted(figures.glob("*.md")):
        pair = split_stem(md.stem, studies)
        if pair is not None and (figures / f"{md.stem}.png").is_file():
            found.append(pair)
    return found


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))
