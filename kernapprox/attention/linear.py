"""Linear attention: attention with a finite feature map, in three equivalent modes, under four state rules.

``y(q) = Σ_i κ(q, k_i) v_i / Σ_i κ(q, k_i)``. With the exact kernel ``κ = exp(s qᵀk)`` this is softmax attention;
with a feature map ``κ ≈ φ(q)ᵀφ(k)`` it is linear attention, computed in one of three modes that agree to
floating-point tolerance:

``parallel`` (the "Transformer mode")
    materialise ``A = φ(Q) φ(K)ᵀ`` (masked if causal), then ``A V`` and ``A 1``. Quadratic; reference/small n.
``recurrent`` (the "RNN mode")
    scan the state ``W_t = W_{t-1} + φ(k_t) v_tᵀ``, ``z_t = z_{t-1} + φ(k_t)`` token by token and read
    ``y_t = W_tᵀ φ(q_t) / z_tᵀ φ(q_t)``; constant memory per step. :class:`RecurrentState` exposes the same
    step for decoding one token at a time.
``chunked`` (the fast mode)
    blockwise: exact masked products within a chunk, the running state across chunks. Float32 calls on a CPU
    without gradients run the compiled operators of :mod:`.native` (same results to rounding) when the backend
    dispatch takes them (:mod:`kernapprox.backends`, switch ``KERNAPPROX_NATIVE``): every causal call, and
    non-causal calls with a map of the exponential form (whose features the kernels then compute themselves,
    causal or not).

The state may be written by other rules than the sum (``rule=``, :mod:`kernapprox.rules`): a decayed sum
(:class:`~kernapprox.rules.Decay`), the delta rule (:class:`~kernapprox.rules.Delta`, :mod:`.delta`) and the
least-squares state (:class:`~kernapprox.rules.LeastSquares`, :mod:`.least_squares`), each in the three modes.

Stabilisation (sum and decay): features come as ``φ = φ̃ · exp(ℓ)`` (see :mod:`kernapprox.estimators.base`).
Query scales cancel in the ratio and are carried only in the returned log-scale. Non-causal: the key scales are
shifted by one constant per (batch, head), their maximum. Causal: query ``i`` is shifted by the running maximum
``c_i = max_{j≤i} ℓ(k_j) + (i − j) log γ`` (``γ = 1`` for the sum) in every mode (the recurrent state is rescaled
by ``exp(c_old + log γ − c_new)`` when the maximum grows; the parallel and chunked modes apply the same per-row
shift inside their blocks, with positions measured from the start of each chunk), so no ``exp`` overflows, no row
loses all its keys to underflow because of a later, larger key, the streaming form never looks ahead, and the
three modes return the same numerator, normaliser and log-scale. The delta and least-squares rules use unit
features ``φ̄ = φ̃/‖φ̃‖``, from which ``ℓ`` cancels exactly. Half-precision inputs are computed in float32 and
returned in the input dtype.
"""

from __future__ import annotations

import math

import torch

from .. import backends
from ..estimators.base import AttentionParts, Estimator
from ..rules import SENTINEL, NormalizedState, Sum, resolve_rule, to_public
from ..validation import check_bool, check_choice, check_positive_int, check_qkv, compute_dtype
from . import chunk_grad, logdomain
from . import delta as _delta
from . import least_squares as _ls
from . import native as _native
from .blocks import chunked_block_length
from .exact import softmax_attention
from .masks import (
    allowed_pairs,
    check_attn_mask,
    check_key_padding_mask,
    check_query_padding_mask,
    check_rows,
    mask_kwargs,
    zero_padded_rows,
)
from .recurrent import normalized_read, normalized_step

MODES = ("parallel", "recurrent", "chunked")


def _stabilised_features(q, k, estimator, padding=None):
    # q and k were checked for NaN/Inf by the caller: one scan each, not two
    pq, lq = estimator.features(q, "query", log_scale=True, check_finite=False)
    pk, lk = estimator.features(k, "key", log_scale=True, check_finite=False)
    ct = compute_dtype(q.dtype)
    pq, lq, pk, lk = pq.to(ct), lq.to(ct), pk.to(ct), lk.to(ct)
    if padding is not None:
        pk, lk = _mask_keys(pk, lk, padding)
    return pq, lq, pk, lk


def _mask_keys(pk, lk, padding):
    """Padded keys weigh nothing: zero features and the empty-state sentinel as log-scale (never a maximum)."""
    return pk.masked_fill(padding[..., None], 0.0), lk.masked_fill(padding, SENTINEL)


# ------------------------------------------------------------------------------------ normalised: parallel
def _normalized_parallel(pq, lq, pk, lk, v, causal, a, log_mask, state0, want_state):
    """Sum/decay rule, parallel mode: ``A_ij = φ̃(q_i)ᵀφ̃(k_j) e^{ℓ_j + (i−j) log γ + m_ij − c_i}``.

    ``c_i`` is the row's largest weight exponent (the running key maximum when causal, one constant per batch
    entry when non-causal and unmasked), including the initial state's ``c_0 + (i+1) log γ``. Returns
    ``(num, den, log_scale, final_state)``.
    """
    n_q, n_k = pq.shape[-2], pk.shape[-2]
    device, ct = pq.device, pq.dtype
    if not causal and a:                   # every query reads the state after the last key: weights γ^(n_k−1−j)
        lk = lk + torch.arange(n_k - 1, -1, -1, device=device, dtype=ct) * a
    logits = lk[..., None, :]
    per_row = causal or log_mask is not None
    if causal:
        i = torch.arange(n_q, device=device)[:, None]
        j = torch.arange(n_k, device=device)[None, :]
        lag = ((i - j).to(ct) * a) if a else torch.zeros((), dtype=ct, device=device)
        logits = logits + torch.where(j <= i, lag, torch.full((), -math.inf, dtype=ct, device=device))
    if log_mask is not None:
        logits = logits + log_mask
    logits = logits.expand(*lk.shape[:-1], n_q, n_k)
    if per_row:
        c = logits.amax(-1)                                           # (..., n_q)
    else:
        c = lk.amax(-1, keepdim=True).expand(*lk.shape[:-1], n_q)     # one shift per (batch, head)
    if state0 is not None:
        c0_rows = state0.log_scale[..., None]
        if causal and a:
            c0_rows = c0_rows + torch.arange(1, n_q + 1, device=device, dtype=ct) * a
        elif a:
            c0_rows = c0_rows + n_k * a
        c = torch.maximum(c, c0_rows.expand_as(c))
    a_mat = (pq @ pk.transpose(-1, -2)) * torch.exp(logits - c[..., None])
    num, den = a_mat @ v, a_mat.sum(-1)
    if state0 is not None:
        f = torch.exp(c0_rows - c)
        num = num + (pq @ state0.w) * f[..., None]
        den = den + (pq @ state0.z[..., None]).squeeze(-1) * f
    final = None
    if want_state:
        weight = lk                        # non-causal: already decayed to the last key
        if causal and a:
            weight = lk + torch.arange(n_k - 1, -1, -1, device=device, dtype=ct) * a
        c_fin = weight.amax(-1)
        if state0 is not None:
            c_fin = torch.maximum(c_fin, state0.log_scale + n_k * a)
        wk = torch.exp(weight - c_fin[..., None])
        w = pk.transpose(-1, -2) @ (v * wk[..., None])
        z = (pk * wk[..., None]).sum(-2)
        if state0 is not None:
            f0 = torch.exp(state0.log_scale + n_k * a - c_fin)
            w = w + state0.w * f0[..., None, None]
            z = z + state0.z * f0[..., None]
        final = NormalizedState(w, z, c_fin)
    return num, den, lq + c, final


# ----------------------------------------------------------------------------------- normalised: recurrent
def _normalized_recurrent(pq, lq, pk, lk, v, causal, a, state):
    nums, dens, scales = [], [], []
    for t in range(pk.shape[-2]):
        state = normalized_step(state, pk[..., t, :], lk[..., t], v[..., t, :], a)
        if causal:
            num, den = normalized_read(state, pq[..., t, :])
            nums.append(num)
            dens.append(den)
            scales.append(lq[..., t] + state.log_scale)
    if not causal:
        return pq @ state.w, pq @ state.z[..., None], lq + state.log_scale[..., None], state
    return torch.stack(nums, -2), torch.stack(dens, -1), torch.stack(scales, -1), state


# ------------------------------------------------------------------------------------- normalised: chunked
def _normalized_chunked(q, k, v, estimator, causal, chunk_size, a, padding, state0, want_num):
    """The chunked mode of the sum and decay rules, computed block by block: features of one block of tokens at a
    time (never of the whole sequence), and within a causal block every chunk at once.

    Numerator and normaliser come out of one product with ``[V 1]``; the state is kept transposed,
    ``Sᵀ = [V 1]ᵀ Φ̃_K`` of shape ``(d_v+1) × r``, so that neither product has a transposed feature operand. Causal,
    with positions ``p`` counted from each chunk's start and ``ℓ'_p = ℓ_p − p log γ`` (``= ℓ_p`` for the sum):

    - chunk scales: the state after chunk ``j`` has log-scale ``s_j = max(s_{j−1} + C log γ, σ_j)`` with
      ``σ_j = max_p ℓ'_p + (C−1) log γ`` (the chunk's own largest key, decayed to its end);
    - rows: ``c'_p = max(s_{j−1} + log γ, max_{l≤p} ℓ'_l)`` — the recurrent mode's shift ``c_t`` less ``p log γ``;
    - intra-chunk: ``A_pl = φ̃(q_p)ᵀφ̃(k_l) e^{ℓ'_l − c'_p}`` for ``l ≤ p``;
    - chunk summaries ``U_j = Σ_l e^{ℓ'_l + (C−1) log γ − s_j} φ̃(k_l) [v_l 1]ᵀ`` and states before each chunk
      ``S_{j} = S_{j−1} e^{s_{j−2} + C log γ − s_{j−1}} + U_{j−1}`` (every factor ≤ 1), a loop of fused
      multiply-adds or one batched product (:func:`_chunk_states`), without a Python loop over tokens;
    - rows read ``φ̃(q_p)ᵀ S_j e^{s_{j−1} + log γ − c'_p}``; the log-scale is ``ℓ(q_p) + c'_p + p log γ``.

    Non-causal: the key pass accumulates the state under a running maximum (rescaled by ``e^{c_old + L log γ −
    c_new}`` after a block of ``L`` keys), then the query pass reads the final state; the shift is the maximum over
    all (decayed) keys. Padded keys have zero features and the sentinel log-scale.

    Each block's rows are written as they are computed: with ``want_num`` the numerators, else the outputs
    ``num/den`` directly (in the input dtype, while the block is in cache); normalisers and log-scales always.
    Returns ``(num or None, den, log_scale, final_state, output or None)``.
    """
    ct = compute_dtype(q.dtype)
    batch_shape, (n, d), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    qf, kf = q.reshape(-1, n, d), k.reshape(-1, n_k, d)
    batch = qf.shape[0]
    vf = v.reshape(batch, n_k, d_v)
    padf = None if padding is None else padding.reshape(batch, n_k)
    block = chunked_block_length(batch, estimator.num_features, chunk_size, max(n, n_k), q.device)
    ones = torch.ones(batch, block, 1, dtype=ct, device=v.device)
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))

    def values(start, stop):                      # [V 1] of one block, built per block (a cache-sized copy)
        return torch.cat([vf[:, start:stop].to(ct), ones[:, :stop - start]], -1)

    ws = _Workspace(ct, q.device) if inplace else None
    r = estimator.num_features

    def features(x, role):
        buffer = None if ws is None else ws.get(role, (*x.shape[:-1], r))        # reused by every block
        pf, lf = estimator.features(x, role, log_scale=True, check_finite=False,  # x was checked by the caller
                                    buffer=buffer)
        return pf.to(ct), lf.to(ct)

    def key_features(start, stop):
        pk, lk = features(kf[:, start:stop], "key")
        if padf is not None:
            pk, lk = _mask_keys(pk, lk, padf[:, start:stop])
        return pk, lk

    state = c = None                                                     # state: (batch, d_v + 1, r)
    if state0 is not None:
        state = torch.cat([state0.w.reshape(batch, r, d_v), state0.z.reshape(batch, r, 1)], -1).transpose(-1, -2)
        c = state0.log_scale.reshape(batch)
    sink = _Rows(batch, n, d_v, ct, q.dtype, q.device, want_num)
    backend = backends.choose("linear_attention.chunked", device=q.device, dtype=ct, needs_grad=not inplace,
                              rule_ok=True, batch=batch, entries=batch * max(n, n_k) * r, causal=causal,
                              exponential=estimator.exponential_form(qf[:, :0], "query") is not None).backend
    if backend == "native-exp":
        forms = (estimator.exponential_form(qf, "query"), estimator.exponential_form(kf, "key"))
        state, c = _chunked_native(forms, vf, padf, a, sink, state, c, r, chunk_size if causal else None)
    elif backend == "native":
        state, c = _chunked_causal_native(qf, vf, features, key_features, chunk_size, block, a, sink, state, c, r)
    elif causal:
        state, c = _chunked_causal(qf, values, features, key_features, chunk_size, block, a, sink, state, c, ws)
    else:
        state, c = _chunked_noncausal(n, n_k, block, lambda start, stop: features(qf[:, start:stop], "query"),
                                      key_features, values, a, sink, state, c)
    final = NormalizedState(state[:, :d_v].transpose(-1, -2).reshape(*batch_shape, r, d_v),
                            state[:, d_v].reshape(*batch_shape, r), c.reshape(batch_shape))
    num, den, logs, out = sink.result(batch_shape)
    return num, den, logs, final, out


def _chunked_noncausal(n, n_k, block, query_features, key_features, values, a, sink, state, c):
    """Non-causal chunked mode (see :func:`_normalized_chunked`): the key pass accumulates the transposed state
    ``(batch, d_v+1, r)`` block by block under a running maximum, then the query pass reads the final state and
    writes the rows to ``sink``. ``query_features(start, stop)``, ``key_features(start, stop)`` and
    ``values(start, stop)`` give one block; returns the final (transposed) state and its log-scale."""
    for start in range(0, n_k, block):
        pk, lk = key_features(start, start + block)
        length = pk.shape[1]
        if a:                              # decayed to the block's last key; the carried state by γ^length
            lk = lk + torch.arange(length - 1, -1, -1, device=lk.device, dtype=lk.dtype) * a
            c = None if c is None else c + length * a
        c_new = lk.amax(-1) if c is None else torch.maximum(c, lk.amax(-1))
        weights = torch.exp(lk - c_new[:, None])[..., None]     # scale the d_v+1 columns, not the r features
        update = (values(start, start + length) * weights).transpose(-1, -2) @ pk        # (batch, d_v+1, r)
        state = update if state is None else torch.addcmul(update, state, torch.exp(c - c_new)[:, None, None])
        c = c_new
    for start in range(0, n, block):
        pq, lq = query_features(start, start + block)
        sink.write(start, pq @ state.transpose(-1, -2), lq + c[:, None])
    return state, c


class _Rows:
    """Where the chunked mode writes each block's rows: ``num/den`` (the output, in ``out_dtype``) or the numerator,
    and always the normaliser and the log-scale."""

    def __init__(self, batch, n, d_v, ct, out_dtype, device, want_num):
        self.den = torch.empty(batch, n, dtype=ct, device=device)
        self.logs = torch.empty(batch, n, dtype=ct, device=device)
        self.num = torch.empty(batch, n, d_v, dtype=ct, device=device) if want_num else None
        self.out = None if want_num else torch.empty(batch, n, d_v, dtype=out_dtype, device=device)

    def write(self, start, num_den, logs):
        """Rows ``start:start+L`` from ``num_den`` ``(batch, L, d_v+1)`` (numerators, then the normaliser)."""
        stop = start + num_den.shape[1]
        den = num_den[..., -1]
        self.den[:, start:stop] = den
        self.logs[:, start:stop] = logs
        if self.num is not None:
            self.num[:, start:stop] = num_den[..., :-1]
        else:
            self.out[:, start:stop] = num_den[..., :-1] / den[..., None]

    def result(self, batch_shape):
        n = self.den.shape[1]
        num = None if self.num is None else self.num.reshape(*batch_shape, n, -1)
        out = None if self.out is None else self.out.reshape(*batch_shape, n, -1)
        return num, self.den.reshape(*batch_shape, n), self.logs.reshape(*batch_shape, n), out


# Up to this many chunks per block (CPU-sized blocks) the chunk states are a loop of fused multiply-adds; beyond
# it (GPU-sized blocks) one batched product, whose tiny inner dimension makes it memory-bound on a CPU.
_SEQUENTIAL_CHUNKS = 16


def _chunk_scales(carry, sigma, da):
    """``s_j = max(s_{j−1} + da, σ_j)`` from ``s_{−1} = carry``: the log-scale of the state after each chunk.

    For the sum (``da = 0``) a running maximum; with decay ``s_j = j·da + max_{i≤j}(σ_i − i·da)`` (the carry as
    ``i = −1``). The values are stabilisers, used consistently for writing and reading each state, so the
    rounding of ``j·da`` does not change the result.
    """
    e = torch.cat([carry[:, None], sigma], 1)
    if not da:
        return torch.cummax(e, 1).values[:, 1:]
    lag = torch.arange(e.shape[1], device=e.device, dtype=e.dtype) * da
    return (torch.cummax(e - lag, 1).values + lag)[:, 1:]


def _chunk_states(summary, state, c_before, c_end, da, states=None, final=None):
    """States before each chunk of a block, and the state after the block (any layout of the state's two axes).

    ``S_0`` is the carried state (zero before the first block) and ``S_{j+1} = S_j e^{c⁻_j + da − c⁺_j} + U_j``:
    the recurrence at chunk granularity (``da = C log γ``), every factor ≤ 1. With many chunks the same sums come
    from one product with the weights ``e^{c⁺_i + (j−1−i) da − c⁻_j}`` (``i < j``) and ``e^{c⁻_0 + j da − c⁻_j}``
    for the carried state. ``states`` and ``final`` are optional output buffers (no gradient): shaped like
    ``summary`` and like one of its chunks.
    """
    g = c_end.shape[1]
    decay = torch.exp(c_before + da - c_end)[..., None, None]                # (B, g, 1, 1)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (summary, state, c_before, c_end))
    if g <= _SEQUENTIAL_CHUNKS and needs_grad:                               # out= is not differentiable
        rows = [torch.zeros_like(summary[:, 0]) if state is None else state]
        for j in range(g - 1):
            rows.append(torch.addcmul(summary[:, j], rows[-1], decay[:, j]))
        states = torch.stack(rows, 1)
    elif g <= _SEQUENTIAL_CHUNKS:
        states = torch.empty_like(summary) if states is None else states
        if state is None:
            states[:, 0] = 0
        else:
            states[:, 0] = state
        for j in range(g - 1):
            torch.addcmul(summary[:, j], states[:, j], decay[:, j], out=states[:, j + 1])
    else:
        idx = torch.arange(g, device=c_end.device)
        earlier = idx[:, None] > idx[None, :]
        exponent = c_end[:, None, :] - c_before[:, :, None]
        if da:
            exponent = exponent + ((idx[:, None] - 1 - idx[None, :]).to(c_end.dtype) * da)
        weights = torch.exp(exponent.masked_fill(~earlier, float("-inf")))
        stacked = summary
        if state is not None:                                                # the carried state as chunk "-1"
            carried = c_before[:, :1] - c_before
            if da:
                carried = carried + idx.to(c_end.dtype) * da
            weights = torch.cat([torch.exp(carried)[..., None], weights], -1)
            stacked = torch.cat([state[:, None], summary], 1)
        states = (weights @ stacked.flatten(-2)).view(summary.shape)
    if final is None or needs_grad:
        return states, torch.addcmul(summary[:, -1], states[:, -1], decay[:, -1])
    return states, torch.addcmul(summary[:, -1], states[:, -1], decay[:, -1], out=final)


class _Workspace:
    """Buffers of the causal chunked mode, allocated once per call and reused by every block (no gradient):
    fresh allocations of a few MB per block cost page faults and cache misses. ``get(name, shape)`` is a contiguous
    view of the first ``prod(shape)`` entries of the buffer ``name`` (sized by its first request)."""

    def __init__(self, dtype, device):
        self.dtype, self.device, self.buffers = dtype, device, {}

    def get(self, name, shape):
        size = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self.buffers[name] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[:size].view(shape)


def _chunked_causal(qf, values, features, key_features, chunk_size, block, a, sink, state, c_carry, ws):
    """Causal chunked mode over blocks of ``block`` tokens (see :func:`_normalized_chunked`); writes the rows to
    ``sink``; returns the final (transposed) state and its log-scale. ``ws``: the call's :class:`_Workspace` when
    no gradient is needed (the products write into buffers reused by every block), else None."""
    batch, n = qf.shape[:2]
    size = chunk_size
    ct = sink.den.dtype
    future = torch.ones(size, size, dtype=torch.bool, device=qf.device).triu(1)
    pos_a = torch.arange(size, device=qf.device, dtype=ct) * a if a else None
    if c_carry is None:
        c_carry = torch.full((batch,), SENTINEL, dtype=ct, device=qf.device)
    pad = 0
    for index, start in enumerate(range(0, n, block)):
        stop = min(start + block, n)
        pq, lq = features(qf[:, start:stop], "query")
        pk, lk = key_features(start, stop)
        vb = values(start, stop)
        length, pad = stop - start, -(stop - start) % size
        if pad:                                  # a last partial chunk: padded keys weigh nothing
            pq, pk, vb = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (pq, pk, vb))
            lq = torch.nn.functional.pad(lq, (0, pad))
            lk = torch.nn.functional.pad(lk, (0, pad), value=SENTINEL)
        g, r, dv1 = (length + pad) // size, pq.shape[-1], vb.shape[-1]
        pq, pk, vb = pq.view(batch, g, size, r), pk.view(batch, g, size, r), vb.reshape(batch, g, size, dv1)
        lk, lq = lk.view(batch, g, size), lq.view(batch, g, size)
        if a:
            lk = lk - pos_a                                                  # ℓ'_p = ℓ_p − p log γ
        local = torch.cummax(lk, -1).values                                  # (B, g, C)
        c_end = _chunk_scales(c_carry, local[..., -1] + (size - 1) * a, size * a)   # (B, g)
        c_before = torch.cat([c_carry[:, None], c_end[:, :-1]], 1)           # (B, g)
        c_rows = torch.maximum(local, (c_before + a)[..., None])            # (B, g, C)
        row_logs = lq + c_rows if not a else lq + c_rows + pos_a
        key_w = torch.exp(lk - c_end[..., None] if not a else lk + (size - 1) * a - c_end[..., None])[..., None]
        # intra-chunk weights e^{ℓ'_l − c'_p}: exponents ≤ 0 where l ≤ p; the future ones are clamped (no overflow,
        # no exp of -inf, which is slow) and then zeroed
        exponent = lk[..., None, :] - c_rows[..., :, None]
        bg = batch * g
        if ws is None:
            scores = (pq @ pk.transpose(-1, -2)) * torch.exp(torch.clamp_max(exponent, 0.0))
            out = scores.masked_fill(future, 0.0) @ vb                       # intra-chunk, (B, g, C, d_v+1)
            summary = (vb * key_w).transpose(-1, -2) @ pk                    # (B, g, d_v+1, r)
        else:
            weights = torch.clamp_max(exponent, 0.0, out=ws.get("weights", exponent.shape)).exp_()
            # reshape, not view: the features of a map behind a projection may come as a strided view of heads
            scores = torch.bmm(pq.reshape(bg, size, r), pk.reshape(bg, size, r).transpose(-1, -2),
                               out=ws.get("scores", (bg, size, size))).view(weights.shape)
            scores.mul_(weights).masked_fill_(future, 0.0)
            out = torch.bmm(scores.view(bg, size, size), vb.reshape(bg, size, dv1),
                            out=ws.get("out", (bg, size, dv1))).view(batch, g, size, dv1)
            weighted = torch.mul(vb, key_w, out=ws.get("weighted", vb.shape))
            summary = torch.bmm(weighted.view(bg, size, dv1).transpose(-1, -2), pk.reshape(bg, size, r),
                                out=ws.get("summary", (bg, dv1, r))).view(batch, g, dv1, r)
        if g > 1 or state is not None:
            one = (batch, dv1, r)                     # the carried state: two buffers, alternately written
            buffers = {} if ws is None else {"states": ws.get("states", summary.shape),
                                             "final": ws.get(f"final{index % 2}", one)}
            states, state = _chunk_states(summary, state, c_before, c_end, size * a, **buffers)   # S_jᵀ
            factor = torch.exp(c_before[..., None] + a - c_rows)[..., None]
            if ws is None:
                out = torch.addcmul(out, pq @ states.transpose(-1, -2), factor)
            else:
                read = torch.bmm(pq.reshape(bg, size, r), states.view(bg, dv1, r).transpose(-1, -2),
                                 out=ws.get("read", (bg, size, dv1))).view(out.shape)
                out.addcmul_(read, factor)
        else:
            state = summary[:, -1].clone() if ws is not None else summary[:, -1]
        c_carry = c_end[:, -1]
        sink.write(start, out.reshape(batch, g * size, -1)[:, :length], row_logs.reshape(batch, -1)[:, :length])
    if pad and a:        # the last chunk was padded: its scale was decayed to the padded end, not to token n−1
        c_carry = c_carry - pad * a
    return state, c_carry


# The eager code's backends of the chunked mode (the compiled operators register theirs in .native).
backends.register(backends.Backend(
    "cuda", "linear_attention.chunked", 10,
    lambda *, device, **_: (device.type == "cuda", "torch's CUDA kernels (the eager code on the GPU)"
                            if device.type == "cuda" else f"on {device.type}"),
    None, "the eager code on a CUDA device"))
backends.register(backends.Backend("eager", "linear_attention.chunked", 0, lambda **_: (True, "the eager code"),
                                   None, "the eager code: any device, dtype and rule, with autograd"))
backends.register(backends.Backend(
    "chunk-backward", "linear_attention.gradient", 10,
    lambda **_: ((True, "the written-out chunked backward") if backends.get_mode("backward") == "on"
                 else (False, "KERNAPPROX_BACKWARD=off")),
    "backward", "the sum rule's chunked backward written out (kernapprox.attention.chunk_grad)"))
backends.register(backends.Backend("autograd", "linear_attention.gradient", 0,
                                   lambda **_: (True, "autograd through the eager code"), None,
                                   "autograd through the eager chunked code (any rule)"))


def _kernel_state(state, c_carry, sink, d_v, r):
    """The transposed state ``(batch, d_v+1, r)`` and its log-scale as the kernels advance them in place: fresh
    (zeros, the empty-state sentinel) or contiguous copies, never the caller's tensors."""
    batch, ct, device = sink.den.shape[0], sink.den.dtype, sink.den.device
    state = (torch.zeros(batch, d_v + 1, r, dtype=ct, device=device) if state is None
             else state.to(dtype=ct, memory_format=torch.contiguous_format, copy=True))
    c_carry = (torch.full((batch,), SENTINEL, dtype=ct, device=device) if c_carry is None
               else c_carry.to(dtype=ct, copy=True))
    return state, c_carry


def _chunked_causal_native(qf, vf, features, key_features, chunk_size, block, a, sink, state, c_carry, r):
    """:func:`_chunked_causal` by the compiled kernel (:mod:`.native`): features per token block as there, then one
    kernel call per block that runs its chunks one after the other with the state in cache and writes the rows
    into ``sink``. Float32, no gradient; returns the final (transposed) state and its log-scale."""
    n = qf.shape[1]
    out = sink.num if sink.num is not None else sink.out
    values = vf if vf.stride(-1) == 1 else vf.contiguous()
    state, c_carry = _kernel_state(state, c_carry, sink, vf.shape[-1], r)
    for start in range(0, n, block):
        stop = min(start + block, n)
        pq, lq = features(qf[:, start:stop], "query")
        pk, lk = key_features(start, stop)
        _native.chunk_block(pq.contiguous(), lq.contiguous(), pk.contiguous(), lk.contiguous(),
                            values[:, start:stop], state, c_carry, out[:, start:stop], sink.den[:, start:stop],
                            sink.logs[:, start:stop], chunk_size, a, want_num=sink.num is not None)
    return state, c_carry


def _chunked_native(forms, vf, padf, a, sink, state, c_carry, r, chunk_size=None):
    """The chunked mode by the compiled operator that computes the features itself from the map's exponential
    forms ``(query, key)`` (:meth:`~kernapprox.estimators.base.FeatureMap.exponential_form`): non-causal
    (:func:`.native.noncausal`) or, given ``chunk_size``, causal (:func:`.native.causal_exp`). Float32, no
    gradient; returns the final (transposed) state and its log-scale."""
    state, c_carry = _kernel_state(state, c_carry, sink, vf.shape[-1], r)
    out = sink.num if sink.num is not None else sink.out
    if chunk_size is None:
        _native.noncausal(forms, vf, padf, state, c_carry, out, sink.den, sink.logs, a,
                          want_num=sink.num is not None)
    else:
        _native.causal_exp(forms, vf, padf, state, c_carry, out, sink.den, sink.logs, chunk_size, a,
                           want_num=sink.num is not None)
    return state, c_carry


# ---------------------------------------------------------------------------------------------- entry point
def linear_attention(q, k, v, estimator: Estimator, causal: bool = False, mode: str = "chunked", *,
                     chunk_size: int = 64, return_parts: bool = False, rule="sum", key_padding_mask=None,
                     attn_mask=None, initial_state=None, return_state: bool = False, query_padding_mask=None):
    """Kernelised attention ``y_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)`` (``j ≤ i`` if causal), or the
    read-out of another state rule.

    Parameters
    ----------
    q, k, v : Tensor ``(..., n, d)``, ``(..., n_k, d)``, ``(..., n_k, d_v)``
        Same dtype, device and batch dimensions.
    estimator : Estimator
        A fitted estimator, dispatched on its declared ``kind``: the exact kernel (``"exact"``) is routed to
        :func:`~kernapprox.attention.exact.softmax_attention`; estimators that bring their own attention
        (``"attention"``: hybrids, Nyströmformer, the rank-r references) are called; feature maps
        (``"features"``) run in the mode asked for, under any rule their ``capabilities().rules`` declare.
    causal : bool
    mode : {"parallel", "recurrent", "chunked"}
    chunk_size : int
        Chunk length of the chunked mode.
    return_parts : bool
        Return :class:`AttentionParts` (output, numerator, normaliser, log-scale) instead of the output. Rules
        without a normaliser (delta, least squares) return the output as numerator, normaliser 1, log-scale 0.
    rule : str or rule object
        How the state is written (:mod:`kernapprox.rules`): ``"sum"`` (default), ``Decay(gamma)``,
        ``Delta(beta)``, ``LeastSquares(ridge)`` (or the names ``"delta"``, ``"least_squares"`` with β = 1, λ = 1).
        Non-causal, every query reads the state after the last key (for the order-dependent decay and delta
        rules, the newest keys weigh most).
    key_padding_mask : bool Tensor ``(..., n_k)``, optional
        ``nn.MultiheadAttention``'s convention: True = the key is padding and no query reads it (it adds nothing
        to the state; the decay still counts its position). Broadcast by torch's rules against the batch
        dimensions, aligned from the right: for ``(B, H, n, d)`` inputs pass ``(B, 1, n_k)``. Every mode; an
        estimator with its own attention takes it where it declares ``key_padding`` (the hybrids), else raises.
    attn_mask : Tensor broadcastable to ``(..., n_q, n_k)``, optional
        SDPA's convention: bool with True = the pair takes part, or float additive (the inputs' dtype; ``−inf``
        removes a pair) — parallel mode only, where query ``i`` reads the state built from the keys its row
        allows (in order, for the delta rule). The sum and decay rules take both kinds; the delta and
        least-squares rules take bool masks only (their states are not weighted sums of kernel values, so an
        additive logit has no meaning for them). Combined with ``causal`` and ``key_padding_mask`` by "and".
    initial_state : state tuple, optional
        Start from a state (e.g. returned by an earlier call with ``return_state=True``): the
        :class:`~kernapprox.rules.NormalizedState` (sum, decay), :class:`~kernapprox.rules.DeltaState` or
        :class:`~kernapprox.rules.LeastSquaresState`, shapes for the inputs' batch dimensions, in the compute
        dtype (float32 for half inputs). Its keys come before this call's (decay: one position before the first).
    return_state : bool
        Also return the state after the last key: ``(output or parts, state)``. Not with an ``attn_mask`` (a
        per-query key selection has no single final state).
    query_padding_mask : bool Tensor ``(..., n_q)``, optional
        True = the query is padding (the filler positions of a left- or right-padded batch): its output row is 0
        (parts: numerator 0, normaliser 1, log-scale 0), it needs no key to attend to (a left-padded causal row
        sees only padded keys), and no gradient flows through it. Broadcast like ``key_padding_mask``. Every mode,
        rule and estimator kind. The state is unaffected: pass the same positions in ``key_padding_mask`` to keep
        their keys out of it.

    The normaliser may be ≤ 0 for signed features (trigonometric, Maclaurin, Nyström); the output is then
    ±inf or has the wrong sign, which :func:`kernapprox.metrics.nonpositive_normalizer_rate` measures. Nothing
    is clipped. A query that sees no key (masked, and no initial state) raises ``ValueError``.

    Examples
    --------
    >>> import torch, kernapprox as ka
    >>> gen = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    >>> est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
    >>> rule = ka.rules.Delta(0.5)
    >>> y, state = ka.linear_attention(q[:, :30], k[:, :30], v[:, :30], est, causal=True, rule=rule,
    ...                                return_state=True)                        # prefill
    >>> dec = ka.RecurrentState(est, rule=rule, initial_state=state)
    >>> y_next = dec.step(q[:, 30], k[:, 30], v[:, 30])                           # decode
    >>> y_all = ka.linear_attention(q, k, v, est, causal=True, rule=rule)
    >>> bool(torch.allclose(y_next, y_all[:, 30], atol=1e-12))
    True
    """
    check_qkv(q, k, v, causal)
    check_choice(mode, "mode", MODES)
    check_positive_int(chunk_size, "chunk_size")
    check_bool(return_parts, "return_parts")
    check_bool(return_state, "return_state")
    rule = resolve_rule(rule)
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator must be a kernapprox estimator, got {type(estimator).__name__}")
    estimator._check_fitted()
    if estimator.dim_ != q.shape[-1]:
        raise ValueError(f"q and k have d={q.shape[-1]} but the estimator was fitted with d={estimator.dim_}")
    caps = estimator.capabilities()
    name = type(estimator).__name__
    if mode not in caps.modes:
        raise ValueError(f"mode {mode!r} is not supported by {name}; supported: {', '.join(caps.modes)}")
    if causal and not caps.causal:
        raise ValueError(f"{name} is not causal: it does not define causal attention (use causal=False)")
    if rule.name not in caps.rules:
        raise ValueError(f"rule {rule.name!r} is not supported by {name}; supported: {', '.join(caps.rules)} "
                         "(state rules need a finite feature map)")
    if not causal and not rule.noncausal:
        raise ValueError(f"the {rule.name} rule is causal only (its weights γ^(i−j) are defined for keys before the "
                         "query): use causal=True")
    padding = check_key_padding_mask(key_padding_mask, k)
    qpad = check_query_padding_mask(query_padding_mask, q)
    mask = check_attn_mask(attn_mask, q, k)
    if mask is not None and mode != "parallel":
        raise ValueError(f"attn_mask is honoured in the parallel mode only: the {mode} mode builds one state per "
                         "position from every earlier key, so it cannot leave out arbitrary keys for some queries; use "
                         "key_padding_mask (drops keys for every query) or mode='parallel'")
    if mask is not None and return_state:
        raise ValueError("return_state=True with an attn_mask: the mask selects keys per query, so there is no "
                         "single final state (use key_padding_mask to drop keys for every query)")
    if mask is not None and mask.dtype != torch.bool and not rule.normalized:
        raise ValueError(f"the {rule.name} rule takes a bool attn_mask only: its state is not a weighted sum of "
                         "kernel values, so an additive (float) mask has no meaning for it")
    if caps.kind != "features":
        if initial_state is not None or return_state:
            raise ValueError(f"{name} has no linear state to start from or return (initial_state/return_state "
                             "need a finite feature map)")
        if caps.kind == "exact":
            out, lse = softmax_attention(q, k, v, causal, estimator.scale_, return_lse=True,
                                         **mask_kwargs(key_padding_mask, attn_mask, query_padding_mask))
            if not return_parts:
                return out
            one = torch.ones_like(lse)
            return AttentionParts(out, out.to(lse.dtype), one, lse)
        if mask is not None or (padding is not None and not caps.key_padding):
            raise ValueError(f"{name} brings its own attention, which takes no "
                             f"{'attn_mask' if caps.key_padding else 'key_padding_mask or attn_mask'}")
        extra = mask_kwargs(key_padding_mask, query_padding_mask=query_padding_mask) if caps.key_padding else {}
        result = estimator.attention(q, k, v, causal=causal, mode=mode, chunk_size=chunk_size,
                                     return_parts=return_parts, **extra)
        if qpad is None or caps.key_padding:          # an estimator that takes the masks gives padded rows 0 itself
            return result
        if not return_parts:                     # every row saw keys (no key mask): only the padded rows are zeroed
            return result.masked_fill(qpad[..., None], 0.0)
        num, den, logs = zero_padded_rows(result.numerator, result.normalizer, result.log_scale, qpad)
        return AttentionParts(result.output.masked_fill(qpad[..., None], 0.0), num, den, logs)

    ct = compute_dtype(q.dtype)
    r = estimator.num_features
    state0 = None
    if initial_state is not None:
        state0 = rule.check_state(initial_state, q.shape[:-2], r, v.shape[-1], ct, q.device, "initial_state")
    allowed = None
    if mask is not None:
        allowed = allowed_pairs(mask, padding, causal, q.shape[-2], k.shape[-2], q.device)
    if state0 is None:
        nonempty = None                                  # no initial state: rows need keys of their own
    elif rule.normalized:
        nonempty = state0.log_scale >= SENTINEL / 2      # per entry: has the initial state absorbed a key?
    else:
        nonempty = True                                  # a regression state always has a read-out
    check_rows(causal=causal, key_padding=padding, allowed=allowed, state_nonempty=nonempty, n_q=q.shape[-2],
               exempt=qpad)

    if rule.normalized and mode == "chunked" and not rule.log_decay and state0 is None and not return_state \
            and not return_parts and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        n_rows = q.shape[:-2].numel()
        choice = backends.choose("linear_attention.gradient", causal=causal, device=q.device, dtype=ct,
                                 batch=n_rows, entries=n_rows * max(q.shape[-2], k.shape[-2]) * r,
                                 padding=padding is not None,
                                 form=estimator.exponential_form(q[..., :0, :].to(ct), "query")).backend
        if choice in ("chunk-backward", "native-backward", "native-backward-exp"):
            out, den, logs = _chunked_with_gradient(q, k, v, estimator, causal, chunk_size, padding,
                                                    native=_NATIVE_FEATURES.get(choice))
            if qpad is not None:
                out = out.masked_fill(qpad[..., None], 0.0)
                den, logs = den.masked_fill(qpad, 1.0), logs.masked_fill(qpad, 0.0)
            if not logdomain.needs_recompute(estimator, den, logs):
                return out.to(q.dtype)
            # rows in doubt: the general path below recomputes them (float64, then exact)

    if rule.normalized:
        # padded query rows: the numerator comes back undivided (their rows may be 0/0) and is set to (0, 1, 0)
        num, den, logs, final, out = _normalized(q, k, v, estimator, causal, mode, chunk_size, rule.log_decay,
                                                 padding, mask, state0, return_state,
                                                 return_parts or qpad is not None)
        rows = (*q.shape[:-2], q.shape[-2])
        den = den.reshape(rows)
        logs = logs.reshape(rows)
        if qpad is not None:
            num, den, logs = zero_padded_rows(num, den, logs, qpad)
            out = None
        if logdomain.needs_recompute(estimator, den, logs):   # precision hook (see logdomain): float64, then exact
            extra = {} if qpad is None else {"query_padding_mask": query_padding_mask}
            _, num, den, logs = logdomain.recompute(
                q, k, v, estimator, causal, linear_attention, rule=rule, initial_state=initial_state,
                return_state=return_state, mode=mode, chunk_size=chunk_size, key_padding_mask=key_padding_mask,
                attn_mask=attn_mask, **extra)
            num, den, logs = zero_padded_rows(num, den, logs, qpad)
            out = None
        if out is None:                                # the chunked mode divides block by block when it can
            out = (num / den[..., None]).to(q.dtype)
        result = AttentionParts(out, num, den, logs) if return_parts else out
    else:
        if rule.name == "least_squares":          # the keys of an initial state count too
            rule.check_precision(k.shape[-2] + (rule.keys_in(state0) if state0 is not None else 0.0), ct)
        module = _delta if rule.name == "delta" else _ls
        y, final = module.attention(q, k, v, estimator, rule, causal, mode, chunk_size, padding, allowed, state0,
                                    return_state)
        if not bool(torch.isfinite(y).all()):
            hint = " (use a larger ridge, or float64)" if rule.name == "least_squares" else ""
            raise ValueError(f"the {rule.name} rule gave non-finite outputs in {ct}: the state lost its numerical "
                             f"range{hint}")
        if qpad is not None:
            y = y.masked_fill(qpad[..., None], 0.0)
        out = y.to(q.dtype)
        if return_parts:
            result = AttentionParts(out, y, torch.ones_like(y[..., 0]), torch.zeros_like(y[..., 0]))
        else:
            result = out
    if return_state:
        return result, to_public(final)
    return result


# how the compiled backends of "linear_attention.gradient" compute the features (_chunked_with_gradient's native)
_NATIVE_FEATURES = {"native-backward": "torch", "native-backward-exp": "exp"}


def _chunked_with_gradient(q, k, v, estimator, causal, chunk_size, padding, native=None):
    """The sum rule's chunked output with the written-out backward: the features of the whole sequence (autograd
    takes their gradient to ``q`` and ``k``), then :class:`.chunk_grad.ChunkedSum` (eager chunks) or, with
    ``native`` (causal, float32, no padded keys), :class:`.native.CausalSum` (the compiled forward and backward).
    ``native="torch"``: the map's features by torch (any map); ``"exp"``: features, attention and the whole
    backward by the compiled operators (:func:`.native.exp_causal`; maps of the exponential form with
    ``eps = 0``). Returns ``(output, normaliser, log-scale)`` in the compute dtype."""
    if native == "exp":
        ct = compute_dtype(q.dtype)
        forms = (estimator.exponential_form(q.to(ct), "query"), estimator.exponential_form(k.to(ct), "key"))
        y, den, c, lq = _native.exp_causal(forms, v.to(ct), chunk_size)
        return y, den, lq + c
    pq, lq, pk, lk = _stabilised_features(q, k, estimator, padding)
    batch_shape, n, n_k = q.shape[:-2], q.shape[-2], k.shape[-2]
    r, d_v = pq.shape[-1], v.shape[-1]
    rows = (*batch_shape, n)
    if native:
        y, den, c = _native.CausalSum.apply(pq.reshape(-1, n, r), pk.reshape(-1, n_k, r), lk.reshape(-1, n_k),
                                            v.to(pq.dtype).reshape(-1, n_k, d_v), chunk_size)
        return y.reshape(*rows, d_v), den.reshape(rows), lq + c.reshape(rows)

    def forward(pq, pk, lk, v):
        zeros = torch.zeros(pq.shape[:-1], dtype=pq.dtype, device=pq.device)      # ℓ_q = 0: the log-scale is c
        num, den, c, _ = _chunked_from_features(pq, zeros, pk, lk, v, causal, chunk_size, 0.0, None)
        return num, den, c

    y, den, c = chunk_grad.ChunkedSum.apply(pq.reshape(-1, n, r), pk.reshape(-1, n_k, r), lk.reshape(-1, n_k),
                                            v.to(pq.dtype).reshape(-1, n_k, d_v), causal, chunk_size, forward)
    return y.reshape(*rows, d_v), den.reshape(rows), lq + c.reshape(rows)


def _normalized(q, k, v, estimator, causal, mode, chunk_size, a, padding, mask, state0, want_state, want_num):
    """``(num, den, log_scale, final_state, output)``: the output only where the mode computed it (else None, and
    the numerator is returned); the chunked mode returns the numerator only when ``want_num``."""
    if mode == "chunked":
        return _normalized_chunked(q, k, v, estimator, causal, chunk_size, a, padding, state0, want_num)
    pq, lq, pk, lk = _stabilised_features(q, k, estimator, padding)
    vc = v.to(pq.dtype)
    if mode == "parallel":
        log_mask = None
        if mask is not None:
            log_mask = (mask.to(pq.dtype) if mask.dtype != torch.bool
                        else torch.zeros(mask.shape, dtype=pq.dtype, device=pq.device).masked_fill(~mask, -math.inf))
        return (*_normalized_parallel(pq, lq, pk, lk, vc, causal, a, log_mask, state0, want_state), None)
    if state0 is None:
        state0 = Sum().empty_state(pk.shape[:-2], pk.shape[-1], vc.shape[-1], pq.dtype, pq.device)
    return (*_normalized_recurrent(pq, lq, pk, lk, vc, causal, a, state0), None)


# ------------------------------------------------------------------------------ the core on given features
def linear_attention_from_features(pq, lq, pk, lk, v, *, causal: bool = False, mode: str = "parallel",
                                   chunk_size: int = 64, rule="sum", key_padding_mask=None, attn_mask=None,
                                   initial_state=None, return_state: bool = False, query_padding_mask=None):
    r"""Linear attention of given stabilised features, under the sum or decay rule: the core that
    :func:`linear_attention` runs for a feature map, for estimators that make their features themselves.

    With ``φ(q_i) = φ̃_q,i e^{ℓ_q,i}`` and ``φ(k_j) = φ̃_k,j e^{ℓ_k,j}`` (one log-scale per token),

    .. math::
        y_i = \frac{\sum_{j} w_{ij}\, φ(q_i)^⊤φ(k_j)\, v_j}{\sum_{j} w_{ij}\, φ(q_i)^⊤φ(k_j)},\qquad
        w_{ij} = γ^{i−j} e^{m_{ij}}\ (j ≤ i \text{ if causal})

    (``γ = 1`` for the sum; non-causal, every query at the last key's position), computed in the parallel,
    recurrent or chunked mode with the stabiliser of :mod:`.linear` (each row shifted by its largest key exponent,
    a running maximum when causal), so nothing overflows. The modes agree to rounding and match
    :func:`~kernapprox.attention.naive.linear_attention_naive` on the same features; gradients flow through every
    mode.

    Parameters
    ----------
    pq, lq : Tensor ``(..., n, r)``, ``(..., n)``
        Query features ``φ̃`` and their log-scales ``ℓ`` (a floating dtype; every tensor in it, on one device).
    pk, lk : Tensor ``(..., n_k, r)``, ``(..., n_k)``
        Key features and log-scales.
    v : Tensor ``(..., n_k, d_v)``
    causal, mode, chunk_size, rule, key_padding_mask, attn_mask, initial_state, return_state, query_padding_mask
        As in :func:`linear_attention` (``rule``: ``"sum"`` or a :class:`~kernapprox.rules.Decay`; the delta and
        least-squares rules need unit features of a feature map: use :func:`linear_attention`).

    Returns
    -------
    AttentionParts
        Output, numerator, normaliser and log-scale (true values ``numerator · e^{log_scale}``), in the features'
        dtype; with ``return_state`` also the :class:`~kernapprox.rules.NormalizedState` after the last key.
        Unlike :func:`linear_attention`, nothing is recomputed in float64 where a normaliser underflows: the caller
        owns the features' precision.

    Examples
    --------
    >>> import torch, kernapprox as ka
    >>> gen = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 20, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    >>> est = ka.make_estimator("positive", num_features=16, rng=0).fit(q, k)
    >>> (pq, lq), (pk, lk) = est.features(q, "query", log_scale=True), est.features(k, "key", log_scale=True)
    >>> parts = ka.attention.linear_attention_from_features(pq, lq, pk, lk, v, causal=True, mode="chunked",
    ...                                                     chunk_size=8)
    >>> bool(torch.allclose(parts.output, ka.linear_attention(q, k, v, est, causal=True), atol=1e-12))
    True
    """
    check_choice(mode, "mode", MODES)
    check_positive_int(chunk_size, "chunk_size")
    check_bool(causal, "causal")
    check_bool(return_state, "return_state")
    rule = resolve_rule(rule)
    if not rule.normalized:
        raise ValueError(f"the {rule.name} rule works on the unit features of a feature map: use "
                         "kernapprox.linear_attention with the estimator (this entry point takes sum and decay)")
    if not causal and not rule.noncausal:
        raise ValueError(f"the {rule.name} rule is causal only: use causal=True")
    names = ("pq", "lq", "pk", "lk", "v")
    tensors = (pq, lq, pk, lk, v)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dtype != pq.dtype or t.device != pq.device:
            raise TypeError(f"{name} has dtype {t.dtype} on {t.device}, pq {pq.dtype} on {pq.device}: cast explicitly")
    if pq.dim() < 2 or pk.dim() != pq.dim() or v.dim() != pq.dim():
        raise ValueError(f"pq, pk and v must have the same number (≥ 2) of dimensions, got {pq.dim()}, {pk.dim()}, "
                         f"{v.dim()}")
    batch_shape, (n, r), n_k = pq.shape[:-2], pq.shape[-2:], pk.shape[-2]
    if (pk.shape[:-2] != batch_shape or v.shape[:-2] != batch_shape or pk.shape[-1] != r or v.shape[-2] != n_k
            or lq.shape != pq.shape[:-1] or lk.shape != pk.shape[:-1]):
        raise ValueError(f"shapes do not fit: pq {tuple(pq.shape)}, lq {tuple(lq.shape)}, pk {tuple(pk.shape)}, "
                         f"lk {tuple(lk.shape)}, v {tuple(v.shape)} (want (..., n, r), (..., n), (..., n_k, r), "
                         "(..., n_k), (..., n_k, d_v))")
    if causal and n != n_k:
        raise ValueError(f"causal attention needs as many queries as keys, got {n} and {n_k}")
    padding = check_key_padding_mask(key_padding_mask, pk)
    qpad = check_query_padding_mask(query_padding_mask, pq)
    mask = check_attn_mask(attn_mask, pq, pk)
    if mask is not None and mode != "parallel":
        raise ValueError(f"attn_mask is honoured in the parallel mode only, not the {mode} mode")
    if mask is not None and return_state:
        raise ValueError("return_state=True with an attn_mask: the mask selects keys per query, so there is no "
                         "single final state")
    state0 = None
    if initial_state is not None:
        state0 = rule.check_state(initial_state, batch_shape, r, v.shape[-1], pq.dtype, pq.device, "initial_state")
    allowed = None if mask is None else allowed_pairs(mask, padding, causal, n, n_k, pq.device)
    nonempty = None if state0 is None else state0.log_scale >= SENTINEL / 2
    check_rows(causal=causal, key_padding=padding, allowed=allowed, state_nonempty=nonempty, n_q=n, exempt=qpad)
    if padding is not None:
        pk, lk = _mask_keys(pk, lk, padding)
    a = rule.log_decay
    if mode == "parallel":
        log_mask = None
        if mask is not None:
            log_mask = (mask.to(pq.dtype) if mask.dtype != torch.bool
                        else torch.zeros(mask.shape, dtype=pq.dtype, device=pq.device).masked_fill(~mask, -math.inf))
        num, den, logs, final = _normalized_parallel(pq, lq, pk, lk, v, causal, a, log_mask, state0, return_state)
    elif mode == "recurrent":
        start = state0 if state0 is not None else Sum().empty_state(batch_shape, r, v.shape[-1], pq.dtype, pq.device)
        num, den, logs, final = _normalized_recurrent(pq, lq, pk, lk, v, causal, a, start)
    else:
        num, den, logs, final = _chunked_from_features(pq, lq, pk, lk, v, causal, chunk_size, a, state0)
    den, logs = den.reshape(pq.shape[:-1]), logs.reshape(pq.shape[:-1])
    num, den, logs = zero_padded_rows(num, den, logs, qpad)
    parts = AttentionParts(num / den[..., None], num, den, logs)
    return (parts, to_public(final)) if return_state else parts


def _chunked_from_features(pq, lq, pk, lk, v, causal, chunk_size, a, state0):
    """The chunked mode (:func:`_chunked_causal`, :func:`_chunked_noncausal`) on given features: the blocks are
    slices of them. Returns ``(num, den, log_scale, final_state)``."""
    batch_shape, (n, r), (n_k, d_v) = pq.shape[:-2], pq.shape[-2:], v.shape[-2:]
    ct = pq.dtype
    pqf, lqf = pq.reshape(-1, n, r), lq.reshape(-1, n)
    batch = pqf.shape[0]
    pkf, lkf, vf = pk.reshape(batch, n_k, r), lk.reshape(batch, n_k), v.reshape(batch, n_k, d_v)
    block = chunked_block_length(batch, r, chunk_size, max(n, n_k), pq.device)
    ones = torch.ones(batch, block, 1, dtype=ct, device=pq.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (pq, lq, pk, lk, v))
    ws = None if needs_grad else _Workspace(ct, pq.device)

    def values(start, stop):
        return torch.cat([vf[:, start:stop], ones[:, :stop - start]], -1)

    # blocks of a batch of sequences are strided slices; the in-place products (no gradient) view them flat
    def query_features(start, stop):
        return pqf[:, start:stop].contiguous(), lqf[:, start:stop].contiguous()

    def key_features(start, stop):
        return pkf[:, start:stop].contiguous(), lkf[:, start:stop].contiguous()

    state = c = None
    if state0 is not None:
        state = torch.cat([state0.w.reshape(batch, r, d_v), state0.z.reshape(batch, r, 1)], -1).transpose(-1, -2)
        c = state0.log_scale.reshape(batch)
    sink = _Rows(batch, n, d_v, ct, ct, pq.device, True)
    backend = backends.choose("linear_attention.chunked", device=pq.device, dtype=ct, needs_grad=needs_grad,
                              rule_ok=True, batch=batch, entries=batch * max(n, n_k) * r, causal=causal,
                              exponential=False).backend
    if causal:
        # the causal loops slice their first argument by token and hand the slice to ``features``: pass the
        # positions, so that the slice names the block
        positions = torch.arange(n, device=pq.device).expand(batch, n)

        def block_features(idx, role):
            return query_features(int(idx[0, 0]), int(idx[0, -1]) + 1)

        if backend == "native":
            state, c = _chunked_causal_native(positions, vf.contiguous(), block_features, key_features, chunk_size,
                                              block, a, sink, state, c, r)
        else:
            state, c = _chunked_causal(positions, values, block_features, key_features, chunk_size, block, a, sink,
                                       state, c, ws)
    else:
        state, c = _chunked_noncausal(n, n_k, block, query_features, key_features, values, a, sink, state, c)
    final = NormalizedState(state[:, :d_v].transpose(-1, -2).reshape(*batch_shape, r, d_v),
                            state[:, d_v].reshape(*batch_shape, r), c.reshape(batch_shape))
    num, den, logs, _ = sink.result(batch_shape)
    return num, den, logs, final


def linear_attention_from_log_features(log_q, log_k, v, *, mode: str = "parallel", chunk_size: int = 64):
    r"""Non-causal linear attention of features given as logarithms, stabilised per feature: for maps whose
    features of one token span too wide a range for one log-scale per token (LARA's importance weights).

    .. math::
        y_i = \frac{\sum_l e^{L_{q,il}} \sum_j e^{L_{k,jl}} v_j}{\sum_l e^{L_{q,il}} \sum_j e^{L_{k,jl}}}

    Each feature's key sums are shifted by its largest key log-feature ``M_l = max_j L_{k,jl}`` (the recurrent
    and chunked modes reach it as a running maximum, rescaling the state ``[Σ_j e^{L_k − M} v_j, Σ_j e^{L_k − M}]``
    of shape ``(r, d_v + 1)`` when it grows), the shift is moved to the query side, and each query row is shifted
    by its largest term ``c_i = max_l (L_{q,il} + M_l)``: every exponent is ≤ 0 and the normaliser is ≥ 1 for
    positive features. ``parallel`` materialises the ``n × n_k`` matrix, ``recurrent`` adds one key at a time,
    ``chunked`` ``chunk_size`` keys at a time. Oracle:
    :func:`~kernapprox.attention.naive.linear_attention_from_log_features_naive`.

    Parameters
    ----------
    log_q : Tensor ``(..., n, r)``
    log_k : Tensor ``(..., n_k, r)``
    v : Tensor ``(..., n_k, d_v)``
        One floating dtype and device.
    mode : {"parallel", "recurrent", "chunked"}
    chunk_size : int

    Returns
    -------
    tuple of Tensor
        ``(numerator (..., n, d_v), normaliser (..., n), log_scale (..., n))`` with the true values
        ``numerator · e^{log_scale}``.
    """
    check_choice(mode, "mode", MODES)
    check_positive_int(chunk_size, "chunk_size")
    if mode == "parallel":
        key_max = log_k.amax(-2)                                               # (..., r)
        shifted = log_q + key_max[..., None, :]
        row_max = shifted.amax(-1)
        gram = torch.exp(shifted - row_max[..., None]) @ torch.exp(log_k - key_max[..., None, :]).transpose(-1, -2)
        return gram @ v, gram.sum(-1), row_max
    step = 1 if mode == "recurrent" else chunk_size
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    values = torch.cat([v, ones], -1)                                         # [V 1]
    state = key_max = None
    for start in range(0, log_k.shape[-2], step):
        state, key_max = add_log_keys(state, key_max, log_k[..., start:start + step, :],
                                      values[..., start:start + step, :])
    shifted = log_q + key_max[..., None, :]
    row_max = shifted.amax(-1)
    num_den = torch.exp(shifted - row_max[..., None]) @ state
    return num_den[..., :-1], num_den[..., -1], row_max


def add_log_keys(state, key_max, log_k, values):
    """The per-feature-stabilised state after a block of keys given by log-features: ``S_l ← S_l e^{M_l − M'_l} +
    Σ_j e^{L_{k,jl} − M'_l} [v_j 1]`` with ``M'_l = max(M_l, max_j L_{k,jl})`` (a running maximum per feature).

    ``state (..., r, d_v + 1)`` and ``key_max (..., r)``, or both None for the empty state; ``log_k (..., L, r)``,
    ``values (..., L, d_v + 1)`` (the values with a column of ones, for the normaliser). Returns the new
    ``(state, key_max)``. The streaming step of :func:`linear_attention_from_log_features`; EVA keeps its groups'
    value sums with it (one feature per group).
    """
    new_max = log_k.amax(-2) if key_max is None else torch.maximum(key_max, log_k.amax(-2))
    update = torch.exp(log_k - new_max[..., None, :]).transpose(-1, -2) @ values
    state = update if state is None else state * torch.exp(key_max - new_max)[..., None] + update
    return state, new_max
