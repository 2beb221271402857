r"""State-update rules of linear attention: four ways to write a fixed-size state from the same feature map.

Every finite feature map ``φ`` (``r`` features) gives linear attention a state of ``O(r · d_v)`` numbers. The
*rule* decides what the state holds after the keys ``k_1..k_t`` and how a query reads it:

``"sum"`` (:class:`Sum`)
    ``W_t = Σ_s φ(k_s) v_sᵀ``, ``z_t = Σ_s φ(k_s)``; read ``Wᵀφ(q) / zᵀφ(q)`` (normalised like attention);
    ``r (d_v + 1)`` numbers.
:class:`Decay` ``(γ)``
    ``W_t = Σ_s γ^{t−s} φ(k_s) v_sᵀ``, ``z_t`` likewise; normalised read-out; ``r (d_v + 1)`` numbers.
:class:`Delta` ``(β)``
    ``W_t = W_{t−1} + β_t φ̄_t (v_t − W_{t−1}ᵀφ̄_t)ᵀ``; read ``Wᵀφ̄(q)`` (not normalised); ``r d_v`` numbers.
:class:`LeastSquares` ``(λ)``
    ``W_t = (K̄_tᵀK̄_t + λI)^{−1} K̄_tᵀV_t`` with ``P_t = (K̄_tᵀK̄_t + λI)^{−1}`` kept for the recursion; read
    ``Wᵀφ̄(q)`` (not normalised); ``r² + r d_v`` numbers.

``φ̄ = φ/‖φ‖₂``: the delta rule needs unit keys to be stable for ``β ∈ (0, 2]``, and the least-squares state uses
the same features so that the delta rule is one gradient step on its loss. Because every map returns
``φ = φ̃ · e^ℓ`` with a per-token scalar ``ℓ``, ``φ̄ = φ̃/‖φ̃‖`` exactly: the log-scale cancels and nothing
overflows at any input norm. The sum and decay rules keep ``ℓ`` in a running maximum (see
:mod:`kernapprox.attention.linear`).

All four run in the ``parallel``, ``recurrent`` and ``chunked`` modes of :func:`kernapprox.linear_attention` and
in :class:`kernapprox.RecurrentState`, causal and non-causal (every query reads the state after the last key).
The chunked delta rule uses the WY/UT representation, the chunked least-squares state a Cholesky/Woodbury update
per chunk; both are linear in ``n``.
Prefill → decode: ``linear_attention(..., return_state=True)`` returns the state (:class:`NormalizedState`,
:class:`DeltaState`, :class:`LeastSquaresState`), which ``initial_state=`` and ``RecurrentState(initial_state=)``
accept. Every feature map declares all four in ``capabilities().rules``; the exact kernel and the estimators that
bring their own attention declare ``("sum",)``.

References
----------
Katharopoulos et al., *Transformers are RNNs*, ICML 2020 (sum). Sun et al., *Retentive Network*, arXiv 2307.08621,
2023 (decay). Schlag, Irie & Schmidhuber, *Linear Transformers Are Secretly Fast Weight Programmers*, ICML 2021
(delta rule). Yang et al., *Parallelizing Linear Transformers with the Delta Rule over Sequence Length*, NeurIPS
2024 (chunked WY/UT form). Wang, Shi & Fox, *Test-time regression*, arXiv 2501.12352, 2025 (least squares).

Examples
--------
>>> import torch, kernapprox as ka
>>> ka.available_rules()
['sum', 'decay', 'delta', 'least_squares']
>>> gen = torch.Generator().manual_seed(0)
>>> q, k, v = (torch.randn(3, 50, 8, generator=gen, dtype=torch.float64) for _ in range(3))
>>> est = ka.make_estimator("positive_orthogonal", num_features=32, rng=0).fit(q, k)
>>> for rule in ("sum", ka.rules.Decay(0.95), ka.rules.Delta(0.5), ka.rules.LeastSquares(0.1)):
...     ys = [ka.linear_attention(q, k, v, est, causal=True, mode=m, rule=rule, chunk_size=16)
...           for m in ka.MODES]
...     assert all(torch.allclose(y, ys[0], atol=1e-10) for y in ys)
>>> ka.rules.LeastSquares(0.1).state_bytes(est, d_v=8)        # (r² + r d_v) float32 numbers
5120
"""

from .attention.rules import (
    Decay,
    Delta,
    DeltaState,
    LeastSquares,
    LeastSquaresState,
    NormalizedState,
    Rule,
    Sum,
    available_rules,
    resolve_rule,
)

__all__ = ["Rule", "Sum", "Decay", "Delta", "LeastSquares", "NormalizedState", "DeltaState", "LeastSquaresState",
           "available_rules", "resolve_rule"]
