"""Input checks and sources of randomness shared by every public entry point.

One place for the rules: tensors must be floating point torch tensors of rank >= 2 with finite values, pairs of
tensors must share dtype and device, sizes must be positive integers, names must be known. Every failure raises
``TypeError`` (wrong kind of object) or ``ValueError`` (wrong value) with the argument's name in the message.
Nothing is coerced.

Randomness: every draw comes from a numpy ``Generator`` built from the user's ``rng`` by :func:`as_generator`
(SPEC 7). Random matrices are drawn on the CPU in float64 and only then moved to a device and cast, so one seed
means one draw on every device and dtype. torch's global RNG is never used.

Examples
--------
>>> import math

import torch
>>> from kernapprox.validation import check_positive_int, check_tensor
>>> check_positive_int(3, "num_features")
3
>>> check_tensor(torch.zeros(2), "q")
Traceback (most recent call last):
...
ValueError: q must have rank >= 2 (shape (..., n, d)), got shape (2,)
"""

from __future__ import annotations

import math
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
    if finite and x.numel() and x.device.type != "meta":
        check_finite(x, f"{name} contains NaN or Inf values")
    return x


def check_finite(x: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless every entry of ``x`` is finite.

    Traced by :func:`torch.compile`, the check is an assertion inside the graph instead of a data-dependent
    branch (which would break the graph): a NaN or Inf then raises ``RuntimeError`` with the same message when the
    compiled graph runs. Never a silently wrong result either way."""
    if torch.compiler.is_compiling():
        lo, hi = torch.aminmax(x.detach())
        torch._assert_async(torch.isfinite(lo) & torch.isfinite(hi), message)
    elif not all_finite(x):
        raise ValueError(message)


def max_row_norm(x: torch.Tensor) -> float:
    """The largest Euclidean norm of a row (last dimension) of ``x``, in float64: what error messages about
    overflow report."""
    return float(torch.linalg.vector_norm(x.detach().double(), dim=-1).max())


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, in one reduction pass: NaN propagates through min/max and ±Inf is
    an extreme, so the two extremes are finite exactly when every entry is (about 9× cheaper than materialising
    ``isfinite(x)`` on a CPU), the two extremes then read in one transfer (one synchronisation on a GPU; the
    test on the host costs no further tensor operations, which dominate on the small tensors of a decoding
    step). ``x`` must not be empty."""
    lo, hi = torch.aminmax(x.detach())
    return all(math.isfinite(v) for v in torch.stack((lo, hi)).tolist())


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


def check_float_dtype(value, name: str, *, allow_none: bool = False):
    """``value`` must be a floating ``torch.dtype`` (or ``None`` with ``allow_none``); returned as given."""
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype{' or None' if allow_none else ''}, got {value!r}")
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype computations run in: half types are promoted to float32 (exp needs the dynamic range)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


RNG_TYPES = "None, a non-negative int seed, a numpy.random.SeedSequence or a numpy.random.Generator"


def as_generator(rng) -> np.random.Generator:
    """Turn ``rng`` (None, int, ``SeedSequence`` or ``Generator``) into a ``Generator``.

    ``None`` gives fresh OS entropy (irreproducible; experiments always pass a seed). A ``Generator`` is used
    as is (its state advances). A ``torch.Generator`` is refused with its own message: draws are made with numpy
    on the CPU in float64 (one seed, one draw on every device and dtype), so torch's generators are never used.

    >>> as_generator(torch.Generator())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: rng must be None, a non-negative int seed, ... got a torch.Generator, ...: pass an int seed instead
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, np.random.SeedSequence):
        return np.random.default_rng(rng)
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        if rng < 0:
            raise ValueError(f"rng must be a non-negative integer seed, got {rng}")
        return np.random.default_rng(int(rng))
    if isinstance(rng, torch.Generator):
        raise TypeError(f"rng must be {RNG_TYPES}; got a torch.Generator, which kernapprox does not use (draws are "
                        "made with numpy on the CPU in float64, so that one seed gives one draw on every device and "
                        "dtype): pass an int seed instead")
    raise TypeError(f"rng must be {RNG_TYPES}; got {type(rng).__module__}.{type(rng).__qualname__}")


def check_device(device, name: str = "device") -> torch.device:
    """``device`` (a ``str`` or ``torch.device``) as a ``torch.device`` that exists here.

    ``ValueError`` naming ``name`` for a string that is not a device, or a CUDA device when CUDA is not available
    (torch built without it, or no GPU visible) or its index is out of range; ``TypeError`` for anything else.
    ``meta`` is accepted (shapes without values).
    """
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ValueError(f"{name} must name a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}") from None
    elif not isinstance(device, torch.device):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {str(device)!r} is not available: CUDA is not available here (torch "
                             f"{torch.__version__} built without CUDA, or no GPU visible); use 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {str(device)!r} is not available: {torch.cuda.device_count()} CUDA device(s) "
                             "visible")
    return device


def check_qk(q, k) -> None:
    """``q (..., n_q, d)`` and ``k (..., n_k, d)``: finite floating-point tensors of one dtype and device, with the
    same ``d`` and exactly the same batch dimensions (no silent broadcasting)."""
    check_tensor(q, "q")
    check_tensor(k, "k")
    check_same_kind(q=q, k=k)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share batch dimensions, got {tuple(q.shape[:-2])} and {tuple(k.shape[:-2])}")


def check_qkv(q, k, v, causal) -> None:
    """The inputs of an attention call: ``q (..., n, d)``, ``k (..., n_k, d)``, ``v (..., n_k, d_v)`` of one dtype
    and device with the same batch dimensions; ``causal`` a bool, and then ``n = n_k``."""
    check_tensor(q, "q")
    check_tensor(k, "k")
    check_tensor(v, "v")
    check_same_kind(q=q, k=k, v=v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[-2]} and {v.shape[-2]}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError("q, k and v must share batch dimensions, got "
                         f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch ``dtype`` (``TypeError`` for anything else)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()
