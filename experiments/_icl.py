"""What the in-context-learning experiments share: estimator tables, applicability, read-out metrics, figures.

The experiments ``icl_recall``, ``icl_regression``, ``icl_classification`` and ``rank_summary`` describe their
estimators by a table ``label -> (registry name or FeatureMap class, constructor options)`` and run every
estimator on the same grid axis ``num_features``; the rules below decide which cells are run, what every cell
records about its read-out, and how results are drawn against the fitted feature dimension.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from kernapprox import available_estimators, metrics, readout
from kernapprox.plotting import estimator_style, median_band, new_figure
from kernapprox.sweep import Metric

FIXED_DIMENSION_SLOT = 64  # the num_features column in which fixed-dimension maps run

# The estimators of the regression and classification studies. Left out: the optimal rank-r oracle (see
# rank_summary) and the position-based hybrids, since a context that is a set has no positions to relate.
SET_CONTEXT_ESTIMATORS = {  # label -> (registry name or FeatureMap class, constructor options)
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


# ------------------------------------------------------------------------------------------- grid and cells
def available(table: dict, labels) -> list[str]:
    """The labels of ``table`` whose estimator exists: a registered name or a class given directly (grids
    adapt to what is installed)."""
    names = set(available_estimators())
    return [label for label in labels if isinstance(table[label][0], type) or table[label][0] in names]


def applicable(table: dict, label: str, num_features: int, num_context: int, slot: int = FIXED_DIMENSION_SLOT
               ) -> bool:
    """Fixed-dimension maps run in the ``slot`` column only; landmark methods need ``r ≤ n``."""
    name, options = table[label]
    caps = readout.estimator_capabilities(name, **options)
    if caps.fixed_dimension:
        return num_features == slot
    return not (caps.rank_limited_by_points and num_features > num_context)


def not_applicable(metric_table: dict) -> dict:
    """The result of a cell that is not run: NaN for every metric."""
    return {name: np.float64(np.nan) for name in metric_table}


READOUT_DESCRIPTIONS = {  # metric -> default description of what readout_metrics records
    "output_rel_error": "‖Ŷ−Y‖_F/‖Y‖_F against exact attention; median over episodes",
    "nonpositive_normalizer_rate": "fraction of queries with Σ_i φ(q)ᵀφ(k_i) ≤ 0 or not finite",
    "state_bytes": "r·(d_v+1) float32 numbers; exact attention: KV cache n·(d+d_v)",
    "feature_dim": "r as fitted (NaN for exact attention)",
}


def readout_metric_table(**descriptions: str) -> dict[str, Metric]:
    """The declarations of the metrics :func:`readout_metrics` records, in its order; a keyword replaces the
    default description (:data:`READOUT_DESCRIPTIONS`) of the metric it names."""
    unknown = sorted(set(descriptions) - set(READOUT_DESCRIPTIONS))
    if unknown:
        raise ValueError(f"no read-out metric named {', '.join(unknown)}; known: {', '.join(READOUT_DESCRIPTIONS)}")
    text = {**READOUT_DESCRIPTIONS, **descriptions}
    return {
        "output_rel_error": Metric(long_name="attention-output relative RMS error", units="1",
                                   description=text["output_rel_error"]),
        "nonpositive_normalizer_rate": Metric(long_name="rate of non-positive normalisers", units="1",
                                              description=text["nonpositive_normalizer_rate"]),
        "state_bytes": Metric(long_name="memory read by the queries", units="byte", description=text["state_bytes"]),
        "feature_dim": Metric(long_name="feature dimension of the state", units="1", description=text["feature_dim"]),
    }


def readout_metrics(read: readout.Readout, exact: readout.Readout) -> dict:
    """What every cell records of a read-out against exact attention on the same episodes: the median over
    episodes of the output's relative RMS error, the rate of non-positive normalisers, the state size and the
    fitted feature dimension (NaN where the read-out has none, e.g. exact attention)."""
    return {
        "output_rel_error": metrics.relative_rms_error(read.output, exact.output).median().cpu().numpy(),
        "nonpositive_normalizer_rate": metrics.nonpositive_normalizer_rate(read.normalizer).mean().cpu().numpy(),
        "state_bytes": np.float64(np.nan if read.state_bytes is None else read.state_bytes),
        "feature_dim": np.float64(np.nan if read.num_features is None else read.num_features),
    }


# ------------------------------------------------------------------------------------------------- figures
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


def score_panel(ax, ds: xr.Dataset, var: str, labels, *, ylabel: str, **sel) -> float:
    """:func:`rank_panel` of a task score ``var`` with exact attention's median ``<var>_exact`` on the same
    episodes as a dashed line, and the axis labels. Returns that median."""
    rank_panel(ax, ds, var, labels, **sel)
    exact = float(ds[f"{var}_exact"].sel(**sel).median())
    ax.axhline(exact, color=estimator_style("exact")["color"], linestyle="--", linewidth=1.2,
               label="exact attention")
    ax.set_xlabel("feature dimension r of the state")
    ax.set_ylabel(ylabel)
    return exact


def score_grid(ds: xr.Dataset, var: str, *, ylabel: str, decorate):
    """A figure of :func:`score_panel` panels, rows ``beta`` and columns ``num_context``, with one legend.

    ``decorate(ax, num_context, beta, exact)`` adds each panel's reference lines, limits and title. Returns
    the figure."""
    labels = [str(v) for v in ds.estimator.values]
    betas = [float(v) for v in ds.beta.values]
    ns = [int(v) for v in ds.num_context.values]
    fig, axes = new_figure(len(betas), len(ns), squeeze=False, sharey=True, width=4.0 * len(ns) + 1.8)
    for i, beta in enumerate(betas):
        for j, n in enumerate(ns):
            exact = score_panel(axes[i, j], ds, var, labels, ylabel=ylabel, num_context=n, beta=beta)
            decorate(axes[i, j], n, beta, exact)
    collect_legend(fig, axes.flat)
    return fig


def legend_entries(axes) -> tuple[list, list]:
    """``(handles, names)`` of all the axes' labelled artists, each name once, in drawing order."""
    handles, names = [], []
    for ax in axes:
        for h, nm in zip(*ax.get_legend_handles_labels()):
            if nm not in names:
                handles.append(h)
                names.append(nm)
    return handles, names


def collect_legend(fig, axes) -> None:
    """One legend for the whole figure, outside the panels on the right (no entry twice)."""
    fig.legend(*legend_entries(axes), loc="outside right center", fontsize=7, frameon=False)
