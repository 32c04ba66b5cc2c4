"""attnviz.sources.hf.capture on every architecture of the zoo: maps equal transformers' own eager
output_attentions, blocks equal whole maps, only shown layers pay for eager attention."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
transformers = lazy_import("transformers", "tokenizers")

import torch  # noqa: E402
from zoo import (  # noqa: E402
    ENCODER_DECODER,
    FALLBACK,
    SENTENCES,
    TEXT,
    ZOO,
    load_for_capture,
    load_tokenizer,
)

from attnviz.core.choices import LayerKind  # noqa: E402
from attnviz.errors import UsageError  # noqa: E402
from attnviz.sources.hf import capture as cap  # noqa: E402

INTERFACE = [kind for kind in TEXT if kind not in FALLBACK]
TARGET = "the big red barn"  # decoder input of encoder-decoder models: T != S
ATOL = 1e-5


pytestmark = [pytestmark, pytest.mark.usefixtures("one_thread")]


@dataclass
class Loaded:
    kind: str
    model: Any  # loaded by zoo.load_for_capture
    reference: Any  # the same weights with transformers' eager attention
    tokenizer: Any


@pytest.fixture(scope="module")
def loaded(zoo_model):
    cache: dict[str, Loaded] = {}

    def get(kind: str) -> Loaded:
        if kind not in cache:
            folder = zoo_model(kind)
            model_class = getattr(transformers, ZOO[kind].model_class)
            reference = model_class.from_pretrained(folder, attn_implementation="eager").eval()
            cache[kind] = Loaded(kind, load_for_capture(folder, ZOO[kind].model_class),
                                 reference, load_tokenizer(folder))
        return cache[kind]

    return get


def encode(m: Loaded, sentences: list[str]) -> dict[str, torch.Tensor]:
    enc = dict(m.tokenizer(sentences, return_tensors="pt", padding=len(sentences) > 1))
    if ZOO[m.kind].encoder_decoder:
        target = m.tokenizer(TARGET, return_tensors="pt")["input_ids"]
        start = torch.tensor([[m.reference.config.decoder_start_token_id]])
        enc["decoder_input_ids"] = torch.cat([start, target], 1).expand(len(sentences), -1)
    return enc


def eager_maps(m: Loaded, enc: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """transformers' own output_attentions, in capture's call order, and the last hidden state."""
    with torch.no_grad():
        out = m.reference(**enc, output_attentions=True)
    if ZOO[m.kind].encoder_decoder:
        maps = list(out.encoder_attentions)
        for self_maps, cross_maps in zip(out.decoder_attentions, out.cross_attentions,
                                         strict=True):
            maps += [self_maps, cross_maps]
        return maps, out.last_hidden_state
    return list(out.attentions), out.last_hidden_state


def captured(m: Loaded, enc: dict, **kwargs: Any) -> tuple[cap.CaptureResult, cap.MapCollector]:
    maps = cap.MapCollector()
    return cap.capture(m.model, enc, on_block=maps, **kwargs), maps


def assert_same(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", TEXT)
def test_maps_equal_eager_output_attentions(loaded, kind):
    """Every layer, each sentence alone (and, with a pad token, both padded in one batch)."""
    m = loaded(kind)
    runs = [[s] for s in SENTENCES] + ([SENTENCES] if ZOO[kind].pad else [])
    for sentences in runs:
        enc = encode(m, sentences)
        expected, hidden = eager_maps(m, enc)
        result, maps = captured(m, enc)
        assert result.path == (cap.CapturePath.OUTPUT_ATTENTIONS if kind in FALLBACK
                               else cap.CapturePath.INTERFACE)
        assert [layer.index for layer in result.layers] == list(range(len(expected)))
        for layer, reference in zip(result.layers, expected, strict=True):
            assert layer.shown and layer.num_heads == reference.shape[1]
            assert_same(maps.maps(layer.index), reference)
        assert_same(result.outputs.last_hidden_state, hidden)


def _rows_not_dividing(length: int) -> int:
    return next(rows for rows in range(3, length) if length % rows)


@pytest.mark.parametrize("kind", TEXT)
def test_blocks_equal_whole_maps(loaded, kind):
    m = loaded(kind)
    enc = encode(m, SENTENCES if ZOO[kind].pad else SENTENCES[1:])  # padded: masks sliced too
    whole, whole_maps = captured(m, enc)
    first = whole.layers[0]
    rows = _rows_not_dividing(first.query_length)
    batch = enc["input_ids"].shape[0]
    budget = rows * batch * first.num_heads * first.key_length * 4  # `rows` float32 rows
    blocked, blocked_maps = captured(m, enc, block_budget_bytes=budget)
    starts = [start for start, _ in blocked_maps.blocks[0]]
    assert starts == list(range(0, first.query_length, rows))  # the last block is shorter
    for layer in whole.layers:
        assert_same(blocked_maps.maps(layer.index), whole_maps.maps(layer.index), 1e-6)
    assert_same(blocked.outputs.last_hidden_state, whole.outputs.last_hidden_state)


def _count(monkeypatch, mapping: dict, key: str, calls: list[str], label: str) -> None:
    original = mapping[key]

    def counted(*args, **kwargs):
        calls.append(label)
        return original(*args, **kwargs)

    monkeypatch.setitem(mapping, key, counted)


@pytest.mark.parametrize("kind", INTERFACE)
def test_one_shown_layer_runs_eager_once(loaded, kind, monkeypatch):
    """--layer 1: eager for that layer only, sdpa for the rest (Gemma 2: sdpa cannot softcap)."""
    from transformers import AttentionInterface

    m = loaded(kind)
    enc = encode(m, SENTENCES[1:])
    calls: list[str] = []
    _count(monkeypatch, AttentionInterface._global_mapping, "sdpa", calls, "sdpa")
    # Where each attention forward looks its eager function up, each module namespace once.
    namespaces = {id(forward.__globals__): forward.__globals__ for forward in (
        inspect.unwrap(type(module).forward) for module in m.model.modules()
        if cap.calls_interface(type(module)))}
    for namespace in namespaces.values():
        _count(monkeypatch, namespace, "eager_attention_forward", calls, "eager")
    result, maps = captured(m, enc, shown_layers=[1])
    methods = [layer.computed_with for layer in result.layers]
    assert [layer.shown for layer in result.layers] == [i == 1 for i in range(len(methods))]
    assert calls == methods  # one call per layer, in order, each through the method it reports
    assert methods[1] == "eager"
    if kind == "gemma2":
        assert set(methods) == {"eager"}
    else:
        assert methods.count("sdpa") == len(methods) - 1
    assert list(maps.blocks) == [1]
    expected, hidden = eager_maps(m, enc)
    assert_same(maps.maps(1), expected[1])
    assert_same(result.outputs.last_hidden_state, hidden)


@pytest.mark.parametrize("kind", sorted(FALLBACK))
def test_fallback_path_is_reported(loaded, kind):
    m = loaded(kind)
    assert not cap.uses_interface(m.model)
    result, _ = captured(m, encode(m, SENTENCES[:1]), keep_qk=True)
    assert result.path == cap.CapturePath.OUTPUT_ATTENTIONS
    assert {layer.computed_with for layer in result.layers} == {"output_attentions"}
    assert all(layer.query is None for layer in result.layers)  # not available on this path
    assert all("attention" in layer.name or "attn" in layer.name  # XGLM: layers.N.self_attn
               for layer in result.layers)


@pytest.mark.parametrize("kind", ENCODER_DECODER)
def test_encoder_decoder_layers(loaded, kind):
    m = loaded(kind)
    enc = encode(m, SENTENCES[1:])
    source, target = enc["input_ids"].shape[1], enc["decoder_input_ids"].shape[1]
    result, maps = captured(m, enc)
    kinds = [layer.kind for layer in result.layers]
    assert kinds == [LayerKind.SELF] * 2 + [LayerKind.DECODER_SELF,
                                                 LayerKind.CROSS] * 2
    with torch.no_grad():
        out = m.reference(**enc, output_attentions=True)
    expected = {LayerKind.SELF: list(out.encoder_attentions),
                LayerKind.DECODER_SELF: list(out.decoder_attentions),
                LayerKind.CROSS: list(out.cross_attentions)}
    shapes = {LayerKind.SELF: (source, source), LayerKind.DECODER_SELF: (target, target),
              LayerKind.CROSS: (target, source)}
    for layer in result.layers:
        weights = maps.maps(layer.index)
        assert weights.shape == (1, 4, *shapes[layer.kind])
        assert_same(weights, expected[layer.kind].pop(0))
        if layer.kind == LayerKind.DECODER_SELF:  # causal: nothing above the diagonal
            assert not weights.triu(1).any()
        assert ("decoder" in layer.name) == (layer.kind != LayerKind.SELF)


def test_negative_controls(loaded, monkeypatch):
    """The comparison can fail: a perturbed map, and maps captured without the eager mask
    builder registered (transformers then hands the function no mask at all)."""
    from transformers.masking_utils import AttentionMaskInterface

    m = loaded("llama")
    enc = encode(m, SENTENCES[1:])
    expected, _ = eager_maps(m, enc)
    _, maps = captured(m, enc)
    perturbed = maps.maps(0).clone()
    perturbed[0, 1, 5, 2] += 1e-4
    with pytest.raises(AssertionError):
        assert_same(perturbed, expected[0])
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, cap.NAME)
    monkeypatch.setattr(cap, "register", lambda: None)
    _, unmasked = captured(m, enc)
    with pytest.raises(AssertionError):
        assert_same(unmasked.maps(0), expected[0])
    assert unmasked.maps(0).triu(1).any()  # the causal mask is gone


def test_kept_query_and_key_recompute_the_maps(loaded):
    """keep_qk hands out the model's own per-head q (after rotary) and k (before repeat_kv)."""
    m = loaded("llama")  # 4 query heads, 2 key/value heads, bias on q/k
    enc = encode(m, SENTENCES[1:])
    result, maps = captured(m, enc, shown_layers=[1], keep_qk=True)
    layer = result.layers[1]
    length = enc["input_ids"].shape[1]
    assert layer.query.shape == (1, 4, length, 8) and layer.key.shape == (1, 2, length, 8)
    assert result.layers[0].query is None  # not shown, not kept
    key = layer.key.repeat_interleave(2, dim=1)  # (B, H, S, d)
    scores = layer.query @ key.transpose(2, 3) / 8 ** 0.5
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    assert_same(scores.masked_fill(causal, float("-inf")).softmax(-1), maps.maps(1))


def test_model_loaded_elsewhere_is_switched_for_the_run_only(zoo_model, loaded):
    folder = zoo_model("qwen2")
    model = transformers.Qwen2Model.from_pretrained(folder, attn_implementation="sdpa").eval()
    m = loaded("qwen2")
    enc = encode(m, SENTENCES[1:])
    result = cap.capture(model, enc)
    assert result.path == cap.CapturePath.INTERFACE and len(result.layers) == 2
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        plain = model(**enc).last_hidden_state
    assert_same(result.outputs.last_hidden_state, plain)


def test_vision_model(zoo_model):
    folder = zoo_model("vit")
    model = load_for_capture(folder, "ViTModel")
    reference = transformers.ViTModel.from_pretrained(folder, attn_implementation="eager").eval()
    pixels = {"pixel_values": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        expected = reference(**pixels, output_attentions=True).attentions
    collector = cap.MapCollector()
    result = cap.capture(model, pixels, on_block=collector)
    assert [layer.name for layer in result.layers] == [
        f"layers.{i}.attention" for i in range(2)]  # 5.24 in memory; the file says
    # encoder.layer.{i}.attention.attention.query (conversion_mapping renames on load and save)
    for layer, reference_maps in zip(result.layers, expected, strict=True):
        assert collector.maps(layer.index).shape == (1, 4, 17, 17)  # 16 patches + [CLS]
        assert_same(collector.maps(layer.index), reference_maps)


def test_usage_errors(zoo_model, loaded):
    m = loaded("bert")
    enc = encode(m, SENTENCES[:1])
    with pytest.raises(UsageError, match="call indices"):
        cap.capture(m.model, enc, shown_layers=[-1])
    with pytest.raises(UsageError, match=r"no attention layer 5: the model ran 2 attention "
                                          r"layers \(0\.\.1\)"):
        cap.capture(m.model, enc, shown_layers=[5])
    with pytest.raises(UsageError, match="block budget"):
        cap.capture(m.model, enc, block_budget_bytes=0)


@pytest.mark.parametrize(("family", "kwargs"), [
    ("llama", {}), ("t5", {"position_bias": True}), ("gemma2", {"softcap": 2.0})])
def test_generic_eager_equals_the_families_own(family, kwargs):
    """attnviz's eager, for modules whose file has none, against three files' own."""
    import importlib

    own = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 5, 8, generator=gen) for h in (4, 2, 2))
    if family == "t5":  # T5's eager does not repeat key/value heads
        key, value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    mask = torch.zeros(2, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -1e9)
    if kwargs.get("position_bias"):
        kwargs = {"position_bias": torch.randn(1, 4, 5, 5, generator=gen)}
    module = torch.nn.Module().eval()
    module.num_key_value_groups = 2
    expected = own.eager_attention_forward(module, query, key, value, mask, scaling=0.3,
                                           dropout=0.0, **kwargs)
    actual = cap.generic_eager(module, query, key, value, mask, scaling=0.3, **kwargs)
    for a, b in zip(actual, expected, strict=True):
        assert_same(a, b, 1e-6)


def test_inputs_are_kept_token_major():
    """The hidden states entering an attention module are kept as (B, L, E): SqueezeBERT's
    attention projects with nn.Conv1d on (B, E, L) and is transposed; a tensor with no axis of
    the run's sequence lengths is not hidden states and is dropped (never sliced as if it were)."""
    from attnviz.sources.hf.collect import token_major

    conv = torch.nn.Module()
    conv.query = torch.nn.Conv1d(32, 32, 1)
    linear = torch.nn.Module()
    linear.query = torch.nn.Linear(32, 32)
    x = torch.randn(2, 32, 7)  # (B, E, L)
    assert torch.equal(token_major(conv, x, {7}), x.transpose(1, 2))
    y = torch.randn(2, 7, 32)  # (B, L, E)
    assert token_major(linear, y, {7}) is y
    assert token_major(linear, x, {7}) is None  # channels-first without a conv: not guessed
    assert token_major(conv, torch.randn(2, 32, 5), {7}) is None


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])
def test_half_precision_on_cpu_runs_the_eager_blocks_in_float32(zoo_model, kind, monkeypatch):
    """bfloat16 on a CPU: the shown layers' own eager attention runs on float32 copies of q/k/v
    (bfloat16 matmuls are ~10x slower there). The maps stay within bfloat16 rounding of the
    model's own bfloat16 eager maps, their rows sum to 1 in float32 (bfloat16 rows do not),
    and the model's output stays bfloat16. Control: without the upcast nothing is marked and
    the maps are the bfloat16 ones."""
    if kind not in ZOO:
        pytest.skip(f"{kind} is not in this zoo")
    folder = zoo_model(kind)
    model_class = getattr(transformers, ZOO[kind].model_class)
    half = model_class.from_pretrained(folder, attn_implementation="eager",
                                       dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(folder)
    enc = dict(tokenizer(SENTENCES[:1], return_tensors="pt"))
    with torch.no_grad():
        half_out = half(**enc, output_attentions=True)
    model = load_for_capture(folder, ZOO[kind].model_class)
    model.to(torch.bfloat16)
    result, maps = captured(Loaded(kind, model, half, tokenizer), enc)
    assert result.outputs.last_hidden_state.dtype == torch.bfloat16
    for layer, half_map in zip(result.layers, half_out.attentions, strict=True):
        assert layer.upcast_from == "bfloat16"
        ours = maps.maps(layer.index)
        assert ours.dtype == torch.float32
        assert_same(ours, half_map.float(), atol=2e-2)
        assert_same(ours.sum(-1), torch.ones(ours.shape[:-1]))
    assert not torch.allclose(half_out.attentions[-1].float().sum(-1), torch.ones(()), atol=1e-5)
    monkeypatch.setattr("attnviz.sources.hf.capture_eager._upcast", lambda query: False)
    result, maps = captured(Loaded(kind, model, half, tokenizer), enc)
    assert all(layer.upcast_from is None for layer in result.layers)
    assert maps.maps(0).dtype == torch.bfloat16
