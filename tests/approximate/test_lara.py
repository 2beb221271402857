"""LARA and randomized attention: the identities of the paper, the float64 oracles, and their statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import gaussian

from kernapprox.approximate.lara import (
    _log_normal,
    _log_xi,
    importance_sampling_reference,
    lara_kernel_reference,
    lara_proposals,
    lara_reference,
    positive_attention_delta_moments,
    randomized_attention_reference,
    segment_bounds,
)


def scaled(q, k, scale=None):
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return root * q, root * k


def softmax_attention(q, k, v, scale=None):
    x, y = scaled(q, k, scale)
    logits = x @ np.swapaxes(y, -1, -2)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def positive_feature_attention(x, y, v, omegas):
    """Random-feature attention with positive features ``ξ(·, ω_s)`` (scaled inputs), vectorised."""
    pq = np.exp(x @ omegas.T - 0.5 * (x * x).sum(-1, keepdims=True))
    pk = np.exp(y @ omegas.T - 0.5 * (y * y).sum(-1, keepdims=True))
    a = pq @ pk.T
    return a @ v / a.sum(-1, keepdims=True)


# ------------------------------------------------------------------------------------------- the identities
def test_gaussian_product_identity():
    """``N(ω) ξ(x, ω) ξ(y, ω) = exp(xᵀy) N(ω; x + y)`` at random points."""
    for seed in range(5):
        x, y, w = gaussian(4, seed), gaussian(4, seed + 10), gaussian(4, seed + 20)
        lhs = _log_normal(w, np.zeros(4)) + _log_xi(x, w) + _log_xi(y, w)
        assert lhs == pytest.approx(x @ y + _log_normal(w, x + y), abs=1e-12)


def test_segments_partition_or_repeat():
    for n, c in ((13, 4), (16, 16), (7, 3), (5, 8), (1, 3)):
        bounds = segment_bounds(n, c)
        assert bounds.shape == (c, 2) and (bounds[:, 1] > bounds[:, 0]).all() and bounds.max() <= n
        if n >= c:                                     # a partition into near-equal parts
            assert (bounds[1:, 0] == bounds[:-1, 1]).all() and bounds[0, 0] == 0 and bounds[-1, 1] == n
            sizes = bounds[:, 1] - bounds[:, 0]
            assert sizes.max() - sizes.min() <= 1


def test_randomized_attention_is_unbiased():
    """RA averages ``f(ω)``, ``ω ~ p_x``: bounded by the values, so the sample mean over independent draws is
    within 4.5 standard errors of softmax attention, while one-feature random-feature attention (the biased SNIS
    estimator with the same number of draws) is not."""
    q, k, v = gaussian((2, 3), 0, 1.5), gaussian((4, 3), 1, 1.5), gaussian((4, 2), 2)
    exact = softmax_attention(q, k, v)
    rng = np.random.default_rng(3)
    draws = np.stack([randomized_attention_reference(q, k, v, 1, rng) for _ in range(1500)])
    mean, se = draws.mean(0), draws.std(0, ddof=1) / math.sqrt(len(draws))
    assert (np.abs(mean - exact) < 4.5 * se).all()
    x, y = scaled(q, k)
    rfa = np.stack([positive_feature_attention(x, y, v, rng.standard_normal((1, 3))) for _ in range(1500)])
    rfa_se = rfa.std(0, ddof=1) / math.sqrt(len(rfa))
    assert (np.abs(rfa.mean(0) - exact) > 4.5 * rfa_se).any(), "the test cannot tell a biased estimator apart"


def test_randomized_attention_converges():
    q, k, v = gaussian((2, 3), 4), gaussian((5, 3), 5), gaussian((5, 2), 6)
    exact = softmax_attention(q, k, v)
    err = [np.abs(randomized_attention_reference(q, k, v, s, np.random.default_rng(7)) - exact).max()
           for s in (10, 2000)]
    assert err[1] < 0.03 and err[1] < err[0] / 4


# ------------------------------------------------------------------------ RFA as SNIS, and its delta method
def test_random_feature_attention_is_snis_with_the_standard_normal():
    q, k, v = gaussian((3, 4), 8), gaussian((5, 4), 9), gaussian((5, 2), 10)
    x, y = scaled(q, k)
    omegas = gaussian((6, 4), 11)
    log_g = [_log_normal(w, np.zeros(4)) for w in omegas]
    snis = np.stack([importance_sampling_reference(x[n], y, v, omegas, log_g) for n in range(3)])
    np.testing.assert_allclose(snis, positive_feature_attention(x, y, v, omegas), rtol=1e-12, atol=1e-14)


def test_lara_with_one_proposal_at_zero_is_random_feature_attention():
    """Centred queries and keys put the single segment-mean proposal at ``μ = 0``: LARA (balance heuristic) is
    then positive-feature attention with the frequencies ``ε_s``."""
    q, k, v = gaussian((5, 3), 12), gaussian((6, 3), 13), gaussian((6, 2), 14)
    q, k = q - q.mean(0), k - k.mean(0)
    noise = gaussian((1, 7, 3), 15)
    out = lara_reference(q, k, v, noise, num_proposals=1, weighting="balance")
    x, y = scaled(q, k)
    np.testing.assert_allclose(out, positive_feature_attention(x, y, v, noise[0]), rtol=1e-12, atol=1e-14)


def test_lara_with_the_optimal_proposal_is_randomized_attention():
    """Proposals equal to the query's own ``p_x`` (the mixture ``Σ π_m N(x + y_m, I)``) make every importance
    weight ``p̃_x/p_x = Z``: the MIS estimate (balance weights ``1/C``) is the plain average of ``f``, i.e. RA."""
    q, k, v = gaussian((1, 3), 16), gaussian((4, 3), 17), gaussian((4, 2), 18)
    x, y = scaled(q, k)
    rng = np.random.default_rng(19)
    pi = np.exp(y @ x[0] - np.logaddexp.reduce(y @ x[0]))
    omegas = np.stack([x[0] + y[rng.choice(4, p=pi)] + rng.standard_normal(3) for _ in range(5)])
    log_p = [np.logaddexp.reduce([math.log(pi[m]) + _log_normal(w, x[0] + y[m]) for m in range(4)]) for w in omegas]
    mis = importance_sampling_reference(x[0], y, v, omegas, log_p, np.full(5, 1 / 5))
    f = [importance_sampling_reference(x[0], y, v, w[None], [0.0]) for w in omegas]   # f(ω) alone
    np.testing.assert_allclose(mis, np.mean(f, 0), rtol=1e-12)


def test_positive_attention_delta_moments_match_monte_carlo():
    """First-order bias and variance of positive-feature attention (SNIS with N(0, I)) against 40 000
    independent estimates: bias within 4.5 standard errors plus a tenth of its size (the next order is
    ``O(1/S²)``), variance within 10 % at ``S = 256``; a sign error or a missing factor fails."""
    q, k, v = gaussian((3, 4), 20, 0.35), gaussian((6, 4), 21, 0.35), gaussian((6, 2), 22)
    x, y = scaled(q, k)
    exact = softmax_attention(q, k, v)
    bias, var = positive_attention_delta_moments(q, k, v)
    rng = np.random.default_rng(23)
    for s, trials in ((64, 40_000), (256, 10_000)):
        outs = []
        for _ in range(trials // 2000):
            w = rng.standard_normal((2000, s, 4))
            pq = np.exp(np.einsum("tsd,nd->tns", w, x) - 0.5 * (x * x).sum(1)[None, :, None])
            pk = np.exp(np.einsum("tsd,md->tms", w, y) - 0.5 * (y * y).sum(1)[None, :, None])
            a = np.einsum("tns,tms->tnm", pq, pk)
            outs.append(a @ v / a.sum(-1, keepdims=True))
        outs = np.concatenate(outs)
        if s == 64:
            se = outs.std(0, ddof=1) / math.sqrt(len(outs))
            assert (np.abs((outs.mean(0) - exact) - bias / s) < 4.5 * se + 0.1 * np.abs(bias) / s).all()
        else:
            np.testing.assert_allclose(outs.var(0, ddof=1) * s, var, rtol=0.1)


# --------------------------------------------------------------------------------------- the LARA oracle
def test_lara_kernel_reference_gives_the_output():
    q, k, v = gaussian((4, 3), 24), gaussian((5, 3), 25), gaussian((5, 2), 26)
    noise = gaussian((2, 2, 3), 27)
    for weighting in ("balance", "query"):
        a = lara_kernel_reference(q, k, noise, num_proposals=2, weighting=weighting)
        out = lara_reference(q, k, v, noise, num_proposals=2, weighting=weighting)
        np.testing.assert_allclose(a @ v / a.sum(-1, keepdims=True), out, rtol=1e-12, atol=1e-14)


def test_lara_kernel_is_unbiased_with_balance_weights():
    """With the balance heuristic the weights sum to one and the proposals do not depend on the draws, so the
    implied kernel estimate is unbiased for ``exp(xᵀy)`` (mean over independent draws within 4.5 standard
    errors); dropping the ratio ``N(ω)/g_c(ω)`` (plain positive features at the proposal draws) is not."""
    q, k = gaussian((2, 3), 28, 0.7), gaussian((3, 3), 29, 0.7)
    x, y = scaled(q, k)
    exact = np.exp(x @ y.T)
    rng = np.random.default_rng(30)
    noises = rng.standard_normal((1500, 2, 1, 3))
    draws = np.stack([lara_kernel_reference(q, k, eps, num_proposals=2, weighting="balance") for eps in noises])
    se = draws.std(0, ddof=1) / math.sqrt(len(draws))
    assert (np.abs(draws.mean(0) - exact) < 4.5 * se).all()
    _, _, mu = lara_proposals(q, k, 2)
    wrong = []
    for eps in noises:
        omegas = mu + eps[:, 0]
        log_g = np.array([[_log_normal(w, m) for m in mu] for w in omegas])            # (sample, proposal)
        alpha = np.exp(np.diag(log_g) - np.logaddexp.reduce(log_g, axis=1))
        feats = [np.exp(x @ w - 0.5 * (x * x).sum(1))[:, None] * np.exp(y @ w - 0.5 * (y * y).sum(1))[None]
                 for w in omegas]
        wrong.append(sum(a * f for a, f in zip(alpha, feats)))
    wrong = np.stack(wrong)
    assert (np.abs(wrong.mean(0) - exact) > 4.5 * wrong.std(0, ddof=1) / math.sqrt(len(wrong))).any()


def test_lara_converges_to_softmax_attention():
    q, k, v = gaussian((3, 3), 31), gaussian((4, 3), 32), gaussian((4, 2), 33)
    exact = softmax_attention(q, k, v)
    errs = []
    for s in (4, 400):
        noise = gaussian((2, s, 3), 34)
        errs.append(np.abs(lara_reference(q, k, v, noise, num_proposals=2) - exact).max())
    assert errs[1] < 0.05 and errs[1] < errs[0] / 3


def test_lara_deterministic_mode_ignores_the_noise():
    q, k, v = gaussian((4, 3), 35), gaussian((4, 3), 36), gaussian((4, 2), 37)
    a = lara_reference(q, k, v, gaussian((2, 1, 3), 38), num_proposals=2, sample=False)
    b = lara_reference(q, k, v, gaussian((2, 1, 3), 39), num_proposals=2, sample=False)
    np.testing.assert_array_equal(a, b)


def test_oracle_rejects_noise_of_the_wrong_shape():
    q = gaussian((4, 3), 40)
    with pytest.raises(ValueError, match="noise"):
        lara_reference(q, q, q, gaussian((3, 1, 3), 41), num_proposals=2)


# ---------------------------------------------------------------------------------------- the estimator
import torch  # noqa: E402

import kernapprox as ka  # noqa: E402
from kernapprox.approximate.lara import LinearRandomizedAttention  # noqa: E402
from kernapprox.estimators.registry import registered_options  # noqa: E402

MODES = ("parallel", "recurrent", "chunked")


def tensors(shapes, seed, std=1.0, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal(s) * std).to(dtype) for s in shapes]


@pytest.mark.parametrize("weighting", ["query", "balance"])
@pytest.mark.parametrize("num_features, num_proposals, sample", [(6, None, True), (6, 3, True), (6, 1, True),
                                                                 (5, None, False)])
def test_modes_match_the_oracle(weighting, num_features, num_proposals, sample):
    q, k, v = tensors([(2, 9, 5), (2, 7, 5), (2, 7, 3)], 50)              # n_q != n_k, odd sizes
    est = LinearRandomizedAttention(num_features=num_features, num_proposals=num_proposals, weighting=weighting,
                                    sample=sample, rng=51).fit(q, k)
    ref = torch.from_numpy(lara_reference(q, k, v, est.noise_, num_proposals=est.noise_.shape[0],
                                          weighting=weighting, sample=sample))
    for mode in MODES:
        for chunk in (1, 4, 64):
            out = ka.linear_attention(q, k, v, est, mode=mode, chunk_size=chunk)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    kernel = torch.from_numpy(lara_kernel_reference(q, k, est.noise_, num_proposals=est.noise_.shape[0],
                                                    weighting=weighting, sample=sample))
    torch.testing.assert_close(est.kernel_matrix(q, k), kernel, rtol=1e-10, atol=0)


def test_clamped_query_weights_match_the_oracle():
    """A large ``λ`` drives some query weights below the floor; the clamp is part of the definition."""
    q, k, v = tensors([(9, 4), (9, 4), (9, 2)], 52, std=2.0)
    est = LinearRandomizedAttention(num_features=4, alpha_coeff=50.0, alpha_floor=1e-3, rng=53).fit(q, k)
    x = q * math.sqrt(est.scale_)
    r = torch.softmax(x @ _segment(x, 4).T, dim=0)                     # (n, C), over the queries
    assert (r - r.mean(1, keepdim=True)).min() * 50 < -1, "the test does not reach the clamp"
    ref = lara_reference(q, k, v, est.noise_, num_proposals=4, alpha_coeff=50.0, alpha_floor=1e-3)
    for mode in MODES:
        out = ka.linear_attention(q, k, v, est, mode=mode, chunk_size=2)
        torch.testing.assert_close(out, torch.from_numpy(ref), rtol=1e-10, atol=1e-12)


def _segment(x, c):
    bounds = segment_bounds(x.shape[0], c)
    return torch.stack([x[a:b].mean(0) for a, b in bounds])


def test_hostile_norms_stay_in_the_values_hull():
    """Norms at which ``exp`` of a logit overflows in float64: every mode is finite, agrees with the others, and
    the output (positive weights) lies within the range of the values, in float64 and float32."""
    q, k, v = tensors([(2, 17, 6), (2, 17, 6), (2, 17, 3)], 56)
    q, k = q * 300.0, k * 300.0
    for dtype in (torch.float64, torch.float32):
        est = LinearRandomizedAttention(num_features=8, rng=57).fit(q.to(dtype), k.to(dtype))
        outs = [ka.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), est, mode=mode, chunk_size=5)
                for mode in MODES]
        for out in outs:
            assert torch.isfinite(out).all()
            assert (out <= v.to(dtype).amax(-2, keepdim=True) + 1e-5).all()
            assert (out >= v.to(dtype).amin(-2, keepdim=True) - 1e-5).all()
            torch.testing.assert_close(out, outs[0], rtol=1e-10 if dtype == torch.float64 else 1e-4,
                                       atol=1e-10 if dtype == torch.float64 else 1e-4)


def test_one_draw_for_both_float_types_and_devices_of_the_noise():
    q, k, v = tensors([(10, 4), (10, 4), (10, 2)], 58)
    est = LinearRandomizedAttention(num_features=6, rng=59).fit(q, k)
    other = LinearRandomizedAttention(num_features=6, rng=59).fit(q.float(), k.float())
    np.testing.assert_array_equal(est.noise_, other.noise_)
    out32 = ka.linear_attention(q.float(), k.float(), v.float(), other)
    torch.testing.assert_close(out32.double(), ka.linear_attention(q, k, v, est), rtol=1e-4, atol=1e-5)


def test_sampler_option_draws_orthogonal_noise():
    q = tensors([(10, 4)], 60)[0]
    est = LinearRandomizedAttention(num_features=4, sampler="orthogonal", rng=61).fit(q, q)
    eps = est.noise_.reshape(4, 4)
    gram = eps @ eps.T
    np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-12)


def test_state_bytes_count_proposals_and_draws():
    q = tensors([(10, 4)], 62)[0]
    query = LinearRandomizedAttention(num_features=6, num_proposals=3, rng=0).fit(q, q)
    assert query.state_bytes(5) == (6 * (5 + 4 + 4) + 3 * (4 + 1)) * 4
    balance = LinearRandomizedAttention(num_features=6, weighting="balance", rng=0).fit(q, q)
    assert balance.state_bytes(5, torch.float64) == 6 * (5 + 4 + 3) * 8
    assert balance.state_bytes(5, torch.float64, seq_len=10_000) == balance.state_bytes(5, torch.float64)


def test_declared_properties():
    assert LinearRandomizedAttention(num_features=4, weighting="balance").unbiased
    assert not LinearRandomizedAttention(num_features=4).unbiased
    assert not LinearRandomizedAttention(num_features=4, weighting="balance", sample=False).unbiased
    assert not LinearRandomizedAttention(num_features=4, weighting="balance", sampler="regularized").unbiased


def lara_at_the_means(q, k, v, num_proposals, weighting="query", alpha_coeff=1.0, alpha_floor=1e-8):
    """The inference-time rule ω_c = μ_c in closed form (float64, one head, vectorised, no module code):
    ``Σ_c α_nc(μ_c) e^{−‖μ_c‖²/2} ξ(x_n, μ_c) Σ_m ξ(y_m, μ_c) v_m / (the same with v_m = 1)``, where
    ``α_nc(μ_c) = 1/Σ_c' e^{−‖μ_c − μ_c'‖²/2}`` (balance) plus ``λ(r_nc − mean_c' r_nc')`` clamped at the floor
    (query), ``r_nc`` the softmax over the queries of ``x_nᵀx̃_c``."""
    x, y = scaled(q, k)

    def means(z):                                      # segment c: [⌊cn/C⌋, max(⌊(c+1)n/C⌋, ⌊cn/C⌋ + 1))
        n = z.shape[0]
        return np.stack([z[(c * n) // num_proposals:max(((c + 1) * n) // num_proposals,
                                                        (c * n) // num_proposals + 1)].mean(0)
                         for c in range(num_proposals)])

    x_bar = means(x)
    mu = x_bar + means(y)
    sq = ((mu[:, None, :] - mu[None, :, :]) ** 2).sum(-1)
    alpha = np.broadcast_to(1.0 / np.exp(-0.5 * sq).sum(1), (x.shape[0], num_proposals)).copy()
    if weighting == "query":
        logits = x @ x_bar.T                                                # (n, C)
        r = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
        alpha = np.maximum(alpha + alpha_coeff * (r - r.mean(1, keepdims=True)), alpha_floor)
    xi_q = np.exp(x @ mu.T - 0.5 * (x * x).sum(-1, keepdims=True))         # ξ(x_n, μ_c)
    xi_k = np.exp(y @ mu.T - 0.5 * (y * y).sum(-1, keepdims=True))         # ξ(y_m, μ_c)
    weight = alpha * np.exp(-0.5 * (mu * mu).sum(-1)) * xi_q              # (n, C)
    return (weight @ (xi_k.T @ v)) / (weight @ xi_k.sum(0))[:, None]


@pytest.mark.parametrize("weighting", ["query", "balance"])
def test_lara_mean_is_the_inference_time_rule_in_closed_form(weighting):
    """The registered ``lara_mean`` is LARA with every sample at its proposal mean (the paper's inference-time rule,
    training-free): equal to the closed form at ω = μ in float64, in every mode, and independent of the seed."""
    q, k, v = tensors([(11, 5), (9, 5), (9, 3)], 70, std=0.8)          # n_q != n_k, C ∤ n
    options = {} if weighting == "query" else {"weighting": "balance"}
    ref = torch.from_numpy(lara_at_the_means(q.numpy(), k.numpy(), v.numpy(), 4, weighting))
    for seed in (0, 1):
        est = ka.make_estimator("lara_mean", num_features=4, rng=seed, **options).fit(q, k)
        for mode in MODES:
            torch.testing.assert_close(ka.linear_attention(q, k, v, est, mode=mode, chunk_size=3), ref,
                                       rtol=1e-12, atol=1e-13)


def test_lara_and_eva_are_declared_training_free_with_their_rule():
    """Every LARA/EVA registry name says in its declared reference (the estimator table's column) that it is a
    training-free variant, and which rule: the training-time rule (sampled ω) or the inference-time rule ω = μ."""
    names = [n for n in ka.available_estimators() if n.startswith(("lara", "eva"))]
    assert {"lara", "lara_balance", "lara_mean", "eva", "eva_mean"} <= set(names)
    for name in names:
        reference = ka.capabilities(name).reference
        assert "training-free variant" in reference and "not the paper's trained estimator" in reference, name
        sample = registered_options(name).get("sample", True)
        assert ("training-time rule" in reference) == sample, name
        assert ("inference-time rule" in reference and "ω = μ" in reference) == (not sample), name
    table = ka.estimator_table()
    assert table.count("training-free variant") >= len(names)


def test_rejects_bad_arguments():
    q, k, v = tensors([(6, 4), (6, 4), (6, 2)], 63)
    with pytest.raises(ValueError, match="num_proposals"):
        LinearRandomizedAttention(num_features=6, num_proposals=4)
    with pytest.raises(ValueError, match="sample=False"):
        LinearRandomizedAttention(num_features=6, num_proposals=3, sample=False)
    with pytest.raises(ValueError, match="weighting"):
        LinearRandomizedAttention(num_features=6, weighting="optimal")
    with pytest.raises(ValueError, match="alpha_floor"):
        LinearRandomizedAttention(num_features=6, alpha_floor=0.0)
    with pytest.raises(ValueError, match="weighting='query'"):
        LinearRandomizedAttention(num_features=6, weighting="balance", alpha_coeff=2.0)
    with pytest.raises(TypeError, match="sample"):
        LinearRandomizedAttention(num_features=6, sample=1)
    est = LinearRandomizedAttention(num_features=6, rng=0).fit(q, k)
    with pytest.raises(ValueError, match="not causal"):
        ka.linear_attention(q, k, v, est, causal=True)
    with pytest.raises(ValueError, match="d=4"):
        ka.linear_attention(q[:, :3], k[:, :3], v, est)


def test_parameter_bytes_are_the_noise():
    q = tensors([(10, 4)], 64)[0]
    assert LinearRandomizedAttention(num_features=6, rng=0).fit(q, q).parameter_bytes() == 6 * 4 * 4
    assert LinearRandomizedAttention(num_features=6, sample=False).fit(q, q).parameter_bytes() == 0
