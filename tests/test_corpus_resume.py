"""attnviz corpus, reading and resuming: text, JSON lines and standard input streamed; --long,
--limit, --sample; an interrupted run (by --limit, or killed mid-run by a test hook) resumed
gives the uninterrupted run's numbers; a changed model, corpus or option refuses to resume,
naming what changed."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from attnviz.app.corpus import CorpusRequest, run_corpus
from attnviz.app.corpus_engines import BundledEngine, files_identity
from attnviz.app.corpus_input import read_texts, reservoir
from attnviz.core.choices import LongExamples
from attnviz.core.words import split_words
from attnviz.errors import AttnvizError, UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
ENGLISH = ROOT / "sample_weights" / "english.txt"
LINES = ENGLISH.read_text(encoding="utf-8").splitlines()


def write(tmp_path: Path, texts: list[str], name: str = "c.txt") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def assert_same(a, b, rel: float = 1e-9) -> None:
    for name, tensor in a.sums.tensors().items():
        assert np.allclose(tensor.numpy(), b.sums.tensors()[name].numpy(), rtol=rel,
                           atol=1e-12), name
    assert a.sums.queries.equal(b.sums.queries)
    assert a.counts.used == b.counts.used and a.counts.read == b.counts.read
    assert [h.type for h in a.summary.heads] == [h.type for h in b.summary.heads]


def test_limit_then_resume_equals_one_uninterrupted_run(tmp_path):
    path = write(tmp_path, LINES[:60])
    state = tmp_path / "run.state"
    base = CorpusRequest(path, resamples=30, lookahead=16, save_every=1, state=state)
    first = run_corpus(replace(base, limit=25))
    assert first.summary.examples == 25
    resumed = run_corpus(replace(base, resume=True))
    assert resumed.resumed_from == 25 and resumed.summary.examples == 60
    whole = run_corpus(replace(base, state=None, save_every=None))
    assert_same(resumed, whole)
    # negative control: a run of the last 35 alone (what a resume that lost the state gives)
    tail = run_corpus(CorpusRequest(write(tmp_path, LINES[25:60], "tail.txt"), resamples=30))
    with pytest.raises(AssertionError):
        assert_same(tail, whole)


def test_a_run_killed_mid_way_resumes_to_the_same_numbers(tmp_path):
    """The test hook: the progress callback interrupts the run after its 5th batch (the
    state holds the windows done before), as a crash would."""
    path = write(tmp_path, LINES[200:264])
    state = tmp_path / "run.state"
    request = CorpusRequest(path, resamples=30, lookahead=8, save_every=1, state=state)
    seen = []

    def crash(progress):
        seen.append(progress.batches)
        if progress.batches == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_corpus(request, crash)
    resumed = run_corpus(replace(request, resume=True))
    assert 0 < resumed.resumed_from < 64
    assert_same(resumed, run_corpus(replace(request, state=None, save_every=None)))
    # the state file is data: safetensors, no pickle
    assert state.read_bytes()[8:9] == b"{"


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": 64}, "max_tokens"),
    ({"long": LongExamples.SKIP}, "long"),
    ({"seed": 3}, "seed"),
    ({"resamples": 31}, "resamples"),
])
def test_a_changed_option_refuses_to_resume_naming_it(tmp_path, change, named):
    path = write(tmp_path, LINES[:20])
    request = CorpusRequest(path, resamples=30, limit=10, state=tmp_path / "s")
    run_corpus(request)
    with pytest.raises(UsageError) as caught:
        run_corpus(replace(request, resume=True, limit=None, **change))
    assert f"\u2039{named}\u203a" in caught.value.what and "changed" in caught.value.what
    # negative control: the same options resume
    assert run_corpus(replace(request, resume=True, limit=None)).summary.examples == 20


def test_a_changed_corpus_or_model_refuses_to_resume(tmp_path, monkeypatch):
    path = write(tmp_path, LINES[:20])
    request = CorpusRequest(path, resamples=30, limit=10, state=tmp_path / "s")
    run_corpus(request)
    with path.open("a", encoding="utf-8") as f:
        f.write("One more sentence was added to the corpus after the run.\n")
    with pytest.raises(UsageError, match="corpus's size"):
        run_corpus(replace(request, resume=True))
    path.write_text("\n".join(LINES[:20]) + "\n", encoding="utf-8")
    run_corpus(request)
    identity = BundledEngine.identity
    monkeypatch.setattr(BundledEngine, "identity",
                        lambda self: {**identity(self), "files": "another"})
    with pytest.raises(UsageError, match="the model"):
        run_corpus(replace(request, resume=True))


def test_the_model_identity_reads_file_headers_and_sizes(tmp_path):
    a = tmp_path / "model.safetensors"
    a.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}  " + bytes(100))
    before = files_identity([a])
    a.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":2}  " + bytes(100))
    assert files_identity([a]) != before
    a.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}  " + bytes(100))
    assert files_identity([a]) == before


def test_a_stream_whose_prefix_changed_refuses_to_resume(cli, tmp_path):
    state = tmp_path / "s"
    text = "\n".join(LINES[:20]) + "\n"
    done = cli("corpus", "-", "--limit", "10", "--state", state, "--json", input=text)
    assert done.exit_code == 0, done.output
    same = cli("corpus", "-", "--state", state, "--resume", "--json", input=text)
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["examples"] == 20
    changed = "\n".join(["A different first line."] + LINES[1:20]) + "\n"
    refused = cli("corpus", "-", "--state", state, "--resume", input=changed)
    assert refused.exit_code == 2
    assert "first" in refused.output and "differ" in refused.output


def test_resume_needs_a_state_file(tmp_path):
    path = write(tmp_path, LINES[:5])
    with pytest.raises(UsageError, match="state"):
        run_corpus(CorpusRequest(path, resume=True))
    with pytest.raises(UsageError, match="no state file"):
        run_corpus(CorpusRequest(path, resume=True, state=tmp_path / "missing"))


def test_json_lines_with_a_field_read_the_same_examples(tmp_path):
    texts = LINES[300:320]
    plain = run_corpus(CorpusRequest(write(tmp_path, texts), resamples=10))
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                             for i, t in enumerate(texts)), encoding="utf-8")
    as_json = run_corpus(CorpusRequest(jsonl, field="text", resamples=10))
    assert_same(as_json, plain)
    with pytest.raises(AttnvizError, match="line 1 of the corpus has no string field 'body'"):
        run_corpus(CorpusRequest(jsonl, field="body"))


def test_long_examples_are_truncated_or_skipped_and_counted(tmp_path):
    texts = LINES[:40]
    long_ones = sum(len(split_words(t)) > 10 for t in texts)
    assert 0 < long_ones < 40
    path = write(tmp_path, texts + ["", "   "])  # blank lines are no examples
    cut = run_corpus(CorpusRequest(path, max_tokens=10, resamples=10))
    assert (cut.counts.truncated, cut.counts.used) == (long_ones, 40)
    assert cut.summary.tokens == sum(min(10, len(split_words(t))) for t in texts)
    skipped = run_corpus(CorpusRequest(path, max_tokens=10, long=LongExamples.SKIP,
                                       resamples=10))
    assert (skipped.counts.skipped_long, skipped.counts.used) == (long_ones, 40 - long_ones)
    assert any(str(long_ones) in note for note in skipped.notes)


def test_sample_is_a_seeded_uniform_reservoir_in_stream_order(tmp_path):
    path = write(tmp_path, LINES[:500])
    drawn = reservoir(read_texts(path), 50, 7)
    assert len(drawn) == 50 and len(set(drawn)) == 50
    assert [LINES.index(t) for t in drawn] == sorted(LINES.index(t) for t in drawn)
    assert drawn == reservoir(read_texts(path), 50, 7)
    assert drawn != reservoir(read_texts(path), 50, 8)
    # uniform: each of 10 items is kept by a 3-of-10 reservoir about 30 % of the time
    kept = [0] * 10
    for seed in range(3000):
        for item in reservoir([str(i) for i in range(10)], 3, seed):
            kept[int(item)] += 1
    assert all(abs(k / 3000 - 0.3) < 0.04 for k in kept)
    result = run_corpus(CorpusRequest(path, sample=50, seed=7, resamples=10))
    direct = run_corpus(CorpusRequest(write(tmp_path, drawn, "drawn.txt"), resamples=10,
                                      seed=7))
    assert_same(result, direct)


def test_a_huge_line_is_cut_and_never_read_whole(tmp_path):
    path = tmp_path / "big.txt"
    with path.open("w", encoding="utf-8") as f:
        f.write("Short first line here.\n")
        f.write("word " * 500_000 + "\n")  # 2.5 MB on one line
        f.write("Short last line here.\n")
    assert [len(t) for t in read_texts(path)][0::2] == [22, 21]
    result = run_corpus(CorpusRequest(path, max_tokens=16, resamples=5))
    assert (result.counts.used, result.counts.truncated) == (3, 1)


def test_bad_input_is_refused(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\xff\xfe not utf-8\n")
    with pytest.raises(AttnvizError, match="line 2 of the corpus is not UTF-8"):
        run_corpus(CorpusRequest(bad))
    with pytest.raises(UsageError, match="folder"):
        run_corpus(CorpusRequest(tmp_path))
    empty = write(tmp_path, ["", " "], "empty.txt")
    with pytest.raises(UsageError, match="no example"):
        run_corpus(CorpusRequest(empty))
    with pytest.raises(UsageError, match="positive"):
        run_corpus(CorpusRequest(empty, limit=0))


def test_the_reservoir_leaves_the_global_generator_alone():
    state = random.getstate()
    reservoir(["a", "b", "c"], 1, 0)
    assert random.getstate() == state
