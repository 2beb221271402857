"""Associative recall without training: accuracy against state size, load and query perturbation.

Continuous MQAR (:func:`kernapprox.tasks.associative_recall`): ``n`` pairs of random unit keys (d = 64) and
values (d_v = 64) are written into the memory, every stored key (at most 256 per episode) is queried, and the
read-out is decoded to the nearest of 4096 candidate values (Zoology's V/2). Queries are the stored keys, the keys
perturbed to a cosine ρ of 0.95, 0.9 or 0.85 (a random direction orthogonal to the key), or paraphrases: discrete
keys made of 8 tokens from a shared vocabulary, queried with one token replaced
(:func:`kernapprox.tasks.paraphrase_recall`). The inverse temperature is ``β = beta_factor · ln n`` (``ln n`` puts
about half of exact attention's mass on the match). The episodes come from the data stream of
``(num_pairs, query, seed)``, so every estimator and rank reads the same episodes, and exact attention's read-out of
them is the reference (once per draw). Data-dependent maps are fitted on the context keys only. Maps whose
dimension is fixed by ``d`` (Taylor, ELU+1, DPFP) run only in the ``num_features = 64`` column; landmark methods
with more landmarks than keys are not applicable (NaN). The position-based hybrids are left out: the pairs form a
set and the queries come in random order.

LARA (``lara``, ``lara_mean``) and EVA without its positional window (``eva_w0``, ``eva_mean_w0``) are compared at
equal state bytes: in their rows ``num_features`` is the budget ``r``, and each runs its largest configuration
whose ``state_bytes`` fits the state of FAVOR+/OPRF at ``r`` features (:func:`experiments._icl.sized_readout`; the
configuration and its bytes are stored per cell), at the budgets of the comparison (``MATCHED_BUDGETS``, r = 64
and 256, both below exact attention's KV cache) only; where nothing fits they are not applicable (NaN). Both
build their proposals from the batch of test queries of an episode (non-causal attention by definition), so unlike
the other read-outs they see the other test queries (``fit_on="queries_and_keys"``).
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from experiments import _icl
from experiments._common import add_paired, range_text, verdict
from experiments._icl import style as icl_style
from kernapprox import memory, stats, tasks
from kernapprox.estimators import DPFPFeatures
from kernapprox.plotting import bullets, fmt, fmt_ci, legend_entries, new_figure, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

# label -> (registry name or estimator class, constructor options); unregistered names are left out
ESTIMATORS = {
    "positive_orthogonal": ("positive_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "trig_orthogonal": ("trig_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "elu1": ("elu1", {}),
    "dpfp_nu1": (DPFPFeatures, {"nu": 1}),   # not registered (its normaliser can be exactly zero)
    "nystrom_uniform": ("nystrom_uniform", {}),
    "nystrom_rls": ("nystrom_rls", {}),
    **{label: _icl.SET_CONTEXT_EQUAL_BYTES[label]  # sized by the state budget of FAVOR+ at r (see the module notes)
       for label in ("lara", "lara_mean", "eva_w0", "eva_mean_w0")},
}
SIZED = [label for label in _icl.SET_CONTEXT_EQUAL_BYTES if label in ESTIMATORS]
OPRF = "oprf_orthogonal"
FAVOR = "positive_orthogonal"
RANDOM_MAPS = ("positive_orthogonal", "oprf_orthogonal", "trig_orthogonal")
MATCHED_BUDGETS = (64, 256)    # the budgets (FAVOR+ features) at which the LARA/EVA rows run and are compared
QUERIES = list(_icl.QUERY_COSINES)

GRIDS = {
    "smoke": {"estimator": _icl.available(ESTIMATORS, ["positive_orthogonal", "taylor2", "nystrom_uniform", "lara",
                                                  "eva_w0"]),
              "num_features": [16, 64], "num_pairs": [64], "beta_factor": [2.0], "query": ["key", "paraphrase"],
              "seed": [0, 1]},
    "default": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024, 4096],
                "num_pairs": [256], "beta_factor": [2.0], "query": QUERIES, "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws (~7 min of one core)
    "full": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024, 4096],
             "num_pairs": [256], "beta_factor": [2.0], "query": QUERIES, "seed": list(range(10))},
}
DATA_AXES, REFERENCE_AXES = ("num_pairs", "query", "seed"), ("num_pairs", "beta_factor", "query", "seed")
PARAMETERS = {
    "dim": Parameter(64, long_name="key and value dimension d = d_v", units="1"),
    "num_candidates": Parameter(4096, long_name="candidate values the read-out is decoded against", units="1"),
    "max_queries": Parameter(256, long_name="queries per episode at most", units="1",
                             description="min(n, max_queries) distinct stored pairs are asked for"),
}
AXIS_ATTRS = {"num_pairs": {"long_name": "stored key–value pairs n", "units": "1"},
              "beta_factor": {"long_name": "β / ln n", "units": "1"}, "query": _icl.QUERY_AXIS}

METRICS = {
    "accuracy": Metric(long_name="recall accuracy", units="1",
                       description="per episode, fraction of queries whose normalised attention output is nearest to "
                                   "their own value among the candidates", **_icl.episode_dims()),
    "accuracy_numerator": Metric(long_name="recall accuracy of the unnormalised read-out", units="1",
                                 description="as accuracy, decoding the numerator W φ(q) alone (fast-weight "
                                             "read-out, immune to normaliser sign flips)", **_icl.episode_dims()),
    **_icl.readout_metric_table(),
    "budget_bytes": Metric(long_name="memory budget B(r)", units="byte",
                           description="the larger state of FAVOR+ and OPRF at r features (float32); the LARA and "
                                       "EVA rows run their largest configuration within it"),
}
REFERENCE_METRICS = {
    "accuracy_exact": Metric("exact-attention recall accuracy", "1",
                             "accuracy of exact softmax attention on the same episodes", **_icl.episode_dims()),
    "query_cosine": Metric("mean cosine of a query to its stored key", "1", "per episode (1 for query = key)",
                           **_icl.episode_dims()),
    "state_bytes_exact": Metric(long_name="KV cache of exact attention", units="byte",
                                description="n·(d + d_v) float32 numbers: what exact attention keeps from the context"),
    "num_queries": Metric(long_name="queries per episode", units="1", description="min(n, max_queries)"),
    "beta": Metric(long_name="inverse temperature", units="1", description="β = beta_factor · ln(num_pairs)"),
}


def query_key_cosine(ep: tasks.RecallEpisodes) -> np.ndarray:
    """Mean cosine of each episode's queries to the keys they ask for: ``(B,)``."""
    keys = ep.keys.gather(1, ep.query_slots[..., None].expand(-1, -1, ep.keys.shape[-1]))
    return (ep.queries * keys).sum(-1).mean(-1).double().cpu().numpy()


def draw(params, data_rng, device) -> _icl.EpisodeDraw:
    """The episodes of a ``(num_pairs, query, seed)``, which every estimator, rank and temperature reads."""
    n = params["num_pairs"]
    ep = _icl.recall_episodes(n, params["query"], rng=data_rng, device=device,
                              num_queries=min(n, params["max_queries"]), dim=params["dim"],
                              num_candidates=params["num_candidates"])
    return _icl.EpisodeDraw(ep, ep.queries, ep.keys, ep.values)


def run_cell(params, rng, device, data_rng, data):
    label, r, n, d = params["estimator"], params["num_features"], params["num_pairs"], params["dim"]
    budget = {"budget_bytes": np.float64(memory.budget_bytes(r, d=d, d_v=d, seq_len=n))}
    if not _icl.applicable(ESTIMATORS, label, r, n):
        return not_applicable()
    name, options = ESTIMATORS[label]
    fit_on = "keys"
    if label in SIZED:       # equal state bytes, at the comparison's budgets only: the largest configuration in B(r)
        if r not in MATCHED_BUDGETS or (sized := _icl.sized_readout_arguments(ESTIMATORS, label, r, num_context=n,
                                                                              d=d, d_v=d)) is None:
            return not_applicable(**budget)
        name, options, r, fit_on = sized
    read, exact = data.readouts(name, beta=tasks.log_n_beta(n, params["beta_factor"]), num_features=r, rng=rng,
                                options=options, fit_on=fit_on)
    return {"accuracy": tasks.recall_accuracy(read.output, data.episodes).cpu().numpy(),
            "accuracy_numerator": tasks.recall_accuracy(read.numerator, data.episodes).cpu().numpy(),
            **_icl.readout_metrics(read, exact), **budget}


def run_reference(params, device, data_rng, data):
    beta = tasks.log_n_beta(params["num_pairs"], params["beta_factor"])
    ep, exact = data.episodes, data.exact(beta)
    return {"accuracy_exact": tasks.recall_accuracy(exact.output, ep).cpu().numpy(),
            "query_cosine": query_key_cosine(ep), "state_bytes_exact": np.float64(exact.state_bytes),
            "num_queries": np.float64(ep.queries.shape[1]), "beta": np.float64(beta)}


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds = _icl.summarise_accuracy(ds, "accuracy", "accuracy_exact", ds["num_queries"])
    ds = _icl.summarise_accuracy(ds, "accuracy_numerator", "accuracy_exact", ds["num_queries"])
    ds = _icl.summarise_readout(ds)
    for label, baseline in (("oprf", OPRF), ("favor", FAVOR)):
        if baseline in ds.estimator.values:
            ds = add_paired(ds, "accuracy", baseline, _icl.REPLICATES, op="difference", statistic="mean", label=label)
    cos = ds["query_cosine"].mean(_icl.REPLICATES).assign_attrs(
        long_name="mean cosine of a query to its stored key", units="1", description="mean over seed, episode")
    ds["query_cosine_mean"] = cos
    return ds


# ---------------------------------------------------------------------------------------------------- figure
ACCURACY = "recall accuracy"


def _bars(ax, x, summary, style_of: str, **kw) -> None:
    """``summary``'s estimates at ``x`` with its 95 % interval as bars, in the style of estimator ``style_of``."""
    est, lo, hi = (summary.sel(stat=k).values for k in ("estimate", "lo", "hi"))
    style = icl_style(style_of)
    ax.errorbar(x, est, yerr=[est - lo, hi - est], **{"color": style["color"], "marker": style["marker"],
                                                      "linestyle": style["linestyle"], "capsize": 2, **kw})


def _tradeoff_panel(ax, ds, labels, n, factor):
    acc = ds["accuracy_summary"].sel(num_pairs=n, beta_factor=factor, query="key")
    for label in labels:
        s = acc.sel(estimator=label)
        size = ds["state_bytes"].sel(estimator=label, num_pairs=n, beta_factor=factor, query="key").median("seed")
        keep = np.isfinite(s.sel(stat="estimate").values) & np.isfinite(size.values)
        if not keep.any():
            continue
        _bars(ax, size.values[keep], s.isel(num_features=np.flatnonzero(keep)), label, label=label,
              **({} if keep.sum() > 1 else {"linestyle": "none"}), markersize=7 if keep.sum() == 1 else 4)
    exact = ds["accuracy_exact_summary"].sel(num_pairs=n, beta_factor=factor, query="key")
    kv = float(ds["state_bytes_exact"].sel(num_pairs=n, beta_factor=factor, query="key").median())
    ax.errorbar([kv], [float(exact.sel(stat="estimate"))], marker="*", markersize=12, color="0.3", linestyle="none",
                label="exact (KV cache)")
    ax.axvline(kv, color="0.6", linewidth=0.8, linestyle=":")
    _icl.label_panel(ax, "memory kept from the context (float32; Nyström: state + landmarks + whitening)", ACCURACY,
                     f"query = stored key, n = {n} pairs, β = {factor:g}·ln n", accuracy=True, log2_x=True)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v / 1024:g} kB" if v >= 1024 else f"{v:g} B")   # after the scale


def _load_panel(ax, ds, labels, factor, query="key"):
    """Accuracy against n / r, one line per estimator joining its ranks (the context lengths of the grid)."""
    for label in labels:
        acc = ds["accuracy_summary"].sel(estimator=label, beta_factor=factor, query=query)
        dim = ds["feature_dim"].sel(estimator=label, beta_factor=factor, query=query).median("seed")
        first = True
        for n in acc.num_pairs.values:
            a = acc.sel(num_pairs=n)
            load = float(n) / dim.sel(num_pairs=n).values
            keep = np.isfinite(a.sel(stat="estimate").values) & np.isfinite(load)
            if keep.any():
                _bars(ax, load[keep], a.isel(num_features=np.flatnonzero(keep)), label, linewidth=0.8,
                      label=label if first else None)
                first = False
    load = np.logspace(-6, 8, 300, base=2)
    ax.plot(load, np.minimum(1.0, 1.0 / load), color="0.3", linestyle=(0, (4, 3)), linewidth=1.0,
            label="min(1, r/n)")
    ax.axvline(1.0, color="0.5", linewidth=0.8)
    _icl.label_panel(ax, "load n / r (stored pairs per state feature)", ACCURACY,
                     f"capacity, query = stored key, β = {factor:g}·ln n", accuracy=True, log2_x=True)


def _query_panel(ax, ds, labels, n, factor, r):
    """Accuracy against the query perturbation at rank ``r`` (landmark methods at r = n; fixed maps at their
    dimension)."""
    queries = [str(q) for q in ds["query"].values]
    xs = np.arange(len(queries))
    for label in labels:
        acc = ds["accuracy_summary"].sel(estimator=label, num_pairs=n, beta_factor=factor)
        est_r = acc.sel(stat="estimate")
        usable = [int(v) for v in acc.num_features.values if np.isfinite(est_r.sel(num_features=v).values).all()]
        if not usable:
            continue
        rank = r if r in usable else max(usable)
        dim = float(ds["feature_dim"].sel(estimator=label, num_pairs=n, beta_factor=factor,
                                          num_features=rank).median())
        _bars(ax, xs, acc.sel(num_features=rank), label, label=f"{label} (r = {dim:g})")
    exact = ds["accuracy_exact_summary"].sel(num_pairs=n, beta_factor=factor)
    ax.plot(xs, exact.sel(stat="estimate").values, color="0.3", marker="*", markersize=9, linestyle="--",
            label="exact attention")
    cos = ds["query_cosine_mean"].sel(num_pairs=n, beta_factor=factor).values
    ax.set_xticks(xs, [f"{q}\n(cos {c:.2f})" if q == "paraphrase" else q for q, c in zip(queries, cos)],
                  fontsize=7)
    _icl.label_panel(ax, "query", ACCURACY, f"query perturbation, n = {n}, random maps at r = {r}", accuracy=True)


def matched_cells(ds, n, factor, r) -> dict:
    """Equal state bytes at the budget of FAVOR+ at ``r`` features: ``label -> grid rank`` of the cell each
    estimator is compared at — ``r`` itself for the random maps and the LARA/EVA rows (sized to the budget in the
    cell), and for the others (landmark and fixed maps) their largest grid rank whose state fits the budget."""
    at = {"num_pairs": n, "beta_factor": factor, "query": "key"}
    budget = float(ds["budget_bytes"].sel(num_features=r, **at).max())
    cells = {}
    for label in (str(v) for v in ds.estimator.values):
        acc = ds["accuracy"].sel(estimator=label, **at)
        state = ds["state_bytes"].sel(estimator=label, **at).median("seed")
        if label in SIZED or label in RANDOM_MAPS:
            if bool(acc.sel(num_features=r).notnull().any()):
                cells[label] = r
            continue
        fits = [int(v) for v in ds.num_features.values
                if bool(acc.sel(num_features=v).notnull().any()) and float(state.sel(num_features=v)) <= budget]
        if fits:
            cells[label] = max(fits)
    return cells


def _matched_panel(ax, ds, n, factor, r):
    """Accuracy against the query perturbation, every estimator at equal state bytes (:func:`matched_cells`)."""
    queries = [str(q) for q in ds["query"].values]
    xs = np.arange(len(queries))
    at = {"num_pairs": n, "beta_factor": factor}
    budget = float(ds["budget_bytes"].sel(num_features=r, query="key", **at).max())
    for label, rank in matched_cells(ds, n, factor, r).items():
        kb = float(ds["state_bytes"].sel(estimator=label, num_features=rank, query="key", **at).median()) / 1024
        _bars(ax, xs, ds["accuracy_summary"].sel(estimator=label, num_features=rank, **at), label,
              label=f"{label} ({kb:.3g} KiB)")
    exact = ds["accuracy_exact_summary"].sel(**at)
    ax.plot(xs, exact.sel(stat="estimate").values, color="0.3", marker="*", markersize=9, linestyle="--",
            label="exact attention")
    ax.set_xticks(xs, queries, fontsize=7)
    _icl.label_panel(ax, "query", ACCURACY, accuracy=True)
    ax.set_title(f"equal state bytes: budget of FAVOR+ at r = {r} ({budget / 1024:.3g} KiB)", fontsize=9)
    ax.legend(fontsize=5.5, loc="center right", ncol=2)


def plot(ds: xr.Dataset, path) -> None:
    labels = [str(v) for v in ds.estimator.values]
    unsized = [label for label in labels if label not in SIZED]
    n = int(ds.num_pairs.values.max())
    factor = float(ds.beta_factor.values.max())
    ranks = [int(v) for v in ds.num_features.values]
    r_query = 1024 if 1024 in ranks else max(ranks)
    budgets = [r for r in MATCHED_BUDGETS if r in ranks] or ranks[-1:]
    fig, axes = new_figure(2, 3, squeeze=False, width=19.0, height=8.6)
    _tradeoff_panel(axes[0, 0], ds, labels, n, factor)
    _load_panel(axes[0, 1], ds, unsized, factor)
    _query_panel(axes[1, 0], ds, unsized, n, factor, r_query)
    for ax, r in zip([axes[0, 2], axes[1, 1]], budgets):
        _matched_panel(ax, ds, n, factor, r)
    for ax in [axes[0, 2], axes[1, 1]][len(budgets):]:
        ax.axis("off")
    handles, names = legend_entries([axes[0, 0], axes[0, 1]])
    axes[1, 2].axis("off")
    axes[1, 2].legend(handles, names, loc="center left", ncol=2, frameon=False, fontsize=7.5)
    axes[1, 0].legend(fontsize=6.5, loc="lower left", ncol=2)
    save_figure(fig, path, (
        f"Training-free associative recall (d = d_v = {int(ds['dim'])} random unit keys and values, decoded among "
        f"{int(ds['num_candidates'])} candidate values), n = {n} pairs, β = {factor:g}·ln n. Points: accuracy pooled "
        f"over {ds.sizes['seed']} seeds × {ds.sizes['episode']} episodes (the same episodes for every estimator); "
        "bars: 95 % Clopper–Pearson intervals over the queries. Top left: accuracy against the memory kept from the "
        "context (estimator.state_bytes: the linear state r·(d_v+1) plus, for Nyström, the r·d landmarks and the r×r "
        "whitening, for LARA its draws, key sums and proposal landmarks, for EVA its group summaries; star and dotted "
        "line: exact attention's KV cache n·(d+d_v)). Top middle: accuracy against the load n/r; dashed: the landmark "
        "law min(1, r/n). Bottom left: accuracy as the queries move away from the stored keys (cosine ρ, or a "
        "paraphrase of a discrete 8-token key with one token replaced), random maps at the named r, landmark maps "
        "at their largest r ≤ n, fixed maps at their dimension; stars: exact attention. Top right and bottom "
        "middle, equal state bytes: every estimator within the state budget of FAVOR+ at the named r (the random "
        "maps at r; LARA and EVA, without its positional window, at their largest configuration within it, reading "
        "the episode's test queries as a batch; the landmark and fixed maps at their largest grid rank within it), "
        "its state in the legend; an estimator absent there fits no configuration within the budget."),
        title="Associative recall against state size and query perturbation")


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    n = int(ds.num_pairs.values.max())
    factor = float(ds.beta_factor.values.max())
    at = {"num_pairs": n, "beta_factor": factor}
    acc, cos, lines = ds["accuracy_summary"].sel(**at), ds["query_cosine_mean"].sel(**at), []
    names, queries, ranks = (ds[a].values.tolist() for a in ("estimator", "query", "num_features"))
    r_q = 1024 if 1024 in ranks else max(ranks)
    random_maps = [m for m in ("trig_orthogonal", "positive_orthogonal", "oprf_orthogonal") if m in names]
    if "trig_orthogonal" in random_maps and len(random_maps) > 1 and len(queries) > 1:
        far = min(queries[1:], key=lambda q: float(cos.sel(query=q)))
        trig = {q: acc.sel(estimator="trig_orthogonal", num_features=r_q, query=q) for q in (queries[0], far)}
        others = [m for m in random_maps if m != "trig_orthogonal"]
        lines.append(
            f"At n = {n}, r = {r_q}, β = {factor:g}·ln n, trigonometric features recall {fmt_ci(trig[queries[0]])} "
            f"when the query is the stored key ({queries[0]}) but {fmt_ci(trig[far])} at query cosine "
            f"{fmt(float(cos.sel(query=far)), 2)} ({far}), where " + ", ".join(
                f"`{m}` recalls {fmt_ci(acc.sel(estimator=m, num_features=r_q, query=far))}" for m in others)
            + "; " + _flip_text(ds, r_q, at, random_maps, queries[0], far) + ".")
    if random_maps:
        per_query = []
        for q in queries:
            parts = ", ".join(f"{m.split('_')[0]} {fmt_ci(acc.sel(estimator=m, num_features=r_q, query=q))}"
                              for m in random_maps)
            per_query.append(f"{q} (cos {fmt(float(cos.sel(query=q)), 2)}): {parts}")
        lines.append(f"Recall of the orthogonal random maps at n = {n}, r = {r_q}, β = {factor:g}·ln n, by query: "
                     + "; ".join(per_query) + ". " + _trig_verdict(ds, r_q, at, random_maps, queries))
    lines.extend(_matched_findings(ds, n, factor))
    if nystrom := _icl.labels_with(ESTIMATORS, names, rank_limited_by_points=True):
        est = acc.sel(estimator=nystrom, stat="estimate")
        law = [f"{q}: " + ", ".join(f"r/n = {fmt(r / n, 2)}: {range_text(est.sel(num_features=r, query=q).values)}"
                                    for r in ranks if r <= n) for q in queries]
        lines.append("Nyström maps (fitted on the context keys) against the landmark law min(1, r/n): "
                     + "; ".join(law) + ".")
    exact = ds["accuracy_exact_summary"].sel(**at)
    lines.append("Exact attention on the same episodes: " + "; ".join(
        f"{q} {fmt_ci(exact.sel(query=q), 3)}" for q in queries) + ".")
    if nystrom and n in ranks:
        m = nystrom[0]
        mem = float(ds["state_bytes"].sel(estimator=m, num_features=n, query="key", **at).median())
        kv = float(ds["state_bytes_exact"].sel(query="key", **at).median())
        lines.append(f"At r = n = {n}, `{m}` keeps {fmt(mem / 1024, 3)} kB from the context (state, {n} landmarks and "
                     f"the {n}×{n} whitening, float32) against {fmt(kv / 1024, 3)} kB for exact attention's KV cache "
                     f"({fmt(mem / kv, 2)}×).")
    if fixed := _icl.labels_with(ESTIMATORS, names, fixed_dimension=True):
        cell = {"num_features": _icl.FIXED_DIMENSION_SLOT, "query": "key"}
        lines.append("Fixed maps, query = stored key: " + "; ".join(
            f"`{m}` (r = {fmt(float(ds['feature_dim'].sel(estimator=m, **cell, **at).median()))}) "
            f"{fmt_ci(acc.sel(estimator=m, **cell))}" for m in fixed) + ".")
    if "trig_orthogonal" in names:
        r_lo = min(ranks)
        cell = {"estimator": "trig_orthogonal", "num_features": r_lo, "query": "key", **at}
        norm, num, rate = (ds[f"{v}_summary"].sel(**cell) for v in ("accuracy", "accuracy_numerator",
                                                                   "nonpositive_normalizer_rate"))
        lines.append(f"At r = {r_lo} trigonometric features have {fmt_ci(rate, percent=True)} of normalisers ≤ 0; the "
                     f"normalised read-out recalls {fmt_ci(norm)}, the numerator alone {fmt_ci(num)}.")
    return bullets(lines)


def _configuration(ds, label, rank, at) -> str:
    """``[draws = 84, 64.6 KiB]`` (EVA: ``[86 groups of 3, …]``): the configuration a cell ran and its state."""
    dim = float(ds["feature_dim"].sel(estimator=label, num_features=rank, query="key", **at).median())
    kb = float(ds["state_bytes"].sel(estimator=label, num_features=rank, query="key", **at).median()) / 1024
    if label in SIZED and ESTIMATORS[label][0].startswith("eva"):
        n = int(at["num_pairs"])
        return f"[{dim:g} groups of {-(-n // int(dim))}, {fmt(kb)} KiB]"
    return f"[{'r' if label not in SIZED else 'draws'} = {dim:g}, {fmt(kb)} KiB]"


def _matched_findings(ds, n, factor) -> list[str]:
    """Recall by query at equal state bytes (:func:`matched_cells`), and the LARA/EVA rows against OPRF paired per
    episode."""
    labels = [str(v) for v in ds.estimator.values]
    if not any(label in SIZED for label in labels):
        return []
    at = {"num_pairs": n, "beta_factor": factor}
    queries = [str(q) for q in ds["query"].values]
    acc = ds["accuracy_summary"].sel(**at)
    lines = []
    for r in [r for r in MATCHED_BUDGETS if r in ds.num_features.values]:
        budget = float(ds["budget_bytes"].sel(num_features=r, query="key", **at).max())
        cells = matched_cells(ds, n, factor, r)
        parts = [f"`{label}` {_configuration(ds, label, rank, at)}: " + ", ".join(
            f"{q} {fmt_ci(acc.sel(estimator=label, num_features=rank, query=q))}" for q in queries)
            for label, rank in cells.items()]
        missing = [f"`{label}`" for label in labels if label in SIZED and label not in cells]
        lines.append(f"Equal state bytes, n = {n}, β = {factor:g}·ln n, budget of FAVOR+ at r = {r} "
                     f"({fmt(budget / 1024)} KiB), recall by query [configuration, state kept]: " + "; ".join(parts)
                     + (f"; not _icl.applicable (no configuration within the budget): {', '.join(missing)}"
                        if missing else "")
                     + ". LARA and EVA read each episode's test queries as a batch (their proposals use them).")
    for label, name, title in (("oprf", OPRF, "OPRF"), ("favor", FAVOR, "FAVOR+")):
        if f"accuracy_vs_{label}_summary" not in ds:
            continue
        vs = ds[f"accuracy_vs_{label}_summary"].sel(**at)
        parts = []
        for sized in [sized for sized in labels if sized in SIZED]:
            cells = []
            for r in [r for r in MATCHED_BUDGETS if r in ds.num_features.values]:
                for q in queries:
                    d = vs.sel(estimator=sized, num_features=r, query=q)
                    if np.isfinite(float(d.sel(stat="estimate"))):
                        cells.append(f"r={r} {q} {fmt_ci(d, 2)} {verdict(d, below='below', above='above')}")
            if cells:
                parts.append(f"`{sized}`: " + ", ".join(cells))
        if parts:
            lines.append(f"LARA and EVA minus {title} (`{name}`) at equal state bytes, accuracy per episode on the "
                         "same episodes (mean difference with its bootstrap interval; above/below: the interval "
                         "excludes 0; not resolved: it does not): " + "; ".join(parts) + ".")
    return lines


def _trig_minus_best_positive(ds, r, at, random_maps, query):
    """Per-episode accuracy of trigonometric features minus the better positive map, with its interval."""
    acc = ds["accuracy"].sel(num_features=r, query=query, **at)
    others = [m for m in random_maps if m != "trig_orthogonal"]
    d = acc.sel(estimator="trig_orthogonal") - acc.sel(estimator=others).max("estimator")
    return stats.bootstrap_interval(d, _icl.REPLICATES, "mean")


def _flip_text(ds, r, at, random_maps, near, far) -> str:
    """Whether the paired ranking of trigonometric features against the positive maps flips from ``near`` to
    ``far`` (both differences resolved, opposite signs)."""
    a, b = (_trig_minus_best_positive(ds, r, at, random_maps, q) for q in (near, far))
    sign = [1 if float(s.sel(stat="lo")) > 0 else -1 if float(s.sel(stat="hi")) < 0 else 0 for s in (a, b)]
    flips = sign[0] and sign[1] and sign[0] != sign[1]
    return (f"paired per episode, trigonometric minus the better positive map is {fmt_ci(a)} at {near} and "
            f"{fmt_ci(b)} at {far}: " + ("the ranking of random maps flips" if flips else
                                         "the ranking does not flip with both intervals resolved"))


def _trig_verdict(ds, r, at, random_maps, queries) -> str:
    """Whether trigonometric features beat the positive maps, per query, by the paired per-episode difference."""
    if "trig_orthogonal" not in random_maps or len(random_maps) < 2:
        return ""
    words = []
    for q in queries:
        s = _trig_minus_best_positive(ds, r, at, random_maps, q)
        lo, hi = float(s.sel(stat="lo")), float(s.sel(stat="hi"))
        verdict = "above" if lo > 0 else "below" if hi < 0 else "not separated from"
        words.append(f"{q}: {verdict} ({fmt_ci(s, 2)})")
    return "Trigonometric minus the better positive map, paired per episode: " + "; ".join(words) + "."


EXPERIMENT = Experiment.from_module(
    __name__, title="Training-free associative recall: accuracy against state size and query perturbation")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
