r"""EVA: efficient attention via control variates (Zheng, Yuan, Wang & Kong, ICLR 2023).

Notation as in :mod:`kernapprox.estimators.lara`: ``x = sqrt(s)·q``, ``y = sqrt(s)·k``,
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
key, or identical keys). Cost: the group summaries ``(ȳ_c, |P_c|, β_c)`` are computed once, each query reads the
``|E|`` exact keys and the ``C`` summaries — ``O(N (|E| + C) d)``.

Groups, local sets and proposals here (a definition that partitions the keys; the reference code differs, see
below). ``C`` = ``num_features`` groups of ``g = ⌈M/C⌉`` consecutive keys, ``G_c = [cg, min((c+1)g, M))`` (fewer
than ``C`` groups when ``C`` does not divide ``M`` evenly enough); query ``i`` computes exactly

* non-causal: the band ``E_i = {j : |i − j| < w}`` (empty for ``w = 0``), as :class:`~kernapprox.hybrid.
  WindowLinear` does;
* causal: ``E_i = {j : min(i − w + 1, g⌊i/g⌋) ≤ j ≤ i}``, the last ``w`` keys *and* the keys of its own,
  unfinished group;

and every other key ``j`` it may see (``j ≤ i`` if causal) through its group: ``P_c(i) = G_c ∖ E_i`` restricted
to those keys, with ``ȳ``, ``|P|`` and ``β_c`` taken over ``P_c(i)`` (a prefix and/or suffix of ``G_c``). Group
``c``'s proposal mean is ``μ_c = x̄ + ȳ_c`` (``ȳ_c`` over the whole group): the optimal proposal of query ``x`` for
the group's keys is the mixture ``Σ_{m∈G_c} π_{m|c} N(ω; x + y_m)`` (the randomized-attention density of the LARA
paper restricted to the group), whose mean is ``x + Σ π_{m|c} y_m ≈ x + ȳ_c`` for the queries that read the group;
``x̄`` is their mean — all queries when non-causal; when causal, the group's own queries (as in the reference's
causal code), because a decoder forms the group's summary when the group is complete, before the later queries
that read it exist. ``ω_c = μ_c + ε_c`` with ``ε_c ~ N(0, I)`` (``sample=True``, the paper's estimator) or
``ω_c = μ_c`` (``sample=False``, the reference code at inference: deterministic).

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
Re-derived here and verified numerically (``tests/test_eva.py``): the control-variate decomposition (shared
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

import math

import numpy as np

from .lara import _as_float64, _log_normal, _log_xi


# --------------------------------------------------------------------------------------------- shared pieces
def group_bounds(num_keys: int, num_groups: int) -> np.ndarray:
    """``(G, 2)`` integer array of ``[start, stop)`` of the groups: ``g = ⌈M/C⌉`` consecutive keys each (the last
    one shorter), ``G = ⌈M/g⌉ ≤ C`` groups."""
    size = -(-num_keys // num_groups)
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


def _eva_terms(q, k, noise, num_groups, window, causal, sample, scale):
    """Per head: scaled ``x, y``, group bounds and the draws ``ω_c`` of EVA's proposals, by plain loops."""
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    x, y = root * q, root * k
    bounds = group_bounds(y.shape[0], num_groups)
    omega = np.zeros((len(bounds), x.shape[1]))
    for c, (a, b) in enumerate(bounds):
        y_bar = sum(y[m] for m in range(a, b)) / (b - a)
        readers = range(a, b) if causal else range(x.shape[0])
        x_bar = sum(x[i] for i in readers) / len(readers)
        omega[c] = x_bar + y_bar + (noise[c] if sample else 0.0)
    return x, y, bounds, omega


def _check_eva(noise, num_groups, d, window, causal, n_q, n_k):
    noise = _as_float64(noise)
    if noise.ndim != 2 or noise.shape[1] != d or noise.shape[0] < min(num_groups, n_k):
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
                         group_mass: str = "mean", scale: float | None = None) -> np.ndarray:
    """EVA's implied kernel matrix ``Â (..., n, M)`` by plain loops: ``EVA = Â V / Â 1`` row by row.

    ``noise``: ``(C, d)`` standard-normal draws ``ε_c`` (``ω_c = μ_c + ε_c``; ignored when ``sample=False``).
    ``group_mass``: ``"mean"`` (EVA's ``Ŝ_c = |P| exp(xᵀȳ_P)``) or ``"exact"`` (``S_c``: the quadratic
    per-group control-variate estimator EVA approximates).
    """
    q, k = _as_float64(q), _as_float64(k)
    noise = _check_eva(noise, num_groups, q.shape[-1], window, causal, q.shape[-2], k.shape[-2])

    def one(qh, kh):
        x, y, bounds, omega = _eva_terms(qh, kh, noise, num_groups, window, causal, sample, scale)
        return np.stack([_eva_row_weights(x[i], y, i, bounds, omega, window, causal, group_mass)
                         for i in range(x.shape[0])])

    batch = q.shape[:-2]
    outs = [one(q[idx], k[idx]) for idx in np.ndindex(*batch)]
    return np.stack(outs).reshape(*batch, q.shape[-2], k.shape[-2])


def eva_reference(q, k, v, noise, *, num_groups: int, window: int, causal: bool = False, sample: bool = True,
                  group_mass: str = "mean", scale: float | None = None) -> np.ndarray:
    """EVA's output by a plain float64 loop over queries and groups, straight from the definition.

    Per query ``i``: the exact sums over ``E_i``, then for every group ``c`` with keys left in
    ``P_c(i)``: ``Ŝ_c(x_i)`` and ``β_c = Σ_P ξ(y_m, ω_c) v_m / Σ_P ξ(y_m, ω_c)`` accumulated into the numerator and
    normaliser. Arguments as in :func:`eva_kernel_reference`; unstabilised exponentials (moderate inputs only).
    """
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    noise = _check_eva(noise, num_groups, q.shape[-1], window, causal, q.shape[-2], k.shape[-2])

    def one(qh, kh, vh):
        x, y, bounds, omega = _eva_terms(qh, kh, noise, num_groups, window, causal, sample, scale)
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
