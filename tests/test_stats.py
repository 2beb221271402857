"""kernapprox.stats: the intervals every study stores cover what they claim, on distributions with known answers,
and the summaries follow the one documented convention."""

import numpy as np
import pytest
import xarray as xr
from scipy import stats as scipy_stats

from kernapprox import stats

REPLICATIONS = 400   # independent data sets per coverage check: the coverage estimate has SE ≈ 0.011 at 0.95


def _draws(sampler, m, seed=0):
    """``REPLICATIONS`` independent data sets of ``m`` draws, as a DataArray (replication, draw)."""
    rng = np.random.default_rng(seed)
    return xr.DataArray(sampler(rng, (REPLICATIONS, m)), dims=("replication", "draw"))


@pytest.mark.parametrize("name, sampler, median", [
    ("normal", lambda rng, size: rng.normal(1.0, 2.0, size), 1.0),
    ("lognormal", lambda rng, size: rng.lognormal(-1.0, 1.5, size), np.exp(-1.0)),
    ("pareto", lambda rng, size: rng.pareto(1.5, size), 2 ** (1 / 1.5) - 1),   # heavy tail, infinite variance
])
def test_bootstrap_interval_of_the_median_covers_the_true_median(name, sampler, median):
    """Percentile bootstrap of the median with 40 draws: coverage of the true median close to 95 % (the
    interval is a pair of order statistics; its exact coverage for m = 40 is 0.94–0.97)."""
    s = stats.bootstrap_interval(_draws(sampler, 40), "draw", "median", resamples=400)
    covered = (s.sel(stat="lo") <= median) & (median <= s.sel(stat="hi"))
    coverage = float(covered.mean())
    assert 0.91 <= coverage <= 0.99, (name, coverage)


def test_bootstrap_interval_of_the_mean_covers_the_true_mean():
    s = stats.bootstrap_interval(_draws(lambda rng, size: rng.exponential(2.0, size), 80), "draw", "mean",
                                 resamples=400)
    coverage = float(((s.sel(stat="lo") <= 2.0) & (2.0 <= s.sel(stat="hi"))).mean())
    assert 0.91 <= coverage <= 0.98, coverage


def test_clopper_pearson_is_exact_and_conservative():
    """Exact coverage computed by summing the binomial law over every outcome: never below the level."""
    for n in (5, 16, 100, 1000):
        for p in (0.01, 0.1, 0.5, 0.93):
            k = np.arange(n + 1)
            lo, hi = stats.binomial_interval(k, np.full_like(k, n))
            coverage = scipy_stats.binom.pmf(k, n, p)[(lo <= p) & (p <= hi)].sum()
            assert coverage >= 0.95 - 1e-9, (n, p, coverage)
    lo, hi = stats.binomial_interval(0, 10)
    assert lo == 0.0 and np.isclose(hi, 1 - 0.025 ** 0.1)          # closed form at k = 0
    lo, hi = stats.binomial_interval(10, 10)
    assert hi == 1.0 and np.isclose(lo, 0.025 ** 0.1)
    lo, hi = stats.binomial_interval(8, 10)
    assert np.isclose(lo, scipy_stats.beta.ppf(0.025, 8, 3)) and np.isclose(hi, scipy_stats.beta.ppf(0.975, 9, 2))


def test_binomial_interval_keeps_dataarrays():
    k = xr.DataArray([0, 3, 7], dims="x")
    lo, hi = stats.binomial_interval(k, 7)
    assert isinstance(lo, xr.DataArray) and lo.dims == ("x",) and float(hi[-1]) == 1.0
    with pytest.raises(ValueError, match="successes"):
        stats.binomial_interval(8, 7)
    assert np.isnan(stats.binomial_interval(0, 0)[0])


def test_summarise_convention_quantiles_and_tail():
    rng = np.random.default_rng(3)
    data = rng.lognormal(0.0, 1.0, size=(2, 3, 500))
    da = xr.DataArray(data, dims=("estimator", "seed", "episode"), coords={"estimator": ["a", "b"]},
                      attrs={"long_name": "error", "units": "1"})
    s = stats.summarise(da, ("seed", "episode"))
    assert s.dims == ("estimator", "stat") and s.stat.values.tolist() == list(stats.STATS)
    assert stats.is_summary(s) and s.attrs["over"] == "seed, episode" and s.attrs["statistic"] == "median"
    flat = data.reshape(2, -1)
    np.testing.assert_allclose(s.sel(stat="estimate"), np.median(flat, -1))
    np.testing.assert_allclose(s.sel(stat="q10"), np.quantile(flat, 0.1, -1))
    np.testing.assert_allclose(s.sel(stat="tail"), (flat > 1).mean(-1))
    assert bool((s.sel(stat="tail_lo") < s.sel(stat="tail")).all() and (s.sel(stat="count") == 1500).all())
    assert np.isnan(s.sel(stat="successes")).all()                      # not a proportion: NaN entries


def test_summaries_skip_nan_draws_and_keep_inf():
    da = xr.DataArray([[1.0, 2.0, np.nan, np.inf, 3.0], [np.nan] * 5], dims=("x", "seed"))
    s = stats.summarise(da, "seed")
    assert float(s.sel(x=0, stat="count")) == 4 and float(s.sel(x=0, stat="estimate")) == 2.5
    assert float(s.sel(x=0, stat="tail")) == 0.75                      # 2, inf, 3 exceed 1
    assert np.isnan(s.sel(x=1)).sel(stat=["estimate", "lo", "hi"]).all() and float(s.sel(x=1, stat="count")) == 0


def test_summaries_are_deterministic_and_independent_of_slice_order():
    rng = np.random.default_rng(5)
    da = xr.DataArray(rng.normal(size=(4, 9)), dims=("x", "seed"))
    a = stats.summarise(da, "seed")
    b = stats.summarise(da.isel(x=[3, 2, 1, 0]), "seed").isel(x=[3, 2, 1, 0])
    xr.testing.assert_identical(a, b)
    xr.testing.assert_identical(a, stats.summarise(da, "seed"))


def test_proportion_summary_pools_trials():
    acc = xr.DataArray([[0.5, 1.0, np.nan]], dims=("x", "episode"))
    s = stats.proportion_summary(acc * 10, 10, "episode")
    assert float(s.sel(x=0, stat="estimate")) == 0.75 and float(s.sel(x=0, stat="trials")) == 20
    lo, hi = stats.binomial_interval(15, 20)
    assert float(s.sel(x=0, stat="lo")) == pytest.approx(lo) and float(s.sel(x=0, stat="hi")) == pytest.approx(hi)


def test_paired_comparisons_and_their_summary():
    rng = np.random.default_rng(7)
    base = rng.lognormal(size=30)
    da = xr.DataArray(np.stack([base, 0.5 * base * rng.lognormal(0, 0.1, 30), base * rng.lognormal(0, 1, 30)]),
                      dims=("estimator", "seed"), coords={"estimator": ["base", "half", "noisy"]}, name="err")
    ratio = stats.paired(da, "estimator", "base", op="ratio")
    np.testing.assert_allclose(ratio.sel(estimator="base"), 1.0)
    s = stats.paired_summary(ratio, "seed")
    assert float(s.sel(estimator="half", stat="hi")) < 1 and float(s.sel(estimator="half", stat="below")) == 1.0
    assert float(s.sel(estimator="noisy", stat="lo")) < 1 < float(s.sel(estimator="noisy", stat="hi"))
    diff = stats.paired(da, "estimator", "base")
    np.testing.assert_allclose(diff.sel(estimator="half"), da.sel(estimator="half") - da.sel(estimator="base"))
    with pytest.raises(ValueError, match="baseline"):
        stats.paired(da, "estimator", "missing")


@pytest.mark.parametrize("call, match", [
    (lambda da: stats.summarise(da, "nope"), "not dimensions"),
    (lambda da: stats.bootstrap_interval(da, "seed", level=1.5), "level"),
    (lambda da: stats.bootstrap_interval(da, "seed", "mode"), "statistic"),
    (lambda da: stats.bootstrap_interval(da, "seed", resamples=10), "resamples"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(xr.DataArray(np.ones((2, 5)), dims=("x", "seed")))


# ---------------------------------------------------------------- units of replication and paired tests
def _clustered(rng, units=20, entries=16, between=1.0, within=0.3):
    """Entries that share a unit share its offset: intra-unit correlation between²/(between² + within²)."""
    offset = rng.normal(0.0, between, size=(units, 1))
    return xr.DataArray(offset + rng.normal(0.0, within, size=(units, entries)), dims=("seed", "episode"))


def test_the_cluster_interval_covers_where_pooling_entries_does_not():
    """200 clustered data sets with true mean 0 (intra-unit correlation 0.92): the cluster bootstrap's 95 %
    interval covers 0 in 86-99 % of them (binomial 3σ band around 0.93, the percentile interval's known slight
    under-coverage at 20 units), the interval that treats the 320 entries as independent in far fewer."""
    rng = np.random.default_rng(7)
    cover_cluster = cover_pooled = 0
    for _ in range(200):
        da = _clustered(rng)
        c = stats.cluster_interval(da, "seed", "episode", resamples=400)
        p = stats.bootstrap_interval(da, ("seed", "episode"), "mean", resamples=400)
        cover_cluster += float(c.sel(stat="lo")) <= 0 <= float(c.sel(stat="hi"))
        cover_pooled += float(p.sel(stat="lo")) <= 0 <= float(p.sel(stat="hi"))
        assert float(c.sel(stat="count")) == 20
        np.testing.assert_allclose(float(c.sel(stat="estimate")), float(da.mean()))
    assert 0.86 <= cover_cluster / 200 <= 0.99, cover_cluster
    assert cover_pooled / 200 < 0.6, cover_pooled


def test_the_cluster_interval_weights_units_by_their_valid_entries():
    da = xr.DataArray([[1.0, 1.0, 1.0, np.nan], [5.0, np.nan, np.nan, np.nan], [np.nan] * 4],
                      dims=("seed", "episode"))
    c = stats.cluster_interval(da, "seed", "episode")
    assert float(c.sel(stat="estimate")) == 2.0 and float(c.sel(stat="count")) == 2
    with pytest.raises(ValueError, match="unit 'seed' cannot also be a within"):
        stats.cluster_interval(da, "seed", ("seed", "episode"))


def test_paired_tests_are_the_exact_tests_on_unit_values():
    from scipy import stats as sps

    rng = np.random.default_rng(3)
    a = xr.DataArray(rng.normal(size=(2, 12, 5)), dims=("estimator", "seed", "episode"),
                     coords={"estimator": ["x", "base"]})
    a = a + xr.DataArray([0.4, 0.0], dims="estimator", coords={"estimator": ["x", "base"]})
    diff = stats.paired(a, "estimator", "base")
    units = diff.sel(estimator="x").mean("episode").values
    p = stats.paired_test(diff, "seed", "episode")
    np.testing.assert_allclose(float(p.sel(estimator="x")), sps.wilcoxon(units, method="exact").pvalue)
    assert np.isnan(float(p.sel(estimator="base")))                    # all differences are 0: no test
    s = stats.paired_test(diff, "seed", "episode", test="sign")
    np.testing.assert_allclose(float(s.sel(estimator="x")), sps.binomtest(int((units > 0).sum()), 12).pvalue)
    assert p.attrs["num_units"] == 12 and p.attrs["unit"] == "seed"
    ratio = stats.paired(np.exp(a), "estimator", "base", op="ratio")   # tested on the log ratio = diff here
    np.testing.assert_allclose(float(stats.paired_test(ratio, "seed", "episode").sel(estimator="x")),
                               float(p.sel(estimator="x")))
    with pytest.raises(ValueError, match="test must be"):
        stats.paired_test(diff, "seed", test="t")


def test_five_units_can_never_give_a_verdict():
    """The smallest two-sided exact p-value with 5 units is 2/2⁵ = 0.0625 for both tests: no verdict at 0.05,
    and the verdict also asks for MIN_UNITS units."""
    diff = xr.DataArray(np.arange(1.0, 6.0), dims="seed", attrs={"comparison": "difference"})
    for test in ("wilcoxon", "sign"):
        p = float(stats.paired_test(diff, "seed", test=test))
        np.testing.assert_allclose(p, 0.0625)
        assert stats.verdict(3.0, p, 5) == "not resolved"
    assert stats.verdict(-0.2, 0.001, 12) == "lower" and stats.verdict(1.3, 0.01, 10, neutral=1.0) == "higher"
    assert stats.verdict(-0.2, 0.001, 9) == "not resolved"


def test_holm_adjusts_step_down_and_keeps_nan_out_of_the_family():
    p = np.array([0.01, 0.04, np.nan, 0.03, 0.2])
    # sorted 0.01, 0.03, 0.04, 0.2 with multipliers 4, 3, 2, 1 -> 0.04, 0.09, 0.09 (monotone), 0.2
    np.testing.assert_allclose(stats.holm(p), [0.04, 0.09, np.nan, 0.09, 0.2])
    da = xr.DataArray(p, dims="pair")
    assert isinstance(stats.holm(da), xr.DataArray)


def test_range_summary_is_the_median_and_range_of_the_units():
    values = np.array([[0.3, 0.1, 0.5, np.nan, 0.2], [1.0, 2.0, 3.0, 4.0, 5.0]])
    da = xr.DataArray(values, dims=("estimator", "seed"), attrs={"long_name": "error", "units": "1"})
    s = stats.range_summary(da, "seed")
    assert stats.is_summary(s) and s.attrs["unit"] == "seed" and "not a confidence interval" in s.attrs["interval"]
    np.testing.assert_allclose(s.sel(stat=["estimate", "lo", "hi", "count"]).values,
                               [[0.25, 0.1, 0.5, 4], [3.0, 1.0, 5.0, 5]])
    assert np.isnan(s.sel(stat="q10")).all() and s.attrs["long_name"] == "error"
    assert np.isnan(stats.range_summary(da * np.nan, "seed").sel(stat="estimate")).all()


def _residual_rank_correlation(x, y, z):
    """Independent route to the partial Spearman ρ: Pearson's r of the residuals of rank(x), rank(y) after a
    least-squares line on rank(z)."""
    rx, ry, rz = (scipy_stats.rankdata(v) for v in (x, y, z))
    design = np.stack([np.ones_like(rz), rz], 1)
    res = [v - design @ np.linalg.lstsq(design, v, rcond=None)[0] for v in (rx, ry)]
    return float(np.corrcoef(*res)[0, 1])


def test_partial_spearman_is_the_correlation_of_rank_residuals():
    rng = np.random.default_rng(3)
    for _ in range(5):
        z = rng.normal(size=15)
        x, y = z + rng.normal(size=15), 0.5 * z + rng.normal(size=15)
        np.testing.assert_allclose(stats.partial_spearman(x, y, z), _residual_rank_correlation(x, y, z), atol=1e-12)
    # ties (mid-ranks) and NaN pairs left out
    x, y, z = np.array([1, 2, 2, 3, 5, 4, np.nan]), np.array([2, 1, 3, 3, 6, 5, 0]), np.array([1, 1, 2, 2, 3, 3, 4])
    np.testing.assert_allclose(stats.partial_spearman(x, y, z), _residual_rank_correlation(x[:6], y[:6], z[:6]))


def test_partial_spearman_removes_what_the_control_explains():
    rng = np.random.default_rng(0)
    z = np.log2(np.repeat([16, 32, 64, 128, 256], 40))     # tied levels, as log r over estimators: mid-ranks
    x, y = z + 0.3 * rng.normal(size=200), z + 0.3 * rng.normal(size=200)   # related only through z
    assert stats.partial_spearman(x, y, z) == pytest.approx(0.0, abs=0.15)
    assert float(scipy_stats.spearmanr(x, y).statistic) > 0.8               # the plain ρ is mostly z
    e = rng.normal(size=200)
    x, y = z + 0.3 * e, z - 0.3 * e                                         # residuals opposite
    assert stats.partial_spearman(x, y, z) < -0.8
    assert stats.partial_spearman(z + 0.3 * e, z + 0.3 * e, z) == pytest.approx(1.0)
    # the control orders y perfectly: nothing left to correlate; fewer than 4 pairs: undefined
    assert np.isnan(stats.partial_spearman(rng.normal(size=10), np.arange(10.0) ** 2, np.arange(10.0)))
    assert np.isnan(stats.partial_spearman([1.0, 2.0, 3.0], [3.0, 1.0, 2.0], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="same length"):
        stats.partial_spearman([1.0, 2.0], [1.0], [1.0, 2.0])
