"""MiniLM with substituted attention: the exact plan is the model, padding never leaks, placements are what they
say, and the retrieval and memory measures count what they claim."""

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox import real, sweep

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not real.is_available(), reason=real.unavailable_reason() or "")]

if real.is_available():
    from kernapprox import substitution as sub
    from kernapprox.surgery import attention as sa

TEXTS = ["Comparisons can be chained arbitrarily.",
         "The operators compare the values of two objects; the objects do not need to have the same type.",
         "A short one.",
         "Unlike C, all comparison operations in Python have the same priority, which is lower than that of any "
         "arithmetic, shifting or bitwise operation."]


@pytest.fixture(scope="module")
def encoder():
    return sub.load_encoder(torch.float32)


@pytest.fixture(scope="module")
def encoder64():
    return sub.load_encoder(torch.float64)


def own_length(tokenizer, texts=TEXTS):
    return sub.tokenize(tokenizer, texts, bucket_tokens=1)          # one text per bucket: no padding at all


def padded(tokenizer, texts=TEXTS):
    batch = tokenizer(list(texts), padding=True, return_tensors="pt")
    assert bool((batch["attention_mask"] == 0).any())
    return sub.from_batch(batch["input_ids"], batch["attention_mask"])


def model_embeddings(model, tokenizer, texts=TEXTS):
    """The sentence-transformers pipeline of the package: model, mean over real tokens, unit norm."""
    batch = tokenizer(list(texts), padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


# ------------------------------------------------------------------------------------------------- exactness
def test_exact_everywhere_reproduces_the_model_embeddings(encoder):
    model, tokenizer = encoder
    expected = model_embeddings(model, tokenizer)
    inputs = sub.tokenize(tokenizer, TEXTS)
    for plan in (None, sub.plan(sub.Substitution("exact"))):
        run = sub.encode(model, inputs, plan)
        assert run.embeddings.dtype == torch.float32
        assert float((run.embeddings - expected).abs().max()) < 2e-6       # float32 rounding of unit vectors
    assert run.layer_attention_error == {layer: 0.0 for layer in range(sub.NUM_LAYERS)}


def test_the_study_and_ka_convert_are_one_surgery(encoder):
    """MiniLM through its client (layer by layer, per-layer seeds of the substitution) and ka.convert (the model's own
    forward) substitute the same maps and give the same hidden states, bit for bit, padding included."""
    model, tokenizer = encoder
    inputs = padded(tokenizer)
    run = sub.encode(model, inputs, sub.plan(sub.Substitution("positive_orthogonal", num_features=16, rng=7),
                                             layers=[1, 4]))
    converted = ka.convert(model, "positive_orthogonal", num_features=16, layers=[1, 4], rng=7)
    with torch.no_grad():
        hidden = converted(input_ids=inputs.ids[0], attention_mask=inputs.mask[0]).last_hidden_state
    torch.testing.assert_close(hidden, run.hidden[0], rtol=0, atol=0)


def test_exact_plan_has_zero_error_against_the_reference(encoder):
    model, tokenizer = encoder
    inputs = sub.tokenize(tokenizer, TEXTS)
    reference = sub.encode(model, inputs, keep_layer_states=True)
    run = sub.encode(model, inputs, sub.plan(sub.Substitution("exact")), reference=reference)
    assert max(run.hidden_error.values()) < 1e-6 and run.final_state_error < 1e-6
    np.testing.assert_allclose(run.embedding_cosine, 1.0, atol=1e-6)


@pytest.mark.parametrize(("name", "options"), [("exact", {}), ("positive_orthogonal", {}),
                                               ("oprf_orthogonal", {}), ("oprf_orthogonal", {"fit": "sequence"}),
                                               ("nystrom_uniform", {}), ("window_linear", {"options": {"window": 3}})])
def test_padded_and_unpadded_batches_agree(encoder64, name, options):
    """In float64 the padded batch (tokenizer padding) and every text at its own length give the same hidden states
    of real tokens: padded keys never enter an attention and fits see real tokens only, in text order."""
    model, tokenizer = encoder64
    num_features = None if name == "exact" else 16
    plan = sub.plan(sub.Substitution(name, num_features=num_features, rng=3, **options))
    a = sub.encode(model, own_length(tokenizer), plan)
    b = sub.encode(model, padded(tokenizer), plan)
    torch.testing.assert_close(b.embeddings, a.embeddings, rtol=0, atol=1e-10)
    for layer, error in a.layer_attention_error.items():
        assert abs(b.layer_attention_error[layer] - error) < 1e-10 * max(error, 1.0)


def test_masked_feature_attention_is_linear_attention_per_text(encoder64):
    """A substituted layer's output on a padded bucket equals kernapprox.linear_attention run on each text and head
    at its own length (float64, parallel mode), with the same fitted maps, on the layer's own q, k, v."""
    model, tokenizer = encoder64
    inputs = padded(tokenizer)
    subst = sub.Substitution("positive_orthogonal", num_features=24, rng=5)
    layers = sub._Layers(model, inputs)
    hidden = layers.embed()
    call = layers.stack.capture(0, hidden[0], layers.masks[0])
    q, k, v = call.query, call.key, call.value
    seen = []
    module = layers.stack.attention_module(0)
    sa.set_attention(module, sa.SubstitutedAttention(layers._heads(0, hidden, subst),
                                                     observer=lambda c, out: seen.append(out)))
    try:
        layers.stack.layer(0, hidden[0], layers.masks[0])
    finally:
        sa.set_attention(module, None)
    contexts = seen[0]
    for row, n in enumerate(inputs.lengths):
        for head in (0, 7):
            est = layers.fixed[(0, head)]
            expected = ka.linear_attention(q[row, head, :n], k[row, head, :n], v[row, head, :n], est,
                                           mode="parallel")
            torch.testing.assert_close(contexts[row, head, :n], expected, rtol=1e-10, atol=1e-12)
            oracle = ka.linear_attention_naive(q[row, head, :n], k[row, head, :n], v[row, head, :n], est)
            torch.testing.assert_close(contexts[row, head, :n], oracle, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ placements
def test_plans_and_placements():
    s = sub.Substitution("positive", num_features=8)
    assert list(sub.plan(s)) == list(range(6))
    assert list(sub.plan(s, layers=[4, 1])) == [1, 4]
    assert list(sub.plan(s, exact_layers=[0, 5])) == [1, 2, 3, 4]
    assert sub.first_layers(2) == [0, 1] and sub.last_layers(2) == [4, 5] and sub.last_layers(0) == []
    placements = sub.all_placements()
    assert len(placements) == 64 and len(set(placements)) == 64 and placements[0] == () and placements[-1] == (
        0, 1, 2, 3, 4, 5)
    assert sub.placement_label([5, 0]) == "E:0,5" and sub.placement_label([]) == "E:-"
    with pytest.raises(ValueError, match="layers"):
        sub.plan(s, layers=[6])
    with pytest.raises(ValueError, match="not both"):
        sub.plan(s, layers=[1], exact_layers=[2])
    with pytest.raises(ValueError, match="count"):
        sub.first_layers(7)


def test_substitution_validates_its_parameters():
    with pytest.raises(ValueError, match="unknown estimator"):
        sub.Substitution("no_such_map")
    with pytest.raises(TypeError, match="SeedSequence"):
        sub.Substitution("positive", num_features=8, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="fit"):
        sub.Substitution("positive", num_features=8, fit="sometimes")
    with pytest.raises(ValueError, match="fit_points"):
        sub.Substitution("oprf", num_features=8, fit_points=0)
    with pytest.raises(TypeError, match="plan"):
        sub.encode(None, None, {0: "positive"})


def test_head_seeds_do_not_depend_on_the_placement(encoder):
    """Layer 3's random maps are the same draw whether it is substituted alone or with every layer: the layer's
    own error on the exact model's activations is the same in a one-layer plan and in the placement search."""
    model, tokenizer = encoder
    s = sub.Substitution("positive_orthogonal", num_features=16, rng=7)
    seeds = {(layer, head): s.head_seed(layer, head).generate_state(2).tolist()
             for layer in range(6) for head in range(12)}
    assert len({tuple(v) for v in seeds.values()}) == 72
    assert s.head_seed(3, 2).generate_state(2).tolist() == sub.Substitution(
        "positive_orthogonal", num_features=16, rng=7).head_seed(3, 2).generate_state(2).tolist()
    inputs = sub.tokenize(tokenizer, TEXTS)
    reference = sub.encode(model, inputs, keep_layer_states=True)
    alone = sub.encode(model, inputs, sub.plan(s, layers=[3]), reference=reference)
    seen = {}
    sub.search_placements(model, inputs, s, lambda exact, run: seen.setdefault(exact, run), reference=reference)
    assert len(seen) == 64
    searched = seen[(0, 1, 2, 4, 5)]
    assert searched.layer_attention_error == pytest.approx(alone.layer_attention_error, rel=1e-6)
    torch.testing.assert_close(searched.embeddings, alone.embeddings, rtol=0, atol=1e-6)
    for exact_layers in [(), (0, 1), (2, 5)]:
        direct = sub.encode(model, inputs, sub.plan(s, exact_layers=exact_layers), reference=reference)
        torch.testing.assert_close(seen[exact_layers].embeddings, direct.embeddings, rtol=0, atol=1e-6)
        assert seen[exact_layers].final_state_error == pytest.approx(direct.final_state_error, rel=1e-5)
        assert set(seen[exact_layers].layer_attention_error) == set(range(6)) - set(exact_layers)
    assert seen[tuple(range(6))].final_state_error == 0.0
    other = sub.encode(model, inputs, sub.plan(sub.Substitution("positive_orthogonal", num_features=16, rng=8),
                                               layers=[3]), reference=reference)
    assert other.layer_attention_error[3] != alone.layer_attention_error[3]


def test_a_bounded_search_visits_its_placements_once_with_the_full_search_results(encoder, monkeypatch):
    """``placements=`` walks only the prefixes leading to the given placements, visits each once, and every run
    equals the one of the full search (data-independent maps: the same draws whatever else is searched)."""
    model, tokenizer = encoder
    s = sub.Substitution("positive_orthogonal", num_features=16, rng=7)
    inputs = sub.tokenize(tokenizer, TEXTS)
    reference = sub.encode(model, inputs, keep_layer_states=True)
    wanted = sub.hybrid_placements(2)
    naive = {tuple(range(k)) for k in range(7)} | {tuple(range(6 - k, 6)) for k in range(7)}
    assert len(wanted) == 1 + 6 + 15 + 4 + 6 + 1 and set(wanted) >= naive | {(0, 1, 3, 4, 5)}
    assert all(len(p) <= 2 or len(p) >= 5 or p in naive for p in wanted)
    full, bounded, steps = {}, [], []
    sub.search_placements(model, inputs, s, lambda exact, run: full.setdefault(exact, run), reference=reference)
    original = sub._Layers.step

    def counting(self, layer, hidden, substitution):
        steps.append(layer)
        return original(self, layer, hidden, substitution)

    monkeypatch.setattr(sub._Layers, "step", counting)
    sub.search_placements(model, inputs, s, lambda exact, run: bounded.append((exact, run)), reference=reference,
                          placements=wanted)
    monkeypatch.undo()
    assert sorted(p for p, _ in bounded) == sorted(wanted)
    assert len(steps) == 81                                   # of the full walk's 120 non-free layer evaluations
    for exact_layers, run in bounded:
        assert run.final_state_error == full[exact_layers].final_state_error
        torch.testing.assert_close(run.embeddings, full[exact_layers].embeddings, rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least one"):
        sub.search_placements(model, inputs, s, lambda *a: None, reference=reference, placements=[])
    with pytest.raises(ValueError, match="placements"):
        sub.search_placements(model, inputs, s, lambda *a: None, reference=reference, placements=[(7,)])


def test_prefitted_maps_are_used_as_given(encoder):
    model, tokenizer = encoder
    inputs = sub.tokenize(tokenizer, TEXTS)
    s = sub.Substitution("positive_orthogonal", num_features=16, rng=1)
    maps = {(layer, head): s.make(layer, head).fit(torch.zeros(1, 32)) for layer in range(6) for head in range(12)}
    given = sub.encode(model, inputs, sub.plan(sub.Substitution("positive_orthogonal", num_features=16, rng=99,
                                                                maps=maps)))
    drawn = sub.encode(model, inputs, sub.plan(s))
    torch.testing.assert_close(given.embeddings, drawn.embeddings, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer=0, head=0"):
        sub.encode(model, inputs, sub.plan(sub.Substitution("positive", num_features=8, maps={(1, 0): maps[(1, 0)]})))


# -------------------------------------------------------------------------------------------------- measures
def test_retrieval_agreement_counts_neighbours():
    gen = np.random.default_rng(0)
    ref = torch.nn.functional.normalize(torch.from_numpy(gen.standard_normal((24, 8))), dim=-1)
    same = sub.retrieval_agreement(ref, ref, 12, k=3)
    assert same["top1"].tolist() == [1.0] * 12 and same["top_k"].tolist() == [1.0] * 12
    swapped = ref.clone()
    swapped[12:] = ref[12:].flip(0)                                  # documents relabelled: neighbours all differ
    out = sub.retrieval_agreement(swapped, ref, 12, k=12)
    assert out["top_k"].tolist() == [1.0] * 12                       # top-12 of 12 documents is every document
    broken = ref.clone()
    broken[0] = float("nan")
    out = sub.retrieval_agreement(broken, ref, 12, k=3)
    assert out["finite"][0] == 0 and out["top1"][0] == 0 and out["top_k"][0] == 0 and out["finite"][1:].all()
    with pytest.raises(ValueError, match="k=13"):
        sub.retrieval_agreement(ref, ref, 12, k=13)
    with pytest.raises(ValueError, match="finite"):
        sub.retrieval_agreement(ref, broken, 12)


def test_placement_bytes_counts_kv_caches_and_states():
    lens = np.array([10, 40])
    kv = lens * 64 * 4 * 12
    np.testing.assert_array_equal(sub.placement_bytes(None, range(6), lens), 6 * kv)
    s = sub.Substitution("positive_orthogonal", num_features=32)
    state = 12 * 32 * 33 * 4
    np.testing.assert_array_equal(sub.placement_bytes(s, [], lens), [6 * state] * 2)
    np.testing.assert_array_equal(sub.placement_bytes(s, [0, 2], lens), 2 * kv + 4 * state)
    with pytest.raises(ValueError, match="substitution"):
        sub.placement_bytes(None, [0], lens)


def test_retrieval_corpus_is_deterministic_and_held_out():
    corpus = sub.retrieval_corpus(24)
    assert corpus is sub.retrieval_corpus(24) and len(corpus) == 24 and len(corpus.texts) == 48
    _, tokenizer = sub.load_encoder()
    text, _ = real.reference_text()
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    boundary = offsets[sub.FIT_REGION_TOKENS][0]
    assert min(corpus.char_offsets) >= boundary and list(corpus.char_offsets) == sorted(set(corpus.char_offsets))
    for query, doc, offset in zip(corpus.queries, corpus.documents, corpus.char_offsets):
        assert len(query.split()) >= 5
        assert 24 <= len(tokenizer(doc, add_special_tokens=False)["input_ids"]) <= 96
        assert " ".join(text[offset:offset + 3 * len(query)].split()).startswith(query)
    with pytest.raises(ValueError, match="qualify"):
        sub.retrieval_corpus(10_000)


# ------------------------------------------------------------------------------------------------ the study
def test_model_substitution_smoke_preset_runs_from_the_command_line(tmp_path):
    """``python -m experiments.model_substitution --preset smoke`` writes a complete dataset, its figure, and
    findings whose numbers come from the dataset."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image

    from experiments import model_substitution as study

    root = Path(__file__).resolve().parents[1]
    cache = tmp_path / "cache"                       # fitted maps go to a fresh cache; the extraction is reused
    (cache / "real").mkdir(parents=True)
    extraction = real.cache_path(4, 0)
    if extraction.exists():
        (cache / "real" / extraction.name).symlink_to(extraction.resolve())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERNAPPROX_CACHE_DIR": str(cache)}
    out, figure = tmp_path / "x.nc", tmp_path / "x.png"
    done = subprocess.run([sys.executable, "-m", "experiments.model_substitution", "--preset", "smoke", "--threads",
                           "1", "--quiet", "--out", str(out), "--figure", str(figure)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ds = sweep.load(out)
    grid = study.EXPERIMENT.grid("smoke")
    params = study.EXPERIMENT.parameter_values()
    searched = [sub.placement_label(p) for p in sub.hybrid_placements(params["search_max_exact"])]
    assert "estimator" not in ds["exact_self_hit"].dims                        # the reference: once per draw
    for name in grid["estimator"]:
        cell = ds.sel(estimator=name, num_features=32, search=False)
        assert np.isfinite(cell["top1_agreement"].sel(placement="E:-")).all()
        assert cell["heldout_error"].isnull().all()                           # only at r = heldout_rank
        assert np.isfinite(ds["heldout_error"].sel(estimator=name, num_features=params["heldout_rank"],
                                                   search=False)).all()
        assert cell["layer_attention_error"].sel(placement="E:-").notnull().all()
        assert cell["top1_agreement"].sel(placement="E:0").isnull().all()       # only the search runs hybrids
        found = ds.sel(estimator=name, num_features=32, search=True)
        assert found["final_state_error"].sel(placement=searched).notnull().all()
        assert found["final_state_error"].drop_sel(placement=searched).isnull().all()
        assert float(found["final_state_error"].sel(placement="E:0,1,2,3,4,5").max()) == 0.0
        # the search's all-substituted placement is the non-search cell (the same draws)
        np.testing.assert_allclose(found["final_state_error"].sel(placement="E:-"),
                                   cell["final_state_error"].sel(placement="E:-"), rtol=1e-6)
        kv = found["attention_bytes"].sel(placement="E:0,1,2,3,4,5")
        assert float(kv.max()) > 0 and (found["attention_bytes"].sel(placement=searched) <= kv.max() * 10).all()
        np.testing.assert_allclose(float(kv.max()), float(ds["exact_attention_bytes"].max()))
    assert Image.open(figure).info["Description"].startswith("Sentence retrieval")
    text = study.findings(ds)
    assert text == study.findings(ds.copy(deep=True)) and text.count("\n- ") >= 2
    closing = sweep.findings_text(study.EXPERIMENT, ds, "x").split("\n\n")[0].splitlines()[-1]
    assert "Exact model" in text and "exact layer" in text and "95 % intervals" in closing
    s = ds["top10_agreement_summary"].sel(estimator=grid["estimator"][0], num_features=32, search=False,
                                          placement="E:-").squeeze(drop=True)
    per_query = ds["top10_agreement"].sel(estimator=grid["estimator"][0], num_features=32, search=False,
                                          placement="E:-").mean("seed")
    np.testing.assert_allclose(float(s.sel(stat="estimate")), float(per_query.mean()))


# ------------------------------------------------------------------------------------------- maps on windows
def test_fitted_maps_are_cached_without_pickles_and_reload_exactly(tmp_path, monkeypatch):
    s = sub.Substitution("hedgehog", num_features=8, rng=4, options={"num_steps": 2})
    windows = sub.Windows(windows=(0, 1), segment=64, query_stride=2)
    q, k, _ = windows.qkv(2, 3)
    assert q.shape == (16, 32, 32) and k.shape == (16, 64, 32) and q.dtype == torch.float32
    fitted = sub.fit_maps(s, windows, cache=True, cache_dir=tmp_path)
    files = list((tmp_path / "store" / "objects" / "maps").glob("hedgehog_*/maps.npz"))
    assert len(files) == 1 and set(fitted) == {(layer, head) for layer in range(6) for head in range(12)}
    with np.load(files[0], allow_pickle=False) as stored:              # plain arrays only
        assert "L5H11/query_weight_" in stored.files
    record = sub.map_provenance(s, windows, cache_dir=tmp_path)
    assert record["config"]["estimator"] == "hedgehog" and record["config"]["windows"]["segment"] == 64
    assert record["fit_seconds"] > 0 and record["config"]["text_sha256"] == real.load_qkv()["attrs"]["text_sha256"]
    monkeypatch.setattr(sub, "_fit_all", lambda *a: (_ for _ in ()).throw(AssertionError("refitted")))
    loaded = sub.fit_maps(s, windows, cache=True, cache_dir=tmp_path)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    for key in [(0, 0), (3, 7), (5, 11)]:
        torch.testing.assert_close(loaded[key].features(x, "key"), fitted[key].features(x, "key"), rtol=0, atol=0)
    other = sub.Substitution("hedgehog", num_features=8, rng=5, options={"num_steps": 2})
    assert sub.map_provenance(other, windows, cache_dir=tmp_path) is None     # another seed, another entry


def test_heldout_error_of_maps_fitted_on_other_windows():
    maps = sub.fit_maps(sub.Substitution("oprf_orthogonal", num_features=32, rng=0),
                        sub.Windows(windows=(0,), segment=128))
    errors = sub.heldout_attention_error(maps, sub.Windows(windows=(3,)))
    assert errors.shape == (6, 12) and np.isfinite(errors).all() and (errors > 0).all()
    exact = {key: ka.make_estimator("exact").fit(torch.zeros(1, 32)) for key in maps}
    assert np.abs(sub.heldout_attention_error(exact, sub.Windows(windows=(3,)))).max() < 1e-12
    with pytest.raises(ValueError, match="fit region"):
        sub.Windows(num_windows=sub.FIT_REGION_WINDOWS + 1)
    with pytest.raises(ValueError, match="segment"):
        sub.Windows(segment=100)
