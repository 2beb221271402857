"""Hybrids of exact local attention and a feature-map estimate of the rest: sliding window + linear (Based-style)
and Scatterbrain (sparse + low-rank).

Both estimate the kernel matrix by the exact kernel on a band of keys around each query and by a feature map
``φ(q)ᵀφ(k)`` everywhere else:

    ``Â_ij = exp(s q_iᵀk_j)`` if ``(i, j)`` is in the band,  ``φ(q_i)ᵀφ(k_j)`` otherwise,

with the band ``i − w < j ≤ i`` (causal: the last ``w`` keys, the query's own included) or ``|i − j| < w``
(non-causal; positions count from 0 in both sequences). Every row is one weighted average: the exact part
(shifted by its row maximum ``m_i``) and the linear part (shifted by the features' log-scales ``ℓ(q_i) + c``) are
brought to the common scale ``L_i = max(m_i, ℓ(q_i) + c)`` before they are added, numerator and normaliser alike,
so nothing overflows and the two parts share one normaliser. The returned log-scale is ``L``.

Modes (all agree to floating-point tolerance):

``parallel``
    the whole ``n_q × n_k`` matrix (reference, small n);
``chunked``
    query chunks; the keys near a chunk (the band, widened to chunk boundaries) are handled exactly
    as in the parallel mode, the keys further away through linear-attention states of the core
    (:func:`~kernapprox.attention.recurrent.add_keys`, :func:`~kernapprox.attention.recurrent.read_queries`) —
    a running prefix state (causal, with a running maximum as stabiliser) or a prefix and a suffix state
    built by a forward and a backward sweep (non-causal). Memory O(chunk · (chunk + w)), never n × n;
``recurrent``
    token by token: a linear-attention state of the keys that left the window plus the last ``w``
    keys and values (a KV window); non-causal runs a forward and a backward scan.

Padding: ``key_padding_mask`` (True = padding) removes a key from both parts, ``query_padding_mask`` gives a padded
query the row 0; the band still counts positions, padding included, so a left-padded sequence's real tokens see
the same keys as the sequence alone (padding sits before all of them).

Decoding: :meth:`WindowLinear.decode_extend` continues causal attention from a fixed-size :class:`WindowState`
(the last ``w`` keys and values, exact, and the sum-rule linear state of the keys that left the window), the state
:func:`kernapprox.attention.decode.decode_cache` keeps for these estimators from prefill to decode. Its size is
``state_bytes``'s: it never grows with the context.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import torch

from ..attention.masks import (
    check_every_row_has_a_key,
    check_key_padding_mask,
    check_query_padding_mask,
    check_rows,
    zero_padded_rows,
)
from ..attention.recurrent import add_keys, read_queries
from ..estimators.base import AttentionEstimator, AttentionParts, FeatureMap
from ..estimators.registry import capabilities, make_estimator, register
from ..rules import SENTINEL, NormalizedState
from ..validation import check_positive_int, check_qk, check_qkv, compute_dtype, itemsize


class WindowLinear(AttentionEstimator):
    r"""Sliding-window softmax plus linear attention for the rest (Based-style hybrid).

    .. math::
        y_i = \frac{\sum_{j∈W(i)} e^{s q_i^⊤k_j} v_j + \sum_{j∉W(i)} φ(q_i)^⊤φ(k_j)\, v_j}
                   {\sum_{j∈W(i)} e^{s q_i^⊤k_j} + \sum_{j∉W(i)} φ(q_i)^⊤φ(k_j)}

    with the window ``W(i) = {j: i − w < j ≤ i}`` (causal; the sum outside it runs over ``j ≤ i − w``) or
    ``{j: |i − j| < w}`` (non-causal). The estimate of the kernel matrix is exact on the window and the feature
    map's elsewhere: **unbiased** and **positive** exactly when the feature map is (and so on for the other
    descriptive attributes, which are read from the map). With ``w ≥ n`` it is exact softmax attention.

    The recurrent state is a KV window of ``w`` keys and values plus the linear state of the keys that left it:
    ``state_bytes = (w (d + d_v) + r (d_v + 1)) · itemsize``; :meth:`decode_extend` carries exactly that state
    (:class:`WindowState`) from prefill to decode. Key and query padding masks are taken in every mode (the module
    docstring says how the band counts them). Based (Arora et al. 2024) pairs a 64-token
    window with a second-order Taylor map; here any registered feature map can be used (default ``"positive"``).

    Parameters
    ----------
    num_features : int
        ``r`` of the feature map.
    window : int
        ``w``: keys per query handled exactly (causal), or the band half-width (non-causal).
    feature_map : str
        Registry name of a feature map (not the exact kernel nor another attention-only estimator).
    feature_options : dict, optional
        Further options for the feature map (e.g. ``{"sampler": "orthogonal"}``).
    rng : int, SeedSequence or Generator
        Passed to the feature map's fit.
    scale : float, optional
        Kernel scale ``s`` (default ``1/sqrt(d)``), shared by both parts.

    Attributes
    ----------
    feature_map_ : FeatureMap
        The fitted feature map.

    References
    ----------
    Arora et al., *Simple linear attention language models balance the recall-throughput tradeoff* (Based),
    ICML 2024 (a sliding window of exact attention plus Taylor-feature linear attention).
    """

    modes = ("parallel", "recurrent", "chunked")
    unbiased = True               # the declarations below are the default map's; capabilities_for reads the map's
    positive = True
    reference = "Arora et al. 2024 (Based, ICML): exact sliding window + linear attention"
    # how it uses the linear-attention core: the keys beyond the near block are the sum-rule block states
    core: ClassVar[tuple[str, ...]] = ("add_keys", "read_queries")
    key_padding = True            # attention takes key_padding_mask (and query_padding_mask)
    decode_state = True           # decode_extend: a KV window plus a linear state, fixed in size
    subtract_support: ClassVar[bool] = False    # Scatterbrain's form: full estimate minus the band's estimate
    normalizer_floor: ClassVar[float] = 0.0     # Scatterbrain clamps the linear normaliser at 1e-24

    def __init__(self, *, num_features: int | None = None, window: int = 64, feature_map: str = "positive",
                 feature_options: dict | None = None, rng=None, scale: float | None = None):
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.window = check_positive_int(window, "window")
        if feature_options is not None and not isinstance(feature_options, dict):
            raise TypeError(f"feature_options must be a dict or None, got {type(feature_options).__name__}")
        self.feature_map = feature_map
        self.feature_options = feature_options
        self._feature_map_template()   # validate the name and the options now

    @classmethod
    def capabilities_for(cls, **options):
        """Unbiased, positive, data-dependent, causal-fit and consistent exactly when the feature map is (the
        estimate is exact on the band and the map's elsewhere)."""
        caps = super().capabilities_for(**options)
        name = options.get("feature_map", "positive")
        inner = capabilities(name, **(options.get("feature_options") or {}))
        return dataclasses.replace(caps, unbiased=inner.unbiased, positive=inner.positive,
                                   data_dependent=inner.data_dependent, causal_fit=inner.causal_fit,
                                   consistent=inner.consistent)

    def _feature_map_template(self, rng=None) -> FeatureMap:
        if capabilities(self.feature_map).kind != "features":
            raise ValueError(f"feature_map must name a finite feature map, got {self.feature_map!r}")
        return make_estimator(self.feature_map, num_features=self.num_features_param, rng=rng, scale=self.scale,
                              **(self.feature_options or {}))

    def _fit(self, q, k, rng):
        self.feature_map_ = self._feature_map_template(rng).fit(q, k)

    @property
    def num_features(self) -> int:
        """``r``, the feature dimension of the linear part's state."""
        if getattr(self, "fitted_", False):
            return self.feature_map_.num_features
        return self._feature_map_template().num_features

    @property
    def _band(self) -> Band:
        return Band(self.window, self.subtract_support, self.normalizer_floor)

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """The KV window, ``min(w, seq_len) · (d + d_v)`` numbers (``w`` without ``seq_len``), plus the feature
        map's :meth:`~kernapprox.estimators.base.Estimator.state_bytes` (its state and context state)."""
        self._check_fitted()
        check_positive_int(d_v, "d_v")
        window = self.window if seq_len is None else min(self.window, check_positive_int(seq_len, "seq_len"))
        return window * (self.dim_ + d_v) * itemsize(dtype) + self.feature_map_.state_bytes(d_v, dtype,
                                                                                             seq_len=seq_len)

    def _features(self, q, k, ct, padding=None):
        """Stabilised features of (already checked) queries and keys in the compute dtype; a padded key's
        features are 0 at the empty state's log-scale (it adds nothing to any sum)."""
        pq, lq = self.feature_map_.features(q, "query", log_scale=True, check_finite=False)
        pk, lk = self._key_features(k, ct, padding)
        return pq.to(ct), lq.to(ct), pk, lk

    def _key_features(self, k, ct, padding=None):
        pk, lk = self.feature_map_.features(k, "key", log_scale=True, check_finite=False)
        return mask_padded_keys(pk.to(ct), lk.to(ct), padding)

    # ------------------------------------------------------------------------------------ kernel matrix
    def kernel_matrix(self, q, k):
        """``Â`` ``(..., n_q, n_k)``: exact on the band ``|i − j| < w``, ``φ(q_i)ᵀφ(k_j)`` elsewhere (its lower
        triangle is the causal estimate)."""
        self._check_fitted()
        check_qk(q, k)
        self._check_dim(q)
        ct = compute_dtype(q.dtype)
        exact = torch.exp(self.scale_ * (q.to(ct) @ k.to(ct).transpose(-1, -2)))
        pq, lq, pk, lk = self._features(q, k, ct)
        approx = (pq @ pk.transpose(-1, -2)) * torch.exp(lq[..., :, None] + lk[..., None, :])
        band, _ = _masks(0, q.shape[-2], 0, k.shape[-2], self.window, False, q.device)
        if self.subtract_support:
            return (approx + torch.where(band, exact - approx, torch.zeros_like(approx))).to(q.dtype)
        return torch.where(band, exact, approx).to(q.dtype)

    # ---------------------------------------------------------------------------------------- attention
    def attention(self, q, k, v, *, causal=False, mode="chunked", chunk_size=64, return_parts=False,
                  key_padding_mask=None, query_padding_mask=None):
        """Attention with the hybrid estimate; see the module docstring for the modes and the padding masks
        (``(..., n_k)`` and ``(..., n_q)`` bool, True = padding, as :func:`kernapprox.linear_attention`'s)."""
        self._check_call(q, k, v, causal, mode, chunk_size)
        padding = check_key_padding_mask(key_padding_mask, k)
        qpad = check_query_padding_mask(query_padding_mask, q)
        check_rows(causal=causal, key_padding=padding, allowed=None, state_nonempty=None, n_q=q.shape[-2],
                   exempt=qpad)
        ct = compute_dtype(q.dtype)
        pq, lq, pk, lk = self._features(q, k, ct, padding)
        num, den, logs = window_attention_parts(q.to(ct) * self.scale_, k.to(ct), v.to(ct), pq, lq, pk, lk,
                                                band=self._band, causal=causal, mode=mode, chunk_size=chunk_size,
                                                key_padding_mask=padding)
        num, den, logs = zero_padded_rows(num, den, logs, qpad)
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, logs)
        return out

    # ----------------------------------------------------------------------------------------- decoding
    def decode_extend(self, state: WindowState | None, q, k, v, *, key_padding_mask=None,
                      query_padding_mask=None, chunk_size: int = 64):
        """Causal attention of ``n`` new tokens after the tokens a :class:`WindowState` holds: ``(out, state)``.

        New query ``i`` reads the window's keys and the new keys up to itself (exact on its band of the last
        ``w`` positions, the features' estimate on the rest of them) plus the linear state of every older key;
        then the keys that fall out of the last ``w`` positions are added to the linear state
        (:func:`~kernapprox.attention.recurrent.add_keys`, the running-maximum stabiliser) and the window keeps the
        last ``w``. ``state`` ``None`` is the empty state (the first call is the prefill). The new tokens are taken
        ``chunk_size`` at a time, so a long prompt costs ``O(n (w + chunk_size))``, never ``n × n``.

        Equal (to rounding) to the rows of the new queries of ``attention(..., causal=True)`` over the whole
        context, padding masks included (tested for prefill + one-token steps in float64). The state's tensors are
        in the compute dtype (float32 for half-precision inputs).

        Parameters
        ----------
        state : WindowState or None
        q, k, v : Tensor
            ``(..., n, d)``, ``(..., n, d)``, ``(..., n, d_v)``: the new tokens.
        key_padding_mask, query_padding_mask : bool Tensor ``(..., n)``, optional
            True = the new token is padding: its key enters neither part, its row is 0.
        chunk_size : int
            New queries per block.
        """
        self._check_fitted()
        check_qkv(q, k, v, True)
        self._check_dim(q)
        check_positive_int(chunk_size, "chunk_size")
        ct = compute_dtype(q.dtype)
        padding = check_key_padding_mask(key_padding_mask, k)
        qpad = check_query_padding_mask(query_padding_mask, q)
        batch = k.shape[:-2]
        if padding is None:
            padding = torch.zeros(*batch, k.shape[-2], dtype=torch.bool, device=k.device)
        if state is None:
            state = WindowState(k.new_zeros(*batch, 0, k.shape[-1], dtype=ct),
                                v.new_zeros(*batch, 0, v.shape[-1], dtype=ct),
                                torch.zeros(*batch, 0, dtype=torch.bool, device=k.device), None)
        elif not isinstance(state, WindowState):
            raise TypeError(f"state must be a WindowState (or None), got {type(state).__name__}")
        elif (tuple(state.keys.shape[:-2]) != tuple(batch) or state.keys.shape[-1] != k.shape[-1]
              or state.values.shape[-1] != v.shape[-1] or state.keys.dtype != ct):
            raise ValueError(f"state of keys {tuple(state.keys.shape)} ({state.keys.dtype}) and values "
                             f"{tuple(state.values.shape)} does not continue k {tuple(k.shape)} and v "
                             f"{tuple(v.shape)} in {ct}")
        outs = []
        for a in range(0, q.shape[-2], chunk_size):
            b = min(a + chunk_size, q.shape[-2])
            out, state = self._decode_block(state, q[..., a:b, :], k[..., a:b, :].to(ct), v[..., a:b, :].to(ct),
                                            padding[..., a:b], None if qpad is None else qpad[..., a:b], ct)
            outs.append(out)
        return torch.cat(outs, -2).to(q.dtype), state

    def _decode_block(self, state, q, k, v, padding, qpad, ct):
        m, n = state.keys.shape[-2], q.shape[-2]
        keys, values = torch.cat([state.keys, k], -2), torch.cat([state.values, v], -2)
        pad = torch.cat([state.padding, padding], -1)
        pk, lk = self._key_features(keys, ct, pad)
        pq, lq = self.feature_map_.features(q, "query", log_scale=True, check_finite=False)
        # the new queries sit after the window: rows [m, m + n) of a sequence whose first m rows are never read
        lead = (*q.shape[:-2], m)
        queries = torch.cat([q.new_zeros(*lead, q.shape[-1], dtype=ct), q.to(ct) * self.scale_], -2)
        pq = torch.cat([pq.new_zeros(*lead, pq.shape[-1], dtype=ct), pq.to(ct)], -2)
        lq = torch.cat([lq.new_zeros(lead, dtype=ct), lq.to(ct)], -1)
        seq = _Sequence(queries, keys, values, pq, lq, pk, lk, pad)
        far, older = None, None
        if state.linear is not None:
            num_far, den_far = read_queries(state.linear, pq[..., m:, :])
            far = num_far, den_far, state.linear.log_scale[..., None].expand(den_far.shape)
            older = state.linear.log_scale > SENTINEL / 2            # has the linear state absorbed a real key?
        has_key = (torch.cumsum((~pad).to(torch.int32), -1) > 0)[..., m:]
        if older is not None:
            has_key = has_key | older[..., None]
        if qpad is not None:
            has_key = has_key | qpad
        check_every_row_has_a_key(has_key, "key_padding_mask and causal order")
        num, den, logs = _block(seq, self._band, m, m + n, 0, m + n, True, far)
        num, den, _ = zero_padded_rows(num, den, logs, qpad)
        drop = max(0, m + n - self.window)                           # keys that leave the last w positions
        linear = state.linear
        if drop:
            linear = add_keys(linear, pk[..., :drop, :], lk[..., :drop], values[..., :drop, :])
        return num / den[..., None], WindowState(keys[..., drop:, :], values[..., drop:, :], pad[..., drop:], linear)


class Scatterbrain(WindowLinear):
    r"""Scatterbrain: sparse (exact local band) + low-rank (positive random features) attention.

    .. math::
        Â = φ(Q)φ(K)^⊤ + S,\qquad S_{ij} = \begin{cases} e^{s q_i^⊤k_j} − φ(q_i)^⊤φ(k_j) & (i,j) ∈ \text{band}\\
        0 & \text{otherwise}\end{cases}

    so ``Â`` is exact on the sparse support and the feature estimate elsewhere: **unbiased** for an unbiased
    map and **entrywise positive** for a positive one (the default, hyperbolic features with orthogonal
    projections, as in the reference code). The support is the local band ``|i − j| < w`` (``0 ≤ i − j < w``
    when causal); the reference's ``local_context`` is ``2w − 1``.

    The computation follows the reference: the near keys' contribution is the full feature estimate minus its
    part on the support, plus the exact support, and the normaliser is

        ``log Ẑ_i = logaddexp(log Σ_band e^{s q_iᵀk_j}, log max(Σ_j φ(q_i)ᵀφ(k_j) − Σ_band φ(q_i)ᵀφ(k_j), 1e-24))``

    (in stabilised units), which clamps rounding below zero. For the same support and map the estimate equals
    :class:`WindowLinear`'s; only this subtraction and the clamp differ numerically. Memory and state as in
    :class:`WindowLinear` (chunked mode: band only, never n × n).

    Parameters
    ----------
    See :class:`WindowLinear`; ``feature_map`` defaults to ``"hyperbolic_orthogonal"``.

    References
    ----------
    Chen, Dao, Winsor, Song, Rudra & Ré, *Scatterbrain: Unifying Sparse and Low-rank Attention Approximation*,
    NeurIPS 2021 (the estimator ``Â = φ(Q)φ(K)ᵀ + S``); the normaliser as in the authors' ``sblocal`` attention
    code.
    """

    reference = "Chen, Dao et al. 2021 (Scatterbrain, NeurIPS): sparse + low-rank, exact on the support"
    subtract_support = True
    normalizer_floor = 1e-24

    def __init__(self, *, num_features: int | None = None, window: int = 64,
                 feature_map: str = "hyperbolic_orthogonal", feature_options: dict | None = None, rng=None,
                 scale: float | None = None):
        super().__init__(num_features=num_features, window=window, feature_map=feature_map,
                         feature_options=feature_options, rng=rng, scale=scale)


# ---------------------------------------------------------------------------------------------- helpers
class WindowState(NamedTuple):
    """The fixed-size decoding state of :class:`WindowLinear` and :class:`Scatterbrain` after some tokens.

    Attributes
    ----------
    keys, values : Tensor
        ``(..., m, d)``, ``(..., m, d_v)``, ``m ≤ w``: the last ``m`` tokens' keys and values (compute dtype),
        the exact part's window.
    padding : bool Tensor
        ``(..., m)``: which of them are padding.
    linear : NormalizedState or None
        The sum-rule state ``(W̃, z̃, c)`` of every older key (``None`` until a key leaves the window).
    """

    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor
    linear: NormalizedState | None

    def index_select(self, index: torch.Tensor) -> WindowState:
        """The batch entries ``index`` (on the first batch dimension), as beam search reorders them."""
        linear = None if self.linear is None else NormalizedState(
            *(t.index_select(0, index.to(t.device)) for t in self.linear))
        return WindowState(*(t.index_select(0, index.to(t.device)) for t in (self.keys, self.values, self.padding)),
                           linear)

    def map(self, fn) -> WindowState:
        """``fn`` applied to every tensor (batch dimensions leading), e.g. to broadcast the state to the query heads
        of a key/value head (:class:`~kernapprox.attention.decode.GroupedQueryCache`)."""
        linear = None if self.linear is None else NormalizedState(*(fn(t) for t in self.linear))
        return WindowState(fn(self.keys), fn(self.values), fn(self.padding), linear)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds."""
        return [self.keys, self.values, self.padding, *(() if self.linear is None else self.linear)]


class Band(NamedTuple):
    """Where a hybrid is exact and how it adds the feature part: ``window`` (the band, causal: the last ``w`` keys,
    non-causal: ``|i − j| < w``), ``subtract_support`` (Scatterbrain's form: the full feature estimate minus its
    part on the band) and ``normalizer_floor`` (a clamp of the feature normaliser, Scatterbrain's ``1e-24``)."""

    window: int
    subtract_support: bool = False
    normalizer_floor: float = 0.0


def window_attention_parts(q_scaled, k, v, pq, lq, pk, lk, *, band: Band, causal: bool, mode: str = "chunked",
                           chunk_size: int = 64, key_padding_mask=None):
    r"""Numerator ``(..., n_q, d_v)``, normaliser ``(..., n_q)`` and log-scale ``(..., n_q)`` of the window + linear
    hybrid from given features: every row is

    .. math::
        y_i = \frac{\sum_{j∈W(i)} e^{s q_i^⊤k_j} v_j + \sum_{j∉W(i)} φ(q_i)^⊤φ(k_j)\, v_j}
                   {\sum_{j∈W(i)} e^{s q_i^⊤k_j} + \sum_{j∉W(i)} φ(q_i)^⊤φ(k_j)}
          = \frac{\text{num}_i}{\text{den}_i},

    both at the scale ``e^{L_i}`` (:class:`WindowLinear`'s module docstring: the exact part shifted by its row
    maximum, the features by their log-scales). The core of :class:`WindowLinear` and :class:`Scatterbrain`, and of
    trainable maps beside a window (:func:`kernapprox.trainable.feature_attention` with ``window``, LoLCATs' form:
    Zhang et al. 2025, ICLR, §3.2); the features may carry gradients (every operation is differentiable).

    Parameters
    ----------
    q_scaled : Tensor ``(..., n_q, d)``
        ``s · q``: the exact part's logits are ``q_scaled @ kᵀ``.
    k, v : Tensor ``(..., n_k, d)``, ``(..., n_k, d_v)``
    pq, lq, pk, lk : Tensor
        Stabilised features ``φ̃`` ``(..., n, r)`` and log-scales ``ℓ`` ``(..., n)`` of queries and keys
        (``φ = φ̃ e^ℓ``); a padded key's must be 0 at :data:`~kernapprox.rules.SENTINEL` (:func:`mask_padded_keys`).
    band : Band
    causal : bool
    mode : {"parallel", "chunked", "recurrent"}
        ``parallel`` materialises ``n_q × n_k``; the others sweep ``chunk_size`` queries (``1`` for
        ``recurrent``) with the band exact and the keys beyond it in linear-attention states.
    chunk_size : int
    key_padding_mask : bool Tensor ``(..., n_k)``, optional
        True = padding: the key takes part in neither part.
    """
    seq = _Sequence(q_scaled, k, v, pq, lq, pk, lk, key_padding_mask)
    if mode == "parallel":
        return _block(seq, band, 0, seq.n_q, 0, seq.n_k, causal, None)
    spans = _spans(seq.n_q, seq.n_k, band.window, chunk_size if mode == "chunked" else 1, causal)
    blocks = _causal_blocks(seq, band, spans) if causal else _bidirectional_blocks(seq, band, spans)
    nums, dens, logs = zip(*blocks)
    return torch.cat(nums, -2), torch.cat(dens, -1), torch.cat(logs, -1)


def mask_padded_keys(pk, lk, padding):
    """Stabilised key features with a padded key's set to 0 at the empty state's log-scale (it adds nothing to
    any sum); ``padding`` ``None``: unchanged."""
    if padding is None:
        return pk, lk
    return pk.masked_fill(padding[..., None], 0.0), lk.masked_fill(padding, SENTINEL)


class _Sequence:
    """Everything one attention call needs, in the compute dtype: scaled queries ``s·q`` (exact logits), keys,
    values, the stabilised features ``(φ̃, ℓ)`` of queries and keys (a padded key's are 0 at the empty
    log-scale), and the key padding ``(..., n_k)`` (or ``None``)."""

    def __init__(self, q, k, v, pq, lq, pk, lk, pad=None):
        self.q, self.k, self.v, self.pq, self.lq, self.pk, self.lk, self.pad = q, k, v, pq, lq, pk, lk, pad
        self.n_q, self.n_k = q.shape[-2], k.shape[-2]


def _block(seq, spec, a, b, lo, hi, causal, far):
    """Queries ``[a, b)`` against the near keys ``[lo, hi)`` (exact on the band, features elsewhere) plus
    ``far = (num, den, c)``: stabilised linear sums over all other keys these queries see, at scale
    ``ℓ(q) + c``. Returns numerator, normaliser and their log-scale ``L`` for the rows."""
    band, allowed = _masks(a, b, lo, hi, spec.window, causal, seq.q.device)
    if seq.pad is not None:                     # a padded key takes part in neither the band nor the rest
        real = ~seq.pad[..., None, lo:hi]
        band, allowed = band & real, allowed & real
    logits = seq.q[..., a:b, :] @ seq.k[..., lo:hi, :].transpose(-1, -2)
    masked = logits.masked_fill(~band, -math.inf)
    row_max = masked.amax(-1) if hi > lo else logits.new_full(logits.shape[:-1], -math.inf)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(masked - safe_max[..., None])
    v_near = seq.v[..., lo:hi, :]
    exact_num, exact_den = weights @ v_near, weights.sum(-1)

    lk_near = seq.lk[..., lo:hi]
    c_near = lk_near.amax(-1, keepdim=True) if hi > lo else torch.full_like(seq.lk[..., :1], -math.inf)
    c_near = torch.where(torch.isfinite(c_near), c_near, torch.zeros_like(c_near))
    gram = seq.pq[..., a:b, :] @ (seq.pk[..., lo:hi, :] * torch.exp(lk_near - c_near)[..., None]).transpose(-1, -2)
    if spec.subtract_support:
        lin = gram * allowed
        sub = gram * band
        lin_num = lin @ v_near - sub @ v_near
        lin_den = lin.sum(-1) - sub.sum(-1)
    else:
        lin = gram * (allowed & ~band)
        lin_num, lin_den = lin @ v_near, lin.sum(-1)
    lin_c = c_near.expand(lin_den.shape)
    if far is not None:
        far_num, far_den, far_c = far
        new_c = torch.maximum(lin_c, far_c)
        near_w, far_w = torch.exp(lin_c - new_c), torch.exp(far_c - new_c)
        lin_num = lin_num * near_w[..., None] + far_num * far_w[..., None]
        lin_den = lin_den * near_w + far_den * far_w
        lin_c = new_c
    if spec.normalizer_floor:
        lin_den = lin_den.clamp_min(spec.normalizer_floor)
    lin_scale = seq.lq[..., a:b] + lin_c
    log_scale = torch.maximum(row_max, lin_scale)
    exact_w = torch.exp(row_max - log_scale)
    lin_w = torch.exp(lin_scale - log_scale)
    num = exact_num * exact_w[..., None] + lin_num * lin_w[..., None]
    den = exact_den * exact_w + lin_den * lin_w
    return num, den, log_scale

def _causal_blocks(seq, band, spans):
    """``_block`` of each span in order, the keys before its near keys read from a running prefix state (the
    core's :func:`~kernapprox.attention.recurrent.add_keys`, running-maximum stabiliser)."""
    state, upto = None, 0
    for a, b, lo, hi in spans:
        if lo > upto:                                            # keys that left every window so far
            state = add_keys(state, seq.pk[..., upto:lo, :], seq.lk[..., upto:lo], seq.v[..., upto:lo, :])
            upto = lo
        far = None
        if state is not None:
            num, den = read_queries(state, seq.pq[..., a:b, :])
            far = num, den, state.log_scale[..., None].expand(den.shape)
        yield _block(seq, band, a, b, lo, hi, True, far)

def _bidirectional_blocks(seq, band, spans):
    """``_block`` of each span, the keys outside its near keys read from prefix and suffix states."""
    for (a, b, lo, hi), far in zip(spans, _far_reads(seq, spans)):
        yield _block(seq, band, a, b, lo, hi, False, far)


def _spans(n_q, n_k, window, chunk, causal):
    """``(a, b, lo, hi)`` per block of ``chunk`` queries ``[a, b)``: the near keys ``[lo, hi)`` handled by
    ``_block``, the band widened to chunk boundaries (``chunk = 1``: exactly the band, token by token). Causal
    blocks end their near keys at ``b``; ``lo`` and ``hi`` never decrease."""
    spans = []
    for a in range(0, n_q, chunk):
        b = min(a + chunk, n_q)
        lo = (max(0, a - window + 1) // chunk) * chunk              # keys before lo are outside every band
        if causal:
            spans.append((a, b, lo, b))
        else:
            spans.append((a, b, min(n_k, lo), min(n_k, -(-(b - 1 + window) // chunk) * chunk)))
    return spans


def _masks(a, b, lo, hi, window, causal, device):
    """``band`` and ``allowed`` (which keys a query sees at all) for rows ``[a, b)`` and columns ``[lo, hi)``."""
    rows = torch.arange(a, b, device=device)[:, None]
    cols = torch.arange(lo, hi, device=device)[None, :]
    if causal:
        allowed = cols <= rows
        return allowed & (cols > rows - window), allowed
    return (cols - rows).abs() < window, torch.ones_like(cols - rows, dtype=torch.bool)


def _far_reads(seq, spans):
    """Non-causal far sums for each span ``(a, b, lo, hi)``: the keys ``[0, lo)`` and ``[hi, n_k)`` read by the
    queries ``[a, b)``, as ``(num, den, c)``. A prefix state grown by a forward sweep and a suffix state grown by a
    backward sweep (states are never subtracted), both by the core's
    :func:`~kernapprox.attention.recurrent.add_keys` from an empty state at one constant shift per (batch, head),
    ``c = max ℓ(k)`` (so no key rescales them). ``lo`` and ``hi`` must not decrease along the spans."""
    c = seq.lk.amax(-1)
    r, d_v = seq.pk.shape[-1], seq.v.shape[-1]
    w0 = torch.zeros(*seq.pk.shape[:-2], r, d_v, dtype=seq.pk.dtype, device=seq.pk.device)
    empty = NormalizedState(w0, w0[..., 0], c)

    def add(state, start, stop):
        return add_keys(state, seq.pk[..., start:stop, :], seq.lk[..., start:stop], seq.v[..., start:stop, :])

    state, upto, before = empty, 0, []
    for a, b, lo, _ in spans:
        if lo > upto:
            state, upto = add(state, upto, lo), lo
        before.append(read_queries(state, seq.pq[..., a:b, :]))
    state, start, after = empty, seq.n_k, []
    for a, b, _, hi in reversed(spans):
        if hi < start:
            state, start = add(state, hi, start), hi
        after.append(read_queries(state, seq.pq[..., a:b, :]))
    after.reverse()
    return [(pre[0] + post[0], pre[1] + post[1], c[..., None].expand(pre[1].shape))
            for pre, post in zip(before, after)]


register("window_linear", WindowLinear, feature_map="positive")
register("scatterbrain", Scatterbrain, feature_map="hyperbolic_orthogonal")
