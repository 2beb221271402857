"""Files written whole or not at all, and cached netCDF arrays read once while unchanged."""

import numpy as np
import pytest
import xarray as xr

from kernapprox.io import atomic_write, read_arrays


def _write(path, value):
    ds = xr.Dataset({"a": ("x", np.full(3, value)), "b": ("x", np.arange(3.0))}, attrs={"note": f"v{value}"})
    atomic_write(path, lambda tmp: ds.to_netcdf(tmp, engine="h5netcdf"))


def test_read_arrays_reads_once_and_again_after_a_rewrite(tmp_path):
    path = tmp_path / "c.nc"
    _write(path, 1.0)
    first = read_arrays(path, ("a", "b"))
    np.testing.assert_array_equal(first["a"], [1.0, 1.0, 1.0])
    assert first["attrs"]["note"] == "v1.0" and set(first) == {"a", "b", "attrs"}
    assert read_arrays(str(path), ["a", "b"]) is first                     # memoised: same path, same file
    _write(path, 2.0)                                                      # rewritten in place
    second = read_arrays(path, ("a", "b"))
    assert second is not first and second["attrs"]["note"] == "v2.0"
    np.testing.assert_array_equal(second["a"], [2.0, 2.0, 2.0])
    with pytest.raises(KeyError, match="'zz'"):
        read_arrays(path, ("a", "zz"))
    with pytest.raises(FileNotFoundError):
        read_arrays(tmp_path / "missing.nc", ("a",))


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(path, fail)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]
