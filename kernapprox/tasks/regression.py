"""In-context regression in its two forms: Nadaraya–Watson regression of a smooth function, and linear regression.

Training-free (:mod:`kernapprox.readout`)
    :func:`smooth_regression`: in-context (Nadaraya–Watson) regression of a smooth random function on the sphere
    ``S^{d−1}``: a Gaussian-process draw with squared-exponential covariance ``exp(−‖x−x'‖²/2ℓ²)`` (random-Fourier
    approximation with ``J`` components) or a single random sinusoid; ``β`` is an inverse squared bandwidth (on the
    sphere ``exp(β xᵀy) ∝ exp(−β‖x−y‖²/2)``). Scored by :func:`normalized_mse` against the noise-free function.
Trained models (:mod:`kernapprox.models`)
    :class:`LinearRegression`: in-context linear regression (Garg, Tsipras, Liang & Valiant 2022,
    ``dtsip/in-context-learning``): ``x_i ~ N(0, I_d)``, ``w ~ N(0, I_d)``, ``y_i = wᵀx_i (+ σ ε_i)``, read by a
    linear embedding, in one of two layouts: Garg et al.'s interleaved prompt ``x₁, y₁, …, x_k, y_k`` (each ``y`` in
    the first coordinate of a ``d``-vector, ``models.py::_combine``; the prediction of ``y_i`` read at token
    ``x_i``), or one token ``[x_i, y_i]`` per pair followed by query tokens ``[x_q, 0]`` (von Oswald et al. 2023;
    optionally with a query-flag coordinate, ``[x_i, y_i, 0]`` and ``[x_q, 0, 1]``). The score is the squared error
    divided by ``d`` (Garg et al.'s normalisation: the zero predictor scores ``(d + σ²)/d ≈ 1``). Least squares
    (minimum-norm below ``d`` points) and ridge, computed on the same prompts in float64, are the baselines.

>>> import numpy as np
>>> reg = LinearRegression(dim=3, num_points=5, num_queries=2)
>>> reg.sample(np.random.default_rng(0), 2).inputs.shape         # (batch, k + m, d + 1)
torch.Size([2, 7, 4])
>>> LinearRegression(dim=3, num_points=5, layout="interleaved").sample(np.random.default_rng(0), 2).inputs.shape
torch.Size([2, 10, 3])
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from ..validation import as_generator, check_choice, check_positive_float, check_positive_int, check_tensor
from ._common import _check_common, _to_torch, _unit_rows

__all__ = ["RegressionEpisodes", "REGRESSION_TARGETS", "smooth_regression", "normalized_mse", "LinearRegression",
           "RegressionBatch", "least_squares_predictions", "ridge_predictions"]


# ------------------------------------------------------------------------------------------- training-free
class RegressionEpisodes(NamedTuple):
    """``x (B, n, d)`` unit rows with noisy targets ``y (B, n, d_v)``; ``x_query (B, n_q, d)`` with the
    noise-free function values ``f_query (B, n_q, d_v)``."""

    x: torch.Tensor
    y: torch.Tensor
    x_query: torch.Tensor
    f_query: torch.Tensor


REGRESSION_TARGETS = ("gp", "sinusoid")


def smooth_regression(num_context: int, *, dim: int = 4, num_queries: int = 64, target: str = "gp",
                      lengthscale: float = 0.7, num_components: int = 256, noise_std: float = 0.1,
                      num_outputs: int = 1, batch: int = 8, rng=None, device=None,
                      dtype: torch.dtype = torch.float32) -> RegressionEpisodes:
    """Nadaraya–Watson regression episodes of a smooth random function on the unit sphere ``S^{d−1}``.

    Inputs are uniform on the sphere. Targets, one independent function per output channel:

    ``"gp"``
        ``f(x) = sqrt(2/J) Σ_j a_j cos(ω_jᵀx + b_j)`` with ``a_j ~ N(0,1)``, ``ω_j ~ N(0, ℓ⁻² I)``,
        ``b_j ~ U(0, 2π)``: a random-Fourier approximation (Rahimi & Recht 2007) of a Gaussian process with
        covariance ``exp(−‖x−x'‖²/(2ℓ²))`` and unit variance.
    ``"sinusoid"``
        ``f(x) = sqrt(2) sin(ωᵀx + b)`` with ``ω ~ N(0, ℓ⁻² I)`` — the spherical analogue of von Oswald et
        al.'s sine-wave task.

    Context targets are ``y = f(x) + noise_std · ε``; the queries carry the noise-free ``f``.
    """
    n = check_positive_int(num_context, "num_context")
    n_q = check_positive_int(num_queries, "num_queries")
    d = check_positive_int(dim, "dim")
    if d < 2:
        raise ValueError(f"dim must be >= 2 (the sphere S^(d-1)), got {d}")
    d_v = check_positive_int(num_outputs, "num_outputs")
    j = check_positive_int(num_components, "num_components")
    ell = check_positive_float(lengthscale, "lengthscale")
    sigma = check_positive_float(noise_std, "noise_std", allow_zero=True)
    check_choice(target, "target", REGRESSION_TARGETS)
    device = _check_common(batch, device, dtype)
    gen = as_generator(rng)
    x_all = _unit_rows(gen.standard_normal((batch, n + n_q, d)))
    if target == "sinusoid":
        j = 1
    omega = gen.standard_normal((batch, d_v, j, d)) / ell
    phase = gen.uniform(0.0, 2.0 * math.pi, size=(batch, d_v, j))
    amp = gen.standard_normal((batch, d_v, j)) if target == "gp" else np.ones((batch, d_v, 1))
    proj = np.einsum("bnd,bojd->bnoj", x_all, omega) + phase[:, None]       # (B, n+n_q, d_v, J)
    f_all = math.sqrt(2.0 / j) * (amp[:, None] * np.cos(proj)).sum(-1)     # (B, n+n_q, d_v)
    y = f_all[:, :n] + sigma * gen.standard_normal((batch, n, d_v))
    return RegressionEpisodes(
        x=_to_torch(x_all[:, :n], device, dtype), y=_to_torch(y, device, dtype),
        x_query=_to_torch(x_all[:, n:], device, dtype), f_query=_to_torch(f_all[:, n:], device, dtype))


def normalized_mse(predictions: torch.Tensor, episodes: RegressionEpisodes) -> torch.Tensor:
    """``Σ_q (ŷ_q − f_q)² / Σ_q (f_q − f̄)²`` per episode and output channel, averaged over channels: ``(B,)``.

    Predicting the mean of the query targets scores 1 (Garg et al. 2022 divide by the target variance in the
    same way). A non-finite prediction gives ``inf``.
    """
    check_tensor(predictions, "predictions", min_rank=3, finite=False)
    f = episodes.f_query.double()
    p = predictions.double()
    err = (p - f).pow(2).sum(-2)
    var = (f - f.mean(-2, keepdim=True)).pow(2).sum(-2)
    out = (err / var).mean(-1)
    return torch.where(torch.isfinite(p).all(-1).all(-1), out, torch.full_like(out, float("inf")))


# ------------------------------------------------------------------------------ trained: linear regression
class RegressionBatch(NamedTuple):
    """``inputs`` float32 prompt tokens; ``xs (B, P, d)``, ``ys (B, P)`` and ``w (B, d)`` in float64, every point
    of the prompt (the baselines' inputs); ``num_context``: the pairs in context (``paired`` layout; the points
    after them are the queries)."""

    inputs: torch.Tensor
    xs: torch.Tensor
    ys: torch.Tensor
    w: torch.Tensor
    num_context: int


LAYOUTS = ("paired", "interleaved")


@dataclass(frozen=True)
class LinearRegression:
    """In-context linear regression (Garg et al. 2022's task). See the module docstring.

    Parameters
    ----------
    dim : int
        ``d``.
    num_points : int
        ``k`` in-context (x, y) pairs.
    num_queries : int
        ``m`` query points after the context (layout ``"paired"``).
    min_points : int, optional
        With the ``paired`` layout, draw the number of pairs of each batch uniformly from ``min_points … k``
        (from the sampling generator), so that a model learns every context size, as Garg et al.'s models predict
        at every prefix; ``None``: always ``k``.
    noise_std : float
        ``σ`` of the label noise (Garg et al.'s default task is noiseless).
    query_flag : bool
        With the ``paired`` layout, one more token coordinate: 0 on the context pairs, 1 on the queries, so that a
        query ``[x_q, 0, 1]`` cannot be read as a context pair whose label happens to be 0.
    layout : {"paired", "interleaved"}
        ``"interleaved"`` is Garg et al.'s prompt ``x₁, y₁, …, x_k, y_k`` (``d``-vector tokens, ``y`` in the first
        coordinate), predicting every ``y_i`` at token ``x_i`` and scored at the last one (``k − 1`` pairs in
        context). ``"paired"`` writes each pair as one token ``[x_i, y_i]`` (``d + 1`` coordinates; von Oswald et
        al. 2023) followed by ``m`` query tokens ``[x_q, 0]``, scored by the mean over the queries: a single
        attention layer can then read the context as a kernel smoother, while the interleaved layout first needs
        a previous-token head to bring ``x_i`` and ``y_i`` together (the same induction plateau as MQAR; see
        :mod:`kernapprox.models.presets`).
    """

    dim: int = 5
    num_points: int = 11
    num_queries: int = 8
    min_points: int | None = None
    noise_std: float = 0.0
    layout: str = "paired"
    query_flag: bool = False
    name: ClassVar[str] = "regression"
    score_name: ClassVar[str] = "nmse"
    higher_is_better: ClassVar[bool] = False

    def __post_init__(self):
        check_positive_int(self.dim, "dim")
        check_positive_int(self.num_points, "num_points")
        check_positive_int(self.num_queries, "num_queries")
        check_positive_float(self.noise_std, "noise_std", allow_zero=True)
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}")
        if not isinstance(self.query_flag, bool):
            raise TypeError(f"query_flag must be a bool, got {type(self.query_flag).__name__}")
        if self.query_flag and self.layout != "paired":
            raise ValueError("query_flag needs the paired layout")
        if self.min_points is not None:
            check_positive_int(self.min_points, "min_points")
            if self.min_points > self.num_points or self.layout != "paired":
                raise ValueError(f"min_points must be at most num_points={self.num_points} and needs the paired "
                                 f"layout, got {self.min_points} with {self.layout!r}")

    @property
    def seq_len(self) -> int:
        """Tokens of the longest prompt."""
        k = self.num_points
        return k + self.num_queries if self.layout == "paired" else 2 * k

    @property
    def model_io(self) -> dict:
        """A linear read-in of the tokens, one output (the prediction of ``y``)."""
        width = self.dim + 1 + int(self.query_flag) if self.layout == "paired" else self.dim
        return {"vocab_size": None, "input_dim": width, "output_dim": 1}

    @property
    def difficulty(self) -> int:
        """What a curriculum varies: the (largest) number of in-context points."""
        return self.num_points

    def with_difficulty(self, num_points: int) -> LinearRegression:
        """The same task with at most ``num_points`` pairs per prompt (curriculum stages)."""
        low = None if self.min_points is None else min(self.min_points, num_points)
        return dataclasses.replace(self, num_points=num_points, min_points=low)

    def fixed(self, num_points: int) -> LinearRegression:
        """The task with exactly ``num_points`` pairs (evaluation at one context size)."""
        return dataclasses.replace(self, num_points=num_points, min_points=None)

    def evaluation(self) -> LinearRegression:
        """The held-out task of a training curve: exactly ``k`` pairs."""
        return self.fixed(self.num_points)

    def to_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}

    def sample(self, gen: np.random.Generator, batch: int, device=None) -> RegressionBatch:
        """``batch`` prompts drawn from ``gen``."""
        check_positive_int(batch, "batch")
        d, k = self.dim, self.num_points
        if self.min_points is not None:
            k = int(gen.integers(self.min_points, self.num_points + 1))
        points = k + self.num_queries if self.layout == "paired" else k
        xs = gen.standard_normal((batch, points, d))
        w = gen.standard_normal((batch, d))
        ys = np.einsum("bkd,bd->bk", xs, w)
        if self.noise_std > 0:
            ys = ys + self.noise_std * gen.standard_normal((batch, points))
        if self.layout == "paired":
            tokens = np.concatenate([xs, np.zeros((batch, points, 1 + int(self.query_flag)))], axis=-1)
            tokens[:, :k, d] = ys[:, :k]
            if self.query_flag:
                tokens[:, k:, d + 1] = 1.0
        else:
            tokens = np.zeros((batch, 2 * k, d))
            tokens[:, 0::2] = xs
            tokens[:, 1::2, 0] = ys

        def as_t(a, dtype):
            return torch.as_tensor(a, device=device).to(dtype)

        return RegressionBatch(as_t(tokens, torch.float32), as_t(xs, torch.float64), as_t(ys, torch.float64),
                               as_t(w, torch.float64), k)

    # ------------------------------------------------------------------------------------------- scoring
    def predictions(self, outputs: torch.Tensor, batch: RegressionBatch) -> torch.Tensor:
        """The model's predictions: at the query tokens ``(B, m)`` (paired) or the ``x`` tokens ``(B, k)``."""
        if self.layout == "paired":
            return outputs[:, batch.num_context:, 0]
        return outputs[:, 0::2, 0]

    def targets(self, batch: RegressionBatch) -> torch.Tensor:
        """The labels the predictions are compared with."""
        return batch.ys[:, batch.num_context:] if self.layout == "paired" else batch.ys

    def position_errors(self, outputs: torch.Tensor, batch: RegressionBatch) -> torch.Tensor:
        """Squared error divided by ``d`` of every prediction, float64 (``inf`` where it is not finite)."""
        pred = self.predictions(outputs, batch).double()
        err = (pred - self.targets(batch)).pow(2) / self.dim
        return torch.where(torch.isfinite(pred), err, torch.full_like(err, float("inf")))

    def loss(self, outputs: torch.Tensor, batch: RegressionBatch) -> torch.Tensor:
        """Mean squared error of all predictions (Garg et al.'s training loss)."""
        return (self.predictions(outputs, batch).float() - self.targets(batch).float()).pow(2).mean()

    def _reduce(self, errors: torch.Tensor) -> torch.Tensor:
        return errors.mean(-1) if self.layout == "paired" else errors[:, -1]

    def score(self, outputs: torch.Tensor, batch: RegressionBatch) -> torch.Tensor:
        """Normalised squared error per prompt, ``(B,)`` float64: the mean over the queries (paired) or the last
        prediction, with ``k − 1`` pairs in context (interleaved)."""
        return self._reduce(self.position_errors(outputs, batch))

    def baseline_score(self, batch: RegressionBatch, method: str = "least_squares", alpha: float = 0.0
                       ) -> torch.Tensor:
        """The score of a baseline on the same prompts, ``(B,)`` float64: ``"least_squares"`` (minimum norm
        below ``d`` points) or ``"ridge"`` with regulariser ``alpha``, fitted on the pairs each prediction may
        see."""
        if method not in ("least_squares", "ridge"):
            raise ValueError(f"unknown method {method!r}; valid: least_squares, ridge")
        if self.layout == "paired":
            k = batch.num_context
            w = _fit(batch.xs[:, :k], batch.ys[:, :k], method, alpha)               # (B, d, 1)
            pred = (batch.xs[:, k:] @ w)[..., 0]
        else:
            pred = (least_squares_predictions(batch.xs, batch.ys) if method == "least_squares"
                    else ridge_predictions(batch.xs, batch.ys, alpha))
        return self._reduce((pred - self.targets(batch)).pow(2) / self.dim)


def _check_regression(xs, ys):
    if not (isinstance(xs, torch.Tensor) and isinstance(ys, torch.Tensor)):
        raise TypeError("xs and ys must be torch tensors")
    if xs.dim() != 3 or ys.shape != xs.shape[:2]:
        raise ValueError(f"xs must be (B, k, d) and ys (B, k), got {tuple(xs.shape)} and {tuple(ys.shape)}")


def _fit(x: torch.Tensor, y: torch.Tensor, method: str, alpha: float) -> torch.Tensor:
    """``ŵ (B, d, 1)`` from ``x (B, i, d)``, ``y (B, i)`` in float64: ``X⁺y`` or ``(XᵀX + αI)⁻¹Xᵀy``."""
    x, y = x.double(), y.double()[..., None]
    if method == "least_squares":
        return torch.linalg.pinv(x) @ y
    alpha = check_positive_float(alpha, "alpha")
    eye = torch.eye(x.shape[-1], dtype=torch.float64, device=x.device)
    return torch.linalg.solve(x.transpose(1, 2) @ x + alpha * eye, x.transpose(1, 2) @ y)


def least_squares_predictions(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Prediction of ``y_i`` from the pairs before it by least squares, ``(B, k)`` float64.

    ``ŷ_i = x_iᵀ ŵ_i``, ``ŵ_i = X_{<i}^+ y_{<i}`` (the minimum-norm solution when ``i < d``; ``ŷ_0 = 0``).
    Noiseless prompts give ``ŷ_i = y_i`` (to rounding) as soon as ``i ≥ d``.
    """
    _check_regression(xs, ys)
    out = torch.zeros_like(ys, dtype=torch.float64)
    for i in range(1, xs.shape[1]):
        out[:, i] = (xs[:, i:i + 1].double() @ _fit(xs[:, :i], ys[:, :i], "least_squares", 0.0))[:, 0, 0]
    return out


def ridge_predictions(xs: torch.Tensor, ys: torch.Tensor, alpha: float) -> torch.Tensor:
    """Prediction of ``y_i`` from the pairs before it by ridge regression, ``(B, k)`` float64:
    ``ŵ_i = (X_{<i}ᵀX_{<i} + α I)^{-1} X_{<i}ᵀ y_{<i}`` (the posterior mean under ``w ~ N(0, I)`` and noise
    variance ``α``); ``ŷ_0 = 0``."""
    _check_regression(xs, ys)
    check_positive_float(alpha, "alpha")
    out = torch.zeros_like(ys, dtype=torch.float64)
    for i in range(1, xs.shape[1]):
        out[:, i] = (xs[:, i:i + 1].double() @ _fit(xs[:, :i], ys[:, :i], "ridge", alpha))[:, 0, 0]
    return out
