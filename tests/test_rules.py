"""State-update rules (sum, decay, delta, least squares): every mode against the float64 loop oracle for every
registered feature map, masks in every mode, the prefill → decode hand-off, gradients, precision, hostile input.

The table is ``ka.available_estimators()`` × ``ka.available_rules()`` read at collection time, as in
``test_contract.py``: a feature map that declares a rule in ``capabilities().rules`` runs under it in every mode
it declares, causal and (where the rule defines it) non-causal, and agrees with
:func:`kernapprox.linear_attention_naive` to 1e-10 relative in float64 at odd sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.metrics import relative_rms_error
from kernapprox.rules import to_internal

ESTIMATORS = ka.available_estimators()
BATCH, N, D, DV, CHUNK, M = (2, 3), 13, 6, 5, 4, 16      # odd sizes on purpose; N is not a multiple of CHUNK
RULES = {"sum": "sum", "decay": ka.rules.Decay(0.8), "delta": ka.rules.Delta(0.7),
         "least_squares": ka.rules.LeastSquares(0.5)}


def randn(shape, seed, std=1.0, dtype=torch.float64):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape) * std).to(dtype)


def qkv(seed=0, batch=BATCH, n=N, d=D, dv=DV, std=0.5, dtype=torch.float64):
    return randn((*batch, n, d), seed, std, dtype), randn((*batch, n, d), seed + 1, std, dtype), \
        randn((*batch, n, dv), seed + 2, 1.0, dtype)


def make(name, q, k, num_features=M, rng=0):
    if ka.capabilities(name).fixed_dimension:
        num_features = None
    return ka.make_estimator(name, num_features=num_features, rng=rng).fit(q, k)


def rel(a, b) -> float:
    return float(relative_rms_error(a, b).max())


def supports(name, rule_name) -> bool:
    caps = ka.capabilities(name)
    return caps.kind == "features" and rule_name in caps.rules


TABLE = [pytest.param(name, rule, causal, id=f"{name}-{rule}-{'causal' if causal else 'full'}")
         for name in ESTIMATORS for rule in RULES for causal in (True, False)
         if supports(name, rule) and (causal or RULES[rule] == "sum" or RULES[rule].noncausal)]


# ------------------------------------------------------------------------------------------- declarations
def test_rule_declarations():
    assert ka.available_rules() == ["sum", "decay", "delta", "least_squares"]
    for name in ESTIMATORS:
        caps = ka.capabilities(name)
        assert set(caps.rules) <= set(ka.available_rules()) and "sum" in caps.rules
        if caps.kind == "features":
            assert caps.rules == tuple(ka.available_rules()), name
        else:      # the exact kernel and estimators with their own attention keep what they can do: the sum
            assert caps.rules == ("sum",), name
    assert ka.rules.resolve_rule("delta") == ka.rules.Delta(1.0) or ka.rules.resolve_rule("delta").beta == 1.0
    assert ka.rules.resolve_rule("least_squares") == ka.rules.LeastSquares(1.0)
    assert ka.rules.Decay(0.5) == ka.rules.Decay(0.5) != ka.rules.Sum()
    assert [ka.rules.resolve_rule(r).name for r in RULES.values()] == list(RULES)
    assert not ka.rules.Delta().normalized and ka.rules.Decay(0.9).normalized and ka.rules.Decay(0.9).noncausal


# -------------------------------------------------------------------------------------------------- table
@pytest.mark.parametrize("name,rule,causal", TABLE)
def test_every_mode_equals_the_loop_oracle(name, rule, causal):
    q, k, v = qkv(7)
    est = make(name, q, k)
    oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=RULES[rule])
    assert bool(torch.isfinite(oracle).all())
    for mode in est.capabilities().modes:
        out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=CHUNK, rule=RULES[rule])
        assert out.dtype == torch.float64 and out.shape == (*BATCH, N, DV)
        err = rel(out, oracle)
        assert err < 1e-10, f"{mode}: {err:.2e}"


@pytest.mark.parametrize("rule", list(RULES))
def test_more_keys_than_queries_and_many_chunks(rule):
    """Non-causal with n_q ≠ n_k, and causal sequences long enough for many chunks and several feature blocks."""
    q, k, v = qkv(3, batch=(2,), n=70)
    est = ka.make_estimator("positive_orthogonal", num_features=12, rng=1).fit(q, k)
    if RULES[rule] == "sum" or RULES[rule].noncausal:
        q_short = q[:, :9]
        oracle = ka.linear_attention_naive(q_short, k, v, est, False, rule=RULES[rule])
        for mode in ka.MODES:
            assert rel(ka.linear_attention(q_short, k, v, est, False, mode, chunk_size=CHUNK, rule=RULES[rule]),
                       oracle) < 1e-10
    oracle = ka.linear_attention_naive(q, k, v, est, True, rule=RULES[rule])
    for chunk in (1, 3, 16, 100):
        out = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=chunk, rule=RULES[rule])
        assert rel(out, oracle) < 1e-10, chunk


def test_small_feature_blocks(monkeypatch):
    """Blocks of a few chunks (the CPU block length shrunk): states carried across blocks, both ways of computing
    the chunk states of the normalised rules (a loop, or one product when a block holds more than 16 chunks)."""
    import kernapprox.attention.blocks as blocks

    q, k, v = qkv(4, batch=(2,), n=77)
    est = ka.make_estimator("hyperbolic_orthogonal", num_features=8, rng=2).fit(q, k)
    for entries in (2 * 16 * 4 * 3, 1 << 19):
        monkeypatch.setitem(blocks._FEATURES_PER_BLOCK, "cpu", entries)
        for rule in RULES.values():
            for causal in (True, False):
                if not causal and rule != "sum" and not rule.noncausal:
                    continue
                oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=rule)
                out = ka.linear_attention(q, k, v, est, causal, "chunked", chunk_size=CHUNK, rule=rule)
                assert rel(out, oracle) < 1e-10, (entries, rule, causal)


def test_decay_one_is_the_sum_and_decay_weights_recent_keys():
    q, k, v = qkv(5)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    for mode in ka.MODES:
        torch.testing.assert_close(ka.linear_attention(q, k, v, est, True, mode, rule=ka.rules.Decay(1.0)),
                                   ka.linear_attention(q, k, v, est, True, mode), rtol=1e-12, atol=1e-12)
    # γ → 0 keeps only the newest key: y_t → v_t
    out = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=CHUNK, rule=ka.rules.Decay(1e-12))
    torch.testing.assert_close(out, v, rtol=0, atol=1e-9)


def test_least_squares_is_ridge_regression_in_hindsight():
    """The last causal output equals ridge regression on every key (``torch.linalg.lstsq`` of the augmented
    system [K̄; √λ I] W = [V; 0]) read with φ̄(q_n)."""
    q, k, v = qkv(6, batch=(), n=40)
    est = ka.make_estimator("trig_orthogonal", num_features=10, rng=0).fit(q, k)
    ridge = 0.3
    phi_k = est.features(k, "key")
    phi_q = est.features(q, "query")
    ku, qu = phi_k / phi_k.norm(dim=-1, keepdim=True), phi_q / phi_q.norm(dim=-1, keepdim=True)
    a = torch.cat([ku, math.sqrt(ridge) * torch.eye(10, dtype=torch.float64)])
    b = torch.cat([v, torch.zeros(10, DV, dtype=torch.float64)])
    w = torch.linalg.lstsq(a, b).solution
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, True, mode, chunk_size=7, rule=ka.rules.LeastSquares(ridge))
        torch.testing.assert_close(out[-1], qu[-1] @ w, rtol=1e-10, atol=1e-12)


def test_delta_rule_matches_its_recurrence_with_unit_keys():
    """The delta rule of flash-linear-attention's naive recurrence (state ``S ∈ R^{r×d_v}``, ``v ← β(v − Sᵀk)``,
    ``S ← S + k vᵀ``, ``o = Sᵀq``) on unit features, written out here independently of the library."""
    q, k, v = qkv(8, batch=(3,), n=25)
    est = ka.make_estimator("elu1", rng=0).fit(q, k)
    beta = torch.from_numpy(np.random.default_rng(0).uniform(0.1, 1.9, (3, 25)))
    ku = est.features(k, "key")
    qu = est.features(q, "query")
    ku, qu = ku / ku.norm(dim=-1, keepdim=True), qu / qu.norm(dim=-1, keepdim=True)
    s = torch.zeros(3, ku.shape[-1], DV, dtype=torch.float64)
    want = []
    for t in range(25):
        u = beta[:, t, None] * (v[:, t] - torch.einsum("br,brv->bv", ku[:, t], s))
        s = s + ku[:, t, :, None] * u[:, None, :]
        want.append(torch.einsum("br,brv->bv", qu[:, t], s))
    want = torch.stack(want, 1)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK, rule=ka.rules.Delta(beta))
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


# -------------------------------------------------------------------------------------------------- masks
def _padding(seed, shape, first_kept=True):
    pad = torch.from_numpy(np.random.default_rng(seed).random(shape) < 0.35)
    if first_kept:
        pad[..., 0] = False
    return pad


@pytest.mark.parametrize("rule", list(RULES))
def test_key_padding_mask_in_every_mode(rule):
    q, k, v = qkv(9)
    est = ka.make_estimator("positive_orthogonal", num_features=M, rng=0).fit(q, k)
    pad = _padding(1, (*BATCH, N))
    for causal in (True, False):
        if not causal and not (RULES[rule] == "sum" or RULES[rule].noncausal):
            continue
        oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=RULES[rule], key_padding_mask=pad)
        for mode in ka.MODES:
            out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=CHUNK, rule=RULES[rule],
                                      key_padding_mask=pad)
            assert rel(out, oracle) < 1e-10, (causal, mode)
        # broadcast over the head dimension: a (B, 1, n_k) mask
        pad_b = pad[:, :1]
        oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=RULES[rule], key_padding_mask=pad_b)
        out = ka.linear_attention(q, k, v, est, causal, "chunked", chunk_size=CHUNK, rule=RULES[rule],
                                  key_padding_mask=pad_b)
        assert rel(out, oracle) < 1e-10


@pytest.mark.parametrize("rule", list(RULES))
def test_attn_mask_in_the_parallel_mode(rule):
    """Bool masks (True = takes part) for every rule; float additive masks for the normalised rules; combined
    with causal order and padding by "and"."""
    q, k, v = qkv(10)
    est = ka.make_estimator("taylor2", rng=0).fit(q, k)
    gen = np.random.default_rng(2)
    bool_mask = torch.from_numpy(gen.random((BATCH[1], N, N)) < 0.6)      # broadcast over the batch dimension
    bool_mask[..., 0] = True
    float_mask = torch.from_numpy(gen.standard_normal((*BATCH, N, N)))
    float_mask[..., 3] = -math.inf
    pad = _padding(3, (*BATCH, N))
    masks = [bool_mask] + ([float_mask] if ka.rules.resolve_rule(RULES[rule]).normalized else [])
    for mask in masks:
        for causal in (True, False):
            if not causal and not (RULES[rule] == "sum" or RULES[rule].noncausal):
                continue
            oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=RULES[rule], attn_mask=mask,
                                               key_padding_mask=pad)
            out = ka.linear_attention(q, k, v, est, causal, "parallel", rule=RULES[rule], attn_mask=mask,
                                      key_padding_mask=pad)
            assert rel(out, oracle) < 1e-10, (mask.dtype, causal)


def test_causal_attn_mask_equals_causal():
    q, k, v = qkv(11)
    est = ka.make_estimator("nystrom_uniform", num_features=M, rng=0).fit(q, k)
    tril = torch.ones(N, N, dtype=torch.bool).tril()
    for rule in RULES.values():
        want = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=CHUNK, rule=rule)
        if rule == "sum" or rule.noncausal:
            got = ka.linear_attention(q, k, v, est, False, "parallel", rule=rule, attn_mask=tril)
            assert rel(got, want) < 1e-10, rule
        got = ka.linear_attention(q, k, v, est, True, "parallel", rule=rule, attn_mask=tril)
        assert rel(got, want) < 1e-10, rule


@pytest.mark.parametrize("rule", list(RULES))
def test_a_row_without_keys_raises(rule):
    q, k, v = qkv(12)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    pad = torch.zeros(*BATCH, N, dtype=torch.bool)
    pad[1, 2, :3] = True                                       # the first three queries of one entry see nothing
    for mode in ka.MODES:
        with pytest.raises(ValueError, match=r"query 0 \(batch index \(1, 2\)\) has no key"):
            ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK, rule=RULES[rule], key_padding_mask=pad)
    if RULES[rule] == "sum" or RULES[rule].noncausal:
        pad_all = pad.clone()
        pad_all[0, 1] = True
        for mode in ka.MODES:
            with pytest.raises(ValueError, match="has no key"):
                ka.linear_attention(q, k, v, est, False, mode, rule=RULES[rule], key_padding_mask=pad_all)
    mask = torch.ones(N, N, dtype=torch.bool)
    mask[5] = False
    with pytest.raises(ValueError, match=r"query 5 .* has no key"):
        ka.linear_attention(q, k, v, est, True, "parallel", rule=RULES[rule], attn_mask=mask)
    # an initial state gives every row something to read
    _, state = ka.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], est, True, rule=RULES[rule],
                                   return_state=True)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, True, mode, rule=RULES[rule], key_padding_mask=pad,
                                  initial_state=state)
        assert bool(torch.isfinite(out).all())


def test_mask_arguments_are_checked():
    q, k, v = qkv(13)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    pad = torch.zeros(*BATCH, N, dtype=torch.bool)
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        ka.linear_attention(q, k, v, est, True, key_padding_mask=pad.double())
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        ka.linear_attention(q, k, v, est, True, key_padding_mask=pad[..., :-1])
    with pytest.raises(ValueError, match="does not broadcast"):
        ka.linear_attention(q, k, v, est, True, key_padding_mask=torch.zeros(4, N, dtype=torch.bool))
    mask = torch.ones(N, N, dtype=torch.bool)
    for mode in ("recurrent", "chunked"):
        with pytest.raises(ValueError, match="parallel mode only"):
            ka.linear_attention(q, k, v, est, True, mode, attn_mask=mask)
    with pytest.raises(TypeError, match="attn_mask must be bool or have the inputs' dtype"):
        ka.linear_attention(q, k, v, est, True, "parallel", attn_mask=mask.float())
    with pytest.raises(ValueError, match="does not broadcast"):
        ka.linear_attention(q, k, v, est, True, "parallel", attn_mask=mask[:, :-1])
    bad = torch.zeros(N, N, dtype=torch.float64)
    bad[2, 2] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        ka.linear_attention(q, k, v, est, True, "parallel", attn_mask=bad)
    for rule in (ka.rules.Delta(0.5), ka.rules.LeastSquares(1.0)):
        with pytest.raises(ValueError, match="bool attn_mask only"):
            ka.linear_attention(q, k, v, est, True, "parallel", rule=rule, attn_mask=torch.zeros(N, N).double())
    with pytest.raises(ValueError, match="no single final state"):
        ka.linear_attention(q, k, v, est, True, "parallel", attn_mask=mask, return_state=True)


# --------------------------------------------------------------------------------------- prefill → decode
@pytest.mark.parametrize("rule", list(RULES))
def test_chunked_prefill_then_recurrent_decode_equals_one_pass(rule):
    """A prompt of 29 tokens processed by the chunked mode (padded keys included), its final state handed to a
    RecurrentState that decodes the remaining tokens one by one: the outputs equal one causal pass over all."""
    q, k, v = qkv(14, n=41)
    est = ka.make_estimator("positive_orthogonal", num_features=M, rng=0).fit(q, k)
    pad = _padding(5, (*BATCH, 41))
    prompt = 29
    for padding in (None, pad):
        whole = ka.linear_attention(q, k, v, est, True, "parallel", rule=RULES[rule], key_padding_mask=padding)
        head = None if padding is None else padding[..., :prompt]
        y, state = ka.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], est, True,
                                       "chunked", chunk_size=CHUNK, rule=RULES[rule], key_padding_mask=head,
                                       return_state=True)
        torch.testing.assert_close(y, whole[..., :prompt, :], rtol=1e-10, atol=1e-12)
        decoder = ka.RecurrentState(est, rule=RULES[rule], initial_state=state)
        steps = [decoder.step(q[..., t, :], k[..., t, :], v[..., t, :],
                              key_padding_mask=None if padding is None else padding[..., t])
                 for t in range(prompt, 41)]
        torch.testing.assert_close(torch.stack(steps, -2), whole[..., prompt:, :], rtol=1e-10, atol=1e-12)
        # every mode continues from the same state
        for mode in ka.MODES:
            tail = ka.linear_attention(q[..., prompt:, :], k[..., prompt:, :], v[..., prompt:, :], est, True, mode,
                                       chunk_size=CHUNK, rule=RULES[rule], initial_state=state,
                                       key_padding_mask=None if padding is None else padding[..., prompt:])
            torch.testing.assert_close(tail, whole[..., prompt:, :], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", list(RULES))
def test_final_states_agree_across_modes_and_with_the_decoder(rule):
    q, k, v = qkv(15)
    est = ka.make_estimator("trig_orthogonal", num_features=M, rng=0).fit(q, k)
    states = {mode: ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK, rule=RULES[rule],
                                        return_state=True)[1] for mode in ka.MODES}
    decoder = ka.RecurrentState(est, rule=RULES[rule])
    for t in range(N):
        decoder.update(k[..., t, :], v[..., t, :])
    states["decoder"] = decoder.state
    want = states["parallel"]
    assert type(want) is ka.rules.resolve_rule(RULES[rule]).state_type
    for mode, state in states.items():
        for got, ref in zip(state, want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=f"{mode}")
    assert decoder.state_bytes() == sum(t.numel() * 8 for t in want)


def test_recurrent_state_snapshot_and_restore():
    q, k, v = qkv(16)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    for rule in RULES.values():
        dec = ka.RecurrentState(est, rule=rule)
        for t in range(5):
            dec.update(k[..., t, :], v[..., t, :])
        snap = dec.state
        first = dec.step(q[..., 5, :], k[..., 5, :], v[..., 5, :])
        dec.state = snap
        torch.testing.assert_close(dec.step(q[..., 5, :], k[..., 5, :], v[..., 5, :]), first)
        with pytest.raises((TypeError, ValueError)):
            dec.state = (snap[0][..., :-1, :],) + tuple(snap[1:])


def test_padded_decoder_steps_and_empty_reads():
    q, k, v = qkv(17)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    dec = ka.RecurrentState(est)
    pad = torch.zeros(BATCH, dtype=torch.bool)
    pad[0, 1] = True
    dec.update(k[..., 0, :], v[..., 0, :], key_padding_mask=pad)
    with pytest.raises(ValueError, match="holds no key"):
        dec.read(q[..., 0, :])
    assert math.isinf(float(dec.state.log_scale[0, 1])) and float(dec.state.log_scale[0, 1]) < 0
    dec.update(k[..., 1, :], v[..., 1, :])
    out = dec.read(q[..., 1, :])
    want = ka.linear_attention(q[..., 1:2, :], k[..., :2, :], v[..., :2, :], est, False,
                               key_padding_mask=torch.stack([pad, torch.zeros_like(pad)], -1))[..., 0, :]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="empty"):
        ka.RecurrentState(est, rule="delta").read(q[..., 0, :])


# --------------------------------------------------------------------------------------------- per-token β
def test_per_token_beta():
    q, k, v = qkv(18)
    est = ka.make_estimator("oprf_orthogonal", num_features=M, rng=0).fit(q, k)
    beta = torch.from_numpy(np.random.default_rng(1).uniform(0.05, 2.0, (*BATCH, N)))
    rule = ka.rules.Delta(beta)
    oracle = ka.linear_attention_naive(q, k, v, est, True, rule=rule)
    for mode in ka.MODES:
        assert rel(ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK, rule=rule), oracle) < 1e-10
    dec = ka.RecurrentState(est, rule=rule)
    with pytest.raises(ValueError, match="per-token"):
        dec.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    steps = torch.stack([dec.step(q[..., t, :], k[..., t, :], v[..., t, :], beta=beta[..., t]) for t in range(N)], -2)
    assert rel(steps, oracle) < 1e-10
    # a β per head, broadcast over the sequence
    per_head = torch.tensor([0.3, 1.0, 1.7], dtype=torch.float64)[:, None]
    rule = ka.rules.Delta(per_head)
    oracle = ka.linear_attention_naive(q, k, v, est, True, rule=rule)
    assert rel(ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=CHUNK, rule=rule), oracle) < 1e-10


# ---------------------------------------------------------------------------------------- numerics, dtypes
@pytest.mark.parametrize("rule", ["decay", "delta", "least_squares"])
def test_chunked_gradients_equal_the_parallel_mode(rule):
    g = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(0.5 * g.standard_normal((2, 60, 8))) for _ in range(3))
    est = ka.make_estimator("positive_orthogonal", num_features=16, rng=0).fit(q, k)
    grads = {}
    for mode in ("parallel", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ka.linear_attention(*leaves, est, causal=True, mode=mode, chunk_size=8, rule=RULES[rule])
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[mode] = [t.grad for t in leaves]
    for got, want in zip(grads["chunked"], grads["parallel"]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def _growing(n, d, max_sq_norm, dtype, seed=0):
    g = np.random.default_rng(seed)
    radius = (np.sqrt(np.linspace(0, max_sq_norm, n)) * d**0.25)[:, None]
    rows = lambda: g.standard_normal((2, n, d)) / np.linalg.norm(g.standard_normal((2, n, d)), axis=-1,  # noqa: E731
                                                                   keepdims=True) * radius
    q, k = rows(), rows()
    v = g.standard_normal((2, n, DV))
    return (torch.from_numpy(x).to(dtype) for x in (q, k, v))


@pytest.mark.parametrize("rule", ["decay", "delta", "least_squares"])
def test_large_norms_in_float32(rule):
    """‖x‖² up to 400 after scaling, float32: exact-scale positive features overflow/underflow, the rules stay
    finite in every mode and match float64 (the delta and least-squares rules see ℓ cancel exactly)."""
    q, k, v = _growing(64, 16, 400.0, torch.float32)
    est = ka.make_estimator("positive", num_features=64, rng=5).fit(q, k)
    ref = ka.linear_attention(q.double(), k.double(), v.double(), est, True, "recurrent", rule=RULES[rule])
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, True, mode, chunk_size=10, rule=RULES[rule])
        assert out.dtype == torch.float32 and bool(torch.isfinite(out).all()), mode
        assert float((out.double() - ref).abs().max()) < 1e-3 * float(ref.abs().max()), mode


def test_long_decayed_stream_in_float32():
    """8192 tokens at γ = 0.99 in float32: positions enter only within a chunk, so the chunked and recurrent
    modes agree with float64 over the whole stream."""
    q, k, v = _growing(8192, 8, 4.0, torch.float32, seed=1)
    q, k, v = q[:1], k[:1], v[:1]
    est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
    rule = ka.rules.Decay(0.99)
    ref = ka.linear_attention(q.double(), k.double(), v.double(), est, True, "chunked", chunk_size=64, rule=rule)
    out = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=64, rule=rule)
    assert float((out.double() - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    dec = ka.RecurrentState(est, rule=rule)
    for t in range(8192 - 64):
        dec.update(k[:, t], v[:, t])
    tail = torch.stack([dec.step(q[:, t], k[:, t], v[:, t]) for t in range(8192 - 64, 8192)], 1)
    assert float((tail.double() - ref[:, -64:]).abs().max()) < 1e-4 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_computes_in_float32(dtype):
    q, k, v = qkv(19, batch=(2,), n=21)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    for rule in RULES.values():
        want = ka.linear_attention(qh.float(), kh.float(), vh.float(), est, True, "chunked", chunk_size=CHUNK,
                                   rule=rule)
        for mode in ka.MODES:
            out, state = ka.linear_attention(qh, kh, vh, est, True, mode, chunk_size=CHUNK, rule=rule,
                                             return_state=True)
            assert out.dtype == dtype and state.w.dtype == torch.float32
            torch.testing.assert_close(out, want.to(dtype), rtol=1e-2, atol=1e-2)


def test_zero_features_raise_for_unit_feature_rules():
    """DPFP features can be exactly zero (disjoint sign patterns): φ/‖φ‖ does not exist, so the delta and
    least-squares rules raise instead of dividing by zero."""
    est = ka.estimators.DPFPFeatures(nu=1).fit(torch.zeros(1, 2, dtype=torch.float64))
    x = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64)      # (1, 0) has φ = 0 for ν = 1
    v = torch.ones(1, 2, 3, dtype=torch.float64)
    assert float(est.features(x[:, :1], "key").abs().sum()) == 0
    for rule in ("delta", "least_squares"):
        for mode in ka.MODES:
            with pytest.raises(ValueError, match="all zero"):
                ka.linear_attention(x, x, v, est, True, mode, rule=rule)


# ------------------------------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("beta", [0.0, -0.5, 2.5, math.nan, math.inf])
def test_beta_outside_zero_two_raises(beta):
    with pytest.raises(ValueError, match=r"\(0, 2\]"):
        ka.rules.Delta(beta)
    with pytest.raises(ValueError, match=r"\(0, 2\]"):
        ka.rules.Delta(torch.tensor([0.5, beta]))


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_gamma_outside_zero_one_raises(gamma):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ka.rules.Decay(gamma)


@pytest.mark.parametrize("ridge", [0.0, -1.0, math.nan, math.inf])
def test_ridge_not_positive_raises(ridge):
    with pytest.raises(ValueError, match="ridge must be positive"):
        ka.rules.LeastSquares(ridge)


def test_least_squares_refuses_a_ridge_below_the_precision():
    """eps·(1 + n/λ) ≥ 1: no digit of a float32 result is guaranteed (the recursive form would return a value
    several times off without noticing); every mode and the decoder raise, float64 runs."""
    q, k, v = qkv(24, batch=(2,), n=40, dtype=torch.float32)
    est = ka.make_estimator("positive", num_features=16, rng=0).fit(q, k)
    rule = ka.rules.LeastSquares(1e-8)
    for mode in ka.MODES:
        with pytest.raises(ValueError, match="no digit of the result is guaranteed"):
            ka.linear_attention(q, k, v, est, True, mode, rule=rule)
    dec = ka.RecurrentState(est, rule=rule)
    with pytest.raises(ValueError, match="no digit"):
        for t in range(40):
            dec.update(k[:, t], v[:, t])
    out = ka.linear_attention(q.double(), k.double(), v.double(), est, True, "chunked", rule=rule)
    assert bool(torch.isfinite(out).all())


def test_the_precision_guard_counts_the_keys_of_an_initial_state():
    """float32, λ = 1e-4: 1000 keys in one pass raise (eps·(1 + n/λ) ≥ 1 from n ≈ 839); so must a 600-token
    prefill continued by 400 decode steps, or by a second call on 400 keys from the returned state, whose keys are
    read off the state (tr(P⁻¹) − rλ)."""
    q, k, v = qkv(8, batch=(1,), n=1000, dtype=torch.float32)
    est = ka.make_estimator("positive", num_features=16, rng=0).fit(q, k)
    rule = ka.rules.LeastSquares(1e-4)
    with pytest.raises(ValueError, match="no digit"):
        ka.linear_attention(q, k, v, est, True, "chunked", rule=rule)
    _, state = ka.linear_attention(q[:, :600], k[:, :600], v[:, :600], est, True, "chunked", rule=rule,
                                   return_state=True)
    # P is float32 with condition number 1 + n/λ = 6e6: its inverse's trace is good to a few per cent here
    assert abs(rule.keys_in(to_internal(state)) - 600) < 30
    with pytest.raises(ValueError, match="over 1000 keys|over 1000.0 keys|no digit"):
        ka.linear_attention(q[:, 600:], k[:, 600:], v[:, 600:], est, True, "chunked", rule=rule, initial_state=state)
    dec = ka.RecurrentState(est, rule=rule, initial_state=state)
    with pytest.raises(ValueError, match="no digit"):
        for t in range(600, 1000):
            dec.update(k[:, t], v[:, t])
    assert 230 < dec.num_tokens < 400                       # it stops where the total passes the bound, not later
    ka.linear_attention(q[:, 600:700], k[:, 600:700], v[:, 600:700], est, True, "chunked", rule=rule,
                        initial_state=state)                 # 700 keys in all: within the bound, runs


def test_a_state_whose_p_is_not_positive_definite_is_refused():
    """The count read off P needs P positive definite (as it is in exact arithmetic); a P that is not — one entry
    of P⁻¹'s spectrum negative makes tr(P⁻¹) − rλ negative, which a clamp at zero would have counted as no keys —
    raises, in a call from that state and in the decoder, instead of letting the guard pass."""
    q, k, v = qkv(8, batch=(1,), n=6, dtype=torch.float32)
    est = ka.make_estimator("positive", num_features=4, rng=0).fit(q, k)
    rule = ka.rules.LeastSquares(1e-2)
    empty = rule.empty_state((1,), 4, v.shape[-1], torch.float32, q.device)
    assert rule.keys_in(empty) < 1e-9
    p = empty.p.clone()
    p[..., 3, 3] = -0.01                                        # tr(P⁻¹) − rλ = 3λ − 100 − 4λ < 0
    state = ka.rules.LeastSquaresState(empty.w, p)
    with pytest.raises(ValueError, match="not positive definite"):
        rule.keys_in(state)
    for mode in ka.MODES:
        with pytest.raises(ValueError, match="not positive definite"):
            ka.linear_attention(q, k, v, est, True, mode, rule=rule, initial_state=state)
    with pytest.raises(ValueError, match="not positive definite"):
        ka.RecurrentState(est, rule=rule, initial_state=state)


def test_rule_arguments_are_checked():
    for bad in (True, "0.5", None):
        with pytest.raises(TypeError):
            ka.rules.Decay(bad)
        with pytest.raises(TypeError):
            ka.rules.LeastSquares(bad)
    with pytest.raises(TypeError, match="floating-point"):
        ka.rules.Delta(torch.tensor([1, 1]))
    q, k, v = qkv(20)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    with pytest.raises(ValueError, match="unknown rule 'hebbian'"):
        ka.linear_attention(q, k, v, est, True, rule="hebbian")
    with pytest.raises(ValueError, match="needs its γ"):
        ka.linear_attention(q, k, v, est, True, rule="decay")
    with pytest.raises(TypeError, match="rule must be"):
        ka.linear_attention(q, k, v, est, True, rule=0.5)
    with pytest.raises(ValueError, match="does not broadcast"):
        ka.linear_attention(q, k, v, est, True, rule=ka.rules.Delta(torch.full((4, N), 0.5, dtype=torch.float64)))
    with pytest.raises(ValueError, match="beta is a parameter of the delta rule"):
        ka.RecurrentState(est).update(k[..., 0, :], v[..., 0, :], beta=0.5)
    with pytest.raises(ValueError, match=r"\(0, 2\]"):
        ka.RecurrentState(est, rule="delta").update(k[..., 0, :], v[..., 0, :], beta=3.0)


def test_rules_need_a_feature_map():
    q, k, v = qkv(21)
    for name in ("exact", "nystromformer", "window_linear"):
        if name not in ESTIMATORS:
            continue
        est = ka.make_estimator(name, num_features=None if name == "exact" else 8, rng=0).fit(q, k)
        causal = est.capabilities().causal
        with pytest.raises(ValueError, match="rule 'delta' is not supported"):
            ka.linear_attention(q, k, v, est, causal, est.capabilities().modes[0], rule="delta")
        with pytest.raises(ValueError, match="initial_state/return_state"):
            ka.linear_attention(q, k, v, est, causal, est.capabilities().modes[0], return_state=True)
        if est.capabilities().kind == "attention" and not est.capabilities().key_padding:
            with pytest.raises(ValueError, match="takes no key_padding_mask"):
                ka.linear_attention(q, k, v, est, causal, est.capabilities().modes[0],
                                    key_padding_mask=torch.zeros(*BATCH, N, dtype=torch.bool))


@pytest.mark.parametrize("rule", list(RULES))
def test_wrong_initial_states_raise(rule):
    q, k, v = qkv(22)
    est = ka.make_estimator("positive", num_features=M, rng=0).fit(q, k)
    rule = RULES[rule]
    _, state = ka.linear_attention(q, k, v, est, True, rule=rule, return_state=True)
    other = ka.rules.DeltaState(state.w) if not isinstance(state, ka.rules.DeltaState) else \
        ka.rules.LeastSquaresState(state.w, torch.eye(M, dtype=torch.float64).expand(*BATCH, M, M))
    with pytest.raises(TypeError, match="initial_state must be a"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=other)
    with pytest.raises(TypeError, match="initial_state must be a"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=tuple(state))
    wrong_shape = state._replace(w=state.w[..., :-1, :])
    with pytest.raises(ValueError, match=r"initial_state.w has shape"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=wrong_shape)
    wrong_batch = type(state)(*(t[:1] for t in state))
    with pytest.raises(ValueError, match="has shape"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=wrong_batch)
    with pytest.raises(TypeError, match="dtype"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=type(state)(*(t.float() for t in state)))
    nan = state._replace(w=state.w.clone().fill_(math.nan))
    with pytest.raises(ValueError, match="NaN or Inf"):
        ka.linear_attention(q, k, v, est, True, rule=rule, initial_state=nan)
    with pytest.raises(TypeError, match="initial_state must be a"):
        ka.RecurrentState(est, rule=rule, initial_state=other)
    with pytest.raises(ValueError, match="has shape"):
        ka.RecurrentState(est, rule=rule, initial_state=wrong_shape)


# ------------------------------------------------------------------------------------------ memory counts
def test_state_numbers_and_bytes():
    q, k, _ = qkv(23)
    r, d_v = 16, 5
    assert ka.rules.Sum().state_numbers(r, d_v) == r * (d_v + 1)
    assert ka.rules.Decay(0.5).state_numbers(r, d_v) == r * (d_v + 1)
    assert ka.rules.Delta().state_numbers(r, d_v) == r * d_v
    assert ka.rules.LeastSquares().state_numbers(r, d_v) == r * r + r * d_v
    est = ka.make_estimator("positive", num_features=r, rng=0).fit(q, k)
    assert ka.rules.Sum().state_bytes(est, d_v) == est.state_bytes(d_v)
    assert ka.rules.LeastSquares().state_bytes(est, d_v, torch.float64) == (r * r + r * d_v) * 8
    ny = ka.make_estimator("nystrom_uniform", num_features=r, rng=0).fit(q, k)
    landmarks = ny.state_bytes(d_v) - r * (d_v + 1) * 4                      # context: landmarks and whitening
    assert landmarks > 0
    assert ka.rules.Delta().state_bytes(ny, d_v) == r * d_v * 4 + landmarks
    for rule in RULES.values():
        dec = ka.RecurrentState(est, rule=rule)
        dec.update(k[..., 0, :], torch.zeros(*BATCH, d_v, dtype=torch.float64))
        extra = 1 if ka.rules.resolve_rule(rule).normalized else 0            # the stabilising log-scale
        assert dec.state_bytes() == 6 * (ka.rules.resolve_rule(rule).state_numbers(r, d_v) + extra) * 8


def test_delta_exponent_target_from_rows():
    from benchmarks import run as bench_run
    from benchmarks.cases import Row

    rows = [Row("rule_scaling", f"delta n={n}", n, True, 1e-6 * n**1.05, extra={"rule": "delta"})
            for n in (1024, 4096, 32768)]
    rows += [Row("rule_scaling", f"sum n={n}", n, True, 1e-9 * n**2, extra={"rule": "sum"}) for n in (1024, 4096)]
    values = bench_run.evaluate_targets(rows)
    assert values["delta_chunked_exponent"] == pytest.approx(1.05)
