"""attnviz: see how multi-head attention splits its projections, on any weights."""

__version__ = "0.1.0"
