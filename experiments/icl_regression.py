"""In-context (Nadaraya–Watson) regression without training: error against rank and context length.

Episodes (:func:`kernapprox.tasks.smooth_regression`): ``n`` points uniform on the sphere S³ (d = 4) labelled by
a Gaussian-process draw (squared-exponential covariance, lengthscale 0.7, unit variance) plus noise of standard
deviation 0.1; 64 fresh queries are predicted by the attention read-out with inverse bandwidth ``β`` (the
attention scale on unit-norm inputs; on the sphere ``exp(β xᵀy) ∝ exp(−β‖x−y‖²/2)``). Score: normalised MSE
against the noise-free function (1 = predicting the mean). Every cell also scores exact attention on the same
episodes. Maps whose dimension is fixed by ``d`` run only in the ``num_features = 64`` column (they are drawn at
their own dimension); landmark methods with more landmarks than context points are not applicable (NaN). The
optimal rank-r oracle is left to ``rank_summary`` (with 64 queries it would be exact from r = 64 on), and the
position-based hybrids (sliding window, Scatterbrain) are left out: the context is a set, not a sequence whose
positions relate to the queries.
"""

from __future__ import annotations

import xarray as xr

from experiments._icl import (
    FIXED_DIMENSION_SLOT,
    SET_CONTEXT_ESTIMATORS,
    applicable,
    available,
    not_applicable,
    readout_metric_table,
    readout_metrics,
    score_grid,
)
from kernapprox import readout, tasks
from kernapprox.plotting import save_figure
from kernapprox.sweep import Experiment, Metric, run_cli

INPUT_DIM = 4
LENGTHSCALE = 0.7
NOISE_STD = 0.1
NUM_QUERIES = 64
EPISODES = 8

ESTIMATORS = SET_CONTEXT_ESTIMATORS

GRIDS = {
    "smoke": {"estimator": available(ESTIMATORS, ["exact", "positive_orthogonal", "trig_orthogonal"]),
              "num_features": [16, 64], "num_context": [32], "beta": [8.0], "seed": [0]},
    "default": {"estimator": available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
                "num_context": [64, 512], "beta": [8.0, 32.0], "seed": [0]},
    "full": {"estimator": available(ESTIMATORS, list(ESTIMATORS)),
             "num_features": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
             "num_context": [64, 256, 1024, 4096], "beta": [4.0, 8.0, 16.0, 32.0, 64.0], "seed": [0, 1, 2, 3]},
}

METRICS = {
    "nmse": Metric(long_name="normalised MSE", units="1",
                   description="Σ(ŷ−f)²/Σ(f−f̄)² over the queries of an episode; median over episodes"),
    "nmse_exact": Metric(long_name="normalised MSE of exact attention", units="1",
                         description="the same for exact softmax attention on the same episodes"),
    **readout_metric_table(),
}


def run_cell(params, rng, device):
    label, r, n, beta = params["estimator"], params["num_features"], params["num_context"], params["beta"]
    if not applicable(ESTIMATORS, label, r, n, slot=FIXED_DIMENSION_SLOT):
        return not_applicable(METRICS)
    name, options = ESTIMATORS[label]
    ep = tasks.smooth_regression(n, dim=INPUT_DIM, num_queries=NUM_QUERIES, lengthscale=LENGTHSCALE,
                                 noise_std=NOISE_STD, batch=EPISODES, rng=rng, device=device)
    read, exact = readout.paired_readouts(name, ep.x_query, ep.x, ep.y, beta=beta, num_features=r, rng=rng,
                                        options=options)
    return {
        "nmse": tasks.normalized_mse(read.output, ep).median().cpu().numpy(),
        "nmse_exact": tasks.normalized_mse(exact.output, ep).median().cpu().numpy(),
        **readout_metrics(read, exact),
    }


# ---------------------------------------------------------------------------------------------------- figure
def plot(ds: xr.Dataset, path) -> None:
    def decorate(ax, n, beta, exact):
        ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.0, label="context mean (nMSE = 1)")
        ax.set_yscale("log")
        ax.set_ylim(0.02, 30)
        ax.set_title(f"n = {n}, β = {beta:g} (exact: {exact:.3f})")

    fig = score_grid(ds, "nmse", ylabel="normalised MSE", decorate=decorate)
    save_figure(fig, path, (
        f"In-context Nadaraya–Watson regression of Gaussian-process draws on the sphere S^{INPUT_DIM - 1} "
        f"(lengthscale {LENGTHSCALE}, noise {NOISE_STD}): normalised MSE of {NUM_QUERIES} fresh queries against the "
        "noise-free function, against the feature dimension r of the state, for n context points (columns) and "
        "inverse bandwidth β (rows). Median over seeds of the median over "
        f"{EPISODES} episodes; dashed: exact attention on the same episodes; dotted: predicting the mean. "
        "Values above the top of the axis (including failed read-outs) are clipped."),
        title="In-context regression against rank")


EXPERIMENT = Experiment(
    name="icl_regression", title="Training-free in-context regression: error against rank and context length",
    description="How many features does each estimator need before a Nadaraya–Watson attention read-out "
                "regresses as well as exact attention, and how does that depend on the bandwidth β and the "
                "context length n? Grid: estimator × num_features × num_context × beta × seed.",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
