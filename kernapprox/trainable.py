"""Trainable, per-head feature maps: ``torch.nn`` modules whose parameters a model's optimiser trains end to end.

The estimators of :mod:`kernapprox.estimators` are fitted objects (float64 numpy draws, refitted on request); the
maps here are ``nn.Module`` s whose ``W_h, b_h`` are ``nn.Parameter`` s, one set per head, trained with the model
(or distilled first, :func:`fit_to_softmax`), in every mode of the linear-attention core and under autocast.

- :class:`HedgehogMap`: ``φ_h(x) = softmax([W_h x + b_h, −(W_h x + b_h)])`` over its ``2·feature_dim`` outputs
  (Zhang et al., ICLR 2024), identity-initialised;
- :class:`T2RMap`: ``φ_h(x) = relu(W_h x + b_h)`` (Kasai et al., EMNLP 2021);
- :func:`feature_attention`: linear attention of ``(q, k, v)`` laid out ``(batch, heads, n, d)``, given after the
  caller's projections and positions (rotary), with grouped-query heads, through the one core
  (:func:`kernapprox.attention.linear.linear_attention_from_features`; Hedgehog's non-causal calls without masks
  or state through :func:`kernapprox.attention.linear.linear_attention_from_log_features`, stabilised per
  feature);
- :func:`feature_attention_weights`: the normalised kernel weights ``Â`` a map induces (what Hedgehog distils);
- :func:`fit_to_softmax`: attention transfer, distilling a map into the softmax attention of a teacher on given
  calibration ``q, k (, v)``, by Hedgehog's cross-entropy on weights or LoLCATs' MSE on outputs.

Grouped-query heads
-------------------
Queries ``q (B, H, n, d)``, keys and values ``(B, H_kv, n, d)`` with ``H = G · H_kv``; query head ``h`` reads key
head ``h // G`` (Hugging Face's ``repeat_kv`` order). A map has ``num_heads`` sets of parameters, ``H`` or ``H_kv``:

- ``num_heads = H_kv`` (the default layout here): keys are mapped per key head and the state is per key head
  (``H_kv · r · (d_v + 1)`` numbers); query head ``h`` uses the map of its key head ``h // G`` (the map repeated
  over the group). One map per key head is what makes the state as small as the key-value cache it replaces.
- ``num_heads = H`` (LoLCATs' layout, which repeats keys and values before its maps): keys are repeated to ``H``
  heads and each query head has its own map and its own state (``H · r · (d_v + 1)`` numbers).

Queries and keys share a head's map (``key_map=None``), as Hedgehog's tied map and the notes' single map per head;
``key_map=`` gives keys their own map (LoLCATs' default, ``tie_qk_kernels=False``), whose ``num_heads`` sets the
state's layout as above.

Precision
---------
Features, states and the attention arithmetic are float32 (float64 when the input or the map is float64), with
autocast switched off inside: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the map's matrix product, the
features and the state stay float32; the output is returned in the queries' dtype.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from .approximate.hybrid import Band, mask_padded_keys, window_attention_parts
from .attention import (
    MODES,
    linear_attention_from_features,
    linear_attention_from_log_features,
    softmax_attention,
)
from .attention.masks import check_key_padding_mask, check_query_padding_mask, check_rows, zero_padded_rows
from .kernel import resolve_scale
from .rules import NormalizedState, resolve_rule
from .validation import (
    as_generator,
    check_bool,
    check_choice,
    check_finite,
    check_positive_float,
    check_positive_int,
    check_tensor,
    itemsize,
)

__all__ = ["TrainableFeatureMap", "HedgehogMap", "T2RMap", "feature_attention", "feature_attention_weights",
           "fit_to_softmax", "FitRecord", "INITS", "LOSSES", "MAPS", "MAP_OPTIONS",
           "make_map"]

INITS = ("identity", "random")
LOSSES = ("weights", "outputs")


def _feature_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is, else float32 (half precision never holds features or states)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


class TrainableFeatureMap(nn.Module):
    r"""Base of the trainable maps: one affine projection per head, ``u_h = W_h x + b_h``, then the map's
    activation.

    Parameters live in ``weight (num_heads, feature_dim, head_dim)`` (``nn.Linear``'s ``out × in`` per head) and
    ``bias (num_heads, feature_dim)`` (or ``None``). Inputs are ``(..., heads, n, head_dim)`` with ``heads`` equal
    to ``num_heads`` or a multiple ``G · num_heads``, in which case head ``h`` uses the map of head ``h // G``
    (the map repeated over a group of grouped-query heads).

    Subclasses declare ``log_domain`` (whether the features are given as logarithms, exactly stabilised) and
    ``feature_multiplier`` (``r / feature_dim``), and define :meth:`stabilised_features` (and :meth:`log_features`
    when ``log_domain``).
    """

    log_domain: ClassVar[bool] = False
    feature_multiplier: ClassVar[int] = 1
    reference: ClassVar[str] = ""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int, *, bias: bool = True,
                 init: str = "identity", rng=None, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.feature_dim = check_positive_int(feature_dim, "feature_dim")
        check_bool(bias, "bias")
        self.init = check_choice(init, "init", INITS)
        if init == "identity" and feature_dim != head_dim:
            raise ValueError(f"init='identity' needs feature_dim == head_dim, got feature_dim = {feature_dim} and "
                             f"head_dim = {head_dim}; use init='random' (with rng) for another feature_dim")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(num_heads, feature_dim, head_dim, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_heads, feature_dim, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(rng)

    @torch.no_grad()
    def reset_parameters(self, rng=None) -> TrainableFeatureMap:
        """``init="identity"``: ``W_h = I``, ``b_h = 0``. ``init="random"``: ``W_h, b_h ~ U(−1/√d, 1/√d)`` (the
        ``nn.Linear`` range), drawn on the CPU in float64 from ``rng`` and then cast (one seed, one draw on every
        device and dtype). Returns ``self``."""
        h, f, d = self.weight.shape
        if self.init == "identity":
            weight = np.broadcast_to(np.eye(f, d), (h, f, d))
            bias = np.zeros((h, f))
        else:
            gen = as_generator(rng)
            bound = 1.0 / math.sqrt(d)
            weight = gen.uniform(-bound, bound, size=(h, f, d))
            bias = gen.uniform(-bound, bound, size=(h, f))
        self.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
        if self.bias is not None:
            self.bias.copy_(torch.from_numpy(bias))
        return self

    @property
    def num_features(self) -> int:
        """``r = feature_multiplier · feature_dim``, the features per head (the state is ``r × (d_v + 1)`` per state
        head)."""
        return self.feature_multiplier * self.feature_dim

    @classmethod
    def largest_feature_dim(cls, budget: int, d_v: int, dtype: torch.dtype = torch.float32) -> int:
        """The largest ``feature_dim`` whose per-head state (:meth:`state_bytes`) fits ``budget`` bytes, for
        comparisons at equal state bytes with the estimators (``budget`` from
        :func:`kernapprox.memory.budget_bytes`); 0 when none does."""
        budget, d_v = check_positive_int(budget, "budget"), check_positive_int(d_v, "d_v")
        return budget // (cls.feature_multiplier * (d_v + 1) * itemsize(dtype))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``u = W_h x + b_h`` for every head, ``(..., heads, n, feature_dim)``, in float32 (float64 when ``x`` or
        the parameters are float64), with autocast off."""
        check_tensor(x, "x", min_rank=3, finite=False)
        heads, d = x.shape[-3], x.shape[-1]
        if d != self.head_dim:
            raise ValueError(f"x has head dimension {d}, the map was built for head_dim = {self.head_dim}")
        if heads % self.num_heads:
            raise ValueError(f"x has {heads} heads (dimension -3), which is not a multiple of the map's num_heads = "
                             f"{self.num_heads} (inputs are (..., heads, n, head_dim))")
        ct = _feature_dtype(x.dtype, self.weight.dtype)
        groups, n = heads // self.num_heads, x.shape[-2]
        with _no_autocast(x.device):
            xg = x.to(ct).reshape(*x.shape[:-3], self.num_heads, groups, n, d)
            u = torch.einsum("hfd,...hgnd->...hgnf", self.weight.to(ct), xg)
            if self.bias is not None:
                u = u + self.bias.to(ct)[:, None, None, :]
        return u.reshape(*x.shape[:-3], heads, n, self.feature_dim)

    def stabilised_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(φ̃, ℓ)`` with ``φ(x) = φ̃ · e^ℓ``, shapes ``(..., heads, n, r)`` and ``(..., heads, n)``: what the
        linear-attention core takes."""
        raise NotImplementedError

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """``log φ(x)``, ``(..., heads, n, r)`` (maps with ``log_domain`` only)."""
        raise NotImplementedError(f"{type(self).__name__} has no log-domain features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The features ``φ(x)``, ``(..., heads, n, r)``."""
        phi, logs = self.stabilised_features(x)
        return phi * torch.exp(logs)[..., None]

    def state_bytes(self, d_v: int, dtype: torch.dtype = torch.float32, *, seq_len: int | None = None,
                    heads: int = 1) -> int:
        """Bytes of the recurrent state of ``heads`` state heads at ``dtype`` (default one): ``r · (d_v + 1)``
        numbers per head, the convention of :meth:`kernapprox.estimators.base.Estimator.state_bytes`, so a map
        compares with the estimators of :mod:`kernapprox.memory` at equal bytes. A layer keeps one state per head
        of its key map: ``heads = num_heads`` of the key map, the number of key heads under the default layout (see
        the module docstring), per sequence. ``seq_len`` is accepted for the estimators' signature and ignored:
        the state does not grow with the context."""
        check_positive_int(d_v, "d_v")
        check_positive_int(heads, "heads")
        if seq_len is not None:
            check_positive_int(seq_len, "seq_len")
        return heads * self.num_features * (d_v + 1) * itemsize(dtype)

    def parameter_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the map's parameters (every head), at ``dtype`` (default: their own)."""
        return sum(p.numel() * (p.element_size() if dtype is None else itemsize(dtype)) for p in self.parameters())

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}, "
                f"num_features={self.num_features}, bias={self.bias is not None}, init={self.init!r}")


class HedgehogMap(TrainableFeatureMap):
    r"""Hedgehog's feature map, per head and trainable: a softmax over ``[u, −u]`` with ``u = W_h x + b_h``.

    .. math::
        φ_h(x) = \operatorname{softmax}\big([W_h x + b_h,\ −(W_h x + b_h)]\big) ∈ \mathbb R^{2f},\qquad
        W_h ∈ \mathbb R^{f×d},\ b_h ∈ \mathbb R^f,

    that is the paper's exponential map ``[exp(W_h x + b_h), exp(−W_h x − b_h)]`` (Zhang et al. 2024, §4)
    divided by its sum over the ``2f`` outputs, a per-token factor that keeps every feature in ``(0, 1]`` and,
    on queries, cancels in the attention ratio (the normalisation of the reference implementations).
    ``normalize="halves"`` normalises each half on its own, ``[softmax(u), softmax(−u)]``, as LoLCATs' map
    (``softmax_dim``) does. Positive, so every normaliser is positive; the ``± u`` pair makes it
    monotone in both directions of ``u``.

    Identity initialisation (``init="identity"``, ``f = d``, ``W_h = I``, ``b_h = 0``), as in the paper's
    conversions, starts from ``φ(x) = softmax([x, −x])``; ``init="random"`` gives any ``f``.

    Features are given as logarithms, ``log φ = log_softmax(·)``, exactly stabilised: :func:`feature_attention`
    runs non-causal calls without masks or state on
    :func:`~kernapprox.attention.linear.linear_attention_from_log_features` (shifted per feature) and every other
    call on :func:`~kernapprox.attention.linear.linear_attention_from_features` with ``φ̃ = e^{log φ − max log φ}``,
    ``ℓ = max log φ ∈ [−log 2f, 0]``.

    Parameters
    ----------
    num_heads : int
        Heads with their own parameters (``H`` or ``H_kv``; see the module docstring).
    head_dim : int
        ``d``, the input dimension.
    feature_dim : int
        ``f``; the map has ``r = 2f`` features.
    bias : bool, default True
    init : {"identity", "random"}, default "identity"
    normalize : {"joint", "halves"}, default "joint"
        One softmax over the ``2f`` outputs (Hedgehog) or one per half (LoLCATs).
    rng : int, SeedSequence or Generator, optional
        The draw of ``init="random"`` (unused by the identity).
    dtype, device : optional
        Of the parameters (default: torch's default dtype, the CPU). Features are float32 or float64 whatever
        the parameters' dtype.

    Attributes
    ----------
    weight : Parameter ``(num_heads, feature_dim, head_dim)``
    bias : Parameter ``(num_heads, feature_dim)`` or None

    References
    ----------
    Zhang, Bhatia, Kumbong & Ré, *The Hedgehog & the Porcupine: Expressive Linear Attentions with Softmax
    Mimicry*, ICLR 2024 (arXiv 2402.04347), §4 (the exponential map, its identity initialisation, and the
    attention-weight distillation loss, :func:`fit_to_softmax`).
    Zhang et al., *LoLCATs: On Low-Rank Linearizing of Large Language Models*, ICLR 2025 (arXiv 2410.10254).

    Examples
    --------
    >>> import torch
    >>> fmap = HedgehogMap(num_heads=2, head_dim=8, feature_dim=8)
    >>> x = torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    >>> phi = fmap(x)
    >>> phi.shape
    torch.Size([3, 2, 5, 16])
    >>> bool(torch.allclose(phi.sum(-1), torch.ones(3, 2, 5)))
    True
    """

    log_domain: ClassVar[bool] = True
    feature_multiplier: ClassVar[int] = 2
    reference: ClassVar[str] = "Zhang et al. 2024 (Hedgehog, ICLR, arXiv 2402.04347), §4"

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int, *, bias: bool = True,
                 init: str = "identity", normalize: str = "joint", rng=None, dtype: torch.dtype | None = None,
                 device=None):
        self.normalize = check_choice(normalize, "normalize", ("joint", "halves"))
        super().__init__(num_heads, head_dim, feature_dim, bias=bias, init=init, rng=rng, dtype=dtype,
                         device=device)

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        u = self.project(x)
        if self.normalize == "joint":
            return torch.log_softmax(torch.cat([u, -u], -1), -1)
        return torch.cat([torch.log_softmax(u, -1), torch.log_softmax(-u, -1)], -1)

    def stabilised_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_phi = self.log_features(x)
        # a constant shift per token: detached from both factors, so the gradient of φ̃·e^ℓ is that of φ
        top = log_phi.amax(-1, keepdim=True).detach()
        return torch.exp(log_phi - top), top.squeeze(-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", normalize={self.normalize!r}"


class T2RMap(TrainableFeatureMap):
    r"""The T2R feature map, per head and trainable: ``φ_h(x) = relu(W_h x + b_h)``.

    .. math::
        φ_h(x) = \max(W_h x + b_h,\ 0) ∈ \mathbb R^{f},\qquad W_h ∈ \mathbb R^{f×d},\ b_h ∈ \mathbb R^f

    (Kasai et al. 2021, eq. 4–5: the single-layer MLP feature map that replaces ``exp(qᵀk/√d)`` when a pretrained
    Transformer is finetuned into an RNN). Non-negative, not positive: a token whose ``f`` outputs are all zero has
    no features, and a query whose features meet no key's gives ``0/0``, which :func:`feature_attention` refuses
    (``ValueError``); ``eps > 0`` floors every feature at ``eps`` (LoLCATs' ``clamp(min=eps)``) so that cannot
    happen. ``init="random"`` (default) draws ``W_h, b_h`` from ``U(−1/√d, 1/√d)`` as the paper's randomly
    initialised MLP; ``init="identity"`` (``f = d``) starts from ``relu(x)``.

    Parameters
    ----------
    num_heads, head_dim, feature_dim : int
        As in :class:`HedgehogMap`; ``r = f`` features.
    bias : bool, default True
    init : {"random", "identity"}, default "random"
    eps : float, default 0
        Floor of every feature (0: the paper's relu).
    rng : int, SeedSequence or Generator, optional
        The draw of ``init="random"``.
    dtype, device : optional

    References
    ----------
    Kasai, Peng, Zhang, Yogatama, Ilharco, Pappas, Mao, Chen & Smith, *Finetuning Pretrained Transformers into
    RNNs*, EMNLP 2021 (arXiv 2103.13076), eq. 4–5.

    Examples
    --------
    >>> import torch
    >>> fmap = T2RMap(num_heads=2, head_dim=8, feature_dim=16, rng=0)
    >>> fmap(torch.zeros(3, 2, 5, 8)).shape
    torch.Size([3, 2, 5, 16])
    """

    reference: ClassVar[str] = "Kasai et al. 2021 (T2R, EMNLP, arXiv 2103.13076), eq. 4-5"

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int, *, bias: bool = True, init: str = "random",
                 eps: float = 0.0, rng=None, dtype: torch.dtype | None = None, device=None):
        self.eps = check_positive_float(eps, "eps", allow_zero=True)
        super().__init__(num_heads, head_dim, feature_dim, bias=bias, init=init, rng=rng, dtype=dtype,
                         device=device)

    def stabilised_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.project(x)
        phi = torch.relu(u) if self.eps == 0 else u.clamp_min(self.eps)
        # no exponential, so no range to stabilise: one log-scale of zero per token
        return phi, torch.zeros(phi.shape[:-1], dtype=phi.dtype, device=phi.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps}"


# the names a model builder takes for a trainable map (ka.convert, KernelAttention): not registry estimators, but
# modules whose parameters the model trains
MAPS: dict[str, type] = {"hedgehog_trainable": HedgehogMap, "t2r_trainable": T2RMap}
MAP_OPTIONS: dict[str, tuple] = {"hedgehog_trainable": ("bias", "init", "normalize"),
                                 "t2r_trainable": ("bias", "init", "eps")}


def make_map(name: str, *, num_heads: int, head_dim: int, num_features: int | None = None, rng=None,
             dtype: torch.dtype | None = None, device=None, **options) -> TrainableFeatureMap:
    """The trainable map ``name`` (:data:`MAPS`) as a model builder makes it: ``r = num_features`` features per head
    (the estimators' convention: ``feature_dim = r / 2`` for Hedgehog, ``r`` for T2R; ``None``: ``feature_dim =
    head_dim``); Hedgehog at the identity when ``feature_dim = head_dim``, else drawn from ``rng``; T2R drawn from
    ``rng`` and floored at ``eps = 1e-6`` (so no query meets a zero kernel). ``options``: the map's ``bias``,
    ``init``, ``normalize`` (Hedgehog) or ``eps`` (T2R)."""
    if name not in MAPS:
        raise ValueError(f"unknown trainable map {name!r}; valid values: {', '.join(MAPS)}")
    unknown = sorted(set(options) - set(MAP_OPTIONS[name]))
    if unknown:
        raise TypeError(f"the trainable map {name!r} got unknown options {', '.join(unknown)}; it takes "
                        f"{', '.join(MAP_OPTIONS[name])}")
    cls = MAPS[name]
    head_dim = check_positive_int(head_dim, "head_dim")
    if num_features is None:
        feature_dim = head_dim
    else:
        r = check_positive_int(num_features, "num_features")
        if r % cls.feature_multiplier:
            raise ValueError(f"num_features of {name} is r = {cls.feature_multiplier} · feature_dim; got {r}")
        feature_dim = r // cls.feature_multiplier
    if cls is HedgehogMap:
        options.setdefault("init", "identity" if feature_dim == head_dim else "random")
    else:
        options.setdefault("eps", 1e-6)
    return cls(num_heads, head_dim, feature_dim, rng=rng, dtype=dtype, device=device, **options)


# ------------------------------------------------------------------------------------------ attention of maps
def _check_map(fmap, name: str) -> TrainableFeatureMap:
    if not isinstance(fmap, TrainableFeatureMap):
        raise TypeError(f"{name} must be a kernapprox.trainable map (HedgehogMap, T2RMap), got {type(fmap).__name__}")
    return fmap


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the heads of ``q (…, H, n, d)`` and ``k, v (…, H_kv, n_k, ·)`` meet the maps: ``state_heads`` (``H_kv``
    or ``H``), ``groups`` query heads per state head, ``repeat`` key heads repeated to reach ``state_heads``."""

    heads: int
    kv_heads: int
    state_heads: int

    @property
    def groups(self) -> int:
        return self.heads // self.state_heads

    @property
    def repeat(self) -> int:
        return self.state_heads // self.kv_heads


def _layout(q, k, v, query_map, key_map) -> _Layout:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, min_rank=3)
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise TypeError(f"q, k and v must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
                        f"{v.dtype}/{v.device}")
    if not (q.dim() == k.dim() == v.dim()) or not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(f"q, k and v must be (..., heads, n, d) with equal batch dimensions, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if v.shape[-3] != kv_heads or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"k and v must have the same heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of the {kv_heads} key/value heads (grouped-query "
                         "heads need H = G · H_kv)")
    if key_map.num_features != query_map.num_features or key_map.log_domain != query_map.log_domain:
        raise ValueError(f"key_map ({type(key_map).__name__}, r = {key_map.num_features}) must be a map of the "
                         f"same kind and size as feature_map ({type(query_map).__name__}, "
                         f"r = {query_map.num_features})")
    for name, fmap in (("feature_map", query_map), ("key_map", key_map)):
        if fmap.num_heads not in (heads, kv_heads):
            raise ValueError(f"{name} has num_heads = {fmap.num_heads}; it must be the number of query heads "
                             f"({heads}) or of key/value heads ({kv_heads})")
    return _Layout(heads, kv_heads, key_map.num_heads)


def _repeat_heads(x, times: int):
    """Each head ``times`` times in a row (head ``h`` → ``h // times``: Hugging Face's ``repeat_kv``)."""
    return x if times == 1 else x.repeat_interleave(times, dim=-3)


def _group(x, lay: _Layout):
    """``(…, H, n, ·)`` → ``(…, S, G, n, ·)``."""
    return x.reshape(*x.shape[:-3], lay.state_heads, lay.groups, *x.shape[-2:])


def _share(x, lay: _Layout):
    """A state head's tensor ``(…, S, n, ·)`` seen by its ``G`` query heads: ``(…, S, G, n, ·)`` (a view)."""
    return x.unsqueeze(-3).expand(*x.shape[:-2], lay.groups, *x.shape[-2:])


def feature_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: TrainableFeatureMap, *,
                      key_map: TrainableFeatureMap | None = None, causal: bool = False, mode: str = "chunked",
                      chunk_size: int = 64, rule="sum", key_padding_mask=None, attn_mask=None, initial_state=None,
                      return_state: bool = False, query_padding_mask=None, window: int | None = None,
                      scale: float | None = None):
    r"""Linear attention with a trainable per-head map, in the parallel, recurrent or chunked mode; with ``window``,
    the window + linear hybrid of LoLCATs.

    .. math::
        y_{h,i} = \frac{\sum_{j} w_{ij}\, φ_h(q_{h,i})^⊤ φ'_{g}(k_{g,j})\, v_{g,j}}
                       {\sum_{j} w_{ij}\, φ_h(q_{h,i})^⊤ φ'_{g}(k_{g,j})},\qquad g = h // G,

    with ``φ`` the query map (``feature_map``), ``φ'`` the key map (``key_map``, default the same map), ``w_ij``
    the causal order, masks and decay of the rule, as in :func:`~kernapprox.attention.linear.linear_attention`.
    Gradients reach the maps' parameters in every mode.

    With ``window = w`` the keys of a query's band ``W(i)`` (causal: the last ``w`` positions, its own included;
    non-causal: ``|i − j| < w``) enter by the exact kernel ``e^{s q^⊤k}`` and the others by the map, one
    normaliser for both (LoLCATs, Zhang et al. 2025, ICLR, §3.2, eq. 6; :class:`~kernapprox.approximate.WindowLinear`'s
    estimate with this map, through the same core,
    :func:`~kernapprox.approximate.hybrid.window_attention_parts`):

    .. math::
        y_{h,i} = \frac{\sum_{j∈W(i)} e^{s q_{h,i}^⊤k_{g,j}} v_{g,j} + \sum_{j∉W(i)} φ_h(q_{h,i})^⊤φ'_g(k_{g,j})\,
                  v_{g,j}}{\sum_{j∈W(i)} e^{s q_{h,i}^⊤k_{g,j}} + \sum_{j∉W(i)} φ_h(q_{h,i})^⊤φ'_g(k_{g,j})}.

    Parameters
    ----------
    q : Tensor ``(..., H, n, d)``
        Queries after the caller's projections and positions (rotary).
    k, v : Tensor ``(..., H_kv, n_k, d)``, ``(..., H_kv, n_k, d_v)``
        ``H = G · H_kv`` (grouped-query heads); one dtype and device with ``q``.
    feature_map : TrainableFeatureMap
        :class:`HedgehogMap` or :class:`T2RMap` with ``num_heads`` ``H_kv`` or ``H`` (the layouts of the module
        docstring).
    key_map : TrainableFeatureMap, optional
        A separate map for keys (same kind and ``r``); its ``num_heads`` sets the state's heads.
    causal : bool
    mode : {"parallel", "recurrent", "chunked"}, default "chunked"
    chunk_size : int, default 64
    rule : "sum" or :class:`~kernapprox.rules.Decay`
        The state-update rule (the delta and least-squares rules take an estimator: use
        :func:`~kernapprox.attention.linear.linear_attention`).
    key_padding_mask : bool Tensor, optional
        ``True`` = padding, broadcastable to the keys' ``(..., H_kv, n_k)`` (pass ``(B, 1, n_k)``).
    attn_mask : Tensor, optional
        Bool (``True`` = takes part) or additive float, broadcastable to ``(..., H, n, n_k)``; parallel mode only.
    query_padding_mask : bool Tensor, optional
        ``True`` = the query is padding (a left-padded batch's filler), broadcastable to ``(..., H, n)`` (pass
        ``(B, 1, n)``): its output row is 0 and it needs no key, as in
        :func:`~kernapprox.attention.linear.linear_attention`.
    initial_state : NormalizedState, optional
        The state of a previous call (``return_state=True``): ``w (..., S, r, d_v)``, ``z (..., S, r)``,
        ``log_scale (..., S)`` with ``S`` the key map's ``num_heads``; decoding one token at a time is a causal call
        with ``n = 1`` and the previous state.
    return_state : bool
        Also return the state after the last key, per state head.
    window : int, optional
        The exact band's width ``w`` (the sum rule only; no ``attn_mask``, ``initial_state`` or ``return_state``:
        a decoding state of the hybrid, its last ``w`` keys and values beside the map's state, is not kept here).
    scale : float, optional
        ``s`` of the exact part (default ``1/sqrt(d)``; pass the attention module's ``scaling``); with no window the
        map carries its own temperature and ``scale`` must be ``None``.

    Returns
    -------
    Tensor ``(..., H, n, d_v)`` in ``q``'s dtype, and with ``return_state`` the
    :class:`~kernapprox.rules.NormalizedState` (float32, or float64 for float64 inputs or maps).

    Raises
    ------
    ValueError
        Heads that do not fit, a query row without a key, or a non-finite output (a T2R query whose features meet
        no key's: use ``eps > 0``).

    Examples
    --------
    >>> import torch
    >>> fmap = HedgehogMap(num_heads=2, head_dim=8, feature_dim=8)
    >>> gen = torch.Generator().manual_seed(0)
    >>> q = torch.randn(1, 4, 10, 8, generator=gen)               # 4 query heads
    >>> k, v = torch.randn(1, 2, 10, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen)   # 2 key heads
    >>> y = feature_attention(q, k, v, fmap, causal=True)
    >>> y_rnn = feature_attention(q, k, v, fmap, causal=True, mode="recurrent")
    >>> y.shape, bool(torch.allclose(y, y_rnn, atol=1e-5))
    (torch.Size([1, 4, 10, 8]), True)
    """
    _check_map(feature_map, "feature_map")
    key_map = feature_map if key_map is None else _check_map(key_map, "key_map")
    check_bool(causal, "causal")
    check_bool(return_state, "return_state")
    check_choice(mode, "mode", MODES)
    rule = resolve_rule(rule)
    lay = _layout(q, k, v, feature_map, key_map)
    n, n_k = q.shape[-2], k.shape[-2]
    if causal and n != n_k:
        raise ValueError(f"causal attention needs as many queries as keys, got {n} and {n_k}")
    padding = _padding(key_padding_mask, k, lay)
    ct = _feature_dtype(q.dtype, feature_map.weight.dtype, key_map.weight.dtype)
    if window is not None:
        return _window_attention(q, k, v, feature_map, key_map, lay, causal, mode, chunk_size, rule, padding,
                                 attn_mask, initial_state, return_state, query_padding_mask, window, scale, ct)
    if scale is not None:
        raise ValueError("scale is the exact part's kernel scale: it needs window= (a map carries its own temperature)")
    with _no_autocast(q.device):
        k, v = _repeat_heads(k, lay.repeat), _repeat_heads(v, lay.repeat).to(ct)
        log_path = (feature_map.log_domain and not causal and padding is None and attn_mask is None
                    and initial_state is None and not return_state and rule.name == "sum"
                    and query_padding_mask is None)
        if log_path:                           # every feature shifted by its own maximum: exact stabilisation
            log_q, log_k = feature_map.log_features(q), key_map.log_features(k)
            if lay.groups > 1:
                log_q, log_k, v = _group(log_q, lay), _share(log_k, lay), _share(v, lay)
            num, den, _ = linear_attention_from_log_features(log_q, log_k, v, mode=mode, chunk_size=chunk_size)
            out, final = num / den[..., None], None
        else:
            out, final = _attention_of_features(q, k, v, feature_map, key_map, lay, causal, mode, chunk_size, rule,
                                                padding, attn_mask, initial_state, return_state, ct,
                                                check_query_padding_mask(query_padding_mask, q))
        out = out.reshape(*q.shape[:-1], v.shape[-1])
    check_finite(out, f"feature_attention gave non-finite outputs in {ct}: a query's features have a zero inner "
                      "product with every key's (a T2R map's relu can be zero everywhere: use T2RMap(..., eps=1e-6); "
                      "a map with extreme logits can underflow float32: use float64)")
    out = out.to(q.dtype)
    return (out, final) if return_state else out


def _window_attention(q, k, v, query_map, key_map, lay, causal, mode, chunk_size, rule, padding, attn_mask,
                      initial_state, return_state, query_padding_mask, window, scale, ct):
    """:func:`feature_attention` with a window: every tensor repeated to the query heads, then the hybrid's core."""
    window = check_positive_int(window, "window")
    if rule.name != "sum":
        raise ValueError(f"window= takes the sum rule (the exact band has no decay), got rule {rule.name!r}")
    if attn_mask is not None:
        raise ValueError("window= sets the band itself: attn_mask is not taken with it")
    if initial_state is not None or return_state:
        raise NotImplementedError("a trainable map with window= has no decoding state here (its last w keys and "
                                  "values beside the map's state): call it on the whole sequence, without "
                                  "initial_state or return_state")
    qpad = check_query_padding_mask(query_padding_mask, q)
    with _no_autocast(q.device):
        s = resolve_scale(q.shape[-1], scale)
        k, v = _repeat_heads(k, lay.repeat), _repeat_heads(v, lay.repeat)
        pq, lq = query_map.stabilised_features(q)                     # (..., H, n, r)
        pk, lk = key_map.stabilised_features(k)                       # (..., S, n_k, r)
        if padding is not None:
            padding = padding.expand(*lk.shape)
        heads = lay.groups                                            # state head → its query heads
        pk, lk = _repeat_heads(pk, heads).to(ct), _repeat_heads(lk[..., None], heads)[..., 0].to(ct)
        k, v = _repeat_heads(k, heads).to(ct), _repeat_heads(v, heads).to(ct)
        if padding is not None:
            padding = _repeat_heads(padding[..., None], heads)[..., 0]
        check_rows(causal=causal, key_padding=padding, allowed=None, state_nonempty=None, n_q=q.shape[-2],
                   exempt=qpad)
        pk, lk = mask_padded_keys(pk, lk, padding)
        num, den, logs = window_attention_parts(q.to(ct) * s, k, v, pq.to(ct), lq.to(ct), pk, lk,
                                                band=Band(window), causal=causal, mode=mode, chunk_size=chunk_size,
                                                key_padding_mask=padding)
        num, den, _ = zero_padded_rows(num, den, logs, qpad)
        out = num / den[..., None]
    check_finite(out, f"feature_attention (window = {window}) gave non-finite outputs in {ct}")
    return out.to(q.dtype)


def _padding(mask, k, lay: _Layout):
    """The key padding mask expanded to the keys ``(..., H_kv, n_k)`` and repeated to the state heads."""
    mask = check_key_padding_mask(mask, k)
    if mask is None or lay.repeat == 1:
        return mask
    return mask.repeat_interleave(lay.repeat, dim=-2)


def _attention_of_features(q, k, v, query_map, key_map, lay, causal, mode, chunk_size, rule, padding, attn_mask,
                           initial_state, return_state, ct, qpad=None):
    pq, lq = query_map.stabilised_features(q)                     # (..., H, n, r)
    pk, lk = key_map.stabilised_features(k)                       # (..., S, n_k, r)
    state0 = initial_state
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(ct)
        try:
            attn_mask = attn_mask.expand(*q.shape[:-1], k.shape[-2])
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., H, n, n_k) = "
                             f"{(*q.shape[:-1], k.shape[-2])}") from None
    if initial_state is not None:
        state0 = _check_initial_state(initial_state, pk.shape[:-2], lay)
    if lay.groups > 1:
        pq, lq = _group(pq, lay), _group(lq[..., None], lay)[..., 0]
        pk, lk, v = _share(pk, lay), _share(lk[..., None], lay)[..., 0], _share(v, lay)
        if padding is not None:
            padding = padding.unsqueeze(-2).expand(*padding.shape[:-1], lay.groups, padding.shape[-1])
        if attn_mask is not None:
            attn_mask = _group(attn_mask, lay)
        if qpad is not None:
            qpad = _group(qpad[..., None], lay)[..., 0]
        if state0 is not None:
            state0 = NormalizedState(_share(state0.w, lay), _share(state0.z[..., None], lay)[..., 0],
                                     state0.log_scale[..., None].expand(*state0.log_scale.shape, lay.groups))
    result = linear_attention_from_features(pq, lq, pk, lk, v, causal=causal, mode=mode, chunk_size=chunk_size,
                                            rule=rule, key_padding_mask=padding, attn_mask=attn_mask,
                                            initial_state=state0, return_state=return_state,
                                            query_padding_mask=qpad)
    parts, final = result if return_state else (result, None)
    if final is not None and lay.groups > 1:      # the G copies of a state head's state are one state
        final = NormalizedState(final.w[..., 0, :, :], final.z[..., 0, :], final.log_scale[..., 0])
    return parts.output, final


def _check_initial_state(state, batch_heads, lay: _Layout):
    if not isinstance(state, NormalizedState):
        raise TypeError(f"initial_state must be the NormalizedState that return_state=True gave, got "
                        f"{type(state).__name__}")
    if tuple(state.w.shape[:-2]) != tuple(batch_heads):
        raise ValueError(f"initial_state.w has shape {tuple(state.w.shape)}: its leading dimensions must be the batch "
                         f"and the {lay.state_heads} state heads {tuple(batch_heads)}")
    return state


# --------------------------------------------------------------------------------------------- distillation
def feature_attention_weights(q: torch.Tensor, k: torch.Tensor, feature_map: TrainableFeatureMap, *,
                              key_map: TrainableFeatureMap | None = None, causal: bool = False,
                              log: bool = False, window: int | None = None, scale: float | None = None
                              ) -> torch.Tensor:
    r"""The normalised kernel weights a map induces, ``Â_{h,ij} = φ_h(q_i)^⊤φ'_g(k_j) / Σ_{j'} φ_h(q_i)^⊤φ'_g(k_{j'})``
    (``g = h // G``; ``j ≤ i`` when causal), ``(..., H, n, n_k)``: the linear-attention counterpart of the softmax
    weights, which Hedgehog distils (:func:`fit_to_softmax` with ``loss="weights"``).

    Computed from the stabilised features (``log K_ij = log(φ̃_q,i^⊤ φ̃_k,j e^{ℓ_k,j − max ℓ_k}) + ℓ_q,i + max ℓ_k``),
    materialising ``n × n_k`` per head like the softmax weights; a kernel value below the dtype's smallest normal
    number counts as that number (so ``log`` stays finite). ``log=True`` returns ``log Â`` (``−inf`` where causal
    order removes a pair). With ``window`` (and the exact part's ``scale``), the hybrid's weights of
    :func:`feature_attention`: ``log K_ij = s q_i^⊤k_j`` on the band, the map's elsewhere.
    """
    _check_map(feature_map, "feature_map")
    key_map = feature_map if key_map is None else _check_map(key_map, "key_map")
    check_bool(causal, "causal")
    check_bool(log, "log")
    lay = _layout(q, k, k, feature_map, key_map)
    n, n_k = q.shape[-2], k.shape[-2]
    if causal and n != n_k:
        raise ValueError(f"causal attention needs as many queries as keys, got {n} and {n_k}")
    with _no_autocast(q.device):
        pq, lq = feature_map.stabilised_features(q)
        pk, lk = key_map.stabilised_features(_repeat_heads(k, lay.repeat))
        pk, lk = _repeat_heads(pk, lay.groups), _repeat_heads(lk[..., None], lay.groups)[..., 0]
        top = lk.amax(-1, keepdim=True).detach()
        gram = pq @ (pk * torch.exp(lk - top)[..., None]).transpose(-1, -2)
        tiny = torch.finfo(gram.dtype).tiny
        log_kernel = torch.log(gram.clamp_min(tiny)) + (lq + top)[..., None]
        if window is not None:
            window = check_positive_int(window, "window")
            exact = resolve_scale(q.shape[-1], scale) * (q.to(log_kernel.dtype) @ _repeat_heads(
                _repeat_heads(k, lay.repeat), lay.groups).to(log_kernel.dtype).transpose(-1, -2))
            offset = torch.arange(n, device=q.device)[:, None] - torch.arange(n_k, device=q.device)[None, :]
            band = ((offset >= 0) & (offset < window)) if causal else (offset.abs() < window)
            log_kernel = torch.where(band, exact, log_kernel)
        elif scale is not None:
            raise ValueError("scale is the exact part's kernel scale: it needs window=")
        if causal:
            future = torch.ones(n, n_k, dtype=torch.bool, device=q.device).triu(1)
            log_kernel = log_kernel.masked_fill(future, -math.inf)
        log_weights = torch.log_softmax(log_kernel, -1)
    return log_weights if log else torch.exp(log_weights)


@dataclasses.dataclass(frozen=True)
class FitRecord:
    """What :func:`fit_to_softmax` did: the loss per step, its cost and its size.

    Attributes
    ----------
    loss : str
        ``"weights"`` or ``"outputs"``.
    losses : tuple of float
        The loss of each step's batch, before that step's update.
    initial_loss, final_loss : float
        The loss on the whole calibration set before the first step and after the last.
    steps : int
    tokens : int
        Query positions the optimiser saw: ``Σ_steps batch · n`` (heads not counted).
    calibration_tokens : int
        Positions in the calibration set, ``B · n``.
    cpu_seconds, wall_seconds : float
        Process CPU time (every thread) and wall time of the fit.
    """

    loss: str
    losses: tuple
    initial_loss: float
    final_loss: float
    steps: int
    tokens: int
    calibration_tokens: int
    cpu_seconds: float
    wall_seconds: float

    def as_dict(self) -> dict:
        """Plain data (for a provenance record or a cache entry)."""
        out = dataclasses.asdict(self)
        out["losses"] = list(self.losses)
        return out


def _teacher(q, k, v, lay, causal, scale, loss, ct):
    """Softmax attention of the teacher, in ``ct``: log-weights ``(B, H, n, n_k)`` or outputs ``(B, H, n, d_v)``."""
    kr = _repeat_heads(k, lay.heads // lay.kv_heads).to(ct)
    qc = q.to(ct)
    if loss == "outputs":
        return softmax_attention(qc, kr, _repeat_heads(v, lay.heads // lay.kv_heads).to(ct), causal, scale)
    logits = resolve_scale(q.shape[-1], scale) * (qc @ kr.transpose(-1, -2))
    if causal:
        n = q.shape[-2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(logits, -1)


def _distillation_loss(name, q, k, v, target, feature_map, key_map, causal, window=None, scale=None):
    hybrid = {} if window is None else {"window": window, "scale": scale}
    if name == "outputs":
        y = feature_attention(q, k, v, feature_map, key_map=key_map, causal=causal, mode="parallel", **hybrid)
        return (y - target).pow(2).mean()
    log_weights = feature_attention_weights(q, k, feature_map, key_map=key_map, causal=causal, log=True, **hybrid)
    # removed pairs have P = 0 and log Â = −inf: they take no part (0 · −inf would be NaN)
    terms = torch.where(target > 0, target * log_weights, torch.zeros((), dtype=target.dtype))
    return -terms.sum(-1).mean()


def fit_to_softmax(feature_map: TrainableFeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                   *, key_map: TrainableFeatureMap | None = None, loss: str = "weights", steps: int = 100,
                   lr: float = 0.01, batch_size: int | None = None, rng=None, causal: bool = False,
                   scale: float | None = None, window: int | None = None) -> FitRecord:
    r"""Attention transfer: train a map's parameters (in place) so that its linear attention mimics the softmax
    attention of a teacher on calibration queries and keys.

    With teacher weights ``P_{h,ij} = softmax_j(s q_{h,i}^⊤ k_{g,j})`` (``s = 1/√d`` unless ``scale``; ``j ≤ i``
    when causal) and the map's normalised kernel weights ``Â`` (:func:`feature_attention_weights`):

    - ``loss="weights"`` (Hedgehog, Zhang et al. 2024, §4): the cross-entropy
      ``L = −mean_{h,i} Σ_j P_{h,ij} log Â_{h,ij}``;
    - ``loss="outputs"`` (LoLCATs' attention transfer, Zhang et al. 2025, §3): the mean squared error
      ``L = mean (ŷ − y)²`` between the map's attention outputs ``ŷ`` (:func:`feature_attention`, parallel mode)
      and the teacher's ``y = P V``.

    With ``window = w`` the student is the window + linear hybrid of :func:`feature_attention` (the exact kernel
    at the teacher's ``scale`` on the last ``w`` keys, the map elsewhere) and the map is trained inside it, on the
    hybrid's outputs or weights: LoLCATs' attention transfer of a sliding-window student (Zhang et al. 2025,
    §3.2), where only the keys outside the window reach the map.

    Minimised by ``steps`` Adam steps at learning rate ``lr`` on the parameters of ``feature_map`` (and of
    ``key_map``, when given), each on ``batch_size`` sequences drawn without replacement from ``rng`` (default:
    every sequence, every step; the fit is then deterministic and ``rng`` unused). Each head's parameters see only
    its own heads' loss, so the heads are fitted independently in one pass. Both losses materialise the ``n × n``
    weights of every (sequence, head) of a batch, as softmax attention does: choose ``batch_size`` for long
    calibration sequences.

    Parameters
    ----------
    feature_map : TrainableFeatureMap
    q : Tensor ``(B, H, n, d)``
        Calibration queries (as the model computes them: after projections and positions); never the text the
        fitted map is evaluated on.
    k : Tensor ``(B, H_kv, n, d)``
    v : Tensor ``(B, H_kv, n, d_v)``, optional
        Needed by ``loss="outputs"``.
    key_map : TrainableFeatureMap, optional
    loss : {"weights", "outputs"}
    steps : int, default 100
    lr : float, default 0.01
    batch_size : int, optional
    rng : int, SeedSequence or Generator, optional
        The order of the batches.
    causal : bool
        Teacher and student both causal.
    scale : float, optional
        The teacher's ``s`` (and the hybrid's exact part's, with ``window``).
    window : int, optional
        Train the map inside a window + linear hybrid with ``w`` exact keys.

    Returns
    -------
    FitRecord
        Loss curve, steps, tokens, CPU and wall seconds.

    References
    ----------
    Zhang, Bhatia, Kumbong & Ré, *The Hedgehog & the Porcupine*, ICLR 2024, §4 (attention-weight distillation).
    Zhang, Arora, Chalamala, Wu, Spector, Singhal, Ramesh, Linderman & Ré, *LoLCATs: On Low-Rank Linearizing of
    Large Language Models*, ICLR 2025 (arXiv 2410.10254), §3 (attention transfer by output MSE).

    Examples
    --------
    >>> import torch
    >>> gen = torch.Generator().manual_seed(0)
    >>> q, k = torch.randn(4, 2, 16, 8, generator=gen), torch.randn(4, 2, 16, 8, generator=gen)
    >>> fmap = HedgehogMap(num_heads=2, head_dim=8, feature_dim=8)
    >>> record = fit_to_softmax(fmap, q, k, steps=20, lr=0.05)
    >>> record.final_loss < record.initial_loss
    True
    """
    _check_map(feature_map, "feature_map")
    key_map = None if key_map is None else _check_map(key_map, "key_map")
    check_choice(loss, "loss", LOSSES)
    steps = check_positive_int(steps, "steps")
    lr = check_positive_float(lr, "lr")
    check_bool(causal, "causal")
    if window is not None:
        window = check_positive_int(window, "window")
    if loss == "outputs" and v is None:
        raise ValueError('loss="outputs" compares attention outputs: pass the calibration values v')
    if v is None:
        v = k
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, min_rank=4)
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, n, d), got shape {tuple(t.shape)}")
    lay = _layout(q, k, v, feature_map, key_map or feature_map)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    num_seqs = q.shape[0]
    if batch_size is not None:
        batch_size = min(check_positive_int(batch_size, "batch_size"), num_seqs)
    maps = [feature_map] if key_map is None or key_map is feature_map else [feature_map, key_map]
    params = [p for m in maps for p in m.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the map has no trainable parameters (requires_grad is False for all of them)")
    ct = _feature_dtype(q.dtype, *(p.dtype for p in params))
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad(), _no_autocast(q.device):
        target = _teacher(q, k, v, lay, causal, scale, loss, ct)
    gen = as_generator(rng) if batch_size is not None else None
    cpu0, wall0 = time.process_time(), time.perf_counter()

    def full_loss():
        with torch.no_grad():
            return float(_distillation_loss(loss, q, k, v, target, feature_map, key_map, causal, window, scale))

    initial = full_loss()
    optimizer = torch.optim.Adam(params, lr=lr)
    losses, tokens = [], 0
    with torch.enable_grad():
        for step in range(steps):
            if gen is None:
                idx = slice(None)
                tokens += num_seqs * q.shape[-2]
            else:
                idx = torch.from_numpy(gen.choice(num_seqs, size=batch_size, replace=False)).to(q.device)
                tokens += batch_size * q.shape[-2]
            optimizer.zero_grad(set_to_none=True)
            value = _distillation_loss(loss, q[idx], k[idx], v[idx], target[idx], feature_map, key_map, causal,
                                       window, scale)
            current = float(value.detach())
            if not math.isfinite(current):
                raise ValueError(f"the fit diverged at step {step} (loss {current}): lower lr or the scale of q and k")
            value.backward()
            optimizer.step()
            losses.append(current)
    final = full_loss()
    if not math.isfinite(final):
        raise ValueError(f"the fit ended with a non-finite loss ({final}): lower lr")
    return FitRecord(loss=loss, losses=tuple(losses), initial_loss=initial, final_loss=final, steps=steps,
                     tokens=tokens, calibration_tokens=num_seqs * q.shape[-2],
                     cpu_seconds=time.process_time() - cpu0, wall_seconds=time.perf_counter() - wall0)
