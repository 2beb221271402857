"""The figure, the findings and the proxy-validity statistics of ``trained_icl``, read from its dataset only.

Every number comes from the summaries :func:`experiments.trained_icl.summarise` stores (:mod:`kernapprox.stats`):
means over seeds × prompts with cluster-bootstrap intervals over seeds (the unit: the prompts of a seed share its
feature draw or landmark fit), the layers' errors as the median and range of the seeds, and the proxy's validity
against the post-hoc accuracy:

- rank correlations over the (estimator, r) points (:data:`CORRELATIONS`): Spearman's ρ, log₂ r's own ρ with the
  post-hoc accuracy, and the partial ρ controlling for log₂ r (:func:`kernapprox.stats.partial_spearman`), each with
  a cluster bootstrap that resamples the seeds jointly for every point, which the paired design allows (every point
  reads the same prompts and the same proxy episodes);
- the order at equal r (:func:`pair_agreement`): per estimator pair the post-hoc difference per seed, the exact
  sign test, Holm over all pairs of a (task, context), and whether the proxy prefers the post-hoc winner;
- the calibration gap, proxy − post-hoc accuracy per point (``proxy_gap_summary``).

A verdict needs at least :data:`kernapprox.stats.MIN_UNITS` seeds; with fewer the findings say "not resolved".
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import xarray as xr
from scipy import stats as scipy_stats

from experiments._icl import label_panel, rank_panel
from experiments._icl import style as icl_style
from kernapprox import stats
from kernapprox.plotting import bullets, figure_legend, finite_values, fmt, fmt_ci, new_figure, save_figure

UNIT = "seed"      # the unit of replication: the prompts of a seed share its feature draw or landmark fit


# ------------------------------------------------------------------------------------------------ helpers
def _tasks(ds, family: str) -> list[str]:
    """Task labels of ``family`` ("mqar"/"regression") present in ``ds``."""
    return [str(t) for t in ds.task.values if str(t).startswith(family)]


def _ran(da: xr.DataArray) -> bool:
    return bool(np.isfinite(np.asarray(da.values, dtype=float)).any())


def _contexts(ds, task) -> list[int]:
    sel = ds.score_exact.sel(task=task)
    return [int(c) for c in ds.context.values if _ran(sel.sel(context=c))]


def _evaluated(ds, family: str) -> list[tuple[str, int]]:
    """``(task, largest context)`` of each task of ``family`` with a reference score."""
    return [(task, _contexts(ds, task)[-1]) for task in _tasks(ds, family) if _contexts(ds, task)]


def _estimate(summary: xr.DataArray) -> float:
    return float(summary.sel(stat="estimate"))


def _proxy_cells(ds) -> list[tuple[str, int]]:
    """``(task, context)`` of every cell of the grid with proxy values."""
    return [(str(task), int(c)) for task, c in itertools.product(ds.task.values, ds.context.values)
            if _ran(ds["proxy_accuracy"].sel(task=task, context=c))]


def spearman_points(ds: xr.Dataset, task: str, context: int):
    """``(labels, proxy (P, S, E), post hoc (P, S, E))`` of the approximate (estimator, r) points with a proxy
    value (exact attention, first on both sides by construction, is left out)."""
    sel = ds.sel(task=task, substitution="all", context=context).drop_sel(estimator="exact", errors="ignore")
    x, y = (np.asarray(sel[v].transpose("estimator", "num_features", "seed", "episode").values, dtype=float)
            for v in ("proxy_accuracy", "score"))
    keep = ~(np.isnan(x).all((2, 3)) | np.isnan(y).all((2, 3)))
    labels = [(str(sel.estimator.values[i]), int(sel.num_features.values[j])) for i, j in zip(*np.nonzero(keep))]
    return labels, x[keep], y[keep]


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ; NaN when either side is constant (no ranking to compare) or not finite."""
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return np.nan
    return float(scipy_stats.spearmanr(a, b).statistic)


def _realised(ds: xr.Dataset, task: str, context: int, est: str, r: int) -> float:
    """The realised feature dimension of the (estimator, r) point with every layer substituted (the maps of fixed
    dimension at their own r: Taylor's 1 + d + d², ELU+1's d), the largest over seeds."""
    return float(ds["feature_dim"].sel(task=task, context=context, substitution="all", estimator=est,
                                       num_features=r).max())


def _log_r(ds: xr.Dataset, task: str, context: int, labels) -> np.ndarray:
    """log₂ of the realised feature dimension of each (estimator, r) point (:func:`_realised`)."""
    return np.log2([_realised(ds, task, context, est, r) for est, r in labels])


CORRELATIONS = {  # name: (long name, what is correlated, minimum points)
    "proxy_rank_correlation": ("Spearman's ρ of proxy and post-hoc accuracy", "Spearman's ρ between the mean "
                               "proxy_accuracy and the mean score", 3),
    "proxy_partial_rank_correlation": ("partial Spearman ρ of proxy and post-hoc accuracy, controlling for log₂ r",
                                       "Spearman's partial rank correlation (kernapprox.stats.partial_spearman: "
                                       "(ρ_xy − ρ_xz ρ_yz)/√((1 − ρ_xz²)(1 − ρ_yz²)) on ranks, Kendall & Stuart "
                                       "1979 §27.4) between the mean proxy_accuracy and the mean score, z = log₂ of "
                                       "the realised feature dimension: the agreement that the rank r does not "
                                       "explain", 4),
    "proxy_log_r_rank_correlation": ("Spearman's ρ of log₂ r and post-hoc accuracy", "Spearman's ρ between log₂ "
                                     "of the realised feature dimension and the mean score: how much of the "
                                     "ranking r alone gives", 3),
}


def rank_correlation(ds: xr.Dataset, task: str, context: int,
                     name: str = "proxy_rank_correlation") -> tuple[xr.DataArray, int]:
    """The rank correlation ``name`` (:data:`CORRELATIONS`) over the approximate (estimator, r) points with its cluster
    bootstrap over seeds (:func:`kernapprox.stats.bootstrap_interval` over the seeds, each resample taking the same
    seeds, with all their prompts, for every point): ``(summary with a stat dimension, number of points)``."""
    labels, x, y = spearman_points(ds, task, context)
    seeds = xr.DataArray(np.arange(ds.sizes[UNIT], dtype=float), dims=UNIT)
    if len(labels) < CORRELATIONS[name][2]:
        return stats.bootstrap_interval(seeds * np.nan, UNIT, "mean") * np.nan, len(labels)
    log_r = _log_r(ds, task, context, labels)

    def resampled(index: np.ndarray) -> np.ndarray:
        """The statistic of the points' mean accuracies over each row of seed indices ``(R, m)``, every prompt of
        a drawn seed included."""
        out = np.empty(index.shape[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)        # a point without a finite resampled mean
            for i, row in enumerate(index.astype(int)):
                a, b = (np.nanmean(v[:, row].reshape(len(labels), -1), 1) for v in (x, y))
                out[i] = (stats.partial_spearman(a, b, log_r) if name == "proxy_partial_rank_correlation" else
                          _spearman(log_r if name == "proxy_log_r_rank_correlation" else a, b))
        return out

    summary = stats.bootstrap_interval(seeds, UNIT, resampled)
    summary.attrs["interval"] = summary.attrs["interval"].replace("percentile bootstrap", "cluster bootstrap") \
        + " (each seed with all its prompts)"
    return summary, len(labels)


def rank_correlations(ds: xr.Dataset, name: str = "proxy_rank_correlation") -> xr.DataArray:
    """``name`` (:data:`CORRELATIONS`): :func:`rank_correlation` for every MQAR task and context with proxy values
    (NaN elsewhere), dims ``(task, context, stat)``; attribute ``points``: the number of (estimator, r) points of
    each, as a JSON-free ``task:context=points`` list."""
    out = xr.DataArray(np.nan, dims=("task", "context", "stat"),
                       coords={"task": ds.task.values, "context": ds.context.values, "stat": list(stats.STATS)})
    attrs, points = {}, []
    for task, context in _proxy_cells(ds):
        summary, count = rank_correlation(ds, task, context, name)
        out.loc[{"task": task, "context": context}] = summary.values
        attrs = summary.attrs
        points.append(f"{task}:{context}={count}")
    interval = attrs.get("interval", "95% cluster bootstrap over seed (each seed with all its prompts)")
    long_name, what, _ = CORRELATIONS[name]
    out.attrs = {"long_name": long_name, "units": "1",
                 "description": f"{what}, over the approximate (estimator, r) points of substitution = all; the "
                                "bootstrap resamples the seeds (the units: the prompts of a seed share its feature "
                                "draw) jointly for every point: " + interval,
                 "statistic": name.removesuffix("_correlation").removeprefix("proxy_"), "interval": interval,
                 "level": attrs.get("level", stats.LEVEL), "over": UNIT, "unit": UNIT, "points": ", ".join(points)}
    return out


def proxy_validity(ds: xr.Dataset) -> xr.Dataset:
    """The proxy's validity: the rank correlations (:data:`CORRELATIONS`), the order at equal r
    (:func:`pair_agreement`) and the calibration gap per (estimator, r) point with its cluster interval."""
    ds.update({name: rank_correlations(ds, name) for name in CORRELATIONS} | pair_agreement(ds))
    gap = stats.cluster_interval(ds["proxy_accuracy"] - ds["score"], UNIT, ("episode",))
    ds["proxy_gap_summary"] = gap.assign_attrs(
        long_name="calibration gap: proxy − post-hoc accuracy", units="1",
        description="per (estimator, r) point, the mean proxy_accuracy − the mean score (the same seeds: the proxy's "
                    "episodes and the prompts of a seed share its draw), over seed, episode: " + gap.attrs["interval"])
    return ds


# ------------------------------------------------------------------------------------ within-r agreement
def within_r_pairs(ds: xr.Dataset, task: str, context: int) -> list[tuple[int, str, str]]:
    """``(r, a, b)`` for every pair of estimators with a proxy and a post-hoc value at the same realised feature
    dimension ``r`` (the grid's r; a map of fixed dimension joins only where its own dimension is that r), in the
    dataset's estimator order."""
    labels = spearman_points(ds, task, context)[0]
    at = {}
    for (est, r), log_r in zip(labels, _log_r(ds, task, context, labels)):
        if np.isclose(2.0 ** log_r, r):
            at.setdefault(r, []).append(est)
    return [(r, a, b) for r, ests in at.items() for a, b in itertools.combinations(ests, 2)]


AGREE, DISAGREE, UNRESOLVED = 1.0, -1.0, 0.0
PAIR_TEST = "sign"          # exact with tied unit values (see pair_agreement)


def pair_agreement(ds: xr.Dataset) -> dict[str, xr.DataArray]:
    """Within-r agreement of the proxy with the trained models, dims ``(task, context, num_features, pair)``:
    ``proxy_pair_post_hoc``, per pair ``a vs b`` the post-hoc score difference a − b per prompt (the same prompts),
    mean with its cluster-bootstrap interval over seeds (:func:`kernapprox.stats.cluster_interval`);
    ``proxy_pair_proxy``, the same for the proxy's accuracy (the same episodes); ``proxy_pair_p`` and
    ``proxy_pair_p_holm``, the two-sided exact sign test's p-value of the per-seed mean post-hoc differences
    (:func:`kernapprox.stats.paired_test`; the sign test because per-seed mean accuracies tie, which sends
    Wilcoxon's test to its normal approximation, whose smallest p-value with 12 seeds, 0.002, can never pass Holm
    over 30 pairs; the sign test's, 2·2⁻¹², can), and Holm's adjustment over every within-r pair of the (task,
    context) (:func:`kernapprox.stats.holm`: the family is declared as all pairs at equal r of one context);
    ``proxy_pair_agreement``, +1 where the proxy's preferred estimator (the sign of its mean difference) is the
    post-hoc winner, −1 where it prefers the loser, 0 where the post-hoc order is not resolved
    (:func:`kernapprox.stats.verdict` on the Holm p-value: at least MIN_UNITS seeds and p < 0.05) or the proxy ties;
    NaN where the pair does not exist."""
    ests = [str(e) for e in ds.estimator.values]
    found = {cell: within_r_pairs(ds, *cell) for cell in _proxy_cells(ds)}
    pairs = sorted({(a, b) for items in found.values() for _, a, b in items},
                   key=lambda p: (ests.index(p[0]), ests.index(p[1])))
    dims = ("task", "context", "num_features", "pair")
    coords = {"task": ds.task.values, "context": ds.context.values, "num_features": ds.num_features.values,
              "pair": [f"{a} vs {b}" for a, b in pairs]}
    shape = tuple(len(v) for v in coords.values())
    post, proxy = np.full(shape + (len(stats.STATS),), np.nan), np.full(shape + (len(stats.STATS),), np.nan)
    p, holm, agreement = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    tasks, contexts, ranks = list(ds.task.values), list(ds.context.values), list(ds.num_features.values)
    interval = test = ""
    for (task, c), items in found.items():
        i, j = tasks.index(task), contexts.index(c)
        sel = ds.sel(task=task, context=c, substitution="all")
        for r, a, b in items:
            k, m = ranks.index(r), pairs.index((a, b))
            for out, var in ((post, "score"), (proxy, "proxy_accuracy")):
                diff = (sel[var].sel(estimator=a, num_features=r, drop=True)
                        - sel[var].sel(estimator=b, num_features=r, drop=True))
                summary = stats.cluster_interval(diff, UNIT, ("episode",))
                out[i, j, k, m], interval = summary.values, summary.attrs["interval"]
                if var == "score":
                    pv = stats.paired_test(diff, UNIT, ("episode",), test=PAIR_TEST)
                    p[i, j, k, m], test = float(pv), pv.attrs["description"]
        holm[i, j] = stats.holm(p[i, j])
        for k, m in zip(*np.nonzero(np.isfinite(p[i, j]))):
            est, units = post[i, j, k, m, 0], int(post[i, j, k, m, list(stats.STATS).index("count")])
            side = stats.verdict(est, holm[i, j, k, m], units)
            pref = np.sign(proxy[i, j, k, m, 0])
            agreement[i, j, k, m] = (UNRESOLVED if side == "not resolved" or pref == 0 else
                                     AGREE if pref == np.sign(est) else DISAGREE)
    family = ("Holm over all pairs at equal r of one (task, context), declared before looking; "
              f"a verdict needs {stats.MIN_UNITS} seeds")

    def array(data, long_name, description, **attrs):
        stat = {"stat": list(stats.STATS)} if data.ndim > len(dims) else {}
        return xr.DataArray(data, dims=(*dims, *stat), coords={**coords, **stat}, attrs={
            "long_name": long_name, "units": "1", "unit": UNIT, "description": description, **attrs})

    def summary(data, long_name, var):
        return array(data, long_name, f"per pair 'a vs b' at equal r, {var} of a − {var} of b per prompt (the same "
                     f"prompts and proxy episodes), mean over seed, episode: {interval}", statistic="mean",
                     interval=interval, over=UNIT, within="episode", level=stats.LEVEL)

    return {
        "proxy_pair_post_hoc": summary(post, "post-hoc accuracy difference a − b at equal r", "score"),
        "proxy_pair_proxy": summary(proxy, "proxy accuracy difference a − b at equal r", "proxy_accuracy"),
        "proxy_pair_p": array(p, "p-value of the post-hoc difference a − b",
                              test or "two-sided exact sign test, one value per seed", test=PAIR_TEST),
        "proxy_pair_p_holm": array(holm, "Holm-adjusted p-value of the post-hoc difference a − b",
                                   f"proxy_pair_p adjusted by Holm's step-down method: {family}"),
        "proxy_pair_agreement": array(agreement, "within-r agreement of the proxy's order with the post-hoc order",
                                      "+1: the proxy prefers the post-hoc winner; −1: it prefers the loser; 0: the "
                                      "post-hoc order is not resolved (Holm p ≥ 0.05 or fewer than "
                                      f"{stats.MIN_UNITS} seeds) or the proxy ties; NaN: no such pair ({family})"),
    }


def _post_hoc_range(ds, task, c) -> tuple[str, ...] | None:
    """The lowest and highest post-hoc score among the approximate estimators (every layer, context ``c``)."""
    s = ds["score_summary"].sel(task=task, context=c, substitution="all").drop_sel(estimator="exact")
    est = s.sel(stat="estimate")
    if not np.isfinite(est.values).any():
        return None
    ones = [s.isel({k: int(v) for k, v in pick.items()}) for pick in (est.argmin(...), est.argmax(...))]
    return tuple(f"{fmt_ci(one, 2)} (`{one.estimator.item()}`, r = "
                 f"{fmt(_realised(ds, task, c, one.estimator.item(), one.num_features.item()))})" for one in ones)


# ------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    """Markdown bullets; every number is computed from ``ds`` (means with 95 % cluster-bootstrap intervals over
    seeds, each seed with its prompts)."""
    lines = [_headline(ds)]
    cells = {f: [(t, c) for t in _tasks(ds, f) for c in _contexts(ds, t)] for f in ("mqar", "regression")}
    for task, c in cells["mqar"]:
        ref = ds["score_exact_summary"].sel(task=task, context=c)
        lines.append(f"{task}: the softmax reference recalls {fmt_ci(ref)} of the queries with {c} pairs (seq_len "
                     f"{int(ds['seq_len'].sel(task=task, context=c).max())}, {int(ref.sel(stat='count'))} seeds × "
                     f"{ds.sizes['episode']} prompts).")
    for task, c in cells["regression"]:
        ref, ls, ridge = (fmt_ci(ds[f"{v}_summary"].sel(task=task, context=c))
                          for v in ("score_exact", "baseline_ls", "baseline_ridge"))
        lines.append(f"{task}: with {c} examples in context the reference's normalised error is {ref}; least squares "
                     f"{ls}, ridge {ridge} on the same prompts.")
    exact = ds["score_vs_exact"].sel(estimator="exact").drop_sel(substitution="trained", errors="ignore")
    if _ran(exact):
        lines.append(f"Substituting exact attention for the reference's own (every layer or one) changes no score: max "
                     f"|difference| = {fmt(float(abs(exact).max()))} over {int(exact.notnull().sum())} prompt scores.")
    for task, c in _evaluated(ds, "mqar") + _evaluated(ds, "regression"):
        lines += _post_hoc_lines(ds, task, c)
    for task, c in _evaluated(ds, "mqar"):
        lines += _mqar_lines(ds, task, c)
    for task, c in cells["mqar"]:
        lines += _validity_lines(ds, task, c)
    return bullets([*lines, PROXY_NOT_DEFINED, _training_line(ds)])


def _headline(ds) -> str:
    if not (mqar := _evaluated(ds, "mqar")):
        return "No MQAR model in this dataset."
    task, c = mqar[0]
    ref = fmt_ci(ds["score_exact_summary"].sel(task=task, context=c))
    text = f"A trained MQAR Transformer ({task}, {c} pairs) recalls {ref} with softmax attention"
    if span := _post_hoc_range(ds, task, c):
        text += f" and, with every layer replaced post hoc, {span[0]} to {span[1]}"
    rho = ds["proxy_rank_correlation"].sel(task=task, context=c)
    if np.isfinite(_estimate(rho)):
        text += (f"; the training-free proxy's Spearman ρ with it over {len(spearman_points(ds, task, c)[0])} "
                 f"(estimator, r) points is {fmt_ci(rho, 2)}")
        partial = ds["proxy_partial_rank_correlation"].sel(task=task, context=c)
        if np.isfinite(_estimate(partial)):
            text += f", controlling for log₂ r {fmt_ci(partial, 2)}, {_partial_verdict(ds, partial).split(':')[0]}"
        if (counts := _agreement_counts(ds, task, c))["pairs"]:
            text += (f"; at equal r the proxy prefers the loser in {counts['disagree']} of {counts['resolved']} "
                     "resolved pairs")
    return text + "."


def _agreement(ds, rho) -> str:
    """The rank agreement's verdict: resolved only with at least MIN_UNITS seeds and the cluster interval above 0."""
    if (k := ds.sizes[UNIT]) < stats.MIN_UNITS:
        return (f"agreement not resolved ({k} units: the seeds, whose prompts share one feature draw; a verdict needs "
                f"{stats.MIN_UNITS})")
    return ("agreement resolved (cluster interval above 0)" if float(rho.sel(stat="lo")) > 0 else
            "agreement not resolved (the cluster interval contains 0)")


def _post_hoc_lines(ds, task, c) -> list[str]:
    lines, parts = [], []
    s = ds["score_summary"].sel(task=task, context=c, substitution="all")
    for est in [str(e) for e in s.estimator.values if str(e) != "exact"]:
        if rs := finite_values(s.sel(estimator=est), "num_features"):
            parts.append(f"`{est}` " + " → ".join(f"{fmt_ci(s.sel(estimator=est, num_features=r), 2)} at r = "
                                                   f"{fmt(_realised(ds, task, c, est, r))}"
                                                   for r in dict.fromkeys((rs[0], rs[-1]))))
    if parts:
        lines.append(f"{task}, every layer substituted post hoc ({c} in context): " + "; ".join(parts) + ".")
    errs, r = [], None
    for layer in [int(v) for v in ds.layer.values if f"layer{int(v)}" in ds.substitution.values]:
        one = ds.sel(task=task, context=c, substitution=f"layer{layer}", estimator="positive_orthogonal")
        if not _ran(one.score):
            continue
        rs = [int(v) for v in one.num_features.values if _ran(one.score.sel(num_features=v))]
        r = rs[len(rs) // 2]
        err = one["layer_error_summary"].sel(num_features=r, layer=layer)     # median and range of the seeds
        est, lo, hi = (fmt(float(err.sel(stat=k)), 2) for k in ("estimate", "lo", "hi"))
        errs.append(f"layer {layer} alone: score {fmt_ci(one['score_summary'].sel(num_features=r), 2)}, output "
                    f"error {est} [{lo}–{hi}]")
        ran = int(err.sel(stat="count"))
    if errs:
        lines.append(f"{task}, `positive_orthogonal` at r = {r} in one layer ({c} in context; output error: median "
                     f"over the {ran} seeds of the prompts' median, in brackets the range of the seeds, not a "
                     "95 % interval): " + "; ".join(errs) + ".")
    return lines


def _trains(ds) -> bool:
    """Whether the dataset has models trained from scratch (the ``trained`` substitution: full and gpu presets; the
    default leaves them to ``recall_frontier``, the study of trained fixed-state models against their memory)."""
    return "trained" in ds.substitution.values


def _mqar_lines(ds, task, c) -> list[str]:
    lines, parts = [], []
    if _trains(ds):
        sel = ds.sel(task=task, context=c, substitution="trained")
        for est, r in itertools.product(sel.estimator.values, sel.num_features.values):
            if _ran((one := sel.sel(estimator=est, num_features=r)).score):
                parts.append(f"`{est}` r = {int(r) if str(est) != 'exact' else 'KV'}: "
                             f"{fmt_ci(one['score_summary'], 2)} at {fmt(float(one.state_bytes.max()) / 1024)} KiB")
    if parts:
        lines.append(f"{task}, trained from scratch ({c} pairs; one training run per model, so the intervals cover "
                     "the evaluation prompts' seeds, not training runs): " + "; ".join(parts) + ".")
    beta = ds["reference_beta"].sel(task=task, context=c).mean("seed")
    if beta := [fmt(float(v), 2) for v in beta.values if np.isfinite(v)]:
        factor = float(ds["proxy_beta_factor"])
        lines.append(f"{task}: the reference's layers attend at effective β = s·mean‖q‖·mean‖k‖ = {', '.join(beta)} "
                     f"(layer 0, 1, …; {c} pairs, mean over seeds); the proxy reads at β = {fmt(factor)} ln {c} = "
                     f"{fmt(factor * np.log(c), 2)}.")
    return lines


PROXY_NOT_DEFINED = (
    "Not among the proxy's points: `window_linear` (the trained model's window is the last tokens before each query, "
    "the proxy's episode is a set of pairs read by queries without positions, so which pairs a window holds is not "
    "defined there), LARA (not causal: it cannot replace a decoder's attention), EVA (its proxy is sized by a state "
    "budget, not by r, so it has no point at equal r).")


def _worst_error(ds, task, c, point) -> str:
    """The substituted layers' attention-output error at the point of the largest calibration gap (median over
    seeds): what the proxy, which reads one clean episode, does not see."""
    err = ds["layer_error_summary"].sel(task=task, context=c, substitution="all", estimator=point[0],
                                        num_features=point[1], stat="estimate").values
    if not (err := [fmt(float(e), 2) for e in err if np.isfinite(e) and e > 0]):
        return ""
    return (f" At that point the trained model's substituted attention-output error is {', '.join(err)} (layer 0, "
            "1, …; relative RMS against exact attention on its own activations, median over seeds).")


def _span(values) -> str:
    """``a`` or ``a to b``: the smallest and largest of ``values`` (two significant digits)."""
    lo, hi = fmt(float(np.nanmin(values)), 2), fmt(float(np.nanmax(values)), 2)
    return lo if lo == hi else f"{lo} to {hi}"


def _partial_verdict(ds, summary) -> str:
    """Whether the partial ρ is resolved: at least MIN_UNITS seeds and the cluster interval off 0."""
    if (k := ds.sizes[UNIT]) < stats.MIN_UNITS:
        return f"not resolved: {k} units, a verdict needs {stats.MIN_UNITS}"
    if float(summary.sel(stat="lo")) > 0:
        return "resolved above 0: the proxy adds ranking information beyond r"
    if float(summary.sel(stat="hi")) < 0:
        return "resolved below 0: beyond r, the proxy ranks the points against the trained models"
    return "not resolved: the interval contains 0, no ranking information beyond r is shown"


def _agreement_counts(ds, task, c) -> dict:
    """Counts of ``proxy_pair_agreement`` at ``(task, c)``: pairs, resolved post-hoc orders, agree, disagree, and
    proxy ties among the resolved."""
    a = ds["proxy_pair_agreement"].sel(task=task, context=c).values
    proxy = ds["proxy_pair_proxy"].sel(task=task, context=c, stat="estimate").values
    pairs = np.isfinite(a)
    agree, disagree = int((a == AGREE).sum()), int((a == DISAGREE).sum())
    resolved = (ds["proxy_pair_p_holm"].sel(task=task, context=c).values < 0.05) & (ds.sizes[UNIT] >= stats.MIN_UNITS)
    ties = int((pairs & (a == UNRESOLVED) & (proxy == 0) & resolved).sum())
    return {"pairs": int(pairs.sum()), "agree": agree, "disagree": disagree, "ties": ties,
            "resolved": agree + disagree + ties}


def _validity_lines(ds, task, c) -> list[str]:
    """Proxy validity at ``(task, c)``: the rank correlations with the partial one, the within-r pairs where the
    proxy prefers the post-hoc loser, and the calibration gap."""
    rho, labels = ds["proxy_rank_correlation"].sel(task=task, context=c), spearman_points(ds, task, c)[0]
    if not np.isfinite(_estimate(rho)):
        return [f"{task}: the rank correlation of proxy and post-hoc accuracy is undefined over the {len(labels)} "
                f"points ({c} pairs): too few points, or one side does not vary."] if labels else []
    k = ds.sizes[UNIT]
    names = ", ".join(f"`{e}`" for e in dict.fromkeys(est for est, _ in labels))
    partial, log_r = (ds[f"proxy_{v}_rank_correlation"].sel(task=task, context=c) for v in ("partial", "log_r"))
    lines = [f"{task}, proxy validity with {c} pairs over {len(labels)} (estimator, r) points ({names}; "
             f"cluster bootstrap over {k} seeds): Spearman ρ of proxy and post-hoc accuracy {fmt_ci(rho, 2)}, "
             f"{_agreement(ds, rho)}; log₂ r alone gives ρ = {fmt_ci(log_r, 2)} with the post-hoc accuracy; the "
             f"partial ρ controlling for log₂ r is {fmt_ci(partial, 2)}, {_partial_verdict(ds, partial)}."]
    if (counts := _agreement_counts(ds, task, c))["pairs"]:
        agreement, wrong = ds["proxy_pair_agreement"].sel(task=task, context=c), []
        for pair in agreement.pair.values:
            if rs := [int(r) for r in agreement.num_features.values[agreement.sel(pair=pair).values == DISAGREE]]:
                one = {"task": task, "context": c, "pair": pair, "num_features": rs}
                proxy, post = (ds[f"proxy_pair_{v}"].sel(**one, stat="estimate").values for v in ("proxy", "post_hoc"))
                a, b = str(pair).split(" vs ")
                wrong.append(f"`{a}` − `{b}` at r = {', '.join(map(str, rs))}: proxy {_span(proxy)}, post hoc "
                             f"{_span(post)}, Holm p ≤ {fmt(float(np.max(ds['proxy_pair_p_holm'].sel(**one))), 2)}")
        text = (f"{task}, {c} pairs, at equal r ({counts['pairs']} estimator pairs; per pair the sign test on the "
                f"{k} per-seed mean post-hoc differences, Holm over the {counts['pairs']}): the post-hoc order is "
                f"resolved for {counts['resolved']}; the proxy prefers the winner in {counts['agree']}, the loser in "
                f"{counts['disagree']}, ties in {counts['ties']}; {counts['pairs'] - counts['resolved']} not resolved")
        lines.append(text + (". Where the proxy orders wrongly (accuracy differences a − b): " + " | ".join(wrong)
                             + "." if wrong else "."))
    at = {"task": task, "context": c, "substitution": "all"}
    gap = ds["proxy_gap_summary"].sel(**at)
    if est := [(e, r, g) for e, r in labels if np.isfinite(g := _estimate(gap.sel(estimator=e, num_features=r)))]:
        proxy, post = (ds[f"{v}_summary"].sel(**at, stat="estimate") for v in ("proxy_accuracy", "score"))
        ratios = [float(proxy.sel(estimator=e, num_features=r) / post.sel(estimator=e, num_features=r))
                  for e, r, _ in est]
        lo, hi = min(est, key=lambda t: t[2]), max(est, key=lambda t: t[2])
        above = sum(1 for e, r, _ in est if float(gap.sel(estimator=e, num_features=r, stat="lo")) > 0)
        lines.append(
            f"{task}, {c} pairs, calibration: the proxy's accuracy minus the post-hoc accuracy (mean over seeds × "
            f"prompts, cluster interval over seeds) runs from {fmt_ci(gap.sel(estimator=lo[0], num_features=lo[1]), 2)}"
            f" (`{lo[0]}`, r = {fmt(_realised(ds, task, c, *lo[:2]))}) to "
            f"{fmt_ci(gap.sel(estimator=hi[0], num_features=hi[1]), 2)} (`{hi[0]}`, r = "
            f"{fmt(_realised(ds, task, c, *hi[:2]))}); its interval lies above 0 at {above} of {len(est)} points; the "
            f"proxy's accuracy is {fmt(float(np.median(ratios)), 2)} times the post-hoc one at the median point (from "
            f"{fmt(min(ratios), 2)} to {fmt(max(ratios), 2)}×): the proxy's absolute accuracy does not predict a "
            f"trained model's.{_worst_error(ds, task, c, hi[:2])}")
    return lines


def _training_line(ds) -> str:
    seconds = {}
    for task in map(str, ds.task.values):
        items = [("reference", ds.sel(task=task), "reference_train_")]
        if _trains(ds):
            sel = ds.sel(task=task, substitution="trained")
            items += [(f"{est} r={int(r)}", sel.sel(estimator=est, num_features=r), "train_")
                      for est, r in itertools.product(sel.estimator.values, sel.num_features.values)]
        for name, one, prefix in items:
            if np.isfinite(wall := float(one[f"{prefix}seconds"].max())):
                seconds[(task, name)] = (float(one[f"{prefix}cpu_seconds"].max()), wall)
    if not seconds:
        return ""
    cpu, wall = (sum(v[i] for v in seconds.values()) for i in (0, 1))
    return (f"Training: {len(seconds)} models, {fmt(cpu)} CPU seconds in total on one thread ({fmt(wall)} s wall on "
            "the machine as it was shared): " + ", ".join(f"{t} {m} {fmt(c, 2)} s" for (t, m), (c, _) in
                                                          sorted(seconds.items())) + ".")


# ------------------------------------------------------------------------------------------------------ plot
R_PER_HEAD = "feature dimension r per head"


def plot(ds: xr.Dataset, path) -> None:
    fig, axes = new_figure(2, 3, squeeze=False, width=13.5, height=7.6)
    mq, rg, notes = _evaluated(ds, "mqar")[:1], _evaluated(ds, "regression")[:1], []
    labels = [str(est) for est in ds.estimator.values if str(est) != "exact"]      # the approximate estimators
    if mq:
        task, c = mq[0]
        ax = axes[0, 0]
        rank_panel(ax, ds, "score", labels, task=task, substitution="all", context=c)
        ax.axhline(_estimate(ds["score_exact_summary"].sel(task=task, context=c)), color="k", linestyle="--",
                   linewidth=1.0, label="softmax reference")
        label_panel(ax, R_PER_HEAD, "MQAR accuracy", f"(a) post hoc, every layer ({c} pairs)", accuracy=True)
        ax = axes[0, 1]
        err = ds["layer_error_summary"].sel(task=task, substitution="all", context=c, stat="estimate")
        for est in labels:
            x = ds["feature_dim"].sel(task=task, substitution="all", context=c, estimator=est).max("seed").values
            st = icl_style(est)
            for layer, ls in zip(err.layer.values, ("-", "--", ":")):
                e = err.sel(estimator=est, layer=layer).values
                if (keep := np.isfinite(e) & np.isfinite(x)).any():
                    ax.plot(x[keep], e[keep], color=st["color"], marker=st["marker"], linestyle=ls,
                            label=est if layer == 0 else None)
        ax.set_yscale("log")
        label_panel(ax, R_PER_HEAD, "attention-output rel. RMS error",
                    "(b) per-layer error, own activations (— layer 0, - - layer 1)", log2_x=True)
        if _trains(ds):
            _frontier(axes[1, 0], ds, task, c)
        else:
            axes[1, 0].axis("off")
            axes[1, 0].text(0.5, 0.5, "(d) trained from scratch:\nnot in this preset\n(recall_frontier: trained "
                            "fixed-state\nmodels against their memory)", ha="center", va="center", fontsize=8,
                            transform=axes[1, 0].transAxes)
        _proxy_panel(axes[1, 1], ds, task, c)
        _context_panel(axes[1, 2], ds, task)
        notes.insert(0, f"MQAR panels: task {task}, {c} pairs in context")
    if rg:
        task, c = rg[0]
        ax = axes[0, 2]
        rank_panel(ax, ds, "score", labels, task=task, substitution="all", context=c)
        ax.set_yscale("log")
        notes.append(f"regression panel: task {task}, {c} pairs in context")
        for var, label, ls in (("score_exact", "softmax reference", "--"), ("baseline_ridge", "ridge", ":"),
                               ("baseline_ls", "least squares", "-.")):
            m = _estimate(ds[f"{var}_summary"].sel(task=task, context=c))
            if m > 1e-6:                                     # noiseless least squares is exact beyond d points
                ax.axhline(m, color="k", linestyle=ls, linewidth=1.0, label=label)
            else:
                notes.append(f"{label}: {m:.0e}, below the axis")
        label_panel(ax, R_PER_HEAD, "squared error / d (mean over queries)", f"(c) regression post hoc ({c} examples)")
    figure_legend(fig, axes.flat)
    save_figure(fig, path, (
        "Trained causal Transformers with approximate attention. (a, c) Post-hoc substitution of every layer's softmax "
        "attention by an estimator at rank r, nothing retrained: task score (mean over evaluation prompts, band: 95 % "
        "cluster-bootstrap interval over seeds, each with its prompts); (b) each layer's attention-output error "
        "against exact attention on the model's own activations (median over seeds). (d) Models trained from scratch "
        "with the estimator at feature dimension r (plus a short convolution; full and gpu presets, the default leaves "
        "them to recall_frontier): accuracy against the bytes a decoder keeps (star: the softmax reference's KV cache; "
        "markers drawn later are smaller, so coinciding points stay visible). (e) Proxy validity: the training-free "
        "read-out accuracy (icl_recall: d = 64, β = 2 ln n; dashed, open markers) and the trained model's post-hoc "
        "accuracy (solid, filled) of each estimator against r on one axis, so the vertical distance is the calibration "
        "gap and the order at one r the within-r ranking; title: Spearman's ρ over the approximate points, the partial "
        "ρ controlling for log₂ r (cluster bootstrap over seeds), and the pairs at equal r whose resolved post-hoc "
        "order the proxy gets right or wrong (sign test over seeds, Holm). (f) Post-hoc accuracy against the prompt "
        "length at r = 64 (fixed-dimension maps at their own r). " + "; ".join(notes) + "."),
        title="In-context learning in trained Transformers")


def _frontier(ax, ds, task, c):
    sel = ds.sel(task=task, context=c, substitution="trained")
    for order, est in enumerate(sel.estimator.values):
        s = sel["score_summary"].sel(estimator=est, stat="estimate").values
        x = sel.state_bytes.sel(estimator=est).max("seed").values
        if not (keep := np.isfinite(s) & np.isfinite(x)).any():
            continue
        st = icl_style(str(est))
        if str(est) == "exact":
            ax.plot(x[keep], s[keep], marker="*", markersize=12, linestyle="none", color=st["color"],
                    label="softmax reference (KV cache)")
        else:       # a family trained at one r only: a larger marker
            # later estimators smaller and on top: points that coincide (e.g. two saturated maps) stay visible
            ax.plot(x[keep], s[keep], **{**st, "label": f"{est} (trained)", "zorder": 2 + order,
                                         "markersize": max(3.0, (9.0 if keep.sum() == 1 else 7.0) - 1.2 * order)})
    label_panel(ax, "state size (bytes, float32)", "MQAR accuracy", f"(d) trained from scratch ({c} pairs)",
                accuracy=True, log2_x=True)


def _proxy_panel(ax, ds, task, c):
    """Proxy (dashed, open markers) and post-hoc accuracy (solid, filled) of each estimator against its realised
    r, on one accuracy axis: the calibration gap is the vertical distance, the within-r order the vertical order
    at one r; the rank correlations and the within-r counts in the title."""
    sel = ds.sel(task=task, context=c, substitution="all")
    labels = spearman_points(ds, task, c)[0]
    for est in dict.fromkeys(e for e, _ in labels):
        rs = [r for e, r in labels if e == est]
        x = _log_r(ds, task, c, [(est, r) for r in rs])
        st = icl_style(est)
        for var, ls, fill in (("proxy_accuracy", "--", "none"), ("score", "-", st["color"])):
            y = [_estimate(sel[f"{var}_summary"].sel(estimator=est, num_features=r)) for r in rs]
            ax.plot(2.0 ** x, y, marker=st["marker"], color=st["color"], linestyle=ls, markerfacecolor=fill,
                    markersize=5)
    ax.plot([], [], color="0.3", linestyle="--", marker="o", markerfacecolor="none", label="proxy (training-free)")
    ax.plot([], [], color="0.3", linestyle="-", marker="o", label="post hoc (trained model)")
    rho, partial = (ds[f"proxy_{v}rank_correlation"].sel(task=task, context=c) for v in ("", "partial_"))
    counts = _agreement_counts(ds, task, c)
    label_panel(ax, R_PER_HEAD, "MQAR accuracy",
                f"(e) proxy (dashed) vs post hoc (solid), {c} pairs\nρ = {fmt_ci(rho, 2)}, partial ρ | log₂ r = "
                f"{fmt_ci(partial, 2)}\nequal r: {counts['agree']} agree, {counts['disagree']} disagree, "
                f"{counts['pairs'] - counts['agree'] - counts['disagree']} unresolved or tied "
                f"({ds.sizes[UNIT]} seeds)", accuracy=True, log2_x=True)
    ax.title.set_fontsize(8)


def _context_panel(ax, ds, task):
    sel = ds.sel(task=task, substitution="all")
    r = 64 if 64 in sel.num_features.values else int(sel.num_features.values[-1])
    x = ds["seq_len"].sel(task=task).max("seed").values
    for est in sel.estimator.values:
        slot = sel.sel(estimator=est)
        ranks = [r] + [int(v) for v in slot.num_features.values if v != r]
        if (rank := next((rr for rr in ranks if _ran(slot.score.sel(num_features=rr))), None)) is None:
            continue
        s = slot["score_summary"].sel(num_features=rank, stat="estimate").values
        if (keep := np.isfinite(s) & np.isfinite(x)).any():
            ax.plot(x[keep], s[keep], **icl_style(str(est)))
    label_panel(ax, "prompt length (tokens)", "MQAR accuracy", f"(f) post hoc against length, r = {r}",
                accuracy=True, log2_x=True)
