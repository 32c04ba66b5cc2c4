"""Discovery: checkpoints whose tensor names match no row, resolved by building the model from
config.json on the meta device (attnviz.sources.discover), or listed as unresolved with why."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
transformers = lazy_import("transformers")

import torch  # noqa: E402
from heads_check import check_heads  # noqa: E402
from helpers import SAMPLES, assert_clean_error  # noqa: E402
from zoo import load_for_capture  # noqa: E402

from attnviz.app.split import SplitRequest, run_split  # noqa: E402
from attnviz.load.checkpoint import open_checkpoint  # noqa: E402
from attnviz.load.store import DictStore  # noqa: E402
from attnviz.recognize import conventions, find_layers  # noqa: E402
from attnviz.sources.discover import discover_modules  # noqa: E402

TINY = {  # architectures whose names no row of the table knows, or whose config lists heads
    "ctrl": (lambda: transformers.CTRLConfig(n_embd=32, n_head=4, n_layer=2, dff=64,
                                             vocab_size=40, n_positions=64), "CTRLModel"),
    "swin": (lambda: transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8,
                                             depths=[1, 1], num_heads=[2, 4], window_size=4),
             "SwinModel"),
    "xlnet": (lambda: transformers.XLNetConfig(d_model=32, n_head=4, n_layer=2, d_inner=64,
                                               vocab_size=40), "XLNetModel"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            make, model_class = TINY[kind]
            torch.manual_seed(0)
            model = getattr(transformers, model_class)(make())
            with torch.no_grad():  # random biases: a slicing mistake must show
                for name, param in model.named_parameters():
                    if name.endswith("bias") and param.ndim == 1:
                        param.normal_(0, 0.5)
            built[kind] = tmp_path_factory.mktemp(kind)
            transformers.utils.logging.disable_progress_bar()
            model.save_pretrained(built[kind])
        return built[kind]

    return get


def test_unknown_names_are_found_by_building_the_model(tiny, cli) -> None:
    """CTRL names its projections Wq, Wk, Wv, dense: no row has them. Built on the meta device,
    its MultiHeadAttention modules are found and split; the heads are the forward's own."""
    folder = tiny("ctrl")
    assert find_layers(open_checkpoint(folder)).unclassified == [
        "h.0.multi_head_attention", "h.1.multi_head_attention"]  # the table alone
    doc = json.loads(cli("inspect", folder, "--json").stdout)
    assert doc["unclassified"] == [] and doc["unresolved"] == []
    for layer in doc["layers"]:
        assert (layer["family"], layer["num_heads"], layer["head_dim"], layer["causal"]) == \
            ("ctrl", 4, 8, True)
        assert "meta device" in layer["storage"]
    split = run_split(SplitRequest(weights=folder, layer="h.1.multi_head_attention"))
    assert split.passed
    model = load_for_capture(folder, "CTRLModel")
    inputs = {"input_ids": torch.tensor([[5, 9, 2, 33, 7, 1]])}
    check_heads(model, open_checkpoint(folder), split.layer, split.layer_weights, inputs, "ctrl")


def test_per_stage_head_counts_come_from_the_modules(tiny, cli) -> None:
    """Swin's config lists heads per stage ([2, 4]): not a count for any one layer. The built
    model's modules hold each stage's count."""
    folder = tiny("swin")
    bare = find_layers(open_checkpoint(folder))
    assert [layer.num_heads for layer in bare.layers] == [None, None]
    doc = json.loads(cli("inspect", folder, "--json").stdout)
    assert [(layer["name"], layer["num_heads"], layer["head_dim"]) for layer in doc["layers"]] \
        == [("encoder.layers.0.blocks.0.attention", 2, 4),
            ("encoder.layers.1.blocks.0.attention", 4, 4)]
    assert all(layer["positions"] == "relative bias" for layer in doc["layers"])
    split = run_split(SplitRequest(weights=folder, layer="1"))
    model = load_for_capture(folder, "SwinModel")
    inputs = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    check_heads(model, open_checkpoint(folder), split.layer, split.layer_weights, inputs, "swin")


def test_modules_that_cannot_be_split_are_unresolved_with_the_reason(tiny, cli) -> None:
    """XLNet keeps q, k, v, o as 3-D (d_model, H, d) parameters: listed, with why, not split."""
    folder = tiny("xlnet")
    doc = json.loads(cli("inspect", folder, "--json").stdout)
    assert doc["layers"] == [] and doc["unclassified"] == []
    assert [item["name"] for item in doc["unresolved"]] == ["layer.0.rel_attn", "layer.1.rel_attn"]
    item = doc["unresolved"][0]
    assert item["family"] == "xlnet" and "not 2-D" in item["reason"]
    assert "XLNetRelativeAttention" in item["reason"]
    assert_clean_error(cli("split", "--weights", folder, "--layer", "layer.1.rel_attn"), 2,
                       "not 2-D")


def test_a_known_architecture_without_its_row_is_still_found(zoo_model, monkeypatch) -> None:
    """Remove DistilBERT's row: discovery finds the same layers, with the same rows per head."""
    folder = zoo_model("distilbert")
    store = open_checkpoint(folder)
    with_row = find_layers(store).layers
    monkeypatch.setattr(conventions, "CONVENTIONS", tuple(
        row for row in conventions.CONVENTIONS if row.label != "distilbert"))
    assert find_layers(store).layers == []
    found = find_layers(store, discover=discover_modules).layers
    assert [layer.name for layer in found] == [layer.name for layer in with_row]
    for a, b in zip(found, with_row, strict=True):
        assert (a.num_heads, a.num_kv_heads, a.head_dim, a.family) == \
            (b.num_heads, b.num_kv_heads, b.head_dim, b.family)
        assert (a.q_weight, a.k_weight, a.v_weight, a.o_weight, a.q_bias, a.o_bias) == \
            (b.q_weight, b.k_weight, b.v_weight, b.o_weight, b.q_bias, b.o_bias)


def test_discovery_that_cannot_build_changes_nothing() -> None:
    """No model_type transformers knows, or a config naming its own code: no code runs, the
    tensors stay listed as unclassified."""
    tensors = {"blocks.0.attn.wq.weight": torch.zeros(4, 4)}
    for config in ({"model_type": "no-such-type"},
                   {"model_type": "zeta", "auto_map": {"AutoModel": "modeling_zeta.Zeta"}}):
        store = DictStore(tensors, config=config)
        reason = discover_modules(store)
        assert isinstance(reason, str) and "cannot build" in reason
        assert find_layers(store, discover=discover_modules).unclassified == ["blocks.0.attn"]
    assert discover_modules(DictStore(tensors)) == "config.json names no model_type"


def test_recognized_folders_stay_header_only() -> None:
    """Discovery runs only for what the table leaves open: a folder the table recognizes is
    inspected without importing torch or transformers."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom attnviz.cli.main import app\n"
            f"r = CliRunner().invoke(app, ['inspect', {str(SAMPLES / 'bert-tiny')!r}, '--json'])\n"
            "assert r.exit_code == 0, r.output\n"
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
