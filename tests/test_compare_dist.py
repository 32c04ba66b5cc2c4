"""attnviz compare under torchrun: two gloo ranks on this machine give the one-process paired
differences (counts exactly, values and intervals within 1e-6); a negative control shows the
comparison catches one rank's share alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.hf]
SENTENCES = ["the cat sat on the mat", "a small dog ran far away",
             "the big red barn in the cold night", "the cat ran far away from the dog",
             "a cat sat on the big red mat", "the small dog sat in the barn",
             "the night was cold and the cat slept", "a dog sat", "the red mat"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run(args: list[object], ranks: int = 1) -> dict:
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc-per-node",
                                      str(ranks), "--master-addr", "127.0.0.1",
                                      "--master-port", str(free_port())]
    done = subprocess.run([sys.executable, *launcher, "-m", "attnviz", "compare",
                           *map(str, args), "--json"], capture_output=True, text=True,
                          env=env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)  # rank 0 alone writes


def assert_equal_runs(a: dict, b: dict) -> None:
    assert a["corpus"]["examples"] == b["corpus"]["examples"]
    for x, y in zip(a["corpus"]["heads"], b["corpus"]["heads"], strict=True):
        for key, value in x.items():
            if isinstance(value, float):
                assert value == pytest.approx(y[key], rel=1e-6, abs=1e-12), key
            else:
                assert value == y[key], key


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    pytest.importorskip("transformers")
    import zoo

    folder = tmp_path_factory.mktemp("dist_pair")

    def sharpen(model):
        model.model.layers[1].self_attn.q_proj.weight[16:24] *= 3.0

    corpus = folder / "c.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    return (zoo.build_lm("llama", folder / "a"), zoo.build_lm("llama", folder / "b", edit=sharpen),
            corpus)


def test_two_gloo_ranks_equal_one_process(pair, tmp_path):
    a, b, corpus = pair
    args = [corpus, "-m", a, "-a", b]
    both, alone = run(args, ranks=2), run(args)
    assert both["corpus"]["world_size"] == 2 and alone["corpus"]["world_size"] == 1
    assert both["corpus"]["counts"]["used"] == len(SENTENCES)
    assert_equal_runs(both, alone)
    # negative control: rank 0's share alone (the even ordinals) is caught
    even = tmp_path / "even.txt"
    even.write_text("\n".join(SENTENCES[0::2]) + "\n")
    with pytest.raises(AssertionError):
        assert_equal_runs(run([even, "-m", a, "-a", b]), alone)
