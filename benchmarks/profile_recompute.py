"""Where a recompute pass spends its GPU time: one warm pass under `torch.profiler`, kernels grouped by kind.

What: the model of `bench_multigpu.MODELS` (synthetic bf16 weights, made on the GPU), rollouts of realistic RL
lengths packed into `--batch-tokens` batches, the head on bf16 hidden states as the CLI runs it. After a warm-up
pass (compiles) one pass is timed with CUDA events and one more is profiled. Printed: tokens/s and MFU of the
timed pass, then the GPU time per kernel group (matmuls, grouped matmuls, attention, LM head, NCCL, pointwise,
copies, the rest), the share of the pass's wall time the GPU was busy, and the top kernels by total time.
Under torchrun with `--tp N` the model is tensor-parallel over the world (NCCL kernels then show).

How to run (device):
    python benchmarks/profile_recompute.py --model qwen3-30b-a3b --rollouts 64 --out moe_profile.json
    torchrun --nproc-per-node 2 benchmarks/profile_recompute.py --model qwen3-8b --tp 2
    python benchmarks/profile_recompute.py --model tiny --device cpu --rollouts 4   # a smoke test
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multigpu import MODELS, SyntheticSource, model_flops_any, run_pass
from bench_recompute import PEAK_MEASURED, make_rollouts, pack

from pgdiag.model import ModelConfig, load_from_source
from pgdiag.model.moe import MoeBlock, combine_rows

GROUPS = (  # (group, substrings of a kernel name), first match wins
    ("nccl", ("nccl",)),
    ("memcpy / memset (copy engines)", ("Memcpy", "Memset")),
    ("moe combine", ("_combine_kernel", "index_select_mul_sum")),
    ("lm head (triton)", ("_head_partials", "split_hidden", "merge", "finish")),
    ("grouped matmul", ("grouped", "group_gemm", "GroupedGemm", "GroupProblem", "ragged")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "wgmma")),
    (
        "copy / index",
        ("copy", "Copy", "gather", "scatter", "index", "cat", "sort", "radix", "Memcpy", "Memset"),
    ),
    ("compiled pointwise", ("triton_",)),
    ("pointwise (eager)", ("elementwise", "vectorized", "reduce", "Reduce")),
)


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (start, end): overlapping time counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_group(name: str) -> str:
    return next((group for group, keys in GROUPS if any(k in name for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--head-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel over the torchrun world")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--combine",
        default="default",
        choices=["default", "compiled"],
        help="MoE combine: the model's (the Triton kernel on CUDA) or combine_rows under torch.compile (before)",
    )
    parser.add_argument(
        "--trace", default=None, help="write rank 0's profiled pass as a gzipped Chrome trace"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    group = None
    if args.tp > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        group = dist.group.WORLD
    cfg = ModelConfig.from_hf_dict(MODELS[args.model], source=args.model)
    rollouts = make_rollouts(args.rollouts, cfg.vocab_size, device, seed=0, scale=1.0)
    batches = pack(rollouts, args.batch_tokens)
    n_tokens = sum(len(r.tokens) for r in rollouts)
    model = load_from_source(cfg, SyntheticSource(cfg, device), where="synthetic", dtype="bf16",
                             head_dtype=args.head_dtype, device=device, tp_group=group,
                             fuse_pointwise=device.type == "cuda", attention="auto")  # fmt: skip
    if args.combine == "compiled":  # the combine as it was before issue 26: combine_rows under torch.compile
        compiled = torch.compile(combine_rows, dynamic=True, fullgraph=True,
                                 options={"emulate_precision_casts": True})  # fmt: skip
        for module in model.modules():
            if isinstance(module, MoeBlock):
                module.combine = compiled

    def one_pass() -> None:
        run_pass(model, batches, args.head_dtype, group, cfg.moe is not None)

    one_pass()  # warm-up: compile, autotune
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    one_pass()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    flops = model_flops_any(cfg, rollouts)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t1 = time.perf_counter()
        one_pass()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prof_wall = time.perf_counter() - t1
    kernels: dict[str, list[float]] = {}  # name -> [total us, count]
    spans: list[tuple[float, float]] = []  # (start, end) us of every kernel but the copy engines' work
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            slot = kernels.setdefault(event.name, [0.0, 0])
            slot[0] += event.device_time
            slot[1] += 1
            if not event.name.startswith(("Memcpy", "Memset")):
                spans.append((event.time_range.start, event.time_range.end))
    sm_busy = union_length(spans) / 1e6  # s some kernel ran (overlapping kernels counted once)
    by_group: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        by_group[kernel_group(name)] = by_group.get(kernel_group(name), 0.0) + us
    busy = sum(by_group.values()) / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
    result = {
        "model": args.model, "tp": args.tp, "combine": args.combine, "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda"
        else "cpu", "tokens": n_tokens, "batches": len(batches), "pass_s": seconds,
        "tokens_per_s": n_tokens / seconds, "mfu": flops / seconds / (PEAK_MEASURED * args.tp),
        "profiled_pass_s": prof_wall, "gpu_busy_s": busy, "kernels_union_s": sm_busy,
        "groups_s": {k: v / 1e6 for k, v in sorted(by_group.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "s": us / 1e6, "count": c} for n, (us, c) in top],
    }  # fmt: skip
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"{args.model} tp {args.tp}: {n_tokens} tokens, pass {seconds:.3f} s, {n_tokens / seconds:,.0f} tok/s, "
              f"MFU {result['mfu']:.1%}; profiled pass {prof_wall:.3f} s, GPU kernels {busy:.3f} s, some kernel "
              f"running {sm_busy:.3f} s", flush=True)  # fmt: skip
        for k, v in result["groups_s"].items():
            print(f"  {k:22s} {v:8.3f} s  {v / prof_wall:6.1%} of the pass", flush=True)
        for row in result["top_kernels"]:
            print(f"  {row['s']:8.4f} s x{row['count']:5d}  {row['name'][:120]}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.trace:
            plain = Path(args.trace).with_suffix("")
            prof.export_chrome_trace(str(plain))
            with plain.open("rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
