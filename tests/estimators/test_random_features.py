"""Random-feature maps: sampler marginals, reproducibility, contract.

Unbiasedness (every map × sampler, with stated power) is tested in ``tests/estimators/test_unbiasedness.py``.
"""

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

import kernapprox as ka
from kernapprox.estimators import HyperbolicFeatures, PositiveFeatures, TrigonometricFeatures

MAPS = ("trig", "positive", "hyperbolic")
UNBIASED_SAMPLERS = ("iid", "orthogonal", "qmc")
DIM = 6


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
