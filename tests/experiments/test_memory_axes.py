"""The in-context figures compare estimators at equal memory: every score is drawn against the bytes of the state a
decoder keeps (the dataset's ``state_bytes``), and exact attention at its KV cache, the size of the keys and values
of the episodes the cells read, is marked on the same axis (a dotted vertical line, its score as a star there)."""

import itertools

import numpy as np
import pytest
import torch
import xarray as xr

from experiments import _icl, icl_classification, icl_regression, rank_summary
from kernapprox.plotting import new_figure

CPU = torch.device("cpu")


def _kv_of(keys, values) -> int:
    """The bytes of a float32 KV cache of one episode's keys and values (the last two axes: tokens, width)."""
    return keys.shape[-2] * (keys.shape[-1] + values.shape[-1]) * 4


def _marks(ax) -> tuple[list[float], list[float]]:
    """``(dotted vertical lines, stars)``: the x positions at which a panel marks a memory."""
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) == 2 and line.get_linestyle() == ":"
             and line.get_xdata()[0] == line.get_xdata()[1]]
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    return [float(line.get_xdata()[0]) for line in lines], [float(x) for line in stars for x in line.get_xdata()]


def _line_x(ax, label: str) -> np.ndarray:
    (line,) = [line for line in ax.get_lines() if line.get_label() == label]
    return np.asarray(line.get_xdata(), dtype=float)


@pytest.mark.parametrize("module, d, d_v", [
    (icl_regression, icl_regression.EXPERIMENT.parameter_values()["dim"], icl_regression.LABELS),
    (icl_classification, icl_classification.PIXELS, icl_classification.CLASSES),
], ids=["icl_regression", "icl_classification"])
def test_the_kv_cache_is_that_of_the_episodes_drawn(module, d, d_v):
    params = {**module.EXPERIMENT.parameter_values(), "num_context": 24, "seed": 0}
    data = module.draw(params, np.random.default_rng(0), CPU)
    kv = _icl.kv_cache(xr.DataArray([24, 48], dims="num_context", name="num_context"), d=d, d_v=d_v)
    assert kv.dims == ("num_context",) and kv.attrs["units"] == "byte"
    assert float(kv.sel(num_context=24)) == _kv_of(data.keys, data.values) == _icl.kv_cache_bytes(24, d, d_v)
    assert float(kv.sel(num_context=48)) == 2 * float(kv.sel(num_context=24))


@pytest.mark.parametrize("task", list(rank_summary.TASKS))
def test_rank_summary_kv_cache_is_that_of_the_task_episodes(task):
    keys, values = rank_summary.draw({"task": task, "query": "key", "seed": 0}, np.random.default_rng(0), CPU)[1:3]
    assert keys.shape[-2] == rank_summary.TASKS[task]["num_context"]
    assert rank_summary._kv_bytes(task) == _kv_of(keys, values)


def test_score_grid_draws_against_state_bytes_with_the_kv_cache_marked(smoke_run):
    _, ds, _ = smoke_run("icl_classification")
    fig = _icl.score_grid(ds, "accuracy", "accuracy_exact", ylabel="accuracy", decorate=lambda *args: None,
                          n_axis="num_context", kv_bytes=ds["kv_bytes"])
    panels = np.asarray(fig.axes).reshape(ds.sizes["beta"], ds.sizes["num_context"])
    for (i, beta), (j, n) in itertools.product(enumerate(ds.beta.values), enumerate(ds.num_context.values)):
        ax, kv = panels[i, j], float(ds["kv_bytes"].sel(num_context=n))
        assert ax.get_xscale() == "log" and ax.get_xlabel() == _icl.STATE_BYTES_LABEL
        assert _marks(ax) == ([kv], [kv])
        state = ds["state_bytes"].sel(estimator="positive_orthogonal", num_context=n, beta=beta).median("seed")
        np.testing.assert_array_equal(_line_x(ax, "positive_orthogonal"), state.values)


def test_rank_summary_panels_draw_against_state_bytes_with_the_kv_cache_marked(smoke_run):
    _, ds, _ = smoke_run("rank_summary")
    labels = [str(v) for v in ds.estimator.values]
    _, (error, score) = new_figure(1, 2)
    rank_summary._error_panel(error, ds, labels, "recall")
    rank_summary._score_panel(score, ds, labels, "recall", "key")
    kv = rank_summary._kv_bytes("recall")
    assert _marks(error) == ([kv], []) and _marks(score) == ([kv], [kv])       # exact attention's error is zero
    at = {"task": "recall", "query": "key"}
    for ax in (error, score):
        assert ax.get_xscale() == "log" and ax.get_xlabel() == _icl.STATE_BYTES_LABEL
        np.testing.assert_array_equal(_line_x(ax, "positive_orthogonal"), ds["state_bytes"].sel(
            estimator="positive_orthogonal", **at).median("seed").values)
        np.testing.assert_array_equal(_line_x(ax, rank_summary.ORACLES[rank_summary.KERNEL_SVD]), ds[
            "budget_bytes"].sel(estimator=rank_summary.KERNEL_SVD, **at).median("seed").values)   # no state: B(r)
