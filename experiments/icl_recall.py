"""Associative recall without training: accuracy against state size and against the number of stored pairs.

Continuous MQAR (:func:`kernapprox.tasks.associative_recall`): ``n`` pairs of random unit keys (d = 64) and
values (d_v = 64) are written into the memory, every stored key (at most 256 per episode) is queried, and the
read-out is decoded to the nearest of 4096 candidate values (Zoology's V/2). The inverse temperature is
``β = beta_factor · ln n`` (``ln n`` puts about half of exact attention's mass on the match). Every cell also
reads the same episodes with exact attention, so its accuracy and its attention-output error are measured on
matched inputs. Maps whose dimension is fixed by ``d`` (exact, Taylor, ELU+1, DPFP) run only in the
``num_features = 64`` column; landmark methods with more landmarks than keys are not applicable (NaN). The
position-based hybrids (sliding window + linear, Scatterbrain) are left out: the pairs form a set and the queries
come in random order, so a window over positions says nothing about which pair is asked for.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from experiments._icl import (
    FIXED_DIMENSION_SLOT,
    applicable,
    available,
    legend_entries,
    not_applicable,
    readout_metric_table,
    readout_metrics,
)
from experiments._icl import style as icl_style
from kernapprox import readout, tasks
from kernapprox.estimators import DPFPFeatures
from kernapprox.plotting import median_band, new_figure, save_figure
from kernapprox.sweep import Experiment, Metric, run_cli

KEY_DIM = 64
VALUE_DIM = 64
NUM_CANDIDATES = 4096
MAX_QUERIES = 256
EPISODES = 4

# label -> (registry name or FeatureMap class, constructor options); unregistered names are left out
ESTIMATORS = {
    "exact": ("exact", {}),
    "positive_orthogonal": ("positive_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "trig_orthogonal": ("trig_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "elu1": ("elu1", {}),
    "dpfp_nu1": (DPFPFeatures, {"nu": 1}),   # not registered (its normaliser can be exactly zero)
    "dpfp_nu2": (DPFPFeatures, {"nu": 2}),
    "dpfp_nu3": (DPFPFeatures, {"nu": 3}),
    "nystrom_uniform": ("nystrom_uniform", {}),
    "nystrom_rls": ("nystrom_rls", {}),
}


GRIDS = {
    "smoke": {"estimator": available(ESTIMATORS, ["exact", "positive_orthogonal", "taylor2", "nystrom_uniform"]),
              "num_features": [16, 64], "num_pairs": [16, 64], "beta_factor": [2.0], "seed": [0]},
    "default": {"estimator": available(ESTIMATORS, list(ESTIMATORS)), "num_features": [64, 256, 1024, 4096],
                "num_pairs": [64, 256, 1024], "beta_factor": [1.0, 2.0], "seed": [0]},
    "full": {"estimator": available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024, 4096, 16384],
             "num_pairs": [16, 64, 256, 1024, 4096], "beta_factor": [0.5, 1.0, 2.0], "seed": [0, 1, 2, 3]},
}

METRICS = {
    "accuracy": Metric(long_name="recall accuracy", units="1",
                       description="fraction of queries whose normalised attention output is nearest to their own "
                                   "value among 4096 candidates; mean over episodes"),
    "accuracy_numerator": Metric(long_name="recall accuracy of the unnormalised read-out", units="1",
                                 description="as accuracy, decoding the numerator W φ(q) alone (fast-weight "
                                             "read-out, immune to normaliser sign flips)"),
    "accuracy_exact": Metric(long_name="exact-attention recall accuracy", units="1",
                             description="accuracy of exact softmax attention on the same episodes"),
    **readout_metric_table(
        output_rel_error="‖Ŷ−Y‖_F/‖Y‖_F against exact attention on the same queries; median over episodes (inf "
                         "when an output is not finite)",
        nonpositive_normalizer_rate="fraction of queries whose estimated Σ_i φ(q)ᵀφ(k_i) ≤ 0 or is not finite",
        state_bytes="linear state r·(d_v+1) float32 numbers; exact attention: the KV cache n·(d+d_v) float32 "
                    "numbers"),
    "beta": Metric(long_name="inverse temperature", units="1", description="β = beta_factor · ln(num_pairs)"),
}


def run_cell(params, rng, device):
    label, r, n = params["estimator"], params["num_features"], params["num_pairs"]
    if not applicable(ESTIMATORS, label, r, n, slot=FIXED_DIMENSION_SLOT):
        return not_applicable(METRICS)
    name, options = ESTIMATORS[label]
    beta = tasks.log_n_beta(n, params["beta_factor"])
    ep = tasks.associative_recall(n, dim=KEY_DIM, value_dim=VALUE_DIM, num_candidates=NUM_CANDIDATES,
                                  num_queries=min(n, MAX_QUERIES), batch=EPISODES, rng=rng, device=device)
    read, exact = readout.paired_readouts(name, ep.queries, ep.keys, ep.values, beta=beta, num_features=r, rng=rng,
                                        options=options)
    return {
        "accuracy": tasks.recall_accuracy(read.output, ep).mean().cpu().numpy(),
        "accuracy_numerator": tasks.recall_accuracy(read.numerator, ep).mean().cpu().numpy(),
        "accuracy_exact": tasks.recall_accuracy(exact.output, ep).mean().cpu().numpy(),
        **readout_metrics(read, exact),
        "beta": np.float64(beta),
    }


# ---------------------------------------------------------------------------------------------------- figure
def _median(ds, var, **sel):
    med, _, _ = median_band(ds[var].sel(**sel), dim="seed")
    return med


def _tradeoff_panel(ax, ds, labels, n, factor):
    for label in labels:
        acc = _median(ds, "accuracy", estimator=label, num_pairs=n, beta_factor=factor).values
        size = _median(ds, "state_bytes", estimator=label, num_pairs=n, beta_factor=factor).values
        keep = np.isfinite(acc) & np.isfinite(size)
        if not keep.any():
            continue
        style = icl_style(label)
        if label == "exact":
            ax.plot(size[keep], acc[keep], marker="*", markersize=11, linestyle="none", color=style["color"],
                    label="exact (KV cache)")
        elif keep.sum() == 1:
            ax.plot(size[keep], acc[keep], marker=style["marker"], markersize=7, linestyle="none",
                    color=style["color"], label=label)
        else:
            ax.plot(size[keep], acc[keep], **style)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("state size (bytes, float32)")
    ax.set_ylabel("recall accuracy")
    ax.set_title(f"n = {n} pairs, β = {factor:g}·ln n")


def _load_panel(ax, ds, labels, factor):
    """Accuracy against n / r, one thin line per (estimator, r) joining the context lengths."""
    for label in labels:
        if label == "exact":
            continue
        acc = _median(ds, "accuracy", estimator=label, beta_factor=factor)         # (num_features, num_pairs)
        dim = _median(ds, "feature_dim", estimator=label, beta_factor=factor)
        style = icl_style(label)
        first = True
        for r in acc.num_features.values:
            a = acc.sel(num_features=r).values
            load = acc.num_pairs.values / dim.sel(num_features=r).values
            keep = np.isfinite(a) & np.isfinite(load)
            if not keep.any():
                continue
            ax.plot(load[keep], a[keep], color=style["color"], marker=style["marker"], linestyle=style["linestyle"],
                    linewidth=0.8, alpha=0.85, label=label if first else None)
            first = False
    load = np.logspace(-6, 8, 300, base=2)
    ax.plot(load, np.minimum(1.0, 1.0 / load), color="0.3", linestyle=(0, (4, 3)), linewidth=1.0,
            label="min(1, r/n)")
    ax.axvline(1.0, color="0.5", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("load n / r (stored pairs per state feature)")
    ax.set_ylabel("recall accuracy")
    ax.set_title(f"capacity, β = {factor:g}·ln n")


def plot(ds: xr.Dataset, path) -> None:
    labels = [str(v) for v in ds.estimator.values]
    ns = [int(v) for v in ds.num_pairs.values]
    factors = sorted(float(v) for v in ds.beta_factor.values)
    sharp, soft = factors[-1], factors[0]
    ncols = max(len(ns), 2)
    fig, axes = new_figure(2, ncols, squeeze=False, height=6.6)
    for j, n in enumerate(ns):
        _tradeoff_panel(axes[0, j], ds, labels, n, sharp)
    load_factors = [sharp] + ([soft] if soft != sharp and ncols >= 3 else [])
    for j, factor in enumerate(load_factors):
        _load_panel(axes[1, j], ds, labels, factor)
    handles, names = legend_entries(axes.flat)
    for ax in list(axes[0, len(ns):]) + list(axes[1, len(load_factors):]):
        ax.axis("off")
    axes[1, -1].legend(handles, names, loc="center", ncol=2, frameon=False)
    exact_acc = float(ds.accuracy_exact.median())
    save_figure(fig, path, (
        "Training-free continuous associative recall (d = d_v = 64 random unit keys and values, decoded among 4096 "
        "candidate values). Top: accuracy against the memory the queries read (Zoology/Based convention: "
        "r·(d_v+1) float32 numbers for a linear state; the KV cache n·(d+d_v) for exact attention, star) at "
        f"β = {sharp:g}·ln n; lines join one estimator's ranks, single markers are fixed-dimension maps. Bottom: "
        "the same accuracies against the load n/r (one line per estimator and r, joining context lengths); dashed: "
        "the landmark law min(1, r/n); vertical line: n = r (capacity ≈ feature dimension, Schlag et al. 2021). "
        "Nyström maps fitted on the context also hold their r landmark keys (r·d numbers), not counted here. "
        f"Median over seeds of the mean over {EPISODES} episodes; exact attention's median accuracy over all cells "
        f"is {exact_acc:.3f}."),
        title="Associative recall against state size")


EXPERIMENT = Experiment(
    name="icl_recall", title="Training-free associative recall: accuracy against state size and stored pairs",
    description="How much memory does a kernel approximation need to recall n stored key-value pairs, and at "
                "which load does each estimator fail? Grid: estimator × num_features × num_pairs × beta_factor "
                "(β = factor·ln n) × seed.",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
