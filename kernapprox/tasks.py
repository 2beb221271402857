"""Training-free in-context learning tasks: attention as a fixed kernel smoother, nothing learned.

Every task is a seeded episode generator plus a scorer. An episode is a context of ``n`` (key, value) pairs and
a set of queries; the prediction is the attention read-out

.. math::
    ŷ(q) = \\frac{Σ_i κ(q, k_i)\\, v_i}{Σ_i κ(q, k_i)},\\qquad κ(q, k) = \\exp(β\\, qᵀk),

with unit-norm queries and keys, so that the inverse temperature ``β`` is exactly the attention ``scale``
argument (``softmax_attention(q, k, v, scale=β)``; estimators are built with ``scale=β``). Exact attention is the
ceiling; an estimator replaces ``κ`` by ``φ(q)ᵀφ(k)`` and the KV cache by the state ``W = Σ v_i φ(k_i)ᵀ``,
``z = Σ φ(k_i)``. Nadaraya–Watson view: Han et al. 2023, *Explaining Emergent In-Context Learning as Kernel
Regression*.

Tasks
-----
:func:`associative_recall`
    Continuous multi-query associative recall (MQAR; Arora et al. 2023, *Zoology*, continuous variant
    ``zoology/data/stacked_mqar.py``): keys and values are random unit vectors (or rows of a given embedding
    table), every stored key is queried once (optionally perturbed to cosine ``ρ``), and the read-out is decoded
    to the nearest row of a candidate table of values (``num_candidates`` rows, 4096 = V/2 as in Zoology; the
    stored values are a random subset of it). Retrieval needs ``β ≳ ln n`` (target mass
    ``e^β / (e^β + (n−1) e^{β²/2d}) ≥ ½``).
:func:`paraphrase_recall`
    The same with discrete keys: each key is a phrase of token embeddings from a shared vocabulary and each query
    the phrase with some tokens replaced (a paraphrase-like perturbation, towards other keys' tokens).
:func:`smooth_regression`
    In-context (Nadaraya–Watson) regression of a smooth random function on the sphere ``S^{d−1}``: a Gaussian-
    process draw with squared-exponential covariance ``exp(−‖x−x'‖²/2ℓ²)`` (random-Fourier approximation with
    ``J`` components) or a single random sinusoid; ``β`` is an inverse squared bandwidth (on the sphere
    ``exp(β xᵀy) ∝ exp(−β‖x−y‖²/2)``). Scored by normalised MSE against the noise-free function.
:func:`digits_classification`
    Few-shot classification of scikit-learn's bundled ``load_digits`` (1797 8×8 images, 10 classes; on disk,
    no network): pixels standardised, rows L2-normalised; prediction = argmax of the attention-weighted one-hot
    labels (``β → ∞`` gives 1-NN, :func:`nearest_neighbour_predictions`).

The read-out of an episode by exact attention or an estimator (fitting, modes, memory accounting) is
:mod:`kernapprox.readout`; this module only makes episodes and scores predictions.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from .validation import as_generator, check_choice, check_positive_float, check_positive_int, check_tensor

__all__ = [
    "RecallEpisodes", "RegressionEpisodes", "ClassificationEpisodes",
    "associative_recall", "paraphrase_recall", "decode_nearest", "recall_accuracy",
    "smooth_regression", "normalized_mse",
    "digits_features", "digits_classification", "classification_accuracy", "nearest_neighbour_predictions",
    "log_n_beta",
]


# ------------------------------------------------------------------------------------------------ helpers
def _unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _to_torch(a: np.ndarray, device, dtype) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _check_common(batch, device, dtype):
    check_positive_int(batch, "batch")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    return torch.device("cpu") if device is None else torch.device(device)


def log_n_beta(num_pairs: int, factor: float = 1.0) -> float:
    """``β = factor · ln n``: the inverse temperature at which exact attention puts about half its mass on the
    matching key among ``n`` random unit keys (``factor = 1``; Scalable-Softmax / Chiang & Cholak scaling)."""
    check_positive_int(num_pairs, "num_pairs")
    check_positive_float(factor, "factor")
    return factor * math.log(max(num_pairs, 2))


# ----------------------------------------------------------------------------------- associative recall
class RecallEpisodes(NamedTuple):
    """A batch of associative-recall episodes (all tensors on one device and dtype).

    ``keys (B, n, d)``, ``values (B, n, d_v)`` and ``queries (B, n_q, d)`` are unit rows; ``candidates
    (B, C, d_v)`` is the decoding table (unit rows; the stored values are ``C``-table rows); ``targets (B, n_q)``
    indexes the correct candidate of each query and ``query_slots (B, n_q)`` the stored pair it asks for.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    candidates: torch.Tensor
    targets: torch.Tensor
    query_slots: torch.Tensor


def associative_recall(num_pairs: int, *, dim: int = 64, value_dim: int | None = None,
                       num_candidates: int = 4096, num_queries: int | None = None, query_cosine: float = 1.0,
                       batch: int = 8, rng=None, device=None, dtype: torch.dtype = torch.float32,
                       key_table: np.ndarray | None = None, value_table: np.ndarray | None = None
                       ) -> RecallEpisodes:
    """Continuous MQAR episodes: store ``n`` (key, value) pairs, query stored keys, decode by nearest value.

    Parameters
    ----------
    num_pairs : int
        ``n``, the number of stored pairs (the context length).
    dim, value_dim : int
        Key dimension ``d`` and value dimension ``d_v`` (default ``d``). Ignored when tables are given.
    num_candidates : int
        ``C``, rows of the value table the read-out is decoded against (``C ≥ n``; Zoology decodes over all
        ``V/2 = 4096`` value embeddings). With random vectors a fresh table is drawn per episode.
    num_queries : int, optional
        Queries per episode (default ``n``: every stored key once, in random order, as in MQAR). If smaller
        than ``n``, a random subset of distinct keys is queried.
    query_cosine : float in (0, 1]
        ``ρ``: each query is ``ρ k_j + sqrt(1−ρ²) u`` with ``u`` a random unit vector orthogonal to ``k_j``
        (``ρ = 1``: queries are the stored keys).
    batch : int
        Number of independent episodes ``B``.
    rng : int, SeedSequence or Generator
    key_table, value_table : ndarray ``(V_k, d)``, ``(V_v, d_v)``, optional
        Real embedding tables (e.g. halves of a word-embedding matrix). Keys are drawn from ``key_table``
        without replacement, values from ``value_table`` without replacement, and all of ``value_table`` is the
        candidate table (``num_candidates`` is then ignored). Rows are L2-normalised.

    Returns
    -------
    RecallEpisodes
    """
    n = check_positive_int(num_pairs, "num_pairs")
    device = _check_common(batch, device, dtype)
    n_q = n if num_queries is None else check_positive_int(num_queries, "num_queries")
    if n_q > n:
        raise ValueError(f"num_queries must be <= num_pairs (each query asks for a distinct key), got {n_q} > {n}")
    rho = check_positive_float(query_cosine, "query_cosine")
    if rho > 1.0:
        raise ValueError(f"query_cosine must be in (0, 1], got {query_cosine}")
    if (key_table is None) != (value_table is None):
        raise ValueError("key_table and value_table must be given together")
    gen = as_generator(rng)
    if key_table is not None:
        key_table = _unit_rows(np.asarray(key_table, dtype=np.float64))
        value_table = _unit_rows(np.asarray(value_table, dtype=np.float64))
        if key_table.ndim != 2 or value_table.ndim != 2:
            raise ValueError("key_table and value_table must be 2-D arrays (rows are embeddings)")
        if key_table.shape[0] < n or value_table.shape[0] < n:
            raise ValueError(f"the tables need at least num_pairs={n} rows, got {key_table.shape[0]} keys and "
                             f"{value_table.shape[0]} values")
        d, d_v, c = key_table.shape[1], value_table.shape[1], value_table.shape[0]
    else:
        d = check_positive_int(dim, "dim")
        d_v = d if value_dim is None else check_positive_int(value_dim, "value_dim")
        c = check_positive_int(num_candidates, "num_candidates")
        if c < n:
            raise ValueError(f"num_candidates must be >= num_pairs, got {c} < {n}")
    keys = np.empty((batch, n, d))
    cands = np.empty((batch, c, d_v))
    value_rows = np.empty((batch, n), dtype=np.int64)
    for b in range(batch):
        if key_table is not None:
            keys[b] = key_table[gen.choice(key_table.shape[0], size=n, replace=False)]
            cands[b] = value_table
        else:
            keys[b] = _unit_rows(gen.standard_normal((n, d)))
            cands[b] = _unit_rows(gen.standard_normal((c, d_v)))
        value_rows[b] = gen.choice(c, size=n, replace=False)
    values = np.take_along_axis(cands, value_rows[..., None], axis=1)
    slots = np.stack([gen.permutation(n)[:n_q] for _ in range(batch)])        # (B, n_q)
    queries = np.take_along_axis(keys, slots[..., None], axis=1)
    if rho < 1.0:
        u = gen.standard_normal(queries.shape)
        u -= (u * queries).sum(-1, keepdims=True) * queries                  # orthogonal to the key
        queries = rho * queries + math.sqrt(1.0 - rho * rho) * _unit_rows(u)
    targets = np.take_along_axis(value_rows, slots, axis=1)
    return RecallEpisodes(
        keys=_to_torch(keys, device, dtype), values=_to_torch(values, device, dtype),
        queries=_to_torch(queries, device, dtype), candidates=_to_torch(cands, device, dtype),
        targets=torch.as_tensor(targets, device=device), query_slots=torch.as_tensor(slots, device=device))


def paraphrase_recall(num_pairs: int, *, phrase_length: int = 8, substitutions: int = 1, vocab_size: int = 1024,
                      dim: int = 64, value_dim: int | None = None, num_candidates: int = 4096,
                      num_queries: int | None = None, batch: int = 8, rng=None, device=None,
                      dtype: torch.dtype = torch.float32) -> RecallEpisodes:
    """Recall with discrete keys queried by paraphrases: each key is a phrase of tokens, each query the phrase
    with some tokens replaced.

    A vocabulary of ``vocab_size`` random unit token embeddings (``d = dim``) is drawn per episode; key ``j`` is
    the normalised sum of ``phrase_length`` distinct tokens (keys share tokens when ``n · phrase_length`` is not
    small against the vocabulary, as text does), and the query for key ``j`` is the normalised sum of the same
    phrase with ``substitutions`` of its tokens replaced by tokens outside it. A query's cosine to its key is
    about ``1 − substitutions/phrase_length`` (7/8 by default), but it moves towards other keys' tokens rather
    than in a random direction. Values, candidates and scoring are those of :func:`associative_recall`.
    """
    n = check_positive_int(num_pairs, "num_pairs")
    device = _check_common(batch, device, dtype)
    length = check_positive_int(phrase_length, "phrase_length")
    if isinstance(substitutions, bool) or not isinstance(substitutions, int) or not 0 <= substitutions <= length:
        raise ValueError(f"substitutions must be an integer in [0, phrase_length], got {substitutions!r}")
    vocab = check_positive_int(vocab_size, "vocab_size")
    if vocab < length + substitutions:
        raise ValueError(f"vocab_size must be at least phrase_length + substitutions, got {vocab}")
    d = check_positive_int(dim, "dim")
    d_v = d if value_dim is None else check_positive_int(value_dim, "value_dim")
    c = check_positive_int(num_candidates, "num_candidates")
    if c < n:
        raise ValueError(f"num_candidates must be >= num_pairs, got {c} < {n}")
    n_q = n if num_queries is None else check_positive_int(num_queries, "num_queries")
    if n_q > n:
        raise ValueError(f"num_queries must be <= num_pairs (each query asks for a distinct key), got {n_q} > {n}")
    gen = as_generator(rng)
    keys, queries = np.empty((batch, n, d)), np.empty((batch, n_q, d))
    cands, value_rows = np.empty((batch, c, d_v)), np.empty((batch, n), dtype=np.int64)
    slots = np.empty((batch, n_q), dtype=np.int64)
    rows = np.arange(n_q)[:, None]
    for b in range(batch):
        table = _unit_rows(gen.standard_normal((vocab, d)))
        phrases = np.argsort(gen.random((n, vocab)), axis=1)[:, :length]              # (n, T) distinct tokens
        keys[b] = _unit_rows(table[phrases].sum(1))
        cands[b] = _unit_rows(gen.standard_normal((c, d_v)))
        value_rows[b] = gen.choice(c, size=n, replace=False)
        slots[b] = gen.permutation(n)[:n_q]
        asked = phrases[slots[b]].copy()                                             # (n_q, T)
        where = np.argsort(gen.random((n_q, length)), axis=1)[:, :substitutions]     # distinct positions
        new = gen.integers(0, vocab, size=(n_q, substitutions))
        while True:       # redraw replacements that are in the phrase already or repeat another replacement
            clash = (new[:, :, None] == asked[:, None, :]).any(-1)
            clash |= (new[:, :, None] == new[:, None, :]).sum(-1) > 1
            if not clash.any():
                break
            new = np.where(clash, gen.integers(0, vocab, size=new.shape), new)
        asked[rows, where] = new
        queries[b] = _unit_rows(table[asked].sum(1))
    values = np.take_along_axis(cands, value_rows[..., None], axis=1)
    targets = np.take_along_axis(value_rows, slots, axis=1)
    return RecallEpisodes(
        keys=_to_torch(keys, device, dtype), values=_to_torch(values, device, dtype),
        queries=_to_torch(queries, device, dtype), candidates=_to_torch(cands, device, dtype),
        targets=torch.as_tensor(targets, device=device), query_slots=torch.as_tensor(slots, device=device))


def decode_nearest(outputs: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Index of the candidate with the largest inner product with each read-out (= nearest in Euclidean
    distance for unit-norm candidates); ``-1`` where the read-out has a non-finite entry.

    ``outputs (B, n_q, d_v)``, ``candidates (B, C, d_v)`` → ``(B, n_q)`` int64.
    """
    check_tensor(outputs, "outputs", min_rank=3, finite=False)
    check_tensor(candidates, "candidates", min_rank=3)
    finite = torch.isfinite(outputs).all(-1)
    scores = torch.nan_to_num(outputs, nan=0.0, posinf=0.0, neginf=0.0).to(candidates.dtype) @ \
        candidates.transpose(-1, -2)
    return torch.where(finite, scores.argmax(-1), torch.full_like(finite, -1, dtype=torch.int64))


def recall_accuracy(outputs: torch.Tensor, episodes: RecallEpisodes) -> torch.Tensor:
    """Fraction of queries decoded to their own value, per episode: ``(B,)`` float64."""
    pred = decode_nearest(outputs, episodes.candidates)
    return (pred == episodes.targets).double().mean(-1)


# ------------------------------------------------------------------------------------------- regression
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


# --------------------------------------------------------------------------------------- classification
class ClassificationEpisodes(NamedTuple):
    """``x (B, n, 64)`` unit rows, ``labels (B, n)``, ``onehot (B, n, C)``; queries ``x_query (B, n_q, 64)``
    with ``labels_query (B, n_q)``."""

    x: torch.Tensor
    labels: torch.Tensor
    onehot: torch.Tensor
    x_query: torch.Tensor
    labels_query: torch.Tensor


@functools.lru_cache(maxsize=1)
def digits_features() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 × 64, 10 classes), standardised and L2-normalised.

    Each pixel is z-scored over the whole data set (pixels that are constant — the image border — have zero
    standard deviation and are left at 0; no labels are used), then each image is scaled to unit norm, so that
    ``β`` is the attention scale. Returns read-only ``(X float64 (1797, 64), y int64 (1797,))``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    mean, std = x.mean(0), x.std(0)
    x = (x - mean) / np.where(std > 0, std, 1.0)
    x = _unit_rows(x)
    y = np.asarray(data.target, dtype=np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def digits_classification(num_context: int, *, num_queries: int = 32, batch: int = 8, rng=None, device=None,
                          dtype: torch.dtype = torch.float32) -> ClassificationEpisodes:
    """Few-shot episodes on digits: ``n + n_q`` distinct images drawn uniformly without replacement per episode
    (classes are not balanced), the first ``n`` labelled in context, the rest queried."""
    n = check_positive_int(num_context, "num_context")
    n_q = check_positive_int(num_queries, "num_queries")
    device = _check_common(batch, device, dtype)
    x_all, y_all = digits_features()
    if n + n_q > x_all.shape[0]:
        raise ValueError(f"num_context + num_queries must be <= {x_all.shape[0]} images, got {n + n_q}")
    gen = as_generator(rng)
    idx = np.stack([gen.choice(x_all.shape[0], size=n + n_q, replace=False) for _ in range(batch)])
    x, y = x_all[idx], y_all[idx]
    num_classes = int(y_all.max()) + 1
    onehot = np.eye(num_classes)[y[:, :n]]
    return ClassificationEpisodes(
        x=_to_torch(x[:, :n], device, dtype), labels=torch.as_tensor(y[:, :n], device=device),
        onehot=_to_torch(onehot, device, dtype), x_query=_to_torch(x[:, n:], device, dtype),
        labels_query=torch.as_tensor(y[:, n:], device=device))


def classification_accuracy(scores: torch.Tensor, episodes: ClassificationEpisodes) -> torch.Tensor:
    """Fraction of queries whose argmax class score is the true label, per episode: ``(B,)`` float64.
    A query whose scores are not all finite counts as wrong."""
    check_tensor(scores, "scores", min_rank=3, finite=False)
    finite = torch.isfinite(scores).all(-1)
    pred = torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0).argmax(-1)
    return ((pred == episodes.labels_query) & finite).double().mean(-1)


def nearest_neighbour_predictions(episodes: ClassificationEpisodes) -> torch.Tensor:
    """1-NN by cosine similarity (the ``β → ∞`` limit of the attention classifier): ``(B, n_q, C)`` one-hot
    scores, usable with :func:`classification_accuracy`."""
    sim = episodes.x_query @ episodes.x.transpose(-1, -2)
    nearest = sim.argmax(-1)
    return torch.gather(episodes.onehot, 1, nearest[..., None].expand(-1, -1, episodes.onehot.shape[-1]))
