"""Files the commands need at run time, shipped inside the package (found with
importlib.resources, so a wheel or any install prefix carries them): `induction.safetensors`,
the bundled model that `attnviz heatmap` runs by default (written by
sample_weights/train_induction.py; see sample_weights/NOTES_induction.md).

No torch here: the CLI resolves the bundled model's path (to keep outputs off it) before the
run imports torch."""

from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path

_EXTRACTED = contextlib.ExitStack()  # a copy made for an install that is not plain files (a zip)
atexit.register(_EXTRACTED.close)


def _locate() -> Path:
    """The bundled model's file, wherever attnviz is installed (a checkout, a wheel, another
    prefix): package data found through importlib.resources, as a real path."""
    resource = resources.files("attnviz.data").joinpath("induction.safetensors")
    return Path(_EXTRACTED.enter_context(resources.as_file(resource)))


BUNDLED = _locate()
