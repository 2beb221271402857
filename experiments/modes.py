"""What the two modes cost: Transformer mode (exact attention, KV cache) against RNN mode (a fixed linear state).

For sequence lengths ``n`` from 1k upwards, with 8 heads, ``d = d_v = 64`` and ``r = 256`` positive random
features, causal throughout, one cell times one *computation* at one ``n`` (the axis is not called ``method``, which
``Dataset.sel`` would take as its own keyword):

=================  ====================================================================================
``exact_full``     exact softmax attention over the whole sequence: ``torch`` SDPA, ``is_causal=True``
``exact_decode``   one generated token with a KV cache: SDPA of one query over ``n + 1`` cached keys
``linear_parallel``  linear attention, parallel mode (materialises ``n × n``; small ``n`` only)
``linear_chunked``   linear attention, chunked mode (features included)
``linear_recurrent`` linear attention, recurrent mode (a token-by-token scan over the whole sequence)
``linear_decode``  one generated token in RNN mode: ``RecurrentState.step`` on a state that absorbed ``n``
=================  ====================================================================================

Metrics: median wall time of one call (warm-up first), time per token, the memory carried from token to token
(KV cache ``2·n·H·d`` numbers against the state ``H·r·(d_v+1)``), the peak extra memory of the call —
*measured* with ``torch.cuda.max_memory_allocated`` on CUDA, an *analytic* count of the largest live
intermediates on the CPU (the CPU allocator is not instrumented; see :func:`analytic_peak_bytes`) — and the
agreement of each linear mode with the chunked mode (max absolute difference of the outputs), of the decode
steps with the full-sequence computation.

The claim it tests: a decode step costs O(1) in the RNN mode and O(n) with a KV cache; full-sequence exact
attention costs O(n²), chunked linear attention O(n); the crossover ``n`` where linear beats exact is read
off the data. Timings are only as good as the machine's load: the dataset's ``cpu_utilisation`` says how much
of the requested CPU the process got.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

import kernapprox as ka
from kernapprox import stats
from kernapprox.attention import chunked_block_length  # the chunked mode's token block, for the memory count
from kernapprox.plotting import bullets, fmt, fmt_ci
from kernapprox.sweep import Experiment, Metric, Parameter, not_applicable, run_cli
from kernapprox.timing import measure, synchronize

HEADS, HEAD_DIM, NUM_FEATURES, CHUNK_SIZE = 8, 64, 256, 64
INPUT_STD = 0.5
METHODS = ["exact_full", "exact_decode", "linear_parallel", "linear_chunked", "linear_recurrent", "linear_decode"]
FULL_SEQUENCE = ["exact_full", "linear_parallel", "linear_chunked", "linear_recurrent"]
DECODE = ["exact_decode", "linear_decode"]
# the longest n a computation runs at, by device: the parallel mode materialises H·n² numbers; the recurrent mode
# is a Python loop over tokens (slow everywhere)
MAX_N = {"linear_parallel": {"cpu": 2048, "cuda": 16384}, "linear_recurrent": {"cpu": 65536, "cuda": 65536}}

PARAMETERS = {
    "heads": Parameter(HEADS, long_name="attention heads", units="1"),
    "head_dim": Parameter(HEAD_DIM, long_name="head dimension d = d_v", units="1"),
    "num_features": Parameter(NUM_FEATURES, long_name="positive random features r of the linear state", units="1"),
    "chunk_size": Parameter(CHUNK_SIZE, long_name="chunk length of the chunked and decode modes", units="token"),
    "min_reps": Parameter(5, long_name="timed calls per cell at least", units="1",
                          description="the replicates of a timing study: intervals are over these repeated calls"),
}
AXIS_ATTRS = {"computation": {"long_name": "what is timed (exact/linear, full sequence or one decode step)",
                              "units": "1"},
              "budget_s": {"long_name": "timing budget per cell (repeats stop after it, past min_reps)", "units": "s"}}
GRIDS = {
    "smoke": {"computation": METHODS, "seq_len": [32, 64], "budget_s": [0.0]},
    # default: the parallel mode's two lengths (MAX_N), then a factor 4 (slopes and crossover); full: every doubling
    "default": {"computation": METHODS, "seq_len": [1024, 2048, 4096, 16384], "budget_s": [0.2]},
    "full": {"computation": METHODS, "seq_len": [1024, 2048, 4096, 8192, 16384], "budget_s": [0.2]},
    "gpu": {"computation": METHODS, "seq_len": [1024 * 2**i for i in range(10)], "budget_s": [1.0]},      # to 512k
}

METRICS = {
    "time_s": Metric(long_name="wall time of one call", units="s",
                     description="median over repeats after one warm-up call; full sequence or one decode step"),
    "time_min_s": Metric(long_name="fastest call", units="s",
                         description="minimum over the timed repeats: less sensitive than the median to a busy "
                                     "machine (decode steps of ~0.2 ms are)"),
    "time_per_token_s": Metric(long_name="wall time per token", units="s",
                               description="time_s / n for full-sequence methods, time_s for a decode step"),
    "carried_bytes": Metric(long_name="memory carried to the next token", units="B",
                            description="KV cache 2·n·H·d·4 (exact) or H · estimator.state_bytes(d_v, float32, "
                                        "seq_len=n) (linear: the state r·(d_v+1) per head), float32"),
    "peak_extra_bytes": Metric(long_name="peak extra memory of the call", units="B",
                               description="CUDA: torch.cuda.max_memory_allocated minus memory before the call "
                                           "(measured); CPU: analytic count of the largest live intermediates "
                                           "(analytic_peak_bytes)"),
    "peak_measured": Metric(long_name="peak memory measured", units="1",
                            description="1 if peak_extra_bytes was measured (CUDA), 0 if analytic (CPU)"),
    "max_abs_deviation": Metric(long_name="agreement with the chunked or full computation", units="1",
                                description="max |y − y_ref|: linear modes vs the chunked mode (chunked vs the "
                                            "parallel mode where it runs), decode steps vs the full-sequence "
                                            "output at that position"),
    "reps": Metric(long_name="timed repeats", units="1", description="calls behind the median"),
    "cpu_utilisation": Metric(long_name="CPU utilisation", units="1",
                              description="process CPU time / (wall time · threads); < 1 means a loaded machine"),
    "repeat_times": Metric(long_name="wall time of each timed call", units="s",
                           description="every timed call after the warm-up, in order (NaN-padded)",
                           dims=("repeat",)),
}


# -------------------------------------------------------------------------------------------------- pieces
def analytic_peak_bytes(method: str, n: int, *, heads: int = HEADS, d: int = HEAD_DIM, r: int = NUM_FEATURES,
                        chunk_size: int = CHUNK_SIZE, itemsize: int = 4) -> float:
    """Extra float32 memory live at the peak of one call, beyond its inputs (the CPU has no allocator counter).

    - ``exact_full``: output and log-sum-exp, ``H·n·(d_v+1)`` (flash-style SDPA never holds ``n × n``);
    - ``exact_decode``: one row of logits and the output, ``H·(n + d_v)``;
    - ``linear_parallel``: ``A = Φ_Q Φ_Kᵀ`` and its masked copy, ``2·H·n²``, plus both feature matrices;
    - ``linear_chunked``: numerator/normaliser and output ``H·n·(2 d_v + 1)``, and per token block of ``L`` tokens
      (``kernapprox.attention`` sizes it) both features ``2·H·L·r``, the intra-chunk weights ``H·L·C`` and the
      chunk summaries and states ``2·H·(L/C)·r·(d_v+1)`` — the whole-sequence features are never held;
    - ``linear_recurrent``: both feature matrices, the per-token outputs ``H·n·(d_v+1)``, the state;
    - ``linear_decode``: the new state ``H·r·(d_v+1)`` and the token's features.
    """
    state = heads * r * (d + 1)
    features = 2 * heads * n * r
    block = chunked_block_length(heads, r, chunk_size, n, torch.device("cpu"))
    out = heads * n * (d + 1)
    counts = {
        "exact_full": out,
        "exact_decode": heads * (n + d),
        "linear_parallel": 2 * heads * n * n + features + out,
        "linear_chunked": heads * n * (2 * d + 1) + 2 * heads * block * r + heads * block * chunk_size
                          + 2 * heads * (block // chunk_size) * r * (d + 1),
        "linear_recurrent": features + out + state,
        "linear_decode": state + 2 * heads * r,
    }
    return float(counts[method] * itemsize)


def carried_bytes(method: str, n: int, *, heads: int = HEADS, d: int = HEAD_DIM, r: int = NUM_FEATURES,
                  itemsize: int = 4, estimator=None) -> float:
    """What generation must keep from token to token: the KV cache, or the recurrent state (a fitted
    ``estimator``'s own ``state_bytes`` per head when given, else ``r·(d_v+1)`` numbers per head)."""
    if method.startswith("exact"):
        return float(2 * n * heads * d * itemsize)
    if estimator is not None:
        return float(heads * estimator.state_bytes(d, torch.float32, seq_len=n))
    return float(heads * r * (d + 1) * itemsize)


def _inputs(rng: np.random.Generator, n: int, device: torch.device, heads: int = HEADS, d: int = HEAD_DIM):
    gen = torch.Generator(device="cpu").manual_seed(int(rng.integers(2**63 - 1)))
    q, k, v = (torch.randn(1, heads, n, d, generator=gen) for _ in range(3))
    return (q * INPUT_STD).to(device), (k * INPUT_STD).to(device), v.to(device)


def _applicable(method: str, n: int, device: torch.device) -> bool:
    return n <= MAX_N.get(method, {}).get(device.type, n)


def _filled_state(est, k, v, n):
    state = ka.RecurrentState(est, check_finite=False)              # no per-token NaN scan (a GPU sync)
    for t in range(n):
        state.update(k[..., t, :], v[..., t, :])
    return state


def _decode_linear(state, snapshot, q_t, k_t, v_t):
    state.state = snapshot                                            # every call is the step at position n
    return state.step(q_t, k_t, v_t)


def _decode_exact(cache_k, cache_v, n, q_t, k_t, v_t):
    cache_k[..., n, :] = k_t                                          # append in place to a preallocated cache
    cache_v[..., n, :] = v_t
    return F.scaled_dot_product_attention(q_t[..., None, :], cache_k[..., :n + 1, :], cache_v[..., :n + 1, :])


def _call(method, n, q, k, v, est, chunk_size=CHUNK_SIZE):
    """``(timed callable, output check)``: the check returns the max deviation from the reference."""
    if method == "exact_full":
        return functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True), None
    if method == "exact_decode":
        cache_k, cache_v = torch.zeros_like(k), torch.zeros_like(v)
        cache_k[..., :n, :], cache_v[..., :n, :] = k[..., :n, :], v[..., :n, :]
        fn = functools.partial(_decode_exact, cache_k, cache_v, n, q[..., n, :], k[..., n, :], v[..., n, :])

        def check(y):
            ref = ka.softmax_attention(q[..., n:n + 1, :], k, v)      # the last row of causal attention
            return (y - ref).abs().amax()
        return fn, check
    if method == "linear_decode":
        state = _filled_state(est, k, v, n)
        snapshot = state.state
        fn = functools.partial(_decode_linear, state, snapshot, q[..., n, :], k[..., n, :], v[..., n, :])

        def check(y):
            ref = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=chunk_size)[..., n, :]
            return (y - ref).abs().amax()
        return fn, check
    mode = method.removeprefix("linear_")
    fn = functools.partial(ka.linear_attention, q, k, v, est, causal=True, mode=mode, chunk_size=chunk_size)

    def check(y):
        if mode == "chunked":
            if not _applicable("linear_parallel", n, q.device):
                return torch.tensor(float("nan"))
            ref = ka.linear_attention(q, k, v, est, causal=True, mode="parallel")
        else:
            ref = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=chunk_size)
        return (y - ref).abs().amax()
    return fn, check


def run_cell(params: dict, rng: np.random.Generator, device) -> dict:
    method, n, budget = params["computation"], params["seq_len"], params["budget_s"]
    if not _applicable(method, n, device):
        return not_applicable()
    decode = method in DECODE
    shape = {"heads": params["heads"], "d": params["head_dim"], "r": params["num_features"]}
    q, k, v = _inputs(rng, n + 1 if decode else n, device, shape["heads"], shape["d"])
    est = ka.make_estimator("positive", num_features=shape["r"], rng=rng).fit(q)
    fn, check = _call(method, n, q, k, v, est, params["chunk_size"])
    with torch.no_grad():
        y = fn()                                                      # warm-up, and the output to check
        deviation = float(check(y)) if check is not None else np.nan
        del y
        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            fn()
            synchronize(device)
            peak = float(torch.cuda.max_memory_allocated(device) - before)
        else:
            peak = analytic_peak_bytes(method, n, chunk_size=params["chunk_size"], **shape)
        t = measure(fn, device, warmup=50 if decode else 0, min_reps=params["min_reps"],
                    max_reps=1000 if decode else 20, budget_s=budget)
    per_token = t.median_s if decode else t.median_s / n
    return {"time_s": t.median_s, "time_min_s": t.min_s, "time_per_token_s": per_token,
            "carried_bytes": carried_bytes(method, n, estimator=est, **shape), "repeat_times": np.asarray(t.times),
            "peak_extra_bytes": peak, "peak_measured": float(device.type == "cuda"),
            "max_abs_deviation": deviation, "reps": t.reps, "cpu_utilisation": t.cpu_utilisation}


# ------------------------------------------------------------------------------------------------ summary
def fitted_slope(n: np.ndarray, t: np.ndarray, points: int = 4) -> float:
    """Slope of ``log t`` against ``log n`` over the ``points`` largest finite ``n`` (the asymptotic regime)."""
    ok = np.isfinite(t) & (t > 0)
    n, t = np.asarray(n, float)[ok], np.asarray(t, float)[ok]
    if len(n) < 2:
        return float("nan")
    n, t = n[-points:], t[-points:]
    return float(np.polyfit(np.log(n), np.log(t), 1)[0])


def crossover(n: np.ndarray, t_exact: np.ndarray, t_linear: np.ndarray) -> float:
    """Smallest ``n`` where linear is faster, log-interpolated between grid points (NaN if it never is; the
    first ``n`` if it always is)."""
    n = np.asarray(n, float)
    ratio = np.log(np.asarray(t_linear, float) / np.asarray(t_exact, float))   # < 0: linear faster
    ok = np.isfinite(ratio)
    n, ratio = n[ok], ratio[ok]
    if len(n) == 0 or not (ratio < 0).any():
        return float("nan")
    i = int(np.argmax(ratio < 0))
    if i == 0:
        return float(n[0])
    x0, x1, y0, y1 = math.log(n[i - 1]), math.log(n[i]), ratio[i - 1], ratio[i]
    return float(math.exp(x0 + (x1 - x0) * y0 / (y0 - y1)))


def scaling(ds) -> dict:
    """Slopes of time against n, the exact/chunked crossover and the decode growth, from the dataset only."""
    n = ds["seq_len"].values
    t = {m: ds["time_s"].sel(computation=m).squeeze(drop=True).values for m in METHODS}
    out = {f"slope_{m}": fitted_slope(n, t[m]) for m in METHODS}
    out["crossover_n"] = crossover(n, t["exact_full"], t["linear_chunked"])
    out["decode_crossover_n"] = crossover(n, t["exact_decode"], t["linear_decode"])
    fastest = {m: ds["time_min_s"].sel(computation=m).squeeze(drop=True).values for m in DECODE}
    for m in DECODE:
        for key, times in ((f"growth_{m}", t[m]), (f"growth_min_{m}", fastest[m])):
            finite = np.isfinite(times)
            out[key] = float(times[finite][-1] / times[finite][0]) if finite.sum() >= 2 else float("nan")
    out["n_min"], out["n_max"] = int(n.min()), int(n.max())
    return out


def summarise(ds):
    """``time_s_summary``: the median of the repeated calls of each cell with its 95 % bootstrap interval over
    the repeats (the replicates of a timing study)."""
    summary = stats.bootstrap_interval(ds["repeat_times"], "repeat", "median")
    summary.attrs.update({"long_name": "wall time of one call", "units": "s",
                          "description": "median over the timed calls of a cell: " + summary.attrs["interval"]})
    ds["time_s_summary"] = summary
    return ds


def findings(ds) -> str:
    s = scaling(ds)
    t = ds["time_s_summary"].squeeze("budget_s", drop=True) if "budget_s" in ds.dims else ds["time_s_summary"]
    n_max, n_min = s["n_max"], s["n_min"]
    lines = [
        f"Whole causal sequence, log–log slope of time against n over the largest lengths: exact SDPA "
        f"{fmt(s['slope_exact_full'], 2)}, chunked linear attention {fmt(s['slope_linear_chunked'], 2)}, parallel "
        f"{fmt(s['slope_linear_parallel'], 2)}, recurrent {fmt(s['slope_linear_recurrent'], 2)}; chunked against "
        f"exact: {_crossover_text(s)}. At n = {n_max}: exact {fmt_ci(t.sel(computation='exact_full', seq_len=n_max))} "
        f"s, chunked {fmt_ci(t.sel(computation='linear_chunked', seq_len=n_max))} s (median of the timed calls, 95 % "
        "interval over them).",
        f"One generated token: with a KV cache the step grows {fmt(s['growth_exact_decode'], 3)}× from n = {n_min} to "
        f"{n_max} ({fmt_ci(1e6 * t.sel(computation='exact_decode', seq_len=n_min))} µs → "
        f"{fmt_ci(1e6 * t.sel(computation='exact_decode', seq_len=n_max))} µs); the RNN-mode step grows "
        f"{fmt(s['growth_linear_decode'], 3)}× (fastest calls {fmt(s['growth_min_linear_decode'], 3)}×).",
    ]
    carried = ds["carried_bytes"].squeeze(drop=True)
    lines.append(f"Memory carried between tokens at n = {n_max}: KV cache "
                 f"{fmt(float(carried.sel(computation='exact_decode', seq_len=n_max)) / 2**20, 3)} MiB, linear state "
                 f"{fmt(float(carried.sel(computation='linear_decode', seq_len=n_max)) / 2**20, 3)} MiB (float32).")
    dev = ds["max_abs_deviation"]
    lines.append(f"Every mode agrees with the chunked computation (decode steps with the full sequence) to "
                 f"{fmt(float(dev.max()), 2)} (max absolute difference, float32).")
    util = ds["cpu_utilisation"]
    lines.append(f"Timings are only as good as the machine's load: the CPU utilisation of the cells ranged "
                 f"{fmt(float(util.min()), 2)}–{fmt(float(util.max()), 2)} (1 = the process had its cores) on "
                 f"{ds.attrs.get('device', 'an unrecorded device')}; a rerun measures new times.")
    return bullets(lines)


def _crossover_text(s: dict) -> str:
    if not math.isfinite(s["crossover_n"]):
        return f"exact is faster at every n up to {s['n_max']}"
    if s["crossover_n"] == s["n_min"]:
        return f"linear is faster at every n from {s['n_min']}"
    return f"crossover n ≈ {s['crossover_n']:.0f}"


def plot(ds, path) -> None:
    import matplotlib.pyplot as plt

    from kernapprox import plotting

    plotting.house_style()
    s = scaling(ds)
    n = ds["seq_len"].values
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"exact_full": ("C3", "o", "-"), "linear_parallel": ("C1", "s", ":"), "linear_chunked": ("C0", "D", "-"),
              "linear_recurrent": ("C2", "^", "--"), "exact_decode": ("C3", "o", "--"),
              "linear_decode": ("C0", "D", "--")}

    def series(ax, metric, methods, scale=1.0):
        for m in methods:
            c, mk, ls = styles[m]
            if metric == "time_s" and "time_s_summary" in ds:
                slope = s.get(f"slope_{m}", float("nan"))
                label = m + (f" (slope {slope:.2f})" if math.isfinite(slope) else "")
                summ = ds["time_s_summary"].sel(computation=m).squeeze(drop=True) * scale
                plotting.errorbar_summary(ax, summ, "seq_len", color=c, marker=mk, linestyle=ls, label=label)
                continue
            y = ds[metric].sel(computation=m).squeeze(drop=True).values * scale
            ok = np.isfinite(y)
            if ok.any():
                ax.plot(n[ok], y[ok], color=c, marker=mk, ls=ls, label=m)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length n (tokens)")

    ax = axes[0]
    series(ax, "time_s", FULL_SEQUENCE)
    if math.isfinite(s["crossover_n"]):
        ax.axvline(s["crossover_n"], color="0.5", lw=0.8, ls=":")
        ax.annotate(_crossover_text(s), (s["crossover_n"], ax.get_ylim()[1]),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="0.3")
    ax.set(ylabel="time of the whole causal sequence (s)", title="full sequence (Transformer mode vs linear modes)")
    ax.legend(fontsize=7)

    ax = axes[1]
    series(ax, "time_s", DECODE, scale=1e6)
    for m in DECODE:
        g = s[f"growth_{m}"]
        if math.isfinite(g):
            ax.plot([], [], " ", label=f"{m}: t(n_max)/t(n_min) = {g:.2f} (fastest calls: "
                                       f"{s[f'growth_min_{m}']:.2f})")
    if math.isfinite(s["decode_crossover_n"]) and s["decode_crossover_n"] > s["n_min"]:
        ax.axvline(s["decode_crossover_n"], color="0.5", lw=0.8, ls=":")
    ax.set(ylabel="time of one decode step (µs)", title="one generated token: KV cache vs RNN state")
    ax.legend(fontsize=7)

    ax = axes[2]
    for m, lab in (("exact_decode", "KV cache (exact)"), ("linear_decode", "RNN state (linear)")):
        y = ds["carried_bytes"].sel(computation=m).squeeze(drop=True).values / 2**20
        ok = np.isfinite(y)
        ax.plot(n[ok], y[ok], color=styles[m][0], marker=styles[m][1], label=f"carried: {lab}")
    for m in ("exact_full", "linear_chunked"):
        y = ds["peak_extra_bytes"].sel(computation=m).squeeze(drop=True).values / 2**20
        ok = np.isfinite(y)
        ax.plot(n[ok], y[ok], color=styles[m][0], marker=styles[m][1], ls=":", label=f"peak extra: {m}")
    ax.set_xscale("log", base=2)
    measured = bool((ds["peak_measured"] > 0).any())                  # NaN (not run) compares False
    ax.set(yscale="log", xlabel="sequence length n (tokens)", ylabel="MiB (float32)",
           title="memory " + ("(peak measured on CUDA)" if measured else "(peak: analytic count, CPU)"))
    ax.legend(fontsize=7)

    device = ds.attrs.get("device", "?")
    caption = (f"Cost of the two modes, causal, H={int(ds['heads'])}, d={int(ds['head_dim'])}, "
               f"r={int(ds['num_features'])} positive features, device {device}. Times: median of the timed calls, "
               "bars: 95 % bootstrap interval over them. Left: whole-sequence time, log-log slopes fitted on the "
               "largest n; chunked linear "
               f"attention vs exact SDPA: {_crossover_text(s)}. Middle: one decode step grows "
               f"{s['growth_exact_decode']:.1f}x with a KV cache and {s['growth_linear_decode']:.2f}x in RNN mode "
               f"from n={s['n_min']} to {s['n_max']}. Right: memory carried between tokens and peak extra memory.")
    fig.tight_layout()
    plotting.save_figure(fig, path, caption, title="The cost of the two modes: time and memory against sequence length")


EXPERIMENT = Experiment.from_module(
    __name__, title="Transformer mode vs RNN mode: time and memory against sequence length",
    description="Times exact attention (SDPA, full sequence and KV-cache decode) and linear attention (parallel, "
                "chunked, recurrent modes and the RecurrentState decode step) against n, with the memory "
                "carried between tokens and the peak memory of each call. Grid: computation x seq_len (x the timing "
                "budget per cell); the replicates are the timed calls of each cell (at least min_reps). Answers: "
                "where does linear attention overtake exact attention, and is a decode step O(1) in RNN mode and "
                "O(n) with a KV cache?", replicates="the timed calls")

if __name__ == "__main__":
    run_cli(EXPERIMENT)
