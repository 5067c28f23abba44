"""The copy-engine sums of a two-GPU TP group (`pgdiag.model.tp_sums.PeerCopySums`) equal NCCL's bit for bit.

Two processes (torch.multiprocessing, one GPU each, NCCL); skipped with fewer than 2 GPUs. Each rank runs the
exchanges in `dense_overlapped`'s order (a layer's 4 partials started, then each finished and one more started
per chunk, then the last 4 finished) for 6 layers, so every receive slot is reused; partials and residuals are
random bf16 (the residual the same on both ranks, as in the model), of 1000 rows in a slot of 1024. Each finish
must equal x + (p0 + p1) in eager torch and `NcclSums.finish` on the same inputs, on both ranks.

The sharded residual (`pgdiag.model.tp_dense.dense_sharded`) on a small bf16 Qwen3 (Triton pointwise kernels,
FlashAttention varlen): its hidden states equal the replicated overlapped form's bit for bit, with the copy
engines (pieces of the partials pushed, normed pieces gathered into symmetric memory) and with NCCL (broadcasts),
over two batches of different sizes (the buffers regrown, the gather buffers reused across batches).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pgdiag.model import load_model
from pgdiag.model.tp_sums import NcclSums, PeerCopySums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ROWS, HIDDEN, CHUNKS, LAYERS = 1000, 96, 4, 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inputs(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, p0, p1) of exchange `step`: the residual (same on both ranks) and both ranks' partials."""
    gen = torch.Generator().manual_seed(step)
    x, p0, p1 = (torch.randn(ROWS, HIDDEN, generator=gen).bfloat16() for _ in range(3))
    return x.to(device), p0.to(device), p1.to(device)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        peer = PeerCopySums(group, 1024, HIDDEN, torch.bfloat16, device, slots=4 * CHUNKS)
        nccl = NcclSums(group)
        got, want, eager = [], [], []
        step = 0
        for _ in range(LAYERS):
            started = []
            for _ in range(CHUNKS):  # a layer's o_proj partials
                x, p0, p1 = _inputs(step, rank, device)
                started.append((step, x, peer.start((p0, p1)[rank].clone())))
                step += 1
            later = []
            for _, x, pending in started:  # each chunk: its sum, then its down_proj partial
                got.append(peer.finish(pending, x))
                x2, q0, q1 = _inputs(step, rank, device)
                later.append((step, x2, peer.start((q0, q1)[rank].clone())))
                step += 1
            for _, x, pending in later:
                out = torch.empty_like(x)
                peer.finish(pending, x, out=out)
                got.append(out)
            for index, _, _ in started + later:
                x, p0, p1 = _inputs(index, rank, device)
                eager.append(x + (p0 + p1))
                want.append(nccl.finish(nccl.start((p0, p1)[rank].clone()), x))
        torch.cuda.synchronize()
        torch.save([[t.cpu() for t in ts] for ts in (got, want, eager)], Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_peer_copy_sums_equal_nccl(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got, want, eager in ranks:
        assert len(got) == len(want) == LAYERS * 2 * CHUNKS
        # `got` is in finish order; `want` and `eager` in the same order (started, then later, per layer)
        for g, w, e in zip(got, want, eager, strict=True):
            assert torch.equal(g, e)
            assert torch.equal(g, w)
    for a, b in zip(ranks[0][0], ranks[1][0], strict=True):
        assert torch.equal(a, b)  # both ranks hold the same sums


@pytest.mark.parametrize("n_elements", [1, 2047, 2048, 3 * 4096 + 5])
def test_residual_add_kernel_equals_eager_bf16(n_elements: int) -> None:
    """On the GPU in bf16 (not testable in the interpreter): the kernel equals x + (p + q) in eager torch."""
    from pgdiag.model.residual_add_triton import residual_add_triton

    gen = torch.Generator().manual_seed(n_elements)
    x, p, q = ((torch.randn(n_elements, generator=gen) * 8).bfloat16().cuda() for _ in range(3))
    assert torch.equal(residual_add_triton(x, p, q), x + (p + q))


SHARD_MODES = (("peer_copy", "never"), ("peer_copy", "peer_copy"), ("nccl", "always"), ("nccl", "never"))
BATCHES = ([700, 300, 1001], [1500, 37, 2263])  # documents per packed batch: 2001 and 3800 tokens


def _sharded_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from hf_tiny import packed_inputs

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model(model_dir, dtype="bf16", head_dtype="fp32", device=device, tp_group=dist.group.WORLD,
                           fuse_pointwise=True)  # fmt: skip
        model.tp_overlap_chunks, model.tp_overlap_min_tokens = 4, 1
        hidden = {}
        for reduce, shard in SHARD_MODES:
            model.tp_reduce, model.tp_shard_residual = reduce, shard
            for b, lengths in enumerate(BATCHES):
                ids, pos, cu = packed_inputs(lengths, 251, seed=b)
                hidden[reduce, shard, b] = model.hidden_states(ids, pos, cu).cpu()
            if shard == "peer_copy":  # the copy-engine form ran, with its gather buffers
                assert model._peer_sums is not None and model._peer_sums.gather_rows >= sum(BATCHES[1])
        torch.save(hidden, Path(out_dir) / f"hidden{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_residual_equals_replicated_bf16(tmp_path: Path) -> None:
    from hf_tiny import save_hf_model

    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "num_hidden_layers": 3}  # fmt: skip
    save_hf_model(tmp_path / "qwen3", "Qwen3ForCausalLM", **sizes)
    mp.spawn(_sharded_rank, args=(_free_port(), str(tmp_path / "qwen3"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"hidden{r}.pt") for r in range(2)]
    for hidden in ranks:
        for b, lengths in enumerate(BATCHES):
            want = hidden["peer_copy", "never", b]  # the replicated overlapped form, copy-engine sums
            assert want.shape == (sum(lengths), 256) and want.abs().sum() > 0
            for reduce, shard in SHARD_MODES[1:]:
                assert torch.equal(hidden[reduce, shard, b], want), (reduce, shard, b)
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key])  # every rank returns every row
