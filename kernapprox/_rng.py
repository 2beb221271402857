"""Randomness: every draw comes from a numpy ``Generator`` built from the user's ``rng`` (SPEC 7).

Random matrices are drawn on the CPU in float64 and only then moved to a device and cast, so one seed means one
draw on every device and dtype. torch's global RNG is never used.
"""

from __future__ import annotations

import numbers

import numpy as np


def as_generator(rng) -> np.random.Generator:
    """Turn ``rng`` (None, int, ``SeedSequence`` or ``Generator``) into a ``Generator``.

    ``None`` gives fresh OS entropy (irreproducible; experiments always pass a seed). A ``Generator`` is used
    as is (its state advances).
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, np.random.SeedSequence):
        return np.random.default_rng(rng)
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        if rng < 0:
            raise ValueError(f"rng must be a non-negative integer seed, got {rng}")
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be None, an int, a numpy SeedSequence or Generator, got {type(rng).__name__}")
