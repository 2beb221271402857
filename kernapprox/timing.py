"""Timing, GEMM rate, FLOP counts and provenance shared by the benchmarks and the ``modes`` experiment.

Timing rule: one warm-up call, then repeated calls (device synchronised before and after each) until a time
budget or a repeat cap is reached; the statistic is the median. Wall-clock and process CPU time are both kept,
so that a run on a loaded machine says so (``cpu_time / (wall_time · threads)`` well below one means the
process was waiting for cores).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import numpy as np
import torch

from .provenance import git_revision

PACKAGES = ("kernapprox", "torch", "numpy", "scipy", "scikit-learn", "xarray", "h5netcdf", "performer-pytorch",
            "einops")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (CUDA); nothing on the CPU. Called only around timed regions, never inside."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Median wall time of ``reps`` calls after warm-up, with the spread and the CPU-time utilisation; ``times``
    holds every timed call (for intervals over the repeats)."""

    median_s: float
    min_s: float
    max_s: float
    reps: int
    cpu_utilisation: float   # process CPU time / (wall time · torch threads); ~1 on an idle CPU machine
    times: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "reps": self.reps,
                "cpu_utilisation": self.cpu_utilisation}


def measure(fn: Callable[[], object], device: torch.device, *, min_reps: int = 3, max_reps: int = 50,
            budget_s: float = 1.0, warmup: int = 1) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then at least ``min_reps`` and at most ``max_reps`` timed calls,
    stopping once ``budget_s`` seconds of timed calls have accumulated (after ``min_reps``)."""
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError(f"need 1 <= min_reps <= max_reps, got {min_reps}, {max_reps}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times, cpu = [], 0.0
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_s):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return Timing(float(np.median(times)), float(min(times)), float(max(times)), len(times),
                  float(cpu / (sum(times) * threads)), tuple(times))


def gemm_rate(device: torch.device, size: int = 2048, dtype: torch.dtype = torch.float32,
              budget_s: float = 0.5) -> float:
    """Achieved FLOP/s of a square ``size × size`` GEMM (``2·size³`` flops) on ``device``: the roofline that
    the other rates are quoted against."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen, dtype=dtype).to(device)
    b = torch.randn(size, size, generator=gen, dtype=dtype).to(device)
    t = measure(lambda: a @ b, device, min_reps=3, budget_s=budget_s)
    return 2.0 * size**3 / t.median_s


def memory_bandwidth(device: torch.device, megabytes: int = 256, budget_s: float = 0.5) -> float:
    """Achieved bytes/s of ``a = b + c`` (STREAM's "add") over float32 arrays of ``megabytes`` each, far beyond
    the caches: 3 arrays' bytes moved per call (two read, one written; write-allocate traffic not counted)."""
    n = megabytes * (1 << 20) // 4
    b = torch.ones(n, device=device)
    c = torch.ones(n, device=device)
    a = torch.empty(n, device=device)
    t = measure(lambda: torch.add(b, c, out=a), device, min_reps=3, budget_s=budget_s)
    return 3.0 * 4 * n / t.median_s


def exp_rate(device: torch.device, entries: int = 1 << 19, budget_s: float = 0.3) -> float:
    """Achieved ``exp`` evaluations/s (float32, in place, arguments in [−8, 0]: no special values) on a block that
    stays in cache: the element-wise ceiling of an exponential feature map."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    src = (-8 * torch.rand(entries, generator=gen)).to(device)
    out = torch.empty_like(src)
    t = measure(lambda: torch.exp(src, out=out), device, min_reps=3, budget_s=budget_s)
    return entries / t.median_s


# --------------------------------------------------------------------------------------------- FLOP counts
# Only the multiply-adds of matrix products are counted (2 flops each): that is the work a GEMM rate bounds.
# Element-wise work (exp, scaling, masks) is real cost but not counted, so a rate near the GEMM rate means the
# element-wise passes are cheap, not that they are absent.

def feature_map_flops(n: int, d: int, num_frequencies: int, heads: int = 1) -> float:
    """Projection ``X Wᵀ`` of one role: ``2 · n · d · m`` per head."""
    return 2.0 * n * d * num_frequencies * heads


def linear_attention_flops(n: int, r: int, d_v: int, heads: int = 1, *, causal: bool, chunk_size: int = 64) -> float:
    """Products of linear attention after the features (numerator and normaliser, ``d_v + 1`` columns).

    Non-causal: ``Φ_Kᵀ [V 1]`` and ``Φ_Q S``: ``4 · n · r · (d_v+1)``. Causal, chunked: the same state products
    plus the useful half of the intra-chunk products ``Φ_Q Φ_Kᵀ`` and ``A [V 1]``: ``n · C · (r + d_v + 1)``.
    """
    base = 4.0 * n * r * (d_v + 1)
    if causal:
        base += n * chunk_size * (r + d_v + 1)
    return base * heads


def sdpa_flops(n_q: int, n_k: int, d: int, d_v: int, heads: int = 1, *, causal: bool) -> float:
    """Useful work of exact attention: ``2 · n_q · n_k · (d + d_v)``, halved when causal (square)."""
    f = 2.0 * n_q * n_k * (d + d_v) * heads
    return f / 2 if causal else f


# -------------------------------------------------------------------------------------------- provenance
def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"


def provenance(device: torch.device) -> dict:
    """Attributes (str or number) that make a timing reproducible and its conditions visible."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    attrs = {
        "git_revision": git_revision(),
        "package_versions": json.dumps(package_versions()),
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_description(device),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count() or 0,
        "load_average_1min_at_start": float(load[0]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        attrs["cuda_matmul_allow_tf32"] = int(torch.backends.cuda.matmul.allow_tf32)
        attrs["cudnn_allow_tf32"] = int(torch.backends.cudnn.allow_tf32)
        attrs["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return attrs
