"""The `--random` source's layer: a freshly initialized, seeded nn.MultiheadAttention."""

from __future__ import annotations

from attnviz.core.layer import AttentionLayer, divisor_choices
from attnviz.core.request import HeadHints, RandomSpec
from attnviz.errors import UsageError, option
from attnviz.load.store import DictStore, TensorStore
from attnviz.recognize import find_layers

MAX_RANDOM_DIM = 8192  # a (3E, E) float32 in_proj is 800 MB at E = 8192


def check_random_spec(spec: RandomSpec) -> None:
    """Validate before torch sees the numbers (its own check is an assert, gone under -O)."""
    for flag, value in (("embed_dim", spec.embed_dim), ("num_heads", spec.num_heads),
                        ("kdim", spec.kdim), ("vdim", spec.vdim)):
        if value is not None and value <= 0:
            raise UsageError(f"{option(flag)} must be a positive integer, got {value}",
                             option=flag)
        if value is not None and value > MAX_RANDOM_DIM:
            raise UsageError(f"{option(flag)} {value} is larger than {MAX_RANDOM_DIM}",
                             option=flag)
    if spec.embed_dim % spec.num_heads:
        choices = divisor_choices(spec.embed_dim)
        raise UsageError(
            f"embed_dim {spec.embed_dim} is not divisible by num_heads {spec.num_heads} "
            f"(head_dim would be {spec.embed_dim / spec.num_heads:.2f})",
            fix=f"choose {option('num_heads')} from {choices}", option="num_heads")


def random_mha(spec: RandomSpec) -> tuple[AttentionLayer, TensorStore]:
    """A real torch.nn.MultiheadAttention with torch's own initialization, seeded."""
    import torch

    check_random_spec(spec)
    torch.manual_seed(spec.seed)
    mha = torch.nn.MultiheadAttention(spec.embed_dim, spec.num_heads, bias=spec.bias,
                                      add_bias_kv=spec.add_bias_kv, kdim=spec.kdim,
                                      vdim=spec.vdim, batch_first=True)
    if spec.bias:
        # torch starts biases at zero, which would hide the bias slices; give them values.
        with torch.no_grad():
            mha.in_proj_bias.normal_(0.0, 0.1)
            mha.out_proj.bias.normal_(0.0, 0.1)
    store = DictStore(mha.state_dict(), source=_random_name(spec), fmt="random init")
    inventory = find_layers(store, HeadHints(num_heads=spec.num_heads))
    return inventory.layers[0], store


def _random_name(spec: RandomSpec) -> str:
    extra = "".join(f", {k}={v}" for k, v in (("kdim", spec.kdim), ("vdim", spec.vdim)) if v)
    return (f"nn.MultiheadAttention({spec.embed_dim}, {spec.num_heads}{extra}, "
            f"bias={spec.bias}), seed {spec.seed}")
