"""Any causal decoder whose attention goes through transformers' attention interface: where its layers and their
attention modules are, its sizes, and what in it cannot be converted exactly.

transformers (≥ 4.48, 5.x) routes the attention of most decoders through one interface: each layer's attention
module projects its queries, keys and values, applies whatever the family puts on them (rotary embeddings, partial
rotary dimensions, q/k normalisation as in Qwen3 and OLMo-2, a learned absolute position added to the embeddings
as in GPT-2, nothing at all), updates the cache, and calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with ``query (B, H, n, d)`` and ``key``/``value`` ``(B, H_kv, n_k, d)`` (grouped-query heads before their
repetition) and its ``scaling``. A model class that does so declares it
(``PreTrainedModel._supports_attention_backend``, which transformers reads before it lets a model take a registered
attention function). Everything a family does
before that call is the model's own and stays so; what a substituted head computes from the call is
:mod:`~kernapprox.surgery.attention`'s. So one adapter, :class:`DecoderStack`, serves every such family, found from
the model itself:

* the decoder layers: the one ``torch.nn.ModuleList`` of ``config.num_hidden_layers`` modules in the base model
  (``model.layers`` of Llama, Qwen2/3, Mistral, Phi-3, OLMo-2, Gemma; ``h`` of GPT-2; ``layers`` of GPT-NeoX;
  ``decoder.layers`` of OPT);
* each layer's attention module: its child named in :data:`ATTENTION_NAMES` (``self_attn``, ``attn``,
  ``attention``, ``self_attention``);
* the sizes from the configuration: query heads, key/value heads (``num_key_value_heads``; all of them without
  one), ``head_dim`` (declared, else ``hidden_size / heads``).

:func:`~kernapprox.surgery.conversion.convert` then checks all of this on the model itself with one probe pass
(:func:`~kernapprox.surgery.attention.probe`): every layer's attention module must call the interface, with the
sizes above and nothing a substituted head cannot honour.

What cannot be converted exactly is refused before anything is built (:data:`REFUSALS`, read off the configuration
and the model class; ``ValueError`` naming the reason):

* attention that does not go through the interface (the class does not declare it: BLOOM, MPT, Falcon, …);
* ALiBi (Press et al. 2022, *Train Short, Test Long*): a per-head linear bias ``−m_h (i − j)`` added to the logits,
  which no feature map ``φ(q)ᵀφ(k)`` of the query and key alone reproduces;
* attention-logit soft-capping (Gemma 2: ``c · tanh(s / c)`` of the logits ``s``), not ``exp(qᵀk · scaling)``;
* sliding-window or chunked layers (any ``layer_types`` entry other than ``"full_attention"``, or a configured
  ``sliding_window`` that the family passes to every layer, as Mistral and Phi-3 do): a band mask, which a state
  of all earlier tokens does not keep;
* bidirectional attention in a decoder (``use_bidirectional_attention``) and cross-attention
  (``add_cross_attention``, encoder–decoder models): not a causal self-attention a state can carry.

Families tested (``tests/surgery/test_families.py``, tiny random models from their configurations): Llama, Qwen2,
Qwen3, Mistral (no sliding window), Phi-3, OLMo-2, GPT-2, GPT-NeoX, Gemma, OPT, Granite; refused: Gemma 2 (soft-capping,
sliding windows), Mistral with a sliding window, BLOOM (ALiBi).
"""

from __future__ import annotations

import torch

__all__ = ["DecoderStack", "ATTENTION_NAMES", "REFUSALS", "check_transformers_model", "refusal"]

# the attribute under which a decoder layer keeps its self-attention module, in the families transformers ships
ATTENTION_NAMES: tuple[str, ...] = ("self_attn", "attn", "attention", "self_attention")


def _attn_config(config, name):
    inner = getattr(config, "attn_config", None)                   # MPT keeps its attention options apart
    return inner.get(name) if isinstance(inner, dict) else getattr(inner, name, None)


def _sliding(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(kind != "full_attention" for kind in layer_types)
    return (getattr(config, "sliding_window", None) is not None
            or getattr(config, "attention_chunk_size", None) is not None)


# (reason, test of the configuration): what a converted model could not compute exactly
REFUSALS: tuple[tuple[str, object], ...] = (
    ("ALiBi position biases (a per-head linear bias on the logits, which no feature map of the query and key alone "
     "reproduces)",
     lambda c: c.model_type == "bloom" or bool(getattr(c, "alibi", False)) or bool(_attn_config(c, "alibi"))),
    ("attention-logit soft-capping (attn_logit_softcapping: c·tanh(s/c) of the logits, not exp of them)",
     lambda c: getattr(c, "attn_logit_softcapping", None) is not None),
    ("sliding-window or chunked attention layers (a band mask; a state of every earlier token cannot drop the old "
     "ones)", _sliding),
    ("bidirectional attention in a decoder (use_bidirectional_attention)",
     lambda c: bool(getattr(c, "use_bidirectional_attention", False))),
    ("cross-attention (an encoder-decoder model, or add_cross_attention)",
     lambda c: bool(getattr(c, "is_encoder_decoder", False)) or bool(getattr(c, "add_cross_attention", False))),
)


def check_transformers_model(model, name: str = "model"):
    """``model`` itself when it is a transformers ``PreTrainedModel``, else ``TypeError`` naming ``name``."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{name} must be a transformers model (a PreTrainedModel, e.g. from "
                        f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    return model


def refusal(model) -> str | None:
    """Why ``model`` (a transformers model) cannot be converted exactly as a decoder, or ``None``: the first of
    :data:`REFUSALS` its configuration meets, or attention that does not go through transformers' attention
    interface (the model class does not declare ``_supports_attention_backend``)."""
    config = model.config
    for reason, test in REFUSALS:
        if test(config):
            return reason
    if not getattr(type(model), "_supports_attention_backend", False):
        return ("its attention does not go through transformers' attention interface (the model class does not "
                "declare _supports_attention_backend)")
    return None


class DecoderStack:
    """Access to the attention modules of a causal decoder whose attention goes through transformers' attention
    interface (see the module docstring): a ``…ForCausalLM`` or its bare base model.

    Attributes
    ----------
    model : the base model (``model.base_model``: the decoder without its head)
    layers : torch.nn.ModuleList
        Its decoder layers.
    decoder : the module that runs them (the base model, or its ``decoder`` as in OPT), whose forward a converted
        model's cache hook wraps (:func:`~kernapprox.surgery.cache.install`)
    num_layers, num_heads, num_kv_heads, head_dim : int
    decodes : bool
        True (declared): a causal decoder, whose converted copies decode with a
        :class:`~kernapprox.surgery.cache.KernelCache`.

    Raises ``TypeError`` for an object that is not a transformers model, ``ValueError`` naming the reason for a
    model that cannot be converted exactly (:func:`refusal`) or whose layers it cannot find.
    """

    decodes = True

    def __init__(self, model):
        check_transformers_model(model)
        config = model.config
        why = refusal(model)
        if why is not None:
            raise ValueError(f"cannot convert {type(model).__name__} (model_type {config.model_type!r}) exactly: "
                             f"{why}")
        base = model.base_model
        count = getattr(config, "num_hidden_layers", None)
        found = [(parent, module) for parent in base.modules() for module in parent.children()
                 if isinstance(module, torch.nn.ModuleList) and len(module) == count]
        if len(found) != 1:
            raise ValueError(f"cannot find the {count} decoder layers of {type(model).__name__} (model_type "
                             f"{config.model_type!r}): no single ModuleList of config.num_hidden_layers modules in "
                             "its base model")
        parent, layers = found[0]
        name = next((n for n in ATTENTION_NAMES if isinstance(getattr(layers[0], n, None), torch.nn.Module)), None)
        if name is None or any(not isinstance(getattr(layer, name, None), torch.nn.Module) for layer in layers):
            raise ValueError(f"the decoder layers of {type(model).__name__} keep no attention module under "
                             f"{' / '.join(ATTENTION_NAMES)}")
        from transformers import PreTrainedModel

        self.model = base
        # the module whose forward runs the layers: where a converted model's cache is created (surgery.cache)
        self.decoder = parent if isinstance(parent, PreTrainedModel) else base
        self.config = config
        self.layers = layers
        self.attention_name = name
        self.num_layers = len(layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not share {self.num_kv_heads} key/value heads evenly")

    def attention_module(self, layer: int) -> torch.nn.Module:
        """The attention module of decoder layer ``layer`` (the one that calls the attention interface)."""
        return getattr(self.layers[layer], self.attention_name)

    def attention_modules(self) -> list[torch.nn.Module]:
        return [self.attention_module(layer) for layer in range(self.num_layers)]
