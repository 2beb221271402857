"""Do the empirical mean-squared errors of the random-feature estimators match their closed forms?

For one pair ``(x, y)`` with prescribed ``‖x+y‖`` and ``‖x−y‖`` (a random orientation per seed, the same pair for
every estimator; ``‖x‖ = ‖y‖``; inputs used as is: ``scale = 1``) each cell draws ``replicates`` independent
estimators (fresh projections each time) and stores every estimate ``φ(x)ᵀφ(y)`` relative to ``SM(x, y) = exp(xᵀy)``.
The closed forms of :mod:`kernapprox.theory` sit beside the Monte Carlo values: Performer Lemma 2 for ``trig``,
``positive`` and ``hyperbolic``; Performer Theorem 2 (an upper bound) for ``positive_orthogonal``; the GERF
variance for ``gerf`` (its fixed ``A``) and ``oprf`` (``A*`` fitted on the pair). The summaries pool seeds and
replicates: the mean squared relative error with its bootstrap interval (what the closed forms predict), the
median absolute relative error with its 10/90 % quantiles and the share of draws whose error exceeds the kernel
itself (the heavy tail a mean hides), and the relative bias with its interval.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import add_mean, add_summaries, covers, range_text
from kernapprox import theory
from kernapprox.plotting import (
    errorbar_summary,
    estimator_style,
    fmt,
    fmt_ci,
    fmt_pct,
    identity_line,
    new_figure,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, Parameter, run_cli


def _lemma2(name):
    return lambda x, y, est, m: getattr(theory, f"{name}_mse")(x, y, m)


# registry name -> (closed-form MSE(x, y, fitted estimator, m), is an upper bound)
THEORY = {
    "trig": (_lemma2("trig"), False),
    "positive": (_lemma2("positive"), False),
    "hyperbolic": (_lemma2("hyperbolic"), False),
    "positive_orthogonal": (lambda x, y, est, m: theory.orthogonal_positive_mse_bound(x, y, m), True),
    "gerf": (lambda x, y, est, m: theory.gerf_variance(x, y, est.A_, m), False),
    "oprf": (lambda x, y, est, m: theory.gerf_variance(x, y, est.A_, m), False),
}
ESTIMATORS = [name for name in THEORY if name in ka.available_estimators()]
NORMS = [0.25, 0.5, 1.0, 1.5, 2.0]

GRIDS = {
    "smoke": {"estimator": ESTIMATORS, "sum_norm": [0.5, 1.5], "diff_norm": [1.0], "num_features": [16],
              "seed": [0, 1, 2]},
    "default": {"estimator": ESTIMATORS, "sum_norm": NORMS, "diff_norm": NORMS, "num_features": [16],
                "seed": [0, 1, 2, 3, 4]},
    "full": {"estimator": ESTIMATORS, "sum_norm": NORMS + [2.5], "diff_norm": NORMS + [2.5], "num_features": [16],
             "seed": list(range(10))},
}
PARAMETERS = {
    "dim": Parameter(16, "dimension d of x and y", "1"),
    "replicates": Parameter(100, "independent estimator draws per cell", "1",
                            "each draw is a fresh fit (new projections) on the cell's pair"),
}
AXIS_ATTRS = {
    "sum_norm": {"long_name": "‖x + y‖", "units": "1"},
    "diff_norm": {"long_name": "‖x − y‖", "units": "1"},
    "num_features": {"long_name": "feature dimension r (trig, hyperbolic: r/2 frequencies)", "units": "1"},
}

METRICS = {
    "estimate_ratio": Metric("estimate over the kernel", "1",
                             "φ(x)ᵀφ(y) / SM(x, y) for each independent draw of the estimator", dims=("replicate",)),
    "relative_mse_theory": Metric("closed-form relative MSE", "1",
                                  "MSE/SM² from kernapprox.theory (an upper bound where theory_is_upper_bound = 1)"),
    "theory_is_upper_bound": Metric("closed form is an upper bound", "1",
                                    "1 for Performer Theorem 2 (orthogonal features), else 0"),
    "num_frequencies": Metric("random frequencies m", "1",
                              "m in the closed forms (r/2 for trig and hyperbolic, r otherwise)"),
}
REFERENCE_METRICS = {"kernel_value": Metric("softmax kernel SM(x, y)", "1", "exp(xᵀy) of the cell's pair")}


def pair_with_norms(sum_norm: float, diff_norm: float, dim: int, rng: np.random.Generator):
    """``x, y ∈ R^dim`` with ``‖x+y‖ = sum_norm``, ``‖x−y‖ = diff_norm`` and ``x+y ⊥ x−y`` (so ``‖x‖ = ‖y‖``),
    in a uniformly random orientation."""
    basis, _ = np.linalg.qr(rng.standard_normal((dim, 2)))
    z, delta = sum_norm * basis[:, 0], diff_norm * basis[:, 1]
    return (z + delta) / 2, (z - delta) / 2


def draw(params, data_rng, device):
    """The cell's pair ``(x, y)``, the same for every estimator (a random orientation per seed)."""
    return pair_with_norms(params["sum_norm"], params["diff_norm"], params["dim"], data_rng)


def run_cell(params, rng, device, data):
    name = params["estimator"]
    x, y = data
    xt = torch.as_tensor(x[None], dtype=torch.float64, device=device)        # (1, d)
    yt = torch.as_tensor(y[None], dtype=torch.float64, device=device)
    replicates = params["replicates"]
    values = torch.empty(replicates, dtype=torch.float64, device=device)
    for i in range(replicates):  # independent draws: the estimator is the black box under test
        est = ka.make_estimator(name, num_features=params["num_features"], rng=rng, scale=1.0).fit(xt, yt)
        values[i] = est.kernel_matrix(xt, yt)[0, 0]
    sm = float(theory.softmax_kernel(x, y))
    mse_fn, is_bound = THEORY[name]
    m = getattr(est, "num_frequencies", est.num_features)
    return {"estimate_ratio": values.cpu().numpy() / sm, "relative_mse_theory": float(mse_fn(x, y, est, m)) / sm**2,
            "theory_is_upper_bound": float(is_bound), "num_frequencies": float(m)}


def run_reference(params, device, data):
    return {"kernel_value": float(theory.softmax_kernel(*data))}


# ------------------------------------------------------------------------------------------------ summaries
DRAWS = ("seed", "replicate")


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ratio = ds["estimate_ratio"]
    ds["squared_error"] = ((ratio - 1.0) ** 2).assign_attrs(
        long_name="squared relative error", units="1", description="(φ(x)ᵀφ(y)/SM − 1)² per draw")
    ds["abs_error"] = abs(ratio - 1.0).assign_attrs(
        long_name="absolute relative error", units="1", description="|φ(x)ᵀφ(y)/SM − 1| per draw")
    ds = add_mean(ds, "relative_mse_summary", ds["squared_error"], DRAWS, long_name="empirical relative MSE",
                  description="mean of squared_error over seeds and replicates")
    ds = add_mean(ds, "relative_bias_summary", ratio - 1.0, DRAWS, long_name="relative bias",
                  description="mean of φ(x)ᵀφ(y)/SM − 1")
    ds = add_summaries(ds, ["abs_error"], DRAWS)
    theory_value = ds["relative_mse_theory"].median("seed")
    ds["relative_mse_theory_pair"] = theory_value.assign_attrs(
        long_name="closed-form relative MSE of the pair", units="1",
        description="relative_mse_theory (equal for every seed's orientation of the pair: the formulas depend on "
                    "the norms only), median over seeds")
    return ds


# ------------------------------------------------------------------------------------------------------ plot
def plot(ds, path):
    fig, (ax, axr, axt) = new_figure(1, 3, width=15.5, height=4.6)
    mse = ds["relative_mse_summary"].isel(num_features=0)
    theo = ds["relative_mse_theory_pair"].isel(num_features=0)
    tail = ds["abs_error_summary"].isel(num_features=0)
    lo_t, hi_t = float(theo.min()), float(max(theo.max(), mse.sel(stat="estimate").max()))
    identity_line(ax, lo_t / 2, hi_t * 2)
    for name in ds.estimator.values:
        style = estimator_style(str(name))
        bound = bool(ds["theory_is_upper_bound"].sel(estimator=name).max())
        pairs = {"pair": ("sum_norm", "diff_norm")}
        t, e = theo.sel(estimator=name).stack(pairs), mse.sel(estimator=name).stack(pairs)
        kw = {"marker": style["marker"], "color": style["color"], "mfc": "none" if bound else style["color"],
              "ms": 4, "elinewidth": 0.7, "label": f"{name} (theory = Thm 2 bound)" if bound else str(name)}
        errorbar_summary(ax, e, t.values, **kw)
        errorbar_summary(axr, e / t, t.values, **kw)
        errorbar_summary(axt, tail.sel(estimator=name).stack(pairs), t.values, entry="tail", **kw)
    closed = {"xscale": "log", "xlabel": "closed-form relative MSE  MSE/SM²"}
    ax.set(**closed, yscale="log", ylabel="empirical relative MSE (mean over draws)",
           title="empirical against closed form")
    ax.legend(fontsize=7, loc="upper left")
    axr.axhline(1.0, color="0.2", linewidth=0.9)
    axr.set(**closed, yscale="log", ylabel="empirical / closed form", title="ratio (bars: 95 % bootstrap interval)")
    axt.set(**closed, ylabel="share of draws with |φ(x)ᵀφ(y)/SM − 1| > 1",
            title="the heavy tail (bars: Clopper–Pearson 95 %)")
    fig.suptitle("Random-feature MSE: Monte Carlo against closed forms", fontsize=11, fontweight="bold")
    draws = ds.sizes["seed"] * ds.sizes["replicate"]
    save_figure(fig, path, (
        f"Each point is one pair (x, y) in d = {int(ds['dim'])} with ‖x+y‖ and ‖x−y‖ on the grid "
        f"{', '.join(f'{v:g}' for v in ds.sum_norm.values)} (inputs used as is), r = "
        f"{int(ds.num_features.values[0])} features, {draws} independent draws of the estimator "
        f"({ds.sizes['seed']} seeds, each its own orientation of the pair, × {ds.sizes['replicate']}). Left: mean of "
        "(φ(x)ᵀφ(y) − SM)²/SM² against the closed form (Performer Lemma 2 for trig/positive/hyperbolic, the GERF "
        "variance for GERF and OPRF, the Theorem 2 upper bound for orthogonal positive features, hollow markers, "
        "which should lie on or below the line); bars: 95 % percentile-bootstrap intervals of the mean. Middle: "
        "their ratio. Right: share of draws whose relative error exceeds 1, with Clopper–Pearson intervals: where "
        "it is small but not zero, a few hundred draws mostly miss the rare huge errors that carry the MSE."))


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    ds = ds.isel(num_features=0)
    mse, theo = ds["relative_mse_summary"], ds["relative_mse_theory_pair"]
    exact_forms = ds["theory_is_upper_bound"].max("seed") == 0
    lo, hi = mse.sel(stat="lo"), mse.sel(stat="hi")
    covered = covers(mse, theo)
    small = (theo < 0.5) & exact_forms
    ratio = mse.sel(stat="estimate") / theo
    draws = ds.sizes["seed"] * ds.sizes["replicate"]
    lines = []
    n_small = int(small.sum())
    lines.append(
        f"Where the closed-form relative MSE is below 0.5, the Monte Carlo MSE over {draws} draws matches it: its "
        f"95 % interval covers the closed form at {int((covered & small).sum())} of {n_small} (estimator, pair) "
        f"points, median ratio {fmt(float(ratio.where(small).median()))}.")
    big = (theo >= 0.5) & exact_forms
    if int(big.sum()):
        names = [str(n) for n in ds.estimator.values]
        per = []
        for name in names:
            sel = big.sel(estimator=name)
            if int(sel.sum()):
                per.append(f"`{name}` {int((covered.sel(estimator=name) & sel).sum())}/{int(sel.sum())} "
                           f"(ratios {range_text(ratio.sel(estimator=name).where(sel).values)})")
        below = big & (hi < theo)
        shares = ds["abs_error_summary"].sel(stat="tail").where(below).values
        lines.append("At closed-form relative MSE ≥ 0.5 the intervals cover the closed form at: " + "; ".join(per)
                     + (f". Where the whole interval lies below the closed form ({int(below.sum())} points), the share "
                        f"of draws with relative error above 1 is {range_text(100 * shares)} %" if int(below.sum())
                        else "") + ".")
    tail = ds["abs_error_summary"]
    heavy = tail.sel(stat="tail").where(exact_forms)
    worst = heavy.where(heavy == heavy.max(), drop=True)
    if worst.size:
        where = {d: worst[d].values[0] for d in ("estimator", "sum_norm", "diff_norm")}
        s = tail.sel(**where)
        lines.append(
            f"The largest share of draws with relative error above 1 is "
            f"{fmt_ci(s, percent=True, entry='tail')} (`{where['estimator']}`, ‖x+y‖ = {where['sum_norm']:g}, "
            f"‖x−y‖ = {where['diff_norm']:g}); the median relative error there is {fmt_ci(s)}, against a closed-form "
            f"root-MSE of {fmt(float(np.sqrt(theo.sel(**where))))}.")
    bias = ds["relative_bias_summary"]
    off = ~covers(bias, 0.0)
    total = int(bias.sel(stat="estimate").notnull().sum())
    lines.append(f"The relative bias is zero within its 95 % interval at {total - int(off.sum())} of {total} cells "
                 f"(about {fmt_pct(0.05)} are expected outside by chance).")
    if "positive_orthogonal" in ds.estimator.values:
        above = lo.sel(estimator="positive_orthogonal") > theo.sel(estimator="positive_orthogonal")
        lines.append(f"Orthogonal positive features exceed the Theorem 2 bound with their whole interval at "
                     f"{int(above.sum())} of {int(theo.sel(estimator='positive_orthogonal').notnull().sum())} pairs.")
    if {"gerf", "oprf"} <= set(map(str, ds.estimator.values)):
        s_min, s_max = float(ds.sum_norm.min()), float(ds.sum_norm.max())
        d0 = float(ds.diff_norm.values[0])
        pieces = []
        for s_norm in (s_min, s_max):
            pieces.append(f"‖x+y‖ = {s_norm:g}: OPRF {fmt_ci(mse.sel(estimator='oprf', sum_norm=s_norm, diff_norm=d0))}"
                          f" against GERF {fmt_ci(mse.sel(estimator='gerf', sum_norm=s_norm, diff_norm=d0))}")
        lines.append(f"OPRF's fitted A* against GERF's fixed A (relative MSE at ‖x−y‖ = {d0:g}): " + "; ".join(pieces)
                     + ".")
    return lines


DATA_AXES = ("sum_norm", "diff_norm", "seed")
EXPERIMENT = Experiment.from_module(__name__, title="Random-feature MSE: Monte Carlo against closed forms")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
