"""all-MiniLM-L6-v2 end to end on approximate attention: what sentence retrieval loses, per estimator family, rank
and placement of exact layers; learned (distilled) maps against random, data-dependent and Nyström ones.

Each cell runs the real model (:mod:`kernapprox.substitution`) on held-out paragraphs of Python's help text
(:func:`~kernapprox.substitution.retrieval_corpus`: first sentence = query, rest = document) with the attention of
every layer (``search = False``), or of the hybrid placements of exact layers (``search = True``: every subset of
at most ``search_max_exact`` exact layers, every single substituted layer and the naive first/last ``k``:
:func:`~kernapprox.substitution.hybrid_placements`, for the estimators named by ``search_estimators`` at
``r = search_rank``), replaced by one estimator at ``r`` features per head, and compares with the exact model on
the same token ids (paired): top-1 and top-10 agreement of each query's nearest documents, the embedding cosine,
the relative error of the final hidden states and of each layer's attention output, and the attention memory per
text (estimators' ``state_bytes`` per head; exact layers: their KV cache at the text's length). ``search = False``
cells at ``r = heldout_rank`` (and the fixed-dimension maps' cells) also measure each head's held-out
attention-output error: maps fitted on the extraction windows 0–1, evaluated on windows 2–3 (512 tokens each;
never in-sample).
The exact model's own retrieval and KV caches are the study's :class:`~kernapprox.sweep.Reference`.

Families (:data:`FAMILIES`, the study's one estimator table): random (``positive_orthogonal``, FAVOR+),
data-dependent random (``oprf_orthogonal``), Nyström (``nystrom_kmeans``), Taylor (``taylor2``, dimension fixed
by ``d``: run at ``r = 32`` cells only, its true dimension stored in ``feature_dimension``) and learned
(``hedgehog``: trained per ``(layer, head)`` for ``train_steps`` steps on windows 0–1, kept in the fitted-maps
cache, :mod:`kernapprox.surgery.maps`). Data-dependent
closed-form maps are fitted per ``(layer, head)`` on the running input (all texts' real tokens, at most
``fit_points``); learned maps never see the input. ``seed`` indexes the random draws (projections,
initialisations, k-means seeds): cells sharing ``paragraphs`` and ``seed`` share the root seed, so the
``search = False`` and ``search = True`` cells of one family draw the same maps.

Units of replication. ``seed`` is the independent draw of every map (projections, initialisations, k-means); the
36 (layer, head) pairs of one seed share it, so they are not independent: the held-out head errors are summarised
per seed (the mean of the log error over its heads) and their intervals are cluster bootstraps over seeds, each seed
resampled with all its heads (:func:`kernapprox.stats.cluster_interval`); a verdict against a baseline map needs
at least :data:`kernapprox.stats.MIN_UNITS` seeds and the exact paired test of the per-seed means
(:func:`kernapprox.stats.paired_test`), else it is "not resolved (k units)". Retrieval is measured on one corpus
whose queries every seed reads (queries crossed with seeds): agreement is the mean over queries of each query's
mean over the seeds, with a bootstrap over the queries (the unit: the query), conditional on the seeds' draws;
placements are compared by the Wilcoxon signed-rank test over queries, Holm-adjusted over every comparison of the
family (all pairs of placements with the same number of exact layers, or every placement against none exact), so
naming the best first does not bias its verdict. Per-seed model quantities (embedding cosine, final-state and
per-layer errors) are the median over seeds with the range of the seeds (:func:`kernapprox.stats.range_summary`),
not a 95 % interval. The exact model's accuracy: a Clopper–Pearson proportion over its queries (deterministic).
"""


from __future__ import annotations

import warnings

import numpy as np
import xarray as xr
from matplotlib import ticker

from experiments._common import add_proportion, registered
from kernapprox import plotting, real, stats
from kernapprox.plotting import bullets, fmt, fmt_ci
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

REAL_REASON = real.unavailable_reason()
if REAL_REASON is not None:
    warnings.warn(f"model_substitution needs the real-model extra: {REAL_REASON}", stacklevel=1)
else:
    from kernapprox import substitution as sub

# The study's estimators, one table: registry name -> family (unregistered names are left out).
FAMILIES = {"positive_orthogonal": "random", "oprf_orthogonal": "data-dependent random",
            "nystrom_kmeans": "Nyström", "taylor2": "Taylor", "hedgehog": "learned"}
ESTIMATORS = registered(*FAMILIES)
LEARNED = ("hedgehog",)                   # trained on the extraction windows, never on the input
FIXED_DIMENSION = {"taylor2": 32}          # estimator -> the num_features cell it runs in
HELDOUT_BASELINES = ("positive_orthogonal", "oprf_orthogonal", "nystrom_kmeans")   # paired against the others
# learned-map training / calibration data: every 4th query of each 64-token segment (its softmax over all 64 keys)
TRAIN = dict(windows=(0, 1), segment=64, query_stride=4)
NUM_LAYERS, NUM_HEADS = real.NUM_LAYERS, real.NUM_HEADS
NONE_EXACT = "E:-"
# placement label -> number of exact layers, for every placement
EXACT_LAYERS = {sub.placement_label(p): len(p) for p in sub.all_placements()} if REAL_REASON is None else {"E:-": 0}
PLACEMENTS = list(EXACT_LAYERS)
QUERIES = "query"

GRIDS = {
    "smoke": {"estimator": [e for e in ("hedgehog",) if e in ESTIMATORS] or ["positive_orthogonal"],
              "num_features": [32, 64], "search": [False, True], "paragraphs": [12], "train_steps": [4],
              "seed": [0]},
    # r from d/2 to 2d (head dimension d = 32); CPU budget about 200 s in one process, learned maps trained (cold)
    "default": {"estimator": ESTIMATORS, "num_features": [16, 32, 64], "search": [False, True],
                "paragraphs": [32], "train_steps": [30], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws
    "full": {"estimator": ESTIMATORS, "num_features": [16, 32, 64], "search": [False, True],
             "paragraphs": [32], "train_steps": [30], "seed": list(range(10))},
}
PARAMETERS = {
    "fit_points": Parameter(1024, "tokens per head a data-dependent map is fitted on at most", "1",
                            "every ceil(N / fit_points)-th of the N real tokens of the input"),
    "learning_rate": Parameter(0.05, "learning rate of the learned maps' training (Adam)", "1"),
    "heldout_rank": Parameter(64, "r at which each head's held-out attention error is measured", "1",
                              "fixed-dimension maps: in their own cell"),
    "search_rank": Parameter(32, "r of the hybrid placement search", "1"),
    "search_estimators": Parameter("hedgehog", "estimators whose hybrid placements are searched", "1",
                                   "comma-separated registry names"),
    "search_max_exact": Parameter(2, "exact layers per searched placement at most", "1", "besides single substituted "
                                  "layers and the naive first/last k (kernapprox.substitution.hybrid_placements)"),
}
AXIS_ATTRS = {axis: {"long_name": long_name, "units": "1"} for axis, long_name in {
    "num_features": "features per head r", "search": "hybrid placements searched (else every layer substituted)",
    "paragraphs": "held-out paragraphs of the retrieval corpus", "train_steps": "training steps of the learned maps",
    "seed": "replicate (independent draw of every map: projections, initialisations, k-means)"}.items()}

_PL = {"dims": ("placement",), "coords": {"placement": PLACEMENTS}}              # one value per placement
_PQ = {**_PL, "dims": ("placement", QUERIES)}                                      # ... and per query
_LAYERS = {"layer": list(range(NUM_LAYERS))}
_PLL = {"dims": ("placement", "layer"), "coords": {**_PL["coords"], **_LAYERS}}  # ... and per layer
METRICS = {
    "top1_agreement": Metric("top-1 agreement with the exact model", "1", "per query: 1 if the nearest document "
                             "under the substituted model is the exact model's", **_PQ),
    "top10_agreement": Metric("top-10 agreement with the exact model", "1",
                              "per query: |top-10 documents (substituted) ∩ top-10 (exact)| / 10", **_PQ),
    "self_hit": Metric("retrieval accuracy", "1", "per query: 1 if the nearest document is the query's own paragraph "
                       "(substituted model)", **_PQ),
    "embedding_cosine": Metric("embedding cosine to the exact model", "1",
                               "mean over queries and documents of cos(e, e_exact)", **_PL),
    "final_state_error": Metric("relative error of the final hidden states", "1",
                                "sqrt(Σ‖h − h_exact‖² / Σ‖h_exact‖²) over the real tokens of all texts", **_PL),
    "hidden_error": Metric("relative error of each layer's output states", "1",
                           "as final_state_error, after each layer", **_PLL),
    "layer_attention_error": Metric("relative error of a substituted layer's attention output", "1",
                                    "sqrt(Σ‖ŷ−y‖²/Σ‖y‖²) against exact attention on the same q, k, v (the layer's "
                                    "own error on the activations it sees); NaN for exact layers", **_PLL),
    "attention_bytes": Metric("attention memory per text", "byte",
                              "mean over texts of Σ_layers Σ_heads (state_bytes, or the KV cache n·(d+d_v)·4 of "
                              "an exact layer at the text's n)", **_PL),
    "heldout_error": Metric("held-out attention-output error per head", "1",
                            "maps fitted on extraction windows 0–1, evaluated on windows 2–3 (non-causal, 512 "
                            "tokens): sqrt(Σ‖ŷ−y‖²/Σ‖y‖²); cells at r = heldout_rank and fixed-dimension maps",
                            dims=("layer", "head"), coords={**_LAYERS, "head": list(range(NUM_HEADS))}),
    "feature_dimension": Metric("feature dimension per head", "1", "the estimator's r (its own for fixed maps)"),
}
REFERENCE_METRICS = {
    "exact_self_hit": Metric("retrieval accuracy of the exact model", "1", "per query: 1 if the exact model's "
                             "nearest document is the query's own paragraph", dims=(QUERIES,)),
    "exact_attention_bytes": Metric("attention memory per text of the exact model", "byte",
                                    "mean over texts of the six layers' KV caches, n·(d+d_v)·4 bytes per head"),
}


def _nan_result(num_queries: int) -> dict:
    return {name: np.full([len(metric.coords[d]) if metric.coords and d in metric.coords else num_queries
                           for d in metric.dims], np.nan) for name, metric in METRICS.items()}


def applicable(name: str, num_features: int, search: bool, params) -> bool:
    """Whether a cell runs: fixed-dimension maps only in their rank cell, the search only for the searched
    estimators (``search_estimators``) at ``search_rank``."""
    if name in FIXED_DIMENSION and num_features != FIXED_DIMENSION[name]:
        return False
    searched = [estimator.strip() for estimator in params["search_estimators"].split(",")]
    return not search or (name in searched and num_features == params["search_rank"])


def draw(params, data_rng, device) -> tuple:
    """The data draw of a ``(paragraphs, seed)``: ``(setup, root)``, the corpus, its tokenised input and the exact
    model's run on it, and the root seed of the seed's random draws (projections, initialisations, k-means seeds)."""
    if REAL_REASON is not None:
        raise RuntimeError(f"model_substitution needs the real-model extra: {REAL_REASON}")
    setup = sub.retrieval_setup(params["paragraphs"], min_document_tokens=16, max_document_tokens=64,
                                bucket_tokens=1024, device=str(device))
    return setup, int(data_rng.integers(2**63))


def substitution_for(name: str, num_features: int, root: int, params):
    """The :class:`~kernapprox.substitution.Substitution` a cell runs (learned maps trained and cached first)."""
    r = None if name in FIXED_DIMENSION else num_features
    if name in LEARNED:
        options = {"num_steps": params["train_steps"], "learning_rate": params["learning_rate"]}
        return sub.Substitution(name, num_features=r, rng=root, options=options).fitted_on(sub.Windows(**TRAIN))
    return sub.Substitution(name, num_features=r, rng=root, fit="input", fit_points=params["fit_points"])


def run_cell(params, rng, device, data_rng, data):
    name, r, search = params["estimator"], params["num_features"], params["search"]
    if not applicable(name, r, search, params):
        return not_applicable()
    setup, root = data                                  # root: shared by every cell of this (paragraphs, seed)
    out = _nan_result(len(setup.corpus))                # filled per placement as the runs come
    subst = substitution_for(name, r, root, params)

    def record(exact_layers, run):
        i = PLACEMENTS.index(sub.placement_label(exact_layers))
        for var, value in sub.compare(run, setup).items():
            out[var][i] = value
        out["attention_bytes"][i] = float(np.mean(sub.placement_bytes(subst, exact_layers, setup.inputs.lengths)))

    if search:
        sub.search_placements(setup.model, setup.inputs, subst, record, reference=setup.exact,
                              placements=sub.hybrid_placements(params["search_max_exact"]))
    else:
        record((), sub.encode(setup.model, setup.inputs, sub.plan(subst), reference=setup.exact))
        if r == params["heldout_rank"] or name in FIXED_DIMENSION:
            maps = subst.maps if subst.maps is not None else sub.fit_maps(
                sub.Substitution(name, num_features=subst.num_features, rng=root), sub.Windows(**TRAIN))
            out["heldout_error"] = sub.heldout_attention_error(maps)
    out["feature_dimension"] = float(subst.feature_dimension)
    return out


def run_reference(params, device, data_rng, data):
    """The exact model on the corpus: its own retrieval accuracy and its KV caches (deterministic)."""
    setup = data[0]
    return {"exact_self_hit": np.asarray(setup.exact_hits, dtype=np.float64),
            "exact_attention_bytes": float(np.mean(sub.placement_bytes(None, range(NUM_LAYERS), setup.inputs.lengths)))}


# ------------------------------------------------------------------------------------------------ summaries
UNIT, HEADS = "seed", ("layer", "head")     # a seed's draw of the maps is shared by its heads


def _geometric(log: xr.DataArray, description: str, **attrs) -> xr.DataArray:
    """exp of the mean of ``log`` over seeds × heads with its cluster-bootstrap interval over seeds (each seed with
    all its heads): a geometric mean (of errors or of paired ratios)."""
    summary = stats.cluster_interval(log, UNIT, HEADS)
    summary.loc[{"stat": ["estimate", "lo", "hi"]}] = np.exp(summary.sel(stat=["estimate", "lo", "hi"]))
    return summary.assign_attrs(statistic="geometric mean", units="1", description=description + ": "
                                + summary.attrs["interval"], **attrs)


def summarise(ds: xr.Dataset) -> xr.Dataset:
    """Agreement: per query the mean over seeds, then the mean over queries with its bootstrap interval over
    queries. Errors and cosines per seed: the median and range of the seeds. Held-out head errors: geometric means
    over seeds × heads with cluster-bootstrap intervals over seeds, and the paired ratios against each baseline map
    (geometric mean, the share of heads below 1, the Wilcoxon and sign p-values of the per-seed means of the log
    ratio). The exact model's accuracy: a Clopper–Pearson proportion."""
    for name in ("top1_agreement", "top10_agreement", "self_hit"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)              # cells that do not run: all NaN
            per_query = ds[name].mean("seed")
        summary = stats.bootstrap_interval(per_query, QUERIES, "mean")
        ds[f"{name}_summary"] = summary.assign_attrs({
            "long_name": ds[name].attrs["long_name"], "units": "1", "unit": QUERIES,
            "description": f"{name}: mean over seeds per query, then over queries: " + summary.attrs["interval"]
                           + " (of the per-query means; the unit is the query, conditional on the seeds' map draws)"})
    for name in ("final_state_error", "layer_attention_error", "embedding_cosine"):
        summary = stats.range_summary(ds[name], UNIT)
        summary.attrs["description"] = f"{name}: median over seeds; lo, hi: " + summary.attrs["interval"]
        ds[f"{name}_summary"] = summary
    with np.errstate(divide="ignore", invalid="ignore"):
        ds["heldout_error_summary"] = _geometric(np.log(ds["heldout_error"]), "geometric mean of heldout_error over "
                                                 "seeds × heads", long_name=ds["heldout_error"].attrs["long_name"])
        for baseline in [b for b in HELDOUT_BASELINES if b in ds.estimator.values]:
            ratio = stats.paired(ds["heldout_error"], "estimator", baseline, op="ratio")
            ratio.attrs.update(long_name=f"held-out error / {baseline}'s on the same head and seed", units="1",
                               description=f"per (layer, head, seed): heldout_error / heldout_error of {baseline}")
            summary = _geometric(np.log(ratio), f"geometric mean of the ratio to {baseline} over seeds × heads",
                                 neutral=1.0, long_name=ratio.attrs["long_name"], comparison="ratio")
            below = stats.cluster_interval((ratio < 1).where(ratio.notnull()).astype(float), UNIT, HEADS)
            summary.loc[{"stat": ["below", "below_lo", "below_hi"]}] = below.sel(stat=["estimate", "lo", "hi"]).values
            summary.attrs["interval"] += ("; below, below_lo, below_hi: the share of (layer, head) entries with ratio "
                                          "< 1 and its cluster interval over seeds")
            ds[f"heldout_error_vs_{baseline}"], ds[f"heldout_error_vs_{baseline}_summary"] = ratio, summary
            for test in ("wilcoxon", "sign"):
                ds[f"heldout_error_vs_{baseline}_p_{test}"] = stats.paired_test(ratio, UNIT, HEADS, test=test)
    return add_proportion(ds, "exact_self_hit", ds["exact_self_hit"].isel(seed=0, drop=True), 1.0, (QUERIES,))


# ------------------------------------------------------------------------------------------------- findings
RESOLVED = {"higher": "resolved higher", "lower": "resolved lower"}     # stats.verdict's words in the sentences


def _all_layers(ds, var, est, r):
    """``<var>`` (a summary) of the all-layer substitution of ``est`` at ``r`` (its own cell for fixed maps), or
    None where that cell is not in the grid or did not run."""
    if FIXED_DIMENSION.get(est, r) not in ds.num_features.values:
        return None
    s = ds[var].sel(estimator=est, num_features=FIXED_DIMENSION.get(est, r), search=False,
                    placement=NONE_EXACT).squeeze(drop=True)
    return s if _ran(s) else None


def _all_layer_cells(ds, var, est, ranks) -> list[tuple[int, xr.DataArray]]:
    """``(r, <var> summary)`` of each all-layer substitution of ``est`` in ``ranks`` that applies and ran."""
    return [(r, s) for r in ranks
            if applicable(est, r, False, _parameters(ds)) and (s := _all_layers(ds, var, est, r)) is not None]


def _ran(summary) -> bool:
    return bool(np.isfinite(float(summary.sel(stat="estimate"))))


def _dim(ds, est, r) -> int:
    return int(np.nanmax(ds["feature_dimension"].sel(estimator=est, num_features=FIXED_DIMENSION.get(est, r)).values))


def _kib(ds, est, r, search: bool = False, placement: str = NONE_EXACT) -> float:
    """Attention memory per text of one placement of ``est`` at ``r`` (the largest over seeds), KiB."""
    mem = ds["attention_bytes"].sel(estimator=est, num_features=r, search=search, placement=placement).max()
    return float(mem) / 1024


def hybrid_table(ds, est: str, r: int) -> dict[str, xr.DataArray]:
    """``label -> top10_agreement summary`` of every placement searched for ``est`` at ``r``, in the order of
    :data:`PLACEMENTS`."""
    s = ds["top10_agreement_summary"].sel(estimator=est, num_features=r, search=True).squeeze(drop=True)
    return {label: s.sel(placement=label) for label in PLACEMENTS if _ran(s.sel(placement=label))}


def _searches(ds) -> list[tuple[str, int, dict]]:
    """``(estimator, r, hybrid_table)`` of each search that ran."""
    return [(str(est), int(r), table) for est in ds.estimator.values for r in ds.num_features.values
            if True in ds.search.values and (table := hybrid_table(ds, str(est), int(r)))]


def _ranked(table, count) -> list:
    """``(label, summary)`` of the placements of ``table`` with ``count`` exact layers, best agreement first."""
    return sorted(((label, s) for label, s in table.items() if EXACT_LAYERS[label] == count),
                  key=lambda item: -float(item[1].sel(stat="estimate")))


def _per_query_difference(ds, est: str, r: int, a: str, b: str) -> xr.DataArray:
    v = ds["top10_agreement"].sel(estimator=est, num_features=r, search=True).squeeze(drop=True)
    diff = v.sel(placement=a) - v.sel(placement=b)
    return (diff.mean("seed") if "seed" in diff.dims else diff).assign_attrs(comparison="difference")


def _compare(ds, est: str, r: int, a: str, b: str, pairs) -> tuple[xr.DataArray, float, str]:
    """Placement ``a`` against ``b`` (same maps, same queries): the paired top-10 agreement ``a − b`` (per query
    the mean over seeds of the difference, then the mean over queries with its bootstrap interval over queries),
    the p-value of the Wilcoxon signed-rank test over queries, Holm-adjusted over the family ``pairs`` (which holds
    ``(a, b)`` or ``(b, a)``), and the verdict (:func:`kernapprox.stats.verdict`)."""
    raw = [float(stats.paired_test(_per_query_difference(ds, est, r, x, y), QUERIES, test="wilcoxon"))
           for x, y in pairs]
    family = dict(zip(pairs, stats.holm(np.asarray(raw))))
    p = family.get((a, b), family.get((b, a), np.nan))
    d = stats.paired_summary(_per_query_difference(ds, est, r, a, b), QUERIES, statistic="mean")
    return d, p, stats.verdict(float(d.sel(stat="estimate")), p, int(d.sel(stat="count")))


def _verdict_text(ds, est, r, a, b, labels) -> str:
    """``paired per query a − b 0.012 (−0.005 to 0.029), Holm-adjusted p = 0.9 over all 15 pairs: not resolved``,
    the family being every pair of the placements ``labels``."""
    pairs = [(x, y) for i, x in enumerate(labels) for y in labels[i + 1:]]
    d, p, word = _compare(ds, est, r, a, b, pairs)
    return (f"paired per query {a} − {b} {fmt_ci(d, 2)}, Holm-adjusted p = {_p(p)} over all {len(pairs)} pairs: "
            f"{RESOLVED.get(word, word)}")


def _range(summary, digits: int = 2) -> str:
    """``0.56 [0.55–0.6]``: a median over seeds with the range of the seeds
    (:func:`kernapprox.stats.range_summary`), in brackets."""
    lo, hi = (fmt(float(summary.sel(stat=k)), digits) for k in ("lo", "hi"))
    return f"{fmt(float(summary.sel(stat='estimate')), digits)} [{lo}–{hi}]"


def _p(value: float) -> str:
    return "n/a" if not np.isfinite(value) else fmt(float(value), 2)


def findings(ds) -> str:
    """Markdown bullets; every number is computed from ``ds`` (95 % intervals: bootstrap over queries of the
    per-query means over seeds; Clopper–Pearson for the exact model's accuracy; cluster bootstrap over seeds, each
    with its heads, for held-out errors; in brackets the range of the seeds of a per-seed median)."""
    estimators = [str(e) for e in ds.estimator.values]
    ranks = [int(r) for r in ds.num_features.values]
    lines = [_headline(ds, estimators, ranks)]
    hits = ds["exact_self_hit_summary"].squeeze(drop=True)
    n = int(hits.sel(stat="trials"))
    lines.append(f"Exact model: the query's own paragraph is its nearest document for {fmt_ci(hits, 2)} of {n} "
                 f"queries; a random ranking would share {fmt(10 / n, 2)} of the top 10 and the top document with "
                 f"probability {fmt(1 / n, 2)}.")
    for r in [r for r in ranks if r in (32, max(ranks))]:
        parts = [f"`{est}` (r = {_dim(ds, est, r)}): top-1 {fmt_ci(top1, 2)}, top-10 "
                 f"{fmt_ci(_all_layers(ds, 'top10_agreement_summary', est, r), 2)}, embedding cosine "
                 f"{_range(_all_layers(ds, 'embedding_cosine_summary', est, r), 3)}" for est in estimators
                 if (top1 := _all_layers(ds, "top1_agreement_summary", est, r)) is not None]
        if parts:
            lines.append(f"All six layers substituted, r = {r} per head (agreement: mean over the {n} queries, each "
                         f"the mean over the {ds.sizes[UNIT]} seeds, interval over the queries; embedding cosine: "
                         "median over the seeds, in brackets their range, not a 95 % interval): " + "; ".join(parts)
                         + ".")
    lines.append(_memory_line(ds, estimators, ranks))
    for est, r, table in _searches(ds):
        none = table.get(NONE_EXACT)
        for count in (1, 2):
            ranked = _ranked(table, count)
            if not ranked:
                continue
            best, second = (ranked + [None])[:2]
            naive = [f"{which} {count}: {fmt_ci(table[label], 2)}" for which, label in (
                ("first", sub.placement_label(sub.first_layers(count))),
                ("last", sub.placement_label(sub.last_layers(count)))) if label in table]
            versus = (f"; runner-up {second[0]} {fmt_ci(second[1], 2)}, "
                      + _verdict_text(ds, est, r, best[0], second[0], [label for label, _ in ranked])
                      if second is not None else "")
            lines.append(f"`{est}`, r = {r}, {count} exact layer{'s' * (count > 1)}: the best of {len(ranked)} "
                         f"placements is {best[0]} with top-10 agreement {fmt_ci(best[1], 2)}{versus} ("
                         + "; ".join(naive) + (f"; none exact: {fmt_ci(none, 2)}" if none is not None else "") + ").")
        labels = {i: sub.placement_label([j for j in range(NUM_LAYERS) if j != i]) for i in range(NUM_LAYERS)}
        alone = {layer: table[label] for layer, label in labels.items() if label in table}
        if alone:
            worst, top = (pick(alone, key=lambda i: float(alone[i].sel(stat="estimate"))) for pick in (min, max))
            lines.append(f"`{est}`, r = {r}, one layer substituted at a time: top-10 agreement from "
                         f"{fmt_ci(alone[worst], 2)} (layer {worst}) to {fmt_ci(alone[top], 2)} (layer {top}); "
                         + _verdict_text(ds, est, r, labels[top], labels[worst], [labels[i] for i in alone]) + ".")
    lines += _heldout_lines(ds, estimators, ranks)
    return bullets(lines)


def _headline(ds, estimators, ranks) -> str:
    r = 128 if 128 in ranks else max(ranks)
    tops = {est: _all_layers(ds, "top10_agreement_summary", est, r) for est in estimators}
    parts = [f"`{est}`{f' (r = {_dim(ds, est, r)})' if est in FIXED_DIMENSION else ''} {fmt_ci(top, 2)}"
             for est, top in tops.items() if top is not None]
    text = (f"With the attention of all six layers of all-MiniLM-L6-v2 replaced at r = {r} features per head, the "
            "share of each query's top-10 documents that the exact model also retrieves is " + ", ".join(parts))
    for est, rs, table in _searches(ds):
        two = _ranked(table, 2)
        if two and NONE_EXACT in table:
            best = two[0]
            d, p, word = _compare(ds, est, rs, best[0], NONE_EXACT, [(label, NONE_EXACT) for label, _ in two])
            verb = {"higher": "raises", "lower": "lowers"}.get(word, "does not resolvably change")
            text += (f"; keeping two layers exact ({best[0]}, the best of {len(two)} such placements) {verb} `{est}` "
                     f"at r = {rs}: {fmt_ci(table[NONE_EXACT], 2)} → {fmt_ci(best[1], 2)}, paired per query "
                     f"{fmt_ci(d, 2)} (Wilcoxon over {int(d.sel(stat='count'))} queries, Holm-adjusted over the "
                     f"{len(two)} placements against none exact: p = {_p(p)})")
            break
    return text + "."


def _memory_line(ds, estimators, ranks) -> str:
    """Attention memory per text of the exact model (KV caches) against all-layer substitutions."""
    parts = [f"`{est}`{'' if est in FIXED_DIMENSION else f' r = {r}'} {fmt(_kib(ds, est, r))} KiB"
             for est in estimators for r in ranks if applicable(est, r, False, _parameters(ds))
             and (est in FIXED_DIMENSION or r in (32, max(ranks))) and np.isfinite(_kib(ds, est, r))]
    return (f"Attention memory per text (mean over the corpus's texts): exact model (six layers of KV cache) "
            f"{fmt(float(ds['exact_attention_bytes'].max()) / 1024)} KiB; all layers substituted: " + "; ".join(parts)
            + ".")


def _parameters(ds) -> dict:
    return {name: ds[name].item() for name in PARAMETERS}


def _heldout_lines(ds, estimators, ranks) -> list[str]:
    r = int(_parameters(ds)["heldout_rank"])
    if r not in ranks:
        return []
    s = ds["heldout_error_summary"].sel(search=False)
    ones = {est: s.sel(estimator=est, num_features=FIXED_DIMENSION.get(est, r)).squeeze(drop=True)
            for est in estimators}
    parts = [f"`{est}` (r = {_dim(ds, est, r)}) {fmt_ci(one, 2)}" for est, one in ones.items() if _ran(one)]
    lines = [f"Held-out attention-output error per head at r = {r} (geometric mean over layers × heads × "
             f"{ds.sizes[UNIT]} seeds with a cluster-bootstrap interval over the seeds, maps fitted on extraction "
             "windows 0–1 and tested on windows 2–3): " + "; ".join(parts) + "."] if parts else []
    k = ds.sizes[UNIT]
    for est in [e for e in LEARNED if e in estimators]:
        wins = []
        at = {"estimator": est, "num_features": r, "search": False}
        for base in [b for b in HELDOUT_BASELINES if f"heldout_error_vs_{b}_summary" in ds]:
            var = f"heldout_error_vs_{base}"
            g, per_head, p_w, p_s = (ds[v].sel(at).squeeze(drop=True) for v in (
                f"{var}_summary", var, f"{var}_p_wilcoxon", f"{var}_p_sign"))
            if not _ran(g):
                continue
            share = g.sel(stat=["below", "below_lo", "below_hi"]).assign_coords(stat=["estimate", "lo", "hi"])
            lower = int((np.log(per_head).mean(HEADS) < 0).sum())
            word = stats.verdict(float(np.log(g.sel(stat="estimate"))), float(p_w), int(g.sel(stat="count")))
            if word == "not resolved" and k < stats.MIN_UNITS:
                word = f"not resolved ({k} units)"
            wins.append(f"`{base}`: geometric-mean ratio {fmt_ci(g, 2)}, below 1 on a share {fmt_ci(share, 2)} of "
                        f"the heads, lower in {lower} of {k} seeds (Wilcoxon p = {_p(float(p_w))}, sign test p = "
                        f"{_p(float(p_s))}): {RESOLVED.get(word, word)}")
        if wins:
            lines.append(f"`{est}`'s held-out error against each baseline map at r = {r}, paired by head within seed "
                         f"(the unit is the seed, the maps' draw, which its {ds.sizes['layer'] * ds.sizes['head']} "
                         f"heads share: cluster intervals over the {k} seeds, exact tests on the per-seed mean log "
                         "ratio; a verdict needs " + f"{stats.MIN_UNITS} seeds): " + "; ".join(wins) + ".")
    return lines


# --------------------------------------------------------------------------------------------------- figure
def plot(ds, path):
    estimators = [str(e) for e in ds.estimator.values]
    ranks = [int(r) for r in ds.num_features.values]
    params = _parameters(ds)
    fig, axes = plotting.new_figure(2, 3, width=15.0, height=8.2, squeeze=False)
    (a_top1, a_top10, a_err), (a_mem, a_head, a_layer) = axes

    for ax, var in zip((a_top1, a_top10, a_err), ("top1_agreement", "top10_agreement", "final_state_error")):
        for est in estimators:           # the all-layer substitution against the feature dimension, with its band
            if cells := _all_layer_cells(ds, f"{var}_summary", est, ranks):
                xs, style = [_dim(ds, est, r) for r, _ in cells], plotting.estimator_style(est)
                m, lo, hi = np.array([[float(s.sel(stat=k)) for k in ("estimate", "lo", "hi")] for _, s in cells]).T
                ax.plot(xs, m, **style)
                ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    for ax, top, title in ((a_top1, "top-1", "nearest document unchanged"),
                           (a_top10, "top-10", "top-10 documents shared")):
        ax.set_xscale("log", base=2)
        ax.set(ylim=(-0.02, 1.02), xlabel="features per head r", ylabel=f"{top} agreement with exact",
               title=f"{title} (all layers)")
    a_top1.legend(fontsize=6.5)
    plotting.loglog_rank_axes(a_err, xlabel="features per head r", ylabel="relative error of final states")
    a_err.set_title("final hidden-state error (all layers)")

    # agreement against memory: all-layer substitutions, hybrids (best searched and naive), exact
    for est in estimators:
        style = plotting.estimator_style(est)
        pts = [(_kib(ds, est, r), float(s.sel(stat="estimate")))
               for r, s in _all_layer_cells(ds, "top10_agreement_summary", est, ranks)]
        if pts:
            x, y = np.array(sorted(pts)).T
            a_mem.plot(x, y, color=style["color"], linestyle=":", marker=style["marker"], alpha=0.7,
                       label=f"{est}, all layers, r = {', '.join(map(str, ranks))}"
                       if est not in FIXED_DIMENSION else f"{est}, all layers")
    for est, r, table in _searches(ds):
        color = plotting.estimator_style(est)["color"]
        mem = {label: _kib(ds, est, r, True, label) for label in table}
        curves = {"best": [], "first": [], "last": []}
        for count in range(NUM_LAYERS):
            ranked = _ranked(table, count)
            exhaustive = count <= params["search_max_exact"] or count >= NUM_LAYERS - 1
            for name, label in (("best", ranked[0][0] if ranked and exhaustive else None),
                                ("first", sub.placement_label(sub.first_layers(count))),
                                ("last", sub.placement_label(sub.last_layers(count)))):
                if label in table:
                    curves[name].append((mem[label], float(table[label].sel(stat="estimate")), count))
        for name, ls, mk in (("best", "-", "*"), ("first", "--", "v"), ("last", "-.", "^")):
            if not curves[name]:
                continue
            x, y, _ = np.array(curves[name]).T
            a_mem.plot(x, y, color=color, linestyle=ls, marker=mk, markersize=5 if mk == "*" else 3.5,
                       label=f"{est} r = {r}: k exact layers, {name} k" if name != "best"
                       else f"{est} r = {r}: best searched placement of k exact layers")
        for x, y, count in curves["best"]:
            a_mem.annotate(str(int(count)), (x, y), textcoords="offset points", xytext=(2, 3), fontsize=6, color=color)
    kv = float(ds["exact_attention_bytes"].max()) / 1024.0
    a_mem.plot([kv], [1.0], marker="P", color="black", linestyle="none", markersize=7, label="exact model (KV caches)")
    a_mem.axvline(kv, color="0.5", linewidth=0.7, linestyle=":")
    a_mem.set_xscale("log")
    a_mem.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a_mem.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    a_mem.xaxis.set_minor_formatter(ticker.NullFormatter())
    a_mem.set(ylim=(-0.02, 1.05), xlabel="attention memory per text, KiB (mean over texts)",
              ylabel="top-10 agreement with exact", title="agreement against memory (numbers: exact layers)")
    a_mem.legend(fontsize=5.3, ncol=1, loc="lower right")

    # held-out error per head at heldout_rank (boxes of the per-head, per-seed draws); each layer's own error
    r_head = int(params["heldout_rank"])
    boxes = {}
    for est in estimators:
        rr = FIXED_DIMENSION.get(est, r_head)
        if rr not in ranks:
            continue
        v = ds["heldout_error"].sel(estimator=est, num_features=rr, search=False).values.ravel()
        v = v[np.isfinite(v)]
        if v.size:
            boxes[est] = v
        s = ds["layer_attention_error_summary"].sel(estimator=est, num_features=rr, search=False,
                                                    placement=NONE_EXACT).squeeze(drop=True)
        if np.isfinite(s.sel(stat="estimate").values).any():
            plotting.plot_summary(a_layer, s, "layer", **plotting.estimator_style(est))
    if boxes:
        parts = a_head.boxplot(list(boxes.values()), showfliers=False, patch_artist=True, widths=0.6)
        for patch, est in zip(parts["boxes"], boxes):
            patch.set_facecolor(plotting.estimator_style(est)["color"])
            patch.set_alpha(0.5)
        a_head.set_xticks(range(1, len(boxes) + 1), list(boxes), rotation=20, fontsize=7)
    a_head.set(yscale="log", ylabel="held-out attention-output error",
               title=f"per head, r = {r_head}: fitted on windows 0–1, tested on 2–3")
    a_layer.set(yscale="log", xlabel="layer", ylabel="attention-output error of the layer",
                title=f"each layer's own error, all layers substituted (r = {r_head})")

    n = int(ds.paragraphs.values[0])
    fig.suptitle("all-MiniLM-L6-v2 on approximate attention: retrieval, state error, hybrids, learned maps")
    plotting.save_figure(fig, path, (
        f"Sentence retrieval over {n} held-out paragraphs of Python's help text (query: first sentence; document: "
        "the rest), every layer's attention replaced by the estimator (r features per head, 12 heads, 6 layers) "
        "and compared with the exact model on the same tokens. Top row: top-1 / top-10 agreement of each query's "
        f"nearest documents with the exact model's (mean over queries of the mean over {ds.sizes['seed']} seeds; "
        "band: 95 % bootstrap interval over queries); median relative error of the final hidden states over seeds "
        "(band: the range of the seeds). Bottom left: top-10 agreement against attention memory per "
        "text (estimators' state_bytes; exact layers hold their KV cache at the text's length); dotted: all layers "
        "substituted at each r; solid: the best searched placement of k exact layers (k written beside it; every "
        f"placement is searched for k ≤ {int(params['search_max_exact'])} and k ≥ 5, only the naive ones between), "
        "dashed/dash-dotted: the first/last k layers exact; the cross: the exact model (all six KV caches). Bottom "
        f"middle: held-out attention-output error per head at r = {r_head} (maps fitted on windows 0–1 of the "
        "extraction, tested on windows 2–3; boxes over 72 heads and the seeds, whiskers 1.5 IQR). Bottom right: "
        "each layer's attention-output error on the activations it sees with all layers substituted (median over "
        "seeds and the range of the seeds)."))


DATA_AXES = ("paragraphs", "seed")
EXPERIMENT = Experiment.from_module(
    __name__, title="all-MiniLM-L6-v2 end to end on approximate attention: retrieval, hybrids and learned maps",
    description=("What sentence retrieval loses when every layer (or a hybrid placement of exact layers) of "
                 "all-MiniLM-L6-v2 runs on an approximate attention of r features per head: random, data-dependent "
                 "random, Nyström, Taylor and learned (Hedgehog-distilled) maps; top-1/top-10 agreement with the "
                 "exact model, embedding cosine, final-state and per-layer errors, attention memory per placement, "
                 "and each head's held-out attention error. Grid: estimator × r × placement search × corpus × "
                 "training steps × seed."),
    replicates="the queries (agreement: each query the mean over the seeds) or the seeds (held-out errors: cluster "
               "bootstrap, each seed with all its heads)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
