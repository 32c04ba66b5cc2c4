"""The console entry point runs attnviz in a child process and waits for it, so that a death by
signal inside third-party code (a Rust allocator abort in a tokenizer, a segfault in a C
extension, the kernel's out-of-memory killer) still ends as one `error:` line and exit 1, never
a silent death or a multi-line crash report.

The child is a fork: nothing is imported twice and start-up costs about a millisecond. It
records what it is doing inside libraries (core/crash_note.py); when it dies of a signal, the
parent names that step, the signal and the library's last line on stderr. Signals sent to the
parent alone (`kill PID`, `timeout`) are passed on to the child; those the terminal sends to the
whole process group (Ctrl-C) reach the child directly. The child dies with the parent
(PR_SET_PDEATHSIG), so no orphan goes on writing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

from attnviz.core import crash_note
from attnviz.errors import ExitCode, one_line, printable, printable_path

# Signals the parent passes on to the child when someone sent them to the parent's pid.
_PASSED_ON = tuple(getattr(signal, name) for name in
                   ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                   if hasattr(signal, name))
# A child that dies of one of these was stopped by someone (the terminal, `kill`): the parent
# dies the same way, as an unsupervised process would, and says nothing more.
_STOPPING = {signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
             *(getattr(signal, n) for n in ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
               if hasattr(signal, n))}
_DISABLE = "ATTNVIZ_NO_SUPERVISOR"  # set (to anything) to run in one process, e.g. to debug


def supervised(work: Callable[[], object]) -> None:
    """Run `work` in a child process; exit with its status, or with one error line when it
    dies of a signal. Where fork is missing (Windows) or disabled, `work` runs here."""
    if not hasattr(os, "fork") or not hasattr(signal, "pthread_sigmask") \
            or os.environ.get(_DISABLE):
        work()
        return
    crash_note.share()
    watched = {*_PASSED_ON, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:  # no memory or process slots for a second process: run here
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        work()
        return
    if pid == 0:
        if not die_with_parent(parent, signal.SIGTERM):  # SIGTERM: its files' cleanup runs
            os._exit(128 + int(signal.SIGTERM))
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _run_and_leave(work)
        return
    status = _wait(pid, watched)
    _exit_like(status)


def _run_and_leave(work: Callable[[], object]) -> None:
    """The child runs `work` and, once it has exited with a status, leaves without the
    interpreter's teardown: with torch loaded, unloading every module and freeing every object
    costs 0.3–0.6 s that nothing needs (the parent only reads the status). Exit handlers still
    run (temporary folders, logging), other threads are waited for, and the standard streams are
    flushed first; anything unusual (an exception, a message as the status, a stream that cannot
    be flushed) takes Python's own way out."""
    import atexit
    import threading

    try:
        work()
        code = 0
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):
            raise
        code = done.code or 0
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        raise SystemExit(code) from None
    os._exit(code)


def die_with_parent(parent: int, sig: int) -> bool:
    """Ask Linux to send `sig` to this just-forked process when its parent dies
    (prctl(PR_SET_PDEATHSIG)), so that no orphan goes on working or writing. False if the
    parent, whose pid before the fork was `parent`, died before the request (it then never
    fires): the caller leaves at once. Where prctl is missing only the check is made."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    # compared with the parent's pid, not with 1: a subreaper (systemd --user, a container's
    # init, tini) adopts orphans under its own pid
    return os.getppid() == parent


_PR_SET_PDEATHSIG = 1


def _wait(pid: int, watched: set[int]) -> int:
    """Wait for the child, passing on the signals sent to this process by another one."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD and info.si_code <= 0:  # from kill(), not the tty
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, info.si_signo)


def _exit_like(status: int) -> None:
    """Leave with the child's exit code; after a death by signal, as described above."""
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else int(signal.SIGKILL)
    if sig in _STOPPING:
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    with contextlib.suppress(OSError):
        os.write(2, (death_message(sig) + "\n").encode("utf-8", "replace"))
    os._exit(int(ExitCode.DATA))


def _memory_flag() -> str:
    """The memory budget's flag in the command that ran (`--budget memory` in heatmap)."""
    from attnviz.cli.compound import command_of, spell_as
    from attnviz.cli.options import flag_of

    spell_as(command_of(sys.argv[1:]))
    return flag_of("memory_budget")


def death_message(sig: int) -> str:
    """One line for a child that died of `sig`: the step it was in, the library's last words."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    note = crash_note.read() or {}
    words = crash_note.last_words() if note else ""
    said = f"; the library's last words: {printable(words, 160)}" if words else ""
    if sig == signal.SIGKILL:
        cause = ("was killed (SIGKILL), most likely by the system for using too much memory"
                 f"{said}")
        fix = note.get("fix") or (f"lower {_memory_flag()}, or pass fewer or shorter "
                                  "sentences, fewer layers (--layer) or heads (--head)")
    else:
        cause = f"died of {name} inside third-party code{said}"
        fix = note.get("fix") or "rerun with --debug, and please report it"
    what = note.get("what") or "attnviz"
    where = note.get("where")
    place = f" ({printable_path(where)})" if where else ""
    return "error: " + one_line(f"{what}: the process {cause}{place} — {fix}")
