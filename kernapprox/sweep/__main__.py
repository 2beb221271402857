"""``python -m kernapprox.sweep status | figures | recertify``.

``status [FOLDER]``
    One line per figure of ``FOLDER`` (default ``figures``): ``current``, ``stale`` or ``unknown``, the figure's
    name, then what changed (:func:`kernapprox.sweep.figure_status`); ``--strict`` exits with 1 when any figure is
    not current.
``figures --preset P``
    Run the studies whose figure of preset ``P`` is missing or not current, ``--jobs`` at a time
    (:mod:`kernapprox.sweep._schedule`; ``--all``: every study). What ``make figures`` runs.
``recertify``
    The same for every figure in ``figures/`` whatever its preset: rerun what a change touched; a figure whose
    findings read the same is re-stamped without being redrawn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._figures import figure_status
from ._schedule import committed_presets, default_jobs, plan, run_studies, studies_in


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernapprox.sweep",
                                     description="Which figures are current, and running what is not.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="each figure against today's code: current, stale or unknown")
    status.add_argument("folder", nargs="?", default="figures")
    status.add_argument("--strict", action="store_true", help="exit 1 if any figure is stale or unknown")
    status.add_argument("--root", type=Path, help="the project checkout to compare with (default: this one)")
    for name, text in (("figures", "run the studies whose figures of a preset are not current"),
                       ("recertify", "rerun what changed for every figure in figures/, whatever its preset")):
        cmd = sub.add_parser(name, help=text)
        if name == "figures":
            cmd.add_argument("--preset", default="default")
            cmd.add_argument("--studies", nargs="+", help="the studies, in the order to start them (default: all)")
            cmd.add_argument("--all", dest="everything", action="store_true",
                             help="run every study, current or not (cells still come from the store)")
        cmd.add_argument("--jobs", type=int, default=default_jobs(), help="studies at a time")
        cmd.add_argument("--threads", type=int, default=1, help="torch threads per study")
        cmd.add_argument("--device", default="auto")
        cmd.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    args = parser.parse_args(argv)
    if args.command == "status":
        rows = figure_status(args.folder, root=args.root)
        for row in rows:
            reasons = "; ".join(row.reasons)
            print(f"{row.status:8s} {row.path.name:40s} {row.module:36s} {reasons}".rstrip())
        bad = [row for row in rows if row.status != "current"]
        print(f"{len(rows) - len(bad)} of {len(rows)} figures current", file=sys.stderr)
        return 1 if args.strict and bad else 0
    figures, experiments = Path("figures"), Path("experiments")
    known = studies_in(experiments)
    if args.command == "figures":
        unknown = sorted(set(args.studies or ()) - set(known))
        if unknown:
            parser.error(f"unknown studies {unknown}; studies: {', '.join(known)}")
        todo = plan(args.studies or known, [args.preset], figures, everything=args.everything)
    else:
        pairs = committed_presets(figures, known)
        todo = [item for study, preset in pairs for item in plan([study], [preset], figures)]
    for study, preset, why in todo:
        print(f"{study} ({preset}): {why}")
    if args.dry_run or not todo:
        if not todo:
            print("every figure is current: nothing to run", file=sys.stderr)
        return 0
    return run_studies(todo, jobs=args.jobs, device=args.device, threads=args.threads)


if __name__ == "__main__":
    sys.exit(main())
