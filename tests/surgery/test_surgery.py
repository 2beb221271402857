"""Model surgery through transformers' attention interface, on small random BERT models (no download): exact
substitution is the model, a substituted layer is what a hand-computed reference says, nothing else changes, and
what cannot be honoured is refused."""

import math

import pytest
import torch

import kernapprox as ka

transformers = pytest.importorskip("transformers")

from kernapprox.surgery import attention as sa  # noqa: E402
from kernapprox.surgery import placement as pl  # noqa: E402
from kernapprox.surgery.bert import BertStack  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 4, 8, 3


def bert(implementation="eager", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=61, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=37, max_position_embeddings=24,
                                     attn_implementation=implementation)
    return transformers.BertModel(config).to(dtype).eval()


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0                                                   # two padded rows of different lengths
    return ids, mask


def fitted(name, num_features=None, rng=0, **options):
    return ka.make_estimator(name, num_features=num_features, rng=rng, **options).fit(torch.zeros(1, HEAD_DIM))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_exact_substitution_reproduces_the_model(implementation):
    model = bert(implementation)
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        stack = BertStack(model)
        assert torch.equal(stack.run(ids, mask), expected)              # the stack is the model's own forward
        assert sa.enable(model) == implementation
        assert model.config._attn_implementation == "kernapprox_" + implementation
        assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected)   # untouched
        exact = fitted("exact")
        for layer in range(LAYERS):
            sa.set_attention(stack.attention_module(layer), sa.SubstitutedAttention([exact] * HEADS))
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert float((got - expected)[real].abs().max()) < 1e-5                   # float32 rounding, padding honoured
    sa.disable(model)
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected)


def _hand_attention(module, hidden, est, padding_keep):
    """Layer attention recomputed by hand: the module's projections, φ(q)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q)ᵀ Σ_j φ(k_j) over
    the real keys of each row (exact-scale features, float64)."""
    b, n, _ = hidden.shape

    def split(t):
        return t.view(b, n, HEADS, HEAD_DIM).transpose(1, 2)

    q, k, v = split(module.query(hidden)), split(module.key(hidden)), split(module.value(hidden))
    out = torch.empty_like(q)
    for row in range(b):
        keep = padding_keep[row]
        for head in range(HEADS):
            pq, pk = est.features(q[row, head], "query"), est.features(k[row, head, keep], "key")
            num = pq @ (pk.T @ v[row, head, keep])
            den = pq @ pk.sum(0)
            out[row, head] = num / den[:, None]
    return out


def test_a_substituted_layer_is_linear_attention_on_the_model_activations():
    model = bert(dtype=torch.float64)
    ids, mask = batch()
    stack = BertStack(model)
    sa.enable(model)
    est = fitted("positive_orthogonal", 16, rng=3)
    module = stack.attention_module(1)
    seen = []
    sa.set_attention(module, sa.SubstitutedAttention([est] * HEADS, observer=lambda call, out: seen.append(out)))
    with torch.no_grad():
        hidden, m = stack.embed(ids, mask)
        hidden = stack.layer(0, hidden, m)
        expected = _hand_attention(module, hidden, est, mask.bool())
        stack.layer(1, hidden, m)
    real = mask.bool()[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(seen[0][real], expected[real], rtol=1e-10, atol=1e-12)
    assert seen[0].shape == (3, HEADS, 11, HEAD_DIM)


def test_only_the_chosen_layers_and_heads_change():
    model = bert()
    ids, mask = batch()
    stack = BertStack(model)
    sa.enable(model)
    est = fitted("positive", 8, rng=1)
    calls = {}
    with torch.no_grad():
        hidden, m = stack.embed(ids, mask)
        exact_states = []
        for layer in range(LAYERS):
            calls[layer] = stack.capture(layer, hidden, m)
            hidden = stack.layer(layer, hidden, m)
            exact_states.append(hidden)
        outputs = []
        sa.set_attention(stack.attention_module(1), sa.SubstitutedAttention(
            [None, est, None, est], observer=lambda call, out: outputs.append(out)))
        hidden, m = stack.embed(ids, mask)
        h0 = stack.layer(0, hidden, m)
        stack.layer(1, h0, m)
    assert torch.equal(h0, exact_states[0])                               # layer 0 untouched, bit for bit
    own = torch.nn.functional.scaled_dot_product_attention  # noqa: F841  (the model is eager; compared below)
    call = calls[1]
    keep = ~call.key_padding_mask
    scores = (call.query @ call.key.transpose(-1, -2)) * call.scaling
    scores = scores.masked_fill(~keep[:, None], torch.finfo(scores.dtype).min)
    eager = torch.softmax(scores, -1) @ call.value                          # the model's eager attention
    out = outputs[0]
    assert torch.equal(out[:, [0, 2]], eager[:, [0, 2]])                     # kept heads: the model's own output
    assert float((out[:, [1, 3]] - eager[:, [1, 3]]).abs().max()) > 1e-3     # substituted heads changed
    approx = ka.linear_attention(call.query[:, [1]], call.key[:, [1]], call.value[:, [1]], est,
                                 key_padding_mask=call.key_padding_mask)
    torch.testing.assert_close(out[:, [1]], approx, rtol=0, atol=0)


def test_key_padding_is_read_off_the_masks_transformers_builds():
    lengths = torch.tensor([5, 3])
    keep = torch.arange(5)[None, :] < lengths[:, None]
    pad = ~keep[:, None, :]
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    padding, causal = sa.key_padding_from_mask(additive, 5, 5)
    assert torch.equal(padding, pad) and causal is False
    boolean = keep[:, None, None, :].expand(2, 1, 5, 5)
    padding, causal = sa.key_padding_from_mask(boolean, 5, 5)
    assert torch.equal(padding, pad) and causal is False
    triangle = boolean & torch.ones(5, 5, dtype=torch.bool).tril()
    padding, causal = sa.key_padding_from_mask(triangle, 5, 5)
    assert torch.equal(padding, pad) and causal is True
    padding, causal = sa.key_padding_from_mask(torch.ones(2, 1, 5, 5, dtype=torch.bool).tril(), 5, 5)
    assert padding is None and causal is True
    assert sa.key_padding_from_mask(None, 5, 5) == (None, None)
    padding, causal = sa.key_padding_from_mask(boolean[..., -1:, :], 1, 5)        # one query against a cache
    assert torch.equal(padding, pad) and causal is False
    window = triangle & torch.ones(5, 5, dtype=torch.bool).triu(-1)              # a sliding window of 2
    with pytest.raises(ValueError, match="sliding window"):
        sa.key_padding_from_mask(window, 5, 5)
    with pytest.raises(ValueError, match="bias"):
        sa.key_padding_from_mask(additive - 0.5, 5, 5)
    with pytest.raises(ValueError, match="between heads"):
        sa.key_padding_from_mask(torch.stack([boolean[:, 0], triangle[:, 0]], 1), 5, 5)


def test_a_causal_model_keeps_its_triangle_and_padding():
    """A BERT configured as a decoder (causal self-attention): exact substitution reproduces it with right padding,
    and a feature map equals causal linear attention on the layer's own activations."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=61, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=2,
                                     num_attention_heads=HEADS, intermediate_size=37, is_decoder=True,
                                     attn_implementation="sdpa")
    model = transformers.BertModel(config).eval()
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        converted = ka.convert(model, "exact")
        got = converted(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        assert float((got - expected)[mask.bool()].abs().max()) < 1e-5
        est = fitted("positive", 16, rng=2)
        seen = []
        module = converted.encoder.layer[0].attention.self
        sa.set_attention(module, sa.SubstitutedAttention([est] * HEADS, observer=lambda c, o: seen.append((c, o))))
        converted(input_ids=ids, attention_mask=mask, use_cache=False)
    call, out = seen[0]
    assert call.causal
    expected = ka.linear_attention(call.query, call.key, call.value, est, causal=True,
                                   key_padding_mask=call.key_padding_mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_what_a_substituted_layer_cannot_honour_is_refused():
    model = bert()
    ids, mask = batch()
    stack = BertStack(model)
    sa.enable(model)
    module = stack.attention_module(0)
    wrong_scale = ka.make_estimator("positive", num_features=8, rng=0, scale=0.5).fit(torch.zeros(1, HEAD_DIM))
    sa.set_attention(module, sa.SubstitutedAttention([wrong_scale] * HEADS))
    with pytest.raises(ValueError, match="scale"):
        model(input_ids=ids, attention_mask=mask)
    sa.set_attention(module, sa.SubstitutedAttention([fitted("positive", 8)] * 2))
    with pytest.raises(ValueError, match="heads"):
        model(input_ids=ids, attention_mask=mask)
    model.train()
    model.config.attention_probs_dropout_prob = 0.1
    module.dropout.p = 0.1
    sa.set_attention(module, sa.SubstitutedAttention([fitted("positive", 8)] * HEADS))
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(TypeError, match="heads\\[0\\]"):
        sa.SubstitutedAttention(["positive"])
    with pytest.raises(ValueError, match="implementation"):
        sa.implementation_name("flash_attention_2")
    with pytest.raises(TypeError, match="BERT-family"):
        BertStack(torch.nn.Linear(2, 2))


def test_heads_fitted_per_sequence_see_their_own_tokens_only():
    """A PerSequence head is fitted on each row's real tokens and runs at the row's own length: padding, and
    the other rows, change nothing (float64)."""
    model = bert(dtype=torch.float64)
    ids, mask = batch()
    stack = BertStack(model)
    sa.enable(model)
    module = stack.attention_module(2)
    make = lambda: ka.make_estimator("nystrom_uniform", num_features=3, rng=4)  # noqa: E731
    sa.set_attention(module, sa.SubstitutedAttention([sa.PerSequence(make)] * HEADS))
    with torch.no_grad():
        together = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for row in range(3):
            n = int(mask[row].sum())
            alone = model(input_ids=ids[row:row + 1, :n]).last_hidden_state
            torch.testing.assert_close(together[row, :n], alone[0], rtol=0, atol=1e-12)


def test_placements_walk_shares_prefixes():
    assert pl.all_placements(3) == [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]
    assert pl.placement_label([2, 0], 3) == "E:0,2" and pl.first_layers(2, 3) == [0, 1]
    steps, seen = [], {}

    def step(layer, hidden, substituted):
        steps.append((layer, substituted))
        return hidden + ("s" if substituted else "e"), (1.0 if substituted else None)

    pl.walk_placements(3, "", step, lambda exact, hidden, errors, states: seen.setdefault(exact, (hidden, errors)),
                       exact_states=["e", "ee", "eee"])
    assert len(seen) == 8 and seen[(0, 2)] == ("ese", {1: 1.0}) and seen[(0, 1, 2)] == ("eee", {})
    assert len(steps) == 2 + 4 + 8 - 3                                    # the all-exact prefixes come for free
    bytes_ = pl.placement_bytes(fitted("positive", 16), [0], [10], num_layers=3, num_heads=2, head_dim=HEAD_DIM)
    assert bytes_.tolist() == [10 * (8 + 8) * 4 * 2 + 2 * 2 * 16 * (8 + 1) * 4]   # KV cache; r (d_v + 1) floats
    assert math.isfinite(float(bytes_[0]))


# ---------------------------------------------------------------------------------------------------- convert
def test_convert_exact_reproduces_the_model_and_leaves_it_untouched():
    model = bert()
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        converted = ka.convert(model, "exact")
        got = converted(input_ids=ids, attention_mask=mask).last_hidden_state
    assert converted is not model and model.config._attn_implementation == "eager"
    real = mask.bool()
    assert float((got - expected)[real].abs().max()) < 1e-5
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected)


def test_convert_substitutes_only_the_chosen_layers_and_heads():
    from kernapprox.surgery import conversion

    model = bert(dtype=torch.float64)
    ids, mask = batch()
    converted = ka.convert(model, "positive_orthogonal", num_features=16, layers=[2], heads=[0, 3], rng=5)
    stack = BertStack(converted)
    assert [sa.get_attention(stack.attention_module(layer)) is None for layer in range(LAYERS)] == [True, True, False]
    heads = sa.get_attention(stack.attention_module(2)).heads
    assert heads[1] is None and heads[2] is None
    expected = ka.make_estimator("positive_orthogonal", num_features=16, rng=conversion.head_seed(5, 2, 3)).fit(
        torch.zeros(1, HEAD_DIM, dtype=torch.float64))
    x = torch.randn(4, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(heads[3].features(x), expected.features(x), rtol=0, atol=0)   # seeded per (l, h)
    with torch.no_grad():
        before = BertStack(model)
        h, m = before.embed(ids, mask)
        for layer in range(2):
            h = before.layer(layer, h, m)
        hc, mc = stack.embed(ids, mask)
        for layer in range(2):
            hc = stack.layer(layer, hc, mc)
        assert torch.equal(hc, h)                                          # layers 0-1 are the model's own
    with pytest.raises(ValueError, match="heads"):
        ka.convert(model, "positive", num_features=8, heads=[4])
    with pytest.raises(ValueError, match="layers"):
        ka.convert(model, "positive", num_features=8, layers=[3])
    with pytest.raises(TypeError, match="model must be a transformers model"):
        ka.convert(torch.nn.Linear(2, 2), "exact")


def test_data_dependent_maps_are_fitted_on_the_calibration_batch_only():
    model = bert(dtype=torch.float64)
    ids, mask = batch()
    with pytest.raises(ValueError, match="calibration"):
        ka.convert(model, "nystrom_uniform", num_features=4, layers=[1])
    calibration = dict(zip(("input_ids", "attention_mask"), batch(seed=7)))
    converted = ka.convert(model, "nystrom_uniform", num_features=4, layers=[1], rng=2, calibration=calibration)
    # by hand: layer 1's queries and keys of the calibration batch's real tokens, the map of head_seed(2, 1, h)
    stack = BertStack(model)
    sa.enable(model)                                    # capture needs the interface; the outputs do not change
    with torch.no_grad():
        h, m = stack.embed(calibration["input_ids"], calibration["attention_mask"])
        call = stack.capture(1, stack.layer(0, h, m), m)
    real = calibration["attention_mask"].bool()
    from kernapprox.surgery import conversion

    fitted = sa.get_attention(BertStack(converted).attention_module(1)).heads
    x = torch.randn(5, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for head in range(HEADS):
        own = ka.make_estimator("nystrom_uniform", num_features=4, rng=conversion.head_seed(2, 1, head)).fit(
            call.query[:, head][real], call.key[:, head][real])
        torch.testing.assert_close(fitted[head].features(x, "key"), own.features(x, "key"), rtol=0, atol=0)
    with torch.no_grad():                      # the evaluated batch does not refit anything
        first = converted(input_ids=ids, attention_mask=mask).last_hidden_state
        again = converted(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(first, again)
