"""Torch-free vocabulary shared by every layer: the attention layer description, words."""
