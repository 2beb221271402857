"""Fused feature maps: the projection, the stabilising shift and the ``exp`` in as few passes as the hardware allows.

Eager PyTorch evaluates a stabilised exponential feature map ``φ̃ = exp(xWᵀ + o − max_j(xWᵀ + o)_j)`` as separate
passes over the ``n × r`` projection (the offset, the row maximum, the subtraction, the ``exp``, the ``eps``), each
reading and writing the whole matrix. Compiled with :func:`torch.compile` (TorchInductor: C++/OpenMP on a CPU,
Triton on a GPU), the matrix product stays a library GEMM and everything after it becomes one kernel that reads
each row once while it is in cache: one write of the projection, one read and one write of the features.

Three kernels, each shared by every map of its form (one compilation per form, dtype and device, whatever the map,
its rank, its input dimension or the number of rows — shapes are dynamic):

``exponential``
    ``log φ_j(x) = (xWᵀ)_j + o_j − ½‖x‖² + c`` (``+ eps`` after the shift): positive (FAVOR+, ``W`` = the
    projection), hyperbolic (``W = [Ω; −Ω]``), GERF, OPRF, SDERF, SADERF and ADERF (``W`` = the rescaled
    frequencies, ``o`` = ``Σ_l α_l ω_l²``, the transform applied before the kernel).
``trigonometric``
    ``φ̃ = (sin xWᵀ, cos xWᵀ)``, ``ℓ = ½‖x‖² + c``.
``nystrom``
    ``φ̃ = exp(xZᵀ − h − max_j(xZᵀ − h)_j) G^{+1/2}`` (a second GEMM after the fused kernel).

The eager code of each map (:meth:`~kernapprox.estimators.base.FeatureMap._log_features`) stays the reference and
the fallback. The fused kernels equal it to float rounding (the same GEMM; a different ``exp`` implementation and
summation order of ``‖x‖²``); the tests check it for every map and attention mode.

The switch
----------
``KERNAPPROX_FUSED`` (environment, read at import) or :func:`set_mode` / the context manager :func:`mode` (the
switch ``"fused"`` of :mod:`kernapprox.backends`, which makes and records each call's choice: backends ``fused``
and ``eager`` of ``"features.exponential"`` and ``"features.trigonometric"``; the compiled chunked operators have
their own switch, ``KERNAPPROX_NATIVE``):

``"auto"`` (default)
    fused when all of these hold, else eager: the call produces at least :data:`MIN_ENTRIES` feature entries
    (and at most :data:`MAX_ENTRIES` for a kernel measured slower than the eager code beyond that size);
    the compute dtype is float32 (half inputs are computed in float32); no gradient is needed; :func:`torch.compile`
    can run on the device (a C++ compiler on a CPU, Triton on a GPU; :func:`available`); the call is not itself
    being traced by :func:`torch.compile` (an outer compilation fuses the eager code itself); the kernel has not
    failed in this process; and the process has already computed :data:`WARMUP_ENTRIES` feature entries of such
    calls eagerly (per kernel and device type). The last rule is the ski-rental rule: a compilation costs seconds
    (measured: see the guide), so it is bought only once the eager work done so far would have paid for it — a
    process that computes a few large calls never compiles, one that computes many compiles early, and neither
    pays more than twice what the better choice in hindsight would have cost.
``"large"``
    the same rules without the warm-up: the first eligible call compiles (benchmarks, and processes known to do
    much work, e.g. inference over a data set).
``"on"``
    fused for every call (any size and dtype, with autograd), except inside an outer compilation and after a
    failure: for tests.
``"off"``
    eager always.

Never a crash, never a wrong result: any exception while compiling or running a compiled kernel disables that
kernel for the process with a ``RuntimeWarning`` naming the cause, and the call returns the eager result. The
first call of each compiled variant (kernel, device, dtype, autograd) is checked against the eager kernel on its
first rows; a mismatch beyond rounding disables the kernel the same way. :func:`status` reports each kernel's
state and compilation time.

Compilation time is measured by ``python -m benchmarks.run --cases fusion`` (cold and warm on-disk cache, each
kernel in a fresh process), with the eager and fused times against the size; ``docs/guide/performance.md`` gives
the numbers behind :data:`MIN_ENTRIES` and :data:`WARMUP_ENTRIES`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import time
import warnings

import torch

from .. import backends

MODES = backends.SWITCHES["fused"].modes

# Auto mode fuses only calls producing at least this many feature entries (rows × r, all batch entries together):
# a token block of the chunked mode (2^19 entries on a CPU) and anything larger. Below it a call takes well under a
# millisecond, where fusion saves microseconds against seconds of compilation.
MIN_ENTRIES = 1 << 18

# ... and only once the process has computed this many entries in such calls with the eager code (per kernel and
# device type): compile when the eager work done so far would have paid for the compilation (the ski-rental rule:
# never more than twice the cost of the best choice made knowing the future). See the module docstring.
WARMUP_ENTRIES = {"cpu": 1 << 32, "cuda": 1 << 36}

# ... and at most this many where the compiled kernel was measured slower than the eager code (kernel, device
# type): on a CPU the fused sin/cos epilogue ran at 1.2-1.5x the eager speed up to 2^21 entries but at 0.38-0.47x
# at 2^23-2^25 entries (``python -m benchmarks.run --cases fusion``, 2 threads, the run behind
# benchmarks/RESULTS.md); the chunked mode's token blocks (2^19 entries) stay fused.
MAX_ENTRIES = {("trigonometric", "cpu"): 1 << 21}

# Rows of a compiled call that are compared with the eager kernel the first time a variant runs.
_VERIFY_ROWS = 256


def get_mode() -> str:
    """The current switch: ``"auto"``, ``"large"``, ``"on"`` or ``"off"`` (:func:`kernapprox.backends.get_mode`)."""
    return backends.get_mode("fused")


def set_mode(value: str) -> str:
    """Set the switch for the process; returns the previous value (:func:`kernapprox.backends.set_mode`)."""
    return backends.set_mode("fused", value)


@contextlib.contextmanager
def mode(value: str):
    """Context manager: the switch set to ``value`` inside, restored after.

    Examples
    --------
    >>> import torch, kernapprox as ka
    >>> from kernapprox.estimators import fused
    >>> est = ka.make_estimator("positive", num_features=8, rng=0).fit(torch.zeros(1, 4))
    >>> with fused.mode("off"):                       # the eager reference, whatever the size
    ...     phi, log_scale = est.features(torch.ones(3, 4), log_scale=True)
    >>> phi.shape, log_scale.shape
    (torch.Size([3, 8]), torch.Size([3]))
    """
    with backends.mode("fused", value):
        yield


def cxx_compiler() -> str | None:
    """The C++ compiler on ``PATH``: ``$CXX`` if set, else the first of ``g++``, ``c++``, ``clang++``; None if
    none is found (read afresh on every call)."""
    cxx = os.environ.get("CXX")
    return next((c for c in ([cxx] if cxx else ["g++", "c++", "clang++"]) if shutil.which(c)), None)


@functools.cache
def _compiler_available(device_type: str) -> tuple[bool, str]:
    if not hasattr(torch, "compile"):
        return False, "torch.compile is missing (torch < 2.0)"
    if device_type == "cpu":
        found = cxx_compiler()
        return (True, f"C++ compiler {found}") if found else (False, "no C++ compiler on PATH (CXX, g++, clang++)")
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return False, "torch.utils._triton is missing"
        return (True, "triton") if has_triton() else (False, "triton is not installed")
    return False, f"no fused kernels for device type {device_type!r}"


def available(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether :func:`torch.compile` can build kernels for ``device``, and why (or why not)."""
    return _compiler_available(torch.device(device).type)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def use_fused(x: torch.Tensor, entries: int, kernel: str, *params: torch.Tensor) -> bool:
    """Whether a call of ``kernel`` on ``x`` producing ``entries`` feature entries runs fused (the switch above),
    chosen by :func:`kernapprox.backends.choose` (and recorded there)."""
    return backends.choose(f"features.{kernel}", x=x, entries=entries, kernel=kernel, params=params).backend == "fused"


def _fused_check(x, entries, kernel, params) -> tuple[bool, str]:
    switch = get_mode()
    if switch == "off":
        return False, "KERNAPPROX_FUSED=off"
    if _compiling():
        return False, "inside torch.compile (the outer compilation fuses the eager code)"
    if _KERNELS[kernel].failed is not None:
        return False, f"disabled after a failure: {_KERNELS[kernel].failed}"
    if switch == "on":
        return True, "KERNAPPROX_FUSED=on"
    if entries < MIN_ENTRIES:
        return False, f"{entries} feature entries < MIN_ENTRIES"
    if x.dtype != torch.float32:
        return False, f"dtype {x.dtype} (fused in auto mode for float32 only)"
    if entries > MAX_ENTRIES.get((kernel, x.device.type), entries):
        return False, "above MAX_ENTRIES, where the compiled kernel was measured slower"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False, "gradients needed (auto mode fuses calls without gradients)"
    ok, why = available(x.device)
    if not ok:
        return False, why
    k = _KERNELS[kernel]
    device = x.device.type
    if switch == "large" or k.verified:
        return True, "KERNAPPROX_FUSED=large" if switch == "large" else "compiled and verified in this process"
    k.eager_entries[device] = k.eager_entries.get(device, 0) + entries
    if k.eager_entries[device] > WARMUP_ENTRIES.get(device, WARMUP_ENTRIES["cuda"]):
        return True, "the eager work so far pays for the compilation (WARMUP_ENTRIES)"
    return False, "warming up: the eager work so far does not yet pay for a compilation (WARMUP_ENTRIES)"


for _kernel in ("exponential", "trigonometric"):
    backends.register(backends.Backend("fused", f"features.{_kernel}", 10, _fused_check, "fused",
                                       "torch.compile'd epilogue (C++ on a CPU, Triton on a GPU)"))
    backends.register(backends.Backend("eager", f"features.{_kernel}", 0, lambda **call: (True, "eager code"),
                                       None, "the eager torch code"))


# --------------------------------------------------------------------------------------------------- kernels
# Each kernel is an epilogue: it takes the projection ``p`` (N, m) that a library GEMM computed (into a buffer the
# caller may reuse block after block), the rows ``x`` (N, d) and a few numbers as a tensor, and turns ``p`` into the
# stabilised features. The in-place variant (no gradient) overwrites ``p``; the functional one (autograd) returns
# new tensors.
def _exp_nonpositive(t):
    """``exp(t)`` for ``t ≤ 0`` with results below the dtype's smallest normal number flushed to 0: a subnormal
    result costs a CPU's vector ``exp`` about 16 times an ordinary one (measured), and such a term is below the
    rounding of any sum of stabilised features it enters (which :mod:`kernapprox.attention.logdomain` accounts
    for: a lost term is below ``tiny``)."""
    low = math.log(torch.finfo(t.dtype).tiny) + 0.01
    return torch.where(t < low, 0.0, torch.exp(torch.clamp_min(t, low)))


def _log_scale(shift, x, scalars):
    """``ℓ = max p + c − k·½‖x‖²`` with ``scalars = [c, eps, k]`` (``k`` is 0 or 1; with ``k = 0`` the norm is not
    used at all, not even as ``0·∞``)."""
    norm = torch.where(scalars[2] == 0, 0.0, scalars[2] * 0.5 * (x * x).sum(-1))
    return shift + scalars[0] - norm


def stabilised_exp_(proj, x, scalars):
    """In place: ``p ← exp(p − max_j p_j) + eps`` row by row; returns ``ℓ`` (:func:`_log_scale`)."""
    shift = proj.amax(-1, keepdim=True)
    proj.copy_(_exp_nonpositive(proj - shift) + scalars[1])
    return _log_scale(shift.squeeze(-1), x, scalars)


def stabilised_exp(proj, x, scalars):
    """:func:`stabilised_exp_` without the mutation: ``(φ̃, ℓ)``."""
    shift = proj.amax(-1, keepdim=True)
    return _exp_nonpositive(proj - shift) + scalars[1], _log_scale(shift.squeeze(-1), x, scalars)


def sincos_(proj, x, scalars, phi):
    """Into ``phi`` (N, 2m): ``(sin p, cos p)``; returns ``½‖x‖² + c`` (``scalars = [c]``)."""
    m = proj.shape[-1]
    phi[:, :m].copy_(torch.sin(proj))
    phi[:, m:].copy_(torch.cos(proj))
    return 0.5 * (x * x).sum(-1) + scalars[0]


def sincos(proj, x, scalars):
    """:func:`sincos_` without the mutation: ``(φ̃, ℓ)``."""
    return torch.cat([torch.sin(proj), torch.cos(proj)], -1), 0.5 * (x * x).sum(-1) + scalars[0]


def _close(fused_out, eager_out, scale) -> bool:
    """Agreement to rounding: every entry within ``64·ε·scale`` (``scale`` bounds the entries' magnitude and the
    amplification of a rounding of the kernel's input), NaN where the other is NaN."""
    eps = torch.finfo(eager_out.dtype).eps
    got, ref = fused_out.detach(), eager_out.detach()
    both_nan = torch.isnan(got) & torch.isnan(ref)
    return bool(((((got - ref).abs()) <= 64 * eps * scale) | both_nan | (got == ref)).all())


def _verify_exp(proj, x, scalars, got):
    """``got = (φ̃, ℓ)`` of the first rows against the eager epilogue on their projection ``proj``."""
    phi, logs = stabilised_exp(proj, x, scalars)
    size = 1.0 + logs.detach().abs() + 0.5 * (x * x).sum(-1).detach() + float(scalars[0].abs())
    return _close(got[0], phi, 1.0 + float(scalars[1].abs())) and _close(got[1], logs, size)


def _verify_sincos(proj, x, scalars, got):
    phi, logs = sincos(proj, x, scalars)
    size = 1.0 + logs.detach().abs() + 0.5 * (x * x).sum(-1).detach()
    return _close(got[0], phi, 1.0 + proj.detach().abs().amax(-1, keepdim=True)) and _close(got[1], logs, size)


class _Kernel:
    """A kernel's eager functions (in place and functional), their compiled versions (built on first use) and the
    kernel's state in this process."""

    def __init__(self, name, inplace, functional, verify):
        self.name, self.fns, self.verify = name, {"inplace": inplace, "functional": functional}, verify
        self.compiled: dict = {}
        self.failed: str | None = None
        self.verified: set = set()
        self.compile_s: dict[str, float] = {}
        self.eager_entries: dict[str, int] = {}       # auto mode: entries of large calls computed eagerly so far

    def _compile(self, variant):
        if variant not in self.compiled:
            self.compiled[variant] = torch.compile(self.fns[variant], dynamic=True, backend=_BACKEND,
                                                   **({"options": {"cpp.dynamic_threads": True}}
                                                      if _BACKEND == "inductor" else {}))
        return self.compiled[variant]

    def disable(self, reason: str):
        self.failed = reason
        warnings.warn(f"kernapprox: the fused {self.name} feature kernel is disabled for this process "
                      f"({reason}); the eager code runs instead (set KERNAPPROX_FUSED=off to silence this)",
                      RuntimeWarning, stacklevel=5)

    def __call__(self, grad: bool, proj, x, scalars, *out):
        """``(φ̃, ℓ)``, or None after a failure (the caller runs the eager code). In place: ``proj`` (or ``out``)
        receives the features."""
        variant = "functional" if grad else "inplace"
        key = (proj.device.type, proj.dtype, variant)
        first = key not in self.verified
        try:
            start = time.perf_counter()
            head = None
            if first:                           # what the first rows looked like, for the check against eager
                head = (proj[:_VERIFY_ROWS].detach().clone(), x[:_VERIFY_ROWS].detach(), scalars)
            with contextlib.nullcontext() if grad else torch.no_grad():
                result = self._compile(variant)(proj, x, scalars, *out)
            if grad:
                phi, logs = result
            else:
                phi, logs = (out[0] if out else proj), result
            if first:
                self.compile_s[f"{key[0]}/{str(key[1]).removeprefix('torch.')}{'/grad' if grad else ''}"] = (
                    time.perf_counter() - start)
                with torch.no_grad():
                    ok = self.verify(*head, (phi[:_VERIFY_ROWS], logs[:_VERIFY_ROWS]))
                if not ok:
                    raise _Mismatch("its first result differs from the eager kernel beyond rounding")
                self.verified.add(key)
            return phi, logs
        except Exception as exc:  # noqa: BLE001 - any compiler or runtime failure means: run the eager code
            self.disable(_describe(exc))
            return None


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause of a compiler error (dynamo wraps the backend's exception)."""
    root = exc
    while getattr(root, "inner_exception", None) is not None or root.__cause__ is not None:
        root = getattr(root, "inner_exception", None) or root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:300]


class _Mismatch(RuntimeError):
    pass


# The torch.compile backend: "inductor" (fused C++ / Triton). Tests may set "aot_eager" to trace without code
# generation (cheap), which checks the dispatch and the traced graphs but not the generated code.
_BACKEND = "inductor"

_KERNELS = {"exponential": _Kernel("exponential", stabilised_exp_, stabilised_exp, _verify_exp),
            "trigonometric": _Kernel("trigonometric", sincos_, sincos, _verify_sincos)}


# ------------------------------------------------------------------------------------------ feature maps
def _grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _into(buffer, shape, like):
    """``buffer`` viewed as ``shape`` if it fits (same dtype and device, contiguous, exactly that many entries),
    else None (the product allocates)."""
    if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device or not buffer.is_contiguous():
        return None
    return buffer.view(shape) if buffer.numel() == math.prod(shape) else None


def exponential_features(x, weight, offset, scalars, buffer=None):
    """Fused ``(φ̃, ℓ)`` of the exponential form for rows ``x`` (N, d): ``p = xWᵀ + o`` by a library GEMM (into
    ``buffer`` when given and no gradient is needed), then the compiled :func:`stabilised_exp_`. ``offset`` may
    be None (zero); ``scalars = [c, eps, k]``. None when the kernel is unavailable (run the eager code)."""
    grad = _grad(x, weight, offset)
    out = None if grad else _into(buffer, (x.shape[0], weight.shape[0]), x)
    if offset is None:
        proj = torch.mm(x, weight.T) if out is None else torch.mm(x, weight.T, out=out)
    else:
        proj = torch.addmm(offset, x, weight.T) if out is None else torch.addmm(offset, x, weight.T, out=out)
    return _KERNELS["exponential"](grad, proj, x, scalars)


def trigonometric_features(x, weight, scalars, buffer=None):
    """Fused ``(φ̃, ℓ)`` of the trigonometric form: ``p = xWᵀ``, then the compiled :func:`sincos_` into
    ``buffer`` (or a new tensor). None when the kernel is unavailable."""
    grad = _grad(x, weight)
    proj = x @ weight.T
    if grad:
        return _KERNELS["trigonometric"](True, proj, x, scalars)
    shape = (x.shape[0], 2 * weight.shape[0])
    out = _into(buffer, shape, x)
    return _KERNELS["trigonometric"](False, proj, x, scalars, torch.empty(shape, dtype=x.dtype, device=x.device)
                                     if out is None else out)


def nystrom_features(x, landmarks, half_sq_norms, whitening, scalars, buffer=None):
    """Fused ``(φ̃, ℓ)`` of the Nyström form: ``p = xZᵀ − h`` (GEMM), the compiled :func:`stabilised_exp_`
    (``scalars = [0, 0, 0]``: ``ℓ = max p``), then ``φ̃ = e G^{+1/2}`` (GEMM into ``buffer`` when given). None
    when the kernel is unavailable."""
    grad = _grad(x)
    proj = torch.addmm(-half_sq_norms, x, landmarks.T)
    result = _KERNELS["exponential"](grad, proj, x, scalars)
    if result is None:
        return None
    e, logs = result
    out = None if grad else _into(buffer, (x.shape[0], whitening.shape[1]), x)
    return (e @ whitening if out is None else torch.mm(e, whitening, out=out)), logs


def status() -> dict:
    """Per kernel: ``"unused"``, ``"compiled"`` or ``"failed: <reason>"``, and the wall time of each variant's
    first call (compilation included, seconds). Also the switch and :func:`available` for the CPU."""
    out = {"mode": get_mode(), "cpu": available("cpu")[1], "min_entries": MIN_ENTRIES}
    for name, k in _KERNELS.items():
        state = f"failed: {k.failed}" if k.failed else ("compiled" if k.verified else "unused")
        out[name] = {"state": state, "first_call_s": dict(k.compile_s), "eager_entries": dict(k.eager_entries)}
    return out


def reset() -> None:
    """Forget compiled kernels, failures and timings (the next fused call compiles again); for tests and
    measurements. Dynamo's own caches are reset too."""
    for k in _KERNELS.values():
        k.compiled, k.failed = {}, None
        k.verified.clear()
        k.compile_s.clear()
        k.eager_entries.clear()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------- helpers
def scalars(owner, key: str, like: torch.Tensor, *values: float) -> torch.Tensor:
    """Python numbers as one small tensor on ``like``'s device (a tensor input, so that a new value never
    triggers a recompilation), cached on the estimator ``owner`` like its other derived tensors."""
    values = tuple(float(v) for v in values)
    return owner._derived(f"fused:{key}{values}", like, lambda: torch.tensor(values, dtype=torch.float64))


def flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(N, d)`` (a view when it can be)."""
    return x.reshape(-1, x.shape[-1])


def unflat(out, batch_shape):
    phi, logs = out
    return phi.reshape(*batch_shape, phi.shape[-1]), logs.reshape(batch_shape)

