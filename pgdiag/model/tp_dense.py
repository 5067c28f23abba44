"""A dense decoder layer under tensor parallelism, with its collectives overlapped with compute.

What: two forms of `DecoderLayer.forward` for a dense layer at TP > 1, same math per token as the plain form:
- `dense_overlapped`: the residual stream is whole on every rank; everything after attention (o_proj, residual,
  norm, MLP) runs in token chunks, each chunk's sum over the ranks in flight while the next chunk computes (an
  NCCL all-reduce, or at TP = 2 on CUDA copy-engine pushes: `pgdiag.model.tp_sums`);
- `dense_sequence_parallel`: the residual stream is sharded over tokens (`pgdiag.model.tp.TokenShards`): the
  norms and residual adds run on this rank's rows only, a span's normed rows are all-gathered before q/k/v and
  gate/up (each span's projections start as soon as its rows arrive, while later spans are still on the wire), and
  the row-parallel o_proj and down_proj outputs are reduce-scattered span by span instead of all-reduced.

Why: at TP = 2 the all-reduces alone cost about 6 % of a pass if exposed; the overlapped form hides most of them,
but every rank still runs the norms, residual adds and their copies on all N tokens. Sequence parallelism cuts that
replicated memory-bound work by the TP degree for the same bytes on the wire (docs/benchmarks.md, issue 26).

How: the collectives are explicit calls: `pgdiag.model.tp_sums` (`start`, `finish`) in the overlapped form,
`pgdiag.model.tp`'s `all_gather_rows` and `reduce_scatter_rows` in the sequence-parallel one; in 16-bit the matmul library may pick another kernel for a chunk's row count, so rounding
can differ from the unchunked form by the bf16 reduction-order size (docs/recompute.md).
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pgdiag.model.tp import TokenShards, all_gather_rows, reduce_scatter_rows

if TYPE_CHECKING:
    from pgdiag.model.tp_sums import NcclSums, PeerCopySums
    from pgdiag.model.transformer import DecoderLayer, LayerInputs


def _bias(summed: Tensor, proj: nn.Linear) -> Tensor:
    """A row-parallel output summed over the ranks, plus `proj`'s bias (added once, after the sum)."""
    return summed if proj.bias is None else summed + proj.bias


def _linear_into(out: Tensor, x: Tensor, proj: nn.Linear) -> None:
    """out (n, F) = x (n, H) @ W.T (+ bias), written in place (a row range of a larger buffer)."""
    if proj.bias is None:
        torch.mm(x, proj.weight.t(), out=out)
    else:
        torch.addmm(proj.bias, x, proj.weight.t(), out=out)


def dense_overlapped(
    layer: DecoderLayer, x: Tensor, shared: LayerInputs, sums: NcclSums | PeerCopySums, n_chunks: int
) -> Tensor:
    """The dense layer with its two all-reduces overlapped with compute; x (N, H) whole on every rank.

    Everything after attention (o_proj, residual, norm, MLP) is token-wise, so it runs in `n_chunks` token
    chunks: the o_proj partial sums of all chunks are launched, each summed over the ranks asynchronously
    (`sums`: NCCL, or the copy engines for two GPUs, `pgdiag.model.tp_sums`); then chunk c waits for its sum and
    runs its MLP while the sums of chunks c+1.. are still on the wire, and its down_proj sum runs while chunk c+1
    computes."""
    attn, mlp = layer.self_attn, getattr(layer, layer.ffn_name)
    core = attn.core(layer.input_layernorm(x), shared)  # (N, Hq_local * D)
    edges = [x.shape[0] * c // n_chunks for c in range(n_chunks + 1)]  # near-equal token chunks
    spans = [(start, stop) for start, stop in pairwise(edges) if stop > start]
    out = torch.empty_like(x)  # (N, H)
    o_pending = [sums.start(F.linear(core[a:b], attn.o_proj.weight)) for a, b in spans]  # (n_c, H) partials
    residuals, d_pending = [], []
    for (start, stop), pending in zip(spans, o_pending, strict=True):
        mid = sums.finish(pending, x[start:stop], attn.o_proj.bias)  # (n_c, H)
        normed = layer.post_attention_layernorm(mid)
        inner = mlp.ops.swiglu(mlp.gate_proj(normed), mlp.up_proj(normed))  # (n_c, I_local)
        d_pending.append(sums.start(F.linear(inner, mlp.down_proj.weight)))  # (n_c, H) partial
        residuals.append(mid)
    for (start, stop), mid, pending in zip(spans, residuals, d_pending, strict=True):
        sums.finish(pending, mid, mlp.down_proj.bias, out=out[start:stop])  # one pass, no temporary
    return out


def dense_sequence_parallel(
    layer: DecoderLayer, x_local: Tensor, shared: LayerInputs, shards: TokenShards
) -> Tensor:
    """The dense layer on this rank's token rows x_local (N_pad / tp, H); returns the layer's output rows, same
    shape. `shared` (cos, sin (N_pad, D), docs) describes the whole padded batch; its group is the TP group."""
    attn, mlp = layer.self_attn, getattr(layer, layer.ffn_name)
    group = shared.group
    spans = shards.spans()
    n, h = shards.n_padded, x_local.shape[1]
    gathered = x_local.new_empty(n, h)  # (N_pad, H) a span's normed rows of every rank

    # attention: input norm on this rank's rows, gathered span by span; a span's q/k/v as soon as it arrives
    normed = layer.input_layernorm(x_local)  # (N_pad / tp, H)
    waits = [all_gather_rows(gathered[a:b], normed[la:lb], group) for a, b, la, lb in spans]
    q = x_local.new_empty(n, attn.q_proj.out_features)  # (N_pad, Hq_local * D)
    k = x_local.new_empty(n, attn.k_proj.out_features)  # (N_pad, Hkv_local * D)
    v = x_local.new_empty(n, attn.v_proj.out_features)
    for (a, b, _, _), pending in zip(spans, waits, strict=True):
        pending.wait()
        for proj, out in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
            _linear_into(out[a:b], gathered[a:b], proj)
    core = attn.attend(q, k, v, shared)  # (N_pad, Hq_local * D)
    del q, k, v
    o_local = torch.empty_like(x_local)  # (N_pad / tp, H) this rank's rows of the summed o_proj
    o_parts, o_waits = [], []
    for a, b, la, lb in spans:
        part = F.linear(core[a:b], attn.o_proj.weight)  # (span, H) partial over this rank's heads
        o_waits.append(reduce_scatter_rows(o_local[la:lb], part, group))
        o_parts.append(part)  # kept alive until its reduce-scatter is done
    # MLP: residual and norm on this rank's rows, gathered span by span; gate/up/down per span
    mid = torch.empty_like(x_local)
    waits, sent = [], []  # `sent`: the gathers' inputs, alive until they are done
    for (a, b, la, lb), pending in zip(spans, o_waits, strict=True):
        pending.wait()
        torch.add(x_local[la:lb], _bias(o_local[la:lb], attn.o_proj), out=mid[la:lb])
        sent.append(layer.post_attention_layernorm(mid[la:lb]))  # (piece, H)
        waits.append(all_gather_rows(gathered[a:b], sent[-1], group))
    del o_parts
    d_local = torch.empty_like(x_local)  # (N_pad / tp, H) this rank's rows of the summed down_proj
    d_parts, d_waits = [], []
    for (a, b, la, lb), pending in zip(spans, waits, strict=True):
        pending.wait()
        inner = mlp.ops.swiglu(mlp.gate_proj(gathered[a:b]), mlp.up_proj(gathered[a:b]))  # (span, I_local)
        part = F.linear(inner, mlp.down_proj.weight)  # (span, H) partial
        d_waits.append(reduce_scatter_rows(d_local[la:lb], part, group))
        d_parts.append(part)
    for pending in d_waits:
        pending.wait()
    return mid.add_(_bias(d_local, mlp.down_proj))  # (N_pad / tp, H)


def gather_tokens(local: Tensor, shards: TokenShards, group: dist.ProcessGroup) -> Tensor:
    """Every rank's token rows `local` (N_pad / tp, H) put back together in batch order: (N_pad, H)."""
    whole = local.new_empty(shards.n_padded, local.shape[1])
    waits = [all_gather_rows(whole[a:b], local[la:lb], group) for a, b, la, lb in shards.spans()]
    for pending in waits:
        pending.wait()
    return whole
