"""Nyström feature maps (uniform, k-means, ridge-leverage-score landmarks), recursive RLS sampling,
Nyströmformer and the optimal rank-r floor: known answers, determinism, stabilisation, input checks."""

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.approximate.lowrank import (
    AttentionSVD,
    KernelSVD,
    Nystromformer,
    iterative_pinv,
    output_error_floor,
    segment_means,
)
from kernapprox.estimators.nystrom import (
    RLS_FALLBACK_LAMBDA,
    NystromFeatures,
    effective_dimension,
    gaussian_gram,
    recursive_rls_sample,
    ridge_leverage_scores,
)
from kernapprox.metrics import relative_frobenius_error, relative_rms_error

NYSTROM = ("nystrom_uniform", "nystrom_kmeans", "nystrom_rls")


def randn(shape, seed, std=1.0, dtype=torch.float64):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape) * std).to(dtype)


def clustered(n, d, seed, num_clusters=4, spread=0.15, radius=1.2):
    """Tokens around a few well-separated centres: the structured input Nyström forms are made for."""
    gen = np.random.default_rng(seed)
    centres = gen.standard_normal((num_clusters, d))
    centres *= radius * math.sqrt(d) ** 0.5 / np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[gen.integers(num_clusters, size=n)] + spread * gen.standard_normal((n, d))
    return torch.from_numpy(x)


# ------------------------------------------------------------------------------------ Nyström feature maps
def test_every_point_as_landmark_reproduces_the_kernel():
    q, k = randn((40, 8), 1), randn((30, 8), 2)
    est = ka.make_estimator("nystrom_uniform", num_features=70, rng=0).fit(q, k)
    assert np.array_equal(est.landmark_indices_, np.arange(70))
    exact = ka.kernel_matrix(q, k)
    err = (est.kernel_matrix(q, k) - exact).abs() / exact
    assert float(err.max()) < 1e-8
    assert est.effective_rank_ == 70 and est.regularizer_ == est.regularizer


def test_duplicate_landmarks_are_cut_off_and_recorded():
    """q = k: every landmark appears twice, G(Z, Z) has rank n; the cut-off drops the null space, the effective
    rank records it, and the kernel is still reproduced."""
    x = randn((25, 6), 3)
    est = NystromFeatures(num_features=50, rng=0).fit(x, x.clone())
    assert est.effective_rank_ == 25
    assert est.eigenvalues_[25] < 1e-12 * est.eigenvalues_[0]
    exact = ka.kernel_matrix(x, x)
    assert float(((est.kernel_matrix(x, x) - exact).abs() / exact).max()) < 1e-8


def _dense_nystrom(q, k, z, ridge_d2=None, scale=None):
    """``K(q, Z) (K(Z, Z) [+ λ D²])⁺ K(Z, k)`` straight from the definition (float64 numpy; moderate norms)."""
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    x, y = q.numpy() * math.sqrt(s), k.numpy() * math.sqrt(s)
    kzz = np.exp(z @ z.T)
    if ridge_d2 is not None:
        kzz = kzz + ridge_d2 * np.diag(np.exp((z * z).sum(-1)))
    return np.exp(x @ z.T) @ np.linalg.pinv(kzz, rcond=1e-12, hermitian=True) @ np.exp(z @ y.T)


@pytest.mark.parametrize("name", NYSTROM)
def test_features_match_the_nystrom_formula(name):
    q, k = randn((2, 30, 5), 4, 0.8), randn((2, 30, 5), 5, 0.8)
    est = ka.make_estimator(name, num_features=12, rng=1).fit(q, k)
    assert est.landmarks_.shape == (12, 5) and est.whitening_.shape == (12, 12)
    dense = _dense_nystrom(q[1], k[1], est.landmarks_)
    got = est.kernel_matrix(q, k)[1].numpy()
    assert np.abs(got - dense).max() / np.abs(dense).max() < 1e-9
    assert (est.features(q, "query") < 0).any(), "Nyström features are signed"


def test_ridge_regularisation_is_the_scaled_ridge_and_is_recorded():
    q, k = randn((30, 4), 6, 0.7), randn((30, 4), 7, 0.7)
    lam = 0.05
    est = NystromFeatures(num_features=20, regularization="ridge", regularizer=lam, rng=2).fit(q, k)
    dense = _dense_nystrom(q, k, est.landmarks_, ridge_d2=lam)
    assert np.abs(est.kernel_matrix(q, k).numpy() - dense).max() / np.abs(dense).max() < 1e-10
    assert est.regularizer_ == lam
    assert est.effective_rank_ == int((est.eigenvalues_ >= lam).sum()) < 20


@pytest.mark.parametrize("name", NYSTROM)
def test_landmark_selection_is_deterministic_from_rng(name):
    q, k = randn((3, 40, 6), 8), randn((3, 40, 6), 9)
    first = ka.make_estimator(name, num_features=16, rng=21).fit(q, k).landmarks_
    again = ka.make_estimator(name, num_features=16, rng=np.random.default_rng(21)).fit(q, k).landmarks_
    other = ka.make_estimator(name, num_features=16, rng=22).fit(q, k).landmarks_
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_kmeans_centroids_live_in_the_scaled_space():
    """The centroids are fixed points of Lloyd's step on the *scaled* pooled queries and keys."""
    q, k = clustered(60, 4, 10), clustered(60, 4, 11)
    est = NystromFeatures(num_features=4, landmarks="kmeans", rng=0, kmeans_max_iter=300).fit(q, k)
    pool = torch.cat([q, k]).numpy() * math.sqrt(est.scale_)
    labels = ((pool[:, None, :] - est.landmarks_[None]) ** 2).sum(-1).argmin(1)
    means = np.stack([pool[labels == c].mean(0) for c in range(4)])
    assert np.abs(means - est.landmarks_).max() < 1e-8


def test_exact_ridge_leverage_scores_sum_to_the_effective_dimension():
    x = np.random.default_rng(0).standard_normal((80, 3))
    gram = gaussian_gram(x, x)
    for lam in (1e-3, 0.1, 10.0):
        assert ridge_leverage_scores(gram, lam).sum() == pytest.approx(effective_dimension(gram, lam), rel=1e-10)


@pytest.mark.parametrize(("n", "d", "std", "s"), [(400, 4, 0.7, 40), (300, 2, 1.0, 30), (600, 8, 1.0, 60)])
def test_recursive_rls_scores_sum_to_about_the_effective_dimension(n, d, std, s):
    """Musco & Musco: the recursive estimates are constant-factor approximations of the λ-ridge leverage scores
    (measured ratios of the sums 1.0-1.5 on these inputs, pointwise 0.8-2.3)."""
    x = np.random.default_rng(n).standard_normal((n, d)) * std
    sample = recursive_rls_sample(x, s, np.random.default_rng(1))
    gram = gaussian_gram(x, x)
    exact = ridge_leverage_scores(gram, sample.lam)
    assert 0.9 < sample.scores.sum() / effective_dimension(gram, sample.lam) < 2.0
    ratio = sample.scores / exact
    assert 0.5 < ratio.min() and ratio.max() < 3.0
    assert sample.indices.shape == (s,) and np.unique(sample.indices).size == s
    assert ((sample.scores >= 0) & (sample.scores <= 1)).all()


def test_rls_picks_the_isolated_points_uniform_sampling_misses():
    """500 points in one tight cluster and 20 isolated ones: the isolated points have leverage ≈ 1."""
    gen = np.random.default_rng(3)
    outliers = 6.0 * gen.standard_normal((20, 3))
    x = np.concatenate([0.05 * gen.standard_normal((500, 3)), outliers])
    picked = [(recursive_rls_sample(x, 30, np.random.default_rng(seed)).indices >= 500).sum() for seed in range(10)]
    assert np.mean(picked) >= 10             # uniform sampling picks 30 · 20/520 ≈ 1.2 on average


def test_rls_degenerate_sizes():
    x = np.random.default_rng(0).standard_normal((10, 2))
    full = recursive_rls_sample(x, 10, np.random.default_rng(0))
    assert np.array_equal(full.indices, np.arange(10)) and full.lam == RLS_FALLBACK_LAMBDA == 1e-5
    assert recursive_rls_sample(x, 1, np.random.default_rng(0)).indices.shape == (1,)
    with pytest.raises(ValueError, match="num_samples"):
        recursive_rls_sample(x, 11, np.random.default_rng(0))


@pytest.mark.parametrize("name", NYSTROM)
@pytest.mark.parametrize("causal", [False, True])
def test_nystrom_modes_agree_with_the_oracle(name, causal):
    q, k, v = randn((2, 19, 6), 12, 0.6), randn((2, 19, 6), 13, 0.6), randn((2, 19, 3), 14)
    est = ka.make_estimator(name, num_features=10, rng=0).fit(q, k)
    oracle = ka.linear_attention_naive(q, k, v, est, causal=causal)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, causal=causal, mode=mode, chunk_size=5)
        assert float(relative_rms_error(out, oracle).max()) < 1e-10, mode


def test_stabilised_at_norms_where_the_kernel_overflows():
    """Tokens around a common offset, s·qᵀk in [680, 930] (exp overflows float64 at 709): features and
    attention stay finite and, with every point a landmark, equal exact softmax attention. (Logit ranges of
    several hundred *within* a row are beyond any factorised map with per-row scales: products underflow.)"""
    q, k, v = 20 + randn((12, 4), 15, 2.0), 20 + randn((12, 4), 16, 2.0), randn((12, 4), 17)
    assert float((q @ k.T).min()) / 2 > 680
    est = NystromFeatures(num_features=24, rng=0).fit(q, k)
    tilde, logs = est.features(q, "query", log_scale=True)
    assert torch.isfinite(tilde).all() and torch.isfinite(logs).all()
    for causal in (False, True):
        out = ka.linear_attention(q, k, v, est, causal=causal, mode="recurrent")
        assert float(relative_rms_error(out, ka.softmax_attention(q, k, v, causal)).max()) < 1e-9


def test_float32_features_agree_with_float64():
    q, k = randn((2, 40, 6), 18, 0.8), randn((2, 40, 6), 19, 0.8)
    f64 = NystromFeatures(num_features=32, rng=0).fit(q, k).features(q, "key")
    f32 = NystromFeatures(num_features=32, rng=0).fit(q.float(), k.float()).features(q.float(), "key")
    assert f32.dtype == torch.float32
    assert float((f32.double() - f64).norm() / f64.norm()) < 1e-5


@pytest.mark.parametrize("std", [0.02, 0.1, 0.5, 1.0])
def test_precision_policy_keeps_float32_features_within_the_tolerance(std):
    """precision="auto": float32 features are computed in float32 directly when eps32 · amplification ≤ 1e-5, in
    float32 centred (1ᵀG^{+1/2} + expm1(t) G^{+1/2}) when 1.25 · eps32 · amplification · ρ ≤ 1e-5, and are then
    within 1e-5 (relative, Frobenius) of the float64 features of the same fit; otherwise in float64."""
    from kernapprox.estimators.nystrom import CENTRED_ERROR_FACTOR, FLOAT32_FEATURE_TOLERANCE

    x = randn((1024, 16), 30, std).float()
    est = NystromFeatures(num_features=64, rng=0).fit(x)
    bound = torch.finfo(torch.float32).eps * est.amplification()
    direct = bound <= FLOAT32_FEATURE_TOLERANCE
    centred = not direct and bound * CENTRED_ERROR_FACTOR * est.centred_spread() <= FLOAT32_FEATURE_TOLERANCE
    assert est._plan(torch.float32) == ("direct" if direct else "centred" if centred else "float64")
    in_float32 = direct or centred
    assert est.feature_dtype(torch.float32) == (torch.float32 if in_float32 else torch.float64)
    assert est.feature_dtype(torch.float64) == torch.float64
    reference = NystromFeatures(num_features=64, rng=0, precision="float64").fit(x).features(x, "key", log_scale=True)
    phi, logs = est.features(x, "key", log_scale=True)
    assert phi.dtype == torch.float32
    err = float((phi.double() - reference[0].double()).norm() / reference[0].double().norm())
    assert err <= (FLOAT32_FEATURE_TOLERANCE if in_float32 else 1e-6), (std, est.amplification(), err)
    torch.testing.assert_close(logs, reference[1], rtol=1e-6, atol=1e-5)


def test_precision_options():
    x = randn((400, 8), 31, 0.03).float()                     # near-coincident landmarks: a large amplification
    auto = NystromFeatures(num_features=32, rng=0).fit(x)     # ... but small logits: the centred float32 form
    assert auto.amplification() > 1e3 and auto._plan(torch.float32) == "centred"
    assert auto.feature_dtype(torch.float32) == torch.float32
    gen = np.random.default_rng(33)                           # tight clusters far apart: large amplification and
    tight = gen.standard_normal((4, 8))[gen.integers(0, 4, 400)] + 0.01 * gen.standard_normal((400, 8))
    tight = NystromFeatures(num_features=32, rng=0).fit(torch.from_numpy(tight).float())   # large logits
    assert tight.amplification() > 1e3 and tight.feature_dtype(torch.float32) == torch.float64
    assert NystromFeatures(num_features=32, rng=0, precision="input").fit(x).feature_dtype(torch.float32) == \
        torch.float32
    well = randn((400, 8), 32, 1.0).float()
    assert NystromFeatures(num_features=32, rng=0).fit(well).feature_dtype(torch.float32) == torch.float32
    assert NystromFeatures(num_features=32, rng=0, precision="float64").fit(well).feature_dtype(torch.float32) == \
        torch.float64
    with pytest.raises(ValueError, match="precision"):
        NystromFeatures(num_features=4, precision="half")


def _naive_nystrom_gram(x, landmarks, scale):
    """Williams & Seeger (2001), eq. (5) with the pseudo-inverse: ``K(X, Z) K(Z, Z)⁺ K(Z, X)`` of the softmax kernel
    ``exp(s xᵀy)``, straight from the definition in float64 (no scaling, no stabilisation)."""
    x, z = x.double(), torch.as_tensor(landmarks).double() / math.sqrt(scale)
    kxz = torch.exp(scale * x @ z.T)
    return kxz @ torch.linalg.pinv(torch.exp(scale * z @ z.T), hermitian=True) @ kxz.T


@pytest.mark.parametrize("std", [0.15, 1.0])
def test_default_path_equals_the_float64_features_and_the_naive_oracle(std):
    """The default path (float32, precision="auto", no switch) at the benchmark's input scales, d = 64, m = 256: the
    features within the float32 tolerance of the float64 features of the same fit (the small-norm case takes the
    centred form), and ``φφᵀ`` equal to the naive float64 Nyström Gram to the same relative accuracy."""
    from kernapprox.estimators.nystrom import FLOAT32_FEATURE_TOLERANCE

    x = randn((2048, 64), 40, std).float()
    est = ka.make_estimator("nystrom_uniform", num_features=256, rng=0).fit(x)
    assert est._plan(torch.float32) == ("centred" if std < 0.5 else "direct")
    phi = est.features(x, "key")
    assert phi.dtype == torch.float32 and bool(torch.isfinite(phi).all()) and float(phi.abs().amax()) > 0
    exact = ka.make_estimator("nystrom_uniform", num_features=256, rng=0, precision="float64").fit(x)
    phi64 = exact.features(x.double(), "key")
    assert float((phi.double() - phi64).norm() / phi64.norm()) <= FLOAT32_FEATURE_TOLERANCE
    sub = x[:512]
    naive = _naive_nystrom_gram(sub, est.landmarks_, est.scale_)
    approx = est.features(sub, "key").double()
    assert float(relative_frobenius_error(approx @ approx.T, naive)) <= 10 * FLOAT32_FEATURE_TOLERANCE


def test_centred_form_falls_back_to_float64_for_inputs_with_large_logits():
    """A map fitted on small-norm data (centred plan) applied to inputs thirty times larger: the call's own spread ρ
    is too large for float32, so the call is computed in float64 (equal to the float64 map), never a silent loss."""
    x = randn((1024, 64), 41, 0.15).float()
    est = ka.make_estimator("nystrom_uniform", num_features=128, rng=0).fit(x)
    assert est._plan(torch.float32) == "centred"
    far = 30 * randn((256, 64), 42, 0.15).float()
    assert est._centred_log_features(far * math.sqrt(est.scale_), None) is None
    phi, logs = est.features(far, "query", log_scale=True)
    ref = ka.make_estimator("nystrom_uniform", num_features=128, rng=0, precision="float64").fit(x)
    ref_phi, ref_logs = ref.features(far.double(), "query", log_scale=True)
    assert phi.dtype == torch.float32 and bool(torch.isfinite(phi).all())
    assert float((phi.double() - ref_phi).norm() / ref_phi.norm()) <= 1e-6
    torch.testing.assert_close(logs.double(), ref_logs, rtol=1e-6, atol=1e-6)


def test_centred_form_with_buffer_gradients_and_batches():
    """The centred plan: the chunked mode's buffer gets the same ``φ̃``; with a gradient the reference (float64)
    code runs and the gradient is finite; batch dimensions keep one map."""
    x = randn((2, 300, 32), 43, 0.15).float()
    est = ka.make_estimator("nystrom_uniform", num_features=64, rng=0).fit(x)
    assert est._plan(torch.float32) == "centred"
    phi, logs = est.features(x, "key", log_scale=True)
    buffer = torch.empty_like(phi)
    phi_b, logs_b = est.features(x, "key", log_scale=True, buffer=buffer)
    assert phi_b.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(phi_b, phi, rtol=0, atol=0)
    torch.testing.assert_close(logs_b, logs, rtol=0, atol=0)
    torch.testing.assert_close(est.features(x[1], "key"), est.features(x, "key")[1], rtol=1e-6, atol=1e-6)
    xg = x.clone().requires_grad_(True)
    out = est.features(xg, "key")
    out.sum().backward()
    assert bool(torch.isfinite(xg.grad).all())
    torch.testing.assert_close(out.detach(), est.features(x, "key"), rtol=1e-5, atol=1e-6)


def test_default_path_input_checks():
    est = ka.make_estimator("nystrom_uniform", num_features=16, rng=0).fit(randn((64, 8), 44, 0.15).float())
    with pytest.raises(TypeError, match="x"):
        est.features(torch.zeros(4, 8, dtype=torch.int64), "key")
    with pytest.raises(ValueError, match="x"):
        est.features(torch.full((4, 8), float("nan")), "key")
    with pytest.raises(ValueError, match="d=8"):
        est.features(torch.zeros(4, 7), "key")
    with pytest.raises(ValueError, match="overflow"):     # exact-scale features beyond float32: refused, not inf
        est.features(torch.full((2, 8), 1000.0), "key")


def test_one_map_for_the_whole_batch():
    q, k = randn((2, 3, 10, 4), 20), randn((2, 3, 10, 4), 21)
    est = NystromFeatures(num_features=16, rng=0).fit(q, k)
    assert est.features(q, "query").shape == (2, 3, 10, 16)
    # the same map for every batch entry: equal up to the BLAS's batch-shape-dependent summation order
    torch.testing.assert_close(est.features(q[1, 2], "query"), est.features(q, "query")[1, 2], rtol=1e-12, atol=1e-15)


def test_nystrom_input_checks():
    q = randn((5, 3), 0)
    with pytest.raises(ValueError, match="num_features"):
        NystromFeatures(num_features=11).fit(q, q)
    with pytest.raises(ValueError, match="landmarks"):
        NystromFeatures(num_features=4, landmarks="random")
    with pytest.raises(ValueError, match="regularization"):
        NystromFeatures(num_features=4, regularization="tikhonov")
    with pytest.raises(ValueError, match="regularizer"):
        NystromFeatures(num_features=4, regularizer=0.0)
    with pytest.raises(TypeError, match="num_features"):
        NystromFeatures(num_features=4.0)
    assert NystromFeatures.causal_fit is False and NystromFeatures.data_dependent is True


# ------------------------------------------------------------------------------------------ Nyströmformer
def test_segment_means_with_a_remainder():
    x = torch.arange(7, dtype=torch.float64)[:, None].expand(7, 2)
    torch.testing.assert_close(segment_means(x, 3)[:, 0], torch.tensor([0.5, 2.5, 5.0], dtype=torch.float64))
    torch.testing.assert_close(segment_means(x, 7), x)
    with pytest.raises(ValueError, match="num_segments"):
        segment_means(x, 8)


@pytest.mark.parametrize("n", [48, 53])
def test_nystromformer_exact_pinv_rows_sum_to_one(n):
    q, k = clustered(n, 8, 30)[None], clustered(n, 8, 31)[None]
    est = ka.make_estimator("nystromformer_exact", num_features=8).fit(q, k)
    mat = est.kernel_matrix(q, k)
    assert mat.shape == (1, n, n)
    torch.testing.assert_close(mat.sum(-1), torch.ones(1, n, dtype=torch.float64), rtol=0, atol=1e-10)


def test_nystromformer_matches_its_formula_and_kernel_matrix():
    q, k, v = clustered(40, 6, 32)[None], clustered(40, 6, 33)[None], randn((1, 40, 3), 34)
    est = Nystromformer(num_features=5, pinv="exact").fit(q, k)
    s = 1 / math.sqrt(6)
    x, y = q * s**0.5, k * s**0.5
    ql, kl = x.unflatten(-2, (5, 8)).mean(-2), y.unflatten(-2, (5, 8)).mean(-2)
    f, a, b = (torch.softmax(u @ w.mT, -1) for u, w in ((x, kl), (ql, kl), (ql, y)))
    expected = f @ torch.linalg.pinv(a) @ (b @ v)
    out = ka.linear_attention(q, k, v, est, mode="parallel")
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, est.kernel_matrix(q, k) @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("init", ["original", "per_matrix"])
def test_iterative_pinv_converges_to_the_exact_one(init):
    q, k = randn((2, 64, 8), 35, 2.0), randn((2, 64, 8), 36, 2.0)
    exact = Nystromformer(num_features=16, pinv="exact").fit(q, k).kernel_matrix(q, k)
    errors = [float(relative_frobenius_error(
        Nystromformer(num_features=16, pinv_iterations=it, pinv_init=init).fit(q, k).kernel_matrix(q, k),
        exact).max()) for it in (2, 6, 12, 24, 40)]
    assert all(b <= a * 1.0001 or b < 1e-12 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-8 and errors[0] > 1e-3, errors


def test_original_init_couples_the_batch_and_per_matrix_does_not():
    a = torch.softmax(randn((2, 6, 6), 37, 2.0), -1)
    scaled = a.clone()
    scaled[1] = 0.1 * scaled[1]
    for init, coupled in (("original", True), ("per_matrix", False)):
        z, z_scaled = iterative_pinv(a, 3, init), iterative_pinv(scaled, 3, init)
        assert torch.equal(z[0], z_scaled[0]) is not coupled


def test_nystromformer_with_a_landmark_per_token_is_exact():
    q, k, v = randn((2, 9, 4), 38), randn((2, 9, 4), 39), randn((2, 9, 3), 40)
    est = Nystromformer(num_features=16, pinv="exact").fit(q, k)
    out = ka.linear_attention(q, k, v, est, mode="parallel")
    assert float(relative_rms_error(out, ka.softmax_attention(q, k, v)).max()) < 1e-10


def test_nystromformer_is_not_causal_and_parallel_only():
    q, k, v = randn((10, 4), 41), randn((10, 4), 42), randn((10, 2), 43)
    est = ka.make_estimator("nystromformer", num_features=4).fit(q, k)
    with pytest.raises(ValueError, match="not causal"):
        ka.linear_attention(q, k, v, est, causal=True, mode="parallel")
    with pytest.raises(ValueError, match="mode"):
        ka.linear_attention(q, k, v, est, mode="chunked")
    with pytest.raises(ValueError, match="recurrent state"):
        est.state_bytes(4)
    with pytest.raises(ValueError, match="pinv_init"):
        Nystromformer(num_features=4, pinv_init="exact")


def test_nystromformer_renormalize_parts():
    q, k, v = randn((2, 20, 4), 44), randn((2, 20, 4), 45), randn((2, 20, 3), 46)
    est = Nystromformer(num_features=5, renormalize=True).fit(q, k)
    parts = ka.linear_attention(q, k, v, est, mode="parallel", return_parts=True)
    rows = Nystromformer(num_features=5).fit(q, k).kernel_matrix(q, k).sum(-1)
    torch.testing.assert_close(parts.normalizer, rows, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts.output, parts.numerator / parts.normalizer[..., None])


# ------------------------------------------------------------------ the rank-r references (kernel_svd, attention_svd)
@pytest.mark.parametrize("r", [1, 5, 20])
def test_rank_r_floor_error_is_the_singular_value_tail(r):
    q, k = randn((2, 30, 6), 47), randn((2, 25, 6), 48)
    est = ka.make_estimator("kernel_svd", num_features=r).fit(q, k)
    exact = ka.kernel_matrix(q, k)
    sigma = torch.linalg.svdvals(exact)
    tail = sigma[..., r:].pow(2).sum(-1).sqrt()
    err = torch.linalg.matrix_norm(est.kernel_matrix(q, k) - exact)
    torch.testing.assert_close(err, tail, rtol=1e-9, atol=1e-12 * float(sigma[..., 0].max()))
    torch.testing.assert_close(est.singular_values(q, k), sigma, rtol=1e-10, atol=0)


def test_rank_r_floor_is_below_every_rank_r_estimator():
    q, k = clustered(60, 8, 49), clustered(60, 8, 50)
    exact = ka.kernel_matrix(q, k)
    floor = float(relative_frobenius_error(KernelSVD(num_features=8).fit(q, k).kernel_matrix(q, k), exact))
    for name in ("nystrom_uniform", "nystrom_kmeans", "positive_orthogonal"):
        est = ka.make_estimator(name, num_features=8, rng=0).fit(q, k)
        assert floor <= float(relative_frobenius_error(est.kernel_matrix(q, k), exact)), name


def test_rank_r_floor_attention():
    q, k, v = randn((2, 16, 4), 51, 1.5), randn((2, 16, 4), 52, 1.5), randn((2, 16, 3), 53)
    est = KernelSVD(num_features=6).fit(q, k)
    approx = est.kernel_matrix(q, k)
    for causal in (False, True):
        mat = approx.tril() if causal else approx
        expected = (mat @ v) / mat.sum(-1, keepdim=True)
        torch.testing.assert_close(ka.linear_attention(q, k, v, est, causal=causal, mode="parallel"), expected)
    full = KernelSVD(num_features=16).fit(q, k)
    for causal in (False, True):
        out = ka.linear_attention(q, k, v, full, causal=causal, mode="parallel")
        assert float(relative_rms_error(out, ka.softmax_attention(q, k, v, causal)).max()) < 1e-9


def test_rank_r_floor_guards():
    """Logits 720 ± a few: the exact matrix overflows, the SVD of the shifted matrix does not (rows whose
    entries all lie ~37 orders below the global maximum would underflow: the floor is a Frobenius one)."""
    common = torch.full((4,), 27.0, dtype=torch.float64)
    q = common + randn((20, 4), 54, 0.5)
    est = KernelSVD(num_features=20, max_size=16).fit(q, q)
    with pytest.raises(ValueError, match="max_size"):
        est.kernel_matrix(q, q)
    big = KernelSVD(num_features=20).fit(q, q)
    assert not torch.isfinite(ka.kernel_matrix(q, q)).all()          # the exact matrix overflows ...
    out = ka.linear_attention(q, q, q, big, mode="parallel")           # ... the shifted SVD does not
    assert torch.isfinite(out).all()
    assert float(relative_rms_error(out, ka.softmax_attention(q, q, q)).max()) < 1e-6


def _implied_attention(est, q, k):
    """``P̂ = D̂⁻¹ K̂`` of an estimator's implied kernel matrix (non-causal)."""
    mat = est.kernel_matrix(q, k)
    return mat / mat.sum(-1, keepdim=True)


@pytest.mark.parametrize("r", [1, 4, 12])
def test_attention_svd_error_is_the_singular_value_tail(r):
    """Eckart–Young on P = softmax(s QKᵀ): ‖P − P_r‖_F = (Σ_{i>r} σ_i²)^{1/2}, computed here from a plain float64
    softmax and SVD; the output is P_r V; full rank is exact attention."""
    q, k, v = randn((2, 20, 5), 61), randn((2, 18, 5), 62), randn((2, 18, 3), 63)
    est = ka.make_estimator("attention_svd", num_features=r).fit(q, k)
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(5), dim=-1)
    sigma = torch.linalg.svdvals(attn)
    err = torch.linalg.matrix_norm(est.attention_matrix(q, k) - attn)
    torch.testing.assert_close(err, sigma[..., r:].pow(2).sum(-1).sqrt(), rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(est.singular_values(q, k), sigma, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ka.linear_attention(q, k, v, est, mode="parallel"), est.attention_matrix(q, k) @ v)
    row_sums = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(5)).sum(-1, keepdim=True)        # D = diag(K 1)
    torch.testing.assert_close(est.kernel_matrix(q, k), row_sums * est.attention_matrix(q, k))
    full = AttentionSVD(num_features=18).fit(q, k)
    torch.testing.assert_close(full.attention(q, k, v), ka.softmax_attention(q, k, v), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="not causal"):
        est.attention(q, k, v, causal=True)


def test_each_reference_bounds_its_own_matrix_only():
    """On one clustered head at r = 8: attention_svd is below every rank-r method's attention-matrix error and
    kernel_svd below every kernel-matrix error (each is the optimum of its own matrix), but neither is a floor
    for the other's matrix nor for the output: the exact output PV has rank ≤ d_v = 3 < r, so the output floor
    is 0 while both references have a positive output error."""
    q, k = clustered(60, 8, 49), clustered(60, 8, 50)
    v = randn((60, 3), 64)
    r = 8
    exact_k = ka.kernel_matrix(q, k)
    exact_p = torch.softmax(q @ k.T / math.sqrt(8), dim=-1)
    ksvd = KernelSVD(num_features=r).fit(q, k)
    asvd = AttentionSVD(num_features=r).fit(q, k)
    p_floor = float(torch.linalg.matrix_norm(asvd.attention_matrix(q, k) - exact_p))
    k_floor = float(torch.linalg.matrix_norm(ksvd.kernel_matrix(q, k) - exact_k))
    others = {name: ka.make_estimator(name, num_features=r, rng=0).fit(q, k)
              for name in ("nystrom_uniform", "nystrom_kmeans", "positive_orthogonal", "nystromformer")}
    others["kernel_svd"] = ksvd
    for name, est in others.items():
        assert p_floor <= float(torch.linalg.matrix_norm(_implied_attention(est, q, k) - exact_p)), name
        if name != "nystromformer":                         # its kernel_matrix is an attention matrix
            assert k_floor <= float(torch.linalg.matrix_norm(est.kernel_matrix(q, k) - exact_k)), name
    # the attention optimum is not the kernel optimum, nor the reverse
    assert float(torch.linalg.matrix_norm(asvd.kernel_matrix(q, k) - exact_k)) > k_floor
    assert float(torch.linalg.matrix_norm(_implied_attention(ksvd, q, k) - exact_p)) > p_floor
    # no rank-r floor for the output once r ≥ d_v; both references have a positive output error
    assert float(output_error_floor(q, k, v, r)) < 1e-12
    exact_out = exact_p @ v
    for est in (asvd, ksvd):
        assert float(relative_rms_error(ka.linear_attention(q, k, v, est, mode="parallel"), exact_out)) > 1e-3


def test_output_error_floor_below_d_v():
    """r < d_v: the floor is the relative tail of the singular values of PV (plain SVD here), and no rank-r method
    (attention_svd, Nyström, positive features at r) has a smaller relative Frobenius output error."""
    q, k, v = randn((40, 6), 65), randn((40, 6), 66), randn((40, 8), 67)
    out = torch.softmax(q @ k.T / math.sqrt(6), -1) @ v
    sigma = torch.linalg.svdvals(out)
    for r in (1, 3):
        floor = float(output_error_floor(q, k, v, r))
        assert floor == pytest.approx(float(sigma[r:].norm() / sigma.norm()), rel=1e-10)
        for name in ("attention_svd", "nystrom_uniform", "positive"):
            est = ka.make_estimator(name, num_features=r, rng=0).fit(q, k)
            got = ka.linear_attention(q, k, v, est, mode="parallel")
            assert floor <= float(torch.linalg.matrix_norm(got - out) / torch.linalg.matrix_norm(out)), (name, r)
    with pytest.raises(ValueError, match="one row per key"):
        output_error_floor(q, k, v[:5], 2)


def test_fit_leaves_numpy_blas_threads_as_they_were():
    """The fit's m × m eigendecomposition runs on one BLAS thread (kernapprox.estimators.linalg) and restores
    numpy's thread count afterwards."""
    from threadpoolctl import threadpool_info

    before = [(p["internal_api"], p["num_threads"]) for p in threadpool_info() if p["user_api"] == "blas"]
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ka.make_estimator("nystrom_uniform", num_features=32, rng=0).fit(x)
    after = [(p["internal_api"], p["num_threads"]) for p in threadpool_info() if p["user_api"] == "blas"]
    assert after == before
    from kernapprox.estimators.linalg import one_blas_thread
    with one_blas_thread():
        inside = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert inside and all(n == 1 for n in inside)
