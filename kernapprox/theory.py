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


# ------------------------------------------------------------------ exponential families (GERF, OPRF, DERF)
def _A_array(A, name="A", upper=0.125):
    A = np.asarray(A, dtype=np.float64)
    if not np.all(np.isfinite(A)) or np.any(A >= upper):
        raise ValueError(f"{name} must be finite and < {upper} (finite variance needs 8A < 1), got {A}")
    return A


def gerf_variance(x, y, A, m):
    r"""Variance of the positive generalised exponential (GERF) estimator of ``SM(x, y)`` with ``m`` i.i.d. frequencies.

    Map (softmax form, ``s = +1``): ``f(ω, x) = (1−4A)^{d/4} exp(A‖ω‖² + sqrt(1−4A) ωᵀx − ‖x‖²/2)``,
    ``ω ~ N(0, I_d)``, unbiased for ``A < 1/4``. One sample has second moment
    ``(1−4A)^d (1−8A)^{−d/2} exp(2(1−4A)/(1−8A) ‖x+y‖² − ‖x‖² − ‖y‖²)`` (finite iff ``A < 1/8``), so

    .. math::
        \mathrm{Var} = \frac{1}{m}\Big[(1-4A)^d (1-8A)^{-d/2} e^{2\frac{1-4A}{1-8A}\|x+y\|^2-\|x\|^2-\|y\|^2}
        - SM(x,y)^2\Big].

    ``A = 0`` gives :func:`positive_mse` (Performer Lemma 2). ``A`` may be an array broadcasting against
    ``x.shape[:-1]``. Derived from the Gaussian integral ``E exp(a‖ω‖² + bᵀω) = (1−2a)^{−d/2} e^{‖b‖²/(2(1−2a))}``
    and checked by Monte Carlo in the tests.

    References
    ----------
    Likhosherstov et al., *Chefs' Random Tables: Non-Trigonometric Random Features*, NeurIPS 2022 (GERF family;
    the real-``A``, ``s = +1`` case written out here).
    """
    x, y, m = *_xy(x, y), _m(m)
    A = _A_array(A)
    d = x.shape[-1]
    z2 = ((x + y) ** 2).sum(-1)
    log_m2 = (d * np.log1p(-4 * A) - 0.5 * d * np.log1p(-8 * A) + 2 * (1 - 4 * A) / (1 - 8 * A) * z2
              - (x * x).sum(-1) - (y * y).sum(-1))
    return (np.exp(log_m2) - softmax_kernel(x, y) ** 2) / m


def oprf_optimal_A(rho):
    r"""The GERF parameter minimising the (averaged log) second moment: OPRF / FAVOR++.

    .. math::
        A^* = \tfrac{1}{16}\Big(1 - 2ρ - \sqrt{(2ρ+1)^2 + 8ρ}\Big),\qquad ρ = \operatorname{mean}\|x+y\|^2 / d.

    Setting the derivative in ``A`` of ``d log(1−4A) − (d/2) log(1−8A) + 2(1−4A)/(1−8A)·‖x+y‖²`` to zero gives
    ``16 A² + (4ρ − 2) A − ρ = 0``; this is its root below ``1/8``. ``A* ≤ 0`` (``= 0`` only at ``ρ = 0``), so
    the features are bounded. The objective is linear in ``‖x+y‖²``, so for many pairs the mean of
    ``‖x_i + y_j‖²`` gives the exact minimiser of the mean log second moment (the "homogeneity heuristic").
    For a single pair it is the exact argmin of :func:`gerf_variance` (``SM²`` does not depend on ``A``).
    Identical to the quadratic-root parametrisation of the reference code (``A = (1 − 1/r)/8`` with
    ``2ρd r² + (2ρd + d) r − d = 0``); the tests check both.

    References
    ----------
    Likhosherstov et al., *Chefs' Random Tables*, NeurIPS 2022 (OPRF); tensorflow/models
    ``official/nlp/modeling/layers/kernel_attention.py::expplus`` (FAVOR++).
    """
    rho = np.asarray(rho, dtype=np.float64)
    if not np.all(np.isfinite(rho)) or np.any(rho < 0):
        raise ValueError(f"rho must be finite and non-negative, got {rho}")
    return (1.0 - 2.0 * rho - np.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0


def derf_log_second_moment(x, y, A, B1, B2):
    r"""``log E[(f⁽¹⁾(ω,x) f⁽²⁾(ω,y))²]`` for a dense-exponential (DERF) pair, ``ω ~ N(0, I_d)``.

    ``f⁽ᵏ⁾(ω, x) = det(I−4A)^{1/4} exp(ωᵀAω + ωᵀB⁽ᵏ⁾x + xᵀC⁽ᵏ⁾x)`` with ``C⁽ᵏ⁾ = −½ B⁽ᵏ⁾ᵀ(I−4A)⁻¹B⁽ᵏ⁾`` and the
    validity condition ``B⁽¹⁾ᵀ(I−4A)⁻¹B⁽²⁾ = I`` (checked here; it makes ``E f⁽¹⁾f⁽²⁾ = exp(xᵀy)``). With
    ``H = I − 8A ≻ 0`` and ``u = B⁽¹⁾x + B⁽²⁾y``:

    .. math::
        \log E[(f^{(1)}f^{(2)})^2] = \log\det(I-4A) - \tfrac12\log\det H + 2x^⊤C^{(1)}x + 2y^⊤C^{(2)}y
        + 2u^⊤H^{-1}u.

    ``A``, ``B1``, ``B2`` are ``(d, d)`` (``A`` symmetric). GERF is ``A = aI``, ``B⁽ᵏ⁾ = sqrt(1−4a) I``; SADERF,
    ADERF and SDERF are other members. Derived from the Gaussian integral and checked by Monte Carlo in the tests.

    References
    ----------
    Likhosherstov et al., *Dense-Exponential Random Features: Sharp Positive Estimators of the Gaussian Kernel*,
    NeurIPS 2023 (arXiv 2302.00787), the DERF family.
    """
    x, y = _xy(x, y)
    d = x.shape[-1]
    A, B1, B2 = (np.asarray(a, dtype=np.float64) for a in (A, B1, B2))
    for name, mat in (("A", A), ("B1", B1), ("B2", B2)):
        if mat.shape != (d, d):
            raise ValueError(f"{name} must have shape ({d}, {d}), got {mat.shape}")
    if not np.allclose(A, A.T):
        raise ValueError("A must be symmetric")
    eye = np.eye(d)
    g, h = eye - 4 * A, eye - 8 * A
    if np.linalg.eigvalsh(h).min() <= 0:
        raise ValueError("I - 8A must be positive definite (finite variance)")
    g_inv = np.linalg.inv(g)
    if not np.allclose(B1.T @ g_inv @ B2, eye, atol=1e-8):
        raise ValueError("B1, B2 violate the DERF validity condition B1ᵀ(I−4A)⁻¹B2 = I")
    h_inv = np.linalg.inv(h)
    u = x @ B1.T + y @ B2.T
    quad1 = -0.5 * np.einsum("...i,ij,...j->...", x, B1.T @ g_inv @ B1, x)
    quad2 = -0.5 * np.einsum("...i,ij,...j->...", y, B2.T @ g_inv @ B2, y)
    return (np.linalg.slogdet(g)[1] - 0.5 * np.linalg.slogdet(h)[1] + 2 * quad1 + 2 * quad2
            + 2 * np.einsum("...i,ij,...j->...", u, h_inv, u))


def derf_variance(x, y, A, B1, B2, m):
    """Variance of the DERF estimator with ``m`` i.i.d. frequencies: ``(exp(derf_log_second_moment) − SM²)/m``."""
    m = _m(m)
    return (np.exp(derf_log_second_moment(x, y, A, B1, B2)) - softmax_kernel(x, y) ** 2) / m


# ----------------------------------------------------------------------------------------- random Maclaurin
def maclaurin_variance(x, y, m, p=2.0, max_degree=None, *, weights="rademacher"):
    r"""Mean and variance of the random-Maclaurin estimator of ``exp(xᵀy)`` with ``m`` features.

    One feature product is ``Z(x)Z(y) = a_N/P(N) · Π_{j≤N} (w_jᵀx)(w_jᵀy)`` with ``a_n = 1/n!``, Rademacher
    ``w_j`` and the degree ``N`` drawn with ``P(N = n) = (p−1) p^{−(n+1)}`` (untruncated, ``p > 1``) or
    ``P(N = n) = p^{−n}/Z_T``, ``Z_T = Σ_{n≤T} p^{−n}`` (``max_degree = T``). With
    ``c = E[(wᵀx)²(wᵀy)²] = ‖x‖²‖y‖² + 2(xᵀy)² − 2Σ_i x_i²y_i²`` (Rademacher; drop the last term for Gaussian
    ``w``), the second moment is ``Σ_n a_n² c^n / P(n)``:

    .. math::
        E[(ZZ')^2] = \frac{p}{p-1} I_0\big(2\sqrt{pc}\big)\ \ (\text{untruncated}),\qquad
        Z_T \sum_{n\le T} \frac{(pc)^n}{(n!)^2}\ \ (\text{truncated}).

    The mean is ``exp(xᵀy)`` untruncated and the Taylor polynomial ``Σ_{n≤T} (xᵀy)^n/n!`` when truncated (bias
    ``−Σ_{n>T} (xᵀy)^n/n!``). Returns ``(mean, variance)``, variance of the ``m``-feature average.

    References
    ----------
    Kar & Karnick, *Random Feature Maps for Dot Product Kernels*, AISTATS 2012 (the estimator; the closed-form
    variance is derived here and checked against an exact enumeration in the tests).
    """
    from scipy import special

    x, y, m = *_xy(x, y), _m(m)
    p = float(p)
    if not np.isfinite(p) or p <= 1:
        raise ValueError(f"p must be a finite number > 1, got {p}")
    if weights not in ("rademacher", "gaussian"):
        raise ValueError(f"unknown weights {weights!r}; valid values: rademacher, gaussian")
    t = (x * y).sum(-1)
    c = (x * x).sum(-1) * (y * y).sum(-1) + 2 * t**2
    if weights == "rademacher":
        c = c - 2 * (x * x * y * y).sum(-1)
    if max_degree is None:
        mean = np.exp(t)
        arg = 2 * np.sqrt(p * c)
        m2 = p / (p - 1) * special.i0e(arg) * np.exp(arg)
    else:
        if isinstance(max_degree, bool) or int(max_degree) != max_degree or max_degree < 0:
            raise ValueError(f"max_degree must be None or a non-negative integer, got {max_degree!r}")
        n = np.arange(int(max_degree) + 1)
        log_fact = special.gammaln(n + 1)
        z_t = np.sum(p ** (-n.astype(np.float64)))
        mean = np.sum(t[..., None] ** n / np.exp(log_fact), axis=-1)
        m2 = z_t * np.sum((p * c[..., None]) ** n / np.exp(2 * log_fact), axis=-1)
    return mean, (m2 - mean**2) / m
