"""The benchmark cases: kernapprox measured side by side with its peers in one run.

Each case returns :class:`Row` records; :mod:`benchmarks.run` turns them into the table, the targets and the
dataset. Shapes follow a small language-model head: batch 1, ``heads`` heads, ``d = d_v = 64``, ``r = 256``
positive (FAVOR+) features. Inputs are Gaussian with standard deviation ``INPUT_STD`` (logits ``s qᵀk`` of
standard deviation ``INPUT_STD²`` at ``s = d^{-1/2}``), drawn from a seeded CPU generator and moved to the device.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import kernapprox as ka
from kernapprox import backends, lm_eval
from kernapprox.attention import native
from kernapprox.estimators import fused
from kernapprox.metrics import relative_rms_error
from kernapprox.timing import (
    exp_rate,
    feature_map_flops,
    gemm_rate,
    linear_attention_flops,
    measure,
    memory_bandwidth,
    sdpa_flops,
    synchronize,
)

INPUT_STD = 0.5
HEAD_DIM = 64
NUM_FEATURES = 256
NONCAUSAL_L = native.NONCAUSAL_BLOCK      # tokens per block of the compiled non-causal kernel


@dataclass
class Config:
    """What one benchmark run measures. ``quick`` shrinks every size for the smoke test."""

    device: torch.device
    quick: bool = False
    heads: int = 8
    chunk_size: int = 64
    seed: int = 0
    budget_s: float = 1.0
    gemm_flops_per_s: float = float("nan")

    def time(self, fn, **options):
        """:func:`~kernapprox.timing.measure` with this run's device, repeat floor and budget."""
        return measure(fn, self.device, **{"min_reps": self.min_reps, "budget_s": self.budget_s, **options})

    @property
    def min_reps(self):
        return 1 if self.quick else 3

    @property
    def decode_reps(self):
        return 3 if self.quick else 20

    @property
    def sdpa_sizes(self):
        return (256, 512) if self.quick else (4096, 16384, 65536)

    @property
    def scaling_sizes(self):
        return (128, 256, 512) if self.quick else tuple(1024 * 2**i for i in range(7))   # 1k .. 64k

    @property
    def peer_sizes(self):
        return (128,) if self.quick else (4096, 16384)

    @property
    def decode_sizes(self):
        return (64, 256) if self.quick else (1024, 4096, 16384, 65536)

    @property
    def flop_sizes(self):
        return (512,) if self.quick else (16384, 65536)

    @property
    def rule_sizes(self):
        return (128, 256, 512) if self.quick else tuple(1024 * 2**i for i in range(6))      # 1k .. 32k

    @property
    def chunk_sizes(self):
        return (32, 64) if self.quick else (16, 32, 64, 128, 256)

    @property
    def lm_contexts(self):
        """Contexts at which ``lm_decode`` times the decode step (tokens the state and the KV cache hold)."""
        return (128, 512) if self.quick else (1024, 4096, 32768)

    @property
    def lm_prefill_lengths(self):
        """Lengths at which ``lm_decode`` times the exact model's prefill (one call, SDPA) beside the converted one."""
        return (128, 256) if self.quick else (1024, 4096)

    @property
    def lm_chunk(self):
        """Most tokens per prefill call of the converted model (memory stays bounded over 32k tokens)."""
        return 128 if self.quick else 4096

    @property
    def lm_steps(self):
        """Timed decode steps per context (after one untimed warm-up step)."""
        return 2 if self.quick else 7


@dataclass
class Row:
    """One line of the table. Times in seconds (median); errors are relative RMS errors against exact attention
    on the same inputs; ``flops`` is the counted matrix-product work of ``ours``."""

    case: str
    label: str
    n: int
    causal: bool = False
    time_ours_s: float = float("nan")
    time_peer_s: float = float("nan")
    error_ours: float = float("nan")
    error_peer: float = float("nan")
    flops: float = float("nan")
    reps: int = 0
    cpu_utilisation: float = float("nan")
    status: str = "ok"
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """Peer time over our time (> 1: ours is faster)."""
        return self.time_peer_s / self.time_ours_s


def qkv(cfg: Config, n: int, *, n_q: int | None = None):
    """Seeded Gaussian ``(1, heads, n, d)`` queries/keys/values on the device (``n_q`` queries if given)."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + n)
    shape = (1, cfg.heads, n, HEAD_DIM)
    q = torch.randn((1, cfg.heads, n_q or n, HEAD_DIM), generator=gen) * INPUT_STD
    k = torch.randn(shape, generator=gen) * INPUT_STD
    v = torch.randn(shape, generator=gen)
    return q.to(cfg.device), k.to(cfg.device), v.to(cfg.device)


def favor_estimator(cfg: Config, q: torch.Tensor):
    return ka.make_estimator("positive_orthogonal", num_features=NUM_FEATURES, rng=cfg.seed).fit(q)


def _chunked(q, k, v, est, causal, chunk_size):
    """A no-argument call of chunked linear attention (features included), for :func:`measure`."""
    return functools.partial(ka.linear_attention, q, k, v, est, causal=causal, mode="chunked", chunk_size=chunk_size)


def _error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(relative_rms_error(approx, exact).mean())


def _long_call_kwargs(cfg: Config, flops: float) -> dict:
    """Calls expected to run for seconds are timed once, without a warm-up (smaller sizes warmed the code)."""
    if flops > 2e11 and not cfg.quick:
        return {"warmup": 0, "min_reps": 1, "max_reps": 1}
    return {"min_reps": cfg.min_reps, "budget_s": cfg.budget_s}


# ------------------------------------------------------------------------------------------------- cases
def chunked_vs_sdpa(cfg: Config) -> list[Row]:
    """Chunked linear attention (features included) against ``torch.nn.functional.scaled_dot_product_attention``."""
    rows = []
    for n in cfg.sdpa_sizes:
        q, k, v = qkv(cfg, n)
        est = favor_estimator(cfg, q)
        for causal in (False, True):
            ours = measure(_chunked(q, k, v, est, causal, cfg.chunk_size), cfg.device, min_reps=cfg.min_reps,
                           budget_s=cfg.budget_s)
            fl = sdpa_flops(n, n, HEAD_DIM, HEAD_DIM, cfg.heads, causal=causal)
            peer = measure(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal), cfg.device,
                           **_long_call_kwargs(cfg, fl))
            rows.append(Row("chunked_vs_sdpa", f"n={n} {'causal' if causal else 'non-causal'}", n, causal,
                            ours.median_s, peer.median_s, reps=ours.reps, cpu_utilisation=ours.cpu_utilisation,
                            extra={"peer_flops_per_s": fl / peer.median_s}))
        del q, k, v
    return rows


def chunked_scaling(cfg: Config) -> list[Row]:
    """Chunked linear attention time against n (for the fitted cost exponent)."""
    rows = []
    for causal in (False, True):
        for n in cfg.scaling_sizes:
            q, k, v = qkv(cfg, n)
            est = favor_estimator(cfg, q)
            t = cfg.time(_chunked(q, k, v, est, causal, cfg.chunk_size))
            rows.append(Row("chunked_scaling", f"n={n} {'causal' if causal else 'non-causal'}", n, causal,
                            t.median_s, reps=t.reps, cpu_utilisation=t.cpu_utilisation))
    return rows


def chunk_size_sweep(cfg: Config) -> list[Row]:
    """Causal chunked time against the chunk length at one n (the chunk-size choice)."""
    n = 512 if cfg.quick else 16384
    q, k, v = qkv(cfg, n)
    est = favor_estimator(cfg, q)
    rows = []
    for c in cfg.chunk_sizes:
        t = cfg.time(_chunked(q, k, v, est, True, c))
        rows.append(Row("chunk_size", f"n={n} causal C={c}", n, True, t.median_s, reps=t.reps,
                        cpu_utilisation=t.cpu_utilisation, extra={"chunk_size": c}))
    return rows


def _recurrent_step(state, snapshot, q_t, k_t, v_t):
    state.state = snapshot                                            # every call is the step at position n
    return state.step(q_t, k_t, v_t)


def _kv_cache_step(cache_k, cache_v, n, q_t, k_t, v_t):
    cache_k[..., n, :] = k_t                                          # append to the preallocated cache
    cache_v[..., n, :] = v_t
    return F.scaled_dot_product_attention(q_t[..., None, :], cache_k[..., :n + 1, :], cache_v[..., :n + 1, :])


def decode_step(cfg: Config) -> list[Row]:
    """One generated token: ``RecurrentState.step`` on a state that has absorbed ``n`` tokens (ours) against
    SDPA of one query over a KV cache of ``n`` tokens, appended in place (peer)."""
    sizes = cfg.decode_sizes
    n_max = max(sizes)
    q, k, v = qkv(cfg, n_max + 1)
    est = favor_estimator(cfg, q)
    state = ka.RecurrentState(est, check_finite=False)              # no per-token NaN scan (a GPU sync)
    cache_k = torch.zeros_like(k)
    cache_v = torch.zeros_like(v)
    rows, filled = [], 0
    for n in sizes:
        for t in range(filled, n):                                   # the state absorbs tokens 0..n-1
            state.update(k[..., t, :], v[..., t, :])
        filled = n
        cache_k[..., :n, :] = k[..., :n, :]
        cache_v[..., :n, :] = v[..., :n, :]
        q_t, k_t, v_t = q[..., n, :], k[..., n, :], v[..., n, :]
        snapshot = state.state
        budget = min(cfg.budget_s, 0.5)
        t_ours = measure(functools.partial(_recurrent_step, state, snapshot, q_t, k_t, v_t), cfg.device,
                         min_reps=cfg.decode_reps, max_reps=2000, budget_s=budget)
        t_peer = measure(functools.partial(_kv_cache_step, cache_k, cache_v, n, q_t, k_t, v_t), cfg.device,
                         min_reps=cfg.decode_reps, max_reps=2000, budget_s=budget)
        state.state = snapshot
        rows.append(Row("decode_step", f"cache n={n}", n, True, t_ours.median_s, t_peer.median_s,
                        reps=t_ours.reps, cpu_utilisation=t_ours.cpu_utilisation,
                        extra={"state_bytes": state.state_bytes(),
                               "kv_cache_bytes": 2 * (n + 1) * cfg.heads * HEAD_DIM * k.element_size()}))
    return rows


def _gemm_now(cfg: Config) -> float:
    """The GEMM rate measured right now, kept as the run's best: the roofline of the rows next to it (a rate
    measured once, at another moment of a shared machine's load, would make their fractions meaningless)."""
    rate = gemm_rate(cfg.device, size=512 if cfg.quick else 2048, budget_s=min(cfg.budget_s, 0.3))
    cfg.gemm_flops_per_s = max(rate, cfg.gemm_flops_per_s) if math.isfinite(cfg.gemm_flops_per_s) else rate
    return rate


def flop_rate(cfg: Config) -> list[Row]:
    """Achieved FLOP/s of features + linear attention (counted matrix products, see :mod:`kernapprox.timing`), as
    a fraction of the float32 GEMM rate measured just before and after each row (the larger of the two)."""
    rows = []
    for n in cfg.flop_sizes:
        q, k, v = qkv(cfg, n)
        est = favor_estimator(cfg, q)
        calls = {"non-causal": (_chunked(q, k, v, est, False, cfg.chunk_size),
                                2 * feature_map_flops(n, HEAD_DIM, est.num_frequencies, cfg.heads)
                                + linear_attention_flops(n, est.num_features, HEAD_DIM, cfg.heads, causal=False)),
                 "causal": (_chunked(q, k, v, est, True, cfg.chunk_size),
                            2 * feature_map_flops(n, HEAD_DIM, est.num_frequencies, cfg.heads)
                            + linear_attention_flops(n, est.num_features, HEAD_DIM, cfg.heads, causal=True,
                                                     chunk_size=cfg.chunk_size)),
                 "features only": (functools.partial(est.features, q, "query", log_scale=True),
                                   feature_map_flops(n, HEAD_DIM, est.num_frequencies, cfg.heads))}
        for label, (fn, fl) in calls.items():
            before = _gemm_now(cfg)
            t = cfg.time(fn)
            gemm = max(before, _gemm_now(cfg))
            rows.append(Row("flop_rate", f"n={n} {label}", n, label == "causal", t.median_s, flops=fl, reps=t.reps,
                            cpu_utilisation=t.cpu_utilisation,
                            extra={"fraction_of_gemm": fl / t.median_s / gemm, "gemm_flops_per_s": gemm}))
    return rows


def _performer_module(cfg: Config, est):
    """performer-pytorch's ``FastAttention`` with our projection copied into its buffer (same features)."""
    import io

    from performer_pytorch import FastAttention

    modules = {}
    for causal in (False, True):
        with contextlib.redirect_stdout(io.StringIO()):               # it prints which causal kernel it uses
            m = FastAttention(dim_heads=HEAD_DIM, nb_features=NUM_FEATURES, causal=causal)
        with torch.no_grad():
            m.projection_matrix.copy_(torch.as_tensor(est.projection_, dtype=torch.float32))
        modules[causal] = m.to(cfg.device).eval()
    return modules


@contextlib.contextmanager
def _performer_eps(eps: float):
    """performer-pytorch's feature function with another ``eps`` (its ``FastAttention`` does not expose it)."""
    import performer_pytorch.performer_pytorch as pp

    original = pp.softmax_kernel
    pp.softmax_kernel = functools.partial(original, eps=eps)
    try:
        yield
    finally:
        pp.softmax_kernel = original


def favor_vs_performer(cfg: Config) -> list[Row]:
    """Our FAVOR+ (``positive_orthogonal``, chunked mode) against performer-pytorch's ``FastAttention`` with the
    identical projection matrix and feature count; errors of both against exact attention on the same inputs.

    performer-pytorch adds ``eps = 1e-4`` to every stabilised feature (ours: 0). Because its key features are
    shifted by one maximum per head, that constant is not small against most of them: it blends the output
    towards uniform attention, which lowers the error when the exact attention is nearly uniform (as here) and
    raises it when attention is peaked. So each comparison runs twice: the peer as shipped (``eps=1e-4``) and
    with ``eps=0`` (exactly our estimator; the errors must then agree). Without its CUDA extension performer-pytorch
    runs causal attention as a prefix sum over per-token outer products."""
    try:
        with warnings.catch_warnings():                               # it imports distutils' LooseVersion
            warnings.simplefilter("ignore", DeprecationWarning)
            import performer_pytorch  # noqa: F401
    except Exception as exc:  # an import error or a version clash: the peer is missing, not the benchmark
        return [Row("favor_vs_performer", "performer-pytorch", 0, status=f"skipped: {type(exc).__name__}: {exc}")]
    rows = []
    for n in cfg.peer_sizes:
        q, k, v = qkv(cfg, n)
        est = favor_estimator(cfg, q)
        modules = _performer_module(cfg, est)
        for causal in (False, True):
            with torch.no_grad():
                exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                y_ours = ka.linear_attention(q, k, v, est, causal=causal, mode="chunked", chunk_size=cfg.chunk_size)
                t_ours = cfg.time(_chunked(q, k, v, est, causal, cfg.chunk_size))
                for eps in (1e-4, 0.0):
                    with _performer_eps(eps):
                        y_peer = modules[causal](q, k, v)
                        t_peer = cfg.time(functools.partial(modules[causal], q, k, v))
                    rows.append(Row("favor_vs_performer",
                                    f"n={n} {'causal' if causal else 'non-causal'} eps={eps:g}", n, causal,
                                    t_ours.median_s, t_peer.median_s, _error(y_ours, exact), _error(y_peer, exact),
                                    reps=t_ours.reps, cpu_utilisation=t_ours.cpu_utilisation,
                                    extra={"peer_eps": eps}))
    return rows


# Input scales and landmark counts of ``nystrom_vs_sklearn`` (n = 16k; the last row of the case is n = 20k, m = 512).
NYSTROM_STDS = (0.15, 1.0)
NYSTROM_LANDMARKS = (256, 512, 1024)


def numpy_blas() -> dict:
    """numpy's BLAS as threadpoolctl reports it (``threadpool_info()``): the library, its kernel (OpenBLAS's
    ``architecture``, e.g. SkylakeX or Haswell; MKL and others have none) and its thread count."""
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    mine = [i for i in blas if "numpy" in str(i.get("filepath", ""))] or blas
    if not mine:
        return {"internal_api": "none"}
    info = mine[0]
    return {"internal_api": info.get("internal_api"), "architecture": info.get("architecture", info.get("corename")),
            "num_threads": info.get("num_threads"), "version": info.get("version")}


def interleaved(fns: dict, rounds: int, per_round: int) -> dict:
    """Median wall time of each callable of ``fns``, measured in ``rounds`` rounds that alternate between them (the
    order reversed every other round): in each round each callable runs once untimed (the other's thread pools
    spinning down, caches refilled) and then ``per_round`` times timed. On a shared machine the load then weighs on
    every callable alike; the ratio of the medians is the measurement."""
    names = list(fns)
    times = {k: [] for k in names}
    for i in range(rounds):
        for k in (names if i % 2 == 0 else names[::-1]):
            fns[k]()
            for _ in range(per_round):
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def nystrom_vs_sklearn(cfg: Config) -> list[Row]:
    """Our Nyström features of the softmax kernel on the library's default path (``nystrom_uniform``, every switch
    at its default: precision ``"auto"``, fused mode ``"auto"``) against scikit-learn's ``Nystroem``, at input
    standard deviations :data:`NYSTROM_STDS` and ``m`` in :data:`NYSTROM_LANDMARKS` (n = 16k), and at n = 20k,
    m = 512. ``extra`` records the computation :meth:`~kernapprox.estimators.nystrom.NystromFeatures._plan` chose
    (float32 direct, float32 centred, or float64), the whitening's amplification, the relative difference of our
    features to the float64 ones, and numpy's BLAS kernel (threadpoolctl).

    scikit-learn has no exp-dot-product kernel (a callable kernel is evaluated pair by pair), so the peer uses
    the identity ``exp(s xᵀy) = e^{s‖x‖²/2} e^{s‖y‖²/2} exp(−(s/2)‖x−y‖²)``: ``Nystroem(kernel="rbf",
    gamma=s/2)`` on the same number of uniformly drawn landmarks, its features multiplied by ``e^{s‖x‖²/2}``
    (which is exactly the Nyström map of the softmax kernel with those landmarks). Timed: fit plus the features
    of all ``n`` points, one head, float32 for both, the two measured in alternation (:func:`interleaved`: 5
    rounds of 2 timed calls each) in one process with numpy on its own BLAS kernel (``python -m benchmarks.run``
    unsets ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE``). Error: relative Frobenius error of ``ΦΦᵀ`` against the
    exact kernel on the first 2048 points, ours fitted on the peer's landmarks (``component_indices_``) so that
    the two differ only by their arithmetic.

    Where the time went (n = 16k, m = 256, 2 threads): at input std 0.15 the landmarks lie close together, the
    whitening ``G(Z, Z)^{+1/2}`` amplifies float32 rounding ~200× and the default precision computed in float64:
    the ``n × m × m`` product, the logits and the ``exp`` in float64 took 2–3× their float32 time. At std 1 (float32
    already) the eager code made five passes over the ``n × m`` logits besides the two products (subtract ``h``,
    the maximum, subtract it, ``exp``, scale by ``e^ℓ``) and two more in the exact-scale check (``abs``, maximum),
    each allocating a fresh matrix. Now the small-norm case runs in float32 in the centred form
    ``1ᵀG^{+1/2} + expm1(t) G^{+1/2}`` whose rounding is relative to ``expm1(t)`` (about 0.08 there), and the
    eager path works in place. What remains is the ``n × m × m`` product, as in ``Nystroem``: on the 2-core AMD EPYC
    machine torch's sgemm (MKL) of ``16384 × 256 × 256`` took 30 ms against 23 ms for numpy's (OpenBLAS, SkylakeX
    kernel), one thread each, measured alternately; at m = 256 that product is most of both calls, so the ratio
    there stays near 1 on one thread.
    """
    if "nystrom_uniform" not in ka.available_estimators():
        return [Row("nystrom_vs_sklearn", "nystrom_uniform", 0, status="skipped: nystrom_uniform not registered")]
    from sklearn.kernel_approximation import Nystroem

    blas = numpy_blas()
    shapes = ([(1024, m, std) for std in NYSTROM_STDS for m in (64, 128)] if cfg.quick else
              [(16384, m, std) for std in NYSTROM_STDS for m in NYSTROM_LANDMARKS]
              + [(20000, 512, std) for std in NYSTROM_STDS])
    s = 1.0 / math.sqrt(HEAD_DIM)
    rows = []
    for n, m, std in shapes:
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        x = torch.randn(n, HEAD_DIM, generator=gen) * std
        x_np = x.numpy()
        x_dev = x.to(cfg.device)

        def ours(m=m, x_dev=x_dev):
            est = ka.make_estimator("nystrom_uniform", num_features=m, rng=cfg.seed).fit(x_dev)
            return est.features(x_dev, "key")

        def peer(m=m, x_np=x_np):
            ny = Nystroem(kernel="rbf", gamma=s / 2, n_components=m, random_state=cfg.seed).fit(x_np)
            return ny.transform(x_np) * np.exp(0.5 * s * np.einsum("ij,ij->i", x_np, x_np))[:, None]

        def ours_synced(ours=ours):
            out = ours()
            synchronize(cfg.device)
            return out

        with fused.mode("auto"):                                  # the library's default, whatever the run's switch
            c0 = time.process_time()
            t0 = time.perf_counter()
            med = interleaved({"ours": ours_synced, "peer": peer}, rounds=1 if cfg.quick else 5,
                              per_round=1 if cfg.quick else 2)
            cpu = (time.process_time() - c0) / ((time.perf_counter() - t0) * torch.get_num_threads())
            phi_ours_all = ours()
        sub = min(n, 2048)
        exact = ka.kernel_matrix(x[:sub].double(), x[:sub].double())
        phi_ours = phi_ours_all[:sub].double().cpu()
        ny = Nystroem(kernel="rbf", gamma=s / 2, n_components=m, random_state=cfg.seed).fit(x_np)
        phi_peer = torch.as_tensor(ny.transform(x_np[:sub]) * np.exp(
            0.5 * s * np.einsum("ij,ij->i", x_np[:sub], x_np[:sub]))[:, None], dtype=torch.float64)
        # the errors on the peer's landmarks (our map fitted on exactly those m points): equal errors up to the
        # arithmetic, whatever landmarks a random draw gives (at std 1 the error depends much on the draw)
        same = ka.make_estimator("nystrom_uniform", num_features=m, rng=cfg.seed).fit(x_dev[ny.component_indices_])
        with fused.mode("auto"):
            phi_same = same.features(x_dev[:sub], "key").double().cpu()
        err = [float(ka.metrics.relative_frobenius_error(p @ p.T, exact)) for p in (phi_same, phi_peer)]
        est = ka.make_estimator("nystrom_uniform", num_features=m, rng=cfg.seed).fit(x_dev)
        phi_64 = ka.make_estimator("nystrom_uniform", num_features=m, rng=cfg.seed,
                                   precision="float64").fit(x_dev).features(x_dev[:sub], "key").double().cpu()
        rows.append(Row("nystrom_vs_sklearn", f"n={n} m={m} std={std:g}", n, False, med["ours"], med["peer"],
                        err[0], err[1], reps=(1 if cfg.quick else 10), cpu_utilisation=cpu,
                        extra={"std": std, "m": m, "plan": est._plan(x_dev.dtype),
                               "feature_dtype": str(est.feature_dtype(x_dev.dtype)).removeprefix("torch."),
                               "amplification": est.amplification(),
                               "features_vs_float64": float((phi_ours - phi_64).norm() / phi_64.norm()),
                               "peer_blas": f"{blas.get('internal_api')} {blas.get('architecture')} "
                                            f"{blas.get('num_threads')} threads"}))
        print(f"    n={n} m={m} std={std:g}: ours {med['ours']:.4g} s, Nystroem {med['peer']:.4g} s "
              f"({med['peer'] / med['ours']:.2f}x, {rows[-1].extra['plan']})", flush=True)
    return rows


# The state rules timed by ``rule_scaling``; least squares keeps an r × r matrix and costs O(C r²) per chunk, so it
# runs at ``LEAST_SQUARES_FEATURES`` features (the others at ``NUM_FEATURES``).
RULES = {"sum": "sum", "decay": ka.rules.Decay(0.99), "delta": ka.rules.Delta(0.5),
         "least_squares": ka.rules.LeastSquares(1.0)}
LEAST_SQUARES_FEATURES = 64


def rule_scaling(cfg: Config) -> list[Row]:
    """Causal chunked linear attention time against n under each state rule (features included): the cost
    exponent of the chunked delta rule (WY/UT form) and of the others, 1k .. 32k tokens."""
    rows = []
    for name, rule in RULES.items():
        r = LEAST_SQUARES_FEATURES if name == "least_squares" else NUM_FEATURES
        for n in cfg.rule_sizes:
            q, k, v = qkv(cfg, n)
            est = ka.make_estimator("positive_orthogonal", num_features=r, rng=cfg.seed).fit(q)
            call = functools.partial(ka.linear_attention, q, k, v, est, causal=True, mode="chunked",
                                     chunk_size=cfg.chunk_size, rule=rule)
            t = cfg.time(call)
            rows.append(Row("rule_scaling", f"{name} n={n}", n, True, t.median_s, reps=t.reps,
                            cpu_utilisation=t.cpu_utilisation, extra={"rule": name, "num_features": r}))
    return rows


def exact_vs_sdpa(cfg: Config) -> list[Row]:
    """``ka.softmax_attention`` (exact attention, validation and the overflow check included) against a bare
    ``F.scaled_dot_product_attention`` call on the same inputs: n = 4096, 2 heads, d = 64 (the reported case),
    causal and not, measured alternately in one run so that the machine's load affects both alike. The ratio is
    what matters (target: ours ≤ 1.2 × SDPA); ``error_ours`` is the largest absolute difference to SDPA."""
    rows = []
    n = 512 if cfg.quick else 4096
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    q, k, v = (torch.randn(1, 2, n, HEAD_DIM, generator=gen).to(cfg.device) for _ in range(3))
    for causal in (True, False):
        ours_fn = functools.partial(ka.softmax_attention, q, k, v, causal)
        peer_fn = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
        ours_t, peer_t = [], []
        for _ in range(1 if cfg.quick else 5):                 # alternate: ours, peer, ours, peer, ...
            ours_t.append(cfg.time(ours_fn))
            peer_t.append(cfg.time(peer_fn))
        ours_s = float(np.median([t.median_s for t in ours_t]))
        peer_s = float(np.median([t.median_s for t in peer_t]))
        diff = float((ours_fn() - peer_fn()).abs().max())
        rows.append(Row("exact_vs_sdpa", f"n={n} {'causal' if causal else 'non-causal'}", n, causal, ours_s,
                        peer_s, error_ours=diff, error_peer=0.0, reps=sum(t.reps for t in ours_t),
                        cpu_utilisation=float(np.median([t.cpu_utilisation for t in ours_t])),
                        extra={"time_ratio": ours_s / peer_s}))
    return rows


def precision_check(cfg: Config) -> list[Row]:
    """The cost of linear attention's precision check on ordinary inputs (FAVOR+, chunked, causal and not): the
    call as shipped against the same call with the check disabled (:func:`kernapprox.attention.logdomain.
    needs_recompute` patched to return False), alternately in one run. The check is one reduction over the
    ``(..., n)`` normalisers and log-scales and one host synchronisation; ``time_ratio`` is shipped / unchecked."""
    from kernapprox.attention import linear as linear_module

    rows = []
    n = 512 if cfg.quick else 4096
    q, k, v = qkv(cfg, n)
    est = favor_estimator(cfg, q)
    real = linear_module.logdomain.needs_recompute
    for causal in (True, False):
        fn = _chunked(q, k, v, est, causal, cfg.chunk_size)
        checked, unchecked = [], []
        for _ in range(1 if cfg.quick else 5):
            checked.append(cfg.time(fn))
            linear_module.logdomain.needs_recompute = lambda *args: False
            try:
                unchecked.append(cfg.time(fn))
            finally:
                linear_module.logdomain.needs_recompute = real
        ours_s = float(np.median([t.median_s for t in checked]))
        peer_s = float(np.median([t.median_s for t in unchecked]))
        rows.append(Row("precision_check", f"n={n} {'causal' if causal else 'non-causal'}", n, causal, ours_s,
                        peer_s, reps=sum(t.reps for t in checked),
                        cpu_utilisation=float(np.median([t.cpu_utilisation for t in checked])),
                        extra={"time_ratio": ours_s / peer_s}))
    return rows


# ---------------------------------------------------------------------------------------- the machine itself
def _shape_rate(cfg: Config, batch: int, m: int, k: int, n: int, transpose_a: bool = False) -> float:
    """FLOP/s of ``batch`` products ``(m × k) @ (k × n)`` (the left factor stored transposed if asked)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    a = torch.rand((batch, k, m) if transpose_a else (batch, m, k), generator=gen).to(cfg.device)
    b = torch.rand(batch, k, n, generator=gen).to(cfg.device)
    a = a.transpose(-1, -2) if transpose_a else a
    t = cfg.time(lambda: a @ b, budget_s=min(cfg.budget_s, 0.3))
    return 2.0 * batch * m * k * n / t.median_s


def _native_exp_rate(cfg: Config, entries: int = 1 << 19) -> float:
    """:func:`kernapprox.timing.exp_rate` (same block, arguments and output) for the compiled kernels' ``exp``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    src = -8 * torch.rand(entries, generator=gen)
    out = torch.empty_like(src)
    return entries / cfg.time(lambda: native.exp_nonpositive(src, out), budget_s=min(cfg.budget_s, 0.3)).median_s


def machine(cfg: Config) -> list[Row]:
    """The ceilings the other rows are judged against, measured in this run: the float32 GEMM rate (2048²), the
    memory bandwidth (``a = b + c`` on 256 MB arrays), the rate of ``exp`` on a cache-sized block, and the rates of
    the product shapes the chunked mode runs (per head and block: the projection ``(L × d)(d × r)``, the chunk
    summaries ``([V 1]ᵀ (C × 65))ᵀ Φ_K``, the state reads ``Φ_Q S``, the intra-chunk ``Φ_Q Φ_Kᵀ`` and ``A [V 1]``;
    the non-causal kernel's block summaries and reads over :data:`NONCAUSAL_L` tokens), and, where the compiled
    kernels load, the rate of their own ``exp``. ``extra.rate`` is the rate (FLOP/s, bytes/s or exp/s); these
    feed the roofline of the targets."""
    rows = []
    c, r, d, dv1 = cfg.chunk_size, NUM_FEATURES, HEAD_DIM, HEAD_DIM + 1
    batch = cfg.heads * 4                                             # a CPU block: 4 chunks of 8 heads
    small = 64 if cfg.quick else None
    measures = {
        "gemm 2048^2": ("flop/s", _gemm_now(cfg)),
        "memory bandwidth": ("byte/s", memory_bandwidth(cfg.device, megabytes=small or 256,
                                                        budget_s=min(cfg.budget_s, 0.5))),
        "exp (cache-sized block)": ("exp/s", exp_rate(cfg.device, budget_s=min(cfg.budget_s, 0.3))),
        "projection (L*8 x 64)(64 x 256)": ("flop/s", _shape_rate(cfg, 1, 8 * 4 * c, d, r)),
        "chunk summaries (65 x C)(C x 256)": ("flop/s", _shape_rate(cfg, batch, dv1, c, r, transpose_a=True)),
        "state reads (C x 256)(256 x 65)": ("flop/s", _shape_rate(cfg, batch, c, r, dv1)),
        "intra-chunk scores (C x 256)(256 x C)": ("flop/s", _shape_rate(cfg, batch, c, r, c)),
        "intra-chunk values (C x C)(C x 65)": ("flop/s", _shape_rate(cfg, batch, c, c, dv1)),
        "block summaries (65 x L)(L x 256)": ("flop/s", _shape_rate(cfg, cfg.heads, dv1, NONCAUSAL_L, r,
                                                                    transpose_a=True)),
        "block reads (L x 256)(256 x 65)": ("flop/s", _shape_rate(cfg, cfg.heads, NONCAUSAL_L, r, dv1)),
    }
    if cfg.device.type == "cpu" and backends.get_mode("native") != "off" and native.available():   # their exp
        measures["exp (compiled kernels)"] = ("exp/s", _native_exp_rate(cfg))
    for label, (unit, rate) in measures.items():
        rows.append(Row("machine", label, 0, time_ours_s=1.0 / rate, extra={"rate": rate, "unit": unit}))
    return rows


# ------------------------------------------------------------------------------------------------ fusion
FUSION_MAPS = {"exponential": "positive_orthogonal", "hyperbolic": "hyperbolic_orthogonal", "trigonometric": "trig",
               "nystrom": "nystrom_uniform"}

_COMPILE_PROBE = """
import json, sys, time, torch
import kernapprox as ka
from kernapprox.estimators import fused
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(8, 64, 64).to(sys.argv[3])
out = {}
with fused.mode("on"):
    for form, name in json.loads(sys.argv[2]).items():
        est = ka.make_estimator(name, num_features=256, rng=0).fit(x)
        t = time.perf_counter()
        est.features(x, "key", log_scale=True)
        if x.is_cuda:
            torch.cuda.synchronize()
        out[form] = time.perf_counter() - t
out["status"] = fused.status()
print(json.dumps(out))
"""


def _compile_time(form: str, name: str, cache_dir: str, device: torch.device) -> float:
    """First-call time of one fused kernel in a fresh process (dynamo and inductor's one-time start-up, tracing,
    code generation and the C++ build, the call, the first-call check), with ``cache_dir`` as inductor's on-disk
    cache; NaN (and a warning) if the probe fails."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "KERNAPPROX_FUSED": "on"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, str(torch.get_num_threads()),
                           json.dumps({form: name}), str(device)], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=os.getcwd())
    if proc.returncode != 0:
        warnings.warn(f"compilation probe of {form} failed: {proc.stderr.strip()[-300:]}", RuntimeWarning,
                      stacklevel=2)
        return float("nan")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kernel = "trigonometric" if form == "trigonometric" else "exponential"
    if out["status"][kernel]["state"] != "compiled":
        warnings.warn(f"the fused {kernel} kernel did not compile: {out['status'][kernel]['state']}", RuntimeWarning,
                      stacklevel=2)
        return float("nan")
    return float(out[form])


def fusion(cfg: Config) -> list[Row]:
    """Fused feature maps (:mod:`kernapprox.estimators.fused`) against the eager code: the time of one feature-map
    call (keys of 8 heads, ``r = 256``, float32) at several sizes, fused (ours) and eager (peer), and what the
    compilation costs: first-call times of each kernel in a fresh process with an empty inductor cache (cold) and
    again with the cache it left (warm). ``extra.break_even_calls`` = cold compilation / time saved per call;
    ``extra.break_even_entries`` the same in feature entries (what :data:`~kernapprox.estimators.fused.
    WARMUP_ENTRIES` is set from)."""
    if not fused.available(cfg.device)[0]:
        return [Row("fusion", "fused kernels", 0, status=f"skipped: {fused.available(cfg.device)[1]}")]
    cold, warm = {}, {}
    for form, name in FUSION_MAPS.items():
        if form not in ("exponential", "trigonometric"):         # hyperbolic and Nyström share the exponential kernel
            continue
        with tempfile.TemporaryDirectory(prefix="kernapprox-inductor-") as cache:   # each kernel from scratch
            cold[form] = _compile_time(form, name, cache, cfg.device)
            warm[form] = _compile_time(form, name, cache, cfg.device)
    rows = []
    lengths = (64, 512) if cfg.quick else (64, 256, 1024, 4096, 16384)
    for form, name in FUSION_MAPS.items():
        kernel = "trigonometric" if form == "trigonometric" else "exponential"
        for n in lengths:
            q, k, _ = qkv(cfg, n)
            est = ka.make_estimator(name, num_features=NUM_FEATURES, rng=cfg.seed).fit(q[..., :512, :], k[..., :512, :])
            call = functools.partial(est.features, k, "key", log_scale=True)
            with fused.mode("on"):
                t_fused = cfg.time(call)                    # the warm-up call compiles (if this process has not)
                status = fused.status()[kernel]["state"]
            with fused.mode("off"):
                t_eager = cfg.time(call)
            entries = cfg.heads * n * NUM_FEATURES
            saving = t_eager.median_s - t_fused.median_s
            compile_cold = cold.get(kernel, float("nan"))
            rows.append(Row("fusion", f"{form} n={n}", n, False, t_fused.median_s, t_eager.median_s, reps=t_fused.reps,
                            cpu_utilisation=t_fused.cpu_utilisation,
                            extra={"kernel": kernel, "entries": entries, "state": status,
                                   "compile_cold_s": compile_cold, "compile_warm_s": warm.get(kernel, float("nan")),
                                   "break_even_calls": compile_cold / saving if saving > 0 else float("inf"),
                                   "break_even_entries": compile_cold / saving * entries if saving > 0
                                   else float("inf")}))
    return rows


# ------------------------------------------------------------------------------------------- training step
TRAINING_HEADS = 4


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages that autograd keeps for the backward of ``fn()`` (the inputs excluded): the
    memory a training step holds between its forward and its backward."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _call_with_leaves(forward, inputs):
    return forward(*(t.detach().requires_grad_() for t in inputs))


def _train_step(forward, inputs):
    """One step: ``y = forward(*leaves)``, ``y.square().mean().backward()``; returns (forward s, backward s)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    t0 = time.perf_counter()
    y = forward(*leaves)
    t1 = time.perf_counter()
    y.square().mean().backward()
    return t1 - t0, time.perf_counter() - t1


def training_vs_sdpa(cfg: Config) -> list[Row]:
    """A training step (forward + backward of ``y.square().mean()``) of causal chunked linear attention through the
    public API (FAVOR+ ``positive_orthogonal`` fitted, features included, r = 256, 4 heads) against SDPA with
    ``is_causal=True``: ours as dispatched (``native-backward`` where eligible), and the eager autograd path
    (``KERNAPPROX_NATIVE=off``: what every gradient call ran before the compiled backward). Steps of the three are
    interleaved round by round (a shared machine's load hits them alike); medians of the rounds. Memory: the bytes
    autograd saves for the backward (:func:`_saved_bytes`)."""
    rows = []
    sizes = (256, 512) if cfg.quick else (4096, 16384)
    for n in sizes:
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + n)
        shape = (1, TRAINING_HEADS, n, HEAD_DIM)
        q, k = (torch.randn(shape, generator=gen) * INPUT_STD for _ in range(2))
        v = torch.randn(shape, generator=gen)
        est = favor_estimator(cfg, q)

        def ours(q, k, v, est=est):
            return ka.linear_attention(q, k, v, est, causal=True, chunk_size=cfg.chunk_size)

        def eager(q, k, v, ours=ours):
            with backends.mode("native", "off"):
                return ours(q, k, v)

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        variants = {"ours": ours, "eager": eager, "sdpa": sdpa}
        with backends.record() as calls:
            _train_step(ours, (q, k, v))                               # warm-up (and the backend it takes)
        backend = next((c.backend for c in calls if c.op == "linear_attention.gradient"), "none")
        _train_step(eager, (q, k, v))
        _train_step(sdpa, (q, k, v))
        times = {name: [] for name in variants}
        rounds = 1 if cfg.quick else max(cfg.min_reps, 5)
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name].append(_train_step(fn, (q, k, v)))
        med = {name: (float(np.median([f for f, _ in ts])), float(np.median([b for _, b in ts])),
                      float(np.median([f + b for f, b in ts]))) for name, ts in times.items()}
        saved = {name: _saved_bytes(functools.partial(_call_with_leaves, fn, (q, k, v)))
                 for name, fn in variants.items()}
        rows.append(Row("training_vs_sdpa", f"n={n} causal fwd+bwd", n, True, med["ours"][2], med["sdpa"][2],
                        reps=rounds, extra={"backend": backend, "heads": TRAINING_HEADS,
                                            **{f"{name}_{part}_s": med[name][i] for name in variants
                                               for i, part in enumerate(("forward", "backward", "total"))},
                                            **{f"{name}_saved_bytes": saved[name] for name in variants},
                                            "eager_speedup_vs_sdpa": med["sdpa"][2] / med["eager"][2]}))
        del q, k, v
    return rows


# ------------------------------------------------------------------------------------------- a real model
# The converted models of ``lm_decode``: FAVOR+ (``positive_orthogonal``, Choromanski et al. 2021) at r = 64 in
# every layer with float32 states, drawn once per layer (``share_heads=True``: causal_lm's label
# "positive_orthogonal_shared", whose every layer decodes all its key/value heads in one batch) and once per
# key/value head (``share_heads="group"``: causal_lm's "positive_orthogonal" at its hybrid_rank; each layer then
# steps one state per key/value head, three decoders a layer). The targets read the first, the table shows both.
LM_ESTIMATOR = "positive_orthogonal"
LM_NUM_FEATURES = 64
LM_CONVERSIONS = {"one draw per layer": True, "one draw per key/value head": "group"}
LM_TARGET_CONVERSION = "one draw per layer"


def _lm_stream(stream, tokens: int) -> tuple[torch.Tensor, int]:
    """``(1, tokens)`` int64 ids: ``stream`` from its start, repeated end to end when it is shorter (the number of
    passes over it is returned)."""
    stream = np.asarray(stream, dtype=np.int64)
    repeats = -(-tokens // len(stream))
    ids = np.tile(stream, repeats)[:tokens] if repeats > 1 else stream[:tokens]
    return torch.from_numpy(np.ascontiguousarray(ids))[None], repeats


def _timed(fn, device: torch.device) -> tuple[float, float]:
    """Wall and process CPU seconds of one call of ``fn`` (the device synchronised before and after)."""
    synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _interleaved_steps(runs: dict, ids: torch.Tensor, steps: int, device) -> dict:
    """Decode steps of several ``(model, cache, first)`` runs, interleaved round by round: in round ``i`` every run
    steps once, feeding the stream's token ``first + i`` (teacher forcing: a step's work does not depend on which
    token it reads), the order reversed every other round, so that a shared machine's load weighs on every run
    alike (their ratios are the measurement). Round 0 is untimed (warm-up), rounds 1..``steps`` are timed.
    Returns ``{run: (wall seconds of the timed steps, CPU utilisation = process CPU time / wall / threads)}``."""
    names = list(runs)
    walls = {k: [] for k in names}
    cpu = dict.fromkeys(names, 0.0)
    for i in range(steps + 1):
        for k in (names if i % 2 == 0 else names[::-1]):
            model, cache, first = runs[k]
            token = ids[:, first + i:first + i + 1]
            wall, c = _timed(lambda model=model, cache=cache, token=token: model(
                input_ids=token, use_cache=True, **{lm_eval.cache_keyword(model): cache}), device)
            if i:
                walls[k].append(wall)
                cpu[k] += c
    return {k: (walls[k], cpu[k] / (sum(walls[k]) * torch.get_num_threads())) for k in names}


def _random_kv_cache(config, tokens: int, device, seed: int):
    """A transformers ``DynamicCache`` holding ``tokens`` random keys and values in every layer, of the shape the
    model's own prefill leaves, ``(1, kv heads, tokens, head dim)``: a decode step's work does not depend on their
    values, and filling it costs a ``randn`` instead of a prefill (the method of causal_lm's exact decode)."""
    from transformers import DynamicCache

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads, tokens, head_dim)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device), layer)
    return cache


def _converted_pass(converted, ids: torch.Tensor, found: dict, contexts, chunk: int, device) -> dict:
    """The converted model's part of :func:`lm_decode_rows`: one :class:`~kernapprox.surgery.cache.KernelCache`
    (float32 states) advanced over ``ids`` in calls of at most ``chunk`` tokens, stopping at every length of
    ``found``, where it records the prefill so far and the state, and at each of ``contexts`` keeps a copy of the
    cache (``copy.deepcopy``: the decode steps run on it later, and the state goes on from exactly that length).
    Returns ``{context: the cache's copy}``."""
    import copy

    from kernapprox.surgery.cache import KernelCache

    key = lm_eval.cache_keyword(converted)
    cache = KernelCache(converted, state_dtype=torch.float32)
    n_max = max(found)
    stops = sorted(set(found) | set(range(chunk, n_max, chunk)))
    position, seconds, calls, copies = 0, 0.0, 0, {}
    for stop in stops:
        piece = ids[:, position:stop]
        seconds += _timed(lambda piece=piece: converted(input_ids=piece, use_cache=True, logits_to_keep=1,
                                                        **{key: cache}), device)[0]
        position, calls = stop, calls + 1
        if stop not in found:
            continue
        found[stop].update(prefill_s=seconds, prefill_calls=calls, prefill_s_per_token=seconds / stop,
                           state_tokens=int(cache.get_seq_length()), state_bytes=int(cache.state_bytes()))
        if stop in contexts:
            copies[stop] = copy.deepcopy(cache)
    return copies


@torch.no_grad()
def lm_decode_rows(model, stream, *, device: torch.device, contexts, prefill_lengths, chunk: int, steps: int,
                   num_features: int = LM_NUM_FEATURES, seed: int = 0) -> list[Row]:
    """The measurements of :func:`lm_decode` on any Llama-family causal LM ``model`` (exact, eval mode) and a
    token ``stream`` (one row per length of ``contexts`` ∪ ``prefill_lengths``; see :func:`lm_decode`).

    ``time_ours_s``: the converted model's decode step, ``time_peer_s``: the exact model's (NaN at a length where
    no step is timed); ``extra``: ``state_tokens`` (tokens the converted state has absorbed when its step is
    timed), ``state_bytes`` (:meth:`KernelCache.state_bytes <kernapprox.surgery.cache.KernelCache.state_bytes>`),
    ``kv_cache_bytes`` (the exact model's cache at that length, measured from its tensors:
    :func:`kernapprox.lm_eval.cache_bytes`), ``prefill_s`` / ``prefill_calls`` / ``prefill_s_per_token`` (the
    converted model's calls that took its state from 0 to that length), ``exact_prefill_s`` (one call of the exact
    model over the same tokens, NaN where not measured), the step times, and what was converted."""
    contexts, prefill_lengths = sorted(set(contexts)), sorted(set(prefill_lengths))
    lengths = sorted(set(contexts) | set(prefill_lengths))
    n_max = lengths[-1]
    ids, repeats = _lm_stream(stream, n_max + steps + 1)
    ids = ids.to(device)
    model = model.to(device).eval()
    key = lm_eval.cache_keyword(model)
    found: dict[tuple[str, int], dict] = {}
    converted, states = {}, {}
    for label, share in LM_CONVERSIONS.items():
        converted[label] = ka.convert(model, LM_ESTIMATOR, num_features=num_features, share_heads=share, rng=seed)
        common = {"conversion": label, "estimator": LM_ESTIMATOR, "num_features": num_features,
                  "share_heads": str(share), "layers_converted": int(model.config.num_hidden_layers),
                  "state_dtype": "float32", "prefill_chunk": chunk, "stream_repeats": repeats}
        found.update({(label, n): dict(common) for n in lengths})

    # Untimed warm-up calls of every model, short and long: the compiled paths the benchmark's switches allow are
    # built or loaded here (fused feature maps; the native chunked kernels, which take calls from ~1.4k tokens on).
    for m in (model, *converted.values()):
        for n in (min(512, n_max), min(2048, chunk, n_max)):
            m(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1)
    for label, m in converted.items():
        mine = {n: found[(label, n)] for n in lengths}
        states[label] = _converted_pass(m, ids, mine, contexts, chunk, device)

    # The decode steps: each converted model on its state's copy and the exact model over a KV cache of the same
    # length, at every context, interleaved round by round (:func:`_interleaved_steps`).
    runs = {}
    for n in contexts:
        kv = _random_kv_cache(model.config, n, device, seed * 1_000_003 + n)
        for label, m in converted.items():
            found[(label, n)]["kv_cache_bytes"] = int(lm_eval.cache_bytes(kv))
            runs[(label, n)] = (m, states[label][n], n)
        runs[("exact", n)] = (model, kv, n)
    timed = _interleaved_steps(runs, ids, steps, device)
    del runs, states, converted

    # The exact model's prefill of the first tokens, one call each.
    from transformers import DynamicCache

    for n in prefill_lengths:
        kv = DynamicCache()
        seconds = _timed(lambda n=n, kv=kv: model(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1,
                                                  **{key: kv}), device)[0]
        held = int(lm_eval.cache_bytes(kv))
        for label in LM_CONVERSIONS:
            found[(label, n)].update(exact_prefill_s=seconds, exact_prefill_s_per_token=seconds / n)
            found[(label, n)].setdefault("kv_cache_bytes", held)
        del kv

    rows = []
    for label in LM_CONVERSIONS:
        for n in lengths:
            extra = found[(label, n)]
            ours, cpu = timed.get((label, n), ([], float("nan")))
            peer, cpu_peer = timed.get(("exact", n), ([], float("nan")))
            extra.update(step_s=ours, exact_step_s=peer, exact_cpu_utilisation=cpu_peer)
            rows.append(Row("lm_decode", f"{label}, context={n}", n, True,
                            float(np.median(ours)) if ours else float("nan"),
                            float(np.median(peer)) if peer else float("nan"), reps=len(ours), cpu_utilisation=cpu,
                            extra={"exact_prefill_s": float("nan"), **extra}))
    return rows


def lm_decode(cfg: Config) -> list[Row]:
    """SmolLM2-135M (:func:`kernapprox.lm.load_smollm2`, float32, SDPA) decoding with a fixed-size state against
    its own KV-cache decoding (issue "[7/7] Performance", target "Decoding a real model").

    The converted models: every one of the 30 layers attends with FAVOR+ (:data:`LM_ESTIMATOR` at
    r = :data:`LM_NUM_FEATURES`), drawn once per layer or once per key/value head (:data:`LM_CONVERSIONS`: the
    targets read the first, :data:`LM_TARGET_CONVERSION`), decoded through a
    :class:`~kernapprox.surgery.cache.KernelCache` with float32 states.
    Its state at each context is the real thing: the Shakespeare stream of the calibration split
    (:func:`kernapprox.lm.text_stream`; repeated end to end only if it is shorter than the longest context, which
    ``extra.stream_repeats`` records) is prefilled through the model in calls of at most :attr:`Config.lm_chunk`
    tokens (4096: memory stays bounded) up to 1k, 4k and 32k tokens, the logits of the last position only
    (``logits_to_keep=1``), after two untimed calls of both models on the first 512 and 2048 tokens (where the
    fused feature maps and compiled kernels of the benchmark's switches are built or loaded); at each context a
    copy of the cache is kept. The exact model's cache at each context is a transformers ``DynamicCache`` filled
    with random keys and values of its true shape (the step's work does not depend on them; as causal_lm's exact
    decode). Then both
    models decode the stream's next tokens at every context, all of these runs interleaved round by round (one
    untimed round, :attr:`Config.lm_steps` timed ones; :func:`_interleaved_steps`), so that the machine's load
    weighs on the 1k and 32k steps and on both models alike: ``time_ours_s`` is the converted model's median step,
    ``time_peer_s`` the exact model's (SDPA over the cache, and the ``torch.cat`` that appends the new key and
    value to every layer's cache: transformers' own KV-cache decoding). Bytes: both caches measured from their
    tensors. Prefill: the exact model's one call over the first 1k and 4k tokens (SDPA) beside the converted calls
    that took the state over the same tokens (``extra.prefill_s``, and at 32k the whole chunked prefill).

    Without the model or the text (:func:`kernapprox.lm.unavailable_reason`,
    :func:`~kernapprox.lm.text_unavailable_reason`) the case returns one ``skipped`` row naming what is missing,
    and its targets are "not measured" with that reason (likewise a ``failed`` row if the float32 states
    underflow: the case measures float32 states and does not fall back to float64). ``--quick``: 128 and 512
    tokens."""
    from kernapprox import lm

    reason = lm.unavailable_reason() or lm.text_unavailable_reason("shakespeare")
    if reason is not None:
        return [Row("lm_decode", "SmolLM2-135M", 0, status=f"skipped: {reason}")]
    model, tokenizer = lm.load_smollm2()
    stream = lm.text_stream(tokenizer, split="calibration")
    try:
        return lm_decode_rows(model, stream, device=cfg.device, contexts=cfg.lm_contexts,
                              prefill_lengths=cfg.lm_prefill_lengths, chunk=cfg.lm_chunk, steps=cfg.lm_steps,
                              seed=cfg.seed)
    except ValueError as err:          # float32 states that underflow (KernelCache raises, naming it): no fallback
        if "underflow" not in str(err):
            raise
        return [Row("lm_decode", "SmolLM2-135M", 0, status=f"failed: float32 states: {err}")]


CASES = {
    "exact_vs_sdpa": exact_vs_sdpa,
    "precision_check": precision_check,
    "chunked_vs_sdpa": chunked_vs_sdpa,
    "chunked_scaling": chunked_scaling,
    "chunk_size": chunk_size_sweep,
    "decode_step": decode_step,
    "flop_rate": flop_rate,
    "favor_vs_performer": favor_vs_performer,
    "nystrom_vs_sklearn": nystrom_vs_sklearn,
    "rule_scaling": rule_scaling,
    "machine": machine,
    "fusion": fusion,
    "training_vs_sdpa": training_vs_sdpa,
    "lm_decode": lm_decode,
}
