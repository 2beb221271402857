"""The ``state_rules`` study: the smoke preset runs through the engine, its datasets are paired as declared, the
findings are computed from the dataset (deterministic text, intervals around their estimates), and the figure is
drawn from the dataset alone."""

import numpy as np
import pytest
import torch

from experiments import state_rules
from kernapprox import readout, sweep
from kernapprox.plotting import fmt_ci


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("state_rules") / "result.nc"
    return sweep.run(state_rules.EXPERIMENT, preset="smoke", out=path, device="cpu")


def test_smoke_dataset(smoke):
    ds = smoke
    assert list(ds.rule.values) == list(state_rules.RULE_NAMES) and ds.sizes["episode"] == state_rules.EPISODES
    recall, regression = ds.sel(task="recall_rho1"), ds.sel(task="regression")
    assert recall.nmse.isnull().all() and regression.accuracy.isnull().all()
    # exact attention is the reference: read once per data draw, stored without the estimator axes
    assert set(ds.accuracy_exact.dims) == {"task", "num_pairs", "seed", "episode"}
    assert float(recall.accuracy_exact.min()) == 1.0
    assert int(ds["key_dim"]) == 32 and ds["key_dim"].attrs["units"] == "1"           # fixed parameters
    # fixed-dimension maps run in one column; landmark maps need r ≤ n
    assert ds.accuracy.sel(estimator="taylor2", num_features=16).isnull().all()
    n = int(ds.num_pairs.values[0])
    assert ds.feature_dim.sel(estimator="nystrom_uniform", num_features=64).isnull().all() == (64 > n)
    # memory: the rule's state plus the Nyström context; least squares keeps r² + r d_v numbers
    prf = recall.sel(estimator="positive_orthogonal", num_features=16).state_bytes.isel(num_pairs=0, seed=0)
    d_v = int(ds["value_dim"])
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
    text = sweep.findings_body(state_rules.EXPERIMENT, smoke)
    assert text == sweep.findings_body(state_rules.EXPERIMENT, smoke.copy(deep=True))      # deterministic
    sel = {"task": "recall_rho1", "estimator": "positive_orthogonal", "num_features": 16, "num_pairs": 32}
    s = smoke["accuracy_summary"].sel(**sel, rule="least_squares")
    # every episode asks the same number of queries: the pooled proportion is the mean of the episodes' accuracies
    np.testing.assert_allclose(float(s.sel(stat="estimate")),
                               float(smoke["accuracy"].sel(**sel, rule="least_squares").mean()), rtol=1e-12)
    assert float(s.sel(stat="lo")) <= float(s.sel(stat="estimate")) <= float(s.sel(stat="hi"))
    assert f"least_squares {fmt_ci(s)}" in text and text.startswith("- Recall at n = 32")
    paired = smoke["accuracy_vs_sum"].sel(**sel)
    np.testing.assert_array_equal(paired.sel(rule="delta"), (smoke["accuracy"].sel(**sel, rule="delta")
                                                            - smoke["accuracy"].sel(**sel, rule="sum")))
    assert float(abs(paired.sel(rule="sum")).max()) == 0.0
    closing = sweep.findings_text(state_rules.EXPERIMENT, smoke, "x").split("\n\n")[0].splitlines()[-1]
    assert "95 % intervals" in closing                                # the engine's closing line


def test_figure(smoke, tmp_path):
    png = tmp_path / "state_rules.png"
    state_rules.plot(smoke, png)
    assert png.stat().st_size > 10_000


def test_rules_declared_by_every_map_of_the_study():
    for name, options in state_rules.ESTIMATORS.values():
        assert set(state_rules.RULE_NAMES) <= set(readout.estimator_capabilities(name, **options).rules)
