"""Convert a model: a copy whose chosen layers and heads attend with a kernapprox estimator.

:func:`convert` is the one-call form (a registry name, ``r``, layers, heads, a seed, a calibration batch);
:func:`substitute` puts given fitted estimators into a copy; :func:`calibrate` fits data-dependent maps layer by
layer on a calibration batch, each layer on the activations of the model as substituted below it. The
adapter of a model (:func:`stack_for`: where its attention modules are, its sizes) is found by its configuration's
``model_type`` in :data:`FAMILIES` for the encoders (``"bert"``: BERT-family encoders, MiniLM included,
:class:`~kernapprox.surgery.bert.BertStack`); every other model is a decoder whose attention goes through
transformers' attention interface (:class:`~kernapprox.surgery.decoder.DecoderStack`: Llama, Qwen2/3, Mistral,
Phi-3, OLMo-2, GPT-2, GPT-NeoX, Gemma, … with their rotary or learned positions, grouped-query heads and q/k norms),
or is refused with the reason (:data:`~kernapprox.surgery.decoder.REFUSALS`: ALiBi, soft-capping, sliding windows,
attention outside the interface). Before it substitutes anything a conversion runs one probe pass
(:func:`~kernapprox.surgery.attention.probe`) that checks every layer's attention reaches the interface and reads the
``scaling`` each module passes (an estimator is built with that kernel scale where it is not ``d^{-1/2}``, GPT-2's
``scale_attn_by_inverse_layer_idx`` for one). A converted causal decoder keeps the Hugging Face decoding interface,
with fixed-size states as the cache of its substituted layers (:mod:`~kernapprox.surgery.cache`).

Trainable maps (:data:`TRAINABLE_MAPS`: ``"hedgehog_trainable"``, ``"t2r_trainable"``) are not estimators but
parameters: each chosen layer gets one map module (:class:`~kernapprox.trainable.HedgehogMap` or
:class:`~kernapprox.trainable.T2RMap`, one set of parameters per key/value head) inside a
:class:`~kernapprox.surgery.attention.TrainableAttention`, a submodule of the layer's attention module, which the
model's optimiser trains; a calibration batch, when given, initialises them by attention transfer
(:func:`~kernapprox.trainable.fit_to_softmax`), layer by layer.

>>> import torch, transformers
>>> from kernapprox.surgery import convert
>>> config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
...                                  intermediate_size=20, attn_implementation="eager")
>>> model = transformers.BertModel(config).eval()
>>> ids = torch.tensor([[1, 5, 7, 2]])
>>> same = convert(model, "exact")
>>> bool(torch.allclose(same(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state, atol=1e-5))
True
>>> fast = convert(model, "positive_orthogonal", num_features=32, layers=[1], rng=0)
"""

from __future__ import annotations

import copy as _copy
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..estimators.registry import TRAINABLE_MAP_NAMES, available_estimators, capabilities, make_estimator
from ..validation import check_choice, check_positive_float, check_positive_int
from . import attention as sa
from . import cache as _cache
from .bert import BertStack
from .decoder import DecoderStack, check_transformers_model
from .placement import check_layers

__all__ = ["FAMILIES", "TRAINABLE_MAPS", "stack_for", "head_seed", "substitute", "calibrate", "convert",
           "fit_records"]

# model_type (a transformers configuration's declared field) -> layer-stack adapter of the encoder families; every
# other model is a decoder of DecoderStack (attention through transformers' interface) or refused with the reason
FAMILIES: dict[str, type] = {"bert": BertStack}
# the names convert() takes for trainable maps (parameters of the converted model, not registry estimators); the
# classes are kernapprox.trainable.MAPS, imported when such a map is built
TRAINABLE_MAPS: tuple[str, ...] = TRAINABLE_MAP_NAMES
# convert()'s other options of a trainable map, by what they configure
_ATTENTION_OPTIONS = ("mode", "chunk_size", "window")
_FIT_OPTIONS = ("fit_loss", "fit_steps", "fit_lr", "fit_batch_size")


def stack_for(model):
    """The adapter of ``model``: its family's in :data:`FAMILIES` (by ``model.config.model_type``), else a
    :class:`~kernapprox.surgery.decoder.DecoderStack`. ``TypeError`` for an object that is not a transformers
    model; ``ValueError`` naming the reason for a model that cannot be converted exactly."""
    check_transformers_model(model)
    family = FAMILIES.get(model.config.model_type)
    return DecoderStack(model) if family is None else family(model)


def _probe(model, stack) -> list:
    """The attention call of every layer of ``model`` (enabled) on a two-token input, in eval mode (no dropout, no
    random draw; the modules' training flags restored): :func:`~kernapprox.surgery.attention.probe`, which refuses
    layers whose attention does not reach transformers' attention interface and calls a substituted layer cannot
    honour. Checks the adapter's sizes against what the modules pass."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=device)}
    if stack.decodes:
        inputs["use_cache"] = False
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            calls = sa.probe(stack.attention_modules(), lambda: model(**inputs))
    finally:
        for module, training in flags:
            module.training = training
    for layer, call in enumerate(calls):
        if call.query.shape[1] != stack.num_heads or call.query.shape[-1] != stack.head_dim:
            raise ValueError(f"layer {layer}'s attention passes {call.query.shape[1]} heads of dimension "
                             f"{call.query.shape[-1]}; the configuration declares {stack.num_heads} of "
                             f"{stack.head_dim}")
    return calls


def _check_causal(stack, estimator: str, options) -> None:
    """Refuse, before anything is built or fitted, an estimator that cannot attend causally for a causal decoder
    (its declared capability, :func:`~kernapprox.estimators.registry.capabilities`)."""
    if stack.decodes and estimator not in TRAINABLE_MAPS and not capabilities(estimator, **options).causal:
        raise ValueError(f"estimator {estimator!r} cannot be causal (capabilities({estimator!r}).causal is False: "
                         "its estimate of a query's attention needs keys after it, or a fit on them), so it cannot "
                         f"convert the causal decoder {stack.config.model_type!r}; choose a causal estimator")


def _scale_options(options, calls, layer: int, head_dim: int) -> dict:
    """``options`` with ``scale`` the module's ``scaling`` where it is not ``head_dim^{-1/2}`` and the caller gave
    none (the estimator's kernel is then the module's, ``exp(qᵀk · scaling)``)."""
    scaling = calls[layer].scaling
    if "scale" in options or math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-12):
        return options
    return {**options, "scale": scaling}


def head_seed(rng, layer: int, head: int) -> np.random.SeedSequence:
    """The seed of ``(layer, head)``: ``SeedSequence(entropy, spawn_key=(*spawn_key, layer, head))`` of the root
    ``rng`` (an int or a ``SeedSequence``), independent of which other layers and heads are substituted."""
    if isinstance(rng, bool) or not isinstance(rng, numbers.Integral | np.random.SeedSequence):
        raise TypeError(f"rng must be an int or a numpy SeedSequence (a Generator's draws would depend on which "
                        f"layers are converted), got {type(rng).__name__}")
    root = rng if isinstance(rng, np.random.SeedSequence) else np.random.SeedSequence(int(rng))
    return np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, int(layer), int(head)))


def substitute(model, layers: Mapping[int, Sequence], *, copy: bool = True):
    """``model`` (a copy, unless ``copy=False``) with layer ``l``'s attention heads given by ``layers[l]``: one entry
    per query head, a fitted estimator, a :class:`~kernapprox.surgery.attention.PerSequence` or ``None`` (the
    model's own head). Everything else is the model's own."""
    stack_for(model)                                   # refusals before the copy
    target = _copy.deepcopy(model) if copy else model
    stack = stack_for(target)
    check_layers(layers, "layers", stack.num_layers)
    sa.enable(target)
    _probe(target, stack)
    for layer, heads in layers.items():
        sa.set_attention(stack.attention_module(int(layer)), sa.SubstitutedAttention(heads))
    if stack.decodes:
        _cache.install(target)
    return target


@torch.no_grad()
def calibrate(model, estimators: Mapping[int, Sequence], calibration: Mapping) -> dict[int, list]:
    """Fit ``estimators`` (``{layer: per-head unfitted estimators or None}``) on the calibration batch, layer by
    layer in order: each layer's maps on the real tokens (``attention_mask``) of the batch as the model computes
    them with the layers below already substituted. Heads holding one estimator object (a key/value group,
    ``convert(..., share_heads="group")``) are fitted once, on their queries together and their shared keys.
    ``model`` must be enabled (it is, after :func:`substitute`); the fitted layers are set on it. Returns
    ``{layer: per-head fitted estimators}``."""
    if not isinstance(calibration, Mapping) or "input_ids" not in calibration and "inputs_embeds" not in calibration:
        raise TypeError("calibration must be a mapping of model inputs (input_ids, attention_mask, ...)")
    stack = stack_for(model)
    inputs = dict(calibration)
    if stack.decodes:
        inputs.setdefault("use_cache", False)            # a calibration pass keeps no decoder cache
    fitted = {}
    order = sorted(estimators)

    def fit(position: int, call) -> sa.SubstitutedAttention:
        layer = order[position]
        heads = list(estimators[layer])
        real = (torch.ones(call.query.shape[0], call.query.shape[-2], dtype=torch.bool, device=call.query.device)
                if call.key_padding_mask is None else ~call.key_padding_mask[:, 0])
        out = list(heads)
        shared: dict[int, list[int]] = {}             # heads holding one estimator object are fitted once, together
        for head, est in enumerate(heads):
            if est is not None:
                shared.setdefault(id(est), []).append(head)
        for index in shared.values():
            queries = torch.cat([call.query[:, head][real] for head in index])
            keys = call.key[:, index[0]][real]
            if any(not torch.equal(call.key[:, head], call.key[:, index[0]]) for head in index[1:]):
                raise ValueError(f"heads {index} of layer {layer} share one estimator but not their keys: heads that "
                                 "share a data-dependent map must be one key/value group")
            fitted_est = heads[index[0]].fit(queries, keys)
            for head in index:
                out[head] = fitted_est
        fitted[layer] = out
        return sa.SubstitutedAttention(out)

    # one forward pass: each layer fitted when the pass reaches it, on what the layers below (fitted) produce
    sa.fit_in_one_pass([stack.attention_module(layer) for layer in order], fit, lambda: model(**inputs))
    return fitted


def convert(model, estimator: str, *, num_features: int | None = None, layers=None, heads=None, rng=0,
            calibration: Mapping | None = None, share_heads: bool | str = False, **options):
    """A copy of ``model`` whose chosen layers and heads attend with the registry estimator ``estimator``, or
    with a trainable map of :data:`TRAINABLE_MAPS`.

    Parameters
    ----------
    model
        A transformers model on the eager or SDPA attention implementation: an encoder of :data:`FAMILIES`, or a
        decoder whose attention goes through transformers' attention interface
        (:class:`~kernapprox.surgery.decoder.DecoderStack`). ``TypeError`` for anything else than a transformers
        model; ``ValueError`` naming the reason for a model that cannot be converted exactly (soft-capping, sliding
        windows, ALiBi, attention outside the interface: :data:`~kernapprox.surgery.decoder.REFUSALS`) and, before
        any copy or calibration, for an estimator that cannot be causal (``capabilities(name).causal``) with a
        causal decoder.
    estimator : str
        A registry name (``"exact"`` reproduces the model to rounding), or ``"hedgehog_trainable"`` /
        ``"t2r_trainable"``: one trainable map per chosen layer, a parameter of the copy (see below).
    num_features : int, optional
        ``r`` per head (``None`` for maps whose dimension ``d`` fixes; for a trainable map, ``None`` is
        ``feature_dim = d``: ``r = 2d`` for Hedgehog, ``r = d`` for T2R).
    layers, heads : iterables of int, optional
        The layers (default: all) and, in each, the query heads (default: all) to substitute; the other heads keep
        the model's own attention.
    rng : int or numpy SeedSequence
        Root seed; head ``h`` of layer ``l`` draws from :func:`head_seed` ``(rng, l, h)``.
    calibration : mapping of model inputs, optional
        The batch data-dependent maps are fitted on (:func:`calibrate`); required for them, and never the text the
        converted model is then evaluated on.
    share_heads : bool or "group"
        ``False`` (default): every substituted head draws its own map. ``"group"``: one draw per key/value head
        (grouped-query attention, Ainslie et al. 2023), from :func:`head_seed` ``(rng, l, h₀)`` with ``h₀`` the
        group's first query head, shared by the group's query heads; a data-dependent map is fitted once per group,
        on the group's queries (all its heads) and its keys. ``True``: one draw per layer, from :func:`head_seed`
        ``(rng, l, 0)``, shared by the layer's substituted heads, as the Performer's reference code shares one
        projection per attention layer (Choromanski et al. 2021); data-dependent maps refuse it. Each head's
        estimate keeps its distribution (unbiased maps stay unbiased); the heads' errors are then correlated. Heads
        sharing a map run as one batch in every call, and when they are whole key/value groups (``"group"``, or
        ``True`` with every head substituted) a decoder keeps **one state per key/value head**
        (:class:`~kernapprox.attention.decode.GroupedQueryCache`): ``1/G`` of the per-query-head states' bytes,
        as the model's own KV cache keeps one key and value per key/value head. With ``False`` every query head
        keeps its own state (its keys' features differ from its group's other heads').
    **options
        Further constructor options of the estimator.

    Notes
    -----
    Trainable maps. With ``estimator="hedgehog_trainable"`` (:class:`~kernapprox.trainable.HedgehogMap`,
    ``φ_h(x) = softmax([W_h x + b_h, −(W_h x + b_h)])``, Zhang et al. 2024, §4) or ``"t2r_trainable"``
    (:class:`~kernapprox.trainable.T2RMap`, ``φ_h(x) = relu(W_h x + b_h)`` floored at ``eps``, Kasai et al. 2021,
    eq. 4–5), each chosen layer's attention module gets a
    :class:`~kernapprox.surgery.attention.TrainableAttention` submodule holding one map with ``num_heads`` the
    layer's key/value heads (each query head uses its group's map; one state per key head) in the model's dtype and
    device: its ``weight``/``bias`` are in ``model.parameters()`` and the ``state_dict``. Every head of a layer is
    the map's (``heads`` must be ``None``). ``num_features`` is ``r`` (even for Hedgehog, ``feature_dim = r/2``).
    Initialisation: Hedgehog at the identity when ``feature_dim = d`` (else ``init="random"``), T2R at a random
    draw; a random draw of layer ``l`` comes from :func:`head_seed` ``(rng, l, 0)``. Options: ``bias``, ``init``,
    ``normalize`` (Hedgehog), ``eps`` (T2R, default ``1e-6`` so that no query meets a zero kernel), ``mode``,
    ``chunk_size`` and ``window`` (of :func:`~kernapprox.trainable.feature_attention`: with ``window = w`` each
    layer is LoLCATs' hybrid, the last ``w`` keys by the model's own softmax and the map for the keys before them,
    Zhang et al. 2025, §3.2; the map is then fitted inside it, and the model keeps no decoding state); with
    ``calibration``, attention transfer
    (:func:`~kernapprox.trainable.fit_to_softmax`) on the batch's activations, layer by layer, with ``fit_loss``
    (``"weights"``, Hedgehog's cross-entropy, default, or ``"outputs"``), ``fit_steps`` (100), ``fit_lr`` (0.01),
    ``fit_batch_size`` (every sequence); each layer's :class:`~kernapprox.trainable.FitRecord` is its
    ``TrainableAttention.fit_record`` (:func:`fit_records`). Without ``calibration`` the maps keep their
    initialisation, for the model's optimiser to train.
    """
    if estimator in TRAINABLE_MAPS:
        if share_heads:
            raise ValueError(f"share_heads is for registry estimators; {estimator!r} holds one map per key/value "
                             "head already")
        return _convert_trainable(model, estimator, num_features=num_features, layers=layers, heads=heads, rng=rng,
                                  calibration=calibration, **options)
    check_choice(estimator, "estimator", available_estimators())
    _check_causal(stack_for(model), estimator, options)      # refusals before the copy and any calibration
    converted = _copy.deepcopy(model)
    stack = stack_for(converted)
    chosen = sorted(check_layers(range(stack.num_layers) if layers is None else layers, "layers", stack.num_layers))
    head_set = set(range(stack.num_heads)) if heads is None else _check_heads(heads, stack.num_heads)
    sa.enable(converted)
    calls = _probe(converted, stack)
    if stack.decodes:                # decoding through the model's own cache interface
        _cache.install(converted)
    dtype = next(converted.parameters()).dtype
    device = next(converted.parameters()).device
    if isinstance(share_heads, str) and share_heads != "group":
        raise ValueError(f"share_heads must be False, True or 'group', got {share_heads!r}")
    if not isinstance(share_heads, bool | str):
        raise TypeError(f"share_heads must be a bool or 'group', got {share_heads!r}")
    per_group = share_heads == "group"
    groups = stack.num_heads // getattr(stack, "num_kv_heads", stack.num_heads)
    if share_heads is True and capabilities(estimator, **options).data_dependent:
        raise ValueError(f"share_heads=True with the data-dependent {estimator!r}: each head is fitted on its own "
                         "activations, so heads cannot share one fit")
    pending = {}                                          # layer -> heads still to be fitted on calibration data
    base_options = options
    for layer in chosen:
        options = _scale_options(base_options, calls, layer, stack.head_dim)
        per_head = []
        shared = None
        for head in range(stack.num_heads):
            if head not in head_set:
                per_head.append(None)
                continue
            if share_heads is True:
                if shared is None:
                    shared = make_estimator(estimator, num_features=num_features, rng=head_seed(rng, layer, 0),
                                            **options).fit(torch.zeros(1, stack.head_dim, dtype=dtype, device=device))
                per_head.append(shared)
                continue
            first = head - head % groups if per_group else head        # the head whose draw this head uses
            if first != head and per_head[first] is not None:
                per_head.append(per_head[first])                         # the group's estimator, one object
                if first in pending.get(layer, ()):                      # fitted once, on the group's heads
                    pending[layer].append(head)
                continue
            est = make_estimator(estimator, num_features=num_features, rng=head_seed(rng, layer, first), **options)
            if est.capabilities().data_dependent:
                pending.setdefault(layer, []).append(head)
            else:                                             # one draw per (layer, head): fit on a shape
                est = est.fit(torch.zeros(1, stack.head_dim, dtype=dtype, device=device))
            per_head.append(est)
        if layer not in pending:
            sa.set_attention(stack.attention_module(layer), sa.SubstitutedAttention(per_head))
        else:
            pending[layer] = (pending[layer], per_head)
    if pending:
        if calibration is None:
            raise ValueError(f"{estimator} is data-dependent: pass calibration= (a batch of model inputs it is "
                             "fitted on, apart from the text the converted model is evaluated on)")
        unfitted = {layer: [e if h in todo else None for h, e in enumerate(per_head)]
                    for layer, (todo, per_head) in pending.items()}
        fitted = calibrate(converted, unfitted, calibration)
        for layer, (todo, per_head) in pending.items():
            merged = [fitted[layer][h] if h in todo else e for h, e in enumerate(per_head)]
            sa.set_attention(stack.attention_module(layer), sa.SubstitutedAttention(merged))
    return converted


def _check_heads(heads, num_heads: int) -> set[int]:
    out = set()
    for head in heads:
        if isinstance(head, bool) or not isinstance(head, numbers.Integral) or not 0 <= head < num_heads:
            raise ValueError(f"heads must hold head indices in [0, {num_heads}), got {head!r}")
        out.add(int(head))
    if not out:
        raise ValueError("heads must name at least one head (None: all of them)")
    return out


def fit_records(model) -> dict:
    """``{layer: FitRecord}`` of a model converted with a trainable map and a calibration batch (the attention
    transfer of each layer's map, :func:`~kernapprox.trainable.fit_to_softmax`); empty without one."""
    stack = stack_for(model)
    out = {}
    for layer in range(stack.num_layers):
        attention = sa.get_attention(stack.attention_module(layer))
        if isinstance(attention, sa.TrainableAttention) and attention.fit_record is not None:
            out[layer] = attention.fit_record
    return out


def _convert_trainable(model, estimator: str, *, num_features, layers, heads, rng, calibration, **options):
    """:func:`convert` with a trainable map (see its docstring)."""
    from ..trainable import LOSSES, MAP_OPTIONS, make_map

    allowed = MAP_OPTIONS[estimator] + _ATTENTION_OPTIONS + _FIT_OPTIONS
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"convert({estimator!r}) got unknown options {', '.join(unknown)}; it takes "
                        f"{', '.join(allowed)}")
    fit = {name: options.pop(name) for name in _FIT_OPTIONS if name in options}
    attention_options = {name: options.pop(name) for name in _ATTENTION_OPTIONS if name in options}
    if fit and calibration is None:
        raise ValueError(f"{', '.join(sorted(fit))} configure the attention transfer on a calibration batch: pass "
                         "calibration=")
    loss = check_choice(fit.get("fit_loss", "weights"), "fit_loss", LOSSES)
    steps = check_positive_int(fit.get("fit_steps", 100), "fit_steps")
    lr = check_positive_float(fit.get("fit_lr", 0.01), "fit_lr")
    batch_size = fit.get("fit_batch_size")
    if batch_size is not None:
        check_positive_int(batch_size, "fit_batch_size")
    stack_for(model)                                   # refusals before the copy
    converted = _copy.deepcopy(model)
    stack = stack_for(converted)
    chosen = sorted(check_layers(range(stack.num_layers) if layers is None else layers, "layers", stack.num_layers))
    if heads is not None and _check_heads(heads, stack.num_heads) != set(range(stack.num_heads)):
        raise ValueError(f"a trainable map ({estimator}) replaces every head of a layer (one map per key/value head, "
                         "shared by its group): pass heads=None, or choose the layers")
    kv_heads = getattr(stack, "num_kv_heads", stack.num_heads)
    param = next(converted.parameters())
    sa.enable(converted)
    _probe(converted, stack)
    if stack.decodes:
        _cache.install(converted)
    for layer in chosen:
        fmap = make_map(estimator, num_heads=kv_heads, head_dim=stack.head_dim, num_features=num_features,
                        rng=head_seed(rng, layer, 0), dtype=param.dtype, device=param.device, **options)
        sa.set_attention(stack.attention_module(layer), sa.TrainableAttention(fmap, **attention_options))
    if calibration is not None:
        _transfer(converted, stack, chosen, calibration, loss=loss, steps=steps, lr=lr, batch_size=batch_size,
                  rng=rng)
    return converted


def _transfer(model, stack, chosen, calibration, *, loss, steps, lr, batch_size, rng) -> None:
    """Attention transfer of each chosen layer's map, in order, on the calibration batch's queries, keys and values
    as the model computes them with the maps below already fitted (the teacher: the layer's softmax attention)."""
    from ..trainable import fit_to_softmax

    if not isinstance(calibration, Mapping) or "input_ids" not in calibration and "inputs_embeds" not in calibration:
        raise TypeError("calibration must be a mapping of model inputs (input_ids, attention_mask, ...)")
    inputs = dict(calibration)
    if stack.decodes:
        inputs.setdefault("use_cache", False)
    attentions = [sa.get_attention(stack.attention_module(layer)) for layer in chosen]

    def fit(position: int, call):
        attention = attentions[position]
        if call.key_padding_mask is not None and bool(call.key_padding_mask.any()):
            raise ValueError("the attention transfer of a trainable map takes an unpadded calibration batch (every "
                             "sequence of the same length, no padding in attention_mask)")
        fmap = attention.feature_map
        groups = call.query.shape[1] // fmap.num_heads
        # the call's keys and values are repeated to the query heads; the map's heads are one per group
        key, value = call.key[:, ::groups], call.value[:, ::groups]
        with torch.enable_grad():
            attention.fit_record = fit_to_softmax(fmap, call.query, key, value, key_map=attention.key_map,
                                                  loss=loss, steps=steps, lr=lr, batch_size=batch_size,
                                                  rng=head_seed(rng, chosen[position], 0), causal=call.causal,
                                                  scale=call.scaling, window=attention.window)
        return attention

    # one forward pass (no gradient through the model): each layer's map fitted when the pass reaches it, on the
    # queries, keys and values the layers below (their maps fitted) produce
    with torch.no_grad():
        sa.fit_in_one_pass([stack.attention_module(layer) for layer in chosen], fit, lambda: model(**inputs))
