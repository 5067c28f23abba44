"""Captures: record what a trainer consumes but never writes to disk, for `pgdiag import` (docs/import.md).

`pgdiag.capture.fast_llm` reads Fast-LLM's Redis document stream beside the trainer. Run it as
``python -m pgdiag.capture fast-llm --redis URL --out DIR --docs-per-step N``.
"""
