"""all-MiniLM-L6-v2 end to end on approximate attention: what sentence retrieval loses, per estimator family, rank
and placement of exact layers; learned (distilled) maps against random, data-dependent and Nyström ones.

Each cell runs the real model (:mod:`kernapprox.substitution`) on held-out paragraphs of Python's help text
(:func:`~kernapprox.substitution.retrieval_corpus`: first sentence = query, rest = document) with the attention of
every layer (``search = False``), or of every subset of layers (``search = True``, 64 placements, for the
families and ranks in :data:`SEARCH`), replaced by one estimator at ``r`` features per head, and compares with the
exact model on the same token ids (paired): top-1 and top-10 agreement of each query's nearest documents, the
embedding cosine, the relative error of the final hidden states and of each layer's attention output, and the
attention memory per text (estimators' ``state_bytes`` per head; exact layers: their KV cache at the text's
length). ``search = False`` cells also measure each head's held-out attention-output error: maps fitted on the
extraction windows 0–1, evaluated on windows 2–3 (512 tokens each; never in-sample).

Families (:data:`FAMILIES`): random (``positive_orthogonal``, FAVOR+), data-dependent random
(``oprf_orthogonal``), Nyström (``nystrom_kmeans``), Taylor (``taylor2``, dimension fixed by ``d``: run at
``r = 32`` cells only, its true dimension stored in ``feature_dimension``) and learned (``hedgehog``: trained per
``(layer, head)`` for ``train_steps`` steps on windows 0–1, cached in ``results/cache``). Data-dependent
closed-form maps are fitted per ``(layer, head)`` on the running input (all texts' real tokens, at most
:data:`FIT_POINTS`); learned maps never see the input. ``seed`` indexes the random draws (projections,
initialisations, k-means seeds): cells sharing ``paragraphs`` and ``seed`` share the root seed, so the
``search = False`` and ``search = True`` cells of one family draw the same maps.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

import kernapprox as ka
from kernapprox import real
from kernapprox.sweep import Experiment, Metric, run_cli

REAL_REASON = real.unavailable_reason()
if REAL_REASON is not None:
    warnings.warn(f"model_substitution needs the real-model extra: {REAL_REASON}", stacklevel=1)
else:
    from kernapprox import substitution as sub

FAMILIES = {"positive_orthogonal": "random", "oprf_orthogonal": "data-dependent random",
            "nystrom_kmeans": "Nyström", "taylor2": "Taylor", "hedgehog": "learned"}
ESTIMATORS = [name for name in FAMILIES if name in ka.available_estimators()]
LEARNED = ("hedgehog",)                   # trained on the extraction windows, never on the input
FIXED_DIMENSION = {"taylor2": 32}          # estimator -> the num_features cell it runs in
SEARCH = {"positive_orthogonal": (32,), "hedgehog": (32,)}   # estimator -> ranks of the exhaustive placement search
FIT_POINTS = 1024                          # data-dependent fits on the input: at most this many tokens per head
TRAIN = dict(windows=(0, 1), segment=64, query_stride=2)     # learned-map training / calibration data
LEARNING_RATE = 0.05
NUM_LAYERS, NUM_HEADS = real.NUM_LAYERS, real.NUM_HEADS
PLACEMENTS = ([sub.placement_label(p) for p in sub.all_placements()] if REAL_REASON is None
              else ["E:-"])

GRIDS = {
    "smoke": {"estimator": [e for e in ("hedgehog",) if e in ESTIMATORS] or ["positive_orthogonal"],
              "num_features": [32], "search": [False, True], "paragraphs": [12], "train_steps": [4], "seed": [0]},
    "default": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128], "search": [False, True],
                "paragraphs": [32], "train_steps": [50], "seed": [0, 1, 2, 3, 4]},
    "full": {"estimator": ESTIMATORS, "num_features": [16, 32, 64, 128, 256], "search": [False, True],
             "paragraphs": [96], "train_steps": [200], "seed": list(range(8))},
}

_PL = ("placement",)
_PL_COORDS = {"placement": PLACEMENTS}
METRICS = {
    "top1_agreement": Metric("top-1 agreement with the exact model", "1",
                             "per query: 1 if the nearest document under the substituted model is the exact model's",
                             dims=("placement", "query"), coords=_PL_COORDS),
    "top10_agreement": Metric("top-10 agreement with the exact model", "1",
                              "per query: |top-10 documents (substituted) ∩ top-10 (exact)| / 10",
                              dims=("placement", "query"), coords=_PL_COORDS),
    "self_hit": Metric("retrieval accuracy", "1",
                       "per query: 1 if the nearest document is the query's own paragraph (substituted model)",
                       dims=("placement", "query"), coords=_PL_COORDS),
    "exact_self_hit": Metric("retrieval accuracy of the exact model", "1",
                             "per query: 1 if the exact model's nearest document is the query's own paragraph",
                             dims=("query",)),
    "embedding_cosine": Metric("embedding cosine to the exact model", "1",
                               "mean over queries and documents of cos(e, e_exact)", dims=_PL, coords=_PL_COORDS),
    "final_state_error": Metric("relative error of the final hidden states", "1",
                                "sqrt(Σ‖h − h_exact‖² / Σ‖h_exact‖²) over the real tokens of all texts",
                                dims=_PL, coords=_PL_COORDS),
    "hidden_error": Metric("relative error of each layer's output states", "1",
                           "as final_state_error, after each layer", dims=("placement", "layer"),
                           coords={**_PL_COORDS, "layer": list(range(NUM_LAYERS))}),
    "layer_attention_error": Metric("relative error of a substituted layer's attention output", "1",
                                    "sqrt(Σ‖ŷ−y‖²/Σ‖y‖²) against exact attention on the same q, k, v (the layer's "
                                    "own error on the activations it sees); NaN for exact layers",
                                    dims=("placement", "layer"),
                                    coords={**_PL_COORDS, "layer": list(range(NUM_LAYERS))}),
    "attention_bytes": Metric("attention memory per text", "byte",
                              "mean over texts of Σ_layers Σ_heads (state_bytes, or the KV cache n·(d+d_v)·4 of "
                              "an exact layer at the text's n)", dims=_PL, coords=_PL_COORDS),
    "heldout_error": Metric("held-out attention-output error per head", "1",
                            "maps fitted on extraction windows 0–1, evaluated on windows 2–3 (non-causal, 512 "
                            "tokens): sqrt(Σ‖ŷ−y‖²/Σ‖y‖²)", dims=("layer", "head"),
                            coords={"layer": list(range(NUM_LAYERS)), "head": list(range(NUM_HEADS))}),
    "feature_dimension": Metric("feature dimension per head", "1", "the estimator's r (its own for fixed maps)"),
}


def _nan_result(num_queries: int) -> dict:
    out = {}
    for name, metric in METRICS.items():
        shape = [len(metric.coords[d]) if metric.coords and d in metric.coords else num_queries
                 for d in metric.dims]
        out[name] = np.full(shape, np.nan) if shape else np.nan
    return out


def applicable(name: str, num_features: int, search: bool) -> bool:
    """Whether a cell runs: fixed-dimension maps only in their rank cell, the search only where :data:`SEARCH`
    asks for it."""
    if name in FIXED_DIMENSION and num_features != FIXED_DIMENSION[name]:
        return False
    return not search or num_features in SEARCH.get(name, ())


@functools.lru_cache(maxsize=2)
def _context(paragraphs: int, device: str):
    """The corpus, its tokenised input and the exact run (computed once per process and corpus)."""
    model, tokenizer = sub.load_encoder()
    model = model.to(device)
    corpus = sub.retrieval_corpus(paragraphs, min_document_tokens=16, max_document_tokens=64)
    inputs = sub.tokenize(tokenizer, corpus.texts, bucket_tokens=1024, device=device)
    exact = sub.encode(model, inputs, keep_layer_states=True)
    hits = sub.retrieval_agreement(exact.embeddings, exact.embeddings, len(corpus))["hit"]
    return model, corpus, inputs, exact, hits


def substitution_for(name: str, num_features: int, root: int, train_steps: int, *, cache: bool = True):
    """The :class:`~kernapprox.substitution.Substitution` a cell runs (learned maps trained and cached first)."""
    r = None if name in FIXED_DIMENSION else num_features
    if name in LEARNED:
        options = {"num_steps": train_steps, "learning_rate": LEARNING_RATE}
        spec = sub.Substitution(name, num_features=r, rng=root, options=options)
        maps = sub.fit_maps(spec, sub.Windows(**TRAIN), cache=cache)
        return sub.Substitution(name, num_features=r, rng=root, options=options, maps=maps)
    return sub.Substitution(name, num_features=r, rng=root, fit="input", fit_points=FIT_POINTS)


def run_cell(params, rng, device, data_rng):
    name, r, search = params["estimator"], params["num_features"], params["search"]
    if REAL_REASON is not None:
        raise RuntimeError(f"model_substitution needs the real-model extra: {REAL_REASON}")
    model, corpus, inputs, exact, hits = _context(params["paragraphs"], str(device))
    out = _nan_result(len(corpus))
    if not applicable(name, r, search):
        return out
    out["exact_self_hit"] = hits
    root = int(data_rng.integers(2**63))                # shared by every cell of this (paragraphs, seed)
    subst = substitution_for(name, r, root, params["train_steps"])

    def record(exact_layers, run):
        i = PLACEMENTS.index(sub.placement_label(exact_layers))
        agree = sub.retrieval_agreement(run.embeddings, exact.embeddings, len(corpus))
        out["top1_agreement"][i], out["top10_agreement"][i], out["self_hit"][i] = (
            agree["top1"], agree["top_k"], agree["hit"])
        out["embedding_cosine"][i] = float(np.mean(run.embedding_cosine))
        out["final_state_error"][i] = run.final_state_error
        out["hidden_error"][i] = [run.hidden_error[layer] for layer in range(NUM_LAYERS)]
        out["layer_attention_error"][i] = [run.layer_attention_error.get(layer, np.nan)
                                           for layer in range(NUM_LAYERS)]
        out["attention_bytes"][i] = float(np.mean(sub.placement_bytes(subst, exact_layers, inputs.lengths)))

    if search:
        sub.search_placements(model, inputs, subst, record, reference=exact)
    else:
        record((), sub.encode(model, inputs, sub.plan(subst), reference=exact))
        maps = subst.maps if subst.maps is not None else sub.fit_maps(
            sub.Substitution(name, num_features=subst.num_features, rng=root), sub.Windows(**TRAIN))
        out["heldout_error"] = sub.heldout_attention_error(maps)
    fixed = subst.num_features is None                 # the dimension is d's: read it off a map
    out["feature_dimension"] = float(subst.make(0, 0).fit(torch.zeros(1, real.HEAD_DIM)).num_features if fixed
                                     else subst.num_features)
    return out


# ------------------------------------------------------------------------------------------------ summaries
BOOTSTRAP_SEED = 20240917
BOOTSTRAP_SAMPLES = 2000


def mean_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean of a ``(seed, query)`` array and its percentile-bootstrap interval, resampling seeds and queries
    independently (fixed bootstrap seed). NaN rows/columns (cells not run) are dropped first."""
    values = np.asarray(values, dtype=float)
    if values.ndim == 1:
        values = values[None]
    values = values[~np.all(np.isnan(values), axis=1)]
    values = values[:, ~np.all(np.isnan(values), axis=0)]
    if values.size == 0:
        return (np.nan, np.nan, np.nan)
    gen = np.random.default_rng(BOOTSTRAP_SEED)
    s, q = values.shape
    rows = gen.integers(0, s, size=(BOOTSTRAP_SAMPLES, s))
    cols = gen.integers(0, q, size=(BOOTSTRAP_SAMPLES, q))
    stats = np.array([np.nanmean(values[r][:, c]) for r, c in zip(rows, cols)])
    alpha = (1 - level) / 2
    return float(np.nanmean(values)), float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def median_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Median of the finite-or-inf entries of ``values`` (flattened) and its percentile-bootstrap interval."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[~np.isnan(v)]
    if v.size == 0:
        return (np.nan, np.nan, np.nan)
    gen = np.random.default_rng(BOOTSTRAP_SEED)
    stats = np.median(v[gen.integers(0, v.size, size=(BOOTSTRAP_SAMPLES, v.size))], axis=1)
    alpha = (1 - level) / 2
    return float(np.median(v)), float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def clopper_pearson(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    from scipy.stats import beta

    alpha = 1 - level
    lo = 0.0 if successes == 0 else float(beta.ppf(alpha / 2, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return lo, hi


def _fmt(stat: tuple[float, float, float], digits: int = 2) -> str:
    m, lo, hi = stat
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _per_query(ds, var, estimator, r, placement="E:-", search=None):
    """``(seed, query)`` values of ``var`` for one estimator, rank and placement (search cells if the placement
    needs them)."""
    if search is None:
        search = placement != "E:-"
    da = ds[var].sel(estimator=estimator, num_features=r, search=search, placement=placement)
    return da.squeeze([d for d in da.dims if d not in ("seed", "query")], drop=True).transpose("seed", "query").values


def hybrid_table(ds, estimator: str, r: int, var: str = "top10_agreement") -> list[tuple[str, float, float, float]]:
    """Every placement of a search cell: ``(label, mean, lo, hi)`` of ``var`` (mean over seeds and queries, 95 %
    bootstrap interval), in the order of :data:`PLACEMENTS`."""
    rows = []
    for label in PLACEMENTS:
        vals = _per_query(ds, var, estimator, r, label, search=True)
        rows.append((label, *mean_interval(vals)))
    return rows


def _num_exact(label: str) -> int:
    return 0 if label == "E:-" else len(label[2:].split(","))


def _memory_line(ds, estimators, ranks) -> str | None:
    """Attention memory per text of the exact model (KV caches) against all-layer substitutions."""
    searched = ds["attention_bytes"].sel(search=True, placement=PLACEMENTS[-1]).values
    searched = searched[np.isfinite(searched)]
    if not searched.size:
        return None
    kv = float(np.mean(searched)) / 1024
    parts = []
    for est in estimators:
        for r in ranks:
            if not applicable(est, int(r), False) or (est not in FIXED_DIMENSION and r not in (32, 128)):
                continue
            mem = ds["attention_bytes"].sel(estimator=est, num_features=r, search=False, placement="E:-").values
            mem = mem[np.isfinite(mem)]
            if mem.size:
                label = f"{est}" if est in FIXED_DIMENSION else f"{est} r = {int(r)}"
                parts.append(f"{label} {float(mem.mean()) / 1024:.0f} KiB")
    return (f"- Attention memory per text (mean over the corpus's texts): exact model (six layers of KV cache) "
            f"{kv:.0f} KiB; all layers substituted: " + "; ".join(parts) + ".")


def findings(ds) -> str:
    """Markdown bullets; every number is computed from ``ds`` (95 % intervals: bootstrap over seeds and queries,
    Clopper–Pearson for the exact model's accuracy, bootstrap over heads and seeds for held-out errors)."""
    lines = []
    estimators = [str(e) for e in ds.estimator.values]
    ranks = [int(r) for r in ds.num_features.values]
    hits = ds["exact_self_hit"].max(("estimator", "num_features", "search", "seed")).values
    hits = hits[~np.isnan(hits)]
    if hits.size:
        lo, hi = clopper_pearson(int(hits.sum()), hits.size)
        lines.append(f"- Exact model: the query's own paragraph is its nearest document for {hits.mean():.2f} "
                     f"[{lo:.2f}, {hi:.2f}] of {hits.size} queries; a random ranking would share "
                     f"{10 / hits.size:.2f} of the top 10 and the top document with probability "
                     f"{1 / hits.size:.3f}.")
    for r in [r for r in (32, 128) if r in ranks]:
        parts = []
        for est in estimators:
            rr = FIXED_DIMENSION.get(est, r)
            if rr not in ranks:
                continue
            top1 = mean_interval(_per_query(ds, "top1_agreement", est, rr))
            top10 = mean_interval(_per_query(ds, "top10_agreement", est, rr))
            cos = ds["embedding_cosine"].sel(estimator=est, num_features=rr, search=False, placement="E:-")
            if np.isnan(top1[0]):
                continue
            dim = int(np.nanmax(ds["feature_dimension"].sel(estimator=est, num_features=rr).values))
            parts.append(f"{est} (r = {dim}): top-1 {_fmt(top1)}, top-10 {_fmt(top10)}, cosine "
                         f"{float(cos.mean()):.3f}")
        if parts:
            lines.append(f"- All six layers substituted, r = {r} per head: " + "; ".join(parts) + ".")
    memory = _memory_line(ds, estimators, ranks)
    if memory:
        lines.append(memory)
    for est, search_ranks in SEARCH.items():
        for r in search_ranks:
            if est not in estimators or r not in ranks or not bool(ds.search.any()):
                continue
            table = hybrid_table(ds, est, r)
            if np.isnan(table[0][1]):
                continue
            for count in (1, 2):
                rows = [row for row in table if _num_exact(row[0]) == count]
                best = max(rows, key=lambda row: row[1])
                first = next(row for row in rows if row[0] == sub.placement_label(sub.first_layers(count)))
                last = next(row for row in rows if row[0] == sub.placement_label(sub.last_layers(count)))
                lines.append(f"- {est}, r = {r}, {count} exact layer{'s' * (count > 1)}: best placement "
                             f"{best[0]} with top-10 agreement {_fmt(best[1:])} (first {count}: {_fmt(first[1:])}; "
                             f"last {count}: {_fmt(last[1:])}); none exact: {_fmt(table[0][1:])}.")
    for est, search_ranks in SEARCH.items():
        for r in search_ranks:
            if est not in estimators or r not in ranks or not bool(ds.search.any()):
                continue
            table = {row[0]: row[1:] for row in hybrid_table(ds, est, r)}
            if np.isnan(table["E:-"][0]):
                continue
            alone = {layer: table[sub.placement_label([j for j in range(NUM_LAYERS) if j != layer])]
                     for layer in range(NUM_LAYERS)}
            worst = min(alone, key=lambda layer: alone[layer][0])
            best = max(alone, key=lambda layer: alone[layer][0])
            lines.append(f"- {est}, r = {r}, one layer substituted at a time: top-10 agreement from "
                         f"{_fmt(alone[worst])} (layer {worst}) to {_fmt(alone[best])} (layer {best}).")
    if 64 in ranks:
        parts = []
        for est in estimators:
            rr = FIXED_DIMENSION.get(est, 64)
            vals = ds["heldout_error"].sel(estimator=est, num_features=rr, search=False).values
            stat = median_interval(vals)
            if not np.isnan(stat[0]):
                parts.append(f"{est} {_fmt(stat)}")
        if parts:
            lines.append("- Held-out attention-output error at r = 64 (median over heads and seeds, windows 2–3 of "
                         "maps fitted on windows 0–1): " + "; ".join(parts) + ".")
        learned = [e for e in LEARNED if e in estimators]
        for est in learned:
            mine = ds["heldout_error"].sel(estimator=est, num_features=64, search=False)
            wins = []
            for other in estimators:
                if other == est or other in FIXED_DIMENSION:
                    continue
                theirs = ds["heldout_error"].sel(estimator=other, num_features=64, search=False)
                paired = np.isfinite(mine.values) & ~np.isnan(theirs.values)
                if paired.any():
                    below = int((mine.values[paired] < theirs.values[paired]).sum())
                    lo, hi = clopper_pearson(below, int(paired.sum()))
                    wins.append(f"{other} on {below / paired.sum():.2f} [{lo:.2f}, {hi:.2f}] of {int(paired.sum())}")
            if wins:
                lines.append(f"- Paired by head and seed at r = 64, {est}'s held-out error is below " +
                             "; ".join(wins) + " (head, seed) pairs.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- figure
def plot(ds, path):
    from kernapprox import plotting

    estimators = [str(e) for e in ds.estimator.values]
    ranks = np.array([int(r) for r in ds.num_features.values])
    fig, axes = plotting.new_figure(2, 3, width=15.0, height=8.2, squeeze=False)
    (a_top1, a_top10, a_err), (a_mem, a_head, a_layer) = axes

    for est in estimators:
        style = plotting.estimator_style(est)
        xs, stats1, stats10, errs = [], [], [], []
        for r in ranks:
            if not applicable(est, int(r), False):
                continue
            dim = ds["feature_dimension"].sel(estimator=est, num_features=r, search=False).max().item()
            s1 = mean_interval(_per_query(ds, "top1_agreement", est, int(r)))
            if np.isnan(s1[0]):
                continue
            xs.append(dim)
            stats1.append(s1)
            stats10.append(mean_interval(_per_query(ds, "top10_agreement", est, int(r))))
            fe = ds["final_state_error"].sel(estimator=est, num_features=r, search=False, placement="E:-").values
            errs.append(median_interval(fe))
        for ax, stats in ((a_top1, stats1), (a_top10, stats10), (a_err, errs)):
            if not xs:
                continue
            m, lo, hi = np.array(stats).T
            ax.plot(xs, m, **style)
            ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    for ax, label in ((a_top1, "top-1 agreement with exact"), (a_top10, "top-10 agreement with exact")):
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("features per head r")
        ax.set_ylabel(label)
    a_top1.set_title("nearest document unchanged (all layers)")
    a_top10.set_title("top-10 documents shared (all layers)")
    a_top1.legend(fontsize=6.5)
    plotting.loglog_rank_axes(a_err, xlabel="features per head r", ylabel="relative error of final states")
    a_err.set_title("final hidden-state error (all layers)")

    # agreement against memory: all-layer substitutions, hybrids (best and naive), exact
    from matplotlib import ticker

    kib = 1024.0
    for est in estimators:
        style = plotting.estimator_style(est)
        pts = []
        for r in ranks:
            if not applicable(est, int(r), False):
                continue
            mem = ds["attention_bytes"].sel(estimator=est, num_features=r, search=False, placement="E:-").mean()
            stat = mean_interval(_per_query(ds, "top10_agreement", est, int(r)))
            if not np.isnan(stat[0]):
                pts.append((float(mem) / kib, stat[0]))
        if pts:
            x, y = np.array(sorted(pts)).T
            a_mem.plot(x, y, color=style["color"], linestyle=":", marker=style["marker"], alpha=0.7,
                       label=f"{est}, all layers, r = {', '.join(str(int(r)) for r in ranks)}"
                       if est not in FIXED_DIMENSION else f"{est}, all layers")
    kv = None
    for est, search_ranks in SEARCH.items():
        for r in search_ranks:
            if est not in estimators or r not in ranks or not bool(ds.search.any()):
                continue
            table = hybrid_table(ds, est, r)
            if np.isnan(table[0][1]):
                continue
            color = plotting.estimator_style(est)["color"]
            mem = {label: float(ds["attention_bytes"].sel(estimator=est, num_features=r, search=True,
                                                          placement=label).mean()) / kib for label, *_ in table}
            kv = mem[PLACEMENTS[-1]]
            curves = {"best": [], "first": [], "last": []}
            for count in range(NUM_LAYERS):
                rows = [row for row in table if _num_exact(row[0]) == count]
                top = max(rows, key=lambda row: row[1])
                curves["best"].append((mem[top[0]], top[1], count))
                for name, layers in (("first", sub.first_layers(count)), ("last", sub.last_layers(count))):
                    label = sub.placement_label(layers)
                    curves[name].append((mem[label], next(row[1] for row in rows if row[0] == label), count))
            for name, ls, mk in (("best", "-", "*"), ("first", "--", "v"), ("last", "-.", "^")):
                x, y, _ = np.array(curves[name]).T
                a_mem.plot(x, y, color=color, linestyle=ls, marker=mk, markersize=5 if mk == "*" else 3.5,
                           label=f"{est} r = {r}: k exact layers, {name} k" if name != "best"
                           else f"{est} r = {r}: best k exact layers")
            for x, y, count in curves["best"]:
                a_mem.annotate(str(int(count)), (x, y), textcoords="offset points", xytext=(2, 3), fontsize=6,
                               color=color)
    if kv is not None:
        a_mem.plot([kv], [1.0], marker="P", color="black", linestyle="none", markersize=7,
                   label="exact model (KV caches)")
        a_mem.axvline(kv, color="0.5", linewidth=0.7, linestyle=":")
    a_mem.set_xscale("log")
    a_mem.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a_mem.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    a_mem.xaxis.set_minor_formatter(ticker.NullFormatter())
    a_mem.set_ylim(-0.02, 1.05)
    a_mem.set_xlabel("attention memory per text, KiB (mean over texts)")
    a_mem.set_ylabel("top-10 agreement with exact")
    a_mem.set_title("agreement against memory (numbers: exact layers)")
    a_mem.legend(fontsize=5.3, ncol=1, loc="lower right")

    # held-out per-head error at r = 64 (or the middle rank)
    r_head = 64 if 64 in ranks else int(ranks[len(ranks) // 2])
    data, labels = [], []
    for est in estimators:
        rr = FIXED_DIMENSION.get(est, r_head)
        if rr not in ranks:
            continue
        v = ds["heldout_error"].sel(estimator=est, num_features=rr, search=False).values.ravel()
        v = v[np.isfinite(v)]
        if v.size:
            data.append(v)
            labels.append(est)
    if data:
        parts = a_head.boxplot(data, showfliers=False, patch_artist=True, widths=0.6)
        for patch, est in zip(parts["boxes"], labels):
            patch.set_facecolor(plotting.estimator_style(est)["color"])
            patch.set_alpha(0.5)
        a_head.set_xticks(range(1, len(labels) + 1), labels, rotation=20, fontsize=7)
    a_head.set_yscale("log")
    a_head.set_ylabel("held-out attention-output error")
    a_head.set_title(f"per head, r = {r_head}: fitted on windows 0–1, tested on 2–3")

    # per-layer attention error with all layers substituted
    for est in estimators:
        rr = FIXED_DIMENSION.get(est, r_head)
        if rr not in ranks:
            continue
        da = ds["layer_attention_error"].sel(estimator=est, num_features=rr, search=False, placement="E:-")
        da = da.squeeze([d for d in da.dims if d not in ("seed", "layer")], drop=True)
        med, lo, hi = plotting.median_band(da, dim="seed")
        if not np.isfinite(med.values).any():
            continue
        style = plotting.estimator_style(est)
        a_layer.plot(med.layer.values, med.values, **style)
        a_layer.fill_between(med.layer.values, lo.values, hi.values, color=style["color"], alpha=0.15, linewidth=0)
    a_layer.set_yscale("log")
    a_layer.set_xlabel("layer")
    a_layer.set_ylabel("attention-output error of the layer")
    a_layer.set_title(f"each layer's own error, all layers substituted (r = {r_head})")

    n = int(ds.paragraphs.values[0])
    fig.suptitle("all-MiniLM-L6-v2 on approximate attention: retrieval, state error, hybrids, learned maps")
    plotting.save_figure(fig, path, (
        f"Sentence retrieval over {n} held-out paragraphs of Python's help text (query: first sentence; document: "
        "the rest), every layer's attention replaced by the estimator (r features per head, 12 heads, 6 layers) "
        "and compared with the exact model on the same tokens. Top row: mean top-1 / top-10 agreement of each "
        "query's nearest documents with the exact model's (band: 95 % bootstrap interval over seeds and "
        "queries); median relative error of the final hidden states (band: bootstrap interval of the median). "
        "Bottom left: top-10 agreement against attention memory per text (estimators' state_bytes; exact layers "
        "hold their KV cache at the text's length); dotted: all layers substituted at each r; solid: the best "
        "placement of k exact layers (k written beside it), dashed/dash-dotted: the first/last k layers exact; the "
        "cross: the exact model (all six KV caches). Bottom middle: held-out "
        f"attention-output error per head at r = {r_head} (maps fitted on windows 0–1 of the extraction, tested on "
        "windows 2–3; boxes over 72 heads and the seeds, whiskers 1.5 IQR). Bottom right: each layer's "
        "attention-output error on the activations it sees with all layers substituted (median and 10–90 % "
        "band over seeds)."))


EXPERIMENT = Experiment(
    name="model_substitution",
    title="all-MiniLM-L6-v2 end to end on approximate attention: retrieval, hybrids and learned maps",
    description=("What sentence retrieval loses when every layer (or every subset of layers) of all-MiniLM-L6-v2 "
                 "runs on an approximate attention of r features per head: random, data-dependent random, Nyström, "
                 "Taylor and learned (Hedgehog-distilled) maps; top-1/top-10 agreement with the exact model, "
                 "embedding cosine, final-state and per-layer errors, attention memory per placement, and each "
                 "head's held-out attention error. Grid: estimator × r × placement search × corpus × training "
                 "steps × seed."),
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot, data_axes=("paragraphs", "seed"))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
