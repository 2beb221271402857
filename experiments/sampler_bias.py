"""How biased are the SORF and SMREG samplers at Performer scaling, and does a norm-corrected SORF fix it?

Every random-feature estimator's mean is the mean, over the law of one projection row, of the per-row product
(linearity), so a sampler's bias is a property of that law. ``regularized`` (SMREG) rows are uniform on the sphere
of radius √d, whose mean has the closed form :func:`kernapprox.theory.regularized_mean_ratio`; SORF rows have
norm exactly √d when d is a power of two and a direction close to uniform; ``sorf_chi`` gives SORF's directions
Gaussian norms (independent ``chi(d)`` lengths); ``iid`` is the Gaussian control (ratio 1).

Data (Performer scaling, unit-variance coordinates): ``q, k ~ N(0, I_d)``, ``x = q/d^{1/4}``, ``y = k/d^{1/4}``,
then one common factor rescales the pair to a level of ``‖x+y‖²``: ``2√d`` (the mean over independent pairs of
the regime), ``√d`` and ``√d/2`` (smaller logits; at ``c√d`` the closed form tends to ``e^{−c²/4}`` as d grows),
and the fixed value 4 (the regime of Yu et al.'s result, where the bias vanishes as d grows). The pairs come from
the data stream shared by the samplers (axes ``dim``, ``num_pairs``, ``seed``), so every sampler sees the same
pairs. Maps: positive features (FAVOR+'s map) and OPRF with ``A = A*(‖x+y‖²/d)`` (OPRF fitted on that pair).

Measurement: each cell draws ``num_rows`` rows with its sampler and, for each pair and map, records the mean over
the rows of :func:`kernapprox.theory.sign_averaged_ratio` — the per-row product divided by the kernel, with the
coordinate signs (and, for the chi-norm samplers, the independent norm) integrated out exactly; every sampler
here is invariant under those operations, so this is the estimator's mean-to-kernel ratio with a much smaller
Monte-Carlo error than the raw products. The within-cell standard error comes from ``row_groups`` groups of
consecutive rows (whole sampler blocks, hence independent: ``num_rows / row_groups ≥ d``). The sphere closed form
is the study's :class:`~kernapprox.sweep.Reference` (stored without the sampler axis). Summaries
(:mod:`kernapprox.stats`): the mean ratio over seeds × pairs with its percentile-bootstrap interval
(``ratio_summary``; the pairs of a cell share its rows but point in independent directions, and their errors are
nearly uncorrelated), the per-draw ratio to the closed form (``ratio_vs_closed_form``) and the paired difference
from SMREG on the same pairs (``ratio_vs_regularized``).
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from experiments._common import add_comparison, add_mean, add_paired, covers, range_text
from kernapprox import theory
from kernapprox.estimators.samplers import make_sampler
from kernapprox.plotting import errorbar_summary, estimator_style, fmt, fmt_ci, new_figure, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, run_cli

SAMPLERS = ["iid", "regularized", "sorf", "sorf_chi"]
CHI_NORMS = {"iid", "sorf_chi"}           # norms are independent chi(d) draws: integrated out by quadrature
MAPS = ["positive", "oprf"]
LEVELS = {  # level -> (a, b, label) with ‖x+y‖² = a + b·√d
    "fixed_4": (4.0, 0.0, "‖x+y‖² = 4"),
    "half_sqrt_d": (0.0, 0.5, "‖x+y‖² = √d/2"),
    "sqrt_d": (0.0, 1.0, "‖x+y‖² = √d"),
    "two_sqrt_d": (0.0, 2.0, "‖x+y‖² = 2√d"),
}
SAMPLER_COLORS = {"iid": "#555555", "regularized": "#0173b2", "sorf": "#d55e00", "sorf_chi": "#029e73"}
DRAWS = ("seed", "pair")                  # the replicates: independent pairs of independent cells

GRIDS = {  # num_rows: rows drawn per cell; num_pairs: pairs per seed and level
    "smoke": {"sampler": SAMPLERS, "dim": [16, 32], "num_rows": [2**10], "num_pairs": [2], "seed": [0, 1]},
    "default": {"sampler": SAMPLERS, "dim": [16, 32, 64, 128], "num_rows": [2**12], "num_pairs": [4],
                "seed": [0, 1, 2, 3, 4]},
    # make figures PRESET=full's share of its hour: the default's d and rows, twice its pairs, ten seeds (d = 256
    # needs 2**13 rows: 32 groups of whole 256-row blocks)
    "full": {"sampler": SAMPLERS, "dim": [16, 32, 64, 128], "num_rows": [2**12], "num_pairs": [8],
             "seed": list(range(10))},
}
PARAMETERS = {
    "row_groups": Parameter(32, "groups of consecutive rows for the within-cell standard error", "1",
                            "each group must hold whole sampler blocks: num_rows / row_groups a multiple of d"),
}
AXIS_ATTRS = {axis: {"long_name": long_name, "units": "1"} for axis, long_name in {
    "sampler": "projection sampler (kernapprox.estimators.samplers)", "dim": "dimension d of q and k",
    "num_rows": "projection rows drawn per cell", "num_pairs": "pairs (x, y) per seed and level",
    "level": "norm level of the pair: ‖x+y‖² = a + b·√d (LEVELS: fixed_4, half_sqrt_d, sqrt_d, two_sqrt_d)",
    "feature_map": "random feature map the rows feed (positive: FAVOR+; oprf: FAVOR++)",
    "pair": "pair (x, y) of the cell (an independent draw at its level)"}.items()}

_MAPPED = {"dims": ("level", "feature_map"), "coords": {"level": list(LEVELS), "feature_map": MAPS}}
_PAIRED = {**_MAPPED, "dims": ("level", "feature_map", "pair")}
_LEVELED = {"dims": ("level",), "coords": {"level": list(LEVELS)}}
METRICS = {
    "ratio": Metric("mean estimate / kernel", "1", "E[SM̂(x, y)]/SM(x, y) for one pair: mean over the cell's rows of "
                    "the sign- (and for chi-norm samplers norm-) averaged per-row product / SM", **_PAIRED),
    "ratio_se": Metric("standard error of the ratio", "1",
                       "from row_groups groups of consecutive rows (whole sampler blocks)", **_PAIRED),
}
REFERENCE_METRICS = {
    "closed_form": Metric("sphere closed form of the ratio", "1", "theory.regularized_mean_ratio: rows uniform on the "
                          "sphere of radius √d (exact for the regularized sampler); a function of d and the level only",
                          **_MAPPED),
    "norm2": Metric("‖x+y‖²", "1", "the level's value, the same for every pair", **_LEVELED),
    "oprf_A": Metric("OPRF parameter A", "1", "A*(‖x+y‖²/d) of the OPRF map", **_LEVELED),
}


def draw_pairs(dim: int, num_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``num_pairs`` unit-variance pairs at Performer scaling: ``x = q/d^{1/4}``, ``y = k/d^{1/4}``, ``(P, d)``."""
    q = rng.standard_normal((num_pairs, dim))
    k = rng.standard_normal((num_pairs, dim))
    return q / dim**0.25, k / dim**0.25


def _levels(dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(‖x+y‖², OPRF's A*)`` of every level at dimension ``dim``."""
    norm2 = np.array([a + b * math.sqrt(dim) for a, b, _ in LEVELS.values()])
    return norm2, np.array([float(theory.oprf_optimal_A(v / dim)) for v in norm2])


def _gerf_a(name: str, a_opt: float) -> float:
    return 0.0 if name == "positive" else a_opt


ROW_BLOCK = 512     # rows per call of sign_averaged_ratio: its temporaries stay small (whole-cell calls spent about
                    # half their CPU time in the kernel faulting in fresh pages); values are per row, so identical


def _row_ratios(rows: np.ndarray, x: np.ndarray, y: np.ndarray, A: float, radial) -> np.ndarray:
    """:func:`kernapprox.theory.sign_averaged_ratio` of every row, evaluated :data:`ROW_BLOCK` rows at a time."""
    return np.concatenate([theory.sign_averaged_ratio(rows[i:i + ROW_BLOCK], x, y, A=A, radial=radial)
                           for i in range(0, len(rows), ROW_BLOCK)])


def draw(params, data_rng, device):
    """The pairs of one (d, number of pairs, seed), the same for every sampler."""
    return draw_pairs(params["dim"], params["num_pairs"], data_rng)


def check_params(params) -> None:
    """Refuse, before any cell runs, a dimension that is not a power of two and a row count that does not split into
    ``row_groups`` groups of whole sampler blocks (``d`` rows each)."""
    dim, rows_per_cell, groups = params["dim"], params["num_rows"], params["row_groups"]
    if dim & (dim - 1):
        raise ValueError(f"dim must be a power of two (SORF rows then have norm exactly √d), got {dim}")
    if rows_per_cell % groups or (rows_per_cell // groups) % dim:
        raise ValueError(f"num_rows / row_groups must be a multiple of dim (whole sampler blocks per group), got "
                         f"num_rows = {rows_per_cell}, row_groups = {groups}, dim = {dim}")


def run_cell(params, rng, device, data):
    dim, rows_per_cell, num_pairs, sampler = params["dim"], params["num_rows"], params["num_pairs"], params["sampler"]
    groups = params["row_groups"]
    x, y = data
    rows = make_sampler(sampler).sample(rows_per_cell, dim, rng)
    radial = "chi" if sampler in CHI_NORMS else None
    norm2, a_opt = _levels(dim)
    shape = (len(LEVELS), len(MAPS), num_pairs)
    ratio, se = np.empty(shape), np.empty(shape)
    for i in range(len(LEVELS)):
        for j, name in enumerate(MAPS):
            for p in range(num_pairs):
                factor = math.sqrt(norm2[i] / float((x[p] + y[p]) @ (x[p] + y[p])))
                values = _row_ratios(rows, factor * x[p], factor * y[p], _gerf_a(name, a_opt[i]), radial)
                ratio[i, j, p] = values.mean()
                se[i, j, p] = values.reshape(groups, -1).mean(1).std(ddof=1) / math.sqrt(groups)
    return {"ratio": ratio, "ratio_se": se}


def run_reference(params, device, data):
    """The sphere closed form at each level and map (deterministic in d; the pairs are not needed)."""
    norm2, a_opt = _levels(params["dim"])
    closed = np.array([[float(theory.regularized_mean_ratio(v, params["dim"], A=_gerf_a(name, a)))
                        for name in MAPS] for v, a in zip(norm2, a_opt)])
    return {"closed_form": closed, "norm2": norm2, "oprf_A": a_opt}


# -------------------------------------------------------------------------------------------- summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    """The mean ratio over seeds × pairs with its bootstrap interval; per draw, the ratio to the sphere closed
    form and the paired difference from SMREG on the same pairs, with their intervals."""
    ds = add_mean(ds, "ratio_summary", ds["ratio"], DRAWS, long_name=ds["ratio"].attrs["long_name"],
                  description="mean of ratio over seed, pair")
    to_closed = (ds["ratio"] / ds["closed_form"]).assign_attrs(
        long_name="mean estimate / kernel: / the sphere closed form", units="1", baseline="closed_form",
        comparison="ratio", description="per draw, ratio / closed_form (1: the mean of rows uniform on the sphere "
                                        "of radius √d, SMREG's law)")
    ds = add_comparison(ds, "ratio_vs_closed_form", to_closed, DRAWS, statistic="mean")
    return add_paired(ds, "ratio", "regularized", DRAWS, op="difference", dim="sampler", statistic="mean")


def _closed(ds: xr.Dataset) -> xr.DataArray:
    """The closed form per (dim, level, feature_map) (equal for every seed: a function of d and the level)."""
    return ds["closed_form"].isel(num_pairs=0, seed=0, drop=True)


def _summary(ds: xr.Dataset, name: str) -> xr.DataArray:
    return ds[name].squeeze(("num_rows", "num_pairs"), drop=True)


def findings(ds: xr.Dataset) -> list[str]:
    """Markdown bullets; every number computed from ``ds`` (means over seeds × pairs with 95 % bootstrap
    intervals)."""
    s = _summary(ds, "ratio_summary")
    closed = _closed(ds)
    dims = [int(d) for d in s.dim.values]
    samplers = [str(v) for v in s.sampler.values]
    lo_d, hi_d = dims[0], dims[-1]
    level = "two_sqrt_d"

    def cell(sampler, dim, lvl=level, name="positive"):
        return fmt_ci(s.sel(sampler=sampler, dim=dim, level=lvl, feature_map=name))

    def cf(dim, lvl=level, name="positive"):
        return fmt(float(closed.sel(dim=dim, level=lvl, feature_map=name)))

    lines = []
    if {"sorf", "regularized"} <= set(samplers):
        control = (f"; Gaussian rows (iid) give {cell('iid', lo_d)} and {cell('iid', hi_d)}" if "iid" in samplers
                   else "")
        lines.append(
            f"SORF is not unbiased at Performer scaling: for a typical unit-variance pair ({LEVELS[level][2]}) "
            f"positive random features with SORF rows estimate {cell('sorf', lo_d)} of the kernel at d = {lo_d} and "
            f"{cell('sorf', hi_d)} at d = {hi_d}, close to SMREG ({cell('regularized', lo_d)}, "
            f"{cell('regularized', hi_d)}) and as the sphere closed form says ({cf(lo_d)}, {cf(hi_d)}){control}.")
    for dim in dims:
        lines.append(f"Mean estimate / kernel, positive features, {LEVELS[level][2]}, d = {dim}: "
                     + "; ".join(f"{name} {cell(name, dim)}" for name in samplers)
                     + f"; sphere closed form {cf(dim)}.")
    if {"sorf", "regularized"} <= set(samplers):
        lines.append(f"At {LEVELS['fixed_4'][2]} (a fixed norm: Yu et al.'s regime) the bias shrinks as d grows, as "
                     "the closed form's does: "
                     + "; ".join(f"d = {dim}: SORF {cell('sorf', dim, 'fixed_4')}, SMREG "
                                 f"{cell('regularized', dim, 'fixed_4')}, closed form {cf(dim, 'fixed_4')}"
                                 for dim in dims) + ".")
    if "sorf" in samplers:
        vs = _summary(ds, "ratio_vs_closed_form_summary").sel(sampler="sorf")
        inside = covers(vs, 1.0)
        text = (f"SORF's mean follows the sphere closed form (SMREG's law): over every d, level and map its mean "
                f"divided by the closed form has an interval containing 1 in {int(inside.sum())} of {inside.size} "
                f"cells (estimates "
                f"{range_text(vs.sel(stat='estimate').values, 3)})")
        if "ratio_vs_regularized_summary" in ds:
            diff = _summary(ds, "ratio_vs_regularized_summary").sel(sampler="sorf")
            resolved = ~covers(diff, 0.0)
            text += (f", and SORF − SMREG on the same pairs is {range_text(diff.sel(stat='estimate').values, 2)}, "
                     f"resolved from 0 in {int(resolved.sum())} of {resolved.size} cells"
                     + (": the two laws are close, not identical" if resolved.any() else ""))
        lines.append(text + f". At ‖x+y‖² = c√d the closed form tends to e^(−c²/4) as d grows ("
                     f"{fmt(math.exp(-1 / 16))}, {fmt(math.exp(-1 / 4))}, {fmt(math.exp(-1))} for c = 0.5, 1, 2), "
                     "not to 1.")
    if "oprf" in [str(v) for v in s.feature_map.values]:
        a_value = float(ds["oprf_A"].sel(level=level, dim=hi_d).isel(num_pairs=0, seed=0))
        lines.append(f"OPRF (A = {fmt(a_value)}) at d = {hi_d}, {LEVELS[level][2]}: "
                     + "; ".join(f"{name} {cell(name, hi_d, name='oprf')}" for name in samplers)
                     + f"; sphere closed form {cf(hi_d, name='oprf')}. For GERF-family maps the fixed norm enters "
                     "through e^(2A‖ω‖²) as well as through the projection; Gaussian norms (iid, sorf_chi) remove "
                     "both.")
    if "sorf_chi" in samplers:
        chi = s.sel(sampler="sorf_chi")
        dev = np.abs(chi.sel(stat="estimate") - 1.0)
        at = {k: v.item() for k, v in dev.argmax(...).items()}
        where = {k: chi[k].values[v] for k, v in at.items()}
        inside = covers(chi, 1.0)
        lines.append(f"sorf_chi (SORF directions, chi(d) norms): its interval contains 1 in {int(inside.sum())} of "
                     f"{inside.size} cells; the largest deviation is at d = {int(where['dim'])}, "
                     f"{LEVELS[str(where['level'])][2]}, {where['feature_map']}: "
                     f"{cell('sorf_chi', int(where['dim']), str(where['level']), str(where['feature_map']))}.")
    if "iid" in samplers:
        inside = covers(s.sel(sampler="iid"), 1.0)
        lines.append(f"Control: Gaussian rows (iid) contain 1 in {int(inside.sum())} of {inside.size} intervals.")
    lines.append(f"Each value pools {ds.sizes['seed']} seeds × {ds.sizes['pair']} pairs of "
                 f"{int(ds.num_rows.values[0])} rows each.")
    return lines


# ------------------------------------------------------------------------------------------------------ plot
def plot(ds: xr.Dataset, path) -> None:
    s = _summary(ds, "ratio_summary")
    closed = _closed(ds)
    maps = [str(v) for v in s.feature_map.values]
    levels = [str(v) for v in s.level.values]
    fig, axes = new_figure(len(maps), len(levels), squeeze=False, sharex=True, width=11.5, height=6.4)
    dims = s.dim.values.astype(float)
    for i, name in enumerate(maps):
        for j, c in enumerate(levels):
            ax = axes[i, j]
            ax.plot(dims, closed.sel(feature_map=name, level=c).values, color="black", linewidth=2.0,
                    label="sphere closed form")
            for k, sampler in enumerate(s.sampler.values):
                style = estimator_style(f"{name}_{sampler}" if sampler != "iid" else name)
                errorbar_summary(ax, s.sel(sampler=sampler, feature_map=name, level=c), dims * (1.0 + 0.03 * (k - 1.5)),
                                 color=SAMPLER_COLORS.get(str(sampler), "0.3"), marker=style["marker"],
                                 linestyle=style["linestyle"], ms=4, linewidth=1.0, label=str(sampler))
            ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(dims, [str(int(d)) for d in dims])
            ax.set_title(f"{name}: {LEVELS[c][2]}", fontsize=9)
            ax.set(xlabel="dimension d" if i == len(maps) - 1 else None, ylabel=None if j else "mean estimate / kernel")
    axes[0, min(1, len(levels) - 1)].legend(fontsize=7, loc="center", ncol=2)      # between the two groups of lines
    fig.suptitle("Bias of the SORF and SMREG samplers at Performer scaling", fontsize=11, fontweight="bold")
    save_figure(fig, path, (
        f"Mean of the kernel estimate divided by the kernel, E[SM̂]/SM, for one pair (x, y) with x = q/d^(1/4), "
        f"y = k/d^(1/4), unit-variance q, k rescaled to a level of ‖x+y‖² (columns; 2√d is a typical "
        f"independent pair), for positive features and OPRF (rows). Markers: mean over "
        f"{ds.sizes['seed']} seeds × {ds.sizes['pair']} pairs of the sign-averaged per-row product over "
        f"{int(ds.num_rows.values[0])} rows per draw; bars: 95 % percentile-bootstrap intervals. Black: closed form "
        "for rows uniform on the sphere of radius √d (exact for SMREG). iid: Gaussian rows (unbiased control); "
        "sorf_chi: SORF directions with chi(d) norms."))


DATA_AXES = ("dim", "num_pairs", "seed")
EXPERIMENT = Experiment.from_module(__name__, title="Bias of the SORF and SMREG samplers at Performer scaling",
                                    description=" ".join(__doc__.split("\n\n")[0].split()),
                                    replicates="the seeds × pairs")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
