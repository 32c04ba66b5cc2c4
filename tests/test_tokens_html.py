"""The `tokens --html` route view in headless Chromium: it draws every edge the document holds,
a click on an input token keeps exactly the routes leaving it (checked against a reachability
walk written here), nothing is requested beyond the file, and no script error occurs."""

from __future__ import annotations

import json

import pytest
from browser import Browser, find_chromium

from attnviz.app.tokens import TokensRequest, run_tokens
from attnviz.render.tokens_html import MIN_EDGE_SHARE, _document, tokens_page

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    result = run_tokens(TokensRequest(["the quick brown fox jumps over a lazy dog the quick "
                                       "brown fox </script> <b>"], position="12"))
    folder = tmp_path_factory.mktemp("page")
    path = folder / "tokens.html"
    path.write_text(tokens_page(result), encoding="utf-8")
    with Browser(CHROMIUM, tmp_path_factory.mktemp("profile")) as browser:
        tab = browser.open(path.as_uri())
        yield tab, _document(result)
        assert tab.errors() == []
        assert all(u.startswith("file://") and u.endswith(".html") for u in tab.requests())
        tab.close()


def _lines(tab, colour=None):
    selector = "line.edge" + (f"[stroke='{colour}']" if colour else "")
    return tab.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length")


def test_route_view_draws_every_edge_and_follows_a_token(page):
    tab, doc = page
    s = doc["sentences"][0]
    edges = s["edges"]["rollout"]
    assert edges and all(e[3] >= MIN_EDGE_SHARE for e in edges)
    assert _lines(tab) == len(edges)
    assert _lines(tab, "#ddd") == 0  # nothing followed: every edge drawn in colour
    start = s["index"][3]  # 'fox'
    tab.evaluate(f"window.attnvizTokens.follow({start})")
    reach = {(0, start)}
    for k in range(s["layers"]):
        reach |= {(k + 1, e[2]) for e in edges if e[0] == k and (k, e[1]) in reach}
    on = [e for e in edges if (e[0], e[1]) in reach and (e[0] + 1, e[2]) in reach]
    assert 0 < len(on) < len(edges)
    assert _lines(tab, "#3b528b") == len(on)
    assert _lines(tab) - _lines(tab, "#3b528b") == len(edges) - len(on)  # negative: the rest grey
    tab.evaluate("window.attnvizTokens.follow(null)")
    assert _lines(tab, "#ddd") == 0


def test_tokens_arrive_as_text(tmp_path_factory):
    result = run_tokens(TokensRequest(["the </script> <b> cat <i> the </script>"],
                                      check=False))
    folder = tmp_path_factory.mktemp("markup")
    path = folder / "tokens.html"
    path.write_text(tokens_page(result), encoding="utf-8")
    with Browser(CHROMIUM, tmp_path_factory.mktemp("profile")) as browser:
        tab = browser.open(path.as_uri())
        texts = tab.evaluate("[...document.querySelectorAll('text.token')]"
                             ".map(t => t.textContent)")
        assert texts == _document(result)["sentences"][0]["tokens"]
        assert "<" in texts and "script" in texts  # shown as text, never as markup
        assert tab.evaluate("document.querySelectorAll('b, i').length") == 0
        assert tab.errors() == []
        tab.close()
