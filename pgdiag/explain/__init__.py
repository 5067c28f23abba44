"""`pgdiag explain`: why two log-prob streams of a run disagree, attributed to a fixed vocabulary of causes.

`explain_run(run, model)` (`explain.api`) runs a recompute matrix on a token budget and removes the causes one
after another (docs/explain.md); `compare_layers` (`explain.layers`) finds the first layer where two recompute
configurations diverge.
"""
