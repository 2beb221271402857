"""The state-dimension spectrum: which rank does a sequence's attention need, text against continuous signals?

For each data type and sequence length ``n``, the exact matrices of ``heads`` heads are decomposed in float64:

* the kernel matrix ``A = exp(s QKᵀ)`` (the quantity every feature map approximates), and
* the row-normalised attention matrix ``P = softmax(s QKᵀ)``. Any non-causal linear attention with a state of
  ``r`` features produces ``P̂ = D̂⁻¹ Φ(Q)Ψ(K)ᵀ`` of rank ≤ ``r``, so the best rank-``r`` approximation of ``P``
  bounds the Frobenius error of the attention weights of every such method (and nothing else: not the output).

By Eckart–Young the smallest rank reaching relative Frobenius error 1% and 10% follows from the singular values
(:func:`kernapprox.spectrum.rank_for_relative_error`). At ``n = estimator_len`` (512) random-feature and Nyström
estimators are run on head 0 on a grid of feature counts ``m ≤ n`` (a state larger than ``n`` is no smaller than the
KV cache; stopping once both errors are ≤ 1%), and the smallest ``m`` of the grid reaching each target is recorded
(``inf``: not reached with ``m ≤ n``): what the best practical estimators need against the optimum.

Data: ``text_like`` (Zipf tokens with fixed random embeddings), ``real_text`` (heads of all-MiniLM-L6-v2, four
distinct (layer, head) pairs drawn per cell among all 72, on Python's help text; beyond 512 tokens consecutive
model windows are concatenated), and ``continuous_l{ℓ}`` (smooth Gaussian-process trajectories with correlation length
``ℓ`` tokens). Real text runs only up to the model's 512-token window: beyond it two independent windows would be
joined whose cross-window logits the model never computed. Synthetic data run at nominal ``beta = 8`` (logit
spread ≈ 1.4, inside the 1.0–3.4 of the real heads); real heads at their own temperature. Non-causal throughout
(the real model is bidirectional).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import add_summaries, per_draw_slope
from kernapprox import metrics, plotting, real
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.plotting import finite_values, fmt_ci, fmt_cis
from kernapprox.spectrum import (
    attention_singular_values,
    kernel_singular_values,
    rank_for_relative_error,
    smallest_size_reaching,
)
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

SYNTHETIC_BETA = 8.0
SYNTHETIC = {
    "text_like": ("text_like", {}),
    "continuous_l2": ("continuous", {"length_scale": 2.0}),
    "continuous_l8": ("continuous", {"length_scale": 8.0}),
    "continuous_l32": ("continuous", {"length_scale": 32.0}),
}
REAL_VALUE = "real_text"
REAL_REASON = real.unavailable_reason()
if REAL_REASON is not None:
    warnings.warn(f"spectrum: the real-model data type is skipped: {REAL_REASON}", stacklevel=1)
TARGETS = [0.01, 0.1]
WANTED_ESTIMATORS = ["positive_orthogonal", "hyperbolic_orthogonal", "oprf_orthogonal", "nystrom_uniform",
                     "nystrom_rls"]
ESTIMATORS = [e for e in WANTED_ESTIMATORS if e in ka.available_estimators()]
FEATURE_GRID = [2**i for i in range(2, 13)]                       # 4 … 4096, used up to m = n


def _grids(real_available: bool) -> dict:
    data = ["text_like", *([REAL_VALUE] if real_available else []), "continuous_l2", "continuous_l8",
            "continuous_l32"]
    return {
        "smoke": {"data": ["text_like", *([REAL_VALUE] if real_available else []), "continuous_l8"],
                  "seq_len": [32, 64], "seed": [0, 1]},
        "default": {"data": data, "seq_len": [128, 256, 512, 1024], "seed": [0, 1, 2, 3, 4]},
        # make figures PRESET=full's share of its hour: the default over ten draws (n = 2048 cost 8 of the 9 minutes
        # a run to it took: --set seq_len=128,256,512,1024,2048 adds it)
        "full": {"data": data, "seq_len": [128, 256, 512, 1024], "seed": list(range(10))},
    }


GRIDS = _grids(REAL_REASON is None)
PARAMETERS = {
    "estimator_len": Parameter(512, long_name="sequence length at which the estimators are swept", units="token",
                               description="estimator sweeps cost O(n² m) per m; at other lengths only spectra"),
}
AXIS_ATTRS = {"data": {"long_name": "data type (Zipf-token text, real MiniLM heads, smooth continuous signals)",
                       "units": "1"},
              "target": {"long_name": "target relative Frobenius error of the rank-r approximation", "units": "1"}}


HEADS = 2                # heads per cell for the spectra (they share the cell's tokens); estimators run on head 0
_HEAD = {"head": list(range(HEADS))}
_TARGET = {"target": TARGETS} | _HEAD
_EST_M = {"estimator": ESTIMATORS, "num_features": FEATURE_GRID}
_EST_T = {"estimator": ESTIMATORS, "target": TARGETS}
METRICS = {
    "kernel_sv": Metric(long_name="normalised singular values of the kernel matrix", units="1",
                        description="σ_i/σ_1 of A = exp(s QKᵀ), float64, descending (NaN-padded to the longest n)",
                        dims=("head", "sv_index"), coords=_HEAD),
    "attention_sv": Metric(long_name="normalised singular values of the attention matrix", units="1",
                           description="σ_i/σ_1 of P = softmax(s QKᵀ) (rows sum to 1), float64, descending",
                           dims=("head", "sv_index"), coords=_HEAD),
    "rank_kernel": Metric(long_name="rank for a relative error of the kernel matrix", units="1",
                          description="smallest r with ‖A − A_r‖_F ≤ target·‖A‖_F (Eckart–Young)",
                          dims=("head", "target"), coords=_TARGET),
    "rank_attention": Metric(long_name="rank for a relative error of the attention matrix", units="1",
                             description="smallest r with ‖P − P_r‖_F ≤ target·‖P‖_F (Eckart–Young)",
                             dims=("head", "target"), coords=_TARGET),
    "kernel_error": Metric(long_name="estimator error of the kernel matrix", units="1",
                           description="‖Â − A‖_F/‖A‖_F of the estimator with m features on head 0 (NaN: m > n, "
                                       "or not run after both errors reached 1%)", dims=("estimator", "num_features"),
                           coords=_EST_M),
    "attention_weights_error": Metric(long_name="estimator error of the attention matrix", units="1",
                                      description="‖P̂ − P‖_F/‖P‖_F, P̂ = Â row-normalised", dims=("estimator",
                                                                                                    "num_features"),
                                      coords=_EST_M),
    "features_kernel": Metric(long_name="features an estimator needs for a kernel error", units="1",
                              description="smallest m of the grid with kernel_error ≤ target (inf: none ≤ n; NaN: "
                                          "not run)",
                              dims=("estimator", "target"), coords=_EST_T),
    "features_attention": Metric(long_name="features an estimator needs for an attention-matrix error", units="1",
                                 description="smallest m of the grid with attention_weights_error ≤ target (inf: "
                                             "none ≤ n; NaN: not run)", dims=("estimator", "target"), coords=_EST_T),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="s · mean‖q_i‖ · mean‖k_j‖", dims=("head",), coords=_HEAD),
    "logit_std": Metric(long_name="spread of the logits", units="1", description="std of s q_iᵀk_j over all pairs",
                        dims=("head",), coords=_HEAD),
    "distinct_queries": Metric(long_name="distinct query vectors", units="1",
                               description="number of distinct rows of Q (= distinct tokens for text_like)",
                               dims=("head",), coords=_HEAD),
}


def distribution_for(value: str, n: int):
    """The distribution behind a ``data`` axis value."""
    if value in SYNTHETIC:
        name, params = SYNTHETIC[value]
        return make_distribution(name, beta=SYNTHETIC_BETA, **params)
    if value == REAL_VALUE:
        return make_distribution("real")
    raise ValueError(f"unknown data axis value {value!r}")


def estimator_errors(q, k, exact_kernel, exact_weights, name, rng) -> tuple[np.ndarray, np.ndarray]:
    """Kernel and attention-matrix errors of ``name`` over :data:`FEATURE_GRID` (``m ≤ n``), stopping once both
    are ≤ the smallest target."""
    n = q.shape[-2]
    kern, attn = np.full(len(FEATURE_GRID), np.nan), np.full(len(FEATURE_GRID), np.nan)
    for j, m in enumerate(FEATURE_GRID):
        if m > n:
            break
        est = ka.make_estimator(name, num_features=m, rng=int(rng.integers(0, 2**63))).fit(q, k)
        approx = est.kernel_matrix(q, k)
        kern[j] = float(metrics.relative_frobenius_error(approx, exact_kernel))
        weights = approx / approx.sum(-1, keepdim=True)
        attn[j] = float(metrics.relative_frobenius_error(weights, exact_weights))
        if kern[j] <= min(TARGETS) and attn[j] <= min(TARGETS):
            break
    return kern, attn


def run_cell(params, rng, device):
    if params["data"] == REAL_VALUE and REAL_REASON is not None:
        warnings.warn(f"skipping {REAL_VALUE}: {REAL_REASON}", stacklevel=1)
        return not_applicable()
    n = params["seq_len"]
    if params["data"] == REAL_VALUE and n > real.WINDOW:
        return not_applicable()                          # beyond one model window: no real attention to decompose
    dist = distribution_for(params["data"], n)
    q, k, _ = dist.sample(n, heads=HEADS, rng=rng, device=device, dtype=torch.float64)
    q, k = q[0], k[0]                                                             # (heads, n, d)
    logits = ka.log_kernel_matrix(q, k)
    kernel_sv = kernel_singular_values(q, k)
    attention_sv = attention_singular_values(q, k)
    out = {
        "kernel_sv": kernel_sv, "attention_sv": attention_sv,
        "rank_kernel": np.stack([rank_for_relative_error(kernel_sv, t) for t in TARGETS], -1).astype(float),
        "rank_attention": np.stack([rank_for_relative_error(attention_sv, t) for t in TARGETS], -1).astype(float),
        "beta_eff": effective_beta(q, k).cpu().numpy(), "logit_std": logits.std(dim=(-1, -2)).cpu().numpy(),
        "distinct_queries": np.array([float(torch.unique(q[h], dim=0).shape[0]) for h in range(HEADS)]),
    }
    q, k, logits = q[0], k[0], logits[0]                                          # estimators: head 0
    exact_weights = torch.softmax(logits, -1)
    exact_kernel = torch.exp(logits)
    shape = (len(ESTIMATORS), len(FEATURE_GRID))
    kern, attn = np.full(shape, np.nan), np.full(shape, np.nan)
    swept = n == params["estimator_len"]
    if swept:
        for e, name in enumerate(ESTIMATORS):
            kern[e], attn[e] = estimator_errors(q, k, exact_kernel, exact_weights, name, rng)
    out["kernel_error"], out["attention_weights_error"] = kern, attn

    def needed(errors, t):
        if not swept:
            return np.nan
        m = smallest_size_reaching(errors, FEATURE_GRID, t)
        return np.inf if np.isnan(m) else m                  # swept, but no m ≤ n reached the target

    out["features_kernel"] = np.array([[needed(kern[e], t) for t in TARGETS] for e in range(len(ESTIMATORS))])
    out["features_attention"] = np.array([[needed(attn[e], t) for t in TARGETS] for e in range(len(ESTIMATORS))])
    return out


# ------------------------------------------------------------------------------------------------ summaries
RANDOM_FEATURES = [e for e in ESTIMATORS if not e.startswith("nystrom")]
NYSTROM = [e for e in ESTIMATORS if e.startswith("nystrom")]


def _head_mean(da: xr.DataArray, what: str) -> xr.DataArray:
    out = da.mean("head")
    out.attrs = {**da.attrs, "description": f"{da.attrs.get('description', '')}; mean over the {HEADS} heads of a "
                                            f"draw (they share its tokens), {what}"}
    return out


def rank_growth(rank: xr.DataArray) -> xr.DataArray:
    """Per draw, the log–log slope of the (head-mean) rank against n over the lengths where it was computed."""
    out = per_draw_slope(rank, "seq_len")
    out.attrs = {"long_name": "growth exponent of the rank in n", "units": "1",
                 "description": "per draw, least-squares slope of log(rank) against log(n) over the grid lengths "
                                "(1: proportional to n)"}
    return out


def summarise(ds: xr.Dataset) -> xr.Dataset:
    for name in ("rank_kernel", "rank_attention", "beta_eff", "logit_std", "distinct_queries"):
        ds[f"{name}_draw"] = _head_mean(ds[name], "one value per draw")
    for name in ("kernel_sv", "attention_sv"):
        ds[f"{name}_draw"] = ds[name].median("head").assign_attrs(
            long_name=ds[name].attrs["long_name"], units="1", description=ds[name].attrs["description"]
            + "; median over the heads of a draw")
    for name in ("rank_kernel", "rank_attention"):
        ds[f"{name}_growth"] = rank_growth(ds[f"{name}_draw"])
    for what in ("attention", "kernel"):
        ds[f"rank_{what}_head0"] = ds[f"rank_{what}"].sel(head=0, drop=True).assign_attrs(
            long_name=f"rank for a relative error of the {what} matrix, head 0", units="1",
            description="the head the estimators are swept on (paired with them)")
    for group, members in (("nystrom", NYSTROM), ("random_features", RANDOM_FEATURES)):
        for what in ("kernel", "attention"):
            da = ds[f"features_{what}"].sel(estimator=[m for m in members if m in ds.estimator.values])
            ds[f"features_{what}_best_{group}"] = da.min("estimator", skipna=False).assign_attrs(
                long_name=f"features the best {group.replace('_', ' ')} estimator needs ({what} matrix)", units="1",
                description=f"per draw, the smallest features_{what} over {', '.join(map(str, da.estimator.values))} "
                            "(inf: none reached the target with m ≤ n)")
    names = [f"{n}_draw" for n in ("rank_kernel", "rank_attention", "beta_eff", "logit_std", "distinct_queries",
                                   "kernel_sv", "attention_sv")]
    names += ["rank_kernel_growth", "rank_attention_growth", "rank_attention_head0", "rank_kernel_head0"]
    names += [f"features_{w}_best_{g}" for w in ("kernel", "attention") for g in ("nystrom", "random_features")]
    return add_summaries(ds, names, "seed", tail_threshold=None)


# --------------------------------------------------------------------------------------------------- figure
def data_colors(values):
    """text: warm colours; continuous: greens from rough (light) to smooth (dark)."""
    conts = [v for v in values if v.startswith("continuous")]
    return {"text_like": "#d55e00", REAL_VALUE: "#000000", **plotting.palette(conts, "crest")}


def _label(value):
    if value.startswith("continuous_l"):
        return f"continuous, ℓ = {value.removeprefix('continuous_l')}"
    return {"text_like": "text-like (Zipf tokens)", REAL_VALUE: "real text heads (MiniLM)"}.get(value, value)


def plot(ds, path):
    values = [str(v) for v in ds.data.values]
    colors = data_colors(values)
    ns = [int(n) for n in ds.seq_len.values]
    fig, axes = plotting.new_figure(2, 3, width=14.5, height=7.4, squeeze=False)
    for col, (var, what) in enumerate((("kernel_sv", "kernel"), ("attention_sv", "attention"))):
        ax = axes[0, col]
        for v in values:
            finite = [n for n in ns if bool(np.isfinite(ds[f"{var}_draw"].sel(data=v, seq_len=n)).any())]
            if not finite:
                continue
            s = ds[f"{var}_draw_summary"].sel(data=v, seq_len=finite[-1])
            plotting.plot_summary(ax, s, xvalues=np.arange(1, s.sizes["sv_index"] + 1), positive=True, band_alpha=0.15,
                                  color=colors[v], label=f"{_label(v)}, n = {finite[-1]}")
        ax.set(xscale="log", yscale="log", ylim=(1e-12, 1.5), xlabel="index i", ylabel="σ_i / σ_1",
               title=f"spectrum of the {what} matrix at the largest n")
        ax = axes[1, col]
        rank = ds[f"rank_{what}_draw_summary"]
        for v in values:
            for t, style in zip(TARGETS, ("-", "--")):
                plotting.plot_summary(ax, rank.sel(data=v, target=t), "seq_len", color=colors[v], linestyle=style,
                                      marker="o", label=_label(v) if t == TARGETS[0] else None)
        ax.plot(ns, ns, color="0.5", linestyle=":", linewidth=1.0, label="rank = n")
        plotting.loglog_rank_axes(ax, xlabel="sequence length n", ylabel="rank r for the target")
        plotting.log_axis(ax, "y", base=10)
        ax.set_title(f"rank for 1% (solid) / 10% (dashed) error, {what} matrix")
    axes[0, 0].legend(fontsize=6.5)
    axes[1, 0].legend(fontsize=6.5)
    n_est = int(ds["estimator_len"])
    for row, what in enumerate(("attention", "kernel")):
        ax = axes[row, 2]
        if n_est not in ns:
            ax.set_visible(False)
            continue
        groups = [("optimal (SVD)", f"rank_{what}_head0_summary", "#444444"),
                  ("best Nyström", f"features_{what}_best_nystrom_summary", "#ca9161"),
                  ("best random features", f"features_{what}_best_random_features_summary", "#de8f05")]
        width = 0.8 / (len(groups) * len(TARGETS))
        for g, (name, var, color) in enumerate(groups):
            for t_i, t in enumerate(TARGETS):
                s = ds[var].sel(seq_len=n_est, target=t, data=values)
                est = s.sel(stat="estimate").values
                x = np.arange(len(values)) + (g * len(TARGETS) + t_i - (len(groups) * len(TARGETS) - 1) / 2) * width
                reached = np.isfinite(est)
                hatch = None if t_i == 0 else "//"
                ax.bar(x[reached], est[reached], width, color=color, hatch=hatch, edgecolor="white",
                       label=f"{name}, {t:.0%}")
                plotting.errorbar_summary(ax, s, x, fmt="none", ecolor="0.2", elinewidth=0.7, capsize=1.5)
                miss = np.isinf(est)
                ax.bar(x[miss], np.full(miss.sum(), n_est), width, color="none", edgecolor=color, hatch=hatch,
                       linestyle="--", linewidth=0.8)
        ax.axhline(n_est, color="0.5", linestyle=":", linewidth=1.0)
        plotting.log_axis(ax, "y")
        ax.set_ylim(1, n_est * 1.6)
        ax.set_xticks(np.arange(len(values)), [_label(v).replace(", ", ",\n").replace(" (", "\n(")
                                               for v in values], fontsize=6.5)
        ax.set(ylabel="rank / features needed", title=f"needed for 1% / 10% error, {what} matrix, n = {n_est}")
        ax.legend(fontsize=6, ncol=2, loc="lower left")
    fig.suptitle("The state-dimension spectrum: rank needed by text-like, real-text and continuous sequences")
    plotting.save_figure(fig, path, (
        "Top left/centre: singular values σ_i/σ_1 of a head's kernel matrix exp(s QKᵀ) and of its row-normalised "
        f"attention matrix at the largest n of each data type: median over {ds.sizes['seed']} seeds (each the median "
        f"over its {HEADS} heads) and 95 % bootstrap band. Bottom left/centre: smallest rank r whose best "
        "(truncated-SVD, Eckart–Young) approximation has relative Frobenius error ≤ 1% (solid) or 10% (dashed), "
        "against n (head-mean per draw; median and 95 % band over seeds); dotted: r = n. Right: at "
        f"n = {n_est}, the optimal rank of head 0 next to the smallest m of a power-of-two grid (m ≤ n) at which the "
        "best Nyström and the best random-feature estimator reach the target on that head (median over seeds, bars: "
        "95 % interval; dashed outline at n: not reached). The SVD ranks bound the Frobenius error of the matrix "
        f"they decompose only. Synthetic data at nominal beta = {SYNTHETIC_BETA:g}, d = 32; real heads of "
        "all-MiniLM-L6-v2 on Python's help text at their own temperature, up to one 512-token window; non-causal."))


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    values = [str(v) for v in ds.data.values]
    ns = [int(n) for n in ds.seq_len.values]
    n_max, n_min = max(ns), min(ns)
    rank = ds["rank_attention_draw_summary"]
    growth = ds["rank_attention_growth_summary"]
    lines = []
    parts = []
    for v in values:
        finite = finite_values(rank.sel(data=v, target=TARGETS[0]), "seq_len")
        if not finite:
            continue
        parts.append(f"{_label(v)} {fmt_ci(rank.sel(data=v, seq_len=finite[-1], target=TARGETS[0]))} at "
                     f"n = {finite[-1]} (growth exponent {fmt_ci(growth.sel(data=v, target=TARGETS[0]), 2)} over "
                     f"n = {finite[0]}–{finite[-1]})")
    lines.append(f"Rank a truncated SVD needs for {TARGETS[0]:.0%} relative Frobenius error of the attention matrix "
                 "softmax(s QKᵀ) (head mean per draw; median over seeds): " + "; ".join(parts)
                 + ". An exponent of 1 would mean a rank proportional to n.")
    kern = ds["rank_kernel_draw_summary"].sel(seq_len=n_max, target=TARGETS[0])
    if finite_values(kern, "data"):
        lines.append(f"For the kernel matrix exp(s QKᵀ) at n = {n_max} the same target needs: "
                     + fmt_cis(kern, "data", finite_values(kern, "data"), names=_label) + ".")
    if "text_like" in values:
        dq = ds["distinct_queries_draw_summary"].sel(data="text_like")
        lines.append(f"Text-like sequences hold {fmt_ci(dq.sel(seq_len=n_min), 3)} distinct tokens at n = {n_min} and "
                     f"{fmt_ci(dq.sel(seq_len=n_max), 3)} at n = {n_max}; their 1% attention rank is "
                     f"{fmt_ci(rank.sel(data='text_like', seq_len=n_min, target=TARGETS[0]), 3)} and "
                     f"{fmt_ci(rank.sel(data='text_like', seq_len=n_max, target=TARGETS[0]), 3)}.")
    if REAL_VALUE in values:
        b = ds["beta_eff_draw_summary"].sel(data=REAL_VALUE)
        finite = finite_values(b, "seq_len")
        if finite and n_max > finite[-1]:
            lines.append(f"Real MiniLM heads (β_eff {fmt_ci(b.sel(seq_len=finite[-1]), 2)} at n = {finite[-1]}) are "
                         f"decomposed up to one model window, n = {finite[-1]}: longer sequences would join windows "
                         "the model attended over separately.")
    n_est = int(ds["estimator_len"])
    if n_est in ns:
        t = TARGETS[-1]
        parts = []
        for v in values:
            opt = ds["rank_attention_head0_summary"].sel(data=v, seq_len=n_est, target=t)
            nys = ds["features_attention_best_nystrom_summary"].sel(data=v, seq_len=n_est, target=t)
            rf = ds["features_attention_best_random_features_summary"].sel(data=v, seq_len=n_est, target=t)
            if not np.isfinite(float(opt.sel(stat="estimate"))):
                continue
            parts.append(f"{_label(v)}: optimum {_needed(opt)}, best Nyström {_needed(nys)}, best random features "
                         f"{_needed(rf)}")
        lines.append(f"Features needed for {t:.0%} attention-matrix error at n = {n_est} (head 0, medians over seeds; "
                     "'not reached' = no m ≤ n did): " + "; ".join(parts) + ".")
    return lines


def _needed(summary) -> str:
    est = float(summary.sel(stat="estimate"))
    if np.isinf(est):
        return "not reached"
    return fmt_ci(summary, 3)


EXPERIMENT = Experiment.from_module(
    __name__, title="The state-dimension spectrum: rank needed by text-like, real-text and continuous sequences",
    description=("Singular-value decay of one head's exact kernel and attention matrices and the rank needed for a "
                 "1% / 10% relative Frobenius error (Eckart–Young), against sequence length, for Zipf-token text, "
                 "real MiniLM heads on English text (up to one 512-token window) and smooth continuous signals of "
                 "three correlation lengths; compared with the feature counts random-feature and Nyström "
                 "estimators need for the same targets. Grid: data × n × seed."))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
