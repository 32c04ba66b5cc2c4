"""Where `attnviz circuits` finds its layers (the same sources and layer grammar as `split` and
`heatmap`), how it orders them into stacks for composition, and which norm scale γ feeds each."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.core.request import HeadHints, RandomSpec
from attnviz.core.selection import parse_stack_layers
from attnviz.errors import UsageError, option, quoted
from attnviz.recognize.match import role_of

if TYPE_CHECKING:
    from attnviz.core.layer import AttentionLayer
    from attnviz.load.store import TensorStore

# Norms that feed an attention module, by name beside it (or beside its parent): pre-norm
# LayerNorm/RMSNorm of GPT-2, LLaMA and its kin, NeoX, BLOOM, Falcon, T5, ViT, CLIP, timm and
# the bundled model. Post-norm models (BERT, BART) have none beside their attention.
NORM_NAMES = ("ln", "ln_1", "input_layernorm", "ln_attn", "attention_norm", "attn_norm",
              "layer_norm", "layernorm_before", "layer_norm1", "norm1")
STACK_OF_ROLE = {"encoder": "enc", "decoder": "dec", "cross": "cross", "self": ""}


@dataclass(frozen=True)
class ChosenLayer:
    index: int  # as `attnviz inspect` numbers it
    layer: AttentionLayer
    stack: str  # "" (one stack), "enc", "dec" or "cross"
    number: int  # within its stack, as --layer numbers it
    order: tuple[int, int]  # (block, 0 self | 1 cross): position along the stack's residual

    @property
    def label(self) -> str:
        return f"{self.stack} {self.number}" if self.stack else str(self.number)

    @property
    def residual(self) -> str:
        """The residual stream the layer writes into: cross-attention writes the decoder's."""
        return "dec" if self.stack == "cross" else self.stack


def open_source(weights: Path | None, model: str | None, random: RandomSpec | None,
                hints: HeadHints) -> tuple[list[AttentionLayer], TensorStore, str]:
    """(every recognized layer in inspect's order, the store, the source's kind), opened
    through the one registry (`attnviz.sources.registry`)."""
    from attnviz.core.request import SourceSpec
    from attnviz.sources.registry import SourceKind, open_source, source_kind

    spec = SourceSpec(weights=weights, model=model, random=random, hints=hints)
    kind = source_kind(spec)  # more than one source is refused there
    refuse_head_hints(hints, "" if kind is SourceKind.WEIGHTS else kind.value)
    opened = open_source(spec)
    if kind is SourceKind.BUNDLED:
        from attnviz.sources import bundled

        return bundled.tiny_layers(opened.store), opened.store, kind.value
    opened.require_layers()  # none: the reason, as select_layer says it
    return opened.layers, opened.store, kind.value


def refuse_head_hints(hints: HeadHints, kind: str) -> None:
    """Head counts are hints for a checkpoint's layers. A model folder's come from its config,
    the bundled model's are fixed, and a random nn.MultiheadAttention takes its heads from its
    spec (`RandomSpec.num_heads`, which the caller builds from num_heads) with as many key/value
    heads and E / H per head: given there, they are refused, never silently ignored."""
    given = [name for name in ("num_heads", "num_kv_heads", "head_dim")
             if getattr(hints, name) is not None]
    if not given or kind not in ("bundled", "random", "model"):
        return
    names = " and ".join(option(name) for name in given)
    verb = "applies" if len(given) == 1 else "apply"
    if kind == "model":  # as heatmap refuses them there
        raise UsageError(f"{names} {'does' if len(given) == 1 else 'do'} not apply to "
                         f"{option('model')}: the model's own config decides",
                         fix=f"drop {'it' if len(given) == 1 else 'them'}", option=given[0])
    if kind == "bundled":
        raise UsageError(f"{names} {verb} to a checkpoint's layers: the bundled model's head "
                         "counts are its own",
                         fix=f"drop {'it' if len(given) == 1 else 'them'}, or pass "
                         f"{option('weights')} or {option('model')}", option=given[0])
    raise UsageError(f"{names} {verb} to a checkpoint's layers: the random "
                     "nn.MultiheadAttention has as many key/value heads as heads, each "
                     f"{option('embed_dim')} / {option('num_heads')} wide",
                     fix=f"drop {'it' if len(given) == 1 else 'them'}; size the random layer "
                     f"with {option('embed_dim')} and {option('num_heads')}", option=given[0])


def choose(layers: list[AttentionLayer], spec: str | None, source: str) -> list[ChosenLayer]:
    """The layers `spec` selects: a layer name, or the --layer grammar (all, N, -1, A:B, and
    'enc N', 'dec N', 'cross N' for encoder-decoder models), in stack order."""
    roles = [STACK_OF_ROLE[role_of(layer.name)] for layer in layers]
    if len(set(roles)) == 1:
        roles = [""] * len(layers)
    numbered: list[ChosenLayer] = []
    counts: dict[str, int] = {}
    for index, (layer, stack) in enumerate(zip(layers, roles, strict=True)):
        numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", layer.name)  # the block: first number
        block = int(numbers[0]) if numbers else None
        order = (block if block is not None else counts.get(stack, 0), int(stack == "cross"))
        numbered.append(ChosenLayer(index, layer, stack, counts.get(stack, 0), order))
        counts[stack] = counts.get(stack, 0) + 1
    stack_rank = {"": 0, "enc": 1, "dec": 2, "cross": 2}  # a decoder block: self, then cross
    numbered.sort(key=lambda c: (stack_rank[c.stack], c.order, c.index))
    if spec is not None:
        named = [c for c in numbered if c.layer.name == spec.rstrip(".") and c.layer.name]
        if named:
            return named
    try:
        pairs = parse_stack_layers(spec, {s: counts[s] for s in ("", "enc", "dec", "cross")
                                          if s in counts})
    except UsageError as exc:
        raise UsageError(exc.what, fix=exc.fix + " (or a layer's name, see 'attnviz inspect')",
                         where=source, option="layer") from None
    if pairs is None:
        return numbered
    wanted = set(pairs)
    return [c for c in numbered if (c.stack, c.number) in wanted]


def check_heads(chosen: list[ChosenLayer]) -> None:
    for c in chosen:
        if not c.layer.heads_known:
            raise UsageError(f"the number of heads of layer {quoted(c.layer.name)} is unknown",
                             fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} for "
                             "grouped-query layers)",
                             option="num_heads")


@dataclass(frozen=True)
class NormScale:
    key: str  # the norm's weight in the checkpoint
    kind: str  # "LayerNorm" or "RMSNorm"
    offset: float  # Gemma's RMSNorm scales by (1 + weight)

    def describe(self) -> str:
        shown = f"1 + {self.key}" if self.offset else self.key
        return f"γ = {shown} ({self.kind})"


def norm_scale(store: TensorStore, layer: AttentionLayer) -> NormScale | None:
    """The scale vector of the norm whose output this attention layer reads, where a name
    beside it (or beside its parent module) says so; None when none is recognized."""
    parts = layer.name.split(".") if layer.name else []
    for up in (1, 2):
        if len(parts) < up:
            break
        parent = ".".join(parts[:-up])
        for name in NORM_NAMES:
            key = f"{parent}.{name}.weight" if parent else f"{name}.weight"
            if key in store and tuple(store.info(key).shape) == (layer.embed_dim,):
                bias = key.removesuffix("weight") + "bias"
                gemma = str(store.config.get("model_type", "")).startswith("gemma")
                return NormScale(key, "LayerNorm" if bias in store else "RMSNorm",
                                 1.0 if gemma else 0.0)
    return None
