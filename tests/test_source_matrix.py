"""The source matrix: every sample checkpoint and every zoo model that `attnviz inspect` lists
with a usable layer runs through every command that accepts it (inspect, split, heatmap and
circuits with --weights; split, heatmap, circuits and tokens with --model for the zoo's
folders). Each cell exits 0, or with a clear refusal listed below with its reason; never "no
attention layer recognized" for a layer inspect listed. Every command opens its source through
one registry (attnviz.sources.registry), which is what makes the matrix hold: the negative
control puts heatmap's old table-only inventory back and shows the CTRL cell fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import SAMPLES, torch_loads_pickles

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCE = "the cat sat on the mat"
NEVER = ("no attention layer recognized", "unexpected", "Traceback")


@dataclass(frozen=True)
class Refusal:
    """A cell the matrix expects to refuse: its exit code, a fragment of the one error line and
    why the refusal is right."""

    code: int
    fragment: str
    reason: str


# (case, command, flag) -> the refusal it must give. Cases are sample names, or zoo:<kind>.
REFUSALS: dict[tuple[str, str, str], Refusal] = {
    ("zoo:vit", "heatmap", "--model"): Refusal(
        2, "--model needs a text model",
        "heatmap runs the model's own forward on sentences; a vision model takes pixels, not "
        "token ids (its layers still run in heatmap --weights, on synthetic vectors)"),
    ("zoo:vit", "tokens", "--model"): Refusal(
        2, "--model needs a text model", "tokens runs the model's own forward on sentences"),
    ("zoo:vit", "corpus", "--model"): Refusal(
        2, "--model needs a text model", "a corpus is text; a vision model takes pixels"),
}


def sample_cases() -> list[Path]:
    """Every checkpoint in sample_weights/: files, model folders, and the folders under models/."""
    found = sorted(p for p in SAMPLES.iterdir()
                   if p.suffix in (".safetensors", ".pt") or (p / "config.json").is_file())
    return found + sorted(p for p in (SAMPLES / "models").iterdir() if p.is_dir())


def inspected(cli: Callable[..., Any], source: Path) -> dict[str, Any]:
    result = cli("inspect", source, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def usable(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The first layer inspect lists (the matrix's row), or None when it lists none."""
    return doc["layers"][0] if doc["layers"] else None


def head_hint(layer: dict[str, Any]) -> list[str]:
    """-H for a layer whose head count no config gives (a torch pickle): the smallest divisor
    above 1 of its width, as a user would pass it."""
    if layer["num_heads"] is not None:
        return []
    width = layer["embed_dim"]
    return ["-H", str(next(n for n in range(2, width + 1) if width % n == 0))]


def weights_args(command: str, source: Path, layer: dict[str, Any]) -> list[Any]:
    """One --weights cell's command line (small output: --json, --no-maps)."""
    spec = layer["name"] or str(layer["index"])
    hints = head_hint(layer)
    if command == "inspect":
        return ["inspect", source, "--layer", spec, "--json", *hints]
    if command == "heatmap":
        return ["heatmap", "--weights", source, "--layer", spec, "--no-maps", "--json", *hints,
                SENTENCE]
    return [command, "--weights", source, "--layer", spec, "--json", *hints]


def model_args(command: str, folder: Path) -> list[Any]:
    """One --model cell's command line: the model's first layer."""
    if command == "heatmap":
        return ["heatmap", "--model", folder, "--layer", "0", "--no-maps", "--json", SENTENCE]
    if command == "tokens":  # every layer: the command traces the whole stack
        return ["tokens", "--model", folder, "--json", SENTENCE]
    if command == "corpus":  # every layer, over a few real sentences
        return ["corpus", SAMPLES / "english.txt", "--model", folder, "--limit", "4",
                "--resamples", "5", "--json"]
    return [command, "--model", folder, "--layer", "0", "--json"]


def check_cell(cli: Callable[..., Any], case: str, command: str, flag: str,
               args: list[Any]) -> None:
    """The cell exits 0, or refuses as REFUSALS lists it (one clean error line)."""
    result = cli(*args)
    where = f"{case}: {' '.join(str(a) for a in args)}"
    refusal = REFUSALS.get((case, command, flag))
    for text in NEVER:
        assert text not in result.output, (where, result.output)
    if refusal is None:
        assert result.exit_code == 0, (where, result.output)
        return
    assert result.exit_code == refusal.code, (where, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (where, result.stderr)
    assert refusal.fragment in lines[0], (where, lines[0])


WEIGHTS_COMMANDS = ("inspect", "split", "heatmap", "circuits")
MODEL_COMMANDS = ("split", "heatmap", "circuits", "tokens", "corpus")


def run_weights_row(cli: Callable[..., Any], case: str, source: Path) -> bool:
    """Every --weights cell of one checkpoint; False when inspect lists no layer (no row)."""
    layer = usable(inspected(cli, source))
    if layer is None:
        return False
    for command in WEIGHTS_COMMANDS:
        check_cell(cli, case, command, "--weights", weights_args(command, source, layer))
    return True


@pytest.mark.parametrize("source", sample_cases(), ids=lambda p: p.name)
def test_every_sample_runs_in_every_command(cli, source: Path) -> None:
    if source.suffix == ".pt" and not torch_loads_pickles():
        pytest.skip("this torch does not open pickles (attnviz refuses them below 2.10)")
    assert run_weights_row(cli, source.name, source)  # every sample has a layer


# --------------------------------------------------------------------------------- the zoo


def zoo_kinds() -> list[str]:
    from zoo import DISCOVERED, ZOO

    return list(ZOO) + list(DISCOVERED)


def _zoo_ids() -> list[str]:
    try:
        return zoo_kinds()
    except BaseException:  # noqa: BLE001 - transformers missing: the tests skip
        return []


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", _zoo_ids())
def test_every_zoo_model_runs_in_every_command(cli, zoo_model, kind: str) -> None:
    """--weights on the saved folder in all four commands; --model in split, heatmap,
    circuits and corpus."""
    folder = zoo_model(kind)
    if not run_weights_row(cli, f"zoo:{kind}", folder):
        pytest.skip(f"inspect lists no usable layer of {kind}")
    for command in MODEL_COMMANDS:
        check_cell(cli, f"zoo:{kind}", command, "--model", model_args(command, folder))


# ------------------------------------------------------- CTRL: found only by discovery


@pytest.mark.hf
@pytest.mark.parametrize("command", WEIGHTS_COMMANDS)
def test_ctrl_runs_in_every_weights_command(cli, zoo_model, command: str) -> None:
    """The case that started the registry: CTRL's layers are found only by building the model
    on the meta device; heatmap --weights refused them while the other commands ran them."""
    folder = zoo_model("ctrl")
    layer = usable(inspected(cli, folder))
    assert layer is not None and layer["name"] == "h.0.multi_head_attention"
    check_cell(cli, "zoo:ctrl", command, "--weights", weights_args(command, folder, layer))


@pytest.mark.hf
def test_the_matrix_catches_heatmaps_old_inventory(cli, zoo_model, monkeypatch) -> None:
    """Negative control: heatmap's checkpoint path put back on the table-only inventory (what
    it read before the registry) fails the CTRL cell, with the old message."""
    from attnviz.recognize import find_layers
    from attnviz.sources import registry

    folder = zoo_model("ctrl")
    layer = usable(inspected(cli, folder))
    assert layer is not None
    monkeypatch.setattr(registry, "find_inventory", lambda store, hints: find_layers(store, hints))
    with pytest.raises(AssertionError, match="no attention layer recognized"):
        check_cell(cli, "zoo:ctrl", "heatmap", "--weights",
                   weights_args("heatmap", folder, layer))


@pytest.mark.hf
def test_ctrl_heatmap_maps_equal_ctrls_own_attention(zoo_model) -> None:
    """heatmap --weights' maps for a CTRL layer equal CTRL's own MultiHeadAttention module (run
    by transformers, eager, causal mask) on the same input vectors, to 1e-5; control: the
    module's maps without the causal mask differ (the comparison can fail)."""
    import torch
    import transformers

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.compute.forward_pass.inputs import input_vectors, make_batch
    from attnviz.load.checkpoint import open_checkpoint

    folder = zoo_model("ctrl")
    result = run_heatmap(HeatmapRequest.build(weights=folder, layer="1",
                                              sentences=[SENTENCE]))
    shown = result.run.layers[0]
    assert shown.weights is not None
    ours = shown.weights[0].float()  # (H, L, L)
    model = transformers.CTRLModel.from_pretrained(folder, attn_implementation="eager").eval()
    module = model.h[1].multi_head_attention
    batch = make_batch([SENTENCE])
    x, _ = input_vectors(batch, 32, open_checkpoint(folder), "none")
    n = x.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        _, theirs = module(x, x, x, attention_mask=causal)
        _, open_maps = module(x, x, x, attention_mask=None)
    assert ours.shape == theirs[0].shape == (4, n, n)
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=0)
    assert (ours - open_maps[0]).abs().max() > 1e-2  # control: a wrong mask is caught


@pytest.mark.hf
def test_the_python_api_reads_the_same_inventory(zoo_model) -> None:
    """The Python API goes through the same registry: find_layers lists CTRL's two layers (as
    inspect does), and inspect, split, run_heatmap and circuits run layer 1. Control: the
    naming table alone (recognize.find_layers, no discovery) lists none."""
    import attnviz
    from attnviz.load.checkpoint import open_checkpoint
    from attnviz.recognize import find_layers

    folder = zoo_model("ctrl")
    names = ["h.0.multi_head_attention", "h.1.multi_head_attention"]
    assert [layer.name for layer in attnviz.find_layers(folder).layers] == names
    assert find_layers(open_checkpoint(folder)).layers == []  # control
    assert attnviz.inspect(folder, layer="1").detail is not None
    assert attnviz.split(folder, layer="1").passed
    heatmap = attnviz.run_heatmap([SENTENCE], weights=folder, layer="1")
    assert heatmap.run.layers[0].layer.name == names[1]
    assert [c.name for c in attnviz.circuits(folder, layer="1").layers] == [names[1]]
