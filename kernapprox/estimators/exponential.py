"""Generalised and dense exponential random features: GERF, OPRF (FAVOR++), SDERF, SADERF and ADERF.

All maps here are members of the dense-exponential family of positive random features of ``SM(x, y) = exp(xᵀy)``
(``x = sqrt(s)·q``, ``y = sqrt(s)·k``; ``ω ~ N(0, I_d)``):

.. math::
    f^{(k)}(ω, x) = \\det(I-4A)^{1/4}\\exp\\big(ω^⊤Aω + ω^⊤B^{(k)}x + x^⊤C^{(k)}x\\big),\\qquad
    C^{(k)} = -\\tfrac12 B^{(k)⊤}(I-4A)^{-1}B^{(k)},\\quad B^{(1)⊤}(I-4A)^{-1}B^{(2)} = I,

with ``k = 1`` for queries and ``k = 2`` for keys. The Gaussian integral
``E exp(ωᵀMω + bᵀω) = det(I−2M)^{−1/2} exp(½ bᵀ(I−2M)⁻¹b)`` gives ``E f⁽¹⁾f⁽²⁾ = exp(xᵀy)`` whenever
``4A ≺ I``: every member is **unbiased and strictly positive**, and bounded in ``ω`` when ``A ≼ 0``. The variance
is finite iff ``8A ≺ I`` and has the closed form :func:`kernapprox.theory.derf_log_second_moment`.

Every member used here reduces to a *per-coordinate* GERF after a linear change of variables:
``A = R diag(α) Rᵀ``, ``B⁽ᵏ⁾ = R diag(sqrt(1−4α)) P_k``-type parametrisations give

    ``φ_i(x) = m^{−1/2} Π_l (1−4α_l)^{1/4} · exp(Σ_l α_l ω_il² + Σ_l sqrt(1−4α_l) ω_il (T_k x)_l − ‖T_k x‖²/2)``

with ``T_1ᵀ T_2 = I`` (so ``(T_1 x)ᵀ(T_2 y) = xᵀy``) and ``ω_i`` the rows drawn by the sampler (in the rotated
basis, which is legitimate because the Gaussian is rotation invariant):

=========  ============================  ===================  =====================================================
map        ``α``                         ``T_1``, ``T_2``     fitted from
=========  ============================  ===================  =====================================================
GERF       ``A`` (given), all coords     ``I, I``             nothing (data independent)
OPRF       ``A*(ρ)``                     ``I, I``             ``ρ = mean_ij ‖x_i+y_j‖²/d``, O(nd)
SDERF      ``A*(λ_l)`` per eigenvalue    ``Rᵀ, Rᵀ``           eigen-decomposition ``M3 = R diag(λ) Rᵀ``, O(nd²+d³)
SADERF     ``A*(ρ_Ψ)``                   ``Ψ, Ψ⁻¹`` diagonal  per-coordinate second moments, O(nd)
ADERF      ``A*(ρ_A)``                   ``P_1, P_2`` dense   ``M1, M2`` and an SVD, O(nd² + d³)
=========  ============================  ===================  =====================================================

``A*(ρ) = (1/16)(1 − 2ρ − sqrt((2ρ+1)² + 8ρ))`` (:func:`kernapprox.theory.oprf_optimal_A`). Each data-dependent
map minimises the mean over all within-batch query–key pairs of the log second moment of one feature product
over its family (derivations in each class docstring; all verified numerically in
``tests/estimators/test_exponential_features.py``).

Causality. The fitted maps use statistics of the data passed to ``fit``. Fitting on the very sequence that is
then attended causally lets every token's features depend on future tokens (``causal_fit = False``); the
streaming-correct use is to ``fit`` on a calibration set or a prefix ``q[..., :n0, :]``, ``k[..., :n0, :]``
and then apply the fixed map to the whole sequence — the estimator stays exactly unbiased (the parameters are
then independent of the attended tokens' randomness) and only its variance depends on how representative the
calibration data are. Statistics are pooled over batch dimensions (one map for all batch elements/heads),
which is the exact minimiser of the pooled objective.

Samplers: rows must be marginally ``N(0, I_d)`` for unbiasedness (``iid``, ``orthogonal``, ``qmc``);
``regularized`` fixes ``‖ω‖ = sqrt(d)`` and so does ``sorf`` when d is a power of two, so both are biased, as for
the positive features, and through ``e^{A‖ω‖²}`` as well: at Performer scaling OPRF with SORF gives 0.77 of the
kernel for a typical pair at d = 128 (``experiments/sampler_bias.py``). ``sorf_chi`` restores Gaussian norms
(declared biased: SORF directions).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ..theory import oprf_optimal_A
from ..validation import check_positive_float
from . import fused
from .random import ExponentialRandomFeatureMap
from .registry import register
from .samplers import SAMPLER_VARIANTS

__all__ = [
    "GeneralizedExponentialFeatures", "OptimalPositiveFeatures", "SymmetricDenseExponentialFeatures",
    "SimplifiedAsymmetricDenseExponentialFeatures", "AsymmetricDenseExponentialFeatures",
]


class _ExponentialFamilyFeatures(ExponentialRandomFeatureMap):
    """Shared evaluation of the per-coordinate GERF form above; subclasses set ``alpha_`` and the transforms."""

    positive = True

    def _fit(self, q, k, rng):
        super()._fit(q, k, rng)  # projection_ (m, d)
        alpha, query_transform, key_transform = self._fit_parameters(q, k)
        alpha = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (self.dim_,)).copy()
        if not (np.all(np.isfinite(alpha)) and all(t is None or np.all(np.isfinite(t))
                                                    for t in (query_transform, key_transform))):
            raise ValueError(f"{type(self).__name__}: the fitted parameters are not finite in float64: the squared "
                             "norms of the scaled fitting data overflow them; rescale q and k or pass a smaller scale")
        if np.any(alpha >= 0.125):
            raise ValueError(f"{type(self).__name__}: every α must be < 1/8 for a finite variance, got {alpha}")
        omega = self.projection_
        self.alpha_ = alpha
        self.query_transform_ = query_transform
        self.key_transform_ = key_transform
        self.weight_ = omega * np.sqrt(1.0 - 4.0 * alpha)[None, :]        # (m, d)
        self.frequency_offset_ = (omega * omega) @ alpha                    # (m,)  Σ_l α_l ω_il²
        self.log_normalizer_ = 0.25 * float(np.log1p(-4.0 * alpha).sum()) - 0.5 * math.log(self.num_frequencies)

    def _fit_parameters(self, q, k):
        """Return ``(alpha, query_transform, key_transform)``; ``None`` transforms mean the identity."""
        raise NotImplementedError

    def _exponents(self, x, role):
        transform = self.query_transform_ if role == "query" else self.key_transform_
        if transform is not None:
            x = x @ self._param(f"{role}_transform_", x).T
        proj = x @ self._param("weight_", x).T + self._param("frequency_offset_", x)
        return proj, -0.5 * (x * x).sum(-1) + self.log_normalizer_

    def _input_transform(self, role, like):
        transform = self.query_transform_ if role == "query" else self.key_transform_
        return None if transform is None else self._param(f"{role}_transform_", like)

    def _fused_arguments(self, x, role):
        transform = self._input_transform(role, x)
        if transform is not None:
            x = x @ transform.T
        return (x, self._param("weight_", x), self._param("frequency_offset_", x),
                fused.scalars(self, "gerf", x, self.log_normalizer_, self.eps, 1.0))

    def _log_constant(self) -> float:
        return float(self.log_normalizer_)

    # ------------------------------------------------------------------------------- data statistics
    def _scaled_pairs(self, q, k):
        """Scaled float64 copies ``x, y`` of shape ``(batch, n, d)`` (``y = x`` when ``k`` is None)."""
        root = math.sqrt(self.scale_)
        x = q.detach().to(torch.float64) * root
        if k is None:
            y = x
        else:
            if q.shape[:-2] != k.shape[:-2]:
                raise ValueError(f"{type(self).__name__} fits on query-key pairs: q and k must share batch "
                                 f"dimensions, got {tuple(q.shape[:-2])} and {tuple(k.shape[:-2])}")
            y = k.detach().to(torch.float64) * root
        d = x.shape[-1]
        return x.reshape(-1, x.shape[-2], d), y.reshape(-1, y.shape[-2], d)

    @staticmethod
    def _mean_cross(x, y):
        """``mean_b μ_x,b μ_y,bᵀ`` (d, d): the cross term of the mean over within-batch pairs."""
        mu_x, mu_y = x.mean(-2), y.mean(-2)
        return (mu_x.transpose(0, 1) @ mu_y / mu_x.shape[0]).cpu().numpy()

    @staticmethod
    def _second_moment(x):
        """``mean x xᵀ`` over batch and tokens (d, d)."""
        flat = x.reshape(-1, x.shape[-1])
        return (flat.T @ flat / flat.shape[0]).cpu().numpy()


class GeneralizedExponentialFeatures(_ExponentialFamilyFeatures):
    r"""Positive generalised exponential random features (GERF, ``s = +1``, softmax form) with a fixed ``A``.

    .. math::
        φ(x) = \frac{(1-4A)^{d/4}}{\sqrt m}\Big(e^{A\|ω_i\|^2 + \sqrt{1-4A}\,ω_i^⊤x - \|x\|^2/2}\Big)_{i\le m}

    **Unbiased** (``E φ(x)ᵀφ(y) = SM(x,y)`` for ``A < 1/4``), **positive**, bounded in ``ω`` iff ``A < 0``,
    **data independent** (``causal_fit = True``); ``A = 0`` is exactly
    :class:`~kernapprox.estimators.PositiveFeatures`. Variance (one pair, i.i.d. frequencies):
    :func:`kernapprox.theory.gerf_variance`, relative form ``[(1−4A)^d (1−8A)^{−d/2} exp(‖x+y‖²/(1−8A)) − 1]/m``.
    ``A`` must be ``< 1/8`` (finite variance). ``r = m``.

    Parameters
    ----------
    num_features : int
        ``m``, the number of frequencies and features.
    A : float, default -0.1
        The GERF parameter; ``-0.1`` is the OPRF optimum for ``ρ ≈ 0.26``, i.e. standard-normal queries and
        keys at ``d ≈ 64`` with the ``1/sqrt(d)`` scale. Use :class:`OptimalPositiveFeatures` to fit it.
    sampler, rng, scale, eps
        As for :class:`~kernapprox.estimators.PositiveFeatures`.

    Attributes
    ----------
    A_ : float
    projection_ : ndarray (m, d)
        The frequencies ``ω_i``.

    References
    ----------
    Likhosherstov, Choromanski, Dubey, Liu, Sarlos, Weller, *Chefs' Random Tables: Non-Trigonometric Random
    Features*, NeurIPS 2022 (arXiv 2205.15317), the GERF family (``s = +1``, real ``A``; variance re-derived).
    """

    reference = "Likhosherstov et al. 2022 (Chefs' Random Tables, arXiv 2205.15317), GERF family, s=+1"

    def __init__(self, *, num_features: int, A: float = -0.1, sampler="iid", rng=None, scale: float | None = None,
                 eps: float = 0.0):
        super().__init__(num_features=num_features, sampler=sampler, rng=rng, scale=scale, eps=eps)
        if isinstance(A, bool) or not isinstance(A, numbers.Real):
            raise TypeError(f"A must be a real number, got {A!r}")
        if not math.isfinite(A) or A >= 0.125:
            raise ValueError(f"A must be a finite real number < 1/8 (finite variance), got {A!r}")
        self.A = float(A)

    def _fit_parameters(self, q, k):
        self.A_ = self.A
        return self.A, None, None


class OptimalPositiveFeatures(_ExponentialFamilyFeatures):
    r"""Optimal positive random features (OPRF; FAVOR++ with the homogeneity heuristic).

    GERF (:class:`GeneralizedExponentialFeatures`) with ``A`` fitted to the data:

    .. math::
        ρ = \frac1d\operatorname{mean}_{i,j}\|x_i+y_j\|^2
          = \frac1d\Big(\overline{\|x\|^2} + \overline{\|y\|^2} + 2\,\bar x^⊤\bar y\Big),\qquad
        A^* = \tfrac{1}{16}\big(1-2ρ-\sqrt{(2ρ+1)^2+8ρ}\big)

    computed in ``O(nd)`` from the means and mean squared norms (never the ``n²`` pairs); with batch dimensions
    the mean runs over all within-batch pairs (the cross term is averaged per batch element). ``A*`` minimises
    the mean over pairs of the log second moment of one feature product, exactly (that objective is linear in
    ``‖x+y‖²``); see :func:`kernapprox.theory.oprf_optimal_A`. ``A* ≤ 0``: features are **positive and
    bounded**; **unbiased** given ``A``; **data dependent**. ``fit(q)`` without keys uses ``q`` for both sides.

    Not causal as a whole-sequence fit (``causal_fit = False``): ``A*`` depends on every token. Fit on a
    calibration prefix and apply to the full sequence for a streaming-correct estimator (module docstring).

    Attributes
    ----------
    rho_ : float
        ``mean ‖x_i + y_j‖² / d`` of the fitting data (scaled inputs).
    A_ : float
        ``A*(rho_)``.

    References
    ----------
    Likhosherstov et al., *Chefs' Random Tables: Non-Trigonometric Random Features*, NeurIPS 2022 (OPRF,
    FAVOR++); reference code tensorflow/models ``official/nlp/modeling/layers/kernel_attention.py::expplus``
    (same ``A*`` via ``A = (1 − 1/r)/8``).
    """

    data_dependent = True
    causal_fit = False
    context_state = ("A_",)
    reference = ("Likhosherstov et al. 2022 (Chefs' Random Tables), OPRF/FAVOR++; tensorflow/models "
                 "kernel_attention.py::expplus")

    def _fit_parameters(self, q, k):
        x, y = self._scaled_pairs(q, k)
        mean_sq = (x * x).sum(-1).mean() + (y * y).sum(-1).mean()
        cross = (x.mean(-2) * y.mean(-2)).sum(-1).mean()
        self.rho_ = max(float(mean_sq + 2.0 * cross) / self.dim_, 0.0)  # ≥ 0 exactly; clamp only rounding
        self.A_ = float(oprf_optimal_A(self.rho_))
        return self.A_, None, None


class _DenseExponentialFeatures(_ExponentialFamilyFeatures):
    """The dense-exponential maps (SDERF, SADERF, ADERF; Likhosherstov et al. 2023, arXiv 2302.00787): fitted to
    the queries and keys of the call as a whole (data dependent, not causal as a whole-sequence fit), so a
    decoder keeps their per-coordinate parameters and the two input transforms as context state."""

    data_dependent = True
    causal_fit = False
    context_state = ("alpha_", "query_transform_", "key_transform_")


class SymmetricDenseExponentialFeatures(_DenseExponentialFeatures):
    r"""Symmetric dense-exponential random features (SDERF): one dense ``A`` and ``B⁽¹⁾ = B⁽²⁾ = B``.

    With the validity condition ``Bᵀ(I−4A)⁻¹B = I`` we have ``C = −½ I`` and ``B = (I−4A)^{1/2} O`` (``O``
    orthogonal), and the mean over pairs of the log second moment becomes

    ``log det(I−4A) − ½ log det(I−8A) + 2 tr((I−4A)^{1/2}(I−8A)⁻¹(I−4A)^{1/2} O M3 Oᵀ) − tr(M1 + M2)``,

    ``M3 = mean_ij (x_i+y_j)(x_i+y_j)ᵀ = M1 + M2 + mean_b(μ_x μ_yᵀ + μ_y μ_xᵀ)``. For fixed eigenvalues ``α`` of
    ``A`` the trace term is minimised (Schur–Horn / rearrangement) when ``A`` and ``O M3 Oᵀ`` share eigenvectors,
    and the problem separates into ``d`` one-dimensional GERF problems. Hence, with ``M3 = R diag(λ) Rᵀ``:

    ``A = R diag(α) Rᵀ``, ``α_l = A*(λ_l)`` (:func:`kernapprox.theory.oprf_optimal_A` at ``ρ = λ_l``),
    ``B = R diag(sqrt(1−4α)) Rᵀ``, ``D = Π_l (1−4α_l)^{1/4}``

    — the exact minimiser over the symmetric DERF family (it contains GERF, so it is never worse than OPRF on
    the fitting data; the tests check this, and that random feasible perturbations never beat it). Evaluated in
    the eigenbasis: ``x ↦ Rᵀx`` then a per-coordinate GERF. **Unbiased, positive, bounded (α ≤ 0), data
    dependent, not causal as a whole-sequence fit.** Cost ``O(nd² + d³)`` to fit, ``O(nmd)`` to apply.

    Attributes
    ----------
    alpha_ : ndarray (d,)
        Eigenvalues of ``A``. ``basis_`` (d, d) holds ``R``; ``A_ = R diag(alpha_) Rᵀ``; ``eigenvalues_`` = λ.

    References
    ----------
    Likhosherstov et al., *Dense-Exponential Random Features: Sharp Positive Estimators of the Gaussian Kernel*,
    NeurIPS 2023 (arXiv 2302.00787), SDERF. The closed form here is derived in this docstring (the paper body
    was not available to us) and verified numerically.
    """

    reference = "Likhosherstov et al. 2023 (Dense-Exponential RFs, arXiv 2302.00787), SDERF (closed form re-derived)"

    def _fit_parameters(self, q, k):
        x, y = self._scaled_pairs(q, k)
        cross = self._mean_cross(x, y)
        m3 = self._second_moment(x) + self._second_moment(y) + cross + cross.T
        lam, basis = np.linalg.eigh(0.5 * (m3 + m3.T))
        lam = np.maximum(lam, 0.0)  # M3 is PSD; only rounding can make an eigenvalue negative
        alpha = oprf_optimal_A(lam)
        self.eigenvalues_, self.basis_ = lam, basis
        self.A_ = basis @ np.diag(alpha) @ basis.T
        return alpha, basis.T.copy(), basis.T.copy()


class SimplifiedAsymmetricDenseExponentialFeatures(_DenseExponentialFeatures):
    r"""Simplified asymmetric dense-exponential random features (SADERF): a diagonal rescaling, then OPRF.

    ``f⁽¹⁾(ω, x) = f_GERF(ω, Ψx)``, ``f⁽²⁾(ω, y) = f_GERF(ω, Ψ⁻¹y)`` with ``Ψ = diag(ψ)``; the kernel is preserved
    because ``(Ψx)ᵀ(Ψ⁻¹y) = xᵀy``. The mean log second moment is increasing in ``mean‖Ψx_i + Ψ⁻¹y_j‖²``
    (coefficient ``1/(1−8A) > 0`` on ``‖Ψx‖² + ‖Ψ⁻¹y‖²``, the cross term ``xᵀy`` is invariant) for every ``A``,
    so the optimal ``Ψ`` minimises ``Σ_l ψ_l² a_l + ψ_l⁻² b_l`` with ``a_l = mean x_l²``, ``b_l = mean y_l²``:

    .. math::
        ψ_l^* = (b_l / a_l)^{1/4},\qquad ρ_Ψ = \frac1d\Big(2\sum_l \sqrt{a_l b_l} + 2\,\overline{\bar x^⊤\bar y}\Big),
        \qquad A = A^*(ρ_Ψ).

    ``ρ_Ψ ≤ ρ`` (AM–GM), so SADERF's objective is never above OPRF's. Coordinates with ``a_l = b_l = 0`` get
    ``ψ_l = 1`` (any value is optimal); a coordinate that is zero on every query but not on every key (or vice
    versa) has no optimal ``ψ_l`` and raises ``ValueError``. **Unbiased, positive, bounded, data dependent
    (O(nd) fit), not causal as a whole-sequence fit.**

    Attributes
    ----------
    psi_ : ndarray (d,)
    rho_ : float
        ``ρ_Ψ``. ``A_`` = ``A*(rho_)``.

    References
    ----------
    Likhosherstov et al., *Dense-Exponential Random Features*, NeurIPS 2023 (arXiv 2302.00787), SADERF;
    ``ψ*`` re-derived here as stated above.
    """

    reference = "Likhosherstov et al. 2023 (Dense-Exponential RFs, arXiv 2302.00787), SADERF"

    def _fit_parameters(self, q, k):
        x, y = self._scaled_pairs(q, k)
        a = (x * x).reshape(-1, self.dim_).mean(0).cpu().numpy()
        b = (y * y).reshape(-1, self.dim_).mean(0).cpu().numpy()
        cross = float((x.mean(-2) * y.mean(-2)).sum(-1).mean())
        both_zero = (a == 0) & (b == 0)
        one_zero = (a == 0) ^ (b == 0)
        if one_zero.any():
            raise ValueError(f"SADERF: coordinates {np.flatnonzero(one_zero).tolist()} are zero on every query but "
                             "not every key (or vice versa); the rescaling ψ = (mean y²/mean x²)^(1/4) is undefined")
        psi = np.ones(self.dim_)
        ok = ~both_zero
        psi[ok] = (b[ok] / a[ok]) ** 0.25
        self.psi_ = psi
        self.rho_ = max((float((psi**2 * a + b / psi**2).sum()) + 2.0 * cross) / self.dim_, 0.0)
        self.A_ = float(oprf_optimal_A(self.rho_))
        return self.A_, np.diag(psi), np.diag(1.0 / psi)


class AsymmetricDenseExponentialFeatures(_DenseExponentialFeatures):
    r"""Asymmetric dense-exponential random features (ADERF): ``A = aI``, dense ``B⁽¹⁾ ≠ B⁽²⁾``.

    Write ``B⁽ᵏ⁾ = sqrt(1−4a) P_k`` with ``P_1ᵀP_2 = I`` (validity). Then ``C⁽ᵏ⁾ = −½ P_kᵀP_k`` and, with
    :func:`kernapprox.theory.derf_log_second_moment`, the log second moment of one pair is
    ``d log(1−4a) − (d/2) log(1−8a) − ‖P_1x‖² − ‖P_2y‖² + 2(1−4a)/(1−8a)·‖P_1x + P_2y‖²``
    ``= c(a) + (1−8a)⁻¹ (‖P_1x‖² + ‖P_2y‖²) + 4(1−4a)/(1−8a) · xᵀy`` (since ``2(1−4a)/(1−8a) − 1 = 1/(1−8a)`` and
    ``(P_1x)ᵀ(P_2y) = xᵀy``). Its mean over pairs is ``c(a) + (1−8a)⁻¹ (tr P_1 M1 P_1ᵀ + tr P_2 M2 P_2ᵀ) + const``
    with ``M1 = mean xxᵀ``, ``M2 = mean yyᵀ`` (the coefficient is ``1/(1−8a)`` in terms of ``P``; in terms of
    ``B`` it would be ``[(1−8a)(1−4a)]⁻¹``), minimised over ``P_1`` (``P_2 = P_1^{−ᵀ}``) at ``2 Σ_l σ_l`` (nuclear
    norm of ``M1^{1/2} M2^{1/2}``), attained by

    .. math::
        M_k = Q_k Λ_k Q_k^⊤,\ \ Λ_1^{1/2}Q_1^⊤Q_2Λ_2^{1/2} = UΣV^⊤,\ \
        P_1 = Σ^{1/2}U^⊤Λ_1^{-1/2}Q_1^⊤,\ \ P_2 = Σ^{1/2}V^⊤Λ_2^{-1/2}Q_2^⊤,

    and then ``a = A*(ρ_A)`` with ``ρ_A = mean‖P_1x_i + P_2y_j‖²/d = (2Σσ_l + 2·mean x̄ᵀȳ)/d ≤ ρ``. Features are
    GERF(``a``) features of ``P_1 x`` (queries) and ``P_2 y`` (keys). **Unbiased, positive, bounded, data
    dependent, not causal as a whole-sequence fit.** Cost ``O(nd² + d³)`` to fit, ``O(n(md + d²))`` to apply.

    ``M1`` and ``M2`` must be nonsingular (more fitting tokens than ``d`` in general position). ``ridge``
    (default ``1e-6``) adds ``ridge · tr(M)/d · I`` to each before the decomposition; this keeps the estimator
    exactly unbiased (any valid ``P_1, P_2`` is) and changes only how close to optimal it is. ``ρ_A`` is then
    evaluated on the unregularised moments, so ``a`` is optimal for the ``P`` actually used. A singular
    moment with ``ridge = 0`` raises ``ValueError``. Raise ``ridge`` when calibrating on few tokens: directions
    unseen in the calibration data are amplified by ``Λ^{−1/2}``.

    Attributes
    ----------
    query_transform_, key_transform_ : ndarray (d, d)
        ``P_1``, ``P_2``.
    rho_ : float
        ``ρ_A``; ``A_ = A*(rho_)``.

    References
    ----------
    Likhosherstov et al., *Dense-Exponential Random Features*, NeurIPS 2023 (arXiv 2302.00787), ADERF; the
    closed form is re-derived as above (with ``Σ^{+1/2}``; a secondary summary's ``Σ^{−1/2}`` is not optimal).
    """

    reference = "Likhosherstov et al. 2023 (Dense-Exponential RFs, arXiv 2302.00787), ADERF (closed form re-derived)"

    def __init__(self, *, num_features: int, sampler="iid", rng=None, scale: float | None = None, eps: float = 0.0,
                 ridge: float = 1e-6):
        super().__init__(num_features=num_features, sampler=sampler, rng=rng, scale=scale, eps=eps)
        self.ridge = check_positive_float(ridge, "ridge", allow_zero=True)

    def _fit_parameters(self, q, k):
        x, y = self._scaled_pairs(q, k)
        m1, m2 = self._second_moment(x), self._second_moment(y)
        cross = float(np.trace(self._mean_cross(x, y)))
        factors = []
        for name, mom in (("q", m1), ("k", m2)):
            scale = np.trace(mom) / self.dim_
            if scale <= 0:
                raise ValueError(f"ADERF: {name} is zero on every token; its second moment is singular")
            lam, vec = np.linalg.eigh(0.5 * (mom + mom.T) + self.ridge * scale * np.eye(self.dim_))
            if lam[0] <= self.dim_ * np.finfo(np.float64).eps * lam[-1]:
                raise ValueError(f"ADERF: the second moment of {name} is singular (fewer than d tokens in general "
                                 "position?); pass ridge > 0 or fit on more tokens")
            factors.append((lam, vec))
        (lam1, q1), (lam2, q2) = factors
        u, sigma, vt = np.linalg.svd(np.sqrt(lam1)[:, None] * (q1.T @ q2) * np.sqrt(lam2)[None, :])
        root = np.sqrt(sigma)
        p1 = root[:, None] * (u.T / np.sqrt(lam1)[None, :]) @ q1.T
        p2 = root[:, None] * (vt / np.sqrt(lam2)[None, :]) @ q2.T
        self.singular_values_ = sigma
        self.rho_ = max((float(np.trace(p1 @ m1 @ p1.T) + np.trace(p2 @ m2 @ p2.T)) + 2.0 * cross) / self.dim_, 0.0)
        self.A_ = float(oprf_optimal_A(self.rho_))
        return self.A_, p1, p2


# GERF, OPRF (FAVOR++ with the orthogonal sampler) and the dense-exponential maps, once per sampler.
for _name, _cls in (("gerf", GeneralizedExponentialFeatures), ("oprf", OptimalPositiveFeatures),
                    ("sderf", SymmetricDenseExponentialFeatures),
                    ("saderf", SimplifiedAsymmetricDenseExponentialFeatures),
                    ("aderf", AsymmetricDenseExponentialFeatures)):
    register(_name, _cls, sampler="iid")
    for _sampler in SAMPLER_VARIANTS:
        register(f"{_name}_{_sampler}", _cls, sampler=_sampler)
