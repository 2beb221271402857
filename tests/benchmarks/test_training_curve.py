"""benchmarks.training_curve: a tiny run end to end (dataset, findings, figure) and the pieces the findings use."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr

from benchmarks import training_curve as tc
from kernapprox import sweep
from kernapprox.tasks.sequence import unavailable_reason

TEXT_MISSING = unavailable_reason(tc.SOURCE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if TEXT_MISSING:
        pytest.skip(f"the text source is not available: {TEXT_MISSING} (make lm)")
    folder = tmp_path_factory.mktemp("training_curve")
    paths = {"out": folder / "tc.nc", "figure": folder / "tc.png", "findings": folder / "tc.md"}
    ds = tc.main(["--lengths", "64", "128", "--seeds", "0", "1", "--models", "elu1 r=16", "hedgehog r=16",
                  "--budget-s", "0.25", "--threads", "1", *[f"--{k}={v}" for k, v in paths.items()]])
    return ds, paths


def test_dataset_layout_and_provenance(tiny):
    ds, paths = tiny
    assert list(ds["model"].values) == ["softmax", "elu1 r=16", "hedgehog r=16"]     # the reference always first
    assert ds["eval_loss"].dims == ("model", "seq_len", "seed", "checkpoint")
    for key in ("git_revision", "torch_version", "torch_num_threads", "machine", "load_average_1min_at_start",
                "load_average_1min_at_end", "budget_s"):
        assert key in ds.attrs, key
    with xr.open_dataset(paths["out"], engine="h5netcdf") as stored:
        assert stored["eval_loss"].shape == ds["eval_loss"].shape
    # every run starts at step 0 with a finite loss and trains at least one step within (or just past) the budget
    assert np.all(ds["elapsed_s"].isel(checkpoint=0) == 0)
    assert np.all(np.isfinite(ds["eval_loss"].isel(checkpoint=0)))
    assert np.all(ds["steps"] >= 1)
    assert np.all(ds["train_seconds"] >= ds.attrs["budget_s"])
    # elapsed seconds grow along the checkpoints that were reached
    t = ds["elapsed_s"].values
    assert np.all(np.diff(np.where(np.isfinite(t), t, np.inf), axis=-1) > 0)
    assert np.all(np.isfinite(ds["unigram_loss"]))
    assert int(ds["is_kv_cache"].sel(model="softmax")) == 1


def test_paired_models_start_from_the_same_data(tiny):
    """Models of a seed read the same held-out windows: the unigram baseline is one number per (n, seed)."""
    ds, _ = tiny
    assert ds["unigram_loss"].dims == ("seq_len", "seed")
    assert not np.isclose(float(ds["unigram_loss"].isel(seq_len=0, seed=0)),
                          float(ds["unigram_loss"].isel(seq_len=0, seed=1)), rtol=0, atol=1e-12)


def test_findings_and_figure_from_the_dataset(tiny):
    ds, paths = tiny
    text = paths["findings"].read_text()
    assert text == tc.findings(ds)
    for n in (64, 128):
        assert f"## n = {n}" in text
    assert "KV cache" in text and "unigram baseline" in text
    last = text.strip().splitlines()[-1]          # the studies' digest line: data and the code that made it
    assert sweep.read_digest(last) == sweep.dataset_digest(ds)
    assert sweep.read_code_digest(last) == ds.attrs["code_digest"]
    record = sweep.read_provenance(paths["figure"])
    assert record["study"] == "benchmarks.training_curve" and record["code_digest"] == ds.attrs["code_digest"]
    assert [row.status for row in sweep.figure_status(paths["figure"].parent)
            if row.path.stem == paths["figure"].stem] == ["current"]
    assert paths["figure"].stat().st_size > 10_000
    again = tc.main(["--replot", f"--out={paths['out']}", f"--figure={paths['figure']}",
                     f"--findings={paths['findings']}"])
    assert paths["findings"].read_text() == tc.findings(again)


def test_state_bytes_and_feature_dims():
    d_h, heads_layers = tc.HEAD_DIM, tc.NUM_HEADS * tc.NUM_LAYERS
    assert tc.state_bytes("softmax", 1024) == 4 * 2 * 1024 * d_h * heads_layers
    assert tc.state_bytes("softmax", 2048) == 2 * tc.state_bytes("softmax", 1024)
    assert tc.feature_dim("taylor2 r=45") == 45 and tc.feature_dim("taylor2 r=15") == 15
    assert tc.state_bytes("elu1 r=64", 16384) == 4 * 64 * (d_h + 1) * heads_layers
    assert tc.feature_dim("softmax") is None


def test_time_to_and_loss_by():
    t = np.array([[[[0.0, 1.0, 2.0, 4.0]]]])
    y = np.array([[[[5.0, 4.0, 3.0, 2.5]]]])
    ds = xr.Dataset({"elapsed_s": (("model", "seq_len", "seed", "checkpoint"), t),
                     "eval_loss": (("model", "seq_len", "seed", "checkpoint"), y)},
                    coords={"model": ["m"], "seq_len": [8], "seed": [0]})
    assert tc._loss_by(ds, "m", 8, 0, 2.5) == 3.0
    assert tc._loss_by(ds, "m", 8, 0, math.inf) == 2.5
    assert tc._time_to(ds, "m", 8, 0, 3.0) == 2.0
    assert tc._time_to(ds, "m", 8, 0, 1.0) == math.inf
    assert tc._med([math.inf, math.inf]) == "not reached"
    assert "reached by 1 of 2 seeds" in tc._med([2.0, math.inf])
