"""What a command reads, resolved before any work so no output can overwrite it, and how it
writes a drawn figure or page (through app.outputs' one writer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
            from attnviz.sources.hf.load import resolve_folder

            folder = resolve_folder(model)
        folders.append(folder)
    if bundled:
        from attnviz.data import BUNDLED

        files.append(BUNDLED)
    return read_set(files, folders)


def write_figure(fig: Figure, path: Path) -> None:
    """A figure into `path` through the one output writer (atomic: no partial file)."""
    from attnviz.app.outputs import write_output
    from attnviz.render.figure_io import save_figure

    write_output(path, lambda tmp: save_figure(fig, tmp, named=path))


def write_page(page: str, path: Path) -> None:
    """A self-contained HTML page into `path`, atomically."""
    from attnviz.app.outputs import write_output

    write_output(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))


def preload_matplotlib() -> None:
    """Import matplotlib's figure machinery in a background thread while the attention runs
    (torch's kernels release the GIL): a figure's first ~0.6 s are imports. The import lock
    makes the drawing thread wait for a half-done import, never see one."""
    import threading

    def load() -> None:
        try:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.colorbar  # noqa: F401
            import matplotlib.figure  # noqa: F401
        except Exception:  # noqa: BLE001 - the drawing thread imports again and reports it
            pass

    threading.Thread(target=load, name="attnviz-preload", daemon=True).start()
