"""The decoder's Triton pointwise kernels on the CPU through the Triton interpreter
(`pointwise_interpret_cases.py`, run in a child pytest: Triton reads TRITON_INTERPRET when a kernel is defined)."""

from __future__ import annotations

from pathlib import Path

from triton_interpreter import run_interpreted


def test_kernel_cases_under_the_interpreter() -> None:
    run_interpreted(Path(__file__).with_name("pointwise_interpret_cases.py"))
