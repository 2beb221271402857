"""The "Choosing an estimator" page: its tables are generated from the studies' datasets and are current."""

import re
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from helpers import docs_module

from kernapprox.sweep import read_digest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGE = DOCS / "guide" / "choosing.md"


@pytest.fixture
def choosing():
    with docs_module("choosing") as module:
        yield module


def test_page_reads_the_data_of_the_committed_findings(choosing):
    """Every dataset the page tabulates has the digest of its committed findings; every study is either
    tabulated or named with the reason it is not."""
    text = PAGE.read_text(encoding="utf-8")
    assert choosing.START in text and choosing.END in text
    listed = re.search(r"^Datasets read: (.*)$", text, flags=re.M)
    assert listed, "the page names no dataset"
    read = dict(re.findall(r"`results/(\w+)\.nc` \(digest ([0-9a-f]+)\)", listed.group(1)))
    assert read, "the page names no dataset"
    for name, digest in read.items():
        findings = ROOT / "figures" / f"{name}.md"
        assert findings.exists() and read_digest(findings.read_text(encoding="utf-8")) == digest, (
            f"{name}: the page's data is not that of figures/{name}.md: run `python docs/generate.py choosing`")
    for name in choosing.sources():
        assert name in read or f"(`{name}`)\n\nNot tabulated: " in text, name


def test_page_is_current_with_the_datasets(choosing):
    """Regenerating the tables from results/*.nc changes nothing (`python docs/generate.py choosing`)."""
    missing = [name for name in choosing.sources() if not (ROOT / "results" / f"{name}.nc").exists()]
    if missing:
        pytest.skip(f"datasets not present in this checkout: {', '.join(missing)} (run make figures)")
    assert choosing.update_page(PAGE, check=True), "run `python docs/generate.py choosing`"


def test_page_is_reachable_from_the_index_and_getting_started():
    assert "guide/findings\nguide/choosing\n" in (DOCS / "index.md").read_text(encoding="utf-8")
    assert "{doc}`choosing`" in (DOCS / "guide" / "getting_started.md").read_text(encoding="utf-8")


def _setting(choosing, best, other, baseline, *, lower_better=True, seeds=12):
    rng = np.random.default_rng(0)

    def draws(mean):
        return xr.DataArray(mean + 0.01 * rng.standard_normal((seeds, 4)), dims=("seed", "episode"))

    return choosing.Setting("toy", [choosing.Candidate("`a`", 1 / 100, draws(best)),
                                    choosing.Candidate("`b`", 1 / 4, draws(other))],
                            draws(baseline) if baseline is not None else None, 0.0, lower_better,
                            within=("episode",))


def test_table_picks_the_best_within_each_budget_and_judges_it_against_the_baseline(choosing):
    """`a` fits every budget, `b` only the largest; the paired verdict follows the interval of the difference."""
    family = choosing.Family("toy", "Toy", "error", "baseline", [_setting(choosing, 0.5, 0.2, 0.4)])
    rows, nothing = choosing.table(family)
    lines = rows.splitlines()[2:]
    assert "`a`" in lines[0] and "**loses to it**" in lines[0]          # ≤ 1/64: a (0.5) against 0.4
    assert "`a`" in lines[1]                                              # ≤ 1/8: b does not fit
    assert "`b`" in lines[2] and "**beats it**" in lines[2]             # ≤ 1×: b (0.2)
    assert nothing == ["toy, ≤ 1/64 KV", "toy, ≤ 1/8 KV"]
    # fewer units than a verdict needs (kernapprox.stats.MIN_UNITS): neither beats nor loses, whatever the gap
    few = choosing.Family("toy", "Toy", "error", "baseline", [_setting(choosing, 0.5, 0.2, 0.4, seeds=5)])
    rows, nothing = choosing.table(few)
    assert rows.count("not resolved (5 seeds)") == 3 and "beats" not in rows and "loses" not in rows
    assert nothing == []
    higher = choosing.Family("toy", "Toy", "accuracy", "chance", [_setting(choosing, 0.9, 0.1, None,
                                                                          lower_better=False)])
    rows, nothing = choosing.table(higher)
    assert "no baseline stored" in rows and not nothing


def test_a_stale_or_absent_dataset_is_named_not_tabulated(choosing, tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "figures" / "icl_recall.md").write_text(
        "- x\n\n<!-- findings of results/icl_recall.nc (experiments.icl_recall); data digest 0123456789abcdef -->\n")
    ds, _, reason = choosing._status("icl_recall", tmp_path)
    assert ds is None and "not present" in reason
    xr.Dataset({"v": ("x", [1.0])}).to_netcdf(tmp_path / "results" / "icl_recall.nc")
    ds, _, reason = choosing._status("icl_recall", tmp_path)
    assert ds is None and "is not the data of the committed" in reason
    ds, _, reason = choosing._status("trained_icl", tmp_path)
    assert ds is None and "no committed findings" in reason
