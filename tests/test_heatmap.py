"""heatmap: the batched forward equals torch's own module; padding, masks, figures, errors."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import SAMPLES, assert_clean_error, colored_runs, needs_safe_pickles, read_image
from safetensors import safe_open

from attnviz.compute.forward_pass.attention import layer_attention
from attnviz.compute.forward_pass.forward import load_weights
from attnviz.compute.forward_pass.inputs import hashed_vector, make_batch
from attnviz.compute.measures.stats import head_stats
from attnviz.core import memory
from attnviz.core.layer import AttentionLayer
from attnviz.core.tensor_ref import TensorRef
from attnviz.load.store import DictStore

SENTENCES = ["the cat sat on the mat", "a dog", "one two three four five six seven eight"]


def _export(cli, tmp_path, *args):
    path = tmp_path / "maps.safetensors"
    result = cli("heatmap", *args, "--export", path, "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    return tensors, json.loads(meta["tokens"])


@pytest.mark.parametrize("causal", [False, True])
def test_export_equals_separately_built_torch_module(cli, tmp_path, causal):
    args = ["--random", "--spec", "E=32,seed=3", "-H", "4", *SENTENCES]
    tensors, tokens = _export(cli, tmp_path, *args, *(["--causal"] if causal else []))
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():  # attnviz's random init draws visible biases after torch's init
        mha.in_proj_bias.normal_(0.0, 0.1)
        mha.out_proj.bias.normal_(0.0, 0.1)
    mha.eval()
    x, mask = tensors["inputs.0"], tensors["mask"]
    L = x.shape[1]
    attn_mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        _, expected = mha(x, x, x, key_padding_mask=mask == 0, attn_mask=attn_mask,
                          need_weights=True, average_attn_weights=False)
    assert tensors["attn.0"].shape == (3, 4, L, L)
    torch.testing.assert_close(tensors["attn.0"], expected, atol=1e-6, rtol=1e-5)
    assert tokens == [s.split() for s in SENTENCES]
    assert mask.sum(1).tolist() == [6, 2, 8]
    # the inputs are what the README says: the hashed vector of each token
    assert torch.equal(x[0, 1], hashed_vector("cat", 32))
    assert torch.equal(x[0, 0], x[0, 4])  # "the" twice: the same vector


def test_rows_sum_to_one_and_causal_mask_holds(cli, tmp_path):
    tensors, tokens = _export(cli, tmp_path, "--random", "--causal", *SENTENCES)
    attn = tensors["attn.0"]
    for b, toks in enumerate(tokens):
        n = len(toks)
        real = attn[b, :, :n, :n]
        torch.testing.assert_close(real.sum(-1), torch.ones(real.shape[:2]))
        assert torch.all(real.triu(1) == 0)
        assert torch.all(attn[b, :, :n, n:] == 0)  # padding keys get nothing


def test_padding_invariance(cli, tmp_path):
    batched, _ = _export(cli, tmp_path, "--random", "-H", "2", *SENTENCES)
    for b, sentence in enumerate(SENTENCES):
        alone, tokens = _export(cli, tmp_path, "--random", "-H", "2", sentence)
        n = len(tokens[0])
        torch.testing.assert_close(batched["attn.0"][b, :, :n, :n], alone["attn.0"][0],
                                   atol=1e-6, rtol=1e-5)


def _gqa_layer(E=32, H=4, H_kv=2, d=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {"q.weight": torch.randn(H * d, E, generator=gen) / 4,
               "k.weight": torch.randn(H_kv * d, E, generator=gen) / 4,
               "v.weight": torch.randn(H_kv * d, E, generator=gen) / 4,
               "o.weight": torch.randn(E, H * d, generator=gen) / 4,
               "q.bias": torch.randn(H * d, generator=gen)}
    store = DictStore(tensors)

    def ref(key):
        return TensorRef(key, tuple(tensors[key].shape), "F32")

    layer = AttentionLayer("gqa", "test", E, E, E, H, H_kv, d, ref("q.weight"), ref("k.weight"),
                           ref("v.weight"), ref("o.weight"), q_bias=ref("q.bias"))
    return layer, store, tensors


def _sdpa_gqa(q, k, v, allowed):
    """torch's own attention over grouped kv heads: query head h reads kv head h // (H / H_kv).
    enable_gqa does that mapping inside torch >= 2.5; older torch (the declared floor is 2.1) gets
    each kv head repeated beside its query heads, the same computation spelled out."""
    if torch.__version__ >= "2.5":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.parametrize("H,H_kv,d", [(4, 2, 12), (4, 1, 8), (6, 3, 4), (2, 2, 24)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_non_square_layers_agree_with_sdpa(H, H_kv, d, causal):
    layer, store, t = _gqa_layer(H=H, H_kv=H_kv, d=d)
    batch = make_batch(SENTENCES)
    x = torch.randn(3, batch.max_len, 32, generator=torch.Generator().manual_seed(1))
    pad = torch.arange(batch.max_len)[None] >= torch.tensor(batch.lengths)[:, None]
    out, attn, method = layer_attention(layer, load_weights(layer, store), (x, x, x), pad, causal)
    assert method.startswith("explicit per head")
    B, L = x.shape[:2]
    q = (x @ t["q.weight"].T + t["q.bias"]).view(B, L, H, d).transpose(1, 2)
    k = (x @ t["k.weight"].T).view(B, L, H_kv, d).transpose(1, 2)
    v = (x @ t["v.weight"].T).view(B, L, H_kv, d).transpose(1, 2)
    allowed = ~pad[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool).tril()
    ctx = _sdpa_gqa(q, k, v, allowed)
    expected = ctx.transpose(1, 2).reshape(B, L, H * d) @ t["o.weight"].T
    for b, n in enumerate(batch.lengths):
        torch.testing.assert_close(out[b, :n], expected[b, :n], atol=1e-5, rtol=1e-5)
    # the weights: softmax of the scaled scores with kv head h // (H / H_kv)
    scores = (q @ k.repeat_interleave(H // H_kv, 1).transpose(-1, -2)) / d**0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    for b, n in enumerate(batch.lengths):
        torch.testing.assert_close(attn[b, :, :n], weights[b, :, :n], atol=1e-6, rtol=1e-5)


def test_head_statistics_label_clear_patterns():
    tokens = [["a", "b", "c", "d", "a", "b", "c", "d"]]
    n = 8
    prev = torch.zeros(1, 1, n, n)
    prev[0, 0, 0, 0] = 1.0
    for i in range(1, n):
        prev[0, 0, i, i - 1] = 1.0
    induction = torch.zeros(1, 1, n, n)
    for i in range(n):
        induction[0, 0, i, i - 3 if i >= 4 else 0] = 1.0  # token after the earlier copy
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    stats = head_stats(torch.cat([prev, induction, uniform[None, None]], 1), tokens, 0)
    assert [s.label for s in stats] == ["previous-token", "induction", ""]
    assert stats[0].previous == pytest.approx(1.0)
    assert stats[1].induction == pytest.approx(1.0)
    assert stats[0].distance == pytest.approx(7 / 8)
    import math

    assert stats[2].entropy == pytest.approx(sum(math.log(i) for i in range(1, 9)) / 8)


def test_figure_has_one_panel_per_sentence_and_head(cli, tmp_path):
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--random", "--spec", "E=48", "-H", "3", "the cat sat on the mat",
                 "a dog ran", "--out", out, "--no-maps", "--no-stats")
    assert result.exit_code == 0, result.output
    image = read_image(out)
    assert image.std() > 0.05
    columns = [r for r in colored_runs(image, axis=1) if r[1] - r[0] > 0.1 * image.shape[1]]
    rows = [r for r in colored_runs(image, axis=0) if r[1] - r[0] > 0.1 * image.shape[0]]
    assert (len(rows), len(columns)) == (2, 3)


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_figure_formats(cli, tmp_path, suffix):
    out = tmp_path / f"maps{suffix}"
    assert cli("heatmap", "--random", "a b c", "--out", out).exit_code == 0
    head = out.read_bytes()[:5]
    assert head.startswith(b"%PDF") if suffix == ".pdf" else b"<" in head


def test_terminal_output_fits_80_columns(cli):
    result = cli("heatmap", "--random", "-H", "4", *SENTENCES, "--query", "cat")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert "L0 · head 3" in result.stdout
    assert "query 1 'cat'" in result.stdout


def test_long_sentences_are_downsampled(cli):
    words = " ".join(f"w{i}" for i in range(120))
    result = cli("heatmap", "--random", words, "--budget", "tokens=200", "--head", "0")
    assert result.exit_code == 0, result.output
    assert "downsampled to fit" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_json_has_tokens_and_stats(cli):
    result = cli("heatmap", "--random", "-H", "2", "x y x y", "--json")
    doc = json.loads(result.stdout)
    assert doc["tokens"] == [["x", "y", "x", "y"]]
    assert len(doc["head_stats"]) == 2
    assert {"entropy", "induction", "label"} <= set(doc["head_stats"][0])


@needs_safe_pickles
def test_checkpoint_layer_heatmap(cli, tmp_path):
    path = tmp_path / "enc.pt"
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32), 2,
                                          enable_nested_tensor=False)
    torch.save(encoder.state_dict(), path)
    tensors, _ = _export(cli, tmp_path, "--weights", path, "--layer", "1", "-H", "2", "a b c")
    mha = encoder.layers[1].self_attn.eval()
    assert "attn.0" not in tensors  # keys carry the layer's index in the checkpoint
    x = tensors["inputs.1"].transpose(0, 1)  # the encoder's MHA is sequence-first
    with torch.no_grad():
        _, expected = mha(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(tensors["attn.1"], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("args,fragment", [
    (["   "], "sentence 1 is empty"),
    ([], "no sentence given"),
    (["a b", "--head", "9"], "head 9 is out of range"),
    (["a b", "--query", "zebra"], "token 'zebra' is not in the sentence"),
    (["a b", "--query", "5"], "query index 5 is out of range"),
    (["a b", "--query", "a@2"], "sentence 2 is out of range"),
    (["a b c d", "--budget", "tokens=3"], "more than --budget tokens 3"),
    (["a", "b", "--budget", "sentences=1"], "exceed --budget sentences 1"),
    # an index no machine has: refused with or without CUDA, for the reason that applies
    (["a b", "--device", "cuda:999"], "there is no GPU 999" if torch.cuda.is_available()
     else "CUDA is not available"),
    (["a b", "--device", "tpu"], "device"),
    (["a b", "--spec", "positions=rope"], "unknown --spec positions"),
    (["a b", "--out", "x.gif"], "cannot tell the output format"),
    (["a b", "--export", "x.npz"], "cannot tell the output format"),
    (["a b", "c", "--out", "m.png", "--budget", "panels=15"],
     "16 panels, more than --budget panels"),
])
def test_bad_input(cli, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    assert_clean_error(cli("heatmap", "--random", *args, "--out", "maps.png")
                       if "--out" not in args else cli("heatmap", "--random", *args), 2,
                       fragment)
    assert list(tmp_path.iterdir()) == []


def test_head_statistics_equal_a_naive_loop():
    import math

    gen = torch.Generator().manual_seed(0)
    tokens = [["a", "b", "a", "c", "b", "a"], ["x", "x", "y"]]
    maps = torch.softmax(torch.randn(2, 2, 6, 6, generator=gen), -1)
    stats = head_stats(maps, tokens, 0)
    for h in range(2):
        sums = {"entropy": 0.0, "previous": 0.0, "first": 0.0, "dup": 0.0, "ind": 0.0}
        counts = {"entropy": 0, "previous": 0, "first": 0, "dup": 0, "ind": 0}
        for b, toks in enumerate(tokens):
            n = len(toks)
            a = maps[b, h, :n, :n]
            for i in range(n):
                sums["entropy"] -= sum(float(p) * math.log(float(p)) for p in a[i] if p > 0)
                counts["entropy"] += 1
                if i:
                    sums["previous"] += float(a[i, i - 1])
                    sums["first"] += float(a[i, 0])
                    counts["previous"] += 1
                    counts["first"] += 1
                copies = [j for j in range(i) if toks[j] == toks[i]]
                if copies:
                    sums["dup"] += sum(float(a[i, j]) for j in copies)
                    counts["dup"] += 1
                targets = [j + 1 for j in copies if j + 1 < i]
                if targets:
                    sums["ind"] += sum(float(a[i, j]) for j in targets)
                    counts["ind"] += 1
        s = stats[h]
        assert s.entropy == pytest.approx(sums["entropy"] / counts["entropy"], rel=1e-5)
        assert s.previous == pytest.approx(sums["previous"] / counts["previous"], rel=1e-5)
        assert s.first == pytest.approx(sums["first"] / counts["first"], rel=1e-5)
        assert s.duplicate == pytest.approx(sums["dup"] / counts["dup"], rel=1e-5)
        assert s.induction == pytest.approx(sums["ind"] / counts["ind"], rel=1e-5)


@pytest.mark.slow
def test_streamed_long_inputs_equal_full_maps(cli, tmp_path, monkeypatch):
    """Streaming (one head at a time, display-sized maps) must show what the full maps show."""
    import json as json_mod

    from attnviz.compute.forward_pass import streaming

    words = " ".join(f"w{i % 37}" for i in range(90))
    args = ["heatmap", "--random", "-H", "4", words, "a b a b", "--json", "--causal"]
    full = json_mod.loads(cli(*args).stdout)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    monkeypatch.setattr(streaming, "DISPLAY_CELLS", 32)
    streamed = json_mod.loads(cli(*args).stdout)
    assert streamed["layers"][0]["method"].startswith("explicit per head, streamed")
    for a, b in zip(full["head_stats"], streamed["head_stats"], strict=True):
        for key in ("entropy", "max_weight", "distance", "previous", "induction", "duplicate"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    out = tmp_path / "long.png"
    result = cli("heatmap", "--random", "-H", "4", words, "--out", out, "--no-stats", "--maps")
    assert result.exit_code == 0, result.output
    assert "long input: maps computed one head and sentence at a time" in result.stdout
    assert "downsampled to fit" in result.stdout
    assert "mean of heads" not in result.stdout  # only with --head mean, as for full maps
    image = read_image(out)
    assert image.std() > 0.05
    panels = [r for r in colored_runs(image, axis=1) if r[1] - r[0] > 0.1 * image.shape[1]]
    assert len(panels) == 4


@pytest.mark.parametrize("extra", [["--spec", "E=32,kdim=16,vdim=24"],
                                   ["--spec", "E=32", "--causal"]])
def test_query_on_a_streamed_run_equals_the_full_maps(cli, monkeypatch, extra):
    """--query no longer forces full maps: streaming keeps that query's row of every head, and
    the breakdown (q_h, k_h from the key inputs, scores, weights) is the full run's."""
    import json as json_mod


    words = " ".join(f"w{i % 11}" for i in range(40))
    args = ["heatmap", "--random", "-H", "4", *extra, "a b a", words, "--query", "-3@2",
            "--json"]
    full = json_mod.loads(cli(*args).stdout)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    result = cli(*args)
    assert result.exit_code == 0, result.output
    streamed = json_mod.loads(result.stdout)
    assert streamed["layers"][0]["method"].startswith("explicit per head, streamed")
    assert not full["layers"][0]["method"].startswith("explicit per head, streamed")
    assert streamed["query"]["query"] == full["query"]["query"] == 37
    for a, b in zip(full["query"]["heads"], streamed["query"]["heads"], strict=True):
        for key in ("q", "keys", "dots", "scores", "weights"):
            np.testing.assert_allclose(np.array(b[key]), np.array(a[key]), atol=1e-5)


def test_streamed_views_do_not_keep_full_maps_alive(monkeypatch):
    """A short sentence's view (no downsampling needed) must own its values: a view into the
    head's (B, L, S) map would keep every head's full map in memory."""
    from attnviz.app import heatmap as heatmap_mod
    from attnviz.compute.forward_pass import streaming
    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.request import RandomSpec

    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    monkeypatch.setattr(streaming, "DISPLAY_CELLS", 32)
    batch = make_batch([" ".join(f"w{i}" for i in range(60)), "a b c"])
    run = heatmap_mod.run_on_batch(batch, heatmap_mod.HeatmapRequest.build(
        random=RandomSpec(16, 2)))
    short = [v for v in run.layers[0].streamed.views if v.sentence == 1]
    assert len(short) == 3 and all(not v.downsampled for v in short)  # 2 heads + their mean
    assert all(v.values.flags.owndata for v in short[:2])


@pytest.mark.parametrize("source", ["bias_kv", "gqa"])
def test_streamed_maps_equal_the_padded_batch(monkeypatch, source):
    """Sentence by sentence over real tokens only (bias_k column, causal, grouped-query heads):
    the same maps and statistics as the padded batch's full forward."""
    import numpy as np

    from attnviz.app import heatmap as heatmap_mod
    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.request import RandomSpec

    batch = make_batch(["the cat sat on the mat the cat sat", "a dog ran", "x y x y x"])
    build = heatmap_mod.HeatmapRequest.build
    request = (build(random=RandomSpec(16, 4, add_bias_kv=True), causal=True)
               if source == "bias_kv" else build(weights=SAMPLES / "llama-gqa-tiny", layer="1"))
    full = heatmap_mod.run_on_batch(batch, request).layers[0]
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    streamed = heatmap_mod.run_on_batch(batch, request).layers[0]
    assert full.weights is not None and streamed.weights is None
    H = full.layer.num_heads
    for view in streamed.streamed.views:
        n = len(batch.tokens[view.sentence])
        maps = full.weights[view.sentence, :, :n]  # (H, n, S): real queries
        keys = list(range(n)) + list(range(batch.max_len, maps.shape[-1]))  # + bias_k column
        expected = maps[:, :, keys].mean(0) if view.head is None else maps[view.head][:, keys]
        np.testing.assert_allclose(view.values, expected.numpy(), atol=1e-6)
    assert len(streamed.streamed.views) == len(batch.tokens) * (H + 1)
    full_stats = head_stats(full.weights, batch.tokens, 0)
    for a, b in zip(full_stats, streamed.streamed.stats, strict=True):
        assert a.head == b.head
        for key in ("entropy", "max_weight", "distance", "first", "previous", "self",
                    "duplicate", "induction"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-5, abs=1e-7), key


def test_figure_downsamples_maps_larger_than_their_panel():
    """imshow gets at most one cell per pixel, each a block sum of keys, so rows still sum to 1
    (nearest-neighbour resampling by matplotlib would instead drop most cells)."""
    import numpy as np

    from attnviz.compute.display.views import MapView
    from attnviz.render.figure import heatmap_figure, panel_inches
    from attnviz.render.figure_io import FIGURE_DPI

    n = 1000
    values = np.random.default_rng(0).random((n, n)).astype(np.float32)
    values /= values.sum(1, keepdims=True)
    labels = [f"t{i}" for i in range(n)]
    views = [MapView(0, 0, h, values, labels, labels, False) for h in range(2)]
    fig = heatmap_figure(views, "big")
    mosaic = np.ma.filled(fig.axes[0].images[0].get_array(), np.nan)
    pixels = round(panel_inches(views) * FIGURE_DPI)
    panel_rows = np.flatnonzero(~np.isnan(mosaic[:, 0]))  # under the panel's title band
    assert len(panel_rows) == pixels < n
    panel = mosaic[panel_rows, :pixels]
    np.testing.assert_allclose(panel.sum(1), 1.0, rtol=1e-5)


def test_downsampling_keeps_rows_summing_to_one():
    import numpy as np

    from attnviz.compute.display.views import MapView, downsample

    values = np.random.default_rng(0).random((100, 100)).astype(np.float32)
    values /= values.sum(1, keepdims=True)
    labels = [f"t{i}" for i in range(100)]
    small = downsample(MapView(0, 0, 0, values, labels, labels, False), 30, 7)
    assert small.values.shape == (30, 7)
    np.testing.assert_allclose(small.values.sum(1), 1.0, rtol=1e-5)
    assert small.col_spans[0] == (0, 14) and small.col_labels[0] == "0-13"
    values.flags.writeable = False  # e.g. a memory map: read without a warning on stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(
            downsample(MapView(0, 0, 0, values, labels, labels, False), 30, 7).values,
            small.values)
    smaller = downsample(small, 3, 3)  # downsampling twice composes the token spans
    assert smaller.row_spans == ((0, 33), (33, 67), (67, 100))
    np.testing.assert_allclose(smaller.values.sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("streamed", [False, True])
def test_nan_weights_are_reported_not_drawn(cli, tmp_path, monkeypatch, streamed):
    from safetensors.torch import save_file


    torch.manual_seed(0)
    state = torch.nn.MultiheadAttention(16, 4).state_dict()
    state["in_proj_weight"][0, 0] = float("nan")  # head 0's W_q: its scores turn NaN
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path), metadata={"num_heads": "4"})
    if streamed:
        monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    out = tmp_path / "maps.png"
    result = cli("heatmap", "--weights", path, "a b c", "--out", out)
    assert_clean_error(result, 1, "tensor 'in_proj_weight' (W_q of layer '(top level)') holds "
                       "non-finite values (1 NaN)", "inspect --scan")
    assert not out.exists()
