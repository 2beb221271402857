"""The two in-context-learning tasks trained models are measured on, as the field defines them.

:class:`MQAR`
    Multi-query associative recall (Arora et al. 2023, *Zoology*, ``zoology/data/multiquery_ar.py``): token
    sequences over a vocabulary of ``V`` tokens whose lower half ``[1, V/2)`` holds the keys and upper half
    ``[V/2, V)`` the values (token 0 is the filler). A sequence is ``k₁ v₁ k₂ v₂ … k_N v_N`` (distinct keys, distinct
    values) followed by a query region of ``L − 2N`` tokens in which every key appears once, at an even offset
    ``2g`` with gaps ``g`` drawn without replacement from ``{0, …, S−1}``, ``S = (L − 2N)/2``, with probability
    ``∝ (g+1)^(a−1)`` (``a = power_a = 0.01``: queries crowd towards the context). Other query-region slots hold 0
    (or a uniform random token with ``random_non_queries``). The label at a query position is the value stored
    with that key (the model must emit it at the query token); every other position is ignored. Accuracy is the
    fraction of query positions whose argmax logit is the label, per sequence.
:class:`LinearRegression`
    In-context linear regression (Garg, Tsipras, Liang & Valiant 2022, ``dtsip/in-context-learning``):
    ``x_i ~ N(0, I_d)``, ``w ~ N(0, I_d)``, ``y_i = wᵀx_i (+ σ ε_i)``, read by a linear embedding, in one of two
    layouts: Garg et al.'s interleaved prompt ``x₁, y₁, …, x_k, y_k`` (each ``y`` in the first coordinate of a
    ``d``-vector, ``models.py::_combine``; the prediction of ``y_i`` read at token ``x_i``), or one token
    ``[x_i, y_i]`` per pair followed by query tokens ``[x_q, 0]`` (von Oswald et al. 2023; optionally with a
    query-flag coordinate, ``[x_i, y_i, 0]`` and ``[x_q, 0, 1]``). The score is the
    squared error divided by ``d`` (Garg et al.'s normalisation: the zero predictor scores ``(d + σ²)/d ≈ 1``).
    Least squares (minimum-norm below ``d`` points) and ridge, computed on the same prompts in float64, are the
    baselines.

Both tasks draw from a numpy ``Generator`` only (float64, then cast), so a seed is one data stream everywhere.

>>> import numpy as np
>>> task = MQAR(vocab_size=32, seq_len=24, num_pairs=4)
>>> batch = task.sample(np.random.default_rng(0), 2)
>>> batch.inputs.shape, int((batch.labels >= 0).sum())          # 2 sequences × 4 queried keys
(torch.Size([2, 24]), 8)
>>> reg = LinearRegression(dim=3, num_points=5, num_queries=2)
>>> reg.sample(np.random.default_rng(0), 2).inputs.shape         # (batch, k + m, d + 1)
torch.Size([2, 7, 4])
>>> LinearRegression(dim=3, num_points=5, layout="interleaved").sample(np.random.default_rng(0), 2).inputs.shape
torch.Size([2, 10, 3])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from ..validation import check_bool, check_positive_float, check_positive_int

__all__ = ["MQAR", "MQARBatch", "LinearRegression", "RegressionBatch", "least_squares_predictions",
           "ridge_predictions", "make_task", "TASKS", "IGNORE"]

IGNORE = -100  # label of positions that are not scored (torch's cross-entropy default ignore_index)


# ------------------------------------------------------------------------------------------------------ MQAR
class MQARBatch(NamedTuple):
    """``inputs (B, L)`` token ids; ``labels (B, L)`` the value at each query position, ``IGNORE`` elsewhere;
    ``keys``, ``values`` and ``query_positions`` ``(B, N)`` (pair ``j``'s key, value and where it is queried)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor


def _top_k_without_replacement(gen: np.random.Generator, weights: np.ndarray, rows: int, k: int) -> np.ndarray:
    """``(rows, k)`` indices drawn without replacement with probabilities ``∝ weights``, in draw order.

    Efraimidis & Spirakis (2006): the ``k`` largest keys ``log(u_i)/w_i``, ``u_i ~ U(0, 1)``, in decreasing order
    have the law of ``k`` successive weighted draws without replacement (``numpy.random.choice(p=…,
    replace=False)``'s law), here for all rows at once.
    """
    u = gen.random((rows, weights.shape[0]))
    keys = np.log(u) / weights                                   # log(0) = -inf is never drawn first
    return np.argsort(-keys, axis=1, kind="stable")[:, :k]


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall (Zoology). See the module docstring for the sequence layout.

    Parameters
    ----------
    vocab_size : int
        ``V`` (even): keys are tokens ``1 … V/2 − 1``, values ``V/2 … V − 1``, token 0 the filler.
    seq_len : int
        ``L`` (even), at least ``4N`` (Zoology's constraint ``2N + 2N ≤ L``: context plus a query region that
        fits every key).
    num_pairs : int
        ``N`` key–value pairs per sequence, all queried.
    power_a : float
        ``a`` of the gap law ``p(g) ∝ (g+1)^(a−1)`` (Zoology's default 0.01).
    random_non_queries : bool
        Fill the query region's other slots with uniform random tokens instead of 0 (Zoology's paper figures
        use 0).
    """

    vocab_size: int = 64
    seq_len: int = 64
    num_pairs: int = 8
    power_a: float = 0.01
    random_non_queries: bool = False
    name: ClassVar[str] = "mqar"

    def __post_init__(self):
        v = check_positive_int(self.vocab_size, "vocab_size")
        n = check_positive_int(self.seq_len, "seq_len")
        pairs = check_positive_int(self.num_pairs, "num_pairs")
        check_positive_float(self.power_a, "power_a")
        check_bool(self.random_non_queries, "random_non_queries")
        if v % 2 or n % 2:
            raise ValueError(f"vocab_size and seq_len must be even, got {v} and {n}")
        if pairs > v // 2 - 1:
            raise ValueError(f"num_pairs must be at most vocab_size/2 - 1 = {v // 2 - 1} (distinct keys), got {pairs}")
        if 4 * pairs > n:
            raise ValueError(f"seq_len must be at least 4·num_pairs = {4 * pairs} (context and queries), got {n}")

    # ---------------------------------------------------------------------------------- what a model needs
    @property
    def model_io(self) -> dict:
        """What the model reads and writes: tokens of a ``V``-vocabulary in, ``V`` logits out."""
        return {"vocab_size": self.vocab_size, "input_dim": None, "output_dim": self.vocab_size}

    @property
    def difficulty(self) -> int:
        """What a curriculum varies: the number of pairs."""
        return self.num_pairs

    def with_difficulty(self, num_pairs: int) -> MQAR:
        """The same task with ``num_pairs`` pairs (curriculum stages)."""
        return dataclasses.replace(self, num_pairs=num_pairs)

    def evaluation(self) -> MQAR:
        """The held-out task of a training curve: this one."""
        return self

    def to_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}

    # --------------------------------------------------------------------------------------------- data
    def sample(self, gen: np.random.Generator, batch: int, device=None) -> MQARBatch:
        """``batch`` sequences drawn from ``gen``."""
        check_positive_int(batch, "batch")
        half, n, pairs = self.vocab_size // 2, self.seq_len, self.num_pairs
        keys = _top_k_without_replacement(gen, np.ones(half - 1), batch, pairs) + 1              # in [1, V/2)
        values = _top_k_without_replacement(gen, np.ones(half), batch, pairs) + half            # in [V/2, V)
        slots = (n - 2 * pairs) // 2
        gaps = _top_k_without_replacement(gen, np.arange(1, slots + 1, dtype=np.float64) ** (self.power_a - 1.0),
                                          batch, pairs)                                         # key j -> gap
        query_positions = 2 * pairs + 2 * gaps
        if self.random_non_queries:
            inputs = gen.integers(0, self.vocab_size, size=(batch, n))
        else:
            inputs = np.zeros((batch, n), dtype=np.int64)
        inputs[:, 0:2 * pairs:2] = keys
        inputs[:, 1:2 * pairs:2] = values
        rows = np.arange(batch)[:, None]
        inputs[rows, query_positions] = keys
        labels = np.full((batch, n), IGNORE, dtype=np.int64)
        labels[rows, query_positions] = values
        def as_t(a):
            return torch.as_tensor(a, dtype=torch.int64, device=device)

        return MQARBatch(as_t(inputs), as_t(labels), as_t(keys), as_t(values), as_t(query_positions))

    # ------------------------------------------------------------------------------------------- scoring
    def loss(self, outputs: torch.Tensor, batch: MQARBatch) -> torch.Tensor:
        """Cross-entropy of the logits ``(B, L, V)`` at the query positions only."""
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), batch.labels.reshape(-1),
                               ignore_index=IGNORE)

    def score(self, outputs: torch.Tensor, batch: MQARBatch) -> torch.Tensor:
        """Accuracy per sequence: the fraction of its query positions whose argmax logit is the label,
        ``(B,)`` float64. A position with a non-finite logit counts as wrong."""
        mask = batch.labels != IGNORE
        finite = torch.isfinite(outputs).all(-1)
        correct = (outputs.argmax(-1) == batch.labels) & finite & mask
        return correct.sum(-1).double() / mask.sum(-1).double()

    score_name: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True


# -------------------------------------------------------------------------------------- linear regression
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


TASKS = {cls.name: cls for cls in (MQAR, LinearRegression)}


def make_task(name: str, **params):
    """The task ``name`` (``"mqar"`` or ``"regression"``) with parameters ``params``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name](**params)
