"""Terminal maps carry their information with and without colour: shade glyphs with a legend
when colour is off, full-brightness colour when on; one --scale with the figures; index ticks
for long inputs; a statistics table that fits 80 columns."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from rich.console import Console

from attnviz.compute.display.scale import Scale, map_scale
from attnviz.compute.display.views import MapView
from attnviz.render import maps_terminal
from attnviz.render.split_terminal import band_view

SENTENCE = "the cat sat on the mat the cat sat"
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _map_rows(stdout: str, cols: int) -> list[str]:
    """The cells of every map row (panels side by side: label, then `cols` 2-wide cells)."""
    width = maps_terminal.ROW_LABEL_WIDTH + 1 + 2 * cols
    rows = []
    for line in stdout.splitlines():
        for start in range(0, len(line), width + maps_terminal.GAP):
            label, cells = line[start : start + 9], line[start + 9 : start + width]
            if label[:8].strip() and len(cells) == 2 * cols and set(cells) <= set(" ░▒▓█·"):
                rows.append(cells)
    return rows


def test_piped_maps_use_shade_glyphs_and_a_legend(cli):
    result = cli("heatmap", SENTENCE)
    assert result.exit_code == 0, result.output
    rows = _map_rows(result.stdout, 9)
    assert len(rows) == 4 * 9  # 2 layers × 2 heads × 9 queries
    glyphs = set("".join(rows)) - {" ", "·"}
    assert {"░", "█"} <= glyphs and len(glyphs) >= 3  # not one █ for every weight
    legend = next(line for line in result.stdout.splitlines() if line.startswith("weight"))
    for glyph in "░▒▓█":
        assert glyph in legend
    assert "masked" in legend
    assert "scale max: 0 to 1" in result.stdout


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_colour_terminals_get_shades(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80)
    values = np.array([[1.0, 0.0], [0.3, 0.7]], dtype=np.float32)
    view = MapView(0, 0, 0, values, ["a", "b"], ["a", "b"], False)
    maps_terminal.print_maps(console, [view], ["a b"], "fixed")
    text = SGR.sub("", buffer.getvalue())
    assert "██ ·" in text and "░░▓▓" in text


def _cell_params(ansi: str) -> list[list[str]]:
    """The SGR parameters in force for each run of █ cells."""
    found = []
    for match in re.finditer(r"\x1b\[([0-9;]*)m(█+)", ansi):
        found.append(match.group(1).split(";"))
    return found


def _dim(params: list[str]) -> bool:
    i = 0
    while i < len(params):
        if params[i] in ("38", "48"):  # a colour: 38;2;r;g;b or 38;5;n
            i += 5 if params[i + 1 : i + 2] == ["2"] else 3
            continue
        if params[i] == "2":
            return True
        i += 1
    return False


def test_colour_cells_are_full_brightness(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system="truecolor", width=80)
    values = np.array([[1.0, 0.0], [0.3, 0.7]], dtype=np.float32)
    view = MapView(0, 0, 0, values, ["a", "b"], ["a", "b"], False)
    maps_terminal.print_maps(console, [view], ["a b"], "fixed")
    cells = _cell_params(buffer.getvalue())
    assert cells and not any(_dim(params) for params in cells)
    assert "░" not in buffer.getvalue()  # colour carries the weight
    # the split command's band picture, likewise
    from attnviz.compute.splitting.split_views import BandLine, BandPicture

    picture = BandPicture([BandLine(0, (0, 1), (0, 2), [0.2, 1.0]),
                           BandLine(1, (1, 2), (2, 4), [0.9, 0.5])], [(0, 1), (1, 2)], 1.0)
    buffer.truncate(0)
    console.print(band_view(picture, 2, 2))
    cells = _cell_params(buffer.getvalue())
    assert cells and not any(_dim(params) for params in cells)


def test_split_band_picture_shades_without_colour(cli):
    result = cli("split", "-E", "32", "-H", "4")
    assert result.exit_code == 0, result.output
    band = [line.split("│", 1)[1] for line in result.stdout.splitlines() if "│" in line
            and set(line.split("│", 1)[1]) <= set("░▒▓█")]
    assert len(band) >= 4
    assert len(set("".join(band))) >= 3  # brightness shows as shade, not one █ everywhere
    assert "shade = mean |w|" in result.stdout


def test_scale_positions_and_inverse():
    views = [np.array([[0.5, 0.25]]), np.array([[0.0, 0.125]])]
    linear = map_scale("max", views)
    assert (linear.vmin, linear.vmax) == (0.0, 0.5)
    assert linear.position(0.25) == pytest.approx(0.5)
    assert map_scale("fixed", views) == Scale("fixed", 0.0, 1.0)
    log = map_scale("log", views)
    assert log.vmin == pytest.approx(5e-4) and log.position(0.5) == 1.0
    assert log.position(log.weight_at(0.3)) == pytest.approx(0.3)
    assert log.position(1e-9) == 0.0


def test_scale_option_changes_the_terminal_picture(cli):
    # a random layer on a 12-token sentence: no weight near 1, so 'fixed' shows no full cell
    words = "a b c d e f g h i j k l"
    args = ["heatmap", "--random", "-H", "2", words, "--head", "0", "--no-stats"]
    shown = {kind: cli(*args, *(["--scale", kind] if kind else [])) for kind in
             (None, "max", "fixed", "log")}
    assert all(r.exit_code == 0 for r in shown.values())
    assert shown[None].stdout == shown["max"].stdout  # the documented default
    rows = {kind: _map_rows(r.stdout, 12) for kind, r in shown.items()}
    assert all(len(r) == 12 for r in rows.values())
    cells = {kind: "".join(r) for kind, r in rows.items()}
    assert "█" in cells["max"] and "█" not in cells["fixed"]
    assert "scale fixed: 0 to 1" in shown["fixed"].stdout
    assert "scale log:" in shown["log"].stdout
    bad = cli(*args, "--scale", "sqrt")
    assert bad.exit_code == 2 and "unknown --scale 'sqrt'" in bad.stderr


def test_long_inputs_get_index_ticks_and_a_token_key(cli):
    words = " ".join(f"w{i}" for i in range(40))
    result = cli("heatmap", "--random", "-H", "2", words, "--head", "1", "--no-stats")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("L0 · head 1"))
    ticks = lines[title + 1].split()
    assert ticks[:4] == ["0", "5", "10", "15"] and ticks[-1] == "35"
    assert lines[title + 2].strip().startswith("0 w0 ")  # rows: index and token
    assert lines[title + 3].strip().startswith("1 w1 ")
    key = " ".join(line for line in lines if "0:w0" in line or "39:w39" in line)
    assert "0:w0" in key and "17:w17" in result.stdout and "39:w39" in key
    assert max(len(line) for line in lines) <= 80


def test_short_inputs_keep_their_tokens_as_labels(cli):
    result = cli("heatmap", "--random", "-H", "1", "the cat sat")
    lines = result.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("L0 · head 0"))
    assert lines[title + 1].split() == ["t", "c", "s"]  # tokens written downwards
    assert "tokens  " not in result.stdout


def test_statistics_table_fits_80_columns_and_never_cuts(cli):
    result = cli("heatmap", SENTENCE, "--no-maps")
    assert result.exit_code == 0, result.output
    table = result.stdout.split("head statistics", 1)[1].splitlines()
    assert max(len(line) for line in table) <= 80
    # nothing after the header is cut (the header's source path may be elided at a folder,
    # from a clone at a deep path)
    assert "…" not in result.stdout.split("\n", 1)[1]
    assert sum("previous-token" in line for line in table) == 2
    assert sum("induction" in line.split()[-1:] for line in table) == 2
    header = next(line for line in table if line.startswith("layer"))
    assert header.split() == list(maps_terminal.STATS_COLUMNS)


def test_statistics_numbers_are_never_truncated_even_when_narrow():
    from attnviz.compute.measures.stats import HeadStats

    stats = [HeadStats(11, 15, 5.5512, 0.01, 4095.0, 0.0, 0.01, 0.02, None, 0.75, next=0.125,
                       punctuation=0.5)]
    buffer = io.StringIO()
    Console(file=buffer, width=80).print(maps_terminal.stats_table(stats))
    row = buffer.getvalue().splitlines()[1].split()
    assert row == ["11", "15", "5.55", "0.01", "4095.0", "0.00", "0.01", "0.12", "0.02", "–",
                   "0.75", "0.50", "induction"]


def _yellow_in_panels(path) -> bool:
    """Whether a figure's panels (the colour bar excluded) hold viridis' top colour."""
    from helpers import colored_runs, read_image

    image = read_image(path)
    columns = colored_runs(image, axis=1)
    panels = image[:, columns[0][0] : columns[-2][1]]  # the last run is the colour bar
    yellow = (panels[..., 0] > 0.85) & (panels[..., 1] > 0.8) & (panels[..., 2] < 0.35)
    return bool(yellow.any())


def test_terminal_and_figure_share_one_scale(cli, tmp_path):
    """The default scale puts the largest weight at the top colour in both; --scale fixed puts
    a weight of 1 there, which this map does not reach, in both."""
    args = ["heatmap", "--random", "-H", "2", "a b c d e f g h i j k l", "--no-stats", "--maps"]
    for kind, top in ((None, True), ("fixed", False)):
        out = tmp_path / f"{kind}.png"
        result = cli(*args, *(["--scale", kind] if kind else []), "--out", out)
        assert result.exit_code == 0, result.output
        assert ("█" in "".join(_map_rows(result.stdout, 12))) is top
        assert _yellow_in_panels(out) is top
