"""Shared base of estimators that bring their own attention instead of a finite feature map.

Nyströmformer, the optimal rank-r floor and the hybrids (sliding window + linear, Scatterbrain) approximate
attention through objects other than ``φ(q)ᵀφ(k)``: softmax blocks, an SVD, an exact band. They subclass
:class:`~kernapprox.features.base.FeatureMap` for the shared protocol (``fit``, ``scale_``, the descriptive class
attributes, ``get_params``) but implement ``attention`` and ``kernel_matrix`` instead of ``_log_features``;
:func:`kernapprox.linear_attention` dispatches to their ``attention``.
"""

from __future__ import annotations

import torch

from ._validation import check_choice, check_positive_int
from .attention import _check_qkv
from .features.base import FeatureMap


class AttentionOnlyEstimator(FeatureMap):
    """An estimator with ``attention(q, k, v, *, causal, mode, chunk_size, return_parts)`` and
    ``kernel_matrix(q, k)`` but no feature map (``features`` is not available)."""

    modes = ("parallel",)

    def _fit(self, q, k, rng) -> None:
        """Nothing to draw by default: the approximation is built from the sequence it is applied to."""

    def _check_call(self, q, k, v, causal, mode, chunk_size) -> None:
        self._check_fitted()
        _check_qkv(q, k, v, causal)
        check_choice(mode, "mode", self.modes)
        check_positive_int(chunk_size, "chunk_size")
        self._check_dim(q)

    def _check_dim(self, q) -> None:
        if q.shape[-1] != self.dim_:
            raise ValueError(f"q has last dimension {q.shape[-1]} but the estimator was fitted with d={self.dim_}")

    def attention(self, q, k, v, *, causal: bool = False, mode: str = "parallel", chunk_size: int = 64,
                  return_parts: bool = False):
        raise NotImplementedError

    def kernel_matrix(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32) -> int:
        raise ValueError(f"{type(self).__name__} has no recurrent state (it needs the whole sequence); compare it "
                         "by num_features")
