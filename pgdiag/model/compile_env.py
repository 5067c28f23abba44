"""The process environment `torch.compile` starts under when the model fuses its pointwise ops.

What: `prepare_compile_environment(environ)` sets two variables that the user has not set, before the first
compiled call, and returns what it set:

- ``TORCH_WARM_POOL=0``: Inductor's backend otherwise starts its pool of compile workers (a helper process and
  one worker a CPU core, each importing torch) at the first compiled call, compiled or cached. A recompute whose
  kernels all come from the cache never uses the pool, yet the workers took the CPUs during the start and the
  interpreter's exit waited for them to stop (2.7 s of a warm run on an H200; docs/benchmarks.md, "Start-up: the
  warm fixed cost"). With the flag Inductor starts the pool at the first kernel it really compiles, so a cold
  start still compiles in parallel.
- ``TRITON_CACHE_DIR`` = the folder Inductor picks for its own kernels (``<inductor cache>/triton/0``). Inductor
  sets it only while compiling, not when it loads a cached graph, so pgdiag's own Triton kernels (the LM head)
  were cached in Inductor's folder on a first start and looked for in Triton's default folder on the next one,
  and compiled again there (1.3 s). One folder every time: they are compiled once.

Why here: the CLI and the library both build the model through `pgdiag.model.transformer.pointwise_ops`, the
one place that calls `torch.compile`; variables the user set are left alone.
"""

from __future__ import annotations

from collections.abc import MutableMapping


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
