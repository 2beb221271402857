"""The BERT family layer by layer: the model's own embeddings, mask and encoder layers, one call each.

:class:`BertStack` runs a ``BertModel`` (or a model built like it: ``embeddings``, ``encoder.layer``, a
mask; MiniLM, all-MiniLM-L6-v2 included) one layer at a time, calling the model's own modules exactly
as ``BertModel.forward`` calls them, so that a driver can change a layer's attention between two layers, keep the
hidden states of a prefix, or stop after a layer. With no substitution, :meth:`BertStack.run` gives the model's
``last_hidden_state`` bit for bit (test). :func:`tokenize` cuts texts into padded buckets of similar length
(:class:`EncoderInput`), so that a study pays for little padding and every text's real tokens are what they would
be alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch

from ..validation import check_positive_int
from . import attention as sa

__all__ = ["BertStack", "EncoderInput", "tokenize", "from_batch"]


class BertStack:
    """Layer-by-layer access to a BERT-family encoder (``model`` or its ``base_model``).

    Attributes
    ----------
    num_layers, num_heads, head_dim : int
    decodes : bool
        False (declared): an encoder; its converted copies keep no decoder cache of states.
    """

    decodes = False

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


@dataclasses.dataclass(frozen=True)
class EncoderInput:
    """Tokenised texts in padded buckets of similar length.

    ``ids[b]``, ``mask[b]``: ``(B_b, L_b)`` token ids and attention mask (1 = token, 0 = padding) of bucket
    ``b``; ``index[b]``: the positions (in the original text order) of its rows; ``lengths``: tokens per text
    (special tokens included), in the original order.
    """

    ids: tuple[torch.Tensor, ...]
    mask: tuple[torch.Tensor, ...]
    index: tuple[np.ndarray, ...]
    lengths: np.ndarray

    @property
    def num_texts(self) -> int:
        return int(self.lengths.size)


def tokenize(tokenizer, texts: Iterable[str], *, max_length: int = 256, bucket_tokens: int = 4096,
             device=None) -> EncoderInput:
    """Tokenise ``texts`` one by one (``[CLS] … [SEP]``, truncated at ``max_length``), sort them by length and
    group them into padded buckets of at most ``bucket_tokens`` positions (at least one text each).

    ``bucket_tokens=1`` gives one text per bucket: every text at its own length, no padding at all.
    """
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty list of strings")
    check_positive_int(max_length, "max_length")
    check_positive_int(bucket_tokens, "bucket_tokens")
    encoded = [tokenizer(t, truncation=True, max_length=max_length, verbose=False)["input_ids"] for t in texts]
    lengths = np.array([len(e) for e in encoded])
    order = np.argsort(lengths, kind="stable")
    buckets, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > bucket_tokens:
            buckets.append(current)
            current = []
        current.append(int(i))
    buckets.append(current)
    ids, masks = [], []
    for bucket in buckets:
        width = int(lengths[bucket].max())
        block = torch.full((len(bucket), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(bucket), width), dtype=torch.long)
        for row, i in enumerate(bucket):
            block[row, :lengths[i]] = torch.tensor(encoded[i])
            mask[row, :lengths[i]] = 1
        ids.append(block.to(device))
        masks.append(mask.to(device))
    return EncoderInput(tuple(ids), tuple(masks), tuple(np.array(b) for b in buckets), lengths)


def from_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> EncoderInput:
    """One bucket from an already padded batch ``(B, L)`` (e.g. a tokenizer's ``padding=True`` output)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids and attention_mask must be (B, L) of one shape, got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    lengths = attention_mask.sum(-1).cpu().numpy()
    if (lengths == 0).any():
        raise ValueError("attention_mask has a row without tokens")
    return EncoderInput((input_ids,), (attention_mask,), (np.arange(input_ids.shape[0]),), lengths)
