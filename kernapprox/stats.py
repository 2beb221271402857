"""Summaries with 95 % intervals for the studies: what every plotted number and every stated finding is made of.

The studies store per-draw values (one per seed, or per seed and episode) and summarise them here, so that every
number a figure draws or a finding states comes with its uncertainty. One convention for all of them:

A *summary* is a DataArray with a ``stat`` dimension whose coordinate is always :data:`STATS` (one coordinate
for every summary of a dataset, so summaries of different kinds sit side by side):

``estimate``
    the point estimate (the median, a proportion, or a mean — named in the variable's ``statistic`` attribute),
``lo``, ``hi``
    the bounds of its ``level`` interval (default 95 %), described in the ``interval`` attribute,
``q10``, ``q90``, ``tail``, ``tail_lo``, ``tail_hi``
    quantiles of the draws and the share of draws above a threshold with its interval (:func:`summarise`),
``count``
    valid draws; ``successes``, ``trials`` for proportions (:func:`proportion_summary`),
``below``, ``below_lo``, ``below_hi``
    the share of draws below the baseline in a paired comparison (:func:`paired_summary`).

Entries a kind of summary does not compute are NaN. Attributes ``statistic``, ``interval``, ``level`` and
``over`` (the pooled dimensions, comma separated) say what was computed. :func:`describe_summaries` writes the
dataset-level ``stat_convention`` text.

Intervals
---------
*Percentile bootstrap* (:func:`bootstrap_interval`): ``resamples`` resamples with replacement of the valid
(non-NaN) draws of each slice, the statistic of each, and the ``(1 − level)/2`` and ``(1 + level)/2`` quantiles
of those values (Efron & Tibshirani 1993, ch. 13). The resample indices come from
``numpy.random.default_rng([seed, m])`` for a slice of ``m`` valid draws, so a summary is a deterministic function
of its data (the same text on every run) and does not depend on the order in which slices are visited.
*Clopper–Pearson* (:func:`binomial_interval`): the exact binomial interval, for proportions of independent
trials (Clopper & Pearson 1934, Biometrika 26:404).

Heavy tails
-----------
Random-feature errors are heavy-tailed: a mean over a few draws says little. :func:`summarise` therefore gives
the median with its bootstrap interval, the 10 % and 90 % quantiles of the draws and the *tail fraction*, the
share of draws above a threshold (``P(relative error > 1)`` by default: an error as large as the quantity itself),
with its Clopper–Pearson interval.

Examples
--------
>>> import numpy as np, xarray as xr
>>> from kernapprox import stats
>>> err = xr.DataArray(np.random.default_rng(0).lognormal(-1.0, 1.0, size=(3, 40)),
...                    dims=("estimator", "seed"), coords={"estimator": ["a", "b", "c"]})
>>> s = stats.summarise(err, "seed")
>>> s.stat.values.tolist()[:9]
['estimate', 'lo', 'hi', 'q10', 'q90', 'tail', 'tail_lo', 'tail_hi', 'count']
>>> bool((s.sel(stat="lo") <= s.sel(stat="estimate")).all() and (s.sel(stat="estimate") <= s.sel(stat="hi")).all())
True
>>> lo, hi = stats.binomial_interval(8, 10)
>>> round(float(lo), 4), round(float(hi), 4)
(0.4439, 0.9748)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import xarray as xr
from scipy import stats as _scipy_stats

__all__ = ["LEVEL", "BOOTSTRAP_SEED", "RESAMPLES", "STATS",
           "bootstrap_interval", "binomial_interval", "summarise", "proportion_summary", "paired",
           "paired_summary", "describe_summaries", "is_summary", "unit_values", "cluster_interval", "paired_test",
           "holm", "verdict", "MIN_UNITS", "interval_note", "range_summary", "partial_spearman"]

LEVEL = 0.95
BOOTSTRAP_SEED = 0
RESAMPLES = 2000
STATS = ("estimate", "lo", "hi", "q10", "q90", "tail", "tail_lo", "tail_hi", "count", "successes", "trials",
         "below", "below_lo", "below_hi")
BOOTSTRAP_STATS = ("estimate", "lo", "hi", "count")

_STATISTICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "median": lambda x: np.median(x, axis=-1),
    "mean": lambda x: np.mean(x, axis=-1),
}


# ------------------------------------------------------------------------------------------------ checks
def _check_level(level) -> float:
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0.0 < level < 1.0:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    return float(level)


def _check_dims(da: xr.DataArray, dims) -> tuple[str, ...]:
    if not isinstance(da, xr.DataArray):
        raise TypeError(f"da must be an xarray.DataArray, got {type(da).__name__}")
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    if not dims:
        raise ValueError("dims must name at least one dimension to summarise over")
    missing = [d for d in dims if d not in da.dims]
    if missing:
        raise ValueError(f"dims {missing} are not dimensions of {da.name or 'the array'}; its dims: {da.dims}")
    return dims


def _statistic(statistic) -> Callable[[np.ndarray], np.ndarray]:
    if callable(statistic):
        return statistic
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(_STATISTICS)} or a callable reducing the last axis, "
                         f"got {statistic!r}")
    return _STATISTICS[statistic]


def _pooled(da: xr.DataArray, dims: tuple[str, ...]) -> tuple[xr.DataArray, np.ndarray]:
    """``da`` with ``dims`` moved last and flattened: ``(template without dims, values (..., m))``."""
    rest = [d for d in da.dims if d not in dims]
    values = np.asarray(da.transpose(*rest, *dims).values, dtype=np.float64)
    values = values.reshape(values.shape[:len(rest)] + (-1,))
    template = da.isel({d: 0 for d in dims}, drop=True)
    return template, values


@functools.lru_cache(maxsize=64)
def _indices(seed: int, m: int, resamples: int) -> np.ndarray:
    """Resample indices ``(resamples, m)`` for a slice of ``m`` valid draws (deterministic in seed and m)."""
    return np.random.default_rng([seed, m]).integers(0, m, size=(resamples, m))


def _bootstrap(values: np.ndarray, fn, level: float, seed: int, resamples: int) -> np.ndarray:
    """``(..., 4)``: estimate, lo, hi, count of each slice of ``values (..., m)``; NaN draws are left out."""
    flat = values.reshape(-1, values.shape[-1])
    out = np.full((flat.shape[0], 4), np.nan)
    tails = ((1.0 - level) / 2.0, (1.0 + level) / 2.0)
    for i, row in enumerate(flat):
        valid = row[~np.isnan(row)]
        m = valid.size
        out[i, 3] = m
        if m == 0:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            out[i, 0] = fn(valid[None, :])[0]
            boot = fn(valid[_indices(seed, m, resamples)])
        if np.isnan(boot).any():
            out[i, 1:3] = np.nan
        else:                          # ±inf statistics (inf draws) stay infinite instead of turning NaN
            big = np.finfo(np.float64).max
            q = np.quantile(np.clip(boot, -big, big), tails, method="linear")
            out[i, 1:3] = np.where(q >= big, np.inf, np.where(q <= -big, -np.inf, q))
    return out.reshape(values.shape[:-1] + (4,))


def _with_stat(template: xr.DataArray, data: np.ndarray, stats: Sequence[str], attrs: dict) -> xr.DataArray:
    """A summary on the common :data:`STATS` coordinate: ``data (..., len(stats))`` in the entries ``stats``,
    NaN in the others."""
    full = np.full(data.shape[:-1] + (len(STATS),), np.nan)
    full[..., [STATS.index(s) for s in stats]] = data
    out = xr.DataArray(full, dims=(*template.dims, "stat"),
                       coords={**{k: v for k, v in template.coords.items()}, "stat": list(STATS)}, attrs=attrs)
    out.name = template.name
    return out


# --------------------------------------------------------------------------------------------- intervals
def bootstrap_interval(da: xr.DataArray, dims, statistic="median", *, level: float = LEVEL,
                       seed: int = BOOTSTRAP_SEED, resamples: int = RESAMPLES) -> xr.DataArray:
    """Percentile-bootstrap interval of ``statistic`` over the draws pooled along ``dims``.

    Parameters
    ----------
    da : xarray.DataArray
        Per-draw values; NaN marks a draw that did not run (left out). ``inf`` counts as the largest value.
    dims : str or sequence of str
        The dimensions whose entries are the independent draws (e.g. ``"seed"`` or ``("seed", "episode")``).
    statistic : {"median", "mean"} or callable
        A callable reduces the last axis of a ``(resamples, m)`` array.
    level : float
        Coverage of the interval.
    seed, resamples : int
        The bootstrap's fixed seed and number of resamples.

    Returns
    -------
    xarray.DataArray
        ``da``'s other dimensions plus ``stat`` (:data:`STATS`): ``estimate``, ``lo``, ``hi`` and ``count``, the
        number of valid draws. Slices without any valid draw are NaN.

    Notes
    -----
    Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), §13.3 (percentile interval). With ``m`` draws
    the median's interval cannot be wider than the range of the draws: with 5 seeds it is about the range.
    """
    dims = _check_dims(da, dims)
    level = _check_level(level)
    fn = _statistic(statistic)
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an integer >= 100, got {resamples!r}")
    template, values = _pooled(da, dims)
    data = _bootstrap(values, fn, level, int(seed), resamples)
    name = statistic if isinstance(statistic, str) else getattr(statistic, "__name__", "statistic")
    return _with_stat(template, data, BOOTSTRAP_STATS, {
        **_kept_attrs(da), "statistic": name, "level": level, "over": ", ".join(dims),
        "interval": f"{level:.0%} percentile bootstrap of the {name} over {', '.join(dims)} ({resamples} resamples, "
                    f"bootstrap seed {seed})"})


def binomial_interval(successes, trials, level: float = LEVEL):
    """Exact (Clopper–Pearson) ``level`` interval of a binomial proportion: ``(lo, hi)``.

    ``lo = B⁻¹((1−level)/2; k, n−k+1)`` and ``hi = B⁻¹((1+level)/2; k+1, n−k)`` with the Beta quantile function
    ``B⁻¹`` (``lo = 0`` at ``k = 0``, ``hi = 1`` at ``k = n``). Works elementwise on numbers, numpy arrays and
    DataArrays (returned as such); ``trials = 0`` gives NaN.

    References
    ----------
    Clopper & Pearson, *The use of confidence or fiducial limits illustrated in the case of the binomial*,
    Biometrika 26 (1934) 404–413.
    """
    level = _check_level(level)
    if isinstance(successes, xr.DataArray) or isinstance(trials, xr.DataArray):
        k_da, n_da = xr.broadcast(*(x if isinstance(x, xr.DataArray) else xr.DataArray(np.asarray(x, float))
                                    for x in (successes, trials)))
        lo, hi = binomial_interval(k_da.values, n_da.values, level)
        return k_da.copy(data=np.asarray(lo, float)), k_da.copy(data=np.asarray(hi, float))
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(k < 0) or np.any(k > n) or np.any(n < 0):
        raise ValueError("successes and trials must satisfy 0 <= successes <= trials")
    alpha = 1.0 - level
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.where(k > 0, _scipy_stats.beta.ppf(alpha / 2, k, n - k + 1), 0.0)
        hi = np.where(k < n, _scipy_stats.beta.ppf(1 - alpha / 2, k + 1, n - k), 1.0)
    lo, hi = np.where(n > 0, lo, np.nan), np.where(n > 0, hi, np.nan)
    return (lo[()] if lo.ndim == 0 else lo), (hi[()] if hi.ndim == 0 else hi)


# ------------------------------------------------------------------------------------------------ summaries
def summarise(da: xr.DataArray, dims, *, tail_threshold: float | None = 1.0, level: float = LEVEL,
              seed: int = BOOTSTRAP_SEED, resamples: int = RESAMPLES) -> xr.DataArray:
    """Median with its bootstrap interval, 10/90 % quantiles and the tail fraction of per-draw values.

    Parameters
    ----------
    da : xarray.DataArray
        Per-draw values (NaN: not run, left out; ``inf`` counts as the largest value and as above any threshold).
    dims : str or sequence of str
        The dimensions of independent draws, pooled.
    tail_threshold : float or None
        The tail fraction is the share of valid draws ``> tail_threshold`` (``P(relative error > 1)`` by default),
        with its Clopper–Pearson interval; ``None`` leaves those entries NaN.
    level, seed, resamples
        As in :func:`bootstrap_interval`.

    Returns
    -------
    xarray.DataArray
        ``stat`` (:data:`STATS`): ``estimate`` (the median), ``lo``/``hi`` (its percentile-bootstrap interval),
        ``q10``/``q90`` (quantiles of the draws, linear interpolation), ``tail``, ``tail_lo``, ``tail_hi``,
        ``count`` (valid draws).
    """
    dims = _check_dims(da, dims)
    boot = bootstrap_interval(da, dims, "median", level=level, seed=seed, resamples=resamples)
    template, values = _pooled(da, dims)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)           # all-NaN slices
        q = np.nanquantile(values, [0.1, 0.9], axis=-1, method="linear")
    count = boot.sel(stat="count").values
    if tail_threshold is None:
        k = tail = tail_lo = tail_hi = np.full(count.shape, np.nan)
    else:
        with np.errstate(invalid="ignore"):
            k = np.sum(values > tail_threshold, axis=-1).astype(np.float64)
            tail = np.where(count > 0, k / np.where(count > 0, count, 1), np.nan)
        tail_lo, tail_hi = binomial_interval(k, count, level)
    data = np.stack([boot.sel(stat="estimate").values, boot.sel(stat="lo").values, boot.sel(stat="hi").values,
                     q[0], q[1], tail, tail_lo, tail_hi, count], axis=-1)
    threshold = "none" if tail_threshold is None else f"{tail_threshold:g}"
    return _with_stat(template, data, STATS[:9], {
        **_kept_attrs(da), "statistic": "median", "level": boot.attrs["level"], "over": ", ".join(dims),
        "interval": boot.attrs["interval"] + f"; q10/q90: quantiles of the draws; tail: share of draws > {threshold} "
                                             f"with its {boot.attrs['level']:.0%} Clopper–Pearson interval",
        "tail_threshold": threshold})


def proportion_summary(successes: xr.DataArray, trials, dims, *, level: float = LEVEL) -> xr.DataArray:
    """A pooled proportion ``Σ successes / Σ trials`` over ``dims`` with its Clopper–Pearson interval.

    ``successes`` counts per draw (e.g. correct queries per episode); ``trials`` a number or an array of the same
    dims (trials per draw). NaN draws (not run) are left out. Returns a summary with ``estimate``, ``lo``, ``hi``,
    ``successes`` and ``trials`` (``count``: the number of valid draws). The interval
    treats every trial as independent; when trials share a draw (queries of one episode) it is too narrow by the
    design effect, so paired comparisons use :func:`paired_summary`'s bootstrap over draws instead.
    """
    dims = _check_dims(successes, dims)
    level = _check_level(level)
    trials = xr.broadcast(successes, xr.DataArray(trials) if not isinstance(trials, xr.DataArray) else trials)[1]
    valid = successes.notnull()
    k = successes.where(valid, 0.0).sum(dims)
    n = trials.where(valid, 0.0).sum(dims)
    lo, hi = binomial_interval(k.values, n.values, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        est = np.where(n.values > 0, k.values / np.where(n.values > 0, n.values, 1), np.nan)
    data = np.stack([est, lo, hi, valid.sum(dims).values, k.values, n.values], axis=-1)
    template = k.rename(successes.name)
    return _with_stat(template, data, ("estimate", "lo", "hi", "count", "successes", "trials"), {
        **_kept_attrs(successes), "statistic": "proportion", "level": level, "over": ", ".join(dims),
        "interval": f"{level:.0%} Clopper–Pearson interval of the pooled proportion over {', '.join(dims)} "
                    "(trials treated as independent)"})


def paired(da: xr.DataArray, dim: str, baseline, *, op: str = "difference") -> xr.DataArray:
    """Per-draw comparison of every entry along ``dim`` with the ``baseline`` entry on the same draws.

    ``op="difference"``: ``da − da.sel({dim: baseline})``; ``op="ratio"``: ``da / da.sel({dim: baseline})``
    (for errors: below 1 means better than the baseline). Draws are matched by all other coordinates (the
    studies' data axes guarantee that entries with equal coordinates saw identical inputs).
    """
    if dim not in da.dims:
        raise ValueError(f"dim {dim!r} is not a dimension of {da.name or 'the array'}; its dims: {da.dims}")
    if baseline not in da[dim].values:
        raise ValueError(f"baseline {baseline!r} is not a value of {dim!r}: {list(da[dim].values)}")
    if op not in ("difference", "ratio"):
        raise ValueError(f"op must be 'difference' or 'ratio', got {op!r}")
    base = da.sel({dim: baseline}, drop=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = da - base if op == "difference" else da / base
    sign = "−" if op == "difference" else "/"
    out.attrs = {"long_name": f"{da.attrs.get('long_name', da.name)}: {sign} {baseline} on the same draws",
                 "units": da.attrs.get("units", "1") if op == "difference" else "1",
                 "description": f"per draw, {da.name} of each {dim} {sign} that of {baseline} on identical inputs",
                 "baseline": str(baseline), "comparison": op}
    return out


def paired_summary(comparison: xr.DataArray, dims, *, statistic: str = "median", level: float = LEVEL,
                   seed: int = BOOTSTRAP_SEED, resamples: int = RESAMPLES) -> xr.DataArray:
    """Bootstrap interval of a per-draw paired comparison (from :func:`paired`) plus the share of draws in which
    the entry is *below* the baseline (difference < 0, ratio < 1) with its Clopper–Pearson interval.

    Returns a summary with ``estimate``, ``lo``, ``hi``, ``count``, ``below``, ``below_lo``, ``below_hi``. An effect
    is resolved when its interval excludes 0 (difference) or 1 (ratio).
    """
    dims = _check_dims(comparison, dims)
    boot = bootstrap_interval(comparison, dims, statistic, level=level, seed=seed, resamples=resamples)
    neutral = 1.0 if comparison.attrs.get("comparison") == "ratio" else 0.0
    valid = comparison.notnull()
    k = (comparison < neutral).where(valid, False).sum(dims).values.astype(np.float64)
    n = valid.sum(dims).values.astype(np.float64)
    lo, hi = binomial_interval(k, n, boot.attrs["level"])
    with np.errstate(invalid="ignore", divide="ignore"):
        below = np.where(n > 0, k / np.where(n > 0, n, 1), np.nan)
    template = comparison.isel({d: 0 for d in dims}, drop=True)
    data = np.concatenate([boot.sel(stat=list(BOOTSTRAP_STATS)).values, np.stack([below, lo, hi], axis=-1)], axis=-1)
    return _with_stat(template, data, (*BOOTSTRAP_STATS, "below", "below_lo", "below_hi"), {
        **_kept_attrs(comparison), "statistic": boot.attrs["statistic"], "level": boot.attrs["level"],
        "over": ", ".join(dims), "neutral": neutral,
        "interval": boot.attrs["interval"] + f"; below: share of draws < {neutral:g} with its Clopper–Pearson "
                                             "interval"})


# ------------------------------------------------------------------- units of replication and paired tests
MIN_UNITS = 10


def unit_values(da: xr.DataArray, within=()) -> xr.DataArray:
    """One value per unit of replication: the mean of ``da`` over ``within`` (the dimensions whose entries share
    a unit, e.g. the prompts that share one feature draw or one trained model), NaN entries left out; ``within``
    empty returns ``da``. A unit whose entries are all NaN is NaN."""
    within = () if not within else _check_dims(da, within)
    if not within:
        return da
    out = da.mean(within, skipna=True)
    out.attrs = {**_kept_attrs(da), "unit_mean_over": ", ".join(within)}
    return out


def cluster_interval(da: xr.DataArray, unit, within=(), *, level: float = LEVEL, seed: int = BOOTSTRAP_SEED,
                     resamples: int = RESAMPLES) -> xr.DataArray:
    r"""Mean over units and entries with a *cluster* bootstrap interval: the units (dimension ``unit``) are
    resampled with replacement, each with all of its entries along ``within``.

    The estimate is the pooled mean ``Σ_u S_u / Σ_u N_u`` (``S_u``, ``N_u``: sum and count of unit ``u``'s valid
    entries); each resample recomputes it from the drawn units (Davison & Hinkley 1997, *Bootstrap Methods and
    their Application*, §3.8, resampling the clusters). When entries of a unit are correlated (prompts sharing
    one feature draw) this is the honest interval; treating the entries as independent would narrow it by about
    ``sqrt(1 + (N − 1)ρ)`` for intra-unit correlation ``ρ`` (the design effect, Kish 1965, eq. 5.4.2).

    Returns a summary (``stat`` coordinate :data:`STATS`) with ``estimate``, ``lo``, ``hi`` and ``count`` = the
    number of units with at least one valid entry; ``over`` names the unit, ``within`` the pooled dims.
    """
    level = _check_level(level)
    (unit,) = _check_dims(da, unit)
    within = () if not within else _check_dims(da, within)
    if unit in within:
        raise ValueError(f"unit {unit!r} cannot also be a within dimension")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples must be an integer >= 100, got {resamples!r}")
    valid = da.notnull()
    sums = da.where(valid, 0.0).sum(within) if within else da.where(valid, 0.0)
    counts = valid.sum(within) if within else valid.astype(np.float64)
    template, s = _pooled(sums, (unit,))
    _, c = _pooled(counts.astype(np.float64), (unit,))
    flat_s, flat_c = s.reshape(-1, s.shape[-1]), c.reshape(-1, c.shape[-1])
    alpha = 1.0 - level
    out = np.full((flat_s.shape[0], 4), np.nan)
    for i, (si, ci) in enumerate(zip(flat_s, flat_c)):
        keep = ci > 0
        m = int(keep.sum())
        if m == 0:
            continue
        si, ci = si[keep], ci[keep]
        out[i, 0] = si.sum() / ci.sum()
        out[i, 3] = m
        if m > 1:
            idx = _indices(int(seed), m, resamples)
            boot = si[idx].sum(-1) / ci[idx].sum(-1)
            out[i, 1:3] = np.quantile(boot, [alpha / 2, 1 - alpha / 2], method="linear")
    data = out.reshape(s.shape[:-1] + (4,))
    pooled = f" with their entries along {', '.join(within)}" if within else ""
    return _with_stat(template, data, BOOTSTRAP_STATS, {
        **_kept_attrs(da), "statistic": "mean", "level": level, "over": unit, "unit": unit,
        "within": ", ".join(within),
        "interval": f"{level:.0%} cluster bootstrap: the units ({unit}) resampled with replacement{pooled} "
                    f"({resamples} resamples, bootstrap seed {seed}); count = units"})


def paired_test(comparison: xr.DataArray, unit, within=(), *, test: str = "wilcoxon") -> xr.DataArray:
    r"""Two-sided p-value of an exact paired test of "no difference" on the per-unit values of a comparison.

    ``comparison`` comes from :func:`paired` (a difference, or a ratio: tested on its logarithm, so "no
    difference" is ratio 1); each unit's value is its mean (of the log ratio) over ``within``
    (:func:`unit_values`). ``test``:

    ``"wilcoxon"``
        Wilcoxon's signed-rank test (Wilcoxon 1945, Biometrics Bulletin 1:80), exact null distribution
        (``scipy.stats.wilcoxon(method="exact")``) when no unit value is 0 and there are no ties, else the normal
        approximation with the tie correction; zero values are dropped (Wilcoxon's convention).
    ``"sign"``
        The sign test: the number of units above the neutral value among the non-zero ones against
        Binomial(m, 1/2), exact (``scipy.stats.binomtest``).

    Returns the p-values over the comparison's other dimensions (NaN where fewer than one non-zero unit), with
    attributes ``test``, ``unit`` and ``num_units`` (the largest number of units seen).
    """
    if test not in ("wilcoxon", "sign"):
        raise ValueError(f"test must be 'wilcoxon' or 'sign', got {test!r}")
    (unit,) = _check_dims(comparison, unit)
    if comparison.attrs.get("comparison") == "ratio":      # a unit's value: the mean log ratio of its entries
        with np.errstate(divide="ignore", invalid="ignore"):
            comparison = np.log(comparison)
    per_unit = unit_values(comparison, within)
    template, values = _pooled(per_unit, (unit,))
    flat = values.reshape(-1, values.shape[-1])
    p = np.full(flat.shape[0], np.nan)
    for i, row in enumerate(flat):
        x = row[np.isfinite(row)]
        x = x[x != 0]
        if x.size == 0:
            continue
        if test == "sign":
            p[i] = _scipy_stats.binomtest(int((x > 0).sum()), int(x.size), 0.5).pvalue
        else:
            exact = np.unique(np.abs(x)).size == x.size
            p[i] = _scipy_stats.wilcoxon(x, method="exact" if exact else "approx", correction=False,
                                         zero_method="wilcox").pvalue
    out = template.copy(data=p.reshape(values.shape[:-1]))
    out.attrs = {"long_name": f"p-value, paired {test} test on per-{unit} values", "units": "1",
                 "description": f"two-sided exact {test} test of no difference, one value per {unit}"
                                + (f" (mean over {', '.join(within)})" if within else ""),
                 "test": test, "unit": unit, "num_units": int(np.isfinite(values).sum(-1).max(initial=0))}
    return out


def range_summary(da: xr.DataArray, unit) -> xr.DataArray:
    """The median over the units (dimension ``unit``) with the *range* of the units: ``lo`` = smallest, ``hi`` =
    largest value, ``count`` = valid units (NaN left out). For a handful of units (5 seeds) the percentile bootstrap
    of the median is about that range and covers far less than its nominal level (with 5 units the range of the
    draws contains the median with probability 1 − 2·2⁻⁵ = 93.75 %), so this names it as what it is: the
    ``interval`` attribute says "range", not a confidence interval."""
    (unit,) = _check_dims(da, unit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)                   # slices without any valid unit
        data = np.stack([da.median(unit), da.min(unit), da.max(unit), da.notnull().sum(unit).astype(float)], -1)
    template = da.isel({unit: 0}, drop=True)
    return _with_stat(template, data, BOOTSTRAP_STATS, {
        **_kept_attrs(da), "statistic": "median", "over": unit, "unit": unit,
        "interval": f"range of the {unit}s (min–max of the per-{unit} values), not a confidence interval"})


def holm(p) -> np.ndarray:
    """Holm's step-down adjusted p-values (Holm 1979, Scand. J. Statist. 6:65): the family-wise error rate of
    rejecting every hypothesis whose adjusted p is below α is at most α. ``p`` is any array (DataArray kept);
    NaN entries are not part of the family and stay NaN."""
    da = p if isinstance(p, xr.DataArray) else None
    arr = np.asarray(p, dtype=np.float64)
    flat = arr.ravel()
    ok = np.flatnonzero(np.isfinite(flat))
    out = np.full_like(flat, np.nan)
    if ok.size:
        order = ok[np.argsort(flat[ok], kind="stable")]
        m = ok.size
        adjusted = np.maximum.accumulate((m - np.arange(m)) * flat[order])
        out[order] = np.minimum(adjusted, 1.0)
    out = out.reshape(arr.shape)
    return da.copy(data=out) if da is not None else out


def partial_spearman(x, y, z) -> float:
    r"""Spearman's partial rank correlation of ``x`` and ``y`` controlling for ``z`` (1-D, same length).

    With the Spearman correlations :math:`\rho_{xy}, \rho_{xz}, \rho_{yz}` (Pearson's r of the mid-ranks),

    .. math:: \rho_{xy\cdot z} = \frac{\rho_{xy} - \rho_{xz}\rho_{yz}}{\sqrt{(1-\rho_{xz}^2)(1-\rho_{yz}^2)}},

    the first-order partial correlation formula applied to ranks (Kendall & Stuart 1979, *The Advanced Theory of
    Statistics* vol. 2, §27.4; Conover 1999, *Practical Nonparametric Statistics*, §5.4). It equals Pearson's r
    of the residuals of rank(x) and rank(y) after a least-squares line on rank(z): the rank association of x and
    y that the ordering by z does not explain. Pairs with a non-finite entry are left out. NaN when fewer than 4
    pairs remain, when x or y is constant, or when z orders x or y perfectly (:math:`|\rho| = 1`: no residual to
    correlate).
    """
    x, y, z = (np.asarray(v, dtype=np.float64).ravel() for v in (x, y, z))
    if not x.size == y.size == z.size:
        raise ValueError(f"x, y and z must have the same length, got {x.size}, {y.size}, {z.size}")
    keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
    x, y, z = x[keep], y[keep], z[keep]
    if x.size < 4 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return np.nan
    rx, ry, rz = (_scipy_stats.rankdata(v) for v in (x, y, z))
    if np.ptp(rz) == 0:                                     # z constant: nothing to control for
        return float(np.corrcoef(rx, ry)[0, 1])
    c = np.corrcoef(np.stack([rx, ry, rz]))
    denominator = (1.0 - c[0, 2] ** 2) * (1.0 - c[1, 2] ** 2)
    if denominator <= 1e-12:
        return np.nan
    return float(np.clip((c[0, 1] - c[0, 2] * c[1, 2]) / np.sqrt(denominator), -1.0, 1.0))


def verdict(estimate: float, p: float, units: int, *, neutral: float = 0.0, alpha: float = 0.05,
            min_units: int = MIN_UNITS) -> str:
    """``"lower"``, ``"higher"`` or ``"not resolved"``: a paired comparison's verdict. It is resolved only with at
    least ``min_units`` independent units and an (adjusted) p-value below ``alpha``; its direction is the
    estimate's side of ``neutral`` (0 for differences, 1 for ratios)."""
    if not (units >= min_units and np.isfinite(p) and p < alpha and np.isfinite(estimate) and estimate != neutral):
        return "not resolved"
    return "lower" if estimate < neutral else "higher"


def interval_note(ds: xr.Dataset, replicates: str = "the replicates") -> str:
    """The closing line of a study's findings: what the numbers in parentheses are, from the dataset's attributes
    (written by the engine after the study's own findings: ``kernapprox.sweep`` ``findings_text``).
    ``replicates`` names the unit the bootstrap resamples (the study's ``Experiment.replicates``)."""
    level = float(ds.attrs.get("interval_level", LEVEL))
    return (f"Numbers in parentheses are {level * 100:g} % intervals (percentile bootstrap over {replicates} with "
            f"bootstrap seed {ds.attrs.get('bootstrap_seed', BOOTSTRAP_SEED)}, or Clopper–Pearson for "
            "proportions); ratios and differences are paired: computed per draw on identical inputs.")


def is_summary(da: xr.DataArray) -> bool:
    """Whether ``da`` is a summary of this module's convention (a ``stat`` dimension with coordinate STATS)."""
    return "stat" in da.dims and [str(v) for v in da["stat"].values] == list(STATS)


STAT_CONVENTION = (
    "Variables with a 'stat' dimension summarise per-draw variables of this dataset (kernapprox.stats); the stat "
    "coordinate is the same for all of them: estimate (the point estimate named by the variable's 'statistic' "
    "attribute: median, proportion or mean), lo and hi (its interval, described by the 'interval' attribute at the "
    "'level' given there), q10/q90 (10 and 90 % quantiles of the draws), tail/tail_lo/tail_hi (share of draws "
    "above 'tail_threshold' and its Clopper-Pearson interval), count (valid draws), successes/trials "
    "(proportions), below/below_lo/below_hi (paired comparisons: share of draws below the baseline); entries a "
    "summary does not compute are NaN. The attribute 'over' names the pooled dimensions of independent draws. "
    "Bootstrap resamples come from numpy.random.default_rng([bootstrap_seed, m]) for m valid draws, so summaries "
    "are deterministic.")


def describe_summaries(ds: xr.Dataset) -> dict:
    """Dataset attributes that document the summaries in ``ds``: ``stat_convention`` and ``summaries`` (the
    names of the summary variables, comma separated)."""
    names = [name for name, var in ds.data_vars.items() if is_summary(var)]
    return {"stat_convention": STAT_CONVENTION, "summaries": ", ".join(names),
            "bootstrap_seed": BOOTSTRAP_SEED, "bootstrap_resamples": RESAMPLES, "interval_level": LEVEL}


def _kept_attrs(da: xr.DataArray) -> dict:
    return {key: da.attrs[key] for key in ("long_name", "units", "description") if key in da.attrs}
