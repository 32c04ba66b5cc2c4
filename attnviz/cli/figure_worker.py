"""`heatmap --out`'s figure drawn by a second process, forked before the run imports torch.

matplotlib's import costs about half a second of one core. In the run's own process it comes
after torch's import or competes with the run's threads, and a thread cannot overlap it with
torch's import (both hold the GIL). A process forked at the start imports it on the other
core while the run imports torch, then waits: the run sends the finished display views (plain
numpy and text, `attnviz.compute.display.views`, no torch) over a pipe, and the worker draws the
figure into a temporary file the run made with `app.outputs`' one atomic writer; the run moves
it into place. The worker dies with the run (PR_SET_PDEATHSIG) and the run stops it on any
signal it handles, so no orphan ever writes after the run was killed. The worker is an
optimisation only: on any failure the run draws the figure itself, which reports the error as
usual.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.compute.display.views import MapView


@dataclass(frozen=True)
class FigureJob:
    """Everything `heatmap_figure` draws from, and where the figure goes."""

    views: list[MapView]
    title: str
    scale: str
    size: float | None
    dpi: int
    legend: str
    path: Path
    into: Path | None = None  # the temporary file the worker fills (the run moves it)


class FigureWorker:
    """The forked worker, from the run's side: `draw` once, or `close` unused."""

    def __init__(self, pid: int, to_worker: int, from_worker: int) -> None:
        self.pid, self.to_worker, self.from_worker = pid, to_worker, from_worker
        self.open = True

    @classmethod
    def start(cls) -> FigureWorker | None:
        """A worker, where forking is safe: Linux, and torch not imported yet (its thread pools
        do not survive a fork; a command run in a process that imported it, as the tests' CLI
        runner, draws in-process). ATTNVIZ_FIGURE_WORKER=0 turns it off."""
        if sys.platform != "linux" or "torch" in sys.modules or \
                os.environ.get("ATTNVIZ_FIGURE_WORKER") == "0":
            return None
        from attnviz.cli.supervisor import die_with_parent  # looked up now: the tests patch it

        job_read, job_write = os.pipe()
        answer_read, answer_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the command
            code = 1
            try:
                os.close(job_write)
                os.close(answer_read)
                if die_with_parent(parent, signal.SIGKILL):
                    _serve(job_read, answer_write)
                    code = 0
            finally:
                os._exit(code)
        os.close(job_read)
        os.close(answer_write)
        return cls(pid, job_write, answer_read)

    def draw(self, job: FigureJob) -> bool:
        """Whether the worker drew the figure and it was written; False (nothing written) when
        it could not, and the caller draws it itself.

        The worker only fills a temporary file this process made (`atomic_output`); this
        process moves it into place once the worker has answered and been reaped. So the
        output's name is given only here, under this process's signal handling: a SIGINT,
        SIGTERM or SIGHUP at any moment stops the worker (SIGKILL, reaped) before the
        temporary file goes, and no signal between the worker's write and the move can leave
        the output behind this process's back."""
        from attnviz.app.outputs import atomic_output

        if not self.open:
            return False
        try:
            with atomic_output(job.path) as tmp:
                self.open = False
                try:
                    answer = self._exchange(replace(job, into=tmp))
                finally:  # an interruption included: the worker stops before `tmp` goes
                    self._stop()
                if answer != b"ok":
                    raise _NotDrawn
        except _NotDrawn:  # the worker is gone (killed, out of memory) or failed
            return False
        finally:  # no temporary file could be made: the worker, never sent a job, stops too
            self.close()
        return True

    def _exchange(self, job: FigureJob) -> bytes:
        """Send the job and read the worker's answer (empty if it died)."""
        try:
            with os.fdopen(self.to_worker, "wb") as pipe:  # closing it ends the job
                pipe.write(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
            with os.fdopen(self.from_worker, "rb") as pipe:
                return pipe.read()
        except OSError:
            return b""

    def _stop(self) -> None:
        """The worker killed if it still runs (it has answered or must write nothing more), and
        reaped: once this returns, no process of ours can touch the output."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        _reap(self.pid)

    def close(self) -> None:
        """An unused worker is stopped at once (it has written nothing; it may still be
        importing, and the run's error should not wait for that)."""
        if self.open:
            self.open = False
            for fd in (self.to_worker, self.from_worker):
                os.close(fd)
            self._stop()


class _NotDrawn(Exception):
    """The worker did not draw the figure; its temporary file is removed."""


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _serve(job_read: int, answer_write: int) -> None:
    """The worker: import the figure machinery at once, then draw the one job, if any, into
    the temporary file the run made."""
    # Ctrl-C and the supervisor's signals are the run's to handle: the run stops the worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from attnviz.render.figure_io import isolated_rc, new_figure

    with isolated_rc():  # the Agg canvas and its fonts, loaded before the job arrives
        warm = new_figure(1.0, 1.0)
        warm.text(0.5, 0.5, "attnviz")
        warm.canvas.draw()
    with os.fdopen(job_read, "rb") as pipe:
        data = pipe.read()
    if not data:  # the run ended without a figure
        return
    job: FigureJob = pickle.loads(data)  # noqa: S301 - our own parent's bytes, over a pipe
    answer = b"failed"
    try:
        _save(_draw(job), job)
        answer = b"ok"
    finally:
        with os.fdopen(answer_write, "wb") as pipe:
            pipe.write(answer)


def _draw(job: FigureJob) -> Figure:
    from attnviz.render.figure import heatmap_figure

    return heatmap_figure(job.views, job.title, job.scale, job.size, job.dpi, job.legend)


def _save(figure: Figure, job: FigureJob) -> None:
    """Into the run's temporary file, in the format of the output's suffix."""
    from attnviz.render.figure_io import save_figure

    assert job.into is not None  # set by FigureWorker.draw
    save_figure(figure, job.into, named=job.path)
