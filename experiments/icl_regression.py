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

import numpy as np
import xarray as xr

from kernapprox import available_estimators, metrics, tasks
from kernapprox.plotting import estimator_style, median_band, new_figure, save_figure
from kernapprox.sweep import Experiment, Metric, run_cli

INPUT_DIM = 4
LENGTHSCALE = 0.7
NOISE_STD = 0.1
NUM_QUERIES = 64
EPISODES = 8
FIXED_DIMENSION_SLOT = 64

ESTIMATORS = {  # label -> (registry name or FeatureMap class, constructor options)
    "exact": ("exact", {}),
    "positive_orthogonal": ("positive_orthogonal", {}),
    "hyperbolic_orthogonal": ("hyperbolic_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "trig_orthogonal": ("trig_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "elu1": ("elu1", {}),
    "nystrom_uniform": ("nystrom_uniform", {}),
    "nystrom_kmeans": ("nystrom_kmeans", {}),
    "nystrom_rls": ("nystrom_rls", {}),
}


def available(table: dict, labels) -> list[str]:
    """The labels of ``table`` whose estimator exists: a registered name or a class given directly (grids
    adapt to what is installed)."""
    names = set(available_estimators())
    return [label for label in labels if isinstance(table[label][0], type) or table[label][0] in names]


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
    "output_rel_error": Metric(long_name="attention-output relative RMS error", units="1",
                               description="‖Ŷ−Y‖_F/‖Y‖_F against exact attention; median over episodes"),
    "nonpositive_normalizer_rate": Metric(long_name="rate of non-positive normalisers", units="1",
                                          description="fraction of queries with Σ_i φ(q)ᵀφ(k_i) ≤ 0 or not finite"),
    "state_bytes": Metric(long_name="memory read by the queries", units="byte",
                          description="r·(d_v+1) float32 numbers; exact attention: KV cache n·(d+d_v)"),
    "feature_dim": Metric(long_name="feature dimension of the state", units="1",
                          description="r as fitted (NaN for exact attention)"),
}


def applicable(table: dict, label: str, num_features: int, num_context: int, slot: int = FIXED_DIMENSION_SLOT
               ) -> bool:
    """Fixed-dimension maps run in the ``slot`` column only; landmark methods need ``r ≤ n``."""
    name, options = table[label]
    if tasks.has_fixed_dimension(name, **options):
        return num_features == slot
    return not (tasks.rank_limited_by_points(name) and num_features > num_context)


def run_cell(params, rng, device):
    label, r, n, beta = params["estimator"], params["num_features"], params["num_context"], params["beta"]
    if not applicable(ESTIMATORS, label, r, n):
        return {name: np.float64(np.nan) for name in METRICS}
    name, options = ESTIMATORS[label]
    ep = tasks.smooth_regression(n, dim=INPUT_DIM, num_queries=NUM_QUERIES, lengthscale=LENGTHSCALE,
                                 noise_std=NOISE_STD, batch=EPISODES, rng=rng, device=device)
    exact = tasks.attention_readout("exact", ep.x_query, ep.x, ep.y, beta=beta)
    read = exact if name == "exact" else tasks.attention_readout(
        name, ep.x_query, ep.x, ep.y, beta=beta, num_features=r, rng=rng, options=options)
    return {
        "nmse": tasks.normalized_mse(read.output, ep).median().cpu().numpy(),
        "nmse_exact": tasks.normalized_mse(exact.output, ep).median().cpu().numpy(),
        "output_rel_error": metrics.relative_rms_error(read.output, exact.output).median().cpu().numpy(),
        "nonpositive_normalizer_rate": metrics.nonpositive_normalizer_rate(read.normalizer).mean().cpu().numpy(),
        "state_bytes": np.float64(np.nan if read.state_bytes is None else read.state_bytes),
        "feature_dim": np.float64(np.nan if read.num_features is None else read.num_features),
    }


# ---------------------------------------------------------------------------------------------------- figure
STYLE_OVERRIDES = {  # variants of one family that the house style would draw alike
    "nystrom_uniform": {"marker": "o", "linestyle": "-."},
    "nystrom_kmeans": {"marker": "D", "linestyle": "-"},
    "nystrom_rls": {"marker": "^", "linestyle": ":"},
    "dpfp_nu1": {"marker": "*"},
    "dpfp_nu2": {"marker": ">"},
    "dpfp_nu3": {"marker": "P"},
}


def style(label: str) -> dict:
    """The house style of an estimator label, with distinct markers for variants of one family."""
    return {**estimator_style(label), **STYLE_OVERRIDES.get(label, {})}


def rank_panel(ax, ds: xr.Dataset, var: str, labels, **sel) -> None:
    """``var`` (median over seeds) against the fitted feature dimension, one line per estimator; maps with a
    single applicable rank are drawn as one marker. Exact attention is left to the caller."""
    for label in labels:
        if label == "exact":
            continue
        y, _, _ = median_band(ds[var].sel(estimator=label, **sel), dim="seed")
        x, _, _ = median_band(ds["feature_dim"].sel(estimator=label, **sel), dim="seed")
        y, x = np.asarray(y.values, dtype=float), np.asarray(x.values, dtype=float)
        keep = np.isfinite(x) & ~np.isnan(y)
        if not keep.any():
            continue
        kw = style(label)
        y = np.where(np.isinf(y), np.nan, y)                     # a failed read-out leaves a gap
        if keep.sum() == 1:
            ax.plot(x[keep], y[keep], marker=kw["marker"], markersize=7, linestyle="none", color=kw["color"],
                    label=label)
        else:
            ax.plot(x[keep], y[keep], **kw)
    ax.set_xscale("log", base=2)


def collect_legend(fig, axes) -> None:
    """One legend for the whole figure, outside the panels on the right (no entry twice)."""
    handles, names = [], []
    for ax in axes:
        for h, nm in zip(*ax.get_legend_handles_labels()):
            if nm not in names:
                handles.append(h)
                names.append(nm)
    fig.legend(handles, names, loc="outside right center", fontsize=7, frameon=False)


def plot(ds: xr.Dataset, path) -> None:
    labels = [str(v) for v in ds.estimator.values]
    betas = [float(v) for v in ds.beta.values]
    ns = [int(v) for v in ds.num_context.values]
    fig, axes = new_figure(len(betas), len(ns), squeeze=False, sharey=True, width=4.0 * len(ns) + 1.8)
    for i, beta in enumerate(betas):
        for j, n in enumerate(ns):
            ax = axes[i, j]
            rank_panel(ax, ds, "nmse", labels, num_context=n, beta=beta)
            ex = float(ds.nmse_exact.sel(num_context=n, beta=beta).median())
            ax.axhline(ex, color=estimator_style("exact")["color"], linestyle="--", linewidth=1.2,
                       label="exact attention")
            ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.0, label="context mean (nMSE = 1)")
            ax.set_yscale("log")
            ax.set_ylim(0.02, 30)
            ax.set_xlabel("feature dimension r of the state")
            ax.set_ylabel("normalised MSE")
            ax.set_title(f"n = {n}, β = {beta:g} (exact: {ex:.3f})")
    collect_legend(fig, axes.flat)
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
