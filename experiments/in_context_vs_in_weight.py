"""In-context against in-weight learning on the same examples: error against the number of examples n, in and out
of the training distribution, and against the memory each predictor keeps.

Data: the episodes of the ICL studies. ``regression`` (as ``icl_regression``): ``n`` points uniform on the sphere
S³ labelled by a Gaussian-process draw (squared-exponential covariance, lengthscale 0.7) plus noise 0.1, 64 fresh
queries scored by normalised MSE against the noise-free function (1 = predicting the mean). ``classification`` (as
``icl_classification``): ``n`` labelled digits images (standardised, unit norm) and 32 query images, scored by the
error rate. In-context predictors read the context without changing a weight: exact softmax attention as a
Nadaraya–Watson smoother with ``κ = exp(β qᵀk)`` (``attention``; its KV cache) and fixed-state approximations of
it (FAVOR+ ``positive_orthogonal`` and ``nystrom_uniform`` at r = 16 and 64; a Nyström map with more landmarks
than examples is not applicable). In-weight learners fit the same examples: kernel ridge regression with the
attention's own kernel and the same β (``kernel_ridge``), kernel ridge with the empirical neural tangent kernel of
a seeded two-layer ReLU network of width 256 at its initialisation (``ntk_ridge``), full-batch gradient descent on
that network (``gd``, centred so that it starts at zero; squared loss, or cross-entropy on one-hot labels for
classification; a fixed number of steps of size n/λ_max(Θ)) and the same steps on its linearisation, which the
NTK describes exactly (``ntk_linearised_gd``). Baselines: ``trivial`` (the context's mean label or majority
class) and ``nearest_neighbour`` (1-NN by cosine, the β → ∞ limit of attention). Reference (regression only):
``gp_posterior``, the posterior mean under the task's own covariance and noise, which is kernel ridge with the
attention's kernel at β = 1/ℓ² and ridge σ²; it is the best predictor linear in the context labels, so it bounds
the expected squared error of every predictor here that is linear in them (all but ``gd``). Out-of-distribution
queries: the same query points with their norm scaled by 0.5 and by 2, labelled as the in-distribution ones (the
label depends on the direction only: for digits a contrast change of the standardised image, for regression the
function of the direction); attention reads a scaled query as a change of its temperature, a fitted learner sees
an input it was never fitted near. Memory, in float32 numbers: attention, kernel ridge and the references keep
the n examples and one label or coefficient vector each (the KV cache, n (d + d_v)); a fixed state its own
accounting (kernapprox.memory: r (d_v + 1) plus Nyström's landmarks and whitening); the NTK predictors the examples,
their coefficients and the network at initialisation; gradient descent the trained and the initial parameters.
Design: every predictor reads the same episodes and the same network initialisation (the data draw of
``(task, n, seed)``); the unit of replication is the seed (its episodes are pooled within it), with cluster
bootstrap intervals over seeds and Wilcoxon signed-rank tests of the paired per-seed differences, Holm
adjusted within each task and query set. Left out: the trained in-context Transformer of ``trained_icl``
(``presets.reference("regression")``), since it is trained on another task (linear functions in d = 5 with at
most 11 examples, not these episodes) and its 3,750 training steps do not fit this study's budget.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from experiments._icl import EpisodeDraw, kv_cache_bytes
from kernapprox import in_weight, readout, stats, tasks
from kernapprox.kernel import log_kernel_matrix
from kernapprox.plotting import figure_legend, fmt, fmt_bytes, fmt_ci, log_axis, new_figure, plot_summary, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

TASKS = {"regression": (4, 1), "classification": (64, 10)}     # task -> (input dimension d, outputs d_v)
QUERY_SETS = {"in_distribution": 1.0, "norm_x0.5": 0.5, "norm_x2": 2.0}   # query set -> factor on the query norm
FIXED_STATE = {"favor_r16": ("positive_orthogonal", 16), "favor_r64": ("positive_orthogonal", 64),
               "nystrom_r16": ("nystrom_uniform", 16), "nystrom_r64": ("nystrom_uniform", 64)}
PREDICTORS = {  # label -> view; the module docstring says what each is
    "attention": "in-context", **{label: "in-context" for label in FIXED_STATE},
    "kernel_ridge": "in-weight", "ntk_ridge": "in-weight", "ntk_linearised_gd": "in-weight", "gd": "in-weight",
    "trivial": "baseline", "nearest_neighbour": "baseline", "gp_posterior": "reference",
}
IN_WEIGHT = [label for label, view in PREDICTORS.items() if view == "in-weight"]
HEADLINE_N = (32, 256)           # the example counts the findings compare the two views at
GD_DTYPE = torch.float32         # networks are trained in float32; kernels are solved in float64

GRIDS = {
    "smoke": {"task": list(TASKS), "predictor": list(PREDICTORS), "num_context": [16, 32], "seed": [0, 1]},
    "default": {"task": list(TASKS), "predictor": list(PREDICTORS), "num_context": [8, 16, 32, 64, 128, 256],
                "seed": list(range(16))},
    # make figures PRESET=full's share of its hour: the default's example counts over twice the seeds
    "full": {"task": list(TASKS), "predictor": list(PREDICTORS),
             "num_context": [8, 16, 32, 64, 128, 256], "seed": list(range(32))},
}
PARAMETERS = {
    "episodes": Parameter(4, "episodes per seed (pooled within the seed, the unit of replication)", "1"),
    "beta": Parameter(16.0, "inverse temperature β of attention and of kernel ridge's kernel exp(β xᵀy)", "1"),
    "ridge": Parameter(1e-3, "kernel ridge regulariser, relative to the kernel's mean diagonal", "1"),
    "width": Parameter(256, "hidden width m of the two-layer network (NTK and gradient descent)", "1"),
    "steps": Parameter(200, "full-batch gradient steps (gd and ntk_linearised_gd)", "1"),
    "lengthscale": Parameter(0.7, "lengthscale of the Gaussian-process target (regression)", "1"),
    "noise_std": Parameter(0.1, "standard deviation of the label noise (regression)", "1"),
    "regression_queries": Parameter(64, "query points per regression episode", "1"),
    "classification_queries": Parameter(32, "query images per classification episode", "1"),
}
AXIS_ATTRS = {
    "task": {"long_name": "task: regression of a GP draw on S³, or few-shot digits classification", "units": "1"},
    "predictor": {"long_name": "predictor (in-context read-out, in-weight learner, baseline or reference)",
                  "units": "1"},
    "num_context": {"long_name": "examples n (context points / training examples)", "units": "1"},
    "query_set": {"long_name": "queries: in distribution, or the same points with their norm scaled by 0.5 or 2",
                  "units": "1"},
}
METRICS = {
    "error": Metric(long_name="error", units="1",
                    description="per episode and query set: normalised MSE Σ(ŷ−f)²/Σ(f−f̄)² against the noise-free "
                                "function (regression), or the error rate 1 − accuracy (classification; a "
                                "non-finite score counts as wrong)",
                    dims=("episode", "query_set"), coords={"query_set": list(QUERY_SETS)}),
    "memory_bytes": Metric(long_name="memory the predictor keeps from the examples", units="byte",
                           description="float32 numbers: n (d + d_v) for attention, kernel ridge and the references "
                                       "(examples and one label or coefficient vector each); the fixed state's own "
                                       "accounting (kernapprox.readout.state_bytes); n (d + d_v) + P for the NTK "
                                       "predictors (P parameters of the network at initialisation); 2P for gradient "
                                       "descent (trained and initial parameters); d_v for the trivial baseline"),
}


# ------------------------------------------------------------------------------------------------- the draw
class Draw(EpisodeDraw):
    """One draw of ``(task, n, seed)``: the episodes, every query set stacked along the query axis
    (``queries (B, S·n_q, d)``), one network at initialisation per episode, and the kernel matrices the in-weight
    learners share, each computed once when first asked for."""

    def __init__(self, task: str, episodes, keys, values, query_points, network, params):
        scaled = torch.cat([factor * query_points for factor in QUERY_SETS.values()], dim=1)
        super().__init__(episodes, scaled, keys, values)
        self.task, self.network, self.params, self.num_queries = task, network, params, query_points.shape[1]
        self._memo: dict = {}

    def _once(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def exp_kernel(self, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K_XX, K_QX)`` of ``exp(β (xᵀy − 1))`` in float64: the attention's kernel up to the constant ``e^β``,
        which the relative ridge does not see."""
        x, q = self.keys.double(), self.queries.double()
        return self._once(("exp", beta), lambda: tuple(torch.exp(log_kernel_matrix(a, x, beta) - beta)
                                                       for a in (x, q)))

    def gp_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The task's covariance ``exp(−‖x − y‖²/(2ℓ²)) = exp((xᵀy − 1)/ℓ²)`` on the sphere, at the examples and at
        the queries' directions (the label is a function of the direction)."""
        beta = 1.0 / self.params["lengthscale"] ** 2
        x, q = self.keys.double(), self.queries.double()
        q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        return self._once("gp", lambda: tuple(torch.exp(log_kernel_matrix(a, x, beta) - beta) for a in (x, q)))

    def ntk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Θ_XX, Θ_QX)``: the empirical NTK of each episode's network at initialisation."""
        return self._once("ntk", lambda: (in_weight.two_layer_ntk(self.network, self.keys, self.keys),
                                          in_weight.two_layer_ntk(self.network, self.queries, self.keys)))

    def step_size(self) -> torch.Tensor:
        """``η = n/λ_max(Θ_XX)`` per episode, shared by gradient descent and its linearisation."""
        return self._once("lr", lambda: in_weight.ntk_step_size(self.ntk()[0]))

    def loss(self) -> str:
        return "mse" if self.task == "regression" else "cross_entropy"

    def score(self, outputs: torch.Tensor) -> np.ndarray:
        """Error per episode and query set, ``(B, S)``, of outputs ``(B, S·n_q, d_v)``."""
        parts = outputs.split(self.num_queries, dim=1)
        if self.task == "regression":
            cols = [tasks.normalized_mse(part, self.episodes) for part in parts]
        else:
            cols = [1.0 - tasks.classification_accuracy(part, self.episodes) for part in parts]
        return torch.stack(cols, dim=-1).cpu().numpy()


def draw(params, data_rng, device) -> Draw:
    """The episodes of ``(task, n, seed)`` (the generators and settings of the ICL studies), then one network per
    episode from the same data stream: every predictor reads the same examples and the same initialisation."""
    task, n, batch = params["task"], params["num_context"], params["episodes"]
    if task == "regression":
        ep = tasks.smooth_regression(n, dim=TASKS[task][0], num_queries=params["regression_queries"],
                                     lengthscale=params["lengthscale"], noise_std=params["noise_std"],
                                     num_outputs=TASKS[task][1], batch=batch, rng=data_rng, device=device)
        keys, values = ep.x, ep.y
    else:
        ep = tasks.digits_classification(n, num_queries=params["classification_queries"], batch=batch,
                                         rng=data_rng, device=device)
        keys, values = ep.x, ep.onehot
    d, d_v = TASKS[task]
    network = in_weight.init_two_layer(d, params["width"], d_v, batch=batch, rng=data_rng, device=device)
    return Draw(task, ep, keys, values, ep.x_query, network, params)


# -------------------------------------------------------------------------------------------------- the cell
def _float32_numbers(*counts: int) -> int:
    return 4 * int(sum(counts))


def predict(label: str, params, rng, data: Draw) -> tuple[torch.Tensor, int] | None:
    """``(outputs (B, S·n_q, d_v), memory bytes)`` of predictor ``label`` on the draw, or ``None`` where it does
    not apply."""
    task, n, beta = params["task"], params["num_context"], params["beta"]
    d, d_v = TASKS[task]
    examples = _float32_numbers(n * (d + d_v))           # n examples and one label or coefficient vector each
    parameters = data.network.num_parameters
    if label == "attention":
        return data.exact(beta).output, kv_cache_bytes(n, d, d_v)
    if label in FIXED_STATE:
        name, r = FIXED_STATE[label]
        if readout.estimator_capabilities(name).rank_limited_by_points and r > n:
            return None
        read = readout.attention_readout(name, data.queries, data.keys, data.values, beta=beta, num_features=r,
                                         rng=rng)
        return read.output, read.state_bytes
    if label == "kernel_ridge":
        return in_weight.kernel_ridge(*data.exp_kernel(beta), data.values, ridge=params["ridge"]), examples
    if label == "gp_posterior":
        if task != "regression":
            return None
        noise = params["noise_std"] ** 2                 # the prior's variance is 1: relative ridge = σ²
        return in_weight.kernel_ridge(*data.gp_kernel(), data.values, ridge=noise), examples
    if label == "ntk_ridge":
        return (in_weight.kernel_ridge(*data.ntk(), data.values, ridge=params["ridge"]),
                examples + _float32_numbers(parameters))
    if label == "ntk_linearised_gd":
        out = in_weight.linearised_gradient_descent(*data.ntk(), data.values, loss=data.loss(),
                                                    steps=params["steps"], lr=data.step_size())
        return out, examples + _float32_numbers(parameters)
    if label == "gd":
        start = in_weight.TwoLayerNetwork(*(p.to(GD_DTYPE) for p in data.network))
        trained = in_weight.gradient_descent(start, data.keys, data.values, loss=data.loss(), steps=params["steps"],
                                             lr=data.step_size())
        return in_weight.centred_forward(trained, start, data.queries), _float32_numbers(2 * parameters)
    if label == "trivial":                               # the context mean, or the class counts (argmax: majority)
        summary = data.values.double().mean(1, keepdim=True).expand(-1, data.queries.shape[1], -1)
        return summary, _float32_numbers(d_v)
    if label == "nearest_neighbour":
        nearest = (data.queries @ data.keys.transpose(-1, -2)).argmax(-1)
        return torch.gather(data.values, 1, nearest[..., None].expand(-1, -1, d_v)), examples
    raise ValueError(f"unknown predictor {label!r}; valid: {', '.join(PREDICTORS)}")


def run_cell(params, rng, device, data: Draw):
    result = predict(params["predictor"], params, rng, data)
    if result is None:
        return not_applicable()
    outputs, memory = result
    return {"error": data.score(outputs), "memory_bytes": np.float64(memory)}


def check_params(params) -> None:
    if params["predictor"] not in PREDICTORS:
        raise ValueError(f"predictor {params['predictor']!r} is not one of {', '.join(PREDICTORS)}")
    if params["task"] not in TASKS:
        raise ValueError(f"task {params['task']!r} is not one of {', '.join(TASKS)}")


# ------------------------------------------------------------------------------------------------ summaries
UNIT, WITHIN = "seed", ("episode",)


def _mean(ds: xr.Dataset, name: str, var: str, long_name: str) -> None:
    """``name``: the mean of ``var`` over seeds and their episodes, with its cluster-bootstrap interval (the seeds
    resampled, each with its episodes)."""
    summary = stats.cluster_interval(ds[var], UNIT, WITHIN)
    summary.attrs.update(long_name=long_name, units="1", description=f"mean of {var}: " + summary.attrs["interval"])
    ds[name] = summary


def summarise(ds: xr.Dataset) -> xr.Dataset:
    """Mean error per predictor with its interval; every predictor against exact attention on the same episodes
    (paired difference, its interval, the Wilcoxon p-value over seeds, Holm-adjusted within each task and query set
    over the in-weight learners and example counts); gradient descent against its linearisation; the median
    memory over seeds."""
    _mean(ds, "error_summary", "error", "mean error (normalised MSE or error rate)")
    pair = stats.paired(ds["error"], "predictor", "attention")
    pair.attrs.update(long_name="error minus exact attention's on the same episodes", units="1",
                      description="per episode and query set, error − error of attention (identical episodes)")
    ds["error_vs_attention"] = pair
    _mean(ds, "error_vs_attention_summary", "error_vs_attention", pair.attrs["long_name"])
    ds["error_vs_attention_summary"].attrs["neutral"] = 0.0
    p = stats.paired_test(pair, UNIT, WITHIN, test="wilcoxon")
    p.attrs["description"] = "two-sided Wilcoxon signed-rank test of the per-seed mean differences (exact without ties)"
    ds["error_vs_attention_p"] = p
    holm = xr.full_like(p, np.nan)
    for task in ds.task.values:
        for query_set in ds.query_set.values:
            at = {"task": task, "query_set": query_set, "predictor": IN_WEIGHT}
            holm.loc[at] = stats.holm(p.sel(at).values)
    holm.attrs = {"long_name": "Holm-adjusted p-value of error_vs_attention", "units": "1",
                  "description": "Holm's step-down adjustment within each task and query set over the in-weight "
                                 "learners and every example count (NaN for the other predictors)"}
    ds["error_vs_attention_p_holm"] = holm
    gd = ds["error"].sel(predictor="gd") - ds["error"].sel(predictor="ntk_linearised_gd")
    ds["gd_vs_linearised"] = gd.assign_attrs(
        long_name="gradient descent's error minus its linearisation's", units="1", comparison="difference",
        description="per episode and query set, error of gd − error of ntk_linearised_gd (the same network, "
                    "steps and step size)")
    _mean(ds, "gd_vs_linearised_summary", "gd_vs_linearised", ds["gd_vs_linearised"].attrs["long_name"])
    ds["gd_vs_linearised_p"] = stats.paired_test(ds["gd_vs_linearised"], UNIT, WITHIN, test="wilcoxon")
    ds["memory"] = ds["memory_bytes"].median("seed").assign_attrs(
        long_name="memory the predictor keeps from the examples (median over seeds)", units="byte",
        description="median over seeds of memory_bytes")
    return ds


# ---------------------------------------------------------------------------------------------------- figure
VIEW_STYLE = {"in-context": {"linestyle": "-"}, "in-weight": {"linestyle": "--"},
              "baseline": {"linestyle": ":"}, "reference": {"linestyle": (0, (5, 1, 1, 1))}}
MARKERS = {"attention": "*", "favor_r16": "v", "favor_r64": "^", "nystrom_r16": "<", "nystrom_r64": ">",
           "kernel_ridge": "o", "ntk_ridge": "s", "ntk_linearised_gd": "D", "gd": "P", "trivial": "x",
           "nearest_neighbour": "1", "gp_posterior": "h"}
COLORS = {"attention": "#000000", "favor_r16": "#9ecae1", "favor_r64": "#3182bd", "nystrom_r16": "#a1d99b",
          "nystrom_r64": "#31a354", "kernel_ridge": "#e6550d", "ntk_ridge": "#756bb1", "ntk_linearised_gd": "#bcbddc",
          "gd": "#d62728", "trivial": "#969696", "nearest_neighbour": "#636363", "gp_posterior": "#8c6d31"}


TITLES = {"in_distribution": "queries in distribution", "norm_x0.5": "query norm × 0.5", "norm_x2": "query norm × 2"}


def style(label: str) -> dict:
    return {"color": COLORS[label], "marker": MARKERS[label], "label": f"{label} ({PREDICTORS[label]})",
            **VIEW_STYLE[PREDICTORS[label]]}


def plot(ds: xr.Dataset, path) -> None:
    sets = list(ds.query_set.values)
    fig, axes = new_figure(len(ds.task), len(sets) + 1, squeeze=False, width=3.3 * (len(sets) + 1) + 2.6)
    summary = ds["error_summary"]
    for i, task in enumerate(ds.task.values.tolist()):
        for j, query_set in enumerate(sets):
            ax = axes[i, j]
            for label in ds.predictor.values.tolist():
                plot_summary(ax, summary.sel(task=task, predictor=label, query_set=query_set), "num_context",
                             positive=True, **style(label))
            log_axis(ax, "x", label="examples n")
            ax.set(ylabel="normalised MSE" if task == "regression" else "error rate",
                   title=f"{task}: {TITLES[query_set]}")
            ax.set_yscale("log")
        ax = axes[i, -1]
        for label in ds.predictor.values.tolist():
            at = ds["memory"].sel(task=task, predictor=label).values
            plot_summary(ax, summary.sel(task=task, predictor=label, query_set="in_distribution"), None,
                         xvalues=at, positive=True, **style(label))
        log_axis(ax, "x", label="memory kept (float32)", unit="bytes")
        ax.set(ylabel="normalised MSE" if task == "regression" else "error rate",
               title=f"{task}: against memory")
        ax.set_yscale("log")
        for ax in axes[i]:
            ax.set_ylim(*((5e-3, 30) if task == "regression" else (0.03, 1.2)))
    figure_legend(fig, axes.flat)
    save_figure(fig, path, (
        f"In-context against in-weight learning on the episodes of the ICL studies: regression of Gaussian-process "
        f"draws on S³ (normalised MSE, 1 = predicting the mean) and few-shot digits (error rate), against the number "
        f"of examples n, for queries in distribution and for the same queries with their norm scaled by 0.5 and 2 "
        f"(the label unchanged), and, in the last column, in distribution against the memory each predictor keeps "
        f"(float32; median over seeds). Solid: in-context read-outs (exact attention, β = {float(ds['beta']):g}, and "
        f"fixed-state approximations); dashed: in-weight learners fitted on the same examples (kernel ridge with "
        f"attention's kernel, ridge {float(ds['ridge']):g} relative; kernel ridge with the empirical NTK of a "
        f"width-{int(ds['width'])} two-layer ReLU network; {int(ds['steps'])} full-batch gradient steps on that "
        f"network and on its linearisation); dotted: baselines (context mean or majority class; 1-NN); dash-dot: "
        f"the Gaussian-process posterior (the best predictor linear in the labels). Lines: mean over "
        f"{ds.sizes['seed']} seeds × {ds.sizes['episode']} episodes (the same episodes and networks for every "
        f"predictor); bands: 95 % cluster-bootstrap intervals over seeds. Values beyond the axes are clipped."),
        title="In-context against in-weight learning: error against examples and memory")


# -------------------------------------------------------------------------------------------------- findings
def _verdict(ds: xr.Dataset, at: dict) -> str:
    """``lower``, ``higher`` or ``not resolved``: an in-weight learner's error against attention's (Holm-adjusted
    Wilcoxon p over at least :data:`kernapprox.stats.MIN_UNITS` seeds)."""
    est = float(ds["error_vs_attention_summary"].sel({**at, "stat": "estimate"}))
    return stats.verdict(est, float(ds["error_vs_attention_p_holm"].sel(at)), ds.sizes["seed"])


def findings(ds: xr.Dataset) -> list[str]:
    err, diff, holm = ds["error_summary"], ds["error_vs_attention_summary"], ds["error_vs_attention_p_holm"]
    ns = [n for n in HEADLINE_N if n in ds.num_context.values] or [int(ds.num_context.min()), int(ds.num_context.max())]
    learners = [m for m in IN_WEIGHT if m in ds.predictor.values]
    lines = [_tally(ds)]
    for task in ds.task.values.tolist():
        metric = "normalised MSE" if task == "regression" else "error rate"
        for query_set in ds.query_set.values.tolist():
            parts = []
            for n in ns:
                at = {"task": task, "query_set": query_set, "num_context": n}
                learned = "; ".join(
                    f"`{m}` {fmt_ci(err.sel({**at, 'predictor': m}))}: {VERDICT_WORDS[_verdict(ds, {**at, 'predictor': m})]} "  # noqa: E501
                    f"(difference {fmt_ci(diff.sel({**at, 'predictor': m}))}, p = "
                    f"{fmt(holm.sel({**at, 'predictor': m}), 2)})" for m in learners)
                parts.append(f"at n = {n}, attention {fmt_ci(err.sel({**at, 'predictor': 'attention'}))}; {learned}")
            lines.append(f"{task.capitalize()}, {QUERY_NAMES[query_set]}, {metric} (mean over seeds × episodes; "
                         "difference: learner − attention on the same episodes, Holm-adjusted p): "
                         + " — ".join(parts) + ".")
        lines.append(_crossing(ds, task))
    lines.append(_linearisation(ds, ns))
    lines.append(_fixed_state(ds, max(ns)))
    lines.append(_references(ds, ns))
    lines.append(_memory(ds, max(ns)))
    return lines


VERDICT_WORDS = {"lower": "better than attention", "higher": "worse than attention", "not resolved": "not resolved"}
QUERY_NAMES = {"in_distribution": "queries in distribution", "norm_x0.5": "queries scaled to norm 0.5",
               "norm_x2": "queries scaled to norm 2"}


def _tally(ds: xr.Dataset) -> str:
    """How often the in-weight learners are resolved better than, worse than or not separated from attention, in
    distribution and out of it, over every learner and example count of the grid."""
    learners = [m for m in IN_WEIGHT if m in ds.predictor.values]
    parts = []
    for task in ds.task.values.tolist():
        scaled = [q for q in ds.query_set.values.tolist() if q != "in_distribution"]
        for name, sets in (("in distribution", ["in_distribution"]), ("with scaled queries", scaled)):
            verdicts = [_verdict(ds, {"task": task, "predictor": m, "num_context": int(n), "query_set": q})
                        for m in learners for n in ds.num_context.values for q in sets]
            parts.append(f"{task} {name}: {verdicts.count('lower')} better, {verdicts.count('higher')} worse, "
                         f"{verdicts.count('not resolved')} not resolved of {len(verdicts)}")
    return (f"Against exact attention on the same episodes, the in-weight learners ({', '.join(learners)}) at every "
            f"n of the grid, by the Wilcoxon signed-rank test over {ds.sizes['seed']} seeds of "
            f"{ds.sizes['episode']} episodes (Holm-adjusted within each task and query set; better = lower mean "
            "error): " + "; ".join(parts) + ".")


def _crossing(ds: xr.Dataset, task: str) -> str:
    """Per in-weight learner and query set, the example counts at which it is resolved better or worse than
    attention: where the two views agree (neither) and where they part."""
    short = {"in_distribution": "in distribution", "norm_x0.5": "norm 0.5", "norm_x2": "norm 2"}
    parts = []
    for m in [m for m in IN_WEIGHT if m in ds.predictor.values]:
        sets = []
        for query_set in ds.query_set.values.tolist():
            at = {"task": task, "predictor": m, "query_set": query_set}
            verdicts = {int(n): _verdict(ds, {**at, "num_context": int(n)}) for n in ds.num_context.values}
            sets.append(f"{short[query_set]}: better at n = {_list([n for n, v in verdicts.items() if v == 'lower'])}"
                        f", worse at n = {_list([n for n, v in verdicts.items() if v == 'higher'])}")
        parts.append(f"`{m}` ({'; '.join(sets)})")
    return (f"{task.capitalize()}, where each in-weight learner is resolved better or worse than attention "
            f"(Holm-adjusted p < 0.05 over {ds.sizes['seed']} seeds; n of the grid: "
            f"{', '.join(str(int(n)) for n in ds.num_context.values)}): " + "; ".join(parts) + ".")


def _list(values) -> str:
    return ", ".join(map(str, values)) if values else "none"


def _linearisation(ds: xr.Dataset, ns) -> str:
    """Gradient descent against its linearisation (the network's departure from its NTK), and the linearisation
    against the solved NTK ridge (what the finite number of steps leaves unfitted)."""
    s, p, err = ds["gd_vs_linearised_summary"], ds["gd_vs_linearised_p"], ds["error_summary"]
    parts = []
    for task in ds.task.values.tolist():
        for n in ns:
            at = {"task": task, "num_context": n}
            shifts = ", ".join(f"{QUERY_NAMES[q]} {fmt_ci(s.sel({**at, 'query_set': q}))} (p = "
                               f"{fmt(p.sel({**at, 'query_set': q}), 2)})" for q in ds.query_set.values.tolist())
            ridge = {m: err.sel({**at, "query_set": "in_distribution", "predictor": m}) for m in
                     ("ntk_linearised_gd", "ntk_ridge")}
            parts.append(f"{task} at n = {n}: {shifts}; in distribution the linearisation's error "
                         f"{fmt_ci(ridge['ntk_linearised_gd'])} against NTK ridge's {fmt_ci(ridge['ntk_ridge'])}")
    return (f"Gradient descent on the network minus the same {int(ds['steps'])} steps on its linearisation (the "
            "learning its NTK describes), on the same episodes (Wilcoxon p over seeds, unadjusted): "
            + "; ".join(parts) + ".")


def _fixed_state(ds: xr.Dataset, n: int) -> str:
    diff = ds["error_vs_attention_summary"].sel(num_context=n, query_set="in_distribution")
    labels = [m for m in FIXED_STATE if m in ds.predictor.values]
    parts = [f"{task}: " + ", ".join(f"`{m}` {fmt_ci(diff.sel(task=task, predictor=m))}" for m in labels
                                     if np.isfinite(float(diff.sel(task=task, predictor=m, stat="estimate"))))
             for task in ds.task.values.tolist()]
    return (f"Fixed-state read-outs of attention at n = {n}, queries in distribution, error minus exact attention's "
            "on the same episodes: " + "; ".join(parts) + ".")


def _references(ds: xr.Dataset, ns) -> str:
    err = ds["error_summary"].sel(query_set="in_distribution")
    named = {"gp_posterior": "GP posterior", "nearest_neighbour": "1-NN", "trivial": "trivial"}
    parts = []
    for task in ds.task.values.tolist():
        for n in ns:
            at = err.sel(task=task, num_context=n)
            shown = [m for m in named if m in ds.predictor.values and np.isfinite(float(at.sel(predictor=m,
                                                                                               stat="estimate")))]
            parts.append(f"{task} at n = {n}: " + ", ".join(f"{named[m]} {fmt_ci(at.sel(predictor=m))}"
                                                             for m in shown))
    text = ("Baselines and reference, queries in distribution (trivial: the context's mean label or majority "
            "class; 1-NN: attention's β → ∞ limit): " + "; ".join(parts) + ".")
    if "gp_posterior" in ds.predictor.values and "regression" in ds.task.values:
        est = err.sel(task="regression", stat="estimate")
        others = est.drop_sel(predictor="gp_posterior")
        below = int((est.sel(predictor="gp_posterior") <= others.min("predictor")).sum())
        text += (f" The GP posterior (the best predictor linear in the labels for the task's covariance) has the "
                 f"lowest mean regression error of all predictors at {below} of the {ds.sizes['num_context']} n of "
                 "the grid.")
    return text


def _memory(ds: xr.Dataset, n: int) -> str:
    parts = []
    for task in ds.task.values.tolist():
        mem = ds["memory"].sel(task=task, num_context=n)
        shown = [m for m in ("attention", "favor_r64", "nystrom_r64", "kernel_ridge", "ntk_ridge", "gd")
                 if m in ds.predictor.values and np.isfinite(float(mem.sel(predictor=m)))]
        parts.append(f"{task}: " + ", ".join(f"`{m}` {fmt_bytes(float(mem.sel(predictor=m)))}" for m in shown))
    return f"Memory kept at n = {n} (float32 numbers): " + "; ".join(parts) + "."


DATA_AXES = ("task", "num_context", "seed")
EXPERIMENT = Experiment.from_module(
    __name__, replicates="the seeds (each with its episodes)",
    title="In-context against in-weight learning: error against examples, out of distribution and against memory")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
