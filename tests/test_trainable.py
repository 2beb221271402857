"""Trainable per-head feature maps (kernapprox.trainable): definitions, every mode against a float64 loop oracle
written here, gradients through it, grouped-query layouts, decoding, masks, autocast, distillation, state bytes."""

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.memory import budget_bytes, probe_state_bytes
from kernapprox.rules import Decay, NormalizedState
from kernapprox.trainable import (
    FitRecord,
    HedgehogMap,
    T2RMap,
    feature_attention,
    feature_attention_weights,
    fit_to_softmax,
)

B, H, H_KV, N, D, D_V = 2, 4, 2, 9, 6, 5
MODES = ("parallel", "recurrent", "chunked")


def draw(seed, *shape, dtype=torch.float64, std=1.0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape) * std).to(dtype)


def qkv(seed=0, dtype=torch.float64, n=N, std=0.7):
    return (draw(seed, B, H, n, D, dtype=dtype, std=std), draw(seed + 1, B, H_KV, n, D, dtype=dtype, std=std),
            draw(seed + 2, B, H_KV, n, D_V, dtype=dtype))


def make_map(kind, heads, dtype=torch.float64, seed=3):
    if kind == "hedgehog":
        return HedgehogMap(heads, D, 4, init="random", rng=seed, dtype=dtype)
    if kind == "hedgehog_halves":
        return HedgehogMap(heads, D, 4, init="random", normalize="halves", rng=seed, dtype=dtype)
    return T2RMap(heads, D, 7, rng=seed, eps=1e-3, dtype=dtype)


# --------------------------------------------------------------------------------------- the oracle (float64)
def oracle_features(fmap, x, weight=None, bias=None):
    """φ from the papers' definitions, one head at a time: head h of x uses the map's head h // G."""
    weight = fmap.weight if weight is None else weight
    bias = fmap.bias if bias is None else bias
    groups = x.shape[1] // weight.shape[0]
    heads = []
    for h in range(x.shape[1]):
        u = x[:, h].double() @ weight[h // groups].double().T + bias[h // groups].double()
        if isinstance(fmap, T2RMap):
            heads.append(torch.clamp(u, min=fmap.eps) if fmap.eps else torch.relu(u))
        elif fmap.normalize == "joint":
            e = torch.exp(torch.cat([u, -u], -1))
            heads.append(e / e.sum(-1, keepdim=True))
        else:
            ep, en = torch.exp(u), torch.exp(-u)
            heads.append(torch.cat([ep / ep.sum(-1, keepdim=True), en / en.sum(-1, keepdim=True)], -1))
    return torch.stack(heads, 1)


def oracle_attention(q, k, v, query_map, key_map=None, causal=False, padding=None, mask=None, gamma=1.0):
    """A loop over (batch, query head, row): y = Σ_j w_ij φ(q_i)ᵀφ'(k_j) v_j / Σ_j w_ij φ(q_i)ᵀφ'(k_j), with the key
    heads repeated to the key map's heads and query head h reading state head h // (H / S)."""
    key_map = query_map if key_map is None else key_map
    state_heads = key_map.weight.shape[0]
    rep = state_heads // k.shape[1]
    k_s, v_s = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    pad = None if padding is None else padding.expand(B, k.shape[1], k.shape[2]).repeat_interleave(rep, 1)
    pq, pk = oracle_features(query_map, q), oracle_features(key_map, k_s)
    n_k = k.shape[2]

    def weight(b, h, g, i, j):
        if (causal and j > i) or (pad is not None and pad[b, g, j]) or (mask is not None and not mask[i, j]):
            return None
        return (pq[b, h, i] @ pk[b, g, j]) * gamma ** ((i if causal else n_k - 1) - j)

    return oracle_loop(q.shape[1], q.shape[1] // state_heads, q.shape[2], n_k, v_s, weight)


def oracle_loop(heads, groups, n, n_k, v, weight):
    """``y_{b,h,i} = Σ_j w v_{b,g,j} / Σ_j w`` over the pairs whose ``weight(b, h, g, i, j)`` is not ``None``, with
    ``g = h // groups``: one loop for every oracle here."""
    out = torch.zeros(B, heads, n, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(heads):
            g = h // groups
            for i in range(n):
                num, den = 0.0, 0.0
                for j in range(n_k):
                    w = weight(b, h, g, i, j)
                    if w is not None:
                        num, den = num + w * v[b, g, j], den + w
                out[b, h, i] = num / den
    return out


LAYOUTS = {"kv_heads": H_KV, "query_heads": H}
KINDS = ("hedgehog", "hedgehog_halves", "t2r")


# ------------------------------------------------------------------------------------------------ the maps
def test_hedgehog_identity_initialisation_and_definition():
    fmap = HedgehogMap(3, 5, 5)
    assert isinstance(fmap.weight, torch.nn.Parameter) and isinstance(fmap.bias, torch.nn.Parameter)
    assert fmap.weight.shape == (3, 5, 5) and fmap.bias.shape == (3, 5) and fmap.num_features == 10
    assert torch.equal(fmap.weight.detach(), torch.eye(5).expand(3, 5, 5)) and not fmap.bias.detach().any()
    x = draw(0, 2, 3, 4, 5, dtype=torch.float32)
    phi = fmap(x)
    e = torch.exp(torch.cat([x, -x], -1).double())
    torch.testing.assert_close(phi.double(), e / e.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert phi.dtype == torch.float32
    assert HedgehogMap(2, 5, 5, bias=False).bias is None


@pytest.mark.parametrize("kind", KINDS)
def test_features_follow_the_definitions(kind):
    fmap = make_map(kind, 2)
    x = draw(1, 3, 2, 7, D)
    torch.testing.assert_close(fmap(x), oracle_features(fmap, x), rtol=1e-12, atol=1e-14)
    phi, logs = fmap.stabilised_features(x)
    assert phi.shape == (3, 2, 7, fmap.num_features) and logs.shape == (3, 2, 7)
    if fmap.log_domain:
        torch.testing.assert_close(fmap.log_features(x), torch.log(oracle_features(fmap, x)), rtol=1e-12, atol=1e-12)
        assert float(phi.detach().amax(-1).min()) == 1.0                  # the stabilised features peak at one
    else:
        assert float(phi.detach().min()) >= fmap.eps


def test_each_head_has_its_own_parameters_and_groups_share_theirs():
    fmap = HedgehogMap(2, D, 4, init="random", rng=0, dtype=torch.float64)
    x = draw(2, 1, 2, 5, D)
    before = fmap(x)
    with torch.no_grad():
        fmap.weight[1] += 0.5
    after = fmap(x)
    assert torch.equal(before[:, 0], after[:, 0]) and not torch.allclose(before[:, 1], after[:, 1])
    # four heads on a two-head map: heads 0, 1 use map 0 and heads 2, 3 map 1 (repeat_kv's order)
    x4 = draw(3, 1, 4, 5, D)
    phi4 = fmap(x4)
    for h in range(4):
        torch.testing.assert_close(phi4[:, h], fmap(x4[:, [h, h]])[:, h // 2], rtol=0, atol=0)


def test_random_initialisation_is_seeded_and_dtype_independent():
    a = T2RMap(2, D, 8, rng=5, dtype=torch.float32)
    b = T2RMap(2, D, 8, rng=5, dtype=torch.float64)
    assert torch.equal(a.weight.detach().double(), b.weight.detach().float().double())
    assert not torch.equal(T2RMap(2, D, 8, rng=6).weight, a.weight)
    assert float(a.weight.detach().abs().max()) <= 1 / math.sqrt(D)


# ------------------------------------------------------------------------------- attention: modes and oracle
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_every_mode_equals_the_oracle(kind, layout, causal):
    q, k, v = qkv()
    fmap = make_map(kind, LAYOUTS[layout])
    want = oracle_attention(q, k, v, fmap, causal=causal)
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, causal=causal, mode=mode, chunk_size=4)
        assert got.shape == (B, H, N, D_V) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{mode}")
        # through the per-token core as well (return_state): the same outputs
        got, state = feature_attention(q, k, v, fmap, causal=causal, mode=mode, chunk_size=4, return_state=True)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{mode} with state")
        assert state.w.shape == (B, LAYOUTS[layout], fmap.num_features, D_V)


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gradients_reach_the_parameters_as_through_the_oracle(kind, causal):
    q, k, v = qkv(10)
    fmap = make_map(kind, H_KV)
    probe = draw(20, B, H, N, D_V)
    want_y = oracle_attention(q, k, v, fmap, causal=causal)
    want = torch.autograd.grad((want_y * probe).sum(), [fmap.weight, fmap.bias])
    assert all(float(g.abs().max()) > 1e-6 for g in want)
    for mode in MODES:
        y = feature_attention(q, k, v, fmap, causal=causal, mode=mode, chunk_size=4)
        got = torch.autograd.grad((y * probe).sum(), [fmap.weight, fmap.bias])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=mode)


# ------------------------------------------------------------------- the window + linear hybrid (LoLCATs' form)
def oracle_window(q, k, v, fmap, window, causal, scale=0.4, padding=None):
    """A loop over (batch, query head, row): keys of the band by e^{s qᵀk}, the others by φ(q)ᵀφ(k), one normaliser."""
    pq, pk = oracle_features(fmap, q), oracle_features(fmap, k)

    def weight(b, h, g, i, j):
        if (causal and j > i) or (padding is not None and padding[b, 0, j]):
            return None
        near = (0 <= i - j < window) if causal else abs(i - j) < window
        return torch.exp(scale * q[b, h, i] @ k[b, g, j]) if near else pq[b, h, i] @ pk[b, g, j]

    return oracle_loop(q.shape[1], q.shape[1] // k.shape[1], q.shape[2], k.shape[2], v, weight)


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
@pytest.mark.parametrize("window", [1, 3, N + 2])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_a_window_hybrid_equals_its_oracle_in_every_mode_and_so_do_its_gradients(kind, window, causal):
    q, k, v = qkv(40)
    fmap = make_map(kind, H_KV)
    want = oracle_window(q, k, v, fmap, window, causal)
    probe = draw(41, B, H, N, D_V)
    reads_the_map = window <= N // 2                 # some keys outside every band: the map takes part
    if reads_the_map:
        want_grad = torch.autograd.grad((want * probe).sum(), [fmap.weight, fmap.bias])
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, causal=causal, mode=mode, chunk_size=4, window=window, scale=0.4)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=mode)
        if reads_the_map:
            grad = torch.autograd.grad((got * probe).sum(), [fmap.weight, fmap.bias])
            for g, w in zip(grad, want_grad):
                assert float(w.abs().max()) > 1e-6
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=mode)
    if window >= N:                          # every key in the band: softmax attention itself
        exact = ka.softmax_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=causal,
                                     scale=0.4)
        torch.testing.assert_close(want, exact, rtol=1e-10, atol=1e-12)


def test_a_window_hybrid_takes_key_and_query_padding():
    q, k, v = qkv(50)
    fmap = make_map("hedgehog", H_KV)
    padding = torch.zeros(B, 1, N, dtype=torch.bool)
    padding[..., 6:] = True
    want = oracle_window(q, k, v, fmap, 2, False, padding=padding)
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, mode=mode, chunk_size=4, window=2, scale=0.4, key_padding_mask=padding)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=mode)
    # left padding, causal: the padded queries (no key before them) give rows of 0, the real rows are the sequence's
    left = padding.flip(-1)
    got = feature_attention(q, k, v, fmap, causal=True, window=2, scale=0.4, key_padding_mask=left,
                            query_padding_mask=left)
    assert float(got[:, :, :3].detach().abs().max()) == 0.0
    alone = feature_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], fmap, causal=True, window=2, scale=0.4)
    torch.testing.assert_close(got[:, :, 3:], alone, rtol=1e-10, atol=1e-12)


def test_a_window_hybrids_weights_and_its_fit():
    q, k, v = qkv(60)
    fmap = make_map("hedgehog", H_KV)
    pq, pk = oracle_features(fmap, q), oracle_features(fmap, k).repeat_interleave(2, 1)
    exact = torch.exp(0.4 * q @ k.repeat_interleave(2, 1).transpose(-1, -2))
    offset = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    kernel = torch.where((offset >= 0) & (offset < 3), exact, pq @ pk.transpose(-1, -2)).tril()
    got = feature_attention_weights(q, k, fmap, causal=True, window=3, scale=0.4)
    torch.testing.assert_close(got, kernel / kernel.sum(-1, keepdim=True), rtol=1e-10, atol=1e-13)
    # the map trained inside the hybrid: the hybrid's own loss falls; the keys outside the window are all it sees
    qs, ks, vs = synthetic_head(5, 8, n=24)
    for loss in ("weights", "outputs"):
        fmap = HedgehogMap(2, 8, 8)
        record = fit_to_softmax(fmap, qs, ks, vs, loss=loss, steps=30, lr=0.05, causal=True, window=4,
                                scale=8 ** -0.5)
        assert record.final_loss < 0.9 * record.initial_loss, (loss, record.initial_loss, record.final_loss)
    # with every key in the window the student is the teacher: nothing to fit, the outputs loss is float32 rounding
    record = fit_to_softmax(HedgehogMap(2, 8, 8), qs, ks, vs, loss="outputs", steps=1, causal=True, window=24)
    assert record.initial_loss < 1e-12


def test_what_a_window_hybrid_refuses():
    q, k, v = qkv(70)
    fmap = make_map("hedgehog", H_KV)
    with pytest.raises(NotImplementedError, match="no decoding state"):
        feature_attention(q, k, v, fmap, causal=True, window=2, return_state=True)
    with pytest.raises(ValueError, match="attn_mask"):
        feature_attention(q, k, v, fmap, mode="parallel", window=2, attn_mask=torch.ones(N, N, dtype=torch.bool))
    with pytest.raises(ValueError, match="sum rule"):
        feature_attention(q, k, v, fmap, causal=True, window=2, rule=Decay(0.9))
    with pytest.raises(ValueError, match="window"):
        feature_attention(q, k, v, fmap, window=0)
    with pytest.raises(ValueError, match="needs window"):
        feature_attention(q, k, v, fmap, scale=0.4)
    with pytest.raises(ValueError, match="needs window"):
        feature_attention_weights(q, k, fmap, scale=0.4)


class _Attention(torch.nn.Module):
    def __init__(self, fmap):
        super().__init__()
        self.fmap = fmap

    def forward(self, q, k, v):
        return feature_attention(q, k, v, self.fmap, causal=True, mode="chunked", chunk_size=2)


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
def test_gradients_match_finite_differences(kind):
    q, k, v = qkv(30, n=5)
    module = _Attention(make_map(kind, H_KV))

    def attention(weight, bias):
        return torch.func.functional_call(module, {"fmap.weight": weight, "fmap.bias": bias}, (q, k, v))

    params = (module.fmap.weight.detach().clone().requires_grad_(), module.fmap.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(attention, params, eps=1e-6, atol=1e-7)


def test_separate_key_map():
    q, k, v = qkv(40)
    query_map = HedgehogMap(H, D, 4, init="random", rng=1, dtype=torch.float64)
    key_map = HedgehogMap(H_KV, D, 4, init="random", rng=2, dtype=torch.float64)
    want = oracle_attention(q, k, v, query_map, key_map, causal=True)
    for mode in MODES:
        got = feature_attention(q, k, v, query_map, key_map=key_map, causal=True, mode=mode, chunk_size=4)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got.sum().backward()
    assert query_map.weight.grad.abs().max() > 0 and key_map.weight.grad.abs().max() > 0


def test_decay_rule_passes_through():
    q, k, v = qkv(50)
    fmap = make_map("hedgehog", H_KV)
    want = oracle_attention(q, k, v, fmap, causal=True, gamma=0.8)
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, causal=True, mode=mode, chunk_size=4, rule=Decay(0.8))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------- decoding, masks, autocast
@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_then_decoding_equals_the_full_pass(kind, layout):
    q, k, v = qkv(60, n=11)
    fmap = make_map(kind, LAYOUTS[layout])
    full = feature_attention(q, k, v, fmap, causal=True, mode="parallel")
    prefill = 6
    y, state = feature_attention(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], fmap, causal=True,
                                 mode="chunked", chunk_size=4, return_state=True)
    outs = [y]
    for t in range(prefill, 11):
        y, state = feature_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], fmap, causal=True,
                                     mode="recurrent", initial_state=state, return_state=True)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-12)
    assert isinstance(state, NormalizedState) and state.z.shape == (B, LAYOUTS[layout], fmap.num_features)


def test_key_padding_equals_dropping_the_keys():
    q, k, v = qkv(70)
    fmap = make_map("hedgehog", H_KV)
    keep = 6
    padding = torch.zeros(B, 1, N, dtype=torch.bool)
    padding[..., keep:] = True
    want = feature_attention(q, k[:, :, :keep], v[:, :, :keep], fmap)              # the per-feature log path
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, mode=mode, chunk_size=4, key_padding_mask=padding)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # right padding, causal: the real rows are the causal attention of the real tokens
    want = feature_attention(q[:, :, :keep], k[:, :, :keep], v[:, :, :keep], fmap, causal=True)
    for mode in MODES:
        got = feature_attention(q, k, v, fmap, causal=True, mode=mode, chunk_size=4, key_padding_mask=padding)
        torch.testing.assert_close(got[:, :, :keep], want, rtol=1e-10, atol=1e-12)
    # left padding leaves the padded rows without a key, which the core refuses (it says which row)
    with pytest.raises(ValueError, match="query 0 .* has no key"):
        feature_attention(q, k, v, fmap, causal=True, key_padding_mask=padding.flip(-1))


def test_attention_mask_in_the_parallel_mode():
    q, k, v = qkv(80)
    fmap = make_map("t2r", H_KV)
    mask = torch.rand(N, N, generator=torch.Generator().manual_seed(0)) > 0.4
    mask |= torch.eye(N, dtype=torch.bool)
    want = oracle_attention(q, k, v, fmap, mask=mask)
    torch.testing.assert_close(feature_attention(q, k, v, fmap, mode="parallel", attn_mask=mask), want,
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="parallel mode only"):
        feature_attention(q, k, v, fmap, mode="chunked", attn_mask=mask)


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
def test_autocast_bfloat16_keeps_features_and_states_in_float32(kind):
    fmap = make_map(kind, H_KV, dtype=torch.float32)
    proj, proj_v = torch.nn.Linear(D, D), torch.nn.Linear(D_V, D_V)
    q, k, v = (t.float() for t in qkv(90))
    want, want_state = feature_attention(proj(q), proj(k), proj_v(v), fmap, causal=True, return_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qb, kb, vb = proj(q), proj(k), proj_v(v)
        assert qb.dtype == torch.bfloat16
        y, state = feature_attention(qb, kb, vb, fmap, causal=True, return_state=True)
        phi = fmap(kb)
    assert y.dtype == torch.bfloat16 and phi.dtype == torch.float32
    assert state.w.dtype == state.z.dtype == state.log_scale.dtype == torch.float32
    # only the bf16 rounding of q, k, v (and of the output) separates the two
    torch.testing.assert_close(y.float(), want.detach(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(state.z, want_state.z.detach(), rtol=0.05, atol=0.05)
    y.float().sum().backward()
    assert fmap.weight.grad.dtype == torch.float32 and float(fmap.weight.grad.abs().max()) > 0
    assert float(proj.weight.grad.abs().max()) > 0                  # through the features to the projections


def test_trained_end_to_end_by_an_optimiser_and_saved():
    q, k, v = (t.float() for t in qkv(100))
    fmap = HedgehogMap(H_KV, D, D)
    start = {name: p.detach().clone() for name, p in fmap.named_parameters()}
    optimizer = torch.optim.Adam(fmap.parameters(), lr=0.05)
    target = ka.softmax_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = (feature_attention(q, k, v, fmap, causal=True) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p.detach(), start[name]) for name, p in fmap.named_parameters())
    copy = HedgehogMap(H_KV, D, D)
    copy.load_state_dict(fmap.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(feature_attention(q, k, v, copy), feature_attention(q, k, v, fmap), rtol=0,
                                   atol=0)


def test_on_every_device_the_modes_agree_with_the_cpu(device):
    q, k, v = (t.float() for t in qkv(120))
    fmap = make_map("hedgehog", H_KV, dtype=torch.float32)
    want = feature_attention(q, k, v, fmap, causal=True, mode="parallel")
    fmap = fmap.to(device)
    for mode in MODES:
        got = feature_attention(q.to(device), k.to(device), v.to(device), fmap, causal=True, mode=mode, chunk_size=4)
        assert got.device.type == device.type
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_raises_naming_the_argument():
    q, k, v = qkv()
    fmap = make_map("hedgehog", H_KV)
    with pytest.raises(ValueError, match="feature_dim == head_dim"):
        HedgehogMap(2, 6, 4)
    with pytest.raises(ValueError, match="init"):
        HedgehogMap(2, 6, 6, init="xavier")
    with pytest.raises(ValueError, match="normalize"):
        HedgehogMap(2, 6, 6, normalize="none")
    with pytest.raises(TypeError, match="num_heads"):
        T2RMap(2.0, 6, 4)
    with pytest.raises(TypeError, match="feature_map"):
        feature_attention(q, k, v, ka.make_estimator("positive", num_features=8, rng=0))
    with pytest.raises(ValueError, match="num_heads = 3"):
        feature_attention(q, k, v, HedgehogMap(3, D, D))
    with pytest.raises(ValueError, match="head_dim"):
        feature_attention(q[..., :4], k[..., :4], v, fmap)
    with pytest.raises(ValueError, match="multiple"):
        feature_attention(q[:, :3], k, v, HedgehogMap(3, D, D))
    with pytest.raises(ValueError, match="key_map"):
        feature_attention(q, k, v, fmap, key_map=make_map("t2r", H_KV))
    with pytest.raises(ValueError, match="mode"):
        feature_attention(q, k, v, fmap, mode="fast")
    with pytest.raises(ValueError, match="as many queries as keys"):
        feature_attention(q, k[:, :, :5], v[:, :, :5], fmap, causal=True)
    with pytest.raises(TypeError, match="initial_state"):
        feature_attention(q, k, v, fmap, causal=True, initial_state=(1, 2, 3))
    _, state = feature_attention(q, k, v, make_map("hedgehog", H), causal=True, return_state=True)
    with pytest.raises(ValueError, match="initial_state"):
        feature_attention(q, k, v, fmap, causal=True, initial_state=state)       # 4 state heads, the map has 2
    with pytest.raises(ValueError, match="NaN"):
        feature_attention(q.clone().fill_(math.nan), k, v, fmap)
    with pytest.raises(ValueError, match='loss="outputs"'):
        fit_to_softmax(fmap, q, k, loss="outputs")
    with pytest.raises(ValueError, match="loss"):
        fit_to_softmax(fmap, q, k, loss="kl")


def test_a_t2r_query_without_features_raises():
    q, k, v = qkv()
    fmap = T2RMap(H_KV, D, 4, dtype=torch.float64, rng=0)
    with torch.no_grad():
        fmap.weight.zero_()
        fmap.bias.fill_(-1.0)                                  # relu(−1) = 0: no features at all
    with pytest.raises(ValueError, match="eps"):
        feature_attention(q, k, v, fmap)


# ------------------------------------------------------------------------------------------------ distillation
def test_kernel_weights_are_the_normalised_kernel():
    q, k, _ = qkv(110)
    for kind in KINDS:
        fmap = make_map(kind, H_KV)
        pq, pk = oracle_features(fmap, q), oracle_features(fmap, k).repeat_interleave(2, 1)
        kernel = (pq @ pk.transpose(-1, -2)).tril()
        want = kernel / kernel.sum(-1, keepdim=True)
        got = feature_attention_weights(q, k, fmap, causal=True)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
        assert torch.isneginf(feature_attention_weights(q, k, fmap, causal=True, log=True)[..., 0, 1:]).all()


def synthetic_head(seed, batch, n=32, d=8, heads=2, scale=0.7):
    """A fixed head: q = xA, k = yA' with one fixed pair of mixing matrices per head (seeded), x, y, v ~ N(0, I)."""
    gen = np.random.default_rng(seed)
    mix = np.random.default_rng(1000).standard_normal((heads, d, d)) / math.sqrt(d) * scale

    def tokens():
        return torch.from_numpy(np.einsum("bhnd,hde->bhne", gen.standard_normal((batch, heads, n, d)), mix)).float()

    return tokens(), tokens(), torch.from_numpy(gen.standard_normal((batch, heads, n, d))).float()


@pytest.mark.parametrize("loss", ["weights", "outputs"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_a_fitted_map_beats_its_initialisation_and_favor_on_held_out_keys(loss, causal):
    """Paired, fixed seeds: the same calibration and held-out sequences for the three maps. Across seeds 0-3 the
    fitted map's error is at most 0.66 of the better of the other two (0.49-0.66), so the bound 0.8 holds with
    room; FAVOR+ has the same r = 16 features."""
    q, k, v = synthetic_head(0, 16)
    qt, kt, vt = synthetic_head(100, 8)
    exact = ka.softmax_attention(qt, kt, vt, causal=causal)

    def error(y):
        return float(ka.metrics.relative_rms_error(y, exact).mean())

    fitted = HedgehogMap(2, 8, 8)
    record = fit_to_softmax(fitted, q, k, v, loss=loss, steps=60, lr=0.05, causal=causal)
    with torch.no_grad():
        e_fit = error(feature_attention(qt, kt, vt, fitted, causal=causal))
        e_init = error(feature_attention(qt, kt, vt, HedgehogMap(2, 8, 8), causal=causal))
    favor = ka.make_estimator("positive_orthogonal", num_features=16, rng=0).fit(q, k)
    e_favor = error(ka.linear_attention(qt, kt, vt, favor, causal=causal))
    assert e_fit < 0.8 * min(e_init, e_favor), (e_fit, e_init, e_favor)
    assert record.final_loss < record.initial_loss and record.losses[-1] < record.losses[0]


def test_fit_record_and_reproducibility():
    q, k, v = synthetic_head(1, 6)
    a, b = HedgehogMap(2, 8, 8), HedgehogMap(2, 8, 8)
    ra = fit_to_softmax(a, q, k, steps=5, lr=0.05, batch_size=4, rng=7)
    rb = fit_to_softmax(b, q, k, steps=5, lr=0.05, batch_size=4, rng=7)
    assert isinstance(ra, FitRecord) and ra.losses == rb.losses and len(ra.losses) == ra.steps == 5
    assert torch.equal(a.weight, b.weight)
    assert ra.tokens == 5 * 4 * 32 and ra.calibration_tokens == 6 * 32
    assert ra.cpu_seconds >= 0 and ra.wall_seconds >= 0 and ra.as_dict()["losses"] == list(ra.losses)
    c = HedgehogMap(2, 8, 8)
    assert fit_to_softmax(c, q, k, steps=5, lr=0.05, batch_size=4, rng=8).losses != ra.losses
    # separate query and key maps: both are trained
    query_map, key_map = HedgehogMap(2, 8, 8), HedgehogMap(2, 8, 8)
    fit_to_softmax(query_map, q, k, key_map=key_map, steps=3, lr=0.05)
    assert not torch.equal(query_map.weight, key_map.weight)
    assert not torch.equal(key_map.weight.detach(), torch.eye(8).expand(2, 8, 8))
    # grouped heads: a key-head map fitted to four query heads
    q4 = torch.cat([q, q.flip(-1)], 1)
    t2r = T2RMap(2, 8, 8, rng=0, eps=1e-6)
    record = fit_to_softmax(t2r, q4, k, v, loss="outputs", steps=10, lr=0.02, causal=True)
    assert record.final_loss < record.initial_loss


# ------------------------------------------------------------------------------------------------ state bytes
@pytest.mark.parametrize("d_v", [8, 33])
def test_state_bytes_is_the_estimators_convention(d_v):
    hedgehog, t2r = HedgehogMap(2, 8, 8), T2RMap(2, 8, 24, rng=0)
    for fmap in (hedgehog, t2r):
        r = fmap.num_features
        assert fmap.state_bytes(d_v) == probe_state_bytes("positive_orthogonal", r, d=8, d_v=d_v, seq_len=64)
        assert fmap.state_bytes(d_v, torch.float64, seq_len=4096) == r * (d_v + 1) * 8
    assert hedgehog.state_bytes(d_v, heads=3) == 3 * hedgehog.state_bytes(d_v)
    assert hedgehog.parameter_bytes() == (2 * 8 * 8 + 2 * 8) * 4
    budget = budget_bytes(64, d=8, d_v=d_v, seq_len=64)            # FAVOR+/OPRF at r = 64
    for cls in (HedgehogMap, T2RMap):
        f = cls.largest_feature_dim(budget, d_v)
        assert T2RMap(1, 8, f, rng=0).state_bytes(d_v) * cls.feature_multiplier <= budget
        assert T2RMap(1, 8, f + 1, rng=0).state_bytes(d_v) * cls.feature_multiplier > budget
    _, state = feature_attention(*synthetic_head(2, 1), hedgehog, causal=True, return_state=True)
    assert (state.w.numel() + state.z.numel()) * state.w.element_size() == 2 * hedgehog.state_bytes(8)


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunked"])
def test_left_padded_causal_batch_equals_each_sequence_alone(mode):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    fmap = HedgehogMap(num_heads=2, head_dim=8, feature_dim=8, dtype=torch.float64)
    pad = torch.zeros(2, 1, 12, dtype=torch.bool)
    pad[0, :, :5] = True
    y = feature_attention(q, k, v, fmap, causal=True, mode=mode, chunk_size=4, key_padding_mask=pad,
                          query_padding_mask=pad)
    assert (y[0, :, :5] == 0).all()
    alone = feature_attention(q[:1, :, 5:], k[:1, :, 5:], v[:1, :, 5:], fmap, causal=True, mode=mode, chunk_size=4)
    torch.testing.assert_close(y[:1, :, 5:], alone, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y[1:], feature_attention(q[1:], k[1:], v[1:], fmap, causal=True, mode=mode,
                                                         chunk_size=4), rtol=1e-10, atol=1e-12)
