"""Files the commands need at run time, shipped inside the package (found with
importlib.resources, so a wheel or any install prefix carries them): `induction.safetensors`,
the bundled model that `attnviz heatmap` runs by default (written by
sample_weights/train_induction.py; see sample_weights/NOTES_induction.md)."""
