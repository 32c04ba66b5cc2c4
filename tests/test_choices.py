"""Choices as `str` Enums (attnviz.core.choices): each option's values are one Enum, the CLI's
Typer options and the Python API accept exactly its values, and any other value is one usage
error naming the option and listing them, with the same text from both; one seed bound."""

from __future__ import annotations

import json
import types
import typing

import pytest
import typer
from helpers import assert_clean_error

import attnviz
from attnviz.cli.main import app
from attnviz.cli.options import flag_of
from attnviz.compute.display.scale import SCALES
from attnviz.compute.forward_pass.inputs import POSITION_SCHEMES
from attnviz.compute.measures.ablation_measures import MODES
from attnviz.compute.measures.overview import CHOICES, LABEL, OFF, STATISTICS
from attnviz.compute.measures.value_norms import WEIGHTINGS
from attnviz.core import choices
from attnviz.core.choices import (
    AblationMode,
    Choice,
    ColorScale,
    CorpusShows,
    Dtype,
    Erase,
    HeadReduce,
    LayerKind,
    LongExamples,
    OverviewShows,
    PatchDirection,
    PatchMetric,
    PatchSite,
    Positions,
    Probe,
    TokenMethod,
    Weighting,
)
from attnviz.core.probe import PROBES
from attnviz.core.request import MAX_SEED, GenerateSpec
from attnviz.errors import UsageError

# each flag of each command that takes a choice, and its Enum
CLI_CHOICES: dict[str, dict[str, type[Choice]]] = {
    "heatmap": {"--scale": ColorScale, "--weighting": Weighting, "--dtype": Dtype,
                "--overview": OverviewShows, "--probe": Probe},
    "generate": {"--scale": ColorScale, "--dtype": Dtype, "--overview": OverviewShows,
                 "--probe": Probe},
    "ablate": {"--mode": AblationMode, "--dtype": Dtype, "--overview": OverviewShows,
               "--probe": Probe},
}
# choices set inside a KEY=VALUE option (attnviz.cli.compound): --spec positions=…
SPEC_CHOICES = {"positions": Positions}
# each keyword of the Python API that takes a choice, and its Enum
API_CHOICES = {"run_heatmap": {"weighting": Weighting, "ablate": AblationMode},
               "run_model": {"weighting": Weighting, "ablate": AblationMode, "dtype": Dtype}}


def _enum_of(annotation: object) -> type[Choice] | None:
    """The Choice Enum an option's annotation names (`ColorScale`, `Probe | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, Choice):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        found = [_enum_of(arg) for arg in typing.get_args(annotation)]
        return next((enum for enum in found if enum is not None), None)
    return None


def _choice_params(command: str) -> dict[str, tuple[type[Choice], object]]:
    """flag → (its Enum, the option's parser), read from the Typer command itself."""
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    found = {}
    for param in group.commands[command].params:
        descriptor = getattr(param, "type_descriptor", None)
        enum = _enum_of(getattr(descriptor, "annotation", None))
        if enum is not None:
            found[param.opts[0]] = (enum, descriptor.parameter_info.parser)  # type: ignore
    return found


def test_every_choice_is_a_str_enum_printed_as_its_value():
    enums = [value for value in vars(choices).values()
             if isinstance(value, type) and issubclass(value, Choice) and value is not Choice]
    assert set(enums) == {ColorScale, Weighting, AblationMode, Positions, Dtype, OverviewShows,
                          Probe, PatchMetric, PatchDirection, PatchSite, HeadReduce,
                          TokenMethod, Erase, LongExamples, CorpusShows,
                          LayerKind}  # LayerKind: no option; a run's layers print it (--json)
    for enum in enums:
        for member in enum:
            assert isinstance(member, str) and member == member.value
            # f-strings, str() and JSON show the value (a bare str Enum's str() would be
            # 'ColorScale.MAX' in Python 3.11+): the control is the Enum's own repr
            assert f"{member}" == str(member) == member.value != repr(member)
            assert json.dumps({"k": member, member: 1}) == json.dumps({"k": member.value,
                                                                        member.value: 1})


def test_the_constants_below_are_the_enums():
    """The tuples modules below the CLI read are the Enums' values, not copies."""
    import attnviz.sources.hf.load as hf_load

    assert SCALES == ColorScale.values() == ("max", "fixed", "log")
    assert WEIGHTINGS == Weighting.values() == ("attention", "norm")
    assert MODES == AblationMode.values() == ("zero", "mean")
    assert POSITION_SCHEMES == Positions.values() == ("none", "sinusoidal")
    assert hf_load.DTYPES == Dtype.values() == ("float32", "bfloat16", "float16", "auto")
    assert PROBES == Probe.values() == ("induction",)
    assert CHOICES == OverviewShows.values()
    # attnviz corpus --overview: the type, or a statistic the heatmap overview shows
    assert set(CorpusShows.values()) == set(CHOICES) - {"ablation", "off"}
    assert set(CHOICES) == {LABEL, *STATISTICS, OFF}


@pytest.mark.parametrize("command", sorted(CLI_CHOICES))
def test_cli_options_take_exactly_the_enum(command):
    params = _choice_params(command)
    assert {flag: enum for flag, (enum, _) in params.items()} == CLI_CHOICES[command]
    for flag, (enum, parser) in params.items():
        assert callable(parser), flag  # Choice.parse, so the error is attnviz's own line
        for member in enum:
            assert parser(member.value) is member  # type: ignore[operator]
        with pytest.raises(UsageError) as refused:
            parser("no-such-" + flag.lstrip("-"))  # type: ignore[operator]
        assert refused.value.fix == f"use {', '.join(enum.values())}"


@pytest.mark.parametrize("command", sorted(CLI_CHOICES))
def test_help_lists_the_choices(cli, command):
    text = " ".join(cli(command, "--help", env={"COLUMNS": "200"}).stdout.split())
    for flag, enum in CLI_CHOICES[command].items():
        listed = "<" + "|".join(enum.values()) + ">"
        # --overview (15 values) and --dtype name them in their help text instead of a long
        # metavar broken across lines
        assert listed in text or all(value in text for value in enum.values()), flag


@pytest.mark.parametrize("function", sorted(API_CHOICES))
def test_api_keywords_take_exactly_the_enum(function):
    import inspect

    signature = inspect.signature(getattr(attnviz, function))
    for keyword, enum in API_CHOICES[function].items():
        assert keyword in signature.parameters
        for member in enum:
            assert enum.parse(member.value, keyword) is member


CASES = [("heatmap", "--scale", "sqrt", ("a b",)), ("heatmap", "--weighting", "value", ("a b",)),
         ("heatmap", "--dtype", "float64", ("a b",)),
         ("heatmap", "--overview", "sharpness", ("a b",)), ("heatmap", "--probe", "copying", ()),
         ("generate", "--scale", "sqrt", ("a b",)), ("ablate", "--mode", "half", ("a b",))]


@pytest.mark.parametrize("command, flag, value, rest", CASES)
def test_cli_refuses_an_unknown_value_in_one_line(cli, command, flag, value, rest):
    enum = CLI_CHOICES[command][flag]
    result = cli(command, flag, value, *rest)
    assert_clean_error(result, 2, f"error: unknown {flag} {value!r} ({flag}) — use "
                       f"{', '.join(enum.values())}")


@pytest.mark.parametrize("command", ["heatmap", "ablate"])
def test_spec_refuses_an_unknown_choice_in_one_line(cli, command):
    """A choice inside --spec is parsed by its Enum like any other (the same one line); the
    control: each of its values runs."""
    for key, enum in SPEC_CHOICES.items():
        result = cli(command, "--random", "--spec", f"{key}=rope", "a b")
        assert_clean_error(result, 2, f"error: unknown --spec {key} 'rope' (--spec {key}) — "
                           f"use {', '.join(enum.values())}")
        for value in enum.values():
            ran = cli(command, "--random", "--spec", f"{key}={value}", "a b", "--json")
            assert ran.exit_code == 0, ran.output


def test_api_refuses_an_unknown_value_with_the_cli_text(cli):
    """The same UsageError, keyword for flag: the CLI's line is the API's with flags shown."""
    cases = [(lambda: attnviz.run_heatmap(["a b"], weighting="value"), "weighting", "value"),
             (lambda: attnviz.run_heatmap(["a b"], ablate="half"), "ablate", "half"),
             (lambda: attnviz.run_model("m", ["a b"], dtype="float64"), "dtype", "float64"),
             (lambda: attnviz.run_heatmap(["a b"], random=True).figure(scale="sqrt"), "scale",
              "sqrt"),
             (lambda: attnviz.run_heatmap(["a b"], random=True).overview("sharpness"),
              "overview", "sharpness")]
    for call, keyword, value in cases:
        with pytest.raises(UsageError) as refused:
            call()
        error = refused.value
        assert str(error) == f"unknown {keyword} {value!r}" and error.option == keyword
        flag = flag_of(keyword)
        if flag.startswith("--") and keyword != "ablate":  # ablate's mode is `ablate --mode`
            command = "heatmap"
            line = cli(command, flag, value, "a b").stderr.strip()
            assert line == "error: " + error.one_line(flag_of)
    with pytest.raises(TypeError):  # not a string at all: a type error, as other keywords
        attnviz.run_heatmap(["a b"], weighting=1)  # type: ignore[arg-type]


def test_api_takes_the_enum_members_too():
    heat = attnviz.run_heatmap(["a b c"], random=True, weighting=Weighting.NORM)
    assert heat.run.weighting == "norm" and heat.to_json()["weighting"] == "norm"
    assert json.dumps(heat.to_json()["weighting"]) == '"norm"'


# --- one seed bound, at and past it, from the CLI and the API -------------------------------

def test_seed_bound_is_torchs():
    import torch

    torch.Generator().manual_seed(MAX_SEED)  # the bound itself is a valid torch seed
    with pytest.raises((RuntimeError, ValueError)):  # one past it is not: the bound is torch's
        torch.Generator().manual_seed(MAX_SEED + 1)


@pytest.mark.parametrize("command", ["split", "heatmap"])
def test_cli_seed_at_and_past_the_bound(cli, command):
    """split's --seed; heatmap's random init is seeded by --spec seed=."""
    def seed(value: int) -> tuple[str, ...]:
        if command == "heatmap":
            return ("--random", "--json", "a b", "--spec", f"seed={value}")
        return ("--json", "--seed", str(value))

    at = cli(command, *seed(MAX_SEED))
    assert at.exit_code == 0, at.output
    past = cli(command, *seed(MAX_SEED + 1))
    assert_clean_error(past, 2, "seed", str(MAX_SEED))


def test_api_seed_at_and_past_the_bound():
    assert attnviz.split(seed=MAX_SEED).report.proof.passed
    attnviz.run_heatmap(["a b"], random=True, seed=MAX_SEED)
    attnviz.circuits(random=True, seed=MAX_SEED, embed_dim=8, num_heads=2)
    for call in (lambda: attnviz.split(seed=MAX_SEED + 1),
                 lambda: attnviz.run_heatmap(["a b"], random=True, seed=MAX_SEED + 1),
                 lambda: attnviz.circuits(random=True, seed=MAX_SEED + 1),
                 lambda: attnviz.run_model("m", ["a b"], generate=2, sample=True,
                                           seed=MAX_SEED + 1)):
        with pytest.raises(UsageError, match=f"seed must be 0..{MAX_SEED}, not "):
            call()
    GenerateSpec(2, sample=True, seed=MAX_SEED).check()
    with pytest.raises(UsageError, match=f"0..{MAX_SEED}"):
        GenerateSpec(2, sample=True, seed=MAX_SEED + 1).check()
