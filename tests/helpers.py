"""Small helpers that several test modules share (importable because pytest puts this folder on sys.path)."""

import numpy as np


def gaussian(shape, seed, std=1.0):
    """Standard normal draws of ``shape`` (times ``std``) from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).standard_normal(shape) * std
