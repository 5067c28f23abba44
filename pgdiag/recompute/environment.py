"""Where a recompute ran: the versions and device recorded in every part's footer, and the peak memory it used.

Why apart: these describe the machine, not the computation; `pgdiag.recompute.plan` writes `environment` into the
footer, `pgdiag.recompute.logprobs` reports `peak_memory` in the result.
"""

from __future__ import annotations

import platform
import resource
from typing import Any

import torch

from pgdiag import __version__


def environment(device: torch.device) -> dict[str, Any]:
    """The ``env`` entry of the footer: pgdiag, torch, triton and CUDA versions, and the device name."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "pgdiag": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": name,
    }


def peak_memory(device: torch.device) -> int:
    """Peak CUDA memory allocated on `device`, else the process's peak resident set size, in bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
