"""MoE recompute on one GPU: pgdiag's trunk (grouped-GEMM experts) + `lm_head_logprobs` vs HF transformers.

What: a Qwen3-30B-A3B-shaped model (hidden 2048, 48 layers, 32 heads, 4 kv heads, head_dim 128, 128 experts of
intermediate 768, top-8 with renormalized weights, vocab 151936, q/k norm) with random bf16 weights made on the
GPU, on rollouts with realistic RL lengths (bench_recompute.py's: prompt 128-512, response lognormal around 800
capped at 3500). Both sides compute the logprob and entropy of every response token.

- HF anchor: transformers ``Qwen3MoeForCausalLM`` as users run it (sdpa attention, its default experts
  implementation, grouped_mm where this torch has it), right-padded batches of 8 rollouts, materialized bf16
  logits, per-sequence fp32 log_softmax + gather + entropy.
- pgdiag: the same weight tensors (HF's fused in-memory experts are presented under the checkpoint's per-expert
  names, `FusedExpertSource`, and stacked once by the loader), rollouts packed into ~32k-token batches, the
  experts as two grouped GEMMs per layer (`pgdiag.model.moe`, tokens sorted by expert once per layer), the LM head
  only at response positions through `lm_head_logprobs`.

Reported per row: real tokens/s, MFU on the active parameters (2 x `ModelConfig.active_params()` x real tokens
+ causal attention 2 x L^2 x head_dim x heads x layers per document, over the measured 790 TFLOP/s bf16 peak),
peak GPU memory (weights included), logprob difference to HF. Then the routing disagreement between the bf16
recompute and an fp32 recompute of the same rollouts (fp32 weights upcast from the same bf16 values): per sparse
layer, the fraction of tokens whose top-8 expert set differs, and the logprob difference the two make.

How to run (one H200: the bf16 model is 57 GiB, its fp32 copy for the routing check 114 GiB, so the fp32 step
runs alone after the bf16 model is freed; writes JSON when --out is given):
    python benchmarks/bench_moe.py --out results.json
    python benchmarks/bench_moe.py --device cpu --tiny          # a smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recompute import (  # the shared rollout, packing, HF and timing helpers
    PEAK_MEASURED,
    hf_pass,
    make_rollouts,
    ours_pass,
    pack,
    reset_peak,
    sync,
    timed,
)

from pgdiag.model import ModelConfig, TensorSource, load_from_source
from pgdiag.model.moe import different_sets

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
TINY = {**QWEN3_30B_A3B, "vocab_size": 1031, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2}  # fmt: skip


class FusedExpertSource(TensorSource):
    """HF's in-memory state dict (experts fused as ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``down_proj``
    (E, H, I)) shown under the checkpoint's per-expert names, as views: nothing is copied until the loader
    stacks a rank's experts."""

    def __init__(self, state: dict[str, torch.Tensor], intermediate: int) -> None:
        views: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            prefix, sep, proj = name.partition("mlp.experts.")
            if not sep:
                views[name] = tensor
                continue
            for e in range(tensor.shape[0]):
                if proj == "gate_up_proj":
                    views[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :intermediate]
                    views[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, intermediate:]
                else:
                    views[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e]
        super().__init__(tensors=views)


def model_flops(cfg: ModelConfig, lengths: list[int]) -> float:
    """Active-parameter FLOPs of one pass: 2 x active params per token + causal attention per document."""
    dense = 2.0 * cfg.active_params() * sum(lengths)
    attn = sum(2.0 * n**2 * cfg.head_dim * cfg.num_attention_heads for n in lengths)
    return dense + attn * cfg.num_hidden_layers


@torch.no_grad()
def routing_of(model, batches) -> list[torch.Tensor]:
    """Per batch: the router's top-k (N, L, k) on the CPU."""
    return [
        model.forward_packed(b.input_ids, b.position_ids, b.cu_seqlens).router_topk.cpu() for b in batches
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny config and short rollouts (smoke test)")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--routing-rollouts", type=int, default=8, help="rollouts of the bf16-vs-fp32 routing check"
    )
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    device = torch.device(args.device)
    raw = TINY if args.tiny else QWEN3_30B_A3B
    cfg = ModelConfig.from_hf_dict(raw, source="bench config")
    rollouts = make_rollouts(args.rollouts, cfg.vocab_size, device, seed=0, scale=0.05 if args.tiny else 1.0)
    lengths = [len(r.tokens) for r in rollouts]
    n_tokens = sum(lengths)
    flops = model_flops(cfg, lengths)
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": args.commit,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "rollouts": len(rollouts), "real_tokens": n_tokens, "active_params": cfg.active_params(),
        "total_non_embedding_params": cfg.non_embedding_params(), "active_flops_per_pass": flops, "rows": [],
    }  # fmt: skip

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    def row(name: str, times: list[float], peak: float, **extra) -> None:
        t = float(np.median(times))
        results["rows"].append({"name": name, "seconds": times, "tokens_per_s": n_tokens / t,
                                "mfu_active": flops / t / PEAK_MEASURED, "peak_gib": peak, **extra})  # fmt: skip
        print(f"{name:52s} {n_tokens / t:9.0f} tok/s  MFU(active) {flops / t / PEAK_MEASURED:6.1%}  "
              f"peak {peak:6.1f} GiB  runs {[round(x, 3) for x in times]} {extra}", flush=True)  # fmt: skip
        save()

    # 1. HF anchor on random weights made on the device (std 0.02, norms 1)
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3MoeForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    experts_impl = getattr(hf.config, "_experts_implementation", None)
    times, hf_out, peak = timed(partial(hf_pass, hf, rollouts, args.hf_batch), device, args.repeats)
    row(f"HF transformers sdpa bf16, padded x{args.hf_batch}", times, peak, experts=str(experts_impl))
    state = dict(hf.state_dict())
    del hf

    # 2. pgdiag on the same tensors. HF's fused expert tensors stay resident (the next variant reads them) but
    #    are not ours: `peak_gib_pgdiag` is the peak minus their bytes, what pgdiag alone holds.
    hf_expert_gib = (
        sum(t.numel() * t.element_size() for n, t in state.items() if ".mlp.experts." in n) / 2**30
    )
    variants = [  # (experts, head dtype, batch tokens)
        ("grouped", "fp32", args.batch_tokens),
        ("grouped", "bf16", args.batch_tokens),
        ("grouped", "fp32", 2 * args.batch_tokens),
        ("loop", "fp32", args.batch_tokens),
    ]
    for experts, head_dtype, budget in variants:
        reset_peak(device)
        batches = pack(rollouts, budget)
        model = load_from_source(cfg, FusedExpertSource(state, cfg.moe.expert_intermediate_size), where="HF state",
                                 dtype="bf16", head_dtype=head_dtype, device=device, fuse_pointwise=device.type == "cuda",
                                 experts=experts)  # fmt: skip
        name = f"pgdiag {model.attention_backend} fused, experts {model.expert_impl}, head {head_dtype}, {budget // 1024}k"
        repeats = args.repeats if experts == "grouped" else 1
        run = partial(ours_pass, model, batches, model.lm_head_weight, head_dtype, "auto")
        try:
            times, out, peak = timed(run, device, repeats)
        except Exception as exc:  # a path that cannot run here is a finding, not the end of the run
            results["rows"].append({"name": name, "error": repr(exc)[:400]})
            print(f"{name}: FAILED {exc!r:.300}", flush=True)
            del model, run
            continue
        ours, impl, mode = out
        diff = torch.cat([(a - b).abs() for a, b in zip(ours, hf_out, strict=True)], dim=1)  # (2, M)
        row(name, times, peak, peak_gib_pgdiag=peak - hf_expert_gib, head_impl=impl, head_mode=mode,
            batches=len(batches), max_abs_dlogp_vs_hf=float(diff[0].max()),
            mean_abs_dlogp_vs_hf=float(diff[0].mean()))  # fmt: skip
        if experts == "grouped" and head_dtype == "fp32" and budget == args.batch_tokens:
            check = pack(rollouts[: args.routing_rollouts], args.batch_tokens)
            bf16_routes = routing_of(model, check)
            bf16_logprobs = ours_pass(model, check, model.lm_head_weight, "fp32", "auto")[0]
        del model, run, out
    del hf_out

    # 3. routing: bf16 vs fp32 recompute (fp32 upcast of the same weights; the bf16 state moves to the host first)
    reset_peak(device)
    state = {k: v.cpu() for k, v in state.items()}
    reset_peak(device)
    fp32 = load_from_source(cfg, FusedExpertSource(state, cfg.moe.expert_intermediate_size), where="HF state",
                            dtype="fp32", head_dtype="fp32", device=device, attention="sdpa", experts="loop")  # fmt: skip
    sync(device)
    t0 = time.perf_counter()
    fp32_routes = routing_of(fp32, check)
    fp32_logprobs = ours_pass(fp32, check, fp32.lm_head_weight, "fp32", "torch")[0]
    sync(device)
    disagree = torch.cat(
        [
            different_sets(a.flatten(0, 1), b.flatten(0, 1)).view(a.shape[:2])
            for a, b in zip(bf16_routes, fp32_routes, strict=True)
        ]
    ).float()  # fmt: skip  (N, L)
    per_layer = disagree.mean(0).tolist()
    dlogp = torch.cat([(a[0] - b[0]).abs() for a, b in zip(bf16_logprobs, fp32_logprobs, strict=True)])
    results["routing_bf16_vs_fp32"] = {
        "tokens": int(disagree.shape[0]), "disagree_frac_mean": float(disagree.mean()),
        "disagree_frac_per_layer": per_layer, "fp32_seconds": time.perf_counter() - t0,
        "max_abs_dlogp": float(dlogp.max()), "mean_abs_dlogp": float(dlogp.mean()),
    }  # fmt: skip
    save()
    print(f"\nrouting bf16 vs fp32 on {disagree.shape[0]} tokens: disagree_frac mean {disagree.mean():.3%}, "
          f"first layer {per_layer[0]:.3%}, last layer {per_layer[-1]:.3%}, max layer {max(per_layer):.3%}; "
          f"|dlogp| max {dlogp.max():.3g} mean {dlogp.mean():.3g}", flush=True)  # fmt: skip
    print("\nsummary:", flush=True)
    hf_tps = results["rows"][0]["tokens_per_s"]
    for r in results["rows"]:
        if "error" in r:
            print(f"  {r['name']}: {r['error'][:160]}")
        else:
            print(f"  {r['name']:52s} {r['tokens_per_s']:8.0f} tok/s ({r['tokens_per_s'] / hf_tps:4.2f}x HF)  "
                  f"MFU(active) {r['mfu_active']:6.1%}  peak {r['peak_gib']:5.1f} GiB "
                  f"(pgdiag alone {r.get('peak_gib_pgdiag', r['peak_gib']):5.1f})  "
                  f"dlogp max {r.get('max_abs_dlogp_vs_hf', 0):.3g} mean {r.get('mean_abs_dlogp_vs_hf', 0):.2g}")  # fmt: skip
    print(f"  real tokens {n_tokens}, active params {cfg.active_params() / 1e9:.2f} B", flush=True)


if __name__ == "__main__":
    main()
