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


def estimator_table() -> str:
    """A markdown table of every registered estimator: name, class (with its registered options), whether it is
    unbiased, positive, data-dependent, causal when fitted on the sequence it is applied to, its modes and its
    reference. Regenerate the README table with ``python -m kernapprox.registry``.

    Each estimator is instantiated with ``num_features=8, rng=0`` to read attributes that depend on options (an
    unbiased map with a biased sampler is biased); estimators that need other arguments fall back to their class
    attributes, and an attribute that is only known per instance shows as "depends".
    """
    columns = ("name", "class", "unbiased", "positive", "data-dependent", "causal fit", "modes", "reference")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name in available_estimators():
        factory = _REGISTRY[name]
        try:
            source = make_estimator(name, num_features=8, rng=0)
        except Exception:  # needs special arguments: the class attributes still describe it
            source = factory.func
        options = ", ".join(f"{key}={value!r}" for key, value in factory.keywords.items())
        cells = [f"`{name}`", f"`{factory.func.__name__}({options})`"]
        for attr in ("unbiased", "positive", "data_dependent", "causal_fit"):
            value = getattr(source, attr, None)
            cells.append(("yes" if value else "no") if isinstance(value, bool) else "depends")
        modes = getattr(source, "modes", ())
        cells.append(", ".join(modes) if isinstance(modes, (tuple, list)) else "depends")
        cells.append(str(getattr(source, "reference", "") or ""))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


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


if __name__ == "__main__":
    # Run as ``python -m kernapprox.registry``: use the package's module (where every estimator registered),
    # not this script's fresh copy of the registry.
    from kernapprox.registry import estimator_table as _table

    print(_table())
