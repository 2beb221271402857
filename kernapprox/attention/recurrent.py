"""The RNN mode: the linear-attention state ``(W, z)`` and its update, for decoding one token at a time.

``W_t = W_{t-1} + v_t φ(k_t)ᵀ``, ``z_t = z_{t-1} + φ(k_t)``, read ``y_t = W_t φ(q_t) / z_tᵀ φ(q_t)``. The state is
stored stabilised: ``W̃ = W e^{−c}`` with ``c`` the running maximum of the keys' log-scales, rescaled by
``e^{c_old − c_new}`` when ``c`` grows, so ``exp`` never overflows over arbitrarily long streams.
"""

from __future__ import annotations

import torch

from ..estimators.base import Estimator
from ..validation import check_same_kind, check_tensor, compute_dtype


def state_update(state, phi_k, log_k, v):
    """One RNN step on stabilised key features: ``W ← W e^{c−c'} + φ̃_k e^{ℓ_k−c'} vᵀ`` (W stored as r × d_v)."""
    if state is None:
        c_new = log_k
        wk = phi_k
        return wk[..., :, None] * v[..., None, :], wk, c_new
    w, z, c = state
    c_new = torch.maximum(c, log_k)
    decay = torch.exp(c - c_new)[..., None]
    wk = phi_k * torch.exp(log_k - c_new)[..., None]
    w = w * decay[..., None] + wk[..., :, None] * v[..., None, :]
    z = z * decay + wk
    return w, z, c_new


def state_read(state, phi_q):
    w, z, _ = state
    num = (phi_q[..., None, :] @ w).squeeze(-2)
    den = (phi_q * z).sum(-1)
    return num, den


class RecurrentState:
    """The linear-attention state ``(W, z)`` for decoding one token at a time.

    >>> import torch, kernapprox as ka
    >>> est = ka.make_estimator("positive", num_features=64, rng=0).fit(torch.zeros(1, 8))
    >>> st = ka.RecurrentState(est)
    >>> q_t, k_t, v_t = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4)   # (batch, d), (batch, d_v)
    >>> st.step(q_t, k_t, v_t).shape
    torch.Size([2, 4])

    ``step`` adds ``(k_t, v_t)`` to the state and then reads it with ``q_t`` (causal: the token sees itself).
    A running maximum of the key log-scales keeps ``exp`` finite over arbitrarily long streams: the state is
    stored as ``W̃ = W e^{−c}`` and rescaled when ``c`` grows. Memory is ``r · (d_v + 1)`` numbers whatever the
    stream length.

    ``check_finite=False`` skips the per-step NaN/Inf check of the inputs, which costs a device-to-host
    synchronisation per token on a GPU (use it in timed decoding loops; shapes, dtypes and devices are still
    checked).
    """

    def __init__(self, estimator: Estimator, *, check_finite: bool = True):
        if not isinstance(estimator, Estimator) or estimator.capabilities().kind != "features":
            raise TypeError("estimator must be a fitted kernapprox feature map (not the exact kernel, nor an "
                            f"estimator without a feature map), got {type(estimator).__name__}")
        if "recurrent" not in estimator.capabilities().modes:
            raise ValueError(f"{type(estimator).__name__} does not support the recurrent mode")
        estimator._check_fitted()
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
        self.estimator = estimator
        self.check_finite = check_finite
        self.state = None
        self.num_tokens = 0

    def update(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Add one key/value pair: ``k_t (..., d)``, ``v_t (..., d_v)``."""
        check_tensor(k_t, "k_t", min_rank=1, finite=self.check_finite)
        check_tensor(v_t, "v_t", min_rank=1, finite=self.check_finite)
        check_same_kind(k_t=k_t, v_t=v_t)
        if k_t.shape[:-1] != v_t.shape[:-1]:
            raise ValueError(f"k_t and v_t must share batch dimensions, got {tuple(k_t.shape)} and {tuple(v_t.shape)}")
        if self.state is not None:
            w = self.state[0]
            if w.shape[:-2] != k_t.shape[:-1] or w.shape[-1] != v_t.shape[-1]:
                raise ValueError(f"k_t/v_t (shapes {tuple(k_t.shape)}, {tuple(v_t.shape)}) do not match the state's "
                                 f"batch shape {tuple(w.shape[:-2])} or value dimension {w.shape[-1]}")
            self._check_like_state(k_t, "k_t")
        pk, lk = self.estimator.features(k_t[..., None, :], "key", log_scale=True, check_finite=False)
        ct = compute_dtype(k_t.dtype)
        self.state = state_update(self.state, pk[..., 0, :].to(ct), lk[..., 0].to(ct), v_t.to(ct))
        self.num_tokens += 1

    def read(self, q_t: torch.Tensor) -> torch.Tensor:
        """``W φ(q_t) / zᵀφ(q_t)`` for ``q_t (..., d)``."""
        if self.state is None:
            raise ValueError("the state is empty: call update (or step) before read")
        check_tensor(q_t, "q_t", min_rank=1, finite=self.check_finite)
        w = self.state[0]
        if q_t.shape[:-1] != w.shape[:-2]:
            raise ValueError(f"q_t has batch shape {tuple(q_t.shape[:-1])} but the state has {tuple(w.shape[:-2])}")
        self._check_like_state(q_t, "q_t")
        pq, _ = self.estimator.features(q_t[..., None, :], "query", log_scale=True, check_finite=False)
        num, den = state_read(self.state, pq[..., 0, :].to(self.state[0].dtype))
        return (num / den[..., None]).to(q_t.dtype)

    def _check_like_state(self, x, name):
        w = self.state[0]
        if x.device != w.device:
            raise ValueError(f"{name} is on {x.device} but the state is on {w.device}")
        if compute_dtype(x.dtype) != w.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but the state holds {w.dtype}; cast explicitly")

    def step(self, q_t, k_t, v_t) -> torch.Tensor:
        """``update(k_t, v_t)`` then ``read(q_t)``."""
        self.update(k_t, v_t)
        return self.read(q_t)

    def state_bytes(self) -> int:
        if self.state is None:
            return 0
        w, z, c = self.state
        return sum(t.numel() * t.element_size() for t in (w, z, c))
