"""Projection samplers: where the random frequencies ``ω_1..ω_m ∈ R^d`` come from.

Every random-feature map takes a sampler, so each family (trig, positive, hyperbolic, GERF, ...) can be run with
every sampler. A sampler draws an ``(m, d)`` float64 numpy array from a numpy ``Generator`` on the CPU; the map
moves it to the device and dtype it needs, so one seed gives one draw everywhere.

========================  =====================================================  ===================================
name                      rows                                                   marginal of each row
========================  =====================================================  ===================================
``iid``                   i.i.d. ``N(0, I_d)``                                   exact ``N(0, I_d)``: unbiased
``orthogonal``            Haar-orthogonal blocks of ``d`` rows, each row         exact ``N(0, I_d)``: unbiased,
                          rescaled by an independent ``chi(d)`` norm             lower variance (Performer Thm 2)
``regularized``           orthogonal blocks with every norm set to ``sqrt(d)``   uniform on the sphere of radius
                          (Performer's SMREG)                                    ``sqrt(d)``: **biased** (Thm 1)
``sorf``                  rows of ``sqrt(p) H D3 H D2 H D1`` (``p`` = next       norm exactly ``sqrt(d)`` (d a power
                          power of two ≥ d), first ``d`` columns                 of two), direction near uniform:
                                                                                 **biased like SMREG** (below)
``sorf_chi``              SORF rows rescaled to independent ``chi(p)`` norms     Gaussian norm law, SORF direction:
                                                                                 bias below measurement (below)
``qmc``                   scrambled Sobol points mapped through the Gaussian     each point marginally ``N(0, I_d)``
                          inverse CDF                                            (scrambling): unbiased
========================  =====================================================  ===================================

Bias of ``regularized`` and ``sorf`` at Performer scaling. For positive features the mean estimate is
``SM(x, y) · e^{−‖x+y‖²/2} ₀F₁(; d/2; d‖x+y‖²/4)`` with rows uniform on the sphere of radius ``sqrt(d)``
(:func:`kernapprox.theory.regularized_mean_ratio`). It tends to ``SM`` as ``d`` grows at a fixed ``‖x+y‖``
(Yu et al.'s regime), but not at Performer scaling ``x = q/d^{1/4}`` with unit-variance ``q, k``, where a typical
independent pair has ``‖x+y‖² = 2√d`` and the ratio tends to ``e^{−1}``. Measured by
``experiments/sampler_bias.py`` (default preset: 5 seeds × 4 pairs, mean estimate / kernel with 95 % bootstrap
intervals, positive features, ``‖x+y‖² = 2√d``):

=====  ======================  ======================  ======================  ============
d      ``sorf``                ``regularized``         ``sorf_chi``            closed form
=====  ======================  ======================  ======================  ============
16     0.547 [0.545, 0.549]    0.548 [0.547, 0.549]    1.001 [0.995, 1.006]    0.547
32     0.504 [0.502, 0.507]    0.504 [0.501, 0.506]    0.996 [0.987, 1.004]    0.505
64     0.469 [0.466, 0.472]    0.472 [0.468, 0.476]    1.006 [0.995, 1.017]    0.471
128    0.445 [0.441, 0.449]    0.444 [0.439, 0.449]    0.997 [0.980, 1.016]    0.444
=====  ======================  ======================  ======================  ============

At ``‖x+y‖² = 4`` SORF gives 0.837, 0.902, 0.945, 0.971 of the kernel at d = 16, 32, 64, 128 (closed form the
same to 3 digits). SORF's interval contains the sphere closed form in every measured cell (4 levels of
``‖x+y‖²`` × 4 d × positive and OPRF maps): its bias is SMREG's. OPRF (FAVOR++) is biased as well, less at this
level: 0.769 [0.756, 0.784] with SORF at d = 128. ``sorf_chi`` contains 1 in every cell (largest deviation
1.006 [0.995, 1.017]); the unbiasedness test (``tests/estimators/test_unbiasedness.py``) bounds its bias at d = 4 too.
It is still declared biased: its directions are not uniform, only its norms are exact.

References
----------
Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021 (arXiv 2009.14794), §2.4, Thm 1-2, App. B.2.
Mezzadri, *How to generate random matrices from the classical compact groups*, Notices AMS 2007 (sign fix).
Yu et al., *Orthogonal Random Features*, NeurIPS 2016 (SORF; its bias → 0 as d grows at fixed ‖z‖/σ, §4).
Avron et al., *Quasi-Monte Carlo feature maps for shift-invariant kernels*, JMLR 17 (2016).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import special, stats
from scipy.linalg import hadamard


class ProjectionSampler:
    """Base class: ``sample(num, dim, rng)`` returns an ``(num, dim)`` float64 array."""

    name: str = ""
    unbiased: bool = True

    def sample(self, num: int, dim: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GaussianSampler(ProjectionSampler):
    """i.i.d. standard Gaussian rows ``ω ~ N(0, I_d)``."""

    name = "iid"

    def sample(self, num, dim, rng):
        return rng.standard_normal((num, dim))


def haar_orthogonal(dim: int, rng: np.random.Generator, num_blocks: int | None = None) -> np.ndarray:
    """Haar-distributed orthogonal matrices: QR of Gaussian matrices with the ``sign(diag R)`` fix.

    Returns ``(dim, dim)``, or ``(num_blocks, dim, dim)`` independent matrices from one batched QR (the same
    draws, in the same order, as ``num_blocks`` successive single calls). Without the sign fix, LAPACK's sign
    convention makes ``Q`` non-Haar (Mezzadri 2007).
    """
    shape = (dim, dim) if num_blocks is None else (num_blocks, dim, dim)
    g = rng.standard_normal(shape)
    q, r = np.linalg.qr(g)
    signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1))
    signs[signs == 0] = 1.0
    return q * signs[..., None, :]


class OrthogonalSampler(ProjectionSampler):
    """Blocks of exactly orthogonal rows (Performer §2.4, ORF).

    Parameters
    ----------
    norms : {"chi", "regularized"}
        ``"chi"`` rescales each row by an independent ``chi(d)`` variable, the norm of a fresh Gaussian vector,
        so every row is marginally ``N(0, I_d)`` and estimators stay unbiased. ``"regularized"`` sets every
        norm to ``sqrt(d)`` (SMREG), which is biased low (Performer Theorem 1).
    """

    def __init__(self, norms: str = "chi"):
        if norms not in ("chi", "regularized"):
            raise ValueError(f"unknown norms {norms!r}; valid values: chi, regularized")
        self.norms = norms
        self.name = "orthogonal" if norms == "chi" else "regularized"
        self.unbiased = norms == "chi"

    def sample(self, num, dim, rng):
        blocks = haar_orthogonal(dim, rng, num_blocks=math.ceil(num / dim))  # (blocks, d, d)
        rows = blocks.reshape(-1, dim)[:num]
        if self.norms == "chi":
            norms = np.linalg.norm(rng.standard_normal((num, dim)), axis=1)
        else:
            norms = np.full(num, math.sqrt(dim))
        return rows * norms[:, None]

    def __repr__(self):
        return f"OrthogonalSampler(norms={self.norms!r})"


class StructuredSampler(ProjectionSampler):
    """SORF: blocks ``sqrt(p) · H D3 H D2 H D1`` with ``H`` the normalised Walsh–Hadamard matrix of size
    ``p = 2^ceil(log2 d)`` and ``D_i`` Rademacher diagonals; the first ``d`` columns act on ``x`` (zero padding).

    Parameters
    ----------
    norms : {"hadamard", "chi"}
        ``"hadamard"`` (``sorf``, Yu et al. 2016): the rows as built. Each block is ``sqrt(p)`` times an orthogonal
        matrix, so every padded row has norm exactly ``sqrt(p)``: when ``d`` is a power of two every row has norm
        ``sqrt(d)``, the norm of the ``regularized`` (SMREG) sampler, and its direction is close to uniform, so it
        has SMREG's bias (below). ``"chi"`` (``sorf_chi``): each padded row is rescaled to an independent
        ``chi(p)`` length (the norm of a fresh Gaussian vector in ``R^p``) before the first ``d`` columns are
        kept, so the law of the norm is exactly that of a Gaussian row and only the direction is SORF's.

    Notes
    -----
    Bias. Every entry has variance 1 (``E ωωᵀ = I``), but rows are not Gaussian: with a norm fixed at
    ``sqrt(d)`` the estimator has the bias of the ``regularized`` sampler, which does not vanish with d at
    Performer scaling (module table: 0.445 of the kernel at d = 128 for a typical pair). ``sorf_chi`` makes the
    norm law exact; what remains comes from the direction law and was below measurement in every cell of
    ``experiments/sampler_bias.py``. Neither is declared unbiased.

    The matrix is materialised (one batched product per draw): we measure its statistical quality, not the
    ``O(d log d)`` fast transform.

    References
    ----------
    Yu, Suresh, Choromanski, Holtmann-Rice, Kumar, *Orthogonal Random Features*, NeurIPS 2016, §4 (SORF).
    """

    unbiased = False

    def __init__(self, norms: str = "hadamard"):
        if norms not in ("hadamard", "chi"):
            raise ValueError(f"unknown norms {norms!r}; valid values: hadamard, chi")
        self.norms = norms
        self.name = "sorf" if norms == "hadamard" else "sorf_chi"

    def sample(self, num, dim, rng):
        p = 1 << max(0, (dim - 1).bit_length())
        h = hadamard(p).astype(np.float64) / math.sqrt(p)
        num_blocks = math.ceil(num / p)
        signs = rng.choice([-1.0, 1.0], size=(num_blocks, 3, p))       # D1, D2, D3 of each block, in draw order
        block = h[None] * signs[:, 0, None, :]                          # H D1
        block = h @ (signs[:, 1, :, None] * block)                      # H D2 H D1
        block = h @ (signs[:, 2, :, None] * block)                      # H D3 H D2 H D1
        rows = math.sqrt(p) * block.reshape(num_blocks * p, p)[:num]   # every padded row has norm sqrt(p)
        if self.norms == "chi":
            lengths = np.linalg.norm(rng.standard_normal((num, p)), axis=1)
            rows = rows * (lengths / math.sqrt(p))[:, None]
        return np.ascontiguousarray(rows[:, :dim])

    def __repr__(self):
        return f"StructuredSampler(norms={self.norms!r})"


class QMCSampler(ProjectionSampler):
    """Scrambled quasi-Monte Carlo rows: ``ω = Φ^{-1}(u)`` with ``u`` from a scrambled Sobol (or Halton)
    sequence (Avron et al. 2016). Scrambling makes each point marginally uniform, so the estimator stays
    unbiased while the points are negatively correlated (lower variance for smooth integrands).

    Sobol: scipy's LMS + digital-shift scramble on a 30-bit grid, completed by a uniform offset inside the grid
    cell (the undrawn low digits), so each row is exactly ``N(0, I_d)``. Halton: scipy's random digit
    permutations; each row is uniform on a fine finite grid (approximately, not exactly, Gaussian).
    """

    def __init__(self, kind: str = "sobol"):
        if kind not in ("sobol", "halton"):
            raise ValueError(f"unknown kind {kind!r}; valid values: sobol, halton")
        self.kind = kind
        self.name = "qmc" if kind == "sobol" else "halton"

    def sample(self, num, dim, rng):
        engine_cls = stats.qmc.Sobol if self.kind == "sobol" else stats.qmc.Halton
        # An integer seed drawn from rng: passing the Generator lets scipy spawn from (and mutate) the
        # SeedSequence behind it, so a refit from the same seed would differ.
        engine = engine_cls(d=dim, scramble=True, seed=int(rng.integers(2**63 - 1)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Sobol balance warning for non-powers of two
            u = engine.random(num)
        if self.kind == "sobol":
            # Sobol points live on a 2^-bits grid (30 bits by default), which would make each coordinate a
            # discrete uniform and cut the Gaussian tails at |ω| ≈ 6.1. Owen scrambling randomises the digits
            # below the grid independently and uniformly, so a uniform offset inside the cell completes it:
            # each point is then exactly U[0, 1)^d.
            u = u + rng.random(u.shape) * 2.0 ** -engine.bits
        u = np.clip(u, np.finfo(np.float64).tiny, 1.0 - np.finfo(np.float64).eps)
        return special.ndtri(u)

    def __repr__(self):
        return f"QMCSampler(kind={self.kind!r})"


SAMPLERS = {
    "iid": GaussianSampler,
    "orthogonal": lambda: OrthogonalSampler("chi"),
    "regularized": lambda: OrthogonalSampler("regularized"),
    "sorf": StructuredSampler,
    "sorf_chi": lambda: StructuredSampler("chi"),
    "qmc": lambda: QMCSampler("sobol"),
    "halton": lambda: QMCSampler("halton"),
}


# The samplers every random-feature family is registered with, besides the default ``iid`` (``<map>_<sampler>``).
SAMPLER_VARIANTS = ("orthogonal", "regularized", "sorf", "sorf_chi", "qmc")


def make_sampler(sampler) -> ProjectionSampler:
    """A sampler from its name (see :data:`SAMPLERS`) or a :class:`ProjectionSampler` instance."""
    if isinstance(sampler, ProjectionSampler):
        return sampler
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; valid values: {', '.join(('iid', *SAMPLER_VARIANTS))}")
    return SAMPLERS[sampler]()
