"""Compiled CPU operators for the chunked mode of the sum and decay rules (float32), and for the causal sum rule's
gradient.

Kernels in ``_chunked.cpp``, registered with torch's dispatcher as operators of the ``kernapprox`` namespace, each
equal to the eager chunked code of :mod:`kernapprox.attention.linear` to float rounding (tests/attention/test_native.py,
tests/attention/test_native_backward.py):

``torch.ops.kernapprox.chunked_causal`` (:func:`chunk_block`)
    The eager causal chunked mode batches each token block's chunks into a few large products, which makes it
    materialise every chunk's summary and state (``(d_v+1) × r`` each: more bytes than the chunk's features when
    ``C`` is small) and run a dozen element-wise passes per block. The kernel runs the same recurrence chunk by
    chunk instead (Yang et al. 2024, "Gated Linear Attention", sec. 3.2, with the log-domain shifts of
    :mod:`kernapprox.attention.linear`): the state stays in cache, the state read and the intra-chunk scores come
    out of one single-threaded matrix product ``φ(Q_j) [Sᵀ; φ(K_j)]ᵀ``. Features come in (any map's).
``torch.ops.kernapprox.exp_attention`` (:func:`noncausal`, :func:`causal_exp`)
    The same with the feature map computed inside the kernel, :data:`NONCAUSAL_BLOCK` tokens at a time while they
    are in cache, for maps of the exponential form (:meth:`~kernapprox.estimators.base.FeatureMap.exponential_form`
    not None: FAVOR+, hyperbolic, the GERF family): the projection GEMM, the row shift and ``exp``, then the
    summary or read GEMM. Non-causal: ``Y = φ(Q)(φ(K)ᵀ[V 1])`` (Katharopoulos et al. 2020, eq. 4–6), key weights and
    the normaliser's sums folded into the same pass; causal: the chunk loop above, per feature block.
``torch.ops.kernapprox.chunked_causal_backward`` (:func:`chunk_backward`)
    The gradient of the causal sum rule's output with respect to the stabilised features, the key log-scales and
    the values: the sums of :mod:`.chunk_grad` (Katharopoulos et al. 2020, sec. 3.3.1) run chunk by chunk, a
    forward pass with the state ``S_J`` in cache for ``∂φ̃_q`` and a backward pass with the reverse state ``R_J``
    for ``∂φ̃_k``, ``∂v`` and ``∂ℓ_k``, from the forward's normalisers and row shifts.
``torch.ops.kernapprox.exp_features`` (:class:`ExpCausalSum`'s forward)
    The stabilised features of a map of the exponential form, :data:`FEATURE_ROWS` rows at a time on torch's
    threads.
``torch.ops.kernapprox.exp_causal_backward`` (:class:`ExpCausalSum`, :func:`exp_causal`)
    The causal backward with the features' backward fused: the chunk loop turns each chunk's feature gradients
    into gradients of the rows while they are in cache, the row shift held constant (exact for ``eps = 0``), so a
    training step of an exponential map stores no ``(n, r)`` gradient.

The sequences (batch × heads) are spread over torch's threads (``at::parallel_for``), each running its products
(``at::cpu::addmm_out`` on views of the kernel's buffers: torch's BLAS through its public API) on its own thread.

When they run
-------------
The backend dispatch (:mod:`kernapprox.backends`, backends ``native-exp`` and ``native`` of
``"linear_attention.chunked"``) takes them for eligible calls, as the switch ``KERNAPPROX_NATIVE`` says: ``"off"``
never; ``"on"`` every eligible call; ``"auto"`` (default) eligible calls of at least :data:`MIN_ENTRIES` feature
entries. Eligible: float32 inputs on a CPU, **no gradient needed** (the operators have no backward: a call whose
inputs require gradients runs the eager code, whose autograd is the reference), the sum or decay rule, at least as
many sequences as torch threads, the operators built and checked in this process; for ``native-exp`` a map of the
exponential form. Inside :func:`torch.compile` the operators are traced as themselves (their fake versions give
the shapes), so a compiled model runs the same kernel.

A call that needs gradients (a training step) asks ``"linear_attention.gradient"`` instead, under the same switch:
``native-backward-exp`` (features, attention and gradient compiled, the features' backward fused: :func:`exp_causal`)
or ``native-backward`` (the map's features and their gradient by torch, any map; then :class:`CausalSum`) take
float32 CPU calls of the causal sum rule's chunked mode that ask for the output only (no initial or returned
state, no parts), without padded keys, with at least as many sequences as torch threads; ``native-backward-exp``
also needs a map of the exponential form with ``eps = 0`` whose weights need no gradient. Every other gradient
call runs autograd through the eager code.

Building and loading
--------------------
The first eligible call builds the source with :func:`torch.utils.cpp_extension.load` (ninja; its file lock makes
concurrent processes wait for one build instead of all compiling), into a folder named by a hash of the source,
the flags and torch's version, below :func:`build_root`: ``$KERNAPPROX_NATIVE_DIR`` if set, else
``<cache root>/native`` (:func:`kernapprox.cache.cache_root`). **Both must be private** (owned by the user, mode
``0700``, no symbolic link; :func:`kernapprox.cache.private_dir` creates them so): a folder another user could
write is refused and nothing in it is ever loaded — there is no fallback to a shared temporary directory. The
loaded operators are checked once per process against a float64 evaluation of the same attention on small
problems (decay, partial chunks, a carried state, padded keys, an offset and ``eps``, more queries than keys), and
the backward operators against float64 autograd through the definitions (partial chunks, key log-scales spread
over ±6; features with an offset and the norm term, a partial block of rows).
Never a crash, never a wrong result: a refused folder, a failed build, load or check disables the operators for
the process with one ``RuntimeWarning`` naming the cause, and the eager code runs. :func:`status` says which.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shutil
import warnings
from pathlib import Path

import torch

from .. import backends
from ..cache import UnsafeCacheError, cache_root, private_dir

SOURCE = Path(__file__).with_name("_chunked.cpp")
# Tokens per block of the non-causal kernel: a block's features (256 × r floats) stay in the L2 cache (blocks of
# 64 to 512 tokens measured within 5 % of each other at r = 256, n = 16k, 8 heads, 2 threads).
NONCAUSAL_BLOCK = 256
# Auto mode runs the operators for calls of at least this many feature entries (batch × tokens × r): a token
# block's worth; below it a call takes well under a millisecond either way.
MIN_ENTRIES = 1 << 18
# Rows per task of the compiled feature map (FEATURE_ROWS in _chunked.cpp): for the self-check's partial block.
FEATURE_ROWS = 256
DIR_ENV = "KERNAPPROX_NATIVE_DIR"
_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
          "AVX2": ["-mavx2", "-mfma"]}


class _State:
    path: str | None = None      # the loaded library (loaded at most once per process: its operators stay)
    ok = False                   # loaded and checked
    failed: str | None = None    # why the operators are disabled in this process


def _prerequisites() -> tuple[bool, str]:
    """Whether the operators can be built here at all (nothing is compiled), and why not."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False, f"no build flags for {platform.machine()}"
    if "OpenMP" not in torch.__config__.parallel_info():
        return False, "PyTorch's parallel backend is not OpenMP"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except (ImportError, RuntimeError) as exc:
        return False, f"ninja is not available ({exc})"
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return False, f"no C++ compiler ({compiler!r}; set CXX)"
    return True, "C++ compiler, ninja and OpenMP found"


def build_root() -> Path:
    """The private folder that holds the builds: ``$KERNAPPROX_NATIVE_DIR``, else ``<cache root>/native``; created
    with mode 0700 if missing; :class:`~kernapprox.cache.UnsafeCacheError` if it exists and is not private."""
    override = os.environ.get(DIR_ENV)
    return private_dir(Path(override) if override else cache_root() / "native")


def _flags() -> list[str]:
    return ["-O3", *_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []), "-fopenmp"]


def _build_dir() -> Path:
    """``build_root()/<hash of source, flags, torch>``, private like its parent."""
    digest = hashlib.sha256(SOURCE.read_bytes() + "\0".join(
        [*_flags(), torch.__version__, os.environ.get("CXX", "")]).encode()).hexdigest()[:16]
    return private_dir(build_root() / digest)


def _load() -> bool:
    """Whether the operators are loaded and checked (building and loading them on the first call)."""
    if _State.ok or _State.failed is not None:
        return _State.ok
    ok, why = _prerequisites()
    if not ok:
        _State.failed = why             # nothing to warn about: the operators are simply not available here
        return False
    try:
        if _State.path is None:
            from torch.utils import cpp_extension

            folder = _build_dir()
            cpp_extension.load(name="kernapprox_chunked", sources=[str(SOURCE)], extra_cflags=_flags(),
                               extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                               verbose=False)
            _State.path = str(folder / "kernapprox_chunked.so")
            _register_fakes()
        _self_check()
        _State.ok = True
    except UnsafeCacheError as exc:
        disable(f"refused to build or load from a folder that is not private: {exc}")
    except Exception as exc:  # noqa: BLE001 - any build, load or check failure means: run the eager code
        disable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300])
    return _State.ok


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the operators are loaded and checked, building them on the first call (a constant to
    :func:`torch.compile`, which runs it once while tracing)."""
    return _load()


@torch.compiler.assume_constant_result
def _threads() -> int:
    return torch.get_num_threads()


def disable(reason: str) -> None:
    """Disable the operators for the process (the eager code runs), with a ``RuntimeWarning`` naming ``reason``."""
    _State.ok, _State.failed = False, reason
    warnings.warn(f"kernapprox: the compiled chunked kernels are disabled for this process ({reason}); the "
                  "eager code runs instead (set KERNAPPROX_NATIVE=off to silence this)", RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget a failure or a passed check (the next eligible call checks again; a loaded library stays loaded:
    its operators cannot be unregistered); for tests."""
    _State.ok, _State.failed = False, None


def status() -> str:
    """``"unused"``, ``"loaded <path>"``, ``"unavailable: <why>"`` or ``"failed: <why>"``."""
    if _State.ok:
        return f"loaded {_State.path}"
    if _State.failed is not None:
        return f"{'failed' if _prerequisites()[0] else 'unavailable'}: {_State.failed}"
    return "unused"


# ------------------------------------------------------------------------------------------------ dispatch
def _common_check(device, dtype, needs_grad, rule_ok, batch, entries, refused: str | None = None
                  ) -> tuple[bool, str]:
    """Whether a native backend takes a call: the switch, then the caller's refusal (``refused``, the gradient
    backends' reasons; the forward operators name theirs before the switch, as their status lines do), then what
    every operator needs (no autograd through it unless it is a gradient backend, a CPU, float32, the sum or decay
    rule, one sequence per thread, enough entries under ``auto``, the operators built and checked)."""
    switch = backends.get_mode("native")
    if switch == "off":
        return False, "KERNAPPROX_NATIVE=off"
    if refused is not None:
        return False, refused
    if needs_grad:
        return False, "gradients needed (the compiled operators have no backward; the eager code's autograd runs)"
    if device is None or device.type != "cpu":
        return False, f"on {getattr(device, 'type', device)} (CPU operators)"
    if dtype != torch.float32:
        return False, f"dtype {dtype} (float32 operators)"
    if not rule_ok:
        return False, "a rule other than sum and decay"
    threads = _threads()
    if batch < threads:
        return False, f"{batch} sequences < {threads} torch threads (one sequence per thread)"
    if switch != "on" and entries < MIN_ENTRIES:
        return False, f"{entries} feature entries < MIN_ENTRIES = {MIN_ENTRIES} (KERNAPPROX_NATIVE=auto)"
    if not available():
        return False, f"not available: {_State.failed}"
    return True, f"KERNAPPROX_NATIVE={switch}, eligible"


def _check_exp(*, device, dtype, needs_grad, rule_ok, batch, entries, causal, exponential, **_):
    if not exponential:
        return False, "the map has no exponential form (FeatureMap.exponential_form is None)"
    return _common_check(device, dtype, needs_grad, rule_ok, batch, entries)


def _check_causal(*, device, dtype, needs_grad, rule_ok, batch, entries, causal, **_):
    if not causal:
        return False, "non-causal (this operator runs the causal chunk loop)"
    return _common_check(device, dtype, needs_grad, rule_ok, batch, entries)


def _check_backward(*, causal, device=None, dtype=None, batch=0, entries=0, padding=False, **_):
    """Whether ``kernapprox::chunked_causal_backward`` computes a gradient call's backward (``native-backward`` of
    ``"linear_attention.gradient"``; the caller already restricted it to the sum rule's chunked mode without an
    initial or returned state, asking for the output only)."""
    refused = ("non-causal (the compiled backward runs the causal chunk loop)" if not causal
               else "padded keys (the compiled backward takes none)" if padding else None)
    return _common_check(device, dtype, False, True, batch, entries, refused)


def _check_backward_exp(*, form=None, **call):
    """``native-backward-exp``: :func:`_check_backward`, and a map whose features the operators compute and
    differentiate themselves (:class:`ExpCausalSum`): of the exponential form, ``eps = 0`` (the row shift then
    carries no gradient), fixed weight and offset (no gradient asked for them)."""
    if form is None:
        return False, "the map has no exponential form (FeatureMap.exponential_form is None)"
    if form.eps != 0:
        return False, f"the map's eps = {form.eps:g} (its row shift carries gradient; the features run in torch)"
    if any(t is not None and t.requires_grad for t in (form.weight, form.offset)):
        return False, "the map's weight or offset needs a gradient (the features run in torch)"
    return _check_backward(**call)


backends.register(backends.Backend("native-backward-exp", "linear_attention.gradient", 30, _check_backward_exp,
                                   "native", "kernapprox::exp_features, chunked_causal and their backward "
                                   "operators: features, attention and gradient compiled (exponential maps)"))
backends.register(backends.Backend("native-backward", "linear_attention.gradient", 20, _check_backward, "native",
                                   "kernapprox::chunked_causal (forward) and kernapprox::chunked_causal_backward: "
                                   "the causal sum rule's chunk loop and its gradient, features given"))
backends.register(backends.Backend("native-exp", "linear_attention.chunked", 30, _check_exp, "native",
                                   "kernapprox::exp_attention: the chunked mode with the features inside"))
backends.register(backends.Backend("native", "linear_attention.chunked", 20, _check_causal, "native",
                                   "kernapprox::chunked_causal: the causal chunk loop, features given"))


# ------------------------------------------------------------------------------------------------ operators
def _register_fakes() -> None:
    """Shape-only versions of the operators, for torch.compile (they write into their arguments only)."""
    for name in ("chunked_causal", "exp_attention", "exp_nonpos", "chunked_causal_backward", "exp_features",
                 "exp_causal_backward"):
        torch.library.register_fake(f"kernapprox::{name}", lambda *args, **kwargs: None)


def chunk_block(pq, lq, pk, lk, v, state, c, out, den, logs, chunk_size: int, log_decay: float,
                want_num: bool) -> None:
    """Advance ``state``/``c`` in place over one token block and write its rows (``kernapprox::chunked_causal``).

    ``pq, pk`` ``(B, L, r)`` and ``lq, lk`` ``(B, L)`` contiguous float32 stabilised features and log-scales;
    ``v`` ``(B, L, d_v)`` float32 with unit stride in the last dimension; ``state`` ``(B, d_v+1, r)`` contiguous
    (``[W z]ᵀ``), ``c`` ``(B,)`` its log-scale (the empty-state sentinel before the first key); ``out``
    ``(B, L, d_v)`` receives ``num/den`` (or the numerators with ``want_num``), ``den`` and ``logs`` ``(B, L)``
    the normalisers and the rows' log-scales (unit stride in the last dimension).
    """
    torch.ops.kernapprox.chunked_causal(pq, lq, pk, lk, v, state, c, out, den, logs, int(chunk_size),
                                        float(log_decay), bool(want_num))


def chunk_backward(pq, pk, lk, v, y, den, c, gy, chunk_size: int, states=None, scores=None):
    """The gradients ``(dφ̃_q, dφ̃_k, dℓ_k, dv)`` of the causal sum rule's output ``y = num/den`` from its gradient
    ``gy`` (``kernapprox::chunked_causal_backward``; the formulas of :mod:`.chunk_grad`, chunk by chunk with the
    forward state ``S_J`` and the reverse state ``R_J`` in cache).

    ``pq, pk`` ``(B, n, r)``, ``lk, den, c`` ``(B, n)`` (``c`` the forward's row shift, the running maximum of
    ``lk``; ``den`` the normalisers at that shift, none zero), ``v, y, gy`` ``(B, n, d_v)``: float32 CPU tensors
    (made contiguous here). ``states`` ``(B, chunks, d_v+1, r)`` and ``scores`` ``(B, chunks, C, C)``: what the
    forward saved (:class:`CausalSum`: each chunk's state ``S_J`` and weighted intra-chunk scores), or None (the
    backward rebuilds them: one state update and one ``C × C`` score product more per chunk).
    """
    pq, pk, lk, v, y, den, c, gy = (t.contiguous() for t in (pq, pk, lk, v, y, den, c, gy))
    gpq, gpk, glk, gv = torch.empty_like(pq), torch.empty_like(pk), torch.empty_like(lk), torch.empty_like(v)
    torch.ops.kernapprox.chunked_causal_backward(pq, pk, lk, v, y, den, c, gy, gpq, gpk, glk, gv, int(chunk_size),
                                                 states, scores)
    return gpq, gpk, glk, gv


class CausalSum(torch.autograd.Function):
    r"""``(y, den, c) = CausalSum.apply(pq, pk, lk, v, chunk_size)``: the causal sum rule's output on stabilised
    features (``pq, pk`` ``(B, n, r)``, ``lk`` ``(B, n)``, ``v`` ``(B, n, d_v)``, float32 on a CPU),

    .. math::
        y_i = \frac{\sum_{j≤i} φ̃_{q,i}^⊤φ̃_{k,j} e^{ℓ_{k,j} − c_i} v_j}{\sum_{j≤i} φ̃_{q,i}^⊤φ̃_{k,j}
        e^{ℓ_{k,j} − c_i}},

    forward by ``kernapprox::chunked_causal`` (Yang et al. 2024, sec. 3.2), backward by
    ``kernapprox::chunked_causal_backward`` (:func:`chunk_backward`; the sums of :mod:`.chunk_grad`, Katharopoulos
    et al. 2020, sec. 3.3.1). ``den`` (the normalisers) and ``c`` (the row shifts, the running maximum of ``lk``)
    are not differentiable; the output does not depend on the query log-scales, which are not an input. The
    forward keeps each chunk's state and weighted scores for the backward (``(d_v+1)·r + C²`` floats per chunk:
    about one more feature tensor), which then skips rebuilding them."""

    @staticmethod
    def forward(ctx, pq, pk, lk, v, chunk_size):
        """The compiled forward (``kernapprox::chunked_causal``), keeping what the backward reads."""
        pq, pk, lk = pq.contiguous(), pk.contiguous(), lk.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        y, den, c, states, scores = _causal_forward(pq, pk, lk, v, chunk_size)
        safe = torch.where(den == 0, torch.ones(()), den)
        ctx.save_for_backward(pq, pk, lk, v, y, safe, c, states, scores)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(den, c)
        return y, den, c

    @staticmethod
    def backward(ctx, gy, _gden, _gc):
        """The compiled backward (``kernapprox::chunked_causal_backward``): gradients of the features and values."""
        pq, pk, lk, v, y, den, c, states, scores = ctx.saved_tensors
        gy = torch.zeros_like(y) if gy is None else gy
        gpq, gpk, glk, gv = chunk_backward(pq, pk, lk, v, y, den, c, gy, ctx.chunk_size, states, scores)
        return gpq, gpk, glk, gv, None


def _causal_forward(pq, pk, lk, v, chunk_size):
    """``kernapprox::chunked_causal`` from an empty state (``ℓ_q = 0``: the rows' log-scales are the shifts ``c``),
    keeping each chunk's state and weighted scores: ``(y, den, c, states, scores)``."""
    batch, n, r = pq.shape
    d_v = v.shape[-1]
    y, den, c = torch.empty(batch, n, d_v), torch.empty(batch, n), torch.empty(batch, n)
    chunks = -(-n // chunk_size)
    states = torch.empty(batch, chunks, d_v + 1, r)
    scores = torch.empty(batch, chunks, chunk_size, chunk_size)
    torch.ops.kernapprox.chunked_causal(pq, torch.zeros(batch, n), pk, lk, v, torch.zeros(batch, d_v + 1, r),
                                        torch.full((batch,), SENTINEL), y, den, c, int(chunk_size), 0.0, False,
                                        states, scores)
    return y, den, c, states, scores


class ExpCausalSum(torch.autograd.Function):
    r"""``(y, den, c, ℓ_q) = ExpCausalSum.apply(xq, xk, v, maps, chunk_size)``: the stabilised features of both
    maps (``kernapprox::exp_features``),

    .. math::
        p = α\,x W^⊤ + o,\qquad φ̃ = e^{p − \max_j p_j} + \mathrm{eps},\qquad
        ℓ = \max_j p_j + c − k α^2 \|x\|^2 / 2

    (Choromanski et al. 2021, Lemma 1), and :class:`CausalSum` in one function (``xq, xk`` ``(B, n, d)`` rows of
    the forms, ``v`` ``(B, n, d_v)``, ``maps = ((W_q, o_q, scalars_q), (W_k, o_k, scalars_k))``, ``scalars =
    [α, c, eps, k]``), whose backward is one operator,
    ``kernapprox::exp_causal_backward``: :func:`chunk_backward`'s chunk loop turning each chunk's ``∂φ̃`` into
    ``∂x`` while it is in cache (``∂p = ∂φ̃ ⊙ (φ̃ − eps)``, ``∂x = α ∂p W − k α^2 ∂ℓ\, x``, the row shift held
    constant: exact for ``eps = 0``, where ``φ̃ e^ℓ`` does not depend on it), so no ``(n, r)`` gradient is stored.
    ``den``, ``c`` and ``ℓ_q`` are not differentiable (the output depends on neither shift)."""

    @staticmethod
    def forward(ctx, xq, xk, v, maps, chunk_size):
        """Features and the compiled causal forward, keeping what the fused backward reads."""
        (wq, oq, mq), (wk, ok, mk) = maps
        xq, xk = xq.contiguous(), xk.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        batch, n, d = xq.shape
        r = wq.shape[0]
        pq, lq, pk, lk = torch.empty(batch * n, r), torch.empty(batch * n), torch.empty(batch * n, r), \
            torch.empty(batch * n)
        torch.ops.kernapprox.exp_features(xq.view(-1, d), wq, oq, mq, pq, lq)
        torch.ops.kernapprox.exp_features(xk.view(-1, d), wk, ok, mk, pk, lk)
        pq, pk, lk = pq.view(batch, n, r), pk.view(batch, n, r), lk.view(batch, n)
        y, den, c, states, scores = _causal_forward(pq, pk, lk, v, chunk_size)
        safe = torch.where(den == 0, torch.ones(()), den)
        ctx.save_for_backward(xq, xk, pq, pk, lk, v, y, safe, c, states, scores)
        ctx.maps, ctx.chunk_size = ((wq, mq), (wk, mk)), chunk_size
        lq = lq.view(batch, n)
        ctx.mark_non_differentiable(den, c, lq)
        return y, den, c, lq

    @staticmethod
    def backward(ctx, gy, _gden, _gc, _glq):
        """The fused backward (``kernapprox::exp_causal_backward``): gradients of the query and key rows and values."""
        xq, xk, pq, pk, lk, v, y, den, c, states, scores = ctx.saved_tensors
        (wq, mq), (wk, mk) = ctx.maps
        gy = torch.zeros_like(y) if gy is None else gy.contiguous()
        gxq, gxk, gv = torch.empty_like(xq), torch.empty_like(xk), torch.empty_like(y)
        torch.ops.kernapprox.exp_causal_backward(xq, xk, wq, mq, wk, mk, pq, pk, lk, v.contiguous(), y, den, c, gy,
                                                 states, scores, gxq, gxk, gv, int(ctx.chunk_size))
        return gxq, gxk, gv, None, None


def _map_tensors(form):
    return (form.weight.to(torch.float32).contiguous(),
            None if form.offset is None else form.offset.to(torch.float32).contiguous(),
            [float(form.alpha), float(form.log_constant), float(form.eps), float(form.norm)])


def exp_causal(forms, v, chunk_size: int):
    """The causal sum rule's output of the exponential forms ``(query, key)`` (rows ``(..., n, d)``) and values
    ``v`` ``(..., n, d_v)`` by :class:`ExpCausalSum` (differentiable in the rows and ``v``): ``(y, den, c, ℓ_q)``
    shaped like the rows' leading dimensions."""
    rq, rk = forms[0].rows, forms[1].rows
    lead, n, d = rq.shape[:-2], rq.shape[-2], rq.shape[-1]
    y, den, c, lq = ExpCausalSum.apply(rq.reshape(-1, n, d), rk.reshape(-1, n, d), v.reshape(-1, n, v.shape[-1]),
                                       (_map_tensors(forms[0]), _map_tensors(forms[1])), chunk_size)
    return y.reshape(*lead, n, -1), den.reshape(*lead, n), c.reshape(*lead, n), lq.reshape(*lead, n)


def _gemm_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, n, m)`` if a matrix product can read its rows in place (unit stride within a row, rows at least
    ``m`` apart), else a contiguous copy (e.g. of an expanded tensor, whose rows share memory)."""
    return t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous()


def _map_arguments(form):
    """``(rows, W, o or None, [α, c, eps, k])`` of an :class:`~kernapprox.estimators.base.ExponentialForm`, as the
    operator reads them."""
    weight = form.weight.to(torch.float32).contiguous()
    offset = None if form.offset is None else form.offset.to(torch.float32).contiguous()
    return (_gemm_rows(form.rows), weight, offset,
            [float(form.alpha), float(form.log_constant), float(form.eps), float(form.norm)])


def _exp_attention(forms, v, padding, state, c, out, den, logs, log_decay: float, want_num: bool,
                   chunk_size: int, block: int) -> None:
    rq, wq, oq, mq = _map_arguments(forms[0])
    rk, wk, ok, mk = _map_arguments(forms[1])
    pad = None if padding is None else padding.to(torch.bool).contiguous()
    torch.ops.kernapprox.exp_attention(rq, rk, wq, oq, mq, wk, ok, mk, pad, _gemm_rows(v), state, c, out, den, logs,
                                       int(chunk_size), int(block), float(log_decay), bool(want_num))


def noncausal(forms, v, padding, state, c, out, den, logs, log_decay: float, want_num: bool) -> None:
    """Non-causal chunked attention of ``B`` sequences by ``kernapprox::exp_attention``, features included.

    ``forms`` ``(query, key)``: the map's :class:`~kernapprox.estimators.base.ExponentialForm` for the float32
    inputs ``(B, n_q, d)`` and ``(B, n_k, d)``; ``v`` ``(B, n_k, d_v)`` float32; ``padding`` ``(B, n_k)`` bool
    (True: padded) or None; ``state`` ``(B, d_v+1, r)`` contiguous (``[W z]ᵀ``) and ``c`` ``(B,)`` its log-scale
    (the empty-state sentinel when empty), advanced in place over every key; ``out`` ``(B, n_q, d_v)`` receives
    ``num/den`` (or the numerators with ``want_num``), ``den`` and ``logs`` ``(B, n_q)`` the normalisers and the
    rows' log-scales (unit stride in the last dimension).
    """
    _exp_attention(forms, v, padding, state, c, out, den, logs, log_decay, want_num, 0, NONCAUSAL_BLOCK)


def feature_block(chunk_size: int) -> int:
    """Tokens per feature block of the causal kernel with features inside: the multiple of ``chunk_size`` nearest
    below :data:`NONCAUSAL_BLOCK` (at least one chunk), so that chunks start where the eager code starts them."""
    return max(chunk_size, NONCAUSAL_BLOCK // chunk_size * chunk_size)


def causal_exp(forms, v, padding, state, c, out, den, logs, chunk_size: int, log_decay: float,
               want_num: bool) -> None:
    """Causal chunked attention by ``kernapprox::exp_attention``, with the features of a map of the exponential
    form computed inside it, :func:`feature_block` tokens at a time (arguments as for :func:`noncausal`;
    ``n_q = n_k``)."""
    _exp_attention(forms, v, padding, state, c, out, den, logs, log_decay, want_num, chunk_size,
                   feature_block(chunk_size))


def exp_nonpositive(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out ← exp(src)`` by the kernels' vectorised ``exp`` (arguments ``≤ 0``; results below the smallest normal
    float flushed to 0), on torch's threads: what the benchmarks' roofline measures as the kernels' ``exp`` rate.
    Contiguous float32 CPU tensors of one size; the operators must be available (:func:`available`)."""
    for name, t in (("src", src), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if src.numel() != out.numel():
        raise ValueError(f"src and out differ in size: {src.numel()} and {out.numel()}")
    if not _State.ok:
        raise RuntimeError(f"the compiled kernels are not loaded ({status()})")
    torch.ops.kernapprox.exp_nonpos(src, out)
    return out


# ---------------------------------------------------------------------------------------------- self-check
SENTINEL = -1e30     # the empty state's log-scale (kernapprox.rules.SENTINEL; checked equal in tests)


def _self_check() -> None:
    # the first eligible call may come under torch.no_grad() or torch.inference_mode() (inference): the backward's
    # check needs autograd, so every check runs with gradients enabled, outside inference mode
    with torch.inference_mode(False), torch.enable_grad():
        _self_checks()


def _self_checks() -> None:
    _self_check_causal()
    _self_check_exp(causal=False)
    _self_check_exp(causal=True)
    _self_check_backward()
    _self_check_fused()


def _reference(pq, lq, pk, lk, v, causal, a, state0):
    """Float64 attention by its definition, with every weight at one reference log-scale per row:
    ``A_ij = φ̃(q_i)ᵀφ̃(k_j) e^{ℓ(q_i) + ℓ(k_j) + λ_ij a}`` (``λ_ij = i − j``, ``j ≤ i``, when causal; ``n_k − 1 − j``
    when not) plus the carried state ``(W₀, z₀, c₀)`` at ``e^{ℓ(q_i) + c₀ + μ_i a}`` (``μ_i = i + 1`` causal,
    ``n_k`` not); the final state ``Σ_j e^{ℓ(k_j) + (n_k−1−j) a} φ̃(k_j)[v_j 1]ᵀ + e^{c₀ + n_k a}[W₀ z₀]``.
    Returns the output, the normalisers and the state, each with its log-scale: ``(out, den, log_den, S,
    log_S)``."""
    w0, z0, c0 = (t.double() for t in state0)
    pq, lq, pk, lk, v = (t.double() for t in (pq, lq, pk, lk, v))
    n_q, n_k = pq.shape[1], pk.shape[1]
    i = torch.arange(n_q, dtype=torch.float64)[:, None]
    j = torch.arange(n_k, dtype=torch.float64)[None, :]
    lag = (i - j) if causal else (n_k - 1 - j).expand(n_q, n_k)
    expo = lk[:, None, :] + lag * a
    if causal:
        expo = expo.masked_fill(j > i, -math.inf)
    carried = c0[:, None] + ((i[:, 0] + 1) if causal else torch.full((n_q,), float(n_k), dtype=torch.float64)) * a
    row = torch.maximum(expo.amax(-1), carried)                           # the row's reference log-scale
    weights = (pq @ pk.transpose(-1, -2)) * torch.exp(expo - row[..., None])
    f = torch.exp(carried - row)[..., None]
    num = weights @ v + (pq @ w0) * f
    den = weights.sum(-1) + (pq @ z0[..., None]).squeeze(-1) * f[..., 0]
    key = lk + (n_k - 1 - torch.arange(n_k, dtype=torch.float64)) * a
    log_s = torch.maximum(key.amax(-1), c0 + n_k * a)
    wk = torch.exp(key - log_s[:, None])[..., None]
    s = (torch.cat([v, torch.ones_like(v[..., :1])], -1) * wk).transpose(-1, -2) @ pk
    s = s + torch.cat([w0, z0[..., None]], -1).transpose(-1, -2) * torch.exp(c0 + n_k * a - log_s)[:, None, None]
    return num / den[..., None], den, lq + row, s, log_s


def _agrees(label, run, feats, v, state0, causal, a):
    """Run ``run(state, c, out, den, logs)`` (an operator on the problem whose float64 features are ``feats = (pq,
    lq, pk, lk)``) from the carried state ``state0 = (w, z, c)``, and raise unless its outputs, normalisers and
    final state agree with :func:`_reference` (the normalisers and the state compared at one log-scale)."""
    w0, z0, c0 = state0
    batch, n_q, d_v = feats[0].shape[0], feats[0].shape[1], v.shape[-1]
    want_out, want_den, log_den, want_state, log_state = _reference(*feats, v, causal, a, state0)
    state = torch.cat([w0, z0[..., None]], -1).transpose(-1, -2).contiguous()
    c = c0.clone()
    out, got_den, got_logs = torch.empty(batch, n_q, d_v), torch.empty(batch, n_q), torch.empty(batch, n_q)
    run(state, c, out, got_den, got_logs)
    checks = {"outputs": (out.double(), want_out),
              "normalisers": (got_den.double() * torch.exp(got_logs.double() - log_den), want_den),
              "state": (state.double() * torch.exp(c.double() - log_state)[:, None, None], want_state)}
    for name, (got, want) in checks.items():
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"self-check: {label} {name} differ from the float64 reference by "
                               f"{float((got - want).abs().max()):.3g}")


def _random_state(gen, batch, r, d_v, shift=0.0):
    return (torch.rand(batch, r, d_v, generator=gen), torch.rand(batch, r, generator=gen),
            torch.randn(batch, generator=gen) + shift)


def _self_check_causal() -> None:
    """The causal operator (features given) on a small problem: decay, a partial chunk, a carried state."""
    gen = torch.Generator().manual_seed(0)
    batch, n, r, d_v, size, a = 3, 21, 12, 5, 4, -0.05
    pq, pk = torch.rand(batch, n, r, generator=gen), torch.rand(batch, n, r, generator=gen)
    lq, lk = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)
    v = torch.randn(batch, n, d_v, generator=gen)
    state0 = _random_state(gen, batch, r, d_v)
    _agrees("the causal operator's", lambda state, c, out, den, logs: chunk_block(
        pq, lq, pk, lk, v, state, c, out, den, logs, size, a, want_num=False), (pq, lq, pk, lk), v, state0, True, a)


def _check_form(gen, x, d, r):
    """A map of the exponential form with fixed random parameters, and its float64 features ``(φ̃, ℓ)``."""
    from ..estimators.base import ExponentialForm

    weight, offset = torch.randn(r, d, generator=gen), 0.3 * torch.randn(r, generator=gen)
    form = ExponentialForm(x, 0.7, weight, offset, -1.5, 1e-3, 1.0)
    p = form.alpha * x.double() @ weight.double().T + offset.double()
    shift = p.amax(-1)
    norm = form.norm * 0.5 * form.alpha ** 2 * (x.double() ** 2).sum(-1)
    return form, torch.exp(p - shift[..., None]) + form.eps, shift + form.log_constant - norm


def _self_check_exp(causal: bool) -> None:
    """The operator that computes the features itself: decay, padded keys, a carried state, an offset and eps;
    non-causal with more queries than keys and a partial block, causal over two feature blocks and a partial
    chunk."""
    gen = torch.Generator().manual_seed(2 if causal else 1)
    size, d, r, d_v, a = 8, 6, 10, 5, (-0.02 if causal else -0.01)
    if causal:
        batch, n_q = 2, feature_block(size) + 2 * size + 3
        n_k = n_q
    else:
        batch, n_q, n_k = 3, NONCAUSAL_BLOCK + 7, NONCAUSAL_BLOCK - 5
    xq, xk = torch.randn(batch, n_q, d, generator=gen), torch.randn(batch, n_k, d, generator=gen)
    state_gen = torch.Generator().manual_seed(3)
    fq, pq, lq = _check_form(torch.Generator().manual_seed(4), xq, d, r)
    fk, pk, lk = _check_form(torch.Generator().manual_seed(4), xk, d, r)      # one map for queries and keys
    v = torch.randn(batch, n_k, d_v, generator=gen)
    padding = torch.rand(batch, n_k, generator=gen) < 0.2
    state0 = _random_state(state_gen, batch, r, d_v, shift=2.0)
    pk, lk = pk.masked_fill(padding[..., None], 0.0), lk.masked_fill(padding, SENTINEL)

    def run(state, c, out, den, logs):
        if causal:
            causal_exp((fq, fk), v, padding, state, c, out, den, logs, size, a, want_num=False)
        else:
            noncausal((fq, fk), v, padding, state, c, out, den, logs, a, want_num=False)

    _agrees("the causal operator's (features inside)" if causal else "the non-causal operator's", run,
            (pq, lq, pk, lk), v, state0, causal, a)


def _self_check_backward() -> None:
    """The compiled backward (through :class:`CausalSum`) against float64 autograd through the definition, on a
    small problem: a partial last chunk, key log-scales spread over ±6 (rows whose shift changes inside a chunk)."""
    gen = torch.Generator().manual_seed(5)
    batch, n, r, d_v, size = 3, 23, 12, 5, 4
    pq, pk = torch.rand(batch, n, r, generator=gen) + 0.05, torch.rand(batch, n, r, generator=gen) + 0.05
    lk = 3 * torch.randn(batch, n, generator=gen)
    v, gy = torch.randn(batch, n, d_v, generator=gen), torch.randn(batch, n, d_v, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (pq, pk, lk, v)]
    y, _, _ = CausalSum.apply(*leaves, size)
    torch.autograd.backward(y, gy)
    ref = [t.double().requires_grad_() for t in (pq, pk, lk, v)]
    q64, k64, l64, v64 = ref
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    shift = torch.cummax(l64.detach(), -1).values
    weights = (q64 @ k64.transpose(-1, -2) * torch.exp(l64[:, None, :] - shift[..., None])).masked_fill(~causal, 0)
    want_y = (weights @ v64) / weights.sum(-1, keepdim=True)
    torch.autograd.backward(want_y, gy.double())
    checks = {"outputs": (y.detach(), want_y.detach())}
    checks.update({f"gradients of {name}": (got.grad, want.grad)
                   for name, got, want in zip(("pq", "pk", "lk", "v"), leaves, ref)})
    # the backward without the forward's saved states and scores (it rebuilds them), from the float64 normalisers
    den = (weights.sum(-1) * torch.exp(shift - torch.cummax(lk.double(), -1).values)).detach().float()
    rebuilt = chunk_backward(pq, pk, lk, v, want_y.detach().float(), den, torch.cummax(lk, -1).values, gy, size)
    checks.update({f"gradients of {name} (states rebuilt)": (got, want.grad)
                   for name, got, want in zip(("pq", "pk", "lk", "v"), rebuilt, ref)})
    for name, (got, want) in checks.items():
        scale = float(want.abs().max())
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5 * scale):
            raise RuntimeError(f"self-check: the causal backward's {name} differ from the float64 reference by "
                               f"{float((got.double() - want).abs().max()):.3g} (largest {scale:.3g})")


def _self_check_fused() -> None:
    """Features, attention and the fused backward (:class:`ExpCausalSum`) against float64 autograd through the
    definitions (each map's features with its shift detached, then causal attention): two maps with offsets and the
    norm term, a partial last chunk."""
    gen = torch.Generator().manual_seed(7)
    batch, n, d, r, d_v, size = 3, 19, 5, 9, 4, 4
    xq, xk = torch.randn(batch, n, d, generator=gen), torch.randn(batch, n, d, generator=gen)
    v, gy = torch.randn(batch, n, d_v, generator=gen), torch.randn(batch, n, d_v, generator=gen)
    maps = tuple((torch.randn(r, d, generator=gen), 0.3 * torch.randn(r, generator=gen), [0.6, -1.0, 0.0, 1.0])
                 for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (xq, xk, v)]
    y, *_ = ExpCausalSum.apply(*leaves, maps, size)
    torch.autograd.backward(y, gy)
    ref = [t.double().requires_grad_() for t in (xq, xk, v)]

    def features(x, weight, offset, scalars):
        alpha, const, _, norm = scalars
        p = alpha * x @ weight.double().T + offset.double()
        shift = p.detach().amax(-1)
        return torch.exp(p - shift[..., None]), shift + const - norm * 0.5 * alpha ** 2 * (x ** 2).sum(-1)

    (pq, _), (pk, lk) = features(ref[0], *maps[0]), features(ref[1], *maps[1])
    past = torch.ones(n, n, dtype=torch.bool).tril()
    shift = torch.cummax(lk.detach(), -1).values
    weights = (pq @ pk.transpose(-1, -2) * torch.exp(lk[:, None, :] - shift[..., None])).masked_fill(~past, 0)
    want_y = (weights @ ref[2]) / weights.sum(-1, keepdim=True)
    torch.autograd.backward(want_y, gy.double())
    checks = {"outputs": (y.detach(), want_y.detach())}
    checks.update({f"gradients of {name}": (got.grad, want.grad) for name, got, want in zip("qkv", leaves, ref)})
    for name, (got, want) in checks.items():
        scale = float(want.abs().max())
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5 * scale):
            raise RuntimeError(f"self-check: the fused features and causal backward's {name} differ from the float64 "
                               f"reference by {float((got.double() - want).abs().max()):.3g} (largest {scale:.3g})")
