"""The figure and the findings of ``trained_icl``, read from its dataset only.

Intervals are percentile bootstraps over evaluation prompts (seeds × episodes pooled: the prompts are i.i.d.)
with a fixed bootstrap seed; the rank correlation resamples the prompts jointly for every (estimator, r) point,
which the paired design allows (every point reads the same prompts and the same proxy episodes).
"""

from __future__ import annotations

import warnings

import numpy as np
import xarray as xr
from scipy import stats

from experiments._icl import legend_entries
from experiments._icl import style as icl_style
from kernapprox.plotting import new_figure, save_figure

BOOT = 2000
BOOT_SEED = 20240


# ------------------------------------------------------------------------------------------------ helpers
def _prompts(da: xr.DataArray) -> np.ndarray:
    """The per-prompt values of a slice with dims (seed, episode) as one flat array (NaN dropped)."""
    values = np.asarray(da.transpose("seed", "episode").values, dtype=float).ravel()
    return values[~np.isnan(values)]


def mean_ci(values: np.ndarray, seed: int = BOOT_SEED) -> tuple[float, float, float]:
    """Mean and its 95 % percentile-bootstrap interval (``inf`` values make the mean ``inf``)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return np.nan, np.nan, np.nan
    gen = np.random.default_rng(seed)
    idx = gen.integers(0, values.size, size=(BOOT, values.size))
    with np.errstate(invalid="ignore"):
        means = values[idx].mean(1)
        lo, hi = np.percentile(means, [2.5, 97.5])
    return float(values.mean()), float(lo), float(hi)


def _fmt(m, lo, hi, digits=3) -> str:
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _tasks(ds, family: str) -> list[str]:
    """Task labels of ``family`` ("mqar"/"regression") present in ``ds``."""
    return [str(t) for t in ds.task.values if str(t).startswith(family)]


def _ran(da: xr.DataArray) -> bool:
    return bool(np.isfinite(np.asarray(da.values, dtype=float)).any())


def _contexts(ds, task) -> list[int]:
    sel = ds.score_exact.sel(task=task)
    return [int(c) for c in ds.context.values if _ran(sel.sel(context=c))]


def _exact_slot(ds) -> dict:
    """The selection of exact attention's cells (the num_features column it runs in)."""
    ran = ds.score_exact.sel(estimator="exact").notnull()
    slots = [int(r) for r in ds.num_features.values if bool(ran.sel(num_features=r).any())]
    return {"estimator": "exact", "num_features": slots[0] if slots else int(ds.num_features.values[0])}


def spearman_points(ds: xr.DataArray | xr.Dataset, task: str, context: int):
    """``(labels, proxy (P, S, E), trained (P, S, E))`` of the approximate (estimator, r) points with a proxy
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
    return float(stats.spearmanr(a, b).statistic)


def rank_correlation(ds, task: str, context: int, seed: int = BOOT_SEED):
    """Spearman's ρ between the proxy and the post-hoc accuracy over (estimator, r) points, with a 95 % bootstrap
    interval (prompts resampled jointly); ``(ρ, lo, hi, number of points)``."""
    labels, x, y = spearman_points(ds, task, context)
    if len(labels) < 3:
        return np.nan, np.nan, np.nan, len(labels)
    x, y = x.reshape(len(labels), -1), y.reshape(len(labels), -1)
    rho = _spearman(np.nanmean(x, 1), np.nanmean(y, 1))
    gen = np.random.default_rng(seed)
    boot = []
    for _ in range(BOOT):
        idx = gen.integers(0, x.shape[1], size=x.shape[1])
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)        # a point without a finite resampled mean
            boot.append(_spearman(np.nanmean(x[:, idx], 1), np.nanmean(y[:, idx], 1)))
    boot = np.asarray(boot, dtype=float)
    boot = boot[np.isfinite(boot)]
    lo, hi = (np.percentile(boot, [2.5, 97.5]) if boot.size else (np.nan, np.nan))
    return float(rho), float(lo), float(hi), len(labels)


# ------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    """Markdown bullets; every number is computed from ``ds`` (means with 95 % bootstrap intervals over prompts)."""
    lines = []
    exact = _exact_slot(ds)
    for task in _tasks(ds, "mqar"):
        for c in _contexts(ds, task):
            sel = ds.sel(task=task, context=c, substitution="all", **exact)
            lines.append(f"- {task}: the softmax reference recalls {_fmt(*mean_ci(_prompts(sel.score_exact)))} of the "
                         f"queries with {c} pairs (seq_len {int(sel.seq_len.max())}, {sel.score_exact.size} prompts).")
    for task in _tasks(ds, "regression"):
        for c in _contexts(ds, task):
            sel = {"task": task, "context": c, "substitution": "all", **exact}
            ref, ls, ridge = (mean_ci(_prompts(ds[v].sel(**sel))) for v in ("score_exact", "baseline_ls",
                                                                             "baseline_ridge"))
            lines.append(f"- {task}: with {c} examples in context the reference's normalised error is "
                         f"{_fmt(*ref)}; least squares {_fmt(*ls)}, ridge {_fmt(*ridge)} on the same prompts.")
    sub = ds.sel(**exact)
    diff = np.abs(sub.score - sub.score_exact).sel(substitution=[s for s in ds.substitution.values if s != "trained"])
    if _ran(diff):
        lines.append(f"- Substituting exact attention for the reference's own (every layer or one) changes no score: "
                     f"max |difference| = {float(diff.max()):.1e} over {int(np.isfinite(diff.values).sum())} "
                     "prompt scores.")
    for task in _tasks(ds, "mqar") + _tasks(ds, "regression"):
        cs = _contexts(ds, task)
        if not cs:
            continue
        c = cs[-1]
        sel = ds.sel(task=task, context=c, substitution="all")
        parts = []
        for est in sel.estimator.values:
            if str(est) == "exact":
                continue
            rs = [int(r) for r in sel.num_features.values if _ran(sel.score.sel(estimator=est, num_features=r))]
            if not rs:
                continue
            ends = [f"{mean_ci(_prompts(sel.score.sel(estimator=est, num_features=r)))[0]:.2f} at r = "
                    f"{int(sel.feature_dim.sel(estimator=est, num_features=r).max())}" for r in dict.fromkeys(
                        (rs[0], rs[-1]))]
            parts.append(f"{est} {' → '.join(ends)}")
        if parts:
            lines.append(f"- {task}, every layer substituted post hoc ({c} in context): " + "; ".join(parts) + ".")
        errs = []
        for layer in ds.layer.values:
            name = f"layer{int(layer)}"
            if name not in ds.substitution.values:
                continue
            one = ds.sel(task=task, context=c, substitution=name, estimator="positive_orthogonal")
            if not _ran(one.score):
                continue
            r = int(one.num_features.values[len(one.num_features) // 2])
            m = mean_ci(_prompts(one.score.sel(num_features=r)))
            e = float(one.layer_error.sel(num_features=r, layer=layer).median())
            errs.append(f"layer {int(layer)} alone: score {_fmt(*m, digits=2)}, output error {e:.2f}")
        if errs:
            lines.append(f"- {task}, positive_orthogonal at r = {r} in one layer: " + "; ".join(errs) + ".")
    for task in _tasks(ds, "mqar"):
        cs = _contexts(ds, task)
        if not cs:
            continue
        c = cs[-1]
        sel = ds.sel(task=task, context=c, substitution="trained")
        parts = []
        for est in sel.estimator.values:
            for r in sel.num_features.values:
                one = sel.sel(estimator=est, num_features=r)
                if not _ran(one.score):
                    continue
                m = mean_ci(_prompts(one.score))
                parts.append(f"{est} r = {int(r) if str(est) != 'exact' else 'KV'}: {m[0]:.2f} [{m[1]:.2f}, {m[2]:.2f}]"
                             f" at {float(one.state_bytes.max()) / 1024:.1f} KiB")
        if parts:
            lines.append(f"- {task}, trained from scratch ({c} pairs): " + "; ".join(parts) + ".")
        beta = ds.reference_beta.sel(task=task, context=c, substitution="all", **exact).mean("seed")
        beta = [f"{float(v):.1f}" for v in beta.values if np.isfinite(v)]
        if beta:
            lines.append(f"- {task}: the reference's layers attend at effective β = s·mean‖q‖·mean‖k‖ = "
                         f"{', '.join(beta)} (layer 0, 1, …; {c} pairs); the proxy reads at β = 2 ln {c} = "
                         f"{2 * np.log(c):.1f}.")
        rho, lo, hi, npts = rank_correlation(ds, task, c)
        if npts and np.isfinite(rho):
            lines.append(f"- {task}: the training-free proxy and the post-hoc accuracy rank the {npts} (estimator, r) "
                         f"points with Spearman ρ = {_fmt(rho, lo, hi, 2)} ({c} pairs).")
        elif npts:
            lines.append(f"- {task}: the rank correlation of proxy and post-hoc accuracy is undefined over the {npts} "
                         f"points ({c} pairs): one side does not vary.")
    seconds = {}
    for task in ds.task.values:
        for sub in ds.substitution.values:
            sel = ds.sel(task=task, substitution=sub)
            for est in sel.estimator.values:
                for r in sel.num_features.values:
                    one = sel.sel(estimator=est, num_features=r)
                    wall, cpu = float(one.train_seconds.max()), float(one.train_cpu_seconds.max())
                    if np.isfinite(wall):
                        key = (str(task), "reference" if sub != "trained" or str(est) == "exact" else
                               f"{est} r={int(r)}")
                        seconds[key] = (cpu, wall)
    if seconds:
        cpu, wall = (sum(v[i] for v in seconds.values()) for i in (0, 1))
        lines.append(f"- Training: {len(seconds)} models, {cpu:.0f} CPU seconds in total on one thread ({wall:.0f} s "
                     "wall on the machine as it was shared): "
                     + ", ".join(f"{t} {m} {c:.0f} s" for (t, m), (c, _) in sorted(seconds.items())) + ".")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ plot
def _curve(ax, ds, task, sub, var, context, *, log=False):
    sel = ds.sel(task=task, substitution=sub, context=context)
    for est in sel.estimator.values:
        if str(est) == "exact":
            continue
        xs, ms, los, his = [], [], [], []
        for r in sel.num_features.values:
            one = sel.sel(estimator=est, num_features=r)
            if not _ran(one[var]):
                continue
            m, lo, hi = mean_ci(_prompts(one[var]))
            xs.append(float(one.feature_dim.max()))
            ms.append(m)
            los.append(lo)
            his.append(hi)
        if not xs:
            continue
        style = icl_style(str(est))
        if len(xs) == 1:
            ax.errorbar(xs, ms, yerr=[[ms[0] - los[0]], [his[0] - ms[0]]], marker=style["marker"], linestyle="none",
                        color=style["color"], label=str(est), markersize=6)
        else:
            ax.plot(xs, ms, **style)
            ax.fill_between(xs, los, his, color=style["color"], alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("feature dimension r per head")


def plot(ds: xr.Dataset, path) -> None:
    exact = _exact_slot(ds)
    fig, axes = new_figure(2, 3, squeeze=False, width=13.5, height=7.6)
    mq = _tasks(ds, "mqar")[:1]
    rg = _tasks(ds, "regression")[:1]
    notes = []
    if mq and _contexts(ds, mq[0]):
        task = mq[0]
        c = _contexts(ds, task)[-1]
        ref = mean_ci(_prompts(ds.score_exact.sel(task=task, context=c, substitution="all", **exact)))[0]
        ax = axes[0, 0]
        _curve(ax, ds, task, "all", "score", c)
        ax.axhline(ref, color="k", linestyle="--", linewidth=1.0, label="softmax reference")
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("MQAR accuracy")
        ax.set_title(f"(b) post hoc, every layer ({c} pairs)")
        ax = axes[0, 1]
        sel = ds.sel(task=task, substitution="all", context=c)
        for est in sel.estimator.values:
            if str(est) == "exact":
                continue
            for layer, ls in zip(sel.layer.values, ("-", "--", ":")):
                err = sel.layer_error.sel(estimator=est, layer=layer).median("seed")
                x = sel.feature_dim.sel(estimator=est).max("seed")
                keep = np.isfinite(err.values) & np.isfinite(x.values)
                if keep.any():
                    st = icl_style(str(est))
                    ax.plot(x.values[keep], err.values[keep], color=st["color"], marker=st["marker"], linestyle=ls,
                            label=str(est) if layer == 0 else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("feature dimension r per head")
        ax.set_ylabel("attention-output rel. RMS error")
        ax.set_title("(b) per-layer error, own activations (— layer 0, - - layer 1)")
        _frontier(axes[1, 0], ds, task, c, exact)
        _proxy_panel(axes[1, 1], ds, task, c)
        _context_panel(axes[1, 2], ds, task)
        notes.insert(0, f"MQAR panels: task {task}, {c} pairs in context")
    if rg and _contexts(ds, rg[0]):
        task = rg[0]
        c = _contexts(ds, task)[-1]
        ax = axes[0, 2]
        _curve(ax, ds, task, "all", "score", c, log=True)
        sel = {"task": task, "context": c, "substitution": "all", **exact}
        notes.append(f"regression panel: task {task}, {c} pairs in context, 8 queries")
        for var, label, ls in (("score_exact", "softmax reference", "--"), ("baseline_ridge", "ridge", ":"),
                               ("baseline_ls", "least squares", "-.")):
            m = mean_ci(_prompts(ds[var].sel(**sel)))[0]
            if m > 1e-6:                                     # noiseless least squares is exact beyond d points
                ax.axhline(m, color="k", linestyle=ls, linewidth=1.0, label=label)
            else:
                notes.append(f"{label}: {m:.0e}, below the axis")
        ax.set_ylabel("squared error / d (mean over queries)")
        ax.set_title(f"(b) regression post hoc ({c} examples)")
    handles, names = legend_entries(axes.flat)
    fig.legend(handles, names, loc="outside right center", fontsize=7, frameon=False)
    save_figure(fig, path, (
        "Trained causal Transformers with approximate attention. (b) Post-hoc substitution of every layer's softmax "
        "attention by an estimator at rank r, nothing retrained: task score (mean over evaluation prompts, band: 95 % "
        "bootstrap interval) and each layer's attention-output error against exact attention on the model's own "
        "activations (median over seeds). (c) Models trained from scratch with the estimator at feature dimension r "
        "(plus a short convolution): accuracy against the bytes a decoder keeps (star: the softmax reference's KV "
        "cache). (d) Training-free read-out accuracy (icl_recall: d = 64, β = 2 ln n) against the trained model's "
        "post-hoc accuracy at the same estimator, r and number of pairs (marker size grows with r), with Spearman's "
        "ρ over the approximate points and its bootstrap interval. Right: post-hoc accuracy against the prompt length "
        "at r = 64 (fixed-dimension maps at their own r). " + "; ".join(notes) + "."),
        title="In-context learning in trained Transformers")


def _frontier(ax, ds, task, c, exact):
    sel = ds.sel(task=task, context=c, substitution="trained")
    for est in sel.estimator.values:
        xs, ms = [], []
        for r in sel.num_features.values:
            one = sel.sel(estimator=est, num_features=r)
            if _ran(one.score):
                xs.append(float(one.state_bytes.max()))
                ms.append(mean_ci(_prompts(one.score))[0])
        if not xs:
            continue
        st = icl_style(str(est))
        if str(est) == "exact":
            ax.plot(xs, ms, marker="*", markersize=12, linestyle="none", color=st["color"],
                    label="softmax reference (KV cache)")
        else:
            ax.plot(xs, ms, **{**st, "label": f"{est} (trained)"})
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("state size (bytes, float32)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_title(f"(c) trained from scratch ({c} pairs)")


def _proxy_panel(ax, ds, task, c):
    labels, x, y = spearman_points(ds, task, c)
    for (est, r), xv, yv in zip(labels, x, y):
        st = icl_style(est)
        ax.plot(np.nanmean(xv), np.nanmean(yv), marker=st["marker"], color=st["color"], linestyle="none",
                markersize=3 + 1.5 * np.log2(max(r, 2)) / 2)
    ax.plot([0, 1], [0, 1], color="0.5", linewidth=0.8)
    rho, lo, hi, npts = rank_correlation(ds, task, c)
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("training-free read-out accuracy (proxy)")
    ax.set_ylabel("trained model, post-hoc accuracy")
    ax.set_title(f"(d) Spearman ρ = {rho:.2f} [{lo:.2f}, {hi:.2f}], {npts} points")


def _context_panel(ax, ds, task):
    sel = ds.sel(task=task, substitution="all")
    r = 64 if 64 in sel.num_features.values else int(sel.num_features.values[-1])
    for est in sel.estimator.values:
        slot = sel.sel(estimator=est)
        one = slot.sel(num_features=r if _ran(slot.score.sel(num_features=r)) else slot.num_features.values[0])
        if not _ran(one.score):
            for rr in slot.num_features.values:
                if _ran(slot.score.sel(num_features=rr)):
                    one = slot.sel(num_features=rr)
                    break
        xs, ms = [], []
        for c in one.context.values:
            if _ran(one.score.sel(context=c)):
                xs.append(float(one.seq_len.sel(context=c).max()))
                ms.append(mean_ci(_prompts(one.score.sel(context=c)))[0])
        if xs:
            ax.plot(xs, ms, **icl_style(str(est)))
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_title(f"(b) post hoc against length, r = {r}")
