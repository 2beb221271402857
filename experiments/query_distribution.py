"""How the error of each estimator depends on the query/key distribution, read against the effective temperature.

Each cell draws one ``(q, k, v)`` sample of one distribution at one nominal temperature ``beta`` (``n`` tokens,
several heads, ``d = 32``, float64) and evaluates every estimator at every rank on that same sample (a paired
comparison): relative Frobenius error of the kernel matrix ``exp(s QKᵀ)``, relative RMS error of the
non-causal attention output, and the fraction of queries whose estimated normaliser is ≤ 0. Each head gets its
own fit (random features: an independent draw; Nyström: landmarks from that head's queries and keys). The
sample's measured effective temperature ``β_eff = s · mean‖q‖ · mean‖k‖`` (and the logit spread) is stored, so
the figure reads every error against ``β_eff``: positive features degrade like ``exp(‖x + y‖²)`` (Performer
Lemma 2), trigonometric ones like ``exp(‖x‖² + ‖y‖²)`` with normalisers that turn negative.

Families: the synthetic ones of :mod:`kernapprox.distributions` at ``beta`` ∈ the grid, and ``real_L0``…``real_L5``:
heads of that layer of all-MiniLM-L6-v2 on Python's help text at their own temperature (run at ``beta = 1.0``
only; other ``beta`` values are NaN for them). Without the ``real`` extra the real values leave the grid with a
warning. The real model is bidirectional; attention here is non-causal throughout.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

import kernapprox as ka
from kernapprox import metrics, real
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.sweep import Experiment, Metric, run_cli

WANTED_ESTIMATORS = ["positive", "positive_orthogonal", "trig", "hyperbolic_orthogonal", "oprf", "nystrom_uniform",
                     "nystrom_kmeans", "nystrom_rls", "kernel_svd"]
ESTIMATORS = [e for e in WANTED_ESTIMATORS if e in ka.available_estimators()]
NUM_FEATURES = [16, 64, 256]
SYNTHETIC = {  # axis value -> (registered name, parameters other than beta)
    "isotropic": ("isotropic", {}),
    "anisotropic": ("anisotropic", {"decay": 1.0}),
    "clustered": ("clustered", {"num_clusters": 8, "spread": 0.25}),
    "heavy_tailed": ("heavy_tailed", {"dof": 3.0}),
    "text_like": ("text_like", {}),
    "continuous": ("continuous", {"length_scale": 8.0}),
}
REAL_BETA = 1.0          # the beta value at which real heads (which have their own temperature) are run
HEADS = {"synthetic": 2, "real": 4}   # heads per cell (real: drawn without replacement from the layer's 12)
REAL_VALUES = [f"real_L{i}" for i in range(real.NUM_LAYERS)]
REAL_REASON = real.unavailable_reason()
if REAL_REASON is not None:
    warnings.warn(f"query_distribution: the real-model axis values are skipped: {REAL_REASON}", stacklevel=1)


def _grids(real_available: bool) -> dict:
    real_values = REAL_VALUES if real_available else []
    return {
        "smoke": {"distribution": ["isotropic", "text_like", *real_values[:1]], "beta": [1.0],
                  "seq_len": [64], "seed": [0]},
        "default": {"distribution": [*SYNTHETIC, *real_values], "beta": [0.5, 1.0, 2.0, 4.0, 8.0, 16.0],
                    "seq_len": [256], "seed": [0]},
        "full": {"distribution": [*SYNTHETIC, *real_values], "beta": [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                 "seq_len": [512], "seed": [0, 1, 2, 3, 4, 5, 6, 7]},
    }


GRIDS = _grids(REAL_REASON is None)

_PER = ("estimator", "num_features")
_COORDS = {"estimator": ESTIMATORS, "num_features": NUM_FEATURES}
METRICS = {
    "kernel_rel_fro": Metric(long_name="relative Frobenius error of the kernel matrix", units="1",
                             description="‖Â − A‖_F/‖A‖_F, A = exp(s QKᵀ); median over heads", dims=_PER,
                             coords=_COORDS),
    "attention_rel_rms": Metric(long_name="relative RMS error of the attention output", units="1",
                                description="non-causal; sqrt(Σ‖ŷ−y‖²)/sqrt(Σ‖y‖²) per head, median over heads",
                                dims=_PER, coords=_COORDS),
    "nonpositive_rate": Metric(long_name="fraction of non-positive normalisers", units="1",
                               description="queries with Σ_j φ(q)ᵀφ(k_j) ≤ 0 or non-finite, mean over heads",
                               dims=_PER, coords=_COORDS),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="s · mean_i‖q_i‖ · mean_j‖k_j‖ (mean over all pairs of s‖q_i‖‖k_j‖), median "
                                   "over heads"),
    "beta_eff_max": Metric(long_name="largest possible logit", units="1",
                           description="s · max‖q_i‖ · max‖k_j‖, median over heads"),
    "logit_std": Metric(long_name="spread of the logits", units="1",
                        description="standard deviation of s q_iᵀk_j over all pairs, median over heads"),
}
_NAN = {name: np.nan for name in METRICS}


def distribution_for(value: str, beta: float):
    """The :class:`~kernapprox.distributions.Distribution` behind an axis value (None: not run at this beta)."""
    if value in SYNTHETIC:
        name, params = SYNTHETIC[value]
        return make_distribution(name, beta=beta, **params)
    if value in REAL_VALUES:
        if beta != REAL_BETA:
            return None
        return make_distribution("real", layer=int(value.removeprefix("real_L")))
    raise ValueError(f"unknown distribution axis value {value!r}")


def _applicable(name: str, m: int, n: int) -> bool:
    if name.startswith("nystrom_"):
        return m <= 2 * n                     # landmarks are drawn from the n queries and n keys of one head
    return True


def evaluate_head(q, k, v, name: str, m: int, seed: int, exact_kernel, exact_output) -> tuple[float, float, float]:
    """(kernel error, attention error, non-positive rate) of estimator ``name`` with ``m`` features fitted on one
    head ``(n, d)``, against that head's exact kernel matrix and non-causal attention output."""
    est = ka.make_estimator(name, num_features=m, rng=seed).fit(q, k)
    kernel_err = metrics.relative_frobenius_error(est.kernel_matrix(q, k), exact_kernel)
    parts = ka.linear_attention(q, k, v, est, causal=False, mode="parallel", return_parts=True)
    attn_err = metrics.relative_rms_error(parts.output, exact_output)
    bad = metrics.nonpositive_normalizer_rate(parts.normalizer)
    return float(kernel_err), float(attn_err), float(bad)


def run_cell(params, rng, device):
    dist = distribution_for(params["distribution"], params["beta"])
    if dist is None:
        return dict(_NAN)
    if params["distribution"] in REAL_VALUES and REAL_REASON is not None:
        warnings.warn(f"skipping {params['distribution']}: {REAL_REASON}", stacklevel=1)
        return dict(_NAN)
    n = params["seq_len"]
    heads = HEADS["real" if params["distribution"] in REAL_VALUES else "synthetic"]
    q, k, v = dist.sample(n, heads=heads, rng=rng, device=device, dtype=torch.float64)
    q, k, v = q[0], k[0], v[0]                                             # (heads, n, d)
    shape = (len(ESTIMATORS), len(NUM_FEATURES), heads)
    errs = {key: np.full(shape, np.nan) for key in ("kernel", "attention", "bad")}
    seeds = rng.integers(0, 2**63, size=shape)
    exact_kernel = ka.kernel_matrix(q, k)
    exact_output = ka.softmax_attention(q, k, v)
    for h in range(heads):
        for e, name in enumerate(ESTIMATORS):
            for j, m in enumerate(NUM_FEATURES):
                if _applicable(name, m, n):
                    out = evaluate_head(q[h], k[h], v[h], name, m, int(seeds[e, j, h]), exact_kernel[h],
                                        exact_output[h])
                    errs["kernel"][e, j, h], errs["attention"][e, j, h], errs["bad"][e, j, h] = out
    s = 1.0 / np.sqrt(q.shape[-1])
    logits = s * (q @ k.transpose(-1, -2))
    return {
        "kernel_rel_fro": np.median(errs["kernel"], -1),
        "attention_rel_rms": np.median(errs["attention"], -1),
        "nonpositive_rate": errs["bad"].mean(-1),
        "beta_eff": float(effective_beta(q, k).median()),
        "beta_eff_max": float(effective_beta(q, k, statistic="max").median()),
        "logit_std": float(logits.std(dim=(-1, -2)).median()),
    }


# --------------------------------------------------------------------------------------------------- figure
FAMILY_ORDER = [*SYNTHETIC]
PLOT_FEATURES = 64


def _family_colors():
    import seaborn as sns

    return dict(zip(FAMILY_ORDER, sns.color_palette("colorblind", len(FAMILY_ORDER)).as_hex()))


def _layer_colors(count):
    import seaborn as sns

    return sns.color_palette("rocket", count + 2).as_hex()[1:-1]


def _against_beta(ax, ds, var, estimator, m, families, real_values, colors, layer_colors, label=True):
    """One panel: ``var`` (median over seeds) against the measured β_eff, a line per synthetic family over its
    beta grid and one marker per real layer."""
    da = ds[var].sel(estimator=estimator, num_features=m).isel(seq_len=0)
    beta = ds["beta_eff"].isel(seq_len=0)
    for fam in families:
        y = da.sel(distribution=fam).median("seed").values
        x = beta.sel(distribution=fam).median("seed").values
        ok = np.isfinite(x) & np.isfinite(y) & (y > 0)
        ax.plot(x[ok], y[ok], marker="o", color=colors[fam], label=fam if label else None)
    for i, value in enumerate(real_values):
        y = da.sel(distribution=value).values.ravel()
        x = beta.sel(distribution=value).values.ravel()
        ok = np.isfinite(x) & np.isfinite(y) & (y > 0)
        ax.scatter(x[ok], y[ok], marker="D", s=22, color=layer_colors[i], edgecolor="black", linewidth=0.4,
                   zorder=3, label=f"real layer {value.removeprefix('real_L')}" if label else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")


def _floor(ax, bottom=1e-4):
    """Errors below ``bottom`` (the exact optimum at r ≥ n) sit on the axis instead of stretching it."""
    lo, hi = ax.get_ylim()
    if lo < bottom < hi:
        ax.set_ylim(bottom, hi)


def plot(ds, path):
    from kernapprox import plotting

    estimators = [str(e) for e in ds.estimator.values]
    values = [str(v) for v in ds.distribution.values]
    families = [f for f in FAMILY_ORDER if f in values]
    real_values = [v for v in values if v.startswith("real_L")]
    nums = [int(m) for m in ds.num_features.values]
    m = PLOT_FEATURES if PLOT_FEATURES in nums else nums[len(nums) // 2]
    colors, layer_colors = _family_colors(), _layer_colors(max(len(real_values), 1))
    ncols = 4
    nrows = -(-(len(estimators) + 3) // ncols)
    fig, axes = plotting.new_figure(nrows, ncols, width=15.5, height=3.0 * nrows + 0.6, squeeze=False)
    axes = axes.ravel()
    for i, est in enumerate(estimators):
        ax = axes[i]
        _against_beta(ax, ds, "attention_rel_rms", est, m, families, real_values, colors, layer_colors,
                      label=i == 0)
        ax.set_title(f"{est} (r = {m})")
        ax.set_xlabel("measured β_eff = s·mean‖q‖·mean‖k‖")
        ax.set_ylabel("attention output rel. error")
        ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
        _floor(ax)
    axes[0].legend(loc="upper left", ncol=2, fontsize=6.5)

    ref = "isotropic" if "isotropic" in values else families[0]
    ax = axes[len(estimators)]
    da, beta = ds["kernel_rel_fro"].isel(seq_len=0), ds["beta_eff"].isel(seq_len=0)
    for est in estimators:
        y = da.sel(distribution=ref, estimator=est, num_features=m).median("seed").values
        x = beta.sel(distribution=ref).median("seed").values
        ok = np.isfinite(y) & (y > 0)
        ax.plot(x[ok], y[ok], **plotting.estimator_style(est))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _floor(ax)
    ax.set_title(f"kernel matrix error, {ref} (r = {m})")
    ax.set_xlabel("measured β_eff")
    ax.set_ylabel("‖Â − A‖_F / ‖A‖_F")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[len(estimators) + 1]
    rate = ds["nonpositive_rate"].isel(seq_len=0)
    for est in estimators:
        r = rate.sel(estimator=est, num_features=m)
        if not bool((r.fillna(0) > 0).any()):
            continue
        y = r.sel(distribution=ref).median("seed").values
        x = beta.sel(distribution=ref).median("seed").values
        ax.plot(x, y, **plotting.estimator_style(est))
        for i, value in enumerate(real_values):
            ax.scatter(beta.sel(distribution=value).values.ravel(), r.sel(distribution=value).values.ravel(),
                       marker="D", s=18, color=layer_colors[i], edgecolor=plotting.estimator_style(est)["color"],
                       linewidth=0.8, zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 0.62)
    ax.set_title(f"non-positive normalisers (r = {m})")
    ax.set_xlabel("measured β_eff (line: isotropic; ◆: real layers)")
    ax.set_ylabel("fraction of queries")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)

    ax = axes[len(estimators) + 2]
    if real_values:
        da = ds["attention_rel_rms"].isel(seq_len=0).sel(distribution=real_values)
        stacked = da.stack(sample=("distribution", "beta", "seed")).dropna("sample", how="all")
        title = "real heads, all layers"
    else:
        stacked = ds["attention_rel_rms"].isel(seq_len=0).sel(distribution=ref).stack(sample=("beta", "seed"))
        title = f"{ref}, all beta"
    for est in estimators:
        line = stacked.sel(estimator=est)
        med, lo, hi = plotting.median_band(line, dim="sample", q=(0.25, 0.75))
        ok = np.isfinite(med.values)
        style = plotting.estimator_style(est)
        ax.plot(med.num_features.values[ok], med.values[ok], **style)
        ax.fill_between(med.num_features.values[ok], lo.values[ok], hi.values[ok], color=style["color"],
                        alpha=0.12, linewidth=0)
    plotting.loglog_rank_axes(ax, ylabel="attention output rel. error")
    _floor(ax)
    ax.set_title(f"error vs rank, {title}")
    for ax in axes[len(estimators) + 3:]:
        ax.set_visible(False)
    n = int(ds.seq_len.values[0])
    fig.suptitle("Estimator error against the effective temperature of queries and keys")
    plotting.save_figure(fig, path, (
        f"Panels 1–{len(estimators)}: relative RMS error of the non-causal attention output at r = {m} features "
        f"against the measured β_eff of the sample (n = {n}, d = 32), median over seeds of the median over heads; "
        "lines: synthetic families over their nominal beta grid; diamonds: heads of all-MiniLM-L6-v2 on Python's "
        f"help text, one per layer and seed (their own temperature). Then: kernel-matrix error on the {ref} family; "
        "fraction of queries whose estimated normaliser is ≤ 0 (signed estimators only); error against rank on "
        "the real heads (median and interquartile band over layers and seeds)."))


EXPERIMENT = Experiment(
    name="query_distribution",
    title="Estimator error against the query/key distribution and its effective temperature",
    description=("How the kernel and attention errors of random-feature, Nyström and optimal low-rank estimators "
                 "depend on the distribution of queries and keys (isotropic, anisotropic, clustered, heavy-tailed, "
                 "text-like, continuous; real all-MiniLM-L6-v2 heads per layer), read against the measured "
                 "effective temperature β_eff. Grid: distribution × nominal beta × n × seed; each cell evaluates "
                 "every estimator at every rank on one shared sample."),
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
