"""The sweeps of `attnviz patch`, each a list of copies for the engine's one loop:

- heads (z), q, pattern: each head, over all positions (layers × heads) or at each position
  (heads × positions); k, v: each key/value head (a grouped-query model's query heads share it);
- residual: the residual stream entering each layer, at each position (causal tracing);
- path: exact path patching (Wang et al. 2022): pass 1 runs the base run with one sender
  head's output from the other run and every other head's output frozen at the base run's
  (MLPs and norms recomputed); the receivers' query, key or value (or, for the logits, the
  output itself) are read; pass 2 runs the base run with only those receiver inputs replaced;
- attribution: one forward and backward of the base run; each activation's first-order
  effect (other − base) · ∂metric/∂activation, beside the exact patch of the same activation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from attnviz.compute.patching.engine import Cache, Copy, Engine, Patch, by_first_layer
from attnviz.compute.patching.result import Baselines, EffectGrid, correlation, summarize
from attnviz.core.choices import PatchDirection

Report = Callable[[str], None]


@dataclass
class Runs:
    """The two unpatched runs: the baselines and each run's activations."""

    engine: Engine
    baselines: Baselines
    clean: Cache
    corrupt: Cache

    def sides(self, direction: PatchDirection) -> tuple[bool, Cache, Cache]:
        """(the patched run is the corrupted one, its own cache, the other run's cache)."""
        if direction is PatchDirection.DENOISING:
            return True, self.corrupt, self.clean
        return False, self.clean, self.corrupt

    @property
    def layers(self) -> int:
        return self.engine.model.n_layers

    @property
    def heads(self) -> int:
        return self.engine.model.n_heads

    @property
    def kv_heads(self) -> int:
        return self.engine.model.n_kv_heads

    @property
    def labels(self) -> list[str]:
        """Each layer's row label: L0, L1, … (an encoder-decoder: enc 0, dec 0, cross 0, …)."""
        return self.engine.model.layer_labels


def baseline_runs(engine: Engine, sites: set[str], explained: str) -> Runs:
    """Both runs, recording `sites`."""
    from attnviz.compute.patching.result import Baselines

    clean, clean_cache = engine.run(False, sites)
    corrupt, corrupt_cache = engine.run(True, sites)
    baselines = Baselines(engine.batch.targets.metric, explained, clean.tolist(),
                          corrupt.tolist())
    return Runs(engine, baselines, clean_cache, corrupt_cache)


def _grid(runs: Runs, scores: torch.Tensor, what: tuple[str, PatchDirection, str],
          rows: list[str], cols: list[str]) -> EffectGrid:
    """A rows × cols grid of (rows·cols, P) scores; `what`: (site, direction, title)."""
    mean, spread, raw = summarize(scores, runs.baselines)
    R, K = len(rows), len(cols)

    def grid(t: torch.Tensor) -> list[list[float]]:
        return t.reshape(R, K).tolist()
    site, direction, title = what
    by_pair = [grid(scores[:, p]) for p in range(scores.shape[1])]
    return EffectGrid(site, direction, title, rows, cols, grid(mean), grid(spread), grid(raw),
                      by_pair=by_pair)


def units(site: str, runs: Runs) -> int:
    return runs.kv_heads if site in ("k", "v") else runs.heads


def head_sweep(runs: Runs, direction: PatchDirection, site: str, report: Report
               ) -> EffectGrid:
    """Each head (k, v: key/value head) of each layer patched over all positions."""
    corrupt, _, other = runs.sides(direction)
    U = units(site, runs)
    copies: list[Copy] = [(Patch(site, layer, unit),) for layer in range(runs.layers)
                          for unit in range(U)]
    scores = runs.engine.sweep(corrupt, copies, {"source": other}, report)
    name = {"z": "head outputs", "q": "queries", "k": "keys", "v": "values",
            "pattern": "attention patterns"}[site]
    col_notes = []
    if site in ("k", "v") and runs.kv_heads != runs.heads:
        group = runs.heads // runs.kv_heads
        col_notes = [f"KV{g}: query heads {g * group}-{(g + 1) * group - 1}" for g in range(U)]
    prefix = "KV" if site in ("k", "v") else "H"
    grid = _grid(runs, scores, ("heads" if site == "z" else site, direction,
                                f"{name}, each patched at every position"),
                 runs.labels[:runs.layers], [f"{prefix}{u}" for u in range(U)])
    grid.col_notes.extend(col_notes)
    return grid


def position_sweep(runs: Runs, direction: PatchDirection, site: str, positions: list[str],
                   report: Report) -> EffectGrid:
    """Each head's output (site z) or the residual stream (site resid) at each position."""
    corrupt, _, other = runs.sides(direction)
    L = runs.engine.batch.length
    if site == "resid":
        rows = runs.labels[:runs.layers]
        copies: list[Copy] = [(Patch("resid", layer, None, p),) for layer in range(runs.layers)
                              for p in range(L)]
        title = "the residual stream entering each layer, patched at each position"
    else:
        rows = [f"{runs.labels[i]}H{h}" for i in range(runs.layers) for h in range(runs.heads)]
        copies = [(Patch(site, layer, h, p),) for layer in range(runs.layers)
                  for h in range(runs.heads) for p in range(L)]
        title = "each head's output, patched at each position"
    scores = runs.engine.sweep(corrupt, copies, {"source": other}, report)
    return _grid(runs, scores, ("residual" if site == "resid" else "head-positions", direction,
                                title), rows, positions)


def path_sweep(runs: Runs, direction: PatchDirection, receivers: list[tuple[int, int]],
               receiver_site: str, report: Report) -> EffectGrid:
    """Exact path patching from every sender head (of layers before the receivers') to the
    receivers' `receiver_site` input (q, k or v), or to the logits (no receivers)."""
    engine = runs.engine
    corrupt, own, other = runs.sides(direction)
    last = min((layer for layer, _ in receivers), default=runs.layers)
    senders = [(layer, h) for layer in range(last) for h in range(runs.heads)]
    # every other head frozen at the base run's output: before the sender's layer nothing has
    # changed yet, so the freezing starts at its layer
    copies: list[Copy] = [tuple(Patch("z", later, None, None, "base")
                                for later in range(layer, runs.layers)) + (Patch("z", layer, h),)
                          for layer, h in senders]
    group = runs.heads // runs.kv_heads
    wanted = {(receiver_site, layer) for layer, _ in receivers}
    out = []
    chunks = [group[i:i + engine.per_forward] for group in by_first_layer(copies)
              for i in range(0, len(group), engine.per_forward)]
    start = 0
    for chunk in chunks:
        report(f"path patching senders {start + 1}-{start + len(chunk)} of {len(copies)}")
        start += len(chunk)
        # to receivers, pass 1 is run for the receivers' inputs alone: it may stop there
        first, recorded = engine.patched(corrupt, chunk, {"base": own, "source": other}, wanted,
                                         scores=not receivers)
        if not receivers:
            out.append(first)
            continue
        second = [tuple(Patch(receiver_site, layer, h // group if receiver_site in "kv" else h,
                              None, "given") for layer, h in receivers)] * len(chunk)
        out.append(engine.patched(corrupt, second, {"given": recorded})[0])
    scores = torch.cat(out) if out else torch.zeros(0, engine.batch.pairs, dtype=torch.float64)
    target = "the logits" if not receivers else ", ".join(
        f"L{layer}H{h}" for layer, h in receivers) + f" ({receiver_site})"
    notes = []
    if receivers and receiver_site in "kv" and group > 1:
        notes.append(f"grouped-query: a receiver's {receiver_site} is its key/value head's, "
                     "shared by the query heads of its group")
    if not receivers:
        notes.append("to the logits: the sender's direct path and its paths through MLPs "
                     "and norms (every other head frozen)")
    grid = _grid(runs, scores, ("path", direction,
                                f"exact path patching, each sender head → {target}"),
                 runs.labels[:last], [f"H{h}" for h in range(runs.heads)])
    return replace(grid, notes=[*grid.notes, *notes])


def attribution_grids(runs: Runs, direction: PatchDirection, positions: list[str],
                      exact: dict[str, EffectGrid]) -> list[EffectGrid]:
    """First-order estimates for every head (all positions; at each position) and the residual
    stream per layer × position, from one forward and backward of the patched run; their
    Pearson correlation with the exact grids of `exact` (same site) in the notes."""
    engine = runs.engine
    corrupt, _, other = runs.sides(direction)
    sites = {"z"} | ({"resid"} if "resid" in engine.model.sites else set())
    scores, acts, grads = engine.gradients(corrupt, sites)
    H, layers = runs.heads, runs.layers
    # per layer, (P, L, H): the first-order change of each pair's metric per head and position
    # (a layer's length is its own: an encoder-decoder's decoder runs over the target)
    per_head = [((other[("z", i)] - acts[("z", i)]) * grads[("z", i)]).sum(-1).double().cpu()
                for i in range(layers)]
    base = scores.double()
    results: list[EffectGrid] = []

    def add(site: str, title: str, estimate: torch.Tensor, rows: list[str],
            cols: list[str]) -> None:
        grid = _grid(runs, estimate, (site, direction, title), rows, cols)
        twin = exact.get(site.removeprefix("attribution-"))
        if twin is not None:
            a = [v for row in grid.mean for v in row]
            b = [v for row in twin.mean for v in row]
            grid = replace(grid, notes=[
                *grid.notes, f"Pearson r with exact patching: {correlation(a, b):.3f} over "
                f"{len(a)} cells"])
        results.append(grid)
    whole = torch.stack([base[:, None] + t.sum(1) for t in per_head], 1)  # (P, layers, H)
    add("attribution-heads", "attribution patching (first order): head outputs",
        whole.reshape(-1, layers * H).T, runs.labels[:layers], [f"H{h}" for h in range(H)])
    if not positions:
        return results
    L = len(positions)
    at = (base[:, None, None, None] + torch.stack(per_head, 1))  # (P, layers, L, H)
    add("attribution-head-positions", "attribution patching (first order): each head at each "
        "position", at.permute(1, 3, 2, 0).reshape(layers * H * L, -1),
        [f"{runs.labels[i]}H{h}" for i in range(layers) for h in range(H)], positions)
    if "resid" in sites:
        resid = torch.stack([((other[("resid", i)] - acts[("resid", i)])
                              * grads[("resid", i)]).sum(-1) for i in range(layers)], 1)
        est = (base[:, None, None] + resid.double().cpu()).reshape(-1, layers * L).T
        add("attribution-residual", "attribution patching (first order): the residual stream "
            "per layer and position", est, runs.labels[:layers], positions)
    return results
