"""One house style for every figure: seaborn's whitegrid theme, log–log error-vs-rank axes, medians with
percentile bands computed in xarray, reference slopes, theory overlays and captions drawn under the figure.

Figures are pure functions of result datasets (they never recompute an estimator). Summary statistics are
computed here with xarray (``median_band``), not by seaborn's estimators, so that bands on log axes are bands of
the data, not of its logarithm's mean.

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

import textwrap
import warnings
import zlib
from pathlib import Path

import numpy as np
import seaborn as sns
import xarray as xr
from matplotlib import ticker
from matplotlib.figure import Figure

FAMILY_COLORS = {  # one hue per estimator family, the same in every figure
    "trig": "#0173b2", "positive": "#de8f05", "hyperbolic": "#029e73", "maclaurin": "#56b4e9",
    "gerf": "#d55e00", "oprf": "#cc78bc", "sderf": "#8c564b", "aderf": "#7b3294", "saderf": "#b8a000",
    "nystrom": "#ca9161", "nystromformer": "#a6761d", "scatterbrain": "#1b3a6b", "window": "#6a6a6a",
    "taylor2": "#e7298a", "elu1": "#66a61e", "dpfp": "#a6cee3", "lowrank": "#000000", "exact": "#949494",
    "hedgehog": "#c51b1b",
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


def plot_median_band(ax, da: xr.DataArray, x: str, dim: str = "seed", q=(0.1, 0.9), band_alpha: float = 0.18,
                     **line_kw):
    """Plot the median of ``da`` over ``dim`` against coordinate ``x`` with its percentile band."""
    med, lo, hi = median_band(da, dim=dim, q=q)
    xs = med[x].values
    (line,) = ax.plot(xs, med.values, **line_kw)
    ax.fill_between(xs, lo.values, hi.values, color=line.get_color(), alpha=band_alpha, linewidth=0)
    return line


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
    path.parent.mkdir(parents=True, exist_ok=True)
    from .io import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", metadata=metadata, bbox_inches="tight",
                                               pad_inches=0.08))
