"""The kernel_error, variance_theory and attention_error studies: smoke presets produce valid datasets and
figures, and each study's arithmetic is checked on cases with known answers."""

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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``smoke(name) -> (module, dataset, folder)``: each study's smoke preset, run once per test module."""
    runs = {}

    def get(name):
        if name not in runs:
            module = STUDIES[name]
            folder = tmp_path_factory.mktemp(name)
            ds = sweep.run(module.EXPERIMENT, preset="smoke", out=folder / "x.nc", device="cpu", progress=False)
            runs[name] = module, ds, folder
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(STUDIES))
def test_smoke_dataset_is_complete_and_described(smoke, name):
    module, ds, folder = smoke(name)
    exp = module.EXPERIMENT
    assert list(ds[next(iter(exp.metrics))].dims)[:len(exp.axes)] == exp.axes
    assert json.loads(ds.attrs["grid"]) == exp.grid("smoke")
    for metric_name, metric in exp.metrics.items():
        assert ds[metric_name].attrs["long_name"] == metric.long_name
        assert ds[metric_name].attrs["units"] == metric.units
    assert bool(ds["cell_seconds"].notnull().all())
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


def _rngs(seed=0):
    return np.random.default_rng(seed), np.random.default_rng(seed + 1)


# ---------------------------------------------------------------------------------------------- kernel_error
def test_kernel_error_grid_holds_consistent_estimators_only():
    names = kernel_error.ESTIMATORS
    assert {"trig", "positive", "hyperbolic_orthogonal"} <= set(names)
    assert "exact" not in names and "positive_regularized" not in names and "trig_sorf" not in names


def test_kernel_error_is_zero_for_the_exact_kernel():
    rng, data_rng = _rngs()
    out = kernel_error.run_cell({"estimator": "exact", "num_features": 8, "beta": 2.0, "seq_len": 32, "seed": 0},
                                rng, torch.device("cpu"), data_rng)
    assert out["kernel_rel_fro"] == 0.0 and out["kernel_max_rel"] == 0.0
    assert 1.5 < out["beta_eff"] < 2.5


def test_kernel_error_floor_is_below_every_rank_r_estimator(smoke):
    _, ds, _ = smoke("kernel_error")
    if kernel_error.FLOOR not in ds.estimator:
        pytest.skip(f"{kernel_error.FLOOR} is not registered")
    err = ds["kernel_rel_fro"]
    floor = err.sel(estimator=kernel_error.FLOOR)
    for name in ds.estimator.values:                     # Eckart–Young: no rank-r matrix does better
        assert bool((err.sel(estimator=name) >= floor * (1 - 1e-9)).all()), name


# ------------------------------------------------------------------------------------------- variance_theory
@pytest.mark.parametrize("a, b", [(0.5, 1.5), (2.0, 0.25)])
def test_pairs_have_the_prescribed_norms(a, b):
    x, y = variance_theory.pair_with_norms(a, b, 16, np.random.default_rng(3))
    assert np.isclose(np.linalg.norm(x + y), a) and np.isclose(np.linalg.norm(x - y), b)
    assert np.isclose(np.linalg.norm(x), np.linalg.norm(y))


def test_variance_theory_bias_is_zero_within_its_standard_error(smoke):
    _, ds, _ = smoke("variance_theory")
    z = ds["relative_bias"] / ds["relative_bias_se"]
    assert bool((abs(z) < 5).all()), z.values        # every estimator in the study is unbiased
    assert bool((ds["relative_mse_theory"] > 0).all())


def test_variance_theory_matches_lemma_2_where_tails_are_light():
    """Small norms: the squared errors are light-tailed, so 400 draws pin the MSE to ~10 %."""
    rng, data_rng = _rngs(5)
    for name in ("trig", "positive", "hyperbolic"):
        out = variance_theory.run_cell({"estimator": name, "sum_norm": 0.5, "diff_norm": 0.5, "num_features": 16,
                                        "replicates": 400, "seed": 0}, rng, torch.device("cpu"), data_rng)
        gap = abs(out["relative_mse_empirical"] - out["relative_mse_theory"])
        assert gap < 4 * out["relative_mse_se"], (name, out)


# ------------------------------------------------------------------------------------------- attention_error
@pytest.mark.parametrize("causal", [False, True])
def test_attention_error_split_is_exact_for_the_exact_kernel(causal):
    rng, data_rng = _rngs()
    params = {"estimator": "exact", "num_features": 8, "seq_len": 40, "causal": causal, "beta": 2.0, "seed": 0}
    out = attention_error.run_cell(params, rng, torch.device("cpu"), data_rng)
    for metric in ("output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms", "normalizer_log_rms"):
        assert out[metric] < 1e-12, (metric, out)
    assert out["nonpositive_rate"] == 0.0


def test_attention_error_parts_match_a_direct_float64_computation():
    """Numerator and normaliser relative to the exact normaliser, recomputed without stabilisation."""
    params = {"estimator": "positive", "num_features": 32, "seq_len": 24, "causal": True, "beta": 1.0, "seed": 0}
    out = attention_error.run_cell(params, np.random.default_rng(9), torch.device("cpu"), np.random.default_rng(4))
    dist = make_distribution("isotropic", beta=1.0)
    q, k, v = dist.sample(24, heads=attention_error.HEADS, d=attention_error.DIM, rng=np.random.default_rng(4),
                          dtype=torch.float64)
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
