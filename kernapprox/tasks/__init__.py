"""In-context-learning tasks: the one home of the episodes that the training-free read-out and the trained models
are measured on.

Each task comes in the form its reader needs, side by side in one module:

:mod:`~kernapprox.tasks.recall`
    multi-query associative recall: continuous episodes :func:`associative_recall` and :func:`paraphrase_recall`
    (training-free); token prompts :class:`MQAR` (trained models).
:mod:`~kernapprox.tasks.regression`
    Nadaraya–Watson regression of a smooth function, :func:`smooth_regression` (training-free); linear
    regression, :class:`LinearRegression` (trained models).
:mod:`~kernapprox.tasks.classification`
    few-shot digits, :func:`digits_classification` (training-free).
:mod:`~kernapprox.tasks.sequence`
    next-step prediction of a real sequence (text bytes, log-mel audio, video patches), :class:`NextStep`
    (trained models of the modality spectrum).

Training-free episodes
----------------------
An episode is a context of ``n`` (key, value) pairs and a set of queries; nothing is learned, the prediction is
the attention read-out

.. math::
    ŷ(q) = \\frac{Σ_i κ(q, k_i)\\, v_i}{Σ_i κ(q, k_i)},\\qquad κ(q, k) = \\exp(β\\, qᵀk),

with unit-norm queries and keys, so that the inverse temperature ``β`` is exactly the attention ``scale``
argument (``softmax_attention(q, k, v, scale=β)``; estimators are built with ``scale=β``). Exact attention is the
ceiling; an estimator replaces ``κ`` by ``φ(q)ᵀφ(k)`` and the KV cache by the state ``W = Σ v_i φ(k_i)ᵀ``,
``z = Σ φ(k_i)``. Nadaraya–Watson view: Han et al. 2023, *Explaining Emergent In-Context Learning as Kernel
Regression*. Each generator is a seeded function returning a named tuple of tensors, with its scorer beside it;
the read-out itself (fitting, modes, memory accounting) is :mod:`kernapprox.readout`.

Tasks for trained models
------------------------
A class per task (:data:`TASKS`, :func:`make_task`): a frozen configuration whose ``sample(gen, batch)`` draws a
batch of prompts, with the model's ``loss`` and ``score``, what the model reads and writes (``model_io``), the
curriculum knob (``difficulty``, ``with_difficulty``) and ``to_dict`` for the checkpoint key
(:mod:`kernapprox.models.training`).

Every task draws from a numpy ``Generator`` only (float64, then cast), so a seed is one data stream everywhere.
"""

from .classification import (
    ClassificationEpisodes,
    classification_accuracy,
    digits_classification,
    digits_features,
    nearest_neighbour_predictions,
)
from .recall import (
    IGNORE,
    MQAR,
    MQARBatch,
    RecallEpisodes,
    associative_recall,
    decode_nearest,
    log_n_beta,
    paraphrase_recall,
    recall_accuracy,
)
from .regression import (
    REGRESSION_TARGETS,
    LinearRegression,
    RegressionBatch,
    RegressionEpisodes,
    least_squares_predictions,
    normalized_mse,
    ridge_predictions,
    smooth_regression,
)
from .sequence import SEQUENCE_SOURCES, NextStep, NextStepBatch, SequenceData, load_sequence

__all__ = [
    "RecallEpisodes", "RegressionEpisodes", "ClassificationEpisodes",
    "associative_recall", "paraphrase_recall", "decode_nearest", "recall_accuracy",
    "smooth_regression", "normalized_mse", "REGRESSION_TARGETS",
    "digits_features", "digits_classification", "classification_accuracy", "nearest_neighbour_predictions",
    "log_n_beta",
    "MQAR", "MQARBatch", "LinearRegression", "RegressionBatch", "least_squares_predictions", "ridge_predictions",
    "NextStep", "NextStepBatch", "SequenceData", "SEQUENCE_SOURCES", "load_sequence",
    "IGNORE", "TASKS", "make_task",
]

TASKS = {cls.name: cls for cls in (MQAR, LinearRegression, NextStep)}
"""The tasks a model can be trained on, by name (``task.to_dict()["name"]``)."""


def make_task(name: str, **params):
    """The trainable task ``name`` (``"mqar"``, ``"regression"`` or ``"next_step"``) with parameters ``params``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    return TASKS[name](**params)
