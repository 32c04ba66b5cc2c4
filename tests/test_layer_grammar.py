"""The --layer grammar for models (attnviz.core.selection): single-stack and per stack."""

from __future__ import annotations

import pytest

from attnviz.core.selection import parse_layers, parse_stack_layers
from attnviz.errors import UsageError

SEQ2SEQ = {"enc": 3, "dec": 2, "cross": 2}


@pytest.mark.parametrize(("spec", "expected"), [
    (None, None), ("all", None), ("0", [0]), ("-1", [3]), ("1:3", [1, 2]), (":2", [0, 1]),
    ("2:", [2, 3])])
def test_single_stack(spec, expected):
    assert parse_layers(spec, 4) == expected
    pairs = parse_stack_layers(spec, {"": 4})
    assert pairs == (None if expected is None else [("", i) for i in expected])


@pytest.mark.parametrize(("spec", "expected"), [
    ("1", [("enc", 1)]),  # a bare number is the encoder's
    ("enc -1", [("enc", 2)]),
    ("dec 0:2", [("dec", 0), ("dec", 1)]),
    ("cross", [("cross", 0), ("cross", 1)]),
    ("cross all", [("cross", 0), ("cross", 1)]),
    ("cross -1,enc 0, dec 1", [("enc", 0), ("dec", 1), ("cross", 1)]),  # stack order
    ("enc 0,enc 0", [("enc", 0)]),
])
def test_per_stack(spec, expected):
    assert parse_stack_layers(spec, SEQ2SEQ) == expected


@pytest.mark.parametrize(("spec", "stacks", "message"), [
    ("dec 0", {"": 4}, "no 'dec' layers"),
    ("cross 0", {"enc": 3}, "no 'cross' layers"),
    ("middle 0", SEQ2SEQ, "unknown stack"),
    ("enc 5", SEQ2SEQ, "not a layer of this model"),
    ("enc 0 1", SEQ2SEQ, "not a layer selection"),
    ("dec 2:2", SEQ2SEQ, "selects no layer"),
    ("x", {"": 4}, "not a layer of this model"),
])
def test_errors(spec, stacks, message):
    with pytest.raises(UsageError, match=message) as info:
        parse_stack_layers(spec, stacks)
    assert info.value.option == "layer"
