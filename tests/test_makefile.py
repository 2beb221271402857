"""The Makefile's preset naming, read from ``make -n`` and the scheduler's commands (nothing runs): the default
preset writes ``results/<name>.nc`` and ``figures/<name>.png``; any other writes ``results/<name>_<preset>.nc`` and
``figures/<name>_<preset>.png``, so ``make figures PRESET=full`` overwrites no default figure."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("[a-z]*.py"))

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _planned(*args: str) -> str:
    """The commands ``make -n figures`` would run."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "figures", *args], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout


class _Finished:
    """A stand-in for a study's process: records its command, finishes at once."""

    commands: list = []

    def __init__(self, cmd, *args, **kwargs):
        self.commands.append(cmd)
        self.returncode = 0

    def poll(self):
        return 0


@pytest.mark.parametrize("preset", ["default", "full"])
def test_each_preset_writes_its_own_files(preset, monkeypatch, tmp_path):
    """`make figures PRESET=p` hands the preset to the scheduler, which runs every study of it (with --all) into
    results/<name><suffix>.nc and figures/<name><suffix>.png: no other preset's files."""
    from kernapprox.sweep import _schedule

    plan = _planned(f"PRESET={preset}")
    assert f"-m kernapprox.sweep figures --preset {preset} " in plan
    assert all(name in plan for name in EXPERIMENTS)
    _Finished.commands = []
    monkeypatch.setattr(_schedule.subprocess, "Popen", _Finished)
    todo = _schedule.plan(EXPERIMENTS, [preset], tmp_path / "figures", everything=True)
    assert _schedule.run_studies(todo, jobs=2, device="cpu", threads=1) == 0
    suffix = "" if preset == "default" else f"_{preset}"
    text = "\n".join(" ".join(cmd) for cmd in _Finished.commands)
    for name in EXPERIMENTS:
        assert re.search(rf"--out results/{name}{suffix}\.nc\b", text), (name, preset)
        assert re.search(rf"--figure figures/{name}{suffix}\.png\b", text), (name, preset)
    written = set(re.findall(r"--out (results/\S+\.nc)", text)) | set(re.findall(r"--figure (figures/\S+\.png)", text))
    if preset != "default":          # no default dataset or figure is written by another preset's run
        assert not {f"results/{n}.nc" for n in EXPERIMENTS} & written
        assert not {f"figures/{n}.png" for n in EXPERIMENTS} & written
    assert set(re.findall(r"--preset (\w+)", text)) == {preset}


def _named_presets() -> list[tuple[str, str]]:
    """The Makefile's NAMED_PRESETS as (study, preset) pairs."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(r"^NAMED_PRESETS\s*:=(.*)$", text, re.M)
    assert match, "the Makefile declares NAMED_PRESETS"
    return [tuple(item.split(":")) for item in match.group(1).split()]


def test_named_presets_exist_and_write_their_own_files():
    """Each named preset belongs to its study's GRIDS, and `make <study>-<preset>` runs that preset into
    results/<study>_<preset>.nc and figures/<study>_<preset>.png (nothing of the default's or full's)."""
    import importlib

    named = _named_presets()
    assert named
    for study, preset in named:
        assert preset not in ("smoke", "default", "full"), (study, preset)
        grids = importlib.import_module(f"experiments.{study}").GRIDS
        assert preset in grids, (study, preset, sorted(grids))
        target = f"{study.replace('_', '-')}-{preset}"
        plan = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
        assert f"-m experiments.{study} --preset {preset} " in plan, (target, plan)
        assert f"--out results/{study}_{preset}.nc" in plan, (target, plan)
        assert f"--figure figures/{study}_{preset}.png" in plan, (target, plan)
