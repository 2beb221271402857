"""``python -m benchmarks.training_curve``: training from scratch, held-out loss against wall-clock seconds.

The question a new user asks before choosing a feature map: *if I train a small causal Transformer with linear
attention instead of softmax attention, how low does the loss get in the same time on my machine, at long
sequences?* Linear attention ``y = W φ(q) / <z, φ(q)>`` (Katharopoulos et al. 2020, *Transformers are RNNs*,
eq. 4–7) costs ``O(n r d)`` per sequence where softmax attention costs ``O(n² d)``, so at long ``n`` it makes more
steps per second; whether that buys a lower loss in the same time depends on how much each step of the cheaper
model is worth. This program measures it.

Task
    Next-byte prediction of Shakespeare's text (:class:`kernapprox.tasks.NextStep` with source ``"text"``: the
    same bytes the ``modality_spectrum`` study trains on; a 75 / 25 % train / held-out split of the corpus) with a
    context of ``n`` ∈ {2048, 4096, 8192, 16384} bytes. Text is used rather than MQAR because its loss is
    meaningful at every length and every position without rescaling the task: an MQAR prompt of 16k tokens needs
    thousands of key–value pairs and a vocabulary to match (the ``recall_frontier`` recipe is calibrated at
    ``L ≤ 96``), while the loss of every next byte of a 16k-byte window is the ordinary language-model loss.
    The trivial baseline is the unigram byte distribution of the training block
    (:meth:`~kernapprox.tasks.NextStep.baseline_losses`), drawn on every panel.
Model
    The library's :class:`~kernapprox.models.CausalTransformer` (:func:`kernapprox.models.build_model`): 2 pre-norm
    blocks with MLPs, width 32, 2 heads (``d_h = 16``), learned positions; the same architecture, initialisation
    stream and data for every attention, only the attention differs. Softmax attention (``AttentionSpec()``:
    torch's ``scaled_dot_product_attention``, causal) is the reference. Linear attention runs in the causal
    ``chunked`` mode (chunk 64), whose training step uses the compiled CPU backward where eligible
    (:mod:`kernapprox.attention.native`). The maps (:data:`MAPS`), each at two feature sizes ``r`` per head:
    ``elu1`` (Katharopoulos et al. 2020, eq. 7; ``r`` = the query/key projection width), ``taylor2`` (Based,
    Arora et al. 2024: the 2nd-order Taylor map of ``exp`` after a projection to ``f`` dimensions,
    ``r = 1 + f + f(f+1)/2``), ``positive_orthogonal`` (FAVOR+, Choromanski et al. 2021: ``r`` positive orthogonal
    random features, drawn once) and ``hedgehog_trainable`` (Zhang et al. 2024, *The Hedgehog & the Porcupine*: a
    trainable per-head map, ``softmax([Wu, -Wu])``, ``r = 2 · feature_dim``, :mod:`kernapprox.trainable`, whose
    parameters train with the model).
Measure: a fixed wall-clock budget per model, not a fixed number of steps
    Each ``(model, n, seed)`` trains until its **training seconds** — the wall time of forward, loss, backward,
    gradient clipping and the optimiser step, summed over steps; data sampling and evaluation are not counted —
    reach the budget (``--budget-s``, the same for every model at every ``n``; the step that crosses it
    finishes). A fixed step count would hand the slow model (softmax at 16k) many times the seconds of the fast
    ones and answer another question (sample efficiency); the user's question is what a second buys. The
    held-out loss (mean next-byte cross-entropy in nats on ``EVAL_WINDOWS`` fixed windows of ``n`` bytes of the
    held-out block, the same windows for every model of a seed) is measured at step 0 and after the steps that
    cross ``CHECKPOINTS`` fractions of the budget. Seconds per step: the median over a run's steps after the
    first (the first carries one-time costs). The process's CPU seconds over the training seconds give each
    run's CPU utilisation: well below the thread count means the run waited for cores (a shared machine).
Paired data
    Every model of a seed reads the same training batches in the same order (step ``k`` of every model is the same
    ``BATCH`` windows) and is evaluated on the same held-out windows; the seed also sets the initialisation.
    The unit of replication is the seed; with two or three seeds the findings give the median and the seeds'
    range, no test.
Optimiser
    AdamW (β = (0.9, 0.98), no weight decay), learning rate :data:`LR` with a linear warm-up over
    :data:`WARMUP_STEPS` steps, then constant (a schedule that needs the number of steps in advance cannot be used
    under a time budget), gradient-norm clip 1. One rate for every model: not tuned per map.
State bytes
    What a decoder keeps per token generated, float32, summed over layers and heads: ``r (d_h + 1)`` numbers per head
    for a map (the state ``W`` and normaliser ``z``), ``2 n d_h`` for softmax's **KV cache** (marked as such).

It times this machine, so it is not part of ``make figures``: ``make training-curve`` runs it. Writes
``results/training_curve.nc`` (with the run's provenance: git revision, torch version, threads, machine, load
average at start and end), ``figures/training_curve.png`` and ``figures/training_curve.md`` (findings, every number
computed from the dataset). ``--quick``: short sequences and budget (about a minute; a smoke test, not a
measurement), written to ``results/training_curve_quick.{nc,png,md}``: it never replaces the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from kernapprox import backends
from kernapprox.attention import native
from kernapprox.models import AttentionSpec, ModelConfig, build_model, presets
from kernapprox.provenance import dependency_record, record_id, report_digest
from kernapprox.sweep import write_provenance
from kernapprox.tasks import NextStep
from kernapprox.tasks.sequence import unavailable_reason
from kernapprox.timing import provenance

from .run import write_dataset

SOURCE = "text"
D_MODEL, NUM_LAYERS, NUM_HEADS = 32, 2, 2
HEAD_DIM = D_MODEL // NUM_HEADS
BATCH = 2                  # windows per training step
EVAL_WINDOWS = 2
LR = 1e-2
WARMUP_STEPS = 5
CHUNK = 64
CHECKPOINTS = (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)

# label -> (estimator, r); "softmax" is the reference
MAPS = {
    "softmax": ("exact", None),
    "elu1 r=16": ("elu1", 16), "elu1 r=64": ("elu1", 64),
    "taylor2 r=15": ("taylor2", 15), "taylor2 r=45": ("taylor2", 45),
    "FAVOR+ r=16": ("positive_orthogonal", 16), "FAVOR+ r=64": ("positive_orthogonal", 64),
    "hedgehog r=16": ("hedgehog_trainable", 16), "hedgehog r=64": ("hedgehog_trainable", 64),
}
PRESETS = {
    "full": {"lengths": [2048, 4096, 8192, 16384], "seeds": [0, 1], "models": list(MAPS), "budget_s": 8.0},
    "quick": {"lengths": [128, 256], "seeds": [0], "models": ["softmax", "elu1 r=16", "hedgehog r=16"],
              "budget_s": 1.0},
}


# ------------------------------------------------------------------------------------------------ models
def attention_spec(label: str) -> AttentionSpec:
    """The attention of model ``label`` (:data:`MAPS`)."""
    name, r = MAPS[label]
    if name == "exact":
        return AttentionSpec()
    if name == "hedgehog_trainable":
        return AttentionSpec(name, num_features=r, mode="chunked")
    return presets.attention_spec(name, r)          # chunked mode; elu1 / taylor2 through the q/k projection


def feature_dim(label: str) -> int | None:
    """``r`` per head as realised (``None``: softmax)."""
    name, r = MAPS[label]
    if name == "taylor2":
        f = presets.taylor2_qk_dim(r)
        return 1 + f + f * (f + 1) // 2
    return r


def state_bytes(label: str, n: int) -> int:
    """float32 bytes a decoder keeps, summed over layers and heads: ``r (d_h + 1)`` per head for a map, the KV
    cache ``2 n d_h`` for softmax."""
    r = feature_dim(label)
    per_head = 2 * n * HEAD_DIM if r is None else r * (HEAD_DIM + 1)
    return 4 * per_head * NUM_HEADS * NUM_LAYERS


def model_config(label: str, n: int) -> ModelConfig:
    return ModelConfig(d_model=D_MODEL, num_layers=NUM_LAYERS, num_heads=NUM_HEADS, mlp=True, max_len=n,
                       attention=attention_spec(label), chunk_size=CHUNK)


# ------------------------------------------------------------------------------------------------ training
@dataclass
class Run:
    """One training run: the held-out loss at each checkpoint (step 0 first), the training seconds and steps there,
    the seconds of every step, the CPU utilisation and why it stopped."""

    elapsed: list
    loss: list
    steps: list
    step_times: list
    cpu_utilisation: float
    status: str


def _seed_data(task: NextStep, seed: int, steps: int) -> tuple[list, object]:
    """The seed's training batches (``steps`` of them, in order) and held-out windows: the same for every model."""
    train_ss, eval_ss = np.random.SeedSequence([seed, 0x7C]).spawn(2)
    gen = np.random.default_rng(train_ss)
    batches = [task.sample(gen, BATCH) for _ in range(steps)]
    held_out = task.evaluation().sample(np.random.default_rng(eval_ss), EVAL_WINDOWS)
    return batches, held_out


@torch.no_grad()
def _held_out_loss(model, task: NextStep, batch) -> float:
    model.eval()
    return float(task.score(model(batch.inputs), batch).mean())


def train_for(label: str, task: NextStep, seed: int, batches: list, held_out, budget_s: float) -> Run:
    """Train model ``label`` from its seed's initialisation on ``batches`` (in order) until its training seconds
    reach ``budget_s``; held-out loss at step 0 and after each step that crosses a :data:`CHECKPOINTS` fraction."""
    model = build_model(model_config(label, task.seq_len), task, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    marks = [f * budget_s for f in CHECKPOINTS]
    elapsed, cpu = 0.0, 0.0
    out = Run([0.0], [_held_out_loss(model, task, held_out)], [0], [], float("nan"), "budget reached")
    step = 0
    while elapsed < budget_s:
        if step >= len(batches):
            batches.append(task.sample(_extra_gen(seed, len(batches)), BATCH))   # same for every model of the seed
        batch = batches[step]
        for group in opt.param_groups:
            group["lr"] = LR * min(1.0, (step + 1) / WARMUP_STEPS)
        model.train()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = task.loss(model(batch.inputs), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        cpu += time.process_time() - c0
        elapsed += dt
        step += 1
        out.step_times.append(dt)
        if not math.isfinite(float(loss.detach())):
            out.status = f"non-finite training loss at step {step}"
            out.elapsed.append(elapsed), out.loss.append(float("nan")), out.steps.append(step)
            break
        if any(out.elapsed[-1] < m <= elapsed for m in marks) or elapsed >= budget_s:
            out.elapsed.append(elapsed), out.loss.append(_held_out_loss(model, task, held_out))
            out.steps.append(step)
    out.cpu_utilisation = cpu / (elapsed * torch.get_num_threads()) if elapsed > 0 else float("nan")
    return out


def _extra_gen(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, 0x7D, index]))


def _warm_up(labels: list[str]) -> None:
    """One untimed step of every model at a short length: loads the compiled operators and torch's lazy state
    before anything is timed (its seconds are not counted anywhere)."""
    task = NextStep(SOURCE, seq_len=256)
    batch = task.sample(np.random.default_rng(0), BATCH)
    for label in labels:
        model = build_model(model_config(label, 256), task, 0)
        task.loss(model(batch.inputs), batch).backward()


# ------------------------------------------------------------------------------------------------ dataset
def to_dataset(runs: dict, labels: list[str], lengths: list[int], seeds: list[int], unigram: dict,
               budget_s: float, attrs: dict) -> xr.Dataset:
    ncp = 1 + len(CHECKPOINTS)
    shape = (len(labels), len(lengths), len(seeds))
    elapsed = np.full((*shape, ncp), np.nan)
    loss = np.full((*shape, ncp), np.nan)
    steps_at = np.full((*shape, ncp), np.nan)
    total_steps = np.full(shape, np.nan)
    train_s = np.full(shape, np.nan)
    sps = np.full(shape, np.nan)
    util = np.full(shape, np.nan)
    status = np.full(shape, "not run", dtype=object)
    for (i, label), (j, n), (k, seed) in ((a, b, c) for a in enumerate(labels) for b in enumerate(lengths)
                                          for c in enumerate(seeds)):
        run = runs.get((label, n, seed))
        if run is None:
            continue
        m = len(run.elapsed)
        elapsed[i, j, k, :m], loss[i, j, k, :m], steps_at[i, j, k, :m] = run.elapsed, run.loss, run.steps
        total_steps[i, j, k] = len(run.step_times)
        train_s[i, j, k] = sum(run.step_times)
        times = run.step_times[1:] if len(run.step_times) > 1 else run.step_times
        sps[i, j, k] = float(np.median(times)) if times else np.nan
        util[i, j, k], status[i, j, k] = run.cpu_utilisation, run.status
    dims4, dims3 = ("model", "seq_len", "seed", "checkpoint"), ("model", "seq_len", "seed")
    sb = np.array([[state_bytes(label, n) for n in lengths] for label in labels], dtype=np.float64)
    data = {
        "elapsed_s": (dims4, elapsed, {"long_name": "training seconds", "units": "s",
                                       "description": "wall time of forward + loss + backward + clip + optimiser "
                                                      "step summed up to the checkpoint (evaluation and data "
                                                      "sampling excluded)"}),
        "eval_loss": (dims4, loss, {"long_name": "held-out loss", "units": "nat",
                                    "description": f"mean next-byte cross-entropy on {EVAL_WINDOWS} held-out windows "
                                                   "of seq_len bytes (the same for every model of a seed)"}),
        "step": (dims4, steps_at, {"long_name": "optimiser steps at the checkpoint", "units": "1"}),
        "steps": (dims3, total_steps, {"long_name": "optimiser steps in the budget", "units": "1"}),
        "train_seconds": (dims3, train_s, {"long_name": "training seconds of the run", "units": "s",
                                           "description": "budget_s plus the overshoot of the last step"}),
        "seconds_per_step": (dims3, sps, {"long_name": "seconds per training step", "units": "s",
                                          "description": "median over the run's steps after the first "
                                                         f"({BATCH} windows of seq_len bytes each)"}),
        "cpu_utilisation": (dims3, util, {"long_name": "CPU utilisation while training", "units": "1",
                                          "description": "process CPU seconds / (training seconds x torch threads); "
                                                         "well below 1: the run waited for cores"}),
        "status": (dims3, status.astype(str), {"long_name": "how the run ended"}),
        "state_bytes": (("model", "seq_len"), sb, {"long_name": "decoder state", "units": "byte",
                                                  "description": "float32, summed over layers and heads: r (d_h + 1) "
                                                                 "per head for a map; softmax: its KV cache "
                                                                 "2 n d_h (is_kv_cache = 1)"}),
        "is_kv_cache": ("model", np.array([int(MAPS[m][0] == "exact") for m in labels]),
                        {"long_name": "state_bytes is a KV cache", "units": "1"}),
        "estimator": ("model", np.array([MAPS[m][0] for m in labels]), {"long_name": "attention (registry name)"}),
        "num_features": ("model", np.array([feature_dim(m) or np.nan for m in labels], dtype=np.float64),
                         {"long_name": "features per head r", "units": "1", "description": "NaN for softmax"}),
        "unigram_loss": (("seq_len", "seed"),
                         np.array([[unigram.get((n, s), np.nan) for s in seeds] for n in lengths]),
                         {"long_name": "trivial baseline: unigram loss", "units": "nat",
                          "description": "cross-entropy of the training block's byte frequencies on the held-out "
                                         "windows"}),
    }
    coords = {"model": labels, "seq_len": ("seq_len", np.asarray(lengths), {"units": "byte"}),
              "seed": seeds, "checkpoint": ("checkpoint", np.array([0.0, *CHECKPOINTS]),
                                            {"long_name": "fraction of the budget (0: step 0)"})}
    return xr.Dataset(data, coords=coords, attrs={**attrs, "budget_s": budget_s})


# ------------------------------------------------------------------------------------------------ findings
def _loss_by(ds, label, n, seed, seconds: float) -> float:
    """Held-out loss at the last checkpoint within ``seconds`` of training (NaN: none after step 0 there)."""
    t = ds["elapsed_s"].sel(model=label, seq_len=n, seed=seed).values
    y = ds["eval_loss"].sel(model=label, seq_len=n, seed=seed).values
    ok = np.isfinite(t) & np.isfinite(y) & (t <= seconds * (1 + 1e-9))
    return float(y[ok][np.argmax(t[ok])]) if ok.any() else float("nan")


def _time_to(ds, label, n, seed, target: float) -> float:
    """Training seconds of the first checkpoint whose loss is at most ``target`` (inf: not reached)."""
    t = ds["elapsed_s"].sel(model=label, seq_len=n, seed=seed).values
    y = ds["eval_loss"].sel(model=label, seq_len=n, seed=seed).values
    ok = np.isfinite(t) & np.isfinite(y) & (y <= target) & (t > 0)
    return float(t[ok].min()) if ok.any() else math.inf


def summary(ds: xr.Dataset) -> dict:
    """Per ``n`` and model, over seeds: softmax's final loss and training seconds, each model's loss at softmax's
    seconds, its seconds to softmax's final loss, its final loss and seconds per step (lists per seed)."""
    out = {}
    seeds = [int(s) for s in ds["seed"].values]
    for n in ds["seq_len"].values:
        n = int(n)
        ref_t = [float(ds["train_seconds"].sel(model="softmax", seq_len=n, seed=s)) for s in seeds]
        ref_loss = [_loss_by(ds, "softmax", n, s, math.inf) for s in seeds]
        rows = {}
        for label in ds["model"].values:
            label = str(label)
            rows[label] = {
                "at_softmax_time": [_loss_by(ds, label, n, s, t) for s, t in zip(seeds, ref_t)],
                "time_to_softmax_loss": [_time_to(ds, label, n, s, y) for s, y in zip(seeds, ref_loss)],
                "final": [_loss_by(ds, label, n, s, math.inf) for s in seeds],
                "sec_per_step": [float(ds["seconds_per_step"].sel(model=label, seq_len=n, seed=s)) for s in seeds],
                "steps": [float(ds["steps"].sel(model=label, seq_len=n, seed=s)) for s in seeds],
            }
        out[n] = {"softmax_seconds": ref_t, "softmax_loss": ref_loss, "models": rows,
                  "unigram": [float(ds["unigram_loss"].sel(seq_len=n, seed=s)) for s in seeds]}
    return out


def _best_at_softmax_time(row: dict) -> tuple[str | None, float]:
    """The map with the lowest median loss at softmax's seconds, and that loss (``None``: no map)."""
    best, value = None, math.inf
    for label, m in row["models"].items():
        v = np.asarray(m["at_softmax_time"], dtype=np.float64)
        if label != "softmax" and np.isfinite(v).any() and np.nanmedian(v) < value:
            best, value = label, float(np.nanmedian(v))
    return best, value


def _headline(s: dict) -> str:
    """The first sentence (the gallery's): at the shortest and the longest n, the map with the lowest loss in
    softmax's training seconds against softmax and the unigram baseline."""
    parts = []
    for n in sorted({min(s), max(s)}):
        row = s[n]
        best, value = _best_at_softmax_time(row)
        soft = f"softmax {np.median(row['softmax_loss']):.3g} after {np.median(row['softmax_seconds']):.3g} s"
        lead = f"{best} {value:.3g}" if best else "no map"
        parts.append(f"at n = {n}, {lead} against {soft} (unigram {np.median(row['unigram']):.3g})")
    return ("Lowest median held-out loss (nats/byte) reached by a linear-attention map within softmax attention's "
            f"training seconds, same budget for every model: {'; '.join(parts)}.")


def _med(values, digits=3, unit="") -> str:
    v = np.asarray(values, dtype=np.float64)
    if np.all(np.isinf(v) & (v > 0)):
        return "not reached"
    fin = v[np.isfinite(v)]
    if fin.size == 0:
        return "n/a"
    text = f"{np.median(fin):.{digits}g}{unit}"
    if v.size > 1:
        lo, hi = (f"{x:.{digits}g}" if math.isfinite(x) else "not reached" for x in (v.min(), v.max()))
        text += f" ({lo}–{hi})"
        if fin.size < v.size:
            text += f", reached by {fin.size} of {v.size} seeds"
    return text


def _slope(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y) & (y > 0)
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0]) if ok.sum() >= 2 else float("nan")


def findings(ds: xr.Dataset) -> str:
    """The findings page, every number computed from ``ds``."""
    from kernapprox.plotting import fmt_bytes

    s = summary(ds)
    a = ds.attrs
    seeds = ds.sizes["seed"]
    lines = [
        "# Training from scratch: held-out loss against wall-clock seconds",
        "",
        _headline(s),
        "",
        f"Next-byte prediction of Shakespeare (`NextStep('text')`), a {NUM_LAYERS}-layer width-{D_MODEL} "
        f"{NUM_HEADS}-head Transformer, {BATCH} windows of n bytes per step, each model trained for "
        f"{a['budget_s']:g} training seconds (forward + backward + optimiser) per n and seed; {seeds} seed(s); "
        f"{a['torch_num_threads']} torch thread(s) on the machine {a['machine']}, {a['device_name']}; load average "
        f"{a['load_average_1min_at_start']:.2f} at the start and {a['load_average_1min_at_end']:.2f} at the end "
        f"(the machine has {a['cpu_count']} CPUs; a load above that means the runs shared the cores and every "
        f"time is longer than on a quiet machine). Median CPU utilisation of the runs: "
        f"{np.nanmedian(ds['cpu_utilisation'].values):.2f}. git {a['git_revision']}, torch {a['torch_version']}. "
        "Losses in nats per byte; medians over seeds with the seeds' range in brackets. 'Loss at softmax's "
        "seconds': the held-out loss at a model's last checkpoint within the training seconds softmax used (its "
        "last step may overshoot the budget; the other models stop at their own budget, so there it is their final "
        "loss, which favours softmax). 'Seconds to softmax's final loss': the training seconds of a model's first "
        "checkpoint at or below softmax's final loss of the same seed (checkpoints after the steps crossing "
        f"{', '.join(f'{c:g}' for c in CHECKPOINTS)} of the budget, so an upper bound).",
        "",
    ]
    for n, row in s.items():
        lines.append(f"## n = {n}")
        lines.append("")
        lines.append(f"Softmax: {_med(row['models']['softmax']['steps'])} steps in "
                     f"{_med(row['softmax_seconds'], unit=' s')}, final held-out loss "
                     f"{_med(row['softmax_loss'])}; unigram baseline {_med(row['unigram'])}.")
        lines.append("")
        lines.append("| model | state | s / step | steps | loss at softmax's seconds | seconds to softmax's final "
                     "loss | final loss |")
        lines.append("|---|---|---|---|---|---|---|")
        for label, m in row["models"].items():
            sb = float(ds["state_bytes"].sel(model=label, seq_len=n))
            kv = " (KV cache)" if int(ds["is_kv_cache"].sel(model=label)) else ""
            lines.append(f"| {label} | {fmt_bytes(sb)}{kv} | {_med(m['sec_per_step'])} | {_med(m['steps'])} | "
                         f"{_med(m['at_softmax_time'])} | {_med(m['time_to_softmax_loss'], unit=' s')} | "
                         f"{_med(m['final'])} |")
        lines.append("")
    lengths = [int(n) for n in ds["seq_len"].values]
    if len(lengths) >= 2:
        lines.append("## Seconds per step against n")
        lines.append("")
        for label in ds["model"].values:
            med = ds["seconds_per_step"].sel(model=label).median("seed").values
            lines.append(f"- {label}: log-log slope {_slope(lengths, med):.2f} "
                         f"({med[0]:.3g} s at n = {lengths[0]}, {med[-1]:.3g} s at n = {lengths[-1]}).")
        lines.append("")
        n = lengths[-1]
        ref = np.median(s[n]["softmax_loss"])
        better = [str(lb) for lb, m in s[n]["models"].items()
                  if lb != "softmax" and np.nanmedian(m["at_softmax_time"]) < ref]
        lines.append(f"At n = {n}, the models whose median loss at softmax's seconds is below softmax's final loss: "
                     f"{', '.join(better) if better else 'none'}.")
        lines.append("")
    lines.append("Not measured: peak memory (the process's resident set is shared by every run); the learning rate "
                 f"is one ({LR:g}) for every model, not tuned per map.")
    lines.append("")
    lines.append(digest_line(ds))
    return "\n".join(lines) + "\n"


def digest_line(ds: xr.Dataset) -> str:
    """The findings' last line in the studies' form (:func:`kernapprox.sweep.read_digest` reads it): the dataset's
    digest (timings excluded) and the digest of the code that made it, as the run recorded it (``code_digest``;
    a dataset without it names none)."""
    from kernapprox.sweep import dataset_digest

    code = ds.attrs.get("code_digest")
    return (f"<!-- findings of results/training_curve.nc (benchmarks.training_curve); data digest "
            f"{dataset_digest(ds)}" + (f"; code {code}" if code else "") + " -->")


# ------------------------------------------------------------------------------------------------ figure
def plot(ds: xr.Dataset, path: str) -> None:
    from kernapprox.plotting import fmt_bytes, new_figure, palette, save_figure

    lengths = [int(n) for n in ds["seq_len"].values]
    labels = [str(m) for m in ds["model"].values]
    others = [m for m in labels if m != "softmax"]
    colors = {**palette(others), "softmax": "#000000"}
    ncols = 3
    nrows = math.ceil((len(lengths) + 2) / ncols)
    fig, axes = new_figure(nrows, ncols, squeeze=False)
    axes = axes.ravel()
    for ax, n in zip(axes, lengths):
        for label in labels:
            for seed in ds["seed"].values:
                t = ds["elapsed_s"].sel(model=label, seq_len=n, seed=seed).values
                y = ds["eval_loss"].sel(model=label, seq_len=n, seed=seed).values
                ok = np.isfinite(t) & np.isfinite(y)
                ax.plot(t[ok], y[ok], color=colors[label], lw=1.6 if label == "softmax" else 1.0,
                        marker=".", ms=3, alpha=0.85, label=label if seed == ds["seed"].values[0] else None)
        uni = float(ds["unigram_loss"].sel(seq_len=n).mean())
        ax.axhline(uni, color="#777777", ls=":", lw=1, label="unigram baseline")
        ax.set_title(f"n = {n}")
        ax.set_xlabel("training seconds (fwd + bwd + optimiser)")
        ax.set_ylabel("held-out loss [nat/byte]")
    ax = axes[len(lengths)]
    for label in labels:
        med = ds["seconds_per_step"].sel(model=label).median("seed").values
        ax.plot(lengths, med, color=colors[label], marker="o", ms=3, lw=1.6 if label == "softmax" else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("seconds per step")
    ax.set_title("step time")
    ax = axes[len(lengths) + 1]
    for label in labels:
        ax.plot(lengths, ds["state_bytes"].sel(model=label).values, color=colors[label], marker="o", ms=3,
                ls="--" if label == "softmax" else "-", lw=1.6 if label == "softmax" else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(fmt_bytes)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("decoder state")
    ax.set_title("state bytes (softmax dashed: KV cache)")
    for extra in axes[len(lengths) + 2:]:
        extra.set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=7)
    caption = (f"Held-out next-byte loss of Shakespeare against training seconds, one panel per context n "
               f"({ds.sizes['seed']} seed(s) as separate lines, {ds.attrs['budget_s']:g} s budget per model); "
               "softmax attention in black, the unigram baseline dotted; then the median seconds per step against "
               "n (log-log) and each model's decoder state (softmax: its KV cache, dashed). "
               f"{ds.attrs['torch_num_threads']} thread(s), load average {ds.attrs['load_average_1min_at_start']:.1f}"
               f"–{ds.attrs['load_average_1min_at_end']:.1f} on {ds.attrs['cpu_count']} CPUs.")
    from kernapprox.plotting import figure_source
    from kernapprox.sweep import dataset_digest

    with figure_source(f"results/training_curve.nc (benchmarks.training_curve); data digest {dataset_digest(ds)}"):
        save_figure(fig, path, caption, title="Training from scratch: loss against wall-clock")


COMPUTE = ("train_for", "to_dataset", "_seed_data", "_warm_up", "MAPS", "SOURCE")


def _record() -> dict:
    """What the curve depends on (kernapprox.store's rule): the library modules loaded, the benchmark's training
    code (its functions that train and measure, not its findings or plot) and the package versions."""
    return dependency_record(study=__name__ if __name__ != "__main__" else "benchmarks.training_curve",
                             roots=COMPUTE)


def write_outputs(ds: xr.Dataset, figure: str, findings_path: str) -> None:
    """The findings page, the figure of ``ds`` and its provenance record (``<figure>.deps.json``)."""
    Path(findings_path).parent.mkdir(parents=True, exist_ok=True)
    Path(findings_path).write_text(findings(ds))
    Path(figure).parent.mkdir(parents=True, exist_ok=True)
    plot(ds, figure)
    module = "benchmarks.training_curve"
    write_provenance(figure, ds, module, report_digest(module))


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> xr.Dataset:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_curve", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short sequences and budget (about a minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--budget-s", type=float, default=None, help="training seconds per (model, n, seed)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths n")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds")
    parser.add_argument("--models", nargs="+", choices=list(MAPS), default=None, help="models (softmax first)")
    parser.add_argument("--out", default=None,
                        help="dataset (default results/training_curve.nc; --quick: results/training_curve_quick.nc)")
    parser.add_argument("--figure", default=None, help="figure (default figures/training_curve.png; --quick: "
                                                       "results/training_curve_quick.png, out of the gallery)")
    parser.add_argument("--findings", default=None, help="findings (default figures/training_curve.md; --quick: "
                                                         "results/training_curve_quick.md)")
    parser.add_argument("--replot", action="store_true",
                        help="no training: rebuild the figure and the findings from the dataset at --out")
    args = parser.parse_args(argv)
    quick = "results/training_curve_quick" if args.quick else None      # a smoke test never replaces the measurement
    args.out = args.out or (f"{quick}.nc" if quick else "results/training_curve.nc")
    args.figure = args.figure or (f"{quick}.png" if quick else "figures/training_curve.png")
    args.findings = args.findings or (f"{quick}.md" if quick else "figures/training_curve.md")
    if args.replot:
        with xr.open_dataset(args.out, engine="h5netcdf") as stored:
            ds = stored.load()
        write_outputs(ds, args.figure, args.findings)
        return ds
    preset = PRESETS["quick" if args.quick else "full"]
    lengths = args.lengths or preset["lengths"]
    seeds = args.seeds if args.seeds is not None else preset["seeds"]
    labels = args.models or preset["models"]
    labels = ["softmax", *[m for m in labels if m != "softmax"]]          # the reference is always run
    budget = args.budget_s if args.budget_s is not None else preset["budget_s"]
    reason = unavailable_reason(SOURCE)
    if reason is not None:
        parser.error(f"the text source is not available here: {reason}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    attrs = provenance(torch.device("cpu"))
    attrs.update({"title": "training from scratch: held-out loss against wall-clock seconds",
                  "torch_version": str(torch.__version__), "machine": f"{platform.node()} ({platform.machine()})",
                  "quick": int(args.quick), "task": f"NextStep('{SOURCE}')", "batch_windows": BATCH,
                  "d_model": D_MODEL, "num_layers": NUM_LAYERS, "num_heads": NUM_HEADS, "lr": LR,
                  "warmup_steps": WARMUP_STEPS, "chunk_size": CHUNK, "eval_windows": EVAL_WINDOWS,
                  "native_mode": backends.get_mode("native")})
    print(f"{attrs['torch_num_threads']} threads, load average {attrs['load_average_1min_at_start']:.2f}; "
          f"{len(labels)} models x n = {lengths} x seeds {seeds}, {budget:g} s each", flush=True)
    _warm_up(labels)
    runs, unigram = {}, {}
    for seed in seeds:
        for n in lengths:
            task = NextStep(SOURCE, seq_len=n)
            batches, held_out = _seed_data(task, seed, 64)
            unigram[(n, seed)] = float(task.baseline_losses(held_out)["unigram"].mean())
            for label in labels:
                run = train_for(label, task, seed, batches, held_out, budget)
                runs[(label, n, seed)] = run
                print(f"  seed {seed} n {n:>6} {label:<14} {len(run.step_times):>4} steps, loss "
                      f"{run.loss[0]:.3f} -> {run.loss[-1]:.3f}, {np.median(run.step_times):.3f} s/step, cpu "
                      f"{run.cpu_utilisation:.2f} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    attrs.update({"load_average_1min_at_end": float(load_end), "native_status": native.status(),
                  "dependencies": json.dumps(_record(), sort_keys=True),
                  "wall_time_s": time.perf_counter() - t_start,
                  "history": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.training_curve",
                                       *(argv if argv is not None else sys.argv[1:])]),
                  "models": json.dumps({m: [MAPS[m][0], MAPS[m][1]] for m in labels})})
    attrs["code_digest"] = record_id(json.loads(attrs["dependencies"]))
    ds = to_dataset(runs, labels, lengths, seeds, unigram, budget, attrs)
    write_dataset(ds, args.out)
    write_outputs(ds, args.figure, args.findings)
    print(f"wrote {args.out}, {args.figure}, {args.findings} ({attrs['wall_time_s']:.0f} s)")
    return ds


if __name__ == "__main__":
    main()
