"""Nyström feature maps of the softmax kernel, with uniform, k-means and ridge-leverage-score landmarks.

The Nyström method approximates a kernel through ``m`` landmarks ``z_1..z_m``:
``K(q, k) ≈ K(q, Z) K(Z, Z)⁺ K(Z, k)``. Written as a feature map ``φ(x) = W K(Z, x)`` with ``WᵀW = K(Z, Z)⁺`` it
is a linear-attention estimator like any other, with a recurrent state of ``r = m`` features.

Scaling of the softmax kernel
-----------------------------
In scaled coordinates ``x = sqrt(s)·q`` the softmax kernel is ``SM(x, y) = exp(xᵀy) = e^{‖x‖²/2} G(x, y)
e^{‖y‖²/2}`` with the Gaussian kernel ``G(x, y) = exp(−‖x − y‖²/2) ∈ (0, 1]``. So ``K(Z, Z) = D G(Z, Z) D`` with
``D = diag(exp(‖z_j‖²/2))``, and ``K(Z, Z)⁺ = D⁻¹ G(Z, Z)⁺ D⁻¹`` (``D`` is invertible). This module therefore
factorises ``G(Z, Z) = U Λ Uᵀ`` (well scaled: unit diagonal, entries in (0, 1]) in float64 and uses

    ``φ(x) = G(Z, Z)^{+1/2} D⁻¹ K(Z, x)``,  ``(D⁻¹ K(Z, x))_j = exp(z_jᵀx − ‖z_j‖²/2)``,

one of the square roots of ``K(Z, Z)⁺`` (``φ(q)ᵀφ(k) = K(q, Z) K(Z, Z)⁺ K(Z, k)`` exactly). The Nyström
approximation commutes with the diagonal scaling, so ``φ(q)ᵀφ(k) = e^{‖x‖²/2} Ĝ(x, y) e^{‖y‖²/2}`` where ``Ĝ`` is
the Nyström approximation of the Gaussian kernel with the same landmarks. Stabilised features: ``ℓ(x) =
max_j (z_jᵀx − ‖z_j‖²/2)`` and ``φ̃(x) = G(Z, Z)^{+1/2} exp(Zx − ‖z‖²/2 − ℓ(x))``; then ``‖φ̃(x)‖² ≤
exp(min_j ‖x − z_j‖²)``, independent of the norms.

Regularisation is explicit and recorded: either an eigenvalue cut-off (``G(Z, Z)`` eigenvalues below
``regularizer · λ_max`` are dropped: the pseudo-inverse) or a ridge (``G(Z, Z) + regularizer · I``; as ``G``
has unit diagonal this is relative to the mean eigenvalue, and equals the ridge ``K(Z, Z) + λ D²``). The fitted
attributes ``regularizer_``, ``effective_rank_`` and ``eigenvalues_`` say what was done.

References
----------
Williams & Seeger, *Using the Nyström Method to Speed Up Kernel Machines*, NeurIPS 2001.
Zhang, Tsang & Kwok, *Improved Nyström low-rank approximation and error analysis*, ICML 2008 (k-means landmarks).
Musco & Musco, *Recursive Sampling for the Nyström Method*, NeurIPS 2017, Algorithm 3 (ridge leverage scores).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..validation import check_choice, check_positive_float, check_positive_int
from . import fused
from .base import FeatureMap
from .linalg import one_blas_thread
from .registry import register

LANDMARK_METHODS = ("uniform", "kmeans", "rls")
REGULARIZATIONS = ("cutoff", "ridge")
DEFAULT_REGULARIZER = 1e-10
PRECISIONS = ("auto", "float64", "input")
# precision="auto" computes float32 (and half) features in float32 when eps32 · amplification() is at most this
# (measured: the float32 features are then within about this relative error of the float64 ones), else in float64.
FLOAT32_FEATURE_TOLERANCE = 1e-5
# The centred evaluation's error is at most this many times eps32 · amplification() · ρ (ρ: the root mean square of
# expm1(t), see NystromFeatures.centred_spread), measured 0.83-1.05x where it is used and 1.26x at most below that.
CENTRED_ERROR_FACTOR = 1.25
RLS_FALLBACK_LAMBDA = 1e-5   # recursiveNystrom.m's ``10e-6``, which is 1e-5 (not 1e-6)


# ------------------------------------------------------------------------------------ kernels and scores
def gaussian_gram(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``G(a_i, b_j) = exp(−‖a_i − b_j‖²/2)`` for float64 arrays ``(n, d)``, ``(m, d)`` → ``(n, m)``."""
    sq = 0.5 * (a * a).sum(-1)[:, None] + 0.5 * (b * b).sum(-1)[None, :] - a @ b.T
    return np.exp(-np.maximum(sq, 0.0))


def ridge_leverage_scores(gram: np.ndarray, lam: float) -> np.ndarray:
    """Exact λ-ridge leverage scores ``τ_i(λ) = (K (K + λI)⁻¹)_ii`` of a PSD matrix ``(n, n)`` (float64).

    They sum to the effective dimension ``d_eff(λ) = Σ_i λ_i/(λ_i + λ)`` (see :func:`effective_dimension`).
    Quadratic memory: for tests and small studies.
    """
    lam = check_positive_float(lam, "lam")
    gram = np.asarray(gram, dtype=np.float64)
    n = gram.shape[0]
    return np.diag(np.linalg.solve(gram + lam * np.eye(n), gram)).copy()


def effective_dimension(gram: np.ndarray, lam: float) -> float:
    """``d_eff(λ) = tr(K (K + λI)⁻¹) = Σ_i λ_i / (λ_i + λ)`` for a PSD matrix ``K`` (float64)."""
    lam = check_positive_float(lam, "lam")
    eig = np.clip(np.linalg.eigvalsh(np.asarray(gram, dtype=np.float64)), 0.0, None)
    return float((eig / (eig + lam)).sum())


class RLSSample(NamedTuple):
    """Result of :func:`recursive_rls_sample`."""

    indices: np.ndarray   # (s,) chosen points, without repetition
    scores: np.ndarray    # (n,) estimated λ-ridge leverage scores of all points at the top level, in [0, 1]
    lam: float            # the ridge λ of the top level


def recursive_rls_sample(points: np.ndarray, num_samples: int, rng: np.random.Generator) -> RLSSample:
    """Recursive ridge-leverage-score sampling (Musco & Musco 2017, Algorithm 3) for the Gaussian kernel.

    Levels halve a random permutation of the ``n`` points down to about ``s`` points. Going back up, each level
    estimates the λ-ridge leverage scores of its points from the weighted sample of the level below,

        ``l_i = min(1, max(0, G_ii − g_iᵀ (SGS + λ W⁻²)⁻¹ g_i) / λ)``,

    with ``λ = (Σ_j G_jj w_j² − Σ_{top k} eig(W S G S W)) / k`` (``k = ceil(s / (4 log s))``; ``λ = 1e-5`` when
    the sample has at most ``k`` points, or when this λ is not positive), keeps each point with probability
    ``min(1, log(s)·l_i)`` (weights ``1/sqrt(p_i)``) on intermediate levels, and on the top level draws exactly
    ``s`` points without replacement with probabilities ``∝ l_i``. ``G`` is the Gaussian kernel of the scaled
    points (unit diagonal), see the module docstring for why it stands in for the softmax kernel.

    Deviations from ``recursiveNystrom.m``, all for degenerate sizes: the oversampling factor ``log s`` is
    floored at 1 (``s < 3``); if fewer than ``s`` points have a positive top-level score, the rest are drawn
    uniformly from the others; an empty intermediate sample falls back to a uniform one (as in the reference).

    Parameters
    ----------
    points : ndarray (n, d)
        Candidate points (float64).
    num_samples : int
        ``s ≤ n``.
    rng : numpy Generator

    Returns
    -------
    RLSSample
        ``indices`` (s,), ``scores`` (n,) and ``lam``: the top-level estimates sum to about ``d_eff(λ)``.
    """
    points = np.asarray(points, dtype=np.float64)
    n = points.shape[0]
    s = check_positive_int(num_samples, "num_samples")
    if s > n:
        raise ValueError(f"num_samples must be at most the number of points ({n}), got {s}")
    if s == n:
        return RLSSample(np.arange(n), np.ones(n), RLS_FALLBACK_LAMBDA)
    oversample = max(math.log(s), 1.0)
    k = math.ceil(s / (4 * oversample))
    num_levels = math.ceil(math.log2(n / s))
    perm = rng.permutation(n)
    sizes = [n]
    for _ in range(num_levels):
        sizes.append(math.ceil(sizes[-1] / 2))
    sample = np.arange(sizes[-1])                       # positions (in perm) of the current sample
    weights = np.ones(sizes[-1])
    for level in range(num_levels - 1, -1, -1):
        current = points[perm[:sizes[level]]]
        chosen = current[sample]
        cross = gaussian_gram(current, chosen)          # (size_level, |sample|)
        inner = cross[sample]
        lam = _rls_lambda(inner, weights, k)
        solved = np.linalg.solve(inner + np.diag(lam / weights**2), cross.T)   # (|sample|, size_level)
        residual = np.maximum(0.0, 1.0 - np.einsum("ij,ji->i", cross, solved))  # G_ii = 1
        if level > 0:
            probs = np.minimum(1.0, oversample * residual / lam)
            sample = np.flatnonzero(rng.random(sizes[level]) < probs)
            if sample.size == 0:
                probs = np.full(sizes[level], s / sizes[level])
                sample = rng.choice(sizes[level], size=s, replace=False)
            weights = 1.0 / np.sqrt(probs[sample])
        else:
            scores = np.minimum(1.0, residual / lam)
            sample = _weighted_sample_without_replacement(scores, s, rng)
    top_scores = np.empty(n)
    top_scores[perm] = scores
    return RLSSample(np.sort(perm[sample]), top_scores, float(lam))


def _rls_lambda(inner: np.ndarray, weights: np.ndarray, k: int) -> float:
    if k >= inner.shape[0]:
        return RLS_FALLBACK_LAMBDA
    weighted = inner * weights[:, None] * weights[None, :]
    top = np.abs(np.linalg.eigvalsh(weighted)[-k:]).sum()
    lam = ((np.diag(inner) * weights**2).sum() - top) / k
    return float(lam) if lam > 0 else RLS_FALLBACK_LAMBDA


def _weighted_sample_without_replacement(scores, s, rng):
    positive = np.flatnonzero(scores > 0)
    if positive.size >= s:
        return rng.choice(scores.size, size=s, replace=False, p=scores / scores.sum())
    rest = np.setdiff1d(np.arange(scores.size), positive)
    return np.concatenate([positive, rng.choice(rest, size=s - positive.size, replace=False)])


# ------------------------------------------------------------------------------------------ the feature map
class NystromFeatures(FeatureMap):
    r"""Nyström features of the softmax kernel: ``φ(q)ᵀφ(k) = K(q, Z) K(Z, Z)⁺ K(Z, k)``.

    .. math::
        φ(x) = G(Z,Z)^{+1/2}\,\big(e^{z_j^⊤x − \|z_j\|^2/2}\big)_{j=1..m},\qquad
        G(Z,Z)_{ij} = e^{-\|z_i − z_j\|^2/2}

    (in scaled coordinates ``x = sqrt(s)·q``; the module docstring derives why this equals
    ``K(Z, Z)^{+1/2} K(Z, x)`` up to an orthogonal rotation, which leaves every ``φ(q)ᵀφ(k)`` unchanged).
    **Biased** (``K̂ ⪯ K`` in the PSD order on the landmarks' span), **signed** (the normaliser
    ``Σ_j φ(q)ᵀφ(k_j)`` may be ≤ 0), **data-dependent**, deterministic given the landmarks. With every point as a
    landmark it reproduces the kernel on those points (up to the cut-off). The error falls to zero as ``m`` grows
    to the number of candidate points (``consistent``).

    Landmarks are chosen from the joint set of scaled queries and keys of ``fit(q, k)`` (all batch elements
    pooled: one map for the whole batch; fit per head for per-head maps):

    ``"uniform"``
        ``m`` distinct points uniformly without replacement (Williams & Seeger 2001).
    ``"kmeans"``
        the ``m`` centroids of scikit-learn's ``KMeans`` (k-means++, seed drawn from ``rng``) in the
        scaled space (Zhang, Tsang & Kwok 2008).
    ``"rls"``
        ``m`` points by recursive ridge-leverage-score sampling (Musco & Musco 2017, Algorithm 3) of
        the Gaussian kernel, see :func:`recursive_rls_sample`; scores in ``leverage_scores_``.

    Causality: fitting on the sequence the map is applied to uses future tokens (``causal_fit = False``). For a
    strictly causal model fit on a calibration prefix (or other sequences) and then run the recurrent mode: the
    map is then fixed and the state update is causal.

    Precision: ``G(Z, Z)`` is factorised in float64 (the whitening is always computed and stored in float64).
    The features are computed in the dtype :meth:`feature_dtype` chooses and returned in the input's compute
    dtype. A relative rounding ``ε`` of ``exp(Zx − ‖z‖²/2)`` reaches the features amplified by
    ``a = sqrt(λ_max/λ_min)`` of the eigenvalues the whitening inverts (:meth:`amplification`); measured on
    Gaussian data with ``a`` from 1 to 1.2e4, the relative error of float32 features against float64 ones was at
    most ``0.8 ε₃₂ a`` (plus ``ε₃₂`` times the logits' size), and that of the kernel matrix ten times less. So
    ``precision="auto"`` (default) computes float32 features in float32 when ``ε₃₂ a ≤ 1e-5``
    (:data:`FLOAT32_FEATURE_TOLERANCE`; ``a ≤ 84``, typical of well-spread landmarks, as in the benchmarks).
    Beyond that (landmarks close together: small input norms, e.g. input standard deviation 0.15 at ``d = 64``,
    where ``a ≈ 200–700`` for ``m = 256–1024``) it uses the centred form of the same map: with ``e = exp(t) =
    1 + expm1(t)``, ``φ̃ = 1ᵀG^{+1/2} + expm1(t) G^{+1/2}`` (the constant row ``1ᵀG^{+1/2}`` in float64, then
    rounded). Close landmarks mean small ``t`` (``|expm1(t)|`` about 0.08 there), and the rounding of ``expm1(t)``
    is relative to its own size, so the error becomes about ``ε₃₂ a ρ`` with ``ρ`` the root mean square of
    ``expm1(t)`` (measured 0.83–1.05 ``ε₃₂ a ρ`` where it is used; :data:`CENTRED_ERROR_FACTOR`). It is used when
    :data:`CENTRED_ERROR_FACTOR` ``· ε₃₂ a ρ ≤ 1e-5``, ``ρ`` estimated at the fit from the landmarks
    (:meth:`centred_spread`) and checked on each call's own ``expm1(t)`` (a call whose inputs lie farther out is
    computed in float64). Otherwise, and for calls that need a gradient, it computes in float64. The float32
    computations (direct and centred) run at the speed of scikit-learn's float32 ``Nystroem`` or faster; the
    float64 one took 2–3× as long (``python -m benchmarks.run --cases nystrom_vs_sklearn``). ``"float64"``
    always uses float64; ``"input"`` always the input's compute dtype, directly (scikit-learn's ``Nystroem``
    convention). Float64 inputs are always computed in float64.

    Parameters
    ----------
    num_features : int
        ``m``, the number of landmarks (= the state's feature dimension ``r``); at most the number of candidate
        points ``prod(batch) · (n_q + n_k)``.
    landmarks : {"uniform", "kmeans", "rls"}
    regularization : {"cutoff", "ridge"}
        Eigenvalue cut-off (pseudo-inverse) or ridge on ``G(Z, Z)``.
    regularizer : float
        The relative cut-off (eigenvalues ``< regularizer · λ_max`` are dropped) or the ridge ``λ``. Default
        ``1e-10``: well below the approximation errors of practical ranks, and the landmarks of a float32 copy of
        the data (which differ by the inputs' rounding, amplified by up to ``regularizer^{-1/2}``) still give
        features within ~1e-6 of the float64 fit (measured: ≤ 2e-7 with ``λ_min/λ_max`` down to 1e-13; 2e-6
        at ``1e-12``). A larger cut-off trades accuracy for robustness: at ``1e-6`` the kernel error of 64
        landmarks on 2-d data rose from 0.048 to 0.087.
    rng : int, SeedSequence or Generator
        Landmark sampling (uniform, rls) or k-means seeding.
    scale : float, optional
        Kernel scale ``s`` (default ``1/sqrt(d)``).
    kmeans_n_init, kmeans_max_iter : int
        Passed to ``sklearn.cluster.KMeans``.
    precision : {"auto", "float64", "input"}
        The dtype of the feature computation for float32 (or half) inputs; see Precision above.

    Attributes
    ----------
    landmarks_ : ndarray (m, d)
        Landmarks in scaled coordinates (float64).
    landmark_indices_ : ndarray (m,) or None
        Their indices in the pooled candidates (flattened batch, queries then keys); None for k-means.
    whitening_ : ndarray (m, m)
        ``G(Z, Z)^{+1/2}`` (symmetric, float64).
    eigenvalues_ : ndarray (m,)
        Eigenvalues of ``G(Z, Z)``, descending.
    regularizer_ : float
        The cut-off or ridge used.
    effective_rank_ : int
        Eigen-directions the map uses: those kept by the cut-off, or those with eigenvalue ≥ the ridge.
    leverage_scores_, rls_lambda_ : ndarray (N,), float
        (``"rls"`` only) top-level ridge-leverage-score estimates of all candidates and their λ.

    Examples
    --------
    >>> import torch, kernapprox
    >>> q, k, v = torch.randn(128, 16), torch.randn(128, 16), torch.randn(128, 8)
    >>> est = NystromFeatures(num_features=64, landmarks="rls", rng=0).fit(q, k)
    >>> est.features(q, "query").shape
    torch.Size([128, 64])
    >>> kernapprox.linear_attention(q, k, v, est, causal=True, mode="recurrent").shape
    torch.Size([128, 8])
    """

    unbiased = False
    positive = False
    data_dependent = True
    causal_fit = False
    consistent = True
    rank_limited_by_points = True
    context_state = ("landmarks_", "whitening_")
    data_sized_state = ("leverage_scores_",)         # one score per candidate point: sized by the data, not by r
    _fresh_features = True
    reference = ("Williams & Seeger 2001 (Nyström); Zhang, Tsang & Kwok 2008 (k-means landmarks); "
                 "Musco & Musco 2017, Algorithm 3 (recursive ridge leverage scores)")

    def __init__(self, *, num_features: int, landmarks: str = "uniform", regularization: str = "cutoff",
                 regularizer: float = DEFAULT_REGULARIZER, rng=None, scale: float | None = None,
                 kmeans_n_init: int = 1, kmeans_max_iter: int = 100, precision: str = "auto"):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.landmarks = check_choice(landmarks, "landmarks", LANDMARK_METHODS)
        self.regularization = check_choice(regularization, "regularization", REGULARIZATIONS)
        self.regularizer = check_positive_float(regularizer, "regularizer")
        self.kmeans_n_init = check_positive_int(kmeans_n_init, "kmeans_n_init")
        self.kmeans_max_iter = check_positive_int(kmeans_max_iter, "kmeans_max_iter")
        self.precision = check_choice(precision, "precision", PRECISIONS)

    def _fit(self, q, k, rng):
        parts = [p.detach().reshape(-1, self.dim_) for p in ([q] if k is None else [q, k])]
        total = sum(p.shape[0] for p in parts)
        m = self.num_features
        if m > total:
            raise ValueError(f"num_features={m} exceeds the number of candidate landmarks ({total} scaled "
                             "queries and keys)")
        self.landmark_indices_ = None
        if self.landmarks == "uniform":
            # only the chosen rows are converted to float64 (the same values as converting the whole pool)
            self.landmark_indices_ = np.sort(rng.choice(total, size=m, replace=False))
            self.landmarks_ = _rows(parts, self.landmark_indices_).numpy() * math.sqrt(self.scale_)
        else:
            pool = torch.cat([p.to("cpu", torch.float64) for p in parts]).numpy() * math.sqrt(self.scale_)
            if self.landmarks == "rls":
                sample = recursive_rls_sample(pool, m, rng)
                self.landmark_indices_ = sample.indices
                self.leverage_scores_ = sample.scores
                self.rls_lambda_ = sample.lam
                self.landmarks_ = pool[self.landmark_indices_]
            else:
                self.landmarks_ = _kmeans_centroids(pool, m, rng, self.kmeans_n_init, self.kmeans_max_iter)
        self.landmark_half_sq_norms_ = 0.5 * (self.landmarks_**2).sum(-1)
        with one_blas_thread():                         # an m × m problem: see kernapprox.estimators.linalg
            self._whiten(gaussian_gram(self.landmarks_, self.landmarks_))

    def _whiten(self, gram):
        """Eigenvalues, ``G^{+1/2}`` and the effective rank from the landmarks' Gram matrix ``G`` (float64)."""
        eigenvalues, vectors = np.linalg.eigh(0.5 * (gram + gram.T))
        eigenvalues, vectors = eigenvalues[::-1].copy(), vectors[:, ::-1].copy()
        if self.regularization == "cutoff":
            keep = eigenvalues > self.regularizer * eigenvalues[0]
            inv_sqrt = np.where(keep, 1.0 / np.sqrt(np.where(keep, eigenvalues, 1.0)), 0.0)
            rank = int(keep.sum())
        else:
            shifted = eigenvalues + self.regularizer
            inv_sqrt = np.where(shifted > 0, 1.0 / np.sqrt(np.abs(shifted)), 0.0)
            rank = int((eigenvalues >= self.regularizer).sum())
        self.eigenvalues_ = eigenvalues
        self.whitening_ = (vectors * inv_sqrt) @ vectors.T
        self.regularizer_ = self.regularizer
        self.effective_rank_ = rank

    def amplification(self) -> float:
        """``sqrt(λ_max / λ_min)`` of the eigenvalues the whitening inverts (after the cut-off or ridge): the factor
        by which ``G^{+1/2}`` amplifies a relative rounding of ``exp(Zx − ‖z‖²/2)`` into the features."""
        self._check_fitted()
        eig = self.eigenvalues_
        used = eig[eig > self.regularizer_ * eig[0]] if self.regularization == "cutoff" else eig + self.regularizer_
        used = used[used > 0]
        return float(np.sqrt(used.max() / used.min())) if used.size else 1.0

    def feature_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the features of inputs of compute dtype ``dtype`` are computed in (``precision``)."""
        return torch.float64 if self._plan(dtype) == "float64" else dtype

    def _plan(self, dtype: torch.dtype) -> str:
        """How features of compute dtype ``dtype`` are computed: ``"float64"``, ``"direct"`` (``exp(t) G^{+1/2}`` in
        ``dtype``) or ``"centred"`` (``1ᵀG^{+1/2} + expm1(t) G^{+1/2}`` in ``dtype``); see the class's Precision."""
        if dtype == torch.float64 or self.precision == "float64":
            return "float64"
        if self.precision == "input":
            return "direct"
        bound = torch.finfo(dtype).eps * self.amplification()
        if bound <= FLOAT32_FEATURE_TOLERANCE:
            return "direct"
        centred = bound * CENTRED_ERROR_FACTOR * self.centred_spread() <= FLOAT32_FEATURE_TOLERANCE
        return "centred" if centred else "float64"

    def centred_spread(self) -> float:
        """``ρ``: the root mean square of ``expm1(t)``, ``t_j = z_jᵀx − ‖z_j‖²/2 − ℓ(x)``, with each landmark as the
        input ``x`` against the other landmarks (leave-one-out: the data's proxy, a sample of it for uniform and
        ridge-leverage landmarks). A rounding of ``expm1(t)`` relative to its own size reaches the centred features
        amplified by ``a ρ`` instead of ``a`` (see the class's Precision). Cached with the fitted state."""
        self._check_fitted()
        cache = self.__dict__.setdefault("_cache", {})
        if "centred_spread" not in cache:
            m = self.landmarks_.shape[0]
            with one_blas_thread():                     # an m × m problem: see kernapprox.estimators.linalg
                logits = self.landmarks_ @ self.landmarks_.T - self.landmark_half_sq_norms_
            logits = logits[~np.eye(m, dtype=bool)].reshape(m, m - 1)
            cache["centred_spread"] = _rms(np.expm1(logits - logits.max(-1, keepdims=True))) if m > 1 else 0.0
        return cache["centred_spread"]

    def _log_features(self, x, role):
        return self._log_features_into(x, role, None)

    def _log_features_into(self, x, role, buffer):
        plan = self._plan(x.dtype)
        grad = torch.is_grad_enabled() and x.requires_grad
        if plan == "centred":
            out = None if grad else self._centred_log_features(x, buffer)
            if out is not None:
                return out
            plan = "float64"
        xc = x.to(torch.float64) if plan == "float64" else x
        z = self._param("landmarks_", xc)
        half = self._param("landmark_half_sq_norms_", xc)
        whitening = self._param("whitening_", xc)
        if fused.use_fused(xc, xc.numel() // xc.shape[-1] * self.num_features, "exponential"):
            scratch = None if buffer is None or xc.dtype != x.dtype else fused.flat(buffer)
            out = fused.nystrom_features(fused.flat(xc), z, half, whitening,
                                         fused.scalars(self, "nystrom", xc, 0, 0, 0), buffer=scratch)
            if out is not None:
                phi, shift = fused.unflat(out, x.shape[:-1])
                return phi.to(x.dtype), shift.to(x.dtype)
        if grad:                                                   # the reference, differentiable through ℓ
            logits = xc @ z.T - half                               # log(D⁻¹K(Z, x)), (..., n, m)
            shift = logits.amax(-1, keepdim=True)
            phi = torch.exp(logits - shift) @ whitening            # whitening is symmetric
            return phi.to(x.dtype), shift.squeeze(-1).to(x.dtype)
        # the same, in place: one (N, m) matrix for the logits and exp(t), then the product
        e = torch.addmm(-half, fused.flat(xc), z.T)
        shift = e.amax(-1, keepdim=True)
        e = e.sub_(shift).exp_()
        out = None if buffer is None or xc.dtype != x.dtype else fused.flat(buffer)
        phi = torch.mm(e, whitening) if out is None else torch.mm(e, whitening, out=out)
        return fused.unflat((phi.to(x.dtype), shift.to(x.dtype)), x.shape[:-1])

    def _centred_log_features(self, x, buffer):
        """``(φ̃, ℓ)`` in ``x``'s dtype as ``φ̃ = 1ᵀG^{+1/2} + expm1(t) G^{+1/2}`` (``e = 1 + expm1(t)``; Williams &
        Seeger 2001's map in the stabilised form of the module docstring), or None when the call's own spread
        ``ρ`` (:meth:`centred_spread` measured on ``x``) exceeds what :data:`FLOAT32_FEATURE_TOLERANCE` allows: the
        caller then computes in float64."""
        z = self._param("landmarks_", x)
        half = self._param("landmark_half_sq_norms_", x)
        whitening = self._param("whitening_", x)
        centre = self._derived("nystrom:centre", x, lambda: torch.as_tensor(self.whitening_.sum(0)))
        u = torch.addmm(-half, fused.flat(x), z.T)                 # logits, then t, then expm1(t): one matrix
        shift = u.amax(-1, keepdim=True)
        u = u.sub_(shift).expm1_()
        spread = float(torch.linalg.vector_norm(u)) / math.sqrt(max(u.numel(), 1))
        if not torch.finfo(x.dtype).eps * self.amplification() * CENTRED_ERROR_FACTOR * spread <= \
                FLOAT32_FEATURE_TOLERANCE:
            return None                                            # (also when spread is NaN)
        out = None if buffer is None else fused.flat(buffer)
        phi = torch.addmm(centre, u, whitening) if out is None else torch.addmm(centre, u, whitening, out=out)
        return fused.unflat((phi, shift), x.shape[:-1])


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a)))) if a.size else 0.0


def _rows(parts, indices) -> torch.Tensor:
    """Rows ``indices`` of the concatenation of ``parts`` (each ``(n_i, d)``), as float64 on the CPU."""
    rows, start = [], 0
    for part in parts:
        stop = start + part.shape[0]
        local = indices[(indices >= start) & (indices < stop)] - start
        rows.append(part.index_select(0, torch.as_tensor(local, device=part.device)).to("cpu", torch.float64))
        start = stop
    return torch.cat(rows)


def _kmeans_centroids(pool, m, rng, n_init, max_iter):
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    seed = int(rng.integers(2**31 - 1))
    with warnings.catch_warnings():
        # Fewer distinct points than clusters gives duplicate centroids: G(Z, Z) is then singular, which the
        # cut-off handles and effective_rank_ records.
        warnings.simplefilter("ignore", ConvergenceWarning)
        km = KMeans(n_clusters=m, n_init=n_init, max_iter=max_iter, random_state=seed).fit(pool)
    return np.asarray(km.cluster_centers_, dtype=np.float64)


for _landmarks in LANDMARK_METHODS:
    register(f"nystrom_{_landmarks}", NystromFeatures, landmarks=_landmarks)
