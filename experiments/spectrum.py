"""The state-dimension spectrum: which rank does a sequence's attention need, text against continuous signals?

For each data type and sequence length ``n``, the exact matrices of four heads are decomposed in float64:

* the kernel matrix ``A = exp(s QKᵀ)`` (the quantity every feature map approximates), and
* the row-normalised attention matrix ``P = softmax(s QKᵀ)``. Any non-causal linear attention with a state of
  ``r`` features produces ``P̂ = D̂⁻¹ Φ(Q)Ψ(K)ᵀ`` of rank ≤ ``r``, so the best rank-``r`` approximation of ``P``
  is a floor for the attention weights of every such method.

By Eckart–Young the smallest rank reaching relative Frobenius error 1% and 10% follows from the singular values
(:func:`kernapprox.spectrum.rank_for_relative_error`). On the first of these heads, random-feature and Nyström
estimators are run on a grid of feature counts ``m ≤ n`` (a state larger than ``n`` is no smaller than the KV cache;
stopping once both errors are ≤ 1%), and the smallest ``m`` of the grid reaching each target is recorded: what
the best practical estimators need against the optimum. These sweeps cost O(n²m) per ``m`` and run up to
``n = 512`` on a CPU (``ESTIMATOR_MAX_N``; 4096 on CUDA); beyond that only the spectra are computed.

Data: ``text_like`` (Zipf tokens with fixed random embeddings), ``real_text`` (heads of all-MiniLM-L6-v2, four
distinct (layer, head) pairs drawn per cell among all 72, on Python's help text; beyond 512 tokens consecutive
model windows are concatenated), and ``continuous_l{ℓ}`` (smooth Gaussian-process trajectories with correlation length
``ℓ`` tokens). Synthetic data run at nominal ``beta = 8`` (logit spread ≈ 1.4, inside the 1.0–3.4 of the real
heads); real heads at their own temperature. Non-causal throughout (the real model is bidirectional).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

import kernapprox as ka
from kernapprox import metrics, real
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.spectrum import (
    attention_singular_values,
    kernel_singular_values,
    rank_for_relative_error,
    smallest_size_reaching,
)
from kernapprox.sweep import Experiment, Metric, run_cli

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
# Estimator sweeps cost O(n² m) per m: on a CPU they run up to n = 512 (the spectra go further).
ESTIMATOR_MAX_N = {"cpu": 512, "cuda": 4096}


def _grids(real_available: bool) -> dict:
    data = ["text_like", *([REAL_VALUE] if real_available else []), "continuous_l2", "continuous_l8",
            "continuous_l32"]
    return {
        "smoke": {"data": ["text_like", *([REAL_VALUE] if real_available else []), "continuous_l8"],
                  "seq_len": [32, 64], "seed": [0]},
        "default": {"data": data, "seq_len": [128, 256, 512, 1024], "seed": [0, 1]},
        "full": {"data": data, "seq_len": [128, 256, 512, 1024, 2048, 4096], "seed": [0, 1, 2, 3, 4, 5, 6, 7]},
    }


GRIDS = _grids(REAL_REASON is None)


def _real_windows(n: int) -> int:
    """512-token windows the cached real stream needs for ``n`` tokens (at least the shared 4-window cache)."""
    return max(4, -(-n // real.WINDOW))


HEADS = 4                # heads per cell for the spectra; the estimator sweeps run on head 0
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
                              description="smallest m of the grid with kernel_error ≤ target (NaN: none ≤ n)",
                              dims=("estimator", "target"), coords=_EST_T),
    "features_attention": Metric(long_name="features an estimator needs for an attention-matrix error", units="1",
                                 description="smallest m of the grid with attention_weights_error ≤ target (NaN: "
                                             "none ≤ n)", dims=("estimator", "target"), coords=_EST_T),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="s · mean‖q_i‖ · mean‖k_j‖", dims=("head",), coords=_HEAD),
    "logit_std": Metric(long_name="spread of the logits", units="1", description="std of s q_iᵀk_j over all pairs",
                        dims=("head",), coords=_HEAD),
    "distinct_queries": Metric(long_name="distinct query vectors", units="1",
                               description="number of distinct rows of Q (= distinct tokens for text_like)",
                               dims=("head",), coords=_HEAD),
}
_NAN = {name: np.nan for name in METRICS}


def distribution_for(value: str, n: int):
    """The distribution behind a ``data`` axis value."""
    if value in SYNTHETIC:
        name, params = SYNTHETIC[value]
        return make_distribution(name, beta=SYNTHETIC_BETA, **params)
    if value == REAL_VALUE:
        return make_distribution("real", num_windows=_real_windows(n))
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
        return dict(_NAN)
    n = params["seq_len"]
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
    if n <= ESTIMATOR_MAX_N.get(q.device.type, ESTIMATOR_MAX_N["cpu"]):
        for e, name in enumerate(ESTIMATORS):
            kern[e], attn[e] = estimator_errors(q, k, exact_kernel, exact_weights, name, rng)
    out["kernel_error"], out["attention_weights_error"] = kern, attn
    out["features_kernel"] = np.array([[smallest_size_reaching(kern[e], FEATURE_GRID, t) for t in TARGETS]
                                       for e in range(len(ESTIMATORS))])
    out["features_attention"] = np.array([[smallest_size_reaching(attn[e], FEATURE_GRID, t) for t in TARGETS]
                                          for e in range(len(ESTIMATORS))])
    return out


# --------------------------------------------------------------------------------------------------- figure
RANDOM_FEATURES = [e for e in ESTIMATORS if not e.startswith("nystrom")]
NYSTROM = [e for e in ESTIMATORS if e.startswith("nystrom")]


def data_colors(values):
    """text: warm colours; continuous: greens from rough (light) to smooth (dark)."""
    import seaborn as sns

    conts = [v for v in values if v.startswith("continuous")]
    greens = sns.color_palette("crest", len(conts) + 1).as_hex()
    colors = {"text_like": "#d55e00", REAL_VALUE: "#000000"}
    colors.update({v: greens[i] for i, v in enumerate(conts)})
    return colors


def _label(value):
    if value.startswith("continuous_l"):
        return f"continuous, ℓ = {value.removeprefix('continuous_l')}"
    return {"text_like": "text-like (Zipf tokens)", REAL_VALUE: "real text heads (MiniLM)"}.get(value, value)


def _best(da, names):
    """Smallest feature count over a group of estimators (NaN where none reached the target)."""
    names = [e for e in names if e in da.estimator.values]
    return da.sel(estimator=names).min("estimator", skipna=True) if names else None


def _samples(da):
    """Seeds and heads pooled into one ``sample`` dimension."""
    return da.stack(sample=("seed", "head"))


def plot(ds, path):
    from matplotlib import ticker
    from matplotlib.patches import Patch

    from kernapprox import plotting

    values = [str(v) for v in ds.data.values]
    colors = data_colors(values)
    ns = [int(n) for n in ds.seq_len.values]
    n_max = ns[-1]
    fig, axes = plotting.new_figure(2, 3, width=14.5, height=7.4, squeeze=False)
    for col, (var, what) in enumerate((("kernel_sv", "kernel matrix A = exp(s QKᵀ)"),
                                       ("attention_sv", "attention matrix P = softmax(s QKᵀ)"))):
        ax = axes[0, col]
        for v in values:
            med, lo, hi = plotting.median_band(_samples(ds[var].sel(data=v, seq_len=n_max)), dim="sample")
            idx = np.arange(1, med.size + 1)
            ok = np.isfinite(med.values) & (med.values > 0)
            ax.plot(idx[ok], med.values[ok], color=colors[v], label=_label(v))
            ax.fill_between(idx[ok], np.maximum(lo.values[ok], 1e-300), hi.values[ok], color=colors[v], alpha=0.15,
                            linewidth=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1e-12, 1.5)
        ax.set_xlabel("index i")
        ax.set_ylabel("σ_i / σ_1")
        ax.set_title(f"spectrum of the {what.split(' ')[0]} matrix, n = {n_max}")
        ax = axes[1, col]
        rank = ds["rank_kernel" if col == 0 else "rank_attention"]
        for v in values:
            for t, style in zip(TARGETS, ("-", "--")):
                med, lo, hi = plotting.median_band(_samples(rank.sel(data=v, target=t)), dim="sample")
                ax.plot(ns, med.values, color=colors[v], linestyle=style, marker="o",
                        label=_label(v) if t == TARGETS[0] else None)
                ax.fill_between(ns, lo.values, hi.values, color=colors[v], alpha=0.12, linewidth=0)
        ax.plot(ns, ns, color="0.5", linestyle=":", linewidth=1.0, label="rank = n")
        plotting.loglog_rank_axes(ax, xlabel="sequence length n", ylabel="rank r for the target")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_title(f"rank for 1% (solid) / 10% (dashed) error, {what.split(' ')[0]} matrix")
    axes[0, 0].legend(fontsize=6.5)
    axes[1, 0].legend(fontsize=6.5)

    # Estimators against the optimum at the largest n where they ran.
    ran = [n for n in ns if bool(np.isfinite(ds["kernel_error"].sel(seq_len=n)).any())]
    for row, (feat, rank, what) in enumerate((("features_attention", "rank_attention", "attention matrix"),
                                              ("features_kernel", "rank_kernel", "kernel matrix"))):
        ax = axes[row, 2]
        if not ran:
            ax.set_visible(False)
            continue
        n_est = ran[-1]
        groups = [("optimal (SVD)", None, "#444444"), ("best Nyström", NYSTROM, "#ca9161"),
                  ("best random features", RANDOM_FEATURES, "#de8f05")]
        width = 0.8 / (len(groups) * len(TARGETS))
        handles = []
        for g, (name, members, color) in enumerate(groups):
            for t_i, t in enumerate(TARGETS):
                if members is None:
                    da = ds[rank].sel(seq_len=n_est, target=t, head=0)     # the estimators' head: paired
                else:
                    best = _best(ds[feat].sel(seq_len=n_est, target=t), members)
                    if best is None:
                        continue
                    da = best
                med = da.median("seed", skipna=False).sel(data=values).values
                reached = np.isfinite(med)
                x = np.arange(len(values)) + (g * len(TARGETS) + t_i - (len(groups) * len(TARGETS) - 1) / 2) * width
                hatch = None if t_i == 0 else "//"
                ax.bar(x[reached], med[reached], width, color=color, hatch=hatch, edgecolor="white")
                handles.append(Patch(facecolor=color, edgecolor="white", hatch=hatch, label=f"{name}, {t:.0%}"))
                ax.bar(x[~reached], np.full((~reached).sum(), n_est), width, color="none", edgecolor=color,
                       hatch=hatch, linestyle="--", linewidth=0.8)
        ax.axhline(n_est, color="0.5", linestyle=":", linewidth=1.0)
        ax.set_yscale("log", base=2)
        ax.set_ylim(1, n_est * 1.6)
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks(np.arange(len(values)), [_label(v).replace(", ", ",\n").replace(" (", "\n(")
                                               for v in values], fontsize=6.5)
        ax.set_ylabel("rank / features needed")
        ax.set_title(f"needed for 1% / 10% error, {what}, n = {n_est}")
        handles.append(Patch(facecolor="none", edgecolor="0.3", linestyle="--", label="not reached at m ≤ n"))
        ax.legend(handles=handles, fontsize=6, ncol=2, loc="lower left")
    fig.suptitle("The state-dimension spectrum: rank needed by text-like, real-text and continuous sequences")
    beta = SYNTHETIC_BETA
    plotting.save_figure(fig, path, (
        f"Top left/centre: singular values σ_i/σ_1 of a head's kernel matrix exp(s QKᵀ) and of its row-normalised "
        f"attention matrix at n = {n_max} (median and 10–90% band over seeds × {HEADS} heads). Bottom left/centre: "
        "smallest rank r "
        "whose best (truncated-SVD, Eckart–Young) approximation has relative Frobenius error ≤ 1% (solid) or 10% "
        "(dashed), against n; dotted: r = n. Right: at the largest n where the estimators ran, the optimal rank "
        "of head 0 next to the smallest m of a power-of-two grid (m ≤ n) at which the best Nyström and the best "
        "random-feature estimator reach the target on that head (median over seeds; dashed outline at n: not "
        "reached). "
        f"Synthetic data at nominal beta = {beta:g}, d = 32; real heads of all-MiniLM-L6-v2 on Python's help "
        "text at their own temperature, non-causal."))


EXPERIMENT = Experiment(
    name="spectrum",
    title="The state-dimension spectrum: rank needed by text-like, real-text and continuous sequences",
    description=("Singular-value decay of one head's exact kernel and attention matrices and the rank needed for a "
                 "1% / 10% relative Frobenius error (Eckart–Young), against sequence length, for Zipf-token text, "
                 "real MiniLM heads on English text and smooth continuous signals of three correlation lengths; "
                 "compared with the feature counts random-feature and Nyström estimators need for the same "
                 "targets. Grid: data × n × seed."),
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
