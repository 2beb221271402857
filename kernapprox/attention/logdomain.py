"""Linear attention where the stabilised features are not enough: detection, a float64 retry and an exact
log-domain path.

The fast modes (:mod:`.linear`) multiply stabilised features ``φ̃ = φ e^{−ℓ}`` (entries ≤ 1, one scale per
vector) and weigh keys by ``e^{ℓ_k − c}`` with ``c`` their (running) maximum, so every term of a row's normaliser
is ≤ 1. That is exact unless the features of one vector span more than the compute dtype's range: a map of the
exponential family at large norms (DERF/OPRF in float32 at ``‖x‖² ≳ 150``) has entries ``e^{p_j − max p}`` that
underflow to 0, and a row whose dominant query–key terms sit at such entries loses all of them — a zero
normaliser (NaN output) or one made of the wrong terms.

Detection (:func:`needs_recompute`). Every stabilised term is at most 1 in absolute value (up to the map's
constant), and a term lost to underflow is below ``tiny`` (smallest normal number) of the compute dtype. So if a
row's stabilised normaliser is at least ``τ = sqrt(tiny)`` (1e-19 in float32) in absolute value, what was lost is
at most ``n_k·r·tiny``, a relative error below ``n_k·r·sqrt(tiny)`` of it (and of the sum of the terms' absolute
values, for signed maps): the row is exact to rounding. Only rows below ``τ`` (or non-finite) are in doubt. The
test costs one reduction over the ``(..., n)`` normalisers; ordinary inputs never fail it, so the common path is
the fast path plus that reduction. A signed map (trigonometric, Maclaurin, Nyström, Taylor, DPFP) may have a small
or zero normaliser by cancellation — the estimator's own behaviour, measured by
:func:`kernapprox.metrics.nonpositive_normalizer_rate` — and is then recomputed too (rarely, and to the same
value, more precisely); a zero normaliser stays zero.

Recomputation (:func:`recompute`). First the same mode in float64 (range ``e^{±708}`` instead of ``e^{±88}``: the
features of one vector may then span ~1400 nats instead of ~190), returned in the input dtype; if rows are still in
doubt, :func:`log_domain_attention` computes every pair's kernel estimate in the log domain,
``log κ̂(q_i, k_j) = logsumexp_l (L_q,il + L_k,jl)`` from :meth:`FeatureMap.log_features` (exact exponents, no
underflow), then a softmax over keys: exact for any finite input, at ``O(n_q n_k r)`` time and memory bounded by
query chunks. Where even the log-scale is not finite (inputs whose squared norms overflow the dtype, where exact
attention's logits overflow too) attention raises ``ValueError`` naming the cause.

References
----------
Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021 (the stabiliser of positive features);
Likhosherstov et al., *Dense-Exponential Random Features*, NeurIPS 2023 (the maps whose features span widest).
"""

from __future__ import annotations

import math

import torch

from ..estimators.base import AttentionParts, Estimator
from ..validation import compute_dtype

# Query chunks of the log-domain path hold at most this many (query, key, feature) terms (float64: 32 MiB).
LOG_DOMAIN_TERMS = 1 << 22


def trusted_normalizer(dtype: torch.dtype) -> float:
    """``τ = sqrt(tiny)`` of ``dtype``: a stabilised normaliser of a positive map at least this large is exact to
    rounding (what underflowed is below ``n_k · r · sqrt(tiny)`` of it)."""
    return math.sqrt(torch.finfo(dtype).tiny)


def needs_recompute(estimator: Estimator, normalizer: torch.Tensor, log_scale: torch.Tensor) -> bool:
    """Whether the fast result must be recomputed: a row whose stabilised normaliser is below
    :func:`trusted_normalizer` in absolute value, or not finite. Raises ``ValueError`` when a log-scale is not
    finite (then no recomputation can help: the inputs' norms overflow the dtype)."""
    if not log_scale.numel():
        return False
    lo, hi = torch.aminmax(log_scale.detach())
    small = normalizer.detach().abs().amin()
    ok = torch.isfinite(lo) & torch.isfinite(hi) & (small >= trusted_normalizer(normalizer.dtype))
    if bool(ok):
        return False
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise _overflow_error(estimator, log_scale.dtype)
    return True


def check_state_read(estimator: Estimator, normalizer: torch.Tensor, log_scale: torch.Tensor) -> None:
    """For :class:`~kernapprox.attention.recurrent.RecurrentState`: raise ``ValueError`` where a read cannot be
    trusted (:func:`needs_recompute`). A streaming state cannot be recomputed: what underflowed in it is gone, so
    the message names the fix (run the state in float64, or rescale the inputs)."""
    if not estimator.capabilities().positive:          # a signed normaliser may be small or ≤ 0 by cancellation
        lo, hi = torch.aminmax(log_scale.detach())
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise _overflow_error(estimator, log_scale.dtype)
        return
    if needs_recompute(estimator, normalizer, log_scale):
        fix = ("run the state in float64 (cast q_t, k_t, v_t) or rescale the inputs (a smaller scale)"
               if normalizer.dtype != torch.float64 else "rescale the inputs (a smaller scale), or use "
               "kernapprox.linear_attention on the whole sequence, which falls back to an exact log-domain path")
        raise ValueError(f"{type(estimator).__name__}: a read of the recurrent state lost its dominant terms to "
                         f"underflow in {normalizer.dtype} (the features of one vector span more than its range, "
                         f"e.g. an exponential map at large input norms); {fix}")


def _overflow_error(estimator, dtype) -> ValueError:
    return ValueError(f"{type(estimator).__name__}: the log-scale of the features is not finite in {dtype}: the "
                      "squared norms of the scaled inputs overflow it (exact attention's logits would overflow as "
                      "well); rescale q and k or pass a smaller scale")


def recompute(q, k, v, estimator: Estimator, causal: bool, attention, *, rule=None, initial_state=None,
              return_state: bool = False, key_padding_mask=None, attn_mask=None, **options) -> AttentionParts:
    """The parts of a feature map's attention, recomputed where the fast path is in doubt.

    ``attention`` is the fast entry point (:func:`kernapprox.linear_attention`), called again in float64 with the
    same rule, masks and ``options`` (mode, chunk size); if that is still in doubt (or the inputs are float64
    already), :func:`log_domain_attention` (sum rule). Returns parts in the compute dtype of ``q`` with the
    normaliser rescaled to ±1 (its size moved into ``log_scale``; a zero normaliser stays 0), so nothing of the
    float64 range is needed to represent them. A call that starts from or returns a recurrent state, or a decay
    rule in float64, cannot be recomputed: it raises ``ValueError`` naming the cause and the fix.
    """
    ct = compute_dtype(q.dtype)
    rule_name = "sum" if rule is None else rule.name
    if initial_state is not None or return_state:
        raise ValueError(f"{type(estimator).__name__}: some rows lost their dominant terms to underflow in {ct} (the "
                         "features of one vector span more than its range, e.g. an exponential map at large input "
                         "norms), and a call with initial_state/return_state cannot be recomputed in another "
                         "precision; cast the inputs (and the state) to float64, or rescale them")
    masks = {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask}
    if ct != torch.float64:
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            masks["attn_mask"] = attn_mask.double()
        parts = attention(q.double(), k.double(), v.double(), estimator, causal, rule=rule, return_parts=True,
                          **masks, **options)
    elif rule_name != "sum":
        raise ValueError(f"{type(estimator).__name__}: some rows lost their dominant terms to underflow even in "
                         f"float64 (the features of one vector span more than its range); the exact log-domain path "
                         f"covers the sum rule only, not {rule_name!r}: rescale the inputs (a smaller scale)")
    else:
        parts = log_domain_attention(q, k, v, estimator, causal, **masks)
    den = parts.normalizer
    size = torch.where(den != 0, den.abs(), torch.ones_like(den))      # a zero normaliser stays zero (flagged)
    return AttentionParts(parts.output.to(ct), (parts.numerator / size[..., None]).to(ct), (den / size).to(ct),
                          (parts.log_scale + torch.log(size)).to(ct))


def log_domain_attention(q, k, v, estimator: Estimator, causal: bool = False, *, key_padding_mask=None,
                         attn_mask=None, max_terms: int = LOG_DOMAIN_TERMS) -> AttentionParts:
    """Exact linear attention of a feature map in the log domain, float64: ``a_ij = logsumexp_l(L_q,il + L_k,jl)``
    with ``L = log|φ|`` from :meth:`~kernapprox.estimators.base.FeatureMap.log_features` (signs carried
    separately), masked if causal, then ``y_i = Σ_j e^{a_ij − m_i} s_ij v_j / Σ_j e^{a_ij − m_i} s_ij`` with
    ``m_i = max_j a_ij``. Masks as in :func:`kernapprox.linear_attention` (``key_padding_mask`` True = padding;
    ``attn_mask`` bool True = takes part, or float added to ``a_ij``).

    Every pair's largest term is factored out before any ``exp``, so nothing underflows that matters and nothing
    overflows: correct for any finite log-features, whatever their span. Cost ``O(n_q n_k r)``: the last resort
    of :func:`recompute`, and the test oracle for large norms. Returns :class:`AttentionParts` in float64 with
    ``normalizer = Σ_j e^{a_ij − m_i} s_ij`` and ``log_scale = m``.
    """
    lq, sq = estimator.log_features(q.double(), "query", check_finite=False)
    lk, sk = estimator.log_features(k.double(), "key", check_finite=False)
    vd = v.double()
    n_q, n_k, r = lq.shape[-2], lk.shape[-2], lq.shape[-1]
    extra = None                                         # (..., n_q or 1, n_k) additive log-mask, -inf = left out
    if key_padding_mask is not None:
        extra = torch.zeros(key_padding_mask.shape, dtype=torch.float64, device=q.device)
        extra = extra.masked_fill(key_padding_mask, -math.inf)[..., None, :]
    if attn_mask is not None:
        add = (torch.zeros(attn_mask.shape, dtype=torch.float64, device=q.device).masked_fill(~attn_mask, -math.inf)
               if attn_mask.dtype == torch.bool else attn_mask.double())
        extra = add if extra is None else extra + add
    batch = max(1, lq.numel() // max(n_q * r, 1))
    step = max(1, max_terms // max(batch * n_k * r, 1))
    nums, dens, scales = [], [], []
    for start in range(0, n_q, step):
        stop = min(start + step, n_q)
        terms = lq[..., start:stop, None, :] + lk[..., None, :, :]                  # (..., c, n_k, r)
        top = terms.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))          # a pair of zero features
        pair = (sq[..., start:stop, None, :] * sk[..., None, :, :] * torch.exp(terms - top)).sum(-1)
        log_pair = torch.log(pair.abs()) + top[..., 0]                               # log|κ̂|, (..., c, n_k)
        if extra is not None:
            log_pair = log_pair + (extra[..., start:stop, :] if extra.shape[-2] > 1 else extra)
        if causal:
            rows = torch.arange(start, stop, device=q.device)[:, None]
            log_pair = log_pair.masked_fill(torch.arange(n_k, device=q.device)[None, :] > rows, -math.inf)
        m = log_pair.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        weights = torch.sign(pair) * torch.exp(log_pair - m)
        nums.append(weights @ vd)
        dens.append(weights.sum(-1))
        scales.append(m[..., 0])
    num, den, log_scale = torch.cat(nums, -2), torch.cat(dens, -1), torch.cat(scales, -1)
    return AttentionParts(num / den[..., None], num, den, log_scale)
