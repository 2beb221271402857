"""The torch.nn attention layer: equivalence with nn.MultiheadAttention, modes, gradients, explicit redraws,
buffers as the source of truth (state_dict, devices, dtypes), data-dependent fitting."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import kernapprox as ka
from kernapprox.attention.decode import EstimatorStateCache
from kernapprox.nn import KernelAttention

E, H, N = 12, 3, 7


def inputs(seed, batch=2, n=N, embed=E, dtype=torch.float64, std=1.0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((batch, n, embed)) * std).to(dtype)


def layer(estimator="positive_orthogonal", num_features=16, rng=0, **kw):
    kw.setdefault("dtype", torch.float64)
    return KernelAttention(E, H, estimator, num_features=num_features, rng=rng, **kw)


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_exact_is_multihead_attention(causal):
    ours = layer("exact", num_features=None, causal=causal)
    with torch.no_grad():
        for lin in (ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj):
            lin.bias.copy_(torch.linspace(-0.3, 0.4, E, dtype=torch.float64))
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = inputs(0)
    mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    expected, _ = ref(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(ours(x), expected, rtol=1e-12, atol=1e-12)
    if not causal:                                                    # cross-attention, n_k != n_q
        kv = inputs(1, n=N + 4)
        expected, _ = ref(x, kv, kv, need_weights=False)
        torch.testing.assert_close(ours(x, kv), expected, rtol=1e-12, atol=1e-12)


MODE_CASES = [("positive_orthogonal", {}), ("trig", {}), ("oprf", {}), ("nystrom_uniform", {}),
              ("taylor2", {}), ("window_linear", {"window": 3})]


@pytest.mark.parametrize(("estimator", "options"), MODE_CASES, ids=[c[0] for c in MODE_CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_modes_agree_inside_the_layer(estimator, options, causal):
    if ka.capabilities(estimator).fixed_dimension:
        options = {**options, "num_features": None}
    x = inputs(2, std=0.5)
    ref_layer = layer(estimator, mode="parallel", causal=causal, chunk_size=3, **options).fit(x)
    expected = ref_layer(x)
    state = ref_layer.state_dict()
    for mode in ("recurrent", "chunked"):
        other = layer(estimator, mode=mode, causal=causal, chunk_size=3, **options)
        other.load_state_dict(state)
        assert rel(other(x), expected) < 1e-10, mode


@pytest.mark.parametrize(("estimator", "mode", "causal"), [
    ("positive_orthogonal", "chunked", True), ("trig_orthogonal", "recurrent", False),
    ("hyperbolic", "parallel", True), ("exact", "chunked", True),
], ids=lambda v: str(v))
def test_gradcheck_float64(estimator, mode, causal):
    torch.manual_seed(0)   # gradcheck's own perturbations only; the layer never reads the global RNG
    small = KernelAttention(4, 2, estimator, num_features=None if estimator == "exact" else 4, mode=mode,
                            causal=causal, rng=0, chunk_size=2, dtype=torch.float64)
    x = inputs(3, batch=1, n=5, embed=4, std=0.7).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: small(t), (x,))
    kv = inputs(4, batch=1, n=5, embed=4, std=0.7).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: small(a, b, b), (x, kv))
    small(x).square().sum().backward()
    for name, p in small.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_one_rng_for_everything_and_no_global_rng():
    state = torch.random.get_rng_state()
    a, b, c = layer(rng=3), layer(rng=3), layer(rng=4)
    x = inputs(5)
    ya = a(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(ya, b(x)) and rel(c(x), ya) > 1e-6
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb) if torch.is_tensor(pa) else pa == pb, name


def test_redraw_is_explicit_and_reproducible():
    lay = layer(rng=0)
    x = inputs(6)
    first = lay(x)
    projection = lay.feature_state.projection_.clone()
    lay.train()
    lay.eval()
    assert torch.equal(lay(x), first) and torch.equal(lay(x), first)          # never redrawn implicitly
    lay.redraw()
    assert not torch.equal(lay.feature_state.projection_, projection)
    assert rel(lay(x), first) > 1e-6
    twin = layer(rng=0)
    twin.redraw()
    assert torch.equal(twin(x), lay(x))                                         # the stream is reproducible
    assert torch.equal(lay.redraw(5)(x), twin.redraw(5)(x))


def test_state_dict_round_trip_and_no_stale_casts():
    src, dst = layer(rng=0), layer(rng=1)
    x = inputs(7)
    dst(x.float().double())                                   # fill dst's estimator casts with its own draw
    assert "feature_state.projection_" in src.state_dict()
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst(x), src(x))
    np.testing.assert_array_equal(dst.estimator.projection_, src.feature_state.projection_.numpy())


def test_in_place_buffer_edits_are_used():
    lay = layer(rng=0)
    x = inputs(8)
    before = lay(x)
    with torch.no_grad():
        lay.feature_state.projection_.mul_(0.5)
    after = lay(x)
    assert rel(after, before) > 1e-6
    np.testing.assert_array_equal(lay.estimator.projection_, lay.feature_state.projection_.numpy())
    expected = ka.make_estimator("positive_orthogonal", num_features=16).fit(torch.zeros(1, E // H))
    expected.projection_ = lay.feature_state.projection_.numpy().copy()
    q = lay._split_heads(lay.q_proj(x))
    k = lay._split_heads(lay.k_proj(x))
    v = lay._split_heads(lay.v_proj(x))
    out = ka.linear_attention(q, k, v, expected, mode="chunked")
    torch.testing.assert_close(after, lay.out_proj(out.transpose(1, 2).reshape(2, N, E)), rtol=1e-12, atol=0)


def test_buffers_follow_device_and_dtype(device):
    lay = layer(rng=0, dtype=torch.float32)
    x = inputs(9)
    assert lay.feature_state.projection_.dtype == torch.float64     # fitted values are captured in float64
    lay.double()
    expected = lay(x)
    lay.to(device)
    assert lay.feature_state.projection_.device.type == device.type
    got = lay(x.to(device))
    assert got.device.type == device.type and rel(got.cpu(), expected) < 1e-12
    lay.float()
    assert lay.feature_state.projection_.dtype == torch.float32
    y32 = lay(x.float().to(device))
    assert y32.dtype == torch.float32 and rel(y32.double().cpu(), expected) < 1e-4
    lay.cpu().double()
    assert rel(lay(x), expected) < 1e-6                             # float32-rounded projection, as the buffer says


@pytest.mark.parametrize("estimator", ["oprf", "nystrom_uniform"])
def test_data_dependent_fit_on_first_batch_or_calibration(estimator):
    lay = layer(estimator)
    assert not lay.fitted and len(lay.feature_state.state_dict()) == 0
    with pytest.raises(ValueError, match="fit"):
        lay.redraw()
    x, other = inputs(10), inputs(11, std=2.0)
    with pytest.warns(UserWarning, match="was not fitted"):
        y = lay(x)                                                  # fits on this batch, with a warning
    assert lay.fitted
    state = {k: v.clone() for k, v in lay.feature_state.state_dict().items()}
    lay(other)                                                      # and never again implicitly
    for key, value in lay.feature_state.state_dict().items():
        assert torch.equal(value, state[key]), key
    calibrated = layer(estimator).fit(x)
    assert torch.equal(calibrated(x), y)                            # same stream, same data: the same fit
    calibrated.fit(other)
    assert rel(calibrated(x), y) > 1e-6
    fresh = layer(estimator, rng=7)
    fresh.load_state_dict(lay.state_dict())                         # into a layer that was never fitted
    assert fresh.fitted and torch.equal(fresh(x), lay(x))


def test_nested_estimator_state_is_in_the_state_dict():
    lay = layer("window_linear", window=2)
    keys = set(lay.state_dict())
    assert "feature_state.feature_map_.projection_" in keys
    twin = layer("window_linear", window=2, rng=5)
    twin.load_state_dict(lay.state_dict())
    x = inputs(12)
    assert torch.equal(twin(x), lay(x))


def test_load_state_dict_refuses_another_feature_dimension_or_estimator():
    """Like torch: a state of another estimator, feature dimension or options raises RuntimeError with torch's
    framing ("Error(s) in loading state_dict", "size mismatch for ...", "Unexpected key(s)"); the layer keeps its
    own estimator, num_features and state_bytes. (It used to accept 64 features into a 128-feature layer, or
    positive_orthogonal into positive, and report the wrong values.)"""
    target = layer("positive", num_features=128)
    before = {key: value.clone() for key, value in target.state_dict().items() if torch.is_tensor(value)}
    cases = [(layer("positive", num_features=64), r"estimator mismatch for _extra_state: copying the state of "
              r"estimator 'positive' \(num_features=64.*current model is 'positive' \(num_features=128"),
             (layer("positive_orthogonal", num_features=128), r"estimator mismatch.*'positive_orthogonal'.*"
              r"current model is 'positive'"),
             (layer("positive", num_features=128, sampler="qmc"), r"sampler='qmc'.*sampler='iid'")]
    for source, match in cases:
        with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict for KernelAttention") as info:
            target.load_state_dict(source.state_dict())
        assert re.search(match, str(info.value), re.S), info.value
        with pytest.raises(RuntimeError, match="estimator mismatch"):
            target.load_state_dict(source.state_dict(), strict=False)     # a mismatch is never optional
    assert target.estimator_name == "positive" and target.estimator.num_features == 128
    assert target.estimator.state_bytes(d_v=E // H) == 128 * (E // H + 1) * 4
    for key, value in target.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, before[key]), key
    # a state saved without the record (older versions): torch's own size check still applies
    old = layer("positive", num_features=64).state_dict()
    del old["_extra_state"]
    with pytest.raises(RuntimeError, match=r"size mismatch for feature_state\.projection_: copying a param with "
                                           r"shape torch\.Size\(\[64, 4\]\) from checkpoint, the shape in current "
                                           r"model is torch\.Size\(\[128, 4\]\)"):
        target.load_state_dict(old)
    old = layer("oprf").fit(inputs(0)).state_dict()
    old.pop("_extra_state")
    with pytest.raises(RuntimeError, match="Unexpected key\\(s\\) in state_dict: .*feature_state.alpha_"):
        layer("positive", num_features=16).load_state_dict(old)
    same = layer("positive", num_features=128, rng=9)
    same.load_state_dict(target.state_dict())                                   # the same estimator: fine
    assert torch.equal(same(inputs(1)), target(inputs(1)))


def test_state_dict_round_trips_through_weights_only_load(tmp_path):
    lay = layer("nystrom_rls", num_features=6).fit(inputs(2, n=20))
    torch.save(lay.state_dict(), tmp_path / "layer.pt")
    twin = layer("nystrom_rls", num_features=6, rng=4)
    twin.load_state_dict(torch.load(tmp_path / "layer.pt", weights_only=True))
    assert torch.equal(twin(inputs(3)), lay(inputs(3)))


@pytest.mark.parametrize("name", ka.available_estimators())
def test_fitted_shapes_follow_the_parameters_except_declared_data_sized_entries(name):
    """What lets load_state_dict check shapes: two fits on different amounts of data give the same shapes, except
    the entries the class declares in ``data_sized_state``."""
    size = None if ka.capabilities(name).fixed_dimension else 4
    options = {"window": 3} if name in ("window_linear", "scatterbrain") else {}
    small = ka.make_estimator(name, num_features=size, rng=0, **options).fit(inputs(0, n=9)[..., :4])
    large = ka.make_estimator(name, num_features=size, rng=0, **options).fit(inputs(1, batch=3, n=20)[..., :4])
    a, b = small.fitted_state(), large.fitted_state()
    assert set(a) == set(b) and small.data_sized_state_keys() == large.data_sized_state_keys()
    for key in set(a) - small.data_sized_state_keys():
        assert np.shape(a[key]) == np.shape(b[key]), key


PREFILL_CASES = [("positive_orthogonal", "sum"), ("oprf", "sum"), ("taylor2", "sum"), ("nystrom_uniform", "sum"),
                 ("positive_orthogonal", "delta"), ("taylor2", "decay")]


@pytest.mark.parametrize(("estimator", "rule"), PREFILL_CASES, ids=["-".join(c) for c in PREFILL_CASES])
@pytest.mark.parametrize("mode", ["chunked", "recurrent", "parallel"])
def test_prefill_then_decode_equals_one_pass(estimator, rule, mode):
    """forward(prompt, return_state=True) (padded keys included) then step(token) token by token gives
    the rows of one forward pass over the whole sequence (causal): the state hand-off of a decoder."""
    size = None if ka.capabilities(estimator).fixed_dimension else 8
    rule = {"sum": "sum", "delta": ka.rules.Delta(0.5), "decay": ka.rules.Decay(0.9)}[rule]
    lay = layer(estimator, num_features=size, causal=True, chunk_size=3, mode=mode, rule=rule)
    x = inputs(20, n=N + 4, std=0.5)
    if ka.capabilities(estimator).data_dependent:
        lay.fit(x)
    pad = torch.zeros(2, N + 4, dtype=torch.bool)
    pad[1, 2:4] = True                                              # two padded keys inside the second prompt
    full = lay(x, key_padding_mask=pad)
    out, state = lay(x[:, :N], key_padding_mask=pad[:, :N], return_state=True)
    torch.testing.assert_close(out, full[:, :N], rtol=1e-10, atol=1e-10)
    assert isinstance(state, ka.RecurrentState)
    for t in range(N, N + 4):
        y = lay.step(x[:, t], state)
        assert y.shape == (2, E)
        torch.testing.assert_close(y, full[:, t], rtol=1e-10, atol=1e-10)
    assert lay.step(x[:, N:N + 1], state).shape == (2, 1, E)


@pytest.mark.parametrize("estimator", ["window_linear", "scatterbrain"])
@pytest.mark.parametrize("mode", ["chunked", "recurrent", "parallel"])
def test_a_hybrid_layer_decodes_from_its_fixed_size_state(estimator, mode):
    """The hybrids' forward(prompt, return_state=True) gives their window + linear state, which step() continues
    to the rows of one forward pass (padded keys included); the state's size stops growing at the window."""
    lay = layer(estimator, num_features=8, causal=True, chunk_size=3, mode=mode, window=3)
    x = inputs(22, n=N + 6, std=0.5)
    pad = torch.zeros(2, N + 6, dtype=torch.bool)
    pad[1, 2:4] = True
    full = lay(x, key_padding_mask=pad)
    out, cache = lay(x[:, :N], key_padding_mask=pad[:, :N], return_state=True)
    torch.testing.assert_close(out, full[:, :N], rtol=1e-10, atol=1e-10)
    assert isinstance(cache, EstimatorStateCache)
    size = cache.state_bytes()
    for t in range(N, N + 6):
        torch.testing.assert_close(lay.step(x[:, t], cache), full[:, t], rtol=1e-10, atol=1e-10)
        assert cache.state_bytes() == size and cache.state.keys.shape[-2] == 3


def test_layer_masks_equal_the_functional_calls():
    """key_padding_mask (batch, n_k) and attn_mask (n_q, n_k) / (batch, n_q, n_k) reach linear attention in the
    (batch, heads, n_q, n_k) layout: the layer equals its projections around the functional call."""
    lay = layer("positive_orthogonal", mode="parallel")
    x = inputs(22)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0, -2:] = True
    allowed = torch.from_numpy(np.random.default_rng(1).random((2, N, N)) < 0.7)
    allowed[..., 0] = True
    q, k, v = (lay._split_heads(p(x)) for p in (lay.q_proj, lay.k_proj, lay.v_proj))
    for mask in (allowed, allowed[0]):
        got = lay(x, key_padding_mask=pad, attn_mask=mask)
        want = ka.linear_attention(q, k, v, lay.estimator, mode="parallel", key_padding_mask=pad[:, None],
                                   attn_mask=mask[:, None] if mask.dim() == 3 else mask)
        torch.testing.assert_close(got, lay.out_proj(want.transpose(1, 2).reshape(2, N, E)), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, n_k\)"):
        lay(x, key_padding_mask=pad[:, :-1])
    with pytest.raises(ValueError, match="has no key"):
        lay(x, key_padding_mask=torch.ones(2, N, dtype=torch.bool))


def test_decoding_needs_a_causal_feature_map_or_the_exact_kernel():
    x = inputs(21)
    with pytest.raises(ValueError, match="causal"):
        layer(causal=False)(x, return_state=True)
    with pytest.raises(ValueError, match="fixed-size recurrent state"):
        layer("eva", causal=True)(x, return_state=True)           # query-dependent: no decoding state
    _, cache = layer("exact", num_features=None, causal=True)(x, return_state=True)     # its KV cache
    assert cache.num_tokens == x.shape[1] and cache.state_bytes() > 0
    with pytest.raises(ValueError, match="self-attention"):
        layer(causal=True)(x, x, return_state=True)
    lay = layer(causal=True)
    _, state = lay(x, return_state=True)
    with pytest.raises(TypeError, match="state must be the RecurrentState"):
        layer(causal=True, rng=3).step(x[:, 0], state)
    with pytest.raises(ValueError, match="one token"):
        lay.step(x[:, :2], state)


def test_refit_every_follows_the_projections_while_training():
    """refit_every=k: refitted on the first training forward and every k-th after it, never in eval mode; without
    a policy the first batch fits it with a warning, and a changed projection makes it stale with a warning."""
    lay = layer("nystrom_uniform", num_features=8, refit_every=2)
    batches = [inputs(30 + i) for i in range(5)]
    fits = []
    for x in batches:
        lay(x)
        fits.append(lay.feature_state.landmarks_.clone())
    changed = [not torch.equal(a, b) for a, b in zip(fits, fits[1:])]
    assert changed == [False, True, False, True]                   # refits at forwards 0, 2, 4
    lay.eval()
    lay(inputs(40))
    assert torch.equal(lay.feature_state.landmarks_, fits[-1])      # eval: never refitted
    with pytest.raises(ValueError, match="refit_every applies to data-dependent"):
        layer("positive", refit_every=3)
    with pytest.raises(ValueError, match="refit_every"):
        layer("nystrom_uniform", num_features=8, refit_every=0)

    lazy = layer("nystrom_uniform", num_features=8)
    with pytest.warns(UserWarning, match="was not fitted"):
        lazy(batches[0])
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    lazy(batches[1]).square().sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="stale"):
        lazy(batches[2])
    lazy.fit(batches[3])                                            # refitted: current again, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lazy(batches[4])
        lazy.double()                                               # a cast is not a change of the projection
        lazy(batches[4])
    fresh = layer("nystrom_uniform", num_features=8, rng=5)
    fresh.load_state_dict(lazy.state_dict())                       # projections and map from one checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh(batches[0])


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"embed_dim": 10}, ValueError, "divide"),
    ({"mode": "fast"}, ValueError, "mode"),
    ({"causal": 1}, TypeError, "causal"),
    ({"estimator": "nystromformer", "num_features": 4, "mode": "recurrent"}, ValueError, "not supported"),
    ({"estimator": "nystromformer", "num_features": 4, "mode": "parallel", "causal": True}, ValueError, "causal"),
    ({"estimator": "nope"}, ValueError, "unknown estimator"),
    ({"num_features": None}, TypeError, "num_features"),
])
def test_bad_construction(kwargs, error, match):
    args = {"embed_dim": E, "num_heads": H, "estimator": "positive", "num_features": 8, "rng": 0, **kwargs}
    with pytest.raises(error, match=match):
        KernelAttention(**args)


def test_bad_inputs():
    lay = layer()
    with pytest.raises(ValueError, match="query must have shape"):
        lay(inputs(0, embed=E + 1))
    with pytest.raises(ValueError, match="batch size"):
        lay(inputs(0), inputs(1, batch=3))
    with pytest.raises(TypeError, match="query"):
        lay(np.zeros((2, N, E)))
