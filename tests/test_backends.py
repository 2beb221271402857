"""The backend dispatch (:mod:`kernapprox.backends`): one switch per mechanism (environment and Python), the
registry's priorities, and a status that reports the backend each call ran and why."""

from __future__ import annotations

import pytest
import torch

import kernapprox as ka
from kernapprox import backends
from kernapprox.attention import native

CHUNKED = "linear_attention.chunked"


def _data(shape=(2, 2, 24, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen) for _ in range(3))


def _chunked_choices(calls):
    return [c for c in calls if c.op == CHUNKED]


@pytest.mark.parametrize("switch", ["native", "fused"])
@pytest.mark.parametrize("raw, expected", [("0", "off"), ("off", "off"), ("1", "on"), ("ON", "on"), ("", "auto"),
                                           ("auto", "auto"), ("yes", "on")])
def test_switches_from_the_environment(monkeypatch, switch, raw, expected):
    monkeypatch.setenv(f"KERNAPPROX_{switch.upper()}", raw)
    assert backends._initial(switch) == expected


@pytest.mark.parametrize("switch", ["native", "fused"])
def test_unknown_switch_values_warn_and_mean_the_default(monkeypatch, switch):
    variable = f"KERNAPPROX_{switch.upper()}"
    monkeypatch.setenv(variable, "turbo")
    with pytest.warns(RuntimeWarning, match=variable):
        assert backends._initial(switch) == "auto"
    monkeypatch.setenv("KERNAPPROX_NATIVE", "large")           # a value of the fused switch only
    with pytest.warns(RuntimeWarning, match="KERNAPPROX_NATIVE"):
        assert backends._initial("native") == "auto"


def test_the_switches_are_independent():
    from kernapprox.estimators import fused

    before = backends.status()["switches"]
    with backends.mode("native", "off"):
        assert backends.get_mode("native") == "off" and fused.get_mode() == before["fused"]
        with fused.mode("on"):
            assert backends.get_mode("native") == "off" and backends.get_mode("fused") == "on"
    assert backends.status()["switches"] == before
    with pytest.raises(ValueError, match="mode must be one of"):
        backends.set_mode("native", "large")
    with pytest.raises(ValueError, match="switch must be one of"):
        backends.set_mode("kernel", "on")


def test_registry_orders_by_priority():
    names = [b.name for b in backends.backends(CHUNKED)]
    assert names == ["native-exp", "native", "cuda", "eager"]
    assert [b.name for b in backends.backends("features.exponential")] == ["fused", "eager"]
    with pytest.raises(ValueError, match="op must be one of"):
        backends.backends("attention.fast")


def test_a_registered_backend_takes_its_calls(monkeypatch):
    monkeypatch.setattr(backends, "_REGISTRY", {op: dict(b) for op, b in backends._REGISTRY.items()})
    monkeypatch.setattr(backends, "_ORDERED", dict(backends._ORDERED))
    backends.register(backends.Backend("test", CHUNKED, 5, lambda **call: (False, "declines everything")))
    q, k, v = _data()
    est = ka.make_estimator("trig", num_features=8, rng=0).fit(q, k)
    with backends.mode("native", "off"), backends.record() as calls:
        ka.linear_attention(q, k, v, est, causal=True)
    (choice,) = _chunked_choices(calls)
    assert choice.backend == "eager"
    assert dict(choice.declined)["test"] == "declines everything"


def test_status_reports_each_calls_backend_and_why():
    q, k, v = _data()
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    trig = ka.make_estimator("trig", num_features=8, rng=0).fit(q, k)
    with backends.record() as calls:
        with backends.mode("native", "off"):
            ka.linear_attention(q, k, v, est, causal=True)
        with backends.mode("native", "on"):
            ka.linear_attention(q.double(), k.double(), v.double(), est, causal=True)
            ka.linear_attention(q, k, v, trig, causal=False)
    off, float64, signed = _chunked_choices(calls)
    assert off.backend == "eager" and dict(off.declined)["native-exp"] == "KERNAPPROX_NATIVE=off"
    assert float64.backend == "eager" and "dtype torch.float64" in dict(float64.declined)["native-exp"]
    assert signed.backend == "eager"
    assert "no exponential form" in dict(signed.declined)["native-exp"]
    assert "non-causal" in dict(signed.declined)["native"]
    assert backends.status()["last"][CHUNKED] == signed
    assert any(c.op == "features.trigonometric" for c in calls)   # the feature maps' epilogues are recorded too


def test_gradient_calls_report_their_backend_and_why():
    q, k, v = _data()
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    compiled = native.available()
    with backends.mode("native", "on"):
        with backends.mode("backward", "on"), backends.record() as written:
            ka.linear_attention(q.clone().requires_grad_(), k, v, est, causal=True)
        with backends.record() as grad:
            ka.linear_attention(q.clone().requires_grad_(), k, v, est, causal=True)
    with backends.mode("native", "off"):
        with backends.mode("backward", "on"), backends.record() as written_eager:
            ka.linear_attention(q.clone().requires_grad_(), k, v, est, causal=True)
        with backends.record() as grad_eager:
            ka.linear_attention(q.clone().requires_grad_(), k, v, est, causal=True)

    def gradient(calls):
        (choice,) = [c for c in calls if c.op == "linear_attention.gradient"]
        return choice

    # the compiled backward (features, attention and gradient) takes both calls where the operators are built
    for calls in (written, grad):
        assert gradient(calls).backend == ("native-backward-exp" if compiled else
                                           ("chunk-backward" if calls is written else "autograd"))
    # without it: the written-out backward, whose forward needs no gradient (features given, the causal operator
    # when switched on), or autograd through the eager code
    assert gradient(written_eager).backend == "chunk-backward"
    assert dict(gradient(written_eager).declined)["native-backward"] == "KERNAPPROX_NATIVE=off"
    (forward,) = _chunked_choices(written_eager)
    assert forward.backend == "eager" and "no exponential form" in dict(forward.declined)["native-exp"]
    assert gradient(grad_eager).backend == "autograd"
    assert dict(gradient(grad_eager).declined)["chunk-backward"] == "KERNAPPROX_BACKWARD=off"
    (forward,) = _chunked_choices(grad_eager)
    assert forward.backend == "eager" and dict(forward.declined)["native-exp"] == "KERNAPPROX_NATIVE=off"


def test_status_names_the_native_operators_when_they_run():
    if not native.available():                    # built on first use (not at collection)
        pytest.skip(native.status())
    q, k, v = _data(shape=(2, 2, 40, 8))
    with backends.mode("native", "on"), backends.record() as calls:
        ka.linear_attention(q, k, v, ka.make_estimator("positive", num_features=8, rng=0).fit(q, k), causal=False)
        ka.linear_attention(q, k, v, ka.make_estimator("trig", num_features=8, rng=0).fit(q, k), causal=True)
    exp, given = _chunked_choices(calls)
    assert (exp.backend, given.backend) == ("native-exp", "native")
    assert exp.reason == given.reason == "KERNAPPROX_NATIVE=on, eligible"


def test_fused_epilogue_choices_are_recorded():
    from kernapprox.estimators import fused

    est = ka.make_estimator("positive", num_features=8, rng=0).fit(torch.zeros(1, 4))
    with fused.mode("off"), backends.record() as calls:
        est.features(torch.ones(3, 4))
    (choice,) = [c for c in calls if c.op == "features.exponential"]
    assert choice.backend == "eager" and dict(choice.declined)["fused"] == "KERNAPPROX_FUSED=off"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calls_go_through_the_same_dispatch():
    q, k, v = (t.cuda() for t in _data())
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    with backends.record() as calls:
        ka.linear_attention(q, k, v, est, causal=True)
    (choice,) = _chunked_choices(calls)
    assert choice.backend == "cuda"
    assert "on cuda" in dict(choice.declined)["native-exp"]
