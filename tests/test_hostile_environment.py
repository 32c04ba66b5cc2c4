"""Every environment gets an answer: closed standard streams, a C locale without UTF-8, an
unusable COLUMNS, non-UTF-8 arguments and paths, long legal file names, huge numbers in names.

The stream and locale cases run the real command in a fresh interpreter (in-process runners
replace the streams); each has a control run in the ordinary environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error, finish, side_by_side

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str | bytes | Path], env: dict[str, str] | None = None,
        clean_env: bool = False, **kwargs) -> subprocess.CompletedProcess:
    return finish(start(args, env, clean_env, **kwargs), timeout=120)


def start(args: list[str | bytes | Path], env: dict[str, str] | None = None,
          clean_env: bool = False, **kwargs) -> subprocess.Popen:
    """`python -m attnviz ARGS` started (`run` waits for it; `side_by_side` for several)."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")} if clean_env else dict(os.environ)
    full_env = {**base, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", **(env or {})}
    argv = [os.fsencode(sys.executable), b"-m", b"attnviz",
            *(a if isinstance(a, bytes) else os.fsencode(str(a)) for a in args)]
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(argv, env=full_env, cwd=ROOT, **kwargs)


def _closed(fd: int) -> dict:
    """Popen arguments that start the child with file descriptor `fd` closed."""
    def close() -> None:
        os.close(fd)
    return {"preexec_fn": close}


SPLIT = ["split", "-E", "8", "-H", "2"]


@pytest.mark.slow
def test_closed_stdout_writes_the_file_and_says_so(tmp_path):
    png = tmp_path / "s.png"
    done, control = side_by_side(  # the negative control: stdout open
        start([*SPLIT, "--png", png], stdout=None, **_closed(1)),
        start([*SPLIT, "--png", tmp_path / "c.png"]), timeout=120)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert lines == ["error: cannot write to stdout: it is closed — files the command writes "
                     "were written; run it with stdout open to see the rest"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert control.returncode == 0 and control.stderr == b"" and b"proof" in control.stdout


@pytest.mark.slow
def test_closed_stderr_keeps_exit_codes_and_files_clean(tmp_path):
    png, good_png = tmp_path / "s.png", tmp_path / "good.png"
    ok, bad, good = side_by_side(
        start(SPLIT, stderr=None, **_closed(2)),
        start([*SPLIT, "-H", "3", "--png", png], stderr=None, **_closed(2)),
        start([*SPLIT, "--png", good_png], stderr=None, **_closed(2)), timeout=120)
    assert ok.returncode == 0 and b"proof" in ok.stdout
    assert bad.returncode == 2 and not png.exists()  # the error line went nowhere, not into a file
    assert good.returncode == 0 and good_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_closed_stdin_reads_as_empty():
    done = run(["heatmap", "--random", "-f", "-"], stdin=None, **_closed(0))
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().strip().splitlines() == [
        "error: no sentence given — pass one or more sentences, or --file FILE"]


C_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}


@pytest.mark.slow
def test_c_locale_draws_in_ascii_with_a_note():
    done, utf8 = side_by_side(
        start(SPLIT, env=C_LOCALE, clean_env=True),
        start(SPLIT, env={**C_LOCALE, "LC_ALL": "C.UTF-8"}, clean_env=True), timeout=120)
    assert done.returncode == 0, done.stderr
    notes = done.stderr.decode().strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("note: stdout's encoding")
    text = done.stdout.decode("ascii")  # strictly ASCII
    assert "ok equal to float32 round-off" in text and "max |d output|" in text
    assert utf8.returncode == 0 and utf8.stderr == b""
    assert "✓ equal to float32 round-off" in utf8.stdout.decode()


@pytest.mark.slow
def test_explicit_ascii_request_is_still_refused():
    """Negative control: PYTHONIOENCODING=ascii is a request, not the locale: refused as before."""
    done = run(SPLIT, env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 2
    assert "stdout's encoding ascii cannot show" in done.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("command", [["inspect", "{mha}"], ["heatmap", "--random", "a b c"]])
def test_unusable_columns_fall_back_to_80(tmp_path, command):
    """COLUMNS of 0, 1 and 10⁸ each get one note and an 80-column terminal; the control,
    COLUMNS=80, gets no note (all four runs side by side)."""
    from safetensors.torch import save_file

    mha = tmp_path / "mha.safetensors"
    save_file({k: v.contiguous() for k, v in torch.nn.MultiheadAttention(8, 2).state_dict()
               .items()}, mha)
    args = [str(mha) if a == "{mha}" else a for a in command]
    unusable = ["0", "1", "100000000"]
    *runs, control = side_by_side(*(start(args, env={"COLUMNS": columns})
                                    for columns in [*unusable, "80"]), timeout=120)
    for columns, done in zip(unusable, runs, strict=True):
        assert done.returncode == 0, done.stderr
        assert done.stderr.decode().startswith(f"note: COLUMNS={columns} is not a usable")
        assert max(len(line) for line in done.stdout.decode().splitlines()) <= 80
    assert control.returncode == 0 and control.stderr == b""


@pytest.mark.slow
def test_non_utf8_path_works(tmp_path):
    from safetensors.torch import save_file

    folder = os.fsencode(tmp_path)
    path = folder + b"/caf\xe9.safetensors"
    save_file({k: v.contiguous() for k, v in torch.nn.MultiheadAttention(8, 2).state_dict()
               .items()}, os.fsdecode(path))
    png = folder + b"/\xe9t\xe9.png"
    done = run(["split", "--weights", path, "-H", "2", "--png", png])
    assert done.returncode == 0, done.stderr
    assert os.path.getsize(png) > 1000
    shown = done.stdout.decode("utf-8")  # the name is escaped, stdout stays valid UTF-8
    assert "proof" in shown


@pytest.mark.slow
def test_non_utf8_sentence_is_one_line_not_blamed_on_stdout(tmp_path):
    *runs, control = side_by_side(
        *(start(["heatmap", "--random", *extra, b"ok", b"caf\xe9 au lait"])
          for extra in ([], ["--json"])),
        start(["heatmap", "--random", "--json", "ok", "café au lait".encode()]), timeout=120)
    for done in runs:
        assert done.returncode == 2
        lines = done.stderr.decode().strip().splitlines()
        assert lines == ["error: sentence 2 is not UTF-8 text: byte 0xe9 at character 4 "
                         "(caf\\udce9 au lait) — pass UTF-8 text (convert it with iconv -f "
                         "latin1 -t utf-8)"], lines
        assert done.stdout == b""
    assert control.returncode == 0, control.stderr


def test_latin1_sentence_file_is_bad_data(cli, tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes("café\n".encode("latin-1"))
    assert_clean_error(cli("heatmap", "--random", "-f", path), 1, "not UTF-8 text")
    path.write_bytes("café\n".encode())
    assert cli("heatmap", "--random", "--json", "-f", path).exit_code == 0


@pytest.mark.parametrize("suffix", [".png", ".safetensors"])
def test_longest_legal_output_name(cli, tmp_path, suffix):
    """A 255-byte name is legal; the temporary file beside it must not pass the limit."""
    name = "n" * (255 - len(suffix)) + suffix
    path = tmp_path / name
    option = "--out" if suffix == ".png" else "--export"
    result = cli("heatmap", "--random", "the cat sat", option, path)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    too_long = tmp_path / ("n" * 256 + suffix)  # negative control: past the limit
    assert cli("heatmap", "--random", "the cat sat", option, too_long).exit_code in (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


LONG_OUTPUTS = {
    "split figure": (["split", "-E", "8", "-H", "2", "--out"], ".svg"),
    "circuits figure": (["circuits", "--random", "-E", "8", "-H", "2", "--out"], ".pdf"),
    "heatmap page": (["heatmap", "--random", "--spec", "E=8", "-H", "2", "a b", "--html"],
                     ".html"),
    "generated maps": (["generate", "--max-new-tokens", "2", "a b", "--out"], ".png"),
}


@pytest.mark.parametrize("kind", sorted(LONG_OUTPUTS))
def test_longest_legal_name_for_every_output_kind(cli, tmp_path, kind):
    args, suffix = LONG_OUTPUTS[kind]
    name = "é" * 100 + "n" * (255 - 200 - len(suffix)) + suffix  # 255 bytes, 2-byte letters
    result = cli(*args, tmp_path / name)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_the_ablation_figure_beside_a_longest_legal_name(cli, tmp_path):
    """ablate --out writes NAME.ablation.png beside NAME.png: its stem is shortened to fit."""
    name = "é" * 120 + "n" * 11 + ".png"
    assert len(name.encode()) == 255
    result = cli("ablate", "--out", tmp_path / name, "a b")
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and name in names
    other = next(n for n in names if n != name)
    assert other.endswith(".ablation.png") and len(other.encode()) <= 255
    short = tmp_path / "short"  # negative control: a short name keeps its whole stem
    short.mkdir()
    assert cli("ablate", "--out", short / "m.png", "a b").exit_code == 0
    assert sorted(p.name for p in short.iterdir()) == ["m.ablation.png", "m.png"]


def test_huge_layer_numbers_in_names(cli, tmp_path):
    from safetensors.torch import save_file

    digits = "9" * 5000
    state = {f"layers.{digits}.self_attn.{k}": v.contiguous()
             for k, v in torch.nn.MultiheadAttention(8, 2).state_dict().items()}
    path = tmp_path / "huge.safetensors"
    save_file(state, path)
    inspected = cli("inspect", path)
    assert inspected.exit_code == 0, inspected.output
    split = cli("split", "--weights", path, "-H", "2")
    assert split.exit_code == 0 and "✓ equal to float32 round-off" in split.stdout
    assert_clean_error(cli("split", "--weights", path, "-H", "2", "-l", digits), 2,
                       "is out of range")
