"""Evaluations of any Hugging Face causal language model: next-token NLL on text windows, recall prompts in natural
language, and prefill-then-decode time and KV-cache memory.

Every function takes a ``transformers`` causal LM (``model(input_ids).logits`` of shape ``(batch, L, vocab)``) in
eval mode, so the exact model and the models that :func:`kernapprox.convert` makes from it are measured by the same
code on the same tokens.

Quality: :func:`token_nll` gives the per-token negative log-likelihood ``−log p(x_{t+1} | x_{≤t})`` of every
window, :func:`nll_summary` its mean over each window and, over the windows (the independent units), the mean NLL
with its percentile-bootstrap interval and the perplexity ``exp(mean NLL)`` with the interval's image
(:func:`kernapprox.stats.bootstrap_interval`; ``exp`` is increasing, so the bounds map to bounds).

Recall: :func:`passkey_prompt` hides ``"The pass key is 71432. Remember it. 71432 is the pass key."`` at a chosen
depth of real text, or of the original test's repeated sentences (:func:`classic_filler`; Mohtashami & Jaggi,
*Landmark Attention*, 2023, §4.2: the passkey retrieval task), and asks for it at the end;
:func:`kv_lookup_prompt` lists sentences ``"Ada Brook's locker number is 4821."`` for distinct people and asks for
one of them (an associative-recall task written in natural language, cf. Arora et al., *Zoology*, 2023,
multi-query associative recall). Both return a :class:`RecallPrompt` whose answer is scored by
:func:`score_recall`: the answer's log-probability under teacher forcing, and whether the greedy decode gives it,
which is exactly whether every answer token is the argmax at its position given the prompt and the answer's earlier
tokens (the greedy path is the teacher-forced path as long as they agree), so one forward pass gives both.

Decoding: :func:`decode_timing` runs the prefill ``model(prompt, use_cache=True)`` and then one token at a time with
the returned cache, timing each step, and measures the cache's bytes (:func:`cache_bytes`: a converted model's
fixed-size states by :meth:`KernelCache.state_bytes <kernapprox.surgery.cache.KernelCache.state_bytes>`, a key/value
cache from its tensors; for SmolLM2-135M-Instruct's KV cache they equal :func:`kernapprox.lm.kv_cache_bytes`).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr

from . import stats
from .validation import check_positive_int

__all__ = ["token_nll", "nll_summary", "RecallPrompt", "CLASSIC_FILLER", "classic_filler", "passkey_prompt",
           "kv_lookup_prompt", "score_recall", "recall_summary", "decode_timing", "cache_bytes", "cache_keyword",
           "greedy_continuation", "common_prefix", "greedy_reply"]


def _check_ids(input_ids, name: str = "input_ids", *, min_len: int = 2) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() != 2:
        raise ValueError(f"{name} must be an integer tensor (batch, length), got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < min_len:
        raise ValueError(f"{name} must hold at least one row of {min_len} tokens, got {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0:
        raise ValueError(f"{name} holds negative token ids")
    return input_ids.long()


def _device(model) -> torch.device:
    return next(model.parameters()).device


# ------------------------------------------------------------------------------------------------------ quality
@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor, *, batch_size: int = 1, return_argmax: bool = False):
    """Per-token next-token NLL (nats) of every window: ``(n_windows, L − 1)`` float64.

    Entry ``[w, t]`` is ``−log p(x_{t+1} | x_0 … x_t)`` for window ``w`` of ``input_ids`` ``(n_windows, L)``: the
    log-softmax of the model's logits at position ``t`` (computed in float64), read at the next token. Windows run
    ``batch_size`` at a time (the logits of a batch, ``batch_size · L · vocab`` floats, are the memory peak). A
    non-finite logit raises ``ValueError``. The passes keep no cache (``use_cache=False``): a converted model runs
    its parallel attention, not its decoder's. ``return_argmax``: also the model's greedy next token at every
    position, ``(n_windows, L − 1)`` int64 (the argmax of the same logits; teacher-forced on the windows), so that
    two models' greedy choices can be compared on the same text.
    """
    input_ids = _check_ids(input_ids)
    batch_size = check_positive_int(batch_size, "batch_size")
    if not isinstance(return_argmax, bool):
        raise TypeError(f"return_argmax must be a bool, got {return_argmax!r}")
    device = _device(model)
    out = np.empty((input_ids.shape[0], input_ids.shape[1] - 1), dtype=np.float64)
    greedy = np.empty(out.shape, dtype=np.int64) if return_argmax else None
    for first in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[first:first + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]       # a scoring pass keeps no cache
        if not torch.isfinite(logits).all():
            raise ValueError(f"the model gave non-finite logits on windows {first}..{first + ids.shape[0] - 1}")
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        out[first:first + ids.shape[0]] = nll.cpu().numpy()
        if greedy is not None:
            greedy[first:first + ids.shape[0]] = logits.argmax(-1).cpu().numpy()
    return (out, greedy) if greedy is not None else out


def nll_summary(nll, *, level: float = stats.LEVEL) -> xr.Dataset:
    """The windows' NLL and perplexity with intervals over windows.

    Parameters
    ----------
    nll : array (n_windows, positions)
        Per-token NLL (:func:`token_nll`); at least 2 windows.

    Returns
    -------
    xarray.Dataset
        ``nll`` ``(window, position)``; ``window_nll`` ``(window)``, the mean over each window's positions;
        ``mean_nll`` ``(stat)``, the mean of ``window_nll`` with its percentile-bootstrap interval over windows
        (:func:`kernapprox.stats.bootstrap_interval`); ``perplexity`` ``(stat)``, ``exp`` of ``mean_nll``'s
        estimate and bounds (equal windows: the exponential of the mean NLL over all tokens).
    """
    nll = np.asarray(nll, dtype=np.float64)
    if nll.ndim != 2 or nll.shape[0] < 2 or nll.shape[1] < 1:
        raise ValueError(f"nll must be (n_windows >= 2, positions >= 1), got shape {nll.shape}")
    if not np.isfinite(nll).all():
        raise ValueError("nll holds non-finite values")
    da = xr.DataArray(nll, dims=("window", "position"), name="nll", attrs={"units": "nats"})
    window_nll = da.mean("position").assign_attrs(units="nats", long_name="mean next-token NLL of the window")
    mean_nll = stats.bootstrap_interval(window_nll, "window", "mean", level=level)
    ppl = mean_nll.copy()
    for s in ("estimate", "lo", "hi"):
        ppl.loc[{"stat": s}] = np.exp(mean_nll.sel(stat=s).values)
    ppl.attrs = {**mean_nll.attrs, "statistic": "exp(mean NLL)", "long_name": "perplexity"}
    return xr.Dataset({"nll": da, "window_nll": window_nll, "mean_nll": mean_nll, "perplexity": ppl})


# ------------------------------------------------------------------------------------------------------- recall
@dataclass(frozen=True)
class RecallPrompt:
    """One recall question: ``input_ids`` ``(length,)`` the prompt, ``answer_ids`` ``(a,)`` the answer's tokens
    (``answer`` as text), ``needle_start`` the token index where the recalled fact starts, ``kind``
    (``"passkey"`` or ``"kv_lookup"``), ``context_len`` the length asked for, ``seed``, and ``candidates``: how
    many answers the prompt's form leaves open to a reader who does not recall the fact (90,000 five-digit keys for
    the passkey; the listed people's numbers for the lookup), so ``1 / candidates`` is the chance baseline of
    greedy accuracy (0: not stated)."""

    input_ids: torch.Tensor
    answer_ids: torch.Tensor
    answer: str
    needle_start: int
    kind: str
    context_len: int
    seed: int
    candidates: int = 0

    @property
    def depth(self) -> float:
        """Where the fact sits in the prompt, ``needle_start / len(input_ids)``."""
        return self.needle_start / len(self.input_ids)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _check_depth(depth) -> float:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    return float(depth)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


_PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                  "memorise it; you will be asked about it.\n\n")
_PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def _line_boundary(tokenizer, filler: list[int], position: int, reach: int = 64) -> int:
    """The first index ``≥ position`` (within ``reach``) just after a filler token that ends a line, else
    ``position``: the needle then starts at a line's start, not inside a word."""
    for i in range(position, min(position + reach, len(filler))):
        if i > 0 and tokenizer.decode([filler[i - 1]]).endswith("\n"):
            return i
    return position


# The haystack of the original passkey test (Mohtashami & Jaggi 2023, §4.2), repeated: predictable text, against which
# the real text of a held-out source is the harder test (SmolLM2-135M-Instruct, dequantised from its Q4_1 GGUF,
# finds a key at 1024 tokens in the one, not in the other: docs/guide/causal_lm.md).
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def classic_filler(tokenizer, n_tokens: int) -> np.ndarray:
    """At least ``n_tokens`` token ids of :data:`CLASSIC_FILLER` repeated (``int64``): the original passkey test's
    haystack, a ``filler`` for :func:`passkey_prompt`."""
    n_tokens = check_positive_int(n_tokens, "n_tokens")
    unit = _encode(tokenizer, CLASSIC_FILLER)
    return np.asarray(unit * (n_tokens // len(unit) + 1), dtype=np.int64)


def passkey_prompt(tokenizer, context_len: int, filler, *, depth: float = 0.5, seed: int = 0) -> RecallPrompt:
    """A passkey prompt of exactly ``context_len`` tokens: instruction, real text with the passkey sentence at
    ``depth``, then the question ``"What is the pass key? The pass key is"``; the answer is ``" NNNNN"``.

    Parameters
    ----------
    tokenizer
        A Hugging Face tokenizer (every piece is tokenised on its own, without special tokens, and the ids
        concatenated: all models see the same token sequence).
    context_len : int
        Prompt length in tokens.
    filler : 1-D sequence of int
        Token ids of real text (e.g. the evaluation split's stream, :func:`kernapprox.lm.text_stream`), or the
        original test's repeated haystack (:func:`classic_filler`); the prompt takes a contiguous run of it starting
        at an offset drawn from ``seed``.
    depth : float in [0, 1]
        Where the passkey sits in the filler (0: right after the instruction; 1: right before the question); moved
        forward to the next line start within 64 tokens.
    seed : int
        Draws the 5-digit key and the filler offset (``numpy.random.default_rng([seed, context_len])``).
    """
    context_len = check_positive_int(context_len, "context_len")
    depth, seed = _check_depth(depth), _check_seed(seed)
    filler = [int(t) for t in (filler.tolist() if isinstance(filler, torch.Tensor | np.ndarray) else filler)]
    rng = np.random.default_rng([seed, context_len])
    key = str(int(rng.integers(10_000, 100_000)))
    intro = _encode(tokenizer, _PASSKEY_INTRO)
    needle = _encode(tokenizer, f"The pass key is {key}. Remember it. {key} is the pass key.\n\n")
    question = _encode(tokenizer, _PASSKEY_QUESTION)
    answer = _encode(tokenizer, f" {key}")
    n_filler = context_len - len(intro) - len(needle) - len(question)
    if n_filler < 1:
        raise ValueError(f"context_len={context_len} leaves no room for filler (the fixed parts take "
                         f"{context_len - n_filler} tokens)")
    if len(filler) < n_filler:
        raise ValueError(f"filler holds {len(filler)} tokens, fewer than the {n_filler} this prompt needs")
    offset = int(rng.integers(0, len(filler) - n_filler + 1))
    text = filler[offset:offset + n_filler]
    at = _line_boundary(tokenizer, text, int(round(depth * n_filler)))
    ids = intro + text[:at] + needle + text[at:] + question
    return RecallPrompt(torch.tensor(ids, dtype=torch.long), torch.tensor(answer, dtype=torch.long), f" {key}",
                        len(intro) + at, "passkey", context_len, seed, 90_000)


_FIRST = ("Ada", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "James", "Kate", "Leo", "Maya",
          "Noah", "Olive", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy", "Xavier", "Yara", "Zoe")
_LAST = ("Brook", "Carter", "Dunn", "Ellis", "Fisher", "Grant", "Hayes", "Irving", "Jensen", "Keller", "Lowe",
         "Morgan", "Nash", "Owens", "Price", "Reed", "Stone", "Turner", "Vance", "Walsh", "Young", "Baker", "Cole",
         "Drake", "Frost", "Hale", "Knight", "Lane", "Marsh", "Porter", "Quincy", "Russell", "Shaw", "Tate", "Wade",
         "Webb", "Wood", "Ward", "Fox", "Gray")
_QUESTION = "\nQuestion: What is {name}'s locker number?\nAnswer: {name}'s locker number is"
_KV_INTRO = "Here is the list of locker numbers of the members of a sports club.\n\n"


def kv_lookup_prompt(tokenizer, context_len: int, *, depth: float | None = None, seed: int = 0) -> RecallPrompt:
    """An in-context key–value lookup in natural language, at most ``context_len`` tokens.

    The prompt lists sentences ``"<First> <Last>'s locker number is NNNN."`` (one per line; distinct people drawn
    from 26 × 40 names, distinct 4-digit numbers) until the next one would not fit, then asks
    ``"Question: What is <First> <Last>'s locker number?\\nAnswer: <First> <Last>'s locker number is"`` about one
    of them; the answer is ``" NNNN"``. Its length is within one sentence plus the longest question (~30 tokens)
    of ``context_len``.

    Parameters
    ----------
    depth : float in [0, 1], optional
        Which listed person is asked about, as a fraction of the list (``None``: drawn from ``seed``).
    seed : int
        Draws the people, their numbers and (without ``depth``) the one asked about
        (``numpy.random.default_rng([seed, context_len])``).
    """
    context_len = check_positive_int(context_len, "context_len")
    seed = _check_seed(seed)
    depth = None if depth is None else _check_depth(depth)
    rng = np.random.default_rng([seed, context_len])
    people = [f"{_FIRST[i // len(_LAST)]} {_LAST[i % len(_LAST)]}"
              for i in rng.permutation(len(_FIRST) * len(_LAST))]
    numbers = rng.permutation(9000)[:len(people)] + 1000
    intro = _encode(tokenizer, _KV_INTRO)
    questions = [_QUESTION.format(name=name) for name in people]
    question_len = max(len(q) for q in tokenizer(questions, add_special_tokens=False, verbose=False)["input_ids"])
    ids, starts, count = list(intro), [], 0
    while count < len(people):
        sentence = _encode(tokenizer, f"{people[count]}'s locker number is {numbers[count]}.\n")
        if len(ids) + len(sentence) + question_len > context_len:
            break
        starts.append(len(ids))
        ids += sentence
        count += 1
    if count < 2:
        raise ValueError(f"context_len={context_len} holds fewer than 2 sentences of the list")
    pick = int(rng.integers(0, count)) if depth is None else min(int(depth * count), count - 1)
    ids += _encode(tokenizer, questions[pick])
    answer = f" {numbers[pick]}"
    return RecallPrompt(torch.tensor(ids, dtype=torch.long), torch.tensor(_encode(tokenizer, answer)), answer,
                        starts[pick], "kv_lookup", context_len, seed, count)


@torch.no_grad()
def score_recall(model, prompts) -> dict:
    """Score recall prompts: the answer's log-probability and whether greedy decoding gives it.

    For each :class:`RecallPrompt` one forward pass over ``prompt + answer[:-1]`` (the logits of the last
    ``len(answer)`` positions only, ``logits_to_keep``, where the model accepts it) gives
    ``answer_logprob = Σ_j log p(a_j | prompt, a_<j)`` (float64 log-softmax) and ``greedy_correct``: every
    ``a_j`` is the argmax at its position, i.e. the greedy decode of ``len(answer)`` tokens is the answer.

    Returns
    -------
    dict of numpy arrays, one entry per prompt: ``answer_logprob``, ``greedy_correct`` (bool), ``first_token_rank``
    (0 when the answer's first token is the argmax), ``context_len``, ``prompt_len``, ``depth``, ``candidates``.
    """
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, RecallPrompt) for p in prompts):
        raise TypeError("prompts must be a non-empty sequence of RecallPrompt")
    device = _device(model)
    out = {k: [] for k in ("answer_logprob", "greedy_correct", "first_token_rank", "context_len", "prompt_len",
                           "depth", "candidates")}
    for p in prompts:
        a = len(p.answer_ids)
        ids = torch.cat([p.input_ids, p.answer_ids[:-1]])[None].to(device)
        try:
            logits = model(input_ids=ids, logits_to_keep=a, use_cache=False).logits[0, -a:]
        except TypeError:                 # a model without logits_to_keep: all logits, the last a kept
            logits = model(input_ids=ids, use_cache=False).logits[0, -a:]
        if not torch.isfinite(logits).all():
            raise ValueError(f"the model gave non-finite logits on a {p.kind} prompt (seed {p.seed})")
        logp = torch.log_softmax(logits.double(), -1)
        target = p.answer_ids.to(device)
        out["answer_logprob"].append(float(logp.gather(-1, target[:, None]).sum()))
        out["greedy_correct"].append(bool((logp.argmax(-1) == target).all()))
        out["first_token_rank"].append(int((logp[0] > logp[0, target[0]]).sum()))
        out["context_len"].append(p.context_len)
        out["prompt_len"].append(len(p.input_ids))
        out["depth"].append(p.depth)
        out["candidates"].append(p.candidates)
    return {k: np.asarray(v) for k, v in out.items()}


def recall_summary(scores: dict, *, level: float = stats.LEVEL) -> dict:
    """Greedy accuracy with its Clopper–Pearson interval and the median answer log-probability with its bootstrap
    interval, over the prompts of ``scores`` (:func:`score_recall`): a dict of floats."""
    correct = np.asarray(scores["greedy_correct"], dtype=bool)
    logprob = xr.DataArray(np.asarray(scores["answer_logprob"], float), dims="prompt")
    lo, hi = stats.binomial_interval(int(correct.sum()), correct.size, level)
    lp = stats.bootstrap_interval(logprob, "prompt", "median", level=level)
    return {"accuracy": float(correct.mean()), "accuracy_lo": float(lo), "accuracy_hi": float(hi),
            "prompts": int(correct.size), "median_logprob": float(lp.sel(stat="estimate")),
            "median_logprob_lo": float(lp.sel(stat="lo")), "median_logprob_hi": float(lp.sel(stat="hi"))}


# ----------------------------------------------------------------------------------------------------- decoding
def cache_keyword(model) -> str:
    """The keyword a transformers model's forward takes its cache by: ``cache`` (transformers 5) or
    ``past_key_values`` (earlier versions), read from the signature of ``model.forward``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output):
    """The cache a forward pass with ``use_cache=True`` returned, and the keyword that passes it back
    (transformers 5 names it ``cache``; earlier versions ``past_key_values``)."""
    for key in ("cache", "past_key_values"):
        value = output.get(key) if hasattr(output, "get") else getattr(output, key, None)
        if value is not None:
            return value, key
    raise TypeError("the model returned no cache with use_cache=True")


def cache_bytes(cache) -> int:
    """Bytes held by a decoding cache: a converted model's :class:`~kernapprox.surgery.cache.KernelCache` by its
    ``state_bytes()`` (the substituted layers' fixed-size states, the kept heads' keys and values); a transformers
    cache layer by layer, a kernapprox state layer (:class:`~kernapprox.surgery.cache.StateLayer`, as ``generate()``'s
    ``DynamicCache`` holds them for a converted model) by its ``state_bytes()`` and any other layer by its key and
    value tensors; or the legacy tuple of ``(key, value)`` pairs. ``TypeError`` for a cache of another kind."""
    from .surgery.cache import KernelCache, StateLayer

    if isinstance(cache, KernelCache):
        return int(cache.state_bytes())
    layers = getattr(cache, "layers", None)
    if layers is not None:
        states = [layer for layer in layers if isinstance(layer, StateLayer)]
        pairs = [(layer.keys, layer.values) for layer in layers if not isinstance(layer, StateLayer)]
        return sum(int(layer.state_bytes()) for layer in states) + _tensor_bytes(pairs)
    if isinstance(cache, tuple | list) and all(isinstance(p, tuple | list) and len(p) >= 2 for p in cache):
        return _tensor_bytes([(p[0], p[1]) for p in cache])
    raise TypeError(f"cache_bytes does not know the cache type {type(cache).__name__}")


def _tensor_bytes(pairs) -> int:
    total = 0
    for pair in pairs:
        for t in pair:
            if t is not None:
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def decode_timing(model, input_ids: torch.Tensor, n_decode: int = 16, *, warmup: int = 2) -> dict:
    """Prefill ``input_ids`` ``(1, n)`` with ``use_cache=True``, then decode ``n_decode`` tokens greedily one at a
    time with the returned cache, timing each step (``time.perf_counter``, after ``warmup`` untimed steps).

    Returns
    -------
    dict
        ``prefill_seconds``; ``step_seconds`` (array of ``n_decode``); ``context_len`` ``n``;
        ``cache_bytes_after_prefill`` and ``cache_bytes`` (after the last step, ``n + warmup + n_decode`` tokens),
        measured by :func:`cache_bytes` (a converted model's states included); ``cache_tokens`` (the cache's length
        at the end); ``tokens`` (the ``1 + warmup + n_decode`` greedy ids: the prefill's, then each step's).
    """
    input_ids = _check_ids(input_ids, min_len=1)
    if input_ids.shape[0] != 1:
        raise ValueError(f"decode_timing times one sequence: input_ids must be (1, n), got {tuple(input_ids.shape)}")
    n_decode = check_positive_int(n_decode, "n_decode")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    steps = _greedy_steps(model, input_ids, warmup + n_decode)
    token, cache, prefill = next(steps)
    after_prefill = cache_bytes(cache)
    seconds, tokens = [], [token]
    for i, (token, latest, step) in enumerate(steps):
        if i >= warmup:
            seconds.append(step)
        tokens.append(token)
        cache = latest                                   # the cache after the last step
    return {"prefill_seconds": prefill, "step_seconds": np.asarray(seconds), "context_len": int(input_ids.shape[1]),
            "cache_bytes_after_prefill": after_prefill, "cache_bytes": cache_bytes(cache),
            "cache_tokens": int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else None,
            "tokens": tokens}


def _greedy_steps(model, input_ids: torch.Tensor, n_steps: int):
    """Greedy decoding with the model's cache: yields ``(token, cache, seconds)`` for the prefill of
    ``input_ids`` ``(1, n)`` (its greedy next token), then for each of ``n_steps`` one-token steps."""
    ids = input_ids.to(_device(model))
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    seconds = time.perf_counter() - start
    cache, key = _cache_of(out)
    token = out.logits[:, -1:].argmax(-1)
    yield int(token), cache, seconds
    for _ in range(n_steps):
        start = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{key: cache})
        seconds = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        cache, key = _cache_of(out)
        yield int(token), cache, seconds


@torch.no_grad()
def greedy_continuation(model, input_ids: torch.Tensor, n_tokens: int) -> np.ndarray:
    """The model's greedy continuation of ``input_ids`` ``(1, n)``: ``n_tokens`` int64 token ids, decoded one at a
    time through the model's own cache (a converted model's fixed-size states: its RNN mode), no end-of-sequence
    stop. Two models' continuations of one prompt are compared by :func:`common_prefix`."""
    input_ids = _check_ids(input_ids, min_len=1)
    if input_ids.shape[0] != 1:
        raise ValueError(f"greedy_continuation continues one sequence: input_ids must be (1, n), got "
                         f"{tuple(input_ids.shape)}")
    n_tokens = check_positive_int(n_tokens, "n_tokens")
    return np.array([token for token, _, _ in _greedy_steps(model, input_ids, n_tokens - 1)], dtype=np.int64)


def common_prefix(a, b) -> int:
    """How many tokens two continuations share before their first difference (``min(len)`` if none)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"continuations must be 1-D token sequences, got shapes {a.shape} and {b.shape}")
    differ = np.flatnonzero(a[:min(len(a), len(b))] != b[:min(len(a), len(b))])
    return int(differ[0]) if differ.size else min(len(a), len(b))


@torch.no_grad()
def greedy_reply(model, tokenizer, message: str, *, max_new_tokens: int = 32) -> str:
    """The model's greedy reply to one user ``message`` under the tokenizer's chat template (special tokens
    removed, stripped)."""
    if not isinstance(message, str) or not message:
        raise ValueError("message must be a non-empty string")
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    inputs = {k: v.to(_device(model)) for k, v in inputs.items()}
    generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
