"""attnviz corpus on the command line: the terminal grid, --json, --csv (the same numbers),
--html (escaped, offline), --out (a figure read back), refusals; and on the real
all-MiniLM-L6-v2, the statistics recomputed from the model's own heatmap of each example."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from helpers import ROOT, assert_clean_error

from attnviz.compute.corpus.corpus_sums import STATISTICS

pytestmark = pytest.mark.usefixtures("one_thread")
ENGLISH = ROOT / "sample_weights" / "english.txt"
LINES = ENGLISH.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "a<b>.txt"
    path.write_text("\n".join(LINES[500:530]) + "\n", encoding="utf-8")
    return path


def test_json_csv_and_terminal_say_the_same(cli, small, tmp_path):
    done = cli("corpus", small, "--json", "--csv", tmp_path / "h.csv", "--resamples", "20")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout.split("\nwrote ")[0])
    assert doc["examples"] == 30 and doc["counts"]["used"] == 30
    with open(tmp_path / "h.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(doc["heads"]) == 4
    for row, head in zip(rows, doc["heads"], strict=True):
        assert (int(row["layer"]), int(row["head"]), row["type"]) == \
            (head["layer"], head["head"], head["type"])
        for name in STATISTICS:
            mean = head["statistics"][name]["mean"]
            assert (row[name] == "") if mean is None else math.isclose(float(row[name]), mean)
            assert int(row[f"{name}_queries"]) == head["statistics"][name]["queries"]
    shown = cli("corpus", small, "--resamples", "20", env={"COLUMNS": "80"})
    assert shown.exit_code == 0 and shown.stderr == ""
    grid = shown.stdout.splitlines()
    header = next(i for i, line in enumerate(grid) if line.startswith("layer"))
    for head in doc["heads"]:
        cells = grid[header + 1 + head["layer"]].split()
        assert cells[1 + 2 * head["head"] + 1] == str(round(100 * head["stability"]))
    stat = cli("corpus", small, "--resamples", "20", "--overview", "previous")
    first = doc["heads"][0]["statistics"]["previous"]
    assert f"{first['mean']:.2f}".replace("0.", ".", 1) in stat.stdout and "±" in stat.stdout


def test_html_page_is_offline_and_escaped(cli, small, tmp_path):
    page = tmp_path / "p.html"
    assert cli("corpus", small, "--html", page, "--resamples", "10").exit_code == 0
    text = page.read_text(encoding="utf-8")
    assert "a&lt;b&gt;.txt" in text and "a<b>" not in text
    assert "<script" not in text and "http" not in text
    assert text.count("<tr>") >= 4 + 4  # a row per head in the statistics table, and more


def test_figure_has_a_panel_per_statistic_and_the_settle_curve(cli, small, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "f.png"
    assert cli("corpus", small, "--out", out, "--resamples", "10").exit_code == 0
    pixels = imread(out)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    assert float(np.std(pixels[..., :3])) > 0.01  # not blank


@pytest.mark.parametrize("args, named", [
    (["--overview", "entropy", "--json"], "--overview"),
    (["--save-every", "2"], "--save-every"),
    (["--resume"], "--resume"),
    (["--dtype", "bfloat16"], "--dtype"),
    (["--field", "text"], "--field"),
    (["--limit", "0"], "--limit"),
    (["--long", "cut"], "--long"),
])
def test_options_that_cannot_apply_are_refused(cli, small, args, named):
    assert_clean_error(cli("corpus", small, *args), 2, named)


def test_missing_corpus_and_outputs_over_inputs_are_refused(cli, small, tmp_path):
    assert_clean_error(cli("corpus", tmp_path / "none.txt"), 2, "cannot read the corpus")
    assert_clean_error(cli("corpus", small, "--csv", small.with_suffix(".csv").with_name(
        "x.txt")), 2, "--csv")
    page = tmp_path / "c.html"
    page.write_text("An example sentence saved under a page's name.\n", encoding="utf-8")
    done = cli("corpus", page, "--html", page)
    assert done.exit_code != 0 and "never overwrites its inputs" in done.stderr


@pytest.mark.hf
@pytest.mark.slow
def test_minilm_statistics_equal_each_examples_own_heatmap(minilm, tmp_path):
    """The real all-MiniLM-L6-v2: every head's means and query counts over 6 sentences equal
    the sums of heatmap's statistics of each sentence run alone (the model's own forward)."""
    from attnviz.api import corpus, run_model

    texts = LINES[1000:1006]
    path = tmp_path / "c.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    result = corpus(path, model=minilm, resamples=10, device="cpu")
    sums: dict = {}
    for text in texts:
        heatmap = run_model(minilm, [text], device="cpu")
        n = len(heatmap.run.batch.tokens[0])
        for st in heatmap.head_stats:
            queries = dict(st.queries)
            for name in STATISTICS:
                c = n if name in ("entropy", "max_weight", "distance") else queries[name]
                value = getattr(st, name)
                s_c = sums.setdefault((st.layer, st.head, name), [0.0, 0])
                if value is not None:
                    s_c[0] += value * c
                    s_c[1] += c
    assert len(result.summary.heads) == 6 * 12
    for head in result.summary.heads:
        for name in STATISTICS:
            s, c = sums[(head.layer, head.head, name)]
            got = head.statistics[name]
            assert got.queries == c
            if c:
                assert got.mean == pytest.approx(s / c, rel=1e-5, abs=1e-7), name
    # negative control: a head's neighbour's statistic is caught
    s, c = sums[(0, 1, "previous")]
    assert abs(result.summary.heads[0].statistics["previous"].mean - s / c) > 1e-4


@pytest.mark.hf
@pytest.mark.slow
def test_minilm_truncates_with_its_tokenizer_keeping_sep(minilm, tmp_path):
    from attnviz.api import corpus

    path = tmp_path / "c.txt"
    short = [line for line in LINES if len(line.split()) <= 8][:6]
    long = [line for line in LINES if len(line.split()) >= 20][:6]
    path.write_text("\n".join(short + long) + "\n", encoding="utf-8")
    cut = corpus(path, model=minilm, max_tokens=16, resamples=5, device="cpu")
    assert 0 < cut.counts.truncated < 12 and cut.summary.tokens <= 16 * 12
    last = next(h for h in cut.summary.heads if h.statistics["special"].queries)
    assert last.statistics["special"].queries > 0  # [CLS] and [SEP] are still there
    skipped = corpus(path, model=minilm, max_tokens=16, long="skip", resamples=5,
                     device="cpu")
    assert skipped.counts.skipped_long == cut.counts.truncated
