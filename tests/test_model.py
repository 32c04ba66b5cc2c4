"""heatmap --model and split --model --verify on every text architecture of the zoo (tests/zoo.py):
exported maps equal transformers' own eager output_attentions for each sentence run alone, a
batch equals its sentences run alone, --query recomputes the model's own weights from the
captured q_h and k_h, encoder-decoder models run their decoder (self- and cross-attention), and
the split proof (`split --verify`) passes on attnviz's own head slicing and fails on
deliberately wrong slices."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
transformers = lazy_import("transformers", "tokenizers")

import torch  # noqa: E402
from support_record import record  # noqa: E402
from zoo import FALLBACK, SENTENCES, TEXT, ZOO, load_tokenizer  # noqa: E402

from attnviz.app import heatmap as app  # noqa: E402
from attnviz.compute.measures.breakdown import query_breakdown  # noqa: E402
from attnviz.core import memory  # noqa: E402
from attnviz.errors import UsageError, with_options  # noqa: E402
from attnviz.recognize import find_layers  # noqa: E402
from attnviz.sources.hf import capture as cap  # noqa: E402
from attnviz.sources.hf import split_proof  # noqa: E402
from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run  # noqa: E402
from attnviz.sources.hf.load import PATHS, LoadedModel, load_model  # noqa: E402
from attnviz.sources.hf.run import run_plan  # noqa: E402

INTERFACE = [kind for kind in TEXT if kind not in FALLBACK]
TARGETS = ["the big red barn", "a cat sat far away"]  # one per sentence; T ≠ S
ATOL = 1e-5


pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


@dataclass
class Model:
    kind: str
    loaded: LoadedModel
    reference: Any  # the same weights with transformers' eager attention

    @property
    def targets(self) -> list[str] | None:
        return TARGETS if ZOO[self.kind].encoder_decoder else None


@pytest.fixture(scope="module")
def model(zoo_model):
    cache: dict[str, Model] = {}

    def get(kind: str) -> Model:
        if kind not in cache:
            folder = zoo_model(kind)
            # The zoo's own tokenizer: transformers 5 maps some model types (qwen2) to a class
            # that rebuilds the saved WordLevel tokenizer without its vocabulary.
            loaded = load_model(str(folder), tokenizer=load_tokenizer(folder))
            reference = getattr(transformers, ZOO[kind].model_class).from_pretrained(
                folder, attn_implementation="eager").eval()
            cache[kind] = Model(kind, loaded, reference)
        return cache[kind]

    return get


def alone(m: Model, sentence: str, target: str | None = None) -> dict[str, Any]:
    """transformers' own output_attentions for one sentence (and target) run alone."""
    tok = m.loaded.tokenizer
    ids = tok(sentence)["input_ids"]
    feed: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    runner = m.reference
    out: dict[str, Any] = {"tokens": tok.convert_ids_to_tokens(ids)}
    if target is not None:
        decoder = [m.reference.config.decoder_start_token_id,
                   *tok(text_target=target)["input_ids"]]
        feed["decoder_input_ids"] = torch.tensor([decoder])
        out["target_tokens"] = tok.convert_ids_to_tokens(decoder)
    elif ZOO[m.kind].encoder_decoder:
        runner = m.reference.get_encoder()
    with torch.no_grad():
        result = runner(**feed, output_attentions=True)
    if target is not None:
        out.update(attn=result.encoder_attentions, decoder=result.decoder_attentions,
                   cross=result.cross_attentions)
    else:
        out["attn"] = result.attentions
    return out


def run(m: Model, sentences: list[str], layer: str | None = None,
        targets: list[str] | None = None, **kwargs: Any) -> Any:
    """As the app runs a model: the plan and the run read one ModelRun (kwargs: its fields)."""
    plan = plan_run(m.loaded, RunInputs(sentences, targets), layer, ModelRun(**kwargs))
    return run_plan(m.loaded, plan)


def assert_same(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def assert_streamed_views(whole: Any, streamed: Any, batch: Any) -> None:
    """A streamed layer kept no full map, and each display view equals the full map's (its
    head, or the mean over heads) over the sentence's real tokens."""
    import numpy as np

    assert streamed.weights is None and ", streamed" in streamed.method
    for view in streamed.streamed.views:
        n = len(batch.tokens[view.sentence])
        maps = whole.weights[view.sentence, :, :n, :n]
        expected = maps.mean(0) if view.head is None else maps[view.head]
        np.testing.assert_allclose(view.values, expected.numpy(), atol=1e-6)


@pytest.mark.parametrize("kind", TEXT)
def test_exported_maps_equal_eager_for_each_sentence_alone(model, kind, tmp_path):
    """The --export contract: attn.N (B, H, L, S) [decoder.N, cross.N], inputs.N, mask, tokens
    [target_tokens]; each sentence's maps equal transformers' own for it run alone, padding
    (left or right) realigned to positions 0..n-1."""
    from safetensors import safe_open

    m = model(kind)
    result = run(m, SENTENCES, targets=m.targets)
    assert result.path == PATHS[m.loaded.path]
    assert (m.loaded.path == cap.CapturePath.INTERFACE) == (kind not in FALLBACK)
    path = tmp_path / "maps.safetensors"
    app.export(result, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        maps = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    stacks = {"attn": "S", "decoder": "T", "cross": "T"} if m.targets else {"attn": "S"}
    for b, sentence in enumerate(SENTENCES):
        expected = alone(m, sentence, m.targets[b] if m.targets else None)
        assert json.loads(meta["tokens"])[b] == expected["tokens"]
        lengths = {"S": len(expected["tokens"])}
        if m.targets:
            assert json.loads(meta["target_tokens"])[b] == expected["target_tokens"]
            lengths["T"] = len(expected["target_tokens"])
            assert maps["target_mask"][b].sum() == lengths["T"]
        assert maps["mask"][b].sum() == lengths["S"]
        for stack, rows in stacks.items():
            cols = "S" if stack == "attn" else "T" if stack == "decoder" else "S"
            n, s = lengths[rows], lengths[cols]
            for i, reference in enumerate(expected[stack]):
                got = maps[f"{stack}.{i}"]
                assert got.shape[1] == reference.shape[1]
                assert_same(got[b, :, :n, :s], reference[0])
                assert not got[b, :, n:].any() and not got[b, :, :, s:].any()
    if kind not in FALLBACK:  # the hidden states entering each attention module
        for key in (k for k in maps if k.startswith("attn.")):
            assert maps["inputs." + key[5:]].shape[:2] == maps[key].shape[::2][:2]
    record(kind, heatmap=True, path="interface" if kind not in FALLBACK else "output_attentions",
           cross=bool(m.targets))


@pytest.mark.parametrize("kind", TEXT)
def test_batch_equals_single(model, kind):
    m = model(kind)
    layers = "0,-1" if not m.targets else "enc 0,dec -1,cross 0"
    batch = run(m, SENTENCES, layers, m.targets)
    assert len(batch.layers) == (2 if not m.targets else 3)
    for b, sentence in enumerate(SENTENCES):
        single = run(m, [sentence], layers, [m.targets[b]] if m.targets else None)
        for one, many in zip(single.layers, batch.layers, strict=True):
            assert (one.index, one.label, one.kind) == (many.index, many.label, many.kind)
            n, s = one.weights.shape[2:]
            assert_same(many.weights[b, :, :n, :s], one.weights[0])
            if one.inputs is not None:
                assert_same(many.inputs[b, :n], one.inputs[0])


@pytest.mark.parametrize("kind", ["llama", "bart", "bloom", "albert"])
def test_probed_run_equals_a_run_that_numbers_its_own_layers(model, kind):
    """Short inputs with --layer all, N or A:B skip the 1-token probe: the run itself numbers
    the calls. The same maps, inputs, labels and heads either way (ALBERT: one module, two
    calls; BLOOM: output_attentions)."""
    m = model(kind)
    for spec in (None, "1", "0:2"):
        text = RunInputs(SENTENCES, m.targets)
        direct = plan_run(m.loaded, text, spec)
        probed = plan_run(m.loaded, text, spec, ModelRun(need_layers=True))
        assert direct.layers is None and probed.layers is not None
        a, b = run_plan(m.loaded, direct), run_plan(m.loaded, probed)
        assert [(c.index, c.label, c.kind, c.name, c.heads) for c in a.layers] == \
            [(c.index, c.label, c.kind, c.name, c.heads) for c in b.layers]
        for x, y in zip(a.layers, b.layers, strict=True):
            assert torch.equal(x.weights, y.weights) and x.causal == y.causal
            assert (x.inputs is None) == (y.inputs is None)
            if x.inputs is not None:
                assert torch.equal(x.inputs, y.inputs)
    with pytest.raises(UsageError, match="is not a layer of this model") as info:
        run(m, SENTENCES, "7")
    assert info.value.option == "layer"


@pytest.mark.parametrize("kind", INTERFACE)
def test_query_from_captured_q_and_k(model, kind):
    """--query on every interface model: scaling · q_h·k_h (+ bias, mask) from the q_h and k_h
    the model's attention received equals transformers' own weights for the sentence alone; the
    shorter sentence is padded (on the tokenizer's side) in the batch."""
    m = model(kind)
    specs = ["-1"] if not m.targets else ["enc -1", "cross -1", "dec 0"]
    for spec in specs:
        result = run(m, SENTENCES, spec, m.targets, query=(0, "-1"))
        captured = result.layers[-1]
        expected = alone(m, SENTENCES[0], m.targets[0] if m.targets else None)
        stack = {"self": "attn", "decoder-self": "decoder", "cross": "cross"}[captured.kind]
        rows = captured.rows_of(result.batch)[0]
        breakdown = query_breakdown(result, captured.index, 0, len(rows) - 1)
        assert breakdown.source == "captured" and breakdown.max_diff <= ATOL
        number = int(captured.label.split()[-1])
        reference = expected[stack][number][0, :, len(rows) - 1]  # (H, S)
        for head in breakdown.heads:
            assert_same(torch.tensor(head.weights), reference[head.head])
            q, keys = torch.tensor(head.q), torch.tensor(head.keys)
            assert_same(keys @ q, torch.tensor(head.dots), 1e-4)
            if kind not in ("gemma2", "t5", "mt5"):  # softcap, position bias: added to scores
                assert_same(torch.tensor(head.scores),
                            torch.tensor(head.dots) * breakdown.scale, 1e-4)
    record(kind, query=True)


@pytest.mark.parametrize("kind", sorted(FALLBACK))
def test_query_is_refused_on_output_attentions_models(model, kind):
    m = model(kind)
    with pytest.raises(UsageError, match="output_attentions") as info:
        run(m, SENTENCES, "-1", query=(0, "1"))
    assert info.value.option == "query"
    record(kind, query=False)


def _verify_param(kind: str) -> Any:
    """Every text architecture of the zoo: attnviz's recognizer describes each (recognize/
    conventions.py), so the split proof has a description to prove."""
    return kind


@pytest.mark.parametrize("kind", [_verify_param(kind) for kind in TEXT])
def test_split_proof_passes(model, kind):
    """Every layer attnviz recognizes, encoder, decoder and cross-attention included: negating
    each head's rows changes that head (or its group) only."""
    m = model(kind)
    layers = find_layers(m.loaded.store).layers
    assert layers, "no layer recognized"
    for layer in layers:
        result = split_proof.prove_split(m.loaded, layer, SENTENCES, m.targets)
        assert result.passed, (layer.name, [(c.projection, c.head, c.reason)
                                            for c in result.failures])
        assert len(result.checks) == layer.num_heads + 2 * layer.num_kv_heads
        assert not result.untestable  # the zoo's attention is sharp: every head shows
    from attnviz.compute.forward_pass.positions import (
        SCHEMES,  # families whose positions attnviz recomputes
    )

    record(kind, verify="split" + (" + recompute" if m.loaded.config.model_type in SCHEMES
                                      else ""))


def swap(layer: Any, a: int, b: int, kind: str) -> Any:
    """`layer` with the rows of heads a and b exchanged in W_q (kind q), W_k (k) or W_v (v)."""
    rows = layer.q_rows if kind == "q" else layer.kv_rows
    total = layer.num_heads if kind == "q" else layer.num_kv_heads
    order = tuple(rows(b if h == a else a if h == b else h) for h in range(total))
    names = (f"{kind}_weight", f"{kind}_bias")
    return replace(layer, **{name: getattr(layer, name).take(order) for name in names
                             if getattr(layer, name) is not None})


# One architecture per packing scheme of W_q, W_k, W_v.
PACKINGS = {"separate q/k/v": "llama", "stacked qkv (multi-query)": "gpt_bigcode",
            "interleaved NeoX": "gpt_neox", "interleaved BLOOM": "bloom",
            "grouped Falcon": "falcon", "Conv1D (transposed)": "gpt2"}


@pytest.mark.parametrize("packing", PACKINGS)
def test_split_proof_fails_on_wrong_slices(model, packing):
    """Negative controls: heads 0 and 1 swapped in attnviz's description fail, per projection;
    the proof blames exactly the swapped heads."""
    m = model(PACKINGS[packing])
    layer = find_layers(m.loaded.store).layers[1]
    assert split_proof.prove_split(m.loaded, layer, SENTENCES).passed
    for projection in ("q", "k", "v"):
        if projection != "q" and layer.num_kv_heads < 2:
            continue  # one key/value head: nothing to swap
        wrong = swap(layer, 0, 1, projection)
        result = split_proof.prove_split(m.loaded, layer, SENTENCES, described=wrong)
        assert not result.passed, projection
        failed = {(c.projection, c.head) for c in result.failures}
        assert failed == {(projection, 0), (projection, 1)}, (projection, failed)


def test_untestable_head_is_said(tmp_path):
    """A head whose map is uniform either way cannot show a change: reported, not passed."""
    from zoo import ZOO as zoo_rows
    from zoo import build_model, save_tokenizer

    model = build_model("bert")
    with torch.no_grad():  # head 2's query is zero: uniform attention, however negated
        attention = model.encoder.layer[0].attention.self
        attention.query.weight[16:24] = 0
        attention.query.bias[16:24] = 0
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, zoo_rows["bert"])
    loaded = load_model(str(tmp_path), tokenizer=load_tokenizer(tmp_path))
    layer = find_layers(loaded.store).layers[0]
    assert layer.q_rows(2) == (16, 24)
    result = split_proof.prove_split(loaded, layer, SENTENCES)
    assert result.passed
    # its key cannot show a change either: every score of head 2 is 0
    assert [(c.projection, c.head) for c in result.untestable] == [("q", 2), ("k", 2)]
    assert "uniform" in result.untestable[0].reason


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # left and right padding
def test_streamed_run_equals_full_maps(model, kind, monkeypatch):
    """Past the budget, each layer's maps are reduced block by block: the same views,
    statistics and --query row as the full maps, and only the last layer's inputs are kept."""

    from attnviz.compute.measures.stats import head_stats

    m = model(kind)
    full = run(m, SENTENCES)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    monkeypatch.setattr(memory, "EAGER_BLOCK_BYTES", 3 * 2 * 4 * 16 * 4)  # 3 rows per block
    streamed = run(m, SENTENCES, allow_stream=True, query=(1, "-2"))
    assert "long input" in streamed.notes[0]
    for a, b in zip(full.layers, streamed.layers, strict=True):
        assert_streamed_views(a, b, full.batch)
        for x, y in zip(head_stats(a.weights, full.batch.tokens, a.index), b.streamed.stats,
                        strict=True):
            assert (x.layer, x.head) == (y.layer, y.head)
            assert x.entropy == pytest.approx(y.entropy, rel=1e-5, abs=1e-7)
    n = len(full.batch.tokens[1])
    last = streamed.layers[-1]
    assert last.streamed.query_row == (1, n - 2)
    assert_same(last.streamed.query_weights, full.layers[-1].weights[1, :, n - 2, :n])
    assert [layer.inputs is None for layer in streamed.layers] == [True, False]


@pytest.mark.parametrize(("kind", "causal"), [("llama", True), ("bert", False)])
def test_streamed_run_measures_causality(model, monkeypatch, kind, causal):
    """A streamed layer's `causal` is measured by its reducer (the weight each block puts on
    keys after its queries), not assumed: True for a decoder, False for an encoder (whose
    self-attention layers start out presumed causal), as on the whole maps."""
    m = model(kind)
    full = run(m, SENTENCES)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    monkeypatch.setattr(memory, "EAGER_BLOCK_BYTES", 3 * 2 * 4 * 16 * 4)  # 3 rows per block
    streamed = run(m, SENTENCES, allow_stream=True)
    assert all(layer.weights is None for layer in streamed.layers)
    assert [layer.causal for layer in streamed.layers] == [causal] * len(full.layers)
    assert [layer.causal for layer in full.layers] == [causal] * len(full.layers)


def test_blocks_of_query_rows_equal_whole_maps(model, monkeypatch):
    m = model("phi3")  # left padding, grouped-query
    whole = run(m, SENTENCES)
    monkeypatch.setattr(memory, "EAGER_BLOCK_BYTES", 2 * 2 * 4 * 16 * 4)  # 2 rows per block
    blocked = run(m, SENTENCES)
    for a, b in zip(whole.layers, blocked.layers, strict=True):
        assert_same(b.weights, a.weights, 1e-6)


@pytest.mark.parametrize("kind", ["phi3", "llama"])
def test_causal_blocks_run_over_the_keys_they_see(model, monkeypatch, kind):
    """In blocks of query rows, a causal block runs the module's own eager attention over only
    the keys its queries see (`capture_eager.keys_seen`: fewer than all for an early block),
    and the maps equal one whole block's, which sees every key (phi3: left padding, whose
    fully masked rows keep every key). Control: one key fewer changes the maps."""
    from attnviz.sources.hf import capture_eager

    m = model(kind)
    whole = run(m, SENTENCES)
    monkeypatch.setattr(memory, "EAGER_BLOCK_BYTES", 2 * 2 * 4 * 16 * 4)  # a few rows per block
    real = capture_eager.keys_seen
    seen: list[tuple[int, int]] = []

    def recorded(mask, total, extras):
        keys = real(mask, total, extras)
        seen.append((keys, total))
        return keys

    monkeypatch.setattr(capture_eager, "keys_seen", recorded)
    blocked = run(m, SENTENCES)
    assert any(keys < total for keys, total in seen)
    for a, b in zip(whole.layers, blocked.layers, strict=True):
        assert_same(b.weights, a.weights, 1e-6)
    monkeypatch.setattr(capture_eager, "keys_seen",
                        lambda mask, total, extras: max(1, real(mask, total, extras) - 1))
    short = run(m, SENTENCES)
    assert max(float((a.weights - b.weights).abs().max())
               for a, b in zip(whole.layers, short.layers, strict=True)) > 1e-3


def test_keys_seen_shortens_only_what_it_can_prove():
    """A causal float mask: the keys up to the block's last query; every key where a row sees
    none (left padding), for a boolean mask, or beside a key-axis bias of three axes (ALiBi);
    a 2-D position index does not stop it. Control: a padding-only mask keeps every key."""
    from attnviz.sources.hf.capture_eager import keys_seen

    low = torch.finfo(torch.float32).min
    causal = torch.triu(torch.full((6, 6), low), 1)[None, None]  # (1, 1, L, S)
    block = causal[:, :, 1:3]  # queries 1 and 2
    assert keys_seen(block, 6, ()) == 3
    assert keys_seen(block, 6, (torch.arange(6)[None],)) == 3  # position_ids (1, L)
    assert keys_seen(block, 6, (torch.zeros(2, 1, 6),)) == 6  # an ALiBi-like (B·H, 1, S)
    assert keys_seen(block == 0, 6, ()) == 6  # a boolean mask: left alone
    padded = block.clone()
    padded[..., 0, :] = low  # a row that sees no key: its softmax spreads over every key
    assert keys_seen(padded, 6, ()) == 6
    assert keys_seen(torch.zeros(1, 1, 2, 6), 6, ()) == 6  # control: every key seen


def test_keys_seen_is_worked_out_once_per_mask_and_block(monkeypatch):
    """A model hands every layer one mask object: its blocks' keys_seen are worked out once,
    and again when the mask changes in place or another mask comes; arguments over the keys
    are checked on every call, and an inference tensor (no version counter) is never
    cached."""
    from types import SimpleNamespace

    from attnviz.sources.hf import capture_eager

    real, calls = capture_eager.keys_seen, []
    monkeypatch.setattr(capture_eager, "keys_seen",
                        lambda *args: calls.append(1) or real(*args))
    session = capture_eager.Session(SimpleNamespace(config=SimpleNamespace()), {}, None, None,
                                    lambda *args: None, False)
    low = torch.finfo(torch.float32).min
    mask = torch.triu(torch.full((6, 6), low), 1)[None, None]
    assert session._keys_seen(mask, (1, 3, 6), 6, ()) == 3
    assert session._keys_seen(mask, (1, 3, 6), 6, ()) == 3 and len(calls) == 1  # next layer
    assert session._keys_seen(mask, (1, 3, 6), 6, (torch.zeros(2, 1, 6),)) == 6  # ALiBi-like
    mask[..., 2, 4] = 0.0  # in place: query 2 now sees key 4
    assert session._keys_seen(mask, (1, 3, 6), 6, ()) == 5
    assert session._keys_seen(mask.clone(), (0, 1, 6), 6, ()) == 1
    with torch.inference_mode():
        frozen = torch.triu(torch.full((6, 6), low), 1)[None, None]
    before = len(calls)
    assert [session._keys_seen(frozen, (0, 2, 6), 6, ()) for _ in range(2)] == [2, 2]
    assert len(calls) == before + 2


def test_encoder_decoder_labels_and_grammar(model):
    m = model("marian")
    result = run(m, SENTENCES, None, TARGETS)
    assert [c.label for c in result.layers] == [
        "enc 0", "enc 1", "dec 0", "cross 0", "dec 1", "cross 1"]
    assert [c.causal for c in result.layers] == [False, False, True, False, True, False]
    assert [c.weights.shape[2:] for c in result.layers[2:4]] == [
        (max(map(len, result.target.tokens)),) * 2,
        (max(map(len, result.target.tokens)), max(map(len, result.batch.tokens)))]
    chosen = run(m, SENTENCES, "cross -1,1", TARGETS)
    assert [c.label for c in chosen.layers] == ["enc 1", "cross 1"]
    encoder = run(m, SENTENCES)  # no target: the encoder alone
    assert [c.label for c in encoder.layers] == ["enc 0", "enc 1"]
    assert any("encoder ran alone" in note for note in encoder.notes)
    with pytest.raises(UsageError, match="no 'cross' layers") as info:
        run(m, SENTENCES, "cross 0")
    assert "pass target" in with_options(info.value.fix)
    with pytest.raises(UsageError, match="1 target texts for 2 sentences"):
        run(m, SENTENCES, None, TARGETS[:1])
    with pytest.raises(UsageError, match="encoder-decoder models only"):
        run(model("llama"), SENTENCES, None, TARGETS)


def test_cross_attention_statistics_and_views(model):
    from attnviz.app.heatmap import summarize
    from attnviz.core.request import Selection

    m = model("bart")
    result = summarize(run(m, SENTENCES, "cross 0,dec 0", TARGETS), Selection())
    cross = [s for s in result.head_stats if s.layer_label == "cross 0"]
    assert len(cross) == 4 and all(s.distance is None and s.previous is None for s in cross)
    assert all(0 < s.first < 1 for s in cross)
    dec = [s for s in result.head_stats if s.layer_label == "dec 0"]
    assert all(s.previous is not None for s in dec)
    view = next(v for v in result.views if v.label == "cross 0" and v.sentence == 1)
    assert view.row_labels[0] == "</s>" and view.col_labels[0] == "<s>"  # target × source
    assert view.title == "cross 0 · head 0"


@pytest.mark.parametrize("kind", ["llama", "gpt2", "marian"])  # left, right padding; enc-dec
def test_streamed_export_equals_the_in_memory_export(model, kind, monkeypatch, tmp_path):
    """A long --model --export is written block by block as the model computes (no full map
    held): the file has the same keys, metadata and tensors as the export of the full maps."""
    from safetensors import safe_open

    from attnviz.app import export as exporting

    m = model(kind)
    plan = plan_run(m.loaded, RunInputs(SENTENCES, m.targets), "all",
                    ModelRun(need_layers=True))
    whole = tmp_path / "whole.safetensors"
    exporting.export(run_plan(m.loaded, plan), whole)
    monkeypatch.setattr(memory, "MAP_BUDGET_BYTES", 0)
    monkeypatch.setattr(memory, "EAGER_BLOCK_BYTES", 3 * 2 * 4 * 16 * 4)  # 3 rows per block
    streamed = tmp_path / "streamed.safetensors"
    result = exporting.run_model_exporting(m.loaded, plan, streamed)
    assert result is not None and result.exported == streamed
    assert all(layer.weights is None for layer in result.layers if layer.kind == "self")
    with safe_open(whole, "pt") as a, safe_open(streamed, "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and a.metadata() == b.metadata()
        for key in a.keys():
            assert_same(b.get_tensor(key), a.get_tensor(key), 1e-6)
        maps = sorted(k for k in a.keys() if not k.startswith(("inputs", "mask", "target")))
        assert len(maps) >= 2
        # negative control: the comparison tells two layers' maps apart
        assert not torch.allclose(b.get_tensor(maps[0]), a.get_tensor(maps[1]), atol=1e-6)


def test_short_inputs_export_after_the_run(model, tmp_path):
    from attnviz.app import export as exporting

    m = model("gpt2")
    plan = plan_run(m.loaded, SENTENCES, "all", ModelRun(need_layers=True))
    assert exporting.run_model_exporting(m.loaded, plan, tmp_path / "x.safetensors") is None
    assert not (tmp_path / "x.safetensors").exists()


def test_memory_budget_decides_streaming_and_block_size(model):
    """--budget memory applies to --model: under it the maps stream, in eager blocks of at most
    a quarter of it, and the streamed views equal the full maps'."""

    m = model("llama")
    full = run(m, SENTENCES, "all")
    assert all(layer.weights is not None for layer in full.layers)  # the default budget: whole
    budget = 4 * 2 * 4 * 16 * 4  # a quarter of it: 2 query rows per block
    plan = plan_run(m.loaded, SENTENCES, "all", ModelRun(memory_budget=budget))
    streamed = run_plan(m.loaded, plan, ModelRun(allow_stream=True, memory_budget=budget))
    assert memory.eager_block_bytes(budget) == budget // 4 < memory.EAGER_BLOCK_BYTES
    for a, b in zip(full.layers, streamed.layers, strict=True):
        assert_streamed_views(a, b, full.batch)
