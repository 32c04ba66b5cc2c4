"""Which input tokens reach one output position through all layers (`attnviz tokens`):
attention rollout and attention flow (Abnar & Zuidema 2020), residual- and norm-aware
contributions (Kobayashi et al. 2021; ALTI, Ferrando et al. 2022) composed across layers, and a
leave-one-out faithfulness check (Spearman rank correlation of each method with erasure)."""
