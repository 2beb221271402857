"""Random-feature maps: unbiasedness per map × sampler, the biased samplers detected, reproducibility, contract.

Statistical tests compare a Monte-Carlo mean over independent draws (one seed per draw) with the exact kernel,
using the sample standard error. Family-wise error control: Bonferroni over every (map, sampler, entry) case.
"""

import math

import numpy as np
import pytest
import scipy.special as sp
import scipy.stats as st
import torch

import kernapprox as ka
from kernapprox.estimators import HyperbolicFeatures, PositiveFeatures, TrigonometricFeatures

MAPS = ("trig", "positive", "hyperbolic")
UNBIASED_SAMPLERS = ("iid", "orthogonal", "qmc")
NUM_DRAWS = 1000          # independent fits (seeds) per case
NUM_FEATURES = 8          # r: 4 frequencies for trig/hyperbolic, 8 for positive (d = 6: one full orthogonal block)
DIM = 6


def _registry_name(map_name, sampler):
    return map_name if sampler == "iid" else f"{map_name}_{sampler}"


def _points():
    """4 queries and 5 keys with ‖x‖ ≈ 0.5, so ‖x+y‖² ≲ 1.5: the per-draw estimates are mildly skewed and the
    normal approximation of the mean over 1000 draws holds far into the tails."""
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(4, DIM, generator=g, dtype=torch.float64) * 0.22
    k = torch.randn(5, DIM, generator=g, dtype=torch.float64) * 0.22
    return q, k


def _draws(name, q, k, num_draws=NUM_DRAWS, **options):
    """``(num_draws, n_q, n_k)`` kernel estimates, draw ``s`` from ``rng=s`` (independent seeds)."""
    return torch.stack([
        ka.make_estimator(name, num_features=NUM_FEATURES, rng=seed, scale=1.0, **options).fit(q).kernel_matrix(q, k)
        for seed in range(num_draws)
    ])


NUM_UNBIASED_TESTS = len(MAPS) * len(UNBIASED_SAMPLERS) * 4 * 5
FAMILY_ALPHA = 1e-3
# Bonferroni: two-sided per-entry level FAMILY_ALPHA / NUM_UNBIASED_TESTS -> z ≈ 4.5
Z_FAMILY = float(st.norm.isf(FAMILY_ALPHA / NUM_UNBIASED_TESTS / 2))


@pytest.mark.parametrize("sampler", UNBIASED_SAMPLERS)
@pytest.mark.parametrize("map_name", MAPS)
def test_kernel_estimate_is_unbiased(map_name, sampler):
    q, k = _points()
    est = ka.make_estimator(_registry_name(map_name, sampler), num_features=NUM_FEATURES, rng=0)
    assert est.unbiased
    exact = ka.kernel_matrix(q, k, scale=1.0)
    draws = _draws(_registry_name(map_name, sampler), q, k)
    mean = draws.mean(0)
    se = draws.std(0) / math.sqrt(NUM_DRAWS)
    assert bool((se > 0).all())
    z = (mean - exact) / se
    assert float(z.abs().max()) < Z_FAMILY, f"max |z| = {float(z.abs().max()):.2f} ≥ {Z_FAMILY:.2f}"
    # the check has power: the Monte-Carlo mean is within a few percent of the kernel
    assert float(((mean - exact) / exact).abs().max()) < 0.05


def _sphere_expectation(kind, radius, norm, dim):
    """``E f(ωᵀz)`` for ω uniform on the sphere of radius ``radius`` in R^dim, ‖z‖ = ``norm``:
    ``Γ(ν+1) (2/s)^ν I_ν(s)`` for ``f = exp`` or ``cosh`` and ``Γ(ν+1) (2/s)^ν J_ν(s)`` for ``f = cos``,
    with ``s = radius·norm``, ``ν = d/2 − 1`` (the characteristic function of the uniform law on the sphere)."""
    nu = dim / 2 - 1
    s = radius * norm
    bessel = sp.iv(nu, s) if kind in ("exp", "cosh") else sp.jv(nu, s)
    return sp.gamma(nu + 1) * (2 / s) ** nu * bessel


@pytest.mark.parametrize("map_name", MAPS)
def test_regularized_sampler_bias_is_detected(map_name):
    """SMREG (every row rescaled to norm sqrt(d)) is biased: Performer Theorem 1, biased low for the positive
    maps. Its expectation has a closed form (rows are uniform on the sphere of radius sqrt(d)); the Monte-Carlo
    mean matches that form and misses the exact kernel by many standard errors."""
    x = torch.zeros(1, DIM, dtype=torch.float64)
    x[0, 0] = 1.0
    y = x.clone() if map_name != "trig" else -x.clone()   # trig's bias depends on x − y, the others' on x + y
    draws = _draws(f"{map_name}_regularized", x, y, num_draws=2000)[:, 0, 0]
    assert not ka.make_estimator(f"{map_name}_regularized", num_features=NUM_FEATURES).unbiased
    mean, se = float(draws.mean()), float(draws.std()) / math.sqrt(len(draws))
    exact = math.exp(float(x[0] @ y[0]))
    if map_name == "trig":
        prefactor = math.exp(0.5 * float(x.square().sum() + y.square().sum()))
        expected = prefactor * _sphere_expectation("cos", math.sqrt(DIM), float((x - y).norm()), DIM)
    else:
        prefactor = math.exp(-0.5 * float(x.square().sum() + y.square().sum()))
        expected = prefactor * _sphere_expectation("exp", math.sqrt(DIM), float((x + y).norm()), DIM)
    assert abs(mean - expected) < Z_FAMILY * se, (mean, expected, se)
    assert abs(mean - exact) > 10 * se, (mean, exact, se)
    if map_name != "trig":
        assert mean < exact  # Theorem 1: SMREG ≤ SM


def test_sampler_rows_have_gaussian_marginals():
    """The unbiased samplers give rows whose coordinates are N(0, 1) (checked by a KS test on 4096 values per
    sampler, Bonferroni over 3 samplers at family level 1e-3); the regularized rows all have norm sqrt(d)."""
    rng = np.random.default_rng(7)
    for name in UNBIASED_SAMPLERS:
        w = ka.estimators.make_sampler(name).sample(1024, 4, rng)
        assert w.shape == (1024, 4) and w.dtype == np.float64
        assert st.kstest(w.ravel(), "norm").pvalue > 1e-3 / 3, name
    w = ka.estimators.make_sampler("orthogonal").sample(8, 8, rng)
    directions = w / np.linalg.norm(w, axis=1, keepdims=True)
    np.testing.assert_allclose(directions @ directions.T, np.eye(8), atol=1e-12)
    w = ka.estimators.make_sampler("regularized").sample(12, 8, rng)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), math.sqrt(8), rtol=1e-12)


# -------------------------------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("name", ["trig", "positive_orthogonal", "hyperbolic_qmc", "positive_sorf",
                                  "trig_regularized"])
def test_float32_and_float64_fits_share_one_draw(name):
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(2, 7, 12, generator=g, dtype=torch.float64) * 0.5
    x32 = x64.float()
    est64 = ka.make_estimator(name, num_features=32, rng=11).fit(x64)
    est32 = ka.make_estimator(name, num_features=32, rng=11).fit(x32)
    np.testing.assert_array_equal(est64.projection_, est32.projection_)
    assert est64.projection_.dtype == np.float64
    f64, f32 = est64.features(x64, "query"), est32.features(x32, "key")
    assert f32.dtype == torch.float32 and f64.dtype == torch.float64
    torch.testing.assert_close(f32.double(), f64, rtol=1e-5, atol=1e-6)


def test_same_seed_gives_identical_features_and_refit_reproduces():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 5, generator=g)
    a = ka.make_estimator("positive_orthogonal", num_features=16, rng=5).fit(x)
    b = ka.make_estimator("positive_orthogonal", num_features=16, rng=5).fit(x)
    assert torch.equal(a.features(x), b.features(x))
    first = a.features(x)
    a.fit(x)                                   # an int seed is re-expanded on every fit
    assert torch.equal(a.features(x), first)
    c = ka.make_estimator("positive_orthogonal", num_features=16, rng=6).fit(x)
    assert not torch.equal(c.features(x), first)
    gen = np.random.default_rng(5)             # a Generator advances: two fits, two draws
    d = ka.make_estimator("positive_orthogonal", num_features=16, rng=gen).fit(x)
    first_gen = d.projection_.copy()
    d.fit(x)
    assert not np.array_equal(first_gen, d.projection_)
    e = ka.make_estimator("positive_orthogonal", num_features=16, rng=np.random.SeedSequence(5)).fit(x)
    e2 = ka.make_estimator("positive_orthogonal", num_features=16, rng=np.random.SeedSequence(5)).fit(x)
    np.testing.assert_array_equal(e.projection_, e2.projection_)


# -------------------------------------------------------------------------------------------------- contract
CONTRACT = [  # (class, num_features, frequencies, positive)
    (TrigonometricFeatures, 10, 5, False),
    (PositiveFeatures, 10, 10, True),
    (HyperbolicFeatures, 10, 5, True),
]


@pytest.mark.parametrize("cls,r,m,positive", CONTRACT, ids=[c[0].__name__ for c in CONTRACT])
def test_feature_map_contract(cls, r, m, positive):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 11, 6, generator=g, dtype=torch.float64)
    est = cls(num_features=r, rng=0).fit(x)
    assert est.num_features == r and est.num_frequencies == m and est.projection_.shape == (m, 6)
    assert est.positive is positive and est.reference
    phi = est.features(x, "query")
    assert phi.shape == (2, 3, 11, r) and phi.dtype == torch.float64
    tilde, log_scale = est.features(x, "key", log_scale=True)
    assert tilde.shape == (2, 3, 11, r) and log_scale.shape == (2, 3, 11)
    torch.testing.assert_close(tilde * log_scale.exp()[..., None], est.features(x, "key"), rtol=1e-12, atol=0)
    if positive:
        assert bool((phi > 0).all())
        assert float(tilde.amax(-1).min()) == 1.0  # stabilised: the largest entry of each row is exp(0)
    gram = est.kernel_matrix(x, x)
    torch.testing.assert_close(gram, phi @ phi.transpose(-1, -2), rtol=1e-10, atol=0)
    assert est.state_bytes(7, torch.float32) == r * 8 * 4
    assert est.state_bytes(7, torch.float64) == r * 8 * 8


def test_default_scale_is_sdpa_scale():
    """Features apply sqrt(s) to q and k with s = 1/sqrt(d) by default, so φ(q)ᵀφ(k) estimates exp(qᵀk/sqrt(d))."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(3, 16, generator=g, dtype=torch.float64)
    est_default = ka.make_estimator("positive", num_features=8, rng=1).fit(q)
    est_explicit = ka.make_estimator("positive", num_features=8, rng=1, scale=0.25).fit(q)
    assert est_default.scale_ == 0.25
    torch.testing.assert_close(est_default.features(q), est_explicit.features(q), rtol=0, atol=0)
    scaled = ka.make_estimator("positive", num_features=8, rng=1, scale=1.0).fit(q)
    torch.testing.assert_close(est_default.features(q), scaled.features(q * 0.5), rtol=1e-15, atol=0)


def test_convergence_in_num_features():
    """The kernel error falls like r^{-1/2}: from r = 16 to r = 4096 the relative Frobenius error (mean over 5
    seeds) falls by a factor near 16; we ask for more than 5."""
    g = torch.Generator().manual_seed(10)
    q = torch.randn(20, 8, generator=g, dtype=torch.float64) * 0.6
    exact = ka.kernel_matrix(q, q)
    for name in MAPS:
        errs = {}
        for r in (16, 4096):
            errs[r] = np.mean([
                float(ka.metrics.relative_frobenius_error(
                    ka.make_estimator(name, num_features=r, rng=s).fit(q).kernel_matrix(q, q), exact))
                for s in range(5)
            ])
        assert errs[4096] < errs[16] / 5, (name, errs)


def test_estimator_table_lists_every_registered_estimator():
    from kernapprox.estimators.registry import estimator_table

    table = estimator_table().splitlines()
    header = "| name | class | kind | unbiased | positive | data_dependent | causal_fit | consistent |"
    assert table[0].startswith(header)
    rows = {line.split("|")[1].strip().strip("`"): line for line in table[2:]}
    assert set(rows) == set(ka.available_estimators())
    assert "| `PositiveFeatures(sampler='orthogonal')` | features | yes | yes | no | yes | yes |" in rows[
        "positive_orthogonal"]
    assert "| `TrigonometricFeatures(sampler='regularized')` | features | no | no | no | yes | no |" in rows[
        "trig_regularized"]
