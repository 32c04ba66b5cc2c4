"""Nothing after a kill: `attnviz heatmap … --out F.png` killed (SIGTERM, SIGINT, or SIGKILL of
the process the shell started) at any moment of the figure's life leaves no F.png, neither then
nor later, no temporary file, and no process of its own running; it exits as docs/errors.md
says (128 + N, or killed by N, which a shell shows as 128 + N too).

The runs go through the console entry point with its supervisor (cli/supervisor.py): the
process started here is the supervisor, its child runs the command, and the figure worker
(cli/figure_worker.py) is that child's child. A driver pauses the run at one moment of the
figure (MOMENT) and marks it in a file; the test then signals the supervisor, waits for its end,
and waits longer than the pause (a survivor would have finished drawing and writing by then).

Negative control: the same kills with the old worker (no death signal, not stopped by the run,
writing the output itself) leave a surviving worker that writes F.png after the run's end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts attnviz processes

ROOT = Path(__file__).resolve().parents[1]
PAUSE = 3.0  # seconds each paused moment lasts: the kill lands inside it
SENTENCE = "the cat sat on the mat"

DRIVER = """
import os, sys, time
from pathlib import Path
from attnviz.cli import figure_worker, supervisor

marks, moment = Path(os.environ["MARKS"]), os.environ["MOMENT"]
pause = float(os.environ["PAUSE"])
real_draw, real_render, real_save = (figure_worker.FigureWorker.draw, figure_worker._draw,
                                     figure_worker._save)

def mark(what):
    with marks.open("a") as f:
        f.write(what + "\\n")

def pause_at(here):
    if here == moment:
        mark(here)
        time.sleep(pause)

def draw(self, job):  # the run, the job not sent yet: the worker waits for it
    pause_at("before")
    return real_draw(self, job)

def render(job):  # the worker, drawing
    pause_at("drawing")
    return real_render(job)

def save(figure, job):  # the worker, drawn: before it writes the temporary file, and after
    pause_at("writing")
    real_save(figure, job)
    pause_at("written")

if os.environ.get("OLD_WORKER"):  # the control: the worker as it was before the fix
    import pickle
    from attnviz.cli.paths import write_figure
    supervisor.die_with_parent = lambda parent, sig: True  # no death signal

    def real_draw(self, job):  # the run neither stops it nor writes the output
        self.open = False
        try:
            with os.fdopen(self.to_worker, "wb") as pipe:
                pipe.write(pickle.dumps(job))
            with os.fdopen(self.from_worker, "rb") as pipe:
                answer = pipe.read()
        finally:
            figure_worker._reap(self.pid)
        return answer == b"ok"

    def real_save(figure, job):  # it writes the output itself
        write_figure(figure, job.path)

figure_worker.FigureWorker.draw = draw
figure_worker._draw, figure_worker._save = render, save
from attnviz.cli.main import main
sys.argv = ["attnviz", *sys.argv[1:]]
main()
"""


@dataclass
class Kill:
    """One run: killed with `sig` at `moment`."""

    name: str
    sig: signal.Signals
    moment: str
    folder: Path
    group: bool = False  # to the whole process group, as a terminal's Ctrl-C, not to one pid
    proc: subprocess.Popen | None = None
    family: tuple[int, ...] = ()  # the supervisor's descendants when it was signalled
    killed_at: float = 0.0  # time.monotonic() of the signal
    outlived: tuple[int, ...] = ()  # of `family`, those still running when the run had ended
    out_at_end: bool = False  # whether the output existed when the run had ended
    out_text: str = ""
    err_text: str = ""

    @property
    def out(self) -> Path:
        return self.folder / "big.png"

    @property
    def marks(self) -> Path:
        return self.folder / "marks"


def _start(kill: Kill, old_worker: bool) -> None:
    kill.folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MARKS": str(kill.marks),
           "MOMENT": kill.moment, "PAUSE": str(PAUSE), "MPLBACKEND": "Agg"}
    for name in ("ATTNVIZ_NO_SUPERVISOR", "ATTNVIZ_FIGURE_WORKER", "OLD_WORKER"):
        env.pop(name, None)
    if old_worker:
        env["OLD_WORKER"] = "1"
    kill.proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "heatmap", SENTENCE, "--quiet", "--out", str(kill.out)],
        env=env, cwd=kill.folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)  # a process group of its own, for the Ctrl-C cases


def _descendants(pid: int) -> tuple[int, ...]:
    """Every running process below `pid`, read from /proc (each process's parent)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return tuple(found)


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for whoever adopted it to reap it, has ended)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _run_all(kills: list[Kill], old_worker: bool = False) -> None:
    """Start every run, signal each at its moment, wait for each to end, then for longer than
    a survivor would need to finish the figure."""
    for kill in kills:
        _start(kill, old_worker)
    deadline = time.monotonic() + 300
    waiting = list(kills)
    while waiting and time.monotonic() < deadline:
        for kill in list(waiting):
            assert kill.proc is not None
            if kill.proc.poll() is not None:  # ended before its moment: shown by the checks
                waiting.remove(kill)
            elif kill.marks.exists() and kill.marks.read_text().strip():
                kill.family = _descendants(kill.proc.pid)
                kill.killed_at = time.monotonic()
                if kill.group:
                    os.killpg(kill.proc.pid, kill.sig)
                else:
                    kill.proc.send_signal(kill.sig)
                waiting.remove(kill)
        time.sleep(0.02)
    for kill in kills:  # each one's end; a survivor may hold its stdout open longer
        assert kill.proc is not None
        try:
            kill.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill.proc.kill()
            raise
    for kill in kills:
        kill.outlived = tuple(pid for pid in kill.family if _alive(pid))
        kill.out_at_end = kill.out.exists()
    for kill in kills:
        assert kill.proc is not None
        out, err = kill.proc.communicate(timeout=120)
        kill.out_text, kill.err_text = out.decode(), err.decode()
    last = max(kill.killed_at for kill in kills)
    time.sleep(max(0.0, last + PAUSE + 3.0 - time.monotonic()))


MOMENTS = ("before", "drawing", "writing", "written")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)


@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> list[Kill]:
    top = tmp_path_factory.mktemp("kills")
    runs = [Kill(f"{sig.name}-{moment}", sig, moment, top / f"{sig.name}-{moment}")
            for sig in SIGNALS for moment in MOMENTS]
    runs += [Kill(f"ctrl-c-{moment}", signal.SIGINT, moment, top / f"ctrl-c-{moment}", True)
             for moment in MOMENTS]
    _run_all(runs)
    return runs


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("moment", MOMENTS)
def test_nothing_after_a_kill(kills, sig, moment):
    """Killed at `moment`: no output, no temporary file, no process left, the documented exit
    status, and no `wrote` line (checks in `_left_nothing`)."""
    kill = next(k for k in kills if k.sig == sig and k.moment == moment and not k.group)
    _left_nothing(kill)


@pytest.mark.parametrize("moment", MOMENTS)
def test_nothing_after_ctrl_c(kills, moment):
    """Ctrl-C (SIGINT to the whole process group: the worker ignores it, the run stops it) at
    `moment`: the same."""
    _left_nothing(next(k for k in kills if k.moment == moment and k.group))


def _left_nothing(kill: Kill) -> None:
    sig = kill.sig
    assert kill.proc is not None
    err = kill.err_text
    assert kill.killed_at, f"the run ended before its moment: {err}"
    assert len(kill.family) >= 2, kill.family  # the run's process and its figure worker
    assert kill.proc.returncode in (128 + sig, -sig), (kill.proc.returncode, err)
    survivors = [pid for pid in kill.family if _alive(pid)]
    assert survivors == []
    assert sorted(p.name for p in kill.folder.iterdir()) == ["marks"]  # no output, no temp file
    # after a SIGKILL the run's process is sent SIGTERM (the supervisor's death signal), and
    # may say so as it stops
    said = signal.SIGTERM if sig == signal.SIGKILL else sig
    assert err in ("", f"error: interrupted by {said.name}; no partial output was left\n"), err
    assert kill.out_text == ""  # --quiet, and no `wrote` line


def test_an_orphaned_worker_is_caught(tmp_path):
    """The control: the worker as it was (no death signal, not stopped, writing the output
    itself) outlives a run killed while it draws, and writes the output after the run's end —
    the checks above catch both."""
    runs = [Kill(f"old-{sig.name}", sig, "drawing", tmp_path / sig.name)
            for sig in (signal.SIGTERM, signal.SIGKILL)]
    _run_all(runs, old_worker=True)
    for kill in runs:
        assert kill.proc is not None
        assert kill.proc.returncode in (128 + kill.sig, -kill.sig)
        assert kill.outlived, kill.name  # the worker ran on after the run had ended
        assert not kill.out_at_end and kill.out.exists(), kill.name  # written after the end


RACE = """
import ctypes, os, signal, time
from attnviz.cli.supervisor import die_with_parent

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans below come back here
read, write = os.pipe()
checked, told = os.pipe()
middle = os.fork()
if middle == 0:
    parent = os.getpid()
    if os.fork() == 0:
        alive = die_with_parent(parent, 0)  # 0: no signal (this one must outlive its parent)
        os.write(told, b"x")  # the parent may go now
        time.sleep(0.5)  # the parent dies meanwhile: before the request, as far as it knows
        dead = die_with_parent(parent, signal.SIGKILL)  # too late to fire: never sent
        old_check_saw_it = os.getppid() == 1  # the check before the fix
        os.write(write, f"{alive} {dead} {old_check_saw_it}".encode())
        os._exit(0)
    os.read(checked, 1)
    os._exit(0)
os.close(write)
os.waitpid(middle, 0)
print(os.read(read, 100).decode())
os.wait()  # the adopted orphan
"""


def test_a_parent_dead_before_the_request_is_seen():
    """The death signal is asked for after the fork: a parent that died before that is caught
    by comparing the parent's pid with the one before the fork, even where a subreaper (here
    the script itself; systemd --user, a container's init) adopts the orphan instead of pid 1
    — the control: the old check, the parent's pid against 1, misses it there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RACE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "False"]
