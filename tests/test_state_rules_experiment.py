"""The ``state_rules`` study: the smoke preset runs through the engine, its datasets are paired as declared, the
findings are computed from the dataset (deterministic text, intervals around their estimates), and the figure is
drawn from the dataset alone."""

import re

import numpy as np
import pytest
import torch

import kernapprox as ka
from experiments import state_rules
from kernapprox import sweep


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("state_rules") / "result.nc"
    return sweep.run(state_rules.EXPERIMENT, preset="smoke", out=path, device="cpu")


def test_smoke_dataset(smoke):
    ds = smoke
    assert list(ds.rule.values) == list(state_rules.RULES) and ds.sizes["episode"] == state_rules.EPISODES
    recall, regression = ds.sel(task="recall_rho1"), ds.sel(task="regression")
    assert recall.nmse.isnull().all() and regression.accuracy.isnull().all()
    # exact attention reads the same episodes in every cell of a data draw (paired design)
    exact = recall.accuracy_exact.sel(num_features=state_rules.FIXED_DIMENSION_SLOT)
    assert float(exact.min()) == 1.0
    np.testing.assert_array_equal(exact.sel(estimator="taylor2").values,
                                  exact.sel(estimator="positive_orthogonal").values)
    # fixed-dimension maps run in one column; landmark maps need r ≤ n
    assert ds.accuracy.sel(estimator="taylor2", num_features=16).isnull().all()
    n = int(ds.num_pairs.values[0])
    assert ds.feature_dim.sel(estimator="nystrom_uniform", num_features=64).isnull().all() == (64 > n)
    # memory: the rule's state plus the Nyström context; least squares keeps r² + r d_v numbers
    prf = recall.sel(estimator="positive_orthogonal", num_features=16).state_bytes.isel(num_pairs=0, seed=0)
    d_v = state_rules.VALUE_DIM
    assert prf.sel(rule="sum").item() == 16 * (d_v + 1) * 4
    assert prf.sel(rule="delta").item() == 16 * d_v * 4
    assert prf.sel(rule="least_squares").item() == (16 * 16 + 16 * d_v) * 4
    ny = recall.sel(estimator="nystrom_uniform", num_features=16).state_bytes.isel(num_pairs=0, seed=0)
    assert ny.sel(rule="delta").item() > 16 * d_v * 4                     # landmarks and whitening counted
    # least squares is the exact regression on the state's features: with 16 random features and 32 pairs it
    # recalls far more than the sum of linear attention on the same episodes and draws
    diff = (recall.accuracy.sel(rule="least_squares") - recall.accuracy.sel(rule="sum")).sel(
        estimator="positive_orthogonal")
    assert float(diff.mean()) > 0.2


def test_findings_come_from_the_dataset(smoke):
    text = state_rules.findings(smoke)
    assert text == state_rules.findings(smoke)                             # deterministic
    est, lo, hi = state_rules.summary(smoke, "accuracy", task="recall_rho1", estimator="positive_orthogonal",
                                      num_features=16, num_pairs=32, rule="least_squares")
    assert lo <= est <= hi
    assert f"least_squares {est:.2f} [{lo:.2f}, {hi:.2f}]" in text
    for triple in re.findall(r"(-?\d+\.\d+) \[(-?\d+\.\d+), (-?\d+\.\d+)\]", text):
        e, a, b = map(float, triple)
        assert a <= e + 0.005 and e <= b + 0.005


def test_figure(smoke, tmp_path):
    png = tmp_path / "state_rules.png"
    state_rules.plot(smoke, png)
    assert png.stat().st_size > 10_000


def test_rules_declared_by_every_map_of_the_study():
    for name in state_rules.ESTIMATORS:
        assert set(state_rules.RULES) <= set(ka.capabilities(name).rules)
