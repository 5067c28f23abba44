"""The native decoder: one implementation for Llama 2/3, Qwen2/2.5, Qwen3, Mistral and, with `pgdiag.model.moe`
in the sparse layers, Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss.

What: `CausalLM.hidden_states(input_ids, position_ids, cu_seqlens)` runs the trunk on a packed batch of documents
(N tokens, no padding) and returns the final-normed hidden states (N, H). The LM head is not applied here: the
caller gives ``hidden[positions]`` and `CausalLM.lm_head_weight` (this rank's vocab rows) to
`pgdiag.kernels.lm_head_logprobs`, so full logits are never materialized.

Why this shape: architecture differences are config fields (`qkv_bias`, `o_bias`, `mlp_bias`, `qk_norm`,
`head_dim`, RoPE scaling, per-layer sliding windows), not forks of the model. Parameter names are the HF ones
(``model.layers.3.self_attn.q_proj.weight``) and RoPE is HF's rotate-half form, so HF weights load as they are.
Numerics follow HF: RMSNorm in fp32 then cast, cos/sin in fp32 then cast to the body dtype.

Speed: matmuls and attention are PyTorch's own kernels; ``fuse_pointwise=True`` runs the memory-bound steps
(RMSNorm, RoPE, SwiGLU) as one kernel each (`PointwiseOps`, same math): Triton kernels on CUDA
(`pgdiag.model.pointwise_triton`), `torch.compile` elsewhere (`pgdiag.model.fused_ops`).

Tensor parallelism: modules are built with this rank's local sizes (`TPLayout`); the only collectives are the
two `all_reduce_sum` calls after the row-parallel o_proj and down_proj (or the MoE combine), visible in `forward`,
identity at TP=1, or in a dense layer their overlapped, sharded and sequence-parallel forms (`tp_dense`).

Routing: `CausalLM.forward_packed(..., replay_experts=)` also returns the experts each sparse layer's router picked
per token (`TrunkOutput.router_topk`), and runs the recorded experts instead when given (routing replay).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pgdiag.model.attention import PackedDocs, packed_attention
from pgdiag.model.config import ModelConfig
from pgdiag.model.fused_ops import FusedOp
from pgdiag.model.moe import MoeBlock, moe_combine
from pgdiag.model.rope import rope_inv_freq
from pgdiag.model.tp import TPLayout, all_reduce_sum, token_shards
from pgdiag.model.tp_dense import (
    dense_overlapped,
    dense_sequence_parallel,
    dense_sharded,
    gather_tokens,
    sharded_finish,
    sharded_start,
)
from pgdiag.model.tp_sums import NcclSums, PeerCopySums, overlap_sums
from pgdiag.model.warmup import triton_key_thread

TP_OVERLAP_CHUNKS = 4  # token chunks of a dense layer whose all-reduces overlap compute under TP (1 = off)
TP_OVERLAP_MIN_TOKENS = 1024  # fewer tokens a chunk: not worth it, the layer runs unchunked
# dense models under TP: sequence parallelism in the same token chunks; off: 2.5 % slower than the overlapped
# all-reduces at TP 2 on two H200s (docs/benchmarks.md, issue 26)
TP_SEQUENCE_PARALLEL = False
# how the overlapped dense layers sum their partials under TP: "peer_copy" (TP = 2 on CUDA: copy-engine pushes into
# symmetric memory, `pgdiag.model.tp_sums.PeerCopySums`, 3.3 % faster at TP 2 on two H200s than NCCL and bit for bit
# the same; NCCL elsewhere or where symmetric memory fails) or "nccl" (all-reduce)
TP_REDUCE = "peer_copy"
# dense, overlapped: residual adds and norms on this rank's piece of each chunk (`tp_dense.dense_sharded`, bit for bit,
# +1.3 % at TP 2 on two H200s): "peer_copy" where the copy engines sum, "always" (NCCL/gloo broadcasts), "never"
TP_SHARD_RESIDUAL = "peer_copy"


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """w * (x / rms(x)), the normalization in fp32 and cast back before the weight (as HF)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_fp32_weight(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """gpt-oss's RMSNorm: the weight multiplies the fp32 normalized value, then one cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x (N, heads, D), cos/sin (N, 1, D)."""
    return x * cos + rotate_half(x) * sin


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class PointwiseOps:
    """The memory-bound steps of a layer: the eager functions above, or the same functions fused (one kernel each
    instead of 3-6; same math, fp32 where HF computes in fp32): `pgdiag.model.fused_ops.FusedOp`."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    rms_norm_fp32_weight: Callable[[Tensor, Tensor, float], Tensor]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]
    swiglu: Callable[[Tensor, Tensor], Tensor]
    moe_combine: Callable[[Tensor, Tensor, Tensor], Tensor]  # pgdiag.model.moe.combine_rows


def pointwise_ops(fused: bool) -> PointwiseOps:
    if not fused:
        return PointwiseOps(rms_norm, rms_norm_fp32_weight, apply_rope, swiglu, moe_combine(False))
    # CUDA: pgdiag.model.pointwise_triton's kernels (no compile in the process); else torch.compile (fused_ops)
    return PointwiseOps(
        FusedOp("rms_norm_triton", rms_norm),
        FusedOp("rms_norm_fp32_weight_triton", rms_norm_fp32_weight),
        FusedOp("apply_rope_triton", apply_rope),
        FusedOp("swiglu_triton", swiglu),
        moe_combine(True),
    )


@dataclass(frozen=True)
class LayerInputs:
    """What every layer of one forward pass is given besides its input x: RoPE angles, documents, attention
    backend and the TP group (None: one rank)."""

    cos: Tensor  # (N, D) body dtype, RoPE scale applied
    sin: Tensor  # (N, D)
    docs: PackedDocs
    backend: str  # attention backend, resolved by the loader
    group: dist.ProcessGroup | None
    sums: NcclSums | PeerCopySums | None = None  # TP > 1, overlapped dense layers: how partials are summed


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: PointwiseOps, weight_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.norm = ops.rms_norm_fp32_weight if weight_fp32 else ops.rms_norm

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k/v/o biases, optional q/k RMSNorm; local heads only."""

    def __init__(self, config: ModelConfig, layout: TPLayout, window: int | None, ops: PointwiseOps) -> None:
        super().__init__()
        d, h = config.head_dim, config.hidden_size
        self.ops = ops
        self.head_dim = d
        self.local_num_heads = layout.local_num_heads
        self.local_num_kv_heads = layout.local_num_kv_heads
        self.window = window
        self.q_proj = nn.Linear(h, self.local_num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.local_num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.local_num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.local_num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, ops)
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.local_num_heads))  # (Hq_local,) one logit per head

    def forward(self, x: Tensor, shared: LayerInputs) -> Tensor:
        return _row_parallel(self.core(x, shared), self.o_proj, shared.group)  # (N, H)

    def core(self, x: Tensor, shared: LayerInputs) -> Tensor:
        """The attention output of this rank's heads before o_proj: (N, Hq_local * D)."""
        return self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), shared)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, shared: LayerInputs) -> Tensor:
        """`core` from the projections q (N, Hq_local * D), k and v (N, Hkv_local * D): (N, Hq_local * D)."""
        n = q.shape[0]
        q = q.view(n, self.local_num_heads, self.head_dim)  # (N, Hq_local, D)
        k = k.view(n, self.local_num_kv_heads, self.head_dim)  # (N, Hkv_local, D)
        v = v.view(n, self.local_num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = shared.cos.unsqueeze(1), shared.sin.unsqueeze(1)  # (N, 1, D)
        q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        sinks = getattr(self, "sinks", None)
        out = packed_attention(
            q, k, v, shared.docs, window=self.window, backend=shared.backend, sinks=sinks
        )  # (N, Hq_local, D)
        return out.reshape(n, -1)


def _row_parallel(x: Tensor, proj: nn.Linear, group: dist.ProcessGroup | None) -> Tensor:
    """`proj` of a row-parallel layer: this rank's partial x @ W.T (N, H), summed over `group`, then the bias."""
    return _add_bias(all_reduce_sum(F.linear(x, proj.weight), group), proj)


def _add_bias(summed: Tensor, proj: nn.Linear) -> Tensor:
    """A row-parallel output (N, H) summed over the ranks, plus `proj`'s bias (added once, after the sum)."""
    return summed if proj.bias is None else summed + proj.bias


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, layout: TPLayout, ops: PointwiseOps) -> None:
        super().__init__()
        h, i = config.hidden_size, layout.local_intermediate_size
        self.ops = ops
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def forward(self, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        inner = self.ops.swiglu(self.gate_proj(x), self.up_proj(x))  # (N, I_local)
        return _row_parallel(inner, self.down_proj, group)  # (N, H)


class DecoderLayer(nn.Module):
    """Attention then the feed-forward block: a dense `MLP`, or a `MoeBlock` in sparse layers (under HF's name,
    ``mlp`` or Mixtral's ``block_sparse_moe``)."""

    def __init__(
        self, config: ModelConfig, layout: TPLayout, window: int | None, ops: PointwiseOps, sparse: bool
    ) -> None:
        super().__init__()
        h, eps, fp32_weight = config.hidden_size, config.rms_norm_eps, config.norm_weight_fp32
        self.input_layernorm = RMSNorm(h, eps, ops, fp32_weight)
        self.self_attn = Attention(config, layout, window, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, ops, fp32_weight)
        self.sparse = sparse
        moe_name = "block_sparse_moe" if config.moe and config.moe.weight_layout == "mixtral" else "mlp"
        self.ffn_name = moe_name if sparse else "mlp"
        self.add_module(
            self.ffn_name,
            MoeBlock(config, layout, ops.swiglu, ops.moe_combine) if sparse else MLP(config, layout, ops),
        )

    def forward(
        self,
        x: Tensor,
        shared: LayerInputs,
        expert_impl: str = "loop",
        replay: Tensor | None = None,
        overlap_chunks: int = 1,
    ) -> tuple[Tensor, Tensor | None]:
        """(x after the layer (N, H), the router's top-k (N, k) in a sparse layer else None).

        `overlap_chunks` > 1 (a dense layer under TP): the token-wise part after attention runs in that many
        token chunks, each chunk's all-reduce in flight while the next chunk computes (`tp_dense.dense_overlapped`)."""
        group = shared.group
        if not self.sparse and overlap_chunks > 1 and shared.sums is not None:
            return dense_overlapped(self, x, shared, shared.sums, overlap_chunks), None
        x = x + self.self_attn(self.input_layernorm(x), shared)
        ffn = getattr(self, self.ffn_name)
        if not self.sparse:
            return x + ffn(self.post_attention_layernorm(x), group), None
        out, chosen = ffn(self.post_attention_layernorm(x), group, expert_impl, replay)
        return x + out, chosen


class DecoderTrunk(nn.Module):
    """``model.*`` of the HF checkpoint: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig, layout: TPLayout, ops: PointwiseOps) -> None:
        super().__init__()
        sparse = config.moe.sparse_layers if config.moe else (False,) * config.num_hidden_layers
        # given its (empty) weight: nn.Embedding's own init imports torch._dynamo (1.2 s of a start on a GPU)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, layout, window, ops, is_sparse)
            for window, is_sparse in zip(config.sliding_windows, sparse, strict=True)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.norm_weight_fp32)


@dataclass(frozen=True)
class TrunkOutput:
    """What the trunk returns for a packed batch."""

    hidden: Tensor  # (N, H) final-normed hidden states in the body dtype
    router_topk: (
        Tensor | None
    )  # (N, L_sparse, k) int64: experts each sparse layer's router picked; None if dense


class LMHeadShard(nn.Module):
    """Holds ``lm_head.weight`` rows ``vocab_start:vocab_end`` (V_local, H); never applied inside the model."""

    def __init__(self, local_vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_vocab_size, hidden_size))


class CausalLM(nn.Module):
    """A dense decoder on a packed batch; build it with `pgdiag.model.load_model` (weights filled there)."""

    def __init__(
        self,
        config: ModelConfig,
        layout: TPLayout,
        *,
        tp_group: dist.ProcessGroup | None,
        attention: str,
        fuse_pointwise: bool = False,
        expert_impl: str = "loop",
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        self.tp_group = tp_group
        self.attention_backend = attention
        self.expert_impl = expert_impl  # "loop" or "grouped" (pgdiag.model.moe), resolved by the loader
        self.fuse_pointwise = fuse_pointwise
        self.model = DecoderTrunk(config, layout, pointwise_ops(fuse_pointwise))
        self.lm_head = LMHeadShard(layout.local_vocab_size, config.hidden_size)
        inv_freq, self.rope_scale = rope_inv_freq(config.rope, config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,) fp32
        self.load_warnings: tuple[tuple[str, str], ...] = ()  # (code, message) from the loader: W606, W607
        # TP > 1: dense layers overlap their all-reduces with compute in this many token chunks (1 = off); a
        # batch with fewer than TP_OVERLAP_MIN_TOKENS tokens a chunk runs unchunked
        self.tp_overlap_chunks = TP_OVERLAP_CHUNKS
        self.tp_overlap_min_tokens = TP_OVERLAP_MIN_TOKENS
        # TP > 1, dense models: the residual stream, norms and residual adds on a token shard (`pgdiag.model.tp_dense`)
        self.tp_sequence_parallel = TP_SEQUENCE_PARALLEL
        self.tp_reduce = TP_REDUCE
        self.tp_shard_residual = TP_SHARD_RESIDUAL  # "peer_copy", "always" or "never"
        self._peer_sums: PeerCopySums | None = None  # built on first use, collectively (symmetric memory)
        self._peer_sums_failed = False  # symmetric memory refused once: NCCL from then on

    @property
    def vocab_start(self) -> int:
        return self.layout.vocab_start

    @property
    def lm_head_weight(self) -> Tensor:
        """(V_local, H) this rank's vocab rows, in the head dtype."""
        return self.lm_head.weight

    @property
    def body_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Final-normed hidden states (N, H) in the body dtype for a packed batch.

        input_ids (N,) int64, position_ids (N,) int64 restarting at 0 in each document, cu_seqlens (D+1,) int32
        document boundaries. Attention is causal within each document only.
        """
        return self.forward_packed(input_ids, position_ids, cu_seqlens).hidden

    @torch.no_grad()
    def forward_packed(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cu_seqlens: Tensor,
        *,
        replay_experts: Tensor | None = None,
        layer_hook: Callable[[int, Tensor, Tensor], Tensor | None] | None = None,
    ) -> TrunkOutput:
        """`hidden_states` plus the routing of the sparse layers.

        layer_hook(i, x_in (N, H), x_out (N, H)): called with i = -1 on the embeddings (x_in is x_out), then after
        each block i; a tensor it returns replaces x_out as the next block's input (layer-wise comparison:
        `pgdiag.explain.layers` feeds one configuration's blocks with another's inputs).

        replay_experts (N, L_sparse, k) integer: routing replay, the experts to run in each sparse layer (in
        `MoeConfig.sparse_layer_indices` order) instead of the router's choice; their weights are recomputed from
        the router. A token and layer with an entry < 0 (not recorded) keeps the router's own choice.
        """
        device = self.inv_freq.device
        n = input_ids.shape[0]
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be (N,), got {input_ids.shape}, {position_ids.shape}"
            )
        docs = PackedDocs.from_cu_seqlens(cu_seqlens, n, device)
        input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        chunks = self.tp_overlap_chunks if n >= self.tp_overlap_chunks * self.tp_overlap_min_tokens else 1
        shards = (
            None  # sequence parallel: dense, TP > 1, chunked; not for `pgdiag.explain.layers` (whole rows)
        )
        if (
            self.tp_sequence_parallel
            and chunks > 1
            and self.layout.tp_size > 1
            and not (self.config.moe or layer_hook)
        ):
            shards = token_shards(n, chunks, self.layout)
            input_ids, position_ids, docs = _padded(input_ids, position_ids, docs, shards.n_padded)
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]  # (N, D/2) fp32
        angles = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        dtype = self.body_dtype
        overlapped = chunks > 1 and shards is None and self.layout.tp_size > 1
        sums, shard = None, False
        if overlapped:
            shard = self.tp_shard_residual != "never" and not (self.config.moe or layer_hook)
            sums = overlap_sums(self, -(-n // chunks), device, gather_rows=n if shard else 0)
            shard = shard and (self.tp_shard_residual == "always" or isinstance(sums, PeerCopySums))
        shared = LayerInputs(
            cos=(angles.cos() * self.rope_scale).to(dtype),
            sin=(angles.sin() * self.rope_scale).to(dtype),
            docs=docs,
            backend=self.attention_backend,
            group=self.tp_group,
            sums=sums,
        )
        moe = self.config.moe
        if replay_experts is not None:
            want = (n, len(moe.sparse_layer_indices), moe.top_k) if moe else None
            if want is None or tuple(replay_experts.shape) != want:
                raise ValueError(
                    f"replay_experts must be (N, L_sparse, k) = {want}, got {replay_experts.shape}"
                )
            replay_experts = replay_experts.to(device=device, dtype=torch.int64)
        if shards is not None:  # sequence parallel: every rank holds its token rows of the residual stream
            x = self.model.embed_tokens(input_ids[shards.local_rows(device)])  # (N_pad / tp, H)
            for layer in self.model.layers:
                x = dense_sequence_parallel(layer, x, shared, shards)
            return TrunkOutput(gather_tokens(self.model.norm(x), shards, self.tp_group)[:n], None)
        x = self.model.embed_tokens(input_ids)  # (N, H)
        if shard:  # dense, TP > 1: the residual sharded inside each chunk, no hook
            layers = self.model.layers
            stream = sharded_start(x, layers[0].input_layernorm, sums, chunks)
            final = self.model.norm  # normalised into gather buffer 1, the others into buffer 0
            following = [layer.input_layernorm for layer in layers[1:]] + [final]
            for layer, norm in zip(layers, following, strict=True):
                stream = dense_sharded(layer, stream, shared, sums, chunks, norm, int(norm is final))
            return TrunkOutput(sharded_finish(stream, sums), None)
        if layer_hook is not None:
            x = _hooked(layer_hook, -1, x, x)
        picked: list[Tensor] = []
        for index, layer in enumerate(self.model.layers):
            replay = None if replay_experts is None or not layer.sparse else replay_experts[:, len(picked)]
            out, chosen = layer(x, shared, self.expert_impl, replay, chunks)
            x = out if layer_hook is None else _hooked(layer_hook, index, x, out)
            if chosen is not None:
                picked.append(chosen)
        return TrunkOutput(self.model.norm(x), torch.stack(picked, dim=1) if picked else None)


def _padded(
    input_ids: Tensor, position_ids: Tensor, docs: PackedDocs, n_padded: int
) -> tuple[Tensor, Tensor, PackedDocs]:
    """The batch padded to `n_padded` tokens by one extra document of token 0 (attention stays within
    documents, so the real tokens see the same context); unchanged when no padding is needed."""
    n = input_ids.shape[0]
    if n_padded == n:
        return input_ids, position_ids, docs
    extra = torch.arange(n_padded - n, device=input_ids.device)
    bounds = torch.tensor([*docs.bounds, n_padded], dtype=torch.int32)
    padded_docs = PackedDocs.from_cu_seqlens(bounds, n_padded, docs.cu_seqlens.device)
    return torch.cat((input_ids, torch.zeros_like(extra))), torch.cat((position_ids, extra)), padded_docs


def _hooked(
    hook: Callable[[int, Tensor, Tensor], Tensor | None], index: int, x_in: Tensor, x_out: Tensor
) -> Tensor:
    """`x_out`, or what `hook` returns in its place (cast to x_out's dtype and device)."""
    replaced = hook(index, x_in, x_out)
    return x_out if replaced is None else replaced.to(dtype=x_out.dtype, device=x_out.device)


def warm_pointwise_ops(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Run each fused pointwise op of `model` once on small random tensors of the ranks, dtypes and layouts the
    forward gives it, so that Triton loads (or builds) its kernels now; the loader calls this while the weights
    are still arriving (`pgdiag.model.weight_stream`). No-op unless the ops are fused and `device` is CUDA."""
    if model.fuse_pointwise and torch.device(device).type == "cuda":
        triton_key_thread().join()  # Triton's installation key, computed while the weights arrived
        _warm_calls(model, device, dtype)


def _warm_calls(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """`warm_pointwise_ops`' calls, on any device (on the CPU they compile the `torch.compile` graphs the forward
    uses). The norms' weights are what the forward passes: parameters made outside inference mode (a plain tensor,
    or one made under inference mode, fails a compiled graph's guards and the norms were compiled again)."""
    config, layout = model.config, model.layout
    n, d, h, eps = 64, config.head_dim, config.hidden_size, config.rms_norm_eps

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    def weight(size: int) -> nn.Parameter:
        with torch.inference_mode(False):
            return nn.Parameter(rand(size), requires_grad=False)

    layer = model.model.layers[0]
    attn, ops = layer.self_attn, layer.self_attn.ops
    norm_weights = {size: weight(size) for size in (h, d)}
    with torch.inference_mode():
        layer.input_layernorm.norm(rand(n, h), norm_weights[h], eps)  # (n, H)
        cos, sin = rand(n, 1, d), rand(n, 1, d)
        for heads in {attn.local_num_heads, attn.local_num_kv_heads}:
            ops.rope(rand(n, heads, d), cos, sin)  # (n, heads, D)
            if hasattr(attn, "q_norm"):
                attn.q_norm.norm(rand(n, heads, d), norm_weights[d], eps)
        if not all(layer.sparse for layer in model.model.layers):
            inner = layout.local_intermediate_size
            ops.swiglu(rand(n, inner), rand(n, inner))  # (n, I_local)
