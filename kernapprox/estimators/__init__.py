"""The feature maps of the softmax kernel (and the exact kernel), one module per family, with the estimator protocol
and the registry.

=====================  ===============================================================================
module                 estimators
=====================  ===============================================================================
``base``               the protocol (:class:`Estimator`, :class:`FeatureMap`, :class:`AttentionEstimator`)
                       and the declared :class:`Capabilities`
``registry``           names → classes; :func:`make_estimator`, :func:`capabilities`, the table
``samplers``           projection samplers shared by the random maps (iid, orthogonal, SMREG, SORF, QMC)
``random``             trigonometric, positive (FAVOR+) and hyperbolic random features
``exponential``        GERF, OPRF (FAVOR++), the dense-exponential maps (SDERF, SADERF, ADERF)
``maclaurin``          random Maclaurin features
``deterministic``      second-order Taylor (Based), ELU+1, DPFP
``nystrom``            Nyström features (uniform, k-means and ridge-leverage-score landmarks)
``learned``            learned maps distilled from softmax attention (Hedgehog)
``exact``              the exact kernel as an estimator
=====================  ===============================================================================

Importing this package imports every family module, and each registers its names in :mod:`.registry`; the
registry itself imports no family. Dependencies point one way: this package uses only
:mod:`kernapprox.kernel`, :mod:`kernapprox.theory`, :mod:`kernapprox.validation` and :mod:`kernapprox.rules`,
never the attention layer above it. The estimators that bring their own attention (hybrids, Scatterbrain, LARA,
EVA, Nyströmformer, the rank-r references) compose it from the attention core and so live above it, in
:mod:`kernapprox.approximate`; they register in the same registry.
"""

# Every family module registers its estimators when imported; the registry imports none of them.
from . import (  # noqa: F401
    deterministic,
    exact,
    exponential,
    learned,
    maclaurin,
    nystrom,
    random,
    registry,
    samplers,
)
from .base import AttentionEstimator, AttentionParts, Capabilities, Estimator, ExponentialForm, FeatureMap
from .deterministic import DPFPFeatures, EluPlusOneFeatures, TaylorFeatures
from .exact import ExactKernel
from .exponential import (
    AsymmetricDenseExponentialFeatures,
    GeneralizedExponentialFeatures,
    OptimalPositiveFeatures,
    SimplifiedAsymmetricDenseExponentialFeatures,
    SymmetricDenseExponentialFeatures,
)
from .learned import HedgehogFeatures
from .maclaurin import RandomMaclaurinFeatures
from .nystrom import NystromFeatures
from .random import HyperbolicFeatures, PositiveFeatures, RandomFeatureMap, TrigonometricFeatures
from .registry import available_estimators, capabilities, estimator_class, make_estimator, register
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
    "registry", "Estimator", "FeatureMap", "ExponentialForm", "AttentionEstimator", "AttentionParts", "Capabilities",
    "available_estimators", "capabilities", "estimator_class", "make_estimator", "register",
    "ExactKernel", "RandomFeatureMap", "TrigonometricFeatures", "PositiveFeatures", "HyperbolicFeatures",
    "GeneralizedExponentialFeatures", "OptimalPositiveFeatures", "SymmetricDenseExponentialFeatures",
    "SimplifiedAsymmetricDenseExponentialFeatures", "AsymmetricDenseExponentialFeatures",
    "RandomMaclaurinFeatures", "TaylorFeatures", "EluPlusOneFeatures", "DPFPFeatures", "NystromFeatures",
    "HedgehogFeatures",
    "ProjectionSampler", "GaussianSampler", "OrthogonalSampler", "StructuredSampler", "QMCSampler", "SAMPLERS",
    "make_sampler",
]
