"""Benchmark: per-token logprob + entropy from the LM head, pgdiag against the baselines, side by side.

What: for each (T tokens, d hidden, V vocab) it times, in one process on the same bf16 inputs, the cuBLAS
matmul alone (the floor), naive torch (materialized fp32 logits), chunked torch, Liger FLCE and Cut
Cross-Entropy (both ``reduction="none"``, logprob only), pgdiag's torch reference and pgdiag's Triton kernel
(bf16 head at tau 1.0 and 0.7, fp32 head). Reported: median ms (`triton.testing.do_bench`), TFLOP/s counting
the head matmul only (2 T d V), the ratio to the cuBLAS time, and the peak memory allocated beyond the
inputs. The cuBLAS floor is timed again right before each provider and the ratio uses that paired time, as
the GPU's clocks drift while it heats up. Baselines that are not installed or run out of memory are reported as such.

How: ``python benchmarks/bench_lm_head.py --tokens 16384 65536 --shapes 4096x151936 8192x128256
--json out.json`` (CUDA only). ``--sweep`` also times a few Triton launch shapes at the first size, and
``--sweep-fp32`` the fp32 head's launch shapes and accumulation (time, and error against fp64).
Liger (`liger-kernel`) and CCE (`cut-cross-entropy`) are optional, benchmark-only dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import torch
import triton
import triton.testing

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.lm_head_logprobs_triton import default_tiles, lm_head_partials
from pgdiag.kernels.triton_shared import TritonTiles
from pgdiag.kernels.vocab_parallel import finish_partials, merge_partials

IGNORE = -100
NAIVE_MAX_LOGITS = 16384 * 151936  # naive torch above this would need > 80 GB


@dataclass(frozen=True)
class Inputs:
    hidden: torch.Tensor  # (T, d) bf16
    hidden_fp32: torch.Tensor  # (T, d) fp32, the same values before rounding to bf16
    weight: torch.Tensor  # (V, d) bf16
    targets: torch.Tensor  # (T,) int64, 2% ignored


def make_inputs(n_tokens: int, hidden_size: int, vocab: int, seed: int = 0) -> Inputs:
    """Logits with std ~3 and a max of ~20-30 (1% of W rows scaled by 2.5), never zeros."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, device="cuda", generator=gen)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen) * (3.0 / hidden_size**0.5)
    hot = torch.randperm(vocab, device="cuda", generator=gen)[: vocab // 100]
    weight[hot] *= 2.5
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=gen)
    targets[torch.rand(n_tokens, device="cuda", generator=gen) < 0.02] = IGNORE
    targets[0] = vocab - 1
    return Inputs(hidden.bfloat16(), hidden, weight.bfloat16(), targets)


def naive_torch(x: Inputs, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What users write: fp32 logits, log_softmax, gather, entropy."""
    logits = (x.hidden @ x.weight.T).float() / temperature  # (T, V) fp32
    log_p = torch.log_softmax(logits, dim=-1)
    logprobs = log_p.gather(1, x.targets.clamp(min=0)[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def chunked_torch(x: Inputs, temperature: float, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    outs = [
        naive_torch(
            Inputs(x.hidden[s : s + chunk], x.hidden_fp32, x.weight, x.targets[s : s + chunk]), temperature
        )
        for s in range(0, x.hidden.shape[0], chunk)
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def providers(x: Inputs) -> dict[str, Callable[[], object]]:
    """name -> zero-argument callable running that implementation on `x`."""
    runs: dict[str, Callable[[], object]] = {"cublas_matmul": lambda: x.hidden @ x.weight.T}
    if x.hidden.shape[0] * x.weight.shape[0] <= NAIVE_MAX_LOGITS:
        runs["naive_torch"] = lambda: naive_torch(x, 1.0)
    runs["chunked_torch_4096"] = lambda: chunked_torch(x, 1.0)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="none", ignore_index=IGNORE)
        runs["liger_flce"] = lambda: liger(x.weight, x.hidden, x.targets)
    except ImportError:
        print("liger-kernel not installed: skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy

        runs["cce"] = lambda: linear_cross_entropy(x.hidden, x.weight, x.targets, reduction="none")
    except ImportError:
        print("cut-cross-entropy not installed: skipped")
    runs["pgdiag_torch_ref"] = lambda: lm_head_logprobs(x.hidden, x.weight, x.targets, impl="torch")
    for tau in (1.0, 0.7):
        runs[f"pgdiag_triton_bf16_tau{tau}"] = lambda tau=tau: lm_head_logprobs(
            x.hidden, x.weight, x.targets, temperature=tau, impl="triton"
        )
    for tau in (1.0, 0.7):
        runs[f"pgdiag_triton_fp32head_tau{tau}"] = lambda tau=tau: lm_head_logprobs(
            x.hidden_fp32, x.weight, x.targets, temperature=tau, impl="triton", head_dtype="fp32"
        )
    runs["pgdiag_triton_fp32head_bf16hidden_tau1.0"] = lambda: lm_head_logprobs(
        x.hidden, x.weight, x.targets, impl="triton", head_dtype="fp32"
    )  # the fp32 head of a bf16 trunk (bf16x1: one MMA per K step)
    return runs


def measure(fn: Callable[[], object]) -> dict[str, float | str]:
    """Median ms over do_bench repeats and peak GiB allocated beyond what was allocated before."""
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="median")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"status": "OOM"}
    return {"ms": ms, "peak_gib": peak_gib}


def sweep_tiles(x: Inputs) -> list[dict]:
    """Time the Triton partials kernel (bf16, tau 1) for a few launch shapes and split plans on `x` (the first
    is the default for x's hidden size; "aligned" = L2-aligned groups, see `triton_shared.choose_plan`)."""
    local = torch.where(x.targets == IGNORE, -1, x.targets)
    shapes = [
        default_tiles("bf16", x.hidden.shape[1]),
        TritonTiles(aligned_group_blocks=6),
        TritonTiles(),
        TritonTiles(block_n=128, block_v=256, aligned_group_blocks=12),
        TritonTiles(block_n=128, block_v=256),
        TritonTiles(num_stages=4, aligned_group_blocks=6),
        TritonTiles(block_n=128, block_v=256, use_tma=False, aligned_group_blocks=12),
        TritonTiles(block_n=128, block_v=128, num_warps=4, num_stages=4, programs_per_sm=2),
    ]
    rows = []

    def run_default() -> tuple:
        partials = lm_head_partials(
            x.hidden, x.weight, local, temperature=1.0, head_dtype="bf16", tiles=shapes[0]
        )
        return finish_partials(merge_partials(partials))

    for tiles in shapes:

        def run(tiles: TritonTiles = tiles) -> tuple:
            partials = lm_head_partials(
                x.hidden, x.weight, local, temperature=1.0, head_dtype="bf16", tiles=tiles
            )
            return finish_partials(merge_partials(partials))

        try:
            got = run()
            want = run_default() if rows else got
            gap = max(float((got[i] - want[i]).abs().max()) for i in (0, 1))
            rows.append({"tiles": tiles.__dict__, "max_gap_vs_first": gap, **measure(run)})
        except Exception as err:  # a launch shape that does not compile or fit is reported, not fatal
            rows.append({"tiles": tiles.__dict__, "status": f"{type(err).__name__}: {str(err)[:200]}"})
        print(rows[-1], flush=True)
    return rows


def sweep_fp32_head(x: Inputs, n_check: int = 256) -> list[dict]:
    """fp32-head launch shapes and accumulation schemes: time (with the bf16 kernel's time beside them) and
    max |error| of logprob and entropy against fp64 logits of the same inputs, on the first `n_check` tokens,
    for targets sampled from the fp64 distribution (as in rollouts) and for uniform targets (logprob ~ -45).
    """
    d = x.hidden.shape[1]
    x3 = default_tiles("bf16x3", d)
    x1 = default_tiles("bf16x1", d)
    cases = [  # (label, hidden, weight, tiles)
        ("bf16 head (reference time)", x.hidden, x.weight, default_tiles("bf16", d)),
        ("bf16x3 Triton kernel", x.hidden_fp32, x.weight, replace(x3, gluon=False)),
        ("bf16x3 Gluon default", x.hidden_fp32, x.weight, x3),
        ("bf16x3 Gluon chains 1, groups 4", x.hidden_fp32, x.weight, replace(x3, gluon_fresh_per_group=4)),
        ("bf16x3 Gluon chains 1, groups 16", x.hidden_fp32, x.weight, replace(x3, gluon_fresh_per_group=16)),
        (
            "bf16x3 Gluon chains 2, groups 4",
            x.hidden_fp32,
            x.weight,
            replace(x3, gluon_fresh_steps=2, gluon_fresh_per_group=4),
        ),
        ("bf16x1 Triton kernel (bf16 hidden)", x.hidden, x.weight, replace(x1, gluon=False)),
        ("bf16x1 Gluon default", x.hidden, x.weight, x1),
        (
            "bf16x1 Gluon chains 1, groups 8",
            x.hidden,
            x.weight,
            replace(x1, gluon_fresh_steps=1, gluon_fresh_per_group=8),
        ),
    ]
    local = torch.where(x.targets == IGNORE, -1, x.targets)
    gen = torch.Generator(device="cuda").manual_seed(0)
    references = {}
    rows = []
    for label, hidden, weight, tiles in cases:
        head_dtype = "bf16" if label.startswith("bf16 head") else "fp32"
        key = (hidden.dtype, weight.dtype, head_dtype)
        if key not in references:  # fp64 logits of exactly the operands this head multiplies
            h64 = (hidden[:n_check].bfloat16() if head_dtype == "bf16" else hidden[:n_check]).double()
            log_p = torch.log_softmax(h64 @ weight.double().T, dim=1)  # (n_check, V) fp64
            sampled = torch.multinomial(log_p.exp(), 1, generator=gen)[:, 0]
            uniform = torch.randint(0, weight.shape[0], (n_check,), device="cuda", generator=gen)
            references[key] = {
                kind: (t, log_p.gather(1, t[:, None])[:, 0], -(log_p.exp() * log_p).sum(1))
                for kind, t in (("sampled", sampled), ("uniform", uniform))
            }
            del log_p

        def run(hidden=hidden, weight=weight, tiles=tiles, head_dtype=head_dtype) -> tuple:
            partials = lm_head_partials(
                hidden, weight, local, temperature=1.0, head_dtype=head_dtype, tiles=tiles
            )
            return finish_partials(merge_partials(partials))

        try:
            errors = {}
            for kind, (targets, want_logprobs, want_entropy) in references[key].items():
                check = lm_head_partials(
                    hidden[:n_check], weight, targets, temperature=1.0, head_dtype=head_dtype, tiles=tiles
                )
                logprobs, entropy, _ = finish_partials(merge_partials(check))
                errors[f"max_err_logprobs_{kind}"] = float((logprobs.double() - want_logprobs).abs().max())
                errors[f"mean_err_logprobs_{kind}"] = float((logprobs.double() - want_logprobs).abs().mean())
                errors[f"max_err_entropy_{kind}"] = float((entropy.double() - want_entropy).abs().max())
            rows.append({"label": label, "tiles": tiles.__dict__, **errors, **measure(run)})
        except Exception as err:  # a launch shape that does not compile or fit is reported, not fatal
            rows.append(
                {"label": label, "tiles": tiles.__dict__, "status": f"{type(err).__name__}: {str(err)[:200]}"}
            )
        if "ms" in rows[-1] and "ms" in rows[0]:
            rows[-1]["x_bf16_head"] = rows[-1]["ms"] / rows[0]["ms"]
        print(rows[-1], flush=True)
    return rows


def environment() -> dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--shapes", nargs="+", default=["4096x151936"], help="DxV pairs")
    parser.add_argument("--only", nargs="*", default=None, help="provider names to run (default: all)")
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep Triton launch shapes at the first size"
    )
    parser.add_argument(
        "--sweep-fp32",
        action="store_true",
        help="also sweep the fp32 head's launch shapes and accumulation at the first size",
    )
    parser.add_argument("--json", default=None, help="write all results to this file")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    env = environment()
    print(env, flush=True)
    results: dict[str, object] = {"env": env, "rows": [], "sweep": [], "sweep_fp32": []}
    for n_tokens in args.tokens:
        for shape in args.shapes:
            hidden_size, vocab = (int(v) for v in shape.split("x"))
            x = make_inputs(n_tokens, hidden_size, vocab)
            if args.sweep and not results["sweep"]:
                results["sweep"] = sweep_tiles(x)
            if args.sweep_fp32 and not results["sweep_fp32"]:
                results["sweep_fp32"] = sweep_fp32_head(x)
            tflop = 2 * n_tokens * hidden_size * vocab / 1e12
            runs = providers(x)
            for name, fn in runs.items():
                if args.only and name not in args.only and name != "cublas_matmul":
                    continue
                # the floor is timed again right before each provider: clocks drift as the GPU heats up
                floor = measure(runs["cublas_matmul"]) if name != "cublas_matmul" else None
                row = {"T": n_tokens, "d": hidden_size, "V": vocab, "impl": name, **measure(fn)}
                if "ms" in row:
                    floor_ms = floor["ms"] if floor else row["ms"]
                    row["cublas_ms_paired"] = floor_ms
                    row["tflops"] = tflop / (row["ms"] / 1e3)
                    row["x_cublas"] = row["ms"] / floor_ms
                results["rows"].append(row)
                print(_format(row), flush=True)
            del x
            torch.cuda.empty_cache()
    if args.json:
        write_json_atomic(results, args.json)


def write_json_atomic(obj: object, path: str) -> None:
    """Write `obj` as JSON to `path` through a temporary file in the same folder and an atomic rename."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as fh:
        json.dump(obj, fh, indent=1)
    os.replace(fh.name, path)


def _format(row: dict) -> str:
    head = f"| {row['T']} x {row['d']} x {row['V']} | {row['impl']} |"
    if "ms" not in row:
        return f"{head} {row.get('status')} | | | | |"
    return (
        f"{head} {row['ms']:.2f} | {row['cublas_ms_paired']:.2f} | {row['tflops']:.0f} | {row['x_cublas']:.3f} "
        f"| {row['peak_gib']:.2f} |"
    )


if __name__ == "__main__":
    main()
