"""Where a run's captured blocks go: each shown layer's weights realigned to real tokens, into a
full map or its streaming reducer; and the hooks that keep the attention modules' inputs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from attnviz.core.choices import LayerKind
from attnviz.sources.hf.layers import (
    ModelLayer,
    Plan,
    attention_like,
    cols_tokens,
    offsets,
    rows_tokens,
)

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from attnviz.compute.forward_pass.streaming import MapReducer

# --- the run -----------------------------------------------------------------------------------


class _RowsToAdd:
    """For cross-attention layers: copies each sentence's rows of every head into one (H, n, S)
    buffer and hands the sentence to `MapReducer.add` once its last real row is in (so one
    layer's maps of one sentence are held at a time, not all)."""

    def __init__(self, reducer: MapReducer, lengths: list[int], widths: list[int]) -> None:
        self.reducer = reducer
        self.lengths = lengths  # each sentence's query rows
        self.widths = widths  # … and keys
        self.buffers: dict[int, tuple[torch.Tensor, int]] = {}  # sentence: (maps, rows filled)

    def add_rows(self, sentence: int, first_head: int, row_start: int, attn_block: torch.Tensor,
                 scores_block: torch.Tensor | None = None) -> None:
        heads, rows, keys = attn_block.shape  # keys: fewer where a block saw fewer (zeros)
        buffer, filled = self.buffers.get(sentence) or (
            torch.zeros(heads, self.lengths[sentence], self.widths[sentence]), 0)
        buffer[:, row_start:row_start + rows, :keys] = attn_block
        filled += rows
        if filled < self.lengths[sentence]:
            self.buffers[sentence] = buffer, filled
            return
        self.buffers.pop(sentence, None)
        for head in range(heads):  # one head at a time: add's temporaries are one map's
            self.reducer.add(sentence, first_head + head, buffer[head:head + 1])
        del buffer
        _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim), so that a long input's
    layer after layer of freed maps does not add up in the process's resident memory."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


# (call index, sentence, first row, (H, rows, real keys) block): where --export writes a block
ExportRows = Callable[[int, int, int, torch.Tensor], None]


class Collector:
    """The on_block of one run: each shown layer's blocks, realigned to real tokens at once,
    into a full (B, H, n, m) map or, when streaming, into the layer's MapReducer."""

    # Blocks may stop at the last key their queries see (`capture_eager.keys_seen`): every
    # later key has weight 0, and each destination fills the rest with zeros.
    narrow_blocks = True

    def __init__(self, plan: Plan, reducers: dict[int, MapReducer],
                 export_rows: ExportRows | None = None) -> None:
        self.plan = plan
        self.export_rows = export_rows
        self.by_index = {layer.index: layer for layer in plan.shown or []}
        # blocks of layers not numbered before the run (no probe): realigned by replay()
        self.raw: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.reducers = reducers
        self.feeders: dict[int, MapReducer | _RowsToAdd] = {}
        for index, reducer in reducers.items():
            layer = self.by_index[index]
            if layer.kind != LayerKind.CROSS:
                # self-attention: each block of query rows is reduced at once (memory per head
                # O(block × S), never a whole map)
                self.feeders[index] = reducer
                continue
            # cross-attention: a sentence's target rows against its source keys are gathered
            # into one map per sentence first (MapReducer's statistics compare positions of
            # one sequence; cross maps have their own)
            lengths = [len(t) for t in rows_tokens(plan, layer)]
            widths = [len(t) for t in cols_tokens(plan, layer)]
            self.feeders[index] = _RowsToAdd(reducer, lengths, widths)
        self.maps: dict[int, torch.Tensor] = {}
        self.causal: dict[int, bool] = {}

    def replay(self, shown: list[ModelLayer]) -> None:
        """Realign the blocks kept raw, now that the run has numbered its layers."""
        self.by_index = {layer.index: layer for layer in shown}
        for index, blocks in self.raw.items():
            for row_start, weights in blocks:
                self(index, row_start, weights)
        self.raw = {}

    def __call__(self, index: int, row_start: int, weights: torch.Tensor) -> None:
        layer = self.by_index.get(index)
        if layer is None:  # short input, no probe: kept as the model made it, realigned later
            self.raw.setdefault(index, []).append((row_start, weights.float().cpu()))
            return
        rows_of = rows_tokens(self.plan, layer)
        cols_of = cols_tokens(self.plan, layer)
        q_offsets, k_offsets = offsets(self.plan, layer)
        count = weights.shape[2]
        if index not in self.reducers and index not in self.maps:
            self.maps[index] = torch.zeros(
                weights.shape[0], weights.shape[1], max(map(len, rows_of)),
                max(map(len, cols_of)))
        causal = self.causal.get(index, layer.kind != LayerKind.CROSS)
        for b, (rows, cols) in enumerate(zip(rows_of, cols_of, strict=True)):
            n, m, q0, k0 = len(rows), len(cols), q_offsets[b], k_offsets[b]
            lo, hi = max(row_start, q0), min(row_start + count, q0 + n)
            if lo >= hi:
                continue
            block = weights[b, :, lo - row_start:hi - row_start, k0:k0 + m].float()  # (H, r, ≤ m)
            feeder, reducer = self.feeders.get(index), self.reducers.get(index)
            # a self-attention layer's reducer, fed directly, measures the weight after each
            # query itself (cross-attention's feeder gathers whole maps first)
            measured = reducer if reducer is feeder else None
            if causal and measured is None and _sees_later_keys(block, lo - q0, hi - q0):
                causal = False
            host = block.cpu()  # one device-to-host copy, whoever takes the block
            if self.export_rows is not None:
                self.export_rows(index, b, lo - q0, host)
            if feeder is not None:
                feeder.add_rows(b, 0, lo - q0, host, None)
                if causal and measured is not None and measured.sees_later_keys:
                    causal = False
            else:
                self.maps[index][b, :, lo - q0:hi - q0, :host.shape[-1]] = host
        self.causal[index] = causal


def _sees_later_keys(block: torch.Tensor, first: int, stop: int) -> bool:
    """Whether a block of query rows first..stop - 1 (H, r, keys) puts weight on a key after
    its own query: the keys beside the block above the diagonal, or any key after its last
    query (without a copy of the whole block, as triu would make)."""
    beside = block[..., first:stop]  # (H, r, r): key first + j for query first + i
    later = block[..., stop:]
    return bool(beside.triu(1).any()) or (later.numel() > 0 and bool(later.any()))


def input_hooks(plan: Plan, keep: set[int] | None
                 ) -> tuple[list[RemovableHandle], dict[tuple[str, int], torch.Tensor]]:
    """Forward pre-hooks that keep the hidden states entering the attention modules, by (module
    name, call of that module): of the calls `keep` when the layers are known, else of every
    attention-like module (short inputs only)."""
    runner = plan.prepared.runner
    modules = dict(runner.named_modules())
    if plan.shown is not None:
        names = [layer.name for layer in plan.shown if keep is None or layer.index in keep]
        wanted: set[tuple[str, int]] | None = {
            (layer.name, layer.occurrence) for layer in plan.shown
            if keep is None or layer.index in keep}
    else:
        names = [name for name, module in modules.items() if name and attention_like(module)]
        wanted = None
    calls: Counter[str] = Counter()
    inputs: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    batch = len(plan.prepared.batch.tokens)
    lengths = {value.shape[1] for name, value in plan.prepared.feed.items()
               if name in ("input_ids", "decoder_input_ids")}

    def hook_for(name: str) -> Callable[[torch.nn.Module, tuple, dict], None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            key = name, calls[name]
            calls[name] += 1
            x = args[0] if args else kwargs.get("hidden_states")
            if (wanted is None or key in wanted) and isinstance(x, torch.Tensor) \
                    and x.ndim == 3 and x.shape[0] == batch:
                x = token_major(module, x, lengths)
                if x is not None:
                    inputs[key] = x.detach().float().cpu()
        return hook

    for name in dict.fromkeys(names):
        if name in modules:
            handles.append(modules[name].register_forward_pre_hook(hook_for(name),
                                                                   with_kwargs=True))
    return handles, inputs


def token_major(module: torch.nn.Module, x: torch.Tensor, lengths: set[int]) -> torch.Tensor | None:
    """A module's input as (B, L, E): channels-first modules (SqueezeBERT's attention runs
    nn.Conv1d projections on (B, E, L)) are transposed; an input with no axis of the run's
    sequence lengths is not hidden states, and is not kept."""
    channels_first = any(isinstance(child, torch.nn.Conv1d) for child in module.children())
    if channels_first and x.shape[2] in lengths:
        return x.transpose(1, 2)
    return x if x.shape[1] in lengths else None
