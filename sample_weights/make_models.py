"""Write tiny *loadable* Hugging Face models (config, tokenizer, weights) for the README's
`--model` examples, so every one of them runs offline from a fresh clone.

    python sample_weights/make_models.py        # needs the hf extra; about 2 s, ~1 MB in all

Each is a random-weight model written by transformers itself (`Config(...)` →
`Model(config).save_pretrained`) from the architecture zoo the tests use (tests/zoo.py: seeded,
hidden size 32, 2 layers, 4 heads, random biases, sharpened attention) plus a small WordLevel
tokenizer over the zoo's words ("the cat sat on the mat", "a small dog ran far away from the big
red barn in the cold night"; other words become <unk>). Random weights: the maps show how the
tool works, not what a trained model attends to (for that, see the bundled induction model and
all-MiniLM-L6-v2).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from zoo import build  # noqa: E402

# folder name → zoo kind: an encoder, a decoder with grouped-query stacked qkv, an encoder-decoder
MODELS = {"distilbert-tiny-model": "distilbert", "phi3-tiny-model": "phi3",
          "marian-tiny-model": "marian"}


def main(out: Path = HERE / "models") -> None:
    for name, kind in MODELS.items():
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        build(kind, folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {kind}, {size / 1024:.0f} KB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "models")
