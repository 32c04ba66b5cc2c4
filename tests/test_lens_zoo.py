"""`attnviz lens` on the tiny zoo's causal LMs: the last row equals transformers' own logits at
every position on every family (the final norm applied once, whichever convention the family's
last hidden state follows; Gemma-2's softcap applied as the model applies it); each earlier row
is the final norm written out with that row's own statistics (the last row's σ reused is
caught); padded batches equal each prompt alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

PROMPT = "the cat sat on the mat the cat sat on the"
OTHER = "a small dog ran far away"
KINDS = ["llama", "mistral", "gpt2", "gpt_neox", "phi", "gptj", "falcon", "gemma", "gemma2",
         "olmo2", "cohere", "opt", "mixtral", "qwen3", "gemma3", "gpt_bigcode", "olmo",
         "nemotron", "biogpt", "xglm"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("transformers")
    from zoo import build_lm

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            edit = None
            if kind == "gemma2":  # a cap that bends these tiny logits
                def edit(m):
                    m.config.final_logit_softcapping = 0.5
            built[kind] = build_lm(kind, tmp_path_factory.mktemp(kind), edit=edit)
        return built[kind]
    return get


def _lens(folder: Path, texts: list[str]) -> list[torch.Tensor]:
    """Each prompt's (R, P, V) lens logits at every position."""
    from attnviz.app.logit_source import encode, open_logit_source
    from attnviz.core.choices import Dtype

    source = open_logit_source(str(folder), "cpu", Dtype.FLOAT32)
    encoded = encode(source, texts, -1)
    run = source.run(encoded, [list(range(len(i))) for i in encoded.ids])
    assert run.lens is not None
    return [run.lens.stacked(b) for b in range(len(texts))]


def _model(folder: Path) -> tuple[object, object]:
    import transformers
    from zoo import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    return model, load_tokenizer(folder)


@pytest.mark.parametrize("kind", KINDS)
def test_the_last_row_is_the_models_own_logits(lm, kind):
    folder = lm(kind)
    lens = _lens(folder, [PROMPT])[0]
    model, tokenizer = _model(folder)
    with torch.no_grad():
        own = model(tokenizer(PROMPT, return_tensors="pt")["input_ids"]).logits[0]  # (L, V)
    assert lens.shape[0] == model.config.num_hidden_layers + 1
    assert torch.allclose(lens[-1], own, atol=1e-5, rtol=1e-5)
    # negative control: the final norm applied twice (the normed last hidden state normed
    # again) is not the model's output where the norm has a bias (an RMSNorm of unit gain, as
    # the zoo's are, is idempotent: there the two coincide and nothing can tell them apart)
    with torch.no_grad():
        out = model(tokenizer(PROMPT, return_tensors="pt")["input_ids"],
                    output_hidden_states=True)
        head = model.get_output_embeddings()
        norm = next(m for n, m in model.named_modules()  # outside the decoder layers
                    if n.rsplit(".", 1)[-1] in ("norm", "ln_f", "final_layer_norm",
                                                "final_layernorm", "layer_norm")
                    and not any(part.isdigit() for part in n.split(".")))
        twice = head(norm(out.hidden_states[-1][0]))
    if getattr(norm, "bias", None) is not None:
        assert not torch.allclose(twice, own, atol=1e-4)


@pytest.mark.parametrize(("kind", "norm"), [("llama", "model.norm"),
                                            ("gpt2", "transformer.ln_f")])
def test_each_row_uses_its_own_norm_statistics(lm, kind, norm):
    folder = lm(kind)
    lens = _lens(folder, [PROMPT])[0]
    model, tokenizer = _model(folder)
    with torch.no_grad():
        hidden = model(tokenizer(PROMPT, return_tensors="pt")["input_ids"],
                       output_hidden_states=True).hidden_states
        module = model.get_submodule(norm)
        w = module.weight.double()
        U = model.get_output_embeddings().weight.double()

        def sigma(x: torch.Tensor) -> torch.Tensor:
            if kind == "llama":
                return (x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon).sqrt()
            return (x.var(-1, unbiased=False, keepdim=True) + module.eps).sqrt()

        def written(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            centered = x if kind == "llama" else x - x.mean(-1, keepdim=True)
            shift = 0.0 if kind == "llama" else module.bias.double()
            return (centered / scale * w + shift) @ U.T

        for r in range(len(hidden) - 1):  # the last hidden state is normed already
            x = hidden[r][0].double()
            assert torch.allclose(lens[r].double(), written(x, sigma(x)), atol=1e-4), r
        # negative control (TransformerLens #1076): a later layer's σ reused for the
        # embeddings' row is caught
        x0, later = hidden[0][0].double(), hidden[1][0].double()
        assert not torch.allclose(lens[0].double(), written(x0, sigma(later)), atol=1e-3)


def test_a_padded_batch_equals_each_prompt_alone(lm):
    folder = lm("llama")
    both = _lens(folder, [PROMPT, OTHER])
    for logits, text in zip(both, (PROMPT, OTHER), strict=True):
        alone = _lens(folder, [text])[0]
        assert torch.allclose(logits, alone, atol=1e-5)


def test_cli_on_a_model(lm, cli):
    folder = lm("gemma2")
    result = cli("lens", "--model", folder, PROMPT, "--answer", "mat", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert "softcap" in doc["logit_transform"]
    assert doc["prompts"][0]["rows"][-1] == "layer 1"
    shown = cli("lens", "--model", folder, PROMPT, "-p", "-1")
    assert shown.exit_code == 0 and "legend" in shown.stdout


@pytest.mark.parametrize("kind", ["t5", "mbart"])
def test_an_encoder_decoders_last_row_is_its_own_logits(lm, kind):
    import transformers
    from zoo import load_tokenizer

    from attnviz.app.logit_source import encode, open_logit_source
    from attnviz.core.choices import Dtype

    folder = lm(kind)
    source = open_logit_source(str(folder), "cpu", Dtype.FLOAT32)
    encoded = encode(source, [PROMPT], -1, ["the cat sat on the"])
    run = source.run(encoded, [list(range(len(encoded.ids[0])))])
    assert run.lens is not None
    lens = run.lens.stacked(0)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)
    with torch.no_grad():
        own = model(**tokenizer(PROMPT, return_tensors="pt"),
                    decoder_input_ids=torch.tensor([encoded.ids[0]])).logits[0]
    assert lens.shape[0] == 3
    assert torch.allclose(lens[-1], own, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lens[-2], own, atol=1e-3)
