r"""The chunked mode's gradient, written out: a backward pass of the sum rule's linear attention in chunks, in
place of autograd through the forward's block loop.

For stabilised features (``φ(q_i) = φ̃_q,i e^{ℓ_q,i}``, ``φ(k_j) = φ̃_k,j e^{ℓ_k,j}``) the output is

.. math::
    y_i = \frac{n_i}{d_i},\qquad [n_i\ d_i] = \sum_{j ≤ i} A_{ij} \tilde v_j,\qquad
    A_{ij} = φ̃_{q,i}^⊤ φ̃_{k,j}\, e^{ℓ_{k,j} − c_i},\qquad \tilde v_j = [v_j\ 1]

(``j ≤ i`` when causal; ``c_i`` any per-row shift, here the running maximum of the key log-scales, as the forward
uses). ``y`` does not depend on ``ℓ_q`` or on ``c`` (both scale ``n_i`` and ``d_i`` alike), so with
``h_i = [g_i / d_i,\ −g_i^⊤ y_i / d_i]`` (``g = ∂L/∂y``) and ``∂L/∂A_{ij} = h_i^⊤ \tilde v_j``,

.. math::
    \frac{∂L}{∂φ̃_{q,i}} = \sum_{j ≤ i} (h_i^⊤ \tilde v_j)\, e^{ℓ_{k,j} − c_i} φ̃_{k,j},\quad
    \frac{∂L}{∂φ̃_{k,j}} = \sum_{i ≥ j} (h_i^⊤ \tilde v_j)\, e^{ℓ_{k,j} − c_i} φ̃_{q,i},\quad
    \frac{∂L}{∂\tilde v_j} = \sum_{i ≥ j} A_{ij} h_i,\quad
    \frac{∂L}{∂ℓ_{k,j}} = φ̃_{k,j}^⊤ \frac{∂L}{∂φ̃_{k,j}},\quad \frac{∂L}{∂ℓ_{q,i}} = 0 .

The first is the forward's read with ``h`` in place of ``φ̃_q`` (states before each chunk, ``S_J``); the second
and third are the same sums run backwards, over the reverse state ``R_J = Σ_{i after chunk J} e^{s_J − c_i} φ̃_{q,i}
h_i^⊤`` with ``s_J`` the shift at the end of chunk ``J``: every exponent is ≤ 0 (``c_i ≥ s_J ≥ ℓ_{k,j}`` for
``j`` in or before chunk ``J`` and ``i`` after it), so nothing overflows, as in the forward. Within a chunk both
directions are ``C × C`` products. Non-causal, one shift ``c`` for all rows and one state each way.

This is the gradient of :func:`kernapprox.attention.linear_attention` in the chunked mode for the sum rule
without an initial or returned state, when only the output is asked for (what a model's training step needs), with
the switch ``KERNAPPROX_BACKWARD=on`` (:mod:`kernapprox.backends`; off by default: in eager torch it is no faster
than autograd through the chunked code on a CPU and holds the whole sequence's features, so it stands as the
reference of a compiled backward);
its test oracle is autograd through the eager chunked code (itself tested against the naive oracles of
:mod:`kernapprox.attention.naive`). The structure is the chunk-wise backward of Katharopoulos et al., *Transformers
are RNNs*, ICML 2020, §3.3.1 (the gradients as cumulative sums), and of flash-linear-attention's chunked kernels
(Yang et al., *Gated Linear Attention Transformers with Hardware-Efficient Training*, ICML 2024, §3), here with
the per-row log-domain shift of the forward.
"""

from __future__ import annotations

import torch

from ..rules import SENTINEL


def _ones(x, n):
    return torch.ones(*x.shape[:-1], n, dtype=x.dtype, device=x.device)


class ChunkedSum(torch.autograd.Function):
    """``(y, d, c) = ChunkedSum.apply(pq, pk, lk, v, causal, chunk_size, forward)``: the output, the normaliser
    and the row shift of sum-rule linear attention on stabilised features (flattened batch: ``pq (B, n, r)``,
    ``pk (B, n_k, r)``, ``lk (B, n_k)``, ``v (B, n_k, d_v)``), with the written-out backward of the module
    docstring. ``forward(pq, pk, lk, v)`` computes ``(num, den, c)`` without gradient (the chunked core); ``d``
    and ``c`` are not differentiable (the output does not depend on ``c``)."""

    @staticmethod
    def forward(ctx, pq, pk, lk, v, causal, chunk_size, forward):
        """``(y, d, c)`` from the chunked core ``forward`` (no gradient), keeping what the backward reads."""
        num, den, c = forward(pq, pk, lk, v)
        safe = torch.where(den == 0, torch.ones((), dtype=den.dtype, device=den.device), den)
        y = num / safe[..., None]
        ctx.save_for_backward(pq, pk, lk, v, y, safe, c)
        ctx.causal, ctx.chunk_size = causal, chunk_size
        ctx.mark_non_differentiable(den, c)
        return y, den, c

    @staticmethod
    def backward(ctx, gy, _gden, _gc):
        """The gradients of ``pq, pk, lk, v`` from that of ``y`` (module docstring)."""
        pq, pk, lk, v, y, den, c = ctx.saved_tensors
        h = torch.cat([gy, -(gy * y).sum(-1, keepdim=True)], -1) / den[..., None]       # (B, n, d_v + 1)
        vt = torch.cat([v, _ones(v, 1)], -1)
        if ctx.causal:
            gpq, gpk, gvt = _causal(pq, pk, lk, vt, h, c, ctx.chunk_size)
        else:
            gpq, gpk, gvt = _noncausal(pq, pk, lk, vt, h, c)
        glk = (gpk * pk).sum(-1)
        return gpq, gpk, glk, gvt[..., :-1], None, None, None


def _noncausal(pq, pk, lk, vt, h, c):
    """One shift ``c (B, n)`` (every row the same): forward state ``S = Σ_j e^{ℓ_j − c} ṽ_j φ̃_jᵀ`` and reverse
    state ``R = Σ_i h_i φ̃_{q,i}ᵀ``, both ``(B, d_v + 1, r)``."""
    kw = torch.exp(lk - c[:, :1])[..., None]                                     # (B, n_k, 1), ≤ 1
    state = (vt * kw).transpose(-1, -2) @ pk
    reverse = h.transpose(-1, -2) @ pq
    gpq = h @ state
    gpk = kw * (vt @ reverse)
    gvt = kw * (pk @ reverse.transpose(-1, -2))
    return gpq, gpk, gvt


def _causal(pq, pk, lk, vt, h, c, size):
    """The causal backward over chunks of ``size`` tokens (module docstring)."""
    batch, n, r = pq.shape
    dv1 = vt.shape[-1]
    pad = -n % size
    if pad:                                   # a last partial chunk: zero features, values and gradients
        pq, pk, vt, h = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (pq, pk, vt, h))
        lk = torch.nn.functional.pad(lk, (0, pad), value=SENTINEL)
        c = torch.cat([c, c[:, -1:].expand(batch, pad)], 1)
    g = (n + pad) // size
    pq, pk = pq.view(batch, g, size, r), pk.view(batch, g, size, r)
    vt, h = vt.view(batch, g, size, dv1), h.view(batch, g, size, dv1)
    lk, c = lk.view(batch, g, size), c.view(batch, g, size)
    s = c[..., -1]                                                               # shift after each chunk
    s_before = torch.cat([torch.full_like(s[:, :1], SENTINEL), s[:, :-1]], 1)   # and before it

    # within each chunk: W_ij = e^{ℓ_j − c_i} (j ≤ i), scores E = (φ̃_q φ̃_kᵀ) ⊙ W, G = (h ṽᵀ) ⊙ W
    past = torch.ones(size, size, dtype=torch.bool, device=pq.device).tril()
    weights = torch.exp(torch.clamp_max(lk[..., None, :] - c[..., :, None], 0.0)).masked_fill(~past, 0.0)
    scores = (pq @ pk.transpose(-1, -2)) * weights
    grads = (h @ vt.transpose(-1, -2)) * weights
    gpq = grads @ pk
    gpk = grads.transpose(-1, -2) @ pq
    gvt = scores.transpose(-1, -2) @ h

    # across chunks, forward: S_J (before chunk J, scaled by e^{−s_{J−1}}), layout (d_v + 1, r)
    key_w = torch.exp(lk - s[..., None])[..., None]                              # ≤ 1
    summary = (vt * key_w).transpose(-1, -2) @ pk                                # (B, g, d_v + 1, r)
    row_w = torch.exp(s_before[..., None] - c)[..., None]                        # e^{s_{J−1} − c_i} ≤ 1
    decay = torch.exp(s_before - s)                                              # e^{s_{J−1} − s_J} ≤ 1
    states = torch.empty_like(summary)
    state = torch.zeros_like(summary[:, 0])
    for j in range(g):
        states[:, j] = state
        state = torch.addcmul(summary[:, j], state, decay[:, j, None, None])
    gpq = torch.addcmul(gpq, h @ states, row_w)

    # across chunks, backward: R_J = Σ_{i after J} e^{s_J − c_i} h_i φ̃_{q,i}ᵀ, layout (d_v + 1, r)
    summary = (h * row_w).transpose(-1, -2) @ pq                                 # chunk J's terms, × e^{s_{J−1}}
    reverse = torch.empty_like(summary)
    state = torch.zeros_like(summary[:, 0])
    for j in range(g - 1, -1, -1):
        reverse[:, j] = state
        state = torch.addcmul(summary[:, j], state, decay[:, j, None, None])
    gpk = torch.addcmul(gpk, vt @ reverse, key_w)
    gvt = torch.addcmul(gvt, pk @ reverse.transpose(-1, -2), key_w)
    n_all = g * size
    return (gpq.reshape(batch, n_all, r)[:, :n], gpk.reshape(batch, n_all, r)[:, :n],
            gvt.reshape(batch, n_all, dv1)[:, :n])
