"""The heatmap sources, by `SourceSpec.kind`: adding a source is one module implementing
`attnviz.app.heatmap_sources.HeatmapSource`, registered here."""

from __future__ import annotations

from typing import Any

from attnviz.app.heatmap_sources import HeatmapSource
from attnviz.app.source_layers import BundledModel, CheckpointLayer, RandomLayer
from attnviz.app.source_model import HfModel

SOURCES: dict[str, HeatmapSource[Any]] = {
    "bundled": BundledModel(),
    "weights": CheckpointLayer(),
    "random": RandomLayer(),
    "model": HfModel(),
}
