"""experiments.distillation: the gap-closed statistic against its definition, the cells that apply, and the smoke
preset on SmolLM2-135M end to end (marker ``lm``): every student is scored on the teacher's tokens, the objectives
train on the same windows at the same budget, and the findings come from the dataset."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import distillation
from kernapprox import lm, sweep


def test_gap_closed_is_the_share_of_the_post_hoc_gap_the_student_closes():
    exact = np.array([3.0, 3.2, 2.9, 3.1])
    posthoc = exact + np.array([2.0, 2.2, 1.8, 2.0])
    student = exact + 0.25 * (posthoc - exact)
    est, lo, hi = distillation.gap_closed(student, posthoc, exact)
    assert est == pytest.approx(0.75) and lo == pytest.approx(0.75) and hi == pytest.approx(0.75)
    est, lo, hi = distillation.gap_closed(posthoc, posthoc, exact)
    assert est == pytest.approx(0.0)
    noisy = student + np.array([0.3, -0.3, 0.2, -0.2])
    est, lo, hi = distillation.gap_closed(noisy, posthoc, exact)
    assert est == pytest.approx(1 - np.mean(noisy - exact) / np.mean(posthoc - exact)) and lo < est < hi
    assert np.isnan(distillation.gap_closed(student * np.nan, posthoc, exact)[0])
    # several seeds: rows are the units, their windows pooled; the estimate is the pooled ratio
    rows_student, rows_posthoc = np.stack([student, noisy]), np.stack([posthoc, posthoc + 0.5])
    est, lo, hi = distillation.gap_closed(rows_student, rows_posthoc, exact)
    assert est == pytest.approx(1 - np.mean(rows_student - exact) / np.mean(rows_posthoc - exact))
    assert lo <= est <= hi


def test_only_the_trainable_maps_train_and_bad_cells_are_refused():
    base = {"student": "hedgehog", "fit_loss": "weights", "objective": "distill", "num_features": 64, "steps": 4,
            "context": 256, "train_seed": 0}
    assert distillation.applicable(base)
    assert distillation.applicable({**base, "fit_loss": "outputs", "objective": "none"})
    assert distillation.applicable({**base, "student": "positive_orthogonal", "objective": "none"})
    assert not distillation.applicable({**base, "student": "positive_orthogonal"})
    assert distillation.applicable({**base, "student": "t2r"})
    distillation.check_params({**base, "student": "t2r", "num_features": 33})      # T2R's r need not be even
    assert not distillation.applicable({**base, "student": "nystrom_uniform", "objective": "none",
                                        "fit_loss": "outputs"})
    assert distillation.applicable({**base, "student": "window_hedgehog"})          # the hybrid has a stage 2
    assert distillation.applicable({**base, "student": "window_hedgehog", "fit_loss": "outputs"})   # and both losses
    assert distillation.trained_map({**base, "student": "window_hedgehog", "hybrid_window": 16}) == (
        "hedgehog_trainable", {"window": 16})
    with pytest.raises(ValueError, match="num_features"):
        distillation.check_params({**base, "student": "window_hedgehog", "num_features": 33})
    for change, word in (({"student": "elu"}, "student"), ({"objective": "kl"}, "objective"),
                         ({"fit_loss": "mse"}, "fit_loss"), ({"context": 64}, "context"),
                         ({"num_features": 33}, "num_features")):
        with pytest.raises(ValueError, match=word):
            distillation.check_params({**base, **change})


@pytest.mark.lm
@pytest.mark.xdist_group("smollm2")
@pytest.mark.skipif(not lm.is_available(), reason=str(lm.unavailable_reason()))
def test_smoke_preset_trains_and_scores_every_student(tmp_path, monkeypatch, user_cache_root):
    load = lm.load_smollm2
    monkeypatch.setattr(lm, "load_smollm2", lambda **kw: load(cache_root=user_cache_root, **kw))
    ds = sweep.run(distillation.EXPERIMENT, preset="smoke", out=tmp_path / "distillation.nc", device="cpu",
                   progress=False, parameters={"n_windows": 4, "n_prompts": 4, "train_windows": 4})
    r, steps = 32, 2
    hedgehog = dict(student="hedgehog", fit_loss="weights", num_features=r, steps=steps, context=96, train_seed=0)
    assert float(ds["state_bytes"].sel(objective="none", **hedgehog)) == 30 * 3 * r * 65 * 4
    t2r = dict(hedgehog, student="t2r")           # T2R's relu map keeps the same state as any r-feature map
    assert float(ds["state_bytes"].sel(objective="none", **t2r)) == 30 * 3 * r * 65 * 4
    assert np.isfinite(ds["nll"].sel(objective="none", checkpoint=0.0, **t2r)).all()
    assert np.isfinite(ds["train_loss"].sel(objective="distill", **t2r)).all()
    assert float(ds["stage1_tokens"].sel(objective="none", **t2r)) > 0
    # the window hybrid: its window's keys and values (min(w, n) (d + d_v) per key/value head) beside the linear
    # state, a stage-1 fit inside the hybrid with its cost, and a stage 2 through it (the adapters train)
    hybrid = dict(hedgehog, student="window_hedgehog")
    window = min(int(ds["hybrid_window"]), 96)
    assert float(ds["state_bytes"].sel(objective="none", **hybrid)) == 30 * 3 * (r * 65 + window * 128) * 4
    assert float(ds["stage1_cpu_seconds"].sel(objective="none", **hybrid)) > 0
    assert float(ds["stage1_tokens"].sel(objective="none", **hybrid)) == (
        int(ds["fit_steps"]) * int(ds["n_calibration"]) * 96 * 30)          # steps x positions x layers
    assert np.isfinite(ds["nll"].sel(objective="none", checkpoint=0.0, **hybrid)).all()
    assert np.isfinite(ds["train_loss"].sel(objective="next_token", **hybrid)).all()
    assert np.isfinite(ds["nll"].sel(objective="distill", checkpoint=1.0, **hybrid)).all()
    for objective in ("next_token", "distill"):
        cell = dict(hedgehog, objective=objective)
        assert np.isfinite(ds["train_loss"].sel(**cell)).all() and ds["train_loss"].sizes["step"] == steps
        assert float(ds["stage2_tokens"].sel(**cell)) == steps * (int(ds["train_len"]) - 1)
        assert np.isfinite(ds["nll"].sel(**cell, checkpoint=1.0)).all()
        assert np.isnan(ds["nll"].sel(**cell, checkpoint=0.0)).all()            # measured in the 'none' cell
        # the filled checkpoint 0 is the stage-1 student's
        np.testing.assert_array_equal(ds["nll_filled"].sel(**cell, checkpoint=0.0),
                                      ds["nll"].sel(**hedgehog, objective="none", checkpoint=0.0))
    # stage 1 of Hedgehog beats the post-hoc maps at the same bytes on held-out text (an anchor, Zhang et al. 2024)
    ppl = ds["perplexity_summary"].sel(stat="estimate", checkpoint=0.0, objective="none", fit_loss="weights",
                                       num_features=r, steps=steps, context=96, train_seed=0)
    assert float(ppl.sel(student="hedgehog")) < float(ppl.sel(student="positive_orthogonal"))
    # the per-layer analysis: every layer of every student (a stage-2 student at the end of its budget)
    layers = ds["layer_delta_nll"].sel(objective="none", fit_loss="weights", num_features=r, steps=steps, context=96,
                                       train_seed=0)
    assert bool(np.isfinite(layers).all()) and layers.sizes["layer"] == lm.NUM_LAYERS
    assert bool(np.isfinite(ds["layer_delta_nll"].sel(objective="distill", **hedgehog)).all())
    assert float(layers.sel(student="positive_orthogonal").sum()) > float(layers.sel(student="hedgehog").sum())
    written = sweep.draw(distillation.EXPERIMENT, ds, tmp_path / "distillation.png", source="distillation.nc")
    md = written[-1].read_text(encoding="utf-8")
    assert md.startswith("- Teacher at 96-token windows") and sweep.read_digest(md) == sweep.dataset_digest(ds)
    # each objective comparison names its student (hedgehog, t2r and the hybrid have one at the same r)
    budget = [line for line in md.splitlines() if line.startswith("- At an equal budget")]
    assert len(budget) == len(distillation.STAGED)
    assert {line.split("tokens (")[1].split(" at r")[0] for line in budget} == set(distillation.STAGED)


@pytest.mark.lm
@pytest.mark.xdist_group("smollm2")
@pytest.mark.skipif(not lm.is_available(), reason=str(lm.unavailable_reason()))
@pytest.mark.parametrize("student", ["hedgehog", "t2r", "window_hedgehog"])
def test_stage1_cache_returns_the_fitted_student(monkeypatch, user_cache_root, student):
    """A trained student's stage 1 is fitted once and read back from the cache (the test process's own cache root):
    the same logits to the bit, the fitting run's cost, and a key that changes with what determines the maps."""
    import torch

    model, tokenizer = lm.load_smollm2(cache_root=user_cache_root)
    calibration = lm.text_windows(tokenizer, 2, 32, split="calibration").input_ids
    data = distillation.Draw(model, None, None, calibration, None, {}, {})
    params = {"student": student, "fit_loss": "weights", "num_features": 8, "train_seed": 0, "fit_steps": 2,
              "hybrid_window": 8}
    fitted, cost, cached = distillation.stage1(data, params)
    assert not cached and cost[0] > 0 and cost[1] > 0
    data.students.clear()
    read, cost_read, cached_read = distillation.stage1(data, params)
    assert cached_read and cost_read == cost
    ids = lm.text_windows(tokenizer, 1, 24, split="evaluation").input_ids
    with torch.no_grad():
        assert torch.equal(fitted(input_ids=ids, use_cache=False).logits, read(input_ids=ids, use_cache=False).logits)
    base = distillation.stage1_provenance(data, params)
    for change in ({"fit_loss": "outputs"}, {"num_features": 16}, {"train_seed": 1}, {"fit_steps": 3}):
        assert distillation.stage1_provenance(data, {**params, **change}) != base
    changed = distillation.stage1_provenance(data, {**params, "hybrid_window": 4}) != base
    assert changed == (student == "window_hedgehog")          # the window is part of the hybrid's maps' key
    other = data._replace(calibration=calibration[:1])
    assert distillation.stage1_provenance(other, params)["calibration"] != base["calibration"]


def _seeds_dataset(n_seeds: int, effect: float):
    """A dataset shaped as the engine writes one (the seeds preset's cells, NaN where a cell does not apply), with
    the stage-1 student ``effect`` nats below FAVOR+ on every window and the stage-2 students 0.1 nats below it."""
    import xarray as xr

    rng = np.random.default_rng(0)
    students, losses, objectives = ["hedgehog", "positive_orthogonal"], ["weights"], list(distillation.OBJECTIVES)
    seeds, n_w, n_p = list(range(n_seeds)), 6, 4
    grid = {"student": students, "fit_loss": losses, "objective": objectives, "num_features": [128], "steps": [4],
            "context": [128], "train_seed": seeds}
    shape = tuple(len(v) for v in grid.values())
    ckpt = list(distillation.CHECKPOINTS)
    nll = np.full(shape + (len(ckpt), n_w), np.nan)
    logprob = np.full(shape + (len(ckpt), 2, n_p), np.nan)
    base = 5.0 + rng.normal(0, 0.2, size=(n_seeds, n_w))
    for si in range(n_seeds):
        nll[1, 0, 0, 0, 0, 0, si, 0] = base[si] + 1.0                                  # FAVOR+, post hoc
        nll[0, 0, 0, 0, 0, 0, si, 0] = base[si] + 1.0 - effect + rng.normal(0, 0.01, n_w)   # stage 1
        for oi in (1, 2):
            nll[0, 0, oi, 0, 0, 0, si, 1:] = nll[0, 0, 0, 0, 0, 0, si, 0] - 0.1 * oi + rng.normal(0, 0.01, n_w)
        logprob[:, 0, :, 0, 0, 0, si] = -10.0 + rng.normal(0, 1, size=(2, 3, len(ckpt), 2, n_p))
    applies = np.zeros(shape, dtype=bool)
    applies[0] = True
    applies[1, 0, 0] = True
    dims = tuple(grid)
    ds = xr.Dataset(
        {"nll": (dims + ("checkpoint", "window"), nll),
         "answer_logprob": (dims + ("checkpoint", "task", "prompt"), np.where(applies[..., None, None, None], logprob,
                                                                              np.nan)),
         "greedy_correct": (dims + ("checkpoint", "task", "prompt"),
                            np.where(np.isfinite(logprob), (logprob > -10).astype(float), np.nan)),
         "state_bytes": (dims, np.where(applies, 1.0e6, np.nan)),
         "stage1_cpu_seconds": (dims, np.where(applies, 20.0, np.nan)),
         "stage2_cpu_seconds": (dims, np.where(applies, 30.0, np.nan)),
         "stage2_tokens": (dims, np.where(applies, 508.0, np.nan)),
         "stage1_tokens": (dims, np.where(applies, 1000.0, np.nan)),
         "stage1_cached": (dims, np.where(applies, 0.0, np.nan)),
         "train_loss": (dims + ("step",), np.where(applies[..., None], 3.0, np.nan) * np.ones(shape + (4,))),
         "layer_delta_nll": (dims + ("layer",), np.where(applies[..., None], rng.random(shape + (30,)), np.nan)),
         "nll_exact": (("context", "window"), base.mean(0, keepdims=True)),
         "nll_unigram": (("context", "window"), np.full((1, n_w), 7.0)),
         "answer_logprob_exact": (("context", "task", "prompt"), np.full((1, 2, n_p), -2.0)),
         "greedy_correct_exact": (("context", "task", "prompt"), np.ones((1, 2, n_p))),
         "recall_chance": (("context", "task", "prompt"), np.full((1, 2, n_p), 1e-4)),
         "kv_bytes": (("context",), [4.0e6]),
         "train_len": 128, "n_layer_windows": 2},
        coords={**grid, "checkpoint": ckpt, "task": list(distillation._lm.TASKS), "layer": list(range(30))})
    for name, metric in {**distillation.METRICS, **distillation.REFERENCE_METRICS}.items():
        ds[name].attrs.update(long_name=metric.long_name, units=metric.units)
    return ds


def test_seed_comparisons_are_paired_differences_over_seeds_with_holm_verdicts():
    ds = distillation.summarise(_seeds_dataset(10, effect=0.5))
    diff = ds["seed_nll_diff"].sel(comparison="stage1_minus_posthoc", student="hedgehog", fit_loss="weights")
    want = (ds["nll"].sel(student="hedgehog", objective="none", checkpoint=0.0, fit_loss="weights")
            - ds["nll"].sel(student="positive_orthogonal", objective="none", checkpoint=0.0, fit_loss="weights"))
    np.testing.assert_allclose(diff.transpose(*want.dims).values, want.values)
    summary = ds["seed_nll_diff_summary"].sel(student="hedgehog", fit_loss="weights").squeeze()
    assert float(summary.sel(comparison="stage1_minus_posthoc", stat="estimate")) == pytest.approx(-0.5, abs=0.01)
    assert float(summary.sel(comparison="distill_minus_next_token", stat="estimate")) == pytest.approx(-0.1, abs=0.01)
    assert int(summary.sel(comparison="stage1_minus_posthoc", stat="count")) == 10
    p = ds["seed_nll_diff_p"].sel(student="hedgehog", fit_loss="weights").squeeze()
    assert float(p.sel(comparison="stage1_minus_posthoc")) == pytest.approx(2 / 2**10)   # every seed lower: exact
    # the seeds' mean perplexity is exp of the windows' mean NLL pooled over the seeds
    ppl = ds["perplexity_seeds_summary"].sel(student="hedgehog", objective="none", checkpoint=0.0, fit_loss="weights",
                                             stat="estimate").squeeze()
    stage1 = ds["nll"].sel(student="hedgehog", objective="none", checkpoint=0.0, fit_loss="weights")
    assert float(ppl) == pytest.approx(float(np.exp(stage1.mean())))
    text = "\n".join(distillation.findings(ds))
    assert "stage 1 minus post-hoc FAVOR+ −0.5" in text and "p = 0.023: stage 1 lower" in text
    assert "over 10 training seeds" in text
    assert "hedgehog (weights) stage 1 at r = 128 closes 0.5 (" in text            # half of FAVOR+'s 1-nat gap


def test_fewer_than_ten_seeds_resolve_no_verdict():
    ds = distillation.summarise(_seeds_dataset(5, effect=0.5))
    text = "\n".join(distillation.findings(ds))
    assert " lower)" not in text and "not resolved" in text
