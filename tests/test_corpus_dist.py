"""attnviz corpus under torchrun: two gloo ranks on this machine (each through the CLI's
supervised child) give the one-process numbers — counts exactly, means and intervals within
1e-6 — including a rank that sees no example and a two-rank run resumed from its per-rank
state files; a negative control shows the comparison catches one rank's share alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow
ENGLISH = ROOT / "sample_weights" / "english.txt"
LINES = ENGLISH.read_text(encoding="utf-8").splitlines()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def one_process(*args: object) -> dict:
    done = subprocess.run([sys.executable, "-m", "attnviz", "corpus", *map(str, args), "--json"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def two_ranks(*args: object) -> dict:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "attnviz", "corpus", *map(str, args), "--json"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)  # rank 0 alone writes


def assert_equal_runs(a: dict, b: dict) -> None:
    assert a["examples"] == b["examples"] and a["tokens"] == b["tokens"]
    for key in ("used", "truncated", "skipped_long", "skipped_empty", "read"):
        assert a["counts"][key] == b["counts"][key], key
    for x, y in zip(a["heads"], b["heads"], strict=True):
        assert (x["layer"], x["head"], x["type"]) == (y["layer"], y["head"], y["type"])
        assert x["stability"] == y["stability"] and x["settled_at"] == y["settled_at"]
        for name, s in x["statistics"].items():
            t = y["statistics"][name]
            assert (s["queries"], s["examples"]) == (t["queries"], t["examples"]), name
            for field in ("mean", "low", "high"):
                if s[field] is None:
                    assert t[field] is None
                else:
                    assert s[field] == pytest.approx(t[field], rel=1e-6, abs=1e-12), name
    assert a["settle_curve"] == b["settle_curve"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dist") / "c.txt"
    path.write_text("\n".join(LINES[:61]) + "\n", encoding="utf-8")
    return path


def test_two_gloo_ranks_equal_one_process(corpus, tmp_path):
    both = two_ranks(corpus, "--resamples", "40", "--max-tokens", "24")
    assert both["world_size"] == 2
    alone = one_process(corpus, "--resamples", "40", "--max-tokens", "24")
    assert alone["world_size"] == 1
    assert_equal_runs(both, alone)
    # negative control: rank 0's share alone (even ordinals) is caught by the comparison
    even = tmp_path / "even.txt"
    even.write_text("\n".join(LINES[:61][0::2]) + "\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        assert_equal_runs(one_process(even, "--resamples", "40", "--max-tokens", "24"), alone)


def test_a_rank_without_examples_still_takes_part(corpus):
    assert_equal_runs(two_ranks(corpus, "--limit", "1", "--resamples", "10"),
                      one_process(corpus, "--limit", "1", "--resamples", "10"))


def test_two_ranks_resume_from_their_own_state_files(corpus, tmp_path):
    state = tmp_path / "s"
    two_ranks(corpus, "--limit", "20", "--state", state, "--resamples", "10")
    assert (tmp_path / "s.rank0").is_file() and (tmp_path / "s.rank1").is_file()
    resumed = two_ranks(corpus, "--state", state, "--resume", "--resamples", "10")
    assert resumed["resumed_from"] == 20
    assert_equal_runs(resumed, one_process(corpus, "--resamples", "10"))
