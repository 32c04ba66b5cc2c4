"""`--generate` for models outside transformers' attention interface (BLOOM, Falcon, ...):
the maps `generate(output_attentions=True)` and a forward with output_attentions return, added
to a generation's Steps under stable names (`enc.N`, `dec.N`, `cross.N`, `attentions.N`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from attnviz.core.choices import LayerKind

if TYPE_CHECKING:
    import torch


class Steps(Protocol):
    """What collects the blocks (attnviz.sources.hf.generate.Steps)."""

    def add(self, name: str, kind: LayerKind, weights: torch.Tensor,
            call: int | None = None) -> None: ...


def add_returned(steps: Steps, maps: Any, kind: LayerKind, stack: str) -> None:
    """Each layer's returned map as one block of its module."""
    for i, weights in enumerate(maps or ()):
        steps.add(f"{stack}.{i}" if stack else f"attentions.{i}", kind, weights)


def add_generate_attentions(steps: Steps, out: Any) -> None:
    """generate(output_attentions=True): per step, a tuple of per-layer maps."""
    if getattr(out, "decoder_attentions", None) is not None:
        for step, self_maps in enumerate(out.decoder_attentions):
            add_returned(steps, self_maps, LayerKind.DECODER_SELF, "dec")
            add_returned(steps, out.cross_attentions[step], LayerKind.CROSS, "cross")
        return
    for per_layer in out.attentions or ():
        add_returned(steps, per_layer, LayerKind.SELF, "")


def add_forward_attentions(steps: Steps, result: Any) -> None:
    if getattr(result, "decoder_attentions", None) is not None:
        add_returned(steps, result.decoder_attentions, LayerKind.DECODER_SELF, "dec")
        add_returned(steps, result.cross_attentions, LayerKind.CROSS, "cross")
    else:
        add_returned(steps, result.attentions, LayerKind.SELF, "")
