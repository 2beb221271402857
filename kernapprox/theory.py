"""Closed-form mean-squared errors of the random-feature estimators of ``SM(x, y) = exp(xᵀy)``.

Inputs ``x, y`` are already scaled (``x = sqrt(s)·q``); arrays of shape ``(..., d)`` (numpy or torch);
``m`` is the number of random *frequencies* (``r = 2m`` for trig and hyperbolic maps, ``r = m`` for positive).
All formulas are for one pair and i.i.d. Gaussian projections unless stated; they are evaluated in float64.

References: Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 2 (three lines) and
Theorem 2 (orthogonal features).
"""

from __future__ import annotations

import functools
import math

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
    ``MSE(SM^{ort+}_m) ≤ MSE(SM⁺_m) − 2(m−1)/(m(d+2)) · (SM(x,y) − exp(−(‖x‖²+‖y‖²)/2))²``.

    For ``m = k·d`` (``k`` independent Haar blocks of ``d`` rows, the ``orthogonal`` sampler) the estimator is the
    mean of ``k`` independent unbiased block estimators, so its MSE is a block's divided by ``k``: the bound at
    ``d`` times ``d/m``. Other ``m > d`` (a partial last block) raise."""
    x, y, m = *_xy(x, y), _m(m)
    d = x.shape[-1]
    if m > d:
        if m % d:
            raise ValueError(f"Theorem 2 holds for m <= d or m a multiple of d (independent blocks), got m={m}, "
                             f"d={d}")
        return orthogonal_positive_mse_bound(x, y, d) * (d / m)
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
    t = 2.0 * rho + 1.0
    root = t * np.sqrt(1.0 + 8.0 * rho / t / t)        # sqrt(t² + 8ρ) without squaring t (no overflow at huge ρ)
    return (1.0 - 2.0 * rho - root) / 16.0


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


# ------------------------------------------------------------------------------- rows of fixed norm (SMREG)
def log_sphere_mgf(s2, dim):
    r"""``log E exp(uᵀw)`` for ``u`` uniform on the unit sphere ``S^{d−1} ⊂ R^d`` and ``‖w‖² = s2``.

    .. math::
        E\,e^{u^⊤w} = {}_0F_1\big(;\tfrac d2;\tfrac{s^2}{4}\big) = Γ(ν+1)\Big(\frac{2}{s}\Big)^{ν} I_ν(s),
        \qquad ν = \tfrac d2 − 1,\ s = \|w\|.

    Derivation: ``t = uᵀw/‖w‖`` has density ``∝ (1−t²)^{(d−3)/2}`` on ``[−1, 1]``, so odd moments vanish and
    ``E t^{2n} = (1/2)_n / (d/2)_n``; then ``E e^{st} = Σ_n s^{2n} (1/2)_n / ((d/2)_n (2n)!) = Σ_n (s²/4)^n /
    ((d/2)_n n!)`` because ``(2n)! = 4^n n! (1/2)_n``. This is the characteristic function of the uniform law on
    the sphere at an imaginary argument (Watson 1944, §3.7). Summed in log space, so it neither overflows nor
    underflows (the Bessel form underflows for ``d/2 ≫ s``); ``d = 1`` gives ``log cosh s``.

    Parameters
    ----------
    s2 : array_like
        ``‖w‖² ≥ 0``.
    dim : int
        ``d ≥ 1``.

    Examples
    --------
    >>> import numpy as np
    >>> round(float(np.exp(log_sphere_mgf(4.0, 3))), 6) == round(float(np.sinh(2.0) / 2.0), 6)   # d = 3: sinh(s)/s
    True
    """
    dim = _m(dim)
    s2 = np.asarray(s2, dtype=np.float64)
    if not np.all(np.isfinite(s2)) or np.any(s2 < 0):
        raise ValueError(f"s2 must be finite and non-negative, got {s2}")
    out = np.vectorize(lambda v: _log_hyp0f1(dim / 2.0, v / 4.0), otypes=[np.float64])(s2)
    return out if out.ndim else float(out)


def _log_hyp0f1(b: float, x: float) -> float:
    """``log ₀F₁(; b; x)`` for ``x ≥ 0`` by its series in log space: the terms ``x^n/((b)_n n!)`` rise to a peak
    near ``(b+n)(n+1) = x`` and then fall faster than geometrically; summation stops 50 nats below the peak (no
    overflow or underflow at any order or argument, unlike ``I_ν`` for ``ν ≫ s``)."""
    from scipy import special

    if x == 0.0:
        return 0.0
    peak = 0.5 * (-(b + 1.0) + math.sqrt((b - 1.0) ** 2 + 4.0 * x))
    count = int(max(peak, 0.0) + 12.0 * math.sqrt(max(peak, 1.0)) + 60.0)
    n = np.arange(count, dtype=np.float64)
    log_terms = n * math.log(x) - special.gammaln(b + n) + special.gammaln(b) - special.gammaln(n + 1.0)
    if log_terms[-1] > log_terms.max() - 50.0:
        raise ValueError(f"0F1 series did not converge in {count} terms (b={b}, x={x})")
    return float(special.logsumexp(log_terms))


def sphere_characteristic(s2, dim):
    r"""``E cos(uᵀw) = ₀F₁(; d/2; −‖w‖²/4) = Γ(ν+1) (2/s)^ν J_ν(s)`` for ``u`` uniform on ``S^{d−1}``,
    ``‖w‖² = s2`` (``ν = d/2 − 1``): the characteristic function of the uniform law on the sphere (same series as
    :func:`log_sphere_mgf` with alternating signs). It oscillates in sign for large ``s``."""
    from scipy import special

    dim = _m(dim)
    s2 = np.asarray(s2, dtype=np.float64)
    if not np.all(np.isfinite(s2)) or np.any(s2 < 0):
        raise ValueError(f"s2 must be finite and non-negative, got {s2}")
    return special.hyp0f1(dim / 2.0, -s2 / 4.0)


REGULARIZED_KINDS = ("positive", "hyperbolic", "trig")


def regularized_mean_ratio(norm2, dim, *, kind: str = "positive", A=0.0, radius2=None):
    r"""``E[estimate] / SM(x, y)`` of a random-feature estimator whose rows are uniform on the sphere of radius
    ``sqrt(radius2)`` (default ``sqrt(d)``: the ``regularized`` sampler, Performer's SMREG).

    Only the law of one row matters for the mean. With ``ω = R u``, ``u`` uniform on ``S^{d−1}``, and
    :func:`log_sphere_mgf` ``M_d``:

    ``kind="positive"`` or ``"hyperbolic"`` (``norm2 = ‖x+y‖²``), GERF when ``A ≠ 0``
        ``(1−4A)^{d/2} e^{2AR²} M_d((1−4A) R² ‖x+y‖²) e^{−‖x+y‖²/2}``. From
        ``f(ω,x) f(ω,y) = (1−4A)^{d/2} exp(2A‖ω‖² + sqrt(1−4A) ωᵀ(x+y) − (‖x‖²+‖y‖²)/2)`` and
        ``SM = exp(xᵀy)``. ``A = 0`` is the positive (and, by the symmetry ``u → −u``, hyperbolic) map: Performer
        Theorem 1's SMREG, below 1 (Theorem 1). With Gaussian rows the same expectation is exactly 1; for GERF and
        OPRF the fixed norm enters twice, through ``e^{2A‖ω‖²}`` and through the projection.
    ``kind="trig"`` (``norm2 = ‖x−y‖²``)
        ``E cos(R uᵀ(x−y)) / e^{−‖x−y‖²/2}`` (:func:`sphere_characteristic`).

    At Performer scaling ``x = q/d^{1/4}`` with unit-variance ``q, k``, independent pairs have
    ``‖x+y‖² ≈ 2√d``, and the positive ratio tends to ``e^{−1}`` as ``d`` grows (``log ₀F₁(; b; x) = x/b −
    x²/(2b³) + …`` with ``b = d/2``, ``x = d‖z‖²/4``): 0.548, 0.505, 0.471, 0.444 at d = 16, 32, 64, 128.

    Parameters
    ----------
    norm2 : array_like
        ``‖x+y‖²`` (positive, hyperbolic, GERF) or ``‖x−y‖²`` (trig), scaled inputs.
    dim : int
    kind : {"positive", "hyperbolic", "trig"}
    A : float or array_like, default 0
        The GERF parameter (``< 1/8``); must be 0 for ``trig``.
    radius2 : float, optional
        ``R²`` (default ``d``).

    References
    ----------
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, §2.4 and Theorem 1 (SMREG).

    Examples
    --------
    >>> round(float(regularized_mean_ratio(4.0, 32)), 4)        # ‖x+y‖² = 4, d = 32
    0.9021
    """
    if kind not in REGULARIZED_KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid values: {', '.join(REGULARIZED_KINDS)}")
    dim = _m(dim)
    norm2 = np.asarray(norm2, dtype=np.float64)
    if not np.all(np.isfinite(norm2)) or np.any(norm2 < 0):
        raise ValueError(f"norm2 must be finite and non-negative, got {norm2}")
    r2 = float(dim if radius2 is None else radius2)
    if not np.isfinite(r2) or r2 <= 0:
        raise ValueError(f"radius2 must be a finite positive number, got {radius2!r}")
    A = _A_array(A)
    if kind == "trig":
        if np.any(A != 0):
            raise ValueError("A must be 0 for kind='trig'")
        return sphere_characteristic(r2 * norm2, dim) * np.exp(norm2 / 2.0)
    log_norm = 0.5 * dim * np.log1p(-4.0 * A) + 2.0 * A * r2
    return np.exp(log_norm + log_sphere_mgf((1.0 - 4.0 * A) * r2 * norm2, dim) - norm2 / 2.0)


def sign_averaged_ratio(rows, x, y, *, kind: str = "positive", A=0.0, radial: str | None = None,
                        nodes: int = 12):
    r"""Per-row ``E_ε[f(ε∘ω, x) f(ε∘ω, y)] / SM(x, y)`` over independent coordinate signs ``ε`` (and, with
    ``radial="chi"``, over an independent ``chi(d)`` norm): low-variance unbiased estimates of the mean of a
    random-feature estimator over a row law with those symmetries.

    The mean of an estimator with rows ``ω_1..ω_m`` is the mean, over the marginal law of one row, of the per-row
    product (linearity). For the positive (``A = 0``), hyperbolic and GERF maps, averaging
    ``exp(√(1−4A) ωᵀz)`` over the ``2^d`` sign patterns gives ``Π_l cosh(√(1−4A) ω_l z_l)`` (``z = x+y``); for
    the trig map ``cos(ωᵀδ)`` gives ``Π_l cos(ω_l δ_l)`` (``δ = x−y``). If the row law is invariant under
    coordinate sign flips (i.i.d. Gaussian rows; Haar orthogonal blocks with any norms, whose law is invariant
    under ``Q → QS``; SORF, whose rows are ``D₃ · c`` with ``D₃`` Rademacher independent of ``c``), the mean of
    these values is the estimator's mean, with the sign noise integrated out exactly.

    ``radial="chi"`` also integrates out the norm: each row is replaced by its direction ``u = ω/‖ω‖`` and the
    value is ``E_ρ[·]`` over ``ρ ~ chi(d)`` independent of ``u``, by ``nodes``-point generalised Gauss–Laguerre
    quadrature in ``t = ρ²/2 ~ Gamma(d/2)`` (12 nodes reach 1e-6 relative accuracy for ``‖x+y‖² ≤ 2√d``). This
    is the estimator's mean only for samplers whose norms are independent ``chi(d)`` draws: i.i.d. Gaussian rows,
    ``orthogonal``, and ``sorf_chi`` when ``d`` is a power of two. For trig rows it is not available.

    The values are returned divided by ``SM(x, y)``, so their mean is the mean-to-kernel ratio (1 for an
    unbiased estimator).

    Parameters
    ----------
    rows : ndarray (N, d)
        Rows ``ω`` drawn by a sampler (float64).
    x, y : ndarray (d,)
        Scaled query and key.
    kind : {"positive", "hyperbolic", "trig"}
    A : float
        GERF parameter (``< 1/8``; 0 for positive, hyperbolic and trig).
    radial : {None, "chi"}
    nodes : int
        Quadrature nodes for ``radial="chi"``.

    Returns
    -------
    ndarray (N,)

    Examples
    --------
    >>> import numpy as np
    >>> x = y = np.full(4, 0.25)
    >>> rows = np.random.default_rng(0).standard_normal((20_000, 4))
    >>> abs(float(sign_averaged_ratio(rows, x, y, radial="chi").mean()) - 1.0) < 0.01    # Gaussian rows
    True
    """
    from scipy import special

    if kind not in REGULARIZED_KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid values: {', '.join(REGULARIZED_KINDS)}")
    if radial not in (None, "chi"):
        raise ValueError(f"unknown radial {radial!r}; valid values: None, 'chi'")
    nodes = _m(nodes)
    rows = np.asarray(rows, dtype=np.float64)
    x, y = _xy(x, y)
    if rows.ndim != 2 or x.ndim != 1 or y.ndim != 1 or rows.shape[1] != x.shape[0]:
        raise ValueError(f"rows must be (N, d) and x, y (d,), got {rows.shape}, {x.shape}, {y.shape}")
    A = float(_A_array(A))
    d = x.shape[0]
    if kind == "trig":
        if A != 0 or radial is not None:
            raise ValueError("kind='trig' takes A = 0 and radial=None")
        delta = x - y
        return np.prod(np.cos(rows * delta), axis=1) * np.exp(0.5 * float(delta @ delta))
    c = math.sqrt(1.0 - 4.0 * A)
    z2 = float((x + y) @ (x + y))
    offset = 0.5 * d * math.log1p(-4.0 * A) - z2 / 2.0

    def log_value(a, sq_norm):          # a = |ω_l| · √(1−4A)|z_l| for rows of squared norm sq_norm
        log_cosh = a + np.log1p(np.exp(-2.0 * a)) - math.log(2.0)      # stable for large arguments
        return offset + 2.0 * A * sq_norm + log_cosh.sum(-1)

    a = np.abs(rows * (c * (x + y)))
    if radial is None:
        return np.exp(log_value(a, (rows * rows).sum(1)))
    norms = np.linalg.norm(rows, axis=1)
    if np.any(norms == 0):
        raise ValueError("radial='chi' needs rows with a direction: a row is zero")
    a = a / norms[:, None]
    t, w = special.roots_genlaguerre(nodes, d / 2.0 - 1.0)
    w = w / math.exp(special.gammaln(d / 2.0))
    out = np.zeros(len(rows))
    for t_j, w_j in zip(t, w):
        rho = math.sqrt(2.0 * t_j)
        out += w_j * np.exp(log_value(rho * a, rho * rho))
    return out


# ------------------------------------------------------------------- orthogonal rows: exact joint moments
def orthogonal_exp_moment(s2, dim, multiplicities):
    r"""``E exp(Σ_k a_k ω_kᵀw)`` for ``K ≤ d`` rows of one orthogonal block with independent ``chi(d)`` norms
    (the ``orthogonal`` sampler), ``‖w‖² = s2``, ``a = multiplicities``.

    Write ``ω_k = ρ_k u_k`` (``ρ_k ~ chi(d)`` independent, ``u_1..u_K`` an orthonormal frame uniform on the
    Stiefel manifold). The vector ``(u_kᵀw/‖w‖)_k`` is the first ``K`` coordinates of one uniform unit vector,
    whose even moments are ``E Π_k v_k^{2i_k} = Π_k (2i_k−1)!! / Π_{t<I} (d+2t)`` (``I = Σ i_k``; odd ones vanish),
    and ``E ρ^{2i} = 2^i (d/2)_i``. Expanding the exponential:

    .. math::
        E\,e^{\sum_k a_k ω_k^⊤w} = \sum_{I\ge0} \frac{c_I}{2^I (d/2)_I},\qquad
        c_I = [t^I] \prod_{k=1}^K (1 − a_k^2 s^2 t)^{-d/2}.

    For independent Gaussian rows the same expansion gives ``Π_k e^{a_k² s²/2}``; the orthogonal coupling replaces
    ``(d/2)_{i}(d/2)_{j}/(d/2)_{i+j}`` for ``1`` in the cross terms, which is what lowers the variance (Performer
    Theorem 2). The series has positive terms; it is summed in log space until the terms fall below ``1e-18`` of
    the sum.

    Parameters
    ----------
    s2 : float
        ``‖w‖² ≥ 0``.
    dim : int
        ``d``.
    multiplicities : sequence of float
        ``a_1..a_K`` (``K ≤ d``); ``a_k = 0`` entries are dropped.

    Examples
    --------
    >>> import math
    >>> math.isclose(orthogonal_exp_moment(0.7, 5, [1.0]), math.exp(0.7 / 2), rel_tol=1e-12)   # one row: Gaussian
    True
    """
    from scipy import special

    dim = _m(dim)
    s2 = float(s2)
    if not math.isfinite(s2) or s2 < 0:
        raise ValueError(f"s2 must be finite and non-negative, got {s2}")
    a2 = np.asarray([float(a) ** 2 for a in multiplicities if float(a) != 0.0])
    if len(a2) > dim:
        raise ValueError(f"at most d = {dim} orthogonal rows, got {len(a2)} multiplicities")
    if len(a2) == 0 or s2 == 0.0:
        return 1.0
    b = a2 * s2
    scale = float(b.max())
    half = dim / 2.0
    num_terms = int(8 * scale * len(b) + 12 * math.sqrt(scale * len(b) + 1) + 60)
    i = np.arange(num_terms, dtype=np.float64)
    # coefficients of (1 − b_k t)^{−d/2} in τ = scale·t, in log space: (d/2)_i (b_k/scale)^i / i!
    log_pochhammer = special.gammaln(half + i) - special.gammaln(half) - special.gammaln(i + 1.0)
    series = None
    for bk in b:
        coef = np.exp(log_pochhammer + i * math.log(bk / scale))
        series = coef if series is None else np.convolve(series, coef)[:num_terms]
    with np.errstate(divide="ignore"):
        log_terms = (np.log(series) + i * math.log(scale / 2.0) - special.gammaln(half + i) + special.gammaln(half))
    total = special.logsumexp(log_terms)
    if log_terms[-1] - total > math.log(1e-18):
        raise ValueError(f"series did not converge in {num_terms} terms (s2={s2}, multiplicities={multiplicities})")
    return float(np.exp(total))


def _central_moment(raw, mean, powers):
    """``E Π_k (g_k − mean)^{p_k}`` for exchangeable ``g_k`` from ``raw(multiset of powers) = E Π g_k^{q_k}``."""
    total = 0.0
    for choice in np.ndindex(*(p + 1 for p in powers)):
        weight = 1.0
        for p, q in zip(powers, choice):
            weight *= math.comb(p, q) * (-mean) ** (p - q)
        total += weight * raw(tuple(q for q in choice if q))
    return total


def positive_error_moments(x, y, m, *, sampler: str = "orthogonal"):
    r"""``(E e², E e⁴)`` of the error ``e = SM̂⁺_m(x, y) − SM(x, y)`` of positive random features with ``m``
    frequencies, exactly: for i.i.d. Gaussian rows or for ``m ≤ d`` rows of one orthogonal block with ``chi(d)``
    norms (FAVOR+, Performer Theorem 2).

    ``SM̂ = (1/m) Σ_k g_k`` with ``g_k = exp(ω_kᵀz − (‖x‖²+‖y‖²)/2)``, ``z = x + y``. The rows are exchangeable,
    so expanding ``(Σ_k (g_k − SM))^p`` by the pattern of repeated indices,

    ``E e² = [m μ₂ + m(m−1) E h₁h₂] / m²``,
    ``E e⁴ = [m μ₄ + 4m(m−1) E h₁³h₂ + 3m(m−1) E h₁²h₂² + 6m(m−1)(m−2) E h₁²h₂h₃ + m(m−1)(m−2)(m−3) E h₁h₂h₃h₄] / m⁴``

    (``h_k = g_k − SM``), and every mixed moment is a sum of raw moments
    ``E Π g_k^{q_k} = e^{−Σq (‖x‖²+‖y‖²)/2} E exp(Σ_k q_k ω_kᵀz)`` given by :func:`orthogonal_exp_moment`
    (``Π_k e^{q_k²‖z‖²/2}`` for i.i.d. rows). ``E e²`` is the MSE (Performer Lemma 2 for i.i.d. rows; the exact
    value that Theorem 2 bounds for orthogonal rows) and ``Var(e²) = E e⁴ − (E e²)²`` is the variance of one
    squared error: the sample MSE over ``N`` independent draws has variance ``Var(e²)/N``.

    Parameters
    ----------
    x, y : array_like (d,)
        One scaled pair.
    m : int
        Number of frequencies (``≤ d`` for the orthogonal sampler).
    sampler : {"orthogonal", "iid"}

    Returns
    -------
    (float, float)

    References
    ----------
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 2 and Theorem 2 (the exact
    moments here are derived in this docstring and :func:`orthogonal_exp_moment`, and checked by Monte Carlo).
    """
    x, y, m = *_xy(x, y), _m(m)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError("x and y must be single vectors (d,)")
    if sampler not in ("orthogonal", "iid"):
        raise ValueError(f"unknown sampler {sampler!r}; valid values: orthogonal, iid")
    d = x.shape[0]
    if sampler == "orthogonal" and m > d:
        raise ValueError(f"the orthogonal moments hold for m <= d, got m={m}, d={d}")
    s2 = float((x + y) @ (x + y))
    log_pref = -0.5 * float(x @ x + y @ y)
    kernel = math.exp(float(x @ y))

    @functools.cache
    def raw(powers):
        if sampler == "iid":
            log_mgf = sum(q * q for q in powers) * s2 / 2.0
            return math.exp(sum(powers) * log_pref + log_mgf)
        return math.exp(sum(powers) * log_pref) * orthogonal_exp_moment(s2, d, powers)

    def central(*powers):
        return _central_moment(raw, kernel, powers)

    mse = (m * central(2) + m * (m - 1) * central(1, 1)) / m**2
    fourth = (m * central(4) + 4 * m * (m - 1) * central(3, 1) + 3 * m * (m - 1) * central(2, 2)
              + 6 * m * (m - 1) * (m - 2) * central(2, 1, 1)
              + m * (m - 1) * (m - 2) * (m - 3) * central(1, 1, 1, 1)) / m**4
    return mse, fourth
