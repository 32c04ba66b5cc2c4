"""attnviz.sources.hf on real models, offline: the packaged all-MiniLM-L6-v2 and tiny
random-weight models that transformers itself writes, each with a small WordLevel tokenizer
built with `tokenizers`."""

from __future__ import annotations

import importlib.util
import inspect
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from conftest import minilm_folder  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402

from attnviz.compute import positions  # noqa: E402
from attnviz.errors import CheckpointError, UsageError  # noqa: E402
from attnviz.sources import hf  # noqa: E402

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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a shared machine two torch threads spin far more than they
    compute (MiniLM's forward is ~9× faster on one), so run this module on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    cache: dict[str, hf.LoadedModel] = {}

    def get(kind: str) -> hf.LoadedModel:
        if kind not in cache:
            if kind == "minilm":
                folder = minilm_folder()
            else:
                folder = tmp_path_factory.mktemp(kind)
                build_tiny(kind, folder)
            model = hf.load_model(str(folder))
            if kind == "qwen2":
                # transformers 5 maps this folder's generic tokenizer to Qwen2Tokenizer, which
                # rebuilds a BPE without merges; keep the WordLevel tokenizer that was saved.
                model.tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
            cache[kind] = model
        return cache[kind]

    return get


def alone(model: hf.LoadedModel, sentence: str) -> tuple[list[torch.Tensor], list[str]]:
    """transformers' own output_attentions for one sentence run alone (no padding)."""
    enc = model.tokenizer(sentence, return_tensors="pt")
    runner = model.model.get_encoder() if model.config.is_encoder_decoder else model.model
    accepts = inspect.signature(runner.forward).parameters  # 4.x adds token_type_ids
    with torch.no_grad():
        out = runner(**{k: v for k, v in enc.items() if k in accepts}, output_attentions=True)
    return list(out.attentions), model.tokenizer.convert_ids_to_tokens(enc["input_ids"][0])


def test_minilm_is_recognized(loaded):
    model = loaded("minilm")
    assert len(model.layers) == 6
    assert {layer.num_heads for layer in model.layers} == {12}
    assert [layer.name for layer in model.layers] == [f"encoder.layer.{i}.attention"
                                                      for i in range(6)]


@pytest.mark.parametrize("kind", ALL + ENCODER_DECODER)
def test_captured_maps_equal_output_attentions(loaded, kind):
    model = loaded(kind)
    run = hf.run_model(model, SENTENCES, None, 64)
    assert [c.index for c in run.layers] == list(range(len(model.layers)))
    assert run.layers[0].method == hf.METHOD and run.store is model.store
    for b, sentence in enumerate(SENTENCES):
        expected, tokens = alone(model, sentence)
        n = len(tokens)
        assert run.batch.tokens[b] == tokens
        for captured, reference in zip(run.layers, expected, strict=True):
            assert captured.weights.shape[1] == captured.layer.num_heads
            torch.testing.assert_close(captured.weights[b, :, :n, :n], reference[0],
                                       atol=1e-5, rtol=0)
            assert not captured.weights[b, :, :, n:].any()  # right padding, zeroed
            assert not captured.inputs[b, n:].any()


@pytest.mark.parametrize("kind", ALL + ENCODER_DECODER)
def test_batched_equals_single(loaded, kind):
    model = loaded(kind)
    batch = hf.run_model(model, SENTENCES, [0, -1], 64)
    assert [c.index for c in batch.layers] == [0, len(model.layers) - 1]
    for b, sentence in enumerate(SENTENCES):
        single = hf.run_model(model, [sentence], [0, -1], 64)
        n = single.batch.lengths[0]
        for one, many in zip(single.layers, batch.layers, strict=True):
            torch.testing.assert_close(many.weights[b, :, :n, :n], one.weights[0],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(many.inputs[b, :n], one.inputs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # left and right padding
def test_streamed_model_run_equals_full_maps(loaded, kind, monkeypatch):
    """Past the budget, each layer's maps are reduced inside the forward pass: the same views,
    statistics and --query row as the full maps, and only the last layer's inputs are kept."""
    import numpy as np

    from attnviz.compute import streaming
    from attnviz.compute.stats import head_stats

    model = loaded(kind)
    full = hf.run_model(model, SENTENCES, None, 64)
    monkeypatch.setattr(streaming, "MAP_BUDGET_BYTES", 0)
    streamed = hf.run_model(model, SENTENCES, None, 64, allow_stream=True, query=(2, "-2"))
    assert "long input" in streamed.notes[0]
    for a, b in zip(full.layers, streamed.layers, strict=True):
        assert b.weights is None and b.method.startswith(hf.METHOD + ", streamed")
        for view in b.views:
            n = len(full.batch.tokens[view.sentence])
            maps = a.weights[view.sentence, :, :n, :n]
            expected = maps.mean(0) if view.head is None else maps[view.head]
            np.testing.assert_allclose(view.values, expected.numpy(), atol=1e-6)
        assert len(b.views) == len(SENTENCES) * (a.layer.num_heads + 1)
        for x, y in zip(head_stats(a.weights, full.batch.tokens, a.index), b.stats, strict=True):
            assert (x.layer, x.head) == (y.layer, y.head)
            assert x.entropy == pytest.approx(y.entropy, rel=1e-5, abs=1e-7)
            assert x.previous == pytest.approx(y.previous, rel=1e-5, abs=1e-7)
    last = streamed.layers[-1]
    n = len(full.batch.tokens[2])
    assert last.query_row == (2, n - 2)
    torch.testing.assert_close(last.query_weights, full.layers[-1].weights[2, :, n - 2, :n])
    assert [layer.inputs is None for layer in streamed.layers] == [True] * (
        len(streamed.layers) - 1) + [False]


@pytest.mark.parametrize("kind", ENCODER_DECODER)
def test_encoder_decoder_runs_its_encoder(loaded, kind):
    """Encoder-decoder models: the encoder's self-attention layers only, numbered from 0 (the
    decoder's self- and cross-attention need target text), said in a note."""
    model = loaded(kind)
    assert model.encoder_only
    assert [layer.name.split(".")[0] for layer in model.layers] == ["encoder", "encoder"]
    run = hf.run_model(model, SENTENCES[:1], None, 64)
    assert [c.index for c in run.layers] == [0, 1]
    assert any("encoder-decoder model" in note for note in run.notes)


def test_padding_cases_are_exercised(loaded):
    assert loaded("llama").tokenizer.padding_side == "left"
    gpt2 = loaded("gpt2")
    assert gpt2.tokenizer.pad_token is None
    hf.run_model(gpt2, SENTENCES, [0], 64)
    assert gpt2.tokenizer.pad_token is None  # padding needs no change to the tokenizer


@pytest.mark.parametrize("kind", [*ALL, "bart"])
def test_verify_passes(loaded, kind):
    model = loaded(kind)
    run = hf.run_model(model, SENTENCES, None, 64)
    for index in range(len(model.layers)):
        result = hf.verify_layer(model, index, SENTENCES, run=run)
        assert result.passed, (index, result.per_head)
        assert len(result.per_head) == model.layers[index].num_heads
    if kind in ("llama", "neox", "mistral", "qwen2"):
        assert result.positions.startswith("RoPE recomputed from config.json")
    if kind == "neox":
        assert "8 of 16 dims" in result.positions


def test_verify_runs_the_model_itself(loaded):
    result = hf.verify_layer(loaded("minilm"), 3, SENTENCES[:2])
    assert result.passed and result.layer_index == 3 and result.tolerance == 1e-4


def swap_heads(layer, a: int, b: int, kind: str = "q"):
    """A copy of `layer` whose W (and bias) rows of heads a and b are exchanged."""
    rows = layer.q_rows if kind == "q" else layer.kv_rows
    total = (layer.num_heads if kind == "q" else layer.num_kv_heads) or 0
    order = [rows(b if h == a else a if h == b else h) for h in range(total)]
    names = ("q_weight", "q_bias") if kind == "q" else ("k_weight", "k_bias")
    changes = {name: getattr(layer, name).take(tuple(order)) for name in names
               if getattr(layer, name) is not None}
    return replace(layer, **changes)


@pytest.mark.parametrize("kind", ["minilm", "gpt2", "llama"])
def test_wrong_query_slicing_fails(loaded, kind):
    model = loaded(kind)
    wrong = swap_heads(model.layers[0], 0, 1)
    result = hf.verify_layer(model, 0, SENTENCES, layer=wrong)
    assert not result.passed
    assert min(result.per_head[:2]) > 1e-2  # the swapped heads
    assert max(result.per_head[2:]) <= result.tolerance  # the rest still agree


def test_wrong_kv_slicing_fails(loaded):
    model = loaded("llama")  # 4 query heads share 2 kv heads: each kv head serves two
    wrong = swap_heads(model.layers[1], 0, 1, kind="kv")
    result = hf.verify_layer(model, 1, SENTENCES, layer=wrong)
    assert min(result.per_head) > 1e-2


def test_sliding_window_is_needed(loaded, monkeypatch):
    model = loaded("mistral")  # window 4, sentences of up to 10 tokens
    assert "sliding window of 4 keys" in hf.verify_layer(model, 0, SENTENCES).positions
    monkeypatch.setattr(positions, "sliding_window", lambda *args: None)
    assert not hf.verify_layer(model, 0, SENTENCES).passed


def test_hub_id_resolves_from_the_local_cache_only(loaded, tmp_path, monkeypatch):
    import huggingface_hub.constants

    source = loaded("gpt2").folder
    snapshot = tmp_path / "models--tiny--gpt2" / "snapshots" / "abc123"
    shutil.copytree(source, snapshot)
    (tmp_path / "models--tiny--gpt2" / "refs").mkdir()
    (tmp_path / "models--tiny--gpt2" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    model = hf.load_model("tiny/gpt2")
    assert model.folder == snapshot and len(model.layers) == 2
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        hf.load_model("tiny/absent")


def test_unsupported_family_is_a_usage_error(loaded):
    model = loaded("opt")
    assert hf.run_model(model, SENTENCES, None, 64).layers[0].weights.shape[1] == 4
    with pytest.raises(UsageError, match="does not support model_type 'opt'") as info:
        hf.verify_layer(model, 0, SENTENCES)
    assert info.value.fix == "supported: bart, bert, gpt2, gpt_neox, llama, mistral, qwen2"


def test_usage_errors(loaded, monkeypatch):
    model = loaded("gpt2")
    with pytest.raises(UsageError, match="out of range"):
        hf.run_model(model, SENTENCES, [2], 64)
    with pytest.raises(UsageError, match="more than --max-tokens 5"):
        hf.run_model(model, SENTENCES, None, 5)
    with pytest.raises(UsageError, match="no sentence"):
        hf.run_model(model, [], None, 64)
    with pytest.raises(UsageError, match="unknown dtype"):
        hf.load_model(str(model.folder), dtype="float64")
    with pytest.raises(UsageError, match="no such model folder"):
        hf.load_model("./missing-folder")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            hf.load_model(str(model.folder), device="cuda")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(UsageError, match="needs accelerate"):
        hf.load_model(str(model.folder), device_map="auto")


def test_missing_extra_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(UsageError) as info:
        hf.require_transformers()
    assert info.value.what == "--model needs the Hugging Face extra"
    assert info.value.fix == "pip install 'attnviz[hf]'"


# ------------------------------------------------------------------------------------------
# the command line: heatmap --model and split --model --verify


@pytest.mark.parametrize("kind", [*ALL, "bart"])
def test_query_breakdown_equals_the_models_own_weights(loaded, kind):
    """--query on every supported family (RoPE, partial RoPE, sliding window, grouped-query):
    the per-head weights recomputed from q_h and k_h equal transformers' own for the sentence
    run alone, and the printed products are consistent with them."""
    from attnviz.compute.attention import query_breakdown

    model = loaded(kind)
    run = hf.run_model(model, SENTENCES, [-1], 64)
    expected, tokens = alone(model, SENTENCES[2])
    query = len(tokens) - 1  # the last token: far enough for mistral's 4-key sliding window
    breakdown = query_breakdown(run, run.layers[0].index, 2, query)
    assert breakdown.token == tokens[query]
    assert breakdown.positions.startswith("RoPE") == (kind in ("llama", "neox", "mistral",
                                                               "qwen2"))
    layer = run.layers[0].layer
    for head in breakdown.heads:
        torch.testing.assert_close(torch.tensor(head.weights), expected[-1][0, head.head, query],
                                   atol=1e-5, rtol=0)
        q, keys = torch.tensor(head.q), torch.tensor(head.keys)
        torch.testing.assert_close(keys @ q, torch.tensor(head.dots), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(head.scores),
                                   torch.tensor(head.dots) * layer.effective_scale)
        assert head.kv_head == layer.kv_head_of(head.head)
    if kind == "mistral":
        assert sum(w > 0 for w in breakdown.heads[0].weights) == 4


def test_query_on_a_bfloat16_model_uses_its_tolerance(loaded):
    """A half-precision model's own maps are rounded: the float32 recomputation is checked
    against them to the dtype's tolerance (as --verify does), not float32's."""
    from attnviz.compute.attention import query_breakdown

    model = hf.load_model(str(loaded("llama").folder), dtype="bfloat16")
    run = hf.run_model(model, SENTENCES, [-1], 64)
    assert run.tolerance == hf.TOLERANCE["bfloat16"]
    breakdown = query_breakdown(run, run.layers[0].index, 0, 3)
    # bf16 rounding shows (float32's 1e-4 would refuse it), well inside bf16's tolerance
    assert 1e-4 < breakdown.max_diff <= run.tolerance / 4


def test_t5_relative_bias_is_refused_by_query_and_verify(loaded):
    """T5 adds a learned relative-position bias inside attention, which attnviz does not
    recompute: both recomputations refuse with a usage error instead of a false mismatch."""
    from attnviz.compute.attention import query_breakdown

    model = loaded("t5")
    run = hf.run_model(model, SENTENCES[:1], None, 64)
    with pytest.raises(UsageError, match="does not recompute relative bias positions"):
        query_breakdown(run, 1, 0, 2)
    with pytest.raises(UsageError, match="verification does not support model_type 't5'"):
        hf.verify_layer(model, 0, SENTENCES[:1], run=run)


def test_query_on_unsupported_rope_family_is_a_usage_error(loaded, monkeypatch):
    from attnviz.compute.attention import query_breakdown

    run = hf.run_model(loaded("llama"), SENTENCES[:1], [0], 64)
    monkeypatch.delitem(positions.SCHEMES, "llama")
    with pytest.raises(UsageError, match="does not recompute rope positions of model_type"):
        query_breakdown(run, 0, 0, 1)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-gpt2")
    build_tiny("gpt2", folder)
    return folder


def test_cli_heatmap_model_export_equals_output_attentions(cli, tmp_path, loaded, gpt2_folder):
    from safetensors import safe_open

    sentences = ["the cat sat on the mat", "a dog ran"]
    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--model", gpt2_folder, *sentences, "--export", out, "--no-maps")
    assert result.exit_code == 0, result.output
    import json

    with safe_open(str(out), "pt") as f:
        tokens = json.loads(f.metadata()["tokens"])
        maps = {k: f.get_tensor(k) for k in f.keys()}
    model = loaded("gpt2")
    for b, sentence in enumerate(sentences):
        expected, expected_tokens = alone(model, sentence)
        assert tokens[b] == expected_tokens
        n = len(expected_tokens)
        for i, layer_maps in enumerate(expected):
            torch.testing.assert_close(maps[f"attn.{i}"][b, :, :n, :n], layer_maps[0],
                                       atol=1e-6, rtol=1e-5)


def test_cli_split_model_verify(cli, gpt2_folder):
    import json

    result = cli("split", "--model", gpt2_folder, "--layer", "1", "--verify", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verify"]["passed"] is True and doc["verify"]["max_abs_diff"] < 1e-5
    assert doc["proof"]["passed"] is True
    text = cli("split", "--model", gpt2_folder, "--layer", "0", "--verify").stdout
    assert "✓ the model's heads are these slices" in text


def test_cli_query_on_a_rotary_model(cli, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-neox")
    build_tiny("neox", folder)
    result = cli("heatmap", "--model", folder, "the cat sat on the mat", "--query", "mat",
                 "--layer", "1", "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    assert "positions: RoPE recomputed from config.json: rotate_half on 8 of 16 dims" in \
        " ".join(result.stdout.split())
    assert "q_0 = RoPE_5(x_5 · W_q[0:16]ᵀ (+ b))" in result.stdout


def test_cli_query_on_a_streamed_model_run(cli, gpt2_folder, monkeypatch):
    import json

    from conftest import assert_clean_error

    from attnviz.compute import streaming

    args = ["heatmap", "--model", gpt2_folder, *SENTENCES, "--sentence", "3", "--query", "bird",
            "--json"]
    full = json.loads(cli(*args).stdout)
    monkeypatch.setattr(streaming, "MAP_BUDGET_BYTES", 0)
    result = cli(*args)
    assert result.exit_code == 0, result.output
    streamed = json.loads(result.stdout)
    assert all(", streamed" in layer["method"] for layer in streamed["layers"])
    assert streamed["query"]["token"] == full["query"]["token"] == "bird"
    for a, b in zip(full["query"]["heads"], streamed["query"]["heads"], strict=True):
        torch.testing.assert_close(torch.tensor(b["weights"]), torch.tensor(a["weights"]))
    for x, y in zip(full["head_stats"], streamed["head_stats"], strict=True):
        assert (x["layer"], x["head"], x["label"]) == (y["layer"], y["head"], y["label"])
        for key in ("entropy", "max_weight", "distance", "first", "previous", "self"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key
    assert_clean_error(cli("heatmap", "--model", gpt2_folder, "a dog", "--query", "zebra"), 2,
                       "token 'zebra' is not in the sentence")


def test_cli_encoder_decoder_model(cli, tmp_path_factory, loaded):
    """heatmap --model on BART: the encoder's maps, exported, equal transformers' own for each
    sentence run alone through the encoder; split --verify checks the same layers."""
    import json

    from conftest import assert_clean_error
    from safetensors import safe_open

    folder = tmp_path_factory.mktemp("cli-bart")
    build_tiny("bart", folder)
    out = tmp_path_factory.mktemp("out") / "maps.safetensors"
    result = cli("heatmap", "--model", folder, *SENTENCES[:2], "--export", out, "--no-maps")
    assert result.exit_code == 0, result.output
    assert "encoder-decoder model: its encoder's self-attention layers" in \
        " ".join(result.stdout.split())
    with safe_open(str(out), "pt") as f:
        maps = {k: f.get_tensor(k) for k in f.keys()}
    for b, sentence in enumerate(SENTENCES[:2]):
        expected, tokens = alone(loaded("bart"), sentence)
        for i, layer_maps in enumerate(expected):
            torch.testing.assert_close(maps[f"attn.{i}"][b, :, :len(tokens), :len(tokens)],
                                       layer_maps[0], atol=1e-6, rtol=1e-5)
    # split numbers layers as inspect does (decoder ones too); --verify maps them by name
    name = "encoder.layers.1.self_attn"
    verified = cli("split", "--model", folder, "--layer", name, "--verify", "--json")
    assert verified.exit_code == 0, verified.output
    doc = json.loads(verified.stdout)["verify"]
    assert doc["passed"] is True and doc["layer"] == 1
    assert_clean_error(cli("split", "--model", folder, "--layer", "decoder.layers.0.self_attn",
                           "--verify"), 2, "in the decoder of an encoder-decoder model",
                       "encoder.layers.0.self_attn")


def test_cli_model_errors(cli, tmp_path, gpt2_folder):
    from conftest import assert_clean_error

    assert_clean_error(cli("split", "--verify"), 2, "--verify needs --model")
    assert_clean_error(cli("heatmap", "--model", tmp_path / "nope", "a b"), 2, "no such model")
    assert_clean_error(cli("heatmap", "--model", "someone/not-cached-model", "a b"), 1,
                       "not in the local Hugging Face cache")
    assert_clean_error(cli("heatmap", "--model", gpt2_folder, "a b", "--layer", "9"), 2,
                       "not a layer of this model")
