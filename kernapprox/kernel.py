"""The exp-dot-product (softmax) kernel ``SM_s(q, k) = exp(s · qᵀk)`` and its exact matrices.

Scaling follows ``torch.nn.functional.scaled_dot_product_attention``: ``s`` defaults to ``1/sqrt(d)``.
Feature maps apply ``sqrt(s)`` to both arguments (the ``d^{-1/4}`` convention of every Performer
implementation), so that ``exp(s qᵀk) = SM(x, y)`` with ``x = sqrt(s) q`` and ``y = sqrt(s) k``.
"""

from __future__ import annotations

import math

import torch

from .validation import check_positive_float, check_qk, compute_dtype


def resolve_scale(dim: int, scale: float | None) -> float:
    """``scale`` if given (must be positive and finite), else ``1/sqrt(dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(dim)
    return check_positive_float(scale, "scale")


def _logits(q, k, scale):
    """``s · Q Kᵀ`` in the compute dtype (float32 for half-precision inputs)."""
    check_qk(q, k)
    s = resolve_scale(q.shape[-1], scale)
    ct = compute_dtype(q.dtype)
    return s * (q.to(ct) @ k.to(ct).transpose(-1, -2))


def log_kernel_matrix(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``log SM_s(q_i, k_j) = s · q_iᵀ k_j`` for all pairs: ``(..., n_q, n_k)``, in the inputs' dtype (computed in
    float32 for half-precision inputs)."""
    return _logits(q, k, scale).to(q.dtype)


def kernel_matrix(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The exact kernel matrix ``exp(s · Q Kᵀ)``, shape ``(..., n_q, n_k)``, in the inputs' dtype.

    This is the reference every estimator's ``kernel_matrix`` approximates. It materialises the full matrix by
    definition; attention at large ``n`` goes through :func:`kernapprox.softmax_attention`, which never does.
    """
    return torch.exp(_logits(q, k, scale)).to(q.dtype)     # half inputs: exp in float32, rounded once
