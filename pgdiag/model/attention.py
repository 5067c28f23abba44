"""Causal attention over packed documents, with PyTorch's own kernels.

What: `packed_attention(q, k, v, docs, window=..., backend=...)` attends each token only to earlier tokens of its
own document (and, for sliding-window layers, only to the last `window` of them, itself included, as HF's
masks do). Documents are packed back to back with no padding; `PackedDocs` holds their boundaries.

Why two backends, chosen by an argument (never an env var):
- ``"varlen"``: FlashAttention's varlen forward on CUDA, bf16/fp16. One kernel for the whole packed batch, GQA and
  sliding windows native: no padding, no mask tensor. Called as ``aten::_flash_attention_forward``, with the
  arguments `torch.nn.attention.varlen.varlen_attn` gives it (torch 2.11 to 2.13: the same kernel, the same bits),
  not through `varlen_attn` itself: its custom op's wrapper imports dynamo at the first call (1.55 s of every
  start, docs/benchmarks.md). A torch whose op lacks the window arguments gets `varlen_attn`.
- ``"sdpa"``: `scaled_dot_product_attention` once per document (``is_causal=True``; a boolean band mask only
  for a sliding window shorter than the document). Runs everywhere, any dtype; the CPU path and the reference.
`resolve_attention_backend("auto", device, dtype)` picks ``varlen`` on CUDA for a bf16/fp16 body when this torch
has it, else ``sdpa``.

Attention sinks (gpt-oss): one learned logit per head joins every query's softmax as an extra key whose value
is zero, so the weights of the real keys sum to less than one. ``sdpa`` computes this per document as HF's
eager attention does (the logits with the sink appended, softmax, sink dropped); ``varlen`` rescales the
sink-free output by ``sigmoid(lse - sink)`` from the kernel's log-sum-exp, the same quantity.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pgdiag.errors import Code, UsageError

ATTENTION_BACKENDS = ("auto", "sdpa", "varlen")


@dataclass(frozen=True)
class PackedDocs:
    """Document boundaries of a packed batch: document d owns tokens ``bounds[d]:bounds[d + 1]``."""

    cu_seqlens: Tensor  # (D + 1,) int32 on the compute device
    bounds: tuple[int, ...]  # the same offsets as Python ints (read once per forward)
    max_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, n_tokens: int, device: torch.device) -> PackedDocs:
        """Validate `cu_seqlens` (D+1,) against `n_tokens`; raises ValueError on a malformed one."""
        bounds = tuple(int(b) for b in cu_seqlens.tolist())
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n_tokens:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the token count {n_tokens}, got {bounds}"
            )
        lengths = [b - a for a, b in pairwise(bounds)]
        if min(lengths) <= 0:
            raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
        return cls(cu_seqlens.to(device=device, dtype=torch.int32), bounds, max(lengths))


def varlen_available() -> bool:
    """True when a CUDA device is present and this torch has FlashAttention's varlen forward (the op, or
    `torch.nn.attention.varlen`; found without importing the module, whose import alone loads dynamo in torch
    2.13)."""
    if not torch.cuda.is_available():
        return False
    if _flash_forward_op() is not None:
        return True
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _flash_forward_op() -> Any:
    """``aten::_flash_attention_forward`` when it takes the window arguments `varlen_attn` passes, else None (an
    older torch; ROCm, whose op returns a padded log-sum-exp)."""
    if torch.version.hip is not None:
        return None
    try:
        op = torch.ops.aten._flash_attention_forward.default
    except AttributeError:
        return None
    names = {argument.name for argument in op._schema.arguments}
    return op if {"window_size_left", "window_size_right"} <= names else None


def _flash_varlen(
    op: Any, q: Tensor, k: Tensor, v: Tensor, docs: PackedDocs, window: int | None
) -> tuple[Tensor, Tensor]:
    """FlashAttention over the packed documents, the call `varlen_attn(..., window_size=(left, 0))` makes inside
    its custom op (torch 2.11-2.13, torch/nn/attention/varlen.py): dropout 0, causal exactly when there is no
    window, the window's left and right sizes. k and v keep their Hkv heads: the kernel reads kv head
    ``h // (Hq / Hkv)`` for query head h, as `varlen_attn`'s ``enable_gqa`` does. Returns (out (N, Hq, D),
    lse (Hq, N) fp32)."""
    left = -1 if window is None else window - 1
    cu = docs.cu_seqlens
    out, lse, *_ = op(
        q, k, v, cu, cu, docs.max_len, docs.max_len, 0.0, window is None,
        return_debug_mask=False, scale=None, window_size_left=left, window_size_right=0,
    )  # fmt: skip
    return out, lse


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that will run for a body in `dtype`: ``auto`` -> ``varlen`` on CUDA when available and the
    body is 16-bit (FlashAttention has no fp32 kernel), else ``sdpa``."""
    if requested not in ATTENTION_BACKENDS:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"unknown attention backend {requested!r}; choose one of {ATTENTION_BACKENDS}",
        )
    varlen_ok = device.type == "cuda" and varlen_available() and dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        return "varlen" if varlen_ok else "sdpa"
    if requested == "varlen" and not varlen_ok:
        raise UsageError(
            Code.DEVICE_UNAVAILABLE,
            f"attention backend 'varlen' needs CUDA, torch.nn.attention.varlen and a 16-bit body (got {dtype})",
            "use --attn sdpa or auto",
        )
    return requested


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    docs: PackedDocs,
    *,
    window: int | None,
    backend: str,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention within each document.

    q: (N, Hq, D), k and v: (N, Hkv, D) with Hq a multiple of Hkv (GQA); returns (N, Hq, D).
    `window`: attend to the last `window` positions of the document (self included); None = full causal.
    `sinks`: (Hq,) per-head sink logits (gpt-oss), or None.
    """
    if sinks is not None:
        return (
            _varlen_sinks(q, k, v, docs, window, sinks)
            if backend == "varlen"
            else _eager_sinks(q, k, v, docs, window, sinks)
        )
    if backend == "varlen":
        return _varlen(q, k, v, docs, window)
    return _sdpa_per_document(q, k, v, docs, window)


def _eager_sinks(
    q: Tensor, k: Tensor, v: Tensor, docs: PackedDocs, window: int | None, sinks: Tensor
) -> Tensor:
    """Per document: softmax over [q.k / sqrt(D) masked, sink], sink column dropped (HF's eager gpt-oss)."""
    out = torch.empty_like(q)  # (N, Hq, D)
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    for start, stop in pairwise(docs.bounds):
        length = stop - start
        qd = q[start:stop].transpose(0, 1)  # (Hq, L, D)
        kd = k[start:stop].transpose(0, 1).repeat_interleave(group, dim=0)  # (Hq, L, D)
        vd = v[start:stop].transpose(0, 1).repeat_interleave(group, dim=0)
        i = torch.arange(length, device=q.device)
        diff = i[:, None] - i[None, :]  # (L, L)
        allowed = (diff >= 0) if window is None else (diff >= 0) & (diff < window)
        logits = (qd @ kd.transpose(1, 2)) * scale  # (Hq, L, L)
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, length, 1)  # (Hq, L, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1].to(vd.dtype)  # (Hq, L, L)
        out[start:stop] = (probs @ vd).transpose(0, 1)
    return out


def _varlen_sinks(
    q: Tensor, k: Tensor, v: Tensor, docs: PackedDocs, window: int | None, sinks: Tensor
) -> Tensor:
    """FlashAttention varlen with its log-sum-exp: out * sigmoid(lse - sink) adds the sink to each softmax."""
    op = _flash_forward_op()
    if op is not None:
        out, lse = _flash_varlen(op, q, k, v, docs, window)  # lse: (Hq, N)
        return _sink_scaled(out, lse.transpose(0, 1), sinks)
    from torch.nn.attention import varlen as varlen_module

    aux_request = getattr(varlen_module, "AuxRequest", None)
    if aux_request is None:
        return _eager_sinks(q, k, v, docs, window, sinks)
    kwargs: dict[str, object] = {"window_size": (-1 if window is None else window - 1, 0)}
    k, v = _grouped_kv(q, k, v, inspect.signature(varlen_module.varlen_attn).parameters, kwargs)
    cu = docs.cu_seqlens
    out, aux = varlen_module.varlen_attn(
        q, k, v, cu, cu, docs.max_len, docs.max_len, return_aux=aux_request(lse=True), **kwargs
    )
    lse = aux.lse if hasattr(aux, "lse") else aux  # (Hq, N) or (N, Hq) fp32
    if lse.shape[0] != q.shape[0]:
        lse = lse.transpose(0, 1)  # (N, Hq)
    return _sink_scaled(out, lse, sinks)


def _sink_scaled(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """out (N, Hq, D) times sigmoid(lse - sink): lse (N, Hq) the kernel's log-sum-exp, sinks (Hq,)."""
    scale = torch.sigmoid(lse.float() - sinks.float()[None, :])  # (N, Hq)
    return (out.float() * scale[..., None]).to(out.dtype)


def _sdpa_per_document(q: Tensor, k: Tensor, v: Tensor, docs: PackedDocs, window: int | None) -> Tensor:
    out = torch.empty_like(q)  # (N, Hq, D)
    gqa = q.shape[1] != k.shape[1]
    for start, stop in pairwise(docs.bounds):
        length = stop - start
        qd = q[start:stop].transpose(0, 1).unsqueeze(0)  # (1, Hq, L, D)
        kd = k[start:stop].transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
        vd = v[start:stop].transpose(0, 1).unsqueeze(0)
        if window is None or window >= length:
            od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
        else:
            i = torch.arange(length, device=q.device)
            diff = i[:, None] - i[None, :]  # (L, L) query position minus key position
            band = (diff >= 0) & (diff < window)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=band, enable_gqa=gqa)
        out[start:stop] = od.squeeze(0).transpose(0, 1)
    return out


def _varlen(q: Tensor, k: Tensor, v: Tensor, docs: PackedDocs, window: int | None) -> Tensor:
    op = _flash_forward_op()
    if op is not None:
        return _flash_varlen(op, q, k, v, docs, window)[0]
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is not None:
        return _sdpa_per_document(q, k, v, docs, window)
    else:
        kwargs["is_causal"] = True
    k, v = _grouped_kv(q, k, v, params, kwargs)
    cu = docs.cu_seqlens
    return varlen_attn(q, k, v, cu, cu, docs.max_len, docs.max_len, **kwargs)


def _grouped_kv(
    q: Tensor, k: Tensor, v: Tensor, params: Mapping[str, object], kwargs: dict[str, object]
) -> tuple[Tensor, Tensor]:
    """k and v for `varlen_attn` (parameters `params`) under grouped-query attention: with its ``enable_gqa``
    (set in `kwargs`) they stay (N, Hkv, D), else each kv head is repeated over its query group: (N, Hq, D)."""
    if q.shape[1] == k.shape[1]:
        return k, v
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
        return k, v
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (N, Hq, D)
