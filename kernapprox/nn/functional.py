"""Attention on given heads, in the conventions of SDPA and fla: the functional core of :class:`KernelAttention`.

:func:`kernel_attention` takes queries, keys and values *after* the caller's projections and positions (rotary or
any other), ``q (B, H, n, d)``, ``k (B, H_kv, n_k, d)``, ``v (B, H_kv, n_k, d_v)``, with grouped-query heads (``H``
a multiple of ``H_kv``), and runs the estimator's attention in the mode asked for (:func:`kernapprox.linear_attention`
for a feature map or an estimator with its own attention, :func:`kernapprox.softmax_attention` for ``"exact"``).

>>> import torch, kernapprox as ka
>>> from kernapprox.nn.functional import kernel_attention
>>> gen = torch.Generator().manual_seed(0)
>>> q = torch.randn(2, 8, 16, 32, generator=gen)                    # 8 query heads
>>> k, v = (torch.randn(2, 2, 16, 32, generator=gen) for _ in range(2))   # 2 key/value heads
>>> est = ka.make_estimator("positive_orthogonal", num_features=64, rng=0).fit(q)
>>> kernel_attention(q, k, v, est, causal=True).shape
torch.Size([2, 8, 16, 32])

Decisions
---------
* **Grouped-query heads** are a documented repetition: the ``H_kv`` key/value heads are repeated to the ``H``
  query heads (head ``h`` reads key/value head ``h // (H / H_kv)``, as Hugging Face's ``repeat_kv``) before the
  core. States (``initial_state``, ``return_state``) therefore have the batch shape ``(B, H)``; the ``H / H_kv``
  heads of a group hold equal copies (the state is a function of the keys and values alone), which
  :class:`~kernapprox.RecurrentState` then updates with the same repeated keys when decoding.
* **Attention dropout drops keys.** Softmax attention's dropout zeroes weights of the matrix ``P``; outside the
  parallel mode there is no such matrix, only a state. What every estimator, mode and rule shares is that the
  output is linear in the values, ``y_i = Σ_j c_ij(q, k) v_j`` (for the sum rule ``c_ij`` are the attention
  weights). Dropout therefore zeroes whole columns of ``c``: each key ``j`` of each (batch entry, query head) is
  dropped with probability ``p`` (its value zeroed; the normaliser keeps it) and the kept values are scaled by
  ``1/(1−p)``, so ``E[y] = y`` without dropout, as for SDPA's dropout. Being applied to the values before the
  core, the same mask gives the same result in every mode (tested). The mask is drawn with numpy from ``rng``
  (a seed gives the same mask on every device); torch's global RNG is never used.
* **Mixed precision.** Under ``torch.autocast`` the inputs are cast to the autocast dtype (as autocast casts
  SDPA's) and the core runs with autocast off: half-precision inputs are computed in float32 and states are
  float32 (:mod:`kernapprox.attention.linear`), the output is in the autocast dtype.
* **Scale.** ``scale=None`` uses the estimator's ``scale_`` (fixed when it was fitted); another ``scale`` multiplies
  queries and keys by ``sqrt(scale / scale_)``, so the map estimates ``exp(scale · qᵀk)`` (exact attention takes
  it directly).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..attention import linear_attention, softmax_attention
from ..attention.masks import check_bool_mask, mask_kwargs
from ..estimators.base import Estimator
from ..rules import resolve_rule
from ..validation import as_generator, check_bool, check_positive_float, check_positive_int, check_tensor

__all__ = ["kernel_attention", "repeat_kv", "autocast_dtype"]


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, H_kv, ...)`` → ``(B, H_kv · groups, ...)``: head ``h`` of the result is head ``h // groups`` of ``x``
    (Hugging Face's ``repeat_kv``). ``groups = 1`` returns ``x`` itself."""
    if groups == 1:
        return x
    batch, heads, *rest = x.shape
    return x[:, :, None].expand(batch, heads, groups, *rest).reshape(batch, heads * groups, *rest)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type``, else ``None``."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 has no device argument
        enabled = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def _padding(mask, name: str, batch: int, heads: int, kv_heads: int, length: int):
    """A padding mask ``(B, n)`` (every head) or ``(B, 1 | H_kv | H, n)`` in the ``(B, ·, n)`` layout of the core;
    a per-key/value-head mask is repeated to the query heads."""
    if mask is None:
        return None
    check_bool_mask(mask, name)
    if mask.dim() == 2:
        mask = mask[:, None, :]
    if mask.dim() != 3 or mask.shape[0] != batch or mask.shape[-1] != length or \
            mask.shape[1] not in {1, kv_heads, heads}:
        raise ValueError(f"{name} must have shape (batch, n) = {(batch, length)} or (batch, 1 | {kv_heads} | {heads}, "
                         f"n), got {tuple(mask.shape)}")
    if mask.shape[1] != heads and mask.shape[1] != 1:
        mask = repeat_kv(mask, heads // kv_heads)
    return mask


def _dropout_keep(p: float, shape, rng, like: torch.Tensor) -> torch.Tensor:
    """The kept-value factors ``m / (1 − p)``, ``m ~ Bernoulli(1 − p)`` per (batch, head, key), drawn on the CPU from
    ``rng`` (numpy) and moved to ``like``'s device and dtype."""
    keep = as_generator(rng).random(shape) >= p
    return torch.from_numpy(keep.astype(np.float64) / (1.0 - p)).to(device=like.device, dtype=like.dtype)


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, estimator: Estimator, *, causal: bool = False,
                     mode: str = "chunked", chunk_size: int = 64, rule="sum", key_padding_mask=None, attn_mask=None,
                     query_padding_mask=None, dropout_p: float = 0.0, training: bool = False, rng=None,
                     scale: float | None = None, initial_state=None, return_state: bool = False):
    r"""Attention of given heads with the softmax kernel replaced by ``estimator``:

    .. math::
        y_i = \frac{\sum_{j} κ̂(q_i, k_j)\, v_j}{\sum_{j} κ̂(q_i, k_j)}\quad(j ≤ i \text{ if causal}),
        \qquad κ̂(q, k) ≈ \exp(s\, q^⊤k)

    (for ``"exact"``: ``κ̂ = exp``, softmax attention; other state rules: their read-out, :mod:`kernapprox.rules`).
    Linear attention after Katharopoulos et al. (2020), eq. 4-6; the kernel estimates are the estimator's.

    Parameters
    ----------
    q : Tensor ``(B, H, n, d)``
        Queries after the caller's projection and positions.
    k, v : Tensor ``(B, H_kv, n_k, d)``, ``(B, H_kv, n_k, d_v)``
        ``H`` a multiple of ``H_kv`` (grouped-query heads; ``H_kv = 1`` is multi-query attention). One dtype and
        device for the three (under autocast: any floating dtypes).
    estimator : Estimator
        A fitted kernapprox estimator (``kernapprox.make_estimator(...).fit(...)``) for head dimension ``d``.
    causal : bool
        Key ``j`` takes part in query ``i`` only when ``j ≤ i`` (``n = n_k``).
    mode : {"parallel", "recurrent", "chunked"}
        The mode of linear attention (one the estimator supports); ignored by exact attention (one SDPA call).
    chunk_size : int
    rule : str or rule object
        The state-update rule (:mod:`kernapprox.rules`).
    key_padding_mask : bool Tensor ``(B, n_k)`` or ``(B, 1 | H_kv | H, n_k)``, optional
        True = the key is padding (``nn.MultiheadAttention``'s convention). Every mode.
    attn_mask : Tensor broadcastable to ``(B, H, n, n_k)``, optional
        SDPA's convention: bool with True = the pair takes part, or float added to the logits. Exact attention and
        the parallel mode of a feature map only (a state built key by key cannot leave out keys for some queries:
        other modes raise ``ValueError``, saying so).
    query_padding_mask : bool Tensor ``(B, n)`` or ``(B, 1 | H, n)``, optional
        True = the query is padding: its output row is 0 and it is exempt from the check that every query has a
        key — what left-padded batches need (their first rows see no key). Every mode.
    dropout_p : float in [0, 1)
        Attention dropout, applied when ``training`` (see the module docstring: whole keys are dropped).
    training : bool
    rng : int, SeedSequence or Generator, optional
        The dropout mask's source; required when dropout applies.
    scale : float, optional
        ``s``; default the estimator's ``scale_``.
    initial_state : state tuple, optional
        The state to continue (batch shape ``(B, H)``; for sum/decay a
        :class:`~kernapprox.rules.NormalizedState`), e.g. from an earlier call with ``return_state=True``. Feature
        maps only.
    return_state : bool
        Also return the state after the last key, batch shape ``(B, H)`` (float32 for half inputs).

    Returns
    -------
    Tensor ``(B, H, n, d_v)``
        In the inputs' dtype (the autocast dtype under autocast); with ``return_state`` the pair ``(output,
        state)``.

    Raises
    ------
    ValueError, TypeError
        Shapes that do not fit (naming the argument), ``H`` not a multiple of ``H_kv``, a mask a mode cannot honour,
        dropout without ``rng``, and everything :func:`kernapprox.linear_attention` refuses.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name, min_rank=1, finite=False)
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, n, dim), got {tuple(x.shape)}")
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator must be a kernapprox estimator, got {type(estimator).__name__}")
    check_bool(causal, "causal")
    check_bool(training, "training")
    check_bool(return_state, "return_state")
    batch, heads, n_q, _ = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"q, k and v must share the batch size, got {q.shape[0]}, {k.shape[0]} and {v.shape[0]}")
    if v.shape[1] != kv_heads or v.shape[2] != n_k:
        raise ValueError(f"k and v must have the same heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the key/value heads "
                         f"({kv_heads}): grouped-query attention")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    check_positive_int(chunk_size, "chunk_size")
    rule = resolve_rule(rule)
    caps = estimator.capabilities()
    groups = heads // kv_heads
    device_type = q.device.type
    low = autocast_dtype(device_type)
    if low is not None:                                  # autocast: its dtype in, float32 compute and states
        with torch.autocast(device_type, enabled=False):
            return kernel_attention(q.to(low), k.to(low), v.to(low), estimator, causal=causal, mode=mode,
                                    chunk_size=chunk_size, rule=rule, key_padding_mask=key_padding_mask,
                                    attn_mask=(attn_mask.to(low) if isinstance(attn_mask, torch.Tensor)
                                               and attn_mask.is_floating_point() else attn_mask),
                                    query_padding_mask=query_padding_mask, dropout_p=dropout_p, training=training,
                                    rng=rng, scale=scale, initial_state=initial_state, return_state=return_state)
    key_padding = _padding(key_padding_mask, "key_padding_mask", batch, heads, kv_heads, n_k)
    query_padding = _padding(query_padding_mask, "query_padding_mask", batch, heads, heads, n_q)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if training and dropout_p > 0:
        if rng is None:
            raise ValueError("dropout_p > 0 in training needs rng= (int, SeedSequence or Generator): the dropout mask "
                             "is drawn from it, never from torch's global RNG")
        v = v * _dropout_keep(dropout_p, (batch, heads, n_k), rng, v)[..., None]
    masks = mask_kwargs(key_padding, attn_mask, query_padding)
    estimator._check_fitted()
    if caps.kind == "exact":
        if initial_state is not None or return_state:
            raise ValueError("exact attention has no fixed-size state to start from or return (initial_state/"
                             "return_state need a feature map; a key/value cache keeps the keys themselves)")
        s = estimator.scale_ if scale is None else check_positive_float(scale, "scale")
        return softmax_attention(q, k, v, causal, s, **masks)
    if scale is not None:
        factor = math.sqrt(check_positive_float(scale, "scale") / estimator.scale_)
        q, k = q * factor, k * factor
    return linear_attention(q, k, v, estimator, causal=causal, mode=mode, chunk_size=chunk_size, rule=rule,
                            initial_state=initial_state, return_state=return_state, **masks)
