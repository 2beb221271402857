"""In-context (Nadaraya–Watson) regression without training: error against rank and context length.

Episodes (:func:`kernapprox.tasks.smooth_regression`): ``n`` points uniform on the sphere S³ (d = 4) labelled by
a Gaussian-process draw (squared-exponential covariance, lengthscale 0.7, unit variance) plus noise of standard
deviation 0.1; 64 fresh queries are predicted by the attention read-out with inverse bandwidth ``β`` (the
attention scale on unit-norm inputs; on the sphere ``exp(β xᵀy) ∝ exp(−β‖x−y‖²/2)``). Score: normalised MSE
against the noise-free function (1 = predicting the mean). The episodes come from the data stream of
``(num_context, seed)``: every estimator, rank and bandwidth reads the same episodes, and exact attention's score on
them is the reference. Data-dependent maps are fitted on the context points only. Maps whose dimension is fixed by
``d`` run only in the ``num_features = 64`` column (drawn at their own dimension); landmark methods with more
landmarks than context points are not applicable (NaN). The rank-r oracles are left to ``rank_summary`` and the
position-based hybrids are left out: the context is a set, not a sequence whose positions relate to the queries.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from experiments import _icl
from experiments._common import add_summaries, range_text
from kernapprox import tasks
from kernapprox.plotting import bullets, fmt, fmt_ci, fmt_pct, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

ESTIMATORS = _icl.SET_CONTEXT_ESTIMATORS
LABELS = 1                           # d_v: one real-valued label per context point

GRIDS = {
    "smoke": {"estimator": _icl.available(ESTIMATORS, ["positive_orthogonal", "trig_orthogonal", "nystrom_uniform"]),
              "num_features": [16, 32], "num_context": [32], "beta": [8.0], "seed": [0, 1]},
    "default": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
                "num_context": [64, 512], "beta": [8.0, 32.0], "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default over ten draws
    "full": {"estimator": _icl.available(ESTIMATORS, list(ESTIMATORS)), "num_features": [16, 64, 256, 1024],
             "num_context": [64, 512], "beta": [8.0, 32.0], "seed": list(range(10))},
}
DATA_AXES, REFERENCE_AXES = ("num_context", "seed"), ("num_context", "beta", "seed")
PARAMETERS = {
    "dim": Parameter(4, long_name="input dimension d (points on the sphere S^(d−1))", units="1"),
    "lengthscale": Parameter(0.7, long_name="lengthscale of the Gaussian-process target", units="1"),
    "noise_std": Parameter(0.1, long_name="standard deviation of the label noise", units="1"),
    "num_queries": Parameter(64, long_name="fresh queries per episode", units="1"),
}
AXIS_ATTRS = {"num_context": {"long_name": "context points n", "units": "1"},
              "beta": {"long_name": "inverse bandwidth β (attention scale on unit-norm inputs)", "units": "1"}}

METRICS = {
    "nmse": Metric(long_name="normalised MSE", units="1",
                   description="per episode, Σ(ŷ−f)²/Σ(f−f̄)² over its queries", **_icl.episode_dims()),
    **_icl.readout_metric_table(),
}
REFERENCE_METRICS = {
    "nmse_exact": Metric("normalised MSE of exact attention", "1",
                         "the same for exact softmax attention on the same episodes", **_icl.episode_dims()),
}


def draw(params, data_rng, device) -> _icl.EpisodeDraw:
    """The episodes of a ``(num_context, seed)``, which every estimator, rank and bandwidth reads."""
    ep = tasks.smooth_regression(params["num_context"], dim=params["dim"], num_queries=params["num_queries"],
                                 lengthscale=params["lengthscale"], noise_std=params["noise_std"], num_outputs=LABELS,
                                 batch=_icl.EPISODES, rng=data_rng, device=device)
    return _icl.EpisodeDraw(ep, ep.x_query, ep.x, ep.y)


def run_cell(params, rng, device, data_rng, data):
    label, r, n = params["estimator"], params["num_features"], params["num_context"]
    if not _icl.applicable(ESTIMATORS, label, r, n):
        return not_applicable()
    name, options = ESTIMATORS[label]
    read, exact = data.readouts(name, beta=params["beta"], num_features=r, rng=rng, options=options)
    return {"nmse": tasks.normalized_mse(read.output, data.episodes).cpu().numpy(), **_icl.readout_metrics(read, exact)}


def run_reference(params, device, data_rng, data):
    return {"nmse_exact": tasks.normalized_mse(data.exact(params["beta"]).output, data.episodes).cpu().numpy()}


def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds = add_summaries(ds, ["nmse", "nmse_exact"], _icl.REPLICATES)
    ratio = (ds["nmse"] / ds["nmse_exact"]).assign_attrs(
        long_name="normalised MSE over exact attention's on the same episode", units="1",
        description="per episode, nmse / nmse_exact (identical episodes)", comparison="ratio")
    ds["nmse_vs_exact"] = ratio
    ds = add_summaries(ds, ["nmse_vs_exact"], _icl.REPLICATES, tail_threshold=None)
    ds["nmse_vs_exact_summary"].attrs["neutral"] = 1.0
    return _icl.summarise_readout(ds)


# ---------------------------------------------------------------------------------------------------- figure
def plot(ds: xr.Dataset, path) -> None:
    def decorate(ax, n, beta, exact):
        ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.0, label="context mean (nMSE = 1)")
        ax.set_yscale("log")
        ax.set_ylim(0.01, 30)
        ax.set_title(f"n = {n}, β = {beta:g} (exact: {exact:.3f})")

    d = int(ds["dim"])
    fig = _icl.score_grid(ds, "nmse", "nmse_exact", ylabel="normalised MSE", decorate=decorate,
                          n_axis="num_context", kv_bytes=_icl.kv_cache(ds["num_context"], d=d, d_v=LABELS))
    save_figure(fig, path, (
        f"In-context Nadaraya–Watson regression of Gaussian-process draws on the sphere S^{d - 1} "
        f"(lengthscale {float(ds['lengthscale']):g}, noise {float(ds['noise_std']):g}): normalised MSE of "
        f"{int(ds['num_queries'])} fresh queries against the noise-free function, against the bytes of the state a "
        "decoder keeps from the context (float32, each estimator's own accounting: the linear state r·(d_v+1), "
        "Nyström also its landmarks and whitening; one point per feature dimension r of the grid), for n context "
        f"points (columns) and inverse bandwidth β (rows). Lines: median over {ds.sizes['seed']} seeds × "
        f"{ds.sizes['episode']} episodes (the same episodes for every estimator); bands and bars: 95 % bootstrap "
        "intervals of the median. Star on the vertical dotted line: exact attention at its KV cache, n (d + d_v) "
        f"float32 numbers (d = {d}, d_v = {LABELS}); dashed line and grey band: its normalised MSE across the panel; "
        "dotted: predicting the mean. Values above the top of the axis (including failed read-outs) are clipped."),
        title="In-context regression against state bytes (KV cache marked)")


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> str:
    names, ns, betas, ranks = (ds[a].values.tolist() for a in ("estimator", "num_context", "beta", "num_features"))
    ratio, nmse, lines = ds["nmse_vs_exact_summary"], ds["nmse_summary"], []
    nystrom, n_small = _icl.labels_with(ESTIMATORS, names, rank_limited_by_points=True), min(ns)
    if nystrom and n_small in ranks:
        gap = float(abs(ds["nmse"].sel(estimator=nystrom, num_features=n_small, num_context=n_small)
                        - ds["nmse_exact"].sel(num_context=n_small)).max())
        lines.append(f"With r = n = {n_small} landmarks fitted on the context, every Nyström map reproduces exact "
                     f"attention's score on each of the same {ds.sizes['seed'] * ds.sizes['episode']} episodes "
                     f"(largest |nMSE difference| {fmt(gap)}).")
    exact = ds["nmse_exact_summary"]
    lines.append("Exact attention's normalised MSE: " + "; ".join(
        f"n = {n}, β = {b:g}: {fmt_ci(exact.sel(num_context=n, beta=b))}" for b in betas for n in ns) + ".")
    n_big, r_big = max(ns), max(ranks)
    if nystrom:
        half = max(r for r in ranks if r <= n_big)
        parts = [f"`{m}` at r = {half}, β = {b:g}: {fmt_ci(ratio.sel(estimator=m, num_features=half, num_context=n_big, beta=b))}"  # noqa: E501
                 for m in nystrom for b in betas]
        lines.append(f"Nyström at n = {n_big}, per-episode nMSE over exact attention's (median, 95 % interval): "
                     + "; ".join(parts) + ".")
    if random_maps := _icl.labels_with(ESTIMATORS, names, unbiased=True):
        parts = []
        for b in betas:
            s = ratio.sel(num_features=r_big, num_context=n_big, beta=b, estimator=random_maps)
            best = random_maps[int(np.nanargmin(s.sel(stat="estimate").values))]
            parts.append(f"β = {b:g}: best `{best}` {fmt_ci(s.sel(estimator=best))}, range of medians "
                         f"{range_text(s.sel(stat='estimate').values)}")
        lines.append(f"Random maps at r = {r_big}, n = {n_big}, nMSE over exact attention's on the same episodes: "
                     + "; ".join(parts) + ".")
    for m in [m for m in names if m.startswith("trig")][:1]:
        parts = []
        for b in betas:
            s = nmse.sel(estimator=m, num_context=n_big, beta=b)
            rate = ds["nonpositive_normalizer_rate_summary"].sel(estimator=m, num_context=n_big, beta=b)
            parts.append(f"β = {b:g}: share of episodes with nMSE > 1 from "
                         f"{fmt_pct(float(s.sel(stat='tail').isel(num_features=0)))} at r = {ranks[0]} to "
                         f"{fmt_pct(float(s.sel(stat='tail').isel(num_features=-1)))} at r = {ranks[-1]}; normalisers "
                         f"≤ 0 {fmt_ci(rate.isel(num_features=0), percent=True)} at r = {ranks[0]}")
        lines.append(f"`{m}` at n = {n_big}: " + "; ".join(parts) + ".")
    if fixed := _icl.labels_with(ESTIMATORS, names, fixed_dimension=True):
        lines.append("Fixed maps (their own dimension): " + "; ".join(
            f"`{m}` {range_text(nmse.sel(estimator=m, num_features=_icl.FIXED_DIMENSION_SLOT, stat='estimate').values)}"
            for m in fixed) + " (median nMSE over the n and β of the grid).")
    return bullets(lines)


EXPERIMENT = Experiment.from_module(
    __name__, title="Training-free in-context regression: error against rank and context length")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
