"""One backend dispatch: which implementation runs a computation that has several, one switch each, and why.

Three computations of kernapprox have more than one implementation:

``"linear_attention.chunked"``
    the chunked mode of the sum and decay rules (:func:`kernapprox.linear_attention`):

    ============== ======== =================================================================================
    backend        priority runs
    ============== ======== =================================================================================
    ``native-exp`` 30       the compiled CPU operator ``kernapprox::exp_attention``, features computed inside
                            (maps of the :class:`~kernapprox.estimators.base.ExponentialForm`; causal or not)
    ``native``     20       the compiled CPU operator ``kernapprox::chunked_causal`` (causal; any map's features)
    ``cuda``       10       the eager code on a CUDA device (torch's CUDA kernels)
    ``eager``      0        the eager code (any device, dtype, gradients)
    ============== ======== =================================================================================

``"linear_attention.gradient"``
    how the chunked mode's gradient is computed when a call needs one (the sum rule, calls that ask for the output
    only, without an initial or returned state; other calls take ``autograd``):

    ======================= ======== ==========================================================================
    backend                 priority runs
    ======================= ======== ==========================================================================
    ``native-backward-exp`` 30       compiled features, forward and backward (:mod:`kernapprox.attention.native`:
                                     causal, float32 CPU, no padded keys, maps of the exponential form with
                                     ``eps = 0`` and fixed weights; ``KERNAPPROX_NATIVE``)
    ``native-backward``     20       the same with the map's features (and their gradient) by torch (any map)
    ``chunk-backward``      10       when switched on: the backward written out in eager chunks
                                     (:mod:`kernapprox.attention.chunk_grad`, the reference of the compiled one)
    ``autograd``            0        autograd through the eager chunked code (any rule)
    ======================= ======== ==========================================================================

``"features.exponential"``, ``"features.trigonometric"``
    the epilogue of a feature map (row shift and ``exp``, or ``sin``/``cos``): ``fused`` (10, a
    :func:`torch.compile`'d kernel, C++ on a CPU, Triton on a GPU; :mod:`kernapprox.estimators.fused`) or
    ``eager`` (0).

Each call asks :func:`choose`, which tries the backends of the computation from the highest priority down and
takes the first that accepts the call; every backend says why it accepts or declines. The choice is recorded:
:func:`status` gives the switches and the last choice per computation, :func:`record` every choice made inside a
``with`` block. Inside :func:`torch.compile` the choice is made (and recorded) once, when the graph is traced.

Switches
--------
One per mechanism, each an environment variable read at import and a Python call (:func:`set_mode`, the context
manager :func:`mode`):

``KERNAPPROX_NATIVE`` (``"auto"``, ``"on"``, ``"off"``)
    the compiled CPU operators: ``auto`` for eligible calls large enough to pay for the kernel's fixed costs,
    ``on`` for every eligible call, ``off`` never (:mod:`kernapprox.attention.native`).
``KERNAPPROX_FUSED`` (``"auto"``, ``"large"``, ``"on"``, ``"off"``)
    the compiled feature-map epilogues (:mod:`kernapprox.estimators.fused`, whose docstring gives the rules).
``KERNAPPROX_BACKWARD`` (``"off"``, ``"on"``)
    the written-out chunked backward: ``off`` (the default) never, ``on`` for every eligible call. Off by default
    because it is no faster than autograd through the eager code on a CPU (measured at n = 16k, d = 64, r = 256,
    4 heads, 2 threads: forward + backward 1.0 s against 0.95 s) and holds more memory (the whole sequence's
    features); it is the reference for a compiled backward.

Examples
--------
>>> import torch, kernapprox as ka
>>> est = ka.make_estimator("positive", num_features=8, rng=0).fit(torch.zeros(1, 4))
>>> q = k = v = torch.randn(1, 2, 16, 4)
>>> with ka.backends.record() as calls:
...     _ = ka.linear_attention(q, k, v, est, causal=True)
>>> [c.op for c in calls if c.op.startswith("linear")]
['linear_attention.chunked']
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["SWITCHES", "Backend", "Choice", "register", "backends", "choose", "status", "record", "get_mode",
           "set_mode", "mode"]

_ALIASES = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "auto"}


@dataclasses.dataclass(frozen=True)
class Switch:
    """A documented switch: its environment variable and the values it takes (the first is the default)."""

    env: str
    modes: tuple[str, ...]
    doc: str


SWITCHES = {
    "native": Switch("KERNAPPROX_NATIVE", ("auto", "on", "off"), "the compiled CPU operators of the chunked mode"),
    "fused": Switch("KERNAPPROX_FUSED", ("auto", "large", "on", "off"), "the compiled feature-map epilogues"),
    "backward": Switch("KERNAPPROX_BACKWARD", ("off", "on"), "the written-out backward of the chunked mode"),
}


def _initial(name: str) -> str:
    switch = SWITCHES[name]
    raw = os.environ.get(switch.env, switch.modes[0]).strip().lower()
    value = _ALIASES.get(raw, raw)
    if value not in switch.modes:
        warnings.warn(f"{switch.env}={raw!r} is not one of {switch.modes} (or 1/0); using {switch.modes[0]!r}",
                      RuntimeWarning, stacklevel=3)
        return switch.modes[0]
    return value


_MODES = {name: _initial(name) for name in SWITCHES}


def _check_switch(name) -> Switch:
    if name not in SWITCHES:
        raise ValueError(f"switch must be one of {tuple(SWITCHES)}, got {name!r}")
    return SWITCHES[name]


def get_mode(switch: str) -> str:
    """The current value of ``switch`` (``"native"`` or ``"fused"``)."""
    _check_switch(switch)
    return _MODES[switch]


def set_mode(switch: str, value: str) -> str:
    """Set ``switch`` to ``value`` for the process; returns the previous value."""
    spec = _check_switch(switch)
    if not isinstance(value, str) or value not in spec.modes:
        raise ValueError(f"{spec.env}: mode must be one of {spec.modes}, got {value!r}")
    previous, _MODES[switch] = _MODES[switch], value
    return previous


@contextlib.contextmanager
def mode(switch: str, value: str):
    """Context manager: ``switch`` set to ``value`` inside, restored after."""
    previous = set_mode(switch, value)
    try:
        yield
    finally:
        set_mode(switch, previous)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of a computation ``op``.

    ``check(**call)`` returns ``(accepted, reason)`` for a call's description (its keywords are the computation's,
    e.g. ``device``, ``dtype``, ``needs_grad``); ``switch`` names the switch that governs it (None: always on).
    """

    name: str
    op: str
    priority: int
    check: Callable[..., tuple[bool, str]]
    switch: str | None = None
    description: str = ""


class Choice(NamedTuple):
    """The backend a call ran, why, and why each backend of higher priority declined it."""

    op: str
    backend: str
    reason: str
    declined: tuple[tuple[str, str], ...] = ()


_REGISTRY: dict[str, dict[str, Backend]] = {}
_ORDERED: dict[str, tuple[Backend, ...]] = {}      # per op, highest priority first (sorted once, at registration)
_LAST: dict[str, Choice] = {}
_RECORDERS: list[list[Choice]] = []


def register(backend: Backend) -> Backend:
    """Add (or replace, by name) a backend of ``backend.op``."""
    if backend.switch is not None:
        _check_switch(backend.switch)
    _REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    _ORDERED[backend.op] = tuple(sorted(_REGISTRY[backend.op].values(), key=lambda b: -b.priority))
    return backend


def backends(op: str) -> list[Backend]:
    """The backends of ``op``, highest priority first."""
    if op not in _ORDERED:
        raise ValueError(f"op must be one of {sorted(_ORDERED)}, got {op!r}")
    return list(_ORDERED[op])


def choose(op: str, **call) -> Choice:
    """The first backend of ``op`` (by priority) that accepts ``call``, recorded for :func:`status` and
    :func:`record`. Every computation registers an ``eager`` backend that accepts every call."""
    if op not in _ORDERED:
        raise ValueError(f"op must be one of {sorted(_ORDERED)}, got {op!r}")
    declined = []
    for backend in _ORDERED[op]:
        accepted, reason = backend.check(**call)
        if accepted:
            choice = Choice(op, backend.name, reason, tuple(declined))
            _LAST[op] = choice
            for calls in _RECORDERS:
                calls.append(choice)
            return choice
        declined.append((backend.name, reason))
    raise RuntimeError(f"no backend of {op} accepts the call: {declined}")


@contextlib.contextmanager
def record():
    """Context manager yielding the list of every :class:`Choice` made inside it, in call order."""
    calls: list[Choice] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def status() -> dict:
    """The switches (``{name: value}``), the backends of each computation (name, priority, switch) and the last
    choice made for each (a :class:`Choice`, or None before the first call)."""
    return {"switches": dict(_MODES),
            "backends": {op: [(b.name, b.priority, b.switch) for b in _ORDERED[op]] for op in sorted(_ORDERED)},
            "last": {op: _LAST.get(op) for op in sorted(_ORDERED)}}
