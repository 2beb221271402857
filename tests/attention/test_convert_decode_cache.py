"""One cache object from prefill to decode (:mod:`kernapprox.attention.decode`): a prefill, a continuation of
several tokens and one-token steps give the full causal pass for every registered causal estimator (float64); the
state keeps its size and dtype; estimators without a decoding cache say so by name."""

from __future__ import annotations

import pytest
import torch

import kernapprox as ka
from kernapprox.approximate.hybrid import WindowState
from kernapprox.attention.decode import (
    EstimatorStateCache,
    FeatureStateCache,
    GroupedQueryCache,
    KVCache,
    decode_cache,
)

D, DV, N = 8, 6, 20
# the estimators with their own attention take a window shorter than the test sequence, so both parts are used
OPTIONS = {"window_linear": {"window": 4}, "scatterbrain": {"window": 4}}


def _qkv(seed=0, batch=(2, 3), n=N, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return tuple(0.6 * torch.randn(*batch, n, dim, generator=gen, dtype=dtype) for dim in (D, D, DV))


def _fitted(name, q, k):
    caps = ka.capabilities(name, **OPTIONS.get(name, {}))
    r = None if caps.fixed_dimension else 16
    return ka.make_estimator(name, num_features=r, rng=0, **OPTIONS.get(name, {})).fit(
        q.reshape(-1, D), k.reshape(-1, D))


def _decoded(cache, q, k, v, prefill=7, block=3):
    """Prefill of ``prefill`` tokens, one continuation of ``block`` tokens, then one token at a time."""
    outs = [cache.prefill(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :])]
    stop = prefill + block
    outs.append(cache.extend(q[..., prefill:stop, :], k[..., prefill:stop, :], v[..., prefill:stop, :]))
    for t in range(stop, q.shape[-2]):
        outs.append(cache.step(q[..., t, :], k[..., t, :], v[..., t, :])[..., None, :])
    return torch.cat(outs, -2)


CAUSAL = [name for name in ka.available_estimators() if ka.capabilities(name, **OPTIONS.get(name, {})).causal]
DECODABLE = [name for name in CAUSAL if not ka.capabilities(name, **OPTIONS.get(name, {})).query_dependent]


@pytest.mark.parametrize("name", DECODABLE)
def test_prefill_then_decode_is_the_full_causal_pass(name):
    q, k, v = _qkv()
    est = _fitted(name, q, k)
    cache = decode_cache(est)
    full = ka.linear_attention(q, k, v, est, causal=True, mode=cache.mode)
    got = _decoded(cache, q, k, v)
    assert cache.num_tokens == N
    assert float((got - full).abs().max()) < 1e-12 * max(1.0, float(full.abs().max()))


def test_each_kind_gets_its_cache():
    q, k, _ = _qkv()
    assert isinstance(decode_cache(_fitted("positive", q, k)), FeatureStateCache)
    assert isinstance(decode_cache(_fitted("exact", q, k)), KVCache)
    for name in ("window_linear", "scatterbrain"):
        assert isinstance(decode_cache(_fitted(name, q, k)), EstimatorStateCache)


@pytest.mark.parametrize("name", sorted(set(CAUSAL) - set(DECODABLE)))
def test_query_dependent_estimators_have_no_decoding_cache(name):
    q, k, _ = _qkv()
    est = _fitted(name, q, k)
    with pytest.raises(ValueError, match=f"{type(est).__name__} has no decoding cache.*query_dependent"):
        decode_cache(est)


def test_non_causal_estimators_are_refused_by_name():
    q, k, _ = _qkv()
    est = ka.make_estimator("nystromformer", num_features=8, rng=0).fit(q.reshape(-1, D), k.reshape(-1, D))
    with pytest.raises(ValueError, match="Nystromformer.* defines no causal attention"):
        decode_cache(est)
    with pytest.raises(TypeError, match="estimator must be a kernapprox estimator"):
        decode_cache("positive")


@pytest.mark.parametrize("rule", [ka.rules.Decay(0.9), ka.rules.Delta(0.5), ka.rules.LeastSquares(1.0)])
@pytest.mark.parametrize("mode", ["chunked", "recurrent", "parallel"])
def test_every_rule_and_mode_decodes_the_full_pass(rule, mode):
    q, k, v = _qkv(seed=3)
    est = _fitted("positive_orthogonal", q, k)
    cache = decode_cache(est, rule=rule, mode=mode)
    full = ka.linear_attention(q, k, v, est, causal=True, rule=rule, mode=mode)
    torch.testing.assert_close(_decoded(cache, q, k, v), full, rtol=0, atol=1e-11)


def test_the_feature_state_keeps_its_size_and_the_kv_cache_grows():
    q, k, v = _qkv(seed=1)
    feat = decode_cache(_fitted("positive", q, k))
    kv = decode_cache(_fitted("exact", q, k))
    for cache in (feat, kv):
        assert cache.state_bytes() == 0
        cache.prefill(q[..., :5, :], k[..., :5, :], v[..., :5, :])
    entries = 2 * 3
    assert feat.state_bytes() == entries * 16 * (DV + 1) * 8           # r (d_v + 1) float64 numbers per entry
    assert kv.state_bytes() == entries * 5 * (D + DV) * 8              # n (d + d_v) numbers per entry
    first = feat.state_bytes(), feat.held_bytes()
    for t in range(5, N):
        feat.step(q[..., t, :], k[..., t, :], v[..., t, :])
        kv.step(q[..., t, :], k[..., t, :], v[..., t, :])
    assert (feat.state_bytes(), feat.held_bytes()) == first
    assert kv.state_bytes() == entries * N * (D + DV) * 8 == kv.held_bytes()
    # the memory axes' convention: the estimator's own state_bytes
    assert feat.state_bytes() == entries * feat.estimator.state_bytes(DV, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_under_autocast_keeps_float32_states(dtype):
    q, k, v = (t.to(dtype) for t in _qkv(seed=2, dtype=torch.float32))
    est = _fitted("positive", q.float(), k.float())
    cache = decode_cache(est)
    with torch.autocast("cpu", dtype=dtype):
        y = cache.prefill(q[..., :8, :], k[..., :8, :], v[..., :8, :])
        y_t = cache.step(q[..., 8, :], k[..., 8, :], v[..., 8, :])
    assert y.dtype == y_t.dtype == dtype
    assert all(t.dtype == torch.float32 for t in cache.state)
    assert cache.state_bytes() == 2 * 3 * est.state_bytes(DV, torch.float32)
    full = ka.linear_attention(q.float()[..., :9, :], k.float()[..., :9, :], v.float()[..., :9, :], est, causal=True)
    torch.testing.assert_close(y_t.float(), full[..., 8, :], rtol=0, atol=2e-2)


def test_select_reorders_the_batch_as_beam_search_does():
    q, k, v = _qkv(seed=4, batch=(3, 2))
    index = torch.tensor([2, 0, 0])
    for name in ("positive", "exact", "window_linear"):
        est = _fitted(name, q, k)
        cache = decode_cache(est)
        cache.prefill(q[..., :10, :], k[..., :10, :], v[..., :10, :])
        cache.select(index)
        got = cache.extend(q[index, :, 10:], k[index, :, 10:], v[index, :, 10:])
        full = ka.linear_attention(q[index], k[index], v[index], est, causal=True, mode=cache.mode)
        torch.testing.assert_close(got, full[..., 10:, :], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["window_linear", "scatterbrain"])
def test_the_hybrid_state_is_a_window_and_a_linear_state_of_fixed_size(name):
    """The hybrids decode from their own fixed-size state: the last w keys and values plus the linear state of the
    older keys; its size stops growing once the window is full, and it is what state_bytes accounts for."""
    q, k, v = _qkv(seed=6)
    est = _fitted(name, q, k)                                            # window 4
    cache = decode_cache(est)
    cache.prefill(q[..., :3, :], k[..., :3, :], v[..., :3, :])
    assert isinstance(cache.state, WindowState) and cache.state.linear is None     # nothing has left the window
    assert cache.state_bytes() == 2 * 3 * est.state_bytes(DV, torch.float64, seq_len=3)
    sizes = []
    for t in range(3, N):
        cache.step(q[..., t, :], k[..., t, :], v[..., t, :])
        assert cache.state.keys.shape[-2] == min(t + 1, 4) and cache.state.linear is not None or t < 4
        sizes.append((cache.state_bytes(), cache.held_bytes()))
    assert len(set(sizes[1:])) == 1                                      # fixed once the window is full
    entries = 2 * 3
    assert sizes[-1][0] == entries * (4 * (D + DV) * 8 + est.feature_map_.state_bytes(DV, torch.float64))
    # held: + the window's padding flags (bool) and the linear state's log-scale, which the r (d_v + 1) convention
    # of the memory axes leaves out (as for a feature map's state)
    assert sizes[-1][1] == sizes[-1][0] + entries * (4 + 8)


@pytest.mark.parametrize("name", ["window_linear", "scatterbrain"])
@pytest.mark.parametrize("window, chunk", [(5, 3), (2, 7), (16, 4)])
def test_the_hybrid_state_continues_the_full_pass_over_chunk_boundaries(name, window, chunk):
    """A long prefill taken in blocks of ``chunk`` new queries (shorter or longer than the window), continuations
    of several tokens and single steps: the full causal pass in every mode, with a left-padded entry."""
    q, k, v = _qkv(seed=7, n=37)
    est = ka.make_estimator(name, num_features=16, rng=1, window=window).fit(q.reshape(-1, D), k.reshape(-1, D))
    pad = torch.zeros(2, 1, 37, dtype=torch.bool)
    pad[1, :, :6] = True
    state, outs = None, []
    for a, b in ((0, 23), (23, 30), *((t, t + 1) for t in range(30, 37))):
        out, state = est.decode_extend(state, q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                       key_padding_mask=pad[..., a:b], query_padding_mask=pad[..., a:b],
                                       chunk_size=chunk)
        outs.append(out)
    got = torch.cat(outs, -2)
    for mode in ("parallel", "recurrent", "chunked"):
        full = ka.linear_attention(q, k, v, est, causal=True, mode=mode, chunk_size=chunk, key_padding_mask=pad,
                                   query_padding_mask=pad)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-12)
    assert state.keys.shape[-2] == window and state.linear is not None


@pytest.mark.parametrize("name", ["positive", "exact", "window_linear"])
def test_a_float64_state_serves_float32_inputs(name):
    """state_dtype=float64: the cache computes in and keeps float64 while the inputs and outputs stay float32, and
    gives the float64 full pass to float32 rounding of the output."""
    q, k, v = _qkv(seed=8)
    est = _fitted(name, q, k)
    cache = decode_cache(est, state_dtype=torch.float64)
    got = _decoded(cache, q.float(), k.float(), v.float())
    assert got.dtype == torch.float32
    assert all(t.dtype == torch.float64 for t in cache._tensors() if t.is_floating_point())
    want = ka.linear_attention(q.float().double(), k.float().double(), v.float().double(), est, causal=True,
                               mode=cache.mode)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    single = decode_cache(est)
    _decoded(single, q.float(), k.float(), v.float())
    assert cache.state_bytes() == 2 * single.state_bytes()              # what it keeps, at 8 bytes a number
    with pytest.raises(TypeError, match="state_dtype"):
        decode_cache(est, state_dtype=torch.int64)


def test_bad_continuations_are_refused():
    q, k, v = _qkv()
    cache = decode_cache(_fitted("positive", q, k))
    cache.prefill(q[..., :4, :], k[..., :4, :], v[..., :4, :])
    with pytest.raises(ValueError, match="prefill on a cache that holds 4 tokens"):
        cache.prefill(q[..., :4, :], k[..., :4, :], v[..., :4, :])
    with pytest.raises(ValueError, match="do not continue the cache of batch shape"):
        cache.extend(q[:1, :, 4:6], k[:1, :, 4:6], v[:1, :, 4:6])
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        cache.extend(q[..., 4:6, :], k[..., 4:6, :], v[..., 4:6, :], key_padding_mask=torch.zeros(2))
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        cache.extend(q[..., 4:6, :], k[..., 4:7, :], v[..., 4:7, :])
    cache.reset()
    assert cache.state is None and cache.num_tokens == 0
    hybrid = decode_cache(_fitted("window_linear", q, k))
    pad = torch.zeros(2, 3, 4, dtype=torch.bool)
    pad[0, 0, :2] = True
    with pytest.raises(ValueError, match="has no key to attend to"):          # a real query after padding only
        hybrid.prefill(q[..., :4, :], k[..., :4, :], v[..., :4, :], key_padding_mask=pad)
    with pytest.raises(TypeError, match="state must be a WindowState"):
        hybrid.estimator.decode_extend((1, 2), q[..., :4, :], k[..., :4, :], v[..., :4, :])


@pytest.mark.parametrize("name", ["positive", "hedgehog", "taylor2", "exact", "nystrom_uniform", "window_linear",
                                  "scatterbrain"])
def test_a_left_padded_batch_decodes_as_each_sequence_alone(name):
    """Entry 0 of the batch is left-padded by 4 tokens: padded keys enter no state, padded queries get rows of 0,
    and its real rows equal the unpadded sequence's, in the full pass and from prefill to decode alike."""
    q, k, v = _qkv(seed=5, batch=(2, 3))
    est = _fitted(name, q, k)
    pad = torch.zeros(2, 1, N, dtype=torch.bool)
    pad[0, :, :4] = True
    full = ka.linear_attention(q, k, v, est, causal=True, key_padding_mask=pad, query_padding_mask=pad)
    cache = decode_cache(est)
    outs = [cache.prefill(q[..., :8, :], k[..., :8, :], v[..., :8, :], key_padding_mask=pad[..., :8],
                          query_padding_mask=pad[..., :8])]
    for t in range(8, N):
        outs.append(cache.step(q[..., t, :], k[..., t, :], v[..., t, :])[..., None, :])
    got = torch.cat(outs, -2)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-12)
    assert bool((got[0, :, :4] == 0).all())
    alone = ka.linear_attention(q[0, :, 4:], k[0, :, 4:], v[0, :, 4:], est, causal=True)
    torch.testing.assert_close(got[0, :, 4:], alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ka.linear_attention(q[1], k[1], v[1], est, causal=True), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["positive", "taylor2", "exact", "window_linear", "scatterbrain"])
def test_grouped_query_heads_keep_one_state_per_key_value_head(name):
    """GroupedQueryCache: G query heads per key/value head read one state each; prefill, a continuation and one-token
    steps (with key padding) give the repeated heads' full pass, the state holds 1/G of their bytes, and select
    reorders it."""
    groups, kv_heads = 3, 2
    gen = torch.Generator().manual_seed(7)
    q = 0.6 * torch.randn(2, kv_heads * groups, N, D, generator=gen, dtype=torch.float64)
    k = 0.6 * torch.randn(2, kv_heads, N, D, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, N, DV, generator=gen, dtype=torch.float64)
    pad = torch.zeros(2, 1, N, dtype=torch.bool)
    pad[1, 0, :2] = True                                               # left padding of the second sequence
    est = _fitted(name, q, k)
    rep_k, rep_v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    keyless = pad & (torch.cumsum((~pad).int(), -1) == 0)
    full = ka.linear_attention(q, rep_k, rep_v, est, causal=True, key_padding_mask=pad, query_padding_mask=keyless)
    grouped = GroupedQueryCache(decode_cache(est), groups)
    repeated = decode_cache(est)
    outs = []
    for a, b in ((0, 7), (7, 10), *((t, t + 1) for t in range(10, N))):
        masks = {"key_padding_mask": pad[..., a:b], "query_padding_mask": keyless[..., a:b]}
        outs.append(grouped.extend(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], **masks))
        repeated.extend(q[..., a:b, :], rep_k[..., a:b, :], rep_v[..., a:b, :], **masks)
    got = torch.cat(outs, -2)
    assert float((got - full).abs().max()) < 1e-12 * max(1.0, float(full.abs().max()))
    assert grouped.num_tokens == N and grouped.estimator is est
    assert groups * grouped.state_bytes() == repeated.state_bytes()
    assert groups * grouped.held_bytes() <= repeated.held_bytes() + 2 * N * groups * 8   # padding flags aside
    index = torch.tensor([1, 1])
    grouped.select(index)
    q2, k2, v2 = (torch.randn(2, h, 1, dim, generator=gen, dtype=torch.float64)
                  for h, dim in ((kv_heads * groups, D), (kv_heads, D), (kv_heads, DV)))
    both = (torch.cat([q[index], q2], -2), torch.cat([rep_k[index], k2.repeat_interleave(groups, 1)], -2),
            torch.cat([rep_v[index], v2.repeat_interleave(groups, 1)], -2))
    masks = {"key_padding_mask": torch.cat([pad[index], pad.new_zeros(2, 1, 1)], -1),
             "query_padding_mask": torch.cat([keyless[index], pad.new_zeros(2, 1, 1)], -1)}
    want = ka.linear_attention(*both, est, causal=True, **masks)[..., -1:, :]
    torch.testing.assert_close(grouped.extend(q2, k2, v2), want, rtol=0, atol=1e-12)
    grouped.reset()
    assert grouped.num_tokens == 0 and grouped.state_bytes() == 0


@pytest.mark.parametrize("rule", ["sum", ka.rules.Decay(0.9)], ids=["sum", "decay"])
@pytest.mark.parametrize("state_dtype", [None, torch.float64], ids=["own-dtype", "float64-state"])
def test_grouped_decoding_steps_update_one_state_per_key_value_head(rule, state_dtype, monkeypatch):
    """The one-token step of a grouped feature state (FeatureStateCache.grouped_step: the key/value head's state
    updated once, read by its G query heads) gives the general path's outputs and states (the state broadcast to
    the G heads, each updated, the first kept) to float rounding, and it is the path that runs."""
    groups, kv_heads, prefill = 3, 2, 6
    gen = torch.Generator().manual_seed(11)
    q = 0.6 * torch.randn(2, kv_heads * groups, N, D, generator=gen)
    k = 0.6 * torch.randn(2, kv_heads, N, D, generator=gen)
    v = torch.randn(2, kv_heads, N, DV, generator=gen)
    est = _fitted("positive", q.double(), k.double())
    caches = {}
    for path in ("grouped", "general"):
        if path == "general":
            monkeypatch.setattr(FeatureStateCache, "grouped_step", lambda self, *a, **kw: None)
        cache = GroupedQueryCache(decode_cache(est, rule=rule, state_dtype=state_dtype), groups)
        outs = [cache.extend(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :])]
        outs += [cache.extend(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]) for t in range(prefill, N)]
        caches[path] = (torch.cat(outs, -2), cache.inner.state)
    monkeypatch.undo()
    (got, got_state), (want, want_state) = caches["grouped"], caches["general"]
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_state, want_state):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    repeated = ka.linear_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), est,
                                   causal=True, rule=rule)
    torch.testing.assert_close(got, repeated, rtol=1e-4, atol=1e-5)
    ran = []
    cache = GroupedQueryCache(decode_cache(est, rule=rule, state_dtype=state_dtype), groups)
    cache.extend(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :])
    real = FeatureStateCache.grouped_step
    monkeypatch.setattr(FeatureStateCache, "grouped_step", lambda self, *a, **kw: ran.append(1) or real(self, *a, **kw))
    cache.extend(q[..., prefill:prefill + 1, :], k[..., prefill:prefill + 1, :], v[..., prefill:prefill + 1, :])
    assert ran == [1] and cache.num_tokens == prefill + 1


def test_grouped_query_cache_refuses_mismatched_heads():
    q, k, v = _qkv(batch=(1, 2))
    grouped = GroupedQueryCache(decode_cache(_fitted("positive", q, k)), 2)
    with pytest.raises(ValueError, match="query heads"):
        grouped.extend(q[:, :1], k, v)
    with pytest.raises(ValueError, match="groups"):
        GroupedQueryCache(decode_cache(_fitted("positive", q, k)), 0)
    with pytest.raises(TypeError, match="inner"):
        GroupedQueryCache(object(), 2)
