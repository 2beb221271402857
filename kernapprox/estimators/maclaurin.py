"""Random Maclaurin features of the exponential dot-product kernel (Kar & Karnick 2012)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
import torch
from scipy import special

from ..validation import check_positive_int
from .base import FeatureMap
from .registry import register

__all__ = ["RandomMaclaurinFeatures"]


class RandomMaclaurinFeatures(FeatureMap):
    r"""Random Maclaurin features: an unbiased, signed estimator of ``exp(xᵀy) = Σ_n (xᵀy)^n / n!``.

    Each feature draws a degree ``N`` and ``N`` Rademacher vectors ``w_1..w_N ∈ {±1}^d``:

    .. math::
        Z(x) = \sqrt{a_N / P(N)}\ \prod_{j=1}^{N} w_j^⊤x,\qquad a_n = 1/n!,\qquad
        φ(x) = m^{-1/2}\,(Z_1(x),…,Z_m(x)).

    Since ``E[(wᵀx)(wᵀy)] = xᵀy`` and the ``w_j`` are independent, ``E[Z(x)Z(y)] = Σ_n P(n)·a_n/P(n)·(xᵀy)^n``.

    * ``max_degree=None`` (default): ``P(N = n) = (p−1) p^{−(n+1)}`` on all ``n ≥ 0`` (geometric; ``p = 2``
      gives Kar & Karnick's ``2^{−(n+1)}``): **unbiased** for the full series, i.e. for ``exp(xᵀy)``.
    * ``max_degree=T``: ``P(N = n) ∝ p^{−n}`` on ``0..T``: unbiased for the Taylor polynomial
      ``Σ_{n≤T} t^n/n!``, hence **biased** for exp by ``−Σ_{n>T} t^n/n!`` (``unbiased`` is then False).

    Variance of one feature product (closed form, :func:`kernapprox.theory.maclaurin_variance`):
    ``(p/(p−1)) I_0(2 sqrt(p c)) − e^{2t}`` with ``c = ‖x‖²‖y‖² + 2t² − 2Σ_l x_l²y_l²`` (untruncated). It grows
    like ``exp(2 sqrt(p)‖x‖‖y‖)`` — heavy tailed; useful as a signed, data-independent baseline. ``p`` trades
    the degree-0/1 mass (large ``p``) against the reach of high degrees (small ``p``). Features are **signed**
    (normalisers can be ≤ 0), **data independent**, causal. Projection samplers do not apply (the weights are
    Rademacher by construction). Cost ``O(n d Σ_i N_i)``; ``E N = 1/(p−1)``.

    Stabilised form: ``φ̃_i = sign(Z_i) exp(log|Z_i| − max_j log|Z_j|)``, ``ℓ = max_j log|Z_j| − ½ log m``.

    Parameters
    ----------
    num_features : int
        ``m``.
    p : float, default 2.0
        ``> 1``, the geometric ratio of the degree distribution.
    max_degree : int or None, default None
        Truncation degree ``T`` (see above) or ``None`` for the unbiased untruncated series.
    rng, scale
        As for every estimator.

    Attributes
    ----------
    degrees_ : ndarray of int (m,)
    weights_ : ndarray (Σ N_i, d)
        The Rademacher vectors, grouped by feature (``feature_index_`` gives each row's feature).
    log_coefficients_ : ndarray (m,)
        ``½ log(a_N / P(N))``.

    References
    ----------
    Kar & Karnick, *Random Feature Maps for Dot Product Kernels*, AISTATS 2012 (PMLR 22:583–591), Algorithm 1
    (the estimator and its unbiasedness; the variance formula is derived here and checked in the tests).
    """

    positive = False
    reference = "Kar & Karnick 2012 (Random Maclaurin), AISTATS, Algorithm 1"

    def __init__(self, *, num_features: int, p: float = 2.0, max_degree: int | None = None, rng=None,
                 scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise TypeError(f"p must be a real number, got {p!r}")
        if not math.isfinite(p) or p <= 1:
            raise ValueError(f"p must be finite and > 1, got {p}")
        self.p = float(p)
        if max_degree is not None:
            if isinstance(max_degree, bool) or not isinstance(max_degree, numbers.Integral):
                raise TypeError(f"max_degree must be None or a non-negative integer, got {max_degree!r}")
            if max_degree < 0:
                raise ValueError(f"max_degree must be non-negative, got {max_degree}")
            max_degree = int(max_degree)
        self.max_degree = max_degree

    unbiased = True     # for the untruncated series; resolved from max_degree below

    @classmethod
    def capabilities_for(cls, **options):
        """Unbiased (and consistent) only for the untruncated series, ``max_degree=None``."""
        caps = super().capabilities_for(**options)
        exact_series = options.get("max_degree") is None
        return dataclasses.replace(caps, unbiased=exact_series, consistent=exact_series)

    def degree_log_probabilities(self, degrees: np.ndarray) -> np.ndarray:
        """``log P(N = n)`` of the degree distribution."""
        n = np.asarray(degrees, dtype=np.float64)
        if self.max_degree is None:
            return math.log(self.p - 1.0) - (n + 1.0) * math.log(self.p)
        all_n = np.arange(self.max_degree + 1, dtype=np.float64)
        log_z = special.logsumexp(-all_n * math.log(self.p))
        return -n * math.log(self.p) - log_z

    def _fit(self, q, k, rng):
        m = self.num_features
        if self.max_degree is None:
            degrees = rng.geometric(1.0 - 1.0 / self.p, size=m) - 1
        else:
            probs = np.exp(self.degree_log_probabilities(np.arange(self.max_degree + 1)))
            degrees = rng.choice(self.max_degree + 1, size=m, p=probs / probs.sum())
        self.degrees_ = degrees.astype(np.int64)
        self.weights_ = rng.integers(0, 2, size=(int(self.degrees_.sum()), self.dim_)).astype(np.float64) * 2 - 1
        self.feature_index_ = np.repeat(np.arange(m), self.degrees_)
        self.log_coefficients_ = 0.5 * (-special.gammaln(self.degrees_ + 1.0)
                                        - self.degree_log_probabilities(self.degrees_))

    def _log_features(self, x, role):
        m = self.num_features
        log_abs = self._param("log_coefficients_", x).expand(*x.shape[:-1], m).clone()
        negatives = torch.zeros_like(log_abs)
        if self.weights_.shape[0]:
            proj = x @ self._param("weights_", x).T                          # (..., n, Σ N_i)
            index = self._feature_index(x.device)
            log_abs.index_add_(-1, index, torch.log(proj.abs()))
            negatives.index_add_(-1, index, (proj < 0).to(x.dtype))
        sign = 1.0 - 2.0 * torch.remainder(negatives, 2.0)
        shift = log_abs.amax(-1, keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # all features exactly 0
        phi = sign * torch.exp(log_abs - shift)
        return phi, shift.squeeze(-1) - 0.5 * math.log(m)

    def _feature_index(self, device):
        key = ("feature_index_", device)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = torch.as_tensor(self.feature_index_, device=device)
        return cache[key]


register("maclaurin", RandomMaclaurinFeatures)
