"""`attnviz generate`: attention while a model writes, checked step by step against transformers.

Each architecture is built tiny by transformers itself, with its language-model head (the
zoo's configs and tokenizer, `AutoModelForCausalLM` / `AutoModelForSeq2SeqLM`). For each:
the generated ids equal `model.generate`'s; every captured row equals the one transformers'
own `generate(output_attentions=True, return_dict_in_generate=True)` with eager attention
returns at that step (≤ 1e-5); the full map equals one teacher-forced forward over prompt +
generated tokens (≤ 1e-5); and a row shifted by one step fails the same comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

TOL = 1e-5
N_NEW = 5
# kind: the zoo row whose config, tokenizer and sharpening the LM variant shares
ARCHITECTURES = ["llama", "gpt2", "gemma2", "qwen2", "phi3", "marian", "t5", "bloom"]
PROMPTS = ["the cat sat on the mat", "a small dog ran far away"]


@pytest.fixture(scope="session")
def lm_folder(tmp_path_factory: Any) -> Any:
    import zoo

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = zoo.build_lm(kind, tmp_path_factory.mktemp(f"lm_{kind}"))
        return built[kind]

    return get


def _run(folder: Path, prompts: list[str], n: int = N_NEW, **spec: Any) -> tuple[Any, Any, Any]:
    from attnviz.core.request import GenerateSpec
    from attnviz.sources.hf.generate import load_lm
    from attnviz.sources.hf.generate_maps import run_generation
    from attnviz.sources.hf.inputs import encode
    from attnviz.sources.hf.load import open_model

    opened = open_model(str(folder))
    rows = [r["input_ids"] for r in encode(opened, prompts).rows]
    loaded = load_lm(opened)
    run, generation = run_generation(loaded, prompts, rows, GenerateSpec(n, **spec))
    return run, generation, rows


def _reference(folder: Path, ids: list[int], encdec: bool, n: int = N_NEW) -> Any:
    """transformers' own eager generate, with the attentions it returns."""
    import torch
    import transformers
    import zoo

    auto = transformers.AutoModelForSeq2SeqLM if encdec else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(folder, attn_implementation="eager").eval()
    pad = model.generation_config.pad_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             output_attentions=True, return_dict_in_generate=True,
                             pad_token_id=zoo.EOS if pad is None else pad)
    return model, out


def _rows_of_steps(out: Any, layer_kind: str) -> list[tuple[Any, ...]]:
    """Per step, the per-layer maps generate returned."""
    if layer_kind == "self":
        return list(out.attentions)
    return list(out.decoder_attentions if layer_kind == "decoder-self" else out.cross_attentions)


def _stack(run: Any, kind: str) -> list[Any]:
    return [layer for layer in run.layers if layer.kind == kind]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_rows_equal_generate_step_by_step(lm_folder: Any, kind: str) -> None:
    import torch

    folder = lm_folder(kind)
    run, generation, rows = _run(folder, PROMPTS[:1])
    model, out = _reference(folder, rows[0], generation.encoder_decoder)
    encdec = generation.encoder_decoder
    width = 1 if encdec else len(rows[0])
    expected_ids = out.sequences[0, width:].tolist()
    assert generation.generated_ids[0] == expected_ids[:len(generation.generated_ids[0])]
    assert len(generation.generated_ids[0]) == len(expected_ids)  # stops where generate stops
    kinds = ["decoder-self", "cross"] if encdec else ["self"]
    compared = shifted_fails = 0
    for layer_kind in kinds:
        steps = _rows_of_steps(out, layer_kind)
        for i, layer in enumerate(_stack(run, layer_kind)):
            maps = layer.weights[0]  # (H, P, K)
            for step, per_layer in enumerate(steps):
                ref = per_layer[i][0]  # (H, rows, K)
                rows_now, keys = ref.shape[1:]
                start = 0 if step == 0 else width + step - 1
                # a sliding-window cache hands the step only its most recent keys
                first = 0 if step == 0 or layer_kind == "cross" else start + 1 - keys
                mine = maps[:, start:start + rows_now, first:first + keys]
                torch.testing.assert_close(mine, ref, atol=TOL, rtol=0)
                compared += 1
                if step > 0 and start + 1 < maps.shape[1]:  # negative control: next step's row
                    shifted = maps[:, start + 1:start + 2, first + 1:first + 1 + keys]
                    if layer_kind == "cross":
                        shifted = maps[:, start + 1:start + 2, :keys]
                    shifted_fails += not torch.allclose(shifted, ref, atol=TOL, rtol=0)
    assert compared >= 2 * len(steps) and shifted_fails >= len(steps) - 2


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_full_map_equals_teacher_forced_forward(lm_folder: Any, kind: str) -> None:
    import torch

    folder = lm_folder(kind)
    run, generation, rows = _run(folder, PROMPTS)
    model, _ = _reference(folder, rows[0], generation.encoder_decoder, 1)
    for b, prompt in enumerate(rows):
        controls = shifted_fails = 0
        produced = generation.generated_ids[b]
        with torch.no_grad():
            if generation.encoder_decoder:
                start = model.config.decoder_start_token_id
                out = model(input_ids=torch.tensor([prompt]),
                            decoder_input_ids=torch.tensor([[start] + produced]),
                            output_attentions=True)
                pairs = [("self", out.encoder_attentions), ("decoder-self",
                         out.decoder_attentions), ("cross", out.cross_attentions)]
            else:
                out = model(torch.tensor([prompt + produced]), output_attentions=True)
                pairs = [("self", out.attentions)]
        for layer_kind, maps in pairs:
            for layer, ref in zip(_stack(run, layer_kind), maps, strict=True):
                h, q, k = ref[0].shape
                mine = layer.weights[b, :, :q, :k]
                torch.testing.assert_close(mine, ref[0], atol=TOL, rtol=0)
                assert float(layer.weights[b, :, q:].abs().sum()) == 0  # padding stays zero
                if layer_kind in ("decoder-self", "self") and (
                        layer_kind != "self" or not generation.encoder_decoder):
                    rolled = torch.roll(mine, 1, dims=1)  # each row one step late
                    controls += 1
                    shifted_fails += not torch.allclose(rolled, ref[0], atol=TOL, rtol=0)
        # negative control: the check fails on causal rows one step late (cross rows are left
        # out: a tiny random model repeats its token, and then its cross rows repeat too)
        assert shifted_fails == controls > 0


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "marian"])
def test_batch_equals_each_prompt_alone(lm_folder: Any, kind: str) -> None:
    """Left padding (decoders) and right padding (an encoder's source) change nothing."""
    import torch

    folder = lm_folder(kind)
    run, generation, _ = _run(folder, PROMPTS)
    for b, prompt in enumerate(PROMPTS):
        alone, alone_generation, _ = _run(folder, [prompt])
        assert generation.generated_ids[b] == alone_generation.generated_ids[0]
        for layer, single in zip(run.layers, alone.layers, strict=True):
            q, k = single.weights.shape[2:]
            torch.testing.assert_close(layer.weights[b, :, :q, :k], single.weights[0],
                                       atol=TOL, rtol=0)
    # negative control: the two prompts' maps differ, so equality above is not vacuous
    assert generation.generated_ids[0] != generation.generated_ids[1] or not torch.allclose(
        run.layers[-1].weights[0], run.layers[-1].weights[1])


@pytest.mark.hf
@pytest.mark.slow
def test_sampling_is_reproducible_and_is_generates(lm_folder: Any) -> None:
    """--sample with a seed: the draw transformers' generate makes under the same seed and
    settings; the same seed twice gives the same tokens, another seed other tokens."""
    import torch

    folder = lm_folder("llama")
    settings = dict(sample=True, temperature=1.5, top_p=0.9)
    runs = {seed: _run(folder, PROMPTS[:1], 8, seed=seed, **settings)[1].generated_ids[0]
            for seed in (1, 2)}
    again = _run(folder, PROMPTS[:1], 8, seed=1, **settings)[1].generated_ids[0]
    assert runs[1] == again
    assert runs[1] != runs[2]
    _, _, rows = _run(folder, PROMPTS[:1], 1)
    model, _ = _reference(folder, rows[0], False, 1)
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(torch.tensor(rows), max_new_tokens=8, do_sample=True,
                             temperature=1.5, top_p=0.9, top_k=0, pad_token_id=1)
    assert out[0, len(rows[0]):].tolist()[:len(runs[1])] == runs[1]


@pytest.mark.hf
def test_max_tokens_counts_generated_tokens_before_loading(zoo_model: Any, cli: Any,
                                                           monkeypatch: Any) -> None:
    from helpers import assert_clean_error

    from attnviz.sources.hf import generate as gen

    def never(*_: Any, **__: Any) -> None:
        raise AssertionError("the weights loaded")

    monkeypatch.setattr(gen, "load_lm", never)
    monkeypatch.setattr("attnviz.sources.hf.generate.load_lm", never)
    folder = zoo_model("llama")  # "<s> the cat sat on the mat": 7 tokens
    result = cli("generate", "--model", folder, "the cat sat on the mat", "--max-new-tokens", "4",
                 "--budget", "tokens=10")
    assert_clean_error(result, 2, "sentence 1 with 4 generated tokens", "11")


@pytest.mark.parametrize("args, fragment", [
    (["--max-new-tokens", "2", "--temperature", "0.5"], "--sample"),
    (["--max-new-tokens", "2", "--seed", "3"], "--sample"),
    (["--max-new-tokens", "2", "--sample", "--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "5000"], "--max-new-tokens must be 1..4096"),  # the library's bound
    (["--max-new-tokens", "2", "--budget", "panels=1"], "--budget panels"),
])
def test_generate_usage_errors(cli: Any, args: list[str], fragment: str) -> None:
    from helpers import assert_clean_error

    assert_clean_error(cli("generate", "the cat sat", *args), 2, fragment)


@pytest.mark.parametrize("args", [["--random"], ["--query", "cat"], ["--weights", "x"],
                                  ["--weighting", "norm"], ["--mode", "mean"]])
def test_generate_has_no_options_that_cannot_apply(cli: Any, args: list[str]) -> None:
    """What `heatmap --generate` refused after parsing is no option of `generate` at all."""
    from helpers import assert_clean_error

    assert_clean_error(cli("generate", "the cat sat", *args), 2, "No such option", args[0])


@pytest.mark.hf
def test_model_without_head_is_refused(cli: Any) -> None:
    from helpers import assert_clean_error

    result = cli("generate", "--model", "sample_weights/models/phi3-tiny-model", "the cat",
                 "--max-new-tokens", "2")
    assert_clean_error(result, 1, "lm_head.weight", "language-model head")


# --- the bundled model --------------------------------------------------------------------------

def _reference_tiny() -> Any:
    """The training script's own TinyAttnModel with the bundled weights: an independent forward
    (torch's nn.MultiheadAttention, its own unembedding) to check attnviz's generation against."""
    import importlib.util

    from safetensors.torch import load_file

    from attnviz.data import BUNDLED

    spec = importlib.util.spec_from_file_location(
        "train_induction", ROOT / "sample_weights" / "train_induction.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TinyAttnModel(1024, 64, 64, 2, 2)
    model.load_state_dict(load_file(str(BUNDLED)))
    return model.eval()


def _bundled_run(sentences: list[str], n: int, **spec: Any) -> tuple[Any, Any]:
    import torch

    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.request import GenerateSpec
    from attnviz.sources import bundled
    from attnviz.sources.bundled_generate import continue_text

    return continue_text(bundled.open_bundled(), make_batch(sentences), GenerateSpec(n, **spec),
                         None, torch.device("cpu"))


def test_bundled_model_continues_with_induction() -> None:
    """Greedy ids equal the reference model's argmax step by step; every row equals the
    reference's map over the same ids (≤ 1e-5); a row one step late does not."""
    import torch

    sentences = ["the cat sat on the mat the cat", "one two three four one two"]
    run, generation = _bundled_run(sentences, 4)
    assert generation.generated_tokens[0] == ["sat", "on", "the", "mat"]  # induction copies
    reference = _reference_tiny()
    for b, prompt in enumerate(generation.prompt_ids):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
            _, maps = reference(torch.tensor([ids]), need_weights=True)
        assert ids[len(prompt):] == generation.generated_ids[b]
        n = len(ids)
        for layer, ref in zip(run.layers, maps, strict=True):
            mine = layer.weights[b, :, :n, :n]
            torch.testing.assert_close(mine, ref[0], atol=TOL, rtol=0)
            assert not torch.allclose(torch.roll(mine, 1, dims=1), ref[0], atol=TOL, rtol=0)


def test_bundled_unknown_id_prints_as_unnamed_and_sampling_repeats() -> None:
    from attnviz.core.words import hashed_ids

    first = _bundled_run(["a b c d e f"], 6, sample=True, temperature=3.0, seed=7)[1]
    again = _bundled_run(["a b c d e f"], 6, sample=True, temperature=3.0, seed=7)[1]
    assert first.generated_ids == again.generated_ids
    words = dict(zip(hashed_ids(list("abcdef"), 1024), "abcdef", strict=True))
    assert first.generated_tokens[0] == [words.get(i, f"<id {i}>")
                                         for i in first.generated_ids[0]]
    assert any(i not in words for i in first.generated_ids[0])  # an unnamed id is checked
    other = _bundled_run(["a b c d e f"], 6, sample=True, temperature=3.0, seed=8)[1]
    assert other.generated_ids != first.generated_ids


@pytest.mark.slow
def test_bundled_cli_json_and_export(cli: Any, tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    result = cli("generate", "the cat sat on the mat the cat", "--max-new-tokens", "4", "--stats")
    assert result.exit_code == 0, result.output
    assert "sat on the mat" in result.stdout
    assert "what each generated token attends to" in result.stdout
    doc = json.loads(cli("generate", "the cat sat on the mat the cat", "--max-new-tokens", "4",
                         "--json").stdout)
    assert doc["generation"]["generated_tokens"] == [["sat", "on", "the", "mat"]]
    assert doc["generation"]["prompt_length"] == [8]
    assert len(doc["generation"]["focus"]) == 4 and doc["tokens"][0][8:] == ["sat", "on", "the",
                                                                               "mat"]
    out = tmp_path / "gen.safetensors"
    assert cli("generate", "the cat sat on the mat the cat", "--max-new-tokens", "4", "--export",
               out).exit_code == 0
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        assert json.loads(meta["generated_tokens"]) == [["sat", "on", "the", "mat"]]
        assert json.loads(meta["prompt_length"]) == [8]
        assert list(f.get_tensor("attn.1").shape) == [1, 2, 12, 12]


@pytest.mark.hf
@pytest.mark.slow
def test_marian_sample_cli_export(cli: Any, tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    out = tmp_path / "m.safetensors"
    result = cli("generate", "--model", "sample_weights/models/marian-tiny-model",
                 "the cat sat on the mat", "a dog", "--max-new-tokens", "3", "--export", out)
    assert result.exit_code == 0, result.output
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        generated = json.loads(meta["generated_ids"])
        rows = max(1 + len(g) for g in generated)
        assert list(f.get_tensor("cross.1").shape)[2] == rows
        assert list(f.get_tensor("decoder.0").shape)[2:] == [rows, rows]
        assert json.loads(meta["prompt_length"]) == [1, 1]


@pytest.mark.slow
def test_figure_marks_the_prompt_generated_boundary(cli: Any, tmp_path: Path) -> None:
    """The boundary's red lines are in the --generate figure (read back), and in no plain one;
    the solid line sits between the last prompt row and the first generated row."""
    import numpy as np
    from helpers import read_image

    def red(path: Path) -> Any:
        image = read_image(path)[..., :3].astype(float)
        if image.max() <= 1.0:
            image = image * 255
        return (image[..., 0] > 200) & (image[..., 1] < 90) & (image[..., 2] < 90)

    marked, plain = tmp_path / "gen.png", tmp_path / "plain.png"
    sentence = "the cat sat on the mat the cat"
    assert cli("generate", sentence, "--max-new-tokens", "4", "--out", marked, "--quiet",
               "--layer", "1", "--head", "0").exit_code == 0
    assert cli("heatmap", sentence + " sat on the mat", "--out", plain, "--quiet",
               "--layer", "1", "--head", "0").exit_code == 0
    assert not red(plain).any()  # negative control: the same map without --generate
    mask = red(marked)
    line_row = int(mask.sum(axis=1).argmax())  # the solid horizontal line
    line_col = int(mask.sum(axis=0).argmax())  # the dashed vertical one spans the panel
    top, bottom = np.nonzero(mask[:, line_col])[0][[0, -1]]
    assert mask[line_row].sum() > (bottom - top) // 2
    # 8 prompt rows of 12: the line lies 8/12 of the way down the panel (within 4 pixels)
    assert abs(line_row - (top + 8 / 12 * (bottom - top))) <= 4
    assert abs(line_col - (mask[line_row].nonzero()[0][0] + 8 / 12 * (bottom - top))) <= 4


@pytest.mark.slow
def test_html_page_covers_the_whole_sequence_and_names_the_boundary(cli: Any,
                                                                     tmp_path: Path) -> None:
    page = tmp_path / "gen.html"
    assert cli("generate", "the cat sat on the mat the cat", "--max-new-tokens", "4", "--html",
               page, "--quiet").exit_code == 0
    text = page.read_text()
    assert "generated, sentence 1: rows 8-11 (sat on the mat)" in text
    assert "http://" not in text and "https://" not in text  # offline: nothing fetched


@pytest.mark.hf
@pytest.mark.slow
def test_encoders_are_refused(cli: Any, tmp_path: Path) -> None:
    """DistilBERT has no causal-LM class; a BERT with its masked-LM head loads as a causal LM
    in transformers but attends to later tokens: both refused, before and after the run."""
    import zoo
    from helpers import assert_clean_error

    result = cli("generate", "--model", "sample_weights/models/distilbert-tiny-model", "the cat",
                 "--max-new-tokens", "2")
    assert_clean_error(result, 1, "distilbert models cannot generate")
    zoo.build_lm("bert", tmp_path, "BertForMaskedLM")
    result = cli("generate", "--model", tmp_path, "the cat sat", "--max-new-tokens", "2")
    assert_clean_error(result, 1, "not causal")


@pytest.mark.hf
@pytest.mark.slow
def test_figure_cross_strip_is_the_alignment_as_produced(tmp_path: Path) -> None:
    """Marian: beside the full maps, a strip per sentence of its generated tokens × the source,
    from the last cross layer (mean over heads). Read back from the PNG, each strip cell's colour
    is viridis of its row's weight (the row computed when the token was fed back in) over the
    strip's maximum; the rows one step earlier do not give those colours."""
    from helpers import read_image

    from attnviz.api import run_model
    from attnviz.render.figure import heatmap_figure
    from attnviz.render.figure_io import save_figure

    result = run_model("sample_weights/models/marian-tiny-model",
                       ["the cat sat on the mat", "a dog ran"], generate=3, device="cpu")
    plain = heatmap_figure(result.views, result.title(), size=1.0)
    fig = result.figure(size=1.0)
    assert fig.get_size_inches()[0] > plain.get_size_inches()[0]  # grown to the right
    strips = [ax for ax in fig.axes if ax.get_ylabel() == "generated (own scale)"]
    assert len(strips) == 2
    path = tmp_path / "strip.png"
    save_figure(fig, path)
    image = read_image(path)[..., :3].astype(float)
    image = image * 255 if image.max() <= 1.0 else image
    assert image.shape[1] == round(fig.get_size_inches()[0] * fig.dpi)
    cross = [layer for layer in result.run.layers if layer.kind == "cross"][-1]
    for b, ax in enumerate(strips):
        count, n = len(result.generation.generated_ids[b]), len(result.run.batch.tokens[b])
        maps = cross.weights[b, :, :, :n].mean(0).numpy()  # (target rows, source)

        box = ax.get_window_extent()
        assert _strip_error(image, box, maps[1:1 + count]) <= 3  # the generated tokens' rows
        assert _strip_error(image, box, maps[0:count]) > 3  # control: one step earlier fails
    assert image[:, :image.shape[1] // 2].std() > 20  # the maps themselves, not blank


def _strip_error(image: Any, box: Any, rows: Any) -> float:
    """The largest difference (0-255) between the strip's cell centres in the image and
    viridis of `rows` (T, S) over their maximum."""
    import matplotlib
    import numpy as np

    count, n = rows.shape
    want = matplotlib.colormaps["viridis"](rows / rows.max())[..., :3] * 255  # (T, S, 3)
    got = np.zeros_like(want)
    for r in range(count):
        for c in range(n):
            x = box.x0 + (c + 0.5) * box.width / n
            y = image.shape[0] - (box.y0 + box.height - (r + 0.5) * box.height / count)
            got[r, c] = image[int(y), int(x)]
    return float(np.abs(got - want).max())


@pytest.mark.slow
def test_focus_by_ranked_heads(cli: Any) -> None:
    """--rank with --generate: per head type, its first-ranked head's top keys per generated
    token; every weight equals the reference model's map at that row (≤ 1e-5), the listed keys
    are that row's largest, and the row one step earlier does not give those weights."""
    import json

    import torch

    sentence = "the cat sat on the mat the cat"
    result = cli("generate", sentence, "--max-new-tokens", "4", "--rank", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    ids = doc["generation"]["generated_ids"][0]
    reference = _reference_tiny()
    from attnviz.core.words import hashed_ids

    prompt = hashed_ids(sentence.split(), 1024)
    with torch.no_grad():
        _, maps = reference(torch.tensor([prompt + ids]), need_weights=True)
    firsts = {(r["heads"][0]["layer"], r["heads"][0]["head"]): r["type"]
              for r in doc["ranking"] if r["heads"] and r["heads"][0]["score"] > 0}
    picked = doc["generation"]["focus_by_rank"]
    assert {(int(p["focus"][0]["layer"]), p["focus"][0]["head"]) for p in picked} == set(firsts)
    assert "induction" in [t for p in picked for t in p["types"]]
    for entry in picked:
        assert len(entry["focus"]) == 4
        for item in entry["focus"]:
            row = maps[int(item["layer"])][0, item["head"], item["row"]]  # (n,)
            want = row.topk(len(item["top"]))
            got = [t["weight"] for t in item["top"]]
            torch.testing.assert_close(torch.tensor(got), want.values, atol=TOL, rtol=0)
            assert [t["position"] for t in item["top"]][0] == int(want.indices[0])
            earlier = maps[int(item["layer"])][0, item["head"], item["row"] - 1]
            assert not torch.allclose(earlier[[t["position"] for t in item["top"]]],
                                      torch.tensor(got), atol=TOL, rtol=0)
    text = cli("generate", sentence, "--max-new-tokens", "4", "--rank", "--no-maps",
               "--no-stats").stdout
    assert "the key the heads --rank puts first weigh most" in text and "induction" in text


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "marian"])
def test_long_generation_streams_within_the_budget(lm_folder: Any, kind: str,
                                                   tmp_path: Path) -> None:
    """Past the memory budget, --generate streams: the same generated ids, display maps equal
    to the whole-map run's (≤ 1e-5; a row shifted by one step is not), the same statistics;
    --export written block by block equals the whole-map export and carries the generation."""
    import json

    import numpy as np
    import torch
    from safetensors import safe_open

    from attnviz.app.heatmap import run_heatmap
    from attnviz.compute.display.maps import select_maps
    from attnviz.core.request import GenerateSpec, HeatmapRequest

    folder = str(lm_folder(kind))

    def job(**extra: Any) -> Any:
        return run_heatmap(HeatmapRequest.build(
            sentences=tuple(PROMPTS), model=folder, device="cpu", generate=GenerateSpec(N_NEW),
            **extra))

    whole = job()
    streamed = job(memory_budget=2048)
    assert streamed.generation.generated_ids == whole.generation.generated_ids
    assert any("teacher-forced forward" in note for note in streamed.run.notes)
    kept = [layer for layer in streamed.run.layers if layer.weights is None]
    assert kept, "nothing streamed"
    views = {(v.sentence, v.layer, v.head): v.values for layer in kept
             for v in layer.streamed.views}
    for view in select_maps(whole.run, None, False) + select_maps(whole.run, None, True):
        if (view.sentence, view.layer, view.head) not in views:
            continue
        got = views.pop((view.sentence, view.layer, view.head))
        np.testing.assert_allclose(got, view.values, atol=TOL, rtol=0)
        if got.shape[0] > 2:  # negative control: one step off
            assert np.abs(got[1:] - view.values[:-1]).max() > TOL
    assert not views
    stats = {(s.layer, s.head): s for s in streamed.head_stats}
    for s in whole.head_stats:
        if (s.layer, s.head) in stats and s.layer in {layer.index for layer in kept}:
            assert stats[(s.layer, s.head)].entropy == pytest.approx(s.entropy, abs=1e-4)
    path, reference = tmp_path / "streamed.safetensors", tmp_path / "whole.safetensors"
    exported = job(memory_budget=2048, keep_full_maps=True, export=path)
    assert exported.run.exported == path
    whole_export = job(keep_full_maps=True)
    whole_export.export(reference)
    with safe_open(str(path), "pt") as got, safe_open(str(reference), "pt") as want:
        meta = got.metadata()
        assert json.loads(meta["generated_ids"]) == whole.generation.generated_ids
        assert json.loads(meta["prompt_length"]) == whole.generation.prompt_lengths
        for key in want.keys():
            if key.startswith(("attn.", "decoder.", "cross.")):
                torch.testing.assert_close(got.get_tensor(key), want.get_tensor(key),
                                           atol=TOL, rtol=0)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])
def test_one_layer_shown_captures_only_it(lm_folder: Any, kind: str) -> None:
    """--layer on a decoder: only that layer is captured (the others run through sdpa, or
    eager where the model refuses sdpa); its maps and the generated ids equal the every-layer
    run's (≤ 1e-5), and another layer's maps would not."""
    import torch

    from attnviz.app.heatmap import run_heatmap
    from attnviz.core.request import GenerateSpec, HeatmapRequest

    folder = str(lm_folder(kind))
    every = run_heatmap(HeatmapRequest.build(
        sentences=tuple(PROMPTS), model=folder, device="cpu", generate=GenerateSpec(N_NEW)))
    one = run_heatmap(HeatmapRequest.build(
        sentences=tuple(PROMPTS), model=folder, device="cpu", layer="-1",
        generate=GenerateSpec(N_NEW)))
    assert one.generation.generated_ids == every.generation.generated_ids
    assert [layer.label for layer in one.run.layers] == [every.run.layers[-1].label]
    torch.testing.assert_close(one.run.layers[0].weights, every.run.layers[-1].weights,
                               atol=TOL, rtol=0)
    assert not torch.allclose(one.run.layers[0].weights, every.run.layers[0].weights,
                              atol=TOL, rtol=0)


@pytest.mark.hf
def test_max_sentences_binds_on_a_model(cli: Any) -> None:
    """`generate --model` used to run every sentence whatever --budget sentences= said (the
    option walker found it dropped); the bundled model's batch always checked it."""
    from helpers import assert_clean_error

    model = "sample_weights/models/phi3-tiny-lm"
    args = ("generate", "--model", model, "the cat", "a dog", "-n", "2", "--no-maps",
            "--no-stats")
    assert_clean_error(cli(*args, "--budget", "sentences=1"), 2,
                       "2 sentences exceed --budget sentences 1")
    assert cli(*args, "--budget", "sentences=2").exit_code == 0  # control: within the limit
