"""What every study shares: the names of the reference estimators, the memory budget for dense matrices, and the
summaries, paired comparisons and sentences built from them.

Conventions (documented in each dataset's attributes by :mod:`kernapprox.stats`):

* per-draw variables keep their replicate dimensions (``seed``, and ``episode`` in the in-context studies);
* ``<metric>_summary``: median, its 95 % bootstrap interval, 10/90 % quantiles and the tail fraction
  ``P(value > 1)`` over the replicate dimensions (:func:`kernapprox.stats.summarise`);
* ``<metric>_vs_<baseline>``: the per-draw paired comparison with a named baseline on identical inputs (a ratio
  for errors, a difference for scores), and ``<metric>_vs_<baseline>_summary`` with its interval and the share of
  draws below the baseline (:func:`kernapprox.stats.paired_summary`);
* proportions (accuracies) pooled over draws with Clopper–Pearson intervals (``<metric>_summary`` with
  ``statistic = proportion``).

A finding calls an effect resolved only when its interval excludes the neutral value (1 for a ratio, 0 for a
difference); otherwise it says the data do not separate the two.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from kernapprox import available_estimators, memory, stats
from kernapprox.plotting import fmt, fmt_ci

# The reference estimators, each named in one place so that a registry rename is a one-line change here.
KERNEL_SVD = "kernel_svd"           # best rank-r approximation of exp(s QKᵀ): bounds that matrix's Frobenius error only
ATTENTION_SVD = "attention_svd"     # best rank-r approximation of softmax(s QKᵀ): bounds that matrix's error only
BASELINE = "positive_orthogonal"    # the paired baseline of the random-feature comparisons (FAVOR+)

# Dense n×n float64 matrices are built only up to this many entries (64 MiB); beyond it the studies work in row
# blocks of at most BLOCK_ENTRIES entries, or leave out what needs the whole matrix.
DENSE_BUDGET_ENTRIES = 2**23
BLOCK_ENTRIES = 2**21


def registered(*names: str) -> list[str]:
    """The given registry names that are registered here, in order."""
    known = set(available_estimators())
    return [name for name in names if name in known]


def row_blocks(n_rows: int, n_cols: int, entries: int | None = None):
    """Slices of at most ``entries // n_cols`` rows (default :data:`BLOCK_ENTRIES`) covering ``range(n_rows)``."""
    step = max(1, (BLOCK_ENTRIES if entries is None else entries) // max(n_cols, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


# ------------------------------------------------------------------------------------------------ summaries
def add_summaries(ds: xr.Dataset, names, dims, *, tail_threshold: float | None = 1.0) -> xr.Dataset:
    """``<name>_summary`` for each per-draw variable in ``names`` (median, interval, quantiles, tail)."""
    for name in names:
        summary = stats.summarise(ds[name], dims, tail_threshold=tail_threshold)
        summary.attrs["description"] = f"summary of {name} over {summary.attrs['over']}: " + \
            summary.attrs["interval"]
        ds[f"{name}_summary"] = summary
    return ds


def add_proportion(ds: xr.Dataset, name: str, successes: xr.DataArray, trials, dims) -> xr.Dataset:
    """``<name>_summary``: the pooled proportion of ``successes`` over ``trials`` with its Clopper–Pearson interval."""
    summary = stats.proportion_summary(successes, trials, dims)
    summary.attrs.update({"long_name": ds[name].attrs.get("long_name", name), "units": "1",
                          "description": f"pooled proportion of {name} over {', '.join(dims)}: "
                                         + summary.attrs["interval"]})
    ds[f"{name}_summary"] = summary
    return ds


def add_paired(ds: xr.Dataset, name: str, baseline, dims, *, op: str, dim: str = "estimator",
               statistic: str = "median", label: str | None = None) -> xr.Dataset:
    """``<name>_vs_<label>`` (per draw, against ``baseline`` along ``dim`` on identical inputs) and its summary;
    nothing where ``baseline`` is not among the values of ``dim`` (a preset without it)."""
    if baseline not in ds[dim].values:
        return ds
    return add_comparison(ds, f"{name}_vs_{label or baseline}", stats.paired(ds[name], dim, baseline, op=op), dims,
                          statistic=statistic)


def add_comparison(ds: xr.Dataset, var: str, comparison: xr.DataArray, dims, *,
                   statistic: str = "median") -> xr.Dataset:
    """``var``: a per-draw paired comparison (attributes ``comparison = "ratio"`` or ``"difference"``), and
    ``<var>_summary`` with its interval over ``dims`` (:func:`kernapprox.stats.paired_summary`)."""
    ds[var] = comparison
    summary = stats.paired_summary(comparison, dims, statistic=statistic)
    dims = [dims] if isinstance(dims, str) else list(dims)
    summary.attrs["description"] = f"summary of {var} over {', '.join(dims)}: " + summary.attrs["interval"]
    ds[f"{var}_summary"] = summary
    return ds


def add_mean(ds: xr.Dataset, var: str, da: xr.DataArray, dims, *, long_name: str, description: str) -> xr.Dataset:
    """``var``: the mean of ``da`` over ``dims`` with its bootstrap interval (``description`` says of what)."""
    mean = stats.bootstrap_interval(da, dims, "mean")
    mean.attrs.update({"long_name": long_name, "units": "1", "description": f"{description}: "
                       + mean.attrs["interval"]})
    ds[var] = mean
    return ds


def per_draw_slope(da: xr.DataArray, x: str) -> xr.DataArray:
    """Least-squares slope of ``log da`` against ``log x`` for every draw (NaN if fewer than two positive finite
    points): the empirical rate, e.g. ``−1/2`` for Monte Carlo in ``r``."""
    xs = np.log(da[x].values.astype(float))

    def fit(y):
        ok = np.isfinite(y) & (y > 0)
        if ok.sum() < 2:
            return np.nan
        return float(np.polyfit(xs[ok], np.log(y[ok]), 1)[0])

    return xr.apply_ufunc(fit, da, input_core_dims=[[x]], vectorize=True)


# ------------------------------------------------------------------------------------------------ sentences
def resolved(summary: xr.DataArray) -> bool:
    """Whether a paired summary's interval excludes its neutral value (1 for ratios, 0 for differences)."""
    neutral = float(summary.attrs.get("neutral", 0.0))
    lo, hi = float(summary.sel(stat="lo")), float(summary.sel(stat="hi"))
    return np.isfinite(lo) and np.isfinite(hi) and (lo > neutral or hi < neutral)


def covers(summary: xr.DataArray, value) -> xr.DataArray:
    """Elementwise, whether a summary's interval ``[lo, hi]`` contains ``value`` (a number or an array that
    broadcasts against it, e.g. a closed form per cell); False where the interval is NaN."""
    return (summary.sel(stat="lo") <= value) & (summary.sel(stat="hi") >= value)


def above(a: xr.DataArray, b: xr.DataArray) -> bool:
    """Whether summary ``a``'s interval lies wholly above summary ``b``'s (the two are separated, ``a`` higher);
    summaries of independent draws, compared by their intervals rather than paired."""
    return float(a.sel(stat="lo")) > float(b.sel(stat="hi"))


def ratio_phrase(summary: xr.DataArray, *, better: str = "lower", worse: str = "higher") -> str:
    """``"lower (ratio 0.57 (0.50–0.65))"`` or ``"not separated (ratio 0.97 (0.85–1.10))"`` for a paired ratio."""
    text = f"ratio {fmt_ci(summary)}"
    if not resolved(summary):
        return f"not separated from it ({text})"
    return f"{better if float(summary.sel(stat='estimate')) < 1 else worse} ({text})"


def verdict(summary: xr.DataArray, *, below: str = "lower", above: str = "higher") -> str:
    """``below``/``above`` where a paired summary's interval excludes its neutral value (1 for ratios, 0 for
    differences), ``"not resolved"`` where it does not (the two are not separated by these data)."""
    if not resolved(summary):
        return "not resolved"
    return below if float(summary.sel(stat="estimate")) < float(summary.attrs.get("neutral", 0.0)) else above


def range_text(values, digits: int = 2) -> str:
    """``"0.12–0.29"`` for the finite values given (``"n/a"`` if none)."""
    values = np.asarray([v for v in np.ravel(values) if np.isfinite(v)], dtype=float)
    if values.size == 0:
        return "n/a"
    lo, hi = values.min(), values.max()
    if fmt(lo, digits) == fmt(hi, digits):
        return fmt(lo, digits)
    return f"{fmt(lo, digits)} to {fmt(hi, digits)}" if lo < 0 else f"{fmt(lo, digits)}–{fmt(hi, digits)}"


# ------------------------------------------------------------------------------------------ equal state bytes
# How the studies compare estimators whose memory is not r·(d_v + 1): every estimator runs at its largest
# configuration whose state fits the budget B(r) of the random-feature baselines at r features
# (kernapprox.memory: the sizing rule, B(r) = the larger state of FAVOR+ and OPRF), and the configuration it got is
# recorded per cell. What is the studies' own: which estimators they size, and that EVA's budget goes to groups.

# The LARA and EVA configurations the studies compare at equal state bytes: label -> (registry name, constructor
# options), every option not named at its registry default. LARA spends the budget on draws (r' = C·S features, one
# draw per proposal); EVA on groups (GROUP_SIZED: the most groups, i.e. the smallest group size g, whose state fits,
# with ``num_features = ⌈n/g⌉`` draws) beside its exact local window (registry default w = 32).
EQUAL_BYTES = {
    # all five are training-free variants (no learned landmark maps or group logit), not the papers' estimators
    "lara": ("lara", {}),                    # query-specific MIS weights, sampled draws (training-time rule)
    "lara_balance": ("lara_balance", {}),    # balance-heuristic weights (an unbiased kernel estimate)
    "lara_mean": ("lara_mean", {}),          # draws at the proposal means, ω = μ (the paper's inference-time rule)
    "eva": ("eva", {}),                      # sampled draws, window 32 (training-time rule)
    "eva_mean": ("eva_mean", {}),            # draws at the proposal means, ω = μ, window 32 (inference-time rule)
}
GROUP_SIZED = ("eva", "eva_mean")            # registry names whose budget goes to the number of groups

# The other estimators whose memory the studies match to the budget: landmarks and whitening (Nyström), an exact
# window of 64 keys beside the features (the hybrids).
EQUAL_BYTES_COMPARATORS = {
    "nystrom_uniform": ("nystrom_uniform", {}),
    "window_linear": ("window_linear", {}),
    "scatterbrain": ("scatterbrain", {}),
}


def _size_by(name: str) -> str:
    return "group_size" if name in GROUP_SIZED else "num_features"


def sized_configuration(name: str, options: dict, budget: int, *, d: int, d_v: int, seq_len: int) -> dict | None:
    """:func:`kernapprox.memory.sized_configuration` of ``name`` with ``options``, by groups for the
    :data:`GROUP_SIZED` names and by features otherwise (float32 states)."""
    return memory.sized_configuration(name, budget, d=d, d_v=d_v, seq_len=seq_len, options=options,
                                      size_by=_size_by(name))


def smallest_state(name: str, options: dict, *, d: int, d_v: int, seq_len: int) -> int:
    """:func:`kernapprox.memory.smallest_state` under the same rule, to report what an estimator that fits no
    budget would have needed."""
    return memory.smallest_state(name, d=d, d_v=d_v, seq_len=seq_len, options=options, size_by=_size_by(name))
