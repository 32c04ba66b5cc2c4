"""Attention flow (Abnar & Zuidema 2020): the maximum flow from each input token to the output
position in the layered attention graph, computed exactly with Dinic's algorithm.

The graph has a node (k, j) for token j entering layer k (k = 0 … n) and an edge
(k, j) → (k + 1, i) of capacity Ã_k[i, j] (the mixed attention of `rollout.mixed`: what query i
of layer k reads from key j, residual included). The flow of input token s is the max flow from
(0, s) to (n, p). Capacities are floats; an edge counts as saturated below SATURATED, far under
any weight a float32 softmax produces that matters, so augmenting terminates.

Cost: one max flow per input token over n·L² edges, in plain Python: the command refuses flow
past FLOW_MAX_TOKENS tokens up front (`flow_problem`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

FLOW_MAX_TOKENS = 48  # one exact max flow per input token over layers · L² edges, in Python
FLOW_MAX_EDGES = 200_000  # layers · L² edges for all tokens, summed over the flows
SATURATED = 1e-12


def flow_problem(tokens: int, layers: int) -> str | None:
    """Why flow is refused for this input, or None."""
    edges = layers * tokens * tokens
    if tokens > FLOW_MAX_TOKENS or edges > FLOW_MAX_EDGES:
        return (f"attention flow solves one exact max flow per input token over layers × L² "
                f"edges in plain Python; {tokens} tokens × {layers} layers is past its limit "
                f"of {FLOW_MAX_TOKENS} tokens and {FLOW_MAX_EDGES:,} edges")
    return None


@dataclass
class Network:
    """A directed graph for Dinic's algorithm: edge e runs to[e] with capacity cap[e]; its
    reverse is e ^ 1."""

    nodes: int
    to: list[int] = field(default_factory=list)
    cap: list[float] = field(default_factory=list)
    out: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = [[] for _ in range(self.nodes)]

    def add(self, a: int, b: int, capacity: float) -> None:
        self.out[a].append(len(self.to))
        self.to.append(b)
        self.cap.append(capacity)
        self.out[b].append(len(self.to))
        self.to.append(a)
        self.cap.append(0.0)


def max_flow(net: Network, source: int, sink: int) -> float:
    """Dinic's algorithm: BFS levels, then blocking flows by DFS (iterative) until the sink is
    unreachable. `net`'s capacities become the residual ones."""
    total = 0.0
    while True:
        level = _levels(net, source)
        if level[sink] < 0:
            return total
        pointer = [0] * net.nodes
        while True:
            pushed = _push(net, source, sink, level, pointer)
            if pushed <= 0:
                break
            total += pushed


def _levels(net: Network, source: int) -> list[int]:
    level = [-1] * net.nodes
    level[source] = 0
    queue = deque([source])
    while queue:
        a = queue.popleft()
        for e in net.out[a]:
            b = net.to[e]
            if level[b] < 0 and net.cap[e] > SATURATED:
                level[b] = level[a] + 1
                queue.append(b)
    return level


def _push(net: Network, source: int, sink: int, level: list[int], pointer: list[int]) -> float:
    """One augmenting path in the level graph (iterative DFS with current-arc pointers)."""
    path: list[int] = []  # edges from source
    node = source
    while True:
        if node == sink:
            amount = min(net.cap[e] for e in path)
            for e in path:
                net.cap[e] -= amount
                net.cap[e ^ 1] += amount
            return amount
        edges = net.out[node]
        advanced = False
        while pointer[node] < len(edges):
            e = edges[pointer[node]]
            b = net.to[e]
            if net.cap[e] > SATURATED and level[b] == level[node] + 1:
                path.append(e)
                node = b
                advanced = True
                break
            pointer[node] += 1
        if advanced:
            continue
        if not path:
            return 0.0
        level[node] = -1  # a dead end: never visited again in this phase
        e = path.pop()
        node = net.to[e ^ 1]
        pointer[node] += 1


def layered_network(matrices: list[torch.Tensor]) -> Network:
    """Nodes k·L + j; edges (k, j) → (k + 1, i) of capacity Ã_k[i, j] > 0."""
    L = matrices[0].shape[-1]
    net = Network((len(matrices) + 1) * L)
    for k, M in enumerate(matrices):
        rows = M.double().cpu().tolist()
        for i in range(L):
            for j, weight in enumerate(rows[i]):
                if weight > 0:
                    net.add(k * L + j, (k + 1) * L + i, weight)
    return net


def attention_flow(matrices: list[torch.Tensor], position: int) -> torch.Tensor:
    """(L,) the max flow from each input token to the output position (float64)."""
    L, n = matrices[0].shape[-1], len(matrices)
    values = torch.zeros(L, dtype=torch.float64)
    for s in range(L):
        values[s] = max_flow(layered_network(matrices), s, n * L + position)
    return values
