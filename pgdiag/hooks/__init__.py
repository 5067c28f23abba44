"""In-trainer hooks: `pgdiag.hooks.{verl,trl,openrlhf}.install(trainer, out_dir, every=1)`.

Each hook wraps a few methods of one trainer object (its class is untouched) and writes, every `every`-th step,
one file ``step_<S>.pt`` (``step_<S>.rank<R>.pt`` when several processes write) that ``pgdiag import`` reads.
Hooks import only the standard library and torch, never change what the wrapped method receives or returns,
draw no random numbers, run no collective, and switch themselves off after logging their first error once.
The file format (``pgdiag.hookdump/v1``) and each hook's fields are documented in docs/import.md.
"""
