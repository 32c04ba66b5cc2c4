"""How heads split the projections, and the split proof's views."""
