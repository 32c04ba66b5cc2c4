"""`heatmap --out`'s figure worker (attnviz.cli.figure_worker): forked before torch's import, it
draws the same PNG bytes the run would draw itself, and any failure of it falls back to that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import side_by_side

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
    try:
        ok = draw(self, job)
    except OSError:
        gone = not os.path.exists(f"/proc/{self.pid}")  # killed and reaped before the error
        marks.write(f"draw raised, worker gone={gone}\\n")
        marks.flush()
        raise
    marks.write(f"draw {ok}\\n")
    marks.flush()
    return ok

figure_worker.FigureWorker.start = staticmethod(started)
figure_worker.FigureWorker.draw = drawn
if os.environ.get("BREAK_WORKER"):
    def broken(job_read, answer_write):
        raise RuntimeError("a worker that fails")
    figure_worker._serve = broken
if os.environ.get("NO_TEMP"):  # the run's first temporary file cannot be made
    from attnviz.app import outputs
    made = outputs.atomic_output
    def no_temp(path, calls=[]):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(28, "No space left on device", str(path))
        return made(path)
    outputs.atomic_output = no_temp
from attnviz.cli.main import main
sys.argv = ["attnviz", *sys.argv[1:]]
main()
"""


def _start(folder: Path, name: str, *args: str, **env: str) -> subprocess.Popen:
    full = {**os.environ, "ATTNVIZ_NO_SUPERVISOR": "1", "MARKS": str(folder / f"{name}.marks"),
            **env}
    return subprocess.Popen([sys.executable, "-c", DRIVER, "heatmap", SENTENCE, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full)


def _outcome(folder: Path, name: str, done: subprocess.CompletedProcess
             ) -> tuple[int, str, list[str]]:
    """(exit status, stderr, what the worker did), once its worker was reaped."""
    marks = folder / f"{name}.marks"
    lines = marks.read_text().splitlines() if marks.exists() else []
    pids = [int(line.split()[1]) for line in lines if line.startswith("pid ")]
    for pid in pids:  # the worker was reaped: no process is left running
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/status").read_text().count("State:\tZ") == 1
    return done.returncode, done.stderr.decode(), [line for line in lines
                                                   if not line.startswith("pid ")]


# name: (extra arguments, environment); "own" (the worker turned off) is every case's control
RUNS = {
    "worker": ((), {}),
    "broken": ((), {"BREAK_WORKER": "1"}),
    "own": ((), {"ATTNVIZ_FIGURE_WORKER": "0"}),
    "refused": (("--layer", "7"), {}),
    "no-temp": ((), {"NO_TEMP": "1"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, dict[str, tuple[int, str, list[str]]]]:
    """Every case's run, started side by side (independent processes): (their folder, each
    run's outcome). Each writes --out FOLDER/NAME.png."""
    folder = tmp_path_factory.mktemp("figure-worker")
    started = {name: _start(folder, name, "--out", str(folder / f"{name}.png"), *args, **env)
               for name, (args, env) in RUNS.items()}
    done = side_by_side(*started.values(), timeout=300)
    return folder, {name: _outcome(folder, name, result)
                    for name, result in zip(started, done, strict=True)}


def test_the_worker_draws_the_bytes_the_run_would(runs):
    """Started before torch was imported, the worker drew and wrote the figure; the same run
    with the worker turned off (the control: it never starts) writes the same bytes."""
    folder, outcome = runs
    code, err, marks = outcome["worker"]
    assert code == 0, err
    assert marks == ["start torch=False worker=True", "draw True"]
    code, err, marks = outcome["own"]
    assert code == 0, err
    assert marks == ["start torch=False worker=False"]
    assert (folder / "worker.png").read_bytes() == (folder / "own.png").read_bytes()


def test_a_failing_worker_leaves_the_figure_to_the_run(runs):
    """A worker that fails draws nothing and writes nothing; the run then draws the figure
    itself, the same bytes as a run without a worker."""
    folder, outcome = runs
    code, err, marks = outcome["broken"]
    assert code == 0, err
    assert marks == ["start torch=False worker=True", "draw False"]
    assert outcome["own"][0] == 0
    assert (folder / "broken.png").read_bytes() == (folder / "own.png").read_bytes()
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".png") == \
        ["broken.png", "own.png", "worker.png"]  # no temporary file left behind


def test_a_run_that_fails_stops_its_worker(runs):
    """A run refused after its worker started exits with its usual error, writes nothing, and
    leaves no worker behind."""
    folder, outcome = runs
    code, err, marks = outcome["refused"]
    assert code == 2 and err.startswith("error:"), err
    assert marks == ["start torch=False worker=True"]
    assert not (folder / "refused.png").exists()


def test_a_temporary_file_that_cannot_be_made_stops_the_worker(runs):
    """When the run cannot make the temporary file the worker would fill (a full disk), the
    run fails with its usual error line, and its worker, never sent a job, was stopped and
    reaped before that (not left waiting until the run's exit)."""
    folder, outcome = runs
    code, err, marks = outcome["no-temp"]
    assert code == 1 and err.startswith("error: ") and "No space left" in err, err
    assert marks == ["start torch=False worker=True", "draw raised, worker gone=True"]
    assert not (folder / "no-temp.png").exists()
