"""Rank against attention-output error and against in-context score, on matched inputs: the summary figure.

For each of the three training-free tasks (:mod:`kernapprox.tasks`) at one representative setting, every cell reads
the episodes of its data draw with one estimator at rank ``r`` and records, per episode, the relative error of the
attention output against exact attention and the task score on exactly those inputs; exact attention's score on
the same episodes is the reference (once per draw). The tasks: ``recall`` (continuous MQAR, n = 256 random unit
key/value pairs in d = 64, β = 2·ln n, decoded among 4096 candidates; score = accuracy), ``regression``
(Nadaraya–Watson regression of GP draws on S³, n = 256, β = 16; score = normalised MSE) and ``classification``
(digits, n = 200 labelled images, β = 16; score = accuracy). The ``query`` axis perturbs the recall queries: the
stored key, the key at cosine 0.9, or a paraphrase of a discrete 8-token key (one token replaced); regression and
classification query fresh points and run at ``query = key`` only (other values are NaN). Every task has as many
queries as context points. Read-outs fit data-dependent maps on the context keys only; the two rank-r SVD
references are oracles fitted on the query–key matrix itself: the kernel SVD (best rank-r approximation of
``exp(s QKᵀ)``, which bounds the kernel's Frobenius error only) and, where registered, the attention SVD (best
rank-r approximation of the row-normalised attention matrix, which bounds that matrix's Frobenius error only);
neither bounds the output error or the score. Maps whose dimension is fixed by ``d`` (Taylor) run in the
``num_features = 64`` column; landmark methods and the oracles need ``r ≤ n`` (NaN otherwise).

LARA (``lara``) and EVA without its positional window (``eva_w0``) — training-free variants of the papers'
training-time rule (sampled draws; no learned landmark maps or group logit), not the papers' trained estimators —
are compared at equal state bytes: in their rows ``num_features`` is the budget ``r`` (the state of FAVOR+/OPRF at
``r`` features, in each task's dimensions), each runs its largest configuration within it
(:func:`experiments._icl.sized_readout`), at budgets below exact attention's KV cache only, and not applicable
(NaN) where nothing fits. They run with the stored keys as queries (``query = key``) only: recall with perturbed
queries at equal state bytes is ``icl_recall``'s. They build their proposals from the batch of test queries of an
episode, so their read-outs see the other test queries (``fit_on="queries_and_keys"``).

The figure draws every estimator against the bytes of the state a decoder keeps (its ``state_bytes``; the
oracles, which keep none, at ``budget_bytes``, the state of FAVOR+/OPRF at their rank), with exact attention at
its KV cache, ``n (d + d_v)`` float32 numbers, on the same axis.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from experiments._common import ATTENTION_SVD, KERNEL_SVD, above, add_comparison, range_text
from experiments._icl import (
    EPISODES,
    QUERY_AXIS,
    REPLICATES,
    SET_CONTEXT_EQUAL_BYTES,
    STATE_BYTES_LABEL,
    applicable,
    available,
    episode_dims,
    kv_cache_bytes,
    readout_metric_table,
    readout_metrics,
    recall_episodes,
    sized_readout_arguments,
    summarise_readout,
)
from experiments._icl import style as icl_style
from kernapprox import memory, readout, stats, tasks
from kernapprox.plotting import (
    figure_legend,
    fmt,
    fmt_bytes,
    fmt_ci,
    fmt_cis,
    kv_cache_marker,
    log_axis,
    new_figure,
    plot_summary,
    reference_band,
    reference_slope,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, not_applicable, run_cli

TASKS = {  # task -> settings
    "recall": {"num_context": 256, "beta_factor": 2.0, "num_queries": 256, "dim": 64, "num_candidates": 4096},
    "regression": {"num_context": 256, "beta": 16.0, "num_queries": 256},
    "classification": {"num_context": 200, "beta": 16.0, "num_queries": 200},
}
# task -> (d, d_v): the widths of its keys and values, which set exact attention's KV cache (recall: values as wide
# as the keys; regression: points on S³ with one label; classification: 64 pixels and 10 one-hot classes)
KV_WIDTHS = {"recall": (TASKS["recall"]["dim"], TASKS["recall"]["dim"]), "regression": (4, 1),
             "classification": (64, 10)}
SCORE_NAMES = {"recall": "recall accuracy", "regression": "normalised MSE", "classification": "accuracy"}
ACCURACY_TASKS = ("recall", "classification")

ESTIMATORS = {  # label -> (registry name, constructor options)
    **{name: (name, {}) for name in ("positive_orthogonal", "oprf_orthogonal", "trig_orthogonal", "taylor2",
                                     "nystrom_uniform", "nystrom_rls", KERNEL_SVD, ATTENTION_SVD)},
    **{label: SET_CONTEXT_EQUAL_BYTES[label] for label in ("lara", "eva_w0")},   # sized by the state budget
}
ORACLES = {KERNEL_SVD: "kernel SVD (oracle)", ATTENTION_SVD: "attention SVD (oracle)"}
SIZED = ("lara", "eva_w0")
COMPARED = ("positive_orthogonal", "oprf_orthogonal")       # the equal-bytes baselines of the findings
QUERIES = ["key", "cos0.9", "paraphrase"]

GRIDS = {
    "smoke": {"task": list(TASKS), "query": ["key", "paraphrase"],
              "estimator": available(ESTIMATORS, ["positive_orthogonal", KERNEL_SVD, "lara"]),
              "num_features": [16, 32], "seed": [0]},
    "default": {"task": list(TASKS), "query": QUERIES, "estimator": available(ESTIMATORS, list(ESTIMATORS)),
                "num_features": [16, 64, 256, 1024, 4096], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws
    "full": {"task": list(TASKS), "query": QUERIES,
             "estimator": available(ESTIMATORS, list(ESTIMATORS)),
             "num_features": [16, 64, 256, 1024, 4096], "seed": list(range(10))},
}
AXIS_ATTRS = {"task": {"long_name": "training-free in-context task", "units": "1"}, "query": QUERY_AXIS}

_READOUT_METRICS = readout_metric_table(
    output_rel_error="per episode, ‖Ŷ−Y‖_F/‖Y‖_F against exact attention on the task's queries (inf when an output "
                     "is not finite)")
METRICS = {  # the output error first, as in the stored datasets
    "output_rel_error": _READOUT_METRICS["output_rel_error"],
    "score": Metric("task score", "1", "per episode; recall and classification: accuracy; regression: normalised MSE",
                    **episode_dims()),
    **{k: v for k, v in _READOUT_METRICS.items() if k != "output_rel_error"},
    "budget_bytes": Metric("memory budget B(r)", "byte", "the larger state of FAVOR+ and OPRF at r features in the "
                           "task's dimensions (float32); the LARA and EVA rows run their largest configuration "
                           "within it"),
}
REFERENCE_METRICS = {
    "score_exact": Metric("task score of exact attention", "1",
                          "the same score for exact softmax attention on the same episodes", **episode_dims()),
}


def draw(params, data_rng, device):
    """``(queries, keys, values, per-episode scorer, β, exact attention's read-out)`` of one batch of episodes of
    the task (None where the task does not run with this query)."""
    task, query, s = params["task"], params["query"], TASKS[params["task"]]
    if task != "recall" and query != "key":          # regression and classification run at query = key only
        return None
    if task == "recall":
        ep = recall_episodes(s["num_context"], query, rng=data_rng, device=device, num_queries=s["num_queries"],
                             dim=s["dim"], num_candidates=s["num_candidates"])
        q, k, v, score, beta = (ep.queries, ep.keys, ep.values, lambda y: tasks.recall_accuracy(y, ep),
                                tasks.log_n_beta(s["num_context"], s["beta_factor"]))
    elif task == "regression":
        ep = tasks.smooth_regression(s["num_context"], num_queries=s["num_queries"], batch=EPISODES, rng=data_rng,
                                     device=device)
        q, k, v, score, beta = ep.x_query, ep.x, ep.y, lambda y: tasks.normalized_mse(y, ep), s["beta"]
    else:
        ep = tasks.digits_classification(s["num_context"], num_queries=s["num_queries"], batch=EPISODES,
                                         rng=data_rng, device=device)
        q, k, v, score, beta = ep.x_query, ep.x, ep.onehot, lambda y: tasks.classification_accuracy(y, ep), s["beta"]
    return q, k, v, score, beta, readout.attention_readout("exact", q, k, v, beta=beta)


def run_cell(params, rng, device, data):
    task, query, label, r = params["task"], params["query"], params["estimator"], params["num_features"]
    n = TASKS[task]["num_context"]
    if data is None or not applicable(ESTIMATORS, label, r, n):
        return not_applicable()
    name, options = ESTIMATORS[label]
    queries, keys, values, score, beta, exact = data
    d, d_v = keys.shape[-1], values.shape[-1]
    budget = {"budget_bytes": np.float64(memory.budget_bytes(r, d=d, d_v=d_v, seq_len=n))}
    fit_on = "queries_and_keys" if label in ORACLES else "keys"
    if label in SIZED:                                   # equal state bytes: the largest configuration within B(r)
        if query != "key":                               # the perturbed recall queries are icl_recall's
            return not_applicable(**budget)
        sized = sized_readout_arguments(ESTIMATORS, label, r, num_context=n, d=d, d_v=d_v)
        if sized is None:
            return not_applicable(**budget)
        name, options, r, fit_on = sized
    read = readout.attention_readout(name, queries, keys, values, beta=beta, num_features=r, rng=rng,
                                     options=options, fit_on=fit_on)
    return {"score": score(read.output).cpu().numpy(), **readout_metrics(read, exact), **budget}


def run_reference(params, device, data):
    return not_applicable() if data is None else {"score_exact": data[3](data[5].output).cpu().numpy()}


# ------------------------------------------------------------------------------------------------ summaries
def _score_summary(ds: xr.Dataset, var: str) -> xr.DataArray:
    """Accuracy tasks: pooled proportions with Clopper–Pearson intervals; regression: median nMSE with its
    bootstrap interval; one variable along ``task``."""
    parts = []
    for task in ds.task.values:
        da = ds[var].sel(task=task)
        if str(task) in ACCURACY_TASKS:
            queries = TASKS[str(task)]["num_queries"]
            parts.append(stats.proportion_summary((da * queries).round(), queries, REPLICATES))
        else:
            parts.append(stats.summarise(da, REPLICATES))
    out = xr.concat(parts, dim="task").transpose(*[d for d in ds[var].dims if d not in REPLICATES], "stat")
    out.attrs = {"long_name": ds[var].attrs["long_name"], "units": "1", "statistic": "proportion (recall, "
                 "classification); median (regression)", "level": stats.LEVEL, "over": ", ".join(REPLICATES),
                 "interval": f"{parts[0].attrs['interval']} (accuracy tasks); {parts[-1].attrs['interval']} "
                             "(regression)" if len(parts) > 1 else parts[0].attrs["interval"],
                 "description": f"summary of {var} over seed, episode"}
    return out


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds["score_summary"] = _score_summary(ds, "score")
    ds["score_exact_summary"] = _score_summary(ds, "score_exact")
    diff = (ds["score"] - ds["score_exact"]).assign_attrs(
        long_name="task score − exact attention's on the same episode", units="1",
        description="per episode (accuracy difference; regression: nMSE difference, positive = worse)",
        comparison="difference")
    return summarise_readout(add_comparison(ds, "score_vs_exact", diff, REPLICATES, statistic="mean"))


# ---------------------------------------------------------------------------------------------------- figure
ORACLE_STYLES = {KERNEL_SVD: {"color": "black", "linestyle": "-"}, ATTENTION_SVD: {"color": "0.45", "linestyle": "--"}}


def _kv_bytes(task: str) -> float:
    """Exact attention's KV cache at the task's context length (:func:`experiments._icl.kv_cache_bytes`)."""
    return float(kv_cache_bytes(TASKS[task]["num_context"], *KV_WIDTHS[task]))


def _memory_lines(ax, ds, var, labels, **sel):
    """``<var>_summary`` against the bytes of each estimator's state (median over seeds; the sized estimators at
    their own state, within the budget), the oracles, which keep no decoder state, at ``budget_bytes``: the larger
    state of FAVOR+ and OPRF at their rank."""
    for label in labels:
        size = ds["budget_bytes" if label in ORACLES else "state_bytes"].sel(estimator=label, **sel).median("seed")
        plot_summary(ax, ds[f"{var}_summary"].sel(estimator=label, **sel), xvalues=size.values,
                     **{**icl_style(label), "label": ORACLES.get(label, label), **ORACLE_STYLES.get(label, {})})
    log_axis(ax, "x", label=STATE_BYTES_LABEL, unit="bytes")


def _setting(task):
    s = TASKS[task]
    beta = f"β = {s['beta_factor']:g}·ln n" if "beta_factor" in s else f"β = {s['beta']:g}"
    return f"{task}: n = {s['num_context']}, {beta}"


def _error_panel(ax, ds, labels, task):
    """The output error against state bytes with the slope r^(−1/2) along B(r) (a linear state's bytes grow as r)
    and exact attention's KV cache as a dotted line (its error is zero)."""
    _memory_lines(ax, ds, "output_rel_error", labels, task=task, query="key")
    budget = ds["budget_bytes"].sel(task=task, query="key").max(("estimator", "seed"))
    reference_slope(ax, budget.values, 1.0, slope=-0.5)
    ax.axvline(_kv_bytes(task), color="0.6", linewidth=0.8, linestyle=":")
    ax.set(yscale="log", ylim=(1e-3, 1e2), ylabel="attention-output relative error")


def _score_panel(ax, ds, labels, task, query):
    """The task score against state bytes, exact attention's across the panel (band) and at its KV cache (star)."""
    _memory_lines(ax, ds, "score", labels, task=task, query=query)
    exact = ds["score_exact_summary"].sel(task=task, query=query)
    ex = reference_band(ax, exact, label="exact attention (same episodes)")
    kv_cache_marker(ax, _kv_bytes(task), exact)
    if task == "regression":
        ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.0, label="context mean (nMSE = 1)")
    ax.set(**({"yscale": "log", "ylim": (None, 10)} if task == "regression" else {"ylim": (-0.02, 1.02)}),
           ylabel=SCORE_NAMES.get(task, "score"))
    return ex


def plot(ds: xr.Dataset, path) -> None:
    labels = [str(v) for v in ds.estimator.values]
    task_names = [str(v) for v in ds.task.values]
    perturbed = [str(q) for q in ds["query"].values if q != "key"]
    rows = 3 if perturbed and "recall" in task_names else 2
    fig, axes = new_figure(rows, len(task_names), squeeze=False, height=3.1 * rows + 0.4, width=4.2 * len(task_names))
    for j, task in enumerate(task_names):
        _error_panel(axes[0, j], ds, labels, task)
        axes[0, j].set_title(_setting(task))
        ex = _score_panel(axes[1, j], ds, labels, task, "key")
        axes[1, j].set_title(f"{task}: exact {ex:.3f}")
    if rows == 3:
        for j in range(len(task_names)):
            axes[2, j].axis("off")
        for j, query in enumerate(perturbed[:len(task_names)]):
            axes[2, j].axis("on")
            ex = _score_panel(axes[2, j], ds, labels, "recall", query)
            axes[2, j].set_title(f"recall, {query}: exact {ex:.3f}")
    figure_legend(fig, axes)
    save_figure(fig, path, (
        "One set of episodes per data draw, read by exact attention and by every estimator at each rank r of the "
        "grid, drawn against the bytes of the state a decoder keeps from the context (float32, each estimator's own "
        "accounting: the linear state r·(d_v+1), Nyström also its landmarks and whitening, LARA and EVA their "
        "proposals and group summaries). Vertical dotted line: exact attention's KV cache at the task's n, n (d + "
        "d_v) float32 numbers; the star on it: exact attention's score. Top: relative RMS error of the attention "
        "output against exact attention (grey dashed: slope −1/2, r^(−1/2) for a linear state, whose bytes grow as "
        "r). Middle: the task score on the same episodes (dashed line and grey band: exact attention across the "
        "panel). "
        + ("Bottom: recall with perturbed queries (cosine 0.9 to the key; a paraphrase of a discrete 8-token key). "
           if rows == 3 else "")
        + "Recall: continuous MQAR, 256 pairs in d = 64, decoded among 4096 candidates; regression: GP draws on S³, "
          "256 points, normalised MSE (lower is better); classification: digits, 200 labelled images. Lines: medians "
          f"(errors, nMSE) or pooled accuracies over {ds.sizes['seed']} seeds × {ds.sizes['episode']} episodes; bands "
          "and bars: 95 % bootstrap (medians) or Clopper–Pearson (accuracies) intervals; markers alone are "
          "fixed-dimension maps; LARA and EVA (without its positional window) run their largest configuration within "
          "the state of FAVOR+ at r and are drawn at the bytes they keep. Black: the kernel-SVD oracle (the best "
          "rank-r kernel in Frobenius norm; it bounds no output error or score); grey dashed: the attention-SVD "
          "oracle where present; the oracles keep no decoder state and are drawn at the state of FAVOR+/OPRF at "
          "their rank. Read-outs fit on the context keys; the oracles see the queries."),
        title="Attention error and in-context score against state bytes (KV cache marked)")


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    labels = [str(v) for v in ds.estimator.values]
    ranks = [int(v) for v in ds.num_features.values]
    r_hi = max(ranks)
    score, diff = ds["score_summary"], ds["score_vs_exact_summary"].sel(query="key")
    err = ds["output_rel_error_summary"].sel(query="key")
    queries = [str(q) for q in ds["query"].values]
    fits = {str(task): [r for r in ranks if r <= TASKS[str(task)]["num_context"]] for task in ds.task.values}
    lines = []
    landmark = [m for m in labels if m.startswith("nystrom")]
    if landmark:
        parts = [f"{task} `{m}` at r = {max(rs)}: {fmt_ci(diff.sel(task=task, estimator=m, num_features=max(rs)))}"
                 for task, rs in fits.items() if rs for m in landmark]
        lines.append("Nyström maps fitted on the context keys, score minus exact attention's on the same episodes at "
                     "their largest grid rank ≤ n (query = key): " + "; ".join(parts) + ".")
    if "recall" in fits and len(queries) > 1:
        recall = score.sel(task="recall", num_features=r_hi)
        parts = [f"`{m}`: {fmt_cis(recall.sel(estimator=m), 'query', queries, sep=', ', names=str)}" for m in labels
                 if m.split("_")[0] in ("trig", "positive", "oprf")]
        exact = fmt_cis(ds["score_exact_summary"].sel(task="recall"), "query", queries, sep=", ", names=str)
        lines.append(f"Recall at r = {r_hi} as the queries move off the keys: {'; '.join(parts)}; exact attention: "
                     f"{exact}.")
    random_maps = [m for m in labels if m.split("_")[0] in ("positive", "oprf")]
    if random_maps:
        parts = [f"{task} `{m}` {fmt_ci(err.sel(task=task, estimator=m, num_features=r_hi))}"
                 for task in fits for m in random_maps]
        lines.append(f"Positive random maps at r = {r_hi} keep a median output error of: " + "; ".join(parts) + ".")
    if "trig_orthogonal" in labels and "recall" in fits:
        r_mid = 256 if 256 in ranks else ranks[len(ranks) // 2]
        mid = {"task": "recall", "num_features": r_mid}
        e_mid, acc_mid = err.sel(mid), score.sel(query="key", **mid)
        t_err, t_acc = e_mid.sel(estimator="trig_orthogonal"), acc_mid.sel(estimator="trig_orthogonal")
        pieces, opposite = [], []
        for m in random_maps:
            m_err, m_acc = e_mid.sel(estimator=m), acc_mid.sel(estimator=m)
            pieces.append(f"`{m}` error {fmt_ci(m_err)}, recall {fmt_ci(m_acc)}")
            if above(t_err, m_err) and above(t_acc, m_acc):            # worse error, better recall
                opposite.append(f"`{m}`")
        verdict = (f"output error and recall rank trigonometric features and {', '.join(opposite)} in opposite "
                   "orders (both intervals separated)" if opposite else
                   "no positive map is ranked in the opposite order by output error and by recall with both "
                   "intervals separated")
        lines.append(f"At r = {r_mid}, query = key, trigonometric features have output error {fmt_ci(t_err)} and "
                     f"recall {fmt_ci(t_acc)} ({'; '.join(pieces)}): {verdict}.")
    for oracle in [m for m in labels if m in ORACLES]:
        parts = [f"{task} (" + fmt_cis(diff.sel(task=task, estimator=oracle), "num_features", rs, sep=", ",
                                       names=lambda r: f"r = {r}:") + ")" for task, rs in fits.items()]
        lines.append(f"The {ORACLES[oracle]}, fitted on the query–key matrix, score minus exact attention's: "
                     + "; ".join(parts) + ". It is a reference for the matrix it approximates, not a bound on scores.")
    if landmark and random_maps:
        e = err.sel(stat="estimate")
        ratio = [f"{task} {range_text(e.sel(task=task, estimator=landmark).values)} (Nyström) vs "
                 f"{range_text(e.sel(task=task, estimator=random_maps).values)} (positive random maps)"
                 for task in fits]
        lines.append("Median output errors over the grid ranks: " + "; ".join(ratio) + ".")
    lines.extend(_matched_findings(ds))
    headline = [line for line in lines if line.startswith("At r = ")]
    return headline + [line for line in lines if line not in headline]


def _matched_findings(ds) -> list[str]:
    """LARA and EVA against FAVOR+ and OPRF at equal state bytes, per task (query = key): output error and score
    with their intervals, and the configuration each sized estimator ran."""
    labels = [str(v) for v in ds.estimator.values]
    sized = [m for m in SIZED if m in labels]
    if not sized:
        return []
    compared = [m for m in COMPARED if m in labels] + sized
    err, score = ds["output_rel_error_summary"], ds["score_summary"]
    parts = []
    for task in (str(t) for t in ds.task.values):
        cells = []
        for r in (int(v) for v in ds.num_features.values):
            at = {"task": task, "query": "key", "num_features": r}
            ran = {m for m in compared if bool(ds["feature_dim"].sel(estimator=m, **at).notnull().any())}
            if not ran & set(sized):
                continue
            entries = []
            for m in compared:
                one = {**at, "estimator": m}
                unit = "groups" if m.startswith("eva") else "draws" if m.startswith("lara") else "features"
                entries.append(f"`{m}` [{fmt(ds['feature_dim'].sel(**one).median())} {unit}, "
                               f"{fmt_bytes(ds['state_bytes'].sel(**one).median())}] error {fmt_ci(err.sel(**one))}, "
                               f"{SCORE_NAMES[task]} {fmt_ci(score.sel(**one))}" if m in ran else f"`{m}` n/a")
            cells.append(f"r = {r} ({fmt_bytes(ds['budget_bytes'].sel(**at).max())}): " + "; ".join(entries))
        if cells:
            parts.append(f"{task}: " + " — ".join(cells))
    return [("LARA and EVA at equal state bytes (budget of FAVOR+ at r in each task's dimensions, query = key; "
             "LARA and EVA read the episode's test queries as a batch): " + " | ".join(parts) + ".")]


DATA_AXES = ("task", "query", "seed")
EXPERIMENT = Experiment.from_module(__name__, title="Rank against attention-output error and in-context score "
                                                    "(matched inputs)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
