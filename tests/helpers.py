"""Small helpers that several test modules share (importable because pytest puts this folder on sys.path)."""

import numpy as np
import torch


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
