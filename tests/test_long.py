"""Long inputs: maps computed in blocks of query rows equal the full maps (display maps,
statistics, --query row, --export file), for any block size, mask, padding and bias_k."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import SAMPLES, assert_clean_error
from safetensors import safe_open

from attnviz.app import heatmap as heatmap_mod
from attnviz.compute.display import maps, views
from attnviz.compute.forward_pass import streaming
from attnviz.compute.forward_pass.forward import load_weights, per_head_forward
from attnviz.compute.forward_pass.inputs import make_batch
from attnviz.compute.measures.stats import head_stats
from attnviz.core import memory
from attnviz.core.request import RandomSpec

# three sentences of different lengths (padding), with repeated tokens (duplicate, induction)
TEXTS = [" ".join(f"w{i % 7}" for i in range(23)), "a b c a b c d a b",
         " ".join(f"x{i % 5}" for i in range(17))]
STAT_KEYS = ("entropy", "max_weight", "distance", "first", "previous", "self", "duplicate",
             "induction")
CASES = {
    "plain": dict(random=RandomSpec(16, 4)),
    "causal": dict(random=RandomSpec(16, 4), causal=True),
    "bias_k": dict(random=RandomSpec(16, 4, add_bias_kv=True)),
    "bias_k causal": dict(random=RandomSpec(16, 2, add_bias_kv=True), causal=True),
    "gqa": dict(weights=SAMPLES / "llama-gqa-tiny", layer="1"),
}


def _budget_for(rows: int, batch, extra: int) -> int:
    """The memory budget that gives blocks of `rows` query rows."""
    return rows * memory.BLOCK_BUFFERS * 4 * (batch.max_len + extra)


def _runs(case: str, rows: int, **extra_request):
    batch = make_batch(TEXTS)
    request = heatmap_mod.HeatmapRequest.build(**CASES[case], **extra_request)
    full = heatmap_mod.run_on_batch(batch, request)
    layer = full.layers[0]
    assert layer.weights is not None  # small: full maps
    extra = layer.weights.shape[-1] - batch.max_len
    budget = _budget_for(rows, batch, extra)
    assert memory.block_rows(budget, batch.max_len + extra) == rows
    streamed = heatmap_mod.run_on_batch(batch, heatmap_mod.HeatmapRequest.build(
        **CASES[case], memory_budget=budget, **extra_request))
    assert streamed.layers[0].weights is None
    assert f"{rows} row" in streamed.layers[0].method
    return full, streamed


def _mismatch(full, streamed_views, streamed_stats, cells: int) -> tuple[float, float]:
    """(largest display-map difference, largest relative statistics difference) between a
    streamed run's views/statistics and the full maps' downsampled views/statistics."""
    selected = maps.select_maps(full, None, False) + maps.select_maps(full, None, True)
    expected = {(v.sentence, v.head): views.downsample(v, cells, cells) for v in selected}
    assert len(streamed_views) == len(expected)
    worst_map = 0.0
    for view in streamed_views:
        want = expected[(view.sentence, view.head)]
        assert view.values.shape == want.values.shape
        assert view.row_labels == want.row_labels and view.col_labels == want.col_labels
        assert view.downsampled == want.downsampled
        assert view.row_spans == want.row_spans and view.col_spans == want.col_spans
        worst_map = max(worst_map, float(np.abs(view.values - want.values).max()))
    layer = full.layers[0]
    reference = head_stats(layer.weights, full.batch.tokens, layer.index)
    worst_stat = 0.0
    for a, b in zip(reference, streamed_stats, strict=True):
        assert a.head == b.head
        for key in STAT_KEYS:
            x, y = getattr(a, key), getattr(b, key)
            assert (x is None) == (y is None), key
            if x is not None:
                worst_stat = max(worst_stat, abs(x - y) / max(1.0, abs(x)))
    return worst_map, worst_stat


# blocks of 3 and 8 rows divide no sentence length; 23 rows: each sentence in one block. Display
# maps heavily downsampled (4, 6 cells a side, blocks that straddle display rows) or exact (512).
# Tokens seen 3 times or more get the matmul's columns in one of them (the common-token path).
@pytest.mark.parametrize(("rows", "cells", "common"), [(3, 4, 16), (8, 512, 3), (23, 6, 16)])
@pytest.mark.parametrize("case", list(CASES))
def test_block_maps_equal_full_maps(monkeypatch, case, rows, cells, common):
    from attnviz.compute.measures import row_stats

    monkeypatch.setattr(streaming, "DISPLAY_CELLS", cells)
    monkeypatch.setattr(row_stats, "FREQUENT_MIN", common)
    full, streamed = _runs(case, rows)
    layer = streamed.layers[0].streamed
    worst_map, worst_stat = _mismatch(full, layer.views, layer.stats, cells)
    assert worst_map <= 1e-6
    assert worst_stat <= 1e-6


def test_wrong_normalizers_are_caught():
    """Negative control: blocks whose rows were normalized over only the keys up to the block
    (as if each block's softmax saw part of its key range) must fail the same comparison."""
    full, _ = _runs("plain", 5)
    layer = full.layers[0]
    batch = full.batch
    reducer = streaming.MapReducer(0, batch.tokens, extra_keys=0)
    weights = load_weights(layer.layer, full.store)
    for b, tokens in enumerate(batch.tokens):
        n = len(tokens)
        x = layer.inputs[b : b + 1, :n]
        scores = per_head_forward(layer.layer, weights, x, x, x).scores[0]  # (H, n, n)
        for start in range(0, n, 5):
            block = scores[:, start:start + 5]
            stop = max(start + block.shape[1], n // 2)  # too short a key range
            attn = torch.zeros_like(block)
            attn[..., :stop] = torch.softmax(block[..., :stop], -1)
            reducer.add_rows(b, 0, start, attn, block)
    wrong = reducer.finish()
    worst_map, worst_stat = _mismatch(full, wrong.views, wrong.stats, 512)
    assert worst_map > 1e-3 and worst_stat > 1e-3


@pytest.mark.parametrize("with_scores", [False, True])
def test_add_rows_takes_blocks_from_any_producer(monkeypatch, with_scores):
    """Blocks of arbitrary sizes, handed in any order of sentences, equal `add` of the whole
    maps and the full maps' own views."""
    monkeypatch.setattr(streaming, "DISPLAY_CELLS", 6)
    full, _ = _runs("bias_k", 4)
    layer = full.layers[0]
    batch = full.batch
    weights = load_weights(layer.layer, full.store)
    whole = streaming.MapReducer(0, batch.tokens)
    blocks = streaming.MapReducer(0, batch.tokens, extra_keys=1)
    sizes = [3, 1, 7, 2, 11]
    for b in (2, 0, 1):
        n = len(batch.tokens[b])
        x = layer.inputs[b : b + 1, :n]
        parts = per_head_forward(layer.layer, weights, x, x, x)
        attn, scores = parts.attn[0], parts.scores[0] if with_scores else None
        whole.add(b, 0, attn, scores)
        start, i = 0, 0
        while start < n:
            stop = min(n, start + sizes[i % len(sizes)])
            blocks.add_rows(b, 0, start, attn[:, start:stop],
                            None if scores is None else scores[:, start:stop])
            start, i = stop, i + 1
    for reducer in (whole, blocks):
        done = reducer.finish()
        worst_map, worst_stat = _mismatch(full, done.views, done.stats, 6)
        assert worst_map <= 1e-6 and worst_stat <= 1e-6


def _causal_maps(heads: int, n: int, seed: int = 0) -> torch.Tensor:
    """Softmax rows over each query's own and earlier keys: (heads, n, n), 0 after the query."""
    scores = torch.randn(heads, n, n, generator=torch.Generator().manual_seed(seed))
    return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf).softmax(-1)


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_reducer_measures_weight_after_each_query(rows):
    """row_terms' `later` term is each row's weight on keys after its query, beside the block
    and right of it (blocks cut to the keys they see, or given every key); MapReducer says a
    causal map sees no later key, and one tiny weight above the diagonal (the control) is
    seen."""
    from attnviz.compute.measures.row_stats import ROW_TERMS, row_terms, sentence_patterns

    tokens = [f"t{i % 4}" for i in range(9)]
    maps = _causal_maps(3, 9)
    leaky = maps.clone()
    leaky[1, 5, 7] = 1e-30
    patterns = sentence_patterns(tuple(tokens))
    for attn, expected in ((maps, False), (leaky, True)):
        narrow = streaming.MapReducer(0, [tokens], extra_keys=0, views=False)
        wide = streaming.MapReducer(0, [tokens], extra_keys=0, views=False)
        for start in range(0, 9, rows):
            stop = min(9, start + rows)
            block = attn[:, start:stop]
            later = row_terms(block, start, 9, patterns)[ROW_TERMS.index("later")]
            own = torch.ones(stop - start, 9, dtype=torch.bool).triu(start + 1)
            torch.testing.assert_close(later, (block * own).sum(-1), rtol=0, atol=0)
            wide.add_rows(0, 0, start, block)
            keys = stop if not expected else 9  # the leaky row's key 7 must stay in its block
            narrow.add_rows(0, 0, start, block[..., :keys])
        assert narrow.sees_later_keys is expected and wide.sees_later_keys is expected


def test_xlogx_rows_equals_xlogy():
    """The entropy's Σ a ln a per row equals torch.special.xlogy's on weights with exact zeros
    and subnormals, to float32 rounding (float64 reference); a negative weight gives NaN. The
    control: the logarithm of max(a, 1e-3) is caught by the same tolerance."""
    from attnviz.compute.measures.stats import xlogx_rows

    maps = _causal_maps(4, 50, seed=1)
    maps[0, 10, :3] = torch.tensor([1e-40, 1e-44, 0.0])  # subnormal weights, then an exact 0
    reference = torch.special.xlogy(maps.double(), maps.double()).sum(-1)
    ours = xlogx_rows(maps)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-6, atol=1e-6)
    wrong = maps.clamp_min(1e-3).log().mul(maps).sum(-1)
    assert float((wrong.double() - reference).abs().max()) > 1e-6
    for half in (torch.float16, torch.bfloat16):  # computed in float32, not at half's tiny
        rounded = maps.to(half)
        exact = torch.special.xlogy(rounded.double(), rounded.double()).sum(-1)
        torch.testing.assert_close(xlogx_rows(rounded).double(), exact, rtol=1e-6, atol=1e-6)
    signed = maps.clone()
    signed[2, 30, 0] = -0.01
    out = xlogx_rows(signed)
    assert bool(out[2, 30].isnan()) and int(out.isnan().sum()) == 1


def test_add_rows_refuses_blocks_that_do_not_fit():
    reducer = streaming.MapReducer(0, [["a", "b", "c"]], extra_keys=0)
    with pytest.raises(ValueError, match="does not fit"):
        reducer.add_rows(0, 0, 2, torch.full((1, 2, 3), 1 / 3))  # rows 2:4 of 3
    with pytest.raises(ValueError, match="does not fit"):
        reducer.add_rows(0, 0, 0, torch.full((1, 2, 1), 1.0))  # row 1 needs keys 0..1


@pytest.mark.parametrize("case", ["plain", "bias_k causal"])
def test_query_row_of_a_block_run_equals_the_full_maps(case):
    full, streamed = _runs(case, 4, query="13")
    expected = full.layers[0].weights[0, :, 13]  # (H, S) with padding columns
    keys = list(range(len(full.batch.tokens[0]))) + \
        list(range(full.batch.max_len, expected.shape[-1]))
    got = streamed.layers[0].streamed.query_weights
    torch.testing.assert_close(got, expected[:, keys], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["plain", "bias_k causal", "gqa"])
def test_streamed_export_equals_the_in_memory_export(cli, tmp_path, case):
    """--export of a long input is written block by block while the maps stream, header first;
    the file loads with safetensors and equals the export of the full maps (padded queries and
    keys, the causal mask and the bias_k column included)."""
    args = {"plain": ["--random", "--spec", "E=16", "-H", "4"],
            "bias_k causal": ["--weights", tmp_path / "bias_kv.safetensors", "-H", "2",
                              "--causal"],
            "gqa": ["--weights", SAMPLES / "llama-gqa-tiny", "--layer", "1"]}[case]
    if case == "bias_k causal":
        from safetensors.torch import save_file

        torch.manual_seed(0)
        mha = torch.nn.MultiheadAttention(16, 2, add_bias_kv=True, batch_first=True)
        save_file(mha.state_dict(), str(tmp_path / "bias_kv.safetensors"))
    common = ["heatmap", *args, *TEXTS, "--no-maps", "--no-stats"]
    full_path, block_path = tmp_path / "full.safetensors", tmp_path / "blocks.safetensors"
    result = cli(*common, "--export", full_path)
    assert result.exit_code == 0, result.output
    result = cli(*common, "--export", block_path, "--budget", "memory=1KB")
    assert result.exit_code != 0  # below the minimum budget
    batch = make_batch(TEXTS)
    monkeypatch_budget = pytest.MonkeyPatch()
    monkeypatch_budget.setattr(memory, "MAP_BUDGET_BYTES", _budget_for(5, batch, 1))
    try:
        result = cli(*common, "--export", block_path)
    finally:
        monkeypatch_budget.undo()
    assert result.exit_code == 0, result.output
    assert "--export wrote every full map block by block" in result.stdout.replace("\n", " ")
    raw = block_path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    layer = args[args.index("--layer") + 1] if "--layer" in args else "0"  # keys carry it
    maps_key = f"attn.{layer}"
    assert header[maps_key]["data_offsets"][1] == len(raw) - 8 - int.from_bytes(raw[:8],
                                                                                "little")
    with safe_open(str(full_path), "pt") as a, safe_open(str(block_path), "pt") as b:
        assert a.metadata() == b.metadata()
        assert sorted(a.keys()) == sorted(b.keys()) == [maps_key, f"inputs.{layer}", "mask"]
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and x.shape == y.shape, key
            torch.testing.assert_close(y, x, atol=1e-6, rtol=0)


def test_a_failed_streamed_export_leaves_no_file(cli, tmp_path, monkeypatch):
    """NaN weights are found while streaming: no export file, not even a partial one."""
    from safetensors.torch import save_file

    state = torch.nn.MultiheadAttention(16, 2, batch_first=True).state_dict()
    state["in_proj_weight"][3, 0] = float("nan")
    save_file(state, str(tmp_path / "nan.safetensors"))
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    out = tmp_path / "maps.safetensors"
    result = cli("heatmap", "--weights", tmp_path / "nan.safetensors", "-H", "2", *TEXTS,
                 "--export", out)
    assert_clean_error(result, 1, "non-finite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.safetensors"]


@pytest.mark.parametrize(("text", "expected"), [("512MB", 512 * 2**20), ("2GB", 2 * 2**30),
                                                ("1.5g", 3 * 2**29), ("3000000", 3000000),
                                                (" 64 MiB ", 64 * 2**20)])
def test_memory_budget_sizes(text, expected):
    from attnviz.app.heatmap_sources import parse_memory_budget

    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "-5MB", "1KB", "0"])
def test_memory_budget_refuses_bad_sizes(cli, text):
    result = cli("heatmap", "a b", "--random", "--budget", f"memory={text}")
    assert_clean_error(result, 2, "--budget memory")


def test_memory_budget_decides_between_full_and_block_maps(cli):
    words = " ".join(f"w{i % 31}" for i in range(300))  # 8 heads: 2.9 MB of full maps
    args = ["heatmap", "--random", words, "--json", "--budget", "tokens=400"]
    small = json.loads(cli(*args, "--budget", "memory=1MB").stdout)
    large = json.loads(cli(*args, "--budget", "memory=64MB").stdout)
    assert small["layers"][0]["method"].startswith("explicit per head, streamed")
    assert not large["layers"][0]["method"].startswith("explicit per head, streamed")
    for a, b in zip(large["head_stats"], small["head_stats"], strict=True):
        for key in STAT_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert "memory (for attention maps" in " ".join(cli("heatmap", "--help").stdout.split())


def test_copies_by_matmul_columns_dense_masks_and_gathered_pairs_agree(monkeypatch):
    """Earlier copies left of a block are summed by the block's matmul for common tokens,
    gathered pair by pair for the others, or masked densely when those pairs are many: all
    three give the full maps' statistics."""
    from attnviz.compute.measures import row_stats

    text = " ".join(["x"] * 20 + [f"w{i % 3}" for i in range(30)] + [f"v{i % 9}" for i in
                                                                     range(40)])
    batch = make_batch([text])
    request = dict(random=RandomSpec(16, 2), causal=True)
    build = heatmap_mod.HeatmapRequest.build
    full = heatmap_mod.run_on_batch(batch, build(**request)).layers[0]
    reference = head_stats(full.weights, batch.tokens, 0)
    budget = _budget_for(8, batch, 0)
    for common, dense in ((16, 16), (2, 16), (16, 0), (16, 10**9), (2, 0)):
        monkeypatch.setattr(row_stats, "FREQUENT_MIN", common)
        monkeypatch.setattr(row_stats, "DENSE_PAIRS", dense)
        got = heatmap_mod.run_on_batch(batch, build(**request, memory_budget=budget)).layers[0]
        for a, b in zip(reference, got.streamed.stats, strict=True):
            for key in STAT_KEYS:
                assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-6), \
                    (common, dense, key)


@pytest.mark.slow
def test_4096_tokens_block_maps_equal_full_maps():
    """The real scale of the 4k benchmark, 4 heads: display maps (512 × 512 of 4096 tokens)
    from 256-row blocks equal the full maps'; statistics equal a float64 computation from the
    full maps (closer than head_stats' own float32 sums of 16M products per head, ~3e-5 apart
    in distance, more under other thread counts)."""
    from attnviz.compute.measures.stats import pattern_pairs

    words = " ".join(f"w{(i * 7919) % 1009}" for i in range(4096))
    batch = make_batch([words], max_tokens=5000)
    request = dict(random=RandomSpec(64, 4))
    full = heatmap_mod.run_on_batch(batch, heatmap_mod.HeatmapRequest.build(
        **request, memory_budget=2**30, keep_full_maps=True))
    streamed = heatmap_mod.run_on_batch(batch, heatmap_mod.HeatmapRequest.build(
        **request, memory_budget=_budget_for(256, batch, 0)))
    layer = streamed.layers[0].streamed
    worst_map, worst_stat = _mismatch(full, layer.views, layer.stats, 512)
    assert worst_map <= 1e-6 and worst_stat <= 1e-3
    pos = torch.arange(4096, dtype=torch.float64)
    pairs = pattern_pairs(tuple(batch.tokens[0]))
    for h, got in enumerate(layer.stats):
        a = full.layers[0].weights[0, h].double()
        expected = {"entropy": -torch.special.xlogy(a, a).sum(-1).mean(),
                    "max_weight": a.max(-1).values.mean(),
                    "distance": (a * (pos[:, None] - pos).abs()).sum(-1).mean()}
        for name in ("first", "previous", "self", "duplicate", "induction"):
            queries, keys = pairs[name]
            mass = torch.zeros(4096, dtype=torch.float64).index_add_(0, queries,
                                                                     a[queries, keys])
            expected[name] = mass[torch.unique(queries)].mean()
        for name, value in expected.items():
            assert getattr(got, name) == pytest.approx(float(value), rel=1e-5), (h, name)
