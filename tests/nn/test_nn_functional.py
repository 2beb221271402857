"""The functional core kernapprox.nn.functional.kernel_attention and RotaryEmbedding: grouped-query heads against the
repeated-heads reference, every mask in every mode against the parallel mode and SDPA, key dropout (the same in
every mode, reproducible from a seed, unbiased), autocast with float32 states, rotary positions against a direct
complex-number form of RoFormer's eq. 34."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernapprox as ka
from kernapprox.nn import RotaryEmbedding
from kernapprox.nn.functional import kernel_attention, repeat_kv

B, H, HKV, N, D = 2, 4, 2, 11, 8
MODES = ("parallel", "recurrent", "chunked")


def heads(seed, heads=H, n=N, d=D, dtype=torch.float64, std=0.6):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, heads, n, d, generator=gen, dtype=torch.float64) * std).to(dtype)


def estimator(name="positive_orthogonal", r=32, d=D):
    size = None if ka.capabilities(name).fixed_dimension else r
    return ka.make_estimator(name, num_features=size, rng=0).fit(torch.zeros(1, d, dtype=torch.float64))


def left_padding():
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, :4] = True                                       # the second sequence is 4 tokens shorter, on the left
    return pad


@pytest.mark.parametrize("name", ["positive_orthogonal", "taylor2", "exact"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_grouped_query_heads_equal_the_repeated_heads_reference(name, causal):
    q, k, v = heads(0), heads(1, HKV), heads(2, HKV)
    est = estimator(name)
    k_rep, v_rep = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    torch.testing.assert_close(repeat_kv(k, H // HKV), k_rep, rtol=0, atol=0)
    want = (ka.softmax_attention(q, k_rep, v_rep, causal) if name == "exact"
            else ka.linear_attention(q, k_rep, v_rep, est, causal=causal, mode="parallel"))
    for mode in MODES:
        got = kernel_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=4)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    one = kernel_attention(q, k[:, :1], v[:, :1], est, causal=causal)          # multi-query attention
    ref = kernel_attention(q, k[:, :1].expand(B, H, N, D), v[:, :1].expand(B, H, N, D), est, causal=causal)
    torch.testing.assert_close(one, ref, rtol=1e-10, atol=1e-12)
    if name != "exact" and causal:                                             # states per query head
        _, state = kernel_attention(q, k, v, est, causal=True, return_state=True)
        assert state.w.shape == (B, H, est.num_features, D)
        # one group, equal copies (to the rounding of the batched product, which may differ by an ulp per head)
        ulps = 8 * torch.finfo(state.w.dtype).eps * float(state.w.abs().max())
        torch.testing.assert_close(state.w[:, 0], state.w[:, 1], rtol=0, atol=ulps)


def test_bad_heads_raise_naming_the_argument():
    q, k, v, est = heads(0), heads(1, 3), heads(2, 3), estimator()
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of the key/value heads \(3\)"):
        kernel_attention(q, k, v, est)
    with pytest.raises(ValueError, match="q must have shape"):
        kernel_attention(q[0], k[0], v[0], est)
    with pytest.raises(ValueError, match="k and v must have the same heads"):
        kernel_attention(q, heads(1, HKV), heads(2, 1), est)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        kernel_attention(q, heads(1), heads(2), est, key_padding_mask=torch.zeros(B, 3, N, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        kernel_attention(q, heads(1), heads(2), est, key_padding_mask=torch.zeros(B, N))


@pytest.mark.parametrize("name", ["positive_orthogonal", "taylor2"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_padding_masks_in_every_mode_equal_the_parallel_mode_and_the_unpadded_rows(name, causal):
    """Left padding (query and key padding together) and key padding per key/value head: every mode equals the
    parallel mode; padded query rows are 0; the real rows of the padded sequence equal the sequence alone."""
    q, k, v = heads(3), heads(4, HKV), heads(5, HKV)
    est = estimator(name)
    pad = left_padding()
    kv_pad = torch.zeros(B, HKV, N, dtype=torch.bool)
    kv_pad[0, 1, 5:7] = True                                 # key/value head 1 of entry 0 drops two keys
    for masks in ({"key_padding_mask": pad, "query_padding_mask": pad}, {"key_padding_mask": kv_pad}):
        want = kernel_attention(q, k, v, est, causal=causal, mode="parallel", **masks)
        for mode in ("recurrent", "chunked"):
            got = kernel_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=3, **masks)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    want = kernel_attention(q, k, v, est, causal=causal, mode="parallel", key_padding_mask=pad,
                            query_padding_mask=pad)
    assert torch.equal(want[1, :, :4], torch.zeros_like(want[1, :, :4]))
    alone = kernel_attention(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:], est, causal=causal, mode="parallel")
    torch.testing.assert_close(want[1:, :, 4:], alone, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="has no key"):                  # without the query mask: refused
        kernel_attention(q, k, v, est, causal=True, key_padding_mask=pad)


def _sdpa(q, k, v, causal, key_padding=None, attn_mask=None):
    """SDPA itself, the masks in its own form (bool: True = takes part)."""
    mask = None
    if key_padding is not None:
        mask = ~key_padding[:, None, None, :]
    if attn_mask is not None:
        mask = attn_mask if mask is None else (mask & attn_mask if attn_mask.dtype == torch.bool
                                               else torch.where(mask, attn_mask, -math.inf))
    if causal:
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = tri if mask is None else (mask & tri if mask.dtype == torch.bool else mask.masked_fill(~tri, -math.inf))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_exact_attention_with_every_mask_equals_sdpa(causal):
    q, k, v = heads(6), heads(7, HKV), heads(8, HKV)
    est = estimator("exact")
    k_rep, v_rep = repeat_kv(k, 2), repeat_kv(v, 2)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, -3:] = True                                                      # right padding of the keys
    allowed = torch.from_numpy(np.random.default_rng(0).random((B, 1, N, N)) < 0.7)
    allowed[..., 0] = True
    additive = torch.zeros(B, H, N, N, dtype=torch.float64).masked_fill(~allowed, -math.inf) + 0.1
    for kw, ref in (({"key_padding_mask": pad}, {"key_padding": pad}),
                    ({"attn_mask": allowed}, {"attn_mask": allowed}),
                    ({"attn_mask": additive, "key_padding_mask": pad}, {"attn_mask": additive, "key_padding": pad})):
        got = kernel_attention(q, k, v, est, causal=causal, **kw)
        torch.testing.assert_close(got, _sdpa(q, k_rep, v_rep, causal, **ref), rtol=1e-10, atol=1e-12)
    left = left_padding()
    got = kernel_attention(q, k, v, est, causal=causal, key_padding_mask=left, query_padding_mask=left)
    want = _sdpa(q[1:, :, 4:], k_rep[1:, :, 4:], v_rep[1:, :, 4:], causal)
    torch.testing.assert_close(got[1:, :, 4:], want, rtol=1e-10, atol=1e-12)
    assert torch.equal(got[1, :, :4], torch.zeros_like(got[1, :, :4]))


def test_attention_masks_in_the_parallel_mode_and_a_clear_error_elsewhere():
    q, k, v = heads(9), heads(10, HKV), heads(11, HKV)
    est = estimator()
    allowed = torch.from_numpy(np.random.default_rng(1).random((B, 1, N, N)) < 0.6)
    allowed[..., 0] = True
    got = kernel_attention(q, k, v, est, mode="parallel", attn_mask=allowed)
    want = ka.linear_attention_naive(q, repeat_kv(k, 2), repeat_kv(v, 2), est, attn_mask=allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for mode in ("recurrent", "chunked"):
        with pytest.raises(ValueError, match="attn_mask is honoured in the parallel mode only"):
            kernel_attention(q, k, v, est, mode=mode, attn_mask=allowed)


@pytest.mark.parametrize("name", ["positive_orthogonal", "exact"])
def test_dropout_drops_keys_the_same_way_in_every_mode_and_is_seeded(name):
    q, k, v = heads(12), heads(13, HKV), heads(14, HKV)
    est = estimator(name)
    p = 0.3
    ref = kernel_attention(q, k, v, est, causal=True, mode="parallel", dropout_p=p, training=True, rng=5)
    for mode in ("recurrent", "chunked"):
        got = kernel_attention(q, k, v, est, causal=True, mode=mode, dropout_p=p, training=True, rng=5,
                               chunk_size=4)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # the definition: values of dropped keys zeroed (per batch entry, query head and key), kept ones / (1 - p)
    keep = torch.from_numpy((np.random.default_rng(5).random((B, H, N)) >= p) / (1 - p))
    v_drop = repeat_kv(v, 2) * keep[..., None]
    want = (ka.softmax_attention(q, repeat_kv(k, 2), v_drop, True) if name == "exact"
            else ka.linear_attention(q, repeat_kv(k, 2), v_drop, est, causal=True, mode="parallel"))
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-12)
    assert torch.equal(kernel_attention(q, k, v, est, causal=True, dropout_p=p, training=True, rng=5),
                       kernel_attention(q, k, v, est, causal=True, dropout_p=p, training=True, rng=5))
    other = kernel_attention(q, k, v, est, causal=True, dropout_p=p, training=True, rng=6)
    assert float((other - ref).abs().max()) > 1e-3
    plain = kernel_attention(q, k, v, est, causal=True)
    assert torch.equal(kernel_attention(q, k, v, est, causal=True, dropout_p=p, training=False), plain)
    # unbiased: the mean over 400 masks is close to the output without dropout (and a biased variant is not)
    gen = np.random.default_rng(7)
    mean = sum(kernel_attention(q, k, v, est, causal=True, dropout_p=p, training=True, rng=gen)
               for _ in range(400)) / 400
    err = float((mean - plain).norm() / plain.norm())
    assert err < 0.1, err
    assert float(((1 - p) * mean - plain).norm() / plain.norm()) > 2 * err      # the 1/(1-p) matters
    with pytest.raises(ValueError, match="needs rng="):
        kernel_attention(q, k, v, est, dropout_p=p, training=True)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        kernel_attention(q, k, v, est, dropout_p=1.0, training=True, rng=0)


@pytest.mark.parametrize("name", ["positive_orthogonal", "exact"])
def test_autocast_bf16_runs_the_core_in_float32_with_float32_states(name):
    q, k, v = heads(15, dtype=torch.float32), heads(16, HKV, dtype=torch.float32), heads(17, HKV,
                                                                                         dtype=torch.float32)
    est = estimator(name)
    want = kernel_attention(q, k, v, est, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kernel_attention(q, k, v, est, causal=True)
        if name != "exact":
            out, state = kernel_attention(q, k, v, est, causal=True, return_state=True)
            assert state.w.dtype == torch.float32 and state.z.dtype == torch.float32
            assert out.dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16
    # the inputs rounded to bf16 once, then float32 arithmetic: the error is bf16 input rounding, not bf16 matmuls
    ref = kernel_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), est, causal=True)
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
    assert float((got.float() - ref).abs().max()) <= float((ref.bfloat16().float() - ref).abs().max()) + 1e-6
    assert float((got.float() - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("name", ["positive_orthogonal", "exact"])
def test_scale_is_the_kernels(name):
    q, k, v = heads(18), heads(19), heads(20)
    est = ka.make_estimator(name, num_features=None if name == "exact" else 4096, rng=0).fit(q, k)
    got = kernel_attention(q, k, v, est, scale=0.05)
    want = ka.softmax_attention(q, k, v, scale=0.05)
    tol = 1e-12 if name == "exact" else 0.05
    assert float((got - want).norm() / want.norm()) < tol
    assert float((kernel_attention(q, k, v, est) - want).norm() / want.norm()) > 3 * tol


def _rotary_complex(x, positions, base=10000.0):
    """RoFormer eq. 34 written with complex numbers: pair (x_2i, x_2i+1) as x_2i + i x_2i+1 times e^{i m θ_i}."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., 0::2], x[..., 1::2])
    rot = z * torch.exp(1j * positions.to(torch.float64)[:, None, :, None] * theta)
    return torch.stack([rot.real, rot.imag], -1).flatten(-2)


def test_rotary_embedding_is_roformer_eq_34():
    x = heads(21, d=8)
    positions = torch.stack([torch.arange(N), torch.arange(N) + 5])
    rope = RotaryEmbedding(8)
    torch.testing.assert_close(rope.rotate(x, positions), _rotary_complex(x, positions), rtol=1e-12, atol=1e-12)
    half = RotaryEmbedding(8, interleaved=False)          # the same rotation on the coordinates (x_i, x_i+d/2)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    torch.testing.assert_close(half.rotate(x[..., perm], positions)[..., torch.argsort(perm)],
                               rope.rotate(x, positions), rtol=1e-12, atol=1e-12)
    q, k = rope(x, heads(22, d=8), positions)
    scores = q @ k.transpose(-1, -2)
    q2, k2 = rope(x, heads(22, d=8), positions + 9)               # a shift changes nothing of q·k
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), scores, rtol=1e-10, atol=1e-10)
    assert rope.rotate(x.float(), positions).dtype == torch.float32
    assert not list(rope.state_dict())
    with pytest.raises(ValueError, match="dim must be even"):
        RotaryEmbedding(7)
    with pytest.raises(TypeError, match="positions must be an integer"):
        rope.rotate(x, positions.float())


@pytest.mark.parametrize("mode", MODES)
def test_a_state_continues_the_sequence_with_grouped_heads_and_left_padding(mode):
    """Prefill with return_state, then the rest of the sequence from initial_state: the full causal call's rows."""
    q, k, v = heads(23), heads(24, HKV), heads(25, HKV)
    est, pad = estimator(), left_padding()
    full = kernel_attention(q, k, v, est, causal=True, mode=mode, key_padding_mask=pad, query_padding_mask=pad)
    cut = 6
    first, state = kernel_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], est, causal=True, mode=mode,
                                    key_padding_mask=pad[:, :cut], query_padding_mask=pad[:, :cut],
                                    return_state=True)
    rest = kernel_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], est, causal=True, mode=mode,
                            initial_state=state)
    torch.testing.assert_close(torch.cat([first, rest], -2), full, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="exact attention has no fixed-size state"):
        kernel_attention(q, k, v, estimator("exact"), causal=True, return_state=True)
