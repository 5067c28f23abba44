"""`pgdiag logprobs`: rollouts -> packing -> model -> LM-head kernel -> part files, and the worker launch."""
