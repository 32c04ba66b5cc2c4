"""What every figure shares: a matplotlib Figure on an Agg canvas (no pyplot globals, no display
needed), text made safe for it, and drawing it into a file (the caller makes the write atomic:
`attnviz.app.outputs.write_output`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from attnviz.errors import UsageError, option, printable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
FIGURE_DPI = 100
PNG_COMPRESS_LEVEL = 1  # zlib's fastest: flat-coloured panels compress as small as at 6
MAX_CANVAS_PIXELS = 50_000_000  # width × height in pixels: a 200 MB RGBA canvas

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def isolated_rc() -> Iterator[None]:
    """matplotlib's own defaults, whatever a `matplotlibrc` in the current folder, in
    $MATPLOTLIBRC or in $MPLCONFIGDIR says (model repositories ship them: `savefig.dpi: 3000`,
    `savefig.bbox: tight`, `figure.figsize`, `text.usetex` would change what attnviz writes)."""
    import matplotlib

    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        yield


def isolated(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a figure builder under `isolated_rc`: every artist takes matplotlib's defaults."""
    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with isolated_rc():
            return function(*args, **kwargs)
    return wrapper


def check_canvas(width: float, height: float, dpi: float) -> None:
    """One cap on the canvas, width × height × dpi², checked before anything is drawn."""
    pixels = width * dpi * height * dpi
    if not pixels <= MAX_CANVAS_PIXELS:
        raise UsageError(
            f"the figure would be {width * dpi:,.0f} × {height * dpi:,.0f} pixels "
            f"({width:.1f} × {height:.1f} in at {dpi:g} dpi), more than the "
            f"{MAX_CANVAS_PIXELS:,} pixels attnviz draws",
            fix=f"lower {option('dpi')} or {option('size')}, or show fewer panels "
                f"({option('head')}, {option('layer')}, {option('average')})")


def new_figure(width: float, height: float, constrained: bool = True,
               dpi: int = FIGURE_DPI) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    check_canvas(width, height, dpi)
    fig = Figure(figsize=(width, height), dpi=dpi,
                 layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def label(text: str, limit: int | None = None) -> str:
    """Figure text from a file or the user: escaped and shortened. Every text artist is also
    created with parse_math=False, so `$\\frac` in a name is drawn as it is, never parsed."""
    shown = printable(text, None)
    return shown if limit is None else shown[:limit]


def save_figure(fig: Figure, path: Path, named: Path | None = None) -> None:
    """Draw `fig` into `path`, in the format of `named`'s suffix (default: `path`'s). Writes
    `path` directly: outputs go through `app.outputs.write_output`, which hands a temporary
    file beside the real one and moves it into place only when this succeeded. matplotlib's
    font warnings (a glyph missing for a token's script) stay off stderr."""
    import logging
    import warnings

    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fmt = (named or path).suffix.lstrip(".").lower()
            with isolated_rc():  # savefig.dpi, .bbox, .pad_inches … from matplotlib's defaults
                if fmt == "png":
                    path.write_bytes(png_bytes(fig))
                else:
                    fig.savefig(path, format=fmt, dpi=fig.dpi)
    finally:
        logger.setLevel(level)


def png_bytes(fig: Figure) -> bytes:
    """The figure drawn on its Agg canvas, as PNG: the pixels `fig.savefig(…, format="png")`
    writes (its default bbox, dpi and face colour), encoded here. Pillow's encoder, which
    savefig uses, tries five row filters on every row, which is most of a wide grid's saving
    time even at its fastest zlib level; these flat-coloured panels compress as well without
    filters. An opaque figure is written as RGB (a quarter fewer bytes to compress)."""
    import struct
    import zlib

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())  # (height, width, 4) uint8
    height, width = rgba.shape[:2]
    opaque = bool((rgba[..., 3] == 255).all())
    pixels = rgba[..., :3] if opaque else rgba
    rows = np.empty((height, 1 + pixels.shape[1] * pixels.shape[2]), dtype=np.uint8)
    rows[:, 0] = 0  # filter type 0 (none) on every row
    rows[:, 1:] = pixels.reshape(height, -1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 2 if opaque else 6, 0, 0, 0)
    dots_per_metre = round(fig.dpi / 0.0254)  # the dpi, as savefig records it
    return b"".join((b"\x89PNG\r\n\x1a\n", chunk(b"IHDR", header),
                     chunk(b"pHYs", struct.pack(">IIB", dots_per_metre, dots_per_metre, 1)),
                     chunk(b"IDAT", zlib.compress(rows.tobytes(), PNG_COMPRESS_LEVEL)),
                     chunk(b"IEND", b"")))
