"""The page's step view of a `--generate` run: its document holds each generated token's row of
every head at full key resolution (8 bits, within half a step of the run's weights), and in
headless Chromium, offline, clicking (or stepping with the keyboard to) a generated token shows
exactly that token's exported row: one head's, or the mean over heads; a row one step off does
not match. Encoder-decoders (Marian) show cross rows over the source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser import Browser, find_chromium

from attnviz.render.html import render_html
from attnviz.render.html_codes import LEVELS, dequantize

SENTENCES = ["the cat sat on the mat the cat", "one two three four one two"]
N_NEW = 4
CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")


def _document(result: Any) -> dict[str, Any]:
    from attnviz.render.html_document import document_from_run

    return document_from_run(result.run, result.head_stats, result.breakdown,
                             generation=result.generation)


@pytest.fixture(scope="module")
def bundled_generated() -> tuple[Any, dict[str, Any]]:
    from attnviz.app.heatmap import run_heatmap
    from attnviz.core.request import GenerateSpec, HeatmapRequest

    result = run_heatmap(HeatmapRequest.build(sentences=tuple(SENTENCES), device="cpu",
                                              generate=GenerateSpec(N_NEW)))
    return result, _document(result)


def _decode_rows(entry: dict[str, Any]) -> np.ndarray:
    import base64

    heads, rows, cols = len(entry["heads"]), entry["rows"], entry["cols"]
    codes = np.frombuffer(base64.b64decode(entry["codes"]), dtype=np.uint8)
    scales = np.frombuffer(base64.b64decode(entry["scales"]), dtype="<f4")
    return dequantize(codes.reshape(heads, rows, cols), scales.reshape(heads, rows))


def _true_rows(result: Any, entry: dict[str, Any]) -> np.ndarray:
    """The run's own rows of the generated tokens (H, T, K), from its full maps."""
    b, first = entry["sentence"], entry["first"]
    weights = result.run.layer(entry["layer"]).weights
    return weights[b, :, first:first + entry["rows"], :entry["cols"]].numpy()


def test_step_rows_are_the_runs_rows(bundled_generated: Any) -> None:
    result, doc = bundled_generated
    generation = doc["generation"]
    assert [s["first"] for s in generation["sentences"]] == result.generation.prompt_lengths
    assert [s["tokens"] for s in generation["sentences"]] == result.generation.generated_tokens
    assert len(generation["rows"]) == len(SENTENCES) * len(result.run.layers)
    assert generation["left_out"] == []
    for entry in generation["rows"]:
        true = _true_rows(result, entry)
        got = _decode_rows(entry)
        assert entry["key_labels"] == result.run.batch.tokens[entry["sentence"]]
        assert np.array_equal(np.isnan(got), true == 0.0)  # causal: later keys masked
        bound = true.max(-1, keepdims=True) / (2 * LEVELS) + 1e-7
        assert np.all(np.abs(np.nan_to_num(got) - true) <= bound)
        # negative control: the rows one step earlier are not these
        earlier = result.run.layer(entry["layer"]).weights[
            entry["sentence"], :, entry["first"] - 1:entry["first"] - 1 + entry["rows"],
            :entry["cols"]].numpy()
        assert np.abs(np.nan_to_num(got) - earlier).max() > 10 * bound.max()
    assert any("generated, sentence 1: rows 8-11 (sat on the mat)" in n for n in doc["notes"])


def test_step_rows_respect_the_size_budget(bundled_generated: Any) -> None:
    from attnviz.render.html_steps import generation_document

    result, _ = bundled_generated
    cells = sum(len(e["heads"]) * e["rows"] * e["cols"] for e in
                _document(result)["generation"]["rows"] if e["layer"] == 0)
    small = generation_document(result.run, result.generation, budget=cells)
    assert {e["layer"] for e in small["rows"]} == {0} and small["left_out"] == ["1"]


# ---- in a browser --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory: Any) -> Any:
    assert CHROMIUM is not None
    with Browser(CHROMIUM, tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


def _open(browser: Any, doc: dict[str, Any], tmp_path: Path) -> Any:
    path = tmp_path / "steps.html"
    path.write_text(render_html(doc), encoding="utf-8")
    page = browser.open(path.as_uri())
    assert page.evaluate("document.body.dataset.ready") == "1"
    assert page.evaluate("document.body.dataset.stepReady") == "1"
    return page


def _shown(page: Any) -> tuple[list[str], list[float | None]]:
    """The step view's row as the page shows it: each key chip's label and weight."""
    chips = page.evaluate("[...document.querySelectorAll('#step-row .key')].map(n => "
                          "[n.textContent, n.dataset.weight])")
    return [c[0] for c in chips], [float(c[1]) if c[1] else None for c in chips]


def _choose(page: Any, selector: str, value: str) -> None:
    page.evaluate(f"(() => {{ const s = document.querySelector({json.dumps(selector)}); "
                  f"s.value = {json.dumps(value)}; s.dispatchEvent(new Event('change')); }})()")


def _key(page: Any, key: str, code: int) -> None:
    for kind in ("keyDown", "keyUp"):
        page.send("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": key,
                                             "windowsVirtualKeyCode": code})


def _finish(page: Any) -> None:
    assert page.errors() == []
    assert all(u.startswith("file://") and u.endswith(".html") for u in page.requests()), \
        page.requests()
    page.close()


def _assert_row(shown: list[float | None], true: np.ndarray, bound: float) -> None:
    """Shown weights equal the true row (masked keys shown as masked), within `bound`."""
    assert len(shown) == len(true)
    for got, want in zip(shown, true, strict=True):
        if want == 0.0:
            assert got is None
        else:
            assert got is not None and abs(got - want) <= bound, (got, want)


@needs_browser
def test_click_a_generated_token_shows_its_exported_row(browser: Any, bundled_generated: Any,
                                                        tmp_path: Path) -> None:
    result, doc = bundled_generated
    page = _open(browser, doc, tmp_path)
    assert page.evaluate("document.getElementById('step-view').hidden") is False  # opens on it
    generated = page.evaluate("[...document.querySelectorAll('#step-text .gtok')]"
                              ".map(n => n.textContent)")
    assert generated == ["sat", "on", "the", "mat"]
    first = result.generation.prompt_lengths[0]
    layer = result.run.layers[-1]
    maps = layer.weights[0].numpy()  # (H, n, n): what --export writes as attn.1
    page.click("#step-text .gtok[data-step='2']")
    row = first + 2
    labels, shown = _shown(page)
    assert labels == result.run.batch.tokens[0][:row + 1]  # everything up to itself
    scale = maps[:, row, :row + 1].max() / (2 * LEVELS) + 1e-6
    _assert_row(shown, maps[:, row, :row + 1].mean(0), scale)  # the default: mean over heads
    earlier = maps[:, row - 1, :row + 1].mean(0)
    assert max(abs((s or 0.0) - w) for s, w in zip(shown, earlier, strict=True)) > 10 * scale
    assert page.evaluate("document.getElementById('step-view').dataset.row") == str(row)
    assert page.evaluate("document.getElementById('step-map').dataset.boundaryRow") == \
        str(first)
    assert page.evaluate("document.getElementById('step-map').dataset.chosenRow") == str(row)
    assert "generated token 3 of 4 “the”" in page.evaluate(
        "document.getElementById('step-status').textContent")
    # one head: its own row
    _choose(page, "#step-head", "1")
    _assert_row(_shown(page)[1], maps[1, row, :row + 1], maps[1, row].max() / (2 * LEVELS))
    # the keyboard: the focused token steps on with →, back with ←
    _key(page, "ArrowRight", 39)
    assert page.evaluate("document.activeElement.dataset.step") == "3"
    _assert_row(_shown(page)[1], maps[1, row + 1, :row + 2],
                maps[1, row + 1].max() / (2 * LEVELS))
    _key(page, "ArrowLeft", 37)
    _key(page, "ArrowLeft", 37)
    assert page.evaluate("document.getElementById('step-view').dataset.row") == str(first + 1)
    # the other layer and the second sentence
    _choose(page, "#step-layer", "0")
    _choose(page, "#sentence-select", "1")
    page.click("#step-text .gtok[data-step='0']")
    other = result.run.layers[0].weights[1].numpy()
    first = result.generation.prompt_lengths[1]
    _assert_row(_shown(page)[1], other[1, first, :first + 1], other[1, first].max() / 508)
    _finish(page)


@pytest.mark.hf
@pytest.mark.slow
@needs_browser
def test_marian_cross_rows_over_the_source(browser: Any, tmp_path: Path) -> None:
    from attnviz.api import run_model

    result = run_model("sample_weights/models/marian-tiny-model", ["the cat sat on the mat"],
                       generate=3, device="cpu")
    html = result._repr_html_()  # the notebook display carries the step view too
    assert "step-view" in html and "&quot;generation&quot;:{" in html
    doc = _document(result)
    cross = [layer for layer in result.run.layers if layer.kind == "cross"][-1]
    page = _open(browser, doc, tmp_path)
    page.click("#step-text .gtok[data-step='1']")
    labels, shown = _shown(page)
    assert labels == result.run.batch.tokens[0]  # keys: the source's tokens
    maps = cross.weights[0].numpy()  # (H, target rows, source)
    row = 1 + 1
    _assert_row(shown, maps[:, row, :len(labels)].mean(0), maps[:, row].max() / (2 * LEVELS))
    assert "keys: the source" in page.evaluate(
        "document.getElementById('step-status').textContent")
    _finish(page)
