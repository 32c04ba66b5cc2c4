"""The public Python API (`attnviz.__all__`): the same use cases and numbers as the commands,
results that draw themselves, and an import that does not load torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import BUNDLED, ROOT, colored_runs, read_image

import attnviz


def test_all_names_resolve():
    for name in attnviz.__all__:
        assert getattr(attnviz, name) is not None, name
    with pytest.raises(AttributeError):
        attnviz.not_a_name  # noqa: B018


def test_import_is_light():
    code = "import sys, attnviz; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_split_equals_the_cli(cli):
    result = attnviz.split(embed_dim=32, num_heads=4, seed=3)
    shown = json.loads(cli("split", "-E", "32", "-H", "4", "--seed", "3", "--json").stdout)
    assert result.to_json()["projections"] == shown["projections"]
    assert result.report.proof.max_abs_diff == shown["max_abs_diff"]
    assert result.passed


def test_split_slices_are_the_modules_own_rows():
    """Independent check: the W_q slice the API reports for head h is rows h·d:(h+1)·d of the
    nn.MultiheadAttention that torch itself builds with the same seed."""
    result = attnviz.split(embed_dim=16, num_heads=4, seed=5)
    torch.manual_seed(5)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    rows = [(h.start, h.stop) for h in result.report.projections["q"].heads]
    assert rows == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert torch.equal(result.layer_weights.W_q, mha.in_proj_weight[:16].detach())


def test_heatmap_equals_the_cli(cli):
    sentence = "the cat sat on the mat the cat sat"
    heat = attnviz.run_heatmap([sentence])
    shown = json.loads(cli("heatmap", sentence, "--json").stdout)
    assert [s.to_json() for s in heat.head_stats] == shown["head_stats"]
    rows = heat.views[0].values.sum(-1)
    assert abs(rows - 1).max() < 1e-5


@pytest.mark.slow
def test_results_draw_themselves(tmp_path):
    heat = attnviz.run_heatmap(["a b a b"], random=True, embed_dim=24, num_heads=3, seed=1)
    png = heat._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "heat.png").write_bytes(png)
    image = read_image(tmp_path / "heat.png")
    panels = [r for r in colored_runs(image, axis=1) if r[1] - r[0] > 0.1 * image.shape[1]]
    assert len(panels) == 3  # one per head (the colour bar is narrower)
    assert heat.figure().axes
    assert attnviz.split(embed_dim=8, num_heads=2)._repr_png_()[:4] == b"\x89PNG"


def test_inspect_and_find_layers():
    inventory = attnviz.find_layers(BUNDLED)
    assert [layer.name for layer in inventory.layers] == ["layers.0.self_attn",
                                                           "layers.1.self_attn"]
    report = attnviz.inspect(BUNDLED, layer=1)
    assert report.detail is not None and report.doc["layer_detail"]["name"] == "layers.1.self_attn"


def test_errors_are_attnviz_errors():
    with pytest.raises(attnviz.UsageError, match="not divisible"):
        attnviz.split(embed_dim=10, num_heads=4)
    with pytest.raises(attnviz.AttnvizError) as caught:
        attnviz.open_checkpoint(ROOT / "no-such-file.safetensors")
    assert caught.value.fix


def test_heatmap_displays_the_interactive_view_in_notebooks():
    heat = attnviz.run_heatmap(["the cat sat"])
    inline = heat._repr_html_()
    assert inline.startswith("<iframe") and "srcdoc=" in inline
    page = heat.html()
    assert page.lstrip().lower().startswith("<!doctype html") and "http://" not in page
