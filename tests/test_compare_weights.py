"""Two models' attention weights compared head by head (attnviz.compute.comparison.head_weights).

Each test writes a copy of a sample checkpoint with one head's slice perturbed and checks that
exactly that head (and, under grouped-query attention, exactly the query heads sharing a perturbed
key/value head) differs; identical copies give every head identical; each distance equals a
hand-sliced computation from the stored tensors; differing geometry is refused naming what
differs. Negative controls: a wrong slicing table (W_o split by rows) attributes a change to the
wrong heads, and the smallest change (one value's last bit) is caught."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import SAMPLES
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attnviz.compute.comparison import head_weights
from attnviz.compute.comparison.head_weights import compare_weights
from attnviz.core.request import SourceSpec
from attnviz.errors import UsageError
from attnviz.sources.registry import open_source

SIDES = ("‹model›", "‹against›")
D = 4  # head_dim of the samples (hidden 16, 4 heads)


def copy_with(sample: str, folder: Path,
              edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """`sample` copied to `folder`, its tensors changed by `edit` (None: a byte copy)."""
    folder.mkdir(parents=True)
    for item in (SAMPLES / sample).iterdir():
        shutil.copy(item, folder / item.name)
    if edit is not None:
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def compare(a: Path, b: Path) -> head_weights.WeightComparison:
    opened = [open_source(SourceSpec(weights=path)) for path in (a, b)]
    return compare_weights(opened[0].layers, opened[0].store, opened[1].layers, opened[1].store,
                           SIDES)


def differing(result: head_weights.WeightComparison) -> set[tuple[int, int]]:
    return {(h.layer, h.head) for h in result.heads if not h.identical}


def test_identical_copies_have_every_head_identical(tmp_path):
    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b")
    result = compare(a, b)
    assert len(result.heads) == 8 and differing(result) == set()
    assert result.all_identical and all(h.distance == 0.0 for h in result.heads)


def perturb_rows(key: str, start: int, stop: int, columns: bool = False, amount: float = 0.5):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        t = tensors[key].clone()
        if columns:
            t[:, start:stop] += amount
        else:
            t[start:stop] += amount
        tensors[key] = t
    return edit


@pytest.mark.parametrize(("key", "rows", "columns", "expected"), [
    # a query head's rows of W_q: that head only
    ("model.layers.1.self_attn.q_proj.weight", (2 * D, 3 * D), False, {(1, 2)}),
    # a query head's columns of W_o: that head only
    ("model.layers.0.self_attn.o_proj.weight", (1 * D, 2 * D), True, {(0, 1)}),
    # key/value head 1's rows of W_v: the two query heads that share it (h // 2 == 1)
    ("model.layers.1.self_attn.v_proj.weight", (1 * D, 2 * D), False, {(1, 2), (1, 3)}),
])
def test_one_perturbed_head_differs_alone(tmp_path, key, rows, columns, expected):
    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b", perturb_rows(key, *rows, columns=columns))
    result = compare(a, b)
    assert differing(result) == expected
    assert all((h.distance > 0) == ((h.layer, h.head) in expected) for h in result.heads)
    assert not result.all_identical


def test_packed_transposed_gpt2_head_found(tmp_path):
    """GPT-2's Conv1D c_attn (E, 3E) stores [q | k | v] by columns: k of head 3 is columns
    E + 3d … E + 4d of the stored tensor."""
    E = 16
    a = copy_with("gpt2-tiny", tmp_path / "a")
    b = copy_with("gpt2-tiny", tmp_path / "b",
                  perturb_rows("h.0.attn.c_attn.weight", E + 3 * D, E + 4 * D, columns=True))
    result = compare(a, b)
    assert differing(result) == {(0, 3)}
    head = result.layers[0].heads[3]
    assert [name for name in "qkvo" if not head.projection(name).identical] == ["k"]


def test_interleaved_bloom_head_found(tmp_path):
    """BLOOM's query_key_value interleaves per head: rows h·3d + d … h·3d + 2d are k of head h."""
    h = 2
    a = copy_with("bloom-tiny", tmp_path / "a")
    b = copy_with("bloom-tiny", tmp_path / "b", perturb_rows(
        "h.0.self_attention.query_key_value.weight", h * 3 * D + D, h * 3 * D + 2 * D))
    assert differing(compare(a, b)) == {(0, h)}


def test_distances_equal_a_hand_sliced_computation(tmp_path):
    """Each head's distance ‖B − A‖ / ‖A‖ over its W_q rows, its kv head's W_k and W_v rows and
    its W_o columns, recomputed here from the stored tensors in float64."""
    gen = torch.Generator().manual_seed(5)

    def noise(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            if "self_attn" in key:
                tensors[key] = tensors[key] + 0.01 * torch.randn(tensors[key].shape, generator=gen)

    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b", noise)
    ta, tb = (load_file(p / "model.safetensors") for p in (a, b))
    result = compare(a, b)
    for head in result.heads:
        p = f"model.layers.{head.layer}.self_attn."
        h, g = head.head, head.head // 2
        blocks = [(p + "q_proj.weight", slice(h * D, (h + 1) * D), slice(None)),
                  (p + "k_proj.weight", slice(g * D, (g + 1) * D), slice(None)),
                  (p + "v_proj.weight", slice(g * D, (g + 1) * D), slice(None)),
                  (p + "o_proj.weight", slice(None), slice(h * D, (h + 1) * D))]
        diff = sum(float(((tb[k][r, c].double() - ta[k][r, c].double()) ** 2).sum())
                   for k, r, c in blocks)
        base = sum(float((ta[k][r, c].double() ** 2).sum()) for k, r, c in blocks)
        assert head.distance == pytest.approx(math.sqrt(diff / base), rel=1e-12)
        assert 0 < head.distance < 0.5
        assert not head.identical


def test_one_last_bit_is_caught(tmp_path):
    """Negative control on sensitivity: one value moved to the next float32 differs; the
    distance is tiny but the bytes are not the same."""

    def nudge(tensors: dict[str, torch.Tensor]) -> None:
        t = tensors["model.layers.0.self_attn.k_proj.weight"].clone()
        t[D, 3] = torch.nextafter(t[D, 3], torch.tensor(math.inf))
        tensors["model.layers.0.self_attn.k_proj.weight"] = t

    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b", nudge)
    result = compare(a, b)
    assert differing(result) == {(0, 2), (0, 3)}  # kv head 1 serves query heads 2 and 3
    assert all(h.distance < 1e-6 for h in result.heads)


def test_a_wrong_slicing_table_is_caught(tmp_path, monkeypatch):
    """Negative control: with W_o split by rows (as W_q is) instead of by columns, a change to
    head 1's columns shows in every head, so the one-head check above would fail."""
    wrong = tuple(head_weights.Role(r.field, r.name, r.projection,
                                    "query" if r.owner == "columns" else r.owner)
                  for r in head_weights.ROLES)
    monkeypatch.setattr(head_weights, "ROLES", wrong)
    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b", perturb_rows(
        "model.layers.0.self_attn.o_proj.weight", D, 2 * D, columns=True))
    assert differing(compare(a, b)) != {(0, 1)}


def test_other_dtype_is_never_identical(tmp_path):
    def halve(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key] = tensors[key].to(torch.bfloat16)

    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b", halve)
    result = compare(a, b)
    assert result.dtypes == ("F32", "BF16")
    assert differing(result) == {(h.layer, h.head) for h in result.heads}
    assert any("byte-identical" in note for note in result.notes)


def test_differing_geometry_is_refused_by_name(tmp_path):
    """gpt2-tiny (4 key/value heads) against llama-gqa-tiny (2): both 2 layers of 4 heads × 4."""
    with pytest.raises(UsageError) as refused:
        compare(SAMPLES / "gpt2-tiny", SAMPLES / "llama-gqa-tiny")
    assert refused.value.what == ("layer 0 ('h.0.attn') differs in key/value heads: 4 in "
                                  "‹model›, 2 in ‹against›; their heads do not pair one to one")
    with pytest.raises(UsageError) as refused:
        compare(SAMPLES / "bloom-tiny", SAMPLES / "gpt2-tiny")
    assert refused.value.what.startswith("‹model› has 1 attention layers, ‹against› 2")


def test_other_head_count_is_refused(tmp_path):
    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    b = copy_with("llama-gqa-tiny", tmp_path / "b")
    config = json.loads((b / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1)  # d = 8: the same tensors
    (b / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as refused:
        compare(a, b)
    assert "differs in heads: 4 in ‹model›, 2 in ‹against›" in refused.value.what


def test_layers_named_otherwise_are_paired_by_position(tmp_path):
    """bert-tiny and gpt2-tiny share the geometry (2 layers, 4 heads of 4, biases): compared,
    with a note that their layers' names differ."""
    result = compare(SAMPLES / "bert-tiny", SAMPLES / "gpt2-tiny")
    assert differing(result) == {(h.layer, h.head) for h in result.heads}
    assert any("paired by position" in note for note in result.notes)


def test_one_tensor_of_each_model_at_a_time(tmp_path):
    """The reader is asked for one role at a time, A then B, never two of one model at once."""
    a = copy_with("llama-gqa-tiny", tmp_path / "a")
    opened = [open_source(SourceSpec(weights=a)) for _ in range(2)]
    calls: list[str] = []
    layer_a, layer_b = opened[0].layers[0], opened[1].layers[0]

    def reader(side: str, store):
        read = head_weights.tensor_reader(store)

        def traced(layer, role):
            calls.append(f"{side}:{role.name}")
            return read(layer, role)
        return traced

    head_weights.compare_layer(0, layer_a, reader("a", opened[0].store), layer_b,
                               reader("b", opened[1].store))
    assert calls[:4] == ["a:W_q", "b:W_q", "a:b_q", "a:W_k"]  # no b_q: not read from B either
    assert [c.split(":")[0] for c in calls if c.split(":")[1].startswith("W")] == ["a", "b"] * 4


def _sample_cases() -> list[Path]:
    from test_source_matrix import sample_cases

    return sample_cases()


@pytest.mark.parametrize("source", _sample_cases(), ids=lambda p: p.name)
def test_every_sample_against_itself_and_a_shifted_copy(cli, source: Path, tmp_path):
    """Every sample checkpoint the source matrix runs (`attnviz inspect` lists a layer): against
    itself every head is byte-identical; against a copy with every float tensor shifted by
    1e-3 (safetensors samples) none is."""
    from helpers import torch_loads_pickles
    from test_source_matrix import head_hint, inspected, usable

    if source.suffix == ".pt" and not torch_loads_pickles():
        pytest.skip("this torch does not open pickles (attnviz refuses them below 2.10)")
    hints = head_hint(usable(inspected(cli, source)))
    same = cli("compare", "--weights", source, "--against", source, "--json", *hints)
    assert same.exit_code == 0, same.output
    doc = json.loads(same.stdout)["weights"]
    assert doc["all_identical"] and doc["identical_heads"] == doc["heads"] > 0
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    if not files or files[0].suffix != ".safetensors":
        return
    copy = tmp_path / source.name
    if source.is_dir():
        shutil.copytree(source, copy)
    for file in files:
        target = copy if source.is_file() else copy / file.name
        tensors = {k: v + 1e-3 if v.is_floating_point() else v
                   for k, v in load_file(file).items()}
        with safe_open(file, "pt") as f:  # attnviz's own metadata (num_heads) kept
            metadata = f.metadata()
        save_file(tensors, target, metadata=metadata)
    moved = cli("compare", "--weights", source, "--against", copy, "--json", *hints)
    assert moved.exit_code == 0, moved.output
    assert json.loads(moved.stdout)["weights"]["identical_heads"] == 0
