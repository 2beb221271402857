"""Attention as kernel smoothing: the exact reference and linear attention in three equivalent modes.

``y(q) = Σ_i κ(q, k_i) v_i / Σ_i κ(q, k_i)``. With the exact kernel ``κ = exp(s qᵀk)`` this is softmax attention
(:mod:`.exact`); with a feature map ``κ ≈ φ(q)ᵀφ(k)`` it is linear attention (:mod:`.linear`), computed in the
parallel, recurrent or chunked mode, with :class:`~.recurrent.RecurrentState` for decoding one token at a time and
:func:`~.decode.decode_cache` for one cache object from prefill to decode for every estimator (a fixed-size state,
or a KV cache for the exact kernel).
:mod:`.naive` holds the plain float64 loop oracles the fast paths are tested against. The state may be written by
other rules than the sum (:mod:`kernapprox.rules`, their one home: decay, delta rule, least squares;
:mod:`.delta` and :mod:`.least_squares` hold their modes), and every mode takes torch's masks (:mod:`.masks`).

Examples
--------
>>> import torch, kernapprox as ka
>>> gen = torch.Generator().manual_seed(0)
>>> q, k, v = (torch.randn(2, 32, 16, generator=gen, dtype=torch.float64) for _ in range(3))
>>> est = ka.make_estimator("positive_orthogonal", num_features=256, rng=0).fit(q, k)
>>> y = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)
>>> y_rnn = ka.linear_attention(q, k, v, est, causal=True, mode="recurrent")
>>> bool(torch.allclose(y, y_rnn, atol=1e-10))
True
"""

from .decode import DecodeCache, EstimatorStateCache, FeatureStateCache, KVCache, decode_cache
from .exact import softmax_attention, uniform_attention
from .linear import (
    MODES,
    add_log_keys,
    chunked_block_length,
    linear_attention,
    linear_attention_from_features,
    linear_attention_from_log_features,
)
from .naive import linear_attention_from_log_features_naive, linear_attention_naive, softmax_attention_naive
from .recurrent import RecurrentState, add_keys, read_queries

__all__ = ["MODES", "softmax_attention", "uniform_attention", "linear_attention", "linear_attention_from_features",
           "linear_attention_from_log_features", "add_keys", "read_queries", "add_log_keys", "RecurrentState",
           "chunked_block_length", "softmax_attention_naive", "linear_attention_naive",
           "linear_attention_from_log_features_naive", "decode_cache", "DecodeCache", "FeatureStateCache", "KVCache",
           "EstimatorStateCache"]
