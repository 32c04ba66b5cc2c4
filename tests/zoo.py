"""A zoo of tiny random-weight Hugging Face models, one row per architecture, built offline.

Each row names a config factory, the model class and the tokenizer options (pad token, padding
side, whether the tokenizer adds <s> or </s> itself). `build(kind, folder)` writes the model with
`save_pretrained` and a small WordLevel tokenizer next to it; nothing is ever downloaded. Sizes are
tiny (hidden 32, 2 layers, 4 heads, grouped key/value heads where the family has them) so each
model builds in a fraction of a second; biases are random and attention projections scaled up, so
a slicing or masking mistake changes the maps visibly instead of hiding in near-uniform rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from helpers import lazy_import

transformers = lazy_import("transformers", "tokenizers")  # imported when a model is built

SENTENCES = ["the cat sat on the mat",
             "a small dog ran far away from the big red barn in the cold night"]
WORDS = sorted(set(" ".join(SENTENCES).split()))
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>"]  # ids 0..3, matched by the configs below
UNK, PAD, BOS, EOS = range(4)
VOCAB = len(SPECIALS) + len(WORDS)
POSITIONS = 64

# Keyword groups shared by many rows: (hidden 32, 4 heads, 2 layers) in each family's own names.
_IDS = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}
_BERTLIKE = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 64, "max_position_embeddings": POSITIONS, **_IDS}
_DECODER = {**_BERTLIKE, "num_key_value_heads": 2}  # grouped-query: 2 query heads per kv head
_SEQ2SEQ = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "max_position_embeddings": POSITIONS, "decoder_start_token_id": EOS, **_IDS}
_GPT = {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": POSITIONS, **_IDS}


@dataclass(frozen=True)
class Kind:
    """One architecture of the zoo."""

    config: Callable[[], Any]  # () -> a transformers config
    model_class: str  # a transformers class name; the base model, no task head
    pad: bool = True  # the tokenizer has a pad token (GPT-2 style tokenizers do not)
    side: str = "right"  # padding side
    bos: bool = False  # the tokenizer prepends <s> itself
    eos: bool = False  # the tokenizer appends </s> itself
    encoder_decoder: bool = False
    text: bool = True  # False: weights only, no tokenizer (vision)
    sharpen: float = 12.0  # factor on the q/k projections: attention visibly away from uniform


def _config(name: str, **kwargs: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, name)(**kwargs)


ZOO: dict[str, Kind] = {
    # encoders
    "bert": Kind(_config("BertConfig", **_BERTLIKE), "BertModel", bos=True),
    "roberta": Kind(_config("RobertaConfig", **{**_BERTLIKE, "max_position_embeddings": 70}),
                    "RobertaModel", bos=True, eos=True),
    "xlm_roberta": Kind(_config("XLMRobertaConfig",
                                **{**_BERTLIKE, "max_position_embeddings": 70}),
                        "XLMRobertaModel", bos=True, eos=True),
    "distilbert": Kind(_config("DistilBertConfig", dim=32, n_heads=4, n_layers=2, hidden_dim=64,
                               max_position_embeddings=POSITIONS, vocab_size=VOCAB,
                               pad_token_id=PAD), "DistilBertModel", bos=True),
    # ALBERT shares one attention module between its layers: one module, two calls
    "albert": Kind(_config("AlbertConfig", embedding_size=16, **_BERTLIKE), "AlbertModel",
                   bos=True),
    "electra": Kind(_config("ElectraConfig", embedding_size=16, **_BERTLIKE), "ElectraModel",
                    bos=True),
    "deberta_v2": Kind(_config("DebertaV2Config", relative_attention=True,
                               pos_att_type=["p2c", "c2p"], position_buckets=8,
                               max_relative_positions=16, **_BERTLIKE),
                       "DebertaV2Model", bos=True),
    # layer 0 global, layer 1 local (sliding window of 2 tokens either side)
    "modernbert": Kind(_config("ModernBertConfig", local_attention=4,
                               layer_types=["full_attention", "sliding_attention"],
                               attention_bias=True, cls_token_id=BOS, sep_token_id=EOS,
                               **_BERTLIKE), "ModernBertModel", bos=True),
    # MPNet ignores relative_attention_num_buckets (compute_position_bias hardcodes 32)
    "mpnet": Kind(_config("MPNetConfig", **_BERTLIKE),
                  "MPNetModel", bos=True),
    "roformer": Kind(_config("RoFormerConfig", embedding_size=32, **_BERTLIKE), "RoFormerModel",
                     bos=True),
    "megatron_bert": Kind(_config("MegatronBertConfig", **_BERTLIKE), "MegatronBertModel",
                          bos=True),
    "xlm": Kind(_config("XLMConfig", emb_dim=32, n_layers=2, n_heads=4,
                        max_position_embeddings=POSITIONS, vocab_size=VOCAB, pad_index=PAD),
                "XLMModel", bos=True),
    "big_bird": Kind(_config("BigBirdConfig", attention_type="original_full", **_BERTLIKE),
                     "BigBirdModel", bos=True),
    "camembert": Kind(_config("CamembertConfig", **{**_BERTLIKE, "max_position_embeddings": 70}),
                      "CamembertModel", bos=True, eos=True),
    # decoders
    "gpt2": Kind(_config("GPT2Config", **_GPT), "GPT2Model", pad=False),
    "gptj": Kind(_config("GPTJConfig", rotary_dim=4, **_GPT), "GPTJModel", pad=False),
    "gpt_neo": Kind(_config("GPTNeoConfig", hidden_size=32, num_heads=4, num_layers=2,
                            attention_types=[[["global", "local"], 1]], window_size=4,
                            max_position_embeddings=POSITIONS, **_IDS), "GPTNeoModel",
                    pad=False),
    "codegen": Kind(_config("CodeGenConfig", rotary_dim=4, n_ctx=POSITIONS, **_GPT),
                    "CodeGenModel", pad=False),
    "opt": Kind(_config("OPTConfig", hidden_size=32, num_attention_heads=4, ffn_dim=64,
                        num_hidden_layers=2, word_embed_proj_dim=32,
                        max_position_embeddings=POSITIONS, **_IDS), "OPTModel", bos=True),
    "bloom": Kind(_config("BloomConfig", hidden_size=32, n_head=4, n_layer=2, **_IDS),
                  "BloomModel", side="left"),
    "falcon": Kind(_config("FalconConfig", hidden_size=32, num_attention_heads=4,
                           num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2,
                           bias=True, **_IDS), "FalconModel", side="left"),
    "gpt_neox": Kind(_config("GPTNeoXConfig", rotary_pct=0.5, **_BERTLIKE), "GPTNeoXModel"),
    "gpt_bigcode": Kind(_config("GPTBigCodeConfig", multi_query=True, **_GPT),
                        "GPTBigCodeModel", pad=False),
    "phi": Kind(_config("PhiConfig", partial_rotary_factor=0.5, qk_layernorm=True, **_DECODER),
                "PhiModel"),
    "phi3": Kind(_config("Phi3Config", **_DECODER), "Phi3Model", side="left"),
    "llama": Kind(_config("LlamaConfig", attention_bias=True, **_DECODER), "LlamaModel",
                  side="left", bos=True),
    "mistral": Kind(_config("MistralConfig", sliding_window=4,
                            **{**_DECODER, "num_key_value_heads": 1}), "MistralModel",
                    side="left", bos=True),
    "mixtral": Kind(_config("MixtralConfig", num_local_experts=2, num_experts_per_tok=1,
                            **_DECODER), "MixtralModel", side="left", bos=True),
    "qwen2": Kind(_config("Qwen2Config", **_DECODER), "Qwen2Model", side="left"),
    "qwen3": Kind(_config("Qwen3Config", head_dim=16, attention_bias=True, **_DECODER),
                  "Qwen3Model", side="left"),
    "gemma": Kind(_config("GemmaConfig", head_dim=16, **{**_DECODER, "num_key_value_heads": 1}),
                  "GemmaModel", side="left", bos=True),
    # softcapping, query_pre_attn_scalar scaling, alternating sliding (4) and full layers
    "gemma2": Kind(_config("Gemma2Config", head_dim=8, sliding_window=4, query_pre_attn_scalar=16,
                           attn_logit_softcapping=5.0, **_DECODER), "Gemma2Model", side="left",
                   bos=True),
    "olmo2": Kind(_config("Olmo2Config", **_DECODER), "Olmo2Model"),
    "stablelm": Kind(_config("StableLmConfig", partial_rotary_factor=0.25, use_qkv_bias=True,
                             **_DECODER), "StableLmModel"),
    "gemma3": Kind(_config("Gemma3TextConfig", head_dim=8, sliding_window=4, **_DECODER),
                   "Gemma3TextModel", side="left", bos=True),
    "qwen2_moe": Kind(_config("Qwen2MoeConfig", num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32,
                              **_DECODER), "Qwen2MoeModel", side="left"),
    "qwen3_moe": Kind(_config("Qwen3MoeConfig", head_dim=8, num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=32, **_DECODER), "Qwen3MoeModel",
                      side="left"),
    "granite": Kind(_config("GraniteConfig", **_DECODER), "GraniteModel", side="left"),
    "cohere": Kind(_config("CohereConfig", **_DECODER), "CohereModel", side="left", bos=True),
    "starcoder2": Kind(_config("Starcoder2Config", **_DECODER), "Starcoder2Model", side="left"),
    "olmo": Kind(_config("OlmoConfig", **_DECODER), "OlmoModel"),
    "biogpt": Kind(_config("BioGptConfig", **_BERTLIKE), "BioGptModel", bos=True),
    "olmoe": Kind(_config("OlmoeConfig", num_experts=2, num_experts_per_tok=1, **_DECODER),
                  "OlmoeModel"),
    "persimmon": Kind(_config("PersimmonConfig", **_BERTLIKE), "PersimmonModel"),
    "nemotron": Kind(_config("NemotronConfig", **_DECODER), "NemotronModel"),
    "helium": Kind(_config("HeliumConfig", head_dim=8, **_DECODER), "HeliumModel", side="left"),
    "smollm3": Kind(_config("SmolLM3Config", **_DECODER), "SmolLM3Model", side="left"),
    "xglm": Kind(_config("XGLMConfig", d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                         max_position_embeddings=POSITIONS, **_IDS), "XGLMModel", bos=True),
    # encoder-decoders
    "t5": Kind(_config("T5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2,
                       num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                       relative_attention_max_distance=16, vocab_size=VOCAB, pad_token_id=PAD,
                       eos_token_id=EOS, decoder_start_token_id=PAD), "T5Model", eos=True,
               encoder_decoder=True, sharpen=1.0),  # unscaled scores: sharp already
    "mt5": Kind(_config("MT5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                        relative_attention_max_distance=16, vocab_size=VOCAB, pad_token_id=PAD,
                        eos_token_id=EOS, decoder_start_token_id=PAD), "MT5Model", eos=True,
                encoder_decoder=True, sharpen=1.0),
    "bart": Kind(_config("BartConfig", **_SEQ2SEQ), "BartModel", bos=True, eos=True,
                 encoder_decoder=True),
    "marian": Kind(_config("MarianConfig", **{**_SEQ2SEQ, "decoder_start_token_id": PAD}),
                   "MarianModel", eos=True, encoder_decoder=True),
    "mbart": Kind(_config("MBartConfig", **_SEQ2SEQ), "MBartModel", eos=True,
                  encoder_decoder=True),
    "pegasus": Kind(_config("PegasusConfig", **{**_SEQ2SEQ, "decoder_start_token_id": PAD}),
                    "PegasusModel", eos=True, encoder_decoder=True),
    "m2m_100": Kind(_config("M2M100Config", **_SEQ2SEQ), "M2M100Model", eos=True,
                    encoder_decoder=True),
    "blenderbot": Kind(_config("BlenderbotConfig", **_SEQ2SEQ), "BlenderbotModel", eos=True,
                       encoder_decoder=True),
    "plbart": Kind(_config("PLBartConfig", **_SEQ2SEQ), "PLBartModel", eos=True,
                   encoder_decoder=True),
    # vision: 16×16 images, 4×4 patches -> 16 patches + [CLS]
    "vit": Kind(_config("ViTConfig", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                        intermediate_size=64, image_size=16, patch_size=4), "ViTModel",
                text=False),
}
# Architectures no naming row knows: attnviz finds their attention modules only by building the
# model from config.json on the meta device (attnviz.sources.discover). Apart from ZOO, whose
# rows the --model capture tests run: CTRL's modeling file returns no attention weights by name.
DISCOVERED: dict[str, Kind] = {
    "ctrl": Kind(_config("CTRLConfig", n_embd=32, n_head=4, n_layer=2, dff=64,
                         n_positions=POSITIONS, vocab_size=VOCAB, pad_token_id=PAD),
                 "CTRLModel"),
}
TEXT = [kind for kind, row in ZOO.items() if row.text]
# Families whose modeling file (transformers 5.24) does not call ALL_ATTENTION_FUNCTIONS.
FALLBACK = {"deberta_v2", "mpnet", "gpt_neo", "bloom", "falcon", "roformer", "megatron_bert",
            "xlm", "big_bird", "xglm"}
ENCODER_DECODER = [kind for kind, row in ZOO.items() if row.encoder_decoder]

# Parameters scaled up so attention is sharper than at init: projections of q and k (and ALBERT's
# and ELECTRA's embedding projection, whose small outputs reach layer 0 without a norm).
_SHARPEN = ("query", "key", "q_proj", "k_proj", "q_lin", "k_lin", "c_attn", "Wqkv", "qkv_proj",
            "query_key_value", ".q.", ".k.", "in_proj", "embeddings_project",
            "embedding_hidden_mapping_in")


def save_tokenizer(folder: Path, row: Kind) -> None:
    """A WordLevel tokenizer over the zoo's words, with the row's padding and special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = " ".join((["<s>"] if row.bos else []) + ["$A"] + (["</s>"] if row.eos else []))
    if template != "$A":  # special tokens the tokenizer adds itself
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", BOS), ("</s>", EOS)])
    extra = {"pad_token": "<pad>"} if row.pad else {}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        padding_side=row.side, model_input_names=["input_ids", "attention_mask"],
        **extra).save_pretrained(folder)


def load_for_capture(folder: Path, model_class: str = "AutoModel") -> Any:
    """A zoo model of any model class, loaded as `--model` loads its base model: eager
    attention, switched to attnviz's attention function where its modeling file uses the
    interface (`capture_path`)."""
    from attnviz.sources.hf.load import capture_path

    model = getattr(transformers, model_class).from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32, local_files_only=True,
        trust_remote_code=False).eval()
    capture_path(model)
    return model


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer that was saved. Not AutoTokenizer: transformers 5 maps some model types
    (qwen2, ...) to their own tokenizer class, which rebuilds a BPE without merges."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def randomize(model: Any, row: Any) -> None:
    """The zoo's random weights on top of transformers' init: random biases (its zeros would
    hide them) and sharper query/key projections (flat maps would hide the heads)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and param.ndim == 1:
                param.normal_(0, 0.5)
            elif param.ndim == 2 and any(part in f".{name}" for part in _SHARPEN):
                param.mul_(row.sharpen)


def build_model(kind: str, seed: int = 0) -> Any:
    """A random-weight model of `kind`, in eval mode, with random biases and sharper attention."""
    row = row_of(kind)
    torch.manual_seed(seed)
    model = getattr(transformers, row.model_class)(row.config())
    randomize(model, row)
    return model.eval()


def row_of(kind: str) -> Kind:
    """A zoo row: ZOO's, or DISCOVERED's."""
    return ZOO[kind] if kind in ZOO else DISCOVERED[kind]


def build(kind: str, folder: Path) -> Path:
    """Write model `kind` (and its tokenizer, for text kinds) to `folder`; return the folder."""
    transformers.utils.logging.disable_progress_bar()
    build_model(kind).save_pretrained(folder)
    if row_of(kind).text:
        save_tokenizer(folder, row_of(kind))
    return folder


def lm_model(kind: str, model_class: str | None = None, vocab_size: int | None = None) -> Any:
    """The zoo's `kind` WITH a head, random as `build_model`, in eval mode: its language-model
    head (AutoModelForCausalLM, or AutoModelForSeq2SeqLM for an encoder-decoder), or the
    transformers class `model_class` (a masked-LM head, ...); `vocab_size` embedding rows
    instead of the zoo's. Generation ends at the zoo's EOS."""
    row = row_of(kind)
    config = row.config()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(0)
    if model_class is not None:
        model = getattr(transformers, model_class)(config)
    else:
        auto = transformers.AutoModelForSeq2SeqLM if row.encoder_decoder \
            else transformers.AutoModelForCausalLM
        model = auto.from_config(config, attn_implementation="eager")
    randomize(model, row)
    if getattr(model, "generation_config", None) is not None:  # None: cannot generate
        model.generation_config.eos_token_id = EOS
    return model.eval()


def build_lm(kind: str, folder: Path, model_class: str | None = None,
             vocab_size: int | None = None,
             edit: Callable[[Any], None] | None = None) -> Path:
    """Write `lm_model(kind, model_class, vocab_size)` and the zoo's tokenizer to `folder`;
    return the folder. `edit(model)`, run under no_grad before saving, is where a test's own
    variant changes weights (a logit bias on one id, a sharper head)."""
    transformers.utils.logging.disable_progress_bar()
    model = lm_model(kind, model_class, vocab_size)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(folder)
    save_tokenizer(folder, row_of(kind))
    return folder


def zoo_factory(tmp_path_factory: Any) -> Callable[[str], Path]:
    """`get(kind) -> folder`, building each kind at most once per session.

    Wrap it in a session-scoped fixture: `zoo_model = pytest.fixture(scope="session")(...)`.
    """
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


# ------------------------------------------------------------------------ LM-head variants
# The class each text family's language-model head is saved as: decoders' causal LMs and
# encoder-decoders' generation models, as config.json's `architectures` then names it (what
# `--model` reads to find a head). Encoders are left out: their …ForCausalLM classes run
# bidirectionally, and their masked-LM heads are no causal LM (the matrix gives an encoder's
# base model to the LM commands as misuse). The source matrix runs patch, attribute, lens,
# ablate and generate over these (tests/test_source_matrix.py).
LM_HEADS: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel", "gptj": "GPTJForCausalLM", "gpt_neo": "GPTNeoForCausalLM",
    "codegen": "CodeGenForCausalLM", "opt": "OPTForCausalLM", "bloom": "BloomForCausalLM",
    "falcon": "FalconForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "phi": "PhiForCausalLM", "phi3": "Phi3ForCausalLM",
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "stablelm": "StableLmForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "granite": "GraniteForCausalLM", "cohere": "CohereForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM", "olmo": "OlmoForCausalLM",
    "biogpt": "BioGptForCausalLM", "olmoe": "OlmoeForCausalLM",
    "persimmon": "PersimmonForCausalLM", "nemotron": "NemotronForCausalLM",
    "helium": "HeliumForCausalLM", "smollm3": "SmolLM3ForCausalLM", "xglm": "XGLMForCausalLM",
    "t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration", "marian": "MarianMTModel",
    "mbart": "MBartForConditionalGeneration", "pegasus": "PegasusForConditionalGeneration",
    "m2m_100": "M2M100ForConditionalGeneration",
    "blenderbot": "BlenderbotForConditionalGeneration",
    "plbart": "PLBartForConditionalGeneration",
    # found only by discovery (DISCOVERED)
    "ctrl": "CTRLLMHeadModel",
}


def lm_factory(tmp_path_factory: Any) -> Callable[[str], Path]:
    """`get(kind) -> folder` of kind's LM_HEADS model (`build_lm`, its named class), each built
    at most once per session, as `zoo_factory` builds the base models."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_lm(kind, tmp_path_factory.mktemp(f"lm_{kind}"), LM_HEADS[kind])
        return built[kind]

    return get
