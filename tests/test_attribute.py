"""`attnviz attribute` on the bundled model: the parts add up to the model's own logit
difference, each head's part equals a hand-written forward, padded batches equal each prompt
alone, the corrupted difference is the two runs' difference; with negative controls (a dropped
part, the wrong frozen scale) that show each check can fail."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attnviz.app.attribute import AttributeRequest, run_attribute
from attnviz.compute.logit.frozen_norm import NormKind, NormParams, fit_norm
from attnviz.compute.logit.residual_parts_data import ResidualParts, check_parts
from attnviz.core.words import hashed_ids, split_words
from attnviz.errors import CheckFailed
from attnviz.sources import bundled
from attnviz.sources.bundled_generate import _Model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the cat sat on the mat the cat sat on the"
OTHER = "a dog ran to the red barn a dog ran to"
TOL = 1e-5


def _ids(text: str) -> list[int]:
    return hashed_ids(split_words(text), 1024)


def _own_logits(text: str) -> torch.Tensor:
    """The model's own last-position logits, through bundled_generate's forward."""
    model = _Model(bundled.open_bundled(), torch.device("cpu"))
    return model.logits(torch.tensor([_ids(text)]))[0, -1].double()


def _hand_forward(text: str) -> dict[str, torch.Tensor]:
    """The bundled model written out by hand from its stored tensors: the final residual at
    the last position, each head's z_h · W_O[:, cols]ᵀ there, and the final LayerNorm's
    parameters."""
    store = bundled.open_bundled()
    t = {k: store.read(k).double() for k in store.keys()}
    ids = torch.tensor(_ids(text))
    L = len(ids)
    x = t["embed.weight"][ids] + t["pos_embed.weight"][:L]  # (L, E)
    E, H = x.shape[1], 2
    d = E // H
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    heads = []
    for i in range(2):
        p = f"layers.{i}."
        h = F.layer_norm(x, (E,), t[p + "ln.weight"], t[p + "ln.bias"], eps=1e-5)
        qkv = h @ t[p + "self_attn.in_proj_weight"].T + t[p + "self_attn.in_proj_bias"]
        q, k, v = qkv.split(E, dim=-1)
        W_o = t[p + "self_attn.out_proj.weight"]
        out = torch.zeros_like(x)
        row = []
        for hd in range(H):
            s = slice(hd * d, (hd + 1) * d)
            scores = (q[:, s] @ k[:, s].T) / d ** 0.5
            a = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
            part = (a @ v[:, s]) @ W_o[:, s].T  # (L, E)
            row.append(part[-1])
            out = out + part
        heads.append(torch.stack(row))
        x = x + out + t[p + "self_attn.out_proj.bias"]
    return {"final": x[-1], "heads": torch.stack(heads), "w": t["ln_f.weight"],
            "U": t["unembed.weight"]}


def test_parts_add_up_to_the_models_own_logit_difference():
    result = run_attribute(AttributeRequest([PROMPT], answer="mat", wrong="cat", device="cpu"))
    parts = result.prompts[0].parts
    own = _own_logits(PROMPT)
    mat, cat = _ids("mat")[0], _ids("cat")[0]
    assert parts.target == pytest.approx(float(own[mat] - own[cat]), abs=TOL)
    assert abs(parts.total - float(own[mat] - own[cat])) <= TOL
    assert abs(parts.remainder) <= TOL
    # negative control: a dropped part (the largest head) breaks the sum
    largest = max(abs(v) for row in parts.heads for v in row)
    assert largest > 100 * TOL
    assert abs(parts.total - largest - parts.target) > 100 * TOL


def test_each_heads_part_equals_a_hand_written_forward():
    result = run_attribute(AttributeRequest([PROMPT], answer="mat", wrong="cat", device="cpu"))
    got = torch.tensor(result.prompts[0].parts.heads, dtype=torch.float64)  # (N, H)
    hand = _hand_forward(PROMPT)
    x = hand["final"]
    sigma = (x.var(unbiased=False) + 1e-5).sqrt()
    mat, cat = _ids("mat")[0], _ids("cat")[0]
    u = hand["U"][mat] - hand["U"][cat]

    def through(part: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((part - part.mean(-1, keepdim=True)) / scale * hand["w"] * u).sum(-1)

    expected = through(hand["heads"], sigma)  # (N, H)
    assert torch.allclose(got, expected, atol=1e-5)
    assert result.prompts[0].scale == pytest.approx(float(1 / sigma), rel=1e-5)
    # negative control: the scale of another row (here the embeddings') is caught
    wrong_scale = (hand["heads"][0, 0].var(unbiased=False) + 1e-5).sqrt()
    assert not torch.allclose(got, through(hand["heads"], wrong_scale), atol=1e-3)


def test_a_padded_batch_equals_each_prompt_alone():
    both = run_attribute(AttributeRequest([PROMPT, OTHER], answer="mat", wrong="cat",
                                          device="cpu"))
    for prompt, alone_text in zip(both.prompts, (PROMPT, OTHER), strict=True):
        alone = run_attribute(AttributeRequest([alone_text], answer="mat", wrong="cat",
                                               device="cpu")).prompts[0]
        a, b = prompt.parts.named(), alone.parts.named()
        assert [n for n, _ in a] == [n for n, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) <= 1e-5
        assert prompt.position == alone.position == len(split_words(alone_text)) - 1


def test_the_corrupted_difference_is_clean_minus_corrupted():
    corrupt = "the cat sat on the mat the dog sat on the"
    both = run_attribute(AttributeRequest([PROMPT], answer="mat", wrong="cat",
                                          corrupt=[corrupt], device="cpu")).prompts[0]
    alone = run_attribute(AttributeRequest([corrupt], answer="mat", wrong="cat",
                                           device="cpu")).prompts[0]
    assert both.difference is not None
    for (name, d), (_, c), (_, k) in zip(both.difference.named(), both.parts.named(),
                                         alone.parts.named(), strict=True):
        assert d == pytest.approx(c - k, abs=1e-9), name
    assert both.difference.target == pytest.approx(both.parts.target - alone.parts.target)


def test_no_answer_is_top_prediction_against_runner_up():
    result = run_attribute(AttributeRequest(device="cpu"))
    prompt = result.prompts[0]
    own = _own_logits(prompt.prompt)
    top = own.topk(2).indices.tolist()
    assert [prompt.answer[0], prompt.wrong[0]] == top
    assert prompt.answer[1] == "mat"  # the built-in induction prompt's repeat
    assert any("top prediction" in note for note in result.notes)


def test_answer_logit_alone_counts_the_norm_bias():
    result = run_attribute(AttributeRequest([PROMPT], answer="mat", device="cpu"))
    parts = result.prompts[0].parts
    own = _own_logits(PROMPT)
    assert result.metric.startswith("logit(answer) at")
    assert abs(parts.total - float(own[_ids("mat")[0]])) <= TOL
    assert abs(parts.norm_bias) > 100 * TOL  # the LayerNorm bias reaches one logit


def test_fit_norm_names_each_kind_and_refuses_what_it_cannot_reproduce():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    layer = torch.nn.LayerNorm(8)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    rms = torch.nn.RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(rms.weight)
    with torch.no_grad():
        ln = NormParams(layer.weight, layer.bias, 1e-5)
        assert fit_norm(x, layer(x), ln, "ln").kind is NormKind.LAYER
        rms_params = NormParams(rms.weight, None, 1e-6)
        assert fit_norm(x, rms(x), rms_params, "rms").kind is NormKind.RMS
        gemma = rms(x) + rms(x) / rms.weight  # x/σ · (1 + w)
        assert fit_norm(x, gemma, rms_params, "gemma").kind is NormKind.RMS_OFFSET
        # negative control: a norm none of the three reproduces
        with pytest.raises(CheckFailed, match="neither a LayerNorm nor an RMSNorm"):
            fit_norm(x, torch.tanh(layer(x)), ln, "tanh")


def test_parts_that_do_not_add_up_are_refused():
    """A post-norm model's parts (each layer normalizes the sum) are refused, not decomposed."""
    torch.manual_seed(0)
    embed, attn, mlp = torch.randn(2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    heads = torch.randn(2, 3, 2, 8)
    bias = attn - heads.sum(1)
    final = embed + attn.sum(0) + mlp.sum(0)
    check_parts(ResidualParts(embed, attn, mlp, heads, bias, final), "pre-norm")
    post = F.layer_norm(final, (8,))
    with pytest.raises(CheckFailed, match="post-norm"):
        check_parts(ResidualParts(embed, attn, mlp, heads, bias, post), "post-norm")
    with pytest.raises(CheckFailed, match="heads"):
        check_parts(ResidualParts(embed, attn, mlp, heads, bias + 0.1, final), "heads")


def test_cli_prints_the_sum_line_and_json(cli):
    result = cli("attribute", PROMPT, "--answer", "mat", "--wrong", "cat", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "remainder" in result.stdout and "L1H" in result.stdout
    assert "1/σ" in result.stdout
    doc = json.loads(cli("attribute", PROMPT, "--answer", "mat", "--wrong", "cat",
                         "--json").stdout)
    parts = doc["prompts"][0]["parts"]
    assert doc["command"] == "attribute" and abs(parts["remainder"]) <= TOL
    assert len(parts["heads"]) == 2 and len(parts["heads"][0]) == 2


@pytest.mark.parametrize(("args", "named"), [
    (["--wrong", "cat"], "--wrong"),
    (["--answer", "the mat"], "--answer"),
    (["--position", "40"], "--position"),
    (["--dtype", "bfloat16"], "--dtype"),
    (["--corrupt", "a", "--corrupt", "b"], "--corrupt"),
    (["--top", "0"], "--top"),
])
def test_cli_refuses_misuse_naming_the_option(cli, args, named):
    result = cli("attribute", PROMPT, *args)
    assert result.exit_code == 2, result.output
    assert named in result.stderr and "Traceback" not in result.output


def test_cli_writes_a_figure(cli, tmp_path):
    out = tmp_path / "dla.png"
    result = cli("attribute", "--corrupt", "the cat sat on the mat and the dog sat on the "
                 "rug the dog sat on the", "--out", out)
    assert result.exit_code == 0, result.output
    from PIL import Image

    with Image.open(out) as image:
        import numpy as np

        assert image.size[0] > 200 and len(np.unique(np.asarray(image.convert("L")))) > 10


def test_the_api_returns_the_commands_numbers(cli):
    from attnviz.api import attribute

    result = attribute([PROMPT], answer="mat", wrong="cat", device="cpu")
    doc = json.loads(cli("attribute", PROMPT, "--answer", "mat", "--wrong", "cat",
                         "--json").stdout)
    assert result.to_json()["prompts"][0]["parts"] == doc["prompts"][0]["parts"]
    with pytest.raises(TypeError, match="prompts must be a list"):
        attribute(PROMPT)
    from attnviz.errors import UsageError

    with pytest.raises(UsageError, match="wrong"):
        attribute([PROMPT], wrong="cat")


PAIRS = [("the cat sat on the mat the cat sat on the",
          "the cat sat on the mat the dog sat on the", "mat", "cat"),
         ("a dog ran to the barn a dog ran to the",
          "a dog ran to the barn a cat ran to the", "barn", "cat")]


def _pair_file(tmp_path, rows) -> str:
    path = tmp_path / "pairs.tsv"
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return str(path)


def test_pairs_equal_each_pair_given_alone_and_their_mean(tmp_path):
    result = run_attribute(AttributeRequest(pairs=_pair_file(tmp_path, PAIRS), device="cpu"))
    assert len(result.prompts) == 2
    for got, (clean, corrupt, answer, wrong) in zip(result.prompts, PAIRS, strict=True):
        alone = run_attribute(AttributeRequest([clean], answer=answer, wrong=wrong,
                                               corrupt=[corrupt], device="cpu")).prompts[0]
        assert got.difference is not None and alone.difference is not None
        for (_, a), (_, b) in zip(got.difference.named(), alone.difference.named(),
                                  strict=True):
            assert a == pytest.approx(b, abs=1e-6)
    summary = result.mean()
    assert summary is not None
    mean, spread = summary
    first, second = (p.difference.heads for p in result.prompts)
    assert mean.heads[1][1] == pytest.approx((first[1][1] + second[1][1]) / 2)
    assert spread[1][1] == pytest.approx(abs(first[1][1] - second[1][1]) / 2)
    assert json.loads(json.dumps(result.to_json()))["mean_over_prompts"]["of"] == \
        "clean − corrupted"


def test_pairs_are_checked_as_the_patch_command_checks_them(tmp_path, cli):
    mixed = _pair_file(tmp_path, [PAIRS[0], PAIRS[1][:3]])
    result = cli("attribute", "--pairs", mixed)
    assert result.exit_code == 2 and "wrong answer" in result.stderr
    uneven = _pair_file(tmp_path, [(PAIRS[0][0], "the cat sat", "mat", "cat")])
    result = cli("attribute", "--pairs", uneven)
    assert result.exit_code == 2 and "same length" in result.stderr
    result = cli("attribute", PROMPT, "--pairs", _pair_file(tmp_path, PAIRS))
    assert result.exit_code == 2 and "--pairs" in result.stderr
    result = cli("attribute", "--pairs", _pair_file(tmp_path, PAIRS), "--answer", "mat")
    assert result.exit_code == 2 and "--answer" in result.stderr
    shown = cli("attribute", "--pairs", _pair_file(tmp_path, PAIRS))
    assert shown.exit_code == 0 and "mean over 2 prompts" in shown.stdout


def test_export_holds_every_number(tmp_path, cli):
    from safetensors import safe_open

    path = tmp_path / "dla.safetensors"
    result = cli("attribute", PROMPT, "-a", "mat", "--wrong", "cat", "-c",
                 "the cat sat on the mat the dog sat on the", "--export", path)
    assert result.exit_code == 0, result.output
    doc = json.loads(cli("attribute", PROMPT, "-a", "mat", "--wrong", "cat", "-c",
                         "the cat sat on the mat the dog sat on the", "--json").stdout)
    with safe_open(str(path), "pt") as f:
        heads = f.get_tensor("heads")
        assert heads.shape == (1, 2, 2)
        assert heads[0].tolist() == doc["prompts"][0]["parts"]["heads"]
        assert f.get_tensor("difference.heads")[0].tolist() == \
            doc["prompts"][0]["difference_clean_minus_corrupt"]["heads"]
        assert json.loads(f.metadata()["document"]) == doc
    as_json = tmp_path / "dla.json"
    assert cli("attribute", PROMPT, "--export", as_json).exit_code == 0
    assert json.loads(as_json.read_text())["command"] == "attribute"
    refused = cli("attribute", "--export", tmp_path / "x.txt")
    assert refused.exit_code == 2 and "--export" in refused.stderr


def test_html_page_escapes_the_prompt_and_shows_every_head(tmp_path, cli):
    page = tmp_path / "dla.html"
    hostile = "the cat sat on the mat <script>alert(1)</script> the cat sat on the"
    result = cli("attribute", hostile, "-a", "mat", "--wrong", "cat", "--html", page)
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text
    doc = json.loads(cli("attribute", hostile, "-a", "mat", "--wrong", "cat", "--json").stdout)
    heads = doc["prompts"][0]["parts"]["heads"]
    for layer, row in enumerate(heads):
        for h, value in enumerate(row):
            assert f'title="L{layer}H{h}: {value:+.6g}"' in text
