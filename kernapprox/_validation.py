"""Input checks shared by every public entry point.

One place for the rules: tensors must be floating point torch tensors of rank >= 2 with finite values, pairs of
tensors must share dtype and device, sizes must be positive integers, names must be known. Every failure raises
``TypeError`` (wrong kind of object) or ``ValueError`` (wrong value) with the argument's name in the message.
Nothing is coerced.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class NotFittedError(ValueError, AttributeError):
    """Raised when an estimator is used before ``fit``."""


def check_tensor(x, name: str, *, min_rank: int = 2, finite: bool = True, allow_empty: bool = False):
    """Check that ``x`` is a floating-point tensor of rank >= ``min_rank`` with finite entries."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    if x.dim() < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank} (shape (..., n, d)), got shape {tuple(x.shape)}")
    if not allow_empty and x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    if min_rank >= 1 and x.dim() >= 1 and x.shape[-1] == 0:
        raise ValueError(f"{name} has a zero-size feature dimension, shape {tuple(x.shape)}")
    # meta tensors carry no values (shape-only checks); everything else is checked for NaN/Inf
    if finite and x.numel() and x.device.type != "meta" and not _all_finite(x):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def _all_finite(x: torch.Tensor) -> bool:
    """One reduction pass: NaN propagates through min/max and ±Inf is an extreme, so the two extremes are finite
    exactly when every entry is (about 9× cheaper than materialising ``isfinite(x)`` on a CPU)."""
    lo, hi = torch.aminmax(x.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_same_kind(**tensors: torch.Tensor) -> None:
    """All named tensors share one dtype and one device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}; cast explicitly")
        if t.device != first.device:
            raise ValueError(f"{name} is on device {t.device} but {first_name} is on {first.device}")


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def check_positive_float(value, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'} and finite, got {value}")
    return v


def check_bool(value, name: str) -> bool:
    """``value`` must be a Python bool (or numpy bool); truthy objects are not accepted."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_choice(value, name: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid values: {', '.join(map(str, choices))}")
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype computations run in: half types are promoted to float32 (exp needs the dynamic range)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
