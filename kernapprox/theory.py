"""Closed-form mean-squared errors of the random-feature estimators of ``SM(x, y) = exp(xᵀy)``.

Inputs ``x, y`` are already scaled (``x = sqrt(s)·q``); arrays of shape ``(..., d)`` (numpy or torch);
``m`` is the number of random *frequencies* (``r = 2m`` for trig and hyperbolic maps, ``r = m`` for positive).
All formulas are for one pair and i.i.d. Gaussian projections unless stated; they are evaluated in float64.

References: Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 2 (three lines) and
Theorem 2 (orthogonal features).
"""

from __future__ import annotations

import numpy as np


def _xy(x, y):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must share the last dimension, got {x.shape[-1]} and {y.shape[-1]}")
    return x, y


def _m(m):
    if isinstance(m, bool) or int(m) != m or m <= 0:
        raise ValueError(f"m must be a positive integer, got {m!r}")
    return int(m)


def softmax_kernel(x, y):
    """``SM(x, y) = exp(xᵀy)``."""
    x, y = _xy(x, y)
    return np.exp((x * y).sum(-1))


def trig_mse(x, y, m):
    """Lemma 2 (line 1): ``(1/2m) exp(‖x+y‖²) SM⁻²(x,y) (1 − exp(−‖x−y‖²))²``
    ``= (1/2m) exp(‖x‖²+‖y‖²) (1 − exp(−‖x−y‖²))²``."""
    x, y, m = *_xy(x, y), _m(m)
    delta2 = ((x - y) ** 2).sum(-1)
    return np.exp((x * x).sum(-1) + (y * y).sum(-1)) * (-np.expm1(-delta2)) ** 2 / (2 * m)


def positive_mse(x, y, m):
    """Lemma 2 (line 2): ``(1/m) exp(‖x+y‖²) SM²(x,y) (1 − exp(−‖x+y‖²))``."""
    x, y, m = *_xy(x, y), _m(m)
    z2 = ((x + y) ** 2).sum(-1)
    return np.exp(z2 + 2 * (x * y).sum(-1)) * (-np.expm1(-z2)) / m


def hyperbolic_mse(x, y, m):
    """Lemma 2 (line 3): ``½ (1 − exp(−‖x+y‖²)) · MSE(SM⁺_m(x, y))``."""
    x, y = _xy(x, y)
    z2 = ((x + y) ** 2).sum(-1)
    return 0.5 * (-np.expm1(-z2)) * positive_mse(x, y, m)


def orthogonal_positive_mse_bound(x, y, m):
    """Theorem 2: for ``m ≤ d`` orthogonal (chi-norm) frequencies,
    ``MSE(SM^{ort+}_m) ≤ MSE(SM⁺_m) − 2(m−1)/(m(d+2)) · (SM(x,y) − exp(−(‖x‖²+‖y‖²)/2))²``."""
    x, y, m = *_xy(x, y), _m(m)
    d = x.shape[-1]
    if m > d:
        raise ValueError(f"Theorem 2 holds for m <= d, got m={m}, d={d}")
    gap = softmax_kernel(x, y) - np.exp(-0.5 * ((x * x).sum(-1) + (y * y).sum(-1)))
    return positive_mse(x, y, m) - 2 * (m - 1) / (m * (d + 2)) * gap**2


def relative_mse(name: str, x, y, m):
    """``MSE / SM²`` for ``name`` in {"trig", "positive", "hyperbolic"}."""
    fn = {"trig": trig_mse, "positive": positive_mse, "hyperbolic": hyperbolic_mse}
    if name not in fn:
        raise ValueError(f"unknown name {name!r}; valid values: {', '.join(fn)}")
    return fn[name](x, y, m) / softmax_kernel(x, y) ** 2
