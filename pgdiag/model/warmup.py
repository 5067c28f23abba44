"""First-call costs of a CUDA start paid while the weights stream in, off the path to the first forward.

What: `triton_key_thread()` starts (once per process) a daemon thread that calls Triton's ``triton_key()`` and
returns it; whoever is about to launch the first Triton kernel joins it (`pgdiag.model.transformer.
warm_pointwise_ops`). `warm_library_kernels(model, device, dtype)` runs one small GEMM in the body's dtype and one
attention call of the model's backend and head sizes, so that cuBLAS makes its handle and workspace and the CUDA
kernels of those calls are loaded now. The loader calls both while `pgdiag.model.weight_stream` copies the weights
(`pgdiag.model.checkpoint.load_from_source`); the stream, not the main thread, is the longer of the two there.

Why: the first Triton kernel a process launches, even one found in Triton's cache, first computes ``triton_key()``:
a SHA-256 of ``libtriton`` and of Triton's compiler sources, 0.45 s of a warm 8B start on an H200 host
(docs/benchmarks.md, "Start-up: the warm fixed cost"). Triton keeps the answer (``functools.lru_cache``), so
computing it beforehand on a thread (the hashing and the file reads release the GIL) takes it off the main thread.
One process computes one key: the thread is made once (`functools.cache`). The library calls change no value:
their outputs are dropped, and a GEMM or attention call gives the same bits whatever ran before it.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pgdiag.model.attention import PackedDocs, packed_attention

if TYPE_CHECKING:
    from pgdiag.model.transformer import CausalLM


@functools.cache
def triton_key_thread() -> threading.Thread:
    """The started thread computing ``triton_key()`` (the same one on every call)."""
    thread = threading.Thread(target=_compute_triton_key, daemon=True, name="pgdiag-triton-key")
    thread.start()
    return thread


def _compute_triton_key() -> None:
    """Call ``triton_key()`` where this Triton keeps it (``triton.runtime.cache``, or ``triton.compiler.compiler``
    in older releases); nothing when Triton is missing or fails: its own compile reports that."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return
    try:
        triton_key()
    except Exception:
        return


def warm_library_kernels(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """One (64, H) x (H, 64) GEMM in `dtype` and one causal attention call over 64 tokens with the model's heads
    on `device`, outputs dropped. No-op off CUDA."""
    if torch.device(device).type != "cuda":
        return
    attn = model.model.layers[0].self_attn
    n, h, d = 64, model.config.hidden_size, attn.head_dim
    with torch.inference_mode():
        x = torch.randn(n, h, device=device, dtype=dtype)  # (n, H)
        F.linear(x, torch.randn(n, h, device=device, dtype=dtype))  # (n, n)
        q = torch.randn(n, attn.local_num_heads, d, device=device, dtype=dtype)  # (n, Hq_local, D)
        kv = torch.randn(n, attn.local_num_kv_heads, d, device=device, dtype=dtype)  # (n, Hkv_local, D)
        docs = PackedDocs.from_cu_seqlens(torch.tensor([0, n], dtype=torch.int32), n, torch.device(device))
        packed_attention(q, kv, kv, docs, window=None, backend=model.attention_backend)
