"""The source matrix: every sample checkpoint and every zoo model that `attnviz inspect` lists
with a usable layer runs through every command that accepts it (inspect, split, heatmap and
circuits with --weights; split, heatmap, circuits, tokens and corpus with --model for the zoo's
folders; patch, attribute, lens, ablate and generate with --model for each family's model with
its language-model head, zoo.LM_HEADS, each cell also checked against the model's own
forward). Each cell exits 0, or with a clear refusal listed below with its reason; never "no
attention layer recognized" for a layer inspect listed. Every command opens its source through
one registry (attnviz.sources.registry), which is what makes the matrix hold: the negative
control puts heatmap's old table-only inventory back and shows the CTRL cell fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import SAMPLES, torch_loads_pickles

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCE = "the cat sat on the mat"
NEVER = ("no attention layer recognized", "unexpected", "Traceback")


@dataclass(frozen=True)
class Refusal:
    """A cell the matrix expects to refuse: its exit code, a fragment of the one error line and
    why the refusal is right."""

    code: int
    fragment: str
    reason: str


# (case, command, flag) -> the refusal it must give. Cases are sample names, or zoo:<kind>.
REFUSALS: dict[tuple[str, str, str], Refusal] = {
    ("zoo:vit", "heatmap", "--model"): Refusal(
        2, "--model needs a text model",
        "heatmap runs the model's own forward on sentences; a vision model takes pixels, not "
        "token ids (its layers still run in heatmap --weights, on synthetic vectors)"),
    ("zoo:vit", "tokens", "--model"): Refusal(
        2, "--model needs a text model", "tokens runs the model's own forward on sentences"),
    ("zoo:vit", "corpus", "--model"): Refusal(
        2, "--model needs a text model", "a corpus is text; a vision model takes pixels"),
}


def sample_cases() -> list[Path]:
    """Every checkpoint in sample_weights/: files, model folders, and the folders under models/."""
    found = sorted(p for p in SAMPLES.iterdir()
                   if p.suffix in (".safetensors", ".pt") or (p / "config.json").is_file())
    return found + sorted(p for p in (SAMPLES / "models").iterdir() if p.is_dir())


def inspected(cli: Callable[..., Any], source: Path) -> dict[str, Any]:
    result = cli("inspect", source, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def usable(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The first layer inspect lists (the matrix's row), or None when it lists none."""
    return doc["layers"][0] if doc["layers"] else None


def head_hint(layer: dict[str, Any]) -> list[str]:
    """-H for a layer whose head count no config gives (a torch pickle): the smallest divisor
    above 1 of its width, as a user would pass it."""
    if layer["num_heads"] is not None:
        return []
    width = layer["embed_dim"]
    return ["-H", str(next(n for n in range(2, width + 1) if width % n == 0))]


def weights_args(command: str, source: Path, layer: dict[str, Any]) -> list[Any]:
    """One --weights cell's command line (small output: --json, --no-maps)."""
    spec = layer["name"] or str(layer["index"])
    hints = head_hint(layer)
    if command == "inspect":
        return ["inspect", source, "--layer", spec, "--json", *hints]
    if command == "heatmap":
        return ["heatmap", "--weights", source, "--layer", spec, "--no-maps", "--json", *hints,
                SENTENCE]
    return [command, "--weights", source, "--layer", spec, "--json", *hints]


def model_args(command: str, folder: Path) -> list[Any]:
    """One --model cell's command line: the model's first layer."""
    if command == "heatmap":
        return ["heatmap", "--model", folder, "--layer", "0", "--no-maps", "--json", SENTENCE]
    if command == "tokens":  # every layer: the command traces the whole stack
        return ["tokens", "--model", folder, "--json", SENTENCE]
    if command == "corpus":  # every layer, over a few real sentences
        return ["corpus", SAMPLES / "english.txt", "--model", folder, "--limit", "4",
                "--resamples", "5", "--json"]
    return [command, "--model", folder, "--layer", "0", "--json"]


def check_cell(cli: Callable[..., Any], case: str, command: str, flag: str,
               args: list[Any], refusal: Refusal | None = None) -> Any:
    """The cell exits 0, or refuses as `refusal` (default: REFUSALS' entry) says (one clean
    error line); the CLI's result."""
    result = cli(*args)
    where = f"{case}: {' '.join(str(a) for a in args)}"
    refusal = refusal or REFUSALS.get((case, command, flag))
    for text in NEVER:
        assert text not in result.output, (where, result.output)
    if refusal is None:
        assert result.exit_code == 0, (where, result.output)
        return result
    assert result.exit_code == refusal.code, (where, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (where, result.stderr)
    assert refusal.fragment in lines[0], (where, lines[0])
    return result


WEIGHTS_COMMANDS = ("inspect", "split", "heatmap", "circuits")
MODEL_COMMANDS = ("split", "heatmap", "circuits", "tokens", "corpus")


def run_weights_row(cli: Callable[..., Any], case: str, source: Path) -> bool:
    """Every --weights cell of one checkpoint; False when inspect lists no layer (no row)."""
    layer = usable(inspected(cli, source))
    if layer is None:
        return False
    for command in WEIGHTS_COMMANDS:
        check_cell(cli, case, command, "--weights", weights_args(command, source, layer))
    return True


@pytest.mark.parametrize("source", sample_cases(), ids=lambda p: p.name)
def test_every_sample_runs_in_every_command(cli, source: Path) -> None:
    if source.suffix == ".pt" and not torch_loads_pickles():
        pytest.skip("this torch does not open pickles (attnviz refuses them below 2.10)")
    assert run_weights_row(cli, source.name, source)  # every sample has a layer


# --------------------------------------------------------------------------------- the zoo


def zoo_kinds() -> list[str]:
    from zoo import DISCOVERED, ZOO

    return list(ZOO) + list(DISCOVERED)


def _zoo_ids() -> list[str]:
    try:
        return zoo_kinds()
    except BaseException:  # noqa: BLE001 - transformers missing: the tests skip
        return []


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", _zoo_ids())
def test_every_zoo_model_runs_in_every_command(cli, zoo_model, kind: str) -> None:
    """--weights on the saved folder in all four commands; --model in split, heatmap,
    circuits and corpus."""
    folder = zoo_model(kind)
    if not run_weights_row(cli, f"zoo:{kind}", folder):
        pytest.skip(f"inspect lists no usable layer of {kind}")
    for command in MODEL_COMMANDS:
        check_cell(cli, f"zoo:{kind}", command, "--model", model_args(command, folder))


# ------------------------------------------------------- CTRL: found only by discovery


@pytest.mark.hf
@pytest.mark.parametrize("command", WEIGHTS_COMMANDS)
def test_ctrl_runs_in_every_weights_command(cli, zoo_model, command: str) -> None:
    """The case that started the registry: CTRL's layers are found only by building the model
    on the meta device; heatmap --weights refused them while the other commands ran them."""
    folder = zoo_model("ctrl")
    layer = usable(inspected(cli, folder))
    assert layer is not None and layer["name"] == "h.0.multi_head_attention"
    check_cell(cli, "zoo:ctrl", command, "--weights", weights_args(command, folder, layer))


@pytest.mark.hf
def test_the_matrix_catches_heatmaps_old_inventory(cli, zoo_model, monkeypatch) -> None:
    """Negative control: heatmap's checkpoint path put back on the table-only inventory (what
    it read before the registry) fails the CTRL cell, with the old message."""
    from attnviz.recognize import find_layers
    from attnviz.sources import registry

    folder = zoo_model("ctrl")
    layer = usable(inspected(cli, folder))
    assert layer is not None
    monkeypatch.setattr(registry, "find_inventory", lambda store, hints: find_layers(store, hints))
    with pytest.raises(AssertionError, match="no attention layer recognized"):
        check_cell(cli, "zoo:ctrl", "heatmap", "--weights",
                   weights_args("heatmap", folder, layer))


@pytest.mark.hf
def test_ctrl_heatmap_maps_equal_ctrls_own_attention(zoo_model) -> None:
    """heatmap --weights' maps for a CTRL layer equal CTRL's own MultiHeadAttention module (run
    by transformers, eager, causal mask) on the same input vectors, to 1e-5; control: the
    module's maps without the causal mask differ (the comparison can fail)."""
    import torch
    import transformers

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.compute.forward_pass.inputs import input_vectors, make_batch
    from attnviz.load.checkpoint import open_checkpoint

    folder = zoo_model("ctrl")
    result = run_heatmap(HeatmapRequest.build(weights=folder, layer="1",
                                              sentences=[SENTENCE]))
    shown = result.run.layers[0]
    assert shown.weights is not None
    ours = shown.weights[0].float()  # (H, L, L)
    model = transformers.CTRLModel.from_pretrained(folder, attn_implementation="eager").eval()
    module = model.h[1].multi_head_attention
    batch = make_batch([SENTENCE])
    x, _ = input_vectors(batch, 32, open_checkpoint(folder), "none")
    n = x.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        _, theirs = module(x, x, x, attention_mask=causal)
        _, open_maps = module(x, x, x, attention_mask=None)
    assert ours.shape == theirs[0].shape == (4, n, n)
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=0)
    assert (ours - open_maps[0]).abs().max() > 1e-2  # control: a wrong mask is caught


@pytest.mark.hf
def test_the_python_api_reads_the_same_inventory(zoo_model) -> None:
    """The Python API goes through the same registry: find_layers lists CTRL's two layers (as
    inspect does), and inspect, split, run_heatmap and circuits run layer 1. Control: the
    naming table alone (recognize.find_layers, no discovery) lists none."""
    import attnviz
    from attnviz.load.checkpoint import open_checkpoint
    from attnviz.recognize import find_layers

    folder = zoo_model("ctrl")
    names = ["h.0.multi_head_attention", "h.1.multi_head_attention"]
    assert [layer.name for layer in attnviz.find_layers(folder).layers] == names
    assert find_layers(open_checkpoint(folder)).layers == []  # control
    assert attnviz.inspect(folder, layer="1").detail is not None
    assert attnviz.split(folder, layer="1").passed
    heatmap = attnviz.run_heatmap([SENTENCE], weights=folder, layer="1")
    assert heatmap.run.layers[0].layer.name == names[1]
    assert [c.name for c in attnviz.circuits(folder, layer="1").layers] == [names[1]]


# ------------------------------------------------------- the LM-head commands (zoo.LM_HEADS)
# patch, attribute, lens, ablate and generate take a --model with a language-model head: each
# family's LM_HEADS model runs through each of them (an encoder-decoder's with --target where
# the command reads its decoder), exits 0 with one identity checked against the model's own
# forward (transformers' class loaded here, independently), or refuses as LM_REFUSALS lists.

LM_COMMANDS = ("patch", "attribute", "lens", "ablate", "generate")
FAST_LMS = ("llama", "gpt2", "t5")  # grouped-query LLaMA, GPT-2's Conv1D, an encoder-decoder
CLEAN, CORRUPT, ANSWER, WRONG = "the cat sat on the mat", "the dog sat on the mat", "cat", "dog"
PROMPT, TARGET = "the cat sat on the mat the cat sat on the", "the cat"
NEW_TOKENS = 2
LENS_TOL = 1e-6
POST_NORM = ("no final norm after its last layer: a post-norm model normalizes the residual "
             "inside each layer, so no direct attribution (nor a lens row) adds up")
NO_SUM = "not the sum of its embeddings"

LM_REFUSALS: dict[tuple[str, str], Refusal] = {
    **{(kind, command): Refusal(1, "no final norm after its last layer", POST_NORM)
       for kind in ("bart", "plbart", "marian") for command in ("attribute", "lens")},
    **{("bloom", command): Refusal(
        1, NO_SUM, "BLOOM's attention module returns its output with the residual added: "
        "parts that do not sum are refused, not printed") for command in ("attribute", "lens")},
    # transformers 5 reads the zoo's WordLevel tokenizer.json for model type qwen2 as Qwen2's
    # own BPE without merges: every word becomes 'a', so the pair and the answers collide (a
    # real Qwen2 checkpoint ships its merges)
    ("qwen2", "patch"): Refusal(2, "tokenize to the same length",
                                "the zoo's tokenizer read as a BPE without merges"),
    ("qwen2", "attribute"): Refusal(2, "are the same token",
                                    "the zoo's tokenizer read as a BPE without merges"),
}

# Cells that fail with an unexpected error today: bugs, kept visible (strict: a fix turns the
# cell into an XPASS failure, and the entry comes out).
LM_BUGS: dict[tuple[str, str], str] = {}


def lm_cells(kinds: list[str]) -> list[Any]:
    """(kind, command) parameters; LM_BUGS' cells marked strict xfail."""
    return [pytest.param(kind, command, id=f"{kind}-{command}",
                         marks=[pytest.mark.xfail(strict=True, reason=LM_BUGS[kind, command])]
                         if (kind, command) in LM_BUGS else [])
            for kind in kinds for command in LM_COMMANDS]


def _lm_kinds() -> list[str]:
    try:
        from zoo import LM_HEADS
    except BaseException:  # noqa: BLE001 - transformers missing: the tests skip
        return []
    return [kind for kind in LM_HEADS if kind not in FAST_LMS]


def encoder_decoder(kind: str) -> bool:
    from zoo import row_of

    return row_of(kind).encoder_decoder


def lm_args(command: str, kind: str, folder: Path) -> list[Any]:
    """One LM cell's command line: the encoder-decoder's --target where the command reads its
    decoder (patch, attribute, lens); ablate and generate run it whole."""
    target = ["--target", TARGET] if encoder_decoder(kind) else []
    source = ["--model", folder, "--device", "cpu", "--json"]
    if command == "patch":
        return ["patch", CLEAN, "-c", CORRUPT, "-a", ANSWER, "--wrong", WRONG, *target, *source]
    if command == "attribute":
        return ["attribute", PROMPT, "-a", "mat", "--wrong", ANSWER, *target, *source]
    if command == "lens":
        return ["lens", PROMPT, "-a", "mat", "--top", "2", *target, *source]
    if command == "ablate":
        return ["ablate", PROMPT, "--layer", "all", *source]
    return ["generate", CLEAN, "-n", str(NEW_TOKENS), *source]


class OwnModel:
    """The LM_HEADS model loaded by transformers here, apart from attnviz: its own logits."""

    def __init__(self, kind: str, folder: Path) -> None:
        import torch
        import transformers
        from zoo import LM_HEADS, load_tokenizer

        self.torch, self.seq2seq = torch, encoder_decoder(kind)
        self.model = getattr(transformers, LM_HEADS[kind]).from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32).eval()
        self.tokenizer = load_tokenizer(folder)

    def ids(self, tokens: list[str]) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(tokens)

    def decoder(self) -> list[int]:
        """An encoder-decoder's decoder input: its start token, then TARGET's tokens."""
        start = self.model.config.decoder_start_token_id
        return [start, *self.tokenizer(TARGET, add_special_tokens=False)["input_ids"]]

    def logits(self, ids: list[int], encoder: str | list[int] | None = None) -> Any:
        """(L, V) float64 logits of `ids`: a causal LM's tokens, or an encoder-decoder's decoder
        tokens after `encoder` (a text, tokenized with its special tokens, or ids)."""
        torch = self.torch
        with torch.no_grad():
            if not self.seq2seq:
                return self.model(input_ids=torch.tensor([ids])).logits[0].double()
            if isinstance(encoder, str):
                encoder = self.tokenizer(encoder)["input_ids"]
            return self.model(input_ids=torch.tensor([encoder]),
                              decoder_input_ids=torch.tensor([ids])).logits[0].double()


def check_patch(own: OwnModel, doc: dict[str, Any]) -> None:
    """The clean and corrupted baselines are the model's own logit difference on each prompt
    alone, at its last token; control: the metric one token earlier (a reader off by one)
    differs."""
    pair = doc["pairs"][0]
    answer, wrong = own.ids(pair["answer"])[0], own.ids([pair["wrong"]])[0]
    for side, key in (("clean", "clean"), ("corrupt", "corrupted")):
        ids = own.ids(pair[side])
        logits = own.logits(own.decoder(), ids) if own.seq2seq else own.logits(ids)
        metric = logits[:, answer] - logits[:, wrong]
        assert doc["baselines"][key][0] == pytest.approx(float(metric[-1]), abs=1e-4), key
        assert abs(doc["baselines"][key][0] - float(metric[-2])) > 1e-4  # control


def check_attribute(own: OwnModel, doc: dict[str, Any]) -> None:
    """The parts add up to the metric, and the metric (after any softcap) is the model's own
    logit(mat) − logit(cat); control: the sum without its largest part does not."""
    prompt = doc["prompts"][0]
    ids = own.ids(prompt["tokens"])
    logits = own.logits(ids, PROMPT if own.seq2seq else None)[prompt["position"]]
    own_metric = float(logits[prompt["answer"]["id"]] - logits[prompt["wrong"]["id"]])
    assert prompt["model_metric_after_transform"] == pytest.approx(own_metric, abs=1e-5)
    parts = prompt["parts"]
    assert parts["sum"] == pytest.approx(parts["model_metric"], abs=1e-5)
    largest = max(abs(part["value"]) for part in prompt["largest"])
    assert largest > 1e-4 and abs(parts["sum"] - largest - parts["model_metric"]) > 1e-5


def check_lens(own: OwnModel, doc: dict[str, Any]) -> None:
    """The last row is the model's own next-token distribution at every position (the answer's
    probability and rank, the top tokens), to 1e-6 (float32 logits of these sizes: ~1e-9); control:
    the earlier rows are not (a random mT5's rows differ by a few 1e-6: its logits are small)."""
    torch = own.torch
    prompt = doc["prompts"][0]
    probs = torch.softmax(own.logits(own.ids(prompt["tokens"]),
                                     PROMPT if own.seq2seq else None), -1)
    answer = prompt["answer"]["id"]
    last = prompt["cells"][-1]
    for p, cell in zip(prompt["positions"], last, strict=True):
        assert cell["answer_prob"] == pytest.approx(float(probs[p, answer]), abs=LENS_TOL)
        assert cell["answer_rank"] == int((probs[p] > probs[p, answer]).sum()) + 1
        top = torch.topk(probs[p], len(cell["top"])).values
        assert [t["prob"] for t in cell["top"]] == pytest.approx(top.tolist(), abs=LENS_TOL)
    assert max(abs(cell["answer_prob"] - float(probs[p, answer]))  # control: earlier rows
               for row in prompt["cells"][:-1]
               for p, cell in zip(prompt["positions"], row, strict=True)) > LENS_TOL


def check_ablate(own: OwnModel, doc: dict[str, Any]) -> None:
    """Every head of every layer scored; a causal LM's unablated loss is the model's own mean
    next-token loss (control: the loss against other next tokens is not)."""
    torch = own.torch
    heads = sum(layer["num_heads"] for layer in doc["layers"])
    assert len(doc["ablation"]) == heads and heads > 0
    if own.seq2seq:  # KL of the output distributions: a change, never negative
        assert all(e["loss_change"] is None or e["loss_change"] >= -1e-9
                   for e in doc["ablation"])
        return
    ids = torch.tensor(own.ids(doc["tokens"][0]))
    logits = own.logits(ids.tolist())
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
    assert doc["ablation_run"]["base_loss"] == pytest.approx(float(loss), abs=1e-5)
    other = torch.nn.functional.cross_entropy(logits[:-1], (ids[1:] + 1) % logits.shape[-1])
    assert abs(float(other) - doc["ablation_run"]["base_loss"]) > 1e-5  # control


def check_generate(own: OwnModel, doc: dict[str, Any]) -> None:
    """Greedy: the first token written is the model's own most likely next token after the
    prompt (control: its runner-up is another token)."""
    generation = doc["generation"]
    written = generation["generated_ids"][0]
    assert 1 <= len(written) <= NEW_TOKENS
    if own.seq2seq:  # the decoder starts from its start token, the encoder reads the prompt
        logits = own.logits([own.model.config.decoder_start_token_id], CLEAN)
    else:
        logits = own.logits(own.ids(doc["tokens"][0][:generation["prompt_length"][0]]))
    ranked = own.torch.argsort(logits[-1], descending=True)
    assert written[0] == int(ranked[0]) != int(ranked[1])


CHECKS: dict[str, Callable[[OwnModel, dict[str, Any]], None]] = {
    "patch": check_patch, "attribute": check_attribute, "lens": check_lens,
    "ablate": check_ablate, "generate": check_generate}


def run_lm_cell(cli: Callable[..., Any], zoo_lm: Callable[[str], Path], kind: str,
                command: str) -> None:
    """One LM cell: it refuses as LM_REFUSALS lists, or exits 0 and its identity holds."""
    from zoo import LM_HEADS

    folder = zoo_lm(kind)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [LM_HEADS[kind]]
    args = lm_args(command, kind, folder)
    refusal = LM_REFUSALS.get((kind, command))
    result = check_cell(cli, f"lm:{kind}", command, "--model", args, refusal)
    if refusal is None:
        CHECKS[command](OwnModel(kind, folder), json.loads(result.stdout))


@pytest.mark.hf
@pytest.mark.parametrize(("kind", "command"), lm_cells(list(FAST_LMS)))
def test_lm_commands_on_llama_gpt2_t5(cli, zoo_lm, kind: str, command: str) -> None:
    run_lm_cell(cli, zoo_lm, kind, command)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "command"), lm_cells(_lm_kinds()))
def test_every_zoo_lm_runs_in_every_lm_command(cli, zoo_lm, kind: str, command: str) -> None:
    run_lm_cell(cli, zoo_lm, kind, command)


# An encoder is no LM: its base model (no head) and its masked-LM head, given to the commands
# that score next tokens, get one usage error naming what is missing.
MISUSE: dict[str, str] = {
    "patch": "name no language-model head",
    "attribute": "need a model with a causal-LM head",
    "lens": "need a model with a causal-LM head",
}


@pytest.mark.hf
@pytest.mark.parametrize("command", sorted(MISUSE))
@pytest.mark.parametrize("head", [None, "BertForMaskedLM"], ids=["base", "masked-lm"])
def test_an_encoder_given_to_the_lm_commands_is_refused(cli, zoo_model, tmp_path_factory,
                                                        command: str, head: str | None) -> None:
    from zoo import build_lm

    folder = zoo_model("bert") if head is None else \
        build_lm("bert", tmp_path_factory.mktemp("bert_mlm"), head)
    args = [a for a in lm_args(command, "bert", folder) if a != "--json"]
    check_cell(cli, f"encoder:{head or 'base'}", command, "--model", args,
               Refusal(2, MISUSE[command], "an encoder scores no next token"))
