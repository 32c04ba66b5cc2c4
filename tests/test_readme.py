"""The README cannot drift: every `attnviz` example in it runs offline from a clone (sample
paths as written, the few placeholders mapped to shipped samples), and every marked output block
is the tool's real output (scripts/readme_examples.py; `--write` regenerates the blocks)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("readme_examples",
                                                  ROOT / "scripts" / "readme_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_readme_example_runs_and_shows_its_real_output():
    problems = _script().check()
    assert problems == [], "\n".join(problems)


def test_the_readme_check_can_fail(tmp_path, monkeypatch):
    """Negative control: a failing example and a drifted output block are both reported."""
    script = _script()
    readme = tmp_path / "README.md"
    readme.write_text("```bash\nattnviz split -E 10 -H 4\n```\n\n"
                      "<!-- output: attnviz split -E 8 -H 2 | lines 1-1 -->\n"
                      "```text\nnot it\n```\n")
    monkeypatch.setattr(script, "README", readme)
    problems = script.check()
    assert len(problems) == 2
    assert "exited 2" in problems[0] and "differs" in problems[1]
