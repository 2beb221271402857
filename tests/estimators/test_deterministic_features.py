"""Deterministic maps (Taylor-2, ELU+1, DPFP) and random Maclaurin features: exact identities, known values,
unbiasedness within z·SE (z = 4.5), the closed-form variance, and agreement of the three attention modes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox import theory
from kernapprox.estimators.deterministic import DPFPFeatures, EluPlusOneFeatures, TaylorFeatures
from kernapprox.estimators.maclaurin import RandomMaclaurinFeatures
from kernapprox.metrics import relative_rms_error

Z = 4.5


def randn(shape, seed, std=1.0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape) * std)


# ------------------------------------------------------------------------------------------------- Taylor-2
@pytest.mark.parametrize(("form", "dim"), [("packed", lambda d: 1 + d + d * (d + 1) // 2),
                                           ("full", lambda d: 1 + d + d * d)])
@pytest.mark.parametrize("d", [1, 5, 16])
def test_taylor_identity_is_exact(form, dim, d):
    q, k = randn((2, 7, d), 0, 1.5), randn((2, 9, d), 1, 1.5)
    est = TaylorFeatures(form=form).fit(q, k)
    assert est.num_features == dim(d)
    assert est.features(q, "query").shape == (2, 7, dim(d))
    t = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    poly = 1 + t + t * t / 2
    torch.testing.assert_close(est.kernel_matrix(q, k), poly, rtol=1e-14, atol=1e-14)
    phi_q, phi_k = est.features(q, "query"), est.features(k, "key")         # exact-scale features, same identity
    torch.testing.assert_close(phi_q @ phi_k.transpose(-1, -2), poly, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(est.features(q, "key"), phi_q, rtol=0, atol=0)   # symmetric map


def test_taylor_known_values_and_truncation_error():
    est = TaylorFeatures(scale=1.0).fit(torch.zeros(1, 3, dtype=torch.float64))
    x = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    expected = [1, 1, 2, -1, 1 / math.sqrt(2), 4 / math.sqrt(2), 1 / math.sqrt(2), 2, -1, -2]
    torch.testing.assert_close(est.features(x)[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    # minimum of 1 + t + t²/2 is 1/2 at t = −1: the kernel (hence every normaliser) is positive
    y = -x / 6.0                                                              # t = xᵀy = −1
    assert float(est.kernel_matrix(x, y)) == pytest.approx(0.5, abs=1e-15)
    # Lagrange remainder: |e^t − (1 + t + t²/2)| ≤ |t|³/6 · e^{max(t, 0)}
    q, k = randn((40, 4), 2, 0.6), randn((40, 4), 3, 0.6)
    t = q @ k.T
    err = (ka.kernel_matrix(q, k, 1.0) - est.fit(q).kernel_matrix(q, k)).abs()
    assert bool((err <= t.abs() ** 3 / 6 * torch.exp(t.clamp_min(0)) * (1 + 1e-12) + 1e-15).all())


# -------------------------------------------------------------------------------------------- ELU+1 and DPFP
def test_elu_plus_one_values_and_kernel():
    x = torch.tensor([[0.0, -30.0, 2.0, -1.0]], dtype=torch.float64)
    est = EluPlusOneFeatures(scale=1.0).fit(x)
    assert est.num_features == 4 and EluPlusOneFeatures.positive and not EluPlusOneFeatures.unbiased
    torch.testing.assert_close(est.features(x)[0], torch.tensor([1.0, math.exp(-30.0), 3.0, math.exp(-1.0)],
                                                               dtype=torch.float64), rtol=1e-15, atol=0)
    q, k = randn((5, 4), 4), randn((6, 4), 5)
    scaled = EluPlusOneFeatures().fit(q)                                      # default scale 1/sqrt(d) first
    fq = torch.nn.functional.elu(q / math.sqrt(2.0)) + 1                      # sqrt(1/sqrt(4)) = 1/sqrt(2)
    fk = torch.nn.functional.elu(k / math.sqrt(2.0)) + 1
    torch.testing.assert_close(scaled.kernel_matrix(q, k), fq @ fk.T, rtol=1e-14, atol=0)


def test_dpfp_by_hand():
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)                    # u = [1, 0, 0, 2]
    one = DPFPFeatures(nu=1, scale=1.0).fit(x)
    two = DPFPFeatures(nu=2, scale=1.0).fit(x)
    assert one.num_features == 4 and two.num_features == 8
    torch.testing.assert_close(one.features(x)[0], torch.tensor([2.0, 0, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(two.features(x)[0], torch.tensor([2.0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    y = torch.tensor([[3.0, 1.0]], dtype=torch.float64)                     # u = [3, 1, 0, 0]
    torch.testing.assert_close(two.features(y)[0], torch.tensor([0, 3.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    assert float(two.kernel_matrix(x, y)) == 0.0                              # a normaliser can vanish exactly
    with pytest.raises(ValueError, match="nu"):
        DPFPFeatures(nu=4).fit(x)                                             # 2d − 1 = 3
    with pytest.raises(TypeError, match="nu"):
        DPFPFeatures(nu=1.5)


# ---------------------------------------------------------------------------------------- random Maclaurin
def test_maclaurin_features_equal_the_direct_product():
    """The log-domain segment product (signs, zeros, degree 0) equals Π_j w_jᵀx computed directly."""
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0], [0.5, 0.25, -3.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    est = RandomMaclaurinFeatures(num_features=300, p=1.6, rng=0, scale=1.0).fit(x)
    assert est.degrees_.max() >= 4 and (est.degrees_ == 0).any()
    proj = x.numpy() @ est.weights_.T
    direct = np.empty((3, 300))
    for i in range(300):
        rows = est.feature_index_ == i
        direct[:, i] = np.exp(est.log_coefficients_[i]) * np.prod(proj[:, rows], axis=1)
    assert (direct[0] == 0).any()                                             # wᵀx = 0 occurs for this x
    torch.testing.assert_close(est.features(x), torch.from_numpy(direct / math.sqrt(300)), rtol=1e-12, atol=1e-300)


def test_maclaurin_degree_distribution():
    est = RandomMaclaurinFeatures(num_features=20_000, p=3.0, rng=1).fit(torch.zeros(1, 2, dtype=torch.float64))
    mean, sd = 1 / (3.0 - 1), math.sqrt(3.0) / (3.0 - 1)                      # geometric on {0,1,…}, ratio 1/3
    assert abs(est.degrees_.mean() - mean) < Z * sd / math.sqrt(20_000)
    trunc = RandomMaclaurinFeatures(num_features=20_000, p=1.5, max_degree=3, rng=2).fit(torch.zeros(1, 2))
    probs = 1.5 ** -np.arange(4.0)
    probs /= probs.sum()
    counts = np.bincount(trunc.degrees_, minlength=4)
    assert counts.size == 4
    assert np.all(np.abs(counts / 20_000 - probs) < Z * np.sqrt(probs * (1 - probs) / 20_000))


def test_maclaurin_variance_closed_form_by_enumeration():
    """c = E[(wᵀx)²(wᵀy)²] over all 2^d Rademacher vectors, and the series against the Bessel form."""
    gen = np.random.default_rng(3)
    d = 5
    x, y = 0.7 * gen.standard_normal(d), 0.7 * gen.standard_normal(d)
    w = np.array(list(itertools.product([-1.0, 1.0], repeat=d)))
    c = float(np.mean((w @ x) ** 2 * (w @ y) ** 2))
    p = 2.5
    m2 = sum(p / (p - 1) * (p * c) ** n / math.factorial(n) ** 2 for n in range(60))
    mean, var = theory.maclaurin_variance(x, y, 1, p=p)
    assert mean == pytest.approx(math.exp(x @ y), rel=1e-14)
    assert var == pytest.approx(m2 - math.exp(2 * x @ y), rel=1e-12)
    mean_t, var_t = theory.maclaurin_variance(x, y, 1, p=p, max_degree=2)
    t = x @ y
    assert mean_t == pytest.approx(1 + t + t * t / 2, rel=1e-14)
    z_t = sum(p**-n for n in range(3))
    assert var_t == pytest.approx(z_t * sum((p * c) ** n / math.factorial(n) ** 2 for n in range(3)) - mean_t**2,
                                  rel=1e-12)


@pytest.mark.parametrize("max_degree", [None, 2])
def test_maclaurin_unbiased_and_variance_matches(max_degree):
    """Untruncated: unbiased for exp. Truncated at 2: unbiased for 1 + t + t²/2 and visibly biased for exp."""
    x = torch.tensor([[0.9, 0.6, -0.3]], dtype=torch.float64)
    y = torch.tensor([[0.8, 0.9, 0.4]], dtype=torch.float64)                # t = 1.14
    m = 100_000
    est = RandomMaclaurinFeatures(num_features=m, max_degree=max_degree, rng=4, scale=1.0).fit(x, y)
    prods = (est.features(x, "query") * est.features(y, "key"))[0].numpy() * m
    mean, var = theory.maclaurin_variance(x.numpy()[0], y.numpy()[0], 1, max_degree=max_degree)
    se = prods.std() / math.sqrt(m)
    assert abs(prods.mean() - mean) < Z * se
    c = prods - prods.mean()
    assert abs((c**2).mean() - var) < Z * math.sqrt(((c**4).mean() - (c**2).mean() ** 2) / m)
    t = float(x @ y.T)
    if max_degree is None:
        assert mean == pytest.approx(math.exp(t))
        assert est.unbiased
    else:
        assert not est.unbiased
        assert abs(prods.mean() - math.exp(t)) > 10 * se                     # truncation bias t³/6 + … ≈ 0.28


def test_maclaurin_invalid_options():
    with pytest.raises(ValueError, match="p must"):
        RandomMaclaurinFeatures(num_features=4, p=1.0)
    with pytest.raises(TypeError, match="max_degree"):
        RandomMaclaurinFeatures(num_features=4, max_degree=2.0)
    with pytest.raises(ValueError, match="max_degree"):
        RandomMaclaurinFeatures(num_features=4, max_degree=-1)
    with pytest.raises(ValueError, match="p must"):
        theory.maclaurin_variance(np.ones(2), np.ones(2), 1, p=0.5)


# ------------------------------------------------------------------------------------------------- modes
MAPS = {
    "taylor2": lambda: ka.make_estimator("taylor2"),
    "taylor2_based": lambda: ka.make_estimator("taylor2_based"),
    "elu1": lambda: ka.make_estimator("elu1"),
    "dpfp": lambda: DPFPFeatures(nu=3),
    "maclaurin": lambda: ka.make_estimator("maclaurin", num_features=64, rng=5),
}


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", list(MAPS))
def test_three_modes_agree_with_the_float64_oracle(name, causal):
    q, k = randn((2, 17, 6), 6, 0.8), randn((2, 17, 6), 7, 0.8)
    if name == "dpfp":
        q, k = q.abs() + 0.1, k.abs() + 0.1                                   # overlapping supports: κ > 0
    v = randn((2, 17, 3), 8)
    est = MAPS[name]().fit(q, k)
    oracle = ka.linear_attention_naive(q, k, v, est, causal=causal)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=5)
        assert float(relative_rms_error(out, oracle).max()) < 1e-10, mode


def test_registered_properties():
    for name in ("taylor2", "taylor2_based", "elu1"):
        cls = ka.estimator_class(name)
        assert not cls.unbiased and not cls.data_dependent and cls.causal_fit
    assert ka.make_estimator("maclaurin", num_features=4).unbiased
    assert not ka.estimator_class("maclaurin").positive
