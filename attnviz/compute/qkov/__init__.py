"""QK and OV circuits: factors, composition, the result."""
