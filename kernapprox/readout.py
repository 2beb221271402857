"""The attention read-out of in-context-learning episodes: exact attention or an estimator reading a context.

Each query reads the context through ``ŷ(q) = Σ_i κ(q, k_i) v_i / Σ_i κ(q, k_i)`` with ``κ = exp(β qᵀk)`` (exact
attention, the KV cache) or ``κ ≈ φ(q)ᵀφ(k)`` (an estimator, the state ``W = Σ v_i φ(k_i)ᵀ``, ``z = Σ φ(k_i)``).
Episodes and scores are in :mod:`kernapprox.tasks`.

Causal form
-----------
Queries come after the context and do not write to the state, so every query reads the state after the whole
context: ``ŷ(q) = W_n φ(q) / z_nᵀφ(q)``. That is non-causal attention of the queries on the context, which is
what :func:`attention_readout` computes (the tests check it against :class:`~kernapprox.RecurrentState` fed
token by token).

State size
----------
:func:`state_bytes` is the estimator's :meth:`~kernapprox.estimators.base.Estimator.state_bytes` at the
context length: a linear state holds ``r·(d_v + 1)`` numbers (``W`` and ``z``; Zoology/Based convention) plus
what its map computed from the context (Nyström's landmarks and whitening, fitted statistics); a window hybrid
adds its window of keys and values; exact attention holds the KV cache of the context, ``n·(d + d_v)`` numbers;
4 bytes per number (float32) unless stated.

Fitting
-------
Data-dependent maps are fitted on the context only (its keys), as a recurrent model reading the context before
any query would have to: the read-out of a query never depends on the test queries (Nyström landmarks are
context keys; OPRF/DERF statistics are the keys'). ``tests/test_icl_anchors.py`` proves it for every
data-dependent feature map of the registry: replacing some test queries leaves every other query's read-out
unchanged. Estimators that bring their own attention and are data dependent (Nyströmformer, whose landmarks are
segment means of the queries; the rank-r SVD references, built from the query–key matrix) compute their
approximation from the queries they are given, so a query's read-out depends on the other test queries; they are
refused unless the read-out is declared an oracle (``fit_on="queries_and_keys"``), and the :class:`Readout` says
so (``oracle=True``). An oracle is a reference, never a method an ICL study may compare as an estimator.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .attention import linear_attention, softmax_attention
from .estimators.base import Estimator
from .estimators.registry import capabilities, make_estimator
from .validation import as_generator, check_choice, check_positive_float, check_positive_int, check_tensor, itemsize

__all__ = ["Readout", "attention_readout", "paired_readouts", "build_estimator", "estimator_capabilities",
           "reads_test_queries", "state_bytes"]


class Readout(NamedTuple):
    """The attention read-out of a batch of episodes.

    ``output (B, n_q, d_v)``: normalised attention output. ``numerator (B, n_q, d_v)`` and ``normalizer
    (B, n_q)``: ``Σ κ̂ v`` and ``Σ κ̂`` up to one positive factor per query (so signs and directions are
    exact; decoding the numerator alone is the unnormalised fast-weight read-out ``W φ(q)`` of Schlag et al.
    2021, immune to normaliser sign flips). ``state_bytes``: see :func:`state_bytes` (``None`` for an
    estimator without a recurrent state, such as the rank-r SVD references). ``num_features``: the state feature
    dimension ``r`` (``None`` for exact attention). ``oracle``: the read-out looked at the test queries
    (``fit_on="queries_and_keys"``): a reference, not an estimator reading its context.
    """

    output: torch.Tensor
    numerator: torch.Tensor
    normalizer: torch.Tensor
    state_bytes: int | None
    num_features: int | None
    oracle: bool = False


def _factory(estimator):
    """``(factory, capabilities_for)`` of a registry name or an :class:`~kernapprox.estimators.base.Estimator`
    subclass (for maps that are not registered, e.g. fixed linear-attention maps outside the contract table)."""
    if isinstance(estimator, str):
        return functools.partial(make_estimator, estimator), functools.partial(capabilities, estimator)
    if isinstance(estimator, type) and issubclass(estimator, Estimator):
        return estimator, estimator.capabilities_for
    raise TypeError(f"estimator must be a registry name or an Estimator subclass, got {estimator!r}")


def estimator_capabilities(estimator, **options):
    """The declared :class:`~kernapprox.estimators.base.Capabilities` of a registry name or an estimator class
    with constructor ``options``."""
    _, caps = _factory(estimator)
    return caps(**options)


def build_estimator(estimator, *, beta: float, num_features: int | None = None, rng=None, **options
                    ) -> Estimator:
    """An unfitted estimator (registry name or estimator class) with inverse temperature ``scale = β`` (for
    unit-norm inputs).

    ``num_features`` is not passed to estimators whose dimension is fixed by ``d`` (declared
    ``fixed_dimension``: the exact kernel, Taylor, ELU+1, DPFP); their read-outs report the dimension they have
    (:attr:`Readout.num_features`).
    """
    beta = check_positive_float(beta, "beta")
    factory, caps = _factory(estimator)
    if caps(**options).fixed_dimension:
        num_features = None
    return factory(num_features=num_features, rng=rng, scale=beta, **options)


def state_bytes(estimator: Estimator, d_v: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the memory a fitted estimator reads a context of ``seq_len`` tokens from:
    ``estimator.state_bytes(d_v, dtype, seq_len=seq_len)`` (see the module notes)."""
    check_positive_int(d_v, "d_v")
    check_positive_int(seq_len, "seq_len")
    itemsize(dtype)
    return int(estimator.state_bytes(d_v, dtype, seq_len=seq_len))


FIT_TARGETS = ("keys", "queries_and_keys")


def reads_test_queries(estimator, **options) -> bool:
    """Whether the read-out of one query by ``estimator`` depends on the other test queries when fitted on the
    context: estimators that bring their own attention and are data dependent build their approximation from the
    queries they are given (declared: ``kind == "attention"`` and ``data_dependent``). Conservative: a window
    hybrid with a data-dependent map counts too."""
    caps = estimator_capabilities(estimator, **options)
    return caps.kind == "attention" and caps.data_dependent


def attention_readout(estimator, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                      beta: float, num_features: int | None = None, rng=None, mode: str | None = None,
                      fit_on: str = "keys", options: dict | None = None) -> Readout:
    """Read each episode's context with ``queries``: exact softmax attention or an approximation.

    ``queries (B, n_q, d)``, ``keys (B, n, d)``, ``values (B, n, d_v)``. For every episode a fresh estimator
    ``estimator`` (a registry name or an estimator class, with extra constructor ``options``) is
    built with ``scale = β`` and ``num_features`` and fitted on that episode alone:

    ``fit_on="keys"`` (default)
        ``fit(keys)``: the map is derived from the context only, as a recurrent model reading the context
        before any query would have to (Nyström landmarks are context keys; no query is seen). Estimators whose
        attention reads the test queries (:func:`reads_test_queries`: Nyströmformer, the rank-r SVD references)
        raise ``ValueError``.
    ``fit_on="queries_and_keys"``
        The **oracle** read-out: ``fit(queries, keys)``, and estimators that read the test queries are allowed.
        For reference curves that need the query–key matrix itself (the rank-r SVD references); the result has
        ``oracle=True``. An ICL study must not use it for an estimator it compares.

    Data-independent maps use only ``d``. Random maps get an independent draw per episode (seeds from
    ``rng``), so averages over episodes also average over draws. ``mode`` is the linear-attention mode
    (non-causal: the state after the context, see the module notes); by default ``"chunked"``, or the first
    mode the estimator supports (e.g. ``"parallel"`` for the rank-r SVD references). ``"exact"`` is
    :func:`~kernapprox.softmax_attention` with ``scale = β``.
    """
    for name, tensor in (("queries", queries), ("keys", keys), ("values", values)):
        check_tensor(tensor, name, min_rank=3)
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D (episodes, tokens, features): one episode per row, no head "
                             f"dimension; got shape {tuple(tensor.shape)} (flatten extra leading dimensions into "
                             "the episode dimension)")
    beta = check_positive_float(beta, "beta")
    check_choice(fit_on, "fit_on", FIT_TARGETS)
    oracle = fit_on == "queries_and_keys"
    batch, n, d_v = values.shape
    caps = estimator_capabilities(estimator, **(options or {}))
    if not oracle and reads_test_queries(estimator, **(options or {})):
        raise ValueError(f"{estimator!r} builds its attention from the queries it is given (a data-dependent "
                         "estimator with its own attention): its read-out of a query would depend on the other test "
                         "queries. Use it only as an oracle reference, fit_on='queries_and_keys'")
    if caps.kind == "exact":                                 # one batched call; nothing random
        out = softmax_attention(queries, keys, values, scale=beta)
        ones = torch.ones(out.shape[:-1], dtype=out.dtype, device=out.device)
        exact = build_estimator(estimator, beta=beta).fit(queries, keys)
        return Readout(output=out, numerator=out, normalizer=ones, state_bytes=state_bytes(exact, d_v, n),
                       num_features=None)                  # exact attention reads no other query, oracle or not
    gen = as_generator(rng)
    seeds = gen.integers(0, 2**63 - 1, size=batch)
    outs, nums, dens = [], [], []
    fitted = None
    for b in range(batch):
        q_b, k_b, v_b = queries[b], keys[b], values[b]
        fitted = build_estimator(estimator, beta=beta, num_features=num_features, rng=int(seeds[b]),
                                 **(options or {}))
        if fit_on == "keys":
            fitted.fit(k_b)
        else:
            fitted.fit(q_b, k_b)
        use = mode or ("chunked" if "chunked" in caps.modes else caps.modes[0])
        parts = linear_attention(q_b, k_b, v_b, fitted, causal=False, mode=use, return_parts=True)
        outs.append(parts.output)
        nums.append(parts.numerator.to(q_b.dtype))
        dens.append(parts.normalizer.to(q_b.dtype))
    memory = state_bytes(fitted, d_v, n) if "recurrent" in caps.modes else None
    return Readout(output=torch.stack(outs), numerator=torch.stack(nums), normalizer=torch.stack(dens),
                   state_bytes=memory, num_features=int(fitted.num_features), oracle=oracle)


def paired_readouts(estimator, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, beta: float,
                    num_features: int | None = None, rng=None, fit_on: str = "keys", options: dict | None = None
                    ) -> tuple[Readout, Readout]:
    """``(read, exact)``: the :func:`attention_readout` of ``estimator`` and of exact attention on the same
    episodes, so that an estimator's task score and its attention-output error are measured on matched inputs.

    Arguments as in :func:`attention_readout`. Exact attention draws nothing from ``rng``; when ``estimator`` is
    the exact kernel itself, ``read`` is the exact read-out (computed once).
    """
    exact = attention_readout("exact", queries, keys, values, beta=beta)
    if estimator_capabilities(estimator, **(options or {})).kind == "exact":
        return exact, exact
    read = attention_readout(estimator, queries, keys, values, beta=beta, num_features=num_features, rng=rng,
                             fit_on=fit_on, options=options)
    return read, exact
