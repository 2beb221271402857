"""Low-rank attention that is not a feature map: Nyströmformer and the two rank-r SVD references.

All need the whole sequence (no recurrent state) and run in the parallel mode only. Nyströmformer is the
segment-means Nyström form of Xiong et al. (2021). The references are oracles (they need the exact ``n × n``
matrices and an SVD), each named for the one matrix whose error it bounds:

=================  ==========================================================================================
``kernel_svd``     :class:`KernelSVD`: the best rank-r approximation ``K_r`` of the kernel matrix
                   ``K = exp(s QKᵀ)``. A floor for the **kernel-matrix** error (Frobenius or spectral) of every
                   method whose implied kernel matrix has rank ≤ r; not for the attention matrix or the output.
``attention_svd``  :class:`AttentionSVD`: the best rank-r approximation ``P_r`` of the row-normalised attention
                   matrix ``P = D⁻¹K``. A floor for the **attention-matrix** error of every non-causal method whose
                   implied attention matrix has rank ≤ r; not for the kernel matrix or the output.
=================  ==========================================================================================

Neither bounds the attention-output error ``‖P̂V − PV‖``. For that metric the only rank-r floor is the
truncated SVD of the output itself, :func:`output_error_floor` (a method whose implied attention matrix has rank
≤ r produces an output of rank ≤ r); it is zero once ``r ≥ rank(PV)`` (at most ``d_v``): ``P̂ = P V V⁺`` has rank
≤ ``d_v`` and reproduces the output exactly, so no rank-r method is excluded from exact outputs when
``r ≥ d_v``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..attention.linear import linear_attention_from_features
from ..estimators.base import AttentionEstimator, AttentionParts
from ..estimators.registry import register
from ..kernel import resolve_scale
from ..validation import check_choice, check_positive_int, check_qk, check_tensor, compute_dtype

PINV_METHODS = ("iterative", "exact")
PINV_INITS = ("original", "per_matrix")


# ------------------------------------------------------------------------------------------------ helpers
def signed_exp(values: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """``values · e^{log_scale}`` as ``sign · exp(log|values| + log_scale)``: an entry that is 0 stays 0 where
    ``e^{log_scale}`` overflows (never ``0 · inf = NaN``). The kernel matrices of shifted estimates."""
    return torch.sign(values) * torch.exp(torch.log(values.abs()) + log_scale)


def segment_means(x: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Means of ``num_segments`` consecutive segments of the rows of ``x``: ``(..., n, d) -> (..., m, d)``.

    When ``m`` does not divide ``n`` the segments have ``floor(n/m)`` or ``floor(n/m) + 1`` rows, the longer
    ones last (the remainder rule of the Nyströmformer ImageNet code); ``m ≤ n`` is required.
    """
    check_tensor(x, "x")
    m = check_positive_int(num_segments, "num_segments")
    n = x.shape[-2]
    if m > n:
        raise ValueError(f"num_segments ({m}) must not exceed the number of rows ({n})")
    base, extra = divmod(n, m)
    short = m - extra
    head = x[..., :short * base, :].unflatten(-2, (short, base)).mean(-2)
    if not extra:
        return head
    tail = x[..., short * base:, :].unflatten(-2, (extra, base + 1)).mean(-2)
    return torch.cat([head, tail], dim=-2)


def iterative_pinv(a: torch.Tensor, num_iterations: int = 6, init: str = "original") -> torch.Tensor:
    r"""Iterative Moore–Penrose pseudo-inverse of square matrices ``(..., m, m)`` (Razavi et al. 2014).

    ``Z_{j+1} = ¼ Z_j (13 I − A Z_j (15 I − A Z_j (7 I − A Z_j)))``, third-order convergent near the solution,
    from ``Z_0 = Aᵀ / (‖A‖₁ ‖A‖_∞)``, which satisfies ``‖I − A Z_0‖₂ < 1``. ``init`` chooses where the norms
    are taken:

    ``"original"``   the largest column sum and the largest row sum over the whole tensor (all batch elements
                     and heads at once), as in the original Nyströmformer code (for a row-softmax ``A`` the row
                     sums are 1);
    ``"per_matrix"`` ``‖A‖₁ ‖A‖_∞`` of each matrix, the alternative the authors added later ("can lead to
                     faster convergence").

    Absolute values are used in the sums, so any real matrix is accepted. Small singular values grow by at
    most ×3.25 per step: ill-conditioned matrices need many more than the customary 6 iterations.
    """
    check_tensor(a, "a")
    check_positive_int(num_iterations, "num_iterations")
    check_choice(init, "init", PINV_INITS)
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be square, got shape {tuple(a.shape)}")
    col = a.abs().sum(-2).amax(-1)
    row = a.abs().sum(-1).amax(-1)
    if init == "original":
        col, row = col.amax(), row.amax()
    else:
        col, row = col[..., None, None], row[..., None, None]
    z = a.transpose(-1, -2) / (col * row)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(num_iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


# ------------------------------------------------------------------------------------------- Nyströmformer
class Nystromformer(AttentionEstimator):
    r"""Nyströmformer attention: ``F · A⁺ · (B · V)`` from segment-means landmarks.

    With ``x = sqrt(s)·q``, ``y = sqrt(s)·k`` and landmarks ``Q̃``, ``K̃`` = means of ``m`` consecutive segments
    of the queries and keys (:func:`segment_means`),

    .. math::
        F = \mathrm{softmax}(X K̃^⊤),\quad A = \mathrm{softmax}(Q̃ K̃^⊤),\quad B = \mathrm{softmax}(Q̃ Y^⊤),
        \qquad \mathrm{out} = F\,A^{+}\,(B V)

    (row softmax; Xiong et al. 2021, eq. (15) in the numbering of the reference implementations). ``A⁺`` is the
    iterative pseudo-inverse (:func:`iterative_pinv`, ``pinv_iterations`` steps from ``pinv_init``) or the exact
    one (``torch.linalg.pinv`` in float64). The Nyström form is applied to row-softmaxed blocks, not to
    ``exp(s QKᵀ)``: **biased**, entries of the implied matrix ``F A⁺ B`` can be **negative**, its rows sum to 1
    when ``A`` is invertible and ``A⁺ = A⁻¹`` (``F A⁻¹ B 1 = F A⁻¹ 1 = F 1 = 1``), only approximately with
    the truncated iteration. **Data-dependent** (landmarks from the sequence itself) and **not causal**: a
    segment mean averages over later tokens, so ``causal=True`` raises ``ValueError``. No residual convolution
    (it is a learned layer, not part of the approximation). O(n·m·(d + d_v) + m³·iterations) time, never n×n.

    Lengths: ``m`` landmarks per sequence; when ``m`` does not divide the length the segments differ by one
    row (:func:`segment_means`). If the queries or the keys number fewer than ``m``, ``m`` is reduced to that
    length for both; with ``n_q = n_k ≤ m`` every token is its own segment, ``F = A = B`` are the exact
    attention weights and the result is exact with the exact pseudo-inverse.

    Parameters
    ----------
    num_features : int
        ``m``, the number of landmarks.
    pinv : {"iterative", "exact"}
    pinv_iterations : int
        Steps of the iteration (6 in the paper and its code).
    pinv_init : {"original", "per_matrix"}
        Initialisation of the iteration, see :func:`iterative_pinv`. "original" couples the batch elements (one
        global scale, as in the reference code).
    renormalize : bool
        Divide each output row by the implied row sum ``F A⁺ B 1`` (not in the paper; default False). The
        attention parts report that row sum as the normaliser when True and 1 otherwise.
    rng, scale
        ``rng`` is unused (nothing is random); ``scale`` is the kernel scale ``s`` (default ``1/sqrt(d)``).

    References
    ----------
    Xiong et al., *Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention*, AAAI 2021.
    Razavi et al., *A new iterative method for finding approximate inverses of complex matrices*, Abstract and
    Applied Analysis 2014 (the pseudo-inverse iteration).
    """

    unbiased = False
    positive = False
    data_dependent = True
    query_dependent = True        # landmarks are segment means of the queries of the call
    causal_fit = False
    causal = False
    rank_limited_by_points = True
    modes = ("parallel",)
    reference = "Xiong et al. 2021 (Nyströmformer, AAAI), segment-means landmarks, eq. (15); Razavi et al. 2014"
    # none of the core: F A⁺ (B V) multiplies row-softmaxed blocks, with no feature map and no stabilised state
    core: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, num_features: int, pinv: str = "iterative", pinv_iterations: int = 6,
                 pinv_init: str = "original", renormalize: bool = False, rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.pinv = check_choice(pinv, "pinv", PINV_METHODS)
        self.pinv_iterations = check_positive_int(pinv_iterations, "pinv_iterations")
        self.pinv_init = check_choice(pinv_init, "pinv_init", PINV_INITS)
        if not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {renormalize!r}")
        self.renormalize = renormalize

    def _blocks(self, q, k):
        """``F (..., n_q, m)``, ``A⁺ (..., m, m)``, ``B (..., m, n_k)`` in the compute dtype."""
        ct = compute_dtype(q.dtype)
        root = math.sqrt(self.scale_)
        x, y = q.to(ct) * root, k.to(ct) * root
        m = min(self.num_features, x.shape[-2], y.shape[-2])
        q_land, k_land = segment_means(x, m), segment_means(y, m)
        f = torch.softmax(x @ k_land.transpose(-1, -2), dim=-1)
        a = torch.softmax(q_land @ k_land.transpose(-1, -2), dim=-1)
        b = torch.softmax(q_land @ y.transpose(-1, -2), dim=-1)
        if self.pinv == "exact":
            a_pinv = torch.linalg.pinv(a.to(torch.float64)).to(ct)
        else:
            a_pinv = iterative_pinv(a, self.pinv_iterations, self.pinv_init)
        return f, a_pinv, b

    def kernel_matrix(self, q, k):
        """The implied attention matrix ``F A⁺ B`` ``(..., n_q, n_k)`` (row-normalised if ``renormalize``).

        It is row-stochastic with the exact pseudo-inverse (invertible ``A``); quadratic memory, for small n.
        """
        self._check_fitted()
        check_qk(q, k)
        self._check_dim(q)
        f, a_pinv, b = self._blocks(q, k)
        mat = (f @ a_pinv) @ b
        if self.renormalize:
            mat = mat / mat.sum(-1, keepdim=True)
        return mat.to(q.dtype)

    def attention(self, q, k, v, *, causal=False, mode="parallel", chunk_size=64, return_parts=False):
        """``F · (A⁺ · (B · V))``; see the class docstring. ``chunk_size`` is accepted and unused."""
        if causal is True:
            raise ValueError("Nyströmformer is not causal: its segment-mean landmarks average over later tokens "
                             "(use causal=False)")
        self._check_call(q, k, v, causal, mode, chunk_size)
        f, a_pinv, b = self._blocks(q, k)
        vc = v.to(f.dtype)
        ones = torch.ones_like(vc[..., :1])
        summary = a_pinv @ (b @ torch.cat([vc, ones], dim=-1))     # (..., m, d_v + 1)
        both = f @ summary
        num, row_sum = both[..., :-1], both[..., -1]
        den = row_sum if self.renormalize else torch.ones_like(row_sum)
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, torch.zeros_like(den))
        return out


# ----------------------------------------------------------------------------------- the rank-r references
class KernelSVD(AttentionEstimator):
    r"""The best rank-r approximation of the kernel matrix ``exp(s QKᵀ)`` (Eckart–Young–Mirsky): a floor for the
    kernel-matrix error only.

    .. math::
        K = e^{s Q K^⊤} = U Σ V^⊤,\qquad K_r = U_{:r} Σ_{:r} V_{:r}^⊤,\qquad
        \|K − K_r\|_F = \Big(\sum_{i>r} σ_i^2\Big)^{1/2},\quad \|K − K_r\|_2 = σ_{r+1}

    computed by a float64 SVD after factoring out ``c = max_ij s q_iᵀk_j`` (``K = e^c K'``; the SVD of ``K'``
    scales). It is an oracle, not an algorithm: it needs the exact ``n_q × n_k`` matrix of the queries and keys it
    is given and an O(n³) SVD (``max_size`` guards against large n), has no recurrent state, and is **biased**,
    **signed** and **data-dependent** (its read-out of a query depends on every other query).

    What it bounds: no method whose implied kernel matrix ``K̂`` (``φ(Q)φ(K)ᵀ`` for ``r`` features, Nyström with
    ``r`` landmarks) has rank ≤ ``r`` has ``‖K − K̂‖`` below ``‖K − K_r‖`` in Frobenius or spectral norm, on the
    same matrix. What it does not bound: the row-normalised attention matrix (normalising rows reweights the
    errors; :class:`AttentionSVD` is that floor), the attention output (a method with a larger kernel error can
    have a smaller output error, and did in the measured ``query_distribution`` cells), causal attention (a
    masked matrix is not low rank), or a feature map's error on other inputs.

    Attention is row-normalised, ``out = K_r V / K_r 1`` (the normaliser may be ≤ 0). ``causal=True`` masks
    ``K_r`` to the lower triangle, which is what a rank-r feature map does in causal mode; it is not the best
    approximation among masked matrices. With ``r ≥ min(n_q, n_k)`` the result is exact.

    Parameters
    ----------
    num_features : int
        The rank ``r``.
    max_size : int
        Largest ``max(n_q, n_k)`` accepted (the SVD is cubic).
    rng, scale
        ``rng`` is unused; ``scale`` is the kernel scale ``s`` (default ``1/sqrt(d)``).

    References
    ----------
    Eckart & Young, *The approximation of one matrix by another of lower rank*, Psychometrika 1 (1936); Mirsky,
    *Symmetric gauge functions and unitarily invariant norms*, Q. J. Math. 11 (1960) (every unitarily invariant norm).

    Examples
    --------
    >>> import torch
    >>> q, k = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    >>> est = KernelSVD(num_features=3).fit(q, k)
    >>> exact = torch.exp(q @ k.T / 2.0)
    >>> sigma = est.singular_values(q, k)
    >>> bool(torch.isclose(torch.linalg.norm(exact - est.kernel_matrix(q, k)), sigma[3:].norm()))
    True
    """

    unbiased = False
    positive = False
    data_dependent = True
    query_dependent = True        # the SVD of the matrix of the queries and keys of the call
    causal_fit = False
    consistent = True
    rank_limited_by_points = True
    modes = ("parallel",)
    reference = "Eckart & Young 1936 (best rank-r approximation of the kernel matrix; bounds kernel error only)"
    # how it uses the linear-attention core: the rank-r factors are features of the parallel mode
    core: ClassVar[tuple[str, ...]] = ("linear_attention_from_features",)

    def __init__(self, *, num_features: int, max_size: int = 4096, rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.max_size = check_positive_int(max_size, "max_size")

    def _logits(self, q, k):
        self._check_dim(q)
        if max(q.shape[-2], k.shape[-2]) > self.max_size:
            raise ValueError(f"sequence length {max(q.shape[-2], k.shape[-2])} exceeds max_size={self.max_size} "
                             f"({type(self).__name__} needs a dense SVD)")
        return self.scale_ * (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2))

    def _scaled_matrix(self, logits):
        """The matrix whose SVD is taken and its log-scale: ``(K e^{−c}, c)``, ``c = max_ij s q_iᵀk_j``."""
        shift = logits.amax(dim=(-1, -2), keepdim=True)
        return torch.exp(logits - shift), shift

    def _svd(self, q, k):
        matrix, log_scale = self._scaled_matrix(self._logits(q, k))
        u, sigma, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u, sigma, vh, log_scale

    def _factors(self, q, k):
        """The truncated matrix as features, ``F Gᵀ`` with ``F = U_{:r} Σ_{:r}``, ``G = V_{:r}``, and its
        log-scale (``K_r = F Gᵀ e^{shift}``)."""
        u, sigma, vh, shift = self._svd(q, k)
        r = self.num_features
        return u[..., :r] * sigma[..., None, :r], vh[..., :r, :].transpose(-1, -2), shift

    def _truncated(self, q, k):
        left, right, shift = self._factors(q, k)
        return left @ right.transpose(-1, -2), shift

    def singular_values(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Singular values of ``exp(s QKᵀ)``, descending, float64 ``(..., min(n_q, n_k))``."""
        self._check_fitted()
        check_qk(q, k)
        _, sigma, _, shift = self._svd(q, k)
        return sigma * torch.exp(shift[..., 0])

    def kernel_matrix(self, q, k):
        """``K_r`` ``(..., n_q, n_k)`` in the inputs' dtype (overflows only where the true matrix does)."""
        self._check_fitted()
        check_qk(q, k)
        approx, shift = self._truncated(q, k)
        return signed_exp(approx, shift).to(q.dtype)

    def attention(self, q, k, v, *, causal=False, mode="parallel", chunk_size=64, return_parts=False):
        """``K_r V / K_r 1`` (lower-triangular ``K_r`` if causal): linear attention of the core
        (:func:`~kernapprox.attention.linear.linear_attention_from_features`, parallel mode) on the rank-r factors
        ``K_r = (U_{:r}Σ_{:r}) V_{:r}ᵀ e^{shift}`` in float64. ``chunk_size`` is accepted and unused."""
        self._check_call(q, k, v, causal, mode, chunk_size)
        left, right, shift = self._factors(q, k)
        zeros = torch.zeros(right.shape[:-1], dtype=right.dtype, device=right.device)
        parts = linear_attention_from_features(left, shift[..., 0].expand(left.shape[:-1]), right, zeros,
                                               v.to(torch.float64), causal=causal, mode="parallel")
        ct = compute_dtype(q.dtype)
        num, den = parts.numerator.to(ct), parts.normalizer.to(ct)
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, parts.log_scale.to(ct))
        return out


class AttentionSVD(KernelSVD):
    r"""The best rank-r approximation of the row-normalised attention matrix ``softmax(s QKᵀ)``: a floor for the
    attention-matrix error only.

    .. math::
        P = D^{-1}K,\ \ D = \operatorname{diag}(K\mathbf 1),\qquad P = U Σ V^⊤,\qquad
        P_r = U_{:r} Σ_{:r} V_{:r}^⊤,\qquad \mathrm{out} = P_r V

    (float64 SVD of the softmax, computed in log space). The output is ``P_r V`` as is: ``P_r`` is not
    row-stochastic, and renormalising it would no longer be the optimum. An oracle like :class:`KernelSVD`:
    exact ``n_q × n_k`` matrix, O(n³), no recurrent state, **biased**, **signed**, **data-dependent**, **not
    causal**.

    What it bounds: a non-causal linear attention with ``r`` features implies ``P̂ = D̂⁻¹ φ(Q)φ(K)ᵀ``, of rank
    ≤ ``r`` (a row scaling keeps the rank); so do Nyström with ``r`` landmarks, Nyströmformer with ``r`` landmarks
    (``F A⁺ B``) and the row-normalised ``K_r`` of :class:`KernelSVD`. None of them has ``‖P − P̂‖`` (Frobenius or
    spectral) below ``‖P − P_r‖`` on the same matrix. What it does not bound: the kernel-matrix error (that is
    :class:`KernelSVD`), causal attention (a masked low-rank matrix is not low rank), a hybrid with an exact band
    (full rank), and the **attention-output error**: ``‖(P − P̂)V‖`` can be smaller than ``‖(P − P_r)V‖`` (the
    error may lie in directions ``V`` does not see); the floor for the output is :func:`output_error_floor`, zero
    once ``r ≥ rank(PV)``.

    ``kernel_matrix`` returns ``D P_r``, the kernel matrix implied by ``P_r`` with the exact row sums (an oracle
    value, not an optimum of the kernel error).

    Parameters
    ----------
    num_features, max_size, rng, scale
        As for :class:`KernelSVD` (``num_features`` is the rank ``r``).

    References
    ----------
    Eckart & Young 1936; Mirsky 1960 (as for :class:`KernelSVD`), applied to ``softmax(s QKᵀ)``; the rank argument
    for linear attention: Wang et al., *Linformer: Self-Attention with Linear Complexity*, arXiv 2006.04768
    (2020), §3 (the softmax attention matrix is approximately low rank).

    Examples
    --------
    >>> import torch
    >>> q, k = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    >>> v = torch.randn(12, 3, dtype=torch.float64)
    >>> est = AttentionSVD(num_features=12).fit(q, k)         # full rank: exact attention
    >>> bool(torch.allclose(est.attention(q, k, v), torch.softmax(q @ k.T / 2.0, -1) @ v))
    True
    """

    causal = False
    reference = "Eckart & Young 1936 applied to softmax(sQKᵀ) (bounds the attention-matrix error only)"

    def _scaled_matrix(self, logits):
        """``(P, log D)``: the row-normalised attention matrix (computed in log space) and its row log-sums."""
        log_rows = torch.logsumexp(logits, dim=-1, keepdim=True)              # log D
        return torch.exp(logits - log_rows), log_rows

    def singular_values(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Singular values of ``softmax(s QKᵀ)``, descending, float64 ``(..., min(n_q, n_k))``."""
        self._check_fitted()
        check_qk(q, k)
        return self._svd(q, k)[1]

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``P_r`` ``(..., n_q, n_k)`` in the inputs' dtype."""
        self._check_fitted()
        check_qk(q, k)
        return self._truncated(q, k)[0].to(q.dtype)

    def kernel_matrix(self, q, k):
        """``D P_r`` with the exact row sums ``D = diag(exp(s QKᵀ) 1)``, in the inputs' dtype."""
        return super().kernel_matrix(q, k)

    def attention(self, q, k, v, *, causal=False, mode="parallel", chunk_size=64, return_parts=False):
        """``P_r V`` (non-causal only): the numerator of the core's linear attention
        (:func:`~kernapprox.attention.linear.linear_attention_from_features`, parallel mode) on the factors
        ``P_r = (U_{:r}Σ_{:r}) V_{:r}ᵀ`` in float64, not divided by its row sums (``P_r`` is not row-stochastic,
        and renormalising would no longer be the optimum). ``chunk_size`` is accepted and unused."""
        if causal is True:
            raise ValueError("AttentionSVD is not causal: a masked low-rank matrix is not low rank, so the bound "
                             "does not hold (use causal=False)")
        self._check_call(q, k, v, causal, mode, chunk_size)
        left, right, _ = self._factors(q, k)
        parts = linear_attention_from_features(left, torch.zeros_like(left[..., 0]), right,
                                               torch.zeros_like(right[..., 0]),
                                               v.to(torch.float64), mode="parallel")
        ct = compute_dtype(q.dtype)
        num = parts.numerator.to(ct)
        den = torch.ones(num.shape[:-1], dtype=ct, device=num.device)
        out = num.to(q.dtype)
        if return_parts:
            return AttentionParts(out, num, den, torch.zeros_like(den))
        return out


def output_error_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, *,
                       scale: float | None = None) -> torch.Tensor:
    r"""``‖PV − (PV)_r‖_F / ‖PV‖_F``: the smallest relative attention-output error of any non-causal method whose
    implied attention matrix has rank ≤ ``r`` (``P = softmax(s QKᵀ)``; ``(PV)_r`` the truncated SVD of the output).

    A rank-≤ r matrix ``P̂`` gives an output ``P̂V`` of rank ≤ r, and Eckart–Young bounds its distance to ``PV``.
    The floor is 0 once ``r ≥ rank(PV)`` (at most ``d_v``). Float64; ``(..., n_q, d)``, ``(..., n_k, d)``,
    ``(..., n_k, d_v)`` → ``(...)``.

    Examples
    --------
    >>> import torch
    >>> q, k, v = (torch.randn(10, 4, dtype=torch.float64) for _ in range(3))
    >>> float(output_error_floor(q, k, v, rank=4)) < 1e-12      # r ≥ d_v = 4: no floor
    True
    """
    check_qk(q, k)
    check_tensor(v, "v")
    r = check_positive_int(rank, "rank")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have one row per key, got {v.shape[-2]} rows for {k.shape[-2]} keys")
    s = resolve_scale(q.shape[-1], scale)
    attn = torch.softmax(s * (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2)), dim=-1)
    out = attn @ v.to(torch.float64)
    sigma = torch.linalg.svdvals(out)
    return sigma[..., r:].norm(dim=-1) / sigma.norm(dim=-1)


register("nystromformer", Nystromformer, pinv="iterative")
register("nystromformer_exact", Nystromformer, pinv="exact")
register("kernel_svd", KernelSVD)
register("attention_svd", AttentionSVD)
