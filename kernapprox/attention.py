"""Attention as kernel smoothing: the exact reference and linear attention in three equivalent modes.

``y(q) = Σ_i κ(q, k_i) v_i / Σ_i κ(q, k_i)``. With the exact kernel ``κ = exp(s qᵀk)`` this is softmax attention;
with a feature map ``κ ≈ φ(q)ᵀφ(k)`` it is linear attention, computed in one of three modes that agree to
floating-point tolerance:

``parallel`` (the "Transformer mode")
    materialise ``A = φ(Q) φ(K)ᵀ`` (masked if causal), then ``A V`` and ``A 1``. Quadratic; reference/small n.
``recurrent`` (the "RNN mode")
    scan the state ``W_t = W_{t-1} + v_t φ(k_t)ᵀ``, ``z_t = z_{t-1} + φ(k_t)`` token by token and read
    ``y_t = W_t φ(q_t) / z_tᵀ φ(q_t)``; constant memory per step. :class:`RecurrentState` exposes the same
    step for decoding one token at a time.
``chunked`` (the fast mode)
    blockwise: exact masked products within a chunk, the running state across chunks.

Stabilisation (all modes): features come as ``φ = φ̃ · exp(ℓ)`` (see :mod:`kernapprox.features.base`).
Query scales cancel in the ratio and are carried only in the returned log-scale. Non-causal: the key scales are
shifted by one constant per (batch, head), their maximum. Causal: query ``i`` is shifted by the running maximum
``c_i = max_{j≤i} ℓ(k_j)`` in every mode (the recurrent state is rescaled by ``exp(c_old − c_new)`` when the
maximum grows; the parallel and chunked modes apply the same per-row shift inside their blocks), so no ``exp``
overflows, no row loses all its keys to underflow because of a later, larger key, the streaming form never looks
ahead, and the three modes return the same numerator, normaliser and log-scale. Half-precision inputs are
computed in float32 and returned in the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._validation import (
    check_choice,
    check_positive_int,
    check_same_kind,
    check_tensor,
    compute_dtype,
)
from .features.base import FeatureMap
from .features.exact import ExactKernel
from .kernel import resolve_scale

MODES = ("parallel", "recurrent", "chunked")
_LOGITS_PER_CHUNK = 1 << 24  # default memory bound of softmax_attention's query chunks (all batch entries)


class AttentionParts(NamedTuple):
    """Output with its numerator and normaliser: true ``numerator = numerator · exp(log_scale)[..., None]``,
    true ``normalizer = normalizer · exp(log_scale)``; ``output = numerator / normalizer[..., None]``."""

    output: torch.Tensor      # (..., n, d_v)
    numerator: torch.Tensor   # (..., n, d_v)
    normalizer: torch.Tensor  # (..., n)
    log_scale: torch.Tensor   # (..., n)


def _check_qkv(q, k, v, causal):
    check_tensor(q, "q")
    check_tensor(k, "k")
    check_tensor(v, "v")
    check_same_kind(q=q, k=k, v=v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[-2]} and {v.shape[-2]}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError("q, k and v must share batch dimensions, got "
                         f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")


# ------------------------------------------------------------------------------------------ exact attention
def softmax_attention(q, k, v, causal: bool = False, scale: float | None = None, *, chunk_size: int | None = None,
                      return_lse: bool = False):
    """Exact softmax attention ``softmax(s · Q Kᵀ [+ causal mask]) V``, computed in query chunks.

    Never materialises more than ``chunk_size × n_k`` logits per (batch, head) (``chunk_size`` defaults so that
    a chunk holds at most 2²⁴ logits over all batch and head entries together, 64 MiB in float32, and at least
    one query row), so it runs at n = 32k and beyond on a CPU. Matches
    ``torch.nn.functional.scaled_dot_product_attention``. With ``return_lse=True`` also returns the log of the
    normaliser ``log Σ_j exp(s q_iᵀk_j)``, shape ``(..., n_q)``.
    """
    _check_qkv(q, k, v, causal)
    s = resolve_scale(q.shape[-1], scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if chunk_size is None:
        num_heads = q.numel() // max(n_q * q.shape[-1], 1)            # product of the batch dimensions
        chunk_size = max(1, min(n_q, _LOGITS_PER_CHUNK // max(n_k * num_heads, 1)))
    check_positive_int(chunk_size, "chunk_size")
    ct = compute_dtype(q.dtype)
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    outs, lses = [], []
    for start in range(0, n_q, chunk_size):
        stop = min(start + chunk_size, n_q)
        kend = stop if causal else n_k
        logits = s * (qc[..., start:stop, :] @ kc[..., :kend, :].transpose(-1, -2))
        if causal:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            cols = torch.arange(kend, device=q.device)[None, :]
            logits = logits.masked_fill(cols > rows, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        outs.append(torch.exp(logits - lse) @ vc[..., :kend, :])
        lses.append(lse.squeeze(-1))
    out = torch.cat(outs, dim=-2).to(q.dtype)
    if return_lse:
        return out, torch.cat(lses, dim=-1)
    return out


# ----------------------------------------------------------------------------------------- linear attention
def _stabilised_features(q, k, estimator):
    # q and k were checked for NaN/Inf by the caller: one scan each, not two
    pq, lq = estimator.features(q, "query", log_scale=True, check_finite=False)
    pk, lk = estimator.features(k, "key", log_scale=True, check_finite=False)
    ct = compute_dtype(q.dtype)
    return pq.to(ct), lq.to(ct), pk.to(ct), lk.to(ct)


def _parallel(pq, lq, pk, lk, v, causal):
    if causal:
        num, den, c_rows = _causal_block(pq, pk, lk, v, None)
        return num, den, lq + c_rows
    c = lk.amax(-1, keepdim=True)                                     # one shift per (batch, head)
    pk = pk * torch.exp(lk - c)[..., None]
    a = pq @ pk.transpose(-1, -2)                                     # (..., n, n)
    return a @ v, a.sum(-1), lq + c


def _causal_block(pq, pk, lk, v, c_prev):
    """Causal products within one block, each query row shifted by the running key maximum up to itself.

    ``A_ij = φ̃(q_i)ᵀφ̃(k_j) · exp(ℓ_j − c_i)`` for ``j ≤ i`` with ``c_i = max(c_prev, max_{j≤i} ℓ_j)`` — the
    shift the recurrent mode has at step ``i`` — so no row's keys all underflow because of a later, larger key.
    Returns ``(A V, A 1, c)`` with ``c`` of shape ``(..., L)``.
    """
    c_rows = torch.cummax(lk, dim=-1).values                          # (..., L)
    if c_prev is not None:
        c_rows = torch.maximum(c_rows, c_prev[..., None])
    length = lk.shape[-1]
    future = torch.ones(length, length, dtype=torch.bool, device=lk.device).triu(1)
    log_w = (lk[..., None, :] - c_rows[..., :, None]).masked_fill(future, float("-inf"))
    a = (pq @ pk.transpose(-1, -2)) * torch.exp(log_w)                # (..., L, L)
    return a @ v, a.sum(-1), c_rows


def _recurrent(pq, lq, pk, lk, v, causal):
    state = None
    nums, dens, scales = [], [], []
    n = pk.shape[-2]
    for t in range(n):
        state = _state_update(state, pk[..., t, :], lk[..., t], v[..., t, :])
        if causal:
            num, den = _state_read(state, pq[..., t, :])
            nums.append(num)
            dens.append(den)
            scales.append(lq[..., t] + state[2])
    if not causal:
        w, z, c = state
        return pq @ w, pq @ z[..., None], lq + c[..., None]
    return torch.stack(nums, -2), torch.stack(dens, -1), torch.stack(scales, -1)


def _state_update(state, phi_k, log_k, v):
    """One RNN step on stabilised key features: ``W ← W e^{c−c'} + φ̃_k e^{ℓ_k−c'} vᵀ`` (W stored as r × d_v)."""
    if state is None:
        c_new = log_k
        wk = phi_k
        return wk[..., :, None] * v[..., None, :], wk, c_new
    w, z, c = state
    c_new = torch.maximum(c, log_k)
    decay = torch.exp(c - c_new)[..., None]
    wk = phi_k * torch.exp(log_k - c_new)[..., None]
    w = w * decay[..., None] + wk[..., :, None] * v[..., None, :]
    z = z * decay + wk
    return w, z, c_new


def _state_read(state, phi_q):
    w, z, _ = state
    num = (phi_q[..., None, :] @ w).squeeze(-2)
    den = (phi_q * z).sum(-1)
    return num, den


def _chunked(pq, lq, pk, lk, v, causal, chunk_size):
    if not causal:
        c = lk.amax(-1, keepdim=True)
        pk = pk * torch.exp(lk - c)[..., None]
        w = pk.transpose(-1, -2) @ v                                  # (..., r, d_v)
        z = pk.sum(-2)                                                # (..., r)
        return pq @ w, (pq * z[..., None, :]).sum(-1), lq + c
    n = pk.shape[-2]
    nums, dens, scales = [], [], []
    w = z = c = None                                                  # state (r, d_v), (r,), shift c
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        pq_j, pk_j = pq[..., start:stop, :], pk[..., start:stop, :]
        lk_j, v_j = lk[..., start:stop], v[..., start:stop, :]
        num, den, c_rows = _causal_block(pq_j, pk_j, lk_j, v_j, c)
        c_end = c_rows[..., -1]
        if w is not None:
            carry = torch.exp(c[..., None] - c_rows)                  # (..., L): old state, row shifts
            num = num + (pq_j @ w) * carry[..., None]
            den = den + (pq_j * z[..., None, :]).sum(-1) * carry
            decay = torch.exp(c - c_end)
            w = w * decay[..., None, None]
            z = z * decay[..., None]
        pk_end = pk_j * torch.exp(lk_j - c_end[..., None])[..., None]
        w_add, z_add = pk_end.transpose(-1, -2) @ v_j, pk_end.sum(-2)
        w, z = (w_add, z_add) if w is None else (w + w_add, z + z_add)
        c = c_end
        nums.append(num)
        dens.append(den)
        scales.append(lq[..., start:stop] + c_rows)
    return torch.cat(nums, -2), torch.cat(dens, -1), torch.cat(scales, -1)


def linear_attention(q, k, v, estimator: FeatureMap, causal: bool = False, mode: str = "chunked", *,
                     chunk_size: int = 64, return_parts: bool = False):
    """Kernelised attention ``y_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)`` (``j ≤ i`` if causal).

    Parameters
    ----------
    q, k, v : Tensor ``(..., n, d)``, ``(..., n_k, d)``, ``(..., n_k, d_v)``
        Same dtype, device and batch dimensions.
    estimator : FeatureMap
        A fitted estimator. :class:`~kernapprox.features.ExactKernel` is routed to :func:`softmax_attention`.
        Estimators that are not feature maps (e.g. hybrids, Nyströmformer) provide their own ``attention``
        method, which is called instead.
    causal : bool
    mode : {"parallel", "recurrent", "chunked"}
    chunk_size : int
        Chunk length of the chunked mode.
    return_parts : bool
        Return :class:`AttentionParts` (output, numerator, normaliser, log-scale) instead of the output.

    The normaliser may be ≤ 0 for signed features (trigonometric, Maclaurin, Nyström); the output is then
    ±inf or has the wrong sign, which :func:`kernapprox.metrics.nonpositive_normalizer_rate` measures. Nothing
    is clipped.
    """
    _check_qkv(q, k, v, causal)
    check_choice(mode, "mode", MODES)
    check_positive_int(chunk_size, "chunk_size")
    if not isinstance(estimator, FeatureMap):
        raise TypeError(f"estimator must be a kernapprox estimator, got {type(estimator).__name__}")
    estimator._check_fitted()
    if getattr(estimator, "dim_", q.shape[-1]) != q.shape[-1]:
        raise ValueError(f"q and k have d={q.shape[-1]} but the estimator was fitted with d={estimator.dim_}")
    if mode not in estimator.modes:
        raise ValueError(f"mode {mode!r} is not supported by {type(estimator).__name__}; "
                         f"supported: {', '.join(estimator.modes)}")
    if isinstance(estimator, ExactKernel):
        out, lse = softmax_attention(q, k, v, causal, estimator.scale_, return_lse=True)
        if not return_parts:
            return out
        one = torch.ones_like(lse)
        return AttentionParts(out, out.to(lse.dtype), one, lse)
    if hasattr(estimator, "attention"):
        return estimator.attention(q, k, v, causal=causal, mode=mode, chunk_size=chunk_size,
                                   return_parts=return_parts)
    pq, lq, pk, lk = _stabilised_features(q, k, estimator)
    vc = v.to(pq.dtype)
    if mode == "parallel":
        num, den, logs = _parallel(pq, lq, pk, lk, vc, causal)
    elif mode == "recurrent":
        num, den, logs = _recurrent(pq, lq, pk, lk, vc, causal)
    else:
        num, den, logs = _chunked(pq, lq, pk, lk, vc, causal, chunk_size)
    den = den.reshape(num.shape[:-1])
    logs = logs.reshape(num.shape[:-1])
    out = (num / den[..., None]).to(q.dtype)
    if return_parts:
        return AttentionParts(out, num, den, logs)
    return out


# ------------------------------------------------------------------------------------- the RNN-mode object
class RecurrentState:
    """The linear-attention state ``(W, z)`` for decoding one token at a time.

    >>> est = make_estimator("positive", num_features=64, rng=0).fit(torch.zeros(1, 8))
    >>> st = RecurrentState(est)
    >>> y = st.step(q_t, k_t, v_t)   # q_t, k_t: (..., d), v_t: (..., d_v) -> y_t: (..., d_v)

    ``step`` adds ``(k_t, v_t)`` to the state and then reads it with ``q_t`` (causal: the token sees itself).
    A running maximum of the key log-scales keeps ``exp`` finite over arbitrarily long streams: the state is
    stored as ``W̃ = W e^{−c}`` and rescaled when ``c`` grows. Memory is ``r · (d_v + 1)`` numbers whatever the
    stream length.

    ``check_finite=False`` skips the per-step NaN/Inf check of the inputs, which costs a device-to-host
    synchronisation per token on a GPU (use it in timed decoding loops; shapes, dtypes and devices are still
    checked).
    """

    def __init__(self, estimator: FeatureMap, *, check_finite: bool = True):
        if not isinstance(estimator, FeatureMap) or isinstance(estimator, ExactKernel):
            raise TypeError("estimator must be a fitted kernapprox feature map (not the exact kernel)")
        if "recurrent" not in estimator.modes:
            raise ValueError(f"{type(estimator).__name__} does not support the recurrent mode")
        estimator._check_fitted()
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self.estimator = estimator
        self.check_finite = check_finite
        self.state = None
        self.num_tokens = 0

    def update(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Add one key/value pair: ``k_t (..., d)``, ``v_t (..., d_v)``."""
        check_tensor(k_t, "k_t", min_rank=1, finite=self.check_finite)
        check_tensor(v_t, "v_t", min_rank=1, finite=self.check_finite)
        check_same_kind(k_t=k_t, v_t=v_t)
        if k_t.shape[:-1] != v_t.shape[:-1]:
            raise ValueError(f"k_t and v_t must share batch dimensions, got {tuple(k_t.shape)} and {tuple(v_t.shape)}")
        if self.state is not None:
            w = self.state[0]
            if w.shape[:-2] != k_t.shape[:-1] or w.shape[-1] != v_t.shape[-1]:
                raise ValueError(f"k_t/v_t (shapes {tuple(k_t.shape)}, {tuple(v_t.shape)}) do not match the state's "
                                 f"batch shape {tuple(w.shape[:-2])} or value dimension {w.shape[-1]}")
            self._check_like_state(k_t, "k_t")
        pk, lk = self.estimator.features(k_t[..., None, :], "key", log_scale=True, check_finite=False)
        ct = compute_dtype(k_t.dtype)
        self.state = _state_update(self.state, pk[..., 0, :].to(ct), lk[..., 0].to(ct), v_t.to(ct))
        self.num_tokens += 1

    def read(self, q_t: torch.Tensor) -> torch.Tensor:
        """``W φ(q_t) / zᵀφ(q_t)`` for ``q_t (..., d)``."""
        if self.state is None:
            raise ValueError("the state is empty: call update (or step) before read")
        check_tensor(q_t, "q_t", min_rank=1, finite=self.check_finite)
        w = self.state[0]
        if q_t.shape[:-1] != w.shape[:-2]:
            raise ValueError(f"q_t has batch shape {tuple(q_t.shape[:-1])} but the state has {tuple(w.shape[:-2])}")
        self._check_like_state(q_t, "q_t")
        pq, _ = self.estimator.features(q_t[..., None, :], "query", log_scale=True, check_finite=False)
        num, den = _state_read(self.state, pq[..., 0, :].to(self.state[0].dtype))
        return (num / den[..., None]).to(q_t.dtype)

    def _check_like_state(self, x, name):
        w = self.state[0]
        if x.device != w.device:
            raise ValueError(f"{name} is on {x.device} but the state is on {w.device}")
        if compute_dtype(x.dtype) != w.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but the state holds {w.dtype}; cast explicitly")

    def step(self, q_t, k_t, v_t) -> torch.Tensor:
        """``update(k_t, v_t)`` then ``read(q_t)``."""
        self.update(k_t, v_t)
        return self.read(q_t)

    def state_bytes(self) -> int:
        if self.state is None:
            return 0
        w, z, c = self.state
        return sum(t.numel() * t.element_size() for t in (w, z, c))


# ---------------------------------------------------------------------------------------------- the oracles
def softmax_attention_reference(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Plain float64 loop over queries: the test oracle of :func:`softmax_attention`."""
    _check_qkv(q, k, v, causal)
    s = resolve_scale(q.shape[-1], scale)
    q, k, v = q.double(), k.double(), v.double()
    outs = []
    for i in range(q.shape[-2]):
        end = i + 1 if causal else k.shape[-2]
        logits = s * (k[..., :end, :] @ q[..., i, :, None]).squeeze(-1)
        w = torch.exp(logits - logits.amax(-1, keepdim=True))
        outs.append((w[..., None] * v[..., :end, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(outs, -2)


def linear_attention_reference(q, k, v, estimator: FeatureMap, causal: bool = False) -> torch.Tensor:
    """Plain float64 loop over queries with exact-scale features: the test oracle of the three modes.

    No stabilisation, so use it only at moderate norms.
    """
    _check_qkv(q, k, v, causal)
    pq = estimator.features(q.double(), "query")
    pk = estimator.features(k.double(), "key")
    v = v.double()
    outs = []
    for i in range(q.shape[-2]):
        end = i + 1 if causal else k.shape[-2]
        w = (pk[..., :end, :] @ pq[..., i, :, None]).squeeze(-1)
        outs.append((w[..., None] * v[..., :end, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(outs, -2)
