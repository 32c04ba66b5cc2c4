"""The --html page shows every character the terminal escapes as the terminal does (issue #36
item 7, round three): a token or sentence holding U+202E (right-to-left override), U+200B,
U+2066, ESC, NUL, a C1 control or a lone surrogate reaches neither the page file nor its DOM raw.

The page file is scanned whole; where headless Chromium is installed the rendered text of the
sentence selector, token columns and meta block is compared with `errors.printable`'s form.
Negative control: the same scan over a page built without the escaping finds the characters.
"""

from __future__ import annotations

import json
import re

import pytest
from browser import Browser, find_chromium

from attnviz.app.heatmap import HeatmapRequest, run_on_batch
from attnviz.cli.paths import write_page
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.compute.measures.stats import head_stats
from attnviz.core.request import RandomSpec
from attnviz.errors import printable
from attnviz.render import html as page_html
from attnviz.render.html import render_html
from attnviz.render.html_document import document_from_run

# each is escaped by the terminal (errors.printable): what the page must never hold raw
HOSTILE_CHARS = ["\u202e", "\u200b", "\u2066", "\u2069", "\x1b", "\x00", "\x9b", "\x85",
                 "\ud800", "\u2028", "\ufeff", "\x7f", "\u200f"]
TOKENS = ["abc\u202edef", "zero\u200bwidth", "\u2066iso", "\x1b[31mred", "nul\x00",
          "c1\x9b2J", "lone\ud800", "ok", "emoji😀x"]


def _raw_hostile(text: str) -> list[str]:
    """Every character of `text` the terminal would escape (newlines aside)."""
    return sorted({ch for ch in text if ch not in "\n" and not ch.isprintable()})


@pytest.fixture(scope="module")
def hostile_doc():
    runnable = [t.replace("\ud800", "?") for t in TOKENS]
    batch = Batch([" ".join(runnable), "\u202eplain"], [runnable, ["\u202eplain"]])
    run = run_on_batch(batch, HeatmapRequest.build(random=RandomSpec(16, 2, seed=1),
                                                   device="cpu", keep_full_maps=True))
    stats = [s for c in run.layers for s in head_stats(c.weights, run.batch.tokens, c.index)]
    doc = document_from_run(run, stats)
    # a lone surrogate cannot be run (tokens are hashed as UTF-8), but a document handed to
    # render_html may hold one: put it where the run's token was
    lone = TOKENS.index("lone\ud800")
    doc["sentences"][0]["tokens"][lone] = "lone\ud800"
    doc["sentences"][0]["text"] = " ".join(TOKENS)
    for entry in doc["maps"]:
        if entry["sentence"] == 0:
            entry["row_labels"][lone] = entry["col_labels"][lone] = "lone\ud800"
    # paths, notes and layer names come from files too
    doc["source"] = "/models/\u202egpj.evil/\x1b]0;x\x07/m\udcff.safetensors"
    doc["notes"] = [*doc["notes"], "note \u2066from a file\u2069 \x85"]
    doc["layers"][0]["name"] = "layer\u202e.0"
    return doc


def test_page_file_never_holds_a_character_the_terminal_escapes(hostile_doc):
    page = render_html(hostile_doc)
    assert [ch for ch in HOSTILE_CHARS if ch in page] == []
    assert _raw_hostile(page) == []
    # the title, outside the JSON, is escaped too
    title = re.search(r"<title>(.*?)</title>", page, re.S)
    assert title is not None and "\\u202e" in title.group(1)
    page.encode("utf-8")  # no lone surrogate left to make the write fail


def test_page_data_is_the_terminals_escaped_form(hostile_doc):
    page = render_html(hostile_doc)
    data = json.loads(re.search(r'id="attnviz-data">(.*?)</script>', page, re.S).group(1))
    assert data["sentences"][0]["tokens"] == [printable(t, None) for t in TOKENS]
    assert data["sentences"][0]["text"] == printable(" ".join(TOKENS), None)
    assert data["source"] == printable(hostile_doc["source"], None)
    assert data["layers"][0]["name"] == "layer\\u202e.0"
    for entry in data["maps"]:
        for label in entry["row_labels"] + entry["col_labels"]:
            assert _raw_hostile(label) == [], label
    # the parsed data holds no raw character either (JSON's own \u escapes are not enough)
    assert _raw_hostile(json.dumps(data, ensure_ascii=False)) == []
    assert "emoji😀x" in data["sentences"][0]["tokens"]  # printable text stays as it is


def test_negative_control_the_unescaped_page_is_caught(hostile_doc, monkeypatch):
    """Without the escaping the file still looks clean (JSON's \\u escapes) but its data hands
    U+202E back to the page's script; the scan of the parsed data catches it."""
    monkeypatch.setattr(page_html, "page_strings", lambda value: value)
    page = render_html(hostile_doc)
    data = json.loads(re.search(r'id="attnviz-data">(.*?)</script>', page, re.S).group(1))
    assert "\u202e" in _raw_hostile(json.dumps(data, ensure_ascii=False))
    assert "\u202e" in _raw_hostile(page)  # the <title> held it raw


CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_rendered_text_equals_the_terminals(hostile_doc, tmp_path):
    path = tmp_path / "page.html"
    write_page(render_html(hostile_doc), path)
    (tmp_path / "profile").mkdir()
    with Browser(CHROMIUM, tmp_path / "profile") as browser:
        page = browser.open(path.as_uri())
        assert page.evaluate("document.body.dataset.ready") == "1"
        tokens = page.evaluate(
            "[...document.querySelectorAll('#hv-left .tok')].map(n => n.textContent)")
        assert tokens == [printable(t, None) for t in TOKENS]
        options = page.evaluate(
            "[...document.querySelectorAll('#sentence-select option')].map(n => n.textContent)")
        body = page.evaluate("document.body.innerText + document.title + "
                             "[...document.querySelectorAll('option')]"
                             ".map(n => n.textContent).join(' ')")
        assert _raw_hostile(body) == [], body
        assert any("\\u202e" in option for option in options), options
        page.close()
