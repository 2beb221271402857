"""kernapprox: how good finite feature maps of the softmax kernel are, and what they cost.

>>> import kernapprox as ka
>>> est = ka.make_estimator("positive_orthogonal", num_features=128, rng=0).fit(q, k)
>>> y = ka.linear_attention(q, k, v, est, causal=True, mode="chunked")
"""

from . import features, metrics, theory
from ._validation import NotFittedError
from .attention import (
    MODES,
    AttentionParts,
    RecurrentState,
    linear_attention,
    linear_attention_reference,
    softmax_attention,
    softmax_attention_reference,
)
from .features import FeatureMap
from .kernel import kernel_matrix, log_kernel_matrix, resolve_scale
from .registry import available_estimators, estimator_class, make_estimator, register

__version__ = "0.1.0"

__all__ = [
    "features", "metrics", "theory", "NotFittedError", "MODES", "AttentionParts", "RecurrentState",
    "linear_attention", "linear_attention_reference", "softmax_attention", "softmax_attention_reference",
    "FeatureMap", "kernel_matrix", "log_kernel_matrix", "resolve_scale", "available_estimators",
    "estimator_class", "make_estimator", "register", "__version__",
]
