"""How heatmap runs each kind of source, keyed by `SourceKind`'s value (`SourceSpec.kind`): a
runner implementing `attnviz.app.heatmap_sources.HeatmapSource`. Every runner opens its source
through the one registry, `attnviz.sources.registry.open_source`."""

from __future__ import annotations

from typing import Any

from attnviz.app.heatmap_sources import HeatmapSource
from attnviz.app.source_layers import BundledModel, CheckpointLayer, RandomLayer
from attnviz.app.source_model import HfModel
from attnviz.sources.registry import SourceKind

SOURCES: dict[str, HeatmapSource[Any]] = {
    SourceKind.BUNDLED.value: BundledModel(),
    SourceKind.WEIGHTS.value: CheckpointLayer(),
    SourceKind.RANDOM.value: RandomLayer(),
    SourceKind.MODEL.value: HfModel(),
}
# every kind the registry opens has a heatmap runner
assert set(SOURCES) == {kind.value for kind in SourceKind}
