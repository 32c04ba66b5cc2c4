"""Write sample_weights/models/phi3-tiny-lm: the Phi-3 sample (models/phi3-tiny-model) with a
language-model head, so `heatmap --model ... --generate N` has a decoder sample to run on.

No new numbers: every weight is the Phi-3 sample's, and the head is its own token embedding
(tied, `tie_word_embeddings=True`: logits = final hidden state · embeddingᵀ), so the sample's
generations come from the same random tiny model the other examples show. Run from the repo root:
`python sample_weights/make_generate_sample.py` (needs transformers).
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "models" / "phi3-tiny-model"
TARGET = HERE / "models" / "phi3-tiny-lm"


def main() -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(SOURCE)
    config.tie_word_embeddings = True
    config.architectures = ["Phi3ForCausalLM"]
    model = transformers.Phi3ForCausalLM.from_pretrained(SOURCE, config=config)
    model.tie_weights()
    model.eval().save_pretrained(TARGET)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SOURCE / name, TARGET / name)
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
