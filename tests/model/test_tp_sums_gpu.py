"""The copy-engine sums of a two-GPU TP group (`pgdiag.model.tp_sums.PeerCopySums`) equal NCCL's bit for bit.

Two processes (torch.multiprocessing, one GPU each, NCCL); skipped with fewer than 2 GPUs. Each rank runs the
exchanges in `dense_overlapped`'s order (a layer's 4 partials started, then each finished and one more started
per chunk, then the last 4 finished) for 6 layers, so every receive slot is reused; partials and residuals are
random bf16 (the residual the same on both ranks, as in the model), of 1000 rows in a slot of 1024. Each finish
must equal x + (p0 + p1) in eager torch and `NcclSums.finish` on the same inputs, on both ranks.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
