"""A model opened for one run with every limit checked before its weights load: the inputs'
lengths against --max-tokens and the model's positions, and a figure's panel count against the
layers and heads config.json describes."""

from __future__ import annotations

from collections.abc import Callable

from attnviz.compute.inputs import DEFAULT_MAX_TOKENS
from attnviz.sources.hf.inputs import Encoded, encode
from attnviz.sources.hf.layers import expected_shown
from attnviz.sources.hf.load import LoadedModel, check_load_options, load_weights, open_model


def load_checked(spec: str, sentences: list[str], *, targets: list[str] | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, device: str = "cpu",
                 dtype: str = "float32", device_map: str | None = None,
                 layer: str | None = None,
                 check_shown: Callable[[int, int], None] | None = None
                 ) -> tuple[LoadedModel, Encoded]:
    """The model and its encoded inputs. check_shown(layers, heads), when given, is called with
    the layers `layer` shows and their heads as config.json counts them, before the weights
    load (where the config does not say, the caller checks after the probe)."""
    check_load_options(device, dtype, device_map)
    opened = open_model(spec)
    encoded = encode(opened, sentences, targets, max_tokens)
    if check_shown is not None:
        shown = expected_shown(opened, layer, targets is not None)
        if shown is not None:
            check_shown(*shown)
    return load_weights(opened, device, dtype, device_map), encoded
