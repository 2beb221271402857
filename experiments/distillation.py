"""Distillation: what a fixed-state student keeps of a softmax teacher (SmolLM2-135M), stage by stage, against the
post-hoc maps at the same number of features.

The teacher is the pretrained model; a student is its copy converted by :func:`kernapprox.convert`, every layer
substituted, one map and one state per key/value head. Three kinds of student, all with ``num_features`` features
per key/value head (Hedgehog and FAVOR+ then keep equal state bytes, ``30 · 3 · r (d + 1)`` float32 numbers; Nyström
keeps its fit besides):

* ``hedgehog`` (Zhang et al. 2024, ICLR, *The Hedgehog & the Porcupine*): trainable maps ``φ(x) = softmax([Wx,
  −Wx])`` fitted layer by layer to the teacher's attention on ``n_calibration`` calibration windows (stage 1,
  attention transfer, :func:`kernapprox.trainable.fit_to_softmax` through ``ka.convert(..., calibration=)``) by the
  cross-entropy of the attention weights (``fit_loss="weights"``, Hedgehog's) or the MSE of the outputs
  (``"outputs"``, LoLCATs's attention transfer: Zhang et al. 2025, ICLR, §3.1); then, for ``objective`` other than
  ``"none"``, stage 2: low-rank adapters on every attention projection (:func:`kernapprox.surgery.finetuning.add_lora`,
  rank ``lora_rank``) trained with the maps for ``steps`` steps of one ``train_len``-token window of the calibration
  split each (:func:`kernapprox.surgery.finetuning.finetune`), by next-token cross-entropy (``"next_token"``) or by
  the KL divergence to the teacher's logits at temperature ``temperature`` (``"distill"``, Hinton et al. 2015): the
  same windows, in the same order, so the two objectives are compared at an equal token budget;
* ``t2r`` (Kasai et al. 2021, EMNLP, *Finetuning Pretrained Transformers into RNNs*, eq. 4–5): trainable maps
  ``φ(x) = relu(Wx + b)`` (plus ``1e-6``), through the same two stages as Hedgehog;
* ``window_hedgehog`` (LoLCATs' form, Zhang et al. 2025, ICLR, §3.2): the last ``hybrid_window`` keys of each query
  by the teacher's own softmax, the keys before them by a Hedgehog map, one normaliser
  (``ka.convert(..., window=hybrid_window)``); stage 1 trains the map *inside* the hybrid, on the hybrid's outputs
  or weights, so only the keys outside the window shape it; then stage 2. Its state is the window's keys and values
  plus the map's ``r (d_v + 1)`` numbers per key/value head;
* ``positive_orthogonal`` (FAVOR+) and ``nystrom_uniform`` (fitted on the calibration windows): post-hoc maps, no
  training (``objective="none"``): the reference a distilled student must beat (FAVOR+ at the same bytes, Nyström
  with more).

Every student is scored on the same held-out tokens as the teacher (paired): the next-token NLL of ``n_windows``
windows of ``context`` tokens of Shakespeare's evaluation split, and recall on ``n_prompts`` passkey and
``n_prompts`` key–value lookup prompts of ``context`` tokens (:mod:`kernapprox.lm_eval`), at the budget's
checkpoints (fractions 0, ½ and 1 of ``steps``; checkpoint 0 is the stage-1 student, measured in its ``"none"``
cell). The teacher's scores, a unigram model's NLL (the trivial baseline) and recall's chance are the draw's
reference. The unit of the NLL is the window, of recall the prompt; ``train_seed`` draws the maps' initialisation, the
adapters and the window order (one trained student per seed: the seeds preset's ten seeds are the units of the
verdicts on training, each comparison of :data:`SEED_COMPARISONS` tested over the seeds and Holm-adjusted per
student). Hedgehog's maps start at the identity (Zhang et al. 2024, §4), so its stage 1 is the same student in every
seed (the findings say so where the dataset shows it): its seeds vary the post-hoc draw and stage 2.

A trained student's stage 1 is kept in the result store (:mod:`kernapprox.store`, objects ``distillation_students``):
its maps under the SHA-256 of everything the study decides about them (:func:`stage1_provenance`: the teacher's file,
the map, the fit, the calibration tokens), with that provenance and the fit's cost beside them, and valid while the
library code the fitting process loaded is unchanged; a run that reads them reports the cost of the run that fitted them
(``stage1_cpu_seconds``) and says so (``stage1_cached``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

import kernapprox as ka
from experiments import _lm
from kernapprox import lm, lm_eval, memory, stats
from kernapprox.io import file_sha256
from kernapprox.plotting import estimator_style, fmt, fmt_bytes, fmt_ci, new_figure, save_figure
from kernapprox.store import default_store
from kernapprox.surgery.conversion import fit_records
from kernapprox.surgery.finetuning import add_lora, finetune
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

LM_REASON = _lm.unavailable("distillation")

STUDENTS = ("hedgehog", "t2r", "positive_orthogonal", "nystrom_uniform")
# the trained students: kernapprox.convert's trainable map and its options (T2R's relu features get eps = 1e-6 so
# that no query's features are all zero: a zero normaliser)
TRAINED = {"hedgehog": ("hedgehog_trainable", {}), "t2r": ("t2r_trainable", {"eps": 1e-6})}
# whose state accounting each student's decoder follows (kernapprox.memory): a trained map's state is that of any
# r-feature map, r (d_v + 1) numbers per key/value head; Nyström's adds what its fit keeps
STATE_OF = {"hedgehog": "positive_orthogonal", "t2r": "positive_orthogonal",
            "positive_orthogonal": "positive_orthogonal", "nystrom_uniform": "nystrom_uniform"}
# the window + linear hybrid student (LoLCATs' form, Zhang et al. 2025, ICLR, §3.2: exact softmax on the last
# ``hybrid_window`` keys, a Hedgehog map for the keys before them): the trained student it names, converted with
# ``window=hybrid_window`` (kernapprox.trainable.feature_attention), its map fitted inside the hybrid (stage 1, by
# either fit_loss), then stage 2 like the trained students; a causal-LM student only
HYBRIDS = {"window_hedgehog": "hedgehog"}
# the students with a stage 2 (adapters trained on top of stage 1)
STAGED = (*TRAINED, *HYBRIDS)
LM_STUDENTS = (*STUDENTS, *HYBRIDS)
OBJECTIVES = ("none", "next_token", "distill")
FIT_LOSSES = ("weights", "outputs")
CHECKPOINTS = (0.0, 0.5, 1.0)
NUM_LAYERS = lm.NUM_LAYERS

GRIDS = {
    "smoke": {"student": list(LM_STUDENTS), "fit_loss": ["weights"], "objective": list(OBJECTIVES),
              "num_features": [32], "steps": [2], "context": [96], "train_seed": [0]},
    # ~4 min of one core with the model cached: the stage-1 student, both stage-2 objectives and FAVOR+ at the same
    # bytes, on 128-token windows and prompts (stage 1 on 128-token calibration windows); the second state size and
    # Nyström are the full preset's, T2R and the outputs loss the students preset's, the verdicts the seeds preset's
    "default": {"student": ["hedgehog", "positive_orthogonal"], "fit_loss": ["weights"], "objective": list(OBJECTIVES),
                "num_features": [128], "steps": [16], "context": [128], "train_seed": [0]},
    # make figures PRESET=full's share of its hour (~20 min of one core): the default at two state sizes, with the
    # window hybrid (both stages) and Nyström
    "full": {"student": ["hedgehog", "window_hedgehog", "positive_orthogonal", "nystrom_uniform"],
             "fit_loss": ["weights"],
             "objective": list(OBJECTIVES), "num_features": [64, 128], "steps": [16], "context": [128],
             "train_seed": [0]},
    # two state sizes: both trained students by both stage-1 losses, both stage-2 objectives at twice the default's
    # budget, FAVOR+ and Nyström, one training seed (~30 min with --threads 2, make distillation-students)
    "students": {"student": list(STUDENTS), "fit_loss": list(FIT_LOSSES), "objective": list(OBJECTIVES),
                 "num_features": [64, 128], "steps": [32], "context": [128], "train_seed": [0]},
    # the window hybrid's map fitted inside it by both stage-1 losses (LoLCATs' outputs against Hedgehog's weights),
    # both stage-2 objectives, two state sizes, one training seed (~15 min with --threads 2, make distillation-hybrid)
    "hybrid": {"student": ["window_hedgehog"], "fit_loss": list(FIT_LOSSES), "objective": list(OBJECTIVES),
               "num_features": [64, 128], "steps": [16], "context": [128], "train_seed": [0]},
    # the default's students and budget over ten training seeds, the units of the verdicts on what training
    # transfers (~25 min with --threads 2, make distillation-seeds)
    "seeds": {"student": ["hedgehog", "positive_orthogonal"], "fit_loss": ["weights"], "objective": list(OBJECTIVES),
              "num_features": [128], "steps": [16], "context": [128], "train_seed": list(range(10))},
}
DATA_AXES = REFERENCE_AXES = ("context",)    # the draw: the model, its held-out windows and prompts
PARAMETERS = {
    "n_windows": Parameter(10, long_name="held-out text windows (the NLL's units)", units="1"),
    "n_prompts": Parameter(10, long_name="recall prompts per task (recall's units), depths 0.1 to 0.9", units="1"),
    "n_calibration": Parameter(4, long_name="calibration windows of stage 1 and of the Nyström fit", units="1",
                               description="of the calibration split, min(context, 256) tokens each"),
    "fit_steps": Parameter(30, long_name="attention-transfer steps per layer (stage 1)", units="1"),
    "hybrid_window": Parameter(32, long_name="exact softmax keys of the window hybrid (window_hedgehog)",
                               units="token",
                               description="its Hedgehog map fitted inside the hybrid (stage 1, fit_steps)"),
    "train_windows": Parameter(64, long_name="calibration windows stage 2 draws from", units="1",
                               description="train_len tokens each, of the calibration split; one per step, in a "
                                           "seeded order"),
    "train_len": Parameter(128, long_name="tokens per training window (stage 2)", units="token"),
    "n_layer_windows": Parameter(2, "held-out windows of the per-layer analysis", "1",
                                 "the first of the n_windows; each layer the student's alone"),
    "lora_rank": Parameter(8, long_name="rank of the adapters on q, k, v and o", units="1"),
    "lr": Parameter(1e-3, long_name="AdamW learning rate of stage 2", units="1"),
    "temperature": Parameter(2.0, long_name="distillation temperature T", units="1"),
}
AXIS_ATTRS = {
    "student": {"long_name": "the student's attention",
                "description": "hedgehog (Hedgehog's softmax map), t2r (T2R's relu map): trainable maps fitted to "
                               "the teacher (stage 1) and optionally trained (stage 2); window_hedgehog: exact "
                               "softmax on the last `hybrid_window` keys plus Hedgehog's map for the rest, the map "
                               "fitted inside the hybrid (stage 1), then stage 2; positive_orthogonal, "
                               "nystrom_uniform: post-hoc maps"},
    "fit_loss": {"long_name": "stage-1 attention-transfer loss",
                 "description": "weights: cross-entropy of attention weights (Hedgehog); outputs: MSE of attention "
                                "outputs (LoLCATs); post-hoc students carry 'weights' as their label"},
    "objective": {"long_name": "stage-2 objective",
                  "description": "none: no stage 2; next_token: cross-entropy of the next token; distill: KL to the "
                                 "teacher's logits at temperature T"},
    "num_features": {"long_name": "features per key/value head r", "units": "1"},
    "steps": {"long_name": "stage-2 steps (one training window each)", "units": "1"},
    "context": {"long_name": "tokens per held-out window and per recall prompt", "units": "token"},
    "train_seed": {"long_name": "training seed (maps' initialisation or draw, adapters, window order)",
                   "units": "1"},
    "window": {"long_name": "held-out text window", "units": "1"},
    "prompt": {"long_name": "recall prompt (the fact at depth 0.1 to 0.9)", "units": "1"},
    "task": {"long_name": "recall task", "description": "passkey (kernapprox.lm_eval.passkey_prompt); kv_lookup "
                                                       "(kernapprox.lm_eval.kv_lookup_prompt)"},
    "checkpoint": {"long_name": "fraction of the stage-2 budget trained", "units": "1"},
    "step": {"long_name": "stage-2 step", "units": "1"},
}
_C = {"checkpoint": list(CHECKPOINTS)}
_T = {"checkpoint": list(CHECKPOINTS), "task": list(_lm.TASKS)}
METRICS = {
    "nll": Metric("mean next-token NLL of the window", "nats", "the student after the checkpoint's share of stage 2 "
                  "(checkpoint 0: the stage-1 or post-hoc student, measured in the 'none' cell)",
                  dims=("checkpoint", "window"), coords=_C),
    "answer_logprob": Metric("log-probability of the recalled answer", "nats", "teacher-forced, summed over the "
                             "answer's tokens", dims=("checkpoint", "task", "prompt"), coords=_T),
    "greedy_correct": Metric("greedy decoding gives the recalled answer", "1", "1 if every answer token is the "
                             "argmax", dims=("checkpoint", "task", "prompt"), coords=_T),
    "train_loss": Metric("stage-2 loss of each step's window", "nats", "before the step's update (next-token "
                         "cross-entropy, or T²·KL to the teacher)", dims=("step",)),
    "layer_delta_nll": Metric("NLL increase with only this layer the student's, held-out windows", "nats",
                              "mean over the first n_layer_windows held-out windows of nll(layer l the student's, "
                              "every other layer the teacher's) − nll(teacher): where in the network a student loses "
                              "(the stage-1 and post-hoc students; a stage-2 student at the end of its budget, its "
                              "layer with the adapters)", dims=("layer",),
                              coords={"layer": list(range(NUM_LAYERS))}),
    "state_bytes": Metric("bytes of the student's decoding state", "byte",
                          "30 layers × 3 key/value heads × the state of one head (kernapprox.memory.probe_state_bytes "
                          "at the context's length: r (d_v + 1) float32 numbers for Hedgehog and FAVOR+, more for "
                          "Nyström, whose fit is kept too)"),
    "stage1_cpu_seconds": Metric("CPU seconds of stage 1", "s", "the attention transfer of every layer (0 for "
                                 "post-hoc maps: Nyström's fit is not counted)"),
    "stage1_tokens": Metric("query positions stage 1 trained on", "token", "Σ over layers of FitRecord.tokens"),
    "stage1_cached": Metric("stage 1 read from the cache", "1", "1: the stage-1 maps came from kernapprox's cache "
                            "(stage1_cpu_seconds is then the cost of the run that fitted them); 0: fitted in this run "
                            "(or a post-hoc map)"),
    "stage2_cpu_seconds": Metric("CPU seconds of stage 2", "s", "kernapprox.surgery.finetuning.FinetuneRecord's, "
                                 "less the checkpoints' evaluations that ran inside it (its on_step)"),
    "stage2_tokens": Metric("positions stage 2 trained on", "token", "steps · (train_len − 1)"),
}
REFERENCE_METRICS = {
    "nll_exact": Metric("mean next-token NLL of the window, teacher", "nats", "the same tokens", dims=("window",)),
    "nll_unigram": Metric("mean next-token NLL of the window, unigram model", "nats",
                          "add-one smoothed token frequencies of the calibration split (no context): the trivial "
                          "baseline", dims=("window",)),
    "answer_logprob_exact": Metric("log-probability of the recalled answer, teacher", "nats", "the same prompts",
                                   dims=("task", "prompt"), coords={"task": list(_lm.TASKS)}),
    "greedy_correct_exact": Metric("greedy decoding gives the recalled answer, teacher", "1", "the same prompts",
                                   dims=("task", "prompt"), coords={"task": list(_lm.TASKS)}),
    "recall_chance": Metric("chance of a greedy answer without recall", "1", "1 / RecallPrompt.candidates",
                            dims=("task", "prompt"), coords={"task": list(_lm.TASKS)}),
    "kv_bytes": Metric("teacher's KV cache at the context's length", "byte", "kernapprox.lm.kv_cache_bytes"),
}


def applicable(params) -> bool:
    """Post-hoc students: ``objective="none"`` and ``fit_loss="weights"`` only (they have no stage 1 or 2)."""
    if params["student"] not in STAGED:
        return params["objective"] == "none" and params["fit_loss"] == "weights"
    return True


def trained_map(params) -> tuple[str, dict]:
    """``(map, options)`` that ``ka.convert`` builds a staged student with: its :data:`TRAINED` entry, or for a
    window hybrid its map's entry with ``window=hybrid_window``."""
    student = params["student"]
    if student in HYBRIDS:
        name, options = TRAINED[HYBRIDS[student]]
        return name, {**options, "window": int(params["hybrid_window"])}
    return TRAINED[student]


def _hedgehog_features(student: str) -> bool:
    """Whether the student's features are Hedgehog's (``r = 2 · feature_dim``, so r must be even): read from its
    entry in :data:`TRAINED` (a hybrid: its map's)."""
    return TRAINED.get(HYBRIDS.get(student, student), (student, {}))[0].startswith("hedgehog")


def check_params(params) -> None:
    for axis, allowed in (("student", LM_STUDENTS), ("objective", OBJECTIVES), ("fit_loss", FIT_LOSSES)):
        if params[axis] not in allowed:
            raise ValueError(f"{axis} must be one of {', '.join(allowed)}, got {params[axis]!r}")
    if params["context"] < 96:
        raise ValueError(f"context must be at least 96 tokens (a passkey prompt's fixed parts), got "
                         f"{params['context']}")
    if _hedgehog_features(params["student"]) and params["num_features"] % 2:
        raise ValueError(f"num_features must be even (Hedgehog's r = 2 · feature_dim), got {params['num_features']}")


class Draw(NamedTuple):
    """What every cell of a context reads: the teacher, the held-out windows, the recall prompts, the calibration
    and training windows, the teacher's and the unigram model's scores, and the stage-1 student of the cells that
    share it (:func:`stage1`: one kept with the draw, since the engine runs a draw's cells together)."""

    model: object
    windows: torch.Tensor
    prompts: dict
    calibration: torch.Tensor
    training: torch.Tensor
    exact: dict
    students: dict


def draw(params, data_rng, device) -> Draw:
    model, tokenizer = _lm.load_model("distillation", LM_REASON, device)
    context = params["context"]
    windows = lm.text_windows(tokenizer, params["n_windows"], context, split="evaluation").input_ids
    calibration = lm.text_windows(tokenizer, params["n_calibration"], min(context, 256), split="calibration")
    training = lm.text_windows(tokenizer, params["train_windows"], params["train_len"], split="calibration")
    prompts = _lm.recall_prompts(tokenizer, context, params["n_prompts"])
    recall = _lm.score_recall(model, prompts)
    exact = {"nll_exact": lm_eval.token_nll(model, windows.to(device)).mean(axis=1),
             "nll_unigram": _lm.unigram_nll(tokenizer, windows),
             "answer_logprob_exact": recall["answer_logprob"], "greedy_correct_exact": recall["greedy_correct"],
             "recall_chance": 1.0 / recall["candidates"], "kv_bytes": float(lm.kv_cache_bytes(context))}
    return Draw(model, windows, prompts, calibration.input_ids.to(device), training.input_ids.to(device), exact, {})


def run_reference(params, device, data):
    return dict(data.exact)


STAGE1_NAMESPACE = "distillation_students"      # objects of the result store (kernapprox.store)
MAP_ENTRIES = "kernapprox_attention."            # the state_dict entries of a converted layer's trainable map


@functools.lru_cache(maxsize=4)
def _file_digest(path: str) -> str:
    return file_sha256(path)


def stage1_provenance(data: Draw, params) -> dict:
    """Everything that determines a trained student's stage-1 maps: its cache key's payload, kept beside them as
    their provenance. The teacher's GGUF file (by SHA-256) and the transformers version that reads it, the map and
    its options, r, the seed, the fit's loss and steps, the calibration tokens (by SHA-256) and the device type. The
    code that converts and fits, and the package versions, are the entry's dependency record in the result store
    (:mod:`kernapprox.store`)."""
    import transformers

    name, options = trained_map(params)
    tokens = np.ascontiguousarray(data.calibration.detach().cpu().numpy())
    return {"teacher": {"file": lm.GGUF_NAME, "sha256": _file_digest(str(lm.gguf_path())),
                        "transformers": transformers.__version__},
            "map": name, "options": options, "num_features": int(params["num_features"]),
            "rng": int(params["train_seed"]), "fit_loss": params["fit_loss"], "fit_steps": int(params["fit_steps"]),
            "calibration": {"shape": list(tokens.shape), "dtype": str(tokens.dtype),
                            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()},
            "device": data.calibration.device.type}


def _fit_stage1(data: Draw, params):
    """``(student, (cpu_seconds, tokens), cached)`` of a trained student's stage 1: read from the cache, else fitted
    (``ka.convert(..., calibration=)``) and written there (the maps, then the provenance: an entry counts only when
    both exist). A hit converts the teacher with unfitted maps and loads the kept ones into them."""
    name, options = trained_map(params)
    provenance = stage1_provenance(data, params)
    text = json.dumps(provenance, sort_keys=True, separators=(",", ":"))
    entry_name = f"{params['student']}_{hashlib.sha256(text.encode()).hexdigest()[:24]}"
    store = default_store()
    entry = store.find(STAGE1_NAMESPACE, entry_name)
    convert = functools.partial(ka.convert, data.model, name, num_features=params["num_features"],
                                rng=params["train_seed"], **options)
    if entry is not None:
        kept = torch.load(entry / "maps.pt", map_location=data.calibration.device, weights_only=True)
        student = convert()
        own = {k for k in student.state_dict() if MAP_ENTRIES in k}
        if set(kept["maps"]) != own:
            raise RuntimeError(f"the stored stage-1 maps {entry} do not fit the converted student (other "
                               "parameter names): delete the entry and run again")
        student.load_state_dict(kept["maps"], strict=False)
        return student, (float(kept["cpu_seconds"]), float(kept["tokens"])), True
    start = time.process_time()
    student = convert(calibration={"input_ids": data.calibration}, fit_loss=params["fit_loss"],
                      fit_steps=params["fit_steps"])
    cost = (time.process_time() - start, float(sum(r.tokens for r in fit_records(student).values())))
    maps = {k: v.detach().cpu().clone() for k, v in student.state_dict().items() if MAP_ENTRIES in k}
    record = json.dumps({**provenance, "cpu_seconds": cost[0], "tokens": cost[1],
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1, sort_keys=True)

    def write(folder: Path) -> None:
        torch.save({"maps": maps, "cpu_seconds": cost[0], "tokens": cost[1]}, folder / "maps.pt")
        (folder / "provenance.json").write_text(record, encoding="utf-8")

    store.put(STAGE1_NAMESPACE, entry_name, write)
    return student, cost, False


STAGE1_KEPT = 2                 # stage-1 students kept with a draw


def stage1(data: Draw, params):
    """The stage-1 student of the cell, ``(cpu_seconds, tokens)`` of its attention transfer and whether it came from
    the cache (:func:`_fit_stage1`; post-hoc maps are converted, cost 0). Kept with the draw: the cells of one draw
    share it, the :data:`STAGE1_KEPT` most recently used (a 135M-parameter copy each; the engine runs a student's
    cells with its state sizes alternating, so one kept would refit each cell's)."""
    key = (params["student"], params["fit_loss"], params["num_features"], params["train_seed"], params["fit_steps"])
    if key not in data.students:
        if params["student"] in STAGED:
            entry = _fit_stage1(data, params)
        else:
            entry = (ka.convert(data.model, params["student"], num_features=params["num_features"],
                                rng=params["train_seed"], share_heads="group",
                                calibration={"input_ids": data.calibration}), (0.0, 0.0), False)
        while len(data.students) >= STAGE1_KEPT:
            data.students.pop(next(iter(data.students)))       # the least recently used
        data.students[key] = entry
    else:
        data.students[key] = data.students.pop(key)             # now the most recently used
    return data.students[key]


@torch.no_grad()
def evaluate(model, data: Draw) -> dict:
    """NLL of the held-out windows and recall of the prompts."""
    recall = _lm.score_recall(model, data.prompts)
    return {"nll": lm_eval.token_nll(model, data.windows.to(next(model.parameters()).device)).mean(axis=1),
            "answer_logprob": recall["answer_logprob"], "greedy_correct": recall["greedy_correct"]}


def _head_state_bytes(params) -> int:
    """A key/value head's decoding state at the context's length (:func:`kernapprox.memory.probe_state_bytes`): a
    map's ``r (d_v + 1)`` numbers (Nyström's fit besides); the window hybrid's adds its window's keys and values,
    ``min(hybrid_window, context) (d + d_v)`` (any r-feature map keeps the same linear state as its Hedgehog
    features)."""
    student, r = params["student"], params["num_features"]
    if student in HYBRIDS:           # the state of WindowLinear, the same hybrid as a registry estimator
        return memory.probe_state_bytes("window_linear", r, d=lm.HEAD_DIM, d_v=lm.HEAD_DIM,
                                        seq_len=params["context"], options={"window": params["hybrid_window"]})
    return memory.probe_state_bytes(STATE_OF[student], r, d=lm.HEAD_DIM, d_v=lm.HEAD_DIM, seq_len=params["context"])


def run_cell(params, rng, device, data):
    if not applicable(params):
        return not_applicable()
    student, (cpu1, tokens1), cached = stage1(data, params)
    n_w, n_p, steps = data.windows.shape[0], params["n_prompts"], params["steps"]
    out = {"nll": np.full((len(CHECKPOINTS), n_w), np.nan),
           "answer_logprob": np.full((len(CHECKPOINTS), len(_lm.TASKS), n_p), np.nan),
           "greedy_correct": np.full((len(CHECKPOINTS), len(_lm.TASKS), n_p), np.nan),
           "train_loss": np.full(steps, np.nan), "layer_delta_nll": np.full(NUM_LAYERS, np.nan),
           "state_bytes": float(NUM_LAYERS * lm.NUM_KV_HEADS * _head_state_bytes(params)),
           "stage1_cpu_seconds": cpu1, "stage1_tokens": tokens1, "stage1_cached": float(cached),
           "stage2_cpu_seconds": 0.0, "stage2_tokens": 0.0}

    evaluation = [0.0]              # CPU seconds of the checkpoints' evaluations: not training

    def record(index, model):
        start = time.process_time()
        for name, value in evaluate(model, data).items():
            out[name][index] = value
        evaluation[0] += time.process_time() - start

    if params["objective"] == "none":
        record(0, student)
        out["layer_delta_nll"] = _lm.layer_delta_nll(data.model, student, [
            data.windows[i:i + 1].to(device) for i in range(params["n_layer_windows"])])
        return out
    model = copy.deepcopy(student)
    add_lora(model, rank=params["lora_rank"], rng=params["train_seed"])
    at = {round(c * steps): i for i, c in enumerate(CHECKPOINTS) if c > 0}
    result = finetune(model, data.training, objective=params["objective"], teacher=data.model,
                      temperature=params["temperature"], steps=steps, batch_size=1, lr=params["lr"],
                      rng=params["train_seed"], on_step=lambda step, m: record(at[step], m) if step in at else None)
    out["train_loss"][:] = result.losses
    out["stage2_cpu_seconds"] = result.cpu_seconds - evaluation[0]
    out["stage2_tokens"] = float(result.tokens)
    out["layer_delta_nll"] = _lm.layer_delta_nll(data.model, model, [
        data.windows[i:i + 1].to(device) for i in range(params["n_layer_windows"])])
    return out


# ------------------------------------------------------------------------------------------------- summaries
def _filled(ds: xr.Dataset, name: str) -> xr.DataArray:
    """``name`` with checkpoint 0 of every objective taken from the ``"none"`` cell of the same student."""
    da = ds[name]
    start = da.sel(objective="none", checkpoint=0.0)
    return xr.where(da["checkpoint"] == 0.0, start.broadcast_like(da), da).transpose(*da.dims)


def gap_closed(student: np.ndarray, posthoc: np.ndarray, exact: np.ndarray, *, seed: int = stats.BOOTSTRAP_SEED,
               resamples: int = stats.RESAMPLES, level: float = stats.LEVEL) -> tuple[float, float, float]:
    """``1 − mean(student − exact) / mean(post-hoc − exact)`` over paired units (the fraction of the post-hoc map's
    NLL gap to the teacher that the student closes) with its percentile-bootstrap interval over the units (the
    same resampled units in numerator and denominator). 1-D arrays: one value per unit (a window); 2-D: one row per
    unit (a training seed) with its windows, resampled whole (a cluster bootstrap; ``exact`` broadcasts)."""
    a, b = np.asarray(student) - np.asarray(exact), np.asarray(posthoc) - np.asarray(exact)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return (np.nan, np.nan, np.nan)
    a, b = (a[:, None], b[:, None]) if a.ndim == 1 else (a, b)
    m = a.shape[0]
    idx = np.random.default_rng([seed, m]).integers(0, m, size=(resamples, m))
    boot = 1.0 - a[idx].mean((1, 2)) / b[idx].mean((1, 2))
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(1.0 - a.mean() / b.mean()), float(lo), float(hi)


def summarise(ds: xr.Dataset) -> xr.Dataset:
    for name in ("nll", "answer_logprob", "greedy_correct"):
        ds[f"{name}_filled"] = _filled(ds, name).assign_attrs(ds[name].attrs)
    for name, unit in (("nll_filled", "window"), ("nll_exact", "window"), ("nll_unigram", "window"),
                       ("answer_logprob_filled", "prompt"), ("answer_logprob_exact", "prompt")):
        _lm.add_summary(ds, f"{name.removesuffix('_filled')}_summary", name, unit)
    for name in ("greedy_correct_filled", "greedy_correct_exact"):
        _lm.add_accuracy(ds, f"{name.removesuffix('_filled')}_summary", name)
    for name, ref in (("perplexity", "nll"), ("perplexity_exact", "nll_exact"), ("perplexity_unigram", "nll_unigram")):
        _lm.add_perplexity(ds, f"{name}_summary", f"{ref}_summary")
    _lm.add_chance(ds)
    # the objectives against each other at the end of the budget, per window (the same windows and training text)
    if {"next_token", "distill"} <= set(ds["objective"].values.tolist()):
        end = ds["nll_filled"].sel(checkpoint=1.0)
        _lm.add_window_difference(ds, "distill_minus_next_token",
                              end.sel(objective="distill") - end.sel(objective="next_token"),
                              "NLL after distillation minus after next-token training",
                              "per window, the same stage-1 student, training windows and budget")
    # the stage-1 losses against each other, per window: the same student, r, seed and stage 2
    if set(FIT_LOSSES) <= set(ds["fit_loss"].values.tolist()):
        nll = ds["nll_filled"]
        last = xr.where(nll["objective"] == "none", 0.0, 1.0)
        end = nll.sel(checkpoint=last).drop_vars("checkpoint")
        _lm.add_window_difference(ds, "outputs_minus_weights",
                                  end.sel(fit_loss="outputs") - end.sel(fit_loss="weights"),
                                  "NLL with stage 1 by outputs minus by weights",
                                  "per window, the same student, r, seed and stage-2 objective (at the end of its "
                                  "budget; the stage-1 student for objective none)")
    ds["memory_fraction"] = (ds["state_bytes"] / ds["kv_bytes"]).assign_attrs(
        long_name="student's state over the teacher's KV cache at the context's length", units="1",
        description="state_bytes / kv_bytes")
    if _several_seeds(ds):
        _seed_summaries(ds)
    return ds


def _several_seeds(ds: xr.Dataset) -> bool:
    return ds.sizes.get("train_seed", 1) > 1


# the comparisons over training seeds: (name, the stage of the first, the stage of the second); a stage is
# (student, objective, checkpoint), None for the student under comparison; the post-hoc reference is FAVOR+
SEED_COMPARISONS = (("stage1_minus_posthoc", (None, "none", 0.0), ("positive_orthogonal", "none", 0.0)),
                    ("next_token_minus_stage1", (None, "next_token", 1.0), (None, "none", 0.0)),
                    ("distill_minus_stage1", (None, "distill", 1.0), (None, "none", 0.0)),
                    ("distill_minus_next_token", (None, "distill", 1.0), (None, "next_token", 1.0)))


def _stage(da: xr.DataArray, stage) -> xr.DataArray:
    student, objective, checkpoint = stage
    out = da.sel(objective=objective, checkpoint=checkpoint, drop=True)
    if student is not None:                     # a post-hoc map: no stage 1 of its own, its "weights" label
        out = out.sel(student=student, fit_loss="weights", drop=True)
    return out


def _seed_summaries(ds: xr.Dataset) -> None:
    """With several training seeds (the unit of a verdict on training): every student's mean NLL, answer
    log-probability and greedy accuracy with cluster-bootstrap intervals over the seeds (each seed with its windows or
    prompts, :func:`kernapprox.stats.cluster_interval`), and the paired differences of :data:`SEED_COMPARISONS` per
    trained student (``seed_nll_diff``, ``seed_logprob_diff``) with their intervals and exact Wilcoxon tests over the
    seeds (each seed's mean over its windows or prompts, :func:`kernapprox.stats.paired_test`)."""
    for name, var, within in (("nll_seeds_summary", "nll_filled", "window"),
                              ("answer_logprob_seeds_summary", "answer_logprob_filled", "prompt"),
                              ("greedy_correct_seeds_summary", "greedy_correct_filled", "prompt")):
        summary = stats.cluster_interval(ds[var], "train_seed", within=(within,))
        ds[name] = summary.assign_attrs(long_name=ds[var].attrs["long_name"] + ", mean over the training seeds",
                                        units=ds[var].attrs["units"])
    nll = ds["nll_seeds_summary"]
    bounds = nll["stat"].isin(["estimate", "lo", "hi"])
    ds["perplexity_seeds_summary"] = xr.where(bounds, np.exp(nll), np.nan).assign_attrs(
        long_name="perplexity exp(mean NLL over the seeds' windows)", units="1")
    trained = [s for s in ds["student"].values.tolist() if s in STAGED]
    objectives = set(ds["objective"].values.tolist())
    students = set(ds["student"].values.tolist())
    names = [name for name, a, b in SEED_COMPARISONS
             if {a[1], b[1]} <= objectives and (b[0] is None or b[0] in students)]
    if not trained or not names:
        return
    table = {name: (a, b) for name, a, b in SEED_COMPARISONS}
    for var, within, out in (("nll_filled", "window", "seed_nll_diff"),
                             ("answer_logprob_filled", "prompt", "seed_logprob_diff")):
        da = ds[var].sel(student=trained)
        diff = xr.concat([_stage(da, table[n][0]) - _stage(ds[var], table[n][1]) for n in names],
                         dim=xr.DataArray(names, dims="comparison", name="comparison"))
        ds[out] = diff.assign_attrs(long_name=f"paired difference of {ds[var].attrs['long_name']}",
                                    units="nats", comparison="difference",
                                    description="the first stage minus the second (SEED_COMPARISONS), per "
                                                f"{within} and training seed")
        ds[f"{out}_summary"] = stats.cluster_interval(ds[out], "train_seed", within=(within,))
        ds[f"{out}_p"] = stats.paired_test(ds[out], "train_seed", within=(within,))


# ---------------------------------------------------------------------------------------------------- figure
def _cells(ds: xr.Dataset):
    """``(student, fit_loss, objective, r, steps, context, train_seed)`` selections of the cells that ran."""
    dims = ("student", "fit_loss", "objective", "num_features", "steps", "context", "train_seed")
    sub = ds["state_bytes"].transpose(*dims)
    return [{d: sub[d].values.tolist()[i] for d, i in zip(dims, idx)}
            for idx in zip(*np.nonzero(np.isfinite(sub.values)))]


def _shown(ds: xr.Dataset):
    """The cells a figure or finding names: every cell, or with several training seeds those of the first seed
    (their numbers are then the seeds' means: :func:`_at`)."""
    cells = _cells(ds)
    if not _several_seeds(ds):
        return cells
    first = ds["train_seed"].values.tolist()[0]
    return [c for c in cells if c["train_seed"] == first]


def _at(ds: xr.Dataset, cell: dict) -> dict:
    """The selection of ``cell`` in per-cell variables, or without its seed in the seed summaries."""
    return {k: v for k, v in cell.items() if k != "train_seed"} if _several_seeds(ds) else cell


def _names(ds: xr.Dataset) -> tuple[str, str, str]:
    """The perplexity, answer log-probability and greedy accuracy summaries the figure and findings read: over the
    windows or prompts of one seed, or over the seeds."""
    if _several_seeds(ds):
        return "perplexity_seeds_summary", "answer_logprob_seeds_summary", "greedy_correct_seeds_summary"
    return "perplexity_summary", "answer_logprob_summary", "greedy_correct_summary"


def _label(cell, ds: xr.Dataset | None = None) -> str:
    """The cell's name in the figure and findings; with ``ds`` holding several r, its r too."""
    r = f" at r = {cell['num_features']}" if ds is not None and ds.sizes.get("num_features", 1) > 1 else ""
    if cell["student"] not in STAGED:
        return f"{cell['student']} (post hoc){r}"
    stage = {"none": "stage 1", "next_token": "+ LoRA, next token", "distill": "+ LoRA, distilled"}[cell["objective"]]
    return f"{cell['student']} ({cell['fit_loss']}) {stage}{r}"


def _markers(ds: xr.Dataset) -> dict:
    """A marker per r, the largest first: circles, squares, diamonds, triangles."""
    return dict(zip(sorted(ds["num_features"].values.tolist(), reverse=True), "osD^v"))


def plot(ds: xr.Dataset, path) -> None:
    fig, axes = new_figure(2, 4, width=26, height=10.5)
    (ax_ppl, ax_pk, ax_kv, ax_loss), (ax_layer, ax_size, ax_size_pk, ax_size_kv) = axes
    colours = {"next_token": "tab:blue", "distill": "tab:red"}
    lines = {"hedgehog": "-", "t2r": "--", "window_hedgehog": ":"}
    markers = _markers(ds)
    ppl_name, logprob_name, _ = _names(ds)
    seeds = _several_seeds(ds)
    for cell in _shown(ds):
        if cell["student"] not in STAGED or cell["objective"] == "none":
            continue
        base = _at(ds, cell)
        tokens = np.asarray(CHECKPOINTS) * (cell["steps"] * (int(ds["train_len"]) - 1))
        face = {} if cell["fit_loss"] == "weights" else {"markerfacecolor": "white"}   # open: stage 1 by outputs
        for ax, name, extra in ((ax_ppl, ppl_name, {}), (ax_pk, logprob_name, {"task": "passkey"}),
                                (ax_kv, logprob_name, {"task": "kv_lookup"})):
            s = ds[name].sel(**base, **extra)
            est, lo, hi = (s.sel(stat=x).values for x in ("estimate", "lo", "hi"))
            ax.errorbar(tokens, est, yerr=[est - lo, hi - est], marker=markers[cell["num_features"]], capsize=2,
                        color=colours[cell["objective"]], linestyle=lines[cell["student"]], label=_label(cell, ds),
                        **face)
        loss = ds["train_loss"].sel(**base)
        ax_loss.plot(np.arange(1, cell["steps"] + 1), (loss.mean("train_seed") if seeds else loss).values,
                     color=colours[cell["objective"]], linestyle=lines[cell["student"]], label=_label(cell, ds),
                     alpha=1.0 if cell["num_features"] == max(markers) else 0.5)
    for ax, name, exact, extra in ((ax_ppl, ppl_name, "perplexity_exact_summary", {}),
                                   (ax_pk, logprob_name, "answer_logprob_exact_summary", {"task": "passkey"}),
                                   (ax_kv, logprob_name, "answer_logprob_exact_summary", {"task": "kv_lookup"})):
        context = ds["context"].values[0]
        ax.axhline(float(ds[exact].sel(context=context, stat="estimate", **extra)), color="k", linewidth=1.2,
                   label="teacher (exact attention)")
        for cell in _shown(ds):
            if cell["student"] in STAGED:
                continue
            style = estimator_style(cell["student"])
            ax.axhline(float(ds[name].sel(**_at(ds, cell), checkpoint=0.0, stat="estimate", **extra)),
                       color=style["color"], linestyle=style["linestyle"], linewidth=1.2, label=_label(cell, ds),
                       alpha=1.0 if cell["num_features"] == max(markers) else 0.5)
    unigram = float(ds["perplexity_unigram_summary"].sel(stat="estimate").values.ravel()[0])
    ax_ppl.axhline(unigram, color="0.5", linestyle=":", label="unigram model (no context)")
    ax_ppl.set_yscale("log")
    # a post-hoc map far worse than the unigram model would squeeze the axis: named above it instead
    top = 4.0 * unigram
    off = [f"{_label(c, ds)}: {fmt(float(ds[ppl_name].sel(**_at(ds, c), checkpoint=0.0, stat='estimate')))}"
           for c in _shown(ds) if c["student"] not in STAGED
           and float(ds[ppl_name].sel(**_at(ds, c), checkpoint=0.0, stat="estimate")) > top]
    if off:
        ax_ppl.set_ylim(top=top)
        ax_ppl.text(0.02, 0.98, "above the axis: " + "; ".join(off), transform=ax_ppl.transAxes, fontsize=6.5,
                    va="top")
    statistic = "mean over seeds" if seeds else "median"
    for ax, title, ylabel in ((ax_ppl, "(a) held-out perplexity", "perplexity"),
                              (ax_pk, "(b) passkey recall", f"answer log-probability (nats, {statistic})"),
                              (ax_kv, "(c) key–value lookup", f"answer log-probability (nats, {statistic})")):
        ax.set_xlabel("stage-2 training tokens (0: the stage-1 student)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    ax_loss.set_xlabel("stage-2 step")
    ax_loss.set_ylabel("training loss of the step's window (nats)")
    ax_loss.set_title("(d) stage-2 loss")
    ax_ppl.legend(fontsize=6.5, loc="center right")
    ax_loss.legend(fontsize=6.5)
    layered = [c for c in _shown(ds) if c["objective"] == "none" and c["student"] != "nystrom_uniform"]
    for i, cell in enumerate(layered):
        delta = ds["layer_delta_nll"].sel(**_at(ds, cell))
        ax_layer.bar(ds["layer"].values + (i - (len(layered) - 1) / 2) * 0.8 / len(layered),
                     (delta.mean("train_seed") if seeds else delta).values, width=0.8 / len(layered),
                     color=estimator_style(cell["student"])["color"], label=_label(cell, ds),
                     alpha=1.0 if cell["num_features"] == max(markers) else 0.5)
    ax_layer.set_yscale("symlog", linthresh=0.01)
    ax_layer.set_xlabel("decoder layer (the student's alone)")
    ax_layer.set_ylabel("held-out NLL increase (nats)")
    ax_layer.set_title("(e) where each student loses, per layer")
    ax_layer.legend(fontsize=6.5)
    _plot_state_sizes(ds, (ax_size, ax_size_pk, ax_size_kv))
    fig.suptitle("Distilling SmolLM2-135M's softmax attention into fixed-state students"
                 + (f" ({ds.sizes['train_seed']} training seeds: means over seeds)" if seeds else ""))
    names = {"positive_orthogonal": "FAVOR+", "nystrom_uniform": "Nyström"}
    posthoc = " and ".join(names[s] for s in STUDENTS if s in names and s in ds["student"].values.tolist())
    units = (f"means over {ds.sizes['train_seed']} training seeds with cluster-bootstrap intervals over the seeds "
             "(each with its windows or prompts)" if seeds else "bootstrap intervals over the windows or prompts")
    save_figure(fig, path, (
        f"Students with r = {', '.join(str(r) for r in ds['num_features'].values)} features per key/value head in "
        "every layer (the trained maps and FAVOR+ keep equal state bytes"
        + ("; Nyström more" if "nystrom_uniform" in ds["student"].values.tolist() else "")
        + ("; the window hybrid more: its window's keys and values"
           if "window_hedgehog" in ds["student"].values.tolist() else "") + "). (a) Perplexity on "
        f"{ds.sizes['window']} held-out Shakespeare windows of {', '.join(str(c) for c in ds['context'].values)} "
        "tokens against stage-2 training tokens: at 0 the stage-1 student (attention transfer; solid: Hedgehog, "
        "dashed: T2R), then the LoRA-adapted student trained by next-token loss (blue) or by distillation from the "
        f"teacher's logits (red) on the same windows; black: the teacher; coloured lines: post-hoc {posthoc} at the "
        "same r (one far above the unigram model is named instead of drawn); dotted: a unigram model. (b, c) The "
        f"recalled answer's log-probability ({statistic}). Intervals: {units}. (d) Each step's training loss"
        + (" (mean over seeds)" if seeds else "") + ". (e) Per layer, "
        f"the NLL increase on {int(ds['n_layer_windows'])} held-out windows with only that layer the student's "
        "(stage-1 and post-hoc students" + (", mean over seeds" if seeds else "") + "; symmetric log scale). "
        "(f–h) The same three scores at the end of each student's training against its decoding state's bytes (one "
        "point per r; solid: stage 1 by weights, dashed: by outputs; grey: the teacher's KV cache at the windows' "
        "length). Markers: r (circles the largest); open markers: stage 1 by outputs."),
        title="Distillation into fixed-state students")


_STAGE_COLOURS = {"none": "tab:green", "next_token": "tab:blue", "distill": "tab:red"}


def _plot_state_sizes(ds: xr.Dataset, axes) -> None:
    """Panels (f–h): perplexity and both recall tasks' answer log-probability at the end of each student's training
    against its state's bytes, one line per (student, stage-1 loss, stage) over r, the post-hoc maps beside them and
    the teacher (its score; its KV cache's bytes a vertical line)."""
    ppl_name, logprob_name, _ = _names(ds)
    context = int(ds["context"].values[0])
    groups: dict = {}
    for cell in _shown(ds):
        groups.setdefault((cell["student"], cell["fit_loss"], cell["objective"]), []).append(cell)
    for ax, name, exact, extra in ((axes[0], ppl_name, "perplexity_exact_summary", {}),
                                   (axes[1], logprob_name, "answer_logprob_exact_summary", {"task": "passkey"}),
                                   (axes[2], logprob_name, "answer_logprob_exact_summary", {"task": "kv_lookup"})):
        for (student, fit_loss, objective), cells in groups.items():
            cells = sorted(cells, key=lambda c: c["num_features"])
            x = [float(ds["state_bytes"].sel(**c)) / 2**20 for c in cells]
            end = [0.0 if c["objective"] == "none" else 1.0 for c in cells]
            s = [ds[name].sel(**_at(ds, c), checkpoint=e, **extra) for c, e in zip(cells, end)]
            est, lo, hi = (np.array([float(v.sel(stat=k)) for v in s]) for k in ("estimate", "lo", "hi"))
            if student in STAGED:
                style = {"color": _STAGE_COLOURS[objective], "linestyle": "-" if fit_loss == "weights" else "--",
                         "marker": "o" if student == "hedgehog" else "s"}
            else:
                style = {k: v for k, v in estimator_style(student).items() if k != "label"}
            ax.errorbar(x, est, yerr=[est - lo, hi - est], capsize=2, label=_label(cells[0]), **style)
        ax.axhline(float(ds[exact].sel(context=context, stat="estimate", **extra)), color="k", linewidth=1.2,
                   label="teacher (exact attention)")
        ax.axvline(float(ds["kv_bytes"].sel(context=context)) / 2**20, color="0.6", linewidth=1.0,
                   label=f"teacher's KV cache at {context} tokens")
        ax.set_xscale("log")
        ax.set_xlabel("decoding state (MiB)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("perplexity")
    axes[0].set_title("(f) perplexity against state size")
    for ax, title in ((axes[1], "(g) passkey recall against state size"),
                      (axes[2], "(h) key–value lookup against state size")):
        ax.set_ylabel("answer log-probability (nats)")
        ax.set_title(title)
    axes[2].legend(fontsize=6, loc="best")


# -------------------------------------------------------------------------------------------------- findings
def findings(ds: xr.Dataset) -> list[str]:
    lines = []
    cells = _cells(ds)
    context = int(ds["context"].values[0])
    kv = float(ds["kv_bytes"].sel(context=context))
    lines.append(f"Teacher at {context}-token windows of held-out Shakespeare: perplexity "
                 f"{fmt_ci(ds['perplexity_exact_summary'].sel(context=context))} over {ds.sizes['window']} windows "
                 f"(KV cache {fmt_bytes(kv)}); unigram model: "
                 f"{fmt_ci(ds['perplexity_unigram_summary'].sel(context=context))}.")
    if _several_seeds(ds):
        return lines + _seed_findings(ds)
    parts = []
    for cell in cells:
        last = 0.0 if cell["objective"] == "none" else 1.0
        s = ds["perplexity_summary"].sel(**cell, checkpoint=last)
        parts.append(f"{_label(cell)} at r = {cell['num_features']}: {fmt_ci(s)} "
                     f"({fmt_bytes(ds['state_bytes'].sel(**cell))}, {fmt(float(ds['memory_fraction'].sel(**cell)))} "
                     "of the KV cache)")
    lines.append("Perplexity of the students on the same windows (at the end of their training): " + "; ".join(parts)
                 + ".")
    nll, exact = ds["nll_filled"], ds["nll_exact"].sel(context=context)
    for post in ("positive_orthogonal", "nystrom_uniform"):
        for cell in (c for c in cells if c["student"] in STAGED):
            ref = dict(cell, student=post, fit_loss="weights", objective="none")
            if not any(c == ref for c in cells):
                continue
            last = 0.0 if cell["objective"] == "none" else 1.0
            est, lo, hi = gap_closed(nll.sel(**cell, checkpoint=last).values,
                                     nll.sel(**ref, checkpoint=0.0).values, exact.values)
            lines.append(f"{_label(cell)} ({fmt_bytes(ds['state_bytes'].sel(**cell))}) closes {fmt(est, 2)} "
                         f"({fmt(lo, 2)} to {fmt(hi, 2)}) of `{post}`'s NLL gap to the teacher "
                         f"({fmt_bytes(ds['state_bytes'].sel(**ref))}; r = {cell['num_features']} for both; 1 − mean "
                         "over windows of the student's NLL increase over the post-hoc map's; bootstrap over "
                         "windows).")
    if "distill_minus_next_token_summary" in ds:
        for cell in (c for c in cells if c["student"] in STAGED and c["objective"] == "distill"):
            sel = {k: v for k, v in cell.items() if k != "objective"}
            s = ds["distill_minus_next_token_summary"].sel(**sel)
            p = float(ds["distill_minus_next_token_p"].sel(**sel))
            tokens = float(ds["stage2_tokens"].sel(**cell))
            lines.append(f"At an equal budget of {int(tokens)} training tokens ({cell['student']} at r = "
                         f"{cell['num_features']}, stage 1 by {cell['fit_loss']}), distillation minus next-token NLL: "
                         f"{fmt_ci(s)} nats (Wilcoxon "
                         f"p = {fmt(p, 2)} over {ds.sizes['window']} windows; one training seed: a statement about "
                         "this student, not about the objectives).")
    if "outputs_minus_weights_summary" in ds:
        for cell in (c for c in cells if c["student"] in STAGED and c["fit_loss"] == "outputs"):
            sel = {k: v for k, v in cell.items() if k != "fit_loss"}
            if not np.isfinite(ds["outputs_minus_weights_summary"].sel(**sel, stat="estimate")):
                continue
            stage = "stage 1" if cell["objective"] == "none" else f"after stage 2 ({cell['objective']})"
            lines.append(f"{cell['student']} at r = {cell['num_features']}, {stage}: NLL with the maps fitted by "
                         "outputs (LoLCATs' MSE) minus by weights (Hedgehog's cross-entropy) "
                         f"{fmt_ci(ds['outputs_minus_weights_summary'].sel(**sel))} nats (Wilcoxon p = "
                         f"{fmt(float(ds['outputs_minus_weights_p'].sel(**sel)), 2)} over {ds.sizes['window']} "
                         "windows; one training seed: a statement about this student).")
    for task, name in _lm.TASK_NAMES.items():
        acc = ds["greedy_correct_exact_summary"].sel(context=context, task=task)
        chance = float(ds["recall_chance_mean"].sel(context=context, task=task))
        parts = []
        for cell in cells:
            last = 0.0 if cell["objective"] == "none" else 1.0
            sel = dict(cell, checkpoint=last, task=task)
            parts.append(f"{_label(cell, ds)}: {fmt_ci(ds['greedy_correct_summary'].sel(**sel), percent=True)}, "
                         f"log-probability {fmt_ci(ds['answer_logprob_summary'].sel(**sel))}")
        lines.append(f"{name} recall ({ds.sizes['prompt']} prompts of {context} tokens; chance {fmt(chance, 2)}): "
                     f"teacher {fmt_ci(acc, percent=True)}, log-probability "
                     f"{fmt_ci(ds['answer_logprob_exact_summary'].sel(context=context, task=task))}; "
                     + "; ".join(parts) + ".")
    costs = []
    for cell in (c for c in cells if c["student"] in STAGED):
        if cell["objective"] == "none":
            cached = "stage1_cached" in ds and float(ds["stage1_cached"].sel(**cell)) == 1.0
            costs.append(f"{_label(cell, ds)}: {fmt(float(ds['stage1_cpu_seconds'].sel(**cell)), 2)} CPU-s on "
                         f"{int(ds['stage1_tokens'].sel(**cell))} query positions"
                         + (" (read from the cache: the run that fitted it)" if cached else ""))
        else:
            costs.append(f"{_label(cell, ds)}: stage 2 {fmt(float(ds['stage2_cpu_seconds'].sel(**cell)), 2)} CPU-s "
                         f"on {int(ds['stage2_tokens'].sel(**cell))} tokens")
    if costs:
        lines.append("Cost (CPU seconds; stage 1 once per student, shared by its stage-2 cells): "
                     + "; ".join(costs) + ".")
    return lines + _layer_findings(ds, cells)


SENSITIVE = 6           # how many of the post-hoc map's most sensitive layers the per-layer findings single out


def _layer_findings(ds: xr.Dataset, cells) -> list[str]:
    """Per layer, where each trained student loses (stage 1, and after stage 2 at the end of its budget) against
    post-hoc FAVOR+ at the same r and seed: on the layers where FAVOR+ alone costs most NLL (the sensitivity of
    ``causal_lm``) and on the others."""
    out = []
    for ref in (c for c in cells if c["student"] == "positive_orthogonal"):
        theirs = ds["layer_delta_nll"].sel(**ref).values
        top = np.argsort(-theirs, kind="stable")[:SENSITIVE]
        rest = np.setdiff1d(np.arange(theirs.size), top)
        parts = []
        for cell in (c for c in cells if c["student"] in STAGED and c["num_features"] == ref["num_features"]
                     and c["train_seed"] == ref["train_seed"]):
            mine = ds["layer_delta_nll"].sel(**cell).values
            if not np.isfinite(mine).all():
                continue
            parts.append(f"{_label(cell)} {fmt(mine[top].sum(), 2)} there and {fmt(mine[rest].sum(), 2)} over the "
                         "other layers (its most costly: " + ", ".join(
                             f"{int(i)} (+{fmt(mine[i], 2)})" for i in np.argsort(-mine, kind="stable")[:3]) + ")")
        if parts:
            out.append(f"Per layer ({int(ds['n_layer_windows'])} held-out windows, each layer the student's alone; "
                       f"one draw: a description): FAVOR+ at r = {ref['num_features']} costs most NLL in layers "
                       + ", ".join(f"{int(i)} (+{fmt(theirs[i], 2)})" for i in top)
                       + f", {fmt(theirs[top].sum(), 2)} nats over those {SENSITIVE} and "
                       f"{fmt(theirs[rest].sum(), 2)} over the other {rest.size}; the students at the same r (stage-2 "
                       "students at the end of their budget, with their adapters): " + "; ".join(parts) + ".")
    return out


PHRASES = {"stage1_minus_posthoc": ("stage 1", "post-hoc FAVOR+"),
           "next_token_minus_stage1": ("+ LoRA by next token", "stage 1"),
           "distill_minus_stage1": ("+ LoRA distilled", "stage 1"),
           "distill_minus_next_token": ("distilled", "next token")}


def _seed_findings(ds: xr.Dataset) -> list[str]:
    """The findings of a dataset with several training seeds: every student's numbers as means over the seeds, and
    the paired comparisons of :data:`SEED_COMPARISONS` per trained student, Holm-adjusted over that student's family
    (the NLL and both recall tasks), with verdicts only where at least :data:`kernapprox.stats.MIN_UNITS` seeds
    resolve them."""
    out = []
    m = ds.sizes["train_seed"]
    ppl_name, lp_name, acc_name = _names(ds)
    shown = _shown(ds)
    n_w, n_p = ds.sizes["window"], ds.sizes["prompt"]

    def last(cell):
        return 0.0 if cell["objective"] == "none" else 1.0

    parts = [f"{_label(c)} at r = {c['num_features']}: {fmt_ci(ds[ppl_name].sel(**_at(ds, c), checkpoint=last(c)))}"
             f" ({fmt_bytes(ds['state_bytes'].sel(**c))})" for c in shown]
    out.append(f"Perplexity over {m} training seeds (the unit: each seed's student with its {n_w} held-out windows; "
               "cluster bootstrap over the seeds), at the end of each student's training: " + "; ".join(parts) + ".")
    for task, name in _lm.TASK_NAMES.items():
        teacher = ds["greedy_correct_exact_summary"].sel(context=shown[0]["context"], task=task)
        parts = [f"{_label(c, ds)} "
                 f"{fmt_ci(ds[acc_name].sel(**_at(ds, c), checkpoint=last(c), task=task), percent=True)}"
                 for c in shown]
        out.append(f"{name} greedy accuracy over {m} seeds × {n_p} prompts (cluster bootstrap over the seeds): teacher "
                   f"{fmt_ci(teacher, percent=True)} (its {n_p} prompts); " + "; ".join(parts) + ".")
    for cell in (c for c in shown if c["student"] in STAGED and c["objective"] == "none"):
        spread = ds["nll"].sel(**_at(ds, cell), checkpoint=0.0)
        if np.isfinite(spread.values).all() and float((spread.max("train_seed") - spread.min("train_seed")).max()) == 0:
            out.append(f"The stage-1 {cell['student']} student ({cell['fit_loss']}) at r = {cell['num_features']} is "
                       f"the same in all {m} seeds (identical NLL on every window: its maps start at the identity and "
                       "its calibration windows and fit are fixed), so its seeds vary the post-hoc map's draw and "
                       "stage 2 only; its interval over seeds is empty.")
    exact = ds["nll_exact"].sel(context=shown[0]["context"]).values
    for cell in (c for c in shown if c["student"] in STAGED):
        at = _at(ds, cell)
        ref = dict(at, student="positive_orthogonal", fit_loss="weights", objective="none")
        if "positive_orthogonal" not in ds["student"].values.tolist():
            break
        posthoc = ds["nll_filled"].sel(**ref, checkpoint=0.0).transpose("train_seed", "window").values
        mine = ds["nll_filled"].sel(**at, checkpoint=last(cell)).transpose("train_seed", "window").values
        est, lo, hi = gap_closed(mine, posthoc, exact)
        out.append(f"{_label(cell)} at r = {cell['num_features']} closes {fmt(est, 2)} ({fmt(lo, 2)} to {fmt(hi, 2)}) "
                   f"of post-hoc FAVOR+'s NLL gap to the teacher at the same r (1 − mean of the student's NLL increase "
                   f"over FAVOR+'s, pooled over the {m} seeds' windows; cluster bootstrap over the seeds).")
    if "seed_nll_diff_summary" in ds:
        for cell in (c for c in shown if c["student"] in STAGED and c["objective"] == "none"):
            sel = {k: v for k, v in _at(ds, cell).items() if k != "objective"}
            nll_s, nll_p = ds["seed_nll_diff_summary"].sel(sel), ds["seed_nll_diff_p"].sel(sel)
            lp_s, lp_p = ds["seed_logprob_diff_summary"].sel(sel), ds["seed_logprob_diff_p"].sel(sel)
            comparisons = ds["comparison"].values.tolist()
            tasks = list(_lm.TASKS)
            p_all = np.concatenate([nll_p.values.ravel(), lp_p.transpose("comparison", "task").values.ravel()])
            adjusted = stats.holm(p_all)
            p_nll = dict(zip(comparisons, adjusted[:len(comparisons)]))
            p_lp = {(c, t): adjusted[len(comparisons) + i * len(tasks) + j]
                    for i, c in enumerate(comparisons) for j, t in enumerate(tasks)}

            def says(comparison, summary, p):
                first, second = PHRASES[comparison]
                est, units = float(summary.sel(stat="estimate")), int(summary.sel(stat="count"))
                word = stats.verdict(est, p, units)
                return (f"{first} minus {second} {fmt_ci(summary)} nats (Holm-adjusted p = {fmt(p, 2)}: "
                        f"{'not resolved' if word == 'not resolved' else f'{first} {word}'})")

            label = f"{cell['student']} ({cell['fit_loss']}) at r = {cell['num_features']}"
            out.append(f"What training transfers, {label}, paired over {m} seeds (each seed's mean over its windows; "
                       f"exact Wilcoxon over the seeds, Holm over the {p_all.size} comparisons of this student): NLL "
                       + "; ".join(says(c, nll_s.sel(comparison=c), p_nll[c]) for c in comparisons)
                       + ".")
            for task in tasks:
                out.append(f"{_lm.TASK_NAMES[task]} answer log-probability, {label}, the same seeds and family: "
                           + "; ".join(says(c, lp_s.sel(comparison=c, task=task), p_lp[(c, task)])
                                       for c in comparisons) + ".")
    costs = []
    for cell in (c for c in shown if c["student"] in STAGED):
        at = _at(ds, cell)
        c1 = ds["stage1_cpu_seconds"].sel(**at).mean("train_seed")
        c2 = ds["stage2_cpu_seconds"].sel(**at).mean("train_seed")
        costs.append(f"{_label(cell, ds)}: stage 1 {fmt(float(c1), 2)} CPU-s" + (
            f", stage 2 {fmt(float(c2), 2)} CPU-s on {int(ds['stage2_tokens'].sel(**cell))} tokens"
            if cell["objective"] != "none" else ""))
    if costs:
        out.append(f"Cost, mean over the {m} seeds: " + "; ".join(costs) + ".")
    for cell in (c for c in shown if c["student"] in STAGED):
        at = _at(ds, cell)
        ref = dict(at, student="positive_orthogonal", fit_loss="weights", objective="none")
        mine, theirs = ds["layer_delta_nll"].sel(**at), ds["layer_delta_nll"].sel(**ref)
        if not (np.isfinite(theirs.values).all() and np.isfinite(mine.values).all()):
            continue
        sums = []
        for seed in ds["train_seed"].values.tolist():
            a, b = mine.sel(train_seed=seed).values, theirs.sel(train_seed=seed).values
            top = np.argsort(-b, kind="stable")[:SENSITIVE]
            sums.append((a[top].sum(), b[top].sum()))
        sums = np.asarray(sums)
        out.append(f"Per layer, each seed ({int(ds['n_layer_windows'])} held-out windows, each layer the student's "
                   f"alone): on the {SENSITIVE} layers where that seed's FAVOR+ costs most, "
                   f"{_label(cell, ds)} costs {fmt(sums[:, 0].mean(), 2)} nats "
                   f"({fmt(sums[:, 0].min(), 2)}–{fmt(sums[:, 0].max(), 2)} over seeds) against FAVOR+'s "
                   f"{fmt(sums[:, 1].mean(), 2)} ({fmt(sums[:, 1].min(), 2)}–{fmt(sums[:, 1].max(), 2)}), less in "
                   f"{int((sums[:, 0] < sums[:, 1]).sum())} of {len(sums)} seeds.")
    return out


EXPERIMENT = Experiment.from_module(
    __name__, title="Distilling a pretrained LM's softmax attention into fixed-state students",
    replicates=f"{_lm.REPLICATES}; each interval is conditional on the students trained with the preset's training "
               "seeds (a student trained again elsewhere, with other floating-point reductions, can move a number "
               "beyond it: the seeds preset's spread over training seeds is the interval that covers that)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
