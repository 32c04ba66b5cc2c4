"""`attnviz compare --html`: the offline page read back with an HTML parser. Every head's numbers
on the page (the weights' relative distance; with a corpus each statistic's difference and its
interval) equal the --json numbers of the same run (themselves checked against an independent
computation in test_compare_cli); the page has no script and no network reference; a hostile
model folder and corpus name are escaped; outputs never land in a model or over an input.
Negative controls: a page with one number changed, or one head dropped, is caught."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from typing import Any

import pytest
from browser import Browser, find_chromium
from helpers import SAMPLES, assert_clean_error
from test_compare_cli import SENTENCES, copy_sample, zoo_pair  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

HOSTILE = "m<b onmouseover=alert(1)>&'\""


class Cells(HTMLParser):
    """Every <td> with data-head: its section's id and its data- attributes; every tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.section = ""
        self.cells: list[tuple[str, dict[str, str]]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        found = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.section = found.get("id", "")
        elif tag == "td" and "data-head" in found:
            self.cells.append((self.section, found))


def read_page(text: str) -> Cells:
    parser = Cells()
    parser.feed(text)
    parser.close()
    return parser


def _value(text: str) -> float | None:
    return None if text == "" else float(text)


def mismatches(text: str, doc: dict[str, Any]) -> list[str]:
    """Where the page's numbers differ from the --json document's (exact equality), or a head
    is missing or extra."""
    page = read_page(text)
    found: list[str] = []
    weights = {(int(a["data-layer"]), int(a["data-head"])): a
               for section, a in page.cells if section == "weights"}
    expected = {(layer["index"], h["head"]): h for layer in doc["weights"]["layers"]
                for h in layer["heads"]}
    if weights.keys() != expected.keys():
        found.append(f"weights heads {sorted(weights)} != {sorted(expected)}")
    for key in weights.keys() & expected.keys():
        cell, head = weights[key], expected[key]
        if _value(cell["data-distance"]) != head["distance"] or \
                (cell["data-identical"] == "true") != head["identical"]:
            found.append(f"weights {key}")
    corpus = doc.get("corpus")
    statistics = {s for s, _ in page.cells if s.startswith("s-")}
    if corpus is None:
        return found + [f"unexpected {s}" for s in sorted(statistics)]
    names = [k[:-len("_diff")] for k in corpus["heads"][0] if k.endswith("_diff")]
    if statistics != {f"s-{n}" for n in names}:
        found.append(f"statistic tabs {sorted(statistics)} != {names}")
    for name in names:
        cells = {(int(a["data-layer"]), int(a["data-head"])): a
                 for section, a in page.cells if section == f"s-{name}"}
        rows = {(r["layer"], r["head"]): r for r in corpus["heads"]}
        if cells.keys() != rows.keys():
            found.append(f"{name}: heads {sorted(cells)} != {sorted(rows)}")
        for key in cells.keys() & rows.keys():
            for part in ("diff", "low", "high"):
                if _value(cells[key][f"data-{part}"]) != rows[key][f"{name}_{part}"]:
                    found.append(f"{name} {key} {part}")
    return found


def assert_offline(text: str) -> None:
    page = read_page(text)
    assert not page.tags & {"script", "iframe", "img", "link", "object", "embed"}, page.tags
    assert "http" not in text and "src=" not in text and "url(" not in text


def test_weights_page_equals_json_and_is_escaped(cli, tmp_path):
    a = copy_sample(tmp_path / HOSTILE)
    b = copy_sample(tmp_path / "b", perturb=True)
    page = tmp_path / "p.html"
    result = cli("compare", "-w", a, "-a", b, "--html", page)
    assert result.exit_code == 0, result.output
    assert f"wrote {page}" in result.stdout
    doc = json.loads(cli("compare", "-w", a, "-a", b, "--json").stdout)
    text = page.read_text(encoding="utf-8")
    assert mismatches(text, doc) == []
    assert_offline(text)
    assert "<b onmouseover" not in text and "&lt;b onmouseover=alert(1)&gt;&amp;" in text
    cells = read_page(text).cells
    assert len(cells) == 8
    moved = [(a["data-layer"], a["data-head"]) for _, a in cells if a["data-identical"] != "true"]
    assert moved == [("1", "2")]
    # negative controls: one changed number, one dropped head, are caught
    value = doc["weights"]["layers"][1]["heads"][2]["distance"]
    distance = repr(value)
    assert text.count(f"data-distance='{distance}'") == 1
    changed = text.replace(f"data-distance='{distance}'",
                           f"data-distance='{value * (1 + 1e-9)!r}'")
    assert mismatches(changed, doc) == ["weights (1, 2)"]
    dropped = text.replace("data-head='3'", "data-hd='3'", 1)
    assert mismatches(dropped, doc) and mismatches(dropped, doc)[0].startswith("weights heads")


def test_html_never_lands_in_a_model_or_over_an_input(cli, tmp_path):
    a, b = copy_sample(tmp_path / "a"), copy_sample(tmp_path / "b")
    before = {p: p.stat().st_mtime_ns for p in [*a.iterdir(), *b.iterdir()]}
    assert_clean_error(cli("compare", "-w", a, "-a", b, "--html", b / "p.html"), 1,
                       "inside a model folder being read")
    assert_clean_error(cli("compare", "-w", a, "-a", b, "--html", tmp_path / "p.png"), 2,
                       "--html")
    assert_clean_error(cli("compare", "-w", a, "-a", b, "--html", tmp_path / "x.html",
                           "--csv", tmp_path / "x.html"), 2)
    assert {p: p.stat().st_mtime_ns for p in [*a.iterdir(), *b.iterdir()]} == before
    # a corpus file named like a page is an input: never overwritten
    corpus = tmp_path / "c.html"
    corpus.write_text("the cat sat\n", encoding="utf-8")
    phi3 = SAMPLES / "models" / "phi3-tiny-lm"
    done = cli("compare", corpus, "-m", phi3, "-a", phi3, "--html", corpus)
    assert done.exit_code != 0 and "never overwrites its inputs" in done.stderr
    assert corpus.read_text(encoding="utf-8") == "the cat sat\n"


@pytest.mark.hf
def test_corpus_page_equals_json_per_statistic(cli, tmp_path, zoo_pair):  # noqa: F811
    a, b, _ = zoo_pair
    corpus = tmp_path / f"{HOSTILE}.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    model = tmp_path / HOSTILE
    shutil.copytree(a, model)
    page = tmp_path / "p.html"
    result = cli("compare", corpus, "-m", model, "-a", b, "--html", page)
    assert result.exit_code == 0, result.output
    doc = json.loads(cli("compare", corpus, "-m", model, "-a", b, "--json").stdout)
    text = page.read_text(encoding="utf-8")
    assert mismatches(text, doc) == []
    assert_offline(text)
    assert "<b onmouseover" not in text
    assert text.count("&lt;b onmouseover=alert(1)&gt;&amp;") >= 3  # model A (title, line), corpus
    cells = read_page(text).cells
    names = [k[:-len("_diff")] for k in doc["corpus"]["heads"][0] if k.endswith("_diff")]
    assert len(names) >= 2 and len(cells) == 8 * (1 + len(names))
    # the sharpened head's entropy interval lies below 0: marked on the page
    entropy = {(a["data-layer"], a["data-head"]): a for s, a in cells if s == "s-entropy"}
    assert entropy["1", "2"]["class"] == "u" and entropy["0", "0"]["class"] == ""
    # negative control: another head's numbers in the changed head's cell are caught
    row = next(r for r in doc["corpus"]["heads"] if (r["layer"], r["head"]) == (1, 2))
    other = next(r for r in doc["corpus"]["heads"] if (r["layer"], r["head"]) == (1, 1))
    swapped = text.replace(f"data-diff='{row['entropy_diff']!r}'",
                           f"data-diff='{other['entropy_diff']!r}'", 1)
    assert swapped != text and "entropy (1, 2) diff" in mismatches(swapped, doc)
    if find_chromium() is not None:  # the tabs switch by link alone: no script
        (tmp_path / "profile").mkdir()
        with Browser(find_chromium() or "", tmp_path / "profile") as browser:
            shown = browser.open(page.as_uri() + "#s-entropy")
            display = "id => getComputedStyle(document.getElementById(id)).display"
            assert shown.evaluate(f"({display})('s-entropy')") == "block"
            assert shown.evaluate(f"({display})('weights')") == "none"
            assert shown.evaluate(f"({display})('s-max_weight')") == "none"
            assert shown.errors() == []


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed")
def test_page_renders_in_chromium_without_errors_or_requests(cli, tmp_path):
    a, b = copy_sample(tmp_path / HOSTILE), copy_sample(tmp_path / "b", perturb=True)
    page = tmp_path / "p.html"
    assert cli("compare", "-w", a, "-a", b, "--html", page).exit_code == 0
    (tmp_path / "profile").mkdir()
    with Browser(find_chromium() or "", tmp_path / "profile") as browser:
        shown = browser.open(page.as_uri())
        # the weights tab is shown by default, with one visible cell per head
        assert shown.evaluate("getComputedStyle(document.getElementById('weights')).display") \
            == "block"
        assert shown.evaluate("[...document.querySelectorAll('#weights td[data-head]')]"
                              ".filter(td => td.offsetWidth > 0).length") == 8
        assert shown.evaluate("document.title").startswith(str(a))  # escaped, read back whole
        assert shown.errors() == []
        assert all(u.startswith("file://") for u in shown.requests()), shown.requests()
        # negative control: a page with a script error is caught by the same check
        broken = tmp_path / "broken.html"
        broken.write_text(page.read_text(encoding="utf-8").replace(
            "</body>", "<script>undefinedFunction()</script></body>"), encoding="utf-8")
        other = browser.open(broken.as_uri())
        assert other.errors() != []
