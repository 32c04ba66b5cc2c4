"""The thin CLI's contract: a flag that does not apply to the chosen source is a usage error
(exit 2, naming the flag), never silently ignored."""

from __future__ import annotations

import pytest
from helpers import BUNDLED, SAMPLES, assert_clean_error

CASES = [
    (["heatmap", "a b", "--spec", "E=32"], "--spec E applies to --random only"),
    (["heatmap", "a b", "--spec", "seed=3,kdim=8"],
     "--spec kdim, --spec seed apply to --random only"),
    (["heatmap", "--model", "m", "a", "--causal"], "--causal does not apply to --model"),
    (["heatmap", "--model", "m", "a", "-H", "4", "--spec", "positions=sinusoidal"],
     "--spec positions, --num-heads do not apply to --model"),
    (["heatmap", "a b", "--dtype", "bfloat16"],
     "--dtype, --device-map and --max-memory apply to --model only"),
    (["heatmap", "a b", "--random", "--weights", BUNDLED], "exclude each other"),
    (["split", "--weights", BUNDLED, "-E", "16"], "--spec E applies to random init only"),
    (["split", "--weights", BUNDLED, "--spec", "E=16"], "--spec E applies to random init only"),
    (["split", "--weights", BUNDLED, "--no-bias"], "--no-bias applies to random init only"),
    (["split", "--layer", "1"], "need --weights or --model"),
    (["split", "--verify"], "--verify needs --model"),
]


@pytest.mark.parametrize("args, fragment", CASES, ids=[" ".join(map(str, c[0])) for c in CASES])
def test_inapplicable_flags_are_usage_errors(cli, args, fragment):
    assert_clean_error(cli(*args), 2, fragment)


def test_applicable_flags_still_work(cli):
    """Negative control: the same flags with the source they belong to run."""
    assert cli("heatmap", "a b", "--random", "--spec", "E=32,seed=3").exit_code == 0
    assert cli("split", "-E", "16", "-H", "2", "--no-bias").exit_code == 0


def test_file_dash_reads_standard_input(cli, tmp_path):
    """`-f -` reads the sentences from standard input, with the limits of any sentence file."""
    import json

    result = cli("heatmap", "-f", "-", "--json", input="the cat sat\na dog ran far\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sentences"] == ["the cat sat", "a dog ran far"]
    long_line = " ".join(["w"] * 300) + "\n"
    assert_clean_error(cli("heatmap", "-f", "-", input=long_line), 2, "more than --budget tokens")


@pytest.mark.parametrize("args, flag, applies", [
    (["-H", "4"], "--num-heads", ["--random"]),
    (["--spec", "d=8"], "--spec d", ["--weights", SAMPLES / "mha.safetensors"]),
    (["--budget", "memory=1GB"], "--budget memory", ["--random"]),
])
def test_flags_the_bundled_model_ignores_are_refused(cli, args, flag, applies):
    """The bundled model has its own 2 heads per layer and always runs whole: a head count or a
    memory budget given to it would be silently ignored, so it is a usage error."""
    assert_clean_error(cli("heatmap", "the cat sat", *args), 2, flag, "bundled model")
    # control: the same flag is taken where it applies (a random layer; a checkpoint layer's
    # head width: a random nn.MultiheadAttention's is E / H, and --head-dim is refused there)
    # (--json: --quiet alone is refused now, as it would write nothing)
    assert cli("heatmap", "the cat sat", *applies, "--json", *args).exit_code == 0
