"""Linear attention: attention with a finite feature map, in three equivalent modes.

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

Stabilisation (all modes): features come as ``φ = φ̃ · exp(ℓ)`` (see :mod:`kernapprox.estimators.base`).
Query scales cancel in the ratio and are carried only in the returned log-scale. Non-causal: the key scales are
shifted by one constant per (batch, head), their maximum. Causal: query ``i`` is shifted by the running maximum
``c_i = max_{j≤i} ℓ(k_j)`` in every mode (the recurrent state is rescaled by ``exp(c_old − c_new)`` when the
maximum grows; the parallel and chunked modes apply the same per-row shift inside their blocks), so no ``exp``
overflows, no row loses all its keys to underflow because of a later, larger key, the streaming form never looks
ahead, and the three modes return the same numerator, normaliser and log-scale. Half-precision inputs are
computed in float32 and returned in the input dtype.
"""

from __future__ import annotations

import torch

from ..estimators.base import AttentionParts, Estimator
from ..validation import check_bool, check_choice, check_positive_int, check_qkv, compute_dtype
from .exact import softmax_attention
from .recurrent import state_read, state_update

MODES = ("parallel", "recurrent", "chunked")


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
        state = state_update(state, pk[..., t, :], lk[..., t], v[..., t, :])
        if causal:
            num, den = state_read(state, pq[..., t, :])
            nums.append(num)
            dens.append(den)
            scales.append(lq[..., t] + state[2])
    if not causal:
        w, z, c = state
        return pq @ w, pq @ z[..., None], lq + c[..., None]
    return torch.stack(nums, -2), torch.stack(dens, -1), torch.stack(scales, -1)


# Token blocks of the chunked mode hold about this many feature entries (all batch entries together). On a CPU a
# block's features stay in cache and the allocator recycles its temporaries; whole-sequence feature matrices of
# hundreds of MB made every element-wise pass a round trip to memory (and a fresh page-faulted allocation).
# A GPU wants large blocks for parallelism. Results do not depend on the block length beyond rounding.
_FEATURES_PER_BLOCK = {"cpu": 1 << 19, "cuda": 1 << 26}


def chunked_block_length(batch: int, r: int, chunk_size: int, n: int, device: torch.device) -> int:
    """Tokens per block of the chunked mode for ``batch`` sequences of ``n`` tokens and ``r`` features.

    A multiple of ``chunk_size`` holding about ``_FEATURES_PER_BLOCK[device.type]`` feature entries (all batch
    entries together), and never more than the sequence rounded up to a whole chunk. Memory accounts of the
    chunked mode (e.g. the ``modes`` experiment) use it to know what one block holds.
    """
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
    block = chunked_block_length(batch, estimator.num_features, chunk_size, max(n, n_k), q.device)
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


def linear_attention(q, k, v, estimator: Estimator, causal: bool = False, mode: str = "chunked", *,
                     chunk_size: int = 64, return_parts: bool = False):
    """Kernelised attention ``y_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)`` (``j ≤ i`` if causal).

    Parameters
    ----------
    q, k, v : Tensor ``(..., n, d)``, ``(..., n_k, d)``, ``(..., n_k, d_v)``
        Same dtype, device and batch dimensions.
    estimator : Estimator
        A fitted estimator, dispatched on its declared ``kind``: the exact kernel (``"exact"``) is routed to
        :func:`~kernapprox.attention.exact.softmax_attention`; estimators that bring their own attention
        (``"attention"``: hybrids, Nyströmformer, the rank-r references) are called; feature maps
        (``"features"``) run in the mode asked for.
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
    check_qkv(q, k, v, causal)
    check_choice(mode, "mode", MODES)
    check_positive_int(chunk_size, "chunk_size")
    check_bool(return_parts, "return_parts")
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator must be a kernapprox estimator, got {type(estimator).__name__}")
    estimator._check_fitted()
    if estimator.dim_ != q.shape[-1]:
        raise ValueError(f"q and k have d={q.shape[-1]} but the estimator was fitted with d={estimator.dim_}")
    caps = estimator.capabilities()
    if mode not in caps.modes:
        raise ValueError(f"mode {mode!r} is not supported by {type(estimator).__name__}; "
                         f"supported: {', '.join(caps.modes)}")
    if causal and not caps.causal:
        raise ValueError(f"{type(estimator).__name__} is not causal: it does not define causal attention "
                         "(use causal=False)")
    if caps.kind == "exact":
        out, lse = softmax_attention(q, k, v, causal, estimator.scale_, return_lse=True)
        if not return_parts:
            return out
        one = torch.ones_like(lse)
        return AttentionParts(out, out.to(lse.dtype), one, lse)
    if caps.kind == "attention":
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
