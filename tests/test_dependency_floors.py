"""pyproject.toml's core floors are what .ci/run's core-floor job installs: the job's own
extraction, run on the file, pins each `name>=X` as `name==X`, so the two cannot drift."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's); 3.10 has no TOML reader

CI = ROOT / ".ci" / "run"
PYPROJECT = ROOT / "pyproject.toml"


def _job() -> str:
    """The body of .ci/run's core_floor function."""
    match = re.search(r"^core_floor\(\) \{\n(.*?)^\}$", CI.read_text(), re.M | re.S)
    assert match is not None, "core_floor() not found in .ci/run"
    return match.group(1)


def ci_floor_pins(pyproject_text: str, tmp_path: Path) -> list[str]:
    """What the job pins, by running its own extraction (the `mapfile -t core` pipeline) on a
    pyproject.toml holding `pyproject_text`."""
    match = re.search(r"mapfile -t core < <\((.*?)\)\n", _job(), re.S)
    assert match is not None, "the core-floor job's extraction not found"
    (tmp_path / "pyproject.toml").write_text(pyproject_text)
    result = subprocess.run(["bash", "-c", match.group(1)], cwd=tmp_path, capture_output=True,
                            text=True, check=True, timeout=30)
    return result.stdout.split()


def declared_pins(pyproject_text: str) -> list[str]:
    """[project] dependencies, read by a TOML parser, each floor `>=X` written `==X`."""
    pins = []
    for requirement in tomllib.loads(pyproject_text)["project"]["dependencies"]:
        name, op, version = re.fullmatch(r"([A-Za-z0-9_.-]+)(>=|==|<|<=|~=)(\S+)",
                                         requirement).groups()
        assert op == ">=", f"{requirement}: a core dependency is declared by its floor"
        pins.append(f"{name}=={version}")
    return pins


def test_ci_installs_the_declared_floors(tmp_path):
    text = PYPROJECT.read_text()
    assert ci_floor_pins(text, tmp_path) == declared_pins(text)
    assert {pin.split("==")[0] for pin in declared_pins(text)} >= {
        "torch", "typer", "rich", "matplotlib", "safetensors"}


def test_a_changed_floor_changes_what_ci_installs(tmp_path):
    """The control: the job reads the file (a floor moved, a dependency added, both follow) and
    the comparison above sees a stale list."""
    text = PYPROJECT.read_text()
    changed = re.sub(r'"rich>=[^"]+"', '"rich>=13.9"', text)
    changed = changed.replace('"safetensors>=', '"numpy>=1.24",\n    "safetensors>=', 1)
    assert changed != text
    pins = ci_floor_pins(changed, tmp_path)
    assert pins == declared_pins(changed)
    assert "rich==13.9" in pins and "numpy==1.24" in pins
    assert ci_floor_pins(text, tmp_path) != declared_pins(changed)


def test_the_job_installs_attnviz_alone_and_runs_core_tests():
    """attnviz without its dependencies (they would pull newer torch), numpy < 2 beside torch
    releases built against numpy 1 (torch < 2.3), and tests that exist."""
    job = _job()
    assert re.search(r'pip" install -q "\$\{core\[@\]\}"', job)
    assert "--no-deps -e ." in job
    torch_floor = next(pin for pin in declared_pins(PYPROJECT.read_text())
                       if pin.startswith("torch=="))
    major, minor = (int(part) for part in torch_floor.split("==")[1].split(".")[:2])
    if (major, minor) < (2, 3):
        assert '"numpy<2"' in job
    tests = re.search(r"^CORE_TESTS=\((.*?)\)$", CI.read_text(), re.M | re.S)
    assert tests is not None
    files = tests.group(1).split()
    assert files and all((ROOT / f).is_file() for f in files)
    assert re.search(r"^core_floor$", CI.read_text(), re.M), "the job is defined but never run"
