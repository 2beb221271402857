"""Numerical extremes: large norms, near-singular Nyström cores, vanishing trigonometric normalisers, half
precision and very long recurrent streams.

What is guaranteed (and checked here):

* positive, hyperbolic, OPRF and dense-exponential features at scaled squared norms ``‖x‖² = 50`` (float32 and
  float64), and positive/hyperbolic up to ``‖x‖² = 1000``: ``kernel_matrix`` is finite wherever the exact kernel
  is finite in that dtype, and attention outputs are finite and agree across the three modes;
* Nyström with duplicated landmarks or nearly collinear points: finite features, the regulariser and the
  effective rank recorded on the estimator, the kernel reproduced on the landmarks' span;
* signed maps whose normaliser is ≤ 0 (trigonometric at large norms, maps with exactly vanishing features):
  outputs may be ±inf or of either sign, but every such row is counted by
  :func:`kernapprox.metrics.nonpositive_normalizer_rate` and the error metrics report ``inf``; nothing raises;
* float16/bfloat16 input: features, sums and divisions run in float32 and the result is exactly the float32
  computation rounded once to the input dtype;
* a :class:`kernapprox.RecurrentState` stream whose key log-scales swing over ~10³ nats (so the exact-scale
  features underflow to zero and ``exp(ωᵀk)`` alone overflows float32) stays finite and equals the chunked mode.

* features of one vector spanning more than the dtype's range (OPRF/DERF in float32 at ``‖x‖² ≳ 150``, and in
  float64 at ``‖x‖² ≳ 1000``): ``kernel_matrix`` and attention in every mode equal the estimator's exact value,
  computed in the log domain (:mod:`kernapprox.attention.logdomain`; the issue's case ``q = k = v = 8·N(0, 1)``
  included), a float32 :class:`kernapprox.RecurrentState` that cannot hold such a stream raises instead of
  returning NaN, and exact-scale features that underflow or overflow raise naming the fix.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.estimators.deterministic import DPFPFeatures
from kernapprox.metrics import nonpositive_normalizer_rate, relative_rms_error

POSITIVE_FAMILIES = ["positive", "positive_orthogonal", "hyperbolic", "hyperbolic_orthogonal"]
FITTED_FAMILIES = ["oprf", "oprf_orthogonal", "sderf", "saderf", "aderf", "gerf"]
D, N, DV = 8, 12, 3


def on_sphere(shape, sq_norm, seed, d=D):
    """Inputs whose *scaled* squared norm ``‖q/d^{1/4}‖²`` (the default scale ``s = 1/sqrt(d)``) is ``sq_norm``."""
    x = np.random.default_rng(seed).standard_normal((*shape, d))
    x *= math.sqrt(sq_norm) * d**0.25 / np.linalg.norm(x, axis=-1, keepdims=True)
    return torch.from_numpy(x)


def large_norm_inputs(sq_norm, seed, dtype):
    q, k = on_sphere((2, N), sq_norm, seed), on_sphere((2, N), sq_norm, seed + 1)
    k[:, :3] = q[:, :3]                                          # aligned pairs: the largest kernel values
    v = torch.from_numpy(np.random.default_rng(seed + 2).standard_normal((2, N, DV)))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_finite_where_true_is(name, sq_norm, dtype, seed=0):
    q, k, v = large_norm_inputs(sq_norm, seed, dtype)
    est = ka.make_estimator(name, num_features=16, rng=seed).fit(q, k)
    exact = ka.kernel_matrix(q, k)
    approx = est.kernel_matrix(q, k)
    assert approx.dtype == dtype
    bad = torch.isfinite(exact) & ~torch.isfinite(approx)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite entries where the exact kernel is finite"
    outputs = {}
    for causal in (False, True):
        for mode in ka.MODES:
            out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=5)
            assert torch.isfinite(out).all(), f"{name} {mode} causal={causal}: non-finite attention output"
            outputs[mode, causal] = out
        tol = 1e-4 if dtype == torch.float32 else 1e-9
        for mode in ("recurrent", "chunked"):
            torch.testing.assert_close(outputs[mode, causal], outputs["parallel", causal], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", POSITIVE_FAMILIES + FITTED_FAMILIES)
def test_large_norms_stay_finite(name, dtype):
    check_finite_where_true_is(name, 50.0, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("sq_norm", [200.0, 1000.0])
@pytest.mark.parametrize("name", POSITIVE_FAMILIES)
def test_very_large_norms_positive_and_hyperbolic(name, sq_norm, dtype):
    check_finite_where_true_is(name, sq_norm, dtype)


@pytest.mark.parametrize("name", FITTED_FAMILIES[:-1])
def test_very_large_norms_fitted_exponential_maps_in_float64(name):
    check_finite_where_true_is(name, 200.0, torch.float64)


@pytest.mark.parametrize("name", FITTED_FAMILIES[:-1])
def test_very_large_norms_fitted_exponential_maps_in_float32(name):
    """Was a strict xfail (the features of one vector span more than float32's range): now exact."""
    check_finite_where_true_is(name, 200.0, torch.float32)


def log_domain_oracle(q, k, v, est, causal):
    """Plain float64 loops: ``κ̂(q_i, k_j) = Σ_l exp(L_q,il + L_k,jl)`` from the exact log-features, the largest
    exponent of each pair and of each row factored out by hand."""
    lq, _ = est.log_features(q.double(), "query")
    lk, _ = est.log_features(k.double(), "key")
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            keys = range(i + 1 if causal else k.shape[1])
            logs = []
            for j in keys:
                terms = lq[b, i] + lk[b, j]
                top = float(terms.max())
                logs.append(top + math.log(float(torch.exp(terms - top).sum())))
            top = max(logs)
            w = torch.tensor([math.exp(a - top) for a in logs], dtype=torch.float64)
            out[b, i] = (w[:, None] * v[b, : len(w)].double()).sum(0) / w.sum()
    return out


WIDE_SPAN = ["sderf", "sderf_orthogonal", "sderf_qmc", "saderf", "saderf_orthogonal", "saderf_qmc", "aderf",
             "aderf_orthogonal", "aderf_qmc", "oprf_qmc"]


@pytest.mark.parametrize("name", WIDE_SPAN)
def test_issue_case_dense_exponential_maps_in_float32(name):
    """The reported case: q = k = v = 8·N(0, 1), n = 16, d = 8 (‖x‖² ≈ 180 after scaling) in float32 gave NaN/Inf
    in about one draw in four. Now every mode, causal or not, equals the float64 log-domain loop oracle for 8
    draws (to float32 rounding of logits of size ~10², relative to max |v|)."""
    for seed in range(8):
        q = 8 * torch.from_numpy(np.random.default_rng(seed).standard_normal((1, 16, 8))).float()
        est = ka.make_estimator(name, num_features=16, rng=seed).fit(q, q)
        for causal in (False, True):
            want = log_domain_oracle(q, q, q, est, causal)
            for mode in ka.MODES:
                out = ka.linear_attention(q, q, q, est, causal, mode, chunk_size=5)
                assert out.dtype == torch.float32 and torch.isfinite(out).all(), (name, seed, mode, causal)
                torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5 * float(q.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("sq_norm", [400.0, 4000.0])
@pytest.mark.parametrize("name", ["oprf", "sderf", "saderf", "positive", "hyperbolic_orthogonal"])
def test_features_spanning_beyond_the_dtype_are_exact_in_every_mode(name, sq_norm, dtype):
    """Beyond float32's range (400) and beyond float64's (4000, where the float64 retry also fails and the exact
    log-domain path is taken): finite outputs equal to the loop oracle; the kernel matrix equals the log-domain
    Gram (rounded once) wherever that is representable."""
    q, k, v = large_norm_inputs(sq_norm, 3, dtype)
    est = ka.make_estimator(name, num_features=16, rng=3).fit(q, k)
    for causal in (False, True):
        want = log_domain_oracle(q, k, v, est, causal)
        for mode in ka.MODES:
            parts = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=5, return_parts=True)
            assert torch.isfinite(parts.output).all() and (parts.normalizer > 0).all()
            tol = 1e-9 if dtype == torch.float64 else 3e-7 * sq_norm
            torch.testing.assert_close(parts.output.double(), want, rtol=0, atol=tol * float(v.abs().max()))
    lq, _ = est.log_features(q.double(), "query")
    lk, _ = est.log_features(k.double(), "key")
    log_gram = torch.logsumexp(lq[..., :, None, :] + lk[..., None, :, :], -1)
    approx = est.kernel_matrix(q, k)
    info = torch.finfo(dtype)
    representable = (log_gram < math.log(info.max) - 1) & (log_gram > math.log(info.tiny) + 1)
    torch.testing.assert_close(torch.log(approx.double())[representable], log_gram[representable],
                               rtol=0, atol=(1e-9 if dtype == torch.float64 else 1e-6) * sq_norm)
    assert (approx[log_gram < math.log(info.tiny) - 1].abs() < info.tiny).all()
    assert torch.isinf(approx[log_gram > math.log(info.max) + 1]).all()


def test_recurrent_state_raises_where_float32_cannot_hold_the_stream():
    """A float32 state whose reads lost their dominant terms raises (the fix is float64), never returns NaN; the
    same stream in float64 equals the chunked mode."""
    q, k, v = large_norm_inputs(200.0, 0, torch.float32)
    est = ka.make_estimator("oprf", num_features=16, rng=0).fit(q, k)
    state = ka.RecurrentState(est)
    with pytest.raises(ValueError, match="float64"):
        for t in range(N):
            out = state.step(q[:, t], k[:, t], v[:, t])
            assert torch.isfinite(out).all()
    state = ka.RecurrentState(est)
    q64, k64, v64 = q.double(), k.double(), v.double()
    outs = torch.stack([state.step(q64[:, t], k64[:, t], v64[:, t]) for t in range(N)], 1)
    torch.testing.assert_close(outs, ka.linear_attention(q64, k64, v64, est, True, "chunked", chunk_size=5))


def test_exact_scale_features_that_underflow_or_overflow_raise():
    """``features(x)`` at exact scale: rows that underflow entirely (positive maps at large norms) or overflow
    (trigonometric) raise naming the cause and the fix; the stabilised pair and log_features are still exact."""
    x = on_sphere((1, 4), 2000.0, 0)
    for name, word in (("positive", "underflow"), ("hyperbolic", "underflow"), ("oprf", "underflow|overflow"),
                       ("trig", "overflow")):
        est = ka.make_estimator(name, num_features=8, rng=0).fit(x)
        with pytest.raises(ValueError, match=word) as info:
            est.features(x)
        assert "log_scale=True" in str(info.value)
        tilde, logs = est.features(x, log_scale=True)
        log_abs, _ = est.log_features(x)
        kept = tilde != 0                                     # where φ̃ underflowed, log_features still has the value
        torch.testing.assert_close((torch.log(tilde.abs()) + logs[..., None])[kept], log_abs[kept], rtol=1e-12,
                                   atol=1e-9)
        assert torch.isfinite(log_abs).all()


# --------------------------------------------------------------------------------- near-singular Nyström
@pytest.mark.parametrize("regularization", ["cutoff", "ridge"])
@pytest.mark.parametrize("landmarks", ["uniform", "kmeans", "rls"])
def test_nystrom_with_duplicated_landmarks(landmarks, regularization):
    distinct = np.random.default_rng(0).standard_normal((3, 4))
    points = torch.from_numpy(np.repeat(distinct, 5, axis=0)[None])           # 15 points, 3 distinct
    est = ka.make_estimator(f"nystrom_{landmarks}", num_features=8, rng=0, regularization=regularization,
                            regularizer=1e-8).fit(points, points)
    assert est.effective_rank_ == 3 and est.regularizer_ == 1e-8
    assert est.eigenvalues_.shape == (8,) and est.eigenvalues_[3:].max() < 1e-8 * est.eigenvalues_[0] + 1e-12
    assert torch.isfinite(est.features(points)).all() and torch.isfinite(est.whitening_ if torch.is_tensor(
        est.whitening_) else torch.from_numpy(est.whitening_)).all()
    exact = ka.kernel_matrix(points, points)
    error = float((est.kernel_matrix(points, points) - exact).norm() / exact.norm())
    assert error < (1e-10 if regularization == "cutoff" else 1e-6)          # the span holds every point
    v = torch.from_numpy(np.random.default_rng(1).standard_normal((1, 15, 2)))
    outs = [ka.linear_attention(points, points, v, est, True, mode, chunk_size=4) for mode in ka.MODES]
    for out in outs:
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, outs[0], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("landmarks", ["uniform", "kmeans", "rls"])
def test_nystrom_with_nearly_collinear_points(landmarks):
    base = np.random.default_rng(2).standard_normal(4)
    t = np.linspace(0.0, 1e-6, 10)
    points = torch.from_numpy((base + t[:, None] * np.ones(4))[None])        # 10 points within 2e-6
    est = ka.make_estimator(f"nystrom_{landmarks}", num_features=6, rng=0).fit(points)
    assert 1 <= est.effective_rank_ < 6                                       # near-singular core: recorded
    assert torch.isfinite(est.features(points)).all()
    exact = ka.kernel_matrix(points, points)
    assert float((est.kernel_matrix(points, points) - exact).norm() / exact.norm()) < 1e-8
    v = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 10, 2)))
    for mode in ka.MODES:
        parts = ka.linear_attention(points, points, v, est, True, mode, return_parts=True)
        assert torch.isfinite(parts.output).all() and float(nonpositive_normalizer_rate(parts.normalizer)) == 0.0


@pytest.mark.parametrize("name", ["nystromformer", "nystromformer_exact"])
def test_nystromformer_with_identical_tokens(name):
    """Identical rows make the landmark block singular (rank 1); the pseudo-inverse keeps the output finite."""
    x = torch.from_numpy(np.repeat(np.random.default_rng(4).standard_normal((1, 1, 4)), 12, axis=1))
    v = torch.from_numpy(np.random.default_rng(5).standard_normal((1, 12, 2)))
    est = ka.make_estimator(name, num_features=4).fit(x)
    out = ka.linear_attention(x, x, v, est, mode="parallel")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ka.softmax_attention(x, x, v), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- vanishing normalisers
@pytest.mark.parametrize("mode", ka.MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_trig_normalisers_near_zero_are_measured_not_hidden(mode, causal):
    """Trigonometric features at large norms: normalisers ≤ 0 happen; they are counted, outputs are never NaN
    from a positive normaliser, and the error metric says ``inf`` when an output is not finite."""
    rates = []
    for seed in range(4):
        q, k, v = large_norm_inputs(12.0, seed, torch.float64)
        est = ka.make_estimator("trig", num_features=8, rng=seed).fit(q, k)
        parts = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=5, return_parts=True)
        flagged = (parts.normalizer <= 0) | ~torch.isfinite(parts.normalizer)
        assert not (~torch.isfinite(parts.output).all(-1) & ~flagged).any()
        assert torch.equal(nonpositive_normalizer_rate(parts.normalizer), flagged.double().mean(-1))
        rates.append(float(nonpositive_normalizer_rate(parts.normalizer).mean()))
        exact = ka.softmax_attention(q, k, v, causal)
        err = relative_rms_error(parts.output, exact)
        assert (torch.isinf(err) == ~torch.isfinite(parts.output).all(-1).all(-1)).all()
    assert max(rates) > 0                                       # the regime is reached by these inputs


def test_exactly_zero_normaliser_gives_a_flagged_row():
    """A map whose features vanish exactly (DPFP of a zero query) divides 0 by 0: NaN, counted, no exception."""
    q = torch.zeros(1, 4, D, dtype=torch.float64)
    k = torch.from_numpy(np.random.default_rng(6).standard_normal((1, 4, D)))
    v = torch.ones(1, 4, 2, dtype=torch.float64)
    est = DPFPFeatures(nu=1).fit(q, k)
    for mode in ka.MODES:
        parts = ka.linear_attention(q, k, v, est, True, mode, return_parts=True)
        assert (parts.normalizer == 0).all() and torch.isnan(parts.output).all()
        assert float(nonpositive_normalizer_rate(parts.normalizer)) == 1.0


# ---------------------------------------------------------------------------------------- half precision
def _has_feature_map(est):
    return est.capabilities().kind == "features"


def _size(name, r):
    return None if ka.capabilities(name).fixed_dimension else r


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", ka.available_estimators())
def test_half_precision_is_the_float32_computation_rounded_once(name, half):
    g = np.random.default_rng(7)
    q, k, v = (torch.from_numpy(g.standard_normal(s)).to(half) for s in ((2, 9, 4), (2, 9, 4), (2, 9, 3)))
    q32, k32, v32 = q.float(), k.float(), v.float()
    options = {"window": 3} if name in ("window_linear", "scatterbrain") else {}
    est = ka.make_estimator(name, num_features=_size(name, 4), rng=0, **options).fit(q, k)
    same = ka.make_estimator(name, num_features=_size(name, 4), rng=0, **options).fit(q32, k32)
    for causal in (False, True) if est.capabilities().causal else (False,):
        for mode in est.capabilities().modes:
            out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=4)
            assert out.dtype == half
            assert torch.equal(out, ka.linear_attention(q32, k32, v32, same, causal, mode, chunk_size=4).to(half))
    km = est.kernel_matrix(q, k)
    assert km.dtype == half and torch.equal(km, same.kernel_matrix(q32, k32).to(half))
    if _has_feature_map(est):
        phi = est.features(k, "key")
        assert phi.dtype == half and torch.equal(phi, same.features(k32, "key").to(half))
        tilde, log_scale = est.features(k, "key", log_scale=True)
        assert tilde.dtype == torch.float32 and log_scale.dtype == torch.float32


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision_exact_paths_and_recurrent_state(half):
    g = np.random.default_rng(8)
    q, k, v = (torch.from_numpy(g.standard_normal(s) * 3).to(half) for s in ((2, 9, 4), (2, 9, 4), (2, 9, 3)))
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert torch.equal(ka.kernel_matrix(q, k), ka.kernel_matrix(q32, k32).to(half))
    assert torch.equal(ka.log_kernel_matrix(q, k), ka.log_kernel_matrix(q32, k32).to(half))
    for causal in (False, True):
        out = ka.softmax_attention(q, k, v, causal)
        assert out.dtype == half and torch.equal(out, ka.softmax_attention(q32, k32, v32, causal).to(half))
    # logits beyond float16's exp range (e^11 > 65504): computed in float32, the output stays finite
    big = q * 8
    assert torch.isfinite(ka.softmax_attention(big, big, v)).all()
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q32)
    state, state32 = ka.RecurrentState(est), ka.RecurrentState(est)
    for t in range(9):
        y = state.step(q[:, t], k[:, t], v[:, t])
        y32 = state32.step(q32[:, t], k32[:, t], v32[:, t])
        assert y.dtype == half and torch.equal(y, y32.to(half))
    assert state.state[0].dtype == torch.float32


# ------------------------------------------------------------------------------------ long recurrent stream
def test_long_recurrent_stream_with_swinging_log_scales(length=20_000):
    """FAVOR+ over a long float32 stream whose key norms swing between 0.5 and 40 (scaled): key log-scales
    range over ~10³ nats, the exact-scale key features underflow to 0 and ``exp(ωᵀk)`` alone overflows, so an
    un-stabilised state would give 0/0 or inf/inf. The running stabiliser keeps every output finite and equal
    to the chunked mode (and to float64)."""
    d = 3
    g = np.random.default_rng(9)
    est = ka.make_estimator("positive_orthogonal", num_features=16, rng=0).fit(torch.zeros(1, d))
    directions = g.standard_normal((length, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radius = 0.5 + 40 * np.abs(np.cos(np.linspace(0, 7 * np.pi, length)))   # starts large: c must grow later
    k = torch.from_numpy(directions * radius[:, None] * d**0.25).float()
    q = torch.from_numpy(g.standard_normal((length, d))).float()
    v = torch.from_numpy(g.standard_normal((length, 2))).float()
    _, log_k = est.features(k, "key", log_scale=True)
    assert float(log_k.max() - log_k.min()) > 500
    with pytest.raises(ValueError, match="underflow"):                      # exact scale underflows: refused
        est.features(k, "key")
    assert not torch.isfinite(torch.exp(k @ torch.from_numpy(est.projection_).float().T / d**0.25)).all()
    state = ka.RecurrentState(est, check_finite=False)
    outputs = torch.stack([state.step(q[t], k[t], v[t]) for t in range(length)])
    assert state.num_tokens == length and torch.isfinite(outputs).all()
    chunked = ka.linear_attention(q[None], k[None], v[None], est, True, "chunked", chunk_size=128)[0]
    # key log-scales of ~10³ nats carry float32 rounding of ulp(10³) ≈ 6e-5 into the key weights, whichever mode
    torch.testing.assert_close(outputs, chunked, rtol=1e-4, atol=1e-4)
    reference = ka.linear_attention(q[None].double(), k[None].double(), v[None].double(), est, True, "chunked",
                                    chunk_size=512)[0]
    torch.testing.assert_close(outputs.double(), reference, rtol=1e-3, atol=1e-4)
