"""No header, metadata or config value sizes the work: values claiming gigabytes run under a
1.6 GB address-space cap, counts must be plain integers, divisors and head counts cost what
the data holds, not what a header says.

The contract every case asserts is in tests/hostile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hostile import (
    Result,
    assert_error,
    assert_printed_clean,
    bundled_with,
    digest,
    one_thread,  # noqa: F401 - autouse: torch on one thread
    write_named,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from attnviz.core import memory

# ------------------------------------------------------------------------------------------
# 3. No header, metadata or config value sizes the work

HEADER_SIZE_CASES = {
    "config-n_layer": "config.json field 'n_layer' is 100000, but the weights number at most 2 "
                      "layers",
    "config-n_positions": "config.json describes 'wpe.weight' as (100000000, 32), but the "
                          "weights hold (64, 32)",
    "config-vocab_size": "config.json describes 'wte.weight' as (100000000, 32)",
    "config-n_embd": "config.json describes 'wte.weight' as ({vocab}, 100000)",  # zoo.VOCAB
    "zero-inspect": "zero-sized dimension", "zero-split": "zero-sized dimension",
    "zero-heatmap": "zero-sized dimension",
    "layers": "num_layers is 100000000, but the file holds 2 attention layers",
    "vocab": "vocab_size is 4000000000, but the file holds that many embedding rows",
    "stride-inspect": "views only 4 bytes of data (strides (0, 0)",
    "stride-split": "views only 4 bytes", "overlap": "views only 1200000 bytes",
}


@pytest.mark.slow  # `capped` runs every case in one capped interpreter: seconds
@pytest.mark.parametrize("name", sorted(HEADER_SIZE_CASES))
def test_work_sized_by_headers_stays_under_a_memory_cap(capped, name):
    from zoo import VOCAB

    folder, results, before = capped
    assert_error(Result(results[name]), 1, HEADER_SIZE_CASES[name].format(vocab=VOCAB))
    assert digest(folder) == before


@pytest.mark.parametrize("value", ["1e8", "²", "١٢", "9" * 5000, "-2", "0x10"])
def test_metadata_counts_must_be_plain_integers(cli, tmp_path, value):
    path = bundled_with(tmp_path / "m.safetensors", num_layers=value)
    assert_error(cli("heatmap", "--weights", path, "a b"), 1, "num_layers",
                 "expected a positive integer")


PICKLE_CASES = [
    ("meta", lambda: torch.empty(8, 8, device="meta"), "meta tensor: it has a shape but no data"),
    ("sparse", lambda: torch.eye(8).to_sparse(), "sparse_coo tensor, not a dense one"),
    ("csr", lambda: torch.eye(8).to_sparse_csr(), "sparse_csr tensor, not a dense one"),
]


@pytest.mark.parametrize("case", PICKLE_CASES, ids=[c[0] for c in PICKLE_CASES])
def test_pickled_tensors_without_dense_data(cli, tmp_path, case):
    import warnings

    path = tmp_path / f"{case[0]}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"in_proj_weight": case[1](), "out_proj.weight": torch.zeros(8, 8)}, path)
    before = digest(tmp_path)
    for args in (["inspect", path], ["split", "--weights", path, "-H", "2"]):
        assert_error(cli(*args), 1, "'in_proj_weight'", case[2])
    assert digest(tmp_path) == before


def test_divisors_are_found_in_square_root_time():
    import time

    from attnviz.core.layer import divisor_choices, divisors

    start = time.perf_counter()
    prime = 999_999_999_989  # the worst case below the bound: 10⁶ trial divisions
    assert divisors(prime) == [1, prime]
    assert time.perf_counter() - start < 5
    assert divisors(10**13) == []  # beyond the search bound: not listed at all
    assert divisors(360)[:6] == [1, 2, 3, 4, 5, 6] and len(divisors(360)) == 24
    assert divisor_choices(360) == ("1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 15, 18, 20, 24, 30, …, 360 "
                                    "(24 divisors)")
    assert divisor_choices(10**13) == f"the divisors of {10**13}"


def test_a_large_prime_row_count_is_fast(cli, tmp_path):
    path = tmp_path / "prime.safetensors"
    rows = 1_000_003  # prime: nothing divides it, and listing divisors must not loop a million
    write_named(path, {"q_proj.weight": torch.zeros(rows, 1),
                       "k_proj.weight": torch.zeros(rows, 1),
                       "v_proj.weight": torch.zeros(rows, 1),
                       "o_proj.weight": torch.zeros(1, rows)})
    assert_error(cli("inspect", path, "-H", "7"), 2, "not divisible by 7 heads",
                 f"choose the number of heads from 1, {rows}")


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.integers(0, 6), min_size=1, max_size=8),
       picks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=5))
def test_composed_row_ranges_equal_the_naive_mapping(blocks, picks):
    from attnviz.core.tensor_ref import _compose_ranges, merge_ranges

    base, start = [], 0
    for size in blocks:
        base.append((start * 3, start * 3 + size))  # gaps between blocks
        start += size + 1
    rows = [r for a, b in base for r in range(a, b)]  # row i of the concatenation → absolute
    ranges = tuple((a, a + n) for a, n in picks)
    expected = merge_ranges(tuple((r, r + 1) for a, b in ranges for r in rows[a:b]))
    assert _compose_ranges(tuple(base), ranges) == expected


def many_heads_file(folder: Path, heads: int) -> Path:
    """A LLaMA-style layer with `heads` heads of d = 1 over E = 4: a 2.5 MB file at 40,000."""
    folder.mkdir()
    torch.manual_seed(0)
    prefix = "model.layers.0.self_attn."
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save({prefix + "q_proj.weight": torch.randn(heads, 4),
          prefix + "k_proj.weight": torch.randn(heads, 4),
          prefix + "v_proj.weight": torch.randn(heads, 4),
          prefix + "o_proj.weight": torch.randn(4, heads)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "head_dim": 1,
                                                    "num_attention_heads": heads}))
    return folder


@pytest.mark.slow
def test_forty_thousand_heads_cost_linear_time(cli, tmp_path):
    """No O(H²) step: slicing 40,000 heads and their per-head norms take seconds."""
    import time

    from attnviz.compute.splitting.split import split_projections
    from attnviz.core.request import SourceSpec
    from attnviz.recognize import find_layers
    from attnviz.sources.registry import open_source

    folder = many_heads_file(tmp_path / "many", 40_000)
    layer = open_source(SourceSpec(weights=folder)).layers[0]
    start = time.perf_counter()
    projections = split_projections(layer)
    assert len(projections["k"].heads) == 40_000
    assert time.perf_counter() - start < 10
    start = time.perf_counter()
    result = cli("inspect", folder, "--layer", "0")
    assert time.perf_counter() - start < 30
    assert_printed_clean(result)
    assert "… 39936 more heads not shown (--json lists all)" in result.stdout
    assert len(result.stdout.splitlines()) < 120  # O(shown), not O(heads)
    assert find_layers  # imported for the inventory above


@pytest.mark.slow
def test_many_heads_print_a_bounded_terminal(cli, tmp_path):
    folder = many_heads_file(tmp_path / "many", 4000)
    for args in (["split", "--weights", folder], ["heatmap", "--weights", folder, "a b c"]):
        result = cli(*args)
        assert_printed_clean(result)
        assert len(result.stdout.splitlines()) < 700, args
        assert "more heads not shown" in result.stdout or "more rows not shown" in result.stdout
    heatmap = cli("heatmap", "--weights", folder, "a b c", "--json")
    assert len(json.loads(heatmap.stdout)["head_stats"]) == 4000  # --json keeps every head


def test_per_stage_head_counts_do_not_break_inspect(cli, tmp_path):
    """Swin's config gives one head count per stage: T5's finder must not claim `num_heads`,
    and each stage's layers take their own count."""
    folder = tmp_path / "swin"
    folder.mkdir()
    tensors = {}
    for stage, width in ((0, 8), (1, 16)):
        block = f"swin.encoder.layers.{stage}.blocks.0.attention."
        for name in ("query", "key", "value"):
            tensors[f"{block}self.{name}.weight"] = torch.zeros(width, width)
        tensors[f"{block}output.dense.weight"] = torch.zeros(width, width)
    save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save(tensors, folder / "model.safetensors")
    # a config that describes these weights: stage widths embed_dim · 2^stage = 8, 16
    (folder / "config.json").write_text(json.dumps({"model_type": "swin", "embed_dim": 8,
                                                    "num_heads": [2, 4], "depths": [1, 1]}))
    result = cli("inspect", folder, "--json")
    assert_printed_clean(result)
    assert [layer["num_heads"] for layer in json.loads(result.stdout)["layers"]] == [2, 4]


def test_streamed_runs_keep_display_maps_of_the_first_heads_only(cli, monkeypatch):
    from attnviz.compute.display import maps
    from attnviz.compute.forward_pass import streaming

    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)  # stream every run
    monkeypatch.setattr(streaming, "MAX_VIEW_HEADS", 2)
    monkeypatch.setattr(maps, "MAX_VIEW_HEADS", 2)
    kept = []
    finish = streaming.MapReducer.finish

    def spy(self, *args, **kwargs):
        result = finish(self, *args, **kwargs)
        kept.append(sorted({v.head for v in result.views if v.head is not None}))
        return result

    monkeypatch.setattr(streaming.MapReducer, "finish", spy)
    result = cli("heatmap", "--random", "--spec", "E=16", "-H", "8", "a b c a b", "--json")
    assert_printed_clean(result)
    assert kept == [[0, 1]] and len(json.loads(result.stdout)["head_stats"]) == 8
    assert_error(cli("heatmap", "--random", "--spec", "E=16", "-H", "8", "a b c", "--head", "5"),
                 2, "only the maps of heads 0..1 are kept", "--export")
