"""A trained recall–memory frontier: MQAR accuracy of models trained from scratch against the bytes of their state.

Zoology's design (Arora et al. 2023, *Zoology: Measuring and Improving Recall in Efficient Language Models*,
sec. 3–4, fig. 2–3) on a CPU budget: small causal Transformers (:func:`kernapprox.models.presets.mqar`'s recipe:
attention-only blocks, N(0, 1) embeddings, AdamW one-cycle, a doubling curriculum on the number of pairs) are trained
on multi-query associative recall (:class:`kernapprox.tasks.MQAR`) with ``N`` key–value pairs in a prompt of
``L = len_per_pair · N`` tokens (``num_pairs`` axis: the state a family needs grows with ``N``), one model per
``(setup, N, family, r, learning rate, seed)``, and read on test prompts.

Families (``estimator`` axis, :data:`FAMILIES`: label → (feature map, state-update rule))
    ``exact``: softmax attention, whose memory is the KV cache ``2 · L · d_h`` floats per head and layer (marked on
    the same bytes axis, run in the ``num_features`` column :data:`SOFTMAX_SLOT` only);
    ``elu1`` (Katharopoulos et al. 2020) and ``taylor2`` (Based, Arora et al. 2024) with the feature dimension set by
    the query/key projection (``qk_dim``: ``r = f`` for ELU+1, ``r = 1 + f + f(f+1)/2 ≤ r_grid`` for Taylor,
    :func:`~kernapprox.models.presets.taylor2_qk_dim`); ``positive_orthogonal`` (FAVOR+, Choromanski et al. 2021)
    with ``r`` random features; ``elu1_delta``: the ELU+1 map under the delta rule (Schlag et al. 2021; β = 1,
    unit keys, state ``r · d_v``), the one state rule of :mod:`kernapprox.rules` besides the sum that a
    :class:`~kernapprox.models.AttentionSpec` names without a parameter and that trains here (decay needs its γ, not
    expressible by a rule name; least squares keeps ``r² + r d_v`` numbers and is in the ``gpu`` preset).
State bytes (``state_bytes``: what a decoder keeps for the next token, float32)
    Σ over layers and heads of the rule's state (:meth:`kernapprox.rules.Rule.state_bytes`: ``r (d_v + 1)`` for the
    sum rule, ``r d_v`` for the delta rule) or of softmax's KV cache (``L (d_qk + d_v)``), plus the short
    convolution's window, ``kernel · d_model`` per layer (the same convention as ``trained_icl``).
Short convolution
    **Every** model, softmax included, has the same causal depthwise convolution (kernel
    :data:`~kernapprox.models.presets.SHORT_CONV` = 3) before each attention: the fixed-state models need it to
    shift tokens (see :mod:`kernapprox.models.presets`), and giving it to softmax too keeps the comparison about the
    attention's memory alone. Its bytes are counted in every model's state.
Learning rate
    Each ``(setup, N, family, r)`` is trained at every rate of the ``lr`` axis (2 in ``default`` and ``full``, 3 in
    ``families``, 4 in ``gpu``); the rate is chosen on **validation** data: the training curve's last held-out accuracy
    (:func:`kernapprox.models.load_or_train`: ``eval_size`` prompts from the evaluation stream of the training seed,
    never trained on), averaged over the seeds (:func:`choose_lr`). Test accuracy is read on other prompts: the
    study's data draw of ``(setup, num_pairs, seed)`` (an independent stream; the same test prompts for every family
    and rate of a seed: paired), and it is reported for the chosen rate only (``test_accuracy_chosen``).
Training
    Linear models train in the ``parallel`` mode (the cheapest at these lengths on a CPU; every mode computes the
    same function, :mod:`kernapprox.attention`), one torch thread, cached by configuration hash. Setups
    (:data:`SETUPS`): ``smoke`` (seconds), ``cpu`` (``d_model`` 32, 2 heads, 2 layers, ``V`` 32, ``L = 8N``, 400
    steps of batch 16), ``gpu`` (Zoology-like widths and lengths; not calibrated on this CPU).
Calibration of ``cpu`` (single 400-step runs, seed 0, one thread; the validation accuracy)
    150 steps left every family, softmax included, at the 1/N plateau (N = 4: 0.20–0.40). With ``V = 64`` and batch
    16 the softmax model stayed at 0.38 (N = 4, 1e-2; a first full default run: median test accuracy 0.39) while
    ELU+1 at r = 32 reached 0.88 (3e-2); with ``V = 32`` softmax reached 0.96 (N = 4) and 0.78 (N = 8) at 1e-2 and
    ELU+1 0.98 at r = 32 and 0.79 at r = 4 (N = 4, 3e-2), so the ``cpu`` setup uses ``V = 32`` and rates
    {1e-2, 3e-2}. One model costs 3–10 CPU seconds (softmax the least, the delta rule at r = 32 and N = 8 the
    most); the default preset's 108 models are well above the 90 CPU seconds a default study should cost (the
    findings state the measured total), the price of three seeds and two rates per configuration.

Unit of replication: the training seed (initialisation, training batches, validation prompts and the test prompts
of that seed). With fewer than :data:`kernapprox.stats.MIN_UNITS` seeds no verdict is given: each point is the
median over seeds with their range (:func:`kernapprox.stats.range_summary`), and a comparison that would need a
verdict says "not resolved". Trivial baselines on every panel: ``1/N`` (a model that knows the answer is one of the
``N`` stored values and guesses among them: the induction plateau of :mod:`kernapprox.models.presets`) and ``2/V``
(a uniform guess among the value tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr

from kernapprox import readout, stats
from kernapprox.models import AttentionSpec, load_or_train, presets
from kernapprox.plotting import errorbar_summary, fmt, fmt_bytes, log_axis, new_figure, palette, save_figure
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli

SOFTMAX_SLOT = 4           # the num_features column in which softmax runs (its memory does not depend on r)
TARGET = 0.9               # the accuracy a state must reach to count as enough


@dataclass(frozen=True)
class Setup:
    """Model size and training budget of one setup: width, heads, layers, vocabulary, prompt tokens per pair
    (``L = len_per_pair · N``), steps and batch, held-out (validation) prompts and test prompts per seed."""

    d_model: int
    num_heads: int
    num_layers: int
    vocab_size: int
    len_per_pair: int
    steps: int
    batch_size: int
    eval_size: int
    test_prompts: int


SETUPS = {
    "smoke": Setup(16, 2, 2, 16, 4, 12, 8, 16, 16),
    "cpu": Setup(32, 2, 2, 32, 8, 400, 16, 128, 256),
    # Zoology-like: d_model 128, L = 8N up to 512 tokens; for a GPU (hours on the 2-core CPU)
    "gpu": Setup(128, 2, 2, 256, 8, 4000, 64, 512, 1024),
}

# label -> (registry name, state-update rule of kernapprox.rules)
FAMILIES = {
    "exact": ("exact", "sum"),
    "elu1": ("elu1", "sum"),
    "taylor2": ("taylor2", "sum"),
    "positive_orthogonal": ("positive_orthogonal", "sum"),
    "elu1_delta": ("elu1", "delta"),
    "elu1_least_squares": ("elu1", "least_squares"),
}
_LINEAR = [f for f in FAMILIES if f not in ("exact", "elu1_least_squares")]

GRIDS = {
    "smoke": {"setup": ["smoke"], "num_pairs": [2], "estimator": ["exact", "elu1", "elu1_delta"],
              "num_features": [4, 16], "lr": [1e-2, 3e-2], "seed": [0, 1, 2]},
    # 2 x 3 configurations x 2 rates x 3 seeds = 36 models, about 190 CPU-s cold (make figures' budget): softmax and
    # ELU+1 at two state sizes; the other families (Taylor, FAVOR+, the delta rule) in families
    "default": {"setup": ["cpu"], "num_pairs": [4, 8], "estimator": ["exact", "elu1"],
                "num_features": [4, 32], "lr": [1e-2, 3e-2], "seed": [0, 1, 2]},
    # make figures PRESET=full's share of its hour: the default's 6 configurations x 2 rates over 10 seeds, the units
    # of a verdict (120 models, ~9 min of one core cold)
    "full": {"setup": ["cpu"], "num_pairs": [4, 8], "estimator": ["exact", "elu1"],
             "num_features": [4, 32], "lr": [1e-2, 3e-2], "seed": list(range(10))},
    # 3 x 13 configurations x 3 rates x 3 seeds = 351 models (~32 min of two processes, make recall-frontier-families).
    # N is at most V/2 - 1 = 15 distinct keys at V = 32.
    "families": {"setup": ["cpu"], "num_pairs": [4, 8, 12], "estimator": ["exact", *_LINEAR],
                 "num_features": [4, 16, 64], "lr": [3e-3, 1e-2, 3e-2], "seed": [0, 1, 2]},
    "gpu": {"setup": ["gpu"], "num_pairs": [8, 16, 32, 64], "estimator": list(FAMILIES),
            "num_features": [4, 8, 16, 32, 64, 128, 256], "lr": [3e-4, 1e-3, 3e-3, 1e-2], "seed": list(range(5))},
}
PARAMETERS = {
    "target": Parameter(TARGET, "accuracy a state must reach to count as enough", "1", "the frontier of the findings: "
                        "the smallest state whose median test accuracy over the seeds reaches it"),
}
AXIS_ATTRS = {
    "setup": {"long_name": "model size and training budget (SETUPS)", "units": "1"},
    "num_pairs": {"long_name": "key-value pairs per prompt N", "units": "1",
                  "description": "prompt length L = len_per_pair · N"},
    "estimator": {"long_name": "family: feature map and state-update rule ('exact': softmax attention)",
                  "units": "1"},
    "num_features": {"long_name": "feature dimension requested r (per head)", "units": "1",
                     "description": "ELU+1: qk_dim = r; Taylor: the largest 1 + f + f(f+1)/2 ≤ r; FAVOR+: r features; "
                                    f"softmax runs in the r = {SOFTMAX_SLOT} column only"},
    "lr": {"long_name": "peak learning rate (AdamW, one-cycle)", "units": "1"},
    "seed": {"long_name": "training seed (initialisation, batches, validation and test prompts)", "units": "1"},
}
METRICS = {
    "test_accuracy": Metric("test accuracy", "1", "MQAR accuracy over every query position of the seed's test prompts "
                            "(the data draw of setup, num_pairs, seed: the same prompts for every family and rate)"),
    "val_accuracy": Metric("validation accuracy", "1", "the training curve's last held-out accuracy (eval_size "
                           "prompts of the training seed's evaluation stream, never trained on); the learning rate is "
                           "chosen on it"),
    "state_bytes": Metric("state read by the last token", "byte", "Σ over layers and heads of the rule's state (sum: "
                          "r·(d_v+1), delta: r·d_v, least squares: r²+r·d_v) or softmax's KV cache L·(d_qk+d_v), plus "
                          "kernel·d_model per layer for the short convolution; float32"),
    "feature_dim": Metric("feature dimension per head as realised", "1",
                          "r of the trained model's map (NaN for softmax)"),
    "seq_len": Metric("prompt length L", "token", "len_per_pair · num_pairs"),
    "train_cpu_seconds": Metric("training CPU time", "s", "CPU seconds of the training process (one torch thread), "
                                "from the checkpoint's curve: the cost when the cache is cold"),
}


# ------------------------------------------------------------------------------------------------ models
def configuration(setup: Setup, num_pairs: int, family: str, r: int, lr: float, seed: int, device: str = "cpu"):
    """``(ModelConfig, MQAR, TrainConfig)`` of one trained model: the calibrated MQAR recipe at the setup's size, the
    family's attention (``parallel`` mode for linear ones) and the short convolution in every model."""
    model, task, train = presets.mqar(d_model=setup.d_model, num_layers=setup.num_layers, num_heads=setup.num_heads,
                                      seq_len=setup.len_per_pair * num_pairs, num_pairs=num_pairs,
                                      vocab_size=setup.vocab_size, steps=setup.steps, batch_size=setup.batch_size,
                                      lr=lr, device=device, seed=seed)
    name, rule = FAMILIES[family]
    spec = AttentionSpec() if name == "exact" else dataclasses.replace(presets.attention_spec(name, r), rule=rule,
                                                                        mode="parallel")
    model = dataclasses.replace(model, attention=spec, short_conv=presets.SHORT_CONV)
    return model, task, dataclasses.replace(train, eval_size=setup.eval_size, eval_every=setup.steps)


def state_bytes(model, seq_len: int) -> int:
    """Bytes a decoder keeps for the next token, from the trained model's own layers (see ``state_bytes``)."""
    exact, cfg = model.layer_specs()[0].estimator == "exact", model.config
    return sum(attn.num_heads * (readout.state_bytes(attn.estimator, attn.head_dim, seq_len) if exact else
                                 attn.rule.state_bytes(attn.estimator, attn.head_dim)) for attn in model.attentions) \
        + cfg.num_layers * cfg.short_conv * cfg.d_model * 4


def kv_cache_bytes(setup: Setup, num_pairs: int) -> int:
    """Softmax's KV cache in closed form: ``2 · L · d_h`` float32 numbers per head and layer (no convolution)."""
    return 2 * setup.len_per_pair * num_pairs * (setup.d_model // setup.num_heads) * 4 * setup.num_heads \
        * setup.num_layers


def applicable(family: str, r: int) -> bool:
    """Softmax runs in the :data:`SOFTMAX_SLOT` column only; every other family at every r."""
    return r == SOFTMAX_SLOT if family == "exact" else True


def check_params(params) -> None:
    if params["setup"] not in SETUPS:
        raise ValueError(f"setup must be one of {', '.join(SETUPS)}, got {params['setup']!r}")
    if params["estimator"] not in FAMILIES:
        raise ValueError(f"estimator must be one of {', '.join(FAMILIES)}, got {params['estimator']!r}")
    most = SETUPS[params["setup"]].vocab_size // 2 - 1
    if params["num_pairs"] > most:
        raise ValueError(f"num_pairs must be at most V/2 - 1 = {most} (distinct keys) in setup {params['setup']!r}, "
                         f"got {params['num_pairs']}")


def draw(params, data_rng, device):
    """The test prompts of ``(setup, num_pairs, seed)``: every family and rate of the seed reads them."""
    setup = SETUPS[params["setup"]]
    _, task, _ = configuration(setup, params["num_pairs"], "exact", SOFTMAX_SLOT, 1e-3, 0)
    return task.sample(data_rng, setup.test_prompts, device=device)


@torch.no_grad()
def run_cell(params, rng, device, data):
    family, r = params["estimator"], params["num_features"]
    if not applicable(family, r):
        return not_applicable()
    setup = SETUPS[params["setup"]]
    model_cfg, task, train_cfg = configuration(setup, params["num_pairs"], family, r, params["lr"], params["seed"],
                                               device=str(device))
    trained = load_or_train(model_cfg, task, train_cfg)
    model, curve = trained.model, trained.curve
    test = task.score(model(data.inputs), data).mean()
    realised = np.nan if family == "exact" else float(model.attentions[0].estimator.num_features)
    return {"test_accuracy": np.float64(test), "val_accuracy": np.float64(curve.eval_score.values[-1]),
            "state_bytes": np.float64(state_bytes(model, task.seq_len)), "feature_dim": np.float64(realised),
            "seq_len": np.float64(task.seq_len),
            "train_cpu_seconds": np.float64(curve.attrs["train_cpu_seconds"])}


# ------------------------------------------------------------------------------------------------ summaries
UNIT = "seed"


def choose_lr(ds: xr.Dataset) -> xr.DataArray:
    """The chosen rate of every ``(setup, num_pairs, estimator, num_features)``: the ``lr`` with the highest mean
    **validation** accuracy over the seeds (the smaller rate on a tie; NaN where nothing ran). Test data are never
    read."""
    val = ds["val_accuracy"].mean(UNIT, skipna=True)
    filled = val.fillna(-np.inf)
    index = filled.argmax("lr")
    chosen = ds["lr"].isel(lr=index).drop_vars("lr", errors="ignore").where(val.notnull().any("lr"))
    return chosen.assign_attrs(long_name="learning rate chosen on validation accuracy", units="1",
                               description="argmax over lr of the mean over seeds of val_accuracy (the smaller on a "
                                           "tie); test accuracy is not read")


def summarise(ds: xr.Dataset) -> xr.Dataset:
    """The chosen rate per configuration, the test accuracy at it (per seed, and its median with the seeds' range),
    the state bytes of each configuration, softmax's KV cache in closed form and the trivial baselines."""
    ds["chosen_lr"] = choose_lr(ds)
    chosen = ds["chosen_lr"].fillna(ds["lr"].values[0])
    at = {"lr": chosen}
    for var, what in (("test_accuracy", "test"), ("val_accuracy", "validation")):
        ds[f"{var}_chosen"] = ds[var].sel(at).drop_vars("lr").where(ds["chosen_lr"].notnull())
        ds[f"{var}_chosen"].attrs = {"long_name": f"{what} accuracy at the chosen learning rate", "units": "1",
                                     "description": f"{var} at chosen_lr, per seed"}
    summary = stats.range_summary(ds["test_accuracy_chosen"], UNIT)
    ds["test_accuracy_summary"] = summary.assign_attrs(
        long_name="test accuracy at the chosen learning rate", units="1",
        description="median over seeds with the seeds' range (lo, hi; not a confidence interval): "
                    + summary.attrs.get("interval", "range"))
    ds["state_bytes_config"] = ds["state_bytes"].max(("lr", UNIT), skipna=True).assign_attrs(
        long_name="state read by the last token", units="byte",
        description="state_bytes of the configuration (the same at every rate and seed)")
    setups = [SETUPS[str(s)] for s in ds["setup"].values]
    kv = [[kv_cache_bytes(s, int(n)) for n in ds["num_pairs"].values] for s in setups]
    ds["kv_cache_bytes"] = xr.DataArray(np.asarray(kv, dtype=np.float64), dims=("setup", "num_pairs"),
                                        attrs={"long_name": "softmax KV cache (closed form)", "units": "byte",
                                               "description": "2·L·d_h float32 numbers per head and layer, without "
                                                              "the short convolution"})
    ds["chance_pairs"] = (1.0 / ds["num_pairs"].astype(np.float64)).assign_attrs(
        long_name="trivial baseline 1/N", units="1",
        description="accuracy of a guess among the prompt's N stored values (the induction plateau)")
    vocab = [SETUPS[str(s)].vocab_size for s in ds["setup"].values]
    ds["chance_vocab"] = xr.DataArray(2.0 / np.asarray(vocab, dtype=np.float64), dims=("setup",),
                                      attrs={"long_name": "trivial baseline 2/V", "units": "1",
                                             "description": "accuracy of a uniform guess among the V/2 value tokens"})
    return ds


def smallest_enough(ds: xr.Dataset, setup, num_pairs, family, target: float):
    """``(bytes, accuracy)`` of the smallest state of ``family`` whose median test accuracy reaches ``target``, or
    ``None``."""
    at = {"setup": setup, "num_pairs": num_pairs, "estimator": family}
    med = ds["test_accuracy_summary"].sel(**at, stat="estimate").values
    size = ds["state_bytes_config"].sel(**at).values
    ok = np.isfinite(med) & np.isfinite(size) & (med >= target)
    if not ok.any():
        return None
    i = np.flatnonzero(ok)[np.argmin(size[ok])]
    return float(size[i]), float(med[i])


def _span(ds: xr.Dataset, at: dict, family: str) -> str:
    """``family a (bytes) → b (bytes)``: the median test accuracy at the smallest and at the largest state."""
    med = ds["test_accuracy_summary"].sel(**at, estimator=family, stat="estimate").values
    size = ds["state_bytes_config"].sel(**at, estimator=family).values
    keep = np.flatnonzero(np.isfinite(med) & np.isfinite(size))
    if not keep.size:
        return f"{family} not run"
    lo, hi = keep[np.argmin(size[keep])], keep[np.argmax(size[keep])]
    return f"{family} {fmt(med[lo])} ({fmt_bytes(size[lo])}) → {fmt(med[hi])} ({fmt_bytes(size[hi])})"


# ------------------------------------------------------------------------------------------------ figure
def _families(ds) -> list[str]:
    return [str(f) for f in ds["estimator"].values]


def plot(ds: xr.Dataset, path) -> None:
    setup = str(ds["setup"].values[0])
    pairs = [int(n) for n in ds["num_pairs"].values]
    fig, axes = new_figure(1, len(pairs), squeeze=False, height=3.3, sharey=True)
    colours = palette(_families(ds))
    for ax, n in zip(axes[0], pairs):
        at = {"setup": setup, "num_pairs": n}
        for family in _families(ds):
            summary = ds["test_accuracy_summary"].sel(**at, estimator=family)
            size = ds["state_bytes_config"].sel(**at, estimator=family)
            keep = np.isfinite(size.values)
            if not keep.any():
                continue
            order = np.argsort(size.values[keep])
            style = {"marker": "*", "markersize": 10, "linestyle": "none"} if family == "exact" else \
                {"marker": "o", "markersize": 4, "linestyle": "-", "linewidth": 1.0}
            errorbar_summary(ax, summary.isel(num_features=np.flatnonzero(keep)[order]),
                             size.values[keep][order], color=colours[family], label=family.replace("_", " "), **style)
        kv = float(ds["kv_cache_bytes"].sel(**at))
        ax.axvline(kv, color="0.5", linestyle=":", linewidth=0.9, label="softmax KV cache")
        ax.axhline(float(ds["chance_pairs"].sel(num_pairs=n)), color="0.4", linestyle="--", linewidth=0.8,
                   label="chance 1/N")
        ax.axhline(float(ds["chance_vocab"].sel(setup=setup)), color="0.7", linestyle="-.", linewidth=0.8,
                   label="chance 2/V")
        ax.axhline(float(ds["target"]), color="0.8", linewidth=0.6)
        log_axis(ax, unit="bytes", label="state bytes (float32, conv included)")
        ax.set(ylim=(-0.03, 1.03), title=f"N = {n} pairs, L = {int(ds['seq_len'].sel(**at).max())}")
    axes[0][0].set_ylabel("MQAR test accuracy")
    axes[0][-1].legend(fontsize=6, loc="center right")
    s = SETUPS[setup]
    caption = (
        f"Trained recall–memory frontier: MQAR test accuracy of models trained from scratch (d_model = {s.d_model}, "
        f"{s.num_heads} heads, {s.num_layers} layers, V = {s.vocab_size}, {s.steps} steps of batch {s.batch_size}) "
        f"against the bytes of the state a decoder keeps (log axis; every model, softmax included, has the same "
        f"short convolution, counted). Points: median over {ds.sizes['seed']} training seeds at the learning rate "
        f"chosen on validation prompts; bars: the seeds' range (not a confidence interval). Star: softmax; dotted "
        f"line: its KV cache; dashed: chance 1/N; dash-dotted: 2/V; thin line: the target {fmt(float(ds['target']))}.")
    save_figure(fig, path, caption, title="Trained recall–memory frontier (MQAR)")


# ------------------------------------------------------------------------------------------------ findings
def findings(ds: xr.Dataset) -> list[str]:
    target = float(ds["target"])
    units = ds.sizes[UNIT]
    lines = []
    for setup in ds["setup"].values:
        for n in ds["num_pairs"].values:
            at = {"setup": setup, "num_pairs": n}
            kv = float(ds["kv_cache_bytes"].sel(**at))
            parts = []
            for family in _families(ds):
                if family == "exact":
                    continue
                found = smallest_enough(ds, setup, n, family, target)
                sizes = ds["state_bytes_config"].sel(**at, estimator=family)
                if not np.isfinite(sizes.values).any():
                    continue
                if found is None:
                    best = ds["test_accuracy_summary"].sel(**at, estimator=family, stat="estimate")
                    parts.append(f"{family} never in the grid (best median {fmt(float(best.max()))} up to "
                                 f"{fmt_bytes(float(sizes.max()))})")
                else:
                    parts.append(f"{family} at {fmt_bytes(found[0])} ({fmt(found[0] / kv)} of the KV cache; "
                                 f"median {fmt(found[1])})")
            soft = ds["test_accuracy_summary"].sel(**at, estimator="exact") if "exact" in _families(ds) else None
            soft_text = "" if soft is None else (
                f" Softmax (KV cache {fmt_bytes(kv)} + convolution): median "
                f"{fmt(float(soft.sel(stat='estimate').max()))}"
                f" (range {fmt(float(soft.sel(stat='lo').max()))}–{fmt(float(soft.sel(stat='hi').max()))}).")
            lines.append(f"N = {int(n)} pairs, median test accuracy from the smallest to the largest state: "
                         + "; ".join(_span(ds, at, f) for f in _families(ds) if f != "exact") + ".")
            lines.append(f"N = {int(n)} pairs, L = {int(ds['seq_len'].sel(**at).max())}: the smallest state whose "
                         f"median test accuracy over {units} seeds reaches {fmt(target)}: " + "; ".join(parts) + "."
                         + soft_text + f" Chance: 1/N = {fmt(float(ds['chance_pairs'].sel(num_pairs=n)))}, "
                         f"2/V = {fmt(float(ds['chance_vocab'].sel(setup=setup)))}.")
        saturated = [f for f in _families(ds) if f != "exact" and all(
            (found := smallest_enough(ds, setup, n, f, target)) is not None
            and found[0] <= float(ds["state_bytes_config"].sel(setup=setup, num_pairs=n, estimator=f).min())
            for n in ds["num_pairs"].values)]
        lines.append("Families at the target already at their smallest state for every N (memory never limits them "
                     "in this grid): " + (", ".join(saturated) if saturated else "none") + ".")
    cpu = float(ds["train_cpu_seconds"].sum())
    lines.append(f"Training cost: {fmt(cpu)} CPU seconds for {int(ds['train_cpu_seconds'].notnull().sum())} models "
                 f"(one thread, cold cache).")
    lines.append(f"Family against family: not resolved ({units} training seeds, fewer than the {stats.MIN_UNITS} a "
                 f"verdict needs); the bars are the seeds' range.")
    return lines


DATA_AXES = ("setup", "num_pairs", "seed")
EXPERIMENT = Experiment.from_module(
    __name__, title="Trained recall–memory frontier (MQAR accuracy against state bytes)",
    description="Where does memory limit recall? Models trained from scratch on MQAR with a number of pairs that grows "
                "with the prompt, every fixed-state family (ELU+1, Taylor, FAVOR+, the delta rule) at several state "
                "sizes and softmax attention with its KV cache on one bytes axis, the same short convolution in every "
                "model, the learning rate chosen per configuration on validation prompts and test accuracy on other "
                "prompts, several training seeds. Grid: setup × num_pairs × estimator × num_features × lr × seed.",
    replicates="the training seeds (none is drawn here: every range above is the seeds' smallest to largest "
               "value)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
