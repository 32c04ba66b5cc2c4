"""What every figure shares: a matplotlib Figure on an Agg canvas (no pyplot globals, no display
needed), text made safe for it, and writing it atomically."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnviz.app.outputs import atomic_output
from attnviz.errors import printable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
FIGURE_DPI = 100


def new_figure(width: float, height: float, constrained: bool = True,
               dpi: int = FIGURE_DPI) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi,
                 layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def label(text: str, limit: int | None = None) -> str:
    """Figure text from a file or the user: escaped and shortened. Every text artist is also
    created with parse_math=False, so `$\\frac` in a name is drawn as it is, never parsed."""
    shown = printable(text, None)
    return shown if limit is None else shown[:limit]


def save_figure(fig: Figure, path: Path) -> None:
    """Write atomically: a failure leaves no partial file. matplotlib's font warnings (a glyph
    missing for a token's script) stay off stderr."""
    import logging
    import warnings

    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with atomic_output(path) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.savefig(tmp, format=path.suffix.lstrip(".").lower())
    finally:
        logger.setLevel(level)
