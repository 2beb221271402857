"""KernelAttention's options for real models: grouped-query heads, a positional hook (rotary), per-call causality,
bias options, dropout, left-padded prefill + decode, bf16 autocast with float32 states, the refit policy's warning,
and ``num_features`` for fixed-dimension maps (the layer and the scikit-learn transformer agree)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernapprox as ka
from kernapprox.nn import KernelAttention, RotaryEmbedding
from kernapprox.nn.functional import kernel_attention, repeat_kv
from kernapprox.sklearn import SoftmaxKernelFeatures

E, H, HKV, N = 16, 4, 2, 10


def inputs(seed, batch=2, n=N, dtype=torch.float64, std=1.0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((batch, n, E)) * std).to(dtype)


def size(name, r=16):
    return None if ka.capabilities(name).fixed_dimension else r


def layer(name="positive_orthogonal", **kw):
    kw.setdefault("dtype", torch.float64)
    kw.setdefault("rng", 0)
    return KernelAttention(E, H, name, num_features=kw.pop("num_features", size(name)), **kw)


def left_padded():
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, :3] = True
    return pad, (torch.cumsum(~pad, 1) - 1).clamp(min=0)     # positions: each sequence starts at 0


@pytest.mark.parametrize("name", ["positive_orthogonal", "exact"])
def test_grouped_query_layer_equals_a_full_layer_with_repeated_key_value_weights(name):
    gqa = layer(name, num_kv_heads=HKV, causal=True)
    full = layer(name, causal=True, rng=3)
    assert gqa.k_proj.weight.shape == (HKV * E // H, E) and gqa.v_proj.out_features == HKV * E // H
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name_ in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name_), getattr(full, name_)
            dst.weight.copy_(src.weight.reshape(HKV, 1, -1, E).expand(HKV, H // HKV, -1, E).reshape(-1, E))
            dst.bias.copy_(src.bias.reshape(HKV, 1, -1).expand(HKV, H // HKV, -1).reshape(-1))
        if name != "exact":
            full.feature_state.projection_.copy_(gqa.feature_state.projection_)
    x = inputs(0)
    torch.testing.assert_close(gqa(x), full(x), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        layer(num_kv_heads=3)


def test_per_call_causality_and_bias_options():
    lay = layer(causal=False)
    x = inputs(1)
    causal = layer(causal=True)
    torch.testing.assert_close(lay(x, causal=True), causal(x), rtol=0, atol=0)
    torch.testing.assert_close(causal(x, causal=False), lay(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        lay(x, causal=1)
    with pytest.raises(ValueError, match="does not support causal"):
        KernelAttention(E, H, "nystromformer", num_features=4, mode="parallel", rng=0)(x.float(), causal=True)
    plain = layer(bias=False)
    assert all(getattr(plain, p).bias is None for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
    qwen = layer(bias=True, out_bias=False)
    assert qwen.q_proj.bias is not None and qwen.out_proj.bias is None
    assert torch.equal(plain.q_proj.weight, lay.q_proj.weight)            # same draws whatever the biases


def test_rotary_hook_with_exact_attention_is_sdpa_on_rotated_heads():
    rope = RotaryEmbedding(E // H)
    lay = layer("exact", causal=True, pos_hook=rope, num_kv_heads=HKV)
    x = inputs(2)
    q = lay._split_heads(lay.q_proj(x))
    k, v = (lay._split_heads(p(x), HKV) for p in (lay.k_proj, lay.v_proj))
    pos = torch.arange(N).expand(2, N)
    y = F.scaled_dot_product_attention(rope.rotate(q, pos), repeat_kv(rope.rotate(k, pos), 2), repeat_kv(v, 2),
                                       is_causal=True)
    torch.testing.assert_close(lay(x), lay.out_proj(y.transpose(1, 2).reshape(2, N, E)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lay(x, positions=torch.arange(N) + 4), lay(x), rtol=1e-10, atol=1e-12)  # relative
    with pytest.raises(ValueError, match="pos_hook applies to self-attention"):
        lay(x, inputs(3))
    with pytest.raises(ValueError, match="no pos_hook"):
        layer()(x, positions=pos)
    with pytest.raises(TypeError, match="pos_hook must be callable"):
        layer(pos_hook=3)
    assert "pos_hook" not in "".join(lay.state_dict())                    # the rotary module keeps nothing


DECODE_CASES = [("positive_orthogonal", "sum", "chunked"), ("positive_orthogonal", "sum", "recurrent"),
                ("taylor2", "sum", "parallel"), ("hedgehog", "sum", "chunked"),
                ("positive_orthogonal", "delta", "chunked"), ("positive_orthogonal", "decay", "parallel"),
                ("exact", "sum", "parallel")]


@pytest.mark.parametrize(("name", "rule", "mode"), DECODE_CASES, ids=["-".join(c) for c in DECODE_CASES])
def test_left_padded_prefill_then_decode_equals_the_full_forward(name, rule, mode):
    """Grouped-query heads, rotary positions, a left-padded batch: prefill with return_state, then step token by
    token, gives the full forward's rows; the padded sequence's real rows equal that sequence alone."""
    rule = {"sum": "sum", "delta": ka.rules.Delta(0.5), "decay": ka.rules.Decay(0.9)}[rule]
    lay = layer(name, causal=True, mode=mode, rule=rule, chunk_size=3, num_kv_heads=HKV,
                pos_hook=RotaryEmbedding(E // H))
    x = inputs(4, std=0.5)
    pad, pos = left_padded()
    if lay.estimator.capabilities().data_dependent:
        lay.fit(x, positions=pos)
    full = lay(x, key_padding_mask=pad, query_padding_mask=pad, positions=pos)
    alone = lay(x[1:, 3:], positions=torch.arange(N - 3))
    torch.testing.assert_close(full[1:, 3:], alone, rtol=1e-10, atol=1e-10)
    prompt = 6
    out, state = lay(x[:, :prompt], key_padding_mask=pad[:, :prompt], query_padding_mask=pad[:, :prompt],
                     positions=pos[:, :prompt], return_state=True)
    torch.testing.assert_close(out, full[:, :prompt], rtol=1e-10, atol=1e-10)
    for t in range(prompt, N):
        torch.testing.assert_close(lay.step(x[:, t], state, position=pos[:, t]), full[:, t], rtol=1e-10,
                                   atol=1e-10)
    with pytest.raises(ValueError, match="needs the token's position"):
        lay.step(x[:, 0], state)


def test_bf16_autocast_prefill_and_decode_keep_float32_states():
    """Under torch.autocast("cpu", bfloat16), return_state works (it used to raise TypeError about
    initial_state.w's dtype), the state is float32, and decoding equals the full forward to bf16 rounding."""
    lay = layer(causal=True, num_kv_heads=HKV, dtype=torch.float32, pos_hook=RotaryEmbedding(E // H))
    x = inputs(5, dtype=torch.float32, std=0.5)
    want = lay(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = lay(x)
        out, state = lay(x[:, :6], return_state=True)
        assert state.state.w.dtype == torch.float32 and out.dtype == torch.bfloat16
        steps = [lay.step(x[:, t], state, position=t) for t in range(6, N)]
        assert state.state.w.dtype == torch.float32
    assert float((full.float() - want).detach().abs().max()) < 0.05
    torch.testing.assert_close(out.float(), full[:, :6].float(), rtol=0.02, atol=0.02)
    for t, y in zip(range(6, N), steps):
        torch.testing.assert_close(y.float(), full[:, t].float(), rtol=0.02, atol=0.02)


def test_dropout_is_seeded_the_same_in_every_mode_and_off_in_eval():
    x = inputs(6)
    outs = {}
    for mode in ("parallel", "recurrent", "chunked"):
        lay = layer(causal=True, mode=mode, dropout=0.25, num_kv_heads=HKV, chunk_size=4).train()
        outs[mode] = (lay(x), lay(x))                     # the layer's stream: the second call draws anew
    first, second = outs["parallel"]
    assert float((first - second).abs().max()) > 1e-3
    for mode in ("recurrent", "chunked"):
        torch.testing.assert_close(outs[mode][0], first, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(outs[mode][1], second, rtol=1e-10, atol=1e-12)
    lay = layer(causal=True, dropout=0.25, num_kv_heads=HKV)
    twin = layer(causal=True, dropout=0.25, num_kv_heads=HKV)
    assert torch.equal(lay.train()(x), twin.train()(x))
    lay.eval()
    assert torch.equal(lay(x), lay(x))
    torch.testing.assert_close(lay(x), layer(causal=True, num_kv_heads=HKV)(x), rtol=0, atol=0)
    state = torch.random.get_rng_state()
    lay.train()(x)
    assert torch.equal(torch.random.get_rng_state(), state)                   # never torch's global RNG
    with pytest.raises(ValueError, match="dropout must be a number"):
        layer(dropout=1.5)


def test_refit_policy_does_not_warn_after_training_and_the_advice_fits_the_layer():
    """With refit_every the map lags the projections by the policy's design: switching to eval after training
    raises no stale-map warning (it used to after every training run); without a policy the warning names the
    options that help."""
    x = inputs(7)
    for name in ("hedgehog", "nystrom_uniform"):
        lay = layer(name, num_features=8, refit_every=2, causal=True)
        opt = torch.optim.Adam(lay.parameters(), lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                lay(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            lay.eval()
            lay(x)
    lazy = layer("nystrom_uniform", num_features=8).fit(x)
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    lazy(x).square().sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match=r"stale\. Pass refit_every=k .* or call fit\(calibration\)"):
        lazy(x)


def test_fixed_dimension_maps_take_their_own_dimension_in_the_layer_and_the_transformer():
    """KernelAttention and SoftmaxKernelFeatures agree: None takes the map's dimension, any other number raises
    naming the argument and the dimension (the layer's is set by qk_dim)."""
    lay = KernelAttention(64, 4, "taylor2", rng=0)
    assert lay.estimator.num_features == 153                              # 1 + 16 + 16·17/2
    assert KernelAttention(64, 4, "taylor2", num_features=153, rng=0).estimator.num_features == 153
    with pytest.raises(ValueError, match=r"num_features=64 cannot be honoured: estimator 'taylor2' has a fixed "
                                         r"dimension, 153 at qk_dim=16; pass num_features=None"):
        KernelAttention(64, 4, "taylor2", num_features=64)
    assert KernelAttention(64, 4, "taylor2", qk_dim=4, rng=0).estimator.num_features == 15
    X = np.random.default_rng(0).normal(size=(30, 16))
    assert SoftmaxKernelFeatures("taylor2").fit(X).n_components_ == 153
    with pytest.raises(ValueError, match=r"n_components must be None or 153, got 8"):
        SoftmaxKernelFeatures("taylor2", n_components=8).fit(X)


def test_state_dict_round_trip_with_the_new_options():
    src = layer(causal=True, num_kv_heads=HKV, pos_hook=RotaryEmbedding(E // H), dropout=0.1, out_bias=False)
    dst = layer(causal=True, num_kv_heads=HKV, pos_hook=RotaryEmbedding(E // H), dropout=0.1, out_bias=False,
                rng=9)
    dst.load_state_dict(src.state_dict())
    x = inputs(8)
    assert torch.equal(dst.eval()(x), src.eval()(x))
    with pytest.raises(RuntimeError, match="size mismatch for k_proj.weight"):
        layer(causal=True).load_state_dict(src.state_dict(), strict=False)


def test_the_functional_core_is_the_layer_between_its_projections():
    lay = layer(causal=True, num_kv_heads=HKV, mode="chunked")
    x = inputs(9)
    pad, _ = left_padded()
    q = lay._split_heads(lay.q_proj(x))
    k, v = (lay._split_heads(p(x), HKV) for p in (lay.k_proj, lay.v_proj))
    y = kernel_attention(q, k, v, lay.estimator, causal=True, key_padding_mask=pad, query_padding_mask=pad)
    torch.testing.assert_close(lay(x, key_padding_mask=pad, query_padding_mask=pad),
                               lay.out_proj(y.transpose(1, 2).reshape(2, N, E)), rtol=1e-12, atol=1e-12)
