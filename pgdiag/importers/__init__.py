"""Importers: framework rollout dumps to canonical pgdiag runs (docs/import.md).

`base` holds the interface every preset implements (`ImportOptions`, `ImportedStep`, `Preset`, the registry
and the E701-E703 errors); `safe_load` loads pickles and ``.pt`` files without running code; `alignment` and
`ids` are the helpers presets use; `writer` validates and writes the run, all or nothing.
"""
