"""What `--generate` asks for: how many tokens, greedy or sampled (torch-free; shared by the
Hugging Face and the bundled model's generation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# GenerateSpec is the request's own (attnviz.core.request), shared by both generators
from attnviz.core.request import GenerateSpec


def unnamed(token_id: int) -> str:
    """How a generated id with no token of its own is shown, in every output: an id past a
    Hugging Face tokenizer's vocabulary (attnviz.sources.hf.token_names), or an id of the bundled
    model's hashed vocabulary that is no prompt word."""
    return f"<id {int(token_id)}>"


@dataclass
class Generation:
    """What was generated, per sentence, and how."""

    prompt_ids: list[list[int]]  # the prompt's (decoder) or source's (encoder-decoder) ids
    generated_ids: list[list[int]]  # up to and including the first end-of-sequence token
    generated_tokens: list[list[str]]
    texts: list[str]  # the generated tokens decoded
    prompt_lengths: list[int]  # where the generated tokens start in the maps' rows
    spec: GenerateSpec
    method: str
    encoder_decoder: bool = False
    # the model's generation_config fields attnviz overrode ('num_beams 3'), see
    # attnviz.sources.hf.generate_settings
    set_aside: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"generated_ids": self.generated_ids, "generated_tokens": self.generated_tokens,
                "generated_text": self.texts, "prompt_length": self.prompt_lengths,
                "method": self.method, "set_aside": self.set_aside, "sample": self.spec.sample,
                "temperature": self.spec.temperature, "top_p": self.spec.top_p,
                "seed": self.spec.seed, "max_new_tokens": self.spec.max_new}

    def export_metadata(self) -> dict[str, str]:
        """--export's metadata fields (JSON strings), per sentence."""
        import json

        return {"generated_ids": json.dumps(self.generated_ids),
                "generated_tokens": json.dumps(self.generated_tokens),
                "prompt_length": json.dumps(self.prompt_lengths),
                "generation": self.method}


@dataclass(frozen=True)
class Focus:
    """One generated token and the tokens its row (the one the model computed when the token was
    fed back in) attends to most, in one layer, for one head or the mean over heads."""

    sentence: int
    row: int  # the token's row in the layer's map
    token: str
    layer: str  # the layer's label
    head: int | None  # None: the mean over heads
    top: list[tuple[int, str, float]]  # (key position, key token, weight), largest first

    def to_json(self) -> dict[str, Any]:
        return {"sentence": self.sentence, "row": self.row, "token": self.token,
                "layer": self.layer, "head": self.head,
                "top": [{"position": p, "token": t, "weight": w} for p, t, w in self.top]}
