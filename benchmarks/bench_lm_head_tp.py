"""Benchmark: vocab-parallel LM head (TP ranks each holding a vocab shard) against TP=1, under torchrun.

What: per-rank time of `lm_head_logprobs(..., impl="triton", tp_group=...)` on a shard of W (one all-gather of
16 bytes a token per call), the same call with the whole W on one GPU (TP=1, no collective), and the local
cuBLAS matmul of the shard (the floor). Target: TP=2 per-rank time <= 0.55x TP=1.

How: ``torchrun --nproc-per-node 2 benchmarks/bench_lm_head_tp.py [--tokens 16384] [--shape 4096x151936]
[--json out.json]``. Timing under torch.distributed uses a fixed iteration count on every rank, CUDA events
around the loop and a barrier before it (do_bench picks its repeat count per rank, so ranks would issue
different numbers of collectives and hang).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime

import torch
import torch.distributed as dist
import triton
from bench_lm_head import write_json_atomic

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.vocab_parallel import vocab_shard_range

WARMUP, ITERS = 3, 10


def timed_ms(fn: Callable[[], object]) -> float:
    """Mean ms of `ITERS` calls after `WARMUP`, the same counts on every rank; max over ranks."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    stop.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(stop) / ITERS], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shape", default="4096x151936", help="DxV")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden_size, vocab = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)  # same inputs on every rank
    hidden = torch.randn(args.tokens, hidden_size, device="cuda", generator=gen)
    weight = (
        torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (3.0 / hidden_size**0.5)
    ).bfloat16()
    targets = torch.randint(0, vocab, (args.tokens,), device="cuda", generator=gen)
    start, stop = vocab_shard_range(vocab, rank, world)
    shard = weight[start:stop]
    hidden_bf16 = hidden.bfloat16()

    rows = {}
    with torch.no_grad():
        for head_dtype, h in (("bf16", hidden_bf16), ("fp32", hidden)):
            tp1 = timed_ms(lambda h=h, hd=head_dtype: lm_head_logprobs(h, weight, targets, head_dtype=hd))
            tpn = timed_ms(
                lambda h=h, hd=head_dtype: lm_head_logprobs(
                    h, shard, targets, head_dtype=hd, tp_group=dist.group.WORLD, vocab_start=start
                )
            )
            rows[head_dtype] = {"tp1_ms": tp1, f"tp{world}_ms": tpn, "ratio": tpn / tp1}
        rows["local_gemm_ms"] = timed_ms(lambda: hidden_bf16 @ shard.T)
    if rank == 0:
        result = {
            "device": torch.cuda.get_device_name(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "world": world,
            "T": args.tokens,
            "d": hidden_size,
            "V": vocab,
            **rows,
        }
        print(json.dumps(result, indent=1))
        if args.json:
            write_json_atomic(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
