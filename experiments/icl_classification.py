"""Few-shot classification of real data without training: accuracy against rank and context length.

Episodes (:func:`kernapprox.tasks.digits_classification`): scikit-learn's bundled digits (1797 images, 64
pixels, 10 classes; standardised, L2-normalised), ``n`` labelled images in context and 32 queries per episode,
drawn without replacement. Prediction = argmax of the attention-weighted one-hot labels with inverse
temperature ``β``. The episodes come from the data stream of ``(num_context, seed)``: every estimator, rank and
temperature reads the same episodes, and exact attention's and 1-NN's (the ``β → ∞`` limit) scores on them are the
reference. Data-dependent maps are fitted on the context images only. Maps whose dimension is fixed by ``d`` run
only in the ``num_features = 64`` column (drawn at their own dimension); landmark methods with more landmarks than
context images are not applicable (NaN). As in ``icl_regression``, the rank-r oracles and the position-based
hybrids are left out.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from experiments import _icl
from experiments._common import add_proportion, range_text
from kernapprox import tasks
from kernapprox.plotting import bullets, fmt_bytes, fmt_ci, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

ESTIMATORS = _icl.SET_CONTEXT_ESTIMATORS
PIXELS, CLASSES = 64, 10             # the digits task: d = 64 pixels per key, d_v = 10 one-hot labels per value

GRIDS = {
    "smoke": {"estimator": _icl.available(ESTIMATORS, ["positive_orthogonal", "taylor2", "nystrom_uniform"]),
              "num_features": [16, 64], "num_context": [64], "beta": [8.0], "seed": [0, 1]},
    "default": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
                "num_context": [100, 500], "beta": [4.0, 16.0], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws
    "full": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
             "num_context": [100, 500], "beta": [4.0, 16.0], "seed": list(range(10))},
}
DATA_AXES, REFERENCE_AXES = ("num_context", "seed"), ("num_context", "beta", "seed")
PARAMETERS = {"num_queries": Parameter(32, long_name="query images per episode", units="1")}
AXIS_ATTRS = {"num_context": {"long_name": "labelled context images n", "units": "1"},
              "beta": {"long_name": "inverse temperature β (attention scale on unit-norm images)", "units": "1"}}

METRICS = {
    "accuracy": Metric(long_name="classification accuracy", units="1",
                       description="per episode, fraction of queries whose argmax attention-weighted label is right "
                                   "(a non-finite output counts as wrong)", **_icl.episode_dims()),
    "accuracy_numerator": Metric(long_name="accuracy of the unnormalised read-out", units="1",
                                 description="as accuracy, from the numerator Σ κ̂ onehot alone (immune to "
                                             "normaliser sign flips)", **_icl.episode_dims()),
    **_icl.readout_metric_table(state_bytes="estimator.state_bytes(d_v = 10 classes, float32, seq_len=n): the "
                                            "linear state r·(d_v+1) plus what the map keeps from the context"),
}
REFERENCE_METRICS = {
    "accuracy_exact": Metric(long_name="exact-attention accuracy", units="1",
                             description="exact softmax attention on the same episodes", **_icl.episode_dims()),
    "accuracy_nearest_neighbour": Metric(long_name="1-NN accuracy", units="1",
                                         description="nearest context image by cosine, on the same episodes",
                                         **_icl.episode_dims()),
}


def draw(params, data_rng, device) -> _icl.EpisodeDraw:
    """The episodes of a ``(num_context, seed)``, which every estimator, rank and temperature reads."""
    ep = tasks.digits_classification(params["num_context"], num_queries=params["num_queries"], batch=_icl.EPISODES,
                                     rng=data_rng, device=device)
    return _icl.EpisodeDraw(ep, ep.x_query, ep.x, ep.onehot)


def run_cell(params, rng, device, data_rng, data):
    label, r, n = params["estimator"], params["num_features"], params["num_context"]
    if not _icl.applicable(ESTIMATORS, label, r, n):
        return not_applicable()
    name, options = ESTIMATORS[label]
    read, exact = data.readouts(name, beta=params["beta"], num_features=r, rng=rng, options=options)
    return {"accuracy": tasks.classification_accuracy(read.output, data.episodes).cpu().numpy(),
            "accuracy_numerator": tasks.classification_accuracy(read.numerator, data.episodes).cpu().numpy(),
            **_icl.readout_metrics(read, exact)}


def run_reference(params, device, data_rng, data):
    ep = data.episodes
    return {"accuracy_exact": tasks.classification_accuracy(data.exact(params["beta"]).output, ep).cpu().numpy(),
            "accuracy_nearest_neighbour": tasks.classification_accuracy(
                tasks.nearest_neighbour_predictions(ep), ep).cpu().numpy()}


def summarise(ds: xr.Dataset) -> xr.Dataset:
    queries = int(ds["num_queries"])
    ds = _icl.summarise_accuracy(ds, "accuracy", "accuracy_exact", queries)
    ds = _icl.summarise_accuracy(ds, "accuracy_numerator", "accuracy_exact", queries)
    ds = add_proportion(ds, "accuracy_nearest_neighbour", (ds["accuracy_nearest_neighbour"] * queries).round(),
                        queries, _icl.REPLICATES)
    ds["kv_bytes"] = _icl.kv_cache(ds["num_context"], d=PIXELS, d_v=CLASSES)
    return _icl.summarise_readout(ds)


def plot(ds: xr.Dataset, path) -> None:
    def decorate(ax, n, beta, exact):
        nn = ds["accuracy_nearest_neighbour_summary"].sel(num_context=n, beta=beta)
        ax.axhline(float(nn.sel(stat="estimate")), color="0.2", linestyle=":", linewidth=1.0, label="1-NN")
        ax.axhline(0.1, color="0.6", linestyle=(0, (1, 3)), linewidth=1.0, label="chance")
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"n = {n}, β = {beta:g}: exact {exact:.2f}, 1-NN {float(nn.sel(stat='estimate')):.2f}")

    fig = _icl.score_grid(ds, "accuracy", "accuracy_exact", ylabel="accuracy", decorate=decorate,
                          n_axis="num_context", kv_bytes=ds["kv_bytes"])
    save_figure(fig, path, (
        "Few-shot classification of scikit-learn's digits (10 classes; pixels standardised, images L2-normalised) "
        "by an attention read-out over n labelled context images (columns) with inverse temperature β (rows): "
        f"accuracy pooled over {int(ds['num_queries'])} queries × {ds.sizes['episode']} episodes × "
        f"{ds.sizes['seed']} seeds against the bytes of the state a decoder keeps from the context (float32, each "
        "estimator's own accounting: the linear state r·(d_v+1), Nyström also its landmarks and whitening; one "
        "point per feature dimension r of the grid; the same episodes for every estimator); bands and bars: 95 % "
        "Clopper–Pearson intervals. Star on the vertical dotted line: exact attention at its KV cache, n (d + d_v) "
        f"float32 numbers (d = {PIXELS}, d_v = {CLASSES}); dashed line and grey band: its accuracy across the panel; "
        "dotted: 1-NN (the β → ∞ limit); chance 0.1."),
        title="Few-shot digits classification against state bytes (KV cache marked)")


def findings(ds: xr.Dataset) -> str:
    names, ns, betas, ranks = (ds[a].values.tolist() for a in ("estimator", "num_context", "beta", "num_features"))
    acc, diff = ds["accuracy_summary"], ds["accuracy_vs_exact_summary"]
    exact, nn = ds["accuracy_exact_summary"], ds["accuracy_nearest_neighbour_summary"]
    lines, random_maps = [], _icl.labels_with(ESTIMATORS, names, unbiased=True)

    def below_kv(m, r, n) -> bool:
        """Whether the map's state at ``r`` keeps fewer bytes than exact attention's KV cache at ``n``."""
        return float(ds["state_bytes"].sel(estimator=m, num_features=r, num_context=n).median()) < float(
            ds["kv_bytes"].sel(num_context=n))

    def reaches(m, n, b, *, memory_limited: bool = True) -> list[int]:
        """The ranks r ≤ n whose paired accuracy deficit to exact attention is within 0.05 at the lower end of
        its 95 % interval (``memory_limited``: and whose state is smaller than the KV cache)."""
        return [r for r in ranks if r <= n and float(diff.sel(estimator=m, num_features=r, num_context=n, beta=b,
                                                              stat="lo")) > -0.05
                and (not memory_limited or below_kv(m, r, n))]
    if "nystrom_kmeans" in names:
        settings = [(n, b) for n in ns for b in betas]
        reached = [(reaches("nystrom_kmeans", n, b) or [None])[0] for n, b in settings]
        smallest = [r for r in reached if r is not None]
        best = diff.sel(num_features=max(ranks), estimator=random_maps).sel(stat="estimate").max("estimator")
        kv_ratio = ds["state_bytes"].sel(estimator=random_maps, num_features=max(ranks)).median("seed") / ds["kv_bytes"]
        within = (f"from r = {min(smallest)} in {sum(r == min(smallest) for r in reached)} of {len(reached)} (n, β) "
                  "settings" if smallest else f"at no grid rank in any of the {len(reached)} (n, β) settings")
        beyond = []                # settings where it reaches exact attention only with more bytes than the KV cache
        for (n, b), r_small in zip(settings, reached):
            larger = reaches("nystrom_kmeans", n, b, memory_limited=False)
            if r_small is None and larger:
                kept = ds["state_bytes"].sel(estimator="nystrom_kmeans", num_features=larger[0], num_context=n)
                beyond.append(f"n = {n}, β = {b:g}: r = {larger[0]} ({fmt_bytes(kept.median())} against "
                              f"{fmt_bytes(ds['kv_bytes'].sel(num_context=n))})")
        lines.append(
            "Nyström with k-means landmarks fitted on the context images comes within 0.05 of exact attention's "
            "accuracy on the same episodes (lower end of the paired 95 % interval) with a state smaller than exact "
            f"attention's KV cache {within}" + ("; in other settings it does so only with a state larger than the "
                                                "KV cache: " + "; ".join(beyond) if beyond else "")
            + f". The best random map at r = {max(ranks)} differs from exact attention's accuracy by "
            f"{range_text(best.values)} across them, with states of "
            f"{range_text(kv_ratio.values)} times the KV cache's bytes.")
    lines.append("Exact attention against 1-NN on the same episodes: " + "; ".join(
        f"n = {n}, β = {b:g}: {fmt_ci(exact.sel(num_context=n, beta=b))} vs {fmt_ci(nn.sel(num_context=n, beta=b))}"
        for n in ns for b in betas) + ".")
    for m in _icl.labels_with(ESTIMATORS, names, rank_limited_by_points=True):
        reach = [f"n = {n}, β = {b:g}: " + (f"r = {ok[0]}" if (ok := reaches(m, n, b)) else "none")
                 for n in ns for b in betas]
        lines.append(f"`{m}` (fitted on the context images): smallest r whose paired accuracy deficit to exact "
                     "attention is within 0.05 at the lower end of its 95 % interval, with a state smaller than the "
                     "KV cache: " + "; ".join(reach) + ".")
    if random_maps:
        r_big = max(ranks)
        parts = []
        for n in ns:
            for b in betas:
                s = diff.sel(num_features=r_big, num_context=n, beta=b, estimator=random_maps)
                best = random_maps[int(np.nanargmax(s.sel(stat="estimate").values))]
                parts.append(f"n = {n}, β = {b:g}: best `{best}` {fmt_ci(s.sel(estimator=best))}")
        lines.append(f"Random maps at r = {r_big}, accuracy minus exact attention's on the same episodes (mean per "
                     "episode): " + "; ".join(parts) + ".")
    for m in [m for m in names if m.startswith("trig")]:
        rate = ds["nonpositive_normalizer_rate_summary"].sel(estimator=m, num_features=max(ranks))
        a = acc.sel(estimator=m, num_features=max(ranks))
        lines.append(f"`{m}` at r = {max(ranks)}: " + "; ".join(
            f"β = {b:g}: accuracy {range_text(a.sel(beta=b, stat='estimate').values)}, normalisers ≤ 0 "
            f"{range_text(100 * rate.sel(beta=b, stat='estimate').values)} %" for b in betas)
            + f" (over n = {', '.join(map(str, ns))}).")
    if fixed := _icl.labels_with(ESTIMATORS, names, fixed_dimension=True):
        lines.append("Fixed maps, accuracy minus exact attention's on the same episodes: " + "; ".join(
            f"`{m}` {range_text(diff.sel(estimator=m, num_features=_icl.FIXED_DIMENSION_SLOT, stat='estimate').values)}"
            for m in fixed) + " (over the n and β of the grid).")
    return bullets(lines)


EXPERIMENT = Experiment.from_module(
    __name__, title="Training-free few-shot classification of digits: accuracy against rank and context length")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
