"""Plain float64 loop oracles: the references the fast attention paths are tested against.

One loop over queries, straight from the definitions, no stabilisation beyond a row maximum (use them at moderate
norms), no chunking: slow and obviously right (flash-linear-attention's ``naive`` files play the same role).
"""

from __future__ import annotations

import torch

from ..estimators.base import FeatureMap
from ..kernel import resolve_scale
from ..validation import check_qkv


def softmax_attention_naive(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Plain float64 loop over queries: the test oracle of :func:`softmax_attention`."""
    check_qkv(q, k, v, causal)
    s = resolve_scale(q.shape[-1], scale)
    q, k, v = q.double(), k.double(), v.double()
    outs = []
    for i in range(q.shape[-2]):
        end = i + 1 if causal else k.shape[-2]
        logits = s * (k[..., :end, :] @ q[..., i, :, None]).squeeze(-1)
        w = torch.exp(logits - logits.amax(-1, keepdim=True))
        outs.append((w[..., None] * v[..., :end, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(outs, -2)


def linear_attention_naive(q, k, v, estimator: FeatureMap, causal: bool = False) -> torch.Tensor:
    """Plain float64 loop over queries with exact-scale features: the test oracle of the three modes.

    No stabilisation, so use it only at moderate norms.
    """
    check_qkv(q, k, v, causal)
    pq = estimator.features(q.double(), "query")
    pk = estimator.features(k.double(), "key")
    v = v.double()
    outs = []
    for i in range(q.shape[-2]):
        end = i + 1 if causal else k.shape[-2]
        w = (pk[..., :end, :] @ pq[..., i, :, None]).squeeze(-1)
        outs.append((w[..., None] * v[..., :end, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(outs, -2)
