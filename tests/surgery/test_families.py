"""``ka.convert`` of the decoder families whose attention transformers routes through its attention interface, on
tiny random models built from their configurations (no download, fixed seeds): the exact conversion reproduces the
logits, a feature map decodes token by token through the model's cache equal to its parallel pass, ``generate()``
runs the greedy path, and the cache's bytes are its states'. What cannot be converted exactly is refused, naming
the reason, before anything is built."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import assert_decode_equals_full_pass, decode_steps

import kernapprox as ka
from kernapprox import lm_eval
from kernapprox.surgery import attention as sa
from kernapprox.surgery.cache import KernelCache, StateLayer
from kernapprox.surgery.decoder import DecoderStack

VOCAB = 50
HEAD_DIM = 8
LAYERS = 2
HEADS = 4
# model_type -> its tiny configuration's own options (grouped-query heads where the family has them; Qwen3 and
# OLMo-2 normalise queries and keys, GPT-2 and OPT learn absolute positions, GPT-NeoX rotates part of each head)
FAMILIES = {
    "llama": {"num_key_value_heads": 2},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": HEAD_DIM},
    "mistral": {"num_key_value_heads": 2, "sliding_window": None},
    "phi3": {"num_key_value_heads": 2},
    "olmo2": {"num_key_value_heads": 2},
    "gpt2": {"n_positions": 64},
    "gpt_neox": {"rotary_pct": 0.5},
    "gemma": {"num_key_value_heads": 2, "head_dim": HEAD_DIM},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": HEADS * HEAD_DIM},     # layers under model.decoder
    "granite": {"num_key_value_heads": 2, "attention_multiplier": 0.5},  # scaling 0.5, not d^{-1/2}
}


def tiny(model_type, impl="eager", seed=0, **options):
    """A random ``…ForCausalLM`` of ``model_type``: 2 layers, 4 heads of dimension 8, vocabulary 50."""
    kw = {"vocab_size": VOCAB, "hidden_size": HEADS * HEAD_DIM, "intermediate_size": 64, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2, **FAMILIES.get(model_type, {}), **options}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def ids(batch=2, n=10, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def kv_heads(model):
    return getattr(model.config, "num_key_value_heads", None) or HEADS


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_conversion_reproduces_the_logits(family, impl):
    model = tiny(family, impl)
    converted = ka.convert(model, "exact")
    tokens = ids()
    with torch.no_grad():
        want, got = model(input_ids=tokens).logits, converted(input_ids=tokens).logits
    assert float((got - want).abs().max()) <= 1e-5
    assert converted.config._attn_implementation == "kernapprox_" + impl
    assert model.config._attn_implementation == impl                       # the original is untouched
    stack = ka.surgery.stack_for(converted)
    assert isinstance(stack, DecoderStack) and (stack.num_layers, stack.num_heads, stack.head_dim) == (
        LAYERS, HEADS, HEAD_DIM)
    assert all(sa.get_attention(module) is not None for module in stack.attention_modules())


@pytest.mark.parametrize("name", ["elu1", "positive"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_feature_map_decodes_through_the_cache_equal_to_its_parallel_pass(family, name):
    converted = ka.convert(tiny(family).double(), name, num_features=None if name == "elu1" else 8, rng=0)
    tokens = ids()
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=4)
    assert isinstance(cache, KernelCache) and cache.get_seq_length() == tokens.shape[1]
    assert all(isinstance(layer, StateLayer) for layer in cache.layers)
    assert float((got - full).abs().max()) < 1e-10
    # per layer and sequence, every query head keeps r (d_v + 1) float64 numbers, r = 8 for both maps here
    assert cache.state_bytes() == LAYERS * 2 * HEADS * 8 * (HEAD_DIM + 1) * 8
    assert lm_eval.cache_bytes(cache) == cache.state_bytes()


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gpt_neox"])
def test_grouped_states_left_padding_and_kept_heads_decode_to_the_full_pass(family):
    """One state per key/value head (share_heads="group") on a left-padded batch, and a layer that keeps two heads
    of the model's own attention beside the substituted ones (GPT-NeoX's module passes no keyword arguments to
    cache.update: the layer reaches its state by hand-over)."""
    model = tiny(family).double()
    tokens = ids(3, 10, seed=7)
    mask = torch.ones(3, 10, dtype=torch.long)
    for b in range(3):
        mask[b, :2 * b] = 0
        tokens[b, :2 * b] = 0
    grouped = ka.convert(model, "positive", num_features=8, share_heads="group", rng=0)
    assert_decode_equals_full_pass(grouped, tokens, mask, prefill=6, tolerance=1e-10)
    with torch.no_grad():
        cache = decode_steps(grouped, tokens, prefill=9, attention_mask=mask)[1]
    assert cache.state_bytes() == LAYERS * 3 * kv_heads(model) * 8 * (HEAD_DIM + 1) * 8
    # the model's own float64 attention gives NaN to a left-padded batch (a padded query that sees no key), so the
    # layer that keeps heads is checked on a batch without padding
    partial = ka.convert(model, "positive", num_features=8, layers=[1], heads=[0, 3], rng=0)
    assert_decode_equals_full_pass(partial, ids(3, 10, seed=7), torch.ones(3, 10, dtype=torch.long), prefill=6,
                                   tolerance=1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_follows_the_greedy_path_of_full_passes(family):
    converted = ka.convert(tiny(family), "positive", num_features=8, rng=0)
    tokens = ids(n=5)
    with torch.no_grad():
        generated = converted.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=5,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        seq = tokens
        for _ in range(5):                   # argmax over full passes, without any cache
            nxt = converted(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert generated.tolist() == seq.tolist()


def test_a_trainable_map_decodes_through_a_cache_that_gets_no_keyword_arguments():
    converted = ka.convert(tiny("gpt_neox").double(), "t2r_trainable", rng=0)
    tokens = ids()
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=3)
    assert float((got - full).abs().max()) < 1e-10
    assert all(layer.map_state is not None for layer in cache.layers)


def test_gpt2_layer_scaling_becomes_the_estimators_kernel_scale():
    """GPT-2's scale_attn_by_inverse_layer_idx divides layer l's scaling by l + 1: the estimators take the scaling
    each module passes, so the exact conversion is still the model and a feature map's kernel is the module's."""
    model = tiny("gpt2", scale_attn_by_inverse_layer_idx=True)
    tokens = ids()
    with torch.no_grad():
        exact = ka.convert(model, "exact")(input_ids=tokens).logits
        assert float((exact - model(input_ids=tokens).logits).abs().max()) <= 1e-5
    converted = ka.convert(model, "positive", num_features=8)
    stack = ka.surgery.stack_for(converted)
    for layer in range(LAYERS):
        heads = sa.get_attention(stack.attention_module(layer)).heads
        assert all(h.scale_ == pytest.approx(HEAD_DIM ** -0.5 / (layer + 1), rel=1e-12) for h in heads)


def test_decode_timing_reports_the_states_bytes():
    converted = ka.convert(tiny("qwen2"), "positive", num_features=8, rng=0)
    timing = lm_eval.decode_timing(converted, ids(1, 6), n_decode=3, warmup=1)
    per_state = LAYERS * HEADS * 8 * (HEAD_DIM + 1) * 4             # float32, one sequence: constant in the context
    assert timing["cache_bytes_after_prefill"] == timing["cache_bytes"] == per_state
    assert timing["cache_tokens"] == 6 + 1 + 3
    # a DynamicCache that generate() would create holds state layers after the prefill: counted by their states
    cache = transformers.DynamicCache(config=converted.config)
    with torch.no_grad():
        converted(input_ids=ids(1, 6), cache=cache, use_cache=True)
    assert lm_eval.cache_bytes(cache) == per_state
    exact = ka.convert(tiny("qwen2"), "exact")
    timing = lm_eval.decode_timing(exact, ids(1, 6), n_decode=3, warmup=1)
    # the exact estimator's decoding cache: keys and values of every token (10), per query head
    assert timing["cache_bytes"] == LAYERS * HEADS * 10 * (HEAD_DIM + HEAD_DIM) * 4


@pytest.mark.parametrize(("model_type", "options", "reason"), [
    ("gemma2", {"num_key_value_heads": 2, "head_dim": HEAD_DIM}, "soft-capping"),
    ("gemma2", {"num_key_value_heads": 2, "head_dim": HEAD_DIM, "attn_logit_softcapping": None}, "sliding-window"),
    ("mistral", {"sliding_window": 4}, "sliding-window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "sliding-window"),
    ("bloom", {"n_layer": LAYERS, "n_head": HEADS}, "ALiBi"),
    ("falcon", {"alibi": False}, "does not go through transformers' attention interface"),
])
def test_what_cannot_be_converted_exactly_is_refused_with_its_reason(model_type, options, reason):
    model = tiny(model_type, **options)
    for estimator in ("exact", "positive"):
        with pytest.raises(ValueError, match=reason):
            ka.convert(model, estimator, num_features=8)
    with pytest.raises(ValueError, match=reason):
        ka.convert(model, "t2r_trainable")


def test_attention_that_bypasses_the_interface_is_refused_by_the_probe():
    """A module of a family that declares the interface but computes its attention another way (here layer 1's,
    replaced by its own eager code) is found by the conversion's probe pass, before anything is substituted."""
    model = tiny("llama")
    module = model.model.layers[1].self_attn

    def own_attention(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return module.o_proj(module.q_proj(hidden_states)), None

    module.forward = own_attention
    with pytest.raises(ValueError, match=r"attention modules \[1\].*not called through transformers' attention"):
        ka.convert(model, "exact")


def test_an_estimator_that_cannot_be_causal_is_refused_before_calibration(monkeypatch):
    assert not ka.capabilities("lara").causal

    def calibrate(*args, **kwargs):
        raise AssertionError("calibration ran before the refusal")

    monkeypatch.setattr(ka.surgery.conversion, "calibrate", calibrate)
    with pytest.raises(ValueError, match="estimator 'lara' cannot be causal"):
        ka.convert(tiny("qwen2"), "lara", num_features=8, calibration={"input_ids": ids()})


def test_an_object_that_is_not_a_transformers_model_is_refused():
    with pytest.raises(TypeError, match="model must be a transformers model.*got Linear"):
        ka.convert(torch.nn.Linear(2, 2), "elu1")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        ka.convert(torch.nn.Linear(2, 2), "t2r_trainable")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        ka.surgery.stack_for(object())
    with pytest.raises(ValueError, match="unknown estimator 'no_such_map'"):
        ka.convert(tiny("gpt2"), "no_such_map")
