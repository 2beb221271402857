"""Next-step prediction of a real sequence (kernapprox.tasks.sequence): the synthetic reference against its
covariance, the split, the residual read-out and the trivial baselines against their definitions, bad input, and
the modality-spectrum study's smoke run."""

import numpy as np
import pytest
import torch

from kernapprox.models.training import TrainConfig, config_key
from kernapprox.models.transformer import ModelConfig
from kernapprox.tasks import NextStep, make_task
from kernapprox.tasks.sequence import gp_trajectory, load_sequence, unavailable_reason, zipf_markov_tokens


def test_gp_trajectory_has_the_squared_exponential_autocorrelation():
    # Bartlett's formula: var(r_k) ≈ (1/T) Σ_j (ρ_j² + ρ_{j+k}ρ_{j−k} − 4ρ_kρ_jρ_{j−k} + 2ρ_k²ρ_j²); over C
    # independent channels the mean's standard error is sqrt(var / C). Tolerance: 5 standard errors.
    T, C, ell = 2**16, 16, 6.0
    x = gp_trajectory(T, C, ell, seed=3)
    assert x.shape == (T, C)
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(x.std(0), 1.0, rtol=1e-12)
    j = np.arange(-200, 201)

    def rho(t):
        return np.exp(-np.asarray(t, dtype=float) ** 2 / (2 * ell**2))

    for lag in (1, 3, 6, 12):
        r = np.mean([np.mean(x[:-lag, c] * x[lag:, c]) for c in range(C)])
        var = np.sum(rho(j) ** 2 + rho(j + lag) * rho(j - lag) - 4 * rho(lag) * rho(j) * rho(j - lag)
                     + 2 * rho(lag) ** 2 * rho(j) ** 2) / T
        assert abs(r - rho(lag)) < 5 * np.sqrt(var / C), (lag, r, rho(lag))


@pytest.mark.parametrize("bad", [{"length": 0}, {"channels": -1}, {"length_scale": 0.0}, {"length_scale": np.nan}])
def test_gp_trajectory_rejects_bad_arguments(bad):
    args = {"length": 64, "channels": 2, "length_scale": 2.0} | bad
    with pytest.raises(ValueError):
        gp_trajectory(**args)


def test_zipf_markov_tokens_follow_zipfs_law_given_the_previous_token():
    """Per previous token, the next tokens' counts sorted in decreasing order, pooled over the previous tokens: the
    share of rank k is Zipf's k^-1 / H_256 (at ~1000 draws per previous token, ranks 1-3 almost never swap places
    in the sort). Tolerance: 6 binomial standard errors of the pooled share (4e-3 for rank 1 at this length)."""
    V, T = 256, 2**18
    x = zipf_markov_tokens(T, V, 1.0, seed=5)
    assert x.dtype == np.int64 and x.min() >= 0 and x.max() < V
    np.testing.assert_array_equal(x, zipf_markov_tokens(T, V, 1.0, seed=5))
    counts = np.zeros((V, V))
    np.add.at(counts, (x[:-1], x[1:]), 1)
    ranked = -np.sort(-counts, axis=1).sum(0) / (T - 1)
    law = np.arange(1, V + 1) ** -1.0 / np.sum(np.arange(1, V + 1) ** -1.0)
    for k in (0, 1, 2):
        se = np.sqrt(law[k] * (1 - law[k]) / T)
        assert abs(ranked[k] - law[k]) < 6 * se, (k, ranked[k], law[k])
    # the unigram law is near uniform (each token is the successor of every previous token at a random rank): the
    # context is where the gain is
    unigram = np.bincount(x, minlength=V) / T
    assert -np.sum(unigram * np.log(unigram)) > np.log(V) - 0.1
    for bad in ({"length": 0}, {"vocab_size": 0}, {"exponent": 0.0}, {"exponent": np.nan}):
        with pytest.raises(ValueError):
            zipf_markov_tokens(**({"length": 8} | bad))
    data = load_sequence("zipf_markov")
    assert data.kind == "tokens" and data.vocab_size == 256 and data.modality == "synthetic"


@pytest.mark.parametrize("kwargs, match", [({"source": "podcast"}, "source"), ({"seq_len": 0}, "seq_len"),
                                           ({"eval_fraction": 1.0}, "eval_fraction")])
def test_next_step_rejects_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NextStep(**({"source": "gp_l8"} | kwargs))


def test_training_and_evaluation_windows_never_share_a_step():
    task = NextStep("gp_l8", seq_len=64)
    values = load_sequence("gp_l8").values
    cut = int(round(values.shape[0] * (1 - task.eval_fraction)))
    train = task.sample(np.random.default_rng(0), 512)
    held = task.evaluation().sample(np.random.default_rng(1), 512)
    fixed = task.eval_windows(8)
    rows = {tuple(np.round(v, 12)): i for i, v in enumerate(values)}
    train_idx = np.array([rows[tuple(np.round(v, 12))] for v in train.targets.reshape(-1, 16).numpy()])
    held_idx = np.array([rows[tuple(np.round(v, 12))] for v in held.targets.reshape(-1, 16).numpy()[::97]])
    assert train_idx.max() < cut and held_idx.min() >= cut
    # targets are the inputs one step later
    np.testing.assert_allclose(train.targets[:, :-1].numpy(), train.inputs[:, 1:].double().numpy(), atol=1e-6)
    assert fixed.inputs.shape == (8, 64, 16) and fixed.targets.dtype == torch.float64


def test_zero_output_is_persistence_and_baselines_match_their_definitions():
    task = NextStep("gp_l8", seq_len=32)
    batch = task.eval_windows(4)
    base = task.baseline_losses(batch)
    zero = torch.zeros(4, 32, 16, dtype=torch.float64)
    np.testing.assert_allclose(task.position_losses(zero, batch).numpy(), base["previous"].numpy(), rtol=1e-6)
    train = load_sequence("gp_l8").values[:int(round(32768 * 0.75))]
    want = ((batch.targets.numpy() - train.mean(0)) ** 2).mean(-1)
    np.testing.assert_allclose(base["mean"].numpy(), want, rtol=1e-12)
    assert float(task.loss(zero, batch)) == pytest.approx(float(base["previous"].mean()), rel=1e-5)


@pytest.mark.lm
def test_text_bytes_uniform_logits_cost_log_256_and_unigram_is_better():
    if unavailable_reason("text") is not None:
        pytest.skip(unavailable_reason("text"))
    task = NextStep("text", seq_len=64)
    batch = task.eval_windows(4)
    assert batch.inputs.dtype == torch.int64 and int(batch.inputs.max()) < 256
    uniform = torch.zeros(4, 64, 256)
    assert float(task.loss(uniform, batch)) == pytest.approx(np.log(256), rel=1e-6)
    assert float(task.baseline_losses(batch)["unigram"].mean()) < np.log(256)
    assert task.model_io == {"vocab_size": 256, "input_dim": None, "output_dim": 256}


def test_the_cache_key_names_the_source_and_its_data():
    a, b = NextStep("gp_l8", seq_len=32), NextStep("gp_l8", seq_len=64)
    assert a.to_dict()["data_sha256"] == load_sequence("gp_l8").attrs["data_sha256"]
    model, train = ModelConfig(d_model=16, num_layers=1, num_heads=2, max_len=64), TrainConfig(steps=2)
    assert config_key(model, a, train) != config_key(model, b, train)
    assert make_task("next_step", source="gp_l8", seq_len=32) == a


def test_modality_spectrum_smoke(smoke_run):
    _, ds, _ = smoke_run("modality_spectrum")
    assert "gp_l8" in ds.source.values
    gp = ds.sel(source="gp_l8", target=0.01).isel(context=0, train_steps=0)
    rank = gp["rank_attention"].sel(seq_len=32)
    assert bool((rank >= 1).all()) and bool((rank <= 32).all())
    # 10 % needs no more than 1 %; the kernel and attention ranks are ranks of n × n matrices
    at32 = ds["rank_attention"].sel(seq_len=32)
    assert bool((at32.sel(target=0.1) <= at32.sel(target=0.01)).all())
    assert bool(np.isnan(gp["rank_attention"].sel(seq_len=64)).all())          # beyond the context: not computed
    assert float(gp["scratch_state_bytes"].isel(train_seed=0)) == 2 * 4 * 16 * 17 * 4
