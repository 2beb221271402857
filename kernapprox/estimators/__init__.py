"""Every estimator of the softmax kernel (or of attention under it), one module per family.

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
``lowrank``            Nyströmformer and the rank-r SVD references (kernel matrix, attention matrix)
``hybrid``             sliding window + linear attention, Scatterbrain
``lara``               LARA: multiple importance sampling of attention with data-dependent proposals
``eva``                EVA: exact local attention plus per-group control variates
``learned``            learned maps distilled from softmax attention (Hedgehog)
``exact``              the exact kernel as an estimator
=====================  ===============================================================================

Importing this package imports every family module, and each registers its names in :mod:`.registry`; the
registry itself imports no family. Dependencies point one way: this package uses only
:mod:`kernapprox.kernel`, :mod:`kernapprox.theory` and :mod:`kernapprox.validation`, never the attention layer
above it.
"""

# Every family module registers its estimators when imported; the registry imports none of them.
from . import (  # noqa: F401
    deterministic,
    eva,
    exact,
    exponential,
    hybrid,
    lara,
    learned,
    lowrank,
    maclaurin,
    nystrom,
    random,
    registry,
    samplers,
)
from .base import AttentionEstimator, AttentionParts, Capabilities, Estimator, ExponentialForm, FeatureMap
from .deterministic import DPFPFeatures, EluPlusOneFeatures, TaylorFeatures
from .eva import EfficientAttentionCV
from .exact import ExactKernel
from .exponential import (
    AsymmetricDenseExponentialFeatures,
    GeneralizedExponentialFeatures,
    OptimalPositiveFeatures,
    SimplifiedAsymmetricDenseExponentialFeatures,
    SymmetricDenseExponentialFeatures,
)
from .hybrid import Scatterbrain, WindowLinear
from .lara import LinearRandomizedAttention
from .learned import HedgehogFeatures
from .lowrank import AttentionSVD, KernelSVD, Nystromformer
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
    "Nystromformer", "KernelSVD", "AttentionSVD", "WindowLinear", "Scatterbrain", "LinearRandomizedAttention",
    "EfficientAttentionCV", "HedgehogFeatures",
    "ProjectionSampler", "GaussianSampler", "OrthogonalSampler", "StructuredSampler", "QMCSampler", "SAMPLERS",
    "make_sampler",
]
