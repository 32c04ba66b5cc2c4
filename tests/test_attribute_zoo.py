"""`attnviz attribute` on the tiny zoo's causal LMs (random weights, LM heads): on every
family the parts add up to the logit difference of transformers' own forward (loaded
independently here); a head's part equals a hand-written hook on its W_O module; padded batches
equal each prompt alone; Gemma-2's softcap is attributed before the cap; models whose residual
is not a sum of parts, and encoder-decoders, are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnviz.app.attribute import AttributeRequest, run_attribute

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

PROMPT = "the cat sat on the mat the cat sat on the"
OTHER = "a small dog ran far away"
# pre-norm decoders: GQA (llama, mistral MQA), Conv1D (gpt2), parallel attention + MLP
# (gpt_neox, phi, gptj, falcon), RMSNorm with 1 + weight and softcap (gemma, gemma2),
# post-branch norms (olmo2, gemma3), a logit scale (cohere), an MLP run on (B·L, E) (opt),
# mixture-of-experts MLPs (mixtral), per-head q/k norms (qwen3), fused MQA (gpt_bigcode), a
# parameter-free LayerNorm keeping its epsilon in code (olmo), a 1 + weight LayerNorm
# (nemotron), scaled embeddings and a final norm named layer_norm (biogpt, xglm)
KINDS = ["llama", "mistral", "gpt2", "gpt_neox", "phi", "gptj", "falcon", "gemma",
         "gemma2", "olmo2", "cohere", "opt", "mixtral", "qwen3", "gemma3", "gpt_bigcode",
         "olmo", "nemotron", "biogpt", "xglm"]
TOL = 1e-6  # float32 round-off on logits of these sizes (remainders are ~1e-8)
CAP = 0.5  # Gemma-2's final softcap, small enough that it bends these tiny logits


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("transformers")
    from zoo import build_lm

    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_lm(kind, tmp_path_factory.mktemp(kind))
        return built[kind]
    return get


def _own(folder: Path, text: str) -> tuple[torch.Tensor, object, object]:
    """transformers' own last-position logits (float64), the model and its tokenizer."""
    import transformers
    from zoo import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits[0, -1].double(), model, tokenizer


@pytest.mark.parametrize("kind", KINDS)
def test_parts_add_up_to_the_models_own_logit_difference(lm, kind):
    folder = lm(kind)
    result = run_attribute(AttributeRequest([PROMPT], str(folder), "mat", "cat", device="cpu"))
    parts = result.prompts[0].parts
    own, _, tokenizer = _own(folder, PROMPT)
    mat, cat = (tokenizer.convert_tokens_to_ids(w) for w in ("mat", "cat"))
    difference = float(own[mat] - own[cat])
    assert result.prompts[0].model_metric == pytest.approx(difference, abs=TOL)
    if kind != "gemma2":  # softcapped: see the test below
        assert abs(parts.total - difference) <= TOL * max(1.0, abs(difference))
    assert abs(parts.remainder) <= TOL
    # negative control: dropping the largest part breaks the sum
    largest = max(abs(v) for _, v in result.prompts[0].parts.named())
    assert abs(parts.total - largest - parts.target) > 10 * TOL


def test_softcapped_logits_are_attributed_before_the_cap(tmp_path):
    pytest.importorskip("transformers")
    from zoo import build_lm

    folder = build_lm("gemma2", tmp_path / "gemma2",
                      edit=lambda m: setattr(m.config, "final_logit_softcapping", CAP))
    result = run_attribute(AttributeRequest([PROMPT], str(folder), "mat", "cat", device="cpu"))
    prompt = result.prompts[0]
    own, model, tokenizer = _own(folder, PROMPT)
    cap = model.config.final_logit_softcapping
    assert cap == CAP
    mat, cat = (tokenizer.convert_tokens_to_ids(w) for w in ("mat", "cat"))
    raw = cap * torch.atanh(own / cap)
    assert result.softcapped and "softcap" in result.transform
    assert abs(prompt.parts.total - float(raw[mat] - raw[cat])) <= TOL
    # negative control: the cap is nonlinear, so the parts do not sum to the capped difference
    assert abs(prompt.parts.total - prompt.model_metric) > 10 * TOL


@pytest.mark.parametrize(("kind", "o_proj", "norm"), [
    ("llama", "model.layers.{i}.self_attn.o_proj", "model.norm"),
    ("gpt2", "transformer.h.{i}.attn.c_proj", "transformer.ln_f")])
def test_a_heads_part_equals_a_hand_written_hook(lm, kind, o_proj, norm):
    """z_h · W_O[:, cols(h)]ᵀ from a pre-hook on W_O's module, through the final norm with
    the run's σ frozen, dotted with W_U[mat] − W_U[cat]."""
    folder = lm(kind)
    result = run_attribute(AttributeRequest([PROMPT], str(folder), "mat", "cat", device="cpu"))
    got = torch.tensor(result.prompts[0].parts.heads, dtype=torch.float64)  # (N, H)
    _, model, tokenizer = _own(folder, PROMPT)
    seen: dict[str, torch.Tensor] = {}
    final_norm = model.get_submodule(norm)
    hooks = [final_norm.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("final", a[0][0, -1].double()))]
    for i in range(2):
        hooks.append(model.get_submodule(o_proj.format(i=i)).register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(f"z{i}", a[0][0, -1].double())))
    with torch.no_grad():
        model(tokenizer(PROMPT, return_tensors="pt")["input_ids"])
    for hook in hooks:
        hook.remove()
    x = seen["final"]
    w = final_norm.weight.double()
    if kind == "llama":  # RMSNorm
        def image(p: torch.Tensor) -> torch.Tensor:
            return p / (x.pow(2).mean() + final_norm.variance_epsilon).sqrt() * w
    else:  # LayerNorm
        def image(p: torch.Tensor) -> torch.Tensor:
            return (p - p.mean()) / (x.var(unbiased=False) + final_norm.eps).sqrt() * w
    mat, cat = (tokenizer.convert_tokens_to_ids(t) for t in ("mat", "cat"))
    U = model.get_output_embeddings().weight.double()
    u = U[mat] - U[cat]
    H, d = 4, 8

    def grid(shift: int) -> torch.Tensor:
        """(N, H): head h's W_O columns applied to head (h + shift)'s slice of z."""
        found = torch.zeros(2, H, dtype=torch.float64)
        for i in range(2):
            W = model.get_submodule(o_proj.format(i=i)).weight.detach().double()
            W = W if kind == "llama" else W.T  # GPT-2's Conv1D stores (in, out)
            for h in range(H):
                g = (h + shift) % H
                part = seen[f"z{i}"][g * d:(g + 1) * d] @ W[:, h * d:(h + 1) * d].T
                found[i, h] = image(part.detach()) @ u.detach()
        return found

    assert torch.allclose(got, grid(0), rtol=1e-5, atol=1e-8)
    # negative control: each head's slice read from the next head's columns is caught
    assert not torch.allclose(got, grid(1), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_padded_batch_equals_each_prompt_alone(lm, kind):
    folder = str(lm(kind))
    both = run_attribute(AttributeRequest([PROMPT, OTHER], folder, "mat", "cat",
                                          device="cpu"))
    for prompt, text in zip(both.prompts, (PROMPT, OTHER), strict=True):
        alone = run_attribute(AttributeRequest([text], folder, "mat", "cat",
                                               device="cpu")).prompts[0]
        pairs = zip(prompt.parts.named(), alone.parts.named(), strict=True)
        assert max(abs(a - b) for (_, a), (_, b) in pairs) <= 1e-5


def test_cli_on_a_model_with_corrupt_and_json(lm, cli):
    folder = lm("llama")
    result = cli("attribute", "--model", folder, PROMPT, "--answer", "mat", "--wrong", "cat",
                 "--corrupt", "the cat sat on the mat the dog sat on the", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    prompt = doc["prompts"][0]
    assert abs(prompt["parts"]["remainder"]) <= TOL
    assert len(prompt["difference_clean_minus_corrupt"]["mlp"]) == 2
    shown = cli("attribute", "--model", folder, PROMPT)
    assert shown.exit_code == 0 and "MLP" in shown.stdout and "RMSNorm" in shown.stdout


def test_a_residual_that_is_no_sum_of_parts_is_refused(lm, cli):
    """BLOOM's attention module returns its output with the residual added: its parts do not
    add up, so attnviz refuses rather than print parts that do not sum."""
    result = cli("attribute", "--model", lm("bloom"), PROMPT, "--answer", "mat")
    assert result.exit_code == 1
    assert "not the sum of its embeddings" in result.stderr


@pytest.mark.parametrize("kind", ["t5", "mbart", "pegasus"])
def test_an_encoder_decoders_decoder_adds_up(lm, kind):
    """The decoder of T5 (RMSNorm, a tied head scaled by d_model^-0.5), mBART and Pegasus
    (a logits bias buffer after the head): self-attention, cross-attention (its own heads)
    and MLP parts add up to transformers' own seq2seq logits."""
    import transformers
    from zoo import load_tokenizer

    folder = lm(kind)
    target = "the cat sat on the"
    result = run_attribute(AttributeRequest([PROMPT], str(folder), "mat", "cat", device="cpu",
                                            targets=[target]))
    parts = result.prompts[0].parts
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)
    decoder = [model.config.decoder_start_token_id] + \
        tokenizer(target, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        own = model(**tokenizer(PROMPT, return_tensors="pt"),
                    decoder_input_ids=torch.tensor([decoder])).logits[0, -1].double()
    mat, cat = (tokenizer.convert_tokens_to_ids(w) for w in ("mat", "cat"))
    assert abs(parts.total - float(own[mat] - own[cat])) <= TOL
    assert parts.cross_heads is not None and len(parts.cross_heads) == 2
    assert result.prompts[0].tokens == tokenizer.convert_ids_to_tokens(decoder)
    # negative control: without its cross-attention the decoder's parts do not add up
    assert abs(parts.total - sum(parts.cross) - parts.target) > 10 * TOL


def test_an_encoder_decoders_padded_batch_equals_each_pair_alone(lm):
    folder = str(lm("t5"))
    prompts, targets = [PROMPT, OTHER], ["the cat sat on the", "a small"]
    both = run_attribute(AttributeRequest(prompts, folder, "mat", "cat", device="cpu",
                                          targets=targets))
    for prompt, text, target in zip(both.prompts, prompts, targets, strict=True):
        alone = run_attribute(AttributeRequest([text], folder, "mat", "cat", device="cpu",
                                               targets=[target])).prompts[0]
        pairs = zip(prompt.parts.named(), alone.parts.named(), strict=True)
        assert max(abs(a - b) for (_, a), (_, b) in pairs) <= 1e-5


def test_encoder_decoder_targets_are_checked(lm, cli):
    t5 = lm("t5")
    result = cli("attribute", "--model", t5, "the cat sat")
    assert result.exit_code == 2 and "--target" in result.stderr
    result = cli("lens", "--model", lm("llama"), "the cat sat", "--target", "the")
    assert result.exit_code == 2 and "--target" in result.stderr
    result = cli("attribute", "--model", t5, "the cat sat", "-t", "a", "-t", "b")
    assert result.exit_code == 2 and "--target" in result.stderr


def test_a_post_norm_encoder_decoder_is_refused(lm, cli):
    result = cli("attribute", "--model", lm("bart"), "the cat sat", "--target", "the")
    assert result.exit_code == 1 and "post-norm" in result.stderr


def test_a_multi_token_answer_is_refused_with_its_tokens(lm, cli):
    result = cli("attribute", "--model", lm("llama"), PROMPT, "--answer", "the mat")
    assert result.exit_code == 2
    assert "2 tokens" in result.stderr and "--answer" in result.stderr


def test_a_prompt_past_the_models_positions_is_refused(lm, cli):
    long = " ".join(["the cat sat on the mat"] * 12)  # 72 words; the zoo numbers 64
    result = cli("attribute", "--model", lm("gpt2"), long)
    assert result.exit_code == 2 and "positions" in result.stderr
