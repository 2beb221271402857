"""Rooflines of the speed targets: the best ratio this machine allows, from the rates measured in the same run.

The chunked mode's work per head for ``n`` tokens (``d`` input dimension, ``r`` features, ``d_v + 1`` value columns
with the normaliser, chunk length ``C``), as executed (not only the "useful" half of the intra-chunk products):

=======================  ======================  =====================================================
part                     FLOPs                   shape of one product
=======================  ======================  =====================================================
projections (q and k)    ``2 · 2ndr``            ``(L × d)(d × r)``
chunk summaries          ``2n(d_v+1)r``          ``((d_v+1) × C)(C × r)``
state reads              ``2nr(d_v+1)``          ``(C × r)(r × (d_v+1))``
intra-chunk scores       ``2nCr`` (causal)       ``(C × r)(r × C)``
intra-chunk values       ``2nC(d_v+1)`` (causal) ``(C × C)(C × (d_v+1))``
=======================  ======================  =====================================================

plus ``2nr`` evaluations of ``exp`` (features of queries and keys) and ``nC`` more when causal (the intra-chunk
weights), and ``4n(2d + d_v)`` bytes of inputs and output (float32) — 1 KiB per token and head, nothing next to
the compute: every target is compute-bound. The non-causal mode runs its summaries and reads over blocks of ``L``
tokens (the compiled kernel's :data:`~kernapprox.attention.native.NONCAUSAL_BLOCK`), not chunks: shapes
``((d_v+1) × L)(L × r)`` and ``(L × r)(r × (d_v+1))``. Two bounds on the time:

``physical``
    every product at the square-GEMM rate ``G`` (2048², the machine's practical peak) and every ``exp`` at the
    fastest ``exp`` rate measured in the run ``X`` (torch's or the compiled kernels' own): ``T = F/G + E/X`` (the
    ``exp`` polynomial runs on the same vector units). A lower bound on any implementation that computes these
    products and ``exp`` on this machine with these two rates as ceilings;
``shapes``
    every product at the rate measured for its own shape (small GEMMs run below ``G``; each shape measured as a
    batched torch product on all threads), and the ``exp`` as above: an estimate of what the chunked mode's own
    shapes allow, not a bound — code that runs a shape faster than the batched torch product (the compiled
    kernels run one single-threaded BLAS product per sequence) can beat it.

The speed-up bound is SDPA's measured time over ``T``; the GEMM-fraction bound is the counted FLOPs
(:func:`kernapprox.timing.linear_attention_flops`, which counts half the intra-chunk scores) over ``T · G``.
"""

from __future__ import annotations

import math

PARTS = {
    "projection": "projection (L*8 x 64)(64 x 256)",
    "summaries": "chunk summaries (65 x C)(C x 256)",
    "reads": "state reads (C x 256)(256 x 65)",
    "scores": "intra-chunk scores (C x 256)(256 x C)",
    "values": "intra-chunk values (C x C)(C x 65)",
    "block_summaries": "block summaries (65 x L)(L x 256)",
    "block_reads": "block reads (L x 256)(256 x 65)",
}
EXP_RATES = ("exp (cache-sized block)", "exp (compiled kernels)")


def chunked_work(n: int, heads: int, d: int, r: int, d_v: int, chunk: int, causal: bool) -> dict:
    """FLOPs per product kind, ``exp`` evaluations and bytes of the chunked mode (features included)."""
    dv1 = d_v + 1
    state = ("summaries", "reads") if causal else ("block_summaries", "block_reads")
    flops = {"projection": 4.0 * n * d * r, state[0]: 2.0 * n * dv1 * r, state[1]: 2.0 * n * r * dv1,
             "scores": 2.0 * n * chunk * r if causal else 0.0, "values": 2.0 * n * chunk * dv1 if causal else 0.0}
    exps = 2.0 * n * r + (n * chunk if causal else 0.0)
    bytes_moved = 4.0 * n * (2 * d + d_v + d_v + 2)
    return {"flops": {k: v * heads for k, v in flops.items()}, "exps": exps * heads, "bytes": bytes_moved * heads}


def training_work(n: int, heads: int, d: int, r: int, d_v: int, chunk: int) -> dict:
    """:func:`chunked_work` for a causal training step as the compiled operators execute it: the forward, then the
    backward (``kernapprox::chunked_causal_backward`` and the features' backward), per product kind.

    The backward runs two passes over the chunks. Forward in time: ``[e^{s−c} h | G] [S; φ̃_K]`` (a state read and
    an intra-chunk score product, ``G = h ṽᵀ`` an intra-chunk value product) and the state ``S`` rebuilt (a
    summary). Backward in time: ``φ̃_K [R; φ̃_Q]ᵀ`` and ``[e^{ℓ−s} ṽ | Gᵀ] [R; φ̃_Q]`` (two reads and two score
    products), ``Gᵀ`` and ``Pᵀh`` (two value products) and the reverse state ``R`` (a summary). The features'
    backward is one ``(L × r)(r × d)`` product per map, counted with the projections. So the step counts the
    forward's projections twice, its summaries three times, its reads, scores and value products four times, and
    ``exp`` ``2nr + 3nC`` times (features once, intra-chunk weights once per pass)."""
    fwd = chunked_work(n, heads, d, r, d_v, chunk, True)
    times = {"projection": 2, "summaries": 3, "reads": 4, "scores": 4, "values": 4}
    flops = {k: v * times[k] for k, v in fwd["flops"].items() if k in times}
    exps = (2.0 * n * r + 3.0 * n * chunk) * heads
    return {"flops": flops, "exps": exps, "bytes": 3 * fwd["bytes"]}


def lower_bounds(work: dict, rates: dict) -> dict:
    """``{"physical": s, "shapes": s}`` (NaN where a rate is missing) from :func:`chunked_work` and the machine
    rates (keys: the labels of :func:`benchmarks.cases.machine`)."""
    g, bw = (rates.get(k, math.nan) for k in ("gemm 2048^2", "memory bandwidth"))
    measured = [rates[k] for k in EXP_RATES if k in rates and math.isfinite(rates[k])]
    x = max(measured) if measured else math.nan
    total = sum(work["flops"].values())
    memory = work["bytes"] / bw
    physical = max(total / g + work["exps"] / x, memory)
    shapes = sum(f / rates.get(PARTS[k], math.nan) for k, f in work["flops"].items() if f) + work["exps"] / x
    return {"physical": physical, "shapes": max(shapes, memory), "memory": memory, "flops": total,
            "exps": work["exps"]}
