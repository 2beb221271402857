"""How fast does the kernel-matrix error fall with the number of features, for every consistent estimator?

Inputs: ``n`` queries and keys from the isotropic Gaussian family (:mod:`kernapprox.distributions`) in ``d = 32``
at two temperatures ``beta`` (``E‖q‖² = E‖k‖² = beta·√d``, so ``‖q‖‖k‖/√d ≈ beta``; the measured value is stored
as ``beta_eff``). Each cell draws ``(q, k)`` (the same for every estimator and rank at a given temperature and
seed: paired comparisons), fits the estimator with ``r`` features on them and compares
``φ(Q)φ(K)ᵀ`` (or the estimator's own ``kernel_matrix``) with ``exp(QKᵀ/√d)`` in float64.

Estimators: every registry name whose estimator is consistent (its ``consistent`` attribute, else ``unbiased``),
found at import time, so new estimators join the grid by registering. ``kernel_svd`` (the truncated SVD of
the exact matrix) is the floor no rank-``r`` approximation can beat. ``num_features`` is the state dimension
``r`` (trigonometric and hyperbolic maps use ``r/2`` frequencies); hybrids add an exact window of keys to their
``r`` features.
"""

from __future__ import annotations

import torch
from matplotlib.lines import Line2D

import kernapprox as ka
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.metrics import max_relative_entry_error, relative_frobenius_error
from kernapprox.plotting import (
    estimator_style,
    loglog_rank_axes,
    median_band,
    new_figure,
    plot_median_band,
    reference_slope,
    save_figure,
    split_estimator_name,
)
from kernapprox.sweep import Experiment, Metric, run_cli

DIM = 32
FLOOR = "kernel_svd"
CLASSIC = ("trig", "positive", "hyperbolic", "maclaurin")       # data-independent, Performer-era maps
DATA_DEPENDENT = ("nystrom", "scatterbrain", "window", "attention", FLOOR.split("_")[0])


def consistent_estimators() -> list[str]:
    """Registry names of the estimators whose error vanishes as ``r`` grows (``exact`` excluded)."""
    return [name for name in ka.available_estimators()
            if ka.capabilities(name).kind != "exact" and ka.capabilities(name).consistent]


ESTIMATORS = consistent_estimators()
SMOKE = [n for n in ("positive", "trig", FLOOR) if n in ESTIMATORS]

GRIDS = {
    "smoke": {"estimator": SMOKE, "num_features": [8, 32], "beta": [1.0], "seq_len": [64], "seed": [0]},
    "default": {"estimator": ESTIMATORS, "num_features": [8, 16, 32, 64, 128], "beta": [1.0, 2.0],
                "seq_len": [256], "seed": [0, 1, 2, 3, 4]},
    "full": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128, 256, 512, 1024],
             "beta": [0.5, 1.0, 2.0, 4.0, 8.0], "seq_len": [1024], "seed": list(range(10))},
}

METRICS = {
    "kernel_rel_fro": Metric(long_name="relative Frobenius error of the kernel matrix", units="1",
                             description="‖Â−A‖_F/‖A‖_F with A = exp(QKᵀ/√d), float64; inf if Â is not finite"),
    "kernel_max_rel": Metric(long_name="largest relative entry error of the kernel matrix", units="1",
                             description="max_ij |Â_ij−A_ij|/A_ij"),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="mean over pairs of ‖q_i‖‖k_j‖/√d of the drawn inputs"),
}


def run_cell(params, rng, device, data_rng):
    dist = make_distribution("isotropic", beta=params["beta"])
    q, k, _ = dist.sample(params["seq_len"], d=DIM, rng=data_rng, device=device, dtype=torch.float64)
    q, k = q[0, 0], k[0, 0]                                                    # (n, d)
    name = params["estimator"]
    r = None if ka.capabilities(name).fixed_dimension else params["num_features"]
    est = ka.make_estimator(name, num_features=r, rng=rng).fit(q, k)
    approx = est.kernel_matrix(q, k)
    exact = ka.kernel_matrix(q, k)
    return {"kernel_rel_fro": relative_frobenius_error(approx, exact).item(),
            "kernel_max_rel": max_relative_entry_error(approx, exact).item(),
            "beta_eff": effective_beta(q, k).item()}


# ------------------------------------------------------------------------------------------------------ plot
def _panel_of(name: str) -> int:
    family, _ = split_estimator_name(name)
    if family in CLASSIC:
        return 0
    if family in DATA_DEPENDENT or name == FLOOR:
        return 2
    return 1


def _sampler_ratios(err, names):
    """Median over seeds of err(family_sampler)/err(family) at the largest r, per family and sampler."""
    top = err.num_features.values.max()
    med = median_band(err.sel(num_features=top), dim="seed")[0]
    rows = []
    for name in names:
        family, variant = split_estimator_name(name)
        if variant != "iid" and family in names:
            rows.append((family, variant, float(med.sel(estimator=name) / med.sel(estimator=family))))
    return rows, int(top)


def plot(ds, path):
    n = int(ds.seq_len.values.max())
    ds = ds.sel(seq_len=n)
    err = ds["kernel_rel_fro"]
    names = [str(n) for n in ds.estimator.values]
    betas = ds.beta.values
    fig, axes = new_figure(len(betas), 4, width=15.5, height=3.0 * len(betas) + 2.2, squeeze=False)
    titles = ["trigonometric, positive, hyperbolic, Maclaurin", "exponential families (GERF, OPRF, DERF)",
              "data-dependent and hybrid", "unbiased samplers against i.i.d."]
    r = ds.num_features.values
    for row, beta in enumerate(betas):
        sub = err.sel(beta=beta)
        beta_eff = float(ds["beta_eff"].sel(beta=beta).median())
        for col in range(3):
            ax = axes[row, col]
            if col:
                ax.sharey(axes[row, 0])
            shown = [n for n in names if n != FLOOR and _panel_of(n) == col
                     and (col == 2 or split_estimator_name(n)[1] in ("iid", "orthogonal"))]
            for name in shown:
                plot_median_band(ax, sub.sel(estimator=name), x="num_features", **estimator_style(name))
            if FLOOR in names:
                plot_median_band(ax, sub.sel(estimator=FLOOR), x="num_features", color="black", linewidth=2,
                                 label="optimal rank r (floor)")
            if shown:
                y0 = float(median_band(sub.sel(estimator=shown), dim="seed")[0].isel(num_features=0).median())
                reference_slope(ax, r, 1.5 * y0)
            loglog_rank_axes(ax, ylabel="‖Â−A‖_F / ‖A‖_F" if col == 0 else None)
            ax.set_title(f"{titles[col]}\nβ = {beta:g} (measured {beta_eff:.2f})", fontsize=8.5)
            if row == len(betas) - 1:
                ax.legend(ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=6.5, frameon=False)
        ax = axes[row, 3]
        rows, top = _sampler_ratios(sub, names)
        families = sorted({f for f, _, _ in rows})
        for family, variant, ratio in rows:
            style = estimator_style(f"{family}_{variant}")
            ax.scatter(families.index(family) + (0.12 if variant == "qmc" else -0.12), ratio, color=style["color"],
                       marker=style["marker"], s=30, label=variant, edgecolor="black", linewidth=0.3)
        ax.axhline(1.0, color="0.3", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_minor_formatter(lambda v, _: f"{v:g}" if round(v, 1) in (0.5, 0.7, 2.0, 3.0) else "")
        ax.set_xticks(range(len(families)), families, rotation=40, ha="right")
        ax.set_ylabel(f"median error / i.i.d. error at r = {top}")
        ax.set_title(f"{titles[3]}\nβ = {beta:g}", fontsize=8.5)
        variants = sorted({variant for _, variant, _ in rows})
        ax.legend([Line2D([], [], linestyle="", marker=estimator_style(f"x_{v}")["marker"], color="0.4")
                   for v in variants], variants, fontsize=6.5, loc="best")
    fig.suptitle("Kernel-matrix error against the number of features", fontsize=11, fontweight="bold")
    save_figure(fig, path, (
        f"Relative Frobenius error ‖Â−A‖_F/‖A‖_F of the {n}×{n} softmax kernel matrix A = exp(QKᵀ/√d) against the "
        f"state dimension r, for isotropic Gaussian queries and keys in d = {DIM} at temperature β (rows; the same "
        f"inputs for every estimator). Lines: median over {ds.sizes['seed']} seeds; bands: 10–90 % quantiles. "
        "Colour = estimator family; solid = i.i.d. projections, dashed = orthogonal (Nyström: solid uniform, dashed "
        "k-means, dotted ridge-leverage landmarks); black = optimal rank-r approximation (truncated SVD, the floor); "
        "grey dashed = r^(-1/2) Monte Carlo rate. Right: median error with orthogonal (square) and scrambled-QMC "
        "(triangle) projections divided by the i.i.d. error, at the largest r. Hybrids also keep an exact window "
        "of keys."))


EXPERIMENT = Experiment(name="kernel_error", title="Kernel-matrix error against the number of features",
                        description=__doc__.strip().split("\n\n")[0] + " " + __doc__.strip().split("\n\n")[1],
                        grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot,
                        data_axes=("beta", "seq_len", "seed"))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
