"""What a Hugging Face `model_type` says about its attention, in one table: the data.

One row per model_type: the config.json keys of its head counts, where positions enter attention,
which layers mask causally, how q·kᵀ is scaled, whether a sliding window applies, how a tensor
that fuses q, k and v lays out its rows, and whether `split --verify` can recompute it. Both the
recognizers (`attnviz.recognize`) and the position code (`attnviz.compute.forward_pass.positions`)
read it;
nothing else keeps a list of model types. The rules that read it against a config.json are in
`attnviz.recognize.model_types`. A naming convention (which tensor is W_q) is not a
model-type fact: those rows live in `attnviz.recognize.conventions`.

A few rows are not Hugging Face model types but formats whose conventions assume them when no
config.json applies ("torch-mha", "timm"). Every value read from config.json is validated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from attnviz.load.config import flag


@dataclass(frozen=True)
class Packing:
    """How one tensor stacks several of q, k and v along its rows.

    The rows form `groups` equal blocks; each block holds the parts in `order`. Per block, q has
    H·d/groups rows and k, v have H_kv·d/groups rows each. That single picture covers every fused
    layout attnviz knows: stacked [q; k; v] is one group, GPT-NeoX/BLOOM interleave per head
    (H groups), Falcon's new architecture per kv group (H_kv groups), CodeGen has 4 groups in the
    order q, v, k.
    """

    groups: int | str  # a number of blocks, or "heads" (H) or "kv_heads" (H_kv)
    kv: str  # H_kv: "all" (= H), "one" (multi-query) or "config" (config.json, else H)
    describe: str  # how inspect states it; {name} is the fused tensor's name
    order: str = "qkv"

    @property
    def needs_heads(self) -> bool:
        """True when where W_q ends depends on the head counts (not just on the row count)."""
        return not isinstance(self.groups, int) or self.kv != "all"

    def group_count(self, heads: int, kv_heads: int) -> int:
        if self.groups == "heads":
            return heads
        if self.groups == "kv_heads":
            return kv_heads
        assert isinstance(self.groups, int)
        return self.groups


THIRDS = Packing(1, "all", "fused {name} (3·H·d, E), stacked [q; k; v] rows, each (H, d)")
STACKED = Packing(1, "config", "{name} ((H + 2·H_kv)·d, E), stacked [q; k; v] rows "
                  "(grouped-query sizes)")
PER_HEAD = Packing("heads", "all", "interleaved per head {name} (H, 3, d): [q_h; k_h; v_h] for "
                   "each head h")
MULTI_QUERY = Packing(1, "one", "multi-query {name} (H + 2, d): all query heads, then one k and "
                      "one v")
PER_GROUP = Packing("kv_heads", "config", "grouped {name} (H_kv, H/H_kv + 2, d): per group its "
                    "query heads, one k, one v")
# The same layouts in the words of GPT-NeoX's and GPTBigCode's own code.
NEOX = Packing("heads", "all", "interleaved per head {name} (H, 3·d): [q_h | k_h | v_h] for each "
               "head h")
BIGCODE_MHA = Packing("heads", "all", "interleaved per head {name} (H, 3·d), like GPT-NeoX")
BIGCODE_MQA = Packing(1, "one", "multi-query {name} (E + 2·d, E): rows 0:E the query heads, then "
                      "one k, one v")
CODEGEN = Packing(4, "all", "{name} in 4 model-parallel blocks, each [q; v; k] of E/4 rows",
                  order="qvk")


@dataclass(frozen=True)
class When:
    """`then` applies when config flag `flag` (default `default`) is true."""

    flag: str
    default: bool
    then: Packing


@dataclass(frozen=True)
class ConfigScale:
    """scale = config[key] ** power (Gemma 2: query_pre_attn_scalar^-½)."""

    key: str
    default: float
    power: float


@dataclass(frozen=True)
class ModelType:
    """What one model_type's attention does, as its modeling file in transformers 5 does it."""

    family: str = ""  # label inspect shows; "" = the model_type itself
    heads: tuple[str, ...] = ("num_attention_heads",)  # config keys of H, first present wins
    kv_heads: tuple[str, ...] = ("num_key_value_heads",)  # of H_kv (absent: from the shapes)
    head_dim: tuple[str, ...] = ("head_dim",)  # of d (absent: H·d / H)
    positions: str = "none"  # none, learned, sinusoidal, rope, alibi, relative bias, ...
    rotary: tuple[str, ...] = ("partial_rotary_factor",)  # keys of the rotated share of d
    rotary_default: float = 1.0
    rotary_dim: tuple[str, int] | None = None  # (key, default) giving rotated dims (GPT-J)
    alibi_flag: str = ""  # a config flag that switches RoPE to ALiBi (Falcon)
    position_key: str = ""  # BERT's position_embedding_type (relative_key → relative bias)
    encoder_positions: str = ""  # where the encoder differs (Whisper: sinusoidal)
    causal: str = "never"  # never, always, decoder (seq2seq decoder), is_decoder, text (tower),
    # causal (XLM's config flag `causal`)
    scale: float | ConfigScale | str | None = None  # None: 1/√d; "gpt2"/"deberta": rules below
    softcap: str = ""  # config key of the logit soft-cap (Gemma 2)
    window: str = ""  # "", "always", "opt-in" (use_sliding_window), "layers" (layer_types)
    packing: Packing | tuple[When | Packing, ...] | None = None  # of fused q/k/v tensors
    verify: bool = False  # split --verify / heatmap --query recompute its positions
    notes: tuple[str, ...] = ()

    def packing_for(self, config: dict[str, Any]) -> Packing | None:
        """The fused layout this config selects (Falcon's flags), or None if the type has none."""
        if self.packing is None or isinstance(self.packing, Packing):
            return self.packing
        for rule in self.packing:
            if isinstance(rule, Packing):
                return rule
            if flag(config, rule.flag, rule.default):
                return rule.then
        return None


_GPT = ("n_head", "num_attention_heads")
_BERT = ModelType(positions="learned", causal="is_decoder", position_key="position_embedding_type")
_ROPE = ModelType(positions="rope", causal="always")
_SEQ2SEQ = ModelType(positions="learned", causal="decoder")
_SINUSOIDAL = ModelType(positions="sinusoidal", causal="decoder")
_GEMMA2 = ModelType(positions="rope", causal="always", scale=ConfigScale(
    "query_pre_attn_scalar", 256.0, -0.5), softcap="attn_logit_softcapping", window="layers")
_FALCON = (When("new_decoder_architecture", False, PER_GROUP), When("multi_query", True,
                                                                    MULTI_QUERY), PER_HEAD)

MODEL_TYPES: dict[str, ModelType] = {
    # formats without config.json, assumed by their naming conventions
    "torch-mha": ModelType(),
    "timm": ModelType(),
    # encoders
    "bert": replace(_BERT, verify=True),
    "albert": replace(_BERT, notes=(
        "ALBERT shares attention modules across layers: num_hidden_layers layers reuse "
        "num_hidden_groups module(s)",)),
    "megatron-bert": replace(_BERT, notes=(
        "a LayerNorm (attention.ln) normalizes the layer's input before q, k and v",)),
    "big_bird": replace(_BERT, notes=(
        "attention_type block_sparse attends in blocks (global, sliding and random); "
        "original_full is ordinary full attention",)),
    "roformer": ModelType(positions="rope", causal="is_decoder", notes=(
        "RoFormer rotates interleaved pairs (2j, 2j+1), not rotate_half",)),
    "xlm": ModelType(heads=("n_heads",), kv_heads=(), positions="learned", causal="causal",
                     notes=("sinusoidal_embeddings: fixed sinusoidal instead of learned "
                            "positions",)),
    "distilbert": ModelType(heads=("n_heads",), positions="learned"),
    "deberta-v2": ModelType(positions="relative (disentangled)", scale="deberta", notes=(
        "disentangled attention: content-to-position and position-to-content terms "
        "(pos_key_proj / pos_query_proj, or key / query when share_att_key) are added to q·kᵀ",)),
    "mpnet": ModelType(positions="relative bias", notes=(
        "adds a learned relative position bias (encoder.relative_attention_bias) to q·kᵀ",)),
    "modernbert": ModelType(positions="rope", window="layers", notes=(
        "global and local layers alternate; local layers attend within local_attention / 2 "
        "tokens either side",)),
    "vit": ModelType(positions="learned"),
    "swin": ModelType(heads=(), kv_heads=(), positions="relative bias", notes=(
        "window attention: each token attends within its window; num_heads in config.json lists "
        "each stage's heads",)),
    # decoders
    "gpt2": ModelType(heads=_GPT, kv_heads=(), head_dim=(), positions="learned", causal="always",
                      scale="gpt2", verify=True),
    "gpt_bigcode": ModelType(heads=_GPT, kv_heads=(), head_dim=(), positions="learned",
                             causal="always", scale="gpt2",
                             packing=(When("multi_query", True, BIGCODE_MQA), BIGCODE_MHA)),
    "gpt_neox": ModelType(family="gpt-neox", heads=("num_attention_heads", "n_head"), kv_heads=(),
                          positions="rope", rotary=("partial_rotary_factor", "rotary_pct"),
                          rotary_default=0.25, causal="always", packing=NEOX, verify=True),
    "bloom": ModelType(heads=_GPT, kv_heads=(), positions="alibi", causal="always",
                       packing=PER_HEAD,
                       notes=("ALiBi: m_h · (key position) is added to the scaled scores",)),
    "falcon": ModelType(heads=("num_attention_heads", "n_head"),
                        kv_heads=("num_kv_heads", "n_head_kv"), positions="rope",
                        alibi_flag="alibi", causal="always", packing=_FALCON),
    # the pre-transformers Falcon code: RefinedWeb (falcon-40b) always used the grouped layout
    "RefinedWeb": ModelType(family="falcon", heads=("n_head", "num_attention_heads"),
                            kv_heads=("n_head_kv", "num_kv_heads"), positions="rope",
                            alibi_flag="alibi", causal="always",
                            packing=(When("new_decoder_architecture", True, PER_GROUP),
                                     *_FALCON[1:])),
    "RefinedWebModel": ModelType(family="falcon", heads=("n_head", "num_attention_heads"),
                                 kv_heads=("n_head_kv", "num_kv_heads"), positions="rope",
                                 alibi_flag="alibi", causal="always", packing=_FALCON),
    "codegen": ModelType(heads=_GPT, kv_heads=(), positions="rope", rotary_dim=("rotary_dim", 64),
                         causal="always", packing=CODEGEN,
                         notes=("CodeGen rotates interleaved pairs (2j, 2j+1), not rotate_half",)),
    "mpt": ModelType(heads=("n_heads",), kv_heads=(), positions="alibi", causal="always"),
    "ctrl": ModelType(heads=("n_head",), kv_heads=(), positions="sinusoidal", causal="always"),
    "opt": ModelType(positions="learned", causal="always"),
    "gpt_neo": ModelType(heads=("num_heads",), positions="learned", causal="always", scale=1.0,
                         notes=("GPT-Neo does not scale q·kᵀ; some layers attend locally "
                                "(window_size)",)),
    "gptj": ModelType(heads=_GPT, positions="rope", causal="always", rotary_dim=("rotary_dim", 64),
                      notes=("GPT-J rotates interleaved pairs (2j, 2j+1), not rotate_half",)),
    "llama": ModelType(positions="rope", causal="always", verify=True),
    "mistral": ModelType(positions="rope", causal="always", window="always", verify=True),
    "mixtral": ModelType(positions="rope", causal="always", window="always"),
    "qwen2": ModelType(positions="rope", causal="always", window="opt-in", verify=True),
    "qwen2_moe": _ROPE,
    "qwen3": _ROPE,
    "qwen3_moe": _ROPE,
    "phi": ModelType(positions="rope", causal="always", rotary_default=0.5),
    "phi3": ModelType(positions="rope", causal="always", window="always"),
    "stablelm": ModelType(positions="rope", causal="always", rotary_default=0.25),
    "gemma": _ROPE,
    "gemma2": _GEMMA2,
    "gemma3": _GEMMA2,
    "olmo": _ROPE,
    "olmo2": _ROPE,
    "starcoder2": ModelType(positions="rope", causal="always", window="always"),
    "cohere": _ROPE,
    "olmoe": replace(_ROPE, notes=(
        "q_norm / k_norm normalize the whole projection (H·d and H_kv·d features), before the "
        "head split",)),
    "nemotron": ModelType(positions="rope", causal="always", rotary_default=0.5),
    "helium": replace(_ROPE, notes=(
        "Helium rotates interleaved pairs (2j, 2j+1), not rotate_half",)),
    "smollm3": replace(_ROPE, window="opt-in", notes=(
        "NoPE layers: a layer whose no_rope_layers entry is 0 uses no positions",)),
    "persimmon": ModelType(positions="rope", causal="always", rotary_default=0.5,
                           packing=PER_HEAD),
    "xglm": ModelType(heads=("attention_heads",), kv_heads=(), positions="sinusoidal",
                      causal="always"),
    "granite": ModelType(positions="rope", causal="always",
                         scale=ConfigScale("attention_multiplier", 1.0, 1.0)),
    # encoder-decoders (role keys encoder_/decoder_attention_heads are tried first, see below)
    "t5": ModelType(heads=("num_heads",), kv_heads=(), head_dim=("d_kv",),
                    positions="relative bias", causal="decoder", scale=1.0),
    "mt5": ModelType(heads=("num_heads",), kv_heads=(), head_dim=("d_kv",),
                     positions="relative bias", causal="decoder", scale=1.0),
    "bart": replace(_SEQ2SEQ, verify=True),
    "mbart": _SEQ2SEQ,
    "plbart": _SEQ2SEQ,
    "blenderbot": _SEQ2SEQ,
    "blenderbot-small": _SEQ2SEQ,
    "marian": _SINUSOIDAL,
    "pegasus": _SINUSOIDAL,
    "m2m_100": _SINUSOIDAL,
    "whisper": ModelType(positions="learned", encoder_positions="sinusoidal", causal="decoder"),
    # multi-tower models: each tower's counts are nested (text_config, vision_config)
    "clip": ModelType(positions="learned", causal="text"),
    "siglip": ModelType(positions="learned"),
}

# An unknown model_type: the usual key names; positions, masking and scale are not known.
GENERIC = ModelType(heads=("num_attention_heads", "n_head", "n_heads", "num_heads"),
                    kv_heads=("num_key_value_heads", "num_kv_heads", "n_head_kv"))
ROLE_HEADS = {"encoder": ("encoder_attention_heads",), "decoder": ("decoder_attention_heads",),
              "cross": ("decoder_attention_heads",)}  # cross-attention belongs to the decoder
TOWER_SUFFIXES = (("_text_model", "text"), ("_vision_model", "vision"), ("_text", "text"))
