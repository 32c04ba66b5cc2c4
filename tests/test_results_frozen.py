"""A run's results are one thing each and never change after they are built (#32): AttentionRun
and LayerAttention are frozen (a change is a new object, `dataclasses.replace`), every layer has
the same core fields, its maps are full or streamed (exactly one), and no property of theirs
merely forwards an optional part's field (`None if self.call is None else self.call.name`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch

from attnviz.compute.forward_pass import results
from attnviz.compute.forward_pass.inputs import make_batch
from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention, StreamedMaps
from attnviz.core.choices import LayerKind
from attnviz.sources.bundled import open_bundled, run_tiny


@pytest.fixture(scope="module")
def tiny_run() -> AttentionRun:
    batch = make_batch(["the cat sat on the mat", "a dog ran"])
    return run_tiny(open_bundled(), batch, None, torch.device("cpu"))


def test_a_run_and_its_layers_are_frozen(tiny_run):
    layer = tiny_run.layers[0]
    for target, name, value in ((tiny_run, "notes", ("x",)), (tiny_run, "exported", None),
                                (tiny_run, "weighting", "norm"), (layer, "label", "9"),
                                (layer, "weights", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, value)
    # the collections are tuples: nothing to append to or assign into
    assert isinstance(tiny_run.layers, tuple) and isinstance(tiny_run.notes, tuple)
    with pytest.raises(TypeError):
        tiny_run.layers[0] = layer  # type: ignore[index]


def test_every_layer_has_the_core_fields(tiny_run):
    """A standalone layer's core: named by its checkpoint prefix, labelled by its number,
    self-attention, heads from its description (the maps' own count, independently)."""
    for captured in tiny_run.layers:
        assert captured.layer is not None and captured.weights is not None
        assert captured.name == captured.layer.name
        assert captured.label == str(captured.index) and captured.stack_label() is None
        assert captured.kind is LayerKind.SELF and f"{captured.kind}" == "self"
        assert captured.heads == captured.weights.shape[1]
        assert captured.causal is True and captured.call is None
    # a stacked label is carried; a number is not
    assert dataclasses.replace(tiny_run.layers[0], label="enc 0").stack_label() == "enc 0"


def test_maps_are_full_or_streamed_never_both_or_neither(tiny_run):
    layer = tiny_run.layers[0]
    kept = StreamedMaps([], [])
    streamed = dataclasses.replace(layer, weights=None, streamed=kept)  # the control: one kind
    assert streamed.streamed is kept and streamed.weights is None
    for weights, maps in ((layer.weights, kept), (None, None)):
        with pytest.raises(ValueError, match="exactly one"):
            dataclasses.replace(layer, weights=weights, streamed=maps)


def test_weighing_returns_a_new_run_and_leaves_the_old_one(tiny_run):
    """weigh_run used to rewrite the run in place; now the run it was given is unchanged."""
    from attnviz.app.weighting import NOTE, weigh_run

    before = [captured.weights.clone() for captured in tiny_run.layers]
    weighed = weigh_run(tiny_run)
    assert weighed is not tiny_run and weighed.weighting == "norm"
    assert weighed.notes == (*tiny_run.notes, NOTE)
    assert tiny_run.weighting == "attention" and NOTE not in tiny_run.notes
    for old, new, kept in zip(tiny_run.layers, weighed.layers, before, strict=True):
        assert torch.equal(old.weights, kept) and old.weighting is None
        assert new.weighting is not None and new.weighting.attention_weights is old.weights
        assert not torch.allclose(new.weights, old.weights)  # weighed: other maps


def forwarding_properties(source: str) -> list[str]:
    """Properties whose body only forwards an optional part's attribute: one return of
    `A if self.X is None else self.X.Y` (either way round, any A)."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not isinstance(node, ast.FunctionDef) or not any(
                    isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                continue
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and
                                                 isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Return) and \
                    _forwards(body[0].value):
                found.append(f"{cls.name}.{node.name}")
    return found


def _forwards(value: ast.expr | None) -> bool:
    if not isinstance(value, ast.IfExp) or not isinstance(value.test, ast.Compare):
        return False
    test = value.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Is | ast.IsNot) or \
            not (isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value
                 is None):
        return False
    part = ast.unparse(test.left)  # self.X
    return part.startswith("self.") and any(
        isinstance(branch, ast.Attribute) and ast.unparse(branch.value) == part
        for branch in (value.body, value.orelse))


def test_no_property_forwards_an_optional_part():
    assert forwarding_properties(inspect.getsource(results)) == []
    # and the classes have no properties at all besides what they hold
    for cls in (LayerAttention, AttentionRun):
        assert [n for n, v in vars(cls).items() if isinstance(v, property)] == []


def test_the_forwarding_scan_can_fail():
    """Negative control: the old LayerAttention's forwarding properties are found (both
    spellings), a computed property and a plain method are not."""
    source = '''
class LayerAttention:
    @property
    def name(self) -> str | None:
        return None if self.call is None else self.call.name

    @property
    def kind(self) -> str:
        """What kind."""
        return "self" if self.call is None else self.call.kind

    @property
    def views(self):
        return self.streamed.views if self.streamed is not None else None

    @property
    def heads(self) -> int:
        return 0 if self.weights is None else int(self.weights.shape[1])

    def rows_of(self, batch):
        return None if self.call is None else self.call.query_tokens
'''
    assert forwarding_properties(source) == ["LayerAttention.name", "LayerAttention.kind",
                                             "LayerAttention.views"]
