"""The experiment engine: grids, seeding, the dataset and its provenance, resume after SIGKILL, executors
(process pool with a dying worker, dask), slices, and refusal to overwrite foreign files.

Runs use ``tests/toy_experiment.py`` (numpy only, with failure points set by environment variables), so results
are bitwise reproducible across processes and executors.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import kernapprox.sweep as sweep
from kernapprox.sweep import Experiment, Metric
from kernapprox.sweep._experiment import cell_spawn_key, check_values

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import toy_experiment  # noqa: E402

TOY = toy_experiment.EXPERIMENT
METRIC_VARS = ["mean", "draws", "ragged"]


def run_toy(tmp_path, name="toy.nc", **kw):
    kw.setdefault("preset", "smoke")
    return sweep.run(TOY, out=tmp_path / name, device="cpu", progress=False, **kw)


def pick(ds, cell):
    """``ds`` at one cell, keeping its dims (by position: xarray reads a list of bools as a mask)."""
    return ds.isel({axis: [list(ds[axis].values).index(value)] for axis, value in cell.items()})


def assert_same_metrics(a, b):
    for var in METRIC_VARS:
        np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=var)


def toy_subprocess(args, tmp_path, **env):
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                **env}
    return subprocess.run([sys.executable, "-m", "toy_experiment", "--quiet", "--no-figure", *args],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The toy smoke grid run once, uninterrupted, in this process (every cell computed: a module-scoped fixture
    is made before a test's own store is set, so it must not count on an empty one)."""
    return run_toy(tmp_path_factory.mktemp("ref"), resume=False)


# ---------------------------------------------------------------------------------------------- definitions
def _experiment(**overrides):
    kw = dict(name="t", title="T", description="D", grids={"smoke": {"a": [1, 2]}},
              metrics={"m": Metric(long_name="m", units="1", description="d")},
              run_cell=lambda params, rng, device: {"m": 0.0}, plot=lambda ds, path: None)
    return Experiment(**{**kw, **overrides})


@pytest.mark.parametrize("grid, error", [
    ({"a": [1, 2.0]}, TypeError),                 # mixed types on one axis
    ({"a": [np.int64(1)]}, TypeError),            # numpy integers are not silently converted
    ({"a": [1, 1]}, ValueError),                  # duplicate values
    ({"a": []}, ValueError),
    ({"a": "xy"}, ValueError),                    # a string is not a list of values
    ({"a": [float("nan")]}, ValueError),
    ({"m": [1]}, ValueError),                     # axis named like a metric
    ({"not an id": [1]}, ValueError),
])
def test_bad_grids_are_refused(grid, error):
    with pytest.raises(error):
        _experiment(grids={"smoke": grid})


def test_presets_must_share_axes_and_types():
    with pytest.raises(ValueError, match="same axes"):
        _experiment(grids={"smoke": {"a": [1]}, "full": {"b": [1]}})
    with pytest.raises(TypeError, match="type"):
        _experiment(grids={"smoke": {"a": [1]}, "full": {"a": [1.0]}})


def test_data_axes_need_a_data_rng_parameter():
    with pytest.raises(TypeError, match="data_rng"):
        _experiment(data_axes=("a",))
    with pytest.raises(ValueError, match="data_axes"):
        _experiment(data_axes=("zz",), run_cell=lambda params, rng, device, data_rng: {"m": 0.0})


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="smoke, wide"):
        TOY.grid("default")


# ------------------------------------------------------------------------------------------------- seeding
def test_seed_depends_on_values_not_positions_or_order():
    p = {"family": "a", "size": 3, "flag": True, "scale": 2.0, "seed": 1}
    reordered = dict(reversed(list(p.items())))
    assert cell_spawn_key("toy", p) == cell_spawn_key("toy", reordered)
    assert cell_spawn_key("toy", p) != cell_spawn_key("other", p)
    for axis, other in [("size", 1), ("flag", False), ("scale", 0.5), ("seed", 0), ("family", "b")]:
        assert cell_spawn_key("toy", {**p, axis: other}) != cell_spawn_key("toy", p)
    a = np.random.default_rng(sweep.cell_seed_sequence("toy", p, 0)).random(3)
    b = np.random.default_rng(sweep.cell_seed_sequence("toy", p, 1)).random(3)
    assert not np.array_equal(a, b)


def test_extending_the_grid_keeps_every_existing_cell(tmp_path, reference):
    wide = run_toy(tmp_path, preset="wide")
    assert_same_metrics(wide.reindex_like(reference), reference)


# ------------------------------------------------------------------------------------------------- dataset
def test_dataset_layout_metadata_and_provenance(reference, tmp_path):
    ds = reference
    assert list(ds["mean"].dims) == TOY.axes
    assert list(ds["draws"].dims) == TOY.axes + ["draw"]
    assert list(ds["draws"].draw.values) == [0, 1, 2, 3, 4]
    assert ds["flag"].dtype == bool and list(ds["family"].values) == ["a", "b"]
    for name, metric in TOY.metrics.items():
        assert ds[name].attrs == {"long_name": metric.long_name, "units": metric.units,
                                  "description": metric.description}
    assert ds["cell_seconds"].attrs["units"] == "s" and bool((ds["cell_seconds"] >= 0).all())
    # ragged array metric: padded with NaN after `size` values
    ragged = ds["ragged"].sel(size=1)
    assert bool(ragged.isel(item=0).notnull().all()) and bool(ragged.isel(item=slice(1, None)).isnull().all())
    attrs = ds.attrs
    assert attrs[sweep.MARKER] == "toy" and attrs["experiment"] == "toy" and attrs["preset"] == "smoke"
    assert json.loads(attrs["grid"]) == TOY.grid("smoke")
    assert attrs["root_seed"] == 0
    assert attrs["git_revision"] == "unknown" or len(attrs["git_revision"].split("+")[0]) == 40
    versions = json.loads(attrs["package_versions"])
    assert {"numpy", "scipy", "torch", "xarray", "sklearn", "kernapprox", "python"} <= set(versions)
    assert attrs["device"].startswith("cpu")
    assert attrs["torch_num_threads"] >= 1 and "torch_num_interop_threads" in attrs
    assert json.loads(attrs["precision"]) == {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False,
                                              "float32_matmul_precision": "highest"}
    assert attrs["cells_run"] == attrs["cells_total"] == 32 and attrs["cells_reused"] == 0
    assert attrs["time_start"] <= attrs["time_end"] and attrs["history"]


def test_run_leaves_no_temporaries_and_restores_precision_switches(tmp_path):
    before = torch.get_float32_matmul_precision()
    run_toy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.nc"]
    assert torch.get_float32_matmul_precision() == before
    xr.testing.assert_identical(sweep.load(tmp_path / "toy.nc"), sweep.load(tmp_path / "toy.nc"))


def test_non_applicable_cells_are_nan_and_missing_cells_too(tmp_path):
    ds = run_toy(tmp_path, preset="wide", only={"family": ["b", "c"], "size": 2, "seed": 0})
    assert dict(ds.sizes)["family"] == 2 and dict(ds.sizes)["size"] == 1
    assert bool(ds["mean"].sel(family="c").isnull().all()) and bool(ds["mean"].sel(family="b").notnull().all())


# ---------------------------------------------------------------------------------------------- slices, CLI
def test_single_cell_rerun_reproduces_the_stored_value(tmp_path, reference):
    cell = {"family": "b", "size": 3, "flag": True, "scale": 2.0, "seed": 1}
    alone = run_toy(tmp_path, only=cell)
    assert alone["mean"].size == 1
    assert_same_metrics(alone, pick(reference, cell))


def test_only_and_seeds_are_checked(tmp_path):
    with pytest.raises(ValueError, match="valid: a, b, c"):
        run_toy(tmp_path, only={"family": "z"})
    with pytest.raises(TypeError, match="takes int"):
        run_toy(tmp_path, only={"size": "1"})
    with pytest.raises(ValueError, match="unknown axis"):
        run_toy(tmp_path, only={"colour": "a"})
    ds = run_toy(tmp_path, seeds=3, only={"family": "a", "size": 1, "flag": False, "scale": 0.5})
    assert list(ds.seed.values) == [0, 1, 2]


def test_help_explains_the_grid(capsys):
    parser = sweep.build_parser(TOY)
    text = parser.format_help()
    assert "smoke — 32 cells" in text and "wide — 162 cells" in text
    assert "family: a, b, c" in text and "ragged [item]" in text
    with pytest.raises(SystemExit):
        sweep.run_cli(TOY, ["--only", "size"])
    assert "AXIS=VALUE" in capsys.readouterr().err


def test_cli_slice_goes_to_its_own_file_and_bad_values_fail_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sweep.run_cli(TOY, ["--preset", "smoke", "--quiet", "--only", "family=a", "size=1", "flag=false",
                        "scale=0.5", "seed=0"])
    assert (tmp_path / "results" / "toy.only.nc").exists() and not (tmp_path / "results" / "toy.nc").exists()
    with pytest.raises(SystemExit) as info:
        sweep.run_cli(TOY, ["--preset", "smoke", "--quiet", "--only", "size=x"])
    assert info.value.code == 2 and "expected a int" in capsys.readouterr().err


def test_device_resolution():
    assert sweep.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device"):
        sweep.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            sweep.resolve_device("cuda")


# ----------------------------------------------------------------------------------------- resume, failure
def test_resume_after_sigkill_computes_only_missing_cells(tmp_path, reference):
    killed = toy_subprocess(["--preset", "smoke", "--out", "r/toy.nc"], tmp_path, TOY_KILL_AT_CELL="10")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "r" / "toy.nc").exists()                    # nothing half-written at the final path
    assert len(toy_experiment.stored_cells()) == 9                     # every finished cell is in the store
    resumed = toy_subprocess(["--preset", "smoke", "--out", "r/toy.nc"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    ds = sweep.load(tmp_path / "r" / "toy.nc")
    assert (ds.attrs["cells_run"], ds.attrs["cells_reused"]) == (23, 9)
    assert_same_metrics(ds, reference)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["toy.nc"]     # no temporaries beside it


def test_failing_cell_fails_loudly_keeps_progress_and_no_resume_starts_over(tmp_path, reference, monkeypatch):
    monkeypatch.setenv("TOY_FAIL_FAMILY", "b")
    with pytest.raises(sweep.CellError, match="broken on purpose") as info:
        run_toy(tmp_path)
    assert info.value.params["family"] == "b" and "Traceback" in info.value.remote_traceback
    assert not (tmp_path / "toy.nc").exists()
    monkeypatch.delenv("TOY_FAIL_FAMILY")
    ds = run_toy(tmp_path)
    assert (ds.attrs["cells_run"], ds.attrs["cells_reused"]) == (16, 16)     # the family-a half was kept
    assert_same_metrics(ds, reference)
    monkeypatch.setenv("TOY_FAIL_FAMILY", "b")
    again = run_toy(tmp_path)                       # a finished run of the same command: nothing runs
    assert (again.attrs["cells_run"], again.attrs["cells_reused"]) == (0, 32)
    assert_same_metrics(again, reference)
    with pytest.raises(sweep.CellError):
        run_toy(tmp_path, resume=False)             # --force recomputes every cell
    monkeypatch.delenv("TOY_FAIL_FAMILY")
    assert run_toy(tmp_path, resume=False).attrs["cells_reused"] == 0


def test_ctrl_c_says_what_was_saved_and_the_rerun_resumes(tmp_path, reference):
    """Ctrl-C: no traceback, exit code 130, how many cells are saved and how to resume; the rerun computes the
    rest only and ends with the uninterrupted run's numbers."""
    stopped = toy_subprocess(["--preset", "smoke", "--out", "toy.nc"], tmp_path, TOY_INTERRUPT_AT_CELL="6")
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr, stopped.stderr
    assert "interrupted: 5 of 32 cells saved in" in stopped.stderr and "rerun the same command to resume" \
        in stopped.stderr
    resumed = toy_subprocess(["--preset", "smoke", "--out", "toy.nc"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    ds = sweep.load(tmp_path / "toy.nc")
    assert (ds.attrs["cells_run"], ds.attrs["cells_reused"]) == (27, 5)
    assert_same_metrics(ds, reference)


def test_a_finished_command_reruns_nothing_unless_forced(tmp_path, reference):
    """Every cell is kept in the result store under its inputs: the same command computes nothing; another root
    seed computes every cell; a grid that extends the run (more seeds) computes only the new cells; --force
    computes every cell again."""
    first = run_toy(tmp_path)
    again = run_toy(tmp_path)
    assert (again.attrs["cells_run"], again.attrs["cells_reused"]) == (0, 32)
    assert again.attrs["code_digest"] == first.attrs["code_digest"]
    assert_same_metrics(again, first)
    assert run_toy(tmp_path, root_seed=1).attrs["cells_run"] == 32      # another seed: recomputed
    extended = run_toy(tmp_path, seeds=3)                                # seeds 0, 1 are stored; 2 is new
    assert (extended.attrs["cells_run"], extended.attrs["cells_reused"]) == (16, 32)
    forced = run_toy(tmp_path, seeds=3, resume=False)
    assert forced.attrs["cells_run"] == 48 and forced.attrs["time_start"] >= first.attrs["time_start"]
    toy_subprocess(["--preset", "smoke", "--out", "again.nc"], tmp_path)
    out = toy_subprocess(["--preset", "smoke", "--out", "again.nc"], tmp_path)
    assert out.returncode == 0 and "0 cells run, 32 reused" in out.stderr, out.stderr


def test_set_values_are_checked_before_any_cell_runs(tmp_path):
    calls = []
    exp = _experiment(grids={"smoke": {"estimator": ["positive_orthogonal"], "num_features": [8], "seed": [0]}},
                      data_axes=("seed",),
                      run_cell=lambda params, rng, device, data_rng: calls.append(params) or {"m": 0.0},
                      check_params=lambda p: None if p["num_features"] < 100 else (_ for _ in ()).throw(
                          ValueError("num_features must be below 100 here")))
    with pytest.raises(ValueError, match="axis 'estimator' has values \\['no_such_map'\\]"):
        sweep.run(exp, out=tmp_path / "t.nc", set_values={"estimator": ["positive_orthogonal", "no_such_map"]},
                  progress=False)
    with pytest.raises(ValueError, match="axis 'num_features' has values \\[0\\]"):
        sweep.run(exp, out=tmp_path / "t.nc", set_values={"num_features": [8, 0]}, progress=False)
    with pytest.raises(ValueError, match="below 100"):
        sweep.run(exp, out=tmp_path / "t.nc", set_values={"num_features": [8, 128]}, progress=False)
    assert calls == []                                                   # nothing ran
    check_values(exp, {"estimator": ["trig", "positive_orthogonal"], "num_features": [8, 64], "seed": [0, 7]})


def test_every_coordinate_has_a_long_name_and_units(tmp_path, reference):
    for name in reference.coords:
        assert reference[name].attrs.get("long_name") and reference[name].attrs.get("units"), name
    assert reference["draw"].attrs["long_name"] == "draw"                  # a metric's own dimension


def test_the_digest_ignores_every_timing(reference):
    timed = reference.assign(train_seconds=reference["mean"].copy(data=np.random.default_rng(0).random(
        reference["mean"].shape)).assign_attrs(units="s"))
    assert sweep.dataset_digest(timed) == sweep.dataset_digest(reference)
    assert sweep.dataset_digest(reference.assign(mean=reference["mean"] + 1)) != sweep.dataset_digest(reference)


def test_progress_from_another_root_seed_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_FAIL_FAMILY", "b")
    with pytest.raises(sweep.CellError):
        run_toy(tmp_path, root_seed=5)
    monkeypatch.delenv("TOY_FAIL_FAMILY")
    ds = run_toy(tmp_path, root_seed=6)
    assert ds.attrs["cells_reused"] == 0 and ds.attrs["root_seed"] == 6


def test_two_concurrent_runs_of_one_study_both_finish_with_the_same_numbers(tmp_path, reference):
    """Concurrent writers share the store: each cell file is whole (written under a temporary name and renamed),
    two writers of one cell write the same name, and both runs end with the uninterrupted run's numbers."""
    args = ["--preset", "smoke"]
    procs = [subprocess.Popen([sys.executable, "-m", "toy_experiment", "--quiet", "--no-figure", *args, "--out",
                               f"c{i}.nc"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TOY_SLEEP": "0.01",
                                   "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
             for i in range(2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    for i in range(2):
        assert_same_metrics(sweep.load(tmp_path / f"c{i}.nc"), reference)
    assert len(toy_experiment.stored_cells()) >= 32


# -------------------------------------------------------------------------------------------- output path
def test_corrupt_foreign_or_other_experiment_outputs_are_never_overwritten(tmp_path):
    garbage = tmp_path / "garbage.nc"
    garbage.write_bytes(b"not a netCDF file at all")
    foreign = tmp_path / "foreign.nc"
    xr.Dataset({"x": ("t", [1.0, 2.0])}).to_netcdf(foreign, engine="h5netcdf")
    other = tmp_path / "other.nc"
    xr.Dataset(attrs={sweep.MARKER: "kernel_error"}).to_netcdf(other, engine="h5netcdf")
    for path, message in [(garbage, "not a readable netCDF"), (foreign, "not a kernapprox result"),
                          (other, "results of experiment 'kernel_error'")]:
        before = path.read_bytes()
        with pytest.raises(sweep.OutputPathError, match=message):
            sweep.run(TOY, out=path, device="cpu", progress=False)
        assert path.read_bytes() == before
    with pytest.raises(ValueError, match="not a kernapprox result"):
        sweep.load(foreign)
    with pytest.raises(FileNotFoundError):
        sweep.load(tmp_path / "missing.nc")


# --------------------------------------------------------------------------------------------- executors
def test_process_pool_survives_a_dying_worker_without_losing_or_duplicating_cells(tmp_path, reference,
                                                                                   monkeypatch):
    marker = tmp_path / "died"
    monkeypatch.setenv("TOY_DIE_ONCE", str(marker))
    ds = run_toy(tmp_path, workers=2)
    assert marker.exists()                                              # a worker really was killed
    assert ds.attrs["executor"].startswith("process pool") and ds.attrs["cells_run"] == 32
    assert_same_metrics(ds, reference)


def test_worker_deaths_beyond_max_retries_raise(tmp_path):
    from concurrent.futures import Future

    from kernapprox.sweep._run import _execute, _Plan

    class Lossy:  # every task is lost with its worker
        def submit(self, fn, *args):
            future = Future()
            future.set_exception(ConnectionError("worker died"))
            return future

    task = sweep._worker.CellTask("toy_experiment", "toy", {"family": "a"}, 0, (1,), "cpu")
    with pytest.raises(sweep.SweepError, match="lost 3 times"):
        _execute([task], _Plan(Lossy(), "lossy", window=1), max_retries=2, on_done=lambda *a: None)


def test_dask_local_cluster_on_loopback(tmp_path, reference):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp",
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        by_address = run_toy(tmp_path, "a.nc", scheduler=cluster.scheduler_address)
        with distributed.Client(cluster) as client:
            by_executor = run_toy(tmp_path, "b.nc", executor=client.get_executor(pure=False))
    assert by_address.attrs["executor"].startswith("dask.distributed")
    assert_same_metrics(by_address, reference)
    assert_same_metrics(by_executor, reference)


def test_threads_limit_numpy_blas_inside_the_cells_and_are_restored(tmp_path):
    """``threads=1`` holds numpy's BLAS to one thread while the cells run (a multithreaded BLAS on busy cores spins),
    and the process's own limit is back afterwards."""
    import toy_threads

    before = toy_threads.blas_threads()
    ds = sweep.run(toy_threads.EXPERIMENT, preset="smoke", out=tmp_path / "t.nc", device="cpu", progress=False,
                   threads=1)
    if np.isnan(before):
        pytest.skip("no BLAS library found by threadpoolctl")
    assert float(ds["blas_threads"].max()) == 1.0
    assert toy_threads.blas_threads() == before


def test_not_applicable_is_nan_for_every_metric_but_the_kept_ones():
    from kernapprox.sweep._worker import normalise_metrics

    out = normalise_metrics(TOY, sweep.not_applicable(mean=2.5))
    assert out["mean"] == 2.5 and np.isnan(out["draws"]) and np.isnan(out["ragged"])
    with pytest.raises(ValueError, match="unknown keys \\['nope'\\]"):
        normalise_metrics(TOY, sweep.not_applicable(nope=1.0))


# ----------------------------------------------------------------------------------- draws made by the engine
@pytest.mark.parametrize("workers", [0, 2])
def test_each_data_draw_is_made_once_and_handed_to_every_cell_and_its_reference(tmp_path, monkeypatch, workers):
    """Experiment.draw: 6 draws (2 scales x 3 seeds) for 24 cells and 6 reference cells, computed exactly 6 times,
    in this process or on a pool of 2 spawn workers (the cells of a draw run as one task there); the same
    numbers either way."""
    import toy_draw

    log = tmp_path / "draws"
    log.mkdir()
    monkeypatch.setenv("TOY_DRAW_LOG", str(log))
    ds = sweep.run(toy_draw.EXPERIMENT, out=tmp_path / "d.nc", device="cpu", progress=False, workers=workers)
    made = sorted(p.name.rsplit("-", 1)[0] for p in log.iterdir())
    assert made == sorted(f"{s}-{seed}" for s in (1.0, 2.0) for seed in (0, 1, 2)), made
    np.testing.assert_array_equal(ds["data_mean"].isel(estimator=0, num_features=0).values,
                                  ds["reference_mean"].values)                 # the reference read the same draw
    again = sweep.run(toy_draw.EXPERIMENT, out=tmp_path / "e.nc", device="cpu", progress=False, workers=0)
    for var in ("data_mean", "error", "reference_mean"):
        np.testing.assert_array_equal(ds[var].values, again[var].values)


def test_findings_may_be_sentences_the_engine_writes_as_bullets(tmp_path):
    """Experiment.findings returning a list: one bullet per non-empty sentence, then the engine's closing line on
    the intervals and the line naming the data; an empty list is refused."""
    import toy_paired

    ds = sweep.run(toy_paired.EXPERIMENT, out=tmp_path / "p.nc", device="cpu", progress=False)
    listed = dataclasses.replace(toy_paired.EXPERIMENT, findings=lambda ds: ["First  sentence.", "", "Second."])
    assert sweep.findings_body(listed, ds) == "- First sentence.\n- Second."
    text = sweep.findings_text(listed, ds, "results/p.nc")
    assert text.startswith("- First sentence.\n- Second.\n- Numbers in parentheses are 95 % intervals")
    assert sweep.read_digest(text) == sweep.dataset_digest(ds)
    with pytest.raises(ValueError, match="non-empty markdown text or a list of sentences"):
        sweep.findings_body(dataclasses.replace(listed, findings=lambda ds: []), ds)


def test_a_draw_needs_data_axes_and_cells_that_take_it():
    import toy_draw

    with pytest.raises(TypeError, match="needs data_axes"):
        _experiment(draw=toy_draw.draw)
    with pytest.raises(TypeError, match="run_cell\\(params, rng, device, data\\)"):
        _experiment(grids={"smoke": {"a": [1], "seed": [0]}}, data_axes=("seed",), draw=toy_draw.draw,
                    run_cell=lambda params, rng, device, data_rng: {"m": 0.0})


def _study_package(root, name, body):
    pkg = root / name
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_helper.py").write_text("def helper():\n    return 1\n")
    (pkg / "study.py").write_text(body)


def test_the_study_slice_follows_compute_statements_not_prose_nor_report(tmp_path, monkeypatch):
    """A study's compute digest is the slice of its module (and of its package's helpers) that run_cell reaches:
    a docstring or a comment leaves it, a changed statement in run_cell or in a helper it uses moves it; the
    findings and a helper only they use move the report digest and never the compute one."""
    from kernapprox import provenance

    monkeypatch.syspath_prepend(str(tmp_path))
    body = ('"""A study."""\nfrom studypkg._helper import helper, phrase\n\n\n'
            'def run_cell(params, rng, device):\n    return {"m": helper()}\n\n\n'
            'def findings(ds):\n    return [phrase("a sentence")]\n')
    _study_package(tmp_path, "studypkg", body)
    (tmp_path / "studypkg" / "_helper.py").write_text("def helper():\n    return 1\n\n\n"
                                                      "def phrase(text):\n    return text\n")

    def digests():
        return (provenance.study_digest("studypkg.study", root=tmp_path),
                provenance.study_digest("studypkg.study", provenance.REPORT_ROOTS, root=tmp_path))

    compute, report = digests()
    assert len(compute) == 16 and int(compute, 16) >= 0
    (tmp_path / "studypkg" / "study.py").write_text(body.replace('"""A study."""', '"""Prose."""  # a comment'))
    assert digests() == (compute, report)
    (tmp_path / "studypkg" / "study.py").write_text(body.replace("a sentence", "another sentence"))
    assert digests()[0] == compute and digests()[1] != report                  # the report only
    (tmp_path / "studypkg" / "study.py").write_text(body)
    (tmp_path / "studypkg" / "_helper.py").write_text("def helper():\n    return 1\n\n\n"
                                                      "def phrase(text):\n    return text + '.'\n")
    assert digests()[0] == compute                                             # a helper of the report only
    (tmp_path / "studypkg" / "_helper.py").write_text("def helper():\n    return 2\n\n\n"
                                                      "def phrase(text):\n    return text + '.'\n")
    assert digests()[0] != compute                                             # a helper run_cell uses
    (tmp_path / "studypkg" / "study.py").write_text(body.replace('{"m": helper()}', '{"m": helper() + 0}'))
    changed = digests()[0]
    assert changed not in (compute,)
    with pytest.raises(ValueError, match="not a module"):
        provenance.study_digest("no_such_module_anywhere.study", root=tmp_path)


def test_a_figure_carries_its_provenance_and_status_reports_what_changed(tmp_path, monkeypatch):
    """draw() writes the figure, its findings and a provenance record (the cells' merged dependency record, the
    report digest, the data digest); figure_status is current for it, stale when a module of its record or its
    report code changes, unknown without a record; --strict exits 1 unless every figure is current. A rerun whose
    findings read the same re-stamps the record without redrawing."""
    import shutil

    import toy_paired

    from kernapprox import provenance
    from kernapprox.sweep.__main__ import main

    ds = sweep.run(toy_paired.EXPERIMENT, out=tmp_path / "p.nc", device="cpu", progress=False)
    folder = tmp_path / "figures"
    written = sweep.draw(toy_paired.EXPERIMENT, ds, folder / "p.png", source="results/p.nc")
    assert sorted(p.name for p in written) == ["p.deps.json", "p.md", "p.png"]
    record = sweep.read_provenance(folder / "p.png")
    assert record["study"] == "toy_paired" and record["data_digest"] == sweep.dataset_digest(ds)
    assert "kernapprox.stats" in record["code"]["library"] or record["code"]["library"]
    assert record["code"]["study"] == {"toy_paired": provenance.study_digest("toy_paired")}
    assert [(r.path.name, r.status) for r in sweep.figure_status(folder)] == [("p.md", "current")]
    # a rerun with the same numbers: the record is rewritten, the figure and findings are not
    png, md = (folder / "p.png").stat().st_mtime_ns, (folder / "p.md").read_text()
    again = sweep.run(toy_paired.EXPERIMENT, out=tmp_path / "p.nc", device="cpu", progress=False)
    assert sweep.draw(toy_paired.EXPERIMENT, again, folder / "p.png", source="results/p.nc") == [
        folder / "p.deps.json"]
    assert (folder / "p.png").stat().st_mtime_ns == png and (folder / "p.md").read_text() == md
    # a copy of the project in which one module of the record changes by a statement: stale, naming it
    root = tmp_path / "clone"
    shutil.copytree(provenance.project_root() / "kernapprox", root / "kernapprox",
                    ignore=shutil.ignore_patterns("__pycache__"))
    module = sorted(record["code"]["library"])[-1]
    path = root / (module.replace(".", "/") + ".py")
    path = path if path.is_file() else root / module.replace(".", "/") / "__init__.py"
    path.write_text(path.read_text() + "\n# a comment\n")
    # toy_paired lives outside the clone: it is found where Python finds it
    assert [r.status for r in sweep.figure_status(folder, root=root)] == ["current"]
    path.write_text(path.read_text() + "\n_EDITED = 1\n")
    (row,) = sweep.figure_status(folder, root=root)
    assert row.status == "stale" and f"{module} changed" in row.reasons
    (folder / "q.md").write_text("- x\n\n<!-- findings of results/q.nc (experiments.spectrum); data digest "
                                 "0123456789abcdef -->\n")
    status = {row.path.name: row.status for row in sweep.figure_status(folder)}
    assert status == {"p.md": "current", "q.md": "unknown"}
    assert main(["status", str(folder)]) == 0 and main(["status", str(folder), "--strict"]) == 1
    (folder / "q.md").unlink()
    assert main(["status", str(folder), "--strict"]) == 0
    with pytest.raises(ValueError, match="folder"):
        sweep.figure_status(tmp_path / "missing")


def test_the_cli_names_every_preset_but_the_default_apart(tmp_path, monkeypatch):
    """A preset other than the default writes results/<name>_<preset>.nc and figures/<name>_<preset>.png, as the
    Makefile names them: a smoke run never writes over the default's figure."""
    monkeypatch.chdir(tmp_path)
    assert sweep.run_cli(TOY, ["--preset", "smoke", "--quiet"]) == 0
    assert (tmp_path / "results" / "toy_smoke.nc").is_file() and (tmp_path / "figures" / "toy_smoke.png").is_file()
    assert not (tmp_path / "figures" / "toy.png").exists() and not (tmp_path / "results" / "toy.nc").exists()


def _study_module(name="my_study", **attrs):
    """A study module built in memory: the toy's declarations under the conventional names, plus ``attrs``."""
    import types

    mod = types.ModuleType(f"studies.{name}", doc="What the toy measures,\n   in two lines.")

    def run_cell(params, rng, device):
        return {"m": 0.0}

    def plot(ds, path):
        return None

    for fn in (run_cell, plot):
        fn.__module__ = mod.__name__
    mod.__dict__.update({"GRIDS": {"smoke": {"n": [1, 2], "seed": [0, 1]}},
                         "METRICS": {"m": Metric("a metric", "1", "its description")}, "run_cell": run_cell,
                         "plot": plot, **attrs})
    return mod


def test_from_module_gathers_the_conventional_names_and_keywords_override_them():
    mod = _study_module()
    exp = Experiment.from_module(mod, title="T")
    assert (exp.name, exp.module, exp.title) == ("my_study", "studies.my_study", "T")
    assert exp.description == "What the toy measures, in two lines."
    assert exp.run_cell is mod.run_cell and exp.plot is mod.plot and exp.reference is None
    assert dict(exp.grids["smoke"]) == {"n": [1, 2], "seed": [0, 1]} and list(exp.metrics) == ["m"]
    assert Experiment.from_module(mod, title="T", name="other", description="D.").name == "other"

    def run_reference(params, device, data_rng):
        return {"r": 1.0}

    def run_cell(params, rng, device, data_rng):
        return {"m": 0.0}

    run_reference.__module__ = run_cell.__module__ = "studies.my_study"
    ref = _study_module(run_reference=run_reference, run_cell=run_cell, DATA_AXES=("seed",),
                        REFERENCE_METRICS={"r": Metric("ref", "1", "d")}, REFERENCE_AXES=("n", "seed"))
    exp = Experiment.from_module(ref, title="T")
    assert exp.data_axes == ("seed",) and exp.reference.axes == ("n", "seed")
    assert exp.reference.run_cell is run_reference and list(exp.reference.metrics) == ["r"]


def test_from_module_refuses_an_imported_function_and_unknown_fields():
    mod = _study_module(findings=json.dumps)                  # a conventional name bound to another module's function
    with pytest.raises(TypeError, match="findings is defined in 'json.*pass it by keyword"):
        Experiment.from_module(mod, title="T")
    assert Experiment.from_module(mod, title="T", findings=json.dumps).findings is json.dumps
    with pytest.raises(TypeError, match="unknown Experiment fields"):
        Experiment.from_module(_study_module(), title="T", grid={})
    with pytest.raises(ValueError, match="no REFERENCE_METRICS"):
        Experiment.from_module(_study_module(run_reference=_study_module().run_cell), title="T")
    with pytest.raises(ValueError, match="not imported"):
        Experiment.from_module("no.such.study", title="T")
