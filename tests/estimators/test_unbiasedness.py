"""Unbiasedness of the kernel estimate, with the power to see a 2 % bias at moderate norms.

An estimator's mean is the mean of its per-frequency products over the law of one projection row (linearity), so
the test reads those products off the library's own features and splits the question in three:

1. The samplers (``test_sampler_law``): positive and trig maps with every sampler, one fit with ``2^20`` (positive)
   or ``2^18`` (trig) rows in ``d = 4``, at two pairs with ``‖x+y‖² = ‖x−y‖² = 1`` and ``= 2``. The standard error
   is never the sample's: i.i.d. rows have the Lemma-2 variance per row (:mod:`kernapprox.theory`);
   orthogonal positive rows have the exact variance of a block (:func:`kernapprox.theory.positive_error_moments`);
   for the other block samplers (orthogonal trig, SMREG, SORF, sorf_chi) the blocks are independent and, if each
   row is marginally ``N(0, I_d)``, ``Var(block mean) ≤ Var(one row)`` (Cauchy–Schwarz), the Lemma-2 value — a
   valid bound under the null hypothesis of unbiasedness. Scrambled Sobol points are dependent within a
   sequence and no closed form exists for their variance: ``qmc`` uses 256 independent scrambles of 4096 points,
   and the sample standard deviation of those 256 means (each an average of 4096 light-tailed values).
2. The estimator code (``test_estimator_code``): every declared-unbiased feature map with i.i.d. rows, one fit with
   ``2^18`` frequencies, against its closed-form per-frequency variance (Lemma 2, the GERF/DERF second moments with
   the fitted parameters, the Maclaurin variance); data-dependent maps are fitted on a calibration set first.
3. The composition (``test_sampler_variants_use_the_sampler_rows``): every declared-unbiased registry name with a
   sampler uses exactly that sampler's rows, and the declared-unbiased hybrids equal their feature map off the
   exact band. With 1 and 2 this proves every declared-unbiased estimator unbiased at this power, except those
   listed in ``COVERED_ELSEWHERE`` with the reason (a test keeps the list complete).

Decision rule: ``|mean − SM| / SE < Z_CRIT`` (Bonferroni over every z-score of this module at family level
1e-3). Power: a relative bias ``b`` is detected with probability ≥ 99 % when ``b ≥ (Z_CRIT + z_0.99)·SE/SM``; each
test computes that smallest detectable bias and asserts it is ≤ 2 % at ``‖x+y‖² = 1``. Measured (seeds fixed
below): detectable bias 0.85 % (positive, iid), 1.9 % (positive, block bound), 0.09 % (positive, qmc); SMREG and
SORF are rejected at 13–70 standard errors (their means match the sphere closed form: 0.965 at ``‖x+y‖² = 1``);
sorf_chi's bias stays below the resolution (ratios 0.997–1.010).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st
import torch

import kernapprox as ka
from kernapprox import theory
from kernapprox.estimators import registry

D = 4
NUM_Z = 64                                   # z-scores asserted in this module (upper bound), for Bonferroni
Z_CRIT = float(st.norm.isf(1e-3 / NUM_Z / 2))
Z_POWER = float(st.norm.isf(0.01))
REQUIRED_BIAS = 0.02


def _pair(sum2, diff2, seed):
    """``x, y ∈ R^D`` with ``‖x+y‖² = sum2``, ``‖x−y‖² = diff2`` (``x+y ⊥ x−y``), random orientation."""
    basis, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, 2)))
    z, delta = math.sqrt(sum2) * basis[:, 0], math.sqrt(diff2) * basis[:, 1]
    return (z + delta) / 2, (z - delta) / 2


PAIRS = [_pair(1.0, 1.0, 0), _pair(2.0, 2.0, 1)]          # the first is the "moderate norm" of the power claim
X = torch.tensor(np.stack([p[0] for p in PAIRS]))
Y = torch.tensor(np.stack([p[1] for p in PAIRS]))
KERNEL = np.exp((X * Y).sum(-1).numpy())


def detectable_bias(se_rel):
    """Smallest relative bias the rule detects with probability ≥ 99 %."""
    return (Z_CRIT + Z_POWER) * se_rel


def per_frequency_products(est, x, y):
    """``(n_pairs, m)`` one-frequency estimates ``g_j`` (their mean is the estimate ``φ(x)ᵀφ(y)``)."""
    prod = (est.features(x, "query") * est.features(y, "key")).numpy()
    r = prod.shape[1]
    per_frequency = getattr(type(est), "features_per_frequency", 1)   # sin/cos or exp(±) pairs: j and j + m
    m = r // per_frequency
    return m * (prod[:, :m] + prod[:, m:]) if per_frequency == 2 else m * prod


def row_variance(map_name, x, y):
    """Lemma 2: the variance of one per-frequency product with a Gaussian row."""
    fn = {"trig": theory.trig_mse, "positive": theory.positive_mse, "hyperbolic": theory.hyperbolic_mse}[map_name]
    return np.array([fn(x[i], y[i], 1) for i in range(len(x))])


def fit(name, num_features, rng, q=None, k=None):
    q = torch.zeros(1, D, dtype=torch.float64) if q is None else q
    return ka.make_estimator(name, num_features=num_features, rng=rng, scale=1.0).fit(q, k)


# --------------------------------------------------------------------------------------------- 1. samplers
ROWS = {"positive": 2**20, "trig": 2**18}         # frequencies in one fit (D divides them: whole blocks)
UNBIASED_SAMPLERS = ("iid", "orthogonal", "qmc")
BIASED_SAMPLERS = ("regularized", "sorf")
QMC_SCRAMBLES, QMC_POINTS = 256, 4096


def _sampler_mean_and_se(map_name, sampler):
    """Mean estimate per pair and its standard error (closed form or bound, see the module notes)."""
    name = map_name if sampler == "iid" else f"{map_name}_{sampler}"
    per_frequency = 2 if map_name == "trig" else 1
    x, y = X.numpy(), Y.numpy()
    if sampler == "qmc":
        seeds = np.random.SeedSequence(2024).spawn(QMC_SCRAMBLES)
        means = np.stack([per_frequency_products(fit(name, per_frequency * QMC_POINTS, s), X, Y).mean(1)
                          for s in seeds])
        return means.mean(0), means.std(0, ddof=1) / math.sqrt(QMC_SCRAMBLES)
    m = ROWS[map_name]
    g = per_frequency_products(fit(name, per_frequency * m, 11), X, Y)
    if sampler == "iid":
        return g.mean(1), np.sqrt(row_variance(map_name, x, y) / m)
    blocks = m // D
    if sampler == "orthogonal" and map_name == "positive":
        block_var = np.array([theory.positive_error_moments(x[i], y[i], D)[0] for i in range(len(x))])
        return g.mean(1), np.sqrt(block_var / blocks)
    return g.mean(1), np.sqrt(row_variance(map_name, x, y) / blocks)     # Cauchy–Schwarz bound per block


@pytest.mark.parametrize("sampler", [*UNBIASED_SAMPLERS, *BIASED_SAMPLERS, "sorf_chi"])
@pytest.mark.parametrize("map_name", ["positive", "trig"])
def test_sampler_law(map_name, sampler):
    name = map_name if sampler == "iid" else f"{map_name}_{sampler}"
    mean, se = _sampler_mean_and_se(map_name, sampler)
    ratio, se_rel = mean / KERNEL, se / KERNEL
    z = (mean - KERNEL) / se
    print(f"\n{name}: mean/SM {np.round(ratio, 4)}, z {np.round(z, 1)}, detectable bias "
          f"{np.round(detectable_bias(se_rel), 4)}")
    assert detectable_bias(se_rel[0]) <= REQUIRED_BIAS                   # power at ‖x+y‖² = 1
    declared = registry.capabilities(name).unbiased
    if sampler in UNBIASED_SAMPLERS:
        assert declared
        assert (np.abs(z) < Z_CRIT).all(), z
    elif sampler in BIASED_SAMPLERS:
        assert not declared
        assert (np.abs(z) > Z_CRIT).all(), z                              # the bias is detected at both pairs
        if sampler == "regularized":                                     # and it is the sphere closed form's
            norm2 = ((X - Y) if map_name == "trig" else (X + Y)).square().sum(-1).numpy()
            closed = theory.regularized_mean_ratio(norm2, D, kind=map_name)
            assert (np.abs(ratio - closed) < Z_CRIT * se_rel).all(), (ratio, closed)
    else:                                                               # sorf_chi: declared biased (SORF directions)
        assert not declared
        assert (np.abs(ratio - 1.0) < REQUIRED_BIAS).all(), ratio         # measured 0.997–1.010: below 2 %


# ----------------------------------------------------------------------------------------- 2. estimator code
def _iid_unbiased_feature_maps():
    names = []
    for name in ka.available_estimators():
        caps = ka.capabilities(name)
        if caps.kind == "features" and caps.unbiased and registry.registered_options(name).get("sampler", "iid") \
                == "iid":
            names.append(name)
    return names


def _calibration():
    """Anisotropic calibration tokens for the data-dependent maps (fitted once, then fixed)."""
    gen = np.random.default_rng(5)
    scales = np.array([0.7, 0.5, 0.35, 0.25])
    q = torch.tensor(gen.standard_normal((64, D)) * scales)
    k = torch.tensor(gen.standard_normal((64, D)) * scales[::-1])
    return q, k


def _closed_form_variance(name, est, x, y):
    """Variance of one per-frequency product of the fitted ``est`` at each pair (numpy ``(n_pairs,)``)."""
    family = name.split("_")[0]
    if family in ("trig", "positive", "hyperbolic"):
        return row_variance(family, x, y)
    if family == "maclaurin":
        return np.array([theory.maclaurin_variance(x[i], y[i], 1, p=est.p)[1] for i in range(len(x))])
    # GERF/OPRF/SDERF/SADERF/ADERF: a per-coordinate GERF with exponents α of T₁x and T₂y (T₁ᵀT₂ = I)
    alpha = est.alpha_
    t1 = np.eye(D) if est.query_transform_ is None else est.query_transform_
    t2 = np.eye(D) if est.key_transform_ is None else est.key_transform_
    b = np.diag(np.sqrt(1.0 - 4.0 * alpha))
    return np.array([theory.derf_variance(t1 @ x[i], t2 @ y[i], np.diag(alpha), b, b, 1) for i in range(len(x))])


CODE_FREQUENCIES = 2**18


@pytest.mark.parametrize("name", _iid_unbiased_feature_maps())
def test_estimator_code(name):
    q, k = _calibration()
    per_frequency = 2 if name.split("_")[0] in ("trig", "hyperbolic") else 1
    est = fit(name, per_frequency * CODE_FREQUENCIES, 12, q, k)
    g = per_frequency_products(est, X, Y)
    se = np.sqrt(_closed_form_variance(name, est, X.numpy(), Y.numpy()) / CODE_FREQUENCIES)
    z = (g.mean(1) - KERNEL) / se
    print(f"\n{name}: mean/SM {np.round(g.mean(1) / KERNEL, 5)}, z {np.round(z, 1)}, detectable bias "
          f"{np.round(detectable_bias(se / KERNEL), 4)}")
    assert detectable_bias(se[0] / KERNEL[0]) <= REQUIRED_BIAS
    assert (np.abs(z) < Z_CRIT).all(), z
    # the closed-form variance is the one the draws have (a wrong variance would make the rule meaningless)
    sample_var = g.var(1, ddof=1)
    np.testing.assert_allclose(sample_var, se**2 * CODE_FREQUENCIES, rtol=0.25)


def test_the_rule_rejects_a_two_percent_bias():
    """The same rule applied to the i.i.d. positive estimate multiplied by 0.98 rejects at ‖x+y‖² = 1."""
    mean, se = _sampler_mean_and_se("positive", "iid")
    z = (0.98 * mean - KERNEL) / se
    assert abs(z[0]) > Z_CRIT, z


# -------------------------------------------------------------------------------------------- 3. composition
def _unbiased_with_sampler():
    return [name for name in ka.available_estimators()
            if ka.capabilities(name).unbiased and "sampler" in registry.registered_options(name)]


@pytest.mark.parametrize("name", _unbiased_with_sampler())
def test_sampler_variants_use_the_sampler_rows(name):
    """The fitted projection is the sampler's draw from the estimator's rng, unchanged (so the estimator's mean
    is that of its i.i.d. variant whenever the sampler's rows are marginally Gaussian)."""
    sampler = registry.registered_options(name)["sampler"]
    q, k = _calibration()
    est = ka.make_estimator(name, num_features=16, rng=3).fit(q, k)
    expected = ka.estimators.make_sampler(sampler).sample(est.num_frequencies, D, np.random.default_rng(3))
    np.testing.assert_array_equal(est.projection_, expected)


def _unbiased_hybrids():
    return [name for name in ka.available_estimators()
            if ka.capabilities(name).unbiased and "feature_map" in registry.registered_options(name)]


# Declared-unbiased estimators whose unbiasedness is tested elsewhere, with the reason (see the coverage test).
COVERED_ELSEWHERE = {
    "lara_balance": "tests/approximate/test_lara.py: the implied kernel of multiple importance sampling with "
                    "data-dependent proposals has no closed-form variance here",
    "exact": "the exact kernel",
}


def test_every_declared_unbiased_estimator_is_covered():
    covered = set(_iid_unbiased_feature_maps()) | set(_unbiased_with_sampler()) | set(_unbiased_hybrids())
    declared = {name for name in ka.available_estimators() if ka.capabilities(name).unbiased}
    assert declared - covered == set(COVERED_ELSEWHERE) & declared, declared - covered


@pytest.mark.parametrize("name", _unbiased_hybrids())
def test_unbiased_hybrids_are_their_feature_map_off_the_band(name):
    """Declared-unbiased attention estimators (window hybrids) are exact on the band and their feature map (tested
    above) elsewhere: checked entry by entry."""
    gen = np.random.default_rng(4)
    q, k = torch.tensor(gen.standard_normal((9, D)) * 0.5), torch.tensor(gen.standard_normal((9, D)) * 0.5)
    est = ka.make_estimator(name, num_features=8, rng=1, window=2, scale=1.0).fit(q, k)
    approx = est.kernel_matrix(q, k)
    exact = ka.kernel_matrix(q, k, scale=1.0)
    inner = est.feature_map_.kernel_matrix(q, k)
    i, j = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    band = (i - j).abs() < 2                                         # the non-causal band: |i − j| < window
    torch.testing.assert_close(approx[band], exact[band], rtol=1e-12, atol=0)
    torch.testing.assert_close(approx[~band], inner[~band], rtol=1e-12, atol=0)
