"""The bundled model's heads do what the README says, on spans of several lengths."""

from __future__ import annotations

import random

import pytest
import torch

from attnviz.compute.forward_pass.inputs import make_batch
from attnviz.compute.measures.stats import head_stats
from attnviz.sources.bundled import open_bundled, run_tiny

INDUCTION_THRESHOLD = 0.6


@pytest.mark.parametrize("span", [4, 7, 11, 16])
def test_layer1_has_an_induction_head_at_every_span_length(span):
    rng = random.Random(span)
    words = [f"w{rng.randrange(10**6)}" for _ in range(span)]
    prefix = [f"p{rng.randrange(10**6)}" for _ in range(5)]
    batch = make_batch([" ".join(prefix + words + words)])
    run = run_tiny(open_bundled(), batch, None, torch.device("cpu"))
    stats = head_stats(run.layer(1).weights, batch.tokens, 1)
    assert max(s.induction for s in stats) >= INDUCTION_THRESHOLD
    layer0 = head_stats(run.layer(0).weights, batch.tokens, 0)
    assert max(s.previous for s in layer0) >= 0.7


def test_main_job_labels_heads(cli):
    result = cli("heatmap", "the cat sat on the mat the cat sat on the mat", "--json")
    assert result.exit_code == 0, result.output
    import json

    labels = {(s["layer"], s["label"]) for s in json.loads(result.stdout)["head_stats"]}
    assert (1, "induction") in labels and (0, "previous-token") in labels
