"""`heatmap --out`'s figure worker (attnviz.cli.figure_worker): forked before torch's import, it
draws the same PNG bytes the run would draw itself, and any failure of it falls back to that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts attnviz processes

SENTENCE = "the cat sat on the mat the cat sat"

# Runs the CLI in this process (no supervisor), recording what the worker did into MARKS.
DRIVER = """
import os, sys
from attnviz.cli import figure_worker

marks = open(os.environ["MARKS"], "a")
start, draw = figure_worker.FigureWorker.start, figure_worker.FigureWorker.draw

def started(cls=figure_worker.FigureWorker):
    worker = start.__func__(cls)
    marks.write(f"start torch={'torch' in sys.modules} worker={worker is not None}\\n")
    if worker is not None:
        marks.write(f"pid {worker.pid}\\n")
    marks.flush()
    return worker

def drawn(self, job):
    ok = draw(self, job)
    marks.write(f"draw {ok}\\n")
    marks.flush()
    return ok

figure_worker.FigureWorker.start = staticmethod(started)
figure_worker.FigureWorker.draw = drawn
if os.environ.get("BREAK_WORKER"):
    def broken(job_read, answer_write):
        raise RuntimeError("a worker that fails")
    figure_worker._serve = broken
from attnviz.cli.main import main
sys.argv = ["attnviz", *sys.argv[1:]]
main()
"""


def _run(tmp_path: Path, name: str, *args: str, **env: str) -> tuple[int, str, list[str]]:
    marks = tmp_path / f"{name}.marks"
    full = {**os.environ, "ATTNVIZ_NO_SUPERVISOR": "1", "MARKS": str(marks), **env}
    done = subprocess.run([sys.executable, "-c", DRIVER, "heatmap", SENTENCE, *args],
                          capture_output=True, text=True, env=full, timeout=300)
    lines = marks.read_text().splitlines() if marks.exists() else []
    pids = [int(line.split()[1]) for line in lines if line.startswith("pid ")]
    for pid in pids:  # the worker was reaped: no process is left running
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/status").read_text().count("State:\tZ") == 1
    return done.returncode, done.stderr, [line for line in lines if not line.startswith("pid ")]


def test_the_worker_draws_the_bytes_the_run_would(tmp_path):
    """Started before torch was imported, the worker drew and wrote the figure; the same run
    with the worker turned off (the control: it never starts) writes the same bytes."""
    worker_png, own_png = tmp_path / "worker.png", tmp_path / "own.png"
    code, err, marks = _run(tmp_path, "worker", "--out", str(worker_png))
    assert code == 0, err
    assert marks == ["start torch=False worker=True", "draw True"]
    code, err, marks = _run(tmp_path, "own", "--out", str(own_png), ATTNVIZ_FIGURE_WORKER="0")
    assert code == 0, err
    assert marks == ["start torch=False worker=False"]
    assert worker_png.read_bytes() == own_png.read_bytes()


def test_a_failing_worker_leaves_the_figure_to_the_run(tmp_path):
    """A worker that fails draws nothing and writes nothing; the run then draws the figure
    itself, the same bytes as a run without a worker."""
    broken_png, own_png = tmp_path / "broken.png", tmp_path / "own.png"
    code, err, marks = _run(tmp_path, "broken", "--out", str(broken_png), BREAK_WORKER="1")
    assert code == 0, err
    assert marks == ["start torch=False worker=True", "draw False"]
    assert _run(tmp_path, "own", "--out", str(own_png), ATTNVIZ_FIGURE_WORKER="0")[0] == 0
    assert broken_png.read_bytes() == own_png.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png") == \
        ["broken.png", "own.png"]  # no temporary file left behind


def test_a_run_that_fails_stops_its_worker(tmp_path):
    """A run refused after its worker started exits with its usual error, writes nothing, and
    leaves no worker behind."""
    png = tmp_path / "never.png"
    code, err, marks = _run(tmp_path, "refused", "--out", str(png), "--layer", "7")
    assert code == 2 and err.startswith("error:"), err
    assert marks == ["start torch=False worker=True"]
    assert not png.exists()
