"""attnviz.sources.hf on real models, offline: the packaged all-MiniLM-L6-v2 and the tiny
random-weight models of tests/zoo.py; the recompute proof; the command line end to end
(DistilBERT, Phi-3, Marian: the README's examples)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
transformers = lazy_import("transformers", "tokenizers")

import torch  # noqa: E402
from helpers import assert_clean_error, minilm_folder  # noqa: E402
from zoo import SENTENCES, load_tokenizer  # noqa: E402

from attnviz.compute.forward_pass import positions  # noqa: E402
from attnviz.core import memory  # noqa: E402
from attnviz.errors import CheckpointError, UsageError  # noqa: E402
from attnviz.recognize import find_layers  # noqa: E402
from attnviz.sources.hf import versions  # noqa: E402
from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run  # noqa: E402
from attnviz.sources.hf.load import TOLERANCE, LoadedModel, load_model, require_transformers  # noqa: E402
from attnviz.sources.hf.run import run_plan  # noqa: E402
from attnviz.sources.hf.verify import call_of, recompute_supported, verify_layer  # noqa: E402

RECOMPUTED = ["bert", "gpt2", "llama", "gpt_neox", "mistral", "qwen2", "bart"]


pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def loaded(zoo_model):
    cache: dict[str, LoadedModel] = {}

    def get(kind: str) -> LoadedModel:
        if kind not in cache:
            if kind == "minilm":
                cache[kind] = load_model(str(minilm_folder()))
            else:
                folder = zoo_model(kind)
                cache[kind] = load_model(str(folder), tokenizer=load_tokenizer(folder))
        return cache[kind]

    return get


def run(model: LoadedModel, sentences: list[str], layer: str | None = None,
        **kwargs) -> object:
    return run_plan(model, plan_run(model, sentences, layer, ModelRun(**kwargs)))


def test_minilm_maps_equal_output_attentions(loaded):
    """A real checkpoint (sentence-transformers' all-MiniLM-L6-v2): every layer, batched, equals
    transformers' own maps for each sentence alone."""
    model = loaded("minilm")
    sentences = ["the cat sat on the mat", "a dog ran", "the bird sang a song today loudly"]
    result = run(model, sentences)
    assert [c.index for c in result.layers] == list(range(6))
    assert {c.heads for c in result.layers} == {12}
    assert result.layers[0].name == "encoder.layer.0.attention.self"
    eager = transformers.AutoModel.from_pretrained(model.folder,
                                                   attn_implementation="eager").eval()
    for b, sentence in enumerate(sentences):
        enc = model.tokenizer(sentence, return_tensors="pt")
        with torch.no_grad():
            expected = eager(**enc, output_attentions=True).attentions
        n = enc["input_ids"].shape[1]
        for captured, reference in zip(result.layers, expected, strict=True):
            torch.testing.assert_close(captured.weights[b, :, :n, :n], reference[0],
                                       atol=1e-5, rtol=0)


def test_only_the_shown_layer_runs_eager(loaded):
    model = loaded("llama")
    result = run(model, SENTENCES, "-1")
    assert [c.index for c in result.layers] == [1]
    assert "LlamaAttention's own eager_attention_forward" in result.layers[0].method
    assert result.path.startswith("transformers attention interface")


@pytest.mark.parametrize("kind", RECOMPUTED)
def test_recompute_proof_passes(loaded, kind):
    model = loaded(kind)
    for layer in find_layers(model.store).layers:
        if layer.name.startswith("decoder."):
            continue  # the recompute proof covers self-attention over the source
        result = verify_layer(model, layer, SENTENCES)
        assert result.passed, (layer.name, result.per_head)
        assert len(result.per_head) == layer.num_heads
    if kind in ("llama", "gpt_neox", "mistral", "qwen2"):
        assert result.positions.startswith("RoPE recomputed from config.json")
    if kind == "gpt_neox":
        assert "4 of 8 dims" in result.positions


def swap_heads(layer, a: int, b: int, kind: str = "q"):
    """A copy of `layer` whose W (and bias) rows of heads a and b are exchanged."""
    rows = layer.q_rows if kind == "q" else layer.kv_rows
    total = (layer.num_heads if kind == "q" else layer.num_kv_heads) or 0
    order = [rows(b if h == a else a if h == b else h) for h in range(total)]
    names = ("q_weight", "q_bias") if kind == "q" else ("k_weight", "k_bias")
    changes = {name: getattr(layer, name).take(tuple(order)) for name in names
               if getattr(layer, name) is not None}
    return replace(layer, **changes)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_recompute_proof_fails_on_wrong_query_slicing(loaded, kind):
    model = loaded(kind)
    layer = find_layers(model.store).layers[0]
    result = verify_layer(model, layer, SENTENCES, described=swap_heads(layer, 0, 1))
    assert not result.passed
    assert min(result.per_head[:2]) > 1e-2  # the swapped heads
    assert max(result.per_head[2:]) <= result.tolerance  # the rest still agree


def test_recompute_proof_fails_on_wrong_kv_slicing(loaded):
    model = loaded("llama")  # 4 query heads share 2 kv heads: each kv head serves two
    layer = find_layers(model.store).layers[1]
    result = verify_layer(model, layer, SENTENCES, described=swap_heads(layer, 0, 1, "kv"))
    assert min(result.per_head) > 1e-2


def test_sliding_window_is_needed(loaded, monkeypatch):
    model = loaded("mistral")  # window 4, sentences of up to 16 tokens
    layer = find_layers(model.store).layers[0]
    assert "sliding window of 4 keys" in verify_layer(model, layer, SENTENCES).positions
    monkeypatch.setattr(positions, "sliding_window", lambda *args: None)
    assert not verify_layer(model, layer, SENTENCES).passed


def test_recompute_proof_says_where_it_does_not_apply(loaded):
    model = loaded("opt")
    layer = find_layers(model.store).layers[0]
    with pytest.raises(UsageError, match="does not recompute the positions of model_type 'opt'"):
        verify_layer(model, layer, SENTENCES)
    t5 = loaded("t5")
    plan = plan_run(t5, SENTENCES, None, ModelRun(need_layers=True))
    call = call_of(plan.layers, t5.model, find_layers(t5.store).layers[-1])
    assert call.label == "enc 1"
    assert "model_type 't5'" in recompute_supported(t5, call)


def test_query_on_a_bfloat16_model_uses_its_tolerance(zoo_model):
    """A half-precision model's own maps are rounded: the float32 recomputation is checked
    against them to the dtype's tolerance, not float32's."""
    from attnviz.compute.measures.breakdown import query_breakdown

    folder = zoo_model("llama")
    model = load_model(str(folder), dtype="bfloat16", tokenizer=load_tokenizer(folder))
    result = run(model, SENTENCES, "-1", query=(0, "3"))
    assert result.tolerance == TOLERANCE["bfloat16"]
    breakdown = query_breakdown(result, result.layers[0].index, 0, 3)
    assert breakdown.max_diff <= result.tolerance


def test_dtype_auto_loads_the_checkpoints_own_dtype(cli, zoo_model, tmp_path):
    """`--dtype auto` on a checkpoint saved in bfloat16 runs in bfloat16 (on a CPU the shown
    layers' eager attention then runs on float32 copies, and the header says so); the default
    float32 and `--dtype auto` on a float32 checkpoint do not (the controls)."""
    folder = zoo_model("llama")
    half = tmp_path / "llama-bf16"
    transformers.LlamaModel.from_pretrained(folder).to(torch.bfloat16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, half / name)
    said = "in float32 from bfloat16 q/k/v (fast on CPU)"
    runs = {(str(where), dtype): cli("heatmap", "--model", where, SENTENCES[0], "--dtype", dtype,
                                     "--layer", "0", "--no-maps", "--device", "cpu")
            for where, dtype in ((half, "auto"), (half, "float32"), (folder, "auto"))}
    for result in runs.values():
        assert result.exit_code == 0, result.output
    assert said in runs[(str(half), "auto")].stdout.replace("\n", " ")
    assert said not in runs[(str(half), "float32")].stdout.replace("\n", " ")
    assert said not in runs[(str(folder), "auto")].stdout.replace("\n", " ")


def test_hub_id_resolves_from_the_local_cache_only(zoo_model, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--tiny--gpt2" / "snapshots" / "abc123"
    shutil.copytree(zoo_model("gpt2"), snapshot)
    (tmp_path / "models--tiny--gpt2" / "refs").mkdir()
    (tmp_path / "models--tiny--gpt2" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    model = load_model("tiny/gpt2")
    assert model.folder == snapshot
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        load_model("tiny/absent")


def test_usage_errors(loaded, monkeypatch):
    model = loaded("gpt2")
    with pytest.raises(UsageError, match="not a layer of this model"):
        run(model, SENTENCES, "2")
    with pytest.raises(UsageError, match="more than max_tokens 5"):
        plan_run(model, RunInputs(SENTENCES, None, 5))
    with pytest.raises(UsageError, match="no sentence"):
        plan_run(model, [])
    from attnviz.api import run_model  # a dtype is parsed where the request is built

    with pytest.raises(UsageError, match="unknown dtype 'float64'"):
        run_model(str(model.folder), SENTENCES, dtype="float64")
    with pytest.raises(UsageError, match="no such model folder"):
        load_model("./missing-folder")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            load_model(str(model.folder), device="cuda")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(UsageError, match="needs accelerate"):
        load_model(str(model.folder), device_map="auto")


def test_missing_extra_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(UsageError) as info:
        require_transformers()
    assert str(info.value) == "model needs the Hugging Face extra"  # the CLI says --model
    assert info.value.fix == versions.install_hint()  # from this checkout: pip install -e


# ------------------------------------------------------------------------------------------
# the command line: heatmap --model and split --model --verify


def reference_maps(folder: Path, model_class: str, sentence: str,
                   target: str | None = None) -> tuple[object, list[str]]:
    tok = load_tokenizer(folder)
    model = getattr(transformers, model_class).from_pretrained(
        folder, attn_implementation="eager").eval()
    ids = tok(sentence)["input_ids"]
    feed = {"input_ids": torch.tensor([ids])}
    if target is not None:
        feed["decoder_input_ids"] = torch.tensor(
            [[model.config.decoder_start_token_id, *tok(text_target=target)["input_ids"]]])
    with torch.no_grad():
        return model(**feed, output_attentions=True), tok.convert_ids_to_tokens(ids)


def read_export(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_cli_distilbert_end_to_end(cli, zoo_model, tmp_path):
    """DistilBERT: a layout attnviz's recognizer does not know; heatmap --model runs it anyway,
    through the attention interface, and says so."""
    folder = zoo_model("distilbert")
    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--model", folder, *SENTENCES, "--export", out, "--no-maps",
                 "--query", "mat", "--layer", "all")  # --layer: each layer's own header line
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "path transformers attention interface" in text
    assert "layer 1 (transformer.layer.1.attention, 4 heads): DistilBertSelfAttention's own " \
        "eager_attention_forward" in text
    assert "recomputed from the captured q_h and k_h" in text
    meta, maps = read_export(out)
    for b, sentence in enumerate(SENTENCES):
        expected, tokens = reference_maps(folder, "DistilBertModel", sentence)
        assert json.loads(meta["tokens"])[b] == tokens
        for i, layer_maps in enumerate(expected.attentions):
            n = len(tokens)
            torch.testing.assert_close(maps[f"attn.{i}"][b, :, :n, :n], layer_maps[0],
                                       atol=1e-5, rtol=0)


def test_cli_phi3_end_to_end(cli, zoo_model, tmp_path):
    """Phi-3 (fused qkv_proj, left padding, grouped-query): heatmap, --query and a figure."""
    folder = zoo_model("phi3")
    png = tmp_path / "maps.png"
    result = cli("heatmap", "--model", folder, *SENTENCES, "--layer", "0:2", "--query", "-1@1",
                 "--out", png, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [layer["label"] for layer in doc["layers"]] == ["0", "1"]
    assert doc["query"]["source"] == "captured" and doc["query"]["max_diff"] <= 1e-5
    expected, tokens = reference_maps(folder, "Phi3Model", SENTENCES[0])
    for head in doc["query"]["heads"]:
        torch.testing.assert_close(torch.tensor(head["weights"]),
                                   expected.attentions[1][0, head["head"], -1],
                                   atol=1e-5, rtol=0)
    assert png.stat().st_size > 0


def test_cli_marian_end_to_end(cli, zoo_model, tmp_path):
    """Marian with --target: decoder self-attention and cross-attention in the terminal, the
    statistics and the export, equal to transformers' own decoder_/cross_attentions."""
    folder = zoo_model("marian")
    targets = ["the big red barn", "a cat"]
    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--model", folder, *SENTENCES, "--target", targets[0], "--target",
                 targets[1], "--layer", "enc 1,dec all,cross all", "--export", out, "--head", "0",
                 "--maps")
    assert result.exit_code == 0, result.output
    for label in ("enc 1 · head 0", "dec 1 · head 0", "cross 0 · head 0", "target 2: a cat"):
        assert label in result.stdout
    meta, maps = read_export(out)
    assert sorted(k for k in maps if not k.startswith("inputs")) == [
        "attn.1", "cross.0", "cross.1", "decoder.0", "decoder.1", "mask", "target_mask"]
    assert "inputs.cross.1" in maps and "inputs.decoder.0" in maps
    for b, sentence in enumerate(SENTENCES):
        expected, tokens = reference_maps(folder, "MarianModel", sentence, targets[b])
        t = len(json.loads(meta["target_tokens"])[b])
        for i in range(2):
            torch.testing.assert_close(maps[f"cross.{i}"][b, :, :t, :len(tokens)],
                                       expected.cross_attentions[i][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(maps[f"decoder.{i}"][b, :, :t, :t],
                                       expected.decoder_attentions[i][0], atol=1e-5, rtol=0)


def test_cli_split_model_verify(cli, zoo_model):
    folder = zoo_model("gpt2")
    result = cli("split", "--model", folder, "--layer", "1", "--verify", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["verify"]
    assert doc["passed"] is True and doc["proofs"] == ["split", "recompute"]
    assert doc["recompute"]["max_abs_diff"] < 1e-5
    assert [c["status"] for c in doc["split"]["checks"]] == ["pass"] * 12
    text = cli("split", "--model", folder, "--layer", "0", "--verify").stdout
    assert "✓ every head's rows are where attnviz says (12 perturbations)" in text
    assert "c_attn.weight.T[0:8]" in text  # Conv1D: W_q head 0 is columns 0:8 of c_attn
    assert "✓ the model's heads are these slices" in text


def test_cli_split_verify_decoder_layer(cli, zoo_model):
    """An encoder-decoder's decoder and cross-attention layers: the split proof runs (with
    a target), the recompute proof says why it does not."""
    folder = zoo_model("bart")
    result = cli("split", "--model", folder, "--layer", "decoder.layers.1.encoder_attn",
                 "--verify")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "split proof, through the model's own forward pass (layer cross 1" in text
    assert "recompute proof not run: the recompute proof covers self-attention" in text


def test_cli_split_verify_fails_on_a_wrong_description(cli, zoo_model, monkeypatch):
    """Exit 1 with one error line when attnviz's slicing is wrong (heads 0 and 1 swapped)."""
    from attnviz.sources import registry

    real = registry.find_inventory  # the one inventory every command reads

    def wrong(store, hints):
        inventory = real(store, hints)
        return replace(inventory, layers=[swap_heads(layer, 0, 1) for layer in inventory.layers])

    monkeypatch.setattr(registry, "find_inventory", wrong)
    result = cli("split", "--model", zoo_model("llama"), "--layer", "0", "--verify")
    assert result.exit_code == 1
    assert "✗ FAILED: 2 of 8 perturbations" in result.stdout
    assert result.stderr.strip().startswith("error: the split proof failed for 2 of 8")


def test_cli_query_on_a_streamed_model_run(cli, zoo_model, monkeypatch):

    folder = zoo_model("gpt2")
    args = ["heatmap", "--model", folder, *SENTENCES, "--query", "barn@2", "--json"]
    full = json.loads(cli(*args).stdout)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    result = cli(*args)
    assert result.exit_code == 0, result.output
    streamed = json.loads(result.stdout)
    assert all(", streamed" in layer["method"] for layer in streamed["layers"])
    assert streamed["query"]["token"] == full["query"]["token"] == "barn"
    for a, b in zip(full["query"]["heads"], streamed["query"]["heads"], strict=True):
        torch.testing.assert_close(torch.tensor(b["weights"]), torch.tensor(a["weights"]))
    for x, y in zip(full["head_stats"], streamed["head_stats"], strict=True):
        assert (x["layer"], x["head"], x["label"]) == (y["layer"], y["head"], y["label"])
        for key in ("entropy", "max_weight", "distance", "first", "previous", "self"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key
    assert_clean_error(cli("heatmap", "--model", folder, "the cat", "--query", "zebra"), 2,
                       "token 'zebra' is not in the sentence")


def test_cli_model_errors(cli, tmp_path, zoo_model):
    folder = zoo_model("gpt2")
    assert_clean_error(cli("split", "--verify"), 2, "--verify needs --model")
    assert_clean_error(cli("heatmap", "--model", tmp_path / "nope", "a b"), 2, "no such model")
    assert_clean_error(cli("heatmap", "--model", "someone/not-cached-model", "a b"), 1,
                       "not in the local Hugging Face cache")
    assert_clean_error(cli("heatmap", "--model", folder, "a b", "--layer", "9"), 2,
                       "not a layer of this model")
    assert_clean_error(cli("heatmap", "--model", folder, "a b", "--target", "c"), 2,
                       "--target applies to encoder-decoder models only")
    assert_clean_error(cli("heatmap", "a b", "--target", "c"), 2, "--target applies to --model")
    assert_clean_error(cli("heatmap", "--model", zoo_model("bloom"), "the cat", "--query", "1"),
                       2, "output_attentions")
    assert_clean_error(cli("heatmap", "--model", zoo_model("bart"), "the cat", "--layer",
                           "dec 0"), 2, "no 'dec' layers", "--target")
