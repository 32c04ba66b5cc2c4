"""The memory plan: from the memory budget and the sizes of a run, whether its attention maps are
held whole or streamed in blocks of query rows, and how large a block is. One decision for a
standalone layer (`layer_plan`, the per-head kernel's blocks) and for a Hugging Face model
(`model_plan`, the model's own eager attention run in blocks). Pure arithmetic on sizes, no
torch: the callers pass counts, and a device only as `on_cpu`.

Sizes: B sentences padded to L tokens, H heads, S = L + extra keys (bias_k), float32 maps.
"""

from __future__ import annotations

from dataclasses import dataclass

MAP_BUDGET_BYTES = 256 * 2**20  # default memory budget: beyond it, maps stream in blocks
# Maps of at most this many keys are held whole when they fit the budget (torch's own forward
# computes them; a display shows them cell for cell); larger ones stream unless kept (blocks
# cost less than a forward plus statistics over the full maps).
WHOLE_KEYS = 512
# A standalone block holds its scores, its weights and the temporaries of one elementwise pass
# over it: about this many float32 copies of its rows.
BLOCK_BUFFERS = 3
# On a CPU, blocks beyond this many entries (heads × rows × keys; 64 MiB per buffer) stop
# paying, while smaller ones multiply the operations, each of which waits at its OpenMP
# barrier (costly when other processes share the cores); rows beyond CPU_BLOCK_ROWS grow the
# r × r keys beside a block. GPUs take what the budget allows.
CPU_BLOCK_ENTRIES = 2**24
CPU_BLOCK_ROWS = 256
MAX_BLOCK_ROWS = 2048  # GPUs: the r × r keys beside a block stay small
# The most one eager block of one model layer's float32 maps (B, H, rows, S) may take.
EAGER_BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class MemoryPlan:
    """How a run's maps are computed within a memory budget: whole, or streamed in blocks
    (each reduced at once to display maps and statistics, never held whole).

    A standalone layer's blocks hold `rows` query rows of `heads` heads of one sentence. A
    model's eager attention runs in blocks of at most `block_bytes` of float32 maps
    (B, H, rows, S) per call, whether the maps stream or not (`eager_rows` says how many rows).
    """

    streamed: bool  # False: the full maps fit the budget and are kept
    rows: int  # query rows per standalone block (≥ 1)
    heads: int  # heads per standalone block: its buffers are heads × rows × S floats (≥ 1)
    block_bytes: int | None = None  # a model's eager blocks; None: one block per call

    def describe(self) -> str:
        """What one standalone block holds, in words."""
        what = "one head" if self.heads == 1 else f"{self.heads} heads"
        return f"blocks of query rows of {what} of one sentence at a time"


def budget_bytes(budget: int | None) -> int:
    """A stated budget, or the default."""
    return MAP_BUDGET_BYTES if budget is None else budget


def full_maps_bytes(sentences: int, heads: int, length: int, keys: int, layers: int = 1) -> int:
    """The bytes of `layers` layers' full float32 maps (B, H, L, S)."""
    return layers * sentences * heads * length * keys * 4


def held_whole(maps_bytes: int, keys: int, budget: int | None, keep: bool) -> bool:
    """The one rule for both kinds of run: full maps are held whole when they fit the budget
    and either the caller reads them (`keep`) or they are small (at most WHOLE_KEYS keys)."""
    return maps_bytes <= budget_bytes(budget) and (keep or keys <= WHOLE_KEYS)


def block_rows(budget: int | None, keys: int, on_cpu: bool = True) -> int:
    """Standalone query rows per block: as many as the budget holds for one head, capped (see
    CPU_BLOCK_ENTRIES)."""
    rows = budget_bytes(budget) // (BLOCK_BUFFERS * 4 * max(1, keys))
    cap = min(CPU_BLOCK_ROWS, CPU_BLOCK_ENTRIES // max(1, keys)) if on_cpu else MAX_BLOCK_ROWS
    return max(1, min(rows, cap))


@dataclass(frozen=True)
class MapsShape:
    """A standalone layer's maps: B sentences padded to L tokens, H heads, and the extra keys
    (bias_k) beyond the L real ones."""

    sentences: int
    length: int
    heads: int
    extra_keys: int = 0


def layer_plan(shape: MapsShape, budget: int | None = None, *, on_cpu: bool = True,
               one_head: bool = False, keep: bool = False) -> MemoryPlan:
    """A standalone layer's plan. Whole maps when they fit the budget and either the caller
    reads them (`keep`: --weighting norm, a short --export) or they are small (at most
    WHOLE_KEYS keys); else blocks of `block_rows` query rows, of as many heads as the budget
    holds (on a CPU also ≤ CPU_BLOCK_ENTRIES entries, whose passes stay in cache). Blocks cost
    less than torch's forward plus statistics over the full maps (no values, no output, no
    logarithm per entry), so larger maps stream. one_head: blocks of one head (a --export file
    takes its rows in (sentence, head, row) order)."""
    sentences, length, heads, extra_keys = (shape.sentences, shape.length, shape.heads,
                                            shape.extra_keys)
    keys = max(1, length + extra_keys)
    rows = block_rows(budget, keys, on_cpu)
    if held_whole(full_maps_bytes(sentences, heads, length, length + extra_keys), keys, budget,
                  keep):
        return MemoryPlan(False, rows, max(1, heads))
    most = budget_bytes(budget) // (BLOCK_BUFFERS * 4 * rows * keys)
    if on_cpu:
        most = min(most, CPU_BLOCK_ENTRIES // (rows * keys))
    return MemoryPlan(True, rows, 1 if one_head else max(1, min(most, heads)))


def eager_block_bytes(budget: int | None) -> int:
    """A model's eager blocks: a quarter of a stated budget, at most EAGER_BLOCK_BYTES."""
    return EAGER_BLOCK_BYTES if budget is None else max(1, min(EAGER_BLOCK_BYTES, budget // 4))


def eager_rows(block_bytes: int | None, batch: int, heads: int, length: int, keys: int) -> int:
    """Query rows per eager block of one attention call's float32 maps (B, H, rows, S): as many
    as block_bytes holds (None: all L), at least one."""
    if block_bytes is None:
        return length
    per_row = batch * heads * keys * 4  # float32: eager's softmax runs in float32 at least
    return max(1, min(length, block_bytes // per_row))


def model_plan(sentences: int, length: int, heads: int, layers: int,
               budget: int | None = None, keep: bool = False) -> MemoryPlan:
    """A model run's plan, by the same rule as a standalone layer's: its shown source layers'
    maps (`layers` of them, the most heads of any, L = S = length) are held whole when together
    they fit the budget and either the caller reads them (`keep`: --weighting norm) or they are
    small (at most WHOLE_KEYS keys); else each streams. Either way the model's eager attention
    runs in blocks of `eager_block_bytes`; `rows` is one eager block's rows of a source layer."""
    block = eager_block_bytes(budget)
    streamed = layers > 0 and not held_whole(
        full_maps_bytes(sentences, heads, length, length, layers), length, budget, keep)
    return MemoryPlan(streamed, eager_rows(block, sentences, max(1, heads), length, length),
                      max(1, heads), block)


def surely_whole(sentences: int, heads: int, calls: int, length: int,
                 budget: int | None = None) -> bool:
    """Whether every one of `calls` attention calls' full maps (at most `length` rows and keys)
    fit well within the budget (half of it) and are small (at most WHOLE_KEYS keys), so that
    none can stream: a model run then needs no probe of its layers before it starts."""
    return length <= WHOLE_KEYS and \
        full_maps_bytes(sentences, heads, length, length, calls) <= budget_bytes(budget) // 2
