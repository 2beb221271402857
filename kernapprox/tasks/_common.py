"""What every task module shares: unit rows, the cast of numpy draws to torch, the episode arguments."""

from __future__ import annotations

import numpy as np
import torch

from ..validation import check_positive_int


def _unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _to_torch(a: np.ndarray, device, dtype) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _check_common(batch, device, dtype):
    check_positive_int(batch, "batch")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    return torch.device("cpu") if device is None else torch.device(device)
