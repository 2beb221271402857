"""kernapprox: how good finite feature maps of the softmax kernel are, and what they cost.

>>> import torch
>>> import kernapprox as ka
>>> q, k, v = torch.randn(2, 4, 128, 32), torch.randn(2, 4, 128, 32), torch.randn(2, 4, 128, 32)
>>> est = ka.make_estimator("positive_orthogonal", num_features=128, rng=0).fit(q, k)
>>> y = ka.linear_attention(q, k, v, est, causal=True, mode="chunked")
>>> y.shape
torch.Size([2, 4, 128, 32])
>>> err = ka.metrics.relative_rms_error(y, ka.softmax_attention(q, k, v, causal=True))   # per (batch, head)
"""

# approximate (the attention estimators, above the attention core) registers its names in the estimator registry;
# real (the real-model home) registers the "real" heads in the distribution registry
from . import approximate, backends, estimators, metrics, real, rules, theory, trainable
from .attention import (
    MODES,
    RecurrentState,
    linear_attention,
    linear_attention_naive,
    softmax_attention,
    softmax_attention_naive,
    uniform_attention,
)
from .estimators import AttentionParts, Capabilities, Estimator, FeatureMap
from .estimators.registry import (
    available_estimators,
    capabilities,
    estimator_class,
    estimator_table,
    make_estimator,
    register,
)
from .kernel import kernel_matrix, log_kernel_matrix, resolve_scale
from .rules import available_rules
from .surgery import convert
from .trainable import HedgehogMap, T2RMap, feature_attention, fit_to_softmax
from .validation import NotFittedError

__version__ = "0.1.0"

__all__ = [
    "backends", "estimators", "approximate", "metrics", "real", "rules", "available_rules", "theory",
    "NotFittedError", "MODES", "AttentionParts", "Capabilities", "Estimator", "FeatureMap", "RecurrentState",
    "linear_attention", "linear_attention_naive", "softmax_attention", "softmax_attention_naive", "uniform_attention",
    "kernel_matrix", "log_kernel_matrix", "resolve_scale", "available_estimators", "capabilities", "estimator_class",
    "estimator_table", "make_estimator", "register", "convert", "trainable", "HedgehogMap", "T2RMap",
    "feature_attention", "fit_to_softmax", "__version__",
]
