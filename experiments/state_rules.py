"""Beyond the sum rule: recall and in-context regression against state memory, for four ways to write the state.

One feature map ``φ`` gives a fixed-size state; the rule (:mod:`kernapprox.rules`) decides what it holds:
the sum of linear attention, a decayed sum (γ = ``decay_gamma``), the delta rule (β = ``delta_beta``) and the
least-squares state (ridge λ = ``ridge``). Each cell reads the same episodes with every rule and one draw of the map
per episode, so rules are compared on bit-identical inputs and features (paired, metric dimension ``rule``); the
episodes and the map seeds come from the data stream of ``(task, num_pairs, seed)``, so every map and rank reads
the same episodes, and exact softmax attention's read-out of them is the study's reference (once per data draw).

Tasks (``task`` axis):

``recall_rho1``, ``recall_rho0.9``
    continuous multi-query associative recall (:func:`kernapprox.tasks.associative_recall`): ``n`` pairs of random
    unit keys (d = 32) and values (d_v = 64), every stored key queried once (at most 256; queries perturbed to
    cosine ρ with their key for ``rho0.9``), read-outs decoded to the nearest of 4096 candidate values; accuracy per
    episode. Inverse temperature β = 2 ln n.
``regression``
    in-context regression of a smooth random function on the sphere S³ (:func:`kernapprox.tasks.smooth_regression`,
    Gaussian-process draw of lengthscale 0.7, noise 0.1, ``n`` context points, 64 queries), β = 8; normalised
    MSE per episode (1 = predicting the mean).

Queries come after the context, so every rule is read non-causally: each query reads the state after the last
key (decay and delta are order-dependent; the context order is the episode's random order). The sum and decay
rules read like attention (``Wᵀφ(q) / zᵀφ(q)``); the delta and least-squares rules read ``Wᵀφ̄(q)`` with unit
features. State memory per rule (:meth:`kernapprox.rules.Rule.state_bytes`, float32): ``r (d_v+1)`` numbers for
sum and decay, ``r d_v`` for delta, ``r² + r d_v`` for least squares, plus what the map computed from the context
(Nyström's landmarks and whitening); exact attention keeps the KV cache ``n (d + d_v)``. Fixed-dimension maps
(Taylor, ELU+1) run in the ``num_features = 64`` column at their own dimension; landmark maps need ``r ≤ n``.

Unit of replication: the episode. Every episode is its own draw of keys, values (or function) and queries and of the
map (its own map seed), so the ``seed × episode`` episodes are independent; the queries of an episode share its map
draw and are pooled within it (its accuracy or nMSE). Intervals resample the episodes (each with its queries): the
mean accuracy, the median nMSE, and the paired per-episode comparisons. The best state within the KV cache's size is
named by its point estimate, and every pair of candidate states is compared by the Wilcoxon signed-rank test of the
per-episode differences (log ratios for nMSE), Holm-adjusted over all pairs, so the verdict on the best does not
depend on having picked it first.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._common import add_paired, add_summaries
from experiments._icl import EPISODES, FIXED_DIMENSION_SLOT, REPLICATES, add_mean, applicable, available, episode_dims
from kernapprox import readout, stats, tasks
from kernapprox.plotting import (
    errorbar_summary,
    estimator_style,
    fmt,
    fmt_bytes,
    fmt_ci,
    kv_cache_marker,
    log_axis,
    new_figure,
    proxy_legend,
    save_figure,
)
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

# label -> (registry name or estimator class, constructor options). The default preset runs every entry that is
# registered here except those in FULL_ONLY; add a map in this one table.
ESTIMATORS = {name: (name, {}) for name in ("positive_orthogonal", "taylor2", "nystrom_uniform", "elu1",
                                             "trig_orthogonal", "oprf_orthogonal")}
FULL_ONLY = ("trig_orthogonal", "oprf_orthogonal")
RULE_NAMES = ("sum", "decay", "delta", "least_squares")
TASKS = {"recall_rho1": ("recall", 1.0), "recall_rho0.9": ("recall", 0.9), "regression": ("regression", None)}

GRIDS = {
    "smoke": {"task": ["recall_rho1", "regression"],
              "estimator": available(ESTIMATORS, ["positive_orthogonal", "taylor2", "nystrom_uniform"]),
              "num_features": [16, 64], "num_pairs": [32], "seed": [0, 1]},
    "default": {"task": list(TASKS), "estimator": available(ESTIMATORS, [e for e in ESTIMATORS if e not in FULL_ONLY]),
                "num_features": [64, 256], "num_pairs": [256], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: every rule, r from 16 to 256, ten draws
    "full": {"task": list(TASKS), "estimator": available(ESTIMATORS, list(ESTIMATORS)),
             "num_features": [16, 64, 256], "num_pairs": [256], "seed": list(range(10))},
}
PARAMETERS = {
    "key_dim": Parameter(32, "recall: key dimension d", "1"),
    "value_dim": Parameter(64, "recall: value dimension d_v", "1"),
    "num_candidates": Parameter(4096, "recall: candidate values a read-out is decoded against", "1"),
    "max_queries": Parameter(256, "recall: queries per episode at most", "1",
                             "min(n, max_queries) distinct stored pairs are asked for"),
    "beta_factor": Parameter(2.0, "recall: β / ln n", "1"),
    "regression_dim": Parameter(4, "regression: input dimension d (points on S^(d−1))", "1"),
    "regression_beta": Parameter(8.0, "regression: inverse temperature β", "1"),
    "regression_queries": Parameter(64, "regression: fresh queries per episode", "1"),
    "lengthscale": Parameter(0.7, "regression: lengthscale of the Gaussian-process target", "1"),
    "noise_std": Parameter(0.1, "regression: standard deviation of the label noise", "1"),
    "decay_gamma": Parameter(0.99, "decay rule: factor γ applied to the state per token", "1"),
    "delta_beta": Parameter(1.0, "delta rule: write strength β", "1"),
    "ridge": Parameter(0.1, "least-squares rule: ridge λ", "1"),
}
AXIS_ATTRS = {
    "task": {"long_name": "task: recall with queries at cosine ρ to their key, or in-context regression",
             "units": "1"},
    "num_pairs": {"long_name": "context size n (stored pairs or regression points)", "units": "1"},
    "rule": {"long_name": "state-update rule writing the features into the state (kernapprox.rules)", "units": "1"},
}

_PER_RULE = {"dims": ("rule", "episode"), "coords": {"rule": list(RULE_NAMES), "episode": list(range(EPISODES))}}
METRICS = {
    "accuracy": Metric("recall accuracy", "1", "fraction of an episode's queries decoded to their own value among the "
                       "candidates (recall tasks; NaN for regression)", **_PER_RULE),
    "nmse": Metric("normalised MSE", "1", "Σ(ŷ−f)²/Σ(f−f̄)² over an episode's queries (regression; NaN for recall)",
                   **_PER_RULE),
    "state_bytes": Metric("state memory", "byte", "float32 bytes a decoder keeps under the rule: its state plus the "
                          "map's context-dependent fitted values (kernapprox.rules.Rule.state_bytes)", dims=("rule",),
                          coords={"rule": list(RULE_NAMES)}),
    "feature_dim": Metric("feature dimension r", "1", "r of the fitted map"),
}
REFERENCE_METRICS = {
    "accuracy_exact": Metric("exact-attention recall accuracy", "1", "exact softmax attention on the same episodes "
                             "(recall tasks; NaN for regression)", **episode_dims()),
    "nmse_exact": Metric("exact-attention normalised MSE", "1", "exact softmax attention on the same episodes "
                         "(regression; NaN for recall)", **episode_dims()),
    "kv_cache_bytes": Metric("exact attention memory", "byte", "the KV cache of the context, n·(d + d_v) float32 "
                             "numbers"),
    "num_queries": Metric("queries per episode", "1", "recall: min(n, max_queries); regression: regression_queries"),
}


def rules(params) -> dict:
    """The rules of the study, named as the ``rule`` coordinate, with the run's parameters."""
    return {"sum": "sum", "decay": ka.rules.Decay(params["decay_gamma"]), "delta": ka.rules.Delta(params["delta_beta"]),
            "least_squares": ka.rules.LeastSquares(params["ridge"])}


def _recall(task: str) -> bool:
    return TASKS[task][0] == "recall"


# ------------------------------------------------------------------------------------------------------ data
def draw(params, data_rng, device):
    """The episodes and the map seed of each episode (the engine hands them to the reference and to the cells of
    every estimator, rank and rule of the same task, n and seed)."""
    task, n = params["task"], params["num_pairs"]
    if _recall(task):
        ep = tasks.associative_recall(n, dim=params["key_dim"], value_dim=params["value_dim"],
                                      num_candidates=params["num_candidates"],
                                      num_queries=min(n, params["max_queries"]), query_cosine=TASKS[task][1],
                                      batch=EPISODES, rng=data_rng, device=device)
    else:
        ep = tasks.smooth_regression(n, dim=params["regression_dim"], num_queries=params["regression_queries"],
                                     lengthscale=params["lengthscale"], noise_std=params["noise_std"],
                                     batch=EPISODES, rng=data_rng, device=device)
    return ep, data_rng.integers(0, 2**63 - 1, size=EPISODES)


def _qkv(task, ep):
    return (ep.queries, ep.keys, ep.values) if _recall(task) else (ep.x_query, ep.x, ep.y)


def _beta(params):
    return tasks.log_n_beta(params["num_pairs"], params["beta_factor"]) if _recall(params["task"]) else \
        params["regression_beta"]


def _score(task, outputs, ep):
    """Per-episode accuracy (recall) or normalised MSE (regression) of outputs ``(B, n_q, d_v)``."""
    return (tasks.recall_accuracy if _recall(task) else tasks.normalized_mse)(outputs, ep).cpu().numpy()


def run_cell(params, rng, device, data):
    task, label, r, n = params["task"], params["estimator"], params["num_features"], params["num_pairs"]
    rule_table = rules(params)
    if not applicable(ESTIMATORS, label, r, n, slot=FIXED_DIMENSION_SLOT):
        return not_applicable()
    name, options = ESTIMATORS[label]
    ep, seeds = data
    q, k, v = _qkv(task, ep)
    scores = np.empty((len(rule_table), EPISODES))
    for b in range(EPISODES):
        est = readout.build_estimator(name, beta=_beta(params), num_features=r, rng=int(seeds[b]), **options).fit(k[b])
        outs = torch.stack([ka.linear_attention(q[b], k[b], v[b], est, False, "parallel", rule=rule)
                            for rule in rule_table.values()])                               # (rules, n_q, d_v)
        one = ep._replace(**{field: getattr(ep, field)[b:b + 1].expand(len(rule_table), *getattr(ep, field).shape[1:])
                             for field in ("candidates", "targets")}) if _recall(task) else \
            ep._replace(f_query=ep.f_query[b:b + 1].expand(len(rule_table), *ep.f_query.shape[1:]))
        scores[:, b] = _score(task, outs, one)
    return {
        "accuracy": scores if _recall(task) else np.nan,            # NaN: the other task's score
        "nmse": np.nan if _recall(task) else scores,
        "state_bytes": np.array([ka.rules.resolve_rule(rule).state_bytes(est, v.shape[-1])
                                 for rule in rule_table.values()], dtype=np.float64),
        "feature_dim": np.float64(est.num_features),
    }


def run_reference(params, device, data):
    """Exact softmax attention on the episodes of the data draw, and its KV cache."""
    task, n = params["task"], params["num_pairs"]
    ep, _ = data
    q, k, v = _qkv(task, ep)
    exact = _score(task, ka.softmax_attention(q, k, v, scale=_beta(params)), ep)
    return {"accuracy_exact": exact if _recall(task) else np.nan,
            "nmse_exact": np.nan if _recall(task) else exact,
            "kv_cache_bytes": np.float64(n * (k.shape[-1] + v.shape[-1]) * 4),
            "num_queries": np.float64(q.shape[1])}


# ------------------------------------------------------------------------------------------------ summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    """Recall: mean accuracy over episodes (the units: each its own data and map draw, its queries pooled within
    it) with the bootstrap over episodes, per episode paired differences against the sum rule (bootstrap of the
    mean). Regression: median nMSE with its interval, 10/90 % quantiles and the share of episodes worse than
    predicting the mean; the paired ratio against the sum rule."""
    for name in ("accuracy", "accuracy_exact"):
        ds = add_mean(ds, name)
        ds[f"{name}_summary"].attrs["unit"] = "episode (seed × episode: its own data and map draw)"
    ds = add_paired(ds, "accuracy", "sum", REPLICATES, op="difference", dim="rule", statistic="mean")
    ds = add_summaries(ds, ["nmse", "nmse_exact"], REPLICATES)
    ds = add_paired(ds, "nmse", "sum", REPLICATES, op="ratio", dim="rule")
    ds["state_memory"] = ds["state_bytes"].max("seed").assign_attrs(
        long_name="state memory", units="byte", description="state_bytes of the cell (equal for every seed), max over "
                                                            "seeds")
    ds["kv_cache_memory"] = ds["kv_cache_bytes"].max("seed").assign_attrs(
        long_name="exact attention memory", units="byte", description="kv_cache_bytes, max over seeds")
    return ds


def _var(task: str) -> str:
    return "accuracy" if _recall(task) else "nmse"


def _configs(ds, task, n):
    """(estimator, r, fitted dimension) of the applicable cells, in grid order."""
    dim = ds.feature_dim.sel(task=task, num_pairs=n).max("seed")
    return [(str(name), int(r), int(dim.sel(estimator=name, num_features=r))) for name in ds.estimator.values
            for r in ds.num_features.values if np.isfinite(dim.sel(estimator=name, num_features=r))]


def findings(ds: xr.Dataset) -> list[str]:
    """Markdown bullets computed from the dataset: each rule's score per map and state size with its 95 % interval
    (Clopper–Pearson for recall accuracies, bootstrap of the median for nMSE), the paired change of each rule against
    the sum rule on the same episodes and map draws, the state memory, and the best state below the KV cache."""
    n = int(ds.num_pairs.values.max())
    lines = [_headline(ds, n)]
    for task in [str(t) for t in ds.task.values]:
        var = _var(task)
        at = {"task": task, "num_pairs": n}
        exact = ds[f"{var}_exact_summary"].sel(**at)
        what = ("mean recall accuracy over" if _recall(task) else "median normalised MSE over")
        lines.append(f"{task}, n = {n}: {what} {ds.sizes['seed']} seeds × {ds.sizes['episode']} episodes (the units: "
                     "each episode its own data and map draw); exact attention "
                     f"{fmt_ci(exact)} with a {fmt_bytes(ds['kv_cache_memory'].sel(**at))} KV cache.")
        for name, r, dim in _configs(ds, task, n):
            sel = {**at, "estimator": name, "num_features": r}
            parts = [f"{rule} {fmt_ci(ds[f'{var}_summary'].sel(**sel, rule=rule))} "
                     f"({fmt_bytes(ds['state_memory'].sel(**sel, rule=rule))})" for rule in ds.rule.values]
            word = "−" if _recall(task) else "/"
            paired = [f"{rule} {word} sum {fmt_ci(ds[f'{var}_vs_sum_summary'].sel(**sel, rule=rule))}"
                      for rule in ("delta", "least_squares") if rule in ds.rule.values]
            lines.append(f"{task}, `{name}` r = {dim}: " + "; ".join(parts) + ". Paired per episode: "
                         + ", ".join(paired) + ".")
        lines.append(_best_per_budget(ds, task, n))
    return lines


HEADLINE_MAPS = ("positive_orthogonal", "nystrom_uniform", "taylor2")   # the maps the headline names, if run


def _headline(ds, n) -> str:
    """Recall at n with the stored key as query, sum / delta / least squares on the same features, for the
    :data:`HEADLINE_MAPS` at their largest rank whose least-squares state fits in the KV cache (else their
    smallest)."""
    task = "recall_rho1" if "recall_rho1" in ds.task.values else str(ds.task.values[0])
    var = _var(task)
    at = {"task": task, "num_pairs": n}
    kv = float(ds["kv_cache_memory"].sel(**at))
    parts = []
    for name in [m for m in HEADLINE_MAPS if m in ds.estimator.values] or [str(ds.estimator.values[0])]:
        if not (configs := [c for c in _configs(ds, task, n) if c[0] == name]):
            continue
        fits = [c for c in configs if float(ds["state_memory"].sel(**at, estimator=name, num_features=c[1],
                                                                   rule="least_squares")) <= kv]
        _, r, dim = fits[-1] if fits else configs[0]
        s = ds[f"{var}_summary"].sel(**at, estimator=name, num_features=r)
        parts.append(f"`{name}` r = {dim}: " + ", ".join(
            f"{fmt_ci(s.sel(rule=rule))}" for rule in ("sum", "delta", "least_squares")))
    exact = ds[f"{var}_exact_summary"].sel(**at)
    score = "recall" if _recall(task) else "normalised MSE"
    return (f"{score.capitalize()} at n = {n} ({task}) with the sum, delta and least-squares rules writing the same "
            f"features into the state: " + "; ".join(parts) + f" (exact attention {fmt_ci(exact)}).")


def _compare(task: str, a: xr.DataArray, b: xr.DataArray) -> xr.DataArray:
    """Two states' scores compared per episode on the same episodes: a − b (recall accuracy) or a / b (nMSE)."""
    return (a - b).assign_attrs(comparison="difference") if _recall(task) else (a / b).assign_attrs(comparison="ratio")


def _pairwise(ds, task, rows) -> np.ndarray:
    """Holm-adjusted two-sided p-values ``(K, K)`` of every pair of candidate states ``rows``: the Wilcoxon
    signed-rank test of the per-episode differences (recall accuracy) or log ratios (nMSE) on the same episodes,
    adjusted over all ``K (K − 1) / 2`` pairs (NaN on the diagonal)."""
    values = [ds[_var(task)].sel(**row[4]) for row in rows]
    p = np.full((len(rows), len(rows)), np.nan)
    pairs = list(itertools.combinations(range(len(rows)), 2))
    raw = [float(stats.paired_test(_compare(task, values[i], values[j]).stack(unit=REPLICATES), "unit",
                                   test="wilcoxon")) for i, j in pairs]       # the units: every episode of every seed
    for (i, j), q in zip(pairs, stats.holm(np.asarray(raw))):
        p[i, j] = p[j, i] = q
    return p


def _best_per_budget(ds, task, n) -> str:
    """The best (map, rule) among the states not larger than the KV cache by the point estimate, and which of the
    other candidates it is resolved from: all pairs compared (:func:`_pairwise`, Holm over all pairs, so picking
    the best first does not bias the verdict), with the paired comparison against the runner-up and its interval."""
    var = _var(task)
    kv = float(ds["kv_cache_memory"].sel(task=task, num_pairs=n))
    rows = []
    for name, r, dim in _configs(ds, task, n):
        sel = {"task": task, "estimator": name, "num_features": r, "num_pairs": n}
        for rule in ds.rule.values:
            size = float(ds["state_memory"].sel(**sel, rule=rule))
            s = ds[f"{var}_summary"].sel(**sel, rule=rule)
            rows.append((size, float(s.sel(stat="estimate")), s, f"`{name}` r = {dim} with {rule}",
                         {**sel, "rule": str(rule)}))
    small = [row for row in rows if row[0] <= kv and np.isfinite(row[1])]
    if not small:
        return f"{task}: no map and rule keeps a state smaller than the KV cache ({fmt_bytes(kv)})."
    ranked = sorted(small, key=lambda row: -row[1] if _recall(task) else row[1])
    pick = ranked[0]
    statistic = "mean" if _recall(task) else "median"
    text = (f"{task}: among the {len(ranked)} states not larger than the KV cache ({fmt_bytes(kv)}) the best "
            f"{statistic} is {pick[3]}, {fmt_ci(pick[2])} ({fmt_bytes(pick[0])})")
    if len(ranked) < 2:
        return text + "."
    units = ds.sizes["seed"] * ds.sizes["episode"]
    p = _pairwise(ds, task, ranked)
    second = ranked[1]
    summary = stats.paired_summary(_compare(task, ds[var].sel(**pick[4]), ds[var].sel(**second[4])), REPLICATES,
                                   statistic=statistic)
    tied = [i for i in range(1, len(ranked)) if not (units >= stats.MIN_UNITS and p[0, i] < 0.05)]
    if not tied:
        verdict_text = (f"the best is resolved, better than each of the {len(ranked) - 1} others (largest "
                        f"Holm-adjusted p {fmt(np.nanmax(p[0, 1:]), 2)})")
    else:
        verdict_text = ("the best is not resolved, not separated from " + ", ".join(
            f"{ranked[i][3]} (p = {fmt(p[0, i], 2)})" for i in tied)
            + (f"; resolved better than the other {len(ranked) - 1 - len(tied)}" if len(tied) < len(ranked) - 1
               else ""))
    return (text + f"; the runner-up is {second[3]}, {fmt_ci(second[2])} ({fmt_bytes(second[0])}), paired per episode "
            f"best {'−' if _recall(task) else '/'} runner-up {fmt_ci(summary)}. All "
            f"{len(ranked) * (len(ranked) - 1) // 2} pairs compared by the Wilcoxon signed-rank test over {units} "
            f"episodes, Holm-adjusted: {verdict_text}.")


# ---------------------------------------------------------------------------------------------------- figure
RULE_STYLES = {"sum": {"marker": "o", "linestyle": "-"}, "decay": {"marker": "v", "linestyle": ":"},
               "delta": {"marker": "s", "linestyle": "--"}, "least_squares": {"marker": "D", "linestyle": "-."}}


def plot(ds: xr.Dataset, path) -> None:
    n = int(ds.num_pairs.values.max())
    task_list = [str(t) for t in ds.task.values]
    fig, axes = new_figure(1, len(task_list) + 1, squeeze=False, height=3.6)
    axes = axes[0]
    for ax, task in zip(axes, task_list):
        var = _var(task)
        at = {"task": task, "num_pairs": n}
        for name in ds.estimator.values:
            for rule in ds.rule.values:
                errorbar_summary(ax, ds[f"{var}_summary"].sel(**at, estimator=name, rule=rule),
                                 ds["state_memory"].sel(**at, estimator=name, rule=rule).values,
                                 color=estimator_style(str(name))["color"], markersize=4.5, linewidth=0.9,
                                 **RULE_STYLES[str(rule)])
        kv_cache_marker(ax, float(ds["kv_cache_memory"].sel(**at)), ds[f"{var}_exact_summary"].sel(**at))
        log_axis(ax, unit="bytes", label="state memory (float32)")
        if _recall(task):
            ax.set(ylim=(-0.03, 1.03), ylabel="recall accuracy", title=f"{task.replace('_', ' ')}, n = {n}")
        else:
            ax.axhline(1.0, color="0.5", linestyle=":", linewidth=0.9)
            ax.set(yscale="log", ylabel="normalised MSE", title=f"regression, n = {n}")
    maps = {n: {"color": estimator_style(str(n))["color"], "linewidth": 2} for n in ds.estimator.values}
    proxy_legend(axes[-1], {**maps, **{r: RULE_STYLES[str(r)] for r in ds.rule.values}, "exact (KV cache)": {
        "color": "k", "marker": "*", "markersize": 10, "linestyle": "none"}}, off=True)
    caption = (
        f"Four state-update rules on one axis of memory, n = {n} context pairs: the sum of linear attention, a "
        f"decayed sum (γ = {float(ds['decay_gamma']):g}), the delta rule (β = {float(ds['delta_beta']):g}) and the "
        f"least-squares state (λ = {float(ds['ridge']):g}); colour: feature map, marker and line style: rule, lines "
        f"join a map's feature dimensions. Recall: continuous MQAR, d = {int(ds['key_dim'])} keys, "
        f"d_v = {int(ds['value_dim'])} values, decoded among {int(ds['num_candidates'])} candidates, queries equal to "
        f"(ρ = 1) or at cosine 0.9 from their key, β = {float(ds['beta_factor']):g} ln n; regression: smooth function "
        f"on S^{int(ds['regression_dim']) - 1}, β = {float(ds['regression_beta']):g}, normalised MSE (dotted: "
        f"predicting the mean). Points: mean accuracy or median nMSE over {ds.sizes['seed']} seeds × "
        f"{ds.sizes['episode']} episodes with its 95 % percentile-bootstrap interval over the episodes (the units: "
        "each its own data and map draw); every rule reads the same episodes with the same map draw. Memory: the "
        "rule's state (float32; least squares keeps r² + r·d_v numbers) plus Nyström's landmarks and whitening; star: "
        "exact attention with its KV cache.")
    save_figure(fig, path, caption, title="State-update rules: recall and regression against state memory")


DATA_AXES = ("task", "num_pairs", "seed")
EXPERIMENT = Experiment.from_module(
    __name__, title="Sum, decay, delta and least-squares states: recall and regression against memory",
    description="Can a fixed-size state hold what exact attention recalls, and which way of writing it gets "
                "closest? Grid: task × estimator × num_features × num_pairs × seed; every cell reads its "
                f"{EPISODES} episodes with the rules {', '.join(RULE_NAMES)} (metric dimension rule), on data shared "
                "by all estimators and ranks of the same task, n and seed; exact attention reads them once per data "
                "draw (the reference).",
    replicates="the episodes (seeds × episodes, each its own data and map draw, with its queries)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
