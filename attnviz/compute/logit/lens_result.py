"""The results of `attnviz lens` (the logit lens), as the use case returns them and the
renderers draw them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cell:
    """One layer × position: the top tokens and the answer's rank and probability."""

    top: list[tuple[str, float]]  # (token, probability), best first
    answer_rank: int | None
    answer_prob: float | None

    def to_json(self) -> dict[str, Any]:
        return {"top": [{"token": t, "prob": p} for t, p in self.top],
                "answer_rank": self.answer_rank, "answer_prob": self.answer_prob}


@dataclass(frozen=True)
class PromptLens:
    prompt: str
    tokens: list[str]
    positions: list[int]  # the columns
    rows: list[str]  # "embeddings", "layer 0", ...
    cells: list[list[Cell]]  # [row][column]
    answer: tuple[int, str] | None

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "tokens": self.tokens, "positions": self.positions,
                "rows": self.rows, "answer": None if self.answer is None else
                {"id": self.answer[0], "token": self.answer[1]},
                "cells": [[c.to_json() for c in row] for row in self.cells]}


@dataclass(frozen=True)
class LensResult:
    model: str
    norm: str
    transform: str
    prompts: list[PromptLens]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"command": "lens", "model": self.model, "final_norm": self.norm,
                "final_norm_statistics": "each row's own (the norm module run on that row)",
                "logit_transform": self.transform,
                "rows": "embeddings (the residual entering layer 0), then the residual after "
                        "each layer; the last row is the model's own output",
                "prompts": [p.to_json() for p in self.prompts], "notes": self.notes}
