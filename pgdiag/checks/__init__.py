"""Semantic checks of log-prob streams (`pgdiag check`), one implementation used by check, metrics and compare."""
