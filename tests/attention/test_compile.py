"""``torch.compile`` of the library's entry points: :func:`kernapprox.linear_attention` and
:class:`kernapprox.nn.KernelAttention` compile, equal the eager results to float32 rounding, and carry the native
operators in their graphs where the dispatch takes them (:mod:`kernapprox.backends`).

Which calls compile with ``fullgraph=True``: those whose eager path has no data-dependent branch, i.e. exact
attention (its finite checks are in-graph assertions under compile, :func:`kernapprox.validation.check_finite`).
Every call of a feature map has one: the precision hook of :func:`kernapprox.linear_attention` (a row whose
stabilised normaliser underflowed is recomputed in float64, :func:`kernapprox.attention.logdomain.needs_recompute`),
so those compile with graph breaks — the tests check that the hook is the only one (Nyström's own fitted-map code,
``nystrom.py``, breaks too: numpy on its fitted eigenvalues). Most tests use the ``aot_eager`` backend (dynamo, the
operators' fake versions and functionalisation of their in-place arguments, without code generation: seconds);
one compiles with inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import kernapprox as ka
from kernapprox import backends
from kernapprox.attention import native
from kernapprox.nn import KernelAttention

ESTIMATORS = ["positive_orthogonal", "trig_orthogonal", "nystrom_uniform", "hedgehog"]
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _data(seed=0, shape=(2, 2, 40, 8)):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen) for _ in range(3))


class _Recorder:
    """A torch.compile backend that keeps the traced graphs and runs them with ``aot_eager``."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def ops(self) -> set[str]:
        return {str(node.target) for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"}


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=4 * EPS, atol=64 * EPS * float(want.abs().max()))


def _native_on():
    ok = native.available()
    return backends.mode("native", "on" if ok else "off"), ok


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_linear_attention_compiles_and_equals_eager(name, causal):
    q, k, v = _data()
    est = ka.make_estimator(name, num_features=16, rng=0).fit(q, k)
    switch, ok = _native_on()
    recorder = _Recorder()

    def fn(q, k, v):
        return ka.linear_attention(q, k, v, est, causal=causal)

    with torch.no_grad(), switch, backends.record() as calls:
        want = fn(q, k, v)
        got = torch.compile(fn, backend=recorder)(q, k, v)
    _close(got, want)
    chosen = {c.backend for c in calls if c.op == "linear_attention.chunked"}
    assert len(chosen) == 1, chosen                       # eager and traced calls took the same backend
    expected_op = {"native-exp": "kernapprox.exp_attention", "native": "kernapprox.chunked_causal"}.get(chosen.pop())
    if ok and (causal or est.exponential_form(q, "query") is not None):
        assert expected_op is not None
    if expected_op is not None:
        assert any(op.startswith(expected_op) for op in recorder.ops()), recorder.ops()


def _break_files(fn, *args) -> set[str]:
    """The files where dynamo breaks the graph of ``fn(*args)`` (:func:`torch._dynamo.explain`)."""
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(*args)
    return {b.user_stack[-1].filename.rsplit("/", 1)[-1] for b in explained.break_reasons}


@pytest.mark.parametrize("name, causal", [("positive_orthogonal", True), ("trig_orthogonal", False)])
def test_the_only_graph_break_is_the_precision_hook(name, causal):
    q, k, v = _data(5)
    est = ka.make_estimator(name, num_features=16, rng=0).fit(q, k)
    switch, _ = _native_on()
    with switch:
        assert _break_files(lambda q, k, v: ka.linear_attention(q, k, v, est, causal=causal), q, k, v) == {
            "logdomain.py"}


@pytest.mark.parametrize("name, causal", [("positive_orthogonal", True), ("hedgehog", False)])
def test_kernel_attention_compiles_and_equals_eager(name, causal):
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(1))
    layer = KernelAttention(16, 2, name, num_features=16, causal=causal, rng=0).eval()
    if layer.estimator.capabilities().data_dependent:
        layer.fit(x)
    switch, _ = _native_on()
    with torch.no_grad(), switch:
        want = layer(x)
        got = torch.compile(layer, backend="aot_eager")(x)
    _close(got, want)


@pytest.mark.parametrize("name", ["positive_orthogonal", "exact"])
def test_kernel_attention_with_the_new_options_compiles_and_equals_eager(name):
    """Grouped-query heads, a rotary hook, left padding (query and key masks), per-call causality and positions."""
    from kernapprox.nn import RotaryEmbedding

    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(2))
    layer = KernelAttention(16, 4, name, num_features=None if name == "exact" else 16, rng=0, num_kv_heads=2,
                            pos_hook=RotaryEmbedding(4), bias=False, chunk_size=8).eval()
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[1, :5] = True
    pos = (torch.cumsum(~pad, 1) - 1).clamp(min=0)

    def fn(x, pad, pos):
        return layer(x, key_padding_mask=pad, query_padding_mask=pad, positions=pos, causal=True)

    switch, _ = _native_on()
    with torch.no_grad(), switch:
        want = fn(x, pad, pos)
        got = torch.compile(fn, backend="aot_eager")(x, pad, pos)
    _close(got, want)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_exact_attention_compiles_with_fullgraph(causal):
    """No data-dependent branch: one graph, for the function and for the layer."""
    q, k, v = _data(2)
    est = ka.make_estimator("exact").fit(q, k)
    fn = torch.compile(lambda q, k, v: ka.linear_attention(q, k, v, est, causal=causal), fullgraph=True,
                       backend="aot_eager")
    _close(fn(q, k, v), ka.linear_attention(q, k, v, est, causal=causal))
    layer = KernelAttention(8, 2, "exact", causal=causal, rng=0).eval()
    x = q[0].transpose(0, 1).reshape(1, 40, 16)[..., :8]
    _close(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))


def test_nan_input_raises_in_a_compiled_graph():
    """The finite check is an assertion inside the graph: a NaN input raises, never a silently wrong result."""
    q, k, v = _data(3)
    est = ka.make_estimator("exact").fit(q, k)
    fn = torch.compile(lambda q, k, v: ka.linear_attention(q, k, v, est), fullgraph=True, backend="aot_eager")
    fn(q, k, v)
    q = q.clone()
    q[0, 0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="contains NaN or Inf"):
        fn(q, k, v)


@pytest.mark.slow       # inductor's code generation: ~40 s on a 2-core machine
def test_inductor_compiles_the_native_operator():
    """Code generation (inductor) around the native operator: equal to eager to float32 rounding."""
    q, k, v = _data(4, shape=(1, 4, 64, 8))
    est = ka.make_estimator("positive_orthogonal", num_features=16, rng=0).fit(q, k)
    switch, _ = _native_on()
    with torch.no_grad(), switch:
        want = ka.linear_attention(q, k, v, est, causal=True)
        got = torch.compile(lambda q, k, v: ka.linear_attention(q, k, v, est, causal=True))(q, k, v)
    _close(got, want)


def test_the_native_operators_trace_in_one_graph():
    """The operators under ``fullgraph=True``: their fake versions give the shapes, and the state they advance in
    place (declared in their schemas) is advanced in the caller's tensors as in eager mode."""
    if not native.available():                    # built on first use (not at collection)
        pytest.skip(native.status())
    gen = torch.Generator().manual_seed(6)
    batch, n, r, d_v = 3, 20, 8, 4
    pq, pk = torch.rand(batch, n, r, generator=gen), torch.rand(batch, n, r, generator=gen)
    lq, lk = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)
    v = torch.randn(batch, n, d_v, generator=gen)

    def run(pq, lq, pk, lk, v, state, c):
        out, den, logs = torch.empty(batch, n, d_v), torch.empty(batch, n), torch.empty(batch, n)
        native.chunk_block(pq, lq, pk, lk, v, state, c, out, den, logs, 4, -0.1, want_num=False)
        return out, den, logs

    results = []
    for fn in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        state, c = torch.zeros(batch, d_v + 1, r), torch.full((batch,), native.SENTINEL)
        results.append((*fn(pq, lq, pk, lk, v, state, c), state, c))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert float(results[1][3].abs().sum()) > 0          # the state was advanced in place
