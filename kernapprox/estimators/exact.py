"""The exact softmax kernel as an "estimator", so that grids can include the reference itself."""

from __future__ import annotations

import torch

from ..kernel import kernel_matrix
from ..validation import check_positive_int, itemsize
from .base import Estimator
from .registry import register


class ExactKernel(Estimator):
    """The exact kernel ``exp(s · qᵀk)``: no finite feature map exists (its RKHS is infinite-dimensional).

    ``kernel_matrix`` returns the exact matrix; :func:`kernapprox.linear_attention` routes it (``kind =
    "exact"``) to :func:`kernapprox.softmax_attention`. It has no ``features``. Its "state" is the KV cache,
    whose size grows with the sequence: ``state_bytes(d_v, dtype, seq_len=n)`` counts ``n · (d + d_v)`` numbers.
    """

    kind = "exact"
    unbiased = True
    positive = True
    consistent = False          # no feature dimension to grow
    fixed_dimension = True
    modes = ("parallel", "recurrent", "chunked")
    reference = "Vaswani et al. 2017 (softmax attention)"

    def __init__(self, *, num_features: int | None = None, rng=None, scale: float | None = None):
        if num_features is not None:
            check_positive_int(num_features, "num_features")
            raise ValueError(f"num_features must be None for the exact kernel (it has no finite feature map), "
                             f"got {num_features!r}")
        super().__init__(num_features=None, rng=rng, scale=scale)

    def _fit(self, q, k, rng):
        pass

    @property
    def num_features(self) -> int:
        raise ValueError("the exact kernel has no finite feature dimension (its state is the KV cache)")

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """KV-cache bytes at ``seq_len`` tokens: ``seq_len · (d + d_v)`` numbers."""
        self._check_fitted()
        check_positive_int(d_v, "d_v")
        if seq_len is None:
            raise ValueError("seq_len is required: the exact kernel's state (the KV cache) grows with it")
        check_positive_int(seq_len, "seq_len")
        return seq_len * (self.dim_ + d_v) * itemsize(dtype)

    def kernel_matrix(self, q, k):
        self._check_fitted()
        return kernel_matrix(q, k, self.scale_)


register("exact", ExactKernel)
