"""Error metrics. Each takes torch tensors and returns a float64 tensor reduced over the last axes it names.

Every metric checks both sides for NaN/Inf: a non-finite approximation gives ``inf`` (the failure is
measured, not hidden); a non-finite reference raises ``ValueError``.
"""

from __future__ import annotations

import torch

from .validation import check_tensor


def _pair(approx, exact):
    check_tensor(exact, "exact", min_rank=1)
    check_tensor(approx, "approx", min_rank=1, finite=False)
    if approx.shape != exact.shape:
        raise ValueError(f"approx and exact must have the same shape, got {tuple(approx.shape)} and "
                         f"{tuple(exact.shape)}")
    return approx.double(), exact.double()


def _inf_where_nonfinite(value, approx, dims):
    bad = ~torch.isfinite(approx).all(dim=dims) if dims else ~torch.isfinite(approx)
    return torch.where(bad, torch.full_like(value, float("inf")), value)


def relative_frobenius_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``‖Â − A‖_F / ‖A‖_F`` over the last two axes (one value per batch/head)."""
    a, e = _pair(approx, exact)
    num = torch.linalg.matrix_norm(torch.nan_to_num(a - e, nan=0.0, posinf=0.0, neginf=0.0))
    val = num / torch.linalg.matrix_norm(e)
    return _inf_where_nonfinite(val, a, (-1, -2))


def max_relative_entry_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``max_ij |Â_ij − A_ij| / A_ij`` over the last two axes (``A`` must be positive, e.g. a kernel matrix)."""
    a, e = _pair(approx, exact)
    if not bool((e > 0).all()):
        raise ValueError("exact must be entrywise positive for a relative entry error")
    val = ((a - e).abs() / e).nan_to_num(nan=float("inf")).amax(dim=(-1, -2))
    return _inf_where_nonfinite(val, a, (-1, -2))


def relative_rms_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Relative RMS error of attention outputs ``sqrt(Σ‖ŷ_i − y_i‖²) / sqrt(Σ‖y_i‖²)`` over the last two axes
    (rows and value dimension); ``inf`` where ``ŷ`` has a non-finite entry."""
    a, e = _pair(approx, exact)
    diff = torch.nan_to_num(a - e, nan=0.0, posinf=0.0, neginf=0.0)
    val = diff.pow(2).sum(dim=(-1, -2)).sqrt() / e.pow(2).sum(dim=(-1, -2)).sqrt()
    return _inf_where_nonfinite(val, a, (-1, -2))


def nonpositive_normalizer_rate(normalizer: torch.Tensor) -> torch.Tensor:
    """Fraction of queries whose estimated normaliser ``Σ_j φ(q_i)ᵀφ(k_j)`` is ≤ 0 or not finite.

    Takes ``(..., n)`` and returns ``(...)``. Zero for positive maps; trigonometric features hit it as
    ``‖q‖`` grows.
    """
    check_tensor(normalizer, "normalizer", min_rank=1, finite=False)
    bad = (normalizer <= 0) | ~torch.isfinite(normalizer)
    return bad.double().mean(-1)
