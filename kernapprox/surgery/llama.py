"""The Llama family: where a ``LlamaForCausalLM`` or a bare ``LlamaModel`` keeps its attention modules.

:class:`LlamaStack` is the family adapter of :func:`~kernapprox.surgery.conversion.convert` (``model_type
"llama"``): the decoder layers' ``self_attn`` modules, which apply the model's rotary embeddings to their queries
and keys, update the cache and then call transformers' attention interface with ``query (B, H, n, d)`` and
``key``/``value`` ``(B, H_kv, n_k, d)`` (grouped-query heads before their repetition). The substituted attention
(:mod:`~kernapprox.surgery.attention`) therefore sees the positions and the grouping the model itself computes; a
decoder cache of fixed-size states (:mod:`~kernapprox.surgery.cache`) takes the place of the KV cache of its
substituted layers.
"""

from __future__ import annotations

import torch

__all__ = ["LlamaStack"]


class LlamaStack:
    """Access to the attention modules of a Llama-family decoder (``LlamaForCausalLM`` or ``LlamaModel``).

    Attributes
    ----------
    model : the decoder (``LlamaModel``: ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)
    num_layers, num_heads, num_kv_heads, head_dim : int
    decodes : bool
        True (declared): the family is a causal decoder whose converted copies decode with a
        :class:`~kernapprox.surgery.cache.KernelCache`.
    """

    decodes = True

    def __init__(self, model):
        base = getattr(model, "model", model)
        layers = getattr(base, "layers", None)
        if layers is None or getattr(base, "embed_tokens", None) is None or getattr(base, "rotary_emb", None) is None:
            raise TypeError(f"model must be a Llama-family decoder (model.layers, embed_tokens, rotary_emb), got "
                            f"{type(model).__name__}")
        config = base.config
        self.model = base
        self.config = config
        self.num_layers = len(layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads

    def attention_module(self, layer: int) -> torch.nn.Module:
        """The attention module of decoder layer ``layer`` (the one that calls the attention interface)."""
        return self.model.layers[layer].self_attn

    def attention_modules(self) -> list[torch.nn.Module]:
        return [self.attention_module(layer) for layer in range(self.num_layers)]
