"""A small causal Transformer whose attention is pluggable per layer: exact softmax or any registry estimator.

Architecture (GPT-2-like, pre-norm): token embedding (or a linear read-in of vectors) plus learned position
embeddings, ``L`` blocks ``x ← x + Attn(LN(x))`` and, when ``mlp``, ``x ← x + MLP(LN(x))`` (GELU, width
``mlp_ratio·E``), a final LayerNorm and a linear read-out. No dropout: the forward pass is a deterministic function
of the weights.

Attention is built per layer from an :class:`AttentionSpec` by an *attention factory* named in the spec
(``kind``). The registered kind ``"kernel"`` is :class:`kernapprox.nn.KernelAttention` (causal): with
``estimator="exact"`` it is softmax attention, with any other registry name the estimator's linear or hybrid
attention. Other mixers (e.g. a delta-rule layer) plug in through :func:`register_attention`; the spec, kind
included, is part of the model's configuration and of its cache key.

Randomness: every weight is drawn from a numpy ``Generator`` (float64, then cast), spawned per module from the
model's ``rng``; torch's global RNG is never used, so one seed is one initialisation everywhere.

>>> import torch
>>> config = ModelConfig(d_model=32, num_layers=2, num_heads=2, max_len=16)
>>> model = CausalTransformer(config, vocab_size=16, output_dim=16, rng=0)
>>> model(torch.zeros(3, 10, dtype=torch.int64)).shape
torch.Size([3, 10, 16])
>>> swapped = substitute(model, {1: AttentionSpec("positive_orthogonal", num_features=64)}, rng=1)
>>> swapped.layer_specs()[1].estimator
'positive_orthogonal'
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..estimators.registry import TRAINABLE_MAP_NAMES, available_estimators
from ..nn import KernelAttention
from ..validation import as_generator, check_bool, check_positive_float, check_positive_int

__all__ = ["AttentionSpec", "ModelConfig", "CausalTransformer", "register_attention", "attention_kinds",
           "substitute", "record_attention_inputs", "attention_heads", "project_heads"]


# ----------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends.

    Parameters
    ----------
    estimator : str
        Registry name (``"exact"``: softmax attention).
    num_features : int, optional
        ``r`` of the estimator. Fixed-dimension maps such as ``taylor2`` and ``elu1`` take ``None`` (their own
        dimension, set by ``qk_dim``); another value raises, naming the dimension they have.
    qk_dim : int, optional
        Per-head query/key dimension (default ``d_model / num_heads``); with a fixed-dimension map it sets the
        feature dimension, as Based's projection before its Taylor map.
    mode : str
        Linear-attention mode (``"chunked"``, ``"parallel"`` or ``"recurrent"``).
    options : tuple of (name, value)
        Further estimator options (JSON values), e.g. ``(("window", 8),)``.
    rule : str
        The state-update rule of linear attention (:mod:`kernapprox.rules`; ``"sum"``: plain linear attention).
        Delta-rule and least-squares models belong to the state-rule studies; nothing here calibrates them.
    kind : str
        The attention factory (:func:`register_attention`); ``"kernel"`` is :class:`KernelAttention`.
    """

    estimator: str = "exact"
    num_features: int | None = None
    qk_dim: int | None = None
    mode: str = "chunked"
    options: tuple = ()
    rule: str = "sum"
    kind: str = "kernel"

    def __post_init__(self):
        if not isinstance(self.estimator, str):
            raise TypeError(f"estimator must be a registry name, got {self.estimator!r}")
        for name in ("num_features", "qk_dim"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if isinstance(self.options, Mapping):
            object.__setattr__(self, "options", tuple(sorted(self.options.items())))
        if not isinstance(self.options, tuple) or not all(isinstance(o, tuple) and len(o) == 2 for o in self.options):
            raise TypeError(f"options must be a tuple of (name, value) pairs or a dict, got {self.options!r}")
        json.dumps(self.options)                                                  # JSON values only
        for name in ("rule", "kind"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "options": [list(o) for o in self.options]}

    @classmethod
    def from_dict(cls, data: Mapping) -> AttentionSpec:
        return cls(**{**data, "options": tuple(tuple(o) for o in data.get("options", ()))})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`CausalTransformer`.

    Parameters
    ----------
    d_model, num_layers, num_heads : int
        Width ``E``, depth ``L`` and heads ``H`` (``H`` divides ``E``).
    mlp : bool
        Blocks with an MLP after the attention (``False``: attention-only blocks).
    mlp_ratio : int
        MLP width ``mlp_ratio · E``.
    max_len : int
        Learned positions.
    attention : AttentionSpec or tuple of AttentionSpec
        One spec for every layer, or one per layer.
    chunk_size : int
        Chunk length of the chunked linear-attention mode.
    embed_std : float
        Standard deviation of the token and position embeddings at initialisation.
    short_conv : int
        Kernel size of a causal depthwise convolution sublayer ``x ← x + Conv(LN(x))`` at the start of every
        block (0: none). Zoology's and Based's fixed-state models carry one (kernel 3): it shifts tokens, which
        a softmax head does by attending sharply to the previous position and a smooth kernel cannot.
    """

    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    mlp: bool = False
    mlp_ratio: int = 4
    max_len: int = 64
    attention: AttentionSpec | tuple = AttentionSpec()
    chunk_size: int = 64
    embed_std: float = 0.02
    short_conv: int = 0

    def __post_init__(self):
        check_positive_float(self.embed_std, "embed_std")
        for name in ("d_model", "num_layers", "num_heads", "mlp_ratio", "max_len", "chunk_size"):
            check_positive_int(getattr(self, name), name)
        check_bool(self.mlp, "mlp")
        if isinstance(self.short_conv, bool) or not isinstance(self.short_conv, int) or self.short_conv < 0:
            raise ValueError(f"short_conv must be a non-negative int, got {self.short_conv!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide d_model ({self.d_model})")
        specs = self.attention if isinstance(self.attention, tuple) else (self.attention,)
        if not all(isinstance(s, AttentionSpec) for s in specs):
            raise TypeError("attention must be an AttentionSpec or a tuple of them")
        if len(specs) not in (1, self.num_layers):
            raise ValueError(f"attention must hold 1 or num_layers={self.num_layers} specs, got {len(specs)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def layer_specs(self) -> tuple[AttentionSpec, ...]:
        """One :class:`AttentionSpec` per layer."""
        specs = self.attention if isinstance(self.attention, tuple) else (self.attention,)
        return specs * self.num_layers if len(specs) == 1 else specs

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "attention"}
        out["attention"] = [s.to_dict() for s in self.layer_specs()]
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> ModelConfig:
        specs = tuple(AttentionSpec.from_dict(s) for s in data["attention"])
        return cls(**{**data, "attention": specs})


# ------------------------------------------------------------------------------------- attention factories
# kind -> factory(spec, *, d_model, num_heads, chunk_size, rng) -> nn.Module mapping (B, n, E) -> (B, n, E), causal
_FACTORIES: dict[str, Callable] = {}


def register_attention(kind: str, factory: Callable) -> None:
    """Register an attention factory ``factory(spec, *, d_model, num_heads, chunk_size, rng) -> nn.Module``.

    The module maps ``(batch, n, d_model)`` to the same shape, causally. A layer built by another kind than
    ``"kernel"`` must carry the projections ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` to take part in
    :func:`substitute` and :func:`attention_heads`. This is the hook for mixers outside the estimator registry
    (e.g. a mixer outside the estimator protocol); nothing is registered under other kinds here.
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    if kind in _FACTORIES:
        raise ValueError(f"attention kind {kind!r} is already registered")
    if not callable(factory):
        raise TypeError("factory must be callable")
    _FACTORIES[kind] = factory


def attention_kinds() -> list[str]:
    return sorted(_FACTORIES)


def _kernel_attention(spec: AttentionSpec, *, d_model: int, num_heads: int, chunk_size: int, rng) -> nn.Module:
    """:class:`KernelAttention` of a registry estimator or of a trainable map (:data:`kernapprox.trainable.MAPS`:
    its parameters are the layer's, trained with the model)."""
    known = [*available_estimators(), *TRAINABLE_MAP_NAMES]
    if spec.estimator not in known:
        raise ValueError(f"unknown estimator {spec.estimator!r}; available: {', '.join(known)}")
    return KernelAttention(d_model, num_heads, spec.estimator, num_features=spec.num_features, mode=spec.mode,
                           causal=True, rng=rng, chunk_size=chunk_size, qk_dim=spec.qk_dim, rule=spec.rule,
                           **dict(spec.options))


register_attention("kernel", _kernel_attention)


def _build_attention(spec: AttentionSpec, config: ModelConfig, rng) -> nn.Module:
    if spec.kind not in _FACTORIES:
        raise ValueError(f"unknown attention kind {spec.kind!r}; registered: {', '.join(attention_kinds())}")
    return _FACTORIES[spec.kind](spec, d_model=config.d_model, num_heads=config.num_heads,
                                 chunk_size=config.chunk_size, rng=rng)


# ------------------------------------------------------------------------------------------------- model
def _linear(rng: np.random.Generator, fan_in: int, fan_out: int, bias: bool = True) -> nn.Linear:
    """``nn.Linear`` with Xavier-uniform weights from ``rng`` and zero bias (no draw from torch's RNG)."""
    layer = nn.utils.skip_init(nn.Linear, fan_in, fan_out, bias=bias)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(rng.uniform(-bound, bound, size=(fan_out, fan_in))))
        if bias:
            layer.bias.zero_()
    return layer


def _embedding(rng: np.random.Generator, rows: int, dim: int, std: float) -> nn.Embedding:
    emb = nn.utils.skip_init(nn.Embedding, rows, dim)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(rng.normal(0.0, std, size=(rows, dim))))
    return emb


class ShortConv(nn.Module):
    """Causal depthwise convolution over time: ``y_t = Σ_{j<k} w_j ⊙ x_{t−j}`` (zero before the start)."""

    def __init__(self, d_model: int, kernel: int, rng: np.random.Generator):
        super().__init__()
        bound = 1.0 / math.sqrt(kernel)
        self.weight = nn.Parameter(torch.from_numpy(rng.uniform(-bound, bound, size=(d_model, 1, kernel))).float())
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        """``(B, n, E)`` → ``(B, n, E)``."""
        k = self.weight.shape[-1]
        y = nn.functional.conv1d(nn.functional.pad(x.transpose(1, 2), (k - 1, 0)), self.weight, self.bias,
                                 groups=x.shape[-1])
        return y.transpose(1, 2)


class Block(nn.Module):
    """Pre-norm block: ``x + Conv(LN(x))`` when it has a short convolution, ``x + Attn(LN(x))``, then
    ``x + MLP(LN(x))`` when it has an MLP."""

    def __init__(self, attn: nn.Module, d_model: int, mlp_width: int | None, rng: np.random.Generator,
                 short_conv: int = 0):
        super().__init__()
        if short_conv:
            self.norm0, self.conv = nn.LayerNorm(d_model), ShortConv(d_model, short_conv, rng)
        else:
            self.norm0 = self.conv = None
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = attn
        if mlp_width:
            self.norm2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(_linear(rng, d_model, mlp_width), nn.GELU(), _linear(rng, mlp_width, d_model))
        else:
            self.norm2 = self.mlp = None

    def forward(self, x):
        """``(B, n, E)`` → ``(B, n, E)``."""
        if self.conv is not None:
            x = x + self.conv(self.norm0(x))
        x = x + self.attn(self.norm1(x))
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x


class CausalTransformer(nn.Module):
    """A causal Transformer with per-layer pluggable attention (see the module docstring).

    Parameters
    ----------
    config : ModelConfig
    vocab_size : int, optional
        Token inputs ``(B, n)`` int64 through an embedding table (``N(0, 0.02²)`` entries).
    input_dim : int, optional
        Vector inputs ``(B, n, input_dim)`` through a linear read-in (exactly one of the two).
    output_dim : int
        Width of the read-out (logits or predictions).
    rng : int, SeedSequence or Generator
        The only source of randomness.
    """

    def __init__(self, config: ModelConfig, *, vocab_size: int | None = None, input_dim: int | None = None,
                 output_dim: int, rng=None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("give exactly one of vocab_size (token inputs) and input_dim (vector inputs)")
        self.config = config
        self.vocab_size = None if vocab_size is None else check_positive_int(vocab_size, "vocab_size")
        self.input_dim = None if input_dim is None else check_positive_int(input_dim, "input_dim")
        self.output_dim = check_positive_int(output_dim, "output_dim")
        gen = as_generator(rng)
        embed_rng, pos_rng, head_rng, *layer_rngs = gen.spawn(3 + config.num_layers)
        e = config.d_model
        self.embed = (_embedding(embed_rng, vocab_size, e, config.embed_std) if vocab_size is not None
                      else _linear(embed_rng, input_dim, e))
        self.pos = _embedding(pos_rng, config.max_len, e, config.embed_std)
        blocks = []
        for spec, layer_rng in zip(config.layer_specs(), layer_rngs):
            attn_rng, mlp_rng = layer_rng.spawn(2)
            blocks.append(Block(_build_attention(spec, config, attn_rng), e,
                                config.mlp_ratio * e if config.mlp else None, mlp_rng, config.short_conv))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(e)
        self.head = _linear(head_rng, e, output_dim)

    def layer_specs(self) -> tuple[AttentionSpec, ...]:
        return self.config.layer_specs()

    @property
    def attentions(self) -> list[nn.Module]:
        """The attention module of every layer."""
        return [block.attn for block in self.blocks]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, n)`` tokens or ``(B, n, input_dim)`` vectors → ``(B, n, output_dim)``."""
        n = inputs.shape[1]
        if n > self.config.max_len:
            raise ValueError(f"sequence length {n} exceeds max_len={self.config.max_len}")
        if self.vocab_size is not None:
            if inputs.dim() != 2 or inputs.dtype != torch.int64:
                raise TypeError(f"inputs must be (batch, n) int64 tokens, got {inputs.dtype} {tuple(inputs.shape)}")
        elif inputs.dim() != 3 or inputs.shape[-1] != self.input_dim:
            raise ValueError(f"inputs must be (batch, n, {self.input_dim}), got {tuple(inputs.shape)}")
        x = self.embed(inputs) + self.pos.weight[:n]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------- instruments
@contextlib.contextmanager
def record_attention_inputs(model: CausalTransformer):
    """Within the context, the input of every layer's attention (after its LayerNorm) of each forward pass is
    appended to ``records[layer]``; yields ``records`` (a list per layer)."""
    records: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    handles = []
    for i, attn in enumerate(model.attentions):
        handles.append(attn.register_forward_pre_hook(
            lambda module, args, i=i: records[i].append(args[0].detach())))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def project_heads(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``, each ``(B, H, n, ·)``: the layer's own projections of its input ``x (B, n, E)``."""
    heads = attn.num_heads

    def split(t):
        return t.reshape(*t.shape[:2], heads, -1).transpose(1, 2)

    return split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))


@torch.no_grad()
def attention_heads(model: CausalTransformer, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Queries, keys and values of every layer and head on ``inputs``: ``q``, ``k``, ``v`` of shape
    ``(layer, B, H, n, ·)`` (the outputs of each layer's projections, bias included, split into heads), and
    ``scale`` (the kernel scale of each layer, ``(layer,)``)."""
    with record_attention_inputs(model) as records:
        model(inputs)
    parts = [project_heads(attn, rec[0]) for attn, rec in zip(model.attentions, records)]
    scales = [float(attn.estimator.scale_) for attn in model.attentions]          # as fitted
    return {"q": torch.stack([p[0] for p in parts]), "k": torch.stack([p[1] for p in parts]),
            "v": torch.stack([p[2] for p in parts]), "scale": torch.tensor(scales, dtype=torch.float64)}


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@torch.no_grad()
def substitute(model: CausalTransformer, specs: Mapping[int, AttentionSpec], *, rng=None,
               calibration: torch.Tensor | None = None) -> CausalTransformer:
    """A copy of ``model`` in which the attention of each layer ``i`` in ``specs`` is rebuilt from
    ``specs[i]`` with the trained projections (training-free, post-hoc substitution); the rest is shared by
    value (a deep copy). The copy is in eval mode.

    Random maps draw their features from ``rng`` (one independent stream per substituted layer, spawned in
    layer order). Data-dependent estimators are fitted on the layer's input on ``calibration`` prompts, as the
    original model computes it (required for them; the prompts should be drawn apart from the evaluation
    prompts, since a causal model may not look at the sequence it reads). With ``AttentionSpec("exact")`` the
    copy computes exactly what the original does.
    """
    if not isinstance(model, CausalTransformer):
        raise TypeError(f"model must be a CausalTransformer, got {type(model).__name__}")
    layers = sorted(specs)
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(model.blocks):
            raise ValueError(f"layer indices must be in [0, {len(model.blocks)}), got {i!r}")
        if not isinstance(specs[i], AttentionSpec):
            raise TypeError(f"specs[{i}] must be an AttentionSpec, got {type(specs[i]).__name__}")
    new_specs = list(model.layer_specs())
    for i in layers:
        new_specs[i] = specs[i]
    config = dataclasses.replace(model.config, attention=tuple(new_specs))
    out = copy.deepcopy(model)
    out.config = config
    device = next(model.parameters()).device
    streams = as_generator(rng).spawn(len(layers))
    inputs = None
    for i, stream in zip(layers, streams):
        old = model.attentions[i]
        new = _build_attention(specs[i], config, stream).to(device)
        for name in _PROJECTIONS:
            want, have = tuple(getattr(new, name).weight.shape), tuple(getattr(old, name).weight.shape)
            if want != have:
                raise ValueError(f"layer {i}: the {name} of {specs[i]} has shape {want} but the trained one {have} "
                                 "(qk_dim differs)")
            getattr(new, name).load_state_dict(getattr(old, name).state_dict())
        if not new.fitted:
            if calibration is None:
                raise ValueError(f"layer {i}: estimator {specs[i].estimator!r} is data-dependent; pass calibration "
                                 "prompts to fit it on")
            if inputs is None:
                with record_attention_inputs(model) as records:
                    model(calibration)
                inputs = [r[0] for r in records]
            new.fit(inputs[i])                       # continues the layer's own feature stream
        out.blocks[i].attn = new
    return out.eval()
