"""One request, one source interface: the CLI and the API build the same frozen HeatmapRequest,
a source is picked from one table by the request's source kind, and a figure costs no extra
forward pass of a Hugging Face model."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import assert_clean_error, count_calls

from attnviz.core.request import (
    SOURCE_KINDS,
    HeatmapRequest,
    Inputs,
    Limits,
    RandomSpec,
    SourceSpec,
)

DISTILBERT = "sample_weights/models/distilbert-tiny-model"  # 2 layers × 4 heads


def test_build_routes_each_keyword_to_its_group():
    request = HeatmapRequest.build(sentences=("a b",), random=RandomSpec(16, 2), head=1,
                                   max_tokens=9, memory_budget=2**20, ablate="zero")
    assert request == HeatmapRequest(
        Inputs(("a b",)), SourceSpec(random=RandomSpec(16, 2)),
        dataclasses.replace(HeatmapRequest().selection, head=1),
        dataclasses.replace(HeatmapRequest().measure, ablate="zero"),
        limits=Limits(max_tokens=9, memory_budget=2**20))
    assert request.source.kind == "random" and request.selection.one_per_layer
    with pytest.raises(TypeError, match="no field 'max_token'"):
        HeatmapRequest.build(max_token=9)


def test_the_request_is_frozen_all_the_way_down():
    request = HeatmapRequest.build(sentences=("a",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.limits.max_tokens = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.source = SourceSpec()  # type: ignore[misc]


@pytest.mark.parametrize("given, kind", [
    ({}, "bundled"), ({"weights": "x.safetensors"}, "weights"),
    ({"random": RandomSpec()}, "random"), ({"model": "folder"}, "model")])
def test_every_source_kind_has_one_source_in_the_table(given, kind):
    from attnviz.app.source_table import SOURCES

    assert sorted(SOURCES) == sorted(SOURCE_KINDS)
    assert SourceSpec(**given).kind == kind
    source = SOURCES[kind]
    assert callable(source.check) and callable(source.run)


@pytest.fixture
def captured(monkeypatch):
    """The request run_heatmap receives (the run itself is stopped)."""
    from attnviz.app import heatmap

    seen: list[HeatmapRequest] = []

    def stop(request, progress=None):
        seen.append(request)
        raise SystemExit(0)

    # the API binds the use case when it is first imported: imported before the patch (so it
    # binds the real one) and patched too, then restored, so a later test's API call runs
    from attnviz import api

    monkeypatch.setattr(heatmap, "run_heatmap", stop)
    monkeypatch.setattr(api, "_run_heatmap", stop)
    return seen


def test_the_cli_and_the_api_build_the_same_request(cli, captured):
    import attnviz

    cli("heatmap", "--random", "-H", "4", "--spec", "seed=3", "--layer", "0", "--head", "1",
        "--query", "b", "--budget", "tokens=20", "a b c", "d e")
    with pytest.raises(SystemExit):
        attnviz.run_heatmap(["a b c", "d e"], random=True, num_heads=4, seed=3, layer=0,
                            head=1, query="b", max_tokens=20)
    from_cli, from_api = captured
    for group in ("inputs", "source", "selection", "measure"):
        assert getattr(from_cli, group) == getattr(from_api, group), group
    assert from_cli.limits.max_tokens == from_api.limits.max_tokens == 20
    # negative control: a different option gives a different request
    cli("heatmap", "--random", "-H", "2", "a b c", "d e")
    assert captured[-1].source != from_api.source


def test_the_memory_budget_is_parsed_once_into_the_request(cli, captured):
    cli("heatmap", "--random", "--budget", "memory=2MB", "a b")
    assert captured[0].limits.memory_budget == 2 * 2**20


# --- a figure costs no probe forward ------------------------------------------------------------

@pytest.fixture
def probes(monkeypatch):
    """Every 1-token probe forward of a Hugging Face model, counted."""
    pytest.importorskip("transformers")
    from attnviz.sources.hf import layers

    return count_calls(monkeypatch, layers, "probe")


@pytest.mark.hf
def test_a_figure_needs_no_probe_forward(cli, probes, tmp_path):
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--model", DISTILBERT, "the cat sat", "--out", out)
    assert result.exit_code == 0, result.output
    assert out.exists() and probes == []
    # negative control: a layer form only the probe can resolve (-1) does run it
    assert cli("heatmap", "--model", DISTILBERT, "the cat sat", "--layer", "-1",
               "--out", tmp_path / "last.png").exit_code == 0
    assert probes == [1]


@pytest.mark.hf
def test_panels_the_config_does_not_count_are_counted_on_the_run(cli, monkeypatch, tmp_path):
    """Where config.json does not say how many layers run, the run's own layers are counted,
    and a figure over the limit is refused before anything is written."""
    from attnviz.sources.hf import layers

    monkeypatch.setattr(layers, "expected_shown", lambda *args: None)
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--model", DISTILBERT, "the cat sat", "--out", out,
                 "--budget", "panels=5")  # 1 sentence × 2 layers × 4 heads = 8
    assert_clean_error(result, 2, "8 panels, more than --budget panels 5")
    assert not out.exists()
    assert cli("heatmap", "--model", DISTILBERT, "the cat sat", "--out", out,
               "--budget", "panels=8").exit_code == 0  # control: within the limit it draws


# --- one rule for options: the table is checked on the request, whoever built it ----------

@pytest.mark.parametrize("given, named", [
    ({"sentence": 2}, "sentence"), ({"head": 0, "average": True}, "average"),
    ({"targets": ("x",)}, "target"), ({"causal": True}, "causal"),
    ({"random": RandomSpec(16, 2), "head_dim": 4}, "head_dim")])
def test_the_option_table_refuses_a_request_built_by_hand(given, named):
    """A request built field by field (neither the CLI nor the API) meets the same table: the
    use case refuses it before any source is opened, naming the option."""
    from attnviz.app.heatmap import run_heatmap
    from attnviz.core.request import HeadHints
    from attnviz.errors import UsageError

    if "head_dim" in given:  # the hints are one field of the request
        given = {"random": given["random"], "hints": HeadHints(head_dim=given["head_dim"])}
    with pytest.raises(UsageError) as caught:
        run_heatmap(HeatmapRequest.build(sentences=("a b a", "c d"), **given))
    assert caught.value.option == named or f"\u2039{named}\u203a" in caught.value.what


def test_given_fields_are_the_options_set():
    """What the table reads: fields away from their defaults, named as the options are."""
    from attnviz.core.option_rules import given_fields
    from attnviz.core.request import HeadHints

    assert given_fields(HeatmapRequest.build(sentences=("a",))) == {"sentences"}
    request = HeatmapRequest.build(sentences=("a",), targets=("b",), hints=HeadHints(2),
                                   sentence=2, query="a")
    assert given_fields(request) == {"sentences", "target", "num_heads", "sentence", "query"}


def test_layer_options_build_the_random_layer_and_the_hints_in_one_place():
    """-H sizes a random layer and is a hint for a checkpoint's; the random layer's own sizes
    without it are one usage error naming each (split's seed, which also draws its proof batch,
    is not)."""
    from attnviz.core.request import HeadHints, LayerOptions, RandomSpec
    from attnviz.errors import UsageError

    assert LayerOptions(num_heads=4, num_kv_heads=2).build(False, "x", "y") == (
        None, HeadHints(4, 2, None))
    assert LayerOptions(embed_dim=32, num_heads=4, num_kv_heads=2, seed=3).build(
        True, "x", "y") == (RandomSpec(32, 4, seed=3), HeadHints(None, 2, None))
    with pytest.raises(UsageError) as refused:
        LayerOptions(kdim=8, seed=3).build(False, "a random layer only", "drop {them}")
    assert str(refused.value) == "kdim, seed apply to a random layer only"
    assert refused.value.fix == "drop them"
    # control: split's seed is taken by a checkpoint, its sizes are not
    assert LayerOptions(seed=3).build(False, "x", "y", seed_is_random=False)[0] is None
    with pytest.raises(UsageError, match="embed_dim applies"):
        LayerOptions(embed_dim=8, seed=3).build(False, "x", "drop {them}", seed_is_random=False)


def test_api_circuits_refuses_a_seed_without_a_random_layer():
    """It used to be ignored (the CLI's circuits refused it): the API now builds the layer as
    the CLI does; the control: with random=True the seed changes the layer."""
    import attnviz
    from attnviz.errors import UsageError

    with pytest.raises(UsageError, match="seed applies to a random layer only"):
        attnviz.circuits(seed=3)
    a = attnviz.circuits(random=True, seed=3, embed_dim=8, num_heads=2, composition=False)
    b = attnviz.circuits(random=True, embed_dim=8, num_heads=2, composition=False)
    assert a.to_json() != b.to_json()


@pytest.mark.parametrize("source", [[], ["--random"],
                                    ["--weights", "sample_weights/bert-tiny", "--layer", "0"]])
def test_the_panel_limit_is_checked_once_per_run(cli, monkeypatch, tmp_path, source):
    """Known from the headers before the run, the panel count is not counted again after it
    (it was, twice or three times); the control: the one check still refuses a figure past
    the limit."""
    from attnviz.app import heatmap

    calls = count_calls(monkeypatch, heatmap, "check_panels")
    out = tmp_path / "f.png"
    assert cli("heatmap", *source, "a b c", "--out", out, "--no-stats").exit_code == 0
    assert len(calls) == 1
    assert_clean_error(cli("heatmap", *source, "a b c", "--out", out, "--budget", "panels=1"), 2,
                       "more than --budget panels 1")
