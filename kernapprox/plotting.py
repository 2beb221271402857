"""One house style for every figure: seaborn's whitegrid theme, log–log error-vs-rank axes, medians with
intervals, reference slopes, theory overlays, captions drawn under the figure, and the findings' number format.

Figures are pure functions of result datasets (they never recompute an estimator). The summaries a figure draws
are stored in the dataset (:mod:`kernapprox.stats`: a ``stat`` dimension with ``estimate``, ``lo``, ``hi``, ...);
:func:`plot_summary` draws one as a line with its interval as a band, :func:`errorbar_summary` as markers with
bars, both leaving out the cells that did not run; :func:`reference_band` and :func:`kv_cache_marker` draw exact
attention beside them (across a panel; on a memory axis, at its KV cache); :func:`log_axis`, :func:`floor_ylim`,
:func:`figure_legend`, :func:`legend_below` and :func:`proxy_legend` are the axes and legends the studies share.
``median_band`` (medians and percentile bands computed in xarray, not by seaborn's estimators, so that bands on
log axes are bands of the data) stays for quick looks. Findings texts format their numbers with :func:`fmt`,
sizes with :func:`fmt_bytes`, intervals with :func:`fmt_ci` and lists of them with :func:`fmt_cis`, so every
study writes them alike.

>>> import numpy as np, tempfile, xarray as xr
>>> from kernapprox.plotting import (estimator_style, loglog_rank_axes, median_band, new_figure,
...                                  reference_slope, save_figure)
>>> r = [8, 16, 32, 64]
>>> err = xr.DataArray(np.random.default_rng(0).lognormal(size=(4, 5)) / np.sqrt(r)[:, None],
...                    coords={"num_features": r, "seed": range(5)}, dims=("num_features", "seed"))
>>> fig, ax = new_figure()
>>> med, lo, hi = median_band(err, dim="seed")                   # medians and 10/90 % quantiles over seeds
>>> _ = ax.plot(med.num_features, med, **estimator_style("positive"))
>>> _ = ax.fill_between(med.num_features, lo, hi, alpha=0.2)
>>> loglog_rank_axes(ax)
>>> _ = reference_slope(ax, med.num_features.values, float(med[0]))
>>> with tempfile.TemporaryDirectory() as tmp:
...     save_figure(fig, f"{tmp}/x.png", "What is plotted, over what, with which band.")
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import textwrap
import warnings
import zlib
from pathlib import Path

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib import ticker
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

FAMILY_COLORS = {  # one hue per estimator family, the same in every figure
    "trig": "#0173b2", "positive": "#de8f05", "hyperbolic": "#029e73", "maclaurin": "#56b4e9",
    "gerf": "#d55e00", "oprf": "#cc78bc", "sderf": "#8c564b", "aderf": "#7b3294", "saderf": "#b8a000",
    "nystrom": "#ca9161", "nystromformer": "#a6761d", "scatterbrain": "#1b3a6b", "window": "#6a6a6a",
    "taylor2": "#e7298a", "elu1": "#66a61e", "dpfp": "#a6cee3", "lowrank": "#000000", "exact": "#949494",
    "hedgehog": "#c51b1b", "lara": "#17becf", "eva": "#9467bd", "kernel": "#000000", "attention": "#595959",
}
VARIANT_STYLES = {  # one line style and marker per projection sampler or named variant
    "iid": ("-", "o"), "orthogonal": ("--", "s"), "qmc": (":", "^"), "sorf": ("-.", "D"),
    "regularized": ((0, (1, 1)), "v"), "halton": ((0, (3, 1, 1, 1)), "P"),
    "uniform": ("-", "o"), "kmeans": ("--", "s"), "rls": (":", "^"), "linear": ("--", "*"), "exact": (":", "x"),
    "optimal": ("-", None), "based": ("--", "d"),
}
_EXTRA_STYLES = [("-", "X"), ("--", "*"), (":", "p"), ("-.", "h"), ((0, (5, 1)), "<"), ((0, (1, 2)), ">")]
_EXTRA_COLORS = sns.color_palette("dark", 10).as_hex()


def house_style() -> None:
    """Apply the project's matplotlib/seaborn theme (idempotent)."""
    sns.set_theme(style="whitegrid", context="paper", palette="colorblind", rc={
        "figure.dpi": 110, "savefig.dpi": 150, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 7.5,
        "xtick.labelsize": 8, "ytick.labelsize": 8, "lines.linewidth": 1.4, "lines.markersize": 4,
        "grid.linewidth": 0.5, "axes.titleweight": "bold"})


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float | None = None, height: float | None = None,
               sharex: bool | str = False, sharey: bool | str = False, squeeze: bool = True):
    """A ``Figure`` (no pyplot state) in the house style with a grid of axes: ``(fig, axes)``."""
    house_style()
    fig = Figure(figsize=(width or 3.4 * ncols + 0.6, height or 2.8 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=sharex, sharey=sharey, squeeze=squeeze)
    return fig, axes


def palette(values, name: str = "colorblind", *, trim: int = 0) -> dict:
    """One colour (hex) per value, in order, from the seaborn palette ``name``; ``trim`` leaves out that many
    colours at each end (the palest and darkest of a sequential palette such as ``"rocket"``)."""
    values = list(values)
    colors = sns.color_palette(name, len(values) + 2 * trim).as_hex()
    return dict(zip(values, colors[trim:trim + len(values)]))


def split_estimator_name(name: str) -> tuple[str, str]:
    """``"positive_orthogonal"`` → ``("positive", "orthogonal")``; a bare family name has variant ``"iid"``."""
    family, _, variant = name.partition("_")
    return family, variant or "iid"


def estimator_style(name: str) -> dict:
    """Line keywords for an estimator: colour from its family, line style and marker from its sampler/variant,
    identical in every figure."""
    family, variant = split_estimator_name(name)
    color = FAMILY_COLORS.get(family) or _EXTRA_COLORS[zlib.crc32(family.encode()) % len(_EXTRA_COLORS)]
    linestyle, marker = VARIANT_STYLES.get(variant) or _EXTRA_STYLES[zlib.crc32(variant.encode()) %
                                                                      len(_EXTRA_STYLES)]
    return {"color": color, "linestyle": linestyle, "marker": marker, "label": name}


def median_band(da: xr.DataArray, dim: str = "seed", q: tuple[float, float] = (0.1, 0.9),
                method: str = "linear") -> tuple[xr.DataArray, xr.DataArray, xr.DataArray]:
    """Median and the ``q`` percentile band of ``da`` over ``dim`` (NaN cells are skipped; a slice that is all
    NaN gives NaN). ``inf`` values count as the largest values."""
    if dim not in da.dims:
        raise ValueError(f"dim {dim!r} is not a dimension of {da.name!r}; dims: {da.dims}")
    lo_q, hi_q = q
    if not 0 <= lo_q < 0.5 < hi_q <= 1:
        raise ValueError(f"q must satisfy 0 <= q[0] < 0.5 < q[1] <= 1, got {q}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: cells that have not run
        quant = da.quantile([lo_q, 0.5, hi_q], dim=dim, skipna=True, method=method)
    return quant.sel(quantile=0.5, drop=True), quant.sel(quantile=lo_q, drop=True), quant.sel(quantile=hi_q,
                                                                                                drop=True)


def _summary(summary: xr.DataArray) -> xr.DataArray:
    if "stat" not in summary.dims or list(summary["stat"].values[:3]) != ["estimate", "lo", "hi"]:
        raise ValueError(f"{summary.name!r} is not a summary (a 'stat' dimension starting estimate, lo, hi; see "
                         "kernapprox.stats)")
    return summary


def plot_summary(ax, summary: xr.DataArray, x: str | None = None, *, band_alpha: float = 0.18, xvalues=None,
                 positive: bool = False, **line_kw):
    """Draw a stored summary against coordinate ``x`` (or against ``xvalues``): its estimate as a line and its
    ``lo``–``hi`` interval as a band of the line's colour. Points where the estimate or ``x`` is NaN are left out
    (a gap); ``inf`` is drawn as a gap too; ``positive`` (for log axes) also leaves out estimates ≤ 0 and keeps
    the band above zero. A single point left is drawn as a marker with its interval as a bar (a line of one point
    would not show). Returns the line (``None`` if nothing is finite)."""
    summary = _summary(summary)
    xs = np.asarray(summary[x].values if xvalues is None else xvalues, dtype=float)
    est, lo, hi = (np.asarray(summary.sel(stat=s).values, dtype=float) for s in ("estimate", "lo", "hi"))
    if est.ndim != 1 or est.shape != xs.shape:
        raise ValueError(f"plot_summary needs a 1-D summary along {x!r}, got dims {summary.dims}")
    keep = np.isfinite(est) & np.isfinite(xs) & ((est > 0) if positive else True)
    if not keep.any():
        return None
    if keep.sum() == 1:
        style = {**line_kw, "marker": line_kw.get("marker") or "o", "markersize": 7, "linestyle": "none"}
        along = next(d for d in summary.dims if d != "stat")
        return errorbar_summary(ax, summary.isel({along: np.flatnonzero(keep)}), xs[keep], **style)[0]
    (line,) = ax.plot(xs[keep], est[keep], **line_kw)
    band = keep & np.isfinite(lo)
    low = np.maximum(lo[band], np.finfo(float).tiny) if positive else lo[band]
    ax.fill_between(xs[band], low, np.where(np.isfinite(hi[band]), hi[band], np.nanmax(est[keep]) * 1e3),
                    color=line.get_color(), alpha=band_alpha, linewidth=0)
    return line


def _entries(entry: str) -> tuple[str, str, str]:
    """The stat names of an interval: ``estimate, lo, hi``, or ``<entry>, <entry>_lo, <entry>_hi`` (the tail)."""
    return ("estimate", "lo", "hi") if entry == "estimate" else (entry, f"{entry}_lo", f"{entry}_hi")


def estimator_lines(ax, summary: xr.DataArray, names, x: str = "num_features", *, dim: str = "estimator",
                    styles=None, slope: float | None = None, **line_kw) -> list:
    """:func:`plot_summary` of ``summary.sel({dim: name})`` against ``x`` for each of ``names``, in the house style
    of each (:func:`estimator_style`, updated by ``styles[name]`` and ``line_kw``); with ``slope``, also the
    reference line ``∝ x^slope`` (:func:`reference_slope`) through 1.5 times the median first estimate of the
    lines drawn. Returns the names that have a line."""
    drawn = [name for name in names if plot_summary(ax, summary.sel({dim: name}), x, **{
        **estimator_style(str(name)), **(styles or {}).get(name, {}), **line_kw}) is not None]
    if slope is not None and drawn:
        first = summary.sel({dim: drawn, "stat": "estimate"}).isel({x: 0})
        reference_slope(ax, summary[x].values, 1.5 * float(first.median()), slope=slope)
    return drawn


def errorbar_summary(ax, summary: xr.DataArray, x, *, entry: str = "estimate", **kw):
    """Markers at a summary's estimates with ``lo``–``hi`` bars (``x``: positions or a coordinate name;
    ``entry="tail"``: the tail fraction with its interval). Points whose estimate or position is not finite are
    left out; a bound that is not finite (NaN: not computed, ``inf``: unbounded) draws no bar on that side; one
    point left is drawn without a joining line.
    Returns the ``ErrorbarContainer`` (``None`` if nothing is finite)."""
    summary = _summary(summary)
    xs = np.asarray(summary[x].values if isinstance(x, str) else x, dtype=float)
    est, lo, hi = (np.asarray(summary.sel(stat=s).values, dtype=float) for s in _entries(entry))
    if np.ndim(est) == 0:
        xs, est, lo, hi = (np.atleast_1d(v) for v in (xs, est, lo, hi))
    if est.ndim != 1 or xs.shape != est.shape:
        raise ValueError(f"errorbar_summary needs a 1-D summary with one position per entry, got dims "
                         f"{summary.dims} and {xs.size} positions")
    keep = np.isfinite(est) & np.isfinite(xs)
    if not keep.any():
        return None
    style = {"linestyle": "none", "capsize": 2, "elinewidth": 0.8, **kw}
    if keep.sum() == 1:
        style["linestyle"] = "none"
    below, above = est[keep] - lo[keep], hi[keep] - est[keep]
    bars = [np.where(np.isfinite(below), below, 0.0), np.where(np.isfinite(above), above, 0.0)]
    return ax.errorbar(xs[keep], est[keep], yerr=bars, **style)


def reference_band(ax, summary: xr.DataArray, label: str = "exact attention (same inputs)", **kw) -> float:
    """A reference's summary (exact attention's score) across the panel: its estimate as a dashed line and its
    interval as a grey band; returns the estimate."""
    est, lo, hi = (float(summary.sel(stat=k)) for k in ("estimate", "lo", "hi"))
    style = {"color": estimator_style("exact")["color"], "linestyle": "--", "linewidth": 1.2, **kw}
    ax.axhline(est, label=label, **style)
    ax.axhspan(lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    return est


def kv_cache_marker(ax, kv_bytes: float, summary: xr.DataArray, label: str = "exact (KV cache)", **kw):
    """Exact attention on a memory axis: a star at its KV cache's size (bytes) with its score's interval as a bar,
    and a dotted vertical line there, the memory every fixed-size state is measured against."""
    ax.axvline(kv_bytes, color="0.6", linewidth=0.8, linestyle=":")
    style = {"marker": "*", "markersize": 10, "color": "k", "label": label, **kw}
    return errorbar_summary(ax, summary, [float(kv_bytes)], **style)


def log_axis(ax, which: str = "x", *, base: int = 2, label: str | None = None, unit: str | None = None) -> None:
    """A logarithmic axis with its major ticks written as plain numbers (``unit="bytes"``: as B, KiB, MiB); minor
    ticks keep matplotlib's labels."""
    if which not in ("x", "y"):
        raise ValueError(f"which must be 'x' or 'y', got {which!r}")
    if unit not in (None, "bytes"):
        raise ValueError(f"unit must be None or 'bytes', got {unit!r}")
    getattr(ax, f"set_{which}scale")("log", base=base)
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(ticker.FuncFormatter(fmt_bytes if unit else lambda v, _: f"{v:g}"))
    if unit:                                  # sizes span many powers of two: label every few (the text is long)
        axis.set_major_locator(ticker.LogLocator(base=base, numticks=6))
    if label:
        getattr(ax, f"set_{which}label")(label)


def floor_ylim(ax, bottom: float) -> None:
    """Raise the lower limit of a log axis to ``bottom`` when the data reach below it (exact reproductions, errors
    of 1e-15, would otherwise stretch the axis over decades of nothing)."""
    low, high = ax.get_ylim()
    if low < bottom < high:
        ax.set_ylim(bottom, high)


def legend_entries(axes) -> tuple[list, list]:
    """``(handles, labels)`` of all the axes' labelled artists, each label once, in drawing order."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    return handles, labels


def figure_legend(fig, axes, **kw):
    """One legend for the whole figure from the entries of ``axes`` (no label twice), outside the panels on the
    right by default; ``None`` if nothing is labelled."""
    handles, labels = legend_entries(np.ravel(axes))
    if not handles:
        return None
    return fig.legend(handles, labels, **{"loc": "outside right center", "fontsize": 7, "frameon": False, **kw})


def proxy_legend(ax, entries, *, off: bool = False, **kw):
    """A legend of encodings rather than of drawn artists: ``entries`` maps each label to the line keywords of its
    key (``{"sum": {"marker": "o", "color": "0.3"}, ...}``), e.g. colour for the estimator and marker for the rule.
    ``off`` turns the axes off first (a panel that holds the legend only, centred)."""
    if off:
        ax.axis("off")
        kw = {"loc": "center", "frameon": False, **kw}
    handles = [Line2D([], [], **{"color": "0.3", **style}) for style in entries.values()]
    return ax.legend(handles, [str(label) for label in entries], **kw)


def legend_below(ax, ncol: int = 2, **kw):
    """The panel's legend under its axes, without a frame (for the last row of a grid of panels)."""
    return ax.legend(**{"ncol": ncol, "loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "fontsize": 6.5,
                        "frameon": False, **kw})


# ------------------------------------------------------------------------------------------- findings text
def fmt(value, digits: int = 3) -> str:
    """A number for a findings sentence: ``digits`` significant digits, plain between 1e-3 and 1e5, otherwise
    ``a·10^b``, with a true minus sign; ``inf`` and NaN are spelled out. The same value always gives the same
    text."""
    value = float(value)
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        text = f"{value:.{digits}g}"
        text = text if "e" not in text else f"{value:.0f}"
    else:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        text = f"{mantissa}·10^{int(exponent)}"
    return text.replace("-", "−")


def _percent_number(value: float) -> str:
    p = 100.0 * value
    if p == 0:
        return "0"
    if abs(p) >= 1:
        return f"{p:.1f}".rstrip("0").rstrip(".")
    return fmt(p, 2)


def fmt_pct(value) -> str:
    """A fraction as a percentage for a findings sentence (``0.125`` → ``12.5 %``; one decimal from 1 % up)."""
    value = float(value)
    return "n/a" if math.isnan(value) else f"{_percent_number(value)} %"


def fmt_ci(summary: xr.DataArray, digits: int = 3, *, percent: bool = False, entry: str = "estimate") -> str:
    """``estimate (lo–hi)`` of one summary entry (a 0-d selection with a ``stat`` dimension); ``percent`` writes
    fractions as percentages (``12.5 % (9.1–16.4 %)``); ``entry="tail"`` writes the tail fraction with its
    interval (``tail (tail_lo–tail_hi)``, :func:`kernapprox.stats.summarise`)."""
    summary = _summary(summary)
    est, lo, hi = (float(summary.sel(stat=s)) for s in _entries(entry))
    if percent:
        return f"{fmt_pct(est)} ({_percent_number(lo)}–{_percent_number(hi)} %)"
    sep = " to " if lo < 0 else "–"
    while digits < 6 and len({fmt(v, digits) for v in (est, lo, hi)}) < len({est, lo, hi}):
        digits += 1                              # e.g. 1 (0.99982–1), not 1 (1–1)
    return f"{fmt(est, digits)} ({fmt(lo, digits)}{sep}{fmt(hi, digits)})"


def fmt_cis(summary: xr.DataArray, dim: str, values=None, *, digits: int = 3, percent: bool = False,
            sep: str = "; ", names=None) -> str:
    """``"`a` est (lo–hi); `b` est (lo–hi)"``: :func:`fmt_ci` of ``summary`` at each value of ``dim`` (all of them
    by default), each named (``names``: value -> text; default the value in backticks)."""
    values = [v.item() if hasattr(v, "item") else v for v in (summary[dim].values if values is None else values)]
    name = names or (lambda v: f"`{v}`")
    return sep.join(f"{name(v)} {fmt_ci(summary.sel({dim: v}), digits, percent=percent)}" for v in values)


def finite_values(summary: xr.DataArray, dim: str) -> list:
    """The values of ``dim`` at which a summary has a finite estimate (in order): the cells a finding can quote,
    leaving out those that did not run or do not apply."""
    est = _summary(summary).sel(stat="estimate")
    if est.dims != (dim,):
        raise ValueError(f"finite_values needs a summary along {dim!r} only, got dims {summary.dims}")
    return [v.item() if hasattr(v, "item") else v for v, e in zip(summary[dim].values, est.values) if np.isfinite(e)]


def fmt_bytes(value, _=None) -> str:
    """A memory size for a sentence or an axis tick: ``512 B``, ``1.5 KiB``, ``3 MiB`` (3 significant digits)."""
    value = float(value)
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{fmt(value / size)} {unit}"
    return f"{fmt(value)} B"


def bullets(lines) -> str:
    """Markdown bullets, one per non-empty line (the findings' format)."""
    return "\n".join(f"- {' '.join(str(line).split())}" for line in lines if line)


_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("figure_source", default=None)


@contextlib.contextmanager
def figure_source(text: str):
    """While active, :func:`save_figure` stores ``text`` (the dataset and its digest) in the PNG's ``Source``."""
    token = _SOURCE.set(text)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def loglog_rank_axes(ax, xlabel: str = "number of features r", ylabel: str | None = None, base: int = 2) -> None:
    """Log–log axes for error against rank: powers of ``base`` on x written as plain numbers."""
    ax.set_xscale("log", base=base)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.grid(True, which="major", linewidth=0.6)
    ax.grid(True, which="minor", linewidth=0.3, alpha=0.5)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)


def reference_slope(ax, x, y0: float, slope: float = -0.5, label: str | None = None, **kw):
    """A dashed grey line ``y = y0 · (x / x[0])^slope`` (default ``m^{-1/2}``, the Monte Carlo rate)."""
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.size < 2 or not np.all(x > 0):
        raise ValueError("x must be a 1-D array of at least two positive values")
    if label is None:
        label = r"$\propto r^{-1/2}$" if slope == -0.5 else rf"$\propto r^{{{slope:g}}}$"
    style = {"color": "0.35", "linestyle": (0, (4, 3)), "linewidth": 1.0, "zorder": 1, **kw}
    (line,) = ax.plot(x, y0 * (x / x[0]) ** slope, label=label, **style)
    return line


def identity_line(ax, lo: float, hi: float, label: str = "empirical = theory", **kw):
    """The line ``y = x`` over ``[lo, hi]`` (theory overlays on empirical-vs-theory plots)."""
    style = {"color": "0.2", "linestyle": "-", "linewidth": 0.9, "zorder": 1, **kw}
    (line,) = ax.plot([lo, hi], [lo, hi], label=label, **style)
    return line


def save_figure(fig: Figure, path, caption: str, *, title: str | None = None, width_chars: int | None = None) -> None:
    """Draw ``caption`` under the figure, then write a PNG atomically with the caption in its metadata.

    The caption says what is plotted (quantity, band, data, grid); ``title`` (default: the figure's suptitle)
    goes into the PNG's ``Title``.
    """
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("caption must be a non-empty string saying what is plotted")
    from . import __version__

    path = Path(path)
    width_in = fig.get_figwidth()
    wrapped = textwrap.fill(" ".join(caption.split()), width=width_chars or int(width_in * 15.5))
    fig.text(0.01, 0.0, wrapped, ha="left", va="top", fontsize=7.5, color="0.15", wrap=False,
             transform=fig.transFigure)
    if title is None and fig._suptitle is not None:
        title = fig._suptitle.get_text()
    metadata = {"Title": title or path.stem, "Description": " ".join(caption.split()),
                "Software": f"kernapprox {__version__}"}
    if _SOURCE.get() is not None:
        metadata["Source"] = _SOURCE.get()
    path.parent.mkdir(parents=True, exist_ok=True)
    from .io import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", metadata=metadata, bbox_inches="tight",
                                               pad_inches=0.08))
