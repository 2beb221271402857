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
    check_bool,
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
    check_bool(return_lse, "return_lse")
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


# Token blocks of the chunked mode hold about this many feature entries (all batch entries together). On a CPU a
# block's features stay in cache and the allocator recycles its temporaries; whole-sequence feature matrices of
# hundreds of MB made every element-wise pass a round trip to memory (and a fresh page-faulted allocation).
# A GPU wants large blocks for parallelism. Results do not depend on the block length beyond rounding.
_FEATURES_PER_BLOCK = {"cpu": 1 << 19, "cuda": 1 << 26}


def _block_length(batch: int, r: int, chunk_size: int, n: int, device: torch.device) -> int:
    """Tokens per block: a multiple of ``chunk_size`` holding about ``_FEATURES_PER_BLOCK`` feature entries."""
    target = _FEATURES_PER_BLOCK.get(device.type, _FEATURES_PER_BLOCK["cuda"])
    chunks = max(1, target // max(1, batch * r * chunk_size))
    return min(chunks * chunk_size, -(-n // chunk_size) * chunk_size)


def _chunked(q, k, v, estimator, causal, chunk_size):
    """The chunked mode, computed block by block: features of one block of tokens at a time (never of the whole
    sequence), and within a causal block every chunk at once.

    Numerator and normaliser come out of one product with ``[V 1]`` (the state is ``r × (d_v+1)``). Causal: for
    the chunks ``j`` of a block, with ``c_i`` the running key maximum at row ``i`` (the recurrent mode's shift),
    ``c⁻_j`` the shift before chunk ``j`` and ``c⁺_j`` the one at its end,

    - intra-chunk: ``A_il = φ̃(q_i)ᵀφ̃(k_l) e^{ℓ_l − c_i}`` for ``l ≤ i`` (per-row shift, as in :func:`_causal_block`);
    - chunk summaries ``U_j = Σ_{l∈j} e^{ℓ_l − c⁺_j} φ̃(k_l) [v_l 1]ᵀ``;
    - states before each chunk ``S_j = Σ_{i<j} e^{c⁺_i − c⁻_j} U_i + e^{c_carry − c⁻_j} S_carry``, one batched
      product with a lower-triangular weight matrix whose entries are all ≤ 1 (the running maximum only grows):
      the same sums as the token-by-token recurrence, without a Python loop over chunks;
    - rows read ``φ̃(q_i)ᵀ S_j e^{c⁻_j − c_i}``.

    Non-causal: the key pass accumulates the state under a running maximum (rescaled by ``e^{c_old − c_new}``),
    then the query pass reads it; the shift is the maximum over all keys, as in the parallel mode.
    """
    ct = compute_dtype(q.dtype)
    batch_shape, (n, d), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    qf, kf = q.reshape(-1, n, d), k.reshape(-1, n_k, d)
    batch = qf.shape[0]
    vf = v.reshape(batch, n_k, d_v)
    block = _block_length(batch, estimator.num_features, chunk_size, max(n, n_k), q.device)
    ones = torch.ones(batch, block, 1, dtype=ct, device=v.device)

    def values(start, stop):                      # [V 1] of one block, built per block (a cache-sized copy)
        return torch.cat([vf[:, start:stop].to(ct), ones[:, :stop - start]], -1)

    def features(x, role):
        return estimator.features(x, role, log_scale=True, check_finite=False)   # x was checked by the caller

    num_den = torch.empty(batch, n, d_v + 1, dtype=ct, device=q.device)
    logs = torch.empty(batch, n, dtype=ct, device=q.device)
    if causal:
        _chunked_causal(qf, kf, values, features, chunk_size, block, num_den, logs)
    else:
        state = c = None
        for start in range(0, n_k, block):
            pk, lk = features(kf[:, start:start + block], "key")
            c_new = lk.amax(-1) if c is None else torch.maximum(c, lk.amax(-1))
            weights = torch.exp(lk - c_new[:, None])[..., None]     # scale the d_v+1 columns, not the r features
            update = pk.transpose(-1, -2) @ (values(start, start + pk.shape[1]) * weights)
            state = update if state is None else torch.addcmul(update, state, torch.exp(c - c_new)[:, None, None])
            c = c_new
        for start in range(0, n, block):
            pq, lq = features(qf[:, start:start + block], "query")
            num_den[:, start:start + block] = pq @ state
            logs[:, start:start + block] = lq + c[:, None]
    return (num_den[..., :d_v].reshape(*batch_shape, n, d_v), num_den[..., d_v].reshape(*batch_shape, n),
            logs.reshape(*batch_shape, n))


# Up to this many chunks per block (CPU-sized blocks) the chunk states are a loop of fused multiply-adds; beyond
# it (GPU-sized blocks) one batched product, whose tiny inner dimension makes it memory-bound on a CPU.
_SEQUENTIAL_CHUNKS = 16


def _chunk_states(summary, state, c_before, c_end):
    """States before each chunk of a block, and the state after the block.

    ``S_0`` is the carried state (zero before the first block) and ``S_{j+1} = S_j e^{c⁻_j − c⁺_j} + U_j``: the
    recurrence at chunk granularity, every factor ≤ 1 (``e^{-inf} = 0`` before the sequence's first chunk). With
    many chunks the same sums come from one product with the weights ``e^{c⁺_i − c⁻_j}`` (``i < j``) and
    ``e^{c_carry − c⁻_j}`` for the carried state.
    """
    g = c_end.shape[1]
    decay = torch.exp(c_before - c_end)[..., None, None]                     # (B, g, 1, 1)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (summary, state, c_before, c_end))
    if g <= _SEQUENTIAL_CHUNKS and needs_grad:                               # out= is not differentiable
        rows = [torch.zeros_like(summary[:, 0]) if state is None else state]
        for j in range(g - 1):
            rows.append(torch.addcmul(summary[:, j], rows[-1], decay[:, j]))
        states = torch.stack(rows, 1)
    elif g <= _SEQUENTIAL_CHUNKS:
        states = torch.empty_like(summary)
        if state is None:
            states[:, 0] = 0
        else:
            states[:, 0] = state
        for j in range(g - 1):
            torch.addcmul(summary[:, j], states[:, j], decay[:, j], out=states[:, j + 1])
    else:
        earlier = torch.ones(g, g, dtype=torch.bool, device=c_end.device).tril(-1)
        weights = torch.exp((c_end[:, None, :] - c_before[:, :, None]).masked_fill(~earlier, float("-inf")))
        stacked = summary
        if state is not None:                                                # the carried state as chunk "-1"
            weights = torch.cat([torch.exp(c_before[:, :1] - c_before)[..., None], weights], -1)
            stacked = torch.cat([state[:, None], summary], 1)
        states = (weights @ stacked.flatten(-2)).view(summary.shape)
    return states, torch.addcmul(summary[:, -1], states[:, -1], decay[:, -1])


def _chunked_causal(qf, kf, values, features, chunk_size, block, num_den, logs):
    """Causal chunked mode over blocks of ``block`` tokens (see :func:`_chunked`); writes ``num_den``, ``logs``."""
    batch, n = qf.shape[:2]
    size = chunk_size
    future = torch.ones(size, size, dtype=torch.bool, device=qf.device).triu(1)
    state = c_carry = None                                                   # (B, r, d_v+1), (B,)
    for start in range(0, n, block):
        stop = min(start + block, n)
        pq, lq = features(qf[:, start:stop], "query")
        pk, lk = features(kf[:, start:stop], "key")
        vb = values(start, stop)
        c_rows = torch.cummax(lk, -1).values
        if c_carry is not None:
            c_rows = torch.maximum(c_rows, c_carry[:, None])
        logs[:, start:stop] = lq + c_rows
        length, pad = stop - start, -(stop - start) % size
        if pad:                                  # a last partial chunk: padded keys weigh exp(-inf) = 0
            pq, pk, vb = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (pq, pk, vb))
            lk = torch.nn.functional.pad(lk, (0, pad), value=float("-inf"))
            c_rows = torch.cat([c_rows, c_rows[:, -1:].expand(batch, pad)], -1)
        g, r = (length + pad) // size, pq.shape[-1]
        pq, pk, vb = pq.view(batch, g, size, r), pk.view(batch, g, size, r), vb.reshape(batch, g, size, -1)
        lk, c_rows = lk.view(batch, g, size), c_rows.view(batch, g, size)
        c_end = c_rows[..., -1]                                              # (B, g)
        first = c_end.new_full((batch, 1), float("-inf")) if c_carry is None else c_carry[:, None]
        c_before = torch.cat([first, c_end[:, :-1]], 1)                      # (B, g)
        log_w = (lk[..., None, :] - c_rows[..., :, None]).masked_fill(future, float("-inf"))
        out = ((pq @ pk.transpose(-1, -2)) * torch.exp(log_w)) @ vb          # intra-chunk, (B, g, C, d_v+1)
        summary = pk.transpose(-1, -2) @ (vb * torch.exp(lk - c_end[..., None])[..., None])   # (B, g, r, d_v+1)
        if g > 1 or state is not None:
            states, state = _chunk_states(summary, state, c_before, c_end)   # S_j: (B, g, r, d_v+1)
            out = out + (pq @ states) * torch.exp(c_before[..., None] - c_rows)[..., None]
        else:
            state = summary[:, -1]
        c_carry = c_end[:, -1]
        num_den[:, start:stop] = out.reshape(batch, g * size, -1)[:, :length]


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
    check_bool(return_parts, "return_parts")
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
    if mode == "chunked":
        num, den, logs = _chunked(q, k, v, estimator, causal, chunk_size)
    else:
        pq, lq, pk, lk = _stabilised_features(q, k, estimator)
        vc = v.to(pq.dtype)
        if mode == "parallel":
            num, den, logs = _parallel(pq, lq, pk, lk, vc, causal)
        else:
            num, den, logs = _recurrent(pq, lq, pk, lk, vc, causal)
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
        if not isinstance(estimator, FeatureMap) or isinstance(estimator, ExactKernel) or hasattr(estimator,
                                                                                                   "attention"):
            raise TypeError("estimator must be a fitted kernapprox feature map (not the exact kernel, nor an "
                            f"estimator without a feature map), got {type(estimator).__name__}")
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
