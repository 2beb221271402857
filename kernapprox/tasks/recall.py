"""Associative recall: multi-query associative recall (MQAR; Arora et al. 2023, *Zoology*) in its two forms.

Training-free (read by attention as a fixed kernel smoother, :mod:`kernapprox.readout`)
    :func:`associative_recall` is continuous MQAR (Zoology's continuous variant ``zoology/data/stacked_mqar.py``):
    keys and values are random unit vectors (or rows of a given embedding table), every stored key is queried once
    (optionally perturbed to cosine ``ρ``), and the read-out is decoded to the nearest row of a candidate table of
    values (``num_candidates`` rows, 4096 = V/2 as in Zoology; the stored values are a random subset of it).
    Retrieval needs ``β ≳ ln n`` (target mass ``e^β / (e^β + (n−1) e^{β²/2d}) ≥ ½``; :func:`log_n_beta`).
    :func:`paraphrase_recall` is the same with discrete keys: each key is a phrase of token embeddings from a
    shared vocabulary and each query the phrase with some tokens replaced (a paraphrase-like perturbation, towards
    other keys' tokens). Scored by :func:`recall_accuracy` (nearest-candidate decoding, :func:`decode_nearest`).
Trained models (:mod:`kernapprox.models`)
    :class:`MQAR` is token MQAR (``zoology/data/multiquery_ar.py``): token sequences over a vocabulary of ``V``
    tokens whose lower half ``[1, V/2)`` holds the keys and upper half ``[V/2, V)`` the values (token 0 is the
    filler). A sequence is ``k₁ v₁ k₂ v₂ … k_N v_N`` (distinct keys, distinct values) followed by a query region of
    ``L − 2N`` tokens in which every key appears once, at an even offset ``2g`` with gaps ``g`` drawn without
    replacement from ``{0, …, S−1}``, ``S = (L − 2N)/2``, with probability ``∝ (g+1)^(a−1)`` (``a = power_a =
    0.01``: queries crowd towards the context). Other query-region slots hold 0 (or a uniform random token with
    ``random_non_queries``). The label at a query position is the value stored with that key (the model must emit
    it at the query token); every other position is ignored. Accuracy is the fraction of query positions whose
    argmax logit is the label, per sequence.

Both forms draw from a numpy ``Generator`` only (float64, then cast), so a seed is one data stream everywhere.

>>> import numpy as np
>>> task = MQAR(vocab_size=32, seq_len=24, num_pairs=4)
>>> batch = task.sample(np.random.default_rng(0), 2)
>>> batch.inputs.shape, int((batch.labels >= 0).sum())          # 2 sequences × 4 queried keys
(torch.Size([2, 24]), 8)
>>> associative_recall(16, dim=8, num_candidates=32, batch=2, rng=0).keys.shape
torch.Size([2, 16, 8])
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from ..validation import as_generator, check_bool, check_positive_float, check_positive_int, check_tensor
from ._common import _check_common, _to_torch, _unit_rows

__all__ = ["RecallEpisodes", "associative_recall", "paraphrase_recall", "decode_nearest", "recall_accuracy",
           "log_n_beta", "MQAR", "MQARBatch", "IGNORE"]


def log_n_beta(num_pairs: int, factor: float = 1.0) -> float:
    """``β = factor · ln n``: the inverse temperature at which exact attention puts about half its mass on the
    matching key among ``n`` random unit keys (``factor = 1``; Scalable-Softmax / Chiang & Cholak scaling)."""
    check_positive_int(num_pairs, "num_pairs")
    check_positive_float(factor, "factor")
    return factor * math.log(max(num_pairs, 2))


# ----------------------------------------------------------------------------- training-free: continuous
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


# ------------------------------------------------------------------------------------ trained: token MQAR
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
