"""`attnviz compare` end to end: the weights of two checkpoints through the CLI (terminal, --json,
--csv, --out) and its refusals; with a corpus, two tiny zoo LLaMA models (one with head 2 of layer
1 sharpened) through both, each number of --json checked against transformers' own attention
computed here example by example (hf-marked). Negative controls: the neighbouring head's own
numbers do not match the changed head's, and the perturbed head is the only one that moves."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SAMPLES, assert_clean_error, read_image
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_thread")

D = 4  # head_dim of the llama-gqa-tiny sample


def copy_sample(folder: Path, perturb: bool = False) -> Path:
    """llama-gqa-tiny copied; `perturb`: head 2 of layer 1 has its W_q rows shifted."""
    shutil.copytree(SAMPLES / "llama-gqa-tiny", folder)
    if perturb:
        tensors = load_file(folder / "model.safetensors")
        key = "model.layers.1.self_attn.q_proj.weight"
        tensors[key] = tensors[key].clone()
        tensors[key][2 * D:3 * D] += 0.25
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_identical_checkpoints(cli, tmp_path):
    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b")
    result = cli("compare", "--weights", a, "--against", b, env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "weights: all 8 heads byte-identical" in result.stdout
    doc = json.loads(cli("compare", "-w", a, "-a", b, "--json").stdout)
    assert doc["weights"]["all_identical"] and doc["weights"]["identical_heads"] == 8
    assert "corpus" not in doc


def test_one_perturbed_head_through_the_cli(cli, tmp_path):
    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b", perturb=True)
    doc = json.loads(cli("compare", "-w", a, "-a", b, "--json").stdout)
    weights = doc["weights"]
    assert weights["identical_heads"] == 7 and not weights["all_identical"]
    moved = [(layer["index"], h["head"]) for layer in weights["layers"] for h in layer["heads"]
             if not h["identical"]]
    assert moved == [(1, 2)]
    head = weights["layers"][1]["heads"][2]
    ta, tb = (load_file(p / "model.safetensors") for p in (a, b))
    p = "model.layers.1.self_attn."
    blocks = [(p + "q_proj.weight", np.s_[2 * D:3 * D]), (p + "k_proj.weight", np.s_[D:2 * D]),
              (p + "v_proj.weight", np.s_[D:2 * D]), (p + "o_proj.weight", np.s_[:, 2 * D:3 * D])]
    diff = sum(float(((tb[k][s].double() - ta[k][s].double()) ** 2).sum()) for k, s in blocks)
    base = sum(float((ta[k][s].double() ** 2).sum()) for k, s in blocks)
    assert head["distance"] == pytest.approx(math.sqrt(diff / base), rel=1e-12)
    assert [n for n, part in head["projections"].items() if not part["identical"]] == ["q"]
    shown = cli("compare", "-w", a, "-a", b, env={"COLUMNS": "100", "NO_COLOR": "1"}).stdout
    assert "weights: 7 of 8 heads byte-identical (F32)" in shown
    assert f"{head['distance']:.2f}" in shown.splitlines()[4]  # layer 1's row of the grid


def test_csv_and_figure(cli, tmp_path):
    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b", perturb=True)
    table, figure = tmp_path / "heads.csv", tmp_path / "f.png"
    result = cli("compare", "-w", a, "-a", b, "--csv", table, "--out", figure)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 8
    assert [(r["layer"], r["head"]) for r in rows if r["weights_identical"] == "False"] == \
        [("1", "2")]
    image = read_image(figure)
    assert image.shape[0] > 100 and image.std() > 0.01
    assert f"wrote {table}" in result.stdout


@pytest.mark.parametrize(("args", "fragments"), [
    (["--weights", str(SAMPLES / "gpt2-tiny"), "--against", str(SAMPLES / "llama-gqa-tiny")],
     ["differs in key/value heads: 4 in --weights, 2 in --against", "pair one to one"]),
    (["--weights", str(SAMPLES / "bloom-tiny"), "--against", str(SAMPLES / "gpt2-tiny")],
     ["--weights has 1 attention layers, --against 2"]),
    (["--weights", str(SAMPLES / "gpt2-tiny")], ["--against names model B"]),
    (["--against", str(SAMPLES / "gpt2-tiny")], ["--model or --weights"]),
    (["--weights", str(SAMPLES / "gpt2-tiny"), "--against", str(SAMPLES / "bert-tiny"),
      "--limit", "3"], ["--limit applies to a corpus run"]),
    (["--weights", str(SAMPLES / "gpt2-tiny"), "--against", str(SAMPLES / "bert-tiny"),
      "--overview", "max"], ["--overview chooses what the corpus's grid shows"]),
    (["--weights", str(SAMPLES / "gpt2-tiny"), "--against", str(SAMPLES / "bert-tiny"),
      "--overview", "sharpness"], ["unknown --overview 'sharpness'"]),
    ([str(SAMPLES.parent / "README.md"), "--weights", str(SAMPLES / "gpt2-tiny"),
      "--against", str(SAMPLES / "bert-tiny")], ["a corpus runs through the models' own"]),
    (["--model", str(SAMPLES / "models" / "phi3-tiny-lm"), "--against",
      str(SAMPLES / "models" / "phi3-tiny-model"), "-H", "2"], ["-H", "--model"]),
])
def test_refusals_name_what_is_wrong(cli, args, fragments):
    result = cli("compare", *args)
    assert_clean_error(result, 2, *[f.replace("-H", "--num-heads") for f in fragments])


def test_outputs_never_land_in_either_model(cli, tmp_path):
    """--csv or --out inside model B's folder (or onto its file) is refused before any work."""
    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b")
    for args in (["--csv", b / "h.csv"], ["--out", a / "f.png"]):
        result = cli("compare", "-w", a, "-a", b, *args)
        assert_clean_error(result, 1, "inside a model folder being read")
        assert not any(p.suffix in (".csv", ".png") for p in [*a.iterdir(), *b.iterdir()])
    assert cli("compare", "-w", a, "-a", b, "--csv", tmp_path / "h.csv").exit_code == 0


def test_overview_beside_json_is_refused(cli, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\n")
    phi3 = SAMPLES / "models" / "phi3-tiny-lm"
    assert_clean_error(cli("compare", corpus, "-m", phi3, "-a", phi3, "--json", "--overview",
                           "max"), 2, "--overview chooses what the terminal grid shows",
                       "--json holds every statistic")


def test_seed_needs_sample(cli, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\n")
    phi3 = SAMPLES / "models" / "phi3-tiny-lm"
    assert_clean_error(cli("compare", corpus, "-m", phi3, "-a", phi3, "--seed", "3"), 2,
                       "--seed seeds --sample's draw", "add --sample N")


# --- a corpus through two models ----------------------------------------------------------------

SENTENCES = ["the cat sat on the mat", "a small dog ran far away",
             "the big red barn in the cold night", "the cat ran far away from the dog",
             "a cat sat on the big red mat", "the small dog sat in the barn",
             "the night was cold and the cat slept"]


@pytest.fixture(scope="module")
def zoo_pair(tmp_path_factory):
    """Two zoo LLaMA models with their LM head: B has head 2 of layer 1 sharpened (its W_q rows
    times 3), so only that head's maps differ; C is A again."""
    pytest.importorskip("transformers")
    import zoo

    folder = tmp_path_factory.mktemp("pair")

    def sharpen(model):
        model.model.layers[1].self_attn.q_proj.weight[16:24] *= 3.0  # d = 8

    return (zoo.build_lm("llama", folder / "a"), zoo.build_lm("llama", folder / "b", edit=sharpen),
            zoo.build_lm("llama", folder / "c"))


def own_attention(folder: Path) -> list[list[torch.Tensor]]:
    """transformers' own eager attention of each sentence run alone: [sentence][layer] (H, n, n)."""
    import transformers
    import zoo

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = zoo.load_tokenizer(folder)
    maps = []
    with torch.no_grad():
        for text in SENTENCES:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            maps.append([a[0] for a in model(ids, output_attentions=True).attentions])
    return maps


def paired(maps_a, maps_b, layer: int, head: int, statistic: str) -> dict[str, float]:
    """The paired ratio difference and its 95% interval, written out example by example."""
    def sums(maps):
        out = []
        for example in maps:
            a = example[layer][head].double()  # (n, n)
            value = (-torch.special.xlogy(a, a).sum() if statistic == "entropy"
                     else a.max(-1).values.sum())
            out.append((float(value), a.shape[0]))
        return out

    sa, sb = sums(maps_a), sums(maps_b)
    n = len(sa)
    r_a = sum(s for s, _ in sa) / sum(c for _, c in sa)
    r_b = sum(s for s, _ in sb) / sum(c for _, c in sb)
    mean_c_a, mean_c_b = sum(c for _, c in sa) / n, sum(c for _, c in sb) / n
    z = [(s_b - r_b * c_b) / mean_c_b - (s_a - r_a * c_a) / mean_c_a
         for (s_a, c_a), (s_b, c_b) in zip(sa, sb, strict=True)]
    se = math.sqrt(sum(v * v for v in z) / (n * (n - 1)))
    from test_compare_paired import t_quantile_by_bisection

    half = t_quantile_by_bisection(0.975, n - 1) * se
    return {"a": r_a, "b": r_b, "diff": r_b - r_a, "low": r_b - r_a - half,
            "high": r_b - r_a + half}


@pytest.mark.hf
def test_corpus_difference_equals_transformers_own_attention(cli, tmp_path, zoo_pair):
    a, b, _ = zoo_pair
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    result = cli("compare", corpus, "--model", a, "--against", b, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["weights"]["identical_heads"] == 7
    assert doc["corpus"]["examples"] == len(SENTENCES)
    rows = {(r["layer"], r["head"]): r for r in doc["corpus"]["heads"]}
    maps_a, maps_b = own_attention(a), own_attention(b)
    for (layer, head), row in rows.items():
        for statistic in ("entropy", "max_weight"):
            expected = paired(maps_a, maps_b, layer, head, statistic)
            for key, value in expected.items():
                assert row[f"{statistic}_{key}"] == pytest.approx(value, abs=2e-5), \
                    (layer, head, statistic, key)
    # only the sharpened head moved, beyond its interval; every other is exactly unchanged
    moved = {key for key, row in rows.items() if row["entropy_diff"] != 0}
    assert moved == {(1, 2)}
    assert rows[1, 2]["entropy_high"] < 0  # sharper: lower entropy, interval below 0
    # negative control: the neighbouring head's own numbers are not the changed head's
    neighbour = paired(maps_a, maps_b, 1, 1, "entropy")
    assert abs(rows[1, 2]["entropy_diff"] - neighbour["diff"]) > 1e-3


@pytest.mark.hf
def test_identical_models_and_outputs(cli, tmp_path, zoo_pair):
    a, _, c = zoo_pair
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    table, figure = tmp_path / "h.csv", tmp_path / "f.png"
    result = cli("compare", corpus, "--field", "text", "-m", a, "-a", c, "--csv", table,
                 "--out", figure, "--overview", "max", env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "no head's max_weight changed beyond its interval" in result.stdout
    assert "every attention tensor of the two models is byte-identical" in result.stdout
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 8 and all(float(r["entropy_diff"]) == 0.0 for r in rows)
    assert all(r["weights_identical"] == "True" for r in rows)
    assert read_image(figure).std() > 0.01


@pytest.mark.hf
def test_label_grid_shows_each_models_type(cli, tmp_path, zoo_pair):
    """--overview label: a head's type in both models (one word where they agree), as each
    model's own corpus means name it (the JSON's type_a, type_b)."""
    a, b, _ = zoo_pair
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    shown = cli("compare", corpus, "-m", a, "-a", b, "--overview", "label",
                env={"COLUMNS": "120", "NO_COLOR": "1"}).stdout.splitlines()
    rows = json.loads(cli("compare", corpus, "-m", a, "-a", b, "--json").stdout)["corpus"]["heads"]
    from attnviz.render.overview_terminal import TYPES

    top = shown.index(next(line for line in shown if line.startswith("head types over 7")))
    for layer in (0, 1):
        cells = shown[top + 2 + layer].split()[1:]
        for head, cell in enumerate(cells):
            row = next(r for r in rows if (r["layer"], r["head"]) == (layer, head))
            expected = TYPES[row["type_a"]][0] if row["type_a"] == row["type_b"] else \
                f"{TYPES[row['type_a']][1]}>{TYPES[row['type_b']][1]}"
            assert cell == expected


@pytest.mark.hf
def test_api_returns_the_same_result(tmp_path, zoo_pair):
    from attnviz.api import compare

    a, b, _ = zoo_pair
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    result = compare(b, model=a, corpus=corpus, limit=4)
    assert result.corpus is not None and result.corpus.counts.used == 4
    d = result.corpus.difference
    s = result.corpus.statistics.index("entropy")
    assert float(d.diff[1, 2, s]) < 0 and float(d.diff[0, 0, s]) == 0.0
    assert [(h.layer, h.head) for h in result.weights.heads if not h.identical] == [(1, 2)]


def test_api_weights_and_its_refusals_by_keyword(tmp_path):
    """The API compares weights as the CLI does and refuses in its keywords' names."""
    from attnviz.api import compare
    from attnviz.errors import UsageError

    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b", perturb=True)
    result = compare(b, weights=a)
    assert [(h.layer, h.head) for h in result.weights.heads if not h.identical] == [(1, 2)]
    assert result.corpus is None and result.to_json()["weights"]["identical_heads"] == 7
    with pytest.raises(UsageError) as refused:
        compare(b, weights=a, limit=3)
    assert str(refused.value).startswith("limit applies to a corpus run")
    with pytest.raises(UsageError) as refused:
        compare(b, weights=a, corpus=tmp_path / "c.txt")
    assert "pass model folders with model and against" in refused.value.one_line()
    with pytest.raises(TypeError):
        compare(b, weights=a, limit=2.5)
