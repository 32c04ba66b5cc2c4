"""The Python API validates like the command line: types, sizes, ranges — never a silent default.

Named cases check the message (keyword names, never flags, the same words the CLI uses); a
property test drives the API with arbitrary values and asserts that every call ends in a
result, an AttnvizError or a TypeError — no other exception, and quickly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnviz
from attnviz.errors import AttnvizError, UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

BAD_TEXTS = [("cat", "sentences must be a list of strings, not str"),
             (b"cat", "not bytes"), ([b"cat"], "sentences[0] must be a str, not bytes"),
             (np.array(["cat"]), "not ndarray"), ([1, 2], "sentences[0] must be a str, not int"),
             (None, "not NoneType")]


@pytest.mark.parametrize("value,message", BAD_TEXTS, ids=[m for _, m in BAD_TEXTS])
def test_texts_must_be_a_list_of_strings(value, message):
    with pytest.raises(TypeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        attnviz.run_heatmap(value, random=True)


@pytest.mark.parametrize("call", ["heatmap", "split", "circuits"])
@pytest.mark.parametrize("field", ["embed_dim", "num_heads"])
@pytest.mark.parametrize("value", [0, -3])
def test_zero_or_negative_sizes_are_refused_not_defaulted(call, field, value):
    kwargs = {field: value}
    with pytest.raises(UsageError) as caught:
        if call == "heatmap":
            attnviz.run_heatmap(["the cat sat"], random=True, **kwargs)
        elif call == "circuits":
            attnviz.circuits(random=True, **kwargs)
        else:
            attnviz.split(**kwargs)
    text = caught.value.one_line()
    assert f"{field} must be a positive integer, got {value}" in text and "--" not in text


def test_api_message_equals_the_cli_message(cli):
    """Same words as the command line; only the option's name is shown differently."""
    result = cli("split", "--spec", "E=50", "-H", "6")
    with pytest.raises(UsageError) as caught:
        attnviz.split(embed_dim=50, num_heads=6)
    cli_line = result.stderr.strip().removeprefix("error: ")
    assert cli_line == caught.value.one_line(lambda name: "--" + name.replace("_", "-"))


def test_defaults_still_apply_when_not_given():
    """Negative control: None takes the default MHA(64, 8), and an explicit size is used."""
    assert attnviz.split().layer.num_heads == 8
    explicit = attnviz.split(embed_dim=12, num_heads=3)
    assert explicit.layer.num_heads == 3 and explicit.layer.embed_dim == 12


@pytest.mark.parametrize("kwargs,kind", [
    ({"head": 8}, UsageError), ({"head": -1}, UsageError), ({"sentence": 2}, UsageError),
    ({"sentence": 0}, UsageError), ({"max_tokens": 0}, UsageError),
    ({"max_sentences": 0}, UsageError), ({"head": 1.0}, TypeError), ({"head": True}, TypeError),
    ({"causal": "yes"}, TypeError), ({"seed": -1}, UsageError), ({"seed": 2**64}, UsageError),
    ({"layer": 5}, UsageError), ({"weights": b"x.pt"}, TypeError),
])
def test_out_of_range_and_wrong_types(kwargs, kind):
    with pytest.raises(kind):
        attnviz.run_heatmap(["the cat sat"], random=True, **kwargs)


@pytest.mark.parametrize("kwargs,kind", [
    ({"model": ["a" * 1000]}, TypeError), ({"weights": b"x.pt"}, TypeError),
    ({"layer": [1]}, TypeError), ({"device": 3}, TypeError), ({"seed": -1}, UsageError),
    ({"random": "yes"}, TypeError), ({"embed_dim": 8}, UsageError),
    ({"random": True, "embed_dim": 12, "num_heads": 5}, UsageError),
])
def test_circuits_validates_like_the_others(kwargs, kind):
    with pytest.raises(kind):
        attnviz.circuits(**kwargs)


def test_circuits_defaults_and_explicit_sizes():
    """Negative control: a valid random layer runs, with the sizes asked for."""
    result = attnviz.circuits(random=True, embed_dim=8, num_heads=2)
    assert result.to_json()["layers"][0]["num_heads"] == 2


def test_numpy_integers_are_integers():
    """A numpy integer is accepted as what it is, and gives what the int gives."""
    a = attnviz.run_heatmap(["the cat sat"], random=True, head=np.int64(2), num_heads=np.int32(4))
    b = attnviz.run_heatmap(["the cat sat"], random=True, head=2, num_heads=4)
    assert torch.equal(torch.as_tensor(a.views[0].values), torch.as_tensor(b.views[0].values))


_ints = st.one_of(st.none(), st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 16, 10**30, 2**63]),
                  st.floats(allow_nan=True), st.booleans(), st.text(max_size=3),
                  st.just(np.int64(2)))
_texts = st.one_of(st.lists(st.text(max_size=12), max_size=3), st.text(max_size=5),
                   st.binary(max_size=4), st.lists(st.one_of(st.integers(), st.binary()),
                                                   max_size=2), st.none())


@settings(max_examples=150, deadline=20_000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(sentences=_texts, embed_dim=_ints, num_heads=_ints, head=_ints, sentence=_ints,
       max_tokens=_ints, max_sentences=_ints, seed=_ints, layer=_ints, query=_ints,
       causal=st.one_of(st.booleans(), st.none(), st.integers(0, 1)))
def test_heatmap_api_property(sentences, embed_dim, num_heads, head, sentence, max_tokens,
                              max_sentences, seed, layer, query, causal):
    kwargs = dict(embed_dim=embed_dim, num_heads=num_heads, head=head, layer=layer,
                  query=query, causal=causal)
    for name, value in (("sentence", sentence), ("max_tokens", max_tokens),
                        ("max_sentences", max_sentences), ("seed", seed)):
        if value is not None:
            kwargs[name] = value
    try:
        result = attnviz.run_heatmap(sentences, random=True, **kwargs)
    except (AttnvizError, TypeError):
        return
    assert result.views and all(np.isfinite(np.asarray(v.values)).all() for v in result.views)


@settings(max_examples=80, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(embed_dim=_ints, num_heads=_ints, kdim=_ints, vdim=_ints, seed=_ints,
       bias=st.one_of(st.booleans(), st.integers(0, 1)))
def test_split_api_property(embed_dim, num_heads, kdim, vdim, seed, bias):
    kwargs = dict(embed_dim=embed_dim, num_heads=num_heads, kdim=kdim, vdim=vdim, bias=bias)
    if seed is not None:
        kwargs["seed"] = seed
    try:
        result = attnviz.split(**kwargs)
    except (AttnvizError, TypeError):
        return
    assert result.report.proof.passed


# --- one rule for options (#36): the API refuses what it would ignore, as the CLI does -----

@pytest.mark.parametrize("call, kwargs, message", [
    ("run_heatmap", {"sentence": 2}, "sentence picks the sentence query breaks down"),
    ("run_heatmap", {"head": 0, "average": True}, "head and average exclude each other"),
    ("run_heatmap", {"seed": 3}, "seed applies to a random layer only"),
    ("run_heatmap", {"causal": True}, "causal does not apply to the bundled model"),
    ("run_model", {"sample": True}, "sample apply to generate only"),
    ("run_model", {"temperature": 0.5}, "temperature apply to generate only"),
    ("run_model", {"seed": 3}, "seed applies to generate with sample only"),
    ("run_model", {"generate": 2, "seed": 3}, "seed seeds sampling, and sample is not given"),
    ("split", {"bias": False}, "bias=False applies to a random layer only"),
])
def test_api_refuses_options_it_would_ignore(call, kwargs, message):
    """Checked before any model or checkpoint is opened (the paths here do not exist)."""
    args = {"run_heatmap": (["a b a b", "c d"],), "run_model": ("no/such/model", ["a b"]),
            "split": ("no/such/weights.safetensors",)}[call]
    with pytest.raises(UsageError) as caught:
        getattr(attnviz, call)(*args, **kwargs)
    assert message in str(caught.value)
    assert "--" not in str(caught.value)  # keywords, never flags


def test_api_applies_the_same_options_where_they_belong():
    """Control: each option above runs where it applies, and changes the result."""
    both = ["a b a b", "c d"]
    one = attnviz.run_heatmap(both, query=0)
    two = attnviz.run_heatmap(both, query=0, sentence=2)
    assert one.breakdown is not None and two.breakdown is not None
    assert one.breakdown != two.breakdown
    a = attnviz.run_heatmap(both, random=True, seed=3)
    b = attnviz.run_heatmap(both, random=True)
    assert not np.array_equal(a.views[0].values, b.views[0].values)
    assert len(attnviz.run_heatmap(both, average=True).views) == 2 * 2  # sentences × layers
