"""The summaries every study builds from its per-draw values (experiments/_common.py): paired comparisons stored
with their intervals, means with bootstrap intervals, and a comparison against a baseline the preset lacks."""

import numpy as np
import xarray as xr

from experiments._common import add_comparison, add_mean, add_paired
from kernapprox import stats


def per_draw():
    rng = np.random.default_rng(0)
    values = rng.lognormal(size=(2, 40)) * np.array([[1.0], [2.0]])
    return xr.Dataset({"err": (("estimator", "seed"), values)},
                      coords={"estimator": ["a", "b"], "seed": np.arange(40)})


def test_add_comparison_stores_the_per_draw_comparison_and_its_paired_summary():
    ds = per_draw()
    ratio = (ds["err"] / ds["err"].sel(estimator="a")).assign_attrs(comparison="ratio", units="1", long_name="r")
    ds = add_comparison(ds, "err_vs_a", ratio, "seed")
    xr.testing.assert_identical(ds["err_vs_a"], ratio.rename("err_vs_a"))
    expected = stats.paired_summary(ratio, "seed")
    np.testing.assert_array_equal(ds["err_vs_a_summary"].values, expected.values)
    assert ds["err_vs_a_summary"].attrs["description"].startswith("summary of err_vs_a over seed: ")
    b = ds["err_vs_a_summary"].sel(estimator="b")
    assert float(b.sel(stat="lo")) > 1                                      # b is twice a, draw by draw


def test_add_paired_is_add_comparison_against_a_baseline_and_skips_a_missing_one():
    ds = add_paired(per_draw(), "err", "a", "seed", op="ratio", label="base")
    np.testing.assert_allclose(ds["err_vs_base"].sel(estimator="b"),
                               ds["err"].sel(estimator="b") / ds["err"].sel(estimator="a"))
    assert "err_vs_base_summary" in ds
    untouched = add_paired(per_draw(), "err", "c", "seed", op="ratio")      # a preset without the baseline
    assert set(untouched.data_vars) == {"err"}


def test_add_mean_is_the_bootstrap_mean_with_its_description():
    ds = add_mean(per_draw(), "err_mean", per_draw()["err"], "seed", long_name="mean error",
                  description="mean of err over seed")
    expected = stats.bootstrap_interval(per_draw()["err"], "seed", "mean")
    np.testing.assert_array_equal(ds["err_mean"].values, expected.values)
    np.testing.assert_allclose(ds["err_mean"].sel(stat="estimate"), per_draw()["err"].mean("seed"))
    assert ds["err_mean"].attrs["long_name"] == "mean error"
    assert ds["err_mean"].attrs["description"].startswith("mean of err over seed: ")


def test_covers_and_above_read_intervals():
    from experiments._common import above, covers

    s = stats.bootstrap_interval(per_draw()["err"], "seed", "mean")
    a, b = s.sel(estimator="a"), s.sel(estimator="b")
    assert bool(covers(a, float(a.sel(stat="estimate")))) and not bool(covers(a, 1e6))
    np.testing.assert_array_equal(covers(s, xr.DataArray([float(a.sel(stat="estimate")), -1.0],
                                                         coords={"estimator": ["a", "b"]}, dims="estimator")),
                                  [True, False])
    assert above(b, a) and not above(a, b) and not above(a, a)                # b is twice a
