"""CTRL's LM head (transformers' CTRLLMHeadModel, the zoo's tiny random one) in attribute, lens,
ablate and patch, each number checked against CTRL's own forward, run here by transformers with
hand-written hooks and no attnviz code.

CTRL is the case no naming row covers: its attention (`transformer.h.N.multi_head_attention`,
Wq/Wk/Wv/dense) is found only by discovery (the model built on the meta device), and its final
norm (`transformer.layernorm`) by no name the final-norm finder knows, only by running after the
last layer (`decoder_anatomy.norms_after_layers`). Each test has a negative control: the same
check on a wrong computation (no final norm, another head's columns, the previous position)
fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

PROMPT = "the cat sat on the mat the cat sat on the"
CLEAN, CORRUPT = "the cat sat on the mat", "the dog sat on the mat"
TOL = 1e-5  # float32 logits of a 32-wide model: agreement is ~1e-7
# patch's clean and corrupted metrics differ by ~1e-4 in the random model, its head cells by
# ~1e-5 from each other: they are checked to 1e-6 (measured agreement: ~6e-8)
PATCH_TOL = 1e-6


@pytest.fixture(scope="module")
def ctrl(zoo_lm) -> Path:
    return zoo_lm("ctrl")


@pytest.fixture(scope="module")
def own(ctrl: Path) -> Any:
    """CTRL loaded by transformers here, apart from attnviz, and its tokenizer."""
    import torch
    import transformers
    from zoo import load_tokenizer

    model = transformers.CTRLLMHeadModel.from_pretrained(ctrl, dtype=torch.float32).eval()
    return model, load_tokenizer(ctrl)


def run_json(cli, *args: Any) -> dict[str, Any]:
    result = cli(*args, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def logits_of(model: Any, ids: list[int]) -> Any:
    """(L, V) float64 logits of CTRL's own forward."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double()


def test_the_final_norm_found_is_the_one_that_runs_after_the_last_layer(ctrl, own) -> None:
    """On CTRL the rule finds transformer.layernorm; it finds the same norm the names find on
    families whose final norm has a listed name, among them OPT (final norm registered before
    its layers) and mBART (an embedding norm outside the layers too); on BART (post-norm) it
    finds none."""
    from zoo import lm_model

    from attnviz.sources.hf.decoder_anatomy import FINAL_NORMS, norms_after_layers

    model, _ = own
    assert [n for n, _ in norms_after_layers(model, model, "", "transformer.h")] == \
        ["transformer.layernorm"]
    assert "layernorm" not in FINAL_NORMS  # the rule, not a name, finds CTRL's
    for kind, blocks in (("llama", "model.layers"), ("gpt2", "transformer.h"),
                         ("opt", "model.decoder.layers"), ("mbart", "model.decoder.layers"),
                         ("bart", "model.decoder.layers")):
        other = lm_model(kind).eval()
        stack = other.get_decoder() if other.config.is_encoder_decoder else other
        prefix = next(name for name, module in other.named_modules() if module is stack)
        named = [name for name, _ in other.named_modules() if name.startswith(prefix)
                 and name.rsplit(".", 1)[-1] in FINAL_NORMS and not name.startswith(blocks)]
        found = [n for n, _ in norms_after_layers(other, stack, prefix, blocks)]
        assert found == named, kind
        assert (found == []) == (kind == "bart"), kind  # control: a post-norm model has none


def test_attribute_parts_add_up_to_ctrls_own_logit_difference(cli, ctrl, own) -> None:
    """The parts sum to CTRL's own logit(mat) − logit(cat) at the last token; control: the same
    logits with the final norm taken out (the module's output replaced by its input) differ."""

    model, tokenizer = own
    doc = run_json(cli, "attribute", PROMPT, "-a", "mat", "--wrong", "cat", "--model", ctrl)
    prompt = doc["prompts"][0]
    assert "transformer.layernorm" in doc["final_norm"]
    ids = tokenizer.convert_tokens_to_ids(prompt["tokens"])
    answer, wrong = prompt["answer"]["id"], prompt["wrong"]["id"]
    logits = logits_of(model, ids)[prompt["position"]]
    metric = float(logits[answer] - logits[wrong])
    assert prompt["parts"]["sum"] == pytest.approx(metric, abs=TOL)
    assert prompt["model_metric_after_transform"] == pytest.approx(metric, abs=TOL)
    handle = model.transformer.layernorm.register_forward_hook(lambda _m, args, _o: args[0])
    try:
        bare = logits_of(model, ids)[prompt["position"]]
    finally:
        handle.remove()
    assert abs(float(bare[answer] - bare[wrong]) - prompt["parts"]["sum"]) > 1e-3  # control


def test_lens_last_row_is_ctrls_own_distribution(cli, ctrl, own) -> None:
    """The lens's last row is CTRL's own next-token probability of the answer at every position;
    control: its first row (the embeddings) is not."""
    import torch

    model, tokenizer = own
    doc = run_json(cli, "lens", PROMPT, "-a", "mat", "--top", "2", "--model", ctrl)
    prompt = doc["prompts"][0]
    probs = torch.softmax(logits_of(model, tokenizer.convert_tokens_to_ids(prompt["tokens"])),
                          -1)
    answer = prompt["answer"]["id"]
    own_probs = [float(probs[p, answer]) for p in prompt["positions"]]
    assert [c["answer_prob"] for c in prompt["cells"][-1]] == pytest.approx(own_probs, abs=1e-6)
    first = [c["answer_prob"] for c in prompt["cells"][0]]
    assert max(abs(a - b) for a, b in zip(first, own_probs, strict=True)) > 1e-4  # control


def zeroed_loss(model: Any, ids: list[int], layer: int, head: int, d: int) -> float:
    """CTRL's own next-token loss with head `head`'s columns of W_O's input (dense's input)
    zeroed in layer `layer` at every position: a hand-written hook."""
    import torch

    def hook(_module: Any, args: Any) -> Any:
        x = args[0].clone()
        x[..., head * d:(head + 1) * d] = 0
        return (x,)

    dense = model.transformer.h[layer].multi_head_attention.dense
    handle = dense.register_forward_pre_hook(hook)
    try:
        logits = logits_of(model, ids)
    finally:
        handle.remove()
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


def test_ablate_scores_ctrls_own_loss_with_each_head_zeroed(cli, ctrl, own) -> None:
    """The base loss is CTRL's own next-token loss; each head's loss change is CTRL's own loss
    with that head's W_O columns zeroed (so ablate found dense as W_O, with the columns
    discovery says) minus the base; control: the neighbouring head's columns give another."""
    import torch

    model, tokenizer = own
    doc = run_json(cli, "ablate", PROMPT, "--layer", "all", "--model", ctrl)
    ids = tokenizer.convert_tokens_to_ids(doc["tokens"][0])
    base = float(torch.nn.functional.cross_entropy(logits_of(model, ids)[:-1],
                                                   torch.tensor(ids[1:])))
    assert doc["ablation_run"]["base_loss"] == pytest.approx(base, abs=TOL)
    d = model.config.n_embd // model.config.n_head
    entries = doc["ablation"]
    assert len(entries) == model.config.n_layer * model.config.n_head
    for entry in entries:
        layer, head = entry["layer"], entry["head"]
        assert entry["loss_change"] == pytest.approx(
            zeroed_loss(model, ids, layer, head, d) - base, abs=TOL), (layer, head)
    entry = max(entries, key=lambda e: abs(e["loss_change"]))
    neighbour = (entry["head"] + 1) % model.config.n_head
    wrong = zeroed_loss(model, ids, entry["layer"], neighbour, d) - base
    assert abs(wrong - entry["loss_change"]) > TOL  # control


def test_patch_baselines_and_head_cells_are_ctrls_own(cli, ctrl, own) -> None:
    """The baselines are CTRL's own logit(cat) − logit(dog) on each prompt; each head cell,
    back on the metric's scale, is CTRL's own metric on the corrupted prompt with that head's
    columns of dense's input taken from the clean run at every position; control: the same
    metric one token earlier is not the baseline, and the head cell farthest from 0 is not the
    neighbouring head's."""
    import torch

    model, tokenizer = own
    doc = run_json(cli, "patch", CLEAN, "-c", CORRUPT, "-a", "cat", "--wrong", "dog",
                   "--model", ctrl)
    pair = doc["pairs"][0]
    answer, wrong = tokenizer.convert_tokens_to_ids(pair["answer"] + [pair["wrong"]])
    clean, corrupt = (tokenizer.convert_tokens_to_ids(pair[s]) for s in ("clean", "corrupt"))
    metric = {}
    for key, ids in (("clean", clean), ("corrupted", corrupt)):
        logits = logits_of(model, ids)
        metric[key] = float(logits[-1, answer] - logits[-1, wrong])
        assert doc["baselines"][key][0] == pytest.approx(metric[key], abs=TOL), key
        earlier = float(logits[-2, answer] - logits[-2, wrong])
        assert abs(earlier - doc["baselines"][key][0]) > TOL  # control
    grid = next(g for g in doc["grids"] if g["site"] == "heads")
    d = model.config.n_embd // model.config.n_head
    span = doc["baselines"]["clean_mean"] - doc["baselines"]["corrupted_mean"]
    own_cells = [[patched_metric(model, clean, corrupt, layer, head, d, (answer, wrong))
                  for head in range(model.config.n_head)] for layer in range(model.config.n_layer)]
    shown = [[doc["baselines"]["corrupted_mean"] + value * span for value in row]
             for row in grid["mean"]]
    for layer, (row, own_row) in enumerate(zip(shown, own_cells, strict=True)):
        assert row == pytest.approx(own_row, abs=PATCH_TOL), layer
    layer, head = max(((i, h) for i in range(len(shown)) for h in range(len(shown[i]))),
                      key=lambda c: abs(grid["mean"][c[0]][c[1]]))
    neighbour = own_cells[layer][(head + 1) % model.config.n_head]
    assert abs(neighbour - shown[layer][head]) > PATCH_TOL  # control
    assert torch.isfinite(torch.tensor(grid["mean"])).all()


def patched_metric(model: Any, clean: list[int], corrupt: list[int], layer: int, head: int,
                   d: int, tokens: tuple[int, int]) -> float:
    """CTRL's own logit difference at the corrupted prompt's last token, with head `head`'s
    columns of layer `layer`'s dense input taken from the clean run at every position."""
    dense = model.transformer.h[layer].multi_head_attention.dense
    seen: list[Any] = []
    handle = dense.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        logits_of(model, clean)
    finally:
        handle.remove()
    cols = slice(head * d, (head + 1) * d)

    def patch(_m: Any, args: Any) -> Any:
        x = args[0].clone()
        x[..., cols] = seen[0][..., cols]
        return (x,)

    handle = dense.register_forward_pre_hook(patch)
    try:
        logits = logits_of(model, corrupt)
    finally:
        handle.remove()
    answer, wrong = tokens
    return float(logits[-1, answer] - logits[-1, wrong])


def test_without_discovery_or_the_rule_ctrl_is_refused_again(cli, ctrl, monkeypatch) -> None:
    """Negative control of the fix itself: reading W_O from the naming table alone (as these
    commands did) refuses CTRL in ablate, attribute and patch, and a final-norm finder without
    the run-order rule refuses it in attribute and lens, with the old messages."""
    from attnviz.recognize import find_layers
    from attnviz.sources.hf import decoder_anatomy, known_layers, patching

    def table_only(store: Any) -> list[Any]:
        return find_layers(store).layers

    def refused(fragment: str, *args: Any) -> None:
        result = cli(*args, "--model", ctrl, "--device", "cpu")
        assert result.exit_code == 1 and fragment in result.stderr, result.output

    with monkeypatch.context() as patched:
        patched.setattr(known_layers, "attention_layers", table_only)
        patched.setattr(decoder_anatomy, "attention_layers", table_only)
        patched.setattr(patching, "attention_layers", table_only)
        refused("does not recognize the W_O", "ablate", PROMPT, "--layer", "all")
        refused("does not recognize the output projection W_O", "attribute", PROMPT, "-a",
                "mat", "--wrong", "cat")
        refused("finds no attention layer", "patch", CLEAN, "-c", CORRUPT, "-a", "cat",
                "--wrong", "dog")
    with monkeypatch.context() as patched:
        patched.setattr(decoder_anatomy, "norms_after_layers", lambda *_: [])
        refused("no final norm after its last layer", "attribute", PROMPT, "-a", "mat",
                "--wrong", "cat")
        refused("no final norm after its last layer", "lens", PROMPT, "-a", "mat")
