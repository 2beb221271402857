"""Model surgery: the attention of chosen layers and heads of a given model computed by kernapprox estimators,
everything else (projections, positions, masks, the rest of the network) the model's own.

:mod:`~kernapprox.surgery.attention`
    The attention function registered with transformers' attention interface;
    :class:`~kernapprox.surgery.attention.SubstitutedAttention` (one entry per query head);
    :class:`~kernapprox.surgery.attention.TrainableAttention` (a layer's trainable map, a submodule);
    :func:`~kernapprox.surgery.attention.enable`, :func:`~kernapprox.surgery.attention.set_attention`;
    :func:`~kernapprox.surgery.attention.capture` (a layer's attention inputs).
:mod:`~kernapprox.surgery.conversion`
    :func:`~kernapprox.surgery.conversion.convert` (``ka.convert``: a copy of a model with an estimator in chosen
    layers and heads, data-dependent maps fitted on a calibration batch);
    :func:`~kernapprox.surgery.conversion.substitute`; :func:`~kernapprox.surgery.conversion.calibrate`; the encoder
    family adapters (``FAMILIES``); :func:`~kernapprox.surgery.conversion.stack_for` (a model's adapter).
:mod:`~kernapprox.surgery.decoder`
    :class:`~kernapprox.surgery.decoder.DecoderStack`: the attention modules of any causal decoder whose attention
    goes through transformers' attention interface (Llama, Qwen2/3, Mistral, Phi-3, OLMo-2, GPT-2, GPT-NeoX, Gemma,
    ...), and :data:`~kernapprox.surgery.decoder.REFUSALS`, what cannot be converted exactly and why.
:mod:`~kernapprox.surgery.bert`
    :class:`~kernapprox.surgery.bert.BertStack`: a BERT-family encoder layer by layer, through its own modules.
:mod:`~kernapprox.surgery.llama`
    :class:`~kernapprox.surgery.llama.LlamaStack`: the decoder adapter under the Llama family's name.
:mod:`~kernapprox.surgery.cache`
    :class:`~kernapprox.surgery.cache.KernelCache`: a converted decoder's cache (fixed-size states for substituted
    layers, keys and values for the others), which ``model(..., use_cache=True)`` and ``generate()`` use.
:mod:`~kernapprox.surgery.finetuning`
    Stage 2 of a linearisation: :func:`~kernapprox.surgery.finetuning.add_lora` (low-rank adapters on the attention
    projections) and :func:`~kernapprox.surgery.finetuning.finetune` (next-token or logit-distillation training at a
    stated token budget).
:mod:`~kernapprox.surgery.placement`
    Placements of exact layers, the prefix-sharing search over them, their attention memory.
:mod:`~kernapprox.surgery.retrieval`
    A query/document corpus from prose and the nearest-neighbour agreement of two encoders.
:mod:`~kernapprox.surgery.maps`
    The fitted-maps cache (per ``(layer, head)`` fitted estimators, no pickles, under the cache root).

MiniLM (all-MiniLM-L6-v2) is one client: :mod:`kernapprox.substitution`.
"""

from .attention import (
    AttentionCall,
    PerSequence,
    SubstitutedAttention,
    TrainableAttention,
    capture,
    disable,
    enable,
    get_attention,
    set_attention,
)
from .bert import BertStack
from .cache import KernelCache, StateLayer
from .conversion import FAMILIES, TRAINABLE_MAPS, calibrate, convert, fit_records, head_seed, stack_for, substitute
from .decoder import REFUSALS, DecoderStack
from .finetuning import FinetuneRecord, LoRALinear, add_lora, finetune, merge_lora
from .llama import LlamaStack

__all__ = ["AttentionCall", "PerSequence", "SubstitutedAttention", "TrainableAttention", "capture", "disable",
           "enable", "get_attention", "set_attention", "BertStack", "DecoderStack", "REFUSALS", "LlamaStack",
           "KernelCache", "StateLayer",
           "FAMILIES", "TRAINABLE_MAPS", "calibrate", "convert", "fit_records", "head_seed", "stack_for",
           "substitute", "FinetuneRecord", "LoRALinear", "add_lora", "finetune", "merge_lora"]
