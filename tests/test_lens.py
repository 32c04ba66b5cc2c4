"""`attnviz lens` on the bundled model: the last row equals the model's own logits, every
earlier row equals the final LayerNorm written out with that row's own statistics (reusing the
last row's scale is caught), padded batches equal each prompt alone, and the answer's rank and
probability are the softmax's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attnviz.app.lens import LensRequest, run_lens
from attnviz.app.logit_source import encode
from attnviz.compute.logit.lens_grid import lens_grid, softcap, uncap
from attnviz.core.words import hashed_ids, split_words
from attnviz.sources import bundled
from attnviz.sources.bundled_generate import _Model
from attnviz.sources.logit_bundled import BundledLogits

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the cat sat on the mat the cat sat on the"
OTHER = "a dog ran to the red barn a dog"


def _ids(text: str) -> list[int]:
    return hashed_ids(split_words(text), 1024)


def _lens_logits(texts: list[str]) -> list[torch.Tensor]:
    source = BundledLogits(bundled.open_bundled(), torch.device("cpu"))
    encoded = encode(source, texts, -1)
    run = source.run(encoded, [list(range(len(i))) for i in encoded.ids])
    assert run.lens is not None
    return [run.lens.stacked(b) for b in range(len(texts))]


def _residuals(text: str) -> list[torch.Tensor]:
    """Each row's residual (L, E), written out by hand from the stored tensors."""
    store = bundled.open_bundled()
    t = {k: store.read(k) for k in store.keys()}
    ids = torch.tensor(_ids(text))
    x = t["embed.weight"][ids] + t["pos_embed.weight"][:len(ids)]
    rows = [x]
    mha = torch.nn.MultiheadAttention(64, 2, batch_first=True)
    causal = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), 1)
    for i in range(2):
        p = f"layers.{i}."
        mha.load_state_dict({k.removeprefix(p + "self_attn."): v for k, v in t.items()
                             if k.startswith(p + "self_attn.")})
        h = F.layer_norm(x, (64,), t[p + "ln.weight"], t[p + "ln.bias"], eps=1e-5)
        with torch.no_grad():
            x = x + mha(h[None], h[None], h[None], attn_mask=causal, need_weights=False)[0][0]
        rows.append(x)
    return rows


def test_the_last_row_is_the_models_own_logits():
    lens = _lens_logits([PROMPT])[0]  # (R, P, V)
    model = _Model(bundled.open_bundled(), torch.device("cpu"))
    own = model.logits(torch.tensor([_ids(PROMPT)]))[0]  # (L, V)
    assert lens.shape[0] == 3
    assert torch.allclose(lens[-1], own, atol=1e-5)
    assert not torch.allclose(lens[-2], own, atol=1e-2)  # the rows do differ


def test_each_row_uses_its_own_norm_statistics():
    lens = _lens_logits([PROMPT])[0]
    store = bundled.open_bundled()
    w, b, U = (store.read(k) for k in ("ln_f.weight", "ln_f.bias", "unembed.weight"))
    rows = _residuals(PROMPT)
    for r, x in enumerate(rows):
        mine = F.layer_norm(x, (64,), w, b, eps=1e-5) @ U.T
        assert torch.allclose(lens[r], mine, atol=1e-4), r
    # negative control (TransformerLens #1076): the last row's σ reused for the embeddings
    last_sigma = (rows[-1].var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    x = rows[0]
    frozen = ((x - x.mean(-1, keepdim=True)) / last_sigma * w + b) @ U.T
    assert not torch.allclose(lens[0], frozen, atol=1e-2)


def test_a_padded_batch_equals_each_prompt_alone():
    both = _lens_logits([PROMPT, OTHER])
    for logits, text in zip(both, (PROMPT, OTHER), strict=True):
        alone = _lens_logits([text])[0]
        assert logits.shape == alone.shape
        assert torch.allclose(logits, alone, atol=1e-5)


def test_answer_rank_and_probability_are_the_softmaxs():
    result = run_lens(LensRequest([PROMPT], answer="mat", positions=[-1, 2], device="cpu"))
    prompt = result.prompts[0]
    lens = _lens_logits([PROMPT])[0].double()
    mat = _ids("mat")[0]
    assert prompt.positions == [len(_ids(PROMPT)) - 1, 2]
    for r, row in enumerate(prompt.cells):
        for c, position in enumerate(prompt.positions):
            probs = torch.softmax(lens[r, position], -1)
            assert row[c].answer_prob == pytest.approx(float(probs[mat]), rel=1e-5, abs=1e-9)
            assert row[c].answer_rank == 1 + int((probs > probs[mat]).sum())
            assert row[c].top[0][1] == pytest.approx(float(probs.max()), rel=1e-5)
    assert prompt.cells[-1][0].answer_rank == 1  # the model's own output predicts the repeat


def test_grid_without_an_answer_and_softcap_inverse():
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    grid = lens_grid(logits, [0, 1, 2], None, 4)  # rows: iterating (R, P, V) gives (P, V)
    assert grid.answer_rank is None and grid.top_ids.shape == (2, 3, 4)
    capped = softcap(logits, 2.0)
    assert capped.abs().max() < 2.0
    assert torch.allclose(uncap(capped, 2.0), logits, atol=1e-9)
    assert not torch.allclose(capped, logits, atol=1e-3)  # the cap is not the identity


def test_cli_grid_legend_and_json(cli):
    result = cli("lens", PROMPT, "--answer", "mat", "-p", "-1", "-p", "-2")
    assert result.exit_code == 0, result.output
    assert "legend" in result.stdout and "#1" in result.stdout and "emb" in result.stdout
    doc = json.loads(cli("lens", PROMPT, "--json", "--top", "5").stdout)
    prompt = doc["prompts"][0]
    assert doc["command"] == "lens" and prompt["rows"][0] == "embeddings"
    assert len(prompt["cells"]) == 3 and len(prompt["cells"][0]) == len(_ids(PROMPT))
    assert len(prompt["cells"][0][0]["top"]) == 5


@pytest.mark.parametrize(("args", "named"), [
    (["--position", "99"], "--position"), (["--top", "0"], "--top"),
    (["--answer", "two words"], "--answer"), (["--dtype", "float16"], "--dtype")])
def test_cli_refuses_misuse_naming_the_option(cli, args, named):
    result = cli("lens", PROMPT, *args)
    assert result.exit_code == 2, result.output
    assert named in result.stderr


def test_cli_writes_a_figure(cli, tmp_path):
    out = tmp_path / "lens.png"
    result = cli("lens", "--out", out)
    assert result.exit_code == 0, result.output
    import numpy as np
    from PIL import Image

    with Image.open(out) as image:
        assert image.size[0] > 200 and len(np.unique(np.asarray(image.convert("L")))) > 10


def test_the_api_returns_the_commands_numbers(cli):
    from attnviz.api import lens

    result = lens([PROMPT], answer="mat", positions=[-1], device="cpu")
    doc = json.loads(cli("lens", PROMPT, "--answer", "mat", "-p", "-1", "--json").stdout)
    assert result.to_json()["prompts"] == doc["prompts"]
    with pytest.raises(TypeError, match="positions must be a list"):
        lens([PROMPT], positions=-1)


def test_export_writes_the_json_document(tmp_path, cli):
    path = tmp_path / "lens.json"
    result = cli("lens", PROMPT, "--export", path)
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text()) == json.loads(cli("lens", PROMPT, "--json").stdout)


def test_html_page_escapes_tokens_and_holds_every_cell(tmp_path, cli):
    page = tmp_path / "lens.html"
    hostile = "the cat <b>sat</b> on the mat the cat sat on the"
    result = cli("lens", hostile, "--html", page, "--answer", "mat")
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "<b>" not in text and "&lt;" in text
    doc = json.loads(cli("lens", hostile, "--json", "--answer", "mat").stdout)
    cells = doc["prompts"][0]["cells"]
    assert text.count("<td class=\"l\" style=") == sum(len(row) for row in cells)
    assert f"answer #{cells[-1][-1]['answer_rank']}" in text
