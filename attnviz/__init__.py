"""attnviz: see how multi-head attention splits its projections, on any weights.

The public API (`__all__`) is loaded on first use, so `import attnviz` and `attnviz --help` stay
instant: torch is imported only when a function that needs it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AttnvizError",
    "CheckFailed",
    "CheckpointError",
    "Circuits",
    "Heatmap",
    "Split",
    "UsageError",
    "attribute",
    "circuits",
    "compare",
    "corpus",
    "find_layers",
    "inspect",
    "lens",
    "open_checkpoint",
    "patch",
    "run_heatmap",
    "run_model",
    "split",
    "tokens",
]

_ERRORS = {"AttnvizError", "CheckFailed", "CheckpointError", "UsageError"}

if TYPE_CHECKING:
    from attnviz.api import (
        Circuits,
        Heatmap,
        Split,
        attribute,
        circuits,
        compare,
        corpus,
        find_layers,
        inspect,
        lens,
        open_checkpoint,
        patch,
        run_heatmap,
        run_model,
        split,
        tokens,
    )
    from attnviz.errors import AttnvizError, CheckFailed, CheckpointError, UsageError


def __getattr__(name: str) -> Any:
    if name in _ERRORS:
        from attnviz import errors

        return getattr(errors, name)
    if name in __all__:
        from attnviz import api

        return getattr(api, name)
    raise AttributeError(f"module 'attnviz' has no attribute {name!r}")
