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

Equal state bytes: ``num_features`` is the memory budget ``r``. The random-feature maps run with ``r`` features; the
estimators whose memory is not ``r·(d_v + 1)`` — LARA (``lara``, ``lara_balance``, ``lara_mean``: draws, key sums
and proposal landmarks), EVA (``eva``, ``eva_mean``: an exact window of 32 keys and per-group summaries, whose size
depends on ``n``), Nyström with uniform landmarks (landmarks and whitening) and the window hybrids (``window_linear``,
``scatterbrain``: 64 exact keys beside the features) — run at their largest configuration whose
``state_bytes(d_v, float32, seq_len=n)`` fits the budget ``B(r)``, the state of FAVOR+/OPRF at ``r`` features
(:func:`kernapprox.memory.sized_configuration`); the configuration (features, EVA's group size) and its bytes
are stored per cell. An estimator with no configuration within the budget, or LARA in causal attention (defined
non-causally), is not applicable there: NaN, with its smallest possible state stored. The reference also stores
the error of the uniform average of the values (all of them, or the prefix when causal), the output of attention
that ignores the keys. Values of β below the largest run up to ``beta_sweep_max_len`` tokens only (the exact
reference at the longest length costs most).
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import (
    BASELINE,
    EQUAL_BYTES,
    EQUAL_BYTES_COMPARATORS,
    add_comparison,
    add_paired,
    add_summaries,
    per_draw_slope,
    range_text,
    ratio_phrase,
    registered,
    sized_configuration,
    smallest_state,
    verdict,
)
from kernapprox import stats
from kernapprox.distributions import effective_beta, make_distribution
from kernapprox.memory import budget_bytes
from kernapprox.metrics import nonpositive_normalizer_rate, relative_rms_error
from kernapprox.plotting import (
    errorbar_summary,
    estimator_lines,
    estimator_style,
    figure_legend,
    finite_values,
    floor_ylim,
    fmt,
    fmt_bytes,
    fmt_ci,
    fmt_cis,
    fmt_pct,
    log_axis,
    loglog_rank_axes,
    new_figure,
    plot_summary,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

RANDOM_FEATURES = registered("trig", "trig_orthogonal", "positive", "positive_orthogonal", "hyperbolic_orthogonal",
                             "oprf_orthogonal")
POSITIVE = [name for name in RANDOM_FEATURES if not name.startswith("trig")]
OPRF = "oprf_orthogonal"
NYSTROM = "nystrom_uniform"
SIZED = {label: spec for label, spec in {**EQUAL_BYTES, **EQUAL_BYTES_COMPARATORS}.items()
         if registered(spec[0])}                    # label -> (registry name, options), sized by the budget
ESTIMATORS = RANDOM_FEATURES + list(SIZED)
LARA_EVA = [label for label in SIZED if label in EQUAL_BYTES]   # the estimators of issue [9]
MATCHED = [n for n in (BASELINE, OPRF) if n in RANDOM_FEATURES] + list(SIZED)   # the equal-bytes panels

GRIDS = {
    "smoke": {"estimator": registered("trig", "positive", "positive_orthogonal") + [
                  label for label in ("lara", "eva_mean") if label in SIZED],
              "num_features": [16, 256], "seq_len": [64], "causal": [False, True], "beta": [2.0],
              "seed": [0, 1, 2]},
    "default": {"estimator": ESTIMATORS, "num_features": [16, 64, 256], "seq_len": [512, 2048, 8192],
                "causal": [False, True], "beta": [1.0, 2.0], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws (~3 min of one core)
    "full": {"estimator": ESTIMATORS, "num_features": [16, 64, 256], "seq_len": [512, 2048, 8192],
             "causal": [False, True], "beta": [1.0, 2.0], "seed": list(range(10))},
}
DATA_AXES = ("seq_len", "beta", "seed")
PARAMETERS = {
    "dim": Parameter(32, "head dimension d of queries, keys and values", "1"),
    "heads": Parameter(2, "independent heads per draw", "1", "each head its own data; one estimator draw shared by the "
                       "heads of a cell; per-draw values are medians over heads"),
    "long_beta": Parameter(2.0, "the β at which every sequence length runs", "1"),
    "beta_sweep_max_len": Parameter(2048, "longest sequence at which the other β values run", "token",
                                    "beyond it only long_beta runs (cells and references NaN)"),
}
AXIS_ATTRS = {"beta": {"long_name": "nominal inverse temperature β (E‖q‖² = β√d)", "units": "1"},
              "num_features": {"long_name": "memory budget: the feature count r of FAVOR+ (random-feature maps "
                                            "run with r features; the others at their largest configuration whose "
                                            "state fits B(r), the state of FAVOR+/OPRF at r)", "units": "1"}}

METRICS = {
    "output_rel_rms": Metric("relative RMS error of the attention output", "1",
                             "‖Ŷ−Y‖_F/‖Y‖_F per head (inf if Ŷ is not finite); median over heads"),
    "numerator_rel_rms": Metric("relative RMS error of the numerator", "1",
                                "‖N̂/Z − N/Z‖_F/‖Y‖_F with N = Σ_j κ(q_i,k_j) v_j and the exact normaliser Z; "
                                "median over heads"),
    "normalizer_rel_rms": Metric("relative RMS error of the normaliser", "1",
                                 "sqrt(mean_i (Ẑ_i/Z_i − 1)²); median over heads"),
    "normalizer_log_rms": Metric("RMS log-ratio of the normaliser", "1",
                                 "sqrt(mean_i log(Ẑ_i/Z_i)²) over queries with Ẑ_i > 0; median over heads"),
    "nonpositive_rate": Metric("rate of non-positive normalisers", "1",
                               "fraction of queries with Ẑ_i ≤ 0 or not finite; mean over heads"),
    "state_bytes": Metric("state kept by the configuration run", "byte",
                          "estimator.state_bytes(d_v, float32, seq_len=n); NaN where not applicable"),
    "budget_bytes": Metric("memory budget B(r)", "byte", "the larger state of FAVOR+ and OPRF at r features (float32)"),
    "features_used": Metric("num_features of the configuration run", "1",
                            "r for random features; the largest value within the budget for the others (EVA: its "
                            "number of groups ⌈n/g⌉); NaN where not applicable"),
    "group_size": Metric("EVA's group size g", "token",
                         "the smallest group size whose state fits the budget; NaN for the others"),
    "smallest_state_bytes": Metric("smallest state of the estimator's configurations", "byte",
                                   "at this n (one feature; EVA: its best group size): what an estimator that fits "
                                   "no budget would need"),
}
REFERENCE_METRICS = {
    "beta_eff": Metric("effective inverse temperature", "1", "mean over pairs of ‖q_i‖‖k_j‖/√d, mean over heads"),
    "uniform_rel_rms": Metric("relative RMS error of the uniform average of the values", "1",
                              "‖V̄−Y‖_F/‖Y‖_F with V̄_i the mean of all values (non-causal attention); median over "
                              "heads"),
    "uniform_rel_rms_causal": Metric("relative RMS error of the uniform prefix average", "1",
                                     "‖V̄−Y‖_F/‖Y‖_F with V̄_i the mean of v_1..v_i (causal attention); median over "
                                     "heads"),
}


def _data(params, data_rng, device):
    dist = make_distribution("isotropic", beta=params["beta"])
    return dist.sample(params["seq_len"], heads=params["heads"], d=params["dim"], rng=data_rng, device=device,
                       dtype=torch.float64)                                 # (1, heads, n, d) each


def draw(params, data_rng, device):
    """The draw of a (β, n, seed) in the design, ``(q, k, v, exact)`` with ``exact[causal]`` exact attention's
    output and log-normaliser on it (the engine hands it to every estimator and rank); None for a draw outside the
    design (its cells are not applicable)."""
    if not _runs(params):
        return None
    q, k, v = _data(params, data_rng, device)
    return q, k, v, {c: ka.softmax_attention(q, k, v, causal=c, return_lse=True) for c in (False, True)}


def _runs(params) -> bool:
    """Whether the cell's data draw is in the design (β other than ``long_beta`` up to ``beta_sweep_max_len``)."""
    return params["beta"] == params["long_beta"] or params["seq_len"] <= params["beta_sweep_max_len"]


def configuration(params) -> tuple[str, dict | None, dict]:
    """``(registry name, constructor arguments or None, bookkeeping)`` of the cell's estimator at its budget: ``r``
    features for random-feature maps, the largest configuration within ``B(r)`` for the others (None: none fits,
    or a non-causal-only estimator in causal attention)."""
    label, r, n, d = params["estimator"], params["num_features"], params["seq_len"], params["dim"]
    budget = budget_bytes(r, d=d, d_v=d, seq_len=n)
    if label not in SIZED:
        return label, {"num_features": None if ka.capabilities(label).fixed_dimension else r}, {"budget": budget}
    name, options = SIZED[label]
    info = {"budget": budget, "smallest": smallest_state(name, options, d=d, d_v=d, seq_len=n)}
    if params["causal"] and not ka.capabilities(name, **options).causal:
        return name, None, info
    return name, sized_configuration(name, options, budget, d=d, d_v=d, seq_len=n), info


def run_cell(params, rng, device, data):
    if data is None:
        return not_applicable()
    name, kwargs, info = configuration(params)
    book = {"budget_bytes": float(info["budget"]), "smallest_state_bytes": float(info.get("smallest", np.nan))}
    if kwargs is None:                                          # not applicable: nothing fits, or causal LARA
        return not_applicable(**book)
    q, k, v, exact = data
    causal = params["causal"]
    est = ka.make_estimator(name, rng=rng, **kwargs).fit(q, k)
    state = est.state_bytes(params["dim"], torch.float32, seq_len=params["seq_len"])
    if params["estimator"] in MATCHED and state > info["budget"]:      # the equal-bytes rule, checked per cell
        raise RuntimeError(f"{params['estimator']} keeps {state} bytes, over its budget of {info['budget']}")
    parts = ka.linear_attention(q, k, v, est, causal=causal, mode="chunked", return_parts=True)
    exact, lse = exact[causal]                                            # (..., n, d_v), (..., n)
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
            "state_bytes": float(state), "features_used": float(kwargs.get("num_features") or np.nan),
            "group_size": float(kwargs.get("group_size", np.nan)), **book}


def run_reference(params, device, data):
    if data is None:
        return not_applicable()
    q, k, v, exacts = data
    uniform = {c: _median(relative_rms_error(ka.uniform_attention(v, causal=c), y)) for c, (y, _) in exacts.items()}
    return {"beta_eff": effective_beta(q, k).mean().item(), "uniform_rel_rms": uniform[False],
            "uniform_rel_rms_causal": uniform[True]}


def _median(values: torch.Tensor) -> float:
    """Median over heads (the mean of the two middle values for an even count, unlike ``torch.median``)."""
    return float(np.median(values.cpu().numpy()))


# ------------------------------------------------------------------------------------------------ summaries
ERRORS = ["output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms", "normalizer_log_rms"]
UNIFORM = "the uniform average of the values"


def _uniform(ds: xr.Dataset) -> xr.DataArray:
    """The uniform-average error of each draw along ``causal`` (non-causal: all values; causal: the prefix)."""
    both = xr.concat([ds["uniform_rel_rms"], ds["uniform_rel_rms_causal"]], dim="causal")
    return both.assign_coords(causal=[False, True]).reindex(causal=ds.causal.values)   # (sel: a bool mask)


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds = add_summaries(ds, ERRORS + ["beta_eff", "uniform_rel_rms", "uniform_rel_rms_causal"], "seed")
    ds = add_summaries(ds, ["nonpositive_rate"], "seed", tail_threshold=None)
    for baseline, label in ((BASELINE, "baseline"), (OPRF, "oprf"), (NYSTROM, "nystrom")):
        ds = add_paired(ds, "output_rel_rms", baseline, "seed", op="ratio", label=label)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = ds["output_rel_rms"] / _uniform(ds)
    ratio.attrs = {"long_name": f"output error / that of {UNIFORM} on the same draw", "units": "1",
                   "description": "per draw, output_rel_rms / uniform_rel_rms (causal: uniform_rel_rms_causal); "
                                  "below 1: closer to softmax attention than attention that ignores the keys",
                   "baseline": "uniform average", "comparison": "ratio"}
    return add_comparison(ds, "output_rel_rms_vs_uniform", ratio, "seed")


# ------------------------------------------------------------------------------------------------------ plot
def _matched_length(ds) -> int:
    """The sequence length of the equal-bytes panels and findings: 2048 when present."""
    lengths = [int(n) for n in ds.seq_len.values]
    return 2048 if 2048 in lengths else lengths[len(lengths) // 2]


def _not_applicable(ds, name, **sel) -> list[int]:
    """The budgets r at which ``name`` did not run (no configuration fits, or causal LARA)."""
    used = ds["features_used"].sel(estimator=name, **sel)
    return [int(r) for r in ds.num_features.values if not bool(used.sel(num_features=r).notnull().any())]


def _matched_panel(ax, ds, n, beta, causal) -> list[str]:
    """Output error against the budget B(r) at one length, β and causality, every estimator at equal state bytes
    (markers with their intervals, side by side), with the uniform average of the values (dotted); returns the
    estimators that fit no budget, as ``"name: r, r"`` (the caption names them)."""
    names = [m for m in MATCHED if m in ds.estimator.values]
    out = ds["output_rel_rms_summary"].sel(seq_len=n, beta=beta, causal=causal)
    budget = ds["budget_bytes"].sel(seq_len=n, beta=beta, causal=causal).max(["estimator", "seed"]).values
    missing = []
    for i, name in enumerate(names):
        errorbar_summary(ax, out.sel(estimator=name), budget * 2 ** (0.05 * (i - (len(names) - 1) / 2)),
                         **{**estimator_style(name), "linewidth": 1.0})          # side by side at each budget
        gaps = _not_applicable(ds, name, seq_len=n, beta=beta, causal=causal)
        if gaps:
            where = "every r" if len(gaps) == ds.sizes["num_features"] else "r = " + ", ".join(map(str, gaps))
            missing.append(f"{name} ({where})")
    uni = ds[f"uniform_rel_rms{'_causal' if causal else ''}_summary"].sel(seq_len=n, beta=beta)
    ax.axhline(float(uni.sel(stat="estimate")), color="0.35", linestyle=":", linewidth=1.2, label=f"{UNIFORM}")
    log_axis(ax, unit="bytes", label="state budget B(r) (float32)")
    ax.set_yscale("log")
    floor_ylim(ax, 1e-3)                        # exact reproductions (EVA with one key per group) sit on the axis
    ax.set_ylabel("‖Ŷ−Y‖_F / ‖Y‖_F")
    ax.set_title(f"equal state bytes, n = {n}\nβ = {beta:g}, {'causal' if causal else 'non-causal'}", fontsize=9)
    return missing


def _not_applicable_note(missing: dict[str, list[str]]) -> str:
    """The caption's sentence naming the estimators that fit no budget, per equal-bytes panel (merged when every
    panel has the same list)."""
    lists = {", ".join(names) for names in missing.values()}
    if not any(lists):
        return ""
    if len(lists) == 1:
        return f" Not applicable in every equal-bytes panel: {lists.pop()}."
    return " Not applicable: " + "; ".join(f"{panel}: {', '.join(names)}" for panel, names in missing.items()
                                           if names) + "."


def plot(ds, path):
    full = ds
    betas = sorted((float(b) for b in full.beta.values), reverse=True)
    ds = ds.sel(beta=betas[0])
    names = [n for n in RANDOM_FEATURES if n in ds.estimator.values]
    n_max = int(ds.seq_len.values.max())
    n_match = _matched_length(full)
    r_mid = int(ds.num_features.values[len(ds.num_features) // 2])
    out, num, den = (ds[f"{m}_summary"] for m in ("output_rel_rms", "numerator_rel_rms", "normalizer_rel_rms"))
    # four columns: a row of random-feature panels per causality, then the equal-bytes panels (β × causality)
    matched = [(beta, bool(causal)) for causal in ds.causal.values for beta in betas]
    ncols, nrows = 4, ds.sizes["causal"] + -(-len(matched) // 4)
    fig, axes = new_figure(nrows, ncols, width=3.9 * ncols, height=3.3 * nrows + 1.2, squeeze=False)
    for row, causal in enumerate(ds.causal.values):
        kind = "causal" if causal else "non-causal"
        ax = axes[row, 0]
        estimator_lines(ax, out.sel(seq_len=n_max, causal=causal), names, slope=-0.5)
        loglog_rank_axes(ax, ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error, n = {n_max}\n{kind}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")

        ax = axes[row, 1]
        for name in [n for n in names if n in POSITIVE] or names:
            style = estimator_style(name)
            plot_summary(ax, num.sel(estimator=name, seq_len=n_max, causal=causal), "num_features",
                         **{**style, "linestyle": "-", "label": f"{name}: numerator"})
            plot_summary(ax, den.sel(estimator=name, seq_len=n_max, causal=causal), "num_features",
                         **{**style, "linestyle": ":", "marker": "x", "label": f"{name}: normaliser"})
        loglog_rank_axes(ax, ylabel="relative RMS error")
        ax.set_title(f"numerator (solid), normaliser (dotted)\nn = {n_max}, {kind}", fontsize=9)

        ax = axes[row, 2]
        estimator_lines(ax, out.sel(num_features=r_mid, causal=causal), names, "seq_len")
        loglog_rank_axes(ax, xlabel="sequence length n", ylabel="‖Ŷ−Y‖_F / ‖Y‖_F")
        ax.set_title(f"output error against n, r = {r_mid}\n{kind}", fontsize=9)

        ax = axes[row, 3]
        rate = ds["nonpositive_rate_summary"].sel(causal=causal)
        signed = [name for name in names if float(rate.sel(estimator=name, stat="hi").max()) > 0]
        for name in signed:
            for n, alpha in zip(ds.seq_len.values, np.linspace(0.35, 1.0, ds.sizes["seq_len"])):
                style = estimator_style(name)
                plot_summary(ax, rate.sel(estimator=name, seq_len=n), "num_features", band_alpha=0.1 * alpha,
                             **{**style, "alpha": alpha, "label": f"{name}, n = {n}"})
        log_axis(ax, label="number of features r")
        ax.set_ylabel("fraction of queries with Ẑ ≤ 0")
        ax.set_title(f"non-positive normalisers\n{kind}", fontsize=9)
        if signed:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no estimator produced Ẑ ≤ 0", ha="center", transform=ax.transAxes)
    missing, matched_axes = {}, []
    for j, (beta, causal) in enumerate(matched):
        ax = axes[ds.sizes["causal"] + j // ncols, j % ncols]
        matched_axes.append(ax)
        missing[f"β = {beta:g}, {'causal' if causal else 'non-causal'}"] = _matched_panel(ax, full, n_match, beta,
                                                                                          causal)
    for ax in axes.ravel()[ds.sizes["causal"] * ncols + len(matched):]:
        ax.axis("off")
    figure_legend(fig, matched_axes, title="equal state bytes (bottom row)", title_fontsize=8,
                  loc="outside right lower", fontsize=7.5)
    beta = betas[0]
    beta_eff = float(ds["beta_eff_summary"].sel(seq_len=n_max, stat="estimate"))
    fig.suptitle("Attention-output error of linear attention against exact softmax attention", fontsize=11,
                 fontweight="bold")
    save_figure(fig, path, (
        f"Isotropic Gaussian q, k in d = {int(ds['dim'])} at β = {beta:g} (measured {beta_eff:.2f}) in the top "
        f"rows, standard Gaussian values, {int(ds['heads'])} heads per draw, float64, chunked mode; exact "
        f"attention computed in query blocks. Lines: median over {ds.sizes['seed']} seeds of the per-draw median "
        "over heads; bands: 95 % bootstrap interval of that median. Top rows, random-feature maps: relative RMS "
        "output error against the number of features r (grey dashed: r^(-1/2)); numerator Σ κ v and normaliser "
        "Z = Σ κ of the positive maps, both relative to the exact normaliser; output error against sequence length n "
        "at fixed r; fraction of queries whose estimated normaliser is ≤ 0 (signed trigonometric features only), "
        f"darker = longer sequences. Bottom row, equal state bytes at n = {n_match}: every estimator at its "
        "largest configuration whose state (estimator.state_bytes, float32: for LARA its draws, key sums and "
        "proposal landmarks; for EVA its window of 32 keys and group summaries; for Nyström its landmarks and "
        "whitening; for the hybrids their window of 64 keys) fits the budget B(r) of FAVOR+/OPRF at r = "
        f"{', '.join(str(int(v)) for v in ds.num_features.values)} features, against that budget; dotted: the "
        "output error of the uniform average of the values (attention that ignores the keys). Estimators with no "
        "configuration within a budget, and LARA in causal attention (defined non-causally), are not applicable "
        "there." + _not_applicable_note(missing)))


# -------------------------------------------------------------------------------------------------- findings
def _matched_entry(ds, name, n, beta, causal, r) -> str:
    """``name`` at one cell of the equal-bytes design: its error with interval and the configuration it ran, or
    why it is not applicable."""
    at = {"estimator": name, "seq_len": n, "beta": beta, "causal": causal, "num_features": r}
    used = ds["features_used"].sel(**at)
    if not bool(used.notnull().any()):
        if name in SIZED and causal and not ka.capabilities(SIZED[name][0], **SIZED[name][1]).causal:
            return f"`{name}` n/a (non-causal only)"
        smallest = float(ds["smallest_state_bytes"].sel(**at).max())
        return f"`{name}` n/a (needs ≥ {fmt_bytes(smallest)})"
    error = fmt_ci(ds["output_rel_rms_summary"].sel(**at))
    if name not in SIZED:
        return f"`{name}` {error}"
    config = f"r' = {int(used.median())}"
    if bool(ds["group_size"].sel(**at).notnull().any()):
        config = f"{int(used.median())} groups of {int(ds['group_size'].sel(**at).median())}"
    return f"`{name}` {error} [{config}, {fmt_bytes(ds['state_bytes'].sel(**at).median())}]"


def _matched_findings(ds) -> list[str]:
    """The equal-bytes comparison at n = 2048: errors with intervals per budget, β and causality; paired ratios
    against OPRF, FAVOR+ and Nyström."""
    names = [m for m in MATCHED if m in ds.estimator.values]
    if len(names) <= 2:
        return []
    n = _matched_length(ds)
    ranks = [int(r) for r in ds.num_features.values if r >= 64] or [int(r) for r in ds.num_features.values]
    betas = sorted(float(b) for b in ds.beta.values)
    lines = []
    for causal in (False, True):
        if causal not in ds.causal.values:
            continue
        for beta in betas:
            pieces = []
            for r in ranks:
                budget = float(ds["budget_bytes"].sel(num_features=r, seq_len=n, beta=beta, causal=causal).max())
                entries = "; ".join(_matched_entry(ds, m, n, beta, causal, r) for m in names)
                pieces.append(f"r = {r} (budget {fmt_bytes(budget)}): {entries}")
            uni = ds[f"uniform_rel_rms{'_causal' if causal else ''}_summary"].sel(seq_len=n, beta=beta)
            lines.append(f"Equal state bytes, n = {n}, β = {beta:g}, {'causal' if causal else 'non-causal'}, median "
                         "output error over seeds [configuration, state kept]: " + " — ".join(pieces)
                         + f"; {UNIFORM}: {fmt_ci(uni)}.")
    def finite_cells(vs, m, judge):
        """``c β=2 r=64 0.93 (0.9–0.96) lower, …``: the finite cells of ``m`` in a paired summary at length n."""
        at = [(c, b, r) for c in ds.causal.values for b in betas for r in ranks]
        return [f"{'c' if c else 'nc'} β={b:g} r={r} {fmt_ci(s)}" + (f" {verdict(s)}" if judge else "")
                for c, b, r in at if np.isfinite(float((s := vs.sel(estimator=m, beta=b, causal=c,
                                                                      num_features=r)).sel(stat="estimate")))]

    for label, baseline, title, who in (("oprf", OPRF, f"OPRF (`{OPRF}`)", list(SIZED)),
                                        ("baseline", BASELINE, f"FAVOR+ (`{BASELINE}`)", LARA_EVA),
                                        ("nystrom", NYSTROM, f"Nyström with uniform landmarks (`{NYSTROM}`)",
                                         LARA_EVA)):
        if f"output_rel_rms_vs_{label}_summary" not in ds:
            continue
        vs = ds[f"output_rel_rms_vs_{label}_summary"].sel(seq_len=n)
        parts = [f"`{m}`: " + ", ".join(c) for m in names
                 if m in who and m != baseline and (c := finite_cells(vs, m, True))]
        if parts:
            lines.append(f"Against {title} on the same draws at equal state bytes (n = {n}; per-draw ratio of "
                         "output errors, median with its interval; lower/higher: the interval excludes 1; not "
                         "resolved: it does not; nc = non-causal, c = causal): " + "; ".join(parts) + ".")
    return lines


def _uniform_findings(ds) -> list[str]:
    """Every estimator against the uniform average of the values (attention that ignores the keys) on the same
    draws: at the equal-bytes length, per causality, β and budget, which estimators lose to it (paired ratio's
    interval above 1), which are not separated from it and which beat it; then, over every setting of the design,
    how often each estimator loses."""
    if "output_rel_rms_vs_uniform_summary" not in ds:
        return []
    vs = ds["output_rel_rms_vs_uniform_summary"]
    n = _matched_length(ds)
    settings = []
    for causal in (c for c in (False, True) if c in ds.causal.values):
        for beta in sorted(float(b) for b in ds.beta.values):
            groups = []
            for r in (int(r) for r in ds.num_features.values):
                at = vs.sel(seq_len=n, beta=beta, causal=causal, num_features=r)
                ran = finite_values(at, "estimator")
                if not ran:
                    continue
                verdicts = {m: verdict(at.sel(estimator=m), below="beat", above="lose") for m in ran}
                worse = [f"`{m}` {fmt_ci(at.sel(estimator=m))}" for m in ran if verdicts[m] == "lose"]
                tied = [f"`{m}`" for m in ran if verdicts[m] == "not resolved"]
                better = [f"`{m}`" for m in ran if verdicts[m] == "beat"]
                groups.append(f"r = {r}: lose {', '.join(worse) or 'none'}; not separated {', '.join(tied) or 'none'}"
                              f"; beat it {', '.join(better) or 'none'}")
            if groups:
                settings.append(f"{'causal' if causal else 'non-causal'} β = {beta:g} — " + " — ".join(groups))
    if not settings:
        return []
    lines = [f"Against {UNIFORM} (attention that ignores the keys; per-draw ratio of output errors on the same draws, "
             f"n = {n}, at each estimator's configuration within the budget of r; lose: the interval lies above 1; "
             "beat it: below 1): " + "; ".join(settings) + "."]
    counts, never = [], []
    for m in (str(e) for e in ds.estimator.values):
        at = vs.sel(estimator=m).stack(setting=["seq_len", "beta", "causal", "num_features"])
        cells = [at.isel(setting=i) for i in range(at.sizes["setting"])
                 if np.isfinite(float(at.isel(setting=i).sel(stat="estimate")))]
        if cells:
            lost = sum(verdict(c) == "higher" for c in cells)
            beat = sum(verdict(c) == "lower" for c in cells)
            counts.append(f"`{m}` loses in {lost}, beats it in {beat} of {len(cells)}")
            never += [m] if beat == 0 else []
    lines.append("Over every setting of the design (n, β, causality, budget r) where it ran: " + "; ".join(counts)
                 + (f"; never below {UNIFORM} with its whole interval: " + ", ".join(f"`{m}`" for m in never)
                    if never else "") + ".")
    return lines


def findings(ds: xr.Dataset) -> list[str]:
    full = ds
    ds = ds.sel(beta=ds.beta.values.max())
    beta = float(ds.beta)
    out = ds["output_rel_rms_summary"]
    everyone = [str(n) for n in ds.estimator.values]
    names = [n for n in RANDOM_FEATURES if n in everyone]
    n_max, n_min = int(ds.seq_len.max()), int(ds.seq_len.min())
    r_max, r_min = int(ds.num_features.max()), int(ds.num_features.min())
    r_mid = int(ds.num_features.values[len(ds.num_features) // 2])
    lines = []
    top = out.sel(seq_len=n_max, num_features=r_max, causal=False)
    order = sorted(finite_values(top, "estimator"), key=lambda n: float(top.sel(estimator=n, stat="estimate")))
    budget = float(ds["budget_bytes"].sel(seq_len=n_max, num_features=r_max, causal=False).max())
    head = (f"At n = {n_max}, β = {beta:g} (non-causal), at equal state bytes (the budget of FAVOR+ at r = {r_max}, "
            f"{fmt_bytes(budget)}) the smallest median output error is `{order[0]}`'s, "
            f"{fmt_ci(top.sel(estimator=order[0]))}")
    other = order[1] if order[0] == BASELINE and len(order) > 1 else order[0]
    if "output_rel_rms_vs_baseline_summary" in ds and other != BASELINE:
        vs = ds["output_rel_rms_vs_baseline_summary"].sel(seq_len=n_max, num_features=r_max, causal=False,
                                                          estimator=other)
        head += (f"; `{other}` is {ratio_phrase(vs)} than FAVOR+ (`{BASELINE}`, "
                 f"{fmt_ci(top.sel(estimator=BASELINE))}) on the same draws, below it in "
                 f"{fmt_pct(float(vs.sel(stat='below')))} of them")
    uni = ds["uniform_rel_rms_summary"].sel(seq_len=n_max)
    lines.append(head + f". There {UNIFORM} (ignoring the keys) has error {fmt_ci(uni)}.")
    lines.extend(_matched_findings(full))
    lines.extend(_uniform_findings(full))
    positive = [n for n in names if n in POSITIVE]
    if positive:
        split = stats.bootstrap_interval(
            ds["numerator_rel_rms"].sel(estimator=positive, seq_len=n_max, num_features=r_max, causal=False)
            / ds["normalizer_rel_rms"].sel(estimator=positive, seq_len=n_max, num_features=r_max, causal=False),
            "seed")
        parts = fmt_cis(split, "estimator")
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
        ds["output_rel_rms"].sel(estimator=names, causal=True, seq_len=n_max, num_features=r_max)
        / ds["output_rel_rms"].sel(estimator=names, causal=False, seq_len=n_max, num_features=r_max), "seed")
    lo_c = [n for n in names if float(causal_ratio.sel(estimator=n, stat="hi")) < 1]
    lines.append(f"Causal against non-causal output error on the same data (n = {n_max}, r = {r_max}, per-draw ratio): "
                 + fmt_cis(causal_ratio, "estimator")
                 + f" — below 1 with its whole interval for {len(lo_c)} of {len(names)} random-feature maps.")
    if positive and n_max != n_min:
        at = out.sel(num_features=r_mid, causal=False)
        pieces = [f"`{n}` {fmt_ci(at.sel(estimator=n, seq_len=n_min))} → {fmt_ci(at.sel(estimator=n, seq_len=n_max))}"
                  for n in positive]
        lines.append(f"At fixed r = {r_mid}, from n = {n_min} to n = {n_max} (non-causal; independent draws per "
                     "length): " + "; ".join(pieces) + ".")
    trig = [n for n in names if n.startswith("trig")]
    if trig:
        rate, err = (v.sel(causal=False, seq_len=n_max) for v in (ds["nonpositive_rate_summary"], out))
        pieces = [f"`{n}`: {fmt_ci(rate.sel(estimator=n, num_features=r_min), percent=True)} of normalisers ≤ 0 at "
                  f"r = {r_min} (output error {fmt_ci(err.sel(estimator=n, num_features=r_min))}), "
                  f"{fmt_ci(rate.sel(estimator=n, num_features=r_max), percent=True)} at r = {r_max}" for n in trig]
        lines.append(f"Signed trigonometric features fail where their normaliser is ≤ 0 (n = {n_max}, non-causal): "
                     + "; ".join(pieces) + ".")
    signed = [n for n in everyone if n.startswith("trig") or n.startswith("nystrom")]
    unsigned = [n for n in everyone if n not in signed]
    if unsigned:
        worst = float(full["nonpositive_rate"].sel(estimator=unsigned).max())
        lines.append(f"The largest rate of non-positive normalisers among the positive estimators (every one but "
                     f"trigonometric features and Nyström), over every cell and draw, is {fmt(worst)}.")
    return lines


EXPERIMENT = Experiment.from_module(__name__, title="Attention-output error: numerator, normaliser and output")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
