"""Two models compared head by head: their attention weights (`head_weights`: which heads are
byte-identical, how far each head moved) and a statistic's per-head difference over the same
examples with its interval (`paired`, with the t quantile it needs in `student_t`)."""
