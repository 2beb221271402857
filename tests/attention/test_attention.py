"""Attention: the three linear-attention modes against the float64 oracle and each other, the recurrent state,
exact softmax attention against torch's SDPA (and without an n×n matrix), stabilisation, half precision."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import kernapprox as ka
from kernapprox.attention import exact as exact_attention

MAPS = ("trig", "positive", "hyperbolic")
SHAPES = [((2, 3), 63, 60), ((), 63, 60), ((3,), 17, 5)]  # (batch dims, n, d): odd sizes on purpose
CHUNK = 10  # divides none of the sequence lengths
D_V = 7


def _shape_id(batch, n, d):
    names = ["B", "H"][: len(batch)]
    return "-".join([f"{a}{b}" for a, b in zip(names, batch)] + [f"T{n}", f"D{d}"])


def _inputs(batch, n, d, dtype, *, std=0.5, seed=0, n_k=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, n, d, generator=g, dtype=torch.float64) * std
    k = torch.randn(*batch, n if n_k is None else n_k, d, generator=g, dtype=torch.float64) * std
    v = torch.randn(*batch, n if n_k is None else n_k, D_V, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


MODE_CASES = [
    pytest.param(batch, n, d, causal, name, dtype,
                 id=f"{_shape_id(batch, n, d)}-{'causal' if causal else 'full'}-{name}-{str(dtype)[6:]}")
    for batch, n, d in SHAPES for causal in (False, True) for name in MAPS
    for dtype in (torch.float64, torch.float32)
]


@pytest.mark.parametrize("batch,n,d,causal,name,dtype", MODE_CASES)
def test_modes_agree_with_float64_oracle(batch, n, d, causal, name, dtype):
    """float64: every mode within 1e-10 of the oracle, relative to the output scale max|y|; float32: within 1e-4.

    Inputs are moderate (entries N(0, 0.25); N(0, 0.0625) for trig) so that the trigonometric normaliser, which
    can be ≤ 0, stays well away from zero: each row's normaliser Σ_j a_ij is at least 5% of Σ_j |a_ij|
    (asserted), so the ratio does not amplify rounding.
    """
    q, k, v = _inputs(batch, n, d, dtype, std=0.25 if name == "trig" else 0.5)
    est = ka.make_estimator(name, num_features=64, rng=1).fit(q, k)
    ref = ka.linear_attention_naive(q.double(), k.double(), v.double(), est, causal)
    a = est.features(q.double(), "query") @ est.features(k.double(), "key").transpose(-1, -2)
    if causal:
        a = a.tril()
    assert float((a.sum(-1) / a.abs().sum(-1)).min()) > 0.05
    scale = ref.abs().max()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    outs = {}
    for mode in ka.MODES:
        parts = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=CHUNK, return_parts=True)
        assert parts.output.dtype == dtype and parts.output.shape == (*batch, n, D_V)
        assert bool(torch.isfinite(parts.output).all())
        err = float((parts.output.double() - ref).abs().max() / scale)
        assert err < tol, f"{mode}: {err:.2e}"
        outs[mode] = parts
    for mode in ("recurrent", "chunked"):
        assert float((outs[mode].output.double() - outs["parallel"].output.double()).abs().max() / scale) < tol


SIGNED_MAPS = ("trig_orthogonal", "nystrom_uniform")


@pytest.mark.parametrize("name", SIGNED_MAPS)
def test_signed_maps_modes_within_rounding_times_condition(name):
    """Signed maps with normalisers ≤ 0 or near 0 by cancellation: every mode, and the decoding state
    (:class:`kernapprox.RecurrentState` stepped token by token), agrees with the float64 oracle within the forward
    error bound of a ratio of sums (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, §3.1, Lemma 3.1
    for each sum, then the quotient):

        |ŷ_i − y_i| ≤ c · u · n r · (Σ_j |a_ij| |v_j| + |y_i| Σ_j |a_ij|) / |Σ_j a_ij|,   a_ij = φ(q_i)ᵀφ(k_j),

    with ``u`` float64's unit roundoff and ``c = 4``. This is why a whole model converted to such a map can decode
    differently from its parallel pass while every layer is exact to rounding: rows with a near-zero normaliser
    multiply the rounding by their condition number, and 30 layers compound it. The inputs are wide (entries N(0, 2.25)
    at d = 16) so that the test has its ill-conditioned rows (asserted: some normalisers ≤ 0, some condition
    numbers above 100; Nyström's landmarks come from smaller inputs than it reads, as a model's calibration text is
    not its evaluation text); a mode that dropped, clipped or re-signed a term would be off by O(1) there.
    """
    q, k, v = _inputs((2,), 96, 16, torch.float64, std=1.5, seed=3)
    fit_q, fit_k, _ = _inputs((2,), 64, 16, torch.float64, std=0.3, seed=4)   # landmarks from other, smaller inputs
    est = ka.make_estimator(name, num_features=32, rng=0).fit(fit_q, fit_k)
    fq, fk = est.features(q, "query"), est.features(k, "key")
    a = (fq @ fk.transpose(-1, -2)).tril()
    den = a.sum(-1)
    ref = (a @ v) / den[..., None]
    cond = a.abs().sum(-1) / den.abs()
    assert int((den <= 0).sum()) > 0 and float(cond.max()) > 100           # the test has its hard rows
    u = torch.finfo(torch.float64).eps / 2
    bound = 4 * u * 96 * 32 * (a.abs() @ v.abs() + ref.abs() * a.abs().sum(-1, keepdim=True)) / den.abs()[..., None]
    state = ka.RecurrentState(est)
    outs = {mode: ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK) for mode in ka.MODES}
    outs["RecurrentState.step"] = torch.stack([state.step(q[:, t], k[:, t], v[:, t]) for t in range(96)], 1)
    for mode, y in outs.items():
        excess = float(((y - ref).abs() / bound).max())
        assert excess <= 1.0, f"{mode}: error {excess:.3g} × the bound"


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 63, 100])
def test_chunk_sizes(chunk_size):
    q, k, v = _inputs((2,), 63, 12, torch.float64)
    est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
    ref = ka.linear_attention(q, k, v, est, True, "parallel")
    out = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=chunk_size)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", MAPS)
def test_return_parts_are_exact_scale_sums(name, causal):
    """numerator·exp(log_scale) = Σ_j φ(q_i)ᵀφ(k_j) v_j and normalizer·exp(log_scale) = Σ_j φ(q_i)ᵀφ(k_j) (j ≤ i
    if causal), computed with exact-scale float64 features; the causal modes return the same parts."""
    q, k, v = _inputs((2, 2), 29, 9, torch.float64)
    est = ka.make_estimator(name, num_features=16, rng=2).fit(q, k)
    a = est.features(q, "query") @ est.features(k, "key").transpose(-1, -2)
    if causal:
        a = a.tril()
    want_num, want_den = a @ v, a.sum(-1)
    parts_by_mode = {}
    for mode in ka.MODES:
        p = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=6, return_parts=True)
        torch.testing.assert_close(p.numerator * p.log_scale.exp()[..., None], want_num, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p.normalizer * p.log_scale.exp(), want_den, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p.output, p.numerator / p.normalizer[..., None], rtol=1e-14, atol=0)
        parts_by_mode[mode] = p
    if causal:  # one stabiliser (the running key maximum) in every causal mode
        for mode in ("recurrent", "chunked"):
            torch.testing.assert_close(parts_by_mode[mode].log_scale, parts_by_mode["parallel"].log_scale,
                                       rtol=1e-14, atol=1e-14)


def test_exact_kernel_parts():
    q, k, v = _inputs((2,), 11, 4, torch.float64)
    est = ka.make_estimator("exact").fit(q, k)
    for causal in (False, True):
        p = ka.linear_attention(q, k, v, est, causal, return_parts=True)
        a = ka.kernel_matrix(q, k)
        if causal:
            a = a.tril()
        torch.testing.assert_close(p.numerator * p.log_scale.exp()[..., None], a @ v, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(p.normalizer * p.log_scale.exp(), a.sum(-1), rtol=1e-12, atol=0)
        torch.testing.assert_close(p.output, ka.softmax_attention_naive(q, k, v, causal), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", MAPS)
def test_recurrent_state_steps_equal_causal_mode(name, dtype):
    q, k, v = _inputs((2, 3), 40, 8, dtype)
    est = ka.make_estimator(name, num_features=32, rng=3).fit(q, k)
    want = ka.linear_attention(q, k, v, est, True, "recurrent")
    state = ka.RecurrentState(est)
    got = torch.stack([state.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])], -2)
    assert got.dtype == dtype and state.num_tokens == 40
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert state.state_bytes() == (2 * 3) * (32 * (D_V + 1) + 1) * (8 if dtype == torch.float64 else 4)


# -------------------------------------------------------------------------------------------- causal toy case
def test_causal_toy_case():
    """qk_dim 1, n = 3, q = k = 1, v = (1, 0, 0): every kernel value is equal, so causal attention averages the
    prefix: (1, 1/2, 1/3) exactly; positive features with 10⁴ features must give the same within 0.02 (they in
    fact give it to rounding, because equal keys have equal features)."""
    q = torch.ones(3, 1, dtype=torch.float64)
    k = torch.ones(3, 1, dtype=torch.float64)
    v = torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64)
    want = torch.tensor([[1.0], [0.5], [1 / 3]], dtype=torch.float64)
    exact = ka.linear_attention(q, k, v, ka.make_estimator("exact").fit(q), causal=True)
    torch.testing.assert_close(exact, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(ka.softmax_attention(q, k, v, causal=True), want, rtol=0, atol=1e-15)
    est = ka.make_estimator("positive", num_features=10_000, rng=0).fit(q)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, causal=True, mode=mode, chunk_size=2)
        assert float((out - want).abs().max()) < 0.02


def test_noncausal_small_example_with_distinct_keys():
    """A less degenerate known answer: with 2·10⁴ positive features, small inputs, the output is within 0.02 of
    exact softmax attention (relative RMS; the ratio estimator's O(1/m) bias is far below that)."""
    q, k, v = _inputs((), 6, 3, torch.float64, std=0.4, seed=5)
    est = ka.make_estimator("positive_orthogonal", num_features=20_000, rng=0).fit(q, k)
    out = ka.linear_attention(q, k, v, est)
    assert float(ka.metrics.relative_rms_error(out, ka.softmax_attention(q, k, v))) < 0.02


# ------------------------------------------------------------------------------------------- exact attention
SDPA_CASES = [
    pytest.param(causal, dtype, scale, id=f"{'causal' if causal else 'full'}-{str(dtype)[6:]}-scale{scale}")
    for causal in (False, True) for dtype in (torch.float32, torch.float64) for scale in (None, 0.3)
]


@pytest.mark.parametrize("causal,dtype,scale", SDPA_CASES)
def test_softmax_attention_matches_sdpa(causal, dtype, scale):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 37, 16, generator=g, dtype=dtype)
    k = torch.randn(2, 3, 37, 16, generator=g, dtype=dtype)
    v = torch.randn(2, 3, 37, 24, generator=g, dtype=dtype)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for chunk in (None, 5):
        got = ka.softmax_attention(q, k, v, causal, scale, chunk_size=chunk)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(ka.softmax_attention_naive(q, k, v, causal, scale), want.double(),
                               rtol=tol, atol=tol)
    if not causal:  # more keys than queries
        k2 = torch.randn(2, 3, 50, 16, generator=g, dtype=dtype)
        v2 = torch.randn(2, 3, 50, 24, generator=g, dtype=dtype)
        torch.testing.assert_close(ka.softmax_attention(q, k2, v2, scale=scale, chunk_size=7),
                                   F.scaled_dot_product_attention(q, k2, v2, scale=scale), rtol=tol, atol=tol)


def test_softmax_attention_default_chunk_counts_batch_entries(monkeypatch):
    """The default chunk bounds the logits of all (batch, head) entries together (the budget, lowered here to
    2^24 float32 logits, below the 2·5·1400² of one call), even on SDPA's math backend."""
    monkeypatch.setattr(exact_attention, "SCORE_BUDGET_BYTES", 4 << 24)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 5, 1400, 8, generator=g) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH), _LargestTensor() as spy:
        out = ka.softmax_attention(q, k, v)
    assert spy.largest <= 1 << 24 < 2 * 5 * 1400 * 1400
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_softmax_attention_lse():
    q, k, v = _inputs((2,), 13, 5, torch.float64)
    out, lse = ka.softmax_attention(q, k, v, causal=True, return_lse=True, chunk_size=4)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(5)).masked_fill(torch.ones(13, 13).triu(1).bool(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-13, atol=1e-13)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _check_no_quadratic_memory(n, causal):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g) for _ in range(3))
    chunk = 256
    with _LargestTensor() as spy:
        out = ka.softmax_attention(q, k, v, causal, chunk_size=chunk)
    assert spy.largest <= chunk * n < n * n // 8, spy.largest
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with _LargestTensor() as spy:  # the default chunk holds at most the budget's logits over all batch entries
        out_default = ka.softmax_attention(q, k, v, causal)
    assert spy.largest <= max(exact_attention.SCORE_BUDGET_BYTES // 4, n * 64)
    torch.testing.assert_close(out_default, out, rtol=1e-5, atol=1e-6)


def test_softmax_attention_large_n_without_quadratic_memory():
    """n = 8192: no op returns a tensor larger than chunk × n (= n²/32 here); agrees with SDPA."""
    _check_no_quadratic_memory(8192, causal=True)


def test_softmax_attention_32k_causal_rows_match_direct_computation():
    """n = 32768, d = 64 on the CPU: no op returns more than chunk × n elements (n²/32), and the last rows,
    which see every key, equal a direct float64 computation of just those rows."""
    n, chunk, rows = 32768, 1024, 8
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g) for _ in range(3))
    with _LargestTensor() as spy:
        out = ka.softmax_attention(q, k, v, True, chunk_size=chunk)
    assert spy.largest <= chunk * n == n * n // 32, spy.largest
    assert torch.isfinite(out).all()
    logits = (q[0, 0, -rows:].double() @ k[0, 0].double().T) / 8.0            # (rows, n)
    pos = torch.arange(n - rows, n)[:, None]
    logits = logits.masked_fill(torch.arange(n)[None, :] > pos, -math.inf)
    want = torch.softmax(logits, -1) @ v[0, 0].double()
    torch.testing.assert_close(out[0, 0, -rows:].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_attention_32k(causal):
    _check_no_quadratic_memory(32768, causal)


# ------------------------------------------------------------------------------------------- stabilisation
def _growing_norm_inputs(n, d, max_sq_norm, *, decreasing=False, seed=8, dtype=torch.float32, batch=(2,)):
    """Rows whose squared norm *after* the SDPA scaling (x = d^{-1/4} q) runs linearly from 0 to max_sq_norm."""
    g = torch.Generator().manual_seed(seed)
    sq = torch.linspace(0, max_sq_norm, n, dtype=torch.float64)
    if decreasing:
        sq = sq.flip(0)
    radius = (sq.sqrt() * d**0.25)[:, None]

    def rows():
        x = torch.randn(*batch, n, d, generator=g, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True) * radius

    q, k = rows(), rows()
    v = torch.randn(*batch, n, D_V, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("decreasing", [False, True], ids=["growing", "shrinking"])
@pytest.mark.parametrize("name", ["positive", "hyperbolic"])
def test_stabilised_for_large_norms(name, decreasing):
    """float32, ‖x‖² up to 50 after scaling: kernel matrices and normalised outputs are finite in every mode,
    causal and not, and match the float64 oracle. The causal parallel and chunked modes shift each row by the
    running key maximum, so a row does not lose its keys when a later key has a much larger log-scale."""
    d = 16
    q, k, v = _growing_norm_inputs(96, d, 50.0, decreasing=decreasing)
    est = ka.make_estimator(name, num_features=64, rng=4).fit(q, k)
    km = est.kernel_matrix(q, k)
    assert km.dtype == torch.float32 and bool(torch.isfinite(km).all())
    km64 = est.kernel_matrix(q.double(), k.double())
    torch.testing.assert_close(km.double(), km64, rtol=1e-3, atol=1e-6 * float(km64.abs().max()))
    for causal in (False, True):
        ref = ka.linear_attention_naive(q.double(), k.double(), v.double(), est, causal)
        for mode in ka.MODES:
            out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=CHUNK)
            assert bool(torch.isfinite(out).all()), (causal, mode)
            assert float((out.double() - ref).abs().max()) < 1e-3 * float(ref.abs().max()), (causal, mode)


def test_stabilised_where_exact_scale_features_underflow():
    """‖x‖² up to 400 in float32: exact-scale positive features underflow to 0 (e^{−200}), the stabilised
    computation still gives finite outputs that agree across the three causal modes and the float64 oracle."""
    q, k, v = _growing_norm_inputs(64, 16, 400.0, decreasing=True, batch=())
    est = ka.make_estimator("positive", num_features=64, rng=5).fit(q, k)
    with pytest.raises(ValueError, match="underflow"):      # the naive float32 route would divide 0 by 0: refused
        est.features(k[:1], "key")
    ref = ka.linear_attention_naive(q.double(), k.double(), v.double(), est, True)
    for mode in ka.MODES:
        out = ka.linear_attention(q, k, v, est, True, mode, chunk_size=CHUNK)
        assert bool(torch.isfinite(out).all()), mode
        assert float((out.double() - ref).abs().max()) < 1e-3 * float(ref.abs().max()), mode


def test_recurrent_state_long_stream():
    """5000 tokens, ‖x‖² growing to 50: the token-by-token state stays finite and matches the chunked mode."""
    n = 5000
    q, k, v = _growing_norm_inputs(n, 8, 50.0, batch=(2,))
    est = ka.make_estimator("positive_orthogonal", num_features=32, rng=6).fit(q, k)
    state = ka.RecurrentState(est)
    got = torch.stack([state.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(n)], -2)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(state.state[0]).all())
    want = ka.linear_attention(q, k, v, est, True, "chunked", chunk_size=128)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    want64 = ka.linear_attention(q.double(), k.double(), v.double(), est, True, "chunked", chunk_size=128)
    assert float((got.double() - want64).abs().max()) < 1e-4 * float(want64.abs().max())


# ---------------------------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32(dtype):
    """Half inputs: outputs in the input dtype, equal to the float32 computation on the same (upcast) values,
    rounded once at the end."""
    q, k, v = _inputs((2,), 21, 8, torch.float32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q32, k32, v32 = q.float(), k.float(), v.float()
    est = ka.make_estimator("positive", num_features=32, rng=7).fit(q32, k32)
    for causal in (False, True):
        for mode in ka.MODES:
            out = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=CHUNK)
            assert out.dtype == dtype
            want = ka.linear_attention(q32, k32, v32, est, causal, mode, chunk_size=CHUNK)
            assert torch.equal(out, want.to(dtype)), (causal, mode)
        sm = ka.softmax_attention(q, k, v, causal)
        assert sm.dtype == dtype and torch.equal(sm, ka.softmax_attention(q32, k32, v32, causal).to(dtype))
    km = est.kernel_matrix(q, k)
    assert km.dtype == dtype and torch.equal(km, est.kernel_matrix(q32, k32).to(dtype))
    phi = est.features(q, "query")
    assert phi.dtype == dtype and torch.equal(phi, est.features(q32, "query").to(dtype))
    tilde, log_scale = est.features(q, "query", log_scale=True)
    assert tilde.dtype == torch.float32 and log_scale.dtype == torch.float32
    state = ka.RecurrentState(est)
    y = state.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    assert y.dtype == dtype and state.state[0].dtype == torch.float32


# ------------------------------------------------------------------------------------------------ devices
def test_modes_on_device(device):
    """On every available device (CPU; CUDA when present): the three modes, the recurrent state and exact
    attention agree with the CPU float64 oracles, and one seed gives one draw on every device."""
    q, k, v = _inputs((2,), 33, 12, torch.float32)
    est = ka.make_estimator("hyperbolic_orthogonal", num_features=32, rng=9).fit(q.to(device))
    ref = ka.linear_attention_naive(q.double(), k.double(), v.double(), est, True)
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    for mode in ka.MODES:
        out = ka.linear_attention(qd, kd, vd, est, True, mode, chunk_size=CHUNK)
        assert out.device.type == device.type
        assert float((out.cpu().double() - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    state = ka.RecurrentState(est, check_finite=False)
    steps = torch.stack([state.step(qd[:, t], kd[:, t], vd[:, t]) for t in range(33)], -2)
    assert float((steps.cpu().double() - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    exact = ka.softmax_attention(qd, kd, vd, causal=True, chunk_size=8)
    torch.testing.assert_close(exact.cpu().double(), ka.softmax_attention_naive(q, k, v, True),
                               rtol=1e-5, atol=1e-5)
    cpu_est = ka.make_estimator("hyperbolic_orthogonal", num_features=32, rng=9).fit(q)
    torch.testing.assert_close(est.features(qd).cpu(), cpu_est.features(q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [8, 32], ids=["batched-chunk-states", "sequential-chunk-states"])
def test_chunked_causal_gradients_equal_parallel_mode(chunk_size):
    """Training goes through the chunked mode: its gradients w.r.t. q, k, v equal the parallel mode's (float64),
    for both ways of computing the chunk states (n = 200: 25 chunks of 8, or 7 chunks of 32)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (0.5 * torch.randn(2, 200, 16, generator=g, dtype=torch.float64) for _ in range(3))
    est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
    grads = {}
    for mode in ("parallel", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ka.linear_attention(*leaves, est, causal=True, mode=mode, chunk_size=chunk_size)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[mode] = [t.grad for t in leaves]
    for got, want in zip(grads["chunked"], grads["parallel"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------- the core on given features, and its oracle
CORE_RULES = {"sum": "sum", "decay": ka.rules.Decay(0.85)}


def _features(q, k, name="positive", r=24):
    est = ka.make_estimator(name, num_features=r, rng=1).fit(q, k)
    (pq, lq), (pk, lk) = est.features(q, "query", log_scale=True), est.features(k, "key", log_scale=True)
    return est, pq, lq, pk, lk


@pytest.mark.parametrize("rule", list(CORE_RULES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ka.MODES)
def test_core_on_given_features_matches_the_oracle_and_the_estimator_path(rule, causal, mode):
    """Every fast path of the core on given features equals the float64 oracle (to rounding) and, bit for bit, what
    ``linear_attention`` computes from the estimator (the same algorithm behind both entry points)."""
    q, k, v = _inputs((2, 3), 37, 8, torch.float64)
    est, pq, lq, pk, lk = _features(q, k)
    oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=CORE_RULES[rule])
    parts = ka.attention.linear_attention_from_features(pq, lq, pk, lk, v, causal=causal, mode=mode, chunk_size=8,
                                                        rule=CORE_RULES[rule])
    assert torch.allclose(parts.output, oracle, rtol=1e-10, atol=1e-12)
    same = ka.linear_attention(q, k, v, est, causal, mode, chunk_size=8, rule=CORE_RULES[rule], return_parts=True)
    for got, want in zip(parts, same):
        assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ka.MODES)
def test_core_on_given_features_takes_masks_and_states(causal, mode):
    """Key padding, an initial state and the returned state behave as in ``linear_attention`` (against the oracle:
    prefill then continue equals the whole sequence)."""
    q, k, v = _inputs((2,), 30, 6, torch.float64, seed=3)
    est, pq, lq, pk, lk = _features(q, k, r=16)
    pad = torch.zeros(2, 30, dtype=torch.bool)
    pad[0, 3] = pad[1, 17] = True
    rule = CORE_RULES["decay"]
    oracle = ka.linear_attention_naive(q, k, v, est, causal, rule=rule, key_padding_mask=pad)
    got = ka.attention.linear_attention_from_features(pq, lq, pk, lk, v, causal=causal, mode=mode, chunk_size=7,
                                                      rule=rule, key_padding_mask=pad)
    assert torch.allclose(got.output, oracle, rtol=1e-10, atol=1e-12)
    if causal:
        head, state = ka.attention.linear_attention_from_features(
            pq[:, :12], lq[:, :12], pk[:, :12], lk[:, :12], v[:, :12], causal=True, mode=mode, chunk_size=7,
            rule=rule, return_state=True)
        tail = ka.attention.linear_attention_from_features(
            pq[:, 12:], lq[:, 12:], pk[:, 12:], lk[:, 12:], v[:, 12:], causal=True, mode=mode, chunk_size=7,
            rule=rule, initial_state=state)
        whole = ka.linear_attention_naive(q, k, v, est, True, rule=rule)
        assert torch.allclose(torch.cat([head.output, tail.output], -2), whole, rtol=1e-10, atol=1e-12)


def test_core_on_given_features_refuses_bad_input():
    q, k, v = _inputs((2,), 10, 4, torch.float64)
    _, pq, lq, pk, lk = _features(q, k, r=8)
    core = ka.attention.linear_attention_from_features
    with pytest.raises(ValueError, match="shapes do not fit"):
        core(pq, lq[:, :5], pk, lk, v)
    with pytest.raises(TypeError, match="cast explicitly"):
        core(pq, lq, pk.float(), lk, v)
    with pytest.raises(ValueError, match="unit features"):
        core(pq, lq, pk, lk, v, rule="delta")
    with pytest.raises(ValueError, match="mode"):
        core(pq, lq, pk, lk, v, mode="fast")
    with pytest.raises(ValueError, match="parallel mode only"):
        core(pq, lq, pk, lk, v, mode="chunked", attn_mask=torch.ones(10, 10, dtype=torch.bool))


@pytest.mark.parametrize("rule", list(CORE_RULES))
@pytest.mark.parametrize("causal", [False, True])
def test_core_gradients_equal_the_oracle(rule, causal):
    """Autograd through every fast path (parallel, recurrent, chunked; float64) gives the gradients w.r.t. q, k
    and v of autograd through the loop oracle, for the sum and the decay rule (fla's tests/ops check the same)."""
    q, k, v = _inputs((2,), 13, 5, torch.float64, seed=5)
    est = ka.make_estimator("positive", num_features=12, rng=2).fit(q, k)
    weight = torch.randn(2, 13, D_V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def grads(run):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        (run(*leaves) * weight).sum().backward()
        return [t.grad for t in leaves]

    want = grads(lambda a, b, c: ka.linear_attention_naive(a, b, c, est, causal, rule=CORE_RULES[rule]))
    for mode in ka.MODES:
        got = grads(lambda a, b, c, mode=mode: ka.linear_attention(a, b, c, est, causal, mode, chunk_size=4,
                                                        rule=CORE_RULES[rule]))
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=1e-9, atol=1e-11), mode


@pytest.mark.parametrize("causal", [False, True])
def test_core_on_given_features_gradients_equal_the_oracle(causal):
    """The entry point on given features: gradients w.r.t. the features and values, chunked and recurrent against
    parallel (float64), and the parallel mode against the plain formula."""
    q, k, v = _inputs((2,), 11, 4, torch.float64, seed=6)
    _, pq, lq, pk, lk = _features(q, k, r=8)
    weight = torch.randn(2, 11, D_V, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def grads(run):
        leaves = [t.detach().clone().requires_grad_() for t in (pq, lq, pk, lk, v)]
        (run(*leaves) * weight).sum().backward()
        return [t.grad for t in leaves]

    def plain(a, la, b, lb, c):
        kern = (a @ b.transpose(-1, -2)) * torch.exp(la[..., :, None] + lb[..., None, :])
        if causal:
            kern = kern.tril()
        return (kern @ c) / kern.sum(-1, keepdim=True)

    want = grads(plain)
    for mode in ka.MODES:
        got = grads(lambda *t, mode=mode: ka.attention.linear_attention_from_features(*t, causal=causal, mode=mode,
                                                                           chunk_size=4).output)
        # the query log-scales cancel in the ratio: the fast paths carry them only into the log-scale (no gradient
        # path to the output), the plain formula has a gradient of zero up to rounding
        assert got[1] is None and float(want[1].abs().max()) < 1e-12
        for g, w in zip(got[:1] + got[2:], want[:1] + want[2:]):
            assert torch.allclose(g, w, rtol=1e-9, atol=1e-11), mode


@pytest.mark.parametrize("mode", ka.MODES)
def test_log_feature_core_matches_its_oracle_with_gradients(mode):
    """The per-feature-stabilised core (LARA's) against its loop oracle: outputs and gradients, at log-features
    whose exponentials would overflow unshifted in float32 but are exact after the shift (checked in float64)."""
    g = torch.Generator().manual_seed(7)
    log_q = torch.randn(2, 9, 6, generator=g, dtype=torch.float64) * 3
    log_k = torch.randn(2, 14, 6, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 14, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (log_q, log_k, v)]
        out = fn(*leaves)
        (out * weight).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    def fast(a, b, c):
        num, den, _ = ka.attention.linear_attention_from_log_features(a, b, c, mode=mode, chunk_size=4)
        return num / den[..., None]

    want, want_grads = run(ka.attention.linear_attention_from_log_features_naive)
    got, got_grads = run(fast)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    for g_, w in zip(got_grads, want_grads):
        assert torch.allclose(g_, w, rtol=1e-9, atol=1e-11)
    big = ka.attention.linear_attention_from_log_features((log_q + 80).float(), (log_k + 80).float(), v.float(),
                                                          mode=mode, chunk_size=4)
    assert torch.allclose(big[0] / big[1][..., None], want.float(), rtol=1e-4, atol=1e-5)


def test_block_states_equal_the_token_steps():
    """``add_keys`` over blocks (running maximum) and ``read_queries`` give the state and reads of the one-token
    steps, and a state started at the largest key's log-scale is only added to."""
    from kernapprox.attention.recurrent import add_keys, normalized_step, read_queries
    from kernapprox.rules import Sum
    q, k, v = _inputs((3,), 20, 6, torch.float64, seed=8)
    _, pq, lq, pk, lk = _features(q, k, r=10)
    lk = lk + torch.linspace(-5, 5, 20, dtype=torch.float64)           # the maximum moves: rescaling is exercised
    state = None
    for start in range(0, 20, 6):
        state = add_keys(state, pk[:, start:start + 6], lk[:, start:start + 6], v[:, start:start + 6])
    step = Sum().empty_state((3,), 10, D_V, torch.float64, "cpu")
    for t in range(20):
        step = normalized_step(step, pk[:, t], lk[:, t], v[:, t])
    assert torch.equal(state.log_scale, step.log_scale)
    assert torch.allclose(state.w, step.w, rtol=1e-12) and torch.allclose(state.z, step.z, rtol=1e-12)
    num, den = read_queries(state, pq)
    assert torch.allclose(num, pq @ step.w, rtol=1e-12)
    assert torch.allclose(den, (pq * step.z[:, None, :]).sum(-1), rtol=1e-12)
    fixed = ka.rules.NormalizedState(torch.zeros_like(state.w), torch.zeros_like(state.z), lk.amax(-1))
    fixed = add_keys(fixed, pk, lk, v)
    assert torch.equal(fixed.log_scale, lk.amax(-1))
    assert torch.allclose(fixed.w, state.w, rtol=1e-12)


# (registry name, options, shapes of q, k, v, seed of the inputs): the attention estimators whose implied kernel
# matrix is exactly what their attention normalises
KERNEL_ROW_SUM_CASES = [
    ("eva", {"num_features": 3, "window": 2, "rng": 53}, [(9, 4), (9, 4), (9, 3)], 52),
    ("lara", {"num_features": 6, "num_proposals": 2, "rng": 55}, [(7, 4), (8, 4), (8, 3)], 54),
]


@pytest.mark.parametrize("name, options, shapes, seed", KERNEL_ROW_SUM_CASES, ids=[c[0] for c in KERNEL_ROW_SUM_CASES])
def test_attention_estimator_parts_are_the_kernel_row_sums(name, options, shapes, seed):
    """The normaliser of the parts is ``Σ_m Â_{nm}`` and the numerator ``Â V`` (true scale), in every mode."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in shapes)
    est = ka.make_estimator(name, **options).fit(q, k)
    a = est.kernel_matrix(q, k)
    for mode in ka.capabilities(name).modes:
        parts = ka.linear_attention(q, k, v, est, mode=mode, return_parts=True)
        scale = torch.exp(parts.log_scale)
        torch.testing.assert_close(parts.normalizer * scale, a.sum(-1), rtol=1e-12, atol=0)
        torch.testing.assert_close(parts.numerator * scale[:, None], a @ v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_uniform_attention_is_softmax_attention_at_zero_temperature(causal):
    """The trivial baseline equals its oracle, the float64 loop of softmax attention with every score zero (zero
    queries), and refuses what it cannot average."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 17, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    y = ka.uniform_attention(v, causal=causal)
    assert y.shape == v.shape and y.dtype == v.dtype
    torch.testing.assert_close(y, ka.softmax_attention_naive(torch.zeros_like(q), k, v, causal), rtol=1e-13,
                               atol=1e-14)
    with pytest.raises(ValueError, match="NaN or Inf"):
        ka.uniform_attention(torch.full((4, 2), float("nan")))
    with pytest.raises(ValueError, match="rank >= 2"):
        ka.uniform_attention(torch.ones(4))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ka.uniform_attention(v, causal=1)
