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
``sorf``                  rows of ``sqrt(p) H D1 H D2 H D3`` (``p`` = next       approximately Gaussian: small bias
                          power of two ≥ d), first ``d`` columns                 that vanishes as d grows
``qmc``                   scrambled Sobol points mapped through the Gaussian     each point marginally ``N(0, I_d)``
                          inverse CDF                                            (scrambling): unbiased
========================  =====================================================  ===================================

References
----------
Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021 (arXiv 2009.14794), §2.4, Thm 1-2, App. B.2.
Mezzadri, *How to generate random matrices from the classical compact groups*, Notices AMS 2007 (sign fix).
Yu et al., *Orthogonal Random Features*, NeurIPS 2016 (SORF).
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
    """SORF: blocks ``sqrt(p) · H D1 H D2 H D3`` with ``H`` the normalised Walsh–Hadamard matrix of size
    ``p = 2^ceil(log2 d)`` and ``D_i`` Rademacher diagonals; the first ``d`` columns act on ``x`` (zero padding).

    Every entry has variance 1, so rows have ``E‖ω‖² = d``, but they are not exactly Gaussian: the estimator is
    only approximately unbiased (bias → 0 as d grows; Yu et al. 2016). The matrix is materialised here: we
    measure its statistical quality, not the ``O(d log d)`` fast transform.
    """

    name = "sorf"
    unbiased = False

    def sample(self, num, dim, rng):
        p = 1 << max(0, (dim - 1).bit_length())
        h = hadamard(p).astype(np.float64) / math.sqrt(p)
        blocks = []
        for _ in range(math.ceil(num / p)):
            block = np.eye(p)
            for _ in range(3):
                d_diag = rng.choice([-1.0, 1.0], size=p)
                block = h @ (d_diag[:, None] * block)
            blocks.append(math.sqrt(p) * block)
        return np.concatenate(blocks, axis=0)[:num, :dim]


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
    "qmc": lambda: QMCSampler("sobol"),
    "halton": lambda: QMCSampler("halton"),
}


# The samplers every random-feature family is registered with, besides the default ``iid`` (``<map>_<sampler>``).
SAMPLER_VARIANTS = ("orthogonal", "regularized", "sorf", "qmc")


def make_sampler(sampler) -> ProjectionSampler:
    """A sampler from its name (see :data:`SAMPLERS`) or a :class:`ProjectionSampler` instance."""
    if isinstance(sampler, ProjectionSampler):
        return sampler
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; valid values: {', '.join(SAMPLERS)}")
    return SAMPLERS[sampler]()
