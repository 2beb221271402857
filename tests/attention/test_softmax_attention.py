"""Exact softmax attention through SDPA: one call within the memory budget, query chunks beyond it (never a score
matrix larger than the budget, even on SDPA's math backend), masks with torch's conventions checked against a
float64 loop oracle, and rows without keys refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import kernapprox as ka
from kernapprox.attention import exact
from kernapprox.nn import KernelAttention


def inputs(batch, n_q, n_k, d=5, d_v=3, dtype=torch.float64, seed=0, std=1.0):
    g = np.random.default_rng(seed)
    return tuple(torch.from_numpy(g.standard_normal(shape) * s).to(dtype) for shape, s in
                 (((*batch, n_q, d), std), ((*batch, n_k, d), std), ((*batch, n_k, d_v), 1.0)))


def oracle(q, k, v, causal=False, key_padding_mask=None, attn_mask=None, scale=None):
    """Plain float64 loops: logits s·qᵢᵀkⱼ plus the masks' meaning entry by entry, a max-shifted softmax."""
    q, k, v = q.double(), k.double(), v.double()
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, n_q, n_k = q.shape[:-2], q.shape[-2], k.shape[-2]
    full = (*batch, n_q, n_k)
    kpm = None if key_padding_mask is None else key_padding_mask[..., None, :].expand(full)
    am = None if attn_mask is None else attn_mask.expand(full)
    out = torch.empty(*batch, n_q, v.shape[-1], dtype=torch.float64)
    for idx in np.ndindex(*batch):
        for i in range(n_q):
            logits = []
            for j in range(n_k):
                allowed = not (causal and j > i) and not (kpm is not None and bool(kpm[idx][i, j]))
                extra = 0.0
                if am is not None:
                    if am.dtype == torch.bool:
                        allowed = allowed and bool(am[idx][i, j])
                    else:
                        extra = float(am[idx][i, j])
                value = s * float(q[idx][i] @ k[idx][j]) + extra if allowed else -math.inf
                logits.append(value)
            top = max(logits)
            w = torch.tensor([math.exp(a - top) for a in logits], dtype=torch.float64)
            out[idx][i] = (w[:, None] * v[idx]).sum(0) / w.sum()
    return out


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an aten op allocates while active (views of an input, such
    as a broadcast mask's ``expand``, allocate nothing and are not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


class SdpaCalls(TorchDispatchMode):
    """Counts the SDPA kernels called (any backend)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) or "_softmax" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------ dispatch
def test_one_sdpa_call_within_the_budget():
    q, k, v = inputs((2, 3), 40, 40, dtype=torch.float32)
    with SdpaCalls() as spy:
        out = ka.softmax_attention(q, k, v, causal=True)
    assert spy.calls == 1
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))    # it is SDPA


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_beyond_the_budget_no_score_matrix_exceeds_it_even_on_the_math_backend(monkeypatch, causal):
    """Budget lowered to 2^16 bytes (16384 float32 logits): n = 300 with 2 heads (180 000 logits) is chunked; on
    SDPA's math backend, which materialises every chunk's scores, no tensor exceeds the budget, and the result is
    exact (float64 oracle)."""
    monkeypatch.setattr(exact, "SCORE_BUDGET_BYTES", 1 << 16)
    q, k, v = inputs((1, 2), 300, 300, d=8, dtype=torch.float32, seed=1)
    mask = torch.from_numpy(np.random.default_rng(2).random((300, 300)) < 0.8) | torch.eye(300, dtype=torch.bool)
    for kwargs in ({}, {"attn_mask": mask}):
        with sdpa_kernel(SDPBackend.MATH), LargestTensor() as spy:
            out = ka.softmax_attention(q, k, v, causal, **kwargs)
        assert spy.largest <= (1 << 16) // 4 < 2 * 300 * 300, spy.largest
        torch.testing.assert_close(out.double(), oracle(q, k, v, causal, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_exact_against_the_float64_oracle(causal, dtype):
    q, k, v = inputs((2, 2), 23, 23, dtype=dtype, seed=3, std=2.0)
    want = oracle(q, k, v, causal)
    for chunk in (None, 1, 7):
        got = ka.softmax_attention(q, k, v, causal, chunk_size=chunk)
        assert got.dtype == dtype
        if dtype == torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        else:          # half precision: the float32 computation rounded once
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2 * torch.finfo(dtype).eps * 4)


# ----------------------------------------------------------------------------------------------- masks
MASK_CASES = ["padding", "bool", "float", "padding+bool", "padding+float", "broadcast"]


def make_masks(case, batch, n_q, n_k, seed):
    g = np.random.default_rng(seed)
    kpm = torch.from_numpy(g.random((*batch[:1], 1, n_k)) < 0.3)                   # (B, 1, n_k), True = padding
    kpm[..., 0] = False                                                             # every row keeps a key
    allowed = torch.from_numpy(g.random((*batch, n_q, n_k)) < 0.7)
    allowed[..., 0] = True
    additive = torch.from_numpy(g.standard_normal((n_q, n_k)))
    additive[:, 1:][torch.from_numpy(g.random((n_q, n_k - 1)) < 0.3)] = -math.inf
    return {"padding": {"key_padding_mask": kpm}, "bool": {"attn_mask": allowed},
            "float": {"attn_mask": additive}, "padding+bool": {"key_padding_mask": kpm, "attn_mask": allowed},
            "padding+float": {"key_padding_mask": kpm, "attn_mask": additive},
            "broadcast": {"attn_mask": allowed[:1, :1, :1, :]}}[case]


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masks_follow_torch_conventions(case, causal):
    """key_padding_mask True = padding (nn.MultiheadAttention), attn_mask bool True = takes part (SDPA) or float
    additive: equal to the float64 loop oracle, one call or chunked, with and without the log-normaliser."""
    batch, n = (2, 3), 17
    q, k, v = inputs(batch, n, n, seed=4)
    masks = make_masks(case, batch, n, n, 5)
    want = oracle(q, k, v, causal, **masks)
    for chunk in (None, 4):
        got = ka.softmax_attention(q, k, v, causal, chunk_size=chunk, **masks)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        out, lse = ka.softmax_attention(q, k, v, causal, chunk_size=chunk, return_lse=True, **masks)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(lse).all()


def test_masks_match_multihead_attention():
    """The same key_padding_mask and bool attn_mask give nn.MultiheadAttention's output (whose bool attn_mask
    means the opposite, True = excluded)."""
    embed, heads, n = 8, 2, 9
    layer = KernelAttention(embed, heads, "exact", rng=0, dtype=torch.float64)
    ref = torch.nn.MultiheadAttention(embed, heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
        ref.in_proj_bias.zero_()
        ref.out_proj.weight.copy_(layer.out_proj.weight)
        ref.out_proj.bias.zero_()
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((2, n, embed)))
    kpm = torch.zeros(2, n, dtype=torch.bool)
    kpm[0, -3:] = True
    kpm[1, :2] = True
    allowed = torch.from_numpy(np.random.default_rng(7).random((n, n)) < 0.6)
    allowed[:, 3] = True                                          # key 3 is padded in neither sequence
    expected, _ = ref(x, x, x, key_padding_mask=kpm, attn_mask=~allowed, need_weights=False)
    got = layer(x, key_padding_mask=kpm, attn_mask=allowed)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["padding", "bool", "float", "causal+padding"])
def test_a_row_without_keys_raises(case):
    q, k, v = inputs((2,), 6, 6)
    causal = case == "causal+padding"
    kwargs = {}
    if case in ("padding", "causal+padding"):
        kpm = torch.zeros(2, 6, dtype=torch.bool)
        kpm[1, : (1 if causal else 6)] = True        # causal: query 0 of batch 1 sees only key 0, padded
        kwargs["key_padding_mask"] = kpm
    elif case == "bool":
        mask = torch.ones(6, 6, dtype=torch.bool)
        mask[3] = False
        kwargs["attn_mask"] = mask
    else:
        mask = torch.zeros(6, 6, dtype=torch.float64)
        mask[4] = -math.inf
        kwargs["attn_mask"] = mask
    for chunk in (None, 2):
        with pytest.raises(ValueError, match=r"query \d+ \(batch index .*\) has no key to attend to"):
            ka.softmax_attention(q, k, v, causal, chunk_size=chunk, **kwargs)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"key_padding_mask": torch.zeros(2, 6)}, TypeError, "key_padding_mask must have dtype torch.bool"),
    ({"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)}, ValueError, "key_padding_mask must have shape"),
    ({"key_padding_mask": torch.zeros(3, 6, dtype=torch.bool)}, ValueError, "key_padding_mask of shape"),
    ({"key_padding_mask": [[False] * 6] * 2}, TypeError, "key_padding_mask must be a bool torch.Tensor"),
    ({"attn_mask": torch.zeros(6, 6, dtype=torch.int64)}, TypeError, "attn_mask must be bool"),
    ({"attn_mask": torch.zeros(6, 6, dtype=torch.float32)}, TypeError, "attn_mask must be bool"),
    ({"attn_mask": torch.full((6, 6), math.nan, dtype=torch.float64)}, ValueError, "attn_mask .* contains NaN"),
    ({"attn_mask": torch.ones(6, 7, dtype=torch.bool)}, ValueError, "attn_mask of shape"),
    ({"attn_mask": torch.ones(6, dtype=torch.bool)}, ValueError, "attn_mask must have shape"),
    ({"attn_mask": torch.ones(4, 6, 6, dtype=torch.bool)}, ValueError, "attn_mask of shape"),
], ids=["kpm-float", "kpm-length", "kpm-batch", "kpm-list", "int", "float32", "nan", "width", "1d", "enlarges"])
def test_bad_masks_raise_naming_the_argument(kwargs, error, match):
    q, k, v = inputs((2,), 6, 6)
    with pytest.raises(error, match=match):
        ka.softmax_attention(q, k, v, **kwargs)


def test_overflowing_logits_raise():
    q, k, v = inputs((1,), 4, 4, dtype=torch.float32, std=1e20)
    with pytest.raises(ValueError, match="logits"):
        ka.softmax_attention(q, k, v)
