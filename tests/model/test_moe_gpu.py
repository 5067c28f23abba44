"""GPU checks of the MoE path (skipped without CUDA): grouped GEMM equals the per-expert loop in bf16, on the
expert op alone and through a whole tiny model, and gpt-oss sinks through varlen equal the eager sink path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model
from moe_tiny import MOE_CASES

from pgdiag.model import load_model
from pgdiag.model.attention import PackedDocs, packed_attention, varlen_available
from pgdiag.model.moe import expert_outputs, resolve_expert_impl, silu_glu

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_cuda
def test_grouped_equals_loop_bf16() -> None:
    """Both bf16 paths against an fp64 reference of the same math: same error size, and close to each other."""
    assert resolve_expert_impl("auto", torch.device("cuda"), torch.bfloat16) == "grouped"
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, i, e, k = 3000, 512, 256, 16, 4
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
    logits = torch.randn(n, e, device="cuda", generator=g)
    top, experts = logits.softmax(-1).topk(k, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    experts[:7] = 3  # a crowded expert, and some with few tokens
    out = {impl: expert_outputs(x, experts, weights, gate_up, down, glu=silu_glu, impl=impl)
           for impl in ("loop", "grouped")}  # fmt: skip
    ref = expert_outputs(x.double(), experts, weights.double(), gate_up.double(), down.double(), glu=silu_glu)
    errors = {impl: rel_err(o, ref) for impl, o in out.items()}
    print(errors)
    assert errors["grouped"] < 1e-2 and errors["loop"] < 1e-2
    assert rel_err(out["grouped"], out["loop"]) < 1e-2
    # rank owning experts 4..7 only
    part = expert_outputs(
        x, experts, weights, gate_up[4:8], down[4:8], glu=silu_glu, expert_start=4, impl="grouped"
    )
    part_loop = expert_outputs(x, experts, weights, gate_up[4:8], down[4:8], glu=silu_glu, expert_start=4)
    assert rel_err(part, part_loop) < 1e-2


@needs_cuda
def test_grouped_model_equals_loop_model(tmp_path: Path) -> None:
    arch, overrides = MOE_CASES["qwen3-moe"]
    save_hf_model(tmp_path, arch, **{**overrides, "hidden_size": 128, "moe_intermediate_size": 64})
    ids, pos, cu = packed_inputs([300, 17, 1, 520], 251)
    ids, pos = ids.cuda(), pos.cuda()
    outs = {}
    for impl in ("loop", "grouped"):
        model = load_model(tmp_path, dtype="bf16", device="cuda", experts=impl)
        assert model.expert_impl == impl
        outs[impl] = model.forward_packed(ids, pos, cu)
    assert rel_err(outs["grouped"].hidden, outs["loop"].hidden) < 2e-2
    same = (outs["grouped"].router_topk == outs["loop"].router_topk).all(-1).float().mean().item()
    assert same > 0.9  # bf16 rounding moves a few near-tied routes


@needs_cuda
@pytest.mark.skipif(not varlen_available(), reason="torch.nn.attention.varlen not in this torch")
@pytest.mark.parametrize("window", [None, 40])
def test_varlen_sinks_equal_eager_sinks(window: int | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [300, 17, 1, 520]
    n = sum(lengths)
    q = torch.randn(n, 8, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, 2, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(n, 2, 64, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(8, device="cuda", generator=g) * 2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    docs = PackedDocs.from_cu_seqlens(cu, n, torch.device("cuda"))
    ref = packed_attention(q.float(), k.float(), v.float(), docs, window=window, backend="sdpa", sinks=sinks)
    got = packed_attention(q, k, v, docs, window=window, backend="varlen", sinks=sinks)
    assert rel_err(got, ref) < 1e-2
    plain = packed_attention(q.float(), k.float(), v.float(), docs, window=window, backend="sdpa")
    assert rel_err(plain, ref) > 5e-2  # the sinks bind


@needs_cuda
def test_compiled_combine_equals_eager() -> None:
    from pgdiag.model.moe import combine_rows, moe_combine

    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, h = 999, 8, 256
    rows = torch.randn(n * k - 5, h, device="cuda", generator=g).bfloat16()
    row_of = torch.randint(0, rows.shape[0], (n, k), device="cuda", generator=g)
    weights = torch.rand(n, k, device="cuda", generator=g)
    weights[:3] = 0.0  # assignments another rank owns
    eager = combine_rows(rows, row_of, weights)
    fused = moe_combine(True)(rows, row_of, weights)
    assert fused.dtype == torch.bfloat16
    # both round each weighted row to bf16 (as HF), sum the k in fp32 and round once; the compiled kernel may
    # order or fuse that sum differently, so a rare element lands one bf16 ulp away: each must be within one
    # ulp (2^-8 relative, plus the fp32 sum's own error) of the same products summed in fp64
    products = (rows[row_of].float() * weights[..., None]).bfloat16()  # (n, k, h), what both sum
    exact = products.double().sum(1)  # (n, h)
    for got in (fused, eager):
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
    assert (fused != eager).float().mean().item() < 1e-4  # and they agree but for those rare ties
    # the kernel sums the k products in order j = 0 .. k-1: bit for bit the same as that sum written in torch
    sequential = products[:, 0].float()
    for j in range(1, k):
        sequential = sequential + products[:, j].float()
    assert torch.equal(fused, sequential.bfloat16())
