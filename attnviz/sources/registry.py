"""The one place a source is opened: every command (inspect, split, heatmap, circuits, the
generation and scorecard paths, and the Python API through them) turns its source options (a
`SourceSpec`) into an `OpenedSource` here, through `open_source`.

One function means one inventory of layers: a checkpoint's layers are found by the naming table
and, where it knows no row, by building the model from config.json on the meta device
(`attnviz.sources.discover`). So a checkpoint `attnviz inspect` lists is read the same way by
every command that accepts it; before this registry, heatmap's checkpoint path read the table
alone and refused a CTRL checkpoint the other commands ran.

Adding a kind of source: a `SourceKind` member, a class with `open(spec) -> OpenedSource`, and
its row in `SOURCES`; `source_kind` says when its option is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from attnviz.core.request import HeadHints, SourceSpec
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.core.layer import AttentionLayer
    from attnviz.load.store import TensorStore
    from attnviz.recognize import Inventory
    from attnviz.sources.hf.load import OpenedModel


class SourceKind(str, Enum):
    """Where attention comes from; the value is `SourceSpec.kind`'s word."""

    BUNDLED = "bundled"  # the bundled 2-layer model (attnviz/data)
    RANDOM = "random"  # a seeded, freshly initialized nn.MultiheadAttention
    WEIGHTS = "weights"  # a checkpoint file or folder (--weights)
    MODEL = "model"  # a Hugging Face model folder or cached hub id (--model)


@dataclass
class OpenedSource:
    """A source opened: headers only until a layer's tensors are read. `store` and `inventory`
    are read on first use, so a command that needs only the folder (a model's own forward pass)
    reads nothing more."""

    kind: SourceKind
    hints: HeadHints
    folder: Path | None = None  # the checkpoint or model folder (None: bundled, random)
    _store: TensorStore | None = field(default=None, repr=False)
    _inventory: Inventory | None = field(default=None, repr=False)

    @cached_property
    def store(self) -> TensorStore:
        if self._store is None:
            from attnviz.load.checkpoint import open_checkpoint

            assert self.folder is not None
            self._store = open_checkpoint(self.folder)
        return self._store

    @cached_property
    def inventory(self) -> Inventory:
        """Every attention layer, with discovery where the naming table knows no row."""
        if self._inventory is None:
            self._inventory = find_inventory(self.store, self.hints)
        return self._inventory

    @property
    def layers(self) -> list[AttentionLayer]:
        return self.inventory.layers

    def select(self, spec: str | None) -> AttentionLayer:
        """One layer by the --layer grammar or its name (a clear error for none)."""
        from attnviz.recognize import select_layer

        return select_layer(self.inventory, spec, self.store.source)

    def require_layers(self) -> None:
        """Raise the reason when the inventory holds no usable layer."""
        if not self.layers:
            self.select(None)


class Source(Protocol):
    """One kind of source: `open` checks its options and opens it (headers only)."""

    kind: SourceKind

    def open(self, spec: SourceSpec) -> OpenedSource: ...


def find_inventory(store: TensorStore, hints: HeadHints) -> Inventory:
    """The one inventory of a store's layers: the naming table, then discovery (the model built
    from config.json on the meta device) for what no row names."""
    from attnviz.recognize import find_layers
    from attnviz.sources.discover import discover_modules

    return find_layers(store, hints, discover=discover_modules)


class Bundled:
    kind = SourceKind.BUNDLED

    def open(self, spec: SourceSpec) -> OpenedSource:
        from attnviz.sources import bundled

        return OpenedSource(self.kind, spec.hints, None, bundled.open_bundled())


class Random:
    kind = SourceKind.RANDOM

    def open(self, spec: SourceSpec) -> OpenedSource:
        from attnviz.sources.random_layer import random_mha

        assert spec.random is not None  # source_kind picks this source for a spec only
        from attnviz.recognize import Inventory

        layer, store = random_mha(spec.random)
        return OpenedSource(self.kind, spec.hints, None, store, Inventory([layer], []))


class Weights:
    kind = SourceKind.WEIGHTS

    def open(self, spec: SourceSpec) -> OpenedSource:
        assert spec.weights is not None
        opened = OpenedSource(self.kind, spec.hints, spec.weights)
        opened.store  # noqa: B018 - a missing or unreadable checkpoint is reported now
        return opened


class Model:
    kind = SourceKind.MODEL

    def open(self, spec: SourceSpec) -> OpenedSource:
        """The folder (a hub id resolved in the local cache once, never downloaded); its
        headers are read when a layer is asked for."""
        assert spec.model is not None
        folder = Path(spec.model).expanduser()
        if not folder.is_dir():
            from attnviz.sources.hf.load import resolve_folder

            folder = resolve_folder(spec.model)
        return OpenedSource(self.kind, spec.hints, folder)


SOURCES: dict[SourceKind, Source] = {source.kind: source for source in
                                     (Bundled(), Random(), Weights(), Model())}


def source_kind(spec: SourceSpec) -> SourceKind:
    """The kind of source the options ask for; more than one source is a usage error (said
    here, once, for every command)."""
    given = [name for name, value in (("weights", spec.weights), ("model", spec.model),
                                      ("random", spec.random)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{option('weights')}, {option('model')} and a random layer's options "
                         "exclude each other", fix="choose one source")
    return SourceKind(spec.kind)


def open_source(spec: SourceSpec) -> OpenedSource:
    """The source `spec` names, opened through its registered kind."""
    return SOURCES[source_kind(spec)].open(spec)


def open_model_source(spec: SourceSpec) -> OpenedModel:
    """A --model source opened for the model's own forward pass (heatmap, the generation and
    scorecard paths): the registry's folder, then its config.json, tokenizer and shapes checked
    (`attnviz.sources.hf.load.open_model`); no weights read yet."""
    opened = open_source(spec)
    if opened.kind is not SourceKind.MODEL or opened.folder is None:
        raise ValueError(f"a {opened.kind.value} source has no model to open")
    from attnviz.sources.hf.load import open_model

    return open_model(str(opened.folder))
