"""The result store (kernapprox.store) and the dependency record it keys results by (kernapprox.provenance):
entries are found while the code their process loaded is unchanged, by content (comments and docstrings do not
count), and are refused once a statement of such a module changes; objects and cells are whole or absent; the
size report and pruning; a source edited while a process runs is refused."""

import json
import shutil
import threading

import numpy as np
import pytest

from kernapprox import provenance
from kernapprox.store import Store, input_key, interrupts_deferred


@pytest.fixture
def clone(tmp_path):
    """A copy of the library, so that edits to it never touch the checkout."""
    root = tmp_path / "clone"
    shutil.copytree(provenance.project_root() / "kernapprox", root / "kernapprox",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edit(root, module, text):
    path = root / (module.replace(".", "/") + ".py")
    path = path if path.is_file() else root / module.replace(".", "/") / "__init__.py"
    path.write_text(path.read_text() + text)


def test_an_object_is_found_while_its_code_is_unchanged_and_refused_after_a_statement_edit(tmp_path, clone):
    store = Store(tmp_path / "store", project=clone)
    modules = ["kernapprox.kernel", "kernapprox.validation"]
    entry = store.put("things", "k1", lambda folder: (folder / "x.txt").write_text("1"), modules=modules)
    assert entry.name.startswith("k1.") and (entry / "x.txt").read_text() == "1"
    assert Store(tmp_path / "store", project=clone).find("things", "k1") == entry
    assert Store(tmp_path / "store", project=clone).find("things", "k2") is None
    _edit(clone, "kernapprox.kernel", "\n# a comment\n")
    assert Store(tmp_path / "store", project=clone).find("things", "k1") == entry          # prose: still valid
    _edit(clone, "kernapprox.rules", "\n_EDITED = 1\n")                                      # not in the record
    assert Store(tmp_path / "store", project=clone).find("things", "k1") == entry
    _edit(clone, "kernapprox.kernel", "\n_EDITED = 1\n")                                     # in the record
    fresh = Store(tmp_path / "store", project=clone)
    assert fresh.find("things", "k1") is None
    assert provenance.changes(fresh.record(entry.name.split(".", 1)[1]), root=clone) == ["kernapprox.kernel changed"]
    count, size = fresh.prune()                                      # the entry and its record
    assert count == 2 and size > 0 and fresh.size() == {}


def test_concurrent_writers_of_one_object_leave_one_whole_entry(tmp_path):
    store = Store(tmp_path / "store")
    errors = []

    def write():
        try:
            store.put("things", "same", lambda folder: (folder / "x.npy").write_bytes(np.arange(10**5).tobytes()),
                      modules=["kernapprox.kernel"])
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    entries = [p for p in (tmp_path / "store" / "objects" / "things").iterdir()]
    assert len(entries) == 1 and (entries[0] / "x.npy").stat().st_size == 8 * 10**5


def test_a_cell_file_holds_its_own_key_and_a_damaged_one_reads_as_none(tmp_path):
    store = Store(tmp_path / "store")
    rid = store.current_record(["kernapprox.kernel"])
    key = input_key({"experiment": "x", "params": {"a": 1}})
    path = store.put_cell("x", key, rid, {"a": 1}, {"m": np.float64(2.0)}, 0.5)
    cell = store.read_cell(path)
    assert cell["params"] == {"a": 1} and float(cell["metrics"]["m"]) == 2.0 and cell["seconds"] == 0.5
    assert store.valid_cells("x") == {key: (rid, path)}
    swapped = path.with_name(f"{'0' * 32}.{rid}.npz")
    swapped.write_bytes(path.read_bytes())                      # another cell's numbers under this name
    assert store.read_cell(swapped) is None
    path.write_bytes(path.read_bytes()[:40])
    assert store.read_cell(path) is None
    sizes = store.size()
    assert sizes["cells/x"][0] == 2 and sizes["records"][0] == 1


def test_the_record_names_the_loaded_library_the_study_slice_and_the_packages():
    import kernapprox  # noqa: F401

    record = provenance.dependency_record(study="experiments.modes")
    assert "kernapprox.attention.linear" in record["library"] and "kernapprox.plotting" not in record["library"]
    assert not set(record["library"]) & provenance.REPORT_MODULES
    assert record["study"] == {"experiments.modes": provenance.study_digest("experiments.modes")}
    assert {"numpy", "torch"} <= set(record["packages"])
    assert provenance.changes(record) == []
    assert provenance.record_id(record) == provenance.record_id(json.loads(json.dumps(record)))


def test_a_source_edited_while_the_process_runs_is_refused(monkeypatch):
    monkeypatch.setattr(provenance, "_STARTED_NS", 0)        # as if every file changed after the process began
    with pytest.raises(provenance.SourceChangedError, match="changed while this process ran"):
        provenance.dependency_record(["kernapprox.kernel"])


def test_interrupts_are_held_back_until_the_block_ends():
    import os
    import signal

    order = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            order.append("finished the write")
    assert order == ["finished the write"]
