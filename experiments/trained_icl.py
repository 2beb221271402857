"""In-context learning in trained Transformers: does the training-free picture predict it?

Small causal Transformers are trained (:mod:`kernapprox.models`, cached under the root of :mod:`kernapprox.cache`)
on multi-query associative recall (MQAR, Zoology) and in-context linear regression (Garg et al. 2022), then:

(a) **reference**: the softmax model's score on evaluation prompts (MQAR accuracy per prompt; regression: the
    squared error over ``d`` of the predictions at the queries after the context, with least squares and ridge on
    the same prompts);
(b) **post-hoc substitution** (``substitution = all | layer0 | … | layer7``): the attention of every layer, or
    of one layer, is rebuilt from an estimator at rank ``r`` with the trained projections, nothing retrained; each
    substituted layer's attention-output error is measured on the model's own activations (the substituted
    layer against exact attention on the same input), together with the task score;
(c) **trained fixed-state models** (``substitution = trained``; full and gpu presets: the default leaves models
    trained from scratch to :mod:`experiments.recall_frontier`, whose design answers that question with a learning-rate
    sweep, training seeds and state sizes that memory limits): models trained from scratch with the estimator
    at feature dimension ``r`` in every layer (plus a short convolution, as Zoology's and Based's fixed-state
    models; :func:`kernapprox.models.presets.fixed_state`), placed on ``icl_recall``'s axes: accuracy against
    state bytes. ``(trained, exact)`` is the reference itself;
(d) **proxy validity**: the training-free read-out of ``icl_recall`` (continuous MQAR, d = 64, 4096 candidates,
    β = 2 ln n, exact queries) at the same estimator, ``r`` and number of pairs, against the post-hoc accuracy,
    for every estimator the proxy ranks that can replace a causal decoder's attention: the random maps
    (``positive_orthogonal``, ``oprf_orthogonal``, ``trig_orthogonal`` -- the map the proxy ranks first at the
    stored key, run post hoc only where the proxy reads it, :data:`PROXY_ONLY`), ``nystrom_uniform`` (the proxy's
    episode has ``n`` keys, so it reads ``min(r, n)`` landmarks, which span them all: at ``r ≥ n`` its proxy is the
    read-out at ``r = n``), ``taylor2`` and ``elu1``. Not among the points: ``window_linear``
    (:data:`PROXY_LEFT_OUT`: the trained model's window is the last tokens before a query, while the proxy's
    queries read a set of pairs without positions, so which pairs a window would hold is not defined there),
    LARA (not causal: it cannot replace a decoder's attention) and EVA (``icl_recall`` sizes it by a state budget,
    not by ``r``, so it has no point at equal ``r``).

Paired design: ``data_axes = (task, context, seed)``, so every estimator, rank and substitution reads the same
prompts (and the same proxy episodes), and the unmodified reference's score on them (with the least-squares and
ridge baselines and the heads' effective temperature) is the study's :class:`~kernapprox.sweep.Reference`,
computed once per data draw. The training seed is fixed (one model per configuration): intervals are over
evaluation seeds, not training runs. ``context`` is the number of pairs in an evaluation prompt (MQAR, at
``seq_len = context · L/N`` of the training task; regression, followed by its queries).
Substituting one layer at a time is measured at each task's largest evaluation context and at ``r = 64`` (the
column of the fixed-dimension maps) only; every other substitution at every context.

Unit of replication: the seed. The 16 prompts of a seed share its feature draw or landmark fit (one substituted
model per cell), so they are not independent draws: every interval is a cluster bootstrap over seeds, each seed
resampled with its prompts (:func:`kernapprox.stats.cluster_interval`), and a verdict (higher, lower, rank agreement)
needs at least :data:`kernapprox.stats.MIN_UNITS` seeds and a paired exact test on the per-seed means
(:func:`kernapprox.stats.paired_test`); with fewer the findings say "not resolved (k units)". The default preset
has 12 seeds: the within-r pairs below are 30 per context, and only a sign test of 12 of 12 seeds (p = 2·2⁻¹²)
passes Holm over 30 (with 10, no p-value can). The regression setup, which has no proxy and no verdict,
runs its post-hoc cells (the costliest: 8 layers) on the first 5 seeds only (``Setup.post_hoc_seeds``); its
references and intervals count the seeds that ran.

Summaries (:mod:`kernapprox.stats`, read by the figure and the findings of :mod:`experiments._trained_icl_report`):
mean scores over seeds × prompts with cluster-bootstrap intervals over seeds (``score_summary``,
``score_exact_summary``, the baselines', ``proxy_accuracy_summary``), the per-prompt paired difference from the
reference (``score_vs_exact``, its cluster interval and the Wilcoxon p-value of the per-seed means,
``score_vs_exact_p``), each layer's attention-output error (median over seeds with the range of the seeds,
``layer_error_summary``, :func:`kernapprox.stats.range_summary`: not a confidence interval) and the proxy's validity
(:mod:`experiments._trained_icl_report`), each with a cluster bootstrap over seeds that takes the same seeds for
every point: Spearman's ρ between the proxy and the post-hoc accuracy over the (estimator, r) points
(``proxy_rank_correlation``), log₂ r's own ρ with the post-hoc accuracy (``proxy_log_r_rank_correlation``), the
partial ρ controlling for log₂ r (``proxy_partial_rank_correlation``, :func:`kernapprox.stats.partial_spearman`:
the ranking the proxy adds beyond r), the order of every estimator pair at equal r (``proxy_pair_*``: the post-hoc
and proxy differences with cluster intervals, the exact sign test of the per-seed post-hoc differences, Holm over
the pairs of a context, and agree / disagree / not resolved) and the calibration gap, proxy − post-hoc accuracy
per point (``proxy_gap_summary``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

from experiments import _trained_icl_report as report
from experiments import icl_recall
from experiments._icl import EPISODES, episode_dims
from kernapprox import metrics, models, readout, stats, tasks
from kernapprox.distributions import effective_beta
from kernapprox.models import attention_heads, load_or_train, presets, record_attention_inputs, substitute
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

FIXED_SLOT = 64        # the num_features column of maps whose dimension is fixed (exact, Taylor, ELU+1)


@dataclass(frozen=True)
class Setup:
    """One trained configuration: the task family, its softmax reference (``build(device=...)`` returns
    ``(ModelConfig, task, TrainConfig)``), the evaluation contexts, the ranks at which every fixed-state family is
    trained from scratch, and further ``(estimator, r)`` models trained from scratch."""

    task: str
    build: Callable
    contexts: tuple
    trained_ranks: tuple = ()
    trained_extra: tuple = ()
    post_hoc_seeds: int | None = None    # post-hoc cells on seeds 0..k-1 only (None: every seed of the grid)

    def trains(self, label: str, r: int) -> bool:
        """Whether the fixed-state model of ``label`` at feature dimension ``r`` is trained from scratch."""
        return label in presets.FIXED_STATE_ESTIMATORS and (r in self.trained_ranks or (label, r) in self.trained_extra)


SETUPS = {
    # fixed-state models: every family at r = 16, the random map also at r = 64 (its accuracy could grow with r;
    # the deterministic maps are at 1 already at r = 16): with the softmax references, 7 models trained when the
    # checkpoint cache is cold, about 170 of the default preset's CPU seconds
    "mqar": Setup("mqar", presets.mqar, (4, 8), (16,), (("positive_orthogonal", 64),)),
    # no proxy and no verdict on regression: its post-hoc cells (the study's costliest, 8 layers) on 5 seeds
    "regression": Setup("regression", presets.regression, (4, 8, 11), post_hoc_seeds=5),
    "mqar_smoke": Setup("mqar", functools.partial(presets.mqar, d_model=32, seq_len=32, num_pairs=4, steps=12),
                        (2, 4), (16,)),
    "regression_smoke": Setup("regression", functools.partial(presets.regression, dim=3, num_points=6, steps=12), (4,)),
    # Zoology-like widths and lengths (GPU scale; not calibrated on a CPU)
    "mqar_d128_L128": Setup("mqar", functools.partial(presets.mqar, d_model=128, seq_len=128, num_pairs=16,
                                                      vocab_size=128, steps=4000), (4, 8, 16), (16, 64, 256)),
    "mqar_d256_L256": Setup("mqar", functools.partial(presets.mqar, d_model=256, seq_len=256, num_pairs=32,
                                                      vocab_size=256, steps=8000), (8, 16, 32), (16, 64, 256)),
}

# Post-hoc estimators, one table: label -> (registry name, options). Fixed-dimension maps run in the FIXED_SLOT
# column; the fixed-state models trained from scratch are presets.FIXED_STATE_ESTIMATORS' (those of this table).
ESTIMATORS = {label: (label, {"window": presets.WINDOW} if label == "window_linear" else {}) for label in (
    "exact", "positive_orthogonal", "oprf_orthogonal", "taylor2", "elu1", "window_linear", "nystrom_uniform",
    "trig_orthogonal")}
# position-based: the proxy's context is a set read by queries without positions (as in icl_recall), so the window
# a query would read is undefined there (see the module notes)
PROXY_LEFT_OUT = ("window_linear",)
# run post hoc only where the proxy reads them (MQAR, every layer substituted): they are there to test the proxy
PROXY_ONLY = ("trig_orthogonal",)
SUBSTITUTIONS = ("all", *(f"layer{i}" for i in range(8)), "trained")   # the regression reference has 8 layers

GRIDS = {
    "smoke": {"task": ["mqar_smoke", "regression_smoke"], "substitution": ["all", "layer0", "trained"],
              "estimator": ["exact", "positive_orthogonal", "elu1", "window_linear"], "num_features": [16, 64],
              "context": [2, 4], "seed": [0]},
    # no models trained from scratch (recall_frontier's question, with its own design): about 125 CPU-s of training
    # r = 16, 64, 256 (the full preset adds 32 and 128): sized with the other defaults to make figures' 25 minutes
    "default": {"task": ["mqar", "regression"], "substitution": [s for s in SUBSTITUTIONS if s != "trained"],
                "estimator": list(ESTIMATORS),
                "num_features": [16, 64, 256], "context": [4, 8, 11], "seed": list(range(12))},
    # make figures PRESET=full's share of its hour: the default's grid (its models cached) with the fixed-state
    # models trained from scratch
    "full": {"task": ["mqar", "regression"], "substitution": list(SUBSTITUTIONS), "estimator": list(ESTIMATORS),
             "num_features": [16, 32, 64, 128, 256], "context": [4, 8, 11], "seed": list(range(12))},
    # the full preset's grid with r = 512 and 1024 (not yet run)
    "ranks": {"task": ["mqar", "regression"], "substitution": list(SUBSTITUTIONS), "estimator": list(ESTIMATORS),
              "num_features": [16, 32, 64, 128, 256, 512, 1024], "context": [4, 8, 11], "seed": list(range(12))},
    # Zoology-like widths and lengths: 2 + 2 x 3 x 4 models of 4,000-8,000 steps, for a GPU
    # (benchmarks/gpu_check.sh); hours on the 2-core CPU
    "gpu": {"task": ["mqar", "regression", "mqar_d128_L128", "mqar_d256_L256"], "substitution": list(SUBSTITUTIONS),
            "estimator": list(ESTIMATORS), "num_features": [16, 32, 64, 128, 256, 512, 1024],
            "context": [4, 8, 11, 16, 32], "seed": list(range(12))},
}
PARAMETERS = {
    "proxy_beta_factor": Parameter(2.0, "proxy: β / ln n of the training-free read-out", "1"),
    "proxy_dim": Parameter(icl_recall.PARAMETERS["dim"].value, "proxy: key and value dimension d = d_v", "1",
                           "icl_recall's"),
    "proxy_candidates": Parameter(icl_recall.PARAMETERS["num_candidates"].value,
                                  "proxy: candidate values the read-out is decoded against", "1", "icl_recall's"),
    "ridge_alpha": Parameter(0.1, "regression: ridge baseline's α", "1"),
}
AXIS_ATTRS = {
    "task": {"long_name": "trained configuration (task family and model)", "units": "1"},
    "substitution": {"long_name": "what replaces the reference's attention: every layer post hoc ('all'), one layer "
                                  "post hoc ('layer<i>'), or a model trained from scratch ('trained')", "units": "1"},
    "estimator": {"long_name": "estimator (kernapprox registry name; 'exact' is softmax attention)", "units": "1"},
    "num_features": {"long_name": "feature dimension r per head", "units": "1"},
    "context": {"long_name": "pairs in an evaluation prompt", "units": "1"},
}

_PER_PROMPT = episode_dims()
METRICS = {
    "score": Metric("task score", "1", "per evaluation prompt: MQAR accuracy over its query positions; regression: "
                    "squared error / d, mean over the queries after the context", **_PER_PROMPT),
    "layer_error": Metric("attention-output relative RMS error", "1", "per layer: ‖Ŷ−Y‖_F/‖Y‖_F of the substituted "
                          "attention against exact attention on the same input (the substituted model's own "
                          "activations), median over prompts; 0 for layers left exact; NaN for trained models",
                          dims=("layer",)),
    "state_bytes": Metric("state read by the last token", "byte", "Σ over layers and heads: linear state r·(d_v+1), "
                          "KV cache n·(d_qk+d_v) for exact attention, window + linear state for the hybrid, plus "
                          "kernel·d_model for a short convolution; float32, at the prompt's length"),
    "feature_dim": Metric("feature dimension per head", "1", "r as realised (NaN for exact attention)"),
    "proxy_accuracy": Metric("training-free read-out accuracy", "1", "icl_recall's read-out (d = d_v = proxy_dim, "
                             "proxy_candidates candidates, β = proxy_beta_factor · ln n, exact queries) with n = "
                             "context pairs at the same estimator and r, per episode; MQAR cells with substitution = "
                             "all only", **_PER_PROMPT),
    "train_seconds": Metric("training time of the model trained from scratch", "s", "wall seconds of its training "
                            "run (from the checkpoint's curve; one torch thread; grows with the load of a shared "
                            "machine); substitution = trained"),
    "train_cpu_seconds": Metric("training CPU time of the model trained from scratch", "s",
                                "CPU seconds of the training process (one torch thread: the time on a quiet core); "
                                "substitution = trained"),
    "train_score": Metric("held-out score of the model trained from scratch", "1", "the training curve's last "
                          "held-out score (full task); substitution = trained"),
}
REFERENCE_METRICS = {
    "score_exact": Metric("reference score", "1", "the unmodified softmax reference model's score on the prompts "
                          "every cell of the data draw reads", **_PER_PROMPT),
    "baseline_ls": Metric("least-squares score", "1", "regression: least squares (minimum norm) on the same prompts",
                          **_PER_PROMPT),
    "baseline_ridge": Metric("ridge score", "1", "regression: ridge (α = ridge_alpha) on the same prompts",
                             **_PER_PROMPT),
    "reference_beta": Metric("effective inverse temperature of the reference", "1", "mean over heads and prompts of "
                             "s·mean‖q‖·mean‖k‖ of the reference model's layer on these prompts", dims=("layer",)),
    "seq_len": Metric("prompt length", "token", "tokens in an evaluation prompt"),
    "reference_train_seconds": Metric("training time of the softmax reference", "s",
                                      "wall seconds of its training run (one torch thread)"),
    "reference_train_cpu_seconds": Metric("training CPU time of the softmax reference", "s",
                                          "CPU seconds of its training run (one torch thread)"),
    "reference_train_score": Metric("held-out score of the softmax reference at the end of training", "1",
                                    "the training curve's last held-out score (full task)"),
}


# ----------------------------------------------------------------------------------------------- models
def _caps(label: str):
    """The estimator's declared capabilities (e.g. a dimension fixed by d: exact, Taylor, ELU+1)."""
    name, options = ESTIMATORS[label]
    return readout.estimator_capabilities(name, **options)


def applicable(setup: Setup, sub: str, label: str, r: int, context: int, num_layers: int, seed: int = 0) -> bool:
    """Whether a cell runs: the setup's contexts; trained models where the setup trains them; one layer at a time
    at the largest context and r = FIXED_SLOT only; fixed-dimension maps in the FIXED_SLOT column; post-hoc cells
    on the setup's first ``post_hoc_seeds`` seeds when it sets them."""
    if (context not in setup.contexts or (label in PROXY_ONLY and (sub != "all" or setup.task != "mqar"))
            or (sub != "trained" and setup.post_hoc_seeds is not None and seed >= setup.post_hoc_seeds)):
        return False
    if sub == "trained":
        return (label == "exact" and r == FIXED_SLOT) or setup.trains(label, r)
    if sub.startswith("layer") and (int(sub[5:]) >= num_layers or context != max(setup.contexts) or r != FIXED_SLOT):
        return False
    return (r == FIXED_SLOT) if _caps(label).fixed_dimension else True


def landmarks_available(label: str, r: int, task) -> bool:
    """Whether a map whose rank is limited by its points (Nyström) can have ``r`` landmarks: a substituted layer
    is fitted on the queries and keys of ``EPISODES`` calibration prompts of the training task (``2·EPISODES·
    seq_len`` candidates per head). Cells beyond it are not applicable (NaN), like the fixed-dimension maps outside
    their column: e.g. the ranks preset's r = 512, 1024 on the regression task's short prompts."""
    return not _caps(label).rank_limited_by_points or r <= 2 * EPISODES * task.seq_len


def _spec(label: str, r: int) -> models.AttentionSpec:
    name, options = ESTIMATORS[label]
    return models.AttentionSpec(name, num_features=None if _caps(label).fixed_dimension else r, options=options)


def state_bytes(model, seq_len: int) -> int:
    """Bytes a decoder keeps for the next token (see the metric's description)."""
    cfg = model.config
    return sum(attn.num_heads * readout.state_bytes(attn.estimator, attn.head_dim, seq_len)
               for attn in model.attentions) + cfg.num_layers * cfg.short_conv * cfg.d_model * 4


def _layer_errors(model, reference, prompts, layers) -> np.ndarray:
    out = np.zeros(len(model.blocks))
    with record_attention_inputs(model) as records:
        model(prompts.inputs)
    for i in layers:
        x = records[i][0]
        out[i] = float(metrics.relative_rms_error(model.attentions[i](x), reference.attentions[i](x)).median())
    return out


class Draw(NamedTuple):
    """The data draw of a ``(task, context, seed)``: the reference's configuration ``(ModelConfig, task,
    TrainConfig)`` and trained model, the evaluation task, its prompts and (MQAR) the proxy's episodes."""

    config: tuple
    reference: object
    eval_task: object
    prompts: object
    proxy: tasks.RecallEpisodes | None


def draw(params, data_rng, device) -> Draw | None:
    """The draw of a ``(task, context, seed)``: the evaluation task with ``context`` pairs (MQAR at the training
    task's length per pair; regression with its queries after them), its prompts, then (MQAR) the proxy's episodes,
    from ``data_rng``; None for a context the setup does not evaluate (its cells are not applicable)."""
    setup, context = SETUPS[params["task"]], params["context"]
    if context not in setup.contexts:
        return None
    config = setup.build(device=str(device))
    task = config[1]
    ev = (dataclasses.replace(task, num_pairs=context, seq_len=context * task.seq_len // task.num_pairs)
          if task.name == "mqar" else task.fixed(context))
    prompts = ev.sample(data_rng, EPISODES, device=device)
    proxy = (tasks.associative_recall(context, dim=params["proxy_dim"], value_dim=params["proxy_dim"],
                                      num_candidates=params["proxy_candidates"], batch=EPISODES, rng=data_rng,
                                      device=device) if task.name == "mqar" else None)
    return Draw(config, load_or_train(*config), ev, prompts, proxy)


def _proxy(label: str, r: int, params, episodes: tasks.RecallEpisodes, rng) -> dict:
    """``proxy_accuracy`` of the cell's estimator, or nothing where the proxy does not apply (left NaN). A map whose
    rank is limited by its points (Nyström, landmarks among the context keys) reads the proxy at ``min(r, n)``
    landmarks: an episode has ``n`` keys, and ``n`` landmarks already span all of them."""
    if label in PROXY_LEFT_OUT:
        return {}
    (name, options), caps = ESTIMATORS[label], _caps(label)
    rank = min(r, params["context"]) if caps.rank_limited_by_points else r
    read = readout.attention_readout(name, episodes.queries, episodes.keys, episodes.values, rng=rng, options=options,
                                     beta=tasks.log_n_beta(params["context"], params["proxy_beta_factor"]),
                                     num_features=None if caps.fixed_dimension else rank)
    return {"proxy_accuracy": tasks.recall_accuracy(read.output, episodes).cpu().numpy()}


@torch.no_grad()
def run_cell(params, rng, device, data_rng, data):
    setup = SETUPS[params["task"]]
    sub, label, r, context = params["substitution"], params["estimator"], params["num_features"], params["context"]
    model_config = setup.build(device=str(device))[0]
    if not applicable(setup, sub, label, r, context, model_config.num_layers, params["seed"]):
        return not_applicable()
    task, reference, ev, prompts = data.config[1], data.reference, data.eval_task, data.prompts
    result = {}
    if sub == "trained":
        evaluated = reference if label == "exact" else load_or_train(*presets.fixed_state(label, r, data.config))
        model = evaluated.model
        if label != "exact":
            result.update({k: np.float64(evaluated.curve.attrs[k]) for k in ("train_seconds", "train_cpu_seconds")},
                          train_score=np.float64(evaluated.curve.eval_score.values[-1]))
    else:
        if not landmarks_available(label, r, task):
            return not_applicable()
        layers = list(range(model_config.num_layers)) if sub == "all" else [int(sub[5:])]
        calibration = task.sample(rng, EPISODES, device=device).inputs     # for data-dependent estimators
        model = substitute(reference.model, {i: _spec(label, r) for i in layers}, rng=rng, calibration=calibration)
        result["layer_error"] = _layer_errors(model, reference.model, prompts, layers)
        if sub == "all" and task.name == "mqar":
            result.update(_proxy(label, r, params, data.proxy, rng))
    result["score"] = ev.score(model(prompts.inputs), prompts).cpu().numpy()
    result["state_bytes"] = np.float64(state_bytes(model, ev.seq_len))
    exact = model.layer_specs()[-1].estimator == "exact"
    result["feature_dim"] = np.float64(np.nan if exact else model.attentions[-1].estimator.num_features)
    return not_applicable(**result)          # what this kind of cell does not measure stays NaN


@torch.no_grad()
def run_reference(params, device, data_rng, data):
    """The unmodified softmax reference on the prompts of the data draw: its score, the regression baselines, the
    effective temperature of its layers, the prompt length and its training record."""
    if data is None:
        return not_applicable()
    ev, prompts, reference, curve = data.eval_task, data.prompts, data.reference.model, data.reference.curve
    heads = attention_heads(reference, prompts.inputs)
    out = {"score_exact": ev.score(reference(prompts.inputs), prompts).cpu().numpy(),
           "reference_beta": np.array([float(effective_beta(heads["q"][i], heads["k"][i]).mean())
                                       for i in range(data.config[0].num_layers)])}
    if data.config[1].name == "regression":
        out["baseline_ls"] = ev.baseline_score(prompts, "least_squares").cpu().numpy()
        out["baseline_ridge"] = ev.baseline_score(prompts, "ridge", params["ridge_alpha"]).cpu().numpy()
    return not_applicable(**out, seq_len=np.float64(ev.seq_len),   # the regression baselines stay NaN for MQAR
                          reference_train_seconds=np.float64(curve.attrs["train_seconds"]),
                          reference_train_cpu_seconds=np.float64(curve.attrs["train_cpu_seconds"]),
                          reference_train_score=np.float64(curve.eval_score.values[-1]))


# ------------------------------------------------------------------------------------------------ summaries
UNIT, WITHIN = "seed", ("episode",)     # the prompts of a seed share its feature draw / landmark fit


def _cluster_mean(ds: xr.Dataset, var: str) -> None:
    """``<var>_summary``: the mean of ``var`` over seeds × prompts with the cluster-bootstrap interval over seeds
    (each seed resampled with its prompts)."""
    summary = stats.cluster_interval(ds[var], UNIT, WITHIN)
    ds[f"{var}_summary"] = summary.assign_attrs(
        long_name=ds[var].attrs.get("long_name", var), units=ds[var].attrs.get("units", "1"),
        description=f"mean of {var} over seed, episode: " + summary.attrs["interval"])


def summarise(ds: xr.Dataset) -> xr.Dataset:
    """The summaries of the module notes: means and the paired difference from the reference with cluster intervals
    over seeds, its Wilcoxon p-value, the layers' errors (median and range over seeds), the proxy's validity."""
    ds["score_vs_exact"] = (ds["score"] - ds["score_exact"]).assign_attrs(
        long_name=f"{ds['score'].attrs['long_name']}: − the reference's on the same prompt", units="1",
        description="per prompt, score − score_exact (identical prompts)", comparison="difference",
        baseline="reference")
    for name in ("score", "score_exact", "baseline_ls", "baseline_ridge", "proxy_accuracy", "score_vs_exact"):
        _cluster_mean(ds, name)
    ds["score_vs_exact_summary"].attrs["neutral"] = 0.0
    ds["score_vs_exact_p"] = stats.paired_test(ds["score_vs_exact"], UNIT, WITHIN, test="wilcoxon")
    ds["layer_error_summary"] = stats.range_summary(ds["layer_error"], UNIT)     # 5 seeds: the range, named so
    return report.proxy_validity(ds)


DATA_AXES = ("task", "context", "seed")
EXPERIMENT = Experiment.from_module(
    __name__, title="Trained Transformers: post-hoc substitution, trained fixed-state models, proxy",
    plot=report.plot, findings=report.findings,
    replicates="the seeds (cluster bootstrap: each seed with its prompts, which share its feature draw or landmark "
               "fit); conditional on the one softmax reference model trained per task and the fixed-state models "
               "trained once per configuration (trained again elsewhere, with other floating-point reductions, they "
               "can move a number beyond these intervals)",
    description="Does the training-free picture predict in-context learning in trained models? Softmax references "
                "trained on MQAR and in-context linear regression; their attention replaced post hoc by each "
                "estimator at rank r (every layer or one); fixed-state models trained from scratch at feature "
                "dimension r; the training-free read-out accuracy against the trained post-hoc accuracy. Grid: "
                "task × substitution × estimator × num_features × context × seed (prompts paired over estimators).")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
