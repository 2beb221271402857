r"""LARA: linear randomized attention (Zheng, Wang & Kong, ICML 2022) — multiple importance sampling of softmax
attention.

Notation: ``x = sqrt(s)·q`` and ``y = sqrt(s)·k`` (``s`` the attention scale, default ``1/sqrt(d)``) so that
``exp(s qᵀk) = exp(xᵀy)``; keys ``y_1..y_M`` with values ``v_m``; ``ξ(x, ω) = exp(ωᵀx − ‖x‖²/2)`` the positive
random feature of Performer Lemma 1; ``N(ω; μ)`` the density of ``N(μ, I_d)`` and ``N(ω) = N(ω; 0)``.

The randomized-attention identity
---------------------------------
Completing the square gives, for any ``x, y`` and ``ω``,

    ``N(ω) ξ(x, ω) ξ(y, ω) = exp(xᵀy) · N(ω; x + y)``                                              (1)

(integrating over ``ω`` is Performer's Lemma 1). Write softmax attention for the query ``x`` as
``SoftmaxAttn(x) = Σ_m π_m v_m`` with ``π_m = exp(xᵀy_m)/Z`` and ``Z = Σ_m exp(xᵀy_m)``. Define the
query-specific density and the query-free function

    ``p_x(ω) = Σ_m π_m N(ω; x + y_m) = N(ω) ξ(x, ω) Σ_m ξ(y_m, ω) / Z``                             (2)
    ``f(ω) = Σ_m ξ(y_m, ω) v_m / Σ_m ξ(y_m, ω)``

(the second form of ``p_x`` is (1) summed over ``m``; ``ξ(x, ω)`` cancels from ``f``, which is the output of
random-feature attention with the single frequency ``ω``). Then ``p_x(ω) f(ω) = N(ω) ξ(x, ω) Σ_m ξ(y_m, ω) v_m / Z``
integrates, by (1), to ``Σ_m π_m v_m``:

    ``SoftmaxAttn(x) = E_{ω ~ p_x}[ f(ω) ]``                          (LARA paper, §3.2, the RA identity)

*Randomized attention* (RA) is its plain Monte-Carlo estimate ``(1/S) Σ_s f(ω_s)`` with ``ω_s ~ p_x`` (draw
``m ~ π``, then ``ω = x + y_m + ε``, ``ε ~ N(0, I)``): **unbiased** for the whole output, with variance
``Var_{p_x}(f)/S`` per coordinate — finite and small, because ``f(ω)`` is a convex combination of the values and
so bounded by them. It is quadratic: every query needs its own ``π`` (``O(M)``) and ``f`` at its own samples
(``O(M)`` each). :func:`randomized_attention_reference` is its oracle.

Random-feature attention is self-normalised importance sampling
---------------------------------------------------------------
Estimating ``E_{p_x} f`` by importance sampling from a proposal ``g`` needs ``p_x/g``, whose ``Z`` is unknown;
self-normalised IS (SNIS) uses the unnormalised ``p̃_x = Z p_x = N(ω) ξ(x, ω) Σ_m ξ(y_m, ω)`` and divides by the
same estimate of ``E_g[p̃_x/g] = Z``:

    ``SNIS_g(x) = Σ_s w_s f(ω_s) / Σ_s w_s``,   ``w_s = p̃_x(ω_s)/g(ω_s)``,   ``ω_s ~ g``.

With the query-agnostic proposal ``g = N(0, I)``, ``w_s = ξ(x, ω_s) Σ_m ξ(y_m, ω_s)`` and ``SNIS_g`` is exactly
random-feature attention with positive features ``ξ(·, ω_s)`` (FAVOR+ when the ``ω_s`` are orthogonal):
**biased** (a ratio of unbiased estimates) and consistent. Its first-order bias and variance are the delta-method
(Owen 2013, §9.2) expressions

    ``E[SNIS] − SoftmaxAttn(x) ≈ −E_g[w² (f − μ)] / (S Z²)``,   ``Var[SNIS] ≈ E_g[w² (f − μ)²] / (S Z²)``

(``μ = SoftmaxAttn(x)``, per coordinate), which for ``g = N(0, I)`` have the closed form
:func:`positive_attention_delta_moments`: ``E_g[w²(f−μ)] = Σ_{m,m'} C_{mm'} (v_m − μ)`` and
``E_g[w²(f−μ)²] = Σ_{m,m'} C_{mm'} (v_m − μ)(v_{m'} − μ)`` with
``C_{mm'} = E ξ(x,ω)² ξ(y_m,ω) ξ(y_{m'},ω) = exp(‖x‖² + 2xᵀ(y_m + y_{m'}) + y_mᵀy_{m'})`` (Gaussian moment
generating function).

LARA: a few data-dependent proposals combined by multiple importance sampling
-------------------------------------------------------------------------------
LARA keeps SNIS's linear structure but replaces the single query-agnostic proposal by ``C`` Gaussian proposals
``g_c(ω) = N(ω; μ_c)`` shared by all queries, and combines them by multiple importance sampling (MIS; Veach &
Guibas 1995): with weighting functions ``α_{nc}(ω)`` that sum to one over ``c`` for every ``ω``,

    ``E_{p_n}[f] = Σ_c E_{g_c}[ α_{nc}(ω) p_n(ω) f(ω) / g_c(ω) ]``                                 (3)

(sum the integrals and use ``Σ_c α_{nc} = 1``). Drawing ``S`` samples ``ω_{cs} ~ g_c`` from each proposal and
self-normalising with ``p̃_n`` as above gives

    ``LARA(x_n) = Σ_{c,s} w_{ncs} f(ω_{cs}) / Σ_{c,s} w_{ncs}``,
    ``w_{ncs} = α_{nc}(ω_{cs}) p̃_n(ω_{cs}) / g_c(ω_{cs})``                        (LARA paper, §4, the estimator)

(the ``1/S`` of each proposal's average cancels). **What is linear in n.** Because
``p̃_n(ω) f(ω) = N(ω) ξ(x_n, ω) Σ_m ξ(y_m, ω) v_m`` and ``N(ω)/g_c(ω) = exp(−ωᵀμ_c + ‖μ_c‖²/2)``, LARA is linear
attention with ``r = C·S`` features, one per sample ``ω_{cs}``:

    ``φ_{cs}(x_n) = α_{nc}(ω_{cs}) · exp(−ω_{cs}ᵀμ_c + ‖μ_c‖²/2) · ξ(x_n, ω_{cs})``  (query side)
    ``φ_{cs}(y_m) = ξ(y_m, ω_{cs})``                                                  (key side)

``LARA(x_n) = Σ_{cs} φ_{cs}(x_n) [Σ_m φ_{cs}(y_m) v_m] / Σ_{cs} φ_{cs}(x_n) [Σ_m φ_{cs}(y_m)]``: the key sums are
shared by every query, so the cost is ``O((N + M) C S d)`` time and ``O(C S d_v)`` state. The implied kernel
estimate ``Â_{nm} = (1/S) Σ_{cs} φ_{cs}(x_n) φ_{cs}(y_m)`` is **unbiased** for ``exp(x_nᵀy_m)`` when the
proposals do not depend on the draws and the weights sum to one (each term of (3) with ``f`` replaced by one key's
share); the output, a ratio, is biased and consistent as ``S`` grows, as for any SNIS estimator.

*Proposal means* (the paper's data-dependent proposals; reference code ``proposal_gen`` "seg-means"/pooling with
no learned layers): split the queries and the keys into ``C`` contiguous segments, take their means ``x̃_c`` and
``ỹ_c``, and set ``μ_c = x̃_c + ỹ_c`` — the mixture ``p_x`` of (2) has its components at ``x + y_m``, so a
segment of nearby queries and a segment of keys place a proposal where the mass of their ``p_x`` lies. Segments
here are ``[⌊cN/C⌋, max(⌊(c+1)N/C⌋, ⌊cN/C⌋ + 1))`` (:func:`segment_bounds`): a partition into near-equal parts when
``N ≥ C``, single (repeated) tokens when ``N < C``. Samples ``ω_{cs} = μ_c + ε_{cs}`` with ``ε ~ N(0, I)``
(``sample=True``, the paper's training-time rule), or ``ω_c = μ_c`` (``sample=False``, its inference-time rule,
which makes LARA a deterministic, biased estimator).

*Training-free variants, not the paper's trained estimator.* The paper's LARA is a layer trained with its model:
the landmarks ``x̃_c, ỹ_c`` pass through learned maps (reference code: a linear layer and LayerNorm after pooling),
the samples ``ω ~ g_c`` are drawn only in training, and at inference every sample is replaced by its proposal's
mean, ``ω_c = μ_c`` (the estimator of §4 evaluated at the means; the authors' code sets the samples to ``μ``
outside training — the paper's own text on this step could not be read here, so the code is the source). Nothing
here is trained: the landmarks are plain segment means (like the reference code's parameter-free pooling option,
which it offers for a pretrained softmax model; its segment boundaries differ where ``C`` does not divide ``N``).
The registered names are therefore training-free variants of the two rules:

``lara``, ``lara_balance``
    the training-time rule (sampled ``ω``), with the paper's query-specific weights or the balance heuristic;
``lara_mean``
    the **inference-time rule** ``ω = μ`` with the query-specific weights — what the paper evaluates, without
    its learned landmark maps. One draw per proposal (``C = r``), deterministic.

A finding about any of them is a finding about this training-free estimator, not about the paper's models.

*Weights* ``α_{nc}``:

``"balance"``
    the balance heuristic ``α_c(ω) = g_c(ω) / Σ_{c'} g_{c'}(ω)`` (query-independent, positive; then
    ``α_c/g_c = 1/Σ_{c'} g_{c'}``: the deterministic-mixture estimator).
``"query"`` (the paper's query-specific weights; reference code ``mis_type="mis-opt"``)
    ``α_{nc}(ω) = max(α_c(ω) + λ (r_{nc} − (1/C) Σ_{c'} r_{nc'}), α_floor)`` with
    ``r_{nc} = exp(x_nᵀx̃_c) / Σ_{n'} exp(x_{n'}ᵀx̃_c)`` — normalised over the *queries*, as in the reference
    code (``softmax`` over the query axis) and a secondary summary of the paper. The correction sums to zero over
    ``c``, so the unclamped weights sum to one; it moves weight towards proposals whose query landmark ``x̃_c``
    is close to ``x_n``. It can make a weight negative; the reference code clamps at ``α_floor = 1e-8`` before
    taking logarithms, and so does this definition (the clamped weights sum to slightly more than one, so the
    kernel estimate is then slightly biased).

Limits (each checked in the tests): one proposal at ``μ = 0`` with the balance heuristic is random-feature
attention with positive features and the frequencies ``ε_s``; proposals equal to a query's own optimal density
``p_n`` (a Gaussian mixture, not a member of LARA's family, so this is a statement about the estimator (3)) make
every importance weight equal to ``Z`` and LARA equal to RA; as ``S → ∞`` LARA converges to softmax attention.

Causality: the estimator is linear attention once the proposals are fixed, but the segment means and the
query normaliser of ``r_{nc}`` use the whole sequence, and the paper and its reference code define LARA for
non-causal attention only ("Supported pattern of the code: Noncausal Self").

What was re-derived and what was checked
----------------------------------------
Re-derived here and verified numerically (``tests/approximate/test_lara.py``): identities (1)–(3), RA's unbiasedness,
RFA as SNIS with ``N(0, I)``, the linear-attention form of LARA, unbiasedness of the implied kernel estimate, the
delta-method moments of positive-feature attention and their closed form. Read in the authors' reference code
(HKUNLP/efficient-attention, ``efficient_attention/lara.py`` and ``randomized_attention.py``): segment-mean
proposals ``μ_c = x̃_c + ỹ_c``, the balance heuristic and the query-specific weights with their clamp, one sample
per proposal (``C`` landmarks = ``C`` samples), ``ω = μ`` at inference. Differences from that code, on purpose:
the noise is ``N(0, I)`` in the scaled units the densities assume (the code adds unit noise before its
``d^{-1/2}`` scaling, so in training its samples do not follow the densities in its weights); no learned layers
on the landmarks. The paper's own numbers are benchmark accuracies of trained models (ImageNet, WMT, LRA),
which this training-free estimator cannot reproduce; nothing here was checked against them. The paper's text was
available only through secondary summaries and its abstract; where they and the code agree (the form of the
query-specific weights) the code was followed.

References
----------
Zheng, Wang & Kong, *Linear Complexity Randomized Self-attention Mechanism*, ICML 2022 (arXiv 2204.04667), §3
(RA), §4 (LARA). Veach & Guibas, *Optimally combining sampling techniques for Monte Carlo rendering*, SIGGRAPH
1995 (balance heuristic). Owen, *Monte Carlo theory, methods and examples*, 2013, ch. 9 (SNIS delta method).
Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import torch

from ..attention.linear import linear_attention_from_log_features
from ..estimators.base import AttentionEstimator, AttentionParts
from ..estimators.registry import register
from ..estimators.samplers import make_sampler
from ..validation import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    check_qk,
    compute_dtype,
    itemsize,
)
from .lowrank import signed_exp

WEIGHTINGS = ("balance", "query")

# What the registry's table says of each rule (capabilities().reference): both are training-free variants.
REFERENCE_SAMPLED = ("Zheng, Wang & Kong 2022 (LARA, ICML) §3 (randomized attention), §4 (multiple importance "
                     "sampling): training-free variant of the training-time rule (sampled ω ~ N(μ_c, I); segment-mean "
                     "landmarks, no learned landmark maps), not the paper's trained estimator")
REFERENCE_MEAN = ("Zheng, Wang & Kong 2022 (LARA, ICML) §4 at ω = μ: training-free variant of the inference-time rule "
                  "(every sample replaced by its proposal mean, as the authors' code evaluates; segment-mean "
                  "landmarks, no learned landmark maps), not the paper's trained estimator")


# --------------------------------------------------------------------------------------------- shared pieces
def segment_bounds(n: int, num_segments: int) -> np.ndarray:
    """``(C, 2)`` integer array of ``[start, stop)`` of the ``C`` contiguous segments of ``n`` tokens:
    ``start_c = ⌊cn/C⌋``, ``stop_c = max(⌊(c+1)n/C⌋, start_c + 1)`` (a partition when ``n ≥ C``)."""
    c = np.arange(num_segments)
    starts = (c * n) // num_segments
    stops = np.maximum(((c + 1) * n) // num_segments, starts + 1)
    return np.stack([starts, stops], axis=1)


def _as_float64(a) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def _log_xi(x, omega):
    """``log ξ(x, ω) = ωᵀx − ‖x‖²/2``."""
    return float(omega @ x - 0.5 * x @ x)


def _f(y, v, omega):
    """``f(ω) = Σ_m ξ(y_m, ω) v_m / Σ_m ξ(y_m, ω)`` by a plain loop."""
    num = np.zeros(v.shape[-1])
    den = 0.0
    for m in range(y.shape[0]):
        w = math.exp(_log_xi(y[m], omega))
        num += w * v[m]
        den += w
    return num / den


def _batched(fn, *arrays):
    """Apply a per-head function over the leading batch dimensions of ``(..., n, ·)`` arrays."""
    batch = arrays[0].shape[:-2]
    outs = [fn(*(a[idx] for a in arrays)) for idx in np.ndindex(*batch)]
    return np.stack(outs).reshape(*batch, *outs[0].shape)


# ---------------------------------------------------------------------------------------------- the oracles
def randomized_attention_reference(q, k, v, num_samples: int, rng, scale: float | None = None) -> np.ndarray:
    """Randomized attention (RA) by a plain float64 loop: ``(1/S) Σ_s f(ω_s)``, ``ω_s ~ p_x`` per query.

    ``p_x`` is sampled as the mixture it is: ``m ~ π = softmax(xᵀy)``, then ``ω = x + y_m + ε``. Quadratic; an
    unbiased estimate of softmax attention. ``q, k, v``: arrays ``(..., n, d)``, ``(..., M, d)``, ``(..., M, d_v)``;
    ``rng``: a numpy ``Generator``.
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)

    def one(qh, kh, vh):
        x, y = root * qh, root * kh
        out = np.zeros((x.shape[0], vh.shape[-1]))
        for n in range(x.shape[0]):
            logits = y @ x[n]
            pi = np.exp(logits - logits.max())
            pi /= pi.sum()
            for _ in range(num_samples):
                m = rng.choice(len(pi), p=pi)
                omega = x[n] + y[m] + rng.standard_normal(x.shape[1])
                out[n] += _f(y, vh, omega)
            out[n] /= num_samples
        return out

    return _batched(one, q, k, v)


def positive_attention_delta_moments(q, k, v, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """First-order bias and variance of positive-random-feature attention with ``S`` i.i.d. ``N(0, I)``
    frequencies, seen as SNIS with the proposal ``N(0, I)`` (module docstring):
    ``E[out] ≈ μ + bias/S`` and ``Var[out] ≈ variance/S`` per coordinate.

    Returns ``(bias, variance)``, each ``(..., n, d_v)``: ``bias = −Σ_{mm'} C_{mm'} (v_m − μ) / Z²`` and
    ``variance = Σ_{mm'} C_{mm'} (v_m − μ)∘(v_{m'} − μ) / Z²`` with
    ``C_{mm'} = exp(‖x‖² + 2xᵀ(y_m + y_{m'}) + y_mᵀy_{m'})``, computed per query with a common shift (float64).
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)

    def one(qh, kh, vh):
        x, y = root * qh, root * kh
        bias = np.zeros((x.shape[0], vh.shape[-1]))
        var = np.zeros_like(bias)
        gram = y @ y.T
        for n in range(x.shape[0]):
            a = y @ x[n]                                           # xᵀy_m
            log_z = np.logaddexp.reduce(a)
            mu = np.exp(a - log_z) @ vh
            log_c = x[n] @ x[n] + 2.0 * (a[:, None] + a[None, :]) + gram - 2.0 * log_z
            c = np.exp(log_c)                                      # C_{mm'} / Z²
            dev = vh - mu                                          # (M, d_v)
            bias[n] = -(c.sum(1) @ dev)
            var[n] = np.einsum("ab,ai,bi->i", c, dev, dev)
        return bias, var

    batch = q.shape[:-2]
    pairs = [one(q[idx], k[idx], v[idx]) for idx in np.ndindex(*batch)]
    bias = np.stack([p[0] for p in pairs]).reshape(*batch, q.shape[-2], v.shape[-1])
    var = np.stack([p[1] for p in pairs]).reshape(*batch, q.shape[-2], v.shape[-1])
    return bias, var


def lara_proposals(q, k, num_proposals: int, scale: float | None = None):
    """Segment-mean proposals of one head by plain loops: ``(x̃, ỹ, μ = x̃ + ỹ)``, each ``(C, d)``, in scaled
    units (float64)."""
    q, k = _as_float64(q), _as_float64(k)
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    x_bar = np.zeros((num_proposals, q.shape[-1]))
    y_bar = np.zeros_like(x_bar)
    for c, (a, b) in enumerate(segment_bounds(q.shape[0], num_proposals)):
        x_bar[c] = sum(root * q[i] for i in range(a, b)) / (b - a)
    for c, (a, b) in enumerate(segment_bounds(k.shape[0], num_proposals)):
        y_bar[c] = sum(root * k[i] for i in range(a, b)) / (b - a)
    return x_bar, y_bar, x_bar + y_bar


def _log_normal(omega, mu):
    """``log N(ω; μ, I)``."""
    diff = omega - mu
    return -0.5 * float(diff @ diff) - 0.5 * len(omega) * math.log(2.0 * math.pi)


def _lara_terms(q, k, noise, num_proposals, weighting, alpha_coeff, alpha_floor, sample, scale):
    """Per head: scaled ``x, y``, samples ``ω (C, S, d)``, proposal means, and a function giving
    ``α_{nc}(ω)`` — everything the LARA oracles share, by plain loops."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    x, y = root * q, root * k
    x_bar, _, mu = lara_proposals(q, k, num_proposals, scale)
    C, S = noise.shape[0], noise.shape[1]
    omega = np.array([[mu[c] + (noise[c, s] if sample else 0.0) for s in range(S)] for c in range(C)])
    r = np.zeros((x.shape[0], C))
    if weighting == "query":
        for c in range(C):
            logits = np.array([x[n] @ x_bar[c] for n in range(x.shape[0])])
            r[:, c] = np.exp(logits - np.logaddexp.reduce(logits))

    def alpha(n, c, w):
        log_g = np.array([_log_normal(w, mu[cc]) for cc in range(C)])
        bh = math.exp(log_g[c] - np.logaddexp.reduce(log_g))
        if weighting == "balance":
            return bh
        return max(bh + alpha_coeff * (r[n, c] - r[n].mean()), alpha_floor)

    return x, y, omega, mu, alpha


def _check_noise(noise, num_proposals, d):
    noise = _as_float64(noise)
    if noise.ndim != 3 or noise.shape[0] != num_proposals or noise.shape[2] != d:
        raise ValueError(f"noise must have shape (num_proposals, samples_per_proposal, d) = ({num_proposals}, S, "
                         f"{d}), got {noise.shape}")
    return noise


def importance_sampling_reference(x, y, v, omegas, log_proposal, weights=None) -> np.ndarray:
    """Self-normalised (multiple) importance sampling of ``E_{p_x} f`` for one query, by a plain loop.

    ``x (d,)``, ``y (M, d)`` scaled query and keys, ``v (M, d_v)``; ``omegas (K, d)`` the draws, ``log_proposal
    (K,)`` the log-density of the proposal each was drawn from at it, ``weights (K,)`` the MIS weights
    ``α(ω_k)`` (default one). Returns ``Σ_k α_k p̃_x(ω_k)/g(ω_k) f(ω_k) / Σ_k α_k p̃_x(ω_k)/g(ω_k)`` with
    ``p̃_x(ω) = N(ω) ξ(x, ω) Σ_m ξ(y_m, ω)`` — with ``g = N(0, I)`` and unit weights, random-feature attention.
    """
    x, y, v, omegas = _as_float64(x), _as_float64(y), _as_float64(v), _as_float64(omegas)
    weights = np.ones(len(omegas)) if weights is None else _as_float64(weights)
    num, den = np.zeros(v.shape[-1]), 0.0
    for w, log_g, alpha in zip(omegas, _as_float64(log_proposal), weights):
        log_p_tilde = (_log_normal(w, np.zeros_like(w)) + _log_xi(x, w)
                       + np.logaddexp.reduce([_log_xi(y[m], w) for m in range(y.shape[0])]))
        weight = alpha * math.exp(log_p_tilde - log_g)
        num += weight * _f(y, v, w)
        den += weight
    return num / den


def lara_reference(q, k, v, noise, *, num_proposals: int, weighting: str = "query", alpha_coeff: float = 1.0,
                   alpha_floor: float = 1e-8, sample: bool = True, scale: float | None = None) -> np.ndarray:
    """LARA's output by a plain float64 loop over queries, proposals and samples, straight from the estimator.

    ``noise``: ``(C, S, d)`` standard-normal draws ``ε_{cs}`` (``ω_{cs} = μ_c + ε_{cs}``; ignored when
    ``sample=False``). For each query the samples, their proposal densities ``g_c(ω_{cs})`` and the weights
    ``α_{nc}(ω_{cs})`` go through :func:`importance_sampling_reference` (unstabilised exponentials: moderate
    inputs only). Non-causal.
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    noise = _check_noise(noise, num_proposals, q.shape[-1])

    def one(qh, kh, vh):
        x, y, omega, mu, alpha = _lara_terms(qh, kh, noise, num_proposals, weighting, alpha_coeff, alpha_floor,
                                             sample, scale)
        C, S = omega.shape[:2]
        samples = omega.reshape(C * S, -1)
        log_g = [_log_normal(omega[c, s], mu[c]) for c in range(C) for s in range(S)]
        out = np.zeros((x.shape[0], vh.shape[-1]))
        for n in range(x.shape[0]):
            weights = [alpha(n, c, omega[c, s]) for c in range(C) for s in range(S)]
            out[n] = importance_sampling_reference(x[n], y, vh, samples, log_g, weights)
        return out

    return _batched(one, q, k, v)


def lara_kernel_reference(q, k, noise, *, num_proposals: int, weighting: str = "query", alpha_coeff: float = 1.0,
                          alpha_floor: float = 1e-8, sample: bool = True, scale: float | None = None) -> np.ndarray:
    """The implied kernel estimate ``Â_{nm} = (1/S) Σ_{cs} α_{nc}(ω_{cs}) N(ω_{cs})/g_c(ω_{cs}) ξ(x_n, ω_{cs})
    ξ(y_m, ω_{cs})`` of ``exp(x_nᵀy_m)`` by plain loops, ``(..., n, M)``. LARA's output is
    ``Â V / Â 1`` row by row."""
    q, k = _as_float64(q), _as_float64(k)
    noise = _check_noise(noise, num_proposals, q.shape[-1])

    def one(qh, kh):
        x, y, omega, mu, alpha = _lara_terms(qh, kh, noise, num_proposals, weighting, alpha_coeff, alpha_floor,
                                             sample, scale)
        C, S = omega.shape[:2]
        out = np.zeros((x.shape[0], y.shape[0]))
        for n in range(x.shape[0]):
            for m in range(y.shape[0]):
                total = 0.0
                for c in range(C):
                    for s in range(S):
                        w = omega[c, s]
                        ratio = math.exp(_log_normal(w, np.zeros_like(w)) - _log_normal(w, mu[c]))
                        total += alpha(n, c, w) * ratio * math.exp(_log_xi(x[n], w) + _log_xi(y[m], w))
                out[n, m] = total / S
        return out

    return _batched(one, q, k)


# ------------------------------------------------------------------------------------------ the fast paths
def _segment_means(x, num_segments: int):
    """Means of the ``C`` segments of :func:`segment_bounds` along the token axis: ``(..., C, d)``."""
    n = x.shape[-2]
    weights = torch.zeros(num_segments, n, dtype=x.dtype, device=x.device)
    for c, (a, b) in enumerate(segment_bounds(n, num_segments)):
        weights[c, a:b] = 1.0 / (b - a)
    return weights @ x


def _lara_log_features(x, y, noise, weighting: str, alpha_coeff: float, alpha_floor: float, sample: bool):
    """Log query and key features of LARA, ``(..., n, R)`` and ``(..., M, R)`` with ``R = C·S``, from scaled
    ``x``, ``y`` and ``noise (C, S, d)`` (a tensor of their dtype and device).

    ``log φ_r(x) = log α_{nc}(ω_r) − ℓ_{r c} + ω_rᵀx − ‖x‖²/2`` and ``log φ_r(y) = ω_rᵀy − ‖y‖²/2``, where
    ``ℓ_{r c'} = ω_rᵀμ_{c'} − ‖μ_{c'}‖²/2 = log g_{c'}(ω_r) − log N(ω_r) `` and ``c = c(r)`` is the proposal ``ω_r``
    was drawn from (so ``−ℓ_{r c} = log N(ω_r)/g_c(ω_r)``); the balance heuristic is
    ``log α_c(ω_r) = ℓ_{r c} − logsumexp_{c'} ℓ_{r c'}``.
    """
    num_proposals, per = noise.shape[0], noise.shape[1]
    x_bar = _segment_means(x, num_proposals)                                  # (..., C, d)
    mu = x_bar + _segment_means(y, num_proposals)
    omega = mu[..., :, None, :] + noise if sample else mu[..., :, None, :].expand(*mu.shape[:-1], per, mu.shape[-1])
    omega = omega.reshape(*mu.shape[:-2], num_proposals * per, mu.shape[-1])   # (..., R, d)
    log_g = omega @ mu.transpose(-1, -2) - 0.5 * (mu * mu).sum(-1)[..., None, :]   # (..., R, C): ℓ_{r c'}
    own = torch.arange(num_proposals, device=x.device).repeat_interleave(per)  # c(r)
    log_own = log_g.gather(-1, own.expand(*log_g.shape[:-1])[..., None]).squeeze(-1)   # ℓ_{r c(r)}
    log_mixture = torch.logsumexp(log_g, -1)                                   # (..., R)
    query = x @ omega.transpose(-1, -2) - 0.5 * (x * x).sum(-1, keepdim=True)  # (..., n, R)
    if weighting == "balance":
        query = query - log_mixture[..., None, :]
    else:
        r = torch.softmax(x @ x_bar.transpose(-1, -2), dim=-2)                  # (..., n, C), over the queries
        correction = alpha_coeff * (r - r.mean(-1, keepdim=True))
        alpha = torch.exp(log_own - log_mixture)[..., None, :] + correction[..., own]
        query = query + torch.log(alpha.clamp_min(alpha_floor)) - log_own[..., None, :]
    key = y @ omega.transpose(-1, -2) - 0.5 * (y * y).sum(-1, keepdim=True)    # (..., M, R)
    return query, key


# --------------------------------------------------------------------------------------------- the estimator
class LinearRandomizedAttention(AttentionEstimator):
    r"""LARA, training-free: self-normalised multiple importance sampling of softmax attention with ``C``
    segment-mean proposals (no learned landmark maps; module docstring).

    .. math::
        \mathrm{LARA}(x_n) = \frac{\sum_{c,s} α_{nc}(ω_{cs})\,\tilde p_n(ω_{cs})/g_c(ω_{cs})\; f(ω_{cs})}
                                  {\sum_{c,s} α_{nc}(ω_{cs})\,\tilde p_n(ω_{cs})/g_c(ω_{cs})},
        \qquad ω_{cs} \sim g_c = N(x̃_c + ỹ_c, I)

    (module docstring: the randomized-attention identity, the proposals, the weights). Computed as linear
    attention with ``r = C·S`` positive features (query side ``α · N/g_c · ξ(x, ω)``, key side ``ξ(y, ω)``), in the
    log domain: every feature's key sums are shifted by their largest key log-feature and every query row by its
    largest term, so nothing overflows at any norm and the normaliser never underflows.

    **Positive**; **data-dependent** (the proposals are the segment means of the sequence being attended);
    **non-causal only** (``causal=True`` raises: the proposals and the query weights use the whole sequence);
    **consistent** when it samples (the output converges to softmax attention as the number of draws grows); with
    ``sample=False`` it is a deterministic rule whose error stops falling. The implied
    kernel estimate ``Â`` (:meth:`kernel_matrix`) is **unbiased** for ``exp(s qᵀk)`` with the balance heuristic,
    ``sample=True`` and an unbiased sampler; the query weights' clamp and ``sample=False`` bias it. The output is a
    ratio and biased at ``O(1/S)`` in every case. The normaliser of the attention parts is
    ``Ẑ_n = Σ_m Â_{nm}``, an estimate of ``Σ_m exp(s q_nᵀk_m)``.

    Memory (:meth:`state_bytes`): per feature the key sums ``[Σ φ(y) v, Σ φ(y)]`` (``d_v + 1``), its draw ``ω``
    (``d``), its query-side constant and its key shift (2); with the query weights also the balance weight of
    each draw (1) and per proposal its query landmark and normaliser (``d + 1``).

    Parameters
    ----------
    num_features : int
        ``r = C·S``, the number of draws (features of the linear-attention state).
    num_proposals : int, optional
        ``C``, the number of proposals (segments); must divide ``num_features``. Default ``num_features`` (one
        draw per proposal, as in the reference code, whose ``C`` landmarks are its ``C`` samples).
    weighting : {"query", "balance"}
        The MIS weights: the paper's query-specific weights (default) or the balance heuristic.
    alpha_coeff : float
        ``λ`` of the query-specific weights (reference default 1; ``weighting="query"`` only).
    alpha_floor : float
        Clamp of the query-specific weights (reference 1e-8; must be positive; ``weighting="query"`` only).
    sample : bool
        Draw ``ω = μ + ε`` (default; the paper's training-time rule) or use the proposal means ``ω = μ`` (its
        inference-time rule, registered as ``lara_mean``; deterministic, needs ``num_proposals = num_features``).
    sampler : str
        Sampler of the noise ``ε`` (``"iid"`` or ``"orthogonal"``, ...; see :mod:`kernapprox.estimators.samplers`),
        drawn once at ``fit`` as ``(C, S, d)`` and shared by every batch element and head.
    rng : int, SeedSequence or Generator
    scale : float, optional
        The attention scale ``s`` (default ``1/sqrt(d)``).

    Attributes
    ----------
    noise_ : ndarray (C, S, d)
        The standard-normal draws ``ε`` (zeros when ``sample=False``).

    References
    ----------
    Zheng, Wang & Kong, *Linear Complexity Randomized Self-attention Mechanism*, ICML 2022, §3–4.

    Examples
    --------
    >>> import torch, kernapprox as ka
    >>> q, k, v = (torch.randn(2, 64, 16, dtype=torch.float64) for _ in range(3))
    >>> est = ka.make_estimator("lara", num_features=32, rng=0).fit(q, k)
    >>> ka.linear_attention(q, k, v, est, mode="chunked").shape
    torch.Size([2, 64, 16])
    """

    unbiased = False              # resolved per options by capabilities_for
    positive = True
    data_dependent = True
    query_dependent = True        # proposals and query weights from the queries of the call
    causal_fit = False
    causal = False
    consistent = True
    modes = ("parallel", "recurrent", "chunked")
    reference = REFERENCE_SAMPLED         # resolved per ``sample`` by capabilities_for
    # how it uses the linear-attention core: all of it is linear attention on log-features
    core: ClassVar[tuple[str, ...]] = ("linear_attention_from_log_features",)

    def __init__(self, *, num_features: int, num_proposals: int | None = None, weighting: str = "query",
                 alpha_coeff: float = 1.0, alpha_floor: float = 1e-8, sample: bool = True, sampler: str = "iid",
                 rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        if num_proposals is not None:
            check_positive_int(num_proposals, "num_proposals")
            if num_features % num_proposals:
                raise ValueError(f"num_proposals ({num_proposals}) must divide num_features ({num_features})")
        self.num_proposals = num_proposals
        self.weighting = check_choice(weighting, "weighting", WEIGHTINGS)
        self.alpha_coeff = check_positive_float(alpha_coeff, "alpha_coeff", allow_zero=True)
        self.alpha_floor = check_positive_float(alpha_floor, "alpha_floor")
        if self.weighting == "balance" and (self.alpha_coeff != 1.0 or self.alpha_floor != 1e-8):
            raise ValueError("alpha_coeff and alpha_floor are options of weighting='query'; the balance heuristic "
                             f"has none (got alpha_coeff={alpha_coeff}, alpha_floor={alpha_floor})")
        self.sample = check_bool(sample, "sample")
        self.sampler = sampler
        make_sampler(sampler)
        if not self.sample and self._proposals() != num_features:
            raise ValueError("sample=False puts every draw at its proposal's mean: num_proposals must equal "
                             f"num_features (one draw per proposal), got {self._proposals()} and {num_features}")

    def _proposals(self) -> int:
        return self.num_features_param if self.num_proposals is None else self.num_proposals

    @classmethod
    def capabilities_for(cls, **options):
        """The implied kernel estimate is unbiased with the balance heuristic, ``sample=True`` and an unbiased
        sampler (the query weights' clamp and ``sample=False`` bias it); consistent only when it samples (at the
        proposal means the error stops falling once the segments are single tokens). The reference names the rule:
        the training-time rule (sampled ``ω``) or the inference-time rule ``ω = μ``, both training-free."""
        caps = super().capabilities_for(**options)
        sample = options.get("sample", True)
        unbiased = (options.get("weighting", "query") == "balance" and sample
                    and make_sampler(options.get("sampler", "iid")).unbiased)
        return dataclasses.replace(caps, unbiased=bool(unbiased), consistent=bool(sample),
                                   reference=REFERENCE_SAMPLED if sample else REFERENCE_MEAN)

    def _fit(self, q, k, rng):
        proposals = self._proposals()
        per = self.num_features // proposals
        if self.sample:
            noise = make_sampler(self.sampler).sample(self.num_features, self.dim_, rng)
        else:
            noise = np.zeros((self.num_features, self.dim_))
        self.noise_ = noise.reshape(proposals, per, self.dim_)

    def _log_features(self, q, k):
        ct = compute_dtype(q.dtype)
        root = math.sqrt(self.scale_)
        x, y = q.to(ct) * root, k.to(ct) * root
        return _lara_log_features(x, y, self._param("noise_", x), self.weighting, self.alpha_coeff,
                                  self.alpha_floor, self.sample)

    def attention(self, q, k, v, *, causal=False, mode="chunked", chunk_size=64, return_parts=False):
        """LARA in the ``parallel`` (materialise ``Â``), ``recurrent`` (one key at a time into the ``r × (d_v+1)``
        state) or ``chunked`` (``chunk_size`` keys at a time) mode; non-causal only."""
        if causal is True:
            raise ValueError("LARA is defined for non-causal attention: its proposals (segment means) and query "
                             "weights use the whole sequence (use causal=False)")
        self._check_call(q, k, v, causal, mode, chunk_size)
        log_q, log_k = self._log_features(q, k)
        # linear attention on log-features, each feature shifted by its largest key (the core's per-feature
        # stabiliser: LARA's importance weights span too wide a range for one log-scale per token)
        num, den, log_scale = linear_attention_from_log_features(log_q, log_k, v.to(log_q.dtype), mode=mode,
                                                                 chunk_size=chunk_size)
        log_scale = log_scale - math.log(self.noise_.shape[1])
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, log_scale)
        return out

    def kernel_matrix(self, q, k):
        """The implied estimate ``Â (..., n_q, n_k)`` of ``exp(s QKᵀ)``: ``Â_{nm} = (1/S) Σ_r φ_r(x_n) φ_r(y_m)``,
        from shifted features and rescaled at the end (overflows only where the true value does)."""
        self._check_fitted()
        check_qk(q, k)
        self._check_dim(q)
        log_q, log_k = self._log_features(q, k)
        top_q, top_k = log_q.amax(-1, keepdim=True), log_k.amax(-1, keepdim=True)
        gram = torch.exp(log_q - top_q) @ torch.exp(log_k - top_k).transpose(-1, -2)
        scale = top_q + top_k.transpose(-1, -2) - math.log(self.noise_.shape[1])
        return signed_exp(gram, scale).to(q.dtype)

    def parameter_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """The noise ``ε`` (regenerable from the seed) when the estimator samples; nothing at the proposal means."""
        self._check_fitted()
        return int(self.noise_.size) * itemsize(dtype) if self.sample else 0

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """``(r (d_v + d + 4) + C (d + 1)) · itemsize`` with the query weights, ``r (d_v + d + 3) · itemsize`` with
        the balance heuristic (see the class docstring); independent of ``seq_len``."""
        self._check_fitted()
        check_positive_int(d_v, "d_v")
        per_feature = d_v + 1 + self.dim_ + 2
        numbers = self.num_features * per_feature
        if self.weighting == "query":
            numbers += self.num_features + self._proposals() * (self.dim_ + 1)
        return numbers * itemsize(dtype)


register("lara", LinearRandomizedAttention)
register("lara_balance", LinearRandomizedAttention, weighting="balance")
register("lara_mean", LinearRandomizedAttention, sample=False)
