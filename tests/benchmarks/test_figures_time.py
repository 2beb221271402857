"""benchmarks.figures_time: each study's cost read from its dataset, the run's span from the first start to the
last end, the longest study first, a missing or other-preset dataset named and never counted."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from benchmarks import figures_time


def _dataset(path, preset, start, end, wall, cpu):
    ds = xr.Dataset({"x": ("a", np.zeros(2))})
    ds.attrs.update(preset=preset, preset_base=preset, time_start=start, time_end=end, wall_seconds=str(wall),
                    cpu_seconds=str(cpu), cells_run="3", cells_reused="1", torch_num_threads="1",
                    git_revision="abc")
    ds.to_netcdf(path, engine="h5netcdf")


def test_span_totals_and_missing_studies(tmp_path):
    names = figures_time.studies()
    assert "distillation" in names and "_lm" not in names
    _dataset(tmp_path / f"{names[0]}_full.nc", "full", "2026-12-06T10:00:00+00:00", "2026-12-06T10:20:00+00:00",
             1200, 1190)
    _dataset(tmp_path / f"{names[1]}_full.nc", "full", "2026-12-06T10:05:00+00:00", "2026-12-06T10:45:00+00:00",
             2400, 2300)
    _dataset(tmp_path / f"{names[2]}_full.nc", "default", "2026-12-06T09:00:00+00:00",
             "2026-12-06T09:01:00+00:00", 60, 60)                      # another preset's: named, not counted
    rows, missing = figures_time.collect("full", tmp_path)
    assert [r["study"] for r in rows] == names[:2]
    assert f"{names[2]} (its dataset is not a run of the full preset)" in missing
    assert set(names[3:]) <= set(missing)
    text = figures_time.table("full", rows, missing)
    assert "a span of 45.0 min" in text and "against the budget of 60 min" in text
    assert "add up to 60.0 min" in text and "58.2 CPU-min" in text
    body = [line for line in text.splitlines() if line.startswith((f"| {names[0]} ", f"| {names[1]} "))]
    assert body[0].startswith(f"| {names[1]} | 2400 | 2300 | 3 | 1 | 1 |")              # the longest first
    assert "several runs" not in text


def test_datasets_of_several_runs_are_flagged_and_an_empty_run_refused(tmp_path):
    names = figures_time.studies()
    _dataset(tmp_path / f"{names[0]}.nc", "default", "2026-12-06T10:00:00+00:00", "2026-12-06T10:01:00+00:00", 60, 60)
    _dataset(tmp_path / f"{names[1]}.nc", "default", "2026-12-06T12:00:00+00:00", "2026-12-06T12:01:00+00:00", 60, 60)
    rows, missing = figures_time.collect("default", tmp_path)
    assert "several runs" in figures_time.table("default", rows, missing)
    with pytest.raises(ValueError, match="no dataset of the full preset"):
        figures_time.table("full", *figures_time.collect("full", tmp_path))
