"""The one normalized description of an attention layer, whatever checkpoint layout it came from.

Conventions used everywhere in attnviz:
- weights are in `(out, in)` orientation, as `nn.Linear.weight`: y = x · Wᵀ + b;
- W_q is `(H·d, E)`, W_k `(H_kv·d, kdim)`, W_v `(H_kv·d, vdim)`, W_o `(E, H·d)`;
- query head h owns rows `h·d:(h+1)·d` of W_q and columns `h·d:(h+1)·d` of W_o;
- key/value head g owns rows `g·d:(g+1)·d` of W_k and W_v; query head h uses kv head
  `h // (H / H_kv)`;
- attention maps are `(batch, head, query_pos, key_pos)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# TensorRef and its row ranges are part of this vocabulary; they live in their own module.
from attnviz.core.tensor_ref import TensorRef
from attnviz.errors import HeadCountError, LayoutError, UsageError, option


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: geometry plus references to its weights (no tensor data)."""

    name: str  # checkpoint prefix, e.g. "encoder.layer.0.attention"
    family: str  # layout family that recognized it, e.g. "bert"
    embed_dim: int  # E: width of the query input and of the output
    kdim: int  # width of the key input (E for self-attention)
    vdim: int  # width of the value input
    num_heads: int | None  # H; None when the checkpoint does not say
    num_kv_heads: int | None  # H_kv (< H for grouped-query attention)
    head_dim: int | None  # d
    q_weight: TensorRef  # W_q (H·d, E)
    k_weight: TensorRef  # W_k (H_kv·d, kdim)
    v_weight: TensorRef  # W_v (H_kv·d, vdim)
    o_weight: TensorRef  # W_o (E, H·d)
    q_bias: TensorRef | None = None
    k_bias: TensorRef | None = None
    v_bias: TensorRef | None = None
    o_bias: TensorRef | None = None
    bias_k: TensorRef | None = None  # nn.MHA add_bias_kv: one extra key position
    bias_v: TensorRef | None = None
    scale: float | None = None  # multiplies q·kᵀ; None means 1/√d
    causal: bool = False
    positions: str = "none"  # how position enters attention: none, learned, rope, alibi, relative
    storage: str = "separate"  # how q/k/v are stored: separate, packed [q; k; v], interleaved, ...
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def extra_keys(self) -> int:
        """Columns after the real keys in each of its maps: bias_k's one learned key, else 0."""
        return 1 if self.bias_k is not None else 0

    @property
    def heads_known(self) -> bool:
        return self.num_heads is not None

    @property
    def q_out(self) -> int:
        return self.q_weight.shape[0]

    @property
    def kv_out(self) -> int:
        return self.k_weight.shape[0]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for ordinary multi-head attention)."""
        return self._heads()[0] // self._heads()[1]

    @property
    def effective_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self._head_dim())

    @property
    def is_square(self) -> bool:
        """True when W_q is E × E, i.e. H · d = E as torch.nn.MultiheadAttention requires."""
        return self.q_out == self.embed_dim

    def _heads(self) -> tuple[int, int]:
        if self.num_heads is None or self.num_kv_heads is None:
            raise UsageError(
                f"the number of heads of layer {self.name!r} is unknown",
                fix=f"pass {option('num_heads')} (and {option('num_kv_heads')} for grouped-query "
                "layers)",
            )
        return self.num_heads, self.num_kv_heads

    def _head_dim(self) -> int:
        self._heads()
        assert self.head_dim is not None
        return self.head_dim

    def q_rows(self, head: int) -> tuple[int, int]:
        """Rows of W_q (and of the projected query's features) owned by query head `head`."""
        d = self._head_dim()
        return head * d, (head + 1) * d

    def o_cols(self, head: int) -> tuple[int, int]:
        """Columns of W_o that read query head `head`'s output."""
        return self.q_rows(head)

    def kv_head_of(self, head: int) -> int:
        """The kv head that query head `head` attends with (contiguous groups, as repeat_kv)."""
        return head // self.group_size

    def kv_rows(self, kv_head: int) -> tuple[int, int]:
        """Rows of W_k and W_v owned by key/value head `kv_head`."""
        d = self._head_dim()
        return kv_head * d, (kv_head + 1) * d

    def with_heads(
        self, num_heads: int | None, num_kv_heads: int | None = None, head_dim: int | None = None
    ) -> AttentionLayer:
        """This layer with head counts set, checked against the weight shapes."""
        heads = resolve_heads(self, num_heads, num_kv_heads, head_dim)
        return replace(self, num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2])


MAX_DIVISOR_SEARCH = 10**12  # √ of it is 10⁶ trial divisions; larger numbers are not listed


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(√n); [] when n is too large to search."""
    if n <= 0 or n > MAX_DIVISOR_SEARCH:
        return []
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


def divisor_choices(n: int, shown: int = 16) -> str:
    """"1, 2, 4, …, 64" for a message: at most `shown` divisors, always ending with n."""
    found = divisors(n)
    if not found:
        return f"the divisors of {n}"
    if len(found) > shown:
        return ", ".join(map(str, found[: shown - 1])) + f", …, {n} ({len(found)} divisors)"
    return ", ".join(map(str, found))


def resolve_heads(
    layer: AttentionLayer,
    num_heads: int | None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> tuple[int | None, int | None, int | None]:
    """Check head counts against the shapes and fill in what follows from them.

    Returns (H, H_kv, d), all None when `num_heads` is None: the head count cannot be read off the
    weights, so attnviz never guesses it.
    """
    _check_widths(layer)  # weights first: a short W_o is named, not the bias that fits it
    _check_biases(layer)
    if num_heads is None:
        return None, None, None
    if num_heads <= 0:
        raise UsageError(f"the number of heads must be positive, got {num_heads}")
    head_dim = _head_dim(layer, num_heads, head_dim)
    num_kv_heads = _kv_heads(layer, num_heads, num_kv_heads, head_dim)
    _check_v_and_o(layer)
    return num_heads, num_kv_heads, head_dim


def _head_dim(layer: AttentionLayer, num_heads: int, head_dim: int | None) -> int:
    """d: given, or W_q's rows shared by the heads; it must account for every row."""
    q_out, q_key = layer.q_out, layer.q_weight.describe()
    if head_dim is None:
        if q_out % num_heads:
            choices = divisor_choices(q_out)
            raise HeadCountError(
                f"{q_key} has {q_out} rows, not divisible by {num_heads} heads "
                f"(head_dim would be {q_out / num_heads:.2f})",
                fix=f"choose the number of heads from {choices}",
            )
        head_dim = q_out // num_heads
    if head_dim <= 0 or num_heads * head_dim != q_out:
        raise HeadCountError(
            f"{q_key} has shape {_fmt(layer.q_weight.shape)} but {num_heads} heads × head_dim "
            f"{head_dim} need {num_heads * head_dim} rows",
            fix="check num_heads / head_dim in the config or on the command line",
        )
    return head_dim


def _kv_heads(layer: AttentionLayer, num_heads: int, num_kv_heads: int | None,
              head_dim: int) -> int:
    """H_kv: given, or W_k's rows in heads of d; it must divide H evenly."""
    kv_out = layer.kv_out
    if num_kv_heads is None:
        if kv_out % head_dim:
            raise HeadCountError(
                f"{layer.k_weight.describe()} has {kv_out} rows, "
                f"not a multiple of head_dim {head_dim}",
                fix="check num_heads / head_dim in the config or on the command line",
            )
        num_kv_heads = kv_out // head_dim
    if num_kv_heads <= 0 or num_kv_heads * head_dim != kv_out:
        raise HeadCountError(
            f"{layer.k_weight.describe()} has shape {_fmt(layer.k_weight.shape)} but "
            f"{num_kv_heads} key/value heads × head_dim {head_dim} "
            f"need {num_kv_heads * head_dim} rows",
            fix=f"check num_key_value_heads in the config or {option('num_kv_heads')}",
        )
    if num_heads % num_kv_heads:
        raise HeadCountError(
            f"{num_heads} query heads cannot be shared evenly by {num_kv_heads} key/value heads",
            fix="check num_heads and num_kv_heads",
        )
    return num_kv_heads


def _check_v_and_o(layer: AttentionLayer) -> None:
    """W_v has W_k's rows and W_o reads H·d columns, whatever the head counts."""
    if layer.v_weight.shape[0] != layer.kv_out:
        ref = layer.v_weight
        raise LayoutError(
            f"{ref.describe()} has shape {_fmt(ref.shape)}, expected "
            f"{_fmt((layer.kv_out, *ref.shape[1:]))}: {layer.kv_out} rows like W_k",
            fix="the checkpoint is inconsistent",
        )
    if layer.o_weight.shape[1] != layer.q_out:
        raise LayoutError(
            f"{layer.o_weight.describe()} has shape {_fmt(layer.o_weight.shape)}, expected "
            f"{_fmt((layer.o_weight.shape[0], layer.q_out))}: {layer.q_out} columns (H·d), "
            f"as {layer.q_weight.describe()} has rows",
            fix="the checkpoint is inconsistent",
        )


def _check_widths(layer: AttentionLayer) -> None:
    """W_o writes back into the stream W_q reads: its rows equal W_q's input width E. A W_q one
    input column short (E-1) otherwise passes every row count and fails only inside a forward."""
    if layer.o_weight.shape[0] != layer.embed_dim:
        raise LayoutError(
            f"{layer.o_weight.describe()} has shape {_fmt(layer.o_weight.shape)}, expected "
            f"({layer.embed_dim}, {layer.q_out}): {layer.embed_dim} rows, the input width of "
            f"{layer.q_weight.describe()} {_fmt(layer.q_weight.shape)}",
            fix="the checkpoint is inconsistent (a truncated or mismatched tensor)")


def check_self_widths(layer: AttentionLayer) -> None:
    """Self-attention reads queries, keys and values from one stream and W_o writes back into
    it: W_q, W_k and W_v take E inputs and W_o has E rows (only cross-attention and
    nn.MultiheadAttention's kdim/vdim differ). E is the width most of the four agree on, so the
    message names the one tensor that is off (a W_q one input column short, say)."""
    widths = [(layer.q_weight, 1), (layer.k_weight, 1), (layer.v_weight, 1), (layer.o_weight, 0)]
    found = [ref.shape[axis] for ref, axis in widths]
    width = max(found, key=lambda w: (found.count(w), w == layer.o_weight.shape[0]))
    for ref, axis in widths:
        if ref.shape[axis] != width:
            expected = list(ref.shape)
            expected[axis] = width
            others = ", ".join(f"{other.describe()} {_fmt(other.shape)}"
                               for other, _ in widths if other is not ref)
            raise LayoutError(
                f"{ref.describe()} has shape {_fmt(ref.shape)}, expected "
                f"{_fmt(tuple(expected))}: self-attention reads and writes one stream of width "
                f"{width}, as {others} say",
                fix="the checkpoint is inconsistent (a truncated or mismatched tensor)")


def _check_biases(layer: AttentionLayer) -> None:
    """Every bias has one value per output row of its projection (b_q: W_q's rows, b_k and
    bias_k: W_k's, b_v and bias_v: W_v's, b_o: W_o's): a packed in_proj_bias, separate
    q/k/v_proj.bias and nn.MultiheadAttention's bias_k/bias_v alike."""
    expected = (("q_bias", layer.q_weight), ("k_bias", layer.k_weight),
                ("v_bias", layer.v_weight), ("o_bias", layer.o_weight),
                ("bias_k", layer.k_weight), ("bias_v", layer.v_weight))
    for name, weight in expected:
        bias = getattr(layer, name)
        if bias is not None and bias.numel != weight.shape[0]:
            raise LayoutError(
                f"{bias.describe()} has shape {_fmt(bias.shape)} ({bias.numel} values), but "
                f"{weight.describe()} has {weight.shape[0]} output rows: one bias value per row",
                fix="the checkpoint is inconsistent")


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
