"""The written-out backward of the chunked mode (kernapprox.attention.chunk_grad): gradients equal autograd
through the eager code (float64, to rounding), pass torch's finite-difference check, and the dispatch records
which one ran."""

import pytest
import torch

import kernapprox as ka
from kernapprox import backends

D = 6


def _inputs(shape, n, d_v=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (0.7 * torch.randn(*shape, n, D, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(*shape, n, d_v, generator=gen, dtype=dtype)
    return q, k, v


def _fitted(name, q, k, r=16):
    options = {} if name == "taylor2" else {"num_features": r}
    return ka.make_estimator(name, rng=0, **options).fit(q.reshape(-1, D), k.reshape(-1, D))


def _grads(switch, q, k, v, est, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with backends.mode("backward", switch), backends.record() as calls:
        y = ka.linear_attention(q, k, v, est, **kw)
    weights = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)
    (y * weights).sin().sum().backward()
    ran = [c.backend for c in calls if c.op == "linear_attention.gradient"]
    return y.detach(), (q.grad, k.grad, v.grad), ran


@pytest.mark.parametrize("name", ["positive", "oprf", "nystrom_uniform", "taylor2"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, chunk", [(37, 8), (64, 16), (5, 8)])
def test_gradients_equal_autograd_through_the_eager_code(name, causal, n, chunk):
    q, k, v = _inputs((2, 3), n)
    est = _fitted(name, q, k)
    y1, g1, ran1 = _grads("on", q, k, v, est, causal=causal, chunk_size=chunk)
    y0, g0, ran0 = _grads("off", q, k, v, est, causal=causal, chunk_size=chunk)
    assert ran1 == ["chunk-backward"] and ran0 == ["autograd"]
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-13)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_left_padding_and_query_padding():
    q, k, v = _inputs((2, 2), 30)
    pad = torch.zeros(2, 1, 30, dtype=torch.bool)
    pad[0, :, :11] = True                        # more than one chunk of padding
    est = _fitted("positive", q, k)
    kw = {"causal": True, "chunk_size": 8, "key_padding_mask": pad, "query_padding_mask": pad}
    y1, g1, _ = _grads("on", q, k, v, est, **kw)
    y0, g0, _ = _grads("off", q, k, v, est, **kw)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-13)
    for a, b in zip(g1, g0):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_finite_differences(causal):
    q, k, v = _inputs((1,), 11, d_v=3, seed=3)
    est = _fitted("positive", q, k, r=8)

    def f(q, k, v):
        return ka.linear_attention(q, k, v, est, causal=causal, chunk_size=4)

    with backends.mode("backward", "on"):
        assert torch.autograd.gradcheck(f, tuple(t.clone().requires_grad_() for t in (q, k, v)))


def test_float32_within_rounding_of_float64():
    q, k, v = _inputs((1, 2), 300, d_v=8, seed=5)
    est = _fitted("positive_orthogonal", q, k, r=32)
    _, g64, _ = _grads("on", q, k, v, est, causal=True)
    _, g32, ran = _grads("on", q.float(), k.float(), v.float(), est, causal=True)
    assert ran == ["chunk-backward"]
    for a, b in zip(g32, g64):
        assert float((a.double() - b).abs().max() / b.abs().max()) < 1e-5


def test_other_rules_states_and_parts_take_autograd():
    q, k, v = _inputs((2,), 20)
    est = _fitted("positive", q, k)
    for kw in ({"rule": ka.rules.Decay(0.9), "causal": True}, {"return_parts": True}, {"mode": "parallel"}):
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        with backends.record() as calls:
            ka.linear_attention(q1, k1, v1, est, **kw)
        assert not any(c.backend == "chunk-backward" for c in calls)
