"""Recognition as data: a naming convention is one row, a model type is one row, and the two
tables are the only place either is written down. Also: every number config.json gives is
validated, and the layouts added with the tables (DistilBERT, ALBERT, DeBERTa-v2, MPNet, Phi-3,
CodeGen, MPT/ModernBERT) split as their modeling code splits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnviz.compute.forward_pass import positions
from attnviz.compute.forward_pass.forward import load_weights
from attnviz.core.request import HeadHints
from attnviz.errors import LayoutError
from attnviz.load.store import DictStore
from attnviz.recognize import claimed_keys, conventions, find_layers
from attnviz.recognize import model_type_table as table
from attnviz.recognize import model_types as mt
from attnviz.recognize.conventions import Convention, linear

B, L = 2, 5


def draw(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def x_for(width: int) -> torch.Tensor:
    return draw(B, L, width, seed=99)


def separate(prefix: str, names: tuple[str, str, str, str], E: int = 16, H: int = 4,
             H_kv: int = 4, d: int = 4, bias: bool = True) -> dict[str, torch.Tensor]:
    """q, k, v, o nn.Linear weights (and biases) under `prefix` with these names."""
    rows = {names[0]: (H * d, E), names[1]: (H_kv * d, E), names[2]: (H_kv * d, E),
            names[3]: (E, H * d)}
    tensors = {}
    for i, (name, shape) in enumerate(rows.items()):
        tensors[f"{prefix}{name}.weight"] = draw(*shape, seed=i)
        if bias:
            tensors[f"{prefix}{name}.bias"] = draw(shape[0], seed=10 + i)
    return tensors


def heads_of(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, d: int) -> torch.Tensor:
    """The usual reshape of a projection into heads: (B, H, L, d)."""
    return F.linear(x, W, b).view(B, L, -1, d).transpose(1, 2)


def assert_query_heads(layer, store, q: torch.Tensor) -> None:
    """attnviz's W_q rows of each head give the model's q of that head (B, H, L, d)."""
    w, x = load_weights(layer, store), x_for(layer.embed_dim)
    for h in range(layer.num_heads):
        rows = slice(*layer.q_rows(h))
        ours = F.linear(x, w.W_q[rows], None if w.b_q is None else w.b_q[rows])
        torch.testing.assert_close(ours, q[:, h])


# ---------------------------------------------------------------------------------------------
# a new naming convention is one row


INVENTED = Convention("zeta", linear("zattn.wquery", "zattn.wkey", "zattn.wvalue"),
                      ("zattn.wout.weight",), storage="separate zattn.w{query,key,value} + wout")


def test_a_new_naming_convention_is_one_row(monkeypatch) -> None:
    tensors = {**separate("blocks.3.", ("zattn.wquery", "zattn.wkey", "zattn.wvalue",
                                        "zattn.wout"), H=4, H_kv=2),
               "blocks.3.mlp.weight": draw(8, 16)}
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    store = DictStore(tensors, config=config)
    before = find_layers(store)
    assert before.layers == [] and before.unclassified == ["blocks.3.zattn"]

    monkeypatch.setattr(conventions, "CONVENTIONS", (*conventions.CONVENTIONS, INVENTED))
    (layer,) = find_layers(store).layers
    assert (layer.name, layer.family, layer.num_heads, layer.num_kv_heads, layer.head_dim) == \
        ("blocks.3", "llama", 4, 2, 4)
    # the model_type's facts come with it: llama is RoPE, causal
    assert (layer.positions, layer.causal) == ("rope", True)
    assert layer.storage == "separate zattn.w{query,key,value} + wout"
    assert_query_heads(layer, store, heads_of(x_for(16), tensors["blocks.3.zattn.wquery.weight"],
                                              tensors["blocks.3.zattn.wquery.bias"], 4))


def test_a_new_fused_convention_is_one_row_too(monkeypatch) -> None:
    """A stacked [q; k; v] with grouped-query sizes under an invented name: the packing is a
    field of the row, split by the shared packing code."""
    E, H, H_kv, d = 16, 4, 2, 4
    tensors = {"m.attn.fused_all.weight": draw((H + 2 * H_kv) * d, E),
               "m.attn.back.weight": draw(E, H * d)}
    row = Convention("fused-zeta", (("fused_all.weight", "qkv"),), ("back.weight",),
                     packing=table.STACKED)
    monkeypatch.setattr(conventions, "CONVENTIONS", (row, *conventions.CONVENTIONS))
    store = DictStore(tensors, config={"model_type": "qwen2", "num_attention_heads": H,
                                       "num_key_value_heads": H_kv})
    (layer,) = find_layers(store).layers
    assert layer.q_weight.row_ranges == ((0, 16),)
    assert layer.k_weight.row_ranges == ((16, 24),) and layer.v_weight.row_ranges == ((24, 32),)
    unresolved = find_layers(DictStore(tensors)).unresolved  # no head counts: not guessed
    assert [item.name for item in unresolved] == ["m.attn"]
    assert "number of heads" in unresolved[0].reason


def test_a_new_model_type_is_one_row(monkeypatch) -> None:
    tensors = separate("model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"))
    store = DictStore(tensors, config={"model_type": "zeta", "zeta_heads": 2})
    (layer,) = find_layers(store).layers
    assert layer.family == "qkv_proj" and not layer.heads_known
    monkeypatch.setitem(table.MODEL_TYPES, "zeta", table.ModelType(
        heads=("zeta_heads",), positions="alibi", causal="always", scale=0.5))
    (layer,) = find_layers(store).layers
    assert (layer.family, layer.num_heads, layer.positions, layer.causal, layer.scale) == \
        ("zeta", 2, "alibi", True, 0.5)


def test_one_model_type_table_for_recognize_and_positions() -> None:
    """compute/forward_pass/positions keeps no list of its own: what it recomputes is the table's
    verify rows, its sliding-window rules are the table's."""
    assert positions.SCHEMES == {kind: "rope" if row.positions == "rope" else "none"
                                 for kind, row in table.MODEL_TYPES.items() if row.verify}
    assert set(positions.SCHEMES) == {"bert", "gpt2", "bart", "llama", "mistral", "qwen2",
                                      "gpt_neox"}
    mistral = {"sliding_window": 4}
    assert positions.sliding_window(mistral, "mistral", 0) == 4
    assert positions.sliding_window(mistral, "llama", 0) is None
    qwen2 = {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}
    assert [positions.sliding_window(qwen2, "qwen2", i) for i in (0, 1)] == [None, 4]
    layered = {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}
    assert [positions.sliding_window(layered, "gemma2", i) for i in (0, 1)] == [None, 4]
    neox = table.MODEL_TYPES["gpt_neox"]
    assert mt.layer_rotary_fraction(neox, {}, 8) == 0.25  # GPTNeoXConfig's default rotary_pct
    half = {"rope_parameters": {"partial_rotary_factor": 0.5}}
    assert mt.layer_rotary_fraction(neox, half, 8) == 0.5


def test_every_convention_names_a_known_model_type_row() -> None:
    for row in conventions.CONVENTIONS:
        assert row.assume is None or row.assume in table.MODEL_TYPES, row
        assert all(kind is None or kind in table.MODEL_TYPES for kind in row.only), row


# ---------------------------------------------------------------------------------------------
# config.json numbers


def test_list_valued_num_heads_is_not_a_head_count() -> None:
    """Swin-like configs list heads per stage: that is no count for a layer (noted, not an
    error, and never read as H); its items are still checked."""
    tensors = separate("encoder.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj", "out_proj"))
    (layer,) = find_layers(DictStore(tensors, config={"num_heads": [2, 4]})).layers
    assert not layer.heads_known
    assert any("is a list" in note for note in layer.notes)
    with pytest.raises(LayoutError, match="num_heads"):
        find_layers(DictStore(tensors, config={"num_heads": [2, "four"]}))


def test_plain_q_k_v_names_under_any_module() -> None:
    """Hand-written models name them q, k, v, o (or proj): one generic row, after the specific
    ones (T5's modules and MPNet's attn keep their own rows)."""
    tensors = separate("blocks.1.attn.", ("q", "k", "v", "proj"), H=4, H_kv=2)
    (layer,) = find_layers(DictStore(tensors), HeadHints(4)).layers
    assert (layer.name, layer.family, layer.num_kv_heads) == ("blocks.1.attn", "qkv", 2)
    assert layer.storage == "separate {q,k,v} + proj, nn.Linear (out, in)"
    t5 = separate("encoder.block.0.layer.0.SelfAttention.", ("q", "k", "v", "o"), bias=False)
    (layer,) = find_layers(DictStore(t5, config={"model_type": "t5", "num_heads": 4})).layers
    assert layer.family == "t5"


def test_t5_keys_do_not_take_another_model_types_num_heads() -> None:
    """Only the T5 row reads `num_heads`: a config of another known type with T5-style names
    takes that type's own key."""
    tensors = separate("encoder.block.0.layer.0.SelfAttention.", ("q", "k", "v", "o"),
                       bias=False, H=4, d=4)
    config = {"model_type": "llama", "num_attention_heads": 4, "num_heads": 8}
    (layer,) = find_layers(DictStore(tensors, config=config)).layers
    assert (layer.family, layer.num_heads) == ("llama", 4)
    (t5,) = find_layers(DictStore(tensors, config={"model_type": "t5", "num_heads": 4})).layers
    assert (t5.family, t5.scale, t5.positions) == ("t5", 1.0, "relative bias")


@pytest.mark.parametrize("value", ["4", 4.0, True, -2, 0, 10 ** 30, 2 ** 70])
def test_head_counts_must_be_positive_integers(value) -> None:
    tensors = separate("model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(LayoutError, match="num_attention_heads") as info:
        find_layers(DictStore(tensors, config={"model_type": "llama",
                                               "num_attention_heads": value}))
    assert len(info.value.one_line()) < 300  # a huge integer is not printed digit by digit


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, "big", 10 ** 400])
def test_scale_numbers_must_be_finite_and_positive(value) -> None:
    tensors = separate("model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"),
                       d=8, bias=False)
    config = {"model_type": "gemma2", "num_attention_heads": 4, "head_dim": 8,
              "query_pre_attn_scalar": value}
    with pytest.raises(LayoutError, match="query_pre_attn_scalar"):
        find_layers(DictStore(tensors, config=config))


def test_a_head_count_the_tensor_cannot_hold_fails_fast() -> None:
    """60000 heads on a 48-row fused tensor: refused by the row count before any loop."""
    tensors = {"gpt_neox.layers.0.attention.query_key_value.weight": draw(48, 16),
               "gpt_neox.layers.0.attention.dense.weight": draw(16, 16)}
    with pytest.raises(LayoutError, match="not divisible by 60000 heads"):
        find_layers(DictStore(tensors), HeadHints(60000))
    config = {"model_type": "gpt_neox", "num_attention_heads": 10 ** 6}
    with pytest.raises(LayoutError, match="≤ 65536"):
        find_layers(DictStore(tensors, config=config))


# ---------------------------------------------------------------------------------------------
# layouts the tables added, against their modeling code's own reshapes


def test_codegen_blocks_are_q_v_k() -> None:
    """CodeGenAttention: qkv.view(B, L, 4, 3·E/4); query, value, key = split(E/4); then each
    reshaped (B, L, H, d). The layout does not depend on H: no head count needed to split."""
    E, H, d = 32, 4, 8
    tensors = {"h.0.attn.qkv_proj.weight": draw(3 * E, E), "h.0.attn.out_proj.weight": draw(E, E)}
    store = DictStore(tensors, config={"model_type": "codegen", "n_head": H, "rotary_dim": 4})
    (layer,) = find_layers(store).layers
    x, local = x_for(E), E // 4
    qkv = F.linear(x, tensors["h.0.attn.qkv_proj.weight"]).view(B, L, 4, 3 * local)
    query, value, key = qkv.split(local, dim=-1)
    q = query.reshape(B, L, H, d).transpose(1, 2)
    assert_query_heads(layer, store, q)
    w = load_weights(layer, store)
    torch.testing.assert_close(F.linear(x, w.W_k), key.reshape(B, L, E))
    torch.testing.assert_close(F.linear(x, w.W_v), value.reshape(B, L, E))
    assert layer.positions == "rope (partial, 50%)" and layer.causal
    (bare,) = find_layers(DictStore(tensors, config={"model_type": "codegen"})).layers
    assert bare.q_weight.row_ranges == layer.q_weight.row_ranges and not bare.heads_known


def test_phi3_qkv_proj_is_stacked_with_grouped_query_sizes() -> None:
    E, H, H_kv, d = 16, 4, 2, 4
    tensors = {"model.layers.0.self_attn.qkv_proj.weight": draw((H + 2 * H_kv) * d, E),
               "model.layers.0.self_attn.o_proj.weight": draw(E, H * d)}
    config = {"model_type": "phi3", "num_attention_heads": H, "num_key_value_heads": H_kv}
    store = DictStore(tensors, config=config)
    (layer,) = find_layers(store).layers
    # Phi3Attention: query_pos = H·d; q = qkv[..., :query_pos], k = next H_kv·d, v = the rest
    qkv = F.linear(x_for(E), tensors["model.layers.0.self_attn.qkv_proj.weight"])
    assert_query_heads(layer, store, qkv[..., :H * d].view(B, L, H, d).transpose(1, 2))
    w = load_weights(layer, store)
    torch.testing.assert_close(F.linear(x_for(E), w.W_k), qkv[..., H * d:(H + H_kv) * d])
    assert (layer.num_kv_heads, layer.family, layer.positions) == (H_kv, "phi3", "rope")


def test_modernbert_takes_the_attention_wo_never_the_mlps() -> None:
    E = 16
    tensors = {"layers.0.attn.Wqkv.weight": draw(3 * E, E), "layers.0.attn.Wo.weight": draw(E, E),
               "layers.0.mlp.Wi.weight": draw(4 * E, E), "layers.0.mlp.Wo.weight": draw(E, 2 * E)}
    store = DictStore(tensors, config={"model_type": "modernbert", "num_attention_heads": 4})
    inventory = find_layers(store)
    (layer,) = inventory.layers
    assert layer.o_weight.key == "layers.0.attn.Wo.weight"
    assert "layers.0.mlp.Wo.weight" not in claimed_keys(layer) and inventory.unclassified == []
    # ModernBertAttention: qkv.view(B, L, 3, H, d)
    qkv = F.linear(x_for(E), tensors["layers.0.attn.Wqkv.weight"]).view(B, L, 3, 4, 4)
    assert_query_heads(layer, store, qkv[:, :, 0].transpose(1, 2))
    assert (layer.positions, layer.causal) == ("rope", False)


@pytest.mark.parametrize(("names", "prefix", "config", "family"), [
    (("q_lin", "k_lin", "v_lin", "out_lin"), "transformer.layer.0.attention.",
     {"model_type": "distilbert", "n_heads": 4}, "distilbert"),
    (("query", "key", "value", "dense"), "encoder.albert_layer_groups.0.albert_layers.0."
     "attention.", {"model_type": "albert", "num_attention_heads": 4}, "albert"),
    (("attn.q", "attn.k", "attn.v", "attn.o"), "encoder.layer.0.attention.",
     {"model_type": "mpnet", "num_attention_heads": 4}, "mpnet"),
    (("self.query_proj", "self.key_proj", "self.value_proj", "output.dense"),
     "encoder.layer.0.attention.", {"model_type": "deberta-v2", "num_attention_heads": 4,
                                    "relative_attention": True, "pos_att_type": ["p2c", "c2p"]},
     "deberta-v2"),
])
def test_separate_projections_under_other_names(names, prefix, config, family) -> None:
    tensors = separate(prefix, names)
    store = DictStore(tensors, config=config)
    (layer,) = find_layers(store).layers
    assert (layer.name, layer.family, layer.num_heads, layer.head_dim) == \
        (prefix.rstrip("."), family, 4, 4)
    q = heads_of(x_for(16), tensors[f"{prefix}{names[0]}.weight"],
                 tensors[f"{prefix}{names[0]}.bias"], 4)
    assert_query_heads(layer, store, q)
    if family == "deberta-v2":  # DisentangledSelfAttention: q·kᵀ / √(d · (1 + |c2p, p2c|))
        assert layer.scale == pytest.approx((4 * 3) ** -0.5)


def test_gpt_bigcode_honours_scale_attn_weights() -> None:
    """Regression: GPTBigCode's scale_attn_weights false means no 1/√d (it was ignored)."""
    E = 16
    tensors = {"transformer.h.0.attn.c_attn.weight": draw(E + 2 * 4, E),
               "transformer.h.0.attn.c_proj.weight": draw(E, E)}
    config = {"model_type": "gpt_bigcode", "n_head": 4, "scale_attn_weights": False}
    (layer,) = find_layers(DictStore(tensors, config=config)).layers
    assert layer.scale == 1.0 and layer.num_kv_heads == 1
    (scaled,) = find_layers(DictStore(tensors, config={**config,
                                                       "scale_attn_weights": True})).layers
    assert scaled.scale is None


def test_q_norm_over_the_whole_projection_is_told_apart() -> None:
    tensors = separate("model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"),
                       bias=False)
    config = {"model_type": "olmo2", "num_attention_heads": 4}
    whole = {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    per_head = {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(4)}
    (a,) = find_layers(DictStore(whole, config=config)).layers
    (b,) = find_layers(DictStore(per_head, config={**config, "model_type": "qwen3"})).layers
    assert any("whole projection" in note for note in a.notes)
    assert any("per head" in note for note in b.notes)

