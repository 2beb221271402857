"""The attention of a Hugging Face model's chosen layers and heads, computed by kernapprox estimators.

transformers (≥ 4.48, 5.x) routes every attention module through one interface: the module projects its
queries, keys and values, applies what its family puts on them (rotary embeddings, q/k norms), and calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with ``query`` ``(B, H, n_q, d)`` and ``key``/``value`` ``(B, H_kv, n_k, d)`` before
the grouped-query repetition; it expects ``(output (B, n_q, H, d_v), weights or None)``. The mask was built by
``masking_utils`` for the same implementation name (``ALL_MASK_ATTENTION_FUNCTIONS``).

:func:`enable` registers, for the model's own implementation ``base`` (``"eager"`` or ``"sdpa"``), the name
``kernapprox_<base>`` with :func:`attention_forward` as its function and the mask function of ``base``, and
switches the model to it (``model.set_attn_implementation``). Every attention module then calls
:func:`attention_forward`, which

* calls the model's own ``base`` function, unchanged, for a module without a :class:`SubstitutedAttention`
  (:func:`set_attention`), so an untouched layer computes bit for bit what it computed before;
* otherwise computes each substituted head with its estimator (:func:`kernapprox.linear_attention`, which routes the
  exact kernel to :func:`kernapprox.softmax_attention`) on the module's own ``query``, ``key`` and ``value``, with
  the module's ``scaling``, and the key padding and causal triangle read off ``attention_mask``
  (:func:`key_padding_from_mask`; without a mask, the call's ``is_causal`` if passed, else the module's, for more
  than one query, as transformers' SDPA function reads them); heads without an estimator keep the model's own
  output.

A decoder's cache: the layer of a converted model's :class:`~kernapprox.surgery.cache.KernelCache` reaches this
function through the module's keyword arguments (``kernapprox_cache_layer``, set by
:meth:`~kernapprox.surgery.cache.StateLayer.update`); each substituted head then continues its decoding cache
(:func:`kernapprox.attention.decode.decode_cache`) with the call's new tokens, the mask's last columns giving their
padding. Padded queries that no real key precedes (left padding) get rows of 0 (``query_padding_mask``). The core
runs with autocast disabled: half-precision activations are computed in float32 and the output returned in their
dtype.

What it cannot honour it refuses with ``ValueError``: an attention mask that is not key padding (with or without
the causal triangle), an additive bias other than 0/−∞, a sliding window, a soft cap or attention sinks,
attention dropout in training, a causal call of several queries against more keys from a plain key/value cache
(decode a converted model with its own cache), an estimator whose kernel scale is not the module's. One query
against a key/value cache (decoding) is attention over all of them, which the layer computes.

>>> import torch, transformers, kernapprox as ka
>>> from kernapprox.surgery import attention as sa
>>> config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
...                                  intermediate_size=20, attn_implementation="eager")
>>> model = transformers.BertModel(config).eval()
>>> _ = sa.enable(model)
>>> est = ka.make_estimator("positive", num_features=32, rng=0).fit(torch.zeros(1, 8))
>>> sa.set_attention(model.encoder.layer[1].attention.self, sa.SubstitutedAttention([est, None]))
>>> model(input_ids=torch.tensor([[1, 5, 7, 2]])).last_hidden_state.shape
torch.Size([1, 4, 16])
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..attention import MODES, linear_attention
from ..attention.masks import mask_kwargs
from ..estimators import Estimator
from ..estimators.registry import is_trainable_map
from ..nn.functional import repeat_kv
from ..validation import check_choice, check_positive_int, check_same_kind, check_tensor

if TYPE_CHECKING:
    from ..trainable import TrainableFeatureMap

CACHE_KEYWORD = "kernapprox_cache_layer"   # how a decoder cache layer reaches this function (surgery.cache)

__all__ = ["SubstitutedAttention", "TrainableAttention", "PerSequence", "AttentionCall", "enable", "disable",
           "set_attention", "get_attention", "capture", "probe", "attention_forward", "key_padding_from_mask",
           "implementation_name", "hand_over", "BASES"]

PREFIX = "kernapprox_"
BASES = ("eager", "sdpa")
_ATTRIBUTE = "kernapprox_attention"
# keyword arguments that change what attention computes and that a substituted head cannot honour
_REFUSED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")
# a decoder cache layer handed to the next attention call of its module, for the families whose attention module
# calls cache.update(key, value, layer_idx) without its keyword arguments (GPT-NeoX); one slot per thread
_HANDED = threading.local()


def hand_over(layer) -> None:
    """Hand the decoder cache layer ``layer`` (a :class:`~kernapprox.surgery.cache.StateLayer`, or ``None`` to clear
    the slot) to the next call of :func:`attention_forward` in this thread: how a substituted layer reaches its
    state when its attention module calls ``cache.update(key, value, layer_idx)`` without passing the keyword
    arguments it then gives the attention interface (GPT-NeoX, GPT-J). The update is the module's last step before
    that call, so the next call is the same module's (checked by ``module.layer_idx`` against ``layer.index``)."""
    _HANDED.layer = layer


def _handed(module):
    """The cache layer :func:`hand_over` left for ``module`` (taken, the slot cleared), or ``None``."""
    layer = getattr(_HANDED, "layer", None)
    if layer is None:
        return None
    index = getattr(module, "layer_idx", None)
    if index is not None and getattr(layer, "index", index) != index:
        return None
    _HANDED.layer = None
    return layer


@dataclasses.dataclass(frozen=True)
class PerSequence:
    """A head fitted on each sequence of the call alone: ``make()`` gives a fresh unfitted estimator, fitted on the
    sequence's real queries and keys and applied to them at the sequence's own length (padded rows get 0).

    This fits on the text being scored (a transductive choice a study may make and must say); a model converted for
    use fits its maps once, on a calibration batch.
    """

    make: Callable[[], Estimator]


class SubstitutedAttention:
    """What one attention module computes instead of its own attention: one entry per query head.

    Parameters
    ----------
    heads : sequence, one entry per query head
        A fitted estimator (feature map, an estimator with its own attention, or the exact kernel), a
        :class:`PerSequence` (fitted on each sequence alone), or ``None``: the head keeps the model's own attention.
    mode : str, optional
        The linear-attention mode of feature maps; default ``"chunked"`` where the estimator declares it, else its
        first declared mode.
    observer : callable, optional
        Called after the layer's attention as ``observer(call, output)`` with the :class:`AttentionCall` (key and
        value heads repeated to the query heads) and the output ``(B, H, n_q, d_v)``: how a study measures a layer's
        own error on the activations it sees.
    """

    def __init__(self, heads: Sequence, *, mode: str | None = None, observer: Callable | None = None):
        heads = list(heads)
        if not heads:
            raise ValueError("heads must hold one entry per query head")
        for h, entry in enumerate(heads):
            if entry is not None and not isinstance(entry, Estimator | PerSequence):
                raise TypeError(f"heads[{h}] must be a fitted kernapprox estimator, a PerSequence or None, got "
                                f"{type(entry).__name__}")
        if observer is not None and not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        self.heads = heads
        self.mode = mode
        self.observer = observer

    def __repr__(self) -> str:
        kept = sum(entry is None for entry in self.heads)
        return f"SubstitutedAttention({len(self.heads)} heads, {kept} kept)"


class TrainableAttention(torch.nn.Module):
    r"""A whole layer's attention by a trainable feature map (:mod:`kernapprox.trainable`): a module the attention
    module holds as its submodule ``kernapprox_attention``, so the map's parameters are the model's parameters
    (``model.parameters()``, ``state_dict()``) and its optimiser trains them.

    The layer computes :func:`kernapprox.trainable.feature_attention` of the module's own queries and keys (after
    its projections and rotary positions) and values, grouped-query heads as the model groups them:

    .. math::
        y_{h,i} = \frac{\sum_{j ≤ i} φ_h(q_{h,i})^⊤ φ_g(k_{g,j})\, v_{g,j}}{\sum_{j ≤ i} φ_h(q_{h,i})^⊤ φ_g(k_{g,j})},
        \qquad g = h // G

    (``j ≤ i`` when the call is causal), with key padding from the mask and rows of 0 for left-padded queries. The
    module's ``scaling`` takes no part: the map's ``W_h`` carries its own temperature (Hedgehog, Zhang et al. 2024,
    §4). A decoder's cache keeps the map's fixed-size state (:class:`~kernapprox.rules.NormalizedState`) per key
    head.

    With ``window = w``, LoLCATs' hybrid (Zhang et al. 2025, ICLR, §3.2): the last ``w`` keys of each query by
    softmax at the module's ``scaling``, the keys before them by the map, one normaliser
    (:func:`~kernapprox.trainable.feature_attention` with ``window``). Such a layer runs on whole sequences: it keeps
    no decoding state (a decoder cache's first call is the whole sequence; continuing it raises
    ``NotImplementedError``).

    Parameters
    ----------
    feature_map : TrainableFeatureMap
        ``num_heads`` the layer's key/value heads (one state per key head) or its query heads.
    key_map : TrainableFeatureMap, optional
        A separate map for keys (default: the queries' map, Hedgehog's tied map).
    mode : {"parallel", "recurrent", "chunked"}, default "chunked"
    chunk_size : int, default 64
    window : int, optional
        Exact keys per query beside the map (none: the map alone).

    Attributes
    ----------
    fit_record : FitRecord or None
        The attention-transfer fit (:func:`kernapprox.trainable.fit_to_softmax`) that initialised the map, when
        :func:`~kernapprox.surgery.conversion.convert` was given a calibration batch (a plain attribute, not in the
        ``state_dict``).
    """

    def __init__(self, feature_map: TrainableFeatureMap, *, key_map: TrainableFeatureMap | None = None,
                 mode: str = "chunked", chunk_size: int = 64, window: int | None = None):
        super().__init__()
        for name, fmap in (("feature_map", feature_map), ("key_map", key_map)):
            if fmap is not None and not is_trainable_map(fmap):
                raise TypeError(f"{name} must be a kernapprox.trainable map (HedgehogMap, T2RMap), got "
                                f"{type(fmap).__name__}")
        if feature_map is None:
            raise TypeError("feature_map must be a kernapprox.trainable map (HedgehogMap, T2RMap), got None")
        self.feature_map = feature_map
        self.key_map = key_map
        self.mode = check_choice(mode, "mode", MODES)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.window = None if window is None else check_positive_int(window, "window")
        self.fit_record = None

    def forward(self, query, key, value, *, causal: bool, key_padding_mask=None, query_padding_mask=None,
                initial_state=None, return_state: bool = False, scale: float | None = None):
        """:func:`~kernapprox.trainable.feature_attention` of ``query (B, H, n, d)`` and ``key``/``value``
        ``(B, H_kv, n_k, ·)`` with this layer's maps; ``(B, H, n, d_v)`` (and the state with ``return_state``).
        ``scale``: the module's ``scaling``, the exact part's kernel scale with a window (unused without)."""
        from ..trainable import feature_attention

        hybrid = {} if self.window is None else {"window": self.window, "scale": scale}
        return feature_attention(query, key, value, self.feature_map, key_map=self.key_map, causal=causal,
                                 mode=self.mode, chunk_size=self.chunk_size, key_padding_mask=key_padding_mask,
                                 query_padding_mask=query_padding_mask, initial_state=initial_state,
                                 return_state=return_state, **hybrid)

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return f"mode={self.mode!r}, chunk_size={self.chunk_size}{window}"


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call of an attention module, as the model made it: ``query`` ``(B, H, n_q, d)``; ``key``, ``value``
    ``(B, H, n_k, d)`` (grouped key/value heads repeated to the query heads); ``key_padding_mask`` ``(B, 1, n_k)``
    bool, True = padding (or ``None``); the causal flag and the kernel scale of the call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_padding_mask: torch.Tensor | None
    causal: bool
    scaling: float


class _Captured(Exception):
    """Raised by the attention function of a module under :func:`capture`, to stop the forward pass there."""

    def __init__(self, call: AttentionCall):
        super().__init__("attention inputs captured")
        self.call = call


class _Capture:
    """What :func:`capture` and :func:`fit_in_one_pass` put in a module's place: with no ``on_call`` the attention
    function stops the forward pass at the module (:class:`_Captured`); with one, it hands the call to
    ``on_call``, which returns the module's substitution, and the pass goes on through it."""

    def __init__(self, on_call: Callable[[AttentionCall], object] | None = None):
        self.on_call = on_call


def implementation_name(base: str) -> str:
    """``kernapprox_<base>``: the attention implementation kernapprox registers on top of ``base``."""
    if base not in BASES:
        raise ValueError(f"kernapprox substitutes attention on top of the {' or '.join(BASES)} implementation; the "
                         f"model uses {base!r} (load it with attn_implementation='eager' or 'sdpa')")
    return PREFIX + base


def _register(base: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = implementation_name(base)
    if name not in ALL_ATTENTION_FUNCTIONS:

        def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            return attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     base=base, **kwargs)

        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def enable(model) -> str:
    """Route every attention module of ``model`` (a transformers ``PreTrainedModel`` on the eager or SDPA
    implementation) through :func:`attention_forward`. Modules without a :class:`SubstitutedAttention` compute what
    they computed before. Returns the model's original implementation name (what :func:`disable` restores)."""
    current = model.config._attn_implementation
    base = current.removeprefix(PREFIX) if current and current.startswith(PREFIX) else current
    name = _register(base)
    if current != name:
        model.set_attn_implementation(name)
    return base


def disable(model) -> None:
    """Back to the model's own implementation; substituted modules lose their substitution."""
    current = model.config._attn_implementation
    if not (current and current.startswith(PREFIX)):
        return
    for module in list(model.modules()):
        module.__dict__.pop(_ATTRIBUTE, None)
        module._modules.pop(_ATTRIBUTE, None)
    model.set_attn_implementation(current.removeprefix(PREFIX))


def set_attention(module: torch.nn.Module, attention: SubstitutedAttention | TrainableAttention | None) -> None:
    """Give the attention ``module`` (one that calls transformers' attention interface) its substitution, or take
    it away (``None``). The model must be :func:`enable`-d for the substitution to be called.

    A :class:`SubstitutedAttention` (fitted estimators) is a plain attribute of the module, in no ``state_dict``; a
    :class:`TrainableAttention` is registered as its submodule ``kernapprox_attention``, so its maps are parameters
    of the model."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if attention is not None and not isinstance(attention, SubstitutedAttention | TrainableAttention | _Capture):
        raise TypeError(f"attention must be a SubstitutedAttention, a TrainableAttention or None, got "
                        f"{type(attention).__name__}")
    module.__dict__.pop(_ATTRIBUTE, None)
    module._modules.pop(_ATTRIBUTE, None)
    if isinstance(attention, TrainableAttention):
        module.add_module(_ATTRIBUTE, attention)        # a submodule: its parameters are the model's
    elif attention is not None:
        module.__dict__[_ATTRIBUTE] = attention          # a plain attribute: not a parameter, not in state_dict


def get_attention(module: torch.nn.Module) -> SubstitutedAttention | TrainableAttention | None:
    """The substitution of ``module`` (``None``: the model's own attention)."""
    found = module.__dict__.get(_ATTRIBUTE, module._modules.get(_ATTRIBUTE))
    return found if isinstance(found, SubstitutedAttention | TrainableAttention) else None


def capture(module: torch.nn.Module, run: Callable[[], object]) -> AttentionCall:
    """The inputs ``module`` receives when ``run()`` calls the model: the forward pass is stopped at that module's
    attention (nothing after it is computed), the module's substitution restored, and the call returned. How the
    maps of a layer are fitted on the activations the model as substituted so far produces."""
    previous = module.__dict__.get(_ATTRIBUTE)
    module.__dict__[_ATTRIBUTE] = _Capture()
    try:
        run()
    except _Captured as stop:
        return stop.call
    finally:
        if previous is None:
            module.__dict__.pop(_ATTRIBUTE, None)
        else:
            module.__dict__[_ATTRIBUTE] = previous
    raise ValueError("run() did not reach the module's attention (is the model enabled, and the module one of its "
                     "attention modules?)")


def fit_in_one_pass(modules: Sequence[torch.nn.Module], fit: Callable[[int, AttentionCall], object],
                    run: Callable[[], object]) -> None:
    """Fit the substitution of each module of ``modules`` (in the order the model calls them) in one forward pass
    ``run()``: when the pass reaches module ``i``, ``fit(i, call)`` receives the call's inputs as the model computes
    them with the modules before it already substituted, returns the module's substitution, and the pass goes on
    through it; it stops after the last. The same fits as :func:`capture` of each module in turn (one pass up to
    each module, ``O(L²)`` layers for ``L`` modules), in one pass of ``O(L)`` layers. Raises ``ValueError`` naming
    the modules the pass did not reach (their previous substitutions restored)."""
    modules = list(modules)
    done: set[int] = set()
    previous = [module.__dict__.get(_ATTRIBUTE) for module in modules]

    def on_call(index: int):
        def handler(call: AttentionCall):
            attention = fit(index, call)
            done.add(index)
            if len(done) == len(modules):
                set_attention(modules[index], attention)
                raise _Captured(call)                   # every module fitted: nothing after it is needed
            return attention
        return handler

    for index, module in enumerate(modules):
        module.__dict__[_ATTRIBUTE] = _Capture(on_call(index))
    try:
        run()
    except _Captured:
        pass
    finally:
        for index, module in enumerate(modules):
            if index not in done:
                if previous[index] is None:
                    module.__dict__.pop(_ATTRIBUTE, None)
                else:
                    module.__dict__[_ATTRIBUTE] = previous[index]
    missing = [index for index in range(len(modules)) if index not in done]
    if missing:
        raise ValueError(f"run() did not reach the attention of modules {missing} (is the model enabled, and each "
                         "module one of its attention modules?)")


def probe(modules: Sequence[torch.nn.Module], run: Callable[[], object]) -> list[AttentionCall]:
    """The call each module of ``modules`` makes to transformers' attention interface when ``run()`` calls the
    (enabled) model: one :class:`AttentionCall` per module, in the order given, every module computing its own
    attention unchanged. How a conversion checks, before it substitutes anything, that each layer's attention goes
    through the interface (``ValueError`` naming the modules ``run()`` did not reach that way) and reads the sizes and
    ``scaling`` each module passes. A call passing what a substituted layer cannot honour (a sliding window, a
    soft cap, attention sinks, a mask other than key padding and the causal triangle) raises its ``ValueError``
    here. The modules' previous substitutions are restored."""
    modules = list(modules)
    if not all(isinstance(module, torch.nn.Module) for module in modules):
        raise TypeError("modules must be torch.nn.Module attention modules")
    calls: list[AttentionCall | None] = [None] * len(modules)

    def on_call(index: int):
        def handler(call: AttentionCall):
            calls[index] = call
            return None                                 # the module's own attention (attention_forward)
        return handler

    previous = [module.__dict__.get(_ATTRIBUTE) for module in modules]
    for index, module in enumerate(modules):
        module.__dict__[_ATTRIBUTE] = _Capture(on_call(index))
    try:
        run()
    finally:
        for index, module in enumerate(modules):
            if previous[index] is None:
                module.__dict__.pop(_ATTRIBUTE, None)
            else:
                module.__dict__[_ATTRIBUTE] = previous[index]
    missing = [index for index, call in enumerate(calls) if call is None]
    if missing:
        raise ValueError(f"the attention modules {missing} ({type(modules[missing[0]]).__name__}) were not called "
                         "through transformers' attention interface: their attention cannot be substituted")
    return calls


def _base_function(module, base: str):
    if base == "eager":
        # transformers' eager attention is a function of each model's modeling file, the default the module passes
        # to the interface; it is no entry of the registry
        found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if found is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its modeling module; load "
                             "the model with attn_implementation='sdpa'")
        return found
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def key_padding_from_mask(attention_mask, n_q: int, n_k: int) -> tuple[torch.Tensor | None, bool | None]:
    """``(key_padding, causal)`` of a transformers attention mask: the key padding ``(B, 1, n_k)`` (bool, True =
    padding; ``None`` without padding) and whether the mask holds the causal triangle (``None`` for no mask: the
    call's flag decides).

    ``attention_mask`` is what ``masking_utils`` built: ``None``, a bool ``(B, 1|H, n_q|1, n_k)`` (True = takes
    part; SDPA) or an additive float one (0 = takes part, the dtype's lowest value or −∞ = excluded; eager). As the
    model's own eager and SDPA functions do, a given mask is the whole truth: either key padding alone (every query
    row the same) or key padding and the causal triangle (``n_q = n_k``). Anything else (sliding windows, packed
    sequences, block masks, biases, different masks per head) raises ``ValueError``.
    """
    if attention_mask is None:
        return None, None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be a 4-D tensor (B, 1, n_q, n_k) or None, got "
                         f"{type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}")
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        lowest = torch.finfo(attention_mask.dtype).min
        allowed = attention_mask == 0
        blocked = (attention_mask == lowest) | (attention_mask == -math.inf)
        if not bool((allowed | blocked).all()):
            raise ValueError("attention_mask adds a bias other than 0 and -inf to the logits; a substituted head "
                             "cannot honour it")
    if allowed.shape[-1] != n_k or allowed.shape[-2] not in (1, n_q):
        raise ValueError(f"attention_mask of shape {tuple(allowed.shape)} does not match n_q={n_q}, n_k={n_k}")
    if allowed.shape[1] != 1:
        if not bool((allowed == allowed[:, :1]).all()):
            raise ValueError("attention_mask differs between heads; a substituted layer takes one mask per sequence")
        allowed = allowed[:, :1]
    allowed = allowed[:, 0]                                                     # (B, n_q | 1, n_k)
    keep = allowed[:, -1]                          # the last query row: every key but padding, in either case
    if bool((allowed == keep[:, None, :]).all()):
        causal = False
    elif n_q == n_k and bool((allowed == (keep[:, None, :] & torch.ones(
            n_q, n_k, dtype=torch.bool, device=keep.device).tril())).all()):
        causal = True
    else:
        raise ValueError("attention_mask is neither key padding nor key padding with the causal triangle (a sliding "
                         "window, packed sequences, a prefix or a custom mask); a substituted layer cannot honour it")
    return (None if bool(keep.all()) else ~keep[:, None, :]), causal


def _mode(estimator: Estimator, mode: str | None) -> str:
    modes = estimator.capabilities().modes
    if mode is not None:
        return mode
    return "chunked" if "chunked" in modes else modes[0]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, base: str = "eager",
                      **kwargs):
    """transformers' attention interface, with the module's :class:`SubstitutedAttention` where it has one.

    Returns ``(output (B, n_q, H, d_v), None)`` for a substituted module (no attention weights exist for a
    feature map), else what the model's own ``base`` function returns.
    """
    layer = kwargs.pop(CACHE_KEYWORD, None)          # a StateLayer of the converted model's cache (surgery.cache)
    if layer is None:
        layer = _handed(module)                       # or handed over by a module that passes no kwargs to update
    attention = getattr(module, _ATTRIBUTE, None)     # an attribute read: torch.compile guards it per module
    if attention is None:
        if layer is not None:
            raise ValueError("the cache holds a kernapprox state for a layer whose attention is not substituted")
        return _base_function(module, base)(module, query, key, value, attention_mask, scaling=scaling,
                                            dropout=dropout, **kwargs)
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise ValueError(f"the attention call passes {name}={kwargs[name]!r}, which a substituted layer cannot "
                             "honour")
    if dropout and module.training:
        raise ValueError("attention dropout in training is not supported by a substituted layer (call "
                         "model.eval(), or set the model's attention dropout to 0)")
    n_q, n_k = query.shape[-2], key.shape[-2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    common = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    if not query.dtype == key.dtype == value.dtype:
        # under autocast the rotary embeddings (float32 tables) promote bf16 queries and keys, not the values
        query, key, value = query.to(common), key.to(common), value.to(common)
    full_mask = attention_mask
    if layer is not None and attention_mask is not None and attention_mask.shape[-1] != n_k:
        # the mask covers the whole context; the new keys are its last columns (the state holds the others)
        if attention_mask.shape[-1] != layer.seen:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} keys but the cache has seen "
                             f"{layer.seen} tokens")
        attention_mask = attention_mask[..., -n_k:]
    padding, causal = key_padding_from_mask(attention_mask, n_q, n_k)
    if causal is None:                 # no mask: the call's flag, else the module's, as transformers' SDPA reads it
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal) and n_q > 1
    if layer is not None:
        causal = True                  # a decoder cache: every new query sees the state and the new keys before it
    if causal and n_q != n_k:
        raise ValueError(f"a causal call with {n_q} queries and {n_k} keys (decoding from a key/value cache) is not "
                         "supported by the substituted attention: decode a converted model with its own cache "
                         "(kernapprox.surgery.cache.KernelCache, which model(..., use_cache=True) and generate() "
                         "create)")
    heads = query.shape[1]
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads do not share {key.shape[1]} key/value heads evenly")
    groups = heads // key.shape[1]
    if isinstance(attention, _Capture):
        call = AttentionCall(query, repeat_kv(key, groups), repeat_kv(value, groups), padding, causal, float(scaling))
        if attention.on_call is None:
            raise _Captured(call)
        attention = attention.on_call(call)             # the layer's maps fitted on this call, then used in it
        set_attention(module, attention)
        if attention is None:                           # a probe (probe()): the module's own attention, unchanged
            return _base_function(module, base)(module, query, key, value, full_mask, scaling=scaling,
                                                dropout=dropout, **kwargs)
    if isinstance(attention, TrainableAttention):      # the whole layer, grouped heads as the model groups them
        return _trainable_forward(attention, layer, query, key, value, padding, causal, float(scaling)), None
    own_key, own_value = key, value                    # what the model's own function expects (before repetition)
    kv_key, kv_value = key, value                      # one per key/value head: what a grouped decoding state reads
    if layer is not None and layer.kv is not None:
        own_key, own_value = layer.full                # the kept heads attend over the whole context
    if len(attention.heads) != heads:
        raise ValueError(f"the substitution has {len(attention.heads)} heads, the module {heads}")
    groups_of: dict[int, list[int]] = {}
    for h, entry in enumerate(attention.heads):
        if entry is not None:
            groups_of.setdefault(id(entry), []).append(h)
    grouped = {id(attention.heads[index[0]]): _whole_groups(index, groups) for index in groups_of.values()}
    if layer is not None and attention.observer is None and all(grouped.values()):
        # a decoder whose every estimator reads one state per key/value head: the repeated keys are never read
        call = AttentionCall(query, key, value, padding, causal, float(scaling))
    else:                                             # grouped-query heads: each query head reads its group's keys
        call = AttentionCall(query, repeat_kv(key, groups), repeat_kv(value, groups), padding, causal, float(scaling))
    key, value = call.key, call.value
    query_padding = _keyless_queries(padding) if causal else None

    kept = [h for h, entry in enumerate(attention.heads) if entry is None]
    if kept:                                          # the model's own output for the heads it keeps
        own, _ = _base_function(module, base)(module, query, own_key, own_value, full_mask, scaling=scaling,
                                              dropout=dropout, **kwargs)
        out = own.transpose(1, 2).clone()
    else:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
    validated = False
    if layer is not None and all(grouped.values()):     # decoding: the layer's inputs checked once, not per group
        for name, t in (("query", query), ("key", kv_key), ("value", kv_value)):
            check_tensor(t, name)
        check_same_kind(query=query, key=kv_key, value=kv_value)
        validated = True
    for index in groups_of.values():
        entry = attention.heads[index[0]]
        if layer is not None:
            if isinstance(entry, PerSequence):
                raise ValueError("a head fitted on each sequence (PerSequence) has no decoding state")
            _check_scale(entry, call.scaling)
            kv_heads = grouped[id(entry)]
            extra = mask_kwargs(padding, query_padding_mask=query_padding)
            decoder = layer.decoder(tuple(index), entry, attention.mode, groups=groups if kv_heads else 1)
            if kv_heads:             # one state per key/value head, read by its query heads
                out[:, _heads(index)] = decoder.extend(call.query[:, _heads(index)], kv_key[:, _heads(kv_heads)],
                                                       kv_value[:, _heads(kv_heads)], validated=validated, **extra)
            else:
                out[:, _heads(index)] = decoder.extend(*(t[:, _heads(index)] for t in (call.query, key, value)),
                                                       **extra)
            continue
        select = _heads(index)
        q_sel, k_sel, v_sel = call.query[:, select], key[:, select], value[:, select]
        if isinstance(entry, PerSequence) or (padding is not None and not entry.capabilities().key_padding):
            out[:, index] = _per_sequence(call, index, entry, attention.mode)
            continue
        _check_scale(entry, call.scaling)
        with _core_precision(query):
            out[:, index] = linear_attention(q_sel, k_sel, v_sel, entry, causal=causal,
                                             mode=_mode(entry, attention.mode),
                                             **mask_kwargs(padding, query_padding_mask=query_padding))
    if attention.observer is not None:
        attention.observer(call, out)
    return out.transpose(1, 2).contiguous(), None


def _heads(index: list[int]) -> slice | list[int]:
    """The heads ``index`` as a slice where they are consecutive (a view, not a gather), else the list."""
    if index == list(range(index[0], index[-1] + 1)):
        return slice(index[0], index[-1] + 1)
    return index


def _whole_groups(index: list[int], groups: int) -> list[int] | None:
    """The key/value heads whose every query head is in ``index`` (the heads sharing one estimator), in order, when
    ``index`` is exactly those groups' query heads in order (``groups > 1``); else ``None``: the heads then keep
    one decoding state per query head."""
    if groups == 1 or len(index) % groups:
        return None
    kv = [index[i] // groups for i in range(0, len(index), groups)]
    if index != [g * groups + j for g in kv for j in range(groups)]:
        return None
    return kv


def _trainable_forward(attention: TrainableAttention, layer, query, key, value, padding, causal, scaling):
    """The layer's output ``(B, n_q, H, d_v)`` by its trainable map; with a decoder cache ``layer``, the map's state
    continues from the tokens before (``layer.map_state``) and is kept for the next call."""
    query_padding = _keyless_queries(padding) if causal else None
    extra = mask_kwargs(padding, query_padding_mask=query_padding)
    if attention.window is not None:
        extra["scale"] = scaling
        if layer is not None and layer.seen > query.shape[-2]:
            raise NotImplementedError(f"a trainable map with window = {attention.window} keeps no decoding state: the "
                                      "cache cannot continue the tokens before this call; run the whole sequence in "
                                      "one call")
        layer = None                    # the first call of a cache: the whole sequence, nothing kept to continue
    if layer is None:
        out = attention(query, key, value, causal=causal, **extra)
    else:
        out, layer.map_state = attention(query, key, value, causal=True, initial_state=layer.map_state,
                                         return_state=True, **extra)
    return out.transpose(1, 2).contiguous()


def _keyless_queries(padding):
    """The padded queries of a causal call that no real key precedes (left padding), ``(B, 1, n)`` bool, or
    ``None`` when there are none: the core gives their rows 0 (``query_padding_mask``) where it would otherwise have
    no key for them; padded queries after a real token (right padding) keep the rows the model computes."""
    if padding is None:
        return None
    keyless = padding & (torch.cumsum((~padding).to(torch.int32), -1) == 0)
    return keyless if bool(keyless.any()) else None


def _core_precision(x: torch.Tensor):
    """Autocast off around the core: it computes half-precision inputs in float32 itself (and keeps float32
    states), and returns the inputs' dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def _check_scale(estimator: Estimator, scaling: float) -> None:
    if not math.isclose(estimator.scale_, scaling, rel_tol=1e-12):
        raise ValueError(f"the estimator's kernel scale {estimator.scale_:.6g} is not the module's scaling "
                         f"{scaling:.6g}; construct it with scale={scaling!r}")


def _per_sequence(call: AttentionCall, index: list[int], entry, mode) -> torch.Tensor:
    """Heads ``index`` with ``entry`` applied to each sequence's real tokens alone (fitted on them when ``entry`` is a
    :class:`PerSequence`); padded query rows get 0."""
    q, k, v, padding = call.query, call.key, call.value, call.key_padding_mask
    if q.shape[-2] != k.shape[-2]:
        raise ValueError("a head fitted or run per sequence needs self-attention (as many queries as keys)")
    out = q.new_zeros(q.shape[0], len(index), q.shape[-2], v.shape[-1])
    for row in range(q.shape[0]):
        real = (torch.ones(k.shape[-2], dtype=torch.bool, device=k.device) if padding is None
                else ~padding[row, 0])
        positions = torch.nonzero(real).squeeze(-1)
        for slot, head in enumerate(index):
            qs, ks, vs = (t[row, head, positions] for t in (q, k, v))
            est = entry.make().fit(qs, ks) if isinstance(entry, PerSequence) else entry
            _check_scale(est, call.scaling)
            out[row, slot, positions] = linear_attention(qs, ks, vs, est, causal=call.causal,
                                                         mode=est.capabilities().modes[0] if mode is None else mode)
    return out
