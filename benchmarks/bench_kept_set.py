"""Benchmark: the LM head scored over kept sets K against the plain head, and the cost of reconstructing K.

What: on bf16 inputs (T tokens, d = 4096, V = 151936 by default) it times, with `triton.testing.do_bench`:

* ``plain``: `lm_head_logprobs` without K (the Triton head, bf16 and fp32 heads);
* ``kept|K|=N``: the same call with K of N ids per token (N in 1, 16, 64, 2048), Triton gather-dot; the target
  is ``ratio = kept / plain <= 1.15`` for N <= 64 (issue 23);
* ``bitmask``: K stored as packed bitmasks (|K| = 8192 per token), expanded to ids on the host
  (`pgdiag.data.kept.bitmask_ids`) and scored; the expansion and the head are timed separately;
* ``reconstruct``: `reconstruct_kept` (vLLM order, top-k 50 + top-p 0.9) beside the plain head; the goal
  (not a gate) is ``(plain + reconstruct) / plain <= 2``. Method: chunked fp32 logits, one torch.sort a row.

Every row gives median ms, the ratio to the plain head measured just before it, and peak memory beyond the
inputs. Run (CUDA only):

    python benchmarks/bench_kept_set.py --tokens 16384 --json $OUT/kept_set.json

The JSON holds the device, date, torch/triton versions and the pgdiag commit, for docs/benchmarks.md.
"""

# ruff: noqa: B023  (every closure is timed at once inside its loop iteration: late binding cannot bite)
from __future__ import annotations

import argparse
import json
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

from pgdiag.data.kept import bitmask_ids, pack_bitmask
from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.kept_reconstruct import reconstruct_kept
from pgdiag.kernels.kept_set import KeptSet


def make_inputs(n_tokens: int, hidden_size: int, vocab: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (3.0 / hidden_size**0.5)
    hot = torch.randperm(vocab, device="cuda", generator=gen)[: vocab // 100]
    weight[hot] *= 2.5
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=gen)
    return hidden.bfloat16(), weight.bfloat16(), targets


def kept_sets(targets: torch.Tensor, size: int, vocab: int, seed: int = 1) -> KeptSet:
    """|K| = size ids per token: the target and size - 1 random others (distinct)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = targets.shape[0]
    others = torch.randint(0, vocab, (n, size), device="cuda", generator=gen)
    others[:, 0] = targets
    ids = torch.sort(others, dim=1).values
    # duplicates do not change the cost of the gather-dot; keep them (the kernel does not require distinct ids)
    offsets = torch.arange(n + 1, device="cuda", dtype=torch.int64) * size
    return KeptSet(ids.reshape(-1).long(), offsets)


def timed(fn) -> tuple[float, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    return float(ms), int(torch.cuda.max_memory_allocated() - base)


def commit() -> str:
    try:
        here = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 2048])
    parser.add_argument("--bitmask-size", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for n_tokens in args.tokens:
        hidden, weight, targets = make_inputs(n_tokens, args.hidden, args.vocab)
        for head in ("bf16", "fp32"):

            def plain(head: str = head) -> None:
                lm_head_logprobs(hidden, weight, targets, head_dtype=head, impl="triton")

            for size in args.sizes:
                kept = kept_sets(targets, size, args.vocab)
                base_ms, _ = timed(plain)
                ms, mem = timed(
                    lambda kept=kept, head=head: lm_head_logprobs(
                        hidden, weight, targets, head_dtype=head, impl="triton", kept=kept
                    )
                )
                rows.append(
                    {"tokens": n_tokens, "head": head, "case": f"kept|K|={size}", "ms": ms, "plain_ms": base_ms,
                     "ratio": ms / base_ms, "peak_extra_bytes": mem}
                )  # fmt: skip
                print(rows[-1], flush=True)
        # bitmask rows: a packed bitmask per token (host side, as read from Parquet), expanded and scored
        n_mask = min(n_tokens, 2048)
        gen = np.random.default_rng(0)
        host_targets = targets[:n_mask].cpu().numpy()
        masks = []
        for t in host_targets.tolist():
            ids = gen.choice(args.vocab, args.bitmask_size, replace=False)
            ids[0] = t
            masks.append(pack_bitmask(ids, args.vocab))
        import time

        start = time.perf_counter()
        expanded = [bitmask_ids(m) for m in masks]
        expand_ms = (time.perf_counter() - start) * 1e3
        sizes = torch.tensor([e.size for e in expanded])
        offsets = torch.zeros(n_mask + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(sizes, 0)
        kept = KeptSet(torch.from_numpy(np.concatenate(expanded)).cuda(), offsets.cuda())
        sub_h, sub_t = hidden[:n_mask], targets[:n_mask]
        base_ms, _ = timed(lambda: lm_head_logprobs(sub_h, weight, sub_t, head_dtype="bf16", impl="triton"))
        ms, mem = timed(
            lambda: lm_head_logprobs(sub_h, weight, sub_t, head_dtype="bf16", impl="triton", kept=kept)
        )
        rows.append(
            {"tokens": n_mask, "head": "bf16", "case": f"bitmask|K|={args.bitmask_size}", "ms": ms,
             "plain_ms": base_ms, "ratio": ms / base_ms, "host_expand_ms": expand_ms, "peak_extra_bytes": mem}
        )  # fmt: skip
        print(rows[-1], flush=True)
        # reconstruct (vLLM order) beside the plain head
        top_k = torch.full((n_tokens,), 50, device="cuda", dtype=torch.int64)
        top_p = torch.full((n_tokens,), 0.9, device="cuda")
        min_p = torch.zeros(n_tokens, device="cuda")
        for head in ("bf16", "fp32"):
            base_ms, _ = timed(lambda head=head: lm_head_logprobs(hidden, weight, targets, head_dtype=head))
            ms, mem = timed(
                lambda head=head: reconstruct_kept(
                    hidden,
                    weight,
                    temperature=1.0,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    engine="vllm",
                    head_dtype=head,
                )
            )
            rows.append(
                {"tokens": n_tokens, "head": head, "case": "reconstruct:vllm", "ms": ms, "plain_ms": base_ms,
                 "ratio": (base_ms + ms) / base_ms, "peak_extra_bytes": mem}
            )  # fmt: skip
            print(rows[-1], flush=True)
    result = {
        "benchmark": "bench_kept_set",
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit(),
        "shape": {"hidden": args.hidden, "vocab": args.vocab},
        "rows": rows,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
