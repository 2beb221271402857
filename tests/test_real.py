"""Real attention heads: hooks recover the model's own attention, the cache carries its provenance."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kernapprox import real

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not real.is_available(), reason=real.unavailable_reason() or "")]
REPO = Path(__file__).resolve().parents[1]
CACHE = None                                      # the default: kernapprox.cache.cache_dir("real")


@pytest.fixture(scope="module")
def model64():
    model, tokenizer = real.load_model(torch.float64)
    return model, tokenizer


def test_rebuilt_attention_matches_the_model_context_layer(model64):
    model, tokenizer = model64
    text, _ = real.reference_text()
    batch = tokenizer([text[:400], text[5000:5150]], padding=True, truncation=True, max_length=96,
                      return_tensors="pt")
    mask = batch["attention_mask"]
    assert bool((mask == 0).any())                                    # the second sequence is padded
    rec = real.extract_qkv(model, batch["input_ids"], mask)
    b, length = batch["input_ids"].shape
    assert rec["q"].shape == rec["k"].shape == rec["v"].shape == (b, real.NUM_LAYERS, real.NUM_HEADS, length,
                                                                    real.HEAD_DIM)
    assert rec["context"].shape == (b, real.NUM_LAYERS, length, real.NUM_HEADS * real.HEAD_DIM)
    rebuilt = real.rebuild_context(rec["q"], rec["k"], rec["v"], mask)
    keep = mask.bool()[:, None, :, None].expand_as(rebuilt)           # padded query rows are not used
    scale = rec["context"].abs().amax()
    assert float((rebuilt - rec["context"])[keep].abs().max()) < 1e-10 * float(scale)
    wrong = real.rebuild_context(rec["q"], rec["k"], rec["v"], mask, scale=1.0 / real.HEAD_DIM)
    assert float((wrong - rec["context"])[keep].abs().max()) > 1e-3 * float(scale)   # the check can fail
    # the hooks saw what the model computed: the q projection applied to layer 0's input
    emb = model.embeddings(input_ids=batch["input_ids"])
    q0 = model.encoder.layer[0].attention.self.query(emb)
    q0 = q0.reshape(b, length, real.NUM_HEADS, real.HEAD_DIM).transpose(1, 2)
    torch.testing.assert_close(rec["q"][:, 0], q0, rtol=0, atol=1e-12)


def test_cache_holds_the_stream_and_its_provenance():
    data = real.load_qkv(cache_dir=CACHE)
    attrs = data["attrs"]
    text, source = real.reference_text()
    assert attrs["model_name"] == real.MODEL_NAME
    assert attrs["text_sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert attrs["text_source"] == source and "pydoc_data/topics.py" in source
    assert 100_000 < int(attrs["text_num_tokens"]) < 200_000
    assert float(attrs["rebuild_max_abs_error"]) < 1e-5
    assert {"created", "transformers_version", "torch_version", "model_package", "bidirectional"} <= set(attrs)
    total = 4 * real.WINDOW
    for name in ("q", "k", "v"):
        assert data[name].shape == (real.NUM_LAYERS, real.NUM_HEADS, total, real.HEAD_DIM)
        assert data[name].dtype == np.float32 and np.isfinite(data[name]).all()
    np.testing.assert_array_equal(data["position"][: real.WINDOW + 2], [*range(real.WINDOW), 0, 1])
    assert data["token_id"][0] == 101 and data["token_id"][real.WINDOW - 1] == 102       # [CLS] … [SEP]
    path = real.cache_path(4, 0, CACHE)
    mtime = path.stat().st_mtime
    assert real.load_qkv(cache_dir=CACHE) is data and path.stat().st_mtime == mtime       # reused, not redone


def test_cached_heads_are_the_model_heads_of_their_window(model64):
    # the float32 cache of window 1 equals a float64 rerun of the model on that window's tokens (to float32
    # accuracy), and not the heads of another window
    data = real.load_qkv(cache_dir=CACHE)
    model, _ = model64
    window = slice(real.WINDOW, 2 * real.WINDOW)
    ids = torch.from_numpy(data["token_id"][window].astype(np.int64))[None]
    rec = real.extract_qkv(model, ids)
    for name in ("q", "k", "v"):
        cached = torch.from_numpy(data[name][:, :, window]).double()
        fresh = rec[name][0]
        assert float((cached - fresh).norm() / fresh.norm()) < 1e-4
    other = torch.from_numpy(data["q"][:, :, : real.WINDOW]).double()
    assert float((other - rec["q"][0]).norm() / rec["q"][0].norm()) > 0.1


def test_missing_extra_gives_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "unavailable_reason", lambda: "real attention heads need transformers (install "
                                                            "the extra: pip install 'kernapprox[real]')")
    with pytest.raises(ImportError, match="kernapprox\\[real\\]"):
        real.load_qkv(cache_dir=tmp_path)
    with pytest.raises(ImportError):
        real.load_model()


def test_a_cache_of_another_text_is_extracted_again(monkeypatch):
    real.load_qkv(cache_dir=CACHE)            # the cache exists (this test may run first in its worker)
    calls = []
    monkeypatch.setattr(real, "_text_sha256", lambda: "0" * 64)
    monkeypatch.setattr(real, "extract_windows", lambda *args: calls.append(args))
    real.load_qkv(cache_dir=CACHE)
    assert calls == [(4, 0, CACHE)]
