"""The delta rule in the three modes (see :class:`kernapprox.rules.Delta` for the formulas and references).

With unit features ``K̄, Q̄`` (rows ``φ̄ = φ/‖φ‖``), step sizes ``β`` and an initial state ``W_0`` (``r × d_v``):

``parallel``
    the UT form ``T U = diag(β)(V − K̄W_0)``, ``T = I + tril(diag(β)K̄K̄ᵀ, −1)`` (one ``n × n`` unit-triangular
    solve), ``Y = Q̄W_0 + tril(Q̄K̄ᵀ)U`` (causal) or ``Y = Q̄(W_0 + K̄ᵀU)``. With an ``attn_mask``, row ``i`` runs
    the same solve with ``β_j`` set to 0 for the keys it may not see (a step with ``β = 0`` is the identity):
    ``O(n³ d_v)``, a reference.
``recurrent``
    the token loop ``W ← W + φ̄_k β(v − Wᵀφ̄_k)ᵀ``.
``chunked``
    the WY/UT representation per chunk of ``C`` keys (Yang et al. 2024, sec. 3.2): all chunks' triangular
    solves at once, ``[U_pre | W_y] = T^{-1}[diag(β)V | diag(β)K̄]``, then a loop over chunks carrying the state,
    ``U = U_pre − W_y S``, ``Y = Q̄S + tril(Q̄K̄ᵀ)U``, ``S ← S + K̄ᵀU`` — ``O(n (C r + C d_v + r d_v) + n C²)``,
    linear in ``n``.

Padded keys get zero features (and ``β = 0``): their step is the identity.
"""

from __future__ import annotations

import torch

from ..rules import DeltaState, unit_directions
from ..validation import compute_dtype
from .blocks import chunked_block_length
from .recurrent import delta_step

# Rows of the per-row (attn_mask) parallel solve per batch: bound the (rows, n_k, n_k) systems to ~2^22 entries.
_MASKED_ENTRIES = 1 << 22


def _betas(rule, k: torch.Tensor, ct) -> torch.Tensor:
    """β as a tensor of the keys' batch shape and length ``(..., n_k)``."""
    shape = k.shape[:-1]
    if not rule.per_token:
        return torch.full(shape, rule.beta, dtype=ct, device=k.device)
    beta = rule.beta
    if beta.device != k.device:
        raise ValueError(f"the rule's beta is on {beta.device} but the keys are on {k.device}")
    try:
        return beta.to(ct).expand(shape)
    except RuntimeError:
        raise ValueError(f"the rule's per-token beta of shape {tuple(beta.shape)} does not broadcast to the keys' "
                         f"batch shape and length {tuple(shape)}") from None


def attention(q, k, v, estimator, rule, causal, mode, chunk_size, padding, allowed, state0, want_state):
    """Delta-rule attention ``(y, final state or None)`` (inputs checked by the caller)."""
    ct = compute_dtype(q.dtype)
    beta = _betas(rule, k, ct)
    if padding is not None:
        beta = beta.masked_fill(padding, 0.0)
    w0 = None if state0 is None else state0.w
    vc = v.to(ct)
    if mode == "chunked":
        y, w = _chunked(q, k, vc, estimator, beta, causal, chunk_size, padding, w0, ct)
        return y, DeltaState(w) if want_state else None
    qu, ku = unit_directions(estimator, q, "query", ct), unit_directions(estimator, k, "key", ct, padding)
    if mode == "recurrent":
        w = torch.zeros(*ku.shape[:-2], ku.shape[-1], vc.shape[-1], dtype=ct, device=q.device) if w0 is None else w0
        outs = []
        for t in range(ku.shape[-2]):
            w = delta_step(w, ku[..., t, :], vc[..., t, :], beta[..., t])
            if causal:
                outs.append((qu[..., t, None, :] @ w).squeeze(-2))
        y = torch.stack(outs, -2) if causal else qu @ w
        return y, DeltaState(w) if want_state else None
    return _parallel(qu, ku, vc, beta, causal, allowed, w0, want_state)


def _parallel(qu, ku, v, beta, causal, allowed, w0, want_state):
    n_k = ku.shape[-2]
    rhs = v if w0 is None else v - ku @ w0
    kk = ku @ ku.transpose(-1, -2)
    eye = torch.eye(n_k, dtype=ku.dtype, device=ku.device)
    base = qu @ w0 if w0 is not None else None
    if allowed is None:
        t = eye + (beta[..., :, None] * kk).tril(-1)
        u = torch.linalg.solve_triangular(t, beta[..., None] * rhs, upper=False, unitriangular=True)
        final = ku.transpose(-1, -2) @ u if w0 is None else w0 + ku.transpose(-1, -2) @ u
        y = (qu @ ku.transpose(-1, -2)).tril() @ u if causal else qu @ final
        if causal and base is not None:
            y = y + base
        return y, DeltaState(final) if want_state else None
    # an attn_mask: row i reads the state of the keys it may see, in order (β_j = 0 for the others)
    n_q = qu.shape[-2]
    batch = max(1, allowed[..., 0, 0].numel())
    rows = max(1, _MASKED_ENTRIES // max(1, batch * n_k * n_k))
    scores = qu @ ku.transpose(-1, -2)                                 # (..., n_q, n_k)
    outs = []
    for start in range(0, n_q, rows):
        stop = min(start + rows, n_q)
        b = beta[..., None, :] * allowed[..., start:stop, :].to(beta.dtype)          # (..., R, n_k)
        t = eye + (b[..., :, None] * kk[..., None, :, :]).tril(-1)                     # (..., R, n_k, n_k)
        u = torch.linalg.solve_triangular(t, b[..., None] * rhs[..., None, :, :], upper=False, unitriangular=True)
        outs.append((scores[..., start:stop, None, :] @ u).squeeze(-2))                # (..., R, d_v)
    y = torch.cat(outs, -2)
    if base is not None:
        y = y + base
    return y, None


def _chunked(q, k, v, estimator, beta, causal, chunk_size, padding, w0, ct):
    """WY/UT chunked delta rule, block by block (features of one block at a time)."""
    batch_shape, (n, d), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    qf, kf, vf = q.reshape(-1, n, d), k.reshape(-1, n_k, d), v.reshape(-1, n_k, d_v)
    bf = beta.reshape(-1, n_k)
    padf = None if padding is None else padding.reshape(-1, n_k)
    nb = qf.shape[0]
    r = estimator.num_features
    size = chunk_size
    block = chunked_block_length(nb, r, size, max(n, n_k), q.device)
    state = (torch.zeros(nb, r, d_v, dtype=ct, device=q.device) if w0 is None
             else w0.reshape(nb, r, d_v).clone())
    out = torch.empty(nb, n, d_v, dtype=ct, device=q.device) if causal else None
    eye = torch.eye(size, dtype=ct, device=q.device)
    for start in range(0, n_k, block):
        stop = min(start + block, n_k)
        ku = unit_directions(estimator, kf[:, start:stop], "key", ct, None if padf is None else padf[:, start:stop])
        vb, bb = vf[:, start:stop], bf[:, start:stop]
        qu = unit_directions(estimator, qf[:, start:stop], "query", ct) if causal else None
        length, pad = stop - start, -(stop - start) % size
        if pad:                                  # a last partial chunk: zero keys with β = 0 are identity steps
            ku, vb = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (ku, vb))
            bb = torch.nn.functional.pad(bb, (0, pad))
            if causal:
                qu = torch.nn.functional.pad(qu, (0, 0, 0, pad))
        g = (length + pad) // size
        ku, vb, bb = ku.view(nb, g, size, r), vb.reshape(nb, g, size, d_v), bb.view(nb, g, size)
        bk = bb[..., None] * ku
        t = eye + (bk @ ku.transpose(-1, -2)).tril(-1)                       # (B, g, C, C)
        sol = torch.linalg.solve_triangular(t, torch.cat([bb[..., None] * vb, bk], -1), upper=False,
                                            unitriangular=True)
        u_pre, w_y = sol[..., :d_v], sol[..., d_v:]                          # T⁻¹βV, T⁻¹βK̄
        if causal:
            qu = qu.view(nb, g, size, r)
            qk = (qu @ ku.transpose(-1, -2)).tril()                          # (B, g, C, C)
            block_out = torch.empty(nb, g, size, d_v, dtype=ct, device=q.device)
        kt = ku.transpose(-1, -2)
        for j in range(g):
            u = torch.baddbmm(u_pre[:, j], w_y[:, j], state, alpha=-1)      # U = U_pre − W_y S
            if causal:
                block_out[:, j] = torch.baddbmm(qk[:, j] @ u, qu[:, j], state)   # Q̄S + tril(Q̄K̄ᵀ)U
            state = torch.baddbmm(state, kt[:, j], u)                        # S ← S + K̄ᵀU
        if causal:
            out[:, start:stop] = block_out.reshape(nb, g * size, d_v)[:, :length]
    if not causal:
        out = torch.empty(nb, n, d_v, dtype=ct, device=q.device)
        for start in range(0, n, block):
            out[:, start:start + block] = unit_directions(estimator, qf[:, start:start + block], "query", ct) @ state
    return out.reshape(*batch_shape, n, d_v), state.reshape(*batch_shape, r, d_v)
