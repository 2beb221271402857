"""Smoke tests of the benchmark harness and the ``modes`` experiment: they run, they record what they claim, and
their summaries compute what they say. Performance itself is measured by ``make bench``, never asserted here."""

import json
import math

import numpy as np
import pytest
import torch
import xarray as xr

from benchmarks import run as bench_run
from benchmarks.cases import Row
from experiments import modes
from kernapprox.timing import linear_attention_flops, measure, sdpa_flops


def test_quick_run_writes_table_and_targets(tmp_path):
    out = tmp_path / "bench.nc"
    bench_run.main(["--quick", "--device", "cpu", "--out", str(out), "--budget", "0",
                    "--cases", "chunked_vs_sdpa", "decode_step", "flop_rate", "favor_vs_performer"])
    ds = xr.open_dataset(out, engine="h5netcdf")
    assert set(ds["case"].values) == {"chunked_vs_sdpa", "decode_step", "flop_rate", "favor_vs_performer"}
    ok = ds["status"].values == "ok"
    assert np.all(ds["time_ours"].values[ok] > 0)
    sdpa = ds["case"].values == "chunked_vs_sdpa"
    assert np.all(ds["time_peer"].values[sdpa] > 0) and sdpa.sum() == 4
    np.testing.assert_allclose(ds["speedup"].values[sdpa], ds["time_peer"].values[sdpa] / ds["time_ours"].values[sdpa])
    perf = ds["case"].values == "favor_vs_performer"
    statuses = set(ds["status"].values[perf])
    assert statuses == {"ok"} or all(s.startswith("skipped") for s in statuses)
    if statuses == {"ok"}:  # same projection, same inputs, eps=0: the two errors are those of one estimator
        same = perf & np.array([json.loads(e).get("peer_eps") == 0.0 for e in ds["extra"].values])
        assert same.sum() == 2
        err_ours, err_peer = ds["error_ours"].values[same], ds["error_peer"].values[same]
        assert np.all(np.isfinite(err_ours)) and np.all(np.abs(err_ours / err_peer - 1) < 1e-3)
    assert list(ds["target"].values) == [t[0] for t in bench_run.TARGETS]
    met = dict(zip(ds["target"].values, ds["target_met"].values))
    assert met["speedup_vs_sklearn_nystroem"] == -1                  # not run: "not measured", never "met"
    assert met["decode_step_growth"] in (0, 1)
    assert ds.attrs["gemm_flops_per_s"] > 0 and ds.attrs["torch_num_threads"] == 1
    assert "package_versions" in ds.attrs and ds.attrs["quick"] == 1
    ds.close()


def test_quick_run_never_labels_small_sizes_as_the_16k_targets(tmp_path, capsys):
    """--quick measures n = 512 (SDPA) and 512 (exact): the targets named after 16k and 4k are "not measured",
    never "MISSED" on numbers from another size; the exact-attention rows compare ka.softmax_attention with SDPA."""
    out = tmp_path / "bench.nc"
    ds = bench_run.main(["--quick", "--device", "cpu", "--out", str(out), "--budget", "0",
                         "--cases", "chunked_vs_sdpa", "exact_vs_sdpa"])
    table = capsys.readouterr().out
    met = dict(zip(ds["target"].values, ds["target_met"].values))
    for name in ("speedup_vs_sdpa_16k_causal", "speedup_vs_sdpa_16k_noncausal", "exact_time_ratio_4k_causal",
                 "exact_time_ratio_4k_noncausal"):
        assert met[name] == -1
        line = next(x for x in table.splitlines() if x.startswith(name))
        assert "not measured" in line and "MISSED" not in line
    exact = ds["case"].values == "exact_vs_sdpa"
    assert exact.sum() == 2 and np.all(ds["time_peer"].values[exact] > 0)
    assert np.all(ds["error_ours"].values[exact] < 1e-5)                 # it is SDPA
    rows = [_row("chunked_vs_sdpa", 512, 0.1, causal=True, time_peer_s=2.0),
            _row("exact_vs_sdpa", 4096, 1.1, causal=True, time_peer_s=1.0)]
    values = bench_run.evaluate_targets(rows)
    assert math.isnan(values["speedup_vs_sdpa_16k_causal"])
    assert values["exact_time_ratio_4k_causal"] == pytest.approx(1.1)


def _row(case, n, t, causal=False, **kw):
    return Row(case, f"n={n}", n, causal, t, **kw)


def test_targets_from_synthetic_rows():
    rows = [_row("chunked_scaling", n, 1e-6 * n**1.1, causal=True) for n in (1024, 4096, 16384)]
    rows += [_row("chunked_scaling", n, 1e-9 * n**2) for n in (1024, 4096)]
    rows += [_row("chunked_vs_sdpa", 16384, 0.1, causal=True, time_peer_s=2.0),
             _row("chunked_vs_sdpa", 16384, 0.5, time_peer_s=2.0)]
    rows += [_row("decode_step", 1024, 1e-4), _row("decode_step", 65536, 1.5e-4)]
    rows += [_row("favor_vs_performer", 4096, 1.0, time_peer_s=2.0, error_ours=0.1, error_peer=0.1,
                  extra={"peer_eps": 0.0}),
             _row("favor_vs_performer", 16384, 1.0, time_peer_s=0.8, error_ours=0.1, error_peer=0.05,
                  extra={"peer_eps": 1e-4})]
    rows += [Row("nystrom_vs_sklearn", "x", 0, status="skipped: absent")]
    values = bench_run.evaluate_targets(rows)
    assert values["chunked_exponent_causal"] == pytest.approx(1.1)
    assert values["chunked_exponent_noncausal"] == pytest.approx(2.0)
    assert values["speedup_vs_sdpa_16k_causal"] == pytest.approx(20.0)
    assert values["speedup_vs_sdpa_16k_noncausal"] == pytest.approx(4.0)
    assert values["decode_step_growth"] == pytest.approx(1.5)
    assert values["speedup_vs_performer"] == pytest.approx(0.8)      # the worst row decides
    assert values["error_vs_performer"] == pytest.approx(1.0)
    assert math.isnan(values["speedup_vs_sklearn_nystroem"])
    assert bench_run._met(values["chunked_exponent_causal"], 1.15, "<=") == 1
    assert bench_run._met(values["decode_step_growth"], 1.2, "<=") == 0
    assert bench_run._met(float("nan"), 1.0, ">=") == -1


def test_nystrom_targets_take_the_worst_row():
    """The scikit-learn targets: the slowest (std, m) row at n = 16k, the slowest at n = 20k, the worst error
    ratio; each printed met or MISSED against >= 1 / <= 1.05."""
    rows = [_row("nystrom_vs_sklearn", 16384, 1.0, time_peer_s=peer, error_ours=0.1, error_peer=0.1)
            for peer in (1.5, 1.1, 2.0)]
    rows += [_row("nystrom_vs_sklearn", 20000, 1.0, time_peer_s=0.9, error_ours=0.11, error_peer=0.1),
             _row("nystrom_vs_sklearn", 20000, 1.0, time_peer_s=1.3, error_ours=0.1, error_peer=0.1)]
    values = bench_run.evaluate_targets(rows)
    assert values["speedup_vs_sklearn_nystroem"] == pytest.approx(1.1)
    assert values["speedup_vs_sklearn_nystroem_20k"] == pytest.approx(0.9)
    assert values["error_vs_sklearn_nystroem"] == pytest.approx(1.1)
    table = bench_run.format_table(rows, values)
    line = next(x for x in table.splitlines() if x.startswith("speedup_vs_sklearn_nystroem "))
    assert "met" in line and ">=1" in line
    assert "MISSED" in next(x for x in table.splitlines() if x.startswith("speedup_vs_sklearn_nystroem_20k"))


def test_benchmark_command_unsets_the_blas_overrides(monkeypatch):
    """``python -m benchmarks.run`` restarts itself without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (recorded for
    the dataset); without them it carries on; numpy's BLAS is named through threadpoolctl."""
    from benchmarks.cases import numpy_blas

    calls = []
    monkeypatch.setattr(bench_run.os, "execve", lambda *args: calls.append(args))
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)
    bench_run.restart_without_blas_overrides(["--quick"])
    assert calls == []
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1048576")
    bench_run.restart_without_blas_overrides(["--quick"])
    (executable, argv, env), = calls
    assert argv[1:] == ["-m", "benchmarks.run", "--quick"]
    assert "OPENBLAS_CORETYPE" not in env and "OPENBLAS_L2_SIZE" not in env
    assert json.loads(env[bench_run.UNSET_MARK]) == {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}
    info = numpy_blas()
    assert info["internal_api"] and "num_threads" in info


def test_measure_counts_repeats_and_flop_models():
    calls = []
    t = measure(lambda: calls.append(1), torch.device("cpu"), min_reps=4, max_reps=4, budget_s=0.0, warmup=2)
    assert len(calls) == 6 and t.reps == 4 and 0 <= t.min_s <= t.median_s <= t.max_s
    with pytest.raises(ValueError, match="min_reps"):
        measure(lambda: None, torch.device("cpu"), min_reps=0)
    assert sdpa_flops(8, 8, 4, 4, causal=True) == sdpa_flops(8, 8, 4, 4, causal=False) / 2 == 2 * 64 * 8 / 2
    assert linear_attention_flops(10, 4, 3, causal=False) == 4 * 10 * 4 * 4
    assert linear_attention_flops(10, 4, 3, causal=True, chunk_size=2) == 4 * 10 * 4 * 4 + 10 * 2 * 8


def test_modes_smoke_run_and_plot(tmp_path):
    from kernapprox.sweep import run

    ds = run(modes.EXPERIMENT, preset="smoke", out=tmp_path / "modes.nc", device="cpu")
    t = ds["time_s"]
    assert np.all(t.sel(computation=[m for m in modes.METHODS if m != "linear_parallel"]).values > 0)
    carried = ds["carried_bytes"].squeeze("budget_s", drop=True)
    lin = carried.sel(computation="linear_decode").values
    kv = carried.sel(computation="exact_decode").values
    assert lin[0] == lin[-1] == 4 * modes.HEADS * modes.NUM_FEATURES * (modes.HEAD_DIM + 1)
    np.testing.assert_allclose(kv / ds["seq_len"].values, 2 * modes.HEADS * modes.HEAD_DIM * 4)
    dev = ds["max_abs_deviation"].sel(computation=["linear_parallel", "linear_recurrent", "linear_chunked",
                                                    "linear_decode", "exact_decode"])
    assert np.nanmax(dev.values) < 1e-4 and np.isfinite(dev.values).all()  # float32 agreement of the modes
    assert ds["peak_measured"].values.max() == 0                      # CPU: analytic peak
    modes.EXPERIMENT.plot(ds, tmp_path / "modes.png")
    assert (tmp_path / "modes.png").stat().st_size > 0


def test_modes_summary_helpers():
    n = np.array([1024, 2048, 4096, 8192])
    assert modes.fitted_slope(n, 3e-9 * n**2.0) == pytest.approx(2.0)
    assert modes.fitted_slope(n, np.array([np.nan, 1.0, 2.0, 4.0])) == pytest.approx(1.0)
    exact, linear = 1e-8 * n**2.0, 1e-4 * n                           # equal at n = 10^4 ... beyond the grid
    assert math.isnan(modes.crossover(n, exact, linear))
    linear = 1e-5 * n                                                 # equal at n = 1000 < n[0]: always faster
    assert modes.crossover(n, exact, linear) == 1024
    linear = 4e-5 * n                                                 # equal at n = 4000, between 2048 and 4096
    assert modes.crossover(n, exact, linear) == pytest.approx(4000, rel=1e-9)
    assert modes.analytic_peak_bytes("linear_parallel", 4096) > modes.analytic_peak_bytes("linear_chunked", 4096)
    assert modes.carried_bytes("linear_decode", 10) == modes.carried_bytes("linear_decode", 10**6)


def test_report_table_is_read_from_the_dataset(tmp_path):
    """benchmarks.report writes one row per target with the dataset's value and verdict, and the run's machine state."""
    from benchmarks import report

    out = tmp_path / "bench.nc"
    ds = bench_run.main(["--quick", "--device", "cpu", "--out", str(out), "--budget", "0",
                         "--cases", "decode_step"])
    text = report.main([str(out), "--out", str(tmp_path / "RESULTS.md")])
    assert (tmp_path / "RESULTS.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == len(bench_run.TARGETS)
    growth = next(line for line in rows if "`decode_step_growth`" in line)
    value = float(ds["target_value"].sel(target="decode_step_growth"))
    assert f"| {value:.3g} |" in growth
    assert ("| met |" in growth) == (int(ds["target_met"].sel(target="decode_step_growth")) == 1)
    assert "not measured" in next(line for line in rows if "`speedup_vs_sdpa_16k_causal`" in line)
    assert "load average" in text and "--quick" in text
