"""The least-squares state in the three modes (see :class:`kernapprox.rules.LeastSquares` for the formulas).

With unit features ``K̄, Q̄``, ridge ``λ`` and an initial state ``(W_0, P_0)`` (``P_0 = I/λ`` when empty):

``parallel``
    the normal equations per query row: ``A_i = P_0^{-1} + Σ_{j∈S_i} φ̄_jφ̄_jᵀ``, ``B_i = P_0^{-1}W_0 +
    Σ_{j∈S_i} φ̄_j v_jᵀ``, ``y_i = B_iᵀ A_i^{-1} φ̄(q_i)`` (Cholesky solves), ``S_i`` the keys row ``i`` sees
    (causal prefix, padding, ``attn_mask``): ``O(n r³ + n² r²)`` with a mask, prefix sums without one.
``recurrent``
    recursive least squares, one Sherman–Morrison update of ``P`` per token.
``chunked``
    per chunk of ``C`` keys, the Woodbury form: ``LLᵀ = I + K̄P K̄ᵀ`` (Cholesky), ``[E | H] = L^{-1}[K̄P | K̄W]``,
    so that ``P_s = P − E_{≤s}ᵀE_{≤s}`` at each position ``s`` of the chunk (leading blocks of a Cholesky factor
    are the factors of the leading blocks); rows read ``Y = Q̄W − ZH + tril(RK̄ᵀ)V`` with ``Z = tril(Q̄Eᵀ)``,
    ``R = Q̄P − ZE``; the state moves to ``P' = P − EᵀE``, ``W' = W − EᵀH + P'K̄ᵀV``. ``O(C r² + C² r + C³)`` per
    chunk, linear in ``n``.

Padded keys get zero features: they add nothing to the Gram matrix and leave the state unchanged.
"""

from __future__ import annotations

import torch

from ..validation import compute_dtype
from .blocks import chunked_block_length
from .recurrent import least_squares_step
from .rules import LeastSquaresState, unit_features

# Rows of the masked parallel solve per batch: bound the (rows, r, r) Gram matrices to ~2^22 entries.
_GRAM_ENTRIES = 1 << 22


def _unit(estimator, x, role, ct, padding=None):
    phi, _ = estimator.features(x, role, log_scale=True, check_finite=False)
    return unit_features(phi.to(ct), role, type(estimator).__name__, padding)


def attention(q, k, v, estimator, rule, causal, mode, chunk_size, padding, allowed, state0, want_state):
    """Least-squares attention ``(y, final state or None)`` (inputs checked by the caller)."""
    ct = compute_dtype(q.dtype)
    vc = v.to(ct)
    r = estimator.num_features
    if state0 is None:
        state0 = rule.empty_state(q.shape[:-2], r, v.shape[-1], ct, q.device)
        prior = ("ridge", rule.ridge)
    else:
        prior = ("state", None)
    if mode == "chunked":
        return _chunked(q, k, vc, estimator, causal, chunk_size, padding, state0, ct)
    qu, ku = _unit(estimator, q, "query", ct), _unit(estimator, k, "key", ct, padding)
    if mode == "recurrent":
        state, outs = state0, []
        for t in range(ku.shape[-2]):
            state = least_squares_step(state, ku[..., t, :], vc[..., t, :])
            if causal:
                outs.append((qu[..., t, None, :] @ state.w).squeeze(-2))
        y = torch.stack(outs, -2) if causal else qu @ state.w
        return y, state
    return _parallel(qu, ku, vc, causal, allowed, state0, prior, want_state)


def _prior(state0, prior):
    """``(P_0^{-1}, P_0^{-1} W_0)``; ``(λI, 0)`` for the empty state."""
    w0, p0 = state0
    if prior[0] == "ridge":
        r = p0.shape[-1]
        return torch.eye(r, dtype=p0.dtype, device=p0.device) * prior[1], torch.zeros_like(w0)
    a0 = torch.cholesky_inverse(torch.linalg.cholesky(p0))
    return a0, a0 @ w0


def _solve(a, b, x):
    """``bᵀ a^{-1} x`` for SPD ``a (..., r, r)``, ``b (..., r, d_v)``, ``x (..., r)``."""
    sol = torch.cholesky_solve(x[..., None], torch.linalg.cholesky(a)).squeeze(-1)
    return (sol[..., None, :] @ b).squeeze(-2)


def _parallel(qu, ku, v, causal, allowed, state0, prior, want_state):
    a0, b0 = _prior(state0, prior)
    n_q, r = qu.shape[-2], qu.shape[-1]
    final = None
    if want_state:
        a_fin = a0 + ku.transpose(-1, -2) @ ku
        p_fin = torch.cholesky_inverse(torch.linalg.cholesky(a_fin))
        final = LeastSquaresState(p_fin @ (b0 + ku.transpose(-1, -2) @ v), p_fin)
    if allowed is None and not causal:
        a = a0 + ku.transpose(-1, -2) @ ku
        b = b0 + ku.transpose(-1, -2) @ v
        sol = torch.cholesky_solve(qu.transpose(-1, -2), torch.linalg.cholesky(a))      # (..., r, n_q)
        return sol.transpose(-1, -2) @ b, final
    batch = max(1, qu[..., 0, 0].numel())
    rows = max(1, _GRAM_ENTRIES // max(1, batch * r * r))
    outs = []
    a_run, b_run = a0.expand(*qu.shape[:-2], r, r), b0.expand(*qu.shape[:-2], r, v.shape[-1])
    for start in range(0, n_q, rows):
        stop = min(start + rows, n_q)
        if allowed is None:         # causal: prefix sums of the outer products
            kk = ku[..., start:stop, :, None] * ku[..., start:stop, None, :]             # (..., R, r, r)
            kv = ku[..., start:stop, :, None] * v[..., start:stop, None, :]              # (..., R, r, d_v)
            a = a_run[..., None, :, :] + torch.cumsum(kk, -3)
            b = b_run[..., None, :, :] + torch.cumsum(kv, -3)
            a_run, b_run = a[..., -1, :, :], b[..., -1, :, :]
        else:
            m = allowed[..., start:stop, :].to(ku.dtype)                                 # (..., R, n_k)
            a = a0[..., None, :, :] + torch.einsum("...ij,...jr,...js->...irs", m, ku, ku)
            b = b0[..., None, :, :] + torch.einsum("...ij,...jr,...jv->...irv", m, ku, v)
        outs.append(_solve(a, b, qu[..., start:stop, :]))
    return torch.cat(outs, -2), final


def _chunked(q, k, v, estimator, causal, chunk_size, padding, state0, ct):
    """Woodbury/Cholesky chunked least squares, block by block (features of one block at a time)."""
    batch_shape, (n, d), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    qf, kf, vf = q.reshape(-1, n, d), k.reshape(-1, n_k, d), v.reshape(-1, n_k, d_v)
    padf = None if padding is None else padding.reshape(-1, n_k)
    nb = qf.shape[0]
    r = estimator.num_features
    size = chunk_size
    block = chunked_block_length(nb, r, size, max(n, n_k), q.device)
    w = state0.w.reshape(nb, r, d_v)
    p = state0.p.reshape(nb, r, r)
    out = torch.empty(nb, n, d_v, dtype=ct, device=q.device)
    eye = torch.eye(size, dtype=ct, device=q.device)
    for start in range(0, n_k, block):
        stop = min(start + block, n_k)
        ku = _unit(estimator, kf[:, start:stop], "key", ct, None if padf is None else padf[:, start:stop])
        qu = _unit(estimator, qf[:, start:stop], "query", ct) if causal else None
        for c0 in range(0, stop - start, size):
            c1 = min(c0 + size, stop - start)
            kc, vc = ku[:, c0:c1], vf[:, start + c0:start + c1]
            kp = kc @ p                                                       # K̄P (P symmetric)
            chol = torch.linalg.cholesky(torch.baddbmm(eye[:c1 - c0, :c1 - c0], kp, kc.transpose(1, 2)))
            eh = torch.linalg.solve_triangular(chol, torch.cat([kp, kc @ w], -1), upper=False)
            e, h = eh[..., :r], eh[..., r:]
            if causal:
                qc = qu[:, c0:c1]
                z = (qc @ e.transpose(1, 2)).tril()
                rr = qc @ p - z @ e
                y = qc @ w - z @ h + (rr @ kc.transpose(1, 2)).tril() @ vc
                out[:, start + c0:start + c1] = y
            p = p - e.transpose(1, 2) @ e
            p = 0.5 * (p + p.transpose(1, 2))                               # keep P symmetric under rounding
            w = w - e.transpose(1, 2) @ h + p @ (kc.transpose(1, 2) @ vc)
    if not causal:
        for start in range(0, n, block):
            out[:, start:start + block] = _unit(estimator, qf[:, start:start + block], "query", ct) @ w
    final = LeastSquaresState(w.reshape(*batch_shape, r, d_v), p.reshape(*batch_shape, r, r))
    return out.reshape(*batch_shape, n, d_v), final
