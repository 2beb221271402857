"""Feature maps of the softmax kernel and the projection samplers they share."""

from .base import FeatureMap
from .exact import ExactKernel
from .random import HyperbolicFeatures, PositiveFeatures, RandomFeatureMap, TrigonometricFeatures
from .samplers import (
    SAMPLERS,
    GaussianSampler,
    OrthogonalSampler,
    ProjectionSampler,
    QMCSampler,
    StructuredSampler,
    make_sampler,
)

__all__ = [
    "FeatureMap", "ExactKernel", "RandomFeatureMap", "TrigonometricFeatures", "PositiveFeatures",
    "HyperbolicFeatures", "ProjectionSampler", "GaussianSampler", "OrthogonalSampler", "StructuredSampler",
    "QMCSampler", "SAMPLERS", "make_sampler",
]
