"""The tables of the "Choosing an estimator" page, computed from the studies' datasets (``results/<name>.nc``).

Per task family and setting, at each memory budget (the state a decoder keeps, relative to exact attention's KV
cache on the same data), the estimator and configuration with the best mean score among those whose state fits,
its interval, the trivial baseline and exact attention on the same data, and whether it beats the baseline.

A dataset is read only when its values are those of the committed findings (``figures/<name>.md``, whose last line
names the data's digest): the page then describes the same data as the figures. A dataset that is absent, or
whose digest differs from its findings', is named with the reason instead of being tabulated.

One section is not a family of this kind: training from scratch against wall-clock seconds
(``benchmarks/training_curve.py``, :func:`training_curve_section`), a benchmark of the machine it ran on, read from
``results/training_curve.nc`` under the same digest rule, and "not measured on this machine" without it.

Statistics: one value per unit of replication (the feature draw or landmark fit and its data, i.e. the seed; the
text window for the language model, whose maps are drawn once), the mean over units with a 95 % cluster bootstrap
interval (:func:`kernapprox.stats.cluster_interval`: units resampled with their episodes). "Beats the baseline"
is a verdict: at least :data:`kernapprox.stats.MIN_UNITS` units and a paired exact test (Wilcoxon signed-rank on the
per-unit means of the difference to the baseline, or to a constant baseline such as chance) with p < 0.05, its
direction the better side; with fewer units the row says "not resolved" and is counted neither as beating the
baseline nor as losing to it. The best estimator is chosen by its point estimate; the choice itself is not a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- choosing:start -->", "<!-- choosing:end -->"
BUDGETS = ((1 / 64, "≤ 1/64"), (1 / 8, "≤ 1/8"), (1.0, "≤ 1×"))


@dataclass
class Candidate:
    """One estimator at one configuration: its per-entry scores (dims: the unit, then ``within``) and its state."""

    label: str
    fraction: float  # state bytes / exact attention's KV cache on the same data (median over units)
    values: xr.DataArray


@dataclass
class Setting:
    """One task setting of one study: the candidates, the trivial baseline and exact attention on the same data."""

    title: str
    candidates: list[Candidate]
    baseline: xr.DataArray | float | None  # per-entry (paired) or a constant; None: the dataset has none
    exact: xr.DataArray | float | None
    lower_better: bool
    unit: str = "seed"
    within: tuple = ()


@dataclass
class Family:
    """A section of the page: one study's settings, what is measured, and what the baseline is."""

    study: str
    heading: str
    metric: str
    baseline_name: str
    settings: list[Setting]
    text: str = ""


# --------------------------------------------------------------------------------------------------- statistics
def _interval(values: xr.DataArray, unit: str, within) -> tuple[float, float, float, int]:
    from kernapprox import stats

    within = tuple(d for d in within if d in values.dims)
    s = stats.cluster_interval(values.where(np.isfinite(values)), unit, within)
    return tuple(float(s.sel(stat=k)) for k in ("estimate", "lo", "hi")) + (int(s.sel(stat="count")),)


def _fmt(value: float) -> str:
    from kernapprox.plotting import fmt

    return fmt(value, 3)


def _fmt_ci(est: float, lo: float, hi: float) -> str:
    if not np.isfinite(lo):
        return _fmt(est)
    sep = " to " if lo < 0 else "–"
    return f"{_fmt(est)} ({_fmt(lo)}{sep}{_fmt(hi)})"


def _fraction(f: float) -> str:
    return f"1/{1 / f:.0f}" if f < 0.5 else f"{f:.2g}×"


def _score(c: Candidate, s: Setting) -> float:
    mean = float(c.values.where(np.isfinite(c.values)).mean())
    if not np.isfinite(mean):
        return np.inf
    return mean if s.lower_better else -mean


def _verdict(best: Candidate, s: Setting) -> str:
    """Whether the best candidate beats the trivial baseline: a verdict needs :data:`kernapprox.stats.MIN_UNITS`
    units and a paired exact test on the per-unit means (Wilcoxon signed-rank, :func:`kernapprox.stats.paired_test`,
    p < 0.05; against a per-entry baseline the paired difference, against a constant the difference from it), its
    direction that of the difference; with fewer units "not resolved (k units)"."""
    from kernapprox import stats

    if s.baseline is None:
        return "no baseline stored"
    diff = best.values - s.baseline
    est, lo, hi, units = _interval(diff, s.unit, s.within)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not separated"
    if units < stats.MIN_UNITS:
        return f"not resolved ({units} {s.unit}s)"
    p = float(stats.paired_test(diff.where(np.isfinite(diff)), s.unit, tuple(d for d in s.within if d in diff.dims)))
    side = stats.verdict(est, p, units)
    if side == "not resolved":
        return f"not separated (p = {p:.2g})"
    better = side == ("lower" if s.lower_better else "higher")
    return f"**{'beats it' if better else 'loses to it'}** (p = {p:.2g})"


def _reference(value, s: Setting) -> str:
    if value is None:
        return "not stored"
    if isinstance(value, xr.DataArray):
        return _fmt_ci(*_interval(value, s.unit, s.within)[:3])
    return _fmt(value)


def table(family: Family) -> tuple[str, list[str]]:
    """The markdown table of a family and the settings × budgets where nothing beats the baseline."""
    rows = ["| setting | state ≤ KV × | best (state / KV) | " + family.metric + " | against the baseline | "
            f"{family.baseline_name} | exact attention | units |", "|---|---|---|---|---|---|---|---|"]
    nothing = []
    for s in family.settings:
        baseline, exact = _reference(s.baseline, s), _reference(s.exact, s)
        for limit, name in BUDGETS:
            fits = [c for c in s.candidates if c.fraction <= limit and np.isfinite(_score(c, s))]
            if not fits:
                if s.baseline is not None:
                    nothing.append(f"{s.title}, {name} KV (none fits)")
                rows.append(f"| {s.title} | {name} | none fits | – | – | {baseline} | {exact} | – |")
                continue
            best = min(fits, key=lambda c: _score(c, s))
            est, lo, hi, units = _interval(best.values, s.unit, s.within)
            verdict = _verdict(best, s)
            if "beats" not in verdict and "not resolved" not in verdict and s.baseline is not None:
                nothing.append(f"{s.title}, {name} KV")
            rows.append(f"| {s.title} | {name} | {best.label} ({_fraction(best.fraction)}) | "
                        f"{_fmt_ci(est, lo, hi)} | {verdict} | {baseline} | {exact} | {units} {s.unit}s |")
    return "\n".join(rows), nothing


# ----------------------------------------------------------------------------------------------- the datasets
def _kv(n: int, d: int, d_v: int) -> float:
    from experiments._icl import kv_cache_bytes

    return float(kv_cache_bytes(int(n), int(d), int(d_v)))


def _candidates(ds, var, state, kv, axes, sel, label) -> list[Candidate]:
    """Every combination of ``axes`` (e.g. estimator, num_features) with a finite score at ``sel``."""
    out = []
    grid = ds[var].sel(sel)
    stacked = grid.stack(_c=list(axes))
    for i in range(stacked.sizes["_c"]):
        values = stacked.isel(_c=i).drop_vars(["_c", *axes], errors="ignore")
        if not bool(np.isfinite(values).any()):
            continue
        key = {a: stacked["_c"].values[i][j] for j, a in enumerate(axes)}
        size = float(state.sel(sel).sel(key).median()) if state is not None else np.nan
        if not np.isfinite(size):
            continue
        out.append(Candidate(label(key), size / kv, values))
    return out


def attention_error(ds: xr.Dataset) -> Family:
    d = int(ds["dim"])
    settings = []
    for causal in ds.causal.values:
        for beta in ds.beta.values:
            for n in ds.seq_len.values:
                sel = {"seq_len": n, "beta": beta, "causal": causal}
                uniform = ds["uniform_rel_rms_causal" if causal else "uniform_rel_rms"].sel(seq_len=n, beta=beta)
                if not bool(uniform.notnull().any()):
                    continue
                cands = _candidates(ds, "output_rel_rms", ds["state_bytes"], _kv(n, d, d),
                                    ("estimator", "num_features"), sel,
                                    lambda k: f"`{k['estimator']}` at B({k['num_features']})")
                settings.append(Setting(f"n = {n}, β = {beta:g}, {'causal' if causal else 'non-causal'}", cands,
                                        uniform, 0.0, lower_better=True))
    return Family("attention_error", "Attention output (synthetic Gaussian heads)", "relative RMS output error",
                  "uniform average of the values", settings,
                  f"Isotropic Gaussian queries and keys in d = {d} at inverse temperature β; "
                  "B(r) is the state of FAVOR+ at r features, and every estimator runs at its largest configuration "
                  "within it. Exact attention is the reference (error 0). The baseline ignores the keys.")


def icl_recall(ds: xr.Dataset) -> Family:
    chance = 1.0 / int(ds["num_candidates"])
    settings = []
    for n in ds.num_pairs.values:
        for factor in ds.beta_factor.values:
            for query in ds["query"].values:
                sel = {"num_pairs": n, "beta_factor": factor, "query": query}
                kv = float(ds["state_bytes_exact"].sel(sel).median())
                cands = _candidates(ds, "accuracy", ds["state_bytes"], kv, ("estimator", "num_features"), sel,
                                    lambda k: f"`{k['estimator']}`, r = {k['num_features']}")
                settings.append(Setting(f"{n} pairs, β = {factor:g}·ln n, query {query}", cands, chance,
                                        ds["accuracy_exact"].sel(sel), lower_better=False, within=("episode",)))
    return Family("icl_recall", "In-context recall (associative read-out)", "recall accuracy",
                  f"chance (1/{int(ds['num_candidates'])})", settings,
                  "Key–value pairs in context, a query near one key; the read-out is right when the output is "
                  "nearest its own value among the candidates. Queries: the key itself, noisy copies at a cosine, "
                  "or a paraphrase.")


def _icl_grid(ds, var, exact, kv, lower_better, title, baseline) -> list[Setting]:
    settings = []
    for n in ds.num_context.values:
        for beta in ds.beta.values:
            sel = {"num_context": n, "beta": beta}
            cands = _candidates(ds, var, ds["state_bytes"], float(kv.sel(num_context=n)),
                                ("estimator", "num_features"), sel,
                                lambda k: f"`{k['estimator']}`, r = {k['num_features']}")
            settings.append(Setting(title(n, beta), cands, baseline, ds[exact].sel(sel), lower_better,
                                    within=("episode",)))
    return settings


def icl_regression(ds: xr.Dataset) -> Family:
    from experiments.icl_regression import LABELS

    kv = xr.DataArray([_kv(n, int(ds["dim"]), LABELS) for n in ds.num_context.values], dims="num_context",
                      coords={"num_context": ds.num_context.values})
    settings = _icl_grid(ds, "nmse", "nmse_exact", kv, True, lambda n, b: f"n = {n}, β = {b:g}", 1.0)
    return Family("icl_regression", "In-context regression (Gaussian-process functions)", "normalised MSE",
                  "target mean (nMSE = 1)", settings,
                  "Attention as a kernel smoother of the context's labels. The nMSE is normalised by the variance "
                  "of the targets, so predicting their mean scores 1; the context mean scores about 1 (it is not "
                  "stored per episode).")


def icl_classification(ds: xr.Dataset) -> Family:
    from experiments.icl_classification import CLASSES

    settings = _icl_grid(ds, "accuracy", "accuracy_exact", ds["kv_bytes"], False,
                         lambda n, b: f"n = {n}, β = {b:g}", 1.0 / CLASSES)
    return Family("icl_classification", "In-context classification (digits)", "accuracy",
                  f"chance (1/{CLASSES})", settings,
                  "Labelled digits in context, the label of a new digit read out by attention. The majority class "
                  "of a context is not stored; chance is the baseline used here.")


def in_context_vs_in_weight(ds: xr.Dataset) -> Family:
    fixed = [str(p) for p in ds.predictor.values if str(p).startswith(("favor_", "nystrom_"))]
    settings = []
    query = "in_distribution" if "in_distribution" in ds.query_set.values else ds.query_set.values[0]
    for task in ds.task.values:
        for n in ds.num_context.values:
            kv = float(ds["memory"].sel(task=task, predictor="attention", num_context=n))
            err = ds["error"].sel(task=task, num_context=n, query_set=query)
            cands = [Candidate(f"`{p}`", float(ds["memory"].sel(task=task, predictor=p, num_context=n)) / kv,
                               err.sel(predictor=p)) for p in fixed
                     if bool(np.isfinite(err.sel(predictor=p)).any())]
            settings.append(Setting(f"{task}, n = {n}", cands, err.sel(predictor="trivial"),
                                    err.sel(predictor="attention"), True, within=("episode",)))
    return Family("in_context_vs_in_weight", "In-context against in-weight learners (fixed-state read-outs)",
                  "error (nMSE; classification: error rate)", "trivial predictor", settings,
                  f"The fixed-state read-outs of the study (FAVOR+ and Nyström at r = 16, 64) on its {query} "
                  "queries; the trivial predictor is the context mean (regression) or the majority label "
                  "(classification), on the same episodes. Kernel ridge, NTK and gradient descent keep "
                  "other states and are in the study's findings.")


def trained_icl(ds: xr.Dataset) -> Family:
    settings = []
    for task in ds.task.values:
        lower = str(task) != "mqar"
        for context in ds.context.values:
            at = {"task": task, "context": context}
            kv = float(ds["state_bytes"].sel({**at, "estimator": "exact", "substitution": "all"}).median())
            if not np.isfinite(kv):
                continue
            cands = []
            for sub in ("all", "trained"):
                if sub not in ds.substitution.values:
                    continue
                score = ds["score"].sel({**at, "substitution": sub}).drop_sel(estimator="exact")
                state = ds["state_bytes"].sel({**at, "substitution": sub})
                how = "post hoc" if sub == "all" else "trained"
                cands += [Candidate(f"`{c.label.split(';')[0]}`, r = {c.label.split(';')[1]}, {how}",
                                    c.fraction, c.values)
                          for c in _candidates(xr.Dataset({"score": score}), "score", state, kv,
                                               ("estimator", "num_features"), {},
                                               lambda k: f"{k['estimator']};{k['num_features']}")]
            settings.append(Setting(f"{task}, context {context}", cands, None, ds["score_exact"].sel(at), lower,
                                    within=("episode",)))
    return Family("trained_icl", "Trained models (MQAR recall, linear regression)",
                  "score (MQAR: accuracy; regression: squared error / d)", "trivial baseline", settings,
                  "Small Transformers trained with softmax attention, every layer's attention replaced post hoc, "
                  "or models trained from scratch with the feature map. The dataset stores no trivial baseline "
                  "(no MQAR chance, no zero predictor for regression; its least-squares and ridge references are "
                  "strong, not trivial), so the column is empty and no row says whether it beats one. The KV "
                  "cache is the softmax model's at the prompt's length; at these short prompts most "
                  "fixed states are larger than it.")


def recall_frontier(ds: xr.Dataset) -> Family:
    settings = []
    for setup in ds.setup.values:
        for pairs in ds.num_pairs.values:
            at = {"setup": setup, "num_pairs": pairs}
            kv = float(ds["kv_cache_bytes"].sel(at))
            acc = ds["test_accuracy_chosen"].sel(at)
            if "exact" not in acc.estimator.values or not np.isfinite(kv):
                continue
            cands = _candidates(xr.Dataset({"acc": acc.drop_sel(estimator="exact")}), "acc",
                                ds["state_bytes_config"].sel(at), kv, ("estimator", "num_features"), {},
                                lambda k: f"`{k['estimator']}`, r = {k['num_features']}, trained")
            exact = acc.sel(estimator="exact").dropna("num_features", how="all")
            settings.append(Setting(f"{setup}, N = {pairs} pairs", cands,
                                    float(ds["chance_pairs"].sel(num_pairs=pairs)),
                                    exact.isel(num_features=0) if exact.sizes["num_features"] else None, False))
    return Family("recall_frontier", "Trained fixed-state models against their memory (MQAR)",
                  "test accuracy at the learning rate chosen on validation data", "chance 1/N", settings,
                  "Small Transformers trained from scratch with each family at each state size (the same short "
                  "convolution in every model, softmax included, counted in its state); the KV cache is the "
                  "softmax model's at the prompt's length. The unit is the training seed; with 3 seeds the "
                  "intervals are wide and no verdict is drawn.")


def _lm(ds, var, axes, label, fixed: dict, title) -> list[Setting]:
    settings = []
    for context in ds.context.values:
        at = {"context": context, **{k: v for k, v in fixed.items() if k in ds.dims}}
        frac = ds["memory_fraction"].sel(at)
        cands = []
        score = ds[var].sel(at)
        stacked = score.stack(_c=list(axes))
        for i in range(stacked.sizes["_c"]):
            values = stacked.isel(_c=i).drop_vars(["_c", *axes], errors="ignore").squeeze(drop=True)
            if not bool(np.isfinite(values).any()):
                continue
            key = {a: stacked["_c"].values[i][j] for j, a in enumerate(axes)}
            f = float(frac.sel(key).median())
            if np.isfinite(f):
                cands.append(Candidate(label(key), f, values))
        settings.append(Setting(title(context), cands, ds["nll_unigram"].sel(context=context),
                                ds["nll_exact"].sel(context=context), True, unit="window"))
    return settings


def causal_lm(ds: xr.Dataset) -> Family:
    axes = [a for a in ("estimator", "num_features", "exact_layers", "placement") if a in ds.dims]
    settings = _lm(ds, "nll", axes, lambda k: f"`{k['estimator']}`, r = {k['num_features']}, "
                   f"{k.get('exact_layers', 0)} exact layers" + (f" ({k['placement']})" if k.get(
                       "exact_layers", 0) and "placement" in k else ""), {"map_seed": ds.map_seed.values[0]},
                   lambda c: f"{c} tokens")
    return Family("causal_lm", "A real language model (SmolLM2-135M, every layer converted post hoc)",
                  "next-token NLL (nats)", "unigram model", settings,
                  "Shakespeare windows; the unit is the text window (the feature maps are drawn once, "
                  f"map seed {int(ds.map_seed.values[0])}, so the interval says nothing about another draw).")


def distillation(ds: xr.Dataset) -> Family:
    last = float(ds.checkpoint.values.max())
    sub = ds.sel(checkpoint=last)
    axes = [a for a in ("student", "objective", "num_features") if a in sub.dims]
    settings = _lm(sub, "nll", axes, lambda k: f"`{k['student']}`, r = {k['num_features']}, {k['objective']}",
                   {"fit_loss": sub.fit_loss.values[0], "steps": sub.steps.values[0],
                    "train_seed": sub.train_seed.values[0]}, lambda c: f"{c} tokens")
    return Family("distillation", "A real language model, fine-tuned or distilled students", "next-token NLL (nats)",
                  "unigram model", settings,
                  "SmolLM2-135M students after stage 2 (objective none: the stage-1 or post-hoc student); "
                  "one training seed, so the unit is the text window.")


FAMILIES = {"attention_error": attention_error, "icl_recall": icl_recall, "icl_regression": icl_regression,
            "icl_classification": icl_classification, "in_context_vs_in_weight": in_context_vs_in_weight,
            "trained_icl": trained_icl, "recall_frontier": recall_frontier, "causal_lm": causal_lm,
            "distillation": distillation}
TITLES = {"attention_error": "Attention output", "icl_recall": "In-context recall", "icl_regression":
          "In-context regression", "icl_classification": "In-context classification", "in_context_vs_in_weight":
          "In-context against in-weight learners", "trained_icl": "Trained models", "recall_frontier":
          "Trained fixed-state models against their memory", "causal_lm":
          "A real language model", "distillation": "A real language model, fine-tuned or distilled students"}
# Studies the page names without a table, and why.
NOT_TABULATED = {
    "kernel_error": "measures the kernel matrix φ(Q)φ(K)ᵀ against exp(QKᵀ/√d) at equal rank, not a model's output, "
                    "and stores neither state bytes nor a trivial baseline; its figure ranks the maps at each r.",
    "rank_summary": "repeats the three ICL tasks above at one context size each with the SVD oracles added; its "
                    "figure puts them on the bytes axis.",
    "spectrum": "gives the rank an attention matrix needs for 1 % and 10 % error (SVD and the features the best "
                "Nyström and random-feature maps need), not an estimator's score at a budget; see its figure.",
    "modality_spectrum": "gives the same ranks per modality (text, music, video, a smooth reference) for trained "
                         "models.",
}


def _status(name: str, root: Path) -> tuple[xr.Dataset | None, str, str]:
    """``(dataset or None, digest, reason)``: the dataset when it is present and its digest is that of its
    committed findings."""
    from kernapprox.sweep import dataset_digest, read_digest

    path, findings = root / "results" / f"{name}.nc", root / "figures" / f"{name}.md"
    if not findings.exists():
        return None, "", f"no committed findings `figures/{name}.md` yet"
    expected = read_digest(findings.read_text(encoding="utf-8")) or ""
    if not path.exists():
        return None, expected, f"`results/{name}.nc` is not present in this checkout (run `make figures`)"
    with xr.open_dataset(path) as ds:
        ds = ds.load()
    digest = dataset_digest(ds)
    if digest != expected:
        return None, expected, (f"`results/{name}.nc` (digest {digest}) is not the data of the committed "
                                f"`figures/{name}.md` (digest {expected}); regenerate its figure first")
    return ds, digest, ""


TRAINING_CURVE = "training_curve"     # benchmarks/training_curve.py: read by its own section, not a Family


def sources(root: Path = ROOT) -> list[str]:
    """The datasets the page reads: the studies', then the training-curve benchmark's (so that the page is
    regenerated, and checked, only where every one of them is present: without it the section would differ)."""
    return [*FAMILIES, TRAINING_CURVE]


def generated_block(root: Path = ROOT) -> str:
    """The generated part of the page (between :data:`START` and :data:`END`)."""
    parts = [START, "<!-- generated by `python docs/generate.py choosing` from results/*.nc: do not edit -->", ""]
    summary, used = [], []
    for name, build in FAMILIES.items():
        ds, digest, reason = _status(name, root)
        if ds is None:
            parts += [f"## {TITLES[name]} (`{name}`)", "", f"Not tabulated: {reason}.", ""]
            continue
        family = build(ds)
        rows, nothing = table(family)
        used.append(f"`results/{name}.nc` (digest {digest})")
        parts += [f"## {family.heading}", "", f"From `results/{name}.nc` ({{ref}}`fig-{name}`). {family.text}", "",
                  rows, ""]
        total = len(family.settings) * len(BUDGETS)
        if not any(s.baseline is not None for s in family.settings):
            summary.append(f"{family.heading}: no baseline stored")
        elif nothing:
            parts += [f"Where no fixed-state estimator within the budget beats the {family.baseline_name} "
                      f"({len(nothing)} of {total} settings × budgets; none fits: the study has no "
                      "configuration that small): " + "; ".join(nothing) + ".", ""]
            fits = sum(not n.endswith("(none fits)") for n in nothing)
            summary.append(f"{family.heading}: {len(nothing)} of {total} ({fits} where an estimator fits)")
        elif "not resolved" in rows:
            parts += [f"No setting and budget where the best fixed-state estimator is shown not to beat the "
                      f"{family.baseline_name}; the rows marked not resolved have fewer than 10 units.", ""]
            summary.append(f"{family.heading}: 0 of {total} shown (some not resolved)")
        else:
            parts += [f"In every setting and budget some fixed-state estimator beats the {family.baseline_name}.", ""]
            summary.append(f"{family.heading}: 0 of {total}")
    section, read = training_curve_section(root)
    parts += section
    used += read
    parts += ["## Other studies", ""]
    parts += [f"- `{name}` is not tabulated: it {why}" for name, why in NOT_TABULATED.items()]
    parts += ["", "## In short", "", "Settings × budgets where nothing within the budget beats the trivial baseline, "
              "per family: " + "; ".join(summary) + ".", "", "Datasets read: " + ", ".join(used) + ".", "", END]
    return "\n".join(parts)


def training_curve_section(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(lines, datasets read)`` of the section on training from scratch against wall-clock seconds
    (``benchmarks/training_curve.py``, a benchmark of this machine, not a study of ``make figures``): per sequence
    length, softmax attention's steps, training seconds and final held-out loss, and the map with the lowest
    median loss at softmax's seconds. Without ``results/training_curve.nc`` (or when it is not the data of
    ``figures/training_curve.md``) the section says it was not measured on this machine."""
    lines = [f"## Training from scratch against wall-clock (`{TRAINING_CURVE}`)", ""]
    if not (root / "results" / f"{TRAINING_CURVE}.nc").exists():
        return lines + [f"Not tabulated: not measured on this machine (`results/{TRAINING_CURVE}.nc` is absent; "
                        "`make training-curve` measures it: it times the machine, so `make figures` does not run "
                        "it).", ""], []
    ds, digest, reason = _status(TRAINING_CURVE, root)
    if ds is None:
        return lines + [f"Not tabulated: not measured on this machine ({reason}).", ""], []
    from benchmarks.training_curve import summary

    rows = ["| n | softmax: steps, seconds, final loss | lowest loss at softmax's seconds | unigram |",
            "|---|---|---|---|"]
    for n, row in summary(ds).items():
        soft = row["models"]["softmax"]
        maps = {label: np.nanmedian(m["at_softmax_time"]) if np.isfinite(m["at_softmax_time"]).any() else np.inf
                for label, m in row["models"].items() if label != "softmax"}
        best = min(maps, key=maps.get) if maps else None
        best_text = "—" if best is None or not np.isfinite(maps[best]) else (
            f"{best}: {_fmt(maps[best])} (seeds {_fmt(np.nanmin(row['models'][best]['at_softmax_time']))}–"
            f"{_fmt(np.nanmax(row['models'][best]['at_softmax_time']))})")
        rows.append(f"| {n} | {_fmt(np.median(soft['steps']))}, {_fmt(np.median(row['softmax_seconds']))} s, "
                    f"{_fmt(np.median(row['softmax_loss']))} | {best_text} | {_fmt(np.median(row['unigram']))} |")
    text = (f"From `results/training_curve.nc` ({{doc}}`training_curve`): held-out next-byte loss (nats) of the same "
            "small Transformer trained from scratch with each attention for a budget of "
            f"{_fmt(ds.attrs['budget_s'])} s of training (forward, backward, optimiser), medians over the seeds "
            f"({ds.sizes['seed']}); measured on one machine under its load at the time "
            f"(load average {ds.attrs['load_average_1min_at_start']:.1f} on {ds.attrs['cpu_count']} CPUs): the "
            "times are that machine's, and the ranking can change with the machine and the budget.")
    return lines + [text, "", *rows, ""], [f"`results/training_curve.nc` (digest {digest})"]


def update_page(path: Path, *, check: bool = False, root: Path = ROOT) -> bool:
    """Rewrite the generated block of the page; with ``check`` only report whether it is current."""
    text = path.read_text(encoding="utf-8")
    start, end = text.index(START), text.index(END) + len(END)
    new = text[:start] + generated_block(root) + text[end:]
    if check or new == text:
        return new == text
    path.write_text(new, encoding="utf-8")
    return True
