"""Mixture-of-experts blocks: the router, the expert compute (a reference loop or grouped GEMM) and routing replay.

What: `MoeBlock` replaces the dense MLP in the sparse layers of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss. The
router (replicated) scores every expert per token; `route` keeps the top-k and their weights as the
architecture defines them (`pgdiag.model.config.MoeConfig`); `expert_outputs` runs this rank's experts on the
tokens sent to them and combines the weighted outputs per token. `replay_weights` is the replay half: given the
experts an inference engine recorded, it recomputes only their weights from this router's logits, which is
what the RL frameworks' routing replay does.

Why this shape: tokens are sorted by expert once per layer (a stable argsort of the ``N x k`` assignments), so
every expert sees one contiguous slice of rows and no ``[tokens x experts x d]`` tensor ever exists. Two
implementations of the same math, chosen by an argument (`impl`), never an env var:
- ``"loop"``: one pair of matmuls per expert over its slice; the reference and the CPU path.
- ``"grouped"``: two grouped GEMMs over all experts at once with `torch.nn.functional.grouped_mm` (torch >= 2.10;
  `torch._grouped_mm` on older torches that have it), ``offs`` = the cumulative rows per expert. CUDA bf16.
`resolve_expert_impl("auto", device, dtype)` picks ``grouped`` on CUDA for a bf16 body when this torch has it.

Numerics: the router runs in the body dtype and its softmax in fp32 (as HF); each expert's weighted output is
rounded to the body dtype (as HF), and the k outputs of a token are summed in fp32 (HF sums them in the body
dtype in expert order; in fp32 the two agree to rounding). Expert weights live in one canonical layout per
layer: ``gate_up`` (E_local, 2I, H) with the gate rows first, ``down`` (E_local, H, I); the loader converts the
HF layouts (per-expert tensors, Mixtral's w1/w3/w2, gpt-oss's fused and interleaved gate_up, MXFP4) into it.

Tensor parallelism: a rank holds experts ``expert_start : expert_start + E_local`` (`pgdiag.model.tp`); its
output is a partial sum over its experts, reduced by the caller's one `all_reduce_sum` (with the shared
expert's partial sum, for Qwen2-MoE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pgdiag.errors import Code, UsageError
from pgdiag.model.config import ModelConfig, MoeConfig
from pgdiag.model.fused_ops import LazyCompiled
from pgdiag.model.tp import TPLayout, all_reduce_sum

EXPERT_IMPLS = ("auto", "loop", "grouped")


def _grouped_mm_fn() -> Callable[..., Tensor] | None:
    """`F.grouped_mm`, else `torch._grouped_mm`, else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def resolve_expert_impl(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``grouped`` on CUDA with a bf16 body when this torch has a grouped matmul, else ``loop``.
    ``grouped`` is refused (E503) where it cannot run: no grouped matmul in this torch, or CUDA without bf16."""
    if requested not in EXPERT_IMPLS:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"unknown expert implementation {requested!r}; choose one of {EXPERT_IMPLS}",
        )
    available = _grouped_mm_fn() is not None
    cuda_ok = device.type != "cuda" or dtype == torch.bfloat16
    if requested == "auto":
        return "grouped" if available and device.type == "cuda" and dtype == torch.bfloat16 else "loop"
    if requested == "grouped" and not (available and cuda_ok):
        raise UsageError(
            Code.DEVICE_UNAVAILABLE,
            f"expert implementation 'grouped' needs torch's grouped matmul (and a bf16 body on CUDA); got {dtype}",
            "load the model with experts='loop' or 'auto'",
        )
    return requested


def route(logits: Tensor, moe: MoeConfig) -> tuple[Tensor, Tensor]:
    """Top-k routing of router `logits` (N, E): (weights (N, k) fp32, experts (N, k) int64), HF's order."""
    if moe.router == "topk_softmax":  # gpt-oss: top-k logits, softmax over those k in the logits dtype
        top, experts = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1).float(), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    top, experts = torch.topk(probs, moe.top_k, dim=-1)
    return _finish_weights(top, logits.dtype, moe), experts


def replay_weights(logits: Tensor, experts: Tensor, moe: MoeConfig) -> Tensor:
    """Weights (N, k) fp32 of the given `experts` (N, k) under this router's `logits` (N, E): the recorded experts
    of routing replay, weighted as `route` would weight them had it chosen them."""
    if moe.router == "topk_softmax":
        return torch.softmax(logits.gather(1, experts), dim=-1).float()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return _finish_weights(probs.gather(1, experts), logits.dtype, moe)


def _finish_weights(top: Tensor, logits_dtype: torch.dtype, moe: MoeConfig) -> Tensor:
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if moe.weight_layout == "qwen":  # Qwen2/3-MoE round the weights to the logits dtype; Mixtral keeps fp32
        top = top.to(logits_dtype).float()
    return top


def different_sets(a: Tensor, b: Tensor) -> Tensor:
    """(N,) bool: the top-k expert sets of rows of `a` and `b` (N, k) differ (order within a row ignored)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def combine_rows(rows: Tensor, row_of: Tensor, weights: Tensor) -> Tensor:
    """out[t] = sum_j round(weights[t, j] * rows[row_of[t, j]]): each weighted expert output rounded to the rows'
    dtype (as HF), the k of a token summed in fp32. rows (M, H), row_of (N, k) int64, weights (N, k) fp32 ->
    (N, H). Fused by `torch.compile` (`moe_combine(fused=True)`) it is one gather-multiply-sum kernel."""
    n, k = weights.shape
    picked = rows.index_select(0, row_of.reshape(-1)).view(n, k, -1)  # (N, k, H)
    weighted = (picked.float() * weights[..., None]).to(rows.dtype)
    return weighted.sum(dim=1, dtype=torch.float32).to(rows.dtype)


def moe_combine(fused: bool) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """`combine_rows`, eager, or fused into one kernel (same math, every cast kept): on CUDA the Triton kernel
    `pgdiag.model.moe_combine_triton` (one read of each expert row; `torch.compile` of `combine_rows` ran at a
    tenth of the memory bandwidth there), elsewhere `combine_rows` compiled by `torch.compile` at its first call (`fused_ops.LazyCompiled`)."""
    if not fused:
        return combine_rows
    compiled = LazyCompiled(combine_rows)  # compiled at its first call: never on CUDA

    def combine(rows: Tensor, row_of: Tensor, weights: Tensor) -> Tensor:
        if rows.is_cuda:
            from pgdiag.model.moe_combine_triton import combine_rows_triton

            return combine_rows_triton(rows, row_of, weights)
        return compiled(rows, row_of, weights)

    return combine


def expert_outputs(
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    glu: Callable[[Tensor, Tensor], Tensor],
    expert_start: int = 0,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    impl: str = "loop",
    combine: Callable[[Tensor, Tensor, Tensor], Tensor] = combine_rows,
) -> Tensor:
    """Sum over k of weights[t, j] * expert_{experts[t, j]}(x[t]) for this rank's experts: (N, H) in x.dtype.

    x (N, H); experts (N, k) global expert ids; weights (N, k) fp32; gate_up (E_local, 2I, H) gate rows first;
    down (E_local, H, I); biases (E_local, 2I) and (E_local, H) or None. Assignments to experts outside
    ``expert_start : expert_start + E_local`` contribute nothing (another rank owns them).
    """
    n, k = experts.shape
    n_local = gate_up.shape[0]
    local = experts.reshape(-1) - expert_start  # (N*k,)
    key = torch.where((local >= 0) & (local < n_local), local, n_local)  # n_local = not ours
    order = torch.argsort(key, stable=True)  # (N*k,) assignments grouped by expert
    counts = torch.bincount(key, minlength=n_local + 1)[:n_local]  # (E_local,)
    m = int(counts.sum())
    order = order[:m]  # (M,) this rank's assignments
    xs = x.index_select(0, order // k)  # (M, H) rows sorted by expert
    row_expert = key.index_select(0, order)  # (M,)
    if impl == "grouped":
        rows = _grouped(xs, counts, gate_up, down, row_expert, glu, gate_up_bias, down_bias)
    else:
        rows = _loop(xs, counts, gate_up, down, glu, gate_up_bias, down_bias)
    # where each assignment's output row is (row 0 with weight 0 where another rank owns the expert)
    row_of = torch.zeros(n * k, dtype=torch.int64, device=x.device)
    row_of.index_copy_(0, order, torch.arange(m, device=x.device))
    owned_weights = torch.where(key < n_local, weights.reshape(-1), 0.0).view(n, k)
    return combine(rows, row_of.view(n, k), owned_weights)  # (N, H)


def _loop(
    xs: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    glu: Callable[[Tensor, Tensor], Tensor],
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
) -> Tensor:
    out = torch.empty_like(xs)  # (M, H)
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        stop = start + count
        h = F.linear(
            xs[start:stop], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]
        )  # (m_e, 2I)
        gate, up = h.chunk(2, dim=-1)
        out[start:stop] = F.linear(glu(gate, up), down[e], None if down_bias is None else down_bias[e])
        start = stop
    return out


def _grouped(
    xs: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    row_expert: Tensor,
    glu: Callable[[Tensor, Tensor], Tensor],
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
) -> Tensor:
    grouped_mm = _grouped_mm_fn()
    offs = counts.cumsum(0).to(torch.int32)  # (E_local,) end row of each expert
    h = grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # (M, 2I)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, row_expert)
    gate, up = h.chunk(2, dim=-1)
    out = grouped_mm(glu(gate, up).contiguous(), down.transpose(1, 2), offs=offs)  # (M, H)
    if down_bias is not None:
        out = out + down_bias.index_select(0, row_expert)
    return out


class ExpertWeights(nn.Module):
    """This rank's experts of one layer in the canonical layout (filled by the loader from the HF tensors)."""

    def __init__(self, moe: MoeConfig, layout: TPLayout, hidden: int) -> None:
        super().__init__()
        e, i = layout.local_num_experts, moe.expert_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down = nn.Parameter(torch.empty(e, hidden, i))
        if moe.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_bias = nn.Parameter(torch.empty(e, hidden))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP, column/row-parallel; its partial output is not reduced here."""

    def __init__(self, hidden: int, local_intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, local_intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, local_intermediate, bias=False)
        self.down_proj = nn.Linear(local_intermediate, hidden, bias=False)


class MoeBlock(nn.Module):
    """Router + experts (+ shared expert) of one sparse layer; HF names for the router and shared expert."""

    def __init__(
        self,
        config: ModelConfig,
        layout: TPLayout,
        swiglu: Callable[[Tensor, Tensor], Tensor],
        combine: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> None:
        super().__init__()
        self.combine = combine
        moe = config.moe
        assert moe is not None
        h = config.hidden_size
        self.moe = moe
        self.expert_start = layout.expert_start
        self.router_name = "router" if moe.weight_layout == "gpt_oss" else "gate"
        self.add_module(self.router_name, nn.Linear(h, moe.num_experts, bias=moe.router_bias))
        self.experts = ExpertWeights(moe, layout, h)
        if moe.activation == "clamped_swiglu":
            alpha, limit = moe.swiglu_alpha, moe.swiglu_limit
            self.glu: Callable[[Tensor, Tensor], Tensor] = lambda g, u: clamped_swiglu(g, u, alpha, limit)
        else:
            self.glu = swiglu
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(h, layout.local_shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(
        self, x: Tensor, group: dist.ProcessGroup | None, impl: str, replay: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """(output (N, H) reduced over the group, the router's own top-k (N, k) int64).

        `replay` (N, k) int64: experts to use instead of the router's choice (recomputing only their weights);
        a token with any entry < 0 (not recorded) keeps the router's own choice.
        """
        router: nn.Linear = getattr(self, self.router_name)
        logits = router(x)  # (N, E) body dtype
        weights, chosen = route(logits, self.moe)  # (N, k) fp32, (N, k)
        experts = chosen
        if replay is not None:
            recorded = (replay >= 0).all(
                dim=-1, keepdim=True
            )  # (N, 1) a token with any -1 keeps its own routes
            experts = torch.where(recorded, replay, chosen)
            weights = replay_weights(logits, experts, self.moe)
        w = self.experts
        out = expert_outputs(
            x,
            experts,
            weights,
            w.gate_up,
            w.down,
            glu=self.glu,
            expert_start=self.expert_start,
            gate_up_bias=getattr(w, "gate_up_bias", None),
            down_bias=getattr(w, "down_bias", None),
            impl=impl,
            combine=self.combine,
        )  # (N, H) partial over this rank's experts
        if hasattr(self, "shared_expert"):
            s = self.shared_expert
            inner = self.glu(s.gate_proj(x), s.up_proj(x))  # (N, I_shared_local)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * F.linear(inner, s.down_proj.weight)
        return all_reduce_sum(out, group), chosen
