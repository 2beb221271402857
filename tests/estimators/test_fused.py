"""Fused feature maps (:mod:`kernapprox.estimators.fused`): the switch, the fallback, and fused = eager to rounding.

What the default suite covers, and what it leaves to ``-m slow``:

* the switch (``KERNAPPROX_FUSED``, :func:`set_mode`, :func:`mode`) and the auto policy (size, dtype, gradients,
  availability, outer compilation), without compiling anything;
* the fallback: a compiler that fails, and one that compiles a wrong kernel (caught by the first-call check), both
  give the eager result and one warning;
* every map of the three forms (exponential: positive, hyperbolic, GERF, OPRF, SDERF, SADERF, ADERF; trigonometric;
  Nyström) through the traced graph (``aot_eager``: dynamo and AOT autograd, no code generation), equal to the eager
  features to 1e-12 in float64, with gradients;
* the generated code (TorchInductor, C++ on this CPU) of the exponential form, the one the benchmarks run, in
  float32, for every exponential map in every mode (parallel, recurrent, chunked; causal and not; sum and decay
  rules): one compilation for all of them (one test, one worker), ~5–25 s;
* slow: the inductor kernels of the trigonometric and Nyström forms, float64, and ``eps > 0``.

"Equal to rounding" for float32: the largest difference between the fused and the eager result is at most four
times the eager result's own float32 error (against the float64 computation) plus ``64 ε`` of the largest value.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import _rounding_close, data

import kernapprox as ka
from kernapprox.estimators import fused

EXPONENTIAL = ("positive", "positive_orthogonal", "hyperbolic", "gerf", "oprf", "sderf", "saderf", "aderf")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FORMS = {**{name: "exponential" for name in EXPONENTIAL}, "nystrom_uniform": "exponential", "trig": "trigonometric"}


@pytest.fixture
def fresh(monkeypatch):
    """A clean kernel registry for the test (no compiled kernel, no failure), restored afterwards."""
    fused.reset()
    yield
    fused.reset()


def fitted(name, q, k, r=32):
    return ka.make_estimator(name, num_features=r, rng=0).fit(q, k)


# ----------------------------------------------------------------------------------------------- the switch
def test_switch_and_context_manager():
    before = fused.get_mode()
    with fused.mode("off"):
        assert fused.get_mode() == "off"
        with fused.mode("on"):
            assert fused.get_mode() == "on"
        assert fused.get_mode() == "off"
    assert fused.get_mode() == before
    with pytest.raises(ValueError, match="mode must be one of"):
        fused.set_mode("fast")
    with pytest.raises(ValueError, match="mode must be one of"):
        with fused.mode(True):
            pass


# the switch's environment variable: tests/test_backends.py (one test for both switches)


def test_auto_policy(monkeypatch, fresh):
    big = fused.MIN_ENTRIES
    x = torch.zeros(4, 3)
    monkeypatch.setattr(fused, "available", lambda device: (True, "test"))
    monkeypatch.setitem(fused.WARMUP_ENTRIES, "cpu", 3 * big)
    with fused.mode("auto"):
        assert not fused.use_fused(x, big, "exponential")                       # warm-up: eager until the
        assert not fused.use_fused(x, 2 * big, "exponential")                   # eager work would have paid
        assert fused.use_fused(x, big, "exponential")                           # for a compilation
        assert fused.status()["exponential"]["eager_entries"] == {"cpu": 4 * big}
        assert not fused.use_fused(x, big - 1, "exponential")                   # small calls never compile
        assert not fused.use_fused(x.double(), big, "exponential")               # float64: the precision path
        assert not fused.use_fused(x.clone().requires_grad_(), big, "exponential")     # training: eager
        with torch.no_grad():
            assert fused.use_fused(x, big, "exponential")
        monkeypatch.setattr(fused, "_compiling", lambda: True)                    # inside an outer compilation
        assert not fused.use_fused(x, big, "exponential")
        monkeypatch.setattr(fused, "_compiling", lambda: False)
        monkeypatch.setattr(fused, "available", lambda device: (False, "no compiler"))
        assert not fused.use_fused(x, big, "exponential")
    monkeypatch.setattr(fused, "available", lambda device: (True, "test"))
    fused.reset()
    with fused.mode("large"):                                                    # auto without the warm-up
        assert fused.use_fused(x, big, "exponential")
        assert not fused.use_fused(x, big - 1, "exponential")
        assert not fused.use_fused(x.double(), big, "exponential")
        cap = fused.MAX_ENTRIES[("trigonometric", "cpu")]                       # measured slower fused beyond
        assert fused.use_fused(x, cap, "trigonometric")
        assert not fused.use_fused(x, cap + 1, "trigonometric")
        assert fused.use_fused(x, cap + 1, "exponential")
    with fused.mode("on"):
        assert fused.use_fused(x, fused.MAX_ENTRIES[("trigonometric", "cpu")] + 1, "trigonometric")
        assert fused.use_fused(x.double(), 1, "exponential")
    with fused.mode("off"):
        assert not fused.use_fused(x, big, "exponential")


def test_availability_is_reported():
    ok, why = fused.available("cpu")
    assert isinstance(ok, bool) and why
    assert fused.available("meta") == (False, "no fused kernels for device type 'meta'")
    assert set(fused.status()) >= {"mode", "cpu", "min_entries", "exponential", "trigonometric"}


# ------------------------------------------------------------------------------------------------- fallback
def _broken_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler in this test")


def _wrong_backend(gm, example_inputs):
    def run(*args):
        return [2 * out for out in gm(*args)]           # compiles "fine" and computes the wrong thing
    return run


@pytest.mark.parametrize("backend, reason", [(_broken_backend, r"no C\+\+ compiler"),
                                             (_wrong_backend, "differs from the eager kernel")])
def test_a_failing_or_wrong_compiler_falls_back_to_eager_with_one_warning(monkeypatch, fresh, backend, reason):
    q, k, v = data(dtype=torch.float64)
    est = fitted("positive", q, k)
    with fused.mode("off"):
        ref = est.features(q, log_scale=True)
        ref_att = ka.linear_attention(q, k, v, est, causal=True)
    monkeypatch.setattr(fused, "_BACKEND", backend)
    with fused.mode("on"), pytest.warns(RuntimeWarning, match=reason):
        got = est.features(q, log_scale=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))                      # the eager result itself
    assert fused.status()["exponential"]["state"].startswith("failed")
    with fused.mode("on"), warnings.catch_warnings():
        warnings.simplefilter("error")                                            # once per process, not per call
        torch.testing.assert_close(ka.linear_attention(q, k, v, est, causal=True), ref_att, rtol=0, atol=0)
    assert not fused.use_fused(q, 10**9, "exponential")


# ------------------------------------------------------------------------------- traced graphs (no codegen)
def test_traced_kernels_equal_eager_features_float64(monkeypatch, fresh):
    """Every map through dynamo + AOT autograd (``aot_eager``): the kernels trace, with dynamic shapes (several
    row counts and batch shapes: one graph per form), and equal the eager features to 1e-12, gradients included."""
    monkeypatch.setattr(fused, "_BACKEND", "aot_eager")
    q, k, _ = data(dtype=torch.float64)
    for name, form in FORMS.items():
        est = fitted(name, q, k)
        for x in (q, k[0, :, :37], q[1, 2]):
            for role in ("query", "key"):
                with fused.mode("off"):
                    ref = est.features(x, role, log_scale=True)
                with fused.mode("on"):
                    got = est.features(x, role, log_scale=True)
                for a, b in zip(got, ref):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
        assert fused.status()[form]["state"] == "compiled"
    est = fitted("sderf", q, k)
    x = q[0, :, :20].clone().requires_grad_()
    grads = []
    for m in ("off", "on"):
        with fused.mode(m):
            phi, logs = est.features(x, "query", log_scale=True)
            grads.append(torch.autograd.grad((phi.sum(-1).log() + logs).sum(), x)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)


def test_subnormal_features_are_flushed_to_zero(monkeypatch, fresh):
    """Entries below the smallest normal number are 0 in the fused kernels (a subnormal costs ~16× in a vector
    exp): a difference below ``tiny``, which the precision check already counts as lost."""
    monkeypatch.setattr(fused, "_BACKEND", "aot_eager")
    x = torch.tensor([[0.0, 0.0], [50.0, -50.0]])
    w = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    with fused.mode("on"):
        phi, _ = fused.exponential_features(x, w, None, torch.tensor([0.0, 0.0, 1.0]))
    assert phi[1, 1] == 0 and phi[1, 2] > 0 and phi[1, 0] == 1
    eager = torch.exp(x @ w.T - (x @ w.T).amax(-1, keepdim=True))
    assert 0 < eager[1, 1] < torch.finfo(torch.float32).tiny                  # eager: a subnormal
    assert float((phi - eager).abs().max()) < torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------------------------- generated code (inductor)
RULES = ("sum", ka.rules.Decay(0.9))


def _attention_fused_equals_eager(q, k, v, est, what, **call):
    """Linear attention with the fused kernels against the eager code (and its float64 run), every part."""
    call = dict(return_parts=True, chunk_size=32, **call)
    with fused.mode("off"):
        ref = ka.linear_attention(q, k, v, est, **call)
        ref64 = ka.linear_attention(q.double(), k.double(), v.double(), est, **call)
    with fused.mode("on"):
        got = ka.linear_attention(q, k, v, est, **call)
    for part, a, b, c in zip(ref._fields, got, ref, ref64):
        _rounding_close(a, b, c, f"{what} {part}")


def _compare_modes(names, dtype=torch.float32, rules=RULES):
    q, k, v = data(dtype=dtype)
    for name in names:
        est = fitted(name, q, k)
        for rule in rules:
            for mode in ("parallel", "recurrent", "chunked"):
                for causal in (False, True):
                    if not causal and rule != "sum":
                        continue
                    _attention_fused_equals_eager(q, k, v, est, f"{name} {mode} causal={causal} rule={rule}",
                                                  causal=causal, mode=mode, rule=rule)
        with fused.mode("off"):
            ref = est.features(q, "key", log_scale=True)
            ref64 = est.features(q.double(), "key", log_scale=True)
        with fused.mode("on"):
            got = est.features(q, "key", log_scale=True)
        for part, a, b, c in zip(("features", "log-scale"), got, ref, ref64):
            _rounding_close(a, b, c, f"{name} {part}")


@pytest.mark.xdist_group("inductor")
def test_inductor_exponential_kernel_equals_eager_in_every_mode(fresh):
    """The compiled exponential kernel (one compilation, shared by all these maps and Nyström's) = eager to float32
    rounding, in every mode, causal or not, sum and decay rules."""
    if not fused.available("cpu")[0]:
        pytest.skip(fused.available("cpu")[1])
    _compare_modes(EXPONENTIAL + ("nystrom_uniform",))
    state = fused.status()["exponential"]
    assert state["state"] == "compiled", state
    assert list(state["first_call_s"]) == ["cpu/float32"]                 # one variant for every map and shape


@pytest.mark.slow
def test_inductor_trigonometric_kernel_equals_eager(fresh):
    if not fused.available("cpu")[0]:
        pytest.skip(fused.available("cpu")[1])
    _compare_modes(("trig",))
    assert fused.status()["trigonometric"]["state"] == "compiled"


@pytest.mark.slow
def test_inductor_kernels_float64_and_eps(fresh):
    """float64 (a second variant of each kernel) to 1e-10 of the eager result, and ``eps > 0``."""
    if not fused.available("cpu")[0]:
        pytest.skip(fused.available("cpu")[1])
    q, k, v = data(dtype=torch.float64)
    for name in ("positive", "hyperbolic", "sderf", "trig", "nystrom_uniform"):
        est = fitted(name, q, k)
        for causal in (False, True):
            with fused.mode("off"):
                ref = ka.linear_attention(q, k, v, est, causal=causal)
            with fused.mode("on"):
                got = ka.linear_attention(q, k, v, est, causal=causal)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    est = ka.make_estimator("positive", num_features=32, rng=0, eps=1e-3).fit(q, k)
    qf, kf, vf = (t.float() for t in (q, k, v))
    with fused.mode("off"):
        ref = ka.linear_attention(qf, kf, vf, est, causal=True)
    with fused.mode("on"):
        got = ka.linear_attention(qf, kf, vf, est, causal=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)



@requires_cuda
@pytest.mark.xdist_group("inductor")
def test_triton_kernels_equal_eager_on_cuda(fresh):
    """On a GPU the same kernels are Triton code: every form, every mode, float32, to rounding."""
    if not fused.available("cuda")[0]:
        pytest.skip(fused.available("cuda")[1])
    q, k, v = (t.cuda() for t in data())
    for name in ("positive", "hyperbolic", "sderf", "trig", "nystrom_uniform"):
        est = fitted(name, q, k)
        for mode in ("parallel", "recurrent", "chunked"):
            for causal in (False, True):
                _attention_fused_equals_eager(q, k, v, est, f"cuda {name} {mode} causal={causal}",
                                              causal=causal, mode=mode)


def test_feature_buffer(monkeypatch, fresh):
    """``features(..., buffer=)``: checked; written by the fused kernels (the result is the buffer), ignored by
    the eager code; the values are the same either way."""
    monkeypatch.setattr(fused, "_BACKEND", "aot_eager")
    q, k, _ = data(dtype=torch.float64)
    for name in ("positive", "gerf", "trig", "nystrom_uniform"):
        est = fitted(name, q, k)
        buffer = torch.empty(*q.shape[:-1], 32, dtype=torch.float64)
        with fused.mode("off"):
            ref = est.features(q, "key", log_scale=True)
            assert est.features(q, "key", log_scale=True, buffer=buffer)[0] is not buffer
        with fused.mode("on"):
            phi, logs = est.features(q, "key", log_scale=True, buffer=buffer)
        assert phi.data_ptr() == buffer.data_ptr(), name
        torch.testing.assert_close(phi, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logs, ref[1], rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="buffer must be a torch.Tensor"):
        est.features(q, "key", log_scale=True, buffer=[0.0])
    with pytest.raises(ValueError, match="log_scale=True"):
        est.features(q, "key", buffer=buffer)
    with pytest.raises(ValueError, match="buffer must be a contiguous"):
        est.features(q, "key", log_scale=True, buffer=buffer.float())
    with pytest.raises(ValueError, match="not contiguous"):
        est.features(q, "key", log_scale=True, buffer=buffer.transpose(0, 1).contiguous().transpose(0, 1))
