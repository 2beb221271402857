"""What the in-context-learning studies share: estimator tables, applicability, episodes and their data draw,
per-episode read-out metrics, summaries and figures.

The studies ``icl_recall``, ``icl_regression``, ``icl_classification`` and ``rank_summary`` describe their
estimators by a table ``label -> (registry name or estimator class, constructor options)`` and run every estimator
on the grid axis ``num_features``. Design (common random numbers): the episodes of a data draw
(:class:`EpisodeDraw`, made once by the engine) are read by every estimator and rank, and exact attention's score
on them is the study's :class:`~kernapprox.sweep.Reference`, stored without the estimator axes. Cells store
per-episode values (dimension ``episode``) for ``seed × episode`` replicates; the summaries pool them.
Data-dependent maps are fitted on the context keys only (``kernapprox.readout``'s default ``fit_on="keys"``); the
exception is an *oracle* (the rank-r SVD references), which needs the query–key matrix and is labelled so.
"""

from __future__ import annotations

import itertools

import numpy as np
import xarray as xr

from experiments._common import add_proportion, add_summaries, sized_configuration
from kernapprox import available_estimators, memory, metrics, readout, stats, tasks
from kernapprox.plotting import (
    errorbar_summary,
    estimator_style,
    figure_legend,
    kv_cache_marker,
    log_axis,
    new_figure,
    plot_summary,
)
from kernapprox.sweep import Metric

FIXED_DIMENSION_SLOT = 64  # the num_features column in which fixed-dimension maps run
EPISODES = 16              # episodes per seed: the replicates are seed × episode

# The estimators of the regression and classification studies. Left out: the rank-r oracles (see rank_summary)
# and the position-based hybrids, since a context that is a set has no positions to relate.
SET_CONTEXT_ESTIMATORS = {  # label -> (registry name or estimator class, constructor options)
    "positive_orthogonal": ("positive_orthogonal", {}),
    "hyperbolic_orthogonal": ("hyperbolic_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "trig_orthogonal": ("trig_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "elu1": ("elu1", {}),
    "nystrom_uniform": ("nystrom_uniform", {}),
    "nystrom_kmeans": ("nystrom_kmeans", {}),
    "nystrom_rls": ("nystrom_rls", {}),
}

# LARA and EVA, compared with the other estimators at equal state bytes (sized by sized_readout): label -> (registry
# name, constructor options). A context here is a set (queries unrelated to positions), so EVA runs without its
# local window (window = 0), which would hand each query a random band of keys. Both build their proposals from the
# queries they are given (LARA: segment means of queries and keys; EVA: the mean query): they read the episode's
# test queries as a batch (declared ``query_dependent``: BATCH_READOUTS, fit_on="queries_and_keys"), an advantage
# the context-only read-outs do not have, named wherever they are compared.
SET_CONTEXT_EQUAL_BYTES = {
    "lara": ("lara", {}),
    "lara_balance": ("lara_balance", {}),
    "lara_mean": ("lara_mean", {}),
    "eva_w0": ("eva", {"window": 0}),
    "eva_mean_w0": ("eva_mean", {"window": 0}),
}
# registry names of the estimators that read a batch of queries at once (their declared capability)
BATCH_READOUTS = tuple(name for name in available_estimators() if readout.estimator_capabilities(name).query_dependent)

# How recall queries relate to their stored keys: the cosine of a continuous perturbation (a random direction
# orthogonal to the key), or "paraphrase": discrete phrase keys queried with one of their 8 tokens replaced.
QUERY_COSINES = {"key": 1.0, "cos0.95": 0.95, "cos0.9": 0.9, "cos0.85": 0.85, "paraphrase": None}
QUERY_AXIS = {"long_name": "recall query: the stored key ('key'), the key perturbed to a cosine ('cos<ρ>'), or a "
                           "paraphrase of a phrase key (1 of 8 tokens replaced)", "units": "1"}


# ------------------------------------------------------------------------------------------- grid and cells
def available(table: dict, labels) -> list[str]:
    """The labels of ``table`` whose estimator is installed (a registered name, or a class given directly)."""
    names = set(available_estimators())
    return [label for label in labels if isinstance(table[label][0], type) or table[label][0] in names]


def applicable(table: dict, label: str, num_features: int, num_context: int, slot: int = FIXED_DIMENSION_SLOT
               ) -> bool:
    """Fixed-dimension maps run in the ``slot`` column only; landmark methods need ``r ≤ n``."""
    name, options = table[label]
    caps = readout.estimator_capabilities(name, **options)
    if caps.fixed_dimension:
        return num_features == slot
    return not (caps.rank_limited_by_points and num_features > num_context)


def kv_cache_bytes(num_context: int, d: int, d_v: int) -> int:
    """What exact attention keeps from a context of ``num_context`` tokens, as its estimator accounts for it
    (:func:`kernapprox.memory.probe_state_bytes`): its KV cache, ``n (d + d_v)`` float32 numbers."""
    return memory.probe_state_bytes("exact", None, d=int(d), d_v=int(d_v), seq_len=int(num_context))


def kv_cache(num_context: xr.DataArray, *, d: int, d_v: int) -> xr.DataArray:
    """:func:`kv_cache_bytes` at each context length of the coordinate ``num_context`` (keys of width ``d``,
    values of width ``d_v``): a variable along it, the memory every fixed-size state is measured against."""
    return xr.DataArray([float(kv_cache_bytes(int(n), d, d_v)) for n in num_context.values], dims=num_context.dims,
                        coords={num_context.name: num_context.values},
                        attrs={"long_name": "exact attention's KV cache", "units": "byte",
                               "description": f"n (d + d_v) float32 numbers, d = {d}, d_v = {d_v} "
                                              "(kernapprox.memory.probe_state_bytes of exact attention)"})


def sized_readout(table: dict, label: str, num_features: int, *, num_context: int, d: int, d_v: int
                  ) -> tuple[str, dict, int] | None:
    """``(registry name, constructor arguments, budget)`` of an equal-bytes estimator (``table[label]``) at the
    budget of FAVOR+ at ``num_features`` features (:func:`kernapprox.memory.budget_bytes`), or ``None`` where it
    is not run: no configuration fits the budget, or the budget reaches exact attention's KV cache (there the
    context itself fits, and a compressed state has nothing to compress)."""
    name, options = table[label]
    budget = memory.budget_bytes(num_features, d=d, d_v=d_v, seq_len=num_context)
    if budget >= kv_cache_bytes(num_context, d, d_v):
        return None
    config = sized_configuration(name, options, budget, d=d, d_v=d_v, seq_len=num_context)
    return None if config is None else (name, config, budget)


def sized_readout_arguments(table: dict, label: str, num_features: int, *, num_context: int, d: int, d_v: int
                            ) -> tuple[str, dict, int, str] | None:
    """:func:`sized_readout` as read-out arguments ``(registry name, options, num_features, fit_on)`` (``fit_on``
    ``"queries_and_keys"`` for :data:`BATCH_READOUTS`, else ``"keys"``), or ``None`` where it is not run."""
    if (sized := sized_readout(table, label, num_features, num_context=num_context, d=d, d_v=d_v)) is None:
        return None
    name, options = sized[0], dict(sized[1])
    return name, options, options.pop("num_features"), ("queries_and_keys" if name in BATCH_READOUTS else "keys")


class EpisodeDraw:
    """A data draw of an in-context study (what its ``Experiment.draw`` returns): the ``episodes``, the ``queries``,
    ``keys`` and ``values`` a read-out reads, and exact attention's read-out at each ``β`` when first asked for. The
    engine hands one draw to the reference and every cell of it: episodes and exact read-out are made once."""

    def __init__(self, episodes, queries, keys, values):
        self.episodes, self.queries, self.keys, self.values = episodes, queries, keys, values
        self._exact: dict[float, readout.Readout] = {}

    def exact(self, beta: float) -> readout.Readout:
        """Exact attention's read-out at inverse temperature ``beta``."""
        if beta not in self._exact:
            self._exact[beta] = readout.attention_readout("exact", self.queries, self.keys, self.values, beta=beta)
        return self._exact[beta]

    def readouts(self, estimator, *, beta: float, **kwargs) -> tuple[readout.Readout, readout.Readout]:
        """``(read, exact)`` as :func:`kernapprox.readout.paired_readouts` (keywords as there), exact attention's
        from the draw."""
        read = readout.attention_readout(estimator, self.queries, self.keys, self.values, beta=beta, **kwargs)
        return read, self.exact(beta)




def recall_episodes(num_pairs: int, query: str, *, rng, device, num_queries: int, dim: int = 64,
                    num_candidates: int = 4096, batch: int = EPISODES) -> tasks.RecallEpisodes:
    """Recall episodes for a ``query`` axis value (:data:`QUERY_COSINES`)."""
    if query not in QUERY_COSINES:
        raise ValueError(f"unknown query value {query!r}; valid: {', '.join(QUERY_COSINES)}")
    common = {"dim": dim, "num_candidates": num_candidates, "num_queries": num_queries, "batch": batch, "rng": rng,
              "device": device}
    if QUERY_COSINES[query] is None:
        return tasks.paraphrase_recall(num_pairs, **common)
    return tasks.associative_recall(num_pairs, query_cosine=QUERY_COSINES[query], **common)


def episode_dims(episodes: int = EPISODES) -> dict:
    return {"dims": ("episode",), "coords": {"episode": list(range(episodes))}}


READOUT_METRICS = {  # metric -> (long name, units, default description, per episode) of what readout_metrics records
    "output_rel_error": ("attention-output relative RMS error", "1", "‖Ŷ−Y‖_F/‖Y‖_F against exact attention on the "
                         "same episode (inf when an output is not finite)", True),
    "nonpositive_normalizer_rate": ("rate of non-positive normalisers", "1", "fraction of the episode's queries with "
                                    "Σ_i φ(q)ᵀφ(k_i) ≤ 0 or not finite", True),
    "state_bytes": ("memory a decoder keeps from the context", "byte", "estimator.state_bytes(d_v, float32, "
                    "seq_len=n): the linear state r·(d_v+1) plus what the map keeps from the context (Nyström: r·d "
                    "landmarks and the r×r whitening), float32", False),
    "feature_dim": ("feature dimension of the state", "1", "r as fitted", False),
}


def readout_metric_table(episodes: int = EPISODES, **descriptions: str) -> dict[str, Metric]:
    """The declarations of the metrics :func:`readout_metrics` records, in its order; a keyword replaces the
    default description (:data:`READOUT_METRICS`) of the metric it names."""
    unknown = sorted(set(descriptions) - set(READOUT_METRICS))
    if unknown:
        raise ValueError(f"no read-out metric named {', '.join(unknown)}; known: {', '.join(READOUT_METRICS)}")
    return {name: Metric(long_name=long, units=units, description=descriptions.get(name, text),
                         **(episode_dims(episodes) if per_episode else {}))
            for name, (long, units, text, per_episode) in READOUT_METRICS.items()}


def readout_metrics(read: readout.Readout, exact: readout.Readout) -> dict:
    """What every cell records of a read-out against exact attention on the same episodes: per episode, the
    output's relative RMS error and the rate of non-positive normalisers; the state size (NaN for an estimator
    without a recurrent state) and the fitted feature dimension."""
    return {"output_rel_error": metrics.relative_rms_error(read.output, exact.output).cpu().numpy(),
            "nonpositive_normalizer_rate": metrics.nonpositive_normalizer_rate(read.normalizer).cpu().numpy(),
            "state_bytes": np.float64(np.nan if read.state_bytes is None else read.state_bytes),
            "feature_dim": np.float64(np.nan if read.num_features is None else read.num_features)}


# ------------------------------------------------------------------------------------------------ summaries
REPLICATES = ("seed", "episode")


def add_mean(ds: xr.Dataset, name: str) -> xr.Dataset:
    """``<name>_summary``: the mean over seed × episode with its percentile-bootstrap interval."""
    summary = stats.bootstrap_interval(ds[name], REPLICATES, "mean")
    summary.attrs.update({"long_name": ds[name].attrs["long_name"], "units": ds[name].attrs.get("units", "1"),
                          "description": f"mean of {name} over seed, episode: " + summary.attrs["interval"]})
    ds[f"{name}_summary"] = summary
    return ds


def add_vs_exact(ds: xr.Dataset, name: str, exact: str, *, reference: str = "exact attention",
                 unit: str = "episode", **attrs) -> xr.Dataset:
    """``<name>_vs_exact = name − exact`` per ``unit`` (identical inputs: the paired design) and its summary, the
    mean with its bootstrap interval over seed × episode."""
    ds[f"{name}_vs_exact"] = (ds[name] - ds[exact]).assign_attrs(
        long_name=f"{ds[name].attrs['long_name']}: − {reference} on the same {unit}", units="1",
        description=f"per {unit}, {name} − {exact} (identical {unit}s)", comparison="difference", **attrs)
    summary = stats.paired_summary(ds[f"{name}_vs_exact"], REPLICATES, statistic="mean")
    summary.attrs["description"] = f"summary of {name}_vs_exact over seed, episode: " + summary.attrs["interval"]
    ds[f"{name}_vs_exact_summary"] = summary
    return ds


def summarise_accuracy(ds: xr.Dataset, name: str, exact: str, queries) -> xr.Dataset:
    """Pooled proportions with Clopper–Pearson intervals for ``name`` and ``exact`` (``queries`` per episode: a
    number or an array of the data dims), and the paired difference ``<name>_vs_exact`` (:func:`add_vs_exact`)."""
    for var in (name, exact):
        ds = add_proportion(ds, var, (ds[var] * queries).round(), queries, REPLICATES)
    return add_vs_exact(ds, name, exact)


def summarise_readout(ds: xr.Dataset) -> xr.Dataset:
    """Summaries of the read-out metrics: output error (median, interval, tail), non-positive normalisers
    (:func:`add_mean`)."""
    return add_mean(add_summaries(ds, ["output_rel_error"], REPLICATES), "nonpositive_normalizer_rate")


def labels_with(table: dict, labels, **declared) -> list[str]:
    """The ``labels`` (in order) whose estimator in ``table`` declares the given capability values, e.g.
    ``unbiased=True`` (random-feature maps), ``fixed_dimension=True``, ``rank_limited_by_points=True`` (landmarks)."""
    caps = {label: readout.estimator_capabilities(table[label][0], **table[label][1]) for label in labels}
    return [label for label in labels if all(getattr(caps[label], k) == v for k, v in declared.items())]


# ------------------------------------------------------------------------------------------------- figures
STATE_BYTES_LABEL = "bytes of the state a decoder keeps (float32)"  # the memory axis of the score figures
STYLE_OVERRIDES = {  # variants of one family that the house style would draw alike
    "nystrom_uniform": {"marker": "o", "linestyle": "-."}, "nystrom_kmeans": {"marker": "D", "linestyle": "-"},
    "nystrom_rls": {"marker": "^", "linestyle": ":"},
    "dpfp_nu1": {"marker": "*"}, "dpfp_nu2": {"marker": ">"}, "dpfp_nu3": {"marker": "P"},
}


def style(label: str) -> dict:
    """The house style of an estimator label, with distinct markers for variants of one family."""
    return {**estimator_style(label), **STYLE_OVERRIDES.get(label, {})}


def rank_panel(ax, ds: xr.Dataset, var: str, labels, *, x: str = "feature_dim", **sel) -> None:
    """``<var>_summary`` against a per-cell size, its median over seeds (``x``: the fitted feature dimension, or
    ``"state_bytes"``, the memory a decoder keeps), one line per estimator with its interval band; maps with a
    single applicable rank are drawn as one marker with a bar."""
    summary = ds[f"{var}_summary"]
    for label in labels:
        s = summary.sel(estimator=label, **sel)
        at = ds[x].sel(estimator=label, **sel).median("seed").values
        keep = np.isfinite(at) & np.isfinite(s.sel(stat="estimate").values)
        if not keep.any():
            continue
        kw, s = style(label), s.isel(num_features=np.flatnonzero(keep))
        if keep.sum() == 1:
            errorbar_summary(ax, s, at[keep], marker=kw["marker"], markersize=7, color=kw["color"], label=label,
                             elinewidth=None)
        else:
            plot_summary(ax, s, None, xvalues=at[keep], **kw)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")


def label_panel(ax, xlabel: str, ylabel: str, title: str = "", *, accuracy: bool = False, log2_x: bool = False):
    """A panel's axis labels and title; ``accuracy``: the y range of a score in [0, 1]; ``log2_x``: a base-2 x."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, **({"ylim": (-0.03, 1.03)} if accuracy else {}))
    if log2_x:
        ax.set_xscale("log", base=2)


def exact_band(ax, summary: xr.DataArray, label: str = "exact attention (same episodes)") -> float:
    """Exact attention's score as a dashed line with its interval as a grey band; returns the estimate."""
    est, lo, hi = (float(summary.sel(stat=k)) for k in ("estimate", "lo", "hi"))
    color = estimator_style("exact")["color"]
    ax.axhline(est, color=color, linestyle="--", linewidth=1.2, label=label)
    ax.axhspan(lo, hi, color=color, alpha=0.15, linewidth=0)
    return est


def score_grid(ds: xr.Dataset, var: str, exact_var: str, *, ylabel: str, decorate, n_axis: str,
               kv_bytes: xr.DataArray):
    """A figure of a task score against the memory a decoder keeps from the context (:func:`rank_panel` on
    ``state_bytes``), rows ``beta`` and columns ``n_axis``, with one legend. Exact attention's score on the same
    episodes is drawn across each panel as a band (:func:`exact_band`) and at its KV cache at that context length
    (``kv_bytes``, along ``n_axis``) as a star on a dotted line (:func:`kernapprox.plotting.kv_cache_marker`).

    ``decorate(ax, n, beta, exact)`` adds each panel's reference lines, limits and title. Returns the figure."""
    labels, betas, ns = ([str(v) for v in ds.estimator.values], [float(v) for v in ds.beta.values],
                         [int(v) for v in ds[n_axis].values])
    fig, axes = new_figure(len(betas), len(ns), squeeze=False, sharey=True, width=4.0 * len(ns) + 1.8)
    for (i, beta), (j, n) in itertools.product(enumerate(betas), enumerate(ns)):
        ax, at = axes[i, j], {"beta": beta, n_axis: n}
        rank_panel(ax, ds, var, labels, x="state_bytes", **at)
        exact = exact_band(ax, ds[f"{exact_var}_summary"].sel(at))
        kv_cache_marker(ax, float(kv_bytes.sel({n_axis: n})), ds[f"{exact_var}_summary"].sel(at))
        label_panel(ax, STATE_BYTES_LABEL, ylabel)
        log_axis(ax, "x", unit="bytes")
        decorate(ax, n, beta, exact)
    figure_legend(fig, axes.flat)
    return fig
