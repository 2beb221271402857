"""In-context read-outs: no shortcut through the test queries, and anchors computed independently of the library.

* Context only: for every data-dependent feature map of the registry, replacing some test queries leaves the
  read-out of every other query unchanged (the map is fitted on the context keys); the oracle mode does look at
  the queries (the test has power), and estimators whose attention reads the queries are refused outside it.
* Exact attention on random unit keys: the read-out equals a plain float64 loop, and the mean mass on the stored
  key matches the closed form ``E[1/(1+X)]``, ``X = Σ_{j≠i} e^{β(k_iᵀk_j − 1)}`` with ``E e^{β uᵀv} = ₀F₁(; d/2;
  β²/4)`` for independent uniform unit vectors (:func:`kernapprox.theory.log_sphere_mgf`).
* Nyström's r/n law: the read-out equals an explicit projection ``K_{qL} K_{LL}⁻¹ K_{L·}`` computed here with
  ``numpy.linalg.solve``, and each query is recalled exactly when its key is a landmark (membership read from the
  landmark indices), at query cosine 1 and 0.9 — so accuracy ≈ r/n follows from the landmarks, not from q = k.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox import readout, tasks, theory


def _data_dependent_feature_maps():
    return [name for name in ka.available_estimators()
            if ka.capabilities(name).kind == "features" and ka.capabilities(name).data_dependent]


def _episode_seeds(rng, batch):
    """The per-episode seeds :func:`readout.attention_readout` draws from ``rng``."""
    return np.random.default_rng(rng).integers(0, 2**63 - 1, size=batch)


# ------------------------------------------------------------------------------------------- context only
@pytest.mark.parametrize("name", _data_dependent_feature_maps())
def test_readout_is_unchanged_when_only_the_test_queries_change(name):
    ep = tasks.associative_recall(24, dim=8, num_candidates=64, batch=2, rng=3, dtype=torch.float64)
    changed = ep.queries.clone()
    changed[:, ::2] = tasks.associative_recall(24, dim=8, num_candidates=64, batch=2, rng=4,
                                               dtype=torch.float64).queries[:, ::2]
    assert not torch.equal(changed, ep.queries)
    a = readout.attention_readout(name, ep.queries, ep.keys, ep.values, beta=2.0, num_features=8, rng=5)
    b = readout.attention_readout(name, changed, ep.keys, ep.values, beta=2.0, num_features=8, rng=5)
    assert not a.oracle and not b.oracle
    torch.testing.assert_close(b.output[:, 1::2], a.output[:, 1::2], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(b.normalizer[:, 1::2], a.normalizer[:, 1::2], rtol=1e-13, atol=1e-15)
    assert a.state_bytes == b.state_bytes


def test_oracle_readout_does_read_the_queries():
    """The same check fails in the oracle mode for a map fitted on queries and keys (the test above has power)."""
    ep = tasks.associative_recall(24, dim=8, num_candidates=64, batch=2, rng=3, dtype=torch.float64)
    changed = ep.queries.clone()
    changed[:, ::2] *= -1.0
    kw = dict(beta=2.0, num_features=8, rng=5, fit_on="queries_and_keys")
    a = readout.attention_readout("nystrom_uniform", ep.queries, ep.keys, ep.values, **kw)
    b = readout.attention_readout("nystrom_uniform", changed, ep.keys, ep.values, **kw)
    assert a.oracle and b.oracle
    assert not torch.allclose(b.output[:, 1::2], a.output[:, 1::2])


@pytest.mark.parametrize("name", ["nystromformer", "kernel_svd", "attention_svd"])
def test_estimators_that_read_the_queries_are_oracles_only(name):
    ep = tasks.associative_recall(16, dim=8, num_candidates=32, batch=1, rng=3, dtype=torch.float64)
    assert readout.reads_test_queries(name)
    with pytest.raises(ValueError, match="oracle"):
        readout.attention_readout(name, ep.queries, ep.keys, ep.values, beta=2.0, num_features=4)
    rd = readout.attention_readout(name, ep.queries, ep.keys, ep.values, beta=2.0, num_features=4,
                                   fit_on="queries_and_keys")
    assert rd.oracle and torch.isfinite(rd.output).all()
    for name in _data_dependent_feature_maps() + ["exact", "positive", "scatterbrain"]:
        assert not readout.reads_test_queries(name)


# ------------------------------------------------------------------------------- exact attention, closed form
def test_exact_attention_target_mass_matches_the_closed_form():
    """n = 512 random unit keys in d = 64, queries = stored keys, β = ln n: values one-hot, so the read-out is the
    attention row. (a) It equals a plain float64 loop over keys. (b) The mean mass on the stored key over 8 × 512
    queries matches ``1/(1+μ) + σ²/(1+μ)³`` (second-order delta method, ``μ, σ²`` the closed-form mean and variance
    of X) within 4 standard errors (a bound: the standard deviation of a query's mass over √episodes); measured
    0.4250 against 0.4256 ± 0.0034, and the same formula at 1.1 β is 41 SE away."""
    n, d, batch = 512, 64, 8
    beta = tasks.log_n_beta(n)
    ep = tasks.associative_recall(n, dim=d, num_candidates=n, batch=batch, rng=0, dtype=torch.float64)
    onehot = torch.eye(n, dtype=torch.float64).expand(batch, n, n)
    rd = readout.attention_readout("exact", ep.queries, ep.keys, onehot, beta=beta)
    # (a) a plain loop for a few queries
    keys, queries = ep.keys.numpy(), ep.queries.numpy()
    for b, i in ((0, 0), (3, 17), (7, 511)):
        logits = [beta * sum(queries[b, i, c] * keys[b, j, c] for c in range(d)) for j in range(n)]
        top = max(logits)
        weights = [math.exp(v - top) for v in logits]
        total = sum(weights)
        np.testing.assert_allclose(rd.output[b, i].numpy(), np.array(weights) / total, rtol=1e-10, atol=1e-15)
    # (b) the closed form
    mass = torch.gather(rd.output, 2, ep.query_slots[..., None]).squeeze(-1).numpy()      # (B, n)

    def predicted(beta_):
        m1 = math.exp(float(theory.log_sphere_mgf(beta_**2, d)))
        m2 = math.exp(float(theory.log_sphere_mgf(4 * beta_**2, d)))
        mu = (n - 1) * math.exp(-beta_) * m1
        var = (n - 1) * math.exp(-2 * beta_) * (m2 - m1**2)
        return 1 / (1 + mu) + var / (1 + mu) ** 3, math.sqrt(var) / (1 + mu) ** 2

    expected, sd = predicted(beta)
    se = sd / math.sqrt(batch)                                # queries within an episode share keys: bound
    assert abs(mass.mean() - expected) < 4 * se, (mass.mean(), expected, se)
    assert abs(mass.mean() - predicted(1.1 * beta)[0]) > 20 * se
    assert abs(float(mass.std()) / sd - 1) < 0.3                # the closed-form spread is the measured one


def test_exact_attention_recall_matches_a_plain_decoder():
    """Recall accuracy of exact attention at β = ln n and 2 ln n: the library's decode equals an explicit loop
    (weights, weighted value sum, nearest candidate by inner product); sharp recall is perfect, blunt is not."""
    n = 256
    ep = tasks.associative_recall(n, dim=64, num_queries=64, batch=2, rng=1, dtype=torch.float64)
    for factor, lowest in ((1.0, 0.9), (2.0, 1.0)):
        beta = tasks.log_n_beta(n, factor)
        rd = readout.attention_readout("exact", ep.queries, ep.keys, ep.values, beta=beta)
        acc = tasks.recall_accuracy(rd.output, ep).numpy()
        q, k, v, c = (t.numpy() for t in (ep.queries, ep.keys, ep.values, ep.candidates))
        hits = np.zeros(2)
        for b in range(2):
            for i in range(q.shape[1]):
                w = np.exp(beta * (k[b] @ q[b, i]) - beta)
                out = (w[:, None] * v[b]).sum(0) / w.sum()
                hits[b] += int(np.argmax(c[b] @ out) == int(ep.targets[b, i]))
        np.testing.assert_array_equal(acc, hits / q.shape[1])
        assert acc.min() >= lowest


# ------------------------------------------------------------------------------------------ Nyström's r/n law
@pytest.mark.parametrize("cosine", [1.0, 0.9])
@pytest.mark.parametrize("name", ["nystrom_uniform", "nystrom_rls"])
def test_nystrom_recall_is_landmark_membership(name, cosine):
    n, r, batch = 128, 32, 4
    beta = tasks.log_n_beta(n, 2.0)
    ep = tasks.associative_recall(n, dim=64, batch=batch, rng=5, query_cosine=cosine, dtype=torch.float64)
    rd = readout.attention_readout(name, ep.queries, ep.keys, ep.values, beta=beta, num_features=r, rng=0)
    correct = (tasks.decode_nearest(rd.numerator, ep.candidates) == ep.targets).numpy()
    member = np.zeros_like(correct)
    for b, seed in enumerate(_episode_seeds(0, batch)):
        est = readout.build_estimator(name, beta=beta, num_features=r, rng=int(seed)).fit(ep.keys[b])
        landmarks = est.landmark_indices_                                      # indices into the keys
        k, q, v = ep.keys[b].numpy(), ep.queries[b].numpy(), ep.values[b].numpy()
        # the explicit projection K_{qL} K_{LL}^{-1} K_{L,keys} (shift e^{-β} keeps it finite), plain numpy
        k_ql = np.exp(beta * q @ k[landmarks].T - beta)
        k_ll = np.exp(beta * k[landmarks] @ k[landmarks].T - beta)
        k_lk = np.exp(beta * k[landmarks] @ k.T - beta)
        approx = k_ql @ np.linalg.solve(k_ll, k_lk)
        explicit = approx @ v
        np.testing.assert_allclose(rd.numerator[b].numpy() / rd.normalizer[b].numpy()[:, None],
                                   explicit / approx.sum(1, keepdims=True), rtol=1e-6, atol=1e-9)
        member[b] = np.isin(ep.query_slots[b].numpy(), landmarks)
    agreement = float((correct == member).mean())
    accuracy = float(correct.mean())
    assert agreement >= 0.97, agreement                                      # measured 1.0 in all four cases
    assert abs(accuracy - r / n) <= 0.05, accuracy                           # measured 0.25 = r/n
