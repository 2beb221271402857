"""A ``torch.nn`` multi-head attention layer whose softmax kernel is any registry estimator.

:class:`KernelAttention` is multi-head attention with query/key/value/output projections in which
``softmax(s · QKᵀ) V`` is replaced by kernelised attention with a registry estimator (``"exact"`` included) in one
of the three modes (see :func:`kernapprox.linear_attention`). Inputs are batch-first ``(batch, seq, embed_dim)``.

>>> import torch
>>> layer = KernelAttention(64, 4, "positive_orthogonal", num_features=128, causal=True, rng=0)
>>> x = torch.zeros(2, 10, 64)
>>> layer(x).shape                     # (batch, n, embed_dim) -> (batch, n, embed_dim)
torch.Size([2, 10, 64])
>>> layer = layer.redraw()             # a new draw of the random features, only when asked

Design
------
* **Randomness.** All of it comes from ``rng`` (int, ``SeedSequence`` or ``Generator``): the projection
  weights (Xavier-uniform, biases zero), the feature map's draws and the dropout masks use independent numpy
  streams spawned from it; torch's global RNG is never used. Two layers built with the same ``rng`` are
  identical.
* **The attention** is :func:`kernapprox.nn.functional.kernel_attention` on the projected (and, with a
  ``pos_hook``, positioned) heads: its module docstring states what grouped-query heads, dropout, autocast and
  ``scale`` mean.
* **Redraws are explicit.** The random features are drawn once (at construction for data-independent maps)
  and stay fixed — across forward passes, ``train()``/``eval()`` and steps — until :meth:`KernelAttention.redraw`
  (or :meth:`KernelAttention.fit`) is called. Performer-style periodic redrawing is the training loop's call.
* **Data-dependent estimators** (``data_dependent = True``: OPRF, the dense-exponential maps, Nyström, ...) are
  fitted on projected queries and keys (detached, no gradient), and the projections they were fitted on change
  while the layer trains. The refit policy:

  - ``refit_every=k``: in training mode the map is refitted on the current batch before the first training
    forward and then every ``k`` training forwards (``k = 1``: every step), so it follows the projections as they
    learn; in eval mode it is never refitted (inference is deterministic). This is the policy for training. The
    map then lags the projections by design (the optimiser step after the last refit, and up to ``k − 1``
    before it): the stale-map warning below is not raised for it; :meth:`KernelAttention.fit` on a calibration
    batch after training fits it to the final projections.
  - :meth:`KernelAttention.fit` on a calibration batch, explicitly (the policy for inference after training).
  - Otherwise the map is fitted on the first batch ``forward`` sees, with a ``UserWarning``, and a ``UserWarning``
    is raised once when the layer is used after its query or key projections changed since the map was fitted
    (an optimizer step, a load): the map is stale. ``python -m benchmarks.refit_copy_task`` measures the policy
    on a copy task (3 seeds, 600 Adam steps, loss and non-positive normalisers per seed): Nyström at ``r = 16``
    fitted once at the initial projections keeps a large share of non-positive normalisers, ``refit_every=1``
    removes most of them, and at that rank Nyström does not learn the task either way (exact attention does).

  The projections' identity is tracked through their tensors' version counters (every in-place update, e.g.
  ``optimizer.step()`` or ``load_state_dict``, bumps them), which costs nothing per call.
* **Buffers are the source of truth.** Everything the estimator fitted (projections, landmarks, whitening
  matrices, fitted scalars) is registered as a buffer under ``feature_state``: it is in ``state_dict``, moves
  with ``.to(device)`` and is cast by ``.to(dtype)`` like any buffer (use autocast rather than ``.half()`` to keep
  the features accurate). The estimator's own float64 copies are refreshed from the buffers whenever a buffer
  changes (new device or dtype, in-place edit, ``load_state_dict``), so nothing stale is ever used. Loading a
  state dict into a layer whose data-dependent estimator has not been fitted yet first builds the fitted
  structure from a placeholder fit and then takes every value from the state dict.
* One estimator is shared by all heads (statistics of data-dependent maps are pooled over batch and heads).
* **Trainable maps.** ``estimator="hedgehog_trainable"`` or ``"t2r_trainable"`` (:data:`kernapprox.trainable.MAPS`),
  or a :class:`~kernapprox.trainable.TrainableFeatureMap` instance, makes the layer's kernel a per-head map whose
  parameters are the layer's (``feature_map``, a submodule: in ``parameters()`` and ``state_dict``), trained by the
  model's optimiser in every mode through :func:`kernapprox.trainable.feature_attention`; one map per key/value
  head (``num_heads = num_kv_heads``) unless an instance says otherwise. No refit, redraw or fit applies (attention
  transfer is :func:`kernapprox.trainable.fit_to_softmax`), nor ``scale`` (the map's ``W_h`` carries its own
  temperature), nor dropout; the rules are the sum and the decay. Decoding: ``forward(..., return_state=True)``
  gives a :class:`MapState` that :meth:`KernelAttention.step` continues.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..attention import MODES, RecurrentState
from ..attention.decode import DecodeCache, decode_cache
from ..estimators.base import Estimator
from ..estimators.registry import (
    TRAINABLE_MAP_NAMES,
    available_estimators,
    capabilities,
    is_trainable_map,
    make_estimator,
)
from ..rules import NormalizedState, resolve_rule
from ..validation import as_generator, check_bool, check_choice, check_device, check_positive_int, check_tensor
from .functional import autocast_dtype, kernel_attention, repeat_kv

if TYPE_CHECKING:
    from ..trainable import TrainableFeatureMap

__all__ = ["KernelAttention", "MapState"]


class _FittedState(nn.Module):
    """The fitted values of one estimator (:meth:`Estimator.fitted_state`) as buffers; a nested estimator's
    ``"<attribute>.<name>"`` entries live in a child module named after the attribute, so ``state_dict`` keys
    are the estimator's own. Numbers are stored as 0-d int64/float64 buffers."""

    data_sized: frozenset = frozenset()      # names of this module's buffers whose shapes follow the fitting data
    skip_next_load: bool = False             # set by the layer when it refuses a checkpoint

    def capture(self, est: Estimator) -> None:
        for name in list(self._buffers):
            del self._buffers[name]
        for name in list(self._modules):
            del self._modules[name]
        self.data_sized = frozenset()
        data_sized = est.data_sized_state_keys()
        for key, value in est.fitted_state().items():
            *path, name = key.split(".")
            module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, _FittedState())
                module = module._modules[part]
            if key in data_sized:
                module.data_sized = module.data_sized | {name}
            if isinstance(value, np.ndarray):
                buffer = torch.from_numpy(value)                # fitted_state's copy
            elif isinstance(value, torch.Tensor):
                buffer = value
            else:
                buffer = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
            module.register_buffer(name, buffer)

    def restore(self, est: Estimator) -> None:
        """Write the buffers' values back into the estimator (which keeps them as the kinds it stored)."""
        est.load_fitted_state(dict(self.named_buffers(remove_duplicate=False)))

    def signature(self) -> tuple:
        """Identity of every buffer's storage, version, device and dtype: changes whenever a value may have."""
        return tuple((name, b.data_ptr(), b._version, b.device, b.dtype) for name, b in self.named_buffers())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Replace rather than copy into (keeping this buffer's device and dtype), after torch's checks: a tensor,
        # of the shape this estimator's parameters give (entries sized by the fitting data excepted).
        if self.skip_next_load:                 # the layer refused the checkpoint's estimator record
            self.skip_next_load = False
            return
        for name, old in list(self._buffers.items()):
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                                  f"object from checkpoint but received {type(value)}")
                continue
            if value.shape != old.shape and name not in self.data_sized:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {old.shape}.")
                continue
            self._buffers[name] = value.detach().to(device=old.device, dtype=old.dtype).clone()
        if strict:
            for key in state_dict:
                if key.startswith(prefix):
                    head = key[len(prefix):].split(".")[0]
                    if head not in self._buffers and head not in self._modules:
                        unexpected_keys.append(key)


def _plain(value):
    """``value`` as plain Python data (what ``torch.load(weights_only=True)`` reads back): numbers, strings, None
    and containers of them as they are, anything else (a sampler object) as its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _registered() -> set[str]:
    return set(available_estimators())


def _is_fixed_feature_map(caps) -> bool:
    """A data-independent feature map whose dimension is fixed by ``d`` (its dimension is known without data)."""
    return caps.fixed_dimension and caps.kind == "features" and not caps.data_dependent


def _common_dtype(q, k, v):
    """``q, k, v`` in one dtype: under autocast the autocast dtype (as
    :func:`~kernapprox.nn.functional.kernel_attention` casts them; a rotary hook's float32 tables promote queries and
    keys, not values), else their promotion."""
    low = autocast_dtype(q.device.type)
    dtype = low if low is not None else torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


class MapState:
    """The decoding state of a :class:`KernelAttention` with a trainable map: the map's
    :class:`~kernapprox.rules.NormalizedState` after the tokens so far (``w (B, S, r, d_v)``, ``z (B, S, r)``,
    ``log_scale (B, S)``, ``S`` the key map's heads; float32, float64 for a float64 layer, also under autocast),
    which :meth:`KernelAttention.step` updates in place.

    Attributes
    ----------
    feature_map : TrainableFeatureMap
        The layer's map (the state belongs to it).
    rule : rule object
    state : NormalizedState
    """

    def __init__(self, feature_map: TrainableFeatureMap, rule, state: NormalizedState):
        self.feature_map = feature_map
        self.rule = rule
        self.state = state

    def state_bytes(self) -> int:
        """``r (d_v + 1)`` numbers per state head and sequence (the estimators' convention)."""
        return sum(t.numel() * t.element_size() for t in (self.state.w, self.state.z))


class KernelAttention(nn.Module):
    r"""Multi-head attention with the softmax kernel replaced by a registry estimator.

    .. math::
        \mathrm{out} = W_o\,\big[\mathrm{attn}(P(X_q W_q^{(h)}), P(X_k W_k^{(g(h))}), X_v W_v^{(g(h))})\big]_{h=1..H},
        \qquad \mathrm{attn}(Q, K, V)_i = \frac{\sum_j κ̂(q_i, k_j)\, v_j}{\sum_j κ̂(q_i, k_j)}

    with ``κ̂`` the estimator's approximation of ``exp(s · qᵀk)`` (``s = 1/sqrt(qk_dim)`` unless ``scale`` is
    given), the sums over ``j ≤ i`` when causal, ``P`` the positional hook (identity by default; e.g.
    :class:`~kernapprox.nn.RotaryEmbedding`) and ``g(h) = h // (H / H_kv)`` the key/value head of query head ``h``
    (grouped-query attention). The attention itself is :func:`kernapprox.nn.functional.kernel_attention`. With
    ``estimator="exact"`` this is ``torch.nn.MultiheadAttention`` (same projections, same scaling). Whether the
    estimate is unbiased, positive or data-dependent is the estimator's property (its class attributes and
    docstring).

    Parameters
    ----------
    embed_dim : int
        Model width ``E``; inputs are ``(batch, seq, E)``.
    num_heads : int
        ``H``; must divide ``embed_dim`` (``head_dim = E / H``).
    estimator : str or TrainableFeatureMap, default="positive_orthogonal"
        Registry name (:func:`kernapprox.available_estimators`), ``"exact"`` included; or a trainable map,
        ``"hedgehog_trainable"`` / ``"t2r_trainable"`` (built by :func:`kernapprox.trainable.make_map` with
        ``num_heads = num_kv_heads``, ``head_dim = qk_dim``, ``r = num_features``, drawn from ``rng``; ``options``
        its ``bias``, ``init``, ``normalize``, ``eps``), or a :class:`~kernapprox.trainable.TrainableFeatureMap`
        instance (``head_dim = qk_dim``, ``num_heads`` the key/value or the query heads).
    num_features : int, optional
        ``r`` of the estimator; required by every estimator whose dimension is not fixed by ``qk_dim``. A map of
        fixed dimension (capability ``fixed_dimension``: Taylor, ELU+1, ...) takes its own dimension when
        ``num_features`` is None and raises ``ValueError`` naming ``num_features`` and that dimension for any other
        value (its dimension is set through ``qk_dim``).
    mode : {"parallel", "recurrent", "chunked"}, default="chunked"
        Attention mode; must be one the estimator supports (``estimator.modes``).
    causal : bool, default=False
        The default of every call (``forward(..., causal=...)`` overrides it per call).
    rng : int, SeedSequence or Generator, optional
        The only source of randomness (projection weights, feature draws and dropout masks).
    num_kv_heads : int, optional
        ``H_kv``, the key/value heads (grouped-query attention; default ``H``); must divide ``H``. ``k_proj`` and
        ``v_proj`` then have ``H_kv`` heads' outputs. The state is kept per query head (a documented repetition of
        the key/value heads, :mod:`kernapprox.nn.functional`).
    chunk_size : int, default=64
        Chunk length of the chunked mode.
    qk_dim : int, optional
        Per-head dimension of queries and keys, the feature map's input ``d`` (default ``head_dim``). A smaller
        ``qk_dim`` with a fixed-dimension map sets its feature dimension, as Based projects to a small feature
        dimension before its Taylor map (Arora et al. 2024); values keep ``head_dim``, and the default scale is
        ``1/sqrt(qk_dim)``.
    refit_every : int, optional
        Data-dependent estimators only: refit the map on the current batch every ``refit_every`` training-mode
        forward calls (the first included); never in eval mode. See the module docstring for the policy.
    rule : str or rule object, default="sum"
        The state-update rule of linear attention (:mod:`kernapprox.rules`: sum, decay, delta, least squares);
        it must be one the estimator supports. Exact attention takes ``"sum"`` only.
    bias : bool, default=True
        Biases in the query, key and value projections.
    out_bias : bool, optional
        Bias in the output projection (default: ``bias``). Llama-style layers have none anywhere (``bias=False``);
        Qwen-style ones ``bias=True, out_bias=False``.
    dropout : float in [0, 1), default=0
        Attention dropout in training mode: whole keys are dropped (their values zeroed, the kept ones scaled by
        ``1/(1−p)``, the normaliser unchanged), the same in every mode (:mod:`kernapprox.nn.functional`). The masks
        are drawn from the layer's own numpy stream (spawned from ``rng``).
    pos_hook : callable or nn.Module, optional
        ``pos_hook(q, k, positions) -> (q, k)``, applied between the projections and the feature map:
        ``q (B, H, n, qk_dim)``, ``k (B, H_kv, n, qk_dim)``, ``positions (B, n)`` int64 (``arange(n)`` unless the
        call gives them). :class:`~kernapprox.nn.RotaryEmbedding` is one. A module becomes a submodule (it moves
        with the layer). Self-attention only.
    scale : float, optional
        Kernel scale ``s``.
    device, dtype : optional
        Of the projection weights (the feature buffers follow ``.to``).
    **options
        Further estimator options (e.g. ``sampler``, ``window``).

    Attributes
    ----------
    estimator : Estimator or None
        The kernapprox estimator (its fitted values mirror ``feature_state``). Refit it through
        :meth:`fit` or :meth:`redraw`, not directly: a direct ``estimator.fit`` would leave the buffers behind.
        ``None`` with a trainable map.
    feature_map : TrainableFeatureMap or None
        The trainable map (a submodule; its parameters are the layer's), or ``None`` with an estimator.
    feature_state : nn.Module
        The estimator's fitted values as buffers.
    q_proj, k_proj, v_proj, out_proj : nn.Linear
    """

    def __init__(self, embed_dim: int, num_heads: int, estimator: str = "positive_orthogonal",
                 num_features: int | None = None, mode: str = "chunked", causal: bool = False, rng=None, *,
                 num_kv_heads: int | None = None, chunk_size: int = 64, qk_dim: int | None = None,
                 refit_every: int | None = None, rule="sum", bias: bool = True, out_bias: bool | None = None,
                 dropout: float = 0.0, pos_hook=None, scale: float | None = None, device=None, dtype=None,
                 **options):
        super().__init__()
        self.embed_dim = check_positive_int(embed_dim, "embed_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})")
        self.num_kv_heads = num_heads if num_kv_heads is None else check_positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): each key/value head "
                             "serves a group of query heads")
        self.head_dim = embed_dim // num_heads
        self.qk_dim = self.head_dim if qk_dim is None else check_positive_int(qk_dim, "qk_dim")
        check_choice(mode, "mode", MODES)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {bias!r}")
        out_bias = bias if out_bias is None else check_bool(out_bias, "out_bias")
        self._bias, self._out_bias = bias, out_bias
        self.feature_map = None
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        if pos_hook is not None and not callable(pos_hook):
            raise TypeError(f"pos_hook must be callable as pos_hook(q, k, positions) -> (q, k), got {pos_hook!r}")
        self.pos_hook = pos_hook
        if is_trainable_map(estimator) or (isinstance(estimator, str) and estimator in TRAINABLE_MAP_NAMES):
            self._init_map(estimator, num_features, mode, causal, rng, refit_every, rule, scale, device, dtype,
                           options)
            return
        if num_features is not None and isinstance(estimator, str) and estimator in _registered() and \
                _is_fixed_feature_map(capabilities(estimator, **options)):
            # a fixed-dimension map takes its own dimension; any other value is refused before anything is built
            dim = make_estimator(estimator, rng=0, **options).fit(torch.zeros(1, self.qk_dim)).num_features
            if num_features != dim:
                raise ValueError(f"num_features={num_features!r} cannot be honoured: estimator {estimator!r} has a "
                                 f"fixed dimension, {dim} at qk_dim={self.qk_dim}; pass num_features=None (or "
                                 f"{dim}), or choose qk_dim to set the dimension")
        weight_rng, feature_rng = as_generator(rng).spawn(2)
        self._feature_rng = feature_rng
        self._dropout_rng = weight_rng.spawn(1)[0]   # spawning does not advance weight_rng's draws
        self.estimator_name = estimator
        self.estimator = make_estimator(estimator, num_features=num_features, rng=feature_rng, scale=scale,
                                        **options)
        caps = self.estimator.capabilities()
        if mode not in caps.modes:
            raise ValueError(f"mode {mode!r} is not supported by estimator {estimator!r}; supported: "
                             f"{', '.join(caps.modes)}")
        if causal and not caps.causal:
            raise ValueError(f"estimator {estimator!r} does not support causal attention")
        self.mode = mode
        self.causal = causal
        self.rule = resolve_rule(rule)
        if self.rule.name not in caps.rules:
            raise ValueError(f"rule {self.rule.name!r} is not supported by estimator {estimator!r}; supported: "
                             f"{', '.join(caps.rules)}")
        if not causal and not self.rule.noncausal:
            raise ValueError(f"the {self.rule.name} rule is causal only: use causal=True")
        if refit_every is not None:
            check_positive_int(refit_every, "refit_every")
            if not caps.data_dependent:
                raise ValueError(f"refit_every applies to data-dependent estimators; {estimator!r} is fitted from "
                                 "its seed alone (use redraw() for a new draw of random features)")
        self.refit_every = refit_every
        self._training_forwards = 0                  # training-mode forward calls (the refit clock)
        self._fitted_projections = None              # version fingerprint of q_proj/k_proj at the last fit
        self._warned = set()
        # skip_init: nn.Linear's own initialisation would draw from torch's global RNG
        device = torch.get_default_device() if device is None else check_device(device)
        kv = self.num_kv_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.utils.skip_init(nn.Linear, embed_dim, width, bias=has_bias, dtype=dtype, device=device)
            for width, has_bias in ((num_heads * self.qk_dim, bias), (kv * self.qk_dim, bias),
                                    (kv * self.head_dim, bias), (embed_dim, out_bias)))
        self._init_projections(weight_rng)
        self.feature_state = _FittedState()
        self._signature = None
        self.register_load_state_dict_post_hook(KernelAttention._after_load)
        if not self.estimator.capabilities().data_dependent:
            self._fit_estimator(torch.zeros(1, self.qk_dim, dtype=torch.float64), None)

    def _init_map(self, estimator, num_features, mode, causal, rng, refit_every, rule, scale, device, dtype,
                  options) -> None:
        """The rest of ``__init__`` for a trainable map (see the module docstring)."""
        if refit_every is not None:
            raise ValueError("refit_every applies to data-dependent estimators; a trainable map trains with the model")
        if scale is not None:
            raise ValueError("scale applies to estimators of exp(s·qᵀk); a trainable map's W_h carries its own scale")
        if self.dropout:
            raise ValueError("dropout is not supported with a trainable map (dropout=0)")
        self.rule = resolve_rule(rule)
        if self.rule.name not in ("sum", "decay"):
            raise ValueError(f"rule {self.rule.name!r} is not supported with a trainable map; supported: sum, decay")
        if not causal and not self.rule.noncausal:
            raise ValueError(f"the {self.rule.name} rule is causal only: use causal=True")
        self.mode = mode
        self.causal = causal
        self.refit_every = None
        weight_rng, feature_rng = as_generator(rng).spawn(2)
        self._feature_rng = feature_rng
        self._dropout_rng = weight_rng.spawn(1)[0]
        device = torch.get_default_device() if device is None else check_device(device)
        from ..trainable import make_map

        if is_trainable_map(estimator):
            if num_features is not None or options:
                raise ValueError("num_features and map options describe a map to build; the given map is built")
            if estimator.head_dim != self.qk_dim:
                raise ValueError(f"the feature map's head_dim = {estimator.head_dim} is not the layer's qk_dim = "
                                 f"{self.qk_dim}")
            if estimator.num_heads not in (self.num_heads, self.num_kv_heads):
                raise ValueError(f"the feature map has num_heads = {estimator.num_heads}; it must be the layer's "
                                 f"query heads ({self.num_heads}) or key/value heads ({self.num_kv_heads})")
            fmap, name = estimator, type(estimator).__name__
        else:
            fmap = make_map(estimator, num_heads=self.num_kv_heads, head_dim=self.qk_dim, num_features=num_features,
                            rng=feature_rng, dtype=dtype, device=device, **options)
            name = estimator
        self.estimator_name = name
        self.estimator = None
        kv = self.num_kv_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.utils.skip_init(nn.Linear, self.embed_dim, width, bias=has_bias, dtype=dtype, device=device)
            for width, has_bias in ((self.num_heads * self.qk_dim, self._bias), (kv * self.qk_dim, self._bias),
                                    (kv * self.head_dim, self._bias), (self.embed_dim, self._out_bias)))
        self._init_projections(weight_rng)
        self.feature_map = fmap
        self.feature_state = _FittedState()
        self._signature = None
        self._training_forwards = 0
        self._fitted_projections = None
        self._warned = set()

    # ------------------------------------------------------------------------------------------ set-up
    @torch.no_grad()
    def _init_projections(self, rng: np.random.Generator) -> None:
        """Xavier-uniform weights (as ``nn.MultiheadAttention``'s input projection) and zero biases."""
        for layer in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            bound = math.sqrt(6.0 / (layer.in_features + layer.out_features))
            layer.weight.copy_(torch.from_numpy(rng.uniform(-bound, bound, size=tuple(layer.weight.shape))))
            if layer.bias is not None:
                layer.bias.zero_()

    @property
    def fitted(self) -> bool:
        """Whether the estimator has been fitted (always true for data-independent estimators)."""
        return bool(getattr(self.estimator, "fitted_", False))

    def _fit_estimator(self, q, k) -> None:
        self.estimator.fit(q, k)
        device = next(self.parameters()).device
        self.feature_state.capture(self.estimator)
        self.feature_state.to(device)
        self._signature = None
        self._fitted_projections = self._projection_versions()
        self._warned.discard("stale")

    def _projection_versions(self) -> tuple:
        """Identity and version counter of every parameter of the query and key projections: it changes with any
        in-place update (an optimizer step, ``load_state_dict``), not with a move or cast (``.to``)."""
        return tuple((id(p), p._version) for layer in (self.q_proj, self.k_proj) for p in layer.parameters())

    @staticmethod
    def _after_load(module, incompatible_keys) -> None:
        """After ``load_state_dict``: projections and fitted map come from one checkpoint, so the map is current."""
        if module.fitted:
            module._fitted_projections = module._projection_versions()
            module._sync()                 # the loaded map, before a compiled forward (which does not sync)

    def _warn_once(self, cause: str, message: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(message, UserWarning, stacklevel=6)    # the caller of the layer (through nn.Module)

    def _apply_refit_policy(self, q, k) -> None:
        """Fit, refit or warn before a forward call (data-dependent estimators only; see the module docstring)."""
        if self.training and self.refit_every is not None:
            if not self.fitted or self._training_forwards % self.refit_every == 0:
                with torch.no_grad():
                    self._fit_estimator(q.detach(), k.detach())
            self._training_forwards += 1
            return
        if not self.fitted:
            self._warn_once("unfitted", f"KernelAttention: the data-dependent estimator {self.estimator_name!r} "
                            "was not fitted; it is fitted now on this batch's projected queries and keys and kept. "
                            "Call fit(calibration) first, or pass refit_every=k to refit it while training")
            with torch.no_grad():
                self._fit_estimator(q.detach(), k.detach())
        elif (self.refit_every is None                 # with a refit policy the lag is the policy's (docstring)
              and not torch.compiler.is_compiling()    # a warning only: its version counters are not traceable
              and self._fitted_projections is not None and self._projection_versions() != self._fitted_projections):
            self._warn_once("stale", f"KernelAttention: the data-dependent estimator {self.estimator_name!r} was "
                            "fitted on query/key projections that have changed since (an optimizer step or an "
                            "in-place edit): the map is stale. Pass refit_every=k to refit it while training, or "
                            "call fit(calibration) after training")

    def _sync(self) -> None:
        # Traced by torch.compile, the buffers' storage and version counters are not visible: the estimator is
        # synced eagerly instead, whenever the buffers can change outside a forward call (fitting, loading,
        # moving or casting the layer: _apply below) and by the first eager call after an in-place edit.
        if torch.compiler.is_compiling():
            return
        signature = self.feature_state.signature()
        if signature != self._signature:
            self.feature_state.restore(self.estimator)
            self._signature = signature

    def _apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.double``, ...), then the estimator synced to the moved or
        cast buffers (for a compiled forward, which does not sync; :meth:`_sync`)."""
        out = super()._apply(fn, *args, **kwargs)
        if "feature_state" in self._modules and "_signature" in self.__dict__ and self.fitted:
            self._sync()
        return out

    def _split_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        batch, n, width = x.shape
        heads = self.num_heads if heads is None else heads
        return x.reshape(batch, n, heads, width // heads).transpose(1, 2)   # (b, h, n, dim)

    def _project(self, query, key, value):
        """The heads ``q (B, H, n_q, qk_dim)``, ``k (B, H_kv, n_k, qk_dim)``, ``v (B, H_kv, n_k, head_dim)``."""
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            check_tensor(x, name, finite=False)
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} must have shape (batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError("query, key and value must share the batch size")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value must have the same length, got {key.shape[1]} and {value.shape[1]}")
        weight = self.q_proj.weight
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.device != weight.device:
                raise ValueError(f"{name} is on {x.device} but the layer's weights are on {weight.device}; "
                                 "move one of them with .to()")
            if x.dtype != weight.dtype and autocast_dtype(x.device.type) is None:
                raise TypeError(f"{name} has dtype {x.dtype} but the layer's weights are {weight.dtype}; cast one "
                                "of them or run under torch.autocast")
        kv = self.num_kv_heads
        return (self._split_heads(self.q_proj(query)), self._split_heads(self.k_proj(key), kv),
                self._split_heads(self.v_proj(value), kv))

    def _positions(self, q, k, positions, cross: bool):
        """The positional hook applied to the projected heads (identity without one)."""
        if self.pos_hook is None:
            if positions is not None:
                raise ValueError("positions are given but the layer has no pos_hook to use them")
            return q, k
        if cross:
            raise ValueError("a pos_hook applies to self-attention (key and value omitted): queries and keys share "
                             "the positions")
        batch, _, n, _ = q.shape
        if positions is None:
            positions = torch.arange(n, device=q.device).expand(batch, n)
        else:
            if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or \
                    positions.dtype == torch.bool:
                raise TypeError("positions must be an integer torch.Tensor of shape (batch, n) or (n,)")
            if positions.dim() == 1:
                positions = positions[None]
            if positions.dim() != 2 or positions.shape[-1] != n or positions.shape[0] not in (1, batch):
                raise ValueError(f"positions must have shape (batch, n) = {(batch, n)} or (n,), got "
                                 f"{tuple(positions.shape)}")
            positions = positions.to(device=q.device, dtype=torch.int64).expand(batch, n)
        out = self.pos_hook(q, k, positions)
        if not (isinstance(out, tuple) and len(out) == 2 and out[0].shape == q.shape and out[1].shape == k.shape):
            raise TypeError("pos_hook(q, k, positions) must return (q, k) of the shapes it was given")
        return out

    def _heads(self, query, key, value, positions):
        q, k, v = self._project(query, key, value)
        q, k = self._positions(q, k, positions, key is not None or value is not None)
        return q, k, v

    # ------------------------------------------------------------------------------------- public API
    @torch.no_grad()
    def fit(self, query: torch.Tensor, key: torch.Tensor | None = None, *, positions=None, rng=None) -> KernelAttention:
        """Fit the estimator on a calibration batch: ``query`` (and ``key``) are ``(batch, seq, embed_dim)``
        layer inputs, projected by the current ``q_proj``/``k_proj`` (and the ``pos_hook`` at ``positions``, as in
        :meth:`forward`). Draws from ``rng`` when given (which then becomes the layer's feature stream), else
        continues the layer's stream. Returns ``self``."""
        self._refuse_for_map("fit")
        if rng is not None:
            self._feature_rng = as_generator(rng)
        q, k, _ = self._heads(query, key, None, positions)
        self.estimator.rng = self._feature_rng
        self._fit_estimator(q.detach(), repeat_kv(k.detach(), self.num_heads // self.num_kv_heads))
        return self

    def redraw(self, rng=None) -> KernelAttention:
        """A new draw of the random features (data-independent estimators; use :meth:`fit` for the others).

        With ``rng`` the draw comes from ``as_generator(rng)``, which becomes the layer's feature stream (so
        ``redraw(5)`` is reproducible); without, the layer's stream continues. Returns ``self``.
        """
        self._refuse_for_map("redraw")
        if self.estimator.capabilities().data_dependent:
            raise ValueError(f"estimator {self.estimator_name!r} is data-dependent: redraw it with fit(calibration)")
        if rng is not None:
            self._feature_rng = as_generator(rng)
        self.estimator.rng = self._feature_rng
        self._fit_estimator(torch.zeros(1, self.qk_dim, dtype=torch.float64), None)
        return self

    def _refuse_for_map(self, what: str) -> None:
        if self.feature_map is not None:
            raise ValueError(f"{what}() applies to estimators; the trainable map {self.estimator_name!r} trains with "
                             "the model (attention transfer: kernapprox.trainable.fit_to_softmax on its feature_map)")

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None, *,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                query_padding_mask: torch.Tensor | None = None, causal: bool | None = None, positions=None,
                return_state: bool = False):
        """``(batch, n_q, E)``, optional ``key``/``value`` ``(batch, n_k, E)`` (self-attention when omitted)
        → ``(batch, n_q, E)``.

        Parameters
        ----------
        key_padding_mask : bool Tensor ``(batch, n_k)``, optional
            **True = padding** (the key takes no part), as ``torch.nn.MultiheadAttention``. Every mode.
        attn_mask : Tensor ``(n_q, n_k)``, ``(batch, n_q, n_k)`` or ``(batch, num_heads, n_q, n_k)``, optional
            bool with **True = takes part** (SDPA's convention — the opposite of ``nn.MultiheadAttention``'s bool
            mask), or floating, added to the logits (``-inf`` excludes; cast to the attention dtype). Combined
            with ``causal``; a query left without any key raises ``ValueError``. Exact attention and the parallel
            mode only (other modes raise, saying why).
        query_padding_mask : bool Tensor ``(batch, n_q)``, optional
            **True = the query is padding**: its output row is the output projection's bias (attention output 0)
            and it needs no key. Left-padded self-attention passes the same mask here and as
            ``key_padding_mask``. Every mode.
        causal : bool, optional
            This call's causality (default: the layer's ``causal``).
        positions : integer Tensor ``(batch, n_q)`` or ``(n_q,)``, optional
            The positions the ``pos_hook`` sees (default ``arange(n_q)``); e.g. ``cumsum(~pad) − 1`` for left
            padding, so that each sequence starts at position 0.
        return_state : bool
            Causal self-attention with a feature map: also return the :class:`~kernapprox.RecurrentState` after
            the whole sequence (one state per batch element and query head; padded keys left out; float32 under
            autocast), to continue token by token with :meth:`step` (prefill, then decode): the state of
            :func:`~kernapprox.nn.functional.kernel_attention` handed to a ``RecurrentState`` with the layer's rule.
            With ``estimator="exact"`` the state is the KV cache (:class:`~kernapprox.attention.decode.KVCache`,
            the same calls and ``state_bytes``), so the softmax baseline of a decoding comparison is the same code;
            with a hybrid (``window_linear``, ``scatterbrain``) it is its fixed-size window + linear state
            (:class:`~kernapprox.attention.decode.EstimatorStateCache`).

        Data-dependent estimators are fitted or refitted first, as the refit policy says (module docstring).
        Dropout (``dropout > 0``) applies in training mode only.
        """
        if not isinstance(return_state, bool):
            raise TypeError(f"return_state must be a bool, got {return_state!r}")
        causal = self._check_causal(causal)
        if return_state:
            self._check_decodable(key, value, causal)
        q, k, v = self._heads(query, key, value, positions)
        masks = self._masks(key_padding_mask, attn_mask, query_padding_mask, q, k)
        if self.feature_map is not None:
            q, k, v = _common_dtype(q, k, v)
            from ..trainable import feature_attention

            out = feature_attention(q, k, v, self.feature_map, causal=causal, mode=self.mode,
                                    chunk_size=self.chunk_size, rule=self.rule, return_state=return_state, **masks)
            out, state = out if return_state else (out, None)
            batch, _, n_q, _ = out.shape
            out = self.out_proj(out.transpose(1, 2).reshape(batch, n_q, self.embed_dim))
            return (out, MapState(self.feature_map, self.rule, state)) if return_state else out
        caps = self.estimator.capabilities()
        if caps.data_dependent:
            self._apply_refit_policy(q, repeat_kv(k, self.num_heads // self.num_kv_heads))
        self._sync()
        dropout = self.dropout if self.training else 0.0
        if return_state and caps.kind != "features":   # the exact kernel's KV cache, a hybrid's window + linear state
            return self._cache_prefill(q, k, v, masks, dropout)
        out = kernel_attention(q, k, v, self.estimator, causal=causal, mode=self.mode, chunk_size=self.chunk_size,
                               rule=self.rule, dropout_p=dropout, training=self.training,
                               rng=self._dropout_rng if dropout else None, return_state=return_state, **masks)
        state = None
        if return_state:
            out, state = out                                                   # out: (b, h, n_q, head_dim)
        batch, _, n_q, _ = out.shape
        out = self.out_proj(out.transpose(1, 2).reshape(batch, n_q, self.embed_dim))
        if not return_state:
            return out
        return out, RecurrentState(self.estimator, rule=self.rule, initial_state=state)

    def _cache_prefill(self, q, k, v, masks, dropout):
        """``forward(..., return_state=True)`` of an estimator that is not a feature map: the prompt's causal
        attention through its decoding cache (:func:`~kernapprox.attention.decode.decode_cache`: the exact kernel's
        :class:`~kernapprox.attention.decode.KVCache`, a hybrid's
        :class:`~kernapprox.attention.decode.EstimatorStateCache`), which :meth:`step` then extends."""
        if "attn_mask" in masks:
            raise ValueError("return_state with an attn_mask: a decoding cache continues causal attention over every "
                             "earlier key (use key_padding_mask / query_padding_mask)")
        if dropout:
            raise ValueError("return_state in training with dropout > 0: decoding runs without dropout (call "
                             "layer.eval() first)")
        groups = self.num_heads // self.num_kv_heads
        cache = decode_cache(self.estimator)
        out = cache.prefill(q, repeat_kv(k, groups), repeat_kv(v, groups), **masks)
        batch, _, n_q, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, n_q, self.embed_dim)), cache

    def _check_causal(self, causal) -> bool:
        if causal is None:
            return self.causal
        check_bool(causal, "causal")
        if self.feature_map is not None:
            if not causal and not self.rule.noncausal:
                raise ValueError(f"the {self.rule.name} rule is causal only: call with causal=True")
            return causal
        if causal and not self.estimator.capabilities().causal:
            raise ValueError(f"estimator {self.estimator_name!r} does not support causal attention")
        if not causal and not self.rule.noncausal:
            raise ValueError(f"the {self.rule.name} rule is causal only: call with causal=True")
        return causal

    # ---------------------------------------------------------------------------------------------- decoding
    def _check_decodable(self, key, value, causal) -> None:
        if key is not None or value is not None:
            raise ValueError("return_state needs self-attention (key and value omitted): the state continues the "
                             "sequence that step() extends")
        if not causal:
            raise ValueError("return_state needs causal attention (causal=True, in the layer or the call): a "
                             "non-causal layer has no state that a next token could extend")
        if self.feature_map is not None:
            return
        caps = self.estimator.capabilities()
        if caps.kind == "exact":                     # a KV cache (kernapprox.attention.decode.KVCache)
            return
        if not caps.decode_state or caps.query_dependent or "recurrent" not in caps.modes:
            raise ValueError(f"estimator {self.estimator_name!r} has no fixed-size recurrent state (kind "
                             f"{caps.kind!r}); decoding with step() needs a feature map, an estimator that declares "
                             "decode_state (the hybrids) or the exact kernel (a KV cache)")

    def step(self, x: torch.Tensor, state: RecurrentState, *, position=None) -> torch.Tensor:
        """One decoding step: ``x`` ``(batch, E)`` (or ``(batch, 1, E)``), the next token's layer input, is added
        to ``state`` (from ``forward(..., return_state=True)``, updated in place) and read with its own query;
        returns the layer output for that token, of ``x``'s shape. Equal to the last row of ``forward`` on the
        sequence extended by ``x`` (tested, left-padded prompts included). ``position`` (an int or an integer
        tensor ``(batch,)``): the token's position for the ``pos_hook``, required with one. The estimator is
        never refitted here; under autocast the state stays float32."""
        if self.feature_map is not None:
            if not isinstance(state, MapState) or state.feature_map is not self.feature_map:
                raise TypeError("state must be the MapState returned by this layer's forward(..., return_state=True)")
        elif isinstance(state, DecodeCache):
            if state.estimator is not self.estimator:
                raise TypeError("state must be the decoding cache returned by this layer's forward(..., "
                                "return_state=True)")
        elif not isinstance(state, RecurrentState) or state.estimator is not self.estimator or \
                state.rule.name != self.rule.name:
            raise TypeError("state must be the RecurrentState returned by this layer's forward(..., "
                            "return_state=True)")
        check_tensor(x, "x", min_rank=2, finite=False)
        single = x.dim() == 3
        if single and x.shape[1] != 1:
            raise ValueError(f"x must be one token, (batch, E) or (batch, 1, E); got shape {tuple(x.shape)}")
        x3 = x if single else x[:, None, :]
        positions = None
        if self.pos_hook is not None:
            if position is None:
                raise ValueError("step() of a layer with a pos_hook needs the token's position= (an int, or an "
                                 "integer tensor (batch,))")
            positions = torch.as_tensor(position, device=x.device).reshape(-1, 1)
        elif position is not None:
            raise ValueError("position is given but the layer has no pos_hook to use it")
        q, k, v = self._heads(x3, None, None, positions)                # (b, h | h_kv, 1, dim)
        if self.feature_map is not None:               # the map's state continued by one causal token
            q, k, v = _common_dtype(q, k, v)
            from ..trainable import feature_attention

            y, state.state = feature_attention(q, k, v, self.feature_map, causal=True, mode="recurrent",
                                               rule=self.rule, initial_state=state.state, return_state=True)
            out = self.out_proj(y[..., 0, :].reshape(y.shape[0], self.embed_dim))
            return out[:, None, :] if single else out
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        self._sync()
        if isinstance(state, DecodeCache):             # the exact kernel's KV cache or a hybrid's state: one token
            y = state.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
            out = self.out_proj(y.reshape(y.shape[0], self.embed_dim))
            return out[:, None, :] if single else out
        low = autocast_dtype(x.device.type)
        if low is not None:                       # the state's arithmetic in float32, as in forward
            with torch.autocast(x.device.type, enabled=False):
                y = state.step(q[..., 0, :].to(low), k[..., 0, :].to(low), v[..., 0, :].to(low))
        else:
            y = state.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])       # (b, h, head_dim)
        out = self.out_proj(y.reshape(y.shape[0], self.embed_dim))
        return out[:, None, :] if single else out

    def _masks(self, key_padding_mask, attn_mask, query_padding_mask, q, k) -> dict:
        """The layer's masks in the ``(batch, heads, n_q, n_k)`` layout of the functional calls."""
        batch, _, n_q, _ = q.shape
        n_k = k.shape[-2]
        masks = {}
        for name, mask, length in (("key_padding_mask", key_padding_mask, n_k),
                                   ("query_padding_mask", query_padding_mask, n_q)):
            if mask is None:
                continue
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
            n = "n_k" if name == "key_padding_mask" else "n_q"
            if mask.shape != (batch, length):
                raise ValueError(f"{name} must have shape (batch, {n}) = {(batch, length)}, got "
                                 f"{tuple(mask.shape)}")
            masks[name] = mask[:, None, :]                                           # (b, 1, n): every head
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
            if attn_mask.dim() == 3:
                attn_mask = attn_mask[:, None]                                       # (b, 1, n_q, n_k)
            elif attn_mask.dim() not in (2, 4):
                raise ValueError("attn_mask must be (n_q, n_k), (batch, n_q, n_k) or (batch, num_heads, n_q, n_k), "
                                 f"got shape {tuple(attn_mask.shape)}")
            if attn_mask.dtype != torch.bool and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(q.dtype)
            masks["attn_mask"] = attn_mask
        return masks

    # ---------------------------------------------------------------------------------------- state dict
    def get_extra_state(self) -> dict:
        """The estimator's identity, saved in ``state_dict`` under ``"_extra_state"``: its registry name and its
        constructor parameters (``num_features``, ``scale``, options; not ``rng``), and the per-head dimension
        the map is fitted for. ``load_state_dict`` refuses a state whose record differs."""
        if self.feature_map is not None:         # the map's parameters are in the state_dict; its shape here
            fmap = self.feature_map
            params = {"num_heads": fmap.num_heads, "feature_dim": fmap.feature_dim,
                      "num_features": fmap.num_features, "bias": fmap.bias is not None}
            return {"estimator": self.estimator_name, "params": params, "head_dim": self.qk_dim}
        params = {name: _plain(value) for name, value in self.estimator.get_params().items() if name != "rng"}
        return {"estimator": self.estimator_name, "params": params, "head_dim": self.qk_dim}   # the map's input d

    def set_extra_state(self, state) -> None:
        """Nothing to set: the record is checked against this layer's own estimator while loading."""

    def _check_record(self, record, key, error_msgs) -> bool:
        mine = self.get_extra_state()
        if not isinstance(record, dict) or set(record) != set(mine):
            error_msgs.append(f"estimator mismatch for {key}: expected a record {{estimator, params, head_dim}} "
                              f"from checkpoint, received {record!r}.")
            return False
        if record != mine:
            def describe(rec):
                params = ", ".join(f"{k}={v!r}" for k, v in rec["params"].items())
                return f"{rec['estimator']!r} ({params}; head_dim={rec['head_dim']})"

            error_msgs.append(f"estimator mismatch for {key}: copying the state of estimator {describe(record)} from "
                              f"checkpoint, the estimator in current model is {describe(mine)}.")
            return False
        return True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        record_key = prefix + "_extra_state"
        if record_key in state_dict and not self._check_record(state_dict[record_key], record_key, error_msgs):
            # Another estimator's state: reported (load_state_dict raises with every message); none of it is loaded.
            self.feature_state.skip_next_load = True
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            return
        if not self.fitted and any(key.startswith(prefix + "feature_state.") for key in state_dict):
            # Build the fitted structure (attribute names, nested estimators) from a throw-away fit on
            # placeholder data from its own generator, so the layer's stream is not consumed; every value is
            # then replaced by the state dict's.
            size = max(64, self.estimator.get_params()["num_features"] or 0)
            placeholder = torch.from_numpy(np.random.default_rng(0).standard_normal((1, size, self.qk_dim)))
            stream = self.estimator.rng
            self.estimator.rng = np.random.default_rng(0)
            self._fit_estimator(placeholder, placeholder)
            self.estimator.rng = stream
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if record_key not in state_dict and record_key in missing_keys:
            missing_keys.remove(record_key)   # a state saved before the record existed: shape checks only

    def extra_repr(self) -> str:
        r = (self.feature_map.num_features if self.feature_map is not None
             else self.estimator.get_params()["num_features"])
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, estimator={self.estimator_name!r}, "
                f"num_features={r}, mode={self.mode!r}, causal={self.causal}"
                + (f", qk_dim={self.qk_dim}" if self.qk_dim != self.head_dim else "")
                + (f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else "")
                + (f", dropout={self.dropout:g}" if self.dropout else ""))
