"""Third-party failures (transformers, tokenizers) are contained: a model that fails, a
tokenizer that panics, a multi-tower model and hostile tokens each end as attnviz words.

The contract every case asserts is in tests/hostile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import lazy_import
from hostile import (
    assert_error,
    assert_no_control,
    assert_printed_clean,
    digest,
    one_thread,  # noqa: F401 - autouse: torch on one thread
)

# ------------------------------------------------------------------------------------------
# 5. Third-party failures contained (transformers, tokenizers)

transformers = lazy_import("transformers")
from zoo import VOCAB, ZOO, build, save_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models transformers writes itself, with the zoo's WordLevel tokenizer."""
    import base64
    import shutil
    import warnings

    root = tmp_path_factory.mktemp("models")
    folders = {}
    words_only = ZOO["vit"]  # its tokenizer options: a pad token, no <s> or </s> added
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = folders["gpt2"] = build("gpt2", root / "gpt2")
        config = json.loads((gpt2 / "config.json").read_text())  # GPT-2's own <|endoftext|>
        config.update(bos_token_id=50256, eos_token_id=50256)  # id: outside the vocabulary
        (gpt2 / "config.json").write_text(json.dumps(config))
        for name in ("no-tokenizer", "panics", "missing-weight", "foreign-tokenizer"):
            shutil.copytree(gpt2, root / name)
            folders[name] = root / name
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / "no-tokenizer" / name).unlink()
        tok = root / "panics" / "tokenizer.json"  # a charsmap the Rust parser panics on
        doc = json.loads(tok.read_text())
        doc["normalizer"] = {"type": "Precompiled", "precompiled_charsmap":
                             base64.b64encode(b"\xff\xff\xff\x7f" + b"\x01" * 64).decode()}
        tok.write_text(json.dumps(doc))
        from safetensors.torch import load_file, save_file

        weights = root / "missing-weight" / "model.safetensors"
        tensors = load_file(weights)
        del tensors["h.1.mlp.c_fc.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
        tok = root / "foreign-tokenizer" / "tokenizer.json"  # no word of ours, ids past VOCAB
        doc = json.loads(tok.read_text())
        doc["model"]["vocab"] = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "zebra": 40}
        tok.write_text(json.dumps(doc))
        vit = folders["vit"] = root / "vit"
        transformers.ViTModel(transformers.ViTConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            image_size=8, patch_size=4)).save_pretrained(vit)
        save_tokenizer(vit, words_only)
        whisper = folders["whisper"] = root / "whisper"
        transformers.WhisperModel(transformers.WhisperConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=VOCAB,
            pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
            num_mel_bins=4, max_source_positions=8, max_target_positions=8)).save_pretrained(
            whisper)
        save_tokenizer(whisper, words_only)
        clip = folders["clip"] = root / "clip"
        torch.manual_seed(0)
        transformers.CLIPModel(transformers.CLIPConfig(
            text_config={"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "intermediate_size": 16, "vocab_size": VOCAB,
                         "max_position_embeddings": 16},
            vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "intermediate_size": 16, "image_size": 8, "patch_size": 4},
            projection_dim=8)).save_pretrained(clip)
        save_tokenizer(clip, words_only)
    return folders


MODEL_ERRORS = [
    ("no tokenizer files", "no-tokenizer", 1, "the model folder has no tokenizer files"),
    ("token ids past the embedding", "foreign-tokenizer", 1,
     f"the model's tokenizer gives token id 40, but the model's embedding has {VOCAB} rows"),
    ("a tokenizer that panics", "panics", 1,
     "the model's tokenizer cannot be loaded (PanicException: Precompiled"),
    ("a weight left out", "missing-weight", 1, "the weights lack 'h.1.mlp.c_fc.weight', which "
     "the model runs (transformers would fill them with random numbers)"),
    ("a tokenizer of another model", "foreign-tokenizer", 1,
     "the model's tokenizer maps every word of the sentences to its unknown token"),
    ("a vision model", "vit", 2, "model_type 'vit' takes images (pixel_values), not text"),
    ("an audio model", "whisper", 2, "model_type 'whisper' takes audio (input_features), not "
     "text"),
]


@pytest.mark.parametrize("case", MODEL_ERRORS, ids=[c[0] for c in MODEL_ERRORS])
def test_model_failures_in_attnviz_words(cli, models, case):
    """One line of attnviz's own on stderr: no transformers warning, load report, Rust panic
    message or traceback."""
    folder = models[case[1]]
    before = digest(folder)
    sentence = "zebra" if "past the embedding" in case[0] else "the cat sat"
    assert_error(cli("heatmap", "--model", folder, sentence), case[2], case[3])
    assert digest(folder) == before


def test_a_tokenizer_panic_while_encoding_is_contained(cli, models, monkeypatch):
    from tokenizers import Tokenizer

    with pytest.raises(BaseException) as caught:  # a real pyo3_runtime.PanicException
        Tokenizer.from_str((models["panics"] / "tokenizer.json").read_text())
    panic = type(caught.value)
    assert not issubclass(panic, Exception) and panic.__name__ == "PanicException"

    def explode(self, *args, **kwargs):
        raise panic("index out of bounds")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", explode)
    assert_error(cli("heatmap", "--model", models["gpt2"], "the cat sat"), 1,
                 "the model's tokenizer failed on sentence 1 (PanicException: index out of")


def test_a_clean_model_run_writes_nothing_on_stderr(cli, models):
    """This config's bos/eos ids lie outside its vocabulary, which transformers warns about
    on every load: attnviz keeps it off the terminal."""
    result = cli("heatmap", "--model", models["gpt2"], "the cat sat", "--no-maps")
    assert_printed_clean(result)
    assert result.stderr == ""


def test_a_multi_tower_model_runs_its_text_tower(cli, models):
    result = cli("heatmap", "--model", models["clip"], "the cat sat", "--json")
    assert_printed_clean(result)
    doc = json.loads(result.stdout)
    assert [layer["name"] for layer in doc["layers"]] == [
        f"text_model.encoder.layers.{i}.self_attn" for i in range(2)]
    assert doc["causal"] is True and result.stderr == ""


def test_hostile_tokenizer_tokens_print_escaped(cli, tmp_path):
    """Tokens come from the model's tokenizer: escape sequences and markup in its vocabulary
    are shown escaped in maps, --query tables and errors, and as \\u escapes in --json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = build("gpt2", tmp_path / "gpt2")
    words = ["\x1b[2J", "[bold]", "\u202eevil", "\x9b31m", "$\\frac{", ":smile:"]
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # whole words, escapes included
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(folder)
    sentence = " ".join(words)
    for args in (["--query", "[bold]"], ["--json"], ["--query", "\x1b]0;x\x07"]):
        result = cli("heatmap", "--model", folder, sentence, *args)
        assert result.exit_code in (0, 2) and "Traceback" not in result.output
        assert_no_control(result.stdout, result.stderr)
    assert "[bold]" in cli("heatmap", "--model", folder, sentence).stdout


CONFIG_TYPES = [
    ("scale_attn_weights", "yes", "config.json field 'scale_attn_weights' is 'yes', expected "
     "true or false"),
    # a list where a count belongs: attnviz notes it (Swin keeps one per stage); transformers'
    # own validation of GPT-2's config refuses it, reported as a config.json error
    ("n_head", [2, 2], "cannot read the model's config.json"),
    ("n_positions", 1.5, "cannot read the model's config.json"),
    ("n_inner", -5, "cannot read the model's config.json"),
]


@pytest.mark.parametrize("case", CONFIG_TYPES, ids=[c[0] for c in CONFIG_TYPES])
def test_config_fields_of_unexpected_types(cli, models, tmp_path, case):
    import shutil

    folder = tmp_path / "gpt2"
    shutil.copytree(models["gpt2"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, case[0]: case[1]}))
    assert_error(cli("heatmap", "--model", folder, "the cat"), 1, case[2])
