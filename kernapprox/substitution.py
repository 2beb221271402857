"""all-MiniLM-L6-v2 end to end with the attention of chosen layers replaced by any registry estimator: a client of
the general model surgery (:mod:`kernapprox.surgery`).

The encoder runs layer by layer through its own modules (:class:`kernapprox.surgery.bert.BertStack`: embeddings,
the mask transformers builds, each ``BertLayer``), with the attention of a substituted layer computed by
:mod:`kernapprox.surgery.attention` on the layer's own queries, keys and values; between two layers the
attention of each can be the model's own or an estimator's. The sentence embedding is the model's: mean of the
final hidden states over the non-padding tokens, then unit 2-norm (the sentence-transformers pipeline
``modules.json`` of the package: Transformer → mean Pooling → Normalize).

Padding is honoured exactly: texts are tokenised one by one, grouped by length into padded buckets, and a padded
key never enters any attention (exact: the model's mask; feature maps: ``key_padding_mask``, so its weight is 0;
estimators that bring their own attention run each text at its own length). Every other operation is per token, so
the hidden states of a text's real tokens do not depend on the padding (test: padded and unpadded batches agree).

What replaces attention is a :class:`Substitution` (a registry name, ``r``, options and a seed). Per
``(layer, head)`` one estimator is fitted on that layer's projected queries and keys *of the running input*
(the model as substituted so far), the real tokens of all texts pooled — or, with ``fit="sequence"``, on each
text alone; both fit on the texts being scored, the study's declared (transductive) choice. Data-independent maps
are drawn once per ``(layer, head)``; pre-fitted maps (learned maps trained on other text) are passed in ``maps``.
Seeds are per ``(layer, head)``: ``SeedSequence(entropy, spawn_key=(..., layer, head))`` of the substitution's
``rng``, so a layer's draw does not depend on which other layers are substituted (what a placement search needs).

Measured (:func:`encode` with ``reference=``): per substituted layer the relative error of its attention output
against exact attention *on the same queries, keys and values* (the layer's own error on the activations it
sees), the relative error of every layer's hidden states against the exact model's (the propagated error), the
final hidden states' error and the embeddings. Retrieval (:mod:`kernapprox.surgery.retrieval`) runs on
:func:`retrieval_corpus` (paragraphs of Python's help text held out from the extraction windows that any fitting
sees: first sentence as the query, the rest as the document). :func:`search_placements` runs every subset of exact
layers (:func:`kernapprox.surgery.placement.walk_placements`, sharing prefixes), or a bounded set of them
(:func:`hybrid_placements`); :func:`placement_bytes` counts memory: an estimator's ``state_bytes`` per head, an
exact layer's KV cache at the text's length.

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
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

import kernapprox as ka

from . import real
from .surgery import attention as sa
from .surgery import maps as fitted_maps
from .surgery import placement as pl
from .surgery.bert import BertStack, EncoderInput, from_batch, tokenize
from .surgery.conversion import head_seed
from .surgery.retrieval import RetrievalCorpus, paragraph_corpus, retrieval_agreement
from .validation import check_choice, check_positive_int

__all__ = ["NUM_LAYERS", "NUM_HEADS", "HEAD_DIM", "FIT_REGION_TOKENS", "load_encoder", "RetrievalCorpus",
           "retrieval_corpus", "retrieval_agreement", "EncoderInput", "tokenize", "from_batch", "Substitution", "plan",
           "first_layers", "last_layers", "placement_label", "all_placements", "hybrid_placements", "EncoderRun",
           "encode", "search_placements", "RetrievalSetup", "retrieval_setup", "compare", "placement_bytes",
           "Windows", "fit_maps", "map_provenance", "heldout_attention_error"]

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
    """Held-out query/document pairs from Python's help text (:func:`kernapprox.real.reference_text`):
    :func:`kernapprox.surgery.retrieval.paragraph_corpus` over the paragraphs that start after the first
    :data:`FIT_REGION_TOKENS` text tokens (the extraction windows any fit or training sees)."""
    _, tokenizer = load_encoder()
    text, source = real.reference_text()
    held_out_from = _fit_region_end(tokenizer, text)
    corpus = paragraph_corpus(text, source, tokenizer, num_paragraphs, held_out_from=held_out_from,
                              min_document_tokens=min_document_tokens, max_document_tokens=max_document_tokens,
                              min_query_words=min_query_words)
    return dataclasses.replace(corpus, description=corpus.description.replace(
        f"from character {held_out_from} on",
        f"after the first {FIT_REGION_TOKENS} text tokens (characters ≥ {held_out_from})"))


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
        """The seed of ``(layer, head)``, independent of every other layer's and head's: the one rule of
        :func:`kernapprox.surgery.conversion.head_seed` (``ka.convert`` draws the same maps from the same root)."""
        return head_seed(self.rng, layer, head)

    def make(self, layer: int, head: int):
        """The unfitted estimator of ``(layer, head)``."""
        return ka.make_estimator(self.estimator, num_features=self.num_features, rng=self.head_seed(layer, head),
                                 **dict(self.options))

    @property
    def label(self) -> str:
        return self.estimator if self.num_features is None else f"{self.estimator}(r={self.num_features})"

    @property
    def feature_dimension(self) -> int:
        """The feature dimension per head: ``num_features``, or (for maps whose dimension ``d`` fixes) a fitted
        map's."""
        if self.num_features is not None:
            return int(self.num_features)
        return int(self.make(0, 0).fit(torch.zeros(1, HEAD_DIM)).num_features)

    def fitted_on(self, windows: Windows, *, cache: bool = True) -> Substitution:
        """This substitution with its maps fitted on the extraction ``windows`` (:func:`fit_maps`; cached): how
        learned maps, trained on other text than the one scored, enter :func:`encode`."""
        return dataclasses.replace(self, maps=fit_maps(self, windows, cache=cache))


def plan(substitution: Substitution, *, layers: Iterable[int] | None = None,
         exact_layers: Iterable[int] | None = None) -> dict[int, Substitution]:
    """A placement ``{layer: substitution}``: the given ``layers`` (default: all), or all but ``exact_layers``."""
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if layers is not None and exact_layers is not None:
        raise ValueError("give layers or exact_layers, not both")
    chosen = set(range(NUM_LAYERS)) if layers is None else pl.check_layers(layers, "layers", NUM_LAYERS)
    if exact_layers is not None:
        chosen -= pl.check_layers(exact_layers, "exact_layers", NUM_LAYERS)
    return {layer: substitution for layer in sorted(chosen)}


def first_layers(count: int) -> list[int]:
    """Layers ``0 … count−1`` of the six."""
    return pl.first_layers(count, NUM_LAYERS)


def last_layers(count: int) -> list[int]:
    """The last ``count`` of the six layers."""
    return pl.last_layers(count, NUM_LAYERS)


def placement_label(exact_layers: Iterable[int]) -> str:
    """``"E:0,5"`` for exact attention in layers 0 and 5 (``"E:-"``: none exact)."""
    return pl.placement_label(exact_layers, NUM_LAYERS)


def all_placements() -> list[tuple[int, ...]]:
    """The 2⁶ placements of exact layers (:func:`kernapprox.surgery.placement.all_placements`)."""
    return pl.all_placements(NUM_LAYERS)


def hybrid_placements(max_exact: int) -> list[tuple[int, ...]]:
    """The bounded search's placements (:func:`kernapprox.surgery.placement.hybrid_placements`) of the six layers."""
    return pl.hybrid_placements(max_exact, NUM_LAYERS)


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


def _masked_sq(x, mask):
    """``Σ‖x‖²`` over real tokens (float64) of ``(B, H, L, hd)``; ``mask`` ``(B, L)``, True = token."""
    return float((x.double() ** 2).sum(-1).sum(1)[mask].sum())


class _Layers:
    """The encoder layer by layer on a bucketed input (:class:`~kernapprox.surgery.bert.BertStack`), with the
    per-(layer, head) maps that are drawn once."""

    def __init__(self, model, inputs: EncoderInput):
        if not isinstance(inputs, EncoderInput):
            raise TypeError(f"inputs must be an EncoderInput (see tokenize), got {type(inputs).__name__}")
        sa.enable(model)                                 # unsubstituted layers compute what they computed before
        self.stack = BertStack(model)
        self.inputs = inputs
        self.real = [mask.bool() for mask in inputs.mask]
        embedded = [self.stack.embed(ids, mask) for ids, mask in zip(inputs.ids, inputs.mask)]
        self._start = tuple(h for h, _ in embedded)
        self.masks = [m for _, m in embedded]
        self.fixed: dict = {}                                  # (layer, head) -> data-independent fitted map
        self.heads = self.stack.num_heads
        # the reference of a layer's own error: the library's exact kernel, as an "exact" substitution computes it
        self.exact = ka.make_estimator("exact").fit(self._start[0].new_zeros(1, self.stack.head_dim))
        # pooled real tokens come out bucket by bucket; this permutation puts them in text order (text, position),
        # so that a fit on the pool does not depend on how the texts were bucketed
        text_of = np.concatenate([np.repeat(index, mask.sum(-1).cpu().numpy())
                                  for index, mask in zip(inputs.index, inputs.mask)])
        self.pool_order = torch.from_numpy(np.argsort(text_of, kind="stable")).to(inputs.ids[0].device)

    def embed(self) -> tuple[torch.Tensor, ...]:
        return self._start

    def step(self, layer: int, hidden, substitution: Substitution | None):
        """Layer ``layer`` on every bucket: ``(new hidden, (Σ‖ŷ−y‖², Σ‖y‖²) or None)``."""
        module = self.stack.attention_module(layer)
        if substitution is None:
            sa.set_attention(module, None)
            return tuple(self.stack.layer(layer, h, m) for h, m in zip(hidden, self.masks)), None
        heads = self._heads(layer, hidden, substitution)
        sums = [0.0, 0.0]
        bucket = iter(self.real)

        def observe(call, out):                        # the layer's own error: exact attention on the same q, k, v
            exact = ka.linear_attention(call.query, call.key, call.value, self.exact,
                                        key_padding_mask=call.key_padding_mask)
            real = next(bucket)
            sums[0] += _masked_sq(out - exact, real)
            sums[1] += _masked_sq(exact, real)

        sa.set_attention(module, sa.SubstitutedAttention(heads, observer=observe))
        try:
            out = tuple(self.stack.layer(layer, h, m) for h, m in zip(hidden, self.masks))
        finally:
            sa.set_attention(module, None)
        return out, (sums[0], sums[1])

    def _heads(self, layer, hidden, sub: Substitution) -> list:
        """Per head: the estimator for the whole input, or a :class:`~kernapprox.surgery.attention.PerSequence`."""
        calls = None
        out = []
        for head in range(self.heads):
            if sub.maps is not None:
                if (layer, head) not in sub.maps:
                    raise ValueError(f"substitution {sub.label} has maps but none for (layer={layer}, head={head})")
                est = sub.maps[(layer, head)]
                if est.capabilities().kind == "attention":
                    raise ValueError("pre-fitted maps must be feature maps or the exact kernel")
                out.append(est)
                continue
            est = sub.make(layer, head)
            caps = est.capabilities()
            if caps.kind == "attention" or (sub.fit == "sequence" and caps.data_dependent):
                out.append(sa.PerSequence(functools.partial(sub.make, layer, head)))
            elif not caps.data_dependent:                        # one draw per (layer, head): fit on a shape
                if (layer, head) not in self.fixed:
                    self.fixed[(layer, head)] = est.fit(hidden[0].new_zeros(1, self.stack.head_dim))
                out.append(self.fixed[(layer, head)])
            else:                                                # on the pooled real tokens of the running input
                if calls is None:
                    calls = [self.stack.capture(layer, h, m) for h, m in zip(hidden, self.masks)]
                q = torch.cat([c.query[:, head][m] for c, m in zip(calls, self.real)])[self.pool_order]
                k = torch.cat([c.key[:, head][m] for c, m in zip(calls, self.real)])[self.pool_order]
                if sub.fit_points is not None and q.shape[0] > sub.fit_points:
                    stride = -(-q.shape[0] // sub.fit_points)
                    q, k = q[::stride], k[::stride]
                out.append(est.fit(q, k))
        return out


def _pool(hidden: tuple[torch.Tensor, ...], inputs: EncoderInput) -> torch.Tensor:
    """Mean over real tokens, unit 2-norm, rows in the original text order: ``(T, hidden)``."""
    out = torch.empty(inputs.num_texts, hidden[0].shape[-1], dtype=hidden[0].dtype, device=hidden[0].device)
    for h, mask, index in zip(hidden, inputs.mask, inputs.index):
        m = mask.to(h.dtype)[..., None]
        mean = (h * m).sum(1) / m.sum(1)
        out[torch.as_tensor(index, device=h.device)] = torch.nn.functional.normalize(mean, dim=-1)
    return out


def _relative_error(approx, exact, inputs: EncoderInput) -> float:
    num = sum(_masked_sq((a - e)[:, None], m.bool()) for a, e, m in zip(approx, exact, inputs.mask))
    den = sum(_masked_sq(e[:, None], m.bool()) for e, m in zip(exact, inputs.mask))
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
        The ``BertModel`` of :func:`load_encoder` (any dtype/device; the inputs on its device). It is routed through
        :func:`kernapprox.surgery.attention.enable` (in place; its own outputs do not change).
    inputs : EncoderInput
        From :func:`~kernapprox.surgery.bert.tokenize` or :func:`~kernapprox.surgery.bert.from_batch`.
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
    pl.check_layers(plan, "plan", NUM_LAYERS)
    for layer, sub in plan.items():
        if not isinstance(sub, Substitution):
            raise TypeError(f"plan[{layer}] must be a Substitution, got {type(sub).__name__}")
    return {int(k): v for k, v in plan.items()}


@torch.no_grad()
def search_placements(model, inputs: EncoderInput, substitution: Substitution, visit: Callable, *,
                      reference: EncoderRun, placements: Iterable[Iterable[int]] | None = None) -> None:
    """Every placement of exact layers (or the given ``placements``): call ``visit(exact_layers, run)`` for each.

    The walk of :func:`kernapprox.surgery.placement.walk_placements` (shared prefixes: at most 126 layer
    evaluations for all 2⁶ subsets). Data-dependent maps are fitted at each node on the activations of that
    prefix; data-independent ones are drawn once per ``(layer, head)``, so a placement's run does not depend on
    which others are searched. ``run`` is the :class:`EncoderRun` of that placement (without layer states),
    measured against ``reference``.
    """
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if reference is None or reference.layer_states is None:
        raise ValueError("reference must be an exact run with keep_layer_states=True")
    layers = _Layers(model, inputs)

    def step(layer, hidden, substituted):
        nxt, err = layers.step(layer, hidden, substitution if substituted else None)
        return nxt, None if err is None else math.sqrt(err[0] / err[1])

    def finish(exact_layers, hidden, errors, states):
        visit(exact_layers, _finish(hidden, errors, states, inputs, reference, False))

    pl.walk_placements(NUM_LAYERS, layers.embed(), step, finish, exact_states=reference.layer_states,
                       placements=placements)


@dataclasses.dataclass(frozen=True)
class RetrievalSetup:
    """The held-out corpus, its tokenised input and the exact model's run on it (what every substituted run is
    compared with): :func:`retrieval_setup`."""

    model: object
    corpus: RetrievalCorpus
    inputs: EncoderInput
    exact: EncoderRun
    exact_hits: np.ndarray


def retrieval_setup(num_paragraphs: int, *, min_document_tokens: int = 24, max_document_tokens: int = 96,
                    bucket_tokens: int = 4096, device="cpu") -> RetrievalSetup:
    """:func:`retrieval_corpus` tokenised into buckets of at most ``bucket_tokens`` positions on ``device``, the
    exact model's run on it (layer states kept) and its own retrieval hits."""
    model, tokenizer = load_encoder()
    model = model.to(device)
    corpus = retrieval_corpus(num_paragraphs, min_document_tokens=min_document_tokens,
                              max_document_tokens=max_document_tokens)
    inputs = tokenize(tokenizer, corpus.texts, bucket_tokens=bucket_tokens, device=device)
    exact = encode(model, inputs, keep_layer_states=True)
    hits = retrieval_agreement(exact.embeddings, exact.embeddings, len(corpus))["hit"]
    return RetrievalSetup(model, corpus, inputs, exact, hits)


def compare(run: EncoderRun, setup: RetrievalSetup) -> dict:
    """A run against the exact one of ``setup``: per query ``top1_agreement``, ``top10_agreement`` and ``self_hit``
    (``top1``, ``top_k`` with k = 10 and ``hit`` of :func:`~kernapprox.surgery.retrieval.retrieval_agreement`); the
    mean ``embedding_cosine``; the ``final_state_error``; per layer ``hidden_error`` and ``layer_attention_error``
    (NaN for exact layers)."""
    agree = retrieval_agreement(run.embeddings, setup.exact.embeddings, len(setup.corpus))
    return {"top1_agreement": agree["top1"], "top10_agreement": agree["top_k"], "self_hit": agree["hit"],
            "embedding_cosine": float(np.mean(run.embedding_cosine)), "final_state_error": run.final_state_error,
            "hidden_error": [run.hidden_error[layer] for layer in range(NUM_LAYERS)],
            "layer_attention_error": [run.layer_attention_error.get(layer, np.nan) for layer in range(NUM_LAYERS)]}


def placement_bytes(substitution: Substitution | None, exact_layers: Iterable[int], seq_lens, *,
                    d_v: int = HEAD_DIM, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Bytes of attention memory per text (:func:`kernapprox.surgery.placement.placement_bytes`): exact layers'
    KV caches at the text's length, the substitution's ``state_bytes`` per head elsewhere."""
    est = None
    if substitution is not None:
        if substitution.maps is not None:
            est = substitution.maps[min(substitution.maps)]
        else:
            est = substitution.make(0, 0).fit(_probe_points(0), _probe_points(1))
    return pl.placement_bytes(est, exact_layers, seq_lens, num_layers=NUM_LAYERS, num_heads=NUM_HEADS,
                              head_dim=HEAD_DIM, d_v=d_v, dtype=dtype)


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

    With ``cache=True`` the fitted maps are kept in the result store (:mod:`kernapprox.surgery.maps`; below the cache
    root ``cache_dir``, default :func:`kernapprox.cache.cache_root`), keyed by a hash of the configuration:
    estimator, ``r``, options, seed, windows and the extraction's text hash, and valid while the code that fitted
    them is unchanged.
    """
    if not isinstance(substitution, Substitution):
        raise TypeError(f"substitution must be a Substitution, got {type(substitution).__name__}")
    if not isinstance(windows, Windows):
        raise TypeError(f"windows must be a Windows, got {type(windows).__name__}")
    if not cache:
        return _fit_all(substitution, windows)[0]
    path = fitted_maps.find_maps(substitution.estimator, _map_config(substitution, windows), cache_dir)
    if path is not None:
        # enough placeholder points for a map whose rank is limited by the points it is fitted on
        size = max(2, substitution.num_features or 2)
        placeholder = torch.from_numpy(np.random.default_rng(0).standard_normal((size, HEAD_DIM)))
        keys = [(layer, head) for layer in range(NUM_LAYERS) for head in range(NUM_HEADS)]
        return fitted_maps.load_maps(path, substitution.make, keys, placeholder)
    maps, seconds = _fit_all(substitution, windows)
    fitted_maps.store_maps(substitution.estimator, _map_config(substitution, windows), maps, seconds, cache_dir)
    return maps


def _fit_all(substitution, windows):
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


def map_provenance(substitution: Substitution, windows: Windows = Windows(), cache_dir=None) -> dict | None:
    """The ``__provenance__`` record of the cached maps of this configuration (``None`` when not cached)."""
    path = fitted_maps.find_maps(substitution.estimator, _map_config(substitution, windows), cache_dir)
    return None if path is None else fitted_maps.read_provenance(path)


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
        modes = est.capabilities().modes
        approx = ka.linear_attention(q, k, v, est, causal=False, mode="chunked" if "chunked" in modes else modes[0])
        exact = ka.softmax_attention(q, k, v)
        if not bool(torch.isfinite(approx).all()):
            out[layer, head] = np.inf
            continue
        out[layer, head] = float(((approx - exact) ** 2).sum().sqrt() / (exact ** 2).sum().sqrt())
    return out
