"""SmolLM2-135M itself (marker ``lm``; skipped without ``make lm``): the converted model's architecture, its cache and
provenance, its perplexity on Python's inspect.py, its chat answer, its KV cache, and the Shakespeare text.

The model loads once per test process through the user's cache root (tests/conftest.py says why); every test of
this file runs in one xdist group, so ``make test``'s two workers load it once."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
from pathlib import Path

import pytest
import torch

from kernapprox import lm, lm_eval

pytestmark = [pytest.mark.lm, pytest.mark.xdist_group("smollm2"),
              pytest.mark.skipif(not lm.is_available(), reason=str(lm.unavailable_reason()))]

# Python 3.11.7's inspect.py: the text on which 9.8633 was measured (transformers 5.24, torch 2.13 CPU)
INSPECT_SHA256 = "d55ac82f84e5c93953e9f5852ec255957e6c12f47d5cc0ea456447319da0f5af"
INSPECT_PERPLEXITY = 9.8633


@pytest.fixture(scope="module")
def smollm2(user_cache_root):
    return lm.load_smollm2(cache_root=user_cache_root, return_info=True)


def test_the_model_is_smollm2_135m(smollm2):
    model, tokenizer, _ = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size) == (lm.NUM_LAYERS, lm.NUM_HEADS, lm.NUM_KV_HEADS, lm.HEAD_DIM, lm.VOCAB_SIZE)
    assert config.hidden_size == 576 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(tokenizer) == lm.VOCAB_SIZE


def test_the_cache_holds_the_converted_model_with_its_provenance(smollm2, user_cache_root):
    _, _, info = smollm2
    gguf = lm.gguf_path()
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    record = info["provenance"]
    assert record["gguf_sha256"] == sha and record["gguf_bytes"] == gguf.stat().st_size
    assert record["model_package"] == f"{lm.MODEL_PACKAGE} {lm.MODEL_VERSION}"
    assert record["transformers_version"] == importlib.metadata.version("transformers")
    folder = Path(info["folder"])
    assert folder.parent == Path(user_cache_root) / "lm" and sha[:16] in folder.name
    assert {"config.json", "model.safetensors", "tokenizer.json", "provenance.json"} <= {p.name for p in
                                                                                        folder.iterdir()}
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]          # no half-written conversion
    _, _, again = lm.load_smollm2(cache_root=user_cache_root, return_info=True)
    assert again["cold"] is False and again["folder"] == info["folder"]


@pytest.mark.skipif(hashlib.sha256(Path(inspect.__file__).read_bytes()).hexdigest() != INSPECT_SHA256,
                    reason="another Python's inspect.py: the reference perplexity was measured on 3.11.7's")
def test_perplexity_on_the_inspect_source(smollm2):
    model, tokenizer, _ = smollm2
    ids = tokenizer(Path(inspect.__file__).read_text(encoding="utf-8"))["input_ids"][:2048]
    assert len(ids) == 2048
    nll = lm_eval.token_nll(model, torch.tensor([ids]))
    assert float(torch.tensor(nll).mean().exp()) == pytest.approx(INSPECT_PERPLEXITY, abs=2e-3)


def test_the_greedy_chat_answer(smollm2):
    model, tokenizer, _ = smollm2
    assert lm_eval.greedy_reply(model, tokenizer, "What is the capital of France?") == \
        "The capital of France is Paris."


def test_the_kv_cache_is_what_kv_cache_bytes_says(smollm2):
    model, tokenizer, _ = smollm2
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt")["input_ids"][:, :64]
    r = lm_eval.decode_timing(model, ids, n_decode=2, warmup=0)
    assert r["cache_bytes_after_prefill"] == lm.kv_cache_bytes(64) == 64 * 46_080
    assert r["cache_bytes"] == lm.kv_cache_bytes(66)
    # the keyword the installed transformers takes the cache by (cache in transformers 5, else past_key_values)
    keyword = lm_eval.cache_keyword(model)
    assert keyword in ("cache", "past_key_values") and keyword in inspect.signature(model.forward).parameters


@pytest.mark.skipif(lm.text_unavailable_reason("shakespeare") is not None,
                    reason=str(lm.text_unavailable_reason("shakespeare")))
def test_the_shakespeare_text(smollm2):
    _, tokenizer, _ = smollm2
    docs = lm.text_documents("shakespeare")
    names = [n for n, _ in docs]
    assert len(docs) == 42 and {"hamlet", "sonnets", "tempest"} <= set(names)
    assert all(body and not body.endswith("'''") for _, body in docs)
    cal = {n for n, _ in lm.split_documents(docs, "calibration")}
    ev = {n for n, _ in lm.split_documents(docs, "evaluation")}
    assert len(cal) == 11 and len(ev) == 31 and not cal & ev
    w = lm.text_windows(tokenizer, 4, 512, source="shakespeare", split="calibration")
    assert w.input_ids.shape == (4, 512) and set(w.documents) == cal
    assert "Ham." not in "".join(tokenizer.decode(row) for row in w.input_ids)        # Hamlet is evaluation text


@pytest.mark.skipif(lm.text_unavailable_reason("shakespeare") is not None,
                    reason=str(lm.text_unavailable_reason("shakespeare")))
def test_the_exact_model_finds_a_passkey_in_512_tokens_of_shakespeare(smollm2):
    model, tokenizer, _ = smollm2
    filler = lm.text_stream(tokenizer, source="shakespeare", split="evaluation")
    prompt = lm_eval.passkey_prompt(tokenizer, 512, filler, depth=0.1, seed=0)
    scores = lm_eval.score_recall(model, [prompt])
    assert scores["greedy_correct"][0] and scores["answer_logprob"][0] > -3.0
