"""Head statistics over a corpus, streamed: per-example sums of every statistic
`attnviz.compute.measures.stats` takes (`corpus_examples`), added into float64 accumulators that
merge by
addition (`corpus_sums.CorpusSums`: one process, many batches, many ranks, a resumed run), and
the summary they give (`corpus_summary`: each head's mean with a 95 % interval over examples,
its type, the type's bootstrap stability and how many examples it took to settle).

Everything the summary needs is a sum over examples, so nothing grows with the corpus:
- Σ s_i, Σ s_i², Σ c_i, Σ c_i², Σ s_i c_i per (layer, head, statistic), where example i adds
  s_i (the sum of the statistic over its queries) and c_i (how many queries it has);
- the same Σ s, Σ c under R Poisson(1) bootstrap weights drawn from (seed, example ordinal): the
  resamples are the same whichever rank, batch or resumed run sees an example;
- Σ s, Σ c per band of example ordinals (1, 2, 3, 4, 6, 8, 12, …): prefix sums at each band's
  end give the labels after the first k examples.
"""
