"""How many copies of a batch one intervention forward runs (the causal scorecard's: one copy per
removed head, stacked along the batch dimension).

As many as the memory budget (`--memory-budget`, default 256 MB) holds, each copy's cost
measured on the unablated forward (`CostMeter`: the outputs it keeps, and the largest tensor any
module makes, such as eager attention maps, a few of which are live at once); at most
MAX_COPIES; and on a CPU at most CPU_STACK_BYTES of copies: beyond that a stacked forward is
memory-bound and costs as much per copy as separate forwards, while its memory grows with every
copy (measured: 73 copies of 208 tokens took 1.2× a loop of one forward per head, at 2.6× its
peak memory). Short inputs, whose forwards are mostly per-call overhead, still stack many.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.core.memory import budget_bytes

MAX_COPIES = 128  # most copies of the batch in one forward pass
CPU_STACK_BYTES = 32 * 2**20  # on a CPU, stacked copies stop paying beyond about this much
TRANSIENT_BUFFERS = 3  # a module's largest output, live with its input and one temporary


@dataclass(frozen=True)
class CopyCost:
    """What one copy of the batch costs a forward, measured on the unablated one."""

    kept_bytes: int  # the outputs the forward returns and keeps (hidden states, logits)
    largest_bytes: int  # the largest tensor one module returned (eager maps, MLP activations)

    @property
    def total(self) -> int:
        return self.kept_bytes + TRANSIENT_BUFFERS * self.largest_bytes


def copies_per_forward(cost: CopyCost, budget: int | None, on_cpu: bool,
                       most: int = MAX_COPIES) -> int:
    """Copies of the batch per forward: within the budget (None: the default), at most `most`,
    on a CPU at most CPU_STACK_BYTES of them; at least one."""
    per_copy = max(1, cost.total)
    fits = min(most, budget_bytes(budget) // per_copy)
    if on_cpu:
        fits = min(fits, CPU_STACK_BYTES // per_copy)
    return max(1, fits)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in `value` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, tuple | list):
        return sum(tensor_bytes(v) for v in value)
    return 0


def largest_tensor(value: Any) -> int:
    """The bytes of the largest tensor in `value` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, tuple | list) else ()
    return max((largest_tensor(v) for v in items), default=0)


class CostMeter:
    """The largest tensor any module returns while `measuring()` is open (every module of
    every model: torch's global forward hook)."""

    def __init__(self) -> None:
        self.largest = 0

    @contextmanager
    def measuring(self) -> Iterator[CostMeter]:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.largest = max(self.largest, largest_tensor(output))

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            yield self
        finally:
            handle.remove()


def release_freed_memory() -> None:
    """Give the pages the C allocator holds free back to the system (glibc's malloc_trim;
    elsewhere nothing). The heatmap's own run frees its maps before the scorecard starts, but
    glibc keeps the pages: the scorecard's forwards would then add their memory on top of that
    run's peak (measured at 1,024 tokens: 150 MB kept free, returned by this)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
