"""experiments.encoder_distillation on all-MiniLM-L6-v2: the embedding is the teacher's own for an exact conversion,
the state bytes follow the formula, the smoke preset scores every student on the teacher's windows (paired), and its
findings come from the dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernapprox as ka
from experiments import encoder_distillation as study
from kernapprox import real, sweep

pytestmark = [pytest.mark.xdist_group("minilm"),
              pytest.mark.skipif(not real.is_available(), reason=str(real.unavailable_reason()))]


def test_an_exact_conversion_keeps_the_teachers_embedding():
    """The oracle beside the students: substituting every layer by the exact kernel's feature-free path reproduces
    the teacher's embedding (cosine 1 to float32 rounding), and the embedding is unit length."""
    model, tokenizer = study._teacher()
    ids = torch.as_tensor(tokenizer("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False,
                                    return_tensors="pt")["input_ids"])
    teacher = study.embed(model, ids)
    np.testing.assert_allclose(teacher.norm(dim=-1).numpy(), 1.0, atol=1e-12)
    exact = study.embed(ka.convert(model, "exact"), ids)
    assert float((teacher * exact).sum(-1).min()) > 1 - 1e-6


def test_smoke_preset_scores_every_student_on_the_teachers_windows(tmp_path):
    ds = sweep.run(study.EXPERIMENT, preset="smoke", out=tmp_path / "e.nc", device="cpu", progress=False)
    r, context = 16, 64
    cell = dict(fit_loss="weights", num_features=r, context=context, objective="none")
    # state bytes: 6 layers x 12 heads x r (d_v + 1) float32 numbers for the trained maps and FAVOR+
    for student in ("hedgehog", "t2r", "positive_orthogonal"):
        assert float(ds["state_bytes"].sel(student=student, map_seed=0, **cell)) == 6 * 12 * r * 33 * 4
    assert float(ds["state_bytes"].sel(student="nystrom_uniform", map_seed=0, **cell)) > 6 * 12 * r * 33 * 4
    assert float(ds["kv_bytes"].sel(context=context)) == 6 * 2 * context * 384 * 4
    cos = ds["cosine"].sel(**cell)
    assert bool(((cos > -1) & (cos <= 1 + 1e-9)).all())
    assert bool(ds["retrieved"].sel(**cell).isin([0.0, 1.0]).all())
    # attention transfer beats the post-hoc map at the same bytes on held-out windows (Zhang et al. 2024's anchor),
    # and every student beats the predictor that reads no window
    mean_cos = cos.mean(("window", "map_seed"))
    assert float(mean_cos.sel(student="hedgehog")) > float(mean_cos.sel(student="positive_orthogonal"))
    assert float(mean_cos.min()) > float(ds["cosine_mean_embedding"].sel(context=context).mean())
    # outputs-loss cells of the post-hoc maps do not apply
    assert "outputs" not in ds["fit_loss"].values.tolist()
    assert float(ds["stage1_tokens"].sel(student="hedgehog", map_seed=0, **cell)) > 0
    assert float(ds["stage1_cpu_seconds"].sel(student="positive_orthogonal", map_seed=0, **cell)) == 0
    # stage 2: the trained students' adapters by embedding distillation; the post-hoc maps have none
    staged = dict(cell, objective="embedding")
    for student in ("hedgehog", "t2r"):
        assert float(ds["stage2_tokens"].sel(student=student, map_seed=0, **staged)) == (
            int(ds["steps"]) * int(ds["batch_size"]) * context)
        assert np.isfinite(ds["stage2_final_loss"].sel(student=student, **staged)).all()
        assert float(ds["stage2_cpu_seconds"].sel(student=student, map_seed=0, **staged)) > 0
    assert np.isnan(ds["cosine"].sel(student="positive_orthogonal", **staged)).all()
    assert np.isfinite(ds["stage2_gain_summary"].sel(student="hedgehog", fit_loss="weights", num_features=r,
                                                    context=context, stat="estimate"))
    written = sweep.draw(study.EXPERIMENT, ds, tmp_path / "e.png", source="encoder_distillation.nc")
    md = written[-1].read_text(encoding="utf-8")
    assert md.startswith("- At r = 16 features per head") and sweep.read_digest(md) == sweep.dataset_digest(ds)
    assert sum(line.startswith("- Stage 2 (") for line in md.splitlines()) == 2      # Hedgehog's and T2R's
    assert sweep.read_code_digest(md) == ds.attrs["code_digest"]


def test_bad_cells_are_refused():
    base = {"student": "hedgehog", "fit_loss": "weights", "num_features": 16, "context": 64, "map_seed": 0,
            "objective": "none"}
    for change, message in (({"student": "lara"}, "student"), ({"num_features": 15}, "even"),
                            ({"context": 1024}, "context"), ({"objective": "next_token"}, "objective")):
        with pytest.raises(ValueError, match=message):
            study.check_params({**base, **change})
    assert not study.applicable({**base, "student": "positive_orthogonal", "fit_loss": "outputs"})
    assert not study.applicable({**base, "student": "positive_orthogonal", "objective": "embedding"})
    assert study.applicable({**base, "objective": "embedding"})
