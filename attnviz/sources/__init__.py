"""Where runs come from: a random nn.MultiheadAttention, a checkpoint layer, the bundled model,
a Hugging Face model."""
