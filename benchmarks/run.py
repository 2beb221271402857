"""``python -m benchmarks.run``: kernapprox against its peers, measured side by side in one run.

Prints a table and stores it, with the targets and the run's provenance, as ``results/bench.nc``:

- exact attention (``ka.softmax_attention``) vs a bare SDPA call (n = 4k, 2 heads): the overhead of the wrapper;
- chunked linear attention vs ``torch`` SDPA (n = 4k, 16k, 64k; causal and not) and its cost exponent in n;
- the chunked mode under each state rule (sum, decay, delta, least squares) against n, and the delta rule's cost
  exponent (1k .. 32k);
- the decode step: ``RecurrentState.step`` vs one query over a KV cache, against the cache length;
- FAVOR+ vs performer-pytorch's ``FastAttention`` (same projection, same inputs; time and error);
- Nyström features vs scikit-learn's ``Nystroem`` (the default path; input std 0.15 and 1, m = 256 .. 1024; numpy's
  BLAS kernel named through threadpoolctl, ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` unset for the command);
- achieved FLOP/s of features + linear attention as a fraction of the GEMM rate measured in the same run;
- a causal training step (forward + backward) of chunked linear attention vs SDPA (n = 4k, 16k, 4 heads), with
  the eager autograd path beside it and the bytes each saves for its backward.
- decoding a real model: SmolLM2-135M converted to FAVOR+ (r = 64, all 30 layers) with its fixed-size state
  prefilled over 1k, 4k and 32k tokens of Shakespeare, against the same model's KV-cache decoding; the bytes of both
  caches and the prefill times (``lm_decode``; "not measured" with the reason when SmolLM2 is not installed).

A missing peer is reported as ``skipped``. ``--quick`` shrinks every size (seconds; used by the smoke test).
Timings on a shared machine are only as good as its load: the dataset records the load average and each row's
CPU utilisation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from kernapprox import backends
from kernapprox.attention import native
from kernapprox.estimators import fused
from kernapprox.io import atomic_write
from kernapprox.timing import gemm_rate, provenance

from . import roofline
from .cases import CASES, HEAD_DIM, LM_TARGET_CONVERSION, NUM_FEATURES, Config, Row, numpy_blas

TARGETS = (
    # name, description, threshold, sense ("<=" or ">=")
    ("exact_time_ratio_4k_causal", "ka.softmax_attention time / SDPA time at n = 4096, 2 heads, causal", 1.2, "<="),
    ("exact_time_ratio_4k_noncausal", "ka.softmax_attention time / SDPA time at n = 4096, 2 heads, non-causal", 1.2,
     "<="),
    ("chunked_exponent_causal", "causal chunked cost exponent in n (fitted slope of log t vs log n)", 1.15, "<="),
    ("chunked_exponent_noncausal", "non-causal chunked cost exponent in n", 1.15, "<="),
    ("delta_chunked_exponent", "causal chunked delta-rule (WY/UT) cost exponent in n, 1k .. 32k", 1.15, "<="),
    ("speedup_vs_sdpa_16k_causal", "SDPA time / chunked time at n = 16k, causal", 10.0, ">="),
    ("speedup_vs_sdpa_16k_noncausal", "SDPA time / chunked time at n = 16k, non-causal", 25.0, ">="),
    ("decode_step_growth", "decode step time at the largest cache / at the smallest (RecurrentState.step)", 1.2,
     "<="),
    ("speedup_vs_performer", "performer-pytorch time / ours (worst case over n and causality; equal features)",
     1.0, ">="),
    ("error_vs_performer", "our error / performer-pytorch's with eps=0 (same features; worst case; <= 1.05: equal)",
     1.05, "<="),
    ("speedup_vs_sklearn_nystroem", "scikit-learn Nystroem time / ours, default path (fit + features, n = 16k; "
     "worst of input std 0.15 and 1 x m = 256, 512, 1024; numpy on its own BLAS kernel)", 1.0, ">="),
    ("speedup_vs_sklearn_nystroem_20k", "scikit-learn Nystroem time / ours, default path (n = 20k, m = 512; worst of "
     "input std 0.15 and 1)", 1.0, ">="),
    ("error_vs_sklearn_nystroem", "our kernel error / scikit-learn Nystroem's (same data and m, worst row; <= 1.05: "
     "equal)", 1.05, "<="),
    ("training_speedup_vs_sdpa_16k", "SDPA time / ours for a causal training step (forward + backward), n = 16k, "
     "4 heads, r = 256", 10.0, ">="),
    ("training_speedup_vs_sdpa_4k", "SDPA time / ours for a causal training step (forward + backward), n = 4k, "
     "4 heads, r = 256", 2.5, ">="),
    ("gemm_fraction_noncausal", "features + non-causal linear attention FLOP/s / GEMM FLOP/s, largest n", 0.5,
     ">="),
    ("gemm_fraction_causal", "features + causal chunked linear attention FLOP/s / GEMM FLOP/s, largest n", 0.5,
     ">="),
    ("lm_decode_growth", "SmolLM2-135M converted to FAVOR+ (r = 64, all layers, one draw per layer): decode step with "
     "the state prefilled over 32k tokens / over 1k tokens", 1.1, "<="),
    ("lm_decode_speedup_vs_kv_32k", "SmolLM2-135M: the exact model's KV-cache decode step at 32k / the converted "
     "model's step at 32k (one draw per layer; the table shows one draw per key/value head too)", 4.0, ">="),
)

# The case each target is read from: where it is not measured, the reason comes from that case's rows.
TARGET_CASES = {
    "exact_time_ratio_4k_causal": "exact_vs_sdpa", "exact_time_ratio_4k_noncausal": "exact_vs_sdpa",
    "chunked_exponent_causal": "chunked_scaling", "chunked_exponent_noncausal": "chunked_scaling",
    "delta_chunked_exponent": "rule_scaling",
    "speedup_vs_sdpa_16k_causal": "chunked_vs_sdpa", "speedup_vs_sdpa_16k_noncausal": "chunked_vs_sdpa",
    "decode_step_growth": "decode_step",
    "speedup_vs_performer": "favor_vs_performer", "error_vs_performer": "favor_vs_performer",
    "speedup_vs_sklearn_nystroem": "nystrom_vs_sklearn", "speedup_vs_sklearn_nystroem_20k": "nystrom_vs_sklearn",
    "error_vs_sklearn_nystroem": "nystrom_vs_sklearn",
    "training_speedup_vs_sdpa_16k": "training_vs_sdpa", "training_speedup_vs_sdpa_4k": "training_vs_sdpa",
    "gemm_fraction_noncausal": "flop_rate", "gemm_fraction_causal": "flop_rate",
    "lm_decode_growth": "lm_decode", "lm_decode_speedup_vs_kv_32k": "lm_decode",
}


def _rows(rows: list[Row], case: str, status_ok: bool = True) -> list[Row]:
    return [r for r in rows if r.case == case and (not status_ok or r.status == "ok")]


def _slope(rows: list[Row]) -> float:
    if len(rows) < 2:
        return float("nan")
    n = np.log([r.n for r in rows])
    t = np.log([r.time_ours_s for r in rows])
    return float(np.polyfit(n, t, 1)[0])


def evaluate_targets(rows: list[Row]) -> dict[str, float]:
    """The value each target is judged on (NaN where the case did not run). A target named after a size is read
    only at that size: a ``--quick`` run (n = 512) leaves the 16k and 4k targets "not measured"."""
    values = {name: float("nan") for name, *_ in TARGETS}
    for r in _rows(rows, "exact_vs_sdpa"):
        if r.n == 4096:
            values[f"exact_time_ratio_4k_{'causal' if r.causal else 'noncausal'}"] = r.time_ours_s / r.time_peer_s
    scaling = _rows(rows, "chunked_scaling")
    values["chunked_exponent_causal"] = _slope([r for r in scaling if r.causal])
    values["chunked_exponent_noncausal"] = _slope([r for r in scaling if not r.causal])
    delta = [r for r in _rows(rows, "rule_scaling") if r.extra.get("rule") == "delta"]
    values["delta_chunked_exponent"] = _slope(delta)
    for r in _rows(rows, "chunked_vs_sdpa"):
        if r.n == 16384:
            values[f"speedup_vs_sdpa_16k_{'causal' if r.causal else 'noncausal'}"] = r.speedup
    decode = sorted(_rows(rows, "decode_step"), key=lambda r: r.n)
    if len(decode) >= 2:
        values["decode_step_growth"] = decode[-1].time_ours_s / decode[0].time_ours_s
    perf = _rows(rows, "favor_vs_performer")
    if perf:
        values["speedup_vs_performer"] = min(r.speedup for r in perf)
        same = [r for r in perf if r.extra.get("peer_eps", 0.0) == 0.0]     # equal features: equal error expected
        values["error_vs_performer"] = max((r.error_ours / r.error_peer for r in same), default=float("nan"))
    ny = _rows(rows, "nystrom_vs_sklearn")
    if any(r.n == 16384 for r in ny):
        values["speedup_vs_sklearn_nystroem"] = min(r.speedup for r in ny if r.n == 16384)
    if any(r.n == 20000 for r in ny):
        values["speedup_vs_sklearn_nystroem_20k"] = min(r.speedup for r in ny if r.n == 20000)
    if any(r.n >= 16384 for r in ny):
        values["error_vs_sklearn_nystroem"] = max(r.error_ours / r.error_peer for r in ny if r.n >= 16384)
    for r in _rows(rows, "training_vs_sdpa"):
        if r.n in (4096, 16384):
            values[f"training_speedup_vs_sdpa_{r.n // 1024}k"] = r.speedup
    flop = _rows(rows, "flop_rate")
    if flop:
        n_max = max(r.n for r in flop)
        for r in flop:
            if r.n == n_max and "features only" not in r.label:
                values[f"gemm_fraction_{'causal' if r.causal else 'noncausal'}"] = r.extra["fraction_of_gemm"]
    lm_steps = {r.n: r for r in _rows(rows, "lm_decode")
                if math.isfinite(r.time_ours_s) and r.extra.get("conversion") == LM_TARGET_CONVERSION}
    if 1024 in lm_steps and 32768 in lm_steps:
        values["lm_decode_growth"] = lm_steps[32768].time_ours_s / lm_steps[1024].time_ours_s
    if 32768 in lm_steps:
        values["lm_decode_speedup_vs_kv_32k"] = lm_steps[32768].speedup
    return values


def not_measured_reasons(rows: list[Row], values: dict[str, float]) -> dict[str, str]:
    """Why each target without a value (NaN in ``values``) was not measured: its case (:data:`TARGET_CASES`) did
    not run, or every row of it was skipped (the first row's status, e.g. ``skipped: SmolLM2-135M needs ...``), or
    it ran but not at the size the target reads (a ``--quick`` run). Measured targets map to ``""``."""
    reasons = {}
    for name, *_ in TARGETS:
        if math.isfinite(values.get(name, math.nan)):
            reasons[name] = ""
            continue
        case = TARGET_CASES.get(name)
        mine = _rows(rows, case, status_ok=False) if case else []
        if case is None:
            reasons[name] = ""
        elif not mine:
            reasons[name] = f"case {case} not run"
        elif all(r.status != "ok" for r in mine):
            reasons[name] = mine[0].status
        else:
            reasons[name] = f"no row of {case} at the sizes this target reads"
    return reasons


def target_bounds(rows: list[Row], cfg_chunk: int, heads: int) -> dict[str, tuple[float, float]]:
    """The best value each speed target could reach on this machine (:mod:`benchmarks.roofline`): ``(physical,
    shapes)`` — with every product at the square-GEMM rate, or at the rate measured for its shape; every ``exp`` at
    the measured rate. NaN where the case or the machine rates are missing."""
    rates = {r.label: r.extra["rate"] for r in _rows(rows, "machine")}
    bounds = {name: (float("nan"), float("nan")) for name, *_ in TARGETS}
    if not rates:
        return bounds

    def times(n, causal):
        work = roofline.chunked_work(n, heads, HEAD_DIM, NUM_FEATURES, HEAD_DIM, cfg_chunk, causal)
        lb = roofline.lower_bounds(work, rates)
        return lb["physical"], lb["shapes"]

    for r in _rows(rows, "chunked_vs_sdpa"):
        if r.n == 16384:
            phys, shapes = times(r.n, r.causal)
            bounds[f"speedup_vs_sdpa_16k_{'causal' if r.causal else 'noncausal'}"] = (r.time_peer_s / phys,
                                                                                       r.time_peer_s / shapes)
    for r in _rows(rows, "training_vs_sdpa"):
        if r.n in (4096, 16384):
            lb = roofline.lower_bounds(roofline.training_work(r.n, r.extra["heads"], HEAD_DIM, NUM_FEATURES, HEAD_DIM,
                                                              cfg_chunk), rates)
            bounds[f"training_speedup_vs_sdpa_{r.n // 1024}k"] = (r.time_peer_s / lb["physical"],
                                                                  r.time_peer_s / lb["shapes"])
    flop = _rows(rows, "flop_rate")
    if flop:
        n_max = max(r.n for r in flop)
        for r in flop:
            if r.n == n_max and "features only" not in r.label:
                phys, shapes = times(r.n, r.causal)
                g = rates["gemm 2048^2"]
                bounds[f"gemm_fraction_{'causal' if r.causal else 'noncausal'}"] = (r.flops / phys / g,
                                                                                     r.flops / shapes / g)
    return bounds


def _met(value: float, threshold: float, sense: str) -> int:
    """1 met, 0 missed, -1 not measured."""
    if not math.isfinite(value):
        return -1
    return int(value <= threshold if sense == "<=" else value >= threshold)


def to_dataset(rows: list[Row], targets: dict[str, float], attrs: dict,
               bounds: dict[str, tuple[float, float]] | None = None) -> xr.Dataset:
    labels = [f"{r.case}: {r.label}" for r in rows]
    coords = {"row": labels}

    def var(values, long_name, units, description):
        return xr.Variable("row", np.asarray(values), {"long_name": long_name, "units": units,
                                                      "description": description})

    data = {
        "case": var([r.case for r in rows], "benchmark case", "", "group of the row"),
        "seq_len": var([r.n for r in rows], "sequence length n", "tokens", "keys (and queries) per head"),
        "causal": var([int(r.causal) for r in rows], "causal", "1", "1 if causal"),
        "time_ours": var([r.time_ours_s for r in rows], "kernapprox time", "s", "median wall time after warm-up"),
        "time_peer": var([r.time_peer_s for r in rows], "peer time", "s", "median wall time of the peer, same run"),
        "speedup": var([r.speedup for r in rows], "peer time / kernapprox time", "1", "> 1: kernapprox is faster"),
        "error_ours": var([r.error_ours for r in rows], "kernapprox error", "1",
                          "relative RMS error of the output (Frobenius of the kernel matrix for Nyström) vs exact"),
        "error_peer": var([r.error_peer for r in rows], "peer error", "1", "same metric for the peer"),
        "flops": var([r.flops for r in rows], "counted work", "flop", "matrix-product flops of kernapprox's call"),
        "flops_per_s": var([r.flops / r.time_ours_s for r in rows], "achieved rate", "flop/s", "flops / time"),
        "reps": var([r.reps for r in rows], "timed repeats", "1", "calls behind the median"),
        "cpu_utilisation": var([r.cpu_utilisation for r in rows], "CPU utilisation", "1",
                               "process CPU time / (wall time x threads); well below 1 on CPU = a loaded machine"),
        "status": var([r.status for r in rows], "status", "", "ok or 'skipped: why'"),
        "extra": var([json.dumps(r.extra) for r in rows], "extra measurements", "", "JSON"),
    }
    names = [t[0] for t in TARGETS]
    notes = not_measured_reasons(rows, targets)
    tvar = {
        "target_value": ("target", [targets[n] for n in names], {"long_name": "measured value", "units": "1"}),
        "target_threshold": ("target", [t[2] for t in TARGETS], {"long_name": "threshold", "units": "1"}),
        "target_sense": ("target", [t[3] for t in TARGETS], {"long_name": "value must be <= or >= threshold"}),
        "target_met": ("target", [_met(targets[t[0]], t[2], t[3]) for t in TARGETS],
                       {"long_name": "target met", "units": "1", "description": "1 met, 0 missed, -1 not measured"}),
        "target_description": ("target", [t[1] for t in TARGETS], {"long_name": "what is measured"}),
        "target_note": ("target", [notes[t[0]] for t in TARGETS],
                        {"long_name": "why the target was not measured", "description": "'' when measured"}),
        "target_bound_physical": ("target", [(bounds or {}).get(t[0], (np.nan, np.nan))[0] for t in TARGETS],
                                  {"long_name": "roofline: best value at the square-GEMM rate", "units": "1",
                                   "description": "benchmarks.roofline, rates measured in this run (machine case)"}),
        "target_bound_shapes": ("target", [(bounds or {}).get(t[0], (np.nan, np.nan))[1] for t in TARGETS],
                                {"long_name": "roofline: best value at the measured rates of the product shapes",
                                 "units": "1"}),
    }
    ds = xr.Dataset({**data, **{k: xr.Variable(*v) for k, v in tvar.items()}},
                    coords={**coords, "target": names}, attrs=attrs)
    return ds


def write_dataset(ds: xr.Dataset, path: str) -> None:
    """Atomic, fsynced write (:func:`kernapprox.io.atomic_write`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(Path(path), lambda tmp: ds.to_netcdf(tmp, engine="h5netcdf"))


def format_table(rows: list[Row], targets: dict[str, float], bounds: dict | None = None) -> str:
    lines = [f"{'case':<20} {'row':<28} {'ours [s]':>10} {'peer [s]':>10} {'speedup':>8} {'err ours':>9} "
             f"{'err peer':>9} {'GFLOP/s':>8} {'cpu':>5}  note"]
    for r in rows:
        gf = r.flops / r.time_ours_s / 1e9 if math.isfinite(r.flops) else float("nan")
        note = r.status if r.status != "ok" else ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        lines.append(f"{r.case:<20} {r.label:<28} {r.time_ours_s:>10.4g} {r.time_peer_s:>10.4g} "
                     f"{r.speedup:>8.3g} {r.error_ours:>9.3g} {r.error_peer:>9.3g} {gf:>8.3g} "
                     f"{r.cpu_utilisation:>5.2f}  {note}")
    lines.append("")
    lines.append(f"{'target':<32} {'value':>9} {'need':>9} {'bound':>15}  result")
    notes = not_measured_reasons(rows, targets)
    for name, desc, thr, sense in TARGETS:
        val = targets[name]
        verdict = {1: "met", 0: "MISSED", -1: "not measured"}[_met(val, thr, sense)]
        if notes[name]:
            verdict += f" ({notes[name]})"
        phys, shapes = (bounds or {}).get(name, (math.nan, math.nan))
        bound = f"{phys:.3g}/{shapes:.3g}" if math.isfinite(phys) else ""
        lines.append(f"{name:<32} {val:>9.3g} {sense + format(thr, 'g'):>9} {bound:>15}  {verdict}  ({desc})")
    if bounds and any(math.isfinite(b[0]) for b in bounds.values()):
        lines.append("bound: roofline value physical/shapes (benchmarks.roofline: every product at the square-GEMM "
                     "rate / at its shape's measured rate, exp at its measured rate)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> xr.Dataset:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): a smoke test, not a measurement")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (auto: cuda if available)")
    parser.add_argument("--out", default="results/bench.nc", help="dataset path (default results/bench.nc)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="cases to run")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="chunk length of the chunked mode (default: 64, or the best of the chunk-size sweep "
                             "when it runs first)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed calls per measurement")
    parser.add_argument("--fused", choices=fused.MODES, default=None,
                        help="fused feature maps (kernapprox.estimators.fused): large (default: auto's rules without "
                             "its warm-up, so each case's untimed warm-up call compiles; the 'fusion' case times the "
                             "compilation), auto, on (every call), or off (the eager code; the default with --quick, "
                             "which must not spend seconds compiling)")
    parser.add_argument("--native", choices=backends.SWITCHES["native"].modes, default=None,
                        help="the compiled chunked operators (kernapprox.attention.native, KERNAPPROX_NATIVE): auto "
                             "(default: calls of at least native.MIN_ENTRIES feature entries), on, or off (the "
                             "default with --quick, which must not spend seconds building them)")
    args = parser.parse_args(argv)
    args.fused = args.fused or ("off" if args.quick else "large")
    args.native = args.native or ("off" if args.quick else "auto")
    with backends.mode("fused", args.fused), backends.mode("native", args.native):
        return _run(args, argv)


def _run(args, argv) -> xr.Dataset:

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 1.0)
    cfg = Config(device=device, quick=args.quick, budget_s=budget)
    t_start = time.perf_counter()
    attrs = provenance(device)
    blas = numpy_blas()
    attrs["numpy_blas"] = json.dumps(blas)
    attrs["openblas_env_unset"] = os.environ.get(UNSET_MARK, "{}")
    cfg.gemm_flops_per_s = gemm_rate(device, size=512 if args.quick else 2048, budget_s=budget)
    print(f"device {attrs['device_name']}, {attrs['torch_num_threads']} threads, load average "
          f"{attrs['load_average_1min_at_start']:.2f}; float32 GEMM {cfg.gemm_flops_per_s / 1e9:.1f} GFLOP/s",
          flush=True)
    print(f"numpy BLAS: {blas.get('internal_api')}, kernel {blas.get('architecture')}, {blas.get('num_threads')} "
          f"threads, version {blas.get('version')} (threadpoolctl); unset for this run: "
          f"{attrs['openblas_env_unset']}", flush=True)
    if device.type == "cpu" and attrs["load_average_1min_at_start"] > 0.5 * (os.cpu_count() or 1):
        print("warning: the machine is busy (load average above half the CPUs): timings measure the contention "
              "as much as the code; the 'cpu' column shows the share of the requested cores the run got", flush=True)

    rows: list[Row] = []
    order = sorted(args.cases, key=lambda c: c != "chunk_size")        # tune the chunk length first
    for name in order:
        t0 = time.perf_counter()
        if args.chunk_size is not None:
            cfg.chunk_size = args.chunk_size
        new = CASES[name](cfg)
        rows.extend(new)
        if name == "chunk_size" and args.chunk_size is None and new:
            cfg.chunk_size = int(min(new, key=lambda r: r.time_ours_s).extra["chunk_size"])
        print(f"  {name}: {len(new)} rows in {time.perf_counter() - t0:.1f} s", flush=True)

    targets = evaluate_targets(rows)
    bounds = target_bounds(rows, cfg.chunk_size, cfg.heads)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    attrs.update({
        "title": "kernapprox benchmarks against peers (one run, side by side)",
        "quick": int(args.quick),
        "gemm_flops_per_s": cfg.gemm_flops_per_s,
        "chunk_size": cfg.chunk_size,
        "heads": cfg.heads, "head_dim": HEAD_DIM, "num_features": NUM_FEATURES,
        "load_average_1min_at_end": float(load_end),
        "fused_mode": args.fused,
        "native_mode": args.native,
        "fused_status": json.dumps(fused.status()),
        "native_status": native.status(),
        "wall_time_s": time.perf_counter() - t_start,
        "history": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
    })
    ds = to_dataset(rows, targets, attrs, bounds)
    print(format_table(rows, targets, bounds))
    write_dataset(ds, args.out)
    print(f"wrote {args.out} ({attrs['wall_time_s']:.0f} s)")
    return ds


# Environment variables that pin OpenBLAS to another kernel or cache size than the one it detects (set on some of
# the project's machines): the command runs without them, so that scikit-learn's numpy runs on its best kernel.
# OpenBLAS reads them when it loads, so the command starts itself again without them (the tests, which call
# ``main`` in their own process, are not affected).
PEER_BLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
UNSET_MARK = "KERNAPPROX_BENCH_UNSET"


def restart_without_blas_overrides(argv: list[str]) -> None:
    """Replace this process by ``python -m benchmarks.run argv`` without :data:`PEER_BLAS_OVERRIDES` (recorded in
    ``UNSET_MARK`` for the dataset); returns when none is set."""
    present = {k: os.environ[k] for k in PEER_BLAS_OVERRIDES if k in os.environ}
    if not present:
        return
    env = {k: v for k, v in os.environ.items() if k not in PEER_BLAS_OVERRIDES}
    env[UNSET_MARK] = json.dumps(present)
    print(f"restarting without {', '.join(present)} (numpy's BLAS on the kernel it detects)", flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.run", *argv], env)


if __name__ == "__main__":
    restart_without_blas_overrides(sys.argv[1:])
    main()
