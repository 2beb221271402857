"""The command line every experiment shares: ``python -m experiments.<name> [options]``."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from ._experiment import Experiment, grid_size, parse_value
from ._run import default_output, run
from ._store import load
from ._worker import CellError


def _describe_presets(experiment: Experiment) -> str:
    lines = ["presets (axis: values):"]
    for preset, grid in experiment.grids.items():
        lines.append(f"  {preset} — {grid_size(grid)} cells")
        for axis, values in grid.items():
            shown = ", ".join(map(str, values))
            lines.append(textwrap.fill(f"{axis}: {shown}", width=100, initial_indent="      ",
                                       subsequent_indent="          "))
    lines.append("metrics:")
    for name, metric in experiment.metrics.items():
        dims = f" [{', '.join(metric.dims)}]" if metric.dims else ""
        lines.append(textwrap.fill(f"{name}{dims} ({metric.units}): {metric.long_name}", width=100,
                                   initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser(experiment: Experiment) -> argparse.ArgumentParser:
    presets = list(experiment.grids)
    parser = argparse.ArgumentParser(
        prog=f"python -m {experiment.module}",
        description=f"{experiment.title}\n\n{textwrap.fill(experiment.description, 100)}",
        epilog=_describe_presets(experiment) + textwrap.dedent(f"""

            Each cell's randomness comes from the experiment name, the cell's coordinate values and --root-seed,
            so one cell run alone (--only axis=value ...) reproduces its stored numbers. An interrupted run
            resumes from {default_output(experiment)}.partial/ (--no-resume starts over)."""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    default_preset = "default" if "default" in presets else presets[0]
    parser.add_argument("--preset", choices=presets, default=default_preset,
                        help=f"grid preset (default: {default_preset})")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--seeds", type=int, metavar="N", help="replace the seed axis by 0..N-1")
    parser.add_argument("--out", type=Path, help=f"dataset path (default {default_output(experiment)}; "
                                                  f"with --only {default_output(experiment, True)})")
    parser.add_argument("--only", nargs="+", action="extend", metavar="AXIS=VALUE", default=[],
                        help="run only these values of an axis (repeat for several values or axes)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="0: run in this process (default); N: a spawn process pool of N workers")
    parser.add_argument("--dask", action="store_true", help="with --workers N: a dask LocalCluster of N processes")
    parser.add_argument("--scheduler", metavar="ADDRESS", help="run cells on this dask.distributed scheduler")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="discard the progress of an interrupted run and start over")
    parser.add_argument("--root-seed", type=int, default=0, metavar="S", help="root seed of every cell (default 0)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch threads per running cell (default: torch's choice; cores/workers in a pool)")
    parser.add_argument("--max-retries", type=int, default=2, metavar="K",
                        help="resubmissions of a cell lost with its worker (default 2)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the figure from the dataset at --out")
    parser.add_argument("--figure", type=Path,
                        help=f"figure path (default figures/{experiment.name}.png; a slice run draws none)")
    parser.add_argument("--no-figure", dest="draw", action="store_false", help="write the dataset only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _parse_only(experiment: Experiment, items: list[str], parser) -> dict:
    only: dict[str, list] = {}
    for item in items:
        axis, sep, text = item.partition("=")
        if not sep or not axis:
            parser.error(f"--only expects AXIS=VALUE, got {item!r}")
        if axis not in experiment.axes:
            parser.error(f"--only: unknown axis {axis!r}; axes: {', '.join(experiment.axes)}")
        try:
            only.setdefault(axis, []).append(parse_value(experiment, axis, text))
        except ValueError as exc:
            parser.error(str(exc))
    return only


def run_cli(experiment: Experiment, argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run or plot, and exit with a clear message on errors."""
    parser = build_parser(experiment)
    args = parser.parse_args(argv)
    only = _parse_only(experiment, args.only, parser)
    out = args.out or default_output(experiment, only)
    figure = args.figure or (None if only else Path("figures") / f"{experiment.name}.png")
    raw = sys.argv[1:] if argv is None else argv
    try:
        if args.plot_only:
            if figure is None:
                parser.error("--plot-only with --only needs --figure")
            ds = load(out)
        else:
            ds = run(experiment, preset=args.preset, out=out, device=args.device, only=only or None,
                     workers=args.workers, resume=args.resume, seeds=args.seeds, root_seed=args.root_seed,
                     dask=args.dask, scheduler=args.scheduler, max_retries=args.max_retries, threads=args.threads,
                     progress=False if args.quiet else None,
                     history=f"python -m {experiment.module} " + " ".join(raw))
        if figure is not None and (args.plot_only or args.draw):
            figure.parent.mkdir(parents=True, exist_ok=True)
            experiment.plot(ds, figure)
            print(f"{experiment.name}: figure -> {figure}", file=sys.stderr)
    except (ValueError, TypeError, FileNotFoundError, CellError, RuntimeError) as exc:
        print(f"error: {experiment.name}: {exc}", file=sys.stderr)
        raise SystemExit(2 if isinstance(exc, ValueError | TypeError | FileNotFoundError) else 1) from None
    return 0
