"""Every architecture of the zoo (tests/zoo.py), as `inspect` and `split --weights` see it.

inspect: the layer count and each layer's geometry (H, H_kv, d, E) equal what the model's own
config says, and the weight shapes follow from them. split: one layer per model (two for
encoder-decoders: the last encoder self-attention and a cross-attention) is split by
`attnviz split --weights DIR --layer L`, and each head's q and k from attnviz's rows equal the
model's own in its forward (tests/heads_check.py says how); negative controls show a wrong row
of the model-type table is caught.

With ATTNVIZ_SUPPORT_JSON=path set, the outcomes are written there for
scripts/support_table.py, which renders docs/models.md's support table.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
transformers = lazy_import("transformers", "tokenizers")

import torch  # noqa: E402
from heads_check import check_heads  # noqa: E402
from zoo import SENTENCES, ZOO, load_for_capture, load_tokenizer  # noqa: E402

from attnviz.app.split import SplitRequest, run_split  # noqa: E402
from attnviz.core.layer import AttentionLayer  # noqa: E402
from attnviz.load.checkpoint import open_checkpoint  # noqa: E402
from attnviz.recognize import find_layers  # noqa: E402
from attnviz.recognize import model_type_table as table  # noqa: E402
from attnviz.sources.hf import capture as cap  # noqa: E402

KINDS = list(ZOO)
ROOT = Path(__file__).resolve().parents[1]


pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


from support_record import record  # noqa: E402

# ---------------------------------------------------------------------------------------------
# inspect


def expected_geometry(kind: str, config: Any) -> tuple[int, int, int, int, int]:
    """(attention modules, H, H_kv, d, E) from the model's config, in transformers' own terms."""
    E, H = config.hidden_size, config.num_attention_heads
    if kind == "falcon":
        kv = config.num_kv_heads if config.new_decoder_architecture else \
            1 if config.multi_query else H
    elif kind == "gpt_bigcode":
        kv = 1 if config.multi_query else H
    else:
        kv = getattr(config, "num_key_value_heads", None) or H
    d = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or E // H
    if kind in ("t5", "mt5"):
        layers = config.num_layers + 2 * config.num_decoder_layers
    elif ZOO[kind].encoder_decoder:
        layers = config.encoder_layers + 2 * config.decoder_layers
    elif kind == "albert":  # one module shared by all layers of a group
        layers = config.num_hidden_groups * config.inner_group_num
    else:
        layers = config.num_hidden_layers
    return layers, H, kv, d, E


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_geometry_equals_the_config(zoo_model, cli, kind) -> None:
    folder = zoo_model(kind)
    result = cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    config = transformers.AutoConfig.from_pretrained(folder)
    count, H, kv, d, E = expected_geometry(kind, config)
    assert len(doc["layers"]) == count
    assert doc["unresolved"] == [] and doc["unclassified"] == []
    for layer in doc["layers"]:
        assert (layer["num_heads"], layer["num_kv_heads"], layer["head_dim"],
                layer["embed_dim"]) == (H, kv, d, E), layer["name"]
        assert layer["shapes"] == {"q": [H * d, E], "k": [kv * d, E], "v": [kv * d, E],
                                   "o": [E, H * d]}, layer["name"]
    record(kind, model_type=config.model_type, layers=count,
           families=sorted({layer["family"] for layer in doc["layers"]}), inspect=True)


# ---------------------------------------------------------------------------------------------
# split: per-head slices against the model's own forward


def chosen_layers(layers: list[AttentionLayer], kind: str) -> list[AttentionLayer]:
    """The last layer of the main stack (of the encoder, for encoder-decoders), and one
    cross-attention for encoder-decoders."""
    if not ZOO[kind].encoder_decoder:
        return [layers[-1]]
    encoder = [layer for layer in layers if "encoder" in layer.name.split(".")]
    cross = [layer for layer in layers if layer.name.rsplit(".", 1)[-1] in
             ("encoder_attn", "EncDecAttention")]
    return [encoder[-1], cross[-1]]


def inputs_for(kind: str, folder: Any, model: Any) -> dict[str, torch.Tensor]:
    if not ZOO[kind].text:
        size = model.config.image_size
        return {"pixel_values": torch.randn(1, 3, size, size,
                                            generator=torch.Generator().manual_seed(0))}
    tokenizer = load_tokenizer(folder)
    enc = dict(tokenizer(SENTENCES[1], return_tensors="pt"))
    if ZOO[kind].encoder_decoder:
        target = tokenizer(SENTENCES[0], return_tensors="pt")["input_ids"]
        start = torch.tensor([[model.config.decoder_start_token_id]])
        enc["decoder_input_ids"] = torch.cat([start, target], 1)
    return enc


def check_split(folder: Any, kind: str) -> Any:
    """Split the chosen layers of the model in `folder` with `attnviz split --weights` and
    compare each head with the model's own forward; returns the model."""
    store = open_checkpoint(folder)
    model = load_for_capture(folder, ZOO[kind].model_class)
    inputs = inputs_for(kind, folder, model)
    for layer in chosen_layers(find_layers(store).layers, kind):
        split = run_split(SplitRequest(weights=folder, layer=layer.name))
        assert split.passed and split.layer == layer
        check_heads(model, store, layer, split.layer_weights, inputs, kind)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_split_heads_are_the_forwards_heads(zoo_model, kind) -> None:
    model = check_split(zoo_model(kind), kind)
    record(kind, split=True, path="interface" if cap.uses_interface(model) else
           "output_attentions")


@pytest.mark.parametrize(("kind", "wrong"), [
    ("gpt_neox", {"packing": table.THIRDS}),  # per-head interleave read as stacked thirds
    ("codegen", {"packing": replace(table.CODEGEN, order="qkv")}),  # CodeGen's blocks are q, v, k
    ("falcon", {"packing": table.STACKED}),  # per kv group read as stacked
    ("persimmon", {"packing": table.THIRDS}),  # per-head interleave read as stacked thirds
    ("gemma2", {"scale": None}),  # query_pre_attn_scalar^-½ read as 1/√d
])
def test_a_wrong_table_row_is_caught(zoo_model, monkeypatch, kind, wrong) -> None:
    """Negative controls: the comparison fails when a row of the model-type table is wrong."""
    monkeypatch.setitem(table.MODEL_TYPES, kind, replace(table.MODEL_TYPES[kind], **wrong))
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_split(zoo_model(kind), kind)


def test_docs_support_table_is_generated() -> None:
    """docs/models.md's support table is what scripts/support_table.py renders from this module's
    outcomes (it runs last; a partial run, e.g. with -k, has nothing to compare)."""
    from support_record import RESULTS
    from zoo import TEXT

    if any(not RESULTS.get(kind, {}).get(check) for kind in KINDS
           for check in ("inspect", "split")) or any(
            not {"heatmap", "verify"} <= set(RESULTS.get(kind, {})) for kind in TEXT):
        pytest.skip("not every architecture's tests ran (or passed) in this session")
    spec = importlib.util.spec_from_file_location("support_table",
                                                  ROOT / "scripts" / "support_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    assert script.block(readme) == script.render(RESULTS), \
        "docs/models.md's support table is stale: run python scripts/support_table.py"
