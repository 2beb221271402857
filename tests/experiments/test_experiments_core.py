"""The kernel_error, variance_theory and attention_error studies: smoke presets produce valid datasets (paired
data, a reference without the estimator axis, summaries with intervals) and figures, and each study's arithmetic
is checked on cases with known answers."""

import json

import numpy as np
import pytest
import torch
from matplotlib import image
from PIL import Image

import kernapprox as ka
from experiments import attention_error, kernel_error, variance_theory
from kernapprox import sweep
from kernapprox.distributions import make_distribution

STUDIES = {"kernel_error": kernel_error, "variance_theory": variance_theory, "attention_error": attention_error}


@pytest.fixture
def smoke(smoke_run):
    return smoke_run


@pytest.mark.parametrize("name", list(STUDIES))
def test_smoke_dataset_is_complete_and_described(smoke, name):
    module, ds, folder = smoke(name)
    exp = module.EXPERIMENT
    assert list(ds[next(iter(exp.metrics))].dims)[:len(exp.axes)] == exp.axes
    assert json.loads(ds.attrs["grid"]) == exp.grid("smoke") and ds.attrs["preset"] == "smoke"
    for metric_name, metric in exp.metrics.items():
        assert ds[metric_name].attrs["long_name"] == metric.long_name
        assert ds[metric_name].attrs["units"] == metric.units
    for name, metric in exp.reference.metrics.items():                 # once per data draw, no estimator axis
        assert "estimator" not in ds[name].dims and "num_features" not in ds[name].dims
        assert ds[name].attrs["long_name"] == metric.long_name
    for coord in ds.coords.values():
        if coord.name in exp.axes or coord.name in exp.parameters:
            assert coord.attrs.get("long_name") and coord.attrs.get("units"), coord.name
    assert bool(ds["cell_seconds"].notnull().all()) and ds.attrs["summaries"] and ds.attrs["stat_convention"]
    assert sweep.load(folder / "x.nc").equals(ds)


@pytest.mark.parametrize("name", list(STUDIES))
def test_smoke_figure_is_written_with_its_caption(smoke, name):
    module, ds, folder = smoke(name)
    path = folder / "x.png"
    module.EXPERIMENT.plot(ds, path)
    pixels = image.imread(path)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600 and pixels.std() > 0.01     # not blank
    description = Image.open(path).info["Description"]
    assert len(description) > 80 and ("median" in description or "mean" in description)
    assert "95 %" in description                                       # intervals are drawn and named


def _rngs(seed=0):
    return np.random.default_rng(seed), np.random.default_rng(seed + 1)


# ---------------------------------------------------------------------------------------------- kernel_error
def test_kernel_error_grid_holds_consistent_estimators_only():
    names = kernel_error.ESTIMATORS
    assert {"trig", "positive", "hyperbolic_orthogonal"} <= set(names)
    assert "exact" not in names and "positive_regularized" not in names and "trig_sorf" not in names


KERNEL_PARAMS = {"num_features": 8, "beta": 2.0, "seq_len": 32, "seed": 0, "dim": 32, "all_estimators_max_len": 1024}


def test_kernel_error_is_zero_for_the_exact_kernel():
    rng, data_rng = _rngs()
    data = kernel_error.draw(KERNEL_PARAMS, data_rng, torch.device("cpu"))     # the engine's draw of the cell's data
    out = kernel_error.run_cell({"estimator": "exact", **KERNEL_PARAMS}, rng, torch.device("cpu"), data)
    assert out["kernel_rel_fro"] == 0.0 and out["kernel_max_rel"] == 0.0
    ref = kernel_error.run_reference(KERNEL_PARAMS, torch.device("cpu"), data)
    assert 1.5 < ref["beta_eff"] < 2.5 and ref["kernel_sv"][0] == 1.0


def test_kernel_error_blockwise_equals_the_dense_metric(monkeypatch):
    """Row blocks of the query side give the dense relative Frobenius error and largest relative entry error."""
    q, k = kernel_error.draw({**KERNEL_PARAMS, "seq_len": 300}, np.random.default_rng(2), torch.device("cpu"))
    est = ka.make_estimator("positive", num_features=16, rng=0).fit(q, k)
    approx, exact = est.kernel_matrix(q, k), ka.kernel_matrix(q, k)
    blocks = kernel_error.row_blocks(300, 300, entries=300 * 7)            # 43 blocks, the last one short
    assert len(blocks) == 43
    from experiments import _common

    monkeypatch.setattr(_common, "BLOCK_ENTRIES", 300 * 7)
    assert len(_common.row_blocks(300, 300)) == 43
    fro, worst = kernel_error.kernel_errors(est, q, k)
    assert fro == pytest.approx(ka.metrics.relative_frobenius_error(approx, exact).item(), rel=1e-12)
    assert worst == pytest.approx(ka.metrics.max_relative_entry_error(approx, exact).item(), rel=1e-12)


def test_kernel_svd_reference_is_below_every_rank_r_estimator(smoke):
    """Eckart–Young: no rank-r matrix has a smaller Frobenius error than the kernel SVD computed from the
    reference's singular values, on the same draws."""
    _, ds, _ = smoke("kernel_error")
    err, svd = ds["kernel_rel_fro"], ds["kernel_svd_rel_fro"]
    assert bool(svd.notnull().all())
    for name in ds.estimator.values:
        assert bool((err.sel(estimator=name) >= svd * (1 - 1e-9)).all()), name


def test_kernel_error_paired_ratios_use_the_same_draws(smoke):
    _, ds, _ = smoke("kernel_error")
    ratio = ds["kernel_rel_fro_vs_baseline"]
    np.testing.assert_allclose(ratio.sel(estimator="positive"),
                               ds["kernel_rel_fro"].sel(estimator="positive")
                               / ds["kernel_rel_fro"].sel(estimator="positive_orthogonal"))
    s = ds["sampler_ratio"].sel(estimator="positive_orthogonal")
    np.testing.assert_allclose(s, ds["kernel_rel_fro"].sel(estimator="positive_orthogonal")
                               / ds["kernel_rel_fro"].sel(estimator="positive"))


# ------------------------------------------------------------------------------------------- variance_theory
@pytest.mark.parametrize("a, b", [(0.5, 1.5), (2.0, 0.25)])
def test_pairs_have_the_prescribed_norms(a, b):
    x, y = variance_theory.pair_with_norms(a, b, 16, np.random.default_rng(3))
    assert np.isclose(np.linalg.norm(x + y), a) and np.isclose(np.linalg.norm(x - y), b)
    assert np.isclose(np.linalg.norm(x), np.linalg.norm(y))


def test_variance_theory_bias_is_zero_within_its_interval(smoke):
    _, ds, _ = smoke("variance_theory")
    bias = ds["relative_bias_summary"]
    spread = bias.sel(stat="hi") - bias.sel(stat="lo")
    assert bool((abs(bias.sel(stat="estimate")) < 2 * spread).all())     # every estimator in the study is unbiased
    assert bool((ds["relative_mse_theory"] > 0).all()) and ds.sizes["replicate"] == 100


def test_variance_theory_matches_lemma_2_where_tails_are_light():
    """Small norms: the squared errors are light-tailed, so 400 draws pin the MSE to ~10 %; the closed-form
    variance of the squared error (fourth moment) sets the tolerance, not the sample."""
    rng, data_rng = _rngs(5)
    params = {"sum_norm": 0.5, "diff_norm": 0.5, "num_features": 16, "seed": 0, "dim": 16, "replicates": 400}
    data = variance_theory.draw(params, data_rng, torch.device("cpu"))
    for name in ("trig", "positive", "hyperbolic"):
        out = variance_theory.run_cell({"estimator": name, **params}, rng, torch.device("cpu"), data)
        sq = (out["estimate_ratio"] - 1) ** 2
        se = sq.std(ddof=1) / np.sqrt(sq.size)
        assert abs(sq.mean() - out["relative_mse_theory"]) < 4 * se, (name, sq.mean(), out["relative_mse_theory"])


# ------------------------------------------------------------------------------------------- attention_error
@pytest.mark.parametrize("causal", [False, True])
def test_attention_error_split_is_exact_for_the_exact_kernel(causal):
    rng, data_rng = _rngs()
    params = {**attention_error.EXPERIMENT.parameter_values(), "estimator": "exact", "num_features": 8,
              "seq_len": 40, "causal": causal, "beta": 2.0, "seed": 0, "dim": 32, "heads": 4}
    data = attention_error.draw(params, data_rng, torch.device("cpu"))     # the engine's draw of the cell's data
    out = attention_error.run_cell(params, rng, torch.device("cpu"), data)
    for metric in ("output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms", "normalizer_log_rms"):
        assert out[metric] < 1e-12, (metric, out)
    assert out["nonpositive_rate"] == 0.0


def test_attention_error_parts_match_a_direct_float64_computation():
    """Numerator and normaliser relative to the exact normaliser, recomputed without stabilisation."""
    params = {**attention_error.EXPERIMENT.parameter_values(), "estimator": "positive", "num_features": 32,
              "seq_len": 24, "causal": True, "beta": 1.0, "seed": 0, "dim": 32, "heads": 4}
    data = attention_error.draw(params, np.random.default_rng(4), torch.device("cpu"))
    out = attention_error.run_cell(params, np.random.default_rng(9), torch.device("cpu"), data)
    dist = make_distribution("isotropic", beta=1.0)
    q, k, v = dist.sample(24, heads=4, d=32, rng=np.random.default_rng(4), dtype=torch.float64)
    est = ka.make_estimator("positive", num_features=32, rng=np.random.default_rng(9)).fit(q, k)
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    approx = est.kernel_matrix(q, k) * mask
    exact = ka.kernel_matrix(q, k) * mask
    z, z_hat = exact.sum(-1), approx.sum(-1)
    y = exact @ v / z[..., None]
    num_err = ((approx @ v / z[..., None] - y).pow(2).sum((-1, -2)).sqrt() / y.pow(2).sum((-1, -2)).sqrt())
    den_err = ((z_hat / z - 1) ** 2).mean(-1).sqrt()
    assert np.isclose(out["numerator_rel_rms"], np.median(num_err.numpy()), rtol=1e-9)
    assert np.isclose(out["normalizer_rel_rms"], np.median(den_err.numpy()), rtol=1e-9)
