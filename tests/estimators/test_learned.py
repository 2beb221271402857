"""Hedgehog, the learned map: its untrained end is hyperbolic random features, training is deterministic and lowers
the distillation loss and the held-out error, the loss is the cross-entropy it claims, and the stabilised
features match a float64 evaluation of the formula."""

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.estimators import HedgehogFeatures


def sequences(seed, batch=8, n=48, d=16, logit_std=2.0, dv=8):
    """Anisotropic queries and keys (coordinate scales e^{-l/4}) scaled so the logits have std ``logit_std``:
    peaky, structured attention a map can learn; values N(0, 1)."""
    gen = np.random.default_rng(seed)
    scales = np.exp(-np.arange(d) / 4.0)
    q, k = (gen.standard_normal((batch, n, d)) * scales for _ in range(2))
    std = (np.einsum("bnd,bmd->bnm", q, k) / math.sqrt(d)).std()
    factor = math.sqrt(logit_std / std)
    return (torch.from_numpy(q * factor), torch.from_numpy(k * factor),
            torch.from_numpy(gen.standard_normal((batch, n, dv))))


def hedgehog(num_features=16, rng=0, **options):
    return ka.make_estimator("hedgehog", num_features=num_features, rng=rng, **options)


def test_untrained_map_is_hyperbolic_random_features():
    """Zero steps: W = the sampler's draw, b = 0 — exactly the unbiased hyperbolic map with that draw."""
    q, k, _ = sequences(0)
    for sampler in ("orthogonal", "iid"):
        est = hedgehog(24, rng=3, num_steps=0, sampler=sampler).fit(q, k)
        name = "hyperbolic" if sampler == "iid" else f"hyperbolic_{sampler}"
        ref = ka.make_estimator(name, num_features=24, rng=3).fit(q, k)
        torch.testing.assert_close(est.kernel_matrix(q, k), ref.kernel_matrix(q, k), rtol=1e-12, atol=0)
        assert est.loss_ == est.initial_loss_


def test_training_is_deterministic_given_rng_and_steps():
    q, k, _ = sequences(1)
    a = hedgehog(rng=5, num_steps=20).fit(q, k)
    b = hedgehog(rng=5, num_steps=20).fit(q, k)
    for name in ("query_weight_", "query_bias_", "key_weight_", "key_bias_"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert a.loss_ == b.loss_
    c = hedgehog(rng=5, num_steps=21).fit(q, k)
    d = hedgehog(rng=6, num_steps=20).fit(q, k)
    assert not np.array_equal(a.query_weight_, c.query_weight_)
    assert not np.array_equal(a.query_weight_, d.query_weight_)
    # batch dimensions are sequences: (2, 4, n, d) trains exactly as (8, n, d)
    e = hedgehog(rng=5, num_steps=20).fit(q.reshape(2, 4, *q.shape[1:]), k.reshape(2, 4, *k.shape[1:]))
    np.testing.assert_allclose(e.query_weight_, a.query_weight_, rtol=0, atol=1e-12)


def test_training_lowers_the_loss_and_the_held_out_error():
    """On other sequences of the same distribution, 100 steps beat the untrained map for every one of 5 seeds
    (the median error falls by at least a fifth)."""
    q, k, _ = sequences(2)
    qh, kh, vh = sequences(3)
    exact = ka.softmax_attention(qh, kh, vh)
    before, after = [], []
    for seed in range(5):
        untrained = hedgehog(rng=seed, num_steps=0).fit(q, k)
        trained = hedgehog(rng=seed, num_steps=100).fit(q, k)
        assert trained.loss_ < trained.initial_loss_ == untrained.loss_
        assert trained.distillation_loss(qh, kh) < untrained.distillation_loss(qh, kh)
        before.append(float(ka.metrics.relative_rms_error(ka.linear_attention(qh, kh, vh, untrained), exact).mean()))
        after.append(float(ka.metrics.relative_rms_error(ka.linear_attention(qh, kh, vh, trained), exact).mean()))
    assert all(a < b for a, b in zip(after, before)), (before, after)
    assert np.median(after) < 0.8 * np.median(before)


@pytest.mark.parametrize("tied", [True, False])
def test_distillation_loss_is_the_cross_entropy_of_attention_weights(tied):
    """The loss the fit reports equals −mean_i Σ_j P_ij log Â_ij computed plainly in float64 from the map's kernel
    matrix and the softmax weights."""
    q, k, _ = sequences(4, batch=3, n=20, d=8)
    est = hedgehog(12, rng=1, num_steps=15, tied=tied).fit(q, k)
    kernel = est.kernel_matrix(q, k)
    weights = kernel / kernel.sum(-1, keepdim=True)
    target = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    naive = float(-(target * torch.log(weights)).sum(-1).mean())
    assert est.loss_ == pytest.approx(naive, rel=1e-12)
    assert est.distillation_loss(q, k) == pytest.approx(naive, rel=1e-12)
    assert np.array_equal(est.query_weight_, est.key_weight_) == tied


def test_features_match_a_float64_evaluation_of_the_formula():
    """φ(x) = e^{-‖x‖²/2} (2m)^{-1/2} [e^{Wx+b}, e^{-Wx-b}] with x = sqrt(s)·q, evaluated in numpy float64 from the
    fitted weights: float64 features agree to 1e-13, float32 ones to float32 rounding, and the stabilised pair
    recomposes to the same values."""
    q, k, _ = sequences(5, batch=2, n=16, d=8)
    est = hedgehog(10, rng=2, num_steps=10, tied=False).fit(q, k)
    s = 1 / math.sqrt(8)
    for role, x in (("query", q), ("key", k)):
        xs = x.numpy() * math.sqrt(s)
        u = xs @ getattr(est, f"{role}_weight_").T + getattr(est, f"{role}_bias_")
        expected = np.exp(np.concatenate([u, -u], -1) - 0.5 * (xs**2).sum(-1, keepdims=True)) / math.sqrt(10)
        np.testing.assert_allclose(est.features(x, role).numpy(), expected, rtol=1e-13)
        np.testing.assert_allclose(est.features(x.float(), role).numpy(), expected, rtol=2e-6)
        tilde, logs = est.features(x, role, log_scale=True)
        assert float(tilde.max()) == 1.0 and bool((tilde > 0).all())
        np.testing.assert_allclose((tilde * torch.exp(logs)[..., None]).numpy(), expected, rtol=1e-13)


def test_stabilised_features_stay_accurate_where_the_exact_scale_underflows():
    q, k, v = sequences(6, batch=2, n=16, d=8)
    est = hedgehog(8, rng=0, num_steps=5).fit(q, k)
    big_q, big_k = 40.0 * q, 40.0 * k
    with pytest.raises(ValueError, match="underflow"):                 # e^{-‖x‖²/2} underflows whole rows:
        est.features(big_k, "key")                                     # exact scale refused, not zeros
    tilde, logs = est.features(big_k, "key", log_scale=True)
    assert bool(torch.isfinite(tilde).all() & torch.isfinite(logs).all())
    out = ka.linear_attention(big_q, big_k, v, est, mode="chunked", chunk_size=4)
    assert bool(torch.isfinite(out).all())
    # the same output from log-domain weights in float64: w_ij ∝ Σ_l exp(a_il + c_jl)
    s = math.sqrt(1 / math.sqrt(8))
    x, y = big_q * s, big_k * s
    uq, uk = x @ torch.from_numpy(est.query_weight_).T + torch.from_numpy(est.query_bias_), \
        y @ torch.from_numpy(est.key_weight_).T + torch.from_numpy(est.key_bias_)
    aq = torch.cat([uq, -uq], -1)
    ak = torch.cat([uk, -uk], -1) - 0.5 * (y * y).sum(-1, keepdim=True)
    log_w = torch.logsumexp(aq[..., :, None, :] + ak[..., None, :, :], -1)
    expected = torch.softmax(log_w, -1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_validation():
    with pytest.raises(ValueError, match="even"):
        hedgehog(15)
    with pytest.raises(ValueError, match="num_steps"):
        hedgehog(num_steps=-1)
    with pytest.raises(ValueError, match="learning_rate"):
        hedgehog(learning_rate=0.0)
    with pytest.raises(TypeError, match="tied"):
        hedgehog(tied=1)
    with pytest.raises(ValueError, match="sampler"):
        hedgehog(sampler="halton-ish")
    q, k, _ = sequences(7, batch=2, n=8, d=4)
    with pytest.raises(ValueError, match="batch dimensions"):
        hedgehog().fit(q, k[:1])
    with pytest.raises(ValueError, match="diverged"):
        hedgehog(rng=0, num_steps=50, learning_rate=1e3).fit(*sequences(0)[:2])
    same = hedgehog(rng=1, num_steps=3).fit(q)                    # k=None: the queries are the keys
    again = hedgehog(rng=1, num_steps=3).fit(q, q)
    assert np.array_equal(same.query_weight_, again.query_weight_)


def test_capabilities_and_memory():
    caps = ka.capabilities("hedgehog")
    assert caps.kind == "features" and caps.positive and caps.data_dependent and not caps.unbiased
    assert not caps.consistent and set(caps.modes) == set(ka.MODES)
    est = hedgehog(16, rng=0, num_steps=1).fit(*sequences(8, batch=1, n=8, d=4)[:2])
    assert isinstance(est, HedgehogFeatures)
    assert est.state_bytes(32) == 16 * 33 * 4                          # the linear state only
    assert est.parameter_bytes() == 2 * (8 * 4 + 8) * 4                 # W and b per role, trained elsewhere
