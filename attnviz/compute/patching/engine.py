"""The one patch-and-measure loop: run a batch of pairs, with many patched copies of it stacked
along the batch dimension, each copy with its own list of patches, and score every copy.

A `Patch` replaces one site's activation (a layer's head, key/value head or residual stream, at
one position or all) in a copy by the same slice from a cache: the other run's (`source`, the
plain activation patch), the patched run's own (`base`: path patching freezes heads with it), or
a cache given per copy (`given`: path patching's second pass). Copies are copy-major: row
c·P + p is pair p of copy c. How many copies go in one forward comes from the memory budget
and the model's own estimate of a row's cost (`PatchModel.row_bytes`).

Work whose result is known is left out, exactly (a model with `Shortcuts`): a patched forward
starts at the first layer any copy patches (or records), from the residual stream the
unpatched run of the same prompts recorded there — the layers before it compute the same
thing in every copy; a layer whose head outputs every copy replaces whole (path patching's
frozen heads) skips its attention; and a forward run only to record activations (path
patching's first pass to receivers) stops once it has them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnviz.compute.patching.metric import Targets, inputs_of, score, targets
from attnviz.compute.patching.model import Hook, PatchModel, Shortcut, Shortcuts
from attnviz.compute.patching.pairs import TokenizedPair
from attnviz.core.choices import PatchMetric

SOURCES = ("base", "source", "given")  # applied in this order: a later one wins
MAX_COPIES = 256
Key = tuple[str, int]  # (site, layer)
Cache = dict[Key, torch.Tensor]


@dataclass(frozen=True)
class Patch:
    """One site of one copy replaced from a cache."""

    site: str  # resid, q, k, v, pattern, z
    layer: int
    unit: int | None = None  # the head (k, v: the key/value head); None: every one
    position: int | None = None  # None: every position (pattern: query rows)
    source: str = "source"  # base, source or given (see SOURCES)


Copy = tuple[Patch, ...]


@dataclass(frozen=True)
class PairBatch:
    """The pairs as right-padded id tensors."""

    clean: torch.Tensor  # (P, L) long
    corrupt: torch.Tensor  # (P, L) long
    real: torch.Tensor  # (P, L) bool
    targets: Targets
    lengths: list[int]  # each pair's tokens (prompt, and continuation for the loss)

    @property
    def pairs(self) -> int:
        return int(self.clean.shape[0])

    @property
    def length(self) -> int:
        return int(self.clean.shape[1])


def pair_batch(pairs: list[TokenizedPair], metric: PatchMetric) -> PairBatch:
    """Right-padded ids of every pair's clean and corrupted run (padding id 0, masked)."""
    rows = [(inputs_of(p, metric, False), inputs_of(p, metric, True)) for p in pairs]
    L = max(len(clean) for clean, _ in rows)
    clean = torch.zeros(len(rows), L, dtype=torch.long)
    corrupt = torch.zeros(len(rows), L, dtype=torch.long)
    real = torch.zeros(len(rows), L, dtype=torch.bool)
    for p, (c, k) in enumerate(rows):
        clean[p, :len(c)], corrupt[p, :len(k)], real[p, :len(c)] = \
            torch.tensor(c), torch.tensor(k), True
    return PairBatch(clean, corrupt, real, targets(pairs, metric), [len(c) for c, _ in rows])


@dataclass
class Engine:
    """Runs a `PairBatch` through a `PatchModel`, plainly or patched."""

    model: PatchModel
    batch: PairBatch
    budget_bytes: int = 256 * 2**20
    forwards: int = field(default=0, init=False)  # forward passes run (for the output)
    shortcuts: bool = True  # leave out known work (see the module's docstring); tests: False
    # each unpatched run's residual stream entering each layer (clean: False, corrupted: True)
    starts: dict[bool, Cache] = field(default_factory=dict, init=False)

    @property
    def _starting(self) -> bool:
        return (self.shortcuts and isinstance(self.model, Shortcuts)
                and "resid" in self.model.sites and bool(getattr(self.model, "starts", False)))

    @property
    def per_forward(self) -> int:
        """Copies of the batch in one forward pass, from the memory budget: what the engine
        holds (the unpatched runs' streams) comes off it, and each copy's estimated tensors
        count 5/4 — the allocator keeps freed blocks and per-thread arenas beyond the tensors
        alive at once (measured on benchmarks/run.py's GPT-2 at 256 tokens: the process's peak
        grew about 1.05× the estimate per copy, and up to 1.2× between runs)."""
        row = self.model.row_bytes(self.batch.length) * self.batch.pairs * 5 // 4
        held = sum(t.numel() * t.element_size() for cache in self.starts.values()
                   for t in cache.values())
        return max(1, min(MAX_COPIES, (self.budget_bytes - held) // max(1, row)))

    def _forward(self, copies: int, corrupt: bool, hook: Hook | None,
                 share: int | None = None, frozen: frozenset[int] = frozenset()
                 ) -> torch.Tensor:
        """(copies·P,) scores of `copies` copies of the clean (or corrupted) batch. `share`:
        the first layer any copy patches or records — one pair's copies are the same run
        before it, so the forward starts with one row and the copies are made where the
        residual stream enters that layer (every mask and position table the model built for
        one row broadcasts over them); with shortcuts the layers before it are not run at all
        (their output is the unpatched run's). `frozen`: layers whose head outputs the hook
        replaces in every row."""
        b, device = self.batch, self.model.device
        read = b.targets.positions.repeat(copies, 1).to(device)
        self.forwards += 1
        one = share is not None and copies > 1 and self._one_row
        rows = 1 if one else copies
        ids = (b.corrupt if corrupt else b.clean).repeat(rows, 1).to(device)
        real = b.real.repeat(rows, 1).to(device)
        if one:
            assert hook is not None
            inner = hook

            def expand(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
                if site == "resid" and layer == share and x.shape[0] == 1:
                    x = x.expand(copies, *x.shape[1:]).contiguous()
                return inner(site, layer, x)
            hook = expand
        state = self.starts.get(corrupt, {}).get(("resid", share)) \
            if share is not None and self._starting else None
        if isinstance(self.model, Shortcuts) and self.shortcuts \
                and (state is not None or frozen):
            cut = Shortcut(share or 0, None if state is None
                           else state.to(device).repeat(rows, 1, 1), frozen)
            logits = self.model.forward_from(ids, real, read, hook, cut)
        else:
            logits = self.model.forward(ids, real, read, hook)
        return score(logits, b.targets).cpu()

    @property
    def _one_row(self) -> bool:
        """Copies may be made inside the forward (see `_forward`)."""
        return self.batch.pairs == 1 and "resid" in self.model.sites \
            and self.model.shares_prefix

    def shares(self, copies: list[Copy], record: set[Key] | frozenset[Key] = frozenset()
               ) -> int | None:
        """The layer the copies share the run up to (see `_forward`), or None."""
        if not (self._one_row or self._starting):
            return None
        first = min([patch.layer for copy in copies for patch in copy]
                    + [layer for _, layer in record], default=0)
        return first if first > 0 else None

    def run(self, corrupt: bool, record: set[str] | frozenset[str] = frozenset()
            ) -> tuple[torch.Tensor, Cache]:
        """(P,) scores of the clean (or corrupted) run, and its activations at the `record`
        sites of every layer."""
        cache: Cache = {}
        starts: Cache = {}
        keep = self._starting

        def hook(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
            if site in record:
                cache[(site, layer)] = x.detach()
            if keep and site == "resid":
                starts[(site, layer)] = x.detach()
            return x
        with torch.no_grad():
            scores = self._forward(1, corrupt, hook)
        if keep:
            self.starts[corrupt] = starts
        return scores, cache

    def patched(self, corrupt: bool, copies: list[Copy], caches: dict[str, Cache],
                record: set[Key] | frozenset[Key] = frozenset(), scores: bool = True
                ) -> tuple[torch.Tensor, Cache]:
        """(C, P) scores of one forward of C = len(copies) patched copies of the clean (or
        corrupted) run, and the activations at the `record` sites after patching (C·P rows).
        Without `scores` (only the recorded activations wanted), the forward may stop once
        it has recorded them, and the scores returned are NaN."""
        C, P = len(copies), self.batch.pairs
        plan = _plan(copies)
        recorded: Cache = {}
        stop = self.shortcuts and not scores and bool(record)

        def hook(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
            edits = plan.get((site, layer))
            if edits:
                view = x.reshape(C, P, *x.shape[1:])
                for source, entries in edits:
                    mask = _mask(site, entries, C, x.shape[1:])
                    given = caches[source][(site, layer)].to(x.device, x.dtype)
                    given = given.reshape(C, P, *x.shape[1:]) if given.shape[0] == C * P \
                        else given[None]
                    view = torch.where(_broadcast(site, mask.to(x.device)), given, view)
                x = view.reshape(x.shape)
            if (site, layer) in record:
                recorded[(site, layer)] = x.detach()
                if stop and len(recorded) == len(record):
                    raise _Recorded
            return x
        try:
            with torch.no_grad():
                found = self._forward(C, corrupt, hook, self.shares(copies, record),
                                      _frozen(copies, plan, record) if self.shortcuts
                                      else frozenset())
        except _Recorded:
            found = torch.full((C * P,), math.nan, dtype=torch.float64)
        return found.reshape(C, P), recorded

    def sweep(self, corrupt: bool, copies: list[Copy], caches: dict[str, Cache],
              report: Callable[[str], None] = lambda _: None) -> torch.Tensor:
        """(C, P) scores of every copy, `per_forward` copies a forward; copies of one first
        patched layer go together, so that each forward shares the run before it."""
        per, out, done = self.per_forward, [], 0
        for group in by_first_layer(copies):
            for start in range(0, len(group), per):
                chunk = group[start:start + per]
                report(f"patching {done + 1}-{done + len(chunk)} of {len(copies)}")
                out.append(self.patched(corrupt, chunk, caches)[0])
                done += len(chunk)
        return torch.cat(out) if out else torch.zeros(0, self.batch.pairs, dtype=torch.float64)

    def gradients(self, corrupt: bool, sites: set[str]) -> tuple[torch.Tensor, Cache, Cache]:
        """One forward and backward of the clean (or corrupted) run: (P,) scores, the
        activations at `sites`, and the metric's gradient with respect to each (each pair's
        metric depends on its own row only, so one backward of their sum gives every pair's)."""
        acts: Cache = {}
        leaves: Cache = {}

        def hook(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
            if site not in sites:
                return x
            acts[(site, layer)] = x.detach()
            leaf = torch.zeros_like(x, requires_grad=True)  # d metric / d leaf = d metric / d x
            leaves[(site, layer)] = leaf
            return x + leaf
        b, device = self.batch, self.model.device
        with torch.enable_grad():
            ids = (b.corrupt if corrupt else b.clean).to(device)
            logits = self.model.forward(ids, b.real.to(device), b.targets.positions.to(device),
                                        hook)
            scores = score(logits, b.targets)
            scores.sum().backward()
        self.forwards += 1
        grads = {key: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach()
                 for key, leaf in leaves.items()}
        return scores.detach().cpu(), acts, grads


class _Recorded(Exception):
    """Raised from a hook to end a forward that has recorded all it was run for."""


def _frozen(copies: list[Copy], plan: dict[Key, list[tuple[str, list[Entry]]]],
            record: set[Key] | frozenset[Key]) -> frozenset[int]:
    """Layers whose head outputs every copy replaces at every head and position (their
    attention's result is never read), and whose pattern nobody patches or records."""
    whole = [{p.layer for p in copy if p.site == "z" and p.unit is None and p.position is None}
             for copy in copies]
    common = set.intersection(*whole) if whole else set()
    return frozenset(layer for layer in common
                     if ("pattern", layer) not in plan and ("pattern", layer) not in record)


def by_first_layer(copies: list[Copy]) -> list[list[Copy]]:
    """Consecutive runs of copies whose first patched layer is the same (order kept)."""
    groups: list[list[Copy]] = []
    last: int | None = None
    for copy in copies:
        first = min((patch.layer for patch in copy), default=0)
        if not groups or first != last:
            groups.append([])
        groups[-1].append(copy)
        last = first
    return groups


Entry = tuple[int, int | None, int | None]  # (copy, unit, position)


def _plan(copies: list[Copy]) -> dict[Key, list[tuple[str, list[Entry]]]]:
    """Per site, its edits in SOURCES order: (source, the copies' (copy, unit, position))."""
    found: dict[tuple[Key, str], list[Entry]] = {}
    for c, copy in enumerate(copies):
        for patch in copy:
            found.setdefault(((patch.site, patch.layer), patch.source), []).append(
                (c, patch.unit, patch.position))
    plan: dict[Key, list[tuple[str, list[Entry]]]] = {}
    for source in SOURCES:
        for (key, s), entries in found.items():
            if s == source:
                plan.setdefault(key, []).append((source, entries))
    return plan


def _mask(site: str, entries: list[Entry], C: int, shape: torch.Size) -> torch.Tensor:
    """The copies' bool mask for an activation of one row's `shape` (its length read from the
    activation itself: a decoder's or a cross-attention's may differ from the prompt's):
    resid (C, L), pattern (C, H, L) over query rows, q/z (C, L, H), k/v (C, S, Hkv)."""
    mask = torch.zeros(C, *shape[:1 if site == "resid" else 2], dtype=torch.bool)
    for c, unit, position in entries:
        at = slice(None) if position is None else position
        u = slice(None) if unit is None else unit
        if site == "resid":
            mask[c, at] = True
        elif site == "pattern":
            mask[c, u, at] = True
        else:
            mask[c, at, u] = True
    return mask


def _broadcast(site: str, mask: torch.Tensor) -> torch.Tensor:
    """A (C, …) mask shaped to broadcast against the (C, P, …) activation view."""
    if site == "resid":
        return mask[:, None, :, None]  # (C, 1, L, 1)
    return mask[:, None, :, :, None]  # (C, 1, L, U, 1) or pattern (C, 1, H, L, 1)
