"""Files → named tensors, lazily and safely: safetensors, torch pickles, model folders, config.json.

Nothing here imports torch at module level: header-only work (`inspect`) never loads it."""
