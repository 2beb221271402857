"""How large is the attention-output error, and does it come from the numerator or the normaliser?

Inputs: isotropic Gaussian queries and keys in ``d = 32`` at temperature ``beta`` (``‖q‖‖k‖/√d ≈ beta``; see
:mod:`kernapprox.distributions`) and standard Gaussian values, ``heads`` independent heads per cell sharing one
estimator draw; every estimator, rank and causality sees the same data for a given length and seed (paired
comparisons). Each cell runs linear attention (chunked mode) with ``r`` features and exact softmax attention,
causal or not, in float64 (exact attention in query blocks: no ``n × n`` matrix is ever held; computed once per
data draw and causality), and splits the error, each a median over heads. The output error is
``‖Ŷ−Y‖_F/‖Y‖_F``. The numerator ``N_i = Σ_j exp(s q_iᵀk_j) v_j`` is compared after dividing both by the exact
normaliser ``Z_i`` (``‖N̂/Z − Y‖_F/‖Y‖_F``), computed from the stabilised parts and the exact log-normaliser so that
nothing overflows. The normaliser error is the relative RMS of ``Ẑ_i/Z_i − 1`` over queries (and the RMS of
``log(Ẑ_i/Z_i)`` over the queries where ``Ẑ_i > 0``). The rate of non-positive normalisers ``Ẑ_i ≤ 0`` counts the
failures of signed maps such as ``trig``.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import (
    BASELINE,
    add_paired,
    add_summaries,
    interval_note,
    per_draw_slope,
    range_text,
    ratio_phrase,
    registered,
)
from kernapprox import stats
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.metrics import nonpositive_normalizer_rate, relative_rms_error
from kernapprox.plotting import (
    bullets,
    estimator_style,
    fmt,
    fmt_ci,
    fmt_pct,
    loglog_rank_axes,
    new_figure,
    plot_summary,
    reference_slope,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, Parameter, Reference, run_cli

ESTIMATORS = registered("trig", "trig_orthogonal", "positive", "positive_orthogonal", "hyperbolic_orthogonal",
                        "oprf_orthogonal")
POSITIVE = [name for name in ESTIMATORS if not name.startswith("trig")]

GRIDS = {
    "smoke": {"estimator": registered("trig", "positive", "positive_orthogonal"), "num_features": [16, 64],
              "seq_len": [64], "causal": [False, True], "beta": [2.0], "seed": [0, 1, 2]},
    "default": {"estimator": ESTIMATORS, "num_features": [16, 64, 256], "seq_len": [512, 2048, 8192],
                "causal": [False, True], "beta": [2.0], "seed": [0, 1, 2, 3, 4]},
    "full": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128, 256], "seq_len": [512, 2048, 8192],
             "causal": [False, True], "beta": [1.0, 2.0], "seed": list(range(8))},
}
PARAMETERS = {
    "dim": Parameter(32, long_name="head dimension d of queries, keys and values", units="1"),
    "heads": Parameter(2, long_name="independent heads per draw", units="1",
                       description="each head its own data; one estimator draw shared by the heads of a cell; "
                                   "per-draw values are medians over heads"),
}
AXIS_ATTRS = {"beta": {"long_name": "nominal inverse temperature β (E‖q‖² = β√d)", "units": "1"}}

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
}
REFERENCE_METRICS = {
    "beta_eff": Metric(long_name="effective inverse temperature", units="1",
                       description="mean over pairs of ‖q_i‖‖k_j‖/√d, mean over heads"),
}


def _data(params, data_rng, device):
    dist = make_distribution("isotropic", beta=params["beta"])
    return dist.sample(params["seq_len"], heads=params["heads"], d=params["dim"], rng=data_rng, device=device,
                       dtype=torch.float64)                                 # (1, heads, n, d) each


_EXACT: dict = {}  # per-process memo: every estimator and rank of a data draw shares one exact computation


def exact_attention(data_rng, q, k, v, causal):
    """Exact output and log-normaliser, memoised by the data stream's seed (cells with the same data axes)."""
    seq = data_rng.bit_generator.seed_seq
    key = (seq.entropy, seq.spawn_key, causal, str(q.device), tuple(q.shape))
    if key not in _EXACT:
        if len(_EXACT) >= 64:
            _EXACT.pop(next(iter(_EXACT)))
        _EXACT[key] = ka.softmax_attention(q, k, v, causal=causal, return_lse=True)
    return _EXACT[key]


def run_cell(params, rng, device, data_rng):
    q, k, v = _data(params, data_rng, device)
    causal = params["causal"]
    name = params["estimator"]
    r = None if ka.capabilities(name).fixed_dimension else params["num_features"]
    est = ka.make_estimator(name, num_features=r, rng=rng).fit(q, k)
    parts = ka.linear_attention(q, k, v, est, causal=causal, mode="chunked", return_parts=True)
    exact, lse = exact_attention(data_rng, q, k, v, causal)                 # (..., n, d_v), (..., n)
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
            "nonpositive_rate": nonpositive_normalizer_rate(parts.normalizer).mean().item()}


def run_reference(params, device, data_rng):
    q, k, v = _data(params, data_rng, device)
    for causal in (False, True):                                # fill the memo the cells of this draw read
        exact_attention(data_rng, q, k, v, causal)
    return {"beta_eff": effective_beta(q, k).mean().item()}


def _median(values: torch.Tensor) -> float:
    """Median over heads (the mean of the two middle values for an even count, unlike ``torch.median``)."""
    return float(np.median(values.cpu().numpy()))


# ------------------------------------------------------------------------------------------------ summaries
ERRORS = ["output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms", "normalizer_log_rms"]


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds = add_summaries(ds, ERRORS + ["beta_eff"], "seed")
    ds = add_summaries(ds, ["nonpositive_rate"], "seed", tail_threshold=None)
    if BASELINE in ds.estimator.values:
        ds = add_paired(ds, "output_rel_rms", BASELINE, "seed", op="ratio", label="baseline")
    return ds


# ------------------------------------------------------------------------------------------------------ plot
def plot(ds, path):
    ds = ds.sel(beta=ds.beta.values.max())
    names = [str(n) for n in ds.estimator.values]
    n_max = int(ds.seq_len.values.max())
    r_mid = int(ds.num_features.values[len(ds.num_features) // 2])
    r = ds.num_features.values
    out, num, den = (ds[f"{m}_summary"] for m in ("output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms"))
    fig, axes = new_figure(ds.sizes["causal"], 4, width=15.5, height=3.3 * ds.sizes["causal"] + 0.7,
                           squeeze=False)
    for row, causal in enumerate(ds.causal.values):
        kind = "causal" if causal else "non-causal"
        ax = axes[row, 0]
        for name in names:
            plot_summary(ax, out.sel(estimator=name, seq_len=n_max, causal=causal), "num_features",
                         **estimator_style(name))
        y0 = float(out.sel(seq_len=n_max, causal=causal, stat="estimate").isel(num_features=0).median())
        reference_slope(ax, r, 1.5 * y0)
        loglog_rank_axes(ax, ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error, n = {n_max}, {kind}", fontsize=9)
        ax.legend(fontsize=6.5, loc="upper right")

        ax = axes[row, 1]
        for name in [n for n in names if n in POSITIVE] or names:
            style = estimator_style(name)
            plot_summary(ax, num.sel(estimator=name, seq_len=n_max, causal=causal), "num_features",
                         **{**style, "linestyle": "-", "label": f"{name}: numerator"})
            plot_summary(ax, den.sel(estimator=name, seq_len=n_max, causal=causal), "num_features",
                         **{**style, "linestyle": ":", "marker": "x", "label": f"{name}: normaliser"})
        loglog_rank_axes(ax, ylabel="relative RMS error")
        ax.set_title(f"positive maps: numerator (solid) vs normaliser (dotted), n = {n_max}", fontsize=8.5)

        ax = axes[row, 2]
        for name in names:
            plot_summary(ax, out.sel(estimator=name, num_features=r_mid, causal=causal), "seq_len",
                         **estimator_style(name))
        loglog_rank_axes(ax, xlabel="sequence length n", ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error against n, r = {r_mid}, {kind}", fontsize=9)

        ax = axes[row, 3]
        rate = ds["nonpositive_rate_summary"].sel(causal=causal)
        signed = [name for name in names if float(rate.sel(estimator=name, stat="hi").max()) > 0]
        for name in signed:
            for n, alpha in zip(ds.seq_len.values, np.linspace(0.35, 1.0, ds.sizes["seq_len"])):
                style = estimator_style(name)
                plot_summary(ax, rate.sel(estimator=name, seq_len=n), "num_features", band_alpha=0.1 * alpha,
                             **{**style, "alpha": alpha, "label": f"{name}, n = {n}"})
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
    beta_eff = float(ds["beta_eff_summary"].sel(seq_len=n_max, stat="estimate"))
    fig.suptitle("Attention-output error of linear attention against exact softmax attention", fontsize=11,
                 fontweight="bold")
    save_figure(fig, path, (
        f"Isotropic Gaussian q, k in d = {int(ds['dim'])} at β = {beta:g} (measured {beta_eff:.2f}), standard "
        f"Gaussian values, {int(ds['heads'])} heads per draw, float64, chunked mode; exact attention computed in "
        f"query blocks. Lines: median over {ds.sizes['seed']} seeds of the per-draw median over heads; bands: 95 % "
        "bootstrap interval of that median. Left: relative RMS output error against the state dimension r (grey "
        "dashed: r^(-1/2)). Second: numerator Σ κ v and normaliser Z = Σ κ of the positive maps, both relative to "
        "the exact normaliser. Third: output error against sequence length n at fixed r. Right: fraction of queries "
        "whose estimated normaliser is ≤ 0 (signed trigonometric features only), darker = longer sequences."))


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    ds = ds.sel(beta=ds.beta.values.max())
    beta = float(ds.beta)
    out = ds["output_rel_rms_summary"]
    names = [str(n) for n in ds.estimator.values]
    n_max, n_min = int(ds.seq_len.max()), int(ds.seq_len.min())
    r_max, r_min = int(ds.num_features.max()), int(ds.num_features.min())
    r_mid = int(ds.num_features.values[len(ds.num_features) // 2])
    lines = []
    top = out.sel(seq_len=n_max, num_features=r_max, causal=False)
    order = [names[i] for i in np.argsort(top.sel(stat="estimate").values)]
    head = (f"At n = {n_max}, r = {r_max}, β = {beta:g} (non-causal) the smallest median output error is "
            f"`{order[0]}`'s, {fmt_ci(top.sel(estimator=order[0]))}")
    other = order[1] if order[0] == BASELINE and len(order) > 1 else order[0]
    if "output_rel_rms_vs_baseline_summary" in ds and other != BASELINE:
        vs = ds["output_rel_rms_vs_baseline_summary"].sel(seq_len=n_max, num_features=r_max, causal=False,
                                                          estimator=other)
        head += (f"; `{other}` is {ratio_phrase(vs)} than FAVOR+ (`{BASELINE}`, "
                 f"{fmt_ci(top.sel(estimator=BASELINE))}) on the same draws, below it in "
                 f"{fmt_pct(float(vs.sel(stat='below')))} of them")
    lines.append(head + ".")
    positive = [n for n in names if n in POSITIVE]
    if positive:
        split = stats.bootstrap_interval(
            ds["numerator_rel_rms"].sel(estimator=positive, seq_len=n_max, num_features=r_max, causal=False)
            / ds["normalizer_rel_rms"].sel(estimator=positive, seq_len=n_max, num_features=r_max, causal=False),
            "seed")
        parts = "; ".join(f"`{n}` {fmt_ci(split.sel(estimator=n))}" for n in positive)
        above = [n for n in positive if float(split.sel(estimator=n, stat="lo")) > 1]
        lines.append(f"Per-draw ratio of numerator to normaliser error at n = {n_max}, r = {r_max}: {parts}; above 1 "
                     f"with its whole interval for {len(above)} of {len(positive)} positive maps.")
        slopes = {m: stats.bootstrap_interval(per_draw_slope(
            ds[m].sel(estimator=positive, seq_len=n_max, causal=False), "num_features"), "seed")
            for m in ("output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms")}
        est = {m: slopes[m].sel(stat="estimate") for m in slopes}
        slower = int(((est["output_rel_rms"] > est["numerator_rel_rms"])
                      & (est["output_rel_rms"] > est["normalizer_rel_rms"])).sum())
        lines.append(
            f"Fitted log–log slopes in r ({r_min}–{r_max}, n = {n_max}, median over seeds per map): numerator "
            f"{range_text(est['numerator_rel_rms'].values)}, normaliser "
            f"{range_text(est['normalizer_rel_rms'].values)}, output {range_text(est['output_rel_rms'].values)} (the "
            "Monte Carlo rate is −0.5); the output error "
            f"falls more slowly than both of its parts for {slower} of {len(positive)} positive maps.")
    causal_ratio = stats.bootstrap_interval(
        ds["output_rel_rms"].sel(causal=True, seq_len=n_max, num_features=r_max)
        / ds["output_rel_rms"].sel(causal=False, seq_len=n_max, num_features=r_max), "seed")
    lo_c = [n for n in names if float(causal_ratio.sel(estimator=n, stat="hi")) < 1]
    lines.append(f"Causal against non-causal output error on the same data (n = {n_max}, r = {r_max}, per-draw ratio): "
                 + "; ".join(f"`{n}` {fmt_ci(causal_ratio.sel(estimator=n))}" for n in names)
                 + f" — below 1 with its whole interval for {len(lo_c)} of {len(names)} maps.")
    if positive and n_max != n_min:
        pieces = []
        for n in positive:
            a, b = (out.sel(estimator=n, num_features=r_mid, causal=False, seq_len=length)
                    for length in (n_min, n_max))
            pieces.append(f"`{n}` {fmt_ci(a)} → {fmt_ci(b)}")
        lines.append(f"At fixed r = {r_mid}, from n = {n_min} to n = {n_max} (non-causal; independent draws per "
                     "length): " + "; ".join(pieces) + ".")
    trig = [n for n in names if n.startswith("trig")]
    if trig:
        rate = ds["nonpositive_rate_summary"]
        pieces = []
        for n in trig:
            lo_r = rate.sel(estimator=n, num_features=r_min, causal=False, seq_len=n_max)
            hi_r = rate.sel(estimator=n, num_features=r_max, causal=False, seq_len=n_max)
            e_lo = out.sel(estimator=n, num_features=r_min, causal=False, seq_len=n_max)
            pieces.append(f"`{n}`: {fmt_ci(lo_r, percent=True)} of normalisers ≤ 0 at r = {r_min} (output error "
                          f"{fmt_ci(e_lo)}), {fmt_ci(hi_r, percent=True)} at r = {r_max}")
        lines.append(f"Signed trigonometric features fail where their normaliser is ≤ 0 (n = {n_max}, non-causal): "
                     + "; ".join(pieces) + ".")
    if positive:
        worst = float(ds["nonpositive_rate"].sel(estimator=positive).max())
        lines.append(f"The largest rate of non-positive normalisers among the positive maps, over every cell and "
                     f"draw, is {fmt(worst)}.")
    lines.append(interval_note(ds))
    return bullets(lines)


EXPERIMENT = Experiment(name="attention_error", title="Attention-output error: numerator, normaliser and output",
                        description=" ".join(__doc__.split()),
                        grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot,
                        data_axes=("seq_len", "beta", "seed"),
                        reference=Reference(run_cell=run_reference, metrics=REFERENCE_METRICS),
                        parameters=PARAMETERS, axis_attrs=AXIS_ATTRS, summarise=summarise, findings=findings)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
