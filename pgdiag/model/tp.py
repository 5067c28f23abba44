"""Tensor parallelism: every sharding decision of the model, in one place.

What: the shard plan (a table from HF parameter-name patterns to how the parameter is split), the per-rank
sizes for a TP degree (`TPLayout`, all ``local_`` prefixed; global sizes never change), the slice of a tensor
that a rank reads, and `all_reduce_sum`, the one collective the plain layer calls (twice per layer; the overlapped
dense layer sums the same partials through `pgdiag.model.tp_sums`, by NCCL or, at TP = 2 on CUDA, by copy engine).

Why: the model stays single-GPU code with HF names (gpt-fast ``tp.py``, torchtitan ``apply_tp``); the loader
uses this plan to read only its slices from safetensors, so no rank ever holds the full model. The LM head is
split over the vocabulary and is never gathered: the kernel reduces per-token statistics instead.

How (Megatron layout): q/k/v, gate and up are column-parallel (output rows split, so each rank owns whole
attention heads and a slice of the MLP); o_proj and down_proj are row-parallel (input columns split), their
partial outputs summed by `all_reduce_sum`, their bias added after the sum. Embeddings and norms are
replicated. The vocabulary may split unevenly: the first ``vocab_size % tp`` ranks get one row more.

Sequence parallelism (dense layers, `pgdiag.model.tp_dense`): the residual stream, both RMSNorms and the residual
adds run on a token shard (`TokenShards`: the batch is cut into equal spans, each span into ``tp`` equal pieces,
rank r holds piece r of every span); `all_gather_rows` brings a span's normed rows together before the
column-parallel q/k/v or gate/up, and `reduce_scatter_rows` sums a span's row-parallel output (o_proj, down_proj)
and hands each rank its piece, in place of the all-reduce: the same bytes on the wire, and no rank repeats another's
memory-bound work. The weights are sharded as above; only the activations differ.

The sharded residual (dense layers overlapped in token chunks, `pgdiag.model.tp_dense.dense_sharded`): the
residual stream stays in the chunks of `chunk_spans`, each cut into ``tp`` near-equal pieces (`chunk_pieces`);
rank r adds the row-parallel sums into, and normalises, only piece r of every chunk, and the normed pieces are
exchanged before the column-parallel GEMMs, which run on every row of a chunk as in the replicated form.

Mixture of experts: the experts are split over the group (``EXPERTS``: rank r owns experts
``r * E/tp : (r + 1) * E/tp`` whole, per-expert tensors read only by their owner, fused ones sliced along the
expert axis); the router is replicated, so every rank routes every token alike and computes its own experts for
the tokens sent to them; the partial outputs meet in the one `all_reduce_sum` after the combine, like a
row-parallel MLP. A shared expert is an ordinary column/row-parallel MLP whose partial sum joins the same
all-reduce. Attention sinks are per head, so they split with the heads.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor

from pgdiag.errors import Code, UsageError
from pgdiag.model.config import ModelConfig

COLWISE = "colwise"  # split dim 0 (output features) evenly
ROWWISE = "rowwise"  # split dim 1 (input features) evenly
VOCAB = "vocab"  # split dim 0 (vocab rows), ragged
EXPERTS = "experts"  # whole experts per rank: per-expert tensors to their owner, fused ones split along dim 0
REPLICATE = "replicate"

# HF parameter name pattern -> shard kind. First match wins.
SHARD_PLAN: tuple[tuple[str, str], ...] = (
    ("model.layers.*.self_attn.q_proj.*", COLWISE),
    ("model.layers.*.self_attn.k_proj.*", COLWISE),
    ("model.layers.*.self_attn.v_proj.*", COLWISE),
    ("model.layers.*.self_attn.o_proj.weight", ROWWISE),
    ("model.layers.*.self_attn.o_proj.bias", REPLICATE),  # added once, after the all-reduce
    ("model.layers.*.self_attn.sinks", COLWISE),  # one per attention head
    ("model.layers.*.mlp.experts.*", EXPERTS),
    ("model.layers.*.block_sparse_moe.experts.*", EXPERTS),
    ("model.layers.*.mlp.shared_expert.gate_proj.*", COLWISE),
    ("model.layers.*.mlp.shared_expert.up_proj.*", COLWISE),
    ("model.layers.*.mlp.shared_expert.down_proj.weight", ROWWISE),
    ("model.layers.*.mlp.gate_proj.*", COLWISE),
    ("model.layers.*.mlp.up_proj.*", COLWISE),
    ("model.layers.*.mlp.down_proj.weight", ROWWISE),
    ("model.layers.*.mlp.down_proj.bias", REPLICATE),  # added once, after the all-reduce
    ("lm_head.weight", VOCAB),
    ("*", REPLICATE),  # embeddings, norms, q_norm/k_norm (per head_dim), routers, shared_expert_gate
)


@dataclass(frozen=True)
class TPLayout:
    """This rank's share of a model for a TP degree; global sizes stay in `ModelConfig`."""

    tp_size: int
    rank: int
    local_num_heads: int
    local_num_kv_heads: int
    local_intermediate_size: int
    vocab_start: int  # first global vocab id of this rank's head rows
    local_vocab_size: int
    expert_start: int = 0  # first global expert index this rank owns (MoE)
    local_num_experts: int = 0  # experts this rank owns (0 = dense model)
    local_shared_intermediate_size: int = 0  # this rank's columns of a shared expert (Qwen2-MoE)

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.local_vocab_size


@dataclass(frozen=True)
class TensorSlice:
    """Rows or columns ``start:stop`` along `dim` of a checkpoint tensor."""

    dim: int
    start: int
    stop: int


def tp_layout(config: ModelConfig, tp_size: int, rank: int) -> TPLayout:
    """Per-rank sizes; E605 when heads, kv heads, intermediate sizes or the experts do not divide by `tp_size`."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise UsageError(Code.BAD_TP_SIZE, f"bad tensor-parallel rank {rank} of {tp_size}")
    moe = config.moe
    sizes = [
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
    ]
    if moe is None or not all(moe.sparse_layers):  # a dense MLP exists
        sizes.append(("intermediate_size", config.intermediate_size))
    if moe is not None:
        sizes.append(("the expert count", moe.num_experts))
        sizes.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    for name, value in sizes:
        if value % tp_size:
            raise UsageError(
                Code.BAD_TP_SIZE,
                f"--tp {tp_size} does not divide {name} = {value}",
                "heads, kv heads, intermediate sizes and the expert count must divide by the TP size "
                "(each rank owns whole experts); the vocab may split unevenly",
            )
    base, extra = divmod(config.vocab_size, tp_size)
    local_vocab = base + (1 if rank < extra else 0)
    vocab_start = rank * base + min(rank, extra)
    return TPLayout(
        tp_size=tp_size,
        rank=rank,
        local_num_heads=config.num_attention_heads // tp_size,
        local_num_kv_heads=config.num_key_value_heads // tp_size,
        local_intermediate_size=config.intermediate_size // tp_size,
        vocab_start=vocab_start,
        local_vocab_size=local_vocab,
        expert_start=rank * (moe.num_experts // tp_size) if moe else 0,
        local_num_experts=moe.num_experts // tp_size if moe else 0,
        local_shared_intermediate_size=moe.shared_expert_intermediate_size // tp_size if moe else 0,
    )


def shard_kind(name: str) -> str:
    """The plan entry for an HF parameter name."""
    return next(kind for pattern, kind in SHARD_PLAN if fnmatch.fnmatchcase(name, pattern))


def shard_slice(name: str, shape: tuple[int, ...], layout: TPLayout) -> TensorSlice | None:
    """The part of tensor `name` (global `shape`) that this rank reads; None = the whole tensor."""
    kind = shard_kind(name)
    if kind == REPLICATE or (layout.tp_size == 1 and kind != VOCAB):
        return None
    if kind == VOCAB:
        return TensorSlice(0, layout.vocab_start, layout.vocab_end)
    if kind == EXPERTS:  # per-expert tensors (experts.7.w1.weight) are read whole by their owner
        if name.split("experts.", 1)[1].split(".", 1)[0].isdigit():
            return None
        return TensorSlice(0, layout.expert_start, layout.expert_start + layout.local_num_experts)
    dim = 0 if kind == COLWISE else 1
    size = shape[dim] // layout.tp_size
    return TensorSlice(dim, layout.rank * size, (layout.rank + 1) * size)


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) inside `group`; (0, 1) without one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum the partial outputs of a row-parallel matmul over `group`; identity without one (TP=1)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_rows(out: Tensor, local: Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start gathering every rank's `local` rows (n, H) into `out` (tp * n, H) in rank order; returns the handle."""
    return dist.all_gather_into_tensor(out, local, group=group, async_op=True)


def reduce_scatter_rows(out: Tensor, full: Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start summing `full` (tp * n, H) over the ranks, this rank keeping rows ``rank * n : (rank + 1) * n`` in
    `out` (n, H); returns the handle."""
    return dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


@dataclass(frozen=True)
class TokenShards:
    """Sequence parallelism's split of a packed batch of `n_tokens` rows, padded to `n_padded` (a multiple of
    chunks x tp): `chunks` equal spans, each cut into tp equal pieces; this rank holds piece `rank` of every span."""

    n_tokens: int
    n_padded: int
    chunks: int
    tp_size: int
    rank: int

    @property
    def span(self) -> int:
        return self.n_padded // self.chunks

    @property
    def piece(self) -> int:
        return self.span // self.tp_size

    def spans(self) -> list[tuple[int, int, int, int]]:
        """Per span: (first global row, end, first local row, end)."""
        return [
            (c * self.span, (c + 1) * self.span, c * self.piece, (c + 1) * self.piece)
            for c in range(self.chunks)
        ]

    def local_rows(self, device: torch.device) -> Tensor:
        """(n_padded / tp,) int64: the global rows this rank holds, in its local order."""
        starts = torch.arange(self.chunks, device=device) * self.span + self.rank * self.piece  # (chunks,)
        return (starts[:, None] + torch.arange(self.piece, device=device)[None, :]).reshape(-1)


def token_shards(n_tokens: int, chunks: int, layout: TPLayout) -> TokenShards:
    """The `TokenShards` of an `n_tokens` batch cut into `chunks` spans on this rank."""
    unit = chunks * layout.tp_size
    return TokenShards(n_tokens, -(-n_tokens // unit) * unit, chunks, layout.tp_size, layout.rank)


def chunk_spans(n_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """The near-equal token chunks (start, stop) of an `n_tokens` batch, empty ones dropped: the rows each
    overlapped dense layer computes and sums together (`pgdiag.model.tp_dense`)."""
    edges = [n_tokens * c // chunks for c in range(chunks + 1)]
    return [(start, stop) for start, stop in pairwise(edges) if stop > start]


def chunk_pieces(rows: int, tp_size: int) -> tuple[int, ...]:
    """Boundaries (tp + 1 offsets, relative to the chunk) of the near-equal pieces of a `rows`-row chunk: rank r
    owns rows ``pieces[r]:pieces[r + 1]`` of it in the sharded residual."""
    return tuple(rows * r // tp_size for r in range(tp_size + 1))
