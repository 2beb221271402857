"""Bad input raises ``ValueError``/``TypeError`` whose message names the argument; nothing is coerced."""

import numpy as np
import pytest
import torch

import kernapprox as ka


def _qkv(n=5, d=4, d_v=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, n, d, generator=g).to(dtype), torch.randn(2, n, d, generator=g).to(dtype),
            torch.randn(2, n, d_v, generator=g).to(dtype))


def _fitted(name="positive", d=4):
    return ka.make_estimator(name, num_features=8, rng=0).fit(torch.zeros(1, d))


def _entry_points():
    """Callables taking (q, k, v) for every public function that validates tensors."""
    est = _fitted()
    return {
        "softmax_attention": lambda q, k, v: ka.softmax_attention(q, k, v),
        "softmax_attention_causal": lambda q, k, v: ka.softmax_attention(q, k, v, causal=True),
        "linear_attention": lambda q, k, v: ka.linear_attention(q, k, v, est),
        "linear_attention_causal_recurrent": lambda q, k, v: ka.linear_attention(q, k, v, est, True, "recurrent"),
        "softmax_attention_naive": lambda q, k, v: ka.softmax_attention_naive(q, k, v),
        "linear_attention_naive": lambda q, k, v: ka.linear_attention_naive(q, k, v, est),
    }


ENTRY_POINTS = list(_entry_points())


def _call_with_one_replaced(entry, which, replace):
    """Call entry point ``entry`` on ``_qkv()`` with the tensor named ``which`` replaced by ``replace(it)``."""
    tensors = dict(zip("qkv", _qkv()))
    tensors[which] = replace(tensors[which])
    return _entry_points()[entry](*(tensors[name] for name in "qkv"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_inputs(entry, bad, which):
    def poison(t):
        t = t.clone()
        t[1, 2, 0] = float(bad)
        return t

    with pytest.raises(ValueError, match=rf"^{which} contains NaN or Inf"):
        _call_with_one_replaced(entry, which, poison)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rank_below_two(entry, which):
    with pytest.raises(ValueError, match=rf"^{which} must have rank >= 2"):
        _call_with_one_replaced(entry, which, lambda t: t[0, 0])


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_integer_tensors_and_numpy_arrays(entry, which):
    with pytest.raises(TypeError, match=rf"^{which} must be a floating-point tensor"):
        _call_with_one_replaced(entry, which, lambda t: t.to(torch.int64))
    with pytest.raises(TypeError, match=rf"^{which} must be a torch.Tensor, got ndarray"):
        _call_with_one_replaced(entry, which, lambda t: t.numpy())


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_mismatched_sizes(entry):
    q, k, v = _qkv()
    fn = _entry_points()[entry]
    with pytest.raises(ValueError, match="q and k must share the last dimension d"):
        fn(q, k[..., :3], v)
    with pytest.raises(ValueError, match="k and v must have the same sequence length"):
        fn(q, k, v[..., :4, :])
    with pytest.raises(ValueError, match="q, k and v must share batch dimensions"):
        fn(q, k, v[:1])
    if "causal" in entry:
        with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
            fn(q[..., :4, :], k, v)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_mismatched_dtypes_and_devices(entry):
    q, k, v = _qkv()
    fn = _entry_points()[entry]
    with pytest.raises(TypeError, match="k has dtype torch.float64 but q has dtype torch.float32"):
        fn(q, k.double(), v)
    with pytest.raises(TypeError, match="v has dtype torch.float16 but q has dtype torch.float32"):
        fn(q, k, v.half())
    with pytest.raises(ValueError, match="k is on device meta but q is on cpu"):
        fn(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="v is on device meta but q is on cpu"):
        fn(q, k, v.to("meta"))


def test_kernel_matrix_and_fit_checks():
    q, k, _ = _qkv()
    with pytest.raises(TypeError, match="k has dtype"):
        ka.kernel_matrix(q, k.double())
    with pytest.raises(ValueError, match="q and k must share the last dimension"):
        ka.kernel_matrix(q, k[..., :2])
    with pytest.raises(ValueError, match="scale must be positive"):
        ka.kernel_matrix(q, k, scale=-1.0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        ka.kernel_matrix(q, k, scale="big")
    est = ka.make_estimator("trig", num_features=8, rng=0)
    with pytest.raises(ValueError, match="q contains NaN"):
        est.fit(q.masked_fill(q > 1, float("nan")))
    with pytest.raises(TypeError, match="k has dtype"):
        est.fit(q, k.double())
    with pytest.raises(ValueError, match="q and k must share the last dimension"):
        est.fit(q, k[..., :2])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        est.fit(q.numpy())
    with pytest.raises(ka.NotFittedError, match="not fitted"):
        est.features(q)
    est.fit(q)
    with pytest.raises(ValueError, match="x has last dimension 3 but the estimator was fitted with d=4"):
        est.features(q[..., :3])
    with pytest.raises(ValueError, match="x contains NaN"):
        est.features(q / 0)
    with pytest.raises(TypeError, match="k has dtype"):
        est.kernel_matrix(q, k.double())


@pytest.mark.parametrize("role", ["value", "Query", "", None])
def test_role_must_be_query_or_key(role):
    q, _, _ = _qkv()
    with pytest.raises(ValueError, match=r"unknown role .*valid values: query, key"):
        _fitted().features(q, role)


@pytest.mark.parametrize("value,error", [(0, ValueError), (-4, ValueError), (2.0, TypeError), (True, TypeError),
                                         ("8", TypeError)])
def test_num_features_must_be_a_positive_integer(value, error):
    with pytest.raises(error, match="num_features must be a positive integer"):
        ka.make_estimator("positive", num_features=value)


def test_estimator_options():
    with pytest.raises(ValueError, match="num_features must be a multiple of 2 for TrigonometricFeatures"):
        ka.make_estimator("trig", num_features=7)
    with pytest.raises(ValueError, match="eps must be 0 for TrigonometricFeatures"):
        ka.make_estimator("trig", num_features=8, eps=1e-6)
    with pytest.raises(ValueError, match="eps must be non-negative"):
        ka.make_estimator("positive", num_features=8, eps=-1.0)
    with pytest.raises(ValueError, match="unknown sampler 'gauss'; valid values: iid, orthogonal"):
        ka.make_estimator("positive", num_features=8, sampler="gauss")
    with pytest.raises(TypeError, match="rng must be None, a non-negative int seed"):
        ka.make_estimator("positive", num_features=8, rng="seed").fit(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="rng must be a non-negative integer seed"):
        ka.make_estimator("positive", num_features=8, rng=-1).fit(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="scale must be positive"):
        ka.make_estimator("positive", num_features=8, scale=0.0).fit(torch.zeros(1, 3))


def test_unknown_estimator_lists_the_names():
    with pytest.raises(ValueError, match="unknown estimator 'favor'; available: ") as info:
        ka.make_estimator("favor", num_features=8)
    for name in ("exact", "positive", "positive_orthogonal", "trig", "hyperbolic_qmc"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="unknown estimator"):
        ka.estimator_class(3)


def test_linear_attention_arguments():
    q, k, v = _qkv()
    est = _fitted()
    with pytest.raises(ValueError, match="unknown mode 'fast'; valid values: parallel, recurrent, chunked"):
        ka.linear_attention(q, k, v, est, mode="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        ka.linear_attention(q, k, v, est, chunk_size=0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ka.linear_attention(q, k, v, est, causal=1)
    with pytest.raises(TypeError, match="estimator must be a kernapprox estimator"):
        ka.linear_attention(q, k, v, "positive")
    with pytest.raises(ka.NotFittedError, match="not fitted"):
        ka.linear_attention(q, k, v, ka.make_estimator("positive", num_features=8))
    with pytest.raises(ValueError, match="estimator was fitted with d=6"):
        ka.linear_attention(q, k, v, _fitted(d=6))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        ka.softmax_attention(q, k, v, chunk_size=-1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ka.softmax_attention(q, k, v, causal="yes")


def test_recurrent_state_checks():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="estimator must be a fitted kernapprox feature map"):
        ka.RecurrentState(ka.make_estimator("exact").fit(q))
    with pytest.raises(ka.NotFittedError):
        ka.RecurrentState(ka.make_estimator("positive", num_features=8))
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        ka.RecurrentState(_fitted(), check_finite=None)
    state = ka.RecurrentState(_fitted())
    with pytest.raises(ValueError, match="the state is empty"):
        state.read(q[:, 0])
    with pytest.raises(ValueError, match="k_t contains NaN"):
        state.update(k[:, 0] / 0, v[:, 0])
    with pytest.raises(TypeError, match="v_t has dtype"):
        state.update(k[:, 0], v[:, 0].double())
    with pytest.raises(ValueError, match="k_t and v_t must share batch dimensions"):
        state.update(k[:, 0], v[:1, 0])
    state.update(k[:, 0], v[:, 0])
    with pytest.raises(ValueError, match="do not match the state's batch shape"):
        state.update(k[:1, 0], v[:1, 0])
    with pytest.raises(TypeError, match="k_t has dtype torch.float64 but the state holds torch.float32"):
        state.update(k[:, 0].double(), v[:, 0].double())
    with pytest.raises(ValueError, match="q_t has batch shape"):
        state.read(q[:1, 0])
    with pytest.raises(TypeError, match="q_t has dtype torch.float64"):
        state.read(q[:, 0].double())
    with pytest.raises(ValueError, match="q_t contains NaN"):
        state.read(q[:, 0] / 0)
    assert state.num_tokens == 1


def test_metrics_checks():
    a = torch.ones(3, 3)
    with pytest.raises(ValueError, match="exact contains NaN"):
        ka.metrics.relative_frobenius_error(a, a / 0)
    with pytest.raises(ValueError, match="approx and exact must have the same shape"):
        ka.metrics.relative_rms_error(a, torch.ones(3, 4))
    with pytest.raises(TypeError, match="approx must be a torch.Tensor"):
        ka.metrics.relative_rms_error(np.ones((3, 3)), a)
    # a non-finite approximation is measured, not rejected
    assert float(ka.metrics.relative_frobenius_error(a * float("inf"), a)) == float("inf")


@pytest.mark.parametrize("flag", ["return_parts", "return_lse"])
@pytest.mark.parametrize("value", [1, "yes", None, torch.tensor(True)], ids=["int", "str", "none", "tensor"])
def test_boolean_flags_refuse_truthy_objects(flag, value):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    if flag == "return_lse":
        call = lambda: ka.softmax_attention(q, k, v, return_lse=value)  # noqa: E731
    else:
        est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
        call = lambda: ka.linear_attention(q, k, v, est, return_parts=value)  # noqa: E731
    with pytest.raises(TypeError, match=flag):
        call()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_finite_check_finds_one_bad_entry_anywhere(dtype, bad):
    """The one-pass (aminmax) finite check sees a single NaN/±Inf at the first, a middle and the last entry."""
    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    ka.softmax_attention(x, x, x)
    for index in [(0, 0, 0), (1, 3, 2), (2, 6, 4)]:
        y = x.clone()
        y[index] = bad
        with pytest.raises(ValueError, match="q contains NaN or Inf"):
            ka.softmax_attention(y, x, x)


def test_all_finite_sees_every_kind_of_non_finite_entry():
    from kernapprox.validation import all_finite

    x = torch.randn(3, 5, dtype=torch.float64)
    assert all_finite(x) and all_finite(x.float()) and all_finite(torch.tensor([1e308, -1e308], dtype=torch.float64))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (2, 4), (1, 2)):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (bad, where)
    z = torch.randn(4, requires_grad=True)
    assert all_finite(z * 2)                                      # a tensor that needs grad is read, not traced
