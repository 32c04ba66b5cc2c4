"""attnviz as a user installs it: a wheel, built from this checkout and installed into a fresh
virtual environment outside it, runs the main job on the bundled model it carries (package
data), writes the HTML view (its script and style are package data too), splits, inspects, and
displays in a notebook — from a working directory that is not the checkout. The wheel is
installed without dependencies; the environment reaches this one's (torch, …) through a .pth
file, so nothing is downloaded."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import BUNDLED, ROOT, finish, side_by_side

SENTENCE = "the cat sat on the mat the cat sat"


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return finish(_start(args, cwd, **env))


def _start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen[str]:
    """The process `_run` waits for, started (`side_by_side` waits for several)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**clean, "MPLBACKEND": "Agg", "COLUMNS": "100", **env})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding attnviz from a wheel of this checkout; returns its bin folder."""
    base = tmp_path_factory.mktemp("packaging")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(base / "dist"), str(ROOT)], cwd=base)
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "dist").glob("attnviz-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("attnviz/data/induction.safetensors", "attnviz/render/html_view.js",
                    "attnviz/render/html_view.css"):
        assert shipped in names, f"{shipped} is not in the wheel"
    env = base / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    done = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                 "--no-index", "-q", str(wheel)], cwd=base)
    assert done.returncode == 0, done.stderr
    env_site = Path(_run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         cwd=base).stdout.strip())
    # the dependencies: this environment's packages, after the new one's own (attnviz)
    (env_site / "test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return env / "bin"


@pytest.mark.slow
def test_installed_wheel_runs_the_main_job_on_its_bundled_model(installed, tmp_path, cli):
    # the headline command, as typed, then with every data output (side by side)
    where, main, result = side_by_side(
        _start([str(installed / "python"), "-c", "import attnviz; print(attnviz.__file__)"],
               cwd=tmp_path),
        _start([str(installed / "attnviz"), "heatmap", SENTENCE], cwd=tmp_path),
        _start([str(installed / "attnviz"), "heatmap", SENTENCE, "--json",
                "--html", "view.html", "--out", "maps.png"], cwd=tmp_path))
    package = Path(where.stdout.strip()).parent
    assert package.parent.name == "site-packages" and ROOT not in package.parents, where

    assert main.returncode == 0 and main.stderr == "", main.stderr
    assert "is missing" not in main.stdout and "layer 1" in main.stdout
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["source"] == str(package / "data" / "induction.safetensors")  # exact, its own copy
    html = (tmp_path / "view.html").read_text()
    assert "<script>" in html and "induction.safetensors" in html
    assert (tmp_path / "maps.png").stat().st_size > 1000

    # the same numbers as this checkout's run (only the source path differs); floats to 1e-6,
    # since the in-process run and the installed process may sum in another thread order
    reference = json.loads(cli("heatmap", SENTENCE, "--json").stdout)
    assert reference["source"] == str(BUNDLED)
    _assert_close({k: v for k, v in doc.items() if k != "source"},
                  {k: v for k, v in reference.items() if k != "source"})


def _assert_close(got: object, want: object, where: str = "") -> None:
    """Equal JSON documents, floats within 1e-6 relative (and 1e-9 absolute)."""
    import math

    if isinstance(want, float) and isinstance(got, int | float):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def test_the_wheel_comparison_can_fail() -> None:
    with pytest.raises(AssertionError):
        _assert_close({"a": [1.0, 2.0]}, {"a": [1.0, 2.1]})
    with pytest.raises(AssertionError):
        _assert_close({"a": "x"}, {"a": "y"})
    _assert_close({"a": [1.0, 2.0 + 1e-9]}, {"a": [1.0, 2.0]})


@pytest.mark.slow
def test_installed_wheel_splits_inspects_and_displays(installed, tmp_path):
    split, notebook = (_start([str(installed / "attnviz"), "split", "-E", "16", "-H", "4"],
                              cwd=tmp_path),
                       _start([str(installed / "python"), "-c",
                               "import attnviz; h = attnviz.run_heatmap(['the cat sat']); "
                               "print(len(h._repr_html_()), len(h._repr_png_()))"], cwd=tmp_path))
    bundled = _run([str(installed / "python"), "-c", "from attnviz.sources.bundled import "
                    "BUNDLED; print(BUNDLED)"], cwd=tmp_path).stdout.strip()
    inspected = _run([str(installed / "attnviz"), "inspect", bundled, "--json"], cwd=tmp_path)
    split, notebook = side_by_side(split, notebook)
    assert split.returncode == 0 and "equal to float32 round-off" in split.stdout, split.stderr
    assert inspected.returncode == 0, inspected.stderr
    assert [layer["name"] for layer in json.loads(inspected.stdout)["layers"]] \
        == ["layers.0.self_attn", "layers.1.self_attn"]
    assert notebook.returncode == 0, notebook.stderr
    html_chars, png_bytes = map(int, notebook.stdout.split())
    assert html_chars > 10_000 and png_bytes > 1000


def test_missing_bundled_model_is_one_clear_error(monkeypatch, cli, tmp_path):
    """Negative control for the locator: a install without the data file says so, and how to
    get it back, instead of failing somewhere inside."""
    from attnviz.sources import bundled

    monkeypatch.setattr(bundled, "BUNDLED", tmp_path / "induction.safetensors")
    result = cli("heatmap", SENTENCE)
    assert result.exit_code == 1
    assert "the bundled model attnviz/data/induction.safetensors is missing" in result.stderr
    assert "reinstall attnviz" in result.stderr
