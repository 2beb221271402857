"""A re-export of :mod:`kernapprox.rules`, where the state-update rules, their names and states live.

Kept for the function-level imports of :mod:`kernapprox.attention.native` (``NormalizedState``, ``SENTINEL``); the
attention modules import :mod:`kernapprox.rules` directly. Nothing is defined here.
"""

from ..rules import (  # noqa: F401
    _EMPTY_BELOW,
    RULES,
    SENTINEL,
    Decay,
    Delta,
    DeltaState,
    LeastSquares,
    LeastSquaresState,
    NormalizedState,
    Rule,
    Sum,
    available_rules,
    check_beta,
    resolve_rule,
    to_internal,
    to_public,
    unit_features,
)
