"""Honest standalone layers: their real index in the checkpoint, a note that their maps come
from synthetic inputs, and a warning when -H disagrees with the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.core.request import HeadHints

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.core.layer import AttentionLayer
    from attnviz.load.store import TensorStore

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt",
                   "vocab.json", "sentencepiece.bpe.model")
HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")


def renumber(attention_run: AttentionRun, index: int) -> AttentionRun:
    """A standalone layer runs alone; its maps, statistics and export keys carry the index
    `inspect` gives it in its checkpoint (`--layer 3` shows L3), not 0."""
    from dataclasses import replace

    layers = []
    for captured in attention_run.layers:
        kept = captured.streamed
        if kept is not None:
            kept = replace(kept, views=[replace(view, layer=index) for view in kept.views],
                           stats=[replace(stat, layer=index) for stat in kept.stats])
        layers.append(replace(captured, index=index, label=str(index), streamed=kept))
    return replace(attention_run, layers=tuple(layers))


def model_folder(store: TensorStore, weights: Path | None) -> Path | None:
    """The folder that `--model` could load instead: config.json and tokenizer files."""
    folder = store.folder or (None if weights is None else
                              weights if weights.is_dir() else weights.parent)
    if folder is None or not (folder / "config.json").is_file():
        return None
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


def synthetic_note(store: TensorStore, weights: Path | None, index: int) -> str:
    """Plain words for what a standalone layer's maps are, and where the real ones come from."""
    import shlex

    from attnviz.errors import printable

    note = (f"synthetic inputs: these maps are layer {index}'s weights applied to the vectors "
            "above, not to the hidden states the model feeds that layer, so they are not the "
            "model's own attention")
    folder = model_folder(store, weights)
    if folder is not None:
        note += (f"; for that, run the model: attnviz heatmap --model "
                 f"{shlex.quote(printable(str(folder), 200))} …")
    return note


def head_hint_warnings(store: TensorStore, hints: HeadHints, layer_spec: str | None,
                       chosen: AttentionLayer) -> list[str]:
    """-H that disagrees with the checkpoint's own head count (config.json or metadata)."""
    from attnviz.errors import AttnvizError, printable
    from attnviz.recognize import select_layer
    from attnviz.sources.registry import find_inventory

    try:
        own = select_layer(find_inventory(store, HeadHints(None, hints.num_kv_heads,
                                                           hints.head_dim)),
                           layer_spec, store.source)
    except AttnvizError:
        return []
    if not own.heads_known or own.num_heads == hints.num_heads:
        return []
    key = next((k for k in HEADS_KEYS if isinstance(store.config.get(k), int)), None)
    said = f"config.json's {key} = {store.config[key]}" if key else \
        f"the checkpoint's own {own.num_heads}"
    return [f"-H {hints.num_heads} disagrees with {said} for layer "
            f"{printable(chosen.name)!r}: the maps split it into {hints.num_heads} heads of "
            f"d = {chosen.head_dim}, not the model's {own.num_heads} heads"]
