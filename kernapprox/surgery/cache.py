"""The decoder cache of a converted model: fixed-size states for substituted layers, a KV cache for the others.

A converted causal model (:func:`~kernapprox.surgery.conversion.convert` of a decoder,
:class:`~kernapprox.surgery.decoder.DecoderStack`: Llama, Qwen2/3, Mistral, Phi-3, OLMo-2, GPT-2, GPT-NeoX, Gemma, …)
keeps the
Hugging Face decoding interface: ``model(..., use_cache=True)`` returns its cache as ``outputs.cache`` (the
``past_key_values`` of transformers before 5), which the next call continues (``cache=``), and ``generate()``
decodes with it. :class:`KernelCache` is that cache: a transformers ``DynamicCache`` whose layers are

* :class:`StateLayer` for a substituted layer: per substituted head (or group of heads sharing an estimator), the
  estimator's decoding cache (:func:`kernapprox.attention.decode.decode_cache`: the fixed-size state of a feature
  map, a KV cache for ``exact``), plus a KV cache of the layer's own heads when some are kept; for a layer of a
  trainable map (:class:`~kernapprox.surgery.attention.TrainableAttention`), the map's
  :class:`~kernapprox.rules.NormalizedState` per key head (``map_state``), continued by
  :func:`kernapprox.trainable.feature_attention` (``initial_state``/``return_state``);
* transformers' ``DynamicLayer`` (keys and values) for a layer left as it was.

How the cache reaches a substituted layer's attention: transformers' attention module calls
``cache.update(key, value, layer_idx, kwargs=kwargs)`` after its rotary embeddings and before the attention
interface, with the keyword arguments it then passes to that interface. :meth:`StateLayer.update
<kernapprox.surgery.cache.StateLayer.update>` returns the new keys and values unchanged and adds itself to those
keyword arguments (``kernapprox_cache_layer``), so that
:func:`~kernapprox.surgery.attention.attention_forward` runs each substituted head's cache on the new tokens: new
query ``i`` attends to the state of every earlier token and to the new keys up to itself. A family whose module
calls ``cache.update(key, value, layer_idx)`` without its keyword arguments (GPT-NeoX) gets the layer handed to its
next attention call instead (:func:`~kernapprox.surgery.attention.hand_over`, checked by the layer index).

The cache is created by the model itself: :func:`install` registers a forward pre-hook on the decoder (the base
model, or the module of it that runs the layers, as OPT's ``decoder``: ``DecoderStack.decoder``) that, when the
call uses a cache, gives it a :class:`KernelCache` (no cache passed) or puts state layers (:class:`StateLayer`)
into the empty layers of the ``DynamicCache`` it was given (the one ``generate()`` creates), so prefill and decode
need nothing from the user. Masks keep working:
``get_seq_length`` counts the tokens seen and ``get_mask_sizes`` is the dynamic cache's (``seen + query length``,
offset 0), so ``masking_utils`` builds the mask of the whole context; the substituted layer reads the columns of
the new tokens from it.

Padding (left-padded batches, as batched generation pads): a padding token enters no state, and its own output row
is 0 (its logits are not defined by the model either). Beam search reorders the states (``reorder_cache``);
``crop`` (assisted decoding's rollback) is not supported by a fixed-size state.

>>> import torch, transformers, kernapprox as ka
>>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
>>> model = transformers.LlamaForCausalLM(config).eval()
>>> fast = ka.convert(model, "positive", num_features=16, rng=0)
>>> ids = torch.tensor([[3, 7, 1, 9, 4]])
>>> out = fast(input_ids=ids[:, :4], use_cache=True)
>>> type(out.cache).__name__, out.cache.get_seq_length()
('KernelCache', 4)
>>> step = fast(input_ids=ids[:, 4:], cache=out.cache, use_cache=True)
>>> full = fast(input_ids=ids, use_cache=False)
>>> bool(torch.allclose(step.logits[:, -1], full.logits[:, -1], atol=1e-5))
True
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from ..attention.decode import DecodeCache, GroupedQueryCache, decode_cache
from ..validation import check_float_dtype
from . import attention as sa
from .attention import CACHE_KEYWORD
from .decoder import DecoderStack

__all__ = ["StateLayer", "KernelCache", "install"]
_HOOK = "kernapprox_cache_hook"


class StateLayer(CacheLayerMixin):
    """The cache of one substituted layer: a decoding cache per estimator of its heads, a KV cache of the heads it
    keeps (``keep_kv``).

    Attributes
    ----------
    decoders : dict
        ``{head group: DecodeCache}`` (the group: the tuple of query heads sharing one estimator; a
        :class:`~kernapprox.attention.decode.GroupedQueryCache`, one state per key/value head, when the group is
        whole grouped-query groups of the model), created at the
        first call (the prefill).
    kv : DynamicLayer or None
        The keys and values of the layer's key/value heads, for the query heads that keep the model's own attention.
    map_state : NormalizedState or None
        The state of a trainable map's layer (``w (B, S, r, d_v)``, ``z (B, S, r)``, ``log_scale (B, S)``, ``S`` the
        key map's heads), float32 (float64 for a float64 model) also under autocast; ``None`` before the prefill.
    seen : int
        Tokens seen (padding included).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, *, keep_kv: bool = False, state_dtype: torch.dtype | None = None, index: int | None = None):
        super().__init__()
        self.index = index               # the decoder layer this cache layer belongs to
        self.state_dtype = state_dtype
        self.decoders: dict[tuple[int, ...], DecodeCache | GroupedQueryCache] = {}
        self.kv = DynamicLayer() if keep_kv else None
        self.seen = 0
        self.full = None                 # (keys, values) of every token, for the kept heads of the current call
        self.map_state = None            # a trainable map's NormalizedState (surgery.attention.TrainableAttention)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        """Count the new tokens, keep their keys and values for kept heads, hand this layer to the attention call
        (through ``kwargs``), and return the new keys and values: the substituted heads read their states."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv is not None:
            self.full = self.kv.update(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.batch_size = key_states.shape[0]
        if kwargs is None:      # a module that passes no kwargs to update (GPT-NeoX): its next attention call
            sa.hand_over(self)
        else:
            kwargs[CACHE_KEYWORD] = self
        return key_states, value_states

    def decoder(self, heads: tuple[int, ...], estimator, mode: str | None, *, groups: int = 1):
        """The decoding cache of the head group ``heads`` (created for ``estimator`` at the first call): a
        :class:`~kernapprox.attention.decode.GroupedQueryCache` holding one state per key/value head when
        ``groups > 1`` (``heads`` are whole groups of query heads sharing the estimator), else one state per head."""
        found = self.decoders.get(heads)
        if found is None:
            found = decode_cache(estimator, mode=mode, state_dtype=self.state_dtype)
            if groups > 1:
                found = GroupedQueryCache(found, groups)
            self.decoders[heads] = found
        return found

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(seen + query_length, 0)``: the mask covers the whole context, as a dynamic KV layer's does."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def state_bytes(self) -> int:
        """Bytes the layer stands for: its decoders' ``state_bytes`` plus the kept heads' keys and values, or a
        trainable map's state (``r (d_v + 1)`` numbers per key head and sequence, the estimators' convention)."""
        kept = 0 if self.kv is None or self.kv.keys is None else sum(
            t.numel() * t.element_size() for t in (self.kv.keys, self.kv.values))
        mapped = 0 if self.map_state is None else sum(
            t.numel() * t.element_size() for t in (self.map_state.w, self.map_state.z))
        return sum(d.state_bytes() for d in self.decoders.values()) + kept + mapped

    def offload(self):             # the states are small; they stay on their device
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.decoders = {}
        self.seen = 0
        self.full = None
        self.map_state = None
        if self.kv is not None:
            self.kv.reset()
        self.is_initialized = False

    def _select(self, index: torch.Tensor) -> None:
        for dec in self.decoders.values():
            dec.select(index)
        if self.map_state is not None:
            self.map_state = type(self.map_state)(*(t.index_select(0, index.to(t.device)) for t in self.map_state))
        if self.kv is not None and self.kv.get_seq_length() > 0:
            self.kv.batch_select_indices(index.to(self.kv.keys.device))
        self.batch_size = len(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seen:
            self._select(torch.arange(self.batch_size).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("a fixed-size state cannot remove tokens (crop): assisted decoding and other rollbacks "
                             "are not supported by a converted model's cache")


def _layers_for(stack, state_dtype=None) -> list:
    layers = []
    for index in range(stack.num_layers):
        attention = sa.get_attention(stack.attention_module(index))
        if attention is None:
            layers.append(DynamicLayer())
        elif isinstance(attention, sa.TrainableAttention):     # every head by the map: no kept keys and values
            layers.append(StateLayer(index=index))
        else:
            layers.append(StateLayer(keep_kv=any(entry is None for entry in attention.heads), state_dtype=state_dtype,
                                     index=index))
    return layers


class KernelCache(DynamicCache):
    """The cache of a converted decoder: :class:`StateLayer` for its substituted layers, ``DynamicLayer`` (keys and
    values) for the others, built from the model's current substitutions.

    Parameters
    ----------
    model
        A converted decoder (a ``…ForCausalLM`` or its base model; :class:`~kernapprox.surgery.decoder.DecoderStack`).
    state_dtype : torch.dtype, optional
        The dtype the substituted heads' decoding caches compute and keep their states in
        (:func:`~kernapprox.attention.decode.decode_cache`; default the activations' compute dtype). ``float64``
        for maps whose float32 features underflow on the model's activations (the float32 cache raises, naming
        it); the kept heads' keys and values and the trainable maps' states are not affected.

    A converted model creates it itself when a call uses a cache (:func:`install`); pass one as ``past_key_values``
    (``cache=`` in transformers 5) to keep a handle on it from the start, or to choose ``state_dtype``.
    ``state_bytes()`` is the memory of every layer's cache.
    """

    def __init__(self, model, *, state_dtype: torch.dtype | None = None):
        self.state_dtype = check_float_dtype(state_dtype, "state_dtype", allow_none=True)
        Cache.__init__(self, layers=_layers_for(DecoderStack(model), state_dtype))

    def state_bytes(self) -> int:
        """Bytes of the whole cache: states of the substituted layers, keys and values of the others."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, StateLayer):
                total += layer.state_bytes()
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * \
                    layer.values.element_size()
        return total


def _adopt(cache: Cache, stack) -> None:
    """Put state layers into the substituted layers of a transformers cache that holds no token yet (the
    ``DynamicCache`` that ``generate()`` creates); raise for a cache that cannot hold a substituted layer's state."""
    if isinstance(cache, KernelCache):
        return
    wanted = _layers_for(stack)
    if cache.layer_class_to_replicate is not None:       # a lazily built DynamicCache(): its layers, now
        if cache.layer_class_to_replicate is not DynamicLayer:
            raise TypeError(f"a converted model decodes with a KernelCache or a DynamicCache, got a cache of "
                            f"{cache.layer_class_to_replicate.__name__} layers")
        while len(cache.layers) < len(wanted):
            cache.layers.append(DynamicLayer())
        cache.layer_class_to_replicate = None
    if len(cache.layers) != len(wanted):
        raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(wanted)}")
    for index, layer in enumerate(wanted):
        if not isinstance(layer, StateLayer) or isinstance(cache.layers[index], StateLayer):
            continue
        current = cache.layers[index]
        if type(current) is not DynamicLayer or current.get_seq_length() > 0:
            raise TypeError(f"layer {index} is substituted, so its cache must be a kernapprox StateLayer, but the "
                            f"given cache holds a {type(current).__name__} with {current.get_seq_length()} tokens: "
                            "decode a converted model with the cache it returns (or a KernelCache(model))")
        cache.layers[index] = layer


def _pre_hook(module, args, kwargs):
    sa.hand_over(None)                   # nothing left over from an interrupted call reaches this one
    if len(args) > 3:
        raise TypeError("pass the cache of a converted model by keyword (cache= or past_key_values=)")
    name = "past_key_values" if "past_key_values" in kwargs and kwargs.get("cache") is None else "cache"
    cache = kwargs.get(name)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", False)
    if cache is None:
        if not use_cache:
            return None
        kwargs[name] = KernelCache(module)
        return args, kwargs
    if isinstance(cache, Cache):
        _adopt(cache, DecoderStack(module))
    return None


def install(model) -> None:
    """Make ``model`` (a converted decoder) create and adopt its :class:`KernelCache` (see the module
    docstring): a forward pre-hook on its decoder. Idempotent; copies of the model (``copy.deepcopy``) keep it."""
    base = DecoderStack(model).decoder
    if base.__dict__.get(_HOOK):
        return
    base.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    base.__dict__[_HOOK] = True
