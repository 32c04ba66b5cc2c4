"""What a command reads, resolved before any work so no output can overwrite it."""

from __future__ import annotations

from pathlib import Path

from attnviz.app.outputs import ReadSet, read_set


def inputs_read(weights: Path | None, model: str | None, file: Path | None,
                bundled: bool) -> ReadSet:
    """Every file a run will read (a --weights/--model folder whole), for the output checks."""
    if file is not None and str(file) == "-":  # standard input: whatever file it comes from
        file = Path("/dev/stdin")
    files = [p for p in (weights, file) if p is not None]
    folders = [p for p in files if p.is_dir()]
    if model is not None:
        folder = Path(model).expanduser()
        if not folder.is_dir():  # a hub id: its snapshot folder in the local cache
            from attnviz.sources import hf

            folder = hf.resolve_folder(model)
        folders.append(folder)
    if bundled:
        from attnviz.sources.bundled import BUNDLED

        files.append(BUNDLED)
    return read_set(files, folders)
