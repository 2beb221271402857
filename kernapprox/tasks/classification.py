"""Few-shot classification of scikit-learn's bundled digits, read by attention (training-free).

:func:`digits_classification`: few-shot classification of ``load_digits`` (1797 8×8 images, 10 classes; on disk, no
network): pixels standardised, rows L2-normalised; prediction = argmax of the attention-weighted one-hot labels
(``β → ∞`` gives 1-NN, :func:`nearest_neighbour_predictions`); scored by :func:`classification_accuracy`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ..validation import as_generator, check_positive_int, check_tensor
from ._common import _check_common, _to_torch, _unit_rows

__all__ = ["ClassificationEpisodes", "digits_features", "digits_classification", "classification_accuracy",
           "nearest_neighbour_predictions"]


class ClassificationEpisodes(NamedTuple):
    """``x (B, n, 64)`` unit rows, ``labels (B, n)``, ``onehot (B, n, C)``; queries ``x_query (B, n_q, 64)``
    with ``labels_query (B, n_q)``."""

    x: torch.Tensor
    labels: torch.Tensor
    onehot: torch.Tensor
    x_query: torch.Tensor
    labels_query: torch.Tensor


@functools.lru_cache(maxsize=1)
def digits_features() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 × 64, 10 classes), standardised and L2-normalised.

    Each pixel is z-scored over the whole data set (pixels that are constant — the image border — have zero
    standard deviation and are left at 0; no labels are used), then each image is scaled to unit norm, so that
    ``β`` is the attention scale. Returns read-only ``(X float64 (1797, 64), y int64 (1797,))``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    mean, std = x.mean(0), x.std(0)
    x = (x - mean) / np.where(std > 0, std, 1.0)
    x = _unit_rows(x)
    y = np.asarray(data.target, dtype=np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def digits_classification(num_context: int, *, num_queries: int = 32, batch: int = 8, rng=None, device=None,
                          dtype: torch.dtype = torch.float32) -> ClassificationEpisodes:
    """Few-shot episodes on digits: ``n + n_q`` distinct images drawn uniformly without replacement per episode
    (classes are not balanced), the first ``n`` labelled in context, the rest queried."""
    n = check_positive_int(num_context, "num_context")
    n_q = check_positive_int(num_queries, "num_queries")
    device = _check_common(batch, device, dtype)
    x_all, y_all = digits_features()
    if n + n_q > x_all.shape[0]:
        raise ValueError(f"num_context + num_queries must be <= {x_all.shape[0]} images, got {n + n_q}")
    gen = as_generator(rng)
    idx = np.stack([gen.choice(x_all.shape[0], size=n + n_q, replace=False) for _ in range(batch)])
    x, y = x_all[idx], y_all[idx]
    num_classes = int(y_all.max()) + 1
    onehot = np.eye(num_classes)[y[:, :n]]
    return ClassificationEpisodes(
        x=_to_torch(x[:, :n], device, dtype), labels=torch.as_tensor(y[:, :n], device=device),
        onehot=_to_torch(onehot, device, dtype), x_query=_to_torch(x[:, n:], device, dtype),
        labels_query=torch.as_tensor(y[:, n:], device=device))


def classification_accuracy(scores: torch.Tensor, episodes: ClassificationEpisodes) -> torch.Tensor:
    """Fraction of queries whose argmax class score is the true label, per episode: ``(B,)`` float64.
    A query whose scores are not all finite counts as wrong."""
    check_tensor(scores, "scores", min_rank=3, finite=False)
    finite = torch.isfinite(scores).all(-1)
    pred = torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0).argmax(-1)
    return ((pred == episodes.labels_query) & finite).double().mean(-1)


def nearest_neighbour_predictions(episodes: ClassificationEpisodes) -> torch.Tensor:
    """1-NN by cosine similarity (the ``β → ∞`` limit of the attention classifier): ``(B, n_q, C)`` one-hot
    scores, usable with :func:`classification_accuracy`."""
    sim = episodes.x_query @ episodes.x.transpose(-1, -2)
    nearest = sim.argmax(-1)
    return torch.gather(episodes.onehot, 1, nearest[..., None].expand(-1, -1, episodes.onehot.shape[-1]))
