"""The state-dimension spectrum: how fast the exact kernel matrix's spectrum decays, and what rank it needs.

Which matrix
------------
Attention only ever uses the rectangular block ``A = exp(s · Q Kᵀ)`` (queries against keys), and any
linear-attention state of feature dimension ``r`` produces an approximation ``Φ(Q) Ψ(K)ᵀ`` of rank at most
``r``. By Eckart–Young–Mirsky the best such approximation in Frobenius norm keeps the top ``r`` singular values
of ``A``, so the singular values of the rectangular ``A`` answer "which state dimension does this data need"
for every estimator at once, symmetric or not: :func:`kernel_singular_values` is the primary quantity.

Symmetric maps (one ``φ`` for queries and keys, e.g. random features) and symmetric Nyström approximate the
positive semi-definite joint matrix ``exp(s · X Xᵀ)`` on ``X = [Q; K]`` instead, of which ``A`` is the
off-diagonal block; :func:`joint_kernel_singular_values` gives its spectrum (for a PSD matrix, singular values
are the eigenvalues) as a secondary view. Its rank bounds the rank of ``A`` from above.

Both are computed in float64 after subtracting the largest logit (relative spectra are scale-free, and this
keeps ``exp`` finite for any temperature), from matrices built on the device; ``n`` up to a few thousand.
:func:`attention_singular_values` does the same for the row-normalised attention matrix ``softmax(s QKᵀ)``,
whose best rank-``r`` error bounds the attention weights of every rank-``r`` linear attention.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .kernel import log_kernel_matrix
from .validation import check_positive_float, check_tensor


def _normalised_kernel(log_k: torch.Tensor) -> torch.Tensor:
    """``exp(log_k − max)`` per matrix, float64."""
    log_k = log_k.double()
    top = log_k.amax(dim=(-1, -2), keepdim=True)
    return torch.exp(log_k - top)


def kernel_singular_values(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> np.ndarray:
    """Singular values of ``exp(s · Q Kᵀ)`` divided by the largest one, in descending order.

    Parameters
    ----------
    q, k : Tensor ``(..., n_q, d)``, ``(..., n_k, d)``
    scale : float, optional
        ``s``; defaults to ``1/sqrt(d)``.

    Returns
    -------
    numpy float64 ``(..., min(n_q, n_k))`` with first entry 1.
    """
    check_tensor(q, "q")
    check_tensor(k, "k")
    a = _normalised_kernel(log_kernel_matrix(q.double(), k.double(), scale))
    sv = torch.linalg.svdvals(a)
    return (sv / sv[..., :1]).cpu().numpy()


def attention_singular_values(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> np.ndarray:
    """Singular values of the (non-causal) attention matrix ``P = softmax(s · Q Kᵀ)`` (rows sum to one), divided
    by the largest, descending: ``(..., min(n_q, n_k))``.

    ``P = D⁻¹A`` has the rank of ``A`` but weighs every query row equally; any linear attention with ``r``
    features gives ``P̂ = D̂⁻¹ Φ(Q)Ψ(K)ᵀ`` of rank ≤ ``r``, so ``eckart_young_errors`` of these values bound the
    attention-weight error of every rank-``r`` method from below.
    """
    check_tensor(q, "q")
    check_tensor(k, "k")
    weights = torch.softmax(log_kernel_matrix(q.double(), k.double(), scale), dim=-1)
    sv = torch.linalg.svdvals(weights)
    return (sv / sv[..., :1]).cpu().numpy()


def joint_kernel_singular_values(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> np.ndarray:
    """Eigenvalues (= singular values) of the PSD joint matrix ``exp(s · X Xᵀ)``, ``X = [Q; K]``, divided by the
    largest, descending: ``(..., n_q + n_k)``.

    Computed as the absolute eigenvalues of the symmetric matrix (the singular values of a symmetric matrix
    are ``|λ|`` exactly); round-off shows up as tiny values at the tail and is left as is.
    """
    check_tensor(q, "q")
    check_tensor(k, "k")
    x = torch.cat([q, k], dim=-2).double()
    a = _normalised_kernel(log_kernel_matrix(x, x, scale))
    ev = torch.linalg.eigvalsh(a).abs()
    ev = torch.sort(ev, dim=-1, descending=True).values
    return (ev / ev[..., :1]).cpu().numpy()


def _check_singular_values(singular_values) -> np.ndarray:
    sv = np.asarray(singular_values)
    if sv.ndim < 1 or sv.shape[-1] == 0:
        raise ValueError(f"singular_values must be a non-empty array (..., n), got shape {sv.shape}")
    if not np.issubdtype(sv.dtype, np.floating) and not np.issubdtype(sv.dtype, np.integer):
        raise TypeError(f"singular_values must be real numbers, got dtype {sv.dtype}")
    sv = sv.astype(np.float64)
    if not np.isfinite(sv).all() or (sv < 0).any():
        raise ValueError("singular_values must be finite and non-negative")
    if (np.diff(sv, axis=-1) > 0).any():
        raise ValueError("singular_values must be in non-increasing order along the last axis")
    return sv


def eckart_young_errors(singular_values) -> np.ndarray:
    """Relative Frobenius error of the best rank-``r`` approximation, for ``r = 0..n``.

    ``e_r = sqrt(Σ_{i>r} σ_i²) / sqrt(Σ_i σ_i²)`` (Eckart & Young 1936; Mirsky 1960 for every unitarily
    invariant norm). ``singular_values`` ``(..., n)`` non-increasing; returns ``(..., n + 1)``, ``e_0 = 1``,
    ``e_n = 0``. Tail sums are accumulated from the smallest value up, so tiny tails keep their precision.
    """
    sv = _check_singular_values(singular_values)
    sq = sv ** 2
    tail = np.cumsum(sq[..., ::-1], axis=-1)[..., ::-1]                   # tail[r] = Σ_{i ≥ r} σ², 0-based
    total = tail[..., :1]
    tail = np.concatenate([tail, np.zeros_like(total)], axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(tail / total)


def rank_for_relative_error(singular_values, target: float) -> np.ndarray:
    """Smallest ``r`` with ``sqrt(Σ_{i>r} σ_i²) / sqrt(Σ_i σ_i²) ≤ target``: the rank the best (SVD) state of
    that size needs to reach relative Frobenius error ``target`` (Eckart–Young). Integer array ``(...)``.
    """
    target = check_positive_float(target, "target")
    errors = eckart_young_errors(singular_values)
    return np.argmax(errors <= target, axis=-1)


def smallest_size_reaching(errors, sizes, target: float) -> float:
    """Smallest entry of ``sizes`` whose error is ``≤ target`` (NaN errors never qualify), or NaN if none.

    For estimators measured on a grid of feature counts: the grid analogue of :func:`rank_for_relative_error`.
    """
    target = check_positive_float(target, "target")
    errors = np.asarray(errors, dtype=np.float64)
    sizes = np.asarray(sizes)
    if errors.shape != sizes.shape or errors.ndim != 1:
        raise ValueError(f"errors and sizes must be 1-d of the same length, got {errors.shape} and {sizes.shape}")
    if not all(isinstance(s, numbers.Real) for s in sizes.tolist()) or (np.diff(sizes) <= 0).any():
        raise ValueError("sizes must be increasing numbers")
    ok = np.flatnonzero(errors <= target)
    return float(sizes[ok[0]]) if ok.size else float("nan")
