"""`pgdiag explain` on a Qwen3-8B-shaped model: seconds and tokens/s of each configuration of the recompute matrix.

What: writes a Qwen3-8B-shaped checkpoint (hidden 4096, 36 layers, 32/8 heads, head_dim 128, intermediate
12288, vocab 151936, q/k norm; random bf16 weights, std 0.02, saved as safetensors shards) and a run of RL-shaped
samples (prompt 128-512 tokens, response lognormal around 800, capped at 3500; rollout log-probs random, old =
rollout + N(0, 0.01)), then runs `explain_run` over the whole run (`--tokens` loss tokens) and reports, per
configuration of the matrix (ex_ref fp32/fp32, ex_bf16, ex_bf16_head, ex_fp16, ex_b1 one sequence per forward)
and for the sampling grid (one fp32 forward, 27 temperatures x 9 kept sets from sorted logits): seconds,
tokens/s (prompt + response tokens forwarded) and loss tokens/s; plus the whole call, the peak GPU memory and
the cost line explain printed before running (its estimate against the measurement).

How (one GPU, about 17 GB of disk for the checkpoint; JSON with --out):
    python benchmarks/bench_explain.py --out /tmp/bench_explain.json
    python benchmarks/bench_explain.py --tiny --device cpu           # a smoke test of the script itself
Results go to docs/benchmarks.md with the device, date and commit.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import bench_recompute as recompute_shapes
import numpy as np
import torch

# the shapes of bench_recompute.py, written as bf16 checkpoints here
QWEN3_8B = {**recompute_shapes.QWEN3_8B, "torch_dtype": "bfloat16"}
TINY = {**recompute_shapes.TINY, "torch_dtype": "bfloat16"}


def write_checkpoint(directory: Path, config: dict, device: torch.device, seed: int = 0) -> Path:
    """Random bf16 weights of `config` under HF Qwen3 names, one safetensors shard per layer (plus an index)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator(device=device).manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv, d = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
        config["head_dim"],
    )

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    weight_map: dict[str, str] = {}
    shards = [("model-embed.safetensors", {"model.embed_tokens.weight": rand(v, h)})]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shards.append(
            (
                f"model-layer{i:03d}.safetensors",
                {
                    p + "self_attn.q_proj.weight": rand(q, h),
                    p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h),
                    p + "self_attn.o_proj.weight": rand(h, q),
                    p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                    p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                    p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "mlp.gate_proj.weight": rand(inter, h),
                    p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                },
            )
        )
    # a head scaled up so the next-token distributions are peaked like a trained LM's
    shards.append(
        (
            "model-head.safetensors",
            {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rand(v, h) * 50},
        )
    )
    for name, tensors in shards:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / name))
        weight_map.update({k: name for k in tensors})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def write_run(
    directory: Path, vocab: int, n_samples: int, scale: float, seed: int = 0
) -> tuple[Path, int, int]:
    """RL-shaped samples as a canonical run; returns (path, tokens, loss tokens)."""
    import polars as pl

    from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("step", "sample_id", "group_id", "input_ids", "prompt_len", "loss_mask",
                                             "rollout_logprobs", "old_logprobs")}  # fmt: skip
    tokens = loss = 0
    for i in range(n_samples):
        prompt = max(2, int(rng.integers(128, 513) * scale))
        response = max(2, int(min(3500, max(16, rng.lognormal(math.log(800), 0.7))) * scale))
        n = prompt + response
        lp = -rng.exponential(0.5, response)
        old = np.minimum(lp + rng.normal(0, 0.01, response), 0.0)
        rows["step"].append(i % 4)
        rows["sample_id"].append(f"{i % 4}:{i}")
        rows["group_id"].append(f"g{i % 4}")
        rows["input_ids"].append(rng.integers(0, vocab, n).tolist())
        rows["prompt_len"].append(prompt)
        rows["loss_mask"].append([t >= prompt for t in range(n)])
        rows["rollout_logprobs"].append([None] * prompt + lp.tolist())
        rows["old_logprobs"].append([None] * prompt + old.tolist())
        tokens += n
        loss += response
    frame = pl.DataFrame(rows).with_columns(
        pl.col("rollout_logprobs").cast(pl.List(pl.Float32)), pl.col("old_logprobs").cast(pl.List(pl.Float32))
    )
    write_rollouts(
        frame, directory, label="bench", source=source_meta("bench"),
        streams_meta={"rollout_logprobs": stream_meta("rollout"), "old_logprobs": stream_meta("old")},
    )  # fmt: skip
    return directory, tokens, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000, help="explain's loss-token budget")
    parser.add_argument("--samples", type=int, default=160, help="samples in the run (all within the budget)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short samples (smoke test)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the checkpoint and run go (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from pgdiag.explain.api import explain_run
    from pgdiag.explain.settings import ExplainSettings

    device = torch.device(args.device)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_explain_"))
    config = TINY if args.tiny else QWEN3_8B
    started = time.perf_counter()
    checkpoint = write_checkpoint(work / "ckpt", config, device)
    run, tokens, loss_tokens = write_run(
        work / "run", config["vocab_size"], args.samples, 0.05 if args.tiny else 1.0
    )
    setup_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cost: list[str] = []
    t0 = time.perf_counter()
    result = explain_run(
        run, checkpoint, ExplainSettings(tokens=args.tokens, device=args.device), out=work / "explain",
        overwrite=True, on_cost=cost.append,
    )  # fmt: skip
    total_s = time.perf_counter() - t0
    forwarded = result.n_forwarded  # prompt + response tokens of the samples the budget took
    rows = []
    for name, seconds in result.seconds.items():
        if name in ("select", "total"):
            continue
        rows.append(
            {
                "configuration": name,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(forwarded / seconds) if seconds > 0 else None,
                "loss_tokens_per_s": round(result.n_tokens / seconds) if seconds > 0 else None,
            }
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "Qwen3-8B-shaped (random bf16 weights)",
        "tokens": tokens,  # in the run
        "tokens_forwarded": forwarded,  # of the samples the budget took
        "loss_tokens_in_run": loss_tokens,
        "loss_tokens": result.n_tokens,  # matched loss tokens explain attributed
        "setup_s": round(setup_s, 1),
        "explain_s": round(total_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
        "cost_line": cost[0] if cost else None,
        "skipped": result.skipped,
        "configurations": rows,
        "top_cause": result.top_cause,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
