r"""EVA: efficient attention via control variates (Zheng, Yuan, Wang & Kong, ICLR 2023).

Notation as in :mod:`kernapprox.approximate.lara`: ``x = sqrt(s)·q``, ``y = sqrt(s)·k``,
``ξ(x, ω) = exp(ωᵀx − ‖x‖²/2)``, ``N(ω; μ)`` the density of ``N(μ, I_d)``, ``N(ω) = N(ω; 0)``; softmax attention
``Σ_m π_m v_m`` with ``π_m = exp(xᵀy_m)/Z``.

Random-feature attention as a sum of control-variate estimators (EVA paper, §3)
-------------------------------------------------------------------------------
Take a proposal ``ρ(ω)`` and one draw ``ω ~ ρ`` (with ``S`` draws, average each quantity below over them).
For every key ``m`` define

    ``h_m(ω) = N(ω) ξ(x, ω) ξ(y_m, ω) / ρ(ω)``,   ``g_m(ω) = h_m(ω) v_m``,

so that, by ``N(ω) ξ(x, ω) ξ(y, ω) = exp(xᵀy) N(ω; x + y)``, ``E_ρ[h_m] = exp(xᵀy_m) = Z π_m`` and
``E_ρ[g_m] = Z π_m v_m``. ``g_m/Z`` is an unbiased estimate of key ``m``'s share ``π_m v_m`` of the output and
``h_m/Z`` a control variate with the known mean ``π_m``; with a coefficient ``β_m`` the control-variate estimate is

    ``ĝ_m(ω) = g_m(ω)/Z − β_m (h_m(ω)/Z − π_m)``.

*One shared coefficient is random-feature attention.* With ``β_m = β(ω) = Σ_m g_m(ω) / Σ_m h_m(ω)`` for every
``m``, ``Σ_m ĝ_m = Σ g/Z − β Σ h/Z + β Σ π = β(ω)``, and ``β(ω)`` is the self-normalised importance-sampling
estimate of the output — random-feature attention with positive features when ``ρ = N(0, I)``.

*Per-key coefficients give softmax attention.* Since ``g_m = v_m h_m`` exactly, ``β_m = v_m`` — the
variance-minimising coefficient ``Cov(g_m, h_m)/Var(h_m)`` — gives ``ĝ_m = π_m v_m`` with no variance at all, and
``Σ_m ĝ_m`` is exact softmax attention. RFA's approximation gap is thus the cost of sharing one coefficient over
the whole sequence.

*Per-group coefficients.* Partition the keys into groups ``P_c`` and share ``β_c(ω) = Σ_{m∈P_c} g_m / Σ_{m∈P_c} h_m``
within each; the factor ``N(ω) ξ(x, ω)/ρ(ω)`` is common to every ``h_m`` and cancels, so

    ``β_c(ω) = Σ_{m∈P_c} ξ(y_m, ω) v_m / Σ_{m∈P_c} ξ(y_m, ω)``   (query-free)   and
    ``Σ_{m∈P_c} ĝ_m = β_c(ω) Σ_{m∈P_c} π_m``.

With one group this is RFA, with one key per group it is exact, in between it interpolates
(:func:`control_variate_reference` evaluates ``Σ_m ĝ_m`` literally, from ``h``, ``g`` and ``π``).

EVA (EVA paper, §4)
-------------------
EVA computes a local set ``E`` of keys exactly (per-key coefficients) and the remaining keys in ``C`` groups
with shared coefficients, each group with its own proposal ``ρ_c = N(μ_c, I)`` and a single draw ``ω_c``:

    ``EVA(x) = [Σ_{m∈E} e^{xᵀy_m} v_m + Σ_c Ŝ_c(x) β_c(ω_c)] / [Σ_{m∈E} e^{xᵀy_m} + Σ_c Ŝ_c(x)]``,

where ``Ŝ_c(x)`` approximates the group's mass ``S_c(x) = Σ_{m∈P_c} e^{xᵀy_m}`` (with ``S_c`` exact this is
``Σ_{m∈E} π_m v_m + Σ_c β_c Σ_{m∈P_c} π_m``, the per-group control-variate estimator, up to normalising by the
estimated ``Z``). The paper writes ``Ŝ_c(x) = exp(xᵀk̃_c)`` with an adaptive vector ``k̃_c`` computed from the
group (in the reference code a learned linear map and LayerNorm of the group's mean key). Without training, this
module uses the identity map with the group's size:

    ``Ŝ_c(x) = |P_c| · exp(xᵀȳ_c)``,   ``ȳ_c`` the mean key of the group ("mean"),

a lower bound of ``S_c(x)`` by Jensen's inequality, exact when the group's logits ``xᵀy_m`` are equal (a single
key, or identical keys). Cost: the whole-group summaries ``(ȳ_c, |P_c|, β_c)`` are computed once; each query
reads its ``|E|`` exact keys, the ``C`` summaries, and the remaining keys of the (at most two) groups its local
set cuts — ``O(N (|E| + g + C)(d + d_v))`` for groups of ``g`` keys.

Groups, local sets and proposals here (a definition that partitions the keys; the reference code differs, see
below). ``C`` = ``num_features`` groups of ``g = ⌈M/C⌉`` consecutive keys, ``G_c = [cg, min((c+1)g, M))`` (fewer
than ``C`` groups when ``C`` does not divide ``M`` evenly enough), or groups of a fixed ``g = group_size`` (at most
``C`` of them, one draw each); query ``i`` computes exactly

* non-causal: the band ``E_i = {j : |i − j| < w}`` (empty for ``w = 0``), as
  :class:`~kernapprox.approximate.hybrid.WindowLinear` does;
* causal: ``E_i = {j : min(i − w + 1, g⌊i/g⌋) ≤ j ≤ i}``, the last ``w`` keys *and* the keys of its own,
  unfinished group;

and every other key ``j`` it may see (``j ≤ i`` if causal) through its group: ``P_c(i) = G_c ∖ E_i`` restricted
to those keys, with ``ȳ``, ``|P|`` and ``β_c`` taken over ``P_c(i)`` (a prefix and/or suffix of ``G_c``). Group
``c``'s proposal mean is ``μ_c = x̄ + ȳ_c`` (``ȳ_c`` over the whole group): the optimal proposal of query ``x`` for
the group's keys is the mixture ``Σ_{m∈G_c} π_{m|c} N(ω; x + y_m)`` (the randomized-attention density of the LARA
paper restricted to the group), whose mean is ``x + Σ π_{m|c} y_m ≈ x + ȳ_c`` for the queries that read the group;
``x̄`` is their mean — all queries when non-causal; when causal, the group's own queries (as in the reference's
causal code), because a decoder forms the group's summary when the group is complete, before the later queries
that read it exist. ``ω_c = μ_c + ε_c`` with ``ε_c ~ N(0, I)`` (``sample=True``: the paper's training-time rule) or
``ω_c = μ_c`` (``sample=False``: its inference-time rule, as the reference code evaluates; deterministic). Both are
*training-free variants* of EVA: the paper learns the group logit and the landmark projections with the model,
while here the group's coefficient is its Jensen lower bound and the landmarks are plain group means, so neither
registered name is the paper's trained estimator: ``eva`` is the training-free variant of the training-time rule
(sampled ``ω``), ``eva_mean`` that of the inference-time rule ``ω = μ``. A finding about either is a finding about
this training-free estimator, not about the paper's models.

Causality: with these sets, every group a causal query reads through a summary is complete and lies before the
query, and its summary (``ȳ_c``, ``β_c`` with ``ω_c``, which uses only the group's own tokens) is fixed once the
group completes; the estimate for query ``i`` uses no token after ``i``. EVA is **causal-capable** (the paper
trains causal language models with it); LARA, by contrast, is defined non-causally.

Limits (checked in the tests): one key per group (``C ≥ M``) or a window covering the sequence (``w ≥ M``) gives
exact softmax attention; with ``E = ∅``, one group, and ``Ŝ`` exact, EVA is one-feature random-feature attention
with the frequency ``ω_1``.

Bias and variance: the EVA paper gives no closed form for them. The two sources are visible above: ``β_c`` is a
one-draw SNIS estimate that does not depend on the query (its error does not vanish with more groups of the same
size), and ``Ŝ_c`` with "mean" underestimates every group's mass by the Jensen gap (for keys with covariance
``Σ_c`` in the group, ``log S_c − log Ŝ_c ≈ ½ xᵀΣ_c x``), which shifts weight towards the exact local keys.

What was re-derived and what was checked
----------------------------------------
Re-derived here and verified numerically (``tests/approximate/test_eva.py``): the control-variate decomposition (shared
coefficient = RFA, per-key optimal coefficients = softmax attention, per-group coefficients), the query-free form
of ``β_c``, the exactness limits. Read in the authors' reference code (HKUNLP/efficient-attention,
``efficient_attention/eva.py`` and ``causal_eva.py``): ``β_c`` as a softmax over ``ωᵀy_m − ‖y_m‖²/2`` within the
group, the proposal mean from the group's query and key means (``½(q̃ + k̃)`` non-causal, ``q̃ + k̃`` causal, after
learned maps), ``ω = μ`` at inference and ``μ + N(0, I)`` in training, one softmax over the local logits and the
group logits ``xᵀk̃_c``, groups used causally only once complete. Differences, on purpose: (i) no learned maps
(``k̃_c`` is the mean key and ``log|P_c|`` is added — the learned map can absorb it, the identity cannot);
(ii) the groups partition the keys outside the local set — the reference code lets the local window and the
groups overlap, so keys near the query are counted both exactly and in their group, a bias an untrained
estimator cannot learn away; (iii) the causal local set is the last ``w`` keys plus the current group rather than
the reference's block-aligned windows (its decoding path already uses a sliding window). The paper's numbers are
accuracies of trained models and were not reproduced. Its text was available only through its abstract and
introduction; the definitions above follow the reference code where the text could not be read.

References
----------
Zheng, Yuan, Wang & Kong, *Efficient Attention via Control Variates*, ICLR 2023 (arXiv 2302.04542), §3 (RFA as
control variates; optimal coefficients recover softmax attention), §4 (EVA). Zheng, Wang & Kong, *Linear
Complexity Randomized Self-attention Mechanism*, ICML 2022 (the randomized-attention density). Owen, *Monte Carlo
theory, methods and examples*, 2013, ch. 8 (control variates).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import torch

from ..attention.linear import add_log_keys
from ..estimators.base import AttentionEstimator, AttentionParts
from ..estimators.registry import register
from ..validation import check_bool, check_positive_int, check_qk, compute_dtype, itemsize
from .lara import _as_float64, _log_normal, _log_xi

# What the registry's table says of each rule (capabilities().reference): both are training-free variants.
REFERENCE_SAMPLED = ("Zheng, Yuan, Wang & Kong 2023 (EVA, ICLR) §3 (RFA as control variates), §4 (EVA): training-free "
                     "variant of the training-time rule (sampled ω ~ N(μ_c, I); the group's mass by its Jensen lower "
                     "bound instead of the learned group logit, no learned landmark maps), not the paper's trained "
                     "estimator")
REFERENCE_MEAN = ("Zheng, Yuan, Wang & Kong 2023 (EVA, ICLR) §4 at ω = μ: training-free variant of the inference-time "
                  "rule (every draw at its proposal mean, as the authors' code evaluates; the group's mass by its "
                  "Jensen lower bound instead of the learned group logit, no learned landmark maps), not the paper's "
                  "trained estimator")


# --------------------------------------------------------------------------------------------- shared pieces
def group_layout(num_keys: int, num_groups: int, group_size: int | None = None) -> tuple[int, int]:
    """``(g, G)``: the group size (``group_size``, or ``⌈M/C⌉`` for ``C = num_groups``) and the number of groups
    ``G = ⌈M/g⌉``, which must not exceed ``C`` (the number of draws)."""
    size = -(-num_keys // num_groups) if group_size is None else group_size
    count = -(-num_keys // size)
    if count > num_groups:
        raise ValueError(f"{num_keys} keys in groups of group_size={size} need {count} groups, but the estimator "
                         f"has num_features={num_groups} (one draw per group): raise num_features or group_size")
    return size, count


def group_bounds(num_keys: int, num_groups: int, group_size: int | None = None) -> np.ndarray:
    """``(G, 2)`` integer array of ``[start, stop)`` of the groups (:func:`group_layout`): ``g`` consecutive keys
    each, the last one possibly shorter."""
    size, _ = group_layout(num_keys, num_groups, group_size)
    starts = np.arange(0, num_keys, size)
    return np.stack([starts, np.minimum(starts + size, num_keys)], axis=1)


def local_bounds(i: int, num_keys: int, window: int, group_size: int, causal: bool) -> tuple[int, int]:
    """``[lo, hi)`` of query ``i``'s exact local set ``E_i`` (module docstring)."""
    if causal:
        return max(0, min(i - window + 1, (i // group_size) * group_size)), i + 1
    if window == 0:
        return i, i
    return max(0, i - window + 1), min(num_keys, i + window)


# ---------------------------------------------------------------------------------------------- the oracles
def control_variate_reference(q, k, v, omega, groups, proposal_means, scale: float | None = None) -> np.ndarray:
    """``Σ_m ĝ_m(ω_{c(m)})`` by plain loops: the control-variate estimator with one coefficient per group.

    ``groups``: a list of integer index arrays partitioning the keys ``0..M−1``; ``omega`` and ``proposal_means``:
    ``(len(groups), d)``, the draw and the mean of each group's proposal ``N(μ_c, I)``. For every query and key the
    definitions are evaluated literally: ``h_m = N(ω)ξ(x,ω)ξ(y_m,ω)/N(ω; μ)``, ``g_m = h_m v_m``, the exact
    ``π_m`` and ``Z``, ``β_c = Σ_{P_c} g/Σ_{P_c} h`` and ``ĝ_m = g_m/Z − β_c(h_m/Z − π_m)``. One head
    ``(n, d)``, ``(M, d)``, ``(M, d_v)``; quadratic; moderate inputs only.
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    omega, proposal_means = _as_float64(omega), _as_float64(proposal_means)
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    x, y = root * q, root * k
    out = np.zeros((x.shape[0], v.shape[-1]))
    for i in range(x.shape[0]):
        z = sum(math.exp(x[i] @ y[m]) for m in range(y.shape[0]))
        for c, members in enumerate(groups):
            w = omega[c]
            ratio = math.exp(_log_normal(w, np.zeros_like(w)) - _log_normal(w, proposal_means[c]))
            h = {m: ratio * math.exp(_log_xi(x[i], w) + _log_xi(y[m], w)) for m in members}
            beta = sum(h[m] * v[m] for m in members) / sum(h.values())
            for m in members:
                pi = math.exp(x[i] @ y[m]) / z
                out[i] += h[m] * v[m] / z - beta * (h[m] / z - pi)
    return out


def _eva_terms(q, k, noise, num_groups, window, causal, sample, scale, group_size=None):
    """Per head: scaled ``x, y``, group bounds and the draws ``ω_c`` of EVA's proposals, by plain loops."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    x, y = root * q, root * k
    bounds = group_bounds(y.shape[0], num_groups, group_size)
    omega = np.zeros((len(bounds), x.shape[1]))
    for c, (a, b) in enumerate(bounds):
        y_bar = sum(y[m] for m in range(a, b)) / (b - a)
        readers = range(a, b) if causal else range(x.shape[0])
        x_bar = sum(x[i] for i in readers) / len(readers)
        omega[c] = x_bar + y_bar + (noise[c] if sample else 0.0)
    return x, y, bounds, omega


def _check_eva(noise, num_groups, d, window, causal, n_q, n_k):
    noise = _as_float64(noise)
    if noise.ndim != 2 or noise.shape[1] != d or noise.shape[0] != num_groups:
        raise ValueError(f"noise must have shape (num_groups, d) = ({num_groups}, {d}), got {noise.shape}")
    if causal and n_q != n_k:
        raise ValueError(f"causal attention needs as many queries as keys, got {n_q} and {n_k}")
    return noise


def _eva_row_weights(x_i, y, i, bounds, omega, window, causal, group_mass):
    """Query ``i``'s implied kernel row ``Â_{i·}`` (length M): exact on ``E_i``, and for each restricted group
    ``P = P_c(i)`` the mass ``Ŝ`` shared in proportion to ``ξ(y_m, ω_c)`` (so that ``Â V`` gives ``Ŝ β_c``)."""
    num_keys = y.shape[0]
    size = int(bounds[0, 1] - bounds[0, 0])
    lo, hi = local_bounds(i, num_keys, window, size, causal)
    row = np.zeros(num_keys)
    for j in range(lo, hi):
        row[j] = math.exp(x_i @ y[j])
    for c, (a, b) in enumerate(bounds):
        members = [m for m in range(a, b) if not (lo <= m < hi) and (not causal or m <= i)]
        if not members:
            continue
        if group_mass == "mean":
            y_bar = sum(y[m] for m in members) / len(members)
            mass = len(members) * math.exp(x_i @ y_bar)
        else:                                                        # "exact": the per-group CV estimator
            mass = sum(math.exp(x_i @ y[m]) for m in members)
        xi = {m: math.exp(_log_xi(y[m], omega[c])) for m in members}
        total = sum(xi.values())
        for m in members:
            row[m] = mass * xi[m] / total
    return row


def eva_kernel_reference(q, k, noise, *, num_groups: int, window: int, causal: bool = False, sample: bool = True,
                         group_mass: str = "mean", group_size: int | None = None,
                         scale: float | None = None) -> np.ndarray:
    """EVA's implied kernel matrix ``Â (..., n, M)`` by plain loops: ``EVA = Â V / Â 1`` row by row.

    ``noise``: ``(C, d)`` standard-normal draws ``ε_c`` (``ω_c = μ_c + ε_c``; ignored when ``sample=False``).
    ``group_mass``: ``"mean"`` (EVA's ``Ŝ_c = |P| exp(xᵀȳ_P)``) or ``"exact"`` (``S_c``: the quadratic
    per-group control-variate estimator EVA approximates). ``group_size``: groups of that many keys instead of
    ``⌈M/C⌉`` (:func:`group_layout`).
    """
    q, k = _as_float64(q), _as_float64(k)
    noise = _check_eva(noise, num_groups, q.shape[-1], window, causal, q.shape[-2], k.shape[-2])

    def one(qh, kh):
        x, y, bounds, omega = _eva_terms(qh, kh, noise, num_groups, window, causal, sample, scale, group_size)
        return np.stack([_eva_row_weights(x[i], y, i, bounds, omega, window, causal, group_mass)
                         for i in range(x.shape[0])])

    batch = q.shape[:-2]
    outs = [one(q[idx], k[idx]) for idx in np.ndindex(*batch)]
    return np.stack(outs).reshape(*batch, q.shape[-2], k.shape[-2])


def eva_reference(q, k, v, noise, *, num_groups: int, window: int, causal: bool = False, sample: bool = True,
                  group_mass: str = "mean", group_size: int | None = None, scale: float | None = None) -> np.ndarray:
    """EVA's output by a plain float64 loop over queries and groups, straight from the definition.

    Per query ``i``: the exact sums over ``E_i``, then for every group ``c`` with keys left in
    ``P_c(i)``: ``Ŝ_c(x_i)`` and ``β_c = Σ_P ξ(y_m, ω_c) v_m / Σ_P ξ(y_m, ω_c)`` accumulated into the numerator and
    normaliser. Arguments as in :func:`eva_kernel_reference`; unstabilised exponentials (moderate inputs only).
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    noise = _check_eva(noise, num_groups, q.shape[-1], window, causal, q.shape[-2], k.shape[-2])

    def one(qh, kh, vh):
        x, y, bounds, omega = _eva_terms(qh, kh, noise, num_groups, window, causal, sample, scale, group_size)
        size = int(bounds[0, 1] - bounds[0, 0])
        out = np.zeros((x.shape[0], vh.shape[-1]))
        for i in range(x.shape[0]):
            lo, hi = local_bounds(i, y.shape[0], window, size, causal)
            num, den = np.zeros(vh.shape[-1]), 0.0
            for j in range(lo, hi):
                e = math.exp(x[i] @ y[j])
                num += e * vh[j]
                den += e
            for c, (a, b) in enumerate(bounds):
                members = [m for m in range(a, b) if not (lo <= m < hi) and (not causal or m <= i)]
                if not members:
                    continue
                if group_mass == "mean":
                    mass = len(members) * math.exp(x[i] @ (sum(y[m] for m in members) / len(members)))
                else:
                    mass = sum(math.exp(x[i] @ y[m]) for m in members)
                xi = [math.exp(_log_xi(y[m], omega[c])) for m in members]
                beta = sum(w * vh[m] for w, m in zip(xi, members)) / sum(xi)
                num += mass * beta
                den += mass
            out[i] = num / den
        return out

    batch = q.shape[:-2]
    outs = [one(q[idx], k[idx], v[idx]) for idx in np.ndindex(*batch)]
    return np.stack(outs).reshape(*batch, q.shape[-2], v.shape[-1])


# ------------------------------------------------------------------------------------------ the fast paths
class _Groups:
    """The keys of one call split into ``G`` groups of ``g`` (the last one padded), with each group's draw
    ``ω_c`` and each key's log-feature ``l_m = ω_{c(m)}ᵀy_m − ‖y_m‖²/2`` under its own group's draw (padding:
    ``−inf``). ``x, y``: scaled ``(..., n, d)``, ``(..., M, d)``; ``noise``: ``(≥G, d)`` tensor."""

    def __init__(self, x, y, noise, num_groups: int, causal: bool, sample: bool, group_size: int | None = None):
        num_keys, d = y.shape[-2], y.shape[-1]
        self.size, self.count = group_layout(num_keys, num_groups, group_size)
        pad = self.count * self.size - num_keys
        self.lengths = torch.clamp(num_keys - torch.arange(self.count, device=y.device) * self.size, max=self.size)
        self.keys = torch.nn.functional.pad(y, (0, 0, 0, pad)).reshape(*y.shape[:-2], self.count, self.size, d)
        lengths = self.lengths.to(y.dtype)[:, None]
        key_means = self.keys.sum(-2) / lengths                               # (..., G, d)
        if causal:
            queries = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(*x.shape[:-2], self.count, self.size, d)
            query_means = queries.sum(-2) / lengths
        else:
            query_means = x.mean(-2, keepdim=True)
        self.omega = query_means + key_means + (noise[:self.count] if sample else 0.0)   # (..., G, d)
        logs = (self.keys * self.omega[..., None, :]).sum(-1) - 0.5 * (self.keys * self.keys).sum(-1)
        valid = torch.arange(self.size, device=y.device)[None, :] < self.lengths[:, None]
        self.log_features = logs.masked_fill(~valid, -math.inf)             # (..., G, g)
        self.starts = torch.arange(self.count, device=y.device) * self.size


def _local_bounds(rows, num_keys: int, window: int, group_size: int, causal: bool):
    """Vectorised :func:`local_bounds` for a tensor of query positions; ``lo ≤ hi`` always."""
    if causal:
        lo = torch.clamp(torch.minimum(rows - window + 1, (rows // group_size) * group_size), min=0)
        return lo, rows + 1
    if window == 0:
        return rows, rows
    hi = torch.clamp(rows + window, max=num_keys)
    return torch.minimum(torch.clamp(rows - window + 1, min=0), hi), hi


def _combine(exact_logits, v_near, log_mass, beta):
    """Numerator, normaliser and log-scale of the rows from the exact logits (``−inf`` outside the local set) over
    the near values and the groups' log-masses and ``β``: one shift per row, the largest term."""
    exact_max = (exact_logits.amax(-1) if exact_logits.shape[-1] else
                 exact_logits.new_full(exact_logits.shape[:-1], -math.inf))
    row_max = torch.maximum(exact_max, log_mass.amax(-1))
    exact_w = torch.exp(exact_logits - row_max[..., None])
    group_w = torch.exp(log_mass - row_max[..., None])
    num = exact_w @ v_near + (group_w[..., None] * beta).sum(-2)
    return num, exact_w.sum(-1) + group_w.sum(-1), row_max


def _grouped(t, groups: _Groups):
    """``(..., M, f) -> (..., G, g, f)``, zero-padded."""
    pad = groups.count * groups.size - t.shape[-2]
    return torch.nn.functional.pad(t, (0, 0, 0, pad)).reshape(*t.shape[:-2], groups.count, groups.size, -1)


def _far_terms(x_rows, rows, lo, hi, groups: _Groups, values, causal: bool, first: int, last: int):
    """Log-mass ``(..., b, G')`` and ``β (..., b, G', d_v)`` of the groups ``[first, last)`` for the rows at
    positions ``rows`` with local sets ``[lo, hi)``, from masks over the groups' keys: the far keys of row ``i``
    in group ``c`` are its keys outside ``E_i`` (and ``≤ i`` if causal); ``β`` is their softmax-weighted value
    average under ``l_m`` (a convex combination, shifted per row and group)."""
    index = torch.arange(first, last, device=x_rows.device)
    positions = groups.starts[index][:, None] + torch.arange(groups.size, device=x_rows.device)[None, :]
    valid = torch.arange(groups.size, device=x_rows.device)[None, :] < groups.lengths[index][:, None]
    pos, row = positions[None], rows[:, None, None]
    far = valid[None] & ~((pos >= lo[:, None, None]) & (pos < hi[:, None, None]))
    if causal:
        far = far & (pos <= row)                                               # (b, G', g)
    keys = groups.keys[..., first:last, :, :]
    counts = far.sum(-1)
    key_sums = torch.einsum("igj,...gjd->...igd", far.to(keys.dtype), keys)
    safe = counts.clamp(min=1).to(x_rows.dtype)
    log_mass = torch.log(counts.to(x_rows.dtype)) + (x_rows[..., None, :] * key_sums).sum(-1) / safe
    log_mass = log_mass.masked_fill(counts == 0, -math.inf)
    logs = groups.log_features[..., None, first:last, :].masked_fill(~far, -math.inf)   # (..., b, G', g)
    top = logs.amax(-1, keepdim=True)
    weights = torch.exp(logs - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    totals = weights.sum(-1, keepdim=True).clamp(min=torch.finfo(x_rows.dtype).tiny)
    beta = torch.einsum("...igj,...gjd->...igd", weights, values[..., first:last, :, :]) / totals
    return log_mass, beta.masked_fill((counts == 0)[..., None], 0.0)


def _eva_parallel(x, y, v, groups: _Groups, window: int, causal: bool):
    """Every row at once from ``n × M`` masks (reference mode): exact logits on ``E_i`` and the far terms of
    every group from :func:`_far_terms`."""
    n, num_keys = x.shape[-2], y.shape[-2]
    rows, cols = torch.arange(n, device=x.device), torch.arange(num_keys, device=x.device)
    lo, hi = _local_bounds(rows, num_keys, window, groups.size, causal)
    local = (cols[None] >= lo[:, None]) & (cols[None] < hi[:, None])
    exact_logits = (x @ y.transpose(-1, -2)).masked_fill(~local, -math.inf)
    log_mass, beta = _far_terms(x, rows, lo, hi, groups, _grouped(v, groups), causal, 0, groups.count)
    return _combine(exact_logits, v, log_mass, beta)


def _eva_chunked(x, y, v, groups: _Groups, window: int, causal: bool, chunk_size: int):
    """Query chunks. The groups that overlap the chunk's near keys (the union of its local sets) are read through
    masks as in the parallel mode; every other group is entirely far for every row of the chunk (or, causal,
    entirely in the future) and read from its whole-group summary ``(|G_c|, ȳ_c, β_c)``, computed once.
    ``O(N (chunk + w + g + G)(d + d_v))`` time, memory ``O(chunk · (chunk + w + g + G))``, never ``N × M``."""
    n, num_keys = x.shape[-2], y.shape[-2]
    values = _grouped(v, groups)
    lengths = groups.lengths.to(x.dtype)
    key_means = groups.keys.sum(-2) / lengths[:, None]                        # (..., G, d)
    whole_beta = torch.einsum("...gj,...gjd->...gd", torch.softmax(groups.log_features, -1), values)
    group_ends = groups.starts + groups.lengths
    nums, dens, logs = [], [], []
    for a in range(0, n, chunk_size):
        rows = torch.arange(a, min(a + chunk_size, n), device=x.device)
        lo, hi = _local_bounds(rows, num_keys, window, groups.size, causal)
        near_lo, near_hi = int(lo.min()), int(hi.max())
        near_hi = max(near_hi, near_lo)
        x_rows = x[..., a:a + len(rows), :]
        cols = torch.arange(near_lo, near_hi, device=x.device)
        local = (cols[None] >= lo[:, None]) & (cols[None] < hi[:, None])
        exact_logits = (x_rows @ y[..., near_lo:near_hi, :].transpose(-1, -2)).masked_fill(~local, -math.inf)
        log_mass = torch.log(lengths) + x_rows @ key_means.transpose(-1, -2)   # (..., b, G): whole groups
        if causal:
            log_mass = log_mass.masked_fill(group_ends[None, :] > lo[:, None], -math.inf)
        beta = whole_beta[..., None, :, :].expand(*log_mass.shape, v.shape[-1])
        if near_hi > near_lo:                                                  # the groups the near keys touch
            first, last = near_lo // groups.size, -(-near_hi // groups.size)
            touched_mass, touched_beta = _far_terms(x_rows, rows, lo, hi, groups, values, causal, first, last)
            log_mass = torch.cat([log_mass[..., :first], touched_mass, log_mass[..., last:]], -1)
            beta = torch.cat([beta[..., :first, :], touched_beta, beta[..., last:, :]], -2)
        num, den, log_scale = _combine(exact_logits, v[..., near_lo:near_hi, :], log_mass, beta)
        nums.append(num)
        dens.append(den)
        logs.append(log_scale)
    return torch.cat(nums, -2), torch.cat(dens, -1), torch.cat(logs, -1)


def _eva_streaming(x, y, v, noise, num_groups: int, window: int, sample: bool, group_size: int | None = None):
    """Causal EVA token by token, as a decoder runs it: the state is the running sums of each group's keys that
    have left the local sets (count, key sum, and ``Σ e^{l−c}[v, 1]`` under a running maximum ``c``), the keys and
    values of the current local set, and the current group's query and key sums; a group's draw ``ω_c`` is formed
    when its last token arrives. Returns numerator, normaliser and log-scale like the other modes."""
    n, d, d_v = x.shape[-2], x.shape[-1], v.shape[-1]
    size, count = group_layout(n, num_groups, group_size)
    batch = x.shape[:-2]
    counts = torch.zeros(count, dtype=torch.long, device=x.device)
    key_sums = x.new_zeros(*batch, count, d)
    top = x.new_full((*batch, count), -math.inf)
    sums = x.new_zeros(*batch, count, d_v + 1)
    omega = x.new_zeros(*batch, count, d)
    query_sum, key_sum = x.new_zeros(*batch, d), x.new_zeros(*batch, d)
    values = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    left = 0                                                  # keys [0, left) have left the local sets
    nums, dens, logs = [], [], []
    for i in range(n):
        group = i // size
        query_sum = query_sum + x[..., i, :]
        key_sum = key_sum + y[..., i, :]
        if i == min((group + 1) * size, n) - 1:               # the group is complete: form its draw
            length = i + 1 - group * size
            omega[..., group, :] = (query_sum + key_sum) / length + (noise[group] if sample else 0.0)
            query_sum, key_sum = torch.zeros_like(query_sum), torch.zeros_like(key_sum)
        lo = max(0, min(i - window + 1, group * size))
        for m in range(left, lo):                             # keys leaving the local set join their group
            c = m // size
            log_feature = (y[..., m, :] * omega[..., c, :]).sum(-1) - 0.5 * (y[..., m, :] ** 2).sum(-1)
            # the group's value sums: the core's per-feature running-maximum state, one feature (the group)
            empty = int(counts[c]) == 0
            group_sums, group_top = add_log_keys(None if empty else sums[..., c:c + 1, :],
                                                 None if empty else top[..., c:c + 1],
                                                 log_feature[..., None, None], values[..., m:m + 1, :])
            sums[..., c, :], top[..., c] = group_sums[..., 0, :], group_top[..., 0]
            key_sums[..., c, :] = key_sums[..., c, :] + y[..., m, :]
            counts[c] += 1
        left = max(left, lo)
        x_i = x[..., i, :]
        exact_logits = (y[..., lo:i + 1, :] @ x_i[..., None]).squeeze(-1)
        safe = counts.clamp(min=1).to(x.dtype)
        log_mass = torch.log(counts.to(x.dtype)) + (key_sums * x_i[..., None, :]).sum(-1) / safe
        log_mass = log_mass.masked_fill(counts == 0, -math.inf)
        beta = (sums[..., :d_v] / sums[..., d_v:].clamp(min=torch.finfo(x.dtype).tiny)).masked_fill(
            (counts == 0)[..., None], 0.0)
        num, den, log_scale = _combine(exact_logits[..., None, :], v[..., lo:i + 1, :], log_mass[..., None, :],
                                       beta[..., None, :, :])
        nums.append(num[..., 0, :])
        dens.append(den[..., 0])
        logs.append(log_scale[..., 0])
    return torch.stack(nums, -2), torch.stack(dens, -1), torch.stack(logs, -1)


# --------------------------------------------------------------------------------------------- the estimator
class EfficientAttentionCV(AttentionEstimator):
    r"""EVA, training-free: exact attention on a local set of keys, per-group control-variate estimates for the rest
    (the group's mass by its Jensen lower bound instead of the paper's learned group logit; module docstring).

    .. math::
        \mathrm{EVA}(x_i) = \frac{\sum_{m∈E_i} e^{x_i^⊤y_m} v_m + \sum_c Ŝ_c(x_i)\,β_c(ω_c)}
                                 {\sum_{m∈E_i} e^{x_i^⊤y_m} + \sum_c Ŝ_c(x_i)},\qquad
        β_c(ω) = \frac{\sum_{m∈P_c} ξ(y_m, ω) v_m}{\sum_{m∈P_c} ξ(y_m, ω)},\quad Ŝ_c(x) = |P_c|\,e^{x^⊤ȳ_{P_c}}

    with ``C`` = ``num_features`` groups of ``⌈M/C⌉`` consecutive keys (or of ``group_size`` keys, at most
    ``C`` of them), the local set ``E_i`` (a band of
    ``window`` keys, plus the current group when causal) and one draw ``ω_c ~ N(x̄ + ȳ_c, I)`` per group (module
    docstring: derivation, groups, proposals, what differs from the reference code).

    **Positive**, **biased** (``β_c`` does not depend on the query; ``Ŝ_c`` is a Jensen lower bound of the
    group's mass), exact once every key is its own group or the window covers the sequence, but **not
    consistent** in the declared sense (an error falling as ``num_features`` grows like a sampling error): the
    error falls slowly while the groups shrink and vanishes only at ``C ≥ M`` (as for Nyström at ``r = n``);
    **data-dependent** (group summaries and proposals come from the sequence), **causal-capable**: a causal query
    reads only complete earlier groups, whose summaries use only their own tokens (``causal_fit``).

    Modes: ``parallel`` masks an ``n × M`` matrix (reference, small n); ``chunked`` takes query chunks, reads
    the groups that overlap the chunk's local sets through masks and every other group from its whole-group
    summary, ``O(N (chunk + w + g + C)(d + d_v))`` time for groups of ``g`` keys (the current group is exact when
    causal, so ``g`` enters the cost as the window does); ``recurrent`` is, when causal, the decoder's
    token-by-token scan over a streaming state (below), and when non-causal the chunked sweep one query at a time.
    Everything is in the log domain with one shift per row and, inside a group, per row and group: no overflow at
    any norm, and every ``β`` is a convex combination of values as computed.

    State (:meth:`state_bytes`, causal decoding at the end of a sequence of ``seq_len`` tokens in groups of
    ``g`` keys, ``g = ⌈n/C⌉`` or ``group_size``):
    the keys, values and log-features of the local set, at most ``max(w, g)`` tokens (``d + d_v + 1`` each); per
    earlier group its count, key sum, ``Σ e^{l−c}[v, 1]`` and shift ``c`` (``d + d_v + 3``); the current group's
    query and key sums (``2d``). It grows with ``n``: through the group size when ``C`` is fixed, through the
    number of groups when ``group_size`` is (the form a decoder of unknown length uses, as the reference's causal
    code does with its chunk size). For non-causal attention the same count is the size of the compressed
    summary.

    Parameters
    ----------
    num_features : int
        ``C``, the number of groups and of draws (the group size is ``⌈M/C⌉`` for ``M`` keys).
    group_size : int, optional
        Groups of this many keys instead; a sequence may then have at most ``C`` groups (more raises).
    window : int
        ``w ≥ 0``: the band ``|i − j| < w`` (non-causal) or the last ``w`` keys (causal) computed exactly.
    sample : bool
        Draw ``ω_c = μ_c + ε_c`` (default; the paper's training-time rule) or use ``ω_c = μ_c`` (its inference-time
        rule, as the reference code evaluates; deterministic). Training-free either way (module docstring).
    rng : int, SeedSequence or Generator
        Source of the noise ``ε (C, d)``, drawn once at ``fit`` and shared by every batch element and head.
    scale : float, optional
        The attention scale ``s`` (default ``1/sqrt(d)``).

    Attributes
    ----------
    noise_ : ndarray (C, d)
        The standard-normal draws ``ε`` (zeros when ``sample=False``).

    References
    ----------
    Zheng, Yuan, Wang & Kong, *Efficient Attention via Control Variates*, ICLR 2023, §3–4.

    Examples
    --------
    >>> import torch, kernapprox as ka
    >>> q, k, v = (torch.randn(2, 64, 16, dtype=torch.float64) for _ in range(3))
    >>> est = ka.make_estimator("eva", num_features=8, window=8, rng=0).fit(q, k)
    >>> ka.linear_attention(q, k, v, est, causal=True, mode="chunked").shape
    torch.Size([2, 64, 16])
    """

    unbiased = False
    positive = True
    data_dependent = True
    query_dependent = True        # the proposals are centred on the mean query of the call
    causal_fit = True
    consistent = False
    modes = ("parallel", "recurrent", "chunked")
    reference = REFERENCE_SAMPLED         # resolved per ``sample`` by capabilities_for
    # how it uses the linear-attention core: the decoder's per-group value sums are its per-feature state
    core: ClassVar[tuple[str, ...]] = ("add_log_keys",)

    def __init__(self, *, num_features: int, window: int = 32, group_size: int | None = None, sample: bool = True,
                 rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.group_size = None if group_size is None else check_positive_int(group_size, "group_size")
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
            raise ValueError(f"window must be a non-negative integer, got {window!r}")
        self.window = int(window)
        self.sample = check_bool(sample, "sample")

    @classmethod
    def capabilities_for(cls, **options):
        """The declarations, with the reference naming the rule: the training-time rule (sampled ``ω``) or the
        inference-time rule ``ω = μ``, both training-free."""
        caps = super().capabilities_for(**options)
        sample = options.get("sample", True)
        return dataclasses.replace(caps, reference=REFERENCE_SAMPLED if sample else REFERENCE_MEAN)

    def _fit(self, q, k, rng):
        if self.sample:
            self.noise_ = rng.standard_normal((self.num_features, self.dim_))
        else:
            self.noise_ = np.zeros((self.num_features, self.dim_))

    def _scaled(self, q, k):
        ct = compute_dtype(q.dtype)
        root = math.sqrt(self.scale_)
        return q.to(ct) * root, k.to(ct) * root

    def attention(self, q, k, v, *, causal=False, mode="chunked", chunk_size=64, return_parts=False):
        """EVA in the ``parallel``, ``chunked`` or ``recurrent`` mode (class docstring), causal or not."""
        self._check_call(q, k, v, causal, mode, chunk_size)
        x, y = self._scaled(q, k)
        vc = v.to(x.dtype)
        noise = self._param("noise_", x)
        if mode == "recurrent" and causal:
            num, den, log_scale = _eva_streaming(x, y, vc, noise, self.num_features, self.window, self.sample,
                                                 self.group_size)
        else:
            groups = _Groups(x, y, noise, self.num_features, causal, self.sample, self.group_size)
            if mode == "parallel":
                num, den, log_scale = _eva_parallel(x, y, vc, groups, self.window, causal)
            else:
                size = 1 if mode == "recurrent" else chunk_size
                num, den, log_scale = _eva_chunked(x, y, vc, groups, self.window, causal, size)
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, log_scale)
        return out

    def kernel_matrix(self, q, k):
        """The implied matrix ``Â (..., n_q, n_k)`` (``EVA = Â V / Â 1``): ``exp(s q_iᵀk_j)`` on ``E_i``, and for
        the far keys ``P`` of a group ``Ŝ(x_i) ξ(y_j, ω_c) / Σ_P ξ(y_m, ω_c)``; its lower triangle is not the
        causal estimate (the causal local sets and draws differ), so this is the non-causal one."""
        self._check_fitted()
        check_qk(q, k)
        self._check_dim(q)
        x, y = self._scaled(q, k)
        groups = _Groups(x, y, self._param("noise_", x), self.num_features, False, self.sample, self.group_size)
        return torch.exp(_eva_log_kernel(x, y, groups, self.window)).to(q.dtype)

    def parameter_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """The noise ``ε`` (regenerable from the seed) when the estimator samples; nothing at the proposal means."""
        self._check_fitted()
        return int(self.noise_.size) * itemsize(dtype) if self.sample else 0

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None) -> int:
        """``(min(max(w, g), n)(d + d_v + 1) + (G − 1)(d + d_v + 3) + 2d) · itemsize`` for ``n = seq_len`` in
        ``G = ⌈n/g⌉`` groups of ``g`` keys (class docstring). ``seq_len`` is required: the state depends on it."""
        self._check_fitted()
        check_positive_int(d_v, "d_v")
        if seq_len is None:
            raise ValueError("EVA's state depends on the sequence length (its group size is ⌈n/C⌉): pass seq_len")
        n = check_positive_int(seq_len, "seq_len")
        size, count = group_layout(n, self.num_features, self.group_size)
        d = self.dim_
        numbers = min(max(self.window, size), n) * (d + d_v + 1) + (count - 1) * (d + d_v + 3) + 2 * d
        return numbers * itemsize(dtype)


def _eva_log_kernel(x, y, groups: _Groups, window: int):
    """``log Â`` of the non-causal estimate, ``(..., n, M)``, from the same masks as :func:`_eva_parallel`."""
    n, num_keys = x.shape[-2], y.shape[-2]
    rows, cols = torch.arange(n, device=x.device), torch.arange(num_keys, device=x.device)
    lo, hi = _local_bounds(rows, num_keys, window, groups.size, False)
    local = (cols[None] >= lo[:, None]) & (cols[None] < hi[:, None])
    pad = groups.count * groups.size - num_keys
    far = torch.nn.functional.pad(~local, (0, pad)).reshape(n, groups.count, groups.size)
    counts = far.sum(-1)
    key_sums = torch.einsum("igj,...gjd->...igd", far.to(y.dtype), groups.keys)
    log_mass = torch.log(counts.to(x.dtype)) + (x[..., None, :] * key_sums).sum(-1) / counts.clamp(min=1).to(x.dtype)
    logs = groups.log_features[..., None, :, :].masked_fill(~far, -math.inf)   # (..., n, G, g)
    log_share = logs - torch.logsumexp(logs, -1, keepdim=True).nan_to_num(neginf=0.0)
    far_log = (log_mass[..., None] + log_share).flatten(-2)[..., :num_keys]
    return torch.where(local, x @ y.transpose(-1, -2), far_log)


register("eva", EfficientAttentionCV)
register("eva_mean", EfficientAttentionCV, sample=False)
