"""Reusing the unablated run's prefix: a copy whose edits all lie in block k of a model's stack of
blocks (the ModuleList holding its layers: GPT-2's transformer.h, LLaMA's model.layers) runs
blocks 0..k-1 exactly as the unablated run did, so those blocks return the unablated run's
outputs, repeated per copy, instead of running again: about half of the blocks' work over a
whole scorecard.

Only where that is exact: every block of the stack runs once per forward, in order (recorded on
the unablated run); each site's output projection runs once per forward; the blocks' outputs
are tensors (batch first), tuples or None; no block is placed by accelerate (offloaded or
spread over devices: its hooks move tensors). A stack passing those checks is then proved on two
copies (one where the forwards run one copy each): with every block but the last replaced, the
forward must reproduce the unablated run's output (`Prefix.confirm`); one that does not (a block
keeping state between calls, an output whose first dimension is not the batch) is never
skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

SAME_RTOL = 1e-6  # the replaced forward's output against the unablated run's, relative


@dataclass
class BlockStack:
    """One ModuleList of blocks and, once recorded, each block's unablated output."""

    blocks: list[Any]
    outputs: list[Any] = field(default_factory=list)
    usable: bool = True


@dataclass(frozen=True)
class Skip:
    """Blocks 0..below-1 of `stack` return their unablated outputs, `copies` times."""

    stack: BlockStack
    below: int


def block_of(model: Any, module_name: str) -> tuple[Any, int] | None:
    """(the shallowest ModuleList holding the named module, the position of the block holding
    it there), or None."""
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        parent = model.get_submodule(".".join(parts[:i]))
        if isinstance(parent, torch.nn.ModuleList) and parts[i].isdigit():
            return parent, int(parts[i])
    return None


def repeated(value: Any, copies: int, batch: int) -> Any:
    """A copy of `value` with every tensor whose first dimension is the batch repeated `copies`
    times (copies: the model may change what a block returned in place)."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] != batch:
            return value.clone()
        return value.repeat(copies, *[1] * (value.ndim - 1))
    if type(value) in (tuple, list):
        return type(value)(repeated(v, copies, batch) for v in value)
    return value


def plain(value: Any) -> bool:
    """Whether `value` is a tensor, None, or a plain tuple or list of those."""
    if value is None or isinstance(value, torch.Tensor):
        return True
    return type(value) in (tuple, list) and all(plain(v) for v in value)


class Prefix:
    """The stacks of blocks that hold the edited sites, and where each site's block lies."""

    def __init__(self, model: Any, names: dict[int, str], once: dict[int, bool]) -> None:
        """names: site index → its output projection's module name (in `model`); once: site
        index → whether that module runs once per forward."""
        self.stacks: dict[int, BlockStack] = {}
        self.where: dict[int, tuple[BlockStack, int]] = {}  # site index → (stack, position)
        if getattr(model, "hf_device_map", None):
            return
        for index, name in names.items():
            found = block_of(model, name)
            if found is None:
                continue
            modules, position = found
            stack = self.stacks.setdefault(id(modules), BlockStack(list(modules)))
            self.where[index] = (stack, position)
            if not once[index] or any("forward" in vars(b) or hasattr(b, "_hf_hook")
                                      for b in stack.blocks):
                stack.usable = False

    def position(self, index: int) -> tuple[BlockStack, int] | None:
        """Where site `index` lies, if its stack can be skipped."""
        found = self.where.get(index)
        return found if found is not None and found[0].usable else None

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep each block's output of one forward; a stack whose blocks do not run once each,
        in order, or return other than tensors and tuples, is marked unusable."""
        order: dict[int, list[int]] = {id(s): [] for s in self.stacks.values()}
        handles = []
        for stack in self.stacks.values():
            stack.outputs = [None] * len(stack.blocks)
            for position, block in enumerate(stack.blocks):
                def hook(module: Any, args: Any, output: Any, stack: BlockStack = stack,
                         position: int = position) -> None:
                    order[id(stack)].append(position)
                    stack.outputs[position] = repeated(output, 1, -1)  # a copy
                handles.append(block.register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        for stack in self.stacks.values():
            if order[id(stack)] != list(range(len(stack.blocks))) or \
                    not all(plain(o) for o in stack.outputs):
                stack.usable, stack.outputs = False, []

    @contextmanager
    def skipping(self, skip: Skip | None, copies: int, batch: int) -> Iterator[None]:
        """Blocks below `skip.below` return their recorded outputs, repeated per copy."""
        with ExitStack() as restore:
            if skip is not None:
                for position in range(skip.below):
                    block = skip.stack.blocks[position]
                    block.forward = _returning(repeated(skip.stack.outputs[position], copies,
                                                        batch))
                    restore.callback(delattr, block, "forward")
            yield

    def confirm(self, forward: Callable[[Skip], tuple[torch.Tensor, torch.Tensor | None]],
                hidden: torch.Tensor, logits: torch.Tensor | None) -> None:
        """Mark unusable each stack whose replaced blocks do not reproduce the unablated
        output: `forward(skip)` runs copies with every block but the last replaced."""
        for stack in self.stacks.values():
            if not stack.usable or len(stack.blocks) < 2:
                stack.usable = False
                continue
            got_hidden, got_logits = forward(Skip(stack, len(stack.blocks) - 1))
            pairs = [(got_hidden, hidden)] + \
                ([] if logits is None or got_logits is None else [(got_logits, logits)])
            stack.usable = all(_same_copies(got, base) for got, base in pairs)


def _returning(value: Any) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return value
    return forward


def _same_copies(got: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether each copy in `got` (copies·B, …) equals `base` (B, …) to SAME_RTOL."""
    B = base.shape[0]
    if got.shape[0] % B or got.shape[1:] != base.shape[1:]:
        return False
    base = base.to(got.device).double()
    scale = float(base.abs().max()) if base.numel() else 0.0
    return all(torch.allclose(got[c * B:(c + 1) * B].double(), base, rtol=SAME_RTOL,
                              atol=SAME_RTOL * scale)
               for c in range(got.shape[0] // B))
