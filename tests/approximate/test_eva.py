"""EVA: the control-variate view of random-feature attention, the float64 oracles and their limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import gaussian

from kernapprox.approximate.eva import (
    control_variate_reference,
    eva_kernel_reference,
    eva_reference,
    group_bounds,
    local_bounds,
)


def scaled(q, k):
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]))
    return root * q, root * k


def softmax_attention(q, k, v, causal=False):
    x, y = scaled(q, k)
    logits = x @ np.swapaxes(y, -1, -2)
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], dtype=bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


# ------------------------------------------------------------------------------ control variates (EVA §3)
def test_one_shared_coefficient_is_random_feature_attention():
    """One group: ``Σ_m ĝ_m = β(ω)``, the one-feature random-feature attention with the frequency ``ω``, for any
    proposal (the importance ratio cancels)."""
    q, k, v = gaussian((4, 3), 0), gaussian((5, 3), 1), gaussian((5, 2), 2)
    x, y = scaled(q, k)
    for mean in (np.zeros(3), gaussian(3, 3)):
        w = gaussian(3, 4) + mean
        cv = control_variate_reference(q, k, v, w[None], [np.arange(5)], mean[None])
        xi = np.exp(y @ w - 0.5 * (y * y).sum(1))
        np.testing.assert_allclose(cv, np.broadcast_to(xi @ v / xi.sum(), cv.shape), rtol=1e-12, atol=1e-14)


def test_per_key_coefficients_give_softmax_attention():
    q, k, v = gaussian((4, 3), 5), gaussian((6, 3), 6), gaussian((6, 2), 7)
    omegas, means = gaussian((6, 3), 8), gaussian((6, 3), 9)
    cv = control_variate_reference(q, k, v, omegas, [np.array([m]) for m in range(6)], means)
    np.testing.assert_allclose(cv, softmax_attention(q, k, v), rtol=1e-12, atol=1e-14)


def test_per_group_coefficients_are_eva_with_exact_group_masses():
    """EVA without a local set and with the exact group masses ``S_c`` is the per-group control-variate estimator
    (its normaliser is then the exact ``Z``), with each group's draw ``ω_c = x̄ + ȳ_c + ε_c``."""
    q, k, v = gaussian((7, 3), 10), gaussian((7, 3), 11), gaussian((7, 2), 12)
    noise = gaussian((3, 3), 13)
    x, y = scaled(q, k)
    bounds = group_bounds(7, 3)
    means = np.stack([x.mean(0) + y[a:b].mean(0) for a, b in bounds])
    cv = control_variate_reference(q, k, v, means + noise[:len(bounds)], [np.arange(a, b) for a, b in bounds], means)
    eva = eva_reference(q, k, v, noise, num_groups=3, window=0, group_mass="exact")
    np.testing.assert_allclose(eva, cv, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------- groups and sets
def test_groups_and_local_sets():
    assert group_bounds(10, 4).tolist() == [[0, 3], [3, 6], [6, 9], [9, 10]]
    assert group_bounds(13, 16).tolist() == [[i, i + 1] for i in range(13)]
    assert group_bounds(8, 3).tolist() == [[0, 3], [3, 6], [6, 8]]
    assert group_bounds(10, 4, group_size=4).tolist() == [[0, 4], [4, 8], [8, 10]]
    with pytest.raises(ValueError, match="need 4 groups"):
        group_bounds(10, 3, group_size=3)
    assert local_bounds(5, 10, 2, 3, causal=False) == (4, 7)
    assert local_bounds(5, 10, 0, 3, causal=False) == (5, 5)
    assert local_bounds(5, 10, 2, 3, causal=True) == (3, 6)        # own unfinished group [3, 6) from 3
    assert local_bounds(7, 10, 1, 3, causal=True) == (6, 8)
    assert local_bounds(7, 10, 4, 3, causal=True) == (4, 8)        # the last w keys reach further back
    assert local_bounds(1, 10, 5, 3, causal=True) == (0, 2)


# --------------------------------------------------------------------------------------------- the limits
@pytest.mark.parametrize("causal", [False, True])
def test_eva_is_exact_with_one_key_per_group_or_a_covering_window(causal):
    q, k, v = gaussian((2, 9, 3), 14), gaussian((2, 9, 3), 15), gaussian((2, 9, 2), 16)
    exact = softmax_attention(q, k, v, causal)
    for num_groups, window in ((9, 0), (12, 3), (3, 9), (1, 20)):
        noise = gaussian((num_groups, 3), 17)
        for sample in (True, False):
            out = eva_reference(q, k, v, noise, num_groups=num_groups, window=window, causal=causal, sample=sample)
            np.testing.assert_allclose(out, exact, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_eva_kernel_reference_gives_the_output(causal):
    q, k, v = gaussian((8, 3), 18), gaussian((8, 3), 19), gaussian((8, 2), 20)
    noise = gaussian((3, 3), 21)
    for window in (0, 1, 2, 5):
        a = eva_kernel_reference(q, k, noise, num_groups=3, window=window, causal=causal)
        out = eva_reference(q, k, v, noise, num_groups=3, window=window, causal=causal)
        np.testing.assert_allclose(a @ v / a.sum(-1, keepdims=True), out, rtol=1e-12, atol=1e-14)
        if causal:
            assert (np.triu(a, 1) == 0).all()
        assert (a > 0).sum() == (a != 0).sum()                                # positive where non-zero


def test_group_mass_is_a_lower_bound_of_the_exact_mass():
    """Jensen: ``|P| exp(xᵀȳ_P) ≤ Σ_P exp(xᵀy_m)``: with the same draws the "mean" row puts at most the exact
    mass on every group and the exact weights on the local set."""
    q, k = gaussian((9, 3), 22), gaussian((9, 3), 23)
    noise = gaussian((3, 3), 24)
    mean = eva_kernel_reference(q, k, noise, num_groups=3, window=1)
    exact = eva_kernel_reference(q, k, noise, num_groups=3, window=1, group_mass="exact")
    for a, b in group_bounds(9, 3):
        assert (mean[:, a:b].sum(1) <= exact[:, a:b].sum(1) * (1 + 1e-12)).all()
    x, y = scaled(q, k)
    band = np.abs(np.arange(9)[:, None] - np.arange(9)[None]) < 1
    np.testing.assert_allclose(mean[band], np.exp(x @ y.T)[band], rtol=1e-12)


def test_causal_eva_uses_no_future_token():
    q, k, v = gaussian((10, 3), 25), gaussian((10, 3), 26), gaussian((10, 2), 27)
    noise = gaussian((4, 3), 28)
    base = eva_reference(q, k, v, noise, num_groups=4, window=2, causal=True)
    for t in (3, 6, 9):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        q2[t:] += 5.0
        k2[t:] -= 3.0
        v2[t:] *= -2.0
        other = eva_reference(q2, k2, v2, noise, num_groups=4, window=2, causal=True)
        np.testing.assert_allclose(other[:t], base[:t], rtol=1e-12, atol=1e-14)


def test_eva_with_one_group_and_exact_mass_is_one_feature_attention():
    q, k, v = gaussian((5, 3), 29), gaussian((6, 3), 30), gaussian((6, 2), 31)
    noise = gaussian((1, 3), 32)
    out = eva_reference(q, k, v, noise, num_groups=1, window=0, group_mass="exact")
    x, y = scaled(q, k)
    w = x.mean(0) + y.mean(0) + noise[0]
    xi = np.exp(y @ w - 0.5 * (y * y).sum(1))
    np.testing.assert_allclose(out, np.broadcast_to(xi @ v / xi.sum(), out.shape), rtol=1e-12)


def test_oracle_rejects_bad_arguments():
    q = gaussian((4, 3), 33)
    with pytest.raises(ValueError, match="noise"):
        eva_reference(q, q, q, gaussian((2, 2), 34), num_groups=2, window=1)
    with pytest.raises(ValueError, match="as many queries as keys"):
        eva_reference(q, q[:3], q[:3], gaussian((2, 3), 35), num_groups=2, window=1, causal=True)


# ---------------------------------------------------------------------------------------- the estimator
import torch  # noqa: E402

import kernapprox as ka  # noqa: E402
from kernapprox.approximate.eva import EfficientAttentionCV  # noqa: E402

MODES = ("parallel", "recurrent", "chunked")


def tensors(shapes, seed, std=1.0, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal(s) * std).to(dtype) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_groups, window", [(4, 0), (4, 1), (3, 3), (5, 7), (2, 20), (13, 2), (20, 0)])
@pytest.mark.parametrize("sample", [True, False])
def test_modes_match_the_oracle(causal, num_groups, window, sample):
    q, k, v = tensors([(2, 13, 5), (2, 13, 5), (2, 13, 3)], 40)
    est = EfficientAttentionCV(num_features=num_groups, window=window, sample=sample, rng=41).fit(q, k)
    ref = torch.from_numpy(eva_reference(q, k, v, est.noise_, num_groups=num_groups, window=window, causal=causal,
                                         sample=sample))
    for mode in MODES:
        for chunk in (1, 4, 64):
            out = ka.linear_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=chunk)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_fixed_group_size_matches_the_oracle(causal):
    q, k, v = tensors([(2, 13, 4), (2, 13, 4), (2, 13, 3)], 56)
    est = EfficientAttentionCV(num_features=6, group_size=3, window=2, rng=57).fit(q, k)
    ref = torch.from_numpy(eva_reference(q, k, v, est.noise_, num_groups=6, window=2, causal=causal,
                                         group_size=3))
    for mode in MODES:
        torch.testing.assert_close(ka.linear_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=4), ref,
                                   rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="num_features=6"):
        ka.linear_attention(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v.repeat(1, 2, 1), est, causal=causal)


@pytest.mark.parametrize("n_k", [7, 11, 20])
def test_non_causal_modes_with_other_key_lengths(n_k):
    q, k, v = tensors([(13, 4), (n_k, 4), (n_k, 2)], 42)
    est = EfficientAttentionCV(num_features=3, window=2, rng=43).fit(q, k)
    ref = torch.from_numpy(eva_reference(q, k, v, est.noise_, num_groups=3, window=2))
    for mode in MODES:
        torch.testing.assert_close(ka.linear_attention(q, k, v, est, mode=mode, chunk_size=4), ref,
                                   rtol=1e-10, atol=1e-12)
    kernel = torch.from_numpy(eva_kernel_reference(q, k, est.noise_, num_groups=3, window=2))
    torch.testing.assert_close(est.kernel_matrix(q, k), kernel, rtol=1e-10, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_limits(causal):
    q, k, v = tensors([(2, 12, 4), (2, 12, 4), (2, 12, 3)], 44)
    exact = ka.softmax_attention(q, k, v, causal=causal)
    for options in ({"num_features": 12, "window": 0}, {"num_features": 16, "window": 3},
                    {"num_features": 2, "window": 12}):
        est = EfficientAttentionCV(**options, rng=45).fit(q, k)
        for mode in MODES:
            torch.testing.assert_close(ka.linear_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=5),
                                       exact, rtol=1e-12, atol=1e-13)


def test_causal_modes_use_no_future_token():
    q, k, v = tensors([(11, 4), (11, 4), (11, 2)], 46)
    est = EfficientAttentionCV(num_features=3, window=2, rng=47).fit(q, k)
    for mode in MODES:
        base = ka.linear_attention(q, k, v, est, causal=True, mode=mode, chunk_size=4)
        for t in (4, 8):
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[t:], k2[t:], v2[t:] = q2[t:] * 3 + 1, k2[t:] - 2, -v2[t:]
            other = ka.linear_attention(q2, k2, v2, est, causal=True, mode=mode, chunk_size=4)
            torch.testing.assert_close(other[:t], base[:t], rtol=1e-12, atol=1e-14)


def test_far_keys_far_below_their_group_maximum():
    """Group ``[4, 8)`` whose last two keys have log-features ``l = x̄ᵀY ≈ 10⁴`` and first two ``l = 0``: a query
    whose local set covers the last two reads the first two as the group's far part. Their weights relative to
    the group's maximum underflow (``e^{−10⁴}``), so a shift per group would give 0/0; the shift per row and group
    (and the streaming state's running maximum) gives their value average. Every mode finite and equal."""
    q, k, v = tensors([(8, 2), (8, 2), (8, 1)], 48)
    direction = torch.tensor([1.0, 1.0], dtype=torch.float64)
    k[4:6] = 0.0
    k[6:8] = 70.0 * direction
    q[:] = q + 70.0 * direction
    est = EfficientAttentionCV(num_features=2, window=2, sample=False, rng=49).fit(q, k)
    for causal in (False, True):
        outs = {m: ka.linear_attention(q, k, v, est, causal=causal, mode=m, chunk_size=3) for m in MODES}
        for out in outs.values():
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, outs["parallel"], rtol=1e-10, atol=1e-12)
    # query 7 (non-causal): local set [6, 8); far keys 0..5; the logits of keys 6, 7 dominate, so its output is
    # their exact average — a sanity check that the huge terms were kept, not dropped
    out = ka.linear_attention(q, k, v, est, mode="chunked")
    torch.testing.assert_close(out[7], v[6:8].mean(0), rtol=1e-10, atol=1e-12)


def test_hostile_norms_stay_in_the_values_hull():
    q, k, v = tensors([(2, 19, 6), (2, 19, 6), (2, 19, 3)], 50)
    q, k = q * 300.0, k * 300.0
    for dtype in (torch.float64, torch.float32):
        est = EfficientAttentionCV(num_features=4, window=3, rng=51).fit(q.to(dtype), k.to(dtype))
        for causal in (False, True):
            outs = [ka.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), est, causal=causal, mode=mode,
                                        chunk_size=5) for mode in MODES]
            for out in outs:
                assert torch.isfinite(out).all()
                assert (out <= v.to(dtype).amax(-2, keepdim=True) + 1e-5).all()
                assert (out >= v.to(dtype).amin(-2, keepdim=True) - 1e-5).all()
                tol = 1e-10 if dtype == torch.float64 else 1e-3
                torch.testing.assert_close(out, outs[0], rtol=tol, atol=tol)


def test_state_bytes():
    q = tensors([(10, 4)], 54)[0]
    est = EfficientAttentionCV(num_features=8, window=5, rng=0).fit(q, q)
    # n = 100: g = 13, G = 8 groups; local set max(5, 13) tokens
    assert est.state_bytes(3, seq_len=100) == (13 * (4 + 3 + 1) + 7 * (4 + 3 + 3) + 2 * 4) * 4
    assert est.state_bytes(3, torch.float64, seq_len=4) == (4 * 8 + 3 * 10 + 8) * 8   # g = 1, local set = all
    with pytest.raises(ValueError, match="seq_len"):
        est.state_bytes(3)
    fixed = EfficientAttentionCV(num_features=8, group_size=10, window=5, rng=0).fit(q, q)
    assert fixed.state_bytes(3, seq_len=75) == (10 * 8 + 7 * 10 + 8) * 4
    with pytest.raises(ValueError, match="need 9 groups"):
        fixed.state_bytes(3, seq_len=90)


def test_rejects_bad_arguments():
    q, k, v = tensors([(6, 4), (6, 4), (6, 2)], 55)
    with pytest.raises(ValueError, match="window"):
        EfficientAttentionCV(num_features=3, window=-1)
    with pytest.raises(ValueError, match="window"):
        EfficientAttentionCV(num_features=3, window=2.5)
    with pytest.raises(TypeError, match="sample"):
        EfficientAttentionCV(num_features=3, sample="yes")
    with pytest.raises(ValueError, match="group_size"):
        EfficientAttentionCV(num_features=3, group_size=0)
    est = EfficientAttentionCV(num_features=3, rng=0).fit(q, k)
    with pytest.raises(ValueError, match="as many queries as keys"):
        ka.linear_attention(q, k[:4], v[:4], est, causal=True)


def test_parameter_bytes_are_the_noise():
    q = tensors([(10, 4)], 58)[0]
    assert EfficientAttentionCV(num_features=5, rng=0).fit(q, q).parameter_bytes(torch.float64) == 5 * 4 * 8
    assert EfficientAttentionCV(num_features=5, sample=False).fit(q, q).parameter_bytes() == 0
