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


def test_only_hedgehog_trains_and_bad_cells_are_refused():
    base = {"student": "hedgehog", "fit_loss": "weights", "objective": "distill", "num_features": 64, "steps": 4,
            "context": 256, "train_seed": 0}
    assert distillation.applicable(base)
    assert distillation.applicable({**base, "fit_loss": "outputs", "objective": "none"})
    assert distillation.applicable({**base, "student": "positive_orthogonal", "objective": "none"})
    assert not distillation.applicable({**base, "student": "positive_orthogonal"})
    assert not distillation.applicable({**base, "student": "nystrom_uniform", "objective": "none",
                                        "fit_loss": "outputs"})
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
    # the per-layer analysis: every layer of the stage-1 and post-hoc students, none after stage 2
    layers = ds["layer_delta_nll"].sel(objective="none", fit_loss="weights", num_features=r, steps=steps, context=96,
                                       train_seed=0)
    assert bool(np.isfinite(layers).all()) and layers.sizes["layer"] == lm.NUM_LAYERS
    assert bool(np.isnan(ds["layer_delta_nll"].sel(objective="distill", **hedgehog)).all())
    assert float(layers.sel(student="positive_orthogonal").sum()) > float(layers.sel(student="hedgehog").sum())
    written = sweep.draw(distillation.EXPERIMENT, ds, tmp_path / "distillation.png", source="distillation.nc")
    md = written[-1].read_text(encoding="utf-8")
    assert md.startswith("- Teacher at 96-token windows") and sweep.read_digest(md) == sweep.dataset_digest(ds)
