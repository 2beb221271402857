"""Attention masks with torch's conventions, checked once and shared by every mode and rule.

``key_padding_mask`` (``torch.nn.MultiheadAttention``'s convention): a bool tensor ``(..., n_k)``, ``True`` =
the key is padding and is ignored by every query. It broadcasts against the inputs' batch dimensions by torch's
rules (aligned from the right), so for inputs ``(B, H, n, d)`` pass ``(B, 1, n_k)``.

``query_padding_mask``: a bool tensor ``(..., n_q)``, ``True`` = the query is padding (a left- or right-padded
batch's filler position): its output row is 0 (numerator 0, normaliser 1, log-scale 0), it needs no key to attend
to, and it adds nothing to any gradient. Broadcast like ``key_padding_mask``, against the queries.

``attn_mask`` (``torch.nn.functional.scaled_dot_product_attention``'s convention): broadcastable to
``(..., n_q, n_k)``; bool with ``True`` = the pair takes part, or a float additive mask (in the inputs' dtype)
added to the logits, ``−inf`` removing the pair.
"""

from __future__ import annotations

import math

import torch


def check_bool_mask(mask, name: str) -> None:
    """``mask`` is a bool tensor (True = padding), else ``TypeError`` naming ``name``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor (True = padding), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (True = padding, ignored), got {mask.dtype}")


def _check_padding(mask, x: torch.Tensor, name: str, what: str, hint: str) -> torch.Tensor | None:
    """A padding mask over the rows of ``x`` (keys or queries) expanded to ``x.shape[:-1]``, or ``None``."""
    if mask is None:
        return None
    check_bool_mask(mask, name)
    if mask.device != x.device:
        raise ValueError(f"{name} is on {mask.device} but the {what} are on {x.device}")
    want = tuple(x.shape[:-1])
    if mask.dim() < 1 or mask.shape[-1] != want[-1]:
        raise ValueError(f"{name} must have shape (..., {hint}) with {hint} = {want[-1]}, got {tuple(mask.shape)}")
    try:
        return mask.expand(want)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to the {what}' batch shape and "
                         f"length {want} (for inputs (B, H, n, d) pass (B, 1, {hint}))") from None


def check_key_padding_mask(mask, k: torch.Tensor) -> torch.Tensor | None:
    """``mask`` expanded to ``k.shape[:-1]`` (bool), or ``None``."""
    return _check_padding(mask, k, "key_padding_mask", "keys", "n_k")


def check_query_padding_mask(mask, q: torch.Tensor) -> torch.Tensor | None:
    """``mask`` expanded to ``q.shape[:-1]`` (bool), or ``None``."""
    return _check_padding(mask, q, "query_padding_mask", "queries", "n_q")


def mask_kwargs(key_padding_mask=None, attn_mask=None, query_padding_mask=None) -> dict:
    """The masks that are given, as keyword arguments of an attention call (none of them when all are None)."""
    masks = {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask, "query_padding_mask": query_padding_mask}
    return {name: mask for name, mask in masks.items() if mask is not None}


def check_attn_mask(mask, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``mask`` expanded to ``(..., n_q, n_k)``: bool (True = takes part) or float additive, or ``None``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor (bool: True = takes part; or float: added to the logits), "
                        f"got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        raise TypeError(f"attn_mask must be bool or have the inputs' dtype {q.dtype} (as in "
                        f"scaled_dot_product_attention), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but the inputs are on {q.device}")
    want = (*q.shape[:-2], q.shape[-2], k.shape[-2])
    if mask.dim() < 2:
        raise ValueError(f"attn_mask must have shape (..., n_q, n_k) broadcastable to {want}, got {tuple(mask.shape)}")
    # values checked before the expansion (the same values; no (..., n_q, n_k) temporary for a broadcast mask)
    if mask.dtype != torch.bool and bool((torch.isnan(mask) | (mask == math.inf)).any()):
        raise ValueError("attn_mask (additive) contains NaN or +inf; use -inf to remove a pair")
    try:
        mask = mask.expand(want)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (..., n_q, n_k) = "
                         f"{want}") from None
    return mask


def allowed_pairs(attn_mask: torch.Tensor | None, key_padding: torch.Tensor | None, causal: bool, n_q: int,
                  n_k: int, device) -> torch.Tensor | None:
    """Which (query, key) pairs take part: causal order, padding and the attention mask together, ``(..., n_q,
    n_k)`` bool (``None`` when nothing is masked and not causal)."""
    allowed = None
    if causal:
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
    if key_padding is not None:
        keep = ~key_padding[..., None, :]
        allowed = keep if allowed is None else allowed & keep
    if attn_mask is not None:
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf
        allowed = keep if allowed is None else allowed & keep
    return allowed


def check_every_row_has_a_key(has_key: torch.Tensor, why: str) -> None:
    """Raise, naming the first offending row, if ``has_key (..., n_q)`` is False anywhere."""
    if bool(has_key.all()):
        return
    where = torch.nonzero(~has_key)[0].tolist()
    batch, row = tuple(where[:-1]), where[-1]
    raise ValueError(f"query {row} (batch index {batch}) has no key to attend to: {why} leave it none and no "
                     "initial state gives it one; attention over no key is undefined (0/0). Unmask a key for it, "
                     "or drop the row")


def check_rows(*, causal: bool, key_padding: torch.Tensor | None, allowed: torch.Tensor | None,
               state_nonempty, n_q: int, exempt: torch.Tensor | None = None) -> None:
    """Every query row sees at least one key (or a non-empty initial state), else ``ValueError``; rows marked
    in ``exempt`` (``(..., n_q)``, the padded queries) need none.

    ``allowed`` (parallel mode with an ``attn_mask``) is the full pair mask; otherwise the rows are derived from
    ``key_padding`` (causal: a key at or before the row; non-causal: any key).
    """
    if allowed is None and key_padding is None:
        return                                          # every row sees its own key (causal) or all keys
    extra = state_nonempty if isinstance(state_nonempty, torch.Tensor) else None
    if state_nonempty is True:
        return
    if allowed is not None:
        has_key = allowed.any(-1)
        why = "attn_mask, key_padding_mask and causal order"
    elif causal:
        has_key = torch.cumsum((~key_padding).to(torch.int32), -1) > 0
        why = "key_padding_mask and causal order"
    else:
        has_key = (~key_padding).any(-1, keepdim=True).expand(*key_padding.shape[:-1], n_q)
        why = "key_padding_mask"
    if extra is not None:
        has_key = has_key | extra[..., None]
    if exempt is not None:
        has_key = has_key | exempt
    check_every_row_has_a_key(has_key, why)


def zero_padded_rows(num, den, logs, padded):
    """Numerator, normaliser and log-scale with the padded query rows set to ``(0, 1, 0)``: their output is 0,
    finite, and no gradient reaches the (possibly empty, 0/0) rows computed for them."""
    if padded is None:
        return num, den, logs
    return (num.masked_fill(padded[..., None], 0.0), den.masked_fill(padded, 1.0), logs.masked_fill(padded, 0.0))
