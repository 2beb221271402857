"""Trainable maps inside converted models (``ka.convert(model, "hedgehog_trainable" | "t2r_trainable")``): the maps
are parameters of the converted model (``model.parameters()``, a strict ``state_dict`` round trip), gradients reach
them, a training run changes them and lowers its loss, attention transfer on a calibration batch initialises them,
and the converted decoder decodes with the maps' fixed-size state to its full pass (float64 tight, float32 to
rounding, left-padded batches, bf16 autocast)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers import assert_decode_equals_full_pass, decode_steps

import kernapprox as ka
from kernapprox.rules import NormalizedState
from kernapprox.surgery import KernelCache, StateLayer, TrainableAttention, fit_records, get_attention

VOCAB = 50
CALIBRATION = {"input_ids": torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(99))}
# (estimator, options): Hedgehog at the identity (feature_dim = d = 8), Hedgehog drawn at feature_dim 4, T2R
MAPS = [("hedgehog_trainable", {}), ("hedgehog_trainable", {"num_features": 8}), ("t2r_trainable", {})]


def llama(impl="eager", seed=0, init=0.02, causal_lm=True):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=impl, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      initializer_range=init)
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if causal_lm else transformers.LlamaModel
    return cls(config).eval()


def ids(batch=2, n=12, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def map_parameters(model) -> dict:
    return {name: p for name, p in model.named_parameters() if ".kernapprox_attention." in name}




def left_padded(batch=3, n=10, seed=7):
    """Sequence ``b`` left-padded by ``2b`` tokens, with its attention mask."""
    tokens = ids(batch, n, seed)
    mask = torch.ones(batch, n, dtype=torch.long)
    for b in range(batch):
        mask[b, :2 * b] = 0
        tokens[b, :2 * b] = 0
    return tokens, mask


# ------------------------------------------------------------------------------------------------ the parameters
def test_each_chosen_layer_holds_one_map_per_key_value_head_as_its_parameters():
    model = llama()
    converted = ka.convert(model, "hedgehog_trainable", layers=[1])
    assert get_attention(converted.model.layers[0].self_attn) is None
    attention = get_attention(converted.model.layers[1].self_attn)
    assert isinstance(attention, TrainableAttention)
    fmap = attention.feature_map
    assert isinstance(fmap, ka.HedgehogMap) and fmap.num_heads == 2 and fmap.feature_dim == fmap.head_dim == 8
    torch.testing.assert_close(fmap.weight, torch.eye(8).expand(2, 8, 8), rtol=0, atol=0)   # identity init
    assert set(map_parameters(converted)) == {"model.layers.1.self_attn.kernapprox_attention.feature_map.weight",
                                              "model.layers.1.self_attn.kernapprox_attention.feature_map.bias"}
    params = {id(p) for p in converted.parameters()}
    assert id(fmap.weight) in params and id(fmap.bias) in params
    assert not map_parameters(model)                                            # the original is untouched
    t2r = get_attention(ka.convert(model, "t2r_trainable", num_features=6, rng=3).model.layers[0].self_attn)
    assert isinstance(t2r.feature_map, ka.T2RMap) and t2r.feature_map.num_features == 6
    assert t2r.feature_map.eps == 1e-6 and t2r.feature_map.init == "random"


def test_the_state_dict_round_trips_strictly():
    model = llama()
    converted = ka.convert(model, "hedgehog_trainable", num_features=8, rng=0)
    with torch.no_grad():
        for p in map_parameters(converted).values():                          # trained maps, not their init
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    state = converted.state_dict()
    assert set(state) == set(model.state_dict()) | set(map_parameters(converted))
    other = ka.convert(llama(seed=5), "hedgehog_trainable", num_features=8, rng=1)   # other weights and draws
    other.load_state_dict(copy.deepcopy(state), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids()).logits, converted(input_ids=ids()).logits, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        llama().load_state_dict(state, strict=True)


def test_the_maps_follow_the_model_to_another_dtype():
    converted = ka.convert(llama(), "hedgehog_trainable").double()
    fmap = get_attention(converted.model.layers[0].self_attn).feature_map
    assert fmap.weight.dtype == torch.float64
    ka.surgery.disable(converted)
    assert not map_parameters(converted)                                       # disable takes the maps away


# ------------------------------------------------------------------------------------------------ training
def test_gradients_reach_every_map():
    converted = ka.convert(llama(), "hedgehog_trainable", num_features=8, rng=0).train()
    tokens = ids()
    logits = converted(input_ids=tokens, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    params = map_parameters(converted)
    assert len(params) == 4                                                    # W and b of both layers
    for name, p in params.items():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert float(p.grad.abs().max()) > 0, name


def _train(converted, loss_of, steps=30, lr=0.01):
    """``steps`` Adam steps on the parameters that require grad; (first loss, final loss, maps' change norm)."""
    converted.train()
    maps = map_parameters(converted)
    before = {name: p.detach().clone() for name, p in maps.items()}
    optimizer = torch.optim.Adam([p for p in converted.parameters() if p.requires_grad], lr=lr)
    first = None
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(converted)
        loss.backward()
        optimizer.step()
        first = float(loss.detach()) if first is None else first
    with torch.no_grad():
        final = float(loss_of(converted))
    change = sum(float((p.detach() - before[name]).pow(2).sum()) for name, p in maps.items()) ** 0.5
    return first, final, change


def test_a_training_run_of_the_converted_model_changes_the_maps_and_lowers_its_loss():
    """End to end: 30 Adam steps of next-token loss on one fixed batch, every parameter (maps included) trained by
    the model's optimiser (measured: 3.92 to 0.02, the maps move by 1.65 in norm)."""
    tokens = ids(4, 16, seed=3)

    def next_token(model):
        logits = model(input_ids=tokens, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    first, final, change = _train(ka.convert(llama(), "hedgehog_trainable"), next_token)
    assert final < 0.5 * first
    assert change > 0.1


def test_distilling_the_maps_alone_into_the_original_model_lowers_the_divergence():
    """Only the maps train (everything else frozen): the KL divergence of the converted model's next-token
    distribution from the original's on a fixed batch. A Llama with peaked attention (weights at std 0.2) so that
    the maps matter (measured: 6.87 to 0.91 in 30 steps at lr 0.05)."""
    model = llama(init=0.2)
    tokens = ids(4, 16, seed=3)
    with torch.no_grad():
        teacher = torch.log_softmax(model(input_ids=tokens).logits, -1)
    converted = ka.convert(model, "hedgehog_trainable")
    for name, p in converted.named_parameters():
        p.requires_grad_(".kernapprox_attention." in name)

    def divergence(student):
        log_p = torch.log_softmax(student(input_ids=tokens, use_cache=False).logits, -1)
        return torch.nn.functional.kl_div(log_p, teacher, log_target=True, reduction="batchmean")

    first, final, change = _train(converted, divergence, lr=0.05)
    assert final < 0.3 * first
    assert change > 1.0
    torch.testing.assert_close(converted.model.layers[0].self_attn.q_proj.weight,
                               model.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ attention transfer
@pytest.mark.parametrize("loss", ["weights", "outputs"])
def test_a_calibration_batch_initialises_the_maps_by_attention_transfer(loss):
    model = llama(init=0.2)
    converted = ka.convert(model, "hedgehog_trainable", calibration=CALIBRATION, fit_loss=loss, fit_steps=15,
                           fit_lr=0.05)
    records = fit_records(converted)
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record.loss == loss and record.steps == 15 and record.calibration_tokens == 4 * 16
        assert record.final_loss < record.initial_loss
    fitted = map_parameters(converted)
    plain = map_parameters(ka.convert(model, "hedgehog_trainable"))
    assert all(float((fitted[name] - plain[name]).detach().abs().max()) > 1e-3 for name in fitted)
    assert not fit_records(ka.convert(model, "hedgehog_trainable"))


@pytest.mark.parametrize("loss", ["weights", "outputs"])
def test_a_window_hybrid_conversion_fits_its_maps_inside_the_hybrid(loss):
    """LoLCATs' form: the last w keys by the model's softmax, the keys before them by the map, fitted inside it."""
    model = llama(init=0.2)
    tokens = ids(n=16)
    with torch.no_grad():
        want = model(input_ids=tokens, use_cache=False).logits
        # every key in the window: the converted model is the model (its softmax at the module's scaling)
        whole = ka.convert(model, "hedgehog_trainable", window=16)(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-5)
    converted = ka.convert(model, "hedgehog_trainable", window=4, calibration=CALIBRATION, fit_loss=loss,
                           fit_steps=15, fit_lr=0.05)
    assert all(get_attention(layer.self_attn).window == 4 for layer in converted.model.layers)
    for record in fit_records(converted).values():
        assert record.loss == loss and record.final_loss < record.initial_loss
    with torch.no_grad():
        hybrid = converted(input_ids=tokens, use_cache=False).logits
    # causal: the first w positions see only keys of their window in every layer, so they are the model's own
    torch.testing.assert_close(hybrid[:, :4], want[:, :4], rtol=1e-4, atol=1e-5)
    assert float((hybrid[:, 4:] - want[:, 4:]).abs().max()) > 1e-2
    # a cache's first call is the whole sequence (a plain forward); continuing it would need a state it does not keep
    with torch.no_grad():
        prefill = converted(input_ids=tokens[:, :8], use_cache=True)
        torch.testing.assert_close(prefill.logits, hybrid[:, :8], rtol=1e-5, atol=1e-6)
        with pytest.raises(NotImplementedError, match="keeps no decoding state"):
            converted(input_ids=tokens[:, 8:9], past_key_values=prefill.past_key_values, use_cache=True)


def test_what_a_trainable_conversion_refuses():
    model = llama()
    with pytest.raises(ValueError, match="replaces every head"):
        ka.convert(model, "hedgehog_trainable", heads=[0])
    with pytest.raises(ValueError, match="r = 2 · feature_dim"):
        ka.convert(model, "hedgehog_trainable", num_features=7)
    with pytest.raises(TypeError, match="unknown options windows"):
        ka.convert(model, "hedgehog_trainable", windows=3)
    with pytest.raises(ValueError, match="calibration="):
        ka.convert(model, "hedgehog_trainable", fit_steps=5)
    with pytest.raises(ValueError, match="fit_loss"):
        ka.convert(model, "hedgehog_trainable", calibration=CALIBRATION, fit_loss="kl")
    padded = {"input_ids": CALIBRATION["input_ids"], "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    padded["attention_mask"][0, :3] = 0
    with pytest.raises(ValueError, match="unpadded calibration batch"):
        ka.convert(model, "hedgehog_trainable", calibration=padded, fit_steps=2)
    with pytest.raises(ValueError, match="init='identity' needs feature_dim == head_dim"):
        ka.convert(model, "hedgehog_trainable", num_features=8, init="identity")


# ------------------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("name,options", MAPS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_prefill_and_decode_give_the_full_pass_in_float64(name, options, impl):
    converted = ka.convert(llama(impl, init=0.2), name, layers=None, rng=0, **options).double()
    tokens = ids()
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=5)
    assert isinstance(cache, KernelCache) and all(isinstance(layer, StateLayer) for layer in cache.layers)
    for layer in cache.layers:
        state = layer.map_state
        assert isinstance(state, NormalizedState) and state.w.dtype == torch.float64
        fmap = get_attention(converted.model.layers[0].self_attn).feature_map
        assert tuple(state.w.shape) == (2, 2, fmap.num_features, 8)               # per key/value head
    assert float((got - full).abs().max()) < 1e-10


def test_decoding_in_float32_is_the_full_pass_to_rounding_and_the_state_keeps_its_size():
    converted = ka.convert(llama(init=0.2), "hedgehog_trainable")
    tokens = ids(n=20)
    with torch.no_grad():
        full = converted(input_ids=tokens, use_cache=False).logits
        got, cache = decode_steps(converted, tokens, prefill=4)
        short = converted(input_ids=tokens[:, :4], use_cache=True).cache
    assert float((got - full).abs().max()) < 2e-5                               # measured: 2.4e-6
    # 2 layers · 2 sequences · 2 key heads · r (d_v + 1) float32 numbers, whatever the context
    assert cache.state_bytes() == short.state_bytes() == 2 * 2 * 2 * 16 * 9 * 4


@pytest.mark.parametrize("name,options", MAPS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_left_padded_batch_decodes_to_the_full_pass(name, options, impl):
    converted = ka.convert(llama(impl, init=0.2), name, rng=0, **options).double()
    tokens, mask = left_padded()
    assert_decode_equals_full_pass(converted, tokens, mask, prefill=6, tolerance=1e-10)


def test_left_padded_real_tokens_are_those_of_each_prompt_alone_and_generate_agrees():
    converted = ka.convert(llama(init=0.2), "hedgehog_trainable", num_features=8, rng=0).double()
    tokens, mask = left_padded()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    kw = {"max_new_tokens": 5, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        batch = converted(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).logits
        generated = converted.generate(input_ids=tokens[:, :6], attention_mask=mask[:, :6], **kw)
        for b in range(tokens.shape[0]):
            alone = converted(input_ids=tokens[b:b + 1, 2 * b:], use_cache=False).logits[0]
            assert float((batch[b, 2 * b:] - alone).abs().max()) < 1e-10
            assert generated[b, 2 * b:].tolist() == converted.generate(input_ids=tokens[b:b + 1, 2 * b:6],
                                                                       **kw)[0].tolist()


def test_bf16_autocast_prefill_keeps_float32_states_and_decodes():
    converted = ka.convert(llama(init=0.2), "hedgehog_trainable")
    tokens = ids()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = converted(input_ids=tokens[:, :8], use_cache=True)
        step = converted(input_ids=tokens[:, 8:9], cache=out.cache, use_cache=True)
    assert all(t.dtype == torch.float32 for layer in out.cache.layers for t in layer.map_state)
    assert bool(torch.isfinite(step.logits).all())
    with torch.no_grad():
        full = converted(input_ids=tokens[:, :9], use_cache=False).logits[:, -1]
    assert float((step.logits[:, -1].float() - full).abs().max()) < 0.1          # bf16 activations


def test_beam_search_reorders_the_map_states():
    converted = ka.convert(llama(init=0.2), "hedgehog_trainable", num_features=8, rng=0)
    with torch.no_grad():
        out = converted.generate(input_ids=ids(1, 6), max_new_tokens=4, num_beams=3, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    assert out.shape == (1, 10)


# ------------------------------------------------------------------------------------------------ BERT
def test_a_bert_encoder_takes_a_trainable_map_with_key_padding():
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=20, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    converted = ka.convert(model, "hedgehog_trainable", layers=[1]).double()
    tokens = torch.tensor([[1, 5, 7, 2, 0, 0], [1, 4, 9, 3, 8, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        batch = converted(input_ids=tokens, attention_mask=mask).last_hidden_state
        alone = converted(input_ids=tokens[:1, :4]).last_hidden_state
    assert float((batch[0, :4] - alone[0]).abs().max()) < 1e-10
    assert len(map_parameters(converted)) == 2


def test_compile_of_a_trainable_conversion_equals_eager_and_trains():
    """``aot_eager`` (dynamo and fake tensors, no code generation), one layer with a map and one kept, forward and
    backward: the compiled graph reads the map's parameters, so its gradients are eager's."""
    torch._dynamo.reset()
    converted = ka.convert(llama(init=0.2), "hedgehog_trainable", num_features=8, layers=[1], rng=0)
    compiled = torch.compile(converted, backend="aot_eager")
    tokens = ids()
    grads = []
    for model in (converted, compiled):
        converted.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens, use_cache=False).logits
        logits.square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in map_parameters(converted).items()})
        if model is converted:
            eager = logits.detach()
        else:
            torch.testing.assert_close(logits.detach(), eager, rtol=0, atol=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ the layer
from kernapprox.nn import KernelAttention, MapState, RotaryEmbedding  # noqa: E402


def layer(estimator="hedgehog_trainable", mode="chunked", **kw):
    kw.setdefault("num_kv_heads", 2)
    return KernelAttention(32, 4, estimator, mode=mode, causal=True, rng=0, chunk_size=4, **kw)


def inputs(batch=2, n=11, seed=0, dtype=torch.float32):
    return torch.randn(batch, n, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_a_layer_holds_a_trainable_map_as_its_parameters():
    att = layer()
    assert att.estimator is None and isinstance(att.feature_map, ka.HedgehogMap)
    assert att.feature_map.num_heads == 2 and att.feature_map.feature_dim == 8            # identity at d = 8
    names = {name for name, _ in att.named_parameters()}
    assert {"feature_map.weight", "feature_map.bias"} <= names
    given = ka.T2RMap(4, 8, 6, rng=1, eps=1e-6)
    assert layer(given).feature_map is given                                             # one map per query head
    with pytest.raises(ValueError, match="head_dim = 6 is not the layer's qk_dim = 8"):
        layer(ka.HedgehogMap(2, 6, 6))
    with pytest.raises(ValueError, match="scale applies to estimators"):
        layer(scale=0.5)
    with pytest.raises(ValueError, match="fit\\(\\) applies to estimators"):
        layer().fit(inputs())
    with pytest.raises(ValueError, match="redraw\\(\\) applies to estimators"):
        layer().redraw()


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_the_layer_trains_its_map_in_every_mode(mode):
    torch.manual_seed(0)
    att = layer("hedgehog_trainable", mode=mode, num_features=8)
    x, target = inputs(), inputs(seed=1)
    before = att.feature_map.weight.detach().clone()
    optimizer = torch.optim.Adam(att.parameters(), lr=0.01)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = (att(x) - target).pow(2).mean()
        loss.backward()
        assert float(att.feature_map.weight.grad.abs().max()) > 0
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.95 * losses[0]
    assert float((att.feature_map.weight.detach() - before).abs().max()) > 1e-3


@pytest.mark.parametrize("estimator", ["hedgehog_trainable", "t2r_trainable"])
@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_the_layers_step_decoding_is_its_full_forward(estimator, mode):
    att = layer(estimator, mode=mode, pos_hook=RotaryEmbedding(8)).double()
    x = inputs(dtype=torch.float64)
    with torch.no_grad():
        full = att(x)
        head, state = att(x[:, :6], return_state=True)
        assert isinstance(state, MapState) and state.state.w.shape[:2] == (2, 2)    # per key/value head
        steps = [att.step(x[:, t], state, position=t) for t in range(6, 11)]
    got = torch.cat([head, torch.stack(steps, 1)], 1)
    assert float((got - full).abs().max()) < 1e-12


def test_the_layers_state_dict_round_trips_and_bf16_autocast_decodes():
    att = layer(num_features=8)
    with torch.no_grad():
        att.feature_map.weight.add_(0.1)
    other = layer(num_features=8)
    other.load_state_dict(att.state_dict(), strict=True)
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(other(x), att(x), rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            head, state = att(x[:, :6], return_state=True)
            step = att.step(x[:, 6], state)
        full = att(x[:, :7])[:, -1]
    assert state.state.w.dtype == torch.float32 and head.dtype == torch.bfloat16
    assert float((step.float() - full).abs().max()) < 0.05
    with pytest.raises(RuntimeError, match="estimator mismatch"):
        layer(num_features=16).load_state_dict(att.state_dict())


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_the_layers_left_padded_rows_are_each_prompt_alone(mode):
    att = layer(mode=mode, num_features=8, pos_hook=RotaryEmbedding(8)).double()
    x = inputs(3, 9, dtype=torch.float64)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    for b in range(3):
        pad[b, :2 * b] = True
    positions = ((~pad).cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        batch = att(x, key_padding_mask=pad, query_padding_mask=pad, positions=positions)
        for b in range(3):
            alone = att(x[b:b + 1, 2 * b:])
            assert float((batch[b, 2 * b:] - alone[0]).abs().max()) < 1e-12


# ------------------------------------------------------------------------------------------------ one-pass fitting
def _fit_layer_by_layer(model, name, **kw):
    """The oracle of the one-pass fit: each layer's maps fitted on :func:`capture` of a pass up to that layer, with
    the layers below already fitted (a pass per layer, as conversion did before it fitted in one pass)."""
    from kernapprox.surgery import attention as sa
    from kernapprox.surgery import conversion

    calls = []
    real_pass = sa.fit_in_one_pass

    def layer_by_layer(modules, fit, run):
        for position, module in enumerate(modules):
            call = sa.capture(module, run)
            calls.append(call)
            sa.set_attention(module, fit(position, call))

    conversion.sa.fit_in_one_pass = layer_by_layer
    try:
        return ka.convert(model, name, **kw), calls
    finally:
        conversion.sa.fit_in_one_pass = real_pass


@pytest.mark.parametrize("name, kw", [
    ("hedgehog_trainable", {"fit_steps": 6, "fit_lr": 0.05}),
    ("nystrom_uniform", {"num_features": 8, "share_heads": "group"}),
    ("nystrom_kmeans", {"num_features": 8}),
])
def test_one_forward_pass_fits_every_layer_as_a_pass_per_layer_does(name, kw):
    """convert fits each layer's maps when one calibration pass reaches it (surgery.attention.fit_in_one_pass):
    bit for bit the maps of a pass per layer (capture of each layer with the layers below fitted), for a trainable
    map's attention transfer and for data-dependent estimators; the converted models' logits are equal."""
    model = llama(init=0.2)
    one = ka.convert(model, name, calibration=CALIBRATION, rng=3, **kw)
    oracle, calls = _fit_layer_by_layer(model, name, calibration=CALIBRATION, rng=3, **kw)
    assert len(calls) == model.config.num_hidden_layers
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(one(input_ids=x).logits, oracle(input_ids=x).logits, rtol=0, atol=0)
    if name == "hedgehog_trainable":
        a, b = map_parameters(one), map_parameters(oracle)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert {k: (r.initial_loss, r.final_loss) for k, r in fit_records(one).items()} == \
            {k: (r.initial_loss, r.final_loss) for k, r in fit_records(oracle).items()}


def test_a_pass_that_misses_a_layer_names_it_and_restores_the_others():
    from kernapprox.surgery import attention as sa

    model = ka.convert(llama(), "positive", num_features=8, rng=0)
    modules = [layer.self_attn for layer in model.model.layers]
    before = [get_attention(m) for m in modules]
    with pytest.raises(ValueError, match=r"did not reach the attention of modules \[1\]"):
        sa.fit_in_one_pass(modules, lambda i, call: before[i], lambda: model.model.layers[0](
            torch.zeros(1, 3, 32), position_embeddings=model.model.rotary_emb(torch.zeros(1, 3, 32),
                                                                              torch.arange(3)[None])))
    assert [get_attention(m) for m in modules] == before
