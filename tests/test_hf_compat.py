"""The `hf` extra's declared range, tested at both ends (CI's compatibility job runs this file
against the floor in pyproject.toml and against the newest release, each in its own venv).

Only what holds on every supported release: `heatmap --model --export` equals transformers' own
eager `output_attentions` maps for a few architectures (whichever capture path the release
takes), `split --model --verify` passes, and the version floors refuse an older install with
one line naming both versions. Facts that move between releases (which modeling files use the
attention interface) are tests/test_hf.py's and test_zoo_support.py's, pinned to one release."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ROOT, assert_clean_error, minilm_folder

from attnviz.errors import UsageError
from attnviz.sources.hf import versions

SENTENCE = "the cat sat on the mat"


def reference(folder: Path, model_class: str) -> tuple[list[object], list[str]]:
    """transformers' own eager maps of SENTENCE (one sentence: no padding) and its tokens."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder) if (folder / "vocab.txt").is_file() \
        else transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    model = getattr(transformers, model_class).from_pretrained(
        folder, attn_implementation="eager").eval()
    ids = tok(SENTENCE)["input_ids"]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return list(out.attentions), tok.convert_ids_to_tokens(ids)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("kind", "model_class"), [
    ("minilm", "BertModel"), ("gpt2", "GPT2Model"), ("llama", "LlamaModel")])
def test_heatmap_model_export_equals_transformers(cli, zoo_model, tmp_path, kind, model_class):
    import torch
    from safetensors import safe_open

    folder = minilm_folder() if kind == "minilm" else zoo_model(kind)
    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--model", folder, SENTENCE, "--layer", "all", "--no-maps",
                 "--export", out)
    assert result.exit_code == 0, result.output
    expected, tokens = reference(Path(folder), model_class)
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["tokens"]) == [tokens]
        assert f.metadata()["source"] == str(folder)  # exact, however long
        for i, maps in enumerate(expected):
            torch.testing.assert_close(f.get_tensor(f"attn.{i}"), maps, atol=1e-5, rtol=0)
    # negative control: a neighbouring layer's maps are not equal
    assert not torch.allclose(expected[0], expected[1], atol=1e-5)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_split_model_verify_passes(cli, zoo_model, kind):
    result = cli("split", "--model", zoo_model(kind), "--layer", "1", "--verify", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["verify"]
    assert doc["passed"] is True and "split" in doc["proofs"]


def test_floors_are_the_declared_range():
    """pyproject.toml's `hf` extra names exactly the floors attnviz checks at run time."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^hf = \[(.*)\]$", text, re.M)
    assert extra is not None
    declared = dict(re.findall(r'"([a-z]+)>=([0-9.]+)"', extra.group(1)))
    assert declared == versions.FLOORS


@pytest.mark.parametrize(("name", "old"), [("transformers", "4.53.3"), ("tokenizers", "0.20.3")])
def test_an_older_release_is_refused_naming_both_versions(name, old):
    installed = {**versions.FLOORS, name: old}
    with pytest.raises(UsageError) as info:
        versions.check_versions(installed)
    floor = versions.FLOORS[name]
    assert str(info.value) == f"model needs {name} >= {floor}, but {name} {old} is installed"
    assert info.value.fix == f"pip install -U '{name}>={floor}'"
    versions.check_versions(dict(versions.FLOORS))  # the floor itself passes
    versions.check_versions({**versions.FLOORS, name: floor + ".post1"})


def test_the_cli_refuses_an_older_transformers_in_one_line(cli, monkeypatch, tmp_path):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "4.46.3" if name == "transformers" else real(name))
    result = cli("heatmap", "--model", tmp_path, SENTENCE)
    assert_clean_error(result, 2, "--model needs transformers >= "
                       f"{versions.FLOORS['transformers']}, but transformers 4.46.3 is installed")
    assert "please report" not in result.stderr


def test_release_numbers():
    assert versions.release("4.55.0.dev0") == (4, 55, 0)
    assert versions.release("2.13.0+cpu") == (2, 13, 0)
    assert versions.release("5.0.0rc1") == (5, 0, 0)
    assert versions.release("4.9") < versions.release("4.54.0") < versions.release("4.100")


def test_install_advice_fits_where_attnviz_runs(monkeypatch, tmp_path):
    """From this checkout: an editable install of it (`.` when run from its root); from an
    installed package: the extra of the package on the index."""
    assert versions.checkout_root() == ROOT
    assert versions.install_hint(cwd=ROOT) == "pip install -e '.[hf]'"
    assert versions.install_hint(cwd=tmp_path) == f"pip install -e '{ROOT}[hf]'"
    monkeypatch.setattr(versions, "checkout_root", lambda: None)
    assert versions.install_hint() == "pip install 'attnviz[hf]'"


@pytest.fixture(scope="module")
def wide_vocab_llama(tmp_path_factory) -> Path:
    """A zoo LLaMA with a 2,000-row embedding (256 KB) and four small layers: a weight memory
    limit of 300 KB holds the embedding and some layers, the rest goes to disk."""
    import torch
    import transformers
    from zoo import ZOO, save_tokenizer

    folder = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=2000, pad_token_id=1, bos_token_id=2,
                                      eos_token_id=3)
    transformers.LlamaModel(config).save_pretrained(folder)
    save_tokenizer(folder, ZOO["llama"])
    return folder


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_offloaded_model_gives_transformers_own_maps(cli, wide_vocab_llama, tmp_path):
    """--max-memory: accelerate keeps part of the weights on disk and loads each module as the
    forward reaches it; the exported maps still equal transformers' own (all in memory). The
    control: a limit that holds the whole model offloads nothing."""
    import torch
    from safetensors import safe_open

    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--model", wide_vocab_llama, SENTENCE, "--layer", "all",
                 "--no-maps", "--max-memory", "300K", "--export", out)
    assert result.exit_code == 0, result.output
    assert re.search(r"note: weights beyond --max-memory 300 KB: [1-9]\d* modules? offloaded "
                     "to disk", result.stdout), result.stdout
    expected, _ = reference(wide_vocab_llama, "LlamaModel")
    with safe_open(str(out), "pt") as f:
        for i, maps in enumerate(expected):
            torch.testing.assert_close(f.get_tensor(f"attn.{i}"), maps, atol=1e-5, rtol=0)
    whole = cli("heatmap", "--model", wide_vocab_llama, SENTENCE, "--no-maps", "--max-memory",
                "1GB")
    assert whole.exit_code == 0 and "none (the model fits)" in whole.stdout, whole.output


@pytest.mark.hf  # the fixture builds a LLaMA with transformers
def test_offload_without_accelerate_is_one_line(cli, monkeypatch, wide_vocab_llama):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    result = cli("heatmap", "--model", wide_vocab_llama, SENTENCE, "--max-memory", "1MB")
    assert_clean_error(result, 2, "offloads through accelerate")
    assert "[offload]" in result.stderr


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    """The zoo's tiny llama with its language-model head."""
    pytest.importorskip("transformers")
    import zoo

    return zoo.build_lm("llama", tmp_path_factory.mktemp("llama_lm"))


def _greedy_reference(folder: Path, words: str, steps: int, **settings: object) -> list[int]:
    """transformers' own greedy generate of `words`, its new ids (one sentence: no padding)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tok(words)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             num_beams=1, pad_token_id=0, **settings)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_generate_writes_what_transformers_generate_writes(cli, lm_folder):
    """attnviz's decoding settings (passed to generate explicitly, generation_config.json's
    contrary fields set aside) hold on every supported release: the ids it writes are
    transformers' own greedy ones."""
    folder = Path(lm_folder)
    result = cli("generate", "--model", folder, SENTENCE, "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)["generation"]["generated_ids"][0]
    expected = _greedy_reference(folder, SENTENCE, len(written))
    assert written == expected[:len(written)] and written
    # negative control: decoding that differs (its first id suppressed) is told apart
    assert _greedy_reference(folder, SENTENCE, len(written), suppress_tokens=[written[0]]) \
        != written


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_ablate_loads_the_lm_head_on_every_release(cli, lm_folder):
    """The scorecard reloads the model with its LM head (placement keywords of the first load):
    that load works at the floor and at the newest release, and its losses are finite."""
    result = cli("ablate", "--model", lm_folder, SENTENCE, "--layer", "0", "--json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)["ablation_run"]
    assert run["base_loss"] is not None and run["base_loss"] > 0
