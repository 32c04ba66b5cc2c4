"""The error model: neutral facts with keyword-only fix/where/option, one line, one exit code
per kind of mistake."""

from __future__ import annotations

import pytest

from attnviz.errors import AttnvizError, CheckpointError, ExitCode, UsageError


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        UsageError("what", "a positional fix")  # type: ignore[misc]
    error = UsageError("head 9 is out of range", fix="choose 0..7", option="--head")
    assert (error.what, error.fix, error.option, error.where) == (
        "head 9 is out of range", "choose 0..7", "--head", "")


@pytest.mark.parametrize("kwargs, line", [
    ({}, "it broke"),
    ({"fix": "do this"}, "it broke — do this"),
    ({"where": "a/b.safetensors"}, "it broke (a/b.safetensors)"),
    ({"option": "--layer", "where": "ckpt", "fix": "x"}, "it broke (--layer; ckpt) — x"),
])
def test_one_line(kwargs, line):
    assert AttnvizError("it broke", **kwargs).one_line() == line


def test_one_line_folds_newlines_from_files():
    assert "\n" not in CheckpointError("bad\nname", where="dir\n/x").one_line()


def test_exit_codes():
    assert UsageError("x").exit_code == ExitCode.USAGE == 2
    assert CheckpointError("x").exit_code == ExitCode.DATA == 1
