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
import torch
import xarray as xr

import kernapprox as ka
from kernapprox import available_estimators, stats
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
    """``<name>_vs_<label>`` (per draw, against ``baseline`` along ``dim`` on identical inputs) and its summary."""
    label = label or str(baseline)
    comparison = stats.paired(ds[name], dim, baseline, op=op)
    var = f"{name}_vs_{label}"
    ds[var] = comparison
    summary = stats.paired_summary(comparison, dims, statistic=statistic)
    summary.attrs["description"] = f"summary of {var} over {', '.join(dims)}: " + summary.attrs["interval"]
    ds[f"{var}_summary"] = summary
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


def interval_note(ds: xr.Dataset) -> str:
    """The closing line of a findings text (:func:`kernapprox.stats.interval_note`); the engine writes it after
    the findings of a study that does not (kept for the studies that still add it themselves)."""
    return stats.interval_note(ds)


# ------------------------------------------------------------------------------------------ equal state bytes
# How the studies compare estimators whose memory is not r·(d_v + 1): every estimator is run at its largest
# configuration whose state (``estimator.state_bytes(d_v, float32, seq_len=n)``: everything a decoder keeps from
# the context) fits the budget B(r) of the random-feature baselines at r features, and the configuration it got is
# recorded per cell. B(r) is the larger state of FAVOR+ and OPRF at r features: r·(d_v + 1) float32 numbers, plus
# OPRF's one fitted statistic (4 bytes), so both baselines run at r itself.
BUDGET_BASELINES = (BASELINE, "oprf_orthogonal")

# The LARA and EVA configurations the studies compare at equal state bytes: label -> (registry name, constructor
# options), every option not named at its registry default. LARA spends the budget on draws (r' = C·S features, one
# draw per proposal); EVA on groups (GROUP_SIZED: the most groups, i.e. the smallest group size g, whose state fits,
# with ``num_features = ⌈n/g⌉`` draws) beside its exact local window (registry default w = 32).
EQUAL_BYTES = {
    "lara": ("lara", {}),                    # query-specific MIS weights, sampled draws (the paper's estimator)
    "lara_balance": ("lara_balance", {}),    # balance-heuristic weights (an unbiased kernel estimate)
    "lara_mean": ("lara_mean", {}),          # draws at the proposal means (the reference code at inference)
    "eva": ("eva", {}),                      # sampled draws, window 32
    "eva_mean": ("eva_mean", {}),            # draws at the proposal means, window 32
}
GROUP_SIZED = ("eva", "eva_mean")            # registry names whose budget goes to the number of groups

# The other estimators whose memory the studies match to the budget: landmarks and whitening (Nyström), an exact
# window of 64 keys beside the features (the hybrids).
EQUAL_BYTES_COMPARATORS = {
    "nystrom_uniform": ("nystrom_uniform", {}),
    "window_linear": ("window_linear", {}),
    "scatterbrain": ("scatterbrain", {}),
}

_PROBE_CACHE: dict = {}


def _probe_data(seq_len: int, d: int) -> torch.Tensor:
    key = ("data", seq_len, d)
    if key not in _PROBE_CACHE:
        _PROBE_CACHE[key] = torch.as_tensor(np.random.default_rng(0).standard_normal((seq_len, d)))
    return _PROBE_CACHE[key]


def probe_state_bytes(name: str, options: dict, num_features: int, *, d: int, d_v: int, seq_len: int,
                      dtype: torch.dtype = torch.float32) -> int:
    """``state_bytes(d_v, dtype, seq_len)`` of ``name`` with ``num_features`` and ``options``, fitted on a fixed
    standard-normal probe of ``seq_len`` tokens (no estimator's state size depends on the values; memoised)."""
    key = (name, tuple(sorted(options.items())), num_features, d, d_v, seq_len, str(dtype))
    if key not in _PROBE_CACHE:
        x = _probe_data(seq_len, d)
        est = ka.make_estimator(name, num_features=num_features, rng=0, **options).fit(x, x)
        _PROBE_CACHE[key] = int(est.state_bytes(d_v, dtype, seq_len=seq_len))
    return _PROBE_CACHE[key]


def budget_bytes(r: int, *, d: int, d_v: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
    """B(r): the larger state of the :data:`BUDGET_BASELINES` at ``r`` features."""
    return max(probe_state_bytes(name, {}, r, d=d, d_v=d_v, seq_len=seq_len, dtype=dtype)
               for name in BUDGET_BASELINES)


def sized_configuration(name: str, options: dict, budget: int, *, d: int, d_v: int, seq_len: int,
                        dtype: torch.dtype = torch.float32) -> dict | None:
    """Constructor arguments (``num_features``, ``options`` and, for :data:`GROUP_SIZED` names, ``group_size``)
    of the largest configuration of ``name`` whose state fits ``budget`` bytes, or ``None`` if none fits.

    Feature-sized estimators (every state grows with ``num_features``): the largest ``num_features`` (at most
    ``seq_len`` for landmark methods), by doubling then bisection. Group-sized estimators (EVA): the smallest group
    size ``g`` (the most groups, ``num_features = ⌈n/g⌉`` draws) whose state fits, scanning ``g = 1, 2, …``; the
    scan stops once ``g`` tokens of keys, values and log-features alone (``g (d + d_v + 1)`` numbers, a lower bound
    of EVA's local state) exceed the budget.
    """
    options = dict(options)

    def size(r, **extra):
        return probe_state_bytes(name, {**options, **extra}, r, d=d, d_v=d_v, seq_len=seq_len, dtype=dtype)

    if name in GROUP_SIZED:
        unit = (d + d_v + 1) * torch.empty((), dtype=dtype).element_size()
        for g in range(1, seq_len + 1):
            if g * unit > budget:
                return None
            groups = -(-seq_len // g)
            if size(groups, group_size=g) <= budget:
                return {"num_features": groups, **options, "group_size": g}
        return None
    step = _feature_step(name, options)            # maps of sin/cos or exp(±) pairs need an even r
    cap = (seq_len if ka.capabilities(name, **options).rank_limited_by_points else 2**30) // step
    if size(step) > budget:
        return None
    lo, hi = 1, 2                                   # in units of step: size(lo) fits; find hi that does not
    while hi <= cap and size(hi * step) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:                              # invariant: size(lo) <= budget < size(hi) (or hi = cap + 1)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid * step) <= budget else (lo, mid)
    return {"num_features": lo * step, **options}


def _feature_step(name: str, options: dict) -> int:
    """The smallest ``num_features`` the estimator accepts (1, or 2 for maps built from pairs of features); the
    valid values are its multiples."""
    for step in (1, 2, 4):
        try:
            ka.make_estimator(name, num_features=step, rng=0, **options)
        except ValueError:
            continue
        return step
    raise ValueError(f"{name} accepts none of num_features = 1, 2, 4")


def smallest_state(name: str, options: dict, *, d: int, d_v: int, seq_len: int,
                   dtype: torch.dtype = torch.float32) -> int:
    """The smallest state of ``name``'s configurations (one feature; EVA: the best group size), to report what an
    estimator that fits no budget would have needed."""
    if name not in GROUP_SIZED:
        return probe_state_bytes(name, dict(options), _feature_step(name, options), d=d, d_v=d_v, seq_len=seq_len,
                                 dtype=dtype)
    unit = (d + d_v + 1) * torch.empty((), dtype=dtype).element_size()
    best = None
    for g in range(1, seq_len + 1):
        if best is not None and g * unit > best:
            break
        value = probe_state_bytes(name, {**options, "group_size": g}, -(-seq_len // g), d=d, d_v=d_v,
                                  seq_len=seq_len, dtype=dtype)
        best = value if best is None else min(best, value)
    return best
