"""Causal attention heads of trained models: per-layer, per-head queries, keys and values on evaluation prompts.

The reference models of :mod:`kernapprox.models.presets` are trained (or loaded from the checkpoint cache) and run
on ``num_prompts`` evaluation prompts of their own task, drawn from a fixed stream apart from training and from the
studies' prompts; every layer's queries, keys and values (the outputs of its projections, split into heads) are
stored once as netCDF in ``<cache>/trained_heads/`` (``<cache>``: the cache root of :mod:`kernapprox.cache`, or the
``cache_dir`` given), like the MiniLM heads of :mod:`kernapprox.real`. The extraction checks
itself: causal softmax attention rebuilt from the recorded ``q, k, v`` and the layer's output projection reproduces
the layer's own output (attribute ``rebuild_max_abs_error``).

Unlike MiniLM's, these heads were trained causally: each query only ever saw the keys before it, which is the
setting of a linear-attention state. :class:`TrainedCausalHeads` samples them, registered as
``distributions.make_distribution("trained_causal", task=...)`` when :mod:`kernapprox.models` is imported.

>>> from kernapprox.models import heads
>>> stream = heads.load_heads("mqar", num_prompts=8)     # doctest: +SKIP
>>> stream["q"].shape                                   # (layer, head, prompt, token, dim)   # doctest: +SKIP
(2, 2, 8, 64, 32)
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import numpy as np
import torch

from ..cache import cache_dir as _cache_folder
from ..distributions import Distribution, check_layer_head, register_distribution
from ..io import atomic_write, read_arrays
from ..validation import check_choice, check_positive_int
from .training import config_key, load_or_train
from .transformer import attention_heads

__all__ = ["extract_heads", "load_heads", "heads_path", "PROMPT_SEED", "TrainedCausalHeads"]

PROMPT_SEED = 2**31 - 7  # the prompts heads are recorded on: a stream no training or study uses


def _reference(task_name: str):
    from . import presets

    return presets.reference(task_name)


def heads_path(task_name: str, num_prompts: int, cache_dir=None) -> Path:
    """Where the heads of ``task_name``'s reference model on ``num_prompts`` prompts are cached (the file name
    holds the model's cache key, so a retrained model gets a new extraction)."""
    key = config_key(*_reference(task_name))
    return _cache_folder("trained_heads", root=cache_dir) / f"trained_heads_{task_name}_{key}_p{num_prompts}.nc"


def _rebuild_error(model, inputs, recorded) -> float:
    """Max |layer output − out_proj(causal softmax(s q kᵀ) v)| over layers, from the recorded heads."""
    from .transformer import record_attention_inputs

    error = 0.0
    with torch.no_grad(), record_attention_inputs(model) as records:
        model(inputs)
        for i, attn in enumerate(model.attentions):
            q, k, v = recorded["q"][i], recorded["k"][i], recorded["v"][i]
            s = float(recorded["scale"][i])
            logits = s * (q.double() @ k.double().transpose(-1, -2))
            n = logits.shape[-1]
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            ctx = torch.softmax(logits, -1) @ v.double()                            # (B, H, n, dv)
            merged = ctx.transpose(1, 2).reshape(ctx.shape[0], n, -1)
            rebuilt = torch.nn.functional.linear(merged, attn.out_proj.weight.double(), attn.out_proj.bias.double())
            own = attn(records[i][0]).double()
            error = max(error, float((rebuilt - own).abs().max()))
    return error


def extract_heads(task_name: str, num_prompts: int = 64, cache_dir=None):
    """Record the heads of the reference model of ``task_name`` on ``num_prompts`` prompts and write the netCDF
    cache (atomically). Returns the ``xarray.Dataset``: ``q``, ``k``, ``v`` ``(layer, head, prompt, token, dim)``
    float32 and the model's inputs; attributes: the model's cache key and configuration, the prompt seed, the
    per-layer kernel scale, the rebuild check, the date."""
    import xarray as xr

    num_prompts = check_positive_int(num_prompts, "num_prompts")
    model_config, task, train_config = _reference(task_name)
    for spec in model_config.layer_specs():
        if spec.estimator != "exact":
            raise ValueError("trained heads are recorded from softmax reference models only")
    trained = load_or_train(model_config, task, train_config, cache_dir=cache_dir)
    model = trained.model.cpu()
    batch = task.sample(np.random.default_rng(PROMPT_SEED), num_prompts)
    rec = attention_heads(model, batch.inputs)
    error = _rebuild_error(model, batch.inputs, rec)

    def arrange(t):                                       # (layer, B, H, n, d) -> (layer, H, B, n, d)
        return t.transpose(1, 2).float().numpy()

    dims = ("layer", "head", "prompt", "token", "dim")
    data = {name: (dims, arrange(rec[name])) for name in ("q", "k", "v")}
    inputs = batch.inputs.numpy()
    data["inputs"] = (("prompt", "token") + (("feature",) if inputs.ndim == 3 else ()), inputs)
    ds = xr.Dataset(data, attrs={
        "task": task_name, "model_key": trained.key, "model_config": trained.curve.attrs["config"],
        "prompt_seed": PROMPT_SEED, "num_prompts": num_prompts,
        "scale": json.dumps([float(v) for v in rec["scale"].tolist()]),
        "causal": "trained with a causal mask: query i saw keys j <= i only",
        "rebuild_max_abs_error": error,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "dtype": "float32"})
    target = heads_path(task_name, num_prompts, cache_dir)
    atomic_write(target, lambda tmp: ds.to_netcdf(tmp, engine="h5netcdf"))
    return ds


def load_heads(task_name: str, num_prompts: int = 64, cache_dir=None) -> dict:
    """The cached heads as numpy arrays (``q``, ``k``, ``v``: ``(layer, head, prompt, token, dim)`` float32;
    ``scale`` per layer; ``attrs``), recorded first (training the reference model if it is not cached, about a
    minute on a CPU) when missing. Loaded once per process."""
    path = heads_path(task_name, num_prompts, cache_dir)
    if not path.exists():
        extract_heads(task_name, num_prompts, cache_dir)
    data = read_arrays(path, ("q", "k", "v"))
    return {**data, "scale": np.asarray(json.loads(data["attrs"]["scale"]))}


class TrainedCausalHeads(Distribution):
    """Queries, keys and values of a small causal Transformer trained on an in-context-learning task.

    The softmax reference model of ``task`` (:func:`kernapprox.models.presets.reference`: ``"mqar"``, 2 layers ×
    2 heads of dimension 32 on Zoology's multi-query associative recall; ``"regression"``, 3 layers × 2 heads
    on Garg et al.'s in-context linear regression) is loaded from the checkpoint cache (trained first if it is
    missing, about a minute on a CPU) and its heads are recorded on ``num_prompts`` evaluation prompts
    (:func:`load_heads`, cached as netCDF). A draw picks, per batch element, a uniformly
    random prompt and takes its first ``n`` tokens (a causal model's queries at a prefix saw exactly that prefix),
    and per head slot a distinct ``(layer, head)``: from ``layer`` if given (``head`` fixes the head), else from
    all layers. ``d`` must be the model's head dimension (32).

    Unlike :class:`kernapprox.real.RealHeads` (bidirectional BERT), these heads were trained with the causal mask,
    and on a task that needs sharp, content-based retrieval (MQAR's induction heads): the keys a linear-attention
    state would hold. The model's scale is ``1/sqrt(32)``, the kernapprox default.
    """

    name = "trained_causal"

    def __init__(self, *, task: str = "mqar", layer: int | None = None, head: int | None = None,
                 num_prompts: int = 64, cache_dir=None):
        check_choice(task, "task", ("mqar", "regression"))
        model_config, _, _ = _reference(task)
        check_layer_head(layer, head, model_config.num_layers, model_config.num_heads)
        self.task = task
        self.layer = layer
        self.head = head
        self.num_prompts = check_positive_int(num_prompts, "num_prompts")
        self.cache_dir = cache_dir
        self._shape = (model_config.num_layers, model_config.num_heads, model_config.max_len,
                       model_config.head_dim)

    def _draw(self, batch, heads, n, d, rng):
        layers, num_heads, length, head_dim = self._shape
        if d != head_dim:
            raise ValueError(f"d must be {head_dim} (the model's head dimension) for trained heads, got {d}")
        if n > length:
            raise ValueError(f"n={n} exceeds the model's sequence length {length}")
        pairs = [(lay, h) for lay in (range(layers) if self.layer is None else [self.layer])
                 for h in (range(num_heads) if self.head is None else [self.head])]
        if heads > len(pairs):
            raise ValueError(f"heads={heads} exceeds the {len(pairs)} available (layer, head) pairs")
        stream = load_heads(self.task, self.num_prompts, self.cache_dir)
        out = {name: np.empty((batch, heads, n, d)) for name in ("q", "k", "v")}
        for b in range(batch):
            prompt = int(rng.integers(0, self.num_prompts))
            chosen = rng.choice(len(pairs), size=heads, replace=False)
            for slot, index in enumerate(chosen):
                lay, h = pairs[index]
                for name in out:
                    out[name][b, slot] = stream[name][lay, h, prompt, :n]
        return out["q"], out["k"], out["v"]


register_distribution(TrainedCausalHeads)
