"""Small helpers that several test modules share (importable by bare name from every test folder: conftest.py
puts this folder on sys.path)."""

import contextlib
import importlib
import sys
from pathlib import Path

import numpy as np
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def gaussian(shape, seed, std=1.0):
    """Standard normal draws of ``shape`` (times ``std``) from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).standard_normal(shape) * std


def decode_steps(model, tokens, prefill, attention_mask=None):
    """A Hugging Face causal LM's logits of a prefill of ``prefill`` tokens, then one token at a time through the
    returned cache; ``(logits, cache)``."""
    mask = None if attention_mask is None else attention_mask[:, :prefill]
    out = model(input_ids=tokens[:, :prefill], attention_mask=mask, use_cache=True)
    logits, cache = [out.logits], out.cache
    for t in range(prefill, tokens.shape[1]):
        mask = None if attention_mask is None else attention_mask[:, :t + 1]
        out = model(input_ids=tokens[:, t:t + 1], attention_mask=mask, cache=cache, use_cache=True)
        assert out.cache is cache
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


def assert_decode_equals_full_pass(model, tokens, attention_mask, *, prefill: int, tolerance: float):
    """Prefill then token-by-token decoding gives the full pass's logits on the real (unpadded) tokens, finite."""
    real = attention_mask.bool()
    with torch.no_grad():
        full = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits
        got, _ = decode_steps(model, tokens, prefill=prefill, attention_mask=attention_mask)
    assert bool(torch.isfinite(got[real]).all())
    assert float((got - full)[real].abs().max()) < tolerance


def data(shape=(2, 3, 150, 8), seed=0, dtype=torch.float32, std=0.7):
    """Three tensors (q, k, v) of ``shape``: float64 normal draws times ``std`` from a seeded generator, cast to
    ``dtype`` (the fused and native kernels' tests share them)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype) for _ in range(3))


def _rounding_close(got, ref, ref64, what):
    """``got`` (a fused or compiled result) equals the eager ``ref`` to rounding: at most four times the eager result's
    own error against the float64 ``ref64`` plus ``64 ε`` of its largest value."""
    eps = torch.finfo(ref.dtype).eps
    own = float((ref.double() - ref64).abs().max())
    diff = float((got.double() - ref.double()).abs().max())
    bound = 4 * own + 64 * eps * float(ref64.abs().max())
    assert diff <= bound, f"{what}: fused differs from eager by {diff:.3g} > {bound:.3g} (eager's own error {own:.3g})"


@contextlib.contextmanager
def docs_module(name: str):
    """The module ``docs/<name>.py`` (the docs' generators are scripts, not a package), imported with ``docs/`` on
    ``sys.path`` for the duration."""
    sys.path.insert(0, str(DOCS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(DOCS))
