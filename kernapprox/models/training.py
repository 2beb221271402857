"""Deterministic training of the small causal Transformers, the training curve as a dataset, a checkpoint cache.

Determinism
-----------
Everything random comes from one ``SeedSequence(seed)`` spawned into three numpy streams: the initialisation
(:class:`~kernapprox.models.CausalTransformer` draws every weight from it), the training data (one batch per step
from ``task.sample``) and the held-out evaluation prompts of the curve. Training runs with a fixed number of
torch threads (``TrainConfig.threads``, set for the duration of training and put back afterwards) because the
reduction order of a matmul depends on it; no dropout. On a CPU the same configuration then gives bitwise the
same weights and curve (the tests check it). On CUDA, bitwise reproducibility additionally needs
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and deterministic kernels, which this module does not force: the cache key
holds the device, so CPU and GPU checkpoints never mix.

Training time is recorded both as wall seconds (``train_seconds``) and as the process's CPU seconds
(``train_cpu_seconds``): with one thread and nothing else in the process, the CPU seconds are what the training
costs on a quiet core, while the wall time grows with whatever else shares the machine.

Cache
-----
:func:`load_or_train` keeps every trained model in the result store (:mod:`kernapprox.store`, below the cache root
of :mod:`kernapprox.cache` unless a ``cache_dir`` is given) under :func:`config_key`, a SHA-256 over the JSON of the
model configuration, the task configuration and the training configuration (every hyperparameter, the seed, the
threads, the device). An entry is a folder of two files, renamed into place whole: ``weights.pt``
(``torch.save(state_dict)``, loaded with ``torch.load(..., weights_only=True)``) and ``curve.nc``, the training curve
with the provenance as attributes (the configuration, the key, versions, git revision, threads, device, training
seconds, date). A hit rebuilds the model from its configuration and loads the state dict: bitwise the model that
was trained.

The entry carries the dependency record of the training process (the store's one rule): the digests of the code of
every library module it had loaded (syntax trees without docstrings and comments) and the package versions. While
they are today's the entry is used; a change of that code is a miss; a change of code the training process never
loaded (a trainable map's module, plotting, the sweep engine, the studies) is not.

Schedule
--------
AdamW; ``schedule="one_cycle"``: linear warm-up over ``warmup`` of the steps, then cosine decay to zero
(Smith & Topin 2019's one-cycle shape); ``"constant"``: the base rate throughout. ``curriculum`` is a tuple of
``(start_step, difficulty)``: from ``start_step`` on, batches come from ``task.with_difficulty(difficulty)``
(MQAR: pairs; regression: points), the full task after the last stage (see :mod:`kernapprox.models.presets` for
the calibrated choices and why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xarray as xr

from ..provenance import git_revision
from ..tasks import TASKS
from ..validation import check_choice, check_positive_float, check_positive_int
from .transformer import CausalTransformer, ModelConfig

__all__ = ["TrainConfig", "TrainedModel", "train", "load_or_train", "build_model", "config_key", "evaluate"]

SCHEDULES = ("one_cycle", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """Training hyperparameters (all of them enter the cache key).

    Parameters
    ----------
    steps, batch_size : int
    lr, weight_decay : float
        AdamW's rate and decoupled weight decay.
    betas : tuple of float
    schedule : {"one_cycle", "constant"}
    warmup : float
        Fraction of the steps spent warming up (one-cycle).
    grad_clip : float
        Global gradient-norm clip (0: none).
    curriculum : tuple of (int, int)
        ``(start_step, difficulty)`` stages; empty: the full task from the start.
    eval_every, eval_size : int
        Curve points and the held-out prompts each is measured on.
    seed : int
    threads : int
        torch threads while training.
    device : str
    """

    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.98)
    schedule: str = "one_cycle"
    warmup: float = 0.1
    grad_clip: float = 1.0
    curriculum: tuple = ()
    eval_every: int = 100
    eval_size: int = 256
    seed: int = 0
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_size", "threads"):
            check_positive_int(getattr(self, name), name)
        check_positive_float(self.lr, "lr")
        check_positive_float(self.weight_decay, "weight_decay", allow_zero=True)
        check_positive_float(self.grad_clip, "grad_clip", allow_zero=True)
        check_choice(self.schedule, "schedule", SCHEDULES)
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        stages = tuple((int(s), int(v)) for s, v in self.curriculum)
        if any(b[0] <= a[0] for a, b in zip(stages, stages[1:])) or any(s < 0 or v <= 0 for s, v in stages):
            raise ValueError(f"curriculum must be (start_step, difficulty) pairs with increasing steps, got "
                             f"{self.curriculum!r}")
        object.__setattr__(self, "curriculum", stages)
        torch.device(self.device)                                      # a valid device name

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"], d["curriculum"] = list(self.betas), [list(s) for s in self.curriculum]
        return d

    @classmethod
    def from_dict(cls, data) -> TrainConfig:
        return cls(**{**data, "betas": tuple(data["betas"]), "curriculum": tuple(map(tuple, data["curriculum"]))})

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if self.schedule == "constant":
            return self.lr
        warm = int(self.warmup * self.steps)
        if step < warm:
            return self.lr * (step + 1) / warm
        progress = (step - warm) / max(1, self.steps - warm)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))

    def difficulty_at(self, step: int) -> int | None:
        """The curriculum difficulty of step ``step`` (``None``: the full task)."""
        value = None
        for start, difficulty in self.curriculum:
            if step >= start:
                value = difficulty
        return value


class TrainedModel(NamedTuple):
    """A trained model (eval mode), its training curve (``xarray.Dataset`` over ``step`` with the provenance
    attributes), its cache key and whether it came from the cache."""

    model: CausalTransformer
    curve: xr.Dataset
    key: str
    cached: bool


# ---------------------------------------------------------------------------------------- configuration
def _payload(model_config: ModelConfig, task, train_config: TrainConfig) -> dict:
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if not isinstance(train_config, TrainConfig):
        raise TypeError(f"train_config must be a TrainConfig, got {type(train_config).__name__}")
    if type(task) not in TASKS.values():
        raise TypeError(f"task must be one of {', '.join(t.__name__ for t in TASKS.values())}, got "
                        f"{type(task).__name__}")
    return {"model": model_config.to_dict(), "task": task.to_dict(), "train": train_config.to_dict()}


def config_key(model_config: ModelConfig, task, train_config: TrainConfig) -> str:
    """The store key: SHA-256 (24 hex digits) of the canonical JSON of the full configuration (the model, the task,
    every training hyperparameter, the seed, the threads and the device). The code and the package versions are
    the entry's dependency record (:mod:`kernapprox.store`), not part of the key."""
    text = json.dumps(_payload(model_config, task, train_config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------------------------ training
def build_model(model_config: ModelConfig, task, seed: int | np.random.SeedSequence) -> CausalTransformer:
    """The untrained model of a configuration: weights from the initialisation stream of ``seed``."""
    ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    init_ss = ss.spawn(3)[0]
    return CausalTransformer(model_config, rng=np.random.default_rng(init_ss), **task.model_io)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@torch.no_grad()
def evaluate(model: CausalTransformer, task, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, scores)`` of ``model`` on a batch of prompts: the task loss (mean) and the per-prompt score
    (``(B,)`` float64: MQAR accuracy, regression normalised error of the last prediction)."""
    outputs = model(batch.inputs)
    return task.loss(outputs, batch), task.score(outputs, batch)


def train(model_config: ModelConfig, task, train_config: TrainConfig) -> TrainedModel:
    """Train a model from scratch (no cache); see the module docstring. Returns a :class:`TrainedModel`."""
    key = config_key(model_config, task, train_config)
    device = torch.device(train_config.device)
    data_ss, eval_ss = np.random.SeedSequence(train_config.seed).spawn(3)[1:]
    data_gen, eval_gen = np.random.default_rng(data_ss), np.random.default_rng(eval_ss)
    cfg = train_config
    with _threads(cfg.threads), torch.enable_grad():           # callers may hold no_grad
        start, cpu_start = time.perf_counter(), time.process_time()
        model = build_model(model_config, task, cfg.seed).to(device)
        eval_task = task.evaluation()
        eval_batch = eval_task.sample(eval_gen, cfg.eval_size, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        rows = {name: [] for name in ("step", "train_loss", "eval_loss", "eval_score", "lr", "difficulty")}
        running, count = 0.0, 0
        for step in range(cfg.steps):
            difficulty = cfg.difficulty_at(step)
            stage = task if difficulty is None else task.with_difficulty(difficulty)
            batch = stage.sample(data_gen, cfg.batch_size, device=device)
            lr = cfg.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            model.train()
            loss = stage.loss(model(batch.inputs), batch)
            if not torch.isfinite(loss.detach()):
                raise FloatingPointError(f"training loss became {float(loss.detach())} at step {step} (config {key})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            running += float(loss.detach())
            count += 1
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                model.eval()
                eval_loss, scores = evaluate(model, eval_task, eval_batch)
                for name, value in (("step", step + 1), ("train_loss", running / count),
                                    ("eval_loss", float(eval_loss)), ("eval_score", float(scores.mean())),
                                    ("lr", lr), ("difficulty", stage.difficulty)):
                    rows[name].append(value)
                running, count = 0.0, 0
        seconds = (time.perf_counter() - start, time.process_time() - cpu_start)
    model.eval()
    curve = _curve(rows, model_config, task, train_config, key, seconds)
    return TrainedModel(model, curve, key, False)


def _curve(rows, model_config, task, train_config, key, seconds) -> xr.Dataset:
    payload = _payload(model_config, task, train_config)
    score = task.score_name
    ds = xr.Dataset(
        {"train_loss": ("step", np.asarray(rows["train_loss"]), {"long_name": "training loss (mean since the last "
                                                                              "point)", "units": "1"}),
         "eval_loss": ("step", np.asarray(rows["eval_loss"]), {"long_name": "held-out loss", "units": "1"}),
         "eval_score": ("step", np.asarray(rows["eval_score"]),
                        {"long_name": f"held-out {score}", "units": "1",
                         "description": f"mean {score} over {train_config.eval_size} held-out prompts of the full "
                                        "task"}),
         "lr": ("step", np.asarray(rows["lr"]), {"long_name": "learning rate", "units": "1"}),
         "difficulty": ("step", np.asarray(rows["difficulty"], dtype=np.int64),
                        {"long_name": "curriculum difficulty (MQAR pairs / regression points)", "units": "1"})},
        coords={"step": ("step", np.asarray(rows["step"], dtype=np.int64))},
        attrs={"title": f"training curve of a {task.name} model", "config": json.dumps(payload, sort_keys=True),
               "config_key": key, "torch_version": str(torch.__version__),
               "numpy_version": np.__version__, "git_revision": git_revision(), "threads": train_config.threads,
               "device": train_config.device, "train_seconds": float(seconds[0]),
               "train_cpu_seconds": float(seconds[1]),
               "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")})
    return ds


# ----------------------------------------------------------------------------------------------------- cache
def load_or_train(model_config: ModelConfig, task, train_config: TrainConfig, *, cache_dir=None) -> TrainedModel:
    """The trained model of a configuration: from the result store when a valid entry is there, else trained and
    stored.

    The entry is ``objects/trained_models/<task>_<key>.<record>/`` of :mod:`kernapprox.store` (below
    ``<cache_dir>/store``, default the cache root's): ``weights.pt`` and ``curve.nc``. It is valid while the code of
    every library module the training process had loaded is unchanged (and the package versions); a hit rebuilds
    the model and loads the weights with ``torch.load(weights_only=True)`` on ``train_config.device``.
    """
    from ..store import Store, default_store

    store = Store(Path(cache_dir) / "store") if cache_dir is not None else default_store()
    key = config_key(model_config, task, train_config)
    name = f"{task.name}_{key}"
    entry = store.find(NAMESPACE, name)
    if entry is not None:
        model = build_model(model_config, task, train_config.seed).to(train_config.device)
        state = torch.load(entry / "weights.pt", map_location=train_config.device, weights_only=True)
        model.load_state_dict(state)
        with xr.open_dataset(entry / "curve.nc", engine="h5netcdf") as ds:
            curve = ds.load()
        return TrainedModel(model.eval(), curve, key, True)
    trained = train(model_config, task, train_config)

    def write(folder: Path) -> None:
        torch.save(trained.model.state_dict(), folder / "weights.pt")
        trained.curve.to_netcdf(folder / "curve.nc", engine="h5netcdf")

    store.put(NAMESPACE, name, write)
    return trained


NAMESPACE = "trained_models"
