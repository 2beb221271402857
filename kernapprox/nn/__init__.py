"""``torch.nn`` attention with the softmax kernel replaced by any registry estimator.

:class:`KernelAttention` (:mod:`kernapprox.nn.layer`)
    Multi-head attention with its own projections (grouped-query heads, a positional hook, dropout, masks in every
    mode, prefill and token-by-token decoding, ``state_dict`` round trips), with a registry estimator or a
    trainable map (``"hedgehog_trainable"``, ``"t2r_trainable"``; :class:`MapState` its decoding state).
:func:`kernapprox.nn.functional.kernel_attention`
    The functional core on given heads ``(B, H, n, d)`` after the caller's projections and positions, in the
    conventions of SDPA and fla.
:class:`RotaryEmbedding` (:mod:`kernapprox.nn.rotary`)
    Rotary positions (RoFormer, eq. 34), a ``pos_hook`` for the layer.
"""

from . import functional
from .layer import KernelAttention, MapState
from .rotary import RotaryEmbedding

__all__ = ["KernelAttention", "MapState", "RotaryEmbedding", "functional"]
