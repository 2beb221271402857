"""Rotary position embeddings (RoPE), a positional hook for :class:`~kernapprox.nn.KernelAttention`."""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check_bool, check_positive_float, check_positive_int

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    r"""Rotary position embedding (Su et al. 2021, RoFormer, eq. 34): the pairs of coordinates of a query or key at
    position ``m`` are rotated by the angles ``m θ_i``,

    .. math::
        \begin{pmatrix} x'_{2i} \\ x'_{2i+1} \end{pmatrix} =
        \begin{pmatrix} \cos mθ_i & -\sin mθ_i \\ \sin mθ_i & \cos mθ_i \end{pmatrix}
        \begin{pmatrix} x_{2i} \\ x_{2i+1} \end{pmatrix},\qquad θ_i = \mathrm{base}^{-2i/d},\ i < d/2,

    so that ``⟨R_m q, R_n k⟩`` depends on ``m − n`` only (for exact attention; a feature map sees the rotated
    vectors, and its estimate of ``exp(s⟨R_m q, R_n k⟩)`` is the estimator's).

    Parameters
    ----------
    dim : int
        The rotated (per-head) dimension ``d``, even; the ``qk_dim`` of the layer.
    base : float, default=10000
    interleaved : bool, default=True
        Pairs ``(x_{2i}, x_{2i+1})`` as in the paper's eq. 34; ``False`` pairs ``(x_i, x_{i+d/2})`` (the "rotate
        half" layout of GPT-NeoX and Hugging Face's Llama, the same rotation on permuted coordinates).

    Called as the layer's ``pos_hook``: ``rotary(q, k, positions) -> (q, k)`` with ``q (B, H, n, d)``,
    ``k (B, H_kv, n, d)`` and ``positions (B, n)`` int64; the angles are computed in float32 (float64 for
    float64 inputs) and the results have the inputs' dtypes. No parameters, no buffers (nothing in
    ``state_dict``).

    >>> import torch
    >>> rope = RotaryEmbedding(8)
    >>> q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    >>> k = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    >>> pos = torch.arange(5)[None]
    >>> a = rope.rotate(q, pos) @ rope.rotate(k, pos).transpose(-1, -2)
    >>> b = rope.rotate(q, pos + 7) @ rope.rotate(k, pos + 7).transpose(-1, -2)   # every position shifted
    >>> bool(torch.allclose(a, b))
    True
    """

    def __init__(self, dim: int, base: float = 10000.0, *, interleaved: bool = True):
        super().__init__()
        self.dim = check_positive_int(dim, "dim")
        if dim % 2:
            raise ValueError(f"dim must be even (coordinates are rotated in pairs), got {dim}")
        self.base = check_positive_float(base, "base")
        self.interleaved = check_bool(interleaved, "interleaved")

    def frequencies(self, dtype=torch.float32, device=None) -> torch.Tensor:
        """``θ_i = base^{−2i/d}``, ``(d/2,)``."""
        i = torch.arange(0, self.dim, 2, dtype=torch.float64, device=device)
        return (self.base ** (-i / self.dim)).to(dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x (B, heads, n, d)`` rotated at ``positions`` (``(B, n)`` or ``(n,)``, integers)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be a (batch, heads, n, {self.dim}) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or \
                positions.dtype == torch.bool:
            raise TypeError("positions must be an integer torch.Tensor of shape (batch, n) or (n,)")
        if positions.dim() == 1:
            positions = positions[None]
        if positions.dim() != 2 or positions.shape[-1] != x.shape[-2] or positions.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"positions must have shape (batch, n) = {(x.shape[0], x.shape[-2])} or (n,), got "
                             f"{tuple(positions.shape)}")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        angles = positions.to(device=x.device, dtype=ct)[:, None, :, None] * self.frequencies(ct, x.device)
        cos, sin = torch.cos(angles), torch.sin(angles)                      # (B, 1, n, d/2)
        xc = x.to(ct)
        if self.interleaved:
            even, odd = xc[..., 0::2], xc[..., 1::2]
            out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
        else:
            first, second = xc[..., : self.dim // 2], xc[..., self.dim // 2:]
            out = torch.cat([first * cos - second * sin, first * sin + second * cos], -1)
        return out.to(x.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """``(q, k)`` rotated at ``positions`` (the layer's ``pos_hook`` signature)."""
        return self.rotate(q, positions), self.rotate(k, positions)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}"
