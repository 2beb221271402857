"""SmolLM2-135M as an RNN: what a fixed-size state keeps of a pretrained causal language model's perplexity and recall,
against the memory a decoder holds, and how much softmax a hybrid must keep, and where.

Every cell converts the pretrained model (:func:`kernapprox.convert`, transformers' Llama attention interface: the
model's own rotary positions and grouped-query heads) so that ``num_features``-dimensional feature maps replace
softmax attention in every layer except ``exact_layers`` softmax layers, placed evenly (layer ``⌊i·30/k⌋`` for
``i < k``) or where the label's measured per-layer sensitivity is largest (``placement``), and measures on the same
tokens as the exact model (paired): (a) the next-token NLL of ``n_windows`` disjoint windows of ``context`` tokens
of held-out text (Shakespeare's works of the evaluation split, :func:`kernapprox.lm.text_windows`; no map is fitted
on them), (b) recall on ``n_prompts`` prompts of ``context`` tokens per task, the fact at depths 0.1 to 0.9: a
passkey hidden in the same split's text (:func:`kernapprox.lm_eval.passkey_prompt`) and a key–value lookup in
natural language (:func:`kernapprox.lm_eval.kv_lookup_prompt`), each scored by the answer's log-probability and by
whether greedy decoding gives it, against chance (``1 / candidates``), (c) the RNN mode: prefill of the first
``decode_len`` tokens of window 0 but the last ``n_decode``, then decoding those one at a time through the converted
model's fixed-size cache, against the parallel pass's logits, with the seconds per step, and the bytes the cache
holds after the whole window (all layers, kept softmax layers' KV caches included), (d) for the labels with a
sensitivity placement, each layer substituted alone on the calibration windows: the NLL increase (the sensitivity
that places the softmax layers) and each head's attention-output error on the exact model's activations.

Data-dependent maps (Nyström) and the trainable Hedgehog maps (attention transfer, Zhang et al. 2024) are fitted on
``n_calibration`` windows of the calibration split only. Every map is one draw per key/value head
(``share_heads="group"``), so a decoder keeps one state per key/value head as the model's KV cache keeps one key and
value per key/value head (``positive_orthogonal_shared``: one draw per layer, ``share_heads=True``). The exact
model's NLL and recall, a context-free unigram model of the calibration split (the trivial baseline of the NLL:
add-one smoothed token frequencies), recall's chance, and the exact model's per-token decode time with KV caches of
1k to 32k tokens (random keys and values of the cache's true shape: the step's work does not depend on their values)
are the study's reference. The unit of replication of the NLL is the text window and of recall the prompt (the exact
model reads the same ones); the maps are one draw per ``map_seed``. Every label runs at ``hybrid_rank`` with every
layer substituted; the rank sweep is FAVOR+'s, and the kept softmax layers per label and placement are in
:data:`RUNS`. Presets: ``default`` (192 tokens: FAVOR+ and the window hybrid), ``full`` (the default with FAVOR+'s
rank sweep), ``placements`` (512 tokens, two map draws: FAVOR+'s rank sweep and the window hybrid's six softmax layers
placed evenly, by sensitivity, first or last),
``maps`` (512 tokens: every label of :data:`ESTIMATORS` at ``hybrid_rank``, the maps of fixed dimension, taylor2 and
elu1, at theirs) and ``long`` (2048 and 4096 tokens: FAVOR+ and the window hybrid). (c) also gives the free-running
greedy continuation of window 0 against the exact model's and each window's teacher-forced agreement of greedy next
tokens, and (d) the kernel error of each head (the first link of the chain kernel error → attention-output error →
NLL).
LARA is not causal and EVA keeps no decoding state, so neither can decode as an RNN here.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments import _lm
from kernapprox import lm, lm_eval, stats
from kernapprox.plotting import (
    estimator_style,
    fmt,
    fmt_bytes,
    fmt_ci,
    log_axis,
    new_figure,
    save_figure,
)
from kernapprox.surgery.cache import KernelCache
from kernapprox.surgery.conversion import TRAINABLE_MAPS
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

LM_REASON = _lm.unavailable("causal_lm")

# label -> (kernapprox.convert estimator, estimator options, conversion options); one table for the study
# one map per key/value head (share_heads="group"): the decoder keeps one state per key/value head, as the model's
# own KV cache keeps one key and value per key/value head (Hedgehog's trainable maps are per key/value head already)
GROUP = {"share_heads": "group"}
ESTIMATORS = {
    "positive_orthogonal": ("positive_orthogonal", {}, GROUP),                # FAVOR+ (Choromanski et al. 2021)
    "positive_orthogonal_shared": ("positive_orthogonal", {}, {"share_heads": True}),   # one draw per layer
    "nystrom_uniform": ("nystrom_uniform", {}, GROUP),                        # fitted on the calibration windows
    "window_linear": ("window_linear", {"window": 64}, GROUP),                # Based-style: 64 exact + positive RF
    "hedgehog_trainable": ("hedgehog_trainable", {"fit_steps": 30}, {}),      # attention transfer on calibration
    "oprf_orthogonal": ("oprf_orthogonal", {}, GROUP),        # optimised positive RF, its statistics fitted
    "trig_orthogonal": ("trig_orthogonal", {}, GROUP),        # trigonometric RF (Rahimi & Recht; Performer §2.3)
    "taylor2": ("taylor2", {}, GROUP),                        # 2nd-order Taylor map (Based): dimension fixed by d
    "elu1": ("elu1", {}, GROUP),                              # elu + 1 (Katharopoulos et al. 2020): dimension d
}
# labels whose map has a dimension fixed by the head's (r is theirs, not the grid's num_features)
FIXED_DIMENSION = tuple(label for label, (name, options, _) in ESTIMATORS.items()
                        if name not in TRAINABLE_MAPS and ka.capabilities(name, **options).fixed_dimension)
# what each label runs besides r = hybrid_rank with every layer substituted: FAVOR+'s rank sweep ("ranks"), and the
# numbers of softmax layers kept evenly spaced ("even") or where the label's per-layer sensitivity is largest
# ("sensitivity"), at hybrid_rank; a preset's exact_layers axis says which of them run
RUNS = {"positive_orthogonal": {"ranks": True, "even": (15,)},
        "positive_orthogonal_shared": {}, "nystrom_uniform": {},
        "window_linear": {"even": (6, 15), "sensitivity": (2, 6, 15), "first": (6,), "last": (6,)},
        "hedgehog_trainable": {"even": (15,)},
        "oprf_orthogonal": {}, "trig_orthogonal": {}, "taylor2": {}, "elu1": {}}
NUM_LAYERS = lm.NUM_LAYERS
NUM_HEADS = 9
PLACEMENTS = ("even", "sensitivity", "first", "last")
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)

GRIDS = {
    "smoke": {"estimator": ["positive_orthogonal", "window_linear"], "num_features": [64],
              "exact_layers": [0, 2], "placement": ["even", "sensitivity"], "context": [96], "map_seed": [0]},
    # ~4 min of one core with the model cached (4 cells: 10 windows and 10 prompts per task of 192 tokens each;
    # the sensitivity scan); the rank sweep is the full preset's; Nyström, 512 tokens and beyond the named presets'
    "default": {"estimator": ["positive_orthogonal", "window_linear"],
                "num_features": [64], "exact_layers": [0, 6], "placement": ["even", "sensitivity"],
                "context": [192], "map_seed": [0]},
    # make figures PRESET=full's share of its hour (~10 min of one core): the default's design with FAVOR+'s rank
    # sweep; the placements, maps and long presets go further, apart from make figures
    "full": {"estimator": ["positive_orthogonal", "window_linear"], "num_features": [16, 64, 256],
             "exact_layers": [0, 6], "placement": ["even", "sensitivity"], "context": [192], "map_seed": [0]},
    # two map draws at 512 tokens: FAVOR+'s rank sweep and the window hybrid with 6 softmax layers placed each way
    # (~75 min with --threads 2, make causal-lm-placements); Nyström, Hedgehog and one draw per layer join with
    # --set estimator=...
    "placements": {"estimator": ["positive_orthogonal", "window_linear"], "num_features": [16, 64, 256],
                   "exact_layers": [0, 6], "placement": list(PLACEMENTS), "context": [512], "map_seed": [0, 1]},
    # every map at r = hybrid_rank with every layer substituted, at the placements preset's 512 tokens and first map
    # draw (~15 min with --threads 2): the random maps (FAVOR+ per key/value head and per layer, OPRF, trigonometric),
    # Nyström and OPRF fitted on calibration text, Hedgehog's attention transfer, the fixed maps taylor2 and elu1, and
    # the window hybrid
    "maps": {"estimator": list(ESTIMATORS), "num_features": [64], "exact_layers": [0], "placement": ["even"],
             "context": [512], "map_seed": [0]},
    # the long contexts (~40 min of two cores): the 1/8 and 1/64 budgets of the KV cache at 2048 tokens, and recall
    # at 2048 and 4096 tokens
    "long": {"estimator": ["positive_orthogonal", "window_linear"], "num_features": [16, 64], "exact_layers": [0, 2],
             "placement": ["even", "sensitivity"], "context": [2048, 4096], "map_seed": [0]},
}
DATA_AXES = REFERENCE_AXES = ("context",)    # the draw: the model, its held-out windows and prompts
PARAMETERS = {
    "n_windows": Parameter(10, long_name="held-out text windows (the NLL's units)", units="1"),
    "n_prompts": Parameter(10, long_name="recall prompts per task (recall's units), depths 0.1 to 0.9", units="1"),
    "n_calibration": Parameter(4, long_name="calibration windows the data-dependent maps are fitted on", units="1",
                               description="of the calibration split, min(context, 256) tokens each"),
    "n_sensitivity": Parameter(4, long_name="calibration windows of the per-layer sensitivity", units="1",
                               description="the first of the n_calibration windows"),
    "n_decode": Parameter(8, long_name="tokens decoded one at a time after the prefill", units="token"),
    "n_continue": Parameter(16, long_name="tokens of the greedy continuation compared with the exact model's",
                            units="token", description="after the first decode_len tokens of window 0"),
    "decode_len": Parameter(128, long_name="tokens of window 0 in the decoding check", units="token",
                            description="prefill of decode_len − n_decode tokens, then n_decode one at a time"),
    "hybrid_rank": Parameter(64, long_name="r of every estimator outside FAVOR+'s rank sweep", units="1",
                             description="and of every cell that keeps softmax layers (RUNS)"),
}
AXIS_ATTRS = {
    "num_features": {"long_name": "features per head r", "units": "1"},
    "exact_layers": {"long_name": "softmax layers kept (the others substituted)", "units": "1"},
    "placement": {"long_name": "which layers keep softmax attention",
                  "description": "even: layers ⌊i·30/k⌋, i < k; sensitivity: the k layers whose substitution alone "
                                 "raises the calibration windows' NLL most (layer_delta_nll of the label at "
                                 "hybrid_rank and map_seed); first / last: the first / last k layers"},
    "layer": {"long_name": "decoder layer", "units": "1"},
    "head": {"long_name": "query head", "units": "1"},
    "context": {"long_name": "tokens per text window and per recall prompt", "units": "token"},
    "map_seed": {"long_name": "draw of every substituted head's map (projections, landmarks, initialisation)",
                 "units": "1"},
    "window": {"long_name": "held-out text window", "units": "1"},
    "prompt": {"long_name": "recall prompt (the fact at depth 0.1 to 0.9 of the prompt)", "units": "1"},
    "task": {"long_name": "recall task",
             "description": "passkey: a 5-digit key hidden in held-out text (kernapprox.lm_eval.passkey_prompt); "
                            "kv_lookup: a list of people's locker numbers in sentences, one asked for "
                            "(kernapprox.lm_eval.kv_lookup_prompt)"},
    "decode_context": {"long_name": "tokens in the exact model's KV cache", "units": "token"},
}
_W, _P = ("window",), ("task", "prompt")
_TASKS = {"task": list(_lm.TASKS)}
METRICS = {
    "nll": Metric("mean next-token NLL of the window", "nats", "substituted model, mean over the window's "
                  "positions of −log p(x_{t+1} | x_≤t)", dims=_W),
    "answer_logprob": Metric("log-probability of the recalled answer", "nats", "teacher-forced, summed over the "
                             "answer's tokens", dims=_P, coords=_TASKS),
    "greedy_correct": Metric("greedy decoding gives the recalled answer", "1", "1 if every answer token is the argmax",
                             dims=_P, coords=_TASKS),
    "state_bytes": Metric("bytes the decoder keeps at the context's length", "byte",
                          "the converted model's cache (KernelCache.state_bytes, states of state_bits) after "
                          "window 0's context tokens: "
                          "every substituted layer's states (one per key/value head, share_heads='group'; one per "
                          "layer's key/value head for positive_orthogonal_shared; a window's keys and values per "
                          "key/value head for window_linear) and the kept softmax layers' keys and values, all "
                          "layers"),
    "top1_agreement": Metric("greedy next token equals the exact model's", "1", "per window, the fraction of its "
                             "positions where the substituted model's argmax next token is the exact model's "
                             "(teacher-forced on the held-out text: the same prefixes)", dims=_W),
    "continuation_match": Metric("tokens of the greedy continuation equal to the exact model's", "token",
                                 "free-running greedy decoding through the converted model's own cache after the "
                                 "first decode_len tokens of window 0: tokens before the first difference from the "
                                 "exact model's continuation, of n_continue (NaN where the float32 states "
                                 "underflow)"),
    "decode_max_abs_diff": Metric("largest |logit difference|, decoding against the parallel pass", "1",
                                  "over the last n_decode of the first decode_len tokens of window 0, decoded one "
                                  "at a time after the prefill of the others, and the vocabulary"),
    "decode_rel_diff": Metric("relative logit difference, decoding against the parallel pass", "1",
                              "decode_max_abs_diff / max |logit| of the parallel pass"),
    "features_per_head": Metric("features per head of the substituted layers' maps", "1",
                                "r for the random, fitted and trained maps; the map's own dimension for the maps it "
                                "is fixed for by the head's d = 64 (taylor2: 1 + d + d(d+1)/2 = 2145; elu1: d)"),
    "state_bits": Metric("bits per number of the decoding states", "1",
                         "32, or 64 where the float32 states underflow on the model's activations (the float32 "
                         "cache raises; the float64 cache is used and its bytes counted)"),
    "step_seconds": Metric("seconds per decoded token", "s", "median over the n_decode steps but the first two"),
    "prefill_seconds": Metric("seconds of the prefill", "s", "decode_len − n_decode tokens of window 0"),
    "layer_delta_nll": Metric("NLL increase with only this layer substituted, calibration windows", "nats",
                              "mean over the calibration windows' positions of nll(only layer l substituted) − "
                              "nll(exact), the label at this r and map_seed (maps fitted on the same windows): the "
                              "per-layer sensitivity that places the softmax layers; cells with every layer "
                              "substituted of labels with a sensitivity placement", dims=("layer",),
                              coords={"layer": list(range(NUM_LAYERS))}),
    "layer_kernel_error": Metric("relative kernel error of the layer's heads, calibration windows", "1",
                                 "‖(K̂ − K)/Z‖_F / ‖K/Z‖_F over the causal pairs j ≤ i of the calibration windows, "
                                 "K = exp(s qᵀk) on query head h's queries and keys (rotary positions applied) of "
                                 "layer l substituted alone (the exact model's activations), K̂ the estimator's "
                                 "kernel_matrix, each row over its exact normaliser Z_i = Σ_j≤i K_ij: the error of "
                                 "the unnormalised attention weights, the first link of the chain",
                                 dims=("layer", "head"),
                                 coords={"layer": list(range(NUM_LAYERS)), "head": list(range(NUM_HEADS))}),
    "layer_attention_error": Metric("relative attention-output error of the layer, calibration windows", "1",
                                    "‖ŷ_h − y_h‖_F / ‖y_h‖_F over the calibration windows' positions, query head h "
                                    "of layer l substituted alone (its inputs: the exact model's activations); y the "
                                    "layer's causal softmax attention", dims=("layer", "head"),
                                    coords={"layer": list(range(NUM_LAYERS)), "head": list(range(NUM_HEADS))}),
}
REFERENCE_METRICS = {
    "nll_exact": Metric("mean next-token NLL of the window, exact model", "nats", "the same tokens", dims=_W),
    "nll_unigram": Metric("mean next-token NLL of the window, unigram model", "nats",
                          "add-one smoothed token frequencies of the calibration split (no context): the trivial "
                          "baseline", dims=_W),
    "answer_logprob_exact": Metric("log-probability of the recalled answer, exact model", "nats", "the same prompts",
                                   dims=_P, coords=_TASKS),
    "greedy_correct_exact": Metric("greedy decoding gives the recalled answer, exact model", "1", "the same prompts",
                                   dims=_P, coords=_TASKS),
    "recall_chance": Metric("chance of a greedy answer without recall", "1",
                            "1 / the answers the prompt's form leaves open (RecallPrompt.candidates: 90,000 "
                            "five-digit keys; the listed people's numbers): the trivial baseline of recall",
                            dims=_P, coords=_TASKS),
    "kv_bytes": Metric("exact model's KV cache at the context's length", "byte",
                       "30 layers × 2 × 3 key/value heads × 64 × context × 4 bytes (kernapprox.lm.kv_cache_bytes)"),
    "exact_step_seconds": Metric("seconds per decoded token, exact model", "s",
                                 "median of three steps after one untimed step, with a KV cache of decode_context "
                                 "tokens (random keys and values of its true shape)", dims=("decode_context",),
                                 coords={"decode_context": list(DECODE_CONTEXTS)}),
    "exact_kv_bytes": Metric("exact model's KV cache at decode_context tokens", "byte",
                             "measured from the cache's tensors", dims=("decode_context",),
                             coords={"decode_context": list(DECODE_CONTEXTS)}),
}


def substituted_layers(exact_layers: int, sensitivity=None, placement: str = "even") -> list[int]:
    """The layers a cell substitutes: all but ``exact_layers`` softmax layers, kept at ``⌊i·30/k⌋``, ``i < k``
    (``"even"``), the first or the last ``k`` (``"first"``, ``"last"``), or, given the per-layer ``sensitivity``
    (NLL increase of each layer substituted alone), the ``k`` layers where it is largest."""
    k = exact_layers
    if sensitivity is not None:
        kept = set(np.argsort(-np.asarray(sensitivity), kind="stable")[:k].tolist())
    elif placement in ("first", "last"):
        kept = set(range(k)) if placement == "first" else set(range(NUM_LAYERS - k, NUM_LAYERS))
    else:
        kept = {int(i * NUM_LAYERS // k) for i in range(k)} if k else set()
    return [layer for layer in range(NUM_LAYERS) if layer not in kept]


def applicable(params) -> bool:
    """What :data:`RUNS` says: every label at ``hybrid_rank`` with every layer substituted (placement "even", the
    canonical label of k = 0); FAVOR+'s rank sweep; the kept softmax layers of each placement at ``hybrid_rank``."""
    runs = RUNS[params["estimator"]]
    at_rank = params["num_features"] == params["hybrid_rank"]
    if params["exact_layers"]:
        return at_rank and params["exact_layers"] in runs.get(params["placement"], ())
    return params["placement"] == "even" and (at_rank or runs.get("ranks", False))


def check_params(params) -> None:
    if params["estimator"] not in ESTIMATORS:
        raise ValueError(f"estimator {params['estimator']!r} is not one of the study's: {', '.join(ESTIMATORS)}")
    if not 0 <= params["exact_layers"] < NUM_LAYERS:
        raise ValueError(f"exact_layers must be in [0, {NUM_LAYERS}), got {params['exact_layers']}")
    if params["placement"] not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {params['placement']!r}")
    if params["context"] < 96:
        raise ValueError(f"context must be at least 96 tokens (a passkey prompt's fixed parts), got "
                         f"{params['context']}")


class Draw(NamedTuple):
    """What every cell of a context reads: the exact model, its tokenizer, the held-out windows, the recall prompts,
    the calibration batch, the exact model's and the unigram model's scores on them, the exact model's greedy next
    tokens on the windows and its greedy continuation of window 0, and the per-layer sensitivity of each label,
    computed by the first cell that needs it and kept with the draw (the engine runs a draw's cells together)."""

    model: object
    tokenizer: object
    windows: lm.TextWindows
    prompts: dict
    calibration: torch.Tensor
    exact: dict
    greedy: np.ndarray
    continuation: np.ndarray
    sensitivity: dict


@torch.no_grad()
def _exact_decode(model, context: int) -> tuple[float, int]:
    """Median seconds per token of the exact model with a KV cache of ``context`` tokens, and the cache's bytes."""
    from transformers import DynamicCache

    config = model.config
    gen = torch.Generator().manual_seed(context)
    cache = DynamicCache()
    shape = (1, config.num_key_value_heads, context, config.hidden_size // config.num_attention_heads)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
    held = lm_eval.cache_bytes(cache)
    token = torch.tensor([[int(lm.VOCAB_SIZE // 2)]])
    seconds = []
    for step in range(4):
        position = torch.tensor([[context + step]])
        start = time.perf_counter()
        model(input_ids=token, cache=cache, position_ids=position, use_cache=True)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds[1:])), held


def draw(params, data_rng, device) -> Draw:
    model, tokenizer = _lm.load_model("causal_lm", LM_REASON, device)
    context = params["context"]
    windows = lm.text_windows(tokenizer, params["n_windows"], context, split="evaluation")
    calibration = lm.text_windows(tokenizer, params["n_calibration"], min(context, 256), split="calibration")
    prompts = _lm.recall_prompts(tokenizer, context, params["n_prompts"])
    ids = windows.input_ids.to(device)
    nll_exact, greedy = lm_eval.token_nll(model, ids, return_argmax=True)
    nll_exact = nll_exact.mean(axis=1)
    continuation = lm_eval.greedy_continuation(model, ids[:1, :params["decode_len"]], params["n_continue"])
    recall = _lm.score_recall(model, prompts)
    exact = {"nll_exact": nll_exact, "nll_unigram": _lm.unigram_nll(tokenizer, windows.input_ids),
             "answer_logprob_exact": recall["answer_logprob"], "greedy_correct_exact": recall["greedy_correct"],
             "recall_chance": 1.0 / recall["candidates"],
             "kv_bytes": float(lm.kv_cache_bytes(context))}
    return Draw(model, tokenizer, windows, prompts, calibration.input_ids.to(device), exact, greedy, continuation,
                {})


def run_reference(params, device, data):
    timed = [_exact_decode(data.model, n) for n in DECODE_CONTEXTS]
    return {**data.exact, "exact_step_seconds": np.array([t for t, _ in timed]),
            "exact_kv_bytes": np.array([float(b) for _, b in timed])}


def convert(data: Draw, params, layers=None):
    """The cell's converted model (``layers``: the substituted layers, default the cell's placement)."""
    name, options, conversion = ESTIMATORS[params["estimator"]]
    if layers is None:
        sensitivity = (layer_sensitivity(data, params)["layer_delta_nll"] if params["placement"] == "sensitivity"
                       else None)
        layers = substituted_layers(params["exact_layers"], sensitivity, params["placement"])
    r = None if params["estimator"] in FIXED_DIMENSION else params["num_features"]
    kw = dict(options, **conversion, num_features=r, layers=layers, rng=params["map_seed"])
    trainable = name in TRAINABLE_MAPS
    if trainable or ka.capabilities(name, **options).data_dependent:
        kw["calibration"] = {"input_ids": data.calibration}
    return ka.convert(data.model, name, **kw)


@torch.no_grad()
def layer_sensitivity(data: Draw, params) -> dict:
    """Per layer ``l``: the calibration windows' NLL increase when only ``l`` is substituted by the cell's label at
    ``hybrid_rank`` (``layer_delta_nll``), and each query head's relative attention-output error there
    (``layer_attention_error``, on the exact model's activations: the layers below are exact) and kernel error
    (``layer_kernel_error``). Kept in the draw per (label, r, map_seed), over the first ``n_sensitivity``
    calibration windows (the maps of data-dependent labels are fitted on all ``n_calibration`` of them).

    With only ``l`` substituted, the layers below it compute what the exact model does: one exact pass records
    every layer's input, and layer ``l``'s pass starts there, running the label's layer ``l`` and the exact layers
    above it: about half the work of 30 whole passes, the same numbers
    (``tests/experiments/test_causal_lm_experiment.py`` checks them against whole passes). A label whose maps are drawn,
    not fitted, is converted once with every layer substituted (each layer's map comes from its own seed: the map a
    conversion of ``l`` alone draws); a fitted or trainable one once per layer, fitted with the layers below exact."""
    from kernapprox.surgery import attention as sa

    calibration = data.calibration[:params["n_sensitivity"]]
    key = (params["estimator"], params["hybrid_rank"], params["map_seed"])
    if key in data.sensitivity:
        return data.sensitivity[key]
    windows = [calibration[i:i + 1] for i in range(calibration.shape[0])]
    exact = [_lm.layer_inputs(data.model, ids) for ids in windows]          # per window: (layer inputs, NLL)
    base = np.mean([nll for _, nll in exact])
    at_rank = dict(params, num_features=params["hybrid_rank"], exact_layers=0, placement="even")
    name, options, _ = ESTIMATORS[params["estimator"]]
    fitted = name in TRAINABLE_MAPS or ka.capabilities(name, **options).data_dependent
    converted = None if fitted else convert(data, at_rank)
    exact_layers = list(ka.surgery.stack_for(data.model).model.layers)
    delta = np.empty(NUM_LAYERS)
    error, kernel = np.empty((NUM_LAYERS, NUM_HEADS)), np.empty((NUM_LAYERS, NUM_HEADS))
    for layer in range(NUM_LAYERS):
        model = convert(data, at_rank, layers=[layer]) if fitted else converted
        stack = ka.surgery.stack_for(model)
        sums = np.zeros((4, NUM_HEADS))
        attention = sa.get_attention(stack.attention_module(layer))
        heads = getattr(attention, "heads", ())

        def observe(call, out, sums=sums, heads=heads):
            want = ka.softmax_attention(call.query, call.key, call.value, call.causal, call.scaling)
            sums[0] += (out - want).square().sum(dim=(0, 2, 3)).double().numpy()
            sums[1] += want.square().sum(dim=(0, 2, 3)).double().numpy()
            sums[2:] += _kernel_error_sums(call, heads)

        observed = isinstance(attention, sa.SubstitutedAttention)
        if observed:                # a trainable map's layer has no observer: its NLL only
            attention.observer = observe
        try:
            nll = [_lm.suffix_nll(model, ids, inputs[layer], [stack.model.layers[layer], *exact_layers[layer + 1:]])
                   for ids, (inputs, _) in zip(windows, exact)]
        finally:
            if observed:
                attention.observer = None
        delta[layer] = np.mean(nll) - base
        error[layer] = np.sqrt(sums[0] / sums[1]) if observed else np.nan
        kernel[layer] = np.sqrt(sums[2] / sums[3]) if observed else np.nan
        del model
    del converted
    data.sensitivity[key] = {"layer_delta_nll": delta, "layer_attention_error": error, "layer_kernel_error": kernel}
    return data.sensitivity[key]


def _kernel_error_sums(call, heads) -> np.ndarray:
    """Per query head: ``Σ ((K̂_ij − K_ij)/Z_i)²`` and ``Σ (K_ij/Z_i)²`` over the causal pairs ``j ≤ i`` of one call
    (float64; ``K̂`` the head's :meth:`~kernapprox.Estimator.kernel_matrix`, ``Z_i = Σ_j≤i K_ij``); 0 for a head
    that keeps softmax or fits per sequence. ``K/Z`` is formed from the logits less their row maximum, so nothing
    overflows."""
    q, k = call.query.double(), call.key.double()                      # (B, H, n, d), keys repeated to the heads
    n = q.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if call.causal else torch.ones(n, n, dtype=torch.bool)
    logits = (call.scaling * q @ k.transpose(-1, -2)).masked_fill(~allowed, -torch.inf)
    top = logits.amax(-1, keepdim=True)
    weights = torch.exp(logits - top)
    z = weights.sum(-1, keepdim=True)                                  # Z_i / exp(max_i)
    sums = np.zeros((2, len(heads)))
    for h, est in enumerate(heads):
        if not isinstance(est, ka.Estimator):
            continue
        approx = est.kernel_matrix(q[:, h], k[:, h]) * torch.exp(-top[:, h]) / z[:, h]
        exact = weights[:, h] / z[:, h]
        sums[0, h] = float(((approx - exact) * allowed).square().sum())
        sums[1, h] = float(exact.square().sum())
    return sums


@torch.no_grad()
def _decode_check(model, ids: torch.Tensor, n_decode: int, state_dtype) -> dict:
    """Prefill all but the last ``n_decode`` tokens of ``ids`` ``(1, n)`` into a :class:`KernelCache` with
    ``state_dtype``, decode those one at a time; the logits against the parallel pass, and the seconds."""
    full = model(input_ids=ids, use_cache=False).logits[0, -n_decode:].double()
    key = lm_eval.cache_keyword(model)
    cache = KernelCache(model, state_dtype=state_dtype)
    start = time.perf_counter()
    model(input_ids=ids[:, :-n_decode], use_cache=True, **{key: cache})
    prefill = time.perf_counter() - start
    logits, steps = [], []
    for t in range(ids.shape[1] - n_decode, ids.shape[1]):
        start = time.perf_counter()
        out = model(input_ids=ids[:, t:t + 1], use_cache=True, **{key: cache})
        steps.append(time.perf_counter() - start)
        logits.append(out.logits[0, -1].double())
    got = torch.stack(logits)          # the step that reads token t gives position t's logits, as the full pass
    diff = float((got - full).abs().max())
    return {"decode_max_abs_diff": diff, "decode_rel_diff": diff / float(full.abs().max()),
            "step_seconds": float(np.median(steps[2:] if len(steps) > 2 else steps)), "prefill_seconds": prefill}


@torch.no_grad()
def _decoder_bytes(model, ids: torch.Tensor, state_dtype) -> float:
    """The bytes a :class:`KernelCache` with ``state_dtype`` holds after prefilling ``ids`` ``(1, n)``."""
    cache = KernelCache(model, state_dtype=state_dtype)
    model(input_ids=ids, use_cache=True, **{lm_eval.cache_keyword(model): cache})
    return float(cache.state_bytes())


def decode(model, window: torch.Tensor, params) -> dict:
    """The RNN-mode metrics of a converted model on one window ``(1, context)``: float32 states, or float64 where
    float32 features underflow on the model's activations (the float32 cache raises, naming that cause)."""
    for bits, dtype in ((32, None), (64, torch.float64)):
        try:
            state_bytes = _decoder_bytes(model, window, dtype)
            out = _decode_check(model, window[:, :params["decode_len"]], params["n_decode"], dtype)
        except ValueError as err:
            if bits == 64 or "underflow" not in str(err):
                raise
            continue
        return {**out, "state_bytes": state_bytes, "state_bits": float(bits)}
    raise AssertionError("unreachable")


def continuation_match(model, data: Draw, params) -> float:
    """Tokens the converted model's free-running greedy continuation of window 0's first ``decode_len`` tokens shares
    with the exact model's before they differ (:func:`kernapprox.lm_eval.common_prefix`); NaN where its float32
    decoding states underflow on the model's activations (the cache raises, naming that cause)."""
    prompt = data.windows.input_ids[:1, :params["decode_len"]]
    try:
        mine = lm_eval.greedy_continuation(model, prompt, params["n_continue"])
    except ValueError as err:
        if "underflow" not in str(err):
            raise
        return float("nan")
    return float(lm_eval.common_prefix(mine, data.continuation))


def features_per_head(params, head_dim: int) -> int:
    """The cell's map dimension per head: ``num_features``, or the dimension a fixed map has at ``head_dim``."""
    if params["estimator"] not in FIXED_DIMENSION:
        return params["num_features"]
    name, options, _ = ESTIMATORS[params["estimator"]]
    z = torch.zeros(1, head_dim)
    return int(ka.make_estimator(name, **options).fit(z, z).features(z, "key").shape[-1])


def run_cell(params, rng, device, data):
    if not applicable(params):
        return not_applicable()
    model = convert(data, params)
    config = data.model.config
    nll, greedy = lm_eval.token_nll(model, data.windows.input_ids.to(device), return_argmax=True)
    recall = _lm.score_recall(model, data.prompts)
    out = {"nll": nll.mean(axis=1), "top1_agreement": (greedy == data.greedy).mean(axis=1),
           "answer_logprob": recall["answer_logprob"], "greedy_correct": recall["greedy_correct"],
           "continuation_match": continuation_match(model, data, params),
           "features_per_head": features_per_head(params, config.hidden_size // config.num_attention_heads),
           **decode(model, data.windows.input_ids[:1].to(device), params)}
    del model
    runs = RUNS[params["estimator"]]
    if params["exact_layers"] == 0 and params["num_features"] == params["hybrid_rank"] and runs.get("sensitivity"):
        out.update(layer_sensitivity(data, params))
    else:
        out.update(layer_delta_nll=np.full(NUM_LAYERS, np.nan),
                   layer_attention_error=np.full((NUM_LAYERS, NUM_HEADS), np.nan),
                   layer_kernel_error=np.full((NUM_LAYERS, NUM_HEADS), np.nan))
    return out


# ------------------------------------------------------------------------------------------------- summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds["delta_nll"] = (ds["nll"] - ds["nll_exact"]).assign_attrs(
        long_name="NLL increase over the exact model", units="nats",
        description="per window, nll − nll_exact (the same tokens)", comparison="difference")
    ds["delta_logprob"] = (ds["answer_logprob"] - ds["answer_logprob_exact"]).assign_attrs(
        long_name="recalled answer's log-probability change against the exact model", units="nats",
        description="per prompt, answer_logprob − answer_logprob_exact (the same prompt)", comparison="difference")
    for name, unit in (("nll", "window"), ("nll_exact", "window"), ("nll_unigram", "window"),
                       ("delta_nll", "window"), ("top1_agreement", "window"), ("answer_logprob", "prompt"),
                       ("answer_logprob_exact", "prompt"), ("delta_logprob", "prompt")):
        _lm.add_summary(ds, f"{name}_summary", name, unit)
    for name, unit in (("delta_nll", "window"), ("delta_logprob", "prompt")):
        ds[f"{name}_p"] = stats.paired_test(ds[name], unit, test="wilcoxon")
    for name, ref in (("perplexity", "nll"), ("perplexity_exact", "nll_exact"), ("perplexity_unigram", "nll_unigram")):
        _lm.add_perplexity(ds, f"{name}_summary", f"{ref}_summary")
    _lm.add_chance(ds)
    for name in ("greedy_correct", "greedy_correct_exact"):
        _lm.add_accuracy(ds, f"{name}_summary", name)
    if {"positive_orthogonal", "positive_orthogonal_shared"} <= set(ds["estimator"].values.tolist()):
        _lm.add_window_difference(
            ds, "shared_minus_per_head_nll",
            ds["nll"].sel(estimator="positive_orthogonal_shared") - ds["nll"].sel(estimator="positive_orthogonal"),
            "NLL with one draw per layer minus one draw per key/value head", "per window, the same windows and r")
    ds["memory_fraction"] = (ds["state_bytes"] / ds["kv_bytes"]).assign_attrs(
        long_name="bytes kept over the exact model's KV cache at the context's length", units="1",
        description="state_bytes / kv_bytes")
    _placement_pairs(ds)
    return ds


def _placement_pairs(ds: xr.Dataset) -> None:
    """Sensitivity placement minus each other placement (even: ``placement_nll_diff``; first, last:
    ``placement_nll_diff_<name>``), per window, where both ran (same label, r, k, draw)."""
    placements = set(ds["placement"].values.tolist())
    for other in (p for p in PLACEMENTS if p != "sensitivity" and {p, "sensitivity"} <= placements):
        name = "placement_nll_diff" + ("" if other == "even" else f"_{other}")
        _lm.add_window_difference(ds, name, ds["nll"].sel(placement="sensitivity") - ds["nll"].sel(placement=other),
                                  f"NLL with the softmax layers placed by sensitivity minus {PLACED[other]}",
                                  "per window, the same label, r, number of softmax layers and draw")


PLACED = {"even": "evenly spaced", "first": "the first layers", "last": "the last layers"}


# ---------------------------------------------------------------------------------------------------- figure
CELL_DIMS = ("estimator", "num_features", "exact_layers", "placement", "map_seed")


def _cells(ds: xr.Dataset, context: int) -> list[dict]:
    """The selections (estimator, r, k, placement, map_seed) of the cells that ran at ``context``."""
    sub = ds["state_bytes"].sel(context=context).transpose(*CELL_DIMS)
    return [{d: sub[d].values.tolist()[i] for d, i in zip(CELL_DIMS, idx)}
            for idx in zip(*np.nonzero(np.isfinite(sub.values)))]


def _r(ds: xr.Dataset, cell: dict) -> int:
    """The features per head of the cell's label at its r (the grid's r, or a fixed map's own dimension), read from
    any cell of that label and r that ran (a placement's reference cell need not have run)."""
    return int(ds["features_per_head"].sel(estimator=cell["estimator"], num_features=cell["num_features"]).max())


def _name(cell: dict, ds: xr.Dataset) -> str:
    """The cell as the findings name it (its map draw where the dataset has several)."""
    k = cell["exact_layers"]
    return f"`{cell['estimator']}` at r = {_r(ds, cell)}" + (
        f" with {k} softmax layers ({cell['placement']})" if k else "") + (
        f", map draw {cell['map_seed']}" if ds.sizes.get("map_seed", 1) > 1 else "")


def _value(ds, name, cell, context, stat=None, **extra):
    da = ds[name].sel(**cell, context=context, **extra)
    return float(da.sel(stat=stat)) if stat else da


def _sensitivity_cell(ds: xr.Dataset, context: int):
    """The cell whose per-layer sensitivity ran at ``context`` (the first), or ``None``."""
    for cell in _cells(ds, context):
        if np.isfinite(ds["layer_delta_nll"].sel(**cell, context=context).values).all():
            return cell
    return None


def plot(ds: xr.Dataset, path) -> None:
    contexts = ds["context"].values.tolist()
    first = contexts[0]
    fig, axes = new_figure(2, 4, width=21, height=9)
    (ax_ppl, ax_rec, ax_kv, ax_acc), (ax_sens, ax_chain, ax_dec, ax_diff) = axes
    recall_axes = ((ax_rec, "passkey"), (ax_kv, "kv_lookup"))
    markers = dict(zip(contexts, ("o", "D", "^", "v")))
    for context in contexts:
        kv = float(ds["kv_bytes"].sel(context=context))
        for cell in _cells(ds, context):
            style = estimator_style(cell["estimator"])
            b = float(ds["state_bytes"].sel(**cell, context=context))
            k = cell["exact_layers"]
            for ax, name, task in ((ax_ppl, "perplexity_summary", None),
                                   *((ax, "answer_logprob_summary", task) for ax, task in recall_axes)):
                s = ds[name].sel(**cell, context=context, **({"task": task} if task else {}))
                est, lo, hi = (float(s.sel(stat=x)) for x in ("estimate", "lo", "hi"))
                ax.errorbar([b], [est], yerr=[[est - lo], [hi - est]], color=style["color"], marker=markers[context],
                            markersize=4 + 1.2 * np.sqrt(k), capsize=2,
                            markerfacecolor="none" if cell["placement"] == "sensitivity" else style["color"],
                            label=f"{cell['estimator']}" + (f", r = {_r(ds, cell)}" if not k else
                                                            f", {k} softmax ({cell['placement']})")
                            + (f", {context} tokens" if len(contexts) > 1 else ""))
            for task, marker in zip(_lm.TASKS, ("o", "x")):
                acc = float(ds["greedy_correct_summary"].sel(**cell, context=context, task=task, stat="estimate"))
                ax_acc.plot([b], [acc], marker=marker, color=style["color"], linestyle="none",
                            markersize=4 + 1.2 * np.sqrt(k))
        for ax, name, task in ((ax_ppl, "perplexity_exact_summary", None),
                               *((ax, "answer_logprob_exact_summary", task) for ax, task in recall_axes)):
            s = ds[name].sel(context=context, **({"task": task} if task else {}))
            est = float(s.sel(stat="estimate"))
            ax.errorbar([kv], [est], yerr=[[est - float(s.sel(stat="lo"))], [float(s.sel(stat="hi")) - est]],
                        marker="*", markersize=11, color="k", capsize=2,
                        label="exact (KV cache)" + (f", {context} tokens" if len(contexts) > 1 else ""))
            ax.axvline(kv, color="0.6", linewidth=0.8, linestyle=":")
        for task, marker in zip(_lm.TASKS, ("o", "x")):
            acc = float(ds["greedy_correct_exact_summary"].sel(context=context, task=task, stat="estimate"))
            ax_acc.plot([kv], [acc], marker="*", color="k", markersize=11 if marker == "o" else 8,
                        markerfacecolor="k" if marker == "o" else "none", linestyle="none")
        uni = ds["perplexity_unigram_summary"].sel(context=context)
        ax_ppl.axhline(float(uni.sel(stat="estimate")), color="0.4", linestyle="--", linewidth=1.0,
                       label="unigram model (no context)" if context == first else None)
    for ax in (ax_ppl, ax_rec, ax_kv, ax_acc):
        log_axis(ax, "x", label="bytes kept by the decoder at the context's length (all layers)", unit="bytes")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("perplexity on held-out text")
    ax_ppl.set_title("(a) perplexity against memory")
    ax_rec.set_ylabel("passkey log-probability (nats, median)")
    ax_rec.set_title("(b) passkey recall against memory")
    ax_kv.set_ylabel("key–value lookup log-probability (nats, median)")
    ax_kv.set_title("(c) key–value lookup against memory")
    chance = ds["recall_chance_mean"].max()
    ax_acc.axhline(float(chance), color="0.4", linestyle="--", linewidth=1.0,
                   label=f"chance (at most {fmt(float(chance), 2)})")
    ax_acc.plot([], [], "ko", label="passkey")
    ax_acc.plot([], [], "kx", label="key–value lookup")
    ax_acc.set_ylim(-0.05, 1.05)
    ax_acc.set_ylabel("greedy accuracy (fraction of prompts)")
    ax_acc.set_title("(d) greedy recall against memory")
    ax_acc.legend(fontsize=6.5)
    ax_ppl.legend(fontsize=6, loc="upper right")
    # (c) per-layer sensitivity
    cell = _sensitivity_cell(ds, first)
    if cell is not None:
        delta = ds["layer_delta_nll"].sel(**cell, context=first)
        ax_sens.bar(ds["layer"].values, delta.values, color=estimator_style(cell["estimator"])["color"])
        ax_sens.set_xlabel("decoder layer substituted alone")
        ax_sens.set_ylabel("calibration NLL increase (nats)")
        ax_sens.set_title(f"(e) per-layer sensitivity: `{cell['estimator']}`, r = {_r(ds, cell)}")
        err = ds["layer_attention_error"].sel(**cell, context=first).mean("head")
        kernel = ds["layer_kernel_error"].sel(**cell, context=first).mean("head")
        dots = ax_chain.scatter(kernel.values, err.values, c=delta.values, cmap="viridis", s=28, edgecolor="0.3",
                                linewidth=0.4)
        fig.colorbar(dots, ax=ax_chain, label="calibration NLL increase (nats)", pad=0.01)
        for layer in np.argsort(-delta.values)[:5]:
            ax_chain.annotate(str(int(layer)), (float(kernel[layer]), float(err[layer])), fontsize=7,
                              xytext=(3, 2), textcoords="offset points")
        ax_chain.set_xscale("log")
        ax_chain.set_yscale("log")
        ax_chain.set_xlabel("relative kernel error of the layer (unnormalised weights, mean over heads)")
        ax_chain.set_ylabel("relative attention-output error (mean over heads)")
        ax_chain.set_title("(f) where error enters: kernel → attention → NLL, per layer")
    # (d) decode time per token
    steps = ds["exact_step_seconds"].sel(context=first)
    ax_dec.plot(ds["decode_context"].values, steps.values, "k*-", label="exact (KV cache grows)")
    for cell in _cells(ds, first):
        if cell["exact_layers"]:
            continue
        t = float(ds["step_seconds"].sel(**cell, context=first))
        style = estimator_style(cell["estimator"])
        ax_dec.axhline(t, color=style["color"], linestyle=style["linestyle"], linewidth=0.9,
                       label=f"{cell['estimator']}, r = {_r(ds, cell)} (fixed state)")
    log_axis(ax_dec, "x", label="context (tokens)")
    ax_dec.set_yscale("log")
    ax_dec.set_ylabel("seconds per decoded token (one thread)")
    ax_dec.set_title("(g) decoding: per-token time against context")
    ax_dec.legend(fontsize=6.5)
    # (e) decode against the parallel pass
    names, diffs = [], []
    for cell in _cells(ds, first):
        k = cell["exact_layers"]
        names.append(f"{cell['estimator']} r={_r(ds, cell)}" + (f" +{k} sm ({cell['placement'][:4]})"
                                                                         if k else ""))
        diffs.append(float(ds["decode_rel_diff"].sel(**cell, context=first)))
    ax_diff.plot(np.maximum(diffs, 1e-12), range(len(diffs)), "o", color="0.3")
    ax_diff.set_yticks(range(len(diffs)), names, fontsize=6.5)
    ax_diff.axvline(float(np.finfo(np.float32).eps), color="0.6", linestyle=":", linewidth=0.8,
                    label="float32 machine epsilon")
    ax_diff.legend(fontsize=6.5)
    ax_diff.set_xscale("log")
    ax_diff.set_xlabel("max |logit difference| / max |logit|, decoding vs parallel pass")
    ax_diff.set_title("(h) the RNN mode reproduces the parallel pass")
    fig.suptitle("SmolLM2-135M with fixed-size states: perplexity, recall, decoding and per-layer sensitivity")
    ctx = " and ".join(str(c) for c in contexts)
    save_figure(fig, path, (
        f"SmolLM2-135M-Instruct (30 layers, 9 query / 3 key-value heads of dimension 64) with feature maps of r "
        f"features per head, one draw and one decoding state per key/value head, in every layer but the kept softmax "
        f"layers (larger markers: more kept; filled: evenly spaced, open: the most sensitive layers of panel e). "
        f"(a) Perplexity on {ds.sizes['window']} held-out windows of {ctx} tokens of Shakespeare against the bytes "
        "the decoder keeps (every layer's state, kept layers' KV caches); bars: 95 % bootstrap intervals over "
        f"windows; stars: the exact model at its KV cache (dotted); dashed: a unigram model. (b, c) The recalled "
        f"answer's log-probability (median over {ds.sizes['prompt']} prompts, bootstrap interval): a passkey in "
        "text, a locker number in a list of sentences. (d) Greedy accuracy of both (circles: passkey, crosses: "
        "lookup), chance dashed. (e) The calibration windows' NLL increase with one layer substituted alone. (f) "
        "The chain per layer, on the exact model's activations: the kernel error of its heads (the unnormalised "
        "attention weights, each row over its exact normaliser) against their attention-output error, coloured by "
        "the NLL increase of (e) (the five largest labelled). (g) Seconds per decoded token: the exact model with "
        "KV caches of 1k–32k tokens against the fixed states (measured after a short prefill and drawn flat: their "
        "step does the same work at any context). (h) Largest logit difference between token-by-token decoding and "
        f"the parallel pass over the last decoded tokens of window 0 ({first} tokens)."),
        title="SmolLM2-135M as an RNN")


# -------------------------------------------------------------------------------------------------- findings
BUDGETS = (1 / 8, 1 / 64)


def _ppl(ds, cell, context):
    return _value(ds, "perplexity_summary", cell, context, "estimate")


def findings(ds: xr.Dataset) -> list[str]:
    lines = []
    for context in ds["context"].values.tolist():
        at = {"context": context}
        kv = float(ds["kv_bytes"].sel(**at))
        exact = ds["perplexity_exact_summary"].sel(**at)
        uni = ds["perplexity_unigram_summary"].sel(**at)
        lines.append(f"Exact model at {context}-token windows of held-out Shakespeare: perplexity {fmt_ci(exact)} "
                     f"over {ds.sizes['window']} windows, KV cache {fmt_bytes(kv)}; the unigram model without context "
                     f"(the trivial baseline): {fmt_ci(uni)}.")
        cells = _cells(ds, context)
        parts, worse_than_unigram = [], []
        for cell in cells:
            ppl = _value(ds, "perplexity_summary", cell, context)
            delta = _value(ds, "delta_nll_summary", cell, context)
            p = float(_value(ds, "delta_nll_p", cell, context))
            frac = float(_value(ds, "memory_fraction", cell, context))
            bits = "" if float(_value(ds, "state_bits", cell, context)) == 32 else \
                ", float64 states: float32 ones underflow"
            parts.append(f"{_name(cell, ds)}: {fmt_ci(ppl)} ({fmt_bytes(_value(ds, 'state_bytes', cell, context))}"
                         f"{bits}, {fmt(frac)} of the KV cache; NLL +{fmt_ci(delta)} nats, Wilcoxon p = {fmt(p, 2)})")
            if float(ppl.sel(stat="lo")) > float(uni.sel(stat="hi")):
                worse_than_unigram.append(_name(cell, ds))
        lines.append(f"Perplexity of the substituted models on the same {context}-token windows (paired with the "
                     "exact model): " + "; ".join(parts) + ".")
        if worse_than_unigram:
            lines.append(f"Worse than the unigram model at {context} tokens (intervals apart): "
                         + ", ".join(worse_than_unigram) + ".")
        for budget in BUDGETS:
            within = [c for c in cells if float(_value(ds, "memory_fraction", c, context)) <= budget]
            if not within:
                lines.append(f"No cell at {context} tokens keeps at most 1/{round(1 / budget)} of the KV cache's "
                             "bytes.")
                continue
            best = min(within, key=lambda c: _ppl(ds, c, context))
            ratio = _ppl(ds, best, context) / float(exact.sel(stat="estimate"))
            lines.append(f"Best perplexity within 1/{round(1 / budget)} of the KV cache's bytes at {context} tokens "
                         f"({fmt_bytes(kv * budget)}; {len(within)} of {len(cells)} cells): {_name(best, ds)}, "
                         f"{fmt_ci(_value(ds, 'perplexity_summary', best, context))}, {fmt(ratio)} × the exact "
                         f"model's, keeping {fmt(float(_value(ds, 'memory_fraction', best, context)))} of its bytes.")
        if cells:
            best = min(cells, key=lambda c: _ppl(ds, c, context))
            ratio = _ppl(ds, best, context) / float(exact.sel(stat="estimate"))
            lines.append(f"Lowest perplexity at {context} tokens: {_name(best, ds)}, {fmt(ratio)} × the exact model's, "
                         f"keeping {fmt(float(_value(ds, 'memory_fraction', best, context)))} of its KV cache's "
                         "bytes.")
        lines.extend(_placement_findings(ds, context))
        lines.extend(_sensitivity_findings(ds, context))
        if "shared_minus_per_head_nll_summary" in ds:
            r = int(ds["hybrid_rank"])
            one = dict(num_features=r, exact_layers=0, placement="even", map_seed=ds["map_seed"].values.tolist()[0],
                       **at)
            diff = ds["shared_minus_per_head_nll_summary"].sel(one)
            if np.isfinite(float(diff.sel(stat="estimate"))):
                t_head = float(ds["step_seconds"].sel(estimator="positive_orthogonal", **one))
                t_shared = float(ds["step_seconds"].sel(estimator="positive_orthogonal_shared", **one))
                lines.append(f"FAVOR+ at r = {r}, {context} tokens, one draw per layer shared by its heads against one "
                             f"draw per key/value head (one draw of each per map_seed), on the same windows: NLL "
                             f"difference {fmt_ci(diff)} nats (Wilcoxon "
                             f"p = {fmt(float(ds['shared_minus_per_head_nll_p'].sel(one)), 2)}); seconds per decoded "
                             f"token {fmt(t_shared, 2)} against {fmt(t_head, 2)}.")
        lines.extend(_recall_findings(ds, context, cells))
        lines.extend(_greedy_findings(ds, context, cells))
        diffs = {i: float(_value(ds, "decode_rel_diff", c, context)) for i, c in enumerate(cells)}
        close = [i for i in diffs if diffs[i] <= 1e-3]
        if close:
            lines.append(f"Token-by-token decoding through the fixed-size cache reproduces the parallel pass at "
                         f"{context} tokens: relative logit difference at most {fmt(max(diffs[i] for i in close), 2)} "
                         f"in {len(close)} of {len(cells)} cells.")
        for i in (i for i in diffs if diffs[i] > 1e-3):
            cell = cells[i]
            wide = float(_value(ds, "state_bits", cell, context)) == 64
            worse = _name(cell, ds) in worse_than_unigram
            lines.append(f"{_name(cell, ds)}: decoding and the parallel pass differ by {fmt(diffs[i], 2)} of the "
                         "largest logit" + (" (its decoding states are float64, its parallel pass float32: the "
                                            "two compute the estimate at different precisions)" if wide else "")
                         + ("; this model is worse than the unigram model" if worse else "") + ".")
        steps = ds["exact_step_seconds"].sel(**at)
        fixed = [(float(_value(ds, "step_seconds", c, context)), float(_value(ds, "state_bytes", c, context)))
                 for c in cells if c["exact_layers"] == 0]
        if fixed:
            longest = int(ds["decode_context"].values[-1])
            fastest = min(t for t, _ in fixed)
            lines.append(f"Decoding, seconds per token on one thread: the exact model {fmt(float(steps[0]), 2)} s "
                         f"at {int(ds['decode_context'].values[0])} tokens of KV cache and "
                         f"{fmt(float(steps[-1]), 2)} s at {longest} "
                         f"({fmt_bytes(ds['exact_kv_bytes'].sel(**at)[-1])}); the fixed states "
                         f"{fmt(fastest, 2)}–{fmt(max(t for t, _ in fixed), 2)} s "
                         f"({fmt_bytes(min(b for _, b in fixed))}–{fmt_bytes(max(b for _, b in fixed))}; measured "
                         f"after {int(ds['decode_len']) - int(ds['n_decode'])} tokens: a fixed state's step does the "
                         f"same work at any context), {fmt(float(steps[-1]) / fastest, 2)} × faster than the exact "
                         f"model at {longest} tokens.")
    return lines


def _placement_findings(ds, context) -> list[str]:
    out = []
    for cell in (c for c in _cells(ds, context) if c["placement"] == "sensitivity"):
        sel = {d: cell[d] for d in CELL_DIMS if d != "placement"}
        others = []
        for other in (p for p in PLACEMENTS if p != "sensitivity"):
            name = "placement_nll_diff" + ("" if other == "even" else f"_{other}")
            if f"{name}_summary" not in ds:
                continue
            s = ds[f"{name}_summary"].sel(**sel, context=context)
            if np.isfinite(float(s.sel(stat="estimate"))):
                p = float(ds[f"{name}_p"].sel(**sel, context=context))
                ppl = _value(ds, "perplexity_summary", dict(cell, placement=other), context)
                others.append(f"{PLACED[other]} {fmt_ci(ppl)} (NLL difference {fmt_ci(s)} nats, Wilcoxon "
                              f"p = {fmt(p, 2)})")
        if others:
            out.append(f"Which {cell['exact_layers']} layers keep softmax ({context} tokens, "
                       f"{_name(dict(cell, exact_layers=0), ds)}; {ds.sizes['window']} windows, paired): the most "
                       "sensitive ones "
                       f"give perplexity {fmt_ci(_value(ds, 'perplexity_summary', cell, context))}; "
                       + "; ".join(others) + ".")
    return out


def _greedy_findings(ds, context, cells) -> list[str]:
    """What the substituted models generate: their greedy next token against the exact model's on the held-out
    windows (teacher-forced), and their free-running continuation of window 0 against the exact model's."""
    if not cells:
        return []
    parts = [f"{_name(c, ds)} {fmt_ci(_value(ds, 'top1_agreement_summary', c, context), percent=True)}" for c in cells]
    matched = [f"{_name(c, ds)} {int(m)}" for c in cells if np.isfinite(m := float(_value(ds, 'continuation_match', c,
                                                                                        context)))]
    return [f"Greedy next token equal to the exact model's on the same held-out {context}-token windows "
            f"(teacher-forced, mean over {ds.sizes['window']} windows): " + "; ".join(parts) + ".",
            f"Free-running greedy continuations of window 0 ({min(int(ds['decode_len']), context)} tokens, through "
            "each model's "
            f"cache): tokens equal to the exact model's continuation before the first difference, of "
            f"{int(ds['n_continue'])}: " + "; ".join(matched) + "."]


def _sensitivity_findings(ds, context) -> list[str]:
    cell = _sensitivity_cell(ds, context)
    if cell is None:
        return []
    delta = ds["layer_delta_nll"].sel(**cell, context=context).values
    err = ds["layer_attention_error"].sel(**cell, context=context).mean("head").values
    kernel = ds["layer_kernel_error"].sel(**cell, context=context).mean("head").values
    order = np.argsort(-delta, kind="stable")
    top = ", ".join(f"{int(layer)} (+{fmt(delta[layer], 2)})" for layer in order[:6])
    return [f"Per-layer sensitivity of {_name(cell, ds)} (each layer substituted alone, calibration windows, "
            f"{context}-token draw): the NLL increase ranges {fmt(delta.min(), 2)} to {fmt(delta.max(), 2)} nats; the "
            f"most sensitive layers are {top}; the sum over layers is {fmt(delta.sum(), 3)} nats (the increases do "
            f"not add: every layer substituted costs the NLL increase above).",
            f"The chain per layer ({len(delta)} layers, means over heads; Spearman correlations, one draw on "
            f"calibration text: a description, not a test): kernel error (the unnormalised attention weights, "
            f"{fmt(kernel.min(), 2)}–{fmt(kernel.max(), 2)}) → attention-output error ({fmt(err.min(), 2)}–"
            f"{fmt(err.max(), 2)}): ρ = {fmt(float(stats_spearman(kernel, err)), 2)}; attention-output error → NLL "
            f"increase: ρ = {fmt(float(stats_spearman(err, delta)), 2)}; kernel error → NLL increase: "
            f"ρ = {fmt(float(stats_spearman(kernel, delta)), 2)}."]


def stats_spearman(x, y) -> float:
    from scipy.stats import spearmanr

    return spearmanr(x, y).statistic


def _best_recall(ds, context, task, cells):
    """The cell of ``cells`` with the highest greedy accuracy on ``task`` (then answer log-probability)."""
    def score(cell):
        return tuple(_value(ds, name, cell, context, "estimate", task=task)
                     for name in ("greedy_correct_summary", "answer_logprob_summary"))
    return max(cells, key=score, default=None)


def _recall_findings(ds, context, cells) -> list[str]:
    lines = []
    for task in _lm.TASKS:
        at = {"task": task}
        acc = ds["greedy_correct_exact_summary"].sel(context=context, **at)
        lp = ds["answer_logprob_exact_summary"].sel(context=context, **at)
        chance = float(ds["recall_chance_mean"].sel(context=context, **at))
        parts = []
        for cell in cells:
            parts.append(f"{_name(cell, ds)}: "
                         f"{fmt_ci(_value(ds, 'greedy_correct_summary', cell, context, **at), percent=True)} correct, "
                         f"log-probability {fmt_ci(_value(ds, 'answer_logprob_summary', cell, context, **at))} (change "
                         f"{fmt_ci(_value(ds, 'delta_logprob_summary', cell, context, **at))}, p = "
                         f"{fmt(float(_value(ds, 'delta_logprob_p', cell, context, **at)), 2)})")
        lines.append(f"{_lm.TASK_NAMES[task]} recall in {context}-token prompts ({ds.sizes['prompt']} prompts; chance "
                     f"{fmt(chance, 2)}): the exact model answers {fmt_ci(acc, percent=True)} greedily, median "
                     f"log-probability {fmt_ci(lp)} nats; " + "; ".join(parts) + ".")

        linear = _best_recall(ds, context, task, [c for c in cells if c["exact_layers"] == 0
                                                  and c["estimator"] != "window_linear"])
        hybrid = _best_recall(ds, context, task, [c for c in cells if c["exact_layers"]
                                                  or c["estimator"] == "window_linear"])
        summary = [f"exact {fmt_ci(acc, percent=True)}"]
        for what, cell in (("best fixed state without softmax or window", linear), ("best hybrid", hybrid)):
            if cell is not None:
                summary.append(f"{what} {_name(cell, ds)} "
                               f"{fmt_ci(_value(ds, 'greedy_correct_summary', cell, context, **at), percent=True)} "
                               f"({fmt(float(_value(ds, 'memory_fraction', cell, context)))} of the KV cache)")
        lines.append(f"{_lm.TASK_NAMES[task]} accuracy at {context} tokens: " + "; ".join(summary) + ".")
        if float(acc.sel(stat="estimate")) < 0.5:
            lines.append(f"At {context} tokens the exact model itself answers {fmt_ci(acc, percent=True)} of the "
                         f"{_lm.TASK_NAMES[task].lower()} prompts: greedy accuracy cannot show what a fixed state "
                         "loses there; the paired change of the answer's log-probability against the exact model "
                         "(above) is the measure.")
    return lines


EXPERIMENT = Experiment.from_module(
    __name__, title="A pretrained causal LM as an RNN: perplexity, recall and decoding against memory",
    replicates=_lm.REPLICATES)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
