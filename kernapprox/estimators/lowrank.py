"""Low-rank attention that is not a feature map: Nyströmformer and the optimal rank-r floor.

Both need the whole sequence (no recurrent state) and run in the parallel mode only. Nyströmformer is the
segment-means Nyström form of Xiong et al. (2021); :class:`OptimalLowRank` is the Eckart–Young best rank-r
approximation of the exact kernel matrix, the floor no rank-r method can beat in Frobenius norm.
"""

from __future__ import annotations

import math

import torch

from ..validation import check_choice, check_positive_int, check_qk, check_tensor, compute_dtype
from .base import AttentionEstimator, AttentionParts
from .registry import register

PINV_METHODS = ("iterative", "exact")
PINV_INITS = ("original", "per_matrix")


# ------------------------------------------------------------------------------------------------ helpers
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
    causal_fit = False
    causal = False
    rank_limited_by_points = True
    modes = ("parallel",)
    reference = "Xiong et al. 2021 (Nyströmformer, AAAI), segment-means landmarks, eq. (15); Razavi et al. 2014"

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


# ----------------------------------------------------------------------------------- the rank-r floor
class OptimalLowRank(AttentionEstimator):
    r"""The best rank-r approximation of the exact kernel matrix (Eckart–Young): the floor for rank-r methods.

    .. math::
        K = e^{s Q K^⊤} = U Σ V^⊤,\qquad K_r = U_{:r} Σ_{:r} V_{:r}^⊤,\qquad
        \|K − K_r\|_F = \Big(\sum_{i>r} σ_i^2\Big)^{1/2}

    computed by a float64 SVD after factoring out ``c = max_ij s q_iᵀk_j`` (``K = e^c K'``; the SVD of ``K'``
    scales). No map of ``r`` features has ``φ(Q)φ(K)ᵀ`` closer to ``K`` in Frobenius (or spectral) norm, so the
    error of this "estimator" is the floor of every rank-r method on the same matrix. It is an oracle, not an
    algorithm: it needs the exact ``n_q × n_k`` matrix and an O(n³) SVD (``max_size`` guards against large n),
    has no recurrent state, and is **biased**, **signed** and **data-dependent**.

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
    Eckart & Young, *The approximation of one matrix by another of lower rank*, Psychometrika 1 (1936).
    """

    unbiased = False
    positive = False
    data_dependent = True
    causal_fit = False
    consistent = True
    rank_limited_by_points = True
    modes = ("parallel",)
    reference = "Eckart & Young 1936 (best rank-r approximation by truncated SVD)"

    def __init__(self, *, num_features: int, max_size: int = 4096, rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        self.max_size = check_positive_int(max_size, "max_size")

    def _svd(self, q, k):
        self._check_dim(q)
        if max(q.shape[-2], k.shape[-2]) > self.max_size:
            raise ValueError(f"sequence length {max(q.shape[-2], k.shape[-2])} exceeds max_size={self.max_size} "
                             "(the optimal rank-r floor needs a dense SVD)")
        logits = self.scale_ * (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2))
        shift = logits.amax(dim=(-1, -2), keepdim=True)
        u, sigma, vh = torch.linalg.svd(torch.exp(logits - shift), full_matrices=False)
        return u, sigma, vh, shift

    def _truncated(self, q, k):
        u, sigma, vh, shift = self._svd(q, k)
        r = self.num_features
        return (u[..., :r] * sigma[..., None, :r]) @ vh[..., :r, :], shift

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
        return (approx * torch.exp(shift)).to(q.dtype)

    def attention(self, q, k, v, *, causal=False, mode="parallel", chunk_size=64, return_parts=False):
        """``K_r V / K_r 1`` (lower-triangular ``K_r`` if causal). ``chunk_size`` is accepted and unused."""
        self._check_call(q, k, v, causal, mode, chunk_size)
        approx, shift = self._truncated(q, k)
        if causal:
            approx = approx.tril()
        ct = compute_dtype(q.dtype)
        num = (approx @ v.to(torch.float64)).to(ct)
        den = approx.sum(-1).to(ct)
        out = (num / den[..., None]).to(q.dtype)
        if return_parts:
            log_scale = shift[..., 0].expand(den.shape).to(ct)
            return AttentionParts(out, num, den, log_scale)
        return out


register("nystromformer", Nystromformer, pinv="iterative")
register("nystromformer_exact", Nystromformer, pinv="exact")
register("lowrank_optimal", OptimalLowRank)
