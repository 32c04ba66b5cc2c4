"""The answer of `attnviz tokens` (what the renderers draw): per sentence each method's chain
and per-layer matrices, the leave-one-out effects and each method's correlation with them; over
the sentences each method's mean and spread of that correlation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnviz.compute.tokenflow.trace import Erasures
from attnviz.core.choices import HeadReduce, TokenMethod

TOP_TOKENS = 3


@dataclass
class SentenceTokens:
    """One sentence's answer."""

    tokens: list[str]
    position: int
    layers: list[str]
    chains: dict[TokenMethod, Any]  # method → (n + 1, L) float64 tensor
    mixed: list[Any]  # per layer (L, L): rollout's Ã (flow's capacities)
    matrices: dict[TokenMethod, list[Any]] = field(default_factory=dict)  # method → per layer
    effects: Any | None = None  # (L,) float64 leave-one-out effect, NaN where not erased
    erasures: Erasures | None = None
    correlations: dict[TokenMethod, float | None] = field(default_factory=dict)
    # the decoder's view of the source (an encoder-decoder with a target): the decoder's
    # tokens, which `position` indexes, and the share of the output left on them
    output_tokens: list[str] | None = None
    decoder_share: Any | None = None  # (T,) float64: rollout's
    # every method's (T,) share left on the decoder's tokens (flow: each one's max flow)
    decoder_shares: dict[TokenMethod, Any] = field(default_factory=dict)

    @property
    def output_is_input(self) -> bool:
        return self.output_tokens is None

    def output_name(self) -> str:
        """The output token as `word@index` (a decoder token for the cross view)."""
        tokens = self.tokens if self.output_tokens is None else self.output_tokens
        return f"{tokens[self.position]}@{self.position}"

    def reached(self, causal: bool) -> int:
        """How many input tokens the output can reach: tokens 0..p of a causal model, all of a
        bidirectional one, every source token for the decoder's view."""
        if self.output_tokens is None and causal:
            return self.position + 1
        return len(self.tokens)

    def scores(self, method: TokenMethod) -> list[float]:
        """The method's value per input token."""
        return [float(v) for v in self.chains[method][0]]

    def top(self, method: TokenMethod, count: int = TOP_TOKENS, reach: int | None = None
            ) -> list[int]:
        """The `count` tokens the method rates highest, among the first `reach` (the tokens
        the output can see: a causal model's later tokens, which hold 0, are never named)."""
        values = self.chains[method][0]
        seen = len(self.tokens) if reach is None else min(reach, len(self.tokens))
        order = sorted(range(seen), key=lambda j: (-float(values[j]), j))
        return order[:count]


@dataclass
class TokensResult:
    source: str
    causal: bool
    methods: tuple[TokenMethod, ...]
    sentences: list[SentenceTokens]
    summary: dict[TokenMethod, tuple[float | None, float | None, int]]  # mean, spread, count
    heads: HeadReduce
    residual_weight: float
    measure: str | None
    erased_how: str | None
    notes: list[str] = field(default_factory=list)

    def best(self) -> list[TokenMethod]:
        """The methods whose mean correlation with erasure is the highest (ties: all)."""
        rated = [(m, s[0]) for m, s in self.summary.items() if s[0] is not None]
        if not rated:
            return []
        top = max(r for _, r in rated)
        return [m for m, r in rated if r >= top - 1e-9]

    def to_json(self) -> dict[str, Any]:
        def floats(t: Any) -> Any:
            return t.tolist() if t is not None else None

        return {
            "source": self.source, "causal": self.causal,
            "methods": [str(m) for m in self.methods], "heads": str(self.heads),
            "residual_weight": self.residual_weight, "measure": self.measure,
            "erased": self.erased_how,
            "summary": {str(m): {"mean": s[0], "spread": s[1], "sentences": s[2]}
                        for m, s in self.summary.items()},
            "best": [str(m) for m in self.best()],
            "sentences": [{
                "tokens": s.tokens, "position": s.position, "layers": s.layers,
                "scores": {str(m): s.scores(m) for m in self.methods},
                "chains": {str(m): floats(s.chains[m]) for m in self.methods},
                "matrices": {str(m): [floats(M) for M in s.matrices[m]]
                             for m in self.methods},
                "effects": floats(s.effects),
                "output": s.output_name(), "decoder_tokens": s.output_tokens,
                "decoder_share": floats(s.decoder_share),
                "decoder_shares": {str(m): floats(v) for m, v in s.decoder_shares.items()},
                "correlations": {str(m): c for m, c in s.correlations.items()},
            } for s in self.sentences],
            "notes": self.notes,
        }
