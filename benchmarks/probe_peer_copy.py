"""The rates between two GPUs that `pgdiag.model.tp_sums` relies on: a partial pushed into the other GPU's
symmetric memory by a device-to-device copy (the copy engines), both GPUs pushing at once, against NCCL's
all-reduce of the same tensor; and a bf16 GEMM of the MLP's shape alone, beside the pushes and beside NCCL.

Run: torchrun --nproc-per-node 2 benchmarks/probe_peer_copy.py   (prints one JSON line from rank 0)
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def timed(fn, stream: torch.cuda.Stream | None = None, repeats: int = 10) -> float:
    """Milliseconds a call of fn, averaged over `repeats` after one warm-up, both ranks started together."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    rows, hidden = 8192, 4096  # one 8192-token chunk of the 8B shape's residual stream
    part = torch.randn(rows, hidden, device=device).bfloat16()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(dist.group.WORLD.group_name)
    recv = symm_mem.empty((rows, hidden), dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(recv, dist.group.WORLD)
    peer = handle.get_buffer(1 - rank, (rows, hidden), torch.bfloat16)
    nbytes = part.numel() * 2
    result = {"bytes": nbytes}
    result["push_ms"] = timed(lambda: peer.copy_(part))
    result["nccl_all_reduce_ms"] = timed(lambda: dist.all_reduce(part))
    a = torch.randn(rows, hidden, device=device).bfloat16()
    w = torch.randn(2 * 6144, hidden, device=device).bfloat16()  # gate and up of one TP 2 rank
    result["gemm_ms"] = timed(lambda: a @ w.t())
    side = torch.cuda.Stream(device)

    def gemm_beside(comm) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm()
        out = a @ w.t()
        torch.cuda.current_stream().wait_stream(side)
        del out

    result["gemm_beside_push_ms"] = timed(lambda: gemm_beside(lambda: peer.copy_(part)))
    result["gemm_beside_nccl_ms"] = timed(lambda: gemm_beside(lambda: dist.all_reduce(part)))
    for key in [k for k in result if k.endswith("_ms") and k.startswith(("push", "nccl"))]:
        result[key.replace("_ms", "_gb_s")] = nbytes / result[key] / 1e6
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
