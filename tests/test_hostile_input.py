"""Hostile input: generated bad arguments to every public entry point raise ``ValueError``/``TypeError`` naming
the argument, or are handled correctly; nothing crashes, hangs or returns NaN silently.

Property tests (hypothesis, derandomised so every run draws the same cases) cover the registry, ``fit``,
``features``, both ``kernel_matrix`` functions, ``softmax_attention``, ``linear_attention`` in every mode,
``RecurrentState``, the scikit-learn and ``torch.nn`` adapters, query/key distributions and the experiment CLI.
The corrupted-tensor and view tests run once per registry estimator. "Handled correctly" is checked where bad
input is legitimate: non-contiguous and broadcast (``expand``) views give the results of contiguous copies, and
a non-finite attention output only ever appears in a row whose normaliser
:func:`kernapprox.metrics.nonpositive_normalizer_rate` flags.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernapprox as ka
from kernapprox.metrics import nonpositive_normalizer_rate
from kernapprox.validation import compute_dtype

ROOT = Path(__file__).resolve().parents[1]
ESTIMATORS = ka.available_estimators()
OPTIONS = {"window_linear": {"window": 3}, "scatterbrain": {"window": 3}}   # short windows: the map is used
D, M = 4, 4                                                                 # head dimension, num_features

PROPERTY = settings(derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def examples(n):
    return settings(PROPERTY, max_examples=n)


# ----------------------------------------------------------------------------------------------- helpers
def randn(shape, seed, dtype=torch.float64):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)).to(dtype)


def has_feature_map(est) -> bool:
    return est.capabilities().kind == "features"


def causal_options(est):
    return (False, True) if est.capabilities().causal else (False,)


def size(name):
    """``num_features`` for a registry name: ``M``, or ``None`` where the dimension is fixed by ``d``."""
    return None if ka.capabilities(name).fixed_dimension else M


@functools.cache
def fitted(name):
    """Each registry estimator fitted once on fixed data (d = D); the tests never refit these."""
    return ka.make_estimator(name, num_features=size(name), rng=0, **OPTIONS.get(name, {})).fit(
        randn((2, 9, D), 1), randn((2, 9, D), 2))


def names_argument(exc: BaseException, *names: str) -> bool:
    text = str(exc)
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_])", text) for n in names)


def expect_error(kind, names, fn):
    """``fn()`` raises ``kind`` whose message names one of ``names``."""
    with pytest.raises(kind) as info:
        fn()
    assert names_argument(info.value, *names), f"message does not name {names}: {info.value}"


shapes = st.fixed_dictionaries({
    "batch": st.sampled_from([(), (1,), (2,), (2, 3)]),
    "n": st.integers(1, 7),
    "d_v": st.integers(1, 3),
    "seed": st.integers(0, 2**32 - 1),
})


def qkv(shape, dtype=torch.float64):
    b, n, seed = shape["batch"], shape["n"], shape["seed"]
    return (randn((*b, n, D), seed, dtype), randn((*b, n, D), seed + 1, dtype),
            randn((*b, n, shape["d_v"]), seed + 2, dtype))


# Corruptions of one tensor argument: (name, expected exception). "mismatch" kinds only make sense when the
# function takes several tensors that must agree.
CORRUPTIONS = {
    "nan": ValueError, "inf": ValueError, "-inf": ValueError, "int64": TypeError, "bool": TypeError,
    "complex": TypeError, "numpy": TypeError, "list": TypeError, "none": TypeError, "low_rank": ValueError,
    "empty_sequence": ValueError, "zero_dim": ValueError, "zero_batch": ValueError,
}
MISMATCH = {"meta": ValueError, "float32": TypeError, "float16": TypeError}


def corrupt(t: torch.Tensor, how: str, position: int, min_rank: int = 2):
    if how in ("nan", "inf", "-inf"):
        t = t.clone()
        t.view(-1)[position % t.numel()] = float(how)
        return t
    if how == "int64":
        return t.to(torch.int64)
    if how == "bool":
        return t > 0
    if how == "complex":
        return t.to(torch.complex128)
    if how == "numpy":
        return t.numpy()
    if how == "list":
        return t.tolist()
    if how == "none":
        return None
    if how == "low_rank":
        return t.reshape(-1)[: t.shape[-1]] if min_rank == 2 else t.reshape(-1)[0]
    if how == "empty_sequence":
        return t[..., :0, :] if min_rank == 2 else t[..., :0]
    if how == "zero_dim":
        return t[..., :0]
    if how == "zero_batch":
        return t.unsqueeze(0)[:0]
    if how == "meta":
        return t.to("meta")
    return t.to(getattr(torch, how))


tensor_corruptions = st.sampled_from(sorted(CORRUPTIONS) + sorted(MISMATCH))


# ------------------------------------------------------------------------------------------------ registry
@examples(60)
@given(name=st.text(min_size=0, max_size=12))
def test_unknown_estimator_names_are_refused(name):
    if name in ESTIMATORS:
        return
    expect_error(ValueError, ["estimator"], lambda: ka.make_estimator(name, num_features=M))
    expect_error(ValueError, ["estimator"], lambda: ka.estimator_class(name))


@examples(60)
@given(name=st.sampled_from(ESTIMATORS),
       value=st.one_of(st.integers(-10**12, 0), st.floats(allow_nan=True), st.booleans(), st.just("8"),
                       st.just([8]), st.none()))
def test_bad_num_features(name, value):
    if value is None and ka.capabilities(name).fixed_dimension:
        return                                           # the dimension follows from d: None is the valid value
    kind = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
    expect_error(kind, ["num_features"],
                 lambda: ka.make_estimator(name, num_features=value, **OPTIONS.get(name, {})).fit(randn((6, D), 0)))


@examples(40)
@given(name=st.sampled_from(ESTIMATORS), option=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3,
                                                        max_size=10))
def test_unknown_options_name_the_option(name, option):
    if option in ka.estimators.registry.constructor_options(name):
        return
    expect_error(TypeError, [option], lambda: ka.make_estimator(name, num_features=size(name), **{option: 1}))


@examples(30)
@given(sampler=st.text(max_size=10), family=st.sampled_from(["trig", "positive", "hyperbolic", "oprf", "gerf"]))
def test_unknown_sampler(sampler, family):
    if sampler in ("iid", "orthogonal", "regularized", "sorf", "qmc", "halton"):
        return
    expect_error(ValueError, ["sampler"], lambda: ka.make_estimator(family, num_features=M, sampler=sampler))


@examples(30)
@given(scale=st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf")), st.text(max_size=3)),
       name=st.sampled_from(["positive", "trig_orthogonal", "oprf", "nystrom_uniform", "nystromformer", "exact"]))
def test_bad_scale(scale, name):
    kind = TypeError if isinstance(scale, str) else ValueError
    expect_error(kind, ["scale"],
                 lambda: ka.make_estimator(name, num_features=size(name), scale=scale).fit(randn((2, 8, D), 0)))


def test_available_estimators_is_a_copy():
    names = ka.available_estimators()
    names.append("not-an-estimator")
    names.clear()
    assert ka.available_estimators() == ESTIMATORS and len(ESTIMATORS) > 40


# ------------------------------------------------------------------------------------- fit and features
@pytest.mark.parametrize("name", ESTIMATORS)
@examples(5)
@given(which=st.sampled_from(["q", "k"]), how=tensor_corruptions, shape=shapes, position=st.integers(0, 10**6))
def test_fit_refuses_corrupt_tensors(name, which, how, shape, position):
    q, k, _ = qkv(shape)
    args = {"q": q, "k": k}
    if which == "q" and how in MISMATCH:
        which = "k"                       # a mismatch is reported on the second tensor
    if which == "k" and how == "none":
        which = "q"                       # fit(q, None) is legitimate: one sample for both sides
    args[which] = corrupt(args[which], how, position)
    kind = {**CORRUPTIONS, **MISMATCH}[how]
    est = ka.make_estimator(name, num_features=size(name), rng=0, **OPTIONS.get(name, {}))
    expect_error(kind, [which, "q", "k"], lambda: est.fit(args["q"], args["k"]))


@pytest.mark.parametrize("name", ESTIMATORS)
@examples(5)
@given(how=st.sampled_from(sorted(CORRUPTIONS)), role=st.sampled_from(["query", "key"]), shape=shapes,
       position=st.integers(0, 10**6))
def test_features_refuse_corrupt_tensors(name, how, role, shape, position):
    est = fitted(name)
    x = corrupt(qkv(shape)[0], how, position)
    if not has_feature_map(est):
        assert not hasattr(est, "features"), "an estimator declared without a feature map has a features method"
        return
    expect_error(CORRUPTIONS[how], ["x"], lambda: est.features(x, role))


@examples(40)
@given(name=st.sampled_from(ESTIMATORS), role=st.text(max_size=8), shape=shapes)
def test_unknown_role(name, role, shape):
    est = fitted(name)
    if role in ("query", "key") or not has_feature_map(est):
        return
    expect_error(ValueError, ["role"], lambda: est.features(qkv(shape)[0], role))


@examples(30)
@given(name=st.sampled_from(ESTIMATORS), extra=st.integers(1, 3), shape=shapes)
def test_features_refuse_a_different_dimension(name, extra, shape):
    est = fitted(name)
    if not has_feature_map(est):
        return
    x = randn((*shape["batch"], shape["n"], D + extra), shape["seed"])
    expect_error(ValueError, ["x", "d"], lambda: est.features(x, "query"))


def test_unfitted_estimators_say_so():
    for name in ESTIMATORS:
        est = ka.make_estimator(name, num_features=size(name), **OPTIONS.get(name, {}))
        q, k, v = qkv({"batch": (2,), "n": 5, "d_v": 2, "seed": 0})
        with pytest.raises(ka.NotFittedError):
            ka.linear_attention(q, k, v, est)


@pytest.mark.parametrize("name", [n for n in ESTIMATORS if n.split("_")[0] in ("oprf", "sderf", "nystrom")]
                         + ["aderf", "saderf"])
def test_data_dependent_fit_on_meta_tensors_is_refused(name):
    """Meta tensors carry shapes only: a data-dependent fit cannot run on them and must say so."""
    est = ka.make_estimator(name, num_features=size(name), rng=0)
    expect_error(ValueError, ["q", "meta"], lambda: est.fit(randn((2, 8, D), 0).to("meta")))


# --------------------------------------------------------------------------------------- kernel matrices
@pytest.mark.parametrize("name", ESTIMATORS)
@examples(5)
@given(which=st.sampled_from(["q", "k"]), how=tensor_corruptions, shape=shapes, position=st.integers(0, 10**6))
def test_kernel_matrix_refuses_corrupt_tensors(name, which, how, shape, position):
    est = fitted(name)
    q, k, _ = qkv(shape)
    args = {"q": q, "k": k}
    args[which] = corrupt(args[which], how, position)
    kind = {**CORRUPTIONS, **MISMATCH}[how]
    expect_error(kind, ["q", "k", "x"], lambda: est.kernel_matrix(args["q"], args["k"]))
    expect_error(kind, ["q", "k"], lambda: ka.kernel_matrix(args["q"], args["k"]))


@examples(60)
@given(name=st.sampled_from(ESTIMATORS), batch_q=st.sampled_from([(1,), (2,), (3,), (2, 2)]),
       batch_k=st.sampled_from([(1,), (2,), (3,), (2, 2), ()]), extra_d=st.integers(0, 2), seed=st.integers(0, 99))
def test_kernel_matrix_refuses_mismatched_shapes(name, batch_q, batch_k, extra_d, seed):
    """Batch dimensions must agree exactly (no silent broadcasting); so must d."""
    if batch_q == batch_k and extra_d == 0:
        return
    est = fitted(name)
    q, k = randn((*batch_q, 5, D), seed), randn((*batch_k, 6, D + extra_d), seed + 1)
    expect_error(ValueError, ["q", "k", "x"], lambda: est.kernel_matrix(q, k))
    expect_error(ValueError, ["q", "k"], lambda: ka.kernel_matrix(q, k))


# -------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("name", ESTIMATORS)
@examples(8)
@given(which=st.sampled_from(["q", "k", "v"]), how=tensor_corruptions, shape=shapes, position=st.integers(0, 10**6),
       mode_index=st.integers(0, 2), causal=st.booleans())
def test_linear_attention_refuses_corrupt_tensors(name, which, how, shape, position, mode_index, causal):
    est = fitted(name)
    mode = est.capabilities().modes[mode_index % len(est.capabilities().modes)]
    causal = causal and est.capabilities().causal
    q, k, v = qkv(shape)
    args = {"q": q, "k": k, "v": v}
    args[which] = corrupt(args[which], how, position)
    kind = {**CORRUPTIONS, **MISMATCH}[how]
    expect_error(kind, ["q", "k", "v"],
                 lambda: ka.linear_attention(args["q"], args["k"], args["v"], est, causal, mode, chunk_size=3))
    if name == "exact":
        expect_error(kind, ["q", "k", "v"], lambda: ka.softmax_attention(args["q"], args["k"], args["v"], causal))


MISMATCHES = ["d_qk", "n_kv", "batch_k", "batch_v", "broadcast_q", "causal_lengths", "d_fitted"]


@examples(120)
@given(name=st.sampled_from(ESTIMATORS), mismatch=st.sampled_from(MISMATCHES), shape=shapes,
       mode_index=st.integers(0, 2), causal=st.booleans())
def test_linear_attention_refuses_mismatched_shapes(name, mismatch, shape, mode_index, causal):
    est = fitted(name)
    mode = est.capabilities().modes[mode_index % len(est.capabilities().modes)]
    causal = causal and est.capabilities().causal
    b, n, dv, seed = shape["batch"], shape["n"], shape["d_v"], shape["seed"]
    q, k, v = randn((*b, n, D), seed), randn((*b, n, D), seed + 1), randn((*b, n, dv), seed + 2)
    names = ["q", "k", "v"]
    if mismatch == "d_qk":
        k = randn((*b, n, D + 1), seed)
    elif mismatch == "n_kv":
        v = randn((*b, n + 1, dv), seed)
    elif mismatch == "batch_k":
        k = randn((*b, 2, n, D), seed)
    elif mismatch == "batch_v":
        v = randn((5, n, dv), seed)
    elif mismatch == "broadcast_q":
        q, k, v = randn((1, n, D), seed), randn((3, n, D), seed), randn((3, n, dv), seed)
    elif mismatch == "causal_lengths":
        q, causal, names = randn((*b, n + 1, D), seed), True, ["causal"]
        if not est.capabilities().causal:
            names = ["causal", "Nyströmformer"]
    else:
        q, k = randn((*b, n, D + 2), seed), randn((*b, n, D + 2), seed + 1)
        names = ["q", "d"]
    expect_error(ValueError, names, lambda: ka.linear_attention(q, k, v, est, causal, mode, chunk_size=2))


@examples(80)
@given(name=st.sampled_from(ESTIMATORS),
       argument=st.sampled_from(["mode", "chunk_size", "causal", "estimator"]),
       bad=st.one_of(st.text(max_size=10), st.integers(-5, 0), st.floats(allow_nan=True), st.none(),
                     st.just(1), st.just(np.int64(0))),
       shape=shapes)
def test_linear_attention_refuses_bad_arguments(name, argument, bad, shape):
    est = fitted(name)
    q, k, v = qkv(shape)
    kwargs = {"causal": False, "mode": est.capabilities().modes[0], "chunk_size": 3}
    if argument == "estimator":
        expect_error(TypeError, ["estimator"], lambda: ka.linear_attention(q, k, v, bad))
        return
    if argument == "mode" and bad in ka.MODES or argument == "chunk_size" and isinstance(bad, int) and bad > 0:
        return
    kwargs[argument] = bad
    with pytest.raises((ValueError, TypeError)) as info:
        ka.linear_attention(q, k, v, est, **kwargs)
    assert names_argument(info.value, argument)


@examples(40)
@given(name=st.sampled_from(ESTIMATORS), shape=shapes)
def test_unsupported_modes_are_refused(name, shape):
    est = fitted(name)
    for mode in set(ka.MODES) - set(est.capabilities().modes):
        expect_error(ValueError, ["mode"], lambda mode=mode: ka.linear_attention(*qkv(shape), est, False, mode))


@examples(40)
@given(chunk=st.one_of(st.integers(-10, 0), st.floats(), st.text(max_size=3), st.booleans()),
       scale=st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf"))), shape=shapes)
def test_softmax_attention_refuses_bad_sizes(chunk, scale, shape):
    q, k, v = qkv(shape)
    with pytest.raises((ValueError, TypeError)) as info:
        ka.softmax_attention(q, k, v, chunk_size=chunk)
    assert names_argument(info.value, "chunk_size")
    expect_error(ValueError, ["scale"], lambda: ka.softmax_attention(q, k, v, scale=scale))


# --------------------------------------------------------------------- legitimate but unusual input
def views(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A non-contiguous or broadcast view holding the same values as ``t`` (or as ``t[:1]`` broadcast)."""
    if kind == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "strided":
        return torch.stack([t, torch.zeros_like(t)], dim=-2).flatten(-3, -2)[..., ::2, :]
    return t[:1].expand_as(t)


@pytest.mark.parametrize("name", ESTIMATORS)
@examples(3)
@given(kind=st.sampled_from(["transposed", "strided", "expand"]), shape=shapes, causal=st.booleans())
def test_views_give_the_results_of_contiguous_copies(name, kind, shape, causal):
    est = fitted(name)
    causal = causal and est.capabilities().causal
    shape = {**shape, "batch": (2, *shape["batch"][1:]), "n": max(2, shape["n"])}
    q, k, v = (views(t, kind) for t in qkv(shape))
    assert not q.is_contiguous()
    copies = [t.contiguous() for t in (q, k, v)]
    for mode in est.capabilities().modes:
        got = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=3)
        want = ka.linear_attention(*copies, est, causal, mode, chunk_size=3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(est.kernel_matrix(q, k), est.kernel_matrix(*copies[:2]), rtol=1e-12, atol=0)
    if has_feature_map(est):
        torch.testing.assert_close(est.features(k, "key"), est.features(copies[1], "key"), rtol=1e-12, atol=0)
    refit = ka.make_estimator(name, num_features=size(name), rng=0, **OPTIONS.get(name, {})).fit(
        views(randn((2, 9, D), 1), kind), views(randn((2, 9, D), 2), kind))
    again = ka.make_estimator(name, num_features=size(name), rng=0, **OPTIONS.get(name, {})).fit(
        views(randn((2, 9, D), 1), kind).contiguous(), views(randn((2, 9, D), 2), kind).contiguous())
    for mode in est.capabilities().modes:
        torch.testing.assert_close(ka.linear_attention(*copies, refit, causal, mode),
                                   ka.linear_attention(*copies, again, causal, mode), rtol=1e-12, atol=1e-12,
                                   equal_nan=True)


@pytest.mark.parametrize("name", ESTIMATORS)
@examples(4)
@given(shape=shapes, causal=st.booleans(), std=st.sampled_from([0.0, 1e-6, 1.0, 3.0]))
def test_non_finite_outputs_are_flagged_by_the_normaliser(name, shape, causal, std):
    """Valid input never gives a silent NaN: a non-finite output row has a normaliser ≤ 0 or non-finite."""
    est = fitted(name)
    causal = causal and est.capabilities().causal
    q, k, v = (t * std if i < 2 else t for i, t in enumerate(qkv(shape)))
    for mode in est.capabilities().modes:
        parts = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=3, return_parts=True)
        bad_rows = ~torch.isfinite(parts.output).all(-1)
        flagged = (parts.normalizer <= 0) | ~torch.isfinite(parts.normalizer)
        assert not (bad_rows & ~flagged).any(), f"{name} {mode}: non-finite output with a positive normaliser"
        assert float(nonpositive_normalizer_rate(parts.normalizer).max()) >= float(bad_rows.double().mean(-1).max())


# ----------------------------------------------------------------------------------- norms beyond the dtype
# Scaled squared norms ‖x‖² (x = d^{-1/4} q) that make every family's exact-scale features underflow or overflow
# (e^{±‖x‖²/2}: 1e2 already beyond float16, 1e3 beyond float32, 1e4 beyond float64), that make the exponential
# maps' features of one vector span more than each dtype's range, and the largest the dtype holds (where the
# squares or the logits themselves overflow). Half precision is computed in float32.
HOSTILE_NORMS = {torch.float16: (1e2, 1e3, 1e4, 1e8), torch.bfloat16: (1e2, 1e3, 1e4, 1e30),
                 torch.float32: (1e2, 1e3, 1e4, 1e30), torch.float64: (1e2, 1e3, 1e4, 1e200)}
CAUSE = re.compile(r"underflow|overflow|not finite|singular|no key|diverged", re.I)


def hostile_inputs(sq_norm, dtype, seed=0, n=6):
    g = np.random.default_rng(seed)
    q, k = (g.standard_normal((2, n, D)) for _ in range(2))
    q *= np.sqrt(sq_norm) * D**0.25 / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= np.sqrt(sq_norm) * D**0.25 / np.linalg.norm(k, axis=-1, keepdims=True)
    k[:, :2] = q[:, :2]                                          # aligned pairs: the largest kernel values
    v = g.standard_normal((2, n, 3))
    return tuple(torch.from_numpy(a).to(dtype) for a in (q, k, v))


def correct_or_raise(fn):
    """``fn()``, or None when it raises ``ValueError`` naming the numerical cause (never anything else)."""
    try:
        return fn()
    except ValueError as exc:
        assert CAUSE.search(str(exc)), f"a refusal must name its cause: {exc}"
        return None


def check_positive_attention(out, q, k, v, est, causal):
    """A positive map's output is a convex combination of the values, and where the dtype resolves the logits
    (rounding of the log-scales below 1e-3) it equals the estimator's own value from the float64 log-domain
    path on the same (rounded) inputs."""
    lo, hi = v.double().amin(-2, keepdim=True), v.double().amax(-2, keepdim=True)
    eps = torch.finfo(out.dtype).eps
    slack = 4 * eps * float(v.abs().max())
    assert ((out.double() >= lo - slack) & (out.double() <= hi + slack)).all(), "outside the values' hull"
    from kernapprox.attention.logdomain import log_domain_attention

    want = log_domain_attention(q, k, v, est, causal).output
    spread = float(est.log_features(q.double(), "query")[0].abs().max() + est.log_features(k.double(), "key")[0]
                   .abs().max())
    rounding = torch.finfo(compute_dtype(q.dtype)).eps * spread
    if rounding < 1e-3:
        tol = 50 * (rounding + eps) * float(v.abs().max())
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", list(HOSTILE_NORMS), ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_norms_beyond_the_dtype_are_correct_or_raise(name, dtype):
    """Every estimator at norms where its features underflow and overflow, in every dtype: each call either
    raises ValueError naming the cause, or returns the right thing — exact-scale features finite without rows
    lost to underflow; attention in every mode finite and correct for positive maps (see
    check_positive_attention), finite or flagged by its normaliser for signed ones; kernel matrices never NaN;
    a recurrent state finite or refused."""
    for sq_norm in HOSTILE_NORMS[dtype]:
        q, k, v = hostile_inputs(sq_norm, dtype)
        if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
            continue
        est = correct_or_raise(functools.partial(_fitted_on, name, q, k))
        if est is None:
            continue
        caps = est.capabilities()
        positive_map = caps.positive and caps.kind == "features"
        if caps.kind == "features":
            phi = correct_or_raise(functools.partial(est.features, k, "key"))
            if phi is not None:
                assert phi.dtype == dtype and torch.isfinite(phi).all()
                tilde, _ = est.features(k, "key", log_scale=True)
                assert not ((phi == 0).all(-1) & (tilde != 0).any(-1)).any(), "a row lost to underflow"
        km = correct_or_raise(functools.partial(est.kernel_matrix, q, k))
        assert km is None or not torch.isnan(km).any(), f"{name} {dtype} ‖x‖²={sq_norm}: NaN in kernel_matrix"
        for causal in causal_options(est):
            for mode in caps.modes:
                parts = correct_or_raise(functools.partial(ka.linear_attention, q, k, v, est, causal, mode,
                                                           chunk_size=4, return_parts=True))
                if parts is None:
                    continue
                where = f"{name} {mode} causal={causal} {dtype} ‖x‖²={sq_norm:g}"
                assert torch.isfinite(parts.log_scale).all(), where
                if positive_map:
                    assert torch.isfinite(parts.output).all(), where
                    check_positive_attention(parts.output, q, k, v, est, causal)
                else:
                    bad = ~torch.isfinite(parts.output).all(-1)
                    flagged = (parts.normalizer <= 0) | ~torch.isfinite(parts.normalizer)
                    assert not (bad & ~flagged).any(), f"{where}: non-finite output with a positive normaliser"
        if positive_map and "recurrent" in caps.modes:
            out = correct_or_raise(functools.partial(_stream, ka.RecurrentState(est), q, k, v))
            assert out is None or torch.isfinite(out).all()


def _fitted_on(name, q, k):
    return ka.make_estimator(name, num_features=size(name), rng=0, **OPTIONS.get(name, {})).fit(q, k)


def _stream(state, q, k, v):
    return torch.stack([state.step(q[:, t], k[:, t], v[:, t]) for t in range(q.shape[1])], 1)


# ---------------------------------------------------------------------------------------- recurrent state
RECURRENT = [n for n in ESTIMATORS
             if "recurrent" in ka.capabilities(n).modes and ka.capabilities(n).kind == "features"]


def test_recurrent_state_refuses_estimators_without_a_feature_map():
    for name in ESTIMATORS:
        est = fitted(name)
        if has_feature_map(est):
            continue
        with pytest.raises((TypeError, ValueError)) as info:
            ka.RecurrentState(est)
        assert names_argument(info.value, "estimator", type(est).__name__), info.value
    with pytest.raises(TypeError):
        ka.RecurrentState("positive")


@examples(150)
@given(name=st.sampled_from(RECURRENT), which=st.sampled_from(["k_t", "v_t", "q_t"]), how=tensor_corruptions,
       batch=st.sampled_from([(), (2,), (2, 3)]), seed=st.integers(0, 10**6), position=st.integers(0, 10**6))
def test_recurrent_state_refuses_corrupt_tensors(name, which, how, batch, seed, position):
    state = ka.RecurrentState(fitted(name))
    k_t, v_t, q_t = randn((*batch, D), seed), randn((*batch, 2), seed + 1), randn((*batch, D), seed + 2)
    state.update(k_t, v_t)
    args = {"k_t": k_t, "v_t": v_t, "q_t": q_t}
    if how == "zero_batch" and not batch:
        how = "zero_dim"
    args[which] = corrupt(args[which], how, position, min_rank=1)
    kind = {**CORRUPTIONS, **MISMATCH}[how]
    if which == "q_t":
        expect_error(kind, ["q_t", "x"], lambda: state.read(args["q_t"]))
    else:
        expect_error(kind, ["k_t", "v_t", "x"], lambda: state.update(args["k_t"], args["v_t"]))
    # the state is unchanged by a refused step
    assert state.num_tokens == 1
    assert torch.isfinite(state.read(q_t)).all() or not fitted(name).capabilities().positive


@examples(40)
@given(name=st.sampled_from(RECURRENT), change=st.sampled_from(["batch", "d_v", "dtype", "d"]),
       seed=st.integers(0, 10**6))
def test_recurrent_state_refuses_a_changed_stream(name, change, seed):
    state = ka.RecurrentState(fitted(name))
    state.update(randn((2, D), seed), randn((2, 3), seed + 1))
    k_t, v_t = randn((2, D), seed + 2), randn((2, 3), seed + 3)
    if change == "batch":
        k_t, v_t = randn((3, D), seed), randn((3, 3), seed)
    elif change == "d_v":
        v_t = randn((2, 4), seed)
    elif change == "dtype":
        k_t, v_t = k_t.float(), v_t.float()
    else:
        k_t = randn((2, D + 1), seed)
    with pytest.raises((ValueError, TypeError)) as info:
        state.update(k_t, v_t)
    assert names_argument(info.value, "k_t", "x")


# ------------------------------------------------------------------------------------ scikit-learn adapter
@examples(60)
@given(bad=st.sampled_from(["nan", "inf", "1d", "3d", "empty", "no_features", "complex", "strings", "wrong_width"]),
       name=st.sampled_from(["positive", "trig_orthogonal", "oprf", "nystrom_uniform", "taylor2", "maclaurin"]),
       seed=st.integers(0, 10**6))
def test_sklearn_adapter_refuses_bad_arrays(bad, name, seed):
    from kernapprox.sklearn import SoftmaxKernelFeatures

    X = np.random.default_rng(seed).standard_normal((12, D))
    size = None if ka.capabilities(name).fixed_dimension else 4        # fixed maps take their own dimension
    model = SoftmaxKernelFeatures(name, size, random_state=0).fit(X)
    Y = {"nan": np.where(X > 1, np.nan, X), "inf": np.where(X > 1, np.inf, X), "1d": X[:, 0], "3d": X[None],
         "empty": X[:0], "no_features": X[:, :0], "complex": X + 1j, "strings": X.astype(str).astype(object) + "x",
         "wrong_width": X[:, :-1]}[bad]
    with pytest.raises(ValueError) as info:
        model.transform(Y)
    assert re.search(r"\bX\b|feature|array|complex|string|NaN|infinity", str(info.value), re.I), info.value
    with pytest.raises(ValueError):
        SoftmaxKernelFeatures(name, size, random_state=0).fit(Y if bad != "wrong_width" else Y[:0])


@examples(60)
@given(argument=st.sampled_from(["estimator", "n_components", "role", "sampler", "random_state", "scale"]),
       bad=st.one_of(st.text(max_size=8), st.integers(-3, 0), st.floats(max_value=0.0), st.just(float("nan"))))
def test_sklearn_adapter_refuses_bad_parameters(argument, bad):
    from kernapprox.sklearn import SoftmaxKernelFeatures

    if argument in ("estimator", "role", "sampler") and not isinstance(bad, str):
        bad = str(bad) + "?"
    if bad in ESTIMATORS + ["query", "key", "iid", "orthogonal", "regularized", "sorf", "qmc", "halton"]:
        return
    if argument == "random_state" and isinstance(bad, int | float) and not isinstance(bad, bool) and bad >= 0:
        return
    params = {"estimator": "positive", "n_components": 4, "random_state": 0, argument: bad}
    with pytest.raises((ValueError, TypeError)) as info:
        SoftmaxKernelFeatures(**params).fit(np.eye(5, D))
    assert names_argument(info.value, argument), info.value


@examples(20)
@given(kind=st.sampled_from(["fortran", "strided", "broadcast", "readonly"]), seed=st.integers(0, 10**6),
       name=st.sampled_from(["positive_orthogonal", "hyperbolic", "sderf", "nystrom_rls", "elu1"]))
def test_sklearn_adapter_views_match_copies(kind, seed, name):
    from kernapprox.sklearn import SoftmaxKernelFeatures

    X = np.random.default_rng(seed).standard_normal((10, D))
    if kind == "fortran":
        V = np.asfortranarray(X)
    elif kind == "strided":
        V = np.repeat(X, 2, axis=0)[::2]
    elif kind == "broadcast":
        X = np.repeat(X[:1], 10, axis=0)
        V = np.broadcast_to(X[:1], X.shape)
    else:
        V = X.copy()
        V.flags.writeable = False
    model = SoftmaxKernelFeatures(name, 4, random_state=0)
    np.testing.assert_allclose(model.fit_transform(V), model.fit_transform(np.ascontiguousarray(X)), rtol=1e-12,
                               atol=0)


# -------------------------------------------------------------------------------------------- nn adapter
def _nn():
    try:
        from kernapprox.nn import KernelAttention
    except ImportError as exc:   # pragma: no cover - the adapter ships with the package
        pytest.skip(f"kernapprox.nn is not importable: {exc}")
    return KernelAttention


@examples(60)
@given(argument=st.sampled_from(["embed_dim", "num_heads", "estimator", "num_features", "mode", "causal",
                                 "chunk_size", "rng"]),
       bad=st.one_of(st.integers(-4, 0), st.text(max_size=6), st.floats(allow_nan=True), st.none()))
def test_nn_adapter_refuses_bad_construction(argument, bad):
    KernelAttention = _nn()
    kwargs = {"embed_dim": 8, "num_heads": 2, "estimator": "positive", "num_features": 4, "mode": "chunked",
              "causal": False, "chunk_size": 4, "rng": 0}
    if argument in ("estimator", "mode") and isinstance(bad, str) and bad in ESTIMATORS + list(ka.MODES):
        return
    if argument == "rng" and (bad is None or bad == 0 and not isinstance(bad, float)):
        return
    kwargs[argument] = bad
    with pytest.raises((ValueError, TypeError)) as info:
        KernelAttention(**kwargs)
    assert names_argument(info.value, argument), info.value


@examples(60)
@given(which=st.sampled_from(["query", "key", "value"]),
       how=st.sampled_from(["int64", "bool", "numpy", "none_key", "low_rank", "wrong_width", "empty_sequence",
                            "zero_batch", "batch", "length", "nan"]),
       name=st.sampled_from(["positive", "oprf", "exact", "nystromformer", "window_linear"]),
       seed=st.integers(0, 10**6))
def test_nn_adapter_refuses_bad_inputs(which, how, name, seed):
    KernelAttention = _nn()
    mode = "parallel" if name == "nystromformer" else "chunked"
    layer = KernelAttention(8, 2, name, num_features=size(name) and 4, mode=mode, rng=0, **OPTIONS.get(name, {}))
    x = {"query": randn((2, 5, 8), seed, torch.float32), "key": randn((2, 6, 8), seed + 1, torch.float32),
         "value": randn((2, 6, 8), seed + 2, torch.float32)}
    t = x[which]
    if how == "none_key":
        if which != "value":
            return
        x["key"] = None                       # value without key: key defaults to query, whose length differs
        x["value"] = randn((2, 7, 8), seed, torch.float32)
        kind, names = ValueError, ["key", "value"]
    elif how == "wrong_width":
        x[which], kind, names = t[..., :-1], ValueError, [which]
    elif how == "batch":
        x[which], kind, names = torch.cat([t, t]), ValueError, [which, "batch"]
    elif how == "length":
        if which == "query":
            return
        x[which], kind, names = t[:, :-1], ValueError, ["key", "value"]
    elif how == "nan":
        x[which] = corrupt(t, "nan", seed)
        kind, names = ValueError, [which, which[0]]
    else:
        x[which] = corrupt(t, how, seed)
        kind, names = {**CORRUPTIONS, **MISMATCH}[how], [which]
    expect_error(kind, names, lambda: layer(x["query"], x["key"], x["value"]))


@pytest.mark.parametrize("how", ["float64", "float16", "meta"])
def test_nn_adapter_refuses_inputs_unlike_its_weights(how):
    KernelAttention = _nn()
    layer = KernelAttention(8, 2, "positive", num_features=4, rng=0)          # float32 weights on the CPU
    x = corrupt(randn((2, 5, 8), 0, torch.float32), how, 0)
    expect_error(ValueError if how == "meta" else TypeError, ["query"], lambda: layer(x))


def test_nn_adapter_accepts_mixed_dtypes_under_autocast():
    KernelAttention = _nn()
    layer = KernelAttention(8, 2, "positive", num_features=4, rng=0)
    x = randn((2, 5, 8), 0, torch.float32).to(torch.bfloat16)          # float32 weights, bfloat16 input
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.shape == (2, 5, 8) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ distributions
@examples(40)
@given(name=st.text(max_size=10), bad=st.sampled_from(["n", "d", "batch", "heads", "device", "dtype", "rng"]),
       value=st.one_of(st.integers(-3, 0), st.text(max_size=5), st.floats(allow_nan=True)))
def test_distributions_refuse_bad_arguments(name, bad, value):
    from kernapprox import distributions

    if name not in distributions.available_distributions():
        expect_error(ValueError, ["distribution"], lambda: distributions.make_distribution(name))
    dist = distributions.make_distribution("isotropic") if "isotropic" in distributions.available_distributions() \
        else distributions.make_distribution(distributions.available_distributions()[0])
    kwargs = {"n": 4, "d": D, "rng": 0}
    if bad == "device" and isinstance(value, str) and value.strip() in ("cpu", "meta", ""):
        value = value + "?"
    if bad == "rng" and isinstance(value, int) and value >= 0:
        value = -1 - value
    kwargs[bad] = value
    with pytest.raises((ValueError, TypeError)) as info:
        dist.sample(**kwargs)
    assert names_argument(info.value, bad), info.value


# ---------------------------------------------------------------------------------------- experiment CLI
def _toy():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.toy_experiment import EXPERIMENT

    return EXPERIMENT


def run_cli_captured(argv):
    """``(exit code, stderr)`` of ``run_cli`` in this process; anything but SystemExit/return propagates."""
    from kernapprox.sweep import run_cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = run_cli(_toy(), argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def _not_a_device(text):
    return not re.fullmatch(r"\s*(auto|cpu(:\d+)?|cuda(:\d+)?)\s*", text)


UNAVAILABLE_DEVICES = ["meta", "mps", "cpu:x", "cuda:-1"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])


CLI_CASES = st.one_of(
    st.tuples(st.just("--preset"), st.text(min_size=1, max_size=8).filter(lambda s: s not in ("smoke", "wide"))),
    st.tuples(st.just("--seeds"), st.one_of(st.integers(-10**30, 0).map(str), st.just(str(10**30)),
                                            st.text(alphabet="abc.-xe", min_size=1, max_size=5))),
    st.tuples(st.just("--workers"), st.one_of(st.integers(-10**6, -1).map(str),
                                              st.text(alphabet="abc.x", min_size=1, max_size=4))),
    st.tuples(st.just("--device"), st.one_of(st.text(min_size=0, max_size=10).filter(_not_a_device),
                                             st.sampled_from(UNAVAILABLE_DEVICES))),
    st.tuples(st.just("--only"), st.one_of(
        st.text(alphabet="abcxyz", min_size=1, max_size=6),                           # no '='
        st.text(alphabet="xyz", min_size=1, max_size=4).map(lambda a: f"{a}=1"),    # unknown axis
        st.sampled_from(["family=z", "size=abc", "size=1.5", "flag=maybe", "scale=nan", "scale=x", "seed=-1",
                         "=a", "family", "scale=inf", "size=99"]))),
)


@examples(120)
@given(case=CLI_CASES)
def test_cli_refuses_bad_options_with_exit_code_2(case, tmp_path_factory):
    option, value = case
    out = tmp_path_factory.mktemp("cli") / "toy.nc"
    code, err = run_cli_captured([option, value, "--out", str(out), "--no-figure", "--quiet",
                                  "--only", "family=a", "--only", "size=1"] if option != "--only"
                                 else [option, value, "--out", str(out), "--no-figure", "--quiet"])
    assert code == 2, (case, code, err)
    assert "Traceback" not in err
    assert option.lstrip("-") in err, err
    assert not out.exists()


def test_cli_error_from_the_command_line_is_a_message_not_a_traceback(tmp_path):
    """The real entry point (``python -m``): exit status 2, one message naming the option, no traceback."""
    result = subprocess.run([sys.executable, "-m", "tests.toy_experiment", "--seeds", "0", "--out",
                             str(tmp_path / "x.nc"), "--no-figure"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "seeds" in result.stderr
    assert not (tmp_path / "x.nc").exists()
