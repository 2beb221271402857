"""scikit-learn transformers for the softmax-kernel feature maps of the registry.

:class:`SoftmaxKernelFeatures` wraps any registered estimator that has a finite feature map — random features
(``trig*``, ``positive*``, ``hyperbolic*`` and the other exponential maps), deterministic maps and Nyström — as
a scikit-learn transformer: numpy in, numpy out, ``fit``/``transform``/``fit_transform``,
``get_params``/``set_params``/``clone``, pipelines and grid searches.

>>> from sklearn.linear_model import RidgeClassifier
>>> from sklearn.pipeline import make_pipeline
>>> model = make_pipeline(SoftmaxKernelFeatures("positive_orthogonal", n_components=256, scale=0.05,
...                                             random_state=0), RidgeClassifier())

The transform is the feature map ``φ`` of the kernel ``exp(scale · xᵀy)``, so that
``transform(X) @ transform(Y).T ≈ exp(scale · X Yᵀ)`` (for asymmetric maps: ``role="query"`` on ``X`` and
``role="key"`` on ``Y`` from one fitted transformer).
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from .estimators.base import ROLES
from .estimators.registry import available_estimators, capabilities, constructor_options, make_estimator
from .validation import check_choice, check_positive_float, check_positive_int

__all__ = ["SoftmaxKernelFeatures", "has_feature_map", "effective_features"]

# Constructor arguments the adapter sets itself; passing them as options would be ambiguous.
_RESERVED_OPTIONS = ("num_features", "rng", "scale")
# transform warns when more than this share of the rows rest on fewer than COLLAPSED_ESS effective features
DEFAULT_COMPONENTS = 100       # n_components=None for maps of free dimension
COLLAPSED_ESS = 2.0
COLLAPSED_SHARE = 0.5


def effective_features(phi: np.ndarray) -> np.ndarray:
    r"""The effective number of features of each row of ``phi`` ``(n, r)``: ``(Σ_j w_j)² / Σ_j w_j²`` with
    ``w = φ`` for non-negative maps and ``w = φ²`` (the row's energy) for signed ones.

    Kish's effective sample size of the row's normalised weights (Kish 1965, *Survey Sampling*, eq. 11.7.2): 1
    when one feature carries the row, ``r`` when all carry it equally. Computed after dividing each row by its
    largest entry, so it is exact for rows of any magnitude; an all-zero row has 0.
    """
    a = np.abs(np.asarray(phi, dtype=np.float64))
    top = a.max(axis=1, keepdims=True)
    a = np.divide(a, top, out=np.zeros_like(a), where=top > 0)
    w = a ** 2 if (np.asarray(phi) < 0).any() else a
    s1, s2 = w.sum(axis=1), (w ** 2).sum(axis=1)
    return np.divide(s1 ** 2, s2, out=np.zeros_like(s1), where=s2 > 0)


def has_feature_map(name: str) -> bool:
    """Whether the registry estimator ``name`` has a finite feature map (and can be a transformer)."""
    return capabilities(name).kind == "features"


def _as_rng(random_state):
    """``random_state`` as a kernapprox ``rng``: None, int, ``SeedSequence`` and ``Generator`` pass through; a
    legacy ``RandomState`` (scikit-learn's own convention) gives one seed per fit."""
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(np.iinfo(np.int32).max))
    if random_state is None or isinstance(random_state, (np.random.SeedSequence, np.random.Generator)):
        return random_state
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool) and random_state >= 0:
        return int(random_state)
    raise TypeError("random_state must be None, a non-negative int, a numpy SeedSequence, Generator or "
                    f"RandomState, got {random_state!r}")


class SoftmaxKernelFeatures(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    r"""Finite features of the softmax kernel ``exp(scale · xᵀy)`` from any registered feature map.

    ``transform(X)`` returns ``φ(X)`` of shape ``(n_samples, n_components_)`` with
    ``φ(x)ᵀφ(y) ≈ exp(scale · xᵀy)``: the estimator's formula, bias and variance are those of the registry
    entry (see :func:`kernapprox.available_estimators` and each class's docstring). A linear model on these
    features is a kernel machine for the softmax kernel.

    Parameters
    ----------
    estimator : str, default="positive_orthogonal"
        A registry name with a finite feature map (not ``"exact"``, not estimators that only provide their own
        attention). ``"positive_orthogonal"`` is FAVOR+ (Choromanski et al. 2021, Lemma 1 and Theorem 2).
    n_components : int or None, default=None
        ``r``, the number of output features (``num_features`` of the estimator; must be even for the sin/cos
        and ``exp(±)`` maps). ``None``: 100, or for maps whose dimension is fixed by the input dimension (Taylor,
        ELU+1: capability ``fixed_dimension``) that dimension; for those maps a number other than their
        dimension raises ``ValueError`` naming it (it is never silently replaced). Landmark maps (Nyström) use
        at most ``n_samples`` components: a larger value is set to ``n_samples`` with a warning, as
        ``sklearn.kernel_approximation.Nystroem`` does.
    role : {"query", "key"}, default="query"
        Which side of the kernel ``transform`` computes. Only asymmetric maps distinguish them. Read at
        transform time: ``set_params(role="key")`` on a fitted transformer gives the key features of the same
        draw.
    scale : float or None, default=None
        ``s`` in ``exp(s · xᵀy)``; ``None`` means ``1/sqrt(n_features_in_)`` (attention's convention).
    random_state : None, int, SeedSequence, Generator or RandomState, default=None
        Source of the random draw. An int or ``SeedSequence`` gives the same draw at every ``fit`` (and for
        float32 and float64 input); a ``Generator`` advances; a ``RandomState`` gives one seed per fit.
    **options
        Further keyword options of the estimator (e.g. ``sampler``, ``eps``). They are parameters like the
        others: ``get_params`` returns them, ``set_params`` changes or adds them, ``clone`` keeps them.

    Attributes
    ----------
    estimator_ : kernapprox.estimators.FeatureMap
        The fitted kernapprox estimator.
    n_components_ : int
        The actual number of output features.
    scale_ : float
        The kernel scale in use.
    n_features_in_ : int
        Number of input features seen during ``fit``.
    feature_names_in_ : ndarray of str
        Input feature names, when ``X`` had string column names.

    Notes
    -----
    Input is validated with :func:`sklearn.utils.validation.validate_data`: 2-D, finite, float32 kept as is and
    any other numeric type converted to float64 (scikit-learn's convention); the output has the dtype the
    computation ran in. A data-dependent estimator (e.g. Nyström) is fitted on ``X`` alone (``fit(q=X)``): one
    sample stands for both sides of the kernel (with ``n_components = n_samples`` Nyström then reproduces the
    kernel on ``X``). The features are computed at their exact scale: if ``exp(±scale · ‖x‖²/2)``-size factors
    overflow or underflow the dtype (unscaled data: e.g. the wine data set, ``‖x‖² ≈ 10⁶``), ``transform`` raises
    ``ValueError`` naming the fix (standardise ``X``, e.g. with ``StandardScaler``, or reduce ``scale``) instead
    of returning infinities or all-zero rows.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(size=(5, 3))
    >>> Z = SoftmaxKernelFeatures(n_components=4096, random_state=0).fit_transform(X)
    >>> bool(np.allclose(Z @ Z.T, np.exp(X @ X.T / np.sqrt(3)), rtol=0.2))
    True
    """

    def __init__(self, estimator="positive_orthogonal", n_components=None, *, role="query", scale=None,
                 random_state=None, **options):
        self.estimator = estimator
        self.n_components = n_components
        self.role = role
        self.scale = scale
        self.random_state = random_state
        self._options = options

    # ------------------------------------------------------------------------------------- parameters
    def get_params(self, deep=True):
        """Parameters of this transformer, the estimator ``**options`` included."""
        params = super().get_params(deep=deep)
        params.update(self._options)
        return params

    def set_params(self, **params):
        """Set parameters; names that are not the adapter's own are estimator options (checked at ``fit``)."""
        own = set(self._get_param_names())
        for name in [p for p in params if p not in own and "__" not in p]:
            self._options[name] = params.pop(name)
        return super().set_params(**params)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        return tags

    def _check_params(self):
        if not isinstance(self.estimator, str) or self.estimator not in available_estimators():
            raise ValueError(f"unknown estimator {self.estimator!r}; available: {', '.join(available_estimators())}")
        if not has_feature_map(self.estimator):
            valid = [name for name in available_estimators() if has_feature_map(name)]
            raise ValueError(f"estimator {self.estimator!r} has no finite feature map; use one of {', '.join(valid)}")
        if self.n_components is not None:
            check_positive_int(self.n_components, "n_components")
        check_choice(self.role, "role", ROLES)
        if self.scale is not None:
            check_positive_float(self.scale, "scale")
        accepted = [name for name in constructor_options(self.estimator) if name not in _RESERVED_OPTIONS]
        for name in self._options:
            if name in _RESERVED_OPTIONS:
                raise ValueError(f"option {name!r} is set through n_components/random_state/scale, not **options")
            if name not in accepted:
                raise ValueError(f"unknown option {name!r} for estimator {self.estimator!r}; valid options: "
                                 f"{', '.join(accepted) or 'none'}")

    # ---------------------------------------------------------------------------------------- fitting
    def fit(self, X, y=None):
        """Draw (or, for data-dependent maps, derive from ``X``) the feature map. ``y`` is ignored."""
        self._check_params()
        X = validate_data(self, X, dtype=[np.float64, np.float32])
        caps = capabilities(self.estimator, **self._options)
        size = None if caps.fixed_dimension else (DEFAULT_COMPONENTS if self.n_components is None
                                                  else self.n_components)
        if caps.rank_limited_by_points and size > X.shape[0]:
            # scikit-learn's Nystroem: warn and cap (its wording)
            warnings.warn("n_components > n_samples. This is not possible.\nn_components was set to n_samples, which "
                          "results in inefficient evaluation of the full kernel.", stacklevel=2)
            size = X.shape[0]
        est = make_estimator(self.estimator, num_features=size, rng=_as_rng(self.random_state),
                             scale=self.scale, **self._options)
        x = torch.from_numpy(np.array(X, copy=True))
        est.fit(x)                      # k=None: one sample for both sides of the kernel
        if caps.fixed_dimension and self.n_components is not None and self.n_components != est.num_features:
            raise ValueError(f"estimator {self.estimator!r} has a fixed dimension, {est.num_features} for "
                             f"{X.shape[1]} input features; n_components must be None or {est.num_features}, got "
                             f"{self.n_components}")
        self.estimator_ = est
        self.scale_ = float(est.scale_)
        self.n_components_ = int(est.num_features)
        return self

    @property
    def _n_features_out(self):
        return self.n_components_

    def transform(self, X):
        """``φ(X)``: ``(n_samples, n_features_in_) -> (n_samples, n_components_)``, in ``X``'s float dtype."""
        check_is_fitted(self)
        check_choice(self.role, "role", ROLES)
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False)
        x = torch.from_numpy(X if X.flags.writeable else np.array(X, copy=True))
        with torch.no_grad():
            try:
                phi = self.estimator_.features(x, self.role)
            except ValueError as exc:
                if "exact-scale features" not in str(exc):
                    raise
                what = "underflow" if "underflow" in str(exc) else "overflow"
                dtype = str(x.dtype).removeprefix("torch.")
                raise ValueError(
                    f"the features of some rows of X {what} {dtype} at scale={self.scale_:.3g} (they would be "
                    f"returned as {'zeros' if what == 'underflow' else 'infinities'}: the factors exp(±scale·‖x‖²/2) "
                    "of these maps exceed the dtype's range for rows of X this large); standardise X (e.g. "
                    "sklearn.preprocessing.StandardScaler in a pipeline) or pass a smaller scale") from exc
        out = phi.numpy()
        self._warn_if_collapsed(out)
        return out

    def _warn_if_collapsed(self, phi: np.ndarray) -> None:
        """Warn, naming the fix, when the features of most rows rest on one or two coordinates: the kernel
        ``exp(scale·xᵀy)`` is then dominated by its largest term and a linear model on the features sees little
        more than which coordinate is largest (on unscaled digits at the default scale, chance accuracy)."""
        if phi.shape[0] == 0:
            return
        ess = effective_features(phi)
        share = float((ess < COLLAPSED_ESS).mean())
        if share > COLLAPSED_SHARE and self.n_components_ > 2:
            warnings.warn(
                f"SoftmaxKernelFeatures({self.estimator!r}): the features collapse onto few coordinates: "
                f"{share:.0%} of the rows have fewer than {COLLAPSED_ESS:g} effective features (median "
                f"{float(np.median(ess)):.2g} of n_components_={self.n_components_}; "
                f"kernapprox.sklearn.effective_features) at scale={self.scale_:.3g}; standardise X (e.g. "
                "sklearn.preprocessing.StandardScaler in a pipeline) or pass a smaller scale", UserWarning,
                stacklevel=3)

    def kernel(self, X, Y=None):
        """The approximate kernel ``φ_query(X) φ_key(Y)ᵀ ≈ exp(scale · X Yᵀ)`` (``Y = X`` if omitted)."""
        check_is_fitted(self)
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False)
        Y = X if Y is None else validate_data(self, Y, dtype=X.dtype, reset=False)
        with torch.no_grad():
            out = self.estimator_.kernel_matrix(torch.from_numpy(np.array(X, copy=True)),
                                                torch.from_numpy(np.array(Y, copy=True)))
        return out.numpy()
