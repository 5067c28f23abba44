"""A dense decoder layer under tensor parallelism, with its collectives overlapped with compute.

What: three forms of `DecoderLayer.forward` for a dense layer at TP > 1, same math per token as the plain form:
- `dense_overlapped`: the residual stream is whole on every rank; everything after attention (o_proj, residual,
  norm, MLP) runs in token chunks, each chunk's sum over the ranks in flight while the next chunk computes (an
  NCCL all-reduce, or at TP = 2 on CUDA copy-engine pushes: `pgdiag.model.tp_sums`);
- `dense_sharded`: `dense_overlapped` with the residual stream sharded inside each chunk (`pgdiag.model.tp`'s
  `chunk_pieces`): each rank adds the o_proj and down_proj sums into its piece of the chunk only and normalises
  only that piece (the post-attention norm, and the next layer's input norm or the final norm), then hands the
  normed piece to the other ranks (`start_gather`) before the chunk's gate/up, or the next layer's q/k/v, run on
  all its rows. The pipeline runs across the layer boundary: a layer returns its output pieces with the next
  layer's normed rows still on the wire (`ShardedStream`), and the GEMMs see the same rows, chunks and shapes as
  in `dense_overlapped`, so the output equals it bit for bit;
- `dense_sequence_parallel`: the residual stream is sharded over tokens (`pgdiag.model.tp.TokenShards`): the
  norms and residual adds run on this rank's rows only, a span's normed rows are all-gathered before q/k/v and
  gate/up (each span's projections start as soon as its rows arrive, while later spans are still on the wire), and
  the row-parallel o_proj and down_proj outputs are reduce-scattered span by span instead of all-reduced.

Why: at TP = 2 the all-reduces alone cost about 6 % of a pass if exposed; the overlapped form hides most of them,
but every rank still runs the norms, residual adds and their copies on all N tokens. Sequence parallelism cuts that
replicated memory-bound work by the TP degree for the same bytes on the wire (docs/benchmarks.md, issue 26); so
does `dense_sharded`, without sequence parallelism's narrower GEMMs: on an H100 the residual adds and norms that
every rank repeated on all N tokens cost about as much as a GEMM's loss to TP (docs/benchmarks.md).

How: the collectives are explicit calls: `pgdiag.model.tp_sums` (`start`, `finish`, and in the sharded form
`start_gather`, `finish_gather`) in the overlapped forms,
`pgdiag.model.tp`'s `all_gather_rows` and `reduce_scatter_rows` in the sequence-parallel one; in 16-bit the matmul library may pick another kernel for a chunk's row count, so rounding
can differ from the unchunked form by the bf16 reduction-order size (docs/recompute.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pgdiag.model.fused_ops import FusedOp
from pgdiag.model.tp import TokenShards, all_gather_rows, chunk_pieces, chunk_spans, reduce_scatter_rows

if TYPE_CHECKING:
    from pgdiag.model.tp_sums import NcclSums, PeerCopySums, PendingSum
    from pgdiag.model.transformer import DecoderLayer, LayerInputs, RMSNorm


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
    spans = chunk_spans(x.shape[0], n_chunks)  # near-equal token chunks
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


@dataclass(frozen=True)
class ShardedStream:
    """The residual stream between two dense layers of the sharded form (`dense_sharded`)."""

    x: Tensor  # (N, H) the residual stream; only this rank's piece of each chunk is written
    normed: Tensor  # (N, H) the next layer's input norm (or the final norm) of every row, after `pending`
    pending: tuple[PendingSum, ...]  # the gathers of the other ranks' normed pieces, one per chunk


def _norm_into(norm: RMSNorm, x: Tensor, out: Tensor) -> None:
    """out (n, H) = norm(x): in place through a fused op's kernel, else computed and copied."""
    if isinstance(norm.norm, FusedOp):
        norm.norm.into(out, x, norm.weight, norm.eps)
    else:
        out.copy_(norm(x))


def _mine(start: int, pieces: tuple[int, ...], rank: int) -> slice:
    """This rank's rows of a chunk starting at `start`, as global rows."""
    return slice(start + pieces[rank], start + pieces[rank + 1])


def sharded_start(x: Tensor, norm: RMSNorm, sums: NcclSums | PeerCopySums, n_chunks: int) -> ShardedStream:
    """The stream entering the first layer: the embeddings x (N, H), this rank's pieces normed by the first
    layer's input `norm` and sent to the other ranks."""
    normed = sums.gather_buffer(0, x.shape[0], x)  # (N, H)
    pending = []
    for start, stop in chunk_spans(x.shape[0], n_chunks):
        pieces = chunk_pieces(stop - start, sums.size)
        rows = _mine(start, pieces, sums.rank)
        _norm_into(norm, x[rows], normed[rows])
        pending.append(sums.start_gather(normed, start, pieces))
    return ShardedStream(x, normed, tuple(pending))


def dense_sharded(
    layer: DecoderLayer,
    stream: ShardedStream,
    shared: LayerInputs,
    sums: NcclSums | PeerCopySums,
    n_chunks: int,
    next_norm: RMSNorm,
    next_buffer: int,
) -> ShardedStream:
    """The dense layer with the residual sharded inside each chunk; returns the stream for the next layer, whose
    input norm is `next_norm` (the final norm after the last layer: `next_buffer` 1, else 0).

    Order (as `dense_overlapped`, each sum for this rank's piece only): wait for the normed rows, q/k/v and
    attention on all N rows, the o_proj partials of all chunks started; per chunk its sum into this rank's piece,
    the post-attention norm of the piece, the piece sent; per chunk, once its pieces are in, gate/up/down on all
    its rows and the down_proj partial started, then the previous chunk's sum, the next norm of its piece and the
    piece sent (the last chunk's after its own MLP: the one wait at the layer boundary)."""
    attn, mlp = layer.self_attn, getattr(layer, layer.ffn_name)
    x, n = stream.x, stream.x.shape[0]
    rank, tp = sums.rank, sums.size
    spans = chunk_spans(n, n_chunks)
    pieces = [chunk_pieces(stop - start, tp) for start, stop in spans]
    for pending in stream.pending:
        sums.finish_gather(pending)
    core = attn.core(stream.normed, shared)  # (N, Hq_local * D)
    o_pending = [
        sums.start(F.linear(core[a:b], attn.o_proj.weight), p)
        for (a, b), p in zip(spans, pieces, strict=True)
    ]  # (n_c, H) partials, this rank's piece of each summed
    del core
    mid = torch.empty_like(x)  # (N, H) this rank's pieces
    post = sums.gather_buffer(1, n, x)  # (N, H) the post-attention norm of every row
    post_pending = []
    for (start, _), p, pending in zip(spans, pieces, o_pending, strict=True):
        rows = _mine(start, p, rank)
        sums.finish(pending, x[rows], attn.o_proj.bias, out=mid[rows])
        _norm_into(layer.post_attention_layernorm, mid[rows], post[rows])
        post_pending.append(sums.start_gather(post, start, p))
    del o_pending
    out = torch.empty_like(x)  # (N, H) this rank's pieces
    normed = sums.gather_buffer(next_buffer, n, x)  # (N, H)
    d_pending, gathers = [], []

    def finish_down(c: int) -> None:  # chunk c's down_proj sum into this rank's piece, its next norm sent
        rows = _mine(spans[c][0], pieces[c], rank)
        sums.finish(d_pending[c], mid[rows], mlp.down_proj.bias, out=out[rows])
        _norm_into(next_norm, out[rows], normed[rows])
        gathers.append(sums.start_gather(normed, spans[c][0], pieces[c]))

    for c, ((a, b), p, pending) in enumerate(zip(spans, pieces, post_pending, strict=True)):
        sums.finish_gather(pending)
        inner = mlp.ops.swiglu(mlp.gate_proj(post[a:b]), mlp.up_proj(post[a:b]))  # (n_c, I_local)
        d_pending.append(sums.start(F.linear(inner, mlp.down_proj.weight), p))  # (n_c, H) partial
        if c:  # the previous chunk's sum arrived while this chunk computed
            finish_down(c - 1)
    finish_down(len(spans) - 1)
    return ShardedStream(out, normed, tuple(gathers))


def sharded_finish(stream: ShardedStream, sums: NcclSums | PeerCopySums) -> Tensor:
    """The final-normed hidden states (N, H) of every row, after the last `dense_sharded` (a copy: the gather
    buffer is the next batch's)."""
    for pending in stream.pending:
        sums.finish_gather(pending)
    return stream.normed.clone()


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
