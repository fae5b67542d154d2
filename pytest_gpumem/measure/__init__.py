"""Measuring beyond one call: memory-saving strategies tried on the user's own training step (`advise`)."""
