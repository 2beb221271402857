"""The conventions every study follows, enforced by the engine and checked on every experiment: paired data
(comparative studies without data axes are refused), a reference computed once per data draw without the
estimator axes, fixed parameters and grids changeable from the command line and recorded, summaries with
documented intervals, findings computed from the dataset (deterministic, tied to their figure by the data's
digest), and the committed figures/*.md current with their figures."""

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from PIL import Image

import kernapprox.sweep as sweep
from kernapprox import provenance, stats
from kernapprox.sweep import Experiment, Metric, Reference

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import toy_paired  # noqa: E402

STUDIES = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if not p.stem.startswith("_"))
OWN = ["attention_error", "icl_classification", "icl_recall", "icl_regression", "in_context_vs_in_weight",
       "kernel_error", "modality_spectrum", "modes", "query_distribution", "rank_summary", "recall_frontier",
       "spectrum", "variance_theory"]
# Studies whose unit is a trained model (train_seed), not a data draw (seed): fewer units per default preset.
TRAINED = ("modality_spectrum", "recall_frontier")


def _experiment(**overrides):
    kw = dict(name="t", title="T", description="D.", metrics={"m": Metric(long_name="m", units="1", description="d")},
              grids={"smoke": {"estimator": ["a", "b"], "seed": [0, 1]}}, plot=lambda ds, path: None,
              run_cell=lambda params, rng, device, data_rng=None: {"m": 0.0})
    return Experiment(**{**kw, **overrides})


# --------------------------------------------------------------------------------------------- the engine
def test_a_comparative_study_without_data_axes_is_refused():
    with pytest.raises(ValueError, match="compares estimators.*data_axes"):
        _experiment()
    with pytest.raises(ValueError, match="method axes"):
        _experiment(data_axes=("estimator", "seed"))
    with pytest.raises(ValueError, match="must include 'seed'"):
        _experiment(grids={"smoke": {"estimator": ["a"], "n": [1], "seed": [0]}}, data_axes=("n",))
    _experiment(data_axes=("seed",))                                   # paired: accepted


def test_a_reference_needs_the_data_axes_and_no_method_axis():
    ref = Reference(run_cell=lambda params, device, data_rng: {"r": 0.0},
                    metrics={"r": Metric(long_name="r", units="1", description="d")})
    with pytest.raises(ValueError, match="reference axes"):
        _experiment(data_axes=("seed",), reference=Reference(run_cell=ref.run_cell, metrics=ref.metrics,
                                                             axes=("estimator", "seed")))
    with pytest.raises(ValueError, match="distinct"):
        _experiment(data_axes=("seed",), reference=Reference(
            run_cell=ref.run_cell, metrics={"m": Metric(long_name="m", units="1", description="d")}))


def test_the_reference_runs_once_per_data_draw_on_the_cells_data(tmp_path):
    toy_paired.REFERENCE_CALLS.clear()
    ds = sweep.run(toy_paired.EXPERIMENT, preset="smoke", out=tmp_path / "t.nc", device="cpu", progress=False)
    assert len(toy_paired.REFERENCE_CALLS) == 2 * 3                    # scale × seed, not × estimator × r
    assert ds["reference_mean"].dims == ("scale", "seed") and "reference_seconds" in ds
    xr.testing.assert_allclose(ds["data_mean"], ds["reference_mean"].broadcast_like(ds["data_mean"]))
    assert ds.attrs["preset"] == "smoke" and ds["size"].attrs["units"] == "1" and int(ds["size"]) == 6
    assert json.loads(ds.attrs["parameters"]) == {"size": 6}
    summary = ds["error_summary"]
    assert stats.is_summary(summary) and summary.attrs["over"] == "seed" and "bootstrap" in summary.attrs["interval"]
    assert "error_summary" in ds.attrs["summaries"] and "stat" in ds.attrs["stat_convention"]
    for axis in toy_paired.EXPERIMENT.axes:
        assert ds[axis].attrs["long_name"] and ds[axis].attrs["units"]
    loaded = sweep.load(tmp_path / "t.nc")
    xr.testing.assert_identical(loaded["error_summary"], ds["error_summary"])


def test_set_changes_any_axis_and_parameter_and_the_dataset_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = sweep.run_cli(toy_paired.EXPERIMENT, ["--preset", "smoke", "--quiet", "--no-figure",
                                                 "--set", "num_features=3,7", "size=9", "--set", "scale=0.5"])
    assert code == 0
    ds = sweep.load(tmp_path / "results" / "toy_paired.custom.nc")     # never the preset's own output path
    assert ds.attrs["preset"] == "custom" and ds.attrs["preset_base"] == "smoke"
    grid = json.loads(ds.attrs["grid"])
    assert grid["num_features"] == [3, 7] and grid["scale"] == [0.5] and int(ds["size"]) == 9
    changes = json.loads(ds.attrs["grid_changes"])
    assert changes["set"] == {"num_features": [3, 7], "scale": [0.5]} and changes["parameters"] == {"size": 9}


def test_a_slice_with_values_of_another_preset_is_not_stamped_with_the_preset(tmp_path):
    ds = sweep.run(toy_paired.EXPERIMENT, preset="smoke", out=tmp_path / "t.nc", device="cpu", progress=False,
                   only={"estimator": "c", "num_features": 4})
    assert ds.attrs["preset"] == "custom" and json.loads(ds.attrs["grid"])["estimator"] == ["c"]


@pytest.mark.parametrize("args, message", [
    (["--set", "nothing=1"], "neither an axis"),
    (["--set", "size=many"], "expected a int"),
    (["--set", "num_features="], "NAME=VALUE"),
])
def test_bad_set_options_fail_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.run_cli(toy_paired.EXPERIMENT, args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_summaries_must_be_described(tmp_path):
    def bad(ds):
        ds["naked"] = xr.DataArray(ds["error"].values * 2, dims=ds["error"].dims)
        return ds

    exp = Experiment(**{**{f: getattr(toy_paired.EXPERIMENT, f) for f in (
        "name", "title", "description", "grids", "metrics", "run_cell", "plot", "data_axes", "reference",
        "parameters")}, "summarise": bad})
    with pytest.raises(ValueError, match="naked.*lacks attributes"):
        sweep.run(exp, preset="smoke", out=tmp_path / "t.nc", device="cpu", progress=False)


# ------------------------------------------------------------------------------------- every experiment
@pytest.mark.parametrize("name", STUDIES)
def test_help_describes_the_study_in_whole_sentences(name):
    exp = importlib.import_module(f"experiments.{name}").EXPERIMENT
    assert exp.description.rstrip().endswith((".", "?", ")")), exp.description[-80:]
    text = sweep.build_parser(exp).format_help()
    assert exp.title in text and "presets" in text
    if exp.parameters:
        assert "fixed parameters (--set NAME=VALUE)" in text


@pytest.mark.parametrize("name", [n for n in OWN if n != "modes" and n not in TRAINED])
def test_every_comparative_study_is_paired_and_replicated(name):
    exp = importlib.import_module(f"experiments.{name}").EXPERIMENT
    default = exp.grid("default")
    if "estimator" in default:
        assert exp.data_axes and "seed" in exp.data_axes and "estimator" not in exp.data_axes
    assert len(default["seed"]) >= 5, name
    assert exp.findings is not None and exp.summarise is not None


@pytest.mark.parametrize("name", OWN)
def test_findings_are_computed_from_the_dataset_and_tied_to_the_figure(name, smoke_run, tmp_path):
    module, ds, folder = smoke_run(name)
    text = sweep.findings_body(module.EXPERIMENT, ds)
    assert text == sweep.findings_body(module.EXPERIMENT, ds.copy(deep=True))   # a pure, deterministic function
    assert text.startswith("- ")
    written = sweep.draw(module.EXPERIMENT, ds, tmp_path / f"{name}.png", source=f"results/{name}.nc")
    md = (tmp_path / f"{name}.md").read_text(encoding="utf-8")
    assert written[-1].suffix == ".md" and md.startswith(text.strip())
    assert md.count("Numbers in parentheses are 95 % intervals") == 1      # the closing line, written once
    digest = sweep.read_digest(md)
    assert digest == sweep.dataset_digest(ds)
    assert digest in Image.open(tmp_path / f"{name}.png").info["Source"]
    assert sweep.read_code_digest(md) == ds.attrs["code_digest"]
    record = sweep.read_provenance(tmp_path / f"{name}.png")        # what the numbers depend on, beside them
    assert record["study"] == f"experiments.{name}" and record["code_digest"] == ds.attrs["code_digest"]
    assert record["code"]["study"] == {f"experiments.{name}": provenance.study_digest(f"experiments.{name}")}


def test_findings_of_two_runs_are_identical(smoke_run, tmp_path):
    """Cells are seeded by their coordinates: a second run gives the same dataset, hence the same text."""
    module, ds, _ = smoke_run("kernel_error")
    again = sweep.run(module.EXPERIMENT, preset="smoke", out=tmp_path / "again.nc", device="cpu", progress=False)
    assert sweep.dataset_digest(again) == sweep.dataset_digest(ds)
    assert module.EXPERIMENT.findings(again) == module.EXPERIMENT.findings(ds)


def test_findings_change_when_the_data_do(smoke_run):
    module, ds, _ = smoke_run("kernel_error")
    changed = ds.copy(deep=True)
    changed["kernel_rel_fro"] = changed["kernel_rel_fro"] * 1.5
    changed = module.EXPERIMENT.summarise(changed.drop_vars([v for v in changed.data_vars if "summary" in v]))
    assert module.EXPERIMENT.findings(changed) != module.EXPERIMENT.findings(ds)
    assert sweep.dataset_digest(changed) != sweep.dataset_digest(ds)


# ------------------------------------------------------------------------------------ the committed gallery
FIGURES = sorted((ROOT / "figures").glob("*.png"))


@pytest.mark.parametrize("png", [p for p in FIGURES if p.stem in OWN], ids=lambda p: p.stem)
def test_committed_findings_are_current_with_their_figure(png):
    """Each committed figure has its findings beside it, generated from the same dataset (the digest of the data
    stored in the PNG's Source equals the one in the findings file): regenerate both with `make figures`."""
    md = png.with_suffix(".md")
    assert md.exists(), f"{md.name} is missing: run make figures"
    text = md.read_text(encoding="utf-8")
    digest = sweep.read_digest(text)
    source = Image.open(png).info.get("Source", "")
    assert digest and digest in source, f"{png.name} and {md.name} come from different datasets: run make figures"
    assert text.startswith("- ") and np.all([line.startswith(("- ", "<!--")) for line in text.splitlines() if line])


@pytest.mark.parametrize("name", STUDIES)
def test_every_preset_passes_the_checks_run_before_any_cell(name):
    """Every cell of every preset is accepted by the study's ``check_params`` and the common axes' domains with the
    fixed parameters' defaults: a preset that a check refuses fails at its start, not after an hour of other
    studies (as sampler_bias's full preset once did at d = 256)."""
    from kernapprox.sweep._experiment import check_values

    exp = importlib.import_module(f"experiments.{name}").EXPERIMENT
    for preset in exp.grids:
        check_values(exp, exp.grid(preset), exp.parameter_values())
