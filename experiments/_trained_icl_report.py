"""The figure, the findings and the rank correlation of ``trained_icl``, read from its dataset only.

Every number comes from the summaries :func:`experiments.trained_icl.summarise` stores (:mod:`kernapprox.stats`):
means over seeds × prompts with cluster-bootstrap intervals over seeds (the unit: the prompts of a seed share its
feature draw or landmark fit), the layers' errors as the median and range of the seeds, and Spearman's ρ of the
proxy against the post-hoc accuracy, whose cluster bootstrap resamples the seeds jointly for every (estimator, r)
point, which the paired design allows (every point reads the same prompts and the same proxy episodes). A verdict
needs at least :data:`kernapprox.stats.MIN_UNITS` seeds; with fewer the findings say "not resolved (k units)".
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
from kernapprox.plotting import bullets, fmt, fmt_ci, legend_entries, new_figure, save_figure

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


def spearman_points(ds: xr.Dataset, task: str, context: int):
    """``(labels, proxy (P, S, E), post hoc (P, S, E))`` of the approximate (estimator, r) points with a proxy
    value (exact attention, first on both sides by construction, is left out)."""
    sel = ds.sel(task=task, substitution="all", context=context)
    labels, xs, ys = [], [], []
    for est in sel.estimator.values:
        if str(est) == "exact":
            continue
        for r in sel.num_features.values:
            x = sel.proxy_accuracy.sel(estimator=est, num_features=r).transpose("seed", "episode").values
            y = sel.score.sel(estimator=est, num_features=r).transpose("seed", "episode").values
            if np.isnan(x).all() or np.isnan(y).all():
                continue
            labels.append((str(est), int(r)))
            xs.append(x)
            ys.append(y)
    return labels, np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ; NaN when either side is constant (no ranking to compare) or not finite."""
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return np.nan
    return float(scipy_stats.spearmanr(a, b).statistic)


def rank_correlation(ds: xr.Dataset, task: str, context: int) -> tuple[xr.DataArray, int]:
    """Spearman's ρ between the proxy's and the post-hoc mean accuracy over the (estimator, r) points, with its
    cluster-bootstrap interval over seeds (:func:`kernapprox.stats.bootstrap_interval` over the seeds, each resample
    taking the same seeds, with all their prompts, for every point: the prompts of a seed share its feature draw):
    ``(summary with a stat dimension, number of points)``."""
    labels, x, y = spearman_points(ds, task, context)
    seeds = xr.DataArray(np.arange(ds.sizes[UNIT], dtype=float), dims=UNIT)
    if len(labels) < 3:
        return stats.bootstrap_interval(seeds * np.nan, UNIT, "mean") * np.nan, len(labels)

    def spearman_rho(index: np.ndarray) -> np.ndarray:
        """ρ of the points' mean accuracies over each row of seed indices ``(R, m)``, every prompt of a drawn
        seed included."""
        out = np.empty(index.shape[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)        # a point without a finite resampled mean
            for i, row in enumerate(index.astype(int)):
                out[i] = _spearman(np.nanmean(x[:, row].reshape(len(labels), -1), 1),
                                   np.nanmean(y[:, row].reshape(len(labels), -1), 1))
        return out

    summary = stats.bootstrap_interval(seeds, UNIT, spearman_rho)
    summary.attrs["interval"] = summary.attrs["interval"].replace("percentile bootstrap", "cluster bootstrap") \
        + " (each seed with all its prompts)"
    return summary, len(labels)


def rank_correlations(ds: xr.Dataset) -> xr.DataArray:
    """``proxy_rank_correlation``: :func:`rank_correlation` for every MQAR task and context with proxy values
    (NaN elsewhere), dims ``(task, context, stat)``; attribute ``points``: the number of (estimator, r) points of
    each, as a JSON-free ``task:context=points`` list."""
    data = np.full((ds.sizes["task"], ds.sizes["context"], len(stats.STATS)), np.nan)
    attrs, points = {}, []
    for i, task in enumerate(ds.task.values):
        for j, context in enumerate(ds.context.values):
            if not _ran(ds["proxy_accuracy"].sel(task=task, context=context)):
                continue
            summary, count = rank_correlation(ds, str(task), int(context))
            data[i, j] = summary.values
            attrs = summary.attrs
            points.append(f"{task}:{int(context)}={count}")
    out = xr.DataArray(data, dims=("task", "context", "stat"),
                       coords={"task": ds.task.values, "context": ds.context.values, "stat": list(stats.STATS)})
    interval = attrs.get("interval", "95% cluster bootstrap over seed (each seed with all its prompts)")
    out.attrs = {"long_name": "Spearman's ρ of proxy and post-hoc accuracy", "units": "1",
                 "description": "rank correlation over the approximate (estimator, r) points of substitution = all "
                                "between the mean proxy_accuracy and the mean score; the bootstrap resamples the "
                                "seeds (the units: the prompts of a seed share its feature draw) jointly for every "
                                "point: " + interval,
                 "statistic": "spearman_rho", "interval": interval, "level": attrs.get("level", stats.LEVEL),
                 "over": UNIT, "unit": UNIT, "points": ", ".join(points)}
    return out


def _points(ds, task, context) -> int:
    for item in ds["proxy_rank_correlation"].attrs.get("points", "").split(", "):
        if item.startswith(f"{task}:{context}="):
            return int(item.split("=")[1])
    return 0


def _post_hoc_range(ds, task, c) -> tuple[str, str] | None:
    """The lowest and highest post-hoc score among the approximate estimators (every layer, context ``c``)."""
    s = ds["score_summary"].sel(task=task, context=c, substitution="all").drop_sel(estimator="exact")
    est = s.sel(stat="estimate")
    if not np.isfinite(est.values).any():
        return None
    out = []
    for pick in (est.argmin(...), est.argmax(...)):
        one = s.isel({k: int(v) for k, v in pick.items()})
        dim = float(ds["feature_dim"].sel(task=task, context=c, substitution="all", estimator=one.estimator,
                                          num_features=one.num_features).max())
        out.append(f"{fmt_ci(one, 2)} (`{str(one.estimator.values)}`, r = {fmt(dim)})")
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    """Markdown bullets; every number is computed from ``ds`` (means with 95 % cluster-bootstrap intervals over
    seeds, each seed with its prompts)."""
    lines = [_headline(ds)]
    for task in _tasks(ds, "mqar"):
        for c in _contexts(ds, task):
            sel = {"task": task, "context": c}
            lines.append(f"{task}: the softmax reference recalls {fmt_ci(ds['score_exact_summary'].sel(**sel))} of "
                         f"the queries with {c} pairs (seq_len {int(ds['seq_len'].sel(**sel).max())}, "
                         f"{int(ds['score_exact_summary'].sel(**sel, stat='count'))} seeds × "
                         f"{ds.sizes['episode']} prompts).")
    for task in _tasks(ds, "regression"):
        for c in _contexts(ds, task):
            sel = {"task": task, "context": c}
            ref, ls, ridge = (fmt_ci(ds[f"{v}_summary"].sel(**sel)) for v in ("score_exact", "baseline_ls",
                                                                               "baseline_ridge"))
            lines.append(f"{task}: with {c} examples in context the reference's normalised error is {ref}; least "
                         f"squares {ls}, ridge {ridge} on the same prompts.")
    exact = ds["score_vs_exact"].sel(estimator="exact").drop_sel(substitution="trained", errors="ignore")
    if _ran(exact):
        lines.append(f"Substituting exact attention for the reference's own (every layer or one) changes no score: "
                     f"max |difference| = {fmt(float(abs(exact).max()))} over {int(exact.notnull().sum())} "
                     "prompt scores.")
    for task, c in _evaluated(ds, "mqar") + _evaluated(ds, "regression"):
        lines += _post_hoc_lines(ds, task, c)
    for task, c in _evaluated(ds, "mqar"):
        lines += _mqar_lines(ds, task, c)
    lines.append(_training_line(ds))
    return bullets(lines)


def _headline(ds) -> str:
    if not (mqar := _evaluated(ds, "mqar")):
        return "No MQAR model in this dataset."
    task, c = mqar[0]
    ref = fmt_ci(ds["score_exact_summary"].sel(task=task, context=c))
    text = f"A trained MQAR Transformer ({task}, {c} pairs) recalls {ref} with softmax attention"
    span = _post_hoc_range(ds, task, c)
    if span:
        text += f"; with every layer's attention replaced post hoc it recalls from {span[0]} to {span[1]}"
    rho = ds["proxy_rank_correlation"].sel(task=task, context=c)
    if np.isfinite(_estimate(rho)):
        text += (f"; over the {_points(ds, task, c)} (estimator, r) points the training-free read-out's (icl_recall's) "
                 f"Spearman ρ with the post-hoc accuracy is {fmt_ci(rho, 2)}: {_agreement(ds, rho)}")
    return text + "."


def _units(ds) -> int:
    return int(ds.sizes[UNIT])


def _agreement(ds, rho) -> str:
    """The rank agreement's verdict: resolved only with at least MIN_UNITS seeds and the cluster interval above 0."""
    k = _units(ds)
    if k < stats.MIN_UNITS:
        return (f"agreement not resolved ({k} units: the seeds, whose prompts share one feature draw; a verdict needs "
                f"{stats.MIN_UNITS})")
    return ("agreement resolved (cluster interval above 0)" if float(rho.sel(stat="lo")) > 0 else
            "agreement not resolved (the cluster interval contains 0)")


def _range(summary, digits: int = 2) -> str:
    """``0.75 [0.72–0.9]``: a median over seeds with the range of the seeds (:func:`kernapprox.stats.range_summary`),
    in brackets."""
    lo, hi = (fmt(float(summary.sel(stat=k)), digits) for k in ("lo", "hi"))
    return f"{fmt(_estimate(summary), digits)} [{lo}–{hi}]"


def _post_hoc_lines(ds, task, c) -> list[str]:
    lines = []
    sel = {"task": task, "context": c}
    s = ds["score_summary"].sel(**sel, substitution="all")
    parts = []
    for est in s.estimator.values:
        if str(est) == "exact":
            continue
        rs = [int(r) for r in s.num_features.values if np.isfinite(_estimate(s.sel(estimator=est, num_features=r)))]
        if not rs:
            continue
        ends = [f"{fmt_ci(s.sel(estimator=est, num_features=r), 2)} at r = "
                f"{fmt(float(ds['feature_dim'].sel(**sel, substitution='all', estimator=est, num_features=r).max()))}"
                for r in dict.fromkeys((rs[0], rs[-1]))]
        parts.append(f"`{est}` {' → '.join(ends)}")
    if parts:
        lines.append(f"{task}, every layer substituted post hoc ({c} in context): " + "; ".join(parts) + ".")
    errs, r = [], None
    for layer in ds.layer.values:
        name = f"layer{int(layer)}"
        if name not in ds.substitution.values:
            continue
        one = ds.sel(**sel, substitution=name, estimator="positive_orthogonal")
        if not _ran(one.score):
            continue
        rs = [int(v) for v in one.num_features.values if _ran(one.score.sel(num_features=v))]
        r = rs[len(rs) // 2]
        score = fmt_ci(one["score_summary"].sel(num_features=r), 2)
        err = _range(one["layer_error_summary"].sel(num_features=r, layer=layer))
        errs.append(f"layer {int(layer)} alone: score {score}, output error {err}")
    if errs:
        lines.append(f"{task}, `positive_orthogonal` at r = {r} in one layer ({c} in context; output error: median "
                     f"over the {_units(ds)} seeds of the prompts' median, in brackets the range of the seeds, not a "
                     "95 % interval): " + "; ".join(errs) + ".")
    return lines


def _mqar_lines(ds, task, c) -> list[str]:
    lines = []
    sel = ds.sel(task=task, context=c, substitution="trained")
    parts = []
    for est in sel.estimator.values:
        for r in sel.num_features.values:
            one = sel.sel(estimator=est, num_features=r)
            if not _ran(one.score):
                continue
            parts.append(f"`{est}` r = {int(r) if str(est) != 'exact' else 'KV'}: {fmt_ci(one['score_summary'], 2)} "
                         f"at {fmt(float(one.state_bytes.max()) / 1024)} KiB")
    if parts:
        lines.append(f"{task}, trained from scratch ({c} pairs; one training run per model, so the intervals cover "
                     "the evaluation prompts' seeds, not training runs): " + "; ".join(parts) + ".")
    beta = ds["reference_beta"].sel(task=task, context=c).mean("seed")
    beta = [fmt(float(v), 2) for v in beta.values if np.isfinite(v)]
    if beta:
        factor = float(ds["proxy_beta_factor"])
        lines.append(f"{task}: the reference's layers attend at effective β = s·mean‖q‖·mean‖k‖ = {', '.join(beta)} "
                     f"(layer 0, 1, …; {c} pairs, mean over seeds); the proxy reads at β = {fmt(factor)} ln {c} = "
                     f"{fmt(factor * np.log(c), 2)}.")
    rho = ds["proxy_rank_correlation"].sel(task=task)
    parts = [f"{int(cc)} pairs: ρ = {fmt_ci(rho.sel(context=cc), 2)} over {_points(ds, task, int(cc))} points, "
             f"{_agreement(ds, rho.sel(context=cc))}"
             for cc in rho.context.values if np.isfinite(_estimate(rho.sel(context=cc)))]
    if parts:
        lines.append(f"{task}: Spearman's ρ of the training-free proxy's and the post-hoc accuracy over the "
                     f"(estimator, r) points, cluster bootstrap over the {_units(ds)} seeds (each with its prompts, "
                     "the same seeds for every point): " + "; ".join(parts) + ".")
    elif _points(ds, task, c):
        lines.append(f"{task}: the rank correlation of proxy and post-hoc accuracy is undefined over the "
                     f"{_points(ds, task, c)} points ({c} pairs): one side does not vary.")
    return lines


def _training_line(ds) -> str:
    seconds = {}
    for task in ds.task.values:
        ref = ds.sel(task=task)
        wall, cpu = float(ref["reference_train_seconds"].max()), float(ref["reference_train_cpu_seconds"].max())
        if np.isfinite(wall):
            seconds[(str(task), "reference")] = (cpu, wall)
        if "trained" not in ds.substitution.values:
            continue
        sel = ref.sel(substitution="trained")
        for est, r in itertools.product(sel.estimator.values, sel.num_features.values):
            one = sel.sel(estimator=est, num_features=r)
            wall, cpu = float(one.train_seconds.max()), float(one.train_cpu_seconds.max())
            if np.isfinite(wall):
                seconds[(str(task), f"{est} r={int(r)}")] = (cpu, wall)
    if not seconds:
        return ""
    cpu, wall = (sum(v[i] for v in seconds.values()) for i in (0, 1))
    return (f"Training: {len(seconds)} models, {fmt(cpu)} CPU seconds in total on one thread ({fmt(wall)} s wall on "
            "the machine as it was shared): " + ", ".join(f"{t} {m} {fmt(c, 2)} s" for (t, m), (c, _) in
                                                          sorted(seconds.items())) + ".")


# ------------------------------------------------------------------------------------------------------ plot
R_PER_HEAD = "feature dimension r per head"


def _curve(ax, ds, task, sub, var, context):
    """``<var>_summary`` of the approximate estimators against the feature dimension (:func:`~experiments._icl.
    rank_panel`)."""
    labels = [str(est) for est in ds.estimator.values if str(est) != "exact"]
    rank_panel(ax, ds, var, labels, task=task, substitution=sub, context=context)


def plot(ds: xr.Dataset, path) -> None:
    fig, axes = new_figure(2, 3, squeeze=False, width=13.5, height=7.6)
    mq, rg, notes = _evaluated(ds, "mqar")[:1], _evaluated(ds, "regression")[:1], []
    if mq:
        task, c = mq[0]
        ax = axes[0, 0]
        _curve(ax, ds, task, "all", "score", c)
        ax.axhline(_estimate(ds["score_exact_summary"].sel(task=task, context=c)), color="k", linestyle="--",
                   linewidth=1.0, label="softmax reference")
        label_panel(ax, R_PER_HEAD, "MQAR accuracy", f"(a) post hoc, every layer ({c} pairs)", accuracy=True)
        ax = axes[0, 1]
        err = ds["layer_error_summary"].sel(task=task, substitution="all", context=c, stat="estimate")
        for est in err.estimator.values:
            if str(est) == "exact":
                continue
            x = ds["feature_dim"].sel(task=task, substitution="all", context=c, estimator=est).max("seed")
            for layer, ls in zip(err.layer.values, ("-", "--", ":")):
                e = err.sel(estimator=est, layer=layer)
                keep = np.isfinite(e.values) & np.isfinite(x.values)
                if keep.any():
                    st = icl_style(str(est))
                    ax.plot(x.values[keep], e.values[keep], color=st["color"], marker=st["marker"], linestyle=ls,
                            label=str(est) if layer == 0 else None)
        ax.set_yscale("log")
        label_panel(ax, R_PER_HEAD, "attention-output rel. RMS error",
                    "(b) per-layer error, own activations (— layer 0, - - layer 1)", log2_x=True)
        _frontier(axes[1, 0], ds, task, c)
        _proxy_panel(axes[1, 1], ds, task, c)
        _context_panel(axes[1, 2], ds, task)
        notes.insert(0, f"MQAR panels: task {task}, {c} pairs in context")
    if rg:
        task, c = rg[0]
        ax = axes[0, 2]
        _curve(ax, ds, task, "all", "score", c)
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
    handles, names = legend_entries(axes.flat)
    fig.legend(handles, names, loc="outside right center", fontsize=7, frameon=False)
    save_figure(fig, path, (
        "Trained causal Transformers with approximate attention. (a, c) Post-hoc substitution of every layer's "
        "softmax attention by an estimator at rank r, nothing retrained: task score (mean over evaluation prompts, "
        "band: 95 % cluster-bootstrap interval over seeds, each with its prompts); (b) each layer's "
        "attention-output error against exact attention on the "
        "model's own activations (median over seeds). (d) Models trained from scratch with the estimator at feature "
        "dimension r (plus a short convolution): accuracy against the bytes a decoder keeps (star: the softmax "
        "reference's KV cache; markers drawn later are smaller, so coinciding points stay visible). (e) "
        "Training-free read-out accuracy (icl_recall: d = 64, β = 2 ln n) against the trained model's post-hoc "
        "accuracy at the same estimator, r and number of pairs (marker size grows with r), with Spearman's ρ over "
        "the approximate points and its cluster-bootstrap interval over seeds. (f) Post-hoc accuracy against the "
        "prompt length at "
        "r = 64 (fixed-dimension maps at their own r). " + "; ".join(notes) + "."),
        title="In-context learning in trained Transformers")


def _frontier(ax, ds, task, c):
    sel = ds.sel(task=task, context=c, substitution="trained")
    for order, est in enumerate(sel.estimator.values):
        s = sel["score_summary"].sel(estimator=est, stat="estimate").values
        x = sel.state_bytes.sel(estimator=est).max("seed").values
        keep = np.isfinite(s) & np.isfinite(x)
        if not keep.any():
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
    sel = ds.sel(task=task, context=c, substitution="all")
    for est, r in spearman_points(ds, task, c)[0]:
        st = icl_style(est)
        x = _estimate(sel["proxy_accuracy_summary"].sel(estimator=est, num_features=r))
        y = _estimate(sel["score_summary"].sel(estimator=est, num_features=r))
        ax.plot(x, y, marker=st["marker"], color=st["color"], linestyle="none",
                markersize=3 + 1.5 * np.log2(max(r, 2)) / 2)
    ax.plot([0, 1], [0, 1], color="0.5", linewidth=0.8)
    rho = ds["proxy_rank_correlation"].sel(task=task, context=c)
    ax.set_xlim(-0.03, 1.03)
    label_panel(ax, "training-free read-out accuracy (proxy)", "trained model, post-hoc accuracy",
                f"(e) Spearman ρ = {fmt_ci(rho, 2)}, {_points(ds, task, c)} points, {_units(ds)} seeds", accuracy=True)


def _context_panel(ax, ds, task):
    sel = ds.sel(task=task, substitution="all")
    r = 64 if 64 in sel.num_features.values else int(sel.num_features.values[-1])
    for est in sel.estimator.values:
        slot = sel.sel(estimator=est)
        ranks = [r] + [int(v) for v in slot.num_features.values if v != r]
        rank = next((rr for rr in ranks if _ran(slot.score.sel(num_features=rr))), None)
        if rank is None:
            continue
        s = slot["score_summary"].sel(num_features=rank, stat="estimate").values
        x = ds["seq_len"].sel(task=task).max("seed").values
        keep = np.isfinite(s) & np.isfinite(x)
        if keep.any():
            ax.plot(x[keep], s[keep], **icl_style(str(est)))
    label_panel(ax, "prompt length (tokens)", "MQAR accuracy", f"(f) post hoc against length, r = {r}",
                accuracy=True, log2_x=True)
