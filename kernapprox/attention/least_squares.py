"""The least-squares state in the three modes (see :class:`kernapprox.rules.LeastSquares` for the formulas).

With unit features ``K̄, Q̄``, ridge ``λ`` and an initial state ``(W_0, P_0)`` (``P_0 = I/λ`` when empty):

``parallel``
    the kernel (dual) form, an ``n_k × n_k`` system instead of ``r × r``: with the Cholesky factor
    ``LLᵀ = I + K̄P_0K̄ᵀ`` (``= I + K̄K̄ᵀ/λ`` from empty), ``X = L^{-1}(V − K̄W_0)`` and ``Z = L^{-1}K̄P_0Q̄ᵀ``,
    ``Y = Q̄W_0 + tril(Zᵀ)X`` (causal; leading blocks of a Cholesky factor are the factors of the leading blocks,
    so row ``i`` solves the regression on its prefix) or ``Y = Q̄W_0 + ZᵀX`` (the push-through identity
    ``(K̄ᵀK̄ + λI)^{-1}K̄ᵀ = K̄ᵀ(K̄K̄ᵀ + λI)^{-1}``): kernel ridge regression with the kernel ``φ̄(q)ᵀφ̄(k)``,
    ``O(n² r + n³)``. With an ``attn_mask``, the normal equations per query row, ``A_i = P_0^{-1} +
    Σ_{j∈S_i} φ̄_jφ̄_jᵀ``, ``y_i = (P_0^{-1}W_0 + Σ_{j∈S_i} φ̄_j v_jᵀ)ᵀ A_i^{-1} φ̄(q_i)``, ``O(n r³ + n² r²)``.
``recurrent``
    recursive least squares, one Sherman–Morrison update of ``P`` per token.
``chunked``
    the same Cholesky form per chunk of ``C`` keys, carrying ``(W, P)``: ``LLᵀ = I + K̄PK̄ᵀ``,
    ``[E | X] = L^{-1}[K̄P | V − K̄W]``, ``Y = Q̄W + tril(Q̄Eᵀ)X``, then ``W ← W + EᵀX``, ``P ← P − EᵀE``
    (Woodbury). ``O(C r² + C² r + C³)`` per chunk, linear in ``n``.

Padded keys get zero features: they add nothing to the Gram matrix and leave the state unchanged.
"""

from __future__ import annotations

import torch

from ..rules import LeastSquaresState, unit_directions
from ..validation import compute_dtype
from .blocks import chunked_block_length
from .recurrent import least_squares_step

# Rows of the masked parallel solve per batch: bound the (rows, r, r) Gram matrices to ~2^22 entries.
_GRAM_ENTRIES = 1 << 22


def _cholesky(matrix: torch.Tensor, what: str) -> torch.Tensor:
    """Cholesky factor of a matrix that is positive definite in exact arithmetic; a numerical failure raises
    ``ValueError`` naming the cause (the ridge is too small for the precision)."""
    try:
        return torch.linalg.cholesky(matrix)
    except torch.linalg.LinAlgError:
        raise ValueError(f"least squares: {what} is not numerically positive definite in {matrix.dtype}: the ridge "
                         "is too small for this precision (the relative accuracy is about eps·(1 + n/λ)); use a "
                         "larger ridge or float64") from None


def attention(q, k, v, estimator, rule, causal, mode, chunk_size, padding, allowed, state0, want_state):
    """Least-squares attention ``(y, final state or None)`` (inputs checked by the caller)."""
    ct = compute_dtype(q.dtype)
    vc = v.to(ct)
    r = estimator.num_features

    def start():
        return state0 if state0 is not None else rule.empty_state(q.shape[:-2], r, v.shape[-1], ct, q.device)

    if mode == "chunked":
        return _chunked(q, k, vc, estimator, causal, chunk_size, padding, start(), ct)
    qu, ku = unit_directions(estimator, q, "query", ct), unit_directions(estimator, k, "key", ct, padding)
    if mode == "recurrent":
        state, outs = start(), []
        for t in range(ku.shape[-2]):
            state = least_squares_step(state, ku[..., t, :], vc[..., t, :])
            if causal:
                outs.append((qu[..., t, None, :] @ state.w).squeeze(-2))
        y = torch.stack(outs, -2) if causal else qu @ state.w
        return y, state
    if allowed is not None:
        return _masked_parallel(qu, ku, vc, allowed, state0, rule.ridge), None
    return _parallel(qu, ku, vc, causal, state0, rule.ridge, want_state, start)


def _parallel(qu, ku, v, causal, state0, ridge, want_state, start):
    """The kernel (dual) form: one ``n_k × n_k`` Cholesky factor for every query row."""
    n_k = ku.shape[-2]
    kp = ku / ridge if state0 is None else ku @ state0.p                   # K̄P_0
    gram = torch.eye(n_k, dtype=ku.dtype, device=ku.device) + kp @ ku.transpose(-1, -2)
    chol = _cholesky(gram, "I + K̄P₀K̄ᵀ")
    rhs = v if state0 is None else v - ku @ state0.w
    x = torch.linalg.solve_triangular(chol, rhs, upper=False)              # L⁻¹(V − K̄W_0)
    z = torch.linalg.solve_triangular(chol, kp @ qu.transpose(-1, -2), upper=False)   # L⁻¹K̄P_0Q̄ᵀ
    zt = z.transpose(-1, -2)
    y = (zt.tril() if causal else zt) @ x
    if state0 is not None:
        y = y + qu @ state0.w
    final = None
    if want_state:
        w0, p0 = start()
        e = torch.linalg.solve_triangular(chol, kp, upper=False)           # L⁻¹K̄P_0
        final = LeastSquaresState(w0 + e.transpose(-1, -2) @ x, p0 - e.transpose(-1, -2) @ e)
    return y, final


def _masked_parallel(qu, ku, v, allowed, state0, ridge):
    """The normal equations of each query row on the keys its row allows."""
    r = qu.shape[-1]
    if state0 is None:
        a0 = torch.eye(r, dtype=qu.dtype, device=qu.device) * ridge
        b0 = torch.zeros(r, v.shape[-1], dtype=qu.dtype, device=qu.device)
    else:
        a0 = torch.cholesky_inverse(_cholesky(state0.p, "the initial state's P"))
        b0 = a0 @ state0.w
    batch = max(1, qu[..., 0, 0].numel())
    rows = max(1, _GRAM_ENTRIES // max(1, batch * r * r))
    outs = []
    for begin in range(0, qu.shape[-2], rows):
        end = min(begin + rows, qu.shape[-2])
        m = allowed[..., begin:end, :].to(ku.dtype)                                     # (..., R, n_k)
        a = a0[..., None, :, :] + torch.einsum("...ij,...jr,...js->...irs", m, ku, ku)
        b = b0[..., None, :, :] + torch.einsum("...ij,...jr,...jv->...irv", m, ku, v)
        sol = torch.cholesky_solve(qu[..., begin:end, :, None], _cholesky(a, "K̄ᵀK̄ + P₀⁻¹")).squeeze(-1)
        outs.append((sol[..., None, :] @ b).squeeze(-2))
    return torch.cat(outs, -2)


def _chunked(q, k, v, estimator, causal, chunk_size, padding, state0, ct):
    """Cholesky/Woodbury chunked least squares, block by block (features of one block at a time)."""
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
        ku = unit_directions(estimator, kf[:, start:stop], "key", ct, None if padf is None else padf[:, start:stop])
        qu = unit_directions(estimator, qf[:, start:stop], "query", ct) if causal else None
        for c0 in range(0, stop - start, size):
            c1 = min(c0 + size, stop - start)
            kc, vc = ku[:, c0:c1], vf[:, start + c0:start + c1]
            kp = kc @ p                                                       # K̄P (P symmetric)
            chol = _cholesky(torch.baddbmm(eye[:c1 - c0, :c1 - c0], kp, kc.transpose(1, 2)), "I + K̄PK̄ᵀ")
            ex = torch.linalg.solve_triangular(chol, torch.cat([kp, torch.baddbmm(vc, kc, w, alpha=-1)], -1),
                                               upper=False)
            e, x = ex[..., :r], ex[..., r:]                                   # L⁻¹K̄P, L⁻¹(V − K̄W)
            if causal:
                qc = qu[:, c0:c1]
                out[:, start + c0:start + c1] = torch.baddbmm((qc @ e.transpose(1, 2)).tril() @ x, qc, w)
            w = torch.baddbmm(w, e.transpose(1, 2), x)                        # W ← W + EᵀX
            p = torch.baddbmm(p, e.transpose(1, 2), e, alpha=-1)              # P ← P − EᵀE
            p = 0.5 * (p + p.transpose(1, 2))                                 # symmetric under rounding
    if not causal:
        for start in range(0, n, block):
            out[:, start:start + block] = unit_directions(estimator, qf[:, start:start + block], "query", ct) @ w
    final = LeastSquaresState(w.reshape(*batch_shape, r, d_v), p.reshape(*batch_shape, r, r))
    return out.reshape(*batch_shape, n, d_v), final
