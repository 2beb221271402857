"""The command line every experiment shares: ``python -m experiments.<name> [options]``."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from ._experiment import Experiment, axis_type, grid_size, parse_text, parse_value
from ._figures import draw
from ._run import default_figure, default_output, run, summarise_dataset
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
    if experiment.parameters:
        lines.append("fixed parameters (--set NAME=VALUE):")
        for name, p in experiment.parameters.items():
            lines.append(textwrap.fill(f"{name} = {p.value!r} ({p.units}): {p.long_name}", width=100,
                                       initial_indent="  ", subsequent_indent="      "))
    lines.append("metrics:")
    for name, metric in experiment.metrics.items():
        dims = f" [{', '.join(metric.dims)}]" if metric.dims else ""
        lines.append(textwrap.fill(f"{name}{dims} ({metric.units}): {metric.long_name}", width=100,
                                   initial_indent="  ", subsequent_indent="      "))
    if experiment.reference is not None:
        lines.append(f"reference, once per data draw over {', '.join(experiment.reference_axes)}:")
        for name, metric in experiment.reference.metrics.items():
            dims = f" [{', '.join(metric.dims)}]" if metric.dims else ""
            lines.append(textwrap.fill(f"{name}{dims} ({metric.units}): {metric.long_name}", width=100,
                                       initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser(experiment: Experiment) -> argparse.ArgumentParser:
    presets = list(experiment.grids)
    parser = argparse.ArgumentParser(
        prog=f"python -m {experiment.module}",
        description=f"{experiment.title}\n\n{textwrap.fill(experiment.description, 100)}",
        epilog=_describe_presets(experiment) + textwrap.dedent("""

            Each cell's randomness comes from the experiment name, the cell's coordinate values and --root-seed,
            so one cell run alone (--only axis=value ...) reproduces its stored numbers. An interrupted run
            resumes from the result store (kernapprox.store; --force recomputes); rerunning a finished
            command reuses its dataset unless the code, grid, parameters, seed or device changed (--force).
            A run whose grid or parameters differ from the preset is stored with preset = "custom" and the
            grid it ran."""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    default_preset = "default" if "default" in presets else presets[0]
    parser.add_argument("--preset", choices=presets, default=default_preset,
                        help=f"grid preset (default: {default_preset})")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--seeds", type=int, metavar="N", help="replace the seed axis by 0..N-1")
    parser.add_argument("--out", type=Path, help=f"dataset path (default {default_output(experiment)}, or "
                                                  f"results/{experiment.name}_<preset>.nc for another preset; "
                                                  f"with --only {default_output(experiment, True)})")
    parser.add_argument("--only", nargs="+", action="extend", metavar="AXIS=VALUE", default=[],
                        help="run only these values of an axis (repeat for several values or axes)")
    parser.add_argument("--set", nargs="+", action="extend", metavar="NAME=V[,V...]", default=[], dest="set",
                        help="replace an axis's values by any values (AXIS=v1,v2) or change a fixed parameter "
                             "(NAME=value); the dataset records the grid it ran")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="0: run in this process (default); N: a spawn process pool of N workers")
    parser.add_argument("--dask", action="store_true", help="with --workers N: a dask LocalCluster of N processes")
    parser.add_argument("--scheduler", metavar="ADDRESS", help="run cells on this dask.distributed scheduler")
    parser.add_argument("--force", "--no-resume", dest="resume", action="store_false",
                        help="recompute every cell: discard the progress of an interrupted run, and do not reuse "
                             "a finished dataset of the same command (rerunning one otherwise runs nothing)")
    parser.add_argument("--root-seed", type=int, default=0, metavar="S", help="root seed of every cell (default 0)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch threads per running cell (default: torch's choice; cores/workers in a pool)")
    parser.add_argument("--max-retries", type=int, default=2, metavar="K",
                        help="resubmissions of a cell lost with its worker (default 2)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the figure from the dataset at --out")
    parser.add_argument("--figure", type=Path,
                        help=f"figure path (default figures/{experiment.name}.png, or figures/{experiment.name}_"
                             "<preset>.png for another preset: no preset writes over another's figure; a slice or "
                             "custom run draws none unless given); the findings go beside it (.md), and the "
                             "provenance record (.deps.json)")
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


def _parse_set(experiment: Experiment, items: list[str], parser) -> tuple[dict, dict]:
    """``--set`` items → ``(axis -> values, parameter -> value)``."""
    axes: dict[str, list] = {}
    parameters: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name or not text:
            parser.error(f"--set expects NAME=VALUE or AXIS=V1,V2,..., got {item!r}")
        try:
            if name in experiment.axes:
                kind = axis_type(experiment.known_values(name))
                axes[name] = [parse_text(kind, part, f"--set {name}") for part in text.split(",")]
            elif name in experiment.parameters:
                kind = type(experiment.parameters[name].value)
                parameters[name] = parse_text(kind, text, f"--set {name}")
            else:
                parser.error(f"--set: {name!r} is neither an axis ({', '.join(experiment.axes)}) nor a fixed "
                             f"parameter ({', '.join(experiment.parameters) or 'none'})")
        except ValueError as exc:
            parser.error(str(exc))
    return axes, parameters


def run_cli(experiment: Experiment, argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run or plot, and exit with a clear message on errors."""
    parser = build_parser(experiment)
    args = parser.parse_args(argv)
    only = _parse_only(experiment, args.only, parser)
    set_axes, set_parameters = _parse_set(experiment, args.set, parser)
    custom = bool(set_axes or set_parameters)
    out = args.out or default_output(experiment, only, custom, args.preset)
    figure = args.figure or (None if only or custom else default_figure(experiment, args.preset))
    raw = sys.argv[1:] if argv is None else argv
    drawing = False
    try:
        if args.plot_only:
            if figure is None:
                parser.error("--plot-only with --only or --set needs --figure")
            ds = load(out)
            if experiment.summarise is not None and "stat_convention" not in ds.attrs:
                ds = summarise_dataset(experiment, ds)        # a dataset written before summaries existed
        else:
            ds = run(experiment, preset=args.preset, out=out, device=args.device, only=only or None,
                     workers=args.workers, resume=args.resume, seeds=args.seeds, root_seed=args.root_seed,
                     dask=args.dask, scheduler=args.scheduler, max_retries=args.max_retries, threads=args.threads,
                     progress=False if args.quiet else None, set_values=set_axes or None,
                     parameters=set_parameters or None,
                     history=f"python -m {experiment.module} " + " ".join(raw))
        drawing = True
        if figure is not None and (args.plot_only or args.draw):
            written = draw(experiment, ds, figure, source=str(out))
            print(f"{experiment.name}: {' and '.join(map(str, written))}", file=sys.stderr)
    except (ValueError, TypeError, FileNotFoundError, CellError, RuntimeError) as exc:
        print(f"error: {experiment.name}: {exc}", file=sys.stderr)
        raise SystemExit(2 if isinstance(exc, ValueError | TypeError | FileNotFoundError) else 1) from None
    except KeyboardInterrupt:          # run() has said how many cells are saved and how to resume
        if drawing:
            print(f"\n{experiment.name}: interrupted while drawing; the dataset {out} is written (--plot-only "
                  "draws the figure from it)", file=sys.stderr)
        raise SystemExit(130) from None
    return 0
