"""Compiled CPU kernels for the chunked mode of the sum and decay rules (float32, no gradient).

Two kernels, in ``_chunked.cpp``, built once per machine and loaded with ``ctypes``; each equals the eager
chunked code of :mod:`kernapprox.attention.linear` to float rounding (tests/test_native.py):

causal (:func:`chunk_block`)
    The eager causal chunked mode (:func:`kernapprox.attention.linear._chunked_causal`) batches each token
    block's chunks into a few large products, which makes it materialise every chunk's summary and state
    (``(d_v+1) × r`` each: more bytes than the chunk's features when ``C`` is small) and run a dozen element-wise
    passes per block. The kernel runs the same recurrence chunk by chunk instead (Yang et al. 2024, "Gated Linear
    Attention", sec. 3.2, with the log-domain shifts of :mod:`kernapprox.attention.linear`): the state stays in
    cache, the state read and the intra-chunk scores come out of one single-threaded BLAS product
    ``φ(Q_j) [Sᵀ; φ(K_j)]ᵀ``. Features are computed per token block by the estimator (fused or eager), or, for
    maps of the exponential form, by the kernel itself (:func:`causal_exp`) as the non-causal kernel does, a
    :func:`feature_block` of tokens at a time per sequence.
non-causal (:func:`noncausal`)
    ``Y = φ(Q)(φ(K)ᵀ[V 1])`` (Katharopoulos et al. 2020, eq. 4–6) with the feature map computed inside the
    kernel, :data:`NONCAUSAL_BLOCK` tokens at a time while they are in cache: the projection GEMM, the row shift
    and ``exp`` (with the key weights and the normaliser's sums folded into the same pass), then the summary or
    read GEMM — no feature matrix, no ``[V 1]`` copy and no element-wise pass ever leaves the cache. Only for maps
    of the exponential form ``log φ_j = α(x'Wᵀ)_j + o_j − kα²‖x'‖²/2 + c`` (FAVOR+, hyperbolic, the GERF family:
    every :class:`~kernapprox.estimators.random.ExponentialRandomFeatureMap` that keeps its stabilised features,
    :meth:`~kernapprox.estimators.random.ExponentialRandomFeatureMap._exponential_form`); other maps run eagerly.

In both, the sequences (batch × heads) share torch's OpenMP threads, each running its products on one thread.

When they run
-------------
They follow the switch of the fused feature maps (:mod:`kernapprox.estimators.fused`, ``KERNAPPROX_FUSED``):
``"off"`` never; ``"on"`` for every eligible call; ``"auto"`` and ``"large"`` for eligible calls of at least
:data:`~kernapprox.estimators.fused.MIN_ENTRIES` feature entries (a block's worth). Eligible: float32 inputs on a
CPU, no gradient needed, the sum or decay rule, at least as many sequences (batch × heads) as torch threads, and
the kernels available — a C++ compiler on ``PATH`` (``CXX``, ``g++``, ``c++``), a PyTorch built with MKL (the
kernels call the ``sgemm_`` and ``MKL_Set_Num_Threads_Local`` that ``libtorch_cpu`` exports) and OpenMP; for the
non-causal kernel also a map of the exponential form.

Building
--------
The first eligible call compiles the source once per machine (about a second) into
``$KERNAPPROX_NATIVE_DIR``, else ``$XDG_CACHE_HOME/kernapprox`` (``~/.cache/kernapprox``; a per-user folder of the
temporary directory when that cannot be written), named by a hash of the
source, the flags, the compiler and torch's version and CPU capability; later processes load the file. The loaded
library is checked once per process against the parallel mode on small problems (causal: decay, a partial chunk
and a carried state; non-causal: decay, padded keys, a carried state, an offset and ``eps``, more queries than
keys). Never a crash, never a wrong result: a failed build, load or check disables both kernels for the process
with a ``RuntimeWarning`` naming the cause, and the eager code runs. :func:`status` says which.
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

SOURCE = Path(__file__).with_name("_chunked.cpp")
# Tokens per block of the non-causal kernel: a block's features (256 × r floats) stay in the L2 cache (blocks of
# 64 to 512 tokens measured within 5 % of each other at r = 256, n = 16k, 8 heads, 2 threads).
NONCAUSAL_BLOCK = 256
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
    target = directory / f"chunked-{digest}.so"
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
        fn = lib.kernapprox_exp_attention
        fn.argtypes = [i, i, i, i, i, i, i, i, ctypes.c_float, p, p, p, p, p, p, p, i64, i64, p, i64, i64, p, i64,
                       p, i64, i64, p, p, p, i64, i64, p, p, i64, i, i]
        fn.restype = i
        lib.kernapprox_exp_nonpos.argtypes = [p, p, i64, i]
        lib.kernapprox_exp_nonpos.restype = None
        _State.lib = lib
        _self_check()
    except Exception as exc:  # noqa: BLE001 - any build, load or check failure means: run the eager code
        disable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300])
    return _State.lib


def disable(reason: str) -> None:
    """Disable the kernel for the process (the eager code runs), with a ``RuntimeWarning`` naming ``reason``."""
    _State.lib, _State.failed = None, reason
    warnings.warn(f"kernapprox: the compiled chunked kernels are disabled for this process ({reason}); the "
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
    """Whether the chunked call on ``q`` (``batch`` sequences of ``n`` tokens, ``r`` features) may run a kernel
    (see the module docstring; the features-given form serves causal calls of any map); loads or builds the
    library on the first eligible call."""
    switch = fused.get_mode()
    if switch == "off" or needs_grad or q.device.type != "cpu" or q.dtype != torch.float32 or n < 1:
        return False
    if batch < torch.get_num_threads() or fused._compiling():
        return False
    if switch != "on" and batch * n * r < fused.MIN_ENTRIES:
        return False
    return _load() is not None


def exponential_form(estimator):
    """Whether the kernels can compute ``estimator``'s features themselves: a fitted map of the exponential
    form (:class:`~kernapprox.estimators.random.ExponentialRandomFeatureMap` with its own
    :meth:`_fused_arguments` and the stabilised features of that class, not a subclass's own)."""
    from ..estimators.random import ExponentialRandomFeatureMap as Exp

    cls = type(estimator)
    return (isinstance(estimator, Exp) and cls._fused_arguments is not Exp._fused_arguments
            and cls._log_features is Exp._log_features and cls._log_features_into is Exp._log_features_into)


def eligible_exponential(q: torch.Tensor, estimator, batch: int, n: int, r: int, needs_grad: bool) -> bool:
    """Whether the chunked call runs a kernel that computes the features itself (non-causal, or causal with
    features inside): :func:`eligible` and a map of the exponential form."""
    return exponential_form(estimator) and eligible(q, batch, n, r, needs_grad)


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


def _gemm_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, n, m)`` if a BLAS product can read its rows in place (unit stride within a row, rows at least
    ``m`` apart), else a contiguous copy (e.g. of an expanded tensor, whose rows share memory)."""
    return t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous()


def _map_arguments(estimator, x, role):
    """``(rows, W, o or None, [α, c, eps, k])`` as float32 tensors the kernel reads."""
    rows, alpha, weight, offset, scalars = estimator._exponential_form(x, role)
    rows = _gemm_rows(rows)
    weight = weight.to(torch.float32).contiguous()
    offset = None if offset is None else offset.to(torch.float32).contiguous()
    values = torch.tensor([alpha, *(float(s) for s in scalars)], dtype=torch.float32)
    return rows, weight, offset, values


def _exp_attention(estimator, xq, xk, v, padding, state, c, out, den, logs, log_decay: float, want_num: bool,
                   chunk_size: int, block: int) -> None:
    """One call of the kernel that computes the features itself: causal with ``chunk_size > 0``, else non-causal
    (arguments: :func:`noncausal`)."""
    rq, wq, oq, mq = _map_arguments(estimator, xq, "query")
    rk, wk, ok, mk = _map_arguments(estimator, xk, "key")
    v = _gemm_rows(v)
    pad = None if padding is None else padding.to(torch.bool).contiguous()
    rc = _State.lib.kernapprox_exp_attention(
        chunk_size, rq.shape[0], rq.shape[1], rk.shape[1], rq.shape[-1], wq.shape[0], v.shape[-1], block,
        float(log_decay), _ptr(wq), None if oq is None else _ptr(oq), _ptr(mq), _ptr(wk),
        None if ok is None else _ptr(ok), _ptr(mk), _ptr(rq), rq.stride(0), rq.stride(1), _ptr(rk), rk.stride(0),
        rk.stride(1), None if pad is None else _ptr(pad), 0 if pad is None else pad.stride(0), _ptr(v), v.stride(0),
        v.stride(1), _ptr(state), _ptr(c), _ptr(out), out.stride(0), out.stride(1), _ptr(den), _ptr(logs),
        den.stride(0), int(want_num), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the chunked kernel with features inside rejected its arguments (code {rc})")


def noncausal(estimator, xq, xk, v, padding, state, c, out, den, logs, log_decay: float, want_num: bool) -> None:
    """Non-causal chunked attention of ``B`` sequences by the kernel, features included.

    ``xq`` ``(B, n_q, d)``, ``xk`` ``(B, n_k, d)``: the float32 inputs (unscaled, as given to
    :meth:`~kernapprox.estimators.base.FeatureMap.features`); ``v`` ``(B, n_k, d_v)`` float32; ``padding``
    ``(B, n_k)`` bool (True: padded) or None; ``state`` ``(B, d_v+1, r)`` contiguous (``[W z]ᵀ``) and ``c`` ``(B,)``
    its log-scale (the empty-state sentinel when empty), advanced in place over every key; ``out``
    ``(B, n_q, d_v)`` receives ``num/den`` (or the numerators with ``want_num``), ``den`` and ``logs`` ``(B, n_q)``
    the normalisers and the rows' log-scales (unit stride in the last dimension).
    """
    _exp_attention(estimator, xq, xk, v, padding, state, c, out, den, logs, log_decay, want_num, 0,
                   NONCAUSAL_BLOCK)


def feature_block(chunk_size: int) -> int:
    """Tokens per feature block of the causal kernel with features inside: the multiple of ``chunk_size`` nearest
    below :data:`NONCAUSAL_BLOCK` (at least one chunk), so that chunks start where the eager code starts them."""
    return max(chunk_size, NONCAUSAL_BLOCK // chunk_size * chunk_size)


def causal_exp(estimator, xq, xk, v, padding, state, c, out, den, logs, chunk_size: int, log_decay: float,
               want_num: bool) -> None:
    """Causal chunked attention of ``B`` sequences by the kernel, with the features of a map of the exponential
    form computed inside it, :func:`feature_block` tokens at a time (arguments as for :func:`noncausal`;
    ``n_q = n_k``)."""
    _exp_attention(estimator, xq, xk, v, padding, state, c, out, den, logs, log_decay, want_num, chunk_size,
                   feature_block(chunk_size))


def exp_nonpositive(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out ← exp(src)`` by the kernels' vectorised ``exp`` (arguments ``≤ 0``; results below the smallest normal
    float flushed to 0), on torch's thread count: what the benchmarks' roofline measures as the kernels' ``exp``
    rate. Contiguous float32 CPU tensors of one size; the library must be loaded (:func:`eligible`,
    :func:`_load`)."""
    for name, t in (("src", src), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if src.numel() != out.numel():
        raise ValueError(f"src and out differ in size: {src.numel()} and {out.numel()}")
    if _State.lib is None:
        raise RuntimeError(f"the compiled kernels are not loaded ({status()})")
    _State.lib.kernapprox_exp_nonpos(_ptr(src), _ptr(out), src.numel(), torch.get_num_threads())
    return out


def _self_check() -> None:
    _self_check_causal()
    _self_check_exp(causal=False)
    _self_check_exp(causal=True)


def _agrees_with_parallel(label, run, feats, v, state0, causal, a):
    """Run ``run(state, c, out, den, logs)`` (a kernel on the problem whose float64 features ``feats = (pq, lq,
    pk, lk)`` and values ``v`` the parallel mode gets) from the carried state ``state0 = (w, z, c)``, and raise
    unless its outputs, normalisers and final state agree with the parallel mode's (at the same log-scale: the
    output is scale-free, the normalisers and the state are compared after rescaling)."""
    from .linear import _normalized_parallel
    from .rules import NormalizedState

    w0, z0, c0 = state0
    batch, n_q, d_v = feats[0].shape[0], feats[0].shape[1], v.shape[-1]
    num, den, logs, final = _normalized_parallel(*feats, v.double(), causal, a, None,
                                                 NormalizedState(w0.double(), z0.double(), c0.double()), True)
    state = torch.cat([w0, z0[..., None]], -1).transpose(-1, -2).contiguous()
    c = c0.clone()
    out, got_den, got_logs = torch.empty(batch, n_q, d_v), torch.empty(batch, n_q), torch.empty(batch, n_q)
    run(state, c, out, got_den, got_logs)
    rescale = torch.exp(final.log_scale - c.double())[:, None, None]
    want_state = torch.cat([final.w, final.z[..., None]], -1).transpose(-1, -2) * rescale
    checks = {"outputs": (out.double(), num / den[..., None]),
              "normalisers": (got_den.double() * torch.exp(got_logs.double() - logs), den),
              "state": (state.double(), want_state)}
    for name, (got, want) in checks.items():
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"self-check: {label} {name} differ from the parallel mode by "
                               f"{float((got - want).abs().max()):.3g}")


def _random_state(gen, batch, r, d_v, shift=0.0):
    return (torch.rand(batch, r, d_v, generator=gen), torch.rand(batch, r, generator=gen),
            torch.randn(batch, generator=gen) + shift)


def _self_check_causal() -> None:
    """The loaded kernel against the parallel mode on a small problem (decay, a partial chunk, a carried state)."""
    gen = torch.Generator().manual_seed(0)
    batch, n, r, d_v, size, a = 3, 21, 12, 5, 4, -0.05
    pq, pk = torch.rand(batch, n, r, generator=gen), torch.rand(batch, n, r, generator=gen)
    lq, lk = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)
    v = torch.randn(batch, n, d_v, generator=gen)
    state0 = _random_state(gen, batch, r, d_v)
    _agrees_with_parallel("its", lambda state, c, out, den, logs: chunk_block(
        pq, lq, pk, lk, v, state, c, out, den, logs, size, a, want_num=False),
        tuple(t.double() for t in (pq, lq, pk, lk)), v, state0, True, a)


class _CheckMap:
    """A map of the exponential form with fixed random parameters, for :func:`_self_check_exp`."""

    def __init__(self, gen, d, r):
        self.weight = torch.randn(r, d, generator=gen)
        self.offset = 0.3 * torch.randn(r, generator=gen)
        self.alpha, self.scalars = 0.7, (-1.5, 1e-3, 1.0)      # α, then [c, eps, k]

    def _exponential_form(self, x, role):
        return x, self.alpha, self.weight, self.offset, self.scalars

    def reference(self, x):
        """``(φ̃, ℓ)`` in float64 by the formula."""
        c, eps, k = self.scalars
        p = self.alpha * x.double() @ self.weight.double().T + self.offset.double()
        shift = p.amax(-1)
        norm = k * 0.5 * self.alpha ** 2 * (x.double() ** 2).sum(-1)
        return torch.exp(p - shift[..., None]) + eps, shift + c - norm


def _self_check_exp(causal: bool) -> None:
    """A kernel that computes the features itself against the parallel mode: decay, padded keys, a carried state,
    an offset and eps; non-causal with more queries than keys and a partial block, causal over two feature blocks
    and a partial chunk."""
    from .rules import SENTINEL

    gen = torch.Generator().manual_seed(2 if causal else 1)
    size, d, r, d_v, a = 8, 6, 10, 5, (-0.02 if causal else -0.01)
    if causal:
        batch, n_q = 2, feature_block(size) + 2 * size + 3
        n_k = n_q
    else:
        batch, n_q, n_k = 3, NONCAUSAL_BLOCK + 7, NONCAUSAL_BLOCK - 5
    fmap = _CheckMap(gen, d, r)
    xq, xk = torch.randn(batch, n_q, d, generator=gen), torch.randn(batch, n_k, d, generator=gen)
    v = torch.randn(batch, n_k, d_v, generator=gen)
    padding = torch.rand(batch, n_k, generator=gen) < 0.2
    state0 = _random_state(gen, batch, r, d_v, shift=2.0)
    pq, lq = fmap.reference(xq)
    pk, lk = fmap.reference(xk)
    pk, lk = pk.masked_fill(padding[..., None], 0.0), lk.masked_fill(padding, SENTINEL)

    def run(state, c, out, den, logs):
        if causal:
            causal_exp(fmap, xq, xk, v, padding, state, c, out, den, logs, size, a, want_num=False)
        else:
            noncausal(fmap, xq, xk, v, padding, state, c, out, den, logs, a, want_num=False)

    _agrees_with_parallel("the causal kernel's (features inside)" if causal else "the non-causal kernel's", run,
                          (pq, lq, pk, lk), v, state0, causal, a)
