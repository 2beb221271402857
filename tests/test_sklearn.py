"""The scikit-learn adapter: estimator checks, equivalence with the library, parameters, pipelines."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.datasets import load_digits, load_wine
from sklearn.linear_model import RidgeClassifier
from sklearn.model_selection import GridSearchCV, cross_val_score, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

import kernapprox as ka
from kernapprox.sklearn import SoftmaxKernelFeatures, has_feature_map

# The checks that force ``n_components = 1`` (scikit-learn sets it to speed them up).
N_COMPONENTS_ONE_CHECKS = (
    "check_dont_overwrite_parameters", "check_methods_sample_order_invariance", "check_methods_subset_invariance",
    "check_fit2d_1sample", "check_fit2d_1feature", "check_fit2d_predict1d",
)


def has_fixed(name: str) -> bool:
    return ka.capabilities(name).fixed_dimension


def representatives() -> list[str]:
    """One registry name per distinct feature map: names that differ only in their projection sampler share a
    class and its code path, so one of them stands for all."""
    chosen = {}
    for name in ka.available_estimators():
        if not has_feature_map(name):
            continue
        params = ka.make_estimator(name, num_features=8).get_params()
        key = (ka.estimator_class(name), repr(sorted((k, repr(v)) for k, v in params.items()
                                                     if k not in ("sampler", "rng", "num_features"))))
        chosen.setdefault(key, name)
    return sorted(chosen.values())


def expected_failed_checks(transformer) -> dict[str, str]:
    """Checks that cannot apply, with the reason.

    Maps that need sin/cos or exp(±) pairs reject ``n_components = 1`` (raising ValueError at fit), which
    scikit-learn forces in the checks listed in ``N_COMPONENTS_ONE_CHECKS``.
    """
    failing = {}
    if transformer.scale is None:
        failing["check_fit_idempotent"] = (
            "the check draws inputs around 100: at attention's default scale the exact-scale features underflow "
            "float64 (e^(-s‖x‖²/2) ≈ e^(-7000)) and transform raises with the fix instead of returning zeros")
    if has_fixed(transformer.estimator):
        # its dimension is set by the input's; n_components=1 is refused unless the map has dimension 1 there
        reason = "the check sets n_components=1; this map's dimension is fixed by the input dimension"
        one_feature = ka.make_estimator(transformer.estimator).fit(torch.zeros(2, 1, dtype=torch.float64))
        checks = [c for c in N_COMPONENTS_ONE_CHECKS if c != "check_fit2d_1feature" or one_feature.num_features != 1]
        failing.update(dict.fromkeys(checks, reason))
        return failing
    try:
        ka.make_estimator(transformer.estimator, num_features=1)
    except ValueError:
        reason = "the check sets n_components=1; this map needs an even number of features (pairs)"
        failing.update(dict.fromkeys(N_COMPONENTS_ONE_CHECKS, reason))
    return failing


# The default transformer as users get it, and one per distinct feature map at scale 1e-3: check_fit_idempotent
# draws inputs around 100, where exp(±s‖x‖²/2) overflows or underflows float64 at attention's default scale; the
# transformer then raises instead of returning inf or zeros, by design (see test_overflow_raises and
# test_unscaled_wine_features_that_underflow_raise_with_the_fix).
CHECKED = [SoftmaxKernelFeatures()] + [SoftmaxKernelFeatures(name, n_components=None if has_fixed(name) else 8,
                                                              scale=1e-3, random_state=0)
                                       for name in representatives()]


@parametrize_with_checks(CHECKED, expected_failed_checks=expected_failed_checks, xfail_strict=True)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def data(seed=0, n=40, d=6, dtype=np.float64):
    return (np.random.default_rng(seed).standard_normal((n, d)) * 0.5).astype(dtype)


@pytest.mark.parametrize("name", ["positive_orthogonal", "trig", "hyperbolic_qmc"])
def test_transform_is_the_library_feature_map(name):
    X = data()
    tr = SoftmaxKernelFeatures(name, n_components=32, random_state=3).fit(X)
    x = torch.from_numpy(X)
    est = ka.make_estimator(name, num_features=32, rng=3).fit(x, x)
    np.testing.assert_array_equal(tr.transform(X), est.features(x, "query").numpy())
    np.testing.assert_array_equal(tr.set_params(role="key").transform(X), est.features(x, "key").numpy())
    Y = data(1, n=7)
    np.testing.assert_allclose(tr.kernel(X, Y), est.kernel_matrix(x, torch.from_numpy(Y)).numpy(), rtol=1e-12)
    assert tr.n_components_ == 32 and tr.n_features_in_ == 6 and tr.scale_ == pytest.approx(6 ** -0.5)
    assert list(tr.get_feature_names_out()) == [f"softmaxkernelfeatures{i}" for i in range(32)]


def test_kernel_is_approximated():
    """``φ(X)φ(X)ᵀ → exp(s XXᵀ)``: relative Frobenius error at m = 4096 below a quarter of that at m = 64."""
    X = data(n=30)
    exact = np.exp(X @ X.T / np.sqrt(X.shape[1]))

    def err(m):
        Z = SoftmaxKernelFeatures(n_components=m, random_state=0).fit_transform(X)
        return np.linalg.norm(Z @ Z.T - exact) / np.linalg.norm(exact)

    assert err(4096) < 0.25 * err(64)


NYSTROM = [name for name in ka.available_estimators() if name.startswith("nystrom") and has_feature_map(name)]


@pytest.mark.parametrize("name", NYSTROM)
def test_nystrom_with_every_point_as_landmark_is_exact(name):
    """Fitted on X alone with n_components = n_samples, Nyström reproduces exp(s XXᵀ) on X."""
    X = data(n=20)
    Z = SoftmaxKernelFeatures(name, n_components=20, random_state=0).fit_transform(X)
    exact = np.exp(X @ X.T / np.sqrt(X.shape[1]))
    np.testing.assert_allclose(Z @ Z.T, exact, rtol=1e-10)


def test_float32_preserved_with_the_same_draw():
    X = data()
    tr = SoftmaxKernelFeatures(n_components=16, random_state=0)
    z64 = tr.fit_transform(X)
    z32 = tr.fit_transform(X.astype(np.float32))
    assert z64.dtype == np.float64 and z32.dtype == np.float32
    np.testing.assert_allclose(z32, z64, rtol=1e-5, atol=1e-6)
    assert SoftmaxKernelFeatures(n_components=4).fit_transform(np.ones((3, 2), dtype=np.int64)).dtype == np.float64


def test_random_state_semantics():
    X = data()

    def z(rs):
        return SoftmaxKernelFeatures(n_components=8, random_state=rs).fit_transform(X)

    np.testing.assert_array_equal(z(5), z(5))
    np.testing.assert_array_equal(z(np.random.SeedSequence(5)), z(5))
    np.testing.assert_array_equal(z(np.random.RandomState(1)), z(np.random.RandomState(1)))
    gen = np.random.default_rng(0)
    assert not np.array_equal(z(gen), z(gen))            # a Generator advances
    assert not np.array_equal(z(5), z(6))
    with pytest.raises(TypeError, match="random_state"):
        z("0")


def test_options_are_parameters():
    tr = SoftmaxKernelFeatures("positive", n_components=8, sampler="orthogonal", eps=0.0)
    params = tr.get_params()
    assert params["sampler"] == "orthogonal" and params["eps"] == 0.0 and params["estimator"] == "positive"
    assert "sampler=" in repr(tr)
    tr.set_params(sampler="qmc", n_components=4)
    assert tr.get_params()["sampler"] == "qmc" and tr.n_components == 4
    twin = clone(tr)
    assert twin.get_params() == tr.get_params() and twin._options is not tr._options
    X = data()
    assert tr.fit(X).estimator_.sampler == "qmc"
    np.testing.assert_array_equal(clone(tr).set_params(random_state=1).fit_transform(X),
                                  clone(tr).set_params(random_state=1).fit_transform(X))


@pytest.mark.parametrize(("params", "error", "match"), [
    ({"estimator": "nope"}, ValueError, "unknown estimator 'nope'"),
    ({"estimator": "exact"}, ValueError, "no finite feature map"),
    ({"n_components": 0}, ValueError, "n_components"),
    ({"n_components": 2.5}, TypeError, "n_components"),
    ({"role": "value"}, ValueError, "role"),
    ({"scale": -1.0}, ValueError, "scale"),
    ({"bandwidth": 1.0}, ValueError, "unknown option 'bandwidth'"),
    ({"num_features": 8}, ValueError, "n_components"),
    ({"estimator": "trig", "n_components": 7}, ValueError, "multiple of 2"),
], ids=["estimator", "exact", "n0", "nfloat", "role", "scale", "option", "reserved", "odd"])
def test_bad_parameters_raise_at_fit(params, error, match):
    tr = SoftmaxKernelFeatures(n_components=8).set_params(**params)   # construction never raises
    with pytest.raises(error, match=match):
        tr.fit(data())


def test_input_validation_messages():
    tr = SoftmaxKernelFeatures(n_components=8, random_state=0).fit(data())
    with pytest.raises(ValueError, match="6 features"):
        tr.transform(data(d=5))
    with pytest.raises(ValueError, match="NaN"):
        tr.transform(np.full((2, 6), np.nan))
    with pytest.raises(ValueError, match="2D array"):
        tr.transform(np.zeros(6))


def test_overflow_raises():
    X = np.full((2, 4), 30.0)                         # exp(‖x‖²/(2·sqrt(d))) = exp(900) for the trig prefactor
    with pytest.raises(ValueError, match="overflow float64.*StandardScaler"):
        SoftmaxKernelFeatures("trig", n_components=8, random_state=0).fit_transform(X)


@pytest.mark.parametrize("name", ["positive_orthogonal", "hyperbolic_orthogonal", "oprf_orthogonal"])
def test_unscaled_wine_features_that_underflow_raise_with_the_fix(name):
    """Unscaled wine (‖x‖² ≈ 10⁶) used to give all-zero features silently (CV accuracy 0.40 with no warning):
    the exact-scale features underflow float64. transform now raises naming the fix; standardised, it works."""
    X, y = load_wine(return_X_y=True)
    with pytest.raises(ValueError, match="underflow float64.*StandardScaler"):
        SoftmaxKernelFeatures(name, n_components=64, random_state=0).fit_transform(X)
    Z = make_pipeline(StandardScaler(), SoftmaxKernelFeatures(name, n_components=64, random_state=0)).fit_transform(X)
    assert np.isfinite(Z).all() and (np.abs(Z).max(1) > 0).all()


def test_nystrom_caps_n_components_at_n_samples_like_scikit_learn():
    """n_components > n_samples: scikit-learn's Nystroem warning (its wording), capped at n_samples; with every
    point a landmark the kernel is reproduced. cross_val_score on wine at 256 components works in every fold."""
    X = data(n=20)
    wording = (r"^n_components > n_samples\. This is not possible\.\nn_components was set to n_samples, which "
               r"results in inefficient evaluation of the full kernel\.$")
    with pytest.warns(UserWarning, match=wording):
        tr = SoftmaxKernelFeatures("nystrom_uniform", n_components=64, random_state=0).fit(X)
    assert tr.n_components_ == 20 and tr.transform(X).shape == (20, 20)
    np.testing.assert_allclose(tr.transform(X) @ tr.transform(X).T, np.exp(X @ X.T / np.sqrt(X.shape[1])), rtol=1e-8)
    X, y = load_wine(return_X_y=True)
    model = make_pipeline(StandardScaler(), SoftmaxKernelFeatures("nystrom_uniform", n_components=256,
                                                                  random_state=0), RidgeClassifier())
    with pytest.warns(UserWarning, match="n_components > n_samples"):
        scores = cross_val_score(model, X, y, cv=5, error_score="raise")
    assert scores.shape == (5,) and scores.min() > 0.9, scores


def test_pipeline_on_digits_beats_the_linear_model():
    """Ridge on FAVOR+ features of standardised digits beats ridge on the pixels (same split, fixed seeds)."""
    X, y = load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)
    linear = make_pipeline(StandardScaler(), RidgeClassifier()).fit(X_train, y_train).score(X_test, y_test)
    model = make_pipeline(StandardScaler(),
                          SoftmaxKernelFeatures("positive_orthogonal", n_components=256, scale=0.01, random_state=0),
                          RidgeClassifier(alpha=1e-3))
    kernel = model.fit(X_train, y_train).score(X_test, y_test)
    assert kernel > 0.95 and kernel > linear + 0.015, (kernel, linear)


def test_grid_search_over_options():
    X, y = load_digits(return_X_y=True)
    model = make_pipeline(StandardScaler(), SoftmaxKernelFeatures(n_components=64, scale=0.01, random_state=0,
                                                                  sampler="iid"), RidgeClassifier(alpha=1e-3))
    search = GridSearchCV(model, {"softmaxkernelfeatures__sampler": ["iid", "orthogonal"],
                                  "softmaxkernelfeatures__n_components": [32, 64]}, cv=2)
    search.fit(X[:300], y[:300])
    assert set(search.best_params_) == {"softmaxkernelfeatures__sampler", "softmaxkernelfeatures__n_components"}
    assert search.best_estimator_[1].estimator_.sampler == search.best_params_["softmaxkernelfeatures__sampler"]


# ------------------------------------------------------------------------------------ collapsed features
def test_effective_features_counts_the_coordinates_a_row_rests_on():
    from kernapprox.sklearn import effective_features

    phi = np.array([[1.0, 0, 0, 0], [1, 1, 1, 1], [1e300, 1e300, 0, 0], [0, 0, 0, 0], [-1, 1, -1, 1]])
    np.testing.assert_allclose(effective_features(phi), [1, 4, 2, 0, 4])
    np.testing.assert_allclose(effective_features(np.array([[2.0, -1e-200]])), [1.0])   # energy of a signed row


def test_a_transform_whose_features_collapse_warns_and_names_the_fix():
    """Unscaled digits (pixel values 0..16) at the default scale: almost every row of FAVOR+ features rests on one
    coordinate (a linear model on them is at chance); after StandardScaler the same transformer does not warn."""
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    X = load_digits().data
    t = SoftmaxKernelFeatures("positive_orthogonal", n_components=128, random_state=0)
    with pytest.warns(UserWarning, match=r"collapse onto few coordinates: \d+% of the rows.*StandardScaler"):
        t.fit_transform(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.fit_transform(StandardScaler().fit_transform(X))
        SoftmaxKernelFeatures("trig", n_components=128, random_state=0).fit_transform(X)   # energy spread


def test_fixed_dimension_maps_take_their_own_dimension_or_refuse_another():
    X = np.random.default_rng(0).normal(size=(30, 5))
    assert SoftmaxKernelFeatures("taylor2").fit(X).n_components_ == 21             # 1 + d + d(d+1)/2
    assert SoftmaxKernelFeatures("taylor2", n_components=21).fit(X).n_components_ == 21
    with pytest.raises(ValueError, match="fixed dimension, 21 for 5 input features; n_components must be None or 21"):
        SoftmaxKernelFeatures("taylor2", n_components=8).fit(X)
    assert SoftmaxKernelFeatures().fit(X).n_components_ == 100
