"""What is measured on maps: head statistics, ranking, the overview, value-weighted norms, the
scorecard's measures."""
