"""A death by signal inside third-party code (a Rust allocator abort, a segfault) ends as one
`error:` line and exit 1: the console entry point runs the command in a supervised child.

Each case runs a fresh interpreter; each has a negative control (the same death without the
supervisor is not one line) so the check can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import doubling_normalizer, finish, model_with_normalizer, side_by_side

ROOT = Path(__file__).resolve().parents[1]


def python(script: str, env: dict[str, str] | None = None, cap: int | None = None,
           timeout: int = 300) -> subprocess.CompletedProcess:
    return finish(start(script, env, cap), timeout)


def start(script: str, env: dict[str, str] | None = None,
          cap: int | None = None) -> subprocess.Popen:
    """`python -c SCRIPT` started, under an address-space cap of `cap` bytes if given."""
    import resource

    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    full = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", **(env or {})}
    full.pop("ATTNVIZ_NO_SUPERVISOR", None)
    full.update(env or {})
    return subprocess.Popen([sys.executable, "-c", script], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)


DIES = """
import os, signal, sys
from attnviz.cli.supervisor import supervised
from attnviz.core import crash_note
def work():
    with crash_note.doing("reading the weights", "check the file", "/m/w.bin"):
        sys.stderr.flush()
        os.kill(os.getpid(), signal.{sig})
supervised(work)
"""


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGABRT", "SIGBUS", "SIGKILL"])
def test_a_death_by_signal_is_one_line_naming_the_step(sig):
    done = python(DIES.format(sig=sig))
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: reading the weights: the process ")
    assert sig in lines[0] and "(/m/w.bin) — check the file" in lines[0]
    # negative control: the same death without the supervisor is a death by signal
    bare = python(DIES.format(sig=sig), env={"ATTNVIZ_NO_SUPERVISOR": "1"})
    assert bare.returncode == -getattr(signal, sig)


def test_exit_codes_and_output_pass_through():
    done = python("import sys\nfrom attnviz.cli.supervisor import supervised\n"
                  "supervised(lambda: (print('out'), print('err', file=sys.stderr), "
                  "sys.exit(3)))")
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n")


LEAVES = """
import atexit, sys, threading, time
from pathlib import Path
from attnviz.cli.supervisor import supervised
out = Path(sys.argv[1])
def work():
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()
    sys.stdout.write("x" * 200_000)  # more than a pipe holds: flushed before the exit
    sys.exit({status})
supervised(work)
"""


@pytest.mark.parametrize("status", ["0", "4", "'a message as the status'"])
def test_the_child_leaves_fast_but_completely(tmp_path, status):
    """The supervised child skips the interpreter's teardown after its work: its exit handlers
    still run, a thread still running is waited for, its output is all written and its status
    is the process's; a message as the status takes Python's own way out (printed, exit 1)."""
    script = LEAVES.format(status=status)
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    full.pop("ATTNVIZ_NO_SUPERVISOR", None)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=full,
                          capture_output=True, timeout=120)
    expected = {"0": 0, "4": 4}.get(status, 1)
    assert done.returncode == expected, done.stderr
    assert done.stdout == b"x" * 200_000
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
    if expected == 1:
        assert done.stderr.decode().strip() == "a message as the status"


def test_a_signal_sent_to_the_parent_reaches_the_child(tmp_path):
    """`kill PID` / `timeout` signal the process they started: the child gets it and the
    parent ends the way an unsupervised process would (killed by SIGTERM), saying nothing."""
    marker = tmp_path / "child"
    script = (f"import os, time\nfrom attnviz.cli.supervisor import supervised\n"
              f"def work():\n    open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
              f"    time.sleep(60)\nsupervised(work)")
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    full.pop("ATTNVIZ_NO_SUPERVISOR", None)
    proc = subprocess.Popen([sys.executable, "-c", script], env=full, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(marker.read_text())
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and err == b""
    with pytest.raises(ProcessLookupError):  # the child is gone too
        for _ in range(100):
            os.kill(child, 0)
            time.sleep(0.05)


def test_closed_stderr_still_exits_1():
    script = ("import os, signal\nos.close(2)\nfrom attnviz.cli.supervisor import supervised\n"
              "supervised(lambda: os.kill(os.getpid(), signal.SIGSEGV))")
    assert python(script).returncode == 1


def test_help_runs_supervised():
    script = ("import sys\nsys.argv = ['attnviz', '--help']\n"
              "from attnviz.cli.main import main\nmain()")
    done = python(script)
    assert done.returncode == 0 and b"Usage" in done.stdout


# --- a real Rust abort inside the tokenizer -------------------------------------------------

# The static bound (tokenizer_bound) refuses this tokenizer.json before Rust sees the text; it
# is lifted here, as if the file used an amplifier the bound does not know, so that the Rust
# library really runs out of memory (under a 1.5 GB address-space cap, ~0.8 GB of it taken by
# the interpreter, torch and transformers; the lower the cap, the sooner the abort: 16 s alone
# at 2 GB, 11 s at 1.5 GB) and aborts.
ABORT_CAP = 3 << 29
ABORTS = """
import sys
import attnviz.sources.hf.tokenizer_bound as bound
bound.MAX_NORMALIZED_CHARS = 10**15
sys.argv = ['attnviz', 'heatmap', '--model', {folder!r}, '--json', 'a cat']
from attnviz.cli.main import main
main()
"""


@pytest.mark.hf
@pytest.mark.slow
def test_a_rust_abort_in_the_tokenizer_is_one_error_line(minilm, tmp_path):
    folder = model_with_normalizer(minilm, tmp_path / "hostile", doubling_normalizer(),
                                   keep_own=False)
    # the run and its negative control (without the supervisor) side by side
    done, bare = side_by_side(
        start(ABORTS.format(folder=str(folder)), cap=ABORT_CAP),
        start(ABORTS.format(folder=str(folder)), cap=ABORT_CAP,
              env={"ATTNVIZ_NO_SUPERVISOR": "1"}), timeout=300)
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: the model's tokenizer failed on sentence 1: the process "
                               "died of SIGABRT inside third-party code"), lines[0]
    assert "memory allocation of" in lines[0] and str(folder) in lines[0]
    assert lines[0].endswith("check or replace its tokenizer files")
    assert done.stdout == b""
    # negative control: without the supervisor the same run dies of the signal, and what
    # reaches stderr is faulthandler's report, not one line
    assert bare.returncode == -signal.SIGABRT
    assert len(bare.stderr.decode().splitlines()) > 1
