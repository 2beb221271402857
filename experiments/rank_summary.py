"""Rank against attention-output error and against in-context accuracy, on matched inputs: the summary figure.

For each of the three training-free tasks (:mod:`kernapprox.tasks`) at one representative setting, every cell
draws episodes, reads them with exact attention and with one estimator at rank ``r``, and records both the
relative error of the attention output and the task score on exactly those inputs:

* ``recall``: continuous MQAR, n = 256 random unit key/value pairs in d = 64, β = ln n, decoded among 4096
  candidates; score = accuracy.
* ``regression``: Nadaraya–Watson regression of GP draws on S³, n = 256, β = 16; score = normalised MSE.
* ``classification``: digits, n = 200 labelled images, β = 16; score = accuracy.

Every task has as many queries as context points, so the optimal rank-r oracle (the truncated SVD of the
``n × n`` query–key kernel matrix, fitted on queries and keys) is a meaningful floor. Maps whose dimension is fixed
by ``d`` (Taylor) run once per task, in the ``num_features = 64`` column; landmark methods with more landmarks than
context points are not applicable (NaN).
"""

from __future__ import annotations

import xarray as xr

from experiments._icl import (
    applicable,
    available,
    collect_legend,
    not_applicable,
    rank_panel,
    readout_metric_table,
    readout_metrics,
    score_panel,
)
from kernapprox import readout, tasks
from kernapprox.plotting import new_figure, reference_slope, save_figure
from kernapprox.sweep import Experiment, Metric, run_cli

EPISODES = 4
TASKS = {  # task -> settings
    "recall": {"num_context": 256, "beta_factor": 1.0, "num_queries": 256, "dim": 64, "num_candidates": 4096},
    "regression": {"num_context": 256, "beta": 16.0, "num_queries": 256},
    "classification": {"num_context": 200, "beta": 16.0, "num_queries": 200},
}
SCORE_NAMES = {"recall": "recall accuracy", "regression": "normalised MSE", "classification": "accuracy"}

ESTIMATORS = {  # label -> (registry name, constructor options)
    "positive_orthogonal": ("positive_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "trig_orthogonal": ("trig_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "nystrom_uniform": ("nystrom_uniform", {}),
    "nystrom_rls": ("nystrom_rls", {}),
    "kernel_svd": ("kernel_svd", {}),
}
ORACLES = {"kernel_svd"}

GRIDS = {
    "smoke": {"task": list(TASKS), "estimator": available(ESTIMATORS, ["positive_orthogonal", "taylor2"]),
              "num_features": [16, 64], "seed": [0]},
    "default": {"task": list(TASKS), "estimator": available(ESTIMATORS, list(ESTIMATORS)),
                "num_features": [16, 32, 64, 128, 256, 512, 1024, 2048], "seed": [0, 1]},
    "full": {"task": list(TASKS), "estimator": available(ESTIMATORS, list(ESTIMATORS)),
             "num_features": [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], "seed": list(range(8))},
}

_READOUT_METRICS = readout_metric_table(
    output_rel_error="‖Ŷ−Y‖_F/‖Y‖_F against exact attention on the task's queries; median over episodes (inf when "
                     "an output is not finite)",
    state_bytes="r·(d_v+1) float32 numbers", feature_dim="r as fitted")
METRICS = {  # the output error first, as in the stored datasets
    "output_rel_error": _READOUT_METRICS["output_rel_error"],
    "score": Metric(long_name="task score", units="1",
                    description="recall and classification: accuracy (mean over episodes); regression: normalised "
                                "MSE (median over episodes)"),
    "score_exact": Metric(long_name="task score of exact attention", units="1",
                          description="the same score for exact softmax attention on the same episodes"),
    **_READOUT_METRICS,
}


def _episodes(task, rng, device):
    """(queries, keys, values, scorer, β) of one batch of episodes of ``task``."""
    s = TASKS[task]
    if task == "recall":
        ep = tasks.associative_recall(s["num_context"], dim=s["dim"], num_candidates=s["num_candidates"],
                                      num_queries=s["num_queries"], batch=EPISODES, rng=rng, device=device)
        return (ep.queries, ep.keys, ep.values, lambda y: tasks.recall_accuracy(y, ep).mean(),
                tasks.log_n_beta(s["num_context"], s["beta_factor"]))
    if task == "regression":
        ep = tasks.smooth_regression(s["num_context"], num_queries=s["num_queries"], batch=EPISODES, rng=rng,
                                     device=device)
        return ep.x_query, ep.x, ep.y, lambda y: tasks.normalized_mse(y, ep).median(), s["beta"]
    ep = tasks.digits_classification(s["num_context"], num_queries=s["num_queries"], batch=EPISODES, rng=rng,
                                     device=device)
    return ep.x_query, ep.x, ep.onehot, lambda y: tasks.classification_accuracy(y, ep).mean(), s["beta"]


def run_cell(params, rng, device):
    task, label, r = params["task"], params["estimator"], params["num_features"]
    if not applicable(ESTIMATORS, label, r, TASKS[task]["num_context"]):
        return not_applicable(METRICS)
    name, options = ESTIMATORS[label]
    queries, keys, values, score, beta = _episodes(task, rng, device)
    read, exact = readout.paired_readouts(name, queries, keys, values, beta=beta, num_features=r, rng=rng,
                                        options=options, fit_on="queries_and_keys" if label in ORACLES else "keys")
    return {
        "score": score(read.output).cpu().numpy(),
        "score_exact": score(exact.output).cpu().numpy(),
        **readout_metrics(read, exact),
    }


def _setting(task):
    s = TASKS[task]
    beta = f"β = {s['beta_factor']:g}·ln n" if "beta_factor" in s else f"β = {s['beta']:g}"
    return f"{task}: n = {s['num_context']}, {beta}"


def plot(ds: xr.Dataset, path) -> None:
    labels = [str(v) for v in ds.estimator.values]
    task_names = [str(v) for v in ds.task.values]
    fig, axes = new_figure(2, len(task_names), squeeze=False, height=6.2)
    for j, task in enumerate(task_names):
        top, bottom = axes[0, j], axes[1, j]
        rank_panel(top, ds, "output_rel_error", labels, task=task)
        top.set_yscale("log")
        rs = ds.num_features.values.astype(float)
        reference_slope(top, rs, 1.0, slope=-0.5)
        top.set_ylim(1e-3, 1e2)
        top.set_xlabel("feature dimension r of the state")
        top.set_ylabel("attention-output relative error")
        top.set_title(_setting(task))
        ex = score_panel(bottom, ds, "score", labels, ylabel=SCORE_NAMES.get(task, "score"), task=task)
        if task == "regression":
            bottom.axhline(1.0, color="0.4", linestyle=":", linewidth=1.0, label="context mean (nMSE = 1)")
            bottom.set_yscale("log")
            bottom.set_ylim(None, 10)
        else:
            bottom.set_ylim(0.0, 1.02)
        bottom.set_title(f"{task}: exact {ex:.3f}")
    collect_legend(fig, axes.flat)
    save_figure(fig, path, (
        "One set of episodes per cell, read with exact attention and with an estimator of rank r. Top: relative "
        "RMS error of the attention output against exact attention (grey dashed: slope r^(-1/2), the Monte Carlo "
        "rate). Bottom: the task score on the same inputs (dashed: exact attention). Recall: "
        "continuous MQAR, 256 pairs in d = 64, decoded among 4096 candidates; regression: GP draws on S³, 256 "
        "points, normalised MSE (lower is better); classification: digits, 200 labelled images. Medians over "
        f"seeds of {EPISODES} episodes each; markers alone are fixed-dimension maps."),
        title="Rank, attention error and in-context accuracy")


EXPERIMENT = Experiment(
    name="rank_summary", title="Rank against attention-output error and in-context accuracy (matched inputs)",
    description="Does a smaller attention-output error at a given rank mean better in-context learning, and "
                "where does each estimator reach exact attention's score? Grid: task × estimator × "
                "num_features × seed; each cell measures error and score on the same episodes.",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
