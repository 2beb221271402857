"""Trained causal Transformers: task generators, baselines, deterministic training, the checkpoint cache, post-hoc
substitution and the causal modes of kernel attention inside a model. Tiny models, few steps."""

import dataclasses

import numpy as np
import pytest
import torch

from kernapprox import distributions
from kernapprox.models import (
    AttentionSpec,
    CausalTransformer,
    ModelConfig,
    TrainConfig,
    attention_heads,
    build_model,
    config_key,
    load_or_train,
    presets,
    substitute,
    train,
)
from kernapprox.models import heads as trained_heads
from kernapprox.tasks import MQAR, LinearRegression

TINY_MQAR = MQAR(vocab_size=16, seq_len=16, num_pairs=3)
TINY_MODEL = ModelConfig(d_model=16, num_layers=2, num_heads=2, max_len=16, embed_std=1.0)
TINY_TRAIN = TrainConfig(steps=12, batch_size=8, eval_every=4, eval_size=16, curriculum=((0, 2), (6, 3)), seed=3)


def assert_same_state(a, b):
    """Bitwise the same state dict: every tensor equal, every other entry (the layers' estimator records) equal."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        if isinstance(sa[name], torch.Tensor):
            assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
        else:
            assert sa[name] == sb[name], name


# ------------------------------------------------------------------------------------------------ model
def test_model_is_causal_and_seeded():
    a = CausalTransformer(TINY_MODEL, vocab_size=16, output_dim=16, rng=5)
    b = CausalTransformer(TINY_MODEL, vocab_size=16, output_dim=16, rng=5)
    assert_same_state(a, b)
    x = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 16
    torch.testing.assert_close(a(x)[:, :7], a(y)[:, :7], rtol=0, atol=0)                  # no look-ahead
    assert not torch.equal(a(x)[:, 7:], a(y)[:, 7:])


@pytest.mark.parametrize("estimator,extra", [("positive_orthogonal", {"num_features": 24}), ("elu1", {"qk_dim": 5}),
                                             ("taylor2", {"qk_dim": 3}),
                                             ("window_linear", {"num_features": 16, "options": {"window": 3}})])
def test_kernel_attention_in_model_modes_agree(estimator, extra):
    """The parallel, recurrent and chunked causal modes give one model (float64; chunks of 4 on 13 tokens)."""
    outs = {}
    x = torch.randint(0, 16, (3, 13), generator=torch.Generator().manual_seed(1))
    for mode in ("parallel", "recurrent", "chunked"):
        config = ModelConfig(d_model=16, num_layers=2, num_heads=2, max_len=16, chunk_size=4,
                             attention=AttentionSpec(estimator, mode=mode, **extra))
        model = CausalTransformer(config, vocab_size=16, output_dim=16, rng=7).double()
        outs[mode] = model(x)
    torch.testing.assert_close(outs["chunked"], outs["parallel"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(outs["recurrent"], outs["parallel"], rtol=1e-10, atol=1e-10)


def test_a_trainable_map_is_an_attention_spec_and_trains_with_the_model():
    """AttentionSpec("hedgehog_trainable"): the layer's map is a submodule whose parameters the model's optimiser
    trains (their gradients are non-zero); an unknown name still raises, naming the trainable maps too."""
    config = dataclasses.replace(TINY_MODEL, attention=AttentionSpec("hedgehog_trainable", num_features=8))
    model = CausalTransformer(config, vocab_size=16, output_dim=16, rng=2)
    maps = [name for name, _ in model.named_parameters() if "feature_map" in name]
    assert maps
    x = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    grads = dict(model.named_parameters())
    assert all(float(grads[name].grad.abs().max()) > 0 for name in maps)
    with pytest.raises(ValueError, match="hedgehog_trainable"):
        CausalTransformer(dataclasses.replace(TINY_MODEL, attention=AttentionSpec("no_such_map")), vocab_size=16,
                          output_dim=16, rng=2)


def test_a_projected_fixed_map_runs_the_chunked_mode_on_one_sequence_without_gradients():
    """elu1 behind a q/k projection, causal chunked, one sequence under no_grad (the workspace path, whose
    features come as a strided view of heads) equals the same call with gradients."""
    config = dataclasses.replace(TINY_MODEL, max_len=64, attention=AttentionSpec("elu1", qk_dim=8), chunk_size=16)
    model = CausalTransformer(config, vocab_size=16, output_dim=16, rng=4)
    x = torch.randint(0, 16, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = model(x)
    torch.testing.assert_close(fast, model(x).detach(), rtol=1e-5, atol=1e-6)


def test_exact_substitution_equals_the_reference_bitwise():
    model = build_model(TINY_MODEL, TINY_MQAR, 0)
    b = TINY_MQAR.sample(np.random.default_rng(4), 6)
    ref = model(b.inputs)
    for layers in ({0: AttentionSpec("exact")}, {1: AttentionSpec("exact")},
                   {0: AttentionSpec("exact"), 1: AttentionSpec("exact")}):
        assert torch.equal(substitute(model, layers, rng=0)(b.inputs), ref)
    approx = substitute(model, {1: AttentionSpec("positive_orthogonal", num_features=32)}, rng=0)
    assert not torch.equal(approx(b.inputs), ref)
    assert model.layer_specs()[1].estimator == "exact"                                     # the original is kept


def test_substitution_fits_data_dependent_estimators_on_calibration_prompts():
    model = build_model(TINY_MODEL, TINY_MQAR, 0)
    spec = {0: AttentionSpec("nystrom_uniform", num_features=8)}
    with pytest.raises(ValueError, match="calibration"):
        substitute(model, spec, rng=0)
    calib = TINY_MQAR.sample(np.random.default_rng(5), 4).inputs
    a = substitute(model, spec, rng=0, calibration=calib)
    b = substitute(model, spec, rng=0, calibration=calib)
    x = TINY_MQAR.sample(np.random.default_rng(6), 2).inputs
    assert torch.equal(a(x), b(x))


def test_attention_heads_rebuild_the_layers():
    model = build_model(TINY_MODEL, TINY_MQAR, 2)
    x = TINY_MQAR.sample(np.random.default_rng(7), 3).inputs
    rec = attention_heads(model, x)
    assert rec["q"].shape == (2, 3, 2, 16, 8)
    assert trained_heads._rebuild_error(model, x, rec) < 1e-5


# --------------------------------------------------------------------------------------------- training
def test_training_is_deterministic():
    a = train(TINY_MODEL, TINY_MQAR, TINY_TRAIN)
    b = train(TINY_MODEL, TINY_MQAR, TINY_TRAIN)
    assert_same_state(a.model, b.model)
    for var in ("train_loss", "eval_loss", "eval_score", "lr", "difficulty"):
        np.testing.assert_array_equal(a.curve[var].values, b.curve[var].values)
    np.testing.assert_array_equal(a.curve.step.values, [4, 8, 12])
    np.testing.assert_array_equal(a.curve.difficulty.values, [2, 3, 3])                    # the curriculum
    assert a.curve.attrs["threads"] == 1 and a.curve.attrs["config_key"] == a.key
    other = train(TINY_MODEL, TINY_MQAR, dataclasses.replace(TINY_TRAIN, seed=4))
    assert not torch.equal(other.model.head.weight, a.model.head.weight)


def test_regression_training_follows_its_curriculum():
    """Each curriculum stage is scored with its own task (the paired layout's queries follow its context)."""
    task = LinearRegression(dim=3, num_points=6, num_queries=3, min_points=1)
    config = ModelConfig(d_model=16, num_layers=2, num_heads=2, mlp=True, max_len=9)
    cfg = TrainConfig(steps=8, batch_size=8, eval_every=4, eval_size=16, curriculum=((0, 2), (4, 6)))
    out = train(config, task, cfg)
    assert np.isfinite(out.curve.train_loss.values).all() and np.isfinite(out.curve.eval_score.values).all()
    np.testing.assert_array_equal(out.curve.difficulty.values, [2, 6])


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=100, lr=2e-3, warmup=0.1)
    assert cfg.lr_at(0) == pytest.approx(2e-4) and cfg.lr_at(9) == pytest.approx(2e-3)
    assert cfg.lr_at(10) == pytest.approx(2e-3) and cfg.lr_at(55) == pytest.approx(1e-3)
    assert cfg.lr_at(99) < 1e-5
    assert TrainConfig(schedule="constant", lr=1e-3).lr_at(7) == 1e-3


def test_checkpoint_cache_hit_and_miss(tmp_path):
    first = load_or_train(TINY_MODEL, TINY_MQAR, TINY_TRAIN, cache_dir=tmp_path)
    assert not first.cached
    (entry,) = (tmp_path / "store" / "objects" / "trained_models").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["curve.nc", "weights.pt"]
    again = load_or_train(TINY_MODEL, TINY_MQAR, TINY_TRAIN, cache_dir=tmp_path)
    assert again.cached and again.key == first.key
    assert_same_state(first.model, again.model)
    x = TINY_MQAR.sample(np.random.default_rng(8), 4).inputs
    assert torch.equal(first.model(x), again.model(x))
    np.testing.assert_array_equal(first.curve.eval_score.values, again.curve.eval_score.values)
    assert again.curve.attrs["train_seconds"] == first.curve.attrs["train_seconds"]
    # every part of the configuration is in the key
    changed = [(TINY_MODEL, TINY_MQAR, dataclasses.replace(TINY_TRAIN, lr=2e-3)),
               (dataclasses.replace(TINY_MODEL, mlp=True), TINY_MQAR, TINY_TRAIN),
               (TINY_MODEL, dataclasses.replace(TINY_MQAR, power_a=0.5), TINY_TRAIN),
               (TINY_MODEL, TINY_MQAR, dataclasses.replace(TINY_TRAIN, threads=2))]
    keys = {config_key(*c) for c in changed}
    assert len(keys) == len(changed) and first.key not in keys
    miss = load_or_train(*changed[0], cache_dir=tmp_path)
    assert not miss.cached and miss.key != first.key


def test_checkpoints_go_to_the_cache_root_fsynced(tmp_path, monkeypatch):
    """Without ``cache_dir`` the entry lands in the result store below ``$KERNAPPROX_CACHE_DIR`` (never the working
    directory), and both of its files are fsynced before their folder is renamed into place."""
    import os

    from kernapprox import store as store_module

    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else fd)
        real_fsync(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    trained = load_or_train(TINY_MODEL, TINY_MQAR, TINY_TRAIN)
    (entry,) = (tmp_path / "root" / "store" / "objects" / "trained_models").iterdir()
    assert entry.name.startswith(f"{TINY_MQAR.name}_{trained.key}.")
    assert sorted(p.name for p in entry.iterdir()) == ["curve.nc", "weights.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]                # nothing in the working directory
    files = [str(s) for s in synced if ".tmp-" in str(s)]
    assert sum(s.endswith("weights.pt") for s in files) == 1 and sum(s.endswith("curve.nc") for s in files) == 1


def test_the_paired_regression_preset_flags_its_queries():
    assert presets.regression()[1].query_flag
    assert not presets.regression(layout="interleaved", min_points=None)[1].query_flag


def test_presets_realise_the_feature_dimension():
    assert presets.taylor2_qk_dim(16) == 4 and presets.taylor2_qk_dim(64) == 9     # 15 and 55 features
    model, task, train_cfg = presets.fixed_state("elu1", 16)
    assert model.layer_specs()[0].qk_dim == 16 and task.num_pairs == 8 and model.short_conv == presets.SHORT_CONV
    assert train_cfg.lr == presets.FIXED_STATE_LR["elu1"]
    model, _, train_cfg = presets.fixed_state("window_linear", 32, presets.mqar(steps=40))
    assert dict(model.layer_specs()[1].options) == {"window": presets.WINDOW} and train_cfg.steps == 40
    assert train_cfg.curriculum == ((0, 2), (9, 4), (17, 8))
    assert presets.reference("mqar")[2].curriculum == ((0, 2), (150, 4), (301, 8))


# ------------------------------------------------------------------------------------------ distribution
def test_trained_causal_heads_distribution(tmp_path, monkeypatch):
    def tiny_reference(task_name, **kw):
        return TINY_MODEL, TINY_MQAR, TINY_TRAIN
    monkeypatch.setattr(presets, "reference", tiny_reference)
    dist = distributions.make_distribution("trained_causal", task="mqar", num_prompts=5, cache_dir=tmp_path)
    q, k, v = dist.sample(12, batch=3, heads=4, d=8, rng=0)
    assert q.shape == k.shape == v.shape == (3, 4, 12, 8)
    q2, _, _ = dist.sample(12, batch=3, heads=4, d=8, rng=0)
    assert torch.equal(q, q2)
    stream = trained_heads.load_heads("mqar", 5, tmp_path)
    assert stream["attrs"]["rebuild_max_abs_error"] < 1e-5
    assert stream["q"].shape == (2, 2, 5, 16, 8)
    with pytest.raises(ValueError, match="head dimension"):
        dist.sample(12, d=16, rng=0)
    with pytest.raises(ValueError, match="layer"):
        distributions.make_distribution("trained_causal", layer=2)


# ------------------------------------------------------------------------------------------------ the study
def test_trained_icl_smoke_preset_runs_as_a_script(tmp_path):
    """``python -m experiments.trained_icl --preset smoke`` trains its tiny models into a fresh cache, writes the
    dataset and the figure; exact substitution reproduces the reference's scores exactly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import xarray as xr

    from experiments import trained_icl

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KERNAPPROX_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out, fig = tmp_path / "trained_icl.nc", tmp_path / "trained_icl.png"
    proc = subprocess.run([sys.executable, "-m", "experiments.trained_icl", "--preset", "smoke", "--threads", "1",
                           "--device", "cpu", "--out", str(out), "--figure", str(fig), "--quiet"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert fig.stat().st_size > 10_000
    assert len(list((tmp_path / "cache" / "store" / "objects" / "trained_models").glob("*/weights.pt"))) == 5
    with xr.open_dataset(out, engine="h5netcdf") as ds:
        ds = ds.load()
    exact = ds.sel(estimator="exact", num_features=trained_icl.FIXED_SLOT)
    assert "estimator" not in ds.score_exact.dims                     # the reference: once per data draw
    for sub in ("all", "layer0", "trained"):
        ran = exact.score.sel(substitution=sub).notnull()
        assert bool(ran.any())
        np.testing.assert_array_equal(exact.score.sel(substitution=sub).where(ran).values,
                                      ds.score_exact.broadcast_like(ran).where(ran).values)
        assert float(abs(exact.score_vs_exact.sel(substitution=sub)).max()) == 0.0
    assert float(exact.layer_error.sel(substitution="all").max()) == 0.0
    prf = ds.sel(task="mqar_smoke", estimator="positive_orthogonal", context=4, num_features=16)
    one = ds.sel(task="mqar_smoke", estimator="positive_orthogonal", context=4, num_features=trained_icl.FIXED_SLOT)
    assert float(one.layer_error.sel(substitution="layer0", layer=1).max()) == 0.0   # layer 1 left exact
    assert float(one.layer_error.sel(substitution="layer0", layer=0).min()) > 0.0
    assert bool(prf.proxy_accuracy.sel(substitution="all").notnull().all())
    assert bool(one.proxy_accuracy.sel(substitution="layer0").isnull().all())
    # one layer at a time only at the largest context and r = FIXED_SLOT
    assert ds.score.sel(task="mqar_smoke", substitution="layer0", context=2).isnull().all()
    assert prf.score.sel(substitution="layer0").isnull().all()
    assert ds.score.sel(task="mqar_smoke", substitution="trained", estimator="taylor2" if "taylor2" in
                        ds.estimator.values else "elu1", num_features=64).isnull().all()   # not a trained rank
    reg = ds.sel(task="regression_smoke", context=4)
    assert float(reg.baseline_ls.max()) < 1e-20                                       # k = 4 ≥ d = 3, noiseless
    s = ds.score_summary.sel(task="mqar_smoke", substitution="all", estimator="positive_orthogonal", context=4,
                             num_features=16)
    np.testing.assert_allclose(float(s.sel(stat="estimate")), float(prf.score.sel(substitution="all").mean()))
    text = trained_icl.EXPERIMENT.findings(ds)
    assert "changes no score" in text and text == trained_icl.EXPERIMENT.findings(ds.copy(deep=True))
    from kernapprox import sweep

    closing = sweep.findings_text(trained_icl.EXPERIMENT, ds, "x").split("\n\n")[0].splitlines()[-1]
    assert text.startswith("- ") and "95 % intervals" in closing       # the engine's closing line
    # the default preset has no models trained from scratch (recall_frontier's question): findings and figure
    # without that substitution
    post_hoc = ds.drop_sel(substitution="trained")
    text = trained_icl.EXPERIMENT.findings(post_hoc)
    assert "changes no score" in text and "trained from scratch (" not in text
    trained_icl.EXPERIMENT.plot(post_hoc, tmp_path / "post_hoc.png")
    assert (tmp_path / "post_hoc.png").stat().st_size > 10_000
    assert "trained" not in trained_icl.GRIDS["default"]["substitution"]


def test_trained_icl_cells_read_their_data_draw(tmp_path, monkeypatch):
    """The draw of a data stream (prompts, proxy episodes, the reference model) is the same whenever it is drawn,
    and a cell or the reference gives the same values from any copy of it: nothing but the draw carries state from
    one cell to the next."""
    from experiments import trained_icl
    from kernapprox.sweep import cell_seed_sequence, data_seed_sequence

    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(tmp_path))
    exp = trained_icl.EXPERIMENT
    cpu = torch.device("cpu")
    params = {"task": "mqar_smoke", "substitution": "all", "estimator": "positive_orthogonal", "num_features": 16,
              "context": 4, "seed": 0, **exp.parameter_values()}

    def stream():
        return np.random.default_rng(data_seed_sequence(exp.name, params, exp.data_axes, 0))

    def cell(data):
        rng = np.random.default_rng(cell_seed_sequence(exp.name, {k: params[k] for k in exp.axes}, 0))
        return trained_icl.run_cell(params, rng, cpu, stream(), data)

    first, second = trained_icl.draw(params, stream(), cpu), trained_icl.draw(params, stream(), cpu)
    torch.testing.assert_close(first.prompts.inputs, second.prompts.inputs, rtol=0, atol=0)
    torch.testing.assert_close(first.proxy.keys, second.proxy.keys, rtol=0, atol=0)
    reference = trained_icl.run_reference(params, cpu, stream(), first)
    a, b = cell(first), cell(second)
    for key in ("proxy_accuracy", "score", "layer_error"):
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_array_equal(trained_icl.run_reference(params, cpu, stream(), second)["score_exact"],
                                  reference["score_exact"])
    assert trained_icl.draw({**params, "context": 3}, stream(), cpu) is None      # not a context of the setup


def test_trained_icl_applicable_cells_of_the_default_setups():
    """Which fixed-state models the default MQAR setup trains, and one layer at a time at r = FIXED_SLOT only."""
    from experiments import trained_icl

    mqar = trained_icl.SETUPS["mqar"]
    assert mqar.trains("positive_orthogonal", 16) and mqar.trains("positive_orthogonal", 64)
    assert mqar.trains("taylor2", 16) and not mqar.trains("taylor2", 64)
    assert not mqar.trains("exact", 16) and not mqar.trains("nystrom_uniform", 16)   # not a fixed-state family
    slot = trained_icl.FIXED_SLOT
    assert trained_icl.applicable(mqar, "trained", "exact", slot, 8, 2)
    assert not trained_icl.applicable(mqar, "trained", "elu1", 64, 8, 2)
    assert trained_icl.applicable(mqar, "layer1", "positive_orthogonal", slot, 8, 2)
    assert not trained_icl.applicable(mqar, "layer1", "positive_orthogonal", 16, 8, 2)
    assert not trained_icl.applicable(mqar, "layer1", "positive_orthogonal", slot, 4, 2)   # not the largest context
    assert not trained_icl.applicable(mqar, "layer2", "positive_orthogonal", slot, 8, 2)   # the model has 2 layers
    assert trained_icl.applicable(mqar, "all", "positive_orthogonal", 16, 4, 2)


def test_trained_icl_nystrom_beyond_its_calibration_points_is_not_applicable():
    """The ranks preset asks r = 1024 on the regression task, whose calibration prompts hold fewer queries and keys:
    such a Nyström cell is not applicable (NaN), never an error that stops the preset; random maps are unaffected."""
    from experiments import trained_icl

    task = trained_icl.SETUPS["regression"].build(device="cpu")[1]
    candidates = 2 * trained_icl.EPISODES * task.seq_len
    assert trained_icl.landmarks_available("nystrom_uniform", candidates, task)
    assert not trained_icl.landmarks_available("nystrom_uniform", candidates + 1, task)
    assert trained_icl.landmarks_available("positive_orthogonal", 4 * candidates, task)
    import kernapprox as ka
    q = torch.randn(1, trained_icl.EPISODES * task.seq_len, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="exceeds the number of candidate landmarks"):
        ka.make_estimator("nystrom_uniform", num_features=candidates + 1, rng=0).fit(q, q)
    ka.make_estimator("nystrom_uniform", num_features=candidates, rng=0).fit(q, q)
