"""Deterministic feature maps: the second-order Taylor map (Based) and two fixed maps that define other kernels.

Nothing here is random. :class:`TaylorFeatures` approximates ``exp(t)`` by its truncated series
``1 + t + t²/2`` exactly (``φ(q)ᵀφ(k)`` *equals* the polynomial); :class:`EluPlusOneFeatures` and
:class:`DPFPFeatures` are **not estimators of exp** — they are the fixed maps of linear-attention architectures
and define their own kernels, useful as baselines of what a state of a given size can store (in-context
recall/regression capacity), not as approximations to measure against ``exp``.

All maps apply the estimator's scale first, ``x = sqrt(s)·input`` (``s = 1/sqrt(d)`` by default), so the Taylor
map's ``t = s·qᵀk`` is the softmax logit; pass ``scale=1.0`` to apply ELU+1 or DPFP to the raw inputs as in their
papers. ``num_features`` is ignored by all three (the dimension is fixed by ``d``), as for the exact kernel.
Features are polynomial in ``x``, so nothing overflows; the stabilised form still returns unit-norm ``φ̃`` with
``ℓ = log ‖φ(x)‖`` (Taylor, ELU+1), so that ``φ̃`` has entries of order one whatever the input norm (DPFP, whose
features can all vanish, returns ``ℓ = 0``).
"""

from __future__ import annotations

import math

import torch

from ..validation import NotFittedError, check_choice, check_positive_int
from .base import FeatureMap
from .registry import register

__all__ = ["TaylorFeatures", "EluPlusOneFeatures", "DPFPFeatures"]


class _FixedMap(FeatureMap):
    """A deterministic map whose dimension is a function of ``d``.

    ``num_features`` is ``None`` (the dimension follows from ``d``) or exactly that dimension; any other value
    cannot be honoured and raises at ``fit``, naming the dimension the map has.
    """

    fixed_dimension = True

    def __init__(self, *, num_features: int | None = None, rng=None, scale: float | None = None):
        if num_features is not None:
            check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)

    def _fit(self, q, k, rng):
        wanted, dim = self.num_features_param, self._output_dim(self.dim_)
        if wanted is not None and wanted != dim:
            raise ValueError(f"num_features={wanted} cannot be honoured: {type(self).__name__} has dimension {dim} "
                             f"at d={self.dim_} (fixed by d; pass num_features=None)")

    def _output_dim(self, d: int) -> int:
        raise NotImplementedError

    @property
    def num_features(self) -> int:
        if not getattr(self, "fitted_", False):
            raise NotFittedError(f"{type(self).__name__}: num_features is known only after fit (it depends on d)")
        return self._output_dim(self.dim_)


class TaylorFeatures(_FixedMap):
    r"""Second-order Taylor feature map of ``exp`` (Based): ``φ(q)ᵀφ(k) = 1 + t + t²/2`` exactly, ``t = s·qᵀk``.

    ``form="packed"`` (default; the flash-linear-attention layout):
    ``φ(x) = [1, x, (x_l²/√2)_l, (x_l x_m)_{l<m}]``, dimension ``1 + d + d(d+1)/2``.
    ``form="full"`` (the Based layout): ``φ(x) = [1, x, vec(x xᵀ)/√2]``, dimension ``1 + d + d²``, with every
    off-diagonal product twice. Both give ``1 + xᵀy + (xᵀy)²/2`` (the packed form because
    ``Σ_l x_l²y_l²/2 + Σ_{l<m} x_lx_my_ly_m = (xᵀy)²/2``); the tests check this to float64 precision.

    **Deterministic and biased** (truncation: the error is ``Σ_{n≥3} t^n/n!``, relative error ``≈ t³/6`` for
    small ``t``, and the polynomial is not even monotone-faithful for ``t ≪ −1``). The kernel value is always
    positive (``1 + t + t²/2 = ((1+t)² + 1)/2 > 0``), so normalisers are positive, but the features are signed
    (``positive = False``). Data independent, causal.

    References
    ----------
    Arora et al., *Simple linear attention language models balance the recall-throughput tradeoff* (Based),
    ICML 2024, Taylor feature map (reference code ``based/models/mixers/linear_attention.py::TaylorExp``);
    flash-linear-attention ``fla/modules/feature_map.py::TaylorFeatureMap`` for the packed layout.
    """

    reference = "Arora et al. 2024 (Based), 2nd-order Taylor map of exp"

    def __init__(self, *, num_features: int | None = None, form: str = "packed", rng=None,
                 scale: float | None = None):
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.form = check_choice(form, "form", ("packed", "full"))

    def _output_dim(self, d):
        return 1 + d + (d * (d + 1) // 2 if self.form == "packed" else d * d)

    def _fit(self, q, k, rng):
        super()._fit(q, k, rng)
        rows, cols = torch.triu_indices(self.dim_, self.dim_, offset=1)
        self._upper = (rows, cols)

    def _log_features(self, x, role):
        # Written through the unit vector u = x/a, a = ‖x‖, and log-domain coefficients, so that no power of
        # ‖x‖ is ever formed (‖x‖⁴ overflows float32 at ‖x‖ ≈ 1e19, x_l x_m already at 1e19 per entry):
        # φ = [1, a u, a² u⊗u/√2] and ‖φ‖² = 1 + a² + a⁴/2 in both forms.
        a, u = _norm_and_direction(x)
        log_a = torch.log(a)
        log_norm = 0.5 * torch.logaddexp(torch.logaddexp(torch.zeros_like(log_a), 2 * log_a),
                                         4 * log_a - math.log(2.0))           # log ‖φ(x)‖
        c0 = torch.exp(-log_norm)[..., None]                                     # (0·log a is NaN at x = 0)
        c1, c2 = (torch.exp(p * log_a - log_norm)[..., None] for p in (1, 2))
        if self.form == "full":
            outer = (u[..., :, None] * u[..., None, :]).flatten(-2) * 0.5**0.5
            phi = torch.cat([c0, c1 * u, c2 * outer], dim=-1)
        else:
            rows, cols = (i.to(x.device) for i in self._upper)
            phi = torch.cat([c0, c1 * u, c2 * (u * u * 0.5**0.5), c2 * (u[..., rows] * u[..., cols])], dim=-1)
        return phi, log_norm


class EluPlusOneFeatures(_FixedMap):
    r"""``φ(x) = elu(x) + 1`` (linear transformer), dimension ``d``: **not an estimator of exp**.

    Kernel ``κ(q, k) = Σ_l (elu(x_l) + 1)(elu(y_l) + 1)`` with ``x = sqrt(s)·q``; strictly positive features
    (``elu(u) + 1 = e^u`` for ``u ≤ 0``, ``1 + u`` above), hence positive normalisers. Computed as ``e^u`` for
    ``u ≤ 0`` rather than ``1 + (e^u − 1)``, which cancels to exactly 0 in low precision (the bfloat16 failure
    at ``u ≈ −8`` reported for other implementations); features are computed in float32 or wider.
    Deterministic, data independent, causal. ``unbiased = False`` because the kernel differs from ``exp``.

    References
    ----------
    Katharopoulos, Vyas, Pappas, Fleuret, *Transformers are RNNs: Fast Autoregressive Transformers with Linear
    Attention*, ICML 2020, eq. (7).
    """

    positive = True
    reference = "Katharopoulos et al. 2020 (Transformers are RNNs), eq. (7); a different kernel, not exp"

    def _output_dim(self, d):
        return d

    def _log_abs_features(self, x, role):
        # elu(x) + 1 in the log domain: log φ = x for x ≤ 0 (exp(x): the sum 1 + expm1(x) cancels to 0 long before
        # exp underflows), log1p(x) above; exact for any finite x, even where exp(x) underflows
        log_phi = torch.where(x > 0, torch.log1p(torch.clamp_min(x, 0.0)), torch.clamp_max(x, 0.0))
        return log_phi, torch.ones_like(log_phi)

    def _log_features(self, x, role):
        log_phi, _ = self._log_abs_features(x, role)
        log_norm = 0.5 * torch.logsumexp(2 * log_phi, dim=-1)                  # log ‖φ(x)‖, never -inf
        return torch.exp(log_phi - log_norm[..., None]), log_norm


class DPFPFeatures(_FixedMap):
    r"""Deterministic parameter-free projection (DPFP), dimension ``2dν``: **not an estimator of exp**.

    With ``u = [ReLU(x), ReLU(−x)] ∈ R^{2d}`` and cyclic shifts, ``φ_ν(x) = (u_i · u_{(i−j) mod 2d})`` for
    ``j = 1..ν``, ``i = 1..2d``: products of pairs of entries at cyclic distance ``1..ν``. The kernel
    ``κ(q, k) = φ_ν(x)ᵀφ_ν(y)`` is a sum of degree-2 products of rectified coordinates: features are
    non-negative and sparse (``u_i u_{i+d} = 0``), so a normaliser can be **exactly zero** (e.g. ``d = 1``, or
    queries and keys with disjoint sign patterns), in which case linear attention divides by zero; hence
    ``positive = False``. ``1 ≤ ν ≤ 2d − 1`` (a shift of ``2d`` repeats the unshifted vector). Deterministic,
    data independent, causal.

    References
    ----------
    Schlag, Irie, Schmidhuber, *Linear Transformers Are Secretly Fast Weight Programmers*, ICML 2021
    (arXiv 2102.11174), DPFP.
    """

    reference = "Schlag, Irie & Schmidhuber 2021 (arXiv 2102.11174), DPFP; a different kernel, not exp"

    def __init__(self, *, num_features: int | None = None, nu: int = 1, rng=None, scale: float | None = None):
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.nu = check_positive_int(nu, "nu")

    def _output_dim(self, d):
        return 2 * d * self.nu

    def _fit(self, q, k, rng):
        super()._fit(q, k, rng)
        if self.nu > 2 * self.dim_ - 1:
            raise ValueError(f"nu must be at most 2d - 1 = {2 * self.dim_ - 1} for d = {self.dim_}, got {self.nu}")

    def _log_features(self, x, role):
        # Products of the rectified coordinates divided by the largest (so they neither overflow nor underflow),
        # normalised; ℓ = 2 log max|u| + log‖φ̂‖. A vector whose features all vanish keeps φ̃ = 0 and ℓ = 0.
        top = x.abs().amax(-1, keepdim=True)
        safe = torch.where(top > 0, top, torch.ones_like(top))
        u = torch.cat([torch.relu(x), torch.relu(-x)], dim=-1) / safe
        phi = torch.cat([u * torch.roll(u, shifts=j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)
        norm = torch.linalg.vector_norm(phi, dim=-1, keepdim=True)
        nonzero = norm > 0
        phi = phi / torch.where(nonzero, norm, torch.ones_like(norm))
        logs = torch.where(nonzero, 2 * torch.log(safe) + torch.log(torch.where(nonzero, norm, torch.ones_like(norm))),
                           torch.zeros_like(norm))
        return phi, logs.squeeze(-1)


def _norm_and_direction(x):
    """``(‖x‖, x/‖x‖)`` without squaring large entries, shapes ``(...)`` and ``(..., d)``; ``u = 0`` for ``x = 0``."""
    top = x.abs().amax(-1, keepdim=True)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    scaled = x / safe
    norm = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)
    u = scaled / torch.where(norm > 0, norm, torch.ones_like(norm))
    return (top * norm).squeeze(-1), u


register("taylor2", TaylorFeatures, form="packed")
register("taylor2_based", TaylorFeatures, form="full")
register("elu1", EluPlusOneFeatures)
