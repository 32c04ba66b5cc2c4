"""Helpers of the hostile-input tests (tests/test_hostile_*.py): what a terminal must never
receive, hand-written safetensors files, fresh interpreters under resource limits, and the
capped run of every header-sized case (`capped`, a session fixture, registered in conftest.py).

Every case of those modules asserts the exit code, the one-line message fragment that proves
the right check fired, no traceback, no control character in stdout or stderr, inputs unchanged
and no leftover files.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error

# Everything a terminal could interpret: C0 and C1 controls, ESC sequences (CSI, OSC), DEL,
# bidi overrides and isolates; and rich markup / emoji codes that must stay literal.
CONTROLS = ["\x1b[31m", "\x1b[2J", "\x1b]0;pwned\x07", "\x07", "\x00", "\x08", "\r", "\x7f",
            "\x9b31m", "\x85", "\x90", "\u202e", "\u202a", "\u2066", "\u2069", "\u200f",
            "\u2028", "\ufeff"]
MARKUP = ["[bold]", "[/]", "[red on white]", ":smile:", "$\\frac{", "[link=x]y[/link]"]

def assert_no_control(*texts: str) -> None:
    """No character a terminal interprets: only printable text and newlines."""
    for text in texts:
        bad = sorted({ch for ch in text if ch != "\n" and not ch.isprintable()})
        assert not bad, (bad, text[:400])


def assert_printed_clean(result, code: int = 0) -> None:
    assert result.exit_code == code, (result.exit_code, result.output[-2000:])
    assert "Traceback" not in result.output
    assert_no_control(result.stdout, result.stderr)


def assert_error(result, code: int, *fragments: str) -> None:
    assert_clean_error(result, code, *fragments)
    assert_no_control(result.stdout, result.stderr)


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` by name and content: inputs unchanged, nothing left over."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink() and p.exists()}


def st_bytes(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + data


def mha_state(embed: int = 8, heads: int = 2, prefix: str = "") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = torch.nn.MultiheadAttention(embed, heads).state_dict()
    return {prefix + k: v.contiguous() for k, v in state.items()}


def write_named(path: Path, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by hand, so names may hold anything JSON can (lone
    surrogates included, which the library's writer cannot encode)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    data, offset = b"", 0
    for name, tensor in tensors.items():
        raw = tensor.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    path.write_bytes(st_bytes(json.dumps(header).encode(), data))


ROOT = Path(__file__).resolve().parents[1]


def run_process(args: list[str], env: dict[str, str] | None = None, stdout=None,
                timeout: int = 120):
    """The real command in a fresh interpreter (real stdout, real environment)."""
    import os
    import subprocess
    import sys

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "attnviz", *map(str, args)], env=full_env,
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, cwd=ROOT)


def in_subprocess(script: str, limits: dict[str, int] | None = None, timeout: int = 120) -> dict:
    """Run `script` (which sets `out`, a JSON-able dict) in a fresh interpreter under resource
    limits (RLIMIT_AS: address space; RLIMIT_FSIZE: largest file), after torch is imported."""
    import subprocess
    import sys

    prelude = (
        "import json, resource, signal, sys\n"
        "import torch, safetensors.torch, matplotlib, numpy\n"
        "from typer.testing import CliRunner\n"
        "from attnviz.cli.main import app\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"for name, value in {limits or {}!r}.items():\n"
        "    resource.setrlimit(getattr(resource, name), (value, value))\n"
        "def cli(*args):\n"
        "    r = CliRunner().invoke(app, [str(a) for a in args])\n"
        "    return {'code': r.exit_code, 'stdout': r.stdout, 'stderr': r.stderr,\n"
        "            'exception': repr(r.exception) if r.exit_code not in (0, 1, 2) else ''}\n"
        "out = {}\n")
    done = "\nprint('RESULT' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", prelude + script + done], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("RESULT", 1)[1])


class Result:
    """A subprocess result shaped like click's, for assert_clean_error."""

    def __init__(self, doc: dict) -> None:
        self.exit_code = doc["code"]
        self.stdout, self.stderr = doc["stdout"], doc["stderr"]
        self.output = self.stdout + self.stderr


MEMORY_CAP = 1_600_000_000  # address space for torch + attnviz (~0.8 GB) and a little work


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # imported by every test_hostile_* module that builds tensors
    """Tiny tensors: on a shared machine torch's second thread spins more than it computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bundled_with(path: Path, **metadata: str) -> Path:
    """The bundled model, rewritten with some metadata values changed."""
    from helpers import BUNDLED
    from safetensors import safe_open

    with safe_open(str(BUNDLED), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        meta = {**f.metadata(), **metadata}
    write_named(path, tensors, meta)
    return path


@pytest.fixture(scope="session")
def capped(tmp_path_factory) -> tuple[Path, dict[str, dict], dict[str, str]]:
    """Hostile inputs that claim gigabytes, each run by the CLI in one fresh interpreter whose
    address space is capped at 1.6 GB, torch included: (folder, results, digest before)."""
    folder = tmp_path_factory.mktemp("capped")
    zero = folder / "zero.safetensors"  # a zero-sized axis: 3·10⁹ rows of nothing
    zero.write_bytes(st_bytes({
        "__metadata__": {"num_heads": "1000000000"},
        "in_proj_weight": {"dtype": "F32", "shape": [3_000_000_000, 0], "data_offsets": [0, 0]},
        "out_proj.weight": {"dtype": "F32", "shape": [0, 1_000_000_000],
                            "data_offsets": [0, 0]}}))
    assert zero.stat().st_size < 300
    layers = bundled_with(folder / "layers.safetensors", num_layers="100000000")
    vocab = bundled_with(folder / "vocab.safetensors", vocab_size="4000000000")
    stride = folder / "stride0.pt"  # 1.7 KB viewing 4 bytes as 40 GB
    torch.save({"in_proj_weight": torch.zeros(1).expand(100_000, 100_000),
                "out_proj.weight": torch.zeros(1).expand(100_000, 100_000)}, stride)
    assert stride.stat().st_size < 2000
    overlap = folder / "overlap.pt"
    base = torch.zeros(300_000)
    torch.save({"in_proj_weight": base.as_strided((200_000, 100_000), (1, 1)),
                "out_proj.weight": base[:4].view(2, 2)}, overlap)
    model_configs = {"n_layer": 100_000, "n_positions": 100_000_000, "vocab_size": 100_000_000,
                     "n_embd": 100_000}
    gpt2 = folder / "gpt2"
    from zoo import build

    build("gpt2", gpt2)
    for field, value in model_configs.items():
        import shutil

        shutil.copytree(gpt2, folder / field)
        config = json.loads((folder / field / "config.json").read_text())
        (folder / field / "config.json").write_text(json.dumps({**config, field: value}))
    before = digest(folder)
    cases = {
        **{f"config-{field}": ["heatmap", "--model", folder / field, "the cat"]
           for field in model_configs},
        "zero-inspect": ["inspect", zero], "zero-split": ["split", "--weights", zero],
        "zero-heatmap": ["heatmap", "--weights", zero, "a b"],
        "layers": ["heatmap", "--weights", layers, "a b"],
        "vocab": ["heatmap", "--weights", vocab, "a b"],
        "stride-inspect": ["inspect", stride],
        "stride-split": ["split", "--weights", stride, "-H", "2"],
        "overlap": ["inspect", overlap, "--scan", "-H", "2"],
        "dev-zero": ["heatmap", "--random", "-f", "/dev/zero"],
        "dev-zero-long-lines": ["heatmap", "--random", "-f", "/dev/zero", "--budget",
                                "tokens=1000000"],
    }
    script = "".join(f"out[{name!r}] = cli(*{[str(a) for a in args]!r})\n"
                     for name, args in cases.items())
    writes = folder / "writes"  # then, files may not grow past 2000 bytes
    writes.mkdir()
    script += (
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))\n"
        f"out['fsize-png'] = cli('heatmap', '--random', 'a b c', '--out', {str(writes)!r} + "
        "'/f.png')\n"
        "out['fsize-export'] = cli('heatmap', '--random', 'a b c d e f g h i j k l', "
        f"'--export', {str(writes)!r} + '/m.safetensors')\n")
    results = in_subprocess(script, limits={"RLIMIT_AS": MEMORY_CAP})
    return folder, results, before


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past any parser's recursion limit
