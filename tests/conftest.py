"""Fixtures and pytest hooks of the test suite, nothing else: plain helpers and constants live
in tests/helpers.py (`from helpers import …`), the tiny models in tests/zoo.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnviz.cli.main import app

# pytest rewrites the asserts of every test module at import and caches the result in
# __pycache__, as it caches everything else in .pytest_cache, unless bytecode writing is off.
# With PYTHONDONTWRITEBYTECODE=1 (set on these machines) every collection re-parses and
# rewrites ~50 test modules: 7 s instead of 4. The cache is pytest's own (named
# *-pytest-*.pyc) and only covers test modules, which are imported after this line.
sys.dont_write_bytecode = False

# helpers' asserts (assert_clean_error, …) report their values as a test module's do
pytest.register_assert_rewrite("helpers")
from helpers import minilm_folder  # noqa: E402


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_folder()


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory):
    """zoo_model(kind) -> folder: a tiny model of tests/zoo.py, each kind built once per session
    and shared by every test module that asks for it."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from zoo import zoo_factory

    return zoo_factory(tmp_path_factory)


@pytest.fixture(scope="session")
def zoo_lm(tmp_path_factory):
    """zoo_lm(kind) -> folder: kind's model of tests/zoo.py WITH its language-model head
    (zoo.LM_HEADS), each built once per session."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from zoo import lm_factory

    return lm_factory(tmp_path_factory)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: two torch threads spin more than they compute on a shared 2-core machine
    (a module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str, **kwargs):
        return runner.invoke(app, [str(a) for a in args], **kwargs)

    return invoke


def pytest_sessionfinish(session, exitstatus):
    """Hand what the zoo tests established to scripts/support_table.py, when it asks."""
    from support_record import write

    write()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The quick loop (`-m "not slow"`, docs/development.md) leaves out every test that runs a
    transformers model (marked hf): each builds, loads or runs one, seconds apiece here. The
    full loop (`python -m pytest -q`) runs them all."""
    for item in items:
        if item.get_closest_marker("hf") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


# The hostile-input tests' capped run (every header-sized case in one interpreter under an
# address-space cap, seconds): a session fixture here, so their modules share one run.
from hostile import capped  # noqa: E402, F401
