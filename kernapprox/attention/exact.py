"""Exact softmax attention, the reference every estimator is measured against.

``softmax(s · Q Kᵀ + mask) V`` through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): one call when
the score matrix fits a memory budget, query chunks of SDPA calls beyond it, so that no more than a bounded number
of logits can exist at once whatever backend SDPA picks. Its float64 loop oracle is
:func:`kernapprox.attention.naive.softmax_attention_naive`.

Masks (shared with :func:`kernapprox.linear_attention`)
-------------------------------------------------------
``key_padding_mask``
    bool ``(..., n_k)``, **True = padding** (the key takes no part), as ``torch.nn.MultiheadAttention``; its
    leading dimensions broadcast against the batch dimensions of ``q`` (right-aligned, as torch broadcasts: pass
    ``(batch, 1, n_k)`` for ``(batch, heads, n, d)`` inputs).
``attn_mask``
    bool (**True = takes part**, as SDPA) or floating (added to the logits; ``-inf`` excludes), broadcastable to
    ``(..., n_q, n_k)``.
``causal``
    keys after the query excluded (``n_q = n_k``).

They combine by intersection (and addition of a float mask). A query row left without any key raises
``ValueError`` (its softmax would be 0/0: SDPA returns NaN there); nothing is returned silently as NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernel import resolve_scale
from ..validation import (
    all_finite,
    check_bool,
    check_finite,
    check_positive_int,
    check_qkv,
    check_tensor,
    compute_dtype,
    itemsize,
    max_row_norm,
)
from .masks import check_attn_mask, check_key_padding_mask, check_query_padding_mask

# Memory budget of the score matrix: softmax_attention calls SDPA once when all (batch, head) score matrices
# together hold at most this many bytes in the compute dtype (256 MiB: n = 4096 with 4 heads in float32), and
# calls it on query chunks of at most this size beyond. SDPA's fused kernels (flash on the CPU and GPU) never
# build the matrix; the budget bounds its math fallback (e.g. float64 on a GPU) and the explicit masks.
SCORE_BUDGET_BYTES = 1 << 28


def softmax_attention(q, k, v, causal: bool = False, scale: float | None = None, *, key_padding_mask=None,
                      attn_mask=None, chunk_size: int | None = None, return_lse: bool = False,
                      query_padding_mask=None):
    """Exact softmax attention ``softmax(s · Q Kᵀ + mask) V``: SDPA, in query chunks beyond a memory budget.

    Parameters
    ----------
    q, k, v : Tensor ``(..., n_q, d)``, ``(..., n_k, d)``, ``(..., n_k, d_v)``
        One dtype and device, equal batch dimensions. Half precision is computed in float32 and rounded once.
    causal : bool
        Exclude keys after each query (``n_q = n_k``).
    scale : float, optional
        ``s``; default ``1/sqrt(d)`` (SDPA's).
    key_padding_mask, attn_mask : Tensor, optional
        See the module docstring: bool key padding (True = padding), bool (True = takes part) or additive float
        attention mask.
    chunk_size : int, optional
        Queries per SDPA call. Default: all of them when the score matrices of every (batch, head) entry
        together fit :data:`SCORE_BUDGET_BYTES` in the compute dtype, else as many as fit (at least one).
    query_padding_mask : bool Tensor ``(..., n_q)``, optional
        True = the query is padding: its output row (and log-normaliser) is 0, it needs no key to attend to (it is
        computed over every key and then zeroed, so nothing is 0/0), and no gradient flows through it.
    return_lse : bool
        Also return ``log Σ_j exp(s q_iᵀk_j + mask_ij)``, shape ``(..., n_q)`` (computed from the logits in the
        same query chunks, not by SDPA, which does not return it).

    Returns
    -------
    Tensor ``(..., n_q, d_v)`` in the inputs' dtype (and the log-normaliser with ``return_lse=True``).

    Raises
    ------
    ValueError
        A query row has no key left by the masks; or the result is not finite because the logits overflow the
        compute dtype (the message names the fix: rescale).
    """
    check_qkv(q, k, v, causal)
    check_bool(return_lse, "return_lse")
    s = resolve_scale(q.shape[-1], scale)
    batch, n_q, n_k = q.shape[:-2], q.shape[-2], k.shape[-2]
    ct = compute_dtype(q.dtype)
    mask = combine_masks(q, k, causal, key_padding_mask, attn_mask)        # None, or bool / float (..., n_q, n_k)
    qpad = check_query_padding_mask(query_padding_mask, q)
    entries = math.prod(batch)
    if chunk_size is None:
        per_query = max(entries * n_k * itemsize(ct), 1)
        chunk_size = max(1, min(n_q, SCORE_BUDGET_BYTES // per_query))
    check_positive_int(chunk_size, "chunk_size")
    qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(ct)
    outs, lses = [], []
    for start in range(0, n_q, chunk_size):
        stop = min(start + chunk_size, n_q)
        kend = stop if causal else n_k                   # a causal chunk sees no key after its last query
        chunk_mask = _chunk_mask(mask, causal, start, stop, kend, q.device)
        if qpad is not None and chunk_mask is not None:   # a padded row attends to every key, then is zeroed
            rows = qpad[..., start:stop, None]
            chunk_mask = (chunk_mask | rows if chunk_mask.dtype == torch.bool
                          else torch.where(rows, torch.zeros((), dtype=chunk_mask.dtype), chunk_mask))
        _check_rows(chunk_mask, start)
        if return_lse:
            logits = s * (qc[..., start:stop, :] @ kc[..., :kend, :].transpose(-1, -2))
            if causal and chunk_mask is None:
                chunk_mask = torch.ones(stop - start, kend, dtype=torch.bool, device=q.device).tril()
            if chunk_mask is not None:
                logits = (logits.masked_fill(~chunk_mask, -math.inf) if chunk_mask.dtype == torch.bool
                          else logits + chunk_mask)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            outs.append(torch.exp(logits - lse) @ vc[..., :kend, :])
            lses.append(lse.squeeze(-1))
        else:                                            # a square causal block without mask: SDPA's is_causal
            outs.append(F.scaled_dot_product_attention(qc[..., start:stop, :], kc[..., :kend, :], vc[..., :kend, :],
                                                       attn_mask=chunk_mask, is_causal=causal and chunk_mask is None,
                                                       scale=s))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    if out.numel() and torch.compiler.is_compiling():     # an in-graph assertion (validation.check_finite)
        check_finite(out, f"softmax_attention: the result is not finite in {ct}: the logits s·qᵀk overflow it "
                     "or v is too large; rescale q and k (or pass a smaller scale)")
    elif out.numel() and not all_finite(out):
        raise ValueError(f"softmax_attention: the result is not finite in {ct}: the logits s·qᵀk overflow it "
                         f"(s = {s:.3g}, max ‖q‖ = {max_row_norm(q):.3g}, max ‖k‖ = {max_row_norm(k):.3g}) or v is too "
                         "large; rescale q and k (or pass a smaller scale)")
    if qpad is not None:
        out = out.masked_fill(qpad[..., None], 0.0)
    out = out.to(q.dtype)
    if return_lse:
        lse = torch.cat(lses, dim=-1)
        return out, lse if qpad is None else lse.masked_fill(qpad, 0.0)
    return out


def combine_masks(q, k, causal: bool, key_padding_mask=None, attn_mask=None):
    """The masks of an attention call, validated as :func:`kernapprox.linear_attention` validates them
    (:mod:`kernapprox.attention.masks`: same conventions, same messages), and combined into one without the causal
    triangle (applied per chunk): ``None``, a bool mask (True = takes part) or a float additive mask, broadcastable
    to ``(..., n_q, n_k)`` but not expanded to it (SDPA broadcasts it)."""
    check_key_padding_mask(key_padding_mask, k)
    check_attn_mask(attn_mask, q, k)
    mask = None
    if key_padding_mask is not None:
        mask = ~key_padding_mask[..., None, :]                                  # True = takes part
    if attn_mask is not None:
        if mask is None:
            mask = attn_mask
        elif attn_mask.dtype == torch.bool:
            mask = mask & attn_mask
        else:
            mask = torch.where(mask, attn_mask, -math.inf)
    return mask


def _chunk_mask(mask, causal, start, stop, kend, device):
    """The mask of queries ``start:stop`` against keys ``:kend`` (causal triangle included), or None."""
    if not causal:
        return None if mask is None else mask[..., start:stop, :] if mask.shape[-2] > 1 else mask
    if mask is None and start == 0 and stop == kend:
        return None                                       # the whole causal matrix: SDPA's is_causal
    rows = torch.arange(start, stop, device=device)[:, None]
    tri = torch.arange(kend, device=device)[None, :] <= rows
    if mask is None:
        return tri
    part = mask[..., start:stop, :kend] if mask.shape[-2] > 1 else mask[..., :kend]
    return part & tri if part.dtype == torch.bool else part.masked_fill(~tri, -math.inf)


def _check_rows(mask, start):
    """A query row with no key left (all False, or all -inf) has no softmax: raise, naming the first such row."""
    if mask is None:
        return
    allowed = mask if mask.dtype == torch.bool else mask > -math.inf
    has_key = allowed.any(-1)
    if not bool(has_key.all()):
        where = torch.nonzero(~has_key)[0].tolist()
        batch, row = tuple(where[:-1]), start + where[-1] if has_key.shape[-1] > 1 else start
        raise ValueError(f"query {row} (batch index {batch}) has no key to attend to: key_padding_mask, attn_mask "
                         "and causal order leave it none; softmax attention over no key is undefined (0/0). Unmask a "
                         "key for it, or drop the row")


def uniform_attention(v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The trivial baseline of every attention comparison: attention that ignores the keys, ``y_i = (1/n) Σ_j
    v_j`` (non-causal) or the prefix mean ``y_i = (1/i) Σ_{j ≤ i} v_j`` (causal).

    It is softmax attention at inverse temperature 0 (every score equal), the limit ``β → 0`` of
    :func:`softmax_attention`; an estimator whose output error is not below this one's has learnt nothing from the
    keys. ``v`` is ``(..., n, d_v)``; the result has its shape and dtype.
    """
    check_tensor(v, "v")
    check_bool(causal, "causal")
    if not causal:
        return v.mean(-2, keepdim=True).expand_as(v)
    return v.cumsum(-2) / torch.arange(1, v.shape[-2] + 1, dtype=v.dtype, device=v.device)[:, None]
