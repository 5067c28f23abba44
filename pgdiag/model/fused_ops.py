"""The fused pointwise ops of the decoder (``fuse_pointwise=True``): Triton kernels on CUDA, `torch.compile`
elsewhere, and the process environment `torch.compile` starts under.

What: `FusedOp(kernel, reference)` calls the Triton kernel named `kernel` of `pgdiag.model.pointwise_triton` on CUDA
tensors of one dtype, and otherwise `reference` compiled by `torch.compile` at its first call (`LazyCompiled`:
dynamic shapes, full graph, every cast rounded as eager). `prepare_compile_environment(environ)` sets, where the
user has not, before the first compile:

- ``TORCH_WARM_POOL=0``: Inductor's backend otherwise starts its pool of compile workers (a helper process and one
  worker a CPU core, each importing torch) at the first compiled call, compiled or cached; a run whose kernels all
  came from the cache never used it, yet the workers took the CPUs during the start and the exit waited for them
  (2.7 s of a warm start on an H200). With the flag Inductor starts the pool at the first kernel it compiles.
- ``TRITON_CACHE_DIR`` = the folder Inductor picks for its kernels (``<inductor cache>/triton/0``). Inductor sets
  it only while compiling, not when it loads a cached graph, so a Triton kernel first compiled beside a fresh
  compile was looked for elsewhere on the next start and compiled again (1.3 s for the LM head).

Why: on CUDA every process paid dynamo's and Inductor's imports, the tracing of each op and its guards, about 6 s
of a warm start (docs/benchmarks.md, "Start-up: the warm fixed cost"), for kernels that Triton loads from its
cache in milliseconds; nothing imports dynamo now unless a compiled function runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any

import torch


def prepare_compile_environment(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set ``TORCH_WARM_POOL`` and ``TRITON_CACHE_DIR`` in `environ` where unset (see the module docstring);
    returns the variables set."""
    wanted = {"TORCH_WARM_POOL": "0"}
    if "TRITON_CACHE_DIR" not in environ:
        try:
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
        except ImportError:  # another torch layout: Triton and Inductor keep their own choice
            pass
        else:
            wanted["TRITON_CACHE_DIR"] = triton_cache_dir(0)
    added = {key: value for key, value in wanted.items() if key not in environ}
    environ.update(added)
    return added


class LazyCompiled:
    """`fn` under `torch.compile` (dynamic shapes, full graph, ``emulate_precision_casts``: every bf16 cast
    rounded as eager, not once at the end), compiled at its first call."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.compiled: Callable[..., torch.Tensor] | None = None

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.compiled is None:
            prepare_compile_environment(os.environ)
            self.compiled = torch.compile(
                self.fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
            )
        return self.compiled(*args)


class FusedOp:
    """`reference` as one kernel: `pgdiag.model.pointwise_triton`'s `kernel` when the tensor arguments are CUDA
    tensors of one dtype, else `reference` under `LazyCompiled`."""

    def __init__(self, kernel: str, reference: Callable[..., torch.Tensor]) -> None:
        self.kernel = kernel
        self.reference = reference
        self.compiled = LazyCompiled(reference)

    def __call__(self, *args: Any) -> torch.Tensor:
        if _on_triton(args):
            from pgdiag.model import pointwise_triton

            return getattr(pointwise_triton, self.kernel)(*args)
        return self.compiled(*args)

    def into(self, out: torch.Tensor, *args: Any) -> torch.Tensor:
        """`self(*args)` written into `out`: in place by the Triton kernel (the RMSNorm kernels take `out`), else
        computed and copied."""
        if _on_triton(args):
            from pgdiag.model import pointwise_triton

            return getattr(pointwise_triton, self.kernel)(*args, out=out)
        return out.copy_(self.compiled(*args))


def _on_triton(args: tuple[Any, ...]) -> bool:
    """Whether `FusedOp` runs its Triton kernel on these arguments: CUDA tensors of one dtype."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return tensors[0].is_cuda and all(t.dtype == tensors[0].dtype for t in tensors)
