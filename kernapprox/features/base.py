"""The estimator protocol every kernel approximation shares.

An estimator approximates ``SM_s(q, k) = exp(s · qᵀk)`` by ``φ(q)ᵀ φ(k)`` with a finite map ``φ: R^d → R^r``.
Subclasses implement :meth:`FeatureMap._fit` (draw or derive what they need) and
:meth:`FeatureMap._log_features` (stabilised features and their log-scale); everything else — validation,
scaling, dtype handling, the exact-scale features, the approximate kernel matrix and the state size — lives here.

Stabilised features
-------------------
``features(x, role, log_scale=True)`` returns ``(φ̃, ℓ)`` with ``φ(x) = φ̃(x) · exp(ℓ(x))``, where ``φ̃`` has
entries of order one (for exponential maps: the per-row maximum is subtracted inside the exponent) and ``ℓ`` has
shape ``(..., n)``. Attention code uses this split to keep the query scales out of the ratio (they cancel) and to
shift the key scales by one constant per query row — the maximum over all keys, or over the keys up to the query
when causal (a running maximum, in every mode) — so that ``exp`` never overflows. ``features(x, role)`` returns
the exact-scale ``φ(x)`` (which may overflow for large norms; that is what was asked for).

Precision: float16/bfloat16 inputs are computed in float32; float32 and float64 stay as they are. Exact-scale
features are returned in the input dtype; the stabilised pair ``(φ̃, ℓ)`` stays in the compute dtype (float32 for
half inputs), because it is the input of further computation (attention, kernel matrices) that must not be
rounded to half precision half-way. Parameters (projections, landmarks) are kept in float64 on the CPU and cast
on use.
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar

import numpy as np
import torch

from .._rng import as_generator
from .._validation import (
    NotFittedError,
    check_choice,
    check_positive_int,
    check_same_kind,
    check_tensor,
    compute_dtype,
)
from ..kernel import _check_qk, resolve_scale

ROLES = ("query", "key")


class FeatureMap:
    """Base class of all estimators of the softmax kernel.

    Class attributes describe the estimator (and fill the README table): ``unbiased`` (``E φ(x)ᵀφ(y) =
    SM(x, y)``), ``positive`` (features and hence normalisers are positive), ``data_dependent`` (``fit`` looks
    at the data, not just its shape), ``causal_fit`` (fitting on the sequence it is applied to uses no future
    tokens), ``modes`` (the attention modes it supports) and ``reference`` (the paper, with equation/lemma).
    """

    unbiased: ClassVar[bool] = False
    positive: ClassVar[bool] = False
    data_dependent: ClassVar[bool] = False
    causal_fit: ClassVar[bool] = True
    modes: ClassVar[tuple[str, ...]] = ("parallel", "recurrent", "chunked")
    reference: ClassVar[str] = ""

    def __init__(self, *, num_features: int | None = None, rng=None, scale: float | None = None):
        self.num_features_param = num_features
        self.rng = rng
        self.scale = scale

    # ----------------------------------------------------------------------------------------------- fitting
    def fit(self, q: torch.Tensor, k: torch.Tensor | None = None) -> FeatureMap:
        """Draw or derive the map's parameters for inputs like ``q`` (and ``k``); returns ``self``.

        Data-independent maps use only ``d = q.shape[-1]``. Calling ``fit`` again with the same ``rng`` gives
        the same draw (an int or ``SeedSequence`` seed is re-expanded on every call).
        """
        check_tensor(q, "q")
        if k is not None:
            check_tensor(k, "k")
            check_same_kind(q=q, k=k)
            if k.shape[-1] != q.shape[-1]:
                raise ValueError(f"q and k must share the last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
        if self.data_dependent and q.device.type == "meta":
            raise ValueError(f"q is a meta tensor (a shape without values); {type(self).__name__} is fitted on data")
        self.dim_ = int(q.shape[-1])
        self.scale_ = resolve_scale(self.dim_, self.scale)
        self._cache = {}
        self._fit(q, k, as_generator(self.rng))
        self.fitted_ = True
        return self

    def _fit(self, q, k, rng: np.random.Generator) -> None:
        raise NotImplementedError

    def _check_fitted(self):
        if not getattr(self, "fitted_", False):
            raise NotFittedError(f"{type(self).__name__} is not fitted; call fit(q, k) first")

    # -------------------------------------------------------------------------------------------- features
    def features(self, x: torch.Tensor, role: str = "query", *, log_scale: bool = False,
                 check_finite: bool = True):
        """Feature map ``φ(x)``: ``(..., n, d) -> (..., n, r)``.

        With ``log_scale=True`` returns ``(φ̃, ℓ)``, ``φ = φ̃ · exp(ℓ)[..., None]``, ``ℓ`` of shape ``(..., n)``,
        both in the compute dtype (float32 for half-precision ``x``); otherwise ``φ`` in ``x``'s dtype.
        ``check_finite=False`` skips the NaN/Inf scan of ``x`` (a host synchronisation on a GPU), for callers that
        have checked already or decode token by token.
        """
        self._check_fitted()
        check_choice(role, "role", ROLES)
        check_tensor(x, "x", finite=check_finite)
        if x.shape[-1] != self.dim_:
            raise ValueError(f"x has last dimension {x.shape[-1]} but the estimator was fitted with d={self.dim_}")
        out_dtype = x.dtype
        xs = x.to(compute_dtype(x.dtype)) * math.sqrt(self.scale_)
        phi, logs = self._log_features(xs, role)
        if log_scale:
            return phi, logs
        return (phi * torch.exp(logs)[..., None]).to(out_dtype)

    def _log_features(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Stabilised features of the already scaled input ``x = sqrt(s) · input`` (compute dtype)."""
        raise ValueError(f"{type(self).__name__} has no finite feature map; use kernapprox.linear_attention or "
                         "its kernel_matrix")

    def _param(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A float64 numpy parameter ``self.<name>`` as a tensor on ``like``'s device and dtype (cached)."""
        key = (name, like.device, like.dtype)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = torch.as_tensor(getattr(self, name)).to(device=like.device, dtype=like.dtype)
        return cache[key]

    # ----------------------------------------------------------------------------------------- fitted state
    def _state_entries(self, prefix: str = ""):
        """``(key, owner, attribute, value)`` of every fitted-state entry, nested estimators' included, sorted by
        attribute name (a nested estimator's entries in place of its attribute)."""
        for name, value in sorted(vars(self).items()):
            if name.startswith("_") or not name.endswith("_") or name == "fitted_":
                continue
            if isinstance(value, FeatureMap):
                yield from value._state_entries(f"{prefix}{name}.")
            elif (isinstance(value, torch.Tensor) or _is_real_scalar(value)
                  or (isinstance(value, np.ndarray) and value.dtype.kind in "biuf")):
                yield prefix + name, self, name, value

    def fitted_state(self) -> dict:
        """A snapshot of everything ``fit`` computed: ``{name: value}``.

        Fitted state is every public attribute ending in ``_`` (scikit-learn's convention) that holds a
        numeric numpy array (float64 parameters, integer indices), a tensor, or a real number (``dim_``,
        ``scale_``, ...): arrays and tensors are copies, numbers are ``int`` or ``float``. A nested estimator
        (a hybrid's ``feature_map_``) contributes its own state under ``"<attribute>.<name>"`` keys, as in a torch
        ``state_dict``. Not included: the flag ``fitted_``, ``None`` and other objects (samplers), which ``fit``
        rebuilds from the constructor parameters. :meth:`load_fitted_state` takes such a dict back.
        """
        self._check_fitted()
        return {key: _snapshot(value) for key, _, _, value in self._state_entries()}

    def load_fitted_state(self, state: dict) -> FeatureMap:
        """Set the fitted values from ``state`` (as :meth:`fitted_state` returns it); returns ``self``.

        The estimator must be fitted already — a fit (on placeholder data of the same ``d``; data-dependent maps
        on enough points) builds the structure, ``state`` supplies every value — and ``state`` must have exactly
        the keys of its :meth:`fitted_state`. Values may have other shapes than the current ones (a
        data-dependent fit on other data). Each is stored as the attribute's current kind: an array attribute
        becomes a numpy array of its dtype on the CPU (from an array or a tensor on any device), a tensor
        attribute the given tensor, a number ``int`` or ``float`` (from a number or a one-element tensor). Every
        value is checked before any is set. The cached casts of the parameters (:meth:`_param`) are dropped, so
        the new values are used from the next call.
        """
        self._check_fitted()
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        entries = list(self._state_entries())
        expected = {key for key, _, _, _ in entries}
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"state does not match the fitted state of {type(self).__name__}: missing "
                             f"{missing}, unexpected {unexpected}")
        values = [_as_kind_of(current, state[key], f"state[{key!r}]") for key, _, _, current in entries]
        for (_, owner, name, _), value in zip(entries, values):
            setattr(owner, name, value)
            owner._cache = {}
        return self

    # ------------------------------------------------------------------------------------------ properties
    @property
    def num_features(self) -> int:
        """``r``, the feature dimension of the state ``W ∈ R^{d_v × r}``."""
        if self.num_features_param is None:
            raise NotFittedError(f"{type(self).__name__}: num_features is known only after fit")
        return int(self.num_features_param)

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the recurrent state ``(W, z)``: ``r · (d_v + 1)`` numbers (Zoology/Based convention)."""
        check_positive_int(d_v, "d_v")
        return self.num_features * (d_v + 1) * _itemsize(dtype)

    def kernel_matrix(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximation ``φ(Q) φ(K)ᵀ`` of ``exp(s · Q Kᵀ)``, ``(..., n_q, n_k)``, in the inputs' dtype.

        Computed from stabilised features and rescaled at the end, so it overflows only where the true value
        does.
        """
        _check_qk(q, k)                   # batch dimensions must agree exactly: no silent broadcasting
        pq, lq = self.features(q, "query", log_scale=True)
        pk, lk = self.features(k, "key", log_scale=True)
        ct = compute_dtype(q.dtype)
        gram = pq.to(ct) @ pk.to(ct).transpose(-1, -2)
        return (gram * torch.exp(lq[..., :, None] + lk[..., None, :])).to(q.dtype)

    def get_params(self) -> dict:
        """Constructor parameters (scikit-learn style)."""
        import inspect

        sig = inspect.signature(type(self).__init__)
        return {
            name: getattr(self, "num_features_param" if name == "num_features" else name)
            for name in sig.parameters
            if name != "self" and sig.parameters[name].kind == inspect.Parameter.KEYWORD_ONLY
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"


def _is_real_scalar(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _snapshot(value):
    """A copy of an array or tensor; a number as ``int`` or ``float``."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _as_kind_of(current, value, name: str):
    """``value`` (array, tensor or number) as the kind of the fitted attribute ``current``."""
    if isinstance(current, np.ndarray):
        if isinstance(value, torch.Tensor):
            like = torch.from_numpy(np.empty(0, dtype=current.dtype)).dtype
            return value.detach().to("cpu", like, copy=True).numpy()   # never a view of the caller's tensor
        if isinstance(value, np.ndarray):
            return value.astype(current.dtype)                         # a copy
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(value).__name__}")
    if isinstance(current, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        return value.detach()
    if (isinstance(value, torch.Tensor) and value.numel() == 1) or (isinstance(value, np.ndarray) and value.size == 1):
        value = value.item()
    if not _is_real_scalar(value):
        raise TypeError(f"{name} must be a real number or a one-element tensor, got {value!r}")
    return int(value) if isinstance(current, numbers.Integral) else float(value)


def _itemsize(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()
