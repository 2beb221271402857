"""The in-context-learning experiments: smoke presets run through the engine, datasets hold what the metrics
promise, figures are written from the datasets alone."""

import numpy as np
import pytest
import torch

from experiments import icl_classification, icl_recall, icl_regression, rank_summary
from kernapprox import available_estimators, sweep

EXPERIMENTS = [icl_recall, icl_regression, icl_classification, rank_summary]



@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    out = {}
    torch.set_num_threads(1)
    for module in EXPERIMENTS:
        path = tmp_path_factory.mktemp(module.EXPERIMENT.name) / "result.nc"
        out[module.EXPERIMENT.name] = (sweep.run(module.EXPERIMENT, preset="smoke", out=path, device="cpu"), path)
    return out


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.EXPERIMENT.name)
def test_smoke_dataset_and_figure(module, smoke_results, tmp_path):
    ds, _ = smoke_results[module.EXPERIMENT.name]
    assert list(ds.sizes)[: len(module.EXPERIMENT.axes)] == module.EXPERIMENT.axes
    for name, metric in module.METRICS.items():
        assert ds[name].attrs["long_name"] == metric.long_name
    assert ds.state_bytes.notnull().any()
    png = tmp_path / "figure.png"
    module.EXPERIMENT.plot(ds, png)
    assert png.stat().st_size > 10_000


def test_recall_smoke_values(smoke_results):
    ds, _ = smoke_results["icl_recall"]
    exact = ds.sel(estimator="exact", num_features=icl_recall.FIXED_DIMENSION_SLOT)
    assert float(exact.accuracy.min()) == 1.0                                   # β = 2 ln n, n ≤ 64
    for n in ds.num_pairs.values:
        assert float(exact.state_bytes.sel(num_pairs=n).item()) == n * (64 + 64) * 4
    # fixed-dimension maps run in one column only; the others are NaN
    assert ds.accuracy.sel(estimator="exact", num_features=16).isnull().all()
    prf = ds.sel(estimator="positive_orthogonal")
    np.testing.assert_array_equal(prf.feature_dim.squeeze().values.min(-1), ds.num_features.values)
    assert float(prf.output_rel_error.min()) > 0
    assert float(prf.nonpositive_normalizer_rate.max()) == 0.0                  # positive features
    np.testing.assert_allclose(ds.accuracy_exact.squeeze().values[np.isfinite(ds.accuracy.squeeze().values)], 1.0)


def test_regression_and_classification_smoke_values(smoke_results):
    ds, _ = smoke_results["icl_regression"]
    exact = ds.sel(estimator="exact", num_features=icl_regression.FIXED_DIMENSION_SLOT)
    assert 0.0 < float(exact.nmse.min()) < 1.0
    np.testing.assert_array_equal(exact.nmse.values, exact.nmse_exact.values)     # the same episodes
    ds, _ = smoke_results["icl_classification"]
    exact = ds.sel(estimator="exact", num_features=icl_regression.FIXED_DIMENSION_SLOT)
    assert 0.6 <= float(exact.accuracy.min()) <= 1.0                          # digits, n = 50
    assert float(exact.output_rel_error.max()) == 0.0
    assert 0.6 <= float(ds.accuracy_nearest_neighbour.min()) <= 1.0


def test_rank_summary_smoke_values(smoke_results):
    ds, _ = smoke_results["rank_summary"]
    assert set(ds.task.values) == {"recall", "regression", "classification"}
    prf = ds.sel(estimator="positive_orthogonal")
    assert bool((prf.output_rel_error > 0).all())
    assert float(ds.score_exact.sel(task="recall").min()) >= 0.99


def test_cells_are_reproducible_and_not_applicable_cells_are_nan():
    params = {"estimator": "positive_orthogonal", "num_features": 16, "num_pairs": 16, "beta_factor": 2.0,
              "seed": 0}
    cpu = torch.device("cpu")
    a = icl_recall.run_cell(params, np.random.default_rng(123), cpu)
    b = icl_recall.run_cell(params, np.random.default_rng(123), cpu)
    assert a == b and set(a) == set(icl_recall.METRICS)
    fixed = icl_recall.run_cell({**params, "estimator": "exact", "num_features": 16}, np.random.default_rng(1), cpu)
    assert all(np.isnan(v) for v in fixed.values())


def test_applicability_rules():
    table = {"exact": ("exact", {}), "taylor2": ("taylor2", {}), "positive": ("positive", {}),
             "landmarks": ("nystrom_uniform", {})}
    assert icl_regression.applicable(table, "exact", 64, 10)
    assert not icl_regression.applicable(table, "exact", 16, 10)
    assert icl_regression.applicable(table, "positive", 4096, 10)                # random maps: any r
    if "nystrom_uniform" in available_estimators():
        assert not icl_regression.applicable(table, "landmarks", 128, 64)       # more landmarks than keys
        assert icl_regression.applicable(table, "landmarks", 64, 64)
