"""The RNN mode: the state of each rule and its one-token update, for decoding one token at a time.

Sum and decay (:class:`~kernapprox.rules.NormalizedState`): ``W_t = γ W_{t-1} + φ(k_t) v_tᵀ``,
``z_t = γ z_{t-1} + φ(k_t)`` (``γ = 1``: the sum), read ``y_t = W_tᵀ φ(q_t) / z_tᵀ φ(q_t)``. The state is stored
stabilised: ``W̃ = W e^{−c}`` with ``c_t = max(c_{t−1} + log γ, ℓ(k_t))``, so ``exp`` never overflows over
arbitrarily long streams.

Delta rule (:class:`~kernapprox.rules.DeltaState`): ``W_t = W_{t−1} + β_t φ̄_t (v_t − W_{t−1}ᵀφ̄_t)ᵀ``, read
``y_t = W_tᵀ φ̄(q_t)``. Least squares (:class:`~kernapprox.rules.LeastSquaresState`): recursive least squares,
``P_t = P_{t−1} − P_{t−1}φ̄_tφ̄_tᵀP_{t−1} / (1 + φ̄_tᵀP_{t−1}φ̄_t)`` (Sherman–Morrison),
``W_t = W_{t−1} + P_tφ̄_t (v_t − W_{t−1}ᵀφ̄_t)ᵀ``, read ``y_t = W_tᵀ φ̄(q_t)``.
"""

from __future__ import annotations

import torch

from ..estimators.base import Estimator
from ..rules import (
    SENTINEL,
    DeltaState,
    LeastSquaresState,
    NormalizedState,
    check_beta,
    resolve_rule,
    to_internal,
    to_public,
    unit_features,
)
from ..validation import check_same_kind, check_tensor, compute_dtype
from .logdomain import check_state_read


# ------------------------------------------------------------------------------------------- one-token steps
def normalized_step(state: NormalizedState, phi_k, log_k, v, a: float = 0.0) -> NormalizedState:
    """``W̃ ← W̃ e^{c+a−c'} + φ̃_k e^{ℓ_k−c'} vᵀ`` (W stored as r × d_v), ``c' = max(c + a, ℓ_k)``, ``a = log γ``."""
    w, z, c = state
    c_dec = c + a if a else c
    c_new = torch.maximum(c_dec, log_k)
    decay = torch.exp(c_dec - c_new)[..., None]
    wk = phi_k * torch.exp(log_k - c_new)[..., None]
    w = w * decay[..., None] + wk[..., :, None] * v[..., None, :]
    z = z * decay + wk
    return NormalizedState(w, z, c_new)


def normalized_read(state: NormalizedState, phi_q):
    """``(φ̃_qᵀ W̃, φ̃_qᵀ z̃)``: numerator and normaliser, both at the state's log-scale."""
    num = (phi_q[..., None, :] @ state.w).squeeze(-2)
    den = (phi_q * state.z).sum(-1)
    return num, den


def add_keys(state: NormalizedState | None, phi_k, log_k, v) -> NormalizedState:
    """The sum-rule state after a block of keys: ``W̃ ← W̃ e^{c−c'} + Σ_j φ̃_j e^{ℓ_j−c'} v_jᵀ`` (``z̃`` likewise,
    ``W`` stored as ``r × d_v``), with ``c' = max(c, max_j ℓ_j)``: the running-maximum stabiliser over blocks, so
    a stream of keys never overflows and never looks ahead. ``state`` None is the empty state; a state built with
    a log-scale already at the largest key's (a fixed shift) is only added to (every factor ``e^{c−c'}`` is 1).

    Shapes ``phi_k (..., L, r)``, ``log_k (..., L)``, ``v (..., L, d_v)``; the block-sized form of
    :func:`normalized_step`, for the estimators that keep a linear state beside an exact part
    (:mod:`kernapprox.approximate.hybrid`).
    """
    c_new = log_k.amax(-1)
    if state is not None:
        c_new = torch.maximum(state.log_scale, c_new)
    scaled = phi_k * torch.exp(log_k - c_new[..., None])[..., None]
    w_add, z_add = scaled.transpose(-1, -2) @ v, scaled.sum(-2)
    if state is None:
        return NormalizedState(w_add, z_add, c_new)
    decay = torch.exp(state.log_scale - c_new)
    return NormalizedState(state.w * decay[..., None, None] + w_add, state.z * decay[..., None] + z_add, c_new)


def read_queries(state: NormalizedState, phi_q):
    """``(φ̃_q W̃, φ̃_q z̃)`` for a block of stabilised query features ``(..., L, r)``: numerators ``(..., L, d_v)``
    and normalisers ``(..., L)``, both at the state's log-scale (plus each query's own)."""
    return phi_q @ state.w, (phi_q @ state.z[..., :, None]).squeeze(-1)


def delta_step(w: torch.Tensor, k_unit, v, beta) -> torch.Tensor:
    """``W ← W + φ̄_k (β (v − Wᵀφ̄_k))ᵀ`` (β a number or a tensor of the batch shape)."""
    pred = (k_unit[..., None, :] @ w).squeeze(-2)
    u = (v - pred) * (beta[..., None] if isinstance(beta, torch.Tensor) else beta)
    return w + k_unit[..., :, None] * u[..., None, :]


def least_squares_step(state: LeastSquaresState, k_unit, v) -> LeastSquaresState:
    """One recursive-least-squares step (Sherman–Morrison on ``P = (K̄ᵀK̄ + λI)^{-1}``); a zero key changes nothing.

    ``P`` is updated in the symmetric form ``P − (Pφ̄)(Pφ̄)ᵀ/(1 + φ̄ᵀPφ̄)``, which keeps it exactly symmetric.
    """
    w, p = state
    pk = (p @ k_unit[..., :, None]).squeeze(-1)                      # P φ̄
    den = 1.0 + (k_unit * pk).sum(-1)
    p = p - (pk[..., :, None] * pk[..., None, :]) / den[..., None, None]
    gain = pk / den[..., None]                                       # P_t φ̄ = P_{t−1}φ̄ / (1 + φ̄ᵀP_{t−1}φ̄)
    err = v - (k_unit[..., None, :] @ w).squeeze(-2)
    return LeastSquaresState(w + gain[..., :, None] * err[..., None, :], p)


# -------------------------------------------------------------------------------------------- decoding state
class RecurrentState:
    """The state of linear attention under a rule, for decoding one token at a time.

    >>> import torch, kernapprox as ka
    >>> est = ka.make_estimator("positive", num_features=64, rng=0).fit(torch.zeros(1, 8))
    >>> st = ka.RecurrentState(est)
    >>> q_t, k_t, v_t = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4)   # (batch, d), (batch, d_v)
    >>> st.step(q_t, k_t, v_t).shape
    torch.Size([2, 4])
    >>> st = ka.RecurrentState(est, rule=ka.rules.LeastSquares(0.5))
    >>> st.step(q_t, k_t, v_t).shape, st.state_bytes()          # (W, P): 2 · (64·4 + 64²) float32 numbers
    (torch.Size([2, 4]), 34816)

    ``step`` adds ``(k_t, v_t)`` to the state and then reads it with ``q_t`` (causal: the token sees itself).
    The rule (``"sum"`` by default; :mod:`kernapprox.rules`) decides the update and the read-out; see the module
    docstring for the formulas. Sum and decay keep a running maximum of the key log-scales so that ``exp`` stays
    finite over arbitrarily long streams (the state is stored as ``W̃ = W e^{−c}`` and rescaled when ``c``
    grows); memory is ``r · (d_v + 1)`` numbers (plus the log-scale) for sum and decay, ``r · d_v`` for the delta
    rule, ``r² + r · d_v`` for least squares, whatever the stream length.

    Parameters
    ----------
    estimator : FeatureMap
        A fitted feature map that supports the recurrent mode.
    check_finite : bool
        ``False`` skips the per-step NaN/Inf check of the inputs (and of the delta/least-squares outputs), which
        costs a device-to-host synchronisation per token on a GPU (use it in timed decoding loops; shapes, dtypes
        and devices are still checked).
    rule : str or rule object
        The state-update rule (default ``"sum"``).
    initial_state : state tuple, optional
        Start from a state returned by ``linear_attention(..., return_state=True)`` (prefill → decode); it fixes
        the batch shape, ``d_v``, dtype and device of the steps that follow.

    Attributes
    ----------
    state : state tuple or None
        The current state (the rule's tuple, public form: empty entries of a normalised state have
        ``log_scale = −inf``); ``None`` before the first token. May be assigned a snapshot taken earlier.
    num_tokens : int
        Tokens added by :meth:`update` (not counting those of an initial state).
    """

    def __init__(self, estimator: Estimator, *, check_finite: bool = True, rule="sum", initial_state=None):
        if not isinstance(estimator, Estimator) or estimator.capabilities().kind != "features":
            raise TypeError("estimator must be a fitted kernapprox feature map (not the exact kernel, nor an "
                            f"estimator without a feature map), got {type(estimator).__name__}")
        caps = estimator.capabilities()
        if "recurrent" not in caps.modes:
            raise ValueError(f"{type(estimator).__name__} does not support the recurrent mode")
        estimator._check_fitted()
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self.rule = resolve_rule(rule)
        if self.rule.name not in caps.rules:
            raise ValueError(f"rule {self.rule.name!r} is not supported by {type(estimator).__name__}; supported: "
                             f"{', '.join(caps.rules)}")
        self.estimator = estimator
        self.check_finite = check_finite
        self._state = None
        self.num_tokens = 0
        self._keys = 0.0                     # least squares: the unit keys the state holds (precision guard)
        if initial_state is not None:
            self._state = self._checked(initial_state, "initial_state", values=True)
            self._keys = self._keys_in(self._state)

    # ------------------------------------------------------------------------------------------- the state
    @property
    def state(self):
        return None if self._state is None else to_public(self._state)

    @state.setter
    def state(self, value):
        self._state = None if value is None else self._checked(value, "state", values=False)
        self._keys = 0.0 if value is None else self._keys_in(self._state)

    def _keys_in(self, state) -> float:
        return self.rule.keys_in(state) if self.rule.name == "least_squares" else 0.0

    def _checked(self, state, name, values):
        if not isinstance(state, self.rule.state_type):
            raise TypeError(f"{name} must be a {self.rule.state_type.__name__} (the state of the {self.rule.name} "
                            f"rule), got {type(state).__name__}")
        w = state.w
        if not isinstance(w, torch.Tensor) or w.dim() < 2:
            raise TypeError(f"{name}.w must be a tensor (..., r, d_v)")
        if w.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name}.w has dtype {w.dtype}; states are float32 or float64 (the compute dtype)")
        r = self.estimator.num_features
        if values:
            return self.rule.check_state(state, w.shape[:-2], r, w.shape[-1], w.dtype, w.device, name)
        for field, want in zip(state._fields, self.rule._state_shapes(tuple(w.shape[:-2]), r, w.shape[-1])):
            t = getattr(state, field)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != w.dtype:
                raise ValueError(f"{name}.{field} must be a {w.dtype} tensor of shape {want}")
        return to_internal(state)

    # ------------------------------------------------------------------------------------------ the steps
    def update(self, k_t: torch.Tensor, v_t: torch.Tensor, *, beta=None, key_padding_mask=None) -> None:
        """Add one key/value pair: ``k_t (..., d)``, ``v_t (..., d_v)``.

        ``beta`` (delta rule only): this token's step size, a number or a tensor of the batch shape, in (0, 2];
        required when the rule was built with a per-token β tensor. ``key_padding_mask`` (bool, the batch shape):
        True = this token is padding for that entry and leaves its state unchanged (a decayed state still decays).
        """
        check_tensor(k_t, "k_t", min_rank=1, finite=self.check_finite)
        check_tensor(v_t, "v_t", min_rank=1, finite=self.check_finite)
        check_same_kind(k_t=k_t, v_t=v_t)
        if k_t.shape[:-1] != v_t.shape[:-1]:
            raise ValueError(f"k_t and v_t must share batch dimensions, got {tuple(k_t.shape)} and {tuple(v_t.shape)}")
        batch_shape = k_t.shape[:-1]
        if self._state is not None:
            w = self._state.w
            if w.shape[:-2] != batch_shape or w.shape[-1] != v_t.shape[-1]:
                raise ValueError(f"k_t/v_t (shapes {tuple(k_t.shape)}, {tuple(v_t.shape)}) do not match the state's "
                                 f"batch shape {tuple(w.shape[:-2])} or value dimension {w.shape[-1]}")
            self._check_like_state(k_t, "k_t")
        pad = None
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor of the batch shape (True = padding)")
            if key_padding_mask.device != k_t.device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but k_t is on {k_t.device}")
            try:
                pad = key_padding_mask.expand(batch_shape)
            except RuntimeError:
                raise ValueError(f"key_padding_mask of shape {tuple(key_padding_mask.shape)} does not broadcast to "
                                 f"the batch shape {tuple(batch_shape)}") from None
        step_beta = self._step_beta(beta, batch_shape, k_t)
        ct = compute_dtype(k_t.dtype)
        pk, lk = self.estimator.features(k_t[..., None, :], "key", log_scale=True, check_finite=False)
        pk, lk, vc = pk[..., 0, :].to(ct), lk[..., 0].to(ct), v_t.to(ct)
        if self._state is None:
            self._state = self.rule.empty_state(batch_shape, pk.shape[-1], v_t.shape[-1], ct, k_t.device)
        if self.rule.normalized:
            if pad is not None:
                pk, lk = pk.masked_fill(pad[..., None], 0.0), lk.masked_fill(pad, SENTINEL)
            self._state = normalized_step(self._state, pk, lk, vc, self.rule.log_decay)
        else:
            ku = unit_features(pk, "key", type(self.estimator).__name__, pad)
            if self.rule.name == "delta":
                self._state = DeltaState(delta_step(self._state.w, ku, vc, step_beta))
            else:
                self.rule.check_precision(self._keys + 1, ct)
                self._state = least_squares_step(self._state, ku, vc)
        self.num_tokens += 1
        self._keys += 1.0

    def _step_beta(self, beta, batch_shape, k_t):
        if self.rule.name != "delta":
            if beta is not None:
                raise ValueError(f"beta is a parameter of the delta rule, not of the {self.rule.name} rule")
            return None
        if beta is None:
            if self.rule.per_token:
                raise ValueError("the rule holds a per-token β for a whole sequence: pass this token's beta= to "
                                 "update/step")
            return self.rule.beta
        beta = check_beta(beta, "beta")
        if isinstance(beta, torch.Tensor):
            if beta.device != k_t.device:
                raise ValueError(f"beta is on {beta.device} but k_t is on {k_t.device}")
            try:
                beta = beta.to(compute_dtype(k_t.dtype)).expand(batch_shape)
            except RuntimeError:
                raise ValueError(f"beta of shape {tuple(beta.shape)} does not broadcast to the batch shape "
                                 f"{tuple(batch_shape)}") from None
        return beta

    def read(self, q_t: torch.Tensor) -> torch.Tensor:
        """The read-out for ``q_t (..., d)``: ``W̃ᵀφ̃(q_t) / z̃ᵀφ̃(q_t)`` (sum, decay) or ``Wᵀφ̄(q_t)`` (delta, least
        squares)."""
        if self._state is None:
            raise ValueError("the state is empty: call update (or step) before read")
        check_tensor(q_t, "q_t", min_rank=1, finite=self.check_finite)
        w = self._state.w
        if q_t.shape[:-1] != w.shape[:-2]:
            raise ValueError(f"q_t has batch shape {tuple(q_t.shape[:-1])} but the state has {tuple(w.shape[:-2])}")
        self._check_like_state(q_t, "q_t")
        pq, _ = self.estimator.features(q_t[..., None, :], "query", log_scale=True, check_finite=False)
        pq = pq[..., 0, :].to(w.dtype)
        if self.rule.normalized:
            if self.check_finite and bool((self._state.log_scale < SENTINEL / 2).any()):
                raise ValueError("the state of some batch entry holds no key yet (every token so far was padding): "
                                 "its attention read-out is undefined (0/0)")
            num, den = normalized_read(self._state, pq)
            if self.check_finite:                               # precision hook (see logdomain): raise, not NaN
                check_state_read(self.estimator, den, self._state.log_scale)
            return (num / den[..., None]).to(q_t.dtype)
        qu = unit_features(pq, "query", type(self.estimator).__name__)
        out = (qu[..., None, :] @ w).squeeze(-2)
        if self.check_finite and not bool(torch.isfinite(out).all()):
            raise ValueError(f"the {self.rule.name} state gave a non-finite read-out in {w.dtype} (it lost its "
                             "numerical range; a larger ridge or float64 keeps it)")
        return out.to(q_t.dtype)

    def _check_like_state(self, x, name):
        w = self._state.w
        if x.device != w.device:
            raise ValueError(f"{name} is on {x.device} but the state is on {w.device}")
        if compute_dtype(x.dtype) != w.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but the state holds {w.dtype}; cast explicitly")

    def step(self, q_t, k_t, v_t, *, beta=None, key_padding_mask=None) -> torch.Tensor:
        """``update(k_t, v_t)`` then ``read(q_t)``."""
        self.update(k_t, v_t, beta=beta, key_padding_mask=key_padding_mask)
        return self.read(q_t)

    def state_bytes(self) -> int:
        """Bytes of the state held now (every tensor of the rule's state tuple, all batch entries)."""
        if self._state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._state)
