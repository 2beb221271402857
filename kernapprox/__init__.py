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

# The core a user needs at once is imported here: the attention core, the estimators and their registry (approximate
# registers its names there). Everything else is loaded on first use (PEP 562): ``ka.convert``, ``ka.trainable``,
# ``ka.real`` ... import their modules when first touched, so ``import kernapprox`` stays light and a program (a
# study) loads, and so depends on, only the modules it uses (kernapprox.store keys results by the loaded modules).
from . import approximate, estimators, metrics, rules
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
from .validation import NotFittedError

# name -> (module, attribute or None for the module itself), imported on first access
_LAZY = {
    "backends": ("kernapprox.backends", None), "real": ("kernapprox.real", None),
    "theory": ("kernapprox.theory", None), "trainable": ("kernapprox.trainable", None),
    "nn": ("kernapprox.nn", None), "surgery": ("kernapprox.surgery", None),
    "convert": ("kernapprox.surgery.conversion", "convert"),
    "HedgehogMap": ("kernapprox.trainable", "HedgehogMap"), "T2RMap": ("kernapprox.trainable", "T2RMap"),
    "feature_attention": ("kernapprox.trainable", "feature_attention"),
    "fit_to_softmax": ("kernapprox.trainable", "fit_to_softmax"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = importlib.import_module(module)
        value = value if attribute is None else getattr(value, attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kernapprox' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "backends", "estimators", "approximate", "metrics", "real", "rules", "available_rules", "theory",
    "NotFittedError", "MODES", "AttentionParts", "Capabilities", "Estimator", "FeatureMap", "RecurrentState",
    "linear_attention", "linear_attention_naive", "softmax_attention", "softmax_attention_naive", "uniform_attention",
    "kernel_matrix", "log_kernel_matrix", "resolve_scale", "available_estimators", "capabilities", "estimator_class",
    "estimator_table", "make_estimator", "register", "convert", "trainable", "HedgehogMap", "T2RMap",
    "feature_attention", "fit_to_softmax", "__version__",
]
