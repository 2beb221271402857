"""Few-shot classification of real data without training: accuracy against rank and context length.

Episodes (:func:`kernapprox.tasks.digits_classification`): scikit-learn's bundled digits (1797 images, 64
pixels, 10 classes; standardised, L2-normalised), ``n`` labelled images in context and 32 queries per episode,
drawn without replacement. Prediction = argmax of the attention-weighted one-hot labels with inverse
temperature ``β``. Every cell also scores exact attention and 1-NN (the ``β → ∞`` limit) on the same episodes.
Maps whose dimension is fixed by ``d`` run only in the ``num_features = 64`` column (drawn at their own
dimension); landmark methods with more landmarks than context images are not applicable (NaN). As in
``icl_regression``, the optimal rank-r oracle (see ``rank_summary``) and the position-based hybrids are left out.
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

NUM_QUERIES = 32
EPISODES = 8

ESTIMATORS = SET_CONTEXT_ESTIMATORS

GRIDS = {
    "smoke": {"estimator": available(ESTIMATORS, ["exact", "positive_orthogonal", "taylor2"]),
              "num_features": [16, 64], "num_context": [50], "beta": [8.0], "seed": [0]},
    "default": {"estimator": available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
                "num_context": [100, 500], "beta": [4.0, 16.0], "seed": [0]},
    "full": {"estimator": available(ESTIMATORS, list(ESTIMATORS)),
             "num_features": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
             "num_context": [50, 100, 200, 500, 1000], "beta": [2.0, 4.0, 8.0, 16.0, 32.0], "seed": [0, 1, 2, 3]},
}

METRICS = {
    "accuracy": Metric(long_name="classification accuracy", units="1",
                       description="fraction of queries whose argmax attention-weighted label is right; mean over "
                                   "episodes (a non-finite output counts as wrong)"),
    "accuracy_numerator": Metric(long_name="accuracy of the unnormalised read-out", units="1",
                                 description="as accuracy, from the numerator Σ κ̂ onehot alone (immune to "
                                             "normaliser sign flips)"),
    "accuracy_exact": Metric(long_name="exact-attention accuracy", units="1",
                             description="exact softmax attention on the same episodes"),
    "accuracy_nearest_neighbour": Metric(long_name="1-NN accuracy", units="1",
                                         description="nearest context image by cosine, on the same episodes"),
    **readout_metric_table(state_bytes="r·(d_v+1) float32 numbers (d_v = 10 classes); exact attention: KV "
                                      "cache n·(d+d_v)"),
}


def run_cell(params, rng, device):
    label, r, n, beta = params["estimator"], params["num_features"], params["num_context"], params["beta"]
    if not applicable(ESTIMATORS, label, r, n, slot=FIXED_DIMENSION_SLOT):
        return not_applicable(METRICS)
    name, options = ESTIMATORS[label]
    ep = tasks.digits_classification(n, num_queries=NUM_QUERIES, batch=EPISODES, rng=rng, device=device)
    read, exact = readout.paired_readouts(name, ep.x_query, ep.x, ep.onehot, beta=beta, num_features=r, rng=rng,
                                        options=options)
    return {
        "accuracy": tasks.classification_accuracy(read.output, ep).mean().cpu().numpy(),
        "accuracy_numerator": tasks.classification_accuracy(read.numerator, ep).mean().cpu().numpy(),
        "accuracy_exact": tasks.classification_accuracy(exact.output, ep).mean().cpu().numpy(),
        "accuracy_nearest_neighbour": tasks.classification_accuracy(
            tasks.nearest_neighbour_predictions(ep), ep).mean().cpu().numpy(),
        **readout_metrics(read, exact),
    }


def plot(ds: xr.Dataset, path) -> None:
    def decorate(ax, n, beta, exact):
        nn = float(ds.accuracy_nearest_neighbour.sel(num_context=n, beta=beta).median())
        ax.axhline(nn, color="0.2", linestyle=":", linewidth=1.0, label="1-NN")
        ax.axhline(0.1, color="0.6", linestyle=(0, (1, 3)), linewidth=1.0, label="chance")
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"n = {n}, β = {beta:g}: exact {exact:.2f}, 1-NN {nn:.2f}")

    fig = score_grid(ds, "accuracy", ylabel="accuracy", decorate=decorate)
    save_figure(fig, path, (
        "Few-shot classification of scikit-learn's digits (10 classes; pixels standardised, images L2-normalised) "
        f"by an attention read-out over n labelled context images (columns) with inverse temperature β (rows): "
        f"accuracy over {NUM_QUERIES} queries × {EPISODES} episodes (median over seeds) against the feature "
        "dimension r of the state. Dashed: exact attention on the same episodes; dotted: 1-NN (the β → ∞ limit); "
        "chance 0.1."),
        title="Few-shot digits classification against rank")


EXPERIMENT = Experiment(
    name="icl_classification",
    title="Training-free few-shot classification of digits: accuracy against rank and context length",
    description="How many features does each estimator need before an attention read-out over labelled "
                "examples classifies real data (scikit-learn digits) as well as exact attention? Grid: "
                "estimator × num_features × num_context × beta × seed.",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
