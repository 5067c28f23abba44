"""Recompute across several GPUs, library level: every DP x TP layout of one world, warm, in one process group.

What: under ``torchrun --nproc-per-node W`` each layout ``TPxDP`` (tp x dp = W) splits the world into dp replicas
of tp TP-contiguous ranks, loads the model at that TP degree from deterministic synthetic bf16 weights made slice
by slice on each rank (no rank ever holds more than its shard; the same numbers at every TP degree), deals the
rollouts to the replicas (longest first, round robin), and times whole passes (packed batches, body, LM head at
response positions through `lm_head_logprobs` with the TP group) after a warm-up pass that also compiles the
pointwise kernels. Reported per layout: tokens/s of the world and per GPU, MFU over W x 790 TFLOP/s, peak memory
per GPU, load seconds, and the log-prob difference (max / mean over every response token) to the first layout;
for MoE models the fraction of token x layer routes whose top-k set differs from the first layout's. Optional:
an fp32-body reference at one TP degree on the first rollouts (`--fp32-ref TP`), an extra bf16-head pass of the
first layout (`--bf16-head-too`), and the peak memory of one forward of a `--peak-batch`-token packed batch.

Models: ``qwen3-8b``, ``qwen3-30b-a3b`` (MoE), ``llama3-70b`` (80 layers, hidden 8192, 64/8 heads, intermediate
28672, vocab 128256), ``tiny`` and ``tiny-moe`` (CPU smoke tests).

How to run:
    torchrun --nproc-per-node 4 benchmarks/bench_multigpu.py --model qwen3-8b --layouts 1x4,2x2,4x1 --out 8b.json
    torchrun --nproc-per-node 4 benchmarks/bench_multigpu.py --model llama3-70b --layouts 4x1,2x2 --fp32-ref 4
    torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py --model qwen3-8b --layouts 1x2,2x1:c4:n,2x1:c4:s,2x1:c4:s:m8
    torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py --model tiny --device cpu --layouts 1x2,2x1,2x1:c2:s
Keep NCCL_NVLS_ENABLE=0 (NVLink multicast off) as the device machines require.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import QWEN3_30B_A3B
from bench_moe import TINY as TINY_MOE
from bench_recompute import PEAK_MEASURED, QWEN3_8B, TINY, make_rollouts, model_flops, pack

from pgdiag.kernels import lm_head_logprobs
from pgdiag.model import ModelConfig, TensorSource, load_from_source
from pgdiag.model.expected_tensors import expected_shapes
from pgdiag.model.fused_ops import FusedOp
from pgdiag.model.moe import different_sets
from pgdiag.model.tp import TensorSlice

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# Qwen3-235B-A22B's published config.json (94 layers); `--layers N` cuts it to what fits
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
}
MODELS = {
    "qwen3-8b": QWEN3_8B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "llama3-70b": LLAMA3_70B,
    "tiny": TINY,
    "tiny-moe": TINY_MOE,
}
_CHUNK = 1 << 25  # elements generated at once (int64 temporaries stay under ~1 GiB)


def synthetic_values(name: str, shape: tuple[int, ...], part: TensorSlice | None, device) -> torch.Tensor:
    """Rows/columns `part` of the deterministic synthetic tensor `name`: uniform with std 0.02 (norms 1), each
    element a hash of (name, global index), so any slice is made alone and equals the whole tensor's slice."""
    if "norm" in name:
        size = shape[0] if part is None else part.stop - part.start
        return torch.ones(size, dtype=torch.bfloat16, device=device)
    width = 1
    for d in shape[1:]:
        width *= d
    rows = range(shape[0]) if part is None or part.dim != 0 else range(part.start, part.stop)
    cols = torch.arange(width, device=device)
    if part is not None and part.dim == 1:
        cols = cols[part.start : part.stop] if len(shape) == 2 else cols
    salt = zlib.crc32(name.encode())
    step = max(1, _CHUNK // max(1, len(cols)))
    out = torch.empty(len(rows), len(cols), dtype=torch.bfloat16, device=device)
    for i in range(0, len(rows), step):
        r = torch.arange(rows.start + i, min(rows.start + i + step, rows.stop), device=device)
        bits = (r[:, None] * width + cols[None, :]) * 2654435761 + salt  # (R, C) int64
        bits %= 4294967296
        bits = (bits ^ (bits >> 15)) * 2246822519 % 4294967296
        uniform = (bits ^ (bits >> 13)).double() / 4294967296.0
        out[i : i + len(r)] = ((uniform - 0.5) * (0.02 * 12**0.5)).to(torch.bfloat16)
    if len(shape) == 1:
        return out[:, 0]
    if len(shape) > 2:
        return out.view(len(rows), *shape[1:])
    return out


class SyntheticSource(TensorSource):
    """The loader's view of the synthetic checkpoint: each rank reads (generates) only its slices."""

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

    def stored_dtype(self, name: str) -> str:
        return "BF16"

    def read(self, name: str, part: TensorSlice | None) -> torch.Tensor:
        return synthetic_values(name, self._shapes[name], part, self._device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pass(model, batches, head_dtype: str, group, want_routes: bool):
    """Per rollout of this replica, in batch order: (logprobs (R,), routes (T, L, k) uint8 or None)."""
    out = []
    with torch.inference_mode():
        for b in batches:
            trunk = model.forward_packed(b.input_ids, b.position_ids, b.cu_seqlens)
            h = trunk.hidden[b.head_positions]  # (M, H) body dtype, passed as is (as the CLI does)
            res = lm_head_logprobs(h, model.lm_head_weight, b.targets, head_dtype=head_dtype, tp_group=group,
                                   vocab_start=model.vocab_start)  # fmt: skip
            lps = res.logprobs.float().split(b.sizes)
            if want_routes and trunk.router_topk is not None:
                lengths = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
                routes = trunk.router_topk.to(torch.uint8).split(lengths)
            else:
                routes = [None] * len(lps)
            out.extend(zip(lps, routes, strict=True))
    return out


def nccl_options(max_ctas: int | None):
    """NCCL communicator options capping the CTAs (SMs) its kernels take, or None (NCCL's own choice)."""
    if not max_ctas:
        return None
    try:
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = max_ctas
        options.config.min_ctas = 1
    except (AttributeError, RuntimeError) as error:  # a torch without the NCCL config: say so, run without
        print(f"NCCL max_ctas not applied: {error}", file=sys.stderr, flush=True)
        return None
    return options


def build_groups(tp: int, dp: int, max_ctas: int | None = None) -> dist.ProcessGroup | None:
    """Every rank creates every replica's TP group (new_group is collective); returns this rank's."""
    mine = None
    for replica in range(dp):
        ranks = list(range(replica * tp, (replica + 1) * tp))
        group = dist.new_group(ranks, pg_options=nccl_options(max_ctas)) if tp > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    return mine


def deal(lengths: list[int], dp: int) -> list[list[int]]:
    """Rollout indices per replica: longest first, round robin (balanced tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [sorted(order[d::dp]) for d in range(dp)]


def world_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_layout(cfg, rollouts, args, tp: int, dp: int, device, *, dtype: str = "bf16", head_dtype: str,
                   keep: int, repeats: int, name: str, options: TPOptions | None = None,
                   ) -> tuple[dict, dict[int, torch.Tensor], dict]:  # fmt: skip
    """Load at (tp, dp), warm up, time `repeats` passes; returns (row, {rollout: logprobs}, {rollout: routes})."""
    rank, world = dist.get_rank(), dist.get_world_size()
    options = options or TPOptions()
    group = build_groups(tp, dp, options.max_ctas)
    replica, tp_rank = rank // tp, rank % tp
    mine = deal([len(r.tokens) for r in rollouts], dp)[replica]
    batches = pack([rollouts[i] for i in mine], args.batch_tokens)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t0 = time.perf_counter()
    model = load_from_source(cfg, SyntheticSource(cfg, device), where="synthetic", dtype=dtype,
                             head_dtype=head_dtype, device=device, tp_group=group, fuse_pointwise=args.fuse,
                             attention="auto")  # fmt: skip
    if options.chunks is not None:  # TP all-reduces overlapped in this many token chunks (1: off)
        model.tp_overlap_chunks = options.chunks
    if options.sequence is not None:  # sequence parallel in the same chunks (dense models)
        model.tp_sequence_parallel = options.sequence
    if options.reduce is not None:  # how the overlapped layers sum their partials
        model.tp_reduce = options.reduce
    if options.shard is not None:  # the residual stream whole on every rank or sharded in each chunk
        model.tp_shard_residual = options.shard
    sync(device)
    load_s = world_max(time.perf_counter() - t0, device)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    want_routes = cfg.moe is not None
    t0 = time.perf_counter()
    result = run_pass(model, batches, head_dtype, group, want_routes)  # warm-up (and compile)
    sync(device)
    warm_s = world_max(time.perf_counter() - t0, device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        result = run_pass(model, batches, head_dtype, group, want_routes)
        sync(device)
        times.append(world_max(time.perf_counter() - t0, device))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    peak_batch = None
    if args.peak_batch and dtype == "bf16":
        big, total = [], 0
        for r in sorted(rollouts, key=lambda r: -len(r.tokens)):
            if total + len(r.tokens) <= args.peak_batch:
                big.append(r)
                total += len(r.tokens)
        torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
        run_pass(model, pack(big, args.peak_batch), head_dtype, group, False)
        sync(device)
        peak_batch = {"tokens": total, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
                      if device.type == "cuda" else float("nan")}  # fmt: skip
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    lps, routes = {}, {}
    if tp_rank == 0:
        for i, (lp, route) in zip(mine, result, strict=True):
            if i < keep:
                lps[i] = lp.cpu()
                if route is not None:
                    routes[i] = route.cpu()
    gathered = [None] * world
    dist.all_gather_object(gathered, (lps, routes))
    all_lps = {i: v for part, _ in gathered for i, v in part.items()}
    all_routes = {i: v for _, part in gathered for i, v in part.items()}
    n_tokens = sum(len(r.tokens) for r in rollouts)
    flops = model_flops_any(cfg, rollouts)
    median = float(np.median(times))
    row = {
        "name": name, "tp": tp, "dp": dp, "gpus": world, "dtype": dtype, "head_dtype": head_dtype,
        "seconds": times, "tokens": n_tokens, "tokens_per_s": n_tokens / median,
        "tokens_per_s_per_gpu": n_tokens / median / world, "mfu_measured_peak": flops / median / (world * PEAK_MEASURED),
        "load_s": load_s, "warmup_pass_s": warm_s, "weights_gib_per_gpu": weights_gib, "peak_gib_per_gpu": peaks,
        "peak_batch": peak_batch, "attention": model.attention_backend, "experts": model.expert_impl,
        "batch_tokens": args.batch_tokens, "tp_overlap_chunks": model.tp_overlap_chunks,
        "tp_sequence_parallel": model.tp_sequence_parallel, "tp_reduce": model.tp_reduce, "compiled_pointwise": options.compiled, "tp_shard_residual": model.tp_shard_residual, "nccl_max_ctas": options.max_ctas if nccl_options(options.max_ctas) else None,
    }  # fmt: skip
    del model, result
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, all_lps, all_routes


@dataclass(frozen=True)
class TPOptions:
    """A layout's TP options: overlap chunks (None: the model's default), sequence parallel (None: the model's
    default), NCCL's CTA cap for the TP communicator (None: NCCL's own choice), how the overlapped layers sum
    their partials ("nccl" or "peer_copy"; None: the model's default)."""

    chunks: int | None = None
    sequence: bool | None = None
    max_ctas: int | None = None
    reduce: str | None = None
    compiled: bool = False  # the pointwise ops under torch.compile on CUDA too (as before the Triton kernels)
    shard: str | None = None  # model.tp_shard_residual (None: the model's default)

    def suffix(self) -> str:
        return (
            (f"_c{self.chunks}" if self.chunks else "")
            + ({True: "_sp", False: "_nosp"}.get(self.sequence, ""))
            + (f"_m{self.max_ctas}" if self.max_ctas else "")
            + ({"peer_copy": "_peer", "nccl": "_nccl"}.get(self.reduce, ""))
            + ("_compiled" if self.compiled else "")
            + ({"never": "_whole", "always": "_sharded"}.get(self.shard, ""))
        )


def _layout(text: str) -> tuple[int, int, TPOptions]:
    """'2x1' -> (2, 1, defaults); '2x1:c4:s:m8' -> 4 overlap chunks, sequence parallel, NCCL max 8 CTAs;
    ':n' turns sequence parallelism off; ':p' sums the overlapped layers' partials by copy-engine pushes (TP 2),
    ':r' by NCCL all-reduces; ':k' runs the pointwise ops (RMSNorm, RoPE, SwiGLU) under torch.compile on CUDA, as
    before `pgdiag.model.pointwise_triton` (a benchmark-only switch); ':w' keeps the residual stream whole on every
    rank (`dense_overlapped`), ':z' shards it inside each chunk whatever sums the partials (`dense_sharded`)."""
    shape, *options = text.split(":")
    tp, dp = (int(x) for x in shape.split("x"))
    found: dict = {}
    for option in options:
        key, value = option[0], option[1:]
        if key == "c":
            found["chunks"] = int(value)
        elif key in "sn":
            found["sequence"] = key == "s"
        elif key == "m":
            found["max_ctas"] = int(value)
        elif key in "pr" and not value:
            found["reduce"] = "peer_copy" if key == "p" else "nccl"
        elif key == "k" and not value:
            found["compiled"] = True
        elif key in "wz" and not value:
            found["shard"] = "never" if key == "w" else "always"
        else:
            raise SystemExit(f"unknown layout option {option!r} in {text!r}")
    return tp, dp, TPOptions(**found)


@contextmanager
def compiled_pointwise(on: bool) -> Iterator[None]:
    """Inside (`on`): every `FusedOp` runs its reference under torch.compile, CUDA tensors too (the pointwise ops
    as they were before the Triton kernels of `pgdiag.model.pointwise_triton`); a benchmark-only switch."""
    if not on:
        yield
        return
    with patch.object(FusedOp, "__call__", lambda op, *args: op.compiled(*args)):
        yield


def model_flops_any(cfg: ModelConfig, rollouts) -> float:
    """2 x active parameters per token (all of them for a dense model) + causal attention per document."""
    if cfg.moe is None:
        return model_flops(cfg, rollouts)
    dense = 2.0 * cfg.active_params() * sum(len(r.tokens) for r in rollouts)
    attn = sum(2.0 * len(r.tokens) ** 2 * cfg.head_dim * cfg.num_attention_heads for r in rollouts)
    return dense + attn * cfg.num_hidden_layers


def compare(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    common = sorted(set(a) & set(b))
    if not common:
        return {}
    diff = torch.cat([(a[i].double() - b[i].double()).abs() for i in common])
    return {"rollouts": len(common), "tokens": int(diff.numel()), "max_abs": float(diff.max()),
            "mean_abs": float(diff.mean())}  # fmt: skip


def route_disagreement(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    common = sorted(set(a) & set(b))
    if not common:
        return {}
    x = torch.cat([a[i] for i in common]).long()  # (T, L, k)
    y = torch.cat([b[i] for i in common]).long()
    differ = different_sets(x.flatten(0, 1), y.flatten(0, 1)).view(x.shape[0], x.shape[1])  # (T, L)
    per_layer = differ.double().mean(0)
    return {"tokens": int(x.shape[0]), "disagree_frac": float(differ.double().mean()),
            "first_layer": float(per_layer[0]), "last_layer": float(per_layer[-1])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=0, help="cut the model to its first N layers (0: all)")
    parser.add_argument(
        "--layouts",
        default="",
        help="TPxDP[:cN][:s|:n][:mN][:p|:r][:k][:w|:z],... (tp x dp = world; :cN = TP collectives overlapped in N token "
        "chunks, :c1 off; :s sequence parallel, :n not; :mN = NCCL max N CTAs for the TP group; :p partials summed "
        "by copy-engine pushes (TP 2), :r by NCCL all-reduces; :k pointwise ops by torch.compile; :w residual whole on every rank, :z sharded in each chunk); default: "
        "every divisor",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--head-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--bf16-head-too", action="store_true", help="also time the first layout with a bf16 head"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", type=int, default=16, help="rollouts whose log-probs/routes are compared")
    parser.add_argument(
        "--fp32-ref", type=int, default=0, help="TP degree of an fp32-body reference (0: none)"
    )
    parser.add_argument("--fp32-rollouts", type=int, default=8)
    parser.add_argument(
        "--peak-batch", type=int, default=0, help="tokens of one packed batch for peak memory"
    )
    parser.add_argument("--no-fuse", dest="fuse", action="store_false")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hf = MODELS[args.model] | ({"num_hidden_layers": args.layers} if args.layers else {})
    cfg = ModelConfig.from_hf_dict(hf, source=args.model)
    tiny = args.model.startswith("tiny")
    rollouts = make_rollouts(args.rollouts, cfg.vocab_size, device, seed=0, scale=0.05 if tiny else 1.0)
    layouts = [_layout(s) for s in args.layouts.split(",") if s] or [
        (tp, world // tp, TPOptions()) for tp in range(1, world + 1) if world % tp == 0
    ]
    result = {
        "model": args.model, "layers": cfg.num_hidden_layers,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": args.commit,
        "torch": torch.__version__, "non_embedding_params": cfg.non_embedding_params(),
        "active_params": cfg.active_params(), "rollouts": args.rollouts,
        "tokens": sum(len(r.tokens) for r in rollouts),
        "response_tokens": sum(len(r.tokens) - r.prompt_len for r in rollouts), "rows": [], "fp32_ref": None,
    }  # fmt: skip

    def save() -> None:
        if rank == 0 and args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    first_lp = first_routes = None
    bf16_lps: dict[str, dict[int, torch.Tensor]] = {}
    for n, (tp, dp, options) in enumerate(layouts):
        if tp * dp != world:
            raise SystemExit(f"layout {tp}x{dp} does not fill the world of {world}")
        heads = [args.head_dtype] + (
            ["bf16"] if n == 0 and args.bf16_head_too and args.head_dtype != "bf16" else []
        )
        for head in heads:
            name = f"tp{tp}_dp{dp}_head{head}" + options.suffix()
            with compiled_pointwise(options.compiled):
                row, lps, routes = measure_layout(cfg, rollouts, args, tp, dp, device, head_dtype=head,
                                                  keep=args.keep, repeats=args.repeats, name=name,
                                                  options=options)  # fmt: skip
            if head == args.head_dtype:
                if first_lp is None:
                    first_lp, first_routes, row["vs"] = lps, routes, None
                else:
                    row["vs"] = result["rows"][0]["name"]
                    row["logprob_diff_vs_first"] = compare(lps, first_lp)
                    if routes:
                        row["routing_vs_first"] = route_disagreement(routes, first_routes)
                bf16_lps[name] = lps
            result["rows"].append(row)
            if rank == 0:
                shown = {k: v for k, v in row.items() if k not in ("seconds",)}
                print(json.dumps(shown), flush=True)
            save()
    if args.fp32_ref:
        tp = args.fp32_ref
        sub = rollouts[: args.fp32_rollouts]
        saved_keep = args.keep
        row, lps, _ = measure_layout(cfg, sub, args, tp, world // tp, device, dtype="fp32", head_dtype="fp32",
                                     keep=args.fp32_rollouts, repeats=1, name=f"fp32_tp{tp}")  # fmt: skip
        args.keep = saved_keep
        row["bf16_vs_fp32"] = {name: compare(v, lps) for name, v in bf16_lps.items()}
        result["fp32_ref"] = row
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "seconds"}), flush=True)
        save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
