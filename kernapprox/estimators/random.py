"""Random-feature maps of the softmax kernel: trigonometric, positive (FAVOR+) and hyperbolic.

Notation: ``x = sqrt(s)·q`` and ``y = sqrt(s)·k`` so that ``exp(s qᵀk) = SM(x, y) = exp(xᵀy)``; ``ω_1..ω_m``
rows of a projection drawn by a :mod:`~kernapprox.estimators.samplers` sampler; ``r`` = ``num_features`` is the
feature dimension of the state. Trigonometric and hyperbolic maps use ``m = r/2`` frequencies (``r`` must be
even), the positive map ``m = r``. Each estimator is unbiased for ``SM`` when its sampler's rows are marginally
``N(0, I_d)`` (``iid``, ``orthogonal``, ``qmc``); the normalised attention output is a ratio estimator and is
biased at ``O(1/m)`` even then. ``regularized`` (SMREG) and ``sorf`` rows have a fixed norm ``sqrt(d)``: at
Performer scaling (``x = q/d^{1/4}``, unit-variance ``q, k``) a typical pair's positive-feature estimate has mean
0.55 to 0.44 of the kernel at d = 16 to 128, tending to ``e^{−1}``, not to 1 (measured in
``experiments/sampler_bias.py``; see :mod:`~kernapprox.estimators.samplers`). ``sorf_chi`` restores Gaussian
norms; it is still declared biased (SORF directions).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..validation import check_positive_float, check_positive_int
from . import fused
from .base import ExponentialForm, FeatureMap
from .registry import register
from .samplers import SAMPLER_VARIANTS, make_sampler


class RandomFeatureMap(FeatureMap):
    """Shared constructor and fitting of maps built on a projection matrix ``projection_`` of shape (m, d)."""

    features_per_frequency: int = 1  # r = m * features_per_frequency

    def __init__(self, *, num_features: int, sampler="iid", rng=None, scale: float | None = None,
                 eps: float = 0.0):
        check_positive_int(num_features, "num_features")
        if num_features % self.features_per_frequency:
            raise ValueError(f"num_features must be a multiple of {self.features_per_frequency} for "
                             f"{type(self).__name__} (sin/cos or exp(±) pairs), got {num_features}")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.sampler = sampler
        make_sampler(sampler)  # validate early
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        if self.eps and not self.positive:
            raise ValueError(f"eps must be 0 for {type(self).__name__}: a positive shift of signed features "
                             "has no meaning")

    unbiased = True      # with a sampler whose rows are marginally N(0, I_d); resolved per sampler below

    @classmethod
    def capabilities_for(cls, **options):
        """Unbiased exactly when the sampler's rows are marginally ``N(0, I_d)`` (the sampler declares it)."""
        caps = super().capabilities_for(**options)
        unbiased = caps.unbiased and make_sampler(options.get("sampler", "iid")).unbiased
        return dataclasses.replace(caps, unbiased=unbiased, consistent=unbiased)

    @property
    def num_frequencies(self) -> int:
        return self.num_features // self.features_per_frequency

    def _fit(self, q, k, rng):
        self.sampler_ = make_sampler(self.sampler)
        self.projection_ = self.sampler_.sample(self.num_frequencies, self.dim_, rng)  # (m, d) float64


class ExponentialRandomFeatureMap(RandomFeatureMap):
    """Random maps whose features are exponentials, ``log φ_j(x) = p_j(x) + b(x)`` with a per-feature exponent
    ``p`` ``(..., n, r)`` and a per-row offset ``b`` ``(..., n)``: positive, hyperbolic and the GERF family.

    Subclasses implement :meth:`_exponents`; the stabilised pair (``φ̃ = exp(p − max p) + eps``,
    ``ℓ = max p + b``) and the log-domain features (``log φ = p + b``, exact even where ``φ̃`` underflows because
    the features of one vector span more than the dtype's range) both come from it.
    """

    def _exponents(self, x, role) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _fused_arguments(self, x, role) -> tuple:
        """``(x', W, o, [c, eps, 1])`` of the fused kernel (:func:`kernapprox.estimators.fused.exponential_features`),
        with ``log φ_j = (x'Wᵀ)_j + o_j − ½‖x'‖² + c`` (``o`` None for zero): what :meth:`_exponents` computes, as
        parameters."""
        raise NotImplementedError

    def _log_constant(self) -> float:
        """``c`` of the form: the map's constant log-normaliser."""
        raise NotImplementedError

    def exponential_form(self, x, role="query"):
        """:meth:`_fused_arguments` as an :class:`~kernapprox.estimators.base.ExponentialForm` (``k = 1``), with the
        input scale ``α = √s`` left to the kernel's product instead of a pass over ``x``; maps that transform their
        input first (:meth:`_input_transform`) give the transformed, scaled rows and ``α = 1``. None for a subclass
        that computes its stabilised features otherwise (its own :meth:`_log_features`), or that gives no
        parameters."""
        cls, base = type(self), ExponentialRandomFeatureMap
        if (cls._fused_arguments is base._fused_arguments or cls._log_features is not base._log_features
                or cls._log_features_into is not base._log_features_into):
            return None
        self._check_fitted()
        transform = self._input_transform(role, x)
        _, weight, offset, _ = self._fused_arguments(x[..., :0, :], role)
        alpha = math.sqrt(self.scale_)
        rows = x if transform is None else (x * alpha) @ transform.T
        return ExponentialForm(rows, alpha if transform is None else 1.0, weight, offset, self._log_constant(),
                               float(self.eps), 1.0)

    def _input_transform(self, role, like) -> torch.Tensor | None:
        """The ``(d, d)`` matrix applied to the scaled input before the projection, or None (the identity)."""
        return None

    def _log_features(self, x, role):
        return self._log_features_into(x, role, None)

    def _log_features_into(self, x, role, buffer):
        if fused.use_fused(x, x.numel() // x.shape[-1] * self.num_features, "exponential"):
            out = fused.exponential_features(*self._fused_arguments(fused.flat(x), role),
                                             buffer=None if buffer is None else fused.flat(buffer))
            if out is not None:
                return fused.unflat(out, x.shape[:-1])
        proj, offset = self._exponents(x, role)
        shift = proj.amax(-1, keepdim=True)
        if not self.eps:
            # without eps, φ̃ e^ℓ = exp(p + offset) does not depend on the shift: no gradient through the max
            # (whose backward, a scatter over the n × r projections, costs as much as the features)
            shift = shift.detach()
        phi = torch.exp(proj - shift)
        if self.eps:
            phi = phi + self.eps
        return phi, shift.squeeze(-1) + offset

    def _log_abs_features(self, x, role):
        proj, offset = self._exponents(x, role)
        if self.eps:                      # log(exp(p − max p) + eps) + max p: eps is added after the row shift
            shift = proj.amax(-1, keepdim=True)
            proj = torch.logaddexp(proj - shift, torch.full_like(proj, math.log(self.eps))) + shift
        return proj + offset[..., None], torch.ones_like(proj)


class TrigonometricFeatures(RandomFeatureMap):
    r"""Trigonometric random features (random Fourier features of the softmax kernel).

    .. math::
        φ(x) = \frac{e^{\|x\|^2/2}}{\sqrt m}\,\big(\sin ω_1^⊤x,…,\sin ω_m^⊤x,\ \cos ω_1^⊤x,…,\cos ω_m^⊤x\big)

    By Bochner, ``E cos(ωᵀ(x−y)) = exp(−‖x−y‖²/2)``, so ``E φ(x)ᵀφ(y) = SM(x, y)``: **unbiased, not
    positive**; the normaliser ``Σ φ(q)ᵀφ(k_i)`` can be ≤ 0 (a measured phenomenon, see
    :func:`kernapprox.metrics.nonpositive_normalizer_rate`). ``r = 2m``.

    MSE (Performer Lemma 2, first line): ``(1/2m) exp(‖x+y‖²) SM⁻²(x,y) (1 − exp(−‖x−y‖²))²``, i.e. relative
    MSE ``(2/m) sinh²(‖x−y‖²/2)``; see :func:`kernapprox.theory.trig_mse`.

    Stabilised form: ``φ̃ = (sin, cos)``, ``ℓ = ‖x‖²/2 − ½ log m``. ``eps`` must be 0 (no positive shift makes
    sense for signed features).

    References
    ----------
    Rahimi & Recht, *Random Features for Large-Scale Kernel Machines*, NeurIPS 2007.
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, §2.3 eq. (5), Lemma 2.
    """

    features_per_frequency = 2
    positive = False
    reference = "Choromanski et al. 2021 (Performer) §2.3 eq. (5), Lemma 2; Rahimi & Recht 2007"

    def _log_features(self, x, role):
        return self._log_features_into(x, role, None)

    def _log_features_into(self, x, role, buffer):
        w = self._param("projection_", x)
        const = -0.5 * math.log(self.num_frequencies)
        if fused.use_fused(x, x.numel() // x.shape[-1] * self.num_features, "trigonometric"):
            out = fused.trigonometric_features(fused.flat(x), w, fused.scalars(self, "trig", x, const),
                                               buffer=None if buffer is None else fused.flat(buffer))
            if out is not None:
                return fused.unflat(out, x.shape[:-1])
        proj = x @ w.T
        phi = torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1)
        logs = 0.5 * (x * x).sum(-1) + const
        return phi, logs


class PositiveFeatures(ExponentialRandomFeatureMap):
    r"""Positive random features (FAVOR+ "SM⁺").

    .. math::
        φ(x) = \frac{e^{-\|x\|^2/2}}{\sqrt m}\,\big(e^{ω_1^⊤x},…,e^{ω_m^⊤x}\big)

    Performer Lemma 1: ``SM(x,y) = E_ω[exp(ωᵀx − ‖x‖²/2) exp(ωᵀy − ‖y‖²/2)]``: **unbiased and strictly
    positive**. ``r = m``. MSE (Lemma 2, second line): ``(1/m) exp(‖x+y‖²) SM²(x,y) (1 − exp(−‖x+y‖²))``,
    relative MSE ``(exp(‖x+y‖²) − 1)/m`` — it explodes with the norms; see :func:`kernapprox.theory.positive_mse`.
    With the ``orthogonal`` sampler this is FAVOR+ proper (Theorem 2 bounds its MSE for m ≤ d).

    Stabilised form: ``φ̃_j = exp(ω_jᵀx − max_i ω_iᵀx) + eps``, ``ℓ = max_i ω_iᵀx − ‖x‖²/2 − ½ log m``
    (a per-row shift; the attention code adds one key shift per query row — the maximum key scale, a running
    maximum when causal — all of which cancel in the normalised output when ``eps = 0``). ``eps`` (default 0) is
    added after the shift, as in the reference code, and biases the estimate.

    References
    ----------
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 1, Lemma 2, Theorem 2.
    """

    positive = True
    reference = "Choromanski et al. 2021 (Performer) Lemma 1 (map), Lemma 2 (MSE), Theorem 2 (orthogonal)"

    def _exponents(self, x, role):
        proj = x @ self._param("projection_", x).T
        return proj, -0.5 * (x * x).sum(-1) - 0.5 * math.log(self.num_frequencies)

    def _fused_arguments(self, x, role):
        return (x, self._param("projection_", x), None,
                fused.scalars(self, "positive", x, self._log_constant(), self.eps, 1.0))

    def _log_constant(self) -> float:
        return -0.5 * math.log(self.num_frequencies)


class HyperbolicFeatures(ExponentialRandomFeatureMap):
    r"""Hyperbolic positive random features ("SM^{hyp+}").

    .. math::
        φ(x) = \frac{e^{-\|x\|^2/2}}{\sqrt{2m}}\,\big(e^{ω_1^⊤x},…,e^{ω_m^⊤x},\ e^{-ω_1^⊤x},…,e^{-ω_m^⊤x}\big)

    ``SM(x,y) = exp(−(‖x‖²+‖y‖²)/2) E cosh(ωᵀ(x+y))``: **unbiased and positive**, ``r = 2m``. MSE (Lemma 2,
    third line): ``½ (1 − exp(−‖x+y‖²)) · MSE(SM⁺_m)``, relative MSE ``(2/m) sinh²(‖x+y‖²/2)``, strictly
    better than positive features with ``2m`` frequencies; see :func:`kernapprox.theory.hyperbolic_mse`.

    References
    ----------
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 1 (``h = 2^{-1/2} e^{-‖x‖²/2}``,
    ``f₁ = exp``, ``f₂ = exp(−·)``) and Lemma 2.
    """

    features_per_frequency = 2
    positive = True
    reference = "Choromanski et al. 2021 (Performer) Lemma 1 (hyperbolic), Lemma 2 (MSE)"

    def _exponents(self, x, role):
        proj = x @ self._param("projection_", x).T
        return torch.cat([proj, -proj], dim=-1), -0.5 * (x * x).sum(-1) - 0.5 * math.log(2 * self.num_frequencies)

    def _fused_arguments(self, x, role):
        w = self._derived("fused:hyperbolic_weight", x, lambda: torch.cat([torch.as_tensor(self.projection_),
                                                                            -torch.as_tensor(self.projection_)]))
        return x, w, None, fused.scalars(self, "hyperbolic", x, self._log_constant(), self.eps, 1.0)

    def _log_constant(self) -> float:
        return -0.5 * math.log(2 * self.num_frequencies)


for _name, _cls in (("trig", TrigonometricFeatures), ("positive", PositiveFeatures),
                    ("hyperbolic", HyperbolicFeatures)):
    register(_name, _cls, sampler="iid")
    for _sampler in SAMPLER_VARIANTS:    # <map>_orthogonal, _regularized, _sorf, _sorf_chi, _qmc
        register(f"{_name}_{_sampler}", _cls, sampler=_sampler)
