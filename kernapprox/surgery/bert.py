"""The BERT family layer by layer: the model's own embeddings, mask and encoder layers, one call each.

:class:`BertStack` runs a ``BertModel`` (or a model built like it: ``embeddings``, ``encoder.layer``, a
mask; MiniLM, all-MiniLM-L6-v2 included) one layer at a time, calling the model's own modules exactly
as ``BertModel.forward`` calls them, so that a driver can change a layer's attention between two layers, keep the
hidden states of a prefix, or stop after a layer. With no substitution, :meth:`BertStack.run` gives the model's
``last_hidden_state`` bit for bit (test).
"""

from __future__ import annotations

import torch

from . import attention as sa

__all__ = ["BertStack"]


class BertStack:
    """Layer-by-layer access to a BERT-family encoder (``model`` or its ``base_model``).

    Attributes
    ----------
    num_layers, num_heads, head_dim : int
    """

    def __init__(self, model):
        base = getattr(model, "base_model", model)
        encoder = getattr(base, "encoder", None)
        if getattr(base, "embeddings", None) is None or encoder is None or getattr(encoder, "layer", None) is None:
            raise TypeError(f"model must be a BERT-family encoder (embeddings, encoder.layer), got "
                            f"{type(model).__name__}")
        self.model = base
        self.config = base.config
        self.num_layers = len(encoder.layer)
        self.num_heads = base.config.num_attention_heads
        self.head_dim = base.config.hidden_size // self.num_heads

    def attention_module(self, layer: int) -> torch.nn.Module:
        """The self-attention module of ``layer`` (the one that calls the attention interface)."""
        return self.model.encoder.layer[layer].attention.self

    def attention_modules(self) -> list[torch.nn.Module]:
        return [self.attention_module(layer) for layer in range(self.num_layers)]

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """``(hidden, mask)``: the embeddings of ``input_ids`` ``(B, L)`` and the mask every layer receives (built by
        transformers for the model's attention implementation from ``attention_mask``, 1 = token, 0 = padding;
        bidirectional, or causal for a model configured as a decoder, without a cache)."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        hidden = self.model.embeddings(input_ids=input_ids)
        if self.config.is_decoder:
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      cache=None)
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return hidden, mask

    def layer(self, index: int, hidden: torch.Tensor, mask) -> torch.Tensor:
        """Encoder layer ``index`` on ``hidden`` ``(B, L, hidden)``, with the mask of :meth:`embed`."""
        return self.model.encoder.layer[index](hidden, mask)

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer in order: the final hidden states (the model's ``last_hidden_state``)."""
        hidden, mask = self.embed(input_ids, attention_mask)
        for index in range(self.num_layers):
            hidden = self.layer(index, hidden, mask)
        return hidden

    def capture(self, index: int, hidden: torch.Tensor, mask) -> sa.AttentionCall:
        """The attention inputs of layer ``index`` on ``hidden`` (projections only; the layer is not finished)."""
        return sa.capture(self.attention_module(index), lambda: self.layer(index, hidden, mask))
