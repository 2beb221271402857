"""The compiled backward of the causal chunked mode (``kernapprox::chunked_causal_backward``, run through
:class:`kernapprox.attention.native.CausalSum`, backend ``native-backward`` of ``"linear_attention.gradient"``):
gradients of ``q``, ``k``, ``v`` (through the feature map) equal autograd through the eager chunked code to float32
rounding, and a float64 oracle to float32 accuracy; the dispatch takes it exactly for the calls it computes; a
wrong kernel is caught by the self-check and by the tolerance used here.

"Equal to rounding" is the bound of tests/attention/test_native.py: the largest difference from the eager float32
gradient is at most four times the eager gradient's own float32 error (against the float64 eager run) plus ``64 ε`` of
the largest gradient entry.
"""

from __future__ import annotations

import pytest
import torch
from helpers import _rounding_close

import kernapprox as ka
from kernapprox import backends
from kernapprox.attention import native
from kernapprox.nn import KernelAttention

pytestmark = pytest.mark.skipif(not native._prerequisites()[0], reason=native._prerequisites()[1])

D = 8


@pytest.fixture(autouse=True)
def built():
    if not native.available():
        pytest.skip(f"the compiled operators are not available: {native.status()}")


def _inputs(shape, n, d_v=5, seed=0, std=0.7, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = ((std * torch.randn(*shape, n, D, generator=gen, dtype=torch.float64)).to(dtype) for _ in range(2))
    v = torch.randn(*shape, n, d_v, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _fitted(name, q, k, r, **options):
    return ka.make_estimator(name, num_features=r, rng=0, **options).fit(q.reshape(-1, D).double(),
                                                                         k.reshape(-1, D).double())


# (map, options, the backend that takes it): maps of the exponential form with eps = 0 have their features
# computed and differentiated by the compiled operators too; others (eps > 0) by torch, around the compiled core
MAPS = [("positive", {}, "native-backward-exp"), ("positive_orthogonal", {}, "native-backward-exp"),
        ("oprf", {}, "native-backward-exp"), ("positive", {"eps": 1e-3}, "native-backward")]


def _map_id(spec):
    name, options, _ = spec
    return name + "".join(f"-{key}{value}" for key, value in options.items())


def _grads(switch, q, k, v, est, **kw):
    """Output and gradients of ``sin(y · w).sum()`` (a loss whose gradient varies per entry), and the backends
    of ``"linear_attention.gradient"`` that ran."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kw = {"causal": True, **kw}
    with backends.mode("native", switch), backends.record() as calls:
        y = ka.linear_attention(q, k, v, est, **kw)
    weights = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)
    (y * weights).sin().sum().backward()
    ran = [c.backend for c in calls if c.op == "linear_attention.gradient"]
    return (y.detach(), q.grad, k.grad, v.grad), ran


def _id(case):
    shape, n, r, chunk, threads = case
    return f"B{'x'.join(map(str, shape))}-T{n}-r{r}-C{chunk}-threads{threads}"


# (batch shape, n, r, chunk, torch threads): n not a multiple of the chunk, r not a multiple of any block, fewer
# sequences per thread than threads and more, one chunk only, a two-token sequence
CASES = [((2, 3), 37, 20, 8, 1), ((1, 3), 100, 33, 16, 2), ((2, 2), 64, 16, 64, 2), ((1, 2), 2, 7, 4, 2),
         ((3,), 130, 256, 64, 2), ((1, 5), 77, 12, 5, 1)]


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("spec", MAPS, ids=_map_id)
def test_gradients_equal_eager_autograd_to_rounding(case, spec):
    shape, n, r, chunk, threads = case
    name, options, backend = spec
    q, k, v = _inputs(shape, n, seed=n)
    est = _fitted(name, q, k, r, **options)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, ran = _grads("on", q, k, v, est, chunk_size=chunk)
        ref, ran_ref = _grads("off", q, k, v, est, chunk_size=chunk)
    finally:
        torch.set_num_threads(previous)
    ref64, _ = _grads("off", q.double(), k.double(), v.double(), est, chunk_size=chunk)
    assert ran == [backend] and ran_ref == ["autograd"]
    for part, a, b, c in zip(("y", "dq", "dk", "dv"), got, ref, ref64):
        _rounding_close(a, b, c, f"{_map_id(spec)} {_id(case)} {part}")


@pytest.mark.parametrize("eps, backend", [(0.0, "native-backward-exp"), (1e-3, "native-backward")])
def test_one_token(eps, backend):
    """``y = v``: the gradients of ``q`` and ``k`` are 0 (eager: exactly; the kernel: to rounding of ``dv``), that
    of ``v`` the loss's."""
    q, k, v = _inputs((2, 2), 1)
    est = _fitted("positive", q, k, 9, eps=eps)
    got, ran = _grads("on", q, k, v, est)
    ref, _ = _grads("off", q, k, v, est)
    assert ran == [backend]
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[3], ref[3])
    for a in got[1:3]:
        assert float(a.abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(ref[3].abs().max())


@pytest.mark.parametrize("eps, backend", [(0.0, "native-backward-exp"), (1e-3, "native-backward")])
def test_extreme_logits_where_the_stabiliser_matters(eps, backend):
    """Large inputs: key log-scales spread over more than float32's exponent range, so every row's shift (the
    running maximum) changes within chunks and most weights underflow without it."""
    q, k, v = _inputs((2, 2), 90, seed=7, std=7.0)
    est = _fitted("positive", q, k, 24, eps=eps)
    lk = est.features(k.double(), "key", log_scale=True)[1]
    assert float(lk.max() - lk.min()) > 100                   # the case is extreme
    got, ran = _grads("on", q, k, v, est, chunk_size=16)
    ref, _ = _grads("off", q, k, v, est, chunk_size=16)
    ref64, _ = _grads("off", q.double(), k.double(), v.double(), est, chunk_size=16)
    assert ran == [backend]
    for part, a, b, c in zip(("y", "dq", "dk", "dv"), got, ref, ref64):
        assert torch.isfinite(a).all()
        _rounding_close(a, b, c, f"extreme logits {part}")


def _oracle(q, k, v, est):
    """Float64 softmax-free attention by its definition on the map's features: ``y_i = Σ_{j≤i} φ(q_i)ᵀφ(k_j) v_j /
    Σ_{j≤i} φ(q_i)ᵀφ(k_j)``, each row's weights scaled by its largest key log-scale (a constant of the row, so the
    value and its gradient are those of the definition)."""
    pq, lq = est.features(q, "query", log_scale=True)
    pk, lk = est.features(k, "key", log_scale=True)
    n = q.shape[-2]
    past = torch.ones(n, n, dtype=torch.bool).tril()
    shift = torch.cummax(lk.detach(), -1).values
    weights = (pq @ pk.transpose(-1, -2) * torch.exp(lk[..., None, :] - shift[..., :, None])).masked_fill(~past, 0)
    return (weights @ v) / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("eps, backend", [(0.0, "native-backward-exp"), (1e-3, "native-backward")])
def test_gradients_equal_a_float64_oracle(eps, backend):
    q, k, v = _inputs((1, 3), 75, seed=3)
    est = _fitted("positive_orthogonal", q, k, 40, eps=eps)
    got, ran = _grads("on", q, k, v, est, chunk_size=16)
    assert ran == [backend]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    y = _oracle(q64, k64, v64, est)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sin().sum().backward()
    for part, a, b in zip(("y", "dq", "dk", "dv"), got, (y.detach(), q64.grad, k64.grad, v64.grad)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < 2e-5, f"{part}: relative error {err:.3g} against the float64 oracle"


def test_the_oracle_passes_finite_differences():
    """The float64 oracle above is itself differentiable correctly (torch's finite-difference check)."""
    q, k, v = _inputs((1,), 9, d_v=3, seed=4, dtype=torch.float64)
    est = _fitted("positive", q, k, 6)
    assert torch.autograd.gradcheck(lambda q, k, v: _oracle(q, k, v, est),
                                    tuple(t.clone().requires_grad_() for t in (q, k, v)))


def test_the_tolerance_catches_a_perturbed_gradient():
    """The bound used above fails for a gradient off by one part in 10⁴ in one entry (a wrong kernel would be
    caught), while the true gradients pass it."""
    q, k, v = _inputs((2, 2), 50, seed=5)
    est = _fitted("positive", q, k, 20)
    got, _ = _grads("on", q, k, v, est, chunk_size=8)
    ref, _ = _grads("off", q, k, v, est, chunk_size=8)
    ref64, _ = _grads("off", q.double(), k.double(), v.double(), est, chunk_size=8)
    for a, b, c in zip(got[1:], ref[1:], ref64[1:]):
        _rounding_close(a, b, c, "true gradient")
        wrong = a.clone()
        i = int(wrong.abs().argmax())
        wrong.view(-1)[i] *= 1 + 1e-4
        with pytest.raises(AssertionError):
            _rounding_close(wrong, b, c, "perturbed gradient")


def test_the_self_check_catches_a_wrong_backward(monkeypatch):
    real = native.chunk_backward

    def wrong(*args, **kwargs):
        gpq, gpk, glk, gv = real(*args, **kwargs)
        return gpq, gpk, glk, gv * (1 + 1e-3)

    monkeypatch.setattr(native, "chunk_backward", wrong)
    with pytest.raises(RuntimeError, match="causal backward's gradients of v"):
        native._self_check_backward()


def test_a_failed_check_disables_the_backward_with_one_warning(monkeypatch):
    def failing():
        raise RuntimeError("self-check: the causal backward's gradients of v differ")

    q, k, v = _inputs((2, 2), 40)
    est = _fitted("positive", q, k, 16)
    monkeypatch.setattr(native, "_self_check_backward", failing)
    native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="causal backward") as caught:
            got, ran = _grads("on", q, k, v, est)
            _grads("on", q, k, v, est)
        assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
        ref, _ = _grads("off", q, k, v, est)
        assert ran == ["autograd"]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        monkeypatch.undo()
        native.reset()
        assert native.available()


@pytest.mark.parametrize("what, kw, data", [
    ("non-causal", {"causal": False}, {}),
    ("float64", {}, {"dtype": torch.float64}),
    ("padded keys", {"key_padding_mask": torch.arange(30).expand(4, 1, 30) >= 27}, {}),
    ("decay rule", {"rule": ka.rules.Decay(0.9)}, {}),
    ("parts", {"return_parts": True}, {}),
    ("parallel mode", {"mode": "parallel"}, {}),
    ("one sequence, two threads", {}, {"shape": (1, 1)}),
])
def test_calls_it_does_not_compute_take_autograd(what, kw, data):
    shape = data.get("shape", (4, 1))
    q, k, v = _inputs(shape, 30, dtype=data.get("dtype", torch.float32))
    est = _fitted("positive", q, k, 16)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        with backends.mode("native", "on"), backends.record() as calls:
            ka.linear_attention(q1, k1, v1, est, **{"causal": True, **kw})
    finally:
        torch.set_num_threads(previous)
    assert not any(c.backend.startswith("native-backward") for c in calls), what
    for c in calls:
        if c.op == "linear_attention.gradient":
            assert {"native-backward", "native-backward-exp"} <= set(dict(c.declined)), what


def test_switch_off_and_auto():
    q, k, v = _inputs((2, 2), 40)
    est = _fitted("positive", q, k, 16)
    _, ran_off = _grads("off", q, k, v, est)
    _, ran_auto = _grads("auto", q, k, v, est)           # 4 × 40 × 16 feature entries < MIN_ENTRIES
    assert ran_off == ran_auto == ["autograd"]


def test_the_nn_layer_trains_through_the_compiled_backward():
    """The nn layer (projections and FAVOR+ features included): parameter gradients equal the eager path's."""
    torch.manual_seed(0)
    layer = KernelAttention(32, 4, "positive_orthogonal", num_features=24, causal=True, chunk_size=16, rng=0)
    x = torch.randn(2, 45, 32)
    grads = {}
    for switch in ("on", "off"):
        layer.zero_grad()
        with backends.mode("native", switch), backends.record() as calls:
            y = layer(x)
        y.square().mean().backward()
        grads[switch] = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        assert ("native-backward-exp" if switch == "on" else "autograd") in [c.backend for c in calls]
    for a, b in zip(grads["on"], grads["off"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_map_whose_weights_need_gradients_keeps_its_features_in_torch():
    from kernapprox.estimators.base import ExponentialForm

    weight = torch.randn(8, D, requires_grad=True)
    form = ExponentialForm(torch.randn(3, 10, D), 1.0, weight, None, 0.0, 0.0, 1.0)
    call = {"causal": True, "device": torch.device("cpu"), "dtype": torch.float32, "batch": 3, "entries": 1 << 20}
    with backends.mode("native", "on"):
        accepted, reason = native._check_backward_exp(form=form, **call)
        assert not accepted and "gradient" in reason
        assert native._check_backward_exp(form=form._replace(weight=weight.detach()), **call)[0]


def test_a_compiled_training_step_runs_the_compiled_backward():
    """torch.compile traces a training step through the autograd functions (their operators traced as themselves,
    shapes from the fake versions); the gradients equal the eager path's to rounding."""
    q, k, v = _inputs((2, 2), 70, seed=8)
    est = _fitted("positive", q, k, 16)

    def step(q, k, v):
        y = ka.linear_attention(q, k, v, est, causal=True, chunk_size=16)
        return (y * torch.linspace(-1, 1, y.shape[-1])).sin().sum()

    grads = {}
    for label, fn in (("compiled", torch.compile(step, backend="aot_eager")), ("eager", step)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with backends.mode("native", "on" if label == "compiled" else "off"), backends.record() as calls:
            fn(*leaves).backward()
        grads[label] = [t.grad for t in leaves]
        ran = [c.backend for c in calls if c.op == "linear_attention.gradient"]
        assert ran == (["native-backward-exp"] if label == "compiled" else ["autograd"])
    for a, b in zip(grads["compiled"], grads["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_query_padding():
    """Padded query rows (zeroed after the attention) get no gradient through them; the rest equal eager."""
    q, k, v = _inputs((2, 2), 40, seed=9)
    est = _fitted("positive", q, k, 16)
    qpad = torch.zeros(2, 2, 40, dtype=torch.bool)
    qpad[0, :, 30:] = True
    got, ran = _grads("on", q, k, v, est, chunk_size=8, query_padding_mask=qpad)
    ref, _ = _grads("off", q, k, v, est, chunk_size=8, query_padding_mask=qpad)
    ref64, _ = _grads("off", q.double(), k.double(), v.double(), est, chunk_size=8, query_padding_mask=qpad)
    assert ran == ["native-backward-exp"]
    assert float(got[1][qpad].abs().max()) == 0.0
    for part, a, b, c in zip(("y", "dq", "dk", "dv"), got, ref, ref64):
        _rounding_close(a, b, c, f"query padding {part}")


def test_bfloat16_inputs_compute_in_float32():
    q, k, v = (t.to(torch.bfloat16) for t in _inputs((2, 2), 50, seed=10))
    est = _fitted("positive", q.float(), k.float(), 16)
    got, ran = _grads("on", q, k, v, est, chunk_size=16)
    ref, _ = _grads("off", q, k, v, est, chunk_size=16)
    assert ran == ["native-backward-exp"]
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * float(b.float().abs().max()))


def test_the_fused_self_check_catches_a_wrong_backward(monkeypatch):
    real = native.ExpCausalSum.backward

    def wrong(ctx, *grads):
        gxq, gxk, gv, *rest = real(ctx, *grads)
        return (gxq, gxk * (1 + 1e-3), gv, *rest)

    monkeypatch.setattr(native.ExpCausalSum, "backward", staticmethod(wrong))
    with pytest.raises(RuntimeError, match="fused features and causal backward's gradients of k"):
        native._self_check_fused()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_first_call_under_no_grad_or_inference_mode_passes_the_self_check(context, recwarn):
    """Inference calls are the common first eligible call (an evaluation loop): the self-check, which
    differentiates, must run and pass there too, not disable the operators for the process."""
    q, k, v = _inputs((2, 2), 40)
    est = _fitted("positive", q, k, 16)
    native.reset()
    try:
        with backends.mode("native", "on"), getattr(torch, context)():
            with backends.record() as calls:
                out = ka.linear_attention(q, k, v, est, causal=True)
        assert native.status().startswith("loaded"), native.status()
        assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
        assert any(c.backend.startswith("native") for c in calls if c.op == "linear_attention.chunked")
        with backends.mode("native", "off"):
            ref = ka.linear_attention(q, k, v, est, causal=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    finally:
        native.reset()
