"""Learned feature maps distilled from softmax attention: Hedgehog.

Random features are the untrained end of an axis whose other end is a map trained to reproduce softmax attention
weights. Hedgehog (Zhang, Bhatia, Kumbong & Ré, ICLR 2024) trains, per head, an exponential map
``φ(x) = [exp(Wx + b), exp(−Wx − b)]`` by the cross-entropy between the softmax attention weights and the
linear-attention weights that ``φ`` induces. :class:`HedgehogFeatures` is that map with two changes, both
justified in its docstring: a fixed Gaussian factor ``exp(−‖x‖²/2)`` and an initialisation at hyperbolic positive
random features, so that zero training steps is exactly the unbiased random-feature estimator and training moves
along the axis from there.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from ..validation import check_bool, check_positive_float, check_positive_int
from .base import FeatureMap
from .registry import register
from .samplers import make_sampler

__all__ = ["HedgehogFeatures"]


class HedgehogFeatures(FeatureMap):
    r"""Hedgehog: an exponential feature map per head, trained to reproduce softmax attention weights.

    In scaled coordinates ``x = sqrt(s)·q`` (queries) and ``y = sqrt(s)·k`` (keys), with ``r = 2m`` features,

    .. math::
        φ_ρ(x) = \frac{e^{-\|x\|^2/2}}{\sqrt{2m}}\Big[\exp(W_ρ x + b_ρ),\ \exp(-W_ρ x - b_ρ)\Big],
        \qquad W_ρ ∈ \mathbb R^{m×d},\ b_ρ ∈ \mathbb R^m,\ ρ ∈ \{\text{query}, \text{key}\},

    trained (:meth:`fit`) to minimise the attention-weight distillation loss of Zhang et al. (2024, §4): the
    cross-entropy between softmax attention weights and the linear-attention weights the map induces,

    .. math::
        \mathcal L = -\frac{1}{N}\sum_{\text{rows } i} \sum_j P_{ij} \log \hat A_{ij},\qquad
        P_{ij} = \frac{e^{x_i^⊤y_j}}{\sum_{j'} e^{x_i^⊤y_{j'}}},\quad
        \hat A_{ij} = \frac{φ_q(x_i)^⊤φ_k(y_j)}{\sum_{j'} φ_q(x_i)^⊤φ_k(y_{j'})},

    over the rows of the training sequences (each batch element of ``fit(q, k)`` is one sequence; its rows attend
    to all of its keys, non-causally), by ``num_steps`` full-batch Adam steps with a fixed ``learning_rate``, in
    float64 on the CPU (deterministic given ``rng`` and ``num_steps``; the same on every device).

    Departures from the paper, and why:

    * **Gaussian factor** ``e^{−‖x‖²/2}``: the paper's map is ``[exp(Wx+b), exp(−Wx−b)]``; the factor makes
      ``φ_q(x)^⊤φ_k(y) = e^{−(‖x‖²+‖y‖²)/2} (2m)^{-1} Σ_l (e^{w_l^⊤(x+y)+2b_l} + e^{−w_l^⊤(x+y)−2b_l})`` (tied
      case) an estimator of ``e^{x^⊤y} = e^{−(‖x‖²+‖y‖²)/2} e^{‖x+y‖²/2}``: the learned part only has to
      represent ``e^{‖x+y‖²/2}`` on the data. On queries it cancels in the attention ratio; on keys it is the
      key-norm dependence a frozen model's softmax has (the paper's maps are fine-tuned together with the
      model, ours are fitted post hoc to a frozen one).
    * **Initialisation** ``W = Ω`` (rows from ``sampler``), ``b = 0``: at ``num_steps = 0`` the map is exactly
      :class:`~kernapprox.estimators.HyperbolicFeatures` with the same draw — unbiased, positive random features
      (Performer's hyperbolic variant, Choromanski et al. 2021, Lemma 1). The reference implementations
      initialise ``W = I`` with ``m = d``; an ``m × d`` random draw gives any ``r`` and makes the random map the
      untrained end of the same axis.
    * **Tied or per-role maps**: ``tied=True`` (default) uses one ``(W, b)`` for queries and keys, the notes'
      single map per head; ``tied=False`` trains a map per role (as in reference code that distils separate
      query and key maps), twice the parameters.

    **Positive** (every feature is a positive exponential), **biased** once trained, **data dependent**, not
    consistent in ``r`` (training fits a finite family), not causal as a whole-sequence fit (it is meant to be
    trained on other sequences and then applied: its weights are then parameters, not context —
    ``context_state`` is empty and :meth:`parameter_bytes` counts them). Features usable in every mode and rule;
    stabilised like the other exponential maps: ``φ̃ = exp(a − max a)``, ``ℓ = max a − ‖x‖²/2 − ½ log 2m`` with
    ``a = [Wx+b, −Wx−b]``.

    Parameters
    ----------
    num_features : int
        ``r = 2m`` (even).
    num_steps : int, default 50
        Adam steps (0: the untrained random map).
    learning_rate : float, default 0.05
    tied : bool, default True
        One map for queries and keys (``True``) or one per role.
    sampler : str or ProjectionSampler, default "orthogonal"
        Where the initial ``W`` comes from (see :mod:`kernapprox.estimators.samplers`).
    rng : int, SeedSequence or Generator
        The initial draw (the only randomness).
    scale : float, optional
        Kernel scale ``s`` (default ``1/sqrt(d)``).

    Attributes
    ----------
    query_weight_, key_weight_ : ndarray (m, d)
        ``W_q``, ``W_k`` (equal when tied).
    query_bias_, key_bias_ : ndarray (m,)
    initial_loss_, loss_ : float
        The distillation loss on the training data before and after training.
    log_normalizer_ : float
        ``−½ log(2m)``.

    References
    ----------
    Zhang, Bhatia, Kumbong & Ré, *The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax
    Mimicry*, ICLR 2024 (arXiv 2402.04347), §4: the exponential map and the attention-weight distillation loss
    (cross-entropy between softmax and linear-attention weights).
    Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021, Lemma 1 (hyperbolic positive features).

    Examples
    --------
    >>> import torch
    >>> from kernapprox.estimators import make_estimator
    >>> gen = torch.Generator().manual_seed(0)
    >>> q, k = torch.randn(4, 32, 16, generator=gen, dtype=torch.float64), torch.randn(4, 32, 16, generator=gen,
    ...                                                                                 dtype=torch.float64)
    >>> est = make_estimator("hedgehog", num_features=32, rng=0, num_steps=30).fit(q, k)
    >>> est.loss_ < est.initial_loss_
    True
    >>> est.features(q, "key").shape
    torch.Size([4, 32, 32])
    """

    kind: ClassVar[str] = "features"
    unbiased = False
    positive = True
    data_dependent = True
    causal_fit = False
    consistent = False
    reference = ("Zhang et al. 2024 (Hedgehog, ICLR, arXiv 2402.04347), §4: exp map and attention-weight distillation; "
                 "initialised at hyperbolic positive random features (Choromanski et al. 2021, Lemma 1)")

    def __init__(self, *, num_features: int, num_steps: int = 50, learning_rate: float = 0.05, tied: bool = True,
                 sampler="orthogonal", rng=None, scale: float | None = None):
        check_positive_int(num_features, "num_features")
        if num_features % 2:
            raise ValueError(f"num_features must be even (features come in ± pairs), got {num_features}")
        super().__init__(num_features=num_features, rng=rng, scale=scale)
        if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
        self.num_steps = int(num_steps)
        self.learning_rate = check_positive_float(learning_rate, "learning_rate")
        self.tied = check_bool(tied, "tied")
        self.sampler = sampler
        self._sampler = make_sampler(sampler)

    # ------------------------------------------------------------------------------------------------ fitting
    def _fit(self, q, k, rng):
        x, y = self._training_pairs(q, k)
        m = self.num_features // 2
        omega = self._sampler.sample(m, self.dim_, rng)                                   # (m, d) float64
        self.log_normalizer_ = -0.5 * math.log(2 * m)
        params = {"query_weight": torch.from_numpy(omega.copy()), "query_bias": torch.zeros(m, dtype=torch.float64)}
        if not self.tied:
            params |= {"key_weight": torch.from_numpy(omega.copy()), "key_bias": torch.zeros(m, dtype=torch.float64)}
        for p in params.values():
            p.requires_grad_(True)
        targets = torch.softmax(x @ y.transpose(-1, -2), -1)                              # (B, n_q, n_k)
        key_half_sq = 0.5 * (y * y).sum(-1)                                               # (B, n_k)
        with torch.enable_grad():
            self.initial_loss_ = float(_distillation_loss(params, x, y, targets, key_half_sq, self.tied).detach())
            optimizer = torch.optim.Adam(list(params.values()), lr=self.learning_rate)
            for step in range(self.num_steps):
                optimizer.zero_grad()
                loss = _distillation_loss(params, x, y, targets, key_half_sq, self.tied)
                if not math.isfinite(float(loss.detach())):
                    raise ValueError(f"Hedgehog training diverged at step {step} (loss {float(loss.detach())}): lower "
                                     "learning_rate or the scale of q and k")
                loss.backward()
                optimizer.step()
            self.loss_ = float(_distillation_loss(params, x, y, targets, key_half_sq, self.tied).detach())
        if not math.isfinite(self.loss_):
            raise ValueError(f"Hedgehog training ended with a non-finite loss ({self.loss_}): lower learning_rate")
        weights = {name: p.detach().numpy().copy() for name, p in params.items()}
        self.query_weight_, self.query_bias_ = weights["query_weight"], weights["query_bias"]
        self.key_weight_ = weights.get("key_weight", self.query_weight_).copy()
        self.key_bias_ = weights.get("key_bias", self.query_bias_).copy()

    def _training_pairs(self, q, k):
        """Scaled float64 CPU copies ``x (B, n_q, d)``, ``y (B, n_k, d)`` (``k`` None: ``y = x``)."""
        root = math.sqrt(self.scale_)
        x = q.detach().to("cpu", torch.float64) * root
        if k is None:
            y = x
        else:
            if q.shape[:-2] != k.shape[:-2]:
                raise ValueError(f"HedgehogFeatures trains on sequences: q and k must share batch dimensions, got "
                                 f"{tuple(q.shape[:-2])} and {tuple(k.shape[:-2])}")
            y = k.detach().to("cpu", torch.float64) * root
        d = x.shape[-1]
        return x.reshape(-1, x.shape[-2], d), y.reshape(-1, y.shape[-2], d)

    def distillation_loss(self, q: torch.Tensor, k: torch.Tensor | None = None) -> float:
        """The loss ``L`` of the fitted map on the sequences ``(q, k)`` (float64; see the class docstring)."""
        self._check_fitted()
        x, y = self._training_pairs(q, k)
        params = {name: torch.from_numpy(getattr(self, f"{name}_")) for name in
                  ("query_weight", "query_bias", "key_weight", "key_bias")}
        targets = torch.softmax(x @ y.transpose(-1, -2), -1)
        return float(_distillation_loss(params, x, y, targets, 0.5 * (y * y).sum(-1), tied=False))

    # ----------------------------------------------------------------------------------------------- features
    def _log_features(self, x, role):
        weight = self._param(f"{role}_weight_", x)
        bias = self._param(f"{role}_bias_", x)
        u = x @ weight.T + bias
        a = torch.cat([u, -u], -1)
        shift = a.amax(-1, keepdim=True)
        phi = torch.exp(a - shift)
        logs = shift.squeeze(-1) - 0.5 * (x * x).sum(-1) + self.log_normalizer_
        return phi, logs


def _distillation_loss(params, x, y, targets, key_half_sq, tied):
    """``−mean_rows Σ_j P_ij log Â_ij`` from stabilised log-features (query shifts cancel in ``Â``)."""
    wq, bq = params["query_weight"], params["query_bias"]
    wk, bk = (wq, bq) if tied else (params["key_weight"], params["key_bias"])
    uq, uk = x @ wq.T + bq, y @ wk.T + bk
    aq, ak = torch.cat([uq, -uq], -1), torch.cat([uk, -uk], -1)
    aq = aq - aq.amax(-1, keepdim=True).detach()
    key_max = ak.amax(-1, keepdim=True).detach()
    gram = torch.exp(aq) @ torch.exp(ak - key_max).transpose(-1, -2)                  # (B, n_q, n_k), entries > 0
    log_kernel = torch.log(gram) + (key_max.squeeze(-1) - key_half_sq)[..., None, :]
    log_weights = log_kernel - torch.logsumexp(log_kernel, -1, keepdim=True)
    return -(targets * log_weights).sum(-1).mean()


register("hedgehog", HedgehogFeatures)
