"""A compiled CPU kernel for the causal chunked mode of the sum and decay rules.

The eager causal chunked mode (:func:`kernapprox.attention.linear._chunked_causal`) batches each token block's
chunks into a few large products, which makes it materialise every chunk's summary and state (``(d_v+1) × r``
each: more bytes than the chunk's features when ``C`` is small) and run a dozen element-wise passes per block. The
kernel in ``_chunked_causal.cpp`` runs the same recurrence chunk by chunk instead (Yang et al. 2024, "Gated Linear
Attention", sec. 3.2, with the log-domain shifts of :mod:`kernapprox.attention.linear`): the state stays in cache,
the state read and the intra-chunk scores come out of one single-threaded BLAS product ``φ(Q_j) [Sᵀ; φ(K_j)]ᵀ``,
and the sequences of a batch are spread over the OpenMP threads. Features are still computed per token block by
the estimator (fused or eager). The kernel equals the eager code to float rounding (tests/test_native.py).

When it runs
------------
It follows the switch of the fused feature maps (:mod:`kernapprox.estimators.fused`, ``KERNAPPROX_FUSED``):
``"off"`` never; ``"on"`` for every eligible call; ``"auto"`` and ``"large"`` for eligible calls of at least
:data:`~kernapprox.estimators.fused.MIN_ENTRIES` feature entries (a block's worth). Eligible: float32 inputs on a
CPU, no gradient needed, the sum or decay rule, at least as many sequences (batch × heads) as torch threads, and
the kernel available — a C++ compiler on ``PATH`` (``CXX``, ``g++``, ``c++``), a PyTorch built with MKL (the
kernel calls the ``sgemm_`` and ``MKL_Set_Num_Threads_Local`` that ``libtorch_cpu`` exports) and OpenMP.

Building
--------
The first eligible call compiles the source once per machine (about a second) into
``$KERNAPPROX_NATIVE_DIR``, else ``$XDG_CACHE_HOME/kernapprox`` (``~/.cache/kernapprox``; a per-user folder of the
temporary directory when that cannot be written), named by a hash of the
source, the flags, the compiler and torch's version and CPU capability; later processes load the file. The loaded
library is checked once per process against the parallel mode on a small problem with decay, a partial chunk
and a carried state. Never a crash, never a wrong result: a failed build, load or check disables the kernel for
the process with a ``RuntimeWarning`` naming the cause, and the eager code runs. :func:`status` says which.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..estimators import fused

SOURCE = Path(__file__).with_name("_chunked_causal.cpp")
DIR_ENV = "KERNAPPROX_NATIVE_DIR"
_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
          "AVX2": ["-mavx2", "-mfma"]}


class _State:
    lib = None                   # the loaded library (its path: lib._name)
    failed: str | None = None    # why it is disabled in this process


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).parent / "lib"


@functools.cache
def _prerequisites() -> tuple[bool, str]:
    """Whether the kernel can be built and run in this process at all (no compilation), and why not."""
    if fused.cxx_compiler() is None:
        return False, "no C++ compiler on PATH (CXX, g++, clang++)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"no build flags for {platform.machine()}"
    if not torch.backends.mkl.is_available():
        return False, "PyTorch was built without MKL (the kernel calls its sgemm_)"
    if "OpenMP" not in torch.__config__.parallel_info():
        return False, "PyTorch's parallel backend is not OpenMP"
    try:
        torch_cpu = ctypes.CDLL(str(_torch_lib_dir() / "libtorch_cpu.so"))
        for symbol in ("sgemm_", "MKL_Set_Num_Threads_Local"):
            getattr(torch_cpu, symbol)
    except (OSError, AttributeError) as exc:
        return False, f"libtorch_cpu does not export what the kernel needs ({exc})"
    return True, "C++ compiler, MKL and OpenMP found"


def _build_dir() -> Path:
    """``$KERNAPPROX_NATIVE_DIR``, else the user's cache (``$XDG_CACHE_HOME/kernapprox``, ``~/.cache/kernapprox``)
    when it can be created and written, else a per-user folder in the temporary directory."""
    root = os.environ.get(DIR_ENV)
    if root:
        return Path(root)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "kernapprox"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if os.access(cache, os.W_OK):
            return cache
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"kernapprox-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _command(source: Path, target: Path) -> list[str]:
    lib = _torch_lib_dir()
    flags = _FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    compiler = fused.cxx_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler on PATH (CXX, g++, clang++)")
    return [compiler, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-std=c++17", str(source), "-o",
            str(target), f"-L{lib}", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _build() -> Path:
    """Compile the source unless a library of the same source, flags, compiler and torch is cached; atomic (a
    temporary file renamed), so that concurrent processes never load a half-written library."""
    text = SOURCE.read_bytes()
    probe = _command(Path("SRC"), Path("OUT"))
    digest = hashlib.sha256(text + "\0".join([*probe, torch.__version__,
                                              torch.backends.cpu.get_cpu_capability()]).encode()).hexdigest()[:16]
    directory = _build_dir()
    target = directory / f"chunked_causal-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run(_command(SOURCE, Path(tmp)), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"compilation failed (exit code {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[:300]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    """The loaded library, or None (disabled, with the warning given once)."""
    if _State.lib is not None or _State.failed is not None:
        return _State.lib
    ok, why = _prerequisites()
    if not ok:
        _State.failed = why             # nothing to warn about: the kernel is simply not available here
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
        fn = lib.kernapprox_chunked_causal
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [i, i, i, i, i, ctypes.c_float, p, p, p, p, p, i64, i64, p, p, p, i64, i64, p, p, i64, i, i]
        fn.restype = i
        _State.lib = lib
        _self_check()
    except Exception as exc:  # noqa: BLE001 - any build, load or check failure means: run the eager code
        disable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300])
    return _State.lib


def disable(reason: str) -> None:
    """Disable the kernel for the process (the eager code runs), with a ``RuntimeWarning`` naming ``reason``."""
    _State.lib, _State.failed = None, reason
    warnings.warn(f"kernapprox: the compiled causal chunked kernel is disabled for this process ({reason}); the "
                  "eager code runs instead (set KERNAPPROX_FUSED=off to silence this)", RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget the loaded library and any failure (the next eligible call loads or builds again); for tests."""
    _State.lib = _State.failed = None
    _prerequisites.cache_clear()


def status() -> str:
    """``"unused"``, ``"loaded <path>"``, ``"unavailable: <why>"`` or ``"failed: <why>"``."""
    if _State.lib is not None:
        return f"loaded {_State.lib._name}"
    if _State.failed is not None:
        ok = _prerequisites()[0]
        return f"{'failed' if ok else 'unavailable'}: {_State.failed}"
    return "unused"


def eligible(q: torch.Tensor, batch: int, n: int, r: int, needs_grad: bool) -> bool:
    """Whether the causal chunked call on ``q`` (``batch`` sequences of ``n`` tokens, ``r`` features) runs the
    kernel (see the module docstring); loads or builds it on the first eligible call."""
    switch = fused.get_mode()
    if switch == "off" or needs_grad or q.device.type != "cpu" or q.dtype != torch.float32 or n < 1:
        return False
    if batch < torch.get_num_threads() or fused._compiling():
        return False
    if switch != "on" and batch * n * r < fused.MIN_ENTRIES:
        return False
    return _load() is not None


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def chunk_block(pq, lq, pk, lk, v, state, c, out, den, logs, chunk_size: int, log_decay: float,
                want_num: bool) -> None:
    """Advance ``state``/``c`` in place over one token block and write its rows.

    ``pq, pk`` ``(B, L, r)`` and ``lq, lk`` ``(B, L)`` contiguous float32 stabilised features and log-scales;
    ``v`` ``(B, L, d_v)`` float32 with unit stride in the last dimension; ``state`` ``(B, d_v+1, r)`` contiguous
    (``[W z]ᵀ``), ``c`` ``(B,)`` its log-scale (the empty-state sentinel before the first key); ``out``
    ``(B, L, d_v)`` receives ``num/den`` (or the numerators with ``want_num``), ``den`` and ``logs`` ``(B, L)``
    the normalisers and the rows' log-scales (unit stride in the last dimension).
    """
    batch, length, r = pq.shape
    d_v = v.shape[-1]
    rc = _State.lib.kernapprox_chunked_causal(
        batch, length, r, d_v, chunk_size, float(log_decay), _ptr(pq), _ptr(lq), _ptr(pk), _ptr(lk), _ptr(v),
        v.stride(0), v.stride(1), _ptr(state), _ptr(c), _ptr(out), out.stride(0), out.stride(1), _ptr(den),
        _ptr(logs), den.stride(0), int(want_num), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the causal chunked kernel rejected its arguments (code {rc})")


def _self_check() -> None:
    """The loaded kernel against the parallel mode on a small problem (decay, a partial chunk, a carried state)."""
    from .linear import _normalized_parallel
    from .rules import NormalizedState

    gen = torch.Generator().manual_seed(0)
    batch, n, r, d_v, size, a = 3, 21, 12, 5, 4, -0.05
    pq, pk = torch.rand(batch, n, r, generator=gen), torch.rand(batch, n, r, generator=gen)
    lq, lk = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)
    v = torch.randn(batch, n, d_v, generator=gen)
    w0, z0 = torch.rand(batch, r, d_v, generator=gen), torch.rand(batch, r, generator=gen)
    c0 = torch.randn(batch, generator=gen)
    num, den, logs, final = _normalized_parallel(*(t.double() for t in (pq, lq, pk, lk, v)), True, a, None,
                                                 NormalizedState(w0.double(), z0.double(), c0.double()), True)
    state = torch.cat([w0, z0[..., None]], -1).transpose(-1, -2).contiguous()
    c = c0.clone()
    out, got_den, got_logs = torch.empty(batch, n, d_v), torch.empty(batch, n), torch.empty(batch, n)
    chunk_block(pq, lq, pk, lk, v, state, c, out, got_den, got_logs, size, a, want_num=False)
    # compare at the same log-scale: y = num/den is scale-free; the state is compared after rescaling
    rescale = torch.exp(final.log_scale - c.double())[:, None, None]
    want_state = torch.cat([final.w, final.z[..., None]], -1).transpose(-1, -2) * rescale
    checks = {"outputs": (out.double(), num / den[..., None]),
              "normalisers": (got_den.double() * torch.exp(got_logs.double() - logs), den),
              "state": (state.double(), want_state)}
    for name, (got, want) in checks.items():
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"self-check: its {name} differ from the parallel mode by "
                               f"{float((got - want).abs().max()):.3g}")
