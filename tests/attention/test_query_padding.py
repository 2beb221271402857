"""``query_padding_mask``: padded query rows give 0, need no key, and pass no gradient; the real rows of a left-
or right-padded batch equal attention on the unpadded sequence (every mode, rule and estimator kind)."""

import pytest
import torch

import kernapprox as ka

PAD = 3          # left padding of batch entry 0
N, D = 12, 4


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, N, D, generator=gen, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 1, N, dtype=torch.bool)
    pad[0, :, :PAD] = True                 # entry 0: left padded; entry 1: right padded by 2
    pad[1, :, N - 2:] = True
    return q, k, v, pad


def _fitted(name):
    q, k, _, _ = _batch()
    options = {"num_features": 16} if name not in ("exact", "taylor2") else {}
    return ka.make_estimator(name, rng=0, **options).fit(q.reshape(-1, D), k.reshape(-1, D))


def _segments(pad):
    """(batch entry, first real position, end) of each entry's real tokens."""
    return [(0, PAD, N), (1, 0, N - 2)]


CASES = [("positive", "sum", mode) for mode in ("parallel", "recurrent", "chunked")] + [
    ("positive", ka.rules.Decay(0.9), "chunked"), ("positive", "delta", "chunked"),
    ("positive", ka.rules.LeastSquares(1.0), "recurrent"), ("exact", "sum", "parallel"),
    ("taylor2", "sum", "parallel")]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name, rule, mode", CASES)
def test_real_rows_equal_the_unpadded_sequence_and_padded_rows_are_zero(name, rule, mode, causal):
    q, k, v, pad = _batch()
    if not causal and not ka.rules.resolve_rule(rule).noncausal:
        pytest.skip("causal-only rule")
    est = _fitted(name)
    y = ka.linear_attention(q, k, v, est, causal=causal, mode=mode, rule=rule, chunk_size=4,
                            key_padding_mask=pad, query_padding_mask=pad)
    assert torch.isfinite(y).all()
    assert (y.masked_select(pad[..., None].expand_as(y)) == 0).all()
    for b, start, stop in _segments(pad):
        ref = ka.linear_attention(q[b:b + 1, :, start:stop], k[b:b + 1, :, start:stop], v[b:b + 1, :, start:stop],
                                  est, causal=causal, mode=mode, rule=rule, chunk_size=4)
        torch.testing.assert_close(y[b:b + 1, :, start:stop], ref, rtol=1e-10, atol=1e-10)


def test_without_the_query_mask_a_left_padded_causal_row_still_raises():
    q, k, v, pad = _batch()
    with pytest.raises(ValueError, match="no key to attend to"):
        ka.linear_attention(q, k, v, _fitted("positive"), causal=True, key_padding_mask=pad)
    with pytest.raises(ValueError, match="no key to attend to"):
        ka.softmax_attention(q, k, v, causal=True, key_padding_mask=pad)


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
@pytest.mark.parametrize("name", ["positive", "exact"])
def test_gradients_are_finite_and_padded_positions_get_none_through_queries(name, mode):
    q, k, v, pad = _batch()
    if name == "exact" and mode != "parallel":
        mode = "parallel"
    est = _fitted(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = ka.linear_attention(q, k, v, est, causal=True, mode=mode, chunk_size=4, key_padding_mask=pad,
                            query_padding_mask=pad)
    (y * torch.linspace(-1, 1, D, dtype=y.dtype)).square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    padded = pad[..., None].expand_as(q.grad)
    assert (q.grad.masked_select(padded) == 0).all()          # a padded query's output is a constant 0
    assert (k.grad.masked_select(padded) == 0).all()          # a padded key reaches no real row
    assert (v.grad.masked_select(padded) == 0).all()
    assert q.grad.abs().sum() > 0


def test_parts_of_padded_rows_are_zero_one_zero():
    q, k, v, pad = _batch()
    parts = ka.linear_attention(q, k, v, _fitted("positive"), causal=True, key_padding_mask=pad,
                                query_padding_mask=pad, return_parts=True)
    rows = pad.expand(2, 2, N)
    assert (parts.numerator[rows] == 0).all() and (parts.normalizer[rows] == 1).all()
    assert (parts.log_scale[rows] == 0).all()


def test_softmax_attention_lse_and_additive_mask():
    q, k, v, pad = _batch()
    bias = torch.zeros(N, N, dtype=torch.float64).masked_fill(
        torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    bias = bias.masked_fill(pad[..., None, :], float("-inf"))          # (2, 1, N, N): causal + padding
    y, lse = ka.softmax_attention(q, k, v, attn_mask=bias, query_padding_mask=pad, return_lse=True)
    assert torch.isfinite(y).all() and torch.isfinite(lse).all()
    assert (lse.masked_select(pad.expand_as(lse)) == 0).all()
    for b, start, stop in _segments(pad):
        ref = ka.softmax_attention(q[b:b + 1, :, start:stop], k[b:b + 1, :, start:stop], v[b:b + 1, :, start:stop],
                                   causal=True)
        torch.testing.assert_close(y[b:b + 1, :, start:stop], ref, rtol=1e-10, atol=1e-10)


def test_from_features_entry_point():
    q, k, v, pad = _batch()
    est = _fitted("positive")
    (pq, lq), (pk, lk) = est.features(q, "query", log_scale=True), est.features(k, "key", log_scale=True)
    for mode in ("parallel", "recurrent", "chunked"):
        parts = ka.attention.linear_attention_from_features(pq, lq, pk, lk, v, causal=True, mode=mode, chunk_size=4,
                                                            key_padding_mask=pad, query_padding_mask=pad)
        ref = ka.linear_attention(q, k, v, est, causal=True, mode=mode, key_padding_mask=pad, query_padding_mask=pad)
        torch.testing.assert_close(parts.output, ref, rtol=1e-10, atol=1e-12)


def test_bad_query_padding_mask_is_named():
    q, k, v, _ = _batch()
    est = _fitted("positive")
    with pytest.raises(TypeError, match="query_padding_mask"):
        ka.linear_attention(q, k, v, est, query_padding_mask=torch.zeros(2, 1, N))
    with pytest.raises(ValueError, match="query_padding_mask"):
        ka.linear_attention(q, k, v, est, query_padding_mask=torch.zeros(2, 1, N + 1, dtype=torch.bool))
