"""Benchmark: the LM head scored over kept sets K against the plain head, and the cost of reconstructing K.

What: on bf16 inputs (T tokens, d = 4096, V = 151936 by default) it times, with `triton.testing.do_bench`:

* ``plain``: `lm_head_logprobs` without K (the Triton head, bf16 and fp32 heads);
* ``kept|K|=N``: the same call with K of N ids per token (N in 1, 16, 64, 2048), scored inside the head (the
  ids packed into per-row bitmask words, then one head pass); the target is ``ratio = kept / plain <= 1.15`` for
  N <= 64 (issue 23). These rows time plain and kept calls in interleaved pairs (`paired`, `--pairs`): the
  ratio is the median of the per-pair ratios;
* ``kept|K|=64 +engine logprobs``: the same with the engine's kept log-probs (the KL over K adds a gather-dot);
* ``bitmask|K|~8192``: K stored as packed bitmasks (a random 8,192 / V of the vocabulary a token, the target
  in), handed to the head packed, as the recompute does, both heads;
* ``reconstruct``: `reconstruct_kept` (vLLM order: top-k 50 + top-p 0.9, top-p 0.95 alone, min-p + top-p;
  SGLang's; the fp32 head; the torch counting pass) beside the plain head; the goal (not a gate) is
  ``(plain + reconstruct) / plain <= 2``. Method: threshold bisection on chunked fp32 logits
  (`pgdiag.kernels.kept_threshold`), no sort of the vocabulary. `--no-reconstruct` leaves these out.

Every row gives median ms, the ratio to the plain head of the same head dtype (measured just before it with
`do_bench`, or paired with it for the kept|K| rows), and peak memory beyond the inputs. Run (CUDA only):

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

import torch
import triton
import triton.testing

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


def paired(plain, kept, pairs: int = 15) -> tuple[float, float, float]:
    """(plain ms, kept ms, kept / plain): medians over `pairs` interleaved pairs, the order swapped every pair,
    each call timed alone with CUDA events after an L2 flush (as `do_bench` does). `do_bench(rep=100)` gives a
    32 ms head only 2-3 repetitions, and timing all of A before all of B lets clock or allocator drift between the
    two blocks enter the ratio; pairing cancels it. The ratio is the median of the per-pair ratios."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for fn in (plain, kept, plain, kept):
        fn()
    times: dict[str, list[float]] = {"plain": [], "kept": []}
    for i in range(pairs):
        order = (("plain", plain), ("kept", kept)) if i % 2 == 0 else (("kept", kept), ("plain", plain))
        for name, fn in order:
            flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop))
    ratios = sorted(k / p for p, k in zip(times["plain"], times["kept"], strict=True))
    return (
        sorted(times["plain"])[pairs // 2],
        sorted(times["kept"])[pairs // 2],
        ratios[pairs // 2],
    )


def peak_extra(fn) -> int:
    """Peak bytes allocated by one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def commit() -> str:
    try:
        here = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def packed_bitmasks(targets: torch.Tensor, size: int, vocab: int, seed: int = 2) -> torch.Tensor:
    """(N, ceil(V / 8)) uint8 little-endian bitmasks on the GPU: each id kept with probability size / V, the
    target always (about `size` ids a token), packed a chunk of 2048 rows at a time."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = targets.shape[0]
    width = -(-vocab // 8)
    out = torch.empty(n, width, dtype=torch.uint8, device="cuda")
    shifts = torch.arange(8, device="cuda", dtype=torch.uint8)
    for start in range(0, n, 2048):
        stop = min(start + 2048, n)
        bits = torch.zeros(stop - start, 8 * width, dtype=torch.uint8, device="cuda")
        bits[:, :vocab] = torch.rand(stop - start, vocab, device="cuda", generator=gen) < size / vocab
        bits[torch.arange(stop - start, device="cuda"), targets[start:stop]] = 1
        out[start:stop] = (bits.view(stop - start, width, 8) << shifts).sum(-1).to(torch.uint8)
    return out


def bitmask_rows(hidden, weight, targets, vocab: int, size: int) -> list[dict]:
    """Every token's K as a packed bitmask (about `size` ids), scored in the head beside the plain head."""
    n = targets.shape[0]
    bits = packed_bitmasks(targets, size, vocab)
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    kept = KeptSet(
        empty,
        torch.zeros(n + 1, dtype=torch.int64, device="cuda"),
        None,
        torch.arange(n, device="cuda"),
        bits,
    )
    mean_size = float(kept_sizes(bits).float().mean())
    rows = []
    for head in ("bf16", "fp32"):
        base_ms, _ = timed(
            lambda head=head: lm_head_logprobs(hidden, weight, targets, head_dtype=head, impl="triton")
        )
        ms, mem = timed(
            lambda head=head: lm_head_logprobs(
                hidden, weight, targets, head_dtype=head, impl="triton", kept=kept
            )
        )
        rows.append(
            {"tokens": n, "head": head, "case": f"bitmask|K|~{size}", "ms": ms, "plain_ms": base_ms,
             "ratio": ms / base_ms, "mean_kept": mean_size, "peak_extra_bytes": mem}
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def kept_sizes(bits: torch.Tensor) -> torch.Tensor:
    """(N,) number of set bits of each packed row."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits[:, :, None] >> shifts) & 1).sum(dim=(1, 2))


RECONSTRUCT_CASES = [  # (label, engine, top_k, top_p, min_p, head, levels impl)
    ("reconstruct:vllm k50 p0.9", "vllm", 50, 0.9, 0.0, "bf16", "auto"),
    ("reconstruct:vllm k50 p0.9", "vllm", 50, 0.9, 0.0, "fp32", "auto"),
    ("reconstruct:vllm k50 p0.9 torch-levels", "vllm", 50, 0.9, 0.0, "bf16", "torch"),
    ("reconstruct:vllm p0.95", "vllm", 0, 0.95, 0.0, "bf16", "auto"),
    ("reconstruct:vllm min_p0.05 p0.9", "vllm", 0, 0.9, 0.05, "bf16", "auto"),
    ("reconstruct:sglang k50 p0.9", "sglang", 50, 0.9, 0.0, "bf16", "auto"),
]


def reconstruct_rows(hidden, weight, targets) -> list[dict]:
    """`reconstruct_kept` (threshold bisection) beside the plain head of the same head dtype; the goal (not a
    gate) is ``(plain + reconstruct) / plain <= 2``. A case that fails is recorded with its error."""
    n_tokens = targets.shape[0]
    out = []
    for label, engine, k, p, m, head, impl in RECONSTRUCT_CASES:
        top_k = torch.full((n_tokens,), k, device="cuda", dtype=torch.int64)
        top_p = torch.full((n_tokens,), p, device="cuda")
        min_p = torch.full((n_tokens,), m, device="cuda")
        row = {"tokens": n_tokens, "head": head, "case": label}
        try:
            base_ms, _ = timed(lambda head=head: lm_head_logprobs(hidden, weight, targets, head_dtype=head))
            ms, mem = timed(
                lambda head=head, engine=engine, impl=impl: reconstruct_kept(
                    hidden, weight, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, engine=engine,
                    head_dtype=head, impl=impl,
                )
            )  # fmt: skip
            kept = reconstruct_kept(
                hidden, weight, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, engine=engine,
                head_dtype=head, impl=impl,
            )  # fmt: skip
            sizes = kept.sizes().float()
            row.update(
                {"ms": ms, "plain_ms": base_ms, "ratio": (base_ms + ms) / base_ms, "peak_extra_bytes": mem,
                 "mean_kept": float(sizes.mean()), "max_kept": float(sizes.max())}
            )  # fmt: skip
        except Exception as error:  # one failing case must not lose the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"[:500]
        out.append(row)
        print(row, flush=True)
    return out


def engine_logprobs_row(hidden, weight, targets, vocab: int, size: int = 64) -> dict:
    """|K| = 64 with the engine's kept log-probs (for the KL over K: the gather-dot of Σ p_e z_e beside the head)."""
    kept = kept_sets(targets, size, vocab)
    gen = torch.Generator(device="cuda").manual_seed(4)
    with_lp = KeptSet(
        kept.ids, kept.offsets, -torch.rand(kept.ids.shape[0], device="cuda", generator=gen) * 5
    )
    base_ms, _ = timed(lambda: lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="triton"))
    ms, mem = timed(
        lambda: lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="triton", kept=with_lp)
    )
    row = {"tokens": targets.shape[0], "head": "bf16", "case": f"kept|K|={size} +engine logprobs", "ms": ms,
           "plain_ms": base_ms, "ratio": ms / base_ms, "peak_extra_bytes": mem}  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 2048])
    parser.add_argument("--bitmask-size", type=int, default=8192)
    parser.add_argument("--no-reconstruct", action="store_true", help="leave out the reconstruct rows")
    parser.add_argument("--pairs", type=int, default=15, help="interleaved plain/kept pairs per kept|K| row")
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

                def with_kept(kept: KeptSet = kept, head: str = head) -> None:
                    lm_head_logprobs(hidden, weight, targets, head_dtype=head, impl="triton", kept=kept)

                base_ms, ms, ratio = paired(plain, with_kept, args.pairs)
                rows.append(
                    {"tokens": n_tokens, "head": head, "case": f"kept|K|={size}", "ms": ms, "plain_ms": base_ms,
                     "ratio": ratio, "timing": f"{args.pairs} interleaved pairs",
                     "peak_extra_bytes": peak_extra(with_kept)}
                )  # fmt: skip
                print(rows[-1], flush=True)
        rows.append(engine_logprobs_row(hidden, weight, targets, args.vocab))
        rows.extend(bitmask_rows(hidden, weight, targets, args.vocab, args.bitmask_size))
        if not args.no_reconstruct:
            rows.extend(reconstruct_rows(hidden, weight, targets))
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
