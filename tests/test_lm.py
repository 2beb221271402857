"""The text windows, recall prompts and evaluations of kernapprox.lm / kernapprox.lm_eval without the real model:
a byte-level BPE tokenizer trained here on Python's help text and a small random Llama stand in for SmolLM2."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from kernapprox import lm, lm_eval

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """A byte-level BPE of 512 tokens trained on the first help topics (deterministic, ~1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [body for _, body in lm.text_documents("python-docs")[:40]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(cfg).eval()


def _documents(n=9, words=400):
    """Documents whose every word names its document: a window's words tell which documents it came from."""
    return [(f"doc{i:02d}", " ".join(f"w{i:02d}x{j % 7}" for j in range(words))) for i in range(n)]


# -------------------------------------------------------------------------------------------------------- text
def test_splits_are_disjoint_and_cover_the_documents():
    docs = _documents(10)
    cal, ev = lm.split_documents(docs, "calibration"), lm.split_documents(docs, "evaluation")
    assert [n for n, _ in cal] == ["doc00", "doc04", "doc08"]
    assert not {n for n, _ in cal} & {n for n, _ in ev}
    assert sorted(cal + ev) == sorted(docs)
    with pytest.raises(ValueError, match="split"):
        lm.split_documents(docs, "train")
    with pytest.raises(ValueError, match="documents"):
        lm.split_documents(docs[:1], "evaluation")


@pytest.mark.parametrize("split", lm.SPLITS)
def test_windows_are_fixed_disjoint_and_from_their_split_only(tokenizer, split):
    docs = _documents(9)
    w = lm.text_windows(tokenizer, 4, 64, source="python-docs", split=split, documents=docs)
    stream = lm.text_stream(tokenizer, source="python-docs", split=split, documents=docs)
    assert w.input_ids.shape == (4, 64) and w.input_ids.dtype == torch.long
    segment = len(stream) // 4
    assert w.starts == tuple(i * segment for i in range(4)) and w.stream_tokens == len(stream)
    for row, start in zip(w.input_ids, w.starts):
        assert row.tolist() == stream[start:start + 64].tolist()
    allowed = {n for n, _ in lm.split_documents(docs, split)}
    seen = {f"doc{word[1:3]}" for row in w.input_ids for word in tokenizer.decode(row).split()
            if len(word) == 5 and word.startswith("w")}
    assert seen and seen <= allowed
    again = lm.text_windows(tokenizer, 4, 64, source="python-docs", split=split, documents=docs)
    assert torch.equal(again.input_ids, w.input_ids) and again.text_sha256 == w.text_sha256
    assert w.attrs()["n_windows"] == 4 and w.attrs()["text_split"] == split


def test_windows_refuse_bad_sizes(tokenizer):
    docs = _documents(5, words=20)
    with pytest.raises(ValueError, match="fewer than n_windows"):
        lm.text_windows(tokenizer, 4, 4096, source="python-docs", documents=docs)
    for bad in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="n_windows"):
            lm.text_windows(tokenizer, bad, 8, source="python-docs", documents=docs)
    with pytest.raises(ValueError, match="source"):
        lm.text_windows(tokenizer, 1, 8, source="wikipedia")


def test_python_docs_source_is_always_there():
    docs = lm.text_documents("python-docs")
    names = [n for n, _ in docs]
    assert names == sorted(names) and len(docs) > 40 and all(body for _, body in docs)
    assert lm.text_unavailable_reason("python-docs") is None


def test_missing_wheels_name_make_lm(monkeypatch):
    monkeypatch.setattr(lm, "MODEL_MODULE", "kernapprox_no_such_model_package")
    assert "make lm" in lm.unavailable_reason() and not lm.is_available()
    with pytest.raises(ImportError, match="make lm"):
        lm.load_smollm2()
    with pytest.raises(ImportError, match="make lm"):
        lm.gguf_path()
    monkeypatch.setattr(lm, "TEXT_MODULE", "kernapprox_no_such_text_package")
    lm.text_documents.cache_clear()
    try:
        assert "make lm" in lm.text_unavailable_reason("shakespeare")
        with pytest.raises(ImportError, match="make lm"):
            lm.text_documents("shakespeare")
    finally:
        lm.text_documents.cache_clear()


def test_load_refuses_bad_arguments():
    with pytest.raises(TypeError, match="dtype"):
        lm.load_smollm2(dtype="float32")
    with pytest.raises(TypeError, match="dtype"):
        lm.load_smollm2(dtype=torch.int64)
    with pytest.raises(ValueError, match="attn_implementation"):
        lm.load_smollm2(attn_implementation="flash")


def test_kv_cache_bytes():
    assert lm.kv_cache_bytes(1) == 30 * 2 * 3 * 64 * 4 == 46_080
    assert lm.kv_cache_bytes(2048) == 2048 * 46_080
    assert lm.kv_cache_bytes(100, dtype=torch.float16, batch=3) == 3 * 100 * 46_080 // 2
    for bad in (0, -5, 1.5):
        with pytest.raises((ValueError, TypeError), match="n_tokens"):
            lm.kv_cache_bytes(bad)
    with pytest.raises(ValueError, match="kv_heads"):
        lm.kv_cache_bytes(8, kv_heads=0)


# ------------------------------------------------------------------------------------------------------ prompts
@pytest.fixture(scope="module")
def filler(tokenizer):
    return lm.text_stream(tokenizer, source="python-docs", split="evaluation")


@pytest.mark.parametrize("context_len", [256, 512, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt(tokenizer, filler, context_len, depth):
    p = lm_eval.passkey_prompt(tokenizer, context_len, filler, depth=depth, seed=3)
    assert len(p.input_ids) == context_len and p.kind == "passkey" and p.context_len == context_len
    key = p.answer.strip()
    assert len(key) == 5 and key.isdigit() and p.candidates == 90_000
    assert p.answer_ids.tolist() == tokenizer(p.answer, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(p.input_ids)
    assert text.count(key) == 2 and text.endswith("What is the pass key? The pass key is")
    assert tokenizer.decode(p.input_ids[p.needle_start:]).startswith(f"The pass key is {key}.")
    def length(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    intro = length(lm_eval._PASSKEY_INTRO)
    n_filler = context_len - intro - length(lm_eval._PASSKEY_QUESTION) - length(
        f"The pass key is {key}. Remember it. {key} is the pass key.\n\n")
    assert 0 <= p.needle_start - intro - round(depth * n_filler) < 64       # moved to a line start at most 64 on
    again = lm_eval.passkey_prompt(tokenizer, context_len, filler, depth=depth, seed=3)
    assert torch.equal(again.input_ids, p.input_ids)
    other = lm_eval.passkey_prompt(tokenizer, context_len, filler, depth=depth, seed=4)
    assert other.answer != p.answer


def test_classic_filler_makes_a_passkey_prompt(tokenizer):
    filler = lm_eval.classic_filler(tokenizer, 600)
    assert len(filler) >= 600 and filler.dtype == np.int64
    assert tokenizer.decode(filler).startswith(lm_eval.CLASSIC_FILLER * 3)
    p = lm_eval.passkey_prompt(tokenizer, 512, filler, depth=0.5, seed=0)
    assert len(p.input_ids) == 512 and "The grass is green." in tokenizer.decode(p.input_ids)
    with pytest.raises((ValueError, TypeError), match="n_tokens"):
        lm_eval.classic_filler(tokenizer, 0)


def test_passkey_depth_orders_the_needle(tokenizer, filler):
    starts = [lm_eval.passkey_prompt(tokenizer, 1024, filler, depth=d, seed=0).needle_start
              for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert starts == sorted(starts) and starts[-1] - starts[0] > 700


def test_passkey_refuses_bad_input(tokenizer, filler):
    with pytest.raises(ValueError, match="no room"):
        lm_eval.passkey_prompt(tokenizer, 20, filler)
    with pytest.raises(ValueError, match="filler"):
        lm_eval.passkey_prompt(tokenizer, 512, filler[:100])
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="depth"):
            lm_eval.passkey_prompt(tokenizer, 512, filler, depth=bad)
    with pytest.raises(ValueError, match="seed"):
        lm_eval.passkey_prompt(tokenizer, 512, filler, seed=-1)


@pytest.mark.parametrize("context_len", [256, 1024])
def test_kv_lookup_prompt(tokenizer, context_len):
    p = lm_eval.kv_lookup_prompt(tokenizer, context_len, seed=5)
    assert context_len - 60 < len(p.input_ids) <= context_len and p.kind == "kv_lookup"
    text = tokenizer.decode(p.input_ids)
    lines = text.split("\n")
    listed = [line for line in lines if line.endswith(".") and "'s locker number is " in line]
    names = [line.split("'s locker")[0] for line in listed]
    numbers = [line.rsplit(" ", 1)[1].rstrip(".") for line in listed]
    assert len(names) == len(set(names)) > 5 and len(numbers) == len(set(numbers))
    assert p.candidates == len(listed)                               # chance: one of the listed numbers
    asked = lines[-2].removeprefix("Question: What is ").removesuffix("'s locker number?")
    assert asked in names and numbers[names.index(asked)] == p.answer.strip()
    assert tokenizer.decode(p.input_ids[p.needle_start:]).startswith(f"{asked}'s locker number is{p.answer}.")
    assert text.endswith(f"Answer: {asked}'s locker number is")
    again = lm_eval.kv_lookup_prompt(tokenizer, context_len, seed=5)
    assert torch.equal(again.input_ids, p.input_ids)
    first = lm_eval.kv_lookup_prompt(tokenizer, context_len, depth=0.0, seed=5)
    last = lm_eval.kv_lookup_prompt(tokenizer, context_len, depth=1.0, seed=5)
    assert first.needle_start == len(tokenizer(lm_eval._KV_INTRO, add_special_tokens=False)["input_ids"])
    last_listed = [line for line in tokenizer.decode(last.input_ids).split("\n") if line.endswith(".")][-1]
    assert tokenizer.decode(last.input_ids[last.needle_start:]).startswith(last_listed)
    with pytest.raises(ValueError, match="fewer than 2"):
        lm_eval.kv_lookup_prompt(tokenizer, 40)


# -------------------------------------------------------------------------------------------------- evaluations
def test_token_nll_is_the_models_cross_entropy(model, tokenizer):
    ids = lm.text_windows(tokenizer, 3, 96, source="python-docs").input_ids
    nll = lm_eval.token_nll(model, ids, batch_size=2)
    assert nll.shape == (3, 95) and nll.dtype == np.float64
    with torch.no_grad():
        for w in range(3):
            loss = model(input_ids=ids[w:w + 1], labels=ids[w:w + 1]).loss
            assert nll[w].mean() == pytest.approx(float(loss), rel=1e-5)
    with pytest.raises(TypeError, match="input_ids"):
        lm_eval.token_nll(model, ids.tolist())
    with pytest.raises(ValueError, match="input_ids"):
        lm_eval.token_nll(model, ids[:, :1])
    with pytest.raises(ValueError, match="input_ids"):
        lm_eval.token_nll(model, ids.float())
    again, greedy = lm_eval.token_nll(model, ids, return_argmax=True)        # the same NLL, and the greedy choices
    np.testing.assert_array_equal(again, nll)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits[:, :-1].argmax(-1).numpy()
    assert greedy.dtype == np.int64 and greedy.shape == (3, 95)
    np.testing.assert_array_equal(greedy, want)
    with pytest.raises(TypeError, match="return_argmax"):
        lm_eval.token_nll(model, ids, return_argmax=1)


def test_nll_summary():
    rng = np.random.default_rng(0)
    nll = rng.exponential(2.0, size=(12, 50))
    s = lm_eval.nll_summary(nll)
    est, lo, hi = (float(s.perplexity.sel(stat=k)) for k in ("estimate", "lo", "hi"))
    assert est == pytest.approx(np.exp(nll.mean()))
    assert lo < est < hi
    assert float(s.mean_nll.sel(stat="count")) == 12
    np.testing.assert_allclose(s.window_nll.values, nll.mean(1))
    with pytest.raises(ValueError, match="n_windows"):
        lm_eval.nll_summary(nll[:1])
    bad = nll.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        lm_eval.nll_summary(bad)


def _greedy(model, ids, n):
    out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):]


def test_score_recall_against_explicit_decoding(model, tokenizer, filler):
    p = lm_eval.passkey_prompt(tokenizer, 256, filler, seed=1)
    greedy = _greedy(model, p.input_ids, 4)
    hit = lm_eval.RecallPrompt(p.input_ids, greedy, tokenizer.decode(greedy), p.needle_start, "passkey", 256, 1)
    wrong = greedy.clone()
    wrong[-1] = (wrong[-1] + 1) % len(tokenizer)
    miss = lm_eval.RecallPrompt(p.input_ids, wrong, tokenizer.decode(wrong), p.needle_start, "passkey", 256, 1)
    scores = lm_eval.score_recall(model, [hit, miss, p])
    assert scores["greedy_correct"][:2].tolist() == [True, False]
    assert scores["first_token_rank"][0] == 0
    with torch.no_grad():                                   # the answer's log-probability from all the logits
        for i, prompt in enumerate((hit, miss, p)):
            ids = torch.cat([prompt.input_ids, prompt.answer_ids])
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)
            a = len(prompt.answer_ids)
            pos = torch.arange(len(ids) - a - 1, len(ids) - 1)
            expected = float(logp[pos, ids[-a:]].sum())
            assert scores["answer_logprob"][i] == pytest.approx(expected, abs=1e-4)
    assert scores["answer_logprob"][0] > scores["answer_logprob"][1]
    summary = lm_eval.recall_summary(scores)
    assert summary["prompts"] == 3 and summary["accuracy_lo"] <= summary["accuracy"] <= summary["accuracy_hi"]
    with pytest.raises(TypeError, match="RecallPrompt"):
        lm_eval.score_recall(model, [])


def test_decode_timing_follows_the_greedy_path_and_measures_the_cache(model, tokenizer):
    ids = lm.text_windows(tokenizer, 1, 100, source="python-docs").input_ids
    r = lm_eval.decode_timing(model, ids, n_decode=5, warmup=2)
    assert r["step_seconds"].shape == (5,) and (r["step_seconds"] > 0).all() and r["prefill_seconds"] > 0
    assert r["tokens"] == _greedy(model, ids[0], 8).tolist()
    assert r["cache_tokens"] == 100 + 7
    # 2 layers x (K, V) x 2 kv heads x head dim 8 x tokens x 4 bytes: the formula of kv_cache_bytes
    assert r["cache_bytes_after_prefill"] == lm.kv_cache_bytes(100, layers=2, kv_heads=2, head_dim=8)
    assert r["cache_bytes"] == lm.kv_cache_bytes(107, layers=2, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="one sequence"):
        lm_eval.decode_timing(model, ids.repeat(2, 1))
    with pytest.raises(TypeError, match="cache type"):
        lm_eval.cache_bytes(object())


def test_greedy_continuation_is_the_explicit_greedy_path_and_common_prefix_counts_agreement(model, tokenizer):
    ids = lm.text_windows(tokenizer, 1, 60, source="python-docs").input_ids
    got = lm_eval.greedy_continuation(model, ids, 6)
    assert got.dtype == np.int64 and got.tolist() == _greedy(model, ids[0], 6).tolist()
    assert lm_eval.common_prefix(got, got) == 6
    assert lm_eval.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and lm_eval.common_prefix([5], [6, 7]) == 0
    assert lm_eval.common_prefix([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError, match="one sequence"):
        lm_eval.greedy_continuation(model, ids.repeat(2, 1), 3)
    with pytest.raises(ValueError, match="n_tokens"):
        lm_eval.greedy_continuation(model, ids, 0)
    with pytest.raises(ValueError, match="1-D"):
        lm_eval.common_prefix([[1]], [1])


def test_greedy_reply_uses_the_chat_template(model, tokenizer):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    reply = lm_eval.greedy_reply(model, tok, "What is the capital of France?", max_new_tokens=3)
    prompt = tok("user: What is the capital of France?\nassistant:", return_tensors="pt")["input_ids"][0]
    assert reply == tok.decode(_greedy(model, prompt, 3), skip_special_tokens=True).strip()
    with pytest.raises(ValueError, match="message"):
        lm_eval.greedy_reply(model, tok, "")
