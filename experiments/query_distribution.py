"""How the error of each estimator depends on the query/key distribution, read against the effective temperature.

Each cell draws one ``(q, k, v)`` sample of one distribution at one nominal temperature ``beta`` (``n`` tokens,
``d = 32``, float64) and evaluates every estimator at every rank on that same sample (a paired comparison: all
estimators see identical inputs): relative Frobenius error of the kernel matrix ``exp(s QKᵀ)``, relative RMS error
of the non-causal attention output, and the fraction of queries whose estimated normaliser is ≤ 0. Each head gets
its own fit (random features: an independent draw; Nyström: landmarks from that head's queries and keys; the
rank-r SVD references are oracles computed from the exact matrices). The sample's measured effective temperature
``β_eff = s · mean‖q‖ · mean‖k‖`` and its logit spread are stored, so the figure reads every error against
``β_eff``; ``β_eff`` alone does not determine the error (the logit spread and the tails of the norms matter too),
which the families at equal ``β_eff`` show.

Equal state bytes: ``num_features`` is the memory budget ``r``. Every estimator with a recurrent state runs at its
largest configuration whose ``state_bytes(d_v, float32, seq_len=n)`` fits ``B(r)``, the state of FAVOR+/OPRF at
``r`` features (:func:`kernapprox.memory.sized_configuration`): the random-feature maps at ``r`` itself; Nyström
at the landmarks its landmarks and whitening leave room for; LARA (``lara``, ``lara_balance``, ``lara_mean``) at
its draws; EVA (``eva``, ``eva_mean``, exact window of 32 keys) at its number of groups; the window hybrids
(``window_linear``, ``scatterbrain``, 64 exact keys) at their features. The configuration and its bytes are stored
per estimator and budget; where none fits, the estimator is not applicable (NaN). The rank-r SVD references keep no
state (they need the whole matrix) and run at rank ``r`` (``r ≤ n``).

Families: the synthetic ones of :mod:`kernapprox.distributions` at ``beta`` ∈ the grid, and ``real_L0``…``real_L5``:
heads of that layer of all-MiniLM-L6-v2 on Python's help text at their own temperature (run at ``beta = 1.0``
only; other ``beta`` values are NaN for them). Without the ``real`` extra the real values leave the grid with a
warning. The real model is bidirectional; attention here is non-causal throughout.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import (
    ATTENTION_SVD,
    BASELINE,
    EQUAL_BYTES,
    EQUAL_BYTES_COMPARATORS,
    KERNEL_SVD,
    above,
    add_paired,
    add_summaries,
    range_text,
    ratio_phrase,
    registered,
    sized_configuration,
    verdict,
)
from kernapprox import metrics, plotting, real, stats
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.memory import budget_bytes
from kernapprox.plotting import fmt, fmt_bytes, fmt_ci
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

ESTIMATORS = registered("positive", "positive_orthogonal", "trig", "hyperbolic_orthogonal", "oprf",
                        "nystrom_uniform", "nystrom_kmeans", "nystrom_rls", KERNEL_SVD, ATTENTION_SVD,
                        *EQUAL_BYTES, *(n for n in EQUAL_BYTES_COMPARATORS if not n.startswith("nystrom")))
assert all(options == {} for name, options in {**EQUAL_BYTES, **EQUAL_BYTES_COMPARATORS}.values())
ORACLES = {KERNEL_SVD: "kernel SVD (oracle)", ATTENTION_SVD: "attention SVD (oracle)"}
OPRF = "oprf"
SIZED = [name for name in ESTIMATORS if name in EQUAL_BYTES]        # LARA and EVA
RANDOM = ("positive", "positive_orthogonal", "trig", "hyperbolic_orthogonal", "oprf")
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
REAL_VALUES = [f"real_L{i}" for i in range(real.NUM_LAYERS)]
REAL_REASON = real.unavailable_reason()
if REAL_REASON is not None:
    warnings.warn(f"query_distribution: the real-model axis values are skipped: {REAL_REASON}", stacklevel=1)


def _grids(real_available: bool) -> dict:
    real_values = REAL_VALUES if real_available else []
    return {
        "smoke": {"distribution": ["isotropic", "text_like", *real_values[:1]], "beta": [1.0],
                  "seq_len": [64], "seed": [0, 1]},
        # default: β a factor 2 to 4 apart (the full preset adds 4)
        "default": {"distribution": [*SYNTHETIC, *real_values], "beta": [0.5, 1.0, 2.0, 8.0],
                    "seq_len": [256], "seed": [0, 1, 2, 3, 4]},
        # make figures PRESET=full's share of its hour: the default over ten draws
        "full": {"distribution": [*SYNTHETIC, *real_values], "beta": [0.5, 1.0, 2.0, 4.0, 8.0],
                 "seq_len": [256], "seed": list(range(10))},
    }


GRIDS = _grids(REAL_REASON is None)
PARAMETERS = {
    "synthetic_heads": Parameter(1, long_name="heads per synthetic cell", units="1",
                                 description="independent heads of one draw; per-draw values are medians over heads"),
    "real_heads": Parameter(4, long_name="heads per real cell", units="1",
                            description="distinct heads of the layer, drawn without replacement among its 12"),
}
AXIS_ATTRS = {"distribution": {"long_name": "query/key family (synthetic, or real_L<layer>: MiniLM heads)",
                               "units": "1"},
              "beta": {"long_name": "nominal inverse temperature β (synthetic families; real heads at 1 only)",
                       "units": "1"}}

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
    "state_bytes": Metric(long_name="state kept by the configuration run", units="byte",
                          description="estimator.state_bytes(d_v, float32, seq_len=n) of the configuration within "
                                      "the budget; NaN where none fits and for the SVD references (no state)",
                          dims=_PER, coords=_COORDS),
    "features_used": Metric(long_name="num_features of the configuration run", units="1",
                            description="the largest within the budget (EVA: its number of groups); the rank for "
                                        "the SVD references", dims=_PER, coords=_COORDS),
    "budget_bytes": Metric(long_name="memory budget B(r)", units="byte",
                           description="the larger state of FAVOR+ and OPRF at r features (float32)",
                           dims=("num_features",), coords={"num_features": NUM_FEATURES}),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="s · mean_i‖q_i‖ · mean_j‖k_j‖ (mean over all pairs of s‖q_i‖‖k_j‖), median "
                                   "over heads"),
    "beta_eff_max": Metric(long_name="largest possible logit", units="1",
                           description="s · max‖q_i‖ · max‖k_j‖, median over heads"),
    "logit_std": Metric(long_name="spread of the logits", units="1",
                        description="standard deviation of s q_iᵀk_j over all pairs, median over heads"),
}


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


def configuration(name: str, m: int, n: int, d: int, d_v: int) -> dict | None:
    """Constructor arguments of ``name`` at budget ``m``: the largest configuration whose state fits ``B(m)``
    (:func:`kernapprox.memory.sized_configuration`), or rank ``m ≤ n`` for the SVD references (no state); None
    where nothing fits."""
    if name in ORACLES:
        return {"num_features": m} if m <= n else None
    return sized_configuration(name, {}, budget_bytes(m, d=d, d_v=d_v, seq_len=n), d=d, d_v=d_v, seq_len=n)


def evaluate_head(q, k, v, name: str, config: dict, seed: int, exact_kernel, exact_output
                  ) -> tuple[float, float, float, float]:
    """(kernel error, attention error, non-positive rate, state bytes) of estimator ``name`` built with
    ``config`` and fitted on one head ``(n, d)``, against that head's exact kernel matrix and non-causal attention
    output."""
    est = ka.make_estimator(name, rng=seed, **config).fit(q, k)
    approx = est.kernel_matrix(q, k)
    if name == ATTENTION_SVD:                # it approximates the row-normalised matrix: no kernel-matrix error
        kernel_err = torch.tensor(float("nan"))
    else:
        kernel_err = metrics.relative_frobenius_error(approx, exact_kernel)
    parts = ka.linear_attention(q, k, v, est, causal=False, mode="parallel", return_parts=True)
    attn_err = metrics.relative_rms_error(parts.output, exact_output)
    bad = metrics.nonpositive_normalizer_rate(parts.normalizer)
    state = np.nan if name in ORACLES else est.state_bytes(v.shape[-1], torch.float32, seq_len=q.shape[-2])
    return float(kernel_err), float(attn_err), float(bad), float(state)


def run_cell(params, rng, device):
    dist = distribution_for(params["distribution"], params["beta"])
    if dist is None:
        return not_applicable()
    if params["distribution"] in REAL_VALUES and REAL_REASON is not None:
        warnings.warn(f"skipping {params['distribution']}: {REAL_REASON}", stacklevel=1)
        return not_applicable()
    n = params["seq_len"]
    heads = params["real_heads" if params["distribution"] in REAL_VALUES else "synthetic_heads"]
    q, k, v = dist.sample(n, heads=heads, rng=rng, device=device, dtype=torch.float64)
    q, k, v = q[0], k[0], v[0]                                             # (heads, n, d)
    d, d_v = q.shape[-1], v.shape[-1]
    shape = (len(ESTIMATORS), len(NUM_FEATURES), heads)
    errs = {key: np.full(shape, np.nan) for key in ("kernel", "attention", "bad", "state")}
    used = np.full(shape[:2], np.nan)
    seeds = rng.integers(0, 2**63, size=shape)
    exact_kernel = ka.kernel_matrix(q, k)
    exact_output = ka.softmax_attention(q, k, v)
    for e, name in enumerate(ESTIMATORS):
        for j, m in enumerate(NUM_FEATURES):
            config = configuration(name, m, n, d, d_v)
            if config is None:
                continue
            used[e, j] = config["num_features"]
            for h in range(heads):
                out = evaluate_head(q[h], k[h], v[h], name, config, int(seeds[e, j, h]), exact_kernel[h],
                                    exact_output[h])
                errs["kernel"][e, j, h], errs["attention"][e, j, h], errs["bad"][e, j, h], errs["state"][e, j, h] = out
    s = 1.0 / np.sqrt(q.shape[-1])
    logits = s * (q @ k.transpose(-1, -2))
    return {
        "kernel_rel_fro": np.median(errs["kernel"], -1),
        "attention_rel_rms": np.median(errs["attention"], -1),
        "nonpositive_rate": errs["bad"].mean(-1),
        "state_bytes": np.median(errs["state"], -1),
        "features_used": used,
        "budget_bytes": np.array([budget_bytes(m, d=d, d_v=d_v, seq_len=n) for m in NUM_FEATURES], dtype=float),
        "beta_eff": float(effective_beta(q, k).median()),
        "beta_eff_max": float(effective_beta(q, k, statistic="max").median()),
        "logit_std": float(logits.std(dim=(-1, -2)).median()),
    }


# ------------------------------------------------------------------------------------------------ summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds = add_summaries(ds, ["kernel_rel_fro", "attention_rel_rms", "beta_eff", "logit_std"], "seed")
    ds = add_summaries(ds, ["nonpositive_rate"], "seed", tail_threshold=None)
    ds = add_paired(ds, "attention_rel_rms", BASELINE, "seed", op="ratio", label="baseline")
    return add_paired(ds, "attention_rel_rms", OPRF, "seed", op="ratio", label="oprf")


# --------------------------------------------------------------------------------------------------- figure
FAMILY_ORDER = [*SYNTHETIC]
PLOT_FEATURES = 64


def _against_beta(ax, ds, var, estimator, m, families, real_values, colors, layer_colors, label=True):
    """One panel: ``<var>_summary`` against the measured β_eff (median over seeds), a line with its 95 % band per
    synthetic family over its beta grid, and one marker with a bar per real layer."""
    summ = ds[f"{var}_summary"].sel(estimator=estimator, num_features=m).isel(seq_len=0)
    beta = ds["beta_eff_summary"].isel(seq_len=0).sel(stat="estimate")
    for fam in families:
        plotting.plot_summary(ax, summ.sel(distribution=fam), xvalues=beta.sel(distribution=fam).values, positive=True,
                              band_alpha=0.15, marker="o", color=colors[fam], label=fam if label else None)
    for value in real_values:
        at = {"distribution": value, "beta": REAL_BETA}
        if float(summ.sel(**at, stat="estimate")) > 0:
            plotting.errorbar_summary(ax, summ.sel(**at), [float(beta.sel(**at))], marker="D", markersize=5,
                                      color=layer_colors[value], markeredgecolor="black", markeredgewidth=0.4, zorder=3,
                                      label=f"real layer {value.removeprefix('real_L')}" if label else None)
    plotting.log_axis(ax)
    ax.set_yscale("log")


def panel_budget(ds, estimator, m: int) -> int:
    """The budget of an estimator's panel: ``m``, or the smallest budget at which it runs when nothing of it fits
    ``B(m)``."""
    used = ds["features_used"].sel(estimator=estimator).isel(seq_len=0)
    runs = [int(r) for r in ds.num_features.values if bool(used.sel(num_features=r).notnull().any())]
    return m if m in runs or not runs else min(runs)


def plot(ds, path):
    estimators = [str(e) for e in ds.estimator.values]
    values = [str(v) for v in ds.distribution.values]
    families = [f for f in FAMILY_ORDER if f in values]
    real_values = [v for v in values if v.startswith("real_L")]
    nums = [int(m) for m in ds.num_features.values]
    m = PLOT_FEATURES if PLOT_FEATURES in nums else nums[len(nums) // 2]
    colors, layer_colors = plotting.palette(FAMILY_ORDER), plotting.palette(real_values, "rocket", trim=1)
    ncols = 4
    nrows = -(-(len(estimators) + 3) // ncols)
    fig, axes = plotting.new_figure(nrows, ncols, width=15.5, height=3.0 * nrows + 0.6, squeeze=False)
    axes = axes.ravel()
    for i, est in enumerate(estimators):
        ax = axes[i]
        m_est = panel_budget(ds, est, m)
        _against_beta(ax, ds, "attention_rel_rms", est, m_est, families, real_values, colors, layer_colors,
                      label=i == 0)
        used = ds["features_used"].sel(estimator=est, num_features=m_est).median().values
        what = f"rank {m_est}" if est in ORACLES else f"budget r = {m_est}: {fmt(float(used))} features"
        if est in EQUAL_BYTES and str(est).startswith("eva"):
            what = f"budget r = {m_est}: {fmt(float(used))} groups"
        ax.set_title(f"{ORACLES.get(est, est)} ({what})", fontsize=8.5)
        ax.set_xlabel("measured β_eff = s·mean‖q‖·mean‖k‖")
        ax.set_ylabel("attention output rel. error")
        ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
        plotting.floor_ylim(ax, 1e-4)          # exact reproductions at r ≥ n sit on the axis
    axes[0].legend(loc="upper left", ncol=2, fontsize=6.5)

    ref = "isotropic" if "isotropic" in values else families[0]
    ax = axes[len(estimators)]
    kern = ds["kernel_rel_fro_summary"].isel(seq_len=0)
    beta = ds["beta_eff_summary"].isel(seq_len=0).sel(stat="estimate")
    for est in estimators:
        s = kern.sel(distribution=ref, estimator=est, num_features=m)
        if not bool(np.isfinite(s.sel(stat="estimate")).any()):
            continue
        style = plotting.estimator_style(est)
        if est in ORACLES:
            style.update(color="black", label=ORACLES[est])
        plotting.plot_summary(ax, s, None, xvalues=beta.sel(distribution=ref).values, **style)
    plotting.log_axis(ax, label="measured β_eff")
    ax.set_yscale("log")
    plotting.floor_ylim(ax, 1e-4)
    ax.set_title(f"kernel matrix error, {ref} (budget r = {m})")
    ax.set_ylabel("‖Â − A‖_F / ‖A‖_F")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[len(estimators) + 1]
    rate = ds["nonpositive_rate_summary"].isel(seq_len=0)
    for est in estimators:
        r = rate.sel(estimator=est, num_features=m)
        if not bool((r.sel(stat="estimate").fillna(0) > 0).any()):
            continue
        plotting.plot_summary(ax, r.sel(distribution=ref), None, xvalues=beta.sel(distribution=ref).values,
                              **plotting.estimator_style(est))
        for value in real_values:
            s = r.sel(distribution=value, beta=REAL_BETA)
            ax.scatter([float(beta.sel(distribution=value, beta=REAL_BETA))], [float(s.sel(stat="estimate"))],
                       marker="D", s=18, color=layer_colors[value], edgecolor=plotting.estimator_style(est)["color"],
                       linewidth=0.8, zorder=3)
    plotting.log_axis(ax, label="measured β_eff (line: isotropic; ◆: real layers)")
    ax.set_ylim(-0.02, 0.62)
    ax.set_title(f"non-positive normalisers (budget r = {m})")
    ax.set_ylabel("fraction of queries")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)

    ax = axes[len(estimators) + 2]
    pooled = ds["attention_rel_rms"].isel(seq_len=0)
    if real_values:
        pooled = pooled.sel(distribution=real_values, beta=REAL_BETA).rename(distribution="layer")
        title = "real heads, all layers and seeds"
    else:
        pooled = pooled.sel(distribution=ref).rename(beta="layer")
        title = f"{ref}, all beta and seeds"
    plotting.estimator_lines(ax, stats.summarise(pooled, ("layer", "seed")), estimators,
                             styles={e: {"color": "black", "label": ORACLES[e]} for e in ORACLES})
    plotting.loglog_rank_axes(ax, xlabel="budget r (FAVOR+ features at equal state)",
                              ylabel="attention output rel. error")
    plotting.floor_ylim(ax, 1e-4)
    ax.set_title(f"error vs budget, {title}", fontsize=8.5)
    for ax in axes[len(estimators) + 3:]:
        ax.set_visible(False)
    n = int(ds.seq_len.values[0])
    fig.suptitle("Estimator error against the effective temperature of queries and keys")
    plotting.save_figure(fig, path, (
        f"Panels 1–{len(estimators)}: relative RMS error of the non-causal attention output at equal state bytes — "
        f"every estimator at its largest configuration whose state (estimator.state_bytes, float32) fits the budget "
        f"of FAVOR+ at r = {m} features, or at the smallest grid budget where it fits (named in the title; EVA "
        "and the window hybrids need more than the smaller budgets) — "
        f"against the measured β_eff of the sample (n = {n}, d = 32): median over {ds.sizes['seed']} seeds (each the "
        "median over its heads) with its 95 % bootstrap band; lines: synthetic families over their nominal beta grid; "
        "diamonds with bars: heads of all-MiniLM-L6-v2 on Python's help text, one per layer (their own temperature). "
        "The kernel-SVD and attention-SVD references are oracles computed from the exact matrices: they minimise the "
        "Frobenius error of the kernel (resp. attention) matrix, not the output error; they keep no state and run "
        "at rank r. Then: kernel-matrix error on "
        f"the {ref} family; fraction of queries whose estimated normaliser is ≤ 0 (signed estimators only); error "
        "against the budget pooled over the real layers and seeds (median and 95 % bootstrap band)."))


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    ds = ds.isel(seq_len=0)
    err = ds["attention_rel_rms_summary"]
    beta = ds["beta_eff_summary"]
    names = [str(e) for e in ds.estimator.values]
    nums = [int(m) for m in ds.num_features.values]
    m = PLOT_FEATURES if PLOT_FEATURES in nums else nums[len(nums) // 2]
    values = [str(v) for v in ds.distribution.values]
    betas = [float(b) for b in ds.beta.values]
    lines = []
    if "isotropic" in values and BASELINE in names:
        s = err.sel(distribution="isotropic", estimator=BASELINE, num_features=m)
        b = beta.sel(distribution="isotropic")
        lines.append(
            f"On isotropic data FAVOR+ (`{BASELINE}`, r = {m}) has output error {fmt_ci(s.sel(beta=betas[0]))} at "
            f"β_eff = {fmt(float(b.sel(beta=betas[0], stat='estimate')), 2)} and {fmt_ci(s.sel(beta=betas[-1]))} at "
            f"β_eff = {fmt(float(b.sel(beta=betas[-1], stat='estimate')), 2)} (median over seeds, 95 % interval).")
        nys = [n for n in names if n.startswith("nystrom")]
        if nys and "attention_rel_rms_vs_baseline_summary" in ds:
            vs = ds["attention_rel_rms_vs_baseline_summary"].sel(distribution="isotropic", num_features=m)
            landmarks = range_text(ds["features_used"].sel(estimator=nys, num_features=m).values)
            lines.append(f"Nyström against FAVOR+ on the same isotropic samples at equal state bytes (budget of "
                         f"FAVOR+ at r = {m}, {fmt_bytes(ds['budget_bytes'].sel(num_features=m).max())}: "
                         f"{landmarks} landmarks; paired ratio of output errors): " + "; ".join(
                             f"β = {bb:g}: " + ", ".join(f"`{n}` {ratio_phrase(vs.sel(estimator=n, beta=bb))}"
                                                         for n in nys) for bb in (betas[0], betas[-1])) + ".")
    if {"isotropic", "anisotropic"} <= set(values) and "positive" in names:
        b1 = 1.0 if 1.0 in betas else betas[0]
        pieces, errors = [], {}
        for fam in ("isotropic", "anisotropic"):
            errors[fam] = err.sel(distribution=fam, beta=b1, estimator="positive", num_features=m)
            pieces.append(f"{fam}: β_eff {fmt_ci(beta.sel(distribution=fam, beta=b1), 2)}, logit spread "
                          f"{fmt_ci(ds['logit_std_summary'].sel(distribution=fam, beta=b1), 2)}, error "
                          f"{fmt_ci(errors[fam])}")
        iso, aniso = errors["isotropic"], errors["anisotropic"]
        separated = above(aniso, iso) or above(iso, aniso)
        verdict = ("the error intervals are separated" if separated else
                   "the error intervals overlap: at this sample size the two families are not separated")
        lines.append(f"Anisotropy at nominal β = {b1:g}, i.i.d. positive features (r = {m}): " + "; ".join(pieces)
                     + f" — {verdict}.")
    if {"heavy_tailed", "isotropic"} <= set(values) and "trig" in names:
        s = err.sel(distribution="heavy_tailed", estimator="trig", num_features=m)
        where = float(s.sel(stat="q90").idxmax("beta"))
        b_heavy = float(beta.sel(distribution="heavy_tailed", beta=where, stat="estimate"))
        iso_b = beta.sel(distribution="isotropic", stat="estimate")
        near = float(ds.beta.values[int(np.nanargmin(np.abs(np.log(iso_b.values / b_heavy))))])
        iso = err.sel(distribution="isotropic", estimator="trig", num_features=m, beta=near)
        heavy = s.sel(beta=where)
        separated = above(heavy, iso)
        lines.append(
            f"Trigonometric output error (r = {m}) on heavy-tailed norms (Student-t, 3 degrees of freedom) at β_eff "
            f"{fmt(b_heavy, 2)}: median {fmt_ci(heavy)}, 90 % quantile {fmt(float(heavy.sel(stat='q90')))} over "
            f"seeds; on isotropic data at the nearest β_eff ({fmt(float(iso_b.sel(beta=near)), 2)}): {fmt_ci(iso)}"
            + (" — separated: β_eff alone does not fix the error of signed features." if separated else
               " — the intervals overlap."))
    structured = [f for f in ("clustered", "continuous") if f in values]
    nys = [n for n in names if n.startswith("nystrom")]
    randoms = [n for n in names if n.split("_")[0] in ("positive", "hyperbolic", "oprf", "trig")]
    if structured and nys and randoms:
        b1 = 1.0 if 1.0 in betas else betas[0]
        parts = []
        for fam in structured:
            e = err.sel(distribution=fam, beta=b1, num_features=m, stat="estimate")
            parts.append(f"{fam}: Nyström {range_text(e.sel(estimator=nys).values)}, random features "
                         f"{range_text(e.sel(estimator=randoms).values)}")
        lines.append(f"On structured data at nominal β = {b1:g} (equal state bytes: budget r = {m}, medians over "
                     "seeds): " + "; ".join(parts) + ".")
    lines.extend(_sized_findings(ds, names, values, betas))
    real_values = [v for v in values if v.startswith("real_L")]
    if real_values:
        rb = beta.sel(distribution=real_values, beta=REAL_BETA, stat="estimate").values
        e = err.sel(distribution=real_values, beta=REAL_BETA, num_features=m, stat="estimate")
        parts = [f"`{n}` {range_text(e.sel(estimator=n).values)}" for n in names]
        lines.append(f"The MiniLM heads sit at β_eff {range_text(rb)} (median per layer); median output error per "
                     f"layer at equal state bytes (budget r = {m}; n/a: no configuration within it): "
                     + "; ".join(parts) + ". The SVD references are oracles (rank r, no state) that minimise a "
                     "matrix's Frobenius error, not the output error.")
    if "trig" in names and "isotropic" in values:
        rate = ds["nonpositive_rate_summary"].sel(distribution="isotropic", estimator="trig", num_features=m)
        lines.append(f"Trigonometric features on isotropic data (r = {m}): normalisers ≤ 0 for "
                     f"{fmt_ci(rate.sel(beta=betas[0]), percent=True)} of queries at β = {betas[0]:g} and "
                     f"{fmt_ci(rate.sel(beta=betas[-1]), percent=True)} at β = {betas[-1]:g}.")
    return lines


def _sized_findings(ds, names, values, betas) -> list[str]:
    """LARA and EVA against FAVOR+ and OPRF at equal state bytes: per family at nominal β = 1, and over the real
    layers, at the largest budget (where EVA fits)."""
    sized = [n for n in names if n in SIZED]
    if not sized or "attention_rel_rms_vs_baseline_summary" not in ds:
        return []
    r = int(ds.num_features.max())
    b1 = 1.0 if 1.0 in betas else betas[0]
    budget = float(ds["budget_bytes"].sel(num_features=r).max())
    families = [f for f in FAMILY_ORDER if f in values]
    real_values = [v for v in values if v.startswith("real_L")]
    err = ds["attention_rel_rms_summary"].sel(num_features=r)
    lines = []
    for label, var in (("FAVOR+", "attention_rel_rms_vs_baseline_summary"),
                       ("OPRF (`oprf`)", "attention_rel_rms_vs_oprf_summary")):
        if var not in ds:
            continue
        vs = ds[var].sel(num_features=r)
        parts = []
        for name in sized:
            cells = []
            for fam in families:
                s = vs.sel(estimator=name, distribution=fam, beta=b1)
                if np.isfinite(float(s.sel(stat="estimate"))):
                    cells.append(f"{fam} {fmt_ci(s)} {verdict(s)}")
            if real_values:
                med = vs.sel(estimator=name, distribution=real_values, beta=REAL_BETA, stat="estimate").values
                cells.append(f"real layers {range_text(med)} (medians per layer)")
            parts.append(f"`{name}`: " + ", ".join(cells) if cells else f"`{name}`: n/a")
        lines.append(f"LARA and EVA against {label} on the same samples at equal state bytes (budget of FAVOR+ at "
                     f"r = {r}, {fmt_bytes(budget)}, n = {int(ds.seq_len)}; nominal β = {b1:g}; paired ratio of "
                     "output errors; lower/higher: the interval excludes 1; not resolved: it does not): "
                     + "; ".join(parts) + ".")
    others = [n for n in names if n not in ORACLES and n not in RANDOM]
    iso = [f"`{n}` {fmt_ci(err.sel(estimator=n, distribution='isotropic', beta=b1))}"
           for n in [BASELINE, OPRF, *others] if n in names] if "isotropic" in values else []
    if iso:
        config = ", ".join(f"`{n}` {fmt(float(ds['features_used'].sel(estimator=n, num_features=r).median()))}"
                           for n in others)
        lines.append(f"Output errors on isotropic data at nominal β = {b1:g}, equal state bytes (budget r = {r}; "
                     "median over seeds): " + "; ".join(iso) + f" (features, landmarks, draws or groups within the "
                     f"budget: {config}).")
    return lines


EXPERIMENT = Experiment.from_module(
    __name__, title="Estimator error against the query/key distribution and its effective temperature",
    description=("How the kernel and attention errors of random-feature and Nyström estimators (and the rank-r SVD "
                 "oracles) depend on the distribution of queries and keys (isotropic, anisotropic, clustered, "
                 "heavy-tailed, text-like, continuous; real all-MiniLM-L6-v2 heads per layer), read against the "
                 "measured effective temperature β_eff. Grid: distribution × nominal beta × n × seed; each cell "
                 "evaluates every estimator at every rank on one shared sample."))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
