"""Estimator names → factories. Grids, the CLI and the tests refer to estimators by these names only.

Random-feature maps are registered once per sampler: ``<map>`` uses i.i.d. Gaussian projections and
``<map>_<sampler>`` another sampler (``orthogonal``, ``regularized``, ``sorf``, ``qmc``), e.g.
``positive_orthogonal`` is FAVOR+. Other modules add their estimators with :func:`register`.
"""

from __future__ import annotations

import functools

from .features import ExactKernel, HyperbolicFeatures, PositiveFeatures, TrigonometricFeatures
from .features.deterministic import EluPlusOneFeatures, TaylorFeatures
from .features.exponential import (
    AsymmetricDenseExponentialFeatures,
    GeneralizedExponentialFeatures,
    OptimalPositiveFeatures,
    SimplifiedAsymmetricDenseExponentialFeatures,
    SymmetricDenseExponentialFeatures,
)
from .features.maclaurin import RandomMaclaurinFeatures

_REGISTRY: dict[str, functools.partial] = {}


def register(name: str, cls, **defaults) -> None:
    """Register ``cls`` under ``name`` with default constructor options (overridable in make_estimator)."""
    if name in _REGISTRY:
        raise ValueError(f"estimator name {name!r} is already registered")
    _REGISTRY[name] = functools.partial(cls, **defaults)


def available_estimators() -> list[str]:
    """Sorted registry names."""
    return sorted(_REGISTRY)


def estimator_class(name: str):
    """The class behind a registry name."""
    _check_name(name)
    return _REGISTRY[name].func


def _check_name(name):
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown estimator {name!r}; available: {', '.join(available_estimators())}")


def make_estimator(name: str, num_features: int | None = None, rng=None, **options):
    """Build the estimator registered as ``name`` (unfitted).

    Parameters
    ----------
    name : str
        A name from :func:`available_estimators`; unknown names raise ``ValueError`` listing the valid ones.
    num_features : int
        ``r``, the feature dimension of the state (ignored by estimators whose dimension is fixed by ``d``,
        which say so).
    rng : int, SeedSequence or Generator
        Source of randomness (drawn on the CPU in float64).
    **options
        Estimator-specific keyword options (e.g. ``scale``, ``eps``, ``sampler``).
    """
    _check_name(name)
    factory = _REGISTRY[name]
    return factory(num_features=num_features, rng=rng, **options)


register("exact", ExactKernel)
for _map_name, _cls in (("trig", TrigonometricFeatures), ("positive", PositiveFeatures),
                        ("hyperbolic", HyperbolicFeatures)):
    register(_map_name, _cls, sampler="iid")
    for _sampler in ("orthogonal", "regularized", "sorf", "qmc"):
        register(f"{_map_name}_{_sampler}", _cls, sampler=_sampler)

# Exponential families (GERF, OPRF = FAVOR++ with the orthogonal sampler, dense-exponential maps), once per sampler.
for _map_name, _cls in (("gerf", GeneralizedExponentialFeatures), ("oprf", OptimalPositiveFeatures),
                        ("sderf", SymmetricDenseExponentialFeatures),
                        ("saderf", SimplifiedAsymmetricDenseExponentialFeatures),
                        ("aderf", AsymmetricDenseExponentialFeatures)):
    register(_map_name, _cls, sampler="iid")
    for _sampler in ("orthogonal", "regularized", "sorf", "qmc"):
        register(f"{_map_name}_{_sampler}", _cls, sampler=_sampler)
register("maclaurin", RandomMaclaurinFeatures)
register("taylor2", TaylorFeatures, form="packed")
register("taylor2_based", TaylorFeatures, form="full")
register("elu1", EluPlusOneFeatures)

# Nyström maps, Nyströmformer, the optimal rank-r floor and the window/sparse hybrids.
from .hybrid import Scatterbrain, WindowLinear  # noqa: E402
from .lowrank import Nystromformer, OptimalLowRank  # noqa: E402
from .nystrom import NystromFeatures  # noqa: E402

for _landmarks in ("uniform", "kmeans", "rls"):
    register(f"nystrom_{_landmarks}", NystromFeatures, landmarks=_landmarks)
register("nystromformer", Nystromformer, pinv="iterative")
register("nystromformer_exact", Nystromformer, pinv="exact")
register("lowrank_optimal", OptimalLowRank)
register("window_linear", WindowLinear, feature_map="positive")
register("scatterbrain", Scatterbrain, feature_map="hyperbolic_orthogonal")
