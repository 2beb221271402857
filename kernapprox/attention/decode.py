"""One cache object from prefill to decode, for every causal estimator: the same calls whatever it keeps.

:func:`decode_cache` returns, for a fitted estimator, the object a decoder holds between calls:

:class:`FeatureStateCache` (feature maps)
    the fixed-size state of :func:`~kernapprox.attention.linear.linear_attention` under its rule (sum: the
    normalised ``(W̃, z̃, c)`` of :class:`~kernapprox.rules.NormalizedState`), carried from one call to the next by
    ``initial_state``/``return_state``; its size does not grow with the context.
:class:`KVCache` (``exact``)
    the keys and values of every token so far (and which of them are padding): softmax attention of the new
    queries over all of them, each new query seeing the cached keys and the new keys up to itself.
:class:`EstimatorStateCache` (estimators with their own attention that declare ``decode_state``: the hybrids
    ``window_linear`` and ``scatterbrain``)
    the estimator's own fixed-size state, carried by its ``decode_extend`` (the hybrids: the last ``w`` keys and
    values plus the linear state of the keys that left the window, :class:`~kernapprox.approximate.hybrid.WindowState`);
    its size does not grow with the context either.

Estimators whose output at a token depends on the other queries of the call (declared ``query_dependent``: EVA,
the kernel SVD reference), that define no causal attention, or that bring their own attention without a decoding
state have no decoding cache: :func:`decode_cache` raises ``ValueError`` naming them.

Every cache has the same calls. With ``q, k, v`` ``(..., n, d)``, ``(..., n, d)``, ``(..., n, d_v)`` the next ``n``
tokens of every batch entry:

``extend(q, k, v, key_padding_mask=None, query_padding_mask=None)``
    causal attention of the new tokens: new query ``i`` sees every cached token and the new tokens ``≤ i``, then
    the cache holds all of them. The first call is the prefill
    (:meth:`~kernapprox.attention.decode.DecodeCache.prefill` is the same call on an empty cache); later calls
    continue it with one token or more. Padding masks as in
    :func:`~kernapprox.attention.linear.linear_attention`, for the new tokens (``(..., n)``, True = padding): a
    padded key enters no state, a padded query's row is 0.
``step(q_t, k_t, v_t)``
    one token ``(..., d)``: ``extend`` of a sequence of one, returning ``(..., d_v)``.
``state_bytes()``
    the memory the cache stands for, in the convention of :mod:`kernapprox.memory` and the memory axes: the
    estimator's :meth:`~kernapprox.estimators.base.Estimator.state_bytes` at the state's dtype and the number of
    tokens seen, times the batch entries. ``held_bytes()`` is what its tensors occupy now (a hybrid's also holds
    its window's padding flags, one byte a token, which ``state_bytes`` does not count).

Precision: states are kept in the compute dtype (float32 for half-precision inputs, float64 for float64), and the
core runs with autocast disabled, so a prefill under ``torch.autocast(dtype=torch.bfloat16)`` keeps float32 states
(the outputs come back in the inputs' dtype). The KV cache keeps the keys and values in their own dtype, as a
model's KV cache does.

Prefill followed by decoding gives the full causal pass's outputs (to rounding): the tests check it for every
registered causal estimator in float64.

>>> import torch, kernapprox as ka
>>> from kernapprox.attention.decode import decode_cache
>>> gen = torch.Generator().manual_seed(0)
>>> q, k, v = (torch.randn(2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(3))
>>> est = ka.make_estimator("positive", num_features=32, rng=0).fit(q, k)
>>> cache = decode_cache(est)
>>> head = cache.extend(q[:, :10], k[:, :10], v[:, :10])                 # prefill
>>> y10, y11 = cache.step(q[:, 10], k[:, 10], v[:, 10]), cache.step(q[:, 11], k[:, 11], v[:, 11])
>>> full = ka.linear_attention(q, k, v, est, causal=True)
>>> bool(torch.allclose(torch.stack([y10, y11], -2), full[:, 10:], atol=1e-12)), cache.num_tokens
(True, 12)
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..estimators.base import Estimator
from ..rules import NormalizedState, resolve_rule, to_internal, to_public
from ..validation import check_float_dtype, check_qkv, compute_dtype
from . import logdomain
from .exact import softmax_attention
from .linear import linear_attention
from .masks import mask_kwargs
from .recurrent import normalized_read, normalized_step

__all__ = ["decode_cache", "DecodeCache", "FeatureStateCache", "KVCache", "EstimatorStateCache", "GroupedQueryCache"]


def decode_cache(estimator: Estimator, *, mode: str | None = None, rule="sum",
                 state_dtype: torch.dtype | None = None) -> DecodeCache:
    """The decoding cache of a fitted ``estimator`` (see the module docstring): :class:`FeatureStateCache` for a
    feature map, :class:`KVCache` for the exact kernel, :class:`EstimatorStateCache` for a causal estimator with its
    own attention that declares ``decode_state``.

    Parameters
    ----------
    estimator : Estimator
        Fitted.
    mode : str, optional
        The attention mode of the calls (default: ``"chunked"`` where declared, else the first declared mode).
    rule : str or rule object
        The state rule of a feature map (:mod:`kernapprox.rules`; default the sum). Other kinds take the sum only.
    state_dtype : torch.dtype, optional
        The floating dtype the cache computes in and keeps its state (or keys and values) in; the outputs come back
        in the inputs' dtype. Default: the inputs' compute dtype (float32 for half-precision inputs). ``float64``
        serves maps whose features span more than float32's range on the model's activations (a float32 call
        raises naming that cause, and a call that continues a state cannot be recomputed in float64 by itself).

    Raises
    ------
    ValueError
        The estimator defines no causal attention, its output depends on the other queries of a call
        (``query_dependent``: no prefill + decode reproduces its full pass), or it brings its own attention and
        keeps no decoding state (``decode_state`` False).
    """
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator must be a kernapprox estimator, got {type(estimator).__name__}")
    estimator._check_fitted()
    caps = estimator.capabilities()
    name = type(estimator).__name__
    if not caps.causal:
        raise ValueError(f"{name} defines no causal attention, so it has no decoding cache (a decoder's token sees "
                         "only the tokens before it)")
    if mode is not None and mode not in caps.modes:
        raise ValueError(f"mode {mode!r} is not supported by {name}; supported: {', '.join(caps.modes)}")
    rule = resolve_rule(rule)
    check_float_dtype(state_dtype, "state_dtype", allow_none=True)
    if caps.kind == "features":
        return FeatureStateCache(estimator, mode=mode, rule=rule, state_dtype=state_dtype)
    if rule.name != "sum":
        raise ValueError(f"rule {rule.name!r} needs a feature map; {name} takes the sum rule only")
    if caps.kind == "exact":
        return KVCache(estimator, state_dtype=state_dtype)
    if caps.query_dependent:
        raise ValueError(f"{name} has no decoding cache: its output at a token depends on the other queries of the "
                         "call (it is query_dependent: proposals, landmarks or a fit on the call's queries), so a "
                         "prefill followed by one-token steps cannot reproduce its full causal pass")
    if not caps.decode_state:
        raise ValueError(f"{name} brings its own attention and keeps no decoding state (decode_state is False): "
                         "implement decode_extend and declare decode_state = True to decode with it")
    return EstimatorStateCache(estimator, state_dtype=state_dtype)


def _default_mode(estimator: Estimator, mode: str | None) -> str:
    modes = estimator.capabilities().modes
    if mode is not None:
        return mode
    return "chunked" if "chunked" in modes else modes[0]


def _no_autocast(x: torch.Tensor):
    """Autocast disabled for the core's products (its states stay in the compute dtype)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def _check_padding(mask, name: str, n: int):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (..., n) (True = padding), got "
                        f"{type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype}")
    if mask.dim() < 1 or mask.shape[-1] != n:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not end in the {n} new tokens")
    return mask


class DecodeCache:
    """The calls every decoding cache has (see the module docstring); subclasses keep what their estimator needs.

    Attributes
    ----------
    estimator : Estimator
    mode : str
    num_tokens : int
        Tokens seen so far (padding included).
    """

    def __init__(self, estimator: Estimator, *, mode: str | None = None, state_dtype: torch.dtype | None = None):
        self.estimator = estimator
        self.mode = _default_mode(estimator, mode)
        self.state_dtype = state_dtype
        self.num_tokens = 0
        self._batch = None             # batch shape and d_v, fixed by the first call
        self._d_v = None

    def prefill(self, q, k, v, *, key_padding_mask=None, query_padding_mask=None) -> torch.Tensor:
        """The first call (the cache must be empty): causal attention of the prompt, kept."""
        if self.num_tokens:
            raise ValueError(f"prefill on a cache that holds {self.num_tokens} tokens already: use extend (or reset)")
        return self.extend(q, k, v, key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask)

    def extend(self, q, k, v, *, key_padding_mask=None, query_padding_mask=None) -> torch.Tensor:
        """Causal attention of ``n`` new tokens after the cached ones; the cache then holds them too."""
        check_qkv(q, k, v, True)
        key_padding_mask = _check_padding(key_padding_mask, "key_padding_mask", k.shape[-2])
        query_padding_mask = _check_padding(query_padding_mask, "query_padding_mask", q.shape[-2])
        if self._batch is not None and (tuple(q.shape[:-2]) != self._batch or v.shape[-1] != self._d_v):
            raise ValueError(f"q/v of shapes {tuple(q.shape)}, {tuple(v.shape)} do not continue the cache of batch "
                             f"shape {self._batch} and d_v={self._d_v}")
        dtype = q.dtype
        if self.state_dtype is not None:
            q, k, v = q.to(self.state_dtype), k.to(self.state_dtype), v.to(self.state_dtype)
        out = self._extend(q, k, v, key_padding_mask, query_padding_mask).to(dtype)
        self._batch, self._d_v = tuple(q.shape[:-2]), v.shape[-1]
        self.num_tokens += k.shape[-2]
        return out

    def step(self, q_t, k_t, v_t, *, key_padding_mask=None) -> torch.Tensor:
        """One token ``(..., d)``, ``(..., d)``, ``(..., d_v)``: its output ``(..., d_v)``. ``key_padding_mask``
        (the batch shape, True = padding): the token is padding for that entry."""
        pad = None if key_padding_mask is None else key_padding_mask[..., None]
        return self.extend(q_t[..., None, :], k_t[..., None, :], v_t[..., None, :], key_padding_mask=pad,
                           query_padding_mask=pad)[..., 0, :]

    def reset(self) -> None:
        """Empty the cache (the estimator is kept)."""
        self.num_tokens = 0
        self._batch = self._d_v = None

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch entries ``index`` (a long tensor on the first batch dimension; beam search reorders)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes of the tensors the cache holds now."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self):
        return []

    def _map_state(self, fn) -> None:
        """Apply ``fn`` to every tensor of the state (batch dimensions leading)."""
        raise NotImplementedError

    def _broadcast_state(self, groups: int) -> None:
        """Give the state a new last batch dimension of ``groups`` (a view: every member reads the same state), as
        :class:`GroupedQueryCache` shows one key/value head's state to its query heads for a call."""
        if self._batch is not None:
            nb = len(self._batch)
            self._map_state(lambda t: t.unsqueeze(nb).expand(*t.shape[:nb], groups, *t.shape[nb:]))
            self._batch = (*self._batch, groups)

    def _keep_first_member(self) -> None:
        """Drop the last batch dimension, keeping its first member (the inverse of :meth:`_broadcast_state` after a
        call in which every member added the same keys)."""
        nb = len(self._batch) - 1
        self._map_state(lambda t: t.select(nb, 0).contiguous())
        self._batch = self._batch[:-1]

    def _entries(self) -> int:
        return math.prod(self._batch) if self._batch is not None else 0

    def _estimator_bytes(self, dtype: torch.dtype) -> int:
        """Batch entries × the estimator's ``state_bytes(d_v, dtype, seq_len=tokens seen)``: the memory axes'
        convention for what the cache stands for."""
        return self._entries() * self.estimator.state_bytes(self._d_v, dtype, seq_len=max(self.num_tokens, 1))

    def _extend(self, q, k, v, key_padding, query_padding):
        raise NotImplementedError


class FeatureStateCache(DecodeCache):
    """The fixed-size state of a feature map under a rule, from prefill to decode.

    ``extend`` is ``linear_attention(q, k, v, estimator, causal=True, rule=rule, initial_state=state,
    return_state=True)``: the new tokens' keys come after the state's, each new query reads the state plus the new
    keys up to itself. ``state`` (the rule's public tuple, :mod:`kernapprox.rules`) is ``None`` before the first
    call; its tensors are in the compute dtype (float32 under half-precision inputs or autocast).
    """

    def __init__(self, estimator: Estimator, *, mode: str | None = None, rule="sum", state_dtype=None):
        super().__init__(estimator, mode=mode, state_dtype=state_dtype)
        self.rule = resolve_rule(rule)
        self.state = None

    def _extend(self, q, k, v, key_padding, query_padding):
        with _no_autocast(q):
            if q.shape[-2] == 1 and key_padding is None and query_padding is None:
                out = self._one_token(q, k, v)
                if out is not None:
                    return out.to(q.dtype)
            out, self.state = linear_attention(q, k, v, self.estimator, causal=True, mode=self.mode, rule=self.rule,
                                               initial_state=self.state, return_state=True,
                                               **mask_kwargs(key_padding, query_padding_mask=query_padding))
        return out

    def _one_token(self, q, k, v, *, grouped: bool = False):
        """The decoding step of the sum and decay rules without the sequence machinery: the recurrent mode's
        update and read (:func:`~kernapprox.attention.recurrent.normalized_step`,
        :func:`~kernapprox.attention.recurrent.normalized_read`, the same arithmetic as ``linear_attention``'s
        recurrent mode; an entry whose state holds no key yet starts from the empty state's sentinel, as there).
        ``None`` (the general path then runs the step) before the first token, for another rule, a state of
        another dtype or device, or a read whose normaliser cannot be trusted
        (:func:`~kernapprox.attention.logdomain.needs_recompute`: the general path raises or recomputes as it does
        for every call). ``grouped`` (:meth:`grouped_step`): ``q`` and ``k`` carry a group axis before the token,
        ``(..., H_kv, G, 1, d)`` (``k`` broadcast over it); the state takes the first member's key features and is
        read by every member. Returns the output in the compute dtype."""
        if self.state is None or not self.rule.normalized:
            return None
        state = to_internal(self.state)
        ct = state.w.dtype
        if compute_dtype(q.dtype) != ct or q.device != state.w.device:
            return None
        pk, lk = self.estimator.features(k, "key", log_scale=True, check_finite=False)
        pq, _ = self.estimator.features(q, "query", log_scale=True, check_finite=False)
        if grouped:                                       # the key's features: the broadcast call's first member
            pk, lk = pk[..., 0, :, :], lk[..., 0, :]
        new = normalized_step(state, pk[..., 0, :].to(ct), lk[..., 0].to(ct), v[..., 0, :].to(ct),
                              self.rule.log_decay)
        read = NormalizedState(new.w.unsqueeze(-3), new.z.unsqueeze(-2), new.log_scale.unsqueeze(-1)) if grouped \
            else new                                      # the state broadcast over the G readers
        num, den = normalized_read(read, pq[..., 0, :].to(ct))
        if logdomain.needs_recompute(self.estimator, den, new.log_scale):
            return None
        self.state = to_public(new)
        return (num / den[..., None])[..., None, :]

    def grouped_step(self, qg, k, v, *, validated: bool = False):
        """One new token of every key/value head, read by its ``G`` query heads (the decoding step of
        :class:`GroupedQueryCache`): ``qg`` ``(..., H_kv, G, 1, d)``, ``k`` ``(..., H_kv, 1, d)``, ``v``
        ``(..., H_kv, 1, d_v)``; returns ``(..., H_kv, G, 1, d_v)``, or ``None`` where :meth:`_one_token` would
        decline (the caller then runs the general path).

        The same numbers as :meth:`extend` on the state broadcast to the ``G`` query heads (every member then holds
        the same state, and the cache keeps the first): the key's features are those of the broadcast call's first
        member, the state ``(W̃, z̃, c)`` is updated once (:func:`~kernapprox.attention.recurrent.normalized_step`)
        and read by the ``G`` queries (:func:`~kernapprox.attention.recurrent.normalized_read` with the state
        broadcast over ``G``: ``y_h = W̃ φ̃(q_h) / ⟨z̃, φ̃(q_h)⟩``, Katharopoulos et al. 2020, eq. 18–20). It does not
        update ``G`` copies of the state and copy one back, which the general path does. ``validated``: the caller
        has checked that the three tensors are floating point, of one dtype and device, and finite (a model's
        decoding step checks its whole layer once); the shapes are checked here either way."""
        if (self.state is None or not self.rule.normalized or self._batch != tuple(k.shape[:-2])
                or v.shape[-1] != self._d_v or k.shape[-2] != 1):
            return None
        g = qg.shape[-3]
        kg, vg = (t.unsqueeze(-3).expand(*t.shape[:-2], g, *t.shape[-2:]) for t in (k, v))
        if not validated:
            check_qkv(qg, kg, vg, True)
        elif not (qg.shape[:-2] == kg.shape[:-2] == vg.shape[:-2] and qg.shape[-1] == kg.shape[-1]
                  and qg.shape[-2] == 1):
            raise ValueError(f"grouped step: q {tuple(qg.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                             "make one token of G query heads per key/value head")
        dtype = qg.dtype
        if self.state_dtype is not None:
            qg, kg, v = qg.to(self.state_dtype), kg.to(self.state_dtype), v.to(self.state_dtype)
        with _no_autocast(qg):
            out = self._one_token(qg, kg, v, grouped=True)
        if out is None:
            return None
        self.num_tokens += 1
        return out.to(dtype)

    def reset(self) -> None:
        super().reset()
        self.state = None

    def select(self, index: torch.Tensor) -> None:
        if self.state is not None:
            self.state = type(self.state)(*(t.index_select(0, index.to(t.device)) for t in self.state))
            self._batch = (len(index), *self._batch[1:])

    def _tensors(self):
        return [] if self.state is None else list(self.state)

    def _map_state(self, fn) -> None:
        if self.state is not None:
            self.state = type(self.state)(*(fn(t) for t in self.state))

    def state_bytes(self) -> int:
        """Batch entries × the estimator's ``state_bytes(d_v, state dtype)``: ``r (d_v + 1)`` numbers for the sum and
        decay rules plus the fitted context state (the memory axes' convention); 0 before the first call."""
        if self.state is None:
            return 0
        if self.rule.name in ("sum", "decay"):
            return self._estimator_bytes(self.state[0].dtype)
        # another rule's own state: every tensor it keeps
        per_entry = sum(t[(0,) * len(self._batch)].numel() for t in self.state) * self.state[0].element_size()
        return self._entries() * per_entry


class KVCache(DecodeCache):
    """The exact kernel's cache: the keys and values of every token so far, and which are padding.

    ``extend`` is softmax attention (:func:`~kernapprox.attention.exact.softmax_attention`, the estimator's scale)
    of the new queries over the cached and the new keys, new query ``i`` seeing the cached keys and new keys
    ``≤ i``; the keys and values are kept in their own dtype.
    """

    def __init__(self, estimator: Estimator, *, state_dtype=None):
        super().__init__(estimator, mode=None, state_dtype=state_dtype)
        self.keys = self.values = None
        self.padding = None              # (..., n) bool, True = padding; None while no key was padding

    def _extend(self, q, k, v, key_padding, query_padding):
        n_new = k.shape[-2]
        past = 0 if self.keys is None else self.keys.shape[-2]
        if past and (self.keys.dtype != k.dtype or self.keys.device != k.device):
            raise TypeError(f"k has dtype {k.dtype} on {k.device} but the cache holds {self.keys.dtype} on "
                            f"{self.keys.device}")
        keys = k if not past else torch.cat([self.keys, k], -2)
        values = v if not past else torch.cat([self.values, v], -2)
        padding = self.padding
        if key_padding is not None or padding is not None:
            new = (key_padding.expand(*k.shape[:-2], n_new) if key_padding is not None
                   else torch.zeros(*k.shape[:-2], n_new, dtype=torch.bool, device=k.device))
            old = (padding if padding is not None
                   else torch.zeros(*k.shape[:-2], past, dtype=torch.bool, device=k.device))
            padding = torch.cat([old.expand(*k.shape[:-2], past), new], -1)
        extra = mask_kwargs(padding, query_padding_mask=query_padding)
        with _no_autocast(q):
            if not past:
                out = softmax_attention(q, keys, values, True, self.estimator.scale_, **extra)
            else:                  # the new rows: every cached key, and the new keys up to the row
                rows = torch.arange(n_new, device=q.device)[:, None]
                cols = torch.arange(past + n_new, device=q.device)[None, :]
                allowed = cols <= rows + past
                out = softmax_attention(q, keys, values, False, self.estimator.scale_, attn_mask=allowed, **extra)
        self.keys, self.values, self.padding = keys, values, padding
        return out

    def reset(self) -> None:
        super().reset()
        self.keys = self.values = self.padding = None

    def select(self, index: torch.Tensor) -> None:
        if self.keys is not None:
            index = index.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
            if self.padding is not None:
                self.padding = self.padding.expand(*self.keys.shape[:-2], self.padding.shape[-1]).index_select(0,
                                                                                                              index)
            self._batch = (len(index), *self._batch[1:])

    def _tensors(self):
        return [t for t in (self.keys, self.values, self.padding) if t is not None]

    def _map_state(self, fn) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        if self.padding is not None:
            self.padding = fn(self.padding)

    def state_bytes(self) -> int:
        """Batch entries × ``num_tokens · (d + d_v)`` numbers of the keys' dtype (the exact kernel's
        ``state_bytes`` at the context length)."""
        if self.keys is None:
            return 0
        return self._estimator_bytes(self.keys.dtype)


class EstimatorStateCache(DecodeCache):
    """The fixed-size decoding state of an estimator with its own attention (declared ``decode_state``).

    ``extend`` is ``estimator.decode_extend(state, q, k, v, ...)``: the estimator reads its state and the new keys
    up to each new query and returns the state after them (the hybrids:
    :class:`~kernapprox.approximate.hybrid.WindowState`, the last ``w`` keys and values and the linear state of
    the older keys). ``state`` is ``None`` before the first call; its tensors are in the compute dtype.
    """

    def __init__(self, estimator: Estimator, *, chunk_size: int = 64, state_dtype=None):
        super().__init__(estimator, mode=None, state_dtype=state_dtype)
        self.chunk_size = chunk_size
        self.state = None

    def _extend(self, q, k, v, key_padding, query_padding):
        with _no_autocast(q):
            out, self.state = self.estimator.decode_extend(self.state, q, k, v, chunk_size=self.chunk_size,
                                                           **mask_kwargs(key_padding,
                                                                         query_padding_mask=query_padding))
        return out

    def reset(self) -> None:
        super().reset()
        self.state = None

    def select(self, index: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(index)
            self._batch = (len(index), *self._batch[1:])

    def _tensors(self):
        return [] if self.state is None else self.state.tensors()

    def _map_state(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map(fn)

    def state_bytes(self) -> int:
        """Batch entries × the estimator's ``state_bytes(d_v, state dtype, seq_len=num_tokens)`` (the hybrids: the
        window's ``min(w, n) (d + d_v)`` numbers plus the linear state); 0 before the first call."""
        if self.state is None:
            return 0
        return self._estimator_bytes(self.state.keys.dtype)


class GroupedQueryCache:
    """Grouped-query heads (Ainslie et al. 2023, *GQA*, §2) over one decoding cache: ``groups`` query heads share each
    key/value head, so the cache keeps **one state per key/value head**, not one per query head.

    For a feature map ``φ`` shared by a group's query heads, the state ``(W, z) = (Σ_j v_j φ(k_j)ᵀ, Σ_j φ(k_j))`` is a
    function of the group's keys and values alone, and query head ``h`` of group ``g`` reads
    ``y_h = W_g φ(q_h) / ⟨z_g, φ(q_h)⟩``; the same holds for a hybrid's window and for a KV cache. Repeating the
    keys and values to every query head (Hugging Face's ``repeat_kv``) gives the same outputs with ``groups``
    copies of every state; this cache gives the outputs of that repetition (to rounding) and holds, between calls,
    the state of the group's first query head only: ``state_bytes()`` is ``1/groups`` of the repeated heads'.

    ``extend(q, k, v, key_padding_mask=None, query_padding_mask=None)`` takes ``q`` ``(..., H_kv·G, n, d)`` (query
    head ``h`` in group ``h // G``, the order of ``repeat_kv``), ``k`` ``(..., H_kv, n, d)``, ``v``
    ``(..., H_kv, n, d_v)`` and masks broadcastable to ``(..., 1, n)``; it returns ``(..., H_kv·G, n, d_v)``. Within a
    call the state is broadcast to the ``G`` query heads (a view) and the inner cache's ``extend`` runs on them, so
    the compute is that of the repeated heads; the saving is the memory a decoder holds.

    Parameters
    ----------
    inner : DecodeCache
        An empty cache of the group's estimator (:func:`decode_cache`).
    groups : int
        Query heads per key/value head ``G``.

    >>> import torch, kernapprox as ka
    >>> from kernapprox.attention.decode import GroupedQueryCache, decode_cache
    >>> gen = torch.Generator().manual_seed(0)
    >>> q = torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64)        # 4 query heads
    >>> k, v = (torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64) for _ in range(2))   # 2 key/value heads
    >>> est = ka.make_estimator("positive", num_features=16, rng=0).fit(q, k)
    >>> grouped = GroupedQueryCache(decode_cache(est), groups=2)
    >>> out = torch.cat([grouped.extend(q[..., :5, :], k[..., :5, :], v[..., :5, :]),
    ...                  grouped.extend(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :])], -2)
    >>> full = ka.linear_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), est, causal=True)
    >>> bool(torch.allclose(out, full, atol=1e-12)), grouped.state_bytes() == est.state_bytes(8, torch.float64) * 2
    (True, True)
    """

    def __init__(self, inner: DecodeCache, groups: int):
        if not isinstance(inner, DecodeCache):
            raise TypeError(f"inner must be a kernapprox DecodeCache, got {type(inner).__name__}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        if inner.num_tokens:
            raise ValueError(f"inner must be an empty cache; it holds {inner.num_tokens} tokens")
        self.inner = inner
        self.groups = groups

    @property
    def estimator(self) -> Estimator:
        return self.inner.estimator

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def extend(self, q, k, v, *, key_padding_mask=None, query_padding_mask=None, validated: bool = False
               ) -> torch.Tensor:
        """Causal attention of the ``n`` new tokens of every query head after the cached ones (see the class).
        ``validated``: the caller has checked that ``q, k, v`` are floating point, of one dtype and device, and
        finite (:func:`~kernapprox.validation.check_tensor`); a one-token step of a feature state then skips the
        check (the general path checks either way)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise ValueError(f"{name} must be a tensor (..., heads, n, ·), got "
                                 f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        g = self.groups
        kv_heads = k.shape[-3]
        if q.shape[-3] != kv_heads * g or v.shape[-3] != kv_heads:
            raise ValueError(f"q has {q.shape[-3]} heads, k {kv_heads} and v {v.shape[-3]}: a GroupedQueryCache of "
                             f"groups={g} needs H_kv·{g} query heads for H_kv key/value heads")
        batch = tuple(k.shape[:-2])
        qg = q.reshape(*batch, g, *q.shape[-2:])
        if (k.shape[-2] == 1 and key_padding_mask is None and query_padding_mask is None
                and isinstance(self.inner, FeatureStateCache)):
            out = self.inner.grouped_step(qg, k, v, validated=validated)   # the state updated once, read G times
            if out is not None:
                return out.reshape(*q.shape[:-1], out.shape[-1])
        kg, vg = (t.unsqueeze(-3).expand(*batch, g, *t.shape[-2:]) for t in (k, v))
        masks = {name: None if m is None else m.unsqueeze(-2)
                 for name, m in (("key_padding_mask", key_padding_mask), ("query_padding_mask", query_padding_mask))}
        self.inner._broadcast_state(g)           # the kept state, one per key/value head, seen by its G query heads
        out = self.inner.extend(qg, kg, vg, **masks)
        self.inner._keep_first_member()          # one copy per key/value head between calls
        return out.reshape(*q.shape[:-1], out.shape[-1])

    def reset(self) -> None:
        self.inner.reset()

    def select(self, index: torch.Tensor) -> None:
        self.inner.select(index)

    def state_bytes(self) -> int:
        """The inner cache's ``state_bytes``: one state per key/value head and batch entry."""
        return self.inner.state_bytes()

    def held_bytes(self) -> int:
        return self.inner.held_bytes()
