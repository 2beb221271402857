"""The Llama family: where a ``LlamaForCausalLM`` or a bare ``LlamaModel`` keeps its attention modules.

:class:`LlamaStack` is :class:`~kernapprox.surgery.decoder.DecoderStack`, the adapter of every decoder whose
attention goes through transformers' attention interface, under the family's name (kept for the code that names
it): the decoder layers' ``self_attn`` modules, which apply the model's rotary embeddings to their queries and keys,
update the cache and then call the interface with ``query (B, H, n, d)`` and ``key``/``value`` ``(B, H_kv, n_k, d)``
(grouped-query heads before their repetition). The substituted attention (:mod:`~kernapprox.surgery.attention`)
therefore sees the positions and the grouping the model itself computes; a decoder cache of fixed-size states
(:mod:`~kernapprox.surgery.cache`) takes the place of the KV cache of its substituted layers.
"""

from __future__ import annotations

from .decoder import DecoderStack

__all__ = ["LlamaStack"]


class LlamaStack(DecoderStack):
    """Access to the attention modules of a Llama-family decoder (``LlamaForCausalLM`` or ``LlamaModel``): a
    :class:`~kernapprox.surgery.decoder.DecoderStack` (same attributes, same refusals)."""
