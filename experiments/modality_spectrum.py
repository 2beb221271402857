"""The state-size spectrum by modality: do real audio and video compress into a smaller attention state than text?

For each source (:data:`kernapprox.tasks.SEQUENCE_SOURCES`: Shakespeare as UTF-8 bytes, log-mel frames of a piece of
music and of read English speech (LibriVox), 8×8 grey patches of two videos in raster order, and a smooth
Gaussian-process reference) the same small causal Transformer (2 layers, 4 heads, width 64, MLP blocks, learned
positions) is trained on next-step prediction of that source's training block (:class:`kernapprox.tasks.NextStep`;
seeded and cached by its configuration hash, one model per ``train_seed``). The pretrained heads of SmolLM2-135M on
Shakespeare's BPE tokens (8 heads drawn per seed among its 30 × 9 query heads, after the rotary embedding, on two
disjoint evaluation windows per seed) and of the bidirectional encoder all-MiniLM-L6-v2 (8 of its 6 × 12 heads and a
window of Python's help text drawn per seed, :class:`kernapprox.real.RealHeads`) are the real-text references at the
tokenisation of real models.

On fixed evaluation windows (the last quarter of each source, never trained on) and every head:

1. **Spectra.** For the first ``n`` steps of a window (``n`` ∈ :data:`LENGTHS`, up to the training context), the
   singular values of the kernel matrix ``A = exp(s QKᵀ)`` and of the row-normalised attention matrix
   ``P = softmax(s QKᵀ)`` (float64; :mod:`kernapprox.spectrum`) and the smallest rank ``r`` whose best (truncated
   SVD) approximation has relative Frobenius error ≤ 1 % and ≤ 10 % (Eckart–Young). The model is causal, but the
   matrices are the full ones: a lower-triangular matrix with a positive diagonal has full rank, so the masked
   matrix is not the object a feature map approximates; a state of ``r`` features approximates the kernel on the
   pairs of the window, and the rank the full matrix needs bounds the rank the causal pairs need **from above**.
   The growth exponent is the per-model log–log slope of the rank in ``n``.
2. **Post-hoc substitution.** Every layer's softmax replaced by FAVOR+ (positive orthogonal random features) or
   Nyström (uniform landmarks, fitted on training windows) at ``r`` features (``posthoc_r``), the trained weights
   kept: the loss increase, and the share of the model's gain over the best trivial predictor that it loses.
3. **Trained from scratch at a fixed state.** The same architecture trained with the same data, steps and seed but
   linear attention with the ``elu + 1`` map (Katharopoulos et al. 2020, eq. 7): a state of ``d_k (d_v + 1)``
   numbers per head, the same bytes for every source, marked against the KV cache at each ``n``.

Trivial baselines (:meth:`kernapprox.tasks.NextStep.baseline_losses`): the unigram byte distribution for text; the
mean frame and the previous frame (persistence) for frames. The unit of replication is the trained model
(``train_seed``: its initialisation, data order and feature draws); windows and heads are nested in it, and every
interval resamples models. Cross-source comparisons are between independently trained models (paired only by seed
index), tested with Wilcoxon's signed-rank test on the per-model values and given a verdict only with ≥ 10 models.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import xarray as xr

from experiments._common import add_summaries, per_draw_slope
from kernapprox import memory, plotting, stats
from kernapprox.models.training import TrainConfig, load_or_train
from kernapprox.models.transformer import AttentionSpec, ModelConfig, attention_heads, substitute
from kernapprox.plotting import finite_values, fmt, fmt_ci
from kernapprox.spectrum import attention_singular_values, kernel_singular_values, rank_for_relative_error
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli
from kernapprox.tasks import NextStep
from kernapprox.tasks.sequence import unavailable_reason

PRETRAINED = "text_smollm2"
ENCODER = "text_minilm"
LENGTHS = [32, 64, 128, 256]
TARGETS = [0.01, 0.1]
HEADS = 8                                          # 2 layers × 4 heads of the trained models; 8 drawn of SmolLM2
POSTHOC_MAPS = ["positive_orthogonal", "nystrom_uniform"]
POSTHOC_R = [16, 64]
SCRATCH_MAP = "elu1"
EVAL_WINDOWS = 4
WEAK_GAIN = 0.1                                    # a model gaining less over the trivial predictor is flagged
MODEL = {"d_model": 64, "num_layers": 2, "num_heads": 4, "mlp": True}
LABELS = {"text": "text (bytes)", "music": "music (log-mel)", "speech": "speech (log-mel)",
          "video": "video (patches)",
          "video_cuts": "video with cuts (patches)", "gp_l8": "smooth GP, ℓ = 8 (synthetic)",
          "zipf_markov": "Zipf–Markov tokens (synthetic)",
          PRETRAINED: "text (SmolLM2 heads, BPE)", ENCODER: "text (MiniLM heads, WordPiece, bidirectional)"}
TICKS = {"text": "text\n(bytes)", "music": "music\n(log-mel)", "speech": "speech\n(log-mel)",
         "video": "video\n(patches)",
         "video_cuts": "video, cuts\n(patches)", "gp_l8": "GP, ℓ = 8\n(synthetic)",
         "zipf_markov": "Zipf–Markov\n(synthetic)",
         PRETRAINED: "SmolLM2\n(BPE)", ENCODER: "MiniLM\n(WordPiece)"}
SHORT = {"text": "text bytes", "music": "music", "speech": "speech", "video": "video patches",
         "video_cuts": "video with cuts",
         "gp_l8": "smooth GP", "zipf_markov": "Zipf–Markov tokens", PRETRAINED: "SmolLM2 heads",
         ENCODER: "MiniLM heads"}
COLORS = {"text": "#d55e00", PRETRAINED: "#000000", "music": "#0173b2", "speech": "#ca9161", "video": "#029e73",
          "video_cuts": "#56b4e9",
          "gp_l8": "#949494", "zipf_markov": "#fbafe4",
          ENCODER: "#cc78bc"}


def _unavailable(source: str) -> str | None:
    """Why ``source`` cannot run here (``None``: it can)."""
    if source == PRETRAINED:
        from kernapprox import lm
        return lm.unavailable_reason() or lm.text_unavailable_reason("shakespeare")
    if source == ENCODER:
        from kernapprox import real
        return real.unavailable_reason()
    return unavailable_reason(source)


def _sources(wanted) -> list[str]:
    out = []
    for s in wanted:
        reason = _unavailable(s)
        if reason is None:
            out.append(s)
        else:
            warnings.warn(f"modality_spectrum: source {s!r} is skipped: {reason}", stacklevel=2)
    return out


_DEFAULT = ["text", "music", "speech", "video", "gp_l8", PRETRAINED, ENCODER]
GRIDS = {
    "smoke": {"source": _sources(["music", "gp_l8"]), "context": [32], "train_steps": [20], "train_seed": [0, 1]},
    "default": {"source": _sources(_DEFAULT), "context": [128], "train_steps": [300], "train_seed": [0, 1, 2]},
    # make figures PRESET=full's share of its hour (~25 min of one core when it trains its models, less with them
    # cached): ten trained models per source, the units of its verdicts, at the default's training budget
    "full": {"source": _sources([*_DEFAULT, "video_cuts", "zipf_markov"]), "context": [128], "train_steps": [300],
             "train_seed": list(range(10))},
    # windows of 256 steps, the rank's growth to n = 256 (ten models per source, ~40 min of two cores, make
    # modality-spectrum-context256)
    "context256": {"source": _sources(_DEFAULT), "context": [256], "train_steps": [300],
                   "train_seed": list(range(10))},
    # twice the training (~30 min of one core, make modality-spectrum-steps600)
    "steps600": {"source": _sources([*_DEFAULT, "video_cuts", "zipf_markov"]), "context": [128],
                 "train_steps": [600],
                 "train_seed": list(range(10))},
}
PARAMETERS = {
    "batch_size": Parameter(8, long_name="training windows per step", units="1"),
    "lr": Parameter(0.01, long_name="peak learning rate (AdamW, one-cycle)", units="1"),
}
AXIS_ATTRS = {"source": {"long_name": "source (modality) of the sequences", "units": "1"},
              "context": {"long_name": "training and evaluation window length", "units": "step"},
              "train_steps": {"long_name": "training steps of each model", "units": "1"},
              "train_seed": {"long_name": "trained model (seed of initialisation, data order and feature draws)",
                             "units": "1"},
              "seq_len": {"long_name": "prefix length n of the evaluation window", "units": "step"},
              "target": {"long_name": "target relative Frobenius error of the rank-r approximation", "units": "1"}}

_NT = {"seq_len": LENGTHS, "target": TARGETS}
_PH = {"posthoc_map": POSTHOC_MAPS, "posthoc_r": POSTHOC_R}
METRICS = {
    "rank_attention": Metric("rank for a relative error of the attention matrix", "1",
                             "smallest r with ‖P − P_r‖_F ≤ target·‖P‖_F, P = softmax(s QKᵀ) of the first n steps of "
                             "an evaluation window; mean over the windows and heads of the model (NaN: n > context)",
                             dims=("seq_len", "target"), coords=_NT),
    "rank_kernel": Metric("rank for a relative error of the kernel matrix", "1",
                          "as rank_attention for A = exp(s QKᵀ)", dims=("seq_len", "target"), coords=_NT),
    "attention_sv": Metric("normalised singular values of the attention matrix", "1",
                           "σ_i/σ_1 of P at n = context, median over the model's windows and heads",
                           dims=("sv_index",)),
    "logit_std": Metric("spread of the attention logits", "1", "std of s q_iᵀk_j over the pairs of a window at n = "
                        "context, mean over windows and heads", dims=()),
    "eval_loss": Metric("held-out next-step loss of the softmax model", "1",
                        "mean over the evaluation windows: nats per byte (text) or squared error per dimension "
                        "(standardised frames)"),
    "trivial_loss": Metric("held-out loss of the best trivial predictor", "1",
                           "the smaller of the unigram (text), mean-frame and previous-frame (frames) losses on the "
                           "same windows"),
    "persistence_loss": Metric("held-out loss of the previous frame", "1", "frames only (NaN for text)"),
    "posthoc_loss": Metric("held-out loss, every layer's attention replaced post hoc", "1",
                           "the trained weights with each layer's softmax replaced by the map at r features",
                           dims=("posthoc_map", "posthoc_r"), coords=_PH),
    "scratch_loss": Metric("held-out loss of the fixed-state model trained from scratch", "1",
                           "the same architecture, data, steps and seed with elu+1 linear attention"),
    "scratch_state_bytes": Metric("state of the fixed-state model", "byte",
                                  "elu+1 state (W and z) of all layers and heads, float32"),
    "kv_bytes": Metric("KV cache of the softmax model", "byte", "keys and values of all layers and heads at n, "
                       "float32", dims=("seq_len",), coords={"seq_len": LENGTHS}),
}


# ----------------------------------------------------------------------------------------------- models
def _configs(params, attention: AttentionSpec) -> tuple[ModelConfig, NextStep, TrainConfig]:
    context = params["context"]
    task = NextStep(params["source"], seq_len=context)
    model = ModelConfig(**MODEL, max_len=context, attention=attention)
    seed = int(np.random.SeedSequence([params["train_seed"], 0x5EC]).generate_state(1)[0] >> 1)
    train = TrainConfig(steps=params["train_steps"], batch_size=params["batch_size"], lr=params["lr"],
                        eval_every=params["train_steps"], eval_size=16, seed=seed)
    return model, task, train


@functools.lru_cache(maxsize=2)
def _smollm2():
    from kernapprox import lm
    return lm.load_smollm2()


def _window_heads(q, k, scale, lengths) -> dict:
    """Ranks (per n and target), spectra and logit spread of heads ``q``, ``k`` ``(W, H, N, d)`` float64."""
    rank_a = np.full((len(LENGTHS), len(TARGETS)), np.nan)
    rank_k = np.full((len(LENGTHS), len(TARGETS)), np.nan)
    for i, n in enumerate(LENGTHS):
        if n not in lengths:
            continue
        qa, ka_ = q[..., :n, :], k[..., :n, :]
        sv_a = attention_singular_values(qa, ka_, scale)
        sv_k = kernel_singular_values(qa, ka_, scale)
        for j, t in enumerate(TARGETS):
            rank_a[i, j] = rank_for_relative_error(sv_a, t).mean()
            rank_k[i, j] = rank_for_relative_error(sv_k, t).mean()
    n = max(lengths)
    sv = attention_singular_values(q[..., :n, :], k[..., :n, :], scale)
    logits = scale * (q[..., :n, :] @ k[..., :n, :].transpose(-1, -2))
    return {"rank_attention": rank_a, "rank_kernel": rank_k,
            "attention_sv": np.median(sv.reshape(-1, sv.shape[-1]), axis=0),
            "logit_std": float(logits.std(dim=(-1, -2)).mean())}


def _no_training(out: dict, kv_bytes) -> dict:
    nan = float("nan")
    out.update({"eval_loss": nan, "trivial_loss": nan, "persistence_loss": nan, "scratch_loss": nan,
                "scratch_state_bytes": nan, "posthoc_loss": np.full((len(POSTHOC_MAPS), len(POSTHOC_R)), nan),
                "kv_bytes": np.asarray(kv_bytes, dtype=np.float64)})
    return out


def _encoder_cell(params, rng) -> dict:
    """MiniLM's heads (:class:`kernapprox.real.RealHeads`): 8 (layer, head) pairs and a window drawn per seed."""
    from kernapprox import real
    from kernapprox.distributions import make_distribution

    context = params["context"]
    q, k, _ = make_distribution("real").sample(context, heads=HEADS, rng=rng, dtype=torch.float64)
    out = _window_heads(q, k, real.HEAD_DIM ** -0.5, [n for n in LENGTHS if n <= context])
    per_token = 2 * real.NUM_LAYERS * real.NUM_HEADS * real.HEAD_DIM * 4
    return _no_training(out, [per_token * n if n <= context else np.nan for n in LENGTHS])


def _pretrained_cell(params, rng) -> dict:
    from kernapprox import lm
    from kernapprox.surgery import attention as sa
    from kernapprox.surgery import stack_for

    model, tokenizer = _smollm2()
    context = params["context"]
    windows = lm.text_windows(tokenizer, 32, context, split="evaluation").input_ids
    seed = params["train_seed"]
    if seed >= 16:
        raise ValueError(f"train_seed must be < 16 for {PRETRAINED} (two of 32 disjoint windows each), got {seed}")
    ids = windows[2 * seed:2 * seed + 2]
    picks = sorted(rng.choice(lm.NUM_LAYERS * lm.NUM_HEADS, size=HEADS, replace=False).tolist())
    stack = stack_for(model)
    sa.enable(model)
    qs, ks, scale = [], [], None
    with torch.no_grad():
        for layer in sorted({p // lm.NUM_HEADS for p in picks}):
            call = sa.capture(stack.attention_module(layer), lambda: model(input_ids=ids, use_cache=False))
            heads = [p % lm.NUM_HEADS for p in picks if p // lm.NUM_HEADS == layer]
            qs.append(call.query[:, heads].double())
            ks.append(call.key[:, heads].double())
            scale = float(call.scaling)
    q, k = torch.cat(qs, 1), torch.cat(ks, 1)
    lengths = [n for n in LENGTHS if n <= context]
    out = _window_heads(q, k, scale, lengths)
    per_token = 2 * lm.NUM_LAYERS * lm.NUM_KV_HEADS * lm.HEAD_DIM * 4
    return _no_training(out, [per_token * n if n <= context else np.nan for n in LENGTHS])


@torch.no_grad()
def _loss(model, task: NextStep, batch) -> float:
    return float(task.score(model(batch.inputs), batch).mean())


def run_cell(params, rng, device):
    source, context = params["source"], params["context"]
    if _unavailable(source) is not None:
        return not_applicable()
    if source == PRETRAINED:
        return _pretrained_cell(params, rng)
    if source == ENCODER:
        return _encoder_cell(params, rng)
    model_cfg, task, train_cfg = _configs(params, AttentionSpec())
    trained = load_or_train(model_cfg, task, train_cfg)
    model = trained.model
    count = min(EVAL_WINDOWS, int(task.data.values.shape[0] * task.eval_fraction) // (context + 1))
    batch = task.eval_windows(count)
    heads = attention_heads(model, batch.inputs)
    layers, w, h, _, d = heads["q"].shape
    scale = float(heads["scale"][0])
    if not torch.allclose(heads["scale"], heads["scale"][0]):
        raise ValueError("the layers' kernel scales differ; the spectra assume one")
    q = heads["q"].double().permute(1, 0, 2, 3, 4).reshape(w, layers * h, context, d)
    k = heads["k"].double().permute(1, 0, 2, 3, 4).reshape(w, layers * h, context, d)
    out = _window_heads(q, k, scale, [n for n in LENGTHS if n <= context])
    out["eval_loss"] = _loss(model, task, batch)
    base = {name: float(v.mean()) for name, v in task.baseline_losses(batch).items()}
    out["trivial_loss"] = min(base.values())
    out["persistence_loss"] = base.get("previous", float("nan"))
    calibration = task.sample(rng, 8).inputs
    posthoc = np.full((len(POSTHOC_MAPS), len(POSTHOC_R)), np.nan)
    for i, name in enumerate(POSTHOC_MAPS):
        for j, r in enumerate(POSTHOC_R):
            swapped = substitute(model, {layer: AttentionSpec(name, num_features=r) for layer in range(layers)},
                                 rng=rng, calibration=calibration)
            posthoc[i, j] = _loss(swapped, task, batch)
    out["posthoc_loss"] = posthoc
    scratch_cfg, _, _ = _configs(params, AttentionSpec(SCRATCH_MAP))
    scratch = load_or_train(scratch_cfg, task, train_cfg).model
    out["scratch_loss"] = _loss(scratch, task, batch)
    per_head = memory.probe_state_bytes(SCRATCH_MAP, None, d=d, d_v=d, seq_len=context)
    out["scratch_state_bytes"] = float(per_head * layers * h)
    out["kv_bytes"] = np.array([2.0 * n * d * 4 * layers * h if n <= context else np.nan for n in LENGTHS])
    return out


# ----------------------------------------------------------------------------------------------- summaries
def _gain_lost(loss: xr.DataArray, ds: xr.Dataset, what: str) -> xr.DataArray:
    lost = (loss - ds["eval_loss"]) / (ds["trivial_loss"] - ds["eval_loss"])
    return lost.assign_attrs(long_name=f"share of the model's gain over the trivial predictor lost, {what}", units="1",
                             description="(L_approx − L_softmax) / (L_trivial − L_softmax) per model: 0 = nothing "
                                         "lost, 1 = no better than the best trivial predictor")


def summarise(ds: xr.Dataset) -> xr.Dataset:
    for name in ("rank_attention", "rank_kernel"):
        growth = per_draw_slope(ds[name], "seq_len")
        ds[f"{name}_growth"] = growth.assign_attrs(
            long_name=f"growth exponent of the {name.split('_')[1]}-matrix rank in n", units="1",
            description="per model, least-squares slope of log(rank) against log(n) over the lengths ≤ context "
                        "(1: rank proportional to n)")
    ds["rank_state_fraction"] = (ds["rank_attention"] / ds["seq_len"]).assign_attrs(
        long_name="rank for the target as a fraction of n", units="1",
        description="rank_attention / n: the state (r features) the optimal approximation needs, relative to the "
                    "n keys of the KV cache (a rank-r state holds r(d_v + 1) numbers per head against n(d_k + d_v))")
    ds["gain"] = ((ds["trivial_loss"] - ds["eval_loss"]) / ds["trivial_loss"]).assign_attrs(
        long_name="relative gain of the softmax model over the trivial predictor", units="1",
        description="(L_trivial − L_softmax) / L_trivial per model")
    ds["posthoc_gain_lost"] = _gain_lost(ds["posthoc_loss"], ds, "post-hoc substitution")
    ds["scratch_gain_lost"] = _gain_lost(ds["scratch_loss"], ds, "fixed state trained from scratch")
    names = ["rank_attention", "rank_kernel", "rank_attention_growth", "rank_kernel_growth", "rank_state_fraction",
             "attention_sv", "logit_std", "eval_loss", "trivial_loss", "gain", "posthoc_gain_lost",
             "scratch_gain_lost", "scratch_loss", "persistence_loss"]
    ds = add_summaries(ds, names, "train_seed", tail_threshold=None)
    _add_text_ratios(ds)
    return ds


def _add_text_ratios(ds: xr.Dataset) -> None:
    """``rank_vs_text``: per seed index, the 1 % attention rank of each source at the largest n over text's, with
    its summary, Wilcoxon p-value over models and Holm-adjusted p-values across sources."""
    sources = [str(s) for s in ds.source.values]
    if "text" not in sources:
        return
    rank = ds["rank_attention"].sel(target=TARGETS[0])
    n_max = _largest_n(rank)
    if n_max is None:
        return
    rank = rank.sel(seq_len=n_max)
    ratio = stats.paired(rank, "source", "text", op="ratio")
    ds["rank_vs_text"] = ratio.assign_attrs(long_name=f"1 % attention rank at n = {n_max}, ratio to text (bytes)",
                                            units="1")
    summary = stats.paired_summary(ratio, "train_seed")
    summary.attrs["description"] = "summary of rank_vs_text over train_seed: " + summary.attrs["interval"]
    ds["rank_vs_text_summary"] = summary
    p = stats.paired_test(ratio, "train_seed")
    ds["rank_vs_text_p"] = p
    ds["rank_vs_text_p_holm"] = stats.holm(p).assign_attrs(
        long_name="Holm-adjusted p-value across sources", units="1",
        description="Holm (1979) over the sources compared with text (family: this table)")


def _largest_n(rank: xr.DataArray):
    ok = [int(n) for n in rank.seq_len.values if bool(np.isfinite(rank.sel(seq_len=n)).any())]
    return max(ok) if ok else None


# ------------------------------------------------------------------------------------------------- figure
def plot(ds, path):
    sources = [str(s) for s in ds.source.values]
    fig, axes = plotting.new_figure(2, 3, width=15, height=8.2, squeeze=False)
    context = int(ds.context.values.max())
    ctx = {"context": context, "train_steps": int(ds.train_steps.values.max())}
    sel = {k: v for k, v in ctx.items() if k in ds.dims}

    ax = axes[0, 0]
    for s in sources:
        summ = ds["attention_sv_summary"].sel(source=s, **sel)
        if not np.isfinite(summ.sel(stat="estimate")).any():
            continue
        plotting.plot_summary(ax, summ, xvalues=np.arange(1, summ.sizes["sv_index"] + 1), positive=True,
                              band_alpha=0.15, color=COLORS[s], label=LABELS[s])
    ax.set(xscale="log", yscale="log", ylim=(1e-8, 1.5), xlabel="index i", ylabel="σ_i / σ_1",
           title=f"attention-matrix spectrum, n = {context}")
    ax.legend(fontsize=6.5)

    ax = axes[0, 1]
    for s in sources:
        for t, style in zip(TARGETS, ("-", "--")):
            plotting.plot_summary(ax, ds["rank_attention_summary"].sel(source=s, target=t, **sel), "seq_len",
                                  color=COLORS[s], linestyle=style, marker="o",
                                  label=LABELS[s] if t == TARGETS[0] else None)
    ns = [n for n in LENGTHS if n <= context]
    ax.plot(ns, ns, color="0.5", linestyle=":", linewidth=1.0, label="rank = n (the KV cache's keys)")
    plotting.loglog_rank_axes(ax, xlabel="prefix length n", ylabel="rank r for the target")
    ax.set_title("optimal rank for 1 % (solid) / 10 % (dashed) error")
    ax.legend(fontsize=6)

    ax = axes[0, 2]
    x = np.arange(len(sources))
    for j, (name, off, hatch) in enumerate((("rank_attention_growth", -0.2, None), ("rank_kernel_growth", 0.2, "//"))):
        s = ds[f"{name}_summary"].sel(target=TARGETS[0], **sel)
        est = s.sel(stat="estimate").values
        ax.bar(x + off, est, 0.38, color=[COLORS[v] for v in sources], hatch=hatch, edgecolor="white",
               label="attention matrix" if j == 0 else "kernel matrix")
        plotting.errorbar_summary(ax, s, x + off, fmt="none", ecolor="0.2", elinewidth=0.8, capsize=2)
    ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1.0)
    ax.set_xticks(x, [TICKS[v] for v in sources], fontsize=6.5)
    ax.set(ylabel="exponent of n", title=f"growth of the 1 % rank in n ({ns[0]}–{ns[-1]})")
    ax.legend(fontsize=6.5)

    ax = axes[1, 0]
    trained = [s for s in sources if s not in (PRETRAINED, ENCODER)]
    for s in trained:
        for name, style in zip(POSTHOC_MAPS, ("-", "--")):
            plotting.plot_summary(ax, ds["posthoc_gain_lost_summary"].sel(source=s, posthoc_map=name, **sel),
                                  "posthoc_r", color=COLORS[s], linestyle=style, marker="o",
                                  label=LABELS[s] if name == POSTHOC_MAPS[0] else None)
    ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1.0)
    ax.axhline(0.0, color="0.5", linewidth=0.6)
    plotting.log_axis(ax, "x", label="features r")
    ax.set(ylabel="share of the gain over the trivial predictor lost",
           title="post hoc, every layer: FAVOR+ (solid), Nyström (dashed)")
    ax.legend(fontsize=6.5)

    ax = axes[1, 1]
    x = np.arange(len(trained))
    for j, (name, label) in enumerate((("eval_loss", "softmax (KV cache)"), ("scratch_loss", "elu+1 fixed state, "
                                                                                           "from scratch"),
                                       ("trivial_loss", "best trivial predictor"))):
        s = ds[f"{name}_summary"].sel(source=trained, **sel)
        ref = ds["trivial_loss_summary"].sel(source=trained, stat="estimate", **sel).values
        est = s.sel(stat="estimate").values / ref
        ax.bar(x + (j - 1) * 0.27, est, 0.26, color=["#333333", "#de8f05", "#bbbbbb"][j], label=label)
        lo, hi = s.sel(stat="lo").values / ref, s.sel(stat="hi").values / ref
        ax.errorbar(x + (j - 1) * 0.27, est, yerr=[est - lo, hi - est], fmt="none", ecolor="0.2", capsize=2)
    ax.set_xticks(x, [TICKS[v] for v in trained], fontsize=6.5)
    ax.set(ylabel="held-out loss / trivial predictor's", title="trained from scratch at a fixed state")
    ax.legend(fontsize=6.5)

    ax = axes[1, 2]
    for s in sources:
        plotting.plot_summary(ax, ds["rank_state_fraction_summary"].sel(source=s, target=TARGETS[0], **sel),
                              "seq_len", color=COLORS[s], marker="o", label=LABELS[s])
    ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1.0, label="r = n (no smaller than the KV cache)")
    plotting.log_axis(ax, "x", label="prefix length n")
    ax.set(yscale="log", ylabel="rank for 1 % / n", title="optimal state relative to the KV cache's keys")
    ax.legend(fontsize=6, loc="lower left")
    fig.suptitle("The state-size spectrum by modality: models trained on text, music, video and a smooth reference")
    n_models = ds.sizes["train_seed"]
    caption = (
        f"One small causal Transformer per source and seed ({n_models} seeds; 2 layers × 4 heads, width 64, "
        f"{ctx['train_steps']} steps on windows of {context}); SmolLM2-135M and all-MiniLM-L6-v2 heads (8 drawn per "
        "seed) as the pretrained text references. Top left: singular values of the attention matrix softmax(s QKᵀ) "
        "of the evaluation windows (median over heads and windows per model; median and 95 % band over models). "
        "Top centre: smallest rank whose truncated SVD reaches 1 % (solid) / 10 % (dashed) relative Frobenius "
        "error, against the prefix length n; an upper bound on what the causal pairs need. Top right: per-model "
        "log–log slope of that rank in n. Bottom left: share of the softmax model's gain over the best trivial "
        "predictor (unigram; mean or previous frame) lost when every layer's attention is replaced post hoc. "
        "Bottom centre: held-out loss of the softmax model, of the same architecture trained from scratch with "
        "elu+1 linear attention (a fixed state), and of the trivial predictor, each over the trivial predictor's. "
        "Bottom right: the 1 % rank as a fraction of n. Intervals: 95 % bootstrap over trained models.")
    plotting.save_figure(fig, path, caption)


# ------------------------------------------------------------------------------------------------ findings
def findings(ds: xr.Dataset) -> list[str]:
    sources = [str(s) for s in ds.source.values]
    sel = {k: int(ds[k].values.max()) for k in ("context", "train_steps") if k in ds.dims}
    rank = ds["rank_attention_summary"].sel(target=TARGETS[0], **sel)
    growth = ds["rank_attention_growth_summary"].sel(target=TARGETS[0], **sel)
    lines = []
    head = []
    n_top = _largest_n(ds["rank_attention"])
    for s in sources:
        ns = finite_values(rank.sel(source=s), "seq_len")
        if ns:
            value = fmt(float(rank.sel(source=s, seq_len=ns[-1], stat="estimate")), 3)
            head.append(f"{SHORT[s]} {value}"
                        + ("" if ns[-1] == n_top else f" (n = {ns[-1]})"))
    if head:
        lines.append(f"Optimal rank for {TARGETS[0]:.0%} attention-matrix error at n = {n_top} (median "
                     "over models): " + ", ".join(head) + ".")
    parts = []
    for s in sources:
        ns = finite_values(rank.sel(source=s), "seq_len")
        if not ns:
            continue
        parts.append(f"{LABELS[s]} {fmt_ci(rank.sel(source=s, seq_len=ns[-1]), 3)} at n = {ns[-1]} (growth "
                     f"exponent {fmt_ci(growth.sel(source=s), 2)} over n = {ns[0]}–{ns[-1]})")
    lines.append(f"Rank a truncated SVD needs for {TARGETS[0]:.0%} relative Frobenius error of the attention matrix "
                 "(mean over the heads and evaluation windows of a model; median over models, 95 % interval): "
                 + "; ".join(parts) + ". An exponent of 1 means a rank proportional to n.")
    if "rank_vs_text_summary" in ds:
        ratio = ds["rank_vs_text_summary"].sel(**sel)
        p = ds["rank_vs_text_p_holm"].sel(**sel)
        units = int(ds["rank_vs_text_p"].attrs.get("num_units", 0))
        parts = []
        for s in sources:
            if s == "text" or not np.isfinite(float(ratio.sel(source=s, stat="estimate"))):
                continue
            v = stats.verdict(float(ratio.sel(source=s, stat="estimate")), float(p.sel(source=s)), units,
                              neutral=1.0)
            said = v if v == "not resolved" else f"{v} than text"
            parts.append(f"{LABELS[s]} {fmt_ci(ratio.sel(source=s), 2)} (Holm-adjusted Wilcoxon p = "
                         f"{fmt(float(p.sel(source=s)), 2)}: {said})")
        lines.append("The same rank over text's (bytes), as a ratio of independently trained models matched only by "
                     "seed index (not paired inputs): " + "; ".join(parts)
                     + f". {units} models per source; a verdict needs ≥ {stats.MIN_UNITS} and an adjusted p < 0.05.")
    trained = [s for s in sources if s not in (PRETRAINED, ENCODER)]
    parts, weak = [], []
    for s in trained:
        e, t = ds["eval_loss_summary"].sel(source=s, **sel), ds["trivial_loss_summary"].sel(source=s, **sel)
        g = ds["gain_summary"].sel(source=s, **sel)
        if np.isfinite(float(e.sel(stat="estimate"))):
            parts.append(f"{LABELS[s]} {fmt_ci(e, 3)} against {fmt_ci(t, 3)} (relative gain {fmt_ci(g, 2)})")
            if float(g.sel(stat="estimate")) < WEAK_GAIN:
                weak.append(LABELS[s])
    if parts:
        lines.append("Held-out loss of the softmax models against the best trivial predictor (unigram bytes, nats; "
                     "mean or previous frame, squared error per dimension): " + "; ".join(parts) + ".")
    if weak:
        lines.append(f"The models of {', '.join(weak)} gain less than {WEAK_GAIN:.0%} over the trivial predictor: "
                     "their attention has learned little of the context, so their ranks describe these models, not "
                     "the modality.")
    frac = ds["rank_state_fraction_summary"].sel(target=TARGETS[0], **sel)
    parts = []
    for s in sources:
        ns = finite_values(frac.sel(source=s), "seq_len")
        if ns:
            parts.append(f"{LABELS[s]} {fmt_ci(frac.sel(source=s, seq_len=ns[-1]), 2)} at n = {ns[-1]}")
    lines.append("The 1 % rank as a fraction of n (the optimal state's features against the KV cache's keys): "
                 + "; ".join(parts) + ".")
    lost = ds["posthoc_gain_lost_summary"].sel(**sel)
    parts = []
    for s in trained:
        cells = [f"{'FAVOR+' if m == 'positive_orthogonal' else 'Nyström'} r = {r}: "
                 f"{fmt_ci(lost.sel(source=s, posthoc_map=m, posthoc_r=r), 2)}"
                 for m in POSTHOC_MAPS for r in (POSTHOC_R[0], POSTHOC_R[-1])]
        parts.append(f"{LABELS[s]}: " + ", ".join(cells))
    lines.append("Share of the model's gain over the trivial predictor lost when every layer is replaced post hoc "
                 "(0 = none, 1 = all): " + "; ".join(parts) + ".")
    scratch = ds["scratch_gain_lost_summary"].sel(**sel)
    bytes_ = float(ds["scratch_state_bytes"].sel(**sel).max())
    kv = ds["kv_bytes"].sel(**sel).isel(train_seed=0).sel(source=trained[0]) if trained else None
    if trained and kv is not None:
        n_ctx = _largest_n(kv)
        lines.append(f"Trained from scratch with elu+1 linear attention (a state of {plotting.fmt_bytes(bytes_)} for "
                     f"every source, against a KV cache of {plotting.fmt_bytes(float(kv.sel(seq_len=n_ctx)))} at "
                     f"n = {n_ctx}), the share of the softmax model's gain lost: "
                     + "; ".join(f"{LABELS[s]} {fmt_ci(scratch.sel(source=s), 2)}" for s in trained) + ".")
    return lines


EXPERIMENT = Experiment.from_module(
    __name__, title="The state-size spectrum by modality: text, music, video and a smooth reference",
    description=" ".join(__doc__.split("\n\n")[0].split()), replicates="the trained models (train_seed)")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
