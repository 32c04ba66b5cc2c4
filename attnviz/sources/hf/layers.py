"""The attention calls of a model's forward pass, numbered per stack (enc, dec, cross), and
the plan of one run: which calls are shown."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

from attnviz.core import memory
from attnviz.core.choices import LayerKind
from attnviz.core.request import DEFAULT_MAX_TOKENS
from attnviz.core.selection import parse_stack_layers
from attnviz.errors import (
    CheckpointError,
    UsageError,
    option,
    printable,
)
from attnviz.sources.hf import capture, guard
from attnviz.sources.hf.inputs import Encoded, Prepared, prepare
from attnviz.sources.hf.load import STACK_OF, LoadedModel, OpenedModel


@dataclass(frozen=True)
class ModelLayer:
    """One attention call of the model's forward pass, as the probe saw it."""

    index: int  # call order (capture's numbering)
    name: str  # the calling module's name in the runner
    full_name: str  # … in the whole model (a tower's runner adds its prefix)
    kind: LayerKind
    stack: str  # "" (single-stack model), "enc", "dec" or "cross"
    stack_index: int  # its number within the stack
    num_heads: int | None
    num_kv_heads: int | None
    occurrence: int  # how many earlier calls the same module made (ALBERT shares one)

    @property
    def label(self) -> str:
        return f"{self.stack} {self.stack_index}" if self.stack else str(self.stack_index)


def probe(loaded: LoadedModel, prepared: Prepared) -> list[ModelLayer]:
    """Every attention call of the forward pass, from one run on a single token (all sdpa)."""
    try:
        with guard.silenced():
            result = capture.capture(prepared.runner, prepared.tiny(), shown_layers=[])
    except (RuntimeError, ValueError, IndexError) as exc:  # a model that cannot run at all
        raise CheckpointError(f"the model's forward pass failed: {printable(str(exc), 200)}",
                              fix="check that the model runs in transformers",
                              where=printable(str(loaded.folder))) from None
    if not result.layers:
        raise CheckpointError("the model's forward pass made no attention call",
                              fix="report this model to attnviz",
                              where=printable(str(loaded.folder)))
    return model_layers(loaded, prepared, result.layers)


def model_layers(loaded: LoadedModel, prepared: Prepared,
                 calls: list[capture.CapturedLayer]) -> list[ModelLayer]:
    """The attention calls of a forward pass, labelled per stack."""
    counts: Counter[str] = Counter()
    seen: Counter[tuple[str, str]] = Counter()
    layers = []
    prefix = prepared.runner_name + "." if prepared.runner_name else ""
    for call in calls:
        stack = STACK_OF[call.kind] if loaded.encoder_decoder else ""
        layers.append(ModelLayer(call.index, call.name, prefix + call.name, call.kind, stack,
                                 counts[stack], call.num_heads, call.num_kv_heads,
                                 seen[(stack, call.name)]))
        counts[stack] += 1
        seen[(stack, call.name)] += 1
    return layers


def select(layers: list[ModelLayer], spec: str | None) -> list[ModelLayer]:
    """The layers --layer names (see `attnviz.core.selection.parse_stack_layers`)."""
    stacks: dict[str, int] = {}
    for layer in layers:
        stacks[layer.stack] = stacks.get(layer.stack, 0) + 1
    try:
        chosen = parse_stack_layers(spec, stacks)
    except UsageError as error:
        if list(stacks) == ["enc"] and "this run has no" in error.what:
            error.fix = f"pass {option('target')} 'text' (one per sentence) to run the decoder too"
        raise
    if chosen is None:
        return list(layers)
    by_stack = {(layer.stack, layer.stack_index): layer for layer in layers}
    return sorted((by_stack[pair] for pair in chosen), key=lambda layer: layer.index)


@dataclass(frozen=True)
class ModelRun:
    """How a model run goes, as the request asks: read by the plan (what to number before the
    run) and by the run itself."""

    allow_stream: bool = False  # shown source layers may stream (False: full maps kept)
    query: tuple[int, str] | None = None  # (sentence, token spec) broken down head by head
    memory_budget: int | None = None  # bytes the full maps may take (None: the default)
    values: bool = False  # --weighting norm: the value norms, full maps read whole
    need_layers: bool = False  # the layers numbered before the run (the ablation reads them)
    views: bool = True  # streamed layers keep display views (False: statistics alone)


@dataclass(frozen=True)
class RunInputs:
    """The text of a model run: sentences (and an encoder-decoder's decoder targets, one per
    sentence), at most max_tokens each, or their token ids encoded already."""

    sentences: list[str]
    targets: list[str] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    encoded: Encoded | None = None


@dataclass
class Plan:
    """What one heatmap run will do: its inputs, the model's layers, the ones shown.

    When the input is short and --layer names call indices directly (all, N, A:B), no probe
    runs: `layers` and `shown` stay None until the run itself numbers the calls, and `indices`
    says which to show (None: every call).
    """

    prepared: Prepared
    layers: list[ModelLayer] | None
    shown: list[ModelLayer] | None
    indices: list[int] | None = None
    spec: str | None = None
    how: ModelRun = ModelRun()  # how `run_plan` runs it, unless told otherwise


def plan_run(loaded: LoadedModel, text: RunInputs | list[str], layer: str | None = None,
             how: ModelRun = ModelRun()) -> Plan:
    """Inputs encoded and, where the run needs them before it starts, the layers numbered by a
    1-token probe: layer forms that need the layer count or the stacks (-1, 'cross 0'), long
    inputs (the streaming decision needs the heads), how.need_layers or how.values (the value
    norms and the ablation read them), and a query on a decoder run (its rows may be target
    tokens). A figure's panel limit needs no probe: config.json counts the layers
    (`expected_shown`), or the run itself does. text: a list is its sentences alone."""
    if not isinstance(text, RunInputs):
        text = RunInputs(list(text))
    prepared = prepare(loaded, text.sentences, text.targets, text.max_tokens, text.encoded)
    direct = _direct_indices(layer)
    need_layers = how.need_layers or how.values
    if not need_layers and direct is not False and \
            not (how.query is not None and text.targets is not None):
        sizes = _call_sizes(loaded, prepared)  # no probe when no layer can stream
        if sizes is not None and memory.surely_whole(len(prepared.batch.tokens), *sizes,
                                                     how.memory_budget):
            return Plan(prepared, None, None, cast(Any, direct), layer, how)
    layers = probe(loaded, prepared)
    return Plan(prepared, layers, select(layers, layer), None, layer, how)


def _direct_indices(spec: str | None) -> list[int] | None | bool:
    """Call indices a --layer names without knowing the layers: None (all), N, A:B with A < B;
    False for every other form."""
    if spec is None or spec.strip() == "all":
        return None
    text = spec.strip()
    if re.fullmatch(r"[0-9]{1,18}", text):
        return [int(text)]
    match = re.fullmatch(r"([0-9]{1,18}):([0-9]{1,18})", text)
    if match and int(match[1]) < int(match[2]):
        return list(range(int(match[1]), int(match[2])))
    return False


def _call_sizes(loaded: LoadedModel, prepared: Prepared) -> tuple[int, int, int] | None:
    """(heads, attention calls, longest sequence) of a run by the config's head and layer counts
    (or the attention modules counted); None where the config does not say."""
    config = loaded.config
    heads = config_count(config, HEAD_FIELDS)
    layers = config_count(config, LAYER_FIELDS)
    modules = sum(1 for module in prepared.runner.modules() if attention_like(module))
    if not heads or not (layers or modules):
        return None
    calls = max(modules, layers * (3 if prepared.target is not None else 1))
    length = prepared.batch.max_len
    if prepared.target is not None:
        length = max(length, prepared.target.max_len)
    return heads, calls, length


def attention_like(module: Any) -> bool:
    """A module that calls the attention interface, or is named like an attention module."""
    return (capture.calls_interface(type(module))  # type: ignore[arg-type]
            or "Attention" in type(module).__name__)


def rows_tokens(plan: Plan, layer: ModelLayer) -> list[list[str]]:
    if layer.kind == LayerKind.SELF:
        return plan.prepared.batch.tokens
    assert plan.prepared.target is not None
    return plan.prepared.target.tokens


def cols_tokens(plan: Plan, layer: ModelLayer) -> list[list[str]]:
    if layer.kind == LayerKind.DECODER_SELF:
        assert plan.prepared.target is not None
        return plan.prepared.target.tokens
    return plan.prepared.batch.tokens


def offsets(plan: Plan, layer: ModelLayer) -> tuple[list[int], list[int]]:
    source = plan.prepared.offsets
    target = plan.prepared.target_offsets or [0] * len(source)
    if layer.kind == LayerKind.SELF:
        return source, source
    if layer.kind == LayerKind.CROSS:
        return target, source
    return target, target


HEAD_FIELDS = ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads",
               "num_heads", "n_head", "n_heads")
LAYER_FIELDS = ("num_hidden_layers", "encoder_layers", "decoder_layers", "num_layers",
                "num_decoder_layers", "n_layer", "n_layers")


def config_count(config: Any, names: tuple[str, ...]) -> int:
    """The largest positive count config.json gives under any of `names` (0: none)."""
    return max((value for name in names if isinstance(value := getattr(config, name, None), int)
                and value > 0), default=0)


def expected_shown(opened: OpenedModel, spec: str | None, targets: bool
                   ) -> tuple[int, int] | None:
    """(layers a --layer spec shows, heads per layer) by config.json alone, before the weights
    load; None where the config does not say (the probe counts them after loading)."""
    config = opened.config
    heads = config_count(config, HEAD_FIELDS)
    if opened.encoder_decoder:
        encoder = config_count(config, ("encoder_layers", "num_layers", "num_hidden_layers"))
        decoder = config_count(config, ("decoder_layers", "num_decoder_layers")) or encoder
        stacks = {"enc": encoder} | ({"dec": decoder, "cross": decoder} if targets else {})
    else:
        stacks = {"": config_count(config, LAYER_FIELDS)}
    if not heads or not all(stacks.values()) or opened.tower is not None:
        return None
    try:
        chosen = parse_stack_layers(spec, stacks)
    except UsageError:
        return None  # the run words a bad --layer with the model's own numbering
    return (sum(stacks.values()) if chosen is None else len(chosen)), heads
