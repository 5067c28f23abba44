"""Analyses over a batch or a whole run: `whatif` (off-policy correction rules replayed on a saved batch)."""
