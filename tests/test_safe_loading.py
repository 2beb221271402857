"""Safe loading: results, progress files and caches are read without pickle or any code execution.

* result datasets are netCDF-4/HDF5, written and read with the explicit ``h5netcdf`` engine;
* progress files are ``.npz`` read with ``allow_pickle=False`` plus a JSON manifest; a crafted cell file whose
  object array would run code when unpickled is rejected (its cell runs again) and the code never runs;
* a pickle at a result or cache path is refused, and its payload never runs;
* the real-model cache (:mod:`kernapprox.real`) is netCDF read through ``h5netcdf``;
* the code base has no ``pickle``/``joblib``/``dill``/``marshal``/``shelve``, no ``torch.load`` without
  ``weights_only=True``, no ``np.load`` without ``allow_pickle=False``, no netCDF open without an explicit engine,
  and no ``eval``/``exec``.
"""

from __future__ import annotations

import ast
import json
import pickle
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import kernapprox.sweep as sweep

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import toy_experiment  # noqa: E402

TOY = toy_experiment.EXPERIMENT
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class CreatesFileWhenUnpickled:
    """Unpickling this object calls ``open(path, "w")``: proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def engines(monkeypatch):
    """Record the ``engine`` of every ``xarray.open_dataset`` call."""
    seen = []
    original = xr.open_dataset

    def recording(*args, **kwargs):
        seen.append(kwargs.get("engine"))
        return original(*args, **kwargs)

    monkeypatch.setattr(xr, "open_dataset", recording)
    return seen


def test_results_are_netcdf4_read_with_h5netcdf(tmp_path, engines):
    out = tmp_path / "toy.nc"
    sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False, only={"family": "a"})
    assert out.read_bytes()[:8] == HDF5_SIGNATURE
    engines.clear()
    ds = sweep.load(out)
    assert engines and set(engines) == {"h5netcdf"}
    assert ds.attrs[sweep.MARKER] == "toy"


def test_stored_cells_are_npz_without_objects_and_records_json(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(tmp_path / "cache"))        # a store of this test's own
    out = tmp_path / "toy.nc"
    cells = toy_experiment.leave_partial_progress(out, monkeypatch)
    records = list((tmp_path / "cache" / "store" / "records").glob("*.json"))
    assert records and all(json.loads(r.read_text())["library"] for r in records)
    for path in cells:
        assert zipfile.is_zipfile(path)
        with np.load(path, allow_pickle=False) as data:
            assert all(data[name].dtype.kind in "biufU" for name in data.files)


def test_a_pickle_bearing_cell_file_is_rejected_without_running_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(tmp_path / "cache"))        # a store of this test's own
    out = tmp_path / "toy.nc"
    cells = toy_experiment.leave_partial_progress(out, monkeypatch)
    with np.load(cells[0], allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    ran = tmp_path / "payload-ran"
    payload = np.empty(1, dtype=object)
    payload[0] = CreatesFileWhenUnpickled(ran)
    with open(cells[0], "wb") as f:                                 # same cell, same params, a booby-trapped metric
        np.savez(f, **{**arrays, "mean": payload})
    with np.load(cells[0], allow_pickle=False) as data:
        with pytest.raises(ValueError, match="allow_pickle"):
            data["mean"]
    assert not ran.exists()
    ds = sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False)
    assert not ran.exists()
    assert ds.attrs["cells_run"] == 17 and "runs again" in capsys.readouterr().err
    reference = sweep.run(TOY, preset="smoke", out=tmp_path / "reference.nc", device="cpu", progress=False)
    np.testing.assert_array_equal(ds["mean"].values, reference["mean"].values)


def test_a_pickle_at_a_result_path_is_refused_without_running_it(tmp_path):
    ran = tmp_path / "payload-ran"
    out = tmp_path / "toy.nc"
    out.write_bytes(pickle.dumps(CreatesFileWhenUnpickled(ran)))
    with pytest.raises(ValueError, match="not a readable netCDF"):
        sweep.load(out)
    with pytest.raises(sweep.OutputPathError):
        sweep.run(TOY, preset="smoke", out=out, device="cpu", progress=False)
    assert not ran.exists()


def _fake_real_cache(path, n=6):
    from kernapprox import real

    g = np.random.default_rng(0)
    dims = ("layer", "head", "token", "dim")
    shape = (real.NUM_LAYERS, 2, n, real.HEAD_DIM)
    xr.Dataset({name: (dims, g.standard_normal(shape).astype(np.float32)) for name in ("q", "k", "v")}
               | {"token_id": ("token", np.arange(n, dtype=np.int32)),
                  "window": ("token", np.zeros(n, dtype=np.int32)),
                  "position": ("token", np.arange(n, dtype=np.int32))},
               attrs={"model_name": real.MODEL_NAME, "text_sha256": real._text_sha256()}  # as if from this text
               ).to_netcdf(path, engine="h5netcdf")


def test_real_model_cache_is_netcdf_read_with_h5netcdf(tmp_path, engines):
    from kernapprox import real

    path = real.cache_path(num_windows=1, start=7, path=tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _fake_real_cache(path)
    engines.clear()
    qkv = real.load_qkv(num_windows=1, start=7, cache_dir=tmp_path)
    assert set(engines) == {"h5netcdf"}
    assert qkv["q"].shape == (real.NUM_LAYERS, 2, 6, real.HEAD_DIM) and qkv["q"].dtype == np.float32


def test_a_pickle_at_the_real_model_cache_path_never_runs(tmp_path):
    from kernapprox import real

    ran = tmp_path / "payload-ran"
    path = real.cache_path(num_windows=1, start=11, path=tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(CreatesFileWhenUnpickled(ran)))
    with pytest.raises((OSError, ValueError)):
        real.load_qkv(num_windows=1, start=11, cache_dir=tmp_path)
    assert not ran.exists()


# --------------------------------------------------------------------------------------- the code base
SOURCES = sorted(p for folder in ("kernapprox", "experiments", "benchmarks") for p in (ROOT / folder).rglob("*.py"))
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "joblib", "dill", "cloudpickle", "marshal", "shelve"}
NETCDF_OPENERS = {"open_dataset", "open_dataarray", "open_mfdataset", "load_dataset", "load_dataarray"}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword_is(call, name, value) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value
               for k in call.keywords)


def code_base_problems(path: Path) -> list[str]:
    """Ways ``path`` could load data through pickle or run code from data (found in its syntax tree)."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] in PICKLE_MODULES for m in modules):
                problems.append(f"line {node.lineno}: imports {modules}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name in ("eval", "exec"):
            problems.append(f"line {node.lineno}: {name}()")
        elif name == "torch.load" and not _keyword_is(node, "weights_only", True):
            problems.append(f"line {node.lineno}: torch.load without weights_only=True")
        elif name in ("np.load", "numpy.load") and not _keyword_is(node, "allow_pickle", False):
            problems.append(f"line {node.lineno}: {name} without allow_pickle=False")
        elif last in NETCDF_OPENERS and name.split(".")[0] in ("xr", "xarray") and \
                not any(k.arg == "engine" for k in node.keywords):
            problems.append(f"line {node.lineno}: {name} without an explicit engine")
        if _keyword_is(node, "allow_pickle", True) or _keyword_is(node, "weights_only", False):
            problems.append(f"line {node.lineno}: {name} allows pickle")
    return problems


def test_the_code_base_loads_nothing_through_pickle():
    assert len(SOURCES) > 20
    problems = [f"{path.relative_to(ROOT)} {p}" for path in SOURCES for p in code_base_problems(path)]
    assert not problems, "\n".join(problems)


def test_the_code_base_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport numpy as np, torch, xarray as xr\nnp.load('a')\ntorch.load('b')\n"
                   "torch.load('c', weights_only=False)\nxr.open_dataset('d')\neval('1')\n"
                   "np.load('e', allow_pickle=False)\nxr.open_dataset('f', engine='h5netcdf')\n")
    flagged = {int(p.split()[1].rstrip(":")) for p in code_base_problems(bad)}
    assert flagged == {1, 3, 4, 5, 6, 7}
