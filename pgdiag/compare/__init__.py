"""`pgdiag compare`: line two runs (or two streams of one run) up token by token and measure their parity.

Modules, in pipeline order: `align` joins the samples and checks that tokens, masks and values can be compared;
`parity` computes the mismatch table per scope and bucket; `breakdowns` assigns the buckets; `diagnose` looks for
temperature, first-token and processed-log-prob signatures; `worst` lists the worst tokens and sequences; `api`
ties them into `compare_runs(a, b) -> Report`. Nothing here runs at import time.
"""
