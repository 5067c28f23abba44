"""The policy-gradient metric set: engine, families, loss modes, key styles, settings and `compute_metrics`."""
