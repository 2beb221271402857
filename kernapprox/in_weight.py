"""In-weight learners to set beside the in-context read-out: kernel ridge regression, the empirical neural tangent
kernel of a two-layer network, and full-batch gradient descent on that network and on its linearisation.

The in-context read-out (:mod:`kernapprox.readout`) predicts from kernel similarity to the context without changing
any weight: ``ŷ(q) = Σ_i κ(q, k_i) v_i / Σ_i κ(q, k_i)``, the Nadaraya–Watson smoother (Nadaraya 1964, Theory
Probab. Appl. 9:141; Watson 1964, Sankhyā A 26:359) with ``κ = exp(β qᵀk)``; Han et al. 2023 (*Explaining Emergent
In-Context Learning as Kernel Regression*) read in-context learning this way. The learners here *fit* the same
examples instead, and each of them also predicts from kernel similarity to them:

* :func:`kernel_ridge`: ``ŷ(x) = κ(x, X) (K + λ̄ I)⁻¹ Y``, the same kernel, coefficients solved for instead of the
  labels used as they are (Schölkopf & Smola 2002, *Learning with Kernels*, §4.2);
* :func:`two_layer_ntk`: the empirical neural tangent kernel ``Θ(x, x') = J(x) J(x')ᵀ`` of a two-layer network at
  its initialisation (Jacot, Gabriel & Hongler 2018, *Neural Tangent Kernel*, NeurIPS, eq. of §4), ``J`` the
  Jacobian of the output in the parameters; :func:`empirical_ntk` computes it for any function with
  :mod:`torch.func`;
* :func:`gradient_descent`: full-batch gradient descent on the network itself, and
  :func:`linearised_gradient_descent`, the same steps on its first-order Taylor expansion around the
  initialisation, which move the function by ``Δf(x) = −(η/n) Σ_i Θ(x, x_i) ∂ℓ/∂f(x_i)`` (Lee et al. 2019, *Wide
  Neural Networks of Any Depth Evolve as Linear Models Under Gradient Descent*, NeurIPS, eqs. 5–9, in discrete
  time): the weight learning that the kernel describes exactly.

The network
-----------
:class:`TwoLayerNetwork`, in the NTK parametrisation of Jacot et al.: ``g(x) = Aᵀ relu(Wᵀx + b) / sqrt(m)`` with
``W (d, m)``, ``b (m,)``, ``A (m, C)`` all drawn N(0, 1) (:func:`init_two_layer`; unit-norm inputs give pre-
activations of variance ``‖x‖² + 1``). Its tangent kernel is, for output ``c``,

.. math::
    Θ_c(x, x') = \\frac{1}{m} \\sum_j \\Big[ σ(h_j) σ(h'_j) + A_{jc}^2\\, σ'(h_j) σ'(h'_j)\\, (xᵀx' + 1) \\Big],
    \\qquad h = Wᵀx + b,\\ σ = \\mathrm{relu},

(the three terms: the gradients in ``A``, in ``W`` and in ``b``). With ``C > 1`` outputs :func:`two_layer_ntk`
returns the mean over the outputs (``A_{jc}²`` replaced by its mean over ``c``), the trace NTK: the cross-output
entries of ``J_c J_{c'}ᵀ`` vanish in expectation over the initialisation and at infinite width, so the
multi-output kernel is taken as ``Θ̄ ⊗ I_C`` (Jacot et al. 2018, Theorem 1).

Gradient descent trains the *centred* network ``f(x) = g(x; θ) − g(x; θ₀)``, which starts at ``f = 0`` and has
the same Jacobian as ``g``: its linearisation is kernel regression with ``Θ`` started from zero, without the
random initial function (Chizat, Oyallon & Bach 2019, *On Lazy Training*, §2.2). Its memory is both parameter
vectors, ``θ`` and ``θ₀``.

Everything that solves or compares is computed in float64.

Examples
--------
Kernel ridge with the NTK of a network, and the same network trained by gradient descent, on 16 examples:

>>> import numpy as np, torch
>>> from kernapprox import in_weight
>>> x = torch.as_tensor(np.random.default_rng(0).standard_normal((1, 16, 4)))
>>> x = x / x.norm(dim=-1, keepdim=True)                              # unit-norm inputs
>>> y = torch.sin(3 * x[..., :1])
>>> net = in_weight.init_two_layer(4, 256, 1, rng=0)                  # one network (batch 1), 256 hidden units
>>> theta = in_weight.two_layer_ntk(net, x, x)                        # (1, 16, 16)
>>> fit = in_weight.kernel_ridge(theta, theta, y, ridge=1e-6)         # predictions at the examples
>>> bool(torch.allclose(fit, y, atol=1e-3))
True
>>> trained = in_weight.gradient_descent(net, x, y, loss="mse", steps=100, lr=in_weight.ntk_step_size(theta))
>>> in_weight.centred_forward(trained, net, x).shape
torch.Size([1, 16, 1])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .validation import as_generator, check_choice, check_positive_float, check_positive_int, check_tensor

__all__ = ["TwoLayerNetwork", "LOSSES", "init_two_layer", "two_layer_forward", "centred_forward", "two_layer_ntk",
           "empirical_ntk", "kernel_ridge", "ntk_step_size", "gradient_descent", "linearised_gradient_descent"]

LOSSES = ("mse", "cross_entropy")


class TwoLayerNetwork(NamedTuple):
    """The parameters of a batch of two-layer networks ``g(x) = Aᵀ relu(Wᵀx + b) / sqrt(m)``, one per episode:
    ``weight W (B, d, m)``, ``bias b (B, m)``, ``readout A (B, m, C)``."""

    weight: torch.Tensor
    bias: torch.Tensor
    readout: torch.Tensor

    @property
    def width(self) -> int:
        """The hidden width ``m``."""
        return int(self.weight.shape[-1])

    @property
    def num_parameters(self) -> int:
        """Parameters of one network: ``d·m + m + m·C``."""
        return int(self.weight[0].numel() + self.bias[0].numel() + self.readout[0].numel())


def init_two_layer(dim: int, width: int, outputs: int, *, batch: int = 1, rng=None,
                   dtype: torch.dtype = torch.float64, device=None) -> TwoLayerNetwork:
    """``batch`` independent networks at initialisation, every parameter N(0, 1) (the NTK parametrisation: the
    ``1/sqrt(m)`` is in the forward pass), drawn with numpy in float64 from ``rng`` and then cast, so that a seed
    is one draw in every dtype and on every device."""
    d, m, c, b = (check_positive_int(v, name) for v, name in ((dim, "dim"), (width, "width"),
                                                                (outputs, "outputs"), (batch, "batch")))
    gen = as_generator(rng)
    draws = (gen.standard_normal((b, d, m)), gen.standard_normal((b, m)), gen.standard_normal((b, m, c)))
    return TwoLayerNetwork(*(torch.as_tensor(a, dtype=dtype, device=device) for a in draws))


def _check_inputs(net: TwoLayerNetwork, x: torch.Tensor, name: str) -> None:
    if not isinstance(net, TwoLayerNetwork):
        raise TypeError(f"net must be a TwoLayerNetwork, got {type(net).__name__}")
    check_tensor(x, name, min_rank=3)
    if x.dim() != 3 or x.shape[0] != net.weight.shape[0] or x.shape[-1] != net.weight.shape[1]:
        raise ValueError(f"{name} must have shape (B, n, d) = ({net.weight.shape[0]}, n, {net.weight.shape[1]}) for "
                         f"these networks, got {tuple(x.shape)}")


def _hidden(net: TwoLayerNetwork, x: torch.Tensor) -> torch.Tensor:
    """Pre-activations ``h = Wᵀx + b``: ``(B, n, m)``."""
    return torch.baddbmm(net.bias[:, None, :], x.to(net.weight.dtype), net.weight)


def two_layer_forward(net: TwoLayerNetwork, x: torch.Tensor) -> torch.Tensor:
    """``g(x) = Aᵀ relu(Wᵀx + b) / sqrt(m)`` of each episode's network: ``x (B, n, d)`` → ``(B, n, C)``."""
    _check_inputs(net, x, "x")
    return torch.relu(_hidden(net, x)) @ net.readout / math.sqrt(net.width)


def centred_forward(trained: TwoLayerNetwork, initial: TwoLayerNetwork, x: torch.Tensor) -> torch.Tensor:
    """The centred network ``f(x) = g(x; θ) − g(x; θ₀)`` that :func:`gradient_descent` trains (zero at
    initialisation): ``(B, n, C)``."""
    return two_layer_forward(trained, x) - two_layer_forward(initial, x)


def two_layer_ntk(net: TwoLayerNetwork, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The empirical NTK of each episode's network (mean over its outputs; the formula in the module notes), in
    float64: ``x1 (B, n1, d)``, ``x2 (B, n2, d)`` → ``(B, n1, n2)``. Equal to :func:`empirical_ntk` of
    :func:`two_layer_forward` (tested), at ``O(n1 n2 m)`` instead of materialising the Jacobians."""
    _check_inputs(net, x1, "x1")
    _check_inputs(net, x2, "x2")
    net = TwoLayerNetwork(*(p.double() for p in net))
    x1, x2 = x1.double(), x2.double()
    h1, h2 = _hidden(net, x1), _hidden(net, x2)
    a2 = net.readout.pow(2).mean(-1)                                            # (B, m): mean_c A_jc²
    readout_part = torch.relu(h1) @ torch.relu(h2).transpose(-1, -2)
    hidden_part = ((h1 > 0).double() * a2[:, None, :]) @ (h2 > 0).double().transpose(-1, -2)
    return (readout_part + hidden_part * (x1 @ x2.transpose(-1, -2) + 1.0)) / net.width


def empirical_ntk(fn: Callable, params: dict, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The empirical NTK ``Θ(x, x') = (1/C) Σ_c Σ_p ∂f_c(x)/∂θ_p ∂f_c(x')/∂θ_p`` of any differentiable
    ``fn(params, x) -> (n, C)`` (Jacot et al. 2018), from its Jacobians (:func:`torch.func.jacrev`): ``x1 (n1, d)``,
    ``x2 (n2, d)`` → ``(n1, n2)``, in the inputs' dtype (use float64). Materialises ``n·C·P`` numbers: for small
    models and as the oracle of closed forms such as :func:`two_layer_ntk`."""
    if not isinstance(params, dict) or not params:
        raise TypeError("params must be a non-empty dict name -> tensor (the arguments fn differentiates in)")
    check_tensor(x1, "x1", min_rank=2)
    check_tensor(x2, "x2", min_rank=2)
    j1, j2 = (torch.func.jacrev(fn)(params, x) for x in (x1, x2))               # name -> (n, C, *shape)
    outputs = next(iter(j1.values())).shape[1]
    total = sum(torch.einsum("acp,bcp->ab", j1[k].flatten(2), j2[k].flatten(2)) for k in params)
    return total / outputs


def kernel_ridge(gram: torch.Tensor, cross: torch.Tensor, targets: torch.Tensor, *, ridge: float) -> torch.Tensor:
    """Kernel ridge regression: ``ŷ = K_qX (K_XX + λ̄ I)⁻¹ Y`` with ``λ̄ = ridge · tr(K_XX)/n``, a regulariser
    relative to the kernel's mean diagonal (so that it does not depend on the kernel's scale), in float64 by a
    Cholesky factorisation.

    ``gram (B, n, n)`` symmetric positive semi-definite, ``cross (B, n_q, n)``, ``targets (B, n, C)`` →
    ``(B, n_q, C)``. ``ridge → 0`` interpolates the targets where ``K_XX`` is invertible. ``ValueError`` if
    ``K_XX + λ̄ I`` is not positive definite in float64 (raise ``ridge``; nothing is repaired silently).
    """
    lam = check_positive_float(ridge, "ridge")
    for name, t in (("gram", gram), ("cross", cross), ("targets", targets)):
        check_tensor(t, name, min_rank=3)
    n = gram.shape[-1]
    if gram.shape[-2] != n or cross.shape[-1] != n or targets.shape[-2] != n or \
            not gram.shape[:-2] == cross.shape[:-2] == targets.shape[:-2]:
        raise ValueError(f"gram (B, n, n), cross (B, n_q, n) and targets (B, n, C) must agree; got "
                         f"{tuple(gram.shape)}, {tuple(cross.shape)}, {tuple(targets.shape)}")
    k = gram.double()
    scale = torch.diagonal(k, dim1=-2, dim2=-1).mean(-1)                        # tr(K)/n per episode
    eye = torch.eye(n, dtype=torch.float64, device=k.device)
    chol, info = torch.linalg.cholesky_ex(k + lam * scale[..., None, None] * eye)
    if bool((info != 0).any()):
        raise ValueError(f"K + ridge·tr(K)/n·I is not positive definite in float64 at ridge = {lam:g}: raise ridge")
    coef = torch.cholesky_solve(targets.double(), chol)
    return cross.double() @ coef


def ntk_step_size(gram: torch.Tensor) -> torch.Tensor:
    """The step size ``η = n / λ_max(Θ_XX)`` per episode: one gradient step on the mean loss then moves the
    linearised function by ``−(η/n) Θ g``, whose largest eigenvalue is 1, inside the stable range ``< 2`` of the
    squared loss (Lee et al. 2019, §2.3). ``gram (B, n, n)`` → ``(B,)`` float64."""
    check_tensor(gram, "gram", min_rank=3)
    top = torch.linalg.eigvalsh(gram.double())[..., -1]
    if bool((top <= 0).any()):
        raise ValueError("gram must have a positive largest eigenvalue (a positive semi-definite kernel matrix)")
    return gram.shape[-1] / top


def _loss_gradient(loss: str, f: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``∂ℓ/∂f`` per example: ``f − y`` (``ℓ = ½‖f − y‖²``) or ``softmax(f) − y`` (cross-entropy on one-hot or
    probability targets)."""
    return f - targets if loss == "mse" else torch.softmax(f, dim=-1) - targets


def _loss(loss: str, f: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean loss per episode: ``(B,)``."""
    if loss == "mse":
        return 0.5 * (f - targets).pow(2).sum(-1).mean(-1)
    return -(targets * torch.log_softmax(f, dim=-1)).sum(-1).mean(-1)


def _check_lr(lr, batch: int) -> torch.Tensor:
    if isinstance(lr, torch.Tensor):
        if lr.shape != (batch,) or not bool((lr > 0).all()) or not bool(torch.isfinite(lr).all()):
            raise ValueError(f"lr must be a positive finite number or a tensor of {batch} of them (one per episode)")
        return lr.double()
    return torch.full((batch,), check_positive_float(lr, "lr"), dtype=torch.float64)


def gradient_descent(net: TwoLayerNetwork, x: torch.Tensor, targets: torch.Tensor, *, loss: str, steps: int,
                     lr) -> TwoLayerNetwork:
    """``steps`` full-batch gradient steps ``θ ← θ − η ∇_θ L(θ)`` on the mean loss ``L`` of each episode's centred
    network ``f = g(·; θ) − g(·; θ₀)`` (:func:`centred_forward`; ``θ₀ = net``), every episode trained on its own
    examples (the episodes' losses are summed, so their gradients do not mix).

    ``x (B, n, d)``, ``targets (B, n, C)`` (``loss="cross_entropy"``: one-hot rows), ``lr`` a number or one per
    episode (e.g. :func:`ntk_step_size`). Runs in the network's dtype; returns the trained parameters."""
    _check_inputs(net, x, "x")
    check_choice(loss, "loss", LOSSES)
    steps = check_positive_int(steps, "steps")
    check_tensor(targets, "targets", min_rank=3)
    if targets.shape[:2] != x.shape[:2] or targets.shape[-1] != net.readout.shape[-1]:
        raise ValueError(f"targets must have shape (B, n, C) = {(*x.shape[:2], net.readout.shape[-1])}, got "
                         f"{tuple(targets.shape)}")
    dtype = net.weight.dtype
    eta = _check_lr(lr, x.shape[0]).to(dtype)
    x, y = x.to(dtype), targets.to(dtype)
    with torch.no_grad():
        initial = two_layer_forward(net, x)
    params = [p.detach().clone().requires_grad_(True) for p in net]
    shapes = [(-1,) + (1,) * (p.dim() - 1) for p in params]
    for _ in range(steps):
        f = two_layer_forward(TwoLayerNetwork(*params), x) - initial
        grads = torch.autograd.grad(_loss(loss, f, y).sum(), params)
        with torch.no_grad():
            for p, g, shape in zip(params, grads, shapes):
                p.sub_(eta.view(shape) * g)
    return TwoLayerNetwork(*(p.detach() for p in params))


def linearised_gradient_descent(gram: torch.Tensor, cross: torch.Tensor, targets: torch.Tensor, *, loss: str,
                                steps: int, lr) -> torch.Tensor:
    """What :func:`gradient_descent` gives on the linearised network: the function-space iteration
    ``f ← f − (η/n) Θ ∂ℓ/∂f`` from ``f = 0``, on the training points (``gram = Θ_XX``, ``(B, n, n)``) and carried
    to the queries (``cross = Θ_qX``, ``(B, n_q, n)``), in float64 (Lee et al. 2019, eqs. 8–9 in discrete time).
    For the squared loss it is the spectral filter ``Θ_qX Θ_XX⁻¹ [I − (I − ηΘ_XX/n)^T] Y`` of early-stopped
    kernel regression. Returns the queries' outputs ``(B, n_q, C)``."""
    check_choice(loss, "loss", LOSSES)
    steps = check_positive_int(steps, "steps")
    for name, t in (("gram", gram), ("cross", cross), ("targets", targets)):
        check_tensor(t, name, min_rank=3)
    n = gram.shape[-1]
    if gram.shape[-2] != n or cross.shape[-1] != n or targets.shape[-2] != n:
        raise ValueError(f"gram (B, n, n), cross (B, n_q, n) and targets (B, n, C) must agree; got "
                         f"{tuple(gram.shape)}, {tuple(cross.shape)}, {tuple(targets.shape)}")
    step = (_check_lr(lr, gram.shape[0]) / n)[:, None, None]
    k, kq, y = gram.double(), cross.double(), targets.double()
    f = torch.zeros_like(y)
    out = torch.zeros(kq.shape[:-1] + (y.shape[-1],), dtype=torch.float64, device=y.device)
    for _ in range(steps):
        g = _loss_gradient(loss, f, y)
        f = f - step * (k @ g)
        out = out - step * (kq @ g)
    return out

