"""The Triton LM-head kernel on the CPU through the Triton interpreter, and its launch heuristics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pgdiag.kernels.lm_head_logprobs_triton import choose_n_splits, head_mode_for

REPO = Path(__file__).resolve().parents[2]


def test_kernel_cases_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    cases = Path(__file__).with_name("triton_interpret_cases.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_choose_n_splits_fills_whole_waves() -> None:
    # 128 token blocks x 594 vocab tiles on 132 SMs: 33 splits of 18 tiles are exactly 32 waves
    assert choose_n_splits(128, 594, 132) == 33
    assert choose_n_splits(1, 1, 132) == 1
    # one token block: as many splits as there are slots (capped by the tile count)
    assert choose_n_splits(1, 40, 8) == 8


def test_head_modes() -> None:
    import torch

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert head_mode_for("bf16", bf16, f32) == "bf16"
    assert head_mode_for("fp32", bf16, f32) == "bf16x3"
    assert head_mode_for("fp32", bf16, bf16) == "bf16x3"
    assert head_mode_for("fp32", f16, f32) == "fp16x3"
    assert head_mode_for("fp32", f16, f16) == "fp16x3"
    assert head_mode_for("fp32", f32, bf16) == "tf32x3"
