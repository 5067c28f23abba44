"""Capturing rollouts from a running trainer, for `pgdiag import` (docs/import.md).

In-trainer hooks: `pgdiag.capture.{verl,trl,openrlhf}.install(trainer, out_dir, every=1)`. Each hook wraps a few
methods of one trainer object (its class is untouched) and writes, every `every`-th step, one file
``step_<S>.pt`` (``step_<S>.rank<R>.pt`` when several processes write; format ``pgdiag.hookdump/v1``, written by
`dump.py`). Hooks import only the standard library and torch, never change what the wrapped method receives or
returns, draw no random numbers, run no collective, and switch themselves off after logging their first error once.

Beside the trainer: `pgdiag.capture.fast_llm` reads Fast-LLM's Redis document stream. Run it as
``python -m pgdiag.capture fast-llm --redis URL --out DIR --docs-per-step N``.
"""
