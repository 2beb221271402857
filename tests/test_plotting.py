"""The figure and findings helpers of kernapprox.plotting that the studies share: summaries drawn as lines, bands
and bars (leaving out what did not run), reference lines, memory axes, legends, and the findings' number formats."""

import numpy as np
import pytest
import xarray as xr
from matplotlib.collections import PolyCollection
from matplotlib.container import ErrorbarContainer

from kernapprox import plotting
from kernapprox.stats import STATS


def summary(estimates, lo=None, hi=None, dim="num_features", coords=(8, 16, 32, 64)):
    """A summary (stat dimension of kernapprox.stats) along ``dim`` with the given estimates and bounds."""
    est = np.asarray(estimates, dtype=float)
    lo = est * 0.5 if lo is None else np.asarray(lo, dtype=float)
    hi = est * 2.0 if hi is None else np.asarray(hi, dtype=float)
    data = np.full((est.size, len(STATS)), np.nan)
    data[:, 0], data[:, 1], data[:, 2] = est, lo, hi
    return xr.DataArray(data, dims=(dim, "stat"), coords={dim: list(coords)[:est.size], "stat": list(STATS)})


def axes():
    fig, ax = plotting.new_figure()
    return fig, ax


def test_plot_summary_leaves_out_what_did_not_run_and_draws_one_point_as_a_marker():
    _, ax = axes()
    line = plotting.plot_summary(ax, summary([1.0, np.nan, 0.5, 0.25]), "num_features", color="red")
    np.testing.assert_array_equal(line.get_xdata(), [8, 32, 64])             # the NaN cell is a gap
    band = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(band) == 1
    _, ax = axes()
    line = plotting.plot_summary(ax, summary([np.nan, 0.5, np.nan, np.nan]), "num_features", label="one")
    assert line is not None and line.get_marker() not in (None, "None", "")  # a line of one point would not show
    np.testing.assert_array_equal(line.get_xdata(), [16])
    assert [c for c in ax.containers if isinstance(c, ErrorbarContainer)]     # with its interval as a bar
    assert plotting.plot_summary(ax, summary([np.nan] * 4), "num_features") is None


def test_plot_summary_positive_keeps_log_axes_drawable():
    _, ax = axes()
    s = summary([1.0, 0.0, 0.5, 0.25], lo=[-1.0, 0.0, 0.1, 0.1])
    line = plotting.plot_summary(ax, s, "num_features", positive=True)
    np.testing.assert_array_equal(line.get_xdata(), [8, 32, 64])             # the zero estimate left out
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert band.get_paths()[0].vertices[:, 1].min() > 0                     # the band stays above zero


def test_plot_summary_draws_against_given_positions():
    _, ax = axes()
    line = plotting.plot_summary(ax, summary([1.0, 0.5, 0.4]), xvalues=[3.0, np.nan, 5.0])
    np.testing.assert_array_equal(line.get_xdata(), [3.0, 5.0])
    with pytest.raises(ValueError, match="1-D summary"):
        plotting.plot_summary(ax, summary([1.0, 0.5]), xvalues=[1.0, 2.0, 3.0])


def test_errorbar_summary_bars_are_the_interval_and_non_finite_points_are_left_out():
    _, ax = axes()
    s = summary([1.0, 2.0, np.nan, 4.0], lo=[0.5, 1.0, np.nan, 3.0], hi=[2.0, 3.0, np.nan, np.inf])
    bars = plotting.errorbar_summary(ax, s, [1.0, np.nan, 3.0, 4.0], color="k")
    np.testing.assert_array_equal(bars.lines[0].get_xdata(), [1.0, 4.0])    # NaN position, NaN estimate: out
    segments = bars.lines[2][0].get_segments()
    np.testing.assert_allclose([seg[:, 1] for seg in segments], [[0.5, 2.0], [3.0, 4.0]])  # none above inf
    assert plotting.errorbar_summary(ax, summary([np.nan, np.nan]), "num_features") is None
    one = plotting.errorbar_summary(ax, summary([1.0]).isel(num_features=0), [2.0], linestyle="-")
    assert one.lines[0].get_linestyle() == "None"                         # a single point joins nothing
    with pytest.raises(ValueError, match="one position per entry"):
        plotting.errorbar_summary(ax, summary([1.0, 2.0]), [1.0])


def test_reference_band_and_kv_cache_marker():
    _, ax = axes()
    exact = summary([0.8], lo=[0.7], hi=[0.9]).isel(num_features=0)
    assert plotting.reference_band(ax, exact) == 0.8
    assert ax.get_legend_handles_labels()[1] == ["exact attention (same inputs)"]
    _, ax = axes()
    star = plotting.kv_cache_marker(ax, 4096.0, exact)
    np.testing.assert_array_equal(star.lines[0].get_xdata(), [4096.0])
    assert star.lines[0].get_marker() == "*"
    assert any(np.allclose(line.get_xdata(), 4096.0) for line in ax.lines if line is not star.lines[0])


def test_log_axis_writes_plain_numbers_or_bytes():
    _, ax = axes()
    plotting.log_axis(ax, label="r")
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "r"
    assert ax.xaxis.get_major_formatter()(64.0, 0) == "64"
    plotting.log_axis(ax, "y", unit="bytes")
    assert ax.yaxis.get_major_formatter()(2048.0, 0) == "2 KiB"
    with pytest.raises(ValueError, match="which"):
        plotting.log_axis(ax, "z")
    with pytest.raises(ValueError, match="unit"):
        plotting.log_axis(ax, unit="KiB")


def test_floor_ylim_raises_the_lower_limit_only_when_the_data_reach_below_it():
    _, ax = axes()
    ax.set_yscale("log")
    ax.set_ylim(1e-15, 10)
    plotting.floor_ylim(ax, 1e-3)
    assert ax.get_ylim() == pytest.approx((1e-3, 10))
    ax.set_ylim(1e-2, 10)
    plotting.floor_ylim(ax, 1e-3)
    assert ax.get_ylim() == pytest.approx((1e-2, 10))


def test_legends_collect_each_label_once():
    fig, (a, b) = plotting.new_figure(1, 2)
    a.plot([1, 2], [1, 2], label="x")
    b.plot([1, 2], [2, 1], label="x")
    b.plot([1, 2], [3, 1], label="y")
    handles, labels = plotting.legend_entries([a, b])
    assert labels == ["x", "y"] and len(handles) == 2
    legend = plotting.figure_legend(fig, np.array([a, b]))
    assert [t.get_text() for t in legend.get_texts()] == ["x", "y"]
    empty, c = plotting.new_figure()
    assert plotting.figure_legend(empty, [c]) is None
    below = plotting.legend_below(b)
    assert [t.get_text() for t in below.get_texts()] == ["x", "y"]


def test_proxy_legend_keys_encodings_not_artists():
    _, ax = axes()
    legend = plotting.proxy_legend(ax, {"sum": {"marker": "o"}, "delta": {"marker": "s", "color": "r"}}, off=True)
    assert [t.get_text() for t in legend.get_texts()] == ["sum", "delta"]
    assert [h.get_marker() for h in legend.legend_handles] == ["o", "s"]
    assert not ax.axison and not ax.lines                                   # nothing drawn on the axes


def test_findings_formats():
    s = summary([0.5, 0.25], lo=[0.4, 0.2], hi=[0.6, 0.3], dim="estimator", coords=("a", "b"))
    assert plotting.fmt_cis(s, "estimator") == "`a` 0.5 (0.4–0.6); `b` 0.25 (0.2–0.3)"
    assert plotting.fmt_cis(s, "estimator", ["b"], names=str.upper) == "B 0.25 (0.2–0.3)"
    tail = s.isel(estimator=0).copy()
    tail.loc[{"stat": ["tail", "tail_lo", "tail_hi"]}] = [0.125, 0.05, 0.25]
    assert plotting.fmt_ci(tail, percent=True, entry="tail") == "12.5 % (5–25 %)"
    assert plotting.fmt_bytes(640) == "640 B"
    assert plotting.fmt_bytes(1536) == "1.5 KiB"
    assert plotting.fmt_bytes(3 * 2**20) == "3 MiB"


def test_estimator_lines_draw_each_estimator_in_its_house_style_with_the_reference_slope():
    _, ax = axes()
    s = xr.concat([summary([1.0, 0.7, 0.5, 0.35]), summary([2.0, 1.4, 1.0, 0.7]), summary([np.nan] * 4)],
                  dim=xr.DataArray(["positive", "trig", "gerf"], dims="estimator"))
    drawn = plotting.estimator_lines(ax, s, ["positive", "trig", "gerf"], slope=-0.5,
                                     styles={"trig": {"color": "black"}})
    assert drawn == ["positive", "trig"]                                  # nothing to draw for gerf
    lines = {line.get_label(): line for line in ax.lines}
    assert lines["positive"].get_color() == plotting.estimator_style("positive")["color"]
    assert lines["trig"].get_color() == "black"
    slope = lines[r"$\propto r^{-1/2}$"]
    np.testing.assert_allclose(slope.get_ydata()[0], 1.5 * 1.5)            # 1.5 × the median first estimate
    np.testing.assert_allclose(slope.get_ydata()[-1], 1.5 * 1.5 * (64 / 8) ** -0.5)


def test_finite_values_are_the_cells_a_finding_can_quote():
    s = summary([1.0, np.nan, np.inf, 0.5], dim="estimator", coords=("a", "b", "c", "d"))
    assert plotting.finite_values(s, "estimator") == ["a", "d"]
    assert all(type(v) is str for v in plotting.finite_values(s, "estimator"))
    with pytest.raises(ValueError, match="along 'seed' only"):
        plotting.finite_values(s, "seed")
