"""Real pretrained models through Hugging Face transformers: load offline, capture, verify.

`run_plan` runs the model's own forward pass once through `attnviz.sources.hf.capture`: the layers
shown go through their module's own eager attention (in blocks of query rows under a memory
budget), the others through sdpa; models whose modeling file does not use transformers'
attention interface return their maps through `output_attentions` instead. Nothing here depends
on attnviz's layout registry: layers, their names and head counts come from the attention calls
of the forward pass itself (the run numbers them, or, where it must know them first, a 1-token
probe), so any model transformers loads without remote code works, recognized by `attnviz
inspect` or not.

Sequences are re-aligned so each sentence's real tokens sit at positions 0..n-1 (right padding),
as the renderers and `attnviz.compute.measures.stats` assume. Encoder-decoder models run their
encoder
alone, or, given a target per sentence, the decoder too: decoder self-attention (target × target)
and cross-attention (target × source).

`verify_layer` (the recompute proof) recomputes one layer's weights from its captured input with
attnviz's own AttentionLayer slices, read from the checkpoint files, and positions recomputed
from config.json by `attnviz.compute.forward_pass.positions` (never taken from the model); the
split proof,
which needs no per-family math, is `attnviz.sources.hf.split_proof`.
transformers is imported lazily: the core install works without it.

The parts: `load` (folder → LoadedModel), `inputs` (sentences → padded feed), `layers` (the
attention calls and the run's plan), `run` (the capture), `verify` (the recompute proof). Each
name has one home, its module: import it from there (this package re-exports nothing).
"""
