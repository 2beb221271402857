"""In-context learning in trained Transformers: does the training-free picture predict it?

Small causal Transformers are trained (:mod:`kernapprox.models`, cached under ``results/cache/``) on multi-query
associative recall (MQAR, Zoology) and in-context linear regression (Garg et al. 2022), then:

(a) **reference**: the softmax model's score on evaluation prompts (MQAR accuracy per prompt; regression: the
    squared error of the last prediction over ``d``, with least squares and ridge on the same prompts);
(b) **post-hoc substitution** (``substitution = all | layer0 | … | layer3``): the attention of every layer, or
    of one layer, is rebuilt from an estimator at rank ``r`` with the trained projections, nothing retrained; each
    substituted layer's attention-output error is measured on the model's own activations (the substituted
    layer against exact attention on the same input), together with the task score;
(c) **trained fixed-state models** (``substitution = trained``): models trained from scratch with the estimator
    at feature dimension ``r`` in every layer (plus a short convolution, as Zoology's and Based's fixed-state
    models; :func:`kernapprox.models.presets.fixed_state`), placed on ``icl_recall``'s axes: accuracy against
    state bytes. ``(trained, exact)`` is the reference itself;
(d) **proxy**: the training-free read-out of ``icl_recall`` (continuous MQAR, d = 64, 4096 candidates,
    β = 2 ln n, exact queries) at the same estimator, ``r`` and number of pairs, against the post-hoc accuracy.

Paired design: ``data_axes = (task, context, seed)``, so every estimator, rank and substitution reads the same
prompts (and the same proxy episodes); every cell also scores the unmodified reference on them. The training
seed is fixed (one model per configuration): intervals are over evaluation prompts and feature draws, not
training runs. ``context`` is the number of pairs in an evaluation prompt (MQAR, at ``seq_len = context · L/N``
of the training task; regression, followed by its queries).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr

from experiments import _trained_icl_report as report
from experiments import icl_recall
from kernapprox import metrics, readout, tasks
from kernapprox.distributions import effective_beta
from kernapprox.models import (
    AttentionSpec,
    attention_heads,
    config_key,
    load_or_train,
    presets,
    record_attention_inputs,
    substitute,
)
from kernapprox.sweep import Experiment, Metric, run_cli

EPISODES = 16          # evaluation prompts per cell (and proxy episodes)
FIXED_SLOT = 64        # the num_features column of maps whose dimension is fixed (exact, Taylor, ELU+1)
PROXY_BETA_FACTOR = 2.0
_PROXY_DIM = icl_recall.PARAMETERS["dim"].value                  # icl_recall's d = d_v
_PROXY_CANDIDATES = icl_recall.PARAMETERS["num_candidates"].value
RIDGE_ALPHA = 0.1


@dataclass(frozen=True)
class Setup:
    """One trained configuration: the task family, its softmax reference (``build(device=...)`` returns
    ``(ModelConfig, task, TrainConfig)``), the evaluation contexts and the ranks of the fixed-state models
    trained from scratch."""

    task: str
    build: Callable
    contexts: tuple
    trained_ranks: tuple = ()


SETUPS = {
    "mqar": Setup("mqar", presets.mqar, (4, 8), (16, 64)),
    "regression": Setup("regression", presets.regression, (4, 8, 11)),
    "mqar_smoke": Setup("mqar", functools.partial(presets.mqar, d_model=32, seq_len=32, num_pairs=4, steps=12),
                        (2, 4), (16,)),
    "regression_smoke": Setup("regression", functools.partial(presets.regression, dim=3, num_points=6, steps=12),
                              (4,)),
    # Zoology-like widths and lengths (GPU scale; not calibrated on a CPU)
    "mqar_d128_L128": Setup("mqar", functools.partial(presets.mqar, d_model=128, seq_len=128, num_pairs=16,
                                                      vocab_size=128, steps=4000), (4, 8, 16), (16, 64, 256)),
    "mqar_d256_L256": Setup("mqar", functools.partial(presets.mqar, d_model=256, seq_len=256, num_pairs=32,
                                                      vocab_size=256, steps=8000), (8, 16, 32), (16, 64, 256)),
}

# post-hoc estimators: label -> (registry name, options); fixed-dimension maps run in the FIXED_SLOT column
ESTIMATORS = {
    "exact": ("exact", {}),
    "positive_orthogonal": ("positive_orthogonal", {}),
    "oprf_orthogonal": ("oprf_orthogonal", {}),
    "taylor2": ("taylor2", {}),
    "elu1": ("elu1", {}),
    "window_linear": ("window_linear", {"window": presets.WINDOW}),
    "nystrom_uniform": ("nystrom_uniform", {}),
}


def _fixed_dimension(label: str) -> bool:
    """Whether the estimator's dimension is fixed by d (declared capability: exact, Taylor, ELU+1)."""
    name, options = ESTIMATORS[label]
    return readout.estimator_capabilities(name, **options).fixed_dimension

PROXY_LEFT_OUT = ("window_linear",)   # position-based: the proxy's context is a set (as in icl_recall)
SUBSTITUTIONS = ("all", "layer0", "layer1", "layer2", "layer3", "trained")

GRIDS = {
    "smoke": {"task": ["mqar_smoke", "regression_smoke"], "substitution": ["all", "layer0", "trained"],
              "estimator": ["exact", "positive_orthogonal", "elu1", "window_linear"], "num_features": [16, 64],
              "context": [2, 4], "seed": [0]},
    "default": {"task": ["mqar", "regression"], "substitution": list(SUBSTITUTIONS), "estimator": list(ESTIMATORS),
                "num_features": [16, 32, 64, 128, 256], "context": [4, 8, 11], "seed": [0, 1, 2, 3, 4]},
    "full": {"task": ["mqar", "regression", "mqar_d128_L128", "mqar_d256_L256"], "substitution": list(SUBSTITUTIONS),
             "estimator": list(ESTIMATORS), "num_features": [16, 32, 64, 128, 256, 512, 1024],
             "context": [4, 8, 11, 16, 32], "seed": list(range(8))},
}

_EPISODE = ("episode",)
_EPISODE_COORDS = {"episode": list(range(EPISODES))}
METRICS = {
    "score": Metric(long_name="task score", units="1", dims=_EPISODE, coords=_EPISODE_COORDS,
                    description="per evaluation prompt: MQAR accuracy over its query positions; regression: "
                                "squared error / d, mean over the queries after the context"),
    "score_exact": Metric(long_name="reference score", units="1", dims=_EPISODE, coords=_EPISODE_COORDS,
                          description="the unmodified softmax reference model's score on the same prompts"),
    "layer_error": Metric(long_name="attention-output relative RMS error", units="1", dims=("layer",),
                          description="per layer: ‖Ŷ−Y‖_F/‖Y‖_F of the substituted attention against exact attention "
                                      "on the same input (the substituted model's own activations), median over "
                                      "prompts; 0 for layers left exact; NaN for trained models"),
    "reference_beta": Metric(long_name="effective inverse temperature of the reference", units="1",
                             dims=("layer",), description="mean over heads and prompts of s·mean‖q‖·mean‖k‖ "
                                                          "of the reference model's layer on these prompts"),
    "state_bytes": Metric(long_name="state read by the last token", units="byte",
                          description="Σ over layers and heads: linear state r·(d_v+1), KV cache n·(d_qk+d_v) for "
                                      "exact attention, window + linear state for the hybrid, plus kernel·d_model "
                                      "for a short convolution; float32, at the prompt's length"),
    "feature_dim": Metric(long_name="feature dimension per head", units="1",
                          description="r as realised (NaN for exact attention)"),
    "seq_len": Metric(long_name="prompt length", units="token", description="tokens in an evaluation prompt"),
    "proxy_accuracy": Metric(long_name="training-free read-out accuracy", units="1", dims=_EPISODE,
                             coords=_EPISODE_COORDS,
                             description="icl_recall's read-out (d = 64, 4096 candidates, β = 2 ln n, exact "
                                         "queries) with n = context pairs at the same estimator and r, per "
                                         "episode; MQAR cells with substitution = all only"),
    "baseline_ls": Metric(long_name="least-squares score", units="1", dims=_EPISODE, coords=_EPISODE_COORDS,
                          description="regression: least squares (minimum norm) on the same prompts"),
    "baseline_ridge": Metric(long_name="ridge score", units="1", dims=_EPISODE, coords=_EPISODE_COORDS,
                             description=f"regression: ridge (α = {RIDGE_ALPHA}) on the same prompts"),
    "train_seconds": Metric(long_name="training time of the evaluated model", units="s",
                            description="wall seconds of its training run (from the checkpoint's curve; one torch "
                                        "thread; grows with the load of a shared machine)"),
    "train_cpu_seconds": Metric(long_name="training CPU time of the evaluated model", units="s",
                                description="CPU seconds of the training process (one torch thread: the time on a "
                                            "quiet core)"),
    "train_score": Metric(long_name="held-out score at the end of training", units="1",
                          description="the training curve's last held-out score (full task)"),
}


# ----------------------------------------------------------------------------------------------- models
_MODELS: dict[str, object] = {}


def trained(config):
    """The trained model of ``(ModelConfig, task, TrainConfig)``, from the checkpoint cache (memoised)."""
    key = config_key(*config)
    if key not in _MODELS:
        _MODELS[key] = load_or_train(*config)
    return _MODELS[key]


def eval_task(task, context: int):
    """The evaluation task with ``context`` pairs (MQAR at the training task's length per pair; regression with
    its queries after them)."""
    if task.name == "mqar":
        return dataclasses.replace(task, num_pairs=context, seq_len=context * task.seq_len // task.num_pairs)
    return task.fixed(context)


def applicable(setup: Setup, sub: str, label: str, r: int, context: int, num_layers: int) -> bool:
    if context not in setup.contexts:
        return False
    if sub == "trained":
        return (label == "exact" and r == FIXED_SLOT) or (label in presets.FIXED_STATE_ESTIMATORS
                                                          and r in setup.trained_ranks)
    if sub.startswith("layer") and int(sub[5:]) >= num_layers:
        return False
    return (r == FIXED_SLOT) if _fixed_dimension(label) else True


def _spec(label: str, r: int) -> AttentionSpec:
    name, options = ESTIMATORS[label]
    return AttentionSpec(name, num_features=None if _fixed_dimension(label) else r, options=options)


def state_bytes(model, seq_len: int) -> int:
    """Bytes a decoder keeps for the next token (see the metric's description)."""
    total = 0
    for attn in model.attentions:
        total += attn.num_heads * readout.state_bytes(attn.estimator, attn.head_dim, seq_len)
    conv = model.config.short_conv
    return total + model.config.num_layers * conv * model.config.d_model * 4


def _feature_dim(model) -> float:
    est = model.attentions[-1].estimator
    return np.nan if model.layer_specs()[-1].estimator == "exact" else float(est.num_features)


def _layer_errors(model, reference, prompts, layers) -> np.ndarray:
    out = np.zeros(len(model.blocks))
    with record_attention_inputs(model) as records:
        model(prompts.inputs)
    for i in layers:
        x = records[i][0]
        err = metrics.relative_rms_error(model.attentions[i](x), reference.attentions[i](x))
        out[i] = float(err.median())
    return out


_EPISODES: dict = {}


def _proxy_episodes(context: int, data_rng, device):
    """The proxy's episodes of a data stream: drawn once per process for the cells that share the stream (the
    4096-candidate tables are the costly part of a cell)."""
    seq = data_rng.bit_generator.seed_seq
    key = (seq.entropy, tuple(seq.spawn_key), context, str(device))
    if key in _EPISODES:
        _EPISODES[key] = _EPISODES.pop(key)                   # most recently used last
    else:
        if len(_EPISODES) >= 16:                              # 16 MB each; a preset cycles through contexts × seeds
            _EPISODES.pop(next(iter(_EPISODES)))
        _EPISODES[key] = tasks.associative_recall(context, dim=_PROXY_DIM, value_dim=_PROXY_DIM,
                                                  num_candidates=_PROXY_CANDIDATES, batch=EPISODES,
                                                  rng=data_rng, device=device)
    return _EPISODES[key]


def _proxy(label: str, r: int, context: int, rng, data_rng, device) -> np.ndarray:
    episodes = _proxy_episodes(context, data_rng, device)
    name, options = ESTIMATORS[label]
    caps = readout.estimator_capabilities(name, **options)
    if label in PROXY_LEFT_OUT or (caps.rank_limited_by_points and r > context):
        return np.full(EPISODES, np.nan)
    read, _ = readout.paired_readouts(name, episodes.queries, episodes.keys, episodes.values,
                                      beta=tasks.log_n_beta(context, PROXY_BETA_FACTOR),
                                      num_features=None if caps.fixed_dimension else r, rng=rng, options=options)
    return tasks.recall_accuracy(read.output, episodes).cpu().numpy()


def _nan_result() -> dict:
    out = {}
    for name, metric in METRICS.items():
        out[name] = np.full(EPISODES, np.nan) if metric.dims == _EPISODE else np.float64(np.nan)
    return out


@torch.no_grad()
def run_cell(params, rng, device, data_rng):
    setup = SETUPS[params["task"]]
    sub, label, r, context = params["substitution"], params["estimator"], params["num_features"], params["context"]
    ref_config = setup.build(device=str(device))
    model_config, task, _ = ref_config
    if not applicable(setup, sub, label, r, context, model_config.num_layers):
        return _nan_result()
    reference = trained(ref_config)
    ev = eval_task(task, context)
    prompts = ev.sample(data_rng, EPISODES, device=device)
    ref_out = reference.model(prompts.inputs)
    result = _nan_result()
    result["score_exact"] = ev.score(ref_out, prompts).cpu().numpy()
    heads = attention_heads(reference.model, prompts.inputs)
    result["reference_beta"] = np.array([float(effective_beta(heads["q"][i], heads["k"][i]).mean())
                                         for i in range(model_config.num_layers)])
    if sub == "trained":
        evaluated = reference if label == "exact" else trained(presets.fixed_state(label, r, ref_config))
        model = evaluated.model
        outputs = model(prompts.inputs)
    else:
        layers = list(range(model_config.num_layers)) if sub == "all" else [int(sub[5:])]
        calibration = task.sample(rng, EPISODES, device=device).inputs     # for data-dependent estimators
        model = substitute(reference.model, {i: _spec(label, r) for i in layers}, rng=rng, calibration=calibration)
        outputs = model(prompts.inputs)
        result["layer_error"] = _layer_errors(model, reference.model, prompts, layers)
        evaluated = reference
        if sub == "all" and task.name == "mqar":
            result["proxy_accuracy"] = _proxy(label, r, context, rng, data_rng, device)
    result["score"] = ev.score(outputs, prompts).cpu().numpy()
    if task.name == "regression":
        result["baseline_ls"] = ev.baseline_score(prompts, "least_squares").cpu().numpy()
        result["baseline_ridge"] = ev.baseline_score(prompts, "ridge", RIDGE_ALPHA).cpu().numpy()
    result["state_bytes"] = np.float64(state_bytes(model, ev.seq_len))
    result["feature_dim"] = np.float64(_feature_dim(model))
    result["seq_len"] = np.float64(ev.seq_len)
    result["train_seconds"] = np.float64(evaluated.curve.attrs["train_seconds"])
    result["train_cpu_seconds"] = np.float64(evaluated.curve.attrs["train_cpu_seconds"])
    result["train_score"] = np.float64(evaluated.curve.eval_score.values[-1])
    return result


def findings(ds: xr.Dataset) -> str:
    """Markdown bullets; every number is computed from ``ds`` (see :mod:`experiments._trained_icl_report`)."""
    return report.findings(ds)


def plot(ds: xr.Dataset, path) -> None:
    report.plot(ds, path)


EXPERIMENT = Experiment(
    name="trained_icl", title="Trained Transformers: post-hoc substitution, trained fixed-state models, proxy",
    description="Does the training-free picture predict in-context learning in trained models? Softmax references "
                "trained on MQAR and in-context linear regression; their attention replaced post hoc by each "
                "estimator at rank r (every layer or one); fixed-state models trained from scratch at feature "
                "dimension r; the training-free read-out accuracy against the trained post-hoc accuracy. Grid: "
                "task × substitution × estimator × num_features × context × seed (prompts paired over estimators).",
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot, data_axes=("task", "context", "seed"))

if __name__ == "__main__":
    run_cli(EXPERIMENT)
