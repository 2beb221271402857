"""How large is the attention-output error, and does it come from the numerator or the normaliser?

Inputs: isotropic Gaussian queries and keys in ``d = 32`` at temperature ``beta`` (``‖q‖‖k‖/√d ≈ beta``; see
:mod:`kernapprox.distributions`) and standard Gaussian values, ``heads`` independent heads per cell sharing one
estimator draw; every estimator, rank and causality sees the same data for a given length and seed (paired
comparisons). Each cell runs linear attention (chunked mode) with ``r`` features and exact softmax attention,
causal or not, in float64, and splits the error (medians over heads):

* output: ``‖Ŷ−Y‖_F/‖Y‖_F``;
* numerator: ``N_i = Σ_j exp(s q_iᵀk_j) v_j`` compared after dividing both by the exact normaliser ``Z_i``
  (``‖N̂/Z − Y‖_F/‖Y‖_F``), computed from the stabilised parts and the exact log-normaliser, so nothing
  overflows;
* normaliser: relative RMS of ``Ẑ_i/Z_i − 1`` over queries, and RMS of ``log(Ẑ_i/Z_i)`` over the queries
  where ``Ẑ_i > 0``;
* the rate of non-positive normalisers ``Ẑ_i ≤ 0`` (only signed maps such as ``trig`` have any).
"""

from __future__ import annotations

import numpy as np
import torch

import kernapprox as ka
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.metrics import nonpositive_normalizer_rate, relative_rms_error
from kernapprox.plotting import (
    estimator_style,
    loglog_rank_axes,
    median_band,
    new_figure,
    plot_median_band,
    reference_slope,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, run_cli

DIM = 32
HEADS = 4
CANDIDATES = ["trig", "trig_orthogonal", "positive", "positive_orthogonal", "hyperbolic_orthogonal",
              "oprf_orthogonal"]
ESTIMATORS = [name for name in CANDIDATES if name in ka.available_estimators()]

GRIDS = {
    "smoke": {"estimator": ["trig", "positive_orthogonal"], "num_features": [16, 64], "seq_len": [64],
              "causal": [False, True], "beta": [2.0], "seed": [0]},
    "default": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128, 256], "seq_len": [128, 512, 2048],
                "causal": [False, True], "beta": [2.0], "seed": [0, 1, 2]},
    "full": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128, 256, 512, 1024, 2048],
             "seq_len": [128, 512, 2048, 8192, 32768], "causal": [False, True], "beta": [1.0, 2.0, 4.0],
             "seed": list(range(8))},
}

METRICS = {
    "output_rel_rms": Metric(long_name="relative RMS error of the attention output", units="1",
                             description="‖Ŷ−Y‖_F/‖Y‖_F per head (inf if Ŷ is not finite); median over heads"),
    "numerator_rel_rms": Metric(long_name="relative RMS error of the numerator", units="1",
                                description="‖N̂/Z − N/Z‖_F/‖Y‖_F with N = Σ_j κ(q_i,k_j) v_j and the exact "
                                            "normaliser Z; median over heads"),
    "normalizer_rel_rms": Metric(long_name="relative RMS error of the normaliser", units="1",
                                 description="sqrt(mean_i (Ẑ_i/Z_i − 1)²); median over heads"),
    "normalizer_log_rms": Metric(long_name="RMS log-ratio of the normaliser", units="1",
                                 description="sqrt(mean_i log(Ẑ_i/Z_i)²) over queries with Ẑ_i > 0; median over "
                                             "heads"),
    "nonpositive_rate": Metric(long_name="rate of non-positive normalisers", units="1",
                               description="fraction of queries with Ẑ_i ≤ 0 or not finite; mean over heads"),
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="mean over pairs of ‖q_i‖‖k_j‖/√d, mean over heads"),
}


_EXACT: dict = {}  # per-process memo: every estimator and rank of a cell row shares one data draw


def exact_attention(data_rng, q, k, v, causal):
    """Exact output and log-normaliser, memoised by the data stream's seed (cells with the same data axes)."""
    seq = data_rng.bit_generator.seed_seq
    key = (seq.entropy, seq.spawn_key, causal, str(q.device))
    if key not in _EXACT:
        if len(_EXACT) >= 64:
            _EXACT.pop(next(iter(_EXACT)))
        _EXACT[key] = ka.softmax_attention(q, k, v, causal=causal, return_lse=True)
    return _EXACT[key]


def run_cell(params, rng, device, data_rng):
    dist = make_distribution("isotropic", beta=params["beta"])
    q, k, v = dist.sample(params["seq_len"], heads=HEADS, d=DIM, rng=data_rng, device=device,
                          dtype=torch.float64)                               # (1, heads, n, d) each
    causal = params["causal"]
    name = params["estimator"]
    r = None if ka.capabilities(name).fixed_dimension else params["num_features"]
    est = ka.make_estimator(name, num_features=r, rng=rng).fit(q, k)
    parts = ka.linear_attention(q, k, v, est, causal=causal, mode="chunked", return_parts=True)
    exact, lse = exact_attention(data_rng, q, k, v, causal)                  # (..., n, d_v), (..., n)
    to_exact = torch.exp(parts.log_scale - lse)                # true part / Z_i, from the stabilised parts
    ratio = parts.normalizer * to_exact                         # Ẑ_i / Z_i
    numerator = parts.numerator * to_exact[..., None]           # N̂_i / Z_i
    positive = ratio > 0
    log_sq = torch.where(positive, torch.log(torch.where(positive, ratio, 1.0)) ** 2, 0.0)
    log_rms = (log_sq.sum(-1) / positive.sum(-1)).sqrt()        # NaN for a head without a positive normaliser
    return {"output_rel_rms": _median(relative_rms_error(parts.output, exact)),
            "numerator_rel_rms": _median(relative_rms_error(numerator, exact)),
            "normalizer_rel_rms": _median(((ratio - 1.0) ** 2).mean(-1).sqrt()),
            "normalizer_log_rms": _median(log_rms),
            "nonpositive_rate": nonpositive_normalizer_rate(parts.normalizer).mean().item(),
            "beta_eff": effective_beta(q, k).mean().item()}


def _median(values: torch.Tensor) -> float:
    """Median over heads (the mean of the two middle values for an even count, unlike ``torch.median``)."""
    return float(np.median(values.cpu().numpy()))


# ------------------------------------------------------------------------------------------------------ plot
def plot(ds, path):
    ds = ds.sel(beta=ds.beta.values.max())
    names = [str(n) for n in ds.estimator.values]
    n_max = int(ds.seq_len.values.max())
    r_mid = int(ds.num_features.values[len(ds.num_features) // 2])
    r = ds.num_features.values
    fig, axes = new_figure(ds.sizes["causal"], 4, width=15.5, height=3.3 * ds.sizes["causal"] + 0.7,
                           squeeze=False)
    for row, causal in enumerate(ds.causal.values):
        sub = ds.sel(causal=causal)
        kind = "causal" if causal else "non-causal"
        ax = axes[row, 0]
        for name in names:
            plot_median_band(ax, sub["output_rel_rms"].sel(estimator=name, seq_len=n_max), x="num_features",
                             **estimator_style(name))
        y0 = float(median_band(sub["output_rel_rms"].sel(seq_len=n_max), "seed")[0].isel(num_features=0).median())
        reference_slope(ax, r, 1.5 * y0)
        loglog_rank_axes(ax, ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error, n = {n_max}, {kind}", fontsize=9)
        ax.legend(fontsize=6.5, loc="upper right")

        ax = axes[row, 1]
        for name in names:
            style = estimator_style(name)
            plot_median_band(ax, sub["numerator_rel_rms"].sel(estimator=name, seq_len=n_max), x="num_features",
                             **{**style, "linestyle": "-", "label": f"{name}: numerator"})
            plot_median_band(ax, sub["normalizer_rel_rms"].sel(estimator=name, seq_len=n_max), x="num_features",
                             band_alpha=0.0, **{**style, "linestyle": ":", "marker": "x",
                                                "label": f"{name}: normaliser"})
        loglog_rank_axes(ax, ylabel="relative RMS error")
        ax.set_title(f"numerator (solid) vs normaliser (dotted), n = {n_max}", fontsize=9)

        ax = axes[row, 2]
        for name in names:
            plot_median_band(ax, sub["output_rel_rms"].sel(estimator=name, num_features=r_mid), x="seq_len",
                             **estimator_style(name))
        loglog_rank_axes(ax, xlabel="sequence length n", ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error against n, r = {r_mid}, {kind}", fontsize=9)

        ax = axes[row, 3]
        signed = [name for name in names if float(sub["nonpositive_rate"].sel(estimator=name).max()) > 0]
        for name in signed:
            for n, alpha in zip(ds.seq_len.values, np.linspace(0.35, 1.0, ds.sizes["seq_len"])):
                med = median_band(sub["nonpositive_rate"].sel(estimator=name, seq_len=n), "seed")[0]
                style = estimator_style(name)
                ax.plot(med.num_features, med, **{**style, "alpha": alpha, "label": f"{name}, n = {n}"})
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.set_xlabel("number of features r")
        ax.set_ylabel("fraction of queries with Ẑ ≤ 0")
        ax.set_title(f"non-positive normalisers, {kind}", fontsize=9)
        if signed:
            ax.legend(fontsize=6.5)
        else:
            ax.text(0.5, 0.5, "no estimator produced Ẑ ≤ 0", ha="center", transform=ax.transAxes)
    beta = float(ds.beta.values)
    beta_eff = float(ds["beta_eff"].median())
    fig.suptitle("Attention-output error of linear attention against exact softmax attention", fontsize=11,
                 fontweight="bold")
    save_figure(fig, path, (
        f"Isotropic Gaussian q, k in d = {DIM} at β = {beta:g} (measured {beta_eff:.2f}), standard Gaussian "
        f"values, {HEADS} heads per draw, float64, chunked mode. Lines: median over {ds.sizes['seed']} seeds of "
        "the per-draw median over heads; bands: 10–90 % quantiles. Left: relative RMS output error against the "
        "state dimension r (grey dashed: r^(-1/2)). Second: the numerator Σ κ v and the normaliser Z = Σ κ, both "
        "relative to the exact normaliser. Third: output error against sequence length n at fixed r. Right: "
        "fraction of queries whose estimated normaliser is ≤ 0 (signed trigonometric features; positive maps "
        "never have any), darker = longer sequences."))


EXPERIMENT = Experiment(name="attention_error", title="Attention-output error: numerator, normaliser and output",
                        description=" ".join(__doc__.split("\n\n")[0].split()) + " " +
                        " ".join(__doc__.split("\n\n")[1].split()),
                        grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot,
                        data_axes=("seq_len", "beta", "seed"))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
