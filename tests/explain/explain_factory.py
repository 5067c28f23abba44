"""Tiny checkpoints, sampled rollouts and planted causes for the `pgdiag explain` tests.

`make_checkpoint` saves a random 2-layer Qwen3 (transformers' own class, as tests/recompute does) with a scaled
head, so next-token distributions are peaked like a trained LM's; `perturbed_checkpoint` copies it with every
weight scaled by (1 + eps·N(0, 1)); `sample_rows` samples responses autoregressively from it (pgdiag's own model
in fp32, plain torch, optional temperature and top-p) and `score` computes the log-prob of every loss token
under a chosen body dtype, temperature, top-p renormalisation, or with an extra token inserted at the start of
the response (the chat-template plant). The plants are written as runs with `rollout_factory`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from hf_tiny import save_scaled_qwen3
from rollout_factory import write_rollouts_file

VOCAB = 64


def make_checkpoint(directory: Path, seed: int = 0, head_scale: float = 12.0, layers: int = 2) -> Path:
    """A tiny random Qwen3 saved as safetensors at `directory` (its head scaled by `head_scale`)."""
    save_scaled_qwen3(
        directory,
        seed=seed,
        head_scale=head_scale,
        embed_scale=3.0,
        vocab_size=VOCAB,
        num_hidden_layers=layers,
    )
    return directory


def perturbed_checkpoint(
    source: Path, directory: Path, eps: float, seed: int = 1, only: str | None = None
) -> Path:
    """`source` with every weight w -> w * (1 + eps * N(0, 1)) (only those whose name contains `only`)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(source).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if only is not None and only not in name:
                continue
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.mul_(1.0 + eps * noise)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _logits(model, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 logits of one sequence under pgdiag's model."""
    n = len(ids)
    trunk = model.forward_packed(
        torch.tensor(ids, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        torch.tensor([0, n], dtype=torch.int32),
    )
    return trunk.hidden.float() @ model.lm_head_weight.float().T


def _log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(…, V) log-probs at `temperature`, renormalised over the top-p set (kept when the mass before < p)."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    probs = logp.exp()
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    masked = logp.masked_fill(~keep, -torch.inf)
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def sample_rows(
    checkpoint: Path,
    *,
    steps: int = 3,
    per_step: int = 6,
    response: int = 10,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """Rows with prompts of 3-5 random tokens and `response` sampled tokens (loss on the response)."""
    from pgdiag.model import load_model

    model = load_model(checkpoint, dtype="fp32", head_dtype="fp32", device="cpu")
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(3, 6))).tolist() for _ in range(steps * per_step)]
    sequences = [list(p) for p in prompts]
    with torch.inference_mode():
        for _ in range(response):  # one packed forward over every sequence per sampled position
            lengths = [len(s) for s in sequences]
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
            trunk = model.forward_packed(
                torch.tensor(np.concatenate(sequences), dtype=torch.int64),
                torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]),
                cu,
            )
            last = trunk.hidden[cu[1:].long() - 1].float() @ model.lm_head_weight.float().T  # (S, V)
            probs = _log_probs(last, temperature, top_p).exp()
            picked = torch.multinomial(probs, 1, generator=generator)[:, 0]
            for sequence, token in zip(sequences, picked.tolist(), strict=True):
                sequence.append(int(token))
    rows = []
    for index, (prompt, ids) in enumerate(zip(prompts, sequences, strict=True)):
        step, k = divmod(index, per_step)
        rows.append(
            {
                "step": step,
                "sample_id": f"{step}:{k}",
                "group_id": f"g{step}",
                "input_ids": ids,
                "prompt_len": len(prompt),
                "loss_mask": [t >= len(prompt) for t in range(len(ids))],
            }
        )
    return rows


def score(
    checkpoint: Path,
    rows: list[dict],
    *,
    dtype: str = "fp32",
    temperature: float = 1.0,
    top_p: float = 1.0,
    insert_token: int | None = None,
) -> list[list[float | None]]:
    """Per row, the log-prob of every loss token (None elsewhere) under the given plant."""
    from pgdiag.model import load_model

    model = load_model(checkpoint, dtype=dtype, head_dtype="fp32", device="cpu")
    out = []
    with torch.inference_mode():
        for row in rows:
            ids, start = list(row["input_ids"]), row["prompt_len"]
            shift = 0
            if insert_token is not None:
                ids = [*ids[:start], insert_token, *ids[start:]]
                shift = 1
            logp = _log_probs(_logits(model, ids), temperature, top_p)  # (T', V)
            values: list[float | None] = [None] * len(row["input_ids"])
            for t, on in enumerate(row["loss_mask"]):
                if on:
                    values[t] = float(logp[t - 1 + shift, ids[t + shift]])
            out.append(values)
    return out


def write_plant(
    path: Path,
    rows: list[dict],
    rollout: list[list[float | None]],
    old: list[list[float | None]],
    **meta,
) -> Path:
    """A run directory at `path` holding `rows` with the two planted streams (footer entries from `meta`)."""
    filled = [dict(r, rollout_logprobs=a, old_logprobs=b) for r, a, b in zip(rows, rollout, old, strict=True)]
    import polars as pl

    types = {
        "policy_version": pl.Int64,
        "sampling_kept_ids": pl.List(pl.Int32),
        "sampling_kept_offsets": pl.List(pl.Int32),
    }
    write_rollouts_file(path / "rollouts" / "part-00000.parquet", filled, raw_types=types, **meta)
    return path


def record_kept_sets(checkpoint: Path, rows: list[dict], top_p: float) -> None:
    """Add the top-p kept set of every response position to `rows` in the CSR columns of docs/schema.md
    (``sampling_kept_ids``, ``sampling_kept_offsets``; empty sets on the prompt: not recorded)."""
    from pgdiag.model import load_model

    model = load_model(checkpoint, dtype="fp32", head_dtype="fp32", device="cpu")
    with torch.inference_mode():
        for row in rows:
            logp = _log_probs(_logits(model, row["input_ids"]), 1.0, top_p)  # (T, V), -inf outside the set
            ids, offsets = [], [0]
            for t, on in enumerate(row["loss_mask"]):
                if on:
                    kept = torch.nonzero(torch.isfinite(logp[t - 1]))[:, 0]
                    ids += kept.tolist()
                offsets.append(len(ids))
            row["sampling_kept_ids"] = ids
            row["sampling_kept_offsets"] = offsets


def make_moe_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2-MoE (8 experts, top-2, 2 layers) as tests/recompute/test_routing_replay.py builds it."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        model.lm_head.weight.mul_(5.0)
    model.save_pretrained(directory)
    return directory


def routed(checkpoint: Path, rows: list[dict], flip: float, seed: int = 0) -> list[list[float | None]]:
    """Record routes in `rows` (``routed_experts``, T x L x k flat): the router's own, with a fraction `flip` of
    the tokens of layer 0 sent to two other experts; returns each row's log-probs under those routes (fp32)."""
    from pgdiag.model import load_model

    model = load_model(checkpoint, dtype="fp32", head_dtype="fp32", device="cpu")
    rng = np.random.default_rng(seed)
    out = []
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor(row["input_ids"])
            n = ids.shape[0]
            args = (ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32))
            topk = model.forward_packed(*args).router_topk.clone()  # (T, L, k)
            for t in np.flatnonzero(rng.random(n) < flip):
                free = [e for e in range(8) if e not in topk[t, 0].tolist()]
                topk[t, 0] = torch.tensor(rng.choice(free, 2, replace=False))
            row["routed_experts"] = topk.reshape(-1).tolist()
            hidden = model.forward_packed(*args, replay_experts=topk).hidden.float()
            logp = torch.log_softmax(hidden @ model.lm_head_weight.float().T, dim=-1)
            out.append([float(logp[t - 1, ids[t]]) if on else None for t, on in enumerate(row["loss_mask"])])
    return out
