"""Vocab-parallel LM head on two GPUs with NCCL: TP=2 equals TP=1 within 1e-5 (Triton kernel, bf16 and fp32 head).

The test starts its own two processes (torch.multiprocessing, one GPU each); skipped with fewer than 2 GPUs.
Each rank computes the TP=2 result from its shard and the TP=1 result from the whole head on its own GPU.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_head_cases import make_case

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.vocab_parallel import vocab_shard_range

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

WORLD = 2
SETTINGS = [("bf16", 151936, 1.0), ("fp32", 151935, 0.7)]  # (head_dtype, V, temperature); 151935 is uneven


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for head_dtype, vocab, temperature in SETTINGS:
            case = make_case(4096, 4096, vocab, seed=vocab, device=f"cuda:{rank}")
            start, stop = vocab_shard_range(vocab, rank, WORLD)
            boundary = vocab_shard_range(vocab, 0, WORLD)[1]  # first row of rank 1's shard
            targets = case.targets.clone()  # the same on every rank, as TP requires
            targets[2:6] = torch.tensor([boundary - 1, boundary, 0, vocab - 1])  # shard edges on both ranks
            hidden = case.hidden if head_dtype == "fp32" else case.hidden.bfloat16()
            weight = case.weight.bfloat16()
            kwargs = {"temperature": temperature, "head_dtype": head_dtype, "impl": "triton"}
            tp = lm_head_logprobs(
                hidden, weight[start:stop], targets, tp_group=dist.group.WORLD, vocab_start=start, **kwargs
            )
            one = lm_head_logprobs(hidden, weight, targets, **kwargs)
            results[head_dtype] = [t.cpu() for t in (tp.logprobs, tp.entropy, one.logprobs, one.entropy)]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for head_dtype, (tp_lp, tp_ent, one_lp, one_ent) in results.items():
            assert torch.isfinite(tp_lp).all() and torch.isfinite(tp_ent).all()
            lp_gap = float((tp_lp - one_lp).abs().max())
            ent_gap = float((tp_ent - one_ent).abs().max())
            assert lp_gap <= 1e-5 and ent_gap <= 1e-5, (rank, head_dtype, lp_gap, ent_gap)
