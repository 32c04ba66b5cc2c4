"""The one memory decision (`attnviz.core.memory`): for a standalone layer (`layer_plan`) whole
maps or blocks, rows and heads per block within the budget, and blocks of several heads at once
give the full maps' display maps, statistics and --query row; for a model run (`model_plan`,
`surely_whole`, `eager_rows`) whether its shown layers stream and how many query rows an eager
block holds."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import count_calls
from test_long import CASES, TEXTS, _mismatch

from attnviz.app import heatmap as heatmap_mod
from attnviz.compute.forward_pass import layer_stream, streaming
from attnviz.compute.forward_pass.inputs import make_batch
from attnviz.core import memory

CPU = torch.device("cpu")


def _plan(batch, heads: int, extra: int = 0, budget: int | None = None, device=CPU, **options):
    """The standalone plan of a batch on a device."""
    return memory.layer_plan(memory.MapsShape(len(batch.tokens), batch.max_len, heads, extra),
                             budget, on_cpu=device.type == "cpu", **options)


def _batch(length: int, sentences: int = 1):
    return make_batch([" ".join(f"w{i}" for i in range(length))] * sentences,
                      max_tokens=40000)


@pytest.mark.parametrize(("length", "heads", "extra", "budget", "device"), list(itertools.product(
    (7, 300, 4096), (1, 4, 16), (0, 1), (2**12, 2**20, 2**28), ("cpu", "meta"))))
def test_plan_stays_within_its_bounds(length, heads, extra, budget, device):
    """Whole exactly when the full maps fit and are kept (or every map is shown whole, at
    most 512 keys); blocks of block_rows' rows; heads per block the most that the budget (and
    on a CPU the entry cap) holds, never more than the layer has."""
    batch = _batch(length, 2)
    device = torch.device(device)
    plan = _plan(batch, heads, extra, budget, device)
    keys = length + extra
    full = 2 * heads * length * keys * 4  # independent of memory.full_maps_bytes
    assert plan.streamed == (full > budget or keys > memory.WHOLE_KEYS)
    kept = _plan(batch, heads, extra, budget, device, keep=True)
    assert kept.streamed == (full > budget)
    if not plan.streamed:
        return
    assert plan.rows == memory.block_rows(budget, keys, device.type == "cpu")

    def fits(h: int) -> bool:
        entries = h * plan.rows * keys
        return entries * memory.BLOCK_BUFFERS * 4 <= budget and (
            device.type != "cpu" or entries <= memory.CPU_BLOCK_ENTRIES)

    assert 1 <= plan.heads <= heads
    assert plan.heads == 1 or fits(plan.heads)  # within the budget
    assert plan.heads == heads or not fits(plan.heads + 1)  # and the most it holds
    assert _plan(batch, heads, extra, budget, device, one_head=True).heads == 1


def test_the_default_plan_of_the_4096_token_layer():
    """The issue's layer (16 heads, 4,096 tokens): full maps of 1 GiB stream, in blocks of
    256 rows of all 16 heads (64 MiB buffers), under the 256 MiB default budget."""
    plan = _plan(_batch(4096), 16)
    assert plan == memory.MemoryPlan(True, 256, 16)
    assert 16 * 256 * 4096 * 4 * memory.BLOCK_BUFFERS <= memory.MAP_BUDGET_BYTES
    # 256 MiB fit the budget: held whole only when kept (for --weighting norm, --export)
    assert _plan(_batch(2048), 16) == memory.MemoryPlan(True, 256, 16)
    assert not _plan(_batch(2048), 16, keep=True).streamed
    assert not _plan(_batch(512), 16).streamed  # shown whole: torch's forward


def _grouped(monkeypatch, case: str, rows: int, heads: int, **request):
    """The full run and a streamed run whose blocks hold `rows` rows of `heads` heads."""
    monkeypatch.setattr(memory, "CPU_BLOCK_ROWS", rows)
    batch = make_batch(TEXTS)
    build = heatmap_mod.HeatmapRequest.build
    full = heatmap_mod.run_on_batch(batch, build(**CASES[case], **request))
    layer = full.layers[0]
    keys = layer.weights.shape[-1]
    budget = heads * rows * keys * memory.BLOCK_BUFFERS * 4
    plan = _plan(batch, layer.layer.num_heads, keys - batch.max_len, budget)
    assert (plan.rows, plan.heads) == (rows, heads)
    streamed = heatmap_mod.run_on_batch(batch, build(**CASES[case], memory_budget=budget,
                                                     **request))
    assert streamed.layers[0].weights is None
    assert f"{heads} heads of one sentence" in streamed.layers[0].method
    return full, streamed


# 3 heads of 4 (groups of 3 and 1), 2 of 4 and 2 of 2; gqa: 4 query heads over 2 kv heads
@pytest.mark.parametrize(("case", "heads"), [("plain", 3), ("causal", 2), ("bias_k", 3),
                                             ("bias_k causal", 2), ("gqa", 3)])
def test_blocks_of_several_heads_equal_full_maps(monkeypatch, case, heads):
    monkeypatch.setattr(streaming, "DISPLAY_CELLS", 6)
    full, streamed = _grouped(monkeypatch, case, 4, heads)
    layer = streamed.layers[0].streamed
    worst_map, worst_stat = _mismatch(full, layer.views, layer.stats, 6)
    assert worst_map <= 1e-6 and worst_stat <= 1e-6


def test_blocks_of_several_heads_keep_the_query_row(monkeypatch):
    full, streamed = _grouped(monkeypatch, "bias_k causal", 5, 2, query="13")
    expected = full.layers[0].weights[0, :, 13]  # (H, S) with padding columns
    keys = list(range(len(full.batch.tokens[0]))) + \
        list(range(full.batch.max_len, expected.shape[-1]))
    torch.testing.assert_close(streamed.layers[0].streamed.query_weights, expected[:, keys],
                               atol=1e-6, rtol=0)


def test_mixed_up_heads_in_a_block_are_caught(monkeypatch):
    """Negative control: a block whose heads get each other's query rows (the projection's
    ranges reversed) fails the same comparison."""
    monkeypatch.setattr(streaming, "DISPLAY_CELLS", 6)
    rows_of = layer_stream._rows
    monkeypatch.setattr(layer_stream, "_rows",
                        lambda tensor, ranges: rows_of(tensor, list(reversed(ranges))))
    full, streamed = _grouped(monkeypatch, "plain", 4, 3)
    layer = streamed.layers[0].streamed
    worst_map, worst_stat = _mismatch(full, layer.views, layer.stats, 6)
    assert worst_map > 1e-3 and worst_stat > 1e-3


def test_the_note_names_the_heads_per_block(cli, monkeypatch):
    words = " ".join(f"w{i % 37}" for i in range(90))
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 3 * 4 * 90 * memory.BLOCK_BUFFERS * 4)
    monkeypatch.setattr(memory, "CPU_BLOCK_ROWS", 4)
    result = cli("heatmap", "--random", "-H", "4", words, "--no-stats", "--no-maps")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert "long input: maps computed 3 heads and sentence at a time" in flat
    assert "blocks of query rows of 3 heads of one sentence at a time, 4 rows per block" in flat


@pytest.mark.parametrize(("n", "row_start", "r", "keys", "extra"), [
    (23, 4, 8, 23, 0), (23, 9, 5, 14, 1), (40, 0, 40, 40, 1), (5, 1, 3, 4, 0), (24, 8, 8, 24, 0)])
def test_cell_sums_on_host_and_device_paths_equal_a_direct_sum(n, row_start, r, keys, extra):
    """A block of 3 heads reduced to display cells by the host (numpy) and the device (torch
    index_add_, here run on the CPU) paths equals a direct sum over each cell's entries."""
    from attnviz.compute.display import cells
    from attnviz.compute.display.views import display_grid

    torch.manual_seed(0)
    grid = display_grid(n, n + extra, 6, 5)
    attn = torch.rand(3, r, keys + extra)
    row_index, col_index = grid.row_index(), grid.col_index()
    low, high = int(row_index[row_start]), int(row_index[row_start + r - 1])
    expected = torch.zeros(3, high - low + 1, len(grid.col_blocks))
    key_of = list(range(keys)) + list(range(n, n + extra))  # the block's columns, as keys
    for i in range(r):
        for c, key in enumerate(key_of):
            expected[:, int(row_index[row_start + i]) - low, int(col_index[key])] += attn[:, i, c]
    span = cells.BlockSpan(row_start, keys, n, low, high)
    host, columns = cells.cell_sums(grid, (row_index, col_index), attn, span, {})
    got = torch.zeros_like(expected)
    got[:, :, columns] = host
    device = cells._device_sums(grid, (row_index, col_index), attn, span)
    for result in (got, device):
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
    wrong = expected.clone()
    wrong[:, 0, 0] += 1e-3  # negative control: one cell off is caught
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, wrong, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_maps_past_512_keys_stream_unless_read():
    """A 600-token layer fits the default budget: it streams (display views and statistics
    equal the full maps'), except when its maps are read whole (--weighting norm), which still
    works; the full run is the negative control of the streamed one's decision."""
    from attnviz.core.request import RandomSpec

    batch = make_batch([" ".join(f"w{i % 50}" for i in range(600))], max_tokens=1000)
    request = dict(random=RandomSpec(32, 4))
    build = heatmap_mod.HeatmapRequest.build
    streamed = heatmap_mod.run_on_batch(batch, build(**request))
    full = heatmap_mod.run_on_batch(batch, build(**request, weighting="norm"))
    assert streamed.layers[0].weights is None and full.layers[0].weights is not None
    kept = streamed.layers[0].streamed
    worst_map, worst_stat = _mismatch(full, kept.views, kept.stats, streaming.DISPLAY_CELLS)
    assert worst_map <= 1e-6 and worst_stat <= 1e-4
    weighted = heatmap_mod.run_heatmap(build(
        sentences=(" ".join(f"w{i % 50}" for i in range(600)),), random=RandomSpec(32, 4),
        max_tokens=1000, weighting="norm"))
    assert weighted.run.weighting == "norm" and weighted.run.layers[0].weights is not None


# --- a model run's plan (`heatmap --model`) ---------------------------------------------------

@pytest.mark.parametrize(("sentences", "length", "heads", "layers"), list(itertools.product(
    (1, 3), (5, 300, 1000), (2, 32), (0, 1, 6))))
def test_model_plan_streams_exactly_past_the_budget(sentences, length, heads, layers):
    """The shown source layers' maps are whole exactly when together they fit the budget and
    either are kept or have at most 512 keys, as a standalone layer's: a budget of exactly
    their bytes holds them, one byte less does not (the control)."""
    full = layers * sentences * heads * length * length * 4  # independent of full_maps_bytes
    small = length <= 512
    if layers == 0:
        assert not memory.model_plan(sentences, length, heads, layers, 1).streamed
        return
    assert memory.model_plan(sentences, length, heads, layers, full).streamed == (not small)
    assert not memory.model_plan(sentences, length, heads, layers, full, keep=True).streamed
    assert memory.model_plan(sentences, length, heads, layers, full - 1).streamed
    assert memory.model_plan(sentences, length, heads, layers, full - 1, keep=True).streamed
    default = memory.model_plan(sentences, length, heads, layers)
    assert default.streamed == (full > 256 * 2**20 or not small)
    assert default.block_bytes == 32 * 2**20


@pytest.mark.parametrize("budget", [None, 1, 7, 4 * 1000, 2**27, 2**28, 2**40])
def test_eager_blocks_take_a_quarter_of_the_budget_at_most_32_mib(budget):
    expected = 32 * 2**20 if budget is None else max(1, min(32 * 2**20, budget // 4))
    assert memory.eager_block_bytes(budget) == expected
    assert memory.model_plan(1, 10, 2, 1, budget).block_bytes == expected


@pytest.mark.parametrize(("block", "batch", "heads", "length", "keys"), list(itertools.product(
    (None, 1, 4 * 2 * 4 * 16, 3 * 2 * 4 * 16 * 4, 2**25), (1, 2), (1, 4, 32), (1, 16, 1000),
    (16, 1000))))
def test_eager_rows_are_the_most_a_block_holds(block, batch, heads, length, keys):
    """An eager block of r query rows holds (B, H, r, S) float32 weights: r is the most that
    fit block_bytes (at least one row, at most L; None: all L)."""
    rows = memory.eager_rows(block, batch, heads, length, keys)
    assert 1 <= rows <= length
    if block is None:
        assert rows == length
        return

    def fits(r: int) -> bool:
        return batch * heads * r * keys * 4 <= block

    assert rows == 1 or fits(rows)  # within the block
    assert rows == length or not fits(rows + 1)  # and the most it holds


def test_eager_rows_control_catches_an_off_by_one():
    """Negative control for the bounds above: a block sized for exactly 3 rows gives 3, and a
    block one byte short gives 2."""
    block = 2 * 4 * 3 * 16 * 4  # B=2, H=4, 3 rows, S=16
    assert memory.eager_rows(block, 2, 4, 20, 16) == 3
    assert memory.eager_rows(block - 1, 2, 4, 20, 16) == 2


@pytest.mark.parametrize(("sentences", "heads", "calls", "length"), list(itertools.product(
    (1, 2), (4, 12), (1, 6, 18), (8, 512, 1500))))
def test_a_model_needs_no_probe_when_every_call_surely_fits(sentences, heads, calls, length):
    """No probe when every call's maps together take at most half the budget and have at most
    512 keys: a budget of twice their bytes suffices, two bytes less do not (the control)."""
    size = sentences * heads * calls * length * length * 4
    small = length <= 512
    assert memory.surely_whole(sentences, heads, calls, length, 2 * size) == small
    assert not memory.surely_whole(sentences, heads, calls, length, 2 * size - 2)
    assert memory.surely_whole(sentences, heads, calls, length) == (size <= 128 * 2**20 and small)


def _long_llama(zoo_model, tmp_path):
    """The zoo's llama with room for 4,096 positions (rotary: the weights do not change)."""
    import json

    from zoo import load_tokenizer

    from attnviz.sources.hf.load import load_model

    folder = tmp_path / "llama"
    folder.mkdir()
    source = zoo_model("llama")
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return load_model(str(folder), tokenizer=load_tokenizer(folder))


@pytest.mark.hf
@pytest.mark.slow
def test_model_maps_past_512_keys_stream_like_a_standalone_layer(zoo_model, tmp_path):
    """A --model input longer than 512 tokens fits the default budget but streams, as a
    standalone layer does (no whole-map statistics): a probe numbers the layers first, and the
    display views and statistics equal those of the whole maps (allow_stream=False, the run
    that keeps them). A 500-token input stays whole with no probe (the control of the
    decision); another layer's maps do not match (the control of the comparison)."""
    from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run
    from attnviz.sources.hf.run import run_plan

    loaded = _long_llama(zoo_model, tmp_path)
    sentences = [" ".join(["the", "cat", "sat"] * 200), "the cat sat on the mat"]

    def runs(layer: str):
        plan = plan_run(loaded, RunInputs(sentences, max_tokens=4000), layer)
        assert plan.shown is not None  # probed: the decision needs the layers' heads
        assert plan.prepared.batch.max_len > memory.WHOLE_KEYS
        return (run_plan(loaded, plan, ModelRun(allow_stream=True)),
                run_plan(loaded, plan, ModelRun()))

    streamed, whole = runs("0")
    assert any("long input" in note for note in streamed.notes)
    layer = streamed.layers[0]
    assert layer.weights is None and ", streamed" in layer.method
    assert whole.layers[0].weights is not None
    worst_map, worst_stat = _mismatch(whole, layer.streamed.views, layer.streamed.stats,
                                      streaming.DISPLAY_CELLS)
    assert worst_map <= 1e-6 and worst_stat <= 1e-4
    # negative control: layer 1's views are not layer 0's maps
    other = runs("1")[0].layers[0].streamed
    assert _mismatch(whole, other.views, other.stats, streaming.DISPLAY_CELLS)[0] > 1e-3

    short = plan_run(loaded, RunInputs([" ".join(["the", "cat"] * 249)], max_tokens=4000),
                     "all")
    assert short.shown is None and short.prepared.batch.max_len <= memory.WHOLE_KEYS
    kept = run_plan(loaded, short, ModelRun(allow_stream=True))
    assert all(layer.weights is not None for layer in kept.layers)
    assert not any("long input" in note for note in kept.notes)


def test_statistics_alone_skip_the_display_views(monkeypatch):
    """Outputs(views=False) (no output shows a map): a streamed layer reduces no block to
    display cells and keeps no view, and its statistics equal a run that keeps views; the
    run that keeps them does reduce blocks (the control of the count)."""
    from attnviz.core.request import HeatmapRequest, RandomSpec

    calls = count_calls(monkeypatch, streaming, "cell_sums")  # blocks reduced to cells
    batch = _batch(700, 2)
    build = HeatmapRequest.build
    spec = RandomSpec(embed_dim=32, num_heads=4)
    kept = heatmap_mod.run_on_batch(batch, build(random=spec, max_tokens=40000))
    assert calls and kept.layers[0].weights is None and kept.layers[0].streamed.views
    calls.clear()
    bare = heatmap_mod.run_on_batch(batch, build(random=spec, max_tokens=40000, views=False))
    assert calls == [] and bare.layers[0].streamed.views == []
    assert bare.layers[0].streamed.stats == kept.layers[0].streamed.stats


def test_model_overview_builds_no_views_unless_an_output_shows_maps(cli, zoo_model, tmp_path,
                                                                     monkeypatch):
    """The default `--model` overview of a long input reduces no block to display cells; the
    same run with --out does (the control), and both print the same overview."""
    folder = _long_llama(zoo_model, tmp_path).folder
    calls = count_calls(monkeypatch, streaming, "cell_sums")  # blocks reduced to cells
    words = " ".join(["the", "cat", "sat"] * 200)
    plain = cli("heatmap", "--model", str(folder), words, "--budget", "tokens=4000", "--json")
    assert plain.exit_code == 0, plain.output
    assert calls == []
    figure = cli("heatmap", "--model", str(folder), words, "--budget", "tokens=4000", "--json",
                 "--out", str(tmp_path / "maps.png"))
    assert figure.exit_code == 0, figure.output
    assert calls
    import json

    assert json.loads(plain.stdout)["overview"] == json.loads(figure.stdout)["overview"]
