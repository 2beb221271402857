"""The in-context-learning experiments: smoke presets run through the engine with paired episodes, the exact
reference is stored once per draw, a Nyström map at r = n reproduces it on every stored episode, read-outs fit on
the context only, and figures are written from the datasets alone."""

import numpy as np
import pytest
import torch

from experiments import _icl, icl_classification, icl_recall, icl_regression, rank_summary
from kernapprox import available_estimators, readout
from kernapprox.sweep._experiment import accepts

EXPERIMENTS = [icl_recall, icl_regression, icl_classification, rank_summary]
SCORES = {"icl_recall": ("accuracy", "accuracy_exact"), "icl_regression": ("nmse", "nmse_exact"),
          "icl_classification": ("accuracy", "accuracy_exact"), "rank_summary": ("score", "score_exact")}
NYSTROM = "nystrom_uniform"
CPU = torch.device("cpu")


def run_cell(exp, params, rng, data_rng):
    """One cell as the engine runs it: with its data draw (from the same data stream) where the study declares
    one."""
    if exp.draw is None:
        return exp.run_cell(params, rng, CPU, data_rng)
    state = data_rng.bit_generator.state
    data = exp.draw(params, data_rng, CPU)
    data_rng.bit_generator.state = state                        # the cell gets a fresh data stream, as in the engine
    extra = {"data_rng": data_rng} if accepts(exp.run_cell, "data_rng") else {}
    return exp.run_cell(params, rng, CPU, data=data, **extra)


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.EXPERIMENT.name)
def test_smoke_dataset_and_figure(module, smoke_run, tmp_path):
    _, ds, _ = smoke_run(module.EXPERIMENT.name)
    exp = module.EXPERIMENT
    assert list(ds.sizes)[: len(exp.axes)] == exp.axes
    assert ds.sizes["episode"] == _icl.EPISODES and "seed" in exp.data_axes and "estimator" not in exp.data_axes
    for name, metric in module.METRICS.items():
        assert ds[name].attrs["long_name"] == metric.long_name
    score, exact = SCORES[exp.name]
    assert set(ds[exact].dims) == set(exp.reference_axes) | {"episode"}      # stored once, no estimator axis
    assert ds.state_bytes.notnull().any() and f"{score}_summary" in ds and f"{score}_vs_exact" in ds
    png = tmp_path / "figure.png"
    exp.plot(ds, png)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("module", [icl_recall, icl_regression, icl_classification], ids=lambda m: m.EXPERIMENT.name)
def test_nystrom_at_r_equal_n_reproduces_exact_attention_on_every_stored_episode(module, smoke_run):
    """With every context key as a landmark the read-out is exact attention: the stored per-episode score equals
    the reference's on the same episodes (the pairing the paired differences rely on)."""
    _, ds, _ = smoke_run(module.EXPERIMENT.name)
    score, exact = SCORES[module.EXPERIMENT.name]
    n_axis = "num_pairs" if "num_pairs" in ds.dims else "num_context"
    checked = 0
    for n in ds[n_axis].values:
        if int(n) not in ds.num_features.values:
            continue
        read = ds[score].sel(estimator=NYSTROM, num_features=int(n), **{n_axis: n})
        ref = ds[exact].sel(**{n_axis: n}).broadcast_like(read)
        np.testing.assert_allclose(read.values, ref.values, rtol=1e-5, atol=1e-6)
        checked += read.size
    assert checked >= 32


def test_rank_summary_nystrom_at_r_equal_n_reproduces_exact_attention():
    """rank_summary's tasks are larger than its smoke grid: one cell per task at r = n, against the reference."""
    cpu = torch.device("cpu")
    for task in ("recall", "regression"):
        params = {"task": task, "query": "key", "estimator": NYSTROM, "seed": 0,
                  "num_features": rank_summary.TASKS[task]["num_context"]}
        data = rank_summary.draw(params, np.random.default_rng(5), cpu)      # the engine's draw of the cell's data
        out = rank_summary.run_cell(params, np.random.default_rng(0), cpu, data)
        ref = rank_summary.run_reference(params, cpu, data)
        np.testing.assert_allclose(out["score"], ref["score_exact"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", EXPERIMENTS, ids=lambda m: m.EXPERIMENT.name)
def test_read_outs_fit_on_the_context_only(module, monkeypatch):
    """Every read-out of a study fits data-dependent maps on the context keys (``fit_on="keys"``); only the
    labelled rank-r oracles and the estimators whose definition reads the batch of test queries (LARA, EVA:
    ``_icl.BATCH_READOUTS``, named as such in the studies) see the queries."""
    seen = []
    real = readout.attention_readout

    def spy(*args, fit_on="keys", **kwargs):         # every read-out, paired_readouts' included
        seen.append((args[0], fit_on))
        return real(*args, fit_on=fit_on, **kwargs)

    monkeypatch.setattr(readout, "attention_readout", spy)
    exp = module.EXPERIMENT
    grid = exp.grid("smoke")
    for label in grid["estimator"]:
        params = {**exp.parameter_values(), **{axis: values[0] for axis, values in grid.items()}, "estimator": label}
        run_cell(exp, params, np.random.default_rng(0), np.random.default_rng(1))
    oracles = getattr(module, "ORACLES", {})
    batch = set(_icl.BATCH_READOUTS)
    assert seen and all(fit == ("queries_and_keys" if name in oracles or name in batch else "keys")
                        for name, fit in seen), seen


def test_episode_draw_pairs_read_outs_as_paired_readouts():
    """A draw's ``(read, exact)`` equal :func:`kernapprox.readout.paired_readouts` on its episodes bit for bit;
    exact attention's read-out is computed once per β and equals the read-out of the exact estimator itself."""
    ep = _icl.recall_episodes(32, "key", rng=0, device="cpu", num_queries=16, batch=2)
    draw = _icl.EpisodeDraw(ep, ep.queries, ep.keys, ep.values)
    read, exact = draw.readouts("positive_orthogonal", beta=3.0, num_features=16, rng=np.random.default_rng(4))
    want = readout.paired_readouts("positive_orthogonal", ep.queries, ep.keys, ep.values, beta=3.0, num_features=16,
                                   rng=np.random.default_rng(4))
    for got, expected in zip((read, exact), want):
        torch.testing.assert_close(got.output, expected.output, rtol=0, atol=0)
        torch.testing.assert_close(got.normalizer, expected.normalizer, rtol=0, atol=0)
    assert draw.exact(3.0) is exact and draw.exact(4.0) is not exact
    read, again = draw.readouts("exact", beta=3.0)
    assert again is exact
    torch.testing.assert_close(read.output, exact.output, rtol=0, atol=0)


def test_recall_smoke_values(smoke_run):
    _, ds, _ = smoke_run("icl_recall")
    exact = ds["accuracy_exact"]
    assert float(exact.min()) == 1.0                                             # β = 2 ln n, n ≤ 64
    assert float(ds["state_bytes_exact"].max()) == int(ds.num_pairs.max()) * (64 + 64) * 4
    assert ds.accuracy.sel(estimator="taylor2", num_features=16).isnull().all()   # fixed maps: one column only
    prf = ds.sel(estimator="positive_orthogonal")
    assert float(prf.output_rel_error.min()) > 0 and float(prf.nonpositive_normalizer_rate.max()) == 0.0
    cos = ds["query_cosine"]
    assert float(cos.sel(query="key").min()) == pytest.approx(1.0, abs=1e-6)
    assert 0.7 < float(cos.sel(query="paraphrase").mean()) < 0.95
    # Nyström's memory counts its landmarks and whitening (estimator.state_bytes), beyond the linear state
    nys = float(ds.state_bytes.sel(estimator=NYSTROM, num_features=64, query="key").median())
    assert nys > 64 * (64 + 1) * 4
    diff = ds["accuracy_vs_exact"].sel(estimator=NYSTROM, num_features=64)
    assert float(abs(diff).max()) == 0.0


def test_regression_and_classification_smoke_values(smoke_run):
    _, ds, _ = smoke_run("icl_regression")
    assert 0.0 < float(ds.nmse_exact.min()) < 1.0
    ratio = ds["nmse_vs_exact"].sel(estimator=NYSTROM, num_features=32)
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-5)
    _, ds, _ = smoke_run("icl_classification")
    assert 0.5 <= float(ds.accuracy_exact.mean()) <= 1.0
    assert 0.5 <= float(ds.accuracy_nearest_neighbour.mean()) <= 1.0
    summary = ds["accuracy_exact_summary"]
    assert float(summary.sel(stat="trials").max()) == ds.sizes["seed"] * ds.sizes["episode"] * 32


def test_rank_summary_smoke_values(smoke_run):
    _, ds, _ = smoke_run("rank_summary")
    assert set(ds.task.values) == {"recall", "regression", "classification"}
    prf = ds.sel(estimator="positive_orthogonal", query="key")
    assert bool((prf.output_rel_error > 0).all())
    assert float(ds.score_exact.sel(task="recall").min()) >= 0.99
    # regression and classification query fresh points: only the "key" value of the query axis runs
    assert ds.score.sel(task="regression", query="paraphrase").isnull().all()


def test_cells_are_reproducible_and_not_applicable_cells_are_nan():
    exp = icl_recall.EXPERIMENT
    params = {**exp.parameter_values(), "estimator": "positive_orthogonal", "num_features": 16, "num_pairs": 16,
              "beta_factor": 2.0, "query": "cos0.9", "seed": 0}
    a = run_cell(exp, params, np.random.default_rng(123), np.random.default_rng(7))
    b = run_cell(exp, params, np.random.default_rng(123), np.random.default_rng(7))
    assert set(a) == set(icl_recall.METRICS)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    fixed = run_cell(exp, {**params, "estimator": "taylor2"}, np.random.default_rng(1), np.random.default_rng(7))
    assert all(np.isnan(v) for v in fixed.values())


def test_applicability_rules():
    table = {"taylor2": ("taylor2", {}), "positive": ("positive", {}), "landmarks": ("nystrom_uniform", {})}
    assert _icl.applicable(table, "taylor2", 64, 10)
    assert not _icl.applicable(table, "taylor2", 16, 10)
    assert _icl.applicable(table, "positive", 4096, 10)                # random maps: any r
    if "nystrom_uniform" in available_estimators():
        assert not _icl.applicable(table, "landmarks", 128, 64)       # more landmarks than keys
        assert _icl.applicable(table, "landmarks", 64, 64)


def test_query_axis_values_make_the_promised_episodes():
    for query, cosine in _icl.QUERY_COSINES.items():
        ep = _icl.recall_episodes(32, query, rng=0, device="cpu", num_queries=32, batch=2)
        measured = icl_recall.query_key_cosine(ep)
        if cosine is not None:
            np.testing.assert_allclose(measured, cosine, atol=1e-5)
        else:
            assert bool(((measured > 0.7) & (measured < 0.95)).all())
    with pytest.raises(ValueError, match="query"):
        _icl.recall_episodes(32, "cos0.5", rng=0, device="cpu", num_queries=32)
