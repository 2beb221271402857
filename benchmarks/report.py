"""``python -m benchmarks.report results/bench.nc``: the targets table of a benchmark run, as Markdown.

Every number of the table is read from the dataset written by :mod:`benchmarks.run` (``target_*`` variables and the
run's provenance attributes); nothing is typed. ``make bench`` writes it to ``benchmarks/RESULTS.md``, which the
documentation's performance page includes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import xarray as xr

VERDICT = {1: "met", 0: "**missed**", -1: "not measured"}


def _fmt(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.3g}"


def markdown_table(ds: xr.Dataset) -> str:
    """The targets of one benchmark run (value, threshold, roofline bounds, verdict) and its machine state."""
    a = ds.attrs
    torch_version = json.loads(a.get("package_versions", "{}")).get("torch", "?")
    lines = [
        f"Run of `{a.get('history', 'python -m benchmarks.run')}` at git revision `{a.get('git_revision', '?')}`: "
        f"{a.get('device_name', '?')}, {a.get('torch_num_threads', '?')} torch threads, torch "
        f"{torch_version}, fused feature maps `{a.get('fused_mode', '?')}`, chunk length "
        f"{a.get('chunk_size', '?')}; float32 GEMM rate {float(a.get('gemm_flops_per_s', math.nan)) / 1e9:.1f} "
        f"GFLOP/s; 1-minute load average {float(a.get('load_average_1min_at_start', math.nan)):.2f} at the start, "
        f"{float(a.get('load_average_1min_at_end', math.nan)):.2f} at the end; CPU utilisation of the timed rows "
        f"{_fmt(float(ds['cpu_utilisation'].min()))}–{_fmt(float(ds['cpu_utilisation'].max()))}; "
        f"{float(a.get('wall_time_s', math.nan)):.0f} s in all.",
        "",
        "| target | measured | needed | roofline bound (square GEMM / shapes) | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in ds["target"].values:
        t = ds.sel(target=name)
        phys, shapes = float(t["target_bound_physical"]), float(t["target_bound_shapes"])
        bound = f"{_fmt(phys)} / {_fmt(shapes)}" if math.isfinite(phys) else ""
        lines.append(f"| {str(t['target_description'].values)} (`{name}`) | {_fmt(float(t['target_value']))} | "
                     f"{str(t['target_sense'].values)} {float(t['target_threshold']):g} | {bound} | "
                     f"{VERDICT[int(t['target_met'])]} |")
    if int(a.get("quick", 0)):
        lines += ["", "This is a `--quick` run (tiny sizes): a smoke test, not a measurement."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", default="results/bench.nc", help="a benchmarks.run dataset")
    parser.add_argument("--out", default=None, help="write here (default: print)")
    args = parser.parse_args(argv)
    with xr.open_dataset(args.dataset, engine="h5netcdf") as ds:
        text = markdown_table(ds.load())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return text


if __name__ == "__main__":
    main()
