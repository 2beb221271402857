"""The estimator protocol every kernel approximation shares, and the capabilities each one declares.

An estimator approximates ``SM_s(q, k) = exp(s · qᵀk)`` (or attention under it). Three kinds exist, declared by
the class attribute ``kind``:

``"features"`` (:class:`FeatureMap`)
    a finite map ``φ: R^d → R^r`` with ``exp(s qᵀk) ≈ φ(q)ᵀφ(k)``. Subclasses implement :meth:`Estimator._fit`
    (draw or derive what they need) and :meth:`FeatureMap._log_features` (stabilised features and their
    log-scale); validation, scaling, dtype handling, the exact-scale features, the approximate kernel matrix and
    the state size live here. :func:`kernapprox.linear_attention` runs them in every mode.
``"attention"`` (:class:`AttentionEstimator`)
    estimators that approximate attention through objects other than ``φ(q)ᵀφ(k)`` (softmax blocks, an SVD, an
    exact band): they implement ``attention(q, k, v, ...)`` and ``kernel_matrix(q, k)``.
``"exact"``
    the exact kernel itself (:class:`~kernapprox.estimators.exact.ExactKernel`), routed to
    :func:`kernapprox.softmax_attention`.

Declared capabilities
---------------------
What an estimator is and can do is declared once, as class attributes, and read by every consumer through
:meth:`Estimator.capabilities` (an instance) or :func:`kernapprox.estimators.registry.capabilities` (a registry
name): nothing outside this package inspects classes, signatures or attributes to find out. The fields are those
of :class:`Capabilities`. A declaration that depends on a constructor option (an unbiased map with a biased
sampler, a hybrid's inner map) is resolved by the classmethod :meth:`Estimator.capabilities_for` from the options
alone, without building anything.

Stabilised features
-------------------
``features(x, role, log_scale=True)`` returns ``(φ̃, ℓ)`` with ``φ(x) = φ̃(x) · exp(ℓ(x))``, where ``φ̃`` has
entries of order one (for exponential maps: the per-row maximum is subtracted inside the exponent) and ``ℓ`` has
shape ``(..., n)``. Attention code uses this split to keep the query scales out of the ratio (they cancel) and to
shift the key scales by one constant per query row — the maximum over all keys, or over the keys up to the query
when causal (a running maximum, in every mode) — so that ``exp`` never overflows. ``features(x, role)`` returns
the exact-scale ``φ(x)``, and raises ``ValueError`` naming the fix where that overflows the dtype or a row
underflows to zeros (never a silent all-zero or infinite row). ``log_features(x, role)`` returns ``(log|φ|, sign)``
entry by entry: exact even where the features of one vector span more than the dtype's range (then ``φ̃``
underflows to 0 at entries that may still dominate a product with another vector's features); the attention and
kernel-matrix code falls back to it where the stabilised products cannot be trusted
(:mod:`kernapprox.attention.logdomain`).

Precision: float16/bfloat16 inputs are computed in float32; float32 and float64 stay as they are. Exact-scale
features are returned in the input dtype; the stabilised pair ``(φ̃, ℓ)`` stays in the compute dtype (float32 for
half inputs), because it is the input of further computation (attention, kernel matrices) that must not be
rounded to half precision half-way. Parameters (projections, landmarks) are kept in float64 on the CPU and cast
on use.

Memory
------
:meth:`Estimator.state_bytes` is the one measure of memory: the bytes of everything a decoder must keep that
depends on the context — the linear state ``(W, z)``, ``r·(d_v + 1)`` numbers (Zoology/Based convention), plus
the fitted values computed from the context that the class declares in ``context_state`` (landmarks, whitening,
fitted statistics), plus what a subclass adds (a window of keys and values, a KV cache).
:meth:`Estimator.parameter_bytes` reports, separately, the fitted arrays that do not depend on the context
(projections regenerable from the seed).

Examples
--------
>>> import torch
>>> import kernapprox as ka
>>> est = ka.make_estimator("positive_orthogonal", num_features=64, rng=0).fit(torch.zeros(1, 16))
>>> est.capabilities().unbiased, est.capabilities().kind
(True, 'features')
>>> est.features(torch.randn(5, 16)).shape
torch.Size([5, 64])
>>> est.state_bytes(d_v=16)          # r (d_v + 1) float32 numbers
4352
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from ..kernel import resolve_scale
from ..rules import RULES, Sum
from ..validation import (
    NotFittedError,
    all_finite,
    as_generator,
    check_choice,
    check_positive_float,
    check_positive_int,
    check_qk,
    check_qkv,
    check_same_kind,
    check_tensor,
    compute_dtype,
    itemsize,
    max_row_norm,
)

ROLES = ("query", "key")
KINDS = ("features", "attention", "exact")
MODES = ("parallel", "recurrent", "chunked")


class AttentionParts(NamedTuple):
    """Output with its numerator and normaliser: true ``numerator = numerator · exp(log_scale)[..., None]``,
    true ``normalizer = normalizer · exp(log_scale)``; ``output = numerator / normalizer[..., None]``."""

    output: torch.Tensor      # (..., n, d_v)
    numerator: torch.Tensor   # (..., n, d_v)
    normalizer: torch.Tensor  # (..., n)
    log_scale: torch.Tensor   # (..., n)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an estimator is and can do, as declared by its class (and resolved for its options).

    Attributes
    ----------
    kind : {"features", "attention", "exact"}
        A finite feature map, an estimator that brings its own attention, or the exact kernel.
    unbiased : bool
        ``E φ(x)ᵀφ(y) = SM(x, y)`` (for the kernel; the normalised attention output is a ratio and biased).
    positive : bool
        Features (hence normalisers) are positive.
    data_dependent : bool
        ``fit`` looks at the data, not only at its shape.
    causal_fit : bool
        Fitting on the sequence it is applied to uses no future token.
    consistent : bool
        The error tends to 0 as ``num_features`` grows.
    causal : bool
        Causal attention is defined (``causal=True`` is accepted).
    fixed_dimension : bool
        The feature dimension is fixed by ``d`` (``num_features`` must be ``None``, which takes that dimension, or
        that dimension itself; any other value raises, naming it).
    rank_limited_by_points : bool
        ``num_features`` cannot exceed the number of points it is fitted on (landmark methods).
    query_dependent : bool
        The output at a query depends on the other queries it is computed with (the estimator is fitted on, or
        builds its proposals or landmarks from, the queries of the call): it reads a batch of queries at once,
        never one query against a state built from the keys alone.
    key_padding : bool
        Its attention takes ``key_padding_mask`` (and ``query_padding_mask``): feature maps and the exact kernel
        always (the core applies them); an estimator with its own attention when it declares so.
    decode_state : bool
        Prefill + decode keep a state whose size does not grow with the context
        (:func:`kernapprox.attention.decode.decode_cache`): feature maps always (the linear state under their rule);
        an estimator with its own attention when it declares so and implements ``decode_extend`` (the hybrids: a
        KV window plus a linear state). The exact kernel's cache is its KV cache, which grows.
    modes : tuple of str
        The attention modes it runs in (a subset of ``("parallel", "recurrent", "chunked")``).
    rules : tuple of str
        The state-update rules it supports.
    reference : str
        The paper, with the equation or lemma.
    """

    kind: str
    unbiased: bool
    positive: bool
    data_dependent: bool
    causal_fit: bool
    consistent: bool
    causal: bool
    fixed_dimension: bool
    rank_limited_by_points: bool
    query_dependent: bool
    key_padding: bool
    decode_state: bool
    modes: tuple[str, ...]
    rules: tuple[str, ...]
    reference: str

    def as_dict(self) -> dict:
        """The fields as a plain dict (in declaration order)."""
        return dataclasses.asdict(self)


class _Declared:
    """A capability declared as a class attribute. Read on the class it is the declaration; read on an instance
    it is resolved for that instance's options (``est.unbiased`` is ``est.capabilities().unbiased``, so a map
    with a biased sampler says so)."""

    def __init__(self, name: str, value):
        self.name, self.value = name, value

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.value
        return getattr(obj.capabilities(), self.name)

    def __set__(self, obj, value):
        raise AttributeError(f"{self.name} is a declared capability of {type(obj).__name__}; it cannot be set on "
                             "an instance")


_DECLARED = tuple(field.name for field in dataclasses.fields(Capabilities))


class Estimator:
    """Base class of every estimator of the softmax kernel or of attention under it.

    Class attributes declare the capabilities (see :class:`Capabilities` for their meaning); subclasses set the
    ones that differ from these defaults. ``consistent = None`` means "as ``unbiased``". Read on an instance, a
    declaration is resolved for the instance's options (:meth:`capabilities`). ``context_state`` names the fitted
    attributes a decoder must keep because they were computed from the context (counted by :meth:`state_bytes`);
    ``data_sized_state`` the fitted attributes whose shape depends on the number of points fitted on rather than
    on the constructor parameters (diagnostics such as Nyström's leverage scores), which
    :meth:`data_sized_state_keys` lists for shape checks of loaded states.
    """

    kind: ClassVar[str] = "features"
    unbiased: ClassVar[bool] = False
    positive: ClassVar[bool] = False
    data_dependent: ClassVar[bool] = False
    causal_fit: ClassVar[bool] = True
    consistent: ClassVar[bool | None] = None
    causal: ClassVar[bool] = True
    fixed_dimension: ClassVar[bool] = False
    rank_limited_by_points: ClassVar[bool] = False
    query_dependent: ClassVar[bool] = False
    key_padding: ClassVar[bool | None] = None      # None: as the kind (features and exact: True)
    decode_state: ClassVar[bool | None] = None     # None: as the kind (features: True)
    modes: ClassVar[tuple[str, ...]] = MODES
    rules: ClassVar[tuple[str, ...]] = (Sum.name,)
    reference: ClassVar[str] = ""
    context_state: ClassVar[tuple[str, ...]] = ()
    data_sized_state: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in _DECLARED:
            if name in vars(cls) and not isinstance(vars(cls)[name], _Declared):
                setattr(cls, name, _Declared(name, vars(cls)[name]))
        # The declarations and the constructor's keywords as plain class data, read by capabilities_for and
        # parameter_names: torch.compile (dynamo) then guards on constants, where it mis-resolves the _Declared
        # descriptors (a raw descriptor, or an ``InternalTorchDynamoError: 'str' object has no attribute
        # 'value'``) and mis-guards inspect.signature's Parameter.kind enum.
        cls._declarations = {name: inspect.getattr_static(cls, name).value for name in _DECLARED}
        cls._keyword_names = _keyword_parameters(cls)

    # ----------------------------------------------------------------------------------------- capabilities
    @classmethod
    def capabilities_for(cls, **options) -> Capabilities:
        """The capabilities of ``cls(**options)``, from the declarations alone (nothing is built or fitted).

        Subclasses whose declarations depend on an option (a sampler, an inner feature map, a truncation degree)
        override this and resolve it from ``options``.
        """
        d = cls._declarations
        return Capabilities(
            kind=d["kind"], unbiased=bool(d["unbiased"]), positive=bool(d["positive"]),
            data_dependent=bool(d["data_dependent"]), causal_fit=bool(d["causal_fit"]),
            consistent=bool(d["unbiased"] if d["consistent"] is None else d["consistent"]), causal=bool(d["causal"]),
            fixed_dimension=bool(d["fixed_dimension"]), rank_limited_by_points=bool(d["rank_limited_by_points"]),
            query_dependent=bool(d["query_dependent"]),
            key_padding=bool(d["kind"] != "attention" if d["key_padding"] is None else d["key_padding"]),
            decode_state=bool(d["kind"] == "features" if d["decode_state"] is None else d["decode_state"]),
            modes=tuple(d["modes"]), rules=tuple(d["rules"]), reference=str(d["reference"]))

    def capabilities(self) -> Capabilities:
        """The capabilities of this estimator (its class's declarations resolved for its parameters)."""
        return type(self).capabilities_for(**self.get_params())

    def __init__(self, *, num_features: int | None = None, rng=None, scale: float | None = None):
        if scale is not None:
            check_positive_float(scale, "scale")   # refused at construction, not at the first fit
        self.num_features_param = num_features
        self.rng = rng
        self.scale = scale

    # ----------------------------------------------------------------------------------------------- fitting
    def fit(self, q: torch.Tensor, k: torch.Tensor | None = None) -> Estimator:
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

    def _derived(self, key: str, like: torch.Tensor, build) -> torch.Tensor:
        """The tensor ``build()`` on ``like``'s device and dtype, built once per ``(key, device, dtype)`` and dropped
        with the fitted state (:meth:`fit` and loading clear the cache)."""
        full = (key, like.device, like.dtype)
        cache = self.__dict__.setdefault("_cache", {})
        if full not in cache:
            cache[full] = build().to(device=like.device, dtype=like.dtype)
        return cache[full]

    def _param(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A float64 numpy parameter ``self.<name>`` as a tensor on ``like``'s device and dtype (cached)."""
        return self._derived(name, like, lambda: torch.as_tensor(getattr(self, name)))

    # ----------------------------------------------------------------------------------------- fitted state
    def _state_entries(self, prefix: str = ""):
        """``(key, owner, attribute, value)`` of every fitted-state entry, nested estimators' included, sorted by
        attribute name (a nested estimator's entries in place of its attribute)."""
        for name, value in sorted(vars(self).items()):
            if name.startswith("_") or not name.endswith("_") or name == "fitted_":
                continue
            if isinstance(value, Estimator):
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

    def load_fitted_state(self, state: dict) -> Estimator:
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

    def data_sized_state_keys(self) -> set[str]:
        """Keys of :meth:`fitted_state` (nested estimators' included) whose shapes depend on the data fitted on, not
        on the constructor parameters: every other entry has the same shape for every fit of an estimator with the
        same parameters and input dimension."""
        self._check_fitted()
        return {key for key, owner, name, _ in self._state_entries() if name in owner.data_sized_state}

    # ------------------------------------------------------------------------------------------ properties
    @property
    def num_features(self) -> int:
        """``r``, the feature dimension of the state ``W ∈ R^{d_v × r}``."""
        if self.num_features_param is None:
            raise NotFittedError(f"{type(self).__name__}: num_features is known only after fit")
        return int(self.num_features_param)

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """Bytes of everything a decoder must keep that depends on the context, at ``dtype``.

        The linear state ``(W, z)``, ``r · (d_v + 1)`` numbers (Zoology/Based convention), plus every fitted
        value computed from the context that the class declares in ``context_state`` (e.g. Nyström's ``r·d``
        landmarks and ``r²`` whitening). Subclasses whose memory grows with the sequence (a KV cache, a window of
        keys and values) use ``seq_len``; it is ignored otherwise. Data-independent parameters are reported by
        :meth:`parameter_bytes`.
        """
        check_positive_int(d_v, "d_v")
        size = itemsize(dtype)
        if seq_len is not None:
            check_positive_int(seq_len, "seq_len")
        return (self.num_features * (d_v + 1) + self._numbers(self.context_state)) * size

    def parameter_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the fitted arrays that do not depend on the context (e.g. a projection regenerable from the
        seed, or values derived from it), at ``dtype``; 0 for a map without any."""
        size = itemsize(dtype)
        self._check_fitted()
        names = [name for key, owner, name, value in self._state_entries()
                 if not isinstance(value, numbers.Number) and "." not in key and name not in self.context_state]
        nested = sum(owner.parameter_bytes(dtype) for owner in self._nested_estimators())
        return self._numbers(names) * size + nested

    def _nested_estimators(self) -> list[Estimator]:
        return [value for name, value in sorted(vars(self).items())
                if not name.startswith("_") and name.endswith("_") and isinstance(value, Estimator)]

    def _numbers(self, names) -> int:
        """How many numbers the fitted attributes ``names`` hold (a scalar counts 1)."""
        if not names:
            return 0
        self._check_fitted()
        total = 0
        for name in names:
            value = getattr(self, name)
            total += int(value.size if isinstance(value, np.ndarray) else
                         value.numel() if isinstance(value, torch.Tensor) else 1)
        return total

    def kernel_matrix(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximation of the kernel matrix ``exp(s · Q Kᵀ)`` implied by the estimator, ``(..., n_q, n_k)``."""
        raise NotImplementedError

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """The keyword-only constructor parameters, in signature order."""
        return cls._keyword_names

    def get_params(self) -> dict:
        """Constructor parameters (scikit-learn style)."""
        return {name: getattr(self, "num_features_param" if name == "num_features" else name)
                for name in self.parameter_names()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"


for _name in _DECLARED:
    setattr(Estimator, _name, _Declared(_name, getattr(Estimator, _name)))


@functools.cache
def _keyword_parameters(cls) -> tuple[str, ...]:
    parameters = inspect.signature(cls.__init__).parameters
    return tuple(name for name, p in parameters.items() if p.kind == inspect.Parameter.KEYWORD_ONLY)


Estimator._declarations = {_name: getattr(Estimator, _name) for _name in _DECLARED}
Estimator._keyword_names = _keyword_parameters(Estimator)


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




class ExponentialForm(NamedTuple):
    """A feature map of the exponential form, as parameters: for rows ``x'`` of the input,

    ``log φ_j(x) = α (x'Wᵀ)_j + o_j − k α² ‖x'‖² / 2 + c``, stabilised as ``φ̃_j = exp(p_j − max_i p_i) + eps``,
    ``ℓ = max_i p_i + c − k α² ‖x'‖² / 2`` with ``p = α x'Wᵀ + o``

    (FAVOR+ and hyperbolic features, Choromanski et al. 2021, Lemma 1; the GERF family, Likhosherstov et al.
    2022, eq. 7). What a kernel that computes such features itself reads (:mod:`kernapprox.attention.native`).
    """

    rows: torch.Tensor                    # x' (..., n, d'): the input, or its transform
    alpha: float                          # the input scale applied inside the product (√s, or 1)
    weight: torch.Tensor                  # W (r, d')
    offset: torch.Tensor | None           # o (r,), or None for zero
    log_constant: float                   # c
    eps: float                            # added after the row shift
    norm: float                           # k: 1 when the row's norm enters ℓ, else 0


class FeatureMap(Estimator):
    """A finite feature map ``φ`` with ``exp(s qᵀk) ≈ φ(q)ᵀφ(k)``: subclasses implement ``_fit`` and
    ``_log_features``; :func:`kernapprox.linear_attention` runs it in every mode it declares."""

    kind: ClassVar[str] = "features"
    rules: ClassVar[tuple[str, ...]] = RULES          # every state rule of kernapprox.rules
    # True when ``_log_features`` returns a new ``φ̃`` that nothing else refers to: ``features`` then scales it in
    # place instead of allocating the exact-scale copy.
    _fresh_features: ClassVar[bool] = False

    # -------------------------------------------------------------------------------------------- features
    def features(self, x: torch.Tensor, role: str = "query", *, log_scale: bool = False,
                 check_finite: bool = True, buffer: torch.Tensor | None = None):
        """Feature map ``φ(x)``: ``(..., n, d) -> (..., n, r)``.

        With ``log_scale=True`` returns ``(φ̃, ℓ)``, ``φ = φ̃ · exp(ℓ)[..., None]``, ``ℓ`` of shape ``(..., n)``,
        both in the compute dtype (float32 for half-precision ``x``); otherwise ``φ`` in ``x``'s dtype.
        ``check_finite=False`` skips the NaN/Inf scans of ``x`` and of ``ℓ`` (host synchronisations on a GPU), for
        callers that check them themselves or decode token by token. ``buffer`` (with ``log_scale=True`` only): a
        contiguous ``(..., n, r)`` tensor of the compute dtype on ``x``'s device that the map may write ``φ̃`` into
        instead of allocating — maps with a fused kernel (:mod:`kernapprox.estimators.fused`) do, others ignore it;
        the returned ``φ̃`` may be ``buffer`` itself. For callers that compute features block after block (the
        chunked mode), where a fresh allocation per block costs page faults.

        Raises
        ------
        ValueError
            With ``log_scale=True``: the log-scale ``ℓ`` is not finite (the input norms overflow the compute
            dtype). Without: the exact-scale features of some row overflow ``x``'s dtype, or underflow it (every
            entry of the row below the smallest normal number although the row is not zero). The message names
            the row's log-scale and the fix: ``log_scale=True`` (the stabilised pair, what attention uses),
            :meth:`log_features`, or smaller inputs / ``scale``.
        """
        self._check_fitted()
        check_choice(role, "role", ROLES)
        check_tensor(x, "x", finite=check_finite)
        if x.shape[-1] != self.dim_:
            raise ValueError(f"x has last dimension {x.shape[-1]} but the estimator was fitted with d={self.dim_}")
        out_dtype = x.dtype
        if buffer is not None:
            _check_buffer(buffer, x, self.num_features, log_scale)
        xs = x.to(compute_dtype(x.dtype)) * math.sqrt(self.scale_)
        phi, logs = self._log_features(xs, role) if buffer is None else self._log_features_into(xs, role, buffer)
        if check_finite and logs.numel() and not all_finite(logs):
            raise ValueError(f"{type(self).__name__}: the log-scale of the features of x is not finite in "
                             f"{logs.dtype} (the input norms overflow it, max ‖x‖ = {max_row_norm(x):.3g}); rescale x "
                             "or pass a smaller scale")
        if log_scale:
            return phi, logs
        # The row maxima of |φ̃| (two reductions, no copy; 20x faster on a CPU than vector_norm(ord=inf, dim=-1))
        # decide over- and underflow: scaling by exp(ℓ) > 0 and the cast are monotone, so max_j |φ_j| is exactly
        # that maximum scaled and cast, and φ̃ may then be scaled in place. NaN propagates through both.
        detached = phi.detach()
        peak = torch.maximum(detached.amax(-1), detached.amin(-1).neg()) if phi.numel() else None
        scale = torch.exp(logs)[..., None]
        if self._fresh_features and phi.dtype == out_dtype and not phi.requires_grad:
            out = phi.mul_(scale)
        else:
            out = (phi * scale).to(out_dtype)
        if peak is not None:
            _check_exact_scale((peak * scale[..., 0]).to(out_dtype), peak, logs, type(self).__name__)
        return out

    def _log_features(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Stabilised features of the already scaled input ``x = sqrt(s) · input`` (compute dtype)."""
        raise NotImplementedError

    def exponential_form(self, x: torch.Tensor, role: str = "query") -> ExponentialForm | None:
        """The map as an :class:`ExponentialForm` for rows of the *unscaled* input ``x`` (compute dtype), or None
        when the map is not of that form (the default).

        A map that returns a form promises that its stabilised features (:meth:`features` with
        ``log_scale=True``) equal the form's to rounding; a kernel may then compute them itself, fused with the
        attention that reads them, instead of calling :meth:`features`.
        """
        return None

    def _log_features_into(self, x: torch.Tensor, role: str, buffer: torch.Tensor):
        """:meth:`_log_features`, free to write ``φ̃`` into ``buffer`` (checked by :meth:`features`); by default
        the buffer is not used."""
        return self._log_features(x, role)

    def log_features(self, x: torch.Tensor, role: str = "query", *, check_finite: bool = True):
        """``(log|φ(x)|, sign φ(x))``, both ``(..., n, r)`` in the compute dtype: the features in the log domain.

        Exact where the stabilised pair of :meth:`features` is not: maps of the exponential family (positive,
        hyperbolic, GERF/OPRF/DERF) return the exponents themselves, so an entry far below its row's maximum (more
        than the dtype's range, where ``φ̃`` underflows to 0) keeps its value. Other maps derive it from the
        stabilised pair, ``log|φ̃| + ℓ`` (``-inf`` where ``φ̃`` is exactly 0, with sign 0). Used where products of
        features must be formed in the log domain (:meth:`kernel_matrix` and the attention fallback of
        :mod:`kernapprox.attention.logdomain`).
        """
        self._check_fitted()
        check_choice(role, "role", ROLES)
        check_tensor(x, "x", finite=check_finite)
        if x.shape[-1] != self.dim_:
            raise ValueError(f"x has last dimension {x.shape[-1]} but the estimator was fitted with d={self.dim_}")
        xs = x.to(compute_dtype(x.dtype)) * math.sqrt(self.scale_)
        return self._log_abs_features(xs, role)

    def _log_abs_features(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        phi, logs = self._log_features(x, role)
        return torch.log(phi.abs()) + logs[..., None], torch.sign(phi)

    def kernel_matrix(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximation ``φ(Q) φ(K)ᵀ`` of ``exp(s · Q Kᵀ)``, ``(..., n_q, n_k)``, in the inputs' dtype.

        Computed from stabilised features, ``sign(G̃) exp(log|G̃| + ℓ_q + ℓ_k)`` with ``G̃ = φ̃(Q)φ̃(K)ᵀ``, so it
        overflows only where the true value does. Entries whose stabilised product is below ``sqrt(tiny)`` of the
        compute dtype may have lost their dominant terms to underflow (features spanning more than the dtype's
        range, e.g. DERF at large norms); where such an entry could be representable it is recomputed exactly in
        the log domain, ``Σ_j s_j exp(L_q,j + L_k,j)`` with the row-pair maximum factored out, in float64 from
        :meth:`log_features` — so every entry is the estimator's value rounded once, or 0 / inf where that
        underflows / overflows the dtype.
        """
        check_qk(q, k)                    # batch dimensions must agree exactly: no silent broadcasting
        pq, lq = self.features(q, "query", log_scale=True)
        pk, lk = self.features(k, "key", log_scale=True)
        ct = compute_dtype(q.dtype)
        gram = pq.to(ct) @ pk.to(ct).transpose(-1, -2)
        log_scale = lq[..., :, None] + lk[..., None, :]
        out = torch.sign(gram) * torch.exp(torch.log(gram.abs()) + log_scale)
        threshold = _trusted_threshold(ct)
        suspect = (gram.abs() < threshold) & (log_scale + math.log(threshold * self.num_features)
                                               > math.log(torch.finfo(q.dtype).tiny))
        if bool(suspect.any()):
            exact = _log_domain_gram(*self.log_features(q.double(), "query", check_finite=False),
                                     *self.log_features(k.double(), "key", check_finite=False))
            out = torch.where(suspect, exact.to(ct), out)
        return out.to(q.dtype)


def _check_buffer(buffer, x, r, log_scale) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if not log_scale:
        raise ValueError("buffer is for the stabilised features: pass log_scale=True")
    shape = (*x.shape[:-1], r)
    if (tuple(buffer.shape) != shape or buffer.dtype != compute_dtype(x.dtype) or buffer.device != x.device
            or not buffer.is_contiguous()):
        raise ValueError(f"buffer must be a contiguous {shape} tensor of {compute_dtype(x.dtype)} on {x.device}, got "
                         f"{tuple(buffer.shape)} {buffer.dtype} on {buffer.device}"
                         f"{'' if buffer.is_contiguous() else ' (not contiguous)'}")


def _trusted_threshold(dtype: torch.dtype) -> float:
    """``sqrt(tiny)`` of ``dtype``: a stabilised sum of terms each ≤ 1 that is at least this large lost at most
    ``r · n · tiny`` to underflow, a relative error below ``r · n · sqrt(tiny)`` (1e-19 in float32)."""
    return math.sqrt(torch.finfo(dtype).tiny)


_EXACT_SCALE_FIX = ("use features(x, log_scale=True), the stabilised pair φ = φ̃·exp(ℓ) that attention uses, or "
                    "log_features(x), or reduce the input norms (a smaller scale, standardised inputs)")


def _check_exact_scale(mag: torch.Tensor, peak: torch.Tensor, logs: torch.Tensor, name: str) -> None:
    """Raise when exact-scale features overflow or (whole rows) underflow the output dtype: ``mag`` is each row's
    largest ``|φ_j|`` in the output dtype, ``peak`` its largest ``|φ̃_j|`` (the stabilised features)."""
    info = torch.finfo(mag.dtype)
    overflow = ~torch.isfinite(mag)
    if bool(overflow.any()):
        worst = float(logs.detach()[overflow].max())
        raise ValueError(f"{name}: the exact-scale features overflow {mag.dtype} (log-scale ℓ up to {worst:.4g}, "
                         f"beyond log(max) = {math.log(info.max):.4g}); {_EXACT_SCALE_FIX}")
    small = mag < info.tiny
    if not bool(small.any()):                      # the usual case: no second pass over phi
        return
    lost = small & (peak > 0)
    if bool(lost.any()):
        worst = float(logs.detach()[lost].min())
        raise ValueError(f"{name}: the exact-scale features underflow {mag.dtype}: every feature of some rows is "
                         f"below its smallest normal number (log-scale ℓ down to {worst:.4g}, below log(tiny) = "
                         f"{math.log(info.tiny):.4g}), so φ(x) would be returned as zeros; {_EXACT_SCALE_FIX}")


def _log_domain_gram(lq, sq, lk, sk, max_elements: int = 1 << 22) -> torch.Tensor:
    """``Σ_j sq_j sk_j exp(lq_j + lk_j)`` for every query–key pair, ``(..., n_q, n_k)``, with each pair's largest
    exponent factored out (no underflow of the dominant term, no overflow before the final ``exp``); in query
    chunks of at most ``max_elements`` pair-features."""
    n_q, n_k, r = lq.shape[-2], lk.shape[-2], lq.shape[-1]
    batch = max(1, lq.numel() // max(n_q * r, 1))
    step = max(1, max_elements // max(batch * n_k * r, 1))
    rows = []
    for start in range(0, n_q, step):
        terms = lq[..., start:start + step, None, :] + lk[..., None, :, :]          # (..., c, n_k, r)
        signs = sq[..., start:start + step, None, :] * sk[..., None, :, :]
        top = terms.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))          # all terms -inf: a zero sum
        total = (signs * torch.exp(terms - top)).sum(-1)
        rows.append(torch.sign(total) * torch.exp(torch.log(total.abs()) + top[..., 0]))
    return torch.cat(rows, -2)


class AttentionEstimator(Estimator):
    """An estimator that brings its own attention instead of a finite feature map.

    Nyströmformer, the rank-r references and the hybrids (sliding window + linear, Scatterbrain) approximate
    attention through objects other than ``φ(q)ᵀφ(k)``: softmax blocks, an SVD, an exact band. They implement
    ``attention(q, k, v, *, causal, mode, chunk_size, return_parts)`` and ``kernel_matrix(q, k)``;
    :func:`kernapprox.linear_attention` dispatches to their ``attention``. One that declares ``key_padding = True``
    takes ``key_padding_mask=`` and ``query_padding_mask=`` there too; one that declares ``decode_state = True``
    implements :meth:`decode_extend`, its fixed-size decoding state.
    """

    kind: ClassVar[str] = "attention"
    modes: ClassVar[tuple[str, ...]] = ("parallel",)

    def _fit(self, q, k, rng) -> None:
        """Nothing to draw by default: the approximation is built from the sequence it is applied to."""

    def _check_call(self, q, k, v, causal, mode, chunk_size) -> None:
        self._check_fitted()
        check_qkv(q, k, v, causal)
        check_choice(mode, "mode", self.modes)
        check_positive_int(chunk_size, "chunk_size")
        if causal and not self.causal:
            raise ValueError(f"{type(self).__name__} is not causal: it does not define causal attention "
                             "(use causal=False)")
        self._check_dim(q)

    def _check_dim(self, q) -> None:
        if q.shape[-1] != self.dim_:
            raise ValueError(f"q has last dimension {q.shape[-1]} but the estimator was fitted with d={self.dim_}")

    def attention(self, q, k, v, *, causal: bool = False, mode: str = "parallel", chunk_size: int = 64,
                  return_parts: bool = False):
        """Approximate attention ``(..., n, d_v)`` (or :class:`AttentionParts` with ``return_parts=True``)."""
        raise NotImplementedError

    def decode_extend(self, state, q, k, v, *, key_padding_mask=None, query_padding_mask=None,
                      chunk_size: int = 64):
        """Causal attention of new tokens ``(..., n, d)`` after those ``state`` holds (``None``: none yet):
        ``(out, new_state)``, a state whose size does not grow with the context. Declared by ``decode_state``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no fixed-size decoding state (decode_state is "
                                  "False)")

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """Estimators that need the whole sequence have no recurrent state; those with one override this."""
        if "recurrent" not in self.modes:
            raise ValueError(f"{type(self).__name__} has no recurrent state (it needs the whole sequence); compare "
                             "it by num_features")
        return super().state_bytes(d_v, dtype, seq_len=seq_len)
