r"""State-update rules of linear attention: four ways to write a fixed-size state from the same feature map.

Every finite feature map ``φ`` (``r`` features) gives linear attention a state of ``O(r · d_v)`` numbers. The
*rule* decides what the state holds after the keys ``k_1..k_t`` and how a query reads it:

``"sum"`` (:class:`Sum`)
    ``W_t = Σ_s φ(k_s) v_sᵀ``, ``z_t = Σ_s φ(k_s)``; read ``Wᵀφ(q) / zᵀφ(q)`` (normalised like attention);
    ``r (d_v + 1)`` numbers.
:class:`Decay` ``(γ)``
    ``W_t = Σ_s γ^{t−s} φ(k_s) v_sᵀ``, ``z_t`` likewise; normalised read-out; ``r (d_v + 1)`` numbers.
:class:`Delta` ``(β)``
    ``W_t = W_{t−1} + β_t φ̄_t (v_t − W_{t−1}ᵀφ̄_t)ᵀ``; read ``Wᵀφ̄(q)`` (not normalised); ``r d_v`` numbers.
:class:`LeastSquares` ``(λ)``
    ``W_t = (K̄_tᵀK̄_t + λI)^{−1} K̄_tᵀV_t`` with ``P_t = (K̄_tᵀK̄_t + λI)^{−1}`` kept for the recursion; read
    ``Wᵀφ̄(q)`` (not normalised); ``r² + r d_v`` numbers.

``φ̄ = φ/‖φ‖₂``: the delta rule needs unit keys to be stable for ``β ∈ (0, 2]``, and the least-squares state uses
the same features so that the delta rule is one gradient step on its loss. Because every map returns
``φ = φ̃ · e^ℓ`` with a per-token scalar ``ℓ``, ``φ̄ = φ̃/‖φ̃‖`` exactly: the log-scale cancels and nothing
overflows at any input norm. The sum and decay rules keep ``ℓ`` in a running maximum (see
:mod:`kernapprox.attention.linear`).

This module is the rules' one home: the rule objects, their names (:data:`RULES`, which the estimators'
``capabilities().rules`` declare), :func:`resolve_rule` and the state tuples. It sits below the estimators and
the attention layer, which both import it.

All four run in the ``parallel``, ``recurrent`` and ``chunked`` modes of :func:`kernapprox.linear_attention` and
in :class:`kernapprox.RecurrentState`, causal and non-causal (every query reads the state after the last key).
The chunked delta rule uses the WY/UT representation, the chunked least-squares state a Cholesky/Woodbury update
per chunk; both are linear in ``n``.
Prefill → decode: ``linear_attention(..., return_state=True)`` returns the state (:class:`NormalizedState`,
:class:`DeltaState`, :class:`LeastSquaresState`), which ``initial_state=`` and ``RecurrentState(initial_state=)``
accept. Every feature map declares all four in ``capabilities().rules``; the exact kernel and the estimators that
bring their own attention declare ``("sum",)``.

References
----------
Katharopoulos et al., *Transformers are RNNs*, ICML 2020 (sum). Sun et al., *Retentive Network*, arXiv 2307.08621,
2023 (decay). Schlag, Irie & Schmidhuber, *Linear Transformers Are Secretly Fast Weight Programmers*, ICML 2021
(delta rule). Yang et al., *Parallelizing Linear Transformers with the Delta Rule over Sequence Length*, NeurIPS
2024 (chunked WY/UT form). Wang, Shi & Fox, *Test-time regression*, arXiv 2501.12352, 2025 (least squares).

Examples
--------
>>> import torch, kernapprox as ka
>>> ka.available_rules()
['sum', 'decay', 'delta', 'least_squares']
>>> gen = torch.Generator().manual_seed(0)
>>> q, k, v = (torch.randn(3, 50, 8, generator=gen, dtype=torch.float64) for _ in range(3))
>>> est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
>>> for rule in ("sum", ka.rules.Decay(0.95), ka.rules.Delta(0.5), ka.rules.LeastSquares(0.1)):
...     ys = [ka.linear_attention(q, k, v, est, causal=True, mode=m, rule=rule, chunk_size=16)
...           for m in ka.MODES]
...     assert all(torch.allclose(y, ys[0], atol=1e-10) for y in ys)
>>> ka.rules.LeastSquares(0.1).state_bytes(est, d_v=8)        # (r² + r d_v) float32 numbers
5120
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, NamedTuple

import torch

__all__ = ["Rule", "Sum", "Decay", "Delta", "LeastSquares", "NormalizedState", "DeltaState", "LeastSquaresState",
           "RULES", "available_rules", "resolve_rule"]

# Log-scale of an empty normalised state inside the algorithms: finite, so that differences of log-scales never
# produce NaN (-inf - -inf); exp(SENTINEL - c) underflows to 0 against any real log-scale. Public states use -inf.
SENTINEL = -1e30
_EMPTY_BELOW = SENTINEL / 2


# ------------------------------------------------------------------------------------------------------ states
class NormalizedState(NamedTuple):
    """State of the normalised rules (:class:`Sum`, :class:`Decay`), stored stabilised.

    True state ``W = w · e^{log_scale}`` (``r × d_v``, so the read-out is ``φ(q)ᵀW``) and ``z = z̃ · e^{log_scale}``
    (``r``); ``log_scale = −inf`` marks an entry that has absorbed no key yet (``w``, ``z`` are then zero).
    Shapes ``w (..., r, d_v)``, ``z (..., r)``, ``log_scale (...)``; ``r·(d_v + 1) + 1`` numbers per entry (the
    rules count ``r·(d_v + 1)``, the Zoology/Based convention).
    """

    w: torch.Tensor
    z: torch.Tensor
    log_scale: torch.Tensor


class DeltaState(NamedTuple):
    """State of the delta rule: the fast-weight matrix ``W (..., r, d_v)`` read as ``φ̄(q)ᵀW``; ``r·d_v``
    numbers."""

    w: torch.Tensor


class LeastSquaresState(NamedTuple):
    """State of recursive least squares: ``W (..., r, d_v)`` (read as ``φ̄(q)ᵀW``) and the inverse regularised
    Gram matrix ``P = (Σ φ̄(k)φ̄(k)ᵀ + λI)^{-1} (..., r, r)``; ``r² + r·d_v`` numbers (``P`` is stored whole)."""

    w: torch.Tensor
    p: torch.Tensor


# ------------------------------------------------------------------------------------------------------- rules
class Rule:
    """Base of the state-update rules. Subclasses declare:

    ``name``
        the entry of :func:`available_rules` (and of the estimators' ``capabilities().rules``);
    ``normalized``
        the read-out divides by the attention normaliser ``zᵀφ(q)`` (like attention) or not;
    ``noncausal``
        non-causal attention is defined: every query reads the state after the last key (all rules here);
    ``unit_features``
        the rule works on ``φ̄ = φ/‖φ‖`` (unit 2-norm) rather than on ``φ``;
    ``state_type``
        the state tuple (:class:`NormalizedState`, :class:`DeltaState`, :class:`LeastSquaresState`).
    """

    name: ClassVar[str] = ""
    normalized: ClassVar[bool] = True
    noncausal: ClassVar[bool] = True
    unit_features: ClassVar[bool] = False
    state_type: ClassVar[type] = NormalizedState

    def state_numbers(self, r: int, d_v: int) -> int:
        """Numbers a decoder keeps per (batch, head) entry for ``r`` features and ``d_v`` value dimensions."""
        raise NotImplementedError

    def state_bytes(self, estimator, d_v: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes a decoder keeps per (batch, head) entry under this rule: the rule's state
        (:meth:`state_numbers`) plus the context-dependent fitted values the estimator declares (e.g. Nyström's
        landmarks and whitening), at ``dtype``. For the sum rule this is ``estimator.state_bytes(d_v, dtype)``."""
        sum_numbers = estimator.num_features * (d_v + 1)
        size = torch.empty((), dtype=dtype).element_size()
        context = estimator.state_bytes(d_v, dtype) - sum_numbers * size
        return self.state_numbers(estimator.num_features, d_v) * size + context

    def empty_state(self, batch_shape, r: int, d_v: int, dtype: torch.dtype, device) -> tuple:
        """The state before any key (internal form: a normalised state's log-scale is the finite sentinel)."""
        raise NotImplementedError

    def check_state(self, state, batch_shape, r: int, d_v: int, dtype: torch.dtype, device, name: str) -> tuple:
        """Validate a state given by a caller; returns it in the internal form (see :func:`to_internal`)."""
        if not isinstance(state, self.state_type):
            raise TypeError(f"{name} must be a {self.state_type.__name__} (the state of the {self.name} rule), got "
                            f"{type(state).__name__}")
        shapes = self._state_shapes(tuple(batch_shape), r, d_v)
        for field, want in zip(state._fields, shapes):
            t = getattr(state, field)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ValueError(f"{name}.{field} has shape {tuple(t.shape)}, expected {want} (batch shape "
                                 f"{tuple(batch_shape)}, r = {r}, d_v = {d_v})")
            if t.dtype != dtype:
                raise TypeError(f"{name}.{field} has dtype {t.dtype} but the computation runs in {dtype}; cast "
                                "explicitly")
            if t.device != torch.device(device):
                raise ValueError(f"{name}.{field} is on {t.device} but the inputs are on {device}")
            finite = torch.isfinite(t) if field != "log_scale" else ~(torch.isnan(t) | (t == math.inf))
            if not bool(finite.all()):
                raise ValueError(f"{name}.{field} contains NaN or Inf values"
                                 + (" (log_scale may be -inf: an empty state)" if field == "log_scale" else ""))
        return to_internal(state)

    def _state_shapes(self, batch_shape, r, d_v):
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({args})"


@dataclasses.dataclass(frozen=True, repr=False)
class Sum(Rule):
    r"""The sum rule of linear attention (the default): ``W_t = W_{t−1} + φ(k_t) v_tᵀ``, ``z_t = z_{t−1} + φ(k_t)``.

    Read-out, normalised like attention:

    .. math:: y_t = \frac{W_tᵀ φ(q_t)}{z_tᵀ φ(q_t)} = \frac{Σ_{s≤t} φ(q_t)ᵀφ(k_s)\, v_s}{Σ_{s≤t} φ(q_t)ᵀφ(k_s)},

    i.e. kernel smoothing with ``κ ≈ φ(q)ᵀφ(k)`` (non-causal: every key). State ``(W, z)``: ``r·(d_v+1)`` numbers
    (Zoology/Based convention, as :meth:`~kernapprox.estimators.base.Estimator.state_bytes`; the one stabilising
    log-scale per entry is not counted). Computed stabilised from ``φ = φ̃·e^ℓ`` (the running maximum of the keys'
    ``ℓ``).

    References
    ----------
    Katharopoulos, Vyas, Pappas & Fleuret, *Transformers are RNNs*, ICML 2020, eqs. (4)–(6) and (16)–(20).

    Examples
    --------
    >>> import kernapprox as ka
    >>> ka.rules.Sum().state_numbers(r=64, d_v=16)
    1088
    """

    name: ClassVar[str] = "sum"

    def state_numbers(self, r, d_v):
        return r * (d_v + 1)

    def empty_state(self, batch_shape, r, d_v, dtype, device):
        return NormalizedState(torch.zeros(*batch_shape, r, d_v, dtype=dtype, device=device),
                               torch.zeros(*batch_shape, r, dtype=dtype, device=device),
                               torch.full(tuple(batch_shape), SENTINEL, dtype=dtype, device=device))

    def _state_shapes(self, batch_shape, r, d_v):
        return (*batch_shape, r, d_v), (*batch_shape, r), batch_shape

    @property
    def log_decay(self) -> float:
        return 0.0


@dataclasses.dataclass(frozen=True, repr=False)
class Decay(Sum):
    r"""The decayed sum (RetNet-style scalar decay): ``W_t = γ W_{t−1} + φ(k_t) v_tᵀ``, ``z_t = γ z_{t−1} + φ(k_t)``.

    Read-out normalised like attention (unlike RetNet, which normalises by a GroupNorm):

    .. math:: y_t = \frac{Σ_{s≤t} γ^{t−s} φ(q_t)ᵀφ(k_s)\, v_s}{Σ_{s≤t} γ^{t−s} φ(q_t)ᵀφ(k_s)},

    kernel smoothing with a recency weight: the parallel form multiplies the causal kernel matrix by ``D_{ts} =
    γ^{t−s}`` (Sun et al. 2023, eq. (5)); the chunked form carries ``γ^C`` between chunks of ``C`` tokens (their
    eq. (7)). ``γ = 1`` is the sum rule. Non-causal (as for every rule): each query reads the state after the
    last key, ``W_n = Σ_j γ^{n−1−j} φ(k_j) v_jᵀ`` (the newest keys weigh most).
    State as for the sum rule, ``r·(d_v+1)`` numbers plus one log-scale. Stabilised in the log domain: the stored
    log-scale follows ``c_t = max(c_{t−1} + log γ, ℓ(k_t))``, and positions enter only as differences within a
    chunk, so long sequences lose no precision.

    Parameters
    ----------
    gamma : float in (0, 1]
        The decay per token.

    References
    ----------
    Sun, Dong, Huang, Ma, Xia, Xue, Wang & Wei, *Retentive Network: A Successor to Transformer for Large Language
    Models*, arXiv 2307.08621 (2023), eqs. (1)–(7).

    Examples
    --------
    >>> import kernapprox as ka
    >>> ka.rules.Decay(0.9)
    Decay(gamma=0.9)
    """

    gamma: float = 1.0
    name: ClassVar[str] = "decay"

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, numbers.Real):
            raise TypeError(f"gamma must be a real number in (0, 1], got {self.gamma!r}")
        if not (0.0 < float(self.gamma) <= 1.0):
            raise ValueError(f"gamma must be in (0, 1] (γ > 1 grows the state without bound; γ ≤ 0 is not a "
                             f"decay), got {self.gamma}")
        object.__setattr__(self, "gamma", float(self.gamma))

    @property
    def log_decay(self) -> float:
        return math.log(self.gamma)


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Delta(Rule):
    r"""The delta rule (fast-weight programmer, DeltaNet): ``W_t = W_{t−1} + β_t φ̄(k_t) (v_t − W_{t−1}ᵀφ̄(k_t))ᵀ``.

    Each step writes the value where the state's current prediction for ``φ̄(k_t)`` is wrong: one step of online
    gradient descent on ``½‖v_t − Wᵀφ̄(k_t)‖²`` with step ``β_t``. Read-out **not** normalised like attention:

    .. math:: y_t = W_tᵀ φ̄(q_t), \qquad W_t = \prod_{s≤t}(I − β_s φ̄_s φ̄_sᵀ)\, W_0 + Σ_{s≤t} (\cdots) ,

    in closed form ``W_t = W_0 + Σ_{s≤t} φ̄(k_s) u_sᵀ`` with pseudo-values ``U = T^{−1} diag(β)(V − K̄W_0)``,
    ``T = I + tril(diag(β) K̄K̄ᵀ, −1)`` (the UT form of the product of generalized Householder transforms; Yang et
    al. 2024, eqs. (5)–(9)), so ``Y = Q̄W_0 + tril(Q̄K̄ᵀ) U``. The chunked mode applies this per chunk of ``C`` keys
    (the WY/UT representation: ``C × C`` triangular solves, state carried between chunks), linear in ``n``.
    Non-causal: every query reads the final state ``W_n`` (order-dependent, as the rule is).

    Features: ``φ̄ = φ/‖φ‖₂`` for keys **and** queries. Why unit 2-norm: with ``‖φ̄(k)‖ = 1`` each transition
    ``I − β φ̄φ̄ᵀ`` has eigenvalue ``1 − β`` along ``φ̄(k)`` and 1 elsewhere, so the state stays bounded exactly
    when ``β ∈ (0, 2]`` (Schlag et al. 2021, sec. 4.2); ``β = 1`` replaces the old association by the new one.
    The normalisation also removes the log-scale exactly — ``φ = φ̃·e^ℓ`` with a per-token scalar ``ℓ``, so
    ``φ̄ = φ̃/‖φ̃‖`` whatever ``ℓ`` is — hence no overflow at any input norm. For an exponential map
    ``φ̄(q)ᵀφ̄(k) ≈ exp(s qᵀk)/sqrt(exp(s‖q‖²) exp(s‖k‖²)) = exp(−s‖q−k‖²/2)``: normalised features estimate the
    Gaussian kernel. (Sum-normalisation, Schlag's choice for DPFP, needs positive features; the 2-norm works for
    every map.) State ``W``: ``r·d_v`` numbers, no normaliser.

    Parameters
    ----------
    beta : float in (0, 2], or tensor ``(..., n_k)``
        Step size, one for all tokens or one per token (a tensor broadcastable to the keys' batch shape and
        length; :class:`~kernapprox.attention.recurrent.RecurrentState` then takes ``beta=`` per step).

    References
    ----------
    Schlag, Irie & Schmidhuber, *Linear Transformers Are Secretly Fast Weight Programmers*, ICML 2021, eqs.
    (15)–(20). Yang, Wang, Zhang, Shen & Kim, *Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length*, NeurIPS 2024, eqs. (5)–(9) (chunkwise WY/UT form; flash-linear-attention's ``delta_rule/naive.py``
    states the same recurrence).

    Examples
    --------
    >>> import kernapprox as ka
    >>> ka.rules.Delta(0.5), ka.rules.Delta(0.5).state_numbers(r=64, d_v=16)
    (Delta(beta=0.5), 1024)
    """

    beta: float | torch.Tensor = 1.0
    name: ClassVar[str] = "delta"
    normalized: ClassVar[bool] = False
    unit_features: ClassVar[bool] = True
    state_type: ClassVar[type] = DeltaState

    def __post_init__(self):
        object.__setattr__(self, "beta", check_beta(self.beta, "beta"))

    @property
    def per_token(self) -> bool:
        return isinstance(self.beta, torch.Tensor)

    def state_numbers(self, r, d_v):
        return r * d_v

    def empty_state(self, batch_shape, r, d_v, dtype, device):
        return DeltaState(torch.zeros(*batch_shape, r, d_v, dtype=dtype, device=device))

    def _state_shapes(self, batch_shape, r, d_v):
        return ((*batch_shape, r, d_v),)

    def __repr__(self) -> str:
        beta = f"tensor{tuple(self.beta.shape)}" if self.per_token else repr(self.beta)
        return f"Delta(beta={beta})"


@dataclasses.dataclass(frozen=True, repr=False)
class LeastSquares(Rule):
    r"""The least-squares state (test-time regression): the ``W`` that best maps the keys' features to the values.

    .. math:: W_t = \arg\min_W Σ_{s≤t} ‖v_s − Wᵀφ̄(k_s)‖² + λ‖W‖_F^2 = (K̄_tᵀK̄_t + λI)^{−1} K̄_tᵀ V_t,
              \qquad y_t = W_tᵀ φ̄(q_t),

    the best any linear state on these features can do in hindsight (Wang, Shi & Fox 2025, sec. 3; the delta rule
    is its first-order online approximation, the sum rule its λ → ∞ relative). Read-out **not** normalised like
    attention. Recurrent mode: recursive least squares, ``P_t = (K̄_tᵀK̄_t + λI)^{−1}`` updated by
    Sherman–Morrison, ``g_t = P_{t−1}φ̄_t / (1 + φ̄_tᵀP_{t−1}φ̄_t)``, ``P_t = P_{t−1} − g_t φ̄_tᵀP_{t−1}``,
    ``W_t = W_{t−1} + g_t (v_t − W_{t−1}ᵀφ̄_t)ᵀ`` — ``O(r² + r d_v)`` per token. Chunked mode: per chunk of ``C``
    keys one Cholesky factor ``LLᵀ = I + K̄PK̄ᵀ`` (Woodbury), ``E = L^{−1}K̄P`` so that ``P_s = P − E_{≤s}ᵀE_{≤s}``
    inside the chunk; ``O(C r² + C² r + C³)`` per chunk, linear in ``n``. Parallel mode: the normal equations per
    query row (any boolean mask). Non-causal: one regression on every key.

    Features ``φ̄ = φ/‖φ‖₂`` as for :class:`Delta` (the log-scale cancels exactly; ``λ`` is then measured against
    unit keys, and the delta rule with the same features is one gradient step on the same loss). State ``(W, P)``:
    ``r² + r·d_v`` numbers (``P`` is symmetric; it is stored whole and counted whole).

    Precision: the modes solve systems of condition number up to ``1 + n/λ`` (``n`` keys, unit features), so
    their relative accuracy is about ``eps·(1 + n/λ)`` — ``λ ≳ 10⁻⁵ n`` keeps float32 within ~1e-3; a smaller
    ridge wants float64. Where ``eps·(1 + n/λ) ≥ 1`` (no digit guaranteed) every mode and
    :class:`~kernapprox.attention.recurrent.RecurrentState` raise ``ValueError``, as does a factorisation that
    fails numerically. ``n`` counts every key the regression holds: those of the call plus those an initial or
    carried state already absorbed, read off its ``P`` (:meth:`keys_in`: ``n = tr(P⁻¹) − rλ``), so a prefill
    followed by decoding steps raises where one pass over the same keys does; a state whose ``P`` is not positive
    definite raises too.

    Parameters
    ----------
    ridge : float > 0
        ``λ``: ``P_0 = I/λ``. With unit features, ``λ = 1`` weighs like one stored key.

    References
    ----------
    Wang, Shi & Fox, *Test-time regression: a unifying framework for designing sequence models with associative
    memory*, arXiv 2501.12352 (2025), sec. 3 (eqs. (4)–(6)); recursive least squares: Haykin, *Adaptive Filter
    Theory*, ch. 10 (Sherman–Morrison update).

    Examples
    --------
    >>> import kernapprox as ka
    >>> ka.rules.LeastSquares(0.1).state_numbers(r=64, d_v=16)
    5120
    """

    ridge: float = 1.0
    name: ClassVar[str] = "least_squares"
    normalized: ClassVar[bool] = False
    unit_features: ClassVar[bool] = True
    state_type: ClassVar[type] = LeastSquaresState

    def __post_init__(self):
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, numbers.Real):
            raise TypeError(f"ridge must be a positive real number, got {self.ridge!r}")
        if not (math.isfinite(float(self.ridge)) and float(self.ridge) > 0.0):
            raise ValueError(f"ridge must be positive and finite (λ ≤ 0 leaves P = (K̄ᵀK̄ + λI)^-1 undefined), "
                             f"got {self.ridge}")
        object.__setattr__(self, "ridge", float(self.ridge))

    def state_numbers(self, r, d_v):
        return r * r + r * d_v

    def check_precision(self, num_keys: int, dtype: torch.dtype) -> None:
        """Raise if ``eps·(1 + n/λ) ≥ 1``: the systems of ``n`` unit keys then have a condition number beyond
        ``1/eps`` of ``dtype`` and no digit of the result is guaranteed."""
        eps = torch.finfo(dtype).eps
        if eps * (1.0 + num_keys / self.ridge) >= 1.0:
            raise ValueError(f"least squares with ridge λ = {self.ridge:g} over {num_keys} keys in {dtype}: the "
                             f"systems it solves have condition number up to 1 + n/λ = {1 + num_keys / self.ridge:.3g}"
                             f", beyond 1/eps = {1 / eps:.3g}, so no digit of the result is guaranteed; use a ridge "
                             f"above {eps * num_keys:.2g} (λ ≳ 1e-5·n for ~1e-3 accuracy in float32) or float64")

    def keys_in(self, state: LeastSquaresState) -> float:
        """How many unit keys a state has absorbed (the largest over its batch entries), read off ``P``:
        ``P⁻¹ = λI + Σ φ̄_j φ̄_jᵀ`` has trace ``rλ + n`` for ``n`` unit keys, so ``n = tr(P⁻¹) − rλ`` (computed in
        float64; an ``r × r`` Cholesky factor per entry, once per call or per :class:`RecurrentState`). What
        :meth:`check_precision` counts for a call that starts from an initial state.

        ``P`` is positive definite in exact arithmetic (its eigenvalues lie in ``[1/(λ + n), 1/λ]``); one that is
        not numerically so (its float64 Cholesky factor fails) was kept beyond its precision — more keys than the
        ridge allows in its dtype, or not a least-squares state — and its count cannot be read: ``ValueError``
        naming the cause, never a count of zero that would let the guard pass."""
        p = state.p.double()
        r = p.shape[-1]
        if p.numel() == 0:
            return 0.0
        factor, info = torch.linalg.cholesky_ex(0.5 * (p + p.transpose(-1, -2)))
        if bool((info != 0).any()):
            raise ValueError(f"least squares with ridge λ = {self.ridge:g}: the state's P = (K̄ᵀK̄ + λI)⁻¹ is not "
                             f"positive definite ({state.p.dtype}), so the keys it carries cannot be counted: it was "
                             "kept beyond its precision (more keys than eps·(1 + n/λ) < 1 allows) or is not a "
                             "least-squares state; use a larger ridge or float64")
        inverse = torch.cholesky_inverse(factor)
        keys = inverse.diagonal(dim1=-2, dim2=-1).sum(-1) - r * self.ridge
        return max(0.0, float(keys.max()))

    def empty_state(self, batch_shape, r, d_v, dtype, device):
        eye = torch.eye(r, dtype=dtype, device=device) / self.ridge
        return LeastSquaresState(torch.zeros(*batch_shape, r, d_v, dtype=dtype, device=device),
                                 eye.expand(*batch_shape, r, r).clone())

    def _state_shapes(self, batch_shape, r, d_v):
        return (*batch_shape, r, d_v), (*batch_shape, r, r)


_BY_NAME = {rule.name: rule for rule in (Sum, Decay, Delta, LeastSquares)}
# The names of the rules, in order: what every finite feature map declares in ``capabilities().rules``.
RULES = tuple(_BY_NAME)


def available_rules() -> list[str]:
    """Names of the state-update rules, in order: ``sum``, ``decay``, ``delta``, ``least_squares``.

    >>> import kernapprox as ka
    >>> ka.available_rules()
    ['sum', 'decay', 'delta', 'least_squares']
    """
    return list(RULES)


def resolve_rule(rule) -> Rule:
    """A rule object from a rule or a name (``"sum"``, ``"delta"`` with β = 1, ``"least_squares"`` with λ = 1;
    ``"decay"`` needs its γ: ``Decay(gamma)``)."""
    if isinstance(rule, Rule):
        if type(rule) is Rule:
            raise TypeError("rule must be a concrete rule (Sum, Decay, Delta, LeastSquares), not the base Rule")
        return rule
    if isinstance(rule, str):
        if rule == "decay":
            raise ValueError("the decay rule needs its γ: pass kernapprox.rules.Decay(gamma)")
        if rule in _BY_NAME:
            return _BY_NAME[rule]()
        raise ValueError(f"unknown rule {rule!r}; available: {', '.join(RULES)}")
    raise TypeError(f"rule must be a rule name ({', '.join(RULES)}) or a kernapprox.rules object, got "
                    f"{type(rule).__name__}")


def check_beta(beta, name: str = "beta"):
    """β of the delta rule: a real number in (0, 2] or a floating tensor with every entry in (0, 2]."""
    if isinstance(beta, torch.Tensor):
        if not beta.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {beta.dtype}")
        if beta.numel() == 0:
            raise ValueError(f"{name} must not be empty")
        if beta.device.type != "meta":
            bad = ~((beta > 0) & (beta <= 2))          # NaN counts as bad
            if bool(bad.any()):
                raise ValueError(f"{name} must lie in (0, 2] (the delta rule's state grows without bound outside "
                                 f"it), got values in [{float(beta.min())}, {float(beta.max())}]")
        return beta
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise TypeError(f"{name} must be a real number in (0, 2] or a tensor of them, got {beta!r}")
    if not (0.0 < float(beta) <= 2.0):
        raise ValueError(f"{name} must be in (0, 2] (the delta rule's state grows without bound outside it), "
                         f"got {beta}")
    return float(beta)


# ------------------------------------------------------------------------------------------ state conversions
def to_internal(state):
    """A normalised state's ``−inf`` log-scales (empty entries) as the finite sentinel; other states as given."""
    if isinstance(state, NormalizedState):
        c = state.log_scale
        return NormalizedState(state.w, state.z, torch.where(c < _EMPTY_BELOW, torch.full_like(c, SENTINEL), c))
    return state


def to_public(state):
    """The inverse of :func:`to_internal`: empty entries get ``log_scale = −inf``."""
    if isinstance(state, NormalizedState):
        c = state.log_scale
        return NormalizedState(state.w, state.z, torch.where(c < _EMPTY_BELOW, torch.full_like(c, -math.inf), c))
    return state


def unit_features(phi: torch.Tensor, role: str, estimator_name: str, padding: torch.Tensor | None = None):
    """``φ̄ = φ̃/‖φ̃‖₂`` (the log-scale cancels); padded rows (``padding`` True) become zero. A token whose
    features are all zero has no direction: it raises."""
    norm = torch.linalg.vector_norm(phi, dim=-1)
    zero = norm == 0
    if padding is not None:
        zero = zero & ~padding
    if bool(zero.any()):
        raise ValueError(f"the {role} features of {estimator_name} are all zero at some token: the rule needs the "
                         "unit direction φ(x)/‖φ(x)‖, which does not exist there")
    out = phi / torch.where(norm == 0, torch.ones_like(norm), norm)[..., None]
    if padding is not None:
        out = out.masked_fill(padding[..., None], 0.0)
    return out


def unit_directions(estimator, x: torch.Tensor, role: str, dtype: torch.dtype, padding: torch.Tensor | None = None):
    """``φ̄(x) = φ̃(x)/‖φ̃(x)‖₂`` of ``estimator``'s map at the rows ``x`` in ``dtype``: :func:`unit_features` of
    its stabilised features (the log-scale cancels in the direction, so it is not applied). What the delta and
    least-squares rules write and read in every mode (:class:`Delta` says why unit 2-norm: with ``‖φ̄(k)‖ = 1``
    each step is a contraction for ``β ∈ (0, 2]``, Schlag et al. 2021, sec. 4.2)."""
    phi, _ = estimator.features(x, role, log_scale=True, check_finite=False)
    return unit_features(phi.to(dtype), role, type(estimator).__name__, padding)

