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


def _native(attrs) -> str:
    """The compiled chunked kernels' state in the run (runs before it was recorded say nothing)."""
    status = attrs.get("native_status")
    if status is None:
        return ""
    return ", chunked kernels (causal, non-causal) " + ("compiled" if status.startswith("loaded") else f"`{status}`")


def _blas(attrs) -> str:
    """numpy's BLAS in the run (threadpoolctl) and the OpenBLAS overrides the command unset (runs before they
    were recorded say nothing)."""
    if "numpy_blas" not in attrs:
        return ""
    blas = json.loads(attrs["numpy_blas"])
    unset = json.loads(attrs.get("openblas_env_unset", "{}"))
    return (f" numpy's BLAS (scikit-learn's): {blas.get('internal_api')}, kernel {blas.get('architecture')}, "
            f"{blas.get('num_threads')} threads (threadpoolctl); "
            + (f"unset for the run: {', '.join(f'{k}={v}' for k, v in unset.items())}." if unset else
               "no OpenBLAS override was set."))


def _fmt(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.3g}"


def markdown_table(ds: xr.Dataset) -> str:
    """The targets of one benchmark run (value, threshold, roofline bounds, verdict) and its machine state."""
    a = ds.attrs
    torch_version = json.loads(a.get("package_versions", "{}")).get("torch", "?")
    lines = [
        f"Run of `{a.get('history', 'python -m benchmarks.run')}` at git revision `{a.get('git_revision', '?')}`: "
        f"{a.get('device_name', '?')}, {a.get('torch_num_threads', '?')} torch threads, torch "
        f"{torch_version}, fused feature maps `{a.get('fused_mode', '?')}`{_native(a)}, chunk length "
        f"{a.get('chunk_size', '?')}; float32 GEMM rate {float(a.get('gemm_flops_per_s', math.nan)) / 1e9:.1f} "
        f"GFLOP/s; 1-minute load average {float(a.get('load_average_1min_at_start', math.nan)):.2f} at the start, "
        f"{float(a.get('load_average_1min_at_end', math.nan)):.2f} at the end; CPU utilisation of the timed rows "
        f"{_fmt(float(ds['cpu_utilisation'].min()))}–{_fmt(float(ds['cpu_utilisation'].max()))}; "
        f"{float(a.get('wall_time_s', math.nan)):.0f} s in all.{_blas(a)}",
        "",
        "| target | measured | needed | roofline bound (square GEMM / shapes) | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in ds["target"].values:
        t = ds.sel(target=name)
        phys, shapes = float(t["target_bound_physical"]), float(t["target_bound_shapes"])
        bound = f"{_fmt(phys)} / {_fmt(shapes)}" if math.isfinite(phys) else ""
        verdict = VERDICT[int(t['target_met'])]
        note = str(t["target_note"].values) if "target_note" in t else ""      # runs before it was recorded: none
        if note:
            verdict += f" ({note})"
        lines.append(f"| {str(t['target_description'].values)} (`{name}`) | {_fmt(float(t['target_value']))} | "
                     f"{str(t['target_sense'].values)} {float(t['target_threshold']):g} | {bound} | {verdict} |")
    lines += _rows_table(ds, "chunked_vs_sdpa", "Chunked linear attention against SDPA (same inputs)",
                         [("n", "seq_len", "d"), ("causal", "causal", "d"), ("chunked [s]", "time_ours", "g"),
                          ("SDPA [s]", "time_peer", "g"), ("speed-up", "speedup", "g")])
    lines += _rows_table(ds, "decode_step", "Decode step: recurrent state against one query over a KV cache",
                         [("cache n", "seq_len", "d"), ("state step [s]", "time_ours", "g"),
                          ("KV-cache step [s]", "time_peer", "g"), ("ratio", "speedup", "g")])
    lines += _rows_table(ds, "flop_rate", "Achieved rate of features + linear attention",
                         [("row", None, "s"), ("time [s]", "time_ours", "g"), ("GFLOP/s", "flops_per_s", "G"),
                          ("of the GEMM rate", "extra:fraction_of_gemm", "g")])
    lines += _rows_table(ds, "nystrom_vs_sklearn", "Nyström features against scikit-learn's Nystroem",
                         [("row", None, "s"), ("ours [s]", "time_ours", "g"), ("Nystroem [s]", "time_peer", "g"),
                          ("speed-up", "speedup", "g"), ("error ours", "error_ours", "g"),
                          ("error Nystroem", "error_peer", "g"), ("feature dtype", "extra:feature_dtype", "s"),
                          ("computed as", "extra:plan", "s"), ("features vs float64", "extra:features_vs_float64", "g"),
                          ("Nystroem's BLAS", "extra:peer_blas", "s")])
    lines += _rows_table(ds, "fusion", "Fused (compiled) against eager feature maps, one call, and the compilation",
                         [("row", None, "s"), ("fused [s]", "time_ours", "g"), ("eager [s]", "time_peer", "g"),
                          ("speed-up", "speedup", "g"), ("compile cold [s]", "extra:compile_cold_s", "g"),
                          ("compile warm [s]", "extra:compile_warm_s", "g"),
                          ("break-even entries", "extra:break_even_entries", "g")])
    lines += _rows_table(ds, "lm_decode", "Decoding SmolLM2-135M: converted to FAVOR+ (r = 64, all 30 layers, float32 "
                         "states prefilled over the context's tokens of Shakespeare; drawn once per layer, or once "
                         "per key/value head) against the exact model's KV cache; prefill of the same tokens "
                         "(converted: calls of at most 4k tokens up to the context; exact: one SDPA call; – where not "
                         "measured)",
                         [("row", None, "s"), ("converted step [s]", "time_ours", "g"),
                          ("exact KV-cache step [s]", "time_peer", "g"), ("ratio", "speedup", "g"),
                          ("state", "extra:state_bytes", "B"), ("KV cache", "extra:kv_cache_bytes", "B"),
                          ("converted prefill [s]", "extra:prefill_s", "g"),
                          ("exact prefill [s]", "extra:exact_prefill_s", "g"),
                          ("converted prefill [ms/token]", "extra:prefill_s_per_token", "m")])
    if int(a.get("quick", 0)):
        lines += ["", "This is a `--quick` run (tiny sizes): a smoke test, not a measurement."]
    return "\n".join(lines) + "\n"


def _cell(value, fmt: str) -> str:
    if fmt == "s":
        return str(value)
    if fmt == "d":
        return str(int(value))
    value = float(value)
    if fmt == "B":                                                    # bytes, in MB
        return "–" if not math.isfinite(value) else f"{value / 1e6:.3g} MB"
    if fmt == "m":                                                    # seconds, in ms
        return _fmt(value * 1e3)
    return _fmt(value / 1e9) if fmt == "G" else _fmt(value)


def _rows_table(ds: xr.Dataset, case: str, title: str, columns) -> list[str]:
    """The rows of one benchmark case (status ok) as a Markdown table; ``columns``: (header, variable or
    ``extra:key`` or None for the row's label, format)."""
    rows = [i for i, (c, st) in enumerate(zip(ds["case"].values, ds["status"].values)) if c == case and st == "ok"]
    if not rows:
        return []
    out = ["", f"**{title}** (`{case}`)", "", "| " + " | ".join(h for h, _, _ in columns) + " |",
           "|" + "---|" * len(columns)]
    for i in rows:
        extra = json.loads(str(ds["extra"].values[i]))
        cells = []
        for _, var, fmt in columns:
            if var is None:
                value = str(ds["row"].values[i]).split(": ", 1)[-1]
            elif var.startswith("extra:"):
                value = extra.get(var.removeprefix("extra:"), math.nan)
            else:
                value = ds[var].values[i]
            cells.append(_cell(value, fmt))
        out.append("| " + " | ".join(cells) + " |")
    return out


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
