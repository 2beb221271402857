"""SmolLM2-135M as an RNN: what a fixed-size state keeps of a pretrained causal language model's perplexity and recall,
against the memory a decoder holds, and how much softmax a hybrid must keep.

Every cell converts the pretrained model (:func:`kernapprox.convert`, transformers' Llama attention interface: the
model's own rotary positions and grouped-query heads) so that ``num_features``-dimensional feature maps replace
softmax attention in every layer except ``exact_layers`` softmax layers kept evenly spaced (layer ``⌊i·30/k⌋`` for
``i < k``), and measures on the same tokens as the exact model (paired): (a) the next-token NLL of ``n_windows``
disjoint windows of ``context`` tokens of held-out text (Shakespeare's works of the evaluation split,
:func:`kernapprox.lm.text_windows`; no map is fitted on them), (b) passkey recall on ``n_prompts`` prompts of
``context`` tokens of the same split with the key hidden at depths from 0.1 to 0.9
(:func:`kernapprox.lm_eval.passkey_prompt`, scored by the answer's log-probability and by whether greedy decoding
gives it), (c) the RNN mode:
prefill of the first ``decode_len`` tokens of window 0 but the last ``n_decode``, then decoding those one at a time
through the converted model's fixed-size cache, against the parallel pass's logits, with the seconds per step, and
the bytes the cache holds after the whole window (all layers, kept softmax layers' KV caches included).
Data-dependent maps (Nyström) and the
trainable Hedgehog maps (attention transfer, Zhang et al. 2024) are fitted on ``n_calibration`` windows of the
calibration split only. The exact model's NLL and recall, a context-free unigram model of the calibration split (the
trivial baseline of the NLL: add-one smoothed token frequencies), and the exact model's per-token decode time with
KV caches of 1k to 32k tokens (random keys and values of the cache's true shape: the step's work does not depend on
their values) are the study's reference. The unit of replication of the NLL is the text window and of recall the
prompt (the exact model reads the same ones); the maps are one draw per ``map_seed`` (per head, or per layer for
``positive_orthogonal_shared``: ``kernapprox.convert(..., share_heads=True)``). Every label runs at ``hybrid_rank``
with every layer substituted; the rank sweep is FAVOR+'s, and the kept softmax layers are FAVOR+'s, the window
hybrid's and Hedgehog's (:data:`RUNS`).
"""

from __future__ import annotations

import inspect
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
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
from kernapprox.sweep import Experiment, Metric, Parameter, Reference, not_applicable, run_cli

LM_REASON = lm.unavailable_reason() or lm.text_unavailable_reason("shakespeare")
if LM_REASON is not None:
    warnings.warn(f"causal_lm needs SmolLM2-135M and the Shakespeare text: {LM_REASON}", stacklevel=1)

# label -> (kernapprox.convert estimator, estimator options, conversion options); one table for the study
ESTIMATORS = {
    "positive_orthogonal": ("positive_orthogonal", {}, {}),                   # FAVOR+ (Choromanski et al. 2021)
    "positive_orthogonal_shared": ("positive_orthogonal", {}, {"share_heads": True}),   # one draw per layer
    "nystrom_uniform": ("nystrom_uniform", {}, {}),                           # fitted on the calibration windows
    "window_linear": ("window_linear", {"window": 64}, {}),                   # Based-style: 64 exact + positive RF
    "hedgehog_trainable": ("hedgehog_trainable", {"fit_steps": 30}, {}),      # attention transfer on calibration
}
# what each label runs besides r = hybrid_rank with every layer substituted: the rank sweep, the kept softmax layers
RUNS = {"positive_orthogonal": ("ranks", "placements"), "positive_orthogonal_shared": (),
        "nystrom_uniform": (), "window_linear": ("placements",), "hedgehog_trainable": ("placements",)}
NUM_LAYERS = lm.NUM_LAYERS
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)

GRIDS = {
    "smoke": {"estimator": ["positive_orthogonal", "window_linear"], "num_features": [64],
              "exact_layers": [0, 15], "context": [96], "map_seed": [0]},
    # ~6 min of one core with the model cached: 10 windows and 10 prompts of 512 tokens per cell
    "default": {"estimator": ["positive_orthogonal", "positive_orthogonal_shared", "nystrom_uniform", "window_linear"],
                "num_features": [16, 64],
                "exact_layers": [0, 15], "context": [512], "map_seed": [0]},
    "full": {"estimator": list(ESTIMATORS), "num_features": [16, 64, 256], "exact_layers": [0, 6, 15],
             "context": [512], "map_seed": [0, 1]},
}
PARAMETERS = {
    "n_windows": Parameter(10, long_name="held-out text windows (the NLL's units)", units="1"),
    "n_prompts": Parameter(10, long_name="passkey prompts (recall's units), depths 0.1 to 0.9", units="1"),
    "n_calibration": Parameter(4, long_name="calibration windows the data-dependent maps are fitted on", units="1",
                               description="of the calibration split, min(context, 256) tokens each"),
    "n_decode": Parameter(8, long_name="tokens decoded one at a time after the prefill", units="token"),
    "decode_len": Parameter(128, long_name="tokens of window 0 in the decoding check", units="token",
                            description="prefill of decode_len − n_decode tokens, then n_decode one at a time"),
    "hybrid_rank": Parameter(64, long_name="r of every estimator outside FAVOR+'s rank sweep", units="1",
                             description="and of every cell that keeps softmax layers (RUNS)"),
}
AXIS_ATTRS = {
    "num_features": {"long_name": "features per head r", "units": "1"},
    "exact_layers": {"long_name": "softmax layers kept (evenly spaced; the others substituted)", "units": "1"},
    "context": {"long_name": "tokens per text window and per recall prompt", "units": "token"},
    "map_seed": {"long_name": "draw of every substituted head's map (projections, landmarks, initialisation)",
                 "units": "1"},
    "window": {"long_name": "held-out text window", "units": "1"},
    "prompt": {"long_name": "passkey prompt (depth 0.1 to 0.9)", "units": "1"},
    "decode_context": {"long_name": "tokens in the exact model's KV cache", "units": "token"},
}
_W, _P = ("window",), ("prompt",)
METRICS = {
    "nll": Metric("mean next-token NLL of the window", "nats", "substituted model, mean over the window's "
                  "positions of −log p(x_{t+1} | x_≤t)", dims=_W),
    "answer_logprob": Metric("log-probability of the passkey", "nats", "teacher-forced, summed over the answer's "
                             "tokens", dims=_P),
    "greedy_correct": Metric("greedy decoding gives the passkey", "1", "1 if every answer token is the argmax",
                             dims=_P),
    "state_bytes": Metric("bytes the decoder keeps at the context's length", "byte",
                          "the converted model's cache (KernelCache.state_bytes, states of state_bits) after "
                          "window 0's context tokens: "
                          "every substituted head's state (one per query head: the key/value heads are repeated to "
                          "the query heads) and the kept softmax layers' keys and values, all layers"),
    "decode_max_abs_diff": Metric("largest |logit difference|, decoding against the parallel pass", "1",
                                  "over the last n_decode of the first decode_len tokens of window 0, decoded one "
                                  "at a time after the prefill of the others, and the vocabulary"),
    "decode_rel_diff": Metric("relative logit difference, decoding against the parallel pass", "1",
                              "decode_max_abs_diff / max |logit| of the parallel pass"),
    "state_bits": Metric("bits per number of the decoding states", "1",
                         "32, or 64 where the float32 states underflow on the model's activations (the float32 "
                         "cache raises; the float64 cache is used and its bytes counted)"),
    "step_seconds": Metric("seconds per decoded token", "s", "median over the n_decode steps but the first two"),
    "prefill_seconds": Metric("seconds of the prefill", "s", "decode_len − n_decode tokens of window 0"),
}
REFERENCE_METRICS = {
    "nll_exact": Metric("mean next-token NLL of the window, exact model", "nats", "the same tokens", dims=_W),
    "nll_unigram": Metric("mean next-token NLL of the window, unigram model", "nats",
                          "add-one smoothed token frequencies of the calibration split (no context): the trivial "
                          "baseline", dims=_W),
    "answer_logprob_exact": Metric("log-probability of the passkey, exact model", "nats", "the same prompts",
                                   dims=_P),
    "greedy_correct_exact": Metric("greedy decoding gives the passkey, exact model", "1", "the same prompts",
                                   dims=_P),
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


def substituted_layers(exact_layers: int) -> list[int]:
    """The layers a cell substitutes: all but ``exact_layers`` softmax layers kept at ``⌊i·30/k⌋``, ``i < k``."""
    kept = {int(i * NUM_LAYERS // exact_layers) for i in range(exact_layers)} if exact_layers else set()
    return [layer for layer in range(NUM_LAYERS) if layer not in kept]


def applicable(params) -> bool:
    """What :data:`RUNS` says: every label at ``hybrid_rank`` with every layer substituted; the rank sweep for
    FAVOR+ only; kept softmax layers (at ``hybrid_rank``) for FAVOR+, the window hybrid and Hedgehog."""
    runs = RUNS[params["estimator"]]
    at_rank = params["num_features"] == params["hybrid_rank"]
    if params["exact_layers"]:
        return at_rank and "placements" in runs
    return at_rank or "ranks" in runs


def check_params(params) -> None:
    if params["estimator"] not in ESTIMATORS:
        raise ValueError(f"estimator {params['estimator']!r} is not one of the study's: {', '.join(ESTIMATORS)}")
    if not 0 <= params["exact_layers"] < NUM_LAYERS:
        raise ValueError(f"exact_layers must be in [0, {NUM_LAYERS}), got {params['exact_layers']}")
    if params["context"] < 96:
        raise ValueError(f"context must be at least 96 tokens (a passkey prompt's fixed parts), got "
                         f"{params['context']}")


class Draw(NamedTuple):
    """What every cell of a context reads: the exact model, its tokenizer, the held-out windows, the recall prompts,
    the calibration batch, and the exact model's and the unigram model's scores on them."""

    model: object
    tokenizer: object
    windows: lm.TextWindows
    prompts: list
    calibration: torch.Tensor
    exact: dict


def _unigram_nll(tokenizer, windows: torch.Tensor) -> np.ndarray:
    """Per-window mean NLL of the add-one smoothed unigram model of the calibration split."""
    counts = np.bincount(lm.text_stream(tokenizer, split="calibration"), minlength=len(tokenizer)).astype(float)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + counts.size)
    return -logp[windows[:, 1:].numpy()].mean(axis=1)


def _passkeys(tokenizer, context: int, n: int) -> list:
    filler = lm.text_stream(tokenizer, split="evaluation")
    return [lm_eval.passkey_prompt(tokenizer, context, filler, depth=float(depth), seed=i)
            for i, depth in enumerate(np.linspace(0.1, 0.9, n))]


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
    if LM_REASON is not None:
        raise RuntimeError(f"causal_lm needs SmolLM2-135M and the Shakespeare text: {LM_REASON}")
    model, tokenizer = lm.load_smollm2()
    model = model.to(device)
    context = params["context"]
    windows = lm.text_windows(tokenizer, params["n_windows"], context, split="evaluation")
    calibration = lm.text_windows(tokenizer, params["n_calibration"], min(context, 256), split="calibration")
    prompts = _passkeys(tokenizer, context, params["n_prompts"])
    ids = windows.input_ids.to(device)
    nll_exact = lm_eval.token_nll(model, ids).mean(axis=1)
    recall = lm_eval.score_recall(model, prompts)
    exact = {"nll_exact": nll_exact, "nll_unigram": _unigram_nll(tokenizer, windows.input_ids),
             "answer_logprob_exact": recall["answer_logprob"],
             "greedy_correct_exact": recall["greedy_correct"].astype(float),
             "kv_bytes": float(lm.kv_cache_bytes(context))}
    return Draw(model, tokenizer, windows, prompts, calibration.input_ids.to(device), exact)


def run_reference(params, device, data):
    timed = [_exact_decode(data.model, n) for n in DECODE_CONTEXTS]
    return {**data.exact, "exact_step_seconds": np.array([t for t, _ in timed]),
            "exact_kv_bytes": np.array([float(b) for _, b in timed])}


def convert(data: Draw, params):
    """The cell's converted model."""
    name, options, conversion = ESTIMATORS[params["estimator"]]
    kw = dict(options, **conversion, num_features=params["num_features"],
              layers=substituted_layers(params["exact_layers"]), rng=params["map_seed"])
    trainable = name in TRAINABLE_MAPS
    if trainable or ka.capabilities(name, **options).data_dependent:
        kw["calibration"] = {"input_ids": data.calibration}
    return ka.convert(data.model, name, **kw)


def _cache_keyword(model) -> str:
    """The keyword a transformers model takes its cache by (``cache`` in transformers 5, else
    ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _decode_check(model, ids: torch.Tensor, n_decode: int, state_dtype) -> dict:
    """Prefill all but the last ``n_decode`` tokens of ``ids`` ``(1, n)`` into a :class:`KernelCache` with
    ``state_dtype``, decode those one at a time; the logits against the parallel pass, and the seconds."""
    full = model(input_ids=ids, use_cache=False).logits[0, -n_decode:].double()
    key = _cache_keyword(model)
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
    model(input_ids=ids, use_cache=True, **{_cache_keyword(model): cache})
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


def run_cell(params, rng, device, data):
    if not applicable(params):
        return not_applicable()
    model = convert(data, params)
    nll = lm_eval.token_nll(model, data.windows.input_ids.to(device)).mean(axis=1)
    recall = lm_eval.score_recall(model, data.prompts)
    return {"nll": nll, "answer_logprob": recall["answer_logprob"],
            "greedy_correct": recall["greedy_correct"].astype(float),
            **decode(model, data.windows.input_ids[:1].to(device), params)}


# ------------------------------------------------------------------------------------------------- summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    ds["delta_nll"] = (ds["nll"] - ds["nll_exact"]).assign_attrs(
        long_name="NLL increase over the exact model", units="nats",
        description="per window, nll − nll_exact (the same tokens)", comparison="difference")
    ds["delta_logprob"] = (ds["answer_logprob"] - ds["answer_logprob_exact"]).assign_attrs(
        long_name="passkey log-probability change against the exact model", units="nats",
        description="per prompt, answer_logprob − answer_logprob_exact (the same prompt)", comparison="difference")
    for name, unit in (("nll", "window"), ("nll_exact", "window"), ("nll_unigram", "window"),
                       ("delta_nll", "window"), ("answer_logprob", "prompt"), ("answer_logprob_exact", "prompt"),
                       ("delta_logprob", "prompt")):
        summary = stats.bootstrap_interval(ds[name], unit, "mean" if "nll" in name else "median")
        summary.attrs.update(long_name=ds[name].attrs["long_name"], units=ds[name].attrs["units"],
                             description=f"over the {unit}s: " + summary.attrs.get("interval", ""))
        ds[f"{name}_summary"] = summary
    for name in ("delta_nll", "delta_logprob"):
        unit = "window" if name == "delta_nll" else "prompt"
        p = stats.paired_test(ds[name], unit, test="wilcoxon")
        ds[f"{name}_p"] = p
    for name, ref in (("perplexity", "nll"), ("perplexity_exact", "nll_exact"), ("perplexity_unigram", "nll_unigram")):
        ppl = np.exp(ds[f"{ref}_summary"])
        ppl.attrs = {**ds[f"{ref}_summary"].attrs, "long_name": "perplexity exp(mean NLL)", "units": "1",
                     "statistic": "exp(mean NLL over windows)"}
        ds[f"{name}_summary"] = ppl
    for name in ("greedy_correct", "greedy_correct_exact"):
        s = stats.proportion_summary(ds[name], 1, ("prompt",))
        s.attrs.update(long_name=ds[name].attrs["long_name"], units="1",
                       description="pooled over the prompts: " + s.attrs.get("interval", ""))
        ds[f"{name}_summary"] = s
    if {"positive_orthogonal", "positive_orthogonal_shared"} <= set(ds["estimator"].values.tolist()):
        pair = (ds["nll"].sel(estimator="positive_orthogonal_shared") - ds["nll"].sel(estimator="positive_orthogonal"))
        pair = pair.assign_attrs(long_name="NLL with one draw per layer minus one draw per head", units="nats",
                                 description="per window, the same windows and r", comparison="difference")
        ds["shared_minus_per_head_nll"] = pair
        summary = stats.bootstrap_interval(pair, "window", "mean")
        summary.attrs.update(long_name=pair.attrs["long_name"], units="nats",
                             description="over the windows: " + summary.attrs.get("interval", ""))
        ds["shared_minus_per_head_nll_summary"] = summary
        ds["shared_minus_per_head_nll_p"] = stats.paired_test(pair, "window", test="wilcoxon")
    ds["memory_fraction"] = (ds["state_bytes"] / ds["kv_bytes"]).assign_attrs(
        long_name="bytes kept over the exact model's KV cache at the context's length", units="1",
        description="state_bytes / kv_bytes")
    return ds


# ---------------------------------------------------------------------------------------------------- figure
def _cells(ds: xr.Dataset, context: int):
    """``(estimator, r, k, seed)`` of the cells that ran at ``context``."""
    sub = ds["state_bytes"].sel(context=context)
    for idx in zip(*np.nonzero(np.isfinite(sub.values))):
        yield tuple(sub[d].values.tolist()[i] for d, i in zip(sub.dims, idx))


def plot(ds: xr.Dataset, path) -> None:
    context = int(ds["context"].values[-1])
    fig, axes = new_figure(2, 2, width=11, height=8)
    (ax_ppl, ax_rec), (ax_dec, ax_diff) = axes
    at = {"context": context}
    kv = float(ds["kv_bytes"].sel(**at))
    for label in ds["estimator"].values.tolist():
        style = estimator_style(label)
        for k in ds["exact_layers"].values.tolist():
            sel = dict(estimator=label, exact_layers=k, **at)
            b = ds["state_bytes"].sel(sel).mean("map_seed")
            keep = np.isfinite(b.values)
            if not keep.any():
                continue
            for ax, name in ((ax_ppl, "perplexity_summary"), (ax_rec, "answer_logprob_summary")):
                s = ds[name].sel(sel).mean("map_seed") if "map_seed" in ds[name].dims else ds[name].sel(sel)
                est, lo, hi = (s.sel(stat=x).values[keep] for x in ("estimate", "lo", "hi"))
                ax.errorbar(b.values[keep], est, yerr=[est - lo, hi - est], color=style["color"],
                            linestyle=style["linestyle"] if k == 0 else "none", marker="o" if k == 0 else "s",
                            markersize=5, capsize=2, label=f"{label}" + (f", {k} softmax layers" if k else ""))
    for ax, name, what in ((ax_ppl, "perplexity_exact_summary", "exact (KV cache)"),
                           (ax_rec, "answer_logprob_exact_summary", "exact (KV cache)")):
        s = ds[name].sel(**at)
        ax.errorbar([kv], [float(s.sel(stat="estimate"))],
                    yerr=[[float(s.sel(stat="estimate") - s.sel(stat="lo"))],
                          [float(s.sel(stat="hi") - s.sel(stat="estimate"))]], marker="*", markersize=11,
                    color="k", capsize=2, label=what)
        ax.axvline(kv, color="0.6", linewidth=0.8, linestyle=":")
        log_axis(ax, "x", label="bytes kept by the decoder at the context's length (all layers)", unit="bytes")
    uni = ds["perplexity_unigram_summary"].sel(**at)
    ax_ppl.axhline(float(uni.sel(stat="estimate")), color="0.4", linestyle="--", linewidth=1.0,
                   label="unigram model (no context)")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("perplexity on held-out text")
    ax_ppl.set_title(f"(a) perplexity against memory, {context}-token windows")
    ax_rec.set_ylabel("passkey log-probability (nats, median)")
    ax_rec.set_title(f"(b) passkey recall in {context}-token prompts")
    ax_ppl.legend(fontsize=6.5, loc="upper right")
    # (c) decode time per token
    steps = ds["exact_step_seconds"].sel(**at)
    ax_dec.plot(ds["decode_context"].values, steps.values, "k*-", label="exact (KV cache grows)")
    for label, r, k, seed in _cells(ds, context):
        if k:
            continue
        t = float(ds["step_seconds"].sel(estimator=label, num_features=r, exact_layers=k, map_seed=seed, **at))
        style = estimator_style(label)
        ax_dec.axhline(t, color=style["color"], linestyle=style["linestyle"], linewidth=0.9,
                       label=f"{label}, r = {r} (fixed state)")
    log_axis(ax_dec, "x", label="context (tokens)")
    ax_dec.set_yscale("log")
    ax_dec.set_ylabel("seconds per decoded token (one thread)")
    ax_dec.set_title("(c) decoding: per-token time against context")
    ax_dec.legend(fontsize=6.5)
    # (d) decode against the parallel pass
    names, diffs = [], []
    for label, r, k, seed in _cells(ds, context):
        names.append(f"{label} r={r}" + (f" +{k} sm" if k else ""))
        diffs.append(float(ds["decode_rel_diff"].sel(estimator=label, num_features=r, exact_layers=k,
                                                     map_seed=seed, **at)))
    ax_diff.plot(np.maximum(diffs, 1e-12), range(len(diffs)), "o", color="0.3")
    ax_diff.set_yticks(range(len(diffs)), names, fontsize=6.5)
    ax_diff.axvline(float(np.finfo(np.float32).eps), color="0.6", linestyle=":", linewidth=0.8,
                    label="float32 machine epsilon")
    ax_diff.legend(fontsize=6.5)
    ax_diff.set_xscale("log")
    ax_diff.set_xlabel("max |logit difference| / max |logit|, decoding vs parallel pass")
    ax_diff.set_title("(d) the RNN mode reproduces the parallel pass")
    kept = ", ".join(str(k) for k in ds["exact_layers"].values.tolist() if k) or "none"
    fig.suptitle("SmolLM2-135M with fixed-size states: perplexity, recall and decoding against memory")
    save_figure(fig, path, (
        f"SmolLM2-135M-Instruct (30 layers, 9 query / 3 key-value heads of dimension 64) with feature maps of r "
        f"features per head in every layer but the kept softmax layers (squares: {kept} kept, evenly spaced). "
        f"(a) Perplexity on {ds.sizes['window']} held-out windows of {context} tokens of "
        f"Shakespeare against the bytes the decoder keeps (every layer's state, kept layers' KV caches); bars: 95 % "
        f"bootstrap intervals over windows; star: the exact model at its KV cache; dashed: a unigram model. (b) The "
        f"passkey's log-probability (median over {ds.sizes['prompt']} prompts, bootstrap interval). (c) Seconds per "
        "decoded token: the exact model with KV caches of 1k–32k tokens against the fixed states (measured "
        "after a short prefill and drawn flat: their step does the same work at any context). (d) Largest logit "
        "difference between token-by-token decoding and the parallel pass over the last decoded tokens of "
        "window 0."),
        title="SmolLM2-135M as an RNN")


# -------------------------------------------------------------------------------------------------- findings
def _name(label, r, k):
    return f"`{label}` at r = {r}" + (f" with {k} softmax layers" if k else "")


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
        cells = list(_cells(ds, context))
        parts, worse_than_unigram = [], []
        for label, r, k, seed in cells:
            sel = dict(estimator=label, num_features=r, exact_layers=k, map_seed=seed, **at)
            ppl = ds["perplexity_summary"].sel(sel)
            delta = ds["delta_nll_summary"].sel(sel)
            p = float(ds["delta_nll_p"].sel(sel))
            frac = float(ds["memory_fraction"].sel(sel))
            bits = "" if float(ds["state_bits"].sel(sel)) == 32 else ", float64 states: float32 ones underflow"
            parts.append(f"{_name(label, r, k)}: {fmt_ci(ppl)} ({fmt_bytes(ds['state_bytes'].sel(sel))}{bits}, "
                         f"{fmt(frac)} of the KV cache; NLL +{fmt_ci(delta)} nats, Wilcoxon p = {fmt(p, 2)})")
            if float(ppl.sel(stat="lo")) > float(uni.sel(stat="hi")):
                worse_than_unigram.append(_name(label, r, k))
        lines.append("Perplexity of the substituted models on the same windows (paired with the exact model): "
                     + "; ".join(parts) + ".")
        if worse_than_unigram:
            lines.append("Worse than the unigram model (intervals apart): " + ", ".join(worse_than_unigram) + ".")
        best = min(cells, key=lambda c: float(ds["perplexity_summary"].sel(
            estimator=c[0], num_features=c[1], exact_layers=c[2], map_seed=c[3], context=context,
            stat="estimate")), default=None)
        if best is not None:
            sel = dict(estimator=best[0], num_features=best[1], exact_layers=best[2], map_seed=best[3], **at)
            ratio = float(ds["perplexity_summary"].sel(sel).sel(stat="estimate")) / float(exact.sel(stat="estimate"))
            lines.append(f"Lowest perplexity: {_name(*best[:3])}, {fmt(ratio)} × the exact model's, keeping "
                         f"{fmt(float(ds['memory_fraction'].sel(sel)))} of its KV cache's bytes.")
        if "shared_minus_per_head_nll_summary" in ds:
            r = int(ds["hybrid_rank"])
            one = dict(num_features=r, exact_layers=0, map_seed=ds["map_seed"].values.tolist()[0], **at)
            diff = ds["shared_minus_per_head_nll_summary"].sel(one)
            if np.isfinite(float(diff.sel(stat="estimate"))):
                t_head = float(ds["step_seconds"].sel(estimator="positive_orthogonal", **one))
                t_shared = float(ds["step_seconds"].sel(estimator="positive_orthogonal_shared", **one))
                lines.append(f"FAVOR+ at r = {r} with one draw per layer shared by its heads (share_heads) against "
                             f"one draw per head (one draw of each per map_seed), on the same windows: NLL difference "
                             f"{fmt_ci(diff)} nats (Wilcoxon "
                             f"p = {fmt(float(ds['shared_minus_per_head_nll_p'].sel(one)), 2)}); seconds per decoded "
                             f"token {fmt(t_shared, 2)} against {fmt(t_head, 2)} (the heads of a layer decode as one "
                             "batch).")
        acc = ds["greedy_correct_exact_summary"].sel(**at)
        lp = ds["answer_logprob_exact_summary"].sel(**at)
        parts = []
        for label, r, k, seed in cells:
            sel = dict(estimator=label, num_features=r, exact_layers=k, map_seed=seed, **at)
            parts.append(f"{_name(label, r, k)}: {fmt_ci(ds['greedy_correct_summary'].sel(sel), percent=True)} "
                         f"correct, log-probability {fmt_ci(ds['answer_logprob_summary'].sel(sel))} (change "
                         f"{fmt_ci(ds['delta_logprob_summary'].sel(sel))}, p = "
                         f"{fmt(float(ds['delta_logprob_p'].sel(sel)), 2)})")
        lines.append(f"Passkey recall in {context}-token prompts ({ds.sizes['prompt']} prompts): the exact model "
                     f"answers {fmt_ci(acc, percent=True)} greedily, median log-probability {fmt_ci(lp)} nats; "
                     + "; ".join(parts) + ".")
        diffs = {c: float(ds["decode_rel_diff"].sel(estimator=c[0], num_features=c[1], exact_layers=c[2],
                                                    map_seed=c[3], **at)) for c in cells}
        close = [c for c in cells if diffs[c] <= 1e-3]
        if close:
            lines.append(f"Token-by-token decoding through the fixed-size cache reproduces the parallel pass: "
                         f"relative logit difference at most {fmt(max(diffs[c] for c in close), 2)} in "
                         f"{len(close)} of {len(cells)} cells.")
        for c in (c for c in cells if diffs[c] > 1e-3):
            sel = dict(estimator=c[0], num_features=c[1], exact_layers=c[2], map_seed=c[3], **at)
            wide = float(ds["state_bits"].sel(sel)) == 64
            worse = _name(*c[:3]) in worse_than_unigram
            lines.append(f"{_name(*c[:3])}: decoding and the parallel pass differ by {fmt(diffs[c], 2)} of the "
                         "largest logit" + (" (its decoding states are float64, its parallel pass float32: the "
                                            "two compute the estimate at different precisions)" if wide else "")
                         + ("; this model is worse than the unigram model" if worse else "") + ".")
        steps = ds["exact_step_seconds"].sel(**at)
        fixed = [float(ds["step_seconds"].sel(estimator=c[0], num_features=c[1], exact_layers=c[2], map_seed=c[3],
                                              **at)) for c in cells if c[2] == 0]
        if fixed:
            longest = int(ds["decode_context"].values[-1])
            lines.append(f"Decoding, seconds per token on one thread: the exact model {fmt(float(steps[0]), 2)} s "
                         f"at {int(ds['decode_context'].values[0])} tokens of KV cache and "
                         f"{fmt(float(steps[-1]), 2)} s at {longest} "
                         f"({fmt_bytes(ds['exact_kv_bytes'].sel(**at)[-1])}); the fixed states "
                         f"{fmt(min(fixed), 2)}–{fmt(max(fixed), 2)} s (measured after "
                         f"{int(ds['decode_len']) - int(ds['n_decode'])} tokens; a fixed state's step does the same "
                         "work at any context).")
    return lines


EXPERIMENT = Experiment(
    name="causal_lm", title="A pretrained causal LM as an RNN: perplexity, recall and decoding against memory",
    description=" ".join(__doc__.split()),
    grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot, data_axes=("context",), draw=draw,
    reference=Reference(run_cell=run_reference, metrics=REFERENCE_METRICS, axes=("context",)),
    parameters=PARAMETERS, axis_attrs=AXIS_ATTRS, summarise=summarise, findings=findings,
    check_params=check_params, replicates="the text windows (NLL) and the prompts (recall)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
