"""Exact softmax attention, the reference every estimator is measured against.

``softmax(s · Q Kᵀ [+ causal mask]) V`` computed in query chunks, so that no more than a bounded number of logits
exists at once; its float64 loop oracle is :func:`kernapprox.attention.naive.softmax_attention_naive`.
"""

from __future__ import annotations

import torch

from ..kernel import resolve_scale
from ..validation import check_bool, check_positive_int, check_qkv, compute_dtype

_LOGITS_PER_CHUNK = 1 << 24  # default memory bound of softmax_attention's query chunks (all batch entries)


def softmax_attention(q, k, v, causal: bool = False, scale: float | None = None, *, chunk_size: int | None = None,
                      return_lse: bool = False):
    """Exact softmax attention ``softmax(s · Q Kᵀ [+ causal mask]) V``, computed in query chunks.

    Never materialises more than ``chunk_size × n_k`` logits per (batch, head) (``chunk_size`` defaults so that
    a chunk holds at most 2²⁴ logits over all batch and head entries together, 64 MiB in float32, and at least
    one query row), so it runs at n = 32k and beyond on a CPU. Matches
    ``torch.nn.functional.scaled_dot_product_attention``. With ``return_lse=True`` also returns the log of the
    normaliser ``log Σ_j exp(s q_iᵀk_j)``, shape ``(..., n_q)``.
    """
    check_qkv(q, k, v, causal)
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
