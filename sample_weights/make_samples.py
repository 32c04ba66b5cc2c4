"""Write tiny, seeded checkpoints of every attention layout attnviz recognizes.

    python sample_weights/make_samples.py [OUT_DIR]     # default: this folder

Each sample gets its own seed, so the tensors are identical on every run (torch's .pt files carry a
random serialization id, so their bytes differ; their tensors do not). Key names, shapes, buffers
and config.json fields follow the real models (transformers' modeling code, torch.nn, timm), with
a few non-attention tensors (embeddings, MLP, norms) so that recognition is realistic. The
builder functions are importable, so tests can write other variants (e.g. Falcon's other layouts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

HERE = Path(__file__).resolve().parent
Tensors = dict[str, torch.Tensor]
Config = dict[str, Any]


class Draw:
    """Seeded N(0, 0.1²) tensors: small like trained weights, never all-zero biases."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=self.gen)

    def linear(self, out: dict, key: str, rows: int, cols: int, bias: bool = True) -> None:
        out[f"{key}.weight"] = self(rows, cols)
        if bias:
            out[f"{key}.bias"] = self(rows)

    def norm(self, out: dict, key: str, width: int, bias: bool = True) -> None:
        out[f"{key}.weight"] = 1.0 + self(width)
        if bias:
            out[f"{key}.bias"] = self(width)


def causal_buffer(length: int, dtype: torch.dtype) -> torch.Tensor:
    """GPT-2's / GPT-NeoX's `attn.bias` buffer: a (1, 1, P, P) lower-triangular mask."""
    return torch.tril(torch.ones(length, length, dtype=dtype)).view(1, 1, length, length)


# ---------------------------------------------------------------------------------------------
# torch.nn modules, saved by torch itself


def _randomize_biases(module: nn.Module, seed: int) -> nn.Module:
    """torch starts biases at zero; give them values so per-head bias slices are checkable."""
    draw = Draw(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias") or name.endswith("bias_k") or name.endswith("bias_v"):
                param.copy_(draw(*param.shape))
    return module


def mha(seed: int = 0, **kwargs: Any) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    embed_dim, num_heads = kwargs.pop("embed_dim", 64), kwargs.pop("num_heads", 8)
    return _randomize_biases(nn.MultiheadAttention(embed_dim, num_heads, **kwargs), seed)


def transformer_encoder(seed: int = 2) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    # TransformerEncoder deep-copies one layer; draw each anew so the two layers differ.
    encoder.layers = nn.ModuleList(
        nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True) for _ in range(2))
    return _randomize_biases(encoder, seed)


def transformer_decoder_layer(seed: int = 3) -> nn.TransformerDecoderLayer:
    torch.manual_seed(seed)
    layer = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    return _randomize_biases(layer, seed)


# ---------------------------------------------------------------------------------------------
# Hugging Face families: (config, tensors)


def bert(seed: int = 10, E: int = 16, H: int = 4, layers: int = 2, prefix: str = "bert.",
         inner: str = "self") -> tuple[Config, Tensors]:
    """BertModel (prefix "bert.") or, with inner="attention", HF ViT's attention naming."""
    draw, t, ff, vit = Draw(seed), {}, 2 * E, inner == "attention"
    if vit:
        t[f"{prefix}embeddings.cls_token"] = draw(1, 1, E)
        t[f"{prefix}embeddings.position_embeddings"] = draw(1, 5, E)
        draw.linear(t, f"{prefix}embeddings.patch_embeddings.projection", E, 3 * 4 * 4)
    else:
        t[f"{prefix}embeddings.word_embeddings.weight"] = draw(32, E)
        t[f"{prefix}embeddings.position_embeddings.weight"] = draw(16, E)
        draw.norm(t, f"{prefix}embeddings.LayerNorm", E)
    for i in range(layers):
        p = f"{prefix}encoder.layer.{i}."
        if vit:
            draw.norm(t, f"{p}layernorm_before", E)
        for name in ("query", "key", "value"):
            draw.linear(t, f"{p}attention.{inner}.{name}", E, E)
        draw.linear(t, f"{p}attention.output.dense", E, E)
        draw.norm(t, f"{p}layernorm_after" if vit else f"{p}attention.output.LayerNorm", E)
        draw.linear(t, f"{p}intermediate.dense", ff, E)
        draw.linear(t, f"{p}output.dense", E, ff)
        if not vit:
            draw.norm(t, f"{p}output.LayerNorm", E)
    config = {"model_type": "vit" if vit else "bert", "hidden_size": E,
              "num_attention_heads": H, "num_hidden_layers": layers, "intermediate_size": ff}
    if not vit:
        config.update(position_embedding_type="absolute", vocab_size=32)
    return config, t


def gpt2(seed: int = 11, E: int = 16, H: int = 4, layers: int = 2,
         positions: int = 8) -> tuple[Config, Tensors]:
    """GPT2Model as on the hub (bare `h.N…` keys), with the attn.bias/masked_bias buffers."""
    draw, t = Draw(seed), {}
    t["wte.weight"], t["wpe.weight"] = draw(32, E), draw(positions, E)
    for i in range(layers):
        p = f"h.{i}."
        draw.norm(t, f"{p}ln_1", E)
        t[f"{p}attn.c_attn.weight"], t[f"{p}attn.c_attn.bias"] = draw(E, 3 * E), draw(3 * E)
        t[f"{p}attn.c_proj.weight"], t[f"{p}attn.c_proj.bias"] = draw(E, E), draw(E)
        t[f"{p}attn.bias"] = causal_buffer(positions, torch.float32)
        t[f"{p}attn.masked_bias"] = torch.tensor(-1e4)
        draw.norm(t, f"{p}ln_2", E)
        t[f"{p}mlp.c_fc.weight"], t[f"{p}mlp.c_fc.bias"] = draw(E, 2 * E), draw(2 * E)
        t[f"{p}mlp.c_proj.weight"], t[f"{p}mlp.c_proj.bias"] = draw(2 * E, E), draw(E)
    draw.norm(t, "ln_f", E)
    config = {"model_type": "gpt2", "n_embd": E, "n_head": H, "n_layer": layers,
              "n_positions": positions, "vocab_size": 32}
    return config, t


def llama(seed: int = 12, E: int = 16, H: int = 4, H_kv: int = 2, d: int | None = None,
          layers: int = 2, model_type: str = "llama", **extra: Any) -> tuple[Config, Tensors]:
    """LlamaForCausalLM-style keys; Gemma/Qwen/Mistral share them (d may make H·d ≠ E)."""
    draw, t, d = Draw(seed), {}, d or E // H
    t["model.embed_tokens.weight"] = draw(32, E)
    for i in range(layers):
        p = f"model.layers.{i}."
        draw.norm(t, f"{p}input_layernorm", E, bias=False)
        draw.linear(t, f"{p}self_attn.q_proj", H * d, E, bias=False)
        draw.linear(t, f"{p}self_attn.k_proj", H_kv * d, E, bias=False)
        draw.linear(t, f"{p}self_attn.v_proj", H_kv * d, E, bias=False)
        draw.linear(t, f"{p}self_attn.o_proj", E, H * d, bias=False)
        if i == 0 and model_type == "llama":  # early conversions saved this buffer
            t[f"{p}self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
        draw.norm(t, f"{p}post_attention_layernorm", E, bias=False)
        for name, rows, cols in (("gate_proj", 2 * E, E), ("up_proj", 2 * E, E),
                                 ("down_proj", E, 2 * E)):
            draw.linear(t, f"{p}mlp.{name}", rows, cols, bias=False)
    draw.norm(t, "model.norm", E, bias=False)
    t["lm_head.weight"] = draw(32, E)
    config = {"model_type": model_type, "hidden_size": E, "num_attention_heads": H,
              "num_key_value_heads": H_kv, "num_hidden_layers": layers,
              "intermediate_size": 2 * E, "rope_theta": 10000.0, "vocab_size": 32, **extra}
    if d != E // H:
        config["head_dim"] = d
    return config, t


def gemma2(seed: int = 13) -> tuple[Config, Tensors]:
    """Gemma 2 with head_dim 8: H·d = 32 ≠ E = 16, and query_pre_attn_scalar 16 ≠ d."""
    config, t = llama(seed, E=16, H=4, H_kv=2, d=8, layers=1, model_type="gemma2",
                      query_pre_attn_scalar=16, attn_logit_softcapping=50.0, sliding_window=8)
    draw = Draw(seed + 1000)
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
        draw.norm(t, f"model.layers.0.{name}", 16, bias=False)
    del t["lm_head.weight"]  # Gemma ties the output embedding
    return config, t


def neox(seed: int = 14, E: int = 16, H: int = 2, positions: int = 8) -> tuple[Config, Tensors]:
    """GPTNeoXForCausalLM, one layer, with the buffers old checkpoints carry."""
    draw, t, d = Draw(seed), {}, E // H
    p = "gpt_neox.layers.0."
    t["gpt_neox.embed_in.weight"] = draw(32, E)
    draw.norm(t, f"{p}input_layernorm", E)
    draw.linear(t, f"{p}attention.query_key_value", 3 * E, E)
    draw.linear(t, f"{p}attention.dense", E, E)
    t[f"{p}attention.bias"] = causal_buffer(positions, torch.bool)
    t[f"{p}attention.masked_bias"] = torch.tensor(-1e9)
    rotary = int(d * 0.25)
    t[f"{p}attention.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, rotary, 2) / rotary)
    draw.norm(t, f"{p}post_attention_layernorm", E)
    draw.linear(t, f"{p}mlp.dense_h_to_4h", 2 * E, E)
    draw.linear(t, f"{p}mlp.dense_4h_to_h", E, 2 * E)
    draw.norm(t, "gpt_neox.final_layer_norm", E)
    t["embed_out.weight"] = draw(32, E)
    config = {"model_type": "gpt_neox", "hidden_size": E, "num_attention_heads": H,
              "num_hidden_layers": 1, "rotary_pct": 0.25, "rotary_emb_base": 10000,
              "max_position_embeddings": positions, "vocab_size": 32}
    return config, t


def falcon(seed: int = 15, E: int = 16, H: int = 4, H_kv: int = 2, layout: str = "grouped",
           alibi: bool = False) -> tuple[Config, Tensors]:
    """FalconForCausalLM, one layer; layout "grouped" (new_decoder_architecture),
    "multi_query" or "interleaved" (neither)."""
    draw, t, d = Draw(seed), {}, E // H
    rows = {"grouped": (H + 2 * H_kv) * d, "multi_query": E + 2 * d, "interleaved": 3 * E}[layout]
    p = "transformer.h.0."
    t["transformer.word_embeddings.weight"] = draw(32, E)
    draw.norm(t, f"{p}ln_attn" if layout == "grouped" else f"{p}input_layernorm", E)
    if layout == "grouped":
        draw.norm(t, f"{p}ln_mlp", E)
    draw.linear(t, f"{p}self_attention.query_key_value", rows, E, bias=alibi)
    draw.linear(t, f"{p}self_attention.dense", E, E, bias=alibi)
    draw.linear(t, f"{p}mlp.dense_h_to_4h", 2 * E, E, bias=False)
    draw.linear(t, f"{p}mlp.dense_4h_to_h", E, 2 * E, bias=False)
    draw.norm(t, "transformer.ln_f", E)
    config = {"model_type": "falcon", "hidden_size": E, "num_attention_heads": H,
              "num_kv_heads": H_kv if layout == "grouped" else H, "num_hidden_layers": 1,
              "new_decoder_architecture": layout == "grouped",
              "multi_query": layout == "multi_query", "alibi": alibi, "bias": alibi,
              "parallel_attn": True, "vocab_size": 32}
    return config, t


def bloom(seed: int = 16, E: int = 16, H: int = 4) -> tuple[Config, Tensors]:
    """BloomModel as commonly saved (bare `h.N…` keys)."""
    draw, t = Draw(seed), {}
    t["word_embeddings.weight"] = draw(32, E)
    draw.norm(t, "word_embeddings_layernorm", E)
    draw.norm(t, "h.0.input_layernorm", E)
    draw.linear(t, "h.0.self_attention.query_key_value", 3 * E, E)
    draw.linear(t, "h.0.self_attention.dense", E, E)
    draw.norm(t, "h.0.post_attention_layernorm", E)
    draw.linear(t, "h.0.mlp.dense_h_to_4h", 2 * E, E)
    draw.linear(t, "h.0.mlp.dense_4h_to_h", E, 2 * E)
    draw.norm(t, "ln_f", E)
    config = {"model_type": "bloom", "hidden_size": E, "n_head": H, "n_layer": 1,
              "vocab_size": 32}
    return config, t


def t5(seed: int = 17, E: int = 16, H: int = 4, d_kv: int = 8) -> tuple[Config, Tensors]:
    """T5Model with one encoder and one decoder block; H·d_kv = 32 ≠ d_model = 16."""
    draw, t, inner, buckets = Draw(seed), {}, H * d_kv, 32
    t["shared.weight"] = draw(32, E)

    def attention(p: str, relative: bool) -> None:
        for name, rows, cols in (("q", inner, E), ("k", inner, E), ("v", inner, E),
                                 ("o", E, inner)):
            draw.linear(t, f"{p}{name}", rows, cols, bias=False)
        if relative:
            t[f"{p}relative_attention_bias.weight"] = draw(buckets, H)

    for side in ("encoder", "decoder"):
        b = f"{side}.block.0.layer."
        attention(f"{b}0.SelfAttention.", relative=True)
        draw.norm(t, f"{b}0.layer_norm", E, bias=False)
        ff = 1
        if side == "decoder":
            attention(f"{b}1.EncDecAttention.", relative=False)
            draw.norm(t, f"{b}1.layer_norm", E, bias=False)
            ff = 2
        draw.linear(t, f"{b}{ff}.DenseReluDense.wi", 2 * E, E, bias=False)
        draw.linear(t, f"{b}{ff}.DenseReluDense.wo", E, 2 * E, bias=False)
        draw.norm(t, f"{b}{ff}.layer_norm", E, bias=False)
        draw.norm(t, f"{side}.final_layer_norm", E, bias=False)
    config = {"model_type": "t5", "d_model": E, "d_kv": d_kv, "num_heads": H, "num_layers": 1,
              "num_decoder_layers": 1, "d_ff": 2 * E, "relative_attention_num_buckets": buckets,
              "vocab_size": 32, "is_encoder_decoder": True}
    return config, t


def timm_vit(seed: int = 18, E: int = 16, H: int = 4, depth: int = 2,
             patch: int = 4) -> tuple[dict[str, str], Tensors]:
    """timm VisionTransformer state dict (img 8, patch 4 → 4 patches + cls); metadata heads."""
    draw, t = Draw(seed), {}
    t["cls_token"], t["pos_embed"] = draw(1, 1, E), draw(1, 5, E)
    t["patch_embed.proj.weight"], t["patch_embed.proj.bias"] = draw(E, 3, patch, patch), draw(E)
    for i in range(depth):
        p = f"blocks.{i}."
        draw.norm(t, f"{p}norm1", E)
        draw.linear(t, f"{p}attn.qkv", 3 * E, E)
        draw.linear(t, f"{p}attn.proj", E, E)
        draw.norm(t, f"{p}norm2", E)
        draw.linear(t, f"{p}mlp.fc1", 2 * E, E)
        draw.linear(t, f"{p}mlp.fc2", E, 2 * E)
    draw.norm(t, "norm", E)
    draw.linear(t, "head", 10, E)
    return {"num_heads": str(H)}, t


def clip(seed: int = 19) -> tuple[Config, Tensors]:
    """CLIPModel with nested configs: text tower E=8 H=2 (causal), vision E=16 H=4."""
    draw, t = Draw(seed), {}
    towers = {"text_model": (8, 2), "vision_model": (16, 4)}
    t["text_model.embeddings.token_embedding.weight"] = draw(32, 8)
    t["text_model.embeddings.position_embedding.weight"] = draw(8, 8)
    t["vision_model.embeddings.class_embedding"] = draw(16)
    t["vision_model.embeddings.position_embedding.weight"] = draw(5, 16)
    for tower, (E, _) in towers.items():
        p = f"{tower}.encoder.layers.0."
        draw.norm(t, f"{p}layer_norm1", E)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            draw.linear(t, f"{p}self_attn.{name}", E, E)
        draw.norm(t, f"{p}layer_norm2", E)
        draw.linear(t, f"{p}mlp.fc1", 2 * E, E)
        draw.linear(t, f"{p}mlp.fc2", E, 2 * E)
    t["text_projection.weight"], t["visual_projection.weight"] = draw(8, 8), draw(8, 16)
    config = {"model_type": "clip", "projection_dim": 8,
              "text_config": {"model_type": "clip_text_model", "hidden_size": 8,
                              "num_attention_heads": 2, "num_hidden_layers": 1},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16,
                                "num_attention_heads": 4, "num_hidden_layers": 1,
                                "image_size": 8, "patch_size": 4}}
    return config, t


def bart(seed: int = 20, E: int = 16) -> tuple[Config, Tensors]:
    """BartModel, one encoder and one decoder layer, 4 encoder heads and 2 decoder heads."""
    draw, t = Draw(seed), {}
    t["model.shared.weight"] = draw(32, E)
    for side, modules in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        t[f"model.{side}.embed_positions.weight"] = draw(10, E)
        p = f"model.{side}.layers.0."
        for module in modules:
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                draw.linear(t, f"{p}{module}.{name}", E, E)
            draw.norm(t, f"{p}{module}_layer_norm", E)
        draw.linear(t, f"{p}fc1", 2 * E, E)
        draw.linear(t, f"{p}fc2", E, 2 * E)
        draw.norm(t, f"{p}final_layer_norm", E)
    config = {"model_type": "bart", "d_model": E, "encoder_attention_heads": 4,
              "decoder_attention_heads": 2, "encoder_layers": 1, "decoder_layers": 1,
              "vocab_size": 32, "is_encoder_decoder": True}
    return config, t


# ---------------------------------------------------------------------------------------------
# writing


def write_folder(folder: Path, config: Config, tensors: Tensors) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_contiguous(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_sharded(folder: Path, config: Config, tensors: Tensors,
                  second_shard: set[str]) -> None:
    """An HF sharded folder: the keys in `second_shard` go to shard 2, the rest to shard 1."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    shards: tuple[Tensors, Tensors] = ({}, {})
    for key, tensor in tensors.items():
        shards[key in second_shard][key] = tensor
    for name, shard in zip(names, shards, strict=True):
        save_file(_contiguous(shard), str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": {key: names[key in second_shard] for key in sorted(tensors)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _contiguous(tensors: Tensors) -> Tensors:
    return {key: tensor.contiguous() for key, tensor in tensors.items()}


def main(out: Path = HERE) -> None:
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    save_file(_contiguous(mha(0).state_dict()), str(out / "mha.safetensors"),
              metadata={"num_heads": "8"})
    torch.save(mha(1, embed_dim=32, num_heads=4, kdim=16, vdim=24).state_dict(),
               out / "mha_kdim.pt")
    torch.save(transformer_encoder().state_dict(), out / "transformer_encoder.pt")
    torch.save(transformer_decoder_layer().state_dict(), out / "transformer_decoder_layer.pt")
    for name, (config, tensors) in {
        "bert-tiny": bert(), "vit-hf-tiny": bert(21, prefix="vit.", inner="attention", layers=1),
        "gpt2-tiny": gpt2(), "llama-gqa-tiny": llama(), "gemma-tiny": gemma2(),
        "neox-tiny": neox(), "falcon-tiny": falcon(), "bloom-tiny": bloom(), "t5-tiny": t5(),
        "clip-tiny": clip(), "bart-tiny": bart(),
    }.items():
        write_folder(out / name, config, tensors)
    metadata, tensors = timm_vit()
    save_file(_contiguous(tensors), str(out / "timm-vit-tiny.safetensors"), metadata=metadata)
    config, tensors = llama(22, H_kv=4)
    tensors = {key: tensor.to(torch.bfloat16) for key, tensor in tensors.items()}
    config["torch_dtype"] = "bfloat16"
    # q and v of layer 0 in shard 1, k and o in shard 2: one layer read from two files.
    second = {key for key in tensors if key.startswith("model.layers.1.") or key in (
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.norm.weight", "lm_head.weight")}
    write_sharded(out / "llama-sharded-tiny", config, tensors, second)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
