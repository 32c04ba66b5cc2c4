"""What the split proof (`split --model --verify`) found: one check per perturbed head, and
the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnviz.core.layer import AttentionLayer

# "unchanged": equal to float round-off, by the dtype the model runs in
UNCHANGED = {"float32": 1e-6, "bfloat16": 1e-3, "float16": 1e-4}
CHANGED_FACTOR = 100  # "changed": above this many times the unchanged tolerance
UNIFORM = 1e-3  # a map whose rows spread less than this cannot show a change


@dataclass(frozen=True)
class HeadCheck:
    """One perturbation and what it did."""

    projection: str  # "q", "k" or "v"
    head: int  # the query head (q) or key/value head (k, v) whose rows were negated
    rows: str  # where, in the stored tensors
    expected: tuple[int, ...]  # the query heads that should change
    deltas: tuple[float, ...]  # per query head: max |Δ| of its map (q, k) or W_o input slice (v)
    status: str  # "pass", "fail" or "untestable"
    reason: str = ""

    @property
    def others(self) -> float:
        """The largest change of a head that should not have changed."""
        return max((d for h, d in enumerate(self.deltas) if h not in self.expected), default=0.0)

    @property
    def own(self) -> float:
        """The smallest change of a head that should have changed."""
        return min(self.deltas[h] for h in self.expected)


@dataclass(frozen=True)
class ProofResult:
    layer_index: int  # the call index in the model's forward pass
    label: str  # "3", "enc 1", "cross 0"
    module: str  # the module that runs it
    layer: AttentionLayer  # the description whose rows were perturbed
    checks: list[HeadCheck]
    unchanged: float  # tolerance of "unchanged"
    changed: float  # threshold of "changed"
    sentences: int
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    @property
    def failures(self) -> list[HeadCheck]:
        return [check for check in self.checks if check.status == "fail"]

    @property
    def untestable(self) -> list[HeadCheck]:
        return [check for check in self.checks if check.status == "untestable"]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer_index, "label": self.label, "module": self.module,
                "passed": self.passed, "unchanged_tolerance": self.unchanged,
                "changed_threshold": self.changed,
                "checks": [{"projection": c.projection, "head": c.head, "rows": c.rows,
                            "expected": list(c.expected), "deltas": list(c.deltas),
                            "status": c.status, "reason": c.reason} for c in self.checks]}
