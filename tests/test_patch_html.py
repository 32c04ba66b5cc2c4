"""attnviz patch --html in headless Chromium: the grids the page shows are the result's numbers,
clicking a head shows its per-position row, no request leaves the file, and text from the user
stays text."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from browser import Browser, find_chromium

from attnviz.app.patch import PatchRequest, run_patch
from attnviz.render.patch_html import patch_html

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: Any) -> Any:
    assert CHROMIUM is not None
    with Browser(CHROMIUM, tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


def test_page_shows_the_grids_and_a_heads_positions(browser, tmp_path):
    result = run_patch(PatchRequest())
    hostile = dataclasses.replace(result, model="<script>window.bad=1</script><img src=x>")
    path = tmp_path / "p.html"
    path.write_text(patch_html(hostile), encoding="utf-8")
    page = browser.open(path.as_uri())
    assert page.evaluate("document.body.dataset.ready") == "1"
    heads = result.grid("heads")
    at = result.grid("head-positions")
    assert heads is not None and at is not None
    shown = page.evaluate("document.querySelector('td[data-cell=\"L0 H1\"]').textContent")
    assert shown == f"{heads.mean[0][1]:.2f}"
    page.evaluate("document.querySelector('td[data-cell=\"L0 H1\"]').click()")
    row = page.evaluate("[...document.querySelectorAll('.detail td.cell')]"
                        ".map(td => td.textContent)")
    assert row == [f"{v:.2f}" for v in at.mean[at.rows.index("L0H1")]]
    # the hostile name is text: no script ran, no image was requested
    assert page.evaluate("window.bad === undefined")
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.errors() == []
    assert all(u.startswith("file://") for u in page.requests()), page.requests()
    # negative control: the same check sees a different head's row as different
    other = page.evaluate("document.querySelector('td[data-cell=\"L1 H1\"]').textContent")
    assert other != shown
    page.close()
    assert json.loads(json.dumps(result.to_json()))  # the document is strict JSON
