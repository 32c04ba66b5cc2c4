"""Every layout family, on the committed samples, on checkpoints written in tmp_path and on the real
all-MiniLM-L6-v2: geometry, per-head slices against independent slicing of the stored tensors,
and, for fused layouts, q/k/v per head against the family's own reshape (written here exactly as
its modeling code does it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from attnviz.compute.forward_pass.forward import LayerWeights, load_weights, read_ref
from attnviz.compute.splitting.split import make_report
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints
from attnviz.errors import LayoutError, UsageError
from attnviz.load.checkpoint import open_checkpoint
from attnviz.load.store import DictStore
from attnviz.recognize import claimed_keys, find_layers, select_layer
from attnviz.recognize.base import ref
from attnviz.recognize.packing import grouped

torch.set_num_threads(1)
SAMPLES = Path(__file__).resolve().parents[1] / "sample_weights"
_spec = importlib.util.spec_from_file_location("make_samples", SAMPLES / "make_samples.py")
samples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(samples)  # type: ignore[union-attr]

B, L = 2, 5


# ---------------------------------------------------------------------------------------------
# helpers


def inventory(path: Path | str, **hints: int):
    store = open_checkpoint(SAMPLES / path if isinstance(path, str) else path)
    return find_layers(store, HeadHints(**hints)), store


def by_name(layers: list[AttentionLayer]) -> dict[str, AttentionLayer]:
    return {layer.name: layer for layer in layers}


def stored(path: Path, key: str) -> torch.Tensor:
    """A tensor read by safetensors itself (or torch.load), not through attnviz, as float32."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        name = json.loads(index.read_text())["weight_map"][key] if index.exists() \
            else "model.safetensors"
        path = path / name
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)[key].float()
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key).float()


def x_for(width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, L, width, generator=torch.Generator().manual_seed(seed))


def head_q(layer: AttentionLayer, w: LayerWeights, x: torch.Tensor, h: int) -> torch.Tensor:
    """q of head h from attnviz's slices alone: (B, L, d)."""
    r0, r1 = layer.q_rows(h)
    return F.linear(x, w.W_q[r0:r1], None if w.b_q is None else w.b_q[r0:r1])


def head_kv(layer: AttentionLayer, w: LayerWeights, x: torch.Tensor,
            h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v that query head h attends with, from attnviz's slices: (B, L, d) each."""
    r0, r1 = layer.kv_rows(layer.kv_head_of(h))
    k = F.linear(x, w.W_k[r0:r1], None if w.b_k is None else w.b_k[r0:r1])
    v = F.linear(x, w.W_v[r0:r1], None if w.b_v is None else w.b_v[r0:r1])
    return k, v


def assert_heads_match(layer: AttentionLayer, store, x: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, H, L, d) and k, v (B, H, L, d) per query head, as the family computes them."""
    w = load_weights(layer, store)
    assert q.shape[1] == layer.num_heads and q.shape[-1] == layer.head_dim
    for h in range(layer.num_heads):
        torch.testing.assert_close(head_q(layer, w, x, h), q[:, h])
        k_h, v_h = head_kv(layer, w, x, h)
        torch.testing.assert_close(k_h, k[:, h])
        torch.testing.assert_close(v_h, v[:, h])


def assert_output_split(layer: AttentionLayer, store, merged_out: torch.Tensor) -> None:
    """W_o's head columns: Σ_h ctx_h · W_o[:, cols_h]ᵀ + b_o equals the family's out-projection
    of the merged context (B, L, H·d); checked by the caller against its own formula."""
    w = load_weights(layer, store)
    ctx = x_for(layer.q_out, seed=7)
    total = sum(ctx[..., slice(*layer.o_cols(h))] @ w.W_o[:, slice(*layer.o_cols(h))].T
                for h in range(layer.num_heads))
    if w.b_o is not None:
        total = total + w.b_o
    torch.testing.assert_close(total, merged_out(ctx))


def save_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    samples.write_folder(folder, config, tensors)
    return folder


# ---------------------------------------------------------------------------------------------
# every sample: geometry, families, nothing left unclassified

GEOMETRY = {  # name → {layer name: (family, E, kdim, H, H_kv, d)}
    "mha.safetensors": {"": ("torch-mha", 64, 64, 8, 8, 8)},
    "mha_kdim.pt": {"": ("torch-mha", 32, 16, None, None, None)},
    "transformer_encoder.pt": {f"layers.{i}.self_attn": ("torch-mha", 16, 16, None, None, None)
                               for i in range(2)},
    "transformer_decoder_layer.pt": {n: ("torch-mha", 16, 16, None, None, None)
                                     for n in ("self_attn", "multihead_attn")},
    "bert-tiny": {f"bert.encoder.layer.{i}.attention": ("bert", 16, 16, 4, 4, 4)
                  for i in range(2)},
    "vit-hf-tiny": {"vit.encoder.layer.0.attention": ("vit", 16, 16, 4, 4, 4)},
    "gpt2-tiny": {f"h.{i}.attn": ("gpt2", 16, 16, 4, 4, 4) for i in range(2)},
    "llama-gqa-tiny": {f"model.layers.{i}.self_attn": ("llama", 16, 16, 4, 2, 4)
                       for i in range(2)},
    "llama-sharded-tiny": {f"model.layers.{i}.self_attn": ("llama", 16, 16, 4, 4, 4)
                           for i in range(2)},
    "gemma-tiny": {"model.layers.0.self_attn": ("gemma2", 16, 16, 4, 2, 8)},
    "clip-tiny": {"text_model.encoder.layers.0.self_attn": ("clip", 8, 8, 2, 2, 4),
                  "vision_model.encoder.layers.0.self_attn": ("clip", 16, 16, 4, 4, 4)},
    "bart-tiny": {"model.encoder.layers.0.self_attn": ("bart", 16, 16, 4, 4, 4),
                  "model.decoder.layers.0.self_attn": ("bart", 16, 16, 2, 2, 8),
                  "model.decoder.layers.0.encoder_attn": ("bart", 16, 16, 2, 2, 8)},
    "timm-vit-tiny.safetensors": {f"blocks.{i}.attn": ("timm", 16, 16, 4, 4, 4)
                                  for i in range(2)},
    "neox-tiny": {"gpt_neox.layers.0.attention": ("gpt-neox", 16, 16, 2, 2, 8)},
    "bloom-tiny": {"h.0.self_attention": ("bloom", 16, 16, 4, 4, 4)},
    "falcon-tiny": {"transformer.h.0.self_attention": ("falcon", 16, 16, 4, 2, 4)},
    "t5-tiny": {"encoder.block.0.layer.0.SelfAttention": ("t5", 16, 16, 4, 4, 8),
                "decoder.block.0.layer.0.SelfAttention": ("t5", 16, 16, 4, 4, 8),
                "decoder.block.0.layer.1.EncDecAttention": ("t5", 16, 16, 4, 4, 8)},
}


@pytest.mark.parametrize("sample", sorted(GEOMETRY))
def test_sample_geometry(sample: str) -> None:
    inv, store = inventory(sample)
    found = {layer.name: (layer.family, layer.embed_dim, layer.kdim, layer.num_heads,
                          layer.num_kv_heads, layer.head_dim) for layer in inv.layers}
    assert found == GEOMETRY[sample]
    for layer in inv.layers:
        if layer.heads_known:
            assert layer.q_weight.shape == (layer.num_heads * layer.head_dim, layer.embed_dim)
            assert layer.k_weight.shape == (layer.num_kv_heads * layer.head_dim, layer.kdim)
            assert layer.v_weight.shape[0] == layer.num_kv_heads * layer.head_dim
            assert layer.o_weight.shape == (layer.embed_dim, layer.num_heads * layer.head_dim)
    assert inv.unclassified == []


@pytest.mark.parametrize("sample", sorted(n for n, g in GEOMETRY.items()
                                          if all(v[3] for v in g.values())))
def test_sample_per_head_proof(sample: str) -> None:
    """attnviz's own proof (torch MHA or SDPA against head-by-head) passes on every sample."""
    inv, store = inventory(sample)
    for layer in inv.layers:
        report, _ = make_report(layer, store)
        assert report.proof.passed, (layer.name, report.proof)


def test_samples_regenerate_identically(tmp_path: Path) -> None:
    """make_samples.py is deterministic and the committed files are what it writes."""
    samples.main(tmp_path)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written
    for rel in written:
        committed = SAMPLES / rel
        assert committed.exists(), rel
        if rel.suffix == ".pt":  # torch writes a random serialization id; compare tensors
            a, b = (torch.load(p, weights_only=True) for p in (committed, tmp_path / rel))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert committed.read_bytes() == (tmp_path / rel).read_bytes(), rel


def test_samples_are_small() -> None:
    """The layout samples stay under 600 KB and the loadable models (sample_weights/models/,
    written by make_models.py) under 500 KB: a clone stays light."""
    weights = [p for p in SAMPLES.rglob("*") if p.is_file() and p.suffix in (".pt", ".safetensors")
               and "induction" not in p.name]
    models = SAMPLES / "models"
    layouts = [p for p in weights if models not in p.parents]
    assert sum(p.stat().st_size for p in layouts) < 600_000
    assert 0 < sum(p.stat().st_size for p in weights if models in p.parents) < 500_000


def test_readme_lists_every_sample() -> None:
    text = (SAMPLES / "README.md").read_text()
    for name in GEOMETRY:
        assert f"`{name}" in text, name


# ---------------------------------------------------------------------------------------------
# files written by torch itself


def test_mha_safetensors_matches_torch() -> None:
    inv, store = inventory("mha.safetensors")
    (layer,) = inv.layers
    mha = torch.nn.MultiheadAttention(64, 8, batch_first=True).eval()
    with safe_open(str(SAMPLES / "mha.safetensors"), framework="pt") as f:
        mha.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
    w = load_weights(layer, store)
    x = x_for(64)
    with torch.no_grad():
        q = F.linear(x, mha.in_proj_weight[:64], mha.in_proj_bias[:64]).view(B, L, 8, 8)
        for h in range(8):
            torch.testing.assert_close(head_q(layer, w, x, h), q[:, :, h])
        torch.testing.assert_close(w.W_o, mha.out_proj.weight)


def test_mha_kdim_pt_needs_heads_and_keeps_kdim_vdim() -> None:
    inv, _ = inventory("mha_kdim.pt")
    assert not inv.layers[0].heads_known
    inv, store = inventory("mha_kdim.pt", num_heads=4)
    (layer,) = inv.layers
    assert (layer.embed_dim, layer.kdim, layer.vdim, layer.head_dim) == (32, 16, 24, 8)
    assert layer.k_weight.shape == (32, 16) and layer.v_weight.shape == (32, 24)
    state = torch.load(SAMPLES / "mha_kdim.pt", weights_only=True)
    w = load_weights(layer, store)
    torch.testing.assert_close(w.W_v, state["v_proj_weight"])
    torch.testing.assert_close(w.b_k, state["in_proj_bias"][32:64])


def test_transformer_encoder_heads_unknown_until_given(cli) -> None:
    inv, _ = inventory("transformer_encoder.pt")
    assert [layer.heads_known for layer in inv.layers] == [False, False]
    result = cli("inspect", SAMPLES / "transformer_encoder.pt", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["heads_known"] is False
    assert [layer["num_heads"] for layer in doc["layers"]] == [None, None]

    inv, store = inventory("transformer_encoder.pt", num_heads=4)
    encoder = samples.transformer_encoder()
    encoder.load_state_dict(torch.load(SAMPLES / "transformer_encoder.pt", weights_only=True))
    for i, layer in enumerate(inv.layers):
        attn = encoder.layers[i].self_attn
        torch.testing.assert_close(load_weights(layer, store).W_k, attn.in_proj_weight[16:32])


def test_transformer_decoder_layer_self_and_cross() -> None:
    inv, store = inventory("transformer_decoder_layer.pt", num_heads=2)
    state = torch.load(SAMPLES / "transformer_decoder_layer.pt", weights_only=True)
    for layer in inv.layers:
        assert layer.head_dim == 8
        w = load_weights(layer, store)
        torch.testing.assert_close(w.W_v, state[f"{layer.name}.in_proj_weight"][32:48])
        torch.testing.assert_close(w.W_o, state[f"{layer.name}.out_proj.weight"])


def test_cli_inspects_every_sample(cli) -> None:
    for sample in GEOMETRY:
        result = cli("inspect", SAMPLES / sample, "--json")
        assert result.exit_code == 0, (sample, result.output)
        assert len(json.loads(result.stdout)["layers"]) == len(GEOMETRY[sample])


# ---------------------------------------------------------------------------------------------
# BERT / HF ViT


@pytest.mark.parametrize("sample", ["bert-tiny", "vit-hf-tiny"])
def test_bert_heads_match_transpose_for_scores(sample: str) -> None:
    inv, store = inventory(sample)
    inner = "self" if sample == "bert-tiny" else "attention"
    x = x_for(16)
    for layer in inv.layers:
        H, d, p = layer.num_heads, layer.head_dim, f"{layer.name}.{inner}."

        def project(name: str, p: str = p, H: int = H, d: int = d) -> torch.Tensor:
            # BertSelfAttention: linear, then view(B, L, H, d).permute(0, 2, 1, 3)
            y = F.linear(x, stored(SAMPLES / sample, f"{p}{name}.weight"),
                         stored(SAMPLES / sample, f"{p}{name}.bias"))
            return y.view(B, L, H, d).permute(0, 2, 1, 3)

        assert_heads_match(layer, store, x, project("query"), project("key"), project("value"))
        o_w = stored(SAMPLES / sample, f"{layer.name}.output.dense.weight")
        o_b = stored(SAMPLES / sample, f"{layer.name}.output.dense.bias")
        assert_output_split(layer, store, lambda ctx, w=o_w, b=o_b: F.linear(ctx, w, b))
        assert (layer.positions, layer.causal, layer.scale) == ("learned", False, None)


def test_real_minilm(minilm: Path) -> None:
    inv, store = inventory(minilm)
    assert [layer.name for layer in inv.layers] == [f"encoder.layer.{i}.attention"
                                                    for i in range(6)]
    assert inv.unclassified == []
    for layer in inv.layers:
        assert (layer.family, layer.embed_dim, layer.num_heads, layer.num_kv_heads,
                layer.head_dim) == ("bert", 384, 12, 12, 32)
    layer = inv.layers[5]
    w = load_weights(layer, store)
    key = stored(minilm, "encoder.layer.5.attention.self.key.weight")
    for h in (0, 7, 11):
        r0, r1 = layer.kv_rows(h)
        torch.testing.assert_close(w.W_k[r0:r1], key[h * 32:(h + 1) * 32])
    report, _ = make_report(inv.layers[0], store)
    assert report.proof.passed


def test_bert_relative_positions_decoder_and_cross_attention() -> None:
    config, tensors = samples.bert(layers=1, prefix="")
    E = 16
    draw = samples.Draw(99)
    for name in ("query", "key", "value"):
        draw.linear(tensors, f"encoder.layer.0.crossattention.self.{name}", E, E)
    draw.linear(tensors, "encoder.layer.0.crossattention.output.dense", E, E)
    config.update(is_decoder=True, position_embedding_type="relative_key")
    layers = by_name(find_layers(DictStore(tensors, config=config)).layers)
    self_attn, cross = layers["encoder.layer.0.attention"], layers["encoder.layer.0.crossattention"]
    assert self_attn.causal and not cross.causal
    assert self_attn.positions == "relative bias"


def test_bert_config_disagreeing_with_shapes_names_the_tensor() -> None:
    config, tensors = samples.bert(layers=1)
    with pytest.raises(LayoutError, match=r"bert\.encoder\.layer\.0\.attention\.self\.query"):
        find_layers(DictStore(tensors, config={**config, "num_attention_heads": 3}))
    # head counts that divide E but disagree with the hints' head_dim: both shapes named
    with pytest.raises(LayoutError, match=r"query\.weight has shape \(16, 16\).*need 12 rows"):
        find_layers(DictStore(tensors, config=config), HeadHints(4, None, 3))


# ---------------------------------------------------------------------------------------------
# GPT-2 Conv1D


def test_gpt2_heads_match_conv1d_split() -> None:
    inv, store = inventory("gpt2-tiny")
    x, E, H, d = x_for(16), 16, 4, 4
    for layer in inv.layers:
        p = f"{layer.name}."
        W, b = (stored(SAMPLES / "gpt2-tiny", f"{p}c_attn.{n}") for n in ("weight", "bias"))
        # GPT2Attention: Conv1D is x @ W + b; split(E, dim=2); _split_heads view(B, L, H, d)
        q, k, v = (x @ W + b).split(E, dim=2)
        q, k, v = (t.view(B, L, H, d).permute(0, 2, 1, 3) for t in (q, k, v))
        assert_heads_match(layer, store, x, q, k, v)
        P, pb = (stored(SAMPLES / "gpt2-tiny", f"{p}c_proj.{n}") for n in ("weight", "bias"))
        assert_output_split(layer, store, lambda ctx, P=P, pb=pb: ctx @ P + pb)
        assert layer.q_weight.transposed and layer.o_weight.transposed
        assert (layer.causal, layer.positions) == (True, "learned")


def test_gpt2_buffers_are_not_biases() -> None:
    inv, store = inventory("gpt2-tiny")
    claimed = set().union(*(claimed_keys(layer) for layer in inv.layers))
    assert {"h.0.attn.bias", "h.0.attn.masked_bias", "h.1.attn.bias"}.isdisjoint(claimed)
    layer = inv.layers[0]
    assert (layer.q_bias.key, layer.o_bias.key) == ("h.0.attn.c_attn.bias", "h.0.attn.c_proj.bias")
    assert inv.unclassified == []


def test_gpt2_cross_attention_and_scaling_options() -> None:
    config, tensors = samples.gpt2(layers=2)
    E, draw = 16, samples.Draw(5)
    tensors["h.1.crossattention.c_attn.weight"] = draw(E, 2 * E)
    tensors["h.1.crossattention.c_attn.bias"] = draw(2 * E)
    tensors["h.1.crossattention.q_attn.weight"] = draw(E, E)
    tensors["h.1.crossattention.q_attn.bias"] = draw(E)
    tensors["h.1.crossattention.c_proj.weight"] = draw(E, E)
    store = DictStore(tensors, config={**config, "scale_attn_by_inverse_layer_idx": True})
    layers = by_name(find_layers(store).layers)
    cross = layers["h.1.crossattention"]
    x = x_for(E)
    k, v = (x @ tensors["h.1.crossattention.c_attn.weight"]
            + tensors["h.1.crossattention.c_attn.bias"]).split(E, dim=2)
    q = x @ tensors["h.1.crossattention.q_attn.weight"] + tensors["h.1.crossattention.q_attn.bias"]
    q, k, v = (t.view(B, L, 4, 4).permute(0, 2, 1, 3) for t in (q, k, v))
    assert_heads_match(cross, store, x, q, k, v)
    assert not cross.causal and cross.o_bias is None
    assert layers["h.1.attn"].scale == pytest.approx(1 / (2 * 2))  # 1/(√d · (layer_idx + 1))
    assert layers["h.0.attn"].scale == pytest.approx(1 / 2)
    unscaled = find_layers(DictStore(tensors, config={**config, "scale_attn_weights": False}))
    assert {layer.scale for layer in unscaled.layers} == {1.0}


def test_gpt2_linear_c_attn_without_config_is_refused() -> None:
    draw = samples.Draw(1)
    tensors = {"h.0.attn.c_attn.weight": draw(48, 16), "h.0.attn.c_proj.weight": draw(16, 16)}
    with pytest.raises(LayoutError, match=r"h\.0\.attn\.c_attn\.weight has shape \(48, 16\)"):
        find_layers(DictStore(tensors))


# ---------------------------------------------------------------------------------------------
# GPTBigCode


@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_matches_its_split(multi_query: bool) -> None:
    E, H, d, draw = 16, 4, 4, samples.Draw(8)
    kv_dim = d if multi_query else E
    tensors = {"transformer.h.0.attn.c_attn.weight": draw(E + 2 * kv_dim, E),
               "transformer.h.0.attn.c_attn.bias": draw(E + 2 * kv_dim),
               "transformer.h.0.attn.c_proj.weight": draw(E, E),
               "transformer.h.0.attn.bias": samples.causal_buffer(8, torch.bool)}
    config = {"model_type": "gpt_bigcode", "n_embd": E, "n_head": H, "multi_query": multi_query}
    store = DictStore(tensors, config=config)
    (layer,) = find_layers(store).layers
    x = x_for(E)
    y = F.linear(x, tensors["transformer.h.0.attn.c_attn.weight"],
                 tensors["transformer.h.0.attn.c_attn.bias"])
    if multi_query:  # GPTBigCodeAttention: split((E, 2·kv_dim)), key_value.split((d, d))
        query, key_value = y.split((E, 2 * kv_dim), dim=2)
        q = query.view(B, L, H, d).transpose(1, 2)
        k, v = (t[:, None].expand(B, H, L, d) for t in key_value.split((d, d), dim=-1))
    else:  # view(B, L, H, 3·d).transpose(1, 2).split((d, 2·d), dim=3)
        q, key_value = y.view(B, L, H, 3 * d).transpose(1, 2).split((d, 2 * d), dim=3)
        k, v = key_value.split((d, d), dim=-1)
    assert_heads_match(layer, store, x, q, k, v)
    assert layer.num_kv_heads == (1 if multi_query else H)
    with pytest.raises(LayoutError, match="c_attn.weight has shape"):
        find_layers(DictStore(tensors))  # without config.json the names read as GPT-2's
    no_heads = {k: v for k, v in config.items() if k != "n_head"}
    inv = find_layers(DictStore(tensors, config=no_heads))
    assert inv.layers == [] and inv.unclassified == []
    (item,) = inv.unresolved
    assert item.family == "gpt_bigcode" and "pass --num-heads" in item.fix
    (layer,) = find_layers(DictStore(tensors, config=no_heads), HeadHints(H)).layers
    assert_heads_match(layer, store, x, q, k, v)


# ---------------------------------------------------------------------------------------------
# q_proj / k_proj / v_proj families


def test_llama_gqa_matches_view_and_repeat_kv() -> None:
    inv, store = inventory("llama-gqa-tiny")
    x, d = x_for(16), 4
    for layer in inv.layers:
        p = f"{layer.name}."

        def project(name: str, p: str = p) -> torch.Tensor:
            # LlamaAttention: proj(x).view(B, L, -1, d).transpose(1, 2); repeat_kv for k/v
            W = stored(SAMPLES / "llama-gqa-tiny", f"{p}{name}.weight")
            return F.linear(x, W).view(B, L, -1, d).transpose(1, 2)

        k, v = (project(n).repeat_interleave(2, dim=1) for n in ("k_proj", "v_proj"))
        assert_heads_match(layer, store, x, project("q_proj"), k, v)
        assert [layer.kv_head_of(h) for h in range(4)] == [0, 0, 1, 1]
        assert (layer.positions, layer.causal, layer.scale) == ("rope", True, None)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in claimed_keys(inv.layers[0])


def test_gemma_explicit_head_dim_and_query_pre_attn_scalar() -> None:
    inv, store = inventory("gemma-tiny")
    (layer,) = inv.layers
    assert layer.q_weight.shape == (32, 16) and layer.o_weight.shape == (16, 32)
    assert not layer.is_square
    assert layer.scale == pytest.approx(16 ** -0.5) != layer.head_dim ** -0.5
    assert any("soft-capped" in note for note in layer.notes)
    x = x_for(16)
    q = F.linear(x, stored(SAMPLES / "gemma-tiny", "model.layers.0.self_attn.q_proj.weight"))
    k = F.linear(x, stored(SAMPLES / "gemma-tiny", "model.layers.0.self_attn.k_proj.weight"))
    v = F.linear(x, stored(SAMPLES / "gemma-tiny", "model.layers.0.self_attn.v_proj.weight"))
    q, k, v = (t.view(B, L, -1, 8).transpose(1, 2) for t in (q, k, v))
    assert_heads_match(layer, store, x, q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))


def test_sharded_llama_reads_one_layer_from_two_shards() -> None:
    folder = SAMPLES / "llama-sharded-tiny"
    inv, store = inventory("llama-sharded-tiny")
    layer = inv.layers[0]
    assert layer.q_weight.dtype == "BF16"
    w = load_weights(layer, store)
    assert store.opened_shards == ["model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors"]
    for ref_w, key in ((w.W_q, "q_proj"), (w.W_k, "k_proj"), (w.W_v, "v_proj"), (w.W_o, "o_proj")):
        torch.testing.assert_close(ref_w, stored(folder, f"model.layers.0.self_attn.{key}.weight"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {index[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj")}
    assert len(shards) == 2


def test_clip_towers_take_nested_head_counts() -> None:
    inv, store = inventory("clip-tiny")
    text, vision = inv.layers
    assert text.causal and not vision.causal
    for layer in inv.layers:
        w = load_weights(layer, store)
        key = stored(SAMPLES / "clip-tiny", f"{layer.name}.q_proj.weight")
        d = layer.head_dim
        for h in range(layer.num_heads):
            torch.testing.assert_close(w.W_q[slice(*layer.q_rows(h))], key[h * d:(h + 1) * d])
    inv, _ = inventory("clip-tiny", num_heads=1)  # the command line wins over config.json
    assert [layer.num_heads for layer in inv.layers] == [1, 1]


def test_clip_text_model_alone_is_causal() -> None:
    config, tensors = samples.clip()
    text = {k: t for k, t in tensors.items() if k.startswith("text_model.")}
    (layer,) = find_layers(DictStore(text, config=config["text_config"])).layers
    assert (layer.family, layer.num_heads, layer.causal) == ("clip", 2, True)


def test_bart_encoder_decoder_cross_heads() -> None:
    inv, store = inventory("bart-tiny")
    layers = by_name(inv.layers)
    cross = layers["model.decoder.layers.0.encoder_attn"]
    assert (cross.num_heads, cross.causal) == (2, False)
    assert layers["model.decoder.layers.0.self_attn"].causal
    assert not layers["model.encoder.layers.0.self_attn"].causal
    enc = by_name(find_layers(store).layers)["model.encoder.layers.0.self_attn"]
    x = x_for(16)
    q = F.linear(x, stored(SAMPLES / "bart-tiny", f"{enc.name}.q_proj.weight"),
                 stored(SAMPLES / "bart-tiny", f"{enc.name}.q_proj.bias"))
    w = load_weights(enc, store)
    for h in range(4):
        torch.testing.assert_close(head_q(enc, w, x, h), q.view(B, L, 4, 4)[:, :, h])


def test_qkv_proj_unknown_model_type_whisper_bias_and_qk_norm() -> None:
    config, tensors = samples.llama(layers=1, model_type="mystery")
    (layer,) = find_layers(DictStore(tensors, config=config)).layers
    assert layer.family == "qkv_proj" and layer.positions == "none" and not layer.causal
    assert any("'mystery' is not known" in note for note in layer.notes)
    (bare,) = find_layers(DictStore(tensors)).layers
    assert not bare.heads_known and any("no config.json" in n for n in bare.notes)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(4)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(16)
    (qwen3,) = find_layers(DictStore(tensors, config={**config, "model_type": "qwen3"})).layers
    assert qwen3.q_bias is not None and qwen3.k_bias is None
    assert any("q_norm" in note for note in qwen3.notes)


def test_gemma3_nested_text_config() -> None:
    config, tensors = samples.llama(layers=1, model_type="gemma3_text", d=8)
    tensors = {k.replace("model.", "language_model.model.", 1): t for k, t in tensors.items()}
    nested = {**config, "query_pre_attn_scalar": 64}
    store = DictStore(tensors, config={"model_type": "gemma3", "text_config": nested})
    (layer,) = find_layers(store).layers
    assert (layer.family, layer.num_heads, layer.num_kv_heads, layer.head_dim) == \
        ("gemma3", 4, 2, 8)
    assert layer.scale == pytest.approx(1 / 8)


def test_gqa_config_disagreeing_with_k_proj_names_it() -> None:
    config, tensors = samples.llama(layers=1)
    with pytest.raises(LayoutError, match=r"k_proj\.weight has shape \(8, 16\).*need 12 rows"):
        find_layers(DictStore(tensors, config={**config, "num_key_value_heads": 3}))


# ---------------------------------------------------------------------------------------------
# timm fused qkv


def test_timm_qkv_matches_reshape_permute() -> None:
    inv, store = inventory("timm-vit-tiny.safetensors")
    path, x, H, d = SAMPLES / "timm-vit-tiny.safetensors", x_for(16), 4, 4
    for layer in inv.layers:
        W, b = (stored(path, f"{layer.name}.qkv.{n}") for n in ("weight", "bias"))
        # timm Attention: qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4); q, k, v = unbind
        q, k, v = F.linear(x, W, b).reshape(B, L, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
        assert_heads_match(layer, store, x, q, k, v)
        P, pb = (stored(path, f"{layer.name}.proj.{n}") for n in ("weight", "bias"))
        assert_output_split(layer, store, lambda ctx, P=P, pb=pb: F.linear(ctx, P, pb))


def test_timm_heads_only_from_hints_or_metadata() -> None:
    _, tensors = samples.timm_vit()
    tensors["blocks.0.attn.q_norm.weight"] = torch.ones(4)
    layers = find_layers(DictStore(tensors, config={"num_attention_heads": 8})).layers
    assert not any(layer.heads_known for layer in layers)  # a config.json is not timm's
    assert any("--num-heads" in note for note in layers[0].notes)
    layers = find_layers(DictStore(tensors), HeadHints(2)).layers
    assert [layer.head_dim for layer in layers] == [8, 8]
    assert any("q_norm" in note for note in layers[0].notes)


def test_beit_q_and_v_biases() -> None:
    _, tensors = samples.timm_vit(depth=1)
    tensors["blocks.0.attn.q_bias"] = tensors.pop("blocks.0.attn.qkv.bias")[:16].clone()
    tensors["blocks.0.attn.v_bias"] = torch.ones(16)
    (layer,) = find_layers(DictStore(tensors), HeadHints(4)).layers
    assert (layer.q_bias.key, layer.k_bias, layer.v_bias.key) == \
        ("blocks.0.attn.q_bias", None, "blocks.0.attn.v_bias")


# ---------------------------------------------------------------------------------------------
# GPT-NeoX, BLOOM, Falcon


def test_neox_matches_view_h_3d() -> None:
    inv, store = inventory("neox-tiny")
    (layer,) = inv.layers
    x, H, d, p = x_for(16), 2, 8, "gpt_neox.layers.0.attention."
    W, b = (stored(SAMPLES / "neox-tiny", f"{p}query_key_value.{n}") for n in ("weight", "bias"))
    # GPTNeoXAttention: qkv.view(B, L, H, 3·d); q, k, v = split(d, dim=-1)
    q, k, v = F.linear(x, W, b).view(B, L, H, 3 * d).transpose(1, 2).split(d, dim=-1)
    assert_heads_match(layer, store, x, q, k, v)
    assert layer.q_weight.row_ranges == ((0, 8), (24, 32))
    assert layer.positions == "rope (partial, 25%)" and layer.causal
    o_w, o_b = (stored(SAMPLES / "neox-tiny", f"{p}dense.{n}") for n in ("weight", "bias"))
    assert_output_split(layer, store, lambda ctx: F.linear(ctx, o_w, o_b))


def test_neox_buffers_are_not_biases() -> None:
    inv, _ = inventory("neox-tiny")
    p = "gpt_neox.layers.0.attention."
    claimed = claimed_keys(inv.layers[0])
    assert {f"{p}bias", f"{p}masked_bias", f"{p}rotary_emb.inv_freq"}.isdisjoint(claimed)
    assert inv.layers[0].o_bias.key == f"{p}dense.bias"
    assert inv.unclassified == []


def test_neox_without_config_needs_heads() -> None:
    """Without a head count, W_q's rows cannot be located: the layer is listed as unresolved
    (claiming its tensors, so they are not 'unclassified'), never guessed."""
    _, tensors = samples.neox()
    inv = find_layers(DictStore(tensors))
    (item,) = inv.unresolved
    assert inv.layers == [] and inv.unclassified == []
    assert (item.name, item.family) == ("gpt_neox.layers.0.attention", "gpt-neox")
    assert set(item.keys) == {f"gpt_neox.layers.0.attention.{k}" for k in (
        "query_key_value.weight", "query_key_value.bias", "dense.weight", "dense.bias")}
    assert "number of heads" in item.reason and "pass --num-heads" in item.fix
    with pytest.raises(UsageError, match="number of heads") as err:
        select_layer(inv, None, "x")
    assert "pass --num-heads" in err.value.one_line()
    (layer,) = find_layers(DictStore(tensors), HeadHints(2)).layers
    assert layer.head_dim == 8 and any("no config.json" in note for note in layer.notes)


def test_bloom_matches_view_h_3_d() -> None:
    inv, store = inventory("bloom-tiny")
    (layer,) = inv.layers
    x, H, d = x_for(16), 4, 4
    W, b = (stored(SAMPLES / "bloom-tiny", f"h.0.self_attention.query_key_value.{n}")
            for n in ("weight", "bias"))
    # BloomAttention._reshape: view(B, L, H, 3, d); q, k, v = [..., 0, :], [..., 1, :], …
    fused = F.linear(x, W, b).view(B, L, H, 3, d)
    q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
    assert_heads_match(layer, store, x, q, k, v)
    assert (layer.positions, layer.causal) == ("alibi", True)


def falcon_split(fused: torch.Tensor, H: int, H_kv: int, d: int, layout: str):
    """FalconAttention._split_heads, verbatim in effect; returns (B, H, L, d) each."""
    batch, seq_len, _ = fused.shape
    if layout == "grouped":  # new_decoder_architecture
        qkv = fused.view(batch, seq_len, -1, H // H_kv + 2, d)
        query = qkv[:, :, :, :-2]
        key = torch.broadcast_to(qkv[:, :, :, [-2]], query.shape)
        value = torch.broadcast_to(qkv[:, :, :, [-1]], query.shape)
        query, key, value = (t.flatten(2, 3) for t in (query, key, value))
    elif layout == "interleaved":  # not multi_query
        qkv = fused.view(batch, seq_len, H, 3, d)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:  # multi_query
        qkv = fused.view(batch, seq_len, H + 2, d)
        query, key, value = qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]
        key, value = key.expand(-1, -1, H, -1), value.expand(-1, -1, H, -1)
    return tuple(t.transpose(1, 2) for t in (query, key, value))


@pytest.mark.parametrize("layout,H_kv", [("grouped", 2), ("grouped", 1), ("multi_query", 1),
                                          ("interleaved", 4)])
def test_falcon_layouts_match_split_heads(tmp_path: Path, layout: str, H_kv: int) -> None:
    if (layout, H_kv) == ("grouped", 2):
        folder = SAMPLES / "falcon-tiny"
    else:
        folder = save_folder(tmp_path / "falcon", *samples.falcon(layout=layout, H_kv=H_kv,
                                                                  alibi=layout == "interleaved"))
    inv, store = inventory(folder)
    (layer,) = inv.layers
    assert layer.num_kv_heads == H_kv
    x, key = x_for(16), "transformer.h.0.self_attention.query_key_value"
    bias = stored(folder, f"{key}.bias") if layout == "interleaved" else None
    fused = F.linear(x, stored(folder, f"{key}.weight"), bias)
    assert_heads_match(layer, store, x, *falcon_split(fused, 4, H_kv, 4, layout))
    assert layer.positions == ("alibi" if layout == "interleaved" else "rope")


def test_falcon_layout_comes_from_config_not_shapes() -> None:
    config, tensors = samples.falcon(layout="multi_query")
    assert config["num_kv_heads"] == 4  # FalconConfig writes it even for multi-query models
    (layer,) = find_layers(DictStore(tensors, config=config)).layers
    assert layer.num_kv_heads == 1
    # A grouped config naming the wrong num_kv_heads: the fused tensor is named, with its shape.
    wrong = {**config, "new_decoder_architecture": True, "num_kv_heads": 2}
    with pytest.raises(LayoutError, match=r"query_key_value\.weight has shape \(24, 16\).*32 rows"):
        find_layers(DictStore(tensors, config=wrong))
    # BLOOM and Falcon share key names: without config.json nothing is guessed; the module is
    # listed as unresolved, saying what would tell them apart.
    bare = find_layers(DictStore(tensors))
    assert bare.layers == [] and bare.unclassified == []
    (item,) = bare.unresolved
    assert (item.name, item.family) == ("transformer.h.0.self_attention", "bloom or falcon")
    assert "config.json" in item.fix


def test_legacy_refinedweb_config_is_grouped() -> None:
    config, tensors = samples.falcon(layout="grouped", H_kv=2)
    legacy = {"model_type": "RefinedWeb", "n_head": 4, "n_head_kv": 2, "hidden_size": 16}
    (layer,) = find_layers(DictStore(tensors, config=legacy)).layers
    assert (layer.num_heads, layer.num_kv_heads, layer.family) == (4, 2, "falcon")


@pytest.mark.parametrize("H,H_kv,d", [(4, 4, 3), (6, 2, 2), (8, 1, 4), (5, 5, 1)])
def test_grouped_rows_partition_the_fused_tensor(H: int, H_kv: int, d: int) -> None:
    rows = (H + 2 * H_kv) * d
    store = DictStore({"w": torch.arange(rows, dtype=torch.float32)[:, None].repeat(1, 3)})
    q, k, v = grouped(ref(store, "w"), H, H_kv, d, "test", "")
    taken = torch.cat([read_ref(store, r)[:, 0] for r in (q, k, v)])
    assert sorted(taken.long().tolist()) == list(range(rows))
    assert (q.shape[0], k.shape[0], v.shape[0]) == (H * d, H_kv * d, H_kv * d)


# ---------------------------------------------------------------------------------------------
# T5


def test_t5_matches_view_and_has_no_scaling() -> None:
    inv, store = inventory("t5-tiny")
    layers = by_name(inv.layers)
    x, H, d_kv = x_for(16), 4, 8
    for layer in inv.layers:
        q, k, v = (F.linear(x, stored(SAMPLES / "t5-tiny", f"{layer.name}.{n}.weight"))
                   .view(B, -1, H, d_kv).transpose(1, 2) for n in "qkv")
        assert_heads_match(layer, store, x, q, k, v)
        assert layer.scale == 1.0 and layer.q_out == 32 != layer.embed_dim
        assert layer.q_bias is None and layer.o_bias is None
    assert layers["decoder.block.0.layer.0.SelfAttention"].causal
    assert not layers["encoder.block.0.layer.0.SelfAttention"].causal
    cross = layers["decoder.block.0.layer.1.EncDecAttention"]
    assert (cross.causal, cross.positions) == (False, "none")
    assert layers["encoder.block.0.layer.0.SelfAttention"].positions == "relative bias"


def test_t5_later_blocks_note_the_shared_bias() -> None:
    config, tensors = samples.t5()
    for key in [k for k in tensors if k.startswith("encoder.block.0.layer.0.SelfAttention")]:
        tensors[key.replace("block.0", "block.1")] = tensors[key]
    del tensors["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"]
    layers = by_name(find_layers(DictStore(tensors, config=config)).layers)
    assert any("first block" in n for n in layers["encoder.block.1.layer.0.SelfAttention"].notes)
    assert not layers["encoder.block.0.layer.0.SelfAttention"].notes


def test_written_checkpoints_round_trip(tmp_path: Path) -> None:
    """A safetensors folder written here, with a `transformer.` prefix GPT-2 hub files lack."""
    config, tensors = samples.gpt2(layers=1)
    tensors = {f"transformer.{k}": t for k, t in tensors.items()}
    folder = save_folder(tmp_path / "gpt2", config, tensors)
    inv, store = inventory(folder)
    assert [layer.name for layer in inv.layers] == ["transformer.h.0.attn"]
    torch.testing.assert_close(read_ref(store, inv.layers[0].k_weight),
                               tensors["transformer.h.0.attn.c_attn.weight"][:, 16:32].T)
    save_file({"blocks.0.attn.qkv.weight": torch.zeros(30, 8),
               "blocks.0.attn.proj.weight": torch.zeros(8, 10)}, str(tmp_path / "odd.safetensors"),
              metadata={"num_heads": "2"})
    inv, _ = inventory(tmp_path / "odd.safetensors")  # timm attn_head_dim: H·d = 10 ≠ E = 8
    assert (inv.layers[0].head_dim, inv.layers[0].q_out) == (5, 10)
