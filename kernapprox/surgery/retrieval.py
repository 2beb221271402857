"""Sentence retrieval as a measure of an encoder on approximate attention: a query/document corpus cut from prose,
and the agreement of an approximate model's nearest neighbours with the exact model's."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import torch

from ..validation import check_positive_int

__all__ = ["RetrievalCorpus", "paragraph_corpus", "retrieval_agreement"]


@dataclasses.dataclass(frozen=True)
class RetrievalCorpus:
    """Query/document pairs: ``queries[i]`` is the first sentence of a paragraph, ``documents[i]`` the rest.

    ``texts`` lists the queries, then the documents (the order an encoder's inputs and embeddings use);
    ``char_offsets`` are the paragraphs' positions in the source text.
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


def paragraph_corpus(text: str, source: str, tokenizer, num_paragraphs: int, *, held_out_from: int = 0,
                     min_document_tokens: int = 24, max_document_tokens: int = 96,
                     min_query_words: int = 5) -> RetrievalCorpus:
    """Query/document pairs from the prose paragraphs of ``text`` that start at or after character
    ``held_out_from``.

    Candidates are blocks between blank lines whose lines are not indented (not code or tables) and do not start
    with ``>>>``. A paragraph is split at its first sentence end (``.``, ``!``, ``?`` or ``:`` followed by space
    and a capital, quote, parenthesis or ``*``); the first sentence (at least ``min_query_words`` words) is the
    query, the rest (between ``min_document_tokens`` and ``max_document_tokens`` tokens of ``tokenizer``, special
    tokens excluded) the document; whitespace runs become one space. ``num_paragraphs`` candidates are taken evenly
    spaced in text order (``round(linspace)`` over the candidates): deterministic, no randomness.
    """
    check_positive_int(num_paragraphs, "num_paragraphs")
    for name, value in (("min_document_tokens", min_document_tokens), ("max_document_tokens", max_document_tokens),
                        ("min_query_words", min_query_words)):
        check_positive_int(value, name)
    if min_document_tokens > max_document_tokens:
        raise ValueError(f"min_document_tokens ({min_document_tokens}) exceeds max_document_tokens "
                         f"({max_document_tokens})")
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
    description = (f"{len(picked)} of {len(candidates)} prose paragraphs of {source}, from character "
                   f"{held_out_from} on; query = first sentence, document = the rest ({min_document_tokens}–"
                   f"{max_document_tokens} tokens); evenly spaced")
    return RetrievalCorpus(tuple(p[1] for p in picked), tuple(p[2] for p in picked), tuple(p[0] for p in picked),
                           description)


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
