"""Encoder distillation: what MiniLM's sentence embeddings keep when every attention layer becomes a fixed-size state.

The teacher is all-MiniLM-L6-v2 (:mod:`kernapprox.real`: a BERT encoder, 6 layers of 12 heads of dimension 32,
bidirectional attention), whose sentence embedding is the mean of its last hidden states over the tokens, normalised
to unit length (its sentence-transformers pooling). A student is its copy converted by :func:`kernapprox.convert`,
every layer substituted, one map per head: its attention over a window is then read from a fixed-size summary
``Σ_j φ(k_j) v_jᵀ`` (and ``Σ_j φ(k_j)``) of ``r (d_v + 1)`` numbers per head, where exact attention keeps every key
and value. Four students at ``num_features = r``:

* ``hedgehog`` (Zhang et al. 2024, ICLR, *The Hedgehog & the Porcupine*): trainable maps ``φ(x) = softmax([Wx,
  −Wx])`` fitted layer by layer to the teacher's attention on ``n_calibration`` calibration windows (attention
  transfer, :func:`kernapprox.trainable.fit_to_softmax` through ``ka.convert(..., calibration=)``) by the
  cross-entropy of the attention weights (``fit_loss="weights"``) or the MSE of the outputs (``"outputs"``,
  LoLCATs's: Zhang et al. 2025, ICLR, §3.1); its maps start at the identity, so it is the same student for every
  ``map_seed``;
* ``t2r`` (Kasai et al. 2021, EMNLP, eq. 4–5): trainable maps ``φ(x) = relu(Wx + b)`` plus ``1e-6``, randomly
  initialised (``map_seed``), fitted the same way;
* ``positive_orthogonal`` (FAVOR+, Choromanski et al. 2021) and ``nystrom_uniform`` (landmarks drawn from the
  calibration windows): post-hoc maps, no training; ``map_seed`` draws them.

For ``objective="embedding"`` a trained student then goes through stage 2: low-rank adapters
(:func:`kernapprox.surgery.finetuning.add_lora`, rank ``lora_rank``) on every layer's ``query``, ``key`` and
``value`` projections, trained with its maps for ``steps`` steps of ``batch_size`` windows of the text between the
calibration and the held-out windows, by the MSE between the student's and the teacher's sentence embeddings
(:func:`kernapprox.surgery.finetuning.finetune`, ``objective="embedding"``: Reimers & Gurevych 2020, EMNLP, eq. 1).
The encoder has no language-model head, so this embedding distillation stands where :mod:`experiments.distillation`
trains the causal LM by next-token loss or by its logits.

Every student is scored on the same held-out windows as the teacher (paired): ``n_windows`` windows of ``context``
WordPiece tokens of Python's documentation text (:func:`kernapprox.real.reference_text`, tokenised without special
tokens), taken from the end of the text, after the calibration windows, which come from its start. Per window: the
cosine between the student's and the teacher's embedding, and whether the student's embedding retrieves the teacher's
embedding of the same window as its nearest among the ``n_windows`` (top-1 retrieval). Trivial baselines (the
reference): the cosine of the mean teacher embedding of the calibration windows with each window's (a predictor
that reads no window), and retrieval's chance, ``1 / n_windows``. The state is set against the teacher's keys and
values at the window's length (``6 · 2 · context · 384`` float32 numbers). The unit of replication is the map draw
(``map_seed``); intervals are cluster bootstraps over the draws with each draw's windows, and paired comparisons
(a trained student against FAVOR+ at the same r) are tested by the exact Wilcoxon test over the draws, Holm-adjusted
over the study's family, with verdicts only with at least ten draws (the full preset).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments.distillation import AXIS_ATTRS as _DISTILLATION_AXES
from experiments.distillation import FIT_LOSSES, STATE_OF, STUDENTS, TRAINED
from kernapprox import memory, real, stats
from kernapprox.plotting import estimator_style, fmt, fmt_bytes, fmt_ci, new_figure, save_figure
from kernapprox.surgery.conversion import fit_records
from kernapprox.surgery.finetuning import add_lora, finetune
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

# the students, their trainable maps and their state accounting are distillation's (the same stage 1)
LAYERS, HEADS, HEAD_DIM, HIDDEN = 6, 12, 32, 384

GRIDS = {
    "smoke": {"student": list(STUDENTS), "fit_loss": ["weights"], "num_features": [16], "context": [64],
              "objective": ["none", "embedding"], "map_seed": [0, 1]},
    # ~5 min of one core: every student at two state sizes, three map draws, the trained ones through stage 2 too (a
    # description; the verdicts need the full preset's ten)
    "default": {"student": list(STUDENTS), "fit_loss": ["weights"], "num_features": [16, 64], "context": [128],
                "objective": ["none", "embedding"], "map_seed": [0, 1, 2]},
    # make figures PRESET=full's share of its hour (~17 min of one core): the default over ten map draws, the verdicts
    "full": {"student": list(STUDENTS), "fit_loss": ["weights"], "num_features": [16, 64], "context": [128],
             "objective": ["none", "embedding"], "map_seed": list(range(10))},
    # four state sizes, both stage-1 losses, two lengths, ten draws (not yet run; a rough estimate from the default's
    # cost: an hour of one core)
    "sizes": {"student": list(STUDENTS), "fit_loss": list(FIT_LOSSES), "num_features": [16, 32, 64, 128],
              "context": [128, 256], "objective": ["none"], "map_seed": list(range(10))},
}
DATA_AXES = REFERENCE_AXES = ("context",)    # the draw: the teacher, its held-out and calibration windows
PARAMETERS = {
    "n_windows": Parameter(64, long_name="held-out text windows (the scores' entries)", units="1",
                           description="the last n_windows whole windows of the text"),
    "n_calibration": Parameter(4, long_name="calibration windows of stage 1 and of the Nyström fit", units="1",
                               description="the first n_calibration windows of the text"),
    "fit_steps": Parameter(30, long_name="attention-transfer steps per layer", units="1"),
    "train_windows": Parameter(64, long_name="windows stage 2 draws from", units="1",
                               description="the text's windows right after the calibration windows (none of them "
                                           "held out)"),
    "steps": Parameter(32, long_name="stage-2 steps", units="1"),
    "batch_size": Parameter(4, long_name="windows per stage-2 step", units="1"),
    "lora_rank": Parameter(8, long_name="rank of the adapters on query, key and value", units="1"),
    "lr": Parameter(1e-3, long_name="AdamW learning rate of stage 2", units="1"),
}
OBJECTIVES = ("none", "embedding")
LORA_TARGETS = ("query", "key", "value")          # BERT's projections in its self-attention module
AXIS_ATTRS = {
    "student": {"long_name": "the student's attention",
                "description": "hedgehog, t2r: trainable maps fitted to the teacher's attention (stage 1); "
                               "positive_orthogonal, nystrom_uniform: post-hoc maps"},
    "fit_loss": _DISTILLATION_AXES["fit_loss"],
    "objective": {"long_name": "stage-2 objective",
                  "description": "none: the stage-1 (or post-hoc) student; embedding: adapters trained by the MSE of "
                                 "the sentence embeddings to the teacher's"},
    "num_features": {"long_name": "features per head r", "units": "1"},
    "context": {"long_name": "tokens per window", "units": "token"},
    "map_seed": {"long_name": "map draw (the unit of replication)", "units": "1"},
    "window": {"long_name": "held-out window", "units": "1"},
}
METRICS = {
    "cosine": Metric("cosine between the student's and the teacher's sentence embedding", "1",
                     "per held-out window: mean-pooled last hidden states, unit length", dims=("window",)),
    "retrieved": Metric("the student's embedding retrieves the teacher's of the same window", "1",
                        "1 if the teacher's embedding of the window is the nearest (cosine) to the student's among "
                        "the n_windows teacher embeddings", dims=("window",)),
    "state_bytes": Metric("bytes of the student's attention state over one window", "byte",
                          "6 layers × 12 heads × the state of one head (kernapprox.memory.probe_state_bytes at the "
                          "window's length: r (d_v + 1) float32 numbers for the trained maps and FAVOR+, more for "
                          "Nyström, whose fit is kept too)"),
    "stage1_cpu_seconds": Metric("CPU seconds of the attention transfer", "s",
                                 "every layer's fit (0 for post-hoc maps; Nyström's fit is not counted)"),
    "stage1_tokens": Metric("query positions the attention transfer trained on", "token",
                            "Σ over layers of FitRecord.tokens"),
    "stage2_cpu_seconds": Metric("CPU seconds of stage 2", "s", "FinetuneRecord.cpu_seconds (0 without stage 2)"),
    "stage2_tokens": Metric("positions stage 2 trained on", "token", "steps · batch_size · context"),
    "stage2_final_loss": Metric("stage-2 loss of the last step's windows", "1",
                                "mean ‖e_student − e_teacher‖² before the last update (NaN without stage 2)"),
}
REFERENCE_METRICS = {
    "cosine_mean_embedding": Metric("cosine of the mean calibration embedding with the teacher's", "1",
                                    "the trivial baseline: one embedding for every window (it reads none)",
                                    dims=("window",)),
    "retrieval_chance": Metric("chance of top-1 retrieval", "1", "1 / n_windows"),
    "kv_bytes": Metric("teacher's keys and values over one window", "byte", "6 · 2 · context · 384 · 4"),
}


def applicable(params) -> bool:
    """Post-hoc students carry ``fit_loss="weights"`` and ``objective="none"`` only (no attention transfer, no
    stage 2)."""
    return params["student"] in TRAINED or (params["fit_loss"] == "weights" and params["objective"] == "none")


def check_params(params) -> None:
    for axis, allowed in (("student", STUDENTS), ("fit_loss", FIT_LOSSES), ("objective", OBJECTIVES)):
        if params[axis] not in allowed:
            raise ValueError(f"{axis} must be one of {', '.join(allowed)}, got {params[axis]!r}")
    if params["student"] == "hedgehog" and params["num_features"] % 2:
        raise ValueError(f"num_features must be even (Hedgehog's r = 2 · feature_dim), got {params['num_features']}")
    if not 16 <= params["context"] <= 512:
        raise ValueError(f"context must be between 16 and 512 tokens (MiniLM's positions), got {params['context']}")


class Draw(NamedTuple):
    """The teacher, the held-out, calibration and stage-2 windows, and the teacher's embeddings of the held-out
    windows."""

    model: object
    windows: torch.Tensor
    calibration: torch.Tensor
    teacher: torch.Tensor
    reference: dict
    training: torch.Tensor | None = None


@functools.lru_cache(maxsize=1)
def _teacher():
    if real.unavailable_reason() is not None:
        raise RuntimeError(f"encoder_distillation needs all-MiniLM-L6-v2: {real.unavailable_reason()}")
    return real.load_model()


@torch.no_grad()
def embed(model, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Unit-length sentence embeddings ``(n, 384)`` float64 of windows ``ids`` ``(n, L)``
    (:func:`kernapprox.real.sentence_embedding`: all-MiniLM-L6-v2's mean pooling, normalised)."""
    out = [model(input_ids=ids[i:i + batch]).last_hidden_state.double() for i in range(0, ids.shape[0], batch)]
    return torch.cat([real.sentence_embedding(h) for h in out])


def draw(params, data_rng, device) -> Draw:
    model, tokenizer = _teacher()
    model = model.to(device)
    text, _ = real.reference_text()
    ids = torch.as_tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    context, n, m, t = params["context"], params["n_windows"], params["n_calibration"], params["train_windows"]
    whole = ids[: (ids.numel() // context) * context].view(-1, context)
    if whole.shape[0] < n + m + t:
        raise ValueError(f"the text has {whole.shape[0]} windows of {context} tokens, fewer than n_windows + "
                         f"n_calibration + train_windows = {n + m + t}")
    windows, calibration = whole[-n:].to(device), whole[:m].to(device)
    training = whole[m:m + t].to(device)
    teacher = embed(model, windows)
    mean = torch.nn.functional.normalize(embed(model, calibration).mean(0), dim=0)
    reference = {"cosine_mean_embedding": (teacher @ mean).cpu().numpy(), "retrieval_chance": 1.0 / n,
                 "kv_bytes": float(LAYERS * 2 * context * HIDDEN * 4)}
    return Draw(model, windows, calibration, teacher, reference, training)


def run_reference(params, device, data):
    return dict(data.reference)


def convert(data: Draw, params):
    """The cell's student and ``(cpu_seconds, tokens)`` of its attention transfer (0 for post-hoc maps)."""
    calibration = {"input_ids": data.calibration}
    if params["student"] in TRAINED:
        name, options = TRAINED[params["student"]]
        start = time.process_time()
        student = ka.convert(data.model, name, num_features=params["num_features"], rng=params["map_seed"],
                             calibration=calibration, fit_loss=params["fit_loss"], fit_steps=params["fit_steps"],
                             **options)
        return student, (time.process_time() - start, float(sum(r.tokens for r in fit_records(student).values())))
    student = ka.convert(data.model, params["student"], num_features=params["num_features"], rng=params["map_seed"],
                         calibration=calibration)
    return student, (0.0, 0.0)


def run_cell(params, rng, device, data):
    if not applicable(params):
        return not_applicable()
    student, (cpu, tokens) = convert(data, params)
    stage2 = {"stage2_cpu_seconds": 0.0, "stage2_tokens": 0.0, "stage2_final_loss": float("nan")}
    if params["objective"] == "embedding":
        add_lora(student, rank=params["lora_rank"], targets=LORA_TARGETS, rng=params["map_seed"])
        record = finetune(student, data.training, objective="embedding", teacher=data.model, steps=params["steps"],
                          batch_size=params["batch_size"], lr=params["lr"], rng=params["map_seed"])
        stage2 = {"stage2_cpu_seconds": record.cpu_seconds, "stage2_tokens": float(record.tokens),
                  "stage2_final_loss": record.losses[-1]}
    mine = embed(student, data.windows)
    similarity = mine @ data.teacher.T
    n = data.windows.shape[0]
    return {"cosine": similarity.diagonal().cpu().numpy(),
            "retrieved": (similarity.argmax(1).cpu() == torch.arange(n)).double().numpy(),
            "state_bytes": float(LAYERS * HEADS * memory.probe_state_bytes(
                STATE_OF[params["student"]], params["num_features"], d=HEAD_DIM, d_v=HEAD_DIM,
                seq_len=params["context"])),
            "stage1_cpu_seconds": cpu, "stage1_tokens": tokens, **stage2}


# ------------------------------------------------------------------------------------------------- summaries
def summarise(ds: xr.Dataset) -> xr.Dataset:
    for name in ("cosine", "retrieved"):
        ds[f"{name}_summary"] = stats.cluster_interval(ds[name], "map_seed", within=("window",)).assign_attrs(
            long_name=ds[name].attrs["long_name"] + ", mean over the map draws' windows", units="1")
    ds["cosine_mean_embedding_summary"] = stats.bootstrap_interval(
        ds["cosine_mean_embedding"], ("window",), "mean").assign_attrs(
        long_name="cosine of the mean calibration embedding with the teacher's, mean over windows", units="1")
    ds["memory_fraction"] = (ds["state_bytes"] / ds["kv_bytes"]).assign_attrs(
        long_name="student's state over the teacher's keys and values at the window's length", units="1",
        description="state_bytes / kv_bytes")
    trained = [s for s in ds["student"].values.tolist() if s in TRAINED]
    if trained and "positive_orthogonal" in ds["student"].values.tolist():
        post = ds["cosine"].sel(student="positive_orthogonal", fit_loss="weights", objective="none", drop=True)
        diff = ds["cosine"].sel(student=trained) - post
        ds["cosine_minus_favor"] = diff.assign_attrs(
            long_name="cosine of the trained student minus FAVOR+'s", units="1", comparison="difference",
            description="per window and map draw, the same r and windows")
        ds["cosine_minus_favor_summary"] = stats.cluster_interval(diff, "map_seed", within=("window",))
        ds["cosine_minus_favor_p"] = stats.paired_test(diff, "map_seed", within=("window",))
    if trained and "embedding" in ds["objective"].values.tolist():
        cos = ds["cosine"].sel(student=trained)
        diff = cos.sel(objective="embedding", drop=True) - cos.sel(objective="none", drop=True)
        ds["stage2_gain"] = diff.assign_attrs(
            long_name="cosine after stage 2 minus after stage 1", units="1", comparison="difference",
            description="per window and map draw, the same student, r and windows")
        ds["stage2_gain_summary"] = stats.cluster_interval(diff, "map_seed", within=("window",))
        ds["stage2_gain_p"] = stats.paired_test(diff, "map_seed", within=("window",))
    return ds


# ---------------------------------------------------------------------------------------------------- figure
def _cells(ds: xr.Dataset):
    """``(student, fit_loss, objective, r, context)`` of the students that ran (over every map draw)."""
    sub = ds["state_bytes"].isel(map_seed=0, drop=True).transpose("student", "fit_loss", "objective", "num_features",
                                                                  "context")
    dims = sub.dims
    return [{d: sub[d].values.tolist()[i] for d, i in zip(dims, idx)}
            for idx in zip(*np.nonzero(np.isfinite(sub.values)))]


def _label(cell) -> str:
    if cell["student"] not in TRAINED:
        return f"{cell['student']} (post hoc)"
    stage = " + LoRA, embedding distillation" if cell["objective"] == "embedding" else " stage 1"
    return f"{cell['student']} ({cell['fit_loss']}){stage}"


def plot(ds: xr.Dataset, path) -> None:
    fig, axes = new_figure(1, 2, width=13, height=4.8)
    context = int(ds["context"].values[-1])
    cells = [c for c in _cells(ds) if c["context"] == context]
    groups: dict = {}
    for cell in cells:
        groups.setdefault((cell["student"], cell["fit_loss"], cell["objective"]), []).append(cell)
    for (student, fit_loss, objective), members in groups.items():
        members = sorted(members, key=lambda c: c["num_features"])
        x = [float(ds["state_bytes"].sel(**c).isel(map_seed=0)) / 2**10 for c in members]
        style = {k: v for k, v in estimator_style(student if student not in TRAINED else
                                                  {"hedgehog": "hedgehog", "t2r": "relu"}[student]).items()
                 if k != "label"}
        if fit_loss == "outputs":
            style["linestyle"] = ":"
        if objective == "embedding":
            style.update(linestyle="--", marker="s")
        for ax, name in zip(axes, ("cosine_summary", "retrieved_summary")):
            s = [ds[name].sel(**c) for c in members]
            est, lo, hi = (np.array([float(v.sel(stat=k)) for v in s]) for k in ("estimate", "lo", "hi"))
            ax.errorbar(x, est, yerr=[est - lo, hi - est], capsize=2, label=_label(members[0]), **style)
    kv = float(ds["kv_bytes"].sel(context=context)) / 2**10
    base = float(ds["cosine_mean_embedding_summary"].sel(context=context, stat="estimate"))
    axes[0].axhline(1.0, color="k", linewidth=1.2, label="teacher (exact attention)")
    axes[0].axhline(base, color="0.5", linestyle=":", label="mean calibration embedding (reads no window)")
    axes[1].axhline(1.0, color="k", linewidth=1.2, label="teacher (exact attention)")
    axes[1].axhline(float(ds["retrieval_chance"].sel(context=context)), color="0.5", linestyle=":", label="chance")
    for ax, title, ylabel in ((axes[0], "(a) embedding fidelity", "cosine with the teacher's embedding"),
                              (axes[1], "(b) retrieval of the teacher's embedding", "top-1 accuracy")):
        ax.axvline(kv, color="0.6", linewidth=1.0, label=f"teacher's keys and values ({context} tokens)")
        ax.set_xscale("log")
        ax.set_xlabel("attention state over one window (KiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    axes[1].legend(fontsize=6.5, loc="lower right")
    fig.suptitle("MiniLM's attention as a fixed-size state: what the sentence embedding keeps")
    save_figure(fig, path, (
        f"all-MiniLM-L6-v2 with every layer's attention substituted, {ds.sizes['window']} held-out windows of "
        f"{context} WordPiece tokens of Python's documentation; one line per student over r = "
        f"{', '.join(str(r) for r in ds['num_features'].values)} features per head, at its state's bytes. (a) Mean "
        "cosine between the student's and the teacher's sentence embedding; grey dotted: the mean calibration "
        "embedding (a predictor that reads no window). (b) Top-1 retrieval of the teacher's embedding of the same "
        "window among all; grey dotted: chance. Dotted lines: attention transfer by outputs; dashed with squares: "
        "the trained students after stage 2 (adapters by embedding distillation). Intervals: cluster "
        f"bootstrap over {ds.sizes['map_seed']} map draws, each with its windows. Vertical line: the teacher's keys "
        "and values over one window."), title="Encoder distillation")


# -------------------------------------------------------------------------------------------------- findings
SHORT = {"hedgehog": "Hedgehog", "t2r": "T2R", "positive_orthogonal": "FAVOR+", "nystrom_uniform": "Nyström"}


def _headline(ds: xr.Dataset) -> str:
    """The largest r at the longest windows: every student's mean cosine, against the trivial predictor's."""
    context, r = int(ds["context"].values.max()), int(ds["num_features"].values.max())
    several = ds.sizes.get("fit_loss", 1) > 1
    parts = []
    for c in _cells(ds):
        if c["context"] != context or c["num_features"] != r:
            continue
        name = (SHORT[c["student"]] + (f" ({c['fit_loss']})" if several and c["student"] in TRAINED else "")
                + (" + stage 2" if c["objective"] == "embedding" else ""))
        parts.append(f"{name} {fmt(float(ds['cosine_summary'].sel(**c, stat='estimate')), 2)}")
    base = float(ds["cosine_mean_embedding_summary"].sel(context=context, stat="estimate"))
    return (f"At r = {r} features per head and {context}-token windows, the cosine of the student's sentence "
            f"embedding with the teacher's (mean over {ds.sizes['map_seed']} map draws): " + ", ".join(parts)
            + f"; a predictor that reads no window, {fmt(base, 2)}.")


def findings(ds: xr.Dataset) -> list[str]:
    lines = [_headline(ds)]
    m = ds.sizes["map_seed"]
    for context in ds["context"].values.tolist():
        kv = float(ds["kv_bytes"].sel(context=context))
        base = ds["cosine_mean_embedding_summary"].sel(context=context)
        chance = float(ds["retrieval_chance"].sel(context=context))
        lines.append(f"Teacher at {context}-token windows ({ds.sizes['window']} held-out windows; keys and values "
                     f"{fmt_bytes(kv)}): the trivial predictor (the mean calibration embedding) has cosine "
                     f"{fmt_ci(base)} with the teacher's embedding; retrieval's chance is {fmt(chance, 2)}.")
        for r in ds["num_features"].values.tolist():
            parts = []
            for cell in (c for c in _cells(ds) if c["context"] == context and c["num_features"] == r):
                cos, ret = ds["cosine_summary"].sel(**cell), ds["retrieved_summary"].sel(**cell)
                below = float(cos.sel(stat="hi")) < float(base.sel(stat="lo"))
                parts.append(f"{_label(cell)} cosine {fmt_ci(cos)}, retrieval {fmt_ci(ret, percent=True)}"
                             + (" (below the trivial predictor)" if below else "")
                             + f" at {fmt_bytes(float(ds['state_bytes'].sel(**cell).isel(map_seed=0)))} "
                             f"({fmt(float(ds['memory_fraction'].sel(**cell).isel(map_seed=0)), 2)} of the keys and "
                             "values)")
            lines.append(f"At r = {r} and {context} tokens (means over {m} map draws, cluster bootstrap over the "
                         "draws): " + "; ".join(parts) + ".")
    if "cosine_minus_favor_summary" in ds:
        summary, p = ds["cosine_minus_favor_summary"], ds["cosine_minus_favor_p"]
        family = [c for c in _cells(ds) if c["student"] in TRAINED]
        raw = np.array([float(p.sel(**c)) for c in family])
        adjusted = stats.holm(raw)
        for cell, p_adj in zip(family, adjusted):
            s = summary.sel(**cell)
            word = stats.verdict(float(s.sel(stat="estimate")), float(p_adj), int(s.sel(stat="count")))
            lines.append(f"{_label(cell)} minus FAVOR+ at r = {cell['num_features']}, {cell['context']} tokens, "
                         f"cosine: {fmt_ci(s)} (exact Wilcoxon over {m} map draws, Holm over the {len(family)} "
                         f"comparisons: p = {fmt(float(p_adj), 2)}, "
                         + ("not resolved" if word == "not resolved" else f"{_label(cell)} {word}") + ").")
    if "stage2_gain_summary" in ds:
        summary, p = ds["stage2_gain_summary"], ds["stage2_gain_p"]
        family = [c for c in _cells(ds) if c["student"] in TRAINED and c["objective"] == "embedding"]
        adjusted = stats.holm(np.array([float(p.sel(**{k: v for k, v in c.items() if k != "objective"}))
                                        for c in family]))
        for cell, p_adj in zip(family, adjusted):
            s = summary.sel(**{k: v for k, v in cell.items() if k != "objective"})
            word = stats.verdict(float(s.sel(stat="estimate")), float(p_adj), int(s.sel(stat="count")))
            lines.append(f"Stage 2 ({int(ds['stage2_tokens'].sel(**cell).isel(map_seed=0))} tokens of embedding "
                         f"distillation) on {cell['student']} ({cell['fit_loss']}) at r = {cell['num_features']}, "
                         f"{cell['context']} tokens, cosine after minus before: {fmt_ci(s)} (exact Wilcoxon over "
                         f"{m} map draws, Holm over the {len(family)} comparisons: p = {fmt(float(p_adj), 2)}, "
                         + ("not resolved" if word == "not resolved" else f"stage 2 {word}") + ").")
    for cell in (c for c in _cells(ds) if c["student"] in TRAINED and m > 1):
        spread = ds["cosine"].sel(**cell)
        if float((spread.max("map_seed") - spread.min("map_seed")).max()) == 0:
            lines.append(f"{_label(cell)} at r = {cell['num_features']}, {cell['context']} tokens, is the same "
                         f"student in all {m} draws (its maps start at the identity and its fit is deterministic), "
                         "so its interval over the draws is a point: the spread over other texts is not measured.")
    costs = [f"{_label(c)} at r = {c['num_features']}, {c['context']} tokens: stage 1 "
             f"{fmt(float(ds['stage1_cpu_seconds'].sel(**c).mean('map_seed')), 2)} CPU-s on "
             f"{int(ds['stage1_tokens'].sel(**c).isel(map_seed=0))} query positions"
             + (f", stage 2 {fmt(float(ds['stage2_cpu_seconds'].sel(**c).mean('map_seed')), 2)} CPU-s on "
                f"{int(ds['stage2_tokens'].sel(**c).isel(map_seed=0))} tokens" if c["objective"] == "embedding" else "")
             for c in _cells(ds) if c["student"] in TRAINED]
    if costs:
        lines.append("Cost, mean over the map draws: " + "; ".join(costs) + ".")
    return lines


EXPERIMENT = Experiment.from_module(
    __name__, title="Distilling MiniLM's attention into fixed-state students: what the sentence embedding keeps")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
