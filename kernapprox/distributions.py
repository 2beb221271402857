"""Query/key/value distributions: named, seeded generators of ``(q, k, v)`` for the studies.

Every distribution draws on the CPU with a numpy ``Generator`` in float64 and only then moves to the device and
casts (so one seed means one draw on every device and dtype) and returns tensors of shape
``(batch, heads, n, d)``::

    >>> from kernapprox.distributions import effective_beta, make_distribution
    >>> dist = make_distribution("clustered", num_clusters=4, beta=2.0)
    >>> q, k, v = dist.sample(256, batch=2, heads=4, rng=0)          # each (2, 4, 256, 32), float32, CPU
    >>> q.shape, q.dtype
    (torch.Size([2, 4, 256, 32]), torch.float32)
    >>> effective_beta(q, k).shape                                   # mean ‖q_i‖‖k_j‖/√d per head
    torch.Size([2, 4])

Synthetic families share one temperature parameter ``beta``: rows are scaled so that
``E‖q‖² = E‖k‖² = beta·√d``, hence ``‖q‖‖k‖/√d ≈ beta`` when norms concentrate. It is a *nominal* value; the
measured :func:`effective_beta` is what the studies report (heavy tails, clusters and anisotropy move it).
Values ``v`` have unit variance per coordinate. Families:

``isotropic``
    Gaussian ``N(0, σ² I)``.
``anisotropic``
    Gaussian with a power-law covariance spectrum ``λ_i ∝ i^(−decay)`` in a random basis.
``clustered``
    Gaussian mixture: queries and keys come from the same ``num_clusters`` centres (queries near keys).
``heavy_tailed``
    multivariate Student-t with ``dof`` degrees of freedom (heavy-tailed norms; ``dof > 2``).
``text_like``
    discrete tokens from a Zipf vocabulary; each token a fixed random embedding projected to q/k/v.
``continuous``
    a smooth Gaussian-process trajectory over time, embedded and projected; ``length_scale`` sets
    the smoothness (correlation length in tokens).

Families of stored heads live with the models they come from and register themselves here when their module is
imported (the registry imports no family above it):

``real``
    queries, keys and values of every layer and head of all-MiniLM-L6-v2 on English text
    (:class:`kernapprox.real.RealHeads`; registered by ``import kernapprox``; needs the ``real`` extra).
``trained_causal``
    queries, keys and values of a small causal Transformer trained on MQAR or in-context linear regression
    (:class:`kernapprox.models.heads.TrainedCausalHeads`; registered by ``import kernapprox.models``; trained and
    cached on first use).

Per-head projections differ; tokens (text_like) and trajectories (continuous) are shared by the heads of one
batch element, as in a real model.
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from .estimators.samplers import haar_orthogonal
from .kernel import resolve_scale
from .validation import (
    FLOAT_DTYPES,
    as_generator,
    check_choice,
    check_device,
    check_positive_float,
    check_positive_int,
    check_tensor,
)


class QKV(NamedTuple):
    """One draw: queries, keys and values, each ``(batch, heads, n, d)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _check_device(device) -> torch.device:
    return check_device(device, "device")


class Distribution:
    """Base class: a named, seeded generator of ``(q, k, v)``.

    Subclasses store validated keyword-only parameters in ``__init__`` and implement :meth:`_draw`, which
    returns float64 numpy arrays ``(batch, heads, n, d)`` drawn from the given ``Generator`` only.
    """

    name: ClassVar[str] = ""
    default_dim: ClassVar[int] = 32

    def sample(self, n: int, *, batch: int = 1, heads: int = 1, d: int | None = None, rng=None,
               device="cpu", dtype: torch.dtype = torch.float32) -> QKV:
        """Draw ``(q, k, v)``, each ``(batch, heads, n, d)`` on ``device`` in ``dtype``.

        Parameters
        ----------
        n : int
            Sequence length (queries = keys = values).
        batch, heads : int
            Independent sequences, and heads per sequence (heads of one sequence share its tokens/trajectory).
        d : int, optional
            Head dimension; defaults to :attr:`default_dim` (32, the head dimension of the real model).
        rng : int, SeedSequence or Generator
            The only source of randomness; an int seed gives the same draw on every call, device and dtype.
        device : str or torch.device
        dtype : torch floating dtype
        """
        n = check_positive_int(n, "n")
        batch = check_positive_int(batch, "batch")
        heads = check_positive_int(heads, "heads")
        d = self.default_dim if d is None else check_positive_int(d, "d")
        device = _check_device(device)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
        gen = as_generator(rng)
        arrays = self._draw(batch, heads, n, d, gen)
        return QKV(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(device=device, dtype=dtype)
                     for a in arrays))

    def _draw(self, batch: int, heads: int, n: int, d: int, rng: np.random.Generator):
        raise NotImplementedError

    def get_params(self) -> dict:
        """Constructor parameters."""
        import inspect

        sig = inspect.signature(type(self).__init__)
        return {p: getattr(self, p) for p in sig.parameters if p != "self"}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"


class _SyntheticDistribution(Distribution):
    """Shared ``beta`` handling: ``σ² = beta/√d`` per coordinate gives ``E‖q‖² = beta·√d``."""

    def __init__(self, *, beta: float = 1.0):
        self.beta = check_positive_float(beta, "beta")

    def _sigma(self, d: int) -> float:
        return math.sqrt(self.beta / math.sqrt(d))


class IsotropicGaussian(_SyntheticDistribution):
    """``q, k ~ N(0, σ² I_d)`` with ``σ² = beta/√d``; ``v ~ N(0, I_d)``.

    ``‖q‖‖k‖/√d`` concentrates at ``beta`` as ``d`` grows; the positive-feature variance grows like
    ``exp(‖x + y‖²)`` (Performer Lemma 2) and the trigonometric one like ``exp(‖x‖² + ‖y‖²)``, so ``beta`` is the
    knob that separates the estimators.
    """

    name = "isotropic"

    def _draw(self, batch, heads, n, d, rng):
        s = self._sigma(d)
        shape = (batch, heads, n, d)
        return s * rng.standard_normal(shape), s * rng.standard_normal(shape), rng.standard_normal(shape)


class AnisotropicGaussian(_SyntheticDistribution):
    """Gaussian with covariance ``σ² R diag(λ) Rᵀ``, ``λ_i ∝ i^(−decay)`` normalised to mean 1.

    ``R`` is a Haar-random rotation per head, shared by that head's queries and keys (one "projection").
    ``decay = 0`` is isotropic; large ``decay`` concentrates the energy in a few directions (low intrinsic
    dimension at equal ``E‖q‖²``).
    """

    name = "anisotropic"

    def __init__(self, *, decay: float = 1.0, beta: float = 1.0):
        super().__init__(beta=beta)
        self.decay = check_positive_float(decay, "decay", allow_zero=True)

    def _draw(self, batch, heads, n, d, rng):
        lam = np.arange(1, d + 1, dtype=np.float64) ** (-self.decay)
        lam *= d / lam.sum()
        rot = haar_orthogonal(d, rng, num_blocks=heads)                       # (heads, d, d)
        mix = np.sqrt(lam)[None, :, None] * rot * self._sigma(d)            # rows scaled, then rotated
        q = rng.standard_normal((batch, heads, n, d)) @ mix[None]
        k = rng.standard_normal((batch, heads, n, d)) @ mix[None]
        return q, k, rng.standard_normal((batch, heads, n, d))


class ClusteredGaussian(_SyntheticDistribution):
    """Gaussian mixture: centres ``μ_c ~ N(0, I_d)``, ``c = 1..num_clusters`` per head; each query and key is
    ``σ (μ_c + spread·ε) / sqrt(1 + spread²)`` with its own uniformly drawn cluster ``c``.

    Queries and keys share the centres, so every query lies near a group of keys: attention rows are peaked
    on one cluster (a low-rank but high-dynamic-range kernel matrix).
    """

    name = "clustered"

    def __init__(self, *, num_clusters: int = 8, spread: float = 0.25, beta: float = 1.0):
        super().__init__(beta=beta)
        self.num_clusters = check_positive_int(num_clusters, "num_clusters")
        self.spread = check_positive_float(spread, "spread", allow_zero=True)

    def _draw(self, batch, heads, n, d, rng):
        centres = rng.standard_normal((batch, heads, self.num_clusters, d))
        norm = self._sigma(d) / math.sqrt(1.0 + self.spread ** 2)

        def points():
            labels = rng.integers(0, self.num_clusters, size=(batch, heads, n))
            chosen = np.take_along_axis(centres, labels[..., None], axis=2)
            return norm * (chosen + self.spread * rng.standard_normal((batch, heads, n, d)))

        q = points()
        k = points()
        return q, k, rng.standard_normal((batch, heads, n, d))


class StudentT(_SyntheticDistribution):
    """Multivariate Student-t: ``x = σ z · sqrt((ν − 2)/g)``, ``z ~ N(0, I_d)``, ``g ~ χ²_ν`` per row.

    Covariance ``σ² I`` (so ``E‖x‖²`` matches the isotropic family) but the row norms are heavy-tailed: a few
    queries/keys have very large norms, which is where exponential feature maps break. Needs ``dof > 2``.
    """

    name = "heavy_tailed"

    def __init__(self, *, dof: float = 3.0, beta: float = 1.0):
        super().__init__(beta=beta)
        dof = check_positive_float(dof, "dof")
        if dof <= 2:
            raise ValueError(f"dof must be > 2 (finite covariance), got {dof}")
        self.dof = dof

    def _draw(self, batch, heads, n, d, rng):
        s = self._sigma(d)

        def rows():
            g = rng.chisquare(self.dof, size=(batch, heads, n, 1))
            return s * rng.standard_normal((batch, heads, n, d)) * np.sqrt((self.dof - 2.0) / g)

        q = rows()
        k = rows()
        return q, k, rng.standard_normal((batch, heads, n, d))


def zipf_probabilities(vocab_size: int, exponent: float) -> np.ndarray:
    """``p_r ∝ r^(−exponent)``, ``r = 1..vocab_size`` (a finite Zipf law)."""
    p = np.arange(1, vocab_size + 1, dtype=np.float64) ** (-exponent)
    return p / p.sum()


class TextLike(_SyntheticDistribution):
    """Discrete tokens: ``t_i ~ Zipf(exponent)`` over ``vocab_size`` types; ``x_i = E[t_i] ∈ R^model_dim``
    with a random embedding table ``E ~ N(0, 1)`` (fixed within a draw, shared by the batch); per head
    ``q_i = σ x_i W_q``, ``k_i = σ x_i W_k``, ``v_i = x_i W_v`` with ``W ~ N(0, 1/model_dim)``.

    A sequence has only as many distinct queries/keys as distinct tokens, so the kernel matrix has rank at most
    the number of distinct tokens, which grows with ``n`` like a Heaps law. No positional component: this is
    the purely discrete extreme.
    """

    name = "text_like"

    def __init__(self, *, vocab_size: int = 8192, zipf_exponent: float = 1.0, model_dim: int = 64,
                 beta: float = 1.0):
        super().__init__(beta=beta)
        self.vocab_size = check_positive_int(vocab_size, "vocab_size")
        self.zipf_exponent = check_positive_float(zipf_exponent, "zipf_exponent", allow_zero=True)
        self.model_dim = check_positive_int(model_dim, "model_dim")

    def _draw(self, batch, heads, n, d, rng):
        p = zipf_probabilities(self.vocab_size, self.zipf_exponent)
        tokens = rng.choice(self.vocab_size, size=(batch, n), p=p)
        table = rng.standard_normal((self.vocab_size, self.model_dim))
        x = table[tokens][:, None]                                               # (batch, 1, n, model_dim)
        w = rng.standard_normal((3, heads, self.model_dim, d)) / math.sqrt(self.model_dim)
        s = self._sigma(d)
        return s * (x @ w[0][None]), s * (x @ w[1][None]), x @ w[2][None]


class SmoothTrajectory(_SyntheticDistribution):
    """Continuous signals: a Gaussian-process trajectory ``z(t) ∈ R^latent_dim`` over ``t = 0..n−1`` with
    squared-exponential covariance ``exp(−(t − t')²/(2 ℓ²))`` per coordinate, ``ℓ = length_scale`` tokens,
    drawn as a sum of ``num_sinusoids`` random sinusoids (random Fourier features of the GP,
    ``z_c(t) = sqrt(2/J) Σ_j a_cj cos(ω_cj t + b_cj)``, ``ω ~ N(0, ℓ^-2)``, ``b ~ U[0, 2π)``, ``a ~ N(0, 1)``;
    Rahimi & Recht 2007, exact in law as ``J → ∞``), embedded ``x(t) = z(t) E`` with
    ``E ~ N(0, 1/latent_dim)`` into ``model_dim`` and projected per head like :class:`TextLike`.

    Larger ``length_scale`` = smoother signal = fewer independent directions visited per token (audio/video
    frames at a high sampling rate); ``length_scale → 0`` approaches i.i.d. Gaussian points in a
    ``latent_dim``-dimensional subspace.
    """

    name = "continuous"

    def __init__(self, *, length_scale: float = 8.0, latent_dim: int = 8, model_dim: int = 64,
                 num_sinusoids: int = 64, beta: float = 1.0):
        super().__init__(beta=beta)
        self.length_scale = check_positive_float(length_scale, "length_scale")
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.model_dim = check_positive_int(model_dim, "model_dim")
        self.num_sinusoids = check_positive_int(num_sinusoids, "num_sinusoids")

    def trajectory(self, batch: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """The latent GP paths ``z``, ``(batch, n, latent_dim)``, unit variance per coordinate."""
        shape = (batch, 1, self.latent_dim, self.num_sinusoids)
        omega = rng.standard_normal(shape) / self.length_scale
        phase = rng.uniform(0.0, 2.0 * math.pi, size=shape)
        amp = rng.standard_normal(shape)
        t = np.arange(n, dtype=np.float64)[None, :, None, None]
        return math.sqrt(2.0 / self.num_sinusoids) * (amp * np.cos(omega * t + phase)).sum(-1)

    def _draw(self, batch, heads, n, d, rng):
        z = self.trajectory(batch, n, rng)
        embed = rng.standard_normal((self.latent_dim, self.model_dim)) / math.sqrt(self.latent_dim)
        x = (z @ embed)[:, None]                                                 # (batch, 1, n, model_dim)
        w = rng.standard_normal((3, heads, self.model_dim, d)) / math.sqrt(self.model_dim)
        s = self._sigma(d)
        return s * (x @ w[0][None]), s * (x @ w[1][None]), x @ w[2][None]


def check_layer_head(layer, head, num_layers: int, num_heads: int) -> None:
    """``layer`` and ``head``: an int in range or None; a head needs its layer (for the families of stored heads)."""
    for value, name, top in ((layer, "layer", num_layers), (head, "head", num_heads)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if not 0 <= value < top:
                raise ValueError(f"{name} must be in [0, {top}), got {value}")
    if head is not None and layer is None:
        raise ValueError("head needs a layer")


_DISTRIBUTIONS: dict[str, type[Distribution]] = {}


def register_distribution(cls: type[Distribution]) -> type[Distribution]:
    """Register a :class:`Distribution` subclass under its ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Distribution)) or not cls.name:
        raise TypeError("register_distribution needs a named Distribution subclass")
    if cls.name in _DISTRIBUTIONS:
        raise ValueError(f"distribution name {cls.name!r} is already registered")
    _DISTRIBUTIONS[cls.name] = cls
    return cls


for _cls in (IsotropicGaussian, AnisotropicGaussian, ClusteredGaussian, StudentT, TextLike, SmoothTrajectory):
    register_distribution(_cls)


# Modules that register distributions of their own, loaded when a name is asked for that is not yet registered (or
# when every name is listed), so that ``import kernapprox`` loads neither them nor what they need.
PLUGINS = {"real": "kernapprox.real", "trained_causal": "kernapprox.models.heads"}


def _load_plugins(name: str | None = None) -> None:
    import importlib

    for plugin, module in PLUGINS.items():
        if plugin not in _DISTRIBUTIONS and (name is None or name == plugin):
            importlib.import_module(module)


def available_distributions() -> list[str]:
    """Sorted registered distribution names (the plug-ins of :data:`PLUGINS` loaded first)."""
    _load_plugins()
    return sorted(_DISTRIBUTIONS)


def make_distribution(name: str, **params) -> Distribution:
    """The distribution registered as ``name`` with keyword parameters ``params``.

    Unknown names raise ``ValueError`` listing the valid ones; unknown parameters raise ``TypeError``.
    """
    if name not in _DISTRIBUTIONS:
        _load_plugins(name if name in PLUGINS else None)
    check_choice(name, "distribution", sorted(_DISTRIBUTIONS))
    return _DISTRIBUTIONS[name](**params)


def effective_beta(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *,
                   statistic: str = "mean") -> torch.Tensor:
    """The effective inverse temperature ``β_ij = s·‖q_i‖‖k_j‖`` summarised over all pairs, per batch/head.

    ``statistic="mean"`` gives ``s · mean_i‖q_i‖ · mean_j‖k_j‖`` (the exact mean over all ``n_q·n_k`` pairs,
    computed in O(n)); ``"max"`` gives ``s · max‖q_i‖ · max‖k_j‖``, the bound on any logit. ``s`` defaults to
    ``1/sqrt(d)``. Returns float64 of shape ``q.shape[:-2]``.
    """
    check_tensor(q, "q")
    check_tensor(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
    check_choice(statistic, "statistic", ("mean", "max"))
    s = resolve_scale(q.shape[-1], scale)
    nq = torch.linalg.vector_norm(q.double(), dim=-1)
    nk = torch.linalg.vector_norm(k.double(), dim=-1)
    if statistic == "mean":
        return s * nq.mean(-1) * nk.mean(-1)
    return s * nq.amax(-1) * nk.amax(-1)
