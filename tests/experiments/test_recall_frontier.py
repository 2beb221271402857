"""The ``recall_frontier`` study: the smoke preset end to end through the engine (declared variables with their
attributes, state bytes in closed form, test prompts paired over families), the learning rate chosen on validation
accuracy and never on test accuracy, and findings and figure drawn from the dataset alone."""

import numpy as np
import pytest
import torch
import xarray as xr
from PIL import Image

from experiments import recall_frontier as rf
from kernapprox import sweep


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("recall_frontier") / "result.nc"
    return sweep.run(rf.EXPERIMENT, preset="smoke", out=path, device="cpu", progress=False)


def test_smoke_dataset_declares_its_variables(smoke):
    ds = smoke
    for name in [*rf.METRICS, "chosen_lr", "test_accuracy_chosen", "test_accuracy_summary", "state_bytes_config",
                 "kv_cache_bytes", "chance_pairs", "chance_vocab"]:
        assert ds[name].attrs["long_name"] and ds[name].attrs["units"], name
    for axis in rf.EXPERIMENT.axes:
        assert ds[axis].attrs["long_name"] and ds[axis].attrs["units"], axis
    assert ds.sizes["seed"] >= 3
    # softmax runs in its one column; every linear family at every r
    exact = ds["test_accuracy"].sel(estimator="exact")
    assert exact.sel(num_features=rf.SOFTMAX_SLOT).notnull().all()
    assert exact.drop_sel(num_features=rf.SOFTMAX_SLOT).isnull().all()
    assert ds["test_accuracy"].sel(estimator="elu1").notnull().all()
    assert ((ds["test_accuracy"] >= 0) & (ds["test_accuracy"] <= 1)).sum() == ds["test_accuracy"].notnull().sum()


def test_state_bytes_are_the_closed_forms(smoke):
    ds = smoke.isel(setup=0, num_pairs=0)
    s = rf.SETUPS[str(smoke["setup"].values[0])]
    heads, layers, d_h = s.num_heads, s.num_layers, s.d_model // s.num_heads
    conv = layers * 3 * s.d_model * 4                                   # kernel · d_model float32 per layer
    n = s.len_per_pair * int(ds["num_pairs"])
    for r in ds["num_features"].values:
        got = ds["state_bytes"].sel(estimator="elu1", num_features=r)
        assert (got == r * (d_h + 1) * 4 * heads * layers + conv).all()              # sum rule: r (d_v + 1)
        delta = ds["state_bytes"].sel(estimator="elu1_delta", num_features=r)
        assert (delta == r * d_h * 4 * heads * layers + conv).all()                  # delta rule: r d_v
    kv = 2 * n * d_h * 4 * heads * layers
    assert float(ds["kv_cache_bytes"]) == kv == rf.kv_cache_bytes(s, int(ds["num_pairs"]))
    assert (ds["state_bytes"].sel(estimator="exact", num_features=rf.SOFTMAX_SLOT) == kv + conv).all()
    assert float(smoke["chance_pairs"].isel(num_pairs=0)) == 1 / int(ds["num_pairs"])


def test_state_bytes_of_the_other_families_follow_their_maps():
    s = rf.SETUPS["smoke"]
    d_h = s.d_model // s.num_heads
    conv = s.num_layers * 3 * s.d_model * 4
    for family, r, realised in (("taylor2", 16, 15), ("positive_orthogonal", 8, 8)):
        cfg = rf.configuration(s, 2, family, r, 1e-2, 0)
        from kernapprox.models import build_model
        model = build_model(cfg[0], cfg[1], 0)
        assert model.attentions[0].estimator.num_features == realised
        assert rf.state_bytes(model, cfg[1].seq_len) == realised * (d_h + 1) * 4 * s.num_heads * s.num_layers + conv


def _constructed(val, test):
    """A dataset of the study's shape with the given validation and test accuracies over (lr, seed)."""
    val, test = np.asarray(val, dtype=float), np.asarray(test, dtype=float)
    shape = (1, 1, 1, 1, *val.shape)
    dims = ("setup", "num_pairs", "estimator", "num_features", "lr", "seed")
    coords = {"setup": ["smoke"], "num_pairs": [2], "estimator": ["elu1"], "num_features": [4],
              "lr": [1e-3, 1e-2, 1e-1][:val.shape[0]], "seed": list(range(val.shape[1]))}
    data = {"val_accuracy": (dims, val.reshape(shape)), "test_accuracy": (dims, test.reshape(shape)),
            "state_bytes": (dims, np.full(shape, 1000.0)), "seq_len": (dims, np.full(shape, 8.0)),
            "train_cpu_seconds": (dims, np.ones(shape)), "feature_dim": (dims, np.full(shape, 4.0))}
    return xr.Dataset(data, coords=coords).assign(target=rf.TARGET)


def test_the_learning_rate_is_chosen_on_validation_never_on_test():
    # lr 1e-2 is best on validation; lr 1e-1 is best on test: the choice must be 1e-2
    val = [[0.2, 0.3, 0.25], [0.9, 0.8, 0.85], [0.5, 0.4, 0.6]]
    test = [[0.2, 0.2, 0.2], [0.7, 0.6, 0.65], [0.99, 0.98, 0.97]]
    ds = rf.summarise(_constructed(val, test))
    assert float(ds["chosen_lr"].squeeze()) == 1e-2
    np.testing.assert_array_equal(ds["test_accuracy_chosen"].squeeze().values, [0.7, 0.6, 0.65])
    summary = ds["test_accuracy_summary"].squeeze()
    assert float(summary.sel(stat="estimate")) == 0.65
    assert (float(summary.sel(stat="lo")), float(summary.sel(stat="hi"))) == (0.6, 0.7)
    # changing the test data never changes the choice
    again = rf.summarise(_constructed(val, np.asarray(test)[::-1]))
    assert float(again["chosen_lr"].squeeze()) == 1e-2
    # a tie goes to the smaller rate; a configuration that never ran has no choice
    tie = rf.summarise(_constructed([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], [[0.1] * 3, [0.9] * 3]))
    assert float(tie["chosen_lr"].squeeze()) == 1e-3
    empty = rf.summarise(_constructed([[np.nan] * 3] * 2, [[np.nan] * 3] * 2))
    assert np.isnan(float(empty["chosen_lr"].squeeze()))


def test_smallest_enough_state_and_findings(smoke):
    ds = _constructed([[0.95, 0.95, 0.95]], [[0.92, 0.95, 0.91]])
    ds = rf.summarise(ds)
    assert rf.smallest_enough(ds, "smoke", 2, "elu1", 0.9) == (1000.0, 0.92)
    assert rf.smallest_enough(ds, "smoke", 2, "elu1", 0.99) is None
    text = sweep.findings_body(rf.EXPERIMENT, smoke)
    assert text == sweep.findings_body(rf.EXPERIMENT, smoke.copy(deep=True))          # deterministic
    assert text.startswith("- N = 2 pairs, median test accuracy") and "Chance: 1/N = 0.5" in text
    assert "not resolved" in text and "never in the grid" in text


def test_figure_and_findings_are_tied_to_the_data(smoke, tmp_path):
    written = sweep.draw(rf.EXPERIMENT, smoke, tmp_path / "recall_frontier.png", source="results/recall_frontier.nc")
    md = (tmp_path / "recall_frontier.md").read_text(encoding="utf-8")
    digest = sweep.read_digest(md)
    assert written[-1].suffix == ".md" and digest == sweep.dataset_digest(smoke)
    assert digest in Image.open(tmp_path / "recall_frontier.png").info["Source"]


def test_test_prompts_are_shared_by_the_families_of_a_seed():
    """The data draw depends on (setup, num_pairs, seed) only: every family and rate of a seed reads the same
    prompts; another seed reads others."""
    params = {"setup": "smoke", "num_pairs": 2, "seed": 0}
    a = rf.draw(params, np.random.default_rng(1), "cpu")
    b = rf.draw(params, np.random.default_rng(1), "cpu")
    c = rf.draw(params, np.random.default_rng(2), "cpu")
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)
