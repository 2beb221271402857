"""Plain float64 loop oracles: the references the fast attention paths are tested against.

One loop over queries, straight from the definitions, no stabilisation beyond a row maximum (use them at moderate
norms), no chunking: slow and obviously right (flash-linear-attention's ``naive`` files play the same role).
"""

from __future__ import annotations

import math

import torch

from ..estimators.base import FeatureMap
from ..kernel import resolve_scale
from ..rules import check_beta, resolve_rule
from ..validation import check_qkv
from .masks import check_attn_mask, check_key_padding_mask


def softmax_attention_naive(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Plain float64 loop over queries: the test oracle of :func:`softmax_attention`."""
    check_qkv(q, k, v, causal)
    s = resolve_scale(q.shape[-1], scale)
    q, k, v = q.double(), k.double(), v.double()
    outs = []
    for i in range(q.shape[-2]):
        end = i + 1 if causal else k.shape[-2]
        logits = s * (k[..., :end, :] @ q[..., i, :, None]).squeeze(-1)
        w = torch.exp(logits - logits.amax(-1, keepdim=True))
        outs.append((w[..., None] * v[..., :end, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(outs, -2)


def linear_attention_naive(q, k, v, estimator: FeatureMap, causal: bool = False, *, rule="sum",
                           key_padding_mask=None, attn_mask=None, initial_state=None) -> torch.Tensor:
    """Plain float64 loops with exact-scale features: the test oracle of the three modes, for every rule.

    For each batch entry and query ``i``, the keys ``S_i`` it may see (``j ≤ i`` if causal, not padded, allowed by
    ``attn_mask``) are listed, in order, and the read-out is computed from its definition:

    - sum / decay: ``Σ_{j∈S_i} w_ij φ(q_i)ᵀφ(k_j) v_j / Σ_{j∈S_i} w_ij φ(q_i)ᵀφ(k_j)`` with ``w_ij = γ^{i−j}
      e^{m_ij}`` (``m`` the additive mask), plus the initial state ``γ^{i+1}(W_0, z_0)``; non-causal: every
      query at the last key's position ``i = n_k − 1``;
    - delta: ``W ← W_0``, then ``W ← W + β_j φ̄_j (v_j − Wᵀφ̄_j)ᵀ`` for ``j ∈ S_i`` in order, ``y_i = Wᵀφ̄(q_i)``;
    - least squares: ``y_i = B_iᵀA_i^{-1}φ̄(q_i)`` with ``A_i = P_0^{-1} + Σ_{S_i} φ̄_jφ̄_jᵀ``, ``B_i = P_0^{-1}W_0 +
      Σ_{S_i} φ̄_j v_jᵀ`` (``P_0 = I/λ``, ``W_0 = 0`` without an initial state).

    ``φ̄ = φ/‖φ‖`` from the exact-scale features. No stabilisation, so use it only at moderate norms.
    """
    check_qkv(q, k, v, causal)
    rule = resolve_rule(rule)
    padding = check_key_padding_mask(key_padding_mask, k)
    mask = check_attn_mask(attn_mask, q, k)
    batch_shape, n_q, n_k, d_v = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    pq = estimator.features(q.double(), "query").reshape(-1, n_q, estimator.num_features)
    pk = estimator.features(k.double(), "key").reshape(-1, n_k, estimator.num_features)
    vv = v.double().reshape(-1, n_k, d_v)
    nb = pq.shape[0]
    pad = None if padding is None else padding.reshape(nb, n_k)
    am = None if mask is None else mask.reshape(nb, n_q, n_k)
    state = None if initial_state is None else [t.double().reshape(nb, *t.shape[len(batch_shape):])
                                                for t in initial_state]
    beta = None
    if rule.name == "delta":
        beta = rule.beta
        if isinstance(beta, torch.Tensor):
            beta = check_beta(beta).double().expand(*batch_shape, n_k).reshape(nb, n_k)
    gamma = getattr(rule, "gamma", 1.0) if rule.normalized else 1.0
    out = torch.zeros(nb, n_q, d_v, dtype=torch.float64)
    for b in range(nb):
        for i in range(n_q):
            keys, weights = [], []
            for j in range(n_k):
                if (causal and j > i) or (pad is not None and bool(pad[b, j])):
                    continue
                m = 0.0
                if am is not None:
                    if am.dtype == torch.bool:
                        if not bool(am[b, i, j]):
                            continue
                    else:
                        m = float(am[b, i, j])
                        if m == -math.inf:
                            continue
                keys.append(j)
                weights.append(math.exp(m) * gamma ** ((i if causal else n_k - 1) - j))
            if rule.normalized:
                num = torch.zeros(d_v, dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                for j, w in zip(keys, weights):
                    a = w * (pq[b, i] @ pk[b, j])
                    num, den = num + a * vv[b, j], den + a
                if state is not None:
                    w0, z0, c0 = state
                    f = gamma ** ((i if causal else n_k - 1) + 1) * math.exp(float(c0[b]))
                    num, den = num + f * (pq[b, i] @ w0[b]), den + f * (pq[b, i] @ z0[b])
                if not keys and (state is None or float(state[2][b]) == -math.inf):
                    raise ValueError(f"query {i} of batch entry {b} sees no key")
                out[b, i] = num / den
            elif rule.name == "delta":
                w = torch.zeros(pk.shape[-1], d_v, dtype=torch.float64) if state is None else state[0][b].clone()
                for j in keys:
                    kj = pk[b, j] / pk[b, j].norm()
                    bj = float(beta[b, j]) if isinstance(beta, torch.Tensor) else beta
                    w = w + bj * torch.outer(kj, vv[b, j] - kj @ w)
                out[b, i] = (pq[b, i] / pq[b, i].norm()) @ w
            else:
                r = pk.shape[-1]
                if state is None:
                    a = rule.ridge * torch.eye(r, dtype=torch.float64)
                    bb = torch.zeros(r, d_v, dtype=torch.float64)
                else:
                    a = torch.linalg.inv(state[1][b])
                    bb = a @ state[0][b]
                for j in keys:
                    kj = pk[b, j] / pk[b, j].norm()
                    a, bb = a + torch.outer(kj, kj), bb + torch.outer(kj, vv[b, j])
                out[b, i] = (pq[b, i] / pq[b, i].norm()) @ torch.linalg.solve(a, bb)
    return out.reshape(*batch_shape, n_q, d_v)


def linear_attention_from_log_features_naive(log_q, log_k, v) -> torch.Tensor:
    """Plain float64 loop over queries: the test oracle of
    :func:`~kernapprox.attention.linear.linear_attention_from_log_features` (non-causal), ``y_i = Σ_j κ_ij v_j /
    Σ_j κ_ij`` with ``κ_ij = Σ_l e^{L_q,il + L_k,jl}`` straight from the definition (use it at moderate
    log-features: nothing is shifted)."""
    lq, lk, vv = log_q.double(), log_k.double(), v.double()
    outs = []
    for i in range(lq.shape[-2]):
        kappa = torch.exp(lq[..., i, None, :] + lk).sum(-1)                        # (..., n_k)
        outs.append((kappa[..., None] * vv).sum(-2) / kappa.sum(-1, keepdim=True))
    return torch.stack(outs, -2)
