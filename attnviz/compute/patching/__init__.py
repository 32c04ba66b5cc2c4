"""Activation patching between a clean and a corrupted prompt (attnviz patch): prompt pairs and
their metric (pairs, metric), the sites an activation is patched at (sites), the one generic
patch-and-measure loop (engine), exact path patching (path), attribution patching
(attribution), and the results (result)."""
