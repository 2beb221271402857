"""Estimators at equal state bytes: the largest configuration of an estimator whose decoder state fits a budget.

Comparing approximations at equal *rank* favours the ones that keep more than ``r·(d_v + 1)`` numbers (Nyström's
landmarks and whitening, a hybrid's exact window, LARA's proposals, EVA's local window and group summaries). The
fair comparison is at equal *memory*: every estimator runs at its largest configuration whose state, as the
estimator itself accounts for it (:meth:`~kernapprox.estimators.base.Estimator.state_bytes` at the context length:
everything a decoder keeps from the context), fits one budget ``B``, usually the state of the random-feature
baselines at ``r`` features (:func:`budget_bytes`).

:func:`sized_configuration` finds that configuration:

- *feature-sized* estimators (``size_by="num_features"``; every state grows with ``r``): the largest valid ``r``
  with ``state_bytes(r) ≤ B``, at most ``n`` for a map whose rank is limited by its points (declared by
  ``rank_limited_by_points``), found by doubling then bisection; valid values are the multiples of the smallest
  accepted ``r`` (maps built from pairs of features need an even ``r``);
- *group-sized* estimators (``size_by="group_size"``, EVA): the smallest group size ``g`` (the most groups, with
  ``⌈n/g⌉`` draws) whose state fits, scanning ``g = 1, 2, …`` until ``g`` tokens of keys, values and log-features
  alone (``g (d + d_v + 1)`` numbers, a lower bound of the local state) exceed the budget;
- maps of a fixed dimension (declared by ``fixed_dimension``): their one configuration, if it fits.

``None`` means nothing fits (:func:`smallest_state` says what the smallest configuration would have needed); an
estimator without a state of fixed size (exact attention's KV cache, the SVD references, Nyströmformer) cannot be
sized and raises ``ValueError``. State sizes are measured on a fixed standard-normal probe of ``n`` tokens (no
estimator's state size depends on the values) and memoised per process.

>>> import kernapprox as ka
>>> budget = budget_bytes(64, d=32, d_v=32, seq_len=256)          # FAVOR+/OPRF at r = 64
>>> sized_configuration("nystrom_uniform", budget, d=32, d_v=32, seq_len=256)["num_features"] < 64
True
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .estimators.registry import capabilities, make_estimator
from .validation import check_choice, check_positive_int

__all__ = ["BUDGET_BASELINES", "SIZE_BY", "probe_state_bytes", "budget_bytes", "feature_step", "sized_configuration",
           "smallest_state"]

# B(r) is the larger state of FAVOR+ and OPRF at r features: r·(d_v + 1) float32 numbers, plus OPRF's one fitted
# statistic, so that both baselines run at r itself.
BUDGET_BASELINES = ("positive_orthogonal", "oprf_orthogonal")
SIZE_BY = ("num_features", "group_size")


@functools.lru_cache(maxsize=8)
def _probe(seq_len: int, d: int) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(0).standard_normal((seq_len, d)))


@functools.lru_cache(maxsize=4096)
def _state_bytes(name: str, options: tuple, num_features, d: int, d_v: int, seq_len: int, dtype: torch.dtype) -> int:
    x = _probe(seq_len, d)
    est = make_estimator(name, num_features=num_features, rng=0, **dict(options)).fit(x, x)
    return int(est.state_bytes(d_v, dtype, seq_len=seq_len))


def _key(options) -> tuple:
    return tuple(sorted(dict(options or {}).items()))


def probe_state_bytes(name: str, num_features: int | None, *, d: int, d_v: int, seq_len: int,
                      options: dict | None = None, dtype: torch.dtype = torch.float32) -> int:
    """``state_bytes(d_v, dtype, seq_len)`` of ``make_estimator(name, num_features, rng=0, **options)`` fitted on
    the fixed standard-normal probe of ``seq_len`` tokens of dimension ``d`` (memoised). Raises ``ValueError``
    for an estimator without a state of fixed size."""
    for value, label in ((d, "d"), (d_v, "d_v"), (seq_len, "seq_len")):
        check_positive_int(value, label)
    return _state_bytes(name, _key(options), num_features, d, d_v, seq_len, dtype)


def budget_bytes(r: int, *, d: int, d_v: int, seq_len: int, baselines=BUDGET_BASELINES,
                 dtype: torch.dtype = torch.float32) -> int:
    """``B(r)``: the largest state of the ``baselines`` (default FAVOR+ and OPRF) at ``r`` features."""
    check_positive_int(r, "r")
    return max(probe_state_bytes(name, r, d=d, d_v=d_v, seq_len=seq_len, dtype=dtype) for name in baselines)


def feature_step(name: str, options: dict | None = None) -> int:
    """The smallest ``num_features`` that ``name`` accepts (1, or 2 for maps built from pairs of features, or 4);
    its valid feature counts are the multiples of it."""
    for step in (1, 2, 4):
        try:
            make_estimator(name, num_features=step, rng=0, **dict(options or {}))
        except ValueError:
            continue
        return step
    raise ValueError(f"{name} accepts none of num_features = 1, 2, 4")


def _group_unit(d: int, d_v: int, dtype: torch.dtype) -> int:
    return (d + d_v + 1) * torch.empty((), dtype=dtype).element_size()


def sized_configuration(name: str, budget: int, *, d: int, d_v: int, seq_len: int, options: dict | None = None,
                        size_by: str = "num_features", dtype: torch.dtype = torch.float32) -> dict | None:
    """Constructor arguments (``num_features``, the ``options`` and, with ``size_by="group_size"``,
    ``group_size``) of the largest configuration of ``name`` whose state fits ``budget`` bytes at context length
    ``seq_len``, or ``None`` if none fits (see the module docstring for the rule). Raises ``ValueError`` for an
    estimator without a state of fixed size."""
    budget = check_positive_int(budget, "budget")
    check_choice(size_by, "size_by", SIZE_BY)
    options = dict(options or {})

    def size(r, **extra):
        return probe_state_bytes(name, r, d=d, d_v=d_v, seq_len=seq_len, options={**options, **extra}, dtype=dtype)

    if size_by == "group_size":
        unit = _group_unit(d, d_v, dtype)
        for g in range(1, seq_len + 1):
            if g * unit > budget:
                return None
            groups = -(-seq_len // g)
            if size(groups, group_size=g) <= budget:
                return {"num_features": groups, **options, "group_size": g}
        return None
    if capabilities(name, **options).fixed_dimension:            # one configuration: its own dimension
        return {"num_features": None, **options} if size(None) <= budget else None
    step = feature_step(name, options)            # maps of sin/cos or exp(±) pairs need an even r
    cap = (seq_len if capabilities(name, **options).rank_limited_by_points else 2**30) // step
    if size(step) > budget:
        return None
    lo, hi = 1, 2                                   # in units of step: size(lo) fits; find hi that does not
    while hi <= cap and size(hi * step) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:                              # invariant: size(lo) <= budget < size(hi) (or hi = cap + 1)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid * step) <= budget else (lo, mid)
    return {"num_features": lo * step, **options}


def smallest_state(name: str, *, d: int, d_v: int, seq_len: int, options: dict | None = None,
                   size_by: str = "num_features", dtype: torch.dtype = torch.float32) -> int:
    """The smallest state of ``name``'s configurations (its smallest valid ``num_features``; group-sized: the
    best group size), to report what an estimator that fits no budget would have needed."""
    check_choice(size_by, "size_by", SIZE_BY)
    options = dict(options or {})
    if size_by == "num_features":
        r = None if capabilities(name, **options).fixed_dimension else feature_step(name, options)
        return probe_state_bytes(name, r, d=d, d_v=d_v, seq_len=seq_len, options=options, dtype=dtype)
    unit = _group_unit(d, d_v, dtype)
    best = None
    for g in range(1, seq_len + 1):
        if best is not None and g * unit > best:
            break
        value = probe_state_bytes(name, -(-seq_len // g), d=d, d_v=d_v, seq_len=seq_len,
                                  options={**options, "group_size": g}, dtype=dtype)
        best = value if best is None else min(best, value)
    return best
