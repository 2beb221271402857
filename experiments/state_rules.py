"""Beyond the sum rule: recall and in-context regression against state memory, for four ways to write the state.

One feature map ``φ`` gives a fixed-size state; the rule (:mod:`kernapprox.rules`) decides what it holds:
the sum of linear attention, a decayed sum (γ = 0.99), the delta rule (β = 1) and the least-squares state
(ridge λ = 0.1). Each cell reads the same episodes with every rule and one draw of the map per episode, so rules
are compared on bit-identical inputs and features (paired), and exact softmax attention reads them too.

Tasks (``task`` axis):

``recall_rho1``, ``recall_rho0.9``
    continuous multi-query associative recall (:func:`kernapprox.tasks.associative_recall`): ``n`` pairs of random
    unit keys (d = 32) and values (d_v = 64), every stored key queried once (queries perturbed to cosine ρ with
    their key for ``rho0.9``), read-outs decoded to the nearest of 4096 candidate values; accuracy per episode.
    Inverse temperature β = 2 ln n.
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
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments._icl import FIXED_DIMENSION_SLOT
from kernapprox import readout, tasks
from kernapprox.plotting import estimator_style, new_figure, save_figure
from kernapprox.sweep import Experiment, Metric, run_cli

KEY_DIM = 32
VALUE_DIM = 64
NUM_CANDIDATES = 4096
BETA_FACTOR = 2.0                 # recall: β = 2 ln n
REGRESSION_DIM = 4
REGRESSION_BETA = 8.0
REGRESSION_QUERIES = 64
LENGTHSCALE = 0.7
NOISE_STD = 0.1
EPISODES = 16
MAX_QUERIES = 256

RULES = {"sum": "sum", "decay": ka.rules.Decay(0.99), "delta": ka.rules.Delta(1.0),
         "least_squares": ka.rules.LeastSquares(0.1)}
TASKS = {"recall_rho1": ("recall", 1.0), "recall_rho0.9": ("recall", 0.9), "regression": ("regression", None)}
ESTIMATORS = ["positive_orthogonal", "taylor2", "nystrom_uniform", "elu1", "trig_orthogonal", "oprf_orthogonal"]

GRIDS = {
    "smoke": {"task": ["recall_rho1", "regression"], "estimator": ["positive_orthogonal", "taylor2", "nystrom_uniform"],
              "num_features": [16, 64], "num_pairs": [32], "seed": [0, 1]},
    "default": {"task": list(TASKS), "estimator": ESTIMATORS[:4], "num_features": [64, 256], "num_pairs": [256],
                "seed": [0, 1, 2, 3, 4]},
    "full": {"task": list(TASKS), "estimator": ESTIMATORS, "num_features": [16, 64, 256, 1024],
             "num_pairs": [64, 256, 1024], "seed": list(range(8))},
}

_PER_RULE = ("rule", "episode")
METRICS = {
    "accuracy": Metric(long_name="recall accuracy", units="1", dims=_PER_RULE,
                       coords={"rule": list(RULES), "episode": list(range(EPISODES))},
                       description="fraction of an episode's queries decoded to their own value among 4096 candidates "
                                   "(recall tasks; NaN for regression)"),
    "nmse": Metric(long_name="normalised MSE", units="1", dims=_PER_RULE,
                   coords={"rule": list(RULES), "episode": list(range(EPISODES))},
                   description="Σ(ŷ−f)²/Σ(f−f̄)² over an episode's queries (regression; NaN for recall)"),
    "accuracy_exact": Metric(long_name="exact-attention recall accuracy", units="1", dims=("episode",),
                             coords={"episode": list(range(EPISODES))},
                             description="exact softmax attention on the same episodes (recall tasks)"),
    "nmse_exact": Metric(long_name="exact-attention normalised MSE", units="1", dims=("episode",),
                         coords={"episode": list(range(EPISODES))},
                         description="exact softmax attention on the same episodes (regression)"),
    "state_bytes": Metric(long_name="state memory", units="byte", dims=("rule",), coords={"rule": list(RULES)},
                          description="float32 bytes a decoder keeps under the rule: its state plus the map's "
                                      "context-dependent fitted values (kernapprox.rules.Rule.state_bytes)"),
    "kv_cache_bytes": Metric(long_name="exact attention memory", units="byte",
                             description="the KV cache of the context, n·(d + d_v) float32 numbers"),
    "feature_dim": Metric(long_name="feature dimension r", units="1", description="r of the fitted map"),
}


# ------------------------------------------------------------------------------------------------------ data
def _episodes(task, n, data_rng, device):
    kind, rho = TASKS[task]
    if kind == "recall":
        return tasks.associative_recall(n, dim=KEY_DIM, value_dim=VALUE_DIM, num_candidates=NUM_CANDIDATES,
                                        num_queries=min(n, MAX_QUERIES), query_cosine=rho, batch=EPISODES,
                                        rng=data_rng, device=device)
    return tasks.smooth_regression(n, dim=REGRESSION_DIM, num_queries=REGRESSION_QUERIES, lengthscale=LENGTHSCALE,
                                   noise_std=NOISE_STD, batch=EPISODES, rng=data_rng, device=device)


def _qkv(task, ep):
    if TASKS[task][0] == "recall":
        return ep.queries, ep.keys, ep.values
    return ep.x_query, ep.x, ep.y


def _beta(task, n):
    return tasks.log_n_beta(n, BETA_FACTOR) if TASKS[task][0] == "recall" else REGRESSION_BETA


def _score(task, outputs, ep):
    """Per-episode accuracy (recall) or normalised MSE (regression) of outputs ``(B, n_q, d_v)``."""
    if TASKS[task][0] == "recall":
        return tasks.recall_accuracy(outputs, ep).cpu().numpy()
    return tasks.normalized_mse(outputs, ep).cpu().numpy()


_DATA: OrderedDict = OrderedDict()      # one data draw (episodes, map seeds, exact scores) per data stream


def _data(params, data_rng, device):
    """Episodes, the map seed of each episode and exact attention's scores, drawn once per data stream (the
    cells of the other estimators, ranks and rules of the same task, n and seed reuse them)."""
    seq = data_rng.bit_generator.seed_seq
    key = (seq.entropy, tuple(seq.spawn_key), str(device))
    if key not in _DATA:
        task, n = params["task"], params["num_pairs"]
        ep = _episodes(task, n, data_rng, device)
        seeds = data_rng.integers(0, 2**63 - 1, size=EPISODES)
        q, k, v = _qkv(task, ep)
        exact = _score(task, ka.softmax_attention(q, k, v, scale=_beta(task, n)), ep)
        _DATA[key] = (ep, seeds, exact)
        while len(_DATA) > 4:
            _DATA.popitem(last=False)
    return _DATA[key]


def _applicable(name, r, n):
    caps = ka.capabilities(name)
    if caps.fixed_dimension:
        return r == FIXED_DIMENSION_SLOT
    return not (caps.rank_limited_by_points and r > n)


def _nan(shape):
    return np.full(shape, np.nan)


def run_cell(params, rng, device, data_rng):
    task, name, r, n = params["task"], params["estimator"], params["num_features"], params["num_pairs"]
    if not _applicable(name, r, n):
        return {"accuracy": _nan((len(RULES), EPISODES)), "nmse": _nan((len(RULES), EPISODES)),
                "accuracy_exact": _nan(EPISODES), "nmse_exact": _nan(EPISODES), "state_bytes": _nan(len(RULES)),
                "kv_cache_bytes": np.float64(np.nan), "feature_dim": np.float64(np.nan)}
    ep, seeds, exact = _data(params, data_rng, device)
    q, k, v = _qkv(task, ep)
    beta = _beta(task, n)
    scores = np.empty((len(RULES), EPISODES))
    for b in range(EPISODES):
        est = readout.build_estimator(name, beta=beta, num_features=r, rng=int(seeds[b])).fit(k[b])
        outs = torch.stack([ka.linear_attention(q[b], k[b], v[b], est, False, "parallel", rule=rule)
                            for rule in RULES.values()])                                   # (rules, n_q, d_v)
        one = ep._replace(**{field: getattr(ep, field)[b:b + 1].expand(len(RULES), *getattr(ep, field).shape[1:])
                             for field in ("candidates", "targets")}) if TASKS[task][0] == "recall" else \
            ep._replace(f_query=ep.f_query[b:b + 1].expand(len(RULES), *ep.f_query.shape[1:]))
        scores[:, b] = _score(task, outs, one)
    recall = TASKS[task][0] == "recall"
    d_v = v.shape[-1]
    return {
        "accuracy": scores if recall else _nan(scores.shape),
        "nmse": _nan(scores.shape) if recall else scores,
        "accuracy_exact": exact if recall else _nan(EPISODES),
        "nmse_exact": _nan(EPISODES) if recall else exact,
        "state_bytes": np.array([ka.rules.resolve_rule(rule).state_bytes(est, d_v) for rule in RULES.values()],
                                dtype=np.float64),
        "kv_cache_bytes": np.float64(n * (k.shape[-1] + d_v) * 4),
        "feature_dim": np.float64(est.num_features),
    }


# ------------------------------------------------------------------------------------------------ summaries
LEVEL = 0.95
RESAMPLES = 2000


def _interval(values: np.ndarray, statistic=np.mean, seed: int = 0) -> tuple[float, float, float]:
    """``(estimate, lo, hi)``: the statistic of the valid values and its 95 % percentile-bootstrap interval
    (2000 resamples from ``default_rng([seed, m])`` for ``m`` valid values: deterministic)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    idx = np.random.default_rng([seed, x.size]).integers(0, x.size, size=(RESAMPLES, x.size))
    boot = statistic(x[idx], axis=1)
    lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(statistic(x)), float(lo), float(hi)


def summary(ds: xr.Dataset, var: str, **sel) -> tuple[float, float, float]:
    """Mean accuracy (recall) or median normalised MSE (regression) over seeds × episodes, with its interval."""
    values = ds[var].sel(**sel).values
    return _interval(values, np.mean if var.startswith("accuracy") else np.median)


def _fmt(triple, digits=2) -> str:
    est, lo, hi = triple
    return f"{est:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _configs(ds, task, n):
    """(estimator, r, fitted dimension) of the applicable cells, in grid order."""
    out = []
    for name in ds.estimator.values:
        for r in ds.num_features.values:
            dim = ds.feature_dim.sel(task=task, estimator=name, num_features=r, num_pairs=n)
            if np.isfinite(dim.values).any():
                out.append((str(name), int(r), int(np.nanmax(dim.values))))
    return out


def findings(ds: xr.Dataset) -> str:
    """Markdown bullets computed from the dataset: each rule's score per map and state size with 95 % intervals
    (percentile bootstrap over seeds × episodes), the paired gain of least squares and delta over the sum, and
    the state memory."""
    lines = []
    n = int(ds.num_pairs.values.max())
    seeds, episodes = ds.sizes["seed"], ds.sizes["episode"]
    for task in ds.task.values:
        recall = TASKS[str(task)][0] == "recall"
        var = "accuracy" if recall else "nmse"
        what = (f"recall accuracy (mean over {seeds} seeds × {episodes} episodes)" if recall else
                f"normalised MSE (median over {seeds} seeds × {episodes} episodes)")
        exact = summary(ds, f"{var}_exact", task=task, num_pairs=n)
        lines.append(f"- **{task}, n = {n}**: {what}, 95 % bootstrap intervals; exact attention "
                     f"{_fmt(exact)} with a {ds.kv_cache_bytes.sel(task=task, num_pairs=n).max().item() / 1024:.1f} "
                     "KiB KV cache.")
        for name, r, dim in _configs(ds, task, n):
            sel = dict(task=task, estimator=name, num_features=r, num_pairs=n)
            parts = []
            for rule in ds.rule.values:
                kib = float(np.nanmax(ds.state_bytes.sel(**sel, rule=rule).values)) / 1024
                parts.append(f"{rule} {_fmt(summary(ds, var, **sel, rule=rule))} ({kib:.1f} KiB)")
            gains = []
            for rule in ("delta", "least_squares"):
                if rule in ds.rule.values:
                    diff = ds[var].sel(**sel, rule=rule) - ds[var].sel(**sel, rule="sum")
                    gains.append(f"{rule} − sum {_fmt(_interval(diff.values, np.mean if recall else np.median))}")
            lines.append(f"  - {name}, r = {dim}: " + "; ".join(parts) + ". Paired: " + ", ".join(gains) + ".")
        best = _best_per_budget(ds, task, n, var, recall)
        if best:
            lines.append("  - " + best)
    return "\n".join(lines)


def _best_per_budget(ds, task, n, var, recall) -> str:
    """The best (map, rule) at each state budget below the KV cache, by the point estimate."""
    kv = float(ds.kv_cache_bytes.sel(task=task, num_pairs=n).max())
    rows = []
    for name, r, dim in _configs(ds, task, n):
        sel = dict(task=task, estimator=name, num_features=r, num_pairs=n)
        for rule in ds.rule.values:
            size = float(np.nanmax(ds.state_bytes.sel(**sel, rule=rule).values))
            rows.append((size, summary(ds, var, **sel, rule=rule), f"{name} r = {dim} with {rule}"))
    small = [row for row in rows if row[0] <= kv]
    if not small:
        return f"no map and rule keeps a state smaller than the KV cache ({kv / 1024:.1f} KiB)"
    pick = max(small, key=lambda row: row[1][0]) if recall else min(small, key=lambda row: row[1][0])
    return (f"best state not larger than the KV cache ({kv / 1024:.1f} KiB): {pick[2]}, {_fmt(pick[1])} "
            f"({pick[0] / 1024:.1f} KiB)")


# ---------------------------------------------------------------------------------------------------- figure
RULE_MARKERS = {"sum": "o", "decay": "v", "delta": "s", "least_squares": "D"}
RULE_LINES = {"sum": "-", "decay": ":", "delta": "--", "least_squares": "-."}


def plot(ds: xr.Dataset, path) -> None:
    n = int(ds.num_pairs.values.max())
    task_list = [str(t) for t in ds.task.values]
    fig, axes = new_figure(1, len(task_list) + 1, squeeze=False, height=3.6)
    axes = axes[0]
    for ax, task in zip(axes, task_list):
        recall = TASKS[task][0] == "recall"
        var = "accuracy" if recall else "nmse"
        for name in ds.estimator.values:
            color = estimator_style(str(name))["color"]
            for rule in ds.rule.values:
                xs, ys, los, his = [], [], [], []
                for r in ds.num_features.values:
                    sel = dict(task=task, estimator=name, num_features=r, num_pairs=n, rule=rule)
                    size = ds.state_bytes.sel(**sel).values
                    if not np.isfinite(size).any():
                        continue
                    est, lo, hi = summary(ds, var, **sel)
                    xs.append(float(np.nanmax(size)))
                    ys.append(est)
                    los.append(est - lo)
                    his.append(hi - est)
                if xs:
                    ax.errorbar(xs, ys, yerr=[los, his], color=color, marker=RULE_MARKERS.get(str(rule), "x"),
                                markersize=4.5, linewidth=0.9, capsize=2,
                                linestyle=RULE_LINES.get(str(rule), "-") if len(xs) > 1 else "none")
        est, lo, hi = summary(ds, f"{var}_exact", task=task, num_pairs=n)
        kv = float(ds.kv_cache_bytes.sel(task=task, num_pairs=n).max())
        ax.errorbar([kv], [est], yerr=[[est - lo], [hi - est]], color="k", marker="*", markersize=10,
                    linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state memory (bytes, float32)")
        if recall:
            ax.set_ylim(-0.03, 1.03)
            ax.set_ylabel("recall accuracy")
            ax.set_title(f"{task.replace('_', ' ')}, n = {n}")
        else:
            ax.set_yscale("log")
            ax.axhline(1.0, color="0.5", linestyle=":", linewidth=0.9)
            ax.set_ylabel("normalised MSE")
            ax.set_title(f"regression, n = {n}")
    legend = axes[-1]
    legend.axis("off")
    for name in ds.estimator.values:
        legend.plot([], [], color=estimator_style(str(name))["color"], linewidth=2, label=str(name))
    for rule in ds.rule.values:
        legend.plot([], [], color="0.3", marker=RULE_MARKERS.get(str(rule), "x"),
                    linestyle=RULE_LINES.get(str(rule), "-"), label=str(rule))
    legend.plot([], [], color="k", marker="*", markersize=10, linestyle="none", label="exact (KV cache)")
    legend.legend(loc="center", frameon=False)
    caption = (
        f"Four state-update rules on one axis of memory, n = {n} context pairs: the sum of linear attention, a "
        f"decayed sum (γ = {RULES['decay'].gamma}), the delta rule (β = {RULES['delta'].beta}) and the "
        f"least-squares state (λ = {RULES['least_squares'].ridge}); colour: feature map, marker and line style: "
        "rule, lines join a map's feature dimensions. Recall: continuous MQAR, d = 32 keys, d_v = 64 values, "
        "decoded among 4096 candidates, queries equal to (ρ = 1) or at cosine 0.9 from their key, β = 2 ln n; "
        "regression: smooth function on S³, β = 8, normalised MSE (dotted: predicting the mean). Points: mean "
        f"accuracy or median nMSE over {ds.sizes['seed']} seeds × {ds.sizes['episode']} episodes with 95 % "
        "percentile-bootstrap intervals; every rule reads the same episodes with the same map draw. Memory: the "
        "rule's state (float32; least squares keeps r² + r·d_v numbers) plus Nyström's landmarks and whitening; "
        "star: exact attention with its KV cache.")
    save_figure(fig, path, caption,
        title="State-update rules: recall and regression against state memory")


EXPERIMENT = Experiment(
    name="state_rules", title="Sum, decay, delta and least-squares states: recall and regression against memory",
    description="Can a fixed-size state hold what exact attention recalls, and which way of writing it gets "
                "closest? Grid: task × estimator × num_features × num_pairs × seed; every cell reads its "
                f"{EPISODES} episodes with the rules {', '.join(RULES)} (metric dimension rule) and with exact "
                "attention, on data shared by all estimators and ranks of the same task, n and seed.",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot, data_axes=("task", "num_pairs", "seed"))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
