"""The SORF/SMREG bias: the sphere closed form (against quadrature and a plain series), the sign-averaged
measurement (against the estimator's own products), the SORF and sorf_chi samplers (against a per-block loop),
and the ``sampler_bias`` study's smoke preset."""

import math

import numpy as np
import pytest
import scipy.stats as st
import torch
from scipy import integrate, special

import kernapprox as ka
from experiments import sampler_bias
from kernapprox import sweep, theory
from kernapprox.estimators.samplers import make_sampler


# ---------------------------------------------------------------------------------------- the closed form
def _sphere_density_integral(f, s, dim):
    """``E f(s·t)`` for ``t`` the first coordinate of a uniform unit vector in ``R^dim`` (density
    ``∝ (1−t²)^{(d−3)/2}``), by adaptive quadrature."""
    log_c = special.gammaln(dim / 2) - 0.5 * math.log(math.pi) - special.gammaln((dim - 1) / 2)
    value, _ = integrate.quad(lambda t: math.exp(log_c) * (1 - t * t) ** ((dim - 3) / 2) * f(s * t), -1, 1,
                              limit=400, epsabs=0, epsrel=1e-10)
    return value


@pytest.mark.parametrize("dim", [2, 3, 5, 16, 64])
def test_sphere_mgf_and_characteristic_function_match_quadrature(dim):
    for s2 in (1e-9, 0.3, 4.0, 40.0):
        s = math.sqrt(s2)
        mgf = _sphere_density_integral(lambda u, s=s: math.exp(u - s), s, dim)   # scaled by e^{-s}
        np.testing.assert_allclose(float(theory.log_sphere_mgf(s2, dim)), math.log(mgf) + s, rtol=1e-9, atol=1e-12)
        char = _sphere_density_integral(math.cos, s, dim)
        np.testing.assert_allclose(float(theory.sphere_characteristic(s2, dim)), char, rtol=1e-8, atol=1e-10)
    assert float(theory.log_sphere_mgf(4.0, 1)) == pytest.approx(math.log(math.cosh(2.0)), rel=1e-12)


def _hyp0f1_series(b, x, terms=400):
    """``₀F₁(; b; x)`` by its defining series, term by term (independent of scipy's Bessel functions)."""
    total, term = 1.0, 1.0
    for n in range(terms):
        term *= x / ((b + n) * (n + 1))
        total += term
    return total


def test_regularized_mean_ratio_values():
    """The issue's numbers: ‖x+y‖² = 4 at d = 32 gives 0.902; a typical unit-variance pair (‖x+y‖² = 2√d) gives
    0.505, 0.471, 0.444 at d = 32, 64, 128, heading to e⁻¹; the fixed-norm GERF factor; trig's closed form."""
    assert float(theory.regularized_mean_ratio(4.0, 32)) == pytest.approx(
        math.exp(-2.0) * _hyp0f1_series(16.0, 32.0), rel=1e-12)
    assert round(float(theory.regularized_mean_ratio(4.0, 32)), 3) == 0.902
    typical = [float(theory.regularized_mean_ratio(2 * math.sqrt(d), d)) for d in (32, 64, 128, 4096)]
    np.testing.assert_allclose(typical[:3], [0.505, 0.471, 0.444], atol=5e-4)
    assert abs(typical[3] - math.exp(-1)) < 0.02 and typical[2] > typical[3] > math.exp(-1)     # 0.383 at d = 4096
    a, d, z2 = -0.1, 16, 3.0
    expected = (1 - 4 * a) ** (d / 2) * math.exp(2 * a * d - z2 / 2) * _hyp0f1_series(d / 2, (1 - 4 * a) * d * z2 / 4)
    assert float(theory.regularized_mean_ratio(z2, d, A=a)) == pytest.approx(expected, rel=1e-11)
    assert float(theory.regularized_mean_ratio(1.5, 8, kind="trig")) == pytest.approx(
        math.exp(0.75) * _hyp0f1_series(4.0, -8 * 1.5 / 4), rel=1e-11)
    assert float(theory.regularized_mean_ratio(0.7, 8, kind="hyperbolic")) == float(
        theory.regularized_mean_ratio(0.7, 8))
    with pytest.raises(ValueError, match="kind"):
        theory.regularized_mean_ratio(1.0, 4, kind="cosine")
    with pytest.raises(ValueError, match="A must be 0"):
        theory.regularized_mean_ratio(1.0, 4, kind="trig", A=-0.1)


# ------------------------------------------------------------------------------- the sign-averaged measurement
def _pair(dim, norm2, seed):
    gen = np.random.default_rng(seed)
    x, y = gen.standard_normal(dim) / dim**0.25, gen.standard_normal(dim) / dim**0.25
    factor = math.sqrt(norm2 / float((x + y) @ (x + y)))
    return factor * x, factor * y


@pytest.mark.parametrize("sampler", ["iid", "regularized", "sorf", "sorf_chi"])
@pytest.mark.parametrize("map_name", ["positive", "gerf"])
def test_sign_averaged_ratio_is_the_estimator_mean(map_name, sampler):
    """On the same 2¹⁸ rows, the mean of the sign-averaged values (and, for chi-norm samplers, the norm-averaged
    ones) agrees with the mean of the estimator's own per-row products within 4.5 standard errors of the latter,
    and has a standard error at least 3× smaller."""
    dim, rows = 16, 2**18
    x, y = _pair(dim, 4.0, 7)
    name = map_name if sampler == "iid" else f"{map_name}_{sampler}"
    options = {"A": -0.1} if map_name == "gerf" else {}
    est = ka.make_estimator(name, num_features=rows, rng=5, scale=1.0, **options)
    est.fit(torch.zeros(1, dim, dtype=torch.float64))
    xt, yt = torch.tensor(x[None]), torch.tensor(y[None])
    plain = rows * (est.features(xt, "query") * est.features(yt, "key")).numpy()[0] / math.exp(float(x @ y))
    a = options.get("A", 0.0)
    radials = [None, "chi"] if sampler in ("iid", "sorf_chi") else [None]
    plain_se = plain.std() / math.sqrt(rows)
    for radial in radials:
        averaged = theory.sign_averaged_ratio(est.projection_, x, y, A=a, radial=radial)
        assert abs(averaged.mean() - plain.mean()) < 4.5 * plain_se, (radial, averaged.mean(), plain.mean())
        assert averaged.std() < plain.std() / 3
    if sampler == "regularized":
        averaged = theory.sign_averaged_ratio(est.projection_, x, y, A=a)
        closed = float(theory.regularized_mean_ratio(4.0, dim, A=a))
        assert abs(averaged.mean() - closed) < 4.5 * averaged.std() / math.sqrt(rows / dim)   # blocks of d rows


def test_sign_averaged_ratio_trig_and_checks():
    dim = 8
    x, y = _pair(dim, 2.0, 3)
    rows = np.random.default_rng(1).standard_normal((2**17, dim))
    values = theory.sign_averaged_ratio(rows, x, y, kind="trig")
    assert abs(values.mean() - 1.0) < 4.5 * values.std() / math.sqrt(len(values))
    with pytest.raises(ValueError, match="trig"):
        theory.sign_averaged_ratio(rows, x, y, kind="trig", radial="chi")
    with pytest.raises(ValueError, match="rows"):
        theory.sign_averaged_ratio(rows[:, :3], x, y)
    with pytest.raises(ValueError, match="zero"):
        theory.sign_averaged_ratio(np.zeros((2, dim)), x, y, radial="chi")


# ------------------------------------------------------------------------------------------------- samplers
def _sorf_loop(num, dim, rng, chi=False):
    """SORF by its definition, one block at a time: ``sqrt(p) H D3 H D2 H D1``, first ``dim`` columns."""
    p = 1 << max(0, (dim - 1).bit_length())
    h = special_hadamard(p) / math.sqrt(p)
    blocks = []
    for _ in range(math.ceil(num / p)):
        d1, d2, d3 = (np.diag(rng.choice([-1.0, 1.0], size=p)) for _ in range(3))
        blocks.append(math.sqrt(p) * h @ d3 @ h @ d2 @ h @ d1)
    rows = np.concatenate(blocks)[:num]
    if chi:
        rows = rows * (np.linalg.norm(rng.standard_normal((num, p)), axis=1) / math.sqrt(p))[:, None]
    return rows[:, :dim]


def special_hadamard(p):
    from scipy.linalg import hadamard

    return hadamard(p).astype(np.float64)


@pytest.mark.parametrize("num,dim", [(8, 8), (20, 5), (3, 16), (130, 64), (7, 1)])
def test_sorf_samplers_match_their_definition(num, dim):
    for name, chi in (("sorf", False), ("sorf_chi", True)):
        rows = make_sampler(name).sample(num, dim, np.random.default_rng(4))
        np.testing.assert_allclose(rows, _sorf_loop(num, dim, np.random.default_rng(4), chi), rtol=0, atol=1e-12)
        assert rows.shape == (num, dim) and rows.dtype == np.float64


def test_sorf_norms_and_sorf_chi_norm_law():
    """d a power of two: SORF rows have norm exactly √d and are orthogonal within a block (SMREG's law of the
    norm); sorf_chi rows have SORF's directions (same draw) and chi(d) norms (KS test, 4096 rows)."""
    dim = 16
    sorf = make_sampler("sorf").sample(4096, dim, np.random.default_rng(9))
    np.testing.assert_allclose(np.linalg.norm(sorf, axis=1), math.sqrt(dim), rtol=1e-12)
    np.testing.assert_allclose(sorf[:dim] @ sorf[:dim].T, dim * np.eye(dim), atol=1e-10)
    chi = make_sampler("sorf_chi").sample(4096, dim, np.random.default_rng(9))
    norms = np.linalg.norm(chi, axis=1)
    np.testing.assert_allclose(chi / norms[:, None], sorf / math.sqrt(dim), atol=1e-12)
    assert st.kstest(norms, st.chi(dim).cdf).pvalue > 1e-3
    assert st.kstest(np.linalg.norm(sorf, axis=1), st.chi(dim).cdf).pvalue < 1e-10   # fixed norm: not chi(d)


def test_sorf_chi_registered_and_declared_biased():
    for family in ("trig", "positive", "hyperbolic", "gerf", "oprf", "sderf", "saderf", "aderf"):
        caps = ka.capabilities(f"{family}_sorf_chi")
        assert not caps.unbiased and not caps.consistent
        assert not ka.capabilities(f"{family}_sorf").unbiased


# --------------------------------------------------------------------------------------------------- the study
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampler_bias")
    ds = sweep.run(sampler_bias.EXPERIMENT, preset="smoke", out=folder / "x.nc", device="cpu", progress=False)
    return ds, folder


def test_smoke_dataset_findings_and_figure(smoke):
    ds, folder = smoke
    exp = sampler_bias.EXPERIMENT
    for name, metric in {**exp.metrics, **exp.reference.metrics}.items():
        assert ds[name].attrs["long_name"] == metric.long_name
        assert bool(ds[name].notnull().all()), name
    assert "sampler" not in ds["closed_form"].dims                       # the reference: once per data draw
    assert sweep.load(folder / "x.nc").equals(ds)
    text = sweep.findings_text(exp, ds, "x.nc")
    assert text == sweep.findings_text(exp, ds, "x.nc") and text.startswith("- ") and "sphere closed form" in text
    assert "e^(−c²/4)" in text and "95 % intervals" in text
    # the summaries are the stats module's: the estimate is the mean over seeds × pairs, inside its interval
    s = ds["ratio_summary"]
    np.testing.assert_allclose(s.sel(stat="estimate"), ds["ratio"].mean(("seed", "pair")), rtol=1e-12)
    est = s.sel(stat="estimate")
    assert bool((s.sel(stat="lo") <= est).all() and (est <= s.sel(stat="hi")).all())
    assert float(abs(ds["ratio_vs_regularized"].sel(sampler="regularized")).max()) == 0.0
    one = s.sel(sampler="sorf", dim=32, level="two_sqrt_d", feature_map="positive").squeeze(drop=True)
    assert f"sorf {sampler_bias.fmt_ci(one)}" in text
    path = folder / "x.png"
    exp.plot(ds, path)
    from PIL import Image

    assert "mean" in Image.open(path).info["Description"]


def test_smoke_measurements_against_exact_answers(smoke):
    """SMREG matches the sphere closed form and Gaussian rows give 1, each within 5 of its own standard errors
    (Bonferroni over the cells); SORF's bias is SMREG's at ‖x+y‖² = 4 (within 2 %)."""
    ds, _ = smoke
    ratio, se = ds["ratio"], ds["ratio_se"]
    closed = ds["closed_form"]
    z = float(np.abs((ratio.sel(sampler="regularized") - closed) / se.sel(sampler="regularized")).max())
    assert z < 5.0, z
    z = float(np.abs((ratio.sel(sampler="iid") - 1.0) / se.sel(sampler="iid")).max())
    assert z < 5.0, z
    sorf = ratio.sel(sampler="sorf", level="fixed_4").mean(("seed", "pair"))
    assert float(np.abs(sorf / closed.sel(level="fixed_4").isel(seed=0) - 1).max()) < 0.02
