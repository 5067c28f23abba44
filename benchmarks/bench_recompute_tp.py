"""Whole recompute with tensor parallelism: TP=2 vs TP=1 tokens/s and logprob equality, Qwen3-8B shape.

What: every rank first runs the whole model alone (TP=1, one model per GPU, the same batches on each), then the
ranks run one model split over all of them (TP=N: heads, MLP and the vocab-parallel head sharded, the head fed
to `lm_head_logprobs` with the group, never gathered). Reported: tokens/s of each, the speedup (target >= 1.6x
at TP=2 on two H200s), MFU over N x the 790 TFLOP/s measured bf16 peak, peak memory per GPU, and the max / mean
|logprob(TP=N) - logprob(TP=1)| over all response tokens (bf16 body: reduction order differs, so equal within
bf16 tolerance, not bit-equal).

Weights are synthetic and never exist whole on a rank: each element is a hash of (tensor, row, column), so a
rank generates exactly the slice the shard plan gives it, and TP=1 and TP=N see the same numbers. This goes
through the real loader (`load_from_source` with a `TensorSource` subclass), the same path as safetensors.

How to run:
    torchrun --nproc-per-node 2 benchmarks/bench_recompute_tp.py --out tp.json
    torchrun --nproc-per-node 2 benchmarks/bench_recompute_tp.py --device cpu --tiny    # gloo smoke test
Keep NCCL_NVLS_ENABLE=0 (NVLink multicast off) as the device machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
from bench_recompute import PEAK_MEASURED, QWEN3_8B, TINY, make_rollouts, model_flops, pack

from pgdiag.kernels import lm_head_logprobs
from pgdiag.model import ModelConfig, TensorSource, load_from_source
from pgdiag.model.expected_tensors import expected_shapes
from pgdiag.model.tp import TensorSlice


class SyntheticSource(TensorSource):
    """Deterministic pseudo-random weights, any slice generated alone: uniform with std 0.02, norms 1."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self._shapes = expected_shapes(config)
        self._device = device

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def is_fp32(self, name: str) -> bool:
        return False

    def dtype(self, name: str) -> torch.dtype:
        return torch.bfloat16

    def read(self, name: str, part: TensorSlice | None) -> torch.Tensor:
        shape = self._shapes[name]
        if "norm" in name:
            size = shape[0] if part is None else part.stop - part.start
            return torch.ones(size, dtype=torch.bfloat16, device=self._device)
        rows = torch.arange(shape[0], device=self._device)
        cols = torch.arange(shape[1] if len(shape) == 2 else 1, device=self._device)
        if part is not None and part.dim == 0:
            rows = rows[part.start : part.stop]
        elif part is not None:
            cols = cols[part.start : part.stop]
        width = shape[1] if len(shape) == 2 else 1
        salt = zlib.crc32(name.encode())
        index = rows[:, None] * width + cols[None, :]  # (R, C) int64 global element index
        bits = (index * 2654435761 + salt) % 4294967296
        bits = (bits ^ (bits >> 15)) * 2246822519 % 4294967296
        uniform = (bits ^ (bits >> 13)).double() / 4294967296.0  # (R, C) in [0, 1)
        values = ((uniform - 0.5) * (0.02 * 12**0.5)).to(torch.bfloat16)
        return values if len(shape) == 2 else values[:, 0]


def run_pass(model, batches, head_dtype: str, impl: str, group) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for b in batches:
            hidden = model.hidden_states(b.input_ids, b.position_ids, b.cu_seqlens)  # (N, H) bf16
            h = hidden[b.head_positions]
            res = lm_head_logprobs(h.float() if head_dtype == "fp32" else h, model.lm_head_weight, b.targets,
                                   head_dtype=head_dtype, impl=impl, tp_group=group,
                                   vocab_start=model.vocab_start)  # fmt: skip
            out.append(res.logprobs)
    return out


def timed(fn, device: torch.device, repeats: int):
    """Warm-up, then a fixed number of timed runs on every rank (never an adaptive repeat count)."""
    result = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rollouts", type=int, default=48)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--head-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impl", default="auto", help="lm_head_logprobs impl (auto, torch, triton)")
    parser.add_argument("--fuse-pointwise", action="store_true", help="torch.compile RMSNorm/RoPE/SwiGLU")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = ModelConfig.from_hf_dict(TINY if args.tiny else QWEN3_8B, source="bench config")
    rollouts = make_rollouts(args.rollouts, cfg.vocab_size, device, seed=0, scale=0.05 if args.tiny else 1.0)
    batches = pack(rollouts, args.batch_tokens)
    n_tokens, flops = sum(len(r.tokens) for r in rollouts), model_flops(cfg, rollouts)
    rows = []
    reference = None
    for tp in (1, world):
        group = dist.group.WORLD if tp > 1 else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = load_from_source(cfg, SyntheticSource(cfg, device), where="synthetic", dtype="bf16",
                                 head_dtype=args.head_dtype, device=device, tp_group=group,
                                 fuse_pointwise=args.fuse_pointwise)  # fmt: skip
        times, logprobs = timed(lambda m=model, g=group: run_pass(m, batches, args.head_dtype, args.impl, g),
                                device, args.repeats)  # fmt: skip
        t = float(np.median(times))
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        row = {"tp": tp, "seconds": times, "tokens_per_s": n_tokens / t, "peak_gib_per_gpu": peak,
               "mfu_measured_peak": flops / t / (tp * PEAK_MEASURED), "attention": model.attention_backend}  # fmt: skip
        flat = torch.cat(logprobs).float().cpu()
        if reference is None:
            reference = flat
        else:
            diff = (flat - reference).abs()
            row.update(max_abs_diff_vs_tp1=float(diff.max()), mean_abs_diff_vs_tp1=float(diff.mean()))
        rows.append(row)
        del model, logprobs
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        speedup = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "world": world, "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": args.commit,
            "torch": torch.__version__, "real_tokens": n_tokens, "head_dtype": args.head_dtype, "impl": args.impl,
            "fuse_pointwise": args.fuse_pointwise, "rows": rows,
            "speedup_tp_vs_tp1": speedup,
        }  # fmt: skip
        print(f"TP={world} vs TP=1: {speedup:.2f}x tokens/s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
