"""The attention estimators: approximations of softmax attention that bring their own attention and compose it
from the linear-attention core (:mod:`kernapprox.attention`).

=====================  ===============================================================================
module                 estimators
=====================  ===============================================================================
``hybrid``             sliding window + linear attention (:class:`WindowLinear`), :class:`Scatterbrain`
``lara``               LARA: multiple importance sampling of attention with data-dependent proposals
``eva``                EVA: exact local attention plus per-group control variates
``lowrank``            Nyströmformer and the rank-r SVD references (kernel matrix, attention matrix)
=====================  ===============================================================================

They sit above the core: a feature map (:mod:`kernapprox.estimators`) knows nothing of attention, the core
(:mod:`kernapprox.attention`) runs linear attention on given features under every rule, mode, mask, initial state
and stabiliser, and these estimators declare ``kind = "attention"`` and call the core for the part of their
computation that is linear attention (see each class's docstring). Importing this package (``import kernapprox``
does) registers their names in :mod:`kernapprox.estimators.registry`, so ``make_estimator("window_linear", ...)``
and the other names work as before.

Each class declares how it uses the core in ``core``: the names of the :mod:`kernapprox.attention` functions its
attention is composed from (empty where its computation is no linear attention: Nyströmformer's ``F A⁺ (B V)``).
"""

# Every module registers its estimators when imported.
from . import eva, hybrid, lara, lowrank  # noqa: F401
from .eva import EfficientAttentionCV
from .hybrid import Scatterbrain, WindowLinear
from .lara import LinearRandomizedAttention
from .lowrank import AttentionSVD, KernelSVD, Nystromformer, output_error_floor

__all__ = ["WindowLinear", "Scatterbrain", "LinearRandomizedAttention", "EfficientAttentionCV", "Nystromformer",
           "KernelSVD", "AttentionSVD", "output_error_floor"]
