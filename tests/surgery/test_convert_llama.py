"""``ka.convert`` of the Llama family, on small random configurations built by transformers (no download): the
exact conversion is the original model, and a converted model decodes through the Hugging Face interface
(``use_cache``/``cache``, ``generate()``) with fixed-size states that give the full pass's logits."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers import assert_decode_equals_full_pass, decode_steps

import kernapprox as ka
from kernapprox.attention.decode import GroupedQueryCache
from kernapprox.surgery import attention as sa
from kernapprox.surgery.cache import KernelCache, StateLayer

VOCAB = 50
CALIBRATION = {"input_ids": torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(99))}
OPTIONS = {"window_linear": {"window": 3}, "scatterbrain": {"window": 3}}


def llama(impl="eager", seed=0, causal_lm=True):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=impl, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if causal_lm else transformers.LlamaModel
    return cls(config).eval()


def ids(batch=2, n=12, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def convert(model, name, **kw):
    caps = ka.capabilities(name, **OPTIONS.get(name, {}))
    if not caps.fixed_dimension:
        kw.setdefault("num_features", 16)
    if caps.data_dependent:
        kw.setdefault("calibration", CALIBRATION)
    return ka.convert(model, name, rng=0, **OPTIONS.get(name, {}), **kw)




@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_exact_conversion_is_the_original_model(impl):
    tokens = ids()
    for causal_lm in (True, False):
        model = llama(impl, causal_lm=causal_lm)
        converted = ka.convert(model, "exact")
        with torch.no_grad():
            want, got = model(input_ids=tokens), converted(input_ids=tokens)
        key = "logits" if causal_lm else "last_hidden_state"
        assert float((got[key] - want[key]).abs().max()) <= 1e-5
        assert model.config._attn_implementation == impl                  # the original is untouched
        assert converted.config._attn_implementation == "kernapprox_" + impl


def test_the_conversion_is_of_the_chosen_layers_and_heads_only():
    model = llama()
    converted = convert(model, "positive", layers=[1], heads=[0, 3])
    stack = ka.surgery.stack_for(converted)
    assert sa.get_attention(stack.attention_module(0)) is None
    heads = sa.get_attention(stack.attention_module(1)).heads
    assert [h is None for h in heads] == [False, True, True, False]
    assert heads[0] is not heads[3]                                        # one draw per (layer, head)
    with torch.no_grad():
        assert float((converted(input_ids=ids()).logits - model(input_ids=ids()).logits).abs().max()) > 1e-4


CAUSAL = [name for name in ka.available_estimators()
          if ka.capabilities(name, **OPTIONS.get(name, {})).causal
          and not ka.capabilities(name, **OPTIONS.get(name, {})).query_dependent]


@pytest.mark.parametrize("name", CAUSAL)
def test_prefill_and_decode_give_the_full_pass(name):
    converted = convert(llama().double(), name)
    tokens = ids(n=10)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=4)
    assert isinstance(cache, KernelCache) and cache.get_seq_length() == tokens.shape[1]
    assert float((got - full).abs().max()) < 1e-10


def test_query_dependent_estimators_convert_but_do_not_decode():
    converted = convert(llama(), "eva")
    with torch.no_grad():
        converted(input_ids=ids(), use_cache=False)
        with pytest.raises(ValueError, match="EfficientAttentionCV has no decoding cache"):
            converted(input_ids=ids(), use_cache=True)


def test_partial_layers_and_heads_decode_with_a_kv_cache_beside_the_states():
    converted = convert(llama().double(), "positive_orthogonal", layers=[1], heads=[1, 2])
    tokens = ids(n=10)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=3)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer", "StateLayer"]
    assert cache.layers[1].kv.get_seq_length() == 10                        # for the two heads it keeps
    assert float((got - full).abs().max()) < 1e-10


def test_the_state_does_not_grow_with_the_context():
    converted = convert(llama(), "positive", num_features=8)
    exact = ka.convert(llama(), "exact")
    sizes = {}
    with torch.no_grad():
        for n in (8, 24):
            sizes[n] = [decode_steps(m, ids(n=n), prefill=n - 1)[1].state_bytes() for m in (converted, exact)]
    # per layer, 2 sequences x 4 heads x r (d_v + 1) float32 numbers; exact: n (d + d_v) per sequence and head
    assert sizes[8][0] == sizes[24][0] == 2 * 2 * 4 * 8 * (8 + 1) * 4
    assert sizes[24][1] == 2 * 2 * 4 * 24 * (8 + 8) * 4
    # a hybrid: the last w = 3 keys and values plus the linear state, whatever the context
    hybrid = convert(llama(), "window_linear", num_features=8)
    with torch.no_grad():
        held = [decode_steps(hybrid, ids(n=n), prefill=n - 1)[1].state_bytes() for n in (8, 24)]
    assert held[0] == held[1] == 2 * 2 * 4 * (3 * (8 + 8) + 8 * (8 + 1)) * 4


def test_a_kernel_cache_with_float64_states_decodes_a_float32_model():
    """KernelCache(model, state_dtype=float64), passed at the prefill: the substituted heads keep float64 states
    (twice the bytes) and decoding gives the float32 model's full pass to float32 rounding."""
    converted = convert(llama(), "positive", num_features=8)
    tokens = ids(n=10)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        cache = KernelCache(converted, state_dtype=torch.float64)
        out = converted(input_ids=tokens[:, :6], use_cache=True, cache=cache)
        assert out.cache is cache
        steps = [converted(input_ids=tokens[:, t:t + 1], use_cache=True, cache=cache).logits for t in range(6, 10)]
    assert all(t.dtype == torch.float64 for layer in cache.layers for dec in layer.decoders.values()
               for t in dec.state)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 6:], rtol=0, atol=1e-5)
    float32 = decode_steps(converted, tokens, prefill=6)[1]
    assert cache.state_bytes() == 2 * float32.state_bytes()
    with pytest.raises(TypeError, match="state_dtype"):
        KernelCache(converted, state_dtype="float64")


def test_generate_decodes_with_the_state_cache_greedily():
    tokens = ids(n=6)
    for name in ("positive", "exact"):
        converted = convert(llama(), name, layers=[0] if name == "positive" else None)
        with torch.no_grad():
            generated = converted.generate(input_ids=tokens, max_new_tokens=6, do_sample=False, eos_token_id=None)
            seq = tokens
            for _ in range(6):                         # a manual argmax loop over full passes, without any cache
                nxt = converted(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], 1)
        assert generated.tolist() == seq.tolist()


def test_beam_search_of_the_exact_conversion_is_the_original_models():
    model = llama()
    converted = ka.convert(model, "exact")
    tokens = ids(n=5)
    kw = {"max_new_tokens": 5, "num_beams": 3, "do_sample": False, "eos_token_id": None}
    with torch.no_grad():
        assert converted.generate(input_ids=tokens, **kw).tolist() == model.generate(input_ids=tokens, **kw).tolist()


def test_a_given_dynamic_cache_is_adopted_and_a_used_one_refused():
    converted = convert(llama(), "positive")
    tokens = ids()
    with torch.no_grad():
        cache = transformers.DynamicCache(config=converted.config)
        out = converted(input_ids=tokens, cache=cache, use_cache=True)
        assert out.cache is cache and all(isinstance(layer, StateLayer) for layer in cache.layers)
        used = transformers.DynamicCache()
        llama()(input_ids=tokens, cache=used, use_cache=True)                # keys and values of a plain model
        with pytest.raises(TypeError, match="layer 0 is substituted"):
            converted(input_ids=tokens[:, :1], cache=used, use_cache=True)


def test_state_dict_round_trips_strictly():
    model = llama()
    converted = convert(model, "positive_orthogonal")
    state = converted.state_dict()
    assert state.keys() == model.state_dict().keys()                        # the maps are no parameters
    other = convert(llama(seed=5), "positive_orthogonal")                   # other weights, the same seed
    other.load_state_dict(copy.deepcopy(state), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids()).logits, converted(input_ids=ids()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_autocast_prefill_keeps_float32_states_and_decodes(dtype):
    converted = convert(llama(), "positive")
    tokens = ids()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = converted(input_ids=tokens[:, :8], use_cache=True)
        step = converted(input_ids=tokens[:, 8:9], cache=out.cache, use_cache=True)
    states = [d.state for layer in out.cache.layers for d in layer.decoders.values()]
    assert states and all(t.dtype == torch.float32 for state in states for t in state)
    assert bool(torch.isfinite(step.logits).all())
    with torch.no_grad():
        full = converted(input_ids=tokens[:, :9], use_cache=False).logits[:, -1]
    assert float((step.logits[:, -1].float() - full).abs().max()) < 0.1         # bf16 activations


def test_fitted_maps_need_a_calibration_batch():
    with pytest.raises(ValueError, match="data-dependent: pass calibration="):
        ka.convert(llama(), "hedgehog", num_features=16)
    converted = convert(llama(), "hedgehog")
    with torch.no_grad():
        assert bool(torch.isfinite(converted(input_ids=ids()).logits).all())


def test_compile_of_a_converted_forward_equals_eager():
    """``aot_eager`` (dynamo and the operators' fake versions, no code generation): seconds on a CPU; the
    inductor backend gives the same logits but spends minutes compiling C++ on a CPU. One layer substituted and
    one kept, called twice: the compiled frames must tell the two layers apart (a substitution read from the
    module's ``__dict__`` was not guarded per module, so the kept layer ran the substituted one's code)."""
    torch._dynamo.reset()
    converted = convert(llama(), "positive_orthogonal", layers=[1])
    compiled = torch.compile(converted, backend="aot_eager")
    with torch.no_grad():
        for seed in (1, 2):
            tokens = ids(seed=seed)
            eager = converted(input_ids=tokens, use_cache=False).logits
            torch.testing.assert_close(compiled(input_ids=tokens, use_cache=False).logits, eager, rtol=0, atol=1e-6)
    torch._dynamo.reset()


def left_padded(batch=3, n=10, seed=7):
    """Token ids with sequence ``b`` left-padded by ``2b`` tokens, their attention mask and the positions
    ``generate()`` gives them (the count of real tokens before each, as transformers computes it)."""
    tokens = ids(batch, n, seed)
    mask = torch.ones(batch, n, dtype=torch.long)
    for b in range(batch):
        mask[b, :2 * b] = 0
        tokens[b, :2 * b] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return tokens, mask, positions


@pytest.mark.parametrize("name", ["positive", "exact", "hedgehog", "taylor2", "trig_orthogonal", "window_linear",
                                  "scatterbrain"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_left_padded_batch_decodes_to_the_full_pass(name, impl):
    converted = convert(llama(impl).double(), name)
    tokens, mask, _ = left_padded()
    assert_decode_equals_full_pass(converted, tokens, mask, prefill=6, tolerance=1e-10)


def test_left_padded_real_tokens_are_those_of_each_prompt_alone():
    converted = convert(llama().double(), "positive_orthogonal")
    tokens, mask, positions = left_padded()
    with torch.no_grad():
        batch = converted(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).logits
        for b in range(tokens.shape[0]):
            alone = converted(input_ids=tokens[b:b + 1, 2 * b:], use_cache=False).logits[0]
            assert float((batch[b, 2 * b:] - alone).abs().max()) < 1e-10


def test_generate_of_a_left_padded_batch_equals_each_prompt_alone():
    converted = convert(llama(), "positive_orthogonal", layers=[1])
    tokens, mask, _ = left_padded(n=6)
    kw = {"max_new_tokens": 5, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        batch = converted.generate(input_ids=tokens, attention_mask=mask, **kw)
        for b in range(tokens.shape[0]):
            alone = converted.generate(input_ids=tokens[b:b + 1, 2 * b:], **kw)
            assert batch[b, 2 * b:].tolist() == alone[0].tolist()


def test_the_convert_guide_runs():
    """The code of docs/guide/convert.md, block after block, as a reader runs it."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "convert.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 5
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "convert.md", "exec"), scope)
    assert isinstance(scope["cache"], KernelCache) and scope["generated"].shape == (2, 16)


def test_the_model_trains_through_the_substituted_attention_and_the_original_is_untouched():
    model = llama()
    converted = convert(model, "positive_orthogonal", layers=[0])
    assert not model.model._forward_pre_hooks                               # the hook is the copy's
    converted.train()
    tokens = ids()
    logits = converted(input_ids=tokens, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    grad = converted.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().max()) > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None


def test_shared_heads_draw_one_map_per_layer_and_decode_it_in_one_batch():
    """share_heads=True: every substituted head of a layer holds the same estimator (one draw, from head_seed(rng,
    l, 0)), the decoder keeps one head group per layer, and decoding equals the full pass; data-dependent maps and
    trainable maps refuse it."""
    converted = convert(llama().double(), "positive_orthogonal", share_heads=True)
    for layer in range(2):
        heads = sa.get_attention(converted.model.layers[layer].self_attn).heads
        assert all(h is heads[0] for h in heads)
    independent = convert(llama().double(), "positive_orthogonal")
    assert sa.get_attention(independent.model.layers[0].self_attn).heads[1] is not \
        sa.get_attention(independent.model.layers[0].self_attn).heads[0]
    tokens = ids(n=10)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=4)
    assert [len(layer.decoders) for layer in cache.layers] == [1, 1]
    assert float((got - full).abs().max()) < 1e-10
    with pytest.raises(ValueError, match="share_heads.*data-dependent"):
        ka.convert(llama(), "nystrom_uniform", num_features=8, share_heads=True, calibration=CALIBRATION)
    with pytest.raises(ValueError, match="share_heads"):
        ka.convert(llama(), "hedgehog_trainable", share_heads=True)
    with pytest.raises(TypeError, match="share_heads"):
        ka.convert(llama(), "positive", num_features=8, share_heads=1)
    with pytest.raises(ValueError, match="share_heads"):
        ka.convert(llama(), "positive", num_features=8, share_heads="layer")


GROUPED = ["positive_orthogonal", "nystrom_uniform", "window_linear", "exact", "taylor2"]


@pytest.mark.parametrize("name", GROUPED)
def test_group_shared_maps_decode_with_one_state_per_key_value_head(name):
    """share_heads="group": the query heads of a key/value group hold one estimator (the draw of the group's first
    head, as with one draw per head; a data-dependent map fitted once on the group's queries); decoding keeps one
    state per key/value head (GroupedQueryCache), half the bytes of the per-query-head states here (G = 2), and
    gives the full pass's logits, left padding included."""
    grouped = convert(llama().double(), name, share_heads="group")
    per_head = convert(llama().double(), name)
    for layer in range(2):
        heads = sa.get_attention(grouped.model.layers[layer].self_attn).heads
        assert heads[0] is heads[1] and heads[2] is heads[3] and heads[0] is not heads[2]
    tokens = ids(n=10)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0                                                   # left padding of the second sequence
    assert_decode_equals_full_pass(grouped, tokens, mask, prefill=4, tolerance=1e-9)
    with torch.no_grad():
        full = grouped(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(grouped, tokens, prefill=4)
        _, cache_per_head = decode_steps(per_head, tokens, prefill=4)
    assert float((got - full).abs().max()) < 1e-9
    assert all(isinstance(d, GroupedQueryCache) for layer in cache.layers for d in layer.decoders.values())
    assert 2 * cache.state_bytes() == cache_per_head.state_bytes()
    assert 2 * sum(d.held_bytes() for layer in cache.layers for d in layer.decoders.values()) <= sum(
        d.held_bytes() for layer in cache_per_head.layers for d in layer.decoders.values())
    caps = ka.capabilities(name, **OPTIONS.get(name, {}))
    if caps.kind == "features" and not caps.data_dependent:
        # the group's draw is its first head's draw of share_heads=False
        first = sa.get_attention(per_head.model.layers[0].self_attn).heads[2]
        shared = sa.get_attention(grouped.model.layers[0].self_attn).heads[3]
        x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        assert torch.equal(first.features(x, "key"), shared.features(x, "key"))


def test_a_group_shared_map_on_some_heads_of_a_group_keeps_states_per_query_head():
    """Heads that do not make whole key/value groups keep one state per query head (and still decode exactly)."""
    converted = convert(llama().double(), "positive", share_heads="group", heads=[0, 2, 3])
    tokens = ids(n=9)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=3)
    assert float((got - full).abs().max()) < 1e-9
    kinds = {heads: type(d).__name__ for heads, d in cache.layers[0].decoders.items()}
    assert kinds == {(0,): "FeatureStateCache", (2, 3): "GroupedQueryCache"}


def test_a_non_finite_query_in_a_decoding_step_raises_naming_it():
    """A decoding step checks each converted layer's query, key and value once (not per key/value group): a NaN
    query of one step raises ValueError naming it, before that layer's states absorb the token."""
    model = convert(llama(), "positive", num_features=8, share_heads="group")
    x = ids(batch=1, n=6)
    out = model(input_ids=x[:, :5], use_cache=True)
    attention = model.model.layers[1].self_attn
    handle = attention.q_proj.register_forward_hook(lambda module, args, y: torch.full_like(y, float("nan")))
    try:
        with pytest.raises(ValueError, match="query contains NaN or Inf"):
            model(input_ids=x[:, 5:], cache=out.cache, use_cache=True)
    finally:
        handle.remove()
