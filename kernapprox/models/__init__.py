"""Small causal Transformers trained on in-context-learning tasks, with attention pluggable per layer.

:mod:`~kernapprox.models.transformer`
    :class:`CausalTransformer` (token/vector read-in, learned positions, pre-norm blocks, per-layer
    :class:`AttentionSpec`: exact softmax or any registry estimator through :class:`kernapprox.nn.KernelAttention`),
    post-hoc :func:`substitute`, :func:`attention_heads`.
:mod:`~kernapprox.models.training`
    Deterministic CPU training (:func:`train`), the training curve as an ``xarray.Dataset`` and the checkpoint cache
    (:func:`load_or_train`).
:mod:`~kernapprox.models.presets`
    The calibrated reference configurations and why they were chosen.

The tasks the models are trained on, :class:`~kernapprox.tasks.MQAR` (Zoology) and
:class:`~kernapprox.tasks.LinearRegression` (Garg et al. 2022, with least-squares and ridge baselines), live with the
training-free tasks in :mod:`kernapprox.tasks`.
"""

from . import heads  # noqa: F401  (registers the trained_causal distribution)
from .training import TrainConfig, TrainedModel, build_model, config_key, evaluate, load_or_train, train
from .transformer import (
    AttentionSpec,
    CausalTransformer,
    ModelConfig,
    attention_heads,
    record_attention_inputs,
    register_attention,
    substitute,
)

__all__ = ["TrainConfig", "TrainedModel", "train", "load_or_train", "build_model", "config_key", "evaluate",
           "AttentionSpec", "CausalTransformer", "ModelConfig", "attention_heads", "record_attention_inputs",
           "register_attention", "substitute"]
