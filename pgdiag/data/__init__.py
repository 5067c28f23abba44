"""The Parquet contract and reading/writing runs: schema, validation, flat buffers, `TokenBatch`, atomic writes.

Imports nothing from the stages above it (and never torch): every other stage reads runs through here.
"""
