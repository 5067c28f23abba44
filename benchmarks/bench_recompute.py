"""Whole recompute on one GPU: pgdiag's model trunk + `pgdiag.kernels.lm_head_logprobs` vs HF transformers.

What: a Qwen3-8B-shaped model (hidden 4096, 36 layers, 32 heads, 8 kv heads, head_dim 128, intermediate 12288,
vocab 151936, q/k norm) with random bf16 weights created on the GPU, on rollouts with realistic RL lengths
(prompt 128-512 tokens, response lognormal around 800, capped at 3500). Both sides compute the logprob and
entropy of every response token.

- HF anchor (what users run today): transformers ``Qwen3ForCausalLM`` with sdpa attention in bf16, right-padded
  batches of 8 rollouts, materialized bf16 logits, then per sequence fp32 log_softmax + gather + entropy.
- pgdiag: the same weight tensors (shared, not copied) loaded through `load_from_source`, rollouts packed into
  ~32k-token batches (no padding), causal attention per document, the LM head applied only at response
  positions through `lm_head_logprobs` (fp32 head by default, bf16 head as a second row).

Reported per side: real tokens/s (prompt + response tokens, padding excluded), model-FLOPs utilization
(2 x non-embedding parameters x real tokens + causal attention 2 x L^2 x head_dim x heads x layers per
document, over a stated bf16 peak), peak GPU memory (weights included), and the logprob difference between
the two sides on the same tokens.

How to run (one GPU; writes JSON when --out is given):
    python benchmarks/bench_recompute.py --out results.json
    python benchmarks/bench_recompute.py --device cpu --tiny          # a smoke test of the script itself
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from pgdiag.kernels import lm_head_logprobs
from pgdiag.model import ModelConfig, TensorSource, load_from_source

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
TINY = {**QWEN3_8B, "vocab_size": 1031, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
PEAK_MEASURED = 790e12  # bf16 dense matmul rate measured on these H100/H200s on the device machines
PEAK_DATASHEET = 989e12  # H100 SXM dense bf16 datasheet


@dataclass(frozen=True)
class Rollout:
    tokens: torch.Tensor  # (L,) int64 on the device
    prompt_len: int


def make_rollouts(n: int, vocab: int, device: torch.device, seed: int, scale: float) -> list[Rollout]:
    """Prompt uniform in [128, 512], response lognormal with median 800 capped at 3500 (x `scale`)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = max(2, int(rng.integers(128, 513) * scale))
        response = max(1, int(min(3500, max(16, rng.lognormal(math.log(800), 0.7))) * scale))
        ids = torch.from_numpy(rng.integers(0, vocab, prompt + response)).to(device)
        out.append(Rollout(ids, prompt))
    return out


def model_flops(cfg: ModelConfig, rollouts: list[Rollout]) -> float:
    dense = 2.0 * cfg.non_embedding_params() * sum(len(r.tokens) for r in rollouts)
    attn = sum(2.0 * len(r.tokens) ** 2 * cfg.head_dim * cfg.num_attention_heads for r in rollouts)
    return dense + attn * cfg.num_hidden_layers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def hf_pass(hf: torch.nn.Module, rollouts: list[Rollout], batch: int) -> list[torch.Tensor]:
    """Right-padded batches, materialized logits, per-sequence fp32 log_softmax; response logprobs per rollout."""
    device = rollouts[0].tokens.device
    out = []
    for i in range(0, len(rollouts), batch):
        group = rollouts[i : i + batch]
        width = max(len(r.tokens) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64, device=device)
        mask = torch.zeros(len(group), width, dtype=torch.int64, device=device)
        for b, r in enumerate(group):
            ids[b, : len(r.tokens)] = r.tokens
            mask[b, : len(r.tokens)] = 1
        logits = hf(input_ids=ids, attention_mask=mask).logits  # (B, T, V) bf16
        for b, r in enumerate(group):
            rows = logits[b, r.prompt_len - 1 : len(r.tokens) - 1].float().log_softmax(-1)  # (R, V) fp32
            lp = rows.gather(-1, r.tokens[r.prompt_len :, None])[:, 0]
            entropy = -(rows.exp() * rows).sum(-1)
            out.append(torch.stack([lp, entropy]))
        del logits
    return out


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # (N,)
    position_ids: torch.Tensor  # (N,)
    cu_seqlens: torch.Tensor  # (D+1,) int32
    head_positions: torch.Tensor  # (M,) positions whose hidden state predicts a response token
    targets: torch.Tensor  # (M,)
    sizes: tuple[int, ...]  # response tokens per document


def pack(rollouts: list[Rollout], budget: int) -> list[PackedBatch]:
    """Greedy in order: documents are appended until the next one would pass `budget` tokens."""
    batches, current = [], []
    for r in rollouts:
        if current and sum(len(x.tokens) for x in current) + len(r.tokens) > budget:
            batches.append(_packed(current))
            current = []
        current.append(r)
    return [*batches, _packed(current)] if current else batches


def _packed(docs: list[Rollout]) -> PackedBatch:
    device = docs[0].tokens.device
    lengths = [len(r.tokens) for r in docs]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    head = np.concatenate(
        [
            np.arange(s + r.prompt_len - 1, s + len(r.tokens) - 1)
            for s, r in zip(starts[:-1], docs, strict=True)
        ]
    )
    ids = torch.cat([r.tokens for r in docs])
    head_positions = torch.from_numpy(head).to(device)
    return PackedBatch(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n, device=device) for n in lengths]),
        cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
        head_positions=head_positions,
        targets=ids[head_positions + 1],
        sizes=tuple(len(r.tokens) - r.prompt_len for r in docs),
    )


@torch.no_grad()
def ours_pass(model, batches: list[PackedBatch], head_weight: torch.Tensor, head_dtype: str, impl: str):
    out = []
    for b in batches:
        hidden = model.hidden_states(b.input_ids, b.position_ids, b.cu_seqlens)  # (N, H) bf16
        h = hidden[b.head_positions]  # (M, H)
        res = lm_head_logprobs(h.float() if head_dtype == "fp32" else h, head_weight, b.targets,
                               head_dtype=head_dtype, impl=impl)  # fmt: skip
        out.extend(torch.stack([res.logprobs, res.entropy]).split(b.sizes, dim=1))
    return out, res.impl, res.head_mode


def timed(fn, device: torch.device, repeats: int):
    """Run once to warm up, then `repeats` timed runs; returns (seconds per run list, last result, peak GiB)."""
    fn()
    sync(device)
    reset_peak(device)
    times, result = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, result, peak_gib(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny config and short rollouts (smoke test)")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--impl", default="auto", help="lm_head_logprobs impl")
    parser.add_argument("--attention", default="auto", help="pgdiag attention backend")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--check-fp32", action="store_true",
                        help="also run an fp32 body + fp32 head reference on the first HF batch and report each "
                             "side's logprob error against it")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device(args.device)
    raw = TINY if args.tiny else QWEN3_8B
    cfg = ModelConfig.from_hf_dict(raw, source="bench config")
    rollouts = make_rollouts(args.rollouts, cfg.vocab_size, device, seed=0, scale=0.05 if args.tiny else 1.0)
    n_tokens = sum(len(r.tokens) for r in rollouts)
    flops = model_flops(cfg, rollouts)
    widths = [
        max(len(r.tokens) for r in rollouts[i : i + args.hf_batch])
        for i in range(0, len(rollouts), args.hf_batch)
    ]
    padded = sum(w * len(rollouts[i * args.hf_batch : (i + 1) * args.hf_batch]) for i, w in enumerate(widths))
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": args.commit,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "triton": getattr(__import__("triton"), "__version__", "?") if device.type == "cuda" else "-"},
        "rollouts": len(rollouts), "real_tokens": n_tokens, "hf_padding_fraction": 1 - n_tokens / padded,
        "non_embedding_params": cfg.non_embedding_params(), "model_flops_per_pass": flops, "rows": [],
    }  # fmt: skip

    def row(name: str, times: list[float], peak: float, **extra) -> None:
        t = float(np.median(times))
        results["rows"].append({
            "name": name, "seconds": times, "tokens_per_s": n_tokens / t,
            "mfu_measured_peak": flops / t / PEAK_MEASURED, "mfu_datasheet_peak": flops / t / PEAK_DATASHEET,
            "peak_gib": peak, **extra,
        })  # fmt: skip
        print(f"{name:44s} {n_tokens / t:10.0f} tok/s  MFU {flops / t / PEAK_MEASURED:6.1%} (of 790T)  "
              f"peak {peak:6.1f} GiB  runs {[round(x, 3) for x in times]} {extra}", flush=True)  # fmt: skip

    # 1. HF anchor, random weights made on the device (std 0.02, norms 1)
    hf_cfg = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3ForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    times, hf_out, peak = timed(partial(hf_pass, hf, rollouts, args.hf_batch), device, args.repeats)
    row(f"HF transformers sdpa bf16, padded x{args.hf_batch}", times, peak)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    # 2. pgdiag on the same tensors (shared, not copied); the fp32 head is a 2.5 GB copy made per variant
    tensors = dict(hf.state_dict())
    del hf
    batches = pack(rollouts, args.batch_tokens)
    reference = None
    if args.check_fp32:  # fp32 everything (no TF32), SDPA per document: the accuracy yardstick for both sides
        first = rollouts[: args.hf_batch]
        ref_model = load_from_source(cfg, TensorSource(tensors=tensors), where="HF state dict", dtype="fp32",
                                     head_dtype="fp32", device=device, attention="sdpa")  # fmt: skip
        reference = ours_pass(
            ref_model, pack(first, args.batch_tokens), ref_model.lm_head_weight, "fp32", "torch"
        )[0]
        del ref_model
        reset_peak(device)
        hf_err = torch.cat([(a - b).abs() for a, b in zip(hf_out, reference, strict=False)], dim=1)
        results["hf_vs_fp32_reference"] = {"max": float(hf_err[0].max()), "mean": float(hf_err[0].mean())}
        print(
            f"HF bf16 vs fp32 reference: |dlogp| max {hf_err[0].max():.3g} mean {hf_err[0].mean():.3g}",
            flush=True,
        )
    variants = [  # (fuse_pointwise, head_dtype)
        (False, "bf16"),
        (True, "bf16"),
        (True, "fp32"),
    ]
    for fused, head_dtype in variants:
        reset_peak(device)
        model = load_from_source(cfg, TensorSource(tensors=tensors), where="HF state dict", dtype="bf16",
                                 head_dtype=head_dtype, device=device, attention=args.attention,
                                 fuse_pointwise=fused)  # fmt: skip
        name = f"pgdiag {model.attention_backend}{' fused' if fused else ''}, head {head_dtype}"
        for impl in dict.fromkeys([args.impl, "torch"]):
            try:
                run = partial(ours_pass, model, batches, model.lm_head_weight, head_dtype, impl)
                times, out, peak = timed(run, device, args.repeats)
            except Exception as exc:  # a kernel that cannot launch here is a finding, not the end of the run
                results["rows"].append({"name": name, "impl": impl, "error": repr(exc)[:300]})
                print(f"{name} impl={impl}: FAILED {exc!r:.200}", flush=True)
                continue
            ours, ran, mode = out
            diff = torch.cat([(a - b).abs() for a, b in zip(ours, hf_out, strict=True)], dim=1)  # (2, M)
            extra = {}
            if reference is not None:
                err = torch.cat([(a - b).abs() for a, b in zip(ours, reference, strict=False)], dim=1)
                extra = {"max_abs_diff_logprob_vs_fp32": float(err[0].max()),
                         "mean_abs_diff_logprob_vs_fp32": float(err[0].mean())}  # fmt: skip
            row(name, times, peak, impl=ran, head_mode=mode, batches=len(batches),
                max_abs_diff_logprob_vs_hf=float(diff[0].max()), mean_abs_diff_logprob_vs_hf=float(diff[0].mean()),
                max_abs_diff_entropy_vs_hf=float(diff[1].max()), **extra)  # fmt: skip
            break
        del model
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print("\nsummary:", flush=True)
    for r in results["rows"]:
        if "error" in r:
            print(f"  {r['name']} [{r['impl']}]: {r['error'][:120]}")
        else:
            print(f"  {r['name']:40s} {r['tokens_per_s']:8.0f} tok/s  MFU {r['mfu_measured_peak']:6.1%}  "
                  f"peak {r['peak_gib']:5.1f} GiB  {r.get('impl', '')} {r.get('head_mode', '')} "
                  f"dlogp max {r.get('max_abs_diff_logprob_vs_hf', 0):.3g} mean {r.get('mean_abs_diff_logprob_vs_hf', 0):.2g}")  # fmt: skip
    print(f"  real tokens {n_tokens}, HF padding {results['hf_padding_fraction']:.0%}", flush=True)


if __name__ == "__main__":
    main()
