"""The --layer grammar for models: which layers of a model a run shows."""

from __future__ import annotations

from attnviz.errors import UsageError


def parse_layers(spec: str | None, available: int) -> list[int] | None:
    """--layer for a model: None (all), "all", "N", "-1" or "A:B" (B exclusive)."""
    if spec is None or spec == "all":
        return None
    try:
        if ":" in spec:
            start_text, stop_text = spec.split(":", 1)
            start = int(start_text) if start_text else 0
            stop = int(stop_text) if stop_text else available
            chosen = list(range(available))[start:stop]
        else:
            index = int(spec)
            if not -available <= index < available:
                raise IndexError
            chosen = [index % available]
    except (ValueError, IndexError):
        raise UsageError(f"--layer {spec!r} is not a layer of this model",
                         fix=f"use all, 0..{available - 1}, -1 or A:B", option="--layer") from None
    if not chosen:
        raise UsageError(f"--layer {spec!r} selects no layer", fix=f"the model has {available}",
                         option="--layer")
    return chosen
