"""What a run is called in a figure's title: the model (not a raw path) and its layers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun

GENERIC_NAMES = ("model", "models", "checkpoint", "checkpoints", "weights", "final")
GENERIC_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")


def display_name(source: str) -> str:
    """A model's name from its path: the folder (a hub snapshot's repository id), the file's
    name when it says more than 'model.safetensors', a generic folder with its parent."""
    path = Path(source)
    if path.name in GENERIC_FILES:
        path = path.parent
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    if path.name.lower() in GENERIC_NAMES and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name or source


def run_title(run: AttentionRun) -> str:
    from attnviz.sources.bundled import is_tiny_model

    store = run.store
    if store is None:  # a model run: the layers were captured from the model itself
        name = display_name(run.source)
    elif is_tiny_model(store):
        name = "the bundled induction model"
    elif store.format == "random init":
        name = run.source
    else:
        name = display_name(run.source)
        kind = store.config.get("model_type")
        name += f" ({kind})" if isinstance(kind, str) else ""
    indices = [captured.index for captured in run.layers]
    labels = [captured.label for captured in run.layers]
    if len(indices) == 1:
        shown = run.layers[0].name
        where = f"layer {labels[0]}" + (f" ({shown})" if shown else "")
    elif labels != [str(i) for i in indices]:  # an encoder-decoder's stacks: enc 0, cross 1, …
        where = "layers " + ", ".join(labels)
    elif indices == list(range(indices[0], indices[-1] + 1)):
        where = f"layers {indices[0]}–{indices[-1]}"
    else:
        where = "layers " + ", ".join(map(str, indices))
    return f"{name} · {where}"
