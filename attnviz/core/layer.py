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

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from attnviz.errors import LayoutError, UsageError

RowRanges = tuple[tuple[int, int], ...]


ArrayT = TypeVar("ArrayT", bound=Any)  # a torch tensor or a numpy array


@dataclass(frozen=True)
class TensorRef:
    """Where one canonical weight or bias lives in a checkpoint, and how to read it out."""

    key: str  # tensor name in the checkpoint
    stored_shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", ...
    transposed: bool = False  # stored (in, out), like GPT-2's Conv1D
    row_ranges: RowRanges | None = None  # rows of the canonical tensor taken, in order; None = all
    flatten: bool = False  # e.g. nn.MHA's bias_k, stored (1, 1, E)

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        """Shape of the whole stored tensor in (out, in) orientation, before row selection."""
        if self.flatten:
            return (math.prod(self.stored_shape),)
        if self.transposed:
            return tuple(reversed(self.stored_shape))
        return self.stored_shape

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the tensor this reference denotes, in (out, in) orientation."""
        canon = self.canonical_shape
        if self.row_ranges is None:
            return canon
        return (sum(stop - start for start, stop in self.row_ranges), *canon[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        """Human-readable origin, e.g. `in_proj_weight[0:64]` or `c_attn.weight.T[0:768]`."""
        text = self.key + (".T" if self.transposed else "")
        if self.row_ranges is not None:
            parts = [f"{start}:{stop}" for start, stop in self.row_ranges]
            shown = ",".join(parts[:3]) + (",…" if len(parts) > 3 else "")
            text += f"[{shown}]"
        return text

    def oriented(self, stored: ArrayT) -> ArrayT:
        """The stored array in (out, in) orientation, before row selection: flattened or
        transposed as this reference says. The one decoder for torch tensors and numpy arrays
        (memory maps) alike: both have `reshape` and `.T`, and neither copies here."""
        if self.flatten:
            return stored.reshape(-1)
        return stored.T if self.transposed else stored

    def row_blocks(self, oriented: ArrayT) -> list[ArrayT]:
        """The row blocks of an `oriented` array this reference takes, in order."""
        if self.row_ranges is None:
            return [oriented]
        return [oriented[start:stop] for start, stop in self.row_ranges]

    def take(self, ranges: RowRanges) -> TensorRef:
        """A reference to rows `ranges` (relative to this reference's rows) of the same tensor."""
        base = self.row_ranges if self.row_ranges is not None else ((0, self.canonical_shape[0]),)
        return replace(self, row_ranges=_compose_ranges(base, ranges))


def _compose_ranges(base: RowRanges, ranges: RowRanges) -> RowRanges:
    """Map row ranges given relative to the concatenation of `base` back to absolute rows.

    Each range finds its first base block by bisection over the blocks' offsets and visits only
    the blocks it overlaps: taking one head's rows out of H per-head blocks costs O(log H), not
    O(H) (so all H heads cost O(H log H), not O(H²))."""
    offsets = list(itertools.accumulate((b_stop - b_start for b_start, b_stop in base),
                                        initial=0))
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        i = max(0, bisect.bisect_right(offsets, start) - 1)
        while i < len(base) and offsets[i] < stop:
            b_start = base[i][0]
            lo, hi = max(start, offsets[i]), min(stop, offsets[i + 1])
            if lo < hi:
                out.append((b_start + lo - offsets[i], b_start + hi - offsets[i]))
            i += 1
    return merge_ranges(tuple(out))


def merge_ranges(ranges: RowRanges) -> RowRanges:
    """Join adjacent ranges: ((0, 4), (4, 8)) -> ((0, 8),)."""
    merged: list[tuple[int, int]] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


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
                fix="pass --num-heads (and --num-kv-heads for grouped-query layers)",
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
    if num_heads is None:
        return None, None, None
    q_out, kv_out = layer.q_out, layer.kv_out
    q_key = layer.q_weight.describe()
    if num_heads <= 0:
        raise UsageError(f"the number of heads must be positive, got {num_heads}")
    if head_dim is None:
        if q_out % num_heads:
            choices = divisor_choices(q_out)
            raise LayoutError(
                f"{q_key} has {q_out} rows, not divisible by {num_heads} heads "
                f"(head_dim would be {q_out / num_heads:.2f})",
                fix=f"choose the number of heads from {choices}",
            )
        head_dim = q_out // num_heads
    if head_dim <= 0 or num_heads * head_dim != q_out:
        raise LayoutError(
            f"{q_key} has shape {_fmt(layer.q_weight.shape)} but {num_heads} heads × head_dim "
            f"{head_dim} need {num_heads * head_dim} rows",
            fix="check num_heads / head_dim in the config or on the command line",
        )
    if num_kv_heads is None:
        if kv_out % head_dim:
            raise LayoutError(
                f"{layer.k_weight.describe()} has {kv_out} rows, "
                f"not a multiple of head_dim {head_dim}",
                fix="check num_heads / head_dim in the config or on the command line",
            )
        num_kv_heads = kv_out // head_dim
    if num_kv_heads <= 0 or num_kv_heads * head_dim != kv_out:
        raise LayoutError(
            f"{layer.k_weight.describe()} has shape {_fmt(layer.k_weight.shape)} but "
            f"{num_kv_heads} key/value heads × head_dim {head_dim} "
            f"need {num_kv_heads * head_dim} rows",
            fix="check num_key_value_heads in the config or --num-kv-heads",
        )
    if num_heads % num_kv_heads:
        raise LayoutError(
            f"{num_heads} query heads cannot be shared evenly by {num_kv_heads} key/value heads",
            fix="check num_heads and num_kv_heads",
        )
    for ref, expect in ((layer.v_weight, kv_out), (layer.o_weight, None)):
        if expect is not None and ref.shape[0] != expect:
            raise LayoutError(
                f"{ref.describe()} has shape {_fmt(ref.shape)}, expected {expect} rows like W_k",
                fix="the checkpoint is inconsistent",
            )
    if layer.o_weight.shape[1] != q_out:
        raise LayoutError(
            f"{layer.o_weight.describe()} has shape {_fmt(layer.o_weight.shape)}, expected "
            f"{q_out} columns (H·d)",
            fix="the checkpoint is inconsistent",
        )
    return num_heads, num_kv_heads, head_dim


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
