"""torch: the per-head kernel, masks, positions, streaming, statistics, maps, split and proofs."""
