"""Small random-weight models written by transformers itself, with a WordLevel tokenizer over a
few words, for the hostile-input tests (`build_tiny(kind, folder)`, `save_tokenizer(...)`).
The architecture zoo (tests/zoo.py) covers the architectures; these keep the exact small configs
those tests were written against (GPT-2 with 2 layers and 4 heads, …)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

SENTENCES = ["the cat sat on the mat", "a dog ran", "the bird sang a song today loudly far away"]
WORDS = sorted(set(" ".join(SENTENCES).split()))
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>"]
VOCAB = len(SPECIALS) + len(WORDS)
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64}
# kind → (config, model class, pad token?, padding side, prepend <s>?)
TINY = {
    "gpt2": (lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64,
                                             vocab_size=VOCAB), "GPT2Model", False, "right", False),
    "llama": (lambda: transformers.LlamaConfig(num_key_value_heads=2, **SMALL), "LlamaModel",
              True, "left", True),
    "neox": (lambda: transformers.GPTNeoXConfig(rotary_pct=0.5, **SMALL), "GPTNeoXModel", True,
             "right", False),
    "mistral": (lambda: transformers.MistralConfig(num_key_value_heads=1, sliding_window=4,
                                                   **SMALL), "MistralModel", True, "left", True),
    "qwen2": (lambda: transformers.Qwen2Config(num_key_value_heads=2, **SMALL), "Qwen2Model",
              False, "left", False),
    "opt": (lambda: transformers.OPTConfig(hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                           num_hidden_layers=1, word_embed_proj_dim=32,
                                           vocab_size=VOCAB, max_position_embeddings=64),
            "OPTModel", True, "right", False),
    # encoder-decoder: --model runs the encoder alone
    "bart": (lambda: transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=1, bos_token_id=2,
        eos_token_id=3, decoder_start_token_id=3), "BartModel", True, "right", True),
    "t5": (lambda: transformers.T5Config(
        d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=4,
        vocab_size=VOCAB, pad_token_id=1, eos_token_id=3, decoder_start_token_id=1),
        "T5Model", True, "right", False),
}
ALL = ["minilm", "gpt2", "llama", "neox", "mistral", "qwen2"]
ENCODER_DECODER = ["bart", "t5"]


def save_tokenizer(folder: Path, pad: bool, side: str, bos: bool) -> None:
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:  # a special token the tokenizer adds itself
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 2)])
    extra = {"pad_token": "<pad>"} if pad else {}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>", padding_side=side,
                                         **extra).save_pretrained(folder)


def build_tiny(kind: str, folder: Path) -> None:
    make_config, model_class, pad, side, bos = TINY[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(make_config())
    with torch.no_grad():  # random biases, sharper attention: slicing mistakes must show
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif any(part in name for part in ("proj", "attn", "query_key_value")):
                param.mul_(8)
    model.save_pretrained(folder)
    save_tokenizer(folder, pad, side, bos)
