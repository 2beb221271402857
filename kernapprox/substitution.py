"""all-MiniLM-L6-v2 end to end with the attention of chosen layers replaced by any registry estimator.

The encoder is run layer by layer from the model's own modules (embeddings; per layer the ``query``/``key``/
``value`` projections, the attention output block, the feed-forward block), so that between two layers the
attention of each can be the model's own softmax attention or an estimator's. The sentence embedding is the
model's: mean of the final hidden states over the non-padding tokens, then unit 2-norm (the
sentence-transformers pipeline ``modules.json`` of the package: Transformer → mean Pooling → Normalize).

Padding is honoured exactly: texts are tokenised one by one, grouped by length into padded buckets, and a padded
key never enters any attention (exact: logit ``−inf``; feature maps: key weight ``exp(−inf) = 0``; estimators
that bring their own attention run each text at its own length). Every other operation is per token, so the
hidden states of a text's real tokens do not depend on the padding (test: padded and unpadded batches agree).

What replaces attention is a :class:`Substitution` (a registry name, ``r``, options and a seed). Per
``(layer, head)`` one estimator is fitted on that layer's projected queries and keys *of the running input*
(the model as substituted so far), the real tokens of all texts pooled — or, with ``fit="sequence"``, on each
text alone; data-independent maps are drawn once per ``(layer, head)``; pre-fitted maps (learned maps trained on
other text) are passed in ``maps``. Seeds are per ``(layer, head)``: ``SeedSequence(entropy, spawn_key=(...,
layer, head))`` of the substitution's ``rng``, so a layer's draw does not depend on which other layers are
substituted (what a placement search needs).

Measured (:func:`encode` with ``reference=``): per substituted layer the relative error of its attention output
against exact attention *on the same queries, keys and values* (the layer's own error on the activations it
sees), the relative error of every layer's hidden states against the exact model's (the propagated error), the
final hidden states' error and the embeddings. :func:`retrieval_agreement` compares nearest-neighbour retrieval
with the exact model's on :func:`retrieval_corpus` (paragraphs of Python's help text held out from the extraction
windows that any fitting sees: first sentence as the query, the rest as the document). :func:`search_placements`
runs every subset of exact layers (2⁶ = 64) as a depth-first walk of the layer-by-layer choice tree, sharing the
hidden states of common prefixes (at most 126 layer evaluations instead of 384), or a bounded set of them
(:func:`hybrid_placements`: at most ``k`` exact layers, single substituted layers and the naive first/last
``k``). :func:`placement_bytes` counts memory: an estimator's ``state_bytes`` per head, an exact layer's KV cache
at the text's length.

>>> from kernapprox import real, substitution as sub
>>> if real.is_available():
...     model, tokenizer = sub.load_encoder()
...     corpus = sub.retrieval_corpus(8)
...     inputs = sub.tokenize(tokenizer, corpus.texts)
...     exact = sub.encode(model, inputs, keep_layer_states=True)
...     plan = sub.plan(sub.Substitution("positive_orthogonal", num_features=64, rng=0), layers=[5])
...     run = sub.encode(model, inputs, plan, reference=exact)
...     round(float(run.layer_attention_error[5]), 1) > 0
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

import kernapprox as ka

from . import real
from .io import atomic_write
from .validation import check_choice, check_positive_int

NUM_LAYERS = real.NUM_LAYERS
NUM_HEADS = real.NUM_HEADS
HEAD_DIM = real.HEAD_DIM
FITS = ("input", "sequence")
# Text tokens of the stream (from its start) that fitting may see: the extraction windows of real.load_qkv
# (510 text tokens each). Retrieval paragraphs start after them, so no fitted or trained map has seen them.
FIT_REGION_WINDOWS = 16
FIT_REGION_TOKENS = FIT_REGION_WINDOWS * (real.WINDOW - 2)


# -------------------------------------------------------------------------------------------------- model
@functools.lru_cache(maxsize=2)
def load_encoder(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of all-MiniLM-L6-v2 (offline, eval mode), loaded once per process and dtype."""
    return real.load_model(dtype)


# ------------------------------------------------------------------------------------------------- corpus
@dataclasses.dataclass(frozen=True)
class RetrievalCorpus:
    """Query/document pairs: ``queries[i]`` is the first sentence of a paragraph, ``documents[i]`` the rest.

    ``texts`` lists the queries, then the documents (the order :func:`tokenize` and :func:`encode` use);
    ``char_offsets`` are the paragraphs' positions in :func:`kernapprox.real.reference_text`.
    """

    queries: tuple[str, ...]
    documents: tuple[str, ...]
    char_offsets: tuple[int, ...]
    description: str

    @property
    def texts(self) -> list[str]:
        return [*self.queries, *self.documents]

    def __len__(self) -> int:
        return len(self.queries)


_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+(?=[A-Z\"(*])")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _paragraphs(text: str):
    """``(offset, paragraph)`` for each block between blank lines."""
    start = 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        yield start, text[start:match.start()]
        start = match.end()
    yield start, text[start:]


def _fit_region_end(tokenizer, text: str) -> int:
    """Character offset of text token :data:`FIT_REGION_TOKENS` (tokenising a growing prefix: a token's offsets do
    not depend on text far beyond it, and a whole-text pass costs seconds)."""
    size = 16 * FIT_REGION_TOKENS
    while True:
        offsets = tokenizer(text[:size], add_special_tokens=False, return_offsets_mapping=True,
                            verbose=False)["offset_mapping"]
        if len(offsets) > FIT_REGION_TOKENS + 64 or size >= len(text):
            break
        size *= 2
    if len(offsets) <= FIT_REGION_TOKENS:
        raise ValueError(f"the text has {len(offsets)} tokens, not more than the fit region ({FIT_REGION_TOKENS})")
    return offsets[FIT_REGION_TOKENS][0]


@functools.lru_cache(maxsize=8)
def retrieval_corpus(num_paragraphs: int = 64, *, min_document_tokens: int = 24, max_document_tokens: int = 96,
                     min_query_words: int = 5) -> RetrievalCorpus:
    """Held-out query/document pairs from Python's help text (:func:`kernapprox.real.reference_text`).

    Candidates are prose paragraphs (blocks between blank lines whose lines are not indented, i.e. not code or
    tables) that start after the first :data:`FIT_REGION_TOKENS` text tokens (the extraction windows any fit or
    training sees). A paragraph is split at its first sentence end (``.``, ``!``, ``?`` or ``:`` followed by
    space and a capital, quote, parenthesis or ``*``); the first sentence (at least ``min_query_words`` words)
    is the query, the rest (between ``min_document_tokens`` and ``max_document_tokens`` WordPiece tokens,
    special tokens excluded) the document; whitespace runs become one space. ``num_paragraphs`` candidates are
    taken evenly spaced in text order (``round(linspace)`` over the candidates): deterministic, no randomness.
    """
    check_positive_int(num_paragraphs, "num_paragraphs")
    for name, value in (("min_document_tokens", min_document_tokens), ("max_document_tokens", max_document_tokens),
                        ("min_query_words", min_query_words)):
        check_positive_int(value, name)
    if min_document_tokens > max_document_tokens:
        raise ValueError(f"min_document_tokens ({min_document_tokens}) exceeds max_document_tokens "
                         f"({max_document_tokens})")
    _, tokenizer = load_encoder()
    text, source = real.reference_text()
    held_out_from = _fit_region_end(tokenizer, text)
    candidates = []
    for offset, para in _paragraphs(text):
        if offset < held_out_from or not para.strip() or any(line[:1].isspace() or line.startswith(">>>")
                                                            for line in para.splitlines()):
            continue
        flat = " ".join(para.split())
        parts = _SENTENCE_END.split(flat, maxsplit=1)
        if len(parts) != 2 or len(parts[0].split()) < min_query_words:
            continue
        num_tokens = len(tokenizer(parts[1], add_special_tokens=False, verbose=False)["input_ids"])
        if min_document_tokens <= num_tokens <= max_document_tokens:
            candidates.append((offset, parts[0], parts[1]))
    if len(candidates) < num_paragraphs:
        raise ValueError(f"only {len(candidates)} paragraphs qualify, fewer than num_paragraphs={num_paragraphs}")
    chosen = np.unique(np.round(np.linspace(0, len(candidates) - 1, num_paragraphs)).astype(int))
    picked = [candidates[i] for i in chosen]
    description = (f"{len(picked)} of {len(candidates)} prose paragraphs of {source}, after the first "
                   f"{FIT_REGION_TOKENS} text tokens (characters ≥ {held_out_from}); query = first sentence, "
                   f"document = the rest ({min_document_tokens}–{max_document_tokens} tokens); evenly spaced")
    return RetrievalCorpus(tuple(p[1] for p in picked), tuple(p[2] for p in picked), tuple(p[0] for p in picked),
                           description)


# ----------------------------------------------------------------------------------------------- tokenising
@dataclasses.dataclass(frozen=True)
class EncoderInput:
    """Tokenised texts in padded buckets of similar length.

    ``ids[b]``, ``mask[b]``: ``(B_b, L_b)`` token ids and attention mask (1 = token, 0 = padding) of bucket
    ``b``; ``index[b]``: the positions (in the original text order) of its rows; ``lengths``: tokens per text
    (special tokens included), in the original order.
    """

    ids: tuple[torch.Tensor, ...]
    mask: tuple[torch.Tensor, ...]
    index: tuple[np.ndarray, ...]
    lengths: np.ndarray

    @property
    def num_texts(self) -> int:
        return int(self.lengths.size)


def tokenize(tokenizer, texts: Iterable[str], *, max_length: int = 256, bucket_tokens: int = 4096,
             device=None) -> EncoderInput:
    """Tokenise ``texts`` one by one (``[CLS] … [SEP]``, truncated at ``max_length``), sort them by length and
    group them into padded buckets of at most ``bucket_tokens`` positions (at least one text each).

    ``bucket_tokens=1`` gives one text per bucket: every text at its own length, no padding at all.
    """
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty list of strings")
    check_positive_int(max_length, "max_length")
    check_positive_int(bucket_tokens, "bucket_tokens")
    encoded = [tokenizer(t, truncation=True, max_length=max_length, verbose=False)["input_ids"] for t in texts]
    lengths = np.array([len(e) for e in encoded])
    order = np.argsort(lengths, kind="stable")
    buckets, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > bucket_tokens:
            buckets.append(current)
            current = []
        current.append(int(i))
    buckets.append(current)
    ids, masks = [], []
    for bucket in buckets:
        width = int(lengths[bucket].max())
        block = torch.full((len(bucket), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(bucket), width), dtype=torch.long)
        for row, i in enumerate(bucket):
            block[row, :lengths[i]] = torch.tensor(encoded[i])
            mask[row, :lengths[i]] = 1
        ids.append(block.to(device))
        masks.append(mask.to(device))
    return EncoderInput(tuple(ids), tuple(masks), tuple(np.array(b) for b in buckets), lengths)


def from_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> EncoderInput:
    """One bucket from an already padded batch ``(B, L)`` (e.g. a tokenizer's ``padding=True`` output)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids and attention_mask must be (B, L) of one shape, got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    lengths = attention_mask.sum(-1).cpu().numpy()
    if (lengths == 0).any():
        raise ValueError("attention_mask has a row without tokens")
    return EncoderInput((input_ids,), (attention_mask,), (np.arange(input_ids.shape[0]),), lengths)


# ------------------------------------------------------------------------------------------ substitutions
@dataclasses.dataclass(frozen=True)
class Substitution:
    """What replaces a layer's attention: registry estimator ``estimator`` with ``num_features`` and ``options``.

    Parameters
    ----------
    estimator : str
        A registry name (``"exact"`` reproduces the model).
    num_features : int, optional
        ``r`` per head (``None`` for estimators whose dimension is fixed by ``d``).
    rng : int or numpy SeedSequence
        Root seed; head ``h`` of layer ``l`` uses ``SeedSequence(entropy, spawn_key=(*spawn_key, l, h))``.
    options : mapping
        Further constructor options of the estimator.
    fit : {"input", "sequence"}
        Data-dependent estimators are fitted per ``(layer, head)`` on the real tokens of all texts of the input
        (``"input"``) or on each text alone (``"sequence"``, one fit per text, head and layer). Estimators that
        bring their own attention always run per text.
    maps : mapping ``(layer, head) -> fitted estimator``, optional
        Pre-fitted maps (learned maps trained on other text, calibrated maps), used as they are.
    fit_points : int, optional
        With ``fit="input"``: fit on at most this many real tokens of the input per ``(layer, head)``, every
        ``ceil(N / fit_points)``-th of the ``N`` pooled tokens (queries and keys alike; deterministic). ``None``:
        all of them.
    """

    estimator: str
    num_features: int | None = None
    rng: int | np.random.SeedSequence = 0
    options: Mapping = dataclasses.field(default_factory=dict)
    fit: str = "input"
    maps: Mapping | None = None
    fit_points: int | None = None

    def __post_init__(self):
        if self.estimator not in ka.available_estimators():
            raise ValueError(f"unknown estimator {self.estimator!r}; available: "
                             f"{', '.join(ka.available_estimators())}")
        check_choice(self.fit, "fit", FITS)
        if isinstance(self.rng, bool) or not isinstance(self.rng, int | np.integer | np.random.SeedSequence):
            raise TypeError(f"rng must be an int or a numpy SeedSequence (a Generator's draws would depend on the "
                            f"placement), got {type(self.rng).__name__}")
        if isinstance(self.rng, int | np.integer) and self.rng < 0:
            raise ValueError(f"rng must be a non-negative int, got {self.rng}")
        if self.fit_points is not None:
            check_positive_int(self.fit_points, "fit_points")
        if self.maps is not None and not isinstance(self.maps, Mapping):
            raise TypeError(f"maps must be a mapping (layer, head) -> fitted estimator, got {type(self.maps).__name__}")

    def head_seed(self, layer: int, head: int) -> np.random.SeedSequence:
        """The seed of ``(layer, head)``: independent of every other layer's and head's."""
        root = self.rng if isinstance(self.rng, np.random.SeedSequence) else np.random.SeedSequence(int(self.rng))
        return np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, int(layer), int(head)))

    def make(self, layer: int, head: int):
        """The unfitted estimator of ``(layer, head)``."""
        return ka.make_estimator(self.estimator, num_features=self.num_features, rng=self.head_seed(layer, head),
                                 **dict(self.options))

    @property
    def label(self) -> str:
        return self.estimator if self.num_features is None else f"{self.estimator}(r={self.num_features})"


def plan(substitution: Substitution, *, layers: Iterable[int] | None = None,
         exact_layers: Iterable[int] | None = None) -> dict[int, Substitution]:
    """A placement ``{layer: substitution}``: the given ``layers`` (default: all), or all but ``exact_layers``."""
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if layers is not None and exact_layers is not None:
        raise ValueError("give layers or exact_layers, not both")
    chosen = set(range(NUM_LAYERS)) if layers is None else _check_layers(layers, "layers")
    if exact_layers is not None:
        chosen -= _check_layers(exact_layers, "exact_layers")
    return {layer: substitution for layer in sorted(chosen)}


def first_layers(count: int) -> list[int]:
    """Layers ``0 … count−1``."""
    return list(range(_check_count(count)))


def last_layers(count: int) -> list[int]:
    """The last ``count`` layers."""
    return list(range(NUM_LAYERS - _check_count(count), NUM_LAYERS))


def placement_label(exact_layers: Iterable[int]) -> str:
    """``"E:0,5"`` for exact attention in layers 0 and 5 (``"E:-"``: none exact)."""
    layers = sorted(_check_layers(exact_layers, "exact_layers"))
    return "E:" + (",".join(map(str, layers)) if layers else "-")


def all_placements() -> list[tuple[int, ...]]:
    """Every subset of layers (as the sorted tuple of layers that keep exact attention), by size then order."""
    import itertools

    return [c for size in range(NUM_LAYERS + 1) for c in itertools.combinations(range(NUM_LAYERS), size)]


def _check_count(count):
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or not 0 <= count <= NUM_LAYERS:
        raise ValueError(f"count must be an int in [0, {NUM_LAYERS}], got {count!r}")
    return int(count)


def _check_layers(layers, name) -> set[int]:
    out = set()
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 0 <= layer < NUM_LAYERS:
            raise ValueError(f"{name} must hold layer indices in [0, {NUM_LAYERS}), got {layer!r}")
        out.add(int(layer))
    return out


# ------------------------------------------------------------------------------------------------ encoder
@dataclasses.dataclass
class EncoderRun:
    """The result of :func:`encode`.

    ``embeddings`` ``(T, hidden)`` (unit norm, original text order); ``hidden`` the final hidden states per
    bucket; ``layer_attention_error[l]`` the relative RMS error of substituted layer ``l``'s attention output
    against exact attention on the same inputs (real tokens, all heads: ``sqrt(Σ‖ŷ−y‖² / Σ‖y‖²)``; absent for
    exact layers); with a ``reference``: ``hidden_error[l]`` the relative RMS error of the hidden states after
    layer ``l`` against the reference's (``NUM_LAYERS − 1``: the final states), ``embedding_cosine`` per text.
    ``layer_states`` (when kept) holds each layer's output hidden states per bucket.
    """

    embeddings: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    layer_attention_error: dict[int, float]
    hidden_error: dict[int, float]
    embedding_cosine: np.ndarray | None
    layer_states: list[tuple[torch.Tensor, ...]] | None

    @property
    def final_state_error(self) -> float:
        return self.hidden_error[NUM_LAYERS - 1]


def _kind(estimator) -> str:
    return estimator.capabilities().kind


def _data_dependent(estimator) -> bool:
    return estimator.capabilities().data_dependent


class _Layers:
    """Per-layer computation on a bucketed input; holds the per-(layer, head) maps that need fitting once."""

    def __init__(self, model, inputs: EncoderInput):
        if not isinstance(inputs, EncoderInput):
            raise TypeError(f"inputs must be an EncoderInput (see tokenize), got {type(inputs).__name__}")
        self.model = model
        self.inputs = inputs
        self.fixed: dict = {}                                  # (layer, head) -> data-independent fitted map
        self.heads = model.config.num_attention_heads
        # pooled real tokens come out bucket by bucket; this permutation puts them in text order (text, position),
        # so that a fit on the pool does not depend on how the texts were bucketed
        text_of = np.concatenate([np.repeat(index, mask.sum(-1).cpu().numpy())
                                  for index, mask in zip(inputs.index, inputs.mask)])
        self.pool_order = torch.from_numpy(np.argsort(text_of, kind="stable")).to(inputs.ids[0].device)

    def embed(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.model.embeddings(input_ids=ids) for ids in self.inputs.ids)

    def _split(self, t):                                       # (B, L, H·hd) -> (B, H, L, hd)
        return t.reshape(*t.shape[:2], self.heads, -1).transpose(1, 2)

    def step(self, layer: int, hidden, substitution: Substitution | None):
        """Layer ``layer`` on every bucket: ``(new hidden, (Σ‖ŷ−y‖², Σ‖y‖²) or None)``."""
        block = self.model.encoder.layer[layer]
        attn = block.attention.self
        qkv = [tuple(self._split(getattr(attn, name)(h)) for name in ("query", "key", "value")) for h in hidden]
        exact = [_masked_softmax(q, k, v, mask.bool()) for (q, k, v), mask in zip(qkv, self.inputs.mask)]
        if substitution is None:
            contexts, error = exact, None
        else:
            contexts = self._substituted(layer, qkv, substitution)
            error = (sum(_masked_sq(c - e, m) for c, e, m in zip(contexts, exact, self.inputs.mask)),
                     sum(_masked_sq(e, m) for e, m in zip(exact, self.inputs.mask)))
        out = []
        for h, ctx in zip(hidden, contexts):
            merged = ctx.transpose(1, 2).reshape(h.shape)
            a = block.attention.output(merged, h)
            out.append(block.output(block.intermediate(a), a))
        return tuple(out), error

    # ------------------------------------------------------------------------------------ substituted layers
    def _substituted(self, layer, qkv, sub: Substitution):
        contexts = [torch.empty_like(v) for _, _, v in qkv]
        masks = [m.bool() for m in self.inputs.mask]
        for head in range(self.heads):
            est = self._estimator(layer, head, qkv, masks, sub)
            if est is None:                                    # per text: fit (if needed) and attend at own length
                for b, ((q, k, v), mask) in enumerate(zip(qkv, masks)):
                    for row in range(q.shape[0]):
                        n = int(mask[row].sum())
                        qs, ks, vs = q[row, head, :n], k[row, head, :n], v[row, head, :n]
                        e = sub.make(layer, head).fit(qs, ks)
                        contexts[b][row, head, :n] = _attend(e, qs, ks, vs)
                        contexts[b][row, head, n:] = 0.0
                continue
            for b, ((q, k, v), mask) in enumerate(zip(qkv, masks)):
                contexts[b][:, head] = _attend_masked(est, q[:, head], k[:, head], v[:, head], mask)
        return contexts

    def _estimator(self, layer, head, qkv, masks, sub: Substitution):
        """The estimator of ``(layer, head)`` for the whole input, or ``None`` when it is fitted per text."""
        if sub.maps is not None:
            if (layer, head) not in sub.maps:
                raise ValueError(f"substitution {sub.label} has maps but none for (layer={layer}, head={head})")
            est = sub.maps[(layer, head)]
            if _kind(est) == "attention":
                raise ValueError("pre-fitted maps must be feature maps or the exact kernel")
            return est
        est = sub.make(layer, head)
        if _kind(est) == "attention" or (sub.fit == "sequence" and _data_dependent(est)):
            return None
        if not _data_dependent(est):                           # one draw per (layer, head): fit on a shape
            if (layer, head) not in self.fixed:
                self.fixed[(layer, head)] = est.fit(qkv[0][0][0, head, :1])
            return self.fixed[(layer, head)]
        q = torch.cat([q[:, head][m] for (q, _, _), m in zip(qkv, masks)])[self.pool_order]
        k = torch.cat([k[:, head][m] for (_, k, _), m in zip(qkv, masks)])[self.pool_order]
        if sub.fit_points is not None and q.shape[0] > sub.fit_points:
            stride = -(-q.shape[0] // sub.fit_points)
            q, k = q[::stride], k[::stride]
        return est.fit(q, k)


def _masked_softmax(q, k, v, mask):
    """Exact softmax attention ``(B, H, L, hd)`` with padded keys (``mask`` ``(B, L)`` False) excluded."""
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v


def _masked_sq(x, mask):
    """``Σ‖x‖²`` over real tokens (float64) of ``(B, H, L, hd)``."""
    return float((x.double() ** 2).sum(-1).sum(1)[mask.bool()].sum())


def _attend(est, q, k, v):
    """Non-causal attention of one text at its own length ``(n, d)`` with a fitted estimator."""
    return ka.linear_attention(q, k, v, est, causal=False, mode=est.modes[0])


def _attend_masked(est, q, k, v, mask):
    """Non-causal attention ``(B, L, d)`` with padded keys excluded exactly.

    The exact kernel: softmax with logit ``−inf`` at padded keys. A feature map: from its stabilised features
    ``φ = φ̃ e^ℓ`` (:meth:`FeatureMap.features`), ``y_i = φ̃(q_i)ᵀ S / φ̃(q_i)ᵀ z`` with
    ``S = Σ_j w_j φ̃(k_j) v_jᵀ``, ``z = Σ_j w_j φ̃(k_j)``, ``w_j = e^{ℓ(k_j) − c}`` over real keys (``ℓ = −inf`` at
    padded ones, so ``w_j = 0`` exactly) and ``c`` their largest log-scale (the query scale cancels) — the
    non-causal linear attention of :func:`kernapprox.linear_attention` restricted to each text's real keys.
    """
    if _kind(est) == "exact":
        return _masked_softmax(q[:, None], k[:, None], v[:, None], mask)[:, 0]
    pq, _ = est.features(q, "query", log_scale=True)
    pk, lk = est.features(k, "key", log_scale=True)
    lk = lk.masked_fill(~mask, float("-inf"))
    weights = torch.exp(lk - lk.amax(-1, keepdim=True))                       # (B, L); 0 at padded keys
    values = torch.cat([v.to(pk.dtype), torch.ones_like(v[..., :1], dtype=pk.dtype)], -1) * weights[..., None]
    out = pq @ (pk.transpose(-1, -2) @ values)                                # (B, L, d_v + 1)
    return (out[..., :-1] / out[..., -1:]).to(v.dtype)


def _pool(hidden: tuple[torch.Tensor, ...], inputs: EncoderInput) -> torch.Tensor:
    """Mean over real tokens, unit 2-norm, rows in the original text order: ``(T, hidden)``."""
    out = torch.empty(inputs.num_texts, hidden[0].shape[-1], dtype=hidden[0].dtype, device=hidden[0].device)
    for h, mask, index in zip(hidden, inputs.mask, inputs.index):
        m = mask.to(h.dtype)[..., None]
        mean = (h * m).sum(1) / m.sum(1)
        out[torch.as_tensor(index, device=h.device)] = torch.nn.functional.normalize(mean, dim=-1)
    return out


def _relative_error(approx, exact, inputs: EncoderInput) -> float:
    num = sum(_masked_sq((a - e)[:, None], m) for a, e, m in zip(approx, exact, inputs.mask))
    den = sum(_masked_sq(e[:, None], m) for e, m in zip(exact, inputs.mask))
    return math.sqrt(num / den)


def _cosines(emb, ref) -> np.ndarray:
    return (emb.double() * ref.double()).sum(-1).cpu().numpy()


@torch.no_grad()
def encode(model, inputs: EncoderInput, plan: Mapping[int, Substitution] | None = None, *,
           reference: EncoderRun | None = None, keep_layer_states: bool = False) -> EncoderRun:
    """Run the encoder on ``inputs`` with the attention of the layers in ``plan`` substituted.

    Parameters
    ----------
    model
        The ``BertModel`` of :func:`load_encoder` (any dtype/device; the inputs on its device).
    inputs : EncoderInput
        From :func:`tokenize` or :func:`from_batch`.
    plan : mapping layer -> Substitution, optional
        Layers not in ``plan`` keep the model's softmax attention; ``None``: the exact model.
    reference : EncoderRun, optional
        An exact run on the same inputs with ``keep_layer_states=True``: then the per-layer hidden-state errors
        and the embedding cosines are measured.
    keep_layer_states : bool
        Keep every layer's output states (what a reference needs).

    Returns
    -------
    EncoderRun
    """
    plan = _check_plan(plan)
    if reference is not None and reference.layer_states is None:
        raise ValueError("reference must be an exact run with keep_layer_states=True")
    layers = _Layers(model, inputs)
    hidden = layers.embed()
    errors, states = {}, []
    for layer in range(NUM_LAYERS):
        hidden, err = layers.step(layer, hidden, plan.get(layer))
        if err is not None:
            errors[layer] = math.sqrt(err[0] / err[1])
        states.append(hidden)
    return _finish(hidden, errors, states, inputs, reference, keep_layer_states)


def _finish(hidden, errors, states, inputs, reference, keep):
    emb = _pool(hidden, inputs)
    hidden_error, cosine = {}, None
    if reference is not None:
        hidden_error = {layer: _relative_error(s, r, inputs)
                        for layer, (s, r) in enumerate(zip(states, reference.layer_states))}
        cosine = _cosines(emb, reference.embeddings)
    return EncoderRun(emb, tuple(hidden), errors, hidden_error, cosine, states if keep else None)


def _check_plan(plan) -> dict[int, Substitution]:
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping layer -> Substitution, got {type(plan).__name__}")
    _check_layers(plan, "plan")
    for layer, sub in plan.items():
        if not isinstance(sub, Substitution):
            raise TypeError(f"plan[{layer}] must be a Substitution, got {type(sub).__name__}")
    return {int(k): v for k, v in plan.items()}


@torch.no_grad()
def search_placements(model, inputs: EncoderInput, substitution: Substitution, visit: Callable, *,
                      reference: EncoderRun, placements: Iterable[Iterable[int]] | None = None) -> None:
    """Every placement of exact layers (or the given ``placements``): call ``visit(exact_layers, run)`` for each.

    A depth-first walk over the layers, each either exact or substituted, sharing the hidden states of common
    prefixes: 2 + 4 + … + 64 = 126 layer evaluations for all 2⁶ subsets; with ``placements`` (iterables of the
    layers that keep exact attention) only the prefixes that lead to one of them are evaluated, and each is
    visited once, in the walk's order. Data-dependent maps are fitted at each node on the activations of that
    prefix; data-independent ones are drawn once per ``(layer, head)``, so a placement's run does not depend on
    which others are searched. ``run`` is the :class:`EncoderRun` of that placement (without layer states),
    measured against ``reference``.
    """
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if reference is None or reference.layer_states is None:
        raise ValueError("reference must be an exact run with keep_layer_states=True")
    prefixes = None
    if placements is not None:
        chosen = [_check_layers(p, "placements") for p in placements]
        if not chosen:
            raise ValueError("placements must name at least one placement (None: all of them)")
        prefixes = {tuple(layer in p for layer in range(depth)) for p in chosen for depth in range(NUM_LAYERS + 1)}
    layers = _Layers(model, inputs)

    def walk(layer, hidden, exact_layers, errors, states):
        if layer == NUM_LAYERS:
            visit(tuple(exact_layers), _finish(hidden, errors, states, inputs, reference, False))
            return
        for keep_exact in (True, False):
            if prefixes is not None and tuple(j in exact_layers for j in range(layer)) + (keep_exact,) not in prefixes:
                continue
            if keep_exact:
                nxt, err = reference.layer_states[layer], None     # the exact prefix needs no recomputation
                if exact_layers != list(range(layer)):
                    nxt, err = layers.step(layer, hidden, None)
            else:
                nxt, err = layers.step(layer, hidden, substitution)
            new_errors = dict(errors) if err is None else {**errors, layer: math.sqrt(err[0] / err[1])}
            walk(layer + 1, nxt, exact_layers + [layer] if keep_exact else exact_layers, new_errors, states + [nxt])

    walk(0, layers.embed(), [], {}, [])


def hybrid_placements(max_exact: int) -> list[tuple[int, ...]]:
    """The placements a bounded hybrid search visits, in :func:`all_placements` order: every subset of at most
    ``max_exact`` exact layers, every single substituted layer (all others exact: each layer's own sensitivity),
    and the naive placements (the first ``k`` and the last ``k`` layers exact, every ``k``)."""
    max_exact = _check_count(max_exact)
    naive = {tuple(first_layers(k)) for k in range(NUM_LAYERS + 1)} | {tuple(last_layers(k))
                                                                     for k in range(NUM_LAYERS + 1)}
    return [p for p in all_placements() if len(p) <= max_exact or len(p) >= NUM_LAYERS - 1 or p in naive]


# ------------------------------------------------------------------------------------------------ metrics
def retrieval_agreement(embeddings: torch.Tensor, reference: torch.Tensor, num_queries: int, *,
                        k: int = 10) -> dict[str, np.ndarray]:
    """Nearest-neighbour retrieval of an approximate model against the exact one, per query.

    ``embeddings`` and ``reference`` are ``(2Q, hidden)``: ``Q`` queries then their ``Q`` documents (the order
    of ``RetrievalCorpus.texts``), unit norm. Documents are ranked by cosine similarity to each query (a
    document whose embedding is not finite ranks last). Returns per query (arrays of length ``Q``):

    - ``top1``: 1 where the approximate model's nearest document is the exact model's;
    - ``top_k``: ``|top-k(approx) ∩ top-k(exact)| / k``;
    - ``hit``: 1 where the approximate model's nearest document is the query's own paragraph (its accuracy;
      the exact model's is this with ``embeddings = reference``);
    - ``finite``: 1 where the query's embedding is finite (a non-finite query agrees with nothing).
    """
    check_positive_int(num_queries, "num_queries")
    check_positive_int(k, "k")
    if embeddings.shape != reference.shape or embeddings.shape[0] != 2 * num_queries:
        raise ValueError(f"embeddings and reference must both be (2·num_queries, hidden), got "
                         f"{tuple(embeddings.shape)} and {tuple(reference.shape)}")
    if k > num_queries:
        raise ValueError(f"k={k} exceeds the number of documents ({num_queries})")
    if not bool(torch.isfinite(reference).all()):
        raise ValueError("reference embeddings must be finite")

    def ranks(emb):
        emb = emb.double()
        sims = emb[:num_queries] @ emb[num_queries:].T
        sims = torch.nan_to_num(sims, nan=-math.inf, posinf=-math.inf)
        return torch.argsort(sims, dim=-1, descending=True, stable=True).cpu().numpy()

    approx, exact = ranks(embeddings), ranks(reference)
    finite = torch.isfinite(embeddings[:num_queries]).all(-1).cpu().numpy()
    top1 = (approx[:, 0] == exact[:, 0]) & finite
    overlap = np.array([len(set(a[:k]) & set(e[:k])) / k for a, e in zip(approx, exact)]) * finite
    hit = (approx[:, 0] == np.arange(num_queries)) & finite
    return {"top1": top1.astype(float), "top_k": overlap, "hit": hit.astype(float), "finite": finite.astype(float)}


def placement_bytes(substitution: Substitution | None, exact_layers: Iterable[int], seq_lens, *,
                    d_v: int = HEAD_DIM, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Bytes of attention memory per text: exact layers keep their KV cache, ``n · (d + d_v)`` numbers per head at
    the text's length ``n``; substituted layers the estimator's ``state_bytes`` per head (the linear state, and
    what it declares as context-dependent). Returns one number per entry of ``seq_lens``."""
    exact_set = _check_layers(exact_layers, "exact_layers")
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    per_exact = seq_lens * (HEAD_DIM + d_v) * torch.empty((), dtype=dtype).element_size() * NUM_HEADS
    total = per_exact * len(exact_set)
    approx = NUM_LAYERS - len(exact_set)
    if approx:
        if substitution is None:
            raise ValueError("substitution is required when a layer is not exact")
        if substitution.maps is not None:
            est = substitution.maps[min(substitution.maps)]
        else:
            est = substitution.make(0, 0).fit(_probe_points(0), _probe_points(1))
        per_text = np.array([est.state_bytes(d_v, dtype, seq_len=int(n)) for n in seq_lens])
        total = total + approx * NUM_HEADS * per_text
    return total


def _probe_points(seed: int) -> torch.Tensor:
    """Fixed points to fit an estimator for its size only (enough for landmark methods up to r = 512)."""
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((512, HEAD_DIM)) * 0.3)


# ------------------------------------------------------------------------ maps fitted on extraction windows
TRAIN_WINDOWS = (0, 1)
HELD_OUT_WINDOWS = (2, 3)
NUM_WINDOWS = 4


@dataclasses.dataclass(frozen=True)
class Windows:
    """Which extraction windows (:func:`kernapprox.real.load_qkv`, 512 positions each) a fit or an evaluation
    uses, cut into segments of ``segment`` positions (each segment one attention sequence), every
    ``query_stride``-th query of a segment kept (its softmax still runs over all keys of the segment)."""

    windows: tuple[int, ...] = TRAIN_WINDOWS
    segment: int = real.WINDOW
    query_stride: int = 1
    num_windows: int = NUM_WINDOWS

    def __post_init__(self):
        check_positive_int(self.num_windows, "num_windows")
        if not self.windows or any(isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < self.num_windows
                                   for w in self.windows):
            raise ValueError(f"windows must be indices in [0, {self.num_windows}), got {self.windows!r}")
        if self.num_windows > FIT_REGION_WINDOWS:
            raise ValueError(f"num_windows={self.num_windows} reaches past the fit region ({FIT_REGION_WINDOWS} "
                             "windows) that the retrieval corpus is held out from")
        check_positive_int(self.segment, "segment")
        check_positive_int(self.query_stride, "query_stride")
        if real.WINDOW % self.segment:
            raise ValueError(f"segment must divide the window length {real.WINDOW}, got {self.segment}")

    def qkv(self, layer: int, head: int, dtype: torch.dtype = torch.float32):
        """``(q, k, v)`` of ``(layer, head)``: ``(S, segment/query_stride, d)``, ``(S, segment, d)`` twice."""
        data = real.load_qkv(self.num_windows)
        picked = np.concatenate([np.arange(w * real.WINDOW, (w + 1) * real.WINDOW) for w in self.windows])
        out = []
        for name in ("q", "k", "v"):
            t = torch.from_numpy(np.ascontiguousarray(data[name][layer, head, picked])).to(dtype)
            out.append(t.reshape(-1, self.segment, t.shape[-1]))
        return out[0][:, ::self.query_stride], out[1], out[2]

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def fit_maps(substitution: Substitution, windows: Windows = Windows(), *, cache: bool = False,
             cache_dir=None) -> dict[tuple[int, int], object]:
    """Fit the estimator of every ``(layer, head)`` on the model's queries and keys of the extraction ``windows``
    (the exact model on Python's help text; disjoint from :func:`retrieval_corpus`). Returns ``{(layer, head):
    fitted estimator}`` for ``Substitution.maps`` — how learned maps (trained on other text) and calibrated
    data-dependent maps enter :func:`encode`.

    With ``cache=True`` the fitted states are stored once in ``cache_dir`` (default
    :func:`kernapprox.real.resolve_cache_dir`) as ``.npz`` (no pickles) keyed by a hash of the configuration:
    estimator, ``r``, options, seed, windows and the extraction's text hash; the file's ``__provenance__`` entry
    (JSON) records that configuration, the package versions, the creation date and the fitting seconds. A
    cached file is loaded with ``allow_pickle=False`` and each map rebuilt with ``load_fitted_state`` (after a
    fit on placeholder tokens that only builds its structure).
    """
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if not isinstance(windows, Windows):
        raise TypeError(f"windows must be a Windows, got {type(windows).__name__}")
    if not cache:
        return _fit_all(substitution, windows)[0]
    config = _map_config(substitution, windows)
    path = real.resolve_cache_dir(cache_dir) / f"maps_{substitution.estimator}_{_config_hash(config)}.npz"
    if path.exists():
        return _load_maps(path, substitution)
    maps, seconds = _fit_all(substitution, windows)
    _save_maps(path, maps, config, seconds)
    return maps


def _fit_all(substitution, windows):
    import time

    start = time.perf_counter()
    maps = {}
    for layer in range(NUM_LAYERS):
        for head in range(NUM_HEADS):
            q, k, _ = windows.qkv(layer, head)
            maps[(layer, head)] = substitution.make(layer, head).fit(q, k)
    return maps, time.perf_counter() - start


def _map_config(substitution, windows) -> dict:
    rng = substitution.rng
    seed = ({"entropy": str(rng.entropy), "spawn_key": list(rng.spawn_key)}
            if isinstance(rng, np.random.SeedSequence) else int(rng))
    data = real.load_qkv(windows.num_windows)
    return {"estimator": substitution.estimator, "num_features": substitution.num_features,
            "options": {key: repr(value) for key, value in sorted(dict(substitution.options).items())},
            "rng": seed, "windows": windows.describe(), "text_sha256": data["attrs"].get("text_sha256"),
            "model_name": real.MODEL_NAME}


def _config_hash(config: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:20]


def _save_maps(path, maps, config, seconds):
    import datetime as dt
    import importlib.metadata
    import json

    arrays = {}
    for (layer, head), est in maps.items():
        for key, value in est.fitted_state().items():
            value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            arrays[f"L{layer}H{head}/{key}"] = value
    provenance = {"config": config, "fit_seconds": round(seconds, 3), "torch_version": str(torch.__version__),
                  "kernapprox_version": importlib.metadata.version("kernapprox"),
                  "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                  "threads": torch.get_num_threads()}
    arrays["__provenance__"] = np.array(json.dumps(provenance, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:                    # a file object: np.savez would append ".npz" to a path
            np.savez(f, **arrays)

    atomic_write(path, write)


def _load_maps(path, substitution) -> dict:
    # enough placeholder points for a map whose rank is limited by the points it is fitted on
    size = max(2, substitution.num_features or 2)
    placeholder = torch.from_numpy(np.random.default_rng(0).standard_normal((size, HEAD_DIM)))
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    maps = {}
    for layer in range(NUM_LAYERS):
        for head in range(NUM_HEADS):
            prefix = f"L{layer}H{head}/"
            state = {}
            for key, value in arrays.items():
                if key.startswith(prefix):
                    name = key[len(prefix):]
                    state[name] = value if value.ndim else value.item()
            est = substitution.make(layer, head).fit(placeholder, placeholder)
            maps[(layer, head)] = est.load_fitted_state(state)
    return maps


def map_provenance(substitution: Substitution, windows: Windows = Windows(), cache_dir=None) -> dict | None:
    """The ``__provenance__`` record of the cached maps of this configuration (``None`` when not cached)."""
    import json

    path = (real.resolve_cache_dir(cache_dir)
            / f"maps_{substitution.estimator}_{_config_hash(_map_config(substitution, windows))}.npz")
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as stored:
        return json.loads(str(stored["__provenance__"]))


@torch.no_grad()
def heldout_attention_error(maps: Mapping, windows: Windows = Windows(windows=HELD_OUT_WINDOWS)) -> np.ndarray:
    """Relative RMS error of each ``(layer, head)``'s non-causal attention output with its fitted map against
    exact softmax attention on the held-out ``windows`` (pooled over their segments:
    ``sqrt(Σ‖ŷ−y‖² / Σ‖y‖²)``), in float64. Returns ``(layers, heads)``; ``inf`` where an output is not finite."""
    out = np.full((NUM_LAYERS, NUM_HEADS), np.nan)
    for (layer, head), est in maps.items():
        q, k, v = windows.qkv(layer, head, torch.float64)
        if windows.query_stride != 1:
            raise ValueError("held-out evaluation uses every query (query_stride=1)")
        approx = ka.linear_attention(q, k, v, est, causal=False, mode="chunked" if "chunked" in est.modes
                                     else est.modes[0])
        exact = ka.softmax_attention(q, k, v)
        if not bool(torch.isfinite(approx).all()):
            out[layer, head] = np.inf
            continue
        out[layer, head] = float(((approx - exact) ** 2).sum().sqrt() / (exact ** 2).sum().sqrt())
    return out
