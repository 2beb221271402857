"""How fast does the kernel-matrix error fall with the number of features, for every consistent estimator?

Inputs: ``n`` queries and keys from the isotropic Gaussian family (:mod:`kernapprox.distributions`) in ``d = 32``
at two temperatures ``beta`` (``E‖q‖² = E‖k‖² = beta·√d``, so ``‖q‖‖k‖/√d ≈ beta``; the measured value is stored
as ``beta_eff``). Each cell draws ``(q, k)`` from the data stream of its temperature, length and seed (the same
for every estimator and rank: paired comparisons), fits the estimator with ``r`` features on them and compares
``φ(Q)φ(K)ᵀ`` (or the estimator's own ``kernel_matrix``) with ``exp(QKᵀ/√d)`` in float64, in row blocks for feature
maps, so that no ``n × n`` matrix beyond a 64 MiB budget is ever held.

Estimators: every registry name whose estimator is consistent (its declared ``consistent`` capability), found at
import time, so new estimators join the grid by registering; beyond ``all_estimators_max_len`` tokens only the
long-sequence set (FAVOR+, orthogonal OPRF, Nyström with uniform and k-means landmarks) runs. ``num_features`` is
the state dimension ``r`` (trigonometric and hyperbolic maps use ``r/2`` frequencies); hybrids add an exact window
of keys to their ``r`` features. The reference, computed once per data draw, holds the measured temperature and
the singular values of the exact matrix: the best rank-``r`` approximation (the kernel SVD, Eckart–Young) has the
smallest Frobenius error of any rank-``r`` matrix, so it bounds this error (and only this one) from below.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import (
    ATTENTION_SVD,
    BASELINE,
    DENSE_BUDGET_ENTRIES,
    KERNEL_SVD,
    above,
    add_comparison,
    add_paired,
    add_summaries,
    per_draw_slope,
    range_text,
    ratio_phrase,
    registered,
    resolved,
    row_blocks,
)
from kernapprox import stats
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.plotting import (
    errorbar_summary,
    estimator_lines,
    estimator_style,
    finite_values,
    fmt_ci,
    legend_below,
    loglog_rank_axes,
    new_figure,
    plot_summary,
    proxy_legend,
    save_figure,
    split_estimator_name,
)
from kernapprox.spectrum import eckart_young_errors, kernel_singular_values
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

CLASSIC = ("trig", "positive", "hyperbolic", "maclaurin")       # data-independent, Performer-era maps
DATA_DEPENDENT = ("nystrom", "scatterbrain", "window", "lara", "eva")


def consistent_estimators() -> list[str]:
    """Registry names of the estimators whose error vanishes as ``r`` grows; ``exact``, the kernel SVD (the
    reference, from the spectrum) and the attention SVD (it approximates the row-normalised matrix, not this one)
    excluded."""
    return [name for name in ka.available_estimators()
            if ka.capabilities(name).kind != "exact" and ka.capabilities(name).consistent
            and name not in (KERNEL_SVD, ATTENTION_SVD)]


ESTIMATORS = consistent_estimators()
LONG_SEQUENCE = registered("positive_orthogonal", "oprf_orthogonal", "nystrom_uniform", "nystrom_kmeans")
SMOKE = registered("positive", "positive_orthogonal", "trig", "nystrom_uniform")

GRIDS = {
    "smoke": {"estimator": SMOKE, "num_features": [8, 32], "beta": [1.0], "seq_len": [64], "seed": [0, 1, 2]},
    "default": {"estimator": ESTIMATORS, "num_features": [8, 16, 32, 64, 128], "beta": [1.0, 2.0],
                "seq_len": [256, 4096], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default to r = 256 over ten draws (~5 min of one core)
    "full": {"estimator": ESTIMATORS, "num_features": [8, 16, 32, 64, 128, 256], "beta": [1.0, 2.0],
             "seq_len": [256, 4096], "seed": list(range(10))},
}
DATA_AXES = ("beta", "seq_len", "seed")
PARAMETERS = {
    "dim": Parameter(32, long_name="head dimension d of queries and keys", units="1"),
    "all_estimators_max_len": Parameter(1024, long_name="longest sequence at which every estimator runs",
                                        units="token",
                                        description="beyond it only the long-sequence set runs (FAVOR+, orthogonal "
                                                    "OPRF, uniform and k-means Nyström); the others are NaN"),
}

METRICS = {
    "kernel_rel_fro": Metric(long_name="relative Frobenius error of the kernel matrix", units="1",
                             description="‖Â−A‖_F/‖A‖_F with A = exp(QKᵀ/√d), float64, in row blocks; inf if Â is not "
                                         "finite; NaN where the estimator does not run"),
    "kernel_max_rel": Metric(long_name="largest relative entry error of the kernel matrix", units="1",
                             description="max_ij |Â_ij−A_ij|/A_ij"),
}
REFERENCE_METRICS = {
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="mean over pairs of ‖q_i‖‖k_j‖/√d of the drawn inputs"),
    "kernel_sv": Metric(long_name="normalised singular values of the exact kernel matrix", units="1",
                        description="σ_i/σ_1 of A = exp(QKᵀ/√d), descending, NaN-padded; NaN where A has more "
                                    "entries than the dense budget (2^23)", dims=("sv_index",)),
}
AXIS_ATTRS = {"beta": {"long_name": "nominal inverse temperature β (E‖q‖² = β√d)", "units": "1"}}


def draw(params, data_rng, device):
    """The queries and keys ``(n, d)`` of one draw, read by every estimator and rank and by the reference."""
    dist = make_distribution("isotropic", beta=params["beta"])
    q, k, _ = dist.sample(params["seq_len"], d=params["dim"], rng=data_rng, device=device, dtype=torch.float64)
    return q[0, 0], k[0, 0]                                                    # (n, d)


def runs(name: str, seq_len: int, max_len: int) -> bool:
    """Whether ``name`` runs at ``seq_len``: every estimator up to ``max_len`` tokens, the long set beyond."""
    return seq_len <= max_len or name in LONG_SEQUENCE


def kernel_errors(est, q, k) -> tuple[float, float]:
    """``(‖Â−A‖_F/‖A‖_F, max_ij |Â_ij−A_ij|/A_ij)``, accumulated over row blocks of the query side for feature maps
    (estimators that bring their own attention, such as the hybrids, need the whole matrix at once, within the
    dense budget); ``inf`` if the estimate is not finite (as :mod:`kernapprox.metrics` reports it)."""
    whole = est.capabilities().kind != "features"
    if whole and q.shape[0] * k.shape[0] > DENSE_BUDGET_ENTRIES:
        raise ValueError(f"{type(est).__name__} needs the whole {q.shape[0]}×{k.shape[0]} matrix, beyond the "
                         f"dense budget of {DENSE_BUDGET_ENTRIES} entries")
    sq_err, sq_ref, worst = 0.0, 0.0, 0.0
    for rows in [slice(None)] if whole else row_blocks(q.shape[0], k.shape[0]):
        approx, exact = est.kernel_matrix(q[rows], k), ka.kernel_matrix(q[rows], k)
        if not bool(torch.isfinite(approx).all()):
            return float("inf"), float("inf")
        diff = approx.sub_(exact)                                  # in place: one block-sized buffer per block
        sq_err += float(diff.square().sum())
        sq_ref += float(exact.square().sum())
        worst = max(worst, float(diff.abs_().div_(exact).max()))
    return float(np.sqrt(sq_err / sq_ref)), worst


def run_cell(params, rng, device, data):
    name, n = params["estimator"], params["seq_len"]
    if not runs(name, n, params["all_estimators_max_len"]):
        return not_applicable()
    q, k = data
    r = None if ka.capabilities(name).fixed_dimension else params["num_features"]
    est = ka.make_estimator(name, num_features=r, rng=rng).fit(q, k)
    fro, worst = kernel_errors(est, q, k)
    return {"kernel_rel_fro": fro, "kernel_max_rel": worst}


def run_reference(params, device, data):
    q, k = data
    sv = kernel_singular_values(q, k) if q.shape[0] * k.shape[0] <= DENSE_BUDGET_ENTRIES else np.nan
    return {"beta_eff": effective_beta(q, k).item(), "kernel_sv": sv}


# ------------------------------------------------------------------------------------------------ summaries
def kernel_svd_errors(ds: xr.Dataset) -> xr.DataArray:
    """Per draw, the relative Frobenius error of the best rank-r approximation at every grid r (from the
    reference's singular values; NaN where they were not computed)."""
    sv = ds["kernel_sv"]
    ranks = ds.num_features.values.astype(int)

    def errors(values):
        values = values[np.isfinite(values)]
        if values.size == 0:
            return np.full(ranks.size, np.nan)
        err = eckart_young_errors(values)
        return np.array([err[min(r, values.size)] for r in ranks])

    out = xr.apply_ufunc(errors, sv, input_core_dims=[["sv_index"]], output_core_dims=[["num_features"]],
                         vectorize=True).assign_coords(num_features=ds.num_features)
    out.attrs = {"long_name": "relative Frobenius error of the rank-r kernel SVD", "units": "1",
                 "description": "sqrt(Σ_{i>r} σ_i²)/sqrt(Σ σ_i²) of the exact kernel matrix (Eckart–Young): the "
                                "smallest Frobenius error of any rank-r matrix; it bounds kernel_rel_fro of every "
                                "rank-r estimator, and no other metric"}
    return out


def sampler_ratios(err: xr.DataArray) -> xr.DataArray:
    """Per draw, each structured-sampler estimator's error over its i.i.d. family's (NaN elsewhere)."""
    names = [str(v) for v in err.estimator.values]
    out = xr.full_like(err, np.nan)
    for name in names:
        family, variant = split_estimator_name(name)
        if variant != "iid" and family in names:
            with np.errstate(invalid="ignore", divide="ignore"):
                out.loc[{"estimator": name}] = err.sel(estimator=name) / err.sel(estimator=family)
    out.attrs = {"long_name": "error with a structured sampler / with i.i.d. projections", "units": "1",
                 "description": "per draw, kernel_rel_fro of <family>_<sampler> divided by that of <family> on the "
                                "same inputs (NaN for i.i.d. maps and estimators without a sampler)",
                 "comparison": "ratio"}
    return out


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds["kernel_svd_rel_fro"] = kernel_svd_errors(ds)
    ds = add_comparison(ds, "sampler_ratio", sampler_ratios(ds["kernel_rel_fro"]), "seed")
    ds = add_summaries(ds, ["kernel_rel_fro", "kernel_svd_rel_fro", "beta_eff"], "seed")
    return add_paired(ds, "kernel_rel_fro", BASELINE, "seed", op="ratio", label="baseline")


# ------------------------------------------------------------------------------------------------------ plot
def _panel_of(name: str) -> int:
    family, _ = split_estimator_name(name)
    if family in CLASSIC:
        return 0
    if family in DATA_DEPENDENT:
        return 2
    return 1


def _draw_svd(ax, ds, **sel):
    plot_summary(ax, ds["kernel_svd_rel_fro_summary"].sel(**sel), "num_features", color="black", linewidth=2.0,
                 label="rank-r kernel SVD (bounds this error only)")


def plot(ds, path):
    n_short, n_long = int(ds.seq_len.values.min()), int(ds.seq_len.values.max())
    summ = ds["kernel_rel_fro_summary"]
    names = [str(n) for n in ds.estimator.values]
    betas = ds.beta.values
    long_col = n_long != n_short
    ncols = 5 if long_col else 4
    fig, axes = new_figure(len(betas), ncols, width=3.3 * ncols + 1.5, height=3.0 * len(betas) + 2.2, squeeze=False)
    titles = ["trigonometric, positive, hyperbolic, Maclaurin", "exponential families (GERF, OPRF, DERF)",
              "data-dependent and hybrid"]
    for row, beta in enumerate(betas):
        sub = summ.sel(beta=beta, seq_len=n_short)
        beta_eff = float(ds["beta_eff_summary"].sel(beta=beta, seq_len=n_short, stat="estimate"))
        for col in range(3):
            ax = axes[row, col]
            if col:
                ax.sharey(axes[row, 0])
            shown = [n for n in names if _panel_of(n) == col
                     and (col == 2 or split_estimator_name(n)[1] in ("iid", "orthogonal"))]
            estimator_lines(ax, sub, shown, slope=-0.5)
            _draw_svd(ax, ds, beta=beta, seq_len=n_short)
            loglog_rank_axes(ax, ylabel="‖Â−A‖_F / ‖A‖_F" if col == 0 else None)
            ax.set_title(f"{titles[col]}\nn = {n_short}, β = {beta:g} (measured {beta_eff:.2f})", fontsize=8.5)
            if row == len(betas) - 1:
                legend_below(ax)
        if long_col:
            ax = axes[row, 3]
            ax.sharey(axes[row, 0])
            estimator_lines(ax, summ.sel(beta=beta, seq_len=n_long), [n for n in names if n in LONG_SEQUENCE])
            _draw_svd(ax, ds, beta=beta, seq_len=n_long)
            loglog_rank_axes(ax)
            ax.set_title(f"long sequences: n = {n_long}, β = {beta:g}", fontsize=8.5)
            if row == len(betas) - 1:
                legend_below(ax, ncol=1)
        _sampler_panel(axes[row, ncols - 1], ds, beta, n_short)
    fig.suptitle("Kernel-matrix error against the number of features", fontsize=11, fontweight="bold")
    save_figure(fig, path, (
        f"Relative Frobenius error ‖Â−A‖_F/‖A‖_F of the n×n softmax kernel matrix A = exp(QKᵀ/√d) against the state "
        f"dimension r, isotropic Gaussian queries and keys in d = {int(ds['dim'])} at temperature β (rows), the same "
        f"inputs for every estimator. Lines: median over {ds.sizes['seed']} seeds; bands: its 95 % bootstrap "
        "interval. Colour = estimator family; solid = i.i.d. projections, dashed = orthogonal (Nyström: markers for "
        "uniform, k-means and ridge-leverage landmarks). Black: the rank-r kernel SVD, the smallest Frobenius error "
        "of any rank-r matrix (a bound for this metric only, not for attention outputs); grey dashed: r^(-1/2). "
        + (f"Fourth column: n = {n_long}, the long-sequence set (the SVD needs the dense matrix and is left out "
           "beyond 2^23 entries). " if long_col else "")
        + "Right: per-draw error with orthogonal (square) or scrambled-QMC (triangle) projections over the i.i.d. "
          "error on the same inputs at the largest r: median and 95 % interval; hybrids also keep an exact window."))


def _sampler_panel(ax, ds, beta, n):
    top = int(ds.num_features.values.max())
    summ = ds["sampler_ratio_summary"].sel(beta=beta, seq_len=n, num_features=top)
    rows = [(*split_estimator_name(name), summ.sel(estimator=name)) for name in finite_values(summ, "estimator")
            if split_estimator_name(name)[1] in ("orthogonal", "qmc")]
    families = sorted({f for f, _, _ in rows})
    for family, variant, s in rows:
        style = estimator_style(f"{family}_{variant}")
        errorbar_summary(ax, s, [families.index(family) + (0.15 if variant == "qmc" else -0.15)],
                         marker=style["marker"], color=style["color"], markersize=5, markeredgecolor="black",
                         markeredgewidth=0.3)
    ax.axhline(1.0, color="0.3", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_minor_formatter(lambda v, _: f"{v:g}" if round(v, 1) in (0.5, 0.7, 2.0, 3.0) else "")
    ax.set_xticks(range(len(families)), families, rotation=40, ha="right")
    ax.set_ylabel(f"error / i.i.d. error, same inputs, r = {top}")
    ax.set_title(f"structured samplers against i.i.d.\nn = {n}, β = {beta:g}", fontsize=8.5)
    proxy_legend(ax, {v: {"linestyle": "", "marker": estimator_style(f"x_{v}")["marker"], "color": "0.4"}
                      for v in sorted({variant for _, variant, _ in rows})}, fontsize=6.5, loc="best")


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    summ = ds["kernel_rel_fro_summary"]
    n_short, n_long = int(ds.seq_len.values.min()), int(ds.seq_len.values.max())
    r_top = int(ds.num_features.values.max())
    b_lo, b_hi = float(ds.beta.values.min()), float(ds.beta.values.max())
    names = [str(v) for v in ds.estimator.values]
    lines = []
    at = {"seq_len": n_short, "num_features": r_top}
    if "nystrom_kmeans" in names and "kernel_rel_fro_vs_baseline_summary" in ds:
        for beta in (b_lo,):
            km = summ.sel(estimator="nystrom_kmeans", beta=beta, **at)
            vs = ds["kernel_rel_fro_vs_baseline_summary"].sel(estimator="nystrom_kmeans", beta=beta, **at)
            svd = ds["kernel_svd_rel_fro_summary"].sel(beta=beta, **at)
            ratio_svd = stats.bootstrap_interval(
                ds["kernel_rel_fro"].sel(estimator="nystrom_kmeans", beta=beta, **at)
                / ds["kernel_svd_rel_fro"].sel(beta=beta, **at), "seed")
            lines.append(
                f"At n = {n_short}, r = {r_top} and β = {beta:g}, Nyström with k-means landmarks has kernel error "
                f"{fmt_ci(km)}; on the same draws its error is {fmt_ci(vs)} times FAVOR+'s (`{BASELINE}`) and "
                f"{fmt_ci(ratio_svd)} times the rank-{r_top} kernel SVD's ({fmt_ci(svd)}), the smallest Frobenius "
                "error of any rank-r matrix (a bound for this metric only).")
    data_independent = [n for n in names if _panel_of(n) in (0, 1) and split_estimator_name(n)[1] == "iid"]
    if data_independent and ds.sizes["num_features"] >= 2:
        slopes = per_draw_slope(ds["kernel_rel_fro"].sel(estimator=data_independent, beta=b_lo, seq_len=n_short),
                                "num_features")
        slope_summary = stats.bootstrap_interval(slopes, "seed")
        meds = slope_summary.sel(stat="estimate").values
        lo_err = summ.sel(estimator=data_independent, beta=b_lo, seq_len=n_short, stat="estimate")
        lines.append(
            f"Data-independent maps with i.i.d. projections ({len(data_independent)} of them) fall at the Monte Carlo "
            f"rate at β = {b_lo:g}: per-estimator median log–log slopes {range_text(meds)} (r^(-1/2) is −0.5), from "
            f"{range_text(lo_err.isel(num_features=0).values)} at r = {int(ds.num_features.values.min())} to "
            f"{range_text(lo_err.isel(num_features=-1).values)} at r = {r_top}.")
    if b_hi != b_lo and data_independent:
        hi_err = summ.sel(estimator=data_independent, beta=b_hi, seq_len=n_short, num_features=r_top)
        tails = hi_err.sel(stat="tail").values
        worst = data_independent[int(np.nanargmax(hi_err.sel(stat="estimate").values))]
        lines.append(
            f"At β = {b_hi:g} the same maps reach median errors {range_text(hi_err.sel(stat='estimate').values)} at "
            f"r = {r_top} (β = {b_lo:g}: {range_text(summ.sel(estimator=data_independent, beta=b_lo, seq_len=n_short, num_features=r_top, stat='estimate').values)}); "  # noqa: E501
            f"the share of draws with error above 1 is {range_text(100 * tails)} % across them, largest for `{worst}` "
            f"({fmt_ci(hi_err.sel(estimator=worst), percent=True, entry='tail')}).")
    resolved_rows, unresolved = [], []
    ratio = ds["sampler_ratio_summary"].sel(seq_len=n_short, num_features=r_top)
    for name in names:
        family, variant = split_estimator_name(name)
        if variant not in ("orthogonal", "qmc"):
            continue
        for beta in ds.beta.values:
            s = ratio.sel(estimator=name, beta=beta)
            if not np.isfinite(float(s.sel(stat="estimate"))):
                continue
            (resolved_rows if resolved(s) else unresolved).append((name, float(beta), s))
    if resolved_rows or unresolved:
        better = [f"`{n}` at β = {b:g} ({fmt_ci(s)})" for n, b, s in resolved_rows if float(s.sel(stat="hi")) < 1]
        worse = [f"`{n}` at β = {b:g} ({fmt_ci(s)})" for n, b, s in resolved_rows if float(s.sel(stat="lo")) > 1]
        lines.append(
            f"Structured samplers against i.i.d. projections of the same family (paired error ratio at r = {r_top}, "
            f"n = {n_short}): lower error for " + (", ".join(better) or "none") + "; higher for "
            + (", ".join(worse) or "none") + f"; the other {len(unresolved)} (sampler, β) pairs are not separated "
            "from 1 by their 95 % interval.")
    if n_long != n_short:
        grow, higher, same = [], [], []
        for name in [n for n in names if n in LONG_SEQUENCE]:
            a = summ.sel(estimator=name, beta=b_lo, seq_len=n_long, num_features=r_top)
            b = summ.sel(estimator=name, beta=b_lo, seq_len=n_short, num_features=r_top)
            if np.isfinite(float(a.sel(stat="estimate"))):
                grow.append(f"`{name}` {fmt_ci(b, 2)} → {fmt_ci(a, 2)}")
                (higher if above(a, b) else same).append(f"`{name}`")
        lines.append(f"From n = {n_short} to n = {n_long} at r = {r_top}, β = {b_lo:g} (median kernel error, 95 % "
                     f"interval): " + "; ".join(grow) + f". Higher at n = {n_long} with separated intervals: "
                     + (", ".join(higher) or "none") + "; not separated: " + (", ".join(same) or "none") + ".")
    hybrids = [n for n in names if split_estimator_name(n)[0] in ("scatterbrain", "window")]
    if hybrids and BASELINE in names:
        vs = ds["kernel_rel_fro_vs_baseline_summary"].sel(seq_len=n_short, num_features=r_top, beta=b_lo)
        lines.append("The hybrids keep an exact window of keys besides their features; against FAVOR+ on the same "
                     f"draws (r = {r_top}, β = {b_lo:g}) their error is " + "; ".join(
                         f"`{h}` {ratio_phrase(vs.sel(estimator=h))}" for h in hybrids) + ".")
    return lines


EXPERIMENT = Experiment.from_module(__name__, title="Kernel-matrix error against the number of features",
                                    description=" ".join(" ".join(__doc__.strip().split("\n\n")[:2]).split()))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
