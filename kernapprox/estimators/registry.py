"""Estimator names → classes with default options. Grids, the CLI and the tests refer to estimators by these names.

Each family module registers its estimators when it is imported (:func:`register` at the bottom of the module);
this module imports no family. Importing :mod:`kernapprox.estimators` imports every family, so every name is
registered before any lookup. Random-feature maps are registered once per sampler: ``<map>`` uses i.i.d. Gaussian
projections and ``<map>_<sampler>`` another sampler (``orthogonal``, ``regularized``, ``sorf``, ``qmc``), e.g.
``positive_orthogonal`` is FAVOR+.

What an estimator can do is read from its declared capabilities (:func:`capabilities`), never by building it.

Examples
--------
>>> from kernapprox.estimators import registry
>>> "positive_orthogonal" in registry.available_estimators()
True
>>> caps = registry.capabilities("positive_regularized")
>>> caps.positive, caps.unbiased            # SMREG: positive, biased by its sampler
(True, False)
>>> est = registry.make_estimator("positive_orthogonal", num_features=32, rng=0)
>>> type(est).__name__
'PositiveFeatures'
"""

from __future__ import annotations

import functools

from .base import Capabilities, Estimator

_REGISTRY: dict[str, functools.partial] = {}

# The columns of the capability table, in order, with what each means.
TABLE_COLUMNS = {
    "kind": "features: a finite map φ; attention: brings its own attention; exact: the reference",
    "unbiased": "E φ(x)ᵀφ(y) = exp(xᵀy)",
    "positive": "features, hence normalisers, are positive",
    "data_dependent": "fit looks at the data",
    "causal_fit": "fitting on the sequence uses no future token",
    "consistent": "error → 0 as the feature dimension grows",
    "causal": "causal attention is defined",
    "fixed_dimension": "the dimension is fixed by d",
    "rank_limited_by_points": "r ≤ number of fitted points",
    "modes": "attention modes",
    "rules": "state-update rules",
    "reference": "paper (equation)",
}


# The names of the trainable maps (:data:`kernapprox.trainable.MAPS`, the same keys: a test checks it), here so that
# a layer or a model can tell such a name without importing :mod:`kernapprox.trainable`: a study that never builds a
# trainable map then never loads it, and an edit of it stales none of that study's results (kernapprox.store).
TRAINABLE_MAP_NAMES = ("hedgehog_trainable", "t2r_trainable")


def is_trainable_map(obj) -> bool:
    """Whether ``obj`` is a :class:`kernapprox.trainable.TrainableFeatureMap` (without importing that module: no
    instance can exist before it is loaded)."""
    import sys

    module = sys.modules.get("kernapprox.trainable")
    return module is not None and isinstance(obj, module.TrainableFeatureMap)


def register(name: str, cls: type[Estimator], **defaults) -> None:
    """Register ``cls`` under ``name`` with default constructor options (overridable in :func:`make_estimator`).

    ``cls`` must be an :class:`~kernapprox.estimators.base.Estimator` subclass; a name is registered once.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Estimator)):
        raise TypeError(f"cls must be an Estimator subclass, got {cls!r}")
    if name in _REGISTRY:
        raise ValueError(f"estimator name {name!r} is already registered")
    _REGISTRY[name] = functools.partial(cls, **defaults)


def available_estimators() -> list[str]:
    """Sorted registry names."""
    return sorted(_REGISTRY)


def _check_name(name) -> functools.partial:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown estimator {name!r}; available: {', '.join(available_estimators())}")
    return _REGISTRY[name]


def estimator_class(name: str) -> type[Estimator]:
    """The class behind a registry name."""
    return _check_name(name).func


def registered_options(name: str) -> dict:
    """The default constructor options a registry name adds to its class (e.g. ``{"sampler": "orthogonal"}``)."""
    return dict(_check_name(name).keywords)


def constructor_options(name: str) -> tuple[str, ...]:
    """The keyword options the class behind ``name`` accepts (``num_features``, ``rng`` and ``scale`` included)."""
    return _check_name(name).func.parameter_names()


def capabilities(name: str, **options) -> Capabilities:
    """The declared capabilities of the estimator ``make_estimator(name, **options)`` would build, without
    building it (see :class:`~kernapprox.estimators.base.Capabilities`)."""
    factory = _check_name(name)
    return factory.func.capabilities_for(**{**factory.keywords, **options})


def make_estimator(name: str, num_features: int | None = None, rng=None, **options) -> Estimator:
    """Build the estimator registered as ``name`` (unfitted).

    Parameters
    ----------
    name : str
        A name from :func:`available_estimators`; unknown names raise ``ValueError`` listing the valid ones.
    num_features : int or None
        ``r``, the feature dimension of the state. Estimators whose dimension is fixed by ``d``
        (``capabilities(name).fixed_dimension``) take ``None`` (their own dimension) or exactly that dimension, and
        raise at ``fit`` on any other value, naming the dimension they have.
    rng : int, SeedSequence or Generator
        Source of randomness (drawn on the CPU in float64).
    **options
        Estimator-specific keyword options (e.g. ``scale``, ``eps``, ``sampler``).

    Returns
    -------
    Estimator
    """
    factory = _check_name(name)
    return factory(num_features=num_features, rng=rng, **options)


def estimator_table() -> str:
    """A markdown table of every registered estimator and its declared capabilities (the columns of
    :data:`TABLE_COLUMNS`), with its class and registered options. Built from declarations only."""
    columns = ["name", "class", *TABLE_COLUMNS]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name in available_estimators():
        factory = _REGISTRY[name]
        caps = capabilities(name).as_dict()
        options = ", ".join(f"{key}={value!r}" for key, value in factory.keywords.items())
        cells = [f"`{name}`", f"`{factory.func.__name__}({options})`"]
        for column in TABLE_COLUMNS:
            value = caps[column]
            if isinstance(value, bool):
                cells.append("yes" if value else "no")
            elif isinstance(value, tuple):
                cells.append(", ".join(value))
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)
