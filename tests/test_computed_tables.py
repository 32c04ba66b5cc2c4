"""A checkpoint may leave out what the model computes instead of learning: Marian's sinusoidal
position tables (transformers 5 saves MarianMTModel without them, and its ignore list names them
with a prefix the base model's keys lack). `--model` runs such a folder; a table that differs
from what its module builds, or any learned weight left out, is still refused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def marian_mt(tmp_path_factory):
    from zoo import build_lm

    folder = tmp_path_factory.mktemp("marian_mt")
    build_lm("marian", folder, "MarianMTModel")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    # what this test is about: the folder holds no position table
    assert not any("embed_positions" in name for name in saved), saved
    return folder


def test_a_folder_without_its_sinusoidal_tables_runs(cli, marian_mt):
    result = cli("heatmap", "the cat sat", "--model", str(marian_mt), "--layer", "0",
                 "--overview", "off", "--no-stats")
    assert result.exit_code == 0, result.output
    assert "lack" not in result.output


def test_the_tables_it_runs_are_what_the_module_builds(marian_mt):
    from attnviz.sources.hf.guard import computed_tables

    model = transformers.MarianModel.from_pretrained(marian_mt)
    names = computed_tables(model)
    assert names == {"encoder.embed_positions.weight", "decoder.embed_positions.weight"}
    for name in names:
        module = model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(module.weight, module.create_weight().to(module.weight.dtype))


def test_a_changed_table_is_not_computed(marian_mt):
    # negative control: a table that is not its module's own sinusoid must come from the file
    from attnviz.sources.hf.guard import computed_tables

    model = transformers.MarianModel.from_pretrained(marian_mt)
    with torch.no_grad():
        model.encoder.embed_positions.weight[3, 0] += 1e-3
    assert computed_tables(model) == {"decoder.embed_positions.weight"}


def test_a_learned_weight_left_out_is_still_refused(cli, marian_mt, tmp_path):
    # negative control: the exemption covers computed tables only
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "cut"
    shutil.copytree(marian_mt, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("encoder.layers.0.fc1.weight"))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    result = cli("heatmap", "the cat sat", "--model", str(folder), "--layer", "0")
    assert result.exit_code == 1
    assert "the weights lack" in result.output
