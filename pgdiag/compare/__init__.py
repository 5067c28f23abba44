"""`pgdiag compare`: line two runs (or two streams of one run) up token by token and measure their parity.

Modules, in pipeline order: `settings` (`CompareSettings`); `align` joins the samples and runs the checks of
`pgdiag.checks` that tokens, masks and values can be compared; `parity` computes the mismatch table per scope and
bucket; `breakdowns` assigns the buckets; the signatures of `pgdiag.checks.signatures` name causes (`tau` fits the
exact temperature from logits); `worst` lists the worst tokens and sequences; `side_by_side` adds each run's own
metric set; `api` ties them into `compare_runs(a, b, CompareSettings) -> Comparison`; `output` and `tokens` write
what `--out` and `--tokens-out` ask for. Nothing here runs at import time.
"""
